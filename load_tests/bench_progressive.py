"""The cost of progressive validation: training samples/s with it on against off.

Same pipeline as ``load_tests/bench_train.py`` (whose training run it reuses):
a data loader process → 1 embedding worker → 1 embedding server → this process, the NN
worker (``TrainCtx`` + ``DataLoader(StreamingDataset)``, staleness 8). Model: 26 ID slots of
dim 16, 13 dense features, MLP 512-256-1, batch 1,024, BCE. The only difference between the
two configurations is ``TrainCtx(progressive=ProgressiveConfig(enabled=...))`` (window
100,000 samples); runs alternate on, off, on, off, ... and the medians count, so drifting
load on the machine hits both alike.

Also measured, in this process: the accumulator alone (``ProgressiveValidation.add`` of one
batch of 1,024, microseconds) and one read of a full window (``read``, milliseconds).

Run: ``python load_tests/bench_progressive.py [--batches 60] [--warmup 10] [--repeat 5]
[--json out.json]``. Prints one JSON object; ``train_metrics_on_vs_off`` = median samples/s
on / median off (target >= 0.97); ``cpu_on_vs_off`` = median CPU seconds per sample off /
on, summed over every process of the pipeline (less sensitive to other load; 1.0: free);
``train_metrics_on_vs_off_best`` best run against best run, ``paired_on_vs_off`` each pair
of neighbouring runs (on a machine shared with other work the medians swing by 2x: read
these and the accumulator's own cost beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import BATCH, DIM, SLOTS, train_window  # noqa: E402

STALENESS = 8


def run(worker: Any, server: Any, n: int, vocab: int, warmup: int, on: bool
        ) -> tuple[float, float, dict]:
    """One training run; returns (samples/s, CPU seconds per sample, ctx.progressive())."""
    from stream_persia.config import ProgressiveConfig

    rate, cpu, _, prog = train_window(worker, server, n, vocab, warmup, STALENESS,
                                      progressive=ProgressiveConfig(enabled=on))
    if on and prog["task0"]["samples"] != n * BATCH:
        raise RuntimeError(f"progressive validation scored {prog['task0']['samples']} "
                           f"samples, expected {n * BATCH}")
    return rate, cpu, prog


def accumulator_cost(repeat: int = 200) -> dict[str, float]:
    """The accumulator alone: µs per ``add`` of one batch, ms per ``read`` of 100k."""
    from stream_persia.nn.progressive import ProgressiveValidation

    rng = np.random.default_rng(0)
    p = rng.random((BATCH, 1), dtype=np.float32)
    y = (rng.random((BATCH, 1)) < p).astype(np.float32)
    pv = ProgressiveValidation(100_000)
    for _ in range(100):           # fill the window (and warm up)
        pv.add([p], [y])
    t0 = time.perf_counter()
    for _ in range(repeat):
        pv.add([p], [y])
    add_us = (time.perf_counter() - t0) / repeat * 1e6
    t0 = time.perf_counter()
    for _ in range(5):
        pv.read()
    read_ms = (time.perf_counter() - t0) / 5 * 1e3
    return {"add_us_per_batch": round(add_us, 1), "read_ms_window_100k": round(read_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60, help="batches per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed batches per run")
    parser.add_argument("--vocab", type=int, default=100_000, help="ids per slot")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs of each configuration, alternated; the medians count")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.batches <= args.warmup:
        raise SystemExit("--batches must exceed --warmup")

    from stream_persia.launch.processes import RoleProcess

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-progressive-"))
    config = tmp / "embedding_config.yml"
    config.write_text("feature_index_prefix_bit: 8\nslots_config:\n" + "".join(
        f"  s{k}: {{dim: {DIM}}}\n" for k in range(SLOTS)))
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    last: dict = {}
    server = RoleProcess("embedding-server", ["--capacity", str(4 * SLOTS * args.vocab)],
                         log_path=tmp / "server.log")
    with server:
        worker = RoleProcess("embedding-worker", [
            "--embedding-servers", server.address, "--embedding-config", str(config)],
            log_path=tmp / "worker.log")
        with worker:
            for r in range(args.repeat):
                # alternate which goes first, so neither always follows the other
                for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    w, c, prog = run(worker, server, args.batches, args.vocab, args.warmup,
                                     name == "on")
                    wall[name].append(w)
                    cpu[name].append(c)
                    if name == "on":
                        last = prog
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    result = json.dumps({
        "benchmark": "progressive_validation", "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "batch_size": BATCH, "batches": args.batches, "warmup": args.warmup,
        "repeat": args.repeat, "embedding_staleness": STALENESS, "window_samples": 100_000,
        "train_metrics_on_vs_off": round(med["on"] / med["off"], 4),
        "cpu_on_vs_off": round(med_cpu["off"] / med_cpu["on"], 4),
        # other load only ever slows a run down: best against best, and each on run
        # against the off run beside it, say more than the medians on a busy machine
        "train_metrics_on_vs_off_best": round(max(wall["on"]) / max(wall["off"]), 4),
        "paired_on_vs_off": [round(a / b, 3) for a, b in zip(wall["on"], wall["off"],
                                                              strict=True)],
        "samples_per_s_on": round(med["on"], 1), "samples_per_s_off": round(med["off"], 1),
        "all_samples_per_s_on": [round(x, 1) for x in wall["on"]],
        "all_samples_per_s_off": [round(x, 1) for x in wall["off"]],
        "cpu_us_per_sample_on": round(med_cpu["on"] * 1e6, 2),
        "cpu_us_per_sample_off": round(med_cpu["off"] * 1e6, 2),
        **accumulator_cost(),
        "last_run_progressive": {t: {k: m[k] for k in ("samples", "auc", "ne", "calibration")}
                                 for t, m in last.items()},
        "target_train_metrics_on_vs_off": 0.97,
    }, indent=2)
    print(result)
    if args.json:
        Path(args.json).write_text(result + "\n")


if __name__ == "__main__":
    main()
