"""The demo's trainer: a closed RL loop on the reference policy.

    python -m rose.demo.trainer --spec '<TrainerSpec JSON>'      (config: $ROSE_CONFIG, ROSE_* env)

It publishes the initial policy as version 1 (a keyframe), keeps `inflight` episodes queued on
the task queue, and whenever at least `batch_min` trajectories have arrived takes one REINFORCE
step on up to `batch_max` of them and publishes the new weights as a delta against the
receivers' view. As RL trainers do, it keeps fp32 master weights, which the optimizer updates,
and publishes them cast to bf16, what the weight stream carries. The toy task rewards lowercase
ASCII action tokens. The forward pass is the reference policy's own, so training and rollout
run the same code. The loop, the loss and what it reports to Redis: docs/demo.md. With
`engine` other than "reference" the trainer is rose.demo.hf_trainer's, on a real checkpoint.
"""

from __future__ import annotations

import sys
import time

from rose.demo.spec_process import spec_main
from rose.demo.training import (
    MASTER_DTYPE,
    PUBLISH_DTYPE,
    TrainerSpec,
    policy_gradient_step,
    record_version,
    version_record,
)

TARGET = frozenset(range(ord("a"), ord("z") + 1))


# ---- pure parts ----------------------------------------------------------------------------
def action_tokens(traj: dict) -> list[int]:
    return [t for turn in traj.get("turns", []) for t in turn.get("action", [])]


def reward(traj: dict) -> float:
    """Fraction of action tokens that are lowercase ASCII letters (0..1)."""
    acts = action_tokens(traj)
    return sum(1 for t in acts if t in TARGET) / len(acts) if acts else 0.0


def sequence_and_mask(traj: dict) -> tuple[list[int], list[bool]]:
    """The episode's tokens (prompt, then per turn action + observation) and which of them the
    policy produced (the action tokens)."""
    toks, mask = list(traj["prompt"]), [False] * len(traj["prompt"])
    for turn in traj["turns"]:
        toks += turn["action"]
        mask += [True] * len(turn["action"])
        obs = turn.get("observation") or []
        toks += obs
        mask += [False] * len(obs)
    return toks, mask


def advantages(rewards: list[float]) -> list[float]:
    """REINFORCE with the batch mean as baseline."""
    if not rewards:
        return []
    m = sum(rewards) / len(rewards)
    return [r - m for r in rewards]


def staleness(trajs: list[dict], version: int) -> int:
    """How many versions behind the trainer the oldest turn of the batch was generated."""
    vs = [v for t in trajs for v in t.get("versions", []) if v is not None and v >= 0]
    return max(0, version - min(vs)) if vs else 0


# ---- the trainer ---------------------------------------------------------------------------
class Trainer:
    def __init__(self, spec: TrainerSpec, cfg, r):
        import torch

        from rose.rollout.policy_model import ModelSpec, PolicyModel, init_state_dict
        from rose.rollout.tasks import TaskQueue
        from rose.weights.clients import weights_client
        from rose.weights.stream import WeightPublisher

        torch.set_num_threads(spec.threads)
        self.spec, self.cfg, self.r = spec, cfg, r
        self.mspec = ModelSpec()
        self.model = PolicyModel(self.mspec).to(getattr(torch, MASTER_DTYPE))  # the master weights
        self.model.load_state_dict(init_state_dict(self.mspec, spec.seed))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=spec.lr)
        self.q = TaskQueue(r, cfg.redis, spec.job)
        self.q.ensure_group()
        # weights on the Redis Cluster of redis.cluster_nodes when set; the task queue stays on `r`
        # (redis.url), its scripts span slots (rose.rollout.worker_process.TASKS_ON_URL)
        wr = weights_client(cfg.redis, r)
        self.pub = WeightPublisher(wr, cfg.redis, spec.model, hmac_key=cfg.security.weights_hmac_key)
        self.version = 0
        self.submitted = 0
        self.received = 0
        self.last_id = "0-0"
        self.buffer: list[dict] = []
        self.stop = False
        # the policy's forward, with autograd; torch types inference_mode() as keeping the
        # function's type, but it wraps it (functools.wraps sets __wrapped__)
        self._forward = type(self.model).forward.__wrapped__  # type: ignore[attr-defined]

    def publish(self, extra: dict) -> None:
        import torch

        sd = {k: v.detach().to(getattr(torch, PUBLISH_DTYPE)) for k, v in self.model.state_dict().items()}
        st = self.pub.publish(sd)
        self.version = st.version
        rec = version_record(st.version, st, extra)
        record_version(self.r, self.cfg.redis.key, self.spec, rec, submitted=self.submitted, received=self.received)

    def top_up(self) -> None:
        import random

        from rose.rollout.episode import Task, ToolLatency

        s = self.spec
        rng = random.Random(s.seed * 7919 + self.submitted)
        while self.submitted - self.received < s.inflight:
            i = self.submitted
            self.q.submit(
                Task(
                    task_id=f"ep-{i}",
                    prompt=[rng.randrange(32, 127) for _ in range(s.prompt_len)],
                    max_turns=s.max_turns,
                    tokens_per_turn=s.tokens_per_turn,
                    obs_tokens=s.obs_tokens,
                    tool=ToolLatency(mu=s.tool_mu, sigma=s.tool_sigma),
                    seed=i,
                    step=self.version,
                )
            )
            self.submitted += 1

    def collect(self, block_ms: int) -> int:
        got = self.q.results(self.last_id, count=500, block_ms=block_ms)
        for eid, traj in got:
            self.last_id = eid
            self.buffer.append(traj)
        self.received += len(got)
        return len(got)

    def step(self) -> dict:
        import torch

        batch, self.buffer = self.buffer[: self.spec.batch_max], self.buffer[self.spec.batch_max :]
        rewards = [reward(t) for t in batch]
        adv = advantages(rewards)
        seqs = [sequence_and_mask(t) for t in batch]
        T = max(len(s) for s, _ in seqs)
        B = len(batch)
        tok = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for i, (s, m) in enumerate(seqs):
            tok[i, : len(s)] = torch.tensor(s)
            mask[i, : len(m)] = torch.tensor(m)
        t0 = time.perf_counter()
        logits = self._forward(
            self.model, tok, self.model.new_cache(B), torch.arange(B), torch.zeros(B, dtype=torch.long)
        )
        loss = policy_gradient_step(self.opt, logits, tok, mask, adv)
        return {
            "loss": round(loss, 5),
            "reward_mean": round(sum(rewards) / B, 4),
            "batch": B,
            "staleness": staleness(batch, self.version),
            "step_ms": round((time.perf_counter() - t0) * 1000, 2),
            "dedicated_frac": round(sum(1 for t in batch if t.get("dedicated")) / B, 3),
        }

    def run(self) -> None:
        self.publish({"reward_mean": None, "batch": 0})
        last = 0.0
        while not self.stop:
            self.top_up()
            self.collect(block_ms=200)
            if len(self.buffer) >= self.spec.batch_min and time.monotonic() - last >= self.spec.min_step_s:
                last = time.monotonic()
                self.publish(self.step())


def make_trainer(spec: TrainerSpec, cfg, r):
    """The toy trainer for the reference policy, rose.demo.hf_trainer's for a real checkpoint."""
    if spec.engine == "reference":
        return Trainer(spec, cfg, r)
    from rose.demo.hf_trainer import HFTrainer

    return HFTrainer(spec, cfg, r)


def main(argv: list[str] | None = None) -> int:
    return spec_main("rose.demo.trainer", TrainerSpec, make_trainer, argv)


if __name__ == "__main__":
    sys.exit(main())
