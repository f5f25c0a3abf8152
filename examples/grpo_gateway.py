"""GRPO against `rose gateway`, speaking to ROSE only over HTTP: the official `openai` client for
rollouts, `POST /v1/weights` (httpx) to publish each new policy, `GET /v1/weights` to see where
the rollout workers stand. What it shows, step by step:

1. For each prompt (token ids: the tiny checkpoint has no tokenizer), a group of G completions
   with distinct seeds and one `X-Rose-Session` per group (its turns stay on one worker), asking
   for `min_weight_version` = the version the trainer holds, so every sampled token comes from
   that policy (each choice's `weight_versions` says so; the loop checks it).
2. A verifiable toy reward from the returned `token_ids` alone: 1 when more than half of the
   sampled ids are even, else 0 (deterministic and checkable from the ids).
3. Group-normalised advantages: (reward - group mean) / (group std + 1e-4); a group whose
   rewards are all equal teaches nothing (advantages 0).
4. One policy-gradient step with torch on a local transformers copy of the checkpoint: loss =
   -mean over samples of advantage x mean log-probability of its sampled tokens, on the returned
   `token_ids`. Only the output embedding is trained (`lm_head`, tied to the input embedding in
   the tiny Qwen2 checkpoint, so `model.embed_tokens.weight`); everything else is frozen.
5. The trained tensor saved as safetensors and published with `POST /v1/weights` (the gateway
   reads the file, so it must be on a path the gateway can see); the next step asks for the new
   version. Before step 0 the checkpoint directory itself is published (as stored), so the
   rollout policy and the local copy agree from the first step; the local copy loads on a thread
   of its own while step 0's completions run.

One line per step (step, mean reward, answers per group, versions seen in `weight_versions`,
workers, seconds, of which waiting for the completions, version published), then a summary.

    rose model init /tmp/tiny-qwen2          # a random-init checkpoint (vocab 1024)
    # rollout workers on it with engine "hf" following the weights, and `rose gateway`, then:
    python examples/grpo_gateway.py --base-url http://127.0.0.1:8000/v1 --api-key KEY \\
        --checkpoint /tmp/tiny-qwen2

docs/frameworks.md has a run's output and what other RL frameworks need to do the same;
tests/test_example_grpo.py runs this file against a real gateway and two hf-engine workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

# Prompts as token ids (below the tiny checkpoint's vocabulary of 1024).
PROMPTS = [[17, 256, 3, 88, 401, 9], [512, 42, 7, 1000, 64], [5, 6, 7, 8], [900, 31, 2, 77, 15, 300, 11]]


def reward(ids: list[int]) -> float:
    """1.0 when more than half of the sampled token ids are even, else 0.0."""
    return 1.0 if 2 * sum(1 for t in ids if t % 2 == 0) > len(ids) else 0.0


def advantages(rewards: list[float]) -> list[float]:
    """GRPO's group-normalised advantages."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-4) for r in rewards]


class Policy:
    """The trainer's local copy of the checkpoint; only the output embedding is trained. Built on
    a thread of its own while the first rollouts run (importing torch and transformers is most
    of a tiny run's time on a CPU)."""

    def __init__(self, checkpoint: str, lr: float, seed: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
        head = self.model.get_output_embeddings().weight
        # the parameter's checkpoint name (a tied lm_head is named as the input embedding)
        self.name = next(n for n, p in self.model.named_parameters() if p is head)
        for p in self.model.parameters():
            p.requires_grad_(p is head)
        self.param = head
        self.opt = torch.optim.Adam([head], lr=lr)

    def step(self, prompt: list[int], samples: list[list[int]], adv: list[float]) -> float:
        """Accumulate one group's policy-gradient loss (samples of one prompt share its length)."""
        import torch

        ids = torch.tensor([prompt + s for s in samples])
        logits = self.model(ids).logits[:, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt) :, None]).squeeze(-1)
        loss = -(torch.tensor(adv) * logp.mean(-1)).mean()
        loss.backward()
        return loss.item()

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file

        save_file({self.name: self.param.detach().contiguous()}, str(path))
        return path


class Rose:
    """The gateway, as the trainer sees it: completions through `openai`, weights over HTTP."""

    def __init__(self, base_url: str, api_key: str, model: str | None):
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=120)
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=120)
        self.model = model or self.client.models.list().data[0].id

    def sample(
        self, prompt: list[int], seed: int, session: str, version: int, max_tokens: int, logprobs: bool = False
    ) -> dict:
        """One completion served at `version` or newer; with `logprobs`, the engine's log-probability
        of each sampled token too (`logprobs`)."""
        r = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=1 if logprobs else None,
            extra_headers={"X-Rose-Session": session},
            extra_body={"min_weight_version": version},
        )
        ch = r.choices[0]
        out = {"ids": list(ch.token_ids), "spans": list(ch.weight_versions), "worker": ch.worker}  # type: ignore[attr-defined]
        if logprobs:
            out["logprobs"] = list(ch.logprobs.token_logprobs) if ch.logprobs else []
        return out

    def publish(self, checkpoint: Path, dtype: str | None = None) -> int:
        """POST /v1/weights: the gateway reads `checkpoint` and publishes it; the new version."""
        r = self.http.post("/weights", json={"checkpoint": str(checkpoint.resolve()), "dtype": dtype})
        if r.status_code != 200:
            sys.exit(f"POST /v1/weights {checkpoint}: {r.status_code} {r.text}")
        return int(r.json()["version"])

    def workers(self, version: int, wait_s: float = 10.0) -> dict[str, int]:
        """Each worker's applied version (GET /v1/weights), once all are at `version` or after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            at = {d["worker"]: d["version"] for d in self.http.get("/weights").json()["data"]}
            if (at and min(at.values()) >= version) or time.monotonic() >= deadline:
                return at
            time.sleep(0.1)


def run_step(rose: Rose, loading: Future, pool: ThreadPoolExecutor, step: int, version: int, args: Any) -> dict:
    """One GRPO step on the policy at `version`: sample, score, update, and what was seen."""
    prompts = PROMPTS[: args.prompts]
    t0 = time.monotonic()
    futures = [
        [
            pool.submit(
                rose.sample, p, args.seed + 1000 * step + 100 * i + g, f"step{step}-p{i}", version, args.max_tokens
            )
            for g in range(args.group)
        ]
        for i, p in enumerate(prompts)
    ]
    groups = [[f.result() for f in fs] for fs in futures]
    rollout_s = time.monotonic() - t0
    versions = {sp["version"] for grp in groups for a in grp for sp in a["spans"]}
    if versions != {version}:
        sys.exit(f"step {step}: tokens from versions {sorted(versions)}, expected only {version}")
    rewards = []
    policy: Policy = loading.result()
    for prompt, grp in zip(prompts, groups):
        rs = [reward(a["ids"]) for a in grp]
        rewards += rs
        policy.step(prompt, [a["ids"] for a in grp], advantages(rs))
    policy.update()
    return {
        "reward": statistics.fmean(rewards),
        "answers": [len(grp) for grp in groups],
        "versions": sorted(versions),
        "workers": sorted({a["worker"] for grp in groups for a in grp}),
        "rollout_s": rollout_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's /v1 URL")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="a gateway.api_keys token")
    ap.add_argument("--model", default=None, help="the served model (default: the first of GET /v1/models)")
    ap.add_argument("--checkpoint", required=True, help="the HF checkpoint directory the workers were started on")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt, G (default 4)")
    ap.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1), help="prompts per step")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per completion (default 8)")
    ap.add_argument("--lr", type=float, default=0.05, help="Adam's learning rate (default 0.05)")
    ap.add_argument("--seed", type=int, default=0, help="the first sampling seed (default 0)")
    ap.add_argument("--out", default=None, help="where the published safetensors go (default: a new temp dir)")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo-gateway-")).resolve()  # the gateway reads it
    out.mkdir(parents=True, exist_ok=True)
    loader = ThreadPoolExecutor(max_workers=1)
    loading = loader.submit(Policy, args.checkpoint, args.lr, args.seed)
    rose = Rose(args.base_url, args.api_key, args.model)
    # the checkpoint as it is: exactly the weights the local copy starts from
    version = rose.publish(Path(args.checkpoint))
    print(f"model {rose.model}: the checkpoint's weights published as version {version}", flush=True)
    rewards = []
    with ThreadPoolExecutor(max_workers=args.prompts * args.group) as pool:
        for step in range(args.steps):
            t0 = time.monotonic()
            seen = run_step(rose, loading, pool, step, version, args)
            policy: Policy = loading.result()
            version = rose.publish(policy.save(out / f"step-{step}.safetensors"), dtype="float32")
            rewards.append(seen["reward"])
            print(
                f"step {step}  reward {seen['reward']:.3f}  answers {seen['answers']}  versions {seen['versions']}"
                f"  workers [{', '.join(seen['workers'])}]  {time.monotonic() - t0:.2f}s (rollout {seen['rollout_s']:.2f}s)"
                f"  published {version}",
                flush=True,
            )
    at = ", ".join(f"{w} {v}" for w, v in sorted(rose.workers(version).items()))
    print(
        f"done: {args.steps} steps training {loading.result().name}, mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, last published {version}, "
        f"worker versions: {at}, {time.monotonic() - t_start:.1f}s",
        flush=True,
    )
    loader.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
