"""The embedding hyperparameters every embedding server applies: :class:`EmbeddingConfig` (PERSIA's ``persia.embedding.EmbeddingConfig``; re-exported there)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stream_persia.errors import BadInput

__all__ = ["EmbeddingConfig", "MAX_CAPACITY"]

#: The most rows one store holds (both stores, any number of store threads): the Cython
#: store's hash table has at most 2**31 slots and int32 row counters. The config loader
#: and ``launch embedding-server --capacity`` refuse more, naming the key or the flag.
MAX_CAPACITY = 2**30


@dataclass(frozen=True)
class EmbeddingConfig:
    """Embedding hyperparameters applied on every embedding server (PERSIA's defaults).

    Args:
        emb_initialization: (lower, upper) bounds of the uniform initialisation of new rows.
        admit_probability: probability in [0, 1] that a training lookup of an unknown id
            admits it; otherwise zeros are returned and nothing is stored.
        weight_bound: every element is clamped to [-weight_bound, weight_bound] after each
            update.
    """

    emb_initialization: tuple[float, float] = (-0.01, 0.01)
    admit_probability: float = 1.0
    weight_bound: float = 10.0

    def __post_init__(self) -> None:
        init = self.emb_initialization
        if not (isinstance(init, (tuple, list)) and len(init) == 2):
            raise BadInput(
                f"emb_initialization must be a (lower, upper) pair, got {init!r}",
                field="emb_initialization", hint="for example (-0.01, 0.01)")
        lo, hi = float(init[0]), float(init[1])
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise BadInput(
                f"emb_initialization must be finite with lower <= upper, got {init!r}",
                field="emb_initialization")
        object.__setattr__(self, "emb_initialization", (lo, hi))
        p = float(self.admit_probability)
        if not (0.0 <= p <= 1.0):
            raise BadInput(f"admit_probability must be in [0, 1], got {self.admit_probability!r}",
                           field="admit_probability")
        object.__setattr__(self, "admit_probability", p)
        wb = float(self.weight_bound)
        if not (wb > 0.0) or math.isnan(wb):
            raise BadInput(f"weight_bound must be > 0, got {self.weight_bound!r}",
                           field="weight_bound", hint="use a large value such as 1e30 to disable")
        object.__setattr__(self, "weight_bound", wb)

    def to_dict(self) -> dict[str, Any]:
        return {"emb_initialization": list(self.emb_initialization),
                "admit_probability": self.admit_probability, "weight_bound": self.weight_bound}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EmbeddingConfig:
        unknown = set(d) - {"emb_initialization", "admit_probability", "weight_bound"}
        if unknown:
            raise BadInput(f"unknown EmbeddingConfig field(s) {sorted(unknown)}",
                           field=sorted(unknown)[0],
                           hint="accepted: emb_initialization, admit_probability, weight_bound")
        kw = dict(d)
        if "emb_initialization" in kw:
            kw["emb_initialization"] = tuple(kw["emb_initialization"])
        return cls(**kw)
