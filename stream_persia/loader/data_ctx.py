"""``DataCtx``: how a data loader sends ``PersiaBatch``es into a job (PERSIA's DataCtx).

Two paths behind one interface, chosen once when the context is built (:attr:`DataCtx.mode`):

- ``"kafka"``: batches are encoded (``PersiaBatch.to_bytes``) and produced to the samples
  topic by an idempotent ``acks=all`` producer (compression from
  ``kafka.compression_type``: none, gzip, snappy, lz4 or zstd). The stream is
  durable, so embedding workers can replay it from a checkpoint: **replay and
  exactly-once training need this path.**
- ``"direct"`` (broker-less, PERSIA's own path): batches go straight to the embedding
  workers over RPC (``ingest``), round-robin, starting at ``REPLICA_INDEX``
  (:mod:`stream_persia.loader.direct_sender`). Same validation, bounded buffers and
  backpressure, but nothing is replayable.

Where the destination comes from (first match wins): the ``embedding_workers`` or
``kafka_bootstrap_servers`` argument (not both), env ``KAFKA_BOOTSTRAP_SERVERS``,
``kafka.bootstrap_servers`` in the global config, env ``PERSIA_EMBEDDING_WORKERS``, and
with none of these (zero-config, one host) the embedding workers' well-known local ports
(:mod:`stream_persia.rpc.local_ports`; ``PERSIA_BASE_PORT``), found by ``start()``, which
waits for them up to ``startup_timeout_ms``.

Semantics:

- **Event time.** A batch without an ``event_time`` is sent with the producer's clock
  (``time.time()`` when ``send_data`` is called); one the user gave is kept as given.
  The caller's batch object is not changed (a shallow copy carries the stamp). Freshness
  of the served model is measured from it (:mod:`stream_persia.core.data`).
- **Validation.** A ``PersiaBatch`` checks itself when built; :meth:`DataCtx.send_data`
  refuses anything else (``BadInput``) and, given an embedding config (argument or
  ``PERSIA_EMBEDDING_CONFIG``), refuses ID features of unknown slots before sending.
  Workers re-check every batch: a bad one is dead-lettered (Kafka) or refused (direct;
  the error surfaces here).
- **Backpressure.** At most ``max_inflight`` batches are sent but unacknowledged (by the
  brokers, or by a worker once the batch is in its ready buffer). ``send_data`` returns
  as soon as its batch is queued and blocks while ``max_inflight`` are outstanding; with
  no room after ``timeout_ms`` the send fails with ``Backpressure``.
- **Failures** of a batch after ``send_data`` returned are raised from a later
  ``send_data``, ``flush`` or ``close``: the first one; later ones are logged and counted
  (``stats()["failed"]``).
- **Start-up.** The destination may come up after the data loader: Kafka, ``start()``
  (entering the ``with`` block) waits until a broker answers (then the topic must
  exist); broker-less, the first batch waits until every embedding worker answers (so
  bad input is still reported before any peer is needed). Both retry with exponential
  backoff, log each failure, and give up after ``startup_timeout_ms`` (default
  ``kafka.startup_timeout_ms``, 60 s) with ``PeerUnavailable`` naming the addresses.
- **A broker that goes away** while batches wait for acknowledgement fails the next
  ``send_data``/``flush`` with ``KafkaUnavailable`` (a ``PeerUnavailable`` naming the
  bootstrap servers) once no broker has answered for ``kafka.broker_timeout_ms``.
- **flush / close.** ``flush()`` waits until every batch sent so far is acknowledged.
  Leaving the ``with`` block flushes and closes. When the block raised, the flush waits
  at most 10 s, a failure is logged, and the block's own exception propagates.
- **Ordering.** Kafka: call order is kept within each partition (the idempotent producer
  keeps one request per partition in flight). Batches with a ``batch_id`` are keyed by it,
  so they spread over partitions by hash, and there is no order across partitions; with
  one partition the order is the call order. Direct: with one worker the call order is
  kept, whatever ``max_inflight`` (the worker takes waiting sends in the order they came,
  through a full buffer and a pause), unless a connection drops and a send is repeated;
  with several, batches go round-robin and a full worker's batch moves on to the next.
- **Delivery.** Kafka: retries never duplicate a record (idempotence). Direct: at least
  once while the context lives — a send whose worker connection drops or times out is
  retried on the next worker and may be ingested twice — and a batch buffered in a worker
  that dies is lost.
- **Threads.** Use a context from one thread at a time (overlapping calls raise
  ``Misuse``).
- **Snapshot.** What is sent is the batch as it was when ``send_data`` was called: Kafka
  encodes it then, broker-less copies its arrays then (they are encoded later, on the
  loop thread). A data loader may refill its arrays for the next batch at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from stream_persia.config import (
    EmbeddingSchema,
    GlobalConfig,
    load_embedding_config,
    load_global_config,
    resolve_bootstrap_servers,
)
from stream_persia.config._base import parse_addresses
from stream_persia.core.aio import LoopThread
from stream_persia.core.data import PersiaBatch
from stream_persia.errors import (
    BadInput,
    ConfigError,
    InternalError,
    Misuse,
    RemoteTimeout,
)
from stream_persia.rpc import local_ports

log = logging.getLogger(__name__)

__all__ = ["DataCtx"]

_PERSIA_ONLY_KWARGS = {"threadpool_worker_size", "device_id"}  # accepted, meaningless here
_CLOSE_TIMEOUT_S = 30.0
_ABORT_FLUSH_S = 10.0        # flush bound when the ``with`` block raised


def _workers(value: Any, field: str) -> list[str]:
    text = parse_addresses(value, field)
    return text.split(",") if text else []


def _replica_index() -> int:
    raw = os.environ.get("REPLICA_INDEX", "").strip() or "0"
    if not raw.isdigit():
        raise ConfigError(f"environment REPLICA_INDEX={raw!r} is not an int >= 0",
                          field="REPLICA_INDEX")
    return int(raw)


def _run(loop: LoopThread, coro: Any, timeout_s: float | None = None) -> Any:
    """``loop.run`` that tells a timeout apart from the coroutine's own ``RemoteTimeout``
    (a ``TimeoutError`` too, which ``LoopThread.run`` would take for its own)."""
    fut = loop.submit(coro)
    try:
        return fut.result(timeout_s)
    except concurrent.futures.TimeoutError:
        if fut.done():
            raise
        fut.cancel()
        raise RemoteTimeout(f"DataCtx: {coro.__qualname__} took over {timeout_s} s",
                            field="timeout_ms") from None


class DataCtx:
    """Send ``PersiaBatch``es to the embedding workers, through Kafka or directly.

    Args:
        embedding_workers: broker-less mode: worker ``host:port`` addresses (default: env
            ``PERSIA_EMBEDDING_WORKERS``, used when no Kafka address is configured).
        kafka_bootstrap_servers: Kafka mode (default: env ``KAFKA_BOOTSTRAP_SERVERS``,
            then ``kafka.bootstrap_servers`` of the global config).
        global_config: a ``GlobalConfig`` or a path (default: env ``PERSIA_GLOBAL_CONFIG``).
        max_inflight: batches sent but not yet acknowledged before ``send_data`` waits.
        timeout_ms: how long one batch may wait for room before it fails with
            ``Backpressure`` (Kafka: also the longest ``flush``).
        topic: the samples topic (default ``kafka.samples_topic``); Kafka mode only.
        compression_type: none|gzip|snappy|lz4|zstd (default ``kafka.compression_type``);
            Kafka mode only.
        embedding_config: an ``EmbeddingSchema`` or a path (default: env
            ``PERSIA_EMBEDDING_CONFIG``, if set); batches with unknown slots are refused.
        startup_timeout_ms: how long ``start`` waits for the brokers or the embedding
            workers (default ``kafka.startup_timeout_ms`` of the global config, 60 s;
            0 tries once).

    Raises:
        ConfigError: a bad ``PERSIA_BASE_PORT`` (no destination given), both kinds
            given, a bad address, topic or compression type, or a topic or compression
            type in the broker-less mode (it would be ignored).
        Misuse: unknown arguments, or ``max_inflight``/``timeout_ms`` below 1.

    Example::

        with DataCtx() as ctx:
            for batch in make_batches():
                ctx.send_data(batch)
    """

    def __init__(self, *args: Any, embedding_workers: list[str] | str | None = None,
                 kafka_bootstrap_servers: str | None = None,
                 global_config: GlobalConfig | str | None = None, max_inflight: int = 8,
                 timeout_ms: int = 600_000, topic: str | None = None,
                 compression_type: str | None = None,
                 embedding_config: EmbeddingSchema | str | None = None,
                 startup_timeout_ms: int | None = None, **kwargs: Any):
        if args or set(kwargs) - _PERSIA_ONLY_KWARGS:
            raise Misuse(f"DataCtx got unexpected arguments {args or ''} {sorted(kwargs)}",
                         hint="DataCtx(embedding_workers=..., kafka_bootstrap_servers=...)")
        for name, value in (("max_inflight", max_inflight), ("timeout_ms", timeout_ms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Misuse(f"{name} must be an int >= 1, got {value!r}", field=name)
        if startup_timeout_ms is not None and (isinstance(startup_timeout_ms, bool) or not
                                               isinstance(startup_timeout_ms, int) or
                                               startup_timeout_ms < 0):
            raise Misuse(f"startup_timeout_ms must be an int >= 0, got {startup_timeout_ms!r}",
                         field="startup_timeout_ms")
        if global_config is None and os.environ.get("PERSIA_GLOBAL_CONFIG"):
            global_config = os.environ["PERSIA_GLOBAL_CONFIG"]
        if isinstance(global_config, (str, os.PathLike)):
            global_config = load_global_config(global_config)
        self.config = global_config or GlobalConfig()
        if kafka_bootstrap_servers and embedding_workers:
            raise ConfigError("DataCtx got both kafka_bootstrap_servers and "
                              "embedding_workers", field="embedding_workers",
                              hint="Kafka mode or broker-less mode: pass one of them")
        if embedding_workers:
            self.bootstrap: str | None = None
            self.workers = _workers(embedding_workers, "embedding_workers")
        else:
            self.bootstrap = resolve_bootstrap_servers(self.config, kafka_bootstrap_servers)
            self.workers = [] if self.bootstrap else _workers(
                os.environ.get("PERSIA_EMBEDDING_WORKERS"), "PERSIA_EMBEDDING_WORKERS")
        # Nowhere given: the workers' well-known local ports (the base is checked now).
        self._base_port = (local_ports.base_port() if not self.bootstrap and not self.workers
                           else None)
        overrides: dict[str, Any] = {k: v for k, v in (("samples_topic", topic),
                                       ("compression_type", compression_type)) if v}
        # replace() re-validates the section, so a bad topic or codec fails here, by name.
        self.kafka = dataclasses.replace(self.config.kafka, **overrides)
        if overrides and not self.bootstrap:
            # Broker-less, the batches go to the workers over RPC: a topic or codec asked
            # for would be ignored while the caller believes the data went there.
            name = next(iter(overrides))
            arg = "topic" if name == "samples_topic" else name
            raise ConfigError(f"DataCtx({arg}={overrides[name]!r}) applies to Kafka only, "
                              "but no Kafka bootstrap servers are configured (broker-less: "
                              "batches go to the embedding workers over RPC)", field=arg,
                              hint="give the brokers (kafka_bootstrap_servers, produce "
                                   "--kafka, KAFKA_BOOTSTRAP_SERVERS or "
                                   "kafka.bootstrap_servers), or drop it")
        if embedding_config is None and os.environ.get("PERSIA_EMBEDDING_CONFIG"):
            embedding_config = os.environ["PERSIA_EMBEDDING_CONFIG"]
        if isinstance(embedding_config, (str, os.PathLike)):
            embedding_config = load_embedding_config(embedding_config)
        self.schema: EmbeddingSchema | None = embedding_config
        self.max_inflight = max_inflight
        self.timeout_ms = timeout_ms
        self.startup_timeout_ms = (self.kafka.startup_timeout_ms if startup_timeout_ms is None
                                   else startup_timeout_ms)
        self.sent = 0
        self._loop: LoopThread | None = None
        self._closed = False
        self._lock = threading.Lock()   # detects overlapping calls from several threads
        # Data loader replicas start the round-robin at different workers.
        self._first_worker = _replica_index()
        self._producer: Any = None              # Kafka: a BatchProducer
        self._direct: Any = None                # broker-less: a DirectSender
        self._bytes = 0

    @property
    def mode(self) -> str:
        """``"kafka"`` or ``"direct"`` (broker-less)."""
        return "kafka" if self.bootstrap else "direct"

    @property
    def topic(self) -> str:
        """The samples topic (Kafka mode)."""
        topic = self.kafka.samples_topic
        if topic is None:   # KafkaConfig resolves it: <job_name>.samples by default
            raise InternalError("KafkaConfig.samples_topic was left unresolved")
        return topic

    def __repr__(self) -> str:
        where = (f"kafka {self.bootstrap} topic {self.topic!r}" if self.bootstrap
                 else f"embedding workers {','.join(self.workers) or 'on local ports'}")
        return f"DataCtx({where}, max_inflight={self.max_inflight}, sent={self.sent})"

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> DataCtx:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            # Bounded: a failing job should not wait timeout_ms for a dead destination.
            self._close(flush_timeout_s=_ABORT_FLUSH_S)
        except Exception as e:  # the block's own exception is the one to see
            log.error("DataCtx could not deliver every batch while handling %r: %s", exc, e)

    def start(self) -> None:
        """Connect (Kafka: check the topic exists and start the producer)."""
        with self._exclusive("start"):
            if self._loop is not None or self._closed:
                raise Misuse("DataCtx can be started once", hint="create a new DataCtx")
            loop = LoopThread(name="data-ctx")
            try:
                if self.bootstrap:
                    _run(loop, self._start_kafka(self.bootstrap))
                else:
                    from stream_persia.loader.direct_sender import DirectSender

                    if self._base_port is not None:
                        self.workers = _run(loop, local_ports.find_local(
                            "embedding-worker", timeout_s=self.startup_timeout_ms / 1000,
                            base=self._base_port))
                    self._direct = DirectSender(
                        self.workers, loop, max_inflight=self.max_inflight,
                        timeout_ms=self.timeout_ms, first_worker=self._first_worker,
                        startup_timeout_s=self.startup_timeout_ms / 1000)
            except BaseException:
                with contextlib.suppress(Exception):
                    _run(loop, self._release(), _CLOSE_TIMEOUT_S)
                loop.close()
                raise
            self._loop = loop
        log.info("DataCtx sends %s", f"to Kafka {self.bootstrap} topic {self.topic!r}"
                 if self.bootstrap else f"directly to embedding workers {self.workers}")

    async def _start_kafka(self, bootstrap: str) -> None:
        from stream_persia.kafka import BatchProducer, topic_partitions

        startup_s = self.startup_timeout_ms / 1000
        partitions = await topic_partitions(bootstrap, self.topic,
                                            security_kwargs=self.kafka.security_kwargs(),
                                            startup_timeout_s=startup_s)
        if not partitions:
            # Checked up front: aiokafka would wait for the topic's metadata for 40 s.
            raise ConfigError(f"samples topic {self.topic!r} does not exist at "
                              f"{bootstrap}", field="kafka.samples_topic",
                              hint="create it (stream-persia never creates topics), or "
                                   "name the right one")
        self._producer = BatchProducer.from_config(
            self.kafka, bootstrap_servers=bootstrap, max_in_flight=self.max_inflight,
            send_timeout_s=self.timeout_ms / 1000.0, startup_timeout_s=startup_s)
        await self._producer.start()

    def close(self) -> None:
        """Flush, then release the connections. Idempotent.

        Raises:
            PersiaError: the first batch that could not be delivered (the connections are
                released all the same).
        """
        self._close()

    def _close(self, flush_timeout_s: float | None = None) -> None:
        with self._exclusive("close"):
            if self._closed:
                return
            self._closed = True
            loop, self._loop = self._loop, None
            if loop is None:
                return
            flushed = False
            try:
                self._flush(loop, flush_timeout_s)
                flushed = True
            finally:
                # After a failed flush, stopping the producer would wait for the same
                # undeliverable batches again: give it a moment only.
                try:
                    _run(loop, self._release(), _CLOSE_TIMEOUT_S if flushed else 1.0)
                except Exception as e:  # nothing left to deliver, or already reported
                    log.warning("DataCtx: closing the %s connections: %r", self.mode, e)
                finally:
                    loop.close()

    async def _release(self) -> None:
        if self._producer is not None:  # both kept after close, for stats()
            await self._producer.close()
        if self._direct is not None:
            await self._direct.close()

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise Misuse(f"DataCtx.{what}() called while another thread is inside this "
                         "DataCtx", hint="use one DataCtx per thread, or serialise the calls")
        try:
            yield
        finally:
            self._lock.release()

    def _live(self) -> LoopThread:
        if self._loop is None:
            raise Misuse("DataCtx is closed" if self._closed else "DataCtx is not started",
                         hint="use `with DataCtx() as ctx:`")
        return self._loop

    # ----------------------------------------------------------------- sending
    def send_data(self, persia_batch: PersiaBatch) -> None:
        """Send one batch; returns once it is queued, blocking under backpressure. A batch
        without an ``event_time`` goes with this process's clock (``time.time()`` now).

        Raises:
            BadInput: not a ``PersiaBatch``, an ID feature of an unknown slot, a batch
                over ``kafka.max_batch_bytes``, or an earlier batch a worker refused.
            Backpressure: no room for ``timeout_ms`` (this or an earlier batch).
            RemoteError: an earlier batch could not be delivered.
        """
        if not isinstance(persia_batch, PersiaBatch):
            raise BadInput(f"send_data takes a PersiaBatch, got {type(persia_batch).__name__}",
                           field="persia_batch",
                           hint="build one with stream_persia.core.data.PersiaBatch")
        with self._exclusive("send_data"):
            loop = self._live()
            if self.schema is not None:
                for feature in persia_batch.id_type_features:
                    self.schema.slot(feature.name)
            persia_batch = persia_batch.stamped(time.time())
            if self._producer is not None:
                value = persia_batch.to_bytes()  # encoded here, off the loop thread
                _run(loop, self._producer.send(value, key=persia_batch.batch_id))
                self._bytes += len(value)
            else:
                self._direct.submit(persia_batch, self.sent)
            self.sent += 1

    def flush(self) -> None:
        """Wait until every batch sent so far is acknowledged; raises the first failure."""
        with self._exclusive("flush"):
            if self._loop is not None:
                self._flush(self._loop)

    def _flush(self, loop: LoopThread, timeout_s: float | None = None) -> None:
        if self._producer is not None:
            _run(loop, self._producer.flush(timeout_s))
        elif self._direct is not None:
            self._direct.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        """Counters: sent, acked, failed, in_flight, peak_in_flight, bytes (encoded in
        Kafka mode, array payload in direct mode), waits/retries."""
        if self._producer is not None:
            p = self._producer.stats()
            return {"sent": self.sent, "acked": p["acked"], "failed": p["failed"],
                    "in_flight": p["in_flight"], "peak_in_flight": p["peak_in_flight"],
                    "bytes": self._bytes, "waits": p["waits"]}
        direct = self._direct.stats() if self._direct is not None else {}
        return {"sent": self.sent, "acked": 0, "failed": 0, "in_flight": 0,
                "peak_in_flight": 0, "bytes": 0, **direct}
