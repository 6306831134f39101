"""ShardedStore: an embedding store cut into internal shards, each on its own thread.

Compared against one EmbeddingStore of the same capacity: without evictions and with full
admission every value is the same (rows are initialised from the id, the optimizer is per
row); pooled sums equal the sums of the rows up to rounding; dumps load either way."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad, Adam
from stream_persia.errors import BadInput
from stream_persia.kernels import segments
from stream_persia.kernels.sharding import shard_of, stable_hash64
from stream_persia.server.sharded import ShardedStore, make_store
from stream_persia.server.store import EmbeddingStore

OPTIMIZERS = [SGD(lr=0.1), Adagrad(lr=0.05), Adam(lr=0.01)]


def ids_of(rng, n, vocab=5000):
    return rng.integers(0, vocab, size=n).astype(np.uint64)


def train_both(one, many, rng, steps=4, dim=8):
    for _ in range(steps):
        ids = ids_of(rng, 2000)
        assert np.array_equal(one.lookup(ids, dim, True), many.lookup(ids, dim, True))
        uniq = np.unique(ids)
        grads = rng.normal(size=(len(uniq), dim)).astype(np.float32)
        one.update(uniq, grads)
        many.update(uniq, grads)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_lookups_and_updates_equal_one_store(opt, shards):
    rng = np.random.default_rng(shards)
    one, many = EmbeddingStore(10**6, opt), ShardedStore(10**6, opt, shards=shards)
    train_both(one, many, rng)
    probe = np.arange(6000, dtype=np.uint64)
    for train in (False, True):
        assert np.array_equal(one.lookup(probe, 8, train), many.lookup(probe, 8, train))
    assert np.array_equal(one.contains(probe), many.contains(probe))
    assert one.stats() == many.stats()
    assert len(one) == len(many) > 0


def test_every_shard_holds_rows_and_runs_on_its_own_thread():
    seen = set()

    class Recording:   # the real store, noting which thread looks up in it
        def __init__(self, *args, **kwargs):
            self.store = EmbeddingStore(*args, **kwargs)

        def lookup(self, *args):
            seen.add(threading.current_thread().name)
            return self.store.lookup(*args)

        def __len__(self):
            return len(self.store)

        def advance_version(self, version):
            self.store.advance_version(version)

    many = ShardedStore(10**6, Adagrad(), shards=3, store_type=Recording)
    many.lookup(np.arange(3000, dtype=np.uint64), 4)
    assert [len(s) for s in many._stores] == [pytest.approx(1000, rel=0.1)] * 3
    # this thread takes shard 0, the pool the others (one pool thread may take both)
    assert threading.current_thread().name in seen and len(seen) >= 2, seen


def test_pooled_lookups_sum_the_rows():
    rng = np.random.default_rng(7)
    one, many = EmbeddingStore(10**6, Adagrad()), ShardedStore(10**6, Adagrad(), shards=4)
    train_both(one, many, rng)
    ids = np.unique(ids_of(rng, 3000, vocab=8000))     # some never seen: admitted, or zeros
    lengths = rng.integers(0, 6, size=400)
    offsets = np.zeros(401, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = rng.integers(0, len(ids), size=int(offsets[-1])).astype(np.int32)
    for train in (False, True):
        want = segments.pool(one.lookup(ids, 8, train), index, offsets)
        got = many.lookup_pooled(ids, 8, index, offsets, train)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert one.stats() == many.stats()


def test_a_non_finite_gradient_is_named_by_its_row_in_the_call_and_nothing_applies():
    many = ShardedStore(1000, SGD(lr=0.1), shards=2)
    ids = np.arange(10, dtype=np.uint64)
    before = many.lookup(ids, 4).copy()
    grads = np.ones((10, 4), dtype=np.float32)
    grads[7, 2] = np.nan
    with pytest.raises(BadInput, match=r"grads row 7 \(id 7\)"):
        many.update(ids, grads)
    assert np.array_equal(many.lookup(ids, 4), before)
    with pytest.raises(BadInput) as e:
        many.lookup(ids.astype(np.int64), 4)
    assert e.value.field == "ids"


def test_finite_gradients_whose_sum_overflows_are_applied():
    many = ShardedStore(1000, SGD(lr=1e-38), shards=2)
    ids = np.arange(4, dtype=np.uint64)
    before = many.lookup(ids, 2).copy()
    many.update(ids, np.full((4, 2), 3e38, dtype=np.float32))   # the sum is inf; no row is
    assert (many.stats()["updates"], many.stats()["dropped_updates"]) == (4, 0)
    assert not np.array_equal(many.lookup(ids, 2), before)


def test_an_id_stored_with_another_dim_is_refused():
    many = ShardedStore(1000, SGD(lr=0.1), shards=2)
    many.lookup(np.arange(4, dtype=np.uint64), 4)
    with pytest.raises(BadInput, match="stored with dim 4"):
        many.lookup(np.arange(4, dtype=np.uint64), 8)


def test_each_shard_evicts_its_own_least_recently_used():
    many = ShardedStore(10, SGD(lr=0.1), shards=3)
    assert [s.capacity for s in many._stores] == [4, 3, 3]
    assert many.capacity == many.stats()["capacity"] == 10
    many.lookup(np.arange(100, dtype=np.uint64), 2)
    assert len(many) == 10 and many.stats()["evictions"] == 90
    kept = np.flatnonzero(many.contains(np.arange(100, dtype=np.uint64)))
    owner = segments.internal_owner(np.arange(100, dtype=np.uint64), 3)
    for s, cap in enumerate([4, 3, 3]):   # per shard: its most recently used ids
        assert list(kept[owner[kept] == s]) == list(np.flatnonzero(owner == s)[-cap:])


@pytest.mark.parametrize(("src", "dst"), [(1, 3), (3, 1), (2, 5)])
def test_dumps_load_across_shard_counts(src, dst):
    rng = np.random.default_rng(src * 10 + dst)
    a = make_store(10**6, Adam(lr=0.01), shards=src)
    train_both(EmbeddingStore(10**6, Adam(lr=0.01)), a, rng)
    b = make_store(10**6, Adam(lr=0.01), shards=dst)
    b.load(a.dump(chunk_rows=500))
    probe = np.arange(6000, dtype=np.uint64)
    assert np.array_equal(a.lookup(probe, 8, False), b.lookup(probe, 8, False))
    assert len(a) == len(b)
    grads = np.ones((len(probe), 8), dtype=np.float32)   # the optimizer state came along
    a.update(probe, grads)
    b.update(probe, grads)
    assert np.array_equal(a.lookup(probe, 8, False), b.lookup(probe, 8, False))


def test_configure_clear_and_memory_reach_every_shard():
    many = ShardedStore(1000, SGD(lr=0.1), shards=2)
    many.lookup(np.arange(100, dtype=np.uint64), 4)
    assert many.memory_bytes() == sum(s.memory_bytes() for s in many._stores) > 0
    many.configure(Adagrad(lr=0.5), EmbeddingConfig(emb_initialization=(-0.5, 0.5)))
    assert all(s.optimizer.name == "adagrad" for s in many._stores)
    assert many.embedding_config.emb_initialization == (-0.5, 0.5)
    many.clear()
    assert len(many) == 0 and many.stats()["lookups"] == 100


@pytest.mark.parametrize(("shards", "capacity", "field"), [
    (0, 10, "store_threads"), (True, 10, "store_threads"), (257, 1000, "store_threads"),
    (4, 3, "capacity")])
def test_bad_shard_counts_are_refused(shards, capacity, field):
    with pytest.raises(BadInput) as e:
        ShardedStore(capacity, SGD(lr=0.1), shards=shards)
    assert e.value.field == field


def test_internal_shards_are_independent_of_the_servers():
    """Every server's ids spread over all its internal shards, even when the counts share
    factors (the low bits route to servers, the high half of the hash to shards)."""
    ids = np.arange(20_000, dtype=np.uint64) * np.uint64(7919)
    for servers, shards in ((2, 2), (4, 2), (3, 6)):
        server0 = ids[shard_of(ids, servers) == 0]
        counts = np.bincount(segments.internal_owner(server0, shards), minlength=shards)
        assert counts.min() > 0.8 * len(server0) / shards, (servers, shards, counts)
    twin = ((stable_hash64(ids) >> np.uint64(32)) % np.uint64(5)).astype(np.int64)
    assert np.array_equal(segments.internal_owner(ids, 5), twin)


def test_close_stops_the_threads_and_later_calls_are_refused():
    others = set(threading.enumerate())
    store = ShardedStore(1000, SGD(lr=0.1), shards=3)
    store.lookup(np.arange(100, dtype=np.uint64), 4)
    mine = [t for t in threading.enumerate()
            if t not in others and t.name.startswith("store-shard")]
    assert mine
    store.close()
    store.close()   # idempotent
    assert not any(t.is_alive() for t in mine)
    with pytest.raises(RuntimeError, match="closed"):
        store.lookup(np.arange(10, dtype=np.uint64), 4)


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_the_shards_sketches_stay_within_sketch_bytes(shards):
    """Every resource bounded: the shards' frequency sketches together take at most the
    store's sketch_bytes, or the store is refused, naming sketch_bytes."""
    for total in (8 << 20, 4096 * shards, 4096 * shards + 4095, 3 * 4096 * shards - 1):
        many = ShardedStore(shards * 10, SGD(lr=0.1), shards=shards, sketch_bytes=total)
        before = many.memory_bytes()
        many.set_policies(0, [SlotPolicy(min_count=2)])
        assert 0 < many.memory_bytes() - before <= total
        many.close()
    with pytest.raises(BadInput) as info:
        ShardedStore(shards * 10, SGD(lr=0.1), shards=shards, sketch_bytes=4096 * shards - 1)
    assert info.value.field == "sketch_bytes" and "store threads" in info.value.message
    with pytest.raises(BadInput, match="sketch_bytes"):
        make_store(shards * 10, SGD(lr=0.1), shards=shards, sketch_bytes=4096)
