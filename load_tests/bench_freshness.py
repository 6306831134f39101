"""Freshness of a serving replica following training, against training without publishing.

Runs the main job (``stream-persia run topologies/synthetic_ctr``, broker-less, every role
a process on this machine) ``--repeat`` times with the update stream on (the embedding
servers publish their changed rows every ``model_updates.model_update_interval_ms``, NN
rank 0 the dense model; a serving replica restores the first checkpoint and follows, at
``nice`` 10 as ``stream-persia run`` starts it: it takes the CPU training leaves) and
as many times with it off (``--no-model-updates``: nothing published, no replica),
alternated so that machine load hits both alike.

Freshness of a sample = the time the replica has applied the updates that include it
(every server's rows and a dense model trained after it) minus the sample's event time
(set by the data loader when it sends the batch). It is computed from the replica's
advances of ``trained_through`` (``stream_persia.launch.replica_watch.freshness_of``), over
the whole run after the replica's start.

Prints the figures of every run, then one JSON object (also written with ``--json``):

- ``freshness_p50_s``, ``freshness_p99_s``: medians over the publishing runs, over the
  whole run from the replica's first advance; ``freshness_steady_*`` leave out the first
  10 s of event time, while the replica catches up from the checkpoint it started from;
- ``update_bytes_vs_full_checkpoint``: bytes of updates the replica applied per minute,
  over the bytes of the job's final full checkpoint (its embedding shard files);
- ``train_vs_publishing_off``: median training samples/s with publishing over without;
- ``served_max_abs_diff``: replica vs training predictions after the final drain;
- ``concept_shift_follow_s``: the generator changes the hidden CTR of a set of ids (slot
  ``C1``'s popularity ranks 4-11, ~9% of samples) at the middle sample of the publishing
  runs; seconds from the send of that sample until the replica's mean prediction on
  held-out samples of those ids crosses halfway from its value then to their new Bayes
  value (``stream-persia run --concept-shift-at``; both modes train the same stream).

Targets (issue 18): p99 freshness <= 2 s at the main job's rate, training >= 0.9x.

Run: ``python load_tests/bench_freshness.py [--samples 300000] [--repeat 2] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_job(samples: int, out: Path, publishing: bool, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stream_persia", "run", str(REPO / "topologies" / "synthetic_ctr"),
           "--samples", str(samples), "--output-dir", str(out), "--no-gates",
           "--predict-samples", "20000", "--timeout-s", str(timeout_s)]
    cmd += ["--concept-shift-at", str(samples // 2)]   # both modes: the same stream
    if not publishing:
        cmd.append("--no-model-updates")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 120)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    report["wall_s"] = time.monotonic() - t0
    return report


def checkpoint_bytes(report: dict[str, Any]) -> int:
    manifest = json.loads((Path(report["checkpoint"]) / "manifest.json").read_text())
    return sum(int(manifest["files"][n]["bytes"]) for n in manifest["embedding_files"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="bench-freshness-") as tmp:
        for i in range(args.repeat):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                out = Path(tmp) / f"{mode}-{i}"
                r = run_job(args.samples, out, mode == "on", args.timeout_s)
                rep = r.get("replica") or {}
                fig = {"mode": mode, "samples_per_s": r["samples_per_s"],
                       "auc": r.get("auc"), "seconds": r["seconds"]}
                if mode == "on":
                    minutes = max(rep.get("following_s") or 0.0, 1e-9) / 60.0
                    fig.update(freshness_p50_s=rep.get("freshness_p50_s"),
                               freshness_p99_s=rep.get("freshness_p99_s"),
                               freshness_max_s=rep.get("freshness_max_s"),
                               freshness_steady_p50_s=rep.get("freshness_steady_p50_s"),
                               freshness_steady_p99_s=rep.get("freshness_steady_p99_s"),
                               advances=rep.get("advances"),
                               update_bytes=rep.get("update_bytes"),
                               update_bytes_per_min=(rep.get("update_bytes") or 0) / minutes,
                               full_checkpoint_bytes=checkpoint_bytes(r),
                               served_auc_final=rep.get("served_auc_final"),
                               served_max_abs_diff=rep.get("served_max_abs_diff"),
                               concept_shift_follow_s=(rep.get("concept_shift") or {})
                               .get("follow_s"))
                print(json.dumps(fig), flush=True)
                runs[mode].append(fig)
    on, off = runs["on"], runs["off"]

    def med(key: str, rows: list[dict[str, Any]]) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {
        "samples": args.samples, "repeat": args.repeat, "cpus": os.cpu_count(),
        "freshness_p50_s": med("freshness_p50_s", on),
        "freshness_p99_s": med("freshness_p99_s", on),
        "freshness_steady_p50_s": med("freshness_steady_p50_s", on),
        "freshness_steady_p99_s": med("freshness_steady_p99_s", on),
        "update_bytes_vs_full_checkpoint": statistics.median(
            r["update_bytes_per_min"] / r["full_checkpoint_bytes"] for r in on),
        "train_vs_publishing_off": med("samples_per_s", on) / med("samples_per_s", off),
        "served_max_abs_diff": med("served_max_abs_diff", on),
        "concept_shift_follow_s": med("concept_shift_follow_s", on),
        "target": {"freshness_p99_s": 2.0, "train_vs_publishing_off": 0.9},
        "runs": on + off,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
