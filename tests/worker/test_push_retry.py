"""Gradient pushes are idempotent per (batch, server), retried, and fail loudly.

Two embedding servers (Adagrad, so applying a gradient twice changes both the row and its
accumulator) and an embedding worker run in this process on real loopback sockets; the
worker reaches server 1 through a TCP forwarder of this file that can lose a reply (the
server applied the update, the worker never hears it) or refuse connections (the server
is unreachable). Every faulty run is compared, rows and optimizer state, with the same
batch pushed on a second, fault-free pair of servers.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from stream_persia.checkpoint import stream_cut
from stream_persia.checkpoint.cut import check_no_failed_push
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad
from stream_persia.errors import BadInput, Misuse, PushFailed
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.worker.service import EmbeddingWorker

SLOTS = ("user", "item", "tags")


class Forwarder:
    """TCP forwarder to ``target`` with faults: ``lose_reply()`` forwards the next request
    and closes the connection when the reply comes back (once); ``refuse()`` stops
    listening (connections are refused) until ``accept()``."""

    def __init__(self, target: str):
        self.host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._lose = False
        self.lost = 0
        self._links = 0
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def accept(self) -> None:
        self._server = await asyncio.start_server(self._link, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
        for writer in list(self._writers):   # established connections drop too
            writer.close()
        while self._links:
            await asyncio.sleep(0.01)

    def lose_reply(self) -> None:
        self._lose = True

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links += 1
        up_r, up_w = await asyncio.open_connection(self.host, self.target_port)
        self._writers |= {writer, up_w}

        async def pump(src, dst, replies: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(1 << 16):
                    if replies and self._lose:
                        self._lose = False
                        self.lost += 1
                        return          # the server applied it; the reply never arrives
                    dst.write(data)
                    await dst.drain()

        up = asyncio.ensure_future(pump(reader, up_w, False))
        down = asyncio.ensure_future(pump(up_r, writer, True))
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in (writer, up_w):
                w.close()
                self._writers.discard(w)
            await asyncio.gather(up, down, return_exceptions=True)
            self._links -= 1

    async def close(self) -> None:
        await self.refuse()


def _servers() -> list[EmbeddingServer]:
    return [EmbeddingServer(10_000, Adagrad(lr=0.1), EmbeddingConfig((-0.5, 0.5)),
                            replica_index=i, replica_size=2) for i in range(2)]


def snapshot(server: EmbeddingServer) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every row of ``server`` with its optimizer state, by id."""
    out = {}
    for chunk in server.store.dump():
        for i, x in enumerate(chunk["ids"].tolist()):
            out[x] = (chunk["weights"][i].copy(), chunk["state"][i].copy())
    return out


def grads_for(served: dict, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
            for e in served["embeddings"]}


@contextlib.asynccontextmanager
async def job(forwarded: bool = True, **worker_kw):
    """Servers, the worker (server 1 behind a Forwarder when ``forwarded``) and a client."""
    servers = _servers()
    for s in servers:
        await s.start()
    fwd = Forwarder(servers[1].address)
    await fwd.accept()
    addresses = [servers[0].address, fwd.address if forwarded else servers[1].address]
    worker = EmbeddingWorker(SCHEMA, addresses, **{"rpc_timeout_ms": 2000, **worker_kw})
    await worker.start()
    client = RpcClient(worker.address, timeout_ms=20_000)
    try:
        yield servers, fwd, worker, client
    finally:
        await client.close()
        await worker.stop()
        await fwd.close()
        for s in servers:
            await s.stop()


async def serve(client: RpcClient, i: int) -> dict:
    await client.call("ingest", {"batch": make_batch(i).to_wire()})
    served = await client.call("next_batch", {"timeout_ms": 2000})
    assert served is not None
    return served


async def reference(n: int) -> list[EmbeddingServer]:
    """Each server's rows and state after ``n`` batches served and pushed once each,
    without faults."""
    async with job(forwarded=False) as (servers, _, _, client):
        for i in range(n):
            served = await serve(client, i)
            await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": grads_for(served, i)})
        return [snapshot(s) for s in servers]


def assert_same(got: list[EmbeddingServer], want: list[dict]) -> None:
    for g, b in zip(got, want, strict=True):
        a = snapshot(g)
        assert a.keys() == b.keys()
        for x in a:
            np.testing.assert_array_equal(a[x][0], b[x][0], err_msg=f"row {x}")
            np.testing.assert_array_equal(a[x][1], b[x][1], err_msg=f"state of {x}")


async def test_a_lost_reply_is_retried_and_applied_exactly_once():
    want = await reference(2)
    async with job() as (servers, fwd, worker, client):
        first = await serve(client, 0)
        fwd.lose_reply()          # server 1 applies the update; its reply is lost
        reply = await client.call("push_gradients", {"batch_id": first["batch_id"],
                                                     "grads": grads_for(first, 0)})
        assert fwd.lost == 1
        assert reply["dropped"] == 0 and reply["applied"] > 0
        stats = servers[1].metrics.render()
        assert b"persia_embedding_server_update_tokens_duplicates_total 1.0" in stats
        second = await serve(client, 1)
        await client.call("push_gradients", {"batch_id": second["batch_id"],
                                             "grads": grads_for(second, 1)})
        assert_same(servers, want)
        front = await client.call("frontier")
        assert (front["inflight"], front["failed"]) == (0, [])


async def test_an_unreachable_server_fails_the_push_loudly_then_it_completes_once():
    want = await reference(1)
    async with job(push_retry_ms=400) as (servers, fwd, worker, client):
        served = await serve(client, 0)
        bid = served["batch_id"]
        await fwd.refuse()
        with pytest.raises(PushFailed) as err:
            await client.call("push_gradients", {"batch_id": bid, "grads": grads_for(served, 0)})
        msg = str(err.value)
        assert err.value.field == "batch_id" and f"batch {bid}" in msg
        assert fwd.address in msg and "1 of 2 servers applied" in msg

        # Failed, not silently pinned: named by frontier, status and health; checkpoints
        # (the manifest's cut, the NN side and the API all check it) refuse naming it.
        front = await client.call("frontier")
        assert front["inflight"] == 1
        [failed] = front["failed"]
        assert (failed["batch_id"], failed["servers"]) == (bid, [fwd.address])
        assert failed["applied_on"] == [servers[0].address]
        health = await client.call("health")
        assert health["ok"] is False and f"batch {bid}" in health["error"]
        assert fwd.address in health["error"]
        assert (await client.call("status"))["failed"] == front["failed"]
        for check in (lambda: check_no_failed_push([front]),
                      lambda: stream_cut([front], ["samples"])):
            with pytest.raises(Misuse) as refused:
                check()
            assert f"batch {bid}" in str(refused.value) and fwd.address in str(refused.value)
        metrics = await client.call("metrics")
        assert b"persia_embedding_worker_batches_push_failed_total 1.0" in metrics
        # Serving it again would apply its gradients twice on server 0.
        with pytest.raises(BadInput) as back:
            await client.call("return_batches", {"batch_ids": [bid]})
        assert back.value.field == "batch_ids"

        # The server is back: pushing the batch again sends what server 1 lacks, once
        # (the gradients given now are ignored: the first ones are kept). The retry bound
        # is raised past the RPC client's reconnect backoff (up to 2 s).
        await fwd.accept()
        worker.push_retry_ms = 5000
        junk = {k: np.full_like(v, 1e3) for k, v in grads_for(served, 0).items()}
        reply = await client.call("push_gradients", {"batch_id": bid, "grads": junk})
        assert reply["applied"] > 0 and reply["dropped"] == 0
        assert_same(servers, want)
        front = await client.call("frontier")
        assert (front["inflight"], front["failed"]) == (0, [])
        assert (await client.call("health"))["ok"] is True


async def test_a_push_retries_until_the_server_accepts_again():
    """Unreachable for less than push_retry_ms: the push waits, retries and succeeds."""
    want = await reference(1)
    async with job(push_retry_ms=10_000) as (servers, fwd, worker, client):
        served = await serve(client, 0)
        await fwd.refuse()
        push = asyncio.ensure_future(client.call(
            "push_gradients", {"batch_id": served["batch_id"], "grads": grads_for(served, 0)}))
        await asyncio.sleep(0.5)
        assert not push.done()
        # A second push of the same batch meanwhile (an NN worker whose call timed out)
        # shares the first one's outcome.
        again = asyncio.ensure_future(client.call(
            "push_gradients", {"batch_id": served["batch_id"], "grads": grads_for(served, 0)}))
        await asyncio.sleep(0.1)
        await fwd.accept()
        reply, repeated = await asyncio.wait_for(asyncio.gather(push, again), 15)
        assert reply == repeated and reply["dropped"] == 0
        assert_same(servers, want)


async def test_a_duplicate_token_is_applied_once_and_the_memory_is_bounded():
    s = EmbeddingServer(10_000, Adagrad(lr=0.1), EmbeddingConfig((-0.5, 0.5)),
                        update_tokens=2)
    await s.start()
    client = RpcClient(s.address)
    try:
        ids = np.arange(1, 9, dtype=np.uint64)
        await client.call("lookup", {"mode": "train", "groups": [{"dim": 4, "ids": ids}]})
        g = np.ones((8, 4), np.float32)

        async def update(token):
            return await client.call("update", {"groups": [{"dim": 4, "ids": ids, "grads": g}],
                                                **({"token": token} if token else {})})

        async def rows():
            return await s.on_store(lambda: s.store.lookup(ids, 4, train=False).copy())

        first = await update("w-1")
        after = await rows()
        assert first["applied"] == 8 and "duplicate" not in first
        dup = await update("w-1")
        assert dup == {**first, "duplicate": True}
        np.testing.assert_array_equal(await rows(), after)      # not applied again
        await update("w-2")
        await update("w-3")                                # forgets w-1 (2 remembered)
        metrics = s.metrics.render()
        assert b"persia_embedding_server_update_tokens_evicted_young_total 1.0" in metrics
        assert b"persia_embedding_server_update_tokens_held 2.0" in metrics
        before = await rows()
        assert "duplicate" not in await update("w-1")     # forgotten: applied (and counted)
        assert not np.array_equal(await rows(), before)
        for bad in ("", "x" * 65, 7):
            with pytest.raises(BadInput) as err:
                await client.call("update", {"groups": [], "token": bad})
            assert err.value.field == "token"
        with pytest.raises(BadInput):
            EmbeddingServer(10, update_tokens=0)
    finally:
        await client.close()
        await s.stop()


@pytest.mark.parametrize("section,key,value", [
    ("embedding_worker_config", "push_retry_ms", 120_001),
    ("embedding_worker_config", "push_retry_ms", -1),
    ("embedding_parameter_server_config", "update_tokens", 0),
])
def test_retry_settings_are_bounded_naming_the_key(section, key, value):
    from stream_persia.config import GlobalConfig
    from stream_persia.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        GlobalConfig.from_dict({section: {key: value}})
    assert key in str(err.value)
    assert GlobalConfig.from_dict({}).embedding_worker_config.push_retry_ms == 20_000


async def test_a_push_without_gradients_sends_no_update():
    server = EmbeddingServer(10_000)
    await server.start()
    worker = EmbeddingWorker(SCHEMA, [server.address])
    await worker.start()
    try:
        async with RpcClient(worker.address) as client:
            served = await serve(client, 0)
            reply = await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                         "grads": dict.fromkeys(SLOTS)})
            assert reply == {"applied": 0, "dropped": 0, "skipped_slots": []}
            assert (await client.call("frontier"))["inflight"] == 0
        assert b'requests_total{method="update"}' not in server.metrics.render()
    finally:
        await worker.stop()
        await server.stop()


def test_a_checkpoint_names_the_partition_and_offset_of_a_failed_kafka_batch():
    fronts = [{"stream": "kafka", "offsets": {"0": 7}, "inflight": 0, "failed": []},
              {"stream": "kafka", "offsets": {"1": 3}, "inflight": 1, "failed": [
                  {"batch_id": 9, "partition": 1, "offset": 3, "servers": ["h:2"],
                   "applied_on": ["h:1"], "error": "refused"}]}]
    with pytest.raises(Misuse) as err:
        stream_cut(fronts, ["samples", "samples"])
    msg = str(err.value)
    assert "embedding worker 1" in msg and "batch 9 (partition 1 offset 3)" in msg
    assert "h:2" in msg and err.value.field == "batch_id"
    check_no_failed_push([fronts[0]])   # nothing failed: no objection
