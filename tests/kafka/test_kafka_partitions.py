"""The samples topic changing under a running job, and records a hostile producer writes,
against the real mock broker.

- Partitions added while the job runs (``kafka-topics --alter --partitions``): each new
  partition is read, from offset 0, by the one worker that owns it (``p mod W``), counted,
  and from then on in the worker's checkpoint frontier. The mock answers no
  CreatePartitions, so a test grows a topic nothing was written to yet by deleting it and
  creating it again with more partitions: to consumers at offset 0 everywhere that is the
  same metadata change.
- The topic deleted and created again (a broker back without its data) and refilled
  past a partition's position while it was not read: the position is in range again,
  but the record below it is another; the partition stops on it (or counts it, with
  ``on_data_loss="skip"``), rather than read on and never train the new records below.
  The same while the consumer reads on with no pause (its periodic check reads a record it
  read before again: ``recheck_every_s``), when a broker killed while it was read comes
  back empty behind its address and refilled past the position (it checks once the
  brokers answer again), and when the re-created partition has another leader (metadata
  says so). The periodic check anchors on no record of before a restore (``seek``) even
  when it falls due at the first fetch after it or the partition read nothing since,
  gives up within the fingerprint timeout on slow brokers, and takes a leader election
  under way (leader -1) for no leader change. These start mock clusters of their own (deleted and created through the
  mock's control commands, a broker killed and replaced, a leader moved), so the Tansu
  pass leaves them out like the other tests here. Not covered: metadata that lacks the
  topic (the mock creates a topic a consumer fetches or asks for by name, with 4
  partitions, so a deleted topic never shows as missing to a reading consumer).
- Records of an aborted transaction are never read (``read_committed``; neither test
  broker filters them: the mock hands aborted records to read_committed consumers and its
  transaction markers fail aiokafka's CRC check, Tansu refuses InitProducerId, so only the
  setting is checked, with reads through it on the real broker).
- Workers started with different ``--replica-size`` leave a partition nobody reads: the
  checkpoint cut is refused naming it (the workers' ``frontier`` replies carry the
  topic's partition count).
- A batch whose event time is far ahead of the worker's clock (milliseconds written as
  seconds) is dead-lettered and counted, never trained (a null record too): watermarks only go up, so it
  would have claimed every later checkpoint and answer trained through that time.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from test_kafka_loss import Worker, bounded, ingest_factory, serve_all

from stream_persia.checkpoint import stream_cut
from stream_persia.config import KafkaConfig
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD
from stream_persia.errors import Misuse
from stream_persia.kafka import DeadLetterWriter, SampleConsumer, parse_dead_letter
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.worker.ingest import KafkaIngest
from stream_persia.worker.service import EmbeddingWorker

pytestmark = [pytest.mark.timeout(90), pytest.mark.kafka]

REFRESH_MS = 300   # the consumers' metadata refresh (30 s by default)


async def produce_one_each(bootstrap: str, topic: str, values: dict[int, bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await bounded(producer.start())
    try:
        for partition, value in values.items():
            await producer.send_and_wait(topic, value, partition=partition)
    finally:
        await producer.stop()


async def read_until(consumers: list[SampleConsumer], n: int, seconds: float = 10.0
                     ) -> list[dict[int, list[int]]]:
    got: list[dict[int, list[int]]] = [{} for _ in consumers]
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        for consumer, mine in zip(consumers, got, strict=True):
            for p, recs in (await consumer.getmany(timeout_ms=50)).items():
                mine.setdefault(p, []).extend(r.offset for r in recs)
        if sum(len(offsets) for mine in got for offsets in mine.values()) >= n:
            break
    return got


def grow(cluster: MockKafkaCluster, topic: str, partitions: int) -> None:
    cluster.delete_topic(topic)
    cluster.create_topic(topic, partitions)


async def test_partitions_added_while_reading_are_read_from_offset_0_by_their_owner():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("grow", 2)
        consumers = [SampleConsumer(cluster.bootstrap_servers, "grow", replica_index=i,
                                    replica_size=2, metadata_max_age_ms=REFRESH_MS)
                     for i in (0, 1)]
        try:
            for c in consumers:
                await bounded(c.start())
            assert await read_until(consumers, 1, seconds=0.5) == [{}, {}]
            grow(cluster, "grow", 5)
            await produce_one_each(cluster.bootstrap_servers, "grow",
                                   {p: b"v%d" % p for p in range(5)})
            got = await read_until(consumers, 5)
            # Every partition read once, by its owner, from its first record.
            assert got == [{0: [0], 2: [0], 4: [0]}, {1: [0], 3: [0]}]
            assert [c.partitions for c in consumers] == [[0, 2, 4], [1, 3]]
            assert [c.num_partitions for c in consumers] == [5, 5]
            assert [c.stats()["partitions_added"] for c in consumers] == [3, 3]
            assert [c.stats()["partitions"] for c in consumers] == [3, 2]
            assert [await c.lag() for c in consumers] == [{0: 0, 2: 0, 4: 0}, {1: 0, 3: 0}]
        finally:
            for c in consumers:
                await c.stop()


async def test_a_partition_added_while_the_others_are_held_is_read():
    """A held partition (a worker refusing a replay) is paused for good; a partition added
    meanwhile is not held with it: it is read (it was paused with the held one and never
    read, its samples untrained while the frontier tracked it at offset 0)."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("held", 1)
        consumer = SampleConsumer(cluster.bootstrap_servers, "held",
                                  metadata_max_age_ms=REFRESH_MS)
        try:
            await bounded(consumer.start())
            consumer.hold([0])
            grow(cluster, "held", 2)
            await produce_one_each(cluster.bootstrap_servers, "held", {0: b"a", 1: b"b"})
            assert await read_until([consumer], 1) == [{1: [0]}]
            assert consumer.partitions == [0, 1]
        finally:
            await consumer.stop()


async def test_a_partition_added_under_a_worker_is_trained_and_in_its_checkpoint_frontier():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("job", 1)
        cluster.create_topic("job.dlq", 1)
        cfg = KafkaConfig(bootstrap_servers=cluster.bootstrap_servers, samples_topic="job")
        async with Worker() as worker:
            make = ingest_factory(worker, cfg)

            def ingest(start_offsets):
                made = make(start_offsets)
                made.consumer._kwargs["metadata_max_age_ms"] = REFRESH_MS
                return made

            await bounded(worker.start_kafka_ingest(ingest))
            assert worker.frontier.offsets() == {0: 0}
            grow(cluster, "job", 2)
            # Tracked before anything is read from it: a cut now records it at 0.
            deadline = time.monotonic() + 10
            while 1 not in worker.frontier.offsets() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert worker.frontier.offsets() == {0: 0, 1: 0}
            assert (await worker._frontier({}))["topic_partitions"] == 2
            await produce_one_each(cluster.bootstrap_servers, "job",
                                   {1: make_batch(1).to_bytes(), 0: make_batch(0).to_bytes()})
            assert len(await serve_all(worker, 2)) == 2
            status = await worker._status({})
            assert status["frontier"] == {"0": 1, "1": 1}       # the cut has partition 1
            assert status["kafka"]["partitions"] == [0, 1]
            metrics = worker.metrics.render().decode()
            assert "persia_embedding_worker_kafka_consumer_partitions_added_total 1.0" in \
                metrics


async def test_batches_from_the_far_future_and_null_records_are_dead_lettered_not_trained():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("job", 1)
        cluster.create_topic("job.dlq", 1)
        cfg = KafkaConfig(bootstrap_servers=cluster.bootstrap_servers, samples_topic="job")
        now = time.time()
        producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap_servers)
        await bounded(producer.start())
        try:
            for i, t in enumerate((now - 60, now * 1000, now - 30)):
                await producer.send_and_wait("job", make_batch(i).stamped(t).to_bytes(),
                                             partition=0)
            # A null value with a key and headers nobody expects.
            await producer.send_and_wait("job", None, key=b"k", partition=0,
                                         headers=[("h", b"x")])
        finally:
            await producer.stop()
        async with Worker() as worker:
            await bounded(worker.start_kafka_ingest(ingest_factory(worker, cfg)))
            metas = await serve_all(worker, 2)
            assert metas == [b"batch-0", b"batch-2"]
            deadline = time.monotonic() + 10
            while worker.frontier.offsets() != {0: 4} and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert worker.frontier.offsets() == {0: 4}           # settled, never replayed
            assert worker.watermarks()["ingested"] == pytest.approx(now - 30)
            metrics = worker.metrics.render().decode()
            assert 'batches_rejected_total{reason="BadInput"} 2.0' in metrics
        dlq = SampleConsumer(cluster.bootstrap_servers, "job.dlq")
        records = []
        try:
            await bounded(dlq.start())
            deadline = time.monotonic() + 10
            while len(records) < 2 and time.monotonic() < deadline:
                records += (await dlq.getmany(timeout_ms=100)).get(0, [])
        finally:
            await dlq.stop()
        letter, null = map(parse_dead_letter, records)
        assert (letter.source_partition, letter.source_offset) == (0, 1)
        assert "batch.event_time" in letter.reason and "days ahead" in letter.reason
        assert (null.source_offset, null.key, null.value) == (3, b"k", b"")
        assert "no value" in null.reason


@pytest.mark.parametrize("mode", ["fail", "skip"])
async def test_a_topic_created_again_and_refilled_past_the_position_is_a_loss(mode):
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 1)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"old0"})
        await produce_one_each(servers, "s", {0: b"old1"})
        consumer = SampleConsumer(servers, "s", on_data_loss=mode, recheck_after_pause_s=0.5)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 2) == [{0: [0, 1]}]
            consumer.pause()
            grow(cluster, "s", 1)                        # empty again, then refilled
            for i in range(4):
                await produce_one_each(servers, "s", {0: b"new%d" % i})
            await asyncio.sleep(0.5)
            consumer.resume()
            got = (await read_until([consumer], 2, seconds=3))[0]
            stats = consumer.stats()
            if mode == "fail":
                assert got == {}                             # nothing of the new topic
                (loss,) = consumer.stopped().values()
                assert (loss.cause, loss.first) == ("recreated", 2)
                assert (await consumer.positions())[0] == 2
                assert stats["partitions_stopped"] == 1
            else:
                assert got == {0: [2, 3]}
                assert stats["fingerprint_mismatches"] == 1
            assert stats["data_loss_events"] == 1
        finally:
            await consumer.stop()


async def test_the_consumer_and_its_side_clients_read_committed_records_only():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 1)
        consumer = SampleConsumer(cluster.bootstrap_servers, "s")
        assert consumer._kwargs["isolation_level"] == "read_committed"
        assert consumer.side_client_kwargs()["isolation_level"] == "read_committed"
        try:
            await bounded(consumer.start())
            await produce_one_each(cluster.bootstrap_servers, "s", {0: b"a"})
            assert await read_until([consumer], 1) == [{0: [0]}]
            assert await consumer.lag() == {0: 0}   # the last stable offset is the end
        finally:
            await consumer.stop()


async def test_workers_of_different_replica_sizes_leave_a_partition_and_the_cut_is_refused():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("job", 4)
        cluster.create_topic("job.dlq", 1)
        cfg = KafkaConfig(bootstrap_servers=cluster.bootstrap_servers, samples_topic="job")
        server = EmbeddingServer(10_000, SGD(lr=0.1), EmbeddingConfig((-0.5, 0.5)))
        await server.start()
        workers = []
        try:
            # Worker 1 restarted with --replica-size 3 while worker 0 kept 2.
            for index, size in ((0, 2), (1, 3)):
                worker = EmbeddingWorker(SCHEMA, [server.address], replica_index=index,
                                         replica_size=size)
                await worker.start()
                workers.append(worker)

                def make(start_offsets, worker=worker, index=index, size=size):
                    return KafkaIngest(worker, SampleConsumer.from_config(
                        cfg, replica_index=index, replica_size=size),
                        DeadLetterWriter.from_config(cfg), start_offsets=start_offsets)
                await bounded(worker.start_kafka_ingest(make))
            fronts = [await w._frontier({}) for w in workers]
            assert [sorted(f["offsets"]) for f in fronts] == [["0", "2"], ["1"]]
            with pytest.raises(Misuse, match=r"partitions \[3\] of 'job'"):
                stream_cut(fronts, ["job", "job"])
        finally:
            for w in workers:
                await w.stop()
            await server.stop()


async def keep_reading(consumer: SampleConsumer, seconds: float) -> dict[int, list[int]]:
    return (await read_until([consumer], 10**6, seconds=seconds))[0]


def assert_recreated_loss(mode: str, consumer: SampleConsumer, got: dict[int, list[int]],
                          new_records: list[int]) -> None:
    stats = consumer.stats()
    if mode == "fail":
        assert got == {}                             # nothing of the new topic
        (loss,) = consumer.stopped().values()
        assert (loss.cause, loss.first) == ("recreated", 2)
        assert stats["partitions_stopped"] == 1
    else:
        assert got == {0: new_records}
        assert stats["fingerprint_mismatches"] == 1
    assert stats["data_loss_events"] == 1


@pytest.mark.parametrize("mode", ["fail", "skip"])
async def test_a_topic_created_again_under_a_consumer_reading_on_is_a_loss(mode):
    """No pause, no out-of-range: the consumer polls on while the topic is deleted,
    created again and refilled past its position; its periodic check reads the record it
    read at offset 1 again before it hands over the new topic's records."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 1)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"old0"})
        await produce_one_each(servers, "s", {0: b"old1"})
        consumer = SampleConsumer(servers, "s", on_data_loss=mode, recheck_every_s=0.5,
                                  fetch_max_wait_ms=2000)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 2) == [{0: [0, 1]}]
            reader = asyncio.create_task(keep_reading(consumer, 4.0))
            await asyncio.sleep(0.6)                     # a check is due from here on
            grow(cluster, "s", 1)
            await produce_one_each(servers, "s", {0: b"new0"})
            await produce_one_each(servers, "s", {0: b"new1"})
            await produce_one_each(servers, "s", {0: b"new2"})
            got = await reader
            assert_recreated_loss(mode, consumer, got, [2])
        finally:
            await consumer.stop()


@pytest.mark.parametrize("mode", ["fail", "skip"])
async def test_a_broker_back_empty_and_refilled_after_an_outage_is_a_loss(mode):
    """The broker dies while the consumer reads; another one, its topic refilled past the
    consumer's position, comes up behind the same address. The position is in range (no
    out-of-range answer) and no pause was long: the consumer checks because the brokers
    answer again after its probes had found none."""
    from stream_persia.testing.proxy import LateProxy

    proxy = LateProxy("127.0.0.1:1")
    proxy.start()
    old = MockKafkaCluster().start()
    new = None
    consumer = SampleConsumer(proxy.address, "s", on_data_loss=mode, broker_timeout_s=30)
    try:
        old.advertise(proxy.address)
        old.create_topic("s", 1)
        proxy.retarget(old.bootstrap_servers)
        await produce_one_each(proxy.address, "s", {0: b"old0"})
        await produce_one_each(proxy.address, "s", {0: b"old1"})
        await bounded(consumer.start())
        assert await read_until([consumer], 2) == [{0: [0, 1]}]
        old.kill()
        assert await keep_reading(consumer, 2.5) == {}
        assert consumer.stats()["broker_down_seconds"] > 0
        new = MockKafkaCluster().start()
        new.create_topic("s", 1)
        for i in range(4):                              # before clients are sent to it
            await produce_one_each(new.bootstrap_servers, "s", {0: b"new%d" % i})
        new.advertise(proxy.address)
        proxy.retarget(new.bootstrap_servers)
        got = await keep_reading(consumer, 4.0)
        assert_recreated_loss(mode, consumer, got, [2, 3])
    finally:
        await consumer.stop()
        old.kill()
        if new is not None:
            new.stop()
        proxy.close()



async def test_a_leader_change_makes_a_reading_consumer_check_the_record_below():
    """The topic deleted and created again on another leader and refilled past the
    position while the partition was paused for less than ``recheck_after_pause_s``
    (backpressure): the metadata naming the new leader makes the consumer compare the
    record below its position before it hands over the new topic's records (its periodic
    check is off here)."""
    with MockKafkaCluster(brokers=2) as cluster:
        cluster.create_topic("s", 1)
        cluster.set_leader("s", 0, 1)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"old0"})
        await produce_one_each(servers, "s", {0: b"old1"})
        consumer = SampleConsumer(servers, "s", recheck_every_s=3600,
                                  metadata_max_age_ms=REFRESH_MS)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 2) == [{0: [0, 1]}]
            consumer.pause()
            grow(cluster, "s", 1)
            cluster.set_leader("s", 0, 2)
            for i in range(4):
                await produce_one_each(servers, "s", {0: b"new%d" % i})
            assert await keep_reading(consumer, 1.0) == {}   # a metadata refresh or more
            consumer.resume()
            got = await keep_reading(consumer, 3.0)
            assert_recreated_loss("fail", consumer, got, [])
        finally:
            await consumer.stop()


@pytest.mark.parametrize("restore_s", [0.0, 0.4])
async def test_a_consumer_moved_onto_a_topic_created_again_checks_from_there(restore_s):
    """Moved on purpose (a restore, ``seek``) onto the re-created topic's start, the
    consumer's periodic check compares records of the new topic only: no loss. Also when
    the check falls due at the first fetch after the move (a restore that took longer than
    ``recheck_every_s``): the last record read before the move is no anchor."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 1)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"old0"})
        await produce_one_each(servers, "s", {0: b"old1"})
        consumer = SampleConsumer(servers, "s", recheck_every_s=0.3)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 2) == [{0: [0, 1]}]
            grow(cluster, "s", 1)
            for i in range(3):
                await produce_one_each(servers, "s", {0: b"new%d" % i})
            await bounded(consumer.seek({0: 0}))
            await asyncio.sleep(restore_s)
            (first,) = await read_until([consumer], 1)
            await asyncio.sleep(0.4)                       # a check is due
            await produce_one_each(servers, "s", {0: b"new3"})
            rest = await keep_reading(consumer, 1.5)
            assert first.get(0, []) + rest.get(0, []) == [0, 1, 2, 3]
            assert consumer.stats()["data_loss_events"] == 0
            assert consumer.stopped() == {}
        finally:
            await consumer.stop()


async def test_a_moved_partition_idle_when_the_check_falls_due_is_not_taken_as_re_created():
    """Both partitions moved onto the re-created topic's start; only partition 1 has
    records when the periodic check falls due, so partition 0 has read nothing since the
    move: it gets no anchor from the record it read before (of the old topic), and
    neither partition is stopped when its records come."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 2)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"old0", 1: b"o0"})
        await produce_one_each(servers, "s", {0: b"old1", 1: b"o1"})
        consumer = SampleConsumer(servers, "s", recheck_every_s=0.3)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 4) == [{0: [0, 1], 1: [0, 1]}]
            grow(cluster, "s", 2)
            await produce_one_each(servers, "s", {1: b"n0"})
            await bounded(consumer.seek({0: 0, 1: 0}))
            await asyncio.sleep(0.4)                       # a check is due
            first = await keep_reading(consumer, 0.8)      # partition 1 only
            for i in range(3):
                await produce_one_each(servers, "s", {0: b"new%d" % i, 1: b"n%d" % (i + 1)})
            rest = await keep_reading(consumer, 1.5)
            assert consumer.stopped() == {}
            assert consumer.stats()["data_loss_events"] == 0
            assert first.get(0, []) + rest.get(0, []) == [0, 1, 2]
            assert first.get(1, []) + rest.get(1, []) == [0, 1, 2, 3]
        finally:
            await consumer.stop()


async def test_a_re_created_partition_idle_since_its_last_check_names_no_records_read_since():
    """Partition 0 read nothing between two periodic checks (partition 1's records make
    them run): when its anchor is found replaced, nothing of it was handed over since,
    and the loss says no range of offsets read since (it said "offsets 2..1")."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 2)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"old0", 1: b"o0"})
        await produce_one_each(servers, "s", {0: b"old1", 1: b"o1"})
        consumer = SampleConsumer(servers, "s", recheck_every_s=0.3)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 4) == [{0: [0, 1], 1: [0, 1]}]
            await asyncio.sleep(0.4)                       # a check is due
            await produce_one_each(servers, "s", {1: b"o2"})
            assert await keep_reading(consumer, 0.5) == {1: [2]}   # anchors: 0/1, 1/1
            # Paused briefly (no recheck on resume) so that no fetch meets the empty new
            # topic (out of range, then in range: a check of its own): the periodic one
            # finds the re-creation.
            consumer.pause()
            grow(cluster, "s", 2)
            for i in range(4):
                await produce_one_each(servers, "s", {0: b"new%d" % i, 1: b"n%d" % i})
            await asyncio.sleep(0.4)                       # a check is due
            consumer.resume()
            assert await keep_reading(consumer, 1.5) == {}
            loss = consumer.stopped()[0]
            assert (loss.cause, loss.first, loss.checked) == ("recreated", 2, 1)
            assert "handed over since" not in loss.describe(), loss.describe()
        finally:
            await consumer.stop()


class _Metadata:
    """aiokafka's ClusterMetadata as the metadata listener reads it: one leader per
    partition, -1 while an election is under way."""

    def __init__(self, leader: int):
        self.leader = leader

    def partitions_for_topic(self, topic):
        return {0}

    def leader_for_partition(self, tp):
        return self.leader


@pytest.mark.parametrize("leaders, moved", [([1, -1, 1], False), ([1, -1, 2], True),
                                            ([1, 2], True)])
def test_a_leader_election_under_way_is_no_leader_change(leaders, moved):
    """aiokafka names leader -1 while a partition elects one: 1 -> -1 -> 1 moved nothing,
    1 -> -1 -> 2 moved once (it flagged both steps)."""
    consumer = SampleConsumer("127.0.0.1:1", "s")
    consumer._tps = {0: TopicPartition("s", 0)}
    consumer._last[0] = object()                  # the partition has been read
    flagged = []
    for leader in leaders:
        consumer._on_metadata(_Metadata(leader))
        flagged.append(0 in consumer._recheck)
        consumer._recheck.clear()
    assert flagged.count(True) == int(moved)


async def test_a_periodic_check_the_brokers_answer_slowly_gives_up_within_the_fingerprint_timeout():
    """Brokers that answer after 10 s (well within broker_timeout_s, 60 s): the periodic
    check waits for the log starts no longer than the fingerprint timeout (5 s), then
    leaves the check to the next round and hands the records over. It waited for the log
    start and end offsets, up to 60 s each, handing nothing over meanwhile."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("s", 1)
        servers = cluster.bootstrap_servers
        await produce_one_each(servers, "s", {0: b"r0"})
        consumer = SampleConsumer(servers, "s", recheck_every_s=0.3, broker_timeout_s=60)
        try:
            await bounded(consumer.start())
            assert await read_until([consumer], 1) == [{0: [0]}]
            await produce_one_each(servers, "s", {0: b"r1"})
            await asyncio.sleep(0.4)                       # a check is due
            cluster.set_rtt(10_000)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 40
            took = None
            while took is None and loop.time() < deadline:
                began = loop.time()
                if await consumer.getmany(timeout_ms=100):
                    took = loop.time() - began
            cluster.set_rtt(0)
            assert took is not None and took < 12, took  # 5 s, then handed over
            assert consumer.stopped() == {}
        finally:
            await consumer.stop()
