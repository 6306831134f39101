"""stream_persia.kafka against a real broker (the mock cluster process) over TCP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest
from aiokafka import AIOKafkaProducer

from stream_persia.errors import (
    Backpressure,
    BadInput,
    ConfigError,
    Misuse,
    PeerUnavailable,
    RemoteTimeout,
)
from stream_persia.kafka import (
    BatchProducer,
    DeadLetterWriter,
    KafkaDataLoss,
    KafkaUnavailable,
    SampleConsumer,
    create_producer,
    parse_dead_letter,
    partitions_for_replica,
    validate_topic,
)
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.pytest_plugin import TANSU_LIST_OFFSETS, deviates_on

pytestmark = [pytest.mark.timeout(60), pytest.mark.client_settings]


async def bounded(coro: Awaitable, seconds: float = 20.0):
    return await asyncio.wait_for(coro, seconds)


async def produce(bootstrap: str, topic: str, messages: list[tuple[int, bytes]]) -> None:
    """Write ``(partition, value)`` pairs with a plain aiokafka producer."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for partition, value in messages:
            await producer.send(topic, value, partition=partition)
        await producer.flush()
    finally:
        await producer.stop()


async def drain(consumer: SampleConsumer, count: int, seconds: float = 15.0) -> list:
    """Read until ``count`` records arrived, then 200 ms more to catch any extras."""
    records: list = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while len(records) < count and loop.time() < deadline:
        for batch in (await consumer.getmany(timeout_ms=100)).values():
            records += batch
    for batch in (await consumer.getmany(timeout_ms=200)).values():
        records += batch
    return records


# ------------------------------------------------------------- pure (no sockets)

def test_static_assignment_covers_every_partition_exactly_once():
    for n in (1, 4, 7, 64):
        for w in range(1, n + 1):
            owned = [partitions_for_replica(n, i, w) for i in range(w)]
            flat = sorted(p for ps in owned for p in ps)
            assert flat == list(range(n))
            assert all(p % w == i for i, ps in enumerate(owned) for p in ps)
    assert partitions_for_replica(4, 1, 2) == [1, 3]


@pytest.mark.parametrize("args,flag", [((4, 2, 2), "--replica-index"),
                                       ((4, -1, 2), "--replica-index"),
                                       ((4, 0, 0), "--replica-size"),
                                       ((2, 0, 3), "--replica-size"),
                                       ((0, 0, 1), "kafka.samples_topic")])
def test_static_assignment_rejects_bad_flags_by_name(args, flag):
    with pytest.raises(ConfigError) as info:
        partitions_for_replica(*args)
    assert info.value.field == flag and flag in str(info.value)


def test_topic_names_are_validated():
    assert validate_topic("job.samples") == "job.samples"
    assert validate_topic("...") == "..."  # only "." and ".." are reserved
    for bad in ("", "a b", "x" * 250, ".", "..", "ü", "job.samples\n", None):
        with pytest.raises(ConfigError):
            validate_topic(bad)


def test_consumer_refuses_auto_commit_and_bad_settings():
    with pytest.raises(ConfigError, match="checkpoint"):
        SampleConsumer("h:1", "t", enable_auto_commit=True)
    with pytest.raises(ConfigError, match="auto_offset_reset"):
        SampleConsumer("h:1", "t", auto_offset_reset="none")
    with pytest.raises(ConfigError, match="bootstrap"):
        SampleConsumer("no-port", "t")
    with pytest.raises(ConfigError, match="--replica-index"):
        SampleConsumer("h:1", "t", replica_index=3, replica_size=2)


async def test_compression_and_size_are_checked_before_connecting():
    with pytest.raises(ConfigError, match="compression_type"):
        await create_producer("h:1", compression_type="brotli")
    with pytest.raises(ConfigError, match="max_batch_bytes"):
        await create_producer("h:1", max_message_bytes=10)


async def test_unreachable_broker_is_peer_unavailable_naming_it(unused_tcp_port):
    servers = f"127.0.0.1:{unused_tcp_port}"
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(KafkaUnavailable, match=f"cannot reach Kafka at {servers}") as info:
        await bounded(create_producer(servers, startup_timeout_s=1.0))
    assert isinstance(info.value, PeerUnavailable)
    assert info.value.field == "kafka.bootstrap_servers" and "startup_timeout_ms" in str(
        info.value)
    # It kept trying (with backoff) for the bound, and no longer.
    assert 1.0 <= asyncio.get_running_loop().time() - t0 < 10


# ------------------------------------------------------------------- consumer

async def test_two_replicas_read_their_own_partitions_exactly_once(kafka_broker, kafka_topic):
    topic = kafka_topic(4)
    sent = [(i % 4, f"m{i}".encode()) for i in range(40)]
    await bounded(produce(kafka_broker.bootstrap_servers, topic, sent))
    consumers = [SampleConsumer(kafka_broker.bootstrap_servers, topic, replica_index=i,
                                replica_size=2) for i in range(2)]
    try:
        for c in consumers:
            await bounded(c.start())
        assert [c.partitions for c in consumers] == [[0, 2], [1, 3]]
        got = [await drain(c, 20) for c in consumers]
    finally:
        for c in consumers:
            await c.stop()
    for c, records in zip(consumers, got, strict=True):
        assert {r.partition for r in records} == set(c.partitions)
    values = [r.value for records in got for r in records]
    assert sorted(values) == sorted(v for _, v in sent)  # every message, none twice
    for records in got:  # in order within each partition
        for p in {r.partition for r in records}:
            offsets = [r.offset for r in records if r.partition == p]
            assert offsets == list(range(len(offsets)))


@deviates_on("tansu", TANSU_LIST_OFFSETS)
async def test_start_from_stored_offsets_resumes_exactly(kafka_broker, kafka_topic):
    topic = kafka_topic(2)
    await bounded(produce(kafka_broker.bootstrap_servers, topic,
                          [(i % 2, f"m{i}".encode()) for i in range(20)]))
    consumer = SampleConsumer(kafka_broker.bootstrap_servers, topic)
    try:
        # Offsets as a checkpoint stores them: partition 1 of another replica would be
        # ignored; here this replica owns both.
        await bounded(consumer.start({0: 3, 1: 7}))
        assert await consumer.positions() == {0: 3, 1: 7}
        records = await drain(consumer, 7 + 3)
    finally:
        await consumer.stop()
    assert sorted((r.partition, r.offset) for r in records) == \
        [(0, o) for o in range(3, 10)] + [(1, o) for o in range(7, 10)]


async def test_stored_offsets_that_do_not_fit_the_topic_are_refused(kafka_broker, kafka_topic):
    topic = kafka_topic(2)
    for offsets, match in (({0: 5}, "beyond its end"), ({2: 0}, "partitions")):
        consumer = SampleConsumer(kafka_broker.bootstrap_servers, topic)
        with pytest.raises(BadInput, match=match):
            await bounded(consumer.start(offsets))
        await consumer.stop()


async def fill_past_retention(bootstrap: str, topic: str, partition: int = 0,
                               count: int = 80) -> None:
    """Write ~8 MiB to one partition: the mock keeps ~5 MiB and drops the first ones."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await bounded(producer.start())
    try:
        for _ in range(count):
            await producer.send(topic, b"x" * 100_000, partition=partition)
        await bounded(producer.flush())
    finally:
        await producer.stop()


@pytest.mark.kafka
async def test_stored_offsets_deleted_by_retention_are_refused_by_default():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("retention", 1)
        await fill_past_retention(cluster.bootstrap_servers, "retention")
        consumer = SampleConsumer(cluster.bootstrap_servers, "retention")
        with pytest.raises(KafkaDataLoss, match=r"retention/0: offsets 0\.\.\d+ .* deleted") \
                as info:
            await bounded(consumer.start({0: 0}))
        await consumer.stop()
        (loss,) = info.value.losses
        assert loss.partition == 0 and loss.first == 0 and 0 < loss.resume < 80
        assert "on_data_loss" in str(info.value)


@pytest.mark.kafka
async def test_offsets_lost_to_retention_are_counted_and_skipped_when_accepted():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("retention", 1)
        await fill_past_retention(cluster.bootstrap_servers, "retention")
        consumer = SampleConsumer(cluster.bootstrap_servers, "retention", on_data_loss="skip")
        try:
            await bounded(consumer.start({0: 0}))
            first_kept = (await consumer.positions())[0]
            assert 0 < first_kept < 80
            assert consumer.stats()["offsets_lost"] == first_kept
            assert consumer.lost_messages() == {0: first_kept}
            (record, *_) = await drain(consumer, 80 - first_kept)
            assert record.offset == first_kept
        finally:
            await consumer.stop()


async def test_missing_topic_and_too_many_replicas_are_config_errors(kafka_broker, kafka_topic):
    consumer = SampleConsumer(kafka_broker.bootstrap_servers, "never-created",
                              metadata_timeout_s=0.3)
    with pytest.raises(ConfigError, match="does not exist"):
        await bounded(consumer.start())
    consumer = SampleConsumer(kafka_broker.bootstrap_servers, kafka_topic(2),
                              replica_index=2, replica_size=3)
    with pytest.raises(ConfigError, match="--replica-size 3 exceeds"):
        await bounded(consumer.start())
    consumer = SampleConsumer(kafka_broker.bootstrap_servers, kafka_topic(2),
                              expected_partitions=4)
    with pytest.raises(ConfigError, match="expects 4"):
        await bounded(consumer.start())


@deviates_on("tansu", TANSU_LIST_OFFSETS)
async def test_pause_stops_fetching_and_resume_restarts_it(kafka_broker, kafka_topic):
    topic = kafka_topic(2)
    bootstrap = kafka_broker.bootstrap_servers
    consumer = SampleConsumer(bootstrap, topic)
    try:
        await bounded(consumer.start())
        consumer.pause([0])
        assert consumer.paused() == {0}
        await bounded(produce(bootstrap, topic, [(p, b"x") for p in (0, 1) for _ in range(5)]))
        first = await drain(consumer, 5, seconds=5)
        assert [r.partition for r in first] == [1] * 5  # nothing from the paused one
        assert (await consumer.lag())[0] == 5
        consumer.resume()
        assert consumer.paused() == set()
        second = await drain(consumer, 5)
        assert [r.partition for r in second] == [0] * 5
        with pytest.raises(Misuse, match="not assigned"):
            consumer.pause([7])
    finally:
        await consumer.stop()


@deviates_on("tansu", TANSU_LIST_OFFSETS)
async def test_lag_comes_from_end_offsets(kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    await bounded(produce(kafka_broker.bootstrap_servers, topic, [(0, b"v")] * 10))
    consumer = SampleConsumer(kafka_broker.bootstrap_servers, topic)
    try:
        await bounded(consumer.start())
        assert await consumer.end_offsets() == {0: 10}
        assert await consumer.lag() == {0: 10}
        got = []
        while len(got) < 4:
            for batch in (await bounded(consumer.getmany(timeout_ms=200,
                                                         max_records=4 - len(got)))).values():
                got += batch
        assert await consumer.lag() == {0: 6}
        assert consumer.stats()["records"] == 4
    finally:
        await consumer.stop()


async def test_commit_records_offsets_only_when_asked(kafka_broker, kafka_topic):
    topic = kafka_topic(2)
    bootstrap = kafka_broker.bootstrap_servers
    await bounded(produce(bootstrap, topic, [(p, b"x") for p in (0, 1) for _ in range(6)]))
    group = f"{topic}.workers"
    consumer = SampleConsumer(bootstrap, topic, group_id=group)
    try:
        await bounded(consumer.start())
        await drain(consumer, 12)
        assert await consumer.committed() == {0: None, 1: None}  # reading commits nothing
        assert await bounded(consumer.commit({0: 4, 1: 6})) is True
        with pytest.raises(Misuse):
            await consumer.commit({5: 1})
    finally:
        await consumer.stop()
    again = SampleConsumer(bootstrap, topic, group_id=group)
    try:
        await bounded(again.start())
        assert await again.committed() == {0: 4, 1: 6}
        # The checkpoint, not the group, decides where reading starts.
        assert await again.positions() == {0: 0, 1: 0}
    finally:
        await again.stop()
    no_group = SampleConsumer(bootstrap, topic)
    try:
        await bounded(no_group.start())
        assert await no_group.commit({0: 1}) is False
        assert no_group.stats()["commits_skipped"] == 1
    finally:
        await no_group.stop()


async def test_consumer_must_be_started():
    consumer = SampleConsumer("127.0.0.1:1", "t")
    with pytest.raises(Misuse, match="not started"):
        await consumer.getmany()


# ------------------------------------------------------------------- producer

class _Batch:
    """Stands in for PersiaBatch where its real encoder is not the subject."""

    def __init__(self, payload: bytes, batch_id: int):
        self.payload, self.batch_id = payload, batch_id

    def to_bytes(self) -> bytes:
        return self.payload


async def test_batches_arrive_keyed_by_batch_id(kafka_broker, kafka_topic):
    topic = kafka_topic(2)
    bootstrap = kafka_broker.bootstrap_servers
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        await bounded(producer.send(_Batch(b"one", 11)))
        await bounded(producer.send(b"two", key="b-12"))
        await bounded(producer.send(b"three"))
        await bounded(producer.flush())
        assert producer.stats()["acked"] == 3
    consumer = SampleConsumer(bootstrap, topic)
    try:
        await bounded(consumer.start())
        got = {r.value: r.key for r in await drain(consumer, 3)}
    finally:
        await consumer.stop()
    assert got == {b"one": b"11", b"two": b"b-12", b"three": None}


async def test_persia_batch_round_trips(kafka_broker, kafka_topic):
    data = pytest.importorskip("stream_persia.embedding.data")
    np = pytest.importorskip("numpy")
    batch = data.PersiaBatch(
        [data.IDTypeFeature("user", [np.array([1, 2], np.uint64), np.array([], np.uint64)])],
        labels=[data.Label(np.array([[1.0], [0.0]], np.float32))], batch_id=42)
    topic = kafka_topic(1)
    async with BatchProducer(topic, bootstrap_servers=kafka_broker.bootstrap_servers) as prod:
        await bounded(prod.send_and_wait(batch))
    consumer = SampleConsumer(kafka_broker.bootstrap_servers, topic)
    try:
        await bounded(consumer.start())
        (record,) = await drain(consumer, 1)
    finally:
        await consumer.stop()
    assert record.key == b"42"
    decoded = data.PersiaBatch.from_bytes(record.value)
    assert decoded.batch_id == 42 and decoded.batch_size == 2


async def test_in_flight_sends_never_exceed_the_limit(kafka_broker, kafka_topic):
    topic = kafka_topic(2)
    async with BatchProducer(topic, bootstrap_servers=kafka_broker.bootstrap_servers,
                             max_in_flight=3) as producer:
        seen: list[int] = []

        async def send(i: int) -> None:
            await producer.send(f"m{i}".encode(), key=i)
            seen.append(producer.in_flight)

        await bounded(asyncio.gather(*(send(i) for i in range(60))))
        await bounded(producer.flush())
        stats = producer.stats()
    assert max(seen) <= 3 and producer.peak_in_flight == 3
    assert stats["waits"] > 0  # the bound was reached, so senders did wait
    assert stats["acked"] == 60 and stats["in_flight"] == 0


@pytest.mark.kafka
async def test_full_buffer_times_out_with_backpressure_then_recovers():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("slow", 1)
        async with BatchProducer("slow", bootstrap_servers=cluster.bootstrap_servers,
                                 max_in_flight=1) as producer:
            await bounded(producer.send_and_wait(b"warm-up"))
            cluster.set_rtt(2000)
            await producer.send(b"first")
            with pytest.raises(Backpressure, match="unacknowledged"):
                await producer.send(b"second", timeout_s=0.2)
            cluster.set_rtt(0)
            await bounded(producer.flush())
            assert producer.stats()["timeouts"] == 1


@pytest.mark.kafka
async def test_flush_times_out_while_broker_is_down_and_nothing_is_lost():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("down", 1)
        producer = BatchProducer("down", bootstrap_servers=cluster.bootstrap_servers)
        await bounded(producer.start())
        try:
            await bounded(producer.send_and_wait(b"before"))
            cluster.broker_down()
            await producer.send(b"during")
            with pytest.raises(RemoteTimeout):
                await producer.flush(timeout_s=0.5)
            cluster.broker_up()
            await bounded(producer.flush())
        finally:
            await bounded(producer.close())
        consumer = SampleConsumer(cluster.bootstrap_servers, "down")
        try:
            await bounded(consumer.start())
            assert [r.value for r in await drain(consumer, 2)] == [b"before", b"during"]
        finally:
            await consumer.stop()


async def test_oversized_or_unkeyable_batches_are_bad_input(kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    async with BatchProducer(topic, bootstrap_servers=kafka_broker.bootstrap_servers,
                             max_message_bytes=1024) as producer:
        with pytest.raises(BadInput, match="exceeds max_message_bytes"):
            await producer.send(b"x" * 2000)
        with pytest.raises(BadInput, match="key"):
            await producer.send(b"x", key=1.5)
        with pytest.raises(BadInput, match="cannot send"):
            await producer.send(["not", "a", "batch"])
        assert producer.in_flight == 0
    with pytest.raises(Misuse, match="closed"):
        await producer.send(b"late")


# ------------------------------------------------------------------ dead letters

async def test_dead_letters_carry_reason_source_and_original_bytes(kafka_broker, kafka_topic):
    bootstrap = kafka_broker.bootstrap_servers
    dlq = kafka_topic(1, prefix="dlq")
    raw = b"\x00not msgpack\xff"
    async with DeadLetterWriter(dlq, bootstrap_servers=bootstrap) as writer:
        assert await bounded(writer.write(raw, "WireError: bad header", ("job.samples", 3, 17),
                                          key=b"b-9", kind="wire"))
        assert await bounded(writer.write(b"", "empty", ("job.samples", 0, 1)))
        assert writer.stats() == {"written": 2, "failed": 0}
    consumer = SampleConsumer(bootstrap, dlq)
    try:
        await bounded(consumer.start())
        records = await drain(consumer, 2)
    finally:
        await consumer.stop()
    first, second = (parse_dead_letter(r) for r in records)
    assert first.value == raw and first.key == b"b-9"
    assert (first.reason, first.kind) == ("WireError: bad header", "wire")
    assert (first.source_topic, first.source_partition, first.source_offset) == \
        ("job.samples", 3, 17)
    assert (second.reason, second.kind, second.source_offset) == ("empty", None, 1)
    assert dict(records[0].headers)["persia-source-partition"] == b"3"


@pytest.mark.kafka
async def test_dead_letter_failure_is_counted_not_raised():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("dlq", 1)
        writer = DeadLetterWriter("dlq", bootstrap_servers=cluster.bootstrap_servers,
                                  send_timeout_s=0.5)
        await bounded(writer.start())
        try:
            cluster.broker_down()
            assert await bounded(writer.write(b"x", "bad", ("s", 0, 0))) is False
            assert writer.stats() == {"written": 0, "failed": 1}
            cluster.broker_up()
        finally:
            await bounded(writer.close())


def test_records_without_dead_letter_headers_are_rejected():
    from aiokafka import ConsumerRecord

    record = ConsumerRecord("t", 0, 5, 0, 0, None, b"v", None, 0, 1, ())
    with pytest.raises(BadInput, match="not a stream-persia dead letter"):
        parse_dead_letter(record)


# ---------------------------------------------------------------------- config

def test_from_config_uses_the_kafka_section(monkeypatch):
    config = pytest.importorskip("stream_persia.config")
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    kafka = config.KafkaConfig(bootstrap_servers="k1:9092", job_name="ctr",
                               fetch_max_wait_ms=20, max_batch_bytes=2_000_000)
    consumer = SampleConsumer.from_config(kafka, replica_index=1, replica_size=2)
    assert consumer.topic == "ctr.samples" and consumer.group_id == "ctr.embedding-workers"
    assert consumer._kwargs["fetch_max_wait_ms"] == 20
    producer = BatchProducer.from_config(kafka, bootstrap_servers="k2:9092")
    assert producer.topic == "ctr.samples" and producer.max_message_bytes == 2_000_000
    assert DeadLetterWriter.from_config(kafka).topic == "ctr.samples.dlq"
    with pytest.raises(ConfigError, match="bootstrap"):
        BatchProducer.from_config(config.KafkaConfig())
