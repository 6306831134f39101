"""No silent loss, and a broker that is gone fails in bounded time: the samples consumer
and producers against the real mock broker (its own cluster where a test deletes data or
kills the broker; the mock keeps ~5 MiB per partition and silently drops older data).

- Offsets deleted by retention before they were read, a gap between records
  (transaction markers of a transactional producer), and stored offsets below the log
  start: by default the partition stops (the others go on) and the loss is reported;
  with ``on_data_loss="skip"`` the loss is counted per partition and reading goes on.
- Start-up: a consumer, a producer or a ``DataCtx`` started before the broker is
  reachable (a loopback proxy that starts forwarding later) connects when it comes; with
  no broker ever, it fails within the bound naming the servers.
- A broker killed while a consumer, a ``KafkaIngest`` task or a producer waits on it
  fails them with ``KafkaUnavailable`` naming the bootstrap servers, in bounded time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import namedtuple

import pytest
from aiokafka import AIOKafkaProducer

from stream_persia.config import KafkaConfig
from stream_persia.core.aio import LoopThread
from stream_persia.ctx import DataCtx
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD
from stream_persia.errors import ConfigError, InternalError, PeerUnavailable, RemoteError
from stream_persia.kafka import (
    BatchProducer,
    DataLoss,
    DeadLetterWriter,
    KafkaDataLoss,
    KafkaUnavailable,
    SampleConsumer,
    topic_partitions,
)
from stream_persia.kafka.loss import gaps
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.proxy import LateProxy, free_port
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.worker.frontier import Frontier
from stream_persia.worker.ingest import KafkaIngest
from stream_persia.worker.service import EmbeddingWorker

pytestmark = [pytest.mark.timeout(90), pytest.mark.client_settings]

Rec = namedtuple("Rec", "offset")
BIG = b"x" * 100_000          # 80 of them overflow the mock's ~5 MiB per partition


async def bounded(coro, seconds: float = 30.0):
    return await asyncio.wait_for(coro, seconds)


async def produce(bootstrap: str, topic: str, partition: int, values: list[bytes],
                  **producer_kwargs) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **producer_kwargs)
    await bounded(producer.start())
    try:
        for value in values:
            await producer.send(topic, value, partition=partition)
        await bounded(producer.flush())
    finally:
        await producer.stop()


async def read(consumer: SampleConsumer, seconds: float = 3.0, until: int | None = None
               ) -> dict[int, list[int]]:
    """Offsets returned per partition within ``seconds`` (or once ``until`` arrived)."""
    got: dict[int, list[int]] = {}
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        for p, recs in (await consumer.getmany(timeout_ms=100)).items():
            got.setdefault(p, []).extend(r.offset for r in recs)
        if until is not None and sum(map(len, got.values())) >= until:
            break
    return got


async def delete_unread(cluster: MockKafkaCluster, consumer: SampleConsumer, topic: str,
                        partition: int) -> int:
    """Overflow ``partition`` while its consumer is paused, so that data it has not read
    is deleted before it resumes (what a slow job meets on a broker with retention);
    returns the partition's new log start offset."""
    consumer.pause([partition])
    await produce(cluster.bootstrap_servers, topic, partition, [BIG] * 80)
    tp = consumer._tps[partition]
    begin = (await consumer._live().beginning_offsets([tp]))[tp]
    assert begin > (await consumer.positions())[partition]
    consumer.resume([partition])
    return begin


# --------------------------------------------------------------------- pure logic

def test_gaps_cost_nothing_on_contiguous_batches_and_find_every_hole():
    assert gaps([], 5) == []
    assert gaps([Rec(5), Rec(6), Rec(7)], 5) == []
    assert gaps([Rec(9), Rec(10)], 5) == [(0, 5)]                 # after the position
    assert gaps([Rec(5), Rec(7), Rec(8), Rec(12)], 5) == [(1, 6), (3, 9)]


def test_a_loss_names_topic_partition_and_offsets():
    loss = DataLoss("t", 3, 10, 25, "deleted", accepted=False)
    assert loss.lost == 15
    assert loss.describe() == ("t/3: offsets 10..24 (15 messages) were deleted (retention) "
                               "before they were read")
    assert DataLoss("t", 0, 9, 4, "truncated", True).lost == 0
    err = KafkaDataLoss([loss])
    assert "t/3: offsets 10..24" in str(err) and err.field == "kafka.on_data_loss"
    assert "on_data_loss: skip" in str(err)


@pytest.mark.parametrize("key,value,match", [
    ("on_data_loss", "ignore", "on_data_loss"),
    ("broker_timeout_ms", 10, "broker_timeout_ms"),
    ("startup_timeout_ms", -1, "startup_timeout_ms"),
])
def test_new_kafka_keys_are_validated_by_name(key, value, match):
    with pytest.raises(ConfigError, match=match):
        KafkaConfig(**{key: value})
    assert KafkaConfig(on_data_loss="SKIP").on_data_loss == "skip"
    with pytest.raises(ConfigError, match="on_data_loss"):
        SampleConsumer("h:1", "t", on_data_loss="ignore")


def test_the_frontier_refuses_to_pass_unread_offsets():
    f = Frontier({0: 0})
    f.read(0, 0)
    with pytest.raises(InternalError, match="1..2 never were"):
        f.read(0, 3)


# ------------------------------------------------------------- data loss, consumer

@pytest.mark.kafka
async def test_retention_stops_that_partition_and_the_others_go_on():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("ret", 2)
        for p in (0, 1):
            await produce(cluster.bootstrap_servers, "ret", p, [b"a", b"b", b"c"])
        consumer = SampleConsumer(cluster.bootstrap_servers, "ret")
        try:
            await bounded(consumer.start())
            assert await read(consumer, until=6) == {0: [0, 1, 2], 1: [0, 1, 2]}
            begin = await delete_unread(cluster, consumer, "ret", 0)
            await produce(cluster.bootstrap_servers, "ret", 1, [b"d", b"e"])
            got = await read(consumer, seconds=3)
            assert got == {1: [3, 4]}                          # partition 1 goes on
            (loss,) = consumer.stopped().values()
            assert (loss.partition, loss.first, loss.resume, loss.cause, loss.accepted) == \
                (0, 3, begin, "deleted", False)
            # Nothing past the loss is handed over, and nothing resumes the partition.
            consumer.resume()
            assert 0 not in await read(consumer, seconds=1)
            assert (await consumer.positions())[0] == 3
            assert (await consumer.lag())[0] == 83 - 3        # the loss counts as lag
            stats = consumer.stats()
            assert stats["partitions_stopped"] == 1 and stats["data_loss_events"] == 1
            assert stats["offsets_lost"] == 0                 # not accepted: not counted
        finally:
            await consumer.stop()


@pytest.mark.kafka
async def test_with_skip_the_loss_is_counted_per_partition_and_reading_goes_on():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("ret", 2)
        await produce(cluster.bootstrap_servers, "ret", 0, [b"a", b"b", b"c"])
        consumer = SampleConsumer(cluster.bootstrap_servers, "ret", on_data_loss="skip")
        try:
            await bounded(consumer.start())
            assert await read(consumer, until=3) == {0: [0, 1, 2]}
            begin = await delete_unread(cluster, consumer, "ret", 0)
            got = await read(consumer, seconds=10, until=83 - begin)
            assert got == {0: list(range(begin, 83))}
            assert consumer.stopped() == {}
            assert consumer.lost_messages() == {0: begin - 3}
            assert consumer.stats()["offsets_lost"] == begin - 3
            (loss,) = consumer.accepted_losses()
            assert (loss.first, loss.resume, loss.accepted) == (3, begin, True)
        finally:
            await consumer.stop()


@pytest.mark.kafka
@pytest.mark.parametrize("mode", ["fail", "skip"])
async def test_a_gap_between_records_is_a_loss(mode):
    """A transactional producer's commit markers take offsets that hold no sample: a
    hole the consumer cannot tell from lost data (stream-persia's producers are not
    transactional; such topics need on_data_loss=skip)."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("tx", 1)
        producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap_servers,
                                    transactional_id="gap-test")
        await bounded(producer.start())
        try:
            for values in ([b"a", b"b", b"c"], [b"d", b"e"]):
                async with producer.transaction():     # offsets 0-2, marker 3, 4-5, 6
                    for v in values:
                        await producer.send("tx", v, partition=0)
        finally:
            await producer.stop()
        # check_crcs=False: the mock writes its commit markers with a CRC aiokafka rejects.
        consumer = SampleConsumer(cluster.bootstrap_servers, "tx", on_data_loss=mode,
                                  check_crcs=False)
        try:
            await bounded(consumer.start())
            got = await read(consumer, seconds=3)
            if mode == "fail":
                assert got == {0: [0, 1, 2]}
                assert consumer.stopped()[0] == DataLoss("tx", 0, 3, 4, "gap", False)
                assert (await consumer.positions())[0] == 3
            else:
                assert got == {0: [0, 1, 2, 4, 5]}
                assert consumer.lost_messages() == {0: 1}
        finally:
            await consumer.stop()


# -------------------------------------------------- a KafkaIngest and its frontier

class Worker:
    """An embedding server and worker in this loop, fed from Kafka."""

    def __init__(self) -> None:
        self.server = EmbeddingServer(10_000, SGD(lr=0.1), EmbeddingConfig((-0.5, 0.5)))
        self.worker: EmbeddingWorker | None = None

    async def __aenter__(self) -> EmbeddingWorker:
        await self.server.start()
        self.worker = EmbeddingWorker(SCHEMA, [self.server.address], ready_buffer_batches=2)
        await self.worker.start()
        return self.worker

    async def __aexit__(self, *exc: object) -> None:
        if self.worker is not None:
            await self.worker.stop()
        await self.server.stop()


def ingest_factory(worker: EmbeddingWorker, cfg: KafkaConfig):
    def make(start_offsets):
        return KafkaIngest(worker, SampleConsumer.from_config(cfg, replica_index=0,
                                                              replica_size=1),
                           DeadLetterWriter.from_config(cfg), start_offsets=start_offsets)
    return make


async def serve_all(worker: EmbeddingWorker, client_calls: int) -> list[bytes]:
    """Pull and apply ``client_calls`` batches as an NN worker would."""
    metas = []
    for _ in range(client_calls):
        served = await worker._next_batch({"timeout_ms": 3000})
        if served is None:
            break
        metas.append(served["meta"])
        await worker._push_gradients({"batch_id": served["batch_id"],
                                      "grads": dict.fromkeys(("user", "item", "tags"))})
    return metas


@pytest.mark.kafka
async def test_the_checkpoint_frontier_stays_before_the_loss_and_a_restore_past_it_is_refused():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("job", 2)
        cluster.create_topic("job.dlq", 1)
        cfg = KafkaConfig(bootstrap_servers=cluster.bootstrap_servers, samples_topic="job")
        for p in (0, 1):
            await produce(cluster.bootstrap_servers, "job", p,
                          [make_batch(10 * p + i).to_bytes() for i in range(3)])
        async with Worker() as worker:
            await bounded(worker.start_kafka_ingest(ingest_factory(worker, cfg)))
            consumer = worker.kafka.consumer
            assert len(await serve_all(worker, 6)) == 6
            assert worker.frontier.offsets() == {0: 3, 1: 3}
            await delete_unread(cluster, consumer, "job", 0)
            await produce(cluster.bootstrap_servers, "job", 1,
                          [make_batch(100 + i).to_bytes() for i in range(2)])
            assert len(await serve_all(worker, 3)) == 2       # partition 1 only
            status = await worker._status({})
            assert status["kafka"]["stopped"]["0"]["first"] == 3
            assert "job/0: offsets 3.." in status["kafka"]["stopped"]["0"]["message"]
            assert status["frontier"] == {"0": 3, "1": 5}      # never past the loss
            assert not worker.kafka.task.done()                # ingest goes on
            metrics = worker.metrics.render().decode()
            assert "persia_embedding_worker_kafka_consumer_partitions_stopped 1.0" in metrics
            assert "persia_embedding_worker_kafka_consumer_data_loss_events_total 1.0" in \
                metrics
            # Restoring a cut whose offset the broker deleted is refused, and the running
            # ingest is left as it was.
            with pytest.raises(KafkaDataLoss, match="job/0: offsets 3"):
                await worker._reset_stream({"offsets": {"0": 3, "1": 5}})
            assert worker.frontier.offsets() == {0: 3, 1: 5}
            assert not worker.kafka.task.done()


# ------------------------------------------------------------------ start-up

@pytest.mark.kafka
async def test_a_consumer_and_producer_started_before_the_broker_connect_when_it_comes():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("late", 1)
        proxy = LateProxy(cluster.bootstrap_servers)
        try:
            consumer = SampleConsumer(proxy.address, "late", startup_timeout_s=30)
            starting = asyncio.create_task(consumer.start())
            producing = asyncio.create_task(
                BatchProducer("late", bootstrap_servers=proxy.address,
                              startup_timeout_s=30).start())
            await asyncio.sleep(1.5)
            assert not starting.done() and not producing.done()  # waiting, not failed
            proxy.start()
            await bounded(starting)
            await bounded(producing)
            await produce(cluster.bootstrap_servers, "late", 0, [b"hello"])
            assert await read(consumer, until=1) == {0: [0]}
            await consumer.stop()
        finally:
            proxy.close()


@pytest.mark.kafka
def test_a_data_loader_started_before_the_broker_sends_once_it_comes(monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    with MockKafkaCluster() as cluster:
        cluster.create_topic("late", 1)
        proxy = LateProxy(cluster.bootstrap_servers)
        timer = threading.Timer(1.5, proxy.start)
        try:
            ctx = DataCtx(kafka_bootstrap_servers=proxy.address, topic="late",
                          startup_timeout_ms=30_000)
            timer.start()
            t0 = time.monotonic()
            with ctx:
                ctx.send_data(make_batch(0))
            assert time.monotonic() - t0 >= 1.4 and ctx.stats()["acked"] == 1
        finally:
            timer.cancel()
            proxy.close()


def test_a_broker_less_data_loader_waits_for_its_embedding_workers(monkeypatch):
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "PERSIA_GLOBAL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    lt = LoopThread(name="late-worker")
    roles: list = []

    async def up() -> None:
        server = EmbeddingServer(10_000, SGD(lr=0.1), EmbeddingConfig((-0.5, 0.5)))
        await server.start()
        worker = EmbeddingWorker(SCHEMA, [server.address], port=port)
        await worker.start()
        roles.extend([worker, server])

    timer = threading.Timer(1.5, lambda: lt.run(up(), timeout=20))
    try:
        timer.start()
        t0 = time.monotonic()
        with DataCtx(embedding_workers=[f"127.0.0.1:{port}"], startup_timeout_ms=30_000) as ctx:
            ctx.send_data(make_batch(0))     # queued; it waits for the worker
            ctx.flush()
            assert time.monotonic() - t0 >= 1.4
        assert ctx.stats()["acked"] == 1 and len(roles[0].ready) == 1
    finally:
        timer.cancel()
        timer.join()

        async def down() -> None:
            for r in roles:
                await r.stop()

        lt.run(down(), timeout=20)
        lt.close()


async def test_with_no_broker_ever_start_up_fails_within_the_bound_naming_it(unused_tcp_port):
    servers = f"127.0.0.1:{unused_tcp_port}"
    for start in (lambda: SampleConsumer(servers, "t", startup_timeout_s=1).start(),
                  lambda: topic_partitions(servers, "t", startup_timeout_s=1)):
        t0 = time.monotonic()
        with pytest.raises(KafkaUnavailable, match=f"cannot reach Kafka at {servers}"):
            await bounded(start())
        assert 1 <= time.monotonic() - t0 < 10


def test_a_data_loader_with_no_peer_ever_fails_within_the_bound(unused_tcp_port, monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    address = f"127.0.0.1:{unused_tcp_port}"
    for kw, field in (({"kafka_bootstrap_servers": address}, "kafka.bootstrap_servers"),
                      ({"embedding_workers": [address]}, "embedding_workers")):
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable) as err, \
                DataCtx(startup_timeout_ms=1000, **kw) as ctx:
            ctx.send_data(make_batch(0))
            ctx.flush()
        assert 1 <= time.monotonic() - t0 < 15
        assert err.value.field == field and address in str(err.value)


# ------------------------------------------------------------ a broker that dies

@pytest.mark.kafka
async def test_a_consumer_fails_naming_the_broker_once_it_is_gone():
    cluster = MockKafkaCluster().start()
    try:
        cluster.create_topic("dies", 1)
        servers = cluster.bootstrap_servers
        consumer = SampleConsumer(servers, "dies", broker_timeout_s=2)
        await bounded(consumer.start())
        assert await read(consumer, seconds=1.5) == {}      # idle but alive: no failure
        cluster.kill()
        t0 = time.monotonic()
        with pytest.raises(KafkaUnavailable, match=f"no Kafka broker at {servers}"):
            await bounded(read(consumer, seconds=60))
        assert time.monotonic() - t0 < 2 + 8
        await consumer.stop()
    finally:
        cluster.stop()


@pytest.mark.kafka
async def test_the_kafka_ingest_task_ends_with_kafka_unavailable_when_the_broker_dies():
    cluster = MockKafkaCluster().start()
    try:
        cluster.create_topic("job", 1)
        cluster.create_topic("job.dlq", 1)
        cfg = KafkaConfig(bootstrap_servers=cluster.bootstrap_servers, samples_topic="job",
                          broker_timeout_ms=2000)
        async with Worker() as worker:
            await bounded(worker.start_kafka_ingest(ingest_factory(worker, cfg)))
            await asyncio.sleep(1.5)
            assert not worker.kafka.task.done()
            cluster.kill()
            t0 = time.monotonic()
            with pytest.raises(KafkaUnavailable) as err:
                await bounded(asyncio.shield(worker.kafka.task))
            assert time.monotonic() - t0 < 2 + 8
            assert cfg.bootstrap_servers in str(err.value)
            assert (await worker._status({}))["kafka"]["error"].startswith("KafkaUnavailable")
    finally:
        cluster.stop()


@pytest.mark.kafka
async def test_a_producer_waiting_on_a_dead_broker_fails_naming_it():
    cluster = MockKafkaCluster().start()
    try:
        cluster.create_topic("dies", 1)
        servers = cluster.bootstrap_servers
        producer = BatchProducer("dies", bootstrap_servers=servers, max_in_flight=1,
                                 broker_timeout_s=2, send_timeout_s=600)
        await bounded(producer.start())
        await bounded(producer.send_and_wait(b"before"))
        cluster.kill()
        t0 = time.monotonic()
        with pytest.raises(KafkaUnavailable, match=f"no Kafka broker at {servers}"):
            await bounded(producer.send(b"one"))
            await bounded(producer.send(b"two"))   # waits for room: the first is stuck
        assert time.monotonic() - t0 < 2 + 8      # not send_timeout_s (600 s)
        with pytest.raises(KafkaUnavailable):
            await bounded(producer.flush(timeout_s=600))
        # Closing waits send_timeout_s at most for the undelivered batches, then fails them.
        producer.send_timeout_s = 1
        with pytest.raises(RemoteError, match="delivery to 'dies' failed"):
            await bounded(producer.close(), 15)
    finally:
        cluster.stop()
