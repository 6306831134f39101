"""PERSIA's batch data types (``persia.embedding.data``): what a data loader sends.

A :class:`PersiaBatch` holds ID type features (sparse uint64 ids, looked up as embeddings),
non-ID type features (dense numpy arrays) and labels, plus optional ``meta`` bytes.
Unlike PERSIA, every check runs (PERSIA's per-sample ID check was a generator that was never
consumed), and every error names the feature and what was wrong.

Batch schema inside a wire frame (``to_wire()``; the frame itself is :mod:`stream_persia.core.wire`)::

    {
      "batch_size": int >= 1,
      "batch_id": int >= 0 | None,
      "requires_grad": bool,
      "meta": bytes | None,
      "id_type_features": [            # at least one; names unique
        {"name": str,
         "values": uint64[n_ids],       # every sample's ids, concatenated
         "offsets": int64[batch_size + 1] | None},
      ],                                # sample i is values[offsets[i]:offsets[i + 1]];
                                        # offsets None: IDTypeFeatureWithSingleID, one id each
      "non_id_type_features": [{"name": str, "data": array[batch_size, ...]}],
      "labels": [{"name": str, "data": array[batch_size, ...]}],
      "event_time"?: float | int,       # optional (absent: None): seconds since the Unix
    }                                   # epoch, finite and >= 0, of the newest sample

``event_time`` is what freshness is measured from (issue 18): ``DataCtx`` sets it to the
producer's clock when the batch is sent unless the user gave one, the embedding worker
passes it on with the batch's gradient update (the servers' ``trained_through``) and with
the served batch (:mod:`stream_persia.core.served`). ``to_wire`` leaves the key out when
the batch has none, so such frames are what older readers expect; a frame without it
decodes (None), one with a bad value is refused naming ``batch.event_time``.

Arrays are any of :data:`stream_persia.core.wire.SUPPORTED_DTYPES`. :meth:`PersiaBatch.from_wire`
re-checks all of it, since Kafka messages and RPC frames are untrusted.

Size: one module past 500 lines on purpose. The batch types, their wire schema (STYLE.md
habit 8) and the decoder of that schema share one set of checks (``check_csr``,
``check_event_time``, the dense types' constructors): a decoded frame is checked by the
very code that checks a batch a user builds, so the two can never disagree.
"""

from __future__ import annotations

import copy
import math
from operator import attrgetter
from typing import Any

import numpy as np

from stream_persia.core import wire
from stream_persia.errors import BadInput, WireError

__all__ = ["IDTypeFeature", "IDTypeFeatureWithSingleID", "NonIDTypeFeature", "Label",
           "PersiaBatch", "check_event_time"]

_U64 = np.dtype(np.uint64)
_I64 = np.dtype(np.int64)
_SUPPORTED = frozenset(d.str[1:] for d in wire.SUPPORTED_DTYPES)
_DTYPES_TEXT = ", ".join(str(d) for d in wire.SUPPORTED_DTYPES)
_DTYPE_NDIM = attrgetter("dtype", "ndim")
_MAX_U64 = (1 << 64) - 1


def check_event_time(value: Any, field: str = "event_time") -> float | None:
    """An event time checked: None, or a finite real number >= 0 (seconds since the Unix
    epoch, like ``time.time()``), as a float.

    The one check of event times: :class:`PersiaBatch`, its wire form, the served batch
    (:mod:`stream_persia.core.served`) and the embedding servers' ``update`` call it.

    Raises:
        BadInput: on ``field``, naming the value received (a bool is not a number here).
    """
    if value is None:
        return None
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating))
            or not math.isfinite(value) or value < 0):
        shown = f"{type(value).__name__} {value!r:.80}"
        raise BadInput(f"{field} must be a finite number of seconds since the Unix epoch "
                       f">= 0, or None, got {shown}", field=field,
                       hint="time.time() of the batch's newest sample")
    return float(value)


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise BadInput(f"{what} name must be a non-empty str, got {name!r}", field="name")
    return name


def _name_and_data(a: Any, b: Any) -> tuple[Any, Any]:
    # PERSIA's signature is (name, data) but its own docs also write (data, name).
    if isinstance(b, str) and not isinstance(a, str):
        return b, a
    return a, b


class IDTypeFeature:
    """Variable-length uint64 ids per sample (PERSIA's LIL sparse matrix), stored as CSR.

    Args:
        name: feature (slot) name, as in ``embedding_config.yml``.
        data: one 1-D ``np.uint64`` array per sample (empty samples allowed), or a 2-D
            ``np.uint64`` array whose rows are samples.

    Attributes:
        name: the feature name.
        values: 1-D uint64, every sample's ids concatenated.
        offsets: 1-D int64 of length ``batch_size + 1``; sample ``i`` is
            ``values[offsets[i]:offsets[i + 1]]``.

    Raises:
        BadInput: naming the feature, the sample and the dtype or shape found.
    """

    def __init__(self, name: str, data: list[np.ndarray] | np.ndarray):
        name, data = _name_and_data(name, data)
        self.name = _check_name(name, "IDTypeFeature")
        self.values, self.offsets = _lil_to_csr(self.name, data)

    @classmethod
    def from_csr(cls, name: str, values: np.ndarray, offsets: np.ndarray) -> IDTypeFeature:
        """Build from CSR arrays without copying them (offsets of another integer dtype are
        converted to int64)."""
        feature = object.__new__(IDTypeFeature)
        feature.name = _check_name(name, "IDTypeFeature")
        feature.values, feature.offsets = check_csr(feature.name, values, offsets)
        return feature

    @property
    def batch_size(self) -> int:
        return len(self.offsets) - 1

    @property
    def data(self) -> list[np.ndarray]:
        """The per-sample id arrays (views of :attr:`values`)."""
        if self.batch_size == 0:
            return []
        return np.split(self.values, self.offsets[1:-1])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, batch_size={self.batch_size}, "
                f"ids={len(self.values)})")


class IDTypeFeatureWithSingleID(IDTypeFeature):
    """Exactly one uint64 id per sample (PERSIA's fast path for single-valued features).

    Args:
        name: feature (slot) name.
        data: 1-D ``np.uint64`` array, one id per sample.

    ``offsets`` is ``arange(batch_size + 1)``; ``data`` returns the 1-D array itself.
    """

    def __init__(self, name: str, data: np.ndarray):
        name, data = _name_and_data(name, data)
        self.name = _check_name(name, "IDTypeFeatureWithSingleID")
        if not isinstance(data, np.ndarray) or data.dtype != _U64 or data.ndim != 1:
            raise BadInput(
                f"IDTypeFeatureWithSingleID {self.name!r}: data must be a 1-D np.uint64 "
                f"array, got {_describe(data)}", field=self.name,
                hint="np.asarray(ids, dtype=np.uint64); use IDTypeFeature for several ids "
                     "or empty samples")
        self.values = data
        self.offsets = np.arange(len(data) + 1, dtype=np.int64)

    @property
    def data(self) -> np.ndarray:  # type: ignore[override]
        return self.values


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"a {x.ndim}-D array of dtype {x.dtype}"
    return f"a {type(x).__name__}"


def _lil_to_csr(name: str, data: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(data, np.ndarray):
        if data.ndim == 2 and data.dtype == _U64:
            rows, width = data.shape
            values = np.ascontiguousarray(data).reshape(-1)
            return values, np.arange(rows + 1, dtype=np.int64) * width
        if data.ndim == 1 and data.dtype == object:
            data = list(data)
        else:
            raise BadInput(
                f"IDTypeFeature {name!r}: an array as data must be 2-D np.uint64 (one row per "
                f"sample), got {_describe(data)}", field=name,
                hint="pass a list of 1-D np.uint64 arrays, or use IDTypeFeatureWithSingleID "
                     "for one id per sample")
    if not isinstance(data, (list, tuple)):
        raise BadInput(f"IDTypeFeature {name!r}: data must be a list of 1-D np.uint64 arrays, "
                       f"got {_describe(data)}", field=name)
    n = len(data)
    if n == 0:
        return np.empty(0, dtype=np.uint64), np.zeros(1, dtype=np.int64)
    # C-speed whole-list checks; the per-sample loop below runs only to word the error.
    if set(map(type, data)) != {np.ndarray} or set(map(_DTYPE_NDIM, data)) != {(_U64, 1)}:
        for i, x in enumerate(data):
            if not isinstance(x, np.ndarray) or x.dtype != _U64 or x.ndim != 1:
                raise BadInput(
                    f"IDTypeFeature {name!r}: sample {i} is {_describe(x)}; every sample "
                    f"must be a 1-D np.uint64 array", field=name,
                    hint="np.asarray(ids, dtype=np.uint64)"
                         + ("; one id per sample? use IDTypeFeatureWithSingleID"
                            if isinstance(x, np.generic) else ""))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, data), dtype=np.int64, count=n), out=offsets[1:])
    return np.concatenate(data), offsets


def check_csr(name: str, values: Any, offsets: Any, *, field: str | None = None,
              int64_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One ID feature's CSR ids checked: ``(values, offsets)``, the offsets as int64.

    The one check of CSR ids: :meth:`IDTypeFeature.from_csr`, :meth:`PersiaBatch.from_wire`
    and the embedding worker's planners (:func:`stream_persia.worker.pooling.check_csr`)
    all call it. Arrays already of the right dtype are returned as given, not copied.

    Args:
        name: the feature's name, for the message.
        values: must be a 1-D ``np.uint64`` array.
        offsets: must be a non-empty 1-D integer array (int64 with ``int64_only``, as the
            wire schema says) that starts at 0, never decreases and ends at ``len(values)``;
            another integer dtype is converted to int64.
        field: the error's field; ``name`` by default.

    Raises:
        BadInput: naming the feature, what was wrong and the value found.
    """
    field = name if field is None else field
    if not isinstance(values, np.ndarray) or values.dtype != _U64 or values.ndim != 1:
        raise BadInput(f"IDTypeFeature {name!r}: values must be a 1-D np.uint64 array, got "
                       f"{_describe(values)}", field=field,
                       hint="np.asarray(ids, dtype=np.uint64)")
    if (not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or len(offsets) == 0
            or (offsets.dtype != _I64 and (int64_only or offsets.dtype.kind not in "iu"))):
        empty = isinstance(offsets, np.ndarray) and offsets.size == 0
        raise BadInput(f"IDTypeFeature {name!r}: offsets must be a non-empty 1-D "
                       f"{'int64' if int64_only else 'integer'} array, got "
                       f"{'an empty array' if empty else _describe(offsets)}", field=field)
    # Checked in their own dtype, so offsets past int64 are reported as given; offsets that
    # pass lie in [0, len(values)] and convert to int64 exactly.
    if offsets[0] != 0 or offsets[-1] != len(values):
        raise BadInput(f"IDTypeFeature {name!r}: offsets must start at 0 and end at "
                       f"len(values)={len(values)}, got {int(offsets[0])} .. "
                       f"{int(offsets[-1])}", field=field)
    if len(offsets) > 1:
        drops = offsets[1:] < offsets[:-1]
        i = int(drops.argmax())  # the first drop, if any: argmax stops there, any() does not
        if drops[i]:
            raise BadInput(f"IDTypeFeature {name!r}: offsets must not decrease, but "
                           f"offsets[{i + 1}]={int(offsets[i + 1])} < offsets[{i}]="
                           f"{int(offsets[i])}", field=field)
    return values, offsets.astype(_I64, copy=False)


class _NdarrayData:
    """A dense numpy array with a name: rank >= 1, first axis is the batch.

    Arrays in non-native byte order are converted once here, because torch only takes
    native order; every other array is kept as given (no copy).
    """

    DEFAULT_NAME = "ndarray_base"

    def __init__(self, data: np.ndarray, name: str | None = None):
        if isinstance(data, str) and not isinstance(name, str):
            data, name = name, data
        what = type(self).__name__
        self.name = self.DEFAULT_NAME if name is None else _check_name(name, what)
        if not isinstance(data, np.ndarray):
            raise BadInput(f"{what} {self.name!r}: data must be a numpy array, got "
                           f"{_describe(data)}", field=self.name, hint="np.asarray(data)")
        if data.dtype.fields is not None or data.dtype.str[1:] not in _SUPPORTED:
            raise BadInput(f"{what} {self.name!r}: dtype {data.dtype} is not supported",
                           field=self.name, hint=f"use one of {_DTYPES_TEXT}")
        if data.ndim < 1:
            raise BadInput(f"{what} {self.name!r}: data must have rank >= 1 (first axis is "
                           f"the batch), got a 0-D array", field=self.name)
        if not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))  # torch takes native order only
        self.data = data

    @property
    def batch_size(self) -> int:
        return int(self.data.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, shape={self.data.shape}, "
                f"dtype={self.data.dtype})")


class NonIDTypeFeature(_NdarrayData):
    """Dense feature data (any supported dtype, rank >= 1, first axis is the batch).

    Args:
        data: numpy array.
        name: defaults to ``"non_id_type_feature_anonymous"`` as in PERSIA.
    """

    DEFAULT_NAME = "non_id_type_feature_anonymous"


class Label(_NdarrayData):
    """Label data (any supported dtype, rank >= 1, first axis is the batch).

    Args:
        data: numpy array.
        name: defaults to ``"label_anonymous"`` as in PERSIA.
    """

    DEFAULT_NAME = "label_anonymous"


class PersiaBatch:
    """One batch from a data loader: ID features, non-ID features, labels and meta bytes.

    Args:
        id_type_features: at least one; names unique.
        non_id_type_features: dense features.
        labels: required when ``requires_grad`` is True.
        batch_id: int >= 0, or None to let the embedding worker assign one.
        requires_grad: whether gradients flow back to the embeddings (training).
        meta: opaque bytes carried along with the batch.
        event_time: seconds since the Unix epoch (like ``time.time()``) of the newest
            sample in the batch, or None to let ``DataCtx`` stamp the producer's clock
            when the batch is sent. Freshness of served models is measured from it.

    Attributes:
        batch_size: the number of samples, the same in every feature and label.

    Raises:
        BadInput: naming the feature or argument that is wrong.
    """

    def __init__(self, id_type_features: list[IDTypeFeature],
                 non_id_type_features: list[NonIDTypeFeature] | None = None,
                 labels: list[Label] | None = None, batch_id: int | None = None,
                 requires_grad: bool = True, meta: bytes | None = None,
                 event_time: float | None = None):
        self.id_type_features = _check_list(id_type_features, IDTypeFeature,
                                            "id_type_features", allow_none=False)
        self.non_id_type_features = _check_list(non_id_type_features, NonIDTypeFeature,
                                                "non_id_type_features")
        self.labels = _check_list(labels, Label, "labels")
        if not self.id_type_features:
            raise BadInput("id_type_features must hold at least one IDTypeFeature",
                           field="id_type_features")
        first = self.id_type_features[0]
        self.batch_size = first.batch_size
        if self.batch_size == 0:
            raise BadInput(f"batch has no samples (id_type_feature {first.name!r} has batch "
                           f"size 0)", field="batch_size")
        seen: set[str] = set()
        for group, items in (("id_type_features", self.id_type_features),
                             ("non_id_type_features", self.non_id_type_features),
                             ("labels", self.labels)):
            for item in items:
                if item.batch_size != self.batch_size:
                    raise BadInput(
                        f"{group} {item.name!r} has batch size {item.batch_size}, but "
                        f"id_type_feature {first.name!r} has {self.batch_size}",
                        field=item.name, hint="every feature and label needs one row per sample")
                if group == "id_type_features":
                    if item.name in seen:
                        raise BadInput(f"id_type_features: name {item.name!r} appears twice",
                                       field=item.name)
                    seen.add(item.name)
        if not isinstance(requires_grad, (bool, np.bool_)):
            raise BadInput(f"requires_grad must be a bool, got {requires_grad!r}",
                           field="requires_grad")
        self.requires_grad = bool(requires_grad)
        if self.requires_grad and not self.labels:
            raise BadInput("requires_grad=True needs labels, but the batch has none",
                           field="labels",
                           hint="add labels=[Label(...)] or pass requires_grad=False")
        if batch_id is not None and (isinstance(batch_id, bool)
                                     or not isinstance(batch_id, (int, np.integer))
                                     or not 0 <= batch_id <= _MAX_U64):
            raise BadInput(f"batch_id must be an int in [0, 2**64) or None, got {batch_id!r}",
                           field="batch_id")
        self.batch_id = None if batch_id is None else int(batch_id)
        if meta is not None and not isinstance(meta, bytes):
            raise BadInput(f"meta must be bytes or None, got {type(meta).__name__}",
                           field="meta", hint="e.g. json.dumps(info).encode()")
        self.meta = meta
        self.event_time = check_event_time(event_time)

    def stamped(self, event_time: float) -> PersiaBatch:
        """This batch if it has an event time, else a shallow copy (the same arrays) with
        ``event_time``: how a sender stamps its clock without changing the caller's batch.

        Raises:
            BadInput: ``event_time`` is not a valid event time.
        """
        if self.event_time is not None:
            return self
        batch = copy.copy(self)
        batch.event_time = check_event_time(event_time)
        return batch

    def to_wire(self) -> dict[str, Any]:
        """The batch as a wire-encodable dict (schema at the top of this module)."""
        d = self._wire()
        if self.event_time is not None:
            d["event_time"] = self.event_time
        return d

    def _wire(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "batch_id": self.batch_id,
            "requires_grad": self.requires_grad,
            "meta": self.meta,
            "id_type_features": [
                {"name": f.name, "values": f.values,
                 "offsets": None if isinstance(f, IDTypeFeatureWithSingleID) else f.offsets}
                for f in self.id_type_features],
            "non_id_type_features": [{"name": f.name, "data": f.data}
                                     for f in self.non_id_type_features],
            "labels": [{"name": f.name, "data": f.data} for f in self.labels],
        }

    @classmethod
    def from_wire(cls, d: Any) -> PersiaBatch:
        """Rebuild and fully validate a batch from :meth:`to_wire`'s dict (untrusted input).

        Arrays are used as given (no copy).

        Raises:
            WireError: naming the field that is wrong.
        """
        return _batch_from_wire(cls, d)

    def to_bytes(self) -> bytes:
        """One wire frame holding this batch."""
        return wire.pack(self.to_wire())

    @classmethod
    def from_bytes(cls, b: bytes | bytearray | memoryview,
                   limits: wire.WireLimits = wire.DEFAULT_LIMITS) -> PersiaBatch:
        """Decode :meth:`to_bytes`' frame; arrays are read-only views of ``b``.

        Raises:
            WireError: the bytes are not a valid frame or not a valid batch.
        """
        return cls.from_wire(wire.unpack(b, limits))

    def __repr__(self) -> str:
        return (f"PersiaBatch(batch_size={self.batch_size}, batch_id={self.batch_id}, "
                f"id_type_features={[f.name for f in self.id_type_features]}, "
                f"non_id_type_features={[f.name for f in self.non_id_type_features]}, "
                f"labels={[f.name for f in self.labels]}, requires_grad={self.requires_grad}, "
                f"event_time={self.event_time})")


def _check_list(items: Any, cls: type, field: str, allow_none: bool = True) -> list:
    if items is None and allow_none:
        return []
    if not isinstance(items, (list, tuple)):
        raise BadInput(f"{field} must be a list of {cls.__name__}, got {type(items).__name__}",
                       field=field)
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise BadInput(f"{field}[{i}] must be a {cls.__name__}, got "
                           f"{type(item).__name__}", field=f"{field}[{i}]")
    return list(items)


def _as_wire_error(e: BadInput, path: str) -> WireError:
    if isinstance(e, WireError):
        return e
    return WireError(f"{path}: {e.message}", field=path, hint=e.hint)


_BATCH_KEYS = frozenset({"batch_size", "batch_id", "requires_grad", "meta", "id_type_features",
                         "non_id_type_features", "labels"})
_BATCH_OPTIONAL = frozenset({"event_time"})
_ID_KEYS = frozenset({"name", "values", "offsets"})
_DENSE_KEYS = frozenset({"name", "data"})


def _check_dict(d: Any, keys: frozenset, path: str, optional: frozenset = frozenset()
                ) -> dict:
    if type(d) is not dict:
        raise WireError(f"{path} must be a map, got {type(d).__name__}", field=path)
    if d.keys() != keys and not (keys <= d.keys() <= keys | optional):
        missing, unknown = sorted(keys - d.keys()), sorted(d.keys() - keys - optional)
        raise WireError(f"{path}: missing keys {missing}, unknown keys {unknown}", field=path,
                        hint=f"a batch of wire format version {wire.FORMAT_VERSION} has "
                             f"exactly {sorted(keys)}"
                             + (f", and optionally {sorted(optional)}" if optional else ""))
    return d


def _wire_list(d: dict, key: str) -> list:
    items = d[key]
    if type(items) is not list:
        raise WireError(f"batch.{key} must be a list, got {type(items).__name__}",
                        field=f"batch.{key}")
    return items


def _batch_from_wire(cls: type[PersiaBatch], d: Any) -> PersiaBatch:
    d = _check_dict(d, _BATCH_KEYS, "batch", _BATCH_OPTIONAL)
    size = d["batch_size"]
    if type(size) is not int or size < 1:
        raise WireError(f"batch.batch_size must be an int >= 1, got {size!r}",
                        field="batch.batch_size")
    ids: list[IDTypeFeature] = []
    for i, f in enumerate(_wire_list(d, "id_type_features")):
        path = f"batch.id_type_features[{i}]"
        f = _check_dict(f, _ID_KEYS, path)
        try:
            name = _check_name(f["name"], "IDTypeFeature")
            if f["offsets"] is None:
                single = IDTypeFeatureWithSingleID(name, f["values"])
                if single.batch_size != size:
                    raise WireError(f"{path}: single-id feature {name!r} holds "
                                    f"{single.batch_size} ids for a batch of {size}",
                                    field=path)
                ids.append(single)
            else:
                feature = object.__new__(IDTypeFeature)
                feature.name = name
                feature.values, feature.offsets = check_csr(name, f["values"], f["offsets"],
                                                            int64_only=True)
                ids.append(feature)
        except BadInput as e:
            raise _as_wire_error(e, path) from e
    dense: dict[str, list] = {}
    for key, kind in (("non_id_type_features", NonIDTypeFeature), ("labels", Label)):
        dense[key] = []
        for i, f in enumerate(_wire_list(d, key)):
            path = f"batch.{key}[{i}]"
            f = _check_dict(f, _DENSE_KEYS, path)
            if not isinstance(f["name"], str):
                raise WireError(f"{path}.name must be a str, got {type(f['name']).__name__}",
                                field=f"{path}.name")
            try:
                dense[key].append(kind(f["data"], f["name"]))
            except BadInput as e:
                raise _as_wire_error(e, path) from e
    try:
        batch = cls(ids, dense["non_id_type_features"], dense["labels"],
                    batch_id=d["batch_id"], requires_grad=d["requires_grad"], meta=d["meta"],
                    event_time=d.get("event_time"))
    except BadInput as e:
        raise _as_wire_error(e, f"batch.{e.field}" if e.field else "batch") from e
    if batch.batch_size != size:
        raise WireError(f"batch.batch_size says {size} but the features hold "
                        f"{batch.batch_size} samples", field="batch.batch_size")
    return batch
