"""The demo's trainer on a real checkpoint (`rose demo --engine vllm|hf`): GRPO-style REINFORCE on
one-digit addition (rose.rollout.addition_task) through `rose.client.RoseClient`.

    python -m rose.demo.trainer --spec '<TrainerSpec JSON with engine != "reference">'

The policy is the checkpoint as a transformers `AutoModelForCausalLM`, fp32 on CPU (the master
weights). Only the last `train_layers` decoder layers and the final norm are trained; the rest
is frozen, which keeps a step within a CPU core's reach and each delta small. The trainer keeps
`inflight` episodes queued, in groups of `group` samples of one prompt with distinct seeds;
once `groups_per_step` groups are complete it takes one step: advantages normalised within each
group, loss = -mean over action tokens of advantage × log-probability. After each step it
publishes the whole state dict, cast to bf16 and keyed by the checkpoint's tensor names, with
`RoseClient.publish_weights` (the weight stream sends the delta). It reports to Redis what the
toy trainer does (rose.demo.trainer: the per-version records and the status hash), plus a few
decoded sample turns and the task's name.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque

from rose.demo.training import (
    MASTER_DTYPE,
    PUBLISH_DTYPE,
    TrainerSpec,
    record_version,
    version_record,
)
from rose.rollout import addition_task as mt
from rose.rollout.addition_task import trainable as trainable  # the parameters a step updates

SAMPLES_KEPT = 8


def checkpoint_names(checkpoint: str) -> set[str]:
    """The tensor names of the checkpoint's safetensors files."""
    from pathlib import Path

    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names.update(h.keys())
    return names


class HFTrainer:
    def __init__(self, spec: TrainerSpec, cfg, r):
        import torch
        from transformers import AutoModelForCausalLM

        from rose.client import RoseClient

        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        self.spec, self.cfg, self.r = spec, cfg, r
        self.tok = mt.load_tokenizer(spec.checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(spec.checkpoint, dtype=getattr(torch, MASTER_DTYPE))
        self.model.train()
        self.trained, params = mt.trainable_parameters(self.model, spec.train_layers)
        self.n_trained = sum(p.numel() for p in params)
        self.opt = torch.optim.Adam(params, lr=spec.lr)
        self.publish_names = checkpoint_names(spec.checkpoint)
        self.client = RoseClient(cfg, job=spec.job, model=spec.model)
        self.rng = random.Random(spec.seed)
        self.version = 0
        self.submitted = 0
        self.received = 0
        self.groups_submitted = 0
        self.problems: dict[str, mt.Problem] = {}  # group id -> its problem
        self.pending: dict[str, list] = {}  # group id -> trajectories so far
        self.ready: deque[tuple[str, list]] = deque()  # complete groups, oldest first
        self.samples: deque[dict] = deque(maxlen=SAMPLES_KEPT)
        self.stop = False

    # ---- weights -----------------------------------------------------------------------------
    def publish(self, extra: dict) -> None:
        sd = {k: v.detach() for k, v in self.model.state_dict().items() if k in self.publish_names}
        v = self.client.publish_weights(sd, dtype=PUBLISH_DTYPE)
        st = self.client.last_publish
        assert st is not None
        self.version = v
        rec = version_record(v, st, extra)
        record_version(
            self.r,
            self.cfg.redis.key,
            self.spec,
            rec,
            submitted=self.submitted,
            received=self.received,
            checkpoint=self.spec.checkpoint,
            task="one-digit addition: 'What is A + B?' in the chat template; reward 1 if the first "
            "integer of the answer is A + B",
            trained=json.dumps(
                {
                    "parameters": self.n_trained,
                    "of": sum(p.numel() for p in self.model.parameters()),
                    "layers": f"last {self.spec.train_layers} decoder layer(s) + final norm",
                }
            ),
            group=self.spec.group,
            samples=json.dumps(list(self.samples)),
        )

    def answer_text(self, action: list[int]) -> str:
        """The assistant's turn: the action up to its end-of-turn token, decoded."""
        eos = self.tok.eos_token_id
        if eos is not None and eos in action:
            action = action[: action.index(eos)]
        return self.tok.decode(action, skip_special_tokens=True).strip()

    # ---- episodes ----------------------------------------------------------------------------
    def top_up(self) -> None:
        s = self.spec
        while self.submitted - self.received < s.inflight:
            gid = f"g{self.groups_submitted}"
            pb = mt.problem(self.rng)
            ids = mt.prompt_ids(self.tok, pb)
            self.client.submit_many(
                [ids] * s.group,
                max_turns=1,
                tokens_per_turn=s.tokens_per_turn,
                obs_tokens=0,
                seeds=[self.groups_submitted * s.group + j for j in range(s.group)],
                step=self.version,
                task_ids=[f"{gid}-{j}" for j in range(s.group)],
            )
            self.problems[gid] = pb
            self.pending[gid] = []
            self.groups_submitted += 1
            self.submitted += s.group

    def collect(self, timeout_s: float) -> None:
        for t in self.client.results(timeout_s=timeout_s):
            self.received += 1
            gid = t.task_id.rsplit("-", 1)[0]
            if gid not in self.pending:
                continue
            self.pending[gid].append(t)
            if len(self.pending[gid]) >= self.spec.group:
                self.ready.append((gid, self.pending.pop(gid)))

    def step(self) -> dict:
        groups = [self.ready.popleft() for _ in range(min(self.spec.groups_per_step, len(self.ready)))]
        trajs, rewards, adv = [], [], []
        for gid, ts in groups:
            pb = self.problems.pop(gid)
            rs, shown = [], []
            for t in ts:
                text = self.answer_text([x for turn in t.turns for x in turn.action])
                rs.append(mt.reward(text, pb))
                shown.append(
                    {
                        "question": pb.question,
                        "prompt": self.tok.decode(t.prompt),
                        "answer": text,
                        "reward": rs[-1],
                        "version": t.turns[0].version if t.turns else None,
                        "gpu": t.gpu,
                    }
                )
            # two samples of each group for the report: a rewarded one first when there is one
            shown.sort(key=lambda x: -x["reward"])
            self.samples.extend(shown[:2])
            trajs += ts
            rewards += rs
            adv += mt.group_advantages(rs)
        B = len(trajs)
        pad = int(self.tok.pad_token_id if self.tok.pad_token_id is not None else 0)
        t0 = time.perf_counter()
        loss_v = mt.reinforce_step(self.model, self.opt, [(t.tokens, t.action_mask) for t in trajs], adv, pad)
        return {
            "loss": round(loss_v, 5),
            "reward_mean": round(sum(rewards) / B, 4),
            "batch": B,
            "groups": len(groups),
            "staleness": max(0, self.version - min((t.min_version for t in trajs if t.min_version >= 0), default=0)),
            "step_ms": round((time.perf_counter() - t0) * 1000, 2),
            "dedicated_frac": round(sum(1 for t in trajs if t.dedicated) / B, 3),
        }

    def run(self) -> None:
        self.publish({"reward_mean": None, "batch": 0})
        last = 0.0
        try:
            while not self.stop:
                self.top_up()
                self.collect(timeout_s=0.2)
                if len(self.ready) >= self.spec.groups_per_step and time.monotonic() - last >= self.spec.min_step_s:
                    last = time.monotonic()
                    self.publish(self.step())
        finally:
            self.client.close()
