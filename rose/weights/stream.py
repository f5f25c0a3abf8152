"""The trainer side of the weight stream: publish each version as entries in a Redis stream.

The publisher keeps the receivers' view (the bytes of the last version it published) and
sends only what changed. A version is: `full` or `delta` shard entries (payloads chunked to
at most `chunk_bytes`), then a `commit` entry listing the version's shards and checksums.
`{stream}:meta` (a hash) holds the epoch, the last version and seq, and the recent
keyframes; after each keyframe the stream is trimmed to the oldest keyframe kept, so
everything since the last keyframe is always there. If the meta hash vanishes (Redis lost
its data), another publisher of the model wrote since, or the layout changes, the next version
is a keyframe.

With `redis.shard_streams` = N > 0 (for a Redis Cluster, `redis.cluster_nodes`) a model's
shard entries go to N shard streams whose hash tags put them on different slots (and so, spread
over the cluster's nodes), and the `commit` entry, written only after every shard entry is
acknowledged, goes alone to the commit stream `{prefix}weights:{model}`; it lists the seq range
each shard stream holds of the version. `weight_keys` names the keys (docs/weights.md).
With `redis.wait_replicas` n > 0 a version's writes count only once n replicas hold them
(WAIT once on each shard stream's node before the commit, then on the commit's); a WAIT short of n
raises ReplicationTimeout (docs/weights.md, "Failover and WAIT").
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from rose.config import RedisConfig
from rose.obs.logs import get_logger
from rose.weights import codec as wcodec
from rose.weights.checkpoint import from_state_dict
from rose.weights.clients import weight_keys
from rose.weights.clients import weights_client as weights_client  # rose.gateway's app takes it from here
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


class VersionConflict(ValueError):
    """A publish asked for a version at or below the last published one; `field` names the
    argument at fault."""

    field = "version"


class ReplicationTimeout(RuntimeError):
    """A publish whose writes fewer than `redis.wait_replicas` replicas acknowledged within
    `redis.wait_timeout_ms` (WAIT on the node holding them). `committed` False: shard entries
    were not replicated, so no commit entry was written; followers stay on the previous version
    and the trainer publishes again (the next version is a keyframe). `committed` True: the
    commit entry (and the meta hash) are written on `node` but not yet replicated; the version
    is visible, and lost if `node` fails before its replica has it."""

    def __init__(self, node: str, wanted: int, reached: int, timeout_ms: int, version: int, committed: bool):
        self.node, self.wanted, self.reached, self.timeout_ms = node, wanted, reached, timeout_ms
        self.version, self.committed = version, committed
        what = "its commit entry" if committed else "its shard entries (no commit entry written)"
        super().__init__(
            f"weights version {version}: {reached} of {wanted} replicas (redis.wait_replicas) acknowledged "
            f"{what} on {node} within {timeout_ms} ms (redis.wait_timeout_ms)"
        )


class WeightPublisher:
    """`publish(state_dict)` after each optimizer step; the Python API behind `rose weights publish`.

    Each publish starts by reading the meta hash (one HMGET): when another publisher of the model
    (a trainer's `RoseClient` and `rose gateway`'s `POST /v1/weights`, say) wrote since this one's
    last version, it takes the stream's epoch, version and seq and sends a keyframe, the receivers'
    view being unknown. So publishers may take turns; two publishing at the very same moment are
    not supported: entry ids are the seq, so Redis refuses the colliding XADD of one of them, and
    that publish raises."""

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
        self.keys = weight_keys(rcfg, model)
        self.stream = self.keys.stream
        self.meta = self.keys.meta
        self.keyframe_every = keyframe_every
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self.codec = codec
        self.lossy_options = lossy_options
        self.key = hmac_key.encode()
        self.compress = compress
        self.workers = workers
        self.keep_keyframes = max(1, keep_keyframes)
        if rcfg.wait_replicas < 0 or rcfg.wait_timeout_ms < 0:
            raise ValueError(
                f"redis.wait_replicas {rcfg.wait_replicas}, redis.wait_timeout_ms {rcfg.wait_timeout_ms}: "
                "neither may be negative"
            )
        if rcfg.wait_replicas and rcfg.cluster_nodes.strip() and not self.keys.shard_streams:
            # one stream and its meta hash hash to two slots: no one connection to WAIT on
            raise ValueError("redis.wait_replicas on a Redis Cluster needs redis.shard_streams > 0")
        self.wait_replicas, self.wait_timeout_ms = rcfg.wait_replicas, rcfg.wait_timeout_ms
        self.where = rcfg.cluster_nodes if rcfg.cluster_nodes.strip() else rcfg.safe_url
        self.log = get_logger("rose.weights.publisher", model=model)
        self._layout: Layout | None = None
        self._view: np.ndarray | None = None  # the receivers' bytes
        self._scratch: np.ndarray | None = None
        self._epoch: str | None = None
        self._version = 0
        self._seq = 0
        self._written: tuple[str, int, int] | None = None  # the meta hash as this publisher left it
        self._pending = 0  # shard entries of the version being written
        self._since_keyframe = 0
        self._keyframe_next = True

    # -- recovery ------------------------------------------------------------------------

    def _read_meta(self) -> tuple[str, int, int] | None:
        """The meta hash's (epoch, version, last_seq), in one round trip; None when it is gone."""
        epoch, version, last_seq = self.redis.hmget(self.meta, ["epoch", "version", "last_seq"])
        if not epoch:
            return None
        return (epoch.decode() if isinstance(epoch, bytes) else epoch, int(version or 0), int(last_seq or 0))

    def _recover(self) -> None:
        """Continue the stream's lineage if there is one (publisher restart), else start one."""
        meta = self._read_meta()
        if meta is None:
            self._epoch = uuid.uuid4().hex[:16]
        self._adopt(meta)

    def _check_meta(self) -> None:
        """Before a publish: the meta hash gone (Redis lost the stream) or written by another
        publisher since this one's last version (the receivers' view unknown) calls for a keyframe,
        the latter on the stream's lineage."""
        meta = self._read_meta()
        if meta is None:
            self.log.warning("weights_meta_missing", reason="redis lost the stream; sending a keyframe")
            self._keyframe_next = True
        elif meta != self._written:
            self.log.info(
                "weights_published_elsewhere",
                reason="another publisher wrote the stream since; sending a keyframe",
                version=meta[1],
            )
            self._adopt(meta)

    def _adopt(self, meta: tuple[str, int, int] | None) -> None:
        """Take the stream's epoch, version and seq (`meta`, when there is one) and send a
        keyframe next."""
        if meta is not None:
            self._epoch, self._version, self._seq = meta
        self._written = meta
        self._view = None
        # every stream written to: a publisher that died between shard writes and the commit
        # left entries beyond the last commit, and Redis refuses ids at or below a stream's top
        for key in [self.stream] + [self.keys.shard_stream(i) for i in range(self.keys.shard_streams)]:
            try:
                last = self.redis.xinfo_stream(key)["last-generated-id"]
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
        else:
            self._check_meta()
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
            raise VersionConflict(f"version {version} is not above the last published version {self._version}")
        t1 = time.perf_counter()
        send = self._send_sharded if self.keys.shard_streams else self._send
        try:
            first, last, n_entries, sent = send(layout, version, patches, keyframe)
        except Exception:
            self._epoch = None  # re-read seq and lineage from Redis next time, send a keyframe
            self._view = None
            raise
        self._view = new_view
        self._version = version
        assert self._epoch is not None  # _recover set it
        self._written = (self._epoch, version, self._seq)  # the meta hash's fields as just written
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
        vstart = self._seq + 1
        yield from self._shard_entries(layout, version, patches, keyframe)
        yield self._commit_entry(layout, version, patches, keyframe, vstart, vstart + self._pending)

    def _shard_entries(
        self, layout: Layout, version: int, patches: list[wcodec.ShardPatch], keyframe: bool
    ) -> Iterator[Entry]:
        """The version's shard entries, seq from `self._seq + 1`; `self._pending` counts them."""
        epoch = self._epoch
        assert epoch is not None  # publish_raw recovered it
        vstart = self._seq + 1
        seq = vstart
        self._pending = 0
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
                self._pending += 1

    def _commit_entry(
        self,
        layout: Layout,
        version: int,
        patches: list[wcodec.ShardPatch],
        keyframe: bool,
        vstart: int,
        seq: int,
        streams: list[list[int]] | None = None,
    ) -> Entry:
        """The version's commit: its shards' checksums and, with shard streams, `streams`
        ([[stream index, first seq, last seq, entries], ...]) and `n` (the stream count)."""
        epoch = self._epoch
        assert epoch is not None  # publish_raw recovered it
        body: dict[str, Any] = {"shards": [[p.shard, p.checksum] for p in patches], "keyframe": keyframe}
        if streams is not None:
            body.update(streams=streams, n=self.keys.shard_streams)
        commit = orjson.dumps(body)
        return Entry(seq, version, "commit", -1, 0, 1, "", 0, "", layout.digest, vstart, epoch, commit)

    def _commit_fields(self, commit: Entry) -> dict[bytes, bytes]:
        """The commit entry's fields as written (a test hook: a publisher dying before its commit)."""
        return to_fields(commit, self.key)

    def _xadd_all(self, entries, stream_of, on_entry=None, wait: bool = False) -> tuple[int, int]:
        """XADD each entry to `stream_of(entry)`, pipelined `_PIPELINE_BYTES` at a time, all
        stored on return, and with `wait` replicated (`_flush`: ReplicationTimeout, not
        committed, if not); (payload bytes, entries). Only the last flush WAITs, once per node:
        WAIT counts the replicas that have the replication stream up to its connection's last
        write, which that stream orders after all the node got before. So each node's newest
        entry is held back for the next flush, and the last one writes on every node written,
        on the connection its WAIT goes on (a pool may lend each flush another)."""
        pipes: dict[str, Any] = {}
        held: dict[int, tuple[Any, str, Entry]] = {}  # per pipeline: its newest entry, not yet queued
        pending = sent = n = 0
        version = 0
        for entry in entries:
            key = stream_of(entry)
            pipe = self._pipe(pipes, key, wait)
            if id(pipe) in held:
                self._queue(*held[id(pipe)])
            held[id(pipe)] = (pipe, key, entry)
            if on_entry is not None:
                on_entry(entry)
            pending += len(entry.payload)
            sent += len(entry.payload)
            n += 1
            version = entry.version
            if pending >= _PIPELINE_BYTES:
                self._flush(pipes, False)
                pending = 0
            self._seq = entry.seq
        for pipe, key, entry in held.values():
            self._queue(pipe, key, entry)
        self._raise_short(self._flush(pipes, wait), version, committed=False)
        return sent, n

    def _queue(self, pipe: Any, key: str, entry: Entry) -> None:
        pipe.xadd(key, to_fields(entry, self.key), id=entry.stream_id)

    def _pipe(self, pipes: dict[str, Any], key: str, wait: bool) -> Any:
        """The pipeline writing `key`: the client's own, or with `wait` on a Redis Cluster one on
        the connection of the node holding `key`, where WAIT counts the replicas holding what
        that connection wrote (and, the replication stream being one, all written before)."""
        node = self.redis.get_node_from_key(key) if wait and hasattr(self.redis, "get_node_from_key") else None
        where = node.name if node is not None else ""
        if where not in pipes:
            pipes[where] = (self.redis if node is None else node.redis_connection).pipeline(transaction=False)
        return pipes[where]

    def _flush(self, pipes: dict[str, Any], wait: bool) -> list[tuple[str, int]]:
        """Execute each pipeline holding commands, with `wait` ending in WAIT wait_replicas
        wait_timeout_ms; the (node, replicas reached) of each WAIT short of wait_replicas. A
        node's error (MOVED after a failover, a refused connection) refreshes the cluster
        client's slot map before it is raised, so the next publish writes to the new master."""
        short = []
        for where, pipe in pipes.items():
            if not len(pipe):
                continue
            if wait:
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            try:
                replies = pipe.execute()
            except Exception:
                self._refresh_slots()
                raise
            if wait and int(replies[-1]) < self.wait_replicas:
                short.append((where or self.where, int(replies[-1])))
        return short

    def _refresh_slots(self) -> None:
        manager = getattr(self.redis, "nodes_manager", None)
        if manager is not None:
            try:
                manager.initialize()
            except Exception:  # the cluster is away: the next command finds it again
                pass

    def _raise_short(self, short: list[tuple[str, int]], version: int, committed: bool) -> None:
        if short:
            node, reached = short[0]
            raise ReplicationTimeout(node, self.wait_replicas, reached, self.wait_timeout_ms, version, committed)

    def _send(self, layout: Layout, version: int, patches, keyframe: bool) -> tuple[int, int, int, int]:
        first = self._seq + 1
        sent, n = self._xadd_all(self._entries(layout, version, patches, keyframe), lambda e: self.stream)
        pipe = self.redis.pipeline(transaction=False)
        meta: dict[str, Any] = {"epoch": self._epoch, "version": version, "last_seq": self._seq}
        if keyframe:
            kept = orjson.loads(self.redis.hget(self.meta, "keyframes") or b"[]")
            kept = (kept + [[first, version]])[-self.keep_keyframes :]
            meta.update(keyframes=orjson.dumps(kept), keyframe_seq=first, keyframe_version=version)
            pipe.hset(self.meta, mapping=meta)
            pipe.xtrim(self.stream, minid=f"0-{kept[0][0]}", approximate=False)
        else:
            pipe.hset(self.meta, mapping=meta)
        # one stream (a single Redis): the commit is in the same writes as its shards; WAIT
        # after the meta hash, on its connection, counts replicas holding all of them
        wait = self.wait_replicas > 0
        self._raise_short(self._flush({"": pipe}, wait), version, committed=True)
        return first, self._seq, n, sent

    def _send_sharded(self, layout: Layout, version: int, patches, keyframe: bool) -> tuple[int, int, int, int]:
        """Shard entries to their shard streams (shard s to stream s % N), all acknowledged;
        then the commit alone to the commit stream, the one write that makes the version
        visible, and once it is stored the meta hash. A publisher dying before it leaves entries
        no commit lists, which followers never read. Trimming after a keyframe comes last."""
        n = self.keys.shard_streams
        first = self._seq + 1
        ranges: dict[int, list[int]] = {}  # stream index -> [first seq, last seq, entries]

        def track(entry) -> None:
            r = ranges.setdefault(entry.shard % n, [entry.seq, entry.seq, 0])
            r[1], r[2] = entry.seq, r[2] + 1

        # every shard entry is stored (with wait_replicas, replicated) before the commit names it
        wait = self.wait_replicas > 0
        sent, count = self._xadd_all(
            self._shard_entries(layout, version, patches, keyframe),
            lambda e: self.keys.shard_stream(e.shard % n),
            track,
            wait,
        )
        streams = [[i, *ranges[i]] for i in sorted(ranges)]
        commit = self._commit_entry(layout, version, patches, keyframe, first, self._seq + 1, streams)
        fields = self._commit_fields(commit)
        sent += len(commit.payload)
        meta: dict[str, Any] = {"epoch": self._epoch, "version": version, "last_seq": commit.seq}
        kept: list = []
        if keyframe:
            kept = orjson.loads(self.redis.hget(self.meta, "keyframes") or b"[]")
            kept = (kept + [[first, version]])[-self.keep_keyframes :]
            meta.update(keyframes=orjson.dumps(kept), keyframe_seq=first, keyframe_version=version)
        pipes: dict[str, Any] = {}
        self._pipe(pipes, self.stream, wait).xadd(self.stream, fields, id=commit.stream_id)
        short = self._flush(pipes, wait)  # the version is visible now
        self._seq = commit.seq
        self.redis.hset(self.meta, mapping=meta)  # only after a stored commit (same hash tag, same node)
        if keyframe:
            pipe = self.redis.pipeline(transaction=False)
            for key in [self.stream] + [self.keys.shard_stream(i) for i in range(n)]:
                pipe.xtrim(key, minid=f"0-{kept[0][0]}", approximate=False)
            pipe.execute()
        self._raise_short(short, version, committed=True)
        return first, self._seq, count + 1, sent
