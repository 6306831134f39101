"""Changed-row tracking in the embedding store (issue 18): change versions, changed_since,
evicted_since and remove, on the Cython store, its Python twin and the ShardedStore of each;
and a replica store that follows them ends with exactly the training store's rows."""

from __future__ import annotations

import numpy as np
import pytest

from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad
from stream_persia.errors import BadInput, Misuse
from stream_persia.server._pystore import PyEmbeddingStore
from stream_persia.server.sharded import ShardedStore

CEmbeddingStore = pytest.importorskip("stream_persia.server._cstore").CEmbeddingStore
IMPLS = [pytest.param(CEmbeddingStore, id="cython"), pytest.param(PyEmbeddingStore, id="python")]


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def u64(*ids):
    return np.array(ids, np.uint64)


def changed(s, since, chunk_rows=65536):
    """{id: (dim, weights, version)} of changed_since, checking the chunk format."""
    out = {}
    for c in s.changed_since(since, chunk_rows):
        n = len(c["ids"])
        assert n <= chunk_rows
        assert c["ids"].dtype == np.uint64 and c["versions"].dtype == np.int64
        assert c["weights"].dtype == np.float32 and c["weights"].shape == (n, c["dim"])
        assert c["versions"].shape == (n,) and (n or c["dim"] == 0)
        for i, k in enumerate(c["ids"].tolist()):
            assert k not in out
            out[k] = (c["dim"], c["weights"][i].copy(), int(c["versions"][i]))
    return out


def versions(s, since=0):
    return {k: v for k, (_, _, v) in changed(s, since).items()}


def test_versions_after_each_kind_of_call(impl):
    s = impl(100, Adagrad())
    assert s.change_version == 0 and versions(s) == {}
    s.lookup(u64(1, 2, 3), 4)                        # admissions: version 1
    assert s.change_version == 1 and versions(s) == {1: 1, 2: 1, 3: 1}
    s.lookup(u64(1, 9), 4, train=False)              # inference: no change
    s.contains(u64(1, 9))
    s.configure(SGD(0.1))
    list(s.dump())
    assert s.change_version == 1
    s.lookup(u64(1), 4)                              # a hit only: the call still counts
    assert s.change_version == 2 and versions(s) == {1: 1, 2: 1, 3: 1}
    s.update(u64(2, 7), np.ones((2, 4), np.float32))   # 7 is not stored: dropped
    assert s.change_version == 3 and versions(s) == {1: 1, 2: 3, 3: 1}
    s.load([{"dim": 4, "ids": u64(3, 5), "weights": np.zeros((2, 4), np.float32)}])
    assert s.change_version == 4 and versions(s) == {1: 1, 2: 3, 3: 4, 5: 4}
    assert versions(s, since=3) == {3: 4, 5: 4}
    assert s.remove(u64(1, 1, 8)) == 1
    assert s.change_version == 5 and versions(s) == {2: 3, 3: 4, 5: 4}
    s.clear()
    assert s.change_version == 6 and versions(s) == {}
    # calls with no ids change nothing; a refused update changes nothing either
    s.lookup(u64(), 4)
    s.update(u64(), np.zeros((0, 4), np.float32))
    s.load([{"dim": 4, "ids": u64(), "weights": np.zeros((0, 4), np.float32)}])
    assert s.remove(u64()) == 0
    s.lookup(u64(1), 4)
    with pytest.raises(BadInput):
        s.update(u64(1), np.full((1, 4), np.nan, np.float32))
    with pytest.raises(BadInput):
        s.update(u64(1), np.ones((1, 8), np.float32))
    assert s.change_version == 7 and versions(s) == {1: 7}
    s.advance_version(20)
    s.advance_version(3)                             # never goes back
    assert s.change_version == 20
    s.update(u64(1), np.ones((1, 4), np.float32))
    assert s.change_version == 21 and versions(s) == {1: 21}
    s.close()
    assert s.change_version == 22


def test_a_failed_update_leaves_versions_and_the_next_update_intact():
    """The Cython update marks the entries it has seen with the call's version; a call
    that fails must undo that, or the next update would mistake its entries for seen."""
    stores = [CEmbeddingStore(100, Adagrad()), PyEmbeddingStore(100, Adagrad())]
    for s in stores:
        s.lookup(u64(1, 2), 4)
        s.lookup(u64(9), 8)
        with pytest.raises(BadInput, match="stored with dim 8"):
            s.update(u64(1, 2, 9), np.ones((3, 4), np.float32))
        with pytest.raises(BadInput, match="not finite"):
            s.update(u64(1, 2), np.array([[1] * 4, [np.nan] * 4], np.float32))
        assert versions(s) == {1: 1, 2: 1, 9: 2} and s.change_version == 2
        s.update(u64(2, 1, 2), np.arange(12, dtype=np.float32).reshape(3, 4))
        assert versions(s) == {1: 3, 2: 3, 9: 2}
    c, p = (s.lookup(u64(1, 2), 4, train=False) for s in stores)
    assert c.tobytes() == p.tobytes()


def test_versions_past_32_bits():
    """The Cython store keeps versions in 32 bits above a base that moves: a jump past
    2**32 moves it; rows changed before are reported with a later version (the base),
    never lost. Values and the newer versions are the twin's."""
    stores = [CEmbeddingStore(100, SGD(0.1)), PyEmbeddingStore(100, SGD(0.1))]
    base = 2**40 - 2**31
    for s in stores:
        s.lookup(u64(1, 2), 2)
        s.advance_version(2**40)
        s.update(u64(2, 2), np.ones((2, 2), np.float32))   # duplicates summed after the move
        s.lookup(u64(3), 2)
        assert s.change_version == 2**40 + 2
        assert versions(s, base) == {2: 2**40 + 1, 3: 2**40 + 2}
        old = versions(s, 0)
        assert old.keys() == {1, 2, 3} and old[1] in (1, base)
        assert versions(s, 2**39).keys() >= {2, 3}
    c, p = (s.lookup(u64(1, 2, 3), 2, train=False) for s in stores)
    assert c.tobytes() == p.tobytes()
    assert versions(stores[0], 0)[1] == base          # the Cython store: reported later


def test_changed_since_returns_the_values_and_splits_by_dim_and_chunk(impl):
    s = impl(1000, Adagrad())
    a = np.arange(40, dtype=np.uint64)
    b = np.arange(100, 130, dtype=np.uint64)
    s.lookup(a, 4)
    s.lookup(b, 8)
    s.update(a[::2], np.ones((20, 4), np.float32))
    got = changed(s, 0, chunk_rows=7)
    assert sorted(got) == sorted(a.tolist() + b.tolist())
    for k, (dim, w, v) in got.items():
        assert dim == (4 if k < 100 else 8)
        assert v == (3 if k < 40 and k % 2 == 0 else 1 if k < 40 else 2)
        assert np.array_equal(w, s.lookup(u64(k), dim, train=False)[0])   # bit for bit
    assert sorted(changed(s, 1)) == a[::2].tolist() + b.tolist()
    assert sorted(changed(s, 2)) == a[::2].tolist()
    assert changed(s, 3) == {}
    # a full scan with nothing to report (a since older than the Cython store's mark: a
    # remove of no stored id is a version that stamps no row) is still many short steps,
    # one per window of slots
    assert s.remove(u64(999)) == 0 and s.change_version == 4
    assert changed(s, 4) == {}
    chunks = list(s.changed_since(3, chunk_rows=10))
    assert len(chunks) >= 7 and all(len(c["ids"]) == 0 and c["dim"] == 0 for c in chunks)


@pytest.mark.parametrize("sharded", [False, True])
def test_changed_since_with_state_gives_the_optimizer_state_dump_gives(impl, sharded):
    """An incremental checkpoint's patch: the changed rows with values and optimizer
    state, as dump has them (rows of two dims, one in float16)."""
    s = ShardedStore(100, Adagrad(), shards=2, store_type=impl) if sharded \
        else impl(100, Adagrad())
    s.lookup(u64(1, 2, 3), 4)
    s.update(u64(1, 2, 3), np.ones((3, 4), np.float32))
    v = s.change_version
    s.lookup(u64(7, 8), 2)
    s.update(u64(2), np.full((1, 4), 0.5, np.float32))
    s.update(u64(8), np.array([[0.25, 0.25]], np.float32))
    dumped = {k: (c["weights"][i], c["state"][i]) for c in s.dump()
              for i, k in enumerate(c["ids"].tolist())}
    got = {}
    for c in s.changed_since(v, state=True):
        if not len(c["ids"]):
            continue
        assert c["state"].dtype == np.float32 and c["state"].shape[0] == len(c["ids"])
        assert c["state_kind"] == Adagrad().state_kind
        for i, k in enumerate(c["ids"].tolist()):
            got[k] = (c["weights"][i], c["state"][i])
    assert sorted(got) == [2, 7, 8]
    for k, (w, st) in got.items():
        np.testing.assert_array_equal(w, dumped[k][0])
        np.testing.assert_array_equal(st, dumped[k][1])
    assert all("state" not in c for c in s.changed_since(v))   # the update feed's


def test_rows_changed_during_a_pass_are_never_torn_and_show_up_in_the_next(impl):
    s = impl(1000, SGD(0.5))
    ids = np.arange(200, dtype=np.uint64)
    s.lookup(ids, 4)
    history = {(int(k), 1): w for k, w in zip(ids, s.lookup(ids, 4, train=False), strict=True)}
    published = s.change_version                     # read before the pass
    rng = np.random.default_rng(0)
    seen = {}
    for chunk in s.changed_since(0, chunk_rows=16):
        rows = zip(chunk["ids"].tolist(), chunk["weights"], chunk["versions"].tolist(),
                   strict=True)
        for k, w, v in rows:
            assert np.array_equal(w, history[(k, v)])   # the row as it was at that version
            seen[k] = v
        some = rng.choice(ids, 50, replace=False).astype(np.uint64)
        s.update(some, rng.standard_normal((50, 4)).astype(np.float32))   # training goes on
        for k, w in zip(some.tolist(), s.lookup(some, 4, train=False), strict=True):
            history[(k, s.change_version)] = w
    assert set(seen) == set(ids.tolist())
    after = changed(s, published)
    newer = {k for (k, v) in history if v > published}
    assert set(after) == newer                       # everything changed mid-pass comes again
    for k, (_, w, v) in after.items():
        assert np.array_equal(w, s.lookup(u64(k), 4, train=False)[0])
        assert np.array_equal(w, history[(k, v)])


def test_evicted_since_logs_evictions_and_removals_oldest_first(impl):
    s = impl(3, SGD(0.1))
    s.lookup(u64(1, 2, 3), 2)                        # v1
    s.lookup(u64(4, 5), 2)                           # v2 evicts 1, 2
    assert s.remove(u64(3, 42)) == 1                 # v3 removes 3
    s.lookup(u64(6), 2)                              # v4: room left, no eviction
    ids, vers, complete = s.evicted_since(0)
    assert ids.tolist() == [1, 2, 3] and vers.tolist() == [2, 2, 3] and complete
    assert ids.dtype == np.uint64 and vers.dtype == np.int64
    ids, vers, complete = s.evicted_since(2)
    assert ids.tolist() == [3] and vers.tolist() == [3] and complete
    assert s.evicted_since(4)[0].size == 0
    st = s.stats()
    assert (st["evictions"], st["removals"], st["rows"]) == (2, 1, 3)
    s.clear()                                        # v5
    ids, _, complete = s.evicted_since(4)
    assert ids.size == 0 and not complete            # the rows of before are all gone
    assert s.evicted_since(5)[2]
    s.close()                                        # v6
    assert not s.evicted_since(5)[2] and s.evicted_since(6)[2]


def test_an_overflowing_eviction_log_says_it_is_incomplete(impl):
    s = impl(2, SGD(0.1), eviction_log=4)
    for k in range(10):
        s.lookup(u64(k), 2)                          # version k+1 evicts k-2 from k=2 on
    ids, vers, complete = s.evicted_since(0)         # (3, version 6) was dropped
    assert ids.tolist() == [4, 5, 6, 7] and vers.tolist() == [7, 8, 9, 10] and not complete
    ids, vers, complete = s.evicted_since(6)         # the log still covers versions > 6
    assert ids.tolist() == [4, 5, 6, 7] and complete
    assert s.evicted_since(5)[2] is False
    ids, vers, complete = s.evicted_since(9)
    assert ids.tolist() == [7] and vers.tolist() == [10] and complete


def test_memory_bytes_counts_the_versions_and_the_log(impl):
    s = impl(10, SGD(0.1))
    s.lookup(np.arange(10, dtype=np.uint64), 16)
    full = s.memory_bytes()
    assert full >= 10 * (16 * 4 + 8)
    for k in range(10, 2000, 10):                    # 1990 evictions, the same rows
        s.lookup(np.arange(k, k + 10, dtype=np.uint64), 16)
    assert len(s) == 10 and s.memory_bytes() >= full + 16 * 1000


@pytest.mark.parametrize("call, field", [
    (lambda s: s.changed_since(-1), "since"),
    (lambda s: s.changed_since("3"), "since"),
    (lambda s: s.changed_since(True), "since"),
    (lambda s: s.changed_since(0, chunk_rows=0), "chunk_rows"),
    (lambda s: s.changed_since(0, chunk_rows=2.0), "chunk_rows"),
    (lambda s: s.evicted_since(-2), "since"),
    (lambda s: s.evicted_since(None), "since"),
    (lambda s: s.advance_version(-1), "version"),
    (lambda s: s.advance_version(1.5), "version"),
    (lambda s: s.remove([1, 2]), "ids"),
])
def test_bad_arguments_name_the_field(impl, call, field):
    for s in (impl(10, SGD(0.1)), ShardedStore(10, SGD(0.1), shards=2, store_type=impl)):
        with pytest.raises(BadInput) as info:
            call(s)
        assert info.value.field == field
        assert s.change_version == 0


@pytest.mark.parametrize("n", [0, -1, True, 1.0, 2**26 + 1])
def test_eviction_log_size_is_validated(impl, n):
    with pytest.raises(BadInput) as info:
        impl(10, SGD(0.1), eviction_log=n)
    assert info.value.field == "eviction_log"


def test_a_closed_store_refuses_listing_changes(impl):
    s = impl(10, SGD(0.1))
    s.lookup(u64(1, 2, 3), 2)
    passing = s.changed_since(0, chunk_rows=1)
    next(passing)
    s.close()
    with pytest.raises(Misuse, match="closed"):
        next(passing)
    with pytest.raises(Misuse, match="closed"):
        s.changed_since(0)
    with pytest.raises(Misuse, match="closed"):
        s.remove(u64(1))


# --- the sharded store ------------------------------------------------------------------------

def _traffic(s, rng, steps=12):
    for step in range(steps):
        dim = 4 if step % 3 else 8
        ids = (rng.integers(0, 300, 80).astype(np.uint64)) | np.uint64(dim << 56)
        s.lookup(ids, dim)
        s.update(ids, rng.standard_normal((80, dim)).astype(np.float32))
        if step % 4 == 3:
            s.remove(ids[:5])
        if step == 6:
            s.load([{"dim": 4, "ids": u64(5, 6) | np.uint64(4 << 56),
                     "weights": np.ones((2, 4), np.float32)}])


@pytest.mark.parametrize("shards", [2, 3])
def test_a_sharded_store_reports_the_changes_of_one_store(impl, shards):
    one = impl(10**5, Adagrad())
    many = ShardedStore(10**5, Adagrad(), shards=shards, store_type=impl)
    for s in (one, many):
        _traffic(s, np.random.default_rng(3))
    assert one.change_version == many.change_version == 12 * 2 + 3 + 1
    assert all(part.change_version <= many.change_version for part in many._stores)
    for since in (0, 5, 17, many.change_version):
        a, b = changed(one, since, 64), changed(many, since, 64)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k][0] == b[k][0] and a[k][2] == b[k][2]
            assert np.array_equal(a[k][1], b[k][1])
        ia, va, ca = one.evicted_since(since)
        ib, vb, cb = many.evicted_since(since)
        assert ca == cb and sorted(zip(va.tolist(), ia.tolist(), strict=True)) == \
            sorted(zip(vb.tolist(), ib.tolist(), strict=True))
        assert list(vb) == sorted(vb)                # merged in order of version
    many.clear()
    assert many.change_version == 29 and changed(many, 0) == {}
    assert not many.evicted_since(28)[2] and many.evicted_since(29)[2]
    many.advance_version(40)
    many.lookup(u64(1), 4)
    assert versions(many) == {1: 41}
    many.close()


# --- a replica that follows the stream ends equal to the training store ------------------------

def _sync(train, replica, published, rng):
    """One pass of a replica following ``train`` from version ``published``; training
    goes on between chunks. Returns the version published through."""
    through = train.change_version                   # read before the pass
    ids, _, complete = train.evicted_since(published)
    if complete:
        replica.remove(ids)
        since = published
    else:                                            # the log lost track: resync
        replica.clear()
        since = 0
    for chunk in train.changed_since(since, chunk_rows=int(rng.integers(1, 40))):
        if len(chunk["ids"]):
            replica.load([chunk])
        if rng.random() < 0.3:
            _train_step(train, rng)
    return through


def _train_step(s, rng):
    dim = int(rng.choice([3, 5]))
    ids = (rng.zipf(1.3, 60) % 400).astype(np.uint64) | np.uint64(dim << 56)
    roll = rng.random()
    if roll < 0.45:
        s.lookup(ids, dim)
    elif roll < 0.9:
        s.update(ids, rng.standard_normal((60, dim)).astype(np.float32))
    elif roll < 0.97:
        s.remove(ids[:10])
    else:
        s.clear()


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("log", [1 << 20, 8])
def test_a_replica_following_the_changes_ends_equal(impl, sharded, log):
    rng = np.random.default_rng(11 + sharded + log)
    cfg = EmbeddingConfig(admit_probability=0.8)
    train = (ShardedStore(150, Adagrad(), cfg, shards=3, store_type=impl, eviction_log=log)
             if sharded else impl(150, Adagrad(), cfg, eviction_log=log))
    replica = impl(10**4, SGD(lr=0.0))
    published = 0
    for _ in range(60):
        for _ in range(int(rng.integers(1, 6))):
            _train_step(train, rng)
        published = _sync(train, replica, published, rng)
    train.lookup(np.arange(100, dtype=np.uint64) | np.uint64(3 << 56), 3)   # rows at the end
    _sync(train, replica, published, _Quiet())       # drained: a pass with training stopped
    want, got = _rows(train), _rows(replica)
    assert want.keys() == got.keys() and len(want) > 50
    for k, (dim, w) in want.items():
        assert got[k][0] == dim and np.array_equal(got[k][1], w), k
    if log == 8:
        assert train.stats()["evictions"] > 8        # the log overflowed: resyncs happened


@pytest.mark.parametrize("sharded", [False, True])
def test_a_replica_drops_what_policies_evict(impl, sharded):
    """Rows a group's cap or TTL evicts (issue 20) reach the eviction log like LRU
    evictions: a replica following the changes ends with exactly the store's rows."""
    rng = np.random.default_rng(5 + sharded)
    train = (ShardedStore(150, Adagrad(), shards=3, store_type=impl) if sharded
             else impl(150, Adagrad()))
    policies = [None] * 3 + [SlotPolicy(max_rows=40, ttl_steps=4), None,
                             SlotPolicy(min_count=2, ttl_steps=3)]
    train.set_policies(8, policies)      # ids of dim 3 and 5 are prefixed 3 and 5
    replica = impl(10**4, SGD(lr=0.0))
    published = 0
    for i in range(40):
        for _ in range(int(rng.integers(1, 6))):
            _train_step(train, rng)
        train.expire()
        if i == 20:
            train.set_policies(8, policies[:3] + [SlotPolicy(max_rows=10)])
        published = _sync(train, replica, published, rng)
    train.lookup(np.arange(100, dtype=np.uint64) | np.uint64(3 << 56), 3)   # rows at the end
    _sync(train, replica, published, _Quiet())
    want, got = _rows(train), _rows(replica)
    assert want.keys() == got.keys() and len(want) >= 10
    for k, (dim, w) in want.items():
        assert got[k][0] == dim and np.array_equal(got[k][1], w), k
    stats = train.policy_stats()
    assert stats[3]["evicted_cap"] > 0 and stats[3]["rows"] <= 10
    assert stats[3]["expired"] > 0


def _rows(s):
    return {int(k): (c["dim"], w) for c in s.dump()
            for k, w in zip(c["ids"], c["weights"], strict=True)}


class _Quiet:
    """A generator of the _sync interface that never trains between chunks."""

    def integers(self, lo, hi):
        return hi - 1

    def random(self):
        return 1.0


# --- incremental passes: a pass from the previous pass's version reads what changed ------------

def steps(s, since):
    """next() calls of a pass with windows of one entry: the entries the pass reads."""
    return sum(1 for _ in s.changed_since(since, chunk_rows=1))


def expected(s, since):
    """What changed_since(since) must return, from a pass from 0 (a full scan, in the
    Cython store: 0 is older than its mark, which the scan leaves alone)."""
    return {k: x for k, x in changed(s, 0).items() if x[2] > since}


def same(a, b):
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and a[k][2] == b[k][2] and np.array_equal(a[k][1], b[k][1])
        for k in a)


def test_a_pass_from_the_last_pass_reads_only_the_changed_entries():
    """The Cython store's incremental pass: its steps are the entries changed since the
    previous pass (the twin scans every slot); rows come once each, duplicates in a call
    or across calls, evicted and reused entries, removals and loads included."""
    s = CEmbeddingStore(1000, Adagrad())
    s.lookup(np.arange(1000, dtype=np.uint64), 4)
    assert steps(s, 0) == 1000                       # the first pass scans everything
    mark = s.change_version
    assert steps(s, mark) == 0                       # nothing since: no step at all
    mark = s.change_version
    s.update(u64(5, 6, 5, 5), np.ones((4, 4), np.float32))   # duplicates in a call
    s.update(u64(6, 7), np.ones((2, 4), np.float32))         # and across calls
    s.lookup(u64(2000, 2001, 2002), 4)               # evicts 3 of the oldest rows: their
    assert s.remove(u64(10, 11)) == 2                # entries are reused; two removed
    s.load([{"dim": 4, "ids": u64(12), "weights": np.zeros((1, 4), np.float32)}])
    want = expected(s, mark)
    assert set(want) == {5, 6, 7, 12, 2000, 2001, 2002}
    through = s.change_version
    got = changed(s, mark, chunk_rows=1)             # (changed() asserts each row once)
    assert same(got, want)
    assert steps(s, through) == 0
    # the entries of evicted rows, reused since the last pass: listed once each
    s.lookup(np.arange(3000, 3100, dtype=np.uint64), 4)
    s.update(np.arange(3000, 3100, dtype=np.uint64), np.ones((100, 4), np.float32))
    mark = s.change_version
    assert len(changed(s, through)) == 100
    s.lookup(u64(3000), 4, train=False)
    s.update(u64(3000, 3001), np.ones((2, 4), np.float32))
    assert steps(s, mark) == 2


def test_a_sharded_store_of_cython_shards_passes_incrementally():
    s = ShardedStore(1000, Adagrad(), shards=3, store_type=CEmbeddingStore)
    ids = np.arange(600, dtype=np.uint64)
    s.lookup(ids, 4)
    assert steps(s, 0) == 600
    for _ in range(3):
        mark = s.change_version
        s.update(ids[:10], np.ones((10, 4), np.float32))
        s.lookup(ids[5:15], 4)                       # hits: no row changes
        s.update(u64(7, 7, 700), np.ones((3, 4), np.float32))
        assert steps(s, mark) == 10 and set(changed(s, mark)) == set(range(10))
        assert same(changed(s, mark), expected(s, mark))
    s.close()


def test_a_failed_update_takes_back_what_it_listed():
    s = CEmbeddingStore(100, SGD(0.1))
    s.lookup(np.arange(10, 60, dtype=np.uint64), 4)   # (a list of a few entries is read,
    s.lookup(u64(1, 2, 3), 4)                         # not a scan of them all)
    s.lookup(u64(9), 8)
    mark = s.change_version
    assert steps(s, 0) == 54 and steps(s, mark) == 0
    with pytest.raises(BadInput):
        s.update(u64(1, 2, 9), np.ones((3, 4), np.float32))
    with pytest.raises(BadInput):
        s.update(u64(1, 3), np.array([[1] * 4, [np.nan] * 4], np.float32))
    assert steps(s, mark) == 0
    s.update(u64(3), np.ones((1, 4), np.float32))
    assert steps(s, mark) == 1


def test_an_abandoned_pass_and_an_older_since_scan_everything_and_keep_the_list(impl):
    s = impl(300, Adagrad())
    s.lookup(np.arange(200, dtype=np.uint64), 4)
    first = s.change_version
    changed(s, 0)                                    # the pass that sets the mark
    s.update(np.arange(0, 40, dtype=np.uint64), np.ones((40, 4), np.float32))
    second = s.change_version
    passing = s.changed_since(first, chunk_rows=3)   # a pass abandoned after one window
    next(passing)
    del passing
    s.update(np.arange(30, 50, dtype=np.uint64), np.ones((20, 4), np.float32))
    s.lookup(np.arange(200, 230, dtype=np.uint64), 4)
    assert same(changed(s, first), expected(s, first))   # again from the same since
    assert len(changed(s, first)) == 80
    assert len(changed(s, 0)) == 230                 # an older reader: everything
    assert same(changed(s, second), expected(s, second))
    third = s.change_version
    s.update(u64(1, 2), np.ones((2, 4), np.float32))
    assert same(changed(s, third), expected(s, third))
    assert set(changed(s, third)) == {1, 2}
    if impl is CEmbeddingStore:                      # the list survived the older readers
        fourth = s.change_version
        s.update(u64(3), np.ones((1, 4), np.float32))
        assert steps(s, fourth) == 1


def test_rows_changed_during_an_incremental_pass_come_in_the_next(impl):
    s = impl(1000, SGD(0.5))
    ids = np.arange(300, dtype=np.uint64)
    s.lookup(ids, 4)
    changed(s, 0)
    rng = np.random.default_rng(5)
    published = s.change_version
    s.update(ids[:120], rng.standard_normal((120, 4)).astype(np.float32))
    through = s.change_version
    want = expected(s, published)
    got = {}
    for chunk in s.changed_since(published, chunk_rows=16):
        for k, w, v in zip(chunk["ids"].tolist(), chunk["weights"], chunk["versions"].tolist(),
                           strict=True):
            if v <= through:                         # as the row was when the pass began
                assert np.array_equal(w, want[k][1]) and v == want[k][2]
            got[k] = v
        some = rng.choice(ids, 30, replace=False).astype(np.uint64)
        s.update(some, rng.standard_normal((30, 4)).astype(np.float32))
        s.remove(some[:2])
    assert set(want) - set(got) <= set(want) - set(expected(s, 0))   # only removed ones
    assert same(changed(s, through), expected(s, through))


@pytest.mark.parametrize("seed", range(4))
def test_random_consecutive_passes_return_exactly_the_changes(seed):
    """Each pass from the previous pass's version returns exactly the rows changed since
    (compared with a full scan) on the Cython store and its twin fed the same calls, with
    evictions, removals, loads, clears, failed updates and jumps of the version past 32
    bits (which move the Cython store's base)."""
    rng = np.random.default_rng(seed)
    cfg = EmbeddingConfig(admit_probability=0.7)
    stores = [CEmbeddingStore(120, Adagrad(), cfg), PyEmbeddingStore(120, Adagrad(), cfg)]
    published = 0
    for _ in range(50):
        roll = rng.random()
        calls = [_random_call(rng) for _ in range(int(rng.integers(0, 5)))]
        for s in stores:
            for call in calls:
                call(s)
            if roll < 0.05:
                s.advance_version(s.change_version + 2**32)
        through = stores[0].change_version
        since = published if rng.random() < 0.9 else int(rng.integers(0, published + 1))
        passes = [changed(s, since, int(rng.integers(1, 50))) for s in stores]
        for s, got in zip(stores, passes, strict=True):
            assert same(got, expected(s, since)), since
        if since == published:
            published = through


def _random_call(rng):
    dim = int(rng.choice([3, 5]))
    ids = (rng.zipf(1.3, 40) % 300).astype(np.uint64) | np.uint64(dim << 56)
    roll = rng.random()
    if roll < 0.4:
        return lambda s: s.lookup(ids, dim)
    grads = rng.standard_normal((40, dim)).astype(np.float32)
    if roll < 0.8:
        return lambda s: s.update(ids, grads)
    if roll < 0.85:
        bad = grads.copy()
        bad[-1, 0] = np.nan

        def refused(s):
            with pytest.raises(BadInput):
                s.update(ids, bad)
        return refused
    if roll < 0.92:
        return lambda s: s.remove(ids[:8])
    if roll < 0.98:
        return lambda s: s.load([{"dim": dim, "ids": np.unique(ids[:10]),
                                  "weights": np.ones((len(np.unique(ids[:10])), dim),
                                                     np.float32)}])
    return lambda s: s.clear()
