"""`rose weights diff` / `patch` on safetensors and torch files: bit-exact round trips, clear errors."""

from __future__ import annotations

import orjson
import pytest
from typer.testing import CliRunner

from rose.cli import app

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

runner = CliRunner()


def _states():
    g = torch.Generator().manual_seed(0)
    base = {
        "layer.w": torch.randn(300, 200, generator=g).to(torch.bfloat16),
        "layer.b": torch.randn(200, generator=g),
        "emb": torch.randn(50, 16, generator=g).half(),
        "step": torch.tensor(7, dtype=torch.int64),
    }
    target = dict(base)
    target["layer.w"] = (base["layer.w"].float() + torch.randn(300, 200, generator=g) * 1e-3).to(torch.bfloat16)
    target["step"] = torch.tensor(8, dtype=torch.int64)
    return base, target


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def test_safetensors_round_trip_is_bit_exact(tmp_path):
    base, target = _states()
    save_file(base, tmp_path / "base.safetensors", metadata={"format": "pt"})
    save_file(target, tmp_path / "target.safetensors", metadata={"format": "pt"})
    r = runner.invoke(
        app,
        [
            "weights",
            "diff",
            str(tmp_path / "base.safetensors"),
            str(tmp_path / "target.safetensors"),
            "--out",
            str(tmp_path / "d.delta"),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rep = orjson.loads(r.stdout)
    assert rep["params"] == 300 * 200 + 200 + 50 * 16 + 1
    assert 0 < rep["changed_fraction"] < 1 and rep["bytes_delta"] < rep["bytes_full"] and rep["seconds"] >= 0
    r = runner.invoke(
        app,
        [
            "weights",
            "patch",
            str(tmp_path / "base.safetensors"),
            str(tmp_path / "d.delta"),
            "--out",
            str(tmp_path / "out.safetensors"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "target.safetensors").read_bytes()


def test_torch_round_trip_is_bit_exact(tmp_path):
    base, target = _states()
    torch.save(base, tmp_path / "base.pt")
    torch.save(target, tmp_path / "target.bin")
    assert (
        runner.invoke(
            app,
            ["weights", "diff", str(tmp_path / "base.pt"), str(tmp_path / "target.bin"), "--out", str(tmp_path / "d")],
        ).exit_code
        == 0
    )
    assert (
        runner.invoke(
            app, ["weights", "patch", str(tmp_path / "base.pt"), str(tmp_path / "d"), "--out", str(tmp_path / "out.pt")]
        ).exit_code
        == 0
    )
    assert _same(torch.load(tmp_path / "out.pt", weights_only=True), target)
    assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "target.bin").read_bytes()
    # and across formats: a torch base patched into safetensors output
    assert (
        runner.invoke(
            app,
            [
                "weights",
                "patch",
                str(tmp_path / "base.pt"),
                str(tmp_path / "d"),
                "--out",
                str(tmp_path / "out.safetensors"),
            ],
        ).exit_code
        == 0
    )
    assert _same(load_file(tmp_path / "out.safetensors"), target)


def test_user_errors_are_one_line(tmp_path):
    base, target = _states()
    save_file(base, tmp_path / "a.safetensors")
    other = dict(target)
    other["layer.b"] = torch.zeros(201)
    save_file(other, tmp_path / "b.safetensors")
    r = runner.invoke(
        app,
        [
            "weights",
            "diff",
            str(tmp_path / "a.safetensors"),
            str(tmp_path / "b.safetensors"),
            "--out",
            str(tmp_path / "d"),
        ],
    )
    assert r.exit_code == 2 and "layout mismatch" in r.output and "layer.b" in r.output
    r = runner.invoke(
        app,
        [
            "weights",
            "diff",
            str(tmp_path / "missing.pt"),
            str(tmp_path / "a.safetensors"),
            "--out",
            str(tmp_path / "d"),
        ],
    )
    assert r.exit_code == 2 and "no such file" in r.output and "Traceback" not in r.output
    save_file(target, tmp_path / "t.safetensors")
    runner.invoke(
        app,
        [
            "weights",
            "diff",
            str(tmp_path / "a.safetensors"),
            str(tmp_path / "t.safetensors"),
            "--out",
            str(tmp_path / "d"),
        ],
    )
    r = runner.invoke(
        app,
        [
            "weights",
            "patch",
            str(tmp_path / "t.safetensors"),
            str(tmp_path / "d"),
            "--out",
            str(tmp_path / "o.safetensors"),
        ],
    )
    assert r.exit_code == 2 and "not the checkpoint" in r.output
    (tmp_path / "junk").write_bytes(b"nope")
    r = runner.invoke(
        app, ["weights", "patch", str(tmp_path / "a.safetensors"), str(tmp_path / "junk"), "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 2 and "not a ROSE weights delta" in r.output
