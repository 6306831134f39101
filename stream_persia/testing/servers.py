"""In-process embedding servers for tests: n shards on loopback and a router over them.

Their checkpoint root defaults to the system's temporary directory (where pytest's
``tmp_path`` lives); the role secret to ``PERSIA_ROLE_SECRET(_FILE)`` of the process, as
for any server and client.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from stream_persia.checkpoint.root import CheckpointRoot
from stream_persia.core import aio
from stream_persia.core.embedding_config import EmbeddingConfig
from stream_persia.core.optim import Adagrad
from stream_persia.rpc import RpcClient, auth
from stream_persia.server.service import EmbeddingServer
from stream_persia.server.shard_files import read_shard_file
from stream_persia.worker.router import ShardRouter

__all__ = ["TEST_CHECKPOINT_ROOT", "dumped_rows", "restarted", "running_servers"]

#: the checkpoint root of test servers unless a test gives its own
TEST_CHECKPOINT_ROOT = tempfile.gettempdir()


@contextlib.asynccontextmanager
async def running_servers(n: int, optimizer: Any = None, capacity: int = 10_000,
                          init: tuple[float, float] = (-0.5, 0.5), store_threads: int = 1,
                          *, checkpoint_root: CheckpointRoot | str = TEST_CHECKPOINT_ROOT,
                          secret: auth.SecretSetting = auth.FROM_ENV,
                          on_server_restart: str = "fail"
                          ) -> AsyncIterator[tuple[list[EmbeddingServer], ShardRouter]]:
    """Start ``n`` embedding servers (replicas 0..n-1, ``optimizer`` default Adagrad(0.1),
    rows initialised uniformly in ``init``, ``store_threads`` internal shards each, dumps
    and loads under ``checkpoint_root``); yield them and a :class:`ShardRouter` over them
    (presenting ``secret`` as they require it, ``on_server_restart`` as given); stop
    everything on exit."""
    secret = auth.resolve(secret)
    servers = [EmbeddingServer(capacity, optimizer or Adagrad(lr=0.1), EmbeddingConfig(init),
                               replica_index=i, replica_size=n, store_threads=store_threads,
                               checkpoint_root=checkpoint_root, secret=secret)
               for i in range(n)]
    for s in servers:
        await s.start()
    router = ShardRouter([s.address for s in servers], timeout_ms=5000, secret=secret,
                         on_server_restart=on_server_restart)
    try:
        yield servers, router
    finally:
        await router.close()
        for s in servers:
            await s.stop()


def restarted(server: EmbeddingServer) -> EmbeddingServer:
    """What a supervisor restarting ``server``'s process would bring up: a fresh server at
    the same address, replica and capacity, holding only the defaults (no rows, no
    configuration) and another incarnation. Not started; the caller stops ``server``
    first."""
    host, port = server.address.rsplit(":", 1)
    return EmbeddingServer(server.store.capacity, replica_index=server.replica_index,
                           replica_size=server.replica_size, host=host, port=int(port),
                           checkpoint_root=server.checkpoint_root, secret=server.rpc.secret)


def dumped_rows(address: str, dump_dir: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every row of the embedding server at ``address`` (a process of its own: called
    from synchronous test code), dumped into ``dump_dir`` under its checkpoint root:
    id -> (weights, optimizer state)."""
    async def dump() -> dict:
        async with RpcClient(address) as c:
            return await c.call("dump", {"dir": dump_dir})

    info = aio.run(dump())
    rows = {}
    for chunk in read_shard_file(dump_dir, info["file"]):
        for i, x in enumerate(chunk["ids"].tolist()):
            rows[x] = (chunk["weights"][i].copy(), chunk["state"][i].copy())
    return rows
