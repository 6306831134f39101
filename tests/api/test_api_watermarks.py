"""Stage watermarks and NN rank 0's relayed figures on ``GET /v1/status`` and ``/metrics``,
against real embedding servers and a worker (stream_persia.core.stages,
stream_persia.worker.nn_relay): a batch's event time goes through ingest (``ingested``), the
servers' applied updates (``applied``) and NN rank 0's heartbeat (``trained``, progressive);
a bad heartbeat is refused naming the field; a real TrainCtx relays its figures."""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
import pytest
import torch
from api_helpers import (
    AUTH,
    Click,
    LiveApi,
    TwoHeads,
    publish_dense,
    settings_for,
    start_job,
    stop_job,
    write_checkpoint,
)
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import SGD
from stream_persia.errors import BadInput
from stream_persia.testing.samples import make_batch

T0 = 1_700_000_000.0
FIGURES = {"window": 1000, "samples": 640, "auc": 0.71, "ne": 0.93, "lifetime_ne": 0.95,
           "calibration": 1.02, "lifetime_calibration": 0.98, "log_loss": 0.55,
           "lifetime_log_loss": 0.57}


async def _train(job, times: list[float]) -> None:
    worker = job.client(job.workers[0].address)
    rng = np.random.default_rng(0)
    for i, t in enumerate(times):
        await worker.call("ingest", {"batch": make_batch(i).stamped(t).to_wire()})
        served = await worker.call("next_batch", {"timeout_ms": 2000})
        grads = {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
                 for e in served["embeddings"]}
        await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": grads, "timeout_ms": 5000})


async def test_status_and_metrics_carry_every_stage_and_the_relayed_figures(job):
    await _train(job, [T0 + 1, T0 + 3, T0 + 2])
    worker = job.client(job.workers[0].address)
    # One more batch ingested but not trained: ingested runs ahead of applied.
    await worker.call("ingest", {"batch": make_batch(9).stamped(T0 + 9).to_wire()})
    await worker.call("nn_heartbeat", {"rank": 0, "world_size": 1, "step": 3,
                                       "trained": T0 + 3, "progressive": {"ctr": FIGURES}})
    async with LiveApi(settings_for(job)) as api:
        before = time.time()
        r = await api.client.get("/v1/status", headers=AUTH)
        assert r.status_code == 200, r.text
        marks = r.json()["watermarks"]
        text = (await api.client.get("/metrics")).text
    assert marks["ingested"]["event_time"] == T0 + 9
    assert marks["trained"]["event_time"] == T0 + 3
    assert marks["applied"]["event_time"] == T0 + 3     # the slowest server's
    assert marks["produced"] is None and marks["served"] is None   # no Kafka, no replica
    assert marks["kafka_lag"] == []
    assert marks["applied"]["lag_s"] >= before - (T0 + 3)
    assert marks["progressive"] == {"ctr": FIGURES}
    assert r.json()["workers"][0]["kafka"] is None

    families = {f.name: f for f in text_string_to_metric_families(text)}
    stage = {(s.labels["role"], s.labels["replica"], s.labels["stage"]): s.value
             for s in families["persia_stage_event_time_seconds"].samples}
    assert stage == {("embedding-worker", "0", "ingested"): T0 + 9,
                     ("embedding-worker", "0", "trained"): T0 + 3,
                     ("embedding-server", "0", "applied"): T0 + 3,
                     ("embedding-server", "1", "applied"): T0 + 3}
    lags = {s.labels["stage"]: s.value for s in families["persia_stage_lag_seconds"].samples}
    assert lags["ingested"] >= before - (T0 + 9)
    auc = families["persia_nn_progressive_auc_ratio"].samples
    assert [(s.labels["task"], s.labels["role"], s.value) for s in auc] == [
        ("ctr", "embedding-worker", 0.71)]
    ne = {s.labels["window"]: s.value for s in families["persia_nn_progressive_ne_ratio"].samples}
    assert ne == {"windowed": 0.93, "lifetime": 0.95}
    cal = {s.labels["window"]: s.value
           for s in families["persia_nn_progressive_calibration_ratio"].samples}
    assert cal == {"windowed": 1.02, "lifetime": 0.98}
    ll = {s.labels["window"]: s.value
          for s in families["persia_nn_progressive_log_loss_nats"].samples}
    assert ll == {"windowed": 0.55, "lifetime": 0.57}
    samples = families["persia_nn_progressive_samples"]
    assert samples.type == "counter" and [s.value for s in samples.samples
                                          if s.name.endswith("_total")] == [640.0]
    age = families["persia_nn_heartbeat_age_seconds"].samples
    assert len(age) == 1 and 0 <= age[0].value < 60
    assert [s.value for s in families["persia_nn_heartbeat_seen"].samples] == [1.0]


async def test_no_sample_before_any_watermark(job):
    async with LiveApi(settings_for(job)) as api:
        marks = (await api.client.get("/v1/status", headers=AUTH)).json()["watermarks"]
        text = (await api.client.get("/metrics")).text
    assert all(marks[s] is None for s in ("produced", "ingested", "trained", "applied",
                                          "served"))
    assert "persia_stage_event_time_seconds" not in text
    assert "persia_nn_progressive" not in text
    assert "persia_nn_heartbeat_age_seconds" not in text
    # No heartbeat yet: worker 0 says so (PersiaNNNeverReported fires on it), where a
    # missing age alone could not tell "never heard" from "not scraped".
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in families["persia_nn_heartbeat_seen"].samples] == [0.0]


@pytest.mark.parametrize("extra, field", [
    ({"trained": float("nan")}, "trained"),
    ({"trained": "soon"}, "trained"),
    ({"progressive": [1]}, "progressive"),
    ({"progressive": {f"t{i}": {} for i in range(65)}}, "progressive"),
    ({"progressive": {"x" * 129: {}}}, "progressive"),
    ({"progressive": {"ctr": {"auc": float("inf")}}}, "progressive.ctr.auc"),
    ({"progressive": {"ctr": {"auc": True}}}, "progressive.ctr.auc"),
    ({"progressive": {"ctr": {"samples": -1}}}, "progressive.ctr.samples"),
    ({"progressive": {"ctr": {"aucc": 0.5}}}, "progressive.ctr.aucc"),
    ({"progressive": {"ctr": 0.5}}, "progressive.ctr"),
])
async def test_a_bad_heartbeat_is_refused_naming_the_field(job, extra, field):
    worker = job.client(job.workers[0].address)
    with pytest.raises(BadInput) as err:
        await worker.call("nn_heartbeat", {"rank": 0, "world_size": 1, "step": 1, **extra})
    assert err.value.field == field
    assert await worker.call("nn_status") is None    # nothing recorded


class _Logits(Click):
    """Click's output stretched past [0, 1] (logits, as a BCEWithLogitsLoss model gives)."""

    def forward(self, *args):
        return super().forward(*args) * 8 - 4


def _train_stamped(worker: str, logits: bool = False) -> TrainCtx:
    model = _Logits(seed=3) if logits else Click(seed=3)
    ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                   embedding_workers=[worker], mixed_precision=False, ready_timeout_s=10)
    loss = (torch.nn.functional.binary_cross_entropy_with_logits if logits
            else torch.nn.functional.binary_cross_entropy)
    with ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, timeout_ms=300):
            output, labels = ctx.forward(tb)
            ctx.backward(loss(output, labels[0]))
    return ctx


async def _ingest_and_train(job, batches: int, *, logits: bool = False):
    """``batches`` stamped batches ingested by worker 0, then trained by a real TrainCtx
    on a thread; its RPC client of worker 0 and the context."""
    worker = job.client(job.workers[0].address)
    for i in range(batches):
        await worker.call("ingest", {"batch": make_batch(i).stamped(T0 + i).to_wire()})
    ctx = await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(_train_stamped, job.workers[0].address, logits=logits))
    assert ctx.steps == batches
    return worker, ctx


async def test_nn_rank_0_relays_trained_and_its_progressive_figures(job):
    """A real TrainCtx: its heartbeats carry ``trained`` and rank 0's progressive figures
    to worker 0, which exports them and answers them in ``nn_status``."""
    worker, ctx = await _ingest_and_train(job, 6)
    hb = await worker.call("nn_status")
    assert hb["trained"] == T0 + 5 and hb["detached"] is True
    mine = ctx.progressive_validation.read()
    assert set(hb["progressive"]) == set(mine) == {"task0"}
    got, want = hb["progressive"]["task0"], mine["task0"]
    assert got["samples"] == want["samples"] == 6 * 16
    for key in ("auc", "ne", "lifetime_ne", "calibration", "log_loss"):
        assert got[key] == pytest.approx(want[key]), key
    text = (await worker.call("metrics")).decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values[("persia_stage_event_time_seconds", (("stage", "trained"),))] == T0 + 5
    assert values[("persia_nn_progressive_samples_total", (("task", "task0"),))] == 96
    assert values[("persia_nn_progressive_not_probability_samples_total",
                   (("task", "task0"),))] == 0


async def test_a_model_outputting_logits_says_its_progressive_figures_are_off(job):
    """Logits switch a task's progressive figures off (they would be figures of a biased
    subset): worker 0 exports how many predictions were outside [0, 1], so
    ``PersiaProgressiveValidationOff`` fires instead of every quality alert going quiet."""
    worker, _ = await _ingest_and_train(job, 4, logits=True)
    got = (await worker.call("nn_status"))["progressive"]["task0"]
    assert got["auc"] is None and got["not_probabilities"] > 0
    assert got["skipped"] >= got["not_probabilities"]
    text = (await worker.call("metrics")).decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    key = ("persia_nn_progressive_not_probability_samples_total", (("task", "task0"),))
    assert values[key] == got["not_probabilities"]
    assert ("persia_nn_progressive_auc_ratio", (("task", "task0"),)) not in values


async def test_a_serving_replica_exports_the_served_stage(tmp_path):
    job = await start_job(n_servers=1)
    try:
        await _train(job, [T0 + 1, T0 + 2])
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3))
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                checkpoint_dir=str(tmp_path / "ckpts"))
        async with LiveApi(settings) as replica:
            await publish_dense(job, TwoHeads(seed=4), step=5, event_time=T0 + 2)
            async with asyncio.timeout(20):
                while (await replica.client.get("/v1/model")).json()["trained_through"] \
                        != T0 + 2:
                    await asyncio.sleep(0.05)
            marks = (await replica.client.get("/v1/status", headers=AUTH)).json()["watermarks"]
            text = (await replica.client.get("/metrics")).text
        assert marks["served"]["event_time"] == T0 + 2
        assert marks["applied"]["event_time"] == T0 + 2
        served = [s for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "persia_stage_event_time_seconds"
                  and s.labels["stage"] == "served"]
        assert [(s.value, "role" in s.labels) for s in served] == [(T0 + 2, False)]
    finally:
        await stop_job(job)


async def test_a_relay_the_worker_refuses_costs_the_figures_not_the_mailbox(job):
    """A model whose task name is longer than the relay takes: rank 0's heartbeats still
    reach the mailbox (so checkpoints over HTTP still do), without the figures."""
    worker = job.client(job.workers[0].address)
    for i in range(6):
        await worker.call("ingest", {"batch": make_batch(i).stamped(T0 + i).to_wire()})

    def train() -> TrainCtx:
        model = Click(seed=3)
        model.tasks = ["x" * 129]
        ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05),
                       model=model, embedding_workers=[job.workers[0].address],
                       mixed_precision=False, ready_timeout_s=10)
        with ctx:
            for tb in DataLoader(StreamingDataset(), embedding_staleness=2, timeout_ms=300):
                output, labels = ctx.forward(tb)
                ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        return ctx

    ctx = await asyncio.get_running_loop().run_in_executor(None, train)
    assert ctx.steps == 6 and set(ctx.progressive()) == {"x" * 129}
    hb = await worker.call("nn_status")
    assert hb is not None, "every heartbeat of rank 0 was refused"
    assert hb["trained"] == T0 + 5 and hb["detached"] is True
    assert hb["progressive"] == {}


async def test_an_older_worker_refusing_the_new_counts_keeps_the_figures(job, monkeypatch):
    """Worker 0 of an older release knows only window and samples among the counts: rank
    0 then relays its figures without skipped / not_probabilities, not none at all."""
    from stream_persia.worker import nn_relay

    monkeypatch.setattr(nn_relay, "_COUNTS", ("window", "samples"))
    worker, ctx = await _ingest_and_train(job, 6)
    got = (await worker.call("nn_status"))["progressive"]["task0"]
    assert got["samples"] == 96 and got["auc"] is not None
    assert "skipped" not in got and "not_probabilities" not in got


async def test_a_role_that_does_not_answer_makes_its_stages_and_totals_unknown():
    """A stuck or dead worker or server may be the slowest: /v1/status says its stages and
    the totals over its kind are unknown (null), not the least or the sum over the roles
    still answering, which would show the job fresher or emptier than it is."""
    job = await start_job(n_servers=2, n_workers=2)
    try:
        await _train(job, [T0 + 2, T0 + 3])
        lagging = job.client(job.workers[1].address)     # the slowest worker: T0 + 1
        await lagging.call("ingest", {"batch": make_batch(7).stamped(T0 + 1).to_wire()})
        await job.client(job.workers[0].address).call(
            "nn_heartbeat", {"rank": 0, "world_size": 1, "step": 2, "trained": T0 + 3})
        async with LiveApi(settings_for(job)) as api:
            st = (await api.client.get("/v1/status", headers=AUTH)).json()
            marks = st["watermarks"]
            assert marks["ingested"]["event_time"] == T0 + 1
            assert marks["applied"]["event_time"] == T0 + 3
            assert st["rows_total"] > 0 and st["staleness_in_flight"] == 0
            assert st["ingest_paused"] is False and st["training"]["batches_applied"] == 2

            await job.workers[1].stop()
            await job.servers[1].stop()
            r = await api.client.get("/v1/status", headers=AUTH)
            assert r.status_code == 200, r.text
            st = r.json()
            marks = st["watermarks"]
        assert not st["workers"][1]["healthy"] and not st["servers"][1]["healthy"]
        assert marks["ingested"] is None and marks["produced"] is None
        assert marks["applied"] is None
        assert marks["trained"]["event_time"] == T0 + 3      # worker 0 relays it
        assert st["rows_total"] is None and st["staleness_in_flight"] is None
        assert st["training"]["batches_applied"] is None
        assert st["ingest_paused"] is False      # worker 0 answers, not paused: not all are
        assert st["servers"][0]["rows"] > 0                  # what is known stays shown
    finally:
        await stop_job(job)
