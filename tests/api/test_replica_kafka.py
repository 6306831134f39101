"""A serving replica following the update stream on Kafka (``<job>.model.updates``).

Real embedding servers publish their update logs to a real Kafka-protocol broker (the
suite's test broker); the replica (uvicorn, ``PERSIA_API_UPDATES=kafka``) restores a
checkpoint, seeks to the offsets its manifest records and follows: after more training
its table equals the servers' rows exactly. A record that is not a valid update message
goes to the dead-letter topic and is counted, and the replica goes on converging. A dense
model NN rank 0 publishes to server 0 reaches the replica through the topic's last
partition.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from api_helpers import (
    LiveApi,
    TwoHeads,
    publish_dense,
    settings_for,
    start_job,
    stop_job,
    write_checkpoint,
)
from stream_persia.api.replica import Replica
from stream_persia.api.replica_kafka import KafkaFollow
from stream_persia.api.roles import Roles

from stream_persia.config import GlobalConfig
from stream_persia.config.kafka import resolve_idempotence
from stream_persia.core import wire
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD
from stream_persia.errors import Misuse
from stream_persia.kafka.updates import UpdateSink, updates_topic
from stream_persia.server.service import EmbeddingServer
from stream_persia.server.store import EmbeddingStore
from stream_persia.testing.proxy import LateProxy
from stream_persia.testing.samples import SCHEMA
from stream_persia.testing.servers import TEST_CHECKPOINT_ROOT
from stream_persia.worker.service import EmbeddingWorker

pytestmark = pytest.mark.kafka


def rows(store) -> dict[int, bytes]:
    """A live server's rows, read from the test's thread: the server's own store thread
    may be on the store (a full pass the replica asked for), which the store refuses
    (Misuse) rather than race; read again once it is done."""
    for _ in range(200):
        try:
            return {k: w.tobytes() for c in store.dump()
                    for k, w in zip(c["ids"].tolist(), c["weights"], strict=True)}
        except Misuse:
            time.sleep(0.01)
    raise AssertionError("the server's store stayed busy for 2 s")


def _follow(replica, bootstrap: str, topic: str, positions) -> KafkaFollow:
    """A Kafka follower whose dead-letter producer is idempotent as the session's broker
    allows (Tansu 0.6 refuses producer ids: the session turns idempotence off)."""
    return KafkaFollow(replica, bootstrap, topic, positions,
                       enable_idempotence=resolve_idempotence())


async def _run_now(fn):
    """A replica's ``execute``: the table's work run at once, on the loop."""
    return fn()


async def _no_dense(*_):
    """A replica's ``on_dense``: dense models are not served here."""
    return None


async def kafka_job(bootstrap: str, job_name: str, n_servers: int = 2):
    from api_helpers import Job

    servers = []
    for i in range(n_servers):
        sink = UpdateSink(updates_topic(job_name), i, bootstrap_servers=bootstrap)
        s = EmbeddingServer(100_000, SGD(lr=0.5), EmbeddingConfig((-0.5, 0.5)),
                            replica_index=i, replica_size=n_servers, job=job_name,
                            checkpoint_root=TEST_CHECKPOINT_ROOT, update_sink=sink,
                            model_update_interval_ms=50)
        await s.start()
        servers.append(s)
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers],
                             checkpoint_root=TEST_CHECKPOINT_ROOT)
    await worker.start()
    return Job(servers, [worker])


def kafka_replica(job, ckpt: str, bootstrap: str, job_name: str, tmp_path):
    """Settings of a replica following ``job_name``'s update topic from ``ckpt``."""
    gc = GlobalConfig.from_dict({"kafka": {"bootstrap_servers": bootstrap,
                                           "job_name": job_name}})
    return settings_for(job, model_checkpoint=ckpt, embeddings="replica", updates="kafka",
                        global_config=gc, checkpoint_dir=str(tmp_path / "ckpts"))


async def converged(api: LiveApi, job, timeout_s: float = 30.0) -> None:
    want = {}
    for s in job.servers:
        want.update(rows(s.store))
    follower = api.state.predictor.replica
    try:
        await _converged(api, job, want, timeout_s)
    except TimeoutError:
        raise AssertionError(f"the replica did not converge: {follower.info()}") from None


async def _converged(api: LiveApi, job, want: dict, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            follower = api.state.predictor.replica
            got = await asyncio.get_running_loop().run_in_executor(
                api.state.predictor._pool, rows, follower.store)
            if got == want:
                return
            await asyncio.sleep(0.1)


async def test_replica_follows_kafka_and_dead_letters_bad_records(kafka_broker, tmp_path):
    bootstrap = kafka_broker.bootstrap_servers
    job_name = f"rk{os.getpid()}{id(tmp_path) % 100000}"
    topic = updates_topic(job_name)
    assert kafka_broker.create_topic(topic, 3)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    job = await kafka_job(bootstrap, job_name)
    try:
        await job.train(3)
        await asyncio.sleep(0.3)    # a pass or two reach Kafka before the dump
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3))
        manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
        assert all("offset" in p for p in manifest["model_updates"]), manifest["model_updates"]
        settings = kafka_replica(job, ckpt, bootstrap, job_name, tmp_path)
        async with LiveApi(settings) as replica:
            await job.train(4, seed=1)
            await converged(replica, job)
            follower = replica.state.predictor.replica
            assert follower.cursors[0].applied["resets"] == 0   # went on from the checkpoint

            # a dense model published to server 0 reaches the replica through Kafka
            await publish_dense(job, TwoHeads(seed=9), step=42, event_time=time.time())
            async with asyncio.timeout(30):
                while follower.dense_step != 42:
                    await asyncio.sleep(0.05)
            assert follower.counts["dense_kafka"] == 1
            r = await replica.client.get("/v1/model")
            assert r.json()["model_version"] == 42
            # a restarted trainer's model (a new lineage, a lower step) follows it
            await publish_dense(job, TwoHeads(seed=10), step=3, event_time=time.time(),
                                lineage=2**63 - 1)
            async with asyncio.timeout(30):
                while follower.dense_step != 3:
                    await asyncio.sleep(0.05)
            assert follower.counts["dense_kafka"] == 2
            assert follower.dense_lineage == 2**63 - 1

            producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
            await producer.start()
            try:
                await producer.send_and_wait(topic, b"not a frame", partition=0)
            finally:
                await producer.stop()
            await job.train(3, seed=2)
            await converged(replica, job)
            assert follower.counts["bad_messages"] == 1
            consumer = AIOKafkaConsumer(f"{topic}.dlq", bootstrap_servers=bootstrap,
                                        auto_offset_reset="earliest")
            await consumer.start()
            try:
                got = await consumer.getmany(timeout_ms=5000)
                records = [r for rs in got.values() for r in rs]
            finally:
                await consumer.stop()
            assert [r.value for r in records] == [b"not a frame"]
    finally:
        await stop_job(job)


async def test_a_broker_outage_is_a_gap_in_freshness_then_the_replica_converges(tmp_path):
    """The broker goes down while training goes on: the servers keep their update logs and
    publish them once it is back, the replica's trained_through stands still meanwhile (the
    gap shows), and it ends with the servers' rows, nothing applied twice."""
    from stream_persia.testing.kafka_mock import MockKafkaCluster

    with MockKafkaCluster() as kafka:
        bootstrap = kafka.bootstrap_servers
        job_name = "outage"
        topic = updates_topic(job_name)
        assert kafka.create_topic(topic, 3)
        kafka.create_topic(f"{topic}.dlq", 1)
        job = await kafka_job(bootstrap, job_name)
        try:
            await job.train(2)
            await asyncio.sleep(0.3)
            ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"),
                                          TwoHeads(seed=3))
            settings = kafka_replica(job, ckpt, bootstrap, job_name, tmp_path)
            async with LiveApi(settings) as replica:
                await job.train(2, seed=1)
                await converged(replica, job)
                follower = replica.state.predictor.replica
                versions = [c.version for c in follower.cursors]
                kafka.broker_down()
                await job.train(3, seed=2)          # training goes on without the broker
                await asyncio.sleep(1.0)
                assert [c.version for c in follower.cursors] == versions   # the gap
                assert any(s.feed.unpublished for s in job.servers)   # kept in the log
                kafka.broker_up()
                await converged(replica, job, timeout_s=60)
                assert all(c.resyncs == 0 for c in follower.cursors)   # no message lost
        finally:
            await stop_job(job)


async def test_a_restore_to_an_older_checkpoint_lowers_trained_through_over_kafka(
        kafka_broker, tmp_path):
    """As over RPC (test_replica.py): the servers restored from a checkpoint trained
    through t1 after training reached t2; the replica reads their full passes from the
    topic and says t1 again (the dense model of t2 still served), counting the rewind."""
    from test_replica import train_stamped

    from stream_persia.checkpoint import load_embeddings

    bootstrap = kafka_broker.bootstrap_servers
    job_name = f"rw{os.getpid()}{id(tmp_path) % 100000}"
    topic = updates_topic(job_name)
    assert kafka_broker.create_topic(topic, 3)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    job = await kafka_job(bootstrap, job_name)
    try:
        t1 = time.time() - 100.0
        t2 = t1 + 50.0
        await train_stamped(job, 3, t1)
        await asyncio.sleep(0.3)    # a pass or two reach Kafka before the dump
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3),
                                      trained_through=t1)
        settings = kafka_replica(job, ckpt, bootstrap, job_name, tmp_path)
        async with LiveApi(settings) as replica:
            follower = replica.state.predictor.replica
            await train_stamped(job, 2, t2, seed=1)
            await publish_dense(job, TwoHeads(seed=5), step=20, event_time=t2, lineage=7)
            async with asyncio.timeout(30):
                while follower.trained_through != t2:
                    await asyncio.sleep(0.05)
            await load_embeddings(ckpt, [job.client(a) for a in job.server_addresses])
            async with asyncio.timeout(30):
                while follower.trained_through != t1:
                    await asyncio.sleep(0.05)
            await converged(replica, job)
            assert follower.dense_step == 20
            assert follower.counts["trained_through_rewinds"] == 1
    finally:
        await stop_job(job)


async def test_a_checkpoint_place_retention_deleted_without_an_offset_resyncs(kafka_broker):
    """The checkpoint recorded its place in server 0's log without a Kafka offset (the sink
    knew none yet), and retention has deleted that place and the reset of the process that
    came after it: the partition holds only the middle of a later log. Its records used to
    be skipped as older than the checkpoint, and the replica waited for its place for good,
    nothing said. Read to the partition's end without it, the shard asks its server for a
    full pass and follows that."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkgone{os.getpid()}")
    assert kafka_broker.create_topic(topic, 2)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    later = [{"job": "j", "shard": 0, "shards": 1, "incarnation": "later", "seq": seq,
              "kind": "mark", "version": seq, "event_time": 10.0 + seq} for seq in (40, 41)]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for m in later:
            await producer.send_and_wait(topic, wire.pack(m), partition=0)
    finally:
        await producer.stop()

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    positions = [{"incarnation": "gone", "seq": 5}]
    replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), positions, _run_now, _no_dense,
                      dense_step=1, dense_event_time=1.0)
    follow = _follow(replica, bootstrap, topic, positions)
    await follow.start()
    try:
        cursor = replica.cursors[0]
        async with asyncio.timeout(20):
            while cursor.resyncs < 1:
                await asyncio.sleep(0.05)
        assert cursor.start is None and cursor.skipping and cursor.version is None
    finally:
        await follow.stop()
        await roles.close()
        await stop_job(job)


async def test_a_checkpoint_of_another_server_count_skips_the_old_layouts_records(
        kafka_broker):
    """A checkpoint written by 2 servers restored into a job of 1 (a supported restore):
    its positions name other logs, so every partition is read from its start, where the
    topic still holds the 2-server layout's records. Each used to be refused as another
    shard's, logged at error, counted as bad and copied to the dead-letter topic. They are
    skipped, said once, and the current server's log is followed."""
    import numpy as np

    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkrescaled{os.getpid()}")
    assert kafka_broker.create_topic(topic, 2)
    kafka_broker.create_topic(f"{topic}.dlq", 1)

    def m(shards: int, inc: str, seq: int, kind: str) -> dict:
        out = {"job": "j", "shard": 0, "shards": shards, "incarnation": inc, "seq": seq,
               "kind": kind, "version": seq, "event_time": 10.0 + seq}
        if kind == "rows":
            out.update(dim=2, ids=np.array([2, 4], np.uint64),
                       weights=np.ones((2, 2), np.float32))
        return out

    old = [m(2, "old", 0, "reset"), m(2, "old", 1, "rows"), m(2, "old", 2, "mark")]
    new = [m(1, "new", 0, "reset"), m(1, "new", 1, "mark")]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for msg in old + new:
            await producer.send_and_wait(topic, wire.pack(msg), partition=0)
    finally:
        await producer.stop()

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    positions = [{"incarnation": "old", "seq": 3, "offset": 3},
                 {"incarnation": "old1", "seq": 3, "offset": 0}]
    replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), positions, _run_now, _no_dense,
                      dense_step=1, dense_event_time=1.0)
    assert replica.positions is None
    follow = _follow(replica, bootstrap, topic, replica.positions)
    await follow.start()
    try:
        cursor = replica.cursors[0]
        async with asyncio.timeout(20):
            while cursor.version != 1:
                await asyncio.sleep(0.05)
        assert replica.counts["bad_messages"] == 0 and follow.other_layout == {0: 3}
        assert cursor.resyncs == 0 and cursor.incarnation == "new"
    finally:
        await follow.stop()
        await roles.close()
        await stop_job(job)


async def test_a_kafka_replica_given_the_servers_in_another_order_says_so_and_asks_nothing(
        kafka_broker, caplog):
    """Over Kafka each server's records come from its own partition, whatever the order of
    PERSIA_EMBEDDING_SERVERS; but a full pass was asked of the address listed at the
    shard's place: in another order another server did it and the shard waited on, with
    nothing said. The replica says so at start, naming the setting, and asks no full pass
    of a server that answers as another shard."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkorder{os.getpid()}")
    assert kafka_broker.create_topic(topic, 3)
    kafka_broker.create_topic(f"{topic}.dlq", 1)

    job = await start_job(n_servers=2)
    roles = Roles([], tuple(reversed(job.server_addresses)))
    replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), None, _run_now, _no_dense)
    follow = _follow(replica, bootstrap, topic, None)
    try:
        for s in job.servers:
            await s.feed.run_pass()
        full = [s.feed.counts["full_passes"] for s in job.servers]
        with caplog.at_level("WARNING", logger="stream_persia.api.replica_kafka"):
            await follow.start()
        said = [m for r in caplog.records
                if "PERSIA_EMBEDDING_SERVERS" in (m := r.getMessage())]
        assert len(said) == 2 and "listed as server 0 of 2" in said[0]
        mid = {"job": "j", "shard": 0, "shards": 2, "incarnation": "x", "seq": 7,
               "kind": "mark", "version": 7, "event_time": 17.0}
        rec = SimpleNamespace(value=wire.pack(mid), key=None, topic=topic, partition=0,
                              offset=0)
        await follow.take(replica.cursors[0], [rec])   # joined mid-log: a gap
        assert replica.cursors[0].skipping
        for s in job.servers:
            await s.feed.run_pass()
        assert [s.feed.counts["full_passes"] for s in job.servers] == full
        assert replica.counts["pull_failures"] >= 2
    finally:
        await follow.stop()
        await roles.close()
        await stop_job(job)


async def _produce(bootstrap: str, topic: str, msgs: list[dict]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for m in msgs:
            await producer.send_and_wait(topic, wire.pack(m), partition=0)
    finally:
        await producer.stop()


def _mark(inc: str, seq: int, kind: str = "mark") -> dict:
    return {"job": "j", "shard": 0, "shards": 1, "incarnation": inc, "seq": seq,
            "kind": kind, "version": seq, "event_time": 10.0 + seq}


async def test_a_failing_batch_is_said_once_and_asks_one_full_pass(kafka_broker, caplog):
    """Applying a batch failed with an exception that is not a refusal (here the table's
    thread fails every time): each failing batch used to be logged with its traceback,
    counted as a bad message (the records were fine) and answered with another full
    pass asked of the server. Said once, counted as a failure, one full pass asked."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkbug{os.getpid()}")
    assert kafka_broker.create_topic(topic, 2)
    kafka_broker.create_topic(f"{topic}.dlq", 1)

    async def execute(fn):
        raise RuntimeError("the table's thread is gone")

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), None, execute, _no_dense,
                      dense_step=1, dense_event_time=1.0)
    follow = _follow(replica, bootstrap, topic, None)
    await follow.start()
    try:
        with caplog.at_level("ERROR", logger="stream_persia.api.replica_kafka"):
            for seq, kind in enumerate(("reset", "mark", "mark")):
                await _produce(bootstrap, topic, [_mark("a", seq, kind)])
                async with asyncio.timeout(20):
                    while (replica.counts["pull_failures"]
                           + replica.counts["bad_messages"]) < seq + 1:
                        await asyncio.sleep(0.02)
        said = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(said) == 1
        assert replica.cursors[0].resyncs == 1 and replica.counts["bad_messages"] == 0
        assert replica.cursors[0].skipping
    finally:
        await follow.stop()
        await roles.close()
        await stop_job(job)


async def test_a_checkpoint_place_not_written_yet_is_waited_for(kafka_broker):
    """The checkpoint recorded its place in server 0's log without an offset (the server's
    sink had nothing acknowledged yet). The replica read the partition to its end before
    the server wrote that place: it asked a full pass as if retention had deleted it, and
    another when the place came ("joined mid-log"). The partition ends in the checkpoint's
    own process's records: it waits, and follows on from the place, no full pass asked."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkplace{os.getpid()}")
    assert kafka_broker.create_topic(topic, 2)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    await _produce(bootstrap, topic, [_mark("now", 0, "reset"), _mark("now", 1),
                                      _mark("now", 2)])

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    positions = [{"incarnation": "now", "seq": 3}]
    replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), positions, _run_now, _no_dense,
                      dense_step=1, dense_event_time=1.0)
    follow = _follow(replica, bootstrap, topic, positions)
    await follow.start()
    try:
        cursor = replica.cursors[0]
        await asyncio.sleep(1.0)   # several fetches at the partition's end
        assert cursor.resyncs == 0 and cursor.start == ("now", 3)
        await _produce(bootstrap, topic, [_mark("now", 3), _mark("now", 4)])
        async with asyncio.timeout(20):
            while cursor.version != 4:
                await asyncio.sleep(0.05)
        assert cursor.resyncs == 0 and not cursor.skipping
    finally:
        await follow.stop()
        await roles.close()
        await stop_job(job)


async def test_a_full_pass_whose_ask_failed_is_asked_again(kafka_broker):
    """A gap found while its server could not be reached: the ask of a full pass failed,
    was said, and never made again: the shard skipped every record until that server's
    next restart or restore. It is asked again once the server answers, and GET
    /v1/model's ``full_pass`` tells it apart from a refused pass."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkretry{os.getpid()}")
    assert kafka_broker.create_topic(topic, 2)
    kafka_broker.create_topic(f"{topic}.dlq", 1)

    job = await start_job(n_servers=1)
    proxy = LateProxy(job.server_addresses[0])   # nothing listens until started
    roles = Roles([], (proxy.address,))
    replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), None, _run_now, _no_dense,
                      dense_step=1, dense_event_time=1.0)
    follow = _follow(replica, bootstrap, topic, None)
    await follow.start()
    try:
        feed = job.servers[0].feed
        await feed.run_pass()
        full = feed.counts["full_passes"]
        cursor = replica.cursors[0]
        rec = SimpleNamespace(value=wire.pack(_mark("x", 7)), key=None, topic=topic,
                              partition=0, offset=0)
        await follow.take(cursor, [rec])   # joined mid-log: a gap, its server unreachable
        assert cursor.skipping and cursor.resync_pending and cursor.resyncs == 0
        assert replica.info()["shards"][0]["full_pass"] == "to_ask"
        proxy.start()
        async with asyncio.timeout(20):
            while cursor.resync_pending:
                await asyncio.sleep(0.05)
        assert cursor.resyncs == 1 and replica.info()["shards"][0]["full_pass"] == "asked"
        await feed.run_pass()
        assert feed.counts["full_passes"] == full + 1
    finally:
        await follow.stop()
        await roles.close()
        proxy.close()
        await stop_job(job)


class _LoadFails:
    """A real table whose loads of rows raise MemoryError (the Cython table's, when it
    cannot grow)."""

    def __init__(self, table):
        self.table = table

    def __getattr__(self, name):
        return getattr(self.table, name)

    def load(self, chunks):
        raise MemoryError("the table could not grow")


async def test_a_full_pass_failing_in_the_batch_of_its_reset_is_asked_again(kafka_broker):
    """A shard skipping to the full pass it asked for; the pass's reset and rows came in
    one fetch, and the rows failed (MemoryError): the reset had spent the ask, and the
    shard, skipping again, asked none (it had asked already), so it skipped every record
    until its server's next restart. It asks again."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = updates_topic(f"rkspent{os.getpid()}")
    assert kafka_broker.create_topic(topic, 2)
    kafka_broker.create_topic(f"{topic}.dlq", 1)

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    replica = Replica(roles, _LoadFails(EmbeddingStore(100, SGD(lr=0.0))), None, _run_now,
                      _no_dense, dense_step=1, dense_event_time=1.0)
    follow = _follow(replica, bootstrap, topic, None)
    await follow.start()
    try:
        cursor = replica.cursors[0]
        cursor.skipping = True            # a full pass asked, waited for
        asked = cursor.resyncs
        rows = {**_mark("p", 1, "rows"), "dim": 2, "ids": np.array([5], np.uint64),
                "weights": np.ones((1, 2), np.float32)}
        recs = [SimpleNamespace(value=wire.pack(m), key=None, topic=topic, partition=0,
                                offset=i) for i, m in enumerate((_mark("p", 0, "reset"), rows))]
        await follow._take_batch(0, recs)
        assert cursor.applied["resets"] == 1 and cursor.skipping
        assert cursor.resyncs == asked + 1, "the spent full pass was not asked again"
    finally:
        await follow.stop()
        await roles.close()
        await stop_job(job)
