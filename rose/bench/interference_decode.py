"""The interference profile's model and rollout process (rose.bench.interference_profile): the
bench's model shapes, a random-init Llama-shaped `Decoder` decoding a batch over a growing KV
cache, serving's timed decode steps, and the rollout process (`RolloutProcess`, this module run
with `--rollout SPEC`) that decodes beside serving under a pause flag, its launches bounded when
asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rose.bench._cuda import _Device
from rose.bench.interference import stop_process
from rose.model.random_init import CheckpointShape
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag

ROLLOUT_NICE = 19  # the executor's default worker_nice
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BenchShape:
    """A model size and the batches both sides decode. `step_ms` is the expected serving decode
    step on an H200 (transformers' eager path), used only to size the plan."""

    name: str
    model: CheckpointShape
    step_ms: float
    serving_batch: int = 32
    rollout_batch: int = 64
    prompt: int = 256  # prompt tokens prefilled before decoding
    context: int = 256  # decode steps before a batch is prefilled anew
    steps: int = 500  # serving decode steps per phase
    cuda: bool = True


def _llama(layers: int, hidden: int, heads: int, intermediate: int, vocab: int = 128256, **kw) -> CheckpointShape:
    return CheckpointShape("llama", layers, hidden, heads, intermediate=intermediate, vocab=vocab, **kw)


SHAPES = {
    "tiny": BenchShape(
        "tiny", _llama(2, 64, 4, 128, vocab=256, kv_heads=2), 2.0, 2, 4, prompt=8, context=16, steps=40, cuda=False
    ),
    "1b": BenchShape("1b", _llama(16, 2048, 32, 8192, kv_heads=8), 18.0),  # Llama 3.2 1B
    "8b": BenchShape("8b", _llama(32, 4096, 32, 14336, kv_heads=8, tie_embeddings=False), 34.0),  # Llama 3.1 8B
}


class Decoder:
    """A random-init causal LM decoding a batch over a growing KV cache. `launch` runs one
    forward pass (a prefill chunk or a decode step of a row group) and waits for its result."""

    def __init__(self, shape: BenchShape, dev: _Device, batch: int, seed: int, stream=None):
        import torch
        import transformers

        self.torch, self.dev, self.shape, self.stream = torch, dev, shape, stream
        torch.manual_seed(seed)
        cfg = replace(shape.model, max_positions=shape.prompt + shape.context + 8).config()
        with torch.device(dev.device):
            self.model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dev.dtype).eval()
        dev.barrier()  # weights drawn on the default stream, read on `stream`
        self.batch = batch
        self.groups = [(0, batch)]  # row ranges, one launch each per decode step
        self.chunk = shape.prompt  # prefill tokens per launch
        self.gen = torch.Generator().manual_seed(seed)

    def _ids(self, rows: int, n: int):
        """Random prompt tokens, on the host (`launch` moves them on its stream)."""
        return self.torch.randint(0, self.shape.model.vocab, (rows, n), generator=self.gen)

    def launch(self, ids, cache):
        """One forward pass, synchronised; the next tokens (greedy)."""
        with self.torch.inference_mode(), self.dev.on(self.stream):
            ids = ids.to(self.dev.device)  # host prompt tokens, or the last launch's tokens (a no-op)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
        if self.stream is not None:
            self.dev.sync(self.stream)
        else:
            self.dev.barrier()
        return nxt

    def prefill(self, rows: int, between=None) -> tuple:
        """A fresh cache for `rows` with the prompt in it, `chunk` tokens per launch; `between()`
        is called after each launch (False: stop)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = self._ids(rows, self.shape.prompt)
        nxt = None
        for i in range(0, self.shape.prompt, self.chunk):
            nxt = self.launch(ids[:, i : i + self.chunk], cache)
            if between is not None and not between():
                break
        return cache, nxt


def serving_steps(d: Decoder, n: int) -> list[int]:
    """`n` timed decode steps of the whole batch (ns), prefilled anew every `context` steps."""
    out: list[int] = []
    while len(out) < n:
        cache, nxt = d.prefill(d.batch)
        for _ in range(min(d.shape.context, n - len(out))):
            t0 = time.perf_counter_ns()
            nxt = d.launch(nxt, cache)
            out.append(time.perf_counter_ns() - t0)
    return out


def warm_up(d: Decoder) -> None:
    """One whole batch prefilled and decoded to its full context, untimed: every size of the
    growing KV cache is then in the allocator's cache and every kernel chosen, so that no timed
    phase pays for first allocations (on an H200 they made a first phase of 500 steps several
    times slower than the next, serving's and rollout's alike)."""
    cache, nxt = d.prefill(d.batch)
    for _ in range(d.shape.context):
        nxt = d.launch(nxt, cache)


# ---- the rollout process ------------------------------------------------------------------------


def bound_launches(d: Decoder, max_launch_us: int) -> dict:
    """Size the rollout's launches: halve the rows per decode launch, then the prefill chunk,
    while one launch takes more than `max_launch_us` and halving still shortens it (a launch
    bound by its fixed cost, not its size, stays as it is: `bound_met` says so); what was chosen."""
    limit = max_launch_us / 1e6
    rows, t_rows = _halve(d.batch, lambda r: _time_decode(d, r), limit)
    chunk, t_chunk = _halve(d.shape.prompt, lambda c: _time_prefill(d, c), limit)
    d.groups = [(i, min(i + rows, d.batch)) for i in range(0, d.batch, rows)]
    d.chunk = chunk
    return {
        "rows_per_launch": rows,
        "prefill_chunk": chunk,
        "max_launch_us": max_launch_us,
        "decode_launch_us": round(t_rows * 1e6),
        "prefill_launch_us": round(t_chunk * 1e6),
        "bound_met": max(t_rows, t_chunk) <= limit,
    }


def _halve(n: int, timed, limit: float) -> tuple[int, float]:
    t = timed(n)
    while n > 1 and t > limit:
        half = (n + 1) // 2
        th = timed(half)
        if th > 0.8 * t:  # no longer shorter in proportion: the fixed cost of a launch dominates
            break
        n, t = half, th
    return n, t


def _time_decode(d: Decoder, rows: int) -> float:
    cache, nxt = d.prefill(rows)
    d.launch(nxt, cache)
    t0 = time.perf_counter()
    for _ in range(3):
        nxt = d.launch(nxt, cache)
    return (time.perf_counter() - t0) / 3


def _time_prefill(d: Decoder, chunk: int) -> float:
    from transformers import DynamicCache

    ids = d._ids(1, chunk)
    d.launch(ids, DynamicCache())
    t0 = time.perf_counter()
    d.launch(ids, DynamicCache())
    return time.perf_counter() - t0


class _Duty:
    """The worker's duty cycle on the flag: after `busy_s` of work, idle `busy_s × (1 - share) /
    share`, cut short when the flag leaves RUN; a paused flag holds the process."""

    def __init__(self, flag):
        self.flag = flag

    def after(self, busy_s: float) -> bool:
        """Idle as the share asks; False once the flag says STOP."""
        share = self.flag.share
        until = time.monotonic() + (busy_s * (1.0 - share) / share if 0.0 < share < 1.0 else 0.0)
        while (state := self.flag.get()) != STOP:
            if state == RUN and time.monotonic() >= until:
                return True
            time.sleep(0.0005 if state == RUN else 0.001)
        return False


def rollout_main(spec: dict) -> int:
    """The rollout process: decode episodes until the flag says STOP, counting tokens on the flag."""
    shape = SHAPES[spec["shape"]]
    dev = _Device(spec["device"])
    if not dev.cuda:
        dev.torch.set_num_threads(1)  # one core beside serving, as a CPU worker at a small share
    flag = PauseFlag(spec["flag"])
    d = Decoder(shape, dev, shape.rollout_batch, seed=2, stream=dev.stream("low"))
    warm_up(d)
    sized = bound_launches(d, spec["max_launch_us"]) if spec["bounded"] else {}
    print(json.dumps({"ready": True, **sized}), flush=True)
    duty = _Duty(flag)
    flag.mark_ready()
    try:
        while _episode_batch(d, flag, duty):
            pass
    finally:
        flag.close()
    return 0


def _episode_batch(d: Decoder, flag, duty: _Duty) -> bool:
    """Prefill and decode one batch of episodes, a row group per launch; False on STOP."""
    caches = []
    for lo, hi in d.groups:
        t = time.perf_counter()
        state: dict = {}

        def between(state=state) -> bool:
            ok = duty.after(time.perf_counter() - state.get("t", t))
            state["t"] = time.perf_counter()
            return ok

        caches.append(d.prefill(hi - lo, between))
        if not duty.after(0.0):
            return False
    for _ in range(d.shape.context):
        for i, (lo, hi) in enumerate(d.groups):
            t0 = time.perf_counter()
            cache, nxt = caches[i]
            caches[i] = (cache, d.launch(nxt, cache))
            flag.count_steps(hi - lo)  # tokens decoded
            if not duty.after(time.perf_counter() - t0):
                return False
    return True


class RolloutProcess:
    """A rollout process beside serving, started as the executor starts a worker."""

    def __init__(self, shape: str, device: str, bounded: bool, max_launch_us: int, env: dict | None = None):
        from rose.rollout.launcher import spawn

        self.flag = PauseFlag(f"rose-ifp-{os.getpid()}-{time.monotonic_ns()}", create=True)
        self.flag.set(PAUSE)
        self._closed = False
        spec: dict = {"shape": shape, "device": device, "flag": self.flag.name, "bounded": bounded}
        spec["max_launch_us"] = max_launch_us
        argv = [sys.executable, "-m", __name__, "--rollout", json.dumps(spec)]
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = spawn(argv, nice=ROLLOUT_NICE, stdout=subprocess.PIPE, text=True, env=env)
        self.sized: dict | None = None

    def ready(self) -> RolloutProcess:
        """Wait until the process has built its model (and sized its launches), paused."""
        if self.sized is None:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if not line:
                self.close()
                raise RuntimeError(f"the rollout process exited with code {self.proc.wait()} before it was ready")
            self.sized = {k: v for k, v in json.loads(line).items() if k != "ready"}
        return self

    def run(self, share: float) -> None:
        self.flag.set_share(share)
        self.flag.set(RUN)

    def pause(self) -> None:
        self.flag.set(PAUSE)

    def tokens(self) -> int:
        return self.flag.steps

    def close(self) -> int:
        if not self._closed:
            self._closed = True
            stop_process(self.proc, self.flag, 60.0)
            if self.proc.stdout:
                self.proc.stdout.close()
        return self.proc.returncode


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rollout":
        sys.exit(rollout_main(json.loads(sys.argv[2])))
    print("usage: python -m rose.bench.interference_decode --rollout SPEC (started by the GPU check)", file=sys.stderr)
    sys.exit(2)
