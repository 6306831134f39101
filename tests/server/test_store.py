"""The embedding store: every behaviour runs on both the Cython store and its Python twin,
and a differential test checks that they agree bit for bit on random call sequences."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad, Adam
from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels import twins
from stream_persia.server import store
from stream_persia.server._pystore import PyEmbeddingStore

CEmbeddingStore = pytest.importorskip("stream_persia.server._cstore").CEmbeddingStore
IMPLS = [pytest.param(CEmbeddingStore, id="cython"), pytest.param(PyEmbeddingStore, id="python")]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def u64(*ids):
    return np.array(ids, np.uint64)


def f32(rows):
    return np.array(rows, np.float32).reshape(len(rows), -1)


def put(s, ids, weights, state=None):
    """Set rows through load() (the way a checkpoint restores them)."""
    chunk = {"dim": np.shape(weights)[1], "ids": u64(*ids), "weights": f32(weights)}
    if state is not None:
        chunk.update(state=f32(state), state_kind=s.optimizer.state_kind)
    s.load([chunk])


def state_of(s, key):
    for chunk in s.dump():
        hit = np.flatnonzero(chunk["ids"] == key)
        if len(hit):
            return chunk["state"][hit[0]]
    raise KeyError(key)


# --- which implementation runs --------------------------------------------------------------

@pytest.mark.parametrize("flag, expected", [("1", "python"), ("", "cython")])
def test_env_flag_picks_the_implementation(flag, expected):
    env = {**os.environ, "STREAM_PERSIA_PURE_PYTHON": flag}
    out = subprocess.run(
        [sys.executable, "-c", "from stream_persia.server import store as s;"
         "print(s.IMPLEMENTATION, s.EmbeddingStore.__name__)"],
        env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [expected, {"python": "PyEmbeddingStore", "cython": "CEmbeddingStore"}[expected]]


def test_module_constant_matches_the_class_in_use():
    assert store.EmbeddingStore.implementation == store.IMPLEMENTATION
    forced = twins.PURE_PYTHON
    assert store.IMPLEMENTATION == ("python" if forced else "cython")


# --- PERSIA's oracles -----------------------------------------------------------------------

ROW0 = [0.7306, 0.0340, 0.1331, 0.4355, 0.0305, 0.6968, 0.1528, 0.7074, 0.5598, 0.0271,
        0.7671, 0.8731]
GRADS = [
    [0.6039, 0.2480, 0.8303, 0.8006, 0.6830, 0.4730, 0.0381, 0.8375, 0.5836, 0.8673, 0.2224,
     0.4040],
    [0.4478, 0.9670, 0.5724, 0.3074, 0.5760, 0.2937, 0.0995, 0.6640, 0.7718, 0.3016, 0.0246,
     0.6975],
    [0.2304, 0.9627, 0.3126, 0.8667, 0.6767, 0.6441, 0.0131, 0.1702, 0.8901, 0.4696, 0.2655,
     0.0545],
]


@pytest.mark.parametrize("shared, row, acc", [
    (False,
     [0.6598564, -0.036559787, 0.04014046, 0.34159237, -0.053671654, 0.6320387, 0.1387946,
      0.6141905, 0.47925496, -0.06816861, 0.7330182, 0.81526995],
     [0.6283042, 1.9333843, 1.1247585, 1.496624, 1.2661879, 0.7348535, 0.021523468, 1.1812702,
      1.7385421, 1.073696, 0.13055718, 0.6626925]),
    (True,
     [0.6601662, -0.018124206, 0.03701234, 0.33996183, -0.055326782, 0.63694036, 0.14721976,
      0.6108338, 0.47815663, -0.070203856, 0.741245, 0.82074344],
     [0.99936616]),
])
def test_persia_adagrad_oracle(impl, shared, row, acc):
    opt = Adagrad(lr=0.01, initial_accumulator_value=0.01, eps=1e-10, g_square_momentum=1,
                  vectorwise_shared=shared)
    s = impl(10, opt)
    put(s, [42], [ROW0])  # no state in the chunk: a fresh accumulator
    for g in GRADS:
        s.update(u64(42), f32([g]))
    np.testing.assert_allclose(s.lookup(u64(42), 12, train=False)[0], row, atol=1e-5)
    np.testing.assert_allclose(state_of(s, 42), acc, atol=1e-5)


def test_persia_lru_oracle(impl):
    s = impl(5, SGD(0.1))
    s.lookup(np.arange(10, dtype=np.uint64), 4)
    assert len(s) == 5
    assert not s.contains(u64(4))[0]
    assert s.contains(u64(5))[0]
    s.lookup(u64(5), 4)  # refresh id 5
    s.lookup(u64(10), 4)
    assert list(s.contains(u64(5, 6, 7, 10))) == [True, False, True, True]
    assert s.stats()["evictions"] == 6


# --- semantics ------------------------------------------------------------------------------

def test_new_rows_are_deterministic_per_id_and_in_range(impl):
    cfg = EmbeddingConfig(emb_initialization=(-0.5, 0.25))
    a = impl(100, SGD(0.1), cfg).lookup(u64(1, 2, 3, 2**63 + 5), 7)
    b = impl(3, SGD(0.1), cfg).lookup(u64(2**63 + 5, 3), 7)  # another store, order, capacity
    np.testing.assert_array_equal(a[[3, 2]], b)
    assert a.min() >= -0.5 and a.max() < 0.25
    assert len({r.tobytes() for r in a}) == 4
    assert len(set(a[1].tolist())) > 1  # elements differ within a row


def test_inference_lookups_neither_insert_nor_refresh(impl):
    s = impl(2, SGD(0.1))
    first = s.lookup(u64(1, 2), 3)
    out = s.lookup(u64(1, 9), 3, train=False)
    np.testing.assert_array_equal(out[0], first[0])
    np.testing.assert_array_equal(out[1], np.zeros(3, np.float32))
    assert len(s) == 2 and not s.contains(u64(9))[0]
    s.lookup(u64(3), 3)  # id 1 was not refreshed by the inference lookup: it goes first
    assert list(s.contains(u64(1, 2, 3))) == [False, True, True]


def test_contains_does_not_refresh(impl):
    s = impl(2, SGD(0.1))
    s.lookup(u64(1, 2), 3)
    assert list(s.contains(u64(1, 2, 3))) == [True, True, False]
    s.lookup(u64(3), 3)
    assert list(s.contains(u64(1, 2, 3))) == [False, True, True]


def test_admit_probability(impl):
    ids = np.arange(4000, dtype=np.uint64)
    never = impl(10_000, SGD(0.1), EmbeddingConfig(admit_probability=0.0))
    out = never.lookup(ids, 2)
    assert len(never) == 0 and not out.any()
    assert never.stats()["misses"] == 4000 and never.stats()["admissions"] == 0
    half = impl(10_000, SGD(0.1), EmbeddingConfig(admit_probability=0.5))
    out = half.lookup(ids, 2)
    admitted = half.contains(ids)
    assert 1800 < admitted.sum() < 2200
    assert (out[~admitted] == 0).all() and (out[admitted] != 0).any(axis=1).all()
    # A rejected id gets a fresh draw on its next training miss.
    half.lookup(ids[~admitted], 2)
    assert half.contains(ids).sum() > admitted.sum()


def test_duplicate_ids_in_one_update_are_summed(impl):
    s = impl(10, SGD(0.5))
    put(s, [7, 8], [[1.0, 1.0], [2.0, 2.0]])
    s.update(u64(7, 8, 7, 99), f32([[0.1, 0.2], [1.0, 1.0], [0.3, -0.2], [5.0, 5.0]]))
    np.testing.assert_allclose(s.lookup(u64(7, 8), 2, train=False),
                               [[1 - 0.5 * 0.4, 1.0], [1.5, 1.5]], rtol=1e-6)
    assert s.stats()["dropped_updates"] == 1 and s.stats()["updates"] == 4


@pytest.mark.parametrize("opt", [SGD(0.1), SGD(0.1, momentum=0.9), Adagrad(lr=0.1),
                                 Adam(lr=0.01)], ids=lambda o: f"{o.name}{getattr(o, 'momentum', '')}")
def test_duplicate_gradients_summing_past_float32_leave_the_row_unchanged(impl, opt):
    """One id 64 times in an update, each gradient finite (1e37): the float32 sum is inf.
    The id's row is not stepped (weights and state kept) and counted; the other ids of the
    call are stepped as usual; no row ever holds inf or NaN."""
    s = impl(10, opt, EmbeddingConfig(weight_bound=1e30))
    s.lookup(u64(1, 2, 3), 4)
    before = {k: (s.lookup(u64(k), 4, train=False), state_of(s, k)) for k in (1, 2, 3)}
    ids = u64(*([1] * 64 + [2, 3, 3, 3]))
    grads = np.full((len(ids), 4), 1e37, np.float32)
    grads[64], grads[66], grads[67] = 0.5, -1e37, 0.25   # id 3: 1e37 - 1e37 + 0.25
    s.update(ids, grads)
    assert s.stats()["nonfinite_updates"] == 1 and s.stats()["updates"] == len(ids)
    after = s.lookup(u64(1, 2, 3), 4, train=False)
    assert np.isfinite(after).all() and all(np.isfinite(state_of(s, k)).all() for k in (1, 2, 3))
    assert (after[0] == before[1][0]).all() and (state_of(s, 1) == before[1][1]).all()
    assert not (after[1] == before[2][0]).all() and not (after[2] == before[3][0]).all()
    # A finite sum whose square overflows the optimizer's state (Adagrad, Adam): refused
    # too, where it would leave inf in the state; SGD's step keeps it finite (clamped).
    s.update(u64(2), np.full((1, 4), 3e38, np.float32))
    assert np.isfinite(s.lookup(u64(2), 4, train=False)).all()
    assert np.isfinite(state_of(s, 2)).all()
    assert s.stats()["nonfinite_updates"] == (1 if opt.name == "sgd" else 2)


def test_duplicates_are_summed_before_the_step(impl):
    """Adagrad is not linear: one step with g1+g2 differs from two steps."""
    s = impl(10, Adagrad(lr=0.1))
    put(s, [1, 2], [[0.0], [0.0]])
    s.update(u64(1, 1), f32([[1.0], [1.0]]))
    s.update(u64(2), f32([[2.0]]))
    both = s.lookup(u64(1, 2), 1, train=False)
    assert both[0, 0] == both[1, 0]
    np.testing.assert_allclose(state_of(s, 1), [0.01 + 4.0], rtol=1e-6)


def test_weight_bound_clamps_after_update(impl):
    s = impl(10, SGD(1.0), EmbeddingConfig(weight_bound=0.5))
    put(s, [1], [[0.9, 0.1, -0.2]])  # loaded rows are not clamped until updated
    np.testing.assert_allclose(s.lookup(u64(1), 3, train=False), [[0.9, 0.1, -0.2]], rtol=1e-6)
    s.update(u64(1), f32([[0.0, -3.0, 3.0]]))
    np.testing.assert_allclose(s.lookup(u64(1), 3, train=False), [[0.5, 0.5, -0.5]])


def test_updates_of_evicted_ids_are_dropped_and_counted(impl):
    s = impl(2, SGD(0.1))
    s.lookup(u64(1, 2, 3), 2)
    before = s.lookup(u64(2, 3), 2, train=False)
    s.update(u64(1, 1, 4), np.ones((3, 2), np.float32))
    assert s.stats()["dropped_updates"] == 3
    np.testing.assert_array_equal(s.lookup(u64(2, 3), 2, train=False), before)


def test_rows_of_different_dims_share_capacity_and_lru(impl):
    s = impl(3, SGD(0.1))
    s.lookup(u64(1), 4)
    s.lookup(u64(2, 3), 8)
    s.lookup(u64(4), 2)
    assert len(s) == 3 and list(s.contains(u64(1, 2, 3, 4))) == [False, True, True, True]
    assert s.lookup(u64(2), 8).shape == (1, 8)
    with pytest.raises(BadInput, match="id 2 is stored with dim 8 but this lookup uses dim 4"):
        s.lookup(u64(2), 4)
    with pytest.raises(BadInput, match="id 3 is stored with dim 8 but this update uses dim 2"):
        s.update(u64(4, 3), np.ones((2, 2), np.float32))
    assert s.stats()["updates"] == 0  # the failed update changed nothing


def test_stats_count_lookups_and_misses(impl):
    s = impl(10, SGD(0.1))
    s.lookup(u64(1, 2, 1), 2)
    s.lookup(u64(1, 5), 2, train=False)
    assert s.stats() == {"rows": 2, "capacity": 10, "lookups": 5, "misses": 3,
                         "admissions": 2, "evictions": 0, "updates": 0, "dropped_updates": 0,
                         "removals": 0, "nonfinite_updates": 0}


def test_clear_drops_rows_and_keeps_counters(impl):
    s = impl(10, SGD(0.1))
    s.lookup(u64(1, 2), 2)
    s.clear()
    assert len(s) == 0 and not s.lookup(u64(1), 2, train=False).any()
    assert s.stats()["admissions"] == 2
    s.lookup(u64(1), 2)
    assert len(s) == 1


CLOSED_CALLS = {
    "lookup": lambda s: s.lookup(u64(1), 2),
    "lookup_pooled": lambda s: s.lookup_pooled(u64(1), 2, np.zeros(1, np.int32),
                                               np.array([0, 1], np.int64)),
    "update": lambda s: s.update(u64(1), f32([[1, 1]])),
    "contains": lambda s: s.contains(u64(1)),
    "clear": lambda s: s.clear(),
    "configure": lambda s: s.configure(SGD(0.2)),
    "dump": lambda s: list(s.dump()),
    "load": lambda s: put(s, [1], [[1, 1]]),
}


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_a_closed_store_frees_its_rows_and_refuses_calls(impl, call):
    s = impl(100, Adagrad(0.1))
    s.lookup(np.arange(50, dtype=np.uint64), 8)
    assert s.memory_bytes() > 0
    s.close()
    s.close()   # idempotent
    assert len(s) == 0 and s.memory_bytes() == 0
    assert s.stats()["admissions"] == 50   # the counters stay readable
    with pytest.raises(Misuse, match="closed"):
        CLOSED_CALLS[call](s)


def test_closing_a_store_mid_dump_stops_the_dump(impl):
    s = impl(100, SGD(0.1))
    s.lookup(np.arange(50, dtype=np.uint64), 2)
    chunks = s.dump(chunk_rows=10)
    next(chunks)
    s.close()
    with pytest.raises(Misuse):
        next(chunks)
    # closed before its first chunk: refused too, not an empty dump
    s = impl(100, SGD(0.1))
    s.lookup(np.arange(50, dtype=np.uint64), 2)
    chunks = s.dump(chunk_rows=10)
    s.close()
    with pytest.raises(Misuse, match="closed"):
        next(chunks)


def test_empty_batches(impl):
    s = impl(10, SGD(0.1))
    assert s.lookup(np.zeros(0, np.uint64), 3).shape == (0, 3)
    s.update(np.zeros(0, np.uint64), np.zeros((0, 3), np.float32))
    assert not s.contains(np.zeros(0, np.uint64)).size


def test_read_only_and_strided_inputs_are_accepted(impl):
    s = impl(10, SGD(0.5))
    ids = np.arange(6, dtype=np.uint64)[::2]
    ids_ro = ids.copy()
    ids_ro.flags.writeable = False
    s.lookup(ids_ro, 2)
    grads = np.ones((3, 4), np.float32)[:, ::2]
    before = s.lookup(ids, 2, train=False)
    s.update(ids, grads)
    np.testing.assert_allclose(s.lookup(ids, 2, train=False), before - 0.5)


# --- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("call, field, text", [
    (lambda s: s.lookup(np.arange(3), 2), "ids", "uint64, got int64"),
    (lambda s: s.lookup([1, 2], 2), "ids", "got list"),
    (lambda s: s.lookup(np.zeros((2, 2), np.uint64), 2), "ids", "1-D"),
    (lambda s: s.lookup(u64(1), 0), "dim", "dim must be"),
    (lambda s: s.update(u64(1), np.ones((1, 2))), "grads", "float32 array of shape (1, dim)"),
    (lambda s: s.update(u64(1, 2), np.ones((1, 2), np.float32)), "grads", "(2, dim)"),
    (lambda s: s.update(u64(1), np.ones(2, np.float32)), "grads", "float32"),
    (lambda s: s.update(u64(1, 2), f32([[1.0], [np.nan]])), "grads", "row 1 (id 2)"),
    (lambda s: s.update(u64(1), f32([[np.inf]])), "grads", "not finite"),
    (lambda s: s.dump(chunk_rows=0), "chunk_rows", "chunk_rows"),
    (lambda s: s.configure(optimizer="sgd"), "optimizer", "optimizer must be"),
    (lambda s: s.configure(embedding_config={"admit": 1}), "admit", "unknown"),
])
def test_bad_input_names_the_field(impl, call, field, text):
    s = impl(10, SGD(0.1))
    with pytest.raises(BadInput) as info:
        call(s)
    assert info.value.field == field
    assert text in str(info.value)


@pytest.mark.parametrize("capacity", [0, -1, 2**30 + 1, 1.5, True])
def test_capacity_is_validated(impl, capacity):
    with pytest.raises(BadInput) as info:
        impl(capacity, SGD(0.1))
    assert info.value.field == "capacity"


def test_nonfinite_gradients_change_nothing(impl):
    s = impl(10, SGD(0.1))
    before = s.lookup(u64(1, 2), 2)
    with pytest.raises(BadInput):
        s.update(u64(1, 2), f32([[1.0, 1.0], [np.nan, 0.0]]))
    np.testing.assert_array_equal(s.lookup(u64(1, 2), 2, train=False), before)


# --- dump, load, configure ------------------------------------------------------------------

def test_dump_load_round_trip_with_state_and_recency(impl):
    s = impl(4, Adam(0.01))
    s.lookup(u64(1, 2, 3, 4), 3)
    s.update(u64(1, 3), np.ones((2, 3), np.float32))
    s.lookup(u64(1), 3)  # recency now, oldest first: 2, 3, 4, 1
    chunks = list(s.dump(chunk_rows=3))
    assert [c["ids"].tolist() for c in chunks] == [[2, 3, 4], [1]]
    assert chunks[0]["state"].shape == (3, 8) and chunks[0]["state_kind"] == "adam"
    t = impl(4, Adam(0.01))
    t.load(chunks)
    for key in (1, 2, 3, 4):
        np.testing.assert_array_equal(state_of(t, key), state_of(s, key))
    np.testing.assert_array_equal(t.lookup(u64(1, 2, 3, 4), 3, train=False),
                                  s.lookup(u64(1, 2, 3, 4), 3, train=False))
    t.lookup(u64(5), 3)  # the least recently used (2) goes first, as in the source store
    assert list(t.contains(u64(1, 2, 3, 4, 5))) == [True, False, True, True, True]


def test_load_into_a_smaller_store_keeps_the_most_recent(impl):
    s = impl(10, SGD(0.1))
    s.lookup(np.arange(6, dtype=np.uint64), 2)
    t = impl(3, SGD(0.1))
    t.load(s.dump(chunk_rows=4))
    assert list(t.contains(np.arange(6, dtype=np.uint64))) == [False] * 3 + [True] * 3
    assert t.stats()["evictions"] == 3


def test_load_validates_chunks(impl):
    s = impl(10, Adagrad())
    src = impl(10, Adam())
    src.lookup(u64(1), 2)
    adam_chunk = next(src.dump())
    with pytest.raises(BadInput, match="'adam' optimizer state") as info:
        s.load([adam_chunk])
    assert info.value.field == "state_kind"
    del adam_chunk["state"]  # weights only: a fresh Adagrad state
    s.load([adam_chunk])
    np.testing.assert_allclose(state_of(s, 1), [0.01, 0.01])
    with pytest.raises(BadInput, match="weights must be float32 of shape"):
        s.load([{"dim": 2, "ids": u64(1), "weights": np.ones((1, 3), np.float32)}])
    with pytest.raises(BadInput, match="lacks"):
        s.load([{"ids": u64(1)}])
    with pytest.raises(BadInput, match="id 1 is stored with dim 2 but this load uses dim 3"):
        s.load([{"dim": 3, "ids": u64(1), "weights": np.ones((1, 3), np.float32)}])


_W, _S = np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)


@pytest.mark.parametrize("chunk, field", [
    (None, "chunk"),
    ({"dim": True, "ids": u64(7, 8), "weights": _W}, "dim"),
    ({"dim": "2", "ids": u64(7, 8), "weights": _W}, "dim"),
    ({"dim": 2, "ids": np.array([7, 8]), "weights": _W}, "ids"),
    ({"dim": 2, "ids": u64(7, 8)[None], "weights": _W}, "ids"),
    ({"dim": 2, "ids": u64(7, 8), "weights": _W.astype(">f4")}, "weights"),
    ({"dim": 2, "ids": u64(7, 8), "weights": _W[:, :, None]}, "weights"),
    ({"dim": 2, "ids": u64(7, 8), "weights": _W.tolist()}, "weights"),
    ({"dim": 2, "ids": u64(7, 8), "weights": _W, "state": _S}, "state_kind"),
    ({"dim": 2, "ids": u64(7, 8), "weights": _W, "state": _S[:, :1],
      "state_kind": "adagrad"}, "state"),
    ({"dim": 2, "ids": u64(7, 8), "weights": _W, "state": _S.astype(np.float64),
      "state_kind": "adagrad"}, "state"),
])
def test_a_bad_chunk_is_refused_whole_and_changes_nothing(impl, chunk, field):
    s = impl(10, Adagrad())
    put(s, [1, 2], [[1.0, 2.0], [3.0, 4.0]])
    good = {"dim": 2, "ids": u64(3), "weights": np.ones((1, 2), np.float32)}
    before = [(c["ids"].tolist(), c["weights"].tolist(), c["state"].tolist()) for c in s.dump()]
    with pytest.raises(BadInput) as info:
        s.load([good, chunk])   # the good chunk before it is in; nothing of the bad one
    assert info.value.field == field
    good_rows = [(c["ids"].tolist(), c["weights"].tolist(), c["state"].tolist())
                 for c in s.dump()]
    initial = before[0][2][0]   # the rows were put without state too
    assert good_rows == [(before[0][0] + [3], before[0][1] + [[1.0, 1.0]],
                          before[0][2] + [initial])]


def test_changing_the_store_during_dump_is_misuse(impl):
    s = impl(10, SGD(0.1))
    s.lookup(np.arange(5, dtype=np.uint64), 2)
    chunks = s.dump(chunk_rows=2)
    next(chunks)
    s.lookup(u64(9), 2)
    with pytest.raises(Misuse, match="changed while it was being dumped"):
        list(chunks)


def test_configure_keeps_state_of_the_same_kind_and_resets_otherwise(impl):
    s = impl(10, Adagrad(lr=0.1))
    s.lookup(u64(1), 2)
    s.update(u64(1), f32([[1.0, 2.0]]))
    acc = state_of(s, 1).copy()
    s.configure(optimizer=Adagrad(lr=0.5, initial_accumulator_value=3.0))
    np.testing.assert_array_equal(state_of(s, 1), acc)  # same layout: kept
    s.lookup(u64(2), 2)
    np.testing.assert_array_equal(state_of(s, 2), [3.0, 3.0])  # new rows: new initial state
    w = s.lookup(u64(1), 2, train=False)
    s.configure(optimizer=Adam(lr=0.1).to_dict())
    np.testing.assert_array_equal(s.lookup(u64(1), 2, train=False), w)  # weights kept
    np.testing.assert_array_equal(state_of(s, 1), [0, 0, 0, 0, 1, 1])  # Adam's fresh state
    assert s.optimizer == Adam(lr=0.1)
    s.configure(embedding_config=EmbeddingConfig(admit_probability=0.0))
    s.lookup(u64(3), 2)
    assert not s.contains(u64(3))[0] and s.embedding_config.admit_probability == 0.0


def test_iterating_a_store_dumps_it(impl):
    s = impl(10, SGD(0.1))
    s.lookup(u64(3, 1), 2)
    (chunk,) = list(s)
    assert chunk["ids"].tolist() == [3, 1] and chunk["state"].shape == (2, 0)


def test_memory_is_reported(impl):
    s = impl(1000, Adagrad())
    s.lookup(np.arange(100, dtype=np.uint64), 16)
    assert s.memory_bytes() >= 100 * 4 * 32


# --- the two implementations agree ------------------------------------------------------------

OPTIMIZERS = [SGD(0.1), SGD(0.05, momentum=0.9, weight_decay=0.01), Adam(0.01, weight_decay=0.1),
              Adagrad(), Adagrad(vectorwise_shared=True, g_square_momentum=0.9)]

op = st.one_of(
    st.tuples(st.just("lookup"), st.lists(st.integers(0, 40), max_size=30),
              st.sampled_from([3, 5]), st.booleans()),
    st.tuples(st.just("update"), st.lists(st.integers(0, 40), max_size=30),
              st.sampled_from([3, 5]), st.integers(0, 2**31)),
    st.tuples(st.just("load"), st.lists(st.integers(0, 40), max_size=8),
              st.sampled_from([3, 5]), st.booleans()),
    st.tuples(st.just("clear"), st.just([]), st.just(3), st.just(0)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 40), max_size=8),
              st.sampled_from([3, 5]), st.just(0)),
    # a pooled lookup: (train, seed of its random index and offsets)
    st.tuples(st.just("pooled"), st.lists(st.integers(0, 40), max_size=30),
              st.sampled_from([3, 5]), st.tuples(st.booleans(), st.integers(0, 2**31))),
)


def _segments_for(n, seed):
    """A random pooled lookup over n ids: occurrences in random order (not only first-
    occurrence order), some ids never named, empty segments."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(0, 3 * n + 2)) if n else 0
    index = rng.integers(0, max(n, 1), m).astype(np.int32) if n else np.zeros(0, np.int32)
    cuts = np.sort(rng.integers(0, m + 1, int(rng.integers(0, 6))))
    return index, np.concatenate([[0], cuts, [m]]).astype(np.int64)


def _key(i, dim):
    return (dim << 56) | i  # slot prefix: ids of the two dims never collide


def _apply(s, step):
    kind, raw, dim, arg = step
    ids = np.array([_key(i, dim) for i in raw], np.uint64)
    try:
        if kind == "lookup":
            return s.lookup(ids, dim, arg).tobytes()
        if kind == "pooled":
            return s.lookup_pooled(ids, dim, *_segments_for(len(ids), arg[1]), arg[0]).tobytes()
        if kind == "update":
            rng = np.random.default_rng(arg)
            s.update(ids, rng.standard_normal((len(ids), dim)).astype(np.float32))
        elif kind == "load":
            chunk = {"dim": dim, "ids": ids, "weights": np.full((len(ids), dim), 0.5, np.float32)}
            if arg:
                state = s.optimizer.initial_state(dim) * 0.5 + 0.25
                chunk.update(state=np.tile(state, (len(ids), 1)),
                             state_kind=s.optimizer.state_kind)
            s.load([chunk])
        elif kind == "remove":
            return s.remove(ids)
        else:
            s.clear()
    except BadInput as exc:
        return str(exc)
    return None


def _changes(s, since):
    """changed_since as a comparable value: rows sorted by id (the order and chunking
    follow each store's layout)."""
    rows = sorted((int(k), c["dim"], c["weights"][i].tobytes(), int(c["versions"][i]))
                  for c in s.changed_since(since, chunk_rows=4) for i, k in enumerate(c["ids"]))
    ids, versions, complete = s.evicted_since(since)
    return rows, ids.tolist(), versions.tolist(), complete


def _dump_bytes(s):
    return [(c["dim"], c["state_kind"], c["ids"].tobytes(), c["weights"].tobytes(),
             c["state"].tobytes(), c["state"].shape) for c in s.dump(chunk_rows=7)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opt=st.sampled_from(OPTIMIZERS), capacity=st.integers(1, 25),
       admit=st.sampled_from([1.0, 0.6]), steps=st.lists(op, max_size=25))
def test_cython_and_python_agree_bit_for_bit(opt, capacity, admit, steps):
    cfg = EmbeddingConfig(admit_probability=admit, weight_bound=0.3)
    c = CEmbeddingStore(capacity, opt, cfg, eviction_log=6)
    p = PyEmbeddingStore(capacity, opt, cfg, eviction_log=6)
    for step in steps:
        assert _apply(c, step) == _apply(p, step), step
        assert c.stats() == p.stats()
        assert c.policy_stats() == p.policy_stats()   # the default policy's counters
        assert c.change_version == p.change_version
    assert _dump_bytes(c) == _dump_bytes(p)
    for since in range(c.change_version + 1):
        assert _changes(c, since) == _changes(p, since), since


def test_long_random_sequence_agrees():
    rng = np.random.default_rng(7)
    for opt in OPTIMIZERS:
        cfg = EmbeddingConfig(admit_probability=0.8, weight_bound=0.05)
        c, p = CEmbeddingStore(300, opt, cfg), PyEmbeddingStore(300, opt, cfg)
        for _ in range(40):
            dim = int(rng.choice([4, 16]))
            ids = (rng.zipf(1.3, 400) % 2000).astype(np.uint64) | np.uint64(dim << 56)
            assert c.lookup(ids, dim).tobytes() == p.lookup(ids, dim).tobytes()
            grads = rng.standard_normal((len(ids), dim)).astype(np.float32)
            c.update(ids, grads)
            p.update(ids, grads)
        assert c.stats() == p.stats()
        assert _dump_bytes(c) == _dump_bytes(p)
        assert c.change_version == p.change_version == 80
        for since in (0, 41, 79, 80):
            assert _changes(c, since) == _changes(p, since)


# --- pooled lookups ---------------------------------------------------------------------------

def _first_occurrence_plan(rng, slots, batch, vocab):
    """A worker's pooled lookup (stream_persia.worker.batchplan): distinct ids in first-
    occurrence order, every occurrence's index, one segment per (slot, sample)."""
    from stream_persia.kernels import segments

    lens = rng.integers(0, 4, slots * batch)
    keys = rng.integers(0, vocab, int(lens.sum())).astype(np.uint64)
    ids, index = segments.factorize(keys)
    return ids, index, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


@pytest.mark.parametrize("train", [True, False])
def test_pooled_lookup_equals_lookup_then_pool_bit_for_bit(impl, train):
    from stream_persia.kernels import segments

    rng = np.random.default_rng(3)
    cfg = EmbeddingConfig(admit_probability=0.7)
    a, b = impl(10_000, Adagrad(), cfg), impl(10_000, Adagrad(), cfg)
    for step in range(6):
        ids, index, offsets = _first_occurrence_plan(rng, 5, 64, 400)
        if step % 2:  # also occurrences out of first-occurrence order
            index = rng.permutation(index).astype(np.int32)
        got = a.lookup_pooled(ids, 8, index, offsets, train)
        want = segments.pool(b.lookup(ids, 8, train), index, offsets)
        assert got.dtype == np.float32 and got.shape == (len(offsets) - 1, 8)
        assert got.tobytes() == want.tobytes()
        assert a.stats() == b.stats() and len(a) == len(b)
    assert _dump_bytes(a) == _dump_bytes(b)  # same rows, same LRU order


def test_pooled_lookup_that_evicts_within_the_call(impl):
    """More new ids than free capacity: rows admitted early in the call are evicted by
    later ones, and every sum still holds the row each id had when it was looked up."""
    from stream_persia.kernels import segments

    a, b = impl(50, SGD(0.1)), impl(50, SGD(0.1))
    ids = np.arange(1, 121, dtype=np.uint64)
    index = np.concatenate([np.arange(120), np.arange(120)[::-1]]).astype(np.int32)
    offsets = np.array([0, 60, 120, 180, 240], np.int64)
    got = a.lookup_pooled(ids, 4, index, offsets)
    assert got.tobytes() == segments.pool(b.lookup(ids, 4), index, offsets).tobytes()
    assert len(a) == 50 and a.stats()["evictions"] == 70
    assert _dump_bytes(a) == _dump_bytes(b)


@pytest.mark.parametrize("index, offsets, field", [
    (np.array([0, 3], np.int32), np.array([0, 2], np.int64), "lookup_pooled.index"),
    (np.array([0, -1], np.int32), np.array([0, 2], np.int64), "lookup_pooled.index"),
    (np.array([0, 1], np.int32), np.array([0, 1], np.int64), "lookup_pooled.offsets"),
    (np.array([0, 1], np.int32), np.array([0, 2, 1, 2], np.int64), "lookup_pooled.offsets"),
    (np.array([0, 1], np.int64), np.array([0, 2], np.int64), "lookup_pooled.index"),
    (np.array([0, 1], np.int32), np.array([0, 2], np.int32), "lookup_pooled.offsets"),
    (np.array([0, 1], np.int32), np.zeros(0, np.int64), "lookup_pooled.offsets"),
])
def test_bad_pooled_lookup_is_refused_before_the_store_changes(impl, index, offsets, field):
    s = impl(100, SGD(0.1))
    s.lookup(u64(1, 2), 4)
    before = (s.stats(), _dump_bytes(s))
    with pytest.raises(BadInput) as err:
        s.lookup_pooled(u64(2, 3, 1), 4, index, offsets)
    assert err.value.field == field
    assert (s.stats(), _dump_bytes(s)) == before  # id 3 not admitted, id 2 not refreshed


def test_pooled_lookup_of_another_dim_is_refused_at_that_id(impl):
    s = impl(100, SGD(0.1))
    s.lookup(u64(7), 4)
    with pytest.raises(BadInput, match="7"):
        s.lookup_pooled(u64(1, 7), 8, np.array([0, 1], np.int32), np.array([0, 2], np.int64))
    with pytest.raises(BadInput, match="7"):  # ids that no occurrence names are looked up too
        s.lookup_pooled(u64(1, 7), 8, np.zeros(0, np.int32), np.array([0], np.int64), False)
