"""The embedding hyperparameters every embedding server applies: :class:`EmbeddingConfig` (PERSIA's ``persia.embedding.EmbeddingConfig``; re-exported there), and the per-feature-group table policies :class:`SlotPolicy` (admission, TTL, row caps, row dtype)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from stream_persia.errors import BadInput

__all__ = ["EmbeddingConfig", "MAX_CAPACITY", "SlotPolicy", "ROW_DTYPES"]

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


#: The storage dtypes of a row's weights (optimizer state stays float32; lookups float32).
ROW_DTYPES = ("float32", "float16", "bfloat16")
_MAX_MIN_COUNT = 1 << 20


@dataclass(frozen=True)
class SlotPolicy:
    """How one feature group's rows are admitted, expired, capped and stored.

    Args:
        admit_probability: probability in [0, 1] that a training lookup of an unknown id
            admits it; None: the store's :class:`EmbeddingConfig` decides.
        min_count: a row is stored only at the ``min_count``-th training lookup of the id
            (frequency admission; 1: off).
        ttl_s: rows not looked up in training for this many seconds expire (None: never).
        ttl_steps: rows not looked up in training for this many training lookup calls of
            the store expire (None: never).
        max_rows: the most rows the group holds; beyond it its least recently used row is
            evicted (None: only the store's capacity).
        dtype: storage dtype of the row weights, one of :data:`ROW_DTYPES`.
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
        _check_int(self, "min_count", 1, _MAX_MIN_COUNT, optional=False,
                   hint="1 turns frequency admission off; 2 drops ids seen only once")
        t = self.ttl_s
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) \
                    or not (0.0 < float(t) < math.inf):
                raise BadInput(f"ttl_s must be a positive finite number of seconds or null, "
                               f"got {t!r}", field="ttl_s", hint="e.g. 86400 for a day")
            object.__setattr__(self, "ttl_s", float(t))
        _check_int(self, "ttl_steps", 1, 1 << 62, optional=True)
        _check_int(self, "max_rows", 1, MAX_CAPACITY, optional=True)
        if self.dtype not in ROW_DTYPES:
            raise BadInput(f"dtype must be one of {', '.join(ROW_DTYPES)}, got "
                           f"{self.dtype!r}", field="dtype")

    @property
    def is_default(self) -> bool:
        """Whether this policy is the default one (no policy: ``SlotPolicy()``)."""
        return self == SlotPolicy()

    def to_dict(self) -> dict[str, Any]:
        """Every field by name; :meth:`from_dict` takes it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> SlotPolicy:
        """Build from a mapping of field names; errors are BadInput naming the field as
        ``<where>.<key>`` (``slots_config.user_id.min_count`` from the config file)."""
        prefix = f"{where}." if where else ""
        if not isinstance(d, Mapping):
            raise BadInput(f"{where or 'policy'} must be a map of SlotPolicy fields, got "
                           f"{type(d).__name__}", field=where or "policy")
        fields = tuple(cls.__dataclass_fields__)
        for key in d:
            if key not in fields:
                raise BadInput(f"unknown SlotPolicy field {prefix}{key}", field=f"{prefix}{key}",
                               hint=f"accepted: {', '.join(fields)}")
        try:
            return cls(**d)
        except BadInput as e:
            raise BadInput(f"{prefix}{e.message}", field=f"{prefix}{e.field}",
                           hint=e.hint) from None


def _check_int(obj: Any, name: str, lo: int, hi: int, *, optional: bool,
               hint: str | None = None) -> None:
    v = getattr(obj, name)
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadInput(f"{name} must be an integer in [{lo}, {hi}]"
                       f"{' or null' if optional else ''}, got {v!r}", field=name, hint=hint)
