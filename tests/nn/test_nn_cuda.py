"""Forward/backward on CUDA with mixed precision (torch.amp autocast + GradScaler).

Runs only where CUDA exists; elsewhere every test here is skipped with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nn_helpers import SumModel

from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import SGD, Adagrad
from stream_persia.testing.samples import SCHEMA, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: torch.cuda.is_available() is False here, and "
                              "mixed precision (autocast + GradScaler) runs only on CUDA"),
]

LR = 0.5
IN_DIM = 3 + 8 + 8 + 4


def _ctx(job, model, emb_opt, **kw):
    return TrainCtx(emb_opt, torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                    device_id=0, mixed_precision=True, embedding_workers=job.worker_addresses,
                    ready_timeout_s=10, **kw)


def test_mixed_precision_forward_backward(job_factory):
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(6)], background=False)
    model = SumModel(IN_DIM, hidden=16).cuda(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _ctx(job, model, Adagrad(lr=0.1)) as ctx:
        assert ctx.mixed_precision and ctx.grad_scaler is not None
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, max_batches=6):
            non_id, emb, labels = ctx.prepare_features(tb)
            assert all(t.is_cuda for t in [*non_id, *emb, *labels])
            output, labels = ctx.forward(tb)
            assert output.dtype == torch.float16, "autocast runs the MLP in float16"
            loss = torch.nn.functional.binary_cross_entropy(output.float(), labels[0])
            scale = ctx.grad_scaler.get_scale()
            scaled = ctx.backward(loss)
            assert scaled.item() == pytest.approx(loss.item() * scale, rel=1e-3)
        stats = ctx.stats()
    assert stats["pushed"] == 6 and stats["steps"] == 6
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(job.workers[0].inflight) == 0


class _UserSum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, non_id_type_feature_tensors, id_type_feature_embedding_tensors):
        return (id_type_feature_embedding_tensors[0] * self.w).sum()


def test_embedding_gradients_are_sent_unscaled(job_factory):
    job = job_factory(SCHEMA)
    batch = make_batch(0)
    job.feed([batch], background=False)
    model = _UserSum().cuda(0)
    user = next(f for f in batch.id_type_features if f.name == "user")
    ids = np.unique(user.values)
    pref = SCHEMA.prefix_ids("user", ids)
    with _ctx(job, model, SGD(lr=LR)) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            rows = job.store_rows(pref, 8)
            output, _ = ctx.forward(tb)
            assert ctx.grad_scaler.get_scale() > 1
            ctx.backward(output)
    # d(output)/d(row) is 1 per occurrence: the loss scale must not reach the servers.
    count = (np.concatenate(user.data)[None, :] == ids[:, None]).sum(1)
    np.testing.assert_allclose(job.store_rows(pref, 8),
                               rows - LR * count[:, None], atol=1e-3)
