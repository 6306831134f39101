"""Benchmark of the embedding store: Cython vs its pure-Python twin vs a dense torch table.

Single thread, dim 16, Adagrad, capacity 1M rows, ids Zipf(1.1)-distributed over 10M values
(rank k drawn with probability ∝ k^-1.1, mapped to a u64 id by a hash), batches of 65,536.
The stores are first filled to capacity with training lookups, so the timed batches run in
steady state (hits, misses, admissions and evictions). Each timed batch is a training
lookup followed by an update with the same ids. Figures are medians over rounds that
interleave the three implementations, in ids per second of the calling thread's CPU time.

Baseline: a preallocated torch table of 1M rows (weights + Adagrad accumulator) indexed by
``rank % 1M``: ``index_select`` for lookup; for update, ``index_add_`` sums duplicate ids into
a dense gradient buffer, then Adagrad runs on the touched rows. It is the ceiling with no
hashing and no eviction.

Change tracking (issue 18): after the timed rounds, the Cython store's
``changed_since`` passes over the whole store in chunks of 65,536 (a serving replica's
pass): the rows changed during the timed rounds, then a pass that finds nothing; each is
reported with its total time and its longest ``next()`` (the longest pause training sees).
Before the timed rounds a pass reads the store (from then on it keeps its dirty list, as
a publishing server's does). Run the script on a build before a change to the store and
after it to compare lookup and
update rates, or give ``--old-build PATH`` (a copy of an earlier ``_cstore*.so``): after
the rounds, a store of each build (loaded with the same rows) runs the same batches in
turn, each build first every other batch, with a publisher's pass on both every 40
batches, and the median of the per-batch ratios new / old is reported (rates of a shared
machine drift by more than 10% between rounds; a pair of batches in turn drifts less).

Policies (issue 20, ``--policy-batches``, default 200; 0 skips it): two stores of this build
loaded with the same rows, one with a policy on every id (``min_count`` 2, ``ttl_s`` one
hour, ``max_rows`` 90% of the capacity, so the sketch, the per-policy lists and stamps and
the cap all work on each miss) and one without, run the same batches in turn as above,
with ``expire()`` on the policed one every 40 batches (the server calls it every second);
the median of the per-batch ratios policies on / off is reported (target >= 0.9).
``--policy ttl|cap|min_count`` puts only that part of the policy on.

Compact rows (issue 20, ``--dtype-batches``, default 200; 0 skips it): rows per GiB of a
store of ``CAPACITY`` distinct ids whose rows are float32, float16 and bfloat16 (a policy
with that ``dtype`` on every id), counted on ``memory_bytes()`` (everything) and on the
row storage of ``memory_breakdown()`` (weights and optimizer state), for this benchmark's
Adagrad at dim 16 and for SGD at dim 64 (no optimizer state: the most a 16-bit row can
save); then two stores loaded with the same rows, float16 and float32 (both with a
policy, so both admit through the policy path), run the same batches in turn as above,
and the median of the per-batch ratios float16 / float32 is reported.

Incremental pass (``--pass-rows``, default 4M rows; ``--pass-changed``, 50k): a publisher's
pass over a store of that many rows after that many rows changed (one update of distinct
stored ids) since its previous pass, in the feed's windows of 262,144 entries. The same
rows are read twice per round: by a pass from one version before the previous pass (older
than the store's mark, so a full scan of every entry: the cost before the dirty list) and
by the pass from the previous pass's version (the dirty list); the version in between
stamps no row, so both return the same rows. Medians over ``--pass-rounds`` rounds.

Memory: ``memory_bytes()`` of the full Cython store per row, against the raw bytes of a row
(4 * (dim + state width)); the growth of the process RSS while a second store is filled is
shown beside it as a check.

Usage: ``python load_tests/bench_store.py [--json PATH] [--rounds N] [--batches N]
[--old-build PATH] [--policy-batches N] [--policy all|ttl|cap|min_count] [--dtype-batches N] [--pass-rows N] [--pass-changed N] [--pass-rounds N]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable

# Single-threaded means no idle BLAS/OpenMP worker threads spinning beside the timed loops.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from stream_persia.core.embedding_config import SlotPolicy  # noqa: E402
from stream_persia.embedding.optim import SGD, Adagrad  # noqa: E402
from stream_persia.kernels.sharding import stable_hash64  # noqa: E402
from stream_persia.server._pystore import PyEmbeddingStore  # noqa: E402
from stream_persia.server.store import CEmbeddingStore  # noqa: E402

DIM, CAPACITY, UNIVERSE, BATCH = 16, 1_000_000, 10_000_000, 65_536
OPT = Adagrad(lr=1e-2)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ZipfIds:
    """Ranks 0..UNIVERSE-1 with P(k) ∝ (k+1)^-1.1, by inverse CDF."""

    def __init__(self, seed: int = 0):
        cdf = np.cumsum(np.arange(1, UNIVERSE + 1, dtype=np.float64) ** -1.1)
        self.cdf = cdf / cdf[-1]
        self.rng = np.random.default_rng(seed)

    def ranks(self, n: int) -> np.ndarray:
        return np.searchsorted(self.cdf, self.rng.random(n)).astype(np.int64)


class TorchTable:
    """Dense baseline: no hashing, no eviction, Adagrad with summed duplicate gradients."""

    def __init__(self, rows: int):
        self.w = torch.rand(rows, DIM) * 0.02 - 0.01
        self.acc = torch.full((rows, DIM), OPT.initial_accumulator_value)
        self.gbuf = torch.zeros(rows, DIM)
        self.touched = torch.zeros(rows, dtype=torch.bool)

    def lookup(self, idx: torch.Tensor) -> torch.Tensor:
        return self.w.index_select(0, idx)

    def update(self, idx: torch.Tensor, grads: torch.Tensor) -> None:
        self.gbuf.index_add_(0, idx, grads)
        self.touched[idx] = True
        rows = self.touched.nonzero().squeeze(1)
        g = self.gbuf.index_select(0, rows)
        a = self.acc.index_select(0, rows)
        w = self.w.index_select(0, rows)
        w -= OPT.lr * g / torch.sqrt(a + OPT.eps)
        a += g * g
        self.w.index_copy_(0, rows, w)
        self.acc.index_copy_(0, rows, a)
        self.gbuf.index_fill_(0, rows, 0.0)
        self.touched.index_fill_(0, rows, False)


class Timer:
    """Per-round throughput of one implementation (lookup and update timed separately).

    Time is the calling thread's CPU time: every implementation here runs in this one
    thread, and on a shared machine wall time would also count other processes.
    """

    def __init__(self):
        self.rounds: list[tuple[int, float, float]] = []

    def run(self, lookup, update, batches) -> None:
        t_lookup = t_update = 0.0
        for b in batches:
            t0 = time.thread_time()
            lookup(b)
            t1 = time.thread_time()
            update(b)
            t_update += time.thread_time() - t1
            t_lookup += t1 - t0
        self.rounds.append((len(batches) * BATCH, t_lookup, t_update))

    def rates(self) -> tuple[float, float]:
        """Median over rounds of ids/s, for lookup and for update."""
        return (float(np.median([n / tl for n, tl, _ in self.rounds])),
                float(np.median([n / tu for n, _, tu in self.rounds])))


def changes_pass(store, since: int) -> dict[str, float]:
    """Wall time of changed_since passes (chunks of 65,536) and of their longest next()."""
    out: dict[str, float] = {}
    for name, v in (("changed", since), ("unchanged", store.change_version)):
        rows, longest, it = 0, 0.0, store.changed_since(v, 65536)
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            chunk = next(it, None)
            longest = max(longest, time.perf_counter() - t)
            if chunk is None:
                break
            rows += len(chunk["ids"])
        out[f"{name}_pass_s"] = time.perf_counter() - t0
        out[f"{name}_max_pause_s"] = longest
        out[f"{name}_rows"] = rows
    return out


def load_old_build(path: str):
    """``CEmbeddingStore`` of another build of ``_cstore`` (a module of its own)."""
    spec = importlib.util.spec_from_file_location("stream_persia_old_build._cstore", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--old-build: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CEmbeddingStore


def paired(a, b, zipf: ZipfIds, grads: np.ndarray, n: int, key: str,
           every_40: Callable[[], object] | None = None) -> dict[str, float]:
    """Rates of store ``a`` / store ``b``: the same batch (a training lookup, then an
    update) on both in turn, each first every other batch, and ``every_40()`` after every
    40 batches; medians and quartiles of the per-batch ratios (rates of a shared machine
    drift by more than 10% between rounds; a pair of batches in turn drifts less)."""
    ratios: dict[str, list[float]] = {"lookup": [], "update": []}
    for i in range(n):
        batch = stable_hash64(zipf.ranks(BATCH).astype(np.uint64))
        t: dict[str, tuple[float, float]] = {}
        for name, store in (("a", a), ("b", b))[::1 if i % 2 else -1]:
            t0 = time.thread_time()
            store.lookup(batch, DIM, True)
            t1 = time.thread_time()
            store.update(batch, grads)
            t[name] = (t1 - t0, time.thread_time() - t1)
        ratios["lookup"].append(t["b"][0] / t["a"][0])
        ratios["update"].append(t["b"][1] / t["a"][1])
        if every_40 is not None and i % 40 == 39:
            every_40()
    out: dict[str, float] = {}
    for what, xs in ratios.items():
        q1, med, q3 = np.percentile(xs, [25, 50, 75])
        out.update({f"{what}_{key}": float(med), f"{what}_{key}_q1": float(q1),
                    f"{what}_{key}_q3": float(q3)})
    return out


def versus_old_build(new, old, zipf: ZipfIds, grads: np.ndarray, n: int) -> dict[str, float]:
    """Rates of this build / the old one (paired), with a publisher's pass on both every
    40 batches (the dirty list restarts)."""
    def passes() -> None:
        for store in (new, old):
            drain(store.changed_since(store.change_version - 40, 1 << 18))

    return {"old_build_batches": n, **paired(new, old, zipf, grads, n, "vs_old_build", passes)}


POLICY_PARTS = {
    "all": {"min_count": 2, "ttl_s": 3600.0, "max_rows": CAPACITY * 9 // 10},
    "ttl": {"ttl_s": 3600.0},
    "cap": {"max_rows": CAPACITY * 9 // 10},
    "min_count": {"min_count": 2},
}


def versus_policies(on, off, zipf: ZipfIds, grads: np.ndarray, n: int) -> dict[str, float]:
    """Rates with policies / without (paired), ``on.expire()`` every 40 batches; and the
    policed store's counters."""
    out: dict[str, float] = {"policy_batches": n,
                             **paired(on, off, zipf, grads, n, "policies_vs_none", on.expire)}
    out.update({f"policies_{k}": v for k, v in on.policy_stats()[0].items()})
    return out


def rows_per_gib(dim: int, opt, rows: int) -> dict[str, float]:
    """Rows per GiB of a store of ``rows`` distinct ids per row dtype, on all its bytes
    and on its row storage."""
    out: dict[str, float] = {}
    tag = f"{type(opt).__name__.lower()}_dim{dim}"
    ids = stable_hash64(np.arange(rows, dtype=np.uint64) + np.uint64(3 * UNIVERSE))
    for dtype in ("float32", "float16", "bfloat16"):
        s = CEmbeddingStore(rows, opt)
        s.set_policies(0, [SlotPolicy(dtype=dtype)])
        for i in range(0, rows, BATCH):
            s.lookup(ids[i:i + BATCH], dim, True)
        mem = s.memory_breakdown()
        out[f"{dtype}_rows_per_gib_{tag}"] = len(s) / (sum(mem.values()) / 2**30)
        out[f"{dtype}_row_storage_rows_per_gib_{tag}"] = len(s) / (mem["rows"] / 2**30)
        out[f"{dtype}_bookkeeping_bytes_per_row_{tag}"] = mem["bookkeeping"] / len(s)
        s.close()
    for dtype in ("float16", "bfloat16"):
        for what in ("rows_per_gib", "row_storage_rows_per_gib"):
            out[f"{dtype}_{what}_vs_float32_{tag}"] = (out[f"{dtype}_{what}_{tag}"]
                                                       / out[f"float32_{what}_{tag}"])
    return out


def drain(it) -> tuple[float, float, int]:
    """Wall time of a pass, its longest next(), and its rows."""
    rows, longest = 0, 0.0
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        chunk = next(it, None)
        longest = max(longest, time.perf_counter() - t)
        if chunk is None:
            return time.perf_counter() - t0, longest, rows
        rows += len(chunk["ids"])


def incremental_pass(rows: int, changed: int, rounds: int) -> dict[str, float]:
    """A pass over the rows changed since the previous one: full scan vs dirty list."""
    window = 1 << 18                                  # the update feed's CHUNK_ROWS
    store = CEmbeddingStore(rows, OPT)
    ids = stable_hash64(np.arange(rows, dtype=np.uint64) + np.uint64(2 * UNIVERSE))
    for i in range(0, rows, BATCH):
        store.lookup(ids[i:i + BATCH], DIM, True)
    drain(store.changed_since(0, window))             # the first pass: a full scan
    rng = np.random.default_rng(7)
    grads = (rng.standard_normal((changed, DIM)) * 0.01).astype(np.float32)
    missing = np.array([1], np.uint64)                # never stored (ids are hashes)
    full: list[tuple[float, float, int]] = []
    fast: list[tuple[float, float, int]] = []
    for _ in range(rounds):
        store.remove(missing)                         # a version that stamps no row
        base = store.change_version
        drain(store.changed_since(base, window))      # the previous pass, from base
        store.update(rng.choice(ids, changed, replace=False), grads)
        full.append(drain(store.changed_since(base - 1, window)))
        fast.append(drain(store.changed_since(base, window)))
        if full[-1][2] != fast[-1][2] or fast[-1][2] != changed:
            raise SystemExit(f"incremental pass: {fast[-1][2]} rows, full scan "
                             f"{full[-1][2]}, expected {changed}")
    store.close()

    def med(xs: list[tuple[float, float, int]], k: int) -> float:
        return float(np.median([x[k] for x in xs]))

    return {"pass_store_rows": rows, "pass_changed_rows": changed,
            "pass_full_scan_s": med(full, 0), "pass_full_scan_max_pause_s": med(full, 1),
            "pass_incremental_s": med(fast, 0), "pass_incremental_max_pause_s": med(fast, 1),
            "pass_full_scan_vs_incremental": med(full, 0) / med(fast, 0)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (medians are reported)")
    ap.add_argument("--batches", type=int, default=10,
                    help="batches per round for the Cython store and torch")
    ap.add_argument("--twin-batches", type=int, default=2,
                    help="batches per round for the Python twin")
    ap.add_argument("--old-build", help="an earlier _cstore*.so to compare rates with")
    ap.add_argument("--old-batches", type=int, default=200,
                    help="batches each build runs, alternating, for the comparison")
    ap.add_argument("--policy-batches", type=int, default=200,
                    help="batches each store runs, alternating, with policies on and off")
    ap.add_argument("--dtype-batches", type=int, default=200,
                    help="batches each store runs, alternating, with float16 and float32 rows")
    ap.add_argument("--policy", choices=sorted(POLICY_PARTS), default="all",
                    help="the policy of --policy-batches (default: all its parts)")
    ap.add_argument("--pass-rows", type=int, default=4_000_000,
                    help="rows of the store of the incremental pass (0: skip it)")
    ap.add_argument("--pass-changed", type=int, default=50_000,
                    help="rows changed before the incremental pass")
    ap.add_argument("--pass-rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    zipf = ZipfIds()
    rng = np.random.default_rng(1)
    grads = (rng.standard_normal((BATCH, DIM)) * 0.01).astype(np.float32)

    print("filling the Cython store to capacity ...", file=sys.stderr)
    cstore = CEmbeddingStore(CAPACITY, OPT)
    t0 = time.perf_counter()
    fill_ids = 0
    while len(cstore) < CAPACITY:
        cstore.lookup(stable_hash64(zipf.ranks(BATCH).astype(np.uint64)), DIM, True)
        fill_ids += BATCH
    fill_s = time.perf_counter() - t0
    raw = 4 * (DIM + OPT.state_width(DIM))
    mem_per_row = cstore.memory_bytes() / len(cstore)
    # As a check on memory_bytes(): the process's RSS growth while a second store is filled
    # with CAPACITY distinct ids (generated beforehand, so that only the store grows).
    fresh = stable_hash64(np.arange(CAPACITY, dtype=np.uint64) + np.uint64(UNIVERSE))
    rss0 = rss_bytes()
    other = CEmbeddingStore(CAPACITY, OPT)
    for i in range(0, CAPACITY, BATCH):
        other.lookup(fresh[i:i + BATCH], DIM, True)
    rss_per_row = (rss_bytes() - rss0) / len(other)
    del other, fresh

    n_c = args.rounds * args.batches
    ranks = [zipf.ranks(BATCH) for _ in range(n_c)]
    batches = [stable_hash64(r.astype(np.uint64)) for r in ranks]
    idxs = [torch.from_numpy(r % CAPACITY) for r in ranks]

    print("copying it into the Python twin ...", file=sys.stderr)
    pystore = PyEmbeddingStore(CAPACITY, OPT)
    pystore.load(cstore.dump())
    old_store = None
    if args.old_build:
        old_store = load_old_build(args.old_build)(CAPACITY, OPT)
        old_store.load(cstore.dump())
        cstore_copy = CEmbeddingStore(CAPACITY, OPT)   # the new build, loaded the same way
        cstore_copy.load(cstore.dump())
        cstore.close()
        cstore = cstore_copy
    table = TorchTable(CAPACITY)
    tg = torch.from_numpy(grads)
    table.update(idxs[0], tg)  # warm-up of torch's kernels

    # Rounds interleave the three so that they share the machine's good and bad moments;
    # within a round each runs alone, on its own warm caches.
    timers = {"cython": Timer(), "python": Timer(), "torch": Timer()}
    stats0 = cstore.stats()
    version0 = getattr(cstore, "change_version", 0)
    for store in (cstore, old_store):   # a publisher reads them: the dirty list is kept
        if store is not None and hasattr(store, "changed_since"):
            drain(store.changed_since(version0))
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds} ...", file=sys.stderr)
        mine = slice(r * args.batches, (r + 1) * args.batches)
        timers["cython"].run(lambda b: cstore.lookup(b, DIM, True),
                             lambda b: cstore.update(b, grads), batches[mine])
        timers["torch"].run(table.lookup, lambda i: table.update(i, tg), idxs[mine])
        twin = batches[r * args.twin_batches:(r + 1) * args.twin_batches]
        timers["python"].run(lambda b: pystore.lookup(b, DIM, True),
                             lambda b: pystore.update(b, grads), twin)
    c_lookup, c_update = timers["cython"].rates()
    p_lookup, p_update = timers["python"].rates()
    t_lookup, t_update = timers["torch"].rates()

    stats = cstore.stats()
    tracking = changes_pass(cstore, version0) if hasattr(cstore, "changed_since") else {}
    if old_store is not None:
        print("this build against the old one ...", file=sys.stderr)
        tracking.update(versus_old_build(cstore, old_store, zipf, grads, args.old_batches))
        old_store.close()
    if args.policy_batches:
        print("policies on against off ...", file=sys.stderr)
        on, off = CEmbeddingStore(CAPACITY, OPT), CEmbeddingStore(CAPACITY, OPT)
        on.load(cstore.dump())
        off.load(cstore.dump())
        on.set_policies(0, [SlotPolicy(**POLICY_PARTS[args.policy])])
        tracking.update(versus_policies(on, off, zipf, grads, args.policy_batches))
        on.close()
        off.close()
    if args.dtype_batches:
        print("compact rows: rows per GiB, float16 against float32 ...", file=sys.stderr)
        tracking.update(rows_per_gib(DIM, OPT, CAPACITY))
        tracking.update(rows_per_gib(64, SGD(lr=1e-2), CAPACITY))
        half, full = CEmbeddingStore(CAPACITY, OPT), CEmbeddingStore(CAPACITY, OPT)
        half.set_policies(0, [SlotPolicy(dtype="float16")])
        full.set_policies(0, [SlotPolicy(admit_probability=1.0)])   # the same policy path
        half.load(cstore.dump())
        full.load(cstore.dump())
        tracking.update(paired(half, full, zipf, grads, args.dtype_batches, "fp16_vs_fp32"))
        tracking["dtype_batches"] = args.dtype_batches
        half.close()
        full.close()
    if args.pass_rows:
        print(f"incremental pass over {args.pass_rows:,} rows ...", file=sys.stderr)
        tracking.update(incremental_pass(args.pass_rows, args.pass_changed, args.pass_rounds))
    res = {
        "cython_lookup_ids_per_s": c_lookup, "cython_update_ids_per_s": c_update,
        "twin_lookup_ids_per_s": p_lookup, "twin_update_ids_per_s": p_update,
        "torch_lookup_ids_per_s": t_lookup, "torch_update_ids_per_s": t_update,
        "lookup_vs_twin": c_lookup / p_lookup, "update_vs_twin": c_update / p_update,
        "lookup_vs_torch": c_lookup / t_lookup, "update_vs_torch": c_update / t_update,
        "bytes_per_row": mem_per_row, "raw_bytes_per_row": raw,
        "bytes_per_row_over_raw": mem_per_row / raw, "rss_bytes_per_row_over_raw": rss_per_row / raw,
        "fill_ids_per_s": fill_ids / fill_s, "rows": len(cstore),
        "steady_state_miss_rate": ((stats["misses"] - stats0["misses"])
                                   / (stats["lookups"] - stats0["lookups"])),
        "rounds": args.rounds, "timing": "median over rounds of ids per CPU-second",
        **tracking,
    }
    print(f"{'':10}{'lookup ids/s':>16}{'update ids/s':>16}")
    for name, lk, up in (("cython", c_lookup, c_update), ("python", p_lookup, p_update),
                         ("torch", t_lookup, t_update)):
        print(f"{name:10}{lk:16,.0f}{up:16,.0f}")
    print(f"cython / python twin: lookup {res['lookup_vs_twin']:.1f}x, "
          f"update {res['update_vs_twin']:.1f}x   (target >= 30x)")
    print(f"cython / torch dense: lookup {res['lookup_vs_torch']:.2f}x, "
          f"update {res['update_vs_torch']:.2f}x   (target >= 0.33x)")
    print(f"memory: {mem_per_row:.1f} B/row allocated, {rss_per_row:.1f} B/row RSS growth, "
          f"raw {raw} B/row -> {res['bytes_per_row_over_raw']:.2f}x   (target <= 1.5x)")
    print(f"miss rate while timed: {res['steady_state_miss_rate']:.3f}; "
          f"{len(cstore):,} rows")
    if tracking:
        print(f"changed_since pass over {len(cstore):,} rows: {tracking['changed_rows']:,} "
              f"changed rows in {tracking['changed_pass_s'] * 1e3:.0f} ms (longest next() "
              f"{tracking['changed_max_pause_s'] * 1e3:.2f} ms); nothing changed: "
              f"{tracking['unchanged_pass_s'] * 1e3:.1f} ms (longest next() "
              f"{tracking['unchanged_max_pause_s'] * 1e3:.2f} ms)")
    if old_store is not None:
        print(f"this build / old build ({args.old_build}), median of {args.old_batches} "
              f"alternated batches (quartiles): lookup {res['lookup_vs_old_build']:.3f}x "
              f"({res['lookup_vs_old_build_q1']:.2f}-{res['lookup_vs_old_build_q3']:.2f}), "
              f"update {res['update_vs_old_build']:.3f}x ({res['update_vs_old_build_q1']:.2f}"
              f"-{res['update_vs_old_build_q3']:.2f})")
    if args.policy_batches:
        print(f"policies on ({args.policy}: {POLICY_PARTS[args.policy]}) / off, median of "
              f"{args.policy_batches} alternated batches (quartiles): lookup "
              f"{res['lookup_policies_vs_none']:.3f}x ({res['lookup_policies_vs_none_q1']:.2f}"
              f"-{res['lookup_policies_vs_none_q3']:.2f}), update "
              f"{res['update_policies_vs_none']:.3f}x ({res['update_policies_vs_none_q1']:.2f}"
              f"-{res['update_policies_vs_none_q3']:.2f})   (target >= 0.9x); policy counters "
              f"{ {k[9:]: v for k, v in res.items() if k.startswith('policies_')} }")
    if args.dtype_batches:
        for tag in ("adagrad_dim16", "sgd_dim64"):
            print(f"rows per GiB ({tag}): " + ", ".join(
                f"{dt} {res[f'{dt}_rows_per_gib_{tag}']:,.0f} total / "
                f"{res[f'{dt}_row_storage_rows_per_gib_{tag}']:,.0f} row storage"
                for dt in ("float32", "float16", "bfloat16"))
                + f"; float16 / float32: {res[f'float16_rows_per_gib_vs_float32_{tag}']:.2f}x "
                f"total, {res[f'float16_row_storage_rows_per_gib_vs_float32_{tag}']:.2f}x "
                f"row storage; bookkeeping "
                f"{res[f'float32_bookkeeping_bytes_per_row_{tag}']:.1f} B/row")
        print(f"float16 rows / float32 rows, median of {args.dtype_batches} alternated "
              f"batches (quartiles): lookup {res['lookup_fp16_vs_fp32']:.3f}x "
              f"({res['lookup_fp16_vs_fp32_q1']:.2f}-{res['lookup_fp16_vs_fp32_q3']:.2f}), "
              f"update {res['update_fp16_vs_fp32']:.3f}x ({res['update_fp16_vs_fp32_q1']:.2f}"
              f"-{res['update_fp16_vs_fp32_q3']:.2f})")
    if args.pass_rows:
        print(f"incremental pass, {res['pass_changed_rows']:,} of {res['pass_store_rows']:,} "
              f"rows changed: full scan {res['pass_full_scan_s'] * 1e3:.1f} ms (longest next() "
              f"{res['pass_full_scan_max_pause_s'] * 1e3:.2f} ms), dirty list "
              f"{res['pass_incremental_s'] * 1e3:.1f} ms (longest next() "
              f"{res['pass_incremental_max_pause_s'] * 1e3:.2f} ms) -> "
              f"{res['pass_full_scan_vs_incremental']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
