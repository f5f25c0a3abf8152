"""GRPO with TRL's own `GRPOTrainer`, its generation done by ROSE through `rose gateway`. TRL
trains a local copy of the checkpoint (on CPU here); ROSE's rollout workers sample for it. What
the example adds to TRL, all through TRL's supported extension points:

1. `rollout_func` (TRL's generation hook): each prompt's text is tokenized with the
   checkpoint's tokenizer and sent as token ids to `POST /v1/completions`, one request per
   completion with its own seed, one `X-Rose-Session` per group, pinned with
   `min_weight_version` = the last version the trainer published. Every sampled token's version
   (the answer's `weight_versions`) is checked against that pin; the engine's log-probability of
   each sampled token goes back to TRL as `logprobs` (TRL reads them where it needs the sampling
   policy's log-probabilities, e.g. `--off-policy-mask-threshold`).
2. A `TrainerCallback` whose `on_step_end` (after each optimizer step) saves the model and
   publishes it with `POST /v1/weights`: the next step's requests ask for that version. Before
   the first step the checkpoint itself is published, so the rollout policy and TRL's copy
   start equal.
3. A verifiable toy reward on the sampled token ids (examples/grpo_gateway.py's: 1 when more
   than half of the ids are even), as a TRL reward function.

One line per optimizer step (step, mean reward, answers, versions seen in the tokens, workers,
seconds, of which waiting for the completions, version published), then a summary. The gateway
samples at temperature 1.0 and ends each completion at `--max-tokens`.

    rose model init /tmp/tiny-qwen2 --tokenizer    # or any HF checkpoint with a tokenizer
    # rollout workers on it with engine "hf" following the weights, and `rose gateway`, then:
    python examples/trl_grpo.py --gateway http://127.0.0.1:8000 --api-key KEY --model /tmp/tiny-qwen2

The published checkpoints are written under `--out`, a path the gateway must be able to read.
tests/test_example_trl.py runs this file against a real gateway and two hf-engine workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpo_gateway import Rose, reward  # the gateway client and the reward of the example beside this one

# Prompts as text: the trainer's tokenizer turns them into the token ids the gateway takes.
PROMPTS = ["The sky is", "Two and two make", "Once upon a time", "The capital of France is"]


def token_versions(spans: list[dict], n: int) -> list[int]:
    """The weight version of each of `n` tokens, from an answer's `weight_versions` spans."""
    out: list[int] = []
    for sp in spans:
        out += [int(sp["version"])] * (int(sp["end"]) - int(sp["start"]))
    if len(out) != n:
        raise SystemExit(f"weight_versions cover {len(out)} tokens of {n}: {spans}")
    return out


def even_ids_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """TRL's reward-function signature over `reward` of the sampled ids."""
    return [reward(ids) for ids in completion_ids]


class RoseGeneration:
    """TRL's `rollout_func` on ROSE, and what it saw at each step (read by the publishing callback)."""

    def __init__(self, rose: Rose, version: int, args: argparse.Namespace):
        self.rose, self.version, self.args = rose, version, args
        self.pool = ThreadPoolExecutor(max_workers=args.prompts * args.group)
        self.seen: dict[str, Any] = {}

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """One completion per entry of `prompts` (TRL's sampler already repeats each prompt G times)."""
        step, group = trainer.state.global_step, trainer.num_generations
        tok = trainer.processing_class
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        t0 = time.monotonic()
        futures = [
            self.pool.submit(
                self.rose.sample,
                ids,
                self.args.seed + 1000 * step + i,
                f"step{step}-p{i // group}",
                self.version,
                self.args.max_tokens,
                logprobs=True,
            )
            for i, ids in enumerate(prompt_ids)
        ]
        answers = [f.result() for f in futures]
        versions = {v for a in answers for v in token_versions(a["spans"], len(a["ids"]))}
        if min(versions) < self.version:
            raise SystemExit(f"step {step}: tokens from versions {sorted(versions)}, pinned to {self.version} or newer")
        if any(len(a["logprobs"]) != len(a["ids"]) for a in answers):
            raise SystemExit(f"step {step}: the gateway returned no log-probabilities for some sampled tokens")
        self.seen = {
            "reward": statistics.fmean(reward(a["ids"]) for a in answers),
            "answers": len(answers),
            "versions": sorted(versions),
            "workers": sorted({a["worker"] for a in answers}),
            "rollout_s": time.monotonic() - t0,
            "t0": t0,
        }
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [a["ids"] for a in answers],
            "logprobs": [a["logprobs"] for a in answers],
        }


def publishing_callback(rose: Rose, gen: RoseGeneration, out: Path, dtype: str | None, stop_at: float) -> Any:
    """A TrainerCallback that publishes the model after each optimizer step, prints the step's line
    and ends training once the clock passes `stop_at` (monotonic seconds; 0 = never)."""
    from transformers import TrainerCallback

    class PublishEachStep(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            step = state.global_step - 1  # the step just taken
            path = out / f"step-{step}"
            model.save_pretrained(path)
            gen.version = rose.publish(path, dtype=dtype)
            s = gen.seen
            print(
                f"step {step}  reward {s['reward']:.3f}  answers {s['answers']}  versions {s['versions']}"
                f"  workers [{', '.join(s['workers'])}]  {time.monotonic() - s['t0']:.2f}s"
                f" (rollout {s['rollout_s']:.2f}s)  published {gen.version}",
                flush=True,
            )
            if stop_at and time.monotonic() >= stop_at:
                control.should_training_stop = True  # the wall-time budget (--max-minutes) is spent

    return PublishEachStep()


def trl_without_vllm() -> None:
    """Tell TRL that vLLM is absent before it is imported: where vLLM is installed (here for ROSE's
    workers) TRL imports it for a generation backend of its own, and that import takes longer
    than a short run; the trainer here generates nothing itself (`use_vllm` stays off)."""
    import trl.import_utils as trl_imports  # (the `as` form: trl is a lazy module without the attribute)

    trl_imports.is_vllm_available = lambda min_version=None: False


def stored_dtype(model: str) -> str | None:
    """The dtype the checkpoint stores its weights in (what the workers hold), as the gateway names it."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(model), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's URL (without /v1)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="a gateway.api_keys token")
    ap.add_argument("--model", required=True, help="the HF checkpoint (with a tokenizer) the workers were started on")
    ap.add_argument("--served-model", default=None, help="the gateway's model name (default: the first of /v1/models)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="end after the step that passes this wall time since the start (default 0: run every step)",
    )
    ap.add_argument("--group", type=int, default=4, help="completions per prompt, G (default 4)")
    ap.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1), help="prompts per step")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per completion (default 8)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="the trainer's seed and the first sampling seed (default 0)")
    ap.add_argument(
        "--off-policy-mask-threshold",
        type=float,
        default=None,
        help="TRL's off-policy sequence mask, computed from the engine's log-probabilities (default: off)",
    )
    ap.add_argument("--out", default=None, help="where the published checkpoints go (default: a new temp dir)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL: said above
    out = Path(args.out or tempfile.mkdtemp(prefix="trl-grpo-")).resolve()  # the gateway reads it
    out.mkdir(parents=True, exist_ok=True)
    rose = Rose(args.gateway.rstrip("/") + "/v1", args.api_key, args.served_model)
    # the checkpoint as it is: exactly the weights TRL's copy starts from
    version = rose.publish(Path(args.model))
    print(f"model {rose.model}: the checkpoint's weights published as version {version}", flush=True)

    trl_without_vllm()
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    gen = RoseGeneration(rose, version, args)
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group,  # one generation batch per optimizer step
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        beta=0.0,  # no reference model
        off_policy_mask_threshold=args.off_policy_mask_threshold,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32},
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=even_ids_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * args.steps}),
        rollout_func=gen,
    )
    stop_at = t_start + 60 * args.max_minutes if args.max_minutes > 0 else 0.0
    trainer.add_callback(publishing_callback(rose, gen, out, stored_dtype(args.model), stop_at))
    trainer.train()
    gen.pool.shutdown()
    at = ", ".join(f"{w} {v}" for w, v in sorted(rose.workers(gen.version).items()))
    print(
        f"done: {trainer.state.global_step} optimizer steps of TRL's GRPOTrainer, last published {gen.version}, "
        f"worker versions: {at}, {time.monotonic() - t_start:.1f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
