"""Checkpoints over HTTP when no NN rank is attached: the API takes the cut itself.

Started with 202, followed to ``done``, listed with its manifest, restored into a job
with another number of embedding servers; refused (the job fails, nothing is published)
while a batch is in flight without an NN rank reporting to the mailbox, or while the
workers mix Kafka and direct ingest; a restore into a job with another embedding schema
is refused (409).
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer
from api_helpers import (
    AUTH,
    LiveApi,
    TwoHeads,
    settings_for,
    start_job,
    stop_job,
    take_checkpoint,
    write_checkpoint,
)
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.checkpoint import config_digest, read_manifest, verify
from stream_persia.config import EmbeddingSchema, KafkaConfig
from stream_persia.kafka import DeadLetterWriter, SampleConsumer
from stream_persia.testing.samples import SCHEMA, SCHEMA_DICT, make_batch
from stream_persia.worker.ingest import KafkaIngest


async def wait_done(api: LiveApi, ident: str, timeout_s: float = 30) -> dict:
    async with asyncio.timeout(timeout_s):
        while True:
            r = await api.client.get(f"/v1/checkpoints/{ident}", headers=AUTH)
            assert r.status_code == 200, r.text
            info = r.json()
            if info["state"] in ("done", "failed"):
                return info
            await asyncio.sleep(0.05)


def rows_of(job) -> dict[int, np.ndarray]:
    """Every row of every server, by id (for comparing jobs with different shard counts)."""
    out = {}
    for s in job.servers:
        for chunk in s.store.dump():
            for i, w in zip(chunk["ids"].tolist(), chunk["weights"], strict=True):
                out[i] = w
    return out


def requests_to(server) -> float:
    """RPC requests an embedding server has taken (its requests_total, every method)."""
    return sum(s.value for fam in text_string_to_metric_families(
        server.metrics.render().decode()) for s in fam.samples
        if s.name == "persia_embedding_server_requests_total")


async def test_api_cut_list_inspect_restore(job, tmp_path):
    root = str(tmp_path / "ckpts")
    await job.train(5)
    # A checkpoint from train.py (dense model included) is the base the API cut carries.
    await write_checkpoint(job, f"{root}/base", TwoHeads(seed=4), step=5)
    await job.train(3, seed=2)
    want_rows = rows_of(job)
    async with LiveApi(settings_for(job, checkpoint_dir=root, embeddings="local")) as api:
        r = await api.client.post("/v1/checkpoints", headers=AUTH)
        assert r.status_code == 202, r.text
        accepted = r.json()
        assert r.headers["location"] == accepted["status_url"]
        ident = accepted["id"]
        info = await wait_done(api, ident)
        assert info["state"] == "done", info
        assert info["by"] == "api" and info["dst"] == f"{root}/{ident}"
        manifest = info["manifest"]
        # A direct stream cannot prove that the base's dense model matches these
        # embeddings (the job trained since): the checkpoint holds the embeddings alone.
        assert manifest["extra"]["dense_from"] is None and manifest["extra"]["embeddings_only"]
        assert manifest["step"] == 5 and manifest["stream"] == "direct"
        assert sum(manifest["files"][f]["rows"] for f in manifest["embedding_files"]) == len(
            want_rows)
        verify(info["dst"])
        assert read_manifest(info["dst"]).dense_filename is None
        # Listed with its manifest, after the older one.
        listed = (await api.client.get("/v1/checkpoints", headers=AUTH)).json()["checkpoints"]
        assert [c["id"] for c in listed] == ["base", ident]
        assert listed[1]["manifest"]["embedding_files"] == manifest["embedding_files"]
        assert (await api.client.get("/v1/status", headers=AUTH)).json()[
            "last_checkpoint"]["id"] == ident
        assert (await api.client.get("/v1/checkpoints/nope", headers=AUTH)).status_code == 404
        r = await api.client.post("/v1/checkpoints/nope/restore", headers=AUTH)
        assert r.status_code == 404

    # The job moves on, then is restored: into 3 servers instead of 2.
    await job.train(2, seed=3)
    other = await start_job(n_servers=3)
    try:
        await other.train(1, seed=9)      # rows that the restore must replace
        async with LiveApi(settings_for(other, checkpoint_dir=root,
                                        embeddings="local")) as api:
            r = await api.client.post(f"/v1/checkpoints/{ident}/restore", headers=AUTH,
                                      json={"reload_model": True})
            assert r.status_code == 200, r.text
            result = r.json()
            assert result["rows"] == len(want_rows)
            assert not result["model_reloaded"]    # no dense model in it
            assert result["workers_reset"] == 0    # a direct stream cannot be replayed
            got = rows_of(other)
            assert got.keys() == want_rows.keys()
            for k, w in want_rows.items():
                np.testing.assert_array_equal(got[k], w)
            # The base (with a dense model) restores and serves.
            r = await api.client.post("/v1/checkpoints/base/restore", headers=AUTH)
            assert r.status_code == 200 and r.json()["model_reloaded"]
            assert (await api.client.get("/v1/model")).json()["version"] == "base"
            r = await api.client.post("/v1/predict", json={
                "id_type_features": {"user": [[1, 2]], "item": [3], "tags": [[4]]},
                "non_id_type_features": {"dense": [[0.1, 0.2, 0.3]]}})
            assert r.status_code == 200 and r.json()["checkpoint"] == "base"
    finally:
        await stop_job(other)


async def test_api_cut_refuses_batches_in_flight(job, tmp_path):
    root = str(tmp_path / "ckpts")
    worker = job.client(job.workers[0].address)
    await worker.call("ingest", {"batch": make_batch(0).to_wire()})
    served = await worker.call("next_batch", {"timeout_ms": 2000})
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        r = await api.client.post("/v1/checkpoints", headers=AUTH)
        assert r.status_code == 202
        info = await wait_done(api, r.json()["id"])
        assert info["state"] == "failed"
        assert "in flight" in info["error"] and info["manifest"] is None
        assert not os.path.exists(info["dst"])
        listed = (await api.client.get("/v1/checkpoints", headers=AUTH)).json()["checkpoints"]
        assert [c["state"] for c in listed] == ["failed"]
        # Restoring refuses too while the batch is out.
        await write_checkpoint(job, f"{root}/ok", TwoHeads())
        r = await api.client.post("/v1/checkpoints/ok/restore", headers=AUTH)
        assert r.status_code == 409, r.text
        assert "in flight" in r.json()["error"]["message"]
    await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                         "grads": dict.fromkeys(SCHEMA.slots)})


async def test_api_cut_refuses_a_clear_of_the_servers_while_it_dumps(job, tmp_path,
                                                                      monkeypatch):
    """``POST /v1/embeddings/clear`` lands while the API's checkpoint dumps the servers
    (some before it, some after, in the worst case): a clear counts in none of the training
    counters the cut compares, so the checkpoint was published as consistent. It fails."""
    from stream_persia.api import checkpoints as checkpoints_mod

    root = str(tmp_path / "ckpts")
    await job.train(2)
    real = checkpoints_mod.CheckpointWriter.dump_embeddings

    async def dump_then_clear(self, clients, **kw):
        out = await real(self, clients, **kw)
        for address in job.server_addresses:
            await job.client(address).call("clear")
        return out

    monkeypatch.setattr(checkpoints_mod.CheckpointWriter, "dump_embeddings", dump_then_clear)
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        r = await api.client.post("/v1/checkpoints", headers=AUTH)
        assert r.status_code == 202
        info = await wait_done(api, r.json()["id"])
        assert info["state"] == "failed" and "moved" in info["error"], info
        assert info["manifest"] is None and not os.path.exists(info["dst"])


async def test_named_checkpoints_stay_inside_the_directory(job, tmp_path):
    root = str(tmp_path / "ckpts")
    await job.train(2)
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": "before-x"})
        assert r.status_code == 202 and r.json()["dst"] == f"{root}/before-x"
        assert (await wait_done(api, "before-x"))["state"] == "done"
        r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": "before-x"})
        assert r.status_code == 409 and r.json()["error"]["field"] == "id"
        for bad in ("../escape", "/abs", ".hidden", "a/b", ""):
            r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": bad})
            assert r.status_code == 422, bad
            assert r.json()["error"]["field"] == "body.id"
        r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"dst": "/tmp/x"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "body.dst"
    assert sorted(os.listdir(root)) == ["before-x"]


async def test_checkpoint_routes_without_a_directory(job):
    async with LiveApi(settings_for(job)) as api:
        r = await api.client.post("/v1/checkpoints", headers=AUTH)
        assert r.status_code == 409 and r.json()["error"]["field"] == "checkpoint_dir"
        assert (await api.client.get("/v1/checkpoints", headers=AUTH)).json() == {
            "checkpoints": []}


async def test_restore_refuses_a_checkpoint_of_another_embedding_schema(job, tmp_path):
    """The checkpoint records the digest of the embedding schema its rows were trained
    with; a job started with another one refuses to restore it (409 naming what differs)
    and keeps its rows; the same schema restores."""
    root = str(tmp_path / "ckpts")
    await job.train(3)
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        info = await take_checkpoint(api, "c1")
    assert info["manifest"]["config_digest"] == config_digest(SCHEMA)
    await job.train(2, seed=5)
    before = rows_of(job)
    wider = copy.deepcopy(SCHEMA_DICT)
    wider["slots_config"]["user"]["dim"] = 16
    async with LiveApi(settings_for(job, checkpoint_dir=root,
                                    schema=EmbeddingSchema.from_dict(wider))) as api:
        r = await api.client.post("/v1/checkpoints/c1/restore", headers=AUTH)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["field"] == "config_digest"
        assert "checkpoint 'c1' was trained with another embedding config" in error["message"]
        assert "slot 'user' has dim 8 in the checkpoint, 16 here" in error["message"]
        assert config_digest(SCHEMA) in error["message"]
    got = rows_of(job)
    assert got.keys() == before.keys()
    for k, w in before.items():
        np.testing.assert_array_equal(got[k], w)
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        r = await api.client.post("/v1/checkpoints/c1/restore", headers=AUTH)
        assert r.status_code == 200, r.text
    assert len(rows_of(job)) == sum(info["manifest"]["files"][f]["rows"]
                                    for f in info["manifest"]["embedding_files"])


async def test_restore_refuses_while_an_nn_rank_trains(job, tmp_path):
    """An NN rank 0 that heartbeats (between two steps: nothing in flight) stops a restore
    (409) instead of training on with its own dense model over the restored rows; once
    the ranks stopped, the restore goes through."""
    root = str(tmp_path / "ckpts")
    await job.train(3)
    await write_checkpoint(job, f"{root}/c1", TwoHeads(), step=3)
    await job.train(2, seed=7)
    before = rows_of(job)
    box = job.workers[0].mailbox
    await box.nn_heartbeat({"rank": 0, "world_size": 1, "step": 5})
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        r = await api.client.post("/v1/checkpoints/c1/restore", headers=AUTH)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["field"] == "checkpoint"
        assert "while NN ranks train (rank 0 at step 5" in error["message"]
        assert "stop the NN workers" in error["hint"]
        got = rows_of(job)
        assert got.keys() == before.keys()
        for k, w in before.items():
            np.testing.assert_array_equal(got[k], w)
        await box.nn_detach({"rank": 0, "step": 5})
        r = await api.client.post("/v1/checkpoints/c1/restore", headers=AUTH)
        assert r.status_code == 200, r.text


async def test_one_restore_at_a_time_and_no_checkpoint_during_one(job, tmp_path):
    """While a restore runs, a second restore and a new checkpoint are refused (409) instead
    of interleaving with it: two restores both answered 200 while the servers ended with
    the rows of one of them (a newer staged load replaces an older one, which is then
    loaded again directly) and, for a Kafka stream, the workers perhaps with the offsets
    of the other; a checkpoint taken meanwhile could pair the restored rows with the stream
    position from before the restore. Two checkpoints started at once: one is refused."""
    root = str(tmp_path / "ckpts")
    await job.train(4)
    await write_checkpoint(job, f"{root}/a", TwoHeads(seed=1), step=1)
    want = rows_of(job)
    await job.train(4, seed=5)
    await write_checkpoint(job, f"{root}/b", TwoHeads(seed=2), step=2)
    gate = threading.Event()
    async with LiveApi(settings_for(job, checkpoint_dir=root, embeddings="local")) as api:
        # Server 0's store thread waits for the gate: restore a cannot finish before it.
        blocked = job.servers[0]._pool.submit(gate.wait, 30)
        calls = requests_to(job.servers[0])
        first = asyncio.create_task(
            api.client.post("/v1/checkpoints/a/restore", headers=AUTH))
        try:
            async with asyncio.timeout(20):   # restore a reached server 0: it is under way
                while requests_to(job.servers[0]) == calls:
                    await asyncio.sleep(0.01)
            r = await api.client.post("/v1/checkpoints/b/restore", headers=AUTH, timeout=10)
            assert r.status_code == 409, r.text
            assert "'a' is being restored" in r.json()["error"]["message"]
            r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": "during"},
                                      timeout=10)
            assert r.status_code == 409, r.text
            assert "'a' is being restored" in r.json()["error"]["message"]
        finally:
            gate.set()
            blocked.result(30)
        r = await first
        assert r.status_code == 200, r.text
        got = rows_of(job)
        assert got.keys() == want.keys()
        for k, w in want.items():
            np.testing.assert_array_equal(got[k], w)
        assert (await api.client.get("/v1/model")).json()["version"] == "a"
        # Two checkpoints started at once: one runs, the other is refused.
        replies = await asyncio.gather(*(
            api.client.post("/v1/checkpoints", headers=AUTH, json={"id": ident})
            for ident in ("x", "y")))
        assert sorted(r.status_code for r in replies) == [202, 409], [r.text for r in replies]
        started = next(r.json()["id"] for r in replies if r.status_code == 202)
        assert (await wait_done(api, started))["state"] == "done"
        # Restores again once nothing else runs.
        r = await api.client.post("/v1/checkpoints/b/restore", headers=AUTH)
        assert r.status_code == 200, r.text


@pytest.mark.kafka
async def test_api_cut_refuses_workers_that_mix_kafka_and_direct_ingest(kafka_broker,
                                                                        kafka_topic, tmp_path):
    """Worker 0 reads Kafka, worker 1 takes direct ingest: no checkpoint records one
    stream position for both (restoring it would lose or replay batches), so the cut is
    refused naming the workers of each kind, and nothing is published."""
    topic = kafka_topic(partitions=1)
    job = await start_job(n_workers=2)
    try:
        worker = job.workers[0]
        cfg = KafkaConfig(bootstrap_servers=kafka_broker.bootstrap_servers,
                          samples_topic=topic, dlq_topic=f"{topic}.dlq", job_name="mixed")
        await worker.start_kafka_ingest(lambda start: KafkaIngest(
            worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
            DeadLetterWriter.from_config(cfg), start_offsets=start))
        async with LiveApi(settings_for(job, checkpoint_dir=str(tmp_path / "ck"))) as api:
            r = await api.client.post("/v1/checkpoints", headers=AUTH)
            assert r.status_code == 202, r.text
            info = await wait_done(api, r.json()["id"])
        assert info["state"] == "failed" and info["manifest"] is None, info
        w0, w1 = job.worker_addresses
        assert (f"mix Kafka (embedding-worker-0 {w0}) and direct ingest "
                f"(embedding-worker-1 {w1})") in info["error"]
        assert not os.path.exists(info["dst"])
    finally:
        await stop_job(job)


async def _kafka_job(bootstrap: str, topic: str, batches: int):
    """A job (one server, one worker) fed from ``topic`` (1 partition, ``batches`` batches
    produced to it) that trained all of them."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for i in range(batches):
            await producer.send(topic, make_batch(i, seed=len(topic)).to_bytes(), partition=0)
        await producer.flush()
    finally:
        await producer.stop()
    job = await start_job(n_servers=1)
    worker = job.workers[0]
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name=topic)
    await worker.start_kafka_ingest(lambda start: KafkaIngest(
        worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
        DeadLetterWriter.from_config(cfg), start_offsets=start))
    client = job.client(worker.address)
    for _ in range(batches):
        served = await client.call("next_batch", {"timeout_ms": 10_000})
        await client.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": dict.fromkeys(SCHEMA.slots)})
    return job


@pytest.mark.kafka
async def test_restore_refuses_a_checkpoint_of_another_topic(kafka_broker, kafka_topic,
                                                             tmp_path):
    """A checkpoint of another job (same embedding schema, another samples topic) is
    refused (422 naming both topics) before anything changes: its offsets were applied
    to this job's partitions, so the workers replayed (or skipped) this topic from
    positions of another stream and the restore answered 200."""
    root = str(tmp_path / "ck")
    ours, theirs = kafka_topic(partitions=1), kafka_topic(partitions=1)
    other = await _kafka_job(kafka_broker.bootstrap_servers, theirs, 2)
    try:
        async with LiveApi(settings_for(other, checkpoint_dir=root)) as api:
            info = await take_checkpoint(api, "theirs")
        assert info["manifest"]["offsets"] == {theirs: {"0": 2}}
    finally:
        await stop_job(other)
    job = await _kafka_job(kafka_broker.bootstrap_servers, ours, 3)
    try:
        before = rows_of(job)
        worker = job.client(job.worker_addresses[0])
        frontier = (await worker.call("frontier", None))["offsets"]
        assert frontier == {"0": 3}
        async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
            r = await api.client.post("/v1/checkpoints/theirs/restore", headers=AUTH)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["field"] == "checkpoint"
            assert f"offsets are of topic {theirs!r}" in error["message"]
            assert f"reads {ours!r}" in error["message"]
        assert (await worker.call("frontier", None))["offsets"] == frontier
        got = rows_of(job)
        assert got.keys() == before.keys()
        for k, w in before.items():
            np.testing.assert_array_equal(got[k], w)
    finally:
        await stop_job(job)
