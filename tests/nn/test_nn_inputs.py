"""Hostile but legitimate batches on the NN side: the model's positional inputs keep the
order of the first batch trained (batches whose data loader sends slots, named non-ID
features or labels in another order are arranged by name, and one with another set of
them is refused, naming it: never fed misplaced), and a NaN label skips its step rather
than turn the dense model NaN for good."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nn_helpers import LEARNABLE_SCHEMA, LEARNABLE_SLOTS, SumModel, learnable_batches

from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.data import Label, NonIDTypeFeature, PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.errors import BadInput
from stream_persia.nn.batch import EmbeddingSlot, PersiaTrainingBatch, arrange
from stream_persia.testing.samples import SCHEMA, make_batch


class FirstSlotLoss(torch.nn.Module):
    """Output = the sum of the first slot's embeddings: only its rows get gradients."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, non_id_type_feature_tensors, id_type_feature_embedding_tensors):
        return id_type_feature_embedding_tensors[0].sum() + self.p.sum()


def _reordered(batch: PersiaBatch, order: list[str]) -> PersiaBatch:
    feats = {f.name: f for f in batch.id_type_features}
    return PersiaBatch([feats[n] for n in order], batch.non_id_type_features, batch.labels,
                       meta=batch.meta)


def _rows(job, slot: str, batch: PersiaBatch) -> np.ndarray:
    ids = np.unique(next(f for f in batch.id_type_features if f.name == slot).values)
    return job.store_rows(SCHEMA.prefix_ids(slot, ids), SCHEMA.slot(slot).dim)


def test_slots_in_another_order_reach_the_model_as_first_trained(job_factory):
    job = job_factory(SCHEMA)
    b0 = make_batch(0)
    b1 = _reordered(make_batch(1), ["item", "user", "tags"])
    b2 = _reordered(make_batch(2), ["user", "tags"])          # 'item' missing
    job.feed([b0, b1, b2], background=False)
    model = FirstSlotLoss()
    seen, before = [], {}
    with pytest.raises(BadInput) as err, \
            TrainCtx(SGD(lr=0.5), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                     embedding_workers=job.worker_addresses, mixed_precision=False,
                     embedding_config=EmbeddingConfig((-0.01, 0.01))) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=3):
            if tb.meta == b"batch-1":   # b0 applied (staleness 1): b1's rows as served
                before = {s: _rows(job, s, b1) for s in ("user", "item")}
            output, _ = ctx.forward(tb)
            seen.append([s.name for s in tb.id_type_feature_embeddings])
            ctx.backward(output)
    assert seen == [["user", "item", "tags"]] * 2
    assert err.value.field == "id_type_features.item" and "missing ['item']" in str(err.value)
    # b1's gradient went to the slot the model reads first ('user'), not to 'item'.
    assert not np.array_equal(_rows(job, "user", b1), before["user"])
    np.testing.assert_array_equal(_rows(job, "item", b1), before["item"])


def _batch(slots, non_id, labels) -> PersiaTrainingBatch:
    return PersiaTrainingBatch(
        non_id_type_features=[torch.full((2, 1), float(i)) for i, _ in enumerate(non_id)],
        non_id_type_feature_names=list(non_id),
        labels=[torch.full((2, 1), float(i)) for i, _ in enumerate(labels)],
        label_names=list(labels),
        id_type_feature_embeddings=[EmbeddingSlot(n, "sum", torch.zeros(2, 1)) for n in slots],
        batch_size=2)


SIG = {"id_type_features": ["a", "b"],
       "non_id_type_features": [{"name": "x", "dtype": "float32", "shape": [1]},
                                {"name": "y", "dtype": "float32", "shape": [1]}]}


def test_named_features_and_labels_are_arranged_by_name():
    tb = _batch(["b", "a"], ["y", "x"], ["ctr", "cvr"])
    arrange(tb, SIG, ["cvr", "ctr"])
    assert [s.name for s in tb.id_type_feature_embeddings] == ["a", "b"]
    assert tb.non_id_type_feature_names == ["x", "y"]
    assert [float(t[0, 0]) for t in tb.non_id_type_features] == [1.0, 0.0]
    assert tb.label_names == ["cvr", "ctr"] and [float(t[0, 0]) for t in tb.labels] == [1, 0]


@pytest.mark.parametrize("slots, non_id, labels, field", [
    (["a", "b", "c"], ["x", "y"], ["ctr"], "id_type_features.c"),
    (["a", "b"], ["x"], ["ctr"], "non_id_type_features.y"),
    (["a", "b"], ["x", "y"], ["cvr"], "labels.ctr"),
    (["a", "a"], ["x", "y"], ["ctr"], "id_type_features.b"),
])
def test_another_set_of_inputs_is_refused_naming_it(slots, non_id, labels, field):
    with pytest.raises(BadInput) as err:
        arrange(_batch(slots, non_id, labels), SIG, ["ctr"])
    assert err.value.field == field


def test_anonymous_features_stay_positional_and_cannot_change_count():
    anon = {"id_type_features": ["a"],
            "non_id_type_features": [{"name": "non_id_type_feature_anonymous"}] * 2}
    tb = _batch(["a"], ["non_id_type_feature_anonymous"] * 2, [])
    arrange(tb, anon)
    assert [float(t[0, 0]) for t in tb.non_id_type_features] == [0.0, 1.0]
    with pytest.raises(BadInput, match="a name twice|not distinct") as err:
        arrange(_batch(["a"], ["non_id_type_feature_anonymous"] * 3, []), anon)
    assert err.value.field == "non_id_type_features"


def test_a_nan_label_skips_its_step_instead_of_poisoning_the_dense_model(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    batches = learnable_batches(4, 32)
    label = batches[1].labels[0].data.copy()
    label[5, 0] = np.nan                      # one bad label, on a step the k-check skips
    b = batches[1]
    batches[1] = PersiaBatch(b.id_type_features, b.non_id_type_features,
                             [Label(label, "click")])
    job.feed(batches)
    model = SumModel(sum(LEARNABLE_SCHEMA.slot(s).dim for s in LEARNABLE_SLOTS) + 1)
    losses = []
    with TrainCtx(SGD(lr=0.1), torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=EmbeddingConfig((-0.01, 0.01))) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=4):
            output, labels = ctx.forward(tb)
            logits = torch.logit(output.clamp(1e-6, 1 - 1e-6))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[0])
            ctx.backward(loss, embedding_gradient_check_frequency=20)
            losses.append(float(loss.detach()))
        stats = ctx.stats()
    assert np.isnan(losses[1]) and np.isfinite([losses[0], *losses[2:]]).all()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert stats["nonfinite_steps"] == stats["nonfinite_dense_steps"] == 1
    assert stats["pushed"] == 4


def test_a_feature_whose_width_changes_is_refused_naming_it():
    """'x' grows a column while 'y' loses one: the total width stays 3, so a model that
    concatenates them would read every column after 'x' one place off, silently."""
    sig = {"id_type_features": ["a", "b"],
           "non_id_type_features": [{"name": "x", "dtype": "float32", "shape": [1]},
                                    {"name": "y", "dtype": "float32", "shape": [2]}]}
    ok = _batch(["a", "b"], ["y", "x"], [])
    ok.non_id_type_features = [torch.zeros(2, 2), torch.zeros(2, 1)]   # y, x: as trained
    arrange(ok, sig)
    assert [list(t.shape) for t in ok.non_id_type_features] == [[2, 1], [2, 2]]
    bad = _batch(["a", "b"], ["x", "y"], [])
    bad.non_id_type_features = [torch.zeros(2, 2), torch.zeros(2, 1)]
    with pytest.raises(BadInput, match=r"\[2\].*\[1\]") as err:
        arrange(bad, sig)
    assert err.value.field == "non_id_type_features.x"
    # A dtype change is no misalignment: let through (a model that casts reads the same).
    cast = _batch(["a", "b"], ["x", "y"], [])
    cast.non_id_type_features = [torch.zeros(2, 1, dtype=torch.float64),
                                 torch.zeros(2, 2, dtype=torch.int64)]
    arrange(cast, sig)


def _widened(batch: PersiaBatch, width: int) -> PersiaBatch:
    n = batch.non_id_type_features[0].data.shape[0]
    return PersiaBatch(batch.id_type_features,
                       [NonIDTypeFeature(np.ones((n, width), np.float32), "one")],
                       batch.labels)


def test_a_width_change_mid_stream_stops_training_before_the_model_sees_it(job_factory):
    job = job_factory(LEARNABLE_SCHEMA)
    batches = learnable_batches(3, 16)
    batches[2] = _widened(batches[2], 2)
    job.feed(batches, background=False)

    class SliceModel(torch.nn.Module):   # reads column 0 only: no shape error of its own
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, non_id, emb):
            return torch.sigmoid(non_id[0][:, :1] * self.w + sum(e.sum(1, keepdim=True)
                                                                 for e in emb))

    model = SliceModel()
    steps = []
    with pytest.raises(BadInput) as err, \
            TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                     embedding_workers=job.worker_addresses, mixed_precision=False,
                     embedding_config=EmbeddingConfig((-0.01, 0.01))) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=3):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            steps.append(ctx.steps)
    assert err.value.field == "non_id_type_features.one" and steps == [1, 2]


class TwoSlotModel(SumModel):
    """Reads slots 'a' and 'b' only ('c' is looked up and served, never used); its
    ``extra`` layer is left out of the optimizer below."""

    def __init__(self):
        super().__init__(1 + 4 + 4)
        self.extra = torch.nn.Linear(1, 1)

    def forward(self, non_id, emb):
        out = super().forward(non_id, emb[:2])
        return torch.sigmoid(torch.logit(out) + self.extra(non_id[0]))


def test_slots_the_loss_never_reaches_are_counted_and_said_once(job_factory, caplog):
    job = job_factory(LEARNABLE_SCHEMA)
    job.feed(learnable_batches(3, 16), background=False)
    model = TwoSlotModel()
    with caplog.at_level("WARNING", logger="stream_persia.nn.train_ctx"), \
            TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.mlp.parameters(), lr=0.1),
                     model=model, embedding_workers=job.worker_addresses,
                     mixed_precision=False,
                     embedding_config=EmbeddingConfig((-0.01, 0.01))) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=3):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        stats = ctx.stats()
    assert stats["steps"] == 3 and stats["gradless_slots"] == 3
    said = [r.getMessage() for r in caplog.records if "no update" in r.getMessage()]
    assert len(said) == 1 and "'c'" in said[0] and "'a'" not in said[0]
    # The layer outside the optimizer got gradients and is never stepped: said once too.
    outside = [r.getMessage() for r in caplog.records
               if "does not hold" in r.getMessage()]
    assert len(outside) == 1 and "extra.weight" in outside[0]
