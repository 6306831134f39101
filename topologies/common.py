"""Helpers shared by the example topologies: run settings, AUC, metrics files.

Not part of the ``stream_persia`` package: the topologies are user code written against
the public PERSIA-style API, and these are the few helpers they share. Each script makes
this folder importable with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common

Settings come from the environment that ``stream-persia run`` sets for every role (see
``topologies/README.md``), so one file serves the data loaders and the NN workers alike.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RunSettings", "roc_auc", "MetricsLog", "log", "replica"]

#: Environment variables the orchestrator sets (the topology's defaults apply otherwise).
ENV_SAMPLES = "STREAM_PERSIA_SAMPLES"
ENV_EPOCHS = "STREAM_PERSIA_EPOCHS"
ENV_BATCH_SIZE = "STREAM_PERSIA_BATCH_SIZE"
ENV_EVAL_SAMPLES = "STREAM_PERSIA_EVAL_SAMPLES"
ENV_SEED = "STREAM_PERSIA_SEED"
ENV_STALENESS = "EMBEDDING_STALENESS"  # PERSIA's name
ENV_REPRODUCIBLE = "REPRODUCIBLE"  # PERSIA's name
ENV_OUTPUT_DIR = "PERSIA_OUTPUT_DIR"
ENV_DATA = "STREAM_PERSIA_DATA"  # a data dir or file, topology-specific


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(float(raw))  # accepts 1e6
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number; set it to an integer such as 1000000")
    if value < 0:
        raise SystemExit(f"{name}={raw!r} must be >= 0")
    return value


@dataclass
class RunSettings:
    """What one run does: sizes, batching, staleness and where results go.

    Every field has a topology default (passed by the script) that the environment
    variables above override; ``stream-persia run`` sets them from its flags.
    """

    samples: int
    batch_size: int
    eval_samples: int
    epochs: int = 1
    embedding_staleness: int = 1
    reproducible: bool = False
    seed: int = 0
    output_dir: str | None = None
    data: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, *, samples: int, batch_size: int, eval_samples: int, epochs: int = 1,
                 embedding_staleness: int = 1, seed: int = 0,
                 data: str | None = None) -> RunSettings:
        s = cls(samples=_env_int(ENV_SAMPLES, samples),
                batch_size=_env_int(ENV_BATCH_SIZE, batch_size),
                eval_samples=_env_int(ENV_EVAL_SAMPLES, eval_samples),
                epochs=_env_int(ENV_EPOCHS, epochs),
                embedding_staleness=_env_int(ENV_STALENESS, embedding_staleness),
                reproducible=bool(_env_int(ENV_REPRODUCIBLE, 0)),
                seed=_env_int(ENV_SEED, seed),
                output_dir=os.environ.get(ENV_OUTPUT_DIR) or None,
                data=os.environ.get(ENV_DATA) or data)
        if s.batch_size < 1:
            raise SystemExit(f"{ENV_BATCH_SIZE} must be >= 1, got {s.batch_size}")
        if s.embedding_staleness < 1:
            raise SystemExit(f"{ENV_STALENESS} must be >= 1, got {s.embedding_staleness}")
        if s.epochs < 1:
            raise SystemExit(f"{ENV_EPOCHS} must be >= 1, got {s.epochs}")
        return s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def replica() -> tuple[int, int]:
    """This process's (index, count) among its role's replicas (PERSIA's env names)."""
    index = _env_int("REPLICA_INDEX", 0)
    size = _env_int("REPLICA_SIZE", 1)
    if size < 1 or index >= size:
        raise SystemExit(f"REPLICA_INDEX={index} must be < REPLICA_SIZE={size}")
    return index, size


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties get half credit), vectorised.

    Args:
        labels: 0/1 (any shape; flattened).
        scores: higher means more likely positive (same number of elements).

    Returns:
        The AUC, or NaN when only one class is present.
    """
    y = np.asarray(labels).reshape(-1) > 0.5
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels has {y.size} elements but scores has {s.size}")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    # Average rank (1-based) of each group of tied scores.
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks = np.repeat(avg, ends - starts)
    pos_rank_sum = ranks[y[order]].sum()
    return float((pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log(role: str, msg: str) -> None:
    """One progress line on stderr (the orchestrator collects role output)."""
    print(f"[{time.strftime('%H:%M:%S')}] {role}: {msg}", file=sys.stderr, flush=True)


class MetricsLog:
    """Collects a run's metrics and writes them as ``metrics.json`` in the output dir.

    The file is replaced atomically on every :meth:`write`, so the orchestrator can read
    partial progress at any time. Schema::

        {"topology": str, "rank": int, "settings": {...},
         "train": {"samples": int, "batches": int, "seconds": float,
                   "samples_per_s": float},
         "loss_curve": [[samples_seen, mean_loss], ...],
         "eval_curve": [[samples_seen, {task: auc}], ...],
         "auc": {task: float}, "bayes_auc": {task: float} (when known),
         "eval": {...topology-specific extras...}, "checkpoint": str | null}
    """

    def __init__(self, topology: str, settings: RunSettings, rank: int = 0):
        self.data: dict[str, Any] = {
            "topology": topology, "rank": rank, "settings": settings.as_dict(),
            "train": {}, "loss_curve": [], "eval_curve": [], "auc": {}, "eval": {},
            "checkpoint": None,
        }
        self.output_dir = Path(settings.output_dir) if settings.output_dir else None
        name = "metrics.json" if rank == 0 else f"metrics.rank{rank}.json"
        self.path = self.output_dir / name if self.output_dir else None

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
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, default=_jsonable)
        os.replace(tmp, self.path)
        return self.path


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
