"""Kafka data lost before it was trained shows in ``/v1/status`` and on ``/metrics``, and a
checkpoint taken over HTTP records the stopped partition's offset where the loss starts,
never past it.

A real job (embedding server and worker on loopback, fed from its own mock broker, which
keeps ~5 MiB per partition and silently drops older data) and the API on uvicorn. The
test plays the NN worker; while its partition 0 is paused (as backpressure pauses it),
8 MiB more arrive there and the broker deletes unread data.

A checkpoint restored onto the samples topic deleted and created again (and grown past its
offsets) is refused: modelled as the same topic name on a new cluster (the mock cannot
delete a topic), other records at the same offsets (stream_persia.kafka.fingerprint).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from api_helpers import (
    AUTH,
    Job,
    LiveApi,
    settings_for,
    start_job,
    stop_job,
    take_checkpoint,
)
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.config import KafkaConfig
from stream_persia.kafka import DeadLetterWriter, SampleConsumer
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.samples import make_batch
from stream_persia.worker.ingest import KafkaIngest

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]
NO_GRADS = dict.fromkeys(("user", "item", "tags"))


async def produce(bootstrap: str, partition: int, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for v in values:
            await producer.send("job", v, partition=partition)
        await producer.flush()
    finally:
        await producer.stop()


def sample(metrics: str, name: str) -> float:
    """The embedding worker's sample ``persia_embedding_worker_<name>``."""
    full = f"persia_embedding_worker_{name}"
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == full:
                return s.value
    raise AssertionError(f"no {full} in /metrics")


async def train(worker, n: int) -> int:
    """Pull and apply up to ``n`` batches as an NN worker; returns how many came."""
    got = 0
    for _ in range(n):
        served = await worker._next_batch({"timeout_ms": 3000})
        if served is None:
            break
        await worker._push_gradients({"batch_id": served["batch_id"], "grads": NO_GRADS})
        got += 1
    return got


@contextlib.asynccontextmanager
async def kafka_job(on_data_loss: str = "fail", first: int = 0
                    ) -> AsyncIterator[tuple[Any, Job, Any]]:
    """(broker, job, its worker): topic ``job`` of 2 partitions holding 3 batches each
    (``make_batch(first + 10 * p + i)``), one embedding server, one worker fed from the
    topic that trained all 6."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("job", 2)
        cluster.create_topic("job.dlq", 1)
        for p in (0, 1):
            await produce(cluster.bootstrap_servers, p,
                          [make_batch(first + 10 * p + i).to_bytes() for i in range(3)])
        cfg = KafkaConfig(bootstrap_servers=cluster.bootstrap_servers, samples_topic="job",
                          on_data_loss=on_data_loss)
        job = await start_job(n_servers=1)
        try:
            worker = job.workers[0]

            def make(start_offsets):
                return KafkaIngest(worker, SampleConsumer.from_config(cfg, replica_index=0,
                                                                      replica_size=1),
                                   DeadLetterWriter.from_config(cfg),
                                   start_offsets=start_offsets)

            await asyncio.wait_for(worker.start_kafka_ingest(make), 30)
            assert await train(worker, 6) == 6
            yield cluster, job, worker
        finally:
            await stop_job(job)


async def retention_deletes_partition_0(cluster: Any, worker: Any) -> int:
    """Pause partition 0 (as backpressure does), write 8 MiB there so the broker deletes
    what the worker has not read, and return the partition's new log start (> 3)."""
    consumer = worker.kafka.consumer
    consumer.pause([0])
    await produce(cluster.bootstrap_servers, 0, [b"x" * 100_000] * 80)
    tp = consumer._tps[0]
    begin = (await consumer._live().beginning_offsets([tp]))[tp]
    assert begin > 3
    return begin


@pytest.mark.parametrize("mode", ["fail", "skip"])
async def test_data_loss_is_reported_and_checkpoints_never_pass_it(tmp_path, mode):
    async with kafka_job(mode) as (cluster, job, worker):
        begin = await retention_deletes_partition_0(cluster, worker)
        worker.kafka.consumer.resume([0])
        await produce(cluster.bootstrap_servers, 1, [make_batch(100).to_bytes()])
        # fail: partition 1's batch only; skip: that one and the 100 KB junk records
        # left on partition 0, which are dead-lettered (settled, never served).
        assert await train(worker, 100) == 1
        if mode == "skip":   # the junk records are dead-lettered one by one
            async with asyncio.timeout(60):
                while worker.frontier.offsets()[0] < 83:
                    await asyncio.sleep(0.05)

        async with LiveApi(settings_for(job, checkpoint_dir=str(tmp_path))) as api:
            status = (await api.client.get("/v1/status", headers=AUTH)).json()
            kafka = status["workers"][0]["kafka"]
            assert kafka["on_data_loss"] == mode
            metrics = (await api.client.get("/metrics", headers=AUTH)).text
            if mode == "fail":
                loss = kafka["stopped"]["0"]
                assert (loss["first"], loss["resume"], loss["cause"]) == (3, begin, "deleted")
                assert f"job/0: offsets 3..{begin - 1}" in loss["message"]
                assert kafka["lost_messages"] == {}
                assert sample(metrics, "kafka_consumer_partitions_stopped") == 1
                assert sample(metrics, "kafka_consumer_data_loss_events_total") == 1
                assert status["workers"][0]["frontier"] == {"0": 3, "1": 4}
            else:
                assert kafka["stopped"] == {}
                assert kafka["lost_messages"] == {"0": begin - 3}
                assert sample(metrics, "kafka_consumer_offsets_lost_total") == begin - 3
                assert sample(metrics, "kafka_consumer_partitions_stopped") == 0
            info = await take_checkpoint(api, "cut")
            offsets = info["manifest"]["offsets"]["job"]
            if mode == "fail":
                # The cut records where the loss starts on the stopped partition: a
                # restore would read offset 3 again, never claim 3..begin-1 trained.
                assert offsets == {"0": 3, "1": 4}
            else:   # the accepted loss is skipped, and counted above
                assert offsets == {"0": 83, "1": 4}


async def test_a_restore_that_kafka_cannot_replay_is_refused_and_changes_nothing(tmp_path):
    """A checkpoint whose offsets retention deleted since (or that lie past the topic's
    end) is refused naming the partition and offsets: 409 (422), never a 502 "a role
    failed"; and the refusal comes before the servers load its rows, so the job trains
    on as it was."""
    async with kafka_job() as (cluster, job, worker), \
            LiveApi(settings_for(job, checkpoint_dir=str(tmp_path))) as api:
        info = await take_checkpoint(api, "cut")
        assert info["manifest"]["offsets"]["job"] == {"0": 3, "1": 3}
        # Trained on past the cut: rows a restore would replace.
        await produce(cluster.bootstrap_servers, 1,
                      [make_batch(100 + i).to_bytes() for i in range(2)])
        assert await train(worker, 2) == 2
        rows = len(job.servers[0].store)
        begin = await retention_deletes_partition_0(cluster, worker)

        r = await api.client.post("/v1/checkpoints/cut/restore", headers=AUTH)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert (err["kind"], err["field"]) == ("data_lost", "checkpoint"), err
        assert f"job/0: offsets 3..{begin - 1}" in err["message"], err
        assert "on_data_loss" in err["hint"]
        assert len(job.servers[0].store) == rows, "the servers loaded the checkpoint"
        assert worker.frontier.offsets() == {0: 3, 1: 5}, "the stream was reset"

        # A checkpoint whose offsets lie past the topic's end (another topic's).
        shutil.copytree(tmp_path / "cut", tmp_path / "elsewhere")
        manifest = json.loads((tmp_path / "elsewhere/manifest.json").read_text())
        manifest["offsets"]["job"] = {"0": 10**6, "1": 3}
        (tmp_path / "elsewhere/manifest.json").write_text(json.dumps(manifest))
        r = await api.client.post("/v1/checkpoints/elsewhere/restore", headers=AUTH)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["field"] == "checkpoint", err
        assert "offset 1000000 of job/0 is beyond its end" in err["message"], err
        assert len(job.servers[0].store) == rows


async def test_a_restore_onto_the_topic_created_again_is_refused_unless_skip(tmp_path, caplog):
    """The cut fingerprints the record below each offset; a restore onto the same topic
    goes on, onto the topic created anew (and grown past the offsets) it is refused before
    anything loads (409 naming topic, partition, offset, both records); a checkpoint from
    before fingerprints restores unchecked (logged); with on_data_loss skip the restore
    goes on and the mismatch is counted."""
    async with kafka_job() as (cluster, job, worker), \
            LiveApi(settings_for(job, checkpoint_dir=str(tmp_path))) as api:
        info = await take_checkpoint(api, "cut")
        manifest = info["manifest"]
        assert manifest["offsets"]["job"] == {"0": 3, "1": 3}
        prints = manifest["fingerprints"]["job"]
        assert sorted(prints) == ["0", "1"]
        assert {fp["offset"] for fp in prints.values()} == {2}
        r = await api.client.post("/v1/checkpoints/cut/restore", headers=AUTH)
        assert r.status_code == 200, r.text                   # the same topic: it matches
    # No fingerprints: as a checkpoint written before them.
    shutil.copytree(tmp_path / "cut", tmp_path / "old")
    old = json.loads((tmp_path / "old/manifest.json").read_text())
    del old["fingerprints"]
    (tmp_path / "old/manifest.json").write_text(json.dumps(old))

    async with kafka_job(first=500) as (cluster, job, worker), \
            LiveApi(settings_for(job, checkpoint_dir=str(tmp_path))) as api:
        rows = len(job.servers[0].store)
        r = await api.client.post("/v1/checkpoints/cut/restore", headers=AUTH)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert (err["kind"], err["field"]) == ("data_lost", "checkpoint"), err
        assert "job/0: the record at offset 2 is not the one the checkpoint recorded" in \
            err["message"], err
        assert f"digest {prints['0']['digest']}; the broker has timestamp" in err["message"]
        assert "job/1: the record at offset 2" in err["message"]
        assert "restore a checkpoint taken of this topic" in err["hint"]
        assert len(job.servers[0].store) == rows, "the servers loaded the checkpoint"
        assert worker.frontier.offsets() == {0: 3, 1: 3}
        assert not worker.kafka.task.done()

        with caplog.at_level(logging.WARNING):
            r = await api.client.post("/v1/checkpoints/old/restore", headers=AUTH)
        assert r.status_code == 200, r.text
        assert "records no fingerprints" in caplog.text

    async with kafka_job("skip", first=500) as (cluster, job, worker), \
            LiveApi(settings_for(job, checkpoint_dir=str(tmp_path))) as api:
        r = await api.client.post("/v1/checkpoints/cut/restore", headers=AUTH)
        assert r.status_code == 200, r.text
        assert worker.frontier.offsets() == {0: 3, 1: 3}
        metrics = (await api.client.get("/metrics", headers=AUTH)).text
        assert sample(metrics, "kafka_consumer_fingerprint_mismatches_total") == 2
