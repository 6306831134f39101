"""Segment kernels of the pooled lookup path (stream_persia.kernels.segments).

The Cython loops and their numpy twins agree bit for bit on random lookups; both match
naive per-occurrence references (Python loops, torch's ``embedding_bag``, and for
pooled_lookup the per-slot prefix / concatenate / de-duplicate formulation it replaced);
both refuse malformed lookups with BadInput naming the field.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels import segments, twins
from stream_persia.kernels.ids import prefix_ids

IMPLS = ["cython", "python"]
HAS_C = segments._c is not None
needs_c = pytest.mark.skipif(not HAS_C, reason="stream_persia.kernels._segments is not built")
SETTINGS = settings(max_examples=50, deadline=None)


@contextlib.contextmanager
def implementation(name):
    before = segments.IMPLEMENTATION
    segments.IMPLEMENTATION = name
    try:
        yield
    finally:
        segments.IMPLEMENTATION = before


def both(fn, *args, **kwargs):
    """(Cython result, twin result) of ``fn``."""
    with implementation("cython"):
        c = fn(*args, **kwargs)
    with implementation("python"):
        p = fn(*args, **kwargs)
    return c, p


def assert_same(a, b):
    """Same dtype, shape and bits (NaN-safe, -0.0 told apart from 0.0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def random_rows(seed, n, dim):
    """float32 rows over several magnitudes, so that a change of summation order shows."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-3, 4, size=(n, 1))
    return (rng.normal(size=(n, dim)) * scale).astype(np.float32)


@st.composite
def lookups(draw, max_ids=12, max_segments=10, max_len=6):
    """A pooled lookup: (n_ids, index int32, offsets int64, dim, seed); empty lookups,
    empty segments, duplicates within a segment and ids shared across segments all come
    up (few ids, many occurrences)."""
    n_ids = draw(st.integers(0, max_ids))
    k = draw(st.integers(0, max_segments))
    lengths = draw(st.lists(st.integers(0, max_len if n_ids else 0), min_size=k, max_size=k))
    n = sum(lengths)
    index = draw(st.lists(st.integers(0, max(n_ids - 1, 0)), min_size=n, max_size=n))
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dim = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    return n_ids, np.array(index, dtype=np.int32), offsets, dim, seed


KEYS = st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1),
                          st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**32])), max_size=60)


# ---- naive references: one occurrence at a time, in occurrence order, from 0.0
def naive_pool(rows, index, offsets):
    out = np.zeros((len(offsets) - 1, rows.shape[1]), dtype=np.float32)
    for s in range(len(offsets) - 1):
        acc = np.zeros(rows.shape[1], dtype=np.float32)
        for j in range(offsets[s], offsets[s + 1]):
            acc = acc + rows[index[j]]
        out[s] = acc
    return out


def naive_scatter(grads, index, offsets, n_ids, active):
    out = np.zeros((n_ids, grads.shape[1]), dtype=np.float32)
    touched = np.zeros(n_ids, dtype=bool)
    for s in range(len(offsets) - 1):
        if not active[s]:
            continue
        for j in range(offsets[s], offsets[s + 1]):
            out[index[j]] = out[index[j]] + grads[s]
            touched[index[j]] = True
    return out, touched


def test_the_suite_states_which_implementation_runs():
    if twins.PURE_PYTHON or not HAS_C:
        assert segments.IMPLEMENTATION == "python"
    else:
        assert segments.IMPLEMENTATION == "cython"


# ---------------------------------------------------------------------------- Cython == twin
@needs_c
@SETTINGS
@given(KEYS)
def test_factorize_cython_equals_twin(keys):
    keys = np.array(keys, dtype=np.uint64)
    (cu, ci), (pu, pi) = both(segments.factorize, keys)
    assert_same(cu, pu)
    assert_same(ci, pi)


@needs_c
@SETTINGS
@given(lookups())
def test_pool_cython_equals_twin(lookup):
    n_ids, index, offsets, dim, seed = lookup
    rows = random_rows(seed, n_ids, dim)
    c, p = both(segments.pool, rows, index, offsets)
    assert_same(c, p)


@needs_c
@SETTINGS
@given(lookups(), st.data())
def test_scatter_cython_equals_twin(lookup, data):
    n_ids, index, offsets, dim, seed = lookup
    k = len(offsets) - 1
    grads = random_rows(seed, k, dim)
    active = np.array(data.draw(st.lists(st.booleans(), min_size=k, max_size=k)), dtype=bool)
    for mask in (None, active):
        (co, ct), (po, pt) = both(segments.scatter, grads, index, offsets, n_ids, mask)
        assert_same(co, po)
        assert_same(ct, pt)


@needs_c
@SETTINGS
@given(lookups(), st.integers(1, 4), st.data())
def test_split_cython_equals_twin(lookup, parts, data):
    n_ids, index, offsets, _, _ = lookup
    owner = np.array(data.draw(st.lists(st.integers(0, parts - 1), min_size=n_ids,
                                        max_size=n_ids)), dtype=np.int64)
    c, p = both(segments.split, index, offsets, owner, parts)
    assert len(c) == len(p) == parts
    for a, b in zip(c, p, strict=True):
        assert_same(a.positions, b.positions)
        assert_same(a.index, b.index)
        assert_same(a.offsets, b.offsets)


@needs_c
@SETTINGS
@given(lookups(), st.integers(1, 4), st.data())
def test_split_part_cuts_one_part_of_split(lookup, parts, data):
    """The branch-free one-part cut (each part on its own thread in ShardedStore) gives
    exactly split's part, in either implementation."""
    n_ids, index, offsets, _, _ = lookup
    owner = np.array(data.draw(st.lists(st.integers(0, parts - 1), min_size=n_ids,
                                        max_size=n_ids)), dtype=np.int64)
    whole = segments.split(index, offsets, owner, parts)
    for part in range(parts):
        for got in both(segments.split_part, index, offsets, owner, part, parts):
            assert_same(got.positions, whole[part].positions)
            assert_same(got.index, whole[part].index)
            assert_same(got.offsets, whole[part].offsets)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_part_refuses_a_bad_part_and_a_bad_index(impl):
    index, offsets, owner = (np.array([0, 1], dtype=np.int32), np.array([0, 2], dtype=np.int64),
                             np.array([0, 1], dtype=np.int64))
    with implementation(impl):
        with pytest.raises(Misuse, match="part must be in"):
            segments.split_part(index, offsets, owner, 2, 2)
        with pytest.raises(BadInput) as e:
            segments.split_part(np.array([0, 5], dtype=np.int32), offsets, owner, 0, 2)
        assert e.value.field.startswith("split")


# ---------------------------------------------------------------------------- semantics
@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(keys=KEYS)
def test_factorize_gives_distinct_ids_in_first_occurrence_order(impl, keys):
    keys = np.array(keys, dtype=np.uint64)
    with implementation(impl):
        uniq, inverse = segments.factorize(keys)
    assert uniq.dtype == np.uint64 and inverse.dtype == np.int32
    assert uniq.tolist() == list(dict.fromkeys(keys.tolist()))
    np.testing.assert_array_equal(uniq[inverse], keys)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lookup=lookups())
def test_pool_is_the_per_segment_sum_in_occurrence_order(impl, lookup):
    n_ids, index, offsets, dim, seed = lookup
    rows = random_rows(seed, n_ids, dim)
    with implementation(impl):
        got = segments.pool(rows, index, offsets)
    assert_same(got, naive_pool(rows, index, offsets))
    if len(offsets) > 1 and len(index):
        bag = torch.nn.functional.embedding_bag(
            torch.from_numpy(index.astype(np.int64)), torch.from_numpy(rows),
            torch.from_numpy(offsets[:-1].copy()), mode="sum").numpy()
        assert_same(got, bag)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lookup=lookups(), data=st.data())
def test_scatter_sums_per_id_in_occurrence_order(impl, lookup, data):
    n_ids, index, offsets, dim, seed = lookup
    k = len(offsets) - 1
    grads = random_rows(seed, k, dim)
    active = np.array(data.draw(st.lists(st.booleans(), min_size=k, max_size=k)), dtype=bool)
    with implementation(impl):
        out, touched = segments.scatter(grads, index, offsets, n_ids, active)
    want, reached = naive_scatter(grads, index, offsets, n_ids, active)
    assert_same(out, want)
    assert touched.dtype == bool
    np.testing.assert_array_equal(touched, reached)
    assert not out[~touched].any(), "an id no active segment reached has a gradient"


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lookup=lookups(), parts=st.integers(1, 4), data=st.data())
def test_split_parts_add_up_to_the_whole(impl, lookup, parts, data):
    n_ids, index, offsets, dim, seed = lookup
    k = len(offsets) - 1
    owner = np.array(data.draw(st.lists(st.integers(0, parts - 1), min_size=n_ids,
                                        max_size=n_ids)), dtype=np.int64)
    rows = random_rows(seed, n_ids, dim)
    with implementation(impl):
        split = segments.split(index, offsets, owner, parts)
        whole = segments.pool(rows, index, offsets)
        total = np.zeros_like(whole)
        for part in split:
            total += segments.pool(rows[part.positions], part.index, part.offsets)
        bound = segments.pool(np.abs(rows), index, offsets)
    assert len(split) == parts
    np.testing.assert_array_less(np.abs(total - whole), 1e-6 * bound + 1e-30)
    # The parts' ids are disjoint, cover every id, and each part holds what it owns.
    every = np.concatenate([part.positions for part in split])
    np.testing.assert_array_equal(np.sort(every), np.arange(n_ids))
    for p, part in enumerate(split):
        assert part.positions.dtype == np.int64 and part.index.dtype == np.int32
        assert part.offsets.dtype == np.int64 and part.offsets.shape == (k + 1,)
        assert (np.diff(part.positions) > 0).all(), "positions keep the lookup's order"
        assert (owner[part.positions] == p).all()
        for s in range(k):
            mine = [u for u in index[offsets[s]:offsets[s + 1]] if owner[u] == p]
            got = part.positions[part.index[part.offsets[s]:part.offsets[s + 1]]]
            assert got.tolist() == mine


def test_empty_lookup_and_empty_segments():
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    index = np.array([2, 2, 0], dtype=np.int32)
    offsets = np.array([0, 0, 2, 2, 3, 3], dtype=np.int64)
    for impl in IMPLS if HAS_C else ["python"]:
        with implementation(impl):
            np.testing.assert_array_equal(segments.pool(rows, index, offsets),
                                          [[0, 0], [8, 10], [0, 0], [0, 1], [0, 0]])
            empty = segments.pool(np.zeros((0, 4), np.float32), np.zeros(0, np.int32),
                                  np.zeros(1, np.int64))
            assert empty.shape == (0, 4) and empty.dtype == np.float32
            uniq, inverse = segments.factorize(np.zeros(0, np.uint64))
            assert uniq.shape == inverse.shape == (0,)
            out, touched = segments.scatter(np.zeros((0, 3), np.float32), np.zeros(0, np.int32),
                                            np.zeros(1, np.int64), 2)
            assert out.shape == (2, 3) and not out.any() and not touched.any()
            parts = segments.split(np.zeros(0, np.int32), np.zeros(3, np.int64),
                                   np.zeros(0, np.int64), 2)
            assert [p.offsets.tolist() for p in parts] == [[0, 0, 0], [0, 0, 0]]


# ---------------------------------------------------------------------------- bad input
I32, I64 = np.int32, np.int64
GOOD_INDEX, GOOD_OFFSETS = np.array([0, 2, 1], I32), np.array([0, 2, 3], I64)
BAD_LOOKUPS = [  # (index, offsets, the field's suffix)
    pytest.param(GOOD_INDEX.astype(I64), GOOD_OFFSETS, "index", id="int64-index"),
    pytest.param(GOOD_INDEX, GOOD_OFFSETS.astype(I32), "offsets", id="int32-offsets"),
    pytest.param(GOOD_INDEX, np.array([], I64), "offsets", id="no-offsets"),
    pytest.param(GOOD_INDEX, np.array([1, 2, 3], I64), "offsets", id="offsets-not-from-0"),
    pytest.param(GOOD_INDEX, np.array([0, 3, 2, 3], I64), "offsets", id="offsets-decrease"),
    pytest.param(GOOD_INDEX, np.array([0, 2, 2], I64), "offsets", id="offsets-short-of-end"),
    pytest.param(GOOD_INDEX, np.array([0, 2, 4], I64), "offsets", id="offsets-past-end"),
    pytest.param(np.array([0, -1, 1], I32), GOOD_OFFSETS, "index", id="negative-index"),
    pytest.param(np.array([0, 3, 1], I32), GOOD_OFFSETS, "index", id="index-past-ids"),
]


def call_kernel(kernel, index, offsets):
    """Run ``kernel`` on a lookup over 3 ids; returns the field its errors must name."""
    k = max(len(offsets) - 1, 0)
    if kernel == "pool":
        segments.pool(np.ones((3, 2), np.float32), index, offsets, field="groups[0]")
    elif kernel == "scatter":
        segments.scatter(np.ones((k, 2), np.float32), index, offsets, 3)
    elif kernel == "split":
        segments.split(index, offsets, np.zeros(3, I64), 2)
    else:
        segments.check_pooled(3, index, offsets, "groups[1]")


FIELDS = {"pool": "groups[0]", "scatter": "gradients", "split": "split",
          "check_pooled": "groups[1]"}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kernel", list(FIELDS))
@pytest.mark.parametrize("index, offsets, suffix", BAD_LOOKUPS)
def test_malformed_lookups_are_refused_naming_the_field(impl, kernel, index, offsets, suffix,
                                                        monkeypatch):
    if impl == "cython" and not HAS_C:
        pytest.skip("stream_persia.kernels._segments is not built")
    monkeypatch.setattr(segments, "IMPLEMENTATION", impl)
    with pytest.raises(BadInput) as err:
        call_kernel(kernel, index, offsets)
    assert err.value.field == f"{FIELDS[kernel]}.{suffix}", str(err.value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("owner", [[0, -1, 1], [0, 2, 1], [0, 1, 5]])
def test_split_refuses_an_owner_out_of_range(impl, owner, monkeypatch):
    if impl == "cython" and not HAS_C:
        pytest.skip("stream_persia.kernels._segments is not built")
    monkeypatch.setattr(segments, "IMPLEMENTATION", impl)
    with pytest.raises(BadInput) as err:
        segments.split(GOOD_INDEX, GOOD_OFFSETS, np.array(owner, I64), 2)
    assert err.value.field.startswith("split")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grads_rows, active_len", [(1, 3), (3, 1)], ids=["grads", "active"])
def test_scatter_refuses_gradients_or_mask_not_one_per_segment(impl, grads_rows, active_len,
                                                               monkeypatch):
    # The Cython loop reads grads[s] and active[s] for every segment s without bounds
    # checks: a short array must be refused before it runs, not read past its end.
    if impl == "cython" and not HAS_C:
        pytest.skip("stream_persia.kernels._segments is not built")
    monkeypatch.setattr(segments, "IMPLEMENTATION", impl)
    with pytest.raises(BadInput):
        segments.scatter(np.ones((grads_rows, 2), np.float32), np.array([0, 1, 2], I32),
                         np.array([0, 1, 2, 3], I64), 3, np.ones(active_len, bool))


# ---------------------------------------------------------------------------- pooled_lookup
def reference_pooled_lookup(values, offsets, prefixes, bits, sqrt):
    """The pooled lookup from its definition, independently of both implementations:
    prefix_ids per slot, de-duplication in first-occurrence order (a dict), and
    segment ``i * batch + b`` holding slot i's sample b, so the segment bounds are the
    running sum of every (slot, sample) length in that order, and a sqrt slot's scale is
    ``1/sqrt(length)`` (0 for an empty sample)."""
    keys = [prefix_ids(v, index_prefix=p, prefix_bits=bits)
            for v, p in zip(values, prefixes, strict=True)]
    flat = (np.concatenate(keys) if keys else np.zeros(0, np.uint64)).tolist()
    first = {key: None for key in flat}
    position = {key: i for i, key in enumerate(first)}
    ids = np.array(list(first), dtype=np.uint64)
    index = np.array([position[key] for key in flat], dtype=np.int32)
    lengths = [int(off[b + 1] - off[b]) for off in offsets for b in range(len(off) - 1)]
    bounds = np.array([0, *itertools.accumulate(lengths)], dtype=np.int64)
    scale = None
    if any(sqrt):
        batch = len(offsets[0]) - 1
        scale = np.array([(1 / math.sqrt(n) if n else 0.0) if sqrt[j // batch] else 1.0
                          for j, n in enumerate(lengths)], dtype=np.float32)
    return ids, index, bounds, scale


def assert_same_lookup(got, want):
    for a, b in zip(got[:3], want[:3], strict=True):
        assert_same(a, b)
    assert (got[3] is None) == (want[3] is None)
    if want[3] is not None:
        assert_same(got[3], want[3])


@st.composite
def csr_slots(draw, max_slots=4, max_batch=6, max_len=4):
    """The slots of one dim: (values, offsets, index_prefixes, prefix_bits, sqrt). Empty
    batches, samples and slots, ids repeated within and across slots, slots sharing a
    prefix (a feature group) or unprefixed (prefix 0), prefixes that wrap past 2**64, ids
    at, around and far above the prefix modulus (the division) all come up; values and
    offsets are sometimes strided or unaligned views."""
    bits = draw(st.sampled_from([0, 1, 3, 8, 32, 63]))
    k = draw(st.integers(0, max_slots))
    batch = draw(st.integers(0, max_batch))
    special = [0, 1, 2**32, 2**63, 2**64 - 1]
    if bits:
        modulus = (1 << (64 - bits)) - 1
        special += [x for x in (modulus - 1, modulus, modulus + 1, 2 * modulus + 5)
                    if x < 2**64]
        group = [(g + 1) << (64 - bits) for g in range(min(3, (1 << bits) - 1))]
    else:
        group = []
    ids = st.one_of(st.integers(0, 6), st.integers(0, 2**64 - 1), st.sampled_from(special))
    prefixes = st.one_of(st.sampled_from([0, *group]), st.integers(0, 2**64 - 1))
    values, offsets = [], []
    for _ in range(k):
        empty = draw(st.integers(0, 3)) == 0
        lengths = draw(st.lists(st.integers(0, 0 if empty else max_len),
                                min_size=batch, max_size=batch))
        off = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(lengths, out=off[1:])
        v = np.array(draw(st.lists(ids, min_size=int(off[-1]), max_size=int(off[-1]))),
                     dtype=np.uint64)
        layout = draw(st.sampled_from(["contiguous", "strided", "unaligned"]))
        if layout == "strided":
            v = np.repeat(v, 2)[::2]
            off = np.repeat(off, 3)[::3]
        elif layout == "unaligned":
            raw = np.zeros(8 * len(v) + 1, dtype=np.uint8)
            raw[1:] = v.view(np.uint8)
            v = raw[1:].view(np.uint64) if len(v) else v
        values.append(v)
        offsets.append(off)
    index_prefixes = draw(st.lists(prefixes, min_size=k, max_size=k))
    sqrt = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    return values, offsets, index_prefixes, bits, sqrt


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(slots=csr_slots())
def test_pooled_lookup_equals_the_reference(impl, slots):
    if impl == "cython" and not HAS_C:
        pytest.skip("stream_persia.kernels._segments is not built")
    values, offsets, prefixes, bits, sqrt = slots
    want = reference_pooled_lookup(values, offsets, prefixes, bits, sqrt)
    with implementation(impl):
        assert_same_lookup(segments.pooled_lookup(values, offsets, prefixes, bits, sqrt), want)
        if not any(sqrt):   # no flags at all: no scale either
            got = segments.pooled_lookup(values, offsets, prefixes, bits)
            assert_same_lookup(got, want)


@needs_c
@SETTINGS
@given(slots=csr_slots(max_slots=6, max_batch=40, max_len=8))
def test_pooled_lookup_cython_equals_twin(slots):
    c, p = both(segments.pooled_lookup, *slots)
    assert_same_lookup(c, p)


def test_pooled_lookup_of_a_large_batch_equals_the_reference():
    # Past the kernel's prefetch chunk and the hash table's smallest size, with ids above
    # the modulus in every slot and two slots sharing a prefix.
    rng = np.random.default_rng(7)
    bits, batch = 8, 300
    values, offsets = [], []
    for _ in range(5):
        off = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(rng.integers(0, 6, size=batch), out=off[1:])
        v = rng.integers(0, 500, size=int(off[-1])).astype(np.uint64)
        v[::7] |= np.uint64(0xFF00_0000_0000_0000)
        values.append(v)
        offsets.append(off)
    prefixes = [1 << 56, 1 << 56, 2 << 56, 0, 3 << 56]
    sqrt = [False, True, False, True, False]
    want = reference_pooled_lookup(values, offsets, prefixes, bits, sqrt)
    for impl in IMPLS if HAS_C else ["python"]:
        with implementation(impl):
            assert_same_lookup(segments.pooled_lookup(values, offsets, prefixes, bits, sqrt),
                               want)


U64 = np.uint64
GOOD_VALUES, GOOD_CSR = np.array([5, 6, 7], U64), np.array([0, 2, 3], I64)
BAD_SLOTS = [  # (values, offsets, the field's suffix); slot 1 is the bad one
    pytest.param(GOOD_VALUES.astype(I64), GOOD_CSR, "values", id="int64-values"),
    pytest.param(GOOD_VALUES.reshape(3, 1), GOOD_CSR, "values", id="2-D-values"),
    pytest.param([5, 6, 7], GOOD_CSR, "values", id="list-values"),
    pytest.param(GOOD_VALUES.astype(">u8"), GOOD_CSR, "values", id="big-endian-values"),
    pytest.param(np.zeros(3, "M8[s]"), GOOD_CSR, "values", id="datetime-values"),
    pytest.param(GOOD_VALUES, GOOD_CSR.astype(I32), "offsets", id="int32-offsets"),
    pytest.param(GOOD_VALUES, [0, 2, 3], "offsets", id="list-offsets"),
    pytest.param(GOOD_VALUES, np.array([0, 1, 2, 3], I64), "offsets", id="more-samples"),
    pytest.param(GOOD_VALUES, np.array([1, 2, 3], I64), "offsets", id="not-from-0"),
    pytest.param(GOOD_VALUES, np.array([0, 4, 3], I64), "offsets", id="decrease"),
    pytest.param(GOOD_VALUES, np.array([0, 1, 2], I64), "offsets", id="short-of-end"),
    pytest.param(GOOD_VALUES, np.array([0, 2, 4], I64), "offsets", id="past-end"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("values, offsets, suffix", BAD_SLOTS)
def test_pooled_lookup_refuses_malformed_slots_naming_the_slot(impl, values, offsets, suffix,
                                                                monkeypatch):
    if impl == "cython" and not HAS_C:
        pytest.skip("stream_persia.kernels._segments is not built")
    monkeypatch.setattr(segments, "IMPLEMENTATION", impl)
    with pytest.raises(BadInput) as err:
        segments.pooled_lookup([GOOD_VALUES, values], [GOOD_CSR, offsets], [0, 1 << 56], 8,
                               field="user")
    assert err.value.field == f"user[1].{suffix}", str(err.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_pooled_lookup_checks_every_slot_s_types_before_any_offsets(impl, monkeypatch):
    # Both implementations name the same slot when several are malformed.
    if impl == "cython" and not HAS_C:
        pytest.skip("stream_persia.kernels._segments is not built")
    monkeypatch.setattr(segments, "IMPLEMENTATION", impl)
    with pytest.raises(BadInput) as err:
        segments.pooled_lookup([GOOD_VALUES, GOOD_VALUES.astype(I64)],
                               [np.array([0, 3, 3], I64), GOOD_CSR], [0, 0], 8)
    assert err.value.field == "slots[1].values"


@pytest.mark.parametrize("impl", IMPLS)
def test_pooled_lookup_misuse(impl, monkeypatch):
    monkeypatch.setattr(segments, "IMPLEMENTATION", impl if HAS_C else "python")
    with pytest.raises(Misuse):
        segments.pooled_lookup([GOOD_VALUES], [GOOD_CSR], [0, 0], 8)
    with pytest.raises(Misuse):
        segments.pooled_lookup([GOOD_VALUES], [GOOD_CSR], [0], 8, [True, False])
    with pytest.raises(Misuse):
        segments.pooled_lookup([GOOD_VALUES], [GOOD_CSR], [0], 64)
