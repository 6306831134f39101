"""In-process embedding servers for tests: n shards on loopback and a router over them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad
from stream_persia.embedding_server import EmbeddingServer
from stream_persia.worker.router import ShardRouter

__all__ = ["restarted", "running_servers"]


@contextlib.asynccontextmanager
async def running_servers(n: int, optimizer: Any = None, capacity: int = 10_000,
                          init: tuple[float, float] = (-0.5, 0.5), store_threads: int = 1
                          ) -> AsyncIterator[tuple[list[EmbeddingServer], ShardRouter]]:
    """Start ``n`` embedding servers (replicas 0..n-1, ``optimizer`` default Adagrad(0.1),
    rows initialised uniformly in ``init``, ``store_threads`` internal shards each); yield
    them and a :class:`ShardRouter` over them; stop everything on exit."""
    servers = [EmbeddingServer(capacity, optimizer or Adagrad(lr=0.1), EmbeddingConfig(init),
                               replica_index=i, replica_size=n, store_threads=store_threads)
               for i in range(n)]
    for s in servers:
        await s.start()
    router = ShardRouter([s.address for s in servers], timeout_ms=5000)
    try:
        yield servers, router
    finally:
        await router.close()
        for s in servers:
            await s.stop()


def restarted(server: EmbeddingServer) -> EmbeddingServer:
    """What a supervisor restarting ``server``'s process would bring up: a fresh server at
    the same address, replica and capacity, holding only the defaults (no rows, no
    configuration). Not started; the caller stops ``server`` first."""
    host, port = server.address.rsplit(":", 1)
    return EmbeddingServer(server.store.capacity, replica_index=server.replica_index,
                           replica_size=server.replica_size, host=host, port=int(port))
