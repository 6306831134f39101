"""An embedding worker's stage watermarks and Kafka lag against the Kafka test broker
(stream_persia.worker.kafka_lag): a worker held back by a full ready buffer lags in
messages and in seconds (the probe reads the partition's newest record), its ``produced``
watermark is the newest event time in its partitions; once it drains, it is caught up (0
and 0) and ``ingested`` reaches ``produced``. Both are in ``status`` and on its metrics."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.config import KafkaConfig
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.rpc import RpcClient
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.pytest_plugin import TANSU_FETCH_ONE_PARTITION, deviates_on
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.servers import running_servers
from stream_persia.worker.ingest import KafkaIngest
from stream_persia.worker.service import EmbeddingWorker

T0 = 1_700_000_000.0
N = 8


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def _until(check, what: str, timeout_s: float = 20.0):
    async with asyncio.timeout(timeout_s):
        while not (got := await check()):
            await asyncio.sleep(0.05)
    assert got, what
    return got


@pytest.mark.kafka
@deviates_on("tansu", TANSU_FETCH_ONE_PARTITION)
async def test_a_lagging_worker_reports_lag_in_messages_and_seconds_then_catches_up(
        kafka_broker, kafka_topic):
    topic = kafka_topic(partitions=2)
    bootstrap = kafka_broker.bootstrap_servers
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        for i in range(N):   # partition 0 gets the even ones, partition 1 the odd ones
            await producer.send_and_wait(make_batch(i).stamped(T0 + i), key=i)
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="lag")
    async with running_servers(1) as (servers, _):
        worker = EmbeddingWorker(SCHEMA, [s.address for s in servers], ready_buffer_batches=2)
        await worker.start()
        try:
            await worker.start_kafka_ingest(lambda start: KafkaIngest(
                worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
                DeadLetterWriter.from_config(cfg), start_offsets=start,
                lag_probe_interval_s=3600))
            # The probes run inside each status call, while it awaits the broker: the
            # watermarks and the lag rows it answers must still be one snapshot (they
            # were not, and a produced older than the probed tail failed in CI).
            ingest = worker.kafka
            assert ingest is not None
            ingest_status = ingest.status

            async def status_across_a_probe():
                got = await ingest_status()
                rows = ingest.lag.rows()
                if any((r["messages"] or 0) > 0 and r["seconds"] is None for r in rows):
                    await ingest.lag.probe()
                return got

            ingest.status = status_across_a_probe   # type: ignore[method-assign]
            async with RpcClient(worker.address, timeout_ms=20_000) as c:
                async def lagging():
                    st = await c.call("status")
                    rows = st.get("kafka_lag") or []
                    return st if rows and all(r["seconds"] is not None for r in rows) \
                        and sum(r["messages"] or 0 for r in rows) > 0 else None

                st = await _until(lagging, "a lag in messages and seconds")
                rows = {r["partition"]: r for r in st["kafka_lag"]}
                assert set(rows) == {0, 1} and all(r["topic"] == topic for r in rows.values())
                ingested = st["watermarks"]["ingested"]
                assert ingested is not None and ingested < T0 + N - 1
                # The probe read each partition's newest record: produced is the newest.
                assert st["watermarks"]["produced"] == T0 + N - 1
                for r in rows.values():
                    assert 0 <= r["seconds"] <= N - 1
                assert max(r["seconds"] for r in rows.values()) > 0
                total = sum(r["messages"] for r in rows.values())
                assert total <= N - 2       # two batches at least are in the ready buffer
                got = _samples((await c.call("metrics")).decode())
                for p in rows:
                    key = (("partition", str(p)), ("topic", topic))
                    assert got[("persia_embedding_worker_kafka_lag_messages", key)] >= 0
                    assert ("persia_embedding_worker_kafka_lag_seconds", key) in got
                assert got[("persia_stage_event_time_seconds", (("stage", "produced"),))] \
                    == T0 + N - 1
                assert ("persia_stage_lag_seconds", (("stage", "ingested"),)) in got

                # Drain: serve and apply every batch; the worker catches up.
                rng = np.random.default_rng(0)
                for _ in range(N):
                    served = await c.call("next_batch", {"timeout_ms": 10_000})
                    grads = {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
                             for e in served["embeddings"]}
                    await c.call("push_gradients", {"batch_id": served["batch_id"],
                                                    "grads": grads})

                async def caught_up():
                    st = await c.call("status")
                    rows = st.get("kafka_lag") or []
                    return st if rows and all(r["messages"] == 0 and r["seconds"] == 0
                                              for r in rows) else None

                st = await _until(caught_up, "caught up")
                assert st["watermarks"]["ingested"] == st["watermarks"]["produced"] \
                    == T0 + N - 1
                got = _samples((await c.call("metrics")).decode())
                assert got[("persia_stage_event_time_seconds", (("stage", "ingested"),))] \
                    == T0 + N - 1
                assert all(v == 0 for (name, _), v in got.items()
                           if name.startswith("persia_embedding_worker_kafka_lag_")
                           and name != "persia_embedding_worker_kafka_lag_probe_age_seconds")
        finally:
            await worker.stop()


@pytest.mark.kafka
async def test_a_dead_broker_neither_hangs_nor_hides_the_lag_probe():
    """The broker dies under a lagging worker: the probe gives up within its bound, status
    still answers, and the failures show on the worker's metrics; the lag figures stay as
    last known, and their age (``..._kafka_lag_probe_age_seconds``, ``probe_age_s`` in
    status) grows from the last probe that succeeded, so they do not pass for current."""
    cluster = MockKafkaCluster().start()
    try:
        topic = "lag-dies"
        cluster.create_topic(topic, 1)
        bootstrap = cluster.bootstrap_servers
        async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
            for i in range(N):
                await producer.send_and_wait(make_batch(i).stamped(T0 + i), key=i)
        cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                          dlq_topic=f"{topic}.dlq", job_name="lag")
        async with running_servers(1) as (servers, _):
            worker = EmbeddingWorker(SCHEMA, [s.address for s in servers],
                                     ready_buffer_batches=2)
            await worker.start()
            try:
                await worker.start_kafka_ingest(lambda start: KafkaIngest(
                    worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
                    DeadLetterWriter.from_config(cfg), start_offsets=start,
                    lag_probe_interval_s=0.2))
                async with RpcClient(worker.address, timeout_ms=20_000) as c:
                    async def lagging():
                        rows = (await c.call("status")).get("kafka_lag") or []
                        return rows if rows and rows[0]["seconds"] else None

                    before = await _until(lagging, "a lag in seconds")
                    age = ("persia_embedding_worker_kafka_lag_probe_age_seconds", ())
                    fresh = _samples((await c.call("metrics")).decode())[age]
                    assert 0 <= fresh < 2, fresh             # probes every 0.2 s succeed
                    assert all(r["probe_age_s"] is not None and r["probe_age_s"] < 2
                               for r in before), before
                    cluster.kill()

                    async def failures():
                        got = _samples((await c.call("metrics")).decode())
                        return got.get(("persia_embedding_worker_kafka_"
                                        "lag_probe_failures_total", ())) or None

                    assert await _until(failures, "probe failures counted") >= 1

                    async def aged():   # the figures stay, but say how old they are
                        got = _samples((await c.call("metrics")).decode())
                        return got.get(age) if got.get(age, 0) > 3 else None

                    assert await _until(aged, "the lag figures' age grows") > 3
                    started = time.monotonic()
                    st = await c.call("status")
                    assert time.monotonic() - started < 5
                    figures = ("topic", "partition", "messages", "seconds")
                    assert [{k: r[k] for k in figures} for r in st["kafka_lag"]] == \
                        [{k: r[k] for k in figures} for r in before]   # as last known
                    assert all(r["probe_age_s"] > 3 for r in st["kafka_lag"]), st["kafka_lag"]
            finally:
                async with asyncio.timeout(30):
                    await worker.stop()
    finally:
        if cluster.is_running:
            cluster.stop()
