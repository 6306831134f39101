"""Local embeddings (no sockets): pooling a micro-batch of requests in one pass gives each
request exactly what it gets alone, and the per-request count of missing ids, through
summation, sqrt-scaled, raw, hash-stacked and feature-grouped slots."""

from __future__ import annotations

import numpy as np
import torch
from stream_persia.api.embeddings import CheckpointTable, cat_slots, concat_features, non_id_tensors

from stream_persia.config import EmbeddingSchema
from stream_persia.embedding.data import IDTypeFeature, NonIDTypeFeature, PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.server.store import EmbeddingStore
from stream_persia.worker import batchplan, pooling

SCHEMA = EmbeddingSchema.from_dict({
    "feature_index_prefix_bit": 8,
    "slots_config": {
        "user": {"dim": 4},
        "item": {"dim": 4, "sqrt_scaling": True},
        "tags": {"dim": 3, "embedding_summation": False, "sample_fixed_size": 2},
        "city": {"dim": 3, "embedding_summation": False, "sample_fixed_size": 3,
                 "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 40}},
        "query": {"dim": 4, "hash_stack_config": {"hash_stack_rounds": 3,
                                                  "embedding_size": 50}},
    },
    "feature_groups": {"shared": ["user", "item"]},
})


def request(rng: np.random.Generator, size: int, vocab: int) -> PersiaBatch:
    feats = [IDTypeFeature(name, [rng.integers(0, vocab, rng.integers(0, 5)).astype(np.uint64)
                                  for _ in range(size)]) for name in SCHEMA.slots]
    return PersiaBatch(feats, [NonIDTypeFeature(rng.normal(size=(size, 2)).astype(np.float32),
                                                "dense")], requires_grad=False)


def table_with_some_rows(rng: np.random.Generator) -> CheckpointTable:
    """A store holding a random half of the rows of ids 0..29 of every slot."""
    store = EmbeddingStore(100_000, SGD(lr=0.0))
    ids = np.arange(30, dtype=np.uint64)
    for slot in SCHEMA.slots.values():
        plan = pooling.plan_slot(ids, np.arange(31), slot, SCHEMA.feature_index_prefix_bit,
                                 requires_grad=False)
        keep = plan.lookup_ids[rng.random(len(plan.lookup_ids)) < 0.5]
        store.load([{"dim": slot.dim, "ids": keep,
                     "weights": rng.normal(size=(len(keep), slot.dim)).astype(np.float32)}])
    return CheckpointTable(store, SCHEMA)


def missing_alone(table: CheckpointTable, batch: PersiaBatch) -> int:
    """The embedding worker's definition: distinct looked-up ids absent, per dim."""
    plan = batchplan.plan_batch(batch.id_type_features, SCHEMA, requires_grad=False,
                                server_pooling=False)
    merged = pooling.merge_lookups(plan.classic)
    return sum(int((~table.store.contains(m.ids)).sum()) for m in merged.values())


def test_a_micro_batch_equals_its_requests_one_by_one():
    rng = np.random.default_rng(0)
    table = table_with_some_rows(rng)
    batches = [request(rng, size, vocab=45) for size in (1, 3, 2, 5, 1)]
    merged, missing = table.embed(batches)
    alone = [table.embed([b]) for b in batches]
    expected = cat_slots([a[0] for a in alone])
    assert len(merged) == len(expected) == len(SCHEMA.slots)
    for got, want in zip(merged, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert hasattr(got, "mask") == hasattr(want, "mask")
        if hasattr(got, "mask"):
            assert torch.equal(got.mask, want.mask)
    assert missing == [a[1][0] for a in alone] == [missing_alone(table, b) for b in batches]
    assert sum(missing) > 0 and min(missing) >= 0
    assert non_id_tensors(batches)[0].shape == (12, 2)


def test_concat_features_keeps_every_sample():
    rng = np.random.default_rng(1)
    batches = [request(rng, size, vocab=10) for size in (2, 1, 3)]
    for j, feature in enumerate(concat_features(batches)):
        want = [x.tolist() for b in batches for x in b.id_type_features[j].data]
        assert [x.tolist() for x in feature.data] == want
