"""Bad input gets one clear line: on stderr with exit status 2 for the CLI (no traceback), or
one log line naming the cause and the fix for a service that stays up."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from rose.config import ConfigError, load_config
from rose.weights import delta_file
from rose.weights.checkpoint import CheckpointError, load
from rose.weights.entries import Entry, to_fields
from rose.weights.follower import KEY_MISMATCH_AFTER, Receiver

REPO = Path(__file__).resolve().parent.parent


def rose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m rose ARGS` without any ROSE_* setting of the calling environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    return subprocess.run(
        [sys.executable, "-m", "rose", *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rose: "), p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# ---- the config file -------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("dir", None, ("is a directory", "--config-file")),
        ("missing.toml", None, ("does not exist",)),
        ("bad.toml", "[policy\n", ("not valid TOML", "line 1")),
        ("binary.toml", b"\xff\xfe[", ("not valid TOML", "UTF-8")),
    ],
)
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, name, content, words):
    path = tmp_path / name
    if name == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    # `topics create` reads the config before it connects to anything
    assert_one_line(rose("--config-file", str(path), "topics", "create"), str(path), *words)


def test_a_wrong_type_in_the_config_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "rose.toml"
    path.write_text('[policy]\nttl_s = "soon"\n')
    assert_one_line(rose("topics", "create", env={"ROSE_CONFIG": str(path)}), "policy.ttl_s", "a number", "'soon'")


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ('[router]\nkind = "nginx"\n', ("router.kind", "vllm-router or readiness", "'nginx'")),
        ("[executor]\ndrain_timeout_s = 0\n", ("executor.drain_timeout_s", "> 0")),
    ],
)
def test_a_bad_router_setting_is_one_line_and_exit_2(tmp_path, section, words):
    path = tmp_path / "rose.toml"
    path.write_text(section)
    assert_one_line(rose("topics", "create", env={"ROSE_CONFIG": str(path)}), *words)


def test_an_unreadable_config_file_is_a_config_error(tmp_path, monkeypatch):
    import rose.config

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rose.config, "open", denied, raising=False)  # as root, chmod 000 still reads
    with pytest.raises(ConfigError, match=r"cannot read it \(Permission denied\)"):
        load_config(tmp_path / "rose.toml", env={})


@pytest.mark.parametrize(
    "toml, key",
    [
        ("[policy]\ngrant_streak = 2.5\n", "policy.grant_streak"),
        ("[policy]\ngrant_streak = inf\n", "policy.grant_streak"),
        ("[kafka]\nbootstrap = [1, 2]\n", "kafka.bootstrap"),
        ("[telemetry]\nmetrics = 3\n", "telemetry.metrics"),
        ("[security]\nweights_hmac_key_file = 7\n", "security.weights_hmac_key_file"),
    ],
)
def test_a_wrong_type_names_the_key(tmp_path, toml, key):
    path = tmp_path / "rose.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=key):
        load_config(path, env={})


# ---- checkpoint and delta files ------------------------------------------------------------


def safetensors_file(path: Path) -> Path:
    from safetensors.numpy import save_file

    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int64)}, str(path))
    return path


def with_header(path: Path, header, hlen: int | None = None, data: bytes = b"\0" * 64) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data)
    return path


CORRUPT_SAFETENSORS = [
    ("huge header length", {"a": {}}, 1 << 60, "header length"),
    ("array header", [], None, "not an object"),
    ("no data_offsets", {"a": {"dtype": "F32", "shape": [2]}}, None, "data_offsets"),
    ("offsets past the data", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}}, None, "outside"),
    ("size differs", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, None, "bytes of data"),
    ("shape of strings", {"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, None, "shape"),
    ("unknown dtype", {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, None, "dtype"),
    ("entry not an object", {"a": 3}, None, "not an object"),
    ("bad metadata", {"__metadata__": {"k": 1}}, None, "__metadata__"),
]


@pytest.mark.parametrize("what, header, hlen, words", CORRUPT_SAFETENSORS, ids=[c[0] for c in CORRUPT_SAFETENSORS])
def test_a_corrupt_safetensors_file_is_a_checkpoint_error(tmp_path, what, header, hlen, words):
    path = with_header(tmp_path / "bad.safetensors", header, hlen)
    with pytest.raises(CheckpointError, match=words) as e:
        load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_weights_diff_of_a_corrupt_file_is_one_line_and_exit_2(tmp_path):
    good = safetensors_file(tmp_path / "good.safetensors")
    for name, header, hlen in [
        ("big", {"a": {}}, 1 << 60),
        ("list", [], None),
        ("nooff", {"a": {"dtype": "F32"}}, None),
    ]:
        bad = with_header(tmp_path / f"{name}.safetensors", header, hlen)
        p = rose("weights", "diff", str(bad), str(good), "--out", str(tmp_path / "d.rdelta"))
        assert_one_line(p, str(bad), "not a valid safetensors file")
    assert not (tmp_path / "d.rdelta").exists()


def test_a_good_safetensors_file_still_reads(tmp_path):
    ck = load(safetensors_file(tmp_path / "good.safetensors"))
    assert ck.specs == {"a": ("float32", (2, 3)), "b": ("int64", (4,))}
    assert np.array_equal(ck.arrays["a"].view(np.float32), np.arange(6, dtype=np.float32))


def delta_with_header(path: Path, header, hlen: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(delta_file.MAGIC + struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + b"\0" * 32)
    return path


LAYOUT = {"shard_bytes": 64, "tensors": [["a", "float32", [4]]]}
CORRUPT_DELTAS = [
    ("huge header length", {}, 1 << 60, "header length"),
    ("array header", [], None, "not an object"),
    ("no layout", {"shards": []}, None, "layout"),
    ("huge shape", {"layout": {"shard_bytes": 64, "tensors": [["a", "float32", [1 << 70]]]}}, None, "shape"),
    ("dtype a list", {"layout": {"shard_bytes": 64, "tensors": [["a", [], [1]]]}}, None, "layout tensor"),
    ("shard of strings", {"layout": LAYOUT, "shards": [["0", "full", "raw", 0, 1, "x"]]}, None, "wrong type"),
    ("shard outside", {"layout": LAYOUT, "shards": [[5, "full", "raw", 0, 1, "x"]]}, None, "outside the layout"),
    ("payload past the end", {"layout": LAYOUT, "shards": [[0, "full", "raw", 0, 99, "x"]]}, None, "truncated"),
    ("no checksums", {"layout": LAYOUT, "shards": []}, None, "base"),
]


@pytest.mark.parametrize("what, header, hlen, words", CORRUPT_DELTAS, ids=[c[0] for c in CORRUPT_DELTAS])
def test_a_corrupt_delta_file_is_a_delta_file_error(tmp_path, what, header, hlen, words):
    path = delta_with_header(tmp_path / "bad.rdelta", header, hlen)
    with pytest.raises(delta_file.DeltaFileError, match=words) as e:
        delta_file.read(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_weights_patch_with_a_corrupt_delta_is_one_line_and_exit_2(tmp_path):
    good = safetensors_file(tmp_path / "good.safetensors")
    bad = delta_with_header(tmp_path / "bad.rdelta", [])
    p = rose("weights", "patch", str(good), str(bad), "--out", str(tmp_path / "out.safetensors"))
    assert_one_line(p, str(bad), "bad header")


# ---- the scheduler without its topics ------------------------------------------------------


def test_the_scheduler_names_missing_topics_and_how_to_create_them(stack, base_cfg):
    """No topics: one line naming them and `rose topics create`, not a client replaced (and
    restarted) forever; the scheduler stays up waiting, and starts once they exist."""
    from rose.kafka.topics import delete_topics, topic_specs
    from rose.scheduler.supervisor import RESTARTS, run_scheduler
    from rose.shutdown import Shutdown

    kafka = dataclasses.replace(
        base_cfg.kafka, bootstrap=stack.kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=1
    )
    cfg = dataclasses.replace(base_cfg, kafka=kafka)
    before = RESTARTS.value()
    try:
        with capture_logs() as logs:
            run_scheduler(cfg, "no-topics", max_seconds=6, shutdown=Shutdown())
    finally:
        delete_topics(cfg.kafka, list(topic_specs(cfg.kafka)))  # none, unless a broker auto-created them
    said = [e for e in logs if e["event"] == "scheduler.topics_missing"]
    assert len(said) == 1, logs  # once, though it looked again every 2 s
    pool_stage = {cfg.kafka.pool_samples_topic, cfg.kafka.pool_intents_topic}  # needed only with policy.pools
    assert set(said[0]["topics"]) == set(topic_specs(cfg.kafka)) - pool_stage and "rose topics create" in said[0]["fix"]
    assert said[0]["log_level"] == "error"
    assert not [e for e in logs if e["event"] == "scheduler.client_replaced"]
    assert RESTARTS.value() == before


# ---- a follower with the wrong weights key -----------------------------------------------


def signed_entries(key: bytes, versions: int = 2, shards: int = 2) -> list[dict]:
    """The entries of `versions` versions (shards + a commit each), signed with `key`."""
    out, seq = [], 1
    for v in range(1, versions + 1):
        vstart = seq
        for kind, shard in [*(("full", i) for i in range(shards)), ("commit", 0)]:
            e = Entry(seq, v, kind, shard, 0, 1, "raw", 0, "0" * 32, "l", vstart, "ep", b"x" * 8)
            out.append(to_fields(e, key))
            seq += 1
    return out


def test_a_follower_with_the_wrong_key_says_the_key_is_the_likely_cause():
    entries = signed_entries(b"publisher-key")
    with capture_logs() as logs:
        r = Receiver(hmac_key="another-key")
        for fields in entries:
            assert r.offer(fields) is None
    said = [e for e in logs if e["event"] == "weights_hmac_key_mismatch"]
    assert len(said) == 1, logs  # after the first version's commit, and not again within 30 s
    assert said[0]["refused_in_a_row"] == 3 and "security.weights_hmac_key" in said[0]["fix"]
    assert r.stats.refused == len(entries)


def test_a_tampered_entry_is_not_blamed_on_the_key():
    """One tampered entry among entries signed with the follower's own key is refused, the
    next ones pass: no line about the key."""
    entries = signed_entries(b"k", versions=3)
    entries[1] = {**entries[1], b"payload": b"y" * 8}
    with capture_logs() as logs:
        r = Receiver(hmac_key="k")
        for fields in entries:
            r.offer(fields)
    assert r.stats.refused == 1
    assert not [e for e in logs if e["event"] == "weights_hmac_key_mismatch"]


def test_a_long_run_of_refused_entries_is_enough():
    entries = [{k: v for k, v in f.items() if k != b"kind"} for f in signed_entries(b"p", versions=10)]
    with capture_logs() as logs:
        r = Receiver(hmac_key="q")
        for fields in entries[:KEY_MISMATCH_AFTER]:
            r.offer(fields)
    assert [e["refused_in_a_row"] for e in logs if e["event"] == "weights_hmac_key_mismatch"] == [KEY_MISMATCH_AFTER]
