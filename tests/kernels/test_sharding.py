"""stable_hash64 / shard_of / split_by_shard / static_partitions (stream_persia.kernels.sharding)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stream_persia.config import EmbeddingSchema
from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels.sharding import (
    ShardSplit,
    shard_of,
    split_by_shard,
    splitmix64_finalizer_inplace,
    stable_hash64,
    stable_hash64_int,
    static_partitions,
)

U64 = np.uint64


def test_hash_is_splitmix64_reference_values():
    # The first two outputs of SplitMix64 seeded with 0 (published reference values).
    out = stable_hash64(np.array([0, 0x9E3779B97F4A7C15], dtype=U64))
    assert out.tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_hash_values_are_pinned():
    # Changing these breaks id routing between versions and checkpoint re-sharding.
    ids = np.array([1, 12345, 2**64 - 1, 450359962737049612], dtype=U64)
    assert stable_hash64(ids).tolist() == [
        10451216379200822465, 2454886589211414944, 16490336266968443936,
        1441120640309230691]
    assert shard_of(np.arange(10, dtype=U64), 7).tolist() == [2, 2, 4, 2, 6, 3, 3, 2, 4, 2]


def test_the_two_mixers_are_told_apart_and_the_scalar_hash_is_the_array_hash():
    # stable_hash64 is the finaliser of id + 0x9E3779B97F4A7C15; the finaliser alone
    # (the hash stack's) differs from it, and the scalar twin (the store's admission
    # draws) gives the array's values.
    ids = np.array([0, 1, 12345, 2**64 - 1, 450359962737049612], dtype=U64)
    with np.errstate(over="ignore"):
        shifted = ids + U64(0x9E3779B97F4A7C15)
    assert splitmix64_finalizer_inplace(shifted.copy()).tolist() == stable_hash64(ids).tolist()
    assert splitmix64_finalizer_inplace(ids.copy()).tolist() != stable_hash64(ids).tolist()
    assert [stable_hash64_int(int(i)) for i in ids] == stable_hash64(ids).tolist()
    z = ids.copy()
    assert splitmix64_finalizer_inplace(z) is z


def test_hash_keeps_shape_and_leaves_input_alone():
    ids = np.arange(12, dtype=U64).reshape(3, 4)
    ids.setflags(write=False)  # ids decoded from the wire are read-only views
    before = ids.copy()
    out = stable_hash64(ids)
    assert out.shape == (3, 4) and out.dtype == U64
    assert np.array_equal(ids, before)
    assert np.array_equal(out.ravel(), stable_hash64(ids.ravel()))


def test_hash_accepts_non_negative_signed_and_rejects_negative_or_float():
    assert stable_hash64(np.array([7], dtype=np.int64)).tolist() == \
        stable_hash64(np.array([7], dtype=U64)).tolist()
    with pytest.raises(BadInput, match="minimum -1"):
        stable_hash64(np.array([3, -1], dtype=np.int64))
    with pytest.raises(BadInput, match="float64"):
        stable_hash64(np.array([1.0]))


def test_hash_raises_no_overflow_warning():
    with np.errstate(all="raise"):
        stable_hash64(np.array([2**64 - 1, 2**63], dtype=U64))


def test_shard_of_range_dtype_and_single_shard():
    ids = np.arange(1000, dtype=U64)
    s = shard_of(ids, 5)
    assert s.dtype == np.int64 and s.min() == 0 and s.max() == 4
    assert np.array_equal(shard_of(ids, 1), np.zeros(1000, dtype=np.int64))


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "3", None])
def test_shard_of_rejects_bad_num_shards(bad):
    with pytest.raises(Misuse, match="num_shards"):
        shard_of(np.arange(3, dtype=U64), bad)


def _prefixed_ids(n: int) -> np.ndarray:
    # PERSIA-style ids: three slots, raw ids small and sequential, groups in the top 8 bits.
    schema = EmbeddingSchema.from_dict(
        {"slots_config": {"a": {"dim": 4}, "b": {"dim": 4}, "c": {"dim": 4}}})
    raw = np.arange(n // 3 + 1, dtype=U64)
    return np.concatenate([schema.prefix_ids(s, raw) for s in "abc"])[:n]


@pytest.mark.parametrize("kind", ["sequential", "prefixed"])
@pytest.mark.parametrize("num_shards", range(2, 17))
def test_shards_are_uniform_within_10_percent(kind, num_shards):
    n = 100_000
    ids = np.arange(n, dtype=U64) if kind == "sequential" else _prefixed_ids(n)
    counts = np.bincount(shard_of(ids, num_shards), minlength=num_shards)
    mean = n / num_shards
    assert counts.min() >= 0.9 * mean and counts.max() <= 1.1 * mean, counts


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8, 13])
def test_split_gather_scatter_round_trip(num_shards):
    rng = np.random.default_rng(num_shards)
    ids = rng.integers(0, 2**63, size=5000, dtype=np.int64).astype(U64)
    split = split_by_shard(ids, num_shards)
    assert isinstance(split, ShardSplit) and split.num_shards == num_shards
    owner = shard_of(ids, num_shards)
    seen = np.zeros(ids.size, dtype=np.int64)
    for k in range(num_shards):
        pos = split.positions(k)
        assert np.all(owner[pos] == k)
        assert np.all(np.diff(pos) > 0)  # stable: original order kept inside a shard
        seen[pos] += 1
    assert np.all(seen == 1)
    assert split.counts.tolist() == np.bincount(owner, minlength=num_shards).tolist()
    # A fake "server" answers each shard's ids with rows derived from the ids.
    rows = ids.astype(np.float64)[:, None] * np.array([1.0, -1.0, 0.5])
    parts = split.gather(rows)
    for k, part in enumerate(parts):
        assert np.array_equal(part, rows[split.positions(k)])
    assert np.array_equal(split.scatter(parts), rows)
    assert np.array_equal(split.scatter(split.gather(ids)), ids)


def test_split_of_empty_batch():
    split = split_by_shard(np.array([], dtype=U64), 4)
    assert split.counts.tolist() == [0, 0, 0, 0]
    out = split.scatter([np.empty((0, 8), np.float32)] * 4)
    assert out.shape == (0, 8)


def test_split_rejects_misuse():
    split = split_by_shard(np.arange(10, dtype=U64), 3)
    with pytest.raises(Misuse, match="expected 3 parts"):
        split.scatter(split.gather(np.arange(10))[:2])
    bad = split.gather(np.arange(10))
    bad[0] = bad[0][:-1]
    with pytest.raises(Misuse, match="part 0"):
        split.scatter(bad)
    with pytest.raises(Misuse, match="rows"):
        split.gather(np.arange(9))
    with pytest.raises(Misuse, match="shard must be"):
        split.positions(3)
    with pytest.raises(Misuse, match="1-D"):
        split_by_shard(np.zeros((2, 2), dtype=U64), 2)


@settings(max_examples=50, deadline=None)
@given(ids=hnp.arrays(U64, st.integers(0, 300), elements=st.integers(0, 2**64 - 1)),
       num_shards=st.integers(1, 40))
def test_split_round_trip_property(ids, num_shards):
    split = split_by_shard(ids, num_shards)
    assert np.array_equal(split.scatter(split.gather(ids)), ids)
    assert int(split.offsets[-1]) == ids.size


def test_static_partitions_cover_each_partition_once():
    for partitions in (0, 1, 4, 7, 12):
        for replicas in (1, 2, 3, 5):
            got = [static_partitions(partitions, i, replicas) for i in range(replicas)]
            flat = sorted(p for ps in got for p in ps)
            assert flat == list(range(partitions))
            for i, ps in enumerate(got):
                assert all(p % replicas == i for p in ps)


@pytest.mark.parametrize("args", [(4, 2, 2), (4, -1, 2), (4, 0, 0), (-1, 0, 1), (4, True, 2)])
def test_static_partitions_rejects_misuse(args):
    with pytest.raises(Misuse):
        static_partitions(*args)
