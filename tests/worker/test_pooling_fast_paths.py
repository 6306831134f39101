"""The planning and pooling fast paths agree with the plain numpy definitions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_persia.kernels.ids import unique_inverse
from stream_persia.worker import pooling


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=200), st.integers(0, 3))
def test_unique_inverse_matches_np_unique(values, spread):
    # spread 0: full 64-bit ids (argsort path); else narrow ranges (packed sort path)
    keys = np.array(values, dtype=np.uint64)
    if spread:
        keys = (keys >> np.uint64(64 - 8 * spread)) + np.uint64(2**63)
    uniq, inverse = unique_inverse(keys)
    expected, expected_inv = np.unique(keys, return_inverse=True)
    assert uniq.dtype == np.uint64 and inverse.dtype == np.int64
    assert uniq.tolist() == expected.tolist()
    assert inverse.tolist() == expected_inv.tolist()


@dataclass(frozen=True)
class HashStack:
    hash_stack_rounds: int = 0
    embedding_size: int = 0


@dataclass(frozen=True)
class Slot:
    name: str
    dim: int = 4
    sample_fixed_size: int = 3
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    hash_stack_config: HashStack = HashStack()
    index_prefix: int = 0


def _csr(rng, batch):
    counts = rng.integers(0, 4, batch)
    offsets = np.zeros(batch + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return rng.integers(0, 50, int(offsets[-1])).astype(np.uint64), offsets


def test_merged_pooling_matches_per_slot_pooling_and_views_disjoint_slots():
    rng = np.random.default_rng(3)
    bits = 8
    slots = [Slot("a", index_prefix=1 << 56), Slot("b", sqrt_scaling=True, index_prefix=2 << 56),
             Slot("c", embedding_summation=False, index_prefix=3 << 56),
             Slot("d", index_prefix=4 << 56,
                  hash_stack_config=HashStack(hash_stack_rounds=2, embedding_size=7)),
             Slot("e", dim=2, index_prefix=5 << 56)]
    plans = {s.name: pooling.plan_slot(*_csr(rng, 6), s, bits) for s in slots}
    merged = pooling.merge_lookups(plans)
    assert merged[4].slot_slices is not None  # distinct prefixes: no id shared
    rows = {d: rng.standard_normal((len(m.ids), d)).astype(np.float32)
            for d, m in merged.items()}
    out = pooling.pool_batch(plans, merged, rows)
    assert list(out) == list(plans)
    for name, plan in plans.items():
        m = merged[plan.dim]
        own = rows[plan.dim][m.slot_index[name]]
        assert np.shares_memory(m.slot_rows(name, rows[plan.dim]), rows[plan.dim])
        alone = pooling.pool(plan, own)
        np.testing.assert_allclose(out[name].embeddings, alone.embeddings, rtol=1e-6)


def test_gradient_maps_are_built_on_first_use_only():
    calls = []
    plan = pooling.plan_slot(np.array([5, 5, 6], np.uint64), np.array([0, 2, 3]), Slot("a"), 0)
    build = plan.grad_map

    def counted():
        calls.append(1)
        return build()

    object.__setattr__(plan, "grad_map", counted)
    assert calls == []
    ids, grads = pooling.reduce_slot_gradient(plan, np.ones((2, 4), np.float32))
    pooling.reduce_slot_gradient(plan, np.ones((2, 4), np.float32))
    assert calls == [1]
    assert ids.tolist() == [5, 6] and grads[:, 0].tolist() == [2.0, 1.0]
