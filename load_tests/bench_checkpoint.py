"""Incremental checkpoints (issue 21): a patch's bytes and time against a full checkpoint's,
and training throughput while checkpoints are taken every 10 s against none.

Setup: one embedding server as a process of its own (``stream-persia launch
embedding-server``, real loopback socket, Adagrad, dim 16, capacity ``--rows``), filled
with ``--rows`` rows (default 5M) by training lookups; this process writes the checkpoints
(:class:`stream_persia.checkpoint.CheckpointWriter`, as NN rank 0 does: the server dumps
its shard into the checkpoint directory; a dense state of about 1 MB beside it) and
trains through the server (``ShardRouter`` lookups and updates, as an embedding worker
does).

1. **Patch vs full** (``--rounds``, default 3, after one warm-up round): each round
   changes ``--changed`` of the rows (default 1%: 4/5 of them updates of stored rows, 1/5
   new ids, which evict as many: tombstones), then writes, in alternating order, a full
   checkpoint and a patch of the same state whose parent is the previous round's full
   checkpoint (so it holds exactly that round's changes). Reported: bytes (every file of
   the checkpoint) and seconds (from the writer's creation to its commit), and the
   medians of the per-round ratios ``patch_bytes_vs_full`` (target <= 0.05) and
   ``patch_seconds_vs_full`` (target <= 0.1).
2. **Training while checkpointing** (``--train-s`` seconds per run, default 40;
   ``--repeat`` pairs, default 2, off and on in alternating order): a training loop of
   lookup + update batches (``--batch`` ids, default 16,384: stored ids drawn by rank with
   a Zipf(1.2) law, and 2% new ones) for a fixed time, once without checkpoints and once
   with one every ``--every-s`` seconds (default 10) taken at a batch boundary with
   nothing in flight (training waits for it, as the consistent cut makes it), each a
   patch of the previous one and a full base every ``--full-every`` (default 8) patches,
   as ``enable_incremental_update`` makes periodic checkpoints. The chain's base is taken
   before the timed run (a job's chain goes on across it); ``amortized_pause_fraction``
   adds a base's cost back: (full_every x patch seconds + full seconds) / ((full_every +
   1) x every_s), from the figures of part 1. Reported: batches/s of each run, the rows
   of each patch, the median of the per-pair ratios ``train_while_checkpointing_vs_off``
   (target >= 0.9), and ``checkpoint_pause_fraction``, the median share of a run with
   checkpoints that training waited for them (1 minus it is what the ratio would be
   without the drift between two runs).

Wall-clock figures of a shared 2-core machine drift; the ratios pair runs taken in turn.
Run: ``python load_tests/bench_checkpoint.py [--rows 5000000] [--changed 0.01]
[--rounds 3] [--train-s 40] [--every-s 10] [--repeat 2] [--json out.json]``
(``--rows 200000 --train-s 5 --every-s 2`` for a quick run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stream_persia.checkpoint import CheckpointWriter, Manifest, chain_of
from stream_persia.launch.processes import RoleProcess
from stream_persia.worker.router import ShardRouter
from stream_persia.worker.shards import RowLookup, UpdateGroup

DIM = 16
FILL_CHUNK = 200_000
ZIPF = 1.2   # training draws stored ids by rank k with probability ~ k^-1.2


def dense_state() -> dict[str, torch.Tensor]:
    """About 1 MB of dense parameters (an MLP's), written into every checkpoint."""
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(416, 512, generator=g), "w2": torch.randn(512, 128, generator=g)}


class Bench:
    def __init__(self, router: ShardRouter, root: Path, rows: int, seed: int = 0):
        self.router, self.root, self.rows = router, root, rows
        self.rng = np.random.default_rng(seed)
        self.ids = np.arange(1, rows + 1, dtype=np.uint64)   # the stored ids
        self.next_new = rows + 1
        self.dense = dense_state()
        self.n = 0

    async def fill(self) -> None:
        for i in range(0, self.rows, FILL_CHUNK):
            await self.router.lookup([RowLookup(DIM, self.ids[i:i + FILL_CHUNK])], "train")

    async def step(self, ids: np.ndarray) -> None:
        await self.router.lookup([RowLookup(DIM, ids)], "train")
        grads = self.rng.normal(size=(ids.size, DIM)).astype(np.float32) * 0.01
        await self.router.update([UpdateGroup(DIM, ids, grads)])

    def _new_ids(self, n: int) -> np.ndarray:
        new = np.arange(self.next_new, self.next_new + n, dtype=np.uint64)
        self.next_new += n
        return new

    async def change(self, fraction: float) -> None:
        """Change ``fraction`` of the rows: 4/5 updates of stored ids, 1/5 new ids."""
        total = int(self.rows * fraction)
        old = self.rng.choice(self.ids, size=total - total // 5, replace=False)
        mixed = np.concatenate([old, self._new_ids(total // 5)])
        for i in range(0, mixed.size, FILL_CHUNK):
            await self.step(np.ascontiguousarray(mixed[i:i + FILL_CHUNK]))

    async def checkpoint(self, parent: Manifest | None) -> tuple[Manifest, float, int]:
        self.n += 1
        began = time.perf_counter()
        with CheckpointWriter(str(self.root / f"ck-{self.n:05d}")) as w:
            w.write_torch("dense.pt", self.dense)
            await w.dump_embeddings(self.router.clients, parent=parent)
            m = w.commit(job="bench", step=self.n, offsets={}, stream="direct")
        took = time.perf_counter() - began
        return m, took, sum(int(f["bytes"]) for f in m.files.values())

    def drop(self, *keep: Manifest) -> None:
        """Delete every checkpoint but ``keep`` (disk: a full one is ~0.7 GB at 5M rows)."""
        names = {Path(m.path or "").name for m in keep}
        for p in self.root.iterdir():
            if p.name.startswith("ck-") and p.name not in names:
                shutil.rmtree(p)

    async def train(self, seconds: float, every_s: float | None, full_every: int,
                    batch: int) -> dict[str, Any]:
        parent: Manifest | None = None
        if every_s:   # the job's chain goes on: its base was taken before this run
            parent, _, _ = await self.checkpoint(None)
        depth = 0
        batches = checkpoints = 0
        paused = 0.0
        patch_rows: list[int] = []
        start = time.perf_counter()
        next_ck = start + every_s if every_s else None
        while (now := time.perf_counter()) - start < seconds:
            if next_ck is not None and now >= next_ck:
                use = parent if parent is not None and depth < full_every else None
                m, took, _ = await self.checkpoint(use)
                assert m.chain is not None
                depth = m.chain["depth"]
                parent = m
                patch_rows.append(m.rows)
                self.drop(*chain_of(m.path or ""))
                checkpoints += 1
                paused += took
                next_ck = now + every_s   # the cut holds training still meanwhile
                continue
            new = self._new_ids(batch // 50)
            hot = (self.rng.zipf(ZIPF, size=batch - new.size) - 1) % self.rows
            ids = np.concatenate([self.ids[hot], new])
            await self.step(np.unique(ids))
            batches += 1
        elapsed = time.perf_counter() - start
        return {"batches_per_s": batches / elapsed, "batches": batches,
                "checkpoints": checkpoints, "checkpoint_s": paused, "seconds": elapsed,
                "rows_per_checkpoint": patch_rows}


async def run(args: argparse.Namespace, address: str, root: Path) -> dict[str, Any]:
    router = ShardRouter([address], timeout_ms=600_000)
    bench = Bench(router, root, args.rows)
    try:
        t = time.perf_counter()
        await bench.fill()
        fill_s = time.perf_counter() - t
        rounds = []
        prev, _, _ = await bench.checkpoint(None)
        for r in range(args.rounds + 1):   # round 0 warms up (the first pass scans)
            await bench.change(args.changed)
            order = ("patch", "full") if r % 2 else ("full", "patch")
            got: dict[str, tuple[Manifest, float, int]] = {}
            for kind in order:
                got[kind] = await bench.checkpoint(prev if kind == "patch" else None)
            patch, full = got["patch"], got["full"]
            assert patch[0].chain is not None and patch[0].chain["depth"] == 1, \
                patch[0].chain
            if r:
                rounds.append({"full_bytes": full[2], "full_s": full[1],
                               "patch_bytes": patch[2], "patch_s": patch[1],
                               "patch_rows": patch[0].rows,
                               "tombstones": sum(patch[0].files[t]["rows"] for t in
                                                 patch[0].chain["tombstone_files"])})
            prev = full[0]
            bench.drop(prev)
        pairs = []
        for r in range(args.repeat):
            out = {}
            for kind in (("off", "on") if r % 2 == 0 else ("on", "off")):
                out[kind] = await bench.train(args.train_s,
                                              args.every_s if kind == "on" else None,
                                              args.full_every, args.batch)
                bench.drop()
            pairs.append(out)
    finally:
        await router.close()
    full_s = statistics.median(x["full_s"] for x in rounds)
    patch_s = statistics.median(x["patch_s"] for x in rounds)
    return {
        "rows": args.rows, "changed": args.changed, "fill_s": fill_s,
        # the share of time a job checkpointing every every_s spends in checkpoints, its
        # base every full_every patches included, from the round medians
        "amortized_pause_fraction": (args.full_every * patch_s + full_s)
        / ((args.full_every + 1) * args.every_s),
        "patch_bytes_vs_full": statistics.median(x["patch_bytes"] / x["full_bytes"]
                                                 for x in rounds),
        "patch_seconds_vs_full": statistics.median(x["patch_s"] / x["full_s"]
                                                   for x in rounds),
        "train_while_checkpointing_vs_off": statistics.median(
            p["on"]["batches_per_s"] / p["off"]["batches_per_s"] for p in pairs),
        # the share of each run with checkpoints that training waited for them (what the
        # ratio above measures, without the drift between two runs of a shared machine)
        "checkpoint_pause_fraction": statistics.median(
            p["on"]["checkpoint_s"] / p["on"]["seconds"] for p in pairs),
        "targets": {"patch_bytes_vs_full": "<= 0.05", "patch_seconds_vs_full": "<= 0.1",
                    "train_while_checkpointing_vs_off": ">= 0.9"},
        "rounds": rounds, "training": pairs,
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-s", type=float, default=40.0)
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--full-every", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16_384)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.rows < 1000 or not 0 < args.changed < 0.5 or args.rounds < 1 or args.repeat < 1:
        parser.error("--rows >= 1000, 0 < --changed < 0.5, --rounds >= 1, --repeat >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    server = RoleProcess("embedding-server",
                         ["--checkpoint-root", str(tmp), "--capacity", str(args.rows)],
                         log_path=tmp / "server.log")
    try:
        server.start()
        address = server.wait_ready(60)
        (tmp / "ck").mkdir()
        result = asyncio.run(run(args, address, tmp / "ck"))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
