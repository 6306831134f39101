"""The embedding server's update feed: its changed rows, as a log serving replicas follow.

Every ``model_update_interval_ms`` the server runs a *pass*: it reads the store's
``change_version`` V and its ``trained_through`` (the newest event time of an update
applied), then appends to its **update log** the ids evicted since the last pass
(``tombstones``) and every row changed since it (``rows``: ids and weights, no optimizer
state), scanned in chunks on the store thread between training calls (each chunk a short
pause; :meth:`~stream_persia.server.store.Store.changed_since`), and ends the pass with a
``mark`` (version V and its event time). A pass is skipped when nothing changed.

Messages (maps in the project's wire format, :mod:`stream_persia.core.wire`) all carry
``job``, ``shard``, ``shards``, ``incarnation`` (the server process), ``seq`` (their place
in this process's log, from 0), ``kind``, ``version`` and ``event_time``:

- ``reset``: a full pass of this shard starts: the rows up to its ``mark`` are all of them
  (a replica's table of this shard is stale; it drops the rows the pass did not send
  when the pass's mark comes, :func:`stream_persia.api.replica.apply_messages`). The
  log of every process starts with one, and a pass that cannot be incremental (the store
  was replaced by a restore or cleared, or its eviction log no longer reaches back to the
  last pass, or a replica asked for a resync) starts with one and lists every row;
- ``tombstones``: ``ids`` (uint64) no longer stored;
- ``rows``: ``dim``, ``ids`` (uint64), ``weights`` (float32, ``(n, dim)``);
- ``mark``: the pass is complete: everything the store held at version ``version`` (and
  updates trained through ``event_time``) is in the log up to here.

Applying the log in order, tombstones before the rows of the same pass, leaves a replica
with exactly the server's rows as of the last mark (a row changed during a pass may show up
with its newer value, and then again in the next pass). Applying a row twice or an older
pass again changes nothing that the later messages do not restore: each message carries
the row's whole value, never a delta.

The log is bounded (``log_bytes``; the oldest messages go first). RPC (registered by
:class:`~stream_persia.server.service.EmbeddingServer`):

- ``model_updates {"from_seq": int >= 0, "max_bytes"?: int, "resync"?: bool}`` →
  ``{"incarnation", "shard", "shards", "first_seq", "next_seq", "messages": [...]}``: the
  messages from ``from_seq`` on (at least one when there is one, then up to ``max_bytes``,
  default :data:`REPLY_BYTES`). A reader whose ``from_seq`` is older than ``first_seq`` lost
  messages: it asks again with ``"resync": true``, which makes the next pass a full one and
  answers ``"resync_seq"``, where the reader then goes on (it skips what comes before that
  pass's ``reset``).

:meth:`UpdateFeed.position` is where a replica restored from a checkpoint dumped now must
start reading: the first message of the pass under way, or the next one; ``dump`` replies
carry it (``updates``) and the checkpoint manifest records it per shard.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from stream_persia.core.aio import cancel_and_wait
from stream_persia.core.metrics import RoleMetrics
from stream_persia.core.replies import UpdatePosition
from stream_persia.errors import BadInput, PersiaError

__all__ = ["UpdateFeed", "UpdateLog", "DenseRelay", "REPLY_BYTES", "MESSAGE_BYTES", "KINDS"]

log = logging.getLogger(__name__)

KINDS = ("reset", "tombstones", "rows", "mark")
#: Default and largest reply of ``model_updates`` (the RPC frame limit is larger).
REPLY_BYTES = 8 << 20
MAX_REPLY_BYTES = 64 << 20
#: The most payload bytes of one ``rows`` or ``tombstones`` message (it fits a Kafka
#: message of the default 1 MB limit with its header).
MESSAGE_BYTES = 900_000
#: Rows a pass asks the store for per chunk (one short pause of the store thread each).
CHUNK_ROWS = 1 << 18
_HEADER_BYTES = 200   # what one message costs beyond its arrays, roughly


def _nbytes(msg: dict[str, Any]) -> int:
    n = _HEADER_BYTES
    for key in ("ids", "weights"):
        a = msg.get(key)
        if isinstance(a, np.ndarray):
            n += a.nbytes
    return n


class UpdateLog:
    """Messages numbered from 0, the oldest dropped beyond ``max_bytes`` (the newest one is
    always kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.deque[tuple[dict[str, Any], int]] = collections.deque()
        self.first_seq = 0
        self.next_seq = 0
        self.bytes = 0

    def append(self, msg: dict[str, Any]) -> int:
        """Number ``msg`` (sets ``msg["seq"]``), keep it, drop the oldest over the bound."""
        seq = msg["seq"] = self.next_seq
        n = _nbytes(msg)
        self._items.append((msg, n))
        self.next_seq += 1
        self.bytes += n
        while self.bytes > self.max_bytes and len(self._items) > 1:
            _, dropped = self._items.popleft()
            self.bytes -= dropped
            self.first_seq += 1
        return seq

    def read(self, from_seq: int, max_bytes: int) -> list[dict[str, Any]]:
        """Messages from ``from_seq`` (>= first_seq) on: at least one if any, then while
        they fit in ``max_bytes``."""
        out: list[dict[str, Any]] = []
        total = 0
        for i in range(from_seq - self.first_seq, len(self._items)):
            msg, n = self._items[i]
            if out and total + n > max_bytes:
                break
            out.append(msg)
            total += n
        return out

    def __len__(self) -> int:
        return len(self._items)


class UpdateFeed:
    """One embedding server's passes and update log (see the module docstring).

    Args:
        store: the store in force now (a restore replaces it).
        run: runs a function on the store thread (awaitable).
        trained_through: the newest event time of an applied update (store thread).
        job, shard, shards, incarnation: what every message names.
        interval_ms: time between two passes.
        log_bytes: bound of the log.
        metrics: where the feed's counters and gauges go.
        sink: an :class:`~stream_persia.kafka.updates.UpdateSink` the log is also produced
            to (its partition of ``<job>.model.updates``), or None.
    """

    def __init__(self, *, store: Callable[[], Any],
                 run: Callable[..., Awaitable[Any]],
                 trained_through: Callable[[], float | None], job: str, shard: int,
                 shards: int, incarnation: str, interval_ms: int = 200,
                 log_bytes: int = 256 << 20, metrics: RoleMetrics | None = None,
                 sink: Any = None):
        if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) \
                or not 10 <= interval_ms <= 60_000:
            raise BadInput(f"model_update_interval_ms must be an int in [10, 60000], got "
                           f"{interval_ms!r}", field="model_update_interval_ms")
        if isinstance(log_bytes, bool) or not isinstance(log_bytes, int) \
                or not 1 << 20 <= log_bytes <= 1 << 40:
            raise BadInput(f"update_log_bytes must be an int in [2**20, 2**40], got "
                           f"{log_bytes!r}", field="update_log_bytes")
        self._store = store
        self._run = run
        self._trained_through = trained_through
        self.job, self.shard, self.shards = job, shard, shards
        self.incarnation = incarnation
        self.interval_s = interval_ms / 1000.0
        self.log = UpdateLog(log_bytes)
        self._published = 0                  # the version the last complete pass reached
        self._last_store: Any = None         # the store that pass read (None: full pass)
        self._full_requested = False
        self._pass_first_seq: int | None = None
        self._task: asyncio.Task | None = None
        self._sink_task: asyncio.Task | None = None
        self._passing = asyncio.Lock()       # one pass at a time (the loop, a test, a drain)
        self.sink = sink
        self._sink_seq = 0                    # the first message not yet on Kafka
        self._sink_failing = False
        self.counts = {"passes": 0, "full_passes": 0, "rows": 0, "tombstones": 0,
                       "bytes": 0, "failures": 0, "kafka_gaps": 0, "kafka_failures": 0}
        self.last_event_time: float | None = None
        if metrics is not None:
            metrics.add_callback("updates", self._gauges,
                                 counters={"passes", "full_passes", "rows", "tombstones",
                                           "bytes", "failures", "kafka_gaps",
                                           "kafka_failures"})

    def _gauges(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counts.items()},
                "log_messages": float(len(self.log)), "log_bytes": float(self.log.bytes),
                "kafka_unpublished": float(self.unpublished),
                "version": float(self._published)}

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"update-feed-{self.shard}")
        if self.sink is not None:   # apart: a broker outage never holds up the passes
            self._sink_task = asyncio.create_task(self._sink_loop(),
                                                  name=f"update-sink-{self.shard}")

    async def stop(self) -> None:
        await cancel_and_wait(self._sink_task, self._task)
        self._sink_task = self._task = None

    async def _loop(self) -> None:
        failing = False
        while True:
            started = time.monotonic()
            try:
                await self.run_pass()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:   # a store closed under it, a bug: keep serving, say so once
                self.counts["failures"] += 1
                if not failing:
                    log.exception("embedding server %d: an update pass failed; the next "
                                  "one will list every row", self.shard)
                failing = True
                self._full_requested = True
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    @property
    def unpublished(self) -> int:
        """Messages of the log not yet acknowledged by Kafka (0 without a sink)."""
        return 0 if self.sink is None else self.log.next_seq - self._sink_seq

    async def _sink_loop(self) -> None:
        while True:
            await self.flush_sink()
            await asyncio.sleep(self.interval_s / 2 if not self._sink_failing else 1.0)

    async def flush_sink(self) -> None:
        """Produce the messages the sink does not have yet; on broker trouble they stay
        in the log and are sent on the next call. Messages the bounded log dropped
        before they were sent are a gap on Kafka: the next pass is then a full one, so
        Kafka readers (who skip to a reset over a gap) rebuild the shard."""
        if self.sink is None:
            return
        if self._sink_seq < self.log.first_seq:
            self.counts["kafka_gaps"] += 1
            log.error("embedding server %d: %d update messages left the log before they "
                      "reached Kafka; the next pass lists every row", self.shard,
                      self.log.first_seq - self._sink_seq)
            self._sink_seq = self.log.first_seq
            self._full_requested = True
        while self._sink_seq < self.log.next_seq:
            batch = self.log.read(self._sink_seq, REPLY_BYTES)
            try:
                await self.sink.publish(batch)
            except PersiaError as e:
                self.counts["kafka_failures"] += 1
                if not self._sink_failing:
                    log.error("embedding server %d: %s; retrying (updates wait in the log)",
                              self.shard, e)
                self._sink_failing = True
                return
            self._sink_failing = False
            self._sink_seq = batch[-1]["seq"] + 1

    # ----------------------------------------------------------------- passes
    def position(self) -> UpdatePosition:
        """Where a reader restored from a dump taken now starts (call on the store thread,
        as ``dump`` does): the server process, the log sequence and, with Kafka, an
        offset of its partition at or before that message (absent: from the start)."""
        seq = self._pass_first_seq if self._pass_first_seq is not None else self.log.next_seq
        out: UpdatePosition = {"incarnation": self.incarnation, "seq": int(seq)}
        if self.sink is not None:
            offset = self.sink.offset_of(self.incarnation, int(seq))
            if offset is not None:
                out["offset"] = int(offset)
        return out

    def _message(self, kind: str, version: int, event_time: float | None,
                 **arrays: Any) -> dict[str, Any]:
        return {"job": self.job, "shard": self.shard, "shards": self.shards,
                "incarnation": self.incarnation, "seq": -1, "kind": kind,
                "version": int(version), "event_time": event_time, **arrays}

    def _append(self, msg: dict[str, Any]) -> None:
        self.log.append(msg)
        self.counts["bytes"] += _nbytes(msg)

    async def run_pass(self) -> bool:
        """One pass (see the module docstring); False when nothing had changed."""
        async with self._passing:
            return await self._pass()

    async def _pass(self) -> bool:
        store = self._store()
        full = self._full_requested or store is not self._last_store
        self._full_requested = False
        since = 0 if full else self._published

        def begin() -> tuple[int, float | None, np.ndarray | None, bool, Any]:
            # The rows' iterator is opened in the hop that reads V: the store's next
            # incremental pass (from V) reads only what changed after this moment.
            version = int(store.change_version)
            event_time = self._trained_through()
            if full:
                return version, event_time, None, False, store.changed_since(0, CHUNK_ROWS)
            if version == since:
                return version, event_time, None, True, None
            ids, _, complete = store.evicted_since(since)
            chunks = store.changed_since(since if complete else 0, CHUNK_ROWS)
            return version, event_time, ids, complete, chunks

        self._pass_first_seq = self.log.next_seq
        try:
            version, event_time, tombs, incremental, chunks = await self._run(begin)
            if incremental and version == since:
                return False
            full = not incremental
            if full:
                since = 0
                self._append(self._message("reset", version, event_time))
                self.counts["full_passes"] += 1
            elif tombs is not None and len(tombs):
                step = MESSAGE_BYTES // 8
                for i in range(0, len(tombs), step):
                    self._append(self._message("tombstones", version, event_time,
                                               ids=np.ascontiguousarray(tombs[i:i + step])))
                self.counts["tombstones"] += len(tombs)
            while True:
                chunk = await self._run(next, chunks, None)
                if chunk is None:
                    break
                if self._store() is not store:   # replaced by a restore mid-pass
                    self._full_requested = True
                    return True
                if len(chunk["ids"]):   # a window with no changed row comes back empty
                    self._append_rows(chunk, version, event_time)
            self._append(self._message("mark", version, event_time))
            self._published, self._last_store = version, store
            self.last_event_time = event_time
            self.counts["passes"] += 1
            return True
        finally:
            self._pass_first_seq = None

    def _append_rows(self, chunk: dict[str, Any], version: int,
                     event_time: float | None) -> None:
        ids, weights, dim = chunk["ids"], chunk["weights"], int(chunk["dim"])
        step = max(1, MESSAGE_BYTES // (8 + 4 * dim))
        for i in range(0, len(ids), step):
            self._append(self._message("rows", version, event_time, dim=dim,
                                       ids=np.ascontiguousarray(ids[i:i + step]),
                                       weights=np.ascontiguousarray(weights[i:i + step])))
        self.counts["rows"] += len(ids)

    # ----------------------------------------------------------------- RPC
    async def model_updates(self, params: Any) -> dict[str, Any]:
        """The ``model_updates`` RPC (module docstring)."""
        if not isinstance(params, dict):
            raise BadInput(f"params must be a map, got {type(params).__name__}",
                           field="params")
        unknown = set(params) - {"from_seq", "max_bytes", "resync"}
        if unknown:
            raise BadInput(f"model_updates: unknown key(s) {sorted(unknown)}",
                           field=sorted(unknown)[0])
        from_seq = params.get("from_seq", 0)
        if isinstance(from_seq, bool) or not isinstance(from_seq, int) or from_seq < 0:
            raise BadInput(f"from_seq must be an int >= 0, got {from_seq!r}", field="from_seq")
        max_bytes = params.get("max_bytes", REPLY_BYTES)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) \
                or not 1 <= max_bytes <= MAX_REPLY_BYTES:
            raise BadInput(f"max_bytes must be an int in [1, {MAX_REPLY_BYTES}], got "
                           f"{max_bytes!r}", field="max_bytes")
        resync = params.get("resync", False)
        if not isinstance(resync, bool):
            raise BadInput(f"resync must be a bool, got {resync!r}", field="resync")
        reply: dict[str, Any] = {"incarnation": self.incarnation, "shard": self.shard,
                                 "shards": self.shards, "first_seq": self.log.first_seq,
                                 "next_seq": self.log.next_seq, "messages": []}
        if resync:
            self._full_requested = True
            reply["resync_seq"] = self.log.next_seq
            return reply
        if from_seq >= self.log.first_seq:
            reply["messages"] = self.log.read(from_seq, max_bytes)
        return reply


class DenseRelay:
    """Embedding server 0 relays each dense model it comes to hold
    (:mod:`stream_persia.server.dense_hub`) to the update topic's last partition (index
    ``shards``), as ``dense`` messages: ``version``, ``lineage`` (the publisher's: a
    replica takes a blob of another lineage whatever its version), ``event_time``,
    ``chunk``, ``chunks``, ``sha256`` (of the whole blob) and ``data`` (at most
    :data:`MESSAGE_BYTES` each),
    numbered by ``seq`` like the update log. Only the newest blob is sent: one that a newer
    one replaces before it is out is dropped. A send that fails is retried with the next
    blob (the dense model is published every few hundred milliseconds)."""

    def __init__(self, sink: Any, *, job: str, shards: int, incarnation: str):
        self.sink, self.job, self.shards, self.incarnation = sink, job, shards, incarnation
        self._seq = 0
        self._newest: Any = None
        self._task: asyncio.Task | None = None
        self.counts = {"sent": 0, "failures": 0}

    def offer(self, blob: Any) -> None:
        """Relay ``blob`` (a held dense model) soon; called on the event loop."""
        self._newest = blob
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        while self._newest is not None:
            blob, self._newest = self._newest, None
            data = blob.data
            n = max(1, -(-len(data) // MESSAGE_BYTES))
            msgs = []
            for i in range(n):
                msgs.append({"job": self.job, "shard": self.shards, "shards": self.shards,
                             "incarnation": self.incarnation, "seq": self._seq,
                             "kind": "dense", "version": int(blob.version),
                             "lineage": int(blob.lineage),
                             "event_time": blob.event_time, "chunk": i, "chunks": n,
                             "sha256": blob.sha256,
                             "data": data[i * MESSAGE_BYTES:(i + 1) * MESSAGE_BYTES]})
                self._seq += 1
            try:
                await self.sink.publish(msgs, partition=self.shards)
                self.counts["sent"] += 1
            except PersiaError as e:
                self.counts["failures"] += 1
                log.warning("embedding server 0: the dense model of step %d did not reach "
                            "Kafka: %s", blob.version, e)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
