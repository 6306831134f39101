"""Over HTTP: an embedding server restarted mid-job refuses every checkpoint, and a restore
of the last one brings the job back (it is the way back), training every batch once.

An embedding server and worker pair (Kafka stream, real sockets) in this process; the NN
side is played over RPC (``next_batch`` / ``push_gradients``). Server 1 is replaced by a
fresh process at its address while a batch is in flight, whose push then fails: the
worker holds a failed batch and a lost server, which refuse ``POST /v1/checkpoints`` but
not ``POST /v1/checkpoints/{id}/restore``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from api_helpers import AUTH, LiveApi, settings_for, start_job, stop_job

from stream_persia.config import KafkaConfig
from stream_persia.errors import ServerRestarted
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.rpc import RpcClient
from stream_persia.testing.pytest_plugin import TANSU_LIST_OFFSETS, deviates_on
from stream_persia.testing.samples import make_batch
from stream_persia.testing.servers import restarted
from stream_persia.worker.ingest import KafkaIngest

N, CUT = 8, 3

pytestmark = pytest.mark.kafka


def grads_for(served: dict) -> dict[str, np.ndarray]:
    i = int(bytes(served["meta"]).split(b"-")[1])
    return {e["name"]: (0.1 * e["emb"] + 0.01 * (i + 1)).astype(np.float32)
            for e in served["embeddings"]}


async def train(client: RpcClient, n: int, metas: list[bytes]) -> None:
    for _ in range(n):
        served = await client.call("next_batch", {"timeout_ms": 10_000})
        assert served is not None
        await client.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": grads_for(served)})
        metas.append(bytes(served["meta"]))


def snapshot(server) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for chunk in server.store.dump():
        for i, x in enumerate(chunk["ids"].tolist()):
            out[x] = (chunk["weights"][i].copy(), chunk["state"][i].copy())
    return out


async def wait_done(api: LiveApi, ident: str) -> dict:
    async with asyncio.timeout(30):
        while True:
            info = (await api.client.get(f"/v1/checkpoints/{ident}", headers=AUTH)).json()
            if info["state"] in ("done", "failed"):
                return info
            await asyncio.sleep(0.05)


@deviates_on("tansu", TANSU_LIST_OFFSETS)
async def test_a_restarted_server_refuses_checkpoints_and_a_restore_brings_the_job_back(
        kafka_broker, kafka_topic, tmp_path):
    topic = kafka_topic(partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        for i in range(N):
            await producer.send(make_batch(i), key=i)

    reference = await start_job(n_servers=2)        # every batch once, in order, no fault
    try:
        async with RpcClient(reference.workers[0].address) as c:
            for i in range(N):
                await c.call("ingest", {"batch": make_batch(i).to_wire()})
                await train(c, 1, [])
        want = [snapshot(s) for s in reference.servers]
    finally:
        await stop_job(reference)

    job = await start_job(n_servers=2)
    worker = job.workers[0]
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="apirestart")
    await worker.start_kafka_ingest(lambda start: KafkaIngest(
        worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
        DeadLetterWriter.from_config(cfg), start_offsets=start))
    client = job.client(worker.address)
    client.timeout_ms = 20_000
    try:
        async with LiveApi(settings_for(job, checkpoint_dir=str(tmp_path / "ckpts"))) as api:
            metas: list[bytes] = []
            await train(client, CUT, metas)
            r = await api.client.post("/v1/checkpoints", headers=AUTH)
            assert r.status_code == 202, r.text
            ident = r.json()["id"]
            assert (await wait_done(api, ident))["state"] == "done"
            await train(client, 2, metas)
            served = await client.call("next_batch", {"timeout_ms": 10_000})

            await job.servers[1].stop()
            fresh = job.servers[1] = restarted(job.servers[1])
            await fresh.start()
            with pytest.raises(ServerRestarted):
                await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                     "grads": grads_for(served)})
            status = (await api.client.get("/v1/status", headers=AUTH)).json()
            assert fresh.address in str(status)
            r = await api.client.post("/v1/checkpoints", headers=AUTH)
            info = await wait_done(api, r.json()["id"])
            assert info["state"] == "failed" and fresh.address in info["error"], info

            r = await api.client.post(f"/v1/checkpoints/{ident}/restore", headers=AUTH,
                                      json={"reload_model": False})
            assert r.status_code == 200, r.text
            assert r.json()["workers_reset"] == 1
            assert (await client.call("health"))["ok"] is True
            rest: list[bytes] = []
            await train(client, N - CUT, rest)
        assert metas[:CUT] + rest == [f"batch-{i}".encode() for i in range(N)]
        for server, expected in zip(job.servers, want, strict=True):
            got = snapshot(server)
            assert got.keys() == expected.keys()
            for x, (w, s) in expected.items():
                np.testing.assert_allclose(got[x][0], w, atol=1e-6, rtol=0)
                np.testing.assert_allclose(got[x][1], s, atol=1e-6, rtol=0)
    finally:
        await stop_job(job)
