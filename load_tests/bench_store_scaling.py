"""How the embedding store scales: lookups and updates per second, and bytes per row, as the
table grows (1M to 50M rows by default), so that a user can size embedding servers.

For each size ``R`` (``--sizes``, capped by ``--max-rows``) a fresh Cython store
(``CEmbeddingStore``, capacity ``R``, dim ``--dim``, the ``--optimizer`` on the rows) is
filled with ``R`` distinct ids by training lookups in batches of ``--batch``; then
``--batches`` timed batches, each a training lookup followed by an update of the same ids
(gradients of the batch's shape, as a server gets them), are drawn two ways:

- ``zipf``: popularity ranks over the ``R`` stored ids with P(k) ∝ (k+1)^-1.1 (hot rows stay
  in the CPU's caches, as in real traffic);
- ``uniform``: every stored id alike (the worst case for caches: nearly every id a miss).

Every id of a timed batch is stored, so these are the hit paths (an id not stored costs an
insert, the fill's rate). Rates are ids per second of the calling thread's CPU time
(single thread, as ``bench_store.py``), medians over ``--rounds`` rounds of the timed
batches. Memory: ``memory_bytes()`` per row (what the store counts: rows, optimizer state,
ids, links, table) and the process's RSS growth per row while the store filled, as a check.

Memory needed: about ``bytes_per_row × R`` (~180 B/row at dim 16 with Adagrad, ~9 GiB at
50M). Before each size the benchmark predicts it from the size before and skips sizes whose
store would pass ``--max-gib`` (default 8), saying so; ``--max-rows`` caps the sizes
outright.

Usage: ``python load_tests/bench_store_scaling.py [--sizes 1e6 2e6 ...] [--max-rows 1e7]
[--max-gib 8] [--dim 16] [--optimizer adagrad|adagrad_rowwise|sgd] [--json PATH]``.
JSON: ``curve`` (one entry per size: ``rows``, ``bytes_per_row``, ``rss_bytes_per_row``,
``fill_ids_per_s``, ``zipf_lookup_ids_per_s``, ``zipf_update_ids_per_s``,
``uniform_lookup_ids_per_s``, ``uniform_update_ids_per_s``), ``skipped`` (sizes left out
and why), and the largest size's figures against the smallest's
(``lookup_50m_vs_1m``-style keys are not fixed: ``largest_vs_smallest`` holds them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from stream_persia.config import flags  # noqa: E402
from stream_persia.embedding.optim import SGD, Adagrad  # noqa: E402
from stream_persia.kernels.sharding import stable_hash64  # noqa: E402
from stream_persia.server.store import CEmbeddingStore  # noqa: E402

SIZES = (1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000)
OPTIMIZERS = {"adagrad": lambda: Adagrad(lr=1e-2),
              "adagrad_rowwise": lambda: Adagrad(lr=1e-2, vectorwise_shared=True),
              "sgd": lambda: SGD(lr=1e-2)}
ZIPF_S = 1.1
OFFSET = np.uint64(0x5EED)     # ids are hashes of (rank + OFFSET): random-looking u64s


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: an argparse type: a whole number >= 1 (``1e6`` and ``1_000_000`` work)
size = flags.size(1)


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def ids_of(ranks: np.ndarray) -> np.ndarray:
    return stable_hash64(ranks.astype(np.uint64) + OFFSET)


def zipf_ranks(rng: np.random.Generator, n: int, rows: int) -> np.ndarray:
    """Ranks in [0, rows) with P(k) ∝ (k+1)^-ZIPF_S (continuous inverse CDF, floored: no
    table of ``rows`` probabilities)."""
    a = 1.0 - ZIPF_S
    x = (1.0 + rng.random(n) * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)


def timed(store: CEmbeddingStore, batches: list[np.ndarray], grads: np.ndarray, dim: int,
          rounds: int) -> tuple[float, float]:
    """Median over rounds of (lookup ids/s, update ids/s) of thread CPU time."""
    per_round = max(1, len(batches) // rounds)
    look, upd = [], []
    for r in range(rounds):
        tl = tu = 0.0
        n = 0
        for b in batches[r * per_round:(r + 1) * per_round]:
            t0 = time.thread_time()
            store.lookup(b, dim, True)
            t1 = time.thread_time()
            store.update(b, grads)
            tu += time.thread_time() - t1
            tl += t1 - t0
            n += len(b)
        look.append(n / max(tl, 1e-9))
        upd.append(n / max(tu, 1e-9))
    return float(np.median(look)), float(np.median(upd))


def measure(rows: int, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(rows)
    grads = (rng.standard_normal((args.batch, args.dim)) * 0.01).astype(np.float32)
    rss0 = rss_bytes()
    store = CEmbeddingStore(rows, OPTIMIZERS[args.optimizer]())
    t0 = time.perf_counter()
    c0 = time.thread_time()
    for lo in range(0, rows, args.batch):
        # ids made per batch: only the store grows with the size
        store.lookup(ids_of(np.arange(lo, min(rows, lo + args.batch))), args.dim, True)
    fill_cpu = time.thread_time() - c0
    fill_wall = time.perf_counter() - t0
    if len(store) != rows:
        raise RuntimeError(f"filled {len(store)} rows, expected {rows}")
    out: dict[str, float] = {
        "rows": rows, "bytes_per_row": store.memory_bytes() / rows,
        "rss_bytes_per_row": (rss_bytes() - rss0) / rows,
        "fill_ids_per_s": rows / max(fill_cpu, 1e-9), "fill_wall_s": fill_wall}
    n = args.rounds * args.batches
    for name, draw in (("zipf", lambda: zipf_ranks(rng, args.batch, rows)),
                       ("uniform", lambda: rng.integers(0, rows, args.batch))):
        batches = [ids_of(draw()) for _ in range(n)]
        lookup, update = timed(store, batches, grads, args.dim, args.rounds)
        out[f"{name}_lookup_ids_per_s"] = lookup
        out[f"{name}_update_ids_per_s"] = update
    stats = store.stats()
    if stats.get("evictions", 0):
        raise RuntimeError(f"the store evicted rows ({stats}): the timed batches were not all "
                           "hits")
    store.close()
    del store
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=size, nargs="+", default=list(SIZES),
                    help="table sizes in rows (default 1M 2M 5M 10M 20M 50M)")
    ap.add_argument("--max-rows", type=size, default=max(SIZES),
                    help="leave out sizes above this many rows")
    ap.add_argument("--max-gib", type=positive, default=8.0,
                    help="skip a size whose store is predicted to need more memory (GiB)")
    ap.add_argument("--dim", type=size, default=16, help="embedding dim of every row")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad",
                    help="the rows' optimizer (its state is part of each row)")
    ap.add_argument("--batch", type=size, default=65_536, help="ids per batch")
    ap.add_argument("--batches", type=size, default=8, help="timed batches per round")
    ap.add_argument("--rounds", type=size, default=3, help="timing rounds (medians)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if CEmbeddingStore is None:
        raise SystemExit("the Cython store is not built (python setup.py build_ext --inplace)")

    curve: list[dict[str, float]] = []
    skipped: list[dict[str, object]] = []
    bytes_per_row = None
    for rows in sorted(set(args.sizes)):
        if rows > args.max_rows:
            skipped.append({"rows": rows, "why": f"--max-rows {args.max_rows}"})
            continue
        if bytes_per_row is not None:
            need = bytes_per_row * rows * 1.1 / 2**30
            if need > args.max_gib:
                skipped.append({"rows": rows, "why": f"needs ~{need:.1f} GiB > --max-gib "
                                                     f"{args.max_gib:g}"})
                print(f"{rows:>11,} rows: skipped, ~{need:.1f} GiB > --max-gib "
                      f"{args.max_gib:g}", file=sys.stderr)
                continue
        print(f"{rows:>11,} rows: filling ...", file=sys.stderr, flush=True)
        fig = measure(rows, args)
        bytes_per_row = fig["bytes_per_row"]
        curve.append(fig)
        print(f"{rows:>11,} rows: {fig['bytes_per_row']:6.1f} B/row (RSS "
              f"{fig['rss_bytes_per_row']:6.1f}), fill {fig['fill_ids_per_s'] / 1e6:5.2f} M/s; "
              f"zipf lookup {fig['zipf_lookup_ids_per_s'] / 1e6:5.2f} M/s update "
              f"{fig['zipf_update_ids_per_s'] / 1e6:5.2f} M/s; uniform lookup "
              f"{fig['uniform_lookup_ids_per_s'] / 1e6:5.2f} M/s update "
              f"{fig['uniform_update_ids_per_s'] / 1e6:5.2f} M/s", file=sys.stderr, flush=True)
    if not curve:
        raise SystemExit("no size measured: every size was above --max-rows or --max-gib")
    small, large = curve[0], curve[-1]
    rates = [k for k in small if k.endswith("_ids_per_s")]
    result = {
        "benchmark": "store_scaling", "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(), "dim": args.dim, "optimizer": args.optimizer,
        "batch": args.batch, "batches": args.batches, "rounds": args.rounds,
        "zipf_s": ZIPF_S, "curve": [{k: (round(v, 1) if isinstance(v, float) else v)
                                     for k, v in fig.items()} for fig in curve],
        "skipped": skipped,
        "largest_vs_smallest": {"rows": [small["rows"], large["rows"]],
                                **{k: round(large[k] / small[k], 3) for k in rates},
                                "bytes_per_row": round(large["bytes_per_row"]
                                                       / small["bytes_per_row"], 3)},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
