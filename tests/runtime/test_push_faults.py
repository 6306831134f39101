"""Gradient pushes against embedding server processes that stall or crash mid-push.

Two embedding servers run as real processes (``launch embedding-server``), configured
with Adagrad over RPC; an embedding worker runs in this process (so its retry bound and
RPC timeout can be small). A server frozen with SIGSTOP while a push is on its way
answers nothing: the worker's request times out and is sent again, and when the server
thaws it reads the first request and every retry. The token makes it apply the update
once: its rows equal those of fault-free servers (in this process, same configuration;
rows are initialised from the id, so both start equal). A server killed and restarted
mid-push lost its rows: the retried update meets the new process, which refuses it, and
the batch fails naming the server (by default); with ``on_server_restart: continue`` the
worker configures it again and the push completes; nothing is left in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad
from stream_persia.errors import ServerRestarted
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.roles import running
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.worker.service import EmbeddingWorker

CONFIG = {"optimizer": Adagrad(lr=0.1).to_dict(),
          "embedding_config": EmbeddingConfig((-0.5, 0.5)).to_dict()}


def _server(i: int, port: str | None = None) -> RoleProcess:
    args = ["--replica-index", str(i), "--replica-size", "2", "--capacity", "10000"]
    return RoleProcess("embedding-server", [*args, *(["--port", port] if port else [])],
                       name=f"embedding-server-{i}")


@pytest.fixture
def servers():
    with running([_server(i) for i in range(2)], ready_s=30) as procs:
        yield procs


def grads_for(served: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
            for e in served["embeddings"]}


def all_ids(batch) -> list[tuple[int, np.ndarray]]:
    """``(dim, prefixed distinct ids)`` of every slot of ``batch``."""
    out = []
    for f in batch.id_type_features:
        out.append((SCHEMA.slot(f.name).dim, SCHEMA.prefix_ids(f.name, np.unique(f.values))))
    return out


async def rows(addresses: list[str], groups) -> list[np.ndarray]:
    """Rows of ``groups`` ([(dim, ids)]) summed over the servers (eval: never inserts;
    each id lives on one server, the other answers zeros)."""
    total = [np.zeros((ids.size, dim), np.float32) for dim, ids in groups]
    for a in addresses:
        async with RpcClient(a) as c:
            reply = await c.call("lookup", {"mode": "eval", "groups": [
                {"dim": d, "ids": i} for d, i in groups]})
        for t, r in zip(total, reply["rows"], strict=True):
            t += r
    return total


async def fault_free(batch) -> list[np.ndarray]:
    """The rows after ``batch`` is served and pushed once on in-process servers."""
    servers = [EmbeddingServer(10_000, replica_index=i, replica_size=2) for i in range(2)]
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers])
    await worker.start()
    try:
        async with RpcClient(worker.address) as c:
            for s in servers:
                async with RpcClient(s.address) as sc:
                    await sc.call("configure", CONFIG)
            await c.call("ingest", {"batch": batch.to_wire()})
            served = await c.call("next_batch", {"timeout_ms": 5000})
            await c.call("push_gradients", {"batch_id": served["batch_id"],
                                            "grads": grads_for(served)})
        return await rows([s.address for s in servers], all_ids(batch))
    finally:
        await worker.stop()
        for s in servers:
            await s.stop()


async def started_worker(addresses: list[str], **kw) -> EmbeddingWorker:
    for a in addresses:
        async with RpcClient(a) as c:
            await c.call("configure", CONFIG)
    worker = EmbeddingWorker(SCHEMA, addresses, rpc_timeout_ms=400, push_retry_ms=15_000,
                             **kw)
    await worker.start()
    return worker


async def test_a_frozen_server_applies_a_retried_push_once(servers):
    batch = make_batch(0)
    want = await fault_free(batch)
    addresses = [p.address for p in servers]
    worker = await started_worker(addresses)
    try:
        async with RpcClient(worker.address, timeout_ms=30_000) as c:
            await c.call("ingest", {"batch": batch.to_wire()})
            served = await c.call("next_batch", {"timeout_ms": 5000})
            os.kill(servers[1].proc.pid, signal.SIGSTOP)
            push = asyncio.ensure_future(c.call(
                "push_gradients", {"batch_id": served["batch_id"], "grads": grads_for(served)}))
            await asyncio.sleep(1.5)          # several requests time out meanwhile
            assert not push.done()
            os.kill(servers[1].proc.pid, signal.SIGCONT)
            reply = await asyncio.wait_for(push, 20)
            assert reply["dropped"] == 0
            front = await c.call("frontier")
            assert (front["inflight"], front["failed"]) == (0, [])
        got = await rows(addresses, all_ids(batch))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        async with RpcClient(addresses[1]) as sc:
            metrics = (await sc.call("metrics")).decode()
        dup = [line for line in metrics.splitlines()
               if line.startswith("persia_embedding_server_update_tokens_duplicates_total")]
        assert dup and float(dup[0].split()[-1]) >= 1, metrics[-2000:]
    finally:
        await worker.stop()


@pytest.mark.parametrize("policy", ["fail", "continue"])
async def test_a_server_restarted_mid_push(servers, policy):
    addresses = [p.address for p in servers]
    worker = await started_worker(addresses, on_server_restart=policy)
    try:
        async with RpcClient(worker.address, timeout_ms=30_000) as c:
            await c.call("ingest", {"batch": make_batch(0).to_wire()})
            served = await c.call("next_batch", {"timeout_ms": 5000})
            servers[1].kill()
            push = asyncio.ensure_future(c.call(
                "push_gradients", {"batch_id": served["batch_id"], "grads": grads_for(served)}))
            await asyncio.sleep(0.5)
            assert not push.done()
            servers[1] = _server(1, addresses[1].rpartition(":")[2])
            await asyncio.to_thread(lambda: servers[1].start().wait_ready(30))
            if policy == "fail":
                # The retried update reaches a process with an empty table: refused there,
                # and the batch fails naming the server instead of being "applied once".
                with pytest.raises(ServerRestarted) as err:
                    await asyncio.wait_for(push, 20)
                assert f"embedding server 1 ({addresses[1]}) restarted" in str(err.value)
                front = await c.call("frontier")
                assert front["inflight"] == 1 and front["failed"][0]["servers"] == \
                    [addresses[1]] and front["lost"][0]["address"] == addresses[1]
                assert (await c.call("health"))["ok"] is False
                async with RpcClient(addresses[1]) as sc:   # nothing applied, not configured
                    assert (await sc.call("stats"))["updates"] == 0
                    assert await sc.call("get_config") is None
                return
            reply = await asyncio.wait_for(push, 20)
            # The fresh server lost the rows: their updates are dropped, and counted.
            assert reply["dropped"] > 0
            front = await c.call("frontier")
            assert (front["inflight"], front["failed"]) == (0, [])
            assert (await c.call("health"))["ok"] is True
            assert b'persia_embedding_worker_server_restarts_total{server="1"} 1.0' in \
                await c.call("metrics")
        async with RpcClient(addresses[1]) as sc:   # configured again by the worker
            assert (await sc.call("get_config"))["optimizer"] == CONFIG["optimizer"]
    finally:
        await worker.stop()
