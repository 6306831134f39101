"""One embedding server and ``n`` embedding workers on a loop thread of the calling process,
for tests of the synchronous callers that feed or drain workers (``DataCtx``, the
broker-less sender): real RPC servers on loopback, stopped by :meth:`WorkersOnLoop.close`.
"""

from __future__ import annotations

from typing import Any

from stream_persia.config import EmbeddingSchema
from stream_persia.core.aio import LoopThread
from stream_persia.core.data import PersiaBatch
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA
from stream_persia.worker.service import EmbeddingWorker

__all__ = ["WorkersOnLoop"]


class WorkersOnLoop:
    """``n`` workers (replicas 0..n-1, ``ready`` batches of ready buffer each, listening on
    ``ports``, 0: from the OS) over one server built from ``server_args``."""

    def __init__(self, n: int = 1, *, ready: int = 16, ports: list[int] | None = None,
                 schema: EmbeddingSchema = SCHEMA, server_args: tuple[Any, ...] = (10_000,)):
        self.lt = LoopThread(name="test-workers")
        self.workers: list[EmbeddingWorker] = []
        self.clients: list[RpcClient] = []
        self.server = EmbeddingServer(*server_args)
        try:
            self.lt.run(self._up(n, ready, ports or [0] * n, schema), timeout=20)
        except BaseException:
            self.close()
            raise

    async def _up(self, n: int, ready: int, ports: list[int], schema: EmbeddingSchema
                  ) -> None:
        await self.server.start()
        for i in range(n):
            w = EmbeddingWorker(schema, [self.server.address], replica_index=i,
                                replica_size=n, ready_buffer_batches=ready, port=ports[i])
            await w.start()
            self.workers.append(w)
            self.clients.append(RpcClient(w.address, timeout_ms=5000))

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def ready(self, i: int = 0) -> int:
        """How many batches worker ``i`` holds ready."""
        return len(self.workers[i].ready)

    def pull(self, i: int = 0) -> dict[str, Any] | None:
        """Take the next ready batch of worker ``i`` (None after 2 s without one)."""
        return self.lt.run(self.clients[i].call("next_batch", {"timeout_ms": 2000}), 10)

    def pull_meta(self, i: int = 0) -> bytes | None:
        """Take the next ready batch of worker ``i``: its meta tag."""
        served = self.pull(i)
        return None if served is None else served["meta"]

    def ingest(self, i: int, batch: PersiaBatch) -> None:
        self.lt.run(self.clients[i].call("ingest", {"batch": batch.to_wire()}), 10)

    def close(self) -> None:
        async def down() -> None:
            for c in self.clients:
                await c.close()
            for w in self.workers:
                await w.stop()
            await self.server.stop()

        try:
            self.lt.run(down(), timeout=20)
        finally:
            self.lt.close()
