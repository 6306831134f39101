"""Internal shards: an embedding server's store on k threads against one, in this process.

The store work of ``bench_ingest.py``'s batches (1,024 samples x 26 ID slots, 1-5 ids each,
dim 16, uniform ids over ``--vocab`` per slot): pooled training lookups as the server
answers them, then the Adagrad update of every distinct id, on a store that has seen a few
rounds of batches first. The baseline is one ``EmbeddingStore`` (``store_threads: 1``),
timed in the same invocation on the same batches; each line prints its ratio to it. Wall
time is what a server's request waits; on a machine with fewer free cores than threads
there is nothing to gain, and the CPU column shows the cost of splitting::

    python load_tests/bench_store_threads.py [--threads 2 4] [--batches 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ingest import embedding_yaml, make_batches  # noqa: E402

from stream_persia.config import load_embedding_config  # noqa: E402
from stream_persia.embedding.data import PersiaBatch  # noqa: E402
from stream_persia.embedding.optim import Adagrad  # noqa: E402
from stream_persia.launch import memory as launch  # noqa: E402
from stream_persia.server.sharded import make_store  # noqa: E402
from stream_persia.worker import batchplan  # noqa: E402


def plan_rounds(args: argparse.Namespace) -> list[list[batchplan.PooledGroup]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "embedding_config.yml"
        path.write_text(embedding_yaml(args.slots, args.dim))
        schema = load_embedding_config(path)
    return [[batchplan.plan_batch(PersiaBatch.from_bytes(p).id_type_features, schema,
                                  requires_grad=False).pooled[args.dim]
             for p in make_batches(args.batches, args.batch_size, args.slots, args.vocab,
                                   seed=1000 + r)]
            for r in range(args.rounds)]


def measure(threads: int, rounds: list, args: argparse.Namespace) -> dict:
    store = make_store(1_000_000_000, Adagrad(), shards=threads)
    for groups in rounds[:-1]:        # fill the table: steady state, not start-up
        for g in groups:
            store.lookup(g.ids, args.dim, True)
    groups = rounds[-1]
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(len(g.ids), args.dim)).astype(np.float32) for g in groups]
    walls, cpus = {"lookup": [], "update": []}, {"lookup": [], "update": []}
    for _ in range(args.repeats):
        for name, run in (("lookup", lambda g, _: store.lookup_pooled(
                              g.ids, args.dim, g.index, g.offsets, True)),
                          ("update", lambda g, gr: store.update(g.ids, gr))):
            w0, c0 = time.perf_counter(), time.process_time()
            for g, gr in zip(groups, grads, strict=True):
                run(g, gr)
            walls[name].append((time.perf_counter() - w0) * 1000 / len(groups))
            cpus[name].append((time.process_time() - c0) * 1000 / len(groups))
    return {name: {"wall_ms_per_batch": statistics.median(walls[name]),
                   "cpu_ms_per_batch": statistics.median(cpus[name])} for name in walls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 4],
                   help="store_threads to compare with 1")
    p.add_argument("--batches", type=int, default=32, help="batches per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds; the last one is timed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--slots", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=100_000, help="distinct ids per slot")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if any(t < 2 for t in args.threads) or args.rounds < 2 or args.repeats < 1:
        p.error("--threads must be >= 2, --rounds >= 2 and --repeats >= 1")
    launch.keep_freed_memory()   # as the roles do: no page faults on every batch's buffers
    rounds = plan_rounds(args)
    results = {1: measure(1, rounds, args)}
    for t in args.threads:
        results[t] = measure(t, rounds, args)
    print(f"store work per batch of {args.batch_size} x {args.slots} slots "
          f"({os.cpu_count()} cores here)")
    print(f"{'threads':>8}{'op':>8}{'wall ms':>10}{'cpu ms':>9}{'speed-up':>10}")
    for t, r in results.items():
        for name, fig in r.items():
            ratio = results[1][name]["wall_ms_per_batch"] / fig["wall_ms_per_batch"]
            fig["speedup_vs_1_thread"] = ratio
            print(f"{t:>8}{name:>8}{fig['wall_ms_per_batch']:>10.2f}"
                  f"{fig['cpu_ms_per_batch']:>9.2f}{ratio:>9.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": {k: v for k, v in vars(args).items()
                                                          if k != "json"},
                                               "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
