"""Progressive validation: every training batch scored by the model before it learns from it.

The forward pass of a training batch already holds predictions made before the update;
:class:`ProgressiveValidation` accumulates, per task, from those predictions and the
batch's labels:

- ``auc``: the AUC of the last ``window_samples`` samples, exact: a ring buffer of
  (prediction, label) pairs, ranked with ties averaged (the Mann-Whitney statistic) when
  read. Reading sorts the window (about 10 ms for 100,000 samples); accumulating is a copy
  into the ring and a few sums, numpy on the batch's arrays.
- ``ne`` / ``lifetime_ne``: normalized entropy, the mean log loss over the entropy of the
  base rate of the same samples (1.0: no better than always predicting the base rate),
  over the window and over every sample seen.
- ``calibration`` / ``lifetime_calibration``: mean prediction over mean label.
- ``log_loss`` / ``lifetime_log_loss``: mean binary cross-entropy, predictions clipped to
  ``[EPS, 1 - EPS]``.

Predictions are probabilities (the models' outputs after their sigmoid). A sample whose
prediction is not finite or outside [0, 1], or whose label is not 0 or 1, is counted in
``skipped`` and left out (a warning is logged the first time for a task): progressive
validation never stops training. A finite prediction outside [0, 1] says more: the model
does not output probabilities (logits, for ``BCEWithLogitsLoss``), and the samples whose
logits happen to fall in [0, 1] are no sample of its predictions. From the first one on,
the task's figures are None (``not_probabilities`` counts them, a warning says so) rather
than metrics of that biased subset. A batch whose predictions and labels do not pair up
(different sample counts, tasks without labels) is a misuse of the model or its labels:
:class:`~stream_persia.errors.BadInput` naming the field.

Several DDP ranks: each keeps its own state over the samples it trained;
:meth:`ProgressiveValidation.read` merges them with one ``all_gather_object`` of the small
state (the windows and the sums), so every rank must read at the same step. The ranks of a
``TrainCtx`` already step in lockstep and share a process group (the non-finite check's
all-reduce), so a collective read costs no new channel; each rank's window is
``ceil(window_samples / world_size)`` so the merged window covers ``window_samples``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from stream_persia.config import ProgressiveConfig
from stream_persia.errors import BadInput, Misuse

__all__ = ["ProgressiveValidation", "TaskState", "auc_exact", "summarize",
           "progressive_config", "EPS", "DEFAULT_WINDOW"]

log = logging.getLogger(__name__)

#: Predictions are clipped to [EPS, 1 - EPS] for the log loss.
EPS = 1e-7
#: Samples in the windowed metrics by default.
DEFAULT_WINDOW = 100_000


def progressive_config() -> ProgressiveConfig:
    """The job's ``progressive`` section: from the global config file
    ``PERSIA_GLOBAL_CONFIG`` names, else the defaults (as
    :func:`~stream_persia.nn.dense_publisher.model_updates_config` does)."""
    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if not path:
        return ProgressiveConfig()
    from stream_persia.config import load_global_config

    return load_global_config(path).progressive


def auc_exact(preds: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC AUC of ``preds`` for binary ``labels`` (ties count one half); None without
    both classes."""
    pos = labels.astype(bool)
    n_pos = int(pos.sum())
    n_neg = pos.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    uniq, inverse, counts = np.unique(preds, return_inverse=True, return_counts=True)
    # the average 1-based rank of each distinct value: its first rank plus (count - 1) / 2
    first = np.cumsum(counts) - counts + 1
    ranks = (first + (counts - 1) / 2.0)[inverse]
    u = float(ranks[pos].sum()) - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


def _entropy(rate: float) -> float:
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def _log_loss_sum(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), EPS, 1 - EPS)
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).sum())


class TaskState:
    """One task's accumulator: the window ring and the lifetime sums (no I/O, no torch)."""

    def __init__(self, name: str, window: int):
        self.name = name
        self.window = window
        self._preds = np.zeros(window, dtype=np.float32)
        self._labels = np.zeros(window, dtype=np.uint8)
        self._pos = 0          # the next slot of the ring written
        self._filled = 0       # slots holding a sample
        self.samples = 0
        self.skipped = 0
        self.not_probabilities = 0   # finite predictions outside [0, 1] (logits?)
        self.sum_pred = 0.0
        self.sum_label = 0.0
        self.sum_log_loss = 0.0

    def add(self, preds: np.ndarray, labels: np.ndarray) -> None:
        """Add one batch: ``preds`` and ``labels`` 1-D, of the same length."""
        ok = np.isfinite(preds) & (preds >= 0) & (preds <= 1) & ((labels == 0) | (labels == 1))
        if not ok.all():
            outside = int(np.count_nonzero(np.isfinite(preds) & ((preds < 0) | (preds > 1))))
            if outside and not self.not_probabilities:
                log.warning("progressive validation of task %s: the model's predictions are "
                            "not probabilities (%d outside [0, 1] in a batch: logits?); the "
                            "task's figures are None from now on (apply a sigmoid in the "
                            "model's output to have them)", self.name, outside)
            self.not_probabilities += outside
            bad = int(ok.size - ok.sum())
            if not self.skipped:
                log.warning("progressive validation of task %s: %d sample(s) of a batch "
                            "skipped (prediction not a probability in [0, 1] or label not "
                            "0/1); counted in 'skipped'", self.name, bad)
            self.skipped += bad
            preds, labels = preds[ok], labels[ok]
        n = preds.size
        if n == 0:
            return
        self.samples += n
        self.sum_pred += float(preds.sum(dtype=np.float64))
        self.sum_label += float(labels.sum(dtype=np.float64))
        self.sum_log_loss += _log_loss_sum(preds, labels)
        if n >= self.window:
            self._preds[:] = preds[-self.window:]
            self._labels[:] = labels[-self.window:]
            self._pos, self._filled = 0, self.window
            return
        end = self._pos + n
        if end <= self.window:
            self._preds[self._pos:end] = preds
            self._labels[self._pos:end] = labels
        else:
            k = self.window - self._pos
            self._preds[self._pos:] = preds[:k]
            self._labels[self._pos:] = labels[:k]
            self._preds[:n - k] = preds[k:]
            self._labels[:n - k] = labels[k:]
        self._pos = end % self.window
        self._filled = min(self.window, self._filled + n)

    def state(self) -> dict[str, Any]:
        """The mergeable state: the window's samples (order does not matter) and the sums."""
        return {"preds": self._preds[:self._filled].copy(),
                "labels": self._labels[:self._filled].copy(),
                "samples": self.samples, "skipped": self.skipped,
                "not_probabilities": self.not_probabilities, "sum_pred": self.sum_pred,
                "sum_label": self.sum_label, "sum_log_loss": self.sum_log_loss}


def summarize(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of one task from the :meth:`TaskState.state` of every rank."""
    preds = np.concatenate([s["preds"] for s in states])
    labels = np.concatenate([s["labels"] for s in states])
    n = sum(int(s["samples"]) for s in states)
    sum_pred = sum(float(s["sum_pred"]) for s in states)
    sum_label = sum(float(s["sum_label"]) for s in states)
    sum_ll = sum(float(s["sum_log_loss"]) for s in states)
    outside = sum(int(s.get("not_probabilities", 0)) for s in states)
    out: dict[str, Any] = {"samples": n, "skipped": sum(int(s["skipped"]) for s in states),
                           "not_probabilities": outside, "window_samples": int(preds.size)}
    if outside:   # not a probability model: no figure of the subset that looked like one
        return out | dict.fromkeys(("auc", "log_loss", "ne", "calibration", "lifetime_log_loss",
                                    "lifetime_ne", "lifetime_calibration"))
    if preds.size:
        y = labels.astype(np.float64)
        ll = _log_loss_sum(preds, y) / preds.size
        h = _entropy(float(y.mean()))
        out.update(auc=auc_exact(preds, labels), log_loss=ll, ne=ll / h if h else None,
                   calibration=float(preds.sum(dtype=np.float64)) / y.sum() if y.sum()
                   else None)
    else:
        out.update(auc=None, log_loss=None, ne=None, calibration=None)
    if n:
        ll = sum_ll / n
        h = _entropy(sum_label / n)
        out.update(lifetime_log_loss=ll, lifetime_ne=ll / h if h else None,
                   lifetime_calibration=sum_pred / sum_label if sum_label else None)
    else:
        out.update(lifetime_log_loss=None, lifetime_ne=None, lifetime_calibration=None)
    return out


class ProgressiveValidation:
    """Per-task progressive metrics of one NN rank (module docstring).

    Args:
        window_samples: samples in the windowed metrics, over every rank together.
        world_size: the NN ranks (each keeps ``ceil(window_samples / world_size)``).
        tasks: task names, one per (output, label) pair; default ``task0``, ``task1``, ...
            as batches show how many there are.
    """

    def __init__(self, window_samples: int = DEFAULT_WINDOW, world_size: int = 1,
                 tasks: Sequence[str] | None = None):
        if isinstance(window_samples, bool) or not isinstance(window_samples, int) \
                or not 1 <= window_samples <= 1 << 30:
            raise Misuse(f"window_samples must be an int in [1, 2**30], got "
                         f"{window_samples!r}", field="window_samples")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise Misuse(f"world_size must be an int >= 1, got {world_size!r}",
                         field="world_size")
        if tasks is not None and (not all(isinstance(t, str) for t in tasks)
                                  or len(set(tasks)) != len(tasks)):
            raise Misuse(f"tasks must be distinct strings, got {tasks!r}", field="tasks")
        self.window_samples = window_samples
        self.world_size = world_size
        self.rank_window = -(-window_samples // world_size)
        self.task_names = list(tasks) if tasks is not None else None
        self.tasks: list[TaskState] = []

    def add(self, preds: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> None:
        """Add one batch: one prediction array and one label array per task (any shape
        with one value per sample).

        Raises:
            BadInput: the numbers of tasks differ from the first batch's or from the
                names given, or a task's predictions and labels differ in size.
        """
        if len(preds) != len(labels):
            raise BadInput(f"the model gave {len(preds)} prediction(s) but the batch has "
                           f"{len(labels)} label(s): progressive validation pairs them",
                           field="labels")
        if not self.tasks:
            names = self.task_names or [f"task{i}" for i in range(len(preds))]
            if len(names) != len(preds):
                raise BadInput(f"the model names {len(names)} task(s) {names} but gives "
                               f"{len(preds)} prediction(s)", field="tasks")
            self.tasks = [TaskState(n, self.rank_window) for n in names]
        elif len(preds) != len(self.tasks):
            raise BadInput(f"{len(preds)} task(s) in this batch, {len(self.tasks)} before",
                           field="labels")
        flat = []
        for task, p, y in zip(self.tasks, preds, labels, strict=True):
            p, y = np.asarray(p).reshape(-1), np.asarray(y).reshape(-1)
            if p.size != y.size:
                raise BadInput(f"task {task.name}: {p.size} predictions for {y.size} labels",
                               field="predictions")
            flat.append((p, y))
        for task, (p, y) in zip(self.tasks, flat, strict=True):
            task.add(p, y)

    def state(self) -> list[dict[str, Any]]:
        """This rank's state, one entry per task (what :meth:`read` gathers)."""
        return [{"name": t.name, **t.state()} for t in self.tasks]

    def read(self, gather: Any = None) -> dict[str, dict[str, Any]]:
        """Metrics per task, merged over the ranks.

        Args:
            gather: with several ranks, a function from this rank's :meth:`state` to the
                list of every rank's (``TrainCtx`` passes an ``all_gather_object``);
                every rank must call it at the same step.
        """
        states = [self.state()] if gather is None else gather(self.state())
        names = next(([t["name"] for t in rank] for rank in states if rank), [])
        out: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(names):
            merged = summarize([rank[i] for rank in states if i < len(rank)])
            out[name] = {"window": self.window_samples, **merged}
        return out
