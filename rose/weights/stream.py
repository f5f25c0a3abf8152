"""The trainer side of the weight stream: publish each version as entries in a Redis stream.

The publisher keeps the receivers' view (the bytes of the last version it published) and
sends only what changed. A version is: `full` or `delta` shard entries (payloads chunked to
at most `chunk_bytes`), then a `commit` entry listing the version's shards and checksums.
`{stream}:meta` (a hash) holds the epoch, the last version and seq, and the recent
keyframes; after each keyframe the stream is trimmed to the oldest keyframe kept, so
everything since the last keyframe is always there. If the meta hash vanishes (Redis lost
its data) or the layout changes, the next version is a keyframe.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from rose.config import RedisConfig
from rose.obs.logs import get_logger
from rose.weights import codec as wcodec
from rose.weights.checkpoint import from_state_dict
from rose.weights.entries import Entry, to_fields
from rose.weights.layout import DEFAULT_SHARD_BYTES, Layout, flatten, make_layout

DEFAULT_CHUNK_BYTES = 8 << 20
_PIPELINE_BYTES = 64 << 20


@dataclass(frozen=True)
class PublishStats:
    version: int
    seq_first: int
    seq_last: int
    keyframe: bool
    shards_sent: int
    shards_total: int
    entries: int
    bytes_sent: int  # payload bytes of this version's entries
    bytes_full: int  # bytes of a full broadcast of the state
    changed_elements: int
    encode_s: float
    send_s: float


def meta_key(stream: str) -> str:
    return f"{stream}:meta"


class WeightPublisher:
    """`publish(state_dict)` after each optimizer step; the Python API behind `rose weights publish`."""

    def __init__(
        self,
        redis: Any,
        rcfg: RedisConfig,
        model: str,
        *,
        keyframe_every: int = 50,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        codec: str = wcodec.LOSSLESS,
        lossy_options: dict | None = None,
        hmac_key: str = "",
        compress: bool = True,
        workers: int = 2,
        keep_keyframes: int = 2,
    ):
        self.redis = redis
        self.stream = rcfg.key("weights", model)
        self.meta = meta_key(self.stream)
        self.keyframe_every = keyframe_every
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.lossy_options = lossy_options
        self.key = hmac_key.encode()
        self.compress = compress
        self.workers = workers
        self.keep_keyframes = max(1, keep_keyframes)
        self.log = get_logger("rose.weights.publisher", model=model)
        self._layout: Layout | None = None
        self._view: np.ndarray | None = None  # the receivers' bytes
        self._scratch: np.ndarray | None = None
        self._epoch: str | None = None
        self._version = 0
        self._seq = 0
        self._since_keyframe = 0
        self._keyframe_next = True

    # -- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Continue the stream's lineage if there is one (publisher restart), else start one."""
        meta = self.redis.hgetall(self.meta)
        meta = {k.decode() if isinstance(k, bytes) else k: v for k, v in meta.items()}
        if meta.get("epoch"):
            self._epoch = meta["epoch"].decode() if isinstance(meta["epoch"], bytes) else meta["epoch"]
            self._version = int(meta.get("version", 0))
            self._seq = int(meta.get("last_seq", 0))
        else:
            self._epoch = uuid.uuid4().hex[:16]
        try:
            last = self.redis.xinfo_stream(self.stream)["last-generated-id"]
            last = last.decode() if isinstance(last, bytes) else last
            self._seq = max(self._seq, int(last.split("-")[1]))
        except Exception:  # no stream yet
            pass
        self._keyframe_next = True

    # -- publishing ----------------------------------------------------------------------

    def publish(self, state: Mapping[str, Any], *, keyframe: bool = False, version: int | None = None) -> PublishStats:
        """Send one version of `state` (torch tensors or numpy arrays); returns what it cost."""
        specs, arrays = from_state_dict(state)
        return self.publish_raw(specs, arrays, keyframe=keyframe, version=version)

    def publish_raw(
        self,
        specs: Mapping[str, tuple],
        arrays: Mapping[str, Any],
        *,
        keyframe: bool = False,
        version: int | None = None,
    ) -> PublishStats:
        """`publish` of tensors given as {name: (dtype, shape)} and {name: raw uint8 bytes}."""
        if self._epoch is None:
            self._recover()
        elif self.redis.hget(self.meta, "epoch") is None:
            self.log.warning("weights_meta_missing", reason="redis lost the stream; sending a keyframe")
            self._keyframe_next = True
        t0 = time.perf_counter()
        layout = make_layout(specs, self.shard_bytes)
        if self._layout is None or layout.digest != self._layout.digest:
            self._layout, self._view, self._scratch = layout, None, None
            keyframe = True
        self._scratch = flatten(layout, arrays, self._scratch)
        keyframe = keyframe or self._keyframe_next or self._view is None
        keyframe = keyframe or (self.keyframe_every > 0 and self._since_keyframe >= self.keyframe_every)
        patches, new_view = wcodec.encode_state(
            layout,
            self._view,
            self._scratch,
            keyframe=keyframe,
            codec=self.codec,
            compress=self.compress,
            workers=self.workers,
            lossy_options=self.lossy_options,
        )
        encode_s = time.perf_counter() - t0
        version = self._version + 1 if version is None else version
        if version <= self._version:
            raise ValueError(f"version {version} is not above the last published version {self._version}")
        t1 = time.perf_counter()
        try:
            first, last, n_entries, sent = self._send(layout, version, patches, keyframe)
        except Exception:
            self._epoch = None  # re-read seq and lineage from Redis next time, send a keyframe
            self._view = None
            raise
        self._view = new_view
        self._version = version
        self._since_keyframe = 0 if keyframe else self._since_keyframe + 1
        self._keyframe_next = False
        return PublishStats(
            version,
            first,
            last,
            keyframe,
            len(patches),
            layout.num_shards,
            n_entries,
            sent,
            layout.total,
            sum(p.changed for p in patches),
            encode_s,
            time.perf_counter() - t1,
        )

    def _entries(self, layout: Layout, version: int, patches: list[wcodec.ShardPatch], keyframe: bool):
        epoch = self._epoch
        assert epoch is not None  # publish_raw recovered it
        vstart = self._seq + 1
        seq = vstart
        for n, p in enumerate(patches):
            s, e = layout.shard_range(p.shard)
            chunks = [p.payload[i : i + self.chunk_bytes] for i in range(0, len(p.payload), self.chunk_bytes)] or [b""]
            for part, chunk in enumerate(chunks):
                yield Entry(
                    seq,
                    version,
                    p.kind,
                    p.shard,
                    part,
                    len(chunks),
                    p.codec,
                    e - s,
                    p.checksum,
                    layout.digest,
                    vstart,
                    epoch,
                    chunk,
                    layout.to_json() if keyframe and n == 0 and part == 0 else b"",
                )
                seq += 1
        commit = orjson.dumps({"shards": [[p.shard, p.checksum] for p in patches], "keyframe": keyframe})
        yield Entry(seq, version, "commit", -1, 0, 1, "", 0, "", layout.digest, vstart, epoch, commit)

    def _send(self, layout: Layout, version: int, patches, keyframe: bool) -> tuple[int, int, int, int]:
        pipe = self.redis.pipeline(transaction=False)
        pending = sent = n = 0
        first = self._seq + 1
        for entry in self._entries(layout, version, patches, keyframe):
            pipe.xadd(self.stream, to_fields(entry, self.key), id=entry.stream_id)
            pending += len(entry.payload)
            sent += len(entry.payload)
            n += 1
            if pending >= _PIPELINE_BYTES:
                pipe.execute()
                pending = 0
            self._seq = entry.seq
        meta: dict[str, Any] = {"epoch": self._epoch, "version": version, "last_seq": self._seq}
        if keyframe:
            kept = orjson.loads(self.redis.hget(self.meta, "keyframes") or b"[]")
            kept = (kept + [[first, version]])[-self.keep_keyframes :]
            meta.update(keyframes=orjson.dumps(kept), keyframe_seq=first, keyframe_version=version)
            pipe.hset(self.meta, mapping=meta)
            pipe.xtrim(self.stream, minid=f"0-{kept[0][0]}", approximate=False)
        else:
            pipe.hset(self.meta, mapping=meta)
        pipe.execute()
        return first, self._seq, n, sent
