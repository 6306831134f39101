"""A serving replica: its own read-only tables, following what training changes.

With ``PERSIA_API_EMBEDDINGS=replica`` the API loads a checkpoint like ``local`` serving
does (its rows into a table in this process, its dense model), then follows:

- every embedding server's **update log** (:mod:`stream_persia.server.updates`), from the
  position the checkpoint's manifest records for it (``model_updates``): tombstones leave
  the table, changed rows are written into it, a ``reset`` starts a full pass that
  replaces the shard's rows (those it does not send leave at its end: until then the
  previous rows answer, never a half-empty shard; :func:`apply_messages`), and each
  ``mark`` says the shard is applied through that version and event time. Messages of one
  pull are applied in one go on the predictor's thread, between two forward passes (the
  table is never read and written at once);
- the **dense model** that NN rank 0 publishes to embedding server 0 (``get_dense``, chunks
  checked against their sha256): loaded into a copy of the served module, then swapped in
  with one reference, between requests. One is taken when its step is newer than the one
  served *or its lineage differs* (:mod:`~stream_persia.server.dense_hub`): a trainer
  restarted from scratch or an earlier checkpoint publishes lower steps in a new lineage,
  and its rows are served already. The replica starts with the checkpoint's step and
  ``extra["dense_lineage"]``; without one (older checkpoints) it is the legacy lineage 0
  of publishers from before lineages: with those, only a newer step is taken, as before.

It never looks anything up on the training servers. A server that answers as another shard
than its place in ``PERSIA_EMBEDDING_SERVERS`` (a list in another order) is refused, said
once and retried, never followed as that shard nor asked for full passes (over Kafka,
:mod:`~stream_persia.api.replica_kafka` checks each at start and before each full pass it
asks). The table is bounded
(``PERSIA_API_TABLE_ROWS``, default: the rows the servers may hold together) and LRU: a row
pushed out answers as missing (zeros) until it changes again.

Restarts and gaps, never silent: a server restarted (another incarnation) is read from the
start of its new log, which begins with a ``reset``; a replica that fell behind a server's
bounded log asks it for a full pass (``resync``) and skips to that pass's ``reset`` (an ask
that failed is made again at the next pull, over Kafka within 1-30 s; ``GET /v1/model``
names each shard's
``full_pass``: ``asked``, ``to_ask`` or ``refused``). A
restarted replica restores the newest checkpoint again and catches up from there (from the
start of every log when the checkpoint was written by another number of servers: its
positions name other logs). A message the table refuses (rows of another dim than the ones
it holds for those ids) is counted in ``bad_messages`` and skips the shard to the next full
pass, asked for unless a full pass was refused (then the server's next restart or restore
brings one); it is never passed over as applied. While a
shard is being resynced, ``trained_through`` stays where it was, so the gap shows in the
freshness metric; a restarted server's shard makes it None (unknown) until that server
is restored (its load says what the checkpoint is trained through) or applies an update
with an event time; a shard or dense model restored from an older checkpoint lowers it.

``model_version`` is the step of the dense model served; ``trained_through`` the event time
of the newest sample whose updates are applied: the oldest of every shard's last mark and
the dense model's. The histogram ``persia_api_freshness_seconds`` observes, each time
``trained_through`` advances, the age of the oldest sample the advance covers (now minus
the previous ``trained_through``), an upper bound of the freshness of every sample in it;
``GET /v1/model`` lists recent advances for exact measurements.

A published dense model that does not fit the served one (another architecture) is
refused: counted in ``dense_failures``, named in ``GET /v1/model`` as
``dense_refused_step``, never fetched again; the served model stays until a newer one of
the refused lineage, or one of another lineage, fits. A lineage the replica served and then
replaced is never served again: a blob of it still on its way through Kafka's dense
partition when the replica took its successor over RPC at start came after it, and a
server 0 restarted (it forgets the lineages it refused) took a stale trainer's again.

Size: one module past 500 lines on purpose: one class, the replica's state and the two
streams it follows (the shards' update logs and the dense model), which share its table,
cursors and advance bookkeeping; the messages' schema and checks are the module functions
below it.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import io
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from stream_persia.api.roles import Roles

from stream_persia.core.aio import cancel_and_wait
from stream_persia.core.metrics import RoleMetrics
from stream_persia.core.stages import StageCollector
from stream_persia.errors import BadInput, InternalError, PersiaError
from stream_persia.kernels.sharding import shard_of
from stream_persia.server.dense_hub import (
    LEGACY_LINEAGE,
    REPLACED_LINEAGES_KEPT,
    LineageCalls,
    check_lineage,
    lineage_or_legacy,
)
from stream_persia.server.store import Store

__all__ = ["Replica", "ReplicaMetrics", "ShardCursor", "TableRefused", "apply_messages",
           "check_message", "drop_shard", "message_bytes"]

log = logging.getLogger(__name__)

#: Seconds between two pulls from each server when the last one brought nothing.
FOLLOW_INTERVAL_S = 0.05
#: Bytes asked for in one pull.
PULL_BYTES = 8 << 20
#: Advances of ``trained_through`` kept for ``GET /v1/model``.
ADVANCES_KEPT = 4096
_FRESHNESS_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
                      60.0, 300.0)


@dataclass
class ShardCursor:
    """Where this replica stands in one server's update log."""

    shard: int
    incarnation: str | None = None
    next_seq: int = 0
    skipping: bool = False              # resyncing: skip to the next reset
    version: int | None = None          # the last mark applied
    event_time: float | None = None     # ... and its event time
    resyncs: int = 0
    restarts: int = 0
    start: tuple[str, int] | None = None   # Kafka: skip to this (incarnation, seq) first
    start_at_offset: bool = False       # ... read from its offset: every record is after it
    rebuilding: bool = False            # a reset applied, not yet the mark ending its pass
    refused_full: bool = False          # the table refused a full pass's message: no resync
    resync_pending: bool = False        # a full pass to ask: the last ask failed (retried)
    received: list[np.ndarray] = field(default_factory=list)   # ... the ids it sent so far
    applied: dict[str, int] = field(default_factory=lambda: {"rows": 0, "tombstones": 0,
                                                             "resets": 0, "marks": 0})


def _array(msg: dict[str, Any], key: str, dtype: Any, ndim: int) -> np.ndarray:
    a = msg.get(key)
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim):
        raise BadInput(f"update message {msg.get('seq')!r}: {key} must be a {ndim}-D "
                       f"{np.dtype(dtype).name} array", field=key)
    return a


def check_message(msg: Any, cursor: ShardCursor, shards: int) -> dict[str, Any]:
    """An update message as it must be to be applied (BadInput naming the field)."""
    if not isinstance(msg, dict):
        raise BadInput(f"an update message must be a map, got {type(msg).__name__}",
                       field="message")
    kind = msg.get("kind")
    if kind not in ("reset", "tombstones", "rows", "mark"):
        raise BadInput(f"update message kind {kind!r} is unknown", field="kind")
    if msg.get("shard") != cursor.shard or msg.get("shards") != shards:
        raise BadInput(f"update message for shard {msg.get('shard')!r}/{msg.get('shards')!r} "
                       f"came from server {cursor.shard} of {shards}", field="shard")
    inc = msg.get("incarnation")
    if not isinstance(inc, str) or not 0 < len(inc) <= 256:
        # Kafka's admit() follows it: a record without one ended the follower (KeyError)
        raise BadInput(f"update message incarnation must be a non-empty string, got "
                       f"{str(inc)[:80]!r}", field="incarnation")
    seq, version = msg.get("seq"), msg.get("version")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise BadInput(f"update message seq must be an int >= 0, got {seq!r}", field="seq")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise BadInput(f"update message version must be an int >= 0, got {version!r}",
                       field="version")
    et = msg.get("event_time")
    if et is not None and (isinstance(et, bool) or not isinstance(et, (int, float))
                           or not np.isfinite(et) or et < 0):
        raise BadInput(f"update message event_time must be a time >= 0 or null, got {et!r}",
                       field="event_time")
    if kind == "tombstones":
        _array(msg, "ids", np.uint64, 1)
    elif kind == "rows":
        dim = msg.get("dim")
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 < dim <= 65536:
            raise BadInput(f"update message dim must be an int in [1, 65536], got {dim!r}",
                           field="dim")
        ids, w = _array(msg, "ids", np.uint64, 1), _array(msg, "weights", np.float32, 2)
        if w.shape != (len(ids), dim):
            raise BadInput(f"update message weights have shape {w.shape}, not "
                           f"{(len(ids), dim)}", field="weights")
    return msg


def message_bytes(msg: dict[str, Any]) -> int:
    """Payload bytes of an update message (its arrays; 64 for the rest)."""
    return 64 + sum(a.nbytes for k in ("ids", "weights")
                    if isinstance(a := msg.get(k), np.ndarray))


def drop_shard(store: Store, shard: int, shards: int,
               keep: np.ndarray | None = None) -> int:
    """Remove every row of ``store`` that server ``shard`` of ``shards`` owns, except the
    ids in ``keep`` (one sorted set difference: no per-id Python work)."""
    ids = [c["ids"] for c in store.dump()]
    if not ids:
        return 0
    every = np.concatenate(ids)
    mine = every[shard_of(every, shards) == shard] if shards > 1 else every
    if keep is not None and len(keep) and len(mine):
        mine = mine[~np.isin(mine, keep)]
    return int(store.remove(mine)) if len(mine) else 0


def apply_messages(store: Store, cursor: ShardCursor, shards: int,
                   messages: list[dict[str, Any]]) -> bool:
    """Apply one pull's messages in order (on the thread that owns ``store``); whether a
    full pass ended among them (its mark may say an older event time: a restore).

    A ``reset`` starts a full pass of the shard: its rows overwrite the held ones as they
    come, and at the pass's ``mark`` the rows of the shard that it did not send leave.
    Until then the shard's previous rows are served: a pass read over many pulls (a
    resync of a large shard) never leaves a half-empty shard answering in between.

    Raises:
        TableRefused: the table refused a message (rows of another dim than the held ones
            of the same ids: a job started again with another embedding config): the
            cursor then skips to the next reset (its marks are not applied, so the shard's
            version and ``trained_through`` hold), never past the message as applied. The
            rest of the messages are still looked at (a ``reset`` among them applies) and
            ``next_seq`` ends past the last one: over Kafka the consumer is past them too,
            and a cursor left at the refused message took the next record for a gap.
    """
    ended = False
    refused: TableRefused | None = None
    for msg in messages:
        kind = msg["kind"]
        cursor.next_seq = msg["seq"] + 1
        if cursor.skipping and kind != "reset":
            cursor.rebuilding, cursor.received = False, []   # that pass is abandoned
            continue
        try:
            ended = _apply_one(store, cursor, shards, msg) or ended
        except PersiaError as e:
            cursor.refused_full = cursor.rebuilding or kind == "reset"
            cursor.skipping, cursor.rebuilding, cursor.received = True, False, []
            refused = refused or TableRefused(
                f"update message {msg['seq']} ({kind}) of server {cursor.shard} was refused "
                f"by the serving table: {e.message}; skipping to the server's next full pass",
                field=e.field or "weights",
                hint="a job started again with another embedding config needs a replica "
                     "restored from one of its checkpoints")
    if refused is not None:
        refused.ended = ended
        raise refused
    return ended


class TableRefused(BadInput):
    """:func:`apply_messages` met a message the table refused; ``ended``: whether a full
    pass ended among the messages all the same (one after a later ``reset``)."""

    ended: bool = False


def _apply_one(store: Store, cursor: ShardCursor, shards: int, msg: dict[str, Any]) -> bool:
    """One message of :func:`apply_messages`; whether it ended a full pass."""
    ended = False
    kind = msg["kind"]
    if kind == "reset":
        cursor.skipping = cursor.resync_pending = False
        cursor.rebuilding = True
        cursor.received = []
        cursor.applied["resets"] += 1
    elif kind == "tombstones":
        store.remove(msg["ids"])
        cursor.applied["tombstones"] += len(msg["ids"])
    elif kind == "rows":
        store.load([{"dim": msg["dim"], "ids": msg["ids"], "weights": msg["weights"]}])
        if cursor.rebuilding:   # a copy: the message's buffer (its weights) is let go
            cursor.received.append(np.array(msg["ids"], dtype=np.uint64, copy=True))
        cursor.applied["rows"] += len(msg["ids"])
    else:
        if cursor.rebuilding:
            sent = np.concatenate(cursor.received) if cursor.received else None
            drop_shard(store, cursor.shard, shards, keep=sent)
            cursor.rebuilding, cursor.received, ended = False, [], True
        cursor.version, cursor.event_time = msg["version"], msg["event_time"]
        cursor.applied["marks"] += 1
        cursor.refused_full = False
    return ended


def _full_pass(c: ShardCursor) -> str | None:
    """What a shard skipping to a full pass waits on (``GET /v1/model``): ``asked`` of its
    server, ``to_ask`` (the ask failed: asked again), ``refused`` (the table refused the
    last one: none asked, the server's next restart or restore brings one); None when not
    skipping."""
    if not c.skipping:
        return None
    if c.resync_pending:
        return "to_ask"
    return "refused" if c.refused_full else "asked"


_COUNTERS = frozenset({"pulls", "pull_failures", "bad_messages", "dense_loads",
                       "dense_failures", "resyncs", "server_restarts", "bytes",
                       "dense_kafka", "dense_lineage_changes", "trained_through_rewinds"})


class ReplicaMetrics:
    """A serving replica's metrics, registered once per API process: a reload starts a new
    :class:`Replica`, whose counters go on from the previous one's (they never drop).
    ``persia_api_freshness_seconds``, ``persia_api_replica_*`` and the ``served`` stage
    watermark (the replica's ``trained_through``: :mod:`stream_persia.core.stages`)."""

    def __init__(self, metrics: RoleMetrics):
        self.freshness = metrics.histogram(
            "freshness_seconds", "age of the oldest sample each advance of trained_through "
            "covers, when it is applied (upper bound of freshness)", buckets=_FRESHNESS_BUCKETS)
        self.current: Replica | None = None
        self.carried = dict.fromkeys(_COUNTERS, 0.0)
        metrics.add_callback("replica", self._gauges, counters=_COUNTERS)
        metrics.registry.register(StageCollector(self.watermarks))

    def watermarks(self) -> dict[str, float | None]:
        """``served``: the current replica's ``trained_through``."""
        return {"served": self.current.trained_through if self.current is not None
                else None}

    def follow(self, replica: Replica) -> None:
        if self.current is not None:
            for k, v in self.current.gauges().items():
                if k in _COUNTERS:
                    self.carried[k] += v
        self.current = replica

    def _gauges(self) -> dict[str, float]:
        if self.current is None:
            return dict(self.carried)
        return {k: v + self.carried.get(k, 0.0) for k, v in self.current.gauges().items()}


class Replica:
    """Follows the servers' update logs and server 0's dense model (module docstring).

    Args:
        roles: the job's embedding servers (``roles.servers``, in replica order).
        store: the serving table, restored from a checkpoint.
        positions: the manifest's ``model_updates`` (None: read every log from its start).
        execute: runs a function on the thread that owns ``store`` (awaitable).
        on_dense: called (on the event loop) with ``(state_dict, step, event_time)`` of each
            newer dense model; the predictor builds and swaps the model.
        dense_step: the step of the dense model served at start (the checkpoint's).
        dense_event_time: its event time, if known.
        dense_lineage: its lineage (the checkpoint's ``extra["dense_lineage"]``; default
            the legacy lineage 0).
        metrics: where the replica's metrics go (one per API process).
    """

    def __init__(self, roles: Roles, store: Store, positions: list[dict[str, Any]] | None,
                 execute: Callable[[Callable[[], Any]], Awaitable[Any]],
                 on_dense: Callable[[dict[str, Any], int, float | None], Awaitable[None]],
                 *, dense_step: int = -1, dense_event_time: float | None = None,
                 dense_lineage: int = LEGACY_LINEAGE,
                 metrics: ReplicaMetrics | None = None,
                 interval_s: float = FOLLOW_INTERVAL_S):
        self.roles = roles
        self.store = store
        self.shards = len(roles.servers)
        self.execute = execute
        self.on_dense = on_dense
        self.interval_s = interval_s
        self.cursors = [ShardCursor(i) for i in range(self.shards)]
        if positions is not None and len(positions) != self.shards:
            # The checkpoint was written by another number of servers (it loads into any):
            # its positions name other logs. Every log is read from its start (a reset).
            log.warning("replica: the checkpoint records update positions of %d embedding "
                        "servers, the job has %d; reading every server's log from its "
                        "start", len(positions), self.shards)
            positions = None
        #: where each server's log is read from (None: from its start)
        self.positions = positions
        self.dense_step = dense_step
        self.dense_event_time = dense_event_time
        self.dense_lineage = check_lineage(dense_lineage, "dense_lineage")
        # the newest dense model (lineage, step) that did not fit the served one: not
        # fetched again; None once a model was served after it
        self.refused: tuple[int, int] | None = None
        self._dense_calls = LineageCalls("replica")
        # lineages this replica served and then replaced: never served again (a record of
        # one still on its way through Kafka would bring back a model training replaced)
        self._replaced: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.trained_through: float | None = None
        self._known: float | None = None   # trained_through before it became unknown
        self.advances: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=ADVANCES_KEPT)
        self._tasks: list[asyncio.Task] = []
        self._warned: dict[str, bool] = {}
        self.counts = {"pulls": 0, "pull_failures": 0, "bad_messages": 0, "dense_loads": 0,
                       "dense_failures": 0, "bytes": 0, "dense_kafka": 0,
                       "dense_lineage_changes": 0, "trained_through_rewinds": 0}
        self.metrics = metrics
        self.freshness = metrics.freshness if metrics is not None else None
        if metrics is not None:
            metrics.follow(self)
        if positions is not None and dense_event_time is not None:
            # Restored from a consistent cut: every server's rows are as of the batches
            # the dense model was trained through.
            for c in self.cursors:
                c.event_time = dense_event_time
            self.advance()

    def gauges(self) -> dict[str, float]:
        """This replica's counters and levels (:class:`ReplicaMetrics` exports them)."""
        now = time.time()
        return {**{k: float(v) for k, v in self.counts.items()},
                "resyncs": float(sum(c.resyncs for c in self.cursors)),
                "server_restarts": float(sum(c.restarts for c in self.cursors)),
                "model_version": float(self.dense_step),
                "staleness_seconds": (now - self.trained_through
                                      if self.trained_through is not None else -1.0)}

    def info(self) -> dict[str, Any]:
        """What ``GET /v1/model`` adds in replica mode."""
        return {"shards": [{"shard": c.shard, "incarnation": c.incarnation,
                            "next_seq": c.next_seq, "version": c.version,
                            "event_time": c.event_time, "resyncing": c.skipping,
                            "full_pass": _full_pass(c),
                            "resyncs": c.resyncs, "applied": dict(c.applied)}
                           for c in self.cursors],
                "advances": [list(a) for a in list(self.advances)[-256:]],
                "counts": dict(self.counts), "dense_event_time": self.dense_event_time,
                "dense_lineage": self.dense_lineage,
                # a replaced lineage's model, asked past, is not one that did not fit
                "dense_refused_step": self.refused[1] if self.refused is not None
                and self.refused[0] not in self._replaced else None}

    @property
    def _legacy_hub(self) -> bool:
        """Server 0 refused get_dense's lineage field: it is from before lineages."""
        return self._dense_calls.legacy

    # ----------------------------------------------------------------- lifecycle
    def start(self, *, over_rpc: bool = True) -> None:
        """Follow the servers' logs and server 0's dense model over RPC (not when a
        :class:`~stream_persia.api.replica_kafka.KafkaFollow` brings both)."""
        if not over_rpc:
            return
        self._tasks = [asyncio.create_task(self._follow(c), name=f"replica-shard-{c.shard}")
                       for c in self.cursors]
        self._tasks.append(asyncio.create_task(self._follow_dense(), name="replica-dense"))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if not self._warned.get(key):
            self._warned[key] = True
            log.warning(msg, *args)

    # ----------------------------------------------------------------- sparse
    async def _follow(self, cursor: ShardCursor) -> None:
        role = self.roles.servers[cursor.shard]
        while True:
            try:
                more = await self.pull(cursor)
                self._warned.pop(f"pull-{cursor.shard}", None)
                self._warned.pop(f"bug-{cursor.shard}", None)
            except asyncio.CancelledError:
                raise
            except PersiaError as e:
                self.counts["pull_failures"] += 1
                self._warn_once(f"pull-{cursor.shard}", "replica: cannot follow %s: %s "
                                "(retrying; trained_through holds)", role.peer, e)
                more = False
            except Exception:   # a bug: said, counted and retried, never a task ended silently
                self.counts["pull_failures"] += 1
                if not self._warned.get(f"bug-{cursor.shard}"):
                    self._warned[f"bug-{cursor.shard}"] = True
                    log.exception("replica: following %s failed (resyncing; trained_through "
                                  "holds)", role.peer)
                # The pull's messages are past (next_seq moved before each was applied, a
                # MemoryError from the table's load among them): never passed over as
                # applied, the shard skips to a full pass.
                cursor.skipping, cursor.rebuilding, cursor.received = True, False, []
                try:
                    await self._resync(cursor)
                except Exception as e:   # asked again at the next pull (resync_pending)
                    self._warn_once(f"pull-{cursor.shard}", "replica: cannot follow %s: %s "
                                    "(retrying; trained_through holds)", role.peer, e)
                more = False
            if not more:
                await asyncio.sleep(self.interval_s)

    async def pull(self, cursor: ShardCursor) -> bool:
        """One pull from server ``cursor.shard`` applied; True when more may be waiting."""
        role = self.roles.servers[cursor.shard]
        reply = await self.roles.call(role, "model_updates",
                                      {"from_seq": cursor.next_seq, "max_bytes": PULL_BYTES})
        self.counts["pulls"] += 1
        inc = reply.get("incarnation") if isinstance(reply, dict) else None
        if not isinstance(inc, str):
            raise BadInput(f"{role.peer} answered model_updates without an incarnation",
                           field="incarnation")
        if (reply.get("shard"), reply.get("shards")) != (cursor.shard, self.shards):
            # Servers listed in another order (or of another job size): its messages are
            # another shard's. Said and retried, never a resync (a full pass of training's
            # rows asked again and again) nor rows applied to the wrong shard.
            raise BadInput(f"{role.peer} is embedding server {reply.get('shard')!r} of "
                           f"{reply.get('shards')!r}, listed as server {cursor.shard} of "
                           f"{self.shards}", field="embedding_servers",
                           hint="list PERSIA_EMBEDDING_SERVERS in the job's replica order")
        first, nxt = int(reply.get("first_seq", 0)), int(reply.get("next_seq", 0))
        if inc != cursor.incarnation:
            return await self._new_incarnation(cursor, inc, first)
        if cursor.resync_pending:   # the last ask failed: the shard waited on for good
            await self._resync(cursor)
            return True
        if cursor.next_seq < first:   # fell behind the bounded log: rows were lost to us
            self._warn_once(f"behind-{cursor.shard}", "replica: fell behind %s's update log "
                            "(at %d, it keeps %d on); asking for a full pass", role.peer,
                            cursor.next_seq, first)
            await self._resync(cursor)
            return True
        messages = reply.get("messages")
        if not isinstance(messages, list):
            raise BadInput(f"{role.peer} answered model_updates without messages",
                           field="messages")
        if not messages:
            return False
        try:
            checked = [check_message(m, cursor, self.shards) for m in messages]
            if checked[0]["seq"] != cursor.next_seq or any(
                    b["seq"] != a["seq"] + 1
                    for a, b in zip(checked, checked[1:], strict=False)):
                raise BadInput(f"{role.peer} sent update messages out of sequence "
                               f"(expected {cursor.next_seq})", field="seq")
        except BadInput as e:
            self.counts["bad_messages"] += 1
            log.error("replica: refused a pull from %s: %s; resyncing", role.peer, e.message)
            await self._resync(cursor)
            return True
        self.counts["bytes"] += sum(message_bytes(m) for m in checked)
        try:
            ended = await self.execute(
                lambda: apply_messages(self.store, cursor, self.shards, checked))
        except TableRefused as e:
            await self.refused_by_table(cursor, e)
            return True
        self.advance(rewound=bool(ended))
        return cursor.next_seq < nxt

    async def refused_by_table(self, cursor: ShardCursor, e: TableRefused,
                               resync: Callable[[ShardCursor], Awaitable[None]] | None = None
                               ) -> None:
        """The table refused a message of ``cursor``'s shard (:func:`apply_messages`): it
        now skips to the next full pass, which it asks for, unless a full pass was what
        the table refused (asking again would only repeat it: the shard then waits for the
        server's next one, a restart or restore, its ``trained_through`` held), or a later
        ``reset`` of the same messages started one already."""
        self.counts["bad_messages"] += 1
        log.error("replica: %s", e.message)
        if e.ended:
            self.advance(rewound=True)
        if cursor.skipping and not cursor.refused_full:
            await (resync or self._resync)(cursor)

    async def _new_incarnation(self, cursor: ShardCursor, inc: str, first: int) -> bool:
        start = None
        if cursor.incarnation is None and self.positions is not None:
            pos = self.positions[cursor.shard]
            if pos.get("incarnation") == inc:
                start = int(pos["seq"])    # the checkpoint's place in this very log
        if cursor.incarnation is not None:
            cursor.restarts += 1
            log.warning("replica: embedding server %d restarted (incarnation %s, was %s); "
                        "following its new log", cursor.shard, inc, cursor.incarnation)
        cursor.incarnation = inc
        cursor.skipping = cursor.resync_pending = False
        if start is None:
            start = 0   # a log starts with a reset: it rebuilds the shard from nothing
        if start < first:
            try:
                await self._resync(cursor)
            except BaseException:
                # Not followed yet: the next pull meets this process again and asks again,
                # never reading its log from where the old process's left off.
                cursor.incarnation = None
                raise
        else:
            cursor.next_seq = start
        return True

    async def _resync(self, cursor: ShardCursor) -> None:
        # pending until asked: a failed ask is retried at the next pull
        cursor.skipping = cursor.resync_pending = True
        reply = await self.roles.call(self.roles.servers[cursor.shard], "model_updates",
                                      {"resync": True})
        cursor.next_seq = int(reply["resync_seq"])
        cursor.resync_pending = False
        cursor.resyncs += 1

    # ----------------------------------------------------------------- dense
    async def _follow_dense(self) -> None:
        while True:
            try:
                got = await self.pull_dense()
                self._warned.pop("dense", None)
            except asyncio.CancelledError:
                raise
            except PersiaError as e:
                self.counts["dense_failures"] += 1
                self._warn_once("dense", "replica: cannot fetch the dense model: %s", e)
                got = False
            except Exception:   # a bug: said, counted and retried, never a task ended silently
                self.counts["dense_failures"] += 1
                if not self._warned.get("bug-dense"):
                    self._warned["bug-dense"] = True
                    log.exception("replica: following the dense model failed (retrying)")
                got = False
            if not got:
                await asyncio.sleep(self.interval_s)

    async def pull_dense(self) -> bool:
        """Fetch and apply server 0's dense model if newer or of another lineage (True)."""
        role = self.roles.servers[0]
        # A refused model is not fetched again: ask past it (server 0 holds it or a newer
        # one; the lineages it replaced never come back), else past the one served.
        lineage_, since = self.refused or (self.dense_lineage, self.dense_step)
        ask: dict[str, Any] = {"since": since}

        def get(params: dict) -> Any:
            return self.roles.call(role, "get_dense", params)

        first = await self._dense_calls.call(get, {**ask, "chunk": 0}, lineage_)
        if first.get("data") is None:
            return False
        step, chunks, digest = int(first["version"]), int(first["chunks"]), first["sha256"]
        lineage = lineage_or_legacy(first.get("lineage"))
        parts = [first["data"]]
        for i in range(1, chunks):
            r = await self._dense_calls.call(get, {**ask, "chunk": i}, lineage_)
            if r.get("data") is None or int(r["version"]) != step \
                    or r.get("lineage", LEGACY_LINEAGE) != lineage:
                return False   # replaced by a newer one meanwhile: start over next time
            parts.append(r["data"])
        return await self.apply_dense(b"".join(bytes(p) for p in parts), step, digest,
                                      first.get("event_time"), lineage)

    async def apply_dense(self, blob: bytes, step: int, digest: Any,
                          event_time: Any, lineage: int = LEGACY_LINEAGE) -> bool:
        """Check a whole dense blob; serve it if newer or of another lineage (RPC, Kafka).

        Raises:
            BadInput: the blob is corrupt, not a state dict, or one that does not fit the
                served model (another architecture): that model is refused, the served
                one stays, and the next newer one is tried.
        """
        if lineage == self.dense_lineage and step <= self.dense_step:
            if self.refused is not None and self.refused[0] in self._replaced:
                # over RPC, asked past a replaced lineage's model: server 0 answered with
                # the one served, which it would send again at every poll
                self.refused = None
            return False
        if lineage in self._replaced:
            self._warn_once(f"replaced-{lineage}", "replica: ignoring the dense model of "
                            "lineage %d step %d: a later lineage replaced it", lineage, step)
            self.refused = (lineage, step)   # over RPC: not fetched again
            return False
        if self.refused is not None and lineage == self.refused[0] \
                and step <= self.refused[1]:
            return False
        self.counts["bytes"] += len(blob)
        if not isinstance(digest, str) or hashlib.sha256(blob).hexdigest() != digest:
            raise BadInput(f"the dense model of step {step} does not match its sha256",
                           field="sha256")
        if event_time is not None and (isinstance(event_time, bool) or not isinstance(
                event_time, (int, float)) or not np.isfinite(event_time) or event_time < 0):
            raise BadInput(f"the dense model's event_time {event_time!r} is not a time",
                           field="event_time")
        try:
            state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:   # torch raises several types on bytes it cannot read
            raise BadInput(f"the dense model of step {step} does not load: "
                           f"{type(e).__name__}", field="data") from None
        if not isinstance(state, dict):
            raise BadInput("the dense model blob is not a state dict", field="data")
        try:
            await self.on_dense(state, step, event_time)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            # load_state_dict: missing, unexpected or reshaped keys: this model never fits
            self.refused = (lineage, step)
            raise BadInput(f"the dense model of step {step} does not fit the served model "
                           f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}); "
                           f"still serving step {self.dense_step}", field="data",
                           hint="a model of another architecture needs a new checkpoint "
                                "(POST /v1/model/reload)") from None
        except Exception as e:   # transient (memory): not refused, tried at the next pull
            raise InternalError(f"the dense model of step {step} could not be loaded "
                                f"({type(e).__name__}: {str(e)[:200]}); tried again") from None
        replaced = lineage != self.dense_lineage
        if replaced:
            self.counts["dense_lineage_changes"] += 1
            if self.dense_lineage != LEGACY_LINEAGE:   # (publishers before lineages share it)
                self._replaced[self.dense_lineage] = None
                while len(self._replaced) > REPLACED_LINEAGES_KEPT:
                    self._replaced.popitem(last=False)
            log.warning("replica: serving the dense model of lineage %d step %d (was lineage "
                        "%d step %d): the trainer restarted", lineage, step,
                        self.dense_lineage, self.dense_step)
        self.refused = None
        self.dense_step = step
        self.dense_event_time = event_time
        self.dense_lineage = lineage
        self.counts["dense_loads"] += 1
        self.advance(rewound=replaced)
        return True

    # ----------------------------------------------------------------- freshness
    def advance(self, *, rewound: bool = False) -> None:
        """Recompute ``trained_through`` after something was applied.

        A shard whose last mark has no event time (a server restarted: its new process has
        applied nothing with one yet, and was not restored from a checkpoint that records
        one) makes it None, unknown, rather than the value from before the restart, which
        the restored rows may not reach. The next advance is observed from the last value
        known, so the gap still shows.

        It only grows, except where what is served was replaced by something older
        (``rewound``): a shard rebuilt by a full pass (its server restored from an older
        checkpoint) or the dense model of another lineage (a trainer restarted from one)
        may lower it to what the new marks say (no advance is observed then)."""
        times = [c.event_time for c in self.cursors]
        if any(t is None for t in times) or self.dense_event_time is None:
            if self.trained_through is not None:
                self._known, self.trained_through = self.trained_through, None
            return
        tt = min(min(t for t in times if t is not None), self.dense_event_time)
        prev = self.trained_through
        if prev is not None and tt <= prev:
            if rewound and tt < prev:
                log.warning("replica: trained_through goes back from %.3f to %.3f: what it "
                            "serves was restored from an older checkpoint", prev, tt)
                self.trained_through = tt
                self.counts["trained_through_rewinds"] += 1
            return
        since = prev if prev is not None else self._known
        now = time.time()
        self.trained_through, self._known = tt, None
        if since is not None and tt <= since:
            return    # known again, but not past the value before the gap
        self.advances.append((now, tt))
        if self.freshness is not None and since is not None:
            self.freshness.observe(max(0.0, now - since))


def rebuilt(module: Any, state: dict[str, Any]) -> Any:
    """A copy of ``module`` holding ``state`` (the served one is never modified)."""
    new = copy.deepcopy(module)
    new.load_state_dict(state)
    new.eval()
    return new
