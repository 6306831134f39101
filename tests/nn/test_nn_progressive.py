"""Progressive validation in ``TrainCtx`` against a real job in this process: it scores
each batch's pre-update predictions, names multi-task heads, can be turned off, and does
not change what training computes."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from nn_helpers import LEARNABLE_SCHEMA, SumModel, learnable_batches

from stream_persia.config import ProgressiveConfig
from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.data import Label, PersiaBatch
from stream_persia.embedding.optim import Adagrad
from stream_persia.utils import setup_seed


def ref_auc(p: np.ndarray, y: np.ndarray) -> float:
    pos, neg = p[y == 1][:, None], p[y == 0][None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def train(job, model, batches, progressive, loss=None):
    """Train ``batches`` synchronously and reproducibly; returns (ctx, the predictions
    and labels of every forward, the embedding rows of slot a)."""
    seen = []
    with TrainCtx(Adagrad(lr=0.1), torch.optim.Adam(model.parameters(), lr=0.01),
                  model=model, embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=EmbeddingConfig((-0.01, 0.01)), ready_timeout_s=10,
                  progressive=progressive) as ctx:
        ctx.clear_embeddings()
        feeder = job.feed(batches)
        loader = DataLoader(StreamingDataset(10), embedding_staleness=1, reproducible=True,
                            max_batches=len(batches))
        for tb in loader:
            output, labels = ctx.forward(tb)
            seen.append((output, labels))
            ctx.backward(loss(output, labels) if loss else
                         torch.nn.functional.binary_cross_entropy(output, labels[0]))
        feeder.join(10)
        result = ctx.progressive()
    rows = job.store_rows(LEARNABLE_SCHEMA.prefix_ids("a", np.arange(50, dtype=np.uint64)), 4)
    return ctx, result, seen, rows


def test_progressive_metrics_score_the_pre_update_predictions_and_change_nothing(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    batches = learnable_batches(12, 64, seed=7)
    runs = {}
    for on in (True, False):
        setup_seed(3)
        model = SumModel(13)
        cfg = ProgressiveConfig(enabled=on, window_samples=500)
        ctx, result, seen, rows = train(job, model, batches, cfg)
        runs[on] = ({k: v.clone() for k, v in model.state_dict().items()}, rows, result, seen)
    (dense_on, rows_on, result, seen), (dense_off, rows_off, off, _) = runs[True], runs[False]
    assert all(torch.equal(dense_on[k], dense_off[k]) for k in dense_on), \
        "progressive validation changed the dense model"
    np.testing.assert_array_equal(rows_on, rows_off)
    assert off == {}
    p = np.concatenate([o.detach().numpy().ravel() for o, _ in seen])
    y = np.concatenate([lb[0].numpy().ravel() for _, lb in seen])
    m = result["task0"]
    assert m["samples"] == 12 * 64 and m["window_samples"] == 500 and m["skipped"] == 0
    # the outputs kept were computed before each update: the metrics are theirs
    assert m["auc"] == pytest.approx(ref_auc(p[-500:], y[-500:]), rel=1e-9)
    assert m["calibration"] == pytest.approx(p[-500:].sum() / y[-500:].sum(), rel=1e-5)
    assert 0 < m["ne"] < 1.5 and 0 < m["lifetime_ne"] < 1.5


class TwoHeads(torch.nn.Module):
    """Two sigmoid heads (a tuple), named by ``tasks``."""

    tasks = ["click", "buy"]

    def __init__(self):
        super().__init__()
        self.a, self.b = SumModel(13), SumModel(13)

    def forward(self, non_id, emb):
        return self.a(non_id, emb), self.b(non_id, emb)


def two_labels(b: PersiaBatch) -> PersiaBatch:
    y = b.labels[0].data
    return PersiaBatch(b.id_type_features, non_id_type_features=b.non_id_type_features,
                       labels=[Label(y, "click"), Label(1 - y, "buy")], requires_grad=True)


def test_a_multi_task_model_gets_one_entry_per_named_head(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    batches = [two_labels(b) for b in learnable_batches(6, 64, seed=2)]

    def loss(out, labels):
        f = torch.nn.functional.binary_cross_entropy
        return f(out[0], labels[0]) + f(out[1], labels[1])

    _, result, seen, _ = train(job, TwoHeads(), batches, ProgressiveConfig(), loss)
    assert list(result) == ["click", "buy"]
    for i, task in enumerate(result):
        p = np.concatenate([o[i].detach().numpy().ravel() for o, _ in seen])
        y = np.concatenate([lb[i].numpy().ravel() for _, lb in seen])
        assert result[task]["samples"] == 6 * 64
        assert result[task]["auc"] == pytest.approx(ref_auc(p, y), rel=1e-9)


class ScalarOut(SumModel):
    def forward(self, non_id, emb):
        return super().forward(non_id, emb).mean()


def test_a_model_whose_output_does_not_pair_with_its_labels_trains_on_without_it(
        job_factory, caplog):
    job = job_factory(LEARNABLE_SCHEMA)
    with caplog.at_level(logging.WARNING):
        ctx, result, _, _ = train(job, ScalarOut(13), learnable_batches(3, 32), None,
                                  lambda out, labels: out)
    assert result == {} and ctx.stats()["steps"] == 3
    assert ctx.progressive_off.startswith("predictions: ")
    assert "progressive validation is off" in caplog.text
