"""NN rank 0 publishes the dense model to embedding server 0 (stream_persia.nn.
dense_publisher) against a real job in this process: what a replica pulls ``torch.load``s
into the model's state dict at the version (step) and event time trained, training is
bit-identical with publishing on and off, a server refusing every publication does not
fail training, and one publication is in flight at most. A fresh publisher (a restarted
trainer) or a restored checkpoint publishes in a new lineage that server 0 and the
replicas take whatever step they hold, and the publisher it replaced is refused."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from nn_helpers import LEARNABLE_SCHEMA, SumModel, learnable_batches

from stream_persia.checkpoint import read_manifest
from stream_persia.config import GlobalConfig, ModelUpdatesConfig
from stream_persia.core.aio import LoopThread
from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad
from stream_persia.errors import Misuse
from stream_persia.nn import dense_publisher
from stream_persia.nn.cluster import Cluster
from stream_persia.nn.dense_publisher import DensePublisher, model_updates_config, snapshot
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.utils import setup_seed


def publishing(every_steps: int = 1, **kw) -> ModelUpdatesConfig:
    # An interval far longer than the test: publications come from the step count.
    return ModelUpdatesConfig(**{"dense_every_steps": every_steps,
                                 "dense_interval_ms": 600_000, **kw})


def pull(address: str, since: int = -1, lineage: int | None = None
         ) -> tuple[dict, bytes | None]:
    """A replica's pull of server 0's dense model: (metadata, blob or None)."""
    ask = {"since": since} | ({} if lineage is None else {"lineage": lineage})

    async def get() -> tuple[dict, bytes | None]:
        async with RpcClient(address) as c:
            first = await c.call("get_dense", ask)
            if first["data"] is None:
                return first, None
            parts = [first["data"]]
            for i in range(1, first["chunks"]):
                reply = await c.call("get_dense", {**ask, "chunk": i})
                assert (reply["version"], reply["lineage"]) \
                    == (first["version"], first["lineage"])
                parts.append(reply["data"])
            return first, b"".join(parts)

    with LoopThread(name="test-replica") as loop:
        meta, blob = loop.run(get(), timeout=30)
    if blob is not None:
        assert hashlib.sha256(blob).hexdigest() == meta["sha256"]
    return meta, blob


def train(job, batches, *, model_updates, seed=0, hidden=32, event_times=None,
          device_id=None, **kw) -> tuple[torch.nn.Module, TrainCtx]:
    setup_seed(seed)
    model = SumModel(13, hidden=hidden)
    # Dropout draws from torch's RNG every step: a publisher that drew from it too, or
    # switched the model's mode, would change what training computes.
    model.mlp.insert(0, torch.nn.Dropout(0.2))
    if device_id is not None:
        model = model.cuda(device_id)
    with TrainCtx(Adagrad(lr=0.1), torch.optim.Adam(model.parameters(), lr=0.01),
                  model=model, embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=EmbeddingConfig((-0.01, 0.01)), ready_timeout_s=10,
                  model_updates=model_updates, device_id=device_id, **kw) as ctx:
        feeder = job.feed(batches)
        loader = DataLoader(StreamingDataset(10), embedding_staleness=1, reproducible=True,
                            max_batches=len(batches))
        for i, tb in enumerate(loader):
            if event_times is not None:
                tb.event_time = event_times[i]
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        feeder.join(10)
    return model, ctx



@contextlib.contextmanager
def server_0() -> Iterator[tuple[LoopThread, EmbeddingServer, Cluster]]:
    """An embedding server 0 on a loop of its own and a cluster whose servers[0] is it
    (the cluster is never started: only its loop and that client are used)."""
    server_loop = LoopThread(name="test-server-0")
    server = EmbeddingServer(100)
    server_loop.run(server.start())
    cluster = Cluster(["127.0.0.1:1"])
    try:
        cluster.servers = [RpcClient(server.address, timeout_ms=10_000)]
        yield server_loop, server, cluster
    finally:
        cluster.close()
        server_loop.run(server.stop())
        server_loop.close()

def test_rank0_publishes_what_a_replica_loads_into_the_models_state(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    times = [1000.0 + (i * 7) % 10 for i in range(12)]      # not in order: the newest wins
    model, ctx = train(job, learnable_batches(12, 64), model_updates=publishing(4),
                       event_times=times)
    assert ctx.trained_through == max(times)
    stats = ctx.dense_publisher.stats()
    # due at steps 4, 8, 12; the final model (step 12) is not sent twice
    assert stats["published"] + stats["skipped"] == 3 and stats["failed"] == 0
    assert ctx.dense_publisher.last_version == 12
    meta, blob = pull(job.servers[0].address)
    assert (meta["version"], meta["event_time"]) == (12, max(times))
    state = torch.load(io.BytesIO(blob), weights_only=True)
    expected = model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert pull(job.servers[0].address, since=12)[1] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda."
                    "is_available() is False here")
def test_a_cuda_model_is_published_as_cpu_tensors(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    model, ctx = train(job, learnable_batches(6, 64), model_updates=publishing(2),
                       device_id=0)
    assert ctx.dense_publisher.stats()["failed"] == 0
    meta, blob = pull(job.servers[0].address)
    assert meta["version"] == 6
    state = torch.load(io.BytesIO(blob), weights_only=True)
    assert all(v.device.type == "cpu" for v in state.values())
    assert all(torch.equal(state[k], v.cpu()) for k, v in model.state_dict().items())


def test_the_final_model_is_published_on_a_clean_exit(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    model, ctx = train(job, learnable_batches(5, 64), model_updates=publishing(3))
    assert ctx.dense_publisher.last_version == 5            # step 3, then the final 5
    meta, blob = pull(job.servers[0].address)
    # the newest event time trained: the sender stamped every batch with its clock
    assert meta["version"] == 5 and meta["event_time"] == ctx.trained_through is not None
    state = torch.load(io.BytesIO(blob), weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_training_is_bit_identical_with_publishing_on_and_off(job_factory):
    batches = learnable_batches(20, 64, seed=4)
    runs = []
    for cfg in (ModelUpdatesConfig(enabled=False), publishing(1)):
        # publishing on: the servers' update feeds pass every 10 ms meanwhile, too
        job = job_factory(LEARNABLE_SCHEMA, model_updates=cfg.enabled,
                          model_update_interval_ms=10)
        model, ctx = train(job, batches, model_updates=cfg, seed=3)
        ids = LEARNABLE_SCHEMA.prefix_ids("a", np.arange(50, dtype=np.uint64))
        runs.append((model.state_dict(), job.store_rows(ids, 4),
                     ctx, job))
    (dense_off, rows_off, ctx_off, job_off), (dense_on, rows_on, ctx_on, job_on) = runs
    assert ctx_off.dense_publisher is None
    assert pull(job_off.servers[0].address)[0]["version"] is None
    assert ctx_on.dense_publisher.stats()["published"] >= 2
    assert pull(job_on.servers[0].address)[0]["version"] == 20
    assert all(torch.equal(dense_off[k], dense_on[k]) for k in dense_off)
    np.testing.assert_array_equal(rows_off, rows_on)
    assert np.abs(rows_on).max() > 0.02, "the embeddings trained (initialised in ±0.01)"


def test_a_server_refusing_every_publication_does_not_fail_training(job_factory, caplog,
                                                                     monkeypatch):
    job = job_factory(LEARNABLE_SCHEMA)
    # This run's lineage was replaced on server 0 already (as if a newer trainer had
    # taken over from it): server 0 refuses everything it publishes.
    monkeypatch.setattr(dense_publisher, "new_lineage", lambda: 77)

    async def replaced() -> None:
        async with RpcClient(job.servers[0].address) as c:
            for lineage, version in ((77, 1), (78, 10**9)):
                await c.call("put_dense", {"version": version, "event_time": None,
                                           "chunk": 0, "chunks": 1, "data": b"x",
                                           "lineage": lineage,
                                           "sha256": hashlib.sha256(b"x").hexdigest()})

    job.loop.run(replaced(), timeout=10)
    with caplog.at_level(logging.WARNING, logger="stream_persia.nn.dense_publisher"):
        _, ctx = train(job, learnable_batches(6, 64), model_updates=publishing(1))
    stats = ctx.dense_publisher.stats()
    assert stats["published"] == 0 and stats["failed"] >= 2
    warnings = [r for r in caplog.records if r.name == "stream_persia.nn.dense_publisher"]
    assert len(warnings) == 1 and "lineage" in warnings[0].getMessage()
    assert pull(job.servers[0].address)[0]["version"] == 10**9


def test_a_model_over_max_dense_bytes_is_not_sent(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    _, ctx = train(job, learnable_batches(3, 64), hidden=256,
                   model_updates=publishing(1, max_dense_bytes=4096))
    stats = ctx.dense_publisher.stats()
    assert stats["too_large"] == stats["failed"] >= 2 and stats["published"] == 0
    assert pull(job.servers[0].address)[0]["version"] is None


def test_one_publication_in_flight_at_most_the_others_are_skipped():
    """Server 0 frozen (its loop blocked): the first publication waits for it, the ones
    due meanwhile are skipped; once it answers, the final model goes out."""
    with server_0() as (server_loop, server, cluster):
        model = SumModel(13, hidden=8)
        publisher = DensePublisher(model, cluster, publishing(1), step=0)
        frozen = server_loop.submit(_block(1.0))
        for step in range(1, 6):
            publisher.step_boundary(step, float(step))
        assert publisher.stats()["skipped"] == 4
        frozen.result(5)
        publisher.close((5, 5.0))
        assert publisher.stats()["published"] == 2 and publisher.last_version == 5
        meta, blob = pull(server.address)
        assert (meta["version"], meta["event_time"]) == (5, 5.0)


def test_an_unreachable_server_is_counted_and_logged_once_per_streak(caplog):
    with socket.socket() as sock:   # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    cluster = Cluster(["127.0.0.1:1"])   # never started: only its loop and servers[0]
    try:
        cluster.servers = [RpcClient(address)]
        # (a refused connection fails at once; the timeout only bounds close's wait for
        # the final publication, which a loaded machine took over 0.3 s to serialize)
        publisher = DensePublisher(SumModel(13), cluster, publishing(1), step=0,
                                   timeout_s=10)
        with caplog.at_level(logging.WARNING, logger="stream_persia.nn.dense_publisher"):
            for step in range(1, 4):
                publisher.step_boundary(step, None)   # returns at once, raises nothing
                deadline = time.monotonic() + 10
                while publisher.stats()["failed"] < step and time.monotonic() < deadline:
                    time.sleep(0.02)
            publisher.close((3, None))   # the final one is version 3 again: it failed
        assert publisher.stats()["failed"] == 4 and publisher.stats()["published"] == 0
        assert len([r for r in caplog.records
                    if r.name == "stream_persia.nn.dense_publisher"]) == 1
    finally:
        cluster.close()


async def _block(seconds: float) -> None:
    time.sleep(seconds)   # blocks the server's event loop: a frozen server


def test_the_settings_come_from_the_global_config(tmp_path, monkeypatch, job_factory):
    cfg = tmp_path / "global_config.yml"
    cfg.write_text("model_updates:\n  enabled: false\n  dense_every_steps: 7\n")
    monkeypatch.setenv("PERSIA_GLOBAL_CONFIG", str(cfg))
    assert model_updates_config() == GlobalConfig.from_dict(
        {"model_updates": {"enabled": False, "dense_every_steps": 7}}).model_updates
    model = SumModel(13)
    ctx = TrainCtx(Adagrad(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                   embedding_workers=["127.0.0.1:1"])
    assert ctx.model_updates.enabled is False and ctx.model_updates.dense_every_steps == 7
    monkeypatch.delenv("PERSIA_GLOBAL_CONFIG")
    assert model_updates_config() == ModelUpdatesConfig()
    with pytest.raises(Misuse) as info:
        TrainCtx(Adagrad(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                 model_updates={"enabled": False})
    assert info.value.field == "model_updates"


def test_the_snapshot_is_a_copy_training_cannot_change():
    model = SumModel(13, hidden=8)
    state = snapshot(model)
    before = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(state[k], before[k]) for k in state)
    assert all(v.device.type == "cpu" for v in state.values())


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_step_short_of_the_next_due_one_is_published_when_the_stream_idles():
    """A stream that pauses after step 4 (due every 3): ``idle`` publishes step 4, once;
    not while a publication is in flight, not when nothing was trained since; the next
    due one counts from there."""
    with server_0() as (server_loop, server, cluster):
        publisher = DensePublisher(SumModel(13, hidden=8), cluster, publishing(3), step=0)
        publisher.idle(0, None)                  # nothing trained: nothing to publish
        assert pull(server.address)[0]["version"] is None
        frozen = server_loop.submit(_block(0.5))
        for step in range(1, 5):
            publisher.step_boundary(step, float(step))     # step 3 is due: in flight
        publisher.idle(4, 4.0)                   # one in flight: not now
        frozen.result(5)
        _until(lambda: publisher.stats()["published"] == 1)
        assert publisher.last_version == 3
        publisher.idle(4, 4.0)                   # the step training stopped at
        _until(lambda: publisher.stats()["published"] == 2)
        meta, _ = pull(server.address)
        assert (meta["version"], meta["event_time"]) == (4, 4.0)
        for _ in range(5):
            publisher.idle(4, 4.0)               # nothing changed: nothing sent
        publisher.step_boundary(6, 6.0)          # 2 steps after the idle one: not due
        assert publisher.stats() == {"published": 2, "skipped": 0, "failed": 0,
                                     "too_large": 0, "bytes_sent": publisher.bytes_sent}
        publisher.step_boundary(7, 7.0)
        _until(lambda: publisher.stats()["published"] == 3)
        assert publisher.last_version == 7
        publisher.close((7, 7.0))                # the final model went out already
        assert publisher.stats()["published"] == 3


def test_the_dataloader_waiting_for_a_batch_publishes_the_last_step(job_factory):
    """5 batches, then the stream pauses: while the DataLoader waits (the context open,
    training not over), server 0 gets the model of step 5, not only step 3 (due every 3)."""
    job = job_factory(LEARNABLE_SCHEMA)
    setup_seed(0)
    model = SumModel(13, hidden=8)
    with TrainCtx(Adagrad(lr=0.1), torch.optim.Adam(model.parameters(), lr=0.01),
                  model=model, embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=EmbeddingConfig((-0.01, 0.01)), ready_timeout_s=10,
                  model_updates=publishing(3)) as ctx:
        feeder = job.feed(learnable_batches(5, 64))
        # the loop ends after 1.5 s without a batch: the stream's pause, inside the context
        for tb in DataLoader(StreamingDataset(10), embedding_staleness=1, timeout_ms=1500):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        feeder.join(10)
        assert ctx.steps == 5
        meta, blob = pull(job.servers[0].address)
        assert (meta["version"], meta["event_time"]) == (5, ctx.trained_through)
        state = torch.load(io.BytesIO(blob), weights_only=True)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        assert ctx.dense_publisher.stats()["published"] == 2


def test_an_idle_publication_that_failed_is_tried_again_after_the_interval():
    """The stream pauses at step 2 while server 0 is unreachable: the idle publication
    fails; once server 0 is back, step 2 is published, but not before dense_interval_ms
    since the failed try (and once only)."""
    with socket.socket() as sock:   # a port nobody listens on, yet
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    now = [100.0]
    cluster = Cluster(["127.0.0.1:1"])   # never started: only its loop and servers[0]
    server_loop = LoopThread(name="test-server-0")
    server = EmbeddingServer(100, host="127.0.0.1", port=port)
    try:
        cluster.servers = [RpcClient(f"127.0.0.1:{port}")]
        publisher = DensePublisher(SumModel(13, hidden=8), cluster,
                                   publishing(10, dense_interval_ms=1000), step=0,
                                   timeout_s=0.3, clock=lambda: now[0])
        publisher.step_boundary(2, 2.0)           # not due
        publisher.idle(2, 2.0)
        _until(lambda: publisher.stats()["failed"] == 1)
        server_loop.run(server.start())
        now[0] += 0.5
        publisher.idle(2, 2.0)                    # within the interval: not yet
        time.sleep(0.1)
        assert publisher.stats()["failed"] == 1 and publisher.stats()["published"] == 0
        now[0] += 0.6
        publisher.idle(2, 2.0)
        _until(lambda: publisher.stats()["published"] == 1)
        assert pull(server.address)[0]["version"] == 2 and publisher.last_version == 2
        now[0] += 5
        publisher.idle(2, 2.0)                    # published: never again
        time.sleep(0.1)
        assert publisher.stats()["published"] == 1 and publisher.stats()["failed"] == 1
    finally:
        cluster.close()
        server_loop.run(server.stop())
        server_loop.close()


def test_a_fresh_publisher_replaces_a_crashed_ones_model_and_fences_it():
    """A trainer restarted from scratch against the running server 0: the crashed run
    published step 60; the new publisher's step 1 is held from its first publication, a
    replica serving step 60 (get_dense with the version and lineage it serves) gets the
    new model, and the old publisher, if it still runs, is refused."""
    with server_0() as (_, server, cluster):
        first_model, second_model = SumModel(13, hidden=8), SumModel(13, hidden=8)
        with torch.no_grad():
            for p in second_model.parameters():
                p.add_(1.0)
        first = DensePublisher(first_model, cluster, publishing(1), step=0)
        first.step_boundary(60, 60.0)
        _until(lambda: first.stats()["published"] == 1)
        served, _ = pull(server.address)
        assert (served["version"], served["lineage"]) == (60, first.lineage)

        second = DensePublisher(second_model, cluster, publishing(1), step=0)
        assert second.lineage != first.lineage
        second.step_boundary(1, 61.0)
        _until(lambda: second.stats()["published"] == 1)
        meta, blob = pull(server.address, since=60, lineage=first.lineage)
        assert (meta["version"], meta["event_time"], meta["lineage"]) \
            == (1, 61.0, second.lineage)
        state = torch.load(io.BytesIO(blob), weights_only=True)
        assert all(torch.equal(state[k], v) for k, v in second_model.state_dict().items())
        assert pull(server.address, since=1, lineage=second.lineage)[1] is None

        first.step_boundary(61, 62.0)                 # the zombie: refused
        _until(lambda: first.stats()["failed"] == 1)
        assert first.last_version == 60
        assert pull(server.address)[0]["lineage"] == second.lineage
        assert server.dense.stats()["lineage_refused"] == 1
        first.close(None)
        second.close((1, 61.0))


def test_a_restore_to_an_earlier_step_publishes_in_a_new_lineage(job_factory, tmp_path):
    """A checkpoint at step 3, training on to step 6 (server 0 holds step 6), then a
    restore of it: step 4 of the restored model is published and held (without a new
    lineage it would be refused until step 7). The checkpoint records the lineage it was
    published in, for a replica restored from it."""
    job = job_factory(LEARNABLE_SCHEMA)
    address = job.servers[0].address
    setup_seed(0)
    model = SumModel(13, hidden=8)
    ck = str(tmp_path / "ck")
    with TrainCtx(Adagrad(lr=0.1), torch.optim.Adam(model.parameters(), lr=0.01),
                  model=model, embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=EmbeddingConfig((-0.01, 0.01)), ready_timeout_s=10,
                  model_updates=publishing(1)) as ctx:
        feeder = job.feed(learnable_batches(7, 64))
        for tb in DataLoader(StreamingDataset(10), embedding_staleness=1, reproducible=True,
                             max_batches=7):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            if ctx.steps == 3 and not tmp_path.joinpath("ck").exists():
                ctx.dump_checkpoint(ck)
                before = ctx.dense_publisher.lineage
            elif ctx.steps == 6:
                while pull(address)[0]["version"] != 6:   # step 6 held (not skipped)
                    ctx.stream_idle()
                    time.sleep(0.02)
                ctx.load_checkpoint(ck)
                assert ctx.steps == 3
        feeder.join(10)
        assert ctx.steps == 4
    after = ctx.dense_publisher.lineage
    assert read_manifest(ck).extra["dense_lineage"] == before != after
    meta, blob = pull(address, since=6, lineage=before)     # a replica serving step 6
    assert (meta["version"], meta["lineage"]) == (4, after)
    state = torch.load(io.BytesIO(blob), weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert ctx.dense_publisher.stats()["failed"] == 0 and ctx.dense_publisher.last_version == 4


def test_a_restored_model_is_published_in_its_new_lineage_when_the_stream_idles():
    """Restored to step 2 after publishing step 6, with the stream paused: the restored
    model is published (version 2, a new lineage) at the next idle call, once."""
    with server_0() as (_, server, cluster):
        model = SumModel(13, hidden=8)
        publisher = DensePublisher(model, cluster, publishing(3), step=0)
        for step in range(1, 7):
            publisher.step_boundary(step, float(step))
            _until(lambda: publisher._inflight is None or publisher._inflight.done())
        assert publisher.last_version == 6
        before = publisher.lineage
        publisher.restored(2)
        assert publisher.lineage != before and publisher.last_version is None
        publisher.idle(2, 2.0)          # the restored model itself, not trained further
        _until(lambda: publisher.stats()["published"] == 3)
        meta, _ = pull(server.address)
        assert (meta["version"], meta["lineage"]) == (2, publisher.lineage)
        publisher.idle(2, 2.0)                           # sent: not again
        publisher.step_boundary(3, 3.0)                  # not due: 1 step after it
        time.sleep(0.1)
        assert publisher.stats()["published"] == 3 and publisher.stats()["failed"] == 0
        publisher.close((3, 3.0))                        # the final model
        assert publisher.stats()["published"] == 4 and publisher.last_version == 3


def test_a_context_that_trains_nothing_never_takes_the_model_over():
    """A TrainCtx against the live servers that trains no step (a run that found no new
    data, a smoke test) exits cleanly and idles: its untrained model, in a lineage of its
    own, must not replace the running trainer's (which server 0 would then refuse)."""
    with server_0() as (_, server, cluster):
        live = DensePublisher(SumModel(13, hidden=8), cluster, publishing(1), step=0)
        live.step_boundary(60, 60.0)
        _until(lambda: live.stats()["published"] == 1)
        idle = DensePublisher(SumModel(13, hidden=8), cluster, publishing(1), step=0)
        idle.idle(0, None)
        idle.close((0, None))
        assert idle.stats()["published"] == idle.stats()["failed"] == 0
        assert pull(server.address)[0]["lineage"] == live.lineage
        live.step_boundary(61, 61.0)                 # the live trainer is not refused
        _until(lambda: live.stats()["published"] == 2)
        assert live.stats()["failed"] == 0 and live.last_version == 61
        live.close((61, 61.0))


def test_an_older_server_0_without_lineages_gets_legacy_publications(monkeypatch, caplog):
    """A rolling upgrade that reaches the NN workers before the embedding servers: server
    0 refuses put_dense's unknown 'lineage' field (here: the hub's fields as they were
    before lineages). The publisher publishes without it from then on, logging once,
    instead of failing every publication until the servers are upgraded."""
    from stream_persia.server import dense_hub

    monkeypatch.setattr(dense_hub, "_PUT_KEYS", frozenset(
        {"version", "event_time", "chunk", "chunks", "data", "sha256"}))
    with server_0() as (_, server, cluster), caplog.at_level("WARNING"):
        publisher = DensePublisher(SumModel(13, hidden=8), cluster, publishing(1), step=0)
        for step in (1, 2):
            publisher.step_boundary(step, float(step))
            _until(lambda s=step: publisher.stats()["published"] == s)
        assert publisher.stats()["failed"] == 0 and publisher.last_version == 2
        meta, _ = pull(server.address)
        assert (meta["version"], meta["lineage"]) == (2, dense_hub.LEGACY_LINEAGE)
        assert sum("does not know dense lineages" in r.getMessage()
                   for r in caplog.records) == 1
        publisher.close((2, 2.0))
