"""Whole-batch plans (stream_persia.worker.batchplan) against the classic per-slot path.

Summation slots without a hash stack are pooled on the embedding servers; everything else
keeps the classic plan of stream_persia.worker.pooling. With one server the outputs and the
reduced gradients equal the classic path's bit for bit. The router and the servers are
exercised on real loopback sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_persia.config import EmbeddingSchema
from stream_persia.core.metrics import RoleMetrics
from stream_persia.embedding.data import IDTypeFeature, PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels import segments
from stream_persia.kernels.ids import prefix_ids
from stream_persia.kernels.sharding import splitmix64_finalizer_inplace
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.servers import running_servers
from stream_persia.worker import batchplan, pooling
from stream_persia.worker.pushes import GradientPushes
from stream_persia.worker.shards import LookupGroup, PooledLookup, RowLookup

SETTINGS = settings(max_examples=25, deadline=None)
SEGMENT_IMPLS = ["cython", "python"] if segments._c is not None else ["python"]

# Summation slots with and without sqrt scaling over two dims (pooled on the servers); a
# raw slot, a hash-stacked raw slot and two hash-stacked summation slots (classic path).
EMBEDDING_YAML = """\
feature_index_prefix_bit: 8
slots_config:
  user:   {dim: 8}
  item:   {dim: 8, sqrt_scaling: true}
  city:   {dim: 4}
  query:  {dim: 4, sqrt_scaling: true}
  tags:   {dim: 4, embedding_summation: false, sample_fixed_size: 3}
  clicks: {dim: 8, embedding_summation: false, sample_fixed_size: 2,
           hash_stack_config: {hash_stack_rounds: 2, embedding_size: 7}}
  hashed: {dim: 8, hash_stack_config: {hash_stack_rounds: 3, embedding_size: 11}}
  hsqrt:  {dim: 4, sqrt_scaling: true,
           hash_stack_config: {hash_stack_rounds: 2, embedding_size: 5}}
"""
MIXED = EmbeddingSchema.from_dict(yaml.safe_load(EMBEDDING_YAML))
SLOTS = list(MIXED.slots)
POOLED = ["user", "item", "city", "query"]


@contextlib.contextmanager
def implementations(segment_impl, segment_sum_impl="torch"):
    before = segments.IMPLEMENTATION, segments.SEGMENT_SUM_IMPLEMENTATION
    segments.IMPLEMENTATION, segments.SEGMENT_SUM_IMPLEMENTATION = segment_impl, segment_sum_impl
    try:
        yield
    finally:
        segments.IMPLEMENTATION, segments.SEGMENT_SUM_IMPLEMENTATION = before


def table(ids, dim):
    """float32 ``(len(ids), dim)``: a fixed row per id (a hash of it), over several
    magnitudes so that a change in summation order shows in the bits."""
    z = np.asarray(ids, dtype=np.uint64)[:, None] + (
        np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    z = splitmix64_finalizer_inplace(z)
    unit = (z >> np.uint64(40)).astype(np.float64) / 2**24 * 2 - 1
    magnitude = 10.0 ** ((z & np.uint64(7)).astype(np.float64) - 3)
    return (unit * magnitude).astype(np.float32)


def features(seed, names, batch_size, vocab=12, max_len=5):
    """CSR features, 0..max_len ids per sample from a small vocabulary (duplicates
    within and across samples)."""
    rng = np.random.default_rng(seed)
    out = []
    for name in names:
        offsets = np.zeros(batch_size + 1, dtype=np.int64)
        np.cumsum(rng.integers(0, max_len + 1, size=batch_size), out=offsets[1:])
        values = rng.integers(0, vocab, size=int(offsets[-1])).astype(np.uint64)
        out.append(IDTypeFeature.from_csr(name, values, offsets))
    return out


def feature(name, samples):
    return IDTypeFeature(name, [np.array(x, dtype=np.uint64) for x in samples])


def serve_as_one_server(plan):
    """The plan's outputs, every lookup answered from :func:`table` as one server would."""
    merged, groups = plan.lookup_groups()
    results = []
    for group in groups:
        rows = table(group.ids, group.dim)
        results.append(segments.pool(rows, group.index, group.offsets)
                       if isinstance(group, PooledLookup) else rows)
    return plan.outputs(merged, results)


def classic_plans(feats, schema, *args, **kwargs):
    """Every slot planned for pooling on the worker (the classic path, the reference):
    slot name -> SlotPlan."""
    return batchplan.plan_batch(feats, schema, *args, server_pooling=False, **kwargs).classic


def reduce_classic(plans, grads):
    """The gradients of a batch planned by :func:`classic_plans`."""
    requires_grad = all(p.requires_grad for p in plans.values())
    return batchplan.reduce_gradients(
        batchplan.BatchPlan(tuple(plans), {}, dict(plans), requires_grad), grads)


def serve_classic(plans):
    merged = pooling.merge_lookups(plans)
    return pooling.pool_batch(plans, merged, {d: table(m.ids, d) for d, m in merged.items()})


def classic_is_exact():
    """Whether the classic path adds a segment's rows in order (torch's embedding_bag does;
    its numpy twin, np.add.reduceat, does not): only then do both paths agree bit for bit."""
    return segments.SEGMENT_SUM_IMPLEMENTATION == "torch"


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def assert_close(a, b):
    """Equal up to float32 rounding of sums taken in another order."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if b.size:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


def assert_outputs_equal(got, want, exact=True):
    assert list(got) == list(want)
    for name, out in want.items():
        (assert_same if exact else assert_close)(got[name].embeddings, out.embeddings)
        for attr in ("index", "mask"):
            a, b = getattr(got[name], attr), getattr(out, attr)
            assert (a is None) == (b is None), (name, attr)
            if b is not None:
                assert_same(a, b)


def by_id(ids, rows):
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[order]


def assert_gradients_equal(got, want, exact=True):
    assert got.skipped == want.skipped
    assert got.by_dim.keys() == want.by_dim.keys()
    for dim, (ids, rows) in want.by_dim.items():
        g_ids, g_rows = by_id(*got.by_dim[dim])
        w_ids, w_rows = by_id(ids, rows)
        assert len(np.unique(g_ids)) == len(g_ids), "ids must be distinct"
        assert_same(g_ids, w_ids)
        (assert_same if exact else assert_close)(g_rows, w_rows)


def random_gradients(seed, plans, nones=(), nans=(), dtypes=None):
    """A gradient per slot of the classic ``plans`` (their shapes hold for both paths)."""
    rng = np.random.default_rng(seed)
    grads = {}
    for name, plan in plans.items():
        if name in nones:
            grads[name] = None
            continue
        g = rng.normal(size=plan.grad_shape) * 10.0 ** rng.integers(-2, 3, size=(1, plan.dim))
        if name in nans and g.size:
            g[rng.integers(len(g)), rng.integers(plan.dim)] = np.nan
        grads[name] = g.astype((dtypes or {}).get(name, np.float32))
    return grads


# ---------------------------------------------------------------------------- planning
def test_summation_slots_without_hash_stack_are_pooled_by_dim():
    plan = batchplan.plan_batch(features(0, SLOTS, 6), MIXED)
    assert plan.names == tuple(SLOTS)
    assert {d: g.names for d, g in plan.pooled.items()} == {8: ("user", "item"),
                                                            4: ("city", "query")}
    assert set(plan.classic) == {"tags", "clicks", "hashed", "hsqrt"}
    assert [plan.is_summation(n) for n in SLOTS] == [True] * 4 + [False, False, True, True]
    for g in plan.pooled.values():
        assert g.batch_size == 6 and g.offsets.shape == (2 * 6 + 1,)
        assert g.ids.dtype == np.uint64 and g.index.dtype == np.int32
        assert g.offsets.dtype == np.int64 and g.scale.dtype == np.float32
        assert len(np.unique(g.ids)) == len(g.ids)
    merged, groups = plan.lookup_groups()
    assert [type(g) for g in groups] == [RowLookup] * len(merged) + [PooledLookup] * 2


@pytest.mark.parametrize("segment_impl", SEGMENT_IMPLS)
@pytest.mark.parametrize("segment_sum_impl", ["torch", "numpy"])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), order=st.permutations(SLOTS),
       keep=st.integers(1, len(SLOTS)), batch_size=st.integers(0, 9))
def test_outputs_equal_the_classic_path_bit_for_bit(segment_impl, segment_sum_impl, seed,
                                                    order, keep, batch_size):
    feats = features(seed, order[:keep], batch_size)
    with implementations(segment_impl, segment_sum_impl):
        got = serve_as_one_server(batchplan.plan_batch(feats, MIXED))
        want = serve_classic(classic_plans(feats, MIXED))
        exact = classic_is_exact()
    assert_outputs_equal(got, want, exact=exact)


def test_sqrt_scaling_and_empty_samples():
    schema = EmbeddingSchema.from_dict({"slots_config": {"a": {"dim": 2, "sqrt_scaling": True},
                                                         "b": {"dim": 2}}})
    samples = [[], [5], [5, 5, 7, 9]]
    plan = batchplan.plan_batch([feature("a", samples), feature("b", samples)], schema)
    np.testing.assert_array_equal(plan.pooled[2].scale, [0, 1, 0.5, 1, 1, 1])
    out = serve_as_one_server(plan)
    for name, scale in (("a", 0.5), ("b", 1.0)):
        emb = out[name].embeddings
        assert emb.shape == (3, 2) and not emb[0].any(), "an empty sample pools to zeros"
        rows = table(schema.prefix_ids(name, np.array(samples[2], np.uint64)), 2)
        np.testing.assert_allclose(emb[2], rows.sum(0) * scale, rtol=1e-6)


def test_the_testing_schema_matches_the_classic_path():
    for i in range(5):
        batch = make_batch(i, batch_size=7 + i)
        got = serve_as_one_server(batchplan.plan_batch(batch.id_type_features, SCHEMA))
        want = serve_classic(classic_plans(batch.id_type_features, SCHEMA))
        assert_outputs_equal(got, want, exact=classic_is_exact())


# ---------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("segment_impl", SEGMENT_IMPLS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), order=st.permutations(SLOTS),
       batch_size=st.integers(0, 9), data=st.data())
def test_gradients_equal_the_classic_path_bit_for_bit(segment_impl, seed, order, batch_size,
                                                      data):
    feats = features(seed, order, batch_size)
    nones = data.draw(st.sets(st.sampled_from(SLOTS), max_size=3), label="none")
    nans = data.draw(st.sets(st.sampled_from(SLOTS), max_size=2), label="nan")
    dtypes = data.draw(st.dictionaries(st.sampled_from(SLOTS),
                                       st.sampled_from([np.float16, np.float64])), label="dtype")
    with implementations(segment_impl):
        plan = batchplan.plan_batch(feats, MIXED)
        plans = classic_plans(feats, MIXED)
        grads = random_gradients(seed, plans, nones, nans - nones, dtypes)
        got = batchplan.reduce_gradients(plan, grads)
        want = reduce_classic(plans, grads)
    assert_gradients_equal(got, want)


def test_a_nan_slot_is_skipped_in_batch_order_and_its_ids_get_no_gradient():
    feats = features(1, SLOTS, 8)
    plan = batchplan.plan_batch(feats, MIXED)
    plans = classic_plans(feats, MIXED)
    grads = random_gradients(2, plans)
    for name in ("query", "user", "hashed"):       # not in batch order
        grads[name][3, 1] = np.nan if name != "query" else np.inf
    got = batchplan.reduce_gradients(plan, grads)
    assert got.skipped == ("user", "query", "hashed")
    assert_gradients_equal(got, reduce_classic(plans, grads),
                           exact=classic_is_exact())
    for name in ("user", "query"):
        dim = MIXED.slot(name).dim
        ids = MIXED.prefix_ids(name, next(f.values for f in feats if f.name == name))
        assert not np.isin(ids, got.by_dim[dim][0]).any(), name
    # Every slot of a dim skipped or None: the dim is absent.
    grads = dict.fromkeys(SLOTS)
    grads["user"] = np.full((8, 8), np.nan, np.float32)
    got = batchplan.reduce_gradients(plan, grads)
    assert got.by_dim == {} and got.skipped == ("user",)


def test_slots_sharing_ids_in_a_feature_group_sum_their_gradients():
    schema = EmbeddingSchema.from_dict({
        "slots_config": {"a": {"dim": 3}, "b": {"dim": 3, "sqrt_scaling": True},
                         "c": {"dim": 3}},
        "feature_groups": {"ab": ["a", "b"]}})
    a = feature("a", [[1, 2, 2], [3], []])
    b = feature("b", [[2], [1, 3, 1, 1], [2]])
    c = feature("c", [[2], [], [1]])
    plan = batchplan.plan_batch([a, b, c], schema)
    assert len(plan.pooled[3].ids) == 5, "a and b share ids 1, 2, 3; c has its own"
    # Powers of two: every sum is exact, whatever the order of the additions.
    grads = {"a": np.array([[1, 2, 4], [8, 16, 32], [64, 128, 256]], np.float32),
             "b": np.array([[0.5, 0.25, 1], [2, 4, 8], [16, 32, 64]], np.float32),
             "c": np.ones((3, 3), np.float32)}
    got = batchplan.reduce_gradients(plan, grads)
    ids, rows = by_id(*got.by_dim[3])
    want = {1: grads["a"][0] + 3 * grads["b"][1] / 2, 2: 2 * grads["a"][0] + grads["b"][0]
            + grads["b"][2], 3: grads["a"][1] + grads["b"][1] / 2}
    pa = [int(x) for x in schema.prefix_ids("a", np.array([1, 2, 3], np.uint64))]
    pc = [int(x) for x in schema.prefix_ids("c", np.array([1, 2], np.uint64))]
    expected = {pa[0]: want[1], pa[1]: want[2], pa[2]: want[3],
                pc[0]: grads["c"][2], pc[1]: grads["c"][0]}
    assert ids.tolist() == sorted(expected)
    np.testing.assert_array_equal(rows, np.stack([expected[k] for k in sorted(expected)]))
    assert_gradients_equal(got, reduce_classic(
        classic_plans([a, b, c], schema), grads))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), batch_size=st.integers(0, 9))
def test_a_feature_group_matches_the_classic_path_up_to_rounding(seed, batch_size):
    # Shared ids: the pooled path adds every occurrence in batch order, the classic one
    # adds per-slot sums, so the gradients differ by rounding (outputs do not).
    schema = EmbeddingSchema.from_dict({
        "slots_config": {"a": {"dim": 3}, "b": {"dim": 3, "sqrt_scaling": True},
                         "h": {"dim": 3, "embedding_summation": False}},
        "feature_groups": {"abh": ["a", "b", "h"]}})
    feats = features(seed, ["a", "b", "h"], batch_size, vocab=5)
    plan = batchplan.plan_batch(feats, schema)
    plans = classic_plans(feats, schema)
    assert_outputs_equal(serve_as_one_server(plan), serve_classic(plans),
                         exact=classic_is_exact())
    grads = random_gradients(seed, plans)
    assert_gradients_equal(batchplan.reduce_gradients(plan, grads),
                           reduce_classic(plans, grads), exact=False)


# Three feature groups over two dims: summation slots share a prefix with each other (a, b;
# d, e) and with classic slots (r, h), whose plans sit between theirs in the batch.
GROUPED = {"slots_config": {
    "a": {"dim": 4}, "b": {"dim": 4, "sqrt_scaling": True}, "c": {"dim": 4},
    "d": {"dim": 8, "sqrt_scaling": True}, "e": {"dim": 8},
    "r": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 2},
    "h": {"dim": 8, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 5}}},
    "feature_groups": {"abr": ["a", "b", "r"], "deh": ["d", "e", "h"]}}


def grouped_features(seed, names, batch_size, bits):
    """Features whose ids repeat within and across slots, with empty samples and empty
    slots, and ids at, around and far above the prefix modulus (high bits set)."""
    rng = np.random.default_rng(seed)
    modulus = (1 << (64 - bits)) - 1 if bits else 2**64 - 1
    edges = np.array([modulus - 1, modulus, min(modulus + 1, 2**64 - 1), 2**64 - 1],
                     dtype=np.uint64)
    out = []
    for name in names:
        high = 0 if rng.random() < 0.2 else 5                 # sometimes an empty slot
        offsets = np.zeros(batch_size + 1, dtype=np.int64)
        np.cumsum(rng.integers(0, high + 1, size=batch_size), out=offsets[1:])
        n = int(offsets[-1])
        values = rng.integers(0, 6, size=n).astype(np.uint64)
        wide = rng.random(n) < 0.3
        values[wide] = rng.integers(0, 2**64, size=int(wide.sum()), dtype=np.uint64)
        edge = rng.random(n) < 0.15
        values[edge] = rng.choice(edges, size=int(edge.sum()))
        out.append(IDTypeFeature.from_csr(name, values, offsets))
    return out


def old_pooled_groups(feats, schema):
    """The pooled groups as plan_batch built them before segments.pooled_lookup: per slot
    prefix_ids, then per dim np.concatenate, de-duplication in first-occurrence
    order (a dict here) and a loop over the slots for the offsets and the sqrt scale."""
    bits = schema.feature_index_prefix_bit
    parts = {}
    for f in feats:
        slot = schema.slot(f.name)
        if slot.embedding_summation and slot.hash_stack_config.hash_stack_rounds == 0:
            keys = prefix_ids(f.values, index_prefix=slot.index_prefix, prefix_bits=bits)
            parts.setdefault(slot.dim, []).append((f.name, keys, f.offsets, slot.sqrt_scaling))
    groups = {}
    for dim, items in parts.items():
        batch = len(items[0][2]) - 1
        flat = np.concatenate([k for _, k, _, _ in items]).tolist()
        position = {}
        for key in flat:
            position.setdefault(key, len(position))
        offsets = np.empty(len(items) * batch + 1, dtype=np.int64)
        base = 0
        for i, (_, k, off, _) in enumerate(items):
            np.add(off[:-1], base, out=offsets[i * batch:(i + 1) * batch])
            base += len(k)
        offsets[-1] = base
        scale = None
        if any(sqrt for _, _, _, sqrt in items):
            scale = np.ones(len(items) * batch, dtype=np.float32)
            for i, (_, _, off, sqrt) in enumerate(items):
                if sqrt:
                    counts = off[1:] - off[:-1]
                    with np.errstate(divide="ignore"):
                        scale[i * batch:(i + 1) * batch] = np.where(
                            counts > 0, 1.0 / np.sqrt(counts), 0.0)
        groups[dim] = (tuple(name for name, _, _, _ in items), batch,
                       np.array(list(position), dtype=np.uint64),
                       np.array([position[key] for key in flat], dtype=np.int32),
                       offsets, scale)
    return groups


@pytest.mark.parametrize("segment_impl", SEGMENT_IMPLS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), order=st.permutations(list(GROUPED["slots_config"])),
       keep=st.integers(1, len(GROUPED["slots_config"])), batch_size=st.integers(0, 9),
       bits=st.sampled_from([0, 2, 8, 32]))
def test_pooled_groups_equal_the_old_formulation(segment_impl, seed, order, keep, batch_size,
                                                 bits):
    schema = EmbeddingSchema.from_dict({**GROUPED, "feature_index_prefix_bit": bits})
    feats = grouped_features(seed, order[:keep], batch_size, bits)
    with implementations(segment_impl):
        plan = batchplan.plan_batch(feats, schema)
    want = old_pooled_groups(feats, schema)
    assert list(plan.pooled) == list(want)
    for dim, (names, batch, ids, index, offsets, scale) in want.items():
        group = plan.pooled[dim]
        assert (group.dim, group.names, group.batch_size) == (dim, names, batch)
        assert_same(group.ids, ids)
        assert_same(group.index, index)
        assert_same(group.offsets, offsets)
        assert (group.scale is None) == (scale is None)
        if scale is not None:
            assert_same(group.scale, scale)


# ---------------------------------------------------------------------------- errors
def test_bad_batches_are_refused_naming_the_feature():
    user, item = features(0, ["user", "item"], 4)
    with pytest.raises(BadInput) as err:
        batchplan.plan_batch([user, item, user], MIXED)
    assert err.value.field == "id_type_features.user"
    with pytest.raises(BadInput) as err:
        batchplan.plan_batch([user, feature("nope", [[1]] * 4)], MIXED)
    assert "nope" in err.value.field
    with pytest.raises(BadInput) as err:
        batchplan.plan_batch([user, *features(0, ["tags"], 5)], MIXED)
    assert err.value.field == "id_type_features.tags"
    with pytest.raises(BadInput) as err:
        batchplan.plan_batch([user, *features(0, ["city"], 3)], MIXED)
    assert err.value.field == "id_type_features.city"
    bad = IDTypeFeature.from_csr("item", item.values, item.offsets)
    bad.values = item.values.astype(np.int64)
    with pytest.raises(BadInput) as err:
        batchplan.plan_batch([user, bad], MIXED)
    assert err.value.field == "id_type_features.item"


# Malformed CSR ids (two samples unless the offsets say otherwise) and a word of the error.
BAD_CSR = {
    "signed ids": (np.array([1, 2, 3], np.int64), np.array([0, 1, 3]), "uint64"),
    "2-D ids": (np.array([[1, 2, 3]], np.uint64), np.array([0, 1, 3]), "uint64"),
    "ids as a list": ([1, 2, 3], np.array([0, 1, 3]), "uint64"),
    "offsets short of len(ids)": (np.array([1, 2, 3], np.uint64), np.array([0, 1, 2]),
                                  "offsets"),
    "offsets not from 0": (np.array([1, 2, 3], np.uint64), np.array([1, 1, 3]), "offsets"),
    "decreasing offsets": (np.array([1, 2, 3], np.uint64), np.array([0, 2, 1, 3]),
                           "offsets"),
    "float offsets": (np.array([1, 2, 3], np.uint64), np.array([0.0, 1.0, 3.0]), "offsets"),
    "offsets as a list": (np.array([1, 2, 3], np.uint64), [0, 1, 3], "offsets"),
    "empty offsets": (np.array([], np.uint64), np.zeros(0, np.int64), "offsets"),
}


@pytest.mark.parametrize("slot", ["user", "tags", "clicks", "hashed"])
@pytest.mark.parametrize("case", list(BAD_CSR))
def test_every_public_planner_checks_raw_csr_ids(case, slot):
    """The worker skips the check for batches it decoded (csr_checked=True); every planner
    a caller hands arrays to still checks them, pooled and classic slots alike."""
    values, offsets, word = BAD_CSR[case]
    raw = types.SimpleNamespace(name=slot, values=values, offsets=offsets)
    calls = {
        "pooling.check_csr": lambda: pooling.check_csr(slot, values, offsets),
        "pooling.plan_slot": lambda: pooling.plan_slot(values, offsets, MIXED.slot(slot),
                                                       MIXED.feature_index_prefix_bit),
        "batchplan.plan_batch(server_pooling=False)": lambda: classic_plans([raw], MIXED),
        "batchplan.plan_batch": lambda: batchplan.plan_batch([raw], MIXED),
    }
    for what, call in calls.items():
        with pytest.raises(BadInput, match=word) as err:
            call()
        assert err.value.field == f"id_type_features.{slot}", what


def test_checked_features_plan_as_checked_ones():
    """csr_checked=True skips the check only: decoded batches plan the same either way."""
    for i in range(3):
        batch = PersiaBatch.from_bytes(make_batch(i, batch_size=5 + i).to_bytes())
        for requires_grad in (True, False):
            trusted = batchplan.plan_batch(batch.id_type_features, SCHEMA, requires_grad,
                                           csr_checked=True)
            checked = batchplan.plan_batch(batch.id_type_features, SCHEMA, requires_grad)
            assert trusted.names == checked.names
            assert trusted.pooled.keys() == checked.pooled.keys()
            assert trusted.classic.keys() == checked.classic.keys()
            assert_outputs_equal(serve_as_one_server(trusted), serve_as_one_server(checked))
            # and the classic planner (the API's online embedding path passes csr_checked)
            fast = classic_plans(batch.id_type_features, SCHEMA, requires_grad,
                                      csr_checked=True)
            slow = classic_plans(batch.id_type_features, SCHEMA, requires_grad)
            assert list(fast) == list(slow)
            for name in fast:
                for attr in ("lookup_ids", "pool_index", "pool_starts", "scale", "index",
                             "mask"):
                    a, b = getattr(fast[name], attr), getattr(slow[name], attr)
                    assert (a is None and b is None) or np.array_equal(a, b), (name, attr)


def test_bad_gradients_are_refused_naming_the_slot():
    feats = features(3, SLOTS, 4)
    plan = batchplan.plan_batch(feats, MIXED)
    grads = random_gradients(0, classic_plans(feats, MIXED))
    cases = {
        "gradients.nope": {**grads, "nope": None},
        "gradients.city": {k: v for k, v in grads.items() if k != "city"},
        "gradients.item": {**grads, "item": np.zeros((3, 8), np.float32)},
        "gradients.query": {**grads, "query": np.zeros((4, 4), np.int32)},
        "gradients.user": {**grads, "user": [[0.0] * 8] * 4},
    }
    for field, bad in cases.items():
        with pytest.raises(BadInput) as err:
            batchplan.reduce_gradients(plan, bad)
        assert err.value.field == field, str(err.value)


def test_gradients_of_a_plan_without_gradients_are_misuse():
    feats = features(4, SLOTS, 4)
    plan = batchplan.plan_batch(feats, MIXED, requires_grad=False)
    with pytest.raises(Misuse):
        batchplan.reduce_gradients(plan, dict.fromkeys(SLOTS))
    assert serve_as_one_server(plan).keys() == set(SLOTS)


def test_pooled_sums_of_the_wrong_shape_are_refused_naming_the_dim():
    plan = batchplan.plan_batch(features(5, SLOTS, 4), MIXED)
    group = plan.pooled[4]
    for bad in (np.zeros((7, 4), np.float32), np.zeros((8, 4), np.float64), [[0.0] * 4] * 8):
        with pytest.raises(BadInput) as err:
            group.outputs(bad)
        assert err.value.field == "embeddings.dim4"


# ---------------------------------------------------------------------------- real sockets
async def pooled_lookup_matches_pooled_rows(n):
    feats = features(n, SLOTS, 16, vocab=40)
    plan = batchplan.plan_batch(feats, MIXED)
    merged, groups = plan.lookup_groups()
    pooled = [g for g in groups if isinstance(g, PooledLookup)]
    n_ids = sum(len(g.ids) for g in groups)
    async with running_servers(n, SGD(lr=0.1)) as (started, router):
        got, missing = await router.lookup(groups, "eval")
        assert missing == n_ids
        for g, sums in zip(groups, got, strict=True):
            want = (len(g.ids) if isinstance(g, RowLookup) else len(g.offsets) - 1, g.dim)
            assert sums.shape == want and sums.dtype == np.float32 and not sums.any()
        assert sum(len(s.store) for s in started) == 0, "eval never inserts"

        got, missing = await router.lookup(groups, "train")
        assert missing == 0
        assert sum(len(s.store) for s in started) == n_ids
        rows, missing = await router.lookup([RowLookup(g.dim, g.ids) for g in pooled], "eval")
        assert missing == 0
        for g, sums, r in zip(pooled, got[len(merged):], rows, strict=True):
            want = segments.pool(r, g.index, g.offsets)
            assert want.any()
            if n == 1:
                assert_same(sums, want)
            else:
                bound = segments.pool(np.abs(r), g.index, g.offsets)
                np.testing.assert_array_less(np.abs(sums - want), 1e-6 * bound + 1e-30)
        # The worker's whole batch: rows of every slot equal a classic lookup's.
        outputs = plan.outputs(merged, got)
        classic = classic_plans(feats, MIXED)
        m = pooling.merge_lookups(classic)
        fetched, _ = await router.lookup([RowLookup(d, x.ids) for d, x in m.items()], "eval")
        want = pooling.pool_batch(classic, m, dict(zip(m, fetched, strict=True)))
        for name in SLOTS:
            np.testing.assert_allclose(outputs[name].embeddings, want[name].embeddings,
                                       rtol=1e-5, atol=1e-6)
            if n == 1 and classic_is_exact():
                assert_same(outputs[name].embeddings, want[name].embeddings)


async def test_pooled_lookup_through_one_server_is_bit_exact():
    await asyncio.wait_for(pooled_lookup_matches_pooled_rows(1), 20)


async def test_pooled_lookup_through_three_servers_adds_partial_sums():
    await asyncio.wait_for(pooled_lookup_matches_pooled_rows(3), 20)


async def test_a_server_refuses_malformed_pooled_groups_and_keeps_serving():
    ids = np.array([11, 12, 13], np.uint64)
    good_index, good_offsets = np.array([0, 2, 2, 1], np.int32), np.array([0, 3, 4], np.int64)
    bad = [
        (np.array([0, 3, 2, 1], np.int32), good_offsets, "groups[0].index"),
        (np.array([0, -1, 2, 1], np.int32), good_offsets, "groups[0].index"),
        (good_index.astype(np.int64), good_offsets, "groups[0].index"),
        (good_index, np.array([0, 3, 2, 4], np.int64), "groups[0].offsets"),
        (good_index, np.array([0, 3, 5], np.int64), "groups[0].offsets"),
        (good_index, good_offsets.astype(np.int32), "groups[0].offsets"),
        (good_index, None, "groups[0].offsets"),
    ]
    async with running_servers(1, SGD(lr=0.1)) as (started, _):
        async with RpcClient(started[0].address, timeout_ms=5000) as client:
            for index, offsets, field in bad:
                group = {"dim": 4, "ids": ids, "index": index}
                if offsets is not None:
                    group["offsets"] = offsets
                with pytest.raises(BadInput) as err:
                    await asyncio.wait_for(client.call("lookup", {"mode": "train",
                                                                  "groups": [group]}), 5)
                assert err.value.field == field, str(err.value)
            assert len(started[0].store) == 0, "a refused lookup inserts nothing"
            reply = await asyncio.wait_for(client.call("lookup", {"mode": "train", "groups": [
                {"dim": 4, "ids": ids, "index": good_index, "offsets": good_offsets},
                {"dim": 4, "ids": ids}]}), 5)
            sums, rows = reply["rows"]
            assert reply["missing"] == 0 and sums.shape == (2, 4)
            assert_same(sums, segments.pool(np.array(rows), good_index, good_offsets))


@pytest.mark.parametrize("n", [1, 3])
async def test_empty_pooled_groups_and_segments_give_zero_sums(n):
    groups: list[LookupGroup] = [
        PooledLookup(4, np.zeros(0, np.uint64), np.zeros(0, np.int32), np.zeros(4, np.int64)),
        PooledLookup(4, np.array([5, 6], np.uint64), np.array([1, 0, 1], np.int32),
                     np.array([0, 0, 3], np.int64)),
        RowLookup(4, np.zeros(0, np.uint64))]
    async with running_servers(n, SGD(lr=0.1)) as (_, router):
        await asyncio.wait_for(router.lookup(groups[1:2], "train"), 5)
        (empty, sums, none), missing = await asyncio.wait_for(router.lookup(groups, "eval"), 5)
        rows, _ = await asyncio.wait_for(router.lookup([RowLookup(4, groups[1].ids)], "eval"), 5)
    assert missing == 0
    assert empty.shape == (3, 4) and not empty.any()
    assert none.shape == (0, 4)
    assert not sums[0].any()
    np.testing.assert_allclose(sums[1], rows[0][1] + rows[0][0] + rows[0][1], rtol=1e-6)


def test_slots_with_gradients_but_no_ids_send_no_empty_update():
    """Found by hypothesis in CI: a dim whose slots with gradients have no ids in the batch
    (here: every sample empty) must not appear in the update at all, as in the classic
    path; an empty group would be an RPC to every server for nothing."""
    feats = [IDTypeFeature.from_csr(name, np.zeros(0, dtype=np.uint64),
                                    np.zeros(4, dtype=np.int64)) for name in SLOTS]
    plan = batchplan.plan_batch(feats, MIXED)
    plans = classic_plans(feats, MIXED)
    grads = random_gradients(0, plans)
    got = batchplan.reduce_gradients(plan, grads)
    assert got.by_dim == {} == reduce_classic(plans, grads).by_dim


@pytest.mark.parametrize("store_threads", [1, 2])
@pytest.mark.parametrize("mode", ["eval", "infer"])
async def test_eval_lookups_count_every_id_without_a_row(mode, store_threads):
    stored = np.arange(1, 200, dtype=np.uint64)
    # plain and pooled groups, ids repeated inside a group and across groups
    plain = np.array([5, 500, 5, 501, 7, 500], np.uint64)
    pooled = np.array([8, 600, 9, 601, 602], np.uint64)
    index = np.array([0, 1, 2, 3, 4, 1, 0], np.int32)
    offsets = np.array([0, 3, 7], np.int64)
    async with running_servers(1, SGD(lr=0.1), store_threads=store_threads) as (started, _):
        async with RpcClient(started[0].address, timeout_ms=5000) as client:
            await client.call("lookup", {"mode": "train", "groups": [{"dim": 4, "ids": stored}]})
            reply = await client.call("lookup", {"mode": mode, "groups": [
                {"dim": 4, "ids": plain},
                {"dim": 4, "ids": pooled, "index": index, "offsets": offsets}]})
            assert reply["missing"] == 3 + 3   # per id looked up: 500, 501, 500; 600-602
            rows, sums = reply["rows"]
            assert not rows[[1, 3, 5]].any() and rows[[0, 2, 4]].all()
            assert len(started[0].store) == stored.size, "an eval lookup inserts nothing"
            train = await client.call("lookup", {"mode": "train", "groups": [
                {"dim": 4, "ids": plain}]})
            assert train["missing"] == 0   # a training lookup reports none: it admits them


async def test_gradients_of_a_hot_id_summing_past_float32_never_reach_a_row(caplog):
    """A real batch names one id 64 times, every gradient finite (1e37): its float32 sum is
    inf. The worker leaves that id out of the update (counted in
    nonfinite_gradient_ids_total, logged) and the server applies the rest; an update that
    names an id many times itself (the server sums it) is refused for that id alone
    (counted in the server's nonfinite_updates, logged). No row holds inf or NaN."""
    schema = EmbeddingSchema.from_dict({"slots_config": {"a": {"dim": 4}}})
    batch = [feature("a", [[7, 7, 7, 7, 100 + i] for i in range(16)])]
    plan = batchplan.plan_batch(batch, schema)
    grads = {"a": np.full((16, 4), 1e37, np.float32)}
    hot = int(schema.prefix_ids("a", np.array([7], np.uint64))[0])
    others = schema.prefix_ids("a", np.arange(100, 116, dtype=np.uint64))
    async with running_servers(1, SGD(lr=0.1)) as (started, router):
        _, groups = plan.lookup_groups()
        await router.lookup(groups, "train")
        every = np.r_[np.array([hot], np.uint64), others]
        (before,), _ = await router.lookup([RowLookup(4, every)], "eval")
        metrics = RoleMetrics("embedding_worker", 0)
        pushes = GradientPushes(router, metrics, name="embedding worker 0",
                                on_applied=lambda _: None)
        with caplog.at_level(logging.WARNING):
            reply = await pushes.push(1, plan, None, grads, retry_s=1.0)
        assert reply["applied"] == 16 and reply["dropped"] == 0
        assert "1 id(s) left out of its update" in caplog.text
        assert b"nonfinite_gradient_ids_total 1.0" in metrics.render()
        (after,), _ = await router.lookup([RowLookup(4, every)], "eval")
        assert np.isfinite(after).all()
        assert (after[0] == before[0]).all() and (after[1:] != before[1:]).all()

        caplog.clear()
        async with RpcClient(started[0].address, timeout_ms=5000) as client:
            ids = np.array([hot] * 64 + [int(others[0])], np.uint64)
            await client.call("update", {"groups": [
                {"dim": 4, "ids": ids, "grads": np.full((65, 4), 1e37, np.float32)}]})
            stats = await client.call("stats", {})
        assert stats["nonfinite_updates"] == 1
        assert "1 id(s) of update" in caplog.text and "not finite" in caplog.text
        (last,), _ = await router.lookup([RowLookup(4, every)], "eval")
        assert np.isfinite(last).all() and (last[0] == before[0]).all()
