"""Role metrics (:mod:`stream_persia.core.metrics`) as Prometheus reads them from a role's text.

What a component counts (lookups, records consumed) is exported as a counter named
``<name>_total``, so ``rate()`` applies; what it measures now (rows, buffer depth) stays a
gauge. A counter name that the component does not report is refused when it is declared.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from stream_persia.config import KafkaConfig
from stream_persia.core.metrics import RoleMetrics
from stream_persia.errors import Misuse
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.rpc import RpcClient
from stream_persia.server.service import COUNTERS, EmbeddingServer
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.worker.ingest import KafkaIngest
from stream_persia.worker.service import EmbeddingWorker

pytestmark = pytest.mark.timeout(60)


def exposition(text: bytes | str) -> dict[str, tuple[str, float]]:
    """``{sample name: (TYPE of its family, value)}``, read straight from the text format
    (the ``# TYPE`` line, not a parser's reading of it; samples without labels only)."""
    if isinstance(text, bytes):
        text = text.decode()
    out: dict[str, tuple[str, float]] = {}
    kind = ""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            kind = line.split()[3]
        elif line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = (kind, float(value))
    return out


def test_declared_keys_are_counters_named_total_and_the_others_gauges():
    m = RoleMetrics("demo")
    m.add_callback("queue", lambda: {"pushed": 7, "depth": 2}, counters=frozenset({"pushed"}))
    raw = m.render().decode()
    assert "# TYPE persia_demo_queue_pushed_total counter\n" in raw
    assert "# TYPE persia_demo_queue_depth gauge\n" in raw
    text = exposition(raw)
    assert text == {"persia_demo_queue_pushed_total": ("counter", 7.0),
                    "persia_demo_queue_depth": ("gauge", 2.0)}


def test_a_counter_the_callback_does_not_report_is_refused_when_declared():
    m = RoleMetrics("demo")
    with pytest.raises(Misuse, match=r"\['pushd'\].*returns \['depth', 'pushed'\]") as err:
        m.add_callback("queue", lambda: {"pushed": 7, "depth": 2}, counters={"pushd"})
    assert err.value.field == "counters"
    with pytest.raises(Misuse, match="collection of key names"):
        m.add_callback("queue", lambda: {"pushed": 7}, counters="pushed")
    assert b"persia_demo_queue" not in m.render(), "nothing half-registered"


async def test_embedding_server_exports_its_counts_as_counters_and_levels_as_gauges():
    server = EmbeddingServer(1000)
    await server.start()
    try:
        async with RpcClient(server.address, timeout_ms=5000) as client:
            ids = np.arange(1, 11, dtype=np.uint64)
            await client.call("lookup", {"mode": "train", "groups": [{"dim": 4, "ids": ids}]})
            stats = await client.call("stats", None)
            text = exposition(await client.call("metrics", None))
    finally:
        await server.stop()
    assert stats["lookups"] == 10 and stats["rows"] > 0
    for key in (*COUNTERS, "loads"):
        name = f"persia_embedding_server_store_{key}"
        assert text[f"{name}_total"] == ("counter", stats[key]), key
        assert name not in text, "no gauge of the same count"
    for key in ("rows", "capacity"):
        assert text[f"persia_embedding_server_store_{key}"] == ("gauge", stats[key]), key


async def test_worker_kafka_counts_are_counters_that_go_on_across_reset_stream(
        kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    cfg = KafkaConfig(bootstrap_servers=kafka_broker.bootstrap_servers, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="metrics-test")
    async with BatchProducer(topic, bootstrap_servers=kafka_broker.bootstrap_servers) as p:
        for i in range(3):
            await p.send(make_batch(i), key=i)
    server = EmbeddingServer(10_000)
    await server.start()
    worker = EmbeddingWorker(SCHEMA, [server.address])

    def make(start_offsets):
        return KafkaIngest(worker, SampleConsumer.from_config(cfg, replica_index=0,
                                                              replica_size=1),
                           DeadLetterWriter.from_config(cfg), start_offsets=start_offsets)

    records = "persia_embedding_worker_kafka_consumer_records_total"
    try:
        await worker.start()
        async with RpcClient(worker.address, timeout_ms=5000) as client:
            # Broker-less so far: no Kafka series at all (no consumer to count).
            raw = (await client.call("metrics")).decode()
            assert "persia_embedding_worker_batches_ingested" in raw
            assert "persia_embedding_worker_kafka" not in raw
            await worker.start_kafka_ingest(make)
            with pytest.raises(Misuse, match="fed from Kafka already"):
                await worker.start_kafka_ingest(make)

            async def consumed(n: int) -> dict:
                async with asyncio.timeout(20):
                    while True:
                        text = exposition(await client.call("metrics"))
                        if text[records][1] >= n:
                            return text
                        await asyncio.sleep(0.05)

            await consumed(3)
            # A restore replays the topic with a new consumer, whose own count starts at 0.
            await client.call("reset_stream", {"offsets": {"0": 0}})
            text = await consumed(6)
    finally:
        await worker.stop()
        await server.stop()
    assert text[records] == ("counter", 6.0), "never dropped back to 3"
    for key in KafkaIngest.COUNTERS:
        assert text[f"persia_embedding_worker_kafka_{key}_total"][0] == "counter", key
    assert text["persia_embedding_worker_kafka_consumer_partitions"] == ("gauge", 1.0)
    assert text["persia_embedding_worker_buffer_ready"][0] == "gauge"
