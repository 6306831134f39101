"""Table policies (issue 20) in the embedding store: frequency admission, TTL, per-group caps
and their counters, on the Cython store and its Python twin alike (and a differential test
that they agree bit for bit), and through a ShardedStore."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad, Adam
from stream_persia.errors import BadInput
from stream_persia.server import policies as pol
from stream_persia.server._pystore import PyEmbeddingStore, initial_rows
from stream_persia.server.sharded import ShardedStore
from stream_persia.server.slot_policies import parse_policies

CEmbeddingStore = pytest.importorskip("stream_persia.server._cstore").CEmbeddingStore
IMPLS = [pytest.param(CEmbeddingStore, id="cython"), pytest.param(PyEmbeddingStore, id="python")]
BITS = 8
INIT = EmbeddingConfig().emb_initialization


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def gid(group, *ids):
    """Ids of feature group ``group`` (policy index group + 1), prefixed as the schema does."""
    return np.array([((group + 1) << (64 - BITS)) | i for i in ids], np.uint64)


def store(impl, capacity=100, **kw):
    return impl(capacity, SGD(lr=0.1), **kw)


# --- frequency admission ------------------------------------------------------------------

def test_an_id_is_admitted_at_its_kth_training_lookup(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(min_count=3)])
    ids = gid(0, 7)
    for k in (1, 2):
        out = s.lookup(ids, 4)
        assert out.tobytes() == initial_rows(ids, 4, INIT).tobytes()   # its initial row
        assert not s.contains(ids)[0] and len(s) == 0, k
    s.lookup(ids, 4, train=False)                 # inference lookups are not counted
    assert not s.contains(ids)[0]
    assert s.lookup(ids, 4).tobytes() == initial_rows(ids, 4, INIT).tobytes()
    assert s.contains(ids)[0]
    stats = s.policy_stats()[1]
    assert (stats["rejected"], stats["admitted"], stats["rows"]) == (2, 1, 1)
    assert s.stats()["admissions"] == 1


def test_other_groups_are_not_counted(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(min_count=2), None])
    s.lookup(np.concatenate([gid(0, 1), gid(1, 1)]), 4)
    assert s.contains(gid(1, 1))[0] and not s.contains(gid(0, 1))[0]
    assert s.sketch_counts(gid(1, 1))[0] == 0 and s.sketch_counts(gid(0, 1))[0] == 1


def test_gradients_of_rejected_ids_are_dropped_and_counted(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(min_count=2)])
    ids = gid(0, 1, 2, 1)
    s.lookup(ids[:2], 4)
    s.update(ids, np.ones((3, 4), np.float32))
    assert len(s) == 0
    assert s.policy_stats()[1]["dropped_grads"] == 3
    assert s.stats()["dropped_updates"] == 3


def test_policy_admit_probability_overrides_the_config(impl):
    s = impl(1000, SGD(lr=0.1), EmbeddingConfig(admit_probability=1.0))
    s.set_policies(BITS, [None, SlotPolicy(admit_probability=0.0), SlotPolicy()])
    s.lookup(gid(0, *range(50)), 4)
    s.lookup(gid(1, *range(50)), 4)
    assert s.policy_stats()[1]["rows"] == 0 and s.policy_stats()[2]["rows"] == 50


def test_sketch_error_is_within_its_bound(impl):
    """Count-min with conservative update: never below the exact count, and above it by
    more than e * N / w for at most a fraction e**-4 of ids (here with slack)."""
    s = store(impl, sketch_bytes=4096)
    s.set_policies(BITS, [None, SlotPolicy(min_count=255)])   # nothing is ever admitted
    w = 4096 // pol.SKETCH_DEPTH
    rng = np.random.default_rng(3)
    stream = rng.zipf(1.2, w - 24) % 5000
    for chunk in np.array_split(stream, 8):
        s.lookup(gid(0, *chunk.tolist()), 2)
    keys, exact = np.unique(stream, return_counts=True)
    est = s.sketch_counts(gid(0, *keys.tolist()))
    assert (est >= np.minimum(exact, 255)).all()
    over = est - exact
    assert (over > math.e * len(stream) / w).mean() <= 2 * math.exp(-pol.SKETCH_DEPTH)
    assert over.mean() < 0.5


def test_sketch_counters_are_halved_every_width_counts(impl):
    s = store(impl, sketch_bytes=4096)
    s.set_policies(BITS, [None, SlotPolicy(min_count=255)])
    w = 4096 // pol.SKETCH_DEPTH
    s.lookup(gid(0, *[1] * 40), 2)
    assert s.sketch_counts(gid(0, 1))[0] == 40
    s.lookup(gid(0, *range(1000, 1000 + w - 40)), 2)    # the w-th count
    assert s.sketch_counts(gid(0, 1))[0] == 40
    s.lookup(gid(0, 5000), 2)                            # halves before counting
    assert s.sketch_counts(gid(0, 1))[0] == 20


def test_the_sketch_is_checkpointed_with_the_rows(impl, tmp_path):
    """A checkpoint (a server's shard file) keeps the counts of ids not yet admitted: after
    a restore an id seen twice of min_count 3 is admitted at its next lookup, as it would
    have been without the restore; into another sketch size no id is counted lower."""
    from stream_persia.server.shard_files import stage_shard_files, write_shard_file
    s = store(impl, capacity=1000, sketch_bytes=8192)
    s.set_policies(BITS, [None, SlotPolicy(min_count=3)])
    seen = gid(0, *range(1, 400))
    s.lookup(seen, 4)
    s.lookup(seen[:200], 4)            # ids 1-199 seen twice, 200-399 once
    s.lookup(gid(0, 500, 500, 500), 4)  # admitted: a row
    want = s.sketch_counts(seen)
    assert (want[:199] >= 2).all() and len(s) == 1
    chunks = list(s.dump())
    assert "sketch" in chunks[-1] and len(chunks[-1]["ids"]) == 0
    name = "embedding-shard-00000-of-00001.bin"
    info = write_shard_file(iter(chunks), str(tmp_path), name)
    expected = {name: {"sha256": info["sha256"], "bytes": info["bytes"], "rows": info["rows"]}}
    for sketch_bytes in (8192, 4096, 1 << 16):
        back = store(impl, capacity=1000, sketch_bytes=sketch_bytes)
        back.set_policies(BITS, [None, SlotPolicy(min_count=3)])
        assert stage_shard_files(back, str(tmp_path), list(expected), expected, 0, 1) == 1
        got = back.sketch_counts(seen)
        if sketch_bytes == 8192:
            assert (got == want).all()
            assert back.sketch_state()[1] == s.sketch_state()[1]
        assert (got >= want).all()
        back.lookup(seen[:199], 4)
        assert back.contains(seen[:199]).all(), "seen twice before, three times now"
    # Policies set after the restore (as a job's NN configures them) find the counts.
    later = store(impl, sketch_bytes=8192)
    later.load(chunks)
    later.set_policies(BITS, [None, SlotPolicy(min_count=3)])
    assert (later.sketch_counts(seen) == want).all()
    later.set_policies(BITS, [None])     # no min_count: the sketch is dropped
    assert later.sketch_state() is None and not (later.sketch_counts(seen)).any()


def test_a_sketch_chunk_is_checked_naming_its_key(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(min_count=3)])
    s.lookup(gid(0, 1), 4)
    chunk = list(s.dump())[-1]
    for key, bad in (("sketch", chunk["sketch"][:, :1000]), ("sketch", chunk["sketch"][:3]),
                     ("sketch", chunk["sketch"].astype(np.int16)),
                     ("sketch_counted", -1), ("sketch_part", [2, 2])):
        with pytest.raises(BadInput) as info:
            s.load([{**chunk, key: bad}])
        assert info.value.field == key


@pytest.mark.parametrize("into", [2, 3])
def test_a_sharded_stores_sketches_are_checkpointed(impl, into):
    many = ShardedStore(1000, SGD(lr=0.1), shards=2, store_type=impl, sketch_bytes=1 << 14)
    many.set_policies(BITS, [None, SlotPolicy(min_count=4)])
    seen = gid(0, *range(1, 300))
    for _ in range(3):
        many.lookup(seen, 4)
    want = many.sketch_counts(seen)
    assert (want >= 3).all() and len(many) == 0
    back = ShardedStore(1000, SGD(lr=0.1), shards=into, store_type=impl,
                        sketch_bytes=1 << 14)
    back.set_policies(BITS, [None, SlotPolicy(min_count=4)])
    back.load(many.dump())
    got = back.sketch_counts(seen)
    assert (got == want).all() if into == 2 else (got >= want).all()
    back.lookup(seen, 4)
    assert back.contains(seen).all()


def test_a_closed_store_frees_its_sketch(impl):
    s = store(impl, sketch_bytes=1 << 20)
    s.set_policies(BITS, [None, SlotPolicy(min_count=2)])
    s.lookup(gid(0, 1, 2), 4)
    assert s.memory_bytes() == sum(s.memory_breakdown().values()) >= 1 << 20
    s.close()
    assert s.memory_bytes() == sum(s.memory_breakdown().values()) == 0


def test_sketch_counts_beside_set_policies_is_misuse_not_a_crash():
    """A second call on a store while one runs raises Misuse: a sketch_counts() reading
    the sketch without the GIL while another thread's set_policies() freed it crashed the
    process (in a subprocess here, so that a crash fails this test only)."""
    script = textwrap.dedent("""
        import threading
        import numpy as np
        from stream_persia.core.embedding_config import SlotPolicy
        from stream_persia.embedding.optim import SGD
        from stream_persia.errors import Misuse
        from stream_persia.server._cstore import CEmbeddingStore
        s = CEmbeddingStore(100, SGD(lr=0.1), sketch_bytes=1 << 24)
        tables = [[SlotPolicy()], [SlotPolicy(min_count=2)]]
        s.set_policies(0, tables[1])
        ids = np.arange(1 << 21, dtype=np.uint64)
        misuse, done = [], threading.Event()
        def read():
            while not done.is_set():
                try:
                    s.sketch_counts(ids)
                except Misuse:
                    misuse.append(1)
        t = threading.Thread(target=read)
        t.start()
        # Until the two calls met (a Misuse) a few times, within a bound: a fixed count
        # of changes sometimes never overlapped a read on a busy machine.
        import time
        deadline, i = time.monotonic() + 60, 0
        while (len(misuse) < 3 or i < 300) and time.monotonic() < deadline:
            try:
                s.set_policies(0, tables[i % 2])
            except Misuse:
                misuse.append(1)
            i += 1
        done.set()
        t.join()
        print("misuse", len(misuse))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert int(proc.stdout.split()[-1]) > 0


def test_a_set_policies_out_of_memory_leaves_the_table_in_force():
    """A set_policies() that cannot allocate the new table's queues raises MemoryError
    and changes nothing: it freed the old table's sketch first, and its min_count then
    admitted every id at its first lookup. In a subprocess whose address space is capped
    just above its use."""
    script = textwrap.dedent("""
        import resource
        import numpy as np
        from stream_persia.core.embedding_config import SlotPolicy
        from stream_persia.embedding.optim import SGD
        from stream_persia.server._cstore import CEmbeddingStore
        n = 1 << 21                       # the queues of n entries: 16 MiB
        s = CEmbeddingStore(n, SGD(lr=0.1))
        ids = np.arange(1, n + 1, dtype=np.uint64)
        for i in range(0, n, 1 << 16):
            s.lookup(ids[i:i + (1 << 16)], 4)
        s.set_policies(0, [SlotPolicy(min_count=2)])
        size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (4 << 20), resource.RLIM_INFINITY))
        try:
            s.set_policies(0, [SlotPolicy(ttl_s=10.0)])
        except MemoryError:
            print("MemoryError")
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
        new = np.array([n + 7], np.uint64)
        s.lookup(new, 4)
        print(int(s.contains(new)[0]), s.policy_stats()[0]["rejected"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["MemoryError", "0", "1"], proc.stdout


def test_sketch_is_allocated_only_while_needed(impl):
    s = store(impl, sketch_bytes=1 << 20)
    before = s.memory_bytes()
    s.set_policies(BITS, [None, SlotPolicy(min_count=2)])
    assert s.memory_bytes() - before >= 1 << 20
    s.set_policies(BITS, [None, SlotPolicy()])
    assert s.memory_bytes() - before < 1 << 20


# --- TTL --------------------------------------------------------------------------------------

def test_ttl_in_seconds(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(ttl_s=100.0)])
    s.lookup(np.concatenate([gid(0, 1, 2), gid(1, 1)]), 4)
    t = time.monotonic()
    assert s.expire(now=t + 50) == 0
    v = s.change_version
    assert s.change_version == v                          # nothing expired: no version
    assert s.expire(now=t + 200) == 2
    assert s.contains(gid(0, 1, 2)).tolist() == [False, False] and s.contains(gid(1, 1))[0]
    assert s.policy_stats()[1]["expired"] == 2 and s.policy_stats()[1]["rows"] == 0
    assert s.change_version == v + 1
    ids, versions, complete = s.evicted_since(v)
    assert sorted(ids.tolist()) == sorted(gid(0, 1, 2).tolist()) and complete
    assert versions.tolist() == [v + 1, v + 1]


def test_a_wall_clock_step_neither_expires_rows_nor_keeps_them(impl, monkeypatch):
    """The TTL clock is monotonic: the wall clock stepping a day ahead (NTP, a VM
    resumed) does not expire every row of the group at the next pass, and TTLs still
    run on the store's clock."""
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(ttl_s=100.0)])
    s.lookup(gid(0, 1, 2), 4)
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 86400.0)
    assert s.expire() == 0 and s.contains(gid(0, 1, 2)).all()
    monkeypatch.setattr(time, "time", lambda: wall() - 86400.0)
    s.lookup(gid(0, 3), 4)
    assert s.expire() == 0
    assert s.expire(now=time.monotonic() + 200) == 3


def test_a_training_lookup_refreshes_the_ttl(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(ttl_steps=3)])
    s.lookup(gid(0, 1, 2), 4)
    s.lookup(gid(0, 2), 4)
    s.lookup(gid(0, 2), 4, train=False)                  # not a step, no refresh
    s.lookup(gid(0, 3), 4)
    assert s.expire() == 0                                # row 1 is 2 steps old
    s.lookup(gid(0, 3), 4)
    assert s.expire() == 1                                # now 3
    assert s.contains(gid(0, 1, 2, 3)).tolist() == [False, True, True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_training_lookup_refreshes_the_ttl_beside_compact_rows(impl, dtype):
    """As above, in a store that holds compact rows (group 1's): its lookups take another
    loop, which stamps a hit on a float32 row and on a compact one alike."""
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(ttl_steps=3, dtype=dtype),
                          SlotPolicy(dtype="float16")])
    s.lookup(np.concatenate([gid(0, 1, 2), gid(1, 9)]), 4)
    s.lookup(gid(0, 2), 4)
    s.lookup(gid(0, 2), 4, train=False)
    s.lookup(gid(0, 3), 4)
    assert s.expire() == 0
    s.lookup(gid(0, 3), 4)
    assert s.expire() == 1
    assert s.contains(gid(0, 1, 2, 3)).tolist() == [False, True, True]


def test_rows_present_when_a_ttl_appears_are_stamped_now(impl):
    s = store(impl)
    s.lookup(gid(0, 1), 4)
    t = time.monotonic() + 1000
    s.set_policies(BITS, [None, SlotPolicy(ttl_s=10.0)], now=t)
    assert s.expire(now=t + 5) == 0
    assert s.expire(now=t + 11) == 1


def test_expire_re_queues_rows_looked_up_since_queued(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(ttl_steps=3)])
    s.lookup(gid(0, 1), 4)                                # step 1: 1 queued
    s.lookup(gid(0, 1), 4)                                # step 2: 1 marked, not moved
    s.lookup(gid(0, 2), 4)                                # step 3: 2 queued after 1
    assert s.expire() == 0                                # 1 re-queued behind 2
    s.lookup(gid(1, 9), 4)
    s.lookup(gid(1, 9), 4)                                # step 5: 1 is 3 steps old ...
    assert s.expire() == 0                                # ... but waits behind 2
    assert s.contains(gid(0, 1, 2)).all()
    s.lookup(gid(1, 9), 4)
    assert s.expire() == 2


def test_a_ttl_appearing_beside_a_cap_stamps_rows_now(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=10)])
    s.lookup(gid(0, 1, 2), 4)
    s.lookup(gid(0, 1), 4)               # no TTL yet: a hit marks, stamps nothing
    t = time.monotonic() + 1000
    s.set_policies(BITS, [None, SlotPolicy(max_rows=10, ttl_s=10.0)], now=t)
    assert s.expire(now=t + 5) == 0
    assert s.expire(now=t + 11) == 2


ttl_calls = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4), max_size=40)


@settings(max_examples=40, deadline=None)
@given(ttl=st.integers(1, 4), cap=st.sampled_from([None, 3, 6]), calls=ttl_calls)
@example(ttl=1, cap=None, calls=[[0], [0, 1]] + [[0]] * 8)   # 0 at the tail, always marked
def test_expire_never_evicts_a_row_looked_up_within_its_ttl(ttl, cap, calls):
    """Both stores, expire after every call: a row expired was not looked up for ``ttl``
    steps, and no row outlives ``2 * (ttl + 1)`` steps without a lookup (the docstring's
    bound with ``d`` = one step)."""
    for impl in (CEmbeddingStore, PyEmbeddingStore):
        s = store(impl)
        s.set_policies(BITS, [None, SlotPolicy(ttl_steps=ttl, max_rows=cap)])
        last: dict[int, int] = {}
        for step, ids in enumerate(calls, 1):
            s.lookup(gid(0, *ids), 4)
            last.update(dict.fromkeys(gid(0, *ids).tolist(), step))
            v = s.change_version
            s.expire()
            gone = s.evicted_since(v)[0].tolist()
            assert all(step - last[k] >= ttl for k in gone), (impl, step, gone)
            for k in gone:
                del last[k]
            held = [k for k in last if s.contains(np.array([k], np.uint64))[0]]
            assert all(step - last[k] < 2 * (ttl + 1) for k in held), (impl, step)
            last = {k: last[k] for k in held}      # capped rows are gone too


def test_stamps_survive_the_entries_growing(impl):
    s = store(impl, capacity=10_000)
    s.set_policies(BITS, [None, SlotPolicy(ttl_steps=2)])
    for k in range(3):                                    # steps 1-3, entries grow past 1024
        s.lookup(gid(0, *range(1000 * k, 1000 * (k + 1))), 4)
    s.lookup(gid(1, 0), 4)                                # step 4
    assert s.expire() == 2000
    assert s.contains(gid(0, 1999, 2000)).tolist() == [False, True]


def test_stamps_are_allocated_only_while_a_ttl_exists():
    s = store(CEmbeddingStore, capacity=100_000)
    s.lookup(gid(0, *range(2000)), 4)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=50_000)])
    cap_only = s.memory_bytes()
    s.set_policies(BITS, [None, SlotPolicy(max_rows=50_000, ttl_steps=5)])
    assert s.memory_bytes() - cap_only >= 8 * 2000
    s.set_policies(BITS, [None, SlotPolicy(max_rows=50_000)])
    assert s.memory_bytes() == cap_only


def test_expire_work_is_bounded(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(ttl_steps=1)])
    s.lookup(gid(0, *range(10)), 4)
    s.lookup(gid(1, 0), 4)
    assert s.expire(max_rows=4) == 4
    assert s.contains(gid(0, *range(4))).tolist() == [False] * 4   # oldest first
    assert s.expire(max_rows=100) == 6
    with pytest.raises(BadInput) as e:
        s.expire(max_rows=0)
    assert e.value.field == "max_rows"


# --- per-group caps ------------------------------------------------------------------------

def test_a_group_cap_evicts_within_the_group(impl):
    s = store(impl, capacity=6)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=2)])
    s.lookup(gid(0, 1, 2), 4)
    s.lookup(gid(1, 1, 2), 4)
    s.lookup(gid(0, 1), 4)                                # 2 is now the group's oldest
    v = s.change_version
    s.lookup(gid(0, 3), 4)
    assert s.contains(gid(0, 1, 2, 3)).tolist() == [True, False, True]
    assert s.contains(gid(1, 1, 2)).all()
    ps = s.policy_stats()
    assert ps[1]["evicted_cap"] == 1 and ps[1]["rows"] == 2
    assert ps[0]["rows"] == 2                             # index 2 is past the table: 0
    assert s.evicted_since(v)[0].tolist() == gid(0, 2).tolist()


def test_global_capacity_still_evicts_the_globally_oldest(impl):
    s = store(impl, capacity=4)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=3), SlotPolicy(ttl_s=1e6)])
    s.lookup(gid(1, 1), 4)
    s.lookup(gid(0, 1, 2), 4)
    s.lookup(gid(1, 2), 4)
    s.lookup(gid(0, 3), 4)                                # full: evicts gid(1, 1)
    assert not s.contains(gid(1, 1))[0]
    assert s.contains(np.concatenate([gid(0, 1, 2, 3), gid(1, 2)])).all()
    ps = s.policy_stats()
    assert ps[2]["evicted_lru"] == 1 and ps[1]["evicted_lru"] == 0
    assert s.stats()["evictions"] == 1


def test_a_cap_gives_looked_up_rows_a_second_chance(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=2)])
    s.lookup(gid(0, 1), 4)
    s.lookup(gid(0, 2), 4)
    s.lookup(gid(0, 2), 4)                                # 2 is the group's oldest ...
    s.lookup(gid(0, 1), 4)
    v = s.change_version
    s.lookup(gid(0, 3), 4)     # ... but both were looked up since queued: 1 and 2 re-queued
    assert s.evicted_since(v)[0].tolist() == gid(0, 1).tolist()   # 1 met unmarked first
    s.lookup(gid(0, 4), 4)
    assert s.contains(gid(0, 1, 2, 3, 4)).tolist() == [False, False, True, True]
    assert s.policy_stats()[1]["evicted_cap"] == 2


def test_a_lower_cap_at_run_time_evicts_at_once(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=10)])
    s.lookup(gid(0, *range(8)), 4)
    s.lookup(gid(0, 0), 4)
    v = s.change_version
    s.set_policies(BITS, [None, SlotPolicy(max_rows=3)])
    assert len(s) == 3 and s.contains(gid(0, 0, 6, 7)).tolist() == [True, True, True]
    assert s.change_version == v + 1
    ids, _, _ = s.evicted_since(v)
    assert ids.tolist() == gid(0, 1, 2, 3, 4, 5).tolist()
    assert s.policy_stats()[1]["evicted_cap"] == 5
    assert s.policy_stats()[1]["admitted"] == 8          # counters survive the new table


def test_loads_respect_caps(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=2)])
    s.load([{"dim": 2, "ids": gid(0, 1, 2, 3), "weights": np.zeros((3, 2), np.float32)}])
    assert s.contains(gid(0, 1, 2, 3)).tolist() == [False, True, True]


def test_policies_off_again_is_the_default(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=2, ttl_steps=1, min_count=2)])
    s.set_policies(BITS, [])
    s.lookup(gid(0, *range(5)), 4)
    assert len(s) == 5 and s.expire() == 0
    assert s.policy_stats() == {0: dict(s.policy_stats()[0])} and s.policy_stats()[0]["rows"] == 5


def test_clear_and_remove_keep_the_counts_right(impl):
    s = store(impl)
    s.set_policies(BITS, [None, SlotPolicy(max_rows=3, ttl_steps=5)])
    s.lookup(gid(0, 1, 2, 3), 4)
    assert s.remove(gid(0, 2)) == 1
    assert s.policy_stats()[1]["rows"] == 2
    s.lookup(gid(0, 4, 5), 4)                             # cap: 1 goes
    assert s.contains(gid(0, 1, 3, 4, 5)).tolist() == [False, True, True, True]
    s.clear()
    assert s.policy_stats()[1]["rows"] == 0 and s.expire() == 0
    s.lookup(gid(0, 1, 2, 3, 4), 4)
    assert len(s) == 3


@pytest.mark.parametrize("args, field", [
    ((-1, []), "prefix_bits"),
    ((64, []), "prefix_bits"),
    ((8, [None, {"min_count": 2}]), "policies[1]"),
    ((8, "x"), "policies"),
    ((0, [None, SlotPolicy(min_count=2)]), "prefix_bits"),
    ((1, [None, None, SlotPolicy(max_rows=1)]), "policies[2]"),   # index 2 needs 2 bits
])
def test_set_policies_validates(impl, args, field):
    s = store(impl)
    with pytest.raises(BadInput) as e:
        s.set_policies(*args)
    assert e.value.field == field


def test_a_table_the_store_cannot_hold_is_refused_where_it_is_parsed():
    """The server's parser allows what a store accepts (an entry keeps its policy index
    in 15 bits), so a table it passes is not refused later on the store thread."""
    with pytest.raises(BadInput) as e:
        parse_policies({"prefix_bits": 16, "policies": [None] * (pol.MAX_POLICIES + 1)})
    assert e.value.field == "policies.policies"


def test_sketch_bytes_is_validated(impl):
    with pytest.raises(BadInput) as e:
        store(impl, sketch_bytes=100)
    assert e.value.field == "sketch_bytes"


def test_slot_policy_errors_name_the_key():
    with pytest.raises(BadInput) as e:
        SlotPolicy.from_dict({"max_rows": 0}, "slots_config.user")
    assert e.value.field == "slots_config.user.max_rows"
    with pytest.raises(BadInput) as e:
        SlotPolicy.from_dict({"ttl": 1}, "slots_config.user")
    assert e.value.field == "slots_config.user.ttl"
    for bad in ({"min_count": 256}, {"min_count": True}, {"admit_probability": 2},
                {"ttl_s": float("inf")}, {"ttl_steps": 0}, {"dtype": "int8"}):
        with pytest.raises(BadInput):
            SlotPolicy.from_dict(bad)
    p = SlotPolicy(min_count=2, ttl_s=5, max_rows=3, dtype="float16")
    assert SlotPolicy.from_dict(p.to_dict()) == p and not p.is_default
    assert SlotPolicy().is_default


# --- sharded --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [CEmbeddingStore, PyEmbeddingStore], ids=["cython", "python"])
def test_sharded_store_forwards_policies(kind):
    s = ShardedStore(1000, SGD(lr=0.1), shards=2, store_type=kind, sketch_bytes=8192)
    try:
        s.set_policies(BITS, [None, SlotPolicy(min_count=2), SlotPolicy(max_rows=4),
                              SlotPolicy(ttl_steps=1)])
        s.lookup(np.concatenate([gid(0, *range(20)), gid(1, *range(20)), gid(2, *range(6))]), 4)
        s.lookup(gid(0, *range(10)), 4)
        assert s.sketch_counts(gid(0, 15))[0] == 1
        ps = s.policy_stats()
        assert ps[1]["rejected"] == 20 and ps[1]["admitted"] == 10
        assert ps[2]["rows"] == 4 and ps[2]["evicted_cap"] == 16
        v = s.change_version
        assert s.expire() == 6 and s.change_version == v + 1
        assert s.expire() == 0 and s.change_version == v + 1
        ids, versions, _ = s.evicted_since(v)
        assert sorted(ids.tolist()) == sorted(gid(2, *range(6)).tolist())
        assert s.policy_stats()[3]["expired"] == 6
    finally:
        s.close()


# --- the two stores agree -----------------------------------------------------------------

# The policies' table (admission, TTL, caps) and compact rows' (dtypes beside a cap and a
# min_count); a "policies" step shuffles the table's groups and may cut it short.
TABLES = {
    "policies": [None, SlotPolicy(min_count=2, max_rows=5), SlotPolicy(ttl_steps=3),
                 SlotPolicy(admit_probability=0.5, min_count=3, ttl_steps=2, max_rows=4)],
    "compact": [None, SlotPolicy(dtype="float16"), SlotPolicy(dtype="bfloat16", max_rows=5),
                SlotPolicy(min_count=2, dtype="float16")],
}
op = st.tuples(st.sampled_from(["lookup", "lookup", "infer", "pooled", "update", "expire",
                                "load", "remove", "policies"]),
               st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), max_size=12),
               st.integers(0, 1000))


def _run(s, step, table):
    kind, raw, seed = step
    ids = np.array([((g + 1) << (64 - BITS)) | i if g < 3 else i for g, i in raw], np.uint64)
    rng = np.random.default_rng(seed)
    if kind in ("lookup", "infer"):
        return s.lookup(ids, 3, train=kind == "lookup").tobytes()
    if kind == "pooled":
        index = rng.integers(0, max(len(ids), 1), len(ids)).astype(np.int32)
        offsets = np.array([0, len(ids) // 2, len(ids)], np.int64)
        if not len(ids):
            index = np.zeros(0, np.int32)
        return s.lookup_pooled(ids, 3, index, offsets, train=bool(seed % 2)).tobytes()
    if kind == "update":     # every other one large: rows reach the weight bound
        scale = np.float32(10.0 if seed % 2 else 1.0)
        s.update(ids, rng.standard_normal((len(ids), 3)).astype(np.float32) * scale)
    elif kind == "expire":
        return s.expire(max_rows=int(rng.integers(1, 4)))
    elif kind == "load":
        u = np.unique(ids)
        s.load([{"dim": 3, "ids": u, "weights": rng.standard_normal((len(u), 3))
                 .astype(np.float32)}])
    elif kind == "remove":
        return s.remove(ids)
    else:
        pols = list(table)
        rng.shuffle(pols[1:])
        s.set_policies(BITS, pols[:int(rng.integers(1, 5))])
    return None


def _dump(s):
    return [(c["sketch"].tobytes(), c["sketch_counted"]) if "sketch" in c else
            (c["ids"].tobytes(), c["weights"].tobytes(), c["state"].tobytes())
            for c in s.dump(chunk_rows=5)]


def _changed(s):
    rows = {}
    for c in s.changed_since(0):
        for k, w, v in zip(c["ids"].tolist(), c["weights"], c["versions"].tolist(),
                           strict=True):
            rows[k] = (w.tobytes(), v)
    return rows


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=st.sampled_from(sorted(TABLES)), capacity=st.integers(1, 30),
       steps=st.lists(op, max_size=30),
       opt=st.sampled_from([SGD(lr=0.5), Adagrad(lr=0.1), Adam(lr=0.1)]))
def test_cython_and_python_agree_with_policies(table, capacity, steps, opt):
    c = CEmbeddingStore(capacity, opt, eviction_log=50, sketch_bytes=4096)
    p = PyEmbeddingStore(capacity, opt, eviction_log=50, sketch_bytes=4096)
    c.set_policies(BITS, TABLES[table])
    p.set_policies(BITS, TABLES[table])
    for step in steps:
        assert _run(c, step, TABLES[table]) == _run(p, step, TABLES[table]), step
        assert c.stats() == p.stats()
        assert c.policy_stats() == p.policy_stats()
        assert c.change_version == p.change_version
    assert _dump(c) == _dump(p)
    assert _changed(c) == _changed(p)
    for since in range(0, c.change_version + 1, 3):
        a, b = c.evicted_since(since), p.evicted_since(since)
        assert (a[0].tolist(), a[1].tolist(), a[2]) == (b[0].tolist(), b[1].tolist(), b[2])
