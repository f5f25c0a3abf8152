"""`POST /v1/weights` on a real gateway (uvicorn in a thread), the real Redis and two real
reference-engine workers that follow the model's weight stream (started once for the module): a
safetensors file or checkpoint directory the gateway reads is published as the next version (or
the one asked, cast to the dtype asked), `GET /v1/weights` then shows every worker reaching it
and turns at that `min_weight_version` carry it; a bad body is a 400 naming its field
(`checkpoint`, `version`, `dtype`), a missing or wrong token a 401."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from rose.config import Config
from rose.rollout.pause_flag import PauseFlag
from rose.rollout.policy_model import ModelSpec, init_state_dict
from tests.test_gateway import (
    KEY,
    MODEL,
    PROMPT,
    SMALL,
    Served,
    launch_workers,
    pause_flags,
    prefixed_gateway_cfg,
    serve,
    stop_workers,
)
from tests.test_rollout_tasks import wait_for

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def module_cfg(stack, base_cfg) -> Iterator[Config]:
    yield from prefixed_gateway_cfg(stack, base_cfg)


@pytest.fixture(scope="module")
def flags() -> Iterator[dict[str, PauseFlag]]:
    yield from pause_flags("rose-gww")


@pytest.fixture(scope="module")
def workers(module_cfg, flags) -> Iterator[list[str]]:
    procs = launch_workers(module_cfg, flags, per_worker=lambda w: {"weights": "follow"})
    yield sorted(procs)
    stop_workers(procs)


@pytest.fixture(scope="module")
def gw(module_cfg, workers) -> Iterator[Served]:
    s = serve(module_cfg)
    wait_for(lambda: sorted(httpx.get(s.url + "/health").json()["workers_running"]) == workers, 90, "workers")
    yield s
    s.stop()


def reference_weights(path: Path, seed: int) -> Path:
    """The reference policy's tensors (its own names and shapes) under a seed, as safetensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in init_state_dict(ModelSpec(**SMALL), seed=seed).items()}, str(path))
    return path


def publish(gw: Served, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(gw.url + "/v1/weights", json=body, headers=AUTH if headers is None else headers, timeout=60)


def weights(gw: Served) -> dict:
    return httpx.get(gw.url + "/v1/weights", headers=AUTH).json()


def reached(gw: Served, workers: list[str], version: int) -> dict | None:
    body = weights(gw)
    at = {d["worker"]: d["version"] for d in body["data"]}
    return body if sorted(at) == workers and all(v >= version for v in at.values()) else None


def test_a_published_file_reaches_every_worker_and_the_turns(gw, workers, tmp_path):
    r = publish(gw, {"checkpoint": str(reference_weights(tmp_path / "step1.safetensors", seed=3))})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == 1 and body["model"] == MODEL and body["keyframe"] is True and body["bytes_sent"] > 0
    after = wait_for(lambda: reached(gw, workers, 1), 60, "both workers at version 1")
    assert after["latest_published"] == 1 and {d["version"] for d in after["data"]} == {1}
    c = gw.client()
    turn = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"min_weight_version": 1})
    assert turn.choices[0].weight_versions == [{"version": 1, "start": 0, "end": 8}]


def test_a_checkpoint_directory_at_a_version_and_dtype_of_its_own(gw, workers, tmp_path):
    ckpt = reference_weights(tmp_path / "ckpt" / "model.safetensors", seed=4).parent
    r = publish(gw, {"checkpoint": str(ckpt), "version": 5, "dtype": "bfloat16"})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 5 and r.json()["model"] == MODEL
    assert wait_for(lambda: reached(gw, workers, 5), 60, "both workers at version 5")["latest_published"] == 5
    nxt = publish(gw, {"checkpoint": str(ckpt), "dtype": "bfloat16"})  # the same again: the next version, a delta
    assert nxt.status_code == 200 and nxt.json()["version"] == 6 and nxt.json()["keyframe"] is False, nxt.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "checkpoint"),
        ({"checkpoint": ""}, "checkpoint"),
        ({"checkpoint": "/nonexistent/rose/ckpt"}, "checkpoint"),
        ({"checkpoint": "/etc/hostname"}, "checkpoint"),  # not a .safetensors file
        ({"checkpoint": "CKPT", "version": 0}, "version"),
        ({"checkpoint": "CKPT", "version": "next"}, "version"),
        ({"checkpoint": "CKPT", "dtype": "int8"}, "dtype"),
        ({"checkpoint": "CKPT", "model": MODEL}, "model"),  # the gateway's own model: no such field
    ],
)
def test_a_bad_body_is_a_400_naming_its_field(gw, tmp_path, body, param):
    ckpt = tmp_path / "w.safetensors"
    if body.get("checkpoint") == "CKPT":
        body = {**body, "checkpoint": str(reference_weights(ckpt, seed=5))}
    r = publish(gw, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and err["type"] == "invalid_request_error"


def test_a_version_not_above_the_last_is_a_400_naming_it(gw, tmp_path):
    ckpt = reference_weights(tmp_path / "w.safetensors", seed=6)
    latest = publish(gw, {"checkpoint": str(ckpt)}).json()["version"]
    r = publish(gw, {"checkpoint": str(ckpt), "version": latest})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
    assert str(latest) in r.json()["error"]["message"]
    assert weights(gw)["latest_published"] == latest


def test_publishing_needs_the_bearer_token(gw, tmp_path):
    ckpt = str(reference_weights(tmp_path / "w.safetensors", seed=7))
    before = weights(gw)["latest_published"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = publish(gw, {"checkpoint": ckpt}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert publish(gw, {"checkpoint": "/nonexistent"}, headers={}).status_code == 401  # auth before the body
    assert weights(gw)["latest_published"] == before
