"""Standalone (no stream-persia runtime) emulation of the embedding servers for checks.

The ``check_standalone.py`` scripts of the topologies train their model in one process
with plain PyTorch to tell "this model cannot learn this data at this size" apart from
"the distributed pipeline loses accuracy". :class:`RowTable` keeps the embedding rows the
way the embedding servers do: gradients summed per row within a batch, then one
per-row optimizer step (Adam with a per-row step count, or PERSIA's Adagrad, which steps
with the accumulator before adding g²). Ids are hashed into a fixed table (a collision
merges two ids' rows; with a table much larger than the ids that matter, that is noise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

_TOPOLOGIES = str(Path(__file__).resolve().parent)
if _TOPOLOGIES not in sys.path:
    sys.path.insert(0, _TOPOLOGIES)

from streamgen import stable_hash64  # noqa: E402

__all__ = ["RowTable"]

_SALT = np.uint64(0xBF58476D1CE4E5B9)


class RowTable:
    """Embedding rows in one hashed table with a per-row optimizer (server semantics)."""

    def __init__(self, rows: int, dim: int, optimizer: str, lr: float,
                 init: tuple[float, float] = (-0.01, 0.01), seed: int = 0,
                 initial_accumulator_value: float = 1e-2):
        g = torch.Generator().manual_seed(seed)
        self.rows = rows
        self.w = torch.rand(rows, dim, generator=g) * (init[1] - init[0]) + init[0]
        self.optimizer, self.lr = optimizer, lr
        if optimizer == "adam":
            self.m = torch.zeros(rows, dim)
            self.v = torch.zeros(rows, dim)
            self.t = torch.zeros(rows, 1)
        else:
            self.acc = torch.full((rows, dim), initial_accumulator_value)

    def index(self, ids: np.ndarray, slot: int | None = None) -> torch.Tensor:
        """Rows of ids: (n, slots), column k salted as slot k so that slots never share a
        row; or any shape with an explicit ``slot``."""
        ids = np.asarray(ids, dtype=np.uint64)
        with np.errstate(over="ignore"):
            if slot is None:
                salt = np.arange(ids.shape[1], dtype=np.uint64) * _SALT
            else:
                salt = np.uint64(slot) * _SALT
        h = stable_hash64(ids ^ salt) % np.uint64(self.rows)
        return torch.from_numpy(h.astype(np.int64))

    def step(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply one batch's gradients: ``grads[..., :]`` belongs to row ``rows[...]``."""
        uniq, inv = torch.unique(rows.reshape(-1), return_inverse=True)
        g = torch.zeros(len(uniq), grads.shape[-1]).index_add_(
            0, inv, grads.reshape(-1, grads.shape[-1]))
        if self.optimizer == "adam":
            b1, b2 = 0.9, 0.999
            m = self.m[uniq].mul_(b1).add_(g, alpha=1 - b1)
            v = self.v[uniq].mul_(b2).addcmul_(g, g, value=1 - b2)
            t = self.t[uniq] + 1
            mh = m / (1 - b1 ** t)
            vh = v / (1 - b2 ** t)
            self.w[uniq] -= self.lr * mh / (vh.sqrt() + 1e-8)
            self.m[uniq], self.v[uniq], self.t[uniq] = m, v, t
        else:  # PERSIA's Adagrad: step with the accumulator before adding g^2
            acc = self.acc[uniq]
            self.w[uniq] -= self.lr * g / (acc + 1e-10).sqrt()
            self.acc[uniq] = acc + g * g
