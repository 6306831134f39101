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
Run the script on a build before a change to the store and after it to compare lookup and
update rates.

Memory: ``memory_bytes()`` of the full Cython store per row, against the raw bytes of a row
(4 * (dim + state width)); the growth of the process RSS while a second store is filled is
shown beside it as a check.

Usage: ``python load_tests/bench_store.py [--json PATH] [--rounds N] [--batches N]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Single-threaded means no idle BLAS/OpenMP worker threads spinning beside the timed loops.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from stream_persia.embedding.optim import Adagrad  # noqa: E402
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (medians are reported)")
    ap.add_argument("--batches", type=int, default=10,
                    help="batches per round for the Cython store and torch")
    ap.add_argument("--twin-batches", type=int, default=2,
                    help="batches per round for the Python twin")
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
    table = TorchTable(CAPACITY)
    tg = torch.from_numpy(grads)
    table.update(idxs[0], tg)  # warm-up of torch's kernels

    # Rounds interleave the three so that they share the machine's good and bad moments;
    # within a round each runs alone, on its own warm caches.
    timers = {"cython": Timer(), "python": Timer(), "torch": Timer()}
    stats0 = cstore.stats()
    version0 = getattr(cstore, "change_version", 0)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
