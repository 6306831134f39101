"""Compact rows (issue 20): float16 / bfloat16 row weights in both stores, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad, Adam
from stream_persia.kernels import segments
from stream_persia.server import row_dtypes
from stream_persia.server._pystore import PyEmbeddingStore, initial_rows

_cstore = pytest.importorskip("stream_persia.server._cstore")
CEmbeddingStore = _cstore.CEmbeddingStore
IMPLS = [pytest.param(CEmbeddingStore, id="cython"), pytest.param(PyEmbeddingStore, id="python")]
BITS = 8
INIT = EmbeddingConfig().emb_initialization
CODES = {"float16": 1, "bfloat16": 2}


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def gid(group, *ids):
    return np.array([((group + 1) << (64 - BITS)) | i for i in ids], np.uint64)


def compact(impl, dtype, opt=None, capacity=1000, **kw):
    """A store whose group 0 stores ``dtype`` rows, group 1 float32."""
    s = impl(capacity, opt or SGD(lr=0.1), **kw)
    s.set_policies(BITS, [None, SlotPolicy(dtype=dtype), None])
    return s


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


# --- the rounding: numpy twin and C kernels agree ----------------------------------------

def _patterns():
    rng = np.random.default_rng(7)
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7FFFFFFF,
               0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x7F7FFFFF,
               0x33000000, 0x33000001, 0x337FFFFF, 0x38000000, 0x387FC000, 0x387FE000,
               0x00000001, 0x00800000, 0x3F808000, 0x3F818000, 0x3F80FFFF]
    top = np.arange(1 << 16, dtype=np.uint32) << 16          # every bfloat16
    halfway = top | 0x8000                                    # every tie of bfloat16
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    f16 = f16[~np.isnan(f16)].view(np.uint32)
    f16_ties = f16 + 0x1000                                   # ties of normal float16s
    rand = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(special, np.uint32), top, halfway, f16, f16_ties,
                           f16 + 1, f16 - 1, rand]).view(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_c_kernels_round_as_the_twin_does(dtype):
    x = _patterns()
    code = CODES[dtype]
    assert (bits(_cstore.round_weights(x, code)) == bits(row_dtypes.round_weights(x, code))).all()


def test_float16_rounds_as_numpy_and_saturates():
    x = _patterns()
    x = x[np.isfinite(x) & (np.abs(x) <= 65504)]
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    assert (bits(row_dtypes.round_weights(x, 1)) == bits(ref)).all()
    big = np.array([65519.0, 65520.0, 1e9, np.inf, -np.inf, 2.0**-25, 2.0**-24 * 1.5],
                   np.float32)
    got = _cstore.round_weights(big, 1)
    assert got.tolist() == [65504.0, 65504.0, 65504.0, 65504.0, -65504.0, 0.0, 2.0**-23]
    assert np.isnan(_cstore.round_weights(np.array([np.nan], np.float32), 1)).all()


def test_bfloat16_rounds_to_nearest_even():
    x = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, -2.0**-130,
                  np.float32(3.4028235e38)], np.float32)
    got = _cstore.round_weights(x, 2)
    assert got[:4].tolist() == [1.0, 1.0 + 4 * 2.0**-8, 1.0 + 2 * 2.0**-8, -2.0**-130]
    assert got[4] == BF16_MAX    # past the largest bfloat16: saturated, not inf


BF16_MAX = np.float32(3.3895314e38)   # 0x7F7F0000, the largest finite bfloat16


def test_bfloat16_saturates_instead_of_becoming_inf():
    big = np.array([3.3895314e38, 3.39e38, 3.3961e38, 3.4028235e38, np.inf, -3.4e38,
                    -np.inf], np.float32)
    want = [BF16_MAX, BF16_MAX, BF16_MAX, BF16_MAX, BF16_MAX, -BF16_MAX, -BF16_MAX]
    for got in (_cstore.round_weights(big, 2), row_dtypes.round_weights(big, 2)):
        assert got.tolist() == want
    # the vector loop (8 at a time) and the scalar tail agree
    many = np.tile(big, 5)
    assert (bits(_cstore.round_weights(many, 2)) == bits(np.tile(np.array(want, np.float32),
                                                                5))).all()


def test_a_bfloat16_row_past_its_largest_value_stays_finite(impl):
    """A row whose weights grow past bfloat16's largest value (a weight_bound above it)
    stores that value, never inf: loaded, or stepped by an update."""
    cfg = EmbeddingConfig(weight_bound=3.4e38)
    s = compact(impl, "bfloat16", SGD(lr=1.0), embedding_config=cfg)
    ids = gid(0, 1, 2)
    s.load([{"dim": 8, "ids": ids[:1], "weights": np.full((1, 8), 3.4e38, np.float32)}])
    s.lookup(ids[1:], 8)
    s.update(ids[1:], np.full((1, 8), -3.39e38, np.float32))   # w = init + 3.39e38
    out = s.lookup(ids, 8, train=False)
    assert np.isfinite(out).all()
    assert (out == BF16_MAX).all()


# --- rows ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_new_rows_are_rounded_and_lookups_return_float32(impl, dtype):
    s = compact(impl, dtype)
    ids16, ids32 = gid(0, *range(10)), gid(1, *range(10))
    out = s.lookup(np.concatenate([ids16, ids32]), 8)
    assert out.dtype == np.float32
    init16, init32 = initial_rows(ids16, 8, INIT), initial_rows(ids32, 8, INIT)
    assert (bits(out[:10]) == bits(row_dtypes.round_weights(init16, CODES[dtype]))).all()
    assert not (out[:10] == init16).all()
    assert (bits(out[10:]) == bits(init32)).all()   # the float32 group is unchanged
    index, offsets = np.arange(20, dtype=np.int32), np.array([0, 10, 20], np.int64)
    pooled = s.lookup_pooled(np.concatenate([ids16, ids32]), 8, index, offsets, train=False)
    assert (bits(pooled) == bits(segments.pool(out, index, offsets))).all()


@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), Adam(lr=0.01)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_update_steps_in_float32_and_stores_rounded(impl, dtype, opt):
    s = compact(impl, dtype, opt)
    ids = gid(0, 1, 2, 3, 4)
    w = s.lookup(ids, 4)
    g = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    s.update(ids, g)
    ref = PyEmbeddingStore(10, opt)        # float32 rows, started from the rounded weights
    ref.load([{"dim": 4, "ids": ids, "weights": w}])
    ref.update(ids, g)
    expect = row_dtypes.round_weights(ref.lookup(ids, 4, train=False), CODES[dtype])
    assert (bits(s.lookup(ids, 4, train=False)) == bits(expect)).all()
    state = next(iter(s.dump()))["state"]
    assert (bits(state) == bits(next(iter(ref.dump()))["state"])).all()  # state stays float32


def test_compact_rows_take_less_memory(impl):
    sizes = {}
    for dtype in ("float32", "float16", "bfloat16"):
        s = compact(impl, dtype, capacity=100_000)
        s.lookup(gid(0, *range(32768)), 64)
        sizes[dtype] = s.memory_breakdown()
        assert sum(sizes[dtype].values()) == s.memory_bytes()
    # SGD keeps no state: half the row bytes (up to the empty float32 arena of the dim)
    assert 1.99 < sizes["float32"]["rows"] / sizes["float16"]["rows"] <= 2
    assert sizes["bfloat16"]["rows"] == sizes["float16"]["rows"]
    assert abs(sizes["float16"]["bookkeeping"] / sizes["float32"]["bookkeeping"] - 1) < 0.01


def test_checkpoints_carry_float32_and_convert_across_dtypes(impl):
    src = impl(1000, Adagrad(lr=0.1))
    ids = np.arange(1, 200, dtype=np.uint64)
    src.lookup(ids, 6)
    src.update(ids, np.random.default_rng(1).standard_normal((199, 6)).astype(np.float32))
    fp32 = list(src.dump())
    half = compact(impl, "float16", Adagrad(lr=0.1))
    half.set_policies(BITS, [SlotPolicy(dtype="float16")])     # the default policy: all ids
    half.load(fp32)
    chunks = list(half.dump())
    assert all(c["weights"].dtype == np.float32 for c in chunks)
    w32 = np.concatenate([c["weights"] for c in fp32])
    w16 = np.concatenate([c["weights"] for c in chunks])
    assert (bits(w16) == bits(row_dtypes.round_weights(w32, 1))).all()
    assert (bits(np.concatenate([c["state"] for c in chunks]))
            == bits(np.concatenate([c["state"] for c in fp32]))).all()
    back = impl(1000, Adagrad(lr=0.1))                        # float16 into float32: exact
    back.load(chunks)
    assert [bits(c["weights"]).tolist() for c in back.dump()] == \
        [bits(c["weights"]).tolist() for c in chunks]
    changed = np.concatenate([c["weights"] for c in half.changed_since(0) if len(c["ids"])])
    assert sorted(bits(changed).ravel().tolist()) == sorted(bits(w16).ravel().tolist())


def test_a_changed_dtype_applies_to_new_rows_only(impl):
    s = impl(1000, SGD(lr=0.1))
    old = gid(0, 1, 2)
    before = s.lookup(old, 8)
    s.set_policies(BITS, [None, SlotPolicy(dtype="float16")])
    new = gid(0, 3, 4)
    assert (bits(s.lookup(old, 8)) == bits(before)).all()      # kept as float32
    assert (bits(s.lookup(new, 8)) ==
            bits(row_dtypes.round_weights(initial_rows(new, 8, INIT), 1))).all()
    s.remove(old)                                              # re-admitted: float16 now
    assert (bits(s.lookup(old, 8)) == bits(row_dtypes.round_weights(before, 1))).all()
    s.set_policies(BITS, [None])                               # back: float16 rows stay
    assert (bits(s.lookup(new, 8)) ==
            bits(row_dtypes.round_weights(initial_rows(new, 8, INIT), 1))).all()


def test_a_dim_mismatch_with_compact_rows_is_still_an_error(impl):
    s = compact(impl, "float16")
    s.lookup(gid(0, 1), 8)
    with pytest.raises(Exception, match="dim"):
        s.lookup(gid(0, 1), 4)
    with pytest.raises(Exception, match="dim"):
        s.update(gid(0, 1), np.zeros((1, 4), np.float32))


def test_shard_files_carry_float32_across_dtypes(impl, tmp_path):
    """A server's checkpoint path: a shard file of a float16 store restores into a float32
    store exactly, and a float32 one into a float16 store (policies set first) rounded."""
    from stream_persia.server.shard_files import stage_shard_files, write_shard_file
    half = impl(1000, Adagrad(lr=0.1))
    half.set_policies(BITS, [SlotPolicy(dtype="float16")])
    ids = np.arange(1, 300, dtype=np.uint64)
    half.lookup(ids, 8)
    half.update(ids, np.random.default_rng(2).standard_normal((299, 8)).astype(np.float32))
    info = write_shard_file(half.dump(), str(tmp_path), "half.bin")
    expected = {"half.bin": {"sha256": info["sha256"], "bytes": info["bytes"],
                             "rows": info["rows"]}}
    full = impl(1000, Adagrad(lr=0.1))
    assert stage_shard_files(full, str(tmp_path), ["half.bin"], expected, 0, 1) == 299
    got = {k: w.tobytes() for c in full.dump() for k, w in zip(c["ids"].tolist(), c["weights"],
                                                                strict=True)}
    want = {k: w.tobytes() for c in half.dump() for k, w in zip(c["ids"].tolist(), c["weights"],
                                                                 strict=True)}
    assert got == want
    full.update(ids, np.full((299, 8), 1e-3, np.float32))     # now float32 values
    info = write_shard_file(full.dump(), str(tmp_path), "full.bin")
    again = impl(1000, Adagrad(lr=0.1))
    again.set_policies(BITS, [SlotPolicy(dtype="float16")])
    stage_shard_files(again, str(tmp_path), ["full.bin"], {}, 0, 1)
    w32 = np.concatenate([c["weights"] for c in full.dump()])
    w16 = np.concatenate([c["weights"] for c in again.dump()])
    assert (bits(w16) == bits(row_dtypes.round_weights(w32, 1))).all()
    assert not (bits(w16) == bits(w32)).all()


def test_a_new_optimizer_keeps_compact_weights(impl):
    s = compact(impl, "bfloat16", SGD(lr=0.1))
    ids = np.concatenate([gid(0, *range(40)), gid(1, *range(40))])
    before = s.lookup(ids, 5)
    s.configure(optimizer=Adam(lr=0.01))      # another state kind: rows are re-laid out
    assert (bits(s.lookup(ids, 5, train=False)) == bits(before)).all()
    s.update(ids, np.ones((80, 5), np.float32))
    twin = compact(PyEmbeddingStore, "bfloat16", SGD(lr=0.1))
    twin.lookup(ids, 5)
    twin.configure(optimizer=Adam(lr=0.01))
    twin.update(ids, np.ones((80, 5), np.float32))
    assert [(c["ids"].tobytes(), c["weights"].tobytes(), c["state"].tobytes())
            for c in s.dump()] == [(c["ids"].tobytes(), c["weights"].tobytes(),
                                    c["state"].tobytes()) for c in twin.dump()]


# --- update's guard (no inf or NaN into a row), in every optimizer's loops ----------------

GUARDED = [SGD(lr=0.1), SGD(lr=0.1, momentum=0.9), SGD(lr=0.1, weight_decay=1.0),
           Adagrad(lr=0.1), Adagrad(lr=0.1, vectorwise_shared=True),
           Adagrad(lr=0.1, weight_decay=1.0, g_square_momentum=0.5), Adam(lr=0.01),
           Adam(lr=0.01, weight_decay=1.0)]


def rows_of(s):
    """Every row of ``s`` as {id: (weight bits, state bits)}, in dump order."""
    return {int(k): (w.tobytes(), st.tobytes()) for c in s.dump()
            for k, w, st in zip(c["ids"], c["weights"], c["state"], strict=True)}


@pytest.mark.parametrize("opt", GUARDED, ids=[
    "sgd", "sgd_momentum", "sgd_decay", "adagrad", "adagrad_shared", "adagrad_decay", "adam",
    "adam_decay"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_update_refuses_the_steps_the_twin_refuses_and_keeps_their_rows(dtype, opt):
    """The guard rides in the optimizer's loops (sp_step): for each optimizer, float32 and
    compact rows, and a dim of 6 (vector loop and scalar tail), the Cython store refuses
    exactly the twin's steps (a sum past float32, a state that overflows) and ends bit for
    bit as the twin, every refused row as it was. With weight decay, g is tested before
    the decay is added (a finite g whose decayed sum is inf is stepped: SGD clamps it)."""
    dim, big = 6, 1e33
    cfg = EmbeddingConfig(weight_bound=big)
    ids = np.concatenate([gid(0, *range(1, 9)), gid(1, *range(1, 9))])
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((len(ids), dim)) * 0.1).astype(np.float32)
    w[[3, 11], :2] = big                     # + decayed FLT_MAX: inf (float32 rows)
    grads = (rng.standard_normal((len(ids), dim)) * 0.01).astype(np.float32)
    grads[[2, 10], 1] = 3e38                 # finite, but g * g overflows the state
    grads[[3, 11], :2] = np.finfo(np.float32).max
    grads[[4, 12], 0] = -3e38                # named twice below: -inf
    sums_to_inf = [ids[1]] * 64 + [ids[9]] * 64 + [ids[4], ids[12]]
    upd_ids = np.concatenate([ids, np.array(sums_to_inf, np.uint64)])
    upd = np.concatenate([grads, np.full((128, dim), 1e37, np.float32), grads[[4, 12]]])
    refused = {int(k) for k in (ids[1], ids[9], ids[4], ids[12])}

    def run(impl):
        if dtype == "float32":
            s = impl(100, opt, cfg)
        else:
            s = compact(impl, dtype, opt, embedding_config=cfg)
        s.lookup(ids, dim)
        s.load([{"dim": dim, "ids": ids, "weights": w}])
        before = rows_of(s)
        s.update(upd_ids, upd)
        s.update(upd_ids[::-1].copy(), upd[::-1].copy())
        return s, before, rows_of(s)

    c, c_before, c_after = run(CEmbeddingStore)
    p, p_before, p_after = run(PyEmbeddingStore)
    assert c_before == p_before
    assert list(c_after.items()) == list(p_after.items())
    n = c.stats()["nonfinite_updates"]
    assert n == p.stats()["nonfinite_updates"] and n >= 2 * len(refused)
    assert all(c_after[k] == c_before[k] for k in refused)
    assert any(c_after[k] != c_before[k] for k in c_after if k not in refused)
    for chunk in c.dump():
        assert np.isfinite(chunk["weights"]).all() and np.isfinite(chunk["state"]).all()
