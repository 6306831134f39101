"""Small schema, batch makers and naive references shared by runtime tests and load tests."""

from __future__ import annotations

import numpy as np

from stream_persia.config import EmbeddingSchema
from stream_persia.core.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch

SCHEMA_DICT = {
    "feature_index_prefix_bit": 8,
    "slots_config": {
        "user": {"dim": 8},
        "item": {"dim": 8, "sqrt_scaling": True},
        "tags": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 3},
    },
}
SCHEMA = EmbeddingSchema.from_dict(SCHEMA_DICT)

EMBEDDING_YAML = """\
feature_index_prefix_bit: 8
slots_config:
  user: {dim: 8}
  item: {dim: 8, sqrt_scaling: true}
  tags: {dim: 4, embedding_summation: false, sample_fixed_size: 3}
"""


def make_batch(i: int, batch_size: int = 16, *, seed: int = 0, vocab: int = 50,
               requires_grad: bool = True) -> PersiaBatch:
    """A batch tagged ``meta=b"batch-<i>"`` with 1–4 ids per sample per slot."""
    rng = np.random.default_rng(seed * 100_003 + i)
    feats = []
    for name in ("user", "item", "tags"):
        lens = rng.integers(0 if name == "tags" else 1, 5, size=batch_size)
        feats.append(IDTypeFeature(name, [rng.integers(0, vocab, size=n).astype(np.uint64)
                                          for n in lens]))
    dense = rng.normal(size=(batch_size, 3)).astype(np.float32)
    label = (rng.random((batch_size, 1)) < 0.3).astype(np.float32)
    return PersiaBatch(feats, non_id_type_features=[NonIDTypeFeature(dense, "dense")],
                       labels=[Label(label, "click")] if requires_grad else None,
                       requires_grad=requires_grad, meta=f"batch-{i}".encode())


def naive_sum(feature_lists, rows_of, sqrt_scaling=False):
    """Per-sample sum of rows (``rows_of(id) -> row``), PERSIA's summation pooling."""
    out = []
    for ids in feature_lists:
        acc = sum((rows_of(int(x)) for x in ids), np.zeros_like(rows_of(0)))
        if sqrt_scaling and len(ids):
            acc = acc / np.sqrt(len(ids))
        out.append(acc)
    return np.stack(out).astype(np.float32)
