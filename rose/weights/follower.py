"""The receiving side of the weight stream: apply every entry exactly once, in order.

`Receiver` is the pure state machine (no I/O): it takes decoded stream entries one by one,
skips duplicates, and on a gap, a checksum mismatch, a corrupt payload or a new publisher epoch
drops its staging buffer and waits for a keyframe. A version becomes visible only at its commit
entry, all shards at once (one reference swap; arrays handed out by `current()` are never
written again). With an HMAC key, unsigned or wrongly signed entries are refused, as are entries
of a wire format this release does not know. The applied seq is part of the committed snapshot,
which a `FileStateStore` replaces atomically, so a follower resumes right after it across a
kill -9. `WeightFollower` is the Redis adapter around a Receiver (XREAD from the last seq; with
shard streams, XREAD of the commit stream, then XRANGE of the seq ranges each commit lists,
merged in seq order). Each rule in full: docs/weights.md.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rose.config import RedisConfig
from rose.obs import metrics
from rose.obs.logs import get_logger
from rose.weights.checkpoint import load, save, to_tensors
from rose.weights.clients import MAX_SHARD_STREAMS, failed_over, node_failed_over, unavailable_errors, weight_keys
from rose.weights.codec import ChecksumMismatch, CorruptPayload, ShardPatch, apply_patch
from rose.weights.entries import Entry, InvalidEntry, UnsupportedFormat, from_fields
from rose.weights.layout import Layout, flatten, layout_from_json

REJECTED = metrics.counter(
    "rose_weights_entries_rejected_total",
    "Weight stream entries not applied, by reason (refused = bad or missing HMAC)",
)
APPLIED = metrics.counter("rose_weights_entries_applied_total", "Weight stream entries applied")
VERSION = metrics.gauge("rose_weights_version", "Newest weight version visible in this process")
RESYNCS = metrics.counter("rose_weights_resyncs_total", "Waits for a keyframe after a gap, divergence or new epoch")


@dataclass(frozen=True)
class Snapshot:
    version: int
    seq: int
    epoch: str
    layout: Layout
    flat: np.ndarray  # never written after it is committed


@dataclass
class ReceiverStats:
    applied_entries: int = 0
    versions: int = 0
    duplicates: int = 0
    skipped: int = 0  # entries passed over while waiting for a keyframe
    gaps: int = 0
    checksum_errors: int = 0
    refused: int = 0
    invalid: int = 0
    unsupported: int = 0  # entries of an unknown wire format (another release of the publisher)
    resyncs: int = 0
    applied_versions: list[int] = field(default_factory=list)  # versions made visible, in order


class _Diverged(Exception):
    pass


KEY_MISMATCH_AFTER = 16  # entries in a row failing the HMAC check that point at the key itself
KEY_MISMATCH_EVERY_S = 30.0
KEY_MISMATCH_HINT = (
    "every entry fails the HMAC check: the signing key likely differs from the publisher's (or the "
    "publisher signs nothing); give both the same security.weights_hmac_key (or "
    "security.weights_hmac_key_file, ROSE_SECURITY__WEIGHTS_HMAC_KEY)"
)


def _whole_version(fields: dict, refused: int) -> bool:
    """Whether `fields`, a refused entry, is a commit and the `refused` entries in a row cover
    its whole version (seq - vstart + 1 entries); its unsigned fields are only a hint here."""
    f = {(k.encode() if isinstance(k, str) else k): v for k, v in fields.items()}
    try:
        kind = f.get(b"kind")
        seq, vstart = int(f[b"seq"]), int(f[b"vstart"])
    except (KeyError, TypeError, ValueError):
        return False
    return kind in (b"commit", "commit") and 0 < seq - vstart + 1 <= refused


class Receiver:
    def __init__(self, hmac_key: str = "", log=None):
        self.key = hmac_key.encode()
        self.log = log or get_logger("rose.weights.receiver")
        self.stats = ReceiverStats()
        self._lock = threading.Lock()
        self._base: Snapshot | None = None  # last committed state (the base of the next delta)
        self._visible: Snapshot | None = None
        self.epoch = ""
        self.last_seq = 0
        self.needs_resync = True  # nothing yet: start from a keyframe
        self._formats_seen: set[str] = set()
        self._refused_in_a_row = 0  # entries that failed the HMAC check since the last that passed
        self._key_mismatch_said = -KEY_MISMATCH_EVERY_S
        self._reset_staging()

    # -- restore / read -----------------------------------------------------------------

    def restore(self, snap: Snapshot, applied_versions: list[int] | None = None) -> None:
        with self._lock:
            self._base = self._visible = snap
        self.epoch, self.last_seq, self.needs_resync = snap.epoch, snap.seq, False
        self.stats.applied_versions = list(applied_versions or [])

    def visible(self) -> Snapshot | None:
        with self._lock:
            return self._visible

    # -- the state machine ----------------------------------------------------------------

    def _reset_staging(self) -> None:
        self._staging: np.ndarray | None = None
        self._staging_layout: Layout | None = None
        self._staging_version = -1
        self._staged: dict[int, str] = {}
        self._parts: list[bytes] = []

    def _resync(self, reason: str) -> None:
        if not self.needs_resync:
            self.stats.resyncs += 1
            RESYNCS.inc()
            self.log.warning("weights_resync", reason=reason, last_seq=self.last_seq)
        self.needs_resync = True
        self._reset_staging()

    def offer(self, fields: dict) -> int | None:
        """Take one stream entry (its field dict); returns a version that just became visible."""
        try:
            e = from_fields(fields, self.key)
        except UnsupportedFormat as err:
            self.stats.unsupported += 1
            REJECTED.inc(reason="unsupported_format")
            if err.format not in self._formats_seen:
                self._formats_seen.add(err.format)
                self.log.error("weights_entry_unsupported_format", reason=str(err), format=err.format)
            return None
        except InvalidEntry as err:
            if err.refused:
                self.stats.refused += 1
                REJECTED.inc(reason="refused")
                self.log.error("weights_entry_refused", reason=str(err), seq=fields.get(b"seq", fields.get("seq")))
                self._note_refused(fields, str(err))
            else:
                self.stats.invalid += 1
                REJECTED.inc(reason="invalid")
                self.log.error("weights_entry_invalid", reason=str(err))
            return None
        self._refused_in_a_row = 0
        return self.offer_entry(e)

    def _note_refused(self, fields: dict, reason: str) -> None:
        """After a whole version (up to its commit entry) or KEY_MISMATCH_AFTER entries in a row
        fail the HMAC check, say once (again at most every KEY_MISMATCH_EVERY_S) that the key,
        not the entries, is the likely cause, and which setting holds it."""
        self._refused_in_a_row += 1
        n = self._refused_in_a_row
        if not (n >= KEY_MISMATCH_AFTER or _whole_version(fields, n)):
            return
        now = time.monotonic()
        if now - self._key_mismatch_said < KEY_MISMATCH_EVERY_S:
            return
        self._key_mismatch_said = now
        self.log.error(
            "weights_hmac_key_mismatch",
            refused_in_a_row=n,
            reason=reason,
            fix=KEY_MISMATCH_HINT,
        )

    def offer_entry(self, e: Entry) -> int | None:
        keyframe_start = e.kind == "full" and e.seq == e.vstart and e.part == 0 and bool(e.layout_json)
        if e.epoch != self.epoch and not self.needs_resync:
            self._resync(f"new publisher epoch {e.epoch}")
        if self.needs_resync:
            if not keyframe_start:
                self.stats.skipped += 1
                return None
            self.epoch, self.last_seq, self.needs_resync = e.epoch, e.seq - 1, False
        if e.seq <= self.last_seq:
            self.stats.duplicates += 1
            return None
        if e.seq != self.last_seq + 1:
            self.stats.gaps += 1
            self._resync(f"gap: seq {e.seq} after {self.last_seq}")
            return self.offer_entry(e) if keyframe_start else None
        try:
            visible = self._apply(e, keyframe_start)
        except (ChecksumMismatch, CorruptPayload, _Diverged, ValueError) as err:
            checksum = isinstance(err, ChecksumMismatch)
            self.stats.checksum_errors += checksum
            REJECTED.inc(reason="checksum" if checksum else "diverged")
            self._resync(f"seq {e.seq}: {err}")
            return None
        self.last_seq = e.seq
        self.stats.applied_entries += 1
        APPLIED.inc()
        return visible

    def _apply(self, e: Entry, keyframe_start: bool) -> int | None:
        if e.seq == e.vstart:
            self._begin_version(e, keyframe_start)
        elif e.version != self._staging_version:
            raise _Diverged(f"entry of version {e.version} inside version {self._staging_version}")
        if e.kind == "commit":
            return self._commit(e)
        if e.part != len(self._parts):
            raise _Diverged(f"part {e.part} of shard {e.shard} out of order")
        self._parts.append(e.payload)
        if e.part + 1 < e.parts:
            return None
        payload, self._parts = b"".join(self._parts), []
        assert self._staging_layout is not None  # _begin_version set it
        if self._staging is None:  # first changed shard of a delta version: copy the base once
            assert self._base is not None  # _begin_version checked the delta's base
            self._staging = self._base.flat.copy()
        apply_patch(self._staging_layout, self._staging, ShardPatch(e.shard, e.kind, e.codec, payload, e.checksum))
        self._staged[e.shard] = e.checksum
        return None

    def _begin_version(self, e: Entry, keyframe_start: bool) -> None:
        self._reset_staging()
        self._staging_version = e.version
        if keyframe_start:
            self._staging_layout = layout_from_json(e.layout_json)
            if self._staging_layout.digest != e.layout:
                raise _Diverged("layout digest does not match its description")
            self._staging = np.zeros(self._staging_layout.total, dtype=np.uint8)
        elif e.kind == "full":
            raise _Diverged("keyframe version without its layout")
        else:
            if self._base is None or self._base.layout.digest != e.layout or self._base.epoch != e.epoch:
                raise _Diverged("delta on a state this receiver does not have")
            self._staging_layout = self._base.layout

    def _commit(self, e: Entry) -> int | None:
        body = orjson.loads(e.payload)
        listed = {int(i): c for i, c in body["shards"]}
        if listed != self._staged:
            raise _Diverged(f"commit lists {len(listed)} shards, {len(self._staged)} applied or checksums differ")
        layout = self._staging_layout
        assert layout is not None  # _begin_version set it
        if body.get("keyframe") and len(listed) != layout.num_shards:
            raise _Diverged("keyframe commit without every shard")
        flat = self._staging
        if flat is None:  # a delta version that changed no shard: its base
            assert self._base is not None  # _begin_version checked it
            flat = self._base.flat
        snap = Snapshot(e.version, e.seq, e.epoch, layout, flat)
        shown = None
        with self._lock:
            self._base = snap
            v = self._visible
            if v is None or v.epoch != snap.epoch or snap.version > v.version:
                self._visible, shown = snap, snap.version
        self._reset_staging()
        if shown is not None:
            self.stats.versions += 1
            self.stats.applied_versions.append(shown)
            VERSION.set(shown)
        return shown


class FileStateStore:
    """The follower's state as one safetensors file, metadata carrying version, seq, epoch."""

    def __init__(self, directory: str | Path, name: str = "weights.safetensors"):
        self.path = Path(directory) / name

    def load(self) -> tuple[Snapshot, list[int]] | None:
        if not self.path.exists():
            return None
        ck = load(self.path)
        m = ck.metadata
        layout = layout_from_json(m["rose.layout"])
        flat = flatten(layout, ck.arrays)
        snap = Snapshot(int(m["rose.version"]), int(m["rose.seq"]), m["rose.epoch"], layout, flat)
        return snap, orjson.loads(m.get("rose.applied", "[]"))

    def save(self, snap: Snapshot, applied_versions: list[int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "rose.version": str(snap.version),
            "rose.seq": str(snap.seq),
            "rose.epoch": snap.epoch,
            "rose.layout": snap.layout.to_json().decode(),
            "rose.applied": orjson.dumps(applied_versions).decode(),
        }
        save(self.path, snap.layout, snap.flat, "safetensors", meta)


class WeightFollower:
    """Follow `rose:weights:{model}`; `poll()` between decode steps, `current()` for the policy."""

    def __init__(
        self,
        redis: Any,
        rcfg: RedisConfig,
        model: str,
        state_store: FileStateStore | None = None,
        *,
        hmac_key: str = "",
        batch: int = 16,
    ):
        self.redis = redis
        self.keys = weight_keys(rcfg, model)
        self.stream = self.keys.stream  # with shard streams: the commit stream
        self.cluster = bool(rcfg.cluster_nodes.strip())  # `redis` is a RedisCluster (clients.weights_client)
        self.redis_url = rcfg.cluster_nodes if self.cluster else rcfg.safe_url
        self.meta = self.keys.meta
        self.store = state_store
        self.batch = batch
        self.log = get_logger("rose.weights.follower", model=model)
        self.receiver = Receiver(hmac_key, self.log)
        self._cursor = "0-0"
        self._saved_seq = -1
        if state_store is not None and (loaded := state_store.load()) is not None:
            snap, applied = loaded
            self.receiver.restore(snap, applied)
            self._cursor = f"0-{snap.seq}"
            self._saved_seq = snap.seq

    @property
    def stats(self) -> ReceiverStats:
        return self.receiver.stats

    def _seek_keyframe(self) -> None:
        kseq = self.redis.hget(self.meta, "keyframe_seq")
        if kseq is not None:
            self._cursor = f"0-{int(kseq) - 1}"

    def poll(self, block_ms: int | None = None) -> int | None:
        """Read and apply what is there (waiting up to block_ms for the first entry); the newest
        version that became visible, or None."""
        if self.receiver.needs_resync:
            self._seek_keyframe()
        shown = None
        block = block_ms or None  # Redis reads BLOCK 0 as "forever"; 0 here means "do not wait"
        reseeked = False
        while True:
            try:
                reply = self.redis.xread({self.stream: self._cursor}, count=self.batch, block=block)
            except Exception as e:
                if failed_over(e):
                    raise node_failed_over()(str(e)) from e
                raise
            block = None  # wait only for the first batch
            if not reply:
                break
            for entry_id, fields in reply[0][1]:
                waiting = self.receiver.needs_resync
                v = self._offer_commit(fields) if self.keys.shard_streams else self.receiver.offer(fields)
                self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if v is not None:
                    shown = v
                # back to the newest keyframe when this entry broke the chain, once a poll: a
                # keyframe that cannot be applied (refused, corrupt) is then read past, not forever
                if self.receiver.needs_resync and not waiting and not reseeked:
                    before = self._cursor
                    self._seek_keyframe()
                    if self._cursor != before:
                        reseeked = True
                        break
        if shown is not None:
            self._persist()
        return shown

    def _offer_commit(self, fields: dict) -> int | None:
        """With shard streams: one commit entry, preceded by the shard entries it lists (read
        from their shard streams in seq order) when the receiver can use them. A refused,
        unreadable or duplicate commit goes to the receiver alone, which counts and logs it."""
        r = self.receiver
        try:
            commit = from_fields(fields, r.key)
            body = orjson.loads(commit.payload) if commit.kind == "commit" else {}
            n = int(body.get("n", 0))
            # within the version's own seqs, whatever the commit says
            ranges = [
                (int(i), max(int(lo), commit.vstart), min(int(hi), commit.seq - 1))
                for i, lo, hi, *_ in body.get("streams", [])
            ]
        except (InvalidEntry, ValueError, TypeError, AttributeError):
            return r.offer(fields)
        wanted = body.get("keyframe") if r.needs_resync else commit.seq > r.last_seq
        # a read cut short (a node away mid-version) resumes after the entries already taken
        floor = 0 if r.needs_resync else r.last_seq + 1
        if wanted and 0 < n <= MAX_SHARD_STREAMS and all(0 <= i < n for i, _, _ in ranges):
            merged = heapq.merge(*(self._range(i, n, max(lo, floor), hi) for i, lo, hi in ranges), key=lambda t: t[0])
            for _seq, shard_fields in merged:
                r.offer(shard_fields)
        return r.offer(fields)

    def _range(self, i: int, n: int, lo: int, hi: int) -> Iterator[tuple[int, dict]]:
        """Entries seq lo..hi of shard stream i of n, `batch` at a time: (seq, fields)."""
        key = self.keys.shard_stream(i, n)
        while lo <= hi:
            got = self.redis.xrange(key, min=f"0-{lo}", max=f"0-{hi}", count=self.batch)
            if not got:
                return
            for entry_id, fields in got:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                lo = int(eid.split("-")[1]) + 1
                yield lo - 1, fields

    def _say_unavailable(self, e: BaseException) -> None:
        if self.cluster:
            self.log.error(
                "redis.cluster_unavailable",
                nodes=self.redis_url,
                error=f"{type(e).__name__}: {e}",
                hint="a Redis Cluster node is down, or the cluster is not ok yet (CLUSTER INFO: cluster_state); "
                "`rose stack up --redis-cluster` restarts the local one; retrying",
            )
        else:
            self.log.error(
                "redis.unreachable",
                url=self.redis_url,
                error=f"{type(e).__name__}: {e}",
                hint="start a local stack with `rose stack up`, or point ROSE_REDIS_URL at your Redis; retrying",
            )

    def _persist(self) -> None:
        snap = self.receiver.visible()
        if self.store is not None and snap is not None and snap.seq != self._saved_seq:
            self.store.save(snap, self.receiver.stats.applied_versions)
            self._saved_seq = snap.seq

    def newest(self) -> int | None:
        """The newest version the publisher has committed (its meta hash, written after the
        version's commit entry), whether or not this follower has applied it yet; None before
        the first."""
        v = self.redis.hget(self.meta, "version")
        return None if v is None else int(v)

    def current(self) -> tuple[int, dict] | tuple[None, dict]:
        """(version, state dict of torch tensors) of the visible version; never half-updated."""
        snap = self.receiver.visible()
        if snap is None:
            return None, {}
        return snap.version, to_tensors(snap.layout, snap.flat)

    def follow(
        self,
        until_version: int | None = None,
        idle_s: float | None = None,
        block_ms: int = 1000,
        stop: threading.Event | None = None,
    ) -> None:
        """Poll until `until_version` is visible, nothing arrived for `idle_s` seconds, or `stop`.
        Redis or a cluster node being away (`unavailable_errors`) is waited out, not raised."""
        last = time.monotonic()
        said: tuple[type, float] = (type(None), -1e9)  # the error last logged, and when
        while stop is None or not stop.is_set():
            try:
                v = self.poll(block_ms)
            except unavailable_errors() as e:
                # Redis restarts: refused connections, then LOADING (BusyLoadingError) while it
                # replays its append-only file; on a cluster, a node down: refused connections to
                # it, then CLUSTERDOWN from the others once they mark it failed. Said once per
                # kind of error, again every 30 s; retried every 0.5 s.
                if type(e) is not said[0] or time.monotonic() - said[1] >= 30:
                    said = (type(e), time.monotonic())
                    self._say_unavailable(e)
                pause = 0.0 if isinstance(e, node_failed_over()) else 0.5  # a new master answers at once
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)
                continue
            snap = self.receiver.visible()
            if v is not None:
                last = time.monotonic()
            if until_version is not None and snap is not None and snap.version >= until_version:
                return
            if idle_s is not None and time.monotonic() - last >= idle_s:
                return
