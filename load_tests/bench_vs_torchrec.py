"""Training on one host: the stream-persia pipeline against single-process TorchRec/FBGEMM.

The same model, data and batch through both:

- **data**: a generated click stream (``topologies/synthetic_ctr/generator.py``'s
  ``ClickStream``: 26 id slots drawing Zipf(1.1..1.2) ranks over ``--vocab`` values each,
  13 dense features, labels from a hidden model), so the Bayes-optimal AUC of the eval
  split is known: the AUC of the true click probabilities. ``--samples`` training samples
  (one pass, in order), ``--eval-samples`` held out. Written once to a temporary folder
  as arrays; both sides read them.
- **model**: the 26 embeddings (dim 16) and the dense features concatenated into an MLP
  512-256-1, sigmoid, BCE; Adam (lr 1e-3) on the MLP; **rowwise Adagrad** on the rows
  (lr ``--emb-lr``; one accumulator per row fed the mean of g² over the row, starting at
  ``--adagrad-initial-accumulator``), rows initialised uniform in ±0.01; batch 1,024.
- **(a) stream-persia**: ``stream-persia run load_tests/vs_torchrec --data DIR
  --no-model-updates`` as it starts a job on one host: an embedding server, an embedding
  worker, the NN worker (torchrun, one rank, one torch thread as ``run`` gives it on 2
  cores) and a data loader, each a process, broker-less, RPC on loopback;
  ``--staleness`` (default 8) batches in flight. No API (the topology's ``api: false``) and
  no model-update stream: the TorchRec side serves and publishes nothing either.
- **(b) TorchRec/FBGEMM**: one process (``vs_torchrec/torchrec_train.py``, run with the
  TorchRec environment's python): FBGEMM's CPU table-batched embedding
  (``SplitTableBatchedEmbeddingBagsCodegen``, the kernels TorchRec uses, float32 rows) with
  ``EXACT_ROWWISE_ADAGRAD`` fused into the backward pass; every configuration of
  ``--torchrec-configs`` (``VARIANT:THREADS``; variants ``tbe``, FBGEMM's module fed flat
  ids, and ``torchrec``, TorchRec's ``FusedEmbeddingBagCollection`` fed a
  ``KeyedJaggedTensor``) runs; the fastest (highest median samples/s) is the baseline of
  samples/s and AUC, the leanest (lowest median CPU per sample) that of CPU per sample.
  Its row ids are the generator's popularity ranks (a collision-free vocabulary per slot,
  TorchRec's best case: no hashing), where stream-persia gets the raw 64-bit ids.
  What the optimizers do differently (FBGEMM allows no closer match): FBGEMM adds the
  step's g² to the accumulator before the step and puts eps outside the root
  (``w -= lr*g/(sqrt(acc)+eps)``), PERSIA steps with the accumulator of the steps before
  (``w -= lr*g/sqrt(acc+eps)``, then ``acc += g²``); FBGEMM has no initial accumulator
  option, so the benchmark writes it into FBGEMM's state.

Figures: samples/s and CPU µs per sample over the batches after ``--warmup`` (stream-persia:
the CPU of every process of the job, ``run`` included, read from ``/proc``; TorchRec: its
process), medians of ``--repeat`` runs, the two sides alternated; test AUC of each run on
the eval split (one AUC function for both) against the Bayes-optimal AUC.

Targets (issue 22): ``samples_per_s_vs_torchrec >= 0.8``, ``cpu_per_sample_vs_torchrec <=
1.25``, ``auc_gap <= 0.002``.

A reference, never a baseline: ``mlp:1`` (in the default ``--torchrec-configs``) trains the
MLP alone, one torch thread, with fixed random rows in place of the embeddings: the ceiling
of an NN rank with one thread. ``mlp_floor`` reports it (``samples_per_s``,
``cpu_us_per_sample``), its ratio to the TorchRec baseline (``vs_torchrec``: the best
``samples_per_s_vs_torchrec`` such an NN rank could reach), stream-persia's fraction of it
(``persia_vs_floor``) and the CPU per sample stream-persia spends beyond it
(``persia_cpu_over_floor_us``: the embedding pipeline's cost, everything but the MLP).

The TorchRec environment is never the project's: TorchRec's ``fbgemm-gpu`` dependency
would replace the CPU build. Create it once (a few minutes; CPU wheels)::

    python3 load_tests/bench_vs_torchrec.py --make-torchrec-venv ~/.cache/stream-persia/torchrec-venv

and name its python with ``--torchrec-python`` or ``STREAM_PERSIA_TORCHREC_PYTHON``
(default: that path). Without it the benchmark says how to create it and exits 2;
``--persia-only`` runs stream-persia's side alone (no ratios).

Run: ``python3 load_tests/bench_vs_torchrec.py [--samples 1e6] [--repeat 3] [--json F]``.
Prints each run, then one JSON object (also written with ``--json``): the keys
``samples_per_s_vs_torchrec``, ``cpu_per_sample_vs_torchrec``, ``auc_gap`` (absolute,
medians' difference), each side's medians and every run.
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

import numpy as np

from stream_persia.config import flags

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
TOPOLOGY = HERE / "vs_torchrec"
DEFAULT_VENV = Path.home() / ".cache" / "stream-persia" / "torchrec-venv"
ENV_PYTHON = "STREAM_PERSIA_TORCHREC_PYTHON"
SLOTS, DIM, DENSE, BATCH, MLP = 26, 16, 13, 1024, [512, 256]
TARGETS = {"samples_per_s_vs_torchrec": 0.8, "cpu_per_sample_vs_torchrec": 1.25,
           "auc_gap": 0.002}
#: What --make-torchrec-venv installs (the versions the figures were measured with).
VENV_PACKAGES = [
    ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"],
    ["fbgemm-gpu-cpu==1.8.0"],
    ["torchrec==1.8.0", "--no-deps"],   # its fbgemm-gpu requirement is the CUDA build
    ["torchmetrics==1.0.3", "tensordict==0.15.3", "pyre-extensions==0.0.32", "tqdm"],
]


#: an argparse type: a whole number >= 1 (``1e6`` and ``1_000_000`` work)
size = flags.size(1)


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def nonneg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def config(text: str) -> tuple[str, int]:
    """An argparse type: ``VARIANT:THREADS``, variant ``tbe``, ``torchrec`` or ``mlp``."""
    variant, _, threads = text.partition(":")
    if variant not in ("tbe", "torchrec", "mlp") or not threads.isdigit() or int(threads) < 1:
        raise argparse.ArgumentTypeError(f"expected VARIANT:THREADS with VARIANT tbe, "
                                         f"torchrec or mlp and THREADS >= 1, got {text!r}")
    return variant, int(threads)


def make_venv(path: Path) -> None:
    """Create the TorchRec environment at ``path`` (its own venv, never the project's)."""
    if (path / "bin" / "python").exists():
        print(f"{path} exists; installing into it", file=sys.stderr)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    for pkgs in VENV_PACKAGES:
        print("+ pip install " + " ".join(pkgs), file=sys.stderr, flush=True)
        subprocess.run(pip + pkgs, check=True)
    check = torchrec_problem(str(path / "bin" / "python"))
    if check:
        raise SystemExit(f"the environment at {path} does not import TorchRec: {check}")
    print(f"ready: --torchrec-python {path / 'bin' / 'python'}")


def torchrec_problem(python: str) -> str | None:
    """Why ``python`` cannot run the TorchRec side (None: it can)."""
    if not Path(python).exists():
        return f"{python} does not exist"
    proc = subprocess.run([python, "-c", "import torch, fbgemm_gpu, torchrec"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "exit " + str(
            proc.returncode)
    return None


def write_data(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The data set both sides read, and ``meta.json`` (sizes and hyper-parameters)."""
    sys.path.insert(0, str(REPO / "topologies" / "synthetic_ctr"))
    from generator import ClickStream  # type: ignore[import-not-found]

    from stream_persia.utils import roc_auc

    stream = ClickStream(num_slots=SLOTS, num_dense=DENSE, vocab_size=args.vocab,
                         seed=args.seed)
    n_train = (args.samples // BATCH) * BATCH
    for split, start, n in (("train", 0, n_train), ("eval", 1 << 48, args.eval_samples)):
        arrays = {k: [] for k in ("ids", "rows", "dense", "label", "p")}
        for lo in range(start, start + n, 65_536):
            index = np.arange(lo, min(start + n, lo + 65_536), dtype=np.int64)
            s = stream.samples_at(index)
            arrays["ids"].append(s.ids)
            arrays["rows"].append(stream.ranks(index).astype(np.int32))
            arrays["dense"].append(s.dense)
            arrays["label"].append(s.label)
            arrays["p"].append(s.p)
        for k, parts in arrays.items():
            np.save(out / f"{split}_{k}.npy", np.concatenate(parts))
    label, p = np.load(out / "eval_label.npy"), np.load(out / "eval_p.npy")
    meta = {"slots": SLOTS, "dim": DIM, "dense": DENSE, "mlp": MLP, "batch": BATCH,
            "vocab": args.vocab, "seed": args.seed, "train_samples": n_train,
            "eval_samples": args.eval_samples, "warmup": args.warmup,
            "emb_lr": args.emb_lr, "dense_lr": 1e-3, "emb_init": 0.01,
            "adagrad_initial_accumulator": args.adagrad_initial_accumulator,
            "adagrad_eps": args.adagrad_eps,
            "bayes_auc": roc_auc(label, p), "click_rate": float(label.mean())}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def auc_of(data: Path, preds: Path) -> float:
    from stream_persia.utils import roc_auc

    return float(roc_auc(np.load(data / "eval_label.npy"), np.load(preds)))


def run_persia(data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stream_persia", "run", str(TOPOLOGY), "--data", str(data),
           "--output-dir", str(out), "--no-model-updates", "--no-gates",
           "--embedding-staleness", str(args.staleness), "--timeout-s", str(args.timeout_s)]
    t0 = time.monotonic()
    # the NN rank counts the CPU of the tree of its ancestor whose parent is this process
    env = {**os.environ, "STREAM_PERSIA_BENCH_PID": str(os.getpid())}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=args.timeout_s + 120)
    if proc.returncode != 0 or not (out / "bench.json").exists():
        raise SystemExit(f"stream-persia run failed ({proc.returncode}); logs in {out}/logs:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    res = json.loads((out / "bench.json").read_text())
    if not res["job_root_is_run"]:
        raise SystemExit(f"the NN rank did not find the run among its ancestors: its CPU "
                         f"figure would leave the other roles out ({out}/bench.json)")
    res["auc"] = auc_of(data, out / "eval_pred.npy")
    res["run_wall_s"] = time.monotonic() - t0
    return res


def run_torchrec(python: str, data: Path, out: Path, variant: str, threads: int,
                 timeout_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run([python, str(TOPOLOGY / "torchrec_train.py"), str(data), str(out),
                           "--variant", variant, "--threads", str(threads)],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the TorchRec side failed ({variant}:{threads}, exit "
                         f"{proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads((out / "result.json").read_text())
    res["auc"] = auc_of(data, out / "eval_pred.npy")
    return res


def med(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=size, default=1_000_000,
                    help="training samples (one pass; whole batches of 1,024)")
    ap.add_argument("--eval-samples", type=size, default=200_000, help="held-out samples")
    ap.add_argument("--vocab", type=size, default=100_000,
                    help="id values per slot (bench_train.py's 100,000 by default)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed batches at the start")
    ap.add_argument("--repeat", type=size, default=3, help="runs of each side (medians)")
    ap.add_argument("--staleness", type=size, default=8,
                    help="stream-persia's embedding staleness (batches in flight)")
    ap.add_argument("--emb-lr", type=positive, default=0.05, help="rowwise Adagrad's lr")
    ap.add_argument("--adagrad-initial-accumulator", type=nonneg, default=1e-4,
                    help="rowwise Adagrad's starting accumulator (both sides)")
    ap.add_argument("--adagrad-eps", type=nonneg, default=1e-8, help="rowwise Adagrad's eps")
    ap.add_argument("--seed", type=int, default=0, help="the generated stream's seed")
    ap.add_argument("--torchrec-configs", type=config, nargs="+",
                    default=[("tbe", 1), ("tbe", 2), ("torchrec", 1), ("mlp", 1)],
                    help="TorchRec configurations to run, VARIANT:THREADS (the fastest tbe "
                         "or torchrec one is the baseline; mlp runs are the reference "
                         "mlp_floor, never a baseline)")
    ap.add_argument("--torchrec-python", default=os.environ.get(ENV_PYTHON) or str(
                        DEFAULT_VENV / "bin" / "python"),
                    help=f"the TorchRec environment's python (env {ENV_PYTHON}; default "
                         f"{DEFAULT_VENV}/bin/python)")
    ap.add_argument("--make-torchrec-venv", metavar="DIR", default=None,
                    help="create the TorchRec environment in DIR, then exit")
    ap.add_argument("--persia-only", action="store_true",
                    help="run stream-persia's side alone (no TorchRec environment; no ratios)")
    ap.add_argument("--timeout-s", type=positive, default=1800.0,
                    help="longest run of either side (seconds)")
    ap.add_argument("--keep", action="store_true", help="keep the data set and the runs' logs")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.make_torchrec_venv:
        make_venv(Path(args.make_torchrec_venv).expanduser())
        return {}
    if not 0 <= args.warmup < args.samples // BATCH:
        ap.error(f"--warmup must be in [0, {args.samples // BATCH}) batches (--samples "
                 f"{args.samples} makes {args.samples // BATCH})")
    if args.adagrad_initial_accumulator + args.adagrad_eps <= 0:
        ap.error("--adagrad-initial-accumulator + --adagrad-eps must be > 0")
    if not args.persia_only:
        problem = torchrec_problem(args.torchrec_python)
        if problem:
            print(f"bench_vs_torchrec: no TorchRec environment ({problem}).\nCreate one "
                  f"(its own venv, never the project's):\n  python3 {Path(__file__).name} "
                  f"--make-torchrec-venv {DEFAULT_VENV}\nthen pass --torchrec-python "
                  f"DIR/bin/python (or set {ENV_PYTHON}), or run stream-persia's side "
                  f"alone with --persia-only.", file=sys.stderr)
            raise SystemExit(2)

    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-torchrec-"))
    data = tmp / "data"
    data.mkdir()
    t0 = time.monotonic()
    meta = write_data(data, args)
    print(f"data: {meta['train_samples']} train, {meta['eval_samples']} eval samples in "
          f"{time.monotonic() - t0:.0f}s; Bayes-optimal AUC {meta['bayes_auc']:.4f}",
          file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0]
    persia: list[dict[str, Any]] = []
    torchrec: dict[str, list[dict[str, Any]]] = {f"{v}:{t}": [] for v, t in
                                                 args.torchrec_configs}
    configs = [] if args.persia_only else args.torchrec_configs
    for r in range(args.repeat):
        sides = ["persia", *configs] if r % 2 == 0 else [*configs, "persia"]
        for side in sides:
            if side == "persia":
                res = run_persia(data, tmp / f"persia-{r}", args)
                persia.append(res)
                name = "stream-persia"
            else:
                variant, threads = side
                name = f"{variant}:{threads}"
                res = run_torchrec(args.torchrec_python, data, tmp / f"{variant}-{threads}-{r}",
                                   variant, threads, args.timeout_s)
                torchrec[name].append(res)
            print(json.dumps({"run": r, "side": name,
                              "samples_per_s": round(res["samples_per_s"], 1),
                              "cpu_us_per_sample": round(res["cpu_us_per_sample"], 2),
                              "auc": round(res["auc"], 5)}), file=sys.stderr, flush=True)

    p_rate, p_cpu, p_auc = (med(persia, k) for k in ("samples_per_s", "cpu_us_per_sample",
                                                       "auc"))
    out: dict[str, Any] = {
        "benchmark": "vs_torchrec", "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "model": {"slots": SLOTS, "dim": DIM, "dense": DENSE, "mlp": [*MLP, 1],
                  "batch": BATCH, "embedding_optimizer": "rowwise Adagrad",
                  "emb_lr": args.emb_lr,
                  "adagrad_initial_accumulator": args.adagrad_initial_accumulator,
                  "adagrad_eps": args.adagrad_eps, "dense_optimizer": "Adam 1e-3"},
        "data": {k: meta[k] for k in ("train_samples", "eval_samples", "vocab", "seed",
                                      "click_rate")},
        "bayes_auc": round(meta["bayes_auc"], 5), "warmup_batches": args.warmup,
        "repeat": args.repeat, "staleness": args.staleness,
        "persia": {"samples_per_s": round(p_rate, 1), "cpu_us_per_sample": round(p_cpu, 2),
                   "auc": round(p_auc, 5), "runs": persia},
        "targets": TARGETS,
    }
    if configs:
        figures = {name: {"samples_per_s": round(med(runs, "samples_per_s"), 1),
                          "cpu_us_per_sample": round(med(runs, "cpu_us_per_sample"), 2),
                          "auc": round(med(runs, "auc"), 5), "runs": runs}
                   for name, runs in torchrec.items()}
        # each ratio against TorchRec's best at it: the fastest configuration for
        # samples/s (and AUC), the leanest for CPU per sample
        peers = [n for n in figures if not n.startswith("mlp:")] or list(figures)
        best = max(peers, key=lambda n: figures[n]["samples_per_s"])
        lean = min(peers, key=lambda n: figures[n]["cpu_us_per_sample"])
        base = figures[best]
        floor = {n: f for n, f in figures.items() if n.startswith("mlp:")}
        if "mlp:1" in floor:
            # the NN rank's ceiling: one torch thread, the MLP alone, rows for free
            out["mlp_floor"] = {
                "samples_per_s": floor["mlp:1"]["samples_per_s"],
                "cpu_us_per_sample": floor["mlp:1"]["cpu_us_per_sample"],
                "vs_torchrec": round(floor["mlp:1"]["samples_per_s"] / base["samples_per_s"],
                                     3),
                "persia_vs_floor": round(p_rate / floor["mlp:1"]["samples_per_s"], 3),
                "persia_cpu_over_floor_us": round(
                    p_cpu - floor["mlp:1"]["cpu_us_per_sample"], 2)}
        out.update({
            "samples_per_s_vs_torchrec": round(p_rate / base["samples_per_s"], 3),
            "cpu_per_sample_vs_torchrec": round(p_cpu / figures[lean]["cpu_us_per_sample"], 3),
            "auc_gap": round(abs(p_auc - base["auc"]), 5),
            "torchrec_baseline": best, "torchrec_cpu_baseline": lean, "torchrec": figures,
            "versions": base["runs"][0].get("versions")})
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        out["kept"] = str(tmp)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if configs:
        print(f"stream-persia vs TorchRec: samples/s {out['samples_per_s_vs_torchrec']}x "
              f"{out['torchrec_baseline']} (target >= 0.8), CPU per sample "
              f"{out['cpu_per_sample_vs_torchrec']}x {out['torchrec_cpu_baseline']} (target "
              f"<= 1.25), AUC gap "
              f"{out['auc_gap']} (target <= 0.002; Bayes {out['bayes_auc']})", file=sys.stderr)
        if "mlp_floor" in out:
            fl = out["mlp_floor"]
            print(f"the MLP alone on one torch thread (the NN rank's ceiling): "
                  f"{fl['samples_per_s']:.0f} samples/s = {fl['vs_torchrec']}x "
                  f"{out['torchrec_baseline']}, {fl['cpu_us_per_sample']} us CPU per sample; "
                  f"stream-persia reaches {fl['persia_vs_floor']}x of it and spends "
                  f"{fl['persia_cpu_over_floor_us']} us per sample beyond it", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
