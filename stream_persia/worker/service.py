"""Embedding worker role (PERSIA's embedding worker), the asyncio heart of the runtime.

Batches enter from the Kafka ingest loop (:mod:`stream_persia.worker.ingest`) or, with no
broker, from data loaders calling ``ingest`` over RPC. Each is decoded, validated against
the embedding schema and *planned* ahead of time (:mod:`stream_persia.worker.batchplan`:
prefixed ids, de-duplicated per dim; summation slots are pooled on the servers), then
waits in a ready buffer bounded by batches and by bytes (``ready_buffer_batches``,
``ready_buffer_bytes``: a planned batch's arrays take about 3-4x its encoded size), so
that a worker whose NN side stops pulling holds a bounded amount of memory: while the
buffer is full Kafka ingest pauses its partitions and broker-less ``ingest`` waits.
Embedding lookups happen when an NN worker pulls the batch: the NN side holds a staleness
permit per pulled batch, so the number of batches looked up but not yet applied is
bounded by ``embedding_staleness`` (PERSIA's semantics; with 1 the job is fully
synchronous and deterministic).

RPC methods (params → result):

- ``health`` → ``{"ok", "role", "replica_index", ..., "error"}``: ``ok`` is false, and
  ``error`` says why, when a background task failed (the Kafka ingest loop: the launched
  role then exits with status 1, :mod:`stream_persia.core.supervisor`), batches whose
  gradient push failed are held (below), an embedding server restarted and lost its
  table (*Embedding servers that restart*, below; the launched role exits 1 too), or
  serving its stream would train batches twice (*Stream replays*, below).
- ``ingest {"batch": PersiaBatch wire dict, "timeout_ms"?}`` → ``{"batch_id"}`` —
  broker-less ingest; waits while ingest is paused or the ready buffer is full
  (``Backpressure`` after the timeout); bad batches are refused with ``BadInput`` naming
  the field (nothing stored).
- ``next_batch {"timeout_ms", "config"?}`` → a training batch (below) or None when none
  arrived. ``config``: the configuration digest the caller set on the servers; while no
  server holds any (all restarted), ``ServerRestarted`` naming them, or with
  ``on_server_restart: continue`` a Misuse on field ``config`` (the NN side configures
  them again; see :mod:`stream_persia.worker.router`); ``StreamReplay`` while the worker
  refuses its stream (*Stream replays*). The batch carries the digest the servers hold
  (``config``) once the worker knows it.
- ``push_gradients {"batch_id", "grads": {slot: f32 grad | None}, "timeout_ms"?}`` →
  ``{"applied", "dropped", "skipped_slots"}``; replies only after every server applied the
  update. See *Gradient pushes* below for retries, duplicates and failed batches.
- ``lookup_batch {"batch": wire dict, "mode": "eval"|"infer"}`` → a batch with embeddings,
  looked up without inserting (evaluation, online inference).
- ``return_batches {"batch_ids"}`` → None: served training batches go back, unapplied,
  to the head of the ready buffer in their original order (an NN worker drops its
  prefetched batches before a checkpoint, so nothing is left in flight).
- ``frontier`` → ``{"stream": "kafka"|"direct", "offsets": {partition: offset},
  "inflight", "pending", "failed", "lost"}``: with nothing in flight, every batch before
  ``offsets`` is applied and none after it (the checkpoint cut). ``failed`` lists the
  batches whose push could not complete (below); they count as in flight too. Every
  server's incarnation is checked first, and ``lost`` lists ``{"server", "address",
  "error"}`` of those found restarted (below): checkpoints refuse while it is not empty.
- ``reset_stream {"offsets": {partition: offset}, "fingerprints"?: {partition:
  {"offset", "timestamp", "digest"}}, "topic"?}``: drop buffered and in-flight batches and
  consume again from ``offsets`` (restore); a ``topic`` (the checkpoint's) other than the
  one the worker reads is refused (BadInput on ``topic``), nothing dropped; offsets the
  brokers deleted, and offsets whose record below is not the one the checkpoint
  fingerprinted (a recreated topic: :mod:`stream_persia.kafka.fingerprint`), are refused
  first (``KafkaDataLoss``, unless ``kafka.on_data_loss: skip``), nothing dropped, and so
  is a reset while an embedding server found restarted was not restored since
  (``ServerRestarted``); offsets at or below what the servers applied start a stream that
  is refused (``StreamReplay``, *Stream replays*). ``check_stream {"offsets"}`` → None:
  refuses as ``reset_stream`` would for the offsets, changing nothing (a restore asks
  before it loads anything). ``commit_offsets {"offsets"}``: record
  checkpoint offsets in the consumer group, for lag monitors. ``fingerprints
  {"offsets"}`` → ``{partition: {"offset", "timestamp", "digest"}}``: the record below
  each offset of this worker's partitions, read from the brokers (a Kafka cut records
  them; ``{}`` without Kafka).
- ``status`` → buffers, counters, frontier offsets, ``watermarks`` (stage → event time
  or None: ``ingested``, with Kafka ``produced``, on replica 0 ``trained``:
  :mod:`stream_persia.core.stages`), and with Kafka ``kafka_lag`` (``[{"topic",
  "partition", "messages", "seconds", "probe_age_s"}]``,
  :mod:`stream_persia.worker.kafka_lag`) and
  ``kafka``: lag, paused
  partitions, those stopped on a data loss (``stopped``) and the messages lost where the
  loss was accepted (``lost_messages``; :meth:`KafkaIngest.status`);
  ``pause_ingest`` / ``resume_ingest``
  (a paused worker takes no batch from Kafka, and ``ingest`` waits); ``servers`` →
  embedding server addresses; ``schema`` → the embedding schema batches are planned with
  (``EmbeddingSchema.to_dict()``: an NN worker started without ``PERSIA_EMBEDDING_CONFIG``
  digests and checks its checkpoints with it); ``metrics`` → Prometheus text.
- Replica 0 only, the checkpoint mailbox (:mod:`stream_persia.worker.mailbox`: how a
  checkpoint started over HTTP reaches the NN ranks): ``nn_heartbeat {"rank",
  "world_size", "step"}`` → ``{"checkpoint": {"id", "dst", "report_every_s"} | None}``,
  ``nn_detach {"rank", "reason"?}``, ``checkpoint_request {"id", "dst", "ttl_s"?,
  "report_timeout_s"?}`` → record,
  ``checkpoint_report {"id", "state", "step"?, "progress"?, "manifest"?, "error"?}``,
  ``checkpoint_status {"id"}`` → record | None, ``nn_status`` → last heartbeat | None.
  A request's ``dst`` must lie under the worker's checkpoint root
  (:mod:`stream_persia.checkpoint.root`): the NN ranks write there.

Gradient pushes are idempotent per (batch, server), retried for up to ``push_retry_ms``,
and a push that cannot complete fails its batch loudly (:mod:`stream_persia.worker.pushes`):
a *failed* batch stays in flight (so no checkpoint can claim it), is listed in
``frontier``/``status`` (``failed``), makes ``health`` answer ``ok: false`` naming it,
and ``return_batches`` refuses it (serving it again would apply its gradients twice on the
servers that took them); checkpoints refuse, naming it
(:func:`stream_persia.checkpoint.cut.check_no_failed_push`). It holds one of the
``max_inflight_batches`` slots until a push of it completes or ``reset_stream`` drops it,
so failures that pile up stop serving rather than grow memory.

Embedding servers that restart. A server process killed and restarted at its address (a
StatefulSet does it by itself) comes back with an empty table. The router notices it by
the server's incarnation (:mod:`stream_persia.worker.router`) and, with
``embedding_worker_config.on_server_restart: fail`` (the default), the server is *lost*:
lookups that need it fail with :class:`~stream_persia.errors.ServerRestarted` naming it,
its address and the rows it held (the batch goes back to the head of the ready buffer), a
push that needs it fails its batch with ``ServerRestarted`` (kept failed as above: pushing
it again cannot help), ``health`` answers not ok naming it, ``frontier`` lists it (so
checkpoints refuse), the metrics count it (``server_restarts_total{server}``, gauge
``servers_lost``), and the supervisor has a launched worker exit 1 after
:data:`~stream_persia.core.supervisor.EXIT_GRACE_S`. A restore is the way back: once a load
replaced the server's table (its ``loads``), the router serves it again (checked on the
next request, ``health`` and ``reset_stream``), and the worker is healthy. With
``continue`` the restart is logged at ERROR and counted, and training goes on without
the rows.

Stream replays. A worker restarted alone (kill -9, OOM, a pod restart) starts its
partitions at ``auto_offset_reset`` while the servers hold every update applied since the
last checkpoint. Every update of a Kafka batch names its topic, partition, offset and the
worker stream that sends it (``<incarnation>.<n>``, a new ``n`` per ``reset_stream``), so
the servers keep per partition the highest offset applied (:mod:`stream_persia.core.watermarks`).
Before its ingest reads a partition the worker asks them, and a partition it would start
at or below that is *refused*: never read nor served, ``health`` answers not ok naming the
topic/partition, the start offset, the watermark and the server, ``next_batch`` raises
:class:`~stream_persia.errors.StreamReplay` naming them (so does ``reset_stream`` to such
offsets), and the gauge ``partitions_replay_refused`` counts the partitions. A push the
servers refuse as a replay (another stream applied that offset: two workers on one
partition) fails its batch with StreamReplay, kept failed as above, with the same effects.
The worker then waits for the way back, a restore (its ``reset_stream`` to the
checkpoint's offsets, once the servers hold the checkpoint's cut), and does not exit: the
restore needs it to answer. A partition given no start offset whose servers hold a
restored cut nothing passed since starts at that cut by itself.

A served batch: ``{"batch_id", "requires_grad", "meta", "batch_size",
"non_id_type_features": [{"name", "data"}], "labels": [{"name", "data"}],
"embeddings": [{"name", "kind": "sum", "emb": f32 (batch, dim)} |
{"name", "kind": "raw", "emb": f32 (n+1, dim), "index": i64 (batch, k), "mask": bool}],
"event_time"?}`` (:mod:`stream_persia.core.served`). A batch's event time
(``PersiaBatch.event_time``) stays with it from ingest to its release: it is served with
the batch (training and evaluation alike) and sent with its gradient update to the
servers, whose ``trained_through`` is the newest one they applied.

Size: one module past 500 lines on purpose. The RPC schema above (STYLE.md habit 8) is a
sixth of it; the rest is one class, the role's RPC surface, whose handlers share its ready
buffer, in-flight table and router. Its parts already live beside it (``ingest``,
``pushes``, ``frontier``, ``mailbox``, ``router``, ``batchplan``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stream_persia.checkpoint.root import CheckpointRoot
from stream_persia.config import EmbeddingSchema
from stream_persia.core.backoff import wait_bounded
from stream_persia.core.data import PersiaBatch
from stream_persia.core.metrics import RoleMetrics
from stream_persia.core.replies import (
    FrontierReply,
    LostServerInfo,
    PushReply,
    WorkerHealth,
    WorkerStatus,
)
from stream_persia.core.served import ServedBatchWire, ServedSlotWire
from stream_persia.core.stages import StageCollector, newer
from stream_persia.core.supervisor import Supervisor
from stream_persia.core.watermarks import RESTORE_HINT, Refusal, check_topic
from stream_persia.errors import (
    Backpressure,
    BadInput,
    Misuse,
    ServerRestarted,
    StreamReplay,
    config_digest_param,
)
from stream_persia.rpc import RpcServer, auth
from stream_persia.rpc.server import CONNECTION_COUNTERS, ConnectionLimits
from stream_persia.worker.batchplan import BatchPlan, plan_batch
from stream_persia.worker.buffer import BoundedBuffer
from stream_persia.worker.frontier import Frontier
from stream_persia.worker.kafka_lag import KafkaLagCollector, LagRow
from stream_persia.worker.mailbox import CheckpointMailbox
from stream_persia.worker.nn_relay import NnRelayCollector
from stream_persia.worker.pushes import PUSHED_MEMORY, GradientPushes
from stream_persia.worker.router import ShardRouter, Table

if TYPE_CHECKING:  # imported by start_kafka_ingest: a broker-less worker never loads aiokafka
    from stream_persia.kafka.fingerprint import Fingerprint
    from stream_persia.worker.ingest import KafkaIngest

log = logging.getLogger(__name__)

__all__ = ["EmbeddingWorker", "PendingBatch"]

#: The supervisor's name for the condition "an embedding server restarted and is lost".
SERVERS_LOST = "embedding-servers"
#: How long ``health`` waits for a lost server to say whether it was restored since.
HEALTH_PROBE_MS = 1000
#: How far ahead of the worker's clock a batch's event time may be (clock skew, time
#: zones); one further ahead is refused (``prepare``; Kafka ingest dead-letters it).
MAX_EVENT_TIME_AHEAD_S = 86_400.0


@dataclass(eq=False)
class PendingBatch:
    """A validated, planned batch waiting to be served (and, if training, applied)."""

    batch_id: int
    batch: PersiaBatch
    plan: BatchPlan
    source: tuple[int, int] | None = None       # (partition, offset) when from Kafka
    stream: tuple[str, str] | None = None       # (topic, writer) of its Kafka stream
    received_s: float = field(default_factory=time.monotonic)
    missing: int = 0                             # ids absent from the servers (eval/infer)
    #: per server, the table its rows were looked up in: its update goes there or nowhere
    tables: dict[int, Table] = field(default_factory=dict)
    nbytes: int = 0                              # its arrays' bytes (the ready buffer's bound)


def _batch_nbytes(batch: PersiaBatch) -> int:
    """Bytes of a decoded batch's arrays (per slot, not per id). Decoded from a Kafka
    record or an RPC frame they are views of it, so this is about the bytes it pins."""
    total = sum(f.values.nbytes + f.offsets.nbytes for f in batch.id_type_features)
    for f in (*(batch.non_id_type_features or ()), *(batch.labels or ())):
        total += getattr(f.data, "nbytes", 0)
    return total


class EmbeddingWorker:
    """One embedding worker replica.

    Args:
        schema: the job's embedding config (slots, dims, prefixes).
        embedding_servers: addresses of every embedding server, in replica order.
        ready_buffer_batches: planned batches held ready for NN workers (bounded).
        max_inflight_lookups: lookups (training pulls, eval and inference lookups) run
            at once; more wait for one to finish.
        ready_buffer_bytes: and at most this many bytes of them (their decoded arrays and
            plans; one batch is always let in); None: no byte bound. While the buffer is
            full, Kafka ingest pauses its partitions and broker-less ``ingest`` waits.
        max_inflight_batches: served training batches awaiting gradients (bounded).
        push_retry_ms: how long a gradient push retries the servers that have not
            applied it before the batch fails (module docstring).
        on_server_restart: ``fail`` or ``continue``: what an embedding server that
            restarted (and lost its table) means (module docstring,
            :mod:`stream_persia.worker.router`).
        checkpoint_root: where checkpoints requested through the mailbox (replica 0) may
            go; None: such requests are refused.
        secret: the job's role secret, required of this worker's clients and proven to the
            embedding servers (see :class:`~stream_persia.rpc.RpcServer`).
        connection_limits: the RPC server's connection cap and timeouts.
    """

    def __init__(self, schema: EmbeddingSchema, embedding_servers: list[str], *,
                 replica_index: int = 0, replica_size: int = 1, host: str = "127.0.0.1",
                 port: int = 0, ready_buffer_batches: int = 16, max_inflight_lookups: int = 16,
                 max_inflight_batches: int = 64, rpc_timeout_ms: int = 10_000,
                 ingest_timeout_ms: int = 30_000, push_retry_ms: int = 20_000,
                 ready_buffer_bytes: int | None = 32 << 20, on_server_restart: str = "fail",
                 checkpoint_root: CheckpointRoot | str | None = None,
                 secret: auth.SecretSetting = auth.FROM_ENV,
                 connection_limits: ConnectionLimits = ConnectionLimits()):
        self.schema = schema
        self.replica_index = replica_index
        self.replica_size = replica_size
        secret = auth.resolve(secret)
        self.router = ShardRouter(embedding_servers, timeout_ms=rpc_timeout_ms, secret=secret,
                                  on_server_restart=on_server_restart,
                                  on_restart=self._server_restarted,
                                  on_lost=self._servers_lost)
        self.ready: BoundedBuffer[PendingBatch] = BoundedBuffer(
            ready_buffer_batches, "ready buffer", max_bytes=ready_buffer_bytes,
            size_of=(lambda pb: pb.nbytes) if ready_buffer_bytes is not None else None)
        self.max_inflight_batches = max_inflight_batches
        if max_inflight_lookups < 1:
            raise Misuse(f"max_inflight_lookups must be >= 1, got {max_inflight_lookups}",
                         field="max_inflight_lookups")
        self._lookups = asyncio.Semaphore(max_inflight_lookups)
        self.inflight: dict[int, PendingBatch] = {}
        self._inflight_room = asyncio.Semaphore(max_inflight_batches)
        self.frontier = Frontier()
        self._streams = 0                       # Kafka streams started (their writer ids)
        self._replay: StreamReplay | None = None   # serving would train batches twice
        self.ingest_timeout_ms = ingest_timeout_ms
        self.ingest_paused = asyncio.Event()    # set = paused (control plane)
        self._ingest_resumed = asyncio.Condition()   # notified by resume_ingest
        self._paused_line: deque[object] = deque()   # ingest calls waiting it out, in order
        if isinstance(checkpoint_root, str):
            checkpoint_root = CheckpointRoot(checkpoint_root)
        self.mailbox = (CheckpointMailbox(checkpoint_root=checkpoint_root)
                        if replica_index == 0 else None)
        self._seq = 0
        self.kafka: KafkaIngest | None = None   # the current ingest when consuming a topic
        # Builds a fresh KafkaIngest from start offsets (reset_stream after a restore).
        self.kafka_factory: Callable[[dict[int, int] | None], KafkaIngest] | None = None
        self.kafka_topic: str | None = None   # the samples topic it reads (with Kafka)
        self._kafka_retired: dict[str, float] = {}
        m = self.metrics = RoleMetrics("embedding_worker", replica_index)
        self.m_ingested = m.counter("batches_ingested_total", "batches accepted")
        self.m_rejected = m.counter("batches_rejected_total", "batches refused or dead-lettered",
                                    ("reason",))
        self.m_served = m.counter("batches_served_total", "batches served to NN workers")
        self.m_truncated = m.counter(
            "ids_truncated_total", "ids of accepted batches that a raw slot keeps no row for "
            "(past sample_fixed_size in their sample)", ("slot",))
        self._truncation_logged: set[str] = set()
        self.m_lookup_s = m.histogram("lookup_seconds", "embedding lookup latency",
                                      buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, 1))
        self.m_server_restarts = m.counter(
            "server_restarts_total", "embedding server restarts seen (a new process at its "
            "address, without the rows the old one held)", ("server",))
        m.add_callback("servers", lambda: {"lost": float(len(self.router.lost))})
        self.push_retry_ms = push_retry_ms
        self.pushes = GradientPushes(self.router, m, name=f"embedding worker {replica_index}",
                                     on_applied=self._applied,
                                     on_replay=self._replayed)
        m.add_callback("partitions", lambda: {"replay_refused": float(
            len(self.kafka.refused) if self.kafka is not None else 0)})
        m.add_callback("buffer", lambda: {"ready": len(self.ready),
                                          "ready_bytes": self.ready.bytes,
                                          "inflight": len(self.inflight),
                                          "pending": self.frontier.pending(),
                                          "failed": len(self.pushes.failed())})
        # Long-running tasks (the Kafka ingest loop) are watched: one that fails makes
        # health answer not ok and the launched role exit 1 (stream_persia.core.supervisor).
        self.supervisor = Supervisor(f"embedding worker {replica_index}", m)
        self.rpc = RpcServer({
            "health": self._health, "ingest": self._ingest, "next_batch": self._next_batch,
            "push_gradients": self._push_gradients, "lookup_batch": self._lookup_batch,
            "status": self._status, "pause_ingest": self._pause, "resume_ingest": self._resume,
            "servers": self._servers, "schema": self._schema, "metrics": self._metrics,
            "return_batches": self._return_batches, "frontier": self._frontier,
            "reset_stream": self._reset_stream, "check_stream": self._check_stream,
            "commit_offsets": self._commit_offsets, "fingerprints": self._fingerprints,
            # Replica 0 holds the checkpoint mailbox (checkpoints started over HTTP).
            **(self.mailbox.handlers() if self.mailbox is not None else {}),
        }, host=host, port=port, name=f"embedding-worker-{replica_index}", secret=secret,
            connection_limits=connection_limits)
        m.add_callback("rpc", self.rpc.connection_stats, counters=CONNECTION_COUNTERS)
        # Stage watermarks (stream_persia.core.stages) and, on replica 0, what NN rank 0's
        # heartbeat relays (stream_persia.worker.nn_relay).
        self.ingested_mark: float | None = None
        m.registry.register(StageCollector(self.watermarks))
        if self.mailbox is not None:
            m.registry.register(NnRelayCollector(self.mailbox.relay))

    def _kafka_stats(self) -> dict[str, float]:
        """The current ingest's statistics, its counts added to those of retired ones."""
        stats = dict(self._kafka_retired)
        if self.kafka is not None:
            for key, value in self.kafka.stats().items():
                stats[key] = stats.get(key, 0.0) + value
        return stats

    # ----------------------------------------------------------------- lifecycle
    async def start_kafka_ingest(
            self, factory: Callable[[dict[int, int] | None], KafkaIngest]) -> None:
        """Feed this worker from Kafka: ``factory(start_offsets)`` builds a
        :class:`~stream_persia.worker.ingest.KafkaIngest` (``None``: the consumer group's
        offsets), now and again on each ``reset_stream``. The worker stops it in
        :meth:`stop`. Only a worker fed from Kafka exports the ``kafka_*`` metrics.

        Raises:
            Misuse: the worker is fed from Kafka already.
        """
        from stream_persia.worker.ingest import KafkaIngest

        if self.kafka_factory is not None:
            raise Misuse(f"embedding worker {self.replica_index} is fed from Kafka already",
                         hint="call start_kafka_ingest once; reset_stream replays the topic")
        ingest = factory(None)
        self.kafka_factory = factory
        self.kafka_topic = ingest.consumer.topic
        # One collector for the Kafka counters, whichever KafkaIngest is current:
        # reset_stream replaces it, and the counts of the ones it retired are carried so
        # the exported counters never drop.
        self._kafka_retired = dict.fromkeys(KafkaIngest.COUNTERS, 0.0)
        self.metrics.add_callback("kafka", self._kafka_stats, counters=KafkaIngest.COUNTERS)
        self.metrics.registry.register(KafkaLagCollector(self.kafka_lag, self.kafka_lag_age))
        self.kafka = ingest
        await self._start_ingest(ingest)

    async def _start_ingest(self, ingest: KafkaIngest) -> None:
        await ingest.start()
        if ingest.task is not None:
            self.supervisor.watch(ingest.task, "kafka-ingest")

    async def start(self) -> None:
        await self.rpc.start()
        log.info("embedding worker %d/%d on %s, servers %s", self.replica_index,
                 self.replica_size, self.rpc.address, self.router.addresses)

    async def stop(self) -> None:
        if self.kafka is not None:
            await self.kafka.stop()
        await self.rpc.stop()   # drains requests, pushes waiting on their task included
        failed = await self.pushes.reset()
        if failed:
            log.error("embedding worker %d stops with %d failed batch(es) whose gradients "
                      "only some servers applied: %s", self.replica_index, len(failed),
                      self.pushes.summary(failed))
        await self.router.close()

    @property
    def address(self) -> str:
        return self.rpc.address

    # ----------------------------------------------------------------- ingest
    def prepare(self, batch: PersiaBatch, source: tuple[int, int] | None = None,
                stream: tuple[str, str] | None = None) -> PendingBatch:
        """Validate a decoded batch against the schema and plan its lookups.

        The ids' CSR is not checked again: ``PersiaBatch.from_wire`` / ``from_bytes``
        checked it when decoding (a bad one raised there, named by its field, and Kafka
        ingest dead-lettered it).

        Raises:
            BadInput: unknown slot, disagreeing batch sizes (names the field), or an
                event time more than ``MAX_EVENT_TIME_AHEAD_S`` ahead of this worker's
                clock (milliseconds sent as seconds, say): watermarks only go up, so one
                such batch would claim every ``ingested`` and ``trained`` watermark,
                checkpoint and served answer after it as trained through that time.
        """
        ahead = (batch.event_time or 0.0) - time.time()
        if ahead > MAX_EVENT_TIME_AHEAD_S:
            raise BadInput(f"batch.event_time {batch.event_time!r} is {ahead / 86_400:,.1f} "
                           f"days ahead of this worker's clock (at most "
                           f"{MAX_EVENT_TIME_AHEAD_S / 3600:g} h is accepted)",
                           field="batch.event_time",
                           hint="seconds since the Unix epoch, like time.time(), not "
                                "milliseconds")
        plan = plan_batch(batch.id_type_features, self.schema,
                          requires_grad=batch.requires_grad, csr_checked=True)
        batch_id = self._seq * self.replica_size + self.replica_index
        self._seq += 1
        pb = PendingBatch(batch_id, batch, plan, source, stream)
        pb.nbytes = _batch_nbytes(batch) + plan.nbytes()
        return pb

    def accepted(self, pb: PendingBatch) -> None:
        """``pb`` is in the ready buffer: count it, and the ids its raw slots keep no row
        for (logged once per slot), and move the ``ingested`` watermark."""
        self.m_ingested.inc()
        for slot, n in pb.plan.truncated.items():
            self.m_truncated.labels(slot).inc(n)
            if slot not in self._truncation_logged:
                self._truncation_logged.add(slot)
                log.warning("slot %r: samples with more than sample_fixed_size=%d ids keep "
                            "their first %d (PERSIA's rule); the ids past them get no "
                            "embedding (counted in ids_truncated_total{slot}; raise "
                            "sample_fixed_size in embedding_config.yml to keep them)", slot,
                            self.schema.slot(slot).sample_fixed_size,
                            self.schema.slot(slot).sample_fixed_size)
        self.saw_ingested(pb.batch.event_time)

    def saw_ingested(self, event_time: float | None) -> None:
        """A batch with ``event_time`` was accepted (the ``ingested`` watermark)."""
        self.ingested_mark = newer(self.ingested_mark, event_time)

    def watermarks(self) -> dict[str, float | None]:
        """This worker's stage watermarks (:mod:`stream_persia.core.stages`)."""
        marks: dict[str, float | None] = {"ingested": self.ingested_mark}
        if self.kafka is not None:
            marks["produced"] = newer(self.kafka.lag.produced(), self.ingested_mark)
        relay = self.mailbox.relay() if self.mailbox is not None else None
        if relay is not None:
            marks["trained"] = relay[0]["trained"]
        return marks

    def kafka_lag(self) -> list[LagRow]:
        """Per partition of the current Kafka ingest, its lag (empty without one)."""
        return self.kafka.lag.rows() if self.kafka is not None else []

    def kafka_lag_age(self) -> float | None:
        """Seconds since the current Kafka ingest's last lag probe that succeeded."""
        return self.kafka.lag.probe_age_s() if self.kafka is not None else None

    def reject(self, reason: str) -> None:
        self.m_rejected.labels(reason).inc()

    @staticmethod
    def _timeout_ms(params: Any, default: float) -> float:
        value = params.get("timeout_ms", default) if isinstance(params, dict) else default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise BadInput(f"timeout_ms must be a number >= 0, got {value!r}",
                           field="timeout_ms")
        return float(value)

    @staticmethod
    def _batch_param(params: Any, method: str) -> PersiaBatch:
        """The (fully validated) batch of an ``ingest`` or ``lookup_batch`` request."""
        if not isinstance(params, dict) or not isinstance(params.get("batch"), dict):
            raise BadInput(f"{method} needs {{'batch': <PersiaBatch wire dict>}}",
                           field="batch")
        return PersiaBatch.from_wire(params["batch"])

    async def _ingest(self, params: Any) -> dict:
        timeout_ms = self._timeout_ms(params, self.ingest_timeout_ms)
        try:
            pb = self.prepare(self._batch_param(params, "ingest"))
        except BadInput as e:
            self.reject(type(e).__name__)
            raise
        deadline = time.monotonic() + float(timeout_ms) / 1000.0
        if self.ingest_paused.is_set() or self._paused_line:
            await self._wait_ingest_resumed(deadline, timeout_ms)
        await self.ready.put(pb, timeout=max(0.0, deadline - time.monotonic()))
        self.accepted(pb)
        return {"batch_id": pb.batch_id}

    async def _wait_ingest_resumed(self, deadline: float, timeout_ms: float) -> None:
        """Wait while ingest is paused (``pause_ingest``), until ``deadline``. The calls
        that waited go on in the order they came, and one arriving before they all went on
        queues behind them: pipelined sends from one data loader keep their order through
        a pause (:class:`~stream_persia.worker.buffer.BoundedBuffer` keeps it from there)."""
        turn = object()
        async with self._ingest_resumed:
            self._paused_line.append(turn)
            try:
                while self.ingest_paused.is_set() or self._paused_line[0] is not turn:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Backpressure(
                            f"ingest is paused on embedding worker {self.replica_index} and "
                            f"was not resumed within timeout_ms={timeout_ms}",
                            field="timeout_ms",
                            hint="resume it (resume_ingest, POST /v1/ingest/resume) or "
                                 "retry later")
                    # Capped so that a flag cleared without resume_ingest is seen soon too.
                    with contextlib.suppress(TimeoutError):
                        await wait_bounded(self._ingest_resumed.wait(), min(left, 0.25))
            finally:
                self._paused_line.remove(turn)
                self._ingest_resumed.notify_all()   # the next in line goes on

    # ----------------------------------------------------------------- serving
    async def _embed(self, pb: PendingBatch, mode: str) -> list[ServedSlotWire]:
        t0 = time.perf_counter()
        # Per dim, one pooled lookup of the summation slots (the servers pool them) and
        # one classic lookup of the raw and hash-stacked slots (batchplan).
        merged, groups = pb.plan.lookup_groups()
        async with self._lookups:   # embedding_worker_config.max_inflight_lookups
            results, missing = await self.router.lookup(groups, mode, seen=pb.tables)
        pooled = pb.plan.outputs(merged, results)
        self.m_lookup_s.observe(time.perf_counter() - t0)
        out: list[ServedSlotWire] = []
        for name, o in pooled.items():
            if pb.plan.is_summation(name):
                out.append({"name": name, "kind": "sum", "emb": o.embeddings})
            else:
                assert o.index is not None and o.mask is not None   # a raw slot's output
                out.append({"name": name, "kind": "raw", "emb": o.embeddings,
                            "index": o.index, "mask": o.mask})
        pb.missing = missing
        return out

    @staticmethod
    def _served(pb: PendingBatch, embeddings: list[ServedSlotWire]) -> ServedBatchWire:
        b = pb.batch
        served: ServedBatchWire = {
            "batch_id": pb.batch_id, "requires_grad": bool(b.requires_grad),
            "meta": b.meta, "batch_size": b.batch_size, "embeddings": embeddings,
            "non_id_type_features": [{"name": f.name, "data": f.data}
                                     for f in (b.non_id_type_features or [])],
            "labels": [{"name": f.name, "data": f.data} for f in (b.labels or [])],
        }
        if b.event_time is not None:
            served["event_time"] = b.event_time
        return served

    async def _next_batch(self, params: Any) -> ServedBatchWire | None:
        if self._replay is not None:   # the NN side must hear it, not wait for batches
            raise StreamReplay(self._replay.message, field=self._replay.field,
                               hint=self._replay.hint)
        timeout_ms = self._timeout_ms(params, 1000)
        want = config_digest_param(params)
        if want is not None and self.router.config is None \
                and await self.router.learn() is None:
            self._all_servers_unconfigured(want)
        deadline = time.monotonic() + timeout_ms / 1000.0
        # Room for one more in-flight batch first, so a batch is never taken off the ready
        # buffer only to wait there. With room to spare (the usual case) the permit is
        # taken at once, without the task and timer of a wait_for.
        left = deadline - time.monotonic()
        if left > 0 and not self._inflight_room.locked():
            await self._inflight_room.acquire()   # returns without suspending
        else:
            try:
                await asyncio.wait_for(self._inflight_room.acquire(), max(0.0, left))
            except TimeoutError:
                return None
        pb = await self.ready.get(timeout=max(0.0, deadline - time.monotonic()))
        if pb is None:
            self._inflight_room.release()
            return None
        training = bool(pb.batch.requires_grad)
        try:
            embeddings = await self._embed(pb, "train" if training else "eval")
        except BaseException:
            await self.ready.put_front(pb)   # not lost: first in line for the next pull
            self._inflight_room.release()
            raise
        if training:
            self.inflight[pb.batch_id] = pb
        else:
            self._inflight_room.release()
            self._settle(pb)
        self.m_served.inc()
        served = self._served(pb, embeddings)
        if self.router.config is not None:
            served["config"] = self.router.config["digest"]
        return served

    def _all_servers_unconfigured(self, want: str) -> None:
        """The NN side configured the servers (``want``), but none holds a configuration
        now: they all restarted (and this worker with them, or it would know it) and lost
        their tables. ``fail``: ServerRestarted, every server lost. ``continue``: a Misuse
        on field ``config``: the NN side configures them again and retries (serving now
        would look up and train with the defaults)."""
        where = f"embedding worker {self.replica_index}"
        servers = ", ".join(f"{i} ({a})" for i, a in enumerate(self.router.addresses))
        if self.router.on_server_restart == "fail":
            error = ServerRestarted(
                f"{where}: no embedding server holds a configuration, but the NN side set "
                f"{want}: every server ({servers}) restarted since and lost the rows it "
                f"held, with their optimizer state", field="config",
                hint="restore the newest checkpoint (it configures the servers too); "
                     "embedding_worker_config.on_server_restart: continue would configure "
                     "them again and train on without those rows")
            log.error("%s", error.message)
            self.router.mark_lost(error)
            raise error
        log.error("%s: no embedding server holds a configuration, but the NN side set %s: "
                  "every server (%s) restarted since; the NN side configures them again "
                  "and training goes on without their rows (on_server_restart: continue)",
                  where, want, servers)
        for s in range(self.router.num_shards):
            self._server_restarted(s)
        raise Misuse(f"{where}: no embedding server holds a configuration, but the caller "
                     f"expects {want} (they restarted)", field="config",
                     hint="configure the embedding servers again (NN workers do so "
                          "by themselves)")

    async def _lookup_batch(self, params: Any) -> ServedBatchWire:
        batch = self._batch_param(params, "lookup_batch")
        mode = params.get("mode", "eval")
        if mode not in ("eval", "infer"):
            raise BadInput(f"mode must be 'eval' or 'infer', got {mode!r}", field="mode")
        pb = PendingBatch(-1, batch, plan_batch(batch.id_type_features, self.schema,
                                                requires_grad=False, csr_checked=True))
        served = self._served(pb, await self._embed(pb, mode))
        served["missing"] = pb.missing
        return served

    async def _push_gradients(self, params: Any) -> PushReply:
        if not isinstance(params, dict):
            raise BadInput("push_gradients takes a map", field="params")
        batch_id = params.get("batch_id")
        pb = None
        if isinstance(batch_id, int) and not isinstance(batch_id, bool):
            if (first := self.pushes.recent(batch_id)) is not None:
                return first   # applied; its reply was lost on the way
            pb = self.inflight.get(batch_id)
        if pb is None:
            raise BadInput(f"batch_id {batch_id!r} is not a batch in flight on this worker "
                           f"(nor one of the last {PUSHED_MEMORY} it applied)",
                           field="batch_id",
                           hint="gradients go to the worker that served the batch; a worker "
                                "that restarted has forgotten the batches it served")
        retry_s = min(self._timeout_ms(params, self.push_retry_ms), self.push_retry_ms) / 1000
        return await self.pushes.push(pb.batch_id, pb.plan, pb.source, params.get("grads"),
                                      retry_s, stream=pb.stream,
                                      event_time=pb.batch.event_time,
                                      # pinned where a restore replays the batch
                                      tables=pb.tables if pb.source is not None else None)

    def _applied(self, batch_id: int) -> None:
        """Every server applied ``batch_id``'s gradients: release it."""
        pb = self.inflight.pop(batch_id)
        self._inflight_room.release()
        self._settle(pb)

    def _settle(self, pb: PendingBatch) -> None:
        if pb.source is not None:
            self.frontier.done(*pb.source)

    # ----------------------------------------------------------------- control
    def problems(self) -> list[str]:
        """Why this worker is unhealthy (empty: healthy): a background task failed (the
        launched role exits), serving its stream would train batches twice (until a
        restore), or batches whose push failed are held."""
        problems = [self.supervisor.error] if self.supervisor.error else []
        if self._replay is not None:
            problems.append(self._replay.message)
        failed = self.pushes.failed()
        if failed:
            problems.append(f"{len(failed)} batch(es) whose gradients could not be applied "
                            f"on every embedding server (checkpoints refuse): "
                            f"{self.pushes.summary(failed)}")
        return problems

    # ----------------------------------------------------------------- stream replays
    def new_stream_writer(self) -> str:
        """A new Kafka stream's id on the servers' watermarks: this process and how many
        streams it started (each ``reset_stream`` starts one)."""
        self._streams += 1
        return f"{self.pushes.incarnation}.{self._streams}"

    def _replayed(self, err: StreamReplay) -> None:
        """A push the servers refused as a replay (another stream applied that offset):
        stop serving until a restore resets the stream."""
        self._replay = err

    def stream_checked(self, refused: list[Refusal]) -> None:
        """A Kafka stream started (:class:`~stream_persia.worker.ingest.KafkaIngest`):
        report the partitions it refused because the servers applied them already, or,
        with none refused, withdraw an earlier report (a restore's ``reset_stream``)."""
        if not refused:
            if self._replay is not None:
                log.warning("embedding worker %d: the stream was reset to where the servers "
                            "stand (a restore); serving again", self.replica_index)
            self._replay = None
            return
        who = f"embedding worker {self.replica_index}"
        lines = [r.describe(who, self.router.addresses) for r in refused]
        for line in lines:
            log.error("%s; waiting for a restore (hint: %s)", line, RESTORE_HINT)
        more = f"; and {len(lines) - 3} more partition(s)" if len(lines) > 3 else ""
        self._replay = StreamReplay("; ".join(lines[:3]) + more, field="offset",
                                    hint=RESTORE_HINT)

    # ----------------------------------------------------------------- server restarts
    def _server_restarted(self, s: int) -> None:
        self.m_server_restarts.labels(str(s)).inc()

    def _servers_lost(self) -> None:
        """The router's lost servers changed: the worker is unhealthy while any is lost
        (reported to the supervisor, so a launched worker exits 1 unless a restore
        resolves it within the grace)."""
        lost = self.router.lost
        if not lost:
            self.supervisor.resolve(SERVERS_LOST)
            return
        first = lost[min(lost)].error
        more = f" (and {len(lost) - 1} more server(s))" if len(lost) > 1 else ""
        self.supervisor.report(SERVERS_LOST, ServerRestarted(
            f"{first.message}{more}; checkpoints refuse, lookups and pushes that need it "
            f"fail", field=first.field, hint=first.hint))

    def _lost_servers(self) -> list[LostServerInfo]:
        return [{"server": s, "address": self.router.addresses[s],
                 "error": lost.error.message} for s, lost in sorted(self.router.lost.items())]

    async def _health(self, params: Any) -> WorkerHealth:
        if self.router.lost:   # restored since? (a restore replaced the table)
            await self.router.recheck(timeout_ms=HEALTH_PROBE_MS)
        problems = self.problems()
        return {"ok": not problems, "role": "embedding-worker",
                "replica_index": self.replica_index,
                "replica_size": self.replica_size, "ready": len(self.ready),
                "inflight": len(self.inflight), "error": "; ".join(problems) or None}

    async def _status(self, params: Any) -> WorkerStatus:
        kafka = await self.kafka.status() if self.kafka is not None else None
        # One snapshot, taken after the last await: a lag probe finishing while the
        # ingest's status awaited the broker would otherwise leave the watermarks older
        # than the lag rows (a ``produced`` below the tail the rows' seconds were read from).
        status: WorkerStatus = {
            "replica_index": self.replica_index, "ready": len(self.ready),
            "ready_capacity": self.ready.maxsize, "ready_bytes": self.ready.bytes,
            "ready_capacity_bytes": self.ready.max_bytes, "inflight": len(self.inflight),
            "pending": self.frontier.pending(),
            "frontier": {str(p): o for p, o in self.frontier.offsets().items()},
            "ingest_paused": self.ingest_paused.is_set(), "failed": self.pushes.failed(),
            "watermarks": self.watermarks(),
        }
        if kafka is not None:
            status["kafka"] = kafka
            status["kafka_lag"] = self.kafka_lag()
        return status

    async def _pause(self, params: Any) -> None:
        self.ingest_paused.set()

    async def _resume(self, params: Any) -> None:
        self.ingest_paused.clear()
        async with self._ingest_resumed:   # wake the waiting ingest calls
            self._ingest_resumed.notify_all()

    async def _servers(self, params: Any) -> list[str]:
        return self.router.addresses

    async def _schema(self, params: Any) -> dict[str, Any]:
        return self.schema.to_dict()

    async def _metrics(self, params: Any) -> bytes:
        return self.metrics.render()

    # ----------------------------------------------------------------- checkpoints
    async def _return_batches(self, params: Any) -> None:
        ids = params.get("batch_ids") if isinstance(params, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise BadInput("return_batches needs {'batch_ids': [int, ...]}", field="batch_ids")
        unknown = [i for i in ids if i not in self.inflight]
        if unknown:
            raise BadInput(f"batch ids {unknown} are not in flight on this worker",
                           field="batch_ids")
        pushed = [i for i in ids if self.pushes.started(i)]
        if pushed:
            # Pushing or failed: some servers may hold its gradients; served again, they
            # would be applied twice there.
            raise BadInput(f"batch ids {pushed} have been pushed (their gradients may be "
                           f"applied on some servers): they cannot be served again",
                           field="batch_ids", hint="push them again to complete them")
        # Back to the head in served order: the oldest must be served first again.
        for pb in sorted((self.inflight.pop(i) for i in ids), key=lambda b: b.batch_id,
                         reverse=True):
            await self.ready.put_front(pb)
            self._inflight_room.release()

    async def _frontier(self, params: Any) -> FrontierReply:
        # Every server still the process this worker trained through? A checkpoint must
        # not record a restarted server's empty table as trained (``lost``).
        await self.router.verify()
        if self.kafka is not None:
            self.kafka.track_added()
        reply: FrontierReply = {
            "stream": "kafka" if self.kafka is not None else "direct",
            "offsets": {str(p): o for p, o in self.frontier.offsets().items()},
            "inflight": len(self.inflight), "pending": self.frontier.pending(),
            "failed": self.pushes.failed(), "lost": self._lost_servers()}
        if self.kafka is not None and self.kafka.consumer.num_partitions:
            reply["topic_partitions"] = self.kafka.consumer.num_partitions
        return reply

    @staticmethod
    def _offsets_param(params: Any) -> dict[int, int]:
        raw = params.get("offsets") if isinstance(params, dict) else None
        if not isinstance(raw, dict):
            raise BadInput("needs {'offsets': {partition: offset}}", field="offsets")
        try:
            offsets = {int(p): int(o) for p, o in raw.items()}
        except (TypeError, ValueError):
            raise BadInput(f"offsets must map partition numbers to offsets, got {raw!r}",
                           field="offsets") from None
        if any(p < 0 or o < 0 for p, o in offsets.items()):
            raise BadInput("partitions and offsets must be >= 0", field="offsets")
        return offsets

    def _fingerprints_param(self, params: Any) -> dict[int, Fingerprint] | None:
        """The restore's fingerprints (None: the caller sent none, from before them, or
        this worker has no Kafka stream, which the restore refuses)."""
        if not isinstance(params, dict) or "fingerprints" not in params \
                or self.kafka_factory is None:
            return None
        from stream_persia.kafka.fingerprint import parse_fingerprints

        return parse_fingerprints(params["fingerprints"])

    async def _check_replayable(self, offsets: dict[int, int],
                                fingerprints: dict[int, Fingerprint] | None
                                ) -> Callable[[dict[int, int] | None], KafkaIngest]:
        """BadInput (no stream, an offset beyond the end) or KafkaDataLoss (deleted, or a
        recreated topic) unless the brokers still have ``offsets``; returns the Kafka
        ingest factory."""
        factory = self.kafka_factory
        if factory is None:
            raise BadInput("this worker has no Kafka stream to reset (broker-less mode "
                           "cannot replay)", field="offsets",
                           hint="run with --kafka for exactly-once restore")
        if self.kafka is not None:
            await self.kafka.check_offsets(offsets, fingerprints)
        return factory

    def _check_topic(self, params: Any) -> None:
        """BadInput when ``params`` names another topic than the one this worker reads (a
        checkpoint of another job: its offsets would be applied to this topic's
        partitions). Without ``topic`` (a caller from before the field) nothing is checked."""
        topic = params.get("topic") if isinstance(params, dict) else None
        if topic is None:
            return
        topic = check_topic(topic, "topic")
        if self.kafka_topic is not None and topic != self.kafka_topic:
            raise BadInput(f"its offsets are of topic {topic!r}, but embedding worker "
                           f"{self.replica_index} reads {self.kafka_topic!r}: they are "
                           f"positions in another stream", field="topic",
                           hint="restore a checkpoint of this job (its kafka.samples_topic)")

    async def _check_stream(self, params: Any) -> None:
        # Asked before a restore loads anything: servers found restarted are not checked
        # here (the load that follows is what brings them back; reset_stream checks them).
        self._check_topic(params)
        await self._check_replayable(self._offsets_param(params),
                                     self._fingerprints_param(params))

    async def _fingerprints(self, params: Any) -> dict[str, dict[str, int | str]]:
        offsets = self._offsets_param(params)
        if self.kafka is None:
            return {}
        taken = await self.kafka.consumer.fingerprints(offsets)
        return {str(p): fp.to_dict() for p, fp in sorted(taken.items())}

    async def _reset_stream(self, params: Any) -> dict:
        self._check_topic(params)
        offsets = self._offsets_param(params)
        fingerprints = self._fingerprints_param(params)
        # Offsets the brokers no longer have (or never had), or of another topic than the
        # checkpoint's (recreated), are refused before anything held here is dropped.
        factory = await self._check_replayable(offsets, fingerprints)
        # A restore loaded the servers first: those found restarted are served again now.
        # One still lost was not restored: replaying onto its empty table would not be
        # exactly-once, so nothing is reset.
        await self.router.recheck()
        if self.router.lost:
            first = self.router.lost[min(self.router.lost)].error
            raise ServerRestarted(f"embedding worker {self.replica_index} does not reset its "
                                  f"stream: {first.message}; no checkpoint was restored into "
                                  f"it since", field=first.field, hint=first.hint)
        if self.kafka is not None:
            await self.kafka.stop()
            retired = self.kafka.stats()
            for key in self._kafka_retired:
                self._kafka_retired[key] += retired.get(key, 0)
            self.kafka = None
        failed = await self.pushes.reset()
        if failed:
            log.warning("embedding worker %d: the stream is reset (a restore): dropping %d "
                        "failed batch(es): %s", self.replica_index, len(failed),
                        self.pushes.summary(failed))
        for _ in range(len(self.inflight)):
            self._inflight_room.release()
        self.inflight.clear()
        await self.ready.clear()
        self.kafka = factory(offsets)
        self.kafka.start_fingerprints = fingerprints
        await self._start_ingest(self.kafka)
        if self._replay is not None:   # the offsets start below what the servers applied
            raise StreamReplay(self._replay.message, field="offsets", hint=self._replay.hint)
        return {"offsets": {str(p): o for p, o in self.frontier.offsets().items()}}

    async def _commit_offsets(self, params: Any) -> bool:
        offsets = self._offsets_param(params)
        if self.kafka is None:
            return False
        mine = {p: o for p, o in offsets.items() if p in self.kafka.consumer.partitions}
        return await self.kafka.consumer.commit(mine) if mine else False
