"""``DataCtx``: how a data loader sends ``PersiaBatch``es into a job (PERSIA's DataCtx).

Two paths with one interface:

- **Kafka** (a bootstrap address from the argument, ``KAFKA_BOOTSTRAP_SERVERS`` or the
  global config): batches are produced to the samples topic (acks=all, idempotent). The
  stream is durable, so embedding workers can replay it from a checkpoint: exactly-once
  training needs this path.
- **Broker-less** (no bootstrap address): batches go straight to the embedding workers
  over RPC, round-robin (PERSIA's own path). Same validation, bounded buffers and
  backpressure, but nothing is replayable: a batch in a worker that dies is lost.

``send_data`` blocks only while the path applies backpressure; up to ``max_inflight``
sends are pipelined and a failure is raised from a later ``send_data`` or from ``flush``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from typing import Any

from stream_persia.aio import LoopThread
from stream_persia.config import GlobalConfig, load_global_config, resolve_bootstrap_servers
from stream_persia.embedding.data import PersiaBatch
from stream_persia.errors import Backpressure, BadInput, ConfigError, Misuse, PeerUnavailable

log = logging.getLogger(__name__)

__all__ = ["DataCtx"]


def _env_addresses(name: str) -> list[str]:
    return [a.strip() for a in os.environ.get(name, "").split(",") if a.strip()]


class DataCtx:
    """Send ``PersiaBatch``es to the embedding workers, through Kafka or directly.

    Args:
        embedding_workers: broker-less mode: worker addresses (default: env
            ``PERSIA_EMBEDDING_WORKERS``).
        kafka_bootstrap_servers: Kafka mode (default: env ``KAFKA_BOOTSTRAP_SERVERS``,
            then ``kafka.bootstrap_servers`` of the global config).
        global_config: a ``GlobalConfig`` or a path (default: env ``PERSIA_GLOBAL_CONFIG``).
        max_inflight: sends pipelined before ``send_data`` waits.
        timeout_ms: how long one batch may wait for room before ``Backpressure``.

    Example::

        with DataCtx() as ctx:
            for batch in make_batches():
                ctx.send_data(batch)
    """

    def __init__(self, *args: Any, embedding_workers: list[str] | None = None,
                 kafka_bootstrap_servers: str | None = None,
                 global_config: GlobalConfig | str | None = None, max_inflight: int = 8,
                 timeout_ms: int = 600_000, **kwargs: Any):
        if args or set(kwargs) - {"threadpool_worker_size", "device_id"}:
            raise Misuse(f"DataCtx got unexpected arguments {args or ''} {sorted(kwargs)}",
                         hint="DataCtx(embedding_workers=..., kafka_bootstrap_servers=...)")
        if global_config is None and os.environ.get("PERSIA_GLOBAL_CONFIG"):
            global_config = os.environ["PERSIA_GLOBAL_CONFIG"]
        if isinstance(global_config, str):
            global_config = load_global_config(global_config)
        self.config = global_config or GlobalConfig()
        self.bootstrap = resolve_bootstrap_servers(self.config, kafka_bootstrap_servers)
        self.workers = list(embedding_workers or _env_addresses("PERSIA_EMBEDDING_WORKERS"))
        if not self.bootstrap and not self.workers:
            raise ConfigError(
                "DataCtx needs somewhere to send: no Kafka bootstrap servers and no "
                "embedding workers", field="KAFKA_BOOTSTRAP_SERVERS",
                hint="set KAFKA_BOOTSTRAP_SERVERS (Kafka) or PERSIA_EMBEDDING_WORKERS "
                     "(broker-less), or pass them to DataCtx")
        if max_inflight < 1:
            raise Misuse(f"max_inflight must be >= 1, got {max_inflight}", field="max_inflight")
        self.max_inflight = max_inflight
        self.timeout_ms = timeout_ms
        self.sent = 0
        self._loop: LoopThread | None = None
        self._producer: Any = None
        self._clients: list[Any] = []
        self._next = int(os.environ.get("REPLICA_INDEX", "0") or 0)
        self._pending: set[concurrent.futures.Future] = set()
        self._slots: asyncio.Semaphore | None = None

    @property
    def mode(self) -> str:
        return "kafka" if self.bootstrap else "direct"

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> DataCtx:
        self.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self.close()

    def start(self) -> None:
        if self._loop is not None:
            raise Misuse("DataCtx started twice")
        self._loop = LoopThread(name="data-ctx")
        self._loop.run(self._start())
        log.info("DataCtx sends %s", f"to Kafka {self.bootstrap} topic "
                 f"{self.config.kafka.samples_topic}" if self.bootstrap
                 else f"directly to embedding workers {self.workers}")

    async def _start(self) -> None:
        self._slots = asyncio.Semaphore(self.max_inflight)
        if self.bootstrap:
            from stream_persia.kafka import BatchProducer

            self._producer = BatchProducer.from_config(
                self.config.kafka, bootstrap_servers=self.bootstrap,
                send_timeout_s=self.timeout_ms / 1000.0)
            await self._producer.start()
        else:
            from stream_persia.rpc import RpcClient

            self._clients = [RpcClient(a, timeout_ms=self.timeout_ms + 5000,
                                       name=f"embedding-worker-{i}")
                             for i, a in enumerate(self.workers)]

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            loop.run(self._close(), timeout=60)
        finally:
            loop.close()

    async def _close(self) -> None:
        if self._producer is not None:
            await self._producer.close()
        for c in self._clients:
            await c.close()

    # ----------------------------------------------------------------- sending
    def send_data(self, persia_batch: PersiaBatch) -> None:
        """Send one batch (validated when it was built); blocks under backpressure."""
        if not isinstance(persia_batch, PersiaBatch):
            raise BadInput(f"send_data takes a PersiaBatch, got {type(persia_batch).__name__}",
                           field="persia_batch")
        if self._loop is None:
            raise Misuse("DataCtx is not started", hint="use `with DataCtx() as ctx:`")
        self._raise_failures()
        fut = self._loop.submit(self._send(persia_batch))
        self._pending.add(fut)
        # Wait for the send to be queued (a slot taken), not for it to be acknowledged.
        while len(self._pending) > self.max_inflight:
            concurrent.futures.wait(self._pending, return_when="FIRST_COMPLETED")
            self._raise_failures()
        self.sent += 1

    def _raise_failures(self) -> None:
        done = {f for f in self._pending if f.done()}
        self._pending -= done
        for f in done:
            f.result()

    def flush(self) -> None:
        """Wait until every batch sent so far is accepted; raises the first failure."""
        if self._loop is None:
            return
        pending, self._pending = self._pending, set()
        for f in pending:
            f.result()
        if self._producer is not None:
            self._loop.run(self._producer.flush())

    async def _send(self, batch: PersiaBatch) -> None:
        assert self._slots is not None
        async with self._slots:
            if self._producer is not None:
                await self._producer.send(batch)
            else:
                await self._send_direct(batch)

    async def _send_direct(self, batch: PersiaBatch) -> None:
        params = {"batch": batch.to_wire(), "timeout_ms": 1000}
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        delay = 0.05
        while True:
            client = self._clients[self._next % len(self._clients)]
            self._next += 1
            try:
                await client.call("ingest", params)
                return
            except (Backpressure, PeerUnavailable) as e:
                # A full or unreachable worker: try the next one, backing off once every
                # worker has been tried.
                if time.monotonic() > deadline:
                    raise Backpressure(f"no embedding worker accepted a batch for "
                                       f"{self.timeout_ms} ms (last: {e})",
                                       field="timeout_ms") from e
                if self._next % len(self._clients) == 0:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
