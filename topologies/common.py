"""Helpers shared by the example topologies: run settings, metrics file, progress lines.

Not part of the ``stream_persia`` package: the topologies are user code written against
the public PERSIA-style API, and these are the few helpers they share. Each entry script
makes this folder importable with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common

**Settings** (:func:`load_settings`): the ``run:`` defaults of the topology's
``topology.yml``, overridden by the environment ``stream-persia run`` sets for every role,
overridden by command-line flags (for running one script by hand)::

    setting              env                          flag
    samples              STREAM_PERSIA_SAMPLES        --samples
    epochs               STREAM_PERSIA_EPOCHS         --epochs
    batch_size           STREAM_PERSIA_BATCH_SIZE     --batch-size
    eval_samples         STREAM_PERSIA_EVAL_SAMPLES   --eval-samples
    embedding_staleness  EMBEDDING_STALENESS          --embedding-staleness
    seed                 STREAM_PERSIA_SEED           --seed
    reproducible         REPRODUCIBLE (0/1)           --reproducible
    output_dir           PERSIA_OUTPUT_DIR            --output-dir
    checkpoint_dir       PERSIA_CKPT_DIR              --checkpoint-dir
    data                 STREAM_PERSIA_DATA           --data (--data-dir, --data-file)

Sizes accept ``1e6`` and ``1_000_000``. ``checkpoint_dir`` defaults to
``<output_dir>/checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from stream_persia.config import parse_yaml

__all__ = ["RunSettings", "load_settings", "MetricsLog", "Progress", "log", "topology_file",
           "embedding_config_path", "model_kwargs", "steps_per_rank", "num_batches", "predict",
           "task_metrics", "all_ranks_sum", "record_progressive", "progressive_every",
           "MAX_CURVE_POINTS", "MIN_CURVE_POINTS"]

#: The most points :func:`progressive_every` gives a progressive curve (metrics.json
#: stays small, and the reads, which sort the window, stay cheap).
MAX_CURVE_POINTS = 400
MIN_CURVE_POINTS = 20

#: (setting, env variable, kind) in the order of the table above.
_FIELDS = (
    ("samples", "STREAM_PERSIA_SAMPLES", "size"),
    ("epochs", "STREAM_PERSIA_EPOCHS", "size"),
    ("batch_size", "STREAM_PERSIA_BATCH_SIZE", "size"),
    ("eval_samples", "STREAM_PERSIA_EVAL_SAMPLES", "size"),
    ("embedding_staleness", "EMBEDDING_STALENESS", "size"),
    ("seed", "STREAM_PERSIA_SEED", "size"),
    ("reproducible", "REPRODUCIBLE", "bool"),
    ("output_dir", "PERSIA_OUTPUT_DIR", "str"),
    ("checkpoint_dir", "PERSIA_CKPT_DIR", "str"),
    ("data", "STREAM_PERSIA_DATA", "str"),
)


@dataclass
class RunSettings:
    """What one run does: sizes, batching, staleness, where data and results are.

    ``samples`` is the training samples per epoch (0: the whole dataset, for file-backed
    topologies); ``eval_samples`` likewise for the held-out split.
    """

    samples: int = 0
    epochs: int = 1
    batch_size: int = 1024
    eval_samples: int = 0
    embedding_staleness: int = 1
    seed: int = 0
    reproducible: bool = False
    output_dir: str | None = None
    checkpoint_dir: str | None = None
    data: str | None = None

    def __post_init__(self) -> None:
        for name, lo in (("samples", 0), ("epochs", 1), ("batch_size", 1),
                         ("eval_samples", 0), ("embedding_staleness", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise SystemExit(f"setting {name} must be an integer >= {lo}, got {value!r}")
        if self.checkpoint_dir is None and self.output_dir:
            self.checkpoint_dir = str(Path(self.output_dir) / "checkpoint")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def topology_file(topology_dir: str | Path) -> dict[str, Any]:
    """The parsed ``topology.yml`` of a topology directory."""
    path = Path(topology_dir) / "topology.yml"
    try:   # refuses a key given twice (PyYAML would keep the last one silently)
        data = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SystemExit(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping at the top level")
    return data


def _parse(kind: str, raw: Any, where: str) -> Any:
    if kind == "str":
        return None if raw in (None, "") else str(raw)
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise SystemExit(f"{where}={raw!r}: expected 0 or 1")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    try:
        value = float(str(raw).replace("_", ""))
    except ValueError:
        raise SystemExit(f"{where}={raw!r} is not a number; use e.g. 1000000 or 1e6") from None
    if not value.is_integer():
        raise SystemExit(f"{where}={raw!r} must be a whole number")
    return int(value)


def load_settings(topology_dir: str | Path, argv: list[str] | None = None,
                  description: str | None = None) -> RunSettings:
    """Defaults of ``topology.yml`` < environment < ``argv`` flags (see module docstring)."""
    run = topology_file(topology_dir).get("run") or {}
    unknown = set(run) - {f for f, _, _ in _FIELDS}
    if unknown:
        raise SystemExit(f"{Path(topology_dir) / 'topology.yml'}: unknown run setting(s) "
                         f"{sorted(unknown)}; accepted: {[f for f, _, _ in _FIELDS]}")
    values: dict[str, Any] = {}
    for name, env, kind in _FIELDS:
        if name in run:
            values[name] = _parse(kind, run[name], f"topology.yml run.{name}")
        if os.environ.get(env, "").strip():
            values[name] = _parse(kind, os.environ[env].strip(), env)
    ap = argparse.ArgumentParser(description=description)
    for name, env, kind in _FIELDS:
        flags = ["--" + name.replace("_", "-")]
        if name == "data":
            flags += ["--data-dir", "--data-file"]
        if kind == "bool":
            ap.add_argument(*flags, dest=name, action="store_true", default=None,
                            help=f"(env {env})")
        else:
            ap.add_argument(*flags, dest=name, default=None, help=f"(env {env})")
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    for name, _env, kind in _FIELDS:
        raw = getattr(args, name)
        if raw is not None:
            values[name] = _parse(kind, raw, "--" + name.replace("_", "-"))
    return RunSettings(**values)


def embedding_config_path(topology_dir: str | Path) -> str | None:
    """The embedding config of the job: None when ``PERSIA_EMBEDDING_CONFIG`` names one
    (the loader reads the env), else the topology's own file."""
    if os.environ.get("PERSIA_EMBEDDING_CONFIG", "").strip():
        return None
    name = (topology_file(topology_dir).get("config") or {}).get("embedding")
    return str(Path(topology_dir) / (name or "embedding_config.yml"))


def model_kwargs(topology_dir: str | Path) -> dict[str, Any]:
    """``serving.model_kwargs`` of ``topology.yml``: the model the job trains and serves."""
    return dict((topology_file(topology_dir).get("serving") or {}).get("model_kwargs") or {})


def steps_per_rank(total_batches: int, world_size: int) -> int:
    """Training steps every NN rank takes: DDP needs the same count on each, so the
    remainder of ``total_batches / world_size`` is not trained."""
    return total_batches // world_size


def num_batches(samples: int, batch_size: int) -> int:
    return math.ceil(samples / batch_size)


def log(role: str, msg: str) -> None:
    """One progress line on stderr (the orchestrator collects role output)."""
    print(f"[{time.strftime('%H:%M:%S')}] {role}: {msg}", file=sys.stderr, flush=True)


class MetricsLog:
    """A run's metrics, written as ``metrics.json`` in the output dir (rank 0;
    ``metrics.rank<r>.json`` for the other ranks).

    The file is replaced atomically on every :meth:`write`, so the orchestrator can read
    progress at any time. Schema (every topology)::

        {"topology": str, "rank": int, "world_size": int, "settings": {...},
         "tasks": [task, ...],
         "train": {"samples": int (all ranks), "batches": int, "seconds": float,
                   "samples_per_s": float, "done": bool},
         "loss_curve": [[samples_seen, mean_loss], ...],      # samples_seen: all ranks
         "eval_curve": [[samples_seen, {task: auc}], ...],
         "auc": {task: float}, "loss": {task: float},         # final, on the eval split
         "bayes_auc": {task: float}, "bayes_lift": {task: float},   # when known
         "eval": {"samples": int, "seconds": float, ...},
         "checkpoint": str | null, "stats": {...TrainCtx.stats()}}
    """

    def __init__(self, topology: str, settings: RunSettings, tasks: list[str], rank: int = 0,
                 world_size: int = 1):
        self.data: dict[str, Any] = {
            "topology": topology, "rank": rank, "world_size": world_size,
            "settings": settings.as_dict(), "tasks": list(tasks),
            "train": {"samples": 0, "batches": 0, "seconds": 0.0, "samples_per_s": 0.0,
                      "done": False},
            "loss_curve": [], "eval_curve": [], "auc": {}, "loss": {}, "eval": {},
            "checkpoint": None, "stats": {},
        }
        out = settings.output_dir
        name = "metrics.json" if rank == 0 else f"metrics.rank{rank}.json"
        self.path = Path(out) / name if out else None

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def write(self) -> Path | None:
        """Write the file (no-op without an output dir); returns its path."""
        if self.path is None:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".metrics.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1, default=_jsonable)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.path


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


class Progress:
    """Loss curve, throughput and progress lines of a training loop (one NN rank).

    Args:
        metrics: where the loss curve and training counters go.
        total_steps: steps this rank will take (for the percentage).
        world_size: NN ranks; samples are reported for the whole job (this rank's count
            times ``world_size``, exact when ranks take equal batches, as DDP makes them).
        points: loss-curve points (and progress lines) over the run.
    """

    def __init__(self, metrics: MetricsLog, total_steps: int, world_size: int = 1,
                 points: int = 50, role: str = "nn-worker"):
        self.metrics, self.total_steps, self.world_size = metrics, total_steps, world_size
        self.every = max(1, total_steps // max(points, 1))
        self.role = role
        self.steps = 0
        self.samples = 0
        self._window: list[float] = []
        self.t0 = time.monotonic()

    @property
    def job_samples(self) -> int:
        return self.samples * self.world_size

    def step(self, batch_samples: int, loss: float) -> bool:
        """Record one step; True when a curve point was just written (a good eval time)."""
        self.steps += 1
        self.samples += batch_samples
        self._window.append(loss)
        if self.steps % self.every and self.steps != self.total_steps:
            return False
        mean = float(np.mean(self._window))
        self._window.clear()
        self.metrics["loss_curve"].append([self.job_samples, mean])
        elapsed = time.monotonic() - self.t0
        rate = self.job_samples / elapsed if elapsed > 0 else 0.0
        train = self.metrics["train"]
        train.update(samples=self.job_samples, batches=self.steps * self.world_size,
                     seconds=round(elapsed, 3), samples_per_s=round(rate, 1))
        pct = 100.0 * self.steps / self.total_steps if self.total_steps else 100.0
        log(self.role, f"{pct:5.1f}% {self.job_samples} samples {rate:8.0f}/s loss {mean:.4f}")
        self.metrics.write()
        return True

    def finish(self, samples: int | None = None) -> None:
        """Final counters (``samples``: the exact job-wide count, when known)."""
        elapsed = time.monotonic() - self.t0
        total = self.job_samples if samples is None else samples
        self.metrics["train"].update(samples=total, batches=self.steps * self.world_size,
                                     seconds=round(elapsed, 3),
                                     samples_per_s=round(total / elapsed, 1) if elapsed else 0.0,
                                     done=True)
        self.metrics.write()


def all_ranks_sum(value: int) -> int:
    """Sum of ``value`` over the NN ranks (``value`` itself outside DDP)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return int(t.item())


def predict(model: Any, batches: Iterable[Any], *, device_id: int | None = None,
            buffer_size: int = 8) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run ``model`` over ``PersiaBatch``es (with labels) in an ``eval_ctx``.

    The embeddings are looked up on the embedding workers without inserting or refreshing
    anything (an id never trained on gives zeros), PERSIA's evaluation path.

    Returns:
        ``(predictions, labels)``: one float64 array per task (per model output / label).
    """
    import torch

    from stream_persia.ctx import eval_ctx
    from stream_persia.data import DataLoader, IterableDataset

    was_training = model.training
    model.eval()
    preds: list[list[np.ndarray]] = []
    labels: list[list[np.ndarray]] = []
    try:
        with eval_ctx(model=model, device_id=device_id) as ctx, torch.no_grad():
            loader = DataLoader(IterableDataset(buffer_size, iterable=batches),
                                forward_buffer_size=buffer_size)
            for batch in loader:
                out, label_tensors = ctx.forward(batch)
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                if not preds:
                    preds = [[] for _ in outs]
                    labels = [[] for _ in label_tensors]
                for k, o in enumerate(outs):
                    preds[k].append(o.detach().float().cpu().numpy().reshape(-1))
                for k, t in enumerate(label_tensors):
                    labels[k].append(t.detach().float().cpu().numpy().reshape(-1))
    finally:
        model.train(was_training)
    return ([np.concatenate(p).astype(np.float64) for p in preds],
            [np.concatenate(y).astype(np.float64) for y in labels])


def task_metrics(tasks: list[str], preds: list[np.ndarray], labels: list[np.ndarray]
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """Per-task AUC and log loss of predicted probabilities."""
    from stream_persia.utils import roc_auc

    if len(preds) != len(tasks) or len(labels) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks {tasks} but the model gave {len(preds)} "
                         f"outputs and the batches {len(labels)} labels")
    auc, loss = {}, {}
    for task, p, y in zip(tasks, preds, labels, strict=True):
        auc[task] = roc_auc(y, p)
        q = np.clip(p, 1e-7, 1 - 1e-7)
        loss[task] = float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))
    return auc, loss


def progressive_every(steps: int, batch_size: int, world_size: int) -> int:
    """Steps between two points of the progressive curve: about a quarter of the window
    (``progressive.window_samples``), so a drop of the windowed AUC shows in a few
    points, at least :data:`MIN_CURVE_POINTS` points where there are that many steps, and
    at most :data:`MAX_CURVE_POINTS`. A read sorts the window, so
    reading every quarter window costs about four sorts of every sample trained,
    whatever the window."""
    from stream_persia.nn.progressive import progressive_config

    window = progressive_config().window_samples
    every = max(1, window // (4 * max(1, batch_size) * max(1, world_size)))
    every = min(every, max(1, steps // MIN_CURVE_POINTS))   # a short run gets a curve too
    return max(every, -(-steps // MAX_CURVE_POINTS))


def record_progressive(metrics: MetricsLog, now: dict[str, dict]) -> None:
    """Progressive validation (every training batch scored before its update,
    ``TrainCtx.progressive()``) into ``metrics["progressive"]``: per task the newest
    figures and a ``curve`` of ``[samples_scored, windowed_auc, windowed_ne]`` points."""
    prog = metrics.data.setdefault("progressive", {})
    for task, m in now.items():
        curve = prog.get(task, {}).get("curve", [])
        if not curve or curve[-1][0] != m["samples"]:
            curve.append([m["samples"], m["auc"], m["ne"]])
        prog[task] = {**m, "curve": curve}
