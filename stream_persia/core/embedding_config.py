"""The embedding hyperparameters every embedding server applies: :class:`EmbeddingConfig` (PERSIA's ``persia.embedding.EmbeddingConfig``; re-exported there), and the per-feature-group table policies of issue 20, :class:`SlotPolicy`."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from stream_persia.errors import BadInput

__all__ = ["EmbeddingConfig", "SlotPolicy", "MAX_CAPACITY", "MAX_MIN_COUNT", "MAX_TTL_STEPS",
           "ROW_DTYPES", "MIN_SKETCH_BYTES", "MAX_SKETCH_BYTES", "SKETCH_BYTES"]

#: The most rows one store holds (both stores, any number of store threads): the Cython
#: store's hash table has at most 2**31 slots and int32 row counters. The config loader
#: and ``launch embedding-server --capacity`` refuse more, naming the key or the flag.
MAX_CAPACITY = 2**30
#: The highest ``min_count``: the stores count ids in 8-bit saturating counters.
MAX_MIN_COUNT = 255
#: The longest ``ttl_steps``: the stores keep a row's step in 32 bits.
MAX_TTL_STEPS = 2**31 - 1
#: Bounds and default of each embedding server's frequency-admission sketch
#: (``admission.sketch_bytes``; the stores' :mod:`stream_persia.server.policies` and the
#: config loader check the same ones).
MIN_SKETCH_BYTES, MAX_SKETCH_BYTES, SKETCH_BYTES = 1 << 12, 1 << 34, 8 << 20
#: Storage dtypes of row weights (optimizer state stays float32; lookups return float32).
ROW_DTYPES = ("float32", "float16", "bfloat16")


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SlotPolicy:
    """How a store keeps the rows of one feature group (issue 20); the default keeps
    today's behaviour (the store's admission probability, global LRU only).

    Args:
        admit_probability: probability in [0, 1] that a training miss admits the id
            (after ``min_count``); None: the store's ``EmbeddingConfig.admit_probability``.
        min_count: a row only at the k-th training lookup of the id (counted in the store's
            count-min sketch); earlier lookups return the id's initial row and store
            nothing. 1: off. At most 255.
        ttl_s: rows not looked up in training for this many seconds expire (``expire()``).
        ttl_steps: rows not looked up in training for this many training lookup calls of
            the store expire.
        max_rows: the group's row cap: beyond it a row not looked up since it was last
            queued is evicted (second chance, as CLOCK; see the store's docstring).
        dtype: storage dtype of the row weights: float32, float16 or bfloat16.
    """

    admit_probability: float | None = None
    min_count: int = 1
    ttl_s: float | None = None
    ttl_steps: int | None = None
    max_rows: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        p = self.admit_probability
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) \
                    or not 0.0 <= float(p) <= 1.0:
                raise BadInput(f"admit_probability must be a number in [0, 1] or null, got "
                               f"{p!r}", field="admit_probability")
            object.__setattr__(self, "admit_probability", float(p))
        if not _is_int(self.min_count) or not 1 <= self.min_count <= MAX_MIN_COUNT:
            raise BadInput(f"min_count must be an int in [1, {MAX_MIN_COUNT}], got "
                           f"{self.min_count!r}", field="min_count",
                           hint="1 admits at the first training lookup (off)")
        t = self.ttl_s
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) \
                    or not math.isfinite(float(t)) or float(t) <= 0:
                raise BadInput(f"ttl_s must be a finite number of seconds > 0 or null, got {t!r}",
                               field="ttl_s", hint="e.g. 86400 for a day")
            object.__setattr__(self, "ttl_s", float(t))
        n = self.ttl_steps
        if n is not None and (not _is_int(n) or not 1 <= n <= MAX_TTL_STEPS):
            raise BadInput(f"ttl_steps must be an int in [1, {MAX_TTL_STEPS}] or null, got "
                           f"{n!r}", field="ttl_steps")
        m = self.max_rows
        if m is not None and (not _is_int(m) or not 1 <= m <= MAX_CAPACITY):
            raise BadInput(f"max_rows must be an int in [1, {MAX_CAPACITY}] or null, got "
                           f"{m!r}", field="max_rows")
        if self.dtype not in ROW_DTYPES:
            raise BadInput(f"dtype must be one of {', '.join(ROW_DTYPES)}, got {self.dtype!r}",
                           field="dtype")

    @property
    def is_default(self) -> bool:
        """True when the policy changes nothing (``SlotPolicy()``)."""
        return self == SlotPolicy()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> SlotPolicy:
        """Build from a dict of the keys above (missing ones default); errors are
        BadInput whose field is ``<where>.<key>`` (``where`` e.g. ``slots_config.user``)."""
        def name(key: str) -> str:
            return f"{where}.{key}" if where else key

        if not isinstance(d, dict):
            raise BadInput(f"a slot policy must be a mapping, got {type(d).__name__}",
                           field=where or None)
        keys = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(keys))
        if unknown:
            raise BadInput(f"unknown policy key(s) {unknown}", field=name(str(unknown[0])),
                           hint="accepted: " + ", ".join(keys))
        try:
            return cls(**d)
        except BadInput as e:
            raise BadInput(e.message, field=name(e.field or ""), hint=e.hint) from None
