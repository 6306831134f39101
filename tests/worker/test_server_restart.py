"""An embedding server restarted mid-job (a new process at its address, an empty table) is
never trained on silently.

Embedding servers and workers run in this process on real loopback sockets; a restart is
:func:`~stream_persia.testing.servers.restarted`: the server is stopped and a fresh one
started at the same address, as kill -9 and a supervisor (a Kubernetes StatefulSet)
would leave it. By default (``on_server_restart: fail``) every lookup and update that
needs it fails with ``ServerRestarted`` naming the server, its address and the rows it
held, the worker's health is not ok, checkpoints refuse, and a restore of a checkpoint
(``load_embeddings`` + ``reset_stream``) brings the job back to train every batch exactly
once. ``continue`` keeps the old behaviour, counted.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from stream_persia.checkpoint import CheckpointWriter, load_embeddings, stream_cut
from stream_persia.checkpoint.cut import check_servers_kept
from stream_persia.config import GlobalConfig, KafkaConfig
from stream_persia.core.supervisor import Supervisor
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad
from stream_persia.errors import BadInput, ConfigError, PersiaError, ServerRestarted
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.kernels.sharding import shard_of
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.pytest_plugin import TANSU_LIST_OFFSETS, deviates_on
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.servers import TEST_CHECKPOINT_ROOT, restarted, running_servers
from stream_persia.worker.ingest import KafkaIngest
from stream_persia.worker.router import ShardRouter, Table
from stream_persia.worker.service import EmbeddingWorker
from stream_persia.worker.shards import RowLookup, UpdateGroup

DIM = 4
JOB = {"optimizer": SGD(lr=0.5).to_dict(),
       "embedding_config": EmbeddingConfig((-0.001, 0.001)).to_dict()}


def ids_on(replica: int, n: int = 8) -> np.ndarray:
    """``n`` ids that shard to ``replica`` of 2."""
    ids = np.arange(1, 200, dtype=np.uint64)
    return ids[shard_of(ids, 2) == replica][:n]


async def restart(servers: list[EmbeddingServer], i: int) -> EmbeddingServer:
    await servers[i].stop()
    fresh = restarted(servers[i])
    await fresh.start()
    servers[i] = fresh
    return fresh


# ------------------------------------------------------------------ the server's side
async def test_a_server_refuses_a_request_meant_for_another_incarnation():
    async with running_servers(1) as ([server], _):
        async with RpcClient(server.address) as c:
            health = await c.call("health")
            me = health["incarnation"]
            assert me == server.incarnation and len(me) == 16 and health["loads"] == 0
            lookup = {"mode": "train", "groups": [{"dim": DIM, "ids": ids_on(0)}]}
            for method, params in (("lookup", lookup), ("update", {"groups": [{
                    "dim": DIM, "ids": ids_on(0), "grads": np.ones((8, DIM), np.float32)}]})):
                with pytest.raises(ServerRestarted) as err:
                    await c.call(method, {**params, "incarnation": "0123456789abcdef"})
                assert err.value.field == "incarnation" and me in str(err.value)
                assert "nothing was done" in str(err.value)
            # nothing admitted, nothing applied
            assert len(server.store) == 0 and server.store_stats()["updates"] == 0
            reply = await c.call("lookup", {**lookup, "incarnation": me})
            assert (reply["incarnation"], reply["held"]) == (me, 8)
        assert restarted(server).incarnation != me


# ------------------------------------------------------------------ the router
async def test_a_restarted_server_fails_lookups_and_updates_naming_what_was_lost():
    async with running_servers(2) as (servers, router):
        await router.broadcast("configure", JOB)
        ids = np.concatenate([ids_on(0), ids_on(1)])
        await router.lookup([RowLookup(DIM, ids)], "train")
        grads = np.ones((ids.size, DIM), np.float32)
        await router.update([UpdateGroup(DIM, ids, grads)])
        old = servers[1].incarnation

        fresh = await restart(servers, 1)
        for attempt in (router.lookup([RowLookup(DIM, ids)], "train"),
                        router.lookup([RowLookup(DIM, ids)], "eval"),
                        router.update([UpdateGroup(DIM, ids, grads)], token="t-1")):
            with pytest.raises(ServerRestarted) as err:
                await attempt
            msg = str(err.value)
            assert f"embedding server 1 ({fresh.address}) restarted" in msg
            assert old in msg and fresh.incarnation in msg
            assert "the 8 rows it held when last seen" in msg
        # The fresh server was neither used nor configured with the defaults' silence.
        assert len(fresh.store) == 0 and fresh.store_stats()["updates"] == 0
        assert fresh.store_stats()["lookups"] == 0
        assert await router.clients[1].call("get_config") is None
        assert list(router.lost) == [1] and router.restarts == [0, 1]
        # Server 0 alone still serves what it owns.
        rows, _ = await router.lookup([RowLookup(DIM, ids_on(0))], "eval")
        assert rows[0].shape == (8, DIM)


async def test_a_job_that_never_configures_its_servers_is_failed_too():
    async with running_servers(2) as (servers, router):
        ids = np.concatenate([ids_on(0), ids_on(1)])
        await router.lookup([RowLookup(DIM, ids)], "train")
        assert router.config is None
        await restart(servers, 1)
        with pytest.raises(ServerRestarted, match="embedding server 1"):
            await router.lookup([RowLookup(DIM, ids)], "train")


async def test_an_update_retried_across_a_restart_fails_its_batch_instead_of_landing():
    """The merged push retry sends an update again while a server cannot be reached; the
    process that answers at last is a new one with an empty table: the update is refused
    there (not "applied once" to nothing) and the push fails."""
    async with running_servers(2) as (servers, router):
        await router.broadcast("configure", JOB)
        ids = np.concatenate([ids_on(0), ids_on(1)])
        await router.lookup([RowLookup(DIM, ids)], "train")
        await servers[1].stop()
        fresh = restarted(servers[1])
        grads = np.ones((ids.size, DIM), np.float32)
        pending = router.split_update([UpdateGroup(DIM, ids, grads)], token="w-7")
        push = asyncio.ensure_future(router.push(pending, retry_s=10))
        await asyncio.sleep(0.3)            # retrying against the dead address
        assert not push.done()
        await fresh.start()
        try:
            with pytest.raises(ServerRestarted, match="embedding server 1"):
                await asyncio.wait_for(push, 10)
            assert pending.missing() == [1] and 0 in pending.replies
            assert fresh.store_stats()["updates"] == 0 and len(fresh.store) == 0
        finally:
            await fresh.stop()


async def looked_up_after_a_checkpoint(router: ShardRouter, tmp_path
                                       ) -> tuple[np.ndarray, str, dict[int, Table]]:
    """Ids of both servers trained, a checkpoint of them at ``dst``, then the same ids
    looked up again: (ids, dst, the tables that lookup saw)."""
    await router.broadcast("configure", JOB)
    ids = np.concatenate([ids_on(0), ids_on(1)])
    await router.lookup([RowLookup(DIM, ids)], "train")
    dst = str(tmp_path / "ck")
    with CheckpointWriter(dst) as w:
        await w.dump_embeddings(router.clients)
        w.commit(job="t", step=1, offsets={}, stream="direct")
    seen: dict[int, Table] = {}
    await router.lookup([RowLookup(DIM, ids)], "train", seen=seen)
    return ids, dst, seen


async def test_an_update_retried_across_a_restore_is_not_applied_to_the_restored_table(
        tmp_path):
    """As above, but the new process is restored from a checkpoint before the update is
    sent again (the worker keeps a failed push and sends it again when the NN side repeats
    it), so the router adopts it: a restore, on purpose. The update was computed from rows
    of the old process, after the checkpoint: applied to the restored table it would count
    a batch the stream replays from the checkpoint's offsets twice (and advance the
    restored shard's watermark and trained_through past the checkpoint). It is pinned to
    the processes its rows were looked up on and fails instead, whether the server refuses
    it (the router learns of the restore then) or the router knew of the restore before."""
    async with running_servers(2) as (servers, router):
        ids, dst, seen = await looked_up_after_a_checkpoint(router, tmp_path)
        assert seen == {0: Table(servers[0].incarnation, 0), 1: Table(servers[1].incarnation, 0)}
        await servers[1].stop()
        fresh = restarted(servers[1])
        grads = np.ones((ids.size, DIM), np.float32)
        first, second = (router.split_update([UpdateGroup(DIM, ids, grads)], token=t,
                                             event_time=1e9, tables=seen)
                         for t in ("w-8", "w-9"))
        for pending in (first, second):
            with pytest.raises(PersiaError):          # server 1 down: the pushes fail
                await router.push(pending, retry_s=0.2)
            assert pending.missing() == [1]
        await fresh.start()
        try:
            assert await load_embeddings(dst, router.clients) == 16
            # refused by the restored process; the router adopts it, the update fails
            with pytest.raises(ServerRestarted, match="restored from a checkpoint since"):
                await router.push(first, retry_s=5)
            assert router.incarnations[1] == fresh.incarnation and not router.lost
            # the router already knows of the restore: not even sent
            sent = await update_requests(fresh)
            with pytest.raises(ServerRestarted, match="looked up on incarnation"):
                await router.push(second, retry_s=5)
            assert await update_requests(fresh) == sent
            assert first.missing() == second.missing() == [1]
            assert fresh.store_stats()["updates"] == 0 and fresh.trained_through is None
            # a batch looked up on the restored process trains as before
            seen = {}
            await router.lookup([RowLookup(DIM, ids)], "train", seen=seen)
            again = router.split_update([UpdateGroup(DIM, ids, grads)], token="w-10",
                                        tables=seen)
            assert await router.push(again) == (16, 0)
            assert fresh.store_stats()["updates"] == 8
        finally:
            await fresh.stop()


async def update_requests(server: EmbeddingServer) -> float:
    async with RpcClient(server.address) as c:
        text = (await c.call("metrics")).decode()
    line = 'persia_embedding_server_requests_total{method="update"} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


async def test_with_continue_a_load_still_refuses_the_updates_of_the_table_it_replaced(
        tmp_path):
    """``continue`` accepts training on a restarted server's new table, not applying an
    update to rows a load replaced in the same process (a restore: the stream replays the
    batch); an update pinned to a process that restarted goes on there, as every update
    does with ``continue``."""
    async with running_servers(2, on_server_restart="continue") as (servers, router):
        ids, dst, seen = await looked_up_after_a_checkpoint(router, tmp_path)
        grads = np.ones((ids.size, DIM), np.float32)
        assert await load_embeddings(dst, router.clients) == 16
        stale = router.split_update([UpdateGroup(DIM, ids, grads)], token="c-1",
                                    event_time=1e9, tables=seen)
        with pytest.raises(ServerRestarted, match="replaced by a load") as err:
            await router.push(stale)
        assert err.value.field == "loads"
        assert [s.store_stats()["updates"] for s in servers] == [0, 0]
        assert [s.trained_through for s in servers] == [None, None]
        seen = {}
        await router.lookup([RowLookup(DIM, ids)], "train", seen=seen)
        fresh = await restart(servers, 1)
        moved = router.split_update([UpdateGroup(DIM, ids, grads)], token="c-2", tables=seen)
        # taken by the new process (whose empty table drops what it holds no row of)
        assert await router.push(moved) == (8, 8) and router.restarts == [0, 1]
        assert fresh.store_stats()["dropped_updates"] == 8


async def test_with_continue_a_restart_is_counted_and_training_goes_on(caplog):
    async with running_servers(2, on_server_restart="continue") as (servers, router):
        ids = np.concatenate([ids_on(0), ids_on(1)])
        await router.lookup([RowLookup(DIM, ids)], "train")
        fresh = await restart(servers, 1)
        rows, _ = await router.lookup([RowLookup(DIM, ids)], "train")
        assert rows[0].shape == (16, DIM) and len(fresh.store) == 8
        assert router.restarts == [0, 1] and not router.lost
        assert router.incarnations[1] == fresh.incarnation
        [record] = [r for r in caplog.records if "restarted" in r.getMessage()]
        assert record.levelname == "ERROR" and "on_server_restart: continue" in \
            record.getMessage()


@pytest.mark.parametrize("policy", ["fail", "continue"])
async def test_a_new_worker_meeting_an_unconfigured_server_of_a_trained_job(policy):
    """A worker that restarts after server 1 did cannot know server 1's old incarnation:
    server 1 holding no configuration while server 0 holds the job's and rows means it
    restarted after the job configured it (and trained)."""
    async with running_servers(2) as (servers, old):
        await old.broadcast("configure", JOB)
        await old.lookup([RowLookup(DIM, ids_on(0))], "train")     # server 0 holds rows
        await restart(servers, 1)
        router = ShardRouter([s.address for s in servers], timeout_ms=5000,
                             on_server_restart=policy)
        try:
            if policy == "fail":
                with pytest.raises(ServerRestarted, match="holds no configuration while"):
                    await router.lookup([RowLookup(DIM, ids_on(1))], "train")
                assert list(router.lost) == [1]
                assert await router.clients[1].call("get_config") is None
            else:
                rows, _ = await router.lookup([RowLookup(DIM, ids_on(1))], "train")
                assert np.abs(rows[0]).max() <= 0.001   # the job's init, not the default
                assert router.restarts == [0, 1]
        finally:
            await router.close()


async def test_a_restore_serves_a_restarted_server_again(tmp_path):
    async with running_servers(2) as (servers, router):
        await router.broadcast("configure", JOB)
        ids = np.concatenate([ids_on(0), ids_on(1)])
        before, _ = await router.lookup([RowLookup(DIM, ids)], "train")
        dst = str(tmp_path / "ck")
        with CheckpointWriter(dst) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="t", step=1, offsets={}, stream="direct")
        await router.update([UpdateGroup(DIM, ids, np.ones((ids.size, DIM), np.float32))])
        await restart(servers, 1)
        with pytest.raises(ServerRestarted):
            await router.lookup([RowLookup(DIM, ids)], "eval")
        assert await load_embeddings(dst, router.clients) == 16
        after, _ = await router.lookup([RowLookup(DIM, ids)], "eval")   # restored: served again
        np.testing.assert_array_equal(after[0], before[0])
        assert not router.lost and router.incarnations[1] == servers[1].incarnation


def test_on_server_restart_is_validated():
    with pytest.raises(BadInput) as err:
        ShardRouter(["127.0.0.1:1"], on_server_restart="ignore")
    assert err.value.field == "on_server_restart"
    with pytest.raises(ConfigError, match="on_server_restart"):
        GlobalConfig.from_dict({"embedding_worker_config": {"on_server_restart": "ignore"}})
    cfg = GlobalConfig.from_dict({"embedding_worker_config": {"on_server_restart": "Continue"}})
    assert cfg.embedding_worker_config.on_server_restart == "continue"
    assert GlobalConfig().embedding_worker_config.on_server_restart == "fail"


def test_a_reported_condition_is_withdrawn_by_resolve():
    sup = Supervisor("embedding worker 0")
    sup.report("embedding-servers", ServerRestarted("server 1 restarted"))
    assert not sup.ok and sup.failed.is_set() and sup.error == "server 1 restarted"
    sup.resolve("embedding-servers")
    assert sup.ok and not sup.failed.is_set() and sup.error is None


# ------------------------------------------------------------------ the worker
def grads_for(served: dict) -> dict[str, np.ndarray]:
    """Gradients that depend on the rows served (a wrong table changes every result)
    and on the batch."""
    i = int(bytes(served["meta"]).split(b"-")[1])
    return {e["name"]: (0.1 * e["emb"] + 0.01 * (i + 1)).astype(np.float32)
            for e in served["embeddings"]}


def two_servers() -> list[EmbeddingServer]:
    return [EmbeddingServer(10_000, Adagrad(lr=0.1), EmbeddingConfig((-0.5, 0.5)),
                            replica_index=i, replica_size=2,
                            checkpoint_root=TEST_CHECKPOINT_ROOT) for i in range(2)]


def snapshot(server: EmbeddingServer) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for chunk in server.store.dump():
        for i, x in enumerate(chunk["ids"].tolist()):
            out[x] = (chunk["weights"][i].copy(), chunk["state"][i].copy())
    return out


async def train(client: RpcClient, n: int, metas: list[bytes]) -> None:
    for _ in range(n):
        served = await client.call("next_batch", {"timeout_ms": 10_000})
        assert served is not None, f"no batch after {metas}"
        await client.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": grads_for(served)})
        metas.append(bytes(served["meta"]))


async def reference(n: int) -> list[dict]:
    """Both servers' rows and state after batches 0..n-1, trained once each in order."""
    servers = two_servers()
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers])
    await worker.start()
    try:
        async with RpcClient(worker.address) as client:
            for i in range(n):
                await client.call("ingest", {"batch": make_batch(i).to_wire()})
                await train(client, 1, [])
        return [snapshot(s) for s in servers]
    finally:
        await worker.stop()
        for s in servers:
            await s.stop()


N, CUT = 10, 4


@pytest.mark.kafka
@deviates_on("tansu", TANSU_LIST_OFFSETS)
async def test_a_worker_fails_loudly_then_a_restore_trains_every_batch_exactly_once(
        kafka_broker, kafka_topic, tmp_path):
    topic = kafka_topic(partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        for i in range(N):
            await producer.send(make_batch(i), key=i)
    want = await reference(N)
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="restart")
    servers = two_servers()
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers])
    await worker.start()
    await worker.start_kafka_ingest(lambda start: KafkaIngest(
        worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
        DeadLetterWriter.from_config(cfg), start_offsets=start))
    direct = [RpcClient(s.address) for s in servers]
    client = RpcClient(worker.address, timeout_ms=20_000)
    try:
        metas: list[bytes] = []
        await train(client, CUT, metas)
        front = await client.call("frontier")
        assert front["lost"] == []
        offsets = stream_cut([front], [topic]).offsets
        dst = str(tmp_path / "ck")
        with CheckpointWriter(dst) as w:
            await w.dump_embeddings(direct)
            w.commit(job="t", step=CUT, offsets=offsets, stream="kafka")
        await train(client, 2, metas)                       # trained past the cut
        in_flight = await client.call("next_batch", {"timeout_ms": 10_000})
        late = await client.call("next_batch", {"timeout_ms": 10_000})   # pushed after
        held = len(servers[1].store)

        fresh = await restart(servers, 1)
        # The batch served before the restart cannot be applied: it fails, naming it.
        with pytest.raises(ServerRestarted) as err:
            await client.call("push_gradients", {"batch_id": in_flight["batch_id"],
                                                 "grads": grads_for(in_flight)})
        assert f"batch {in_flight['batch_id']}" in str(err.value)
        assert fresh.address in str(err.value)
        # The next batch cannot be looked up; it stays first in line.
        with pytest.raises(ServerRestarted) as err:
            await client.call("next_batch", {"timeout_ms": 10_000})
        msg = str(err.value)
        assert f"embedding server 1 ({fresh.address}) restarted" in msg
        assert f"the {held} rows it held when last seen" in msg
        health = await client.call("health")
        assert health["ok"] is False and fresh.address in health["error"]
        assert not worker.supervisor.ok            # a launched worker exits 1
        front = await client.call("frontier")
        assert [lost["address"] for lost in front["lost"]] == [fresh.address]
        with pytest.raises(ServerRestarted, match=fresh.address):
            check_servers_kept([front])            # no checkpoint records the empty table
        with pytest.raises(PersiaError):
            stream_cut([front], [topic])           # (the failed batch refuses it first)
        metrics = await client.call("metrics")
        assert b'persia_embedding_worker_server_restarts_total{server="1"} 1.0' in metrics
        assert b"persia_embedding_worker_servers_lost 1.0" in metrics
        assert len(fresh.store) == 0 and fresh.store_stats()["updates"] == 0

        # The way back: restore the checkpoint into the servers, reset the stream.
        await load_embeddings(dst, direct)
        # A batch whose rows came from the old tables, pushed once the restore is in:
        # its gradients reach neither restored table (the stream replays it): server 1 is
        # another process, server 0 the same one with its table replaced by the load.
        updates0 = servers[0].store_stats()["updates"]
        with pytest.raises(ServerRestarted, match="not applied to the restored"):
            await client.call("push_gradients", {"batch_id": late["batch_id"],
                                                 "grads": grads_for(late)})
        assert fresh.store_stats()["updates"] == 0
        assert servers[0].store_stats()["updates"] == updates0
        assert b"persia_embedding_server_stream_stale_updates_refused_total 1.0" in \
            await direct[0].call("metrics")
        await client.call("reset_stream", {"offsets": offsets[topic]})
        assert (await client.call("health"))["ok"] is True and worker.supervisor.ok
        rest: list[bytes] = []
        await train(client, N - CUT, rest)
        assert metas[:CUT] + rest == [f"batch-{i}".encode() for i in range(N)]
        for got, expected in zip(servers, want, strict=True):
            rows = snapshot(got)
            assert rows.keys() == expected.keys()
            for x, (w_, s_) in expected.items():
                np.testing.assert_allclose(rows[x][0], w_, atol=1e-6, rtol=0)
                np.testing.assert_allclose(rows[x][1], s_, atol=1e-6, rtol=0)
        front = await client.call("frontier")
        assert (front["lost"], front["failed"], front["inflight"]) == ([], [], 0)
    finally:
        await client.close()
        for c in direct:
            await c.close()
        await worker.stop()
        for s in servers:
            await s.stop()


async def test_a_direct_batch_in_flight_across_a_load_is_applied_not_stuck(tmp_path):
    """A broker-less stream replays nothing: a batch looked up before a load (a
    ``load_embedding`` mid-training) and pushed after it is applied to the loaded rows, as
    before; refused, it would stay failed for good (such a stream cannot be reset)."""
    servers = two_servers()
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers])
    await worker.start()
    direct = [RpcClient(s.address) for s in servers]
    try:
        async with RpcClient(worker.address) as client:
            await client.call("ingest", {"batch": make_batch(0).to_wire()})
            await train(client, 1, [])
            dst = str(tmp_path / "ck")
            with CheckpointWriter(dst) as w:
                await w.dump_embeddings(direct)
                w.commit(job="t", step=1, offsets={}, stream="direct")
            await client.call("ingest", {"batch": make_batch(1).to_wire()})
            served = await client.call("next_batch", {"timeout_ms": 10_000})
            await load_embeddings(dst, direct)
            before = sum(s.store_stats()["updates"] for s in servers)
            reply = await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                         "grads": grads_for(served)})
            assert reply["applied"] > 0
            assert sum(s.store_stats()["updates"] for s in servers) > before
            assert (await client.call("frontier"))["failed"] == []
    finally:
        for c in direct:
            await c.close()
        await worker.stop()
        for s in servers:
            await s.stop()


async def test_a_restart_no_request_met_yet_refuses_the_checkpoint():
    """Between two batches a server restarts; the next checkpoint's frontier asks every
    server, so the cut never records its empty table as trained."""
    servers = two_servers()
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers])
    await worker.start()
    try:
        async with RpcClient(worker.address) as client:
            await client.call("ingest", {"batch": make_batch(0).to_wire()})
            await train(client, 1, [])
            await restart(servers, 1)
            front = await client.call("frontier")
            with pytest.raises(ServerRestarted, match=servers[1].address):
                check_servers_kept([front])
            assert (await client.call("health"))["ok"] is False
    finally:
        await worker.stop()
        for s in servers:
            await s.stop()


async def test_with_continue_the_worker_trains_on_counted():
    servers = two_servers()
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers],
                             on_server_restart="continue")
    await worker.start()
    try:
        async with RpcClient(worker.address) as client:
            for i in range(3):
                await client.call("ingest", {"batch": make_batch(i).to_wire()})
            metas: list[bytes] = []
            await train(client, 1, metas)
            await restart(servers, 1)
            await train(client, 2, metas)
            assert len(metas) == 3
            assert (await client.call("health"))["ok"] is True
            metrics = await client.call("metrics")
            assert b'persia_embedding_worker_server_restarts_total{server="1"} 1.0' in metrics
            assert (await client.call("frontier"))["lost"] == []
    finally:
        await worker.stop()
        for s in servers:
            await s.stop()
