"""A launched embedding worker whose embedding server process was killed and restarted at
the same address (what a StatefulSet does by itself) fails loudly and exits 1.

Both roles are real processes (``launch embedding-server``, ``launch embedding-worker``,
broker-less); the test feeds batches and plays the NN side over RPC.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from stream_persia.core.supervisor import EXIT_GRACE_S
from stream_persia.errors import ServerRestarted
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import EMBEDDING_YAML, make_batch


def _server(tmp_path, port: str | None = None) -> RoleProcess:
    return RoleProcess("embedding-server", ["--checkpoint-root", str(tmp_path),
                                            *(["--port", port] if port else [])],
                       log_path=tmp_path / "server.log", name="embedding-server")


async def test_a_launched_worker_fails_naming_a_restarted_server_and_exits_1(tmp_path):
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    server = _server(tmp_path).start()
    worker = None
    try:
        address = await asyncio.to_thread(server.wait_ready, 60)
        worker = RoleProcess("embedding-worker", [
            "--embedding-config", str(tmp_path / "embedding_config.yml"),
            "--embedding-servers", address], log_path=tmp_path / "worker.log").start()
        await asyncio.to_thread(worker.wait_ready, 60)
        async with RpcClient(worker.address, timeout_ms=20_000) as client:
            for i in range(2):
                await client.call("ingest", {"batch": make_batch(i).to_wire()})
            served = await client.call("next_batch", {"timeout_ms": 5000})
            await client.call("push_gradients", {"batch_id": served["batch_id"], "grads": {
                e["name"]: np.ones_like(e["emb"]) for e in served["embeddings"]}})

            server.kill()                        # kill -9, then back at the same port
            server = _server(tmp_path, address.rpartition(":")[2]).start()
            assert await asyncio.to_thread(server.wait_ready, 60) == address

            with pytest.raises(ServerRestarted) as err:
                await client.call("next_batch", {"timeout_ms": 5000})
            assert f"embedding server 0 ({address}) restarted" in str(err.value)
            assert "rows it held when last seen" in str(err.value)
            health = await client.call("health")
            assert health["ok"] is False and address in health["error"]
        deadline = time.monotonic() + EXIT_GRACE_S + 20
        while worker.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not worker.alive(), "the worker went on serving with a lost server"
        assert worker.proc.returncode == 1, worker.log_tail()
        assert address in worker.log_tail(1 << 20)
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
