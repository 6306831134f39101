"""TrainCtx against a real job in this process: gradients reach the servers, the staleness
bound holds, the finite check honours its frequency, runs repeat, hybrid ≈ synchronous.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from nn_helpers import LEARNABLE_SCHEMA, SumModel, learnable_batches

from stream_persia.ctx import InferCtx, TrainCtx, eval_ctx
from stream_persia.data import DataLoader, IterableDataset, StreamingDataset
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.data import PersiaBatch
from stream_persia.embedding.optim import SGD, Adagrad
from stream_persia.errors import Misuse, PushFailed, ServerRestarted
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.utils import roc_auc, setup_seed

LR = 0.5


def train_ctx(job, model, *, emb_opt=None, dense_lr=0.01, **kw) -> TrainCtx:
    return TrainCtx(emb_opt or Adagrad(lr=0.1), torch.optim.Adam(model.parameters(), lr=dense_lr),
                    model=model, embedding_workers=job.worker_addresses, mixed_precision=False,
                    embedding_config=EmbeddingConfig((-0.01, 0.01)), ready_timeout_s=10, **kw)


def bce(output, labels):
    return torch.nn.functional.binary_cross_entropy(output, labels[0])


def server_rows(job, slot, ids):
    pref = SCHEMA.prefix_ids(slot, np.asarray(ids, dtype=np.uint64))
    return job.store_rows(pref, SCHEMA.slot(slot).dim)


class TwoSlotLoss(torch.nn.Module):
    """Output = sum of the 'user' (sum slot) and 'tags' (raw slot) embeddings: every id
    occurrence then gets gradient 1 in every element."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))
        self.seen: list = []

    def forward(self, non_id_type_feature_tensors, id_type_feature_embedding_tensors):
        self.seen = [t.shape for t in id_type_feature_embedding_tensors]
        user, _item, tags = id_type_feature_embedding_tensors
        self.mask = tags.mask
        return user.sum() + tags.sum()


def test_forward_shapes_and_gradients_reach_the_owning_rows(job_factory):
    job = job_factory(SCHEMA)
    batch = make_batch(0, batch_size=16)
    job.feed([batch], background=False)
    model = TwoSlotLoss()
    with TrainCtx(SGD(lr=LR), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            non_id, emb, labels = ctx.prepare_features(tb)
            assert [t.shape for t in non_id] == [(16, 3)] and labels[0].shape == (16, 1)
            assert [tuple(e.shape) for e in emb] == [(16, 8), (16, 8), (16, 3, 4)]
            assert all(e.requires_grad for e in emb)
            feats = {f.name: f for f in batch.id_type_features}
            before = {s: (np.unique(feats[s].values), server_rows(job, s, np.unique(
                feats[s].values))) for s in ("user", "item", "tags")}
            output, _ = ctx.forward(tb)
            assert output.dim() == 0
            assert model.mask.shape == (16, 3) and model.mask.dtype == torch.bool
            assert torch.equal(tb.masks["tags"], model.mask)
            lengths = np.diff(feats["tags"].offsets)
            assert model.mask.sum(1).tolist() == np.minimum(lengths, 3).tolist()
            scaled = ctx.backward(output)
            assert scaled is output            # no loss scaling on the CPU
        assert ctx.stats()["pushed"] == 1
    # SGD on the server: every occurrence of an id took -LR from each element.
    counts = {"user": np.concatenate(feats["user"].data),
              "tags": np.concatenate([s[:3] for s in feats["tags"].data])}
    for slot, occurrences in counts.items():
        ids, rows = before[slot]
        n = (occurrences[None, :] == ids[:, None]).sum(1)
        np.testing.assert_allclose(server_rows(job, slot, ids), rows - LR * n[:, None],
                                   atol=1e-5)
    ids, rows = before["item"]      # unused by the model: no gradient, no update
    np.testing.assert_array_equal(server_rows(job, "item", ids), rows)


@pytest.mark.parametrize("second", ["forward", "prepare_features"])
def test_a_batch_prepared_twice_sends_the_gradient_of_every_use(job_factory, second):
    """A batch given to ``forward`` twice (two passes summed in one loss, as R-Drop
    does), or to ``prepare_features`` after its forward (to look at its features), gets
    the same embedding leaves each time: ``backward`` sends the gradient of every use.
    Each call made fresh leaves and kept only the last: the loss's gradient reached leaves
    that were not sent, and the batch was pushed with no (or half its) embedding update,
    counted as trained."""
    job = job_factory(SCHEMA)
    batch = make_batch(0, batch_size=16)
    job.feed([batch], background=False)
    model = TwoSlotLoss()
    feats = {f.name: f for f in batch.id_type_features}
    ids = np.unique(feats["user"].values)
    with TrainCtx(SGD(lr=LR), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            before = server_rows(job, "user", ids)   # inserted by the lookup
            output, _ = ctx.forward(tb)
            uses = 1
            if second == "forward":
                output = output + ctx.forward(tb)[0]
                uses = 2
            else:
                ctx.prepare_features(tb)
            ctx.backward(output)
    n = (np.concatenate(feats["user"].data)[None, :] == ids[:, None]).sum(1)
    np.testing.assert_allclose(server_rows(job, "user", ids),
                               before - uses * LR * n[:, None], atol=1e-5)


def test_with_continue_servers_and_workers_restarted_together_are_configured_again(
        job_factory):
    """With ``on_server_restart: continue``, every server and worker restarts between the
    NN's start and its first batch: no role is left that knows the job's configuration
    but the NN worker. Its first fetch names the digest, the worker refuses while no
    server holds one, the NN configures them again, and the batch is trained with the
    job's optimizer, not the defaults."""
    job = job_factory(SCHEMA, on_server_restart="continue")
    model = TwoSlotLoss()
    job_init = EmbeddingConfig((-0.001, 0.001))
    with TrainCtx(SGD(lr=LR), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=job_init, ready_timeout_s=10) as ctx:
        want = ctx.cluster.server_config
        assert want is not None and want["optimizer"] == SGD(lr=LR).to_dict()
        job.restart_all()
        assert job.servers[0].store.optimizer.to_dict() != want["optimizer"]  # defaults
        job.feed([make_batch(0, batch_size=16)], background=False)
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            for e in ctx.prepare_features(tb)[1]:   # rows from the job's init range
                assert float(e.detach().abs().max()) <= 0.001 * 4 + 1e-6   # <= 4 ids summed
            output, _ = ctx.forward(tb)
            ctx.backward(output)
        assert ctx.stats()["pushed"] == 1
    store = job.servers[0].store
    assert store.optimizer.to_dict() == want["optimizer"]
    assert store.embedding_config.to_dict() == want["embedding_config"]


def test_servers_and_workers_restarted_together_fail_the_training_loop(job_factory):
    """By default the same restart fails the NN's training loop naming the servers: they
    lost their tables (and never train with the defaults: nothing is served)."""
    job = job_factory(SCHEMA)
    model = TwoSlotLoss()
    with TrainCtx(SGD(lr=LR), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False,
                  ready_timeout_s=10) as ctx:
        job.restart_all()
        job.feed([make_batch(0, batch_size=16)], background=False)
        with pytest.raises(ServerRestarted, match="every server") as err:
            for _ in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
                pass
        assert job.servers[0].address in str(err.value)
        assert ctx.stats()["pushed"] == 0
    assert len(job.servers[0].store) == 0


@pytest.mark.parametrize("staleness", [1, 3])
def test_a_server_restarted_mid_training_fails_the_training_loop(job_factory, staleness):
    """A server restarts while the NN trains (between batches: the stream is idle, so no
    lookup meets the server while it is down): the training loop raises ServerRestarted
    naming it from the next lookup; it never trains on over the empty table."""
    job = job_factory(SCHEMA, servers=2)
    job.feed([make_batch(i) for i in range(3)])
    model = SumModel(3 + 8 + 8 + 4)
    trained = 0
    with train_ctx(job, model) as ctx:
        with pytest.raises(ServerRestarted) as err:
            for tb in DataLoader(StreamingDataset(), embedding_staleness=staleness,
                                 max_batches=12, timeout_ms=10_000):
                output, labels = ctx.forward(tb)
                ctx.backward(bce(output, labels))
                trained += 1
                if trained == 3:
                    deadline = time.monotonic() + 10
                    while ctx.stats()["pushed"] < 3 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    job.restart_server(1)
                    job.feed([make_batch(i) for i in range(3, 12)])
        msg = str(err.value)
        assert "embedding server 1" in msg and job.servers[1].address in msg
    assert trained == 3
    assert len(job.servers[1].store) == 0
    health = job.loop.run(job.workers[0]._health(None), timeout=10)
    assert health["ok"] is False and job.servers[1].address in health["error"]


def test_the_nn_side_follows_a_configuration_set_elsewhere(job_factory):
    """The API reconfigures the servers mid-job: the NN worker learns it from the next
    served batch, so it is what it would set again after a restart of every role."""
    job = job_factory(SCHEMA)
    model = TwoSlotLoss()
    with TrainCtx(SGD(lr=LR), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False,
                  ready_timeout_s=10) as ctx:
        first = ctx.cluster.server_config
        changed = {"optimizer": Adagrad(lr=0.2).to_dict()}

        async def as_the_api_does() -> None:
            async with RpcClient(job.servers[0].address) as server:
                await server.call("configure", changed)

        job.loop.run(as_the_api_does(), timeout=10)
        job.feed([make_batch(0, batch_size=16)], background=False)
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            output, _ = ctx.forward(tb)
            ctx.backward(output)
        now = ctx.cluster.server_config
    assert now["digest"] != first["digest"] and now["optimizer"] == changed["optimizer"]


def test_backward_misuse_is_refused(job_factory):
    job = job_factory(SCHEMA)
    forward_only = make_batch(2)
    forward_only = PersiaBatch(forward_only.id_type_features,
                               forward_only.non_id_type_features, forward_only.labels,
                               requires_grad=False)
    job.feed([make_batch(0), forward_only], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    with train_ctx(job, model) as ctx:
        with pytest.raises(Misuse, match="without a forward"):
            ctx.backward(torch.zeros(()))
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            output, labels = ctx.forward(tb)
            ctx.backward(bce(output, labels))
            with pytest.raises(Misuse):
                ctx.backward(bce(output, labels))
        # An evaluation lookup cannot be trained on.
        tb = ctx.get_embedding_from_data(make_batch(5))
        output, labels = ctx.forward(tb)
        with pytest.raises(Misuse, match="evaluation"):
            ctx.backward(bce(output, labels))
        # Nor can a stream batch sent with requires_grad=False: said as such, not as an
        # evaluation lookup the script never made.
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            output, labels = ctx.forward(tb)
            with pytest.raises(Misuse, match="requires_grad=False") as err:
                ctx.backward(bce(output, labels))
            assert err.value.field == "requires_grad"


def _poison(t):
    return _PoisonGrad.apply(t)


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward (only the embedding gradient is poisoned)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class PoisonModel(SumModel):
    def __init__(self):
        super().__init__(3 + 8 + 8 + 4)
        self.poison = False

    def forward(self, non_id, emb):
        if self.poison:
            emb = [_poison(emb[0]), *emb[1:]]
        return super().forward(non_id, emb)


@pytest.mark.parametrize("frequency,expected", [(3, 2), (1, 6), (0, 0)])
def test_finite_check_runs_every_k_steps(job_factory, frequency, expected):
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(6)])
    model = PoisonModel()
    model.poison = True
    with train_ctx(job, model) as ctx:
        changed = []
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, max_batches=6):
            before = [p.detach().clone() for p in model.parameters()]
            output, labels = ctx.forward(tb)
            ctx.backward(bce(output, labels), embedding_gradient_check_frequency=frequency)
            changed.append(any(not torch.equal(a, b) for a, b in
                               zip(before, model.parameters(), strict=True)))
        stats = ctx.stats()
    # Checked steps (0, k, 2k, ...) are skipped whole: no dense step, no embedding update.
    assert stats["nonfinite_steps"] == expected
    assert changed == [not (frequency and i % frequency == 0) for i in range(6)]
    # Unchecked poisoned steps still reach the worker, which drops the NaN slot and counts it.
    assert stats["worker_skipped_slots"] == 6 - expected
    assert stats["pushed"] == 6


def test_staleness_bounds_batches_in_flight(job_factory):
    job = job_factory(SCHEMA)
    worker = job.workers[0]
    for staleness in (1, 4):
        job.feed([make_batch(i) for i in range(30)])
        model = SumModel(3 + 8 + 8 + 4)
        peak = 0
        with train_ctx(job, model) as ctx:
            for tb in DataLoader(StreamingDataset(), embedding_staleness=staleness,
                                 max_batches=30):
                time.sleep(0.002)   # let the prefetcher run ahead as far as it may
                peak = max(peak, len(worker.inflight))
                output, labels = ctx.forward(tb)
                ctx.backward(bce(output, labels))
        assert 1 <= peak <= staleness, (staleness, peak)
        if staleness > 1:
            assert peak > 1, "the prefetcher never ran ahead"
        assert len(worker.inflight) == 0


def test_stopping_gives_prefetched_batches_back_in_order(job_factory):
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(10)], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    metas = []
    with train_ctx(job, model) as ctx:
        for max_batches in (3, 7):
            loader = DataLoader(StreamingDataset(), embedding_staleness=5, reproducible=True,
                                max_batches=max_batches)
            for tb in loader:
                # Give the prefetcher time to run ahead (on a loaded machine it may not
                # have pulled a batch past max_batches before the loop stops otherwise).
                deadline = time.monotonic() + 2.0
                while (len(job.workers[0].inflight) < min(5, 10 - len(metas))
                       and time.monotonic() < deadline):
                    time.sleep(0.005)
                metas.append(tb.meta)
                output, labels = ctx.forward(tb)
                ctx.backward(bce(output, labels))
            assert len(job.workers[0].inflight) == 0
        assert ctx.stats()["returned"] > 0
    assert metas == [f"batch-{i}".encode() for i in range(10)]


def test_a_batch_without_backward_is_released(job_factory):
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(4)], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    with train_ctx(job, model) as ctx:
        # With staleness 1 this would wait forever if the skipped batches kept their permit.
        seen = [tb.meta for tb in DataLoader(StreamingDataset(), embedding_staleness=1,
                                             max_batches=4, timeout_ms=5000)]
        stats = ctx.stats()
    assert len(seen) == 4 and len(job.workers[0].inflight) == 0
    # The first three were released at the next take (counted: 'pushed' counts their empty
    # pushes too); the last one went back to its worker untrained when the loop ended.
    assert stats["released_untrained"] == 3 and stats["steps"] == 0
    assert stats["returned"] == 1


def test_forward_only_batches_prefetched_when_a_loop_ends_reach_the_next_loop(job_factory):
    """Batches sent with requires_grad=False are settled by their worker when served, so
    the end of a loop (or a checkpoint cut) that handed back the prefetched ones dropped
    them, silently: the next DataLoader never saw them."""
    job = job_factory(SCHEMA)
    forward_only = [PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                                requires_grad=False, meta=b.meta)
                    for b in (make_batch(1), make_batch(2))]
    job.feed([make_batch(0), *forward_only], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    with train_ctx(job, model) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, max_batches=1):
            output, labels = ctx.forward(tb)
            ctx.backward(bce(output, labels))
            deadline = time.monotonic() + 10
            while ctx.stats()["served"] < 3:     # both prefetched behind it
                assert time.monotonic() < deadline
                time.sleep(0.01)
        later = [(tb.meta, tb.requires_grad) for tb in DataLoader(
            StreamingDataset(), embedding_staleness=2, timeout_ms=1500)]
    assert later == [(b"batch-1", False), (b"batch-2", False)]


def test_loss_backward_instead_of_ctx_backward_is_refused(job_factory):
    """A script that runs ``loss.backward()`` and its dense optimizer's step, the plain
    PyTorch way, instead of ``ctx.backward(loss)``: the embedding gradients it computed
    are never sent. Each batch was released without update at the next one, logged
    once, so the dense model trained while the embeddings never did and every batch was
    consumed. Taking the next batch now raises Misuse (a batch skipped without any
    gradient is still released, as above)."""
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(3)], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Misuse, match="ctx.backward") as err:
        with TrainCtx(Adagrad(lr=0.1), opt, model=model, mixed_precision=False,
                      embedding_workers=job.worker_addresses, ready_timeout_s=10) as ctx:
            for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=3,
                                 timeout_ms=5000):
                output, labels = ctx.forward(tb)
                bce(output, labels).backward()
                opt.step()
                opt.zero_grad()
    assert err.value.field == "backward" and ctx.stats()["steps"] == 0
    assert len(job.workers[0].inflight) == 0     # released, and the rest handed back


def test_a_loss_over_a_released_batch_is_refused(job_factory):
    """Gradients accumulated over two batches (the loss of one summed with the next's,
    one ``backward``): the first was released untrained when the second was taken, so
    its embedding gradients could not be sent, and only the second batch's embeddings
    were trained while the dense model took both. Now that backward raises Misuse and
    applies nothing."""
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(2)], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    with train_ctx(job, model) as ctx:
        before = [p.detach().clone() for p in model.parameters()]
        held = None
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, max_batches=2,
                             timeout_ms=5000):
            output, labels = ctx.forward(tb)
            loss = bce(output, labels)
            if held is None:
                held = loss
                continue
            with pytest.raises(Misuse, match="released before") as err:
                ctx.backward(held + loss)
            assert err.value.field == "loss"
        assert ctx.stats()["steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(job.workers[0].inflight) == 0


def _with_event_time(b, event_time):
    return PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                       requires_grad=b.requires_grad, meta=b.meta, event_time=event_time)


def test_event_times_reach_the_training_batches_and_the_servers_trained_through(
        job_factory):
    """Issue 18: a batch's event time goes through DataCtx and a real embedding worker to
    the NN's PersiaTrainingBatch, and with its gradients to every embedding server, whose
    ``health`` then says ``trained_through``: the newest event time applied (a max: the
    times need not arrive in order)."""
    job = job_factory(SCHEMA, servers=2)
    clients = [RpcClient(s.address, timeout_ms=5000) for s in job.servers]

    def trained_through() -> list:
        return [job.loop.run(c.call("health"), 10)["trained_through"] for c in clients]

    assert trained_through() == [None, None]
    given = [1_750_000_000.5, 1_750_000_030.25, 1_750_000_010.0]
    batches = [_with_event_time(make_batch(i), t) for i, t in enumerate(given)]
    before = time.time()
    batches.append(make_batch(3))          # no event time: DataCtx stamps its clock
    job.feed(batches, background=False)
    after = time.time()
    model = SumModel(3 + 8 + 8 + 4)
    seen = []
    try:
        with train_ctx(job, model) as ctx:
            for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=4,
                                 timeout_ms=5000):
                seen.append((tb.meta, tb.event_time))
                output, labels = ctx.forward(tb)
                ctx.backward(bce(output, labels))
                if len(seen) == 3:   # the three given times applied, the stamped one not yet
                    assert trained_through() == [max(given)] * 2
        assert [m for m, _ in seen] == [b"batch-0", b"batch-1", b"batch-2", b"batch-3"]
        assert [t for _, t in seen[:3]] == given
        stamped = seen[3][1]
        assert before <= stamped <= after
        assert trained_through() == [stamped] * 2       # both servers got every update
        # Evaluation: the user's batches, looked up directly, keep their event time too.
        with eval_ctx(model=model, embedding_workers=job.worker_addresses):
            eval_batches = [_with_event_time(make_batch(9, requires_grad=False), 42.5),
                            make_batch(10, requires_grad=False)]
            got = [tb.event_time for tb in DataLoader(IterableDataset(iterable=eval_batches))]
        assert got == [42.5, None]
        assert trained_through() == [stamped] * 2       # lookups apply nothing
    finally:
        for c in clients:
            job.loop.run(c.close(), 10)


def _train(job, batches, staleness, seed=0, *, reproducible=False):
    setup_seed(seed)
    model = SumModel(13)
    with train_ctx(job, model) as ctx:
        ctx.clear_embeddings()
        feeder = job.feed(batches)
        loader = DataLoader(StreamingDataset(10), embedding_staleness=staleness,
                            reproducible=reproducible, max_batches=len(batches))
        for tb in loader:
            output, labels = ctx.forward(tb)
            ctx.backward(bce(output, labels))
        feeder.join(10)
        assert ctx.stats()["steps"] == len(batches)
    return model


def _auc(job, model) -> float:
    scores, ys = [], []
    model.eval()
    with eval_ctx(model=model, embedding_workers=job.worker_addresses) as ctx, torch.no_grad():
        rows = ctx.get_embedding_size()
        data = IterableDataset(iterable=learnable_batches(20, seed=99, requires_grad=False))
        for tb in DataLoader(data, forward_buffer_size=4):
            output, labels = ctx.forward(tb)
            scores.append(output.numpy().ravel())
            ys.append(labels[0].numpy().ravel())
        assert ctx.get_embedding_size() == rows, "evaluation lookups must not insert"
    return roc_auc(np.concatenate(ys), np.concatenate(scores))


def test_hybrid_reaches_the_synchronous_auc(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    batches = learnable_batches(200)
    sync_auc = _auc(job, _train(job, batches, staleness=1))
    hybrid_auc = _auc(job, _train(job, batches, staleness=8))
    assert sync_auc > 0.85, "the stream is learnable: the model should learn it"
    assert abs(hybrid_auc - sync_auc) < 0.005, (sync_auc, hybrid_auc)


def test_reproducible_synchronous_runs_are_identical(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    batches = learnable_batches(30, 64, seed=5)
    runs = []
    for _ in range(2):
        model = _train(job, batches, staleness=1, seed=3, reproducible=True)
        ids = np.arange(50, dtype=np.uint64)
        rows = job.store_rows(LEARNABLE_SCHEMA.prefix_ids("a", ids), 4)
        runs.append(({k: v.clone() for k, v in model.state_dict().items()}, rows))
    (dense_a, rows_a), (dense_b, rows_b) = runs
    assert all(torch.equal(dense_a[k], dense_b[k]) for k in dense_a)
    np.testing.assert_array_equal(rows_a, rows_b)
    assert np.abs(rows_a).max() > 0.05, "the embeddings trained"


def test_pipelined_sends_to_one_worker_are_served_in_the_order_sent(job_factory):
    """DataCtx keeps up to max_inflight ingest calls in flight; with a one-batch ready
    buffer they all wait for room on the worker, and must go in, and come out, in the
    order they were sent. A newcomer took room freed for a waiting one, which made two
    reproducible runs differ under CPU load; that race needs frames read in one loop
    iteration, so its deterministic cases are in tests/worker/test_buffer.py."""
    job = job_factory(LEARNABLE_SCHEMA, ready_buffer_batches=1)
    batches = learnable_batches(40, 8, seed=2)
    for i, b in enumerate(batches):
        b.meta = str(i).encode()
    feeder = job.feed(batches)
    model = SumModel(13)
    with train_ctx(job, model) as ctx:
        loader = DataLoader(StreamingDataset(10), embedding_staleness=1,
                            reproducible=True, max_batches=len(batches))
        order = []
        for tb in loader:
            order.append(int(tb.meta))
            output, labels = ctx.forward(tb)
            ctx.backward(bce(output, labels))
    feeder.join(10)
    assert order == list(range(len(batches)))


def test_inference_ctx_needs_no_labels_and_never_inserts(job_factory):
    job = job_factory(SCHEMA)
    model = SumModel(3 + 8 + 8 + 4)
    batch = make_batch(3, requires_grad=False)
    with InferCtx(job.worker_addresses, model=model) as ctx:
        tb = ctx.get_embedding_from_bytes(batch.to_bytes())
        assert tb.labels is None and tb.missing > 0
        with torch.no_grad():
            output, labels = ctx.forward(tb)
        assert labels is None and output.shape == (16, 1)
    assert job.rows() == 0
    with eval_ctx(model=model, embedding_workers=job.worker_addresses) as ctx:
        with pytest.raises(Exception, match="labels"):
            ctx.forward(ctx.get_embedding_from_data(batch))


def test_async_push_failure_surfaces_on_the_next_call(job_factory):
    """The worker retries the server for push_retry_ms, then fails the batch: the NN side
    gets a typed PushFailed naming the batch and the server, and the worker keeps the
    batch failed (named by its frontier), not silently in flight."""
    job = job_factory(SCHEMA, push_retry_ms=600)
    job.feed([make_batch(i) for i in range(3)], background=False)
    model = SumModel(3 + 8 + 8 + 4)
    ctx = train_ctx(job, model)
    ctx.__enter__()
    try:
        loader = iter(DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=3))
        tb = next(loader)
        output, labels = ctx.forward(tb)
        address = job.servers[0].address
        job.loop.run(job.servers[0].stop(), timeout=10)   # the update cannot be applied
        ctx.backward(bce(output, labels))
        deadline = time.monotonic() + 20
        with pytest.raises(PushFailed) as err:
            while time.monotonic() < deadline:
                ctx.forward(tb)
                time.sleep(0.05)
        assert err.value.field == "batch_id"
        assert f"batch {tb.batch_id}" in str(err.value) and address in str(err.value)
        assert "PeerUnavailable" not in str(err.value) and "refused" in str(err.value)
        front = job.loop.run(job.workers[0]._frontier(None), timeout=10)
        assert [f["batch_id"] for f in front["failed"]] == [tb.batch_id]
        assert front["failed"][0]["servers"] == [address]
        ctx.forward(tb)      # surfaced once; the context is usable for what still works
    finally:
        ctx.__exit__(None, None, None)


def test_feed_thread_is_not_left_behind():
    # The helpers' feeder threads are daemons; a test suite must not leave other threads.
    left = [t.name for t in threading.enumerate()
            if not t.daemon and t is not threading.main_thread()]
    assert not left, f"non-daemon threads left running: {left}"


def test_a_crashed_prefetch_task_reaches_the_training_thread():
    """The prefetcher's main task is supervised: if it dies (here: a cluster left with no
    worker, so choosing the next one divides by zero), the training thread's next get()
    raises its error instead of waiting as if the stream had run dry."""
    from types import SimpleNamespace

    from stream_persia.core.aio import LoopThread
    from stream_persia.nn.loader import StreamPrefetcher

    with LoopThread(name="test-prefetch") as lt:
        cluster = SimpleNamespace(workers=[None], loop=lt)
        prefetcher = StreamPrefetcher(cluster, staleness=1, buffer_size=1)
        cluster.workers = []
        lt.run(prefetcher.start())
        with pytest.raises(ZeroDivisionError):
            prefetcher.get(timeout_s=10)
        assert not prefetcher.running


@pytest.mark.parametrize("value", ["false", "True", None, 2, 0.5])
def test_mixed_precision_must_be_a_bool(value):
    """``bool(mixed_precision)`` read ``"false"`` (an environment variable passed on) as
    True: float16 autocast on CUDA that the script asked to leave off."""
    model = SumModel(13)
    with pytest.raises(Misuse) as err:
        TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                 embedding_workers=["127.0.0.1:1"], mixed_precision=value)
    assert err.value.field == "mixed_precision"
    for ok in (True, False, 1, 0):
        ctx = TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1),
                       model=model, embedding_workers=["127.0.0.1:1"], mixed_precision=ok)
        assert ctx.mixed_precision is (bool(ok) and ctx.device.type == "cuda")
