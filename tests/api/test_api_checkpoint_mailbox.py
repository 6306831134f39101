"""The checkpoint mailbox (on embedding worker 0) between the API and the NN ranks.

The mailbox's rules on their own (with a settable clock), then the two ways a request can
still be pending when the NN ranks stop training: a clean exit of ``TrainCtx`` serves it
(``by: nn``), an exit on an error fails it over to the API, which takes the cut itself once
nothing is in flight (``by: api``). Either way the API never waits for a rank that left.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from api_helpers import AUTH, Click, LiveApi, settings_for, take_checkpoint
from stream_persia.api.checkpoints import Checkpoints

from stream_persia.checkpoint import read_manifest
from stream_persia.checkpoint.root import CheckpointRoot
from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import SGD
from stream_persia.errors import BadInput, ConfigError, Misuse
from stream_persia.testing.samples import make_batch
from stream_persia.worker.mailbox import CheckpointMailbox, MailboxClient

ROOT = CheckpointRoot("/c")   # where the unit tests' requests point

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_request_is_offered_until_taken_then_reported():
    clock = Clock()
    box = CheckpointMailbox(clock, checkpoint_root=ROOT)
    assert await box.nn_status(None) is None
    hb = {"rank": 0, "world_size": 2, "step": 7}
    assert await box.nn_heartbeat(hb) == {"checkpoint": None}
    clock.now += 1.5
    assert await box.nn_status(None) == {"rank": 0, "world_size": 2, "step": 7, "age_s": 1.5,
                                         "alive_s": 1.5, "step_age_s": 1.5,
                                         "detached": False, "trained": None,
                                         "progressive": {}, "periodic": None}
    rec = await box.request({"id": "a", "dst": "/c/a"})
    assert rec["state"] == "pending" and rec["step"] is None
    assert (await box.request({"id": "a", "dst": "/c/a"}))["id"] == "a"   # idempotent
    with pytest.raises(Misuse):
        await box.request({"id": "b", "dst": "/c/b"})
    offer = {"checkpoint": {"id": "a", "dst": "/c/a", "report_every_s": 5.0}}
    assert await box.nn_heartbeat(hb) == offer
    assert await box.nn_heartbeat(hb) == offer       # again, until the rank says running
    await box.report({"id": "a", "state": "running", "step": 7, "progress": {"phase": "x"}})
    assert await box.nn_heartbeat(hb) == {"checkpoint": None}
    await box.report({"id": "a", "state": "done", "manifest": {"step": 7}})
    rec = await box.status({"id": "a"})
    assert (rec["state"], rec["step"], rec["manifest"]) == ("done", 7, {"step": 7})
    with pytest.raises(Misuse):
        await box.report({"id": "a", "state": "failed"})
    with pytest.raises(BadInput) as err:
        await box.report({"id": "a", "state": "pending"})
    assert err.value.field == "state"
    with pytest.raises(BadInput) as err:
        await box.nn_heartbeat({"rank": 0, "world_size": 1, "step": -1})
    assert err.value.field == "step"


async def test_heartbeats_tell_a_stepping_rank_from_a_waiting_or_a_living_one():
    """Three kinds of heartbeat: at a step (the rank takes requests there), from the
    training thread between steps (``at_step: false``: waiting for a batch with several
    ranks) and from the RPC loop (``waiting``: the process lives, training is elsewhere).
    The API's client reads them as ``stepping`` (requests go to the mailbox) and
    ``attached`` (restores are refused)."""
    clock = Clock()
    box = CheckpointMailbox(clock, checkpoint_root=ROOT)
    calls = []

    async def call(method, params):
        calls.append(method)
        return await getattr(box, method)(params)

    client = MailboxClient(call, attached_within_s=10)
    hb = {"rank": 0, "world_size": 2, "step": 7}
    await box.nn_heartbeat(hb)
    clock.now += 6
    await box.nn_heartbeat({**hb, "at_step": False, "trained": 123.0})
    clock.now += 6
    await box.nn_heartbeat({**hb, "waiting": True})
    status = await client.nn_status()
    assert (status["age_s"], status["step_age_s"], status["alive_s"]) == (6, 12, 0)
    assert status["trained"] == 123.0        # relayed by the training thread's heartbeat
    assert status["attached"] and not status["stepping"]
    clock.now += 6
    await box.nn_heartbeat({**hb, "waiting": True, "trained": 999.0})   # relays nothing
    status = await client.nn_status()
    assert status["attached"] and status["trained"] == 123.0 and status["age_s"] == 12
    clock.now += 11                          # nothing for longer than the window
    status = await client.nn_status()
    assert not status["attached"] and not status["stepping"]
    await box.nn_heartbeat(hb)               # a step: stepping again
    status = await client.nn_status()
    assert status["attached"] and status["stepping"]
    await box.nn_detach({"rank": 0, "step": 8})
    await box.nn_heartbeat({**hb, "waiting": True})   # never attaches a detached rank
    status = await client.nn_status()
    assert status["detached"] and not status["attached"] and not status["stepping"]
    for bad in ("yes", 1, None):
        with pytest.raises(BadInput) as err:
            await box.nn_heartbeat({**hb, "waiting": bad})
        assert err.value.field == "waiting"
    # A mailbox from before the kinds answers age_s alone: both read from it.
    old = MailboxClient(lambda m, p: _aiter_value({"rank": 0, "step": 3, "age_s": 2.0,
                                                  "detached": False}))
    status = await old.nn_status()
    assert status["attached"] and status["stepping"]


async def test_worker_0_says_whether_a_heartbeat_ever_came():
    """``persia_nn_heartbeat_seen`` is exported from the start, 0 until NN rank 0's first
    heartbeat (no age then: there is none), 1 after, with the age: a worker 0 restarted
    while the NN ranks are gone says so (``PersiaNNNeverReported``)."""
    from stream_persia.worker.nn_relay import NnRelayCollector

    clock = Clock()
    box = CheckpointMailbox(clock, checkpoint_root=ROOT)
    collector = NnRelayCollector(box.relay)

    def samples() -> dict[str, float]:
        return {s.name: s.value for f in collector.collect() for s in f.samples
                if s.name.startswith("persia_nn_heartbeat")}

    assert samples() == {"persia_nn_heartbeat_seen": 0.0}
    clock.now += 300
    assert samples() == {"persia_nn_heartbeat_seen": 0.0}
    await box.nn_heartbeat({"rank": 0, "world_size": 1, "step": 1})
    clock.now += 130
    assert samples() == {"persia_nn_heartbeat_seen": 1.0,
                         "persia_nn_heartbeat_age_seconds": 130.0}


async def _aiter_value(value):
    return value


async def test_a_request_nobody_takes_fails_and_a_detach_fails_the_pending_one():
    clock = Clock()
    box = CheckpointMailbox(clock, checkpoint_root=ROOT)
    await box.request({"id": "a", "dst": "/c/a", "ttl_s": 5})
    clock.now += 6
    rec = await box.status({"id": "a"})
    assert rec["state"] == "failed" and rec["step"] is None and "in time" in rec["error"]
    await box.nn_heartbeat({"rank": 0, "world_size": 1, "step": 3})
    await box.request({"id": "b", "dst": "/c/b"})
    await box.nn_detach({"rank": 0, "step": 4, "reason": "the NN ranks finished training"})
    rec = await box.status({"id": "b"})
    assert rec["state"] == "failed" and rec["step"] is None
    assert rec["error"] == "the NN ranks finished training before taking it"
    assert (await box.nn_status(None))["detached"] is True
    assert (await box.nn_status(None))["step"] == 4


async def test_a_taken_request_whose_rank_0_goes_silent_fails_and_frees_the_mailbox():
    clock = Clock()
    box = CheckpointMailbox(clock, checkpoint_root=ROOT)
    hb = {"rank": 0, "world_size": 1, "step": 9}
    await box.nn_heartbeat(hb)
    await box.request({"id": "a", "dst": "/c/a", "report_timeout_s": 2})
    assert (await box.nn_heartbeat(hb))["checkpoint"]["report_every_s"] == pytest.approx(2 / 6)
    await box.report({"id": "a", "state": "running", "step": 9,
                      "progress": {"phase": "dumping embeddings"}})
    # A slow dump that keeps reporting (keepalives: "running", nothing else) stays running
    # for far longer than the limit, and keeps its progress.
    for _ in range(10):
        clock.now += 1.5
        await box.report({"id": "a", "state": "running"})
        rec = await box.status({"id": "a"})
        assert rec["state"] == "running" and rec["progress"] == {"phase": "dumping embeddings"}
    assert (await box.nn_status(None))["detached"] is False
    # Then rank 0 dies: no report for longer than the limit.
    clock.now += 2.5
    rec = await box.status({"id": "a"})
    assert rec["state"] == "failed" and rec["step"] == 9
    assert rec["error"].startswith("NN rank 0 stopped reporting while taking checkpoint a "
                                   "(last report 2.5 s ago, at step 9; the limit is "
                                   "report_timeout_s=2)")
    assert (await box.nn_status(None))["detached"] is True
    with pytest.raises(Misuse):     # a stalled rank 0 that comes back is told so
        await box.report({"id": "a", "state": "done"})
    # The mailbox is free for the next one, and a rank that heartbeats is attached again.
    assert (await box.request({"id": "b", "dst": "/c/b"}))["state"] == "pending"
    await box.nn_heartbeat(hb)
    assert (await box.nn_status(None))["detached"] is False
    # The default limit applies without report_timeout_s; a pending request never expires
    # by it (the pickup ttl_s does that).
    clock.now += 59
    assert (await box.status({"id": "b"}))["state"] == "pending"
    assert (await box.status({"id": "b"}))["report_timeout_s"] == 30.0
    for bad in (0, -1, True, "5", float("inf")):
        with pytest.raises(BadInput) as err:
            await box.request({"id": "c", "dst": "/c/c", "report_timeout_s": bad})
        assert err.value.field == "report_timeout_s"
        with pytest.raises(BadInput) as err:  # the pickup time is checked the same way
            await box.request({"id": "c", "dst": "/c/c", "ttl_s": bad})
        assert err.value.field == "ttl_s"


def test_the_api_refuses_a_report_limit_that_is_not_seconds():
    for bad in (0, -2.0, None, float("inf")):
        with pytest.raises(ConfigError) as err:
            Checkpoints(settings_for(), roles=None, report_timeout_s=bad)
        assert err.value.field == "report_timeout_s"


def _train_then_hold(worker: str, ended: threading.Event, leave: threading.Event,
                     how: str) -> TrainCtx:
    """Train until the stream runs dry, then hold the context open until ``leave``; then
    leave it cleanly (``exit``), after the stream-end hook (``stream_end``: what the
    DataLoader calls when every rank agrees the stream ran dry) or on an error."""
    model = Click(seed=3)
    ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                   embedding_workers=[worker], mixed_precision=False, ready_timeout_s=10)
    try:
        with ctx:
            for tb in DataLoader(StreamingDataset(), embedding_staleness=2, timeout_ms=300):
                output, labels = ctx.forward(tb)
                ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            ctx.poller_seen = ctx.checkpoint_poller
            ended.set()
            assert leave.wait(30)
            if how == "stream_end":
                ctx.stream_ended()
                ctx.taken_inside = list(ctx.checkpoint_poller.taken)
            if how == "error":
                raise RuntimeError("the training script failed")
    except RuntimeError as e:
        assert how == "error" and "script failed" in str(e)
    return ctx


@pytest.mark.parametrize("how", ["exit", "stream_end", "error"])
async def test_a_request_pending_when_training_stops_is_served_or_failed_over(
        job, tmp_path, how):
    n = 6
    worker = job.client(job.workers[0].address)
    for i in range(n):
        await worker.call("ingest", {"batch": make_batch(i).to_wire()})
    root = str(tmp_path / "ckpts")
    ended, leave = threading.Event(), threading.Event()
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        run = asyncio.get_running_loop().run_in_executor(
            None, _train_then_hold, job.workers[0].address, ended, leave, how)
        try:
            async with asyncio.timeout(30):
                while not ended.is_set():
                    await asyncio.sleep(0.02)
                # The loop ended, but the context is open: the rank still counts as attached.
                r = await api.client.post("/v1/checkpoints", headers=AUTH)
                assert r.status_code == 202, r.text
                ident = r.json()["id"]
                while await job.workers[0].mailbox.status({"id": ident}) is None:
                    await asyncio.sleep(0.02)
                info = (await api.client.get(f"/v1/checkpoints/{ident}", headers=AUTH)).json()
                assert info["by"] == "nn" and info["state"] in ("pending", "running")
        finally:
            leave.set()
        ctx = await asyncio.wait_for(run, 30)
        async with asyncio.timeout(30):
            while (info := (await api.client.get(f"/v1/checkpoints/{ident}",
                                                 headers=AUTH)).json())["state"] not in (
                    "done", "failed"):
                await asyncio.sleep(0.05)
        assert info["state"] == "done", info
        manifest = read_manifest(f"{root}/{ident}")
        assert manifest.step == n and manifest.stream == "direct"
        if how != "error":      # taken by the rank, dense model included
            assert info["by"] == "nn" and ctx.poller_seen.taken == [ident]
            assert manifest.dense_filename == "dense.pt" and manifest.jit_filename
            assert manifest.extra["by"] == "nn" and manifest.extra["id"] == ident
            if how == "stream_end":
                assert ctx.taken_inside == [ident]
        else:           # the rank left on an error: the API took the cut
            assert info["by"] == "api" and ctx.poller_seen.taken == []
            assert manifest.extra["embeddings_only"] is True
        status = (await api.client.get("/v1/status", headers=AUTH)).json()
        assert not status["training"]["nn_attached"]      # the rank said goodbye
        assert status["workers"][0]["inflight"] == 0


async def test_the_launchers_stop_checkpoint_waits_out_one_in_progress(job, tmp_path):
    """Ctrl-C on ``stream-persia run`` asks for a checkpoint while the serving replica's
    first one may still be taken (409: one at a time): the launcher waits that one out and
    then gets its own, the cut where training stops (it failed the stop before)."""
    from api_helpers import TOKEN

    from stream_persia.launch.job_checkpoints import checkpoint_and_wait

    box = job.workers[0].mailbox
    hb = {"rank": 0, "world_size": 1, "step": 4}
    await box.nn_heartbeat(hb)                 # an NN rank 0 attached: it takes checkpoints
    async with LiveApi(settings_for(job, checkpoint_dir=str(tmp_path / "ckpts"))) as api:
        r = await api.client.post("/v1/checkpoints", json={"id": "bootstrap"}, headers=AUTH)
        assert r.status_code == 202, r.text
        assert (await api.client.post("/v1/checkpoints", headers=AUTH)).status_code == 409
        waiter = asyncio.get_running_loop().run_in_executor(
            None, checkpoint_and_wait, api.url.removeprefix("http://"), TOKEN, 30.0)
        served = []
        async with asyncio.timeout(30):        # play rank 0: take each offer, then report it
            while not waiter.done():
                offer = (await box.nn_heartbeat(hb))["checkpoint"]
                if offer is not None:
                    served.append(offer["id"])
                    await box.report({"id": offer["id"], "state": "running", "step": 4})
                    if offer["id"] == "bootstrap":
                        await asyncio.sleep(1.0)   # the launcher asks meanwhile: 409s
                    await box.report({"id": offer["id"], "state": "done",
                                      "manifest": {"step": 4}})
                await asyncio.sleep(0.05)
        ident = await waiter
        assert ident is not None and served == ["bootstrap", ident]
        info = (await api.client.get(f"/v1/checkpoints/{ident}", headers=AUTH)).json()
        assert info["state"] == "done" and info["by"] == "nn"


def _train_then_idle(worker: str, n: int, idle: threading.Event) -> TrainCtx:
    """Train the ``n`` batches the stream holds, then wait in the DataLoader (the stream
    paused, the loop not over: ``idle`` is set) for one more batch, and leave."""
    model = Click(seed=3)
    ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                   embedding_workers=[worker], mixed_precision=False, ready_timeout_s=10)
    with ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, timeout_ms=30_000,
                             max_batches=n + 1):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            if ctx.steps == n:
                idle.set()
    return ctx


async def test_a_rank_waiting_for_a_paused_stream_stays_attached(job, tmp_path):
    """NN rank 0 heartbeated only at step boundaries, so a stream paused for longer than
    the mailbox's attached window made a live rank look gone: a restore went through under
    it (it trained on with its own dense model over the restored rows) and a checkpoint was
    cut by the API without the dense model. While the DataLoader waits, rank 0 heartbeats:
    the restore is refused (409), and with one rank a checkpoint asked for during the pause
    is taken by the rank, dense model included."""
    n = 3
    worker = job.client(job.workers[0].address)
    for i in range(n):
        await worker.call("ingest", {"batch": make_batch(i).to_wire()})
    root = str(tmp_path / "ckpts")
    idle = threading.Event()
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        window = 1.0
        api.state.checkpoints.mailbox.attached_within_s = window   # 10 s by default
        run = asyncio.get_running_loop().run_in_executor(
            None, _train_then_idle, job.workers[0].address, n, idle)
        try:
            async with asyncio.timeout(30):
                while not idle.is_set():
                    await asyncio.sleep(0.02)
            await asyncio.sleep(3 * window)   # paused for longer than the window
            status = (await api.client.get("/v1/status", headers=AUTH)).json()
            assert status["training"]["nn_attached"] is True, status["training"]
            info = await take_checkpoint(api, "paused")
            assert info["state"] == "done" and info["by"] == "nn", info
            manifest = read_manifest(f"{root}/paused")
            assert manifest.step == n and manifest.dense_filename == "dense.pt"
            assert not manifest.extra.get("embeddings_only")
            await asyncio.sleep(3 * window)
            r = await api.client.post("/v1/checkpoints/paused/restore", headers=AUTH)
            assert r.status_code == 409, r.text
            assert "while NN ranks train" in r.json()["error"]["message"]
        finally:
            await worker.call("ingest", {"batch": make_batch(n).to_wire()})
        ctx = await asyncio.wait_for(run, 30)
        assert ctx.steps == n + 1
        status = (await api.client.get("/v1/status", headers=AUTH)).json()
        assert not status["training"]["nn_attached"]      # the rank said goodbye


def _train_then_evaluate(worker: str, n: int, evaluating: threading.Event,
                         leave: threading.Event) -> TrainCtx:
    """Train the ``n`` batches the stream holds (the loop ends when it runs dry), then
    stay in the context without a step until ``leave``: an evaluation, user code."""
    model = Click(seed=3)
    ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                   embedding_workers=[worker], mixed_precision=False, ready_timeout_s=10)
    with ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, timeout_ms=300):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        evaluating.set()
        assert leave.wait(30)
    return ctx


async def test_a_rank_busy_between_steps_stays_attached_and_the_api_cuts_at_once(
        job, tmp_path):
    """A rank doing something else than stepping (evaluation, user code) for longer than
    the attached window looked gone: a restore went through under it. Its RPC loop's
    liveness heartbeats keep it attached (the restore is refused) without making it look
    like it steps: a checkpoint asked for meanwhile is cut by the API at once, rather
    than waiting the pickup time for a step that does not come."""
    n = 3
    worker = job.client(job.workers[0].address)
    for i in range(n):
        await worker.call("ingest", {"batch": make_batch(i).to_wire()})
    root = str(tmp_path / "ckpts")
    evaluating, leave = threading.Event(), threading.Event()
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        window = 3.0
        ckpts = api.state.checkpoints
        ckpts.mailbox.attached_within_s = window    # 10 s by default
        ckpts.pickup_ttl_s = 30.0
        run = asyncio.get_running_loop().run_in_executor(
            None, _train_then_evaluate, job.workers[0].address, n, evaluating, leave)
        try:
            async with asyncio.timeout(30):
                while not evaluating.is_set():
                    await asyncio.sleep(0.02)
            await asyncio.sleep(2 * window)     # no step for longer than the window
            status = (await api.client.get("/v1/status", headers=AUTH)).json()
            assert status["training"]["nn_attached"] is True, status["training"]
            began = asyncio.get_running_loop().time()
            info = await take_checkpoint(api, "busy")
            assert info["by"] == "api", info
            assert asyncio.get_running_loop().time() - began < 10   # not the pickup time
            r = await api.client.post("/v1/checkpoints/busy/restore", headers=AUTH)
            assert r.status_code == 409, r.text
            assert "while NN ranks train" in r.json()["error"]["message"]
        finally:
            leave.set()
        await asyncio.wait_for(run, 30)
        status = (await api.client.get("/v1/status", headers=AUTH)).json()
        assert not status["training"]["nn_attached"]      # the rank said goodbye


async def test_no_liveness_heartbeat_goes_to_a_mailbox_from_before_them(job, monkeypatch):
    """A worker 0 from before liveness heartbeats (a rolling upgrade) would take one as a
    step's heartbeat that relays nothing (the trained watermark blanked, a stuck step's
    age kept fresh): its nn_status has no alive_s, and the rank then sends none."""
    from stream_persia.nn import checkpoint_poller

    monkeypatch.setattr(checkpoint_poller, "LIVENESS_EVERY_S", 0.2)
    box = job.workers[0].mailbox
    real_status, real_beat = box.nn_status, box.nn_heartbeat
    sent = []

    async def old_status(params):
        status = await real_status(params)
        return None if status is None else {k: v for k, v in status.items()
                                            if k not in ("alive_s", "step_age_s")}

    async def beat(params):
        sent.append(dict(params))
        return await real_beat(params)

    handlers = job.workers[0].rpc._handlers     # what worker 0 answers over RPC
    monkeypatch.setitem(handlers, "nn_status", old_status)
    monkeypatch.setitem(handlers, "nn_heartbeat", beat)
    worker = job.client(job.workers[0].address)
    for i in range(2):
        await worker.call("ingest", {"batch": make_batch(i).to_wire()})
    evaluating, leave = threading.Event(), threading.Event()
    run = asyncio.get_running_loop().run_in_executor(
        None, _train_then_evaluate, job.workers[0].address, 2, evaluating, leave)
    try:
        async with asyncio.timeout(30):
            while not evaluating.is_set():
                await asyncio.sleep(0.02)
        await asyncio.sleep(1.5)       # several liveness periods without a step
    finally:
        leave.set()
    await asyncio.wait_for(run, 30)
    assert sent and not any(p.get("waiting") for p in sent), sent
