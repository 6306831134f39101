"""Inference request bodies → validated :class:`PersiaBatch` (JSON or msgpack).

JSON (``application/json``)::

    {"id_type_features": {slot: [ids_of_sample_0, ids_of_sample_1, ...]},
     "non_id_type_features": {name: [row_of_sample_0, row_of_sample_1, ...]}}

where ``ids_of_sample_i`` is a list of uint64 ids (possibly empty) or one id. A slot whose
samples are all single ids becomes an ``IDTypeFeatureWithSingleID``. Non-ID rows are
nested lists of numbers (``true``/``false`` are refused, not read as 1/0), read as
float32, and every sample must have the same shape. The order of the keys does not
matter: the predictor matches slots and non-ID features to the served model's inputs by
name (:mod:`stream_persia.api.inputs`). A key given twice in one object (which a JSON
parser would silently resolve to its last value) is refused, naming it.

msgpack (``application/msgpack``): the bytes of ``PersiaBatch.to_bytes()``, decoded
without copying under the wire limits; dtypes are kept as sent.

Either way the batch is checked against the embedding schema (unknown slots are
rejected, naming the slot and listing the known ones) and the row limit, and every
problem is a :class:`BadInput` (422) or :class:`~stream_persia.api.errors.TooLarge` (413) naming the
field, never an unhandled exception.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import numpy as np
from stream_persia.api.errors import TooLarge

from stream_persia.config import EmbeddingSchema
from stream_persia.core import wire
from stream_persia.core.data import (
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
    PersiaBatch,
)
from stream_persia.errors import BadInput

__all__ = ["JsonObject", "reject_constant", "JSON_TYPES", "MSGPACK_TYPES", "parse_json", "parse_msgpack", "check_batch",
           "signature", "truncated_ids"]

JSON_TYPES = ("application/json",)
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_MAX_U64 = (1 << 64) - 1
_TOP_KEYS = {"id_type_features", "non_id_type_features"}


def _fail(field: str, message: str, hint: str | None = None) -> BadInput:
    return BadInput(f"{field}: {message}", field=field, hint=hint)


def _ids(slot: str, samples: Any) -> IDTypeFeature:
    field = f"id_type_features.{slot}"
    if not isinstance(samples, list):
        raise _fail(field, f"expected a list with one entry per sample, got "
                           f"{type(samples).__name__}", "e.g. [[3, 17], [5]] or [3, 5]")
    kinds = set(map(type, samples))
    if not samples:
        raise _fail(field, "has no samples", "give at least one sample")
    try:
        if kinds == {int}:
            return IDTypeFeatureWithSingleID(slot, np.fromiter(samples, np.uint64, len(samples)))
        if not kinds <= {int, list}:
            bad = next(i for i, x in enumerate(samples) if type(x) not in (int, list))
            raise _fail(f"{field}[{bad}]", f"expected a list of ids or one id, got "
                                           f"{type(samples[bad]).__name__}",
                        "ids are integers in [0, 2**64)")
        lists = [x if type(x) is list else [x] for x in samples]
        flat = list(itertools.chain.from_iterable(lists))
        if flat and set(map(type, flat)) != {int}:
            pos = next(i for i, x in enumerate(flat) if type(x) is not int)
            sample = int(np.searchsorted(np.cumsum(list(map(len, lists))), pos, side="right"))
            raise _fail(f"{field}[{sample}]", f"ids must be integers, got "
                                              f"{type(flat[pos]).__name__} {flat[pos]!r}",
                        "ids are integers in [0, 2**64)")
        values = np.fromiter(flat, np.uint64, len(flat))
    except OverflowError:
        bad = next(x for x in itertools.chain.from_iterable(
            x if type(x) is list else [x] for x in samples) if not 0 <= x <= _MAX_U64)
        raise _fail(field, f"id {bad} is outside [0, 2**64)", "ids are uint64") from None
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, lists), np.int64, len(lists)), out=offsets[1:])
    return IDTypeFeature.from_csr(slot, values, offsets)


def _dense(name: str, rows: Any, batch_size: int, maybe_bools: bool) -> NonIDTypeFeature:
    """``maybe_bools``: the body holds a ``true`` or ``false`` somewhere (numpy would read
    one among numbers as 1 or 0, so only then are the values looked at one by one)."""
    field = f"non_id_type_features.{name}"
    if not isinstance(rows, list):
        raise _fail(field, f"expected a list with one row per sample, got "
                           f"{type(rows).__name__}", "e.g. [[0.1, 0.2], [0.3, 0.4]]")
    try:
        data = np.array(rows)
    except (ValueError, TypeError, RecursionError):
        data = None
    if data is None or data.dtype.kind not in "biuf":
        raise _fail(field, "must be nested lists of numbers with the same shape for every "
                           "sample", "e.g. [[0.1, 0.2], [0.3, 0.4]]")
    if data.dtype.kind == "b" or (maybe_bools and any(
            type(x) is bool for x in np.array(rows, dtype=object).ravel())):
        raise _fail(field, "holds true or false; non-ID values are numbers",
                    "send 1.0 or 0.0")
    with np.errstate(over="ignore"):   # beyond float32 becomes inf, refused just below
        data = data.astype(np.float32)
    if data.ndim < 1 or data.shape[0] != batch_size:
        raise _fail(field, f"has {data.shape[0] if data.ndim else 0} rows but the batch has "
                           f"{batch_size} samples", "one row per sample")
    if not np.isfinite(data).all():
        raise _fail(field, "holds a NaN or an infinity (or a number beyond float32)",
                    "send finite numbers")
    return NonIDTypeFeature(data, name)


def parse_json(body: bytes, schema: EmbeddingSchema | None, max_rows: int) -> PersiaBatch:
    """Parse and validate a JSON inference request."""
    try:
        doc = json.loads(body, parse_constant=reject_constant, object_pairs_hook=JsonObject)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"body is not valid JSON: {e}", field="body") from None
    except RecursionError:
        raise BadInput("body is nested too deeply", field="body") from None
    if not isinstance(doc, dict):
        raise BadInput(f"body must be a JSON object, got {type(doc).__name__}", field="body",
                       hint="{'id_type_features': {...}, 'non_id_type_features': {...}}")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise BadInput(f"unknown field {key!r}", field=key,
                       hint="accepted: id_type_features, non_id_type_features")
    _once(doc, "")
    id_part = doc.get("id_type_features")
    if not isinstance(id_part, dict) or not id_part:
        raise BadInput("id_type_features must be a non-empty object of slot -> samples",
                       field="id_type_features", hint="{'user': [[3, 17], [5]]}")
    dense_part = doc.get("non_id_type_features", {})
    if dense_part is None:
        dense_part = {}
    if not isinstance(dense_part, dict):
        raise BadInput("non_id_type_features must be an object of name -> rows",
                       field="non_id_type_features")
    _once(id_part, "id_type_features.")
    _once(dense_part, "non_id_type_features.")
    for slot, samples in id_part.items():   # rows limit before any big allocation
        if isinstance(samples, list) and len(samples) > max_rows:
            raise TooLarge(f"id_type_features.{slot} has {len(samples)} samples; the limit "
                           f"is {max_rows} per request", field=f"id_type_features.{slot}",
                           hint="split the request")
    if schema is not None:
        for slot in id_part:
            _check_slot(schema, slot)
    features = [_ids(slot, samples) for slot, samples in id_part.items()]
    size = features[0].batch_size
    for f in features[1:]:
        if f.batch_size != size:
            raise BadInput(f"id_type_features.{f.name} has {f.batch_size} samples but "
                           f"{features[0].name} has {size}", field=f"id_type_features.{f.name}",
                           hint="every feature holds one entry per sample")
    maybe_bools = bool(dense_part) and _JSON_BOOL.search(body) is not None
    dense = [_dense(name, rows, size, maybe_bools) for name, rows in dense_part.items()]
    return PersiaBatch(features, non_id_type_features=dense, requires_grad=False)



#: A JSON true or false in value position (after '[', ',' or ':'), not inside a name such
#: as "false_click_rate": only then are the non-ID values scanned for booleans.
_JSON_BOOL = re.compile(rb"[\[,:]\s*(?:true|false)\b")

class JsonObject(dict):
    """A JSON object that remembers the first key it was given twice (``json.loads``
    keeps the last value of such a key without a word)."""

    twice: str | None = None

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        if len(self) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.twice = key
                    break
                seen.add(key)


def _once(obj: Any, prefix: str) -> None:
    """BadInput naming a key of ``obj`` given twice."""
    key = getattr(obj, "twice", None)
    if key is not None:
        raise BadInput(f"{prefix}{key}: given twice", field=f"{prefix}{key}",
                       hint="name each feature once")


def reject_constant(name: str) -> Any:
    """``json.loads``'s ``parse_constant``: NaN and Infinity are not JSON."""
    raise BadInput(f"body holds {name}, which is not JSON", field="body",
                   hint="send finite numbers")


def parse_msgpack(body: bytes, schema: EmbeddingSchema | None, max_rows: int) -> PersiaBatch:
    """Decode ``PersiaBatch.to_bytes()`` and validate it like a JSON request."""
    batch = PersiaBatch.from_bytes(body, wire.DEFAULT_LIMITS)
    check_batch(batch, schema, max_rows)
    return batch


def check_batch(batch: PersiaBatch, schema: EmbeddingSchema | None, max_rows: int) -> None:
    """Schema and limit checks shared by both encodings."""
    if batch.batch_size > max_rows:
        raise TooLarge(f"the batch has {batch.batch_size} samples; the limit is {max_rows} per "
                       f"request", field="batch_size", hint="split the request")
    if schema is not None:
        for f in batch.id_type_features:
            _check_slot(schema, f.name)
    for f in batch.non_id_type_features:
        if f.data.dtype.kind == "f" and not np.isfinite(f.data).all():
            raise BadInput(f"non_id_type_features.{f.name}: holds a NaN or an infinity",
                           field=f"non_id_type_features.{f.name}", hint="send finite numbers")


def _check_slot(schema: EmbeddingSchema, slot: Any) -> None:
    if slot not in schema.slots:
        known = ", ".join(sorted(schema.slots))
        raise BadInput(f"unknown slot {slot!r} in id_type_features",
                       field=f"id_type_features.{slot}", hint=f"slots of this job: {known}")


def signature(batch: PersiaBatch) -> tuple:
    """What must match for two requests to share one forward pass: slot order and the
    non-ID features' names, dtypes and per-sample shapes (taken after the predictor put
    them in the model's order, so key order alone never splits a micro-batch)."""
    return (tuple(f.name for f in batch.id_type_features),
            tuple((f.name, f.data.dtype.str, f.data.shape[1:])
                  for f in batch.non_id_type_features))


def truncated_ids(batch: PersiaBatch, schema: EmbeddingSchema | None) -> int | None:
    """Ids of ``batch`` that no row is looked up for: those past ``sample_fixed_size`` in a
    sample of a raw slot (``embedding_summation: false``; PERSIA's rule, which training
    applies too and counts as ``ids_truncated_total``). None without a schema (the API
    has no embedding config: the slots' sizes are not known here, and 0 would say every
    id was used)."""
    if schema is None:
        return None
    over = 0
    for feature in batch.id_type_features:
        slot = schema.slots.get(feature.name)
        if slot is not None and not slot.embedding_summation:
            over += int(np.maximum(np.diff(feature.offsets) - slot.sample_fixed_size, 0).sum())
    return over
