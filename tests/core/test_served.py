"""stream_persia.core.served: the one decoder of a served batch, against hostile frames.

Every frame goes through the wire codec first, so the arrays are what a reader gets: read-only
views of the received frame."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from stream_persia.core import wire
from stream_persia.core.served import ServedBatch
from stream_persia.errors import BadInput
from stream_persia.nn.batch import from_served

pytestmark = pytest.mark.timeout(30)


def frame(**changes: Any) -> dict:
    served = {"batch_id": 7, "requires_grad": True, "meta": b"m", "batch_size": 2,
              "non_id_type_features": [{"name": "d", "data": np.ones((2, 3), np.float32)}],
              "labels": [{"name": "y", "data": np.array([[1.0], [0.0]], np.float32)}],
              "embeddings": [
                  {"name": "s", "kind": "sum", "emb": np.full((2, 4), 2.0, np.float32)},
                  {"name": "r", "kind": "raw",
                   "emb": np.arange(12, dtype=np.float32).reshape(3, 4),
                   "index": np.array([[1, 2], [2, 0]], np.int64),
                   "mask": np.array([[True, True], [True, False]])}]}
    served.update(changes)
    return wire.unpack(wire.pack(served))


def test_a_served_batch_decodes_to_named_fields():
    sb = ServedBatch.from_wire(frame())
    assert (sb.batch_id, sb.batch_size, sb.requires_grad, sb.meta, sb.missing) == (7, 2, True,
                                                                                   b"m", 0)
    s, r = sb.embeddings
    assert (s.name, s.kind, s.is_raw(), s.index) == ("s", "sum", False, None)
    assert r.is_raw() and r.index.shape == r.mask.shape == (2, 2) and r.emb.shape == (3, 4)
    assert [f.name for f in sb.non_id_type_features] == ["d"]
    assert sb.labels is not None and [f.name for f in sb.labels] == ["y"]
    # An evaluation lookup: no batch id, no labels, the ids the servers lacked.
    ev = ServedBatch.from_wire(frame(batch_id=-1, labels=[], missing=3, requires_grad=False))
    assert (ev.batch_id, ev.labels, ev.missing) == (None, None, 3)


def test_a_served_batch_carries_its_event_time_to_the_training_batch():
    assert ServedBatch.from_wire(frame()).event_time is None   # an old frame: no key
    sb = ServedBatch.from_wire(frame(event_time=1_750_000_000.25))
    assert sb.event_time == 1_750_000_000.25
    assert from_served(sb).event_time == 1_750_000_000.25
    assert from_served(frame()).event_time is None
    assert ServedBatch.from_wire(frame(event_time=3)).event_time == 3.0


@pytest.mark.parametrize("t", [-0.5, float("nan"), float("inf"), True, "1.0", [1.0]])
def test_a_served_batch_with_a_bad_event_time_is_refused_naming_the_field(t):
    with pytest.raises(BadInput) as e:
        ServedBatch.from_wire(frame(event_time=t))
    assert e.value.field == "event_time" and "event_time" in str(e.value)


def _slot(i: int, **changes: Any) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d["embeddings"][i].update(changes)
        for key in [k for k, v in changes.items() if v is _DROP]:
            del d["embeddings"][i][key]
    return edit


_DROP = object()


def _drop(key: str) -> Callable[[dict], None]:
    return lambda d: d.pop(key)


HOSTILE = [
    # missing keys
    (_drop("batch_size"), "batch_size"),
    (_drop("embeddings"), "embeddings"),
    (_slot(0, emb=_DROP), "embeddings[0].emb"),
    (_slot(0, name=_DROP), "embeddings[0].name"),
    (_slot(1, index=_DROP), "embeddings[1].index"),
    (_slot(1, mask=_DROP), "embeddings[1].mask"),
    (lambda d: d["labels"][0].pop("data"), "labels[0].data"),
    # wrong types and dtypes
    (lambda d: d.update(batch_size="2"), "batch_size"),
    (lambda d: d.update(embeddings={"s": 1}), "embeddings"),
    (lambda d: d["embeddings"].append([1, 2]), "embeddings[2]"),
    (_slot(0, kind="pooled"), "embeddings[0].kind"),
    (_slot(0, emb=np.full((2, 4), 2.0, np.float64)), "embeddings[0].emb"),
    (_slot(0, emb=[[1.0] * 4] * 2), "embeddings[0].emb"),
    (_slot(1, index=np.array([[1.0, 2.0], [2.0, 0.0]])), "embeddings[1].index"),
    (_slot(1, mask=np.array([[1, 1], [1, 0]], np.uint8)), "embeddings[1].mask"),
    (lambda d: d.update(meta="m"), "meta"),
    (lambda d: d.update(requires_grad=1), "requires_grad"),
    (lambda d: d.update(missing=-1), "missing"),
    # wrong shapes
    (_slot(0, emb=np.zeros((3, 4), np.float32)), "embeddings[0].emb"),
    (_slot(0, emb=np.zeros(8, np.float32)), "embeddings[0].emb"),
    (_slot(1, index=np.array([1, 2], np.int64)), "embeddings[1].index"),
    (_slot(1, mask=np.array([[True], [True]])), "embeddings[1].mask"),
    (_slot(1, index=np.array([[1, 3], [2, 0]], np.int64)), "embeddings[1].index"),
    (_slot(1, index=np.array([[1, -1], [2, 0]], np.int64)), "embeddings[1].index"),
    (lambda d: d["non_id_type_features"][0].update(data=np.ones((3, 3), np.float32)),
     "non_id_type_features[0].data"),
    (lambda d: d["labels"][0].update(data=np.zeros((0,), np.float32)), "labels[0].data"),
]


@pytest.mark.parametrize(("edit", "field"), HOSTILE,
                         ids=[f"{field}-{i}" for i, (_, field) in enumerate(HOSTILE)])
def test_a_hostile_frame_is_refused_naming_the_field(edit, field):
    d = frame()
    edit(d)
    d = wire.unpack(wire.pack(d))
    with pytest.raises(BadInput) as err:
        ServedBatch.from_wire(d)
    assert err.value.field == field, err.value.message
    assert field in err.value.message
    with pytest.raises(BadInput) as err:   # the NN worker's reader refuses it the same way
        from_served(d)
    assert err.value.field == field


@pytest.mark.parametrize("d", [None, [], b"x", 3])
def test_a_frame_that_is_not_a_map_is_refused(d):
    with pytest.raises(BadInput) as err:
        ServedBatch.from_wire(d)
    assert err.value.field == "batch"
