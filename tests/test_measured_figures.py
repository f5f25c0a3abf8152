"""Every figure the README and docs/ state as measured comes from a file under docs/measured.

A pure file check, no stack: each `docs/measured/...` reference in README.md and docs/*.md
names a file that exists; every row of the bench table (docs/status.md) names at least one; and each
figure listed in `FIGURES` is found in its document as written and equals its file's value at
the rounding the document uses. Planted bugs it catches: a figure edited in a document without
its file (or a file re-measured without the document), a link to a file that was never
committed, a bench row with no file."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
REF = re.compile(r"(?:docs/)?measured/[A-Za-z0-9_./{},*-]*[A-Za-z0-9_}*]")
NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"

# (document, text around the figure with {} where the number stands, file, key path, scale):
# the document's number equals the file's value × scale at the document's decimals.
CPU, H200 = "docs/measured/cpu/", "docs/measured/h200/"
RUN_A, RUN_B, RUN_C, RUN_D = (CPU + f"demo-vllm-run-{x}.json" for x in "abcd")
FIGURES: list[tuple[str, str, str, str, float]] = [
    # replica leases through the real router
    ("docs/executor.md", "drain p50 {} s, p99", CPU + "bench-replica.json", "drain_s.p50", 1),
    ("docs/executor.md", "s, p99 {} s; reclaim", CPU + "bench-replica.json", "drain_s.p99", 1),
    ("docs/executor.md", "reclaim to serving p50 {} s, p99", CPU + "bench-replica.json", "reclaim_to_serving_s.p50", 1),
    ("docs/executor.md", "0.3722 s, p99 {} s; serving", CPU + "bench-replica.json", "reclaim_to_serving_s.p99", 1),
    (
        "docs/executor.md",
        "worker {} tokens/s against",
        CPU + "bench-replica.json",
        "rollout_tokens_per_s.lent_replica",
        1,
    ),
    (
        "docs/executor.md",
        "tokens/s against {} for",
        CPU + "bench-replica.json",
        "rollout_tokens_per_s.dedicated_same_device",
        1,
    ),
    ("docs/executor.md", "one, {} of it (goal 0.8", CPU + "bench-replica.json", "lent_over_dedicated_tokens_per_s", 1),
    ("docs/executor.md", "{} failed requests of 1520", CPU + "bench-replica.json", "failed_requests", 1),
    ("docs/executor.md", "load average {} at the start", CPU + "bench-replica.json", "provenance.load_average.1m", 1),
    (
        "docs/status.md",
        "lent worker {} of a dedicated one",
        CPU + "bench-replica.json",
        "lent_over_dedicated_tokens_per_s",
        1,
    ),
    # the demo task's starting reward on SmolLM2
    ("docs/demo.md", "starts at {} [0.1467", CPU + "task-reward-smollm2.json", "variants.one-digit.mean_reward", 1),
    ("docs/demo.md", "starts at 0.2188 [{},", CPU + "task-reward-smollm2.json", "variants.one-digit.ci95.0", 1),
    ("docs/demo.md", "[0.1467, {}] on one-digit", CPU + "task-reward-smollm2.json", "variants.one-digit.ci95.1", 1),
    (
        "docs/demo.md",
        "with {} of the groups mixed",
        CPU + "task-reward-smollm2.json",
        "variants.one-digit.groups_with_variance",
        1,
    ),
    ("docs/demo.md", "against {} on the", CPU + "task-reward-smollm2.json", "variants.two-digit.mean_reward", 1),
    (
        "docs/demo.md",
        "where {} of the groups differ",
        CPU + "task-reward-smollm2.json",
        "variants.two-digit.groups_with_variance",
        1,
    ),
    (
        "docs/status.md",
        "one-digit addition {} [0.1467",
        CPU + "task-reward-smollm2.json",
        "variants.one-digit.mean_reward",
        1,
    ),
    # vLLM decode tokens/s by dtype and threads on the AVX2 machine
    ("docs/engines.md", "float32 {} tokens/s on 1 thread", CPU + "bench-decode.json", "cells.0.tokens_per_s", 1),
    ("docs/engines.md", "tokens/s on 1 thread and {} on 2", CPU + "bench-decode.json", "cells.1.tokens_per_s", 1),
    ("docs/engines.md", "bfloat16 {} and 46.8", CPU + "bench-decode.json", "cells.2.tokens_per_s", 1),
    ("docs/engines.md", "bfloat16 45.2 and {};", CPU + "bench-decode.json", "cells.3.tokens_per_s", 1),
    ("docs/status.md", "float32 {} tokens/s on 1 thread, 112.7", CPU + "bench-decode.json", "cells.0.tokens_per_s", 1),
    ("docs/status.md", "load average {} ([bench-decode", CPU + "bench-decode.json", "provenance.load_average.1m", 1),
    # TRL's GRPOTrainer over ROSE on SmolLM2, 10 minutes
    ("docs/status.md", "load average {} ([trl", CPU + "trl-smollm2.json", "provenance.load_average.1m", 1),
    ("docs/status.md", "{} optimizer steps in 606 s", CPU + "trl-smollm2.json", "optimizer_steps", 1),
    ("docs/status.md", "optimizer steps in {} s, 13.8", CPU + "trl-smollm2.json", "wall_s", 1),
    ("docs/frameworks.md", "**Wall time:** {} s for", CPU + "trl-smollm2.json", "wall_s", 1),
    ("docs/frameworks.md", "606 s for {} optimizer steps", CPU + "trl-smollm2.json", "optimizer_steps", 1),
    ("docs/frameworks.md", "optimizer steps, {} s a step", CPU + "trl-smollm2.json", "seconds_per_step.mean", 1),
    ("docs/frameworks.md", "completions {} s (0.59", CPU + "trl-smollm2.json", "rollout_seconds_per_step.mean", 1),
    ("docs/frameworks.md", "first third's mean\n  {} (", CPU + "trl-smollm2.json", "reward_first_third.mean", 1),
    # gateway / direct turns/s, three runs
    (
        "docs/status.md",
        "gateway/direct turns/s {},",
        CPU + "bench-gateway-rounds.json",
        "runs.0.turns_per_s_ratio_gateway_over_direct",
        1,
    ),
    (
        "docs/status.md",
        "turns/s 1.13, {},",
        CPU + "bench-gateway-rounds.json",
        "runs.1.turns_per_s_ratio_gateway_over_direct",
        1,
    ),
    (
        "docs/status.md",
        "turns/s 1.13, 1.14, {} (goal",
        CPU + "bench-gateway-rounds.json",
        "runs.2.turns_per_s_ratio_gateway_over_direct",
        1,
    ),
    # co-elasticity on vLLM and transformers
    (
        "docs/status.md",
        "vLLM warm first token p50 {} ms",
        CPU + "coelastic-vllm.json",
        "grant_to_first_token_ms.warm.p50_ms",
        1,
    ),
    (
        "docs/status.md",
        "vLLM warm first token p50 41 ms, p99 {} ms",
        CPU + "coelastic-vllm.json",
        "grant_to_first_token_ms.warm.p99_ms",
        1,
    ),
    ("docs/status.md", "vs cold p50 {} s", CPU + "coelastic-vllm.json", "grant_to_first_token_ms.cold.p50_ms", 1e-3),
    (
        "docs/status.md",
        "vLLM resume → first token p50 {} ms",
        CPU + "coelastic-vllm.json",
        "resume_to_first_token_ms.p50_ms",
        1,
    ),
    (
        "docs/status.md",
        "vLLM resume → first token p50 31 ms, p99 {} ms",
        CPU + "coelastic-vllm.json",
        "resume_to_first_token_ms.p99_ms",
        1,
    ),
    (
        "docs/status.md",
        "hf warm first token p50 {} ms",
        CPU + "coelastic-hf.json",
        "grant_to_first_token_ms.warm.p50_ms",
        1,
    ),
    (
        "docs/status.md",
        "hf warm first token p50 106 ms, p99 {} ms",
        CPU + "coelastic-hf.json",
        "grant_to_first_token_ms.warm.p99_ms",
        1,
    ),
    # the one Kafka-cluster run with a file
    (
        "docs/status.md",
        "leader death → next committed decision p50 {} s",
        CPU + "kafka-cluster-faults.json",
        "leader_death_to_next_committed_decision_s.p50",
        1,
    ),
    (
        "docs/status.md",
        "committed decision p50 10.2 s, max {} s",
        CPU + "kafka-cluster-faults.json",
        "leader_death_to_next_committed_decision_s.max",
        1,
    ),
    (
        "docs/status.md",
        "SIGSTOPped until fenced: {} s",
        CPU + "kafka-cluster-faults.json",
        "sigstop_to_next_committed_decision_s.0",
        1,
    ),
    # revoke and agent, re-measured with their provenance
    (
        "docs/status.md",
        "paused p50 {} ms, p99 236 ms via Kafka",
        CPU + "bench-revoke.json",
        "kafka_worker_paused_ms.p50_ms",
        1,
    ),
    (
        "docs/status.md",
        "paused p50 8.9 ms, p99 {} ms via Kafka",
        CPU + "bench-revoke.json",
        "kafka_worker_paused_ms.p99_ms",
        1,
    ),
    ("docs/status.md", "via the guard p50 {} ms", CPU + "bench-revoke.json", "guard_worker_paused_ms.p50_ms", 1),
    (
        "docs/status.md",
        "via the guard p50 3.4 ms, p99 {} ms",
        CPU + "bench-revoke.json",
        "guard_worker_paused_ms.p99_ms",
        1,
    ),
    ("docs/status.md", "`revoked` p50 {} ms", CPU + "bench-revoke.json", "kafka_revoked_published_ms.p50_ms", 1),
    (
        "docs/status.md",
        "`revoked` p50 396 ms, p99 {} ms",
        CPU + "bench-revoke.json",
        "kafka_revoked_published_ms.p99_ms",
        1,
    ),
    ("docs/status.md", "load average from {} to", CPU + "bench-revoke.json", "provenance.load_average.1m", 1),
    (
        "docs/status.md",
        "load average from 2.6 to {}",
        CPU + "bench-revoke.json",
        "provenance.load_average_at_end.1m",
        1,
    ),
    (
        "docs/status.md",
        "load average {} ([bench-agent.json]",
        CPU + "bench-agent.json",
        "provenance.load_average.1m",
        1,
    ),
    ("docs/status.md", "{}k acknowledged ev/s", CPU + "bench-agent.json", "events_per_s", 1e-3),
    ("docs/status.md", "acknowledged ev/s (goal 50k), {} dropped", CPU + "bench-agent.json", "dropped", 1),
    (
        "docs/status.md",
        "the real path (parse a vLLM page, window, build the records) {} µs",
        CPU + "bench-agent.json",
        "real_path_cpu_us_per_event",
        1,
    ),
    # the scheduler
    (
        "docs/status.md",
        "load average 13.7 rising to {}",
        CPU + "bench-scheduler.json",
        "provenance.load_average_at_end.1m",
        1,
    ),
    ("docs/status.md", "load average {} rising to 17.6", CPU + "bench-scheduler.json", "provenance.load_average.1m", 1),
    ("docs/status.md", "bench-scheduler.json)): {} ev/s", CPU + "bench-scheduler.json", "scheduler_events_per_s", 1),
    ("docs/status.md", "ev/s, {}× raw consume+decode", CPU + "bench-scheduler.json", "scheduler_vs_raw_ratio", 1),
    (
        "docs/status.md",
        "raw consume+decode of {} (goals",
        CPU + "bench-scheduler.json",
        "raw_consume_decode_events_per_s",
        1,
    ),
    ("docs/status.md", "the policy alone ran {} ev/s", CPU + "bench-scheduler.json", "policy_alone_events_per_s", 1),
    (
        "docs/status.md",
        "decision latency at 5k ev/s p50 {} ms",
        CPU + "bench-scheduler.json",
        "decision_latency.p50_ms",
        1,
    ),
    (
        "docs/status.md",
        "decision latency at 5k ev/s p50 3021 ms, p99 {} ms",
        CPU + "bench-scheduler.json",
        "decision_latency.p99_ms",
        1,
    ),
    (
        "docs/status.md",
        "scale-out ×{} with 2 instances",
        CPU + "bench-scheduler.json",
        "scale_out.instances.2.speedup_vs_1",
        1,
    ),
    (
        "docs/status.md",
        "with 2 instances, ×{} with 4",
        CPU + "bench-scheduler.json",
        "scale_out.instances.4.speedup_vs_1",
        1,
    ),
    ("docs/scheduler.md", "Throughput:** {} events/s", CPU + "bench-scheduler.json", "scheduler_events_per_s", 1),
    (
        "docs/scheduler.md",
        "at p99 waiting to be consumed took {} ms",
        CPU + "bench-scheduler.json",
        "decision_latency.parts_ms.until_consumed.p99",
        1,
    ),
    (
        "docs/scheduler.md",
        "processing {} ms and the commit",
        CPU + "bench-scheduler.json",
        "decision_latency.parts_ms.processing.p99",
        1,
    ),
    (
        "docs/scheduler.md",
        "and the commit {} ms",
        CPU + "bench-scheduler.json",
        "decision_latency.parts_ms.commit.p99",
        1,
    ),
    ("docs/scheduler.md", "a traced command cost {} µs", CPU + "bench-scheduler.json", "traced_command_us", 1),
    (
        "docs/scheduler.md",
        "instances): {}, 5998 and",
        CPU + "bench-scheduler.json",
        "scale_out.instances.1.events_per_s",
        1,
    ),
    ("docs/scheduler.md", "Renews are most commands ({} of", CPU + "bench-scheduler.json", "commands_by_kind.renew", 1),
    ("docs/scheduler.md", "Renews are most commands (28910 of {} in", CPU + "bench-scheduler.json", "commands", 1),
    # weights: a synthetic update (Adam on noise gradients)
    (
        "docs/status.md",
        "load average {} from other work ([bench-weights.json]",
        CPU + "bench-weights.json",
        "provenance.load_average.1m",
        1,
    ),
    (
        "docs/status.md",
        "{} bytes ratio at lr 1e-6 on that synthetic update",
        CPU + "bench-weights.json",
        "bytes_ratio_by_lr.1e-06.bytes_ratio",
        1,
    ),
    (
        "docs/status.md",
        "(goal ≤ 0.01; {} at 1e-7",
        CPU + "bench-weights.json",
        "bytes_ratio_by_lr.1e-07.bytes_ratio",
        1,
    ),
    ("docs/status.md", "at 1e-7, {} at 1e-5)", CPU + "bench-weights.json", "bytes_ratio_by_lr.1e-05.bytes_ratio", 1),
    ("docs/status.md", "encode {}× memcpy on 2 threads", CPU + "bench-weights.json", "encode_over_memcpy", 1),
    ("docs/status.md", "apply {}× the memcpy timed beside it", CPU + "bench-weights.json", "apply_over_memcpy", 1),
    ("docs/status.md", "({} GB/s apply;", CPU + "bench-weights.json", "apply_gb_per_s", 1),
    ("docs/status.md", "patch {} s in-process", CPU + "bench-weights.json", "patch_s", 1),
    ("docs/status.md", "(goal 1.5 s), {} s as a fresh process", CPU + "bench-weights.json", "patch_cli_s", 1),
    (
        "docs/status.md",
        "Weight encoding runs at {}× memcpy on 2 threads",
        CPU + "bench-weights.json",
        "encode_over_memcpy",
        1,
    ),
    (
        "docs/weights.md",
        "| encode, 2 threads | {}× memcpy (1 thread:",
        CPU + "bench-weights.json",
        "encode_over_memcpy",
        1,
    ),
    (
        "docs/weights.md",
        "memcpy (1 thread: {}×) | 0.5×: not met",
        CPU + "bench-weights.json",
        "encode_1_worker_over_memcpy",
        1,
    ),
    ("docs/weights.md", "| apply, 2 threads | {}× the memcpy", CPU + "bench-weights.json", "apply_over_memcpy", 1),
    ("docs/weights.md", "beside it (1 thread: {}×)", CPU + "bench-weights.json", "apply_1_worker_over_memcpy", 1),
    (
        "docs/weights.md",
        "| memcpy itself | {} GB/s on 2 threads beside encode",
        CPU + "bench-weights.json",
        "memcpy_gb_per_s",
        1,
    ),
    ("docs/weights.md", "(apply itself: {} GB/s)", CPU + "bench-weights.json", "apply_gb_per_s", 1),
    (
        "docs/weights.md",
        "comparing the two buffers' words ran at {}× memcpy",
        CPU + "bench-weights.json",
        "stages_over_memcpy.compare_words",
        1,
    ),
    ("docs/weights.md", "(`flatnonzero`) at {}×", CPU + "bench-weights.json", "stages_over_memcpy.extract_indices", 1),
    ("docs/weights.md", "bring the whole scan to {}×", CPU + "bench-weights.json", "stages_over_memcpy.scan", 1),
    (
        "docs/weights.md",
        "coding the changed elements adds a pass at {}×",
        CPU + "bench-weights.json",
        "stages_over_memcpy.code_changed",
        1,
    ),
    (
        "docs/weights.md",
        "decoding ran at {}× and the",
        CPU + "bench-weights.json",
        "stages_over_memcpy.decode_changed",
        1,
    ),
    ("docs/weights.md", "checksum at {}× on one thread", CPU + "bench-weights.json", "stages_over_memcpy.checksum", 1),
    ("docs/weights.md", "the function took a median {} s of 3", CPU + "bench-weights.json", "patch_s", 1),
    ("docs/weights.md", "(load {}, apply", CPU + "bench-weights.json", "patch_stages_s.load_s", 1),
    ("docs/weights.md", "0.16, apply {}, write", CPU + "bench-weights.json", "patch_stages_s.apply_s", 1),
    ("docs/weights.md", "write {} s); a fresh process", CPU + "bench-weights.json", "patch_stages_s.save_s", 1),
    ("docs/weights.md", "a fresh process spent {} s of CPU", CPU + "bench-weights.json", "patch_cli_cpu_s", 1),
    ("docs/weights.md", "and took a median {} s, waiting", CPU + "bench-weights.json", "patch_cli_s", 1),
    (
        "docs/weights.md",
        "(100M params, lr 1e-6, the 2-core machine at load average {} from",
        CPU + "bench-weights.json",
        "provenance.load_average.1m",
        1,
    ),
    # the toy demo, under load (docs/status.md)
    (
        "docs/status.md",
        "| episodes/min, mean [95 % CI] | {} [",
        CPU + "demo-reference.json",
        "throughput.by_kind.dedicated_only.mean",
        1,
    ),
    (
        "docs/status.md",
        "| episodes/min, mean [95 % CI] | 154.03 [{},",
        CPU + "demo-reference.json",
        "throughput.by_kind.dedicated_only.ci95.0",
        1,
    ),
    (
        "docs/status.md",
        "| episodes/min, mean [95 % CI] | 154.03 [121.12, {}]",
        CPU + "demo-reference.json",
        "throughput.by_kind.dedicated_only.ci95.1",
        1,
    ),
    ("docs/status.md", "186.93] | {} [", CPU + "demo-reference.json", "throughput.by_kind.with_leases.mean", 1),
    (
        "docs/status.md",
        "186.93] | 156.39 [{},",
        CPU + "demo-reference.json",
        "throughput.by_kind.with_leases.ci95.0",
        1,
    ),
    (
        "docs/status.md",
        "186.93] | 156.39 [80.79, {}] |",
        CPU + "demo-reference.json",
        "throughput.by_kind.with_leases.ci95.1",
        1,
    ),
    (
        "docs/status.md",
        "dedicated / leased workers | 154.03 / {} |",
        CPU + "demo-reference.json",
        "throughput.by_kind.dedicated_only.by_leased",
        1,
    ),
    (
        "docs/status.md",
        "dedicated / leased workers | 154.03 / 0.0 | {} /",
        CPU + "demo-reference.json",
        "throughput.by_kind.with_leases.by_dedicated",
        1,
    ),
    ("docs/status.md", "| 151.04 / {} |", CPU + "demo-reference.json", "throughput.by_kind.with_leases.by_leased", 1),
    (
        "docs/status.md",
        "`real/0` SLO attainment | {} |",
        CPU + "demo-reference.json",
        "measured_device.slo_attainment_by_window.dedicated_only",
        1,
    ),
    (
        "docs/status.md",
        "`real/0` SLO attainment | 0.0 | {} |",
        CPU + "demo-reference.json",
        "measured_device.slo_attainment_by_window.with_leases",
        1,
    ),
    (
        "docs/status.md",
        "rollout, core-s | {} / 77.44",
        CPU + "demo-reference.json",
        "measured_device.core.dedicated_only.idle_s",
        1,
    ),
    (
        "docs/status.md",
        "rollout, core-s | 0.0 / {} / 12.87",
        CPU + "demo-reference.json",
        "measured_device.core.dedicated_only.serving_s",
        1,
    ),
    (
        "docs/status.md",
        "/ 77.44 / {} |",
        CPU + "demo-reference.json",
        "measured_device.core.dedicated_only.rollout_s",
        1,
    ),
    ("docs/status.md", "12.87 | {} / 73.82", CPU + "demo-reference.json", "measured_device.core.with_leases.idle_s", 1),
    (
        "docs/status.md",
        "12.87 | 0.0 / {} / 15.88",
        CPU + "demo-reference.json",
        "measured_device.core.with_leases.serving_s",
        1,
    ),
    ("docs/status.md", "/ 73.82 / {} |", CPU + "demo-reference.json", "measured_device.core.with_leases.rollout_s", 1),
    # runs of `make demo` on SmolLM2 (README.md and docs/demo.md "Two runs")
    (
        "README.md",
        "inter-token p99 against the 100 ms SLO | {} ms |",
        RUN_C,
        "measured_device.serving_load.solo_tpot_p99_ms",
        1,
    ),
    ("README.md", "SLO | 109.7 ms | {} ms |", RUN_D, "measured_device.serving_load.solo_tpot_p99_ms", 1),
    ("README.md", "(no lease on it) | {} /", RUN_C, "measured_device.slo_attainment_by_window.dedicated_only", 1),
    ("README.md", "(no lease on it) | 0.8222 / {} |", RUN_C, "measured_device.slo_attainment_by_window.with_leases", 1),
    ("README.md", "| 0.8222 / 0.1278 | {} /", RUN_D, "measured_device.slo_attainment_by_window.dedicated_only", 1),
    ("README.md", "| 0.8222 / 0.1278 | 0.5 / {} |", RUN_D, "measured_device.slo_attainment_by_window.with_leases", 1),
    ("README.md", "episodes/min, leases off / on | {} /", RUN_C, "episodes_per_min.dedicated_only", 1),
    ("README.md", "episodes/min, leases off / on | 15.96 / {} |", RUN_C, "episodes_per_min.with_leases", 1),
    ("README.md", "| 15.96 / 10.69 | {} /", RUN_D, "episodes_per_min.dedicated_only", 1),
    ("README.md", "| 15.96 / 10.69 | 5.32 / {} |", RUN_D, "episodes_per_min.with_leases", 1),
    ("README.md", "training steps in the run | {} |", RUN_C, "learning.steps", 1),
    ("README.md", "training steps in the run | 4 | {} |", RUN_D, "learning.steps", 1),
    ("README.md", "same setting, {} s and", RUN_C, "make_demo_wall_s", 1),
    ("README.md", "s and {} s of `make demo`", RUN_D, "make_demo_wall_s", 1),
    ("docs/status.md", "inter-token\np99 {} and", RUN_C, "measured_device.serving_load.solo_tpot_p99_ms", 1),
    ("docs/demo.md", "| `make demo`, s | {} |", RUN_A, "make_demo_wall_s", 1),
    ("docs/demo.md", "| `make demo`, s | 351 | {} |", RUN_B, "make_demo_wall_s", 1),
    ("docs/demo.md", "| `make demo`, s | 351 | 339 | {} |", RUN_C, "make_demo_wall_s", 1),
    ("docs/demo.md", "| `make demo`, s | 351 | 339 | 373 | {} |", RUN_D, "make_demo_wall_s", 1),
    ("docs/demo.md", "(SLO 100) | {} |", RUN_A, "measured_device.serving_load.solo_tpot_p99_ms", 1),
    ("docs/demo.md", "(SLO 100) | 144.913 | {} |", RUN_B, "measured_device.serving_load.solo_tpot_p99_ms", 1),
    ("docs/demo.md", "(SLO 100) | 144.913 | 149.292 | {} |", RUN_C, "measured_device.serving_load.solo_tpot_p99_ms", 1),
    (
        "docs/demo.md",
        "(SLO 100) | 144.913 | 149.292 | 109.7 | {} |",
        RUN_D,
        "measured_device.serving_load.solo_tpot_p99_ms",
        1,
    ),
    ("docs/demo.md", "requests/s (30-s level) | {} |", RUN_A, "measured_device.serving_load.capacity_rps", 1),
    ("docs/demo.md", "(30-s level) | 0.3333 | 0.3333 | {} |", RUN_C, "measured_device.serving_load.capacity_rps", 1),
    ("docs/demo.md", "trace requests kept | {} |", RUN_A, "measured_device.serving_load.keep", 1),
    ("docs/demo.md", "trace requests kept | 0.030341 | 0.030341 | {} |", RUN_C, "measured_device.serving_load.keep", 1),
    ("docs/demo.md", "core-s of about 88 | {} |", RUN_A, "promise.core_idle_s_with_leases", 1),
    ("docs/demo.md", "core-s of about 88 | 25.85 | 19.52 | 18.04 | {} |", RUN_D, "promise.core_idle_s_with_leases", 1),
    (
        "docs/demo.md",
        "leases off / on | 0.517 / 0.038 | 0.3667 / 0.3556 | {} /",
        RUN_C,
        "measured_device.slo_attainment_by_window.dedicated_only",
        1,
    ),
    (
        "docs/demo.md",
        "| 0.8222 / 0.1278 | 0.5 / {} |",
        RUN_D,
        "measured_device.slo_attainment_by_window.with_leases",
        1,
    ),
    ("docs/demo.md", "leases off [95 % CI] | 21.37 [{},", RUN_A, "episodes_per_min.ci95_dedicated_only.0", 1),
    ("docs/demo.md", "leases on [95 % CI] | 10.65 [{},", RUN_A, "episodes_per_min.ci95_with_leases.0", 1),
    ("docs/demo.md", "| 26.65 [-40.9, {}] |", RUN_D, "episodes_per_min.ci95_with_leases.1", 1),
    ("docs/demo.md", "training steps, seconds a step | 4, {} |", RUN_A, "learning.step_s", 1),
    ("docs/demo.md", "| 4, 50.2 | 4, 49.4 | 4, {} |", RUN_C, "learning.step_s", 1),
    ("docs/demo.md", "first / last third of the steps | {} /", RUN_A, "learning.first_third.mean", 1),
    (
        "docs/demo.md",
        "| 0.0625 / 0.3125 | 0.0625 / 0.3125 | 0.0625 / 0.3125 | 0.0625 / {} |",
        RUN_D,
        "learning.last_third.mean",
        1,
    ),
    (
        "docs/status.md",
        "(TTFT p99 {} ms against the 1 s SLO)",
        CPU + "demo-reference.json",
        "measured_device.p99_alone_ms.ttft",
        1,
    ),
    (
        "docs/status.md",
        "Weight bytes ratio {} at the toy trainer's lr 3e-3",
        CPU + "demo-reference.json",
        "weights.weight_bytes_ratio",
        1,
    ),
    ("docs/status.md", "reward {} → 0.9974", CPU + "demo-reference.json", "weights.reward_first", 1),
    ("docs/status.md", "reward 0.099 → {} (docs/demo.md)", CPU + "demo-reference.json", "weights.reward_last", 1),
    (
        "docs/status.md",
        "kept the load average at {} to 15.5",
        CPU + "demo-reference.json",
        "provenance.load_average.1m",
        1,
    ),
    (
        "docs/status.md",
        "kept the load average at 11.0 to {}",
        CPU + "demo-reference.json",
        "provenance.load_average_at_end.1m",
        1,
    ),
    (
        "docs/demo.md",
        "| episodes/min, mean [95 % CI] | {} [",
        CPU + "demo-reference.json",
        "throughput.by_kind.dedicated_only.mean",
        1,
    ),
    ("docs/demo.md", "186.93] | {} [80.79", CPU + "demo-reference.json", "throughput.by_kind.with_leases.mean", 1),
    (
        "docs/demo.md",
        "| serving SLO attainment, all GPUs | {} while no lease",
        CPU + "demo-reference.json",
        "slo.while_not_leased",
        1,
    ),
    ("docs/demo.md", "| {} while one was", CPU + "demo-reference.json", "slo.while_leased", 1),
    ("docs/demo.md", "while one was ({} overall)", CPU + "demo-reference.json", "slo.overall", 1),
    ("docs/demo.md", "(TTFT p99 {} ms alone", CPU + "demo-reference.json", "measured_device.p99_alone_ms.ttft", 1),
    (
        "docs/demo.md",
        "each of the trainer's {} weight versions",
        CPU + "demo-reference.json",
        "weights.versions_published",
        1,
    ),
    ("docs/demo.md", "Weight bytes ratio {} at the toy", CPU + "demo-reference.json", "weights.weight_bytes_ratio", 1),
    ("docs/demo.md", "kept the load average at {} to", CPU + "demo-reference.json", "provenance.load_average.1m", 1),
    # the soak, quick
    (
        "docs/status.md",
        "bench-soak.json)): {} telemetry ev/s produced",
        CPU + "bench-soak.json",
        "fleets.0.telemetry_produced_events_per_s",
        1,
    ),
    (
        "docs/status.md",
        "telemetry ev/s produced, {} consumed",
        CPU + "bench-soak.json",
        "fleets.0.telemetry_consumed_events_per_s",
        1,
    ),
    (
        "docs/status.md",
        "consumed (2000 modelled), {} commands/s",
        CPU + "bench-soak.json",
        "fleets.0.commands_per_s",
        1,
    ),
    (
        "docs/status.md",
        "decision latency over {} decisions",
        CPU + "bench-soak.json",
        "fleets.0.decision_latency_ms.n",
        1,
    ),
    (
        "docs/status.md",
        "decisions p50 {} ms, p99 5768.973",
        CPU + "bench-soak.json",
        "fleets.0.decision_latency_ms.p50_ms",
        1,
    ),
    (
        "docs/status.md",
        "decisions p50 2912.914 ms, p99 {} ms",
        CPU + "bench-soak.json",
        "fleets.0.decision_latency_ms.p99_ms",
        1,
    ),
    (
        "docs/status.md",
        "1,000 GPUs × 40 s, load average {} rising",
        CPU + "bench-soak.json",
        "provenance.load_average.1m",
        1,
    ),
    (
        "docs/scheduler.md",
        "The agent produced {} telemetry events/s",
        CPU + "bench-soak.json",
        "fleets.0.telemetry_produced_events_per_s",
        1,
    ),
    (
        "docs/scheduler.md",
        "and the scheduler consumed {} (",
        CPU + "bench-soak.json",
        "fleets.0.telemetry_consumed_events_per_s",
        1,
    ),
    (
        "docs/scheduler.md",
        "decisions p50 {} ms, p99 5768.973",
        CPU + "bench-soak.json",
        "fleets.0.decision_latency_ms.p50_ms",
        1,
    ),
    (
        "docs/scheduler.md",
        "decisions p50 2912.914 ms, p99 {} ms",
        CPU + "bench-soak.json",
        "fleets.0.decision_latency_ms.p99_ms",
        1,
    ),
    # CPU interference, quick, under load
    (
        "docs/status.md",
        "load average {} falling to",
        CPU + "bench-interference-quick.json",
        "provenance.load_average.1m",
        1,
    ),
    (
        "docs/status.md",
        "falling to {} from other work ([bench-interference-quick",
        CPU + "bench-interference-quick.json",
        "provenance.load_average_at_end.1m",
        1,
    ),
    ("docs/status.md", "the slowest (p99 {} ms)", CPU + "bench-interference-quick.json", "alone_ms.p99_ms", 1),
    (
        "docs/status.md",
        "its ratios, {}× beside unprotected",
        CPU + "bench-interference-quick.json",
        "unprotected_p99_over_alone",
        1,
    ),
    (
        "docs/status.md",
        "beside unprotected rollout and {}× protected",
        CPU + "bench-interference-quick.json",
        "protected_p99_over_alone",
        1,
    ),
    # the H200
    ("docs/status.md", "the {} CUDA-marked tests of that day", H200 + "cuda-tests.xml", "tests", 1),
    ("docs/status.md", "drained in p99 {} ms", H200 + "pause.json", "p99_ms", 1),
    ("docs/status.md", "(fitted alpha {};", H200 + "interference.json", "alpha_per_share", 1),
]


def _load(path: Path):
    if path.suffix == ".xml":
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        return {"tests": int(suite.attrib["tests"]) - int(suite.attrib["skipped"])}
    return json.loads(path.read_text())


def _get(obj, key: str):
    for part in key.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def _refs(doc: Path) -> list[str]:
    out = []
    for m in REF.finditer(doc.read_text()):
        ref = m.group(0)
        out.append(ref if ref.startswith("docs/") else "docs/" + ref)
    return out


def _expand(ref: str) -> list[str]:
    """`a-{x,y}-{p,q}.json` names every combination; `a-*.json`, at least one file."""
    m = re.search(r"\{([^{}]*)\}", ref)
    if not m:
        return [ref] if "*" not in ref else [str(p.relative_to(REPO)) for p in REPO.glob(ref)] or [ref]
    return [e for alt in m.group(1).split(",") for e in _expand(ref[: m.start()] + alt + ref[m.end() :])]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_measured_reference_names_a_committed_file(doc):
    missing = [r for ref in _refs(doc) for r in _expand(ref) if not (REPO / r).exists()]
    assert not missing, f"{doc.name} names files that are not under docs/measured: {missing}"


def _bench_rows() -> list[str]:
    text = (REPO / "docs/status.md").read_text()
    table = text.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in table.splitlines() if ln.startswith("| `")]


def test_every_bench_row_names_its_files():
    rows = _bench_rows()
    assert len(rows) >= 8, "docs/status.md's bench table was not found"
    for row in rows:
        refs = [r for ref in _refs_in(row) for r in _expand(ref)]
        if "no figure is quoted" in row.rsplit(" | ", 1)[-1]:
            continue  # a bench whose runs were not kept says so instead of quoting them
        assert refs, f"bench row without a file under docs/measured: {row[:80]}"
        for r in refs:
            assert (REPO / r).is_file(), r


def _refs_in(text: str) -> list[str]:
    return [m if m.startswith("docs/") else "docs/" + m for m in REF.findall(text)]


def test_files_written_by_the_bench_cli_carry_their_provenance():
    """Files docs/status.md's bench table names that `rose bench NAME --json` wrote since it records
    provenance: each says its command, commit, machine and load average."""
    for path in sorted((REPO / "docs/measured/cpu").glob("bench-*.json")):
        data = json.loads(path.read_text())
        if "provenance" not in data:
            continue
        p = data["provenance"]
        assert p["command"].startswith("rose "), path.name
        assert re.fullmatch(r"[0-9a-f]{40}", p["git_commit"]), path.name
        assert p["machine"]["cores"] >= 1 and p["machine"]["cpu_model"], path.name
        assert set(p["load_average"]) == {"1m", "5m", "15m"}, path.name


def _figure_id(f: tuple) -> str:
    return f"{Path(f[2]).name}:{f[3]}"


@pytest.mark.parametrize("figure", FIGURES, ids=_figure_id)
def test_each_listed_figure_matches_its_file(figure):
    doc, around, file, key, scale = figure
    text = " ".join((REPO / doc).read_text().split())  # a figure may wrap across lines
    pattern = re.escape(" ".join(around.split())).replace(re.escape("{}"), NUM)
    m = re.search(pattern, text)
    assert m, f"{doc}: {around!r} not found"
    written = m.group(1).replace(",", "")
    decimals = len(written.split(".")[1]) if "." in written else 0
    value = float(_get(_load(REPO / file), key)) * scale
    assert f"{value:.{decimals}f}" == f"{float(written):.{decimals}f}", (
        f"{doc} says {written} where {file} [{key}] gives {value:.{decimals + 2}f}"
    )


def test_the_front_page_ends_its_overview_within_80_lines():
    """README.md: what ROSE is, the two commands, what the demo shows and where to read on come
    before line 80; the detailed sections follow "Read on"."""
    lines = (REPO / "README.md").read_text().splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    read_on = next(i for i in heads if lines[i] == "## Read on")
    first_detail = next(i for i in heads if i > read_on)
    assert first_detail < 80, f"README.md's first detailed section starts at line {first_detail + 1}"
