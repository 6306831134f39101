"""A checkpoint started over HTTP while training runs (Kafka stream, ``TrainCtx``) restores
to a job that continues with no sample lost or repeated.

The NN rank polls the checkpoint mailbox between steps (``NnCheckpointPoller``) and takes
the cut with ``dump_checkpoint`` at its next step boundary. The job then trains on and
dies; a new job with a different number of embedding servers is restored over HTTP
(servers load, the worker replays the topic from the manifest's offsets) and a new NN
rank, starting from the checkpoint's dense model, trains until the stream is drained.
Every sample is trained exactly once across the two runs, counting only the first run's
steps before the cut.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from api_helpers import AUTH, Click, LiveApi, settings_for, start_job, stop_job

from api.checkpoints import Checkpoints
from api.mailbox import CheckpointMailbox, MailboxClient, NnCheckpointPoller
from stream_persia.checkpoint import load_torch, read_manifest
from stream_persia.config import KafkaConfig
from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import SGD
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.rpc import RpcClient, RpcServer
from stream_persia.testing.samples import make_batch
from stream_persia.worker.ingest import KafkaIngest

N_BATCHES = 40
AFTER_CUT = 5

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def attach_kafka(worker, bootstrap: str, topic: str) -> None:
    """Feed ``worker`` from ``topic`` as ``launch embedding-worker --kafka`` does."""
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="apitest")

    def make(start_offsets):
        return KafkaIngest(worker, SampleConsumer.from_config(cfg, replica_index=0,
                                                              replica_size=1),
                           DeadLetterWriter.from_config(cfg), start_offsets=start_offsets)

    worker.kafka_factory = make
    worker.kafka = make(None)
    await worker.kafka.start()


def train(worker: str, metas: list, *, mailbox: str | None = None, dense_from: str | None = None,
          step_delay_s: float = 0.0, idle_timeout_ms: int = 3000,
          final_dst: str | None = None) -> dict:
    model = Click(seed=7)
    if dense_from is not None:
        model.load_state_dict(load_torch(dense_from, "dense.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    taken, after = None, None
    with TrainCtx(SGD(lr=0.1), opt, model=model, embedding_workers=[worker],
                  mixed_precision=False, ready_timeout_s=10) as ctx:
        poller = NnCheckpointPoller(ctx, mailbox) if mailbox else None
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2,
                             timeout_ms=idle_timeout_ms):
            metas.append(tb.meta)
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            time.sleep(step_delay_s)
            if poller is not None:
                ident = poller.step_boundary()
                if ident is not None:
                    taken, after = ident, 0
                elif after is not None:
                    after += 1
                    if after == AFTER_CUT:
                        break
        if poller is not None:
            poller.close()
        if final_dst is not None:      # train.py's own checkpoint at the end of its run
            ctx.dump_checkpoint(final_dst, with_jit_model=True)
    return {"taken": taken, "dense": {k: v.clone() for k, v in model.state_dict().items()}}


async def test_http_checkpoint_while_training_restores_exactly_once(kafka_topic, kafka_broker,
                                                                   tmp_path):
    topic = kafka_topic(partitions=2)
    bootstrap = kafka_broker.bootstrap_servers
    root = str(tmp_path / "ckpts")
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        for i in range(N_BATCHES):
            await producer.send(make_batch(i), key=i)
    everything = sorted(make_batch(i).meta for i in range(N_BATCHES))

    # ---- first run: train, checkpoint over HTTP mid-way, train on, die
    job = await start_job(n_servers=2)
    mailbox = RpcServer(CheckpointMailbox().handlers(), name="mailbox")
    await mailbox.start()
    mailbox_client = RpcClient(mailbox.address, timeout_ms=5000)

    def checkpoints(settings, roles, predictor):
        return Checkpoints(settings, roles, predictor,
                           mailbox=MailboxClient(mailbox_client.call))

    metas_a: list[bytes] = []
    try:
        await attach_kafka(job.workers[0], bootstrap, topic)
        async with LiveApi(settings_for(job, checkpoint_dir=root),
                           checkpoints_factory=checkpoints) as api:
            loop = asyncio.get_running_loop()
            run_a = loop.run_in_executor(None, lambda: train(
                job.worker_addresses[0], metas_a, mailbox=mailbox.address,
                step_delay_s=0.02))
            async with asyncio.timeout(60):
                while len(metas_a) < 8:
                    await asyncio.sleep(0.01)
                status = (await api.client.get("/v1/status", headers=AUTH)).json()
                assert status["training"]["nn_attached"] is True
                assert status["training"]["step"] >= 1
                assert set(status["consumer_lag"]) == {"0", "1"}     # per partition
                assert status["workers"][0]["kafka"]["topic"] == topic
                r = await api.client.post("/v1/checkpoints", headers=AUTH)
                assert r.status_code == 202, r.text
                ident = r.json()["id"]
                while True:
                    info = (await api.client.get(f"/v1/checkpoints/{ident}",
                                                 headers=AUTH)).json()
                    if info["state"] in ("done", "failed"):
                        break
                    await asyncio.sleep(0.05)
                result_a = await run_a
            assert info["state"] == "done", info
            assert info["by"] == "nn" and result_a["taken"] == ident
            manifest = info["manifest"]
            cut = manifest["step"]
            assert manifest["stream"] == "kafka" and manifest["offsets"][topic]
            assert 8 <= cut < N_BATCHES - AFTER_CUT
            assert len(metas_a) == cut + AFTER_CUT     # it trained on past the cut
            listed = (await api.client.get("/v1/checkpoints", headers=AUTH)).json()
            assert [c["id"] for c in listed["checkpoints"]] == [ident]
    finally:
        await mailbox_client.close()
        await mailbox.stop()
        await stop_job(job)

    # ---- second run: 3 servers, restored over HTTP, trains until the stream is drained
    job = await start_job(n_servers=3)
    metas_b: list[bytes] = []
    try:
        await attach_kafka(job.workers[0], bootstrap, topic)   # starts from the beginning
        async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
            r = await api.client.post(f"/v1/checkpoints/{ident}/restore", headers=AUTH,
                                      json={"reload_model": False})
            assert r.status_code == 200, r.text
            restored = r.json()
            assert restored["workers_reset"] == 1
            assert restored["offsets"] == manifest["offsets"][topic]
            assert restored["rows"] == sum(len(s.store) for s in job.servers) > 0
            result_b = await asyncio.get_running_loop().run_in_executor(None, lambda: train(
                job.worker_addresses[0], metas_b, dense_from=f"{root}/{ident}",
                final_dst=f"{root}/final"))
            # Nothing trains any more: a checkpoint over HTTP is taken by the API, at the
            # same stream position as train.py's last one, whose dense model it carries.
            r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": "rest"})
            assert r.status_code == 202, r.text
            async with asyncio.timeout(30):
                while (info := (await api.client.get("/v1/checkpoints/rest",
                                                     headers=AUTH)).json())["state"] in (
                        "pending", "running"):
                    await asyncio.sleep(0.05)
            assert info["state"] == "done" and info["by"] == "api", info
            final = read_manifest(f"{root}/final")
            assert info["manifest"]["extra"]["dense_from"] == "final"
            assert info["manifest"]["offsets"] == final.offsets
            assert info["manifest"]["step"] == final.step
            assert info["manifest"]["jit_filename"] == "jit_dense.pt"
    finally:
        await stop_job(job)

    trained = metas_a[:cut] + metas_b
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained) == everything, "a sample was lost"
    assert any(not torch.equal(result_b["dense"][k], v)
               for k, v in load_torch(f"{root}/{ident}", "dense.pt").items())
    assert np.isfinite([v.sum().item() for v in result_b["dense"].values()]).all()
