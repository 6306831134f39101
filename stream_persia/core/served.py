"""A served batch: what an embedding worker answers ``next_batch`` and ``lookup_batch`` with.

Wire schema (a msgpack map, :mod:`stream_persia.core.wire`; built by
:mod:`stream_persia.worker.service`)::

    {"batch_id": int,                 # < 0 for an evaluation lookup (not pushed back)
     "requires_grad": bool, "meta": bytes | None, "batch_size": int >= 1,
     "embeddings": [                  # one per ID slot, in the batch's order
         {"name": str, "kind": "sum", "emb": float32[batch_size, dim]}
       | {"name": str, "kind": "raw", "emb": float32[n + 1, dim],     # row 0: padding
          "index": int[batch_size, k] (rows of emb), "mask": bool[batch_size, k]}],
     "non_id_type_features": [{"name": str | None, "data": array[batch_size, ...]}],
     "labels": [{"name": str | None, "data": array[batch_size, ...]}],
     "config"?: str,                  # the servers' configuration digest
     "missing"?: int,                 # lookup_batch: distinct ids the servers lacked
     "event_time"?: float | int}      # the PersiaBatch's event time (seconds since the
                                      # Unix epoch, finite, >= 0); absent: None

:meth:`ServedBatch.from_wire` checks a received map once, every key, dtype and shape the
readers rely on, and raises :class:`~stream_persia.errors.BadInput` naming the field
(``embeddings[2].index``); the NN worker (:func:`stream_persia.nn.batch.from_served`) and
the API (:func:`stream_persia.api.embeddings.served_tensors`) read the result. Its arrays
are the received ones (read-only views of the frame): readers copy what they keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

import numpy as np

from stream_persia.core.data import check_event_time
from stream_persia.errors import BadInput

__all__ = ["ServedBatch", "ServedBatchWire", "ServedFeature", "ServedSlot", "ServedSlotWire"]


class ServedSlotWire(TypedDict):
    name: str
    kind: Literal["sum", "raw"]
    emb: np.ndarray
    index: NotRequired[np.ndarray]
    mask: NotRequired[np.ndarray]


class ServedFeatureWire(TypedDict):
    name: str | None
    data: np.ndarray


class ServedBatchWire(TypedDict):
    batch_id: int
    requires_grad: bool
    meta: bytes | None
    batch_size: int
    embeddings: list[ServedSlotWire]
    non_id_type_features: list[ServedFeatureWire]
    labels: list[ServedFeatureWire]
    config: NotRequired[str]
    missing: NotRequired[int]
    event_time: NotRequired[float]


@dataclass(frozen=True, eq=False)
class ServedSlot:
    """One slot's embeddings: ``emb`` float32 ``(batch, dim)`` (``sum``) or ``(n + 1,
    dim)`` with ``index`` (integer, ``(batch, k)``, every value a row of ``emb``) and
    ``mask`` (bool, same shape) (``raw``)."""

    name: str
    kind: Literal["sum", "raw"]
    emb: np.ndarray
    index: np.ndarray | None = None
    mask: np.ndarray | None = None

    def is_raw(self) -> bool:
        return self.kind == "raw"


@dataclass(frozen=True, eq=False)
class ServedFeature:
    """A non-ID feature or a label: ``data`` has ``batch_size`` rows."""

    name: str | None
    data: np.ndarray


@dataclass(frozen=True, eq=False)
class ServedBatch:
    """A served batch, checked (see the module docstring).

    Attributes:
        labels: None when the batch carries none (inference).
        batch_id: None for an evaluation lookup (a negative id on the wire).
        config: the servers' configuration digest, when the worker knows it.
        missing: ``lookup_batch``: distinct ids the servers did not hold (0 otherwise).
        event_time: the data loader's event time of the batch (seconds since the Unix
            epoch of its newest sample), None when it carries none.
    """

    batch_size: int
    embeddings: tuple[ServedSlot, ...]
    non_id_type_features: tuple[ServedFeature, ...] = ()
    labels: tuple[ServedFeature, ...] | None = None
    batch_id: int | None = None
    requires_grad: bool = False
    meta: bytes | None = None
    missing: int = 0
    config: str | None = None
    event_time: float | None = None

    @classmethod
    def from_wire(cls, d: object) -> ServedBatch:
        """Check and decode a served batch map.

        Raises:
            BadInput: ``d`` does not have the documented shape (names the field).
        """
        if not isinstance(d, dict):
            raise BadInput(f"served batch must be a map, got {type(d).__name__}",
                           field="batch")
        size = d.get("batch_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise BadInput(f"served batch: batch_size must be an int >= 1, got {size!r:.80}",
                           field="batch_size")
        slots = _list(d, "embeddings", required=True)
        labels = _list(d, "labels")
        bid = d.get("batch_id")
        meta = d.get("meta")
        if meta is not None and not isinstance(meta, bytes):
            raise _bad("meta", "bytes or None", meta)
        requires_grad = d.get("requires_grad", False)
        if not isinstance(requires_grad, bool):
            raise _bad("requires_grad", "a bool", requires_grad)
        missing = d.get("missing") or 0
        if not isinstance(missing, int) or isinstance(missing, bool) or missing < 0:
            raise _bad("missing", "an int >= 0", missing)
        config = d.get("config")
        if config is not None and not isinstance(config, str):
            raise _bad("config", "a string or None", config)
        event_time = check_event_time(d.get("event_time"), "event_time")
        return cls(
            batch_size=size,
            embeddings=tuple(_slot(e, f"embeddings[{i}]", size) for i, e in enumerate(slots)),
            non_id_type_features=_features(_list(d, "non_id_type_features"),
                                           "non_id_type_features", size),
            labels=_features(labels, "labels", size) if labels else None,
            batch_id=bid if isinstance(bid, int) and not isinstance(bid, bool) and bid >= 0
            else None,
            requires_grad=requires_grad, meta=meta, missing=missing, config=config,
            event_time=event_time)


def _bad(where: str, want: str, got: object) -> BadInput:
    shown = (f"{got.dtype} {got.shape}" if isinstance(got, np.ndarray)
             else f"{type(got).__name__} {got!r:.80}")
    return BadInput(f"served batch: {where} must be {want}, got {shown}", field=where)


def _list(d: dict[str, Any], key: str, required: bool = False) -> list[Any]:
    v = d.get(key)
    if v is None and not required:
        return []
    if not isinstance(v, list):
        raise _bad(key, "a list", v)
    return v


def _array(d: dict[str, Any], key: str, where: str, want: str, kind: str, ndim: int | None,
           rows: int | None) -> np.ndarray:
    """``d[key]``: an array of dtype kind ``kind`` (numpy's letter codes; "" any),
    ``ndim`` dimensions (None: at least 1) and ``rows`` rows (None: at least 1)."""
    a = d.get(key)
    ok = (isinstance(a, np.ndarray) and (not kind or a.dtype.kind in kind)
          and (a.ndim == ndim if ndim is not None else a.ndim >= 1)
          and (a.shape[0] == rows if rows is not None else a.shape[0] >= 1))
    if not ok:
        raise _bad(f"{where}.{key}", want, a)
    assert isinstance(a, np.ndarray)
    return a


def _slot(e: object, where: str, size: int) -> ServedSlot:
    if not isinstance(e, dict):
        raise _bad(where, "a map {name, kind, emb, ...}", e)
    name, kind = e.get("name"), e.get("kind")
    if not isinstance(name, str):
        raise _bad(f"{where}.name", "a string", name)
    if kind not in ("sum", "raw"):
        raise BadInput(f"served batch: {where}.kind is {kind!r:.80}, not 'sum' or 'raw'",
                       field=f"{where}.kind")
    if kind == "sum":
        emb = _array(e, "emb", where, f"float32 ({size}, dim)", "f", 2, size)
        if emb.dtype != np.float32:
            raise _bad(f"{where}.emb", f"float32 ({size}, dim)", emb)
        return ServedSlot(name, "sum", emb)
    emb = _array(e, "emb", where, "float32 (rows + 1, dim)", "f", 2, None)
    if emb.dtype != np.float32:
        raise _bad(f"{where}.emb", "float32 (rows + 1, dim)", emb)
    index = _array(e, "index", where, f"an int array ({size}, k)", "iu", 2, size)
    mask = _array(e, "mask", where, f"a bool array of index's shape {index.shape}", "b", 2,
                  size)
    if mask.shape != index.shape:
        raise _bad(f"{where}.mask", f"a bool array of index's shape {index.shape}", mask)
    if index.size and (int(index.min()) < 0 or int(index.max()) >= len(emb)):
        raise BadInput(f"served batch: {where}.index holds rows outside [0, {len(emb)}) "
                       f"(min {int(index.min())}, max {int(index.max())})",
                       field=f"{where}.index")
    return ServedSlot(name, "raw", emb, index, mask)


def _features(items: list[Any], group: str, size: int) -> tuple[ServedFeature, ...]:
    out = []
    for i, f in enumerate(items):
        where = f"{group}[{i}]"
        if not isinstance(f, dict):
            raise _bad(where, "a map {name, data}", f)
        name = f.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{where}.name", "a string or None", name)
        out.append(ServedFeature(name, _array(f, "data", where, f"an array of {size} rows",
                                              "", None, size)))
    return tuple(out)
