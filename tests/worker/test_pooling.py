"""Pooling, lookup planning and gradient reduction against naive per-id references."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels import segments, twins
from stream_persia.kernels.ids import hash_stack, prefix_ids
from stream_persia.kernels.segments import segment_sum
from stream_persia.worker import batchplan
from stream_persia.worker.pooling import (
    merge_lookups,
    plan_slot,
    pool,
    pool_batch,
    reduce_slot_gradient,
)

M64 = (1 << 64) - 1
IMPLS = ["torch", "numpy"]


@dataclass(frozen=True)
class HashStack:
    hash_stack_rounds: int = 0
    embedding_size: int = 0


@dataclass(frozen=True)
class Slot:
    """Stand-in with SlotConfig's attribute names (config is tested on its own)."""

    name: str = "user_id"
    dim: int = 4
    sample_fixed_size: int = 10
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    hash_stack_config: HashStack = field(default_factory=HashStack)
    index_prefix: int = 0


@contextlib.contextmanager
def segment_impl(impl):
    before = segments.SEGMENT_SUM_IMPLEMENTATION
    segments.SEGMENT_SUM_IMPLEMENTATION = impl
    try:
        yield
    finally:
        segments.SEGMENT_SUM_IMPLEMENTATION = before


def plan_batch(features, schema, **kwargs):
    """Every slot planned for pooling on the worker (the API's in-process table's plan)."""
    return batchplan.plan_batch(features, schema, server_pooling=False, **kwargs)


def csr(samples):
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in samples])
    values = np.array([x for s in samples for x in s], dtype=np.uint64)
    return values, offsets


# ---- naive references: Python ints, one id at a time
def naive_bucket(x, r, size):
    z = (x + (r + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return z % size + r * size


def naive_prefix(x, bits, index_prefix):
    if bits == 0 or index_prefix == 0:
        return x
    return x % ((1 << (64 - bits)) - 1) + index_prefix


def naive_lookup_ids(x, slot, bits):
    """The server ids one raw id stands for."""
    hs = slot.hash_stack_config
    buckets = ([naive_bucket(x, r, hs.embedding_size) for r in range(hs.hash_stack_rounds)]
               if hs.hash_stack_rounds else [x])
    return [naive_prefix(b, bits, slot.index_prefix) for b in buckets]


def table_for(ids, dim, seed=0):
    """Deterministic rows for every id (what the servers would return)."""
    rng = np.random.default_rng(seed)
    return {int(i): rng.standard_normal(dim).astype(np.float32) for i in ids}


def rows_of(plan, table):
    return np.array([table[int(i)] for i in plan.lookup_ids],
                    dtype=np.float32).reshape(-1, plan.dim)


def naive_embedding(x, slot, bits, table):
    return sum(table[i].astype(np.float64) for i in naive_lookup_ids(x, slot, bits))


def naive_sum_pool(samples, slot, bits, table):
    out = np.zeros((len(samples), slot.dim))
    for i, sample in enumerate(samples):
        for x in sample:
            out[i] += naive_embedding(x, slot, bits, table)
        if slot.sqrt_scaling and sample:
            out[i] /= math.sqrt(len(sample))
    return out


def naive_sum_grad(samples, slot, bits, grad):
    acc = {}
    for i, sample in enumerate(samples):
        scale = 1 / math.sqrt(len(sample)) if slot.sqrt_scaling and sample else 1.0
        for x in sample:
            for b in naive_lookup_ids(x, slot, bits):
                acc[b] = acc.get(b, 0.0) + grad[i].astype(np.float64) * scale
    return acc


def assert_grads(ids, rows, expected):
    assert sorted(int(i) for i in ids) == sorted(expected)
    assert len(set(int(i) for i in ids)) == len(ids)
    for i, row in zip(ids, rows, strict=True):
        np.testing.assert_allclose(row, expected[int(i)], rtol=1e-5, atol=1e-5)


# ---- hypothesis inputs
ID_POOL = [0, 1, 2, 7, 1000, 1001, 1024, 2**52 - 1, 2**52, 16000000000000000, 2**63, M64]
samples_st = st.lists(st.lists(st.sampled_from(ID_POOL), max_size=7), max_size=12)
slot_st = st.builds(
    lambda dim, fixed, summation, sqrt, rounds, size, group, bits: (Slot(
        dim=dim, sample_fixed_size=fixed, embedding_summation=summation, sqrt_scaling=sqrt,
        hash_stack_config=HashStack(rounds, size if rounds else 0),
        index_prefix=(group + 1) << (64 - bits) if bits else 0), bits),
    st.integers(1, 5), st.integers(1, 4), st.booleans(), st.booleans(), st.integers(0, 3),
    st.integers(1, 40), st.integers(0, 5), st.sampled_from([0, 8, 12]))


# ---- id transforms
def test_prefix_matches_persia_formula_vectors():
    ids = np.array([12, 16000000000000000], dtype=np.uint64)
    out = prefix_ids(ids, index_prefix=100 << 52, prefix_bits=12)
    assert out.dtype == np.uint64
    assert out.tolist() == [450359962737049612, 452849163854938115]
    assert prefix_ids(ids, index_prefix=0, prefix_bits=0) is ids


def test_prefix_agrees_with_schema():
    config = pytest.importorskip("stream_persia.config.embedding")
    schema = config.EmbeddingSchema(
        feature_index_prefix_bit=12,
        slots={"a": config.SlotConfig("a", 4), "b": config.SlotConfig("b", 4)})
    ids = np.array(ID_POOL, dtype=np.uint64)
    for name in ("a", "b"):
        mine = prefix_ids(ids, index_prefix=schema.slot(name).index_prefix, prefix_bits=12)
        assert mine.tolist() == schema.prefix_ids(name, ids).tolist()


def test_hash_stack_is_splitmix64_deterministic_and_in_range():
    # splitmix64 seeded with 0 yields 0xE220A8397B1DCDAF first (the published sequence)
    assert hash_stack(np.array([0], np.uint64), 1, M64)[0, 0] == 0xE220A8397B1DCDAF
    ids = np.array(ID_POOL, dtype=np.uint64)
    out = hash_stack(ids, 3, 1000)
    assert out.shape == (len(ids), 3) and out.dtype == np.uint64
    assert np.array_equal(out, hash_stack(ids.copy(), 3, 1000))
    for r in range(3):
        assert ((out[:, r] >= r * 1000) & (out[:, r] < (r + 1) * 1000)).all()
    assert out.tolist() == [[naive_bucket(int(x), r, 1000) for r in range(3)] for x in ids]
    assert len(set(out[:, 0].tolist())) > len(ids) // 2  # it actually spreads ids


# ---- summation pooling
PERSIA_USER_IDS = [[1000, 1001], [1000], [], [1000, 1001, 1024], [1000] * 200]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sqrt", [False, True])
def test_sum_pooling_persia_example(impl, sqrt):
    slot = Slot(sqrt_scaling=sqrt, index_prefix=1 << 56)
    plan = plan_slot(*csr(PERSIA_USER_IDS), slot, 8)
    assert sorted(plan.lookup_ids.tolist()) == [(1 << 56) + x for x in (1000, 1001, 1024)]
    table = table_for(plan.lookup_ids, 4)
    with segment_impl(impl):
        out = pool(plan, rows_of(plan, table))
    assert out.index is None and out.mask is None
    assert out.embeddings.dtype == np.float32 and out.embeddings.shape == (5, 4)
    row = table[(1 << 56) + 1000]
    np.testing.assert_array_equal(out.embeddings[2], 0)  # empty sample
    expected = row * (200 / math.sqrt(200) if sqrt else 200)
    np.testing.assert_allclose(out.embeddings[4], expected, rtol=1e-5)
    np.testing.assert_allclose(out.embeddings, naive_sum_pool(PERSIA_USER_IDS, slot, 8, table),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=60, deadline=None)
@given(samples=samples_st, slot_bits=slot_st, seed=st.integers(0, 3))
def test_pooling_and_gradients_match_naive(impl, samples, slot_bits, seed):
    slot, bits = slot_bits
    plan = plan_slot(*csr(samples), slot, bits)
    table = table_for(plan.lookup_ids, slot.dim, seed)
    rng = np.random.default_rng(seed)
    with segment_impl(impl):
        out = pool(plan, rows_of(plan, table))
        grad = rng.standard_normal(plan.grad_shape).astype(np.float32)
        ids, rows = reduce_slot_gradient(plan, grad)
    assert rows.dtype == np.float32 and rows.shape == (len(ids), slot.dim)
    if slot.embedding_summation:
        np.testing.assert_allclose(out.embeddings, naive_sum_pool(samples, slot, bits, table),
                                   rtol=1e-5, atol=1e-5)
        assert_grads(ids, rows, naive_sum_grad(samples, slot, bits, grad))
    else:
        check_raw(samples, slot, bits, table, out, grad, ids, rows)


def check_raw(samples, slot, bits, table, out, grad, ids, rows):
    fixed = slot.sample_fixed_size
    hashed = slot.hash_stack_config.hash_stack_rounds > 0
    assert out.index.shape == out.mask.shape == (len(samples), fixed)
    np.testing.assert_array_equal(out.embeddings[0], 0)
    key_of_row, acc = {}, {}
    for i, sample in enumerate(samples):
        kept = sample[:fixed]
        assert out.mask[i].tolist() == [p < len(kept) for p in range(fixed)]
        assert (out.index[i, len(kept):] == 0).all()
        for p, x in enumerate(kept):
            j = int(out.index[i, p])
            key = x if hashed else naive_prefix(x, bits, slot.index_prefix)
            assert key_of_row.setdefault(j, key) == key  # one row per distinct id
            np.testing.assert_allclose(out.embeddings[j], naive_embedding(x, slot, bits, table),
                                       rtol=1e-5, atol=1e-5)
    assert len(set(key_of_row.values())) == len(key_of_row) == len(out.embeddings) - 1
    for j, key in key_of_row.items():
        for b in (naive_lookup_ids(key, slot, bits) if hashed else [key]):
            acc[b] = acc.get(b, 0.0) + grad[j].astype(np.float64)
    assert_grads(ids, rows, acc)


def test_single_id_feature_is_a_gather():
    samples = [[5], [6], [5], [7]]
    plan = plan_slot(*csr(samples), Slot(dim=3, sqrt_scaling=True), 0)
    table = table_for(plan.lookup_ids, 3)
    out = pool(plan, rows_of(plan, table))
    np.testing.assert_array_equal(out.embeddings, np.stack([table[x[0]] for x in samples]))
    ids, rows = reduce_slot_gradient(plan, np.ones((4, 3), np.float32))
    assert ids.tolist() == [5, 6, 7]
    np.testing.assert_array_equal(rows[:, 0], [2, 1, 1])


def test_raw_truncates_at_sample_fixed_size_with_padding_row():
    slot = Slot(embedding_summation=False, sample_fixed_size=3, dim=2)
    plan = plan_slot(*csr([[9, 8, 7, 6, 5], [], [8], [1000] * 200]), slot, 0)
    assert plan.lookup_ids.tolist() == [7, 8, 9, 1000]  # 6 and 5 were cut off
    out = pool(plan, np.arange(8, dtype=np.float32).reshape(4, 2))
    assert out.embeddings.tolist() == [[0, 0], [0, 1], [2, 3], [4, 5], [6, 7]]
    assert out.index.tolist() == [[3, 2, 1], [0, 0, 0], [2, 0, 0], [4, 4, 4]]
    assert out.mask.tolist() == [[True] * 3, [False] * 3, [True, False, False], [True] * 3]
    grad = np.arange(10, dtype=np.float32).reshape(5, 2)
    ids, rows = reduce_slot_gradient(plan, grad)
    assert ids.tolist() == [7, 8, 9, 1000] and rows.tolist() == grad[1:].tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_sqrt_scaling_applies_to_gradient(impl):
    plan = plan_slot(*csr([[3, 3, 3, 3], [3], []]), Slot(dim=1, sqrt_scaling=True), 0)
    with segment_impl(impl):
        ids, rows = reduce_slot_gradient(plan, np.array([[1.0], [10.0], [100.0]], np.float32))
    # 4 occurrences x 1/sqrt(4) + 1 x 10 / sqrt(1); the empty sample gives nothing
    assert ids.tolist() == [3] and rows.tolist() == [[4 * 0.5 + 10.0]]


def test_empty_batch_and_all_empty_samples():
    for samples in ([], [[], []]):
        for summation in (True, False):
            plan = plan_slot(*csr(samples), Slot(embedding_summation=summation), 8)
            out = pool(plan, np.zeros((0, 4), np.float32))
            rows_expected = len(samples) if summation else 1
            assert out.embeddings.shape == (rows_expected, 4) and not out.embeddings.any()
            ids, rows = reduce_slot_gradient(plan, np.ones(plan.grad_shape, np.float32))
            assert ids.shape == (0,) and rows.shape == (0, 4)


# ---- validation
def test_gradient_shape_and_dtype_errors_name_the_slot():
    plan = plan_slot(*csr([[1, 2], [3]]), Slot(name="photo_id", dim=4), 0)
    with pytest.raises(BadInput, match=r"photo_id.*\(2, 4\).*\(3, 4\)") as err:
        reduce_slot_gradient(plan, np.zeros((3, 4), np.float32))
    assert err.value.field == "gradients.photo_id"
    with pytest.raises(BadInput, match=r"photo_id.*int64"):
        reduce_slot_gradient(plan, np.zeros((2, 4), np.int64))
    with pytest.raises(BadInput, match="photo_id"):
        pool(plan, np.zeros((3, 5), np.float32))
    ids, rows = reduce_slot_gradient(plan, np.ones((2, 4), np.float16))  # AMP gradients
    assert rows.dtype == np.float32
    no_grad = plan_slot(*csr([[1]]), Slot(), 0, requires_grad=False)
    with pytest.raises(Misuse):
        reduce_slot_gradient(no_grad, np.zeros((1, 4), np.float32))


def test_bad_csr_is_rejected():
    with pytest.raises(BadInput, match="uint64"):
        plan_slot(np.array([1, 2], np.int64), np.array([0, 2]), Slot(), 0)
    with pytest.raises(BadInput, match="offsets"):
        plan_slot(np.array([1, 2], np.uint64), np.array([0, 3]), Slot(), 0)
    with pytest.raises(BadInput, match="offsets"):
        plan_slot(np.array([1, 2], np.uint64), np.array([0, 2, 1, 2]), Slot(), 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("summation", [True, False])
def test_non_finite_gradient_skips_the_slot(bad, summation):
    plan = plan_slot(*csr([[1, 2], [3]]), Slot(embedding_summation=summation), 0)
    grad = np.ones(plan.grad_shape, np.float32)
    grad[-1, 1] = bad
    assert reduce_slot_gradient(plan, grad) is None
    assert reduce_slot_gradient(plan, np.full(plan.grad_shape, 3e38, np.float32)) is not None


# ---- whole batches
@dataclass
class Feature:
    name: str
    values: np.ndarray
    offsets: np.ndarray


@dataclass
class Schema:
    slots: dict
    feature_index_prefix_bit: int = 8

    def slot(self, name):
        if name not in self.slots:
            raise BadInput(f"unknown slot {name!r}", field=name)
        return self.slots[name]


def make_batch():
    # a and b share a feature group (one prefix); c has its own; d has another dim
    schema = Schema({
        "a": Slot("a", dim=2, index_prefix=1 << 56),
        "b": Slot("b", dim=2, index_prefix=1 << 56, embedding_summation=False,
                  sample_fixed_size=2),
        "c": Slot("c", dim=2, index_prefix=2 << 56, sqrt_scaling=True),
        "d": Slot("d", dim=3, index_prefix=3 << 56,
                  hash_stack_config=HashStack(2, 5))})
    data = {"a": [[1, 2], [2]], "b": [[2, 3, 4], []], "c": [[1], [1, 1]], "d": [[7], [8, 9]]}
    return schema, [Feature(n, *csr(s)) for n, s in data.items()], data


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_merges_lookups_per_dim_and_gradients_across_a_group(impl):
    schema, features, data = make_batch()
    batch_plan = plan_batch(features, schema)
    plans = batch_plan.classic
    assert list(plans) == ["a", "b", "c", "d"]
    merged = merge_lookups(plans)
    assert list(merged) == [2, 3]
    union = set().union(*(plans[n].lookup_ids.tolist() for n in "abc"))
    assert merged[2].ids.tolist() == sorted(union)
    # a: 1, 2; b: 2, 3 (4 is past sample_fixed_size); c: 1 under its own prefix
    assert len(union) == 4
    table = {d: table_for(m.ids, d) for d, m in merged.items()}
    rows_by_dim = {d: np.stack([table[d][int(i)] for i in m.ids]) for d, m in merged.items()}
    grads = {n: np.ones(p.grad_shape, np.float32) for n, p in plans.items()}
    with segment_impl(impl):
        outputs = pool_batch(plans, merged, rows_by_dim)
        result = batchplan.reduce_gradients(batch_plan, grads)
        for name, plan in plans.items():
            alone = pool(plan, rows_of(plan, table[plan.dim]))
            np.testing.assert_array_equal(outputs[name].embeddings, alone.embeddings)
    assert result.skipped == ()
    expected = {}
    for name, plan in plans.items():
        slot = schema.slot(name)
        if slot.embedding_summation:
            per_slot = naive_sum_grad(data[name], slot, 8, grads[name])
        else:
            per_slot = {int(i): r for i, r in zip(*reduce_slot_gradient(plan, grads[name]),
                                                  strict=True)}
        for k, v in per_slot.items():
            expected[k] = expected.get(k, 0.0) + v
    for dim, (ids, rows) in result.by_dim.items():
        assert_grads(ids, rows, {k: v for k, v in expected.items() if len(v) == dim})
    shared = (1 << 56) + 2  # in a (twice) and in b (once)
    ids, rows = result.by_dim[2]
    assert rows[ids.tolist().index(shared)].tolist() == [3.0, 3.0]


def test_batch_gradients_skip_count_and_name_checks():
    schema, features, _ = make_batch()
    batch_plan = plan_batch(features, schema)
    plans = batch_plan.classic
    grads = {n: np.ones(p.grad_shape, np.float32) for n, p in plans.items()}
    grads["c"] = np.full(plans["c"].grad_shape, np.nan, np.float32)
    grads["d"] = None
    result = batchplan.reduce_gradients(batch_plan, grads)
    assert result.skipped == ("c",) and list(result.by_dim) == [2]
    assert not set(result.by_dim[2][0].tolist()) & set(plans["c"].lookup_ids.tolist())
    # a and c share no id: their rows are only reordered, never added
    grads.update(b=None, c=np.full(plans["c"].grad_shape, 2.0, np.float32))
    ids, rows = batchplan.reduce_gradients(batch_plan, grads).by_dim[2]
    expected = {int(i): r for n in "ac"
                for i, r in zip(*reduce_slot_gradient(plans[n], grads[n]), strict=True)}
    assert ids.tolist() == sorted(expected)
    assert rows.tolist() == [expected[int(i)].tolist() for i in ids]
    with pytest.raises(BadInput, match="missing.*'d'"):
        batchplan.reduce_gradients(batch_plan, {n: g for n, g in grads.items() if n != "d"})
    with pytest.raises(BadInput, match="unknown.*'zz'"):
        batchplan.reduce_gradients(batch_plan, {**grads, "zz": None})


def test_plan_batch_rejects_unknown_duplicate_and_ragged_features():
    schema, features, _ = make_batch()
    with pytest.raises(BadInput, match="nope"):
        plan_batch([Feature("nope", *csr([[1]]))], schema)
    with pytest.raises(BadInput, match="twice"):
        plan_batch([features[0], features[0]], schema)
    with pytest.raises(BadInput, match="3 samples"):
        plan_batch([features[0], Feature("c", *csr([[1], [2], [3]]))], schema)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 5), max_size=30), dim=st.integers(1, 4),
       seed=st.integers(0, 5))
def test_segment_sum_implementations_agree(counts, dim, seed):
    # the suite states which implementation the worker runs (both are held to one result)
    # (STREAM_PERSIA_PURE_PYTHON=1 picks the numpy twin, as it picks every twin)
    assert segments.SEGMENT_SUM_IMPLEMENTATION == ("numpy" if twins.PURE_PYTHON else "torch")
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((7, dim)).astype(np.float32)
    index = rng.integers(0, 7, sum(counts)).astype(np.int64)
    starts = (np.cumsum(counts) - counts).astype(np.int64)
    naive = np.array([table[index[s:s + c]].sum(0) if c else np.zeros(dim)
                      for s, c in zip(starts, counts, strict=True)]).reshape(-1, dim)
    table.flags.writeable = False  # rows decoded off the wire are read-only views
    for impl in IMPLS:
        out = segment_sum(table, index, starts, impl=impl)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, naive, rtol=1e-5, atol=1e-6)


def test_plan_batch_with_the_real_schema_and_features():
    from stream_persia.config import EmbeddingSchema
    from stream_persia.embedding.data import IDTypeFeature, IDTypeFeatureWithSingleID

    schema = EmbeddingSchema.from_dict({
        "feature_index_prefix_bit": 8,
        "slots_config": {"user_id": {"dim": 8}, "photo_id": {"dim": 8},
                         "age": {"dim": 4, "embedding_summation": False,
                                 "sample_fixed_size": 2}},
        "feature_groups": {"ids": ["user_id", "photo_id"]}})
    photo = [[2000, 1001], [3000], [5001], [4000, 1001, 1024], [4096] * 200]
    features = [
        IDTypeFeature("user_id", [np.array(s, np.uint64) for s in PERSIA_USER_IDS]),
        IDTypeFeature("photo_id", [np.array(s, np.uint64) for s in photo]),
        IDTypeFeatureWithSingleID("age", np.array([1, 2, 1, 3, 1], np.uint64))]
    plans = plan_batch(features, schema).classic
    for feature in features:
        expected = np.unique(schema.prefix_ids(feature.name, feature.values))
        assert plans[feature.name].lookup_ids.tolist() == expected.tolist()
    merged = merge_lookups(plans)
    user, photo_ids = (set(plans[n].lookup_ids.tolist()) for n in ("user_id", "photo_id"))
    assert user & photo_ids == {int(schema.prefix_ids("user_id", np.array([1001], np.uint64))[0]),
                                int(schema.prefix_ids("user_id", np.array([1024], np.uint64))[0])}
    assert len(merged[8].ids) == len(user | photo_ids)
    assert plans["age"].index.tolist() == [[1, 0], [2, 0], [1, 0], [3, 0], [1, 0]]
