"""A checkpoint started over HTTP while training runs (Kafka stream, ``TrainCtx``) restores
to a job that continues with no sample lost or repeated.

The request reaches the NN rank through the checkpoint mailbox on embedding worker 0,
which ``TrainCtx`` polls after every ``backward``; the rank takes the cut with
``dump_checkpoint`` at its next step boundary (``by: nn``). The job then trains on and
dies; a new job with a different number of embedding servers is restored over HTTP
(servers load, the worker replays the topic from the manifest's offsets) and a new NN
rank, starting from the checkpoint's dense model, trains until the stream is drained.
Every sample is trained exactly once across the two runs, counting only the first run's
steps before the cut.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from api_helpers import AUTH, Click, LiveApi, settings_for, start_job, stop_job
from stream_persia.api.checkpoints import Checkpoints

from stream_persia.checkpoint import load_torch, read_manifest
from stream_persia.config import KafkaConfig
from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import SGD
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.rpc import RpcClient
from stream_persia.testing.pytest_plugin import TANSU_LIST_OFFSETS, deviates_on
from stream_persia.testing.samples import make_batch
from stream_persia.worker.ingest import KafkaIngest

N_BATCHES = 40
AFTER_CUT = 5
INPUTS = {"id_type_features": ["user", "item", "tags"],
          "non_id_type_features": [{"name": "dense", "dtype": "float32", "shape": [3]}]}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def attach_kafka(worker, bootstrap: str, topic: str) -> None:
    """Feed ``worker`` from ``topic`` as ``launch embedding-worker --kafka`` does."""
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="apitest")

    def make(start_offsets):
        return KafkaIngest(worker, SampleConsumer.from_config(cfg, replica_index=0,
                                                              replica_size=1),
                           DeadLetterWriter.from_config(cfg), start_offsets=start_offsets)

    await worker.start_kafka_ingest(make)


def train(worker: str, metas: list, *, dense_from: str | None = None,
          step_delay_s: float = 0.0, idle_timeout_ms: int = 3000,
          final_dst: str | None = None, stop_after_cut: bool = False) -> dict:
    model = Click(seed=7)
    if dense_from is not None:
        model.load_state_dict(load_torch(dense_from, "dense.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    taken, after = None, None
    with TrainCtx(SGD(lr=0.1), opt, model=model, embedding_workers=[worker],
                  mixed_precision=False, ready_timeout_s=10) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2,
                             timeout_ms=idle_timeout_ms):
            metas.append(tb.meta)
            output, labels = ctx.forward(tb)
            # A checkpoint started over HTTP is taken inside backward, after this step.
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            time.sleep(step_delay_s)
            if after is not None:
                after += 1
                if after == AFTER_CUT:
                    break
            elif ctx.checkpoint_poller.taken and stop_after_cut:
                taken, after = ctx.checkpoint_poller.taken[0], 0
        if final_dst is not None:      # train.py's own checkpoint at the end of its run
            ctx.dump_checkpoint(final_dst, with_jit_model=True)
    return {"taken": taken, "dense": {k: v.clone() for k, v in model.state_dict().items()}}


@deviates_on("tansu", TANSU_LIST_OFFSETS)
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
    metas_a: list[bytes] = []
    try:
        await attach_kafka(job.workers[0], bootstrap, topic)
        async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
            loop = asyncio.get_running_loop()
            run_a = loop.run_in_executor(None, lambda: train(
                job.worker_addresses[0], metas_a, step_delay_s=0.08, stop_after_cut=True))
            async with asyncio.timeout(60):
                while len(metas_a) < 8:
                    await asyncio.sleep(0.01)
                # Rank 0's heartbeats (every ~0.5 s, in the background) carry its step.
                while not (status := (await api.client.get("/v1/status", headers=AUTH)
                                      ).json())["training"]["step"]:
                    await asyncio.sleep(0.05)
                assert status["training"]["nn_attached"] is True
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
            # What the model was trained with, in order, for serving to match by name;
            # and the servers' configuration, for a restore into fresh servers.
            assert manifest["extra"]["inputs"] == INPUTS
            assert manifest["server_config"]["optimizer"] == SGD(lr=0.1).to_dict()
            cut = manifest["step"]
            assert manifest["stream"] == "kafka" and manifest["offsets"][topic]
            assert 8 <= cut < N_BATCHES - AFTER_CUT
            assert len(metas_a) == cut + AFTER_CUT     # it trained on past the cut
            listed = (await api.client.get("/v1/checkpoints", headers=AUTH)).json()
            assert [(c["id"], c["by"]) for c in listed["checkpoints"]] == [(ident, "nn")]
    finally:
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
            assert final.extra["inputs"] == info["manifest"]["extra"]["inputs"] == INPUTS
            # The dense model's event time comes with it: a serving replica restored from
            # this checkpoint starts trained through it (it had none, and a replica that
            # started from it never advanced: run's bootstrap checkpoint taken by the API
            # after a short run's NN worker had ended)
            assert final.extra["trained_through"] is not None
            assert info["manifest"]["extra"]["trained_through"] == \
                final.extra["trained_through"]
            # and the order of its labels, which a restore of it trains them in
            assert final.extra["label_names"] is not None
            assert info["manifest"]["extra"]["label_names"] == final.extra["label_names"]
    finally:
        await stop_job(job)

    trained = metas_a[:cut] + metas_b
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained) == everything, "a sample was lost"
    assert any(not torch.equal(result_b["dense"][k], v)
               for k, v in load_torch(f"{root}/{ident}", "dense.pt").items())
    assert np.isfinite([v.sum().item() for v in result_b["dense"].values()]).all()


async def test_http_checkpoint_reaches_two_ddp_ranks_at_the_same_step(tmp_path):
    """Two NN ranks (DDP, gloo; ``launch nn-worker``) take the checkpoint at one step."""
    here = Path(__file__).resolve().parent
    n = 60
    root = str(tmp_path / "ckpts")
    job = await start_job(n_servers=2)
    proc = feeding = None
    try:
        async def feed() -> None:   # ingest waits while the ready buffer is full
            async with RpcClient(job.workers[0].address, timeout_ms=70_000) as worker:
                for i in range(n):
                    await worker.call("ingest", {"batch": make_batch(i).to_wire(),
                                                 "timeout_ms": 60_000})

        feeding = asyncio.create_task(feed())
        env = {**os.environ, "PERSIA_EMBEDDING_WORKERS": ",".join(job.worker_addresses),
               "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
        async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "stream_persia.launch.cli", "launch", "nn-worker",
                "--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0",
                str(here / "ddp_checkpoint_train.py"), "--", str(tmp_path), env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            async with asyncio.timeout(60):
                while not ((status := (await api.client.get("/v1/status", headers=AUTH)
                                       ).json())["training"] or {}).get("step"):
                    assert proc.returncode is None, (await proc.stdout.read())[-4000:]
                    await asyncio.sleep(0.05)
                assert status["training"]["nn_attached"] is True
                r = await api.client.post("/v1/checkpoints", headers=AUTH)
                assert r.status_code == 202, r.text
                ident = r.json()["id"]
                while (info := (await api.client.get(f"/v1/checkpoints/{ident}",
                                                     headers=AUTH)).json())["state"] not in (
                        "done", "failed"):
                    await asyncio.sleep(0.05)
                output = await proc.stdout.read()
                assert await proc.wait() == 0, output[-4000:].decode(errors="replace")
            await feeding
        assert info["state"] == "done" and info["by"] == "nn", info
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["taken"] == ranks[1]["taken"] == [ident]
        assert ranks[0]["taken_at"] == ranks[1]["taken_at"] == info["manifest"]["step"]
        assert ranks[0]["steps"] == ranks[1]["steps"]
        # Every batch trained once, or handed back when the ranks agreed to stop.
        assert ranks[0]["steps"] + ranks[1]["steps"] + len(job.workers[0].ready) == n
        assert len(job.workers[0].inflight) == 0
        assert info["manifest"]["extra"]["world_size"] == 2
        dense = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
        assert all(torch.equal(dense[0][k], dense[1][k]) for k in dense[0])
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if feeding is not None and not feeding.done():
            feeding.cancel()
        await stop_job(job)


async def test_a_checkpoint_whose_nn_rank_is_killed_while_taking_it_fails_in_seconds(
        tmp_path):
    """NN rank 0 takes the checkpoint, is slow to save its dense model (it keeps reporting,
    so the checkpoint stays running past the report limit), then is killed: the checkpoint
    fails within the limit naming what happened, and the next one is taken by the API."""
    here = Path(__file__).resolve().parent
    root = str(tmp_path / "ckpts")
    limit_s = 2.0
    job = await start_job(n_servers=2)
    proc = feeding = None

    async def feed() -> None:   # ingest waits while the ready buffer is full
        async with RpcClient(job.workers[0].address, timeout_ms=130_000) as worker:
            for i in range(400):
                await worker.call("ingest", {"batch": make_batch(i).to_wire(),
                                             "timeout_ms": 120_000})

    def ckpts(settings, roles, predictor) -> Checkpoints:
        return Checkpoints(settings, roles, predictor, report_timeout_s=limit_s)

    try:
        feeding = asyncio.create_task(feed())
        env = {**os.environ, "PERSIA_EMBEDDING_WORKERS": ",".join(job.worker_addresses)}
        async with LiveApi(settings_for(job, checkpoint_dir=root),
                           checkpoints_factory=ckpts) as api:
            async def info_of(ident: str) -> dict:
                return (await api.client.get(f"/v1/checkpoints/{ident}", headers=AUTH)).json()

            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(here / "slow_checkpoint_train.py"), str(tmp_path), "600",
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            async with asyncio.timeout(60):
                while not ((await api.client.get("/v1/status", headers=AUTH)
                            ).json()["training"] or {}).get("step"):
                    assert proc.returncode is None, (await proc.stdout.read())[-4000:]
                    await asyncio.sleep(0.05)
                r = await api.client.post("/v1/checkpoints", headers=AUTH)
                assert r.status_code == 202, r.text
                ident = r.json()["id"]
                while not (tmp_path / "in_dump").exists():
                    assert proc.returncode is None, (await proc.stdout.read())[-4000:]
                    await asyncio.sleep(0.05)
            # Slow but alive: rank 0's keepalives hold it running well past the limit.
            loop = asyncio.get_running_loop()
            until = loop.time() + 3 * limit_s
            while loop.time() < until:
                info = await info_of(ident)
                assert info["state"] == "running" and info["by"] == "nn", info
                await asyncio.sleep(0.1)
            assert info["progress"]["phase"] == "writing the dense model"

            proc.kill()
            await proc.wait()
            killed = loop.time()
            async with asyncio.timeout(30):
                while (info := await info_of(ident))["state"] == "running":
                    await asyncio.sleep(0.05)
            waited_s = loop.time() - killed
            assert info["state"] == "failed", info
            assert info["error"].startswith(
                f"NN rank 0 stopped reporting while taking checkpoint {ident} (last report "
                ), info
            assert f"at step {info['step']};" in info["error"] and info["step"] > 0
            assert waited_s < limit_s + 2, waited_s
            status = (await api.client.get("/v1/status", headers=AUTH)).json()
            assert status["training"]["nn_attached"] is False
            # Nothing trains any more, and the mailbox is free: the API takes the next one.
            r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": "after"})
            assert r.status_code == 202, r.text
            async with asyncio.timeout(30):
                while (info := await info_of("after"))["state"] in ("pending", "running"):
                    await asyncio.sleep(0.05)
            assert info["state"] == "done" and info["by"] == "api", info
            assert read_manifest(f"{root}/after").extra["embeddings_only"] is True
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if feeding is not None:
            feeding.cancel()
            await asyncio.gather(feeding, return_exceptions=True)
        await stop_job(job)
