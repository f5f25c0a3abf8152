"""The reference policy and the torch engine: cache correctness, batching, determinism,
and the memory budget that sizes them."""

import pytest
import torch

from rose.rollout.engine import BudgetError, GenRequest, MemoryBudget, TorchEngine
from rose.rollout.policy_model import ModelSpec, PolicyModel, init_state_dict

SPEC = ModelSpec(d_model=64, n_heads=4, d_ff=128, n_layers=2, max_seq=128)
BIG = 1 << 30


def engine(seed=1, max_batch=8, limit=BIG, temperature=1.0):
    e = TorchEngine(SPEC, MemoryBudget(limit, SPEC), max_batch=max_batch, temperature=temperature)
    e.load_weights(0, init_state_dict(SPEC, seed))
    return e


def prompts(n):
    return [list(f"prompt number {i} ".encode()) * (1 + i % 3) for i in range(n)]


def test_param_count_matches_model():
    assert SPEC.param_count() == sum(p.numel() for p in PolicyModel(SPEC).parameters())


def test_kv_cache_decoding_equals_full_recompute():
    torch.manual_seed(0)
    m = PolicyModel(SPEC).eval()
    m.load_state_dict(init_state_dict(SPEC, 3))
    seq = torch.randint(0, 256, (1, 40))
    full = m(seq, m.new_cache(1), torch.tensor([0]), torch.tensor([0]))[0]
    cache = m.new_cache(2)
    slot = torch.tensor([1])
    step = [m(seq[:, :10], cache, slot, torch.tensor([0]))[0]]  # prefill, then one token at a time
    for i in range(10, 40):
        step.append(m(seq[:, i : i + 1], cache, slot, torch.tensor([i]))[0])
    inc = torch.cat(step)
    assert torch.allclose(inc, full, atol=1e-4), (inc - full).abs().max()


def test_batched_equals_unbatched():
    ps = prompts(5)
    alone = []
    for i, p in enumerate(ps):
        e = engine()
        alone.append(e.generate([GenRequest(f"s{i}", p, seed=i)], 20)[0])
    e = engine()
    together = e.generate([GenRequest(f"s{i}", p, seed=i) for i, p in enumerate(ps)], 20)
    assert together == alone


def test_continuous_batching_join_and_leave():
    """Sequences admitted between steps decode exactly as if they had run alone."""
    ps = prompts(4)
    ref = [engine().generate([GenRequest("x", p, seed=7)], 12)[0] for p in ps]
    e = engine()
    got = {i: [] for i in range(4)}
    live = {}
    joins = {0: 0, 3: 1, 5: 2, 9: 3}  # step -> sequence that joins then
    for step in range(30):
        if step in joins:
            i = joins[step]
            live[i] = GenRequest(f"s{i}", ps[i], seed=7)
        reqs = [live[i] for i in sorted(live)]
        if not reqs:
            break
        out = e.generate(reqs, 1)
        for i, toks in zip(sorted(live), out):
            got[i] += toks
            live[i] = GenRequest(f"s{i}")
            if len(got[i]) == 12:  # leaves, freeing its slot
                del live[i]
                e.release(f"s{i}")
    assert [got[i] for i in range(4)] == ref
    assert e.free_slots() == e.n_slots


def test_deterministic_with_seed_and_differs_across_seeds():
    a = engine().generate([GenRequest("a", list(b"hello"), seed=5)], 30)
    b = engine().generate([GenRequest("a", list(b"hello"), seed=5)], 30)
    c = engine().generate([GenRequest("a", list(b"hello"), seed=6)], 30)
    assert a == b
    assert a != c


def test_pause_check_stops_within_one_step():
    e = engine()
    out = e.generate([GenRequest("a", list(b"hi"), seed=1)], 50, pause_check=lambda: e.steps >= 3)
    assert len(out[0]) == 3


def test_pause_between_prefill_chunks_then_resume_loses_nothing():
    b = MemoryBudget(BIG, SPEC)
    small = b.model_bytes + b.min_activation_bytes() + 2 * b.kv_bytes_per_slot + 10
    ref = engine(limit=small).generate(
        [GenRequest("a", list(b"z" * 100), seed=3), GenRequest("b", list(b"q" * 90), seed=4)], 6
    )
    e = engine(limit=small)
    calls = []
    paused = e.generate(
        [GenRequest("a", list(b"z" * 100), seed=3), GenRequest("b", list(b"q" * 90), seed=4)],
        6,
        pause_check=lambda: calls.append(1) or len(calls) == 3,
    )  # inside the prefill
    assert paused == [[], []]
    rest = e.generate([GenRequest("a"), GenRequest("b")], 6)
    assert rest == ref


def test_load_weights_switches_policy_between_steps():
    e = engine(seed=1, temperature=0)
    a = e.generate([GenRequest("a", list(b"same prompt"))], 10)[0]
    e.load_weights(1, init_state_dict(SPEC, 2))
    b = e.generate([GenRequest("b", list(b"same prompt"))], 10)[0]
    assert e.version == 1 and a != b


def test_budget_refuses_when_model_does_not_fit():
    b = MemoryBudget(SPEC.param_count() * 4 - 1, SPEC)
    with pytest.raises(BudgetError, match="mem_bytes"):
        b.slots(8)


def test_budget_shrinks_slots_and_batches():
    b = MemoryBudget(BIG, SPEC)
    small = b.model_bytes + b.min_activation_bytes() + 3 * b.kv_bytes_per_slot + 1000
    tight = MemoryBudget(small, SPEC)
    assert tight.slots(8) == 3 and b.slots(8) == 8
    e = engine(limit=small)
    assert e.n_slots == 3
    out = e.generate([GenRequest(f"s{i}", list(b"x" * 60), seed=i) for i in range(3)], 5)
    assert [len(o) for o in out] == [5, 5, 5]
    free = small - b.model_bytes - 3 * b.kv_bytes_per_slot
    assert e.peak_activation_bytes <= free  # prefill was chunked to stay inside the budget


def test_chunked_prefill_equals_whole_prefill():
    b = MemoryBudget(BIG, SPEC)
    small = b.model_bytes + b.min_activation_bytes() + b.kv_bytes_per_slot + 10
    whole = engine().generate([GenRequest("a", list(b"y" * 100), seed=3)], 8)
    chunked_engine = engine(limit=small)
    assert chunked_engine.budget.max_chunk_for(1, 100) < 100
    assert chunked_engine.generate([GenRequest("a", list(b"y" * 100), seed=3)], 8) == whole


def test_sequence_longer_than_max_seq_is_refused():
    e = engine()
    with pytest.raises(ValueError, match="max_seq"):
        e.generate([GenRequest("a", [1] * (SPEC.max_seq + 1), seed=1)], 1)
