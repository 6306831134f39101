"""DataCtx against real peers: the Kafka test broker, and embedding workers on loopback.

Kafka mode: batches read back with a plain aiokafka consumer equal what was sent (keys are
batch ids), leaving the ``with`` block flushes, at most ``max_inflight`` sends are
unacknowledged, delivery failures surface. Broker-less mode: batches reach in-process
embedding workers round-robin, in order with one worker, with backpressure from a full
ready buffer and the worker's refusals raised here. Plus configuration errors by name.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from stream_persia.ctx import DataCtx
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.errors import (
    Backpressure,
    BadInput,
    ConfigError,
    Misuse,
    PeerUnavailable,
    RemoteError,
)
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.workers import WorkersOnLoop

pytestmark = pytest.mark.timeout(60)

ENV = ("KAFKA_BOOTSTRAP_SERVERS", "PERSIA_EMBEDDING_WORKERS", "PERSIA_GLOBAL_CONFIG",
       "PERSIA_EMBEDDING_CONFIG", "REPLICA_INDEX")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def batch(i: int, batch_id: int | None = None, **kw) -> PersiaBatch:
    b = make_batch(i, **kw)
    return PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                       batch_id=batch_id, requires_grad=b.requires_grad, meta=b.meta)


def assert_same(got: PersiaBatch, sent: PersiaBatch) -> None:
    assert (got.batch_id, got.meta, got.batch_size) == (sent.batch_id, sent.meta,
                                                        sent.batch_size)
    for g, s in zip(got.id_type_features, sent.id_type_features, strict=True):
        assert g.name == s.name
        np.testing.assert_array_equal(g.values, s.values)
        np.testing.assert_array_equal(g.offsets, s.offsets)
    for g, s in zip([*got.non_id_type_features, *got.labels],
                    [*sent.non_id_type_features, *sent.labels], strict=True):
        assert g.name == s.name
        np.testing.assert_array_equal(g.data, s.data)


def read_back(bootstrap: str, topic: str, count: int, seconds: float = 15.0) -> list:
    """Every record of ``topic`` (all partitions) once ``count`` arrived, plus 300 ms."""

    async def run() -> list:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                    fetch_max_wait_ms=50)
        await consumer.start()
        try:
            parts = None
            while not parts:
                parts = consumer.partitions_for_topic(topic)
                if not parts:
                    await consumer._client.force_metadata_update()
            consumer.assign([TopicPartition(topic, p) for p in parts])
            await consumer.seek_to_beginning()
            records: list = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds
            while len(records) < count and loop.time() < deadline:
                for got in (await consumer.getmany(timeout_ms=100)).values():
                    records += got
            for got in (await consumer.getmany(timeout_ms=300)).values():
                records += got
            return records
        finally:
            await consumer.stop()

    return asyncio.run(asyncio.wait_for(run(), seconds + 10))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ configuration

def test_no_destination_looks_for_the_workers_on_their_well_known_local_ports(monkeypatch):
    """Zero-config (issue 23): nothing given, ``start`` waits for embedding worker 0 on its
    well-known port (``PERSIA_BASE_PORT`` + 100), then names it and the variables."""
    base = free_port()   # a port no one listens on now: its +100 almost surely free too
    monkeypatch.setenv("PERSIA_BASE_PORT", str(min(base, 65000)))
    ctx = DataCtx(startup_timeout_ms=300)
    assert ctx.mode == "direct"
    with pytest.raises(PeerUnavailable) as err:
        ctx.start()
    assert f"127.0.0.1:{min(base, 65000) + 100}" in str(err.value)
    assert "PERSIA_EMBEDDING_WORKERS" in str(err.value)
    monkeypatch.setenv("PERSIA_BASE_PORT", "80")
    with pytest.raises(ConfigError) as cerr:
        DataCtx()
    assert cerr.value.field == "PERSIA_BASE_PORT"


def test_destination_precedence_and_bad_arguments(monkeypatch):
    monkeypatch.setenv("PERSIA_EMBEDDING_WORKERS", "127.0.0.1:1")
    assert DataCtx().mode == "direct"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    assert DataCtx().mode == "kafka"                      # env Kafka beats env workers
    ctx = DataCtx(embedding_workers=["127.0.0.1:2"])      # an argument beats both
    assert (ctx.mode, ctx.workers) == ("direct", ["127.0.0.1:2"])
    assert DataCtx(threadpool_worker_size=4, device_id=0).mode == "kafka"  # PERSIA's kwargs
    with pytest.raises(ConfigError, match="both"):
        DataCtx(kafka_bootstrap_servers="h:1", embedding_workers=["h:2"])
    with pytest.raises(ConfigError) as err:
        DataCtx(embedding_workers="nohost")
    assert err.value.field == "embedding_workers"
    with pytest.raises(ConfigError) as err:
        DataCtx(compression_type="brotli")
    assert "compression_type" in err.value.field
    with pytest.raises(ConfigError) as err:
        DataCtx(topic="bad topic!")
    assert "samples_topic" in err.value.field
    for bad in ({"max_inflight": 0}, {"timeout_ms": -1}, {"whatever": 1}):
        with pytest.raises(Misuse):
            DataCtx(**bad)
    # broker-less, a topic or codec would be ignored while the caller thinks it applies
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    for arg, value in (("topic", "clicks"), ("compression_type", "gzip")):
        with pytest.raises(ConfigError, match=rf"DataCtx\({arg}='{value}'\) applies to "
                                              "Kafka only") as err:
            DataCtx(embedding_workers=["127.0.0.1:2"], **{arg: value})
        assert err.value.field == arg


def test_misuse_outside_the_context_and_non_batches():
    ctx = DataCtx(embedding_workers=[f"127.0.0.1:{free_port()}"])
    with pytest.raises(Misuse, match="not started"):
        ctx.send_data(batch(0))
    with pytest.raises(BadInput) as err:
        ctx.send_data({"not": "a batch"})
    assert err.value.field == "persia_batch"
    with ctx:
        with pytest.raises(Misuse, match="once"):
            ctx.start()
    with pytest.raises(Misuse, match="closed"):
        ctx.send_data(batch(0))
    ctx.close()  # idempotent


# ---------------------------------------------------------------------- Kafka

def test_kafka_batches_read_back_equal_with_batch_id_keys(kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    sent = [batch(i, batch_id=100 + i if i % 2 else None) for i in range(12)]
    with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers, topic=topic,
                 max_inflight=4) as ctx:
        assert ctx.mode == "kafka"
        for b in sent:
            ctx.send_data(b)
        # No flush: leaving the block must deliver everything.
    stats = ctx.stats()
    assert stats["sent"] == stats["acked"] == 12 and stats["failed"] == 0
    records = read_back(kafka_broker.bootstrap_servers, topic, 12)
    assert len(records) == 12
    for record, b in zip(records, sent, strict=True):  # one partition: call order
        assert record.key == (None if b.batch_id is None else str(b.batch_id).encode())
        assert_same(PersiaBatch.from_bytes(record.value), b)


def test_kafka_stamps_the_producer_clock_unless_the_user_gave_an_event_time(kafka_broker,
                                                                            kafka_topic):
    topic = kafka_topic(1)
    plain, given = batch(0), batch(1)
    given.event_time = 1_700_000_000.5
    with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers, topic=topic) as ctx:
        before = time.time()
        ctx.send_data(plain)
        after = time.time()
        ctx.send_data(given)
    got = [PersiaBatch.from_bytes(r.value)
           for r in read_back(kafka_broker.bootstrap_servers, topic, 2)]
    assert before <= got[0].event_time <= after
    assert got[1].event_time == 1_700_000_000.5
    assert plain.event_time is None     # the caller's batch is not changed
    assert_same(got[0], plain)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_every_compression_type_reads_back_equal(kafka_broker, kafka_topic, codec):
    """Each codec Kafka offers works out of the box (lz4, snappy and zstd through cramjam,
    a dependency): what a consumer reads back equals what was sent."""
    topic = kafka_topic(1)
    sent = [batch(i, batch_id=i) for i in range(6)]
    with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers, topic=topic,
                 compression_type=codec) as ctx:
        for b in sent:
            ctx.send_data(b)
    records = read_back(kafka_broker.bootstrap_servers, topic, 6)
    assert len(records) == 6
    for record, b in zip(records, sent, strict=True):
        assert_same(PersiaBatch.from_bytes(record.value), b)


def test_kafka_order_is_kept_within_each_partition(kafka_broker, kafka_topic):
    topic = kafka_topic(3)
    with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers, topic=topic,
                 compression_type="gzip", max_inflight=16) as ctx:
        for i in range(30):
            ctx.send_data(batch(i, batch_id=i, batch_size=4))
    records = read_back(kafka_broker.bootstrap_servers, topic, 30)
    by_partition: dict[int, list[int]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(PersiaBatch.from_bytes(r.value).batch_id)
    assert sorted(i for ids in by_partition.values() for i in ids) == list(range(30))
    assert len(by_partition) > 1, "batch-id keys should spread over partitions"
    assert all(ids == sorted(ids) for ids in by_partition.values())


def test_kafka_unknown_topic_is_a_config_error(kafka_broker):
    ctx = DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers,
                  topic="no-such-topic-for-data-ctx")
    with pytest.raises(ConfigError) as err:
        ctx.start()
    assert err.value.field == "kafka.samples_topic" and "does not exist" in str(err.value)


def test_kafka_unknown_slot_is_refused_before_sending(kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    bad = PersiaBatch([IDTypeFeature("nope", [np.array([1], np.uint64)])],
                      requires_grad=False)
    with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers, topic=topic,
                 embedding_config=SCHEMA) as ctx:
        with pytest.raises(BadInput) as err:
            ctx.send_data(bad)
        assert err.value.field == "nope"
        ctx.send_data(batch(0))
    assert ctx.stats()["sent"] == 1


def test_kafka_in_flight_is_bounded_by_max_inflight():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("slow", 1)
        with DataCtx(kafka_bootstrap_servers=cluster.bootstrap_servers, topic="slow",
                     max_inflight=2) as ctx:
            ctx.send_data(batch(0))
            ctx.flush()
            cluster.set_rtt(100)  # every acknowledgement now takes >= 100 ms
            try:
                for i in range(1, 7):
                    ctx.send_data(batch(i))
                    assert ctx.stats()["in_flight"] <= 2
            finally:
                cluster.set_rtt(0)
        stats = ctx.stats()
        assert stats["peak_in_flight"] == 2 and stats["waits"] > 0
        assert stats["acked"] == 7


def test_kafka_delivery_failure_surfaces_from_flush():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("down", 1)
        ctx = DataCtx(kafka_bootstrap_servers=cluster.bootstrap_servers, topic="down",
                      timeout_ms=500)
        ctx.start()
        try:
            ctx.send_data(batch(0))
            ctx.flush()
            cluster.broker_down()
            ctx.send_data(batch(1))  # queued: send_data does not wait for the broker
            with pytest.raises(RemoteError):
                ctx.flush()
        finally:
            t0 = time.monotonic()
            with pytest.raises(RemoteError):
                ctx.close()
            assert time.monotonic() - t0 < 15, "close must not wait for a dead broker"
            cluster.broker_up()


# ------------------------------------------------------------- broker-less mode

@pytest.fixture
def job():
    made: list[WorkersOnLoop] = []

    def make(workers: int = 1, ready: int = 16) -> WorkersOnLoop:
        made.append(WorkersOnLoop(workers, ready=ready,
                                  server_args=(10_000, SGD(lr=0.1), EmbeddingConfig((-0.5, 0.5)))))
        return made[-1]

    yield make
    for j in made:
        j.close()


def test_direct_one_worker_keeps_order_and_flushes_on_exit(job):
    j = job()
    with DataCtx(embedding_workers=j.addresses, max_inflight=1) as ctx:
        assert ctx.mode == "direct"
        for i in range(5):
            ctx.send_data(batch(i))
    assert j.ready() == 5  # every batch is in the worker once the block is left
    assert [j.pull()["meta"] for _ in range(5)] == [f"batch-{i}".encode() for i in range(5)]
    assert ctx.stats()["acked"] == 5 and ctx.stats()["peak_in_flight"] == 1


def test_direct_stamps_the_producer_clock_unless_the_user_gave_an_event_time(job):
    j = job()
    given = batch(1, requires_grad=False)
    given.event_time = 12.5
    sent = [batch(0), given, batch(2)]
    with DataCtx(embedding_workers=j.addresses, max_inflight=1) as ctx:
        before = time.time()
        ctx.send_data(sent[0])
        after = time.time()
        ctx.send_data(sent[1])
        ctx.send_data(sent[2])
        last = time.time()
    assert sent[0].event_time is None and sent[2].event_time is None
    served = [j.pull() for _ in range(3)]
    assert [s["meta"] for s in served] == [b"batch-0", b"batch-1", b"batch-2"]
    assert before <= served[0]["event_time"] <= after
    assert served[1]["event_time"] == 12.5      # an evaluation batch keeps it too
    assert after <= served[2]["event_time"] <= last


def test_direct_sends_each_batch_as_it_was_when_send_data_returned():
    """A data loader that refills its buffers for the next batch (PERSIA's batches are
    copies, so its loaders may) must not change a batch already handed to send_data.
    Kafka encodes the batch at once; broker-less, the arrays were encoded only when the
    RPC went out, so the worker got the refilled data, silently."""
    port = free_port()
    ref = batch(0)
    ids = [(f.name, f.values.copy(), f.offsets.copy()) for f in ref.id_type_features]
    dense, label = ref.non_id_type_features[0].data.copy(), ref.labels[0].data.copy()
    reused = PersiaBatch([IDTypeFeature.from_csr(n, v, o) for n, v, o in ids],
                         [NonIDTypeFeature(dense, "dense")], [Label(label, "click")],
                         meta=b"reused")
    w = None
    try:
        # No worker listens yet, so the batch cannot have gone out before the refill.
        with DataCtx(embedding_workers=[f"127.0.0.1:{port}"], max_inflight=2,
                     startup_timeout_ms=30_000) as ctx:
            ctx.send_data(reused)
            for _, values, offsets in ids:
                values[:] = 7
                offsets[1:] = offsets[-1]   # still valid CSR: every id in sample 0
            dense[:] = np.nan
            label[:] = 5
            w = WorkersOnLoop(1, ports=[port])
            ctx.send_data(ref)
        got, want = w.pull(), w.pull()
    finally:
        if w is not None:
            w.close()
    assert (got["meta"], want["meta"]) == (b"reused", b"batch-0")
    for key in ("non_id_type_features", "labels", "embeddings"):
        assert len(got[key]) == len(want[key])
        for g, s in zip(got[key], want[key], strict=True):
            for part in ("data", "emb", "index", "mask"):
                if isinstance(s, dict) and s.get(part) is not None:
                    np.testing.assert_array_equal(g[part], s[part], err_msg=f"{key}.{part}")


def test_direct_round_robin_over_workers_from_replica_index(job, monkeypatch):
    j = job(workers=2)
    monkeypatch.setenv("REPLICA_INDEX", "1")
    with DataCtx(embedding_workers=",".join(j.addresses), max_inflight=4) as ctx:
        for i in range(6):
            ctx.send_data(batch(i))
    assert (j.ready(0), j.ready(1)) == (3, 3)
    # Data loader replica 1 starts at worker 1. Concurrent sends race (the order within a
    # worker is kept only with max_inflight=1), so compare sets.
    assert {j.pull(1)["meta"] for _ in range(3)} == {b"batch-0", b"batch-2", b"batch-4"}
    assert {j.pull(0)["meta"] for _ in range(3)} == {b"batch-1", b"batch-3", b"batch-5"}


def test_direct_full_worker_applies_backpressure(job):
    j = job(ready=2)
    with DataCtx(embedding_workers=j.addresses, max_inflight=1, timeout_ms=300) as ctx:
        ctx.send_data(batch(0))
        ctx.send_data(batch(1))
        ctx.send_data(batch(2))  # the buffer is full: this one waits in flight...
        t0 = time.monotonic()
        with pytest.raises(Backpressure) as err:
            ctx.send_data(batch(3))  # ...so this one blocks, and gets its failure
        assert time.monotonic() - t0 >= 0.1
        assert err.value.field == "timeout_ms"
        assert ctx.stats()["failed"] == 1 and ctx.stats()["peak_in_flight"] == 1
        assert j.pull()["meta"] == b"batch-0"  # room again: sending resumes
        ctx.send_data(batch(4))
    assert j.ready() == 2


def test_direct_refused_batch_surfaces_with_its_field(job):
    j = job()
    bad = PersiaBatch([IDTypeFeature("nope", [np.array([1], np.uint64)])],
                      requires_grad=False)
    with DataCtx(embedding_workers=j.addresses) as ctx:
        ctx.send_data(bad)  # pipelined: the refusal arrives later
        with pytest.raises(BadInput) as err:
            ctx.flush()
        assert "nope" in str(err.value) and "batch 0 " in str(err.value)
        ctx.send_data(batch(0))  # the context stays usable
    assert j.ready() == 1


def test_direct_unreachable_worker_fails_naming_it():
    address = f"127.0.0.1:{free_port()}"
    ctx = DataCtx(embedding_workers=[address], timeout_ms=400, startup_timeout_ms=500)
    with pytest.raises(PeerUnavailable) as err, ctx:
        ctx.send_data(batch(0))
        ctx.flush()
    assert err.value.field == "embedding_workers" and address in str(err.value)


def test_exception_in_the_block_still_delivers_what_was_sent(job):
    j = job()
    with pytest.raises(KeyError), DataCtx(embedding_workers=j.addresses) as ctx:
        ctx.send_data(batch(0))
        ctx.send_data(batch(1))
        raise KeyError("user bug")
    assert j.ready() == 2


def test_overlapping_calls_from_two_threads_are_misuse(job):
    j = job(ready=1)
    with DataCtx(embedding_workers=j.addresses, max_inflight=1, timeout_ms=5000) as ctx:
        ctx.send_data(batch(0))
        ctx.send_data(batch(1))  # waits in flight for room
        blocked = threading.Thread(target=ctx.send_data, args=(batch(2),))
        blocked.start()  # blocks for the single in-flight slot
        deadline = time.monotonic() + 5
        while not ctx._lock.locked() and time.monotonic() < deadline:  # it is inside
            time.sleep(0.01)
        with pytest.raises(Misuse, match="another thread"):
            ctx.send_data(batch(3))
        for _ in range(2):
            assert j.pull() is not None
        blocked.join(10)
        assert not blocked.is_alive()
    assert ctx.stats()["acked"] == 3
