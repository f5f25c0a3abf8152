"""`rose bench weights` runs end to end in quick mode and reports every figure with its goal
ratio; timings are reported, never asserted."""

import pytest

pytestmark = pytest.mark.stack


def test_weights_bench_reports_every_figure(cfg):
    from rose.bench import weights

    out = weights.run(cfg, quick=True)
    for k in (
        "encode_gb_per_s",
        "apply_gb_per_s",
        "memcpy_gb_per_s",
        "encode_vs_memcpy",
        "apply_vs_memcpy",
        "encode_vs_memcpy_goal",
        "bytes_ratio_per_step",
        "bytes_ratio_vs_goal",
        "changed_fraction",
        "publish_to_applied_ms",
        "publish_ratio_per_step",
        "keyframe_apply_ms",
    ):
        assert out[k] is not None and out[k] > 0, k
    assert out["params"] == 10_000_000 and out["bytes_full_bf16"] == 2 * out["params"]
    assert out["bytes_ratio_per_step"] < 1 and 0 < out["changed_fraction"] < 1
    assert out["encode_vs_memcpy"] == pytest.approx(out["encode_gb_per_s"] / out["memcpy_gb_per_s"], rel=0.05)
    assert out["lossy_int8_steps_to_exact"] is not None and out["lossy_topk_steps_to_exact"] is not None
