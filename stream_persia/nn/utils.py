"""Helpers for training scripts (PERSIA's ``persia.utils``) and evaluation metrics."""

from __future__ import annotations

import os
import random
import socket

import numpy as np

from stream_persia.errors import BadInput

__all__ = ["find_free_port", "roc_auc", "setup_seed"]


def setup_seed(seed: int) -> None:
    """Seed Python, numpy and torch (every CUDA device too) and make cuDNN deterministic.

    Together with ``DataLoader(reproducible=True, embedding_staleness=1)`` this makes a
    training run repeat exactly for a fixed input order.
    """
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ["PYTHONHASHSEED"] = str(seed)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free now (for ``MASTER_PORT`` in local runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve, from ranks (ties get their average rank).

    Equals the probability that a random positive scores above a random negative, ties
    counting one half: the same value as ``sklearn.metrics.roc_auc_score`` for binary
    labels, in O(n log n) without sklearn.

    Args:
        labels: 0/1 (or bool) per sample, any shape.
        scores: a real score per sample, same number of elements.

    Raises:
        BadInput: sizes differ, labels are not 0/1, a score is NaN, or only one class is
            present (the AUC is undefined).
    """
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.size != s.size:
        raise BadInput(f"labels has {y.size} elements but scores has {s.size}",
                       field="scores", hint="one score per label")
    if y.dtype != np.bool_:
        yf = y.astype(np.float64)
        if not np.isin(yf, (0.0, 1.0)).all():
            raise BadInput("labels must be 0 or 1", field="labels",
                           hint="threshold soft labels before computing the AUC")
        y = yf == 1.0
    if np.isnan(s).any():
        raise BadInput("scores contain NaN", field="scores")
    n_pos = int(np.count_nonzero(y))
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise BadInput(f"AUC needs both classes; got {n_pos} positives and {n_neg} negatives",
                       field="labels")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    first = np.empty(s.size, dtype=bool)
    first[0] = True
    np.not_equal(sorted_s[1:], sorted_s[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], s.size)
    average_rank = (starts + ends + 1) / 2.0      # mean of the 1-based ranks starts+1..ends
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = average_rank[np.cumsum(first) - 1]
    rank_sum = float(ranks[y].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
