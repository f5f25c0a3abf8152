"""What the demo's two trainers share (rose.demo.trainer's on the reference policy,
rose.demo.hf_trainer's on a real checkpoint): the spec they start from, the dtypes of the master
and the published weights, the REINFORCE step (rose.rollout.addition_task's) and the record a
published version leaves."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rose.demo.spec_process import JsonSpec

# the step both trainers take, below the demo so that `rose bench learning` takes it too
from rose.rollout.addition_task import PUBLISH_DTYPE as PUBLISH_DTYPE
from rose.rollout.addition_task import policy_gradient_step as policy_gradient_step

MASTER_DTYPE = "float32"  # what the optimizer updates


@dataclass(frozen=True)
class TrainerSpec(JsonSpec):
    job: str = "demo"
    model: str = "policy"  # the weight stream name (rose:weights:{model}), = executor.model
    seed: int = 1
    lr: float = 3e-3  # Adam on the toy task; far above large-model RL rates (rose bench weights)
    batch_min: int = 8
    batch_max: int = 32
    min_step_s: float = 1.0  # at most one optimizer step per this many seconds (bounds the trainer's CPU)
    inflight: int = 48  # episodes queued or running at most
    prompt_len: int = 8
    max_turns: int = 3
    tokens_per_turn: int = 16
    obs_tokens: int = 8
    tool_mu: float = -1.4  # lognormal tool-call latency: median e^-1.4 ≈ 0.25 s
    tool_sigma: float = 0.5
    threads: int = 1
    status_key: str = "demo:trainer"
    versions_key: str = "demo:versions"
    # the policy: "reference" (rose.demo.trainer's toy model) or a real checkpoint's engine (vllm | hf),
    # trained by rose.demo.hf_trainer on one-digit addition
    engine: str = "reference"
    checkpoint: str = ""  # the Hugging Face checkpoint directory (engine != reference)
    group: int = 4  # samples per prompt (distinct seeds); advantages are normalised within a group
    groups_per_step: int = 2  # complete groups per optimizer step
    train_layers: int = 1  # the last N decoder layers (and the final norm) are trained, the rest frozen


def version_record(version: int, st, extra: dict) -> dict:
    """What the report keeps of a published version: its publish stats (`WeightPublisher`'s)."""
    return {
        "version": version,
        "keyframe": st.keyframe,
        "bytes_sent": st.bytes_sent,
        "bytes_full": st.bytes_full,
        "changed_elements": st.changed_elements,
        "encode_ms": round(st.encode_s * 1000, 3),
        "send_ms": round(st.send_s * 1000, 3),
        "ts": time.time(),
        **extra,
    }


def record_version(r: Any, key: Callable[[str], str], spec: TrainerSpec, rec: dict, **status: Any) -> None:
    """Append a published version's record (`version_record`) to the run's versions list and set
    the trainer's status hash: the version, its record as `last`, the learning rate and dtypes,
    and the trainer's own `status` fields (its counts, what it trains)."""
    p = r.pipeline(transaction=False)
    p.rpush(key(spec.versions_key), json.dumps(rec))
    fields = {"version": rec["version"], **status, "last": json.dumps(rec), "lr": spec.lr}
    p.hset(key(spec.status_key), mapping={**fields, "master_dtype": MASTER_DTYPE, "publish_dtype": PUBLISH_DTYPE})
    p.execute()
