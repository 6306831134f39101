"""Issue 18, item 5: with training paused through the control plane and the stream drained,
a serving replica predicts what the trainer's ``eval_ctx`` does on the same rows (1e-6).

Real parts throughout: embedding servers and a worker on loopback, the control API and a
replica API (``embeddings="replica"``, started from a checkpoint of the same model class)
served by uvicorn, a ``TrainCtx`` training in a thread from ``DataLoader(StreamingDataset)``
and a feeder ingesting batches without end. ``POST /v1/ingest/pause`` holds the feeder's
``ingest`` (the pause of direct ingest); the trainer trains what was ingested and then
waits in its DataLoader, the context open and training not over. Publications due by step
count or time never come in this test: the dense model the replica holds at a pause is the
one the waiting DataLoader published (``TrainCtx.stream_idle``). Then training resumes and
pauses again, and the replica agrees once more.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import numpy as np
import pytest
import torch
from api_helpers import AUTH, Click, LiveApi, settings_for, start_job, stop_job, write_checkpoint

from stream_persia.config import ModelUpdatesConfig
from stream_persia.ctx import TrainCtx, eval_ctx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.data import PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.errors import Backpressure
from stream_persia.testing.samples import make_batch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Never due within this test: only an idle DataLoader publishes the dense model.
NEVER_DUE = ModelUpdatesConfig(dense_every_steps=1 << 30, dense_interval_ms=600_000)


def held_out() -> list[PersiaBatch]:
    """Rows never trained on (some ids never seen: vocab 70 over the stream's 50)."""
    out = []
    for i, size in enumerate((1, 9, 48)):
        b = make_batch(900 + i, batch_size=size, vocab=70, seed=5)
        out.append(PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                               requires_grad=False))
    return out


def body(b: PersiaBatch) -> dict:
    return {"id_type_features": {f.name: [x.tolist() for x in f.data]
                                 for f in b.id_type_features},
            "non_id_type_features": {f.name: f.data.tolist() for f in b.non_id_type_features}}


class Trainer:
    """A ``TrainCtx`` training in a thread until ``stop`` is set (looked at after each
    step), publishing the dense model to server 0 (``model_updates``)."""

    def __init__(self, worker: str, staleness: int):
        self.worker, self.staleness = worker, staleness
        self.stop = threading.Event()
        self.model = Click(seed=3)
        self.ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(self.model.parameters(), lr=0.05),
                            model=self.model, embedding_workers=[worker],
                            mixed_precision=False, ready_timeout_s=10,
                            model_updates=NEVER_DUE)

    def run(self) -> None:
        ctx = self.ctx
        with ctx:
            # a long timeout: a pause never ends the stream, only the test does
            for tb in DataLoader(StreamingDataset(), embedding_staleness=self.staleness,
                                 timeout_ms=120_000):
                output, labels = ctx.forward(tb)
                ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
                if self.stop.is_set():
                    break

    def evaluate(self, batches: list[PersiaBatch]) -> list[np.ndarray]:
        """``eval_ctx`` over the trainer's model as it is now (the trainer waits for a
        batch: nothing changes it meanwhile)."""
        model = copy.deepcopy(self.ctx.raw_model).eval()
        with eval_ctx(model=model, embedding_workers=[self.worker], ready_timeout_s=10) as e, \
                torch.no_grad():
            return [e.forward(e.get_embedding_from_data(b))[0].numpy().ravel()
                    for b in batches]


class Feeder:
    """Ingests batches into worker 0 without end, as a producer does: an ``ingest`` that
    the worker holds for a second (paused, or its buffer full) is refused (``Backpressure``)
    and sent again."""

    def __init__(self, job: Any):
        self.client = job.client(job.workers[0].address)
        self.ingested = 0
        self.refused = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batch = make_batch(self.ingested, seed=2)
            try:
                await self.client.call("ingest", {"batch": batch.to_wire(),
                                                  "timeout_ms": 1000}, timeout_ms=5000)
            except Backpressure:
                self.refused += 1
                continue
            self.ingested += 1


async def until(cond, what: str, run: asyncio.Future, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await cond():
            if run.done():
                run.result()          # the trainer's error
                raise AssertionError(f"the trainer stopped before {what}")
            await asyncio.sleep(0.02)


async def check_paused(control: LiveApi, replica: LiveApi, job: Any, trainer: Trainer,
                       feeder: Feeder, run: asyncio.Future) -> tuple[int, list[np.ndarray]]:
    """Pause, drain, and compare the replica with ``eval_ctx``; returns the step and the
    predictions."""
    r = await control.client.post("/v1/ingest/pause", headers=AUTH)
    assert r.status_code == 200 and r.json()["ingest_paused"] is True, r.text
    worker = job.client(job.workers[0].address)
    ctx = trainer.ctx

    async def drained() -> bool:      # everything ingested was trained and applied
        st = await worker.call("status")
        return (st["ready"] == st["inflight"] == 0
                and feeder.ingested == ctx.steps == ctx.pushed)

    await until(drained, "the stream drained", run)
    steps = ctx.steps
    refused = feeder.refused
    await asyncio.sleep(1.2)          # the feeder's ingest is held, then refused
    assert (feeder.ingested, ctx.steps) == (steps, steps), "the pause held nothing back"
    assert feeder.refused > refused and not feeder.task.done()
    assert ctx.dense_publisher is not None

    want = await asyncio.to_thread(trainer.evaluate, held_out())
    versions = [s.store.change_version for s in job.servers]
    info: dict = {}

    async def replica_caught_up() -> bool:
        nonlocal info
        info = (await replica.client.get("/v1/model")).json()
        return ([sh["version"] for sh in info["replica"]["shards"]] == versions
                and info["model_version"] == steps)

    try:
        await until(replica_caught_up, f"the replica served step {steps}", run, timeout_s=20)
    except TimeoutError:
        raise AssertionError(f"the replica did not catch up with the paused trainer at step "
                             f"{steps} (shards {versions}): it serves dense version "
                             f"{info['model_version']}, shards "
                             f"{[sh['version'] for sh in info['replica']['shards']]}") from None
    assert [s.store.change_version for s in job.servers] == versions   # still paused
    for b, w in zip(held_out(), want, strict=True):
        r = await replica.client.post("/v1/predict", json=body(b))
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["model_version"] == steps
        got = np.array([p["output"] for p in j["predictions"]], dtype=np.float64).ravel()
        np.testing.assert_allclose(got, w, atol=1e-6, rtol=0)
    return steps, want


@pytest.mark.parametrize(("staleness", "n_servers"), [(1, 1), (1, 2), (8, 1), (8, 2)])
async def test_a_paused_replica_predicts_what_the_trainer_evaluates(tmp_path, staleness,
                                                                   n_servers):
    job = await start_job(n_servers=n_servers)
    trainer = Trainer(job.workers[0].address, staleness)
    feeder: Feeder | None = None
    run: asyncio.Future | None = None
    try:
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c0"), Click(seed=3))
        async with LiveApi(settings_for(job)) as control, \
                LiveApi(settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                     checkpoint_dir=str(tmp_path / "ckpts"))) as replica:
            run = asyncio.get_running_loop().run_in_executor(None, trainer.run)
            feeder = Feeder(job)

            async def trained(n: int):
                async def cond() -> bool:
                    return trainer.ctx.steps >= n
                return cond

            await until(await trained(12), "12 steps", run)
            first, before = await check_paused(control, replica, job, trainer, feeder, run)
            r = await control.client.post("/v1/ingest/resume", headers=AUTH)
            assert r.status_code == 200 and r.json()["ingest_paused"] is False, r.text
            await until(await trained(first + 7), f"step {first + 7}", run)
            second, after = await check_paused(control, replica, job, trainer, feeder, run)
            assert second > first
            # training between the pauses moved the predictions: the agreement is no accident
            assert max(np.abs(a - b).max() for a, b in zip(after, before, strict=True)) > 1e-4
            # the publications were the idle ones (none was due): one per pause at least
            assert trainer.ctx.dense_publisher.stats()["published"] >= 2

            trainer.stop.set()        # trains one more batch after the resume, then ends
            r = await control.client.post("/v1/ingest/resume", headers=AUTH)
            assert r.status_code == 200, r.text
            await asyncio.wait_for(run, 30)
    finally:
        trainer.stop.set()
        if run is not None and not run.done():
            # a failed test's trainer waits for a batch: let the feeder in once more
            await job.client(job.workers[0].address).call("resume_ingest")
            await asyncio.wait_for(run, 60)
        if feeder is not None:
            feeder.task.cancel()
            await asyncio.gather(feeder.task, return_exceptions=True)
        await stop_job(job)
