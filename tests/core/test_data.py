"""PERSIA's batch types: construction checks, CSR layout, wire round trips, untrusted input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_persia.core import wire
from stream_persia.embedding.data import (
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from stream_persia.errors import BadInput, WireError

U64 = np.uint64
DTYPES = [np.dtype(d) for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                "uint32", "uint64", "float16", "float32", "float64")]


def ids(*samples):
    return [np.array(s, dtype=U64) for s in samples]


def user_id():
    # PERSIA's documentation example, empty sample included
    return IDTypeFeature("user_id", ids([1000, 1001], [1000], [], [1000, 1001, 1024],
                                        [1000] * 200))


def small_batch(**kw):
    args = dict(non_id_type_features=[NonIDTypeFeature(np.ones((5, 2), np.float32), "dense")],
                labels=[Label(np.array([0, 1, 0, 1, 1], dtype=bool), name="ctr")])
    args.update(kw)
    return PersiaBatch([user_id()], **args)


# --------------------------------------------------------------------------- IDTypeFeature


def test_id_type_feature_is_csr_with_views_back():
    f = user_id()
    assert f.name == "user_id" and f.batch_size == 5
    assert f.values.dtype == U64 and f.offsets.dtype == np.int64
    assert f.offsets.tolist() == [0, 2, 3, 3, 6, 206]
    assert f.values[:6].tolist() == [1000, 1001, 1000, 1000, 1001, 1024]
    samples = f.data
    assert [len(s) for s in samples] == [2, 1, 0, 3, 200]
    assert all(np.shares_memory(s, f.values) for s in samples if len(s))


def test_id_type_feature_accepts_persia_docs_swapped_order_and_tuples():
    f = IDTypeFeature(ids([1], [2, 3]), "swapped")
    assert f.name == "swapped" and f.offsets.tolist() == [0, 1, 3]
    assert IDTypeFeature("t", tuple(ids([7]))).values.tolist() == [7]


def test_id_type_feature_from_2d_array_and_empty_list():
    f = IDTypeFeature("empty_sample", np.array([[]] * 5, dtype=U64))
    assert f.batch_size == 5 and len(f.values) == 0
    assert [len(s) for s in f.data] == [0] * 5
    g = IDTypeFeature("fixed", np.arange(6, dtype=U64).reshape(3, 2)[:, ::-1])
    assert [s.tolist() for s in g.data] == [[1, 0], [3, 2], [5, 4]]
    e = IDTypeFeature("none", [])
    assert e.batch_size == 0 and e.data == [] and e.offsets.tolist() == [0]


@pytest.mark.parametrize("data,sample,found", [
    (ids([1], [2]) + [np.array([3], dtype=np.int64)], "sample 2", "int64"),
    (ids([1]) + [[3, 4]], "sample 1", "list"),
    ([np.array([[1]], dtype=U64)], "sample 0", "2-D"),
    ([np.array(1, dtype=U64)], "sample 0", "0-D"),
    ([np.uint64(5)], "sample 0", "uint64"),
])
def test_id_type_feature_element_checks_name_feature_sample_and_dtype(data, sample, found):
    with pytest.raises(BadInput) as e:
        IDTypeFeature("photo_id", data)
    msg = str(e.value)
    assert "'photo_id'" in msg and sample in msg and found in msg
    assert e.value.field == "photo_id"


@pytest.mark.parametrize("data", [np.arange(3, dtype=U64), np.zeros((2, 2), np.int64), "abc",
                                  {1: 2}], ids=repr)
def test_id_type_feature_rejects_other_data(data):
    with pytest.raises(BadInput, match="'f'"):
        IDTypeFeature("f", data)


def test_1d_array_hints_at_single_id_feature():
    with pytest.raises(BadInput, match="IDTypeFeatureWithSingleID"):
        IDTypeFeature("f", np.arange(3, dtype=U64))


@pytest.mark.parametrize("name", ["", None, 3])
def test_id_type_feature_name_must_be_non_empty_str(name):
    with pytest.raises(BadInput, match="name"):
        IDTypeFeature(name, ids([1]))


def test_from_csr_keeps_arrays_and_converts_integer_offsets():
    values = np.array([5, 6, 7], dtype=U64)
    f = IDTypeFeature.from_csr("c", values, np.array([0, 0, 3], dtype=np.int32))
    assert f.values is values and f.offsets.dtype == np.int64
    assert [s.tolist() for s in f.data] == [[], [5, 6, 7]]


@pytest.mark.parametrize("values,offsets,match", [
    (np.array([1, 2], U64), np.array([1, 2]), "start at 0"),
    (np.array([1, 2], U64), np.array([0, 1]), "end at len"),
    (np.array([1, 2], U64), np.array([0, 2, 1, 2]), r"offsets\[2\]=1 < offsets\[1\]=2"),
    (np.array([1, 2], np.int64), np.array([0, 2]), "np.uint64"),
    (np.array([1, 2], U64), np.array([0.0, 2.0]), "integer"),
    (np.array([1, 2], U64), np.array([], np.int64), "non-empty"),
    (np.array([1, 2], U64), np.array([0, 2 ** 63], np.uint64),  # reported as given
     r"end at len\(values\)=2, got 0 \.\. 9223372036854775808"),
    (np.array([1, 2], U64), np.array([0, 2 ** 63, 2], np.uint64),
     r"offsets\[2\]=2 < offsets\[1\]=9223372036854775808"),
])
def test_from_csr_validation(values, offsets, match):
    with pytest.raises(BadInput, match=match):
        IDTypeFeature.from_csr("c", values, offsets)


def test_single_id_feature():
    f = IDTypeFeatureWithSingleID("item", np.array([1, 2, 3], U64))
    assert isinstance(f, IDTypeFeature) and f.batch_size == 3
    assert f.offsets.tolist() == [0, 1, 2, 3] and f.data.tolist() == [1, 2, 3]
    assert IDTypeFeatureWithSingleID(np.array([9], U64), "swapped").name == "swapped"
    for bad in (np.array([1], np.int64), np.zeros((2, 1), U64), [np.uint64(1)]):
        with pytest.raises(BadInput, match="'item'"):
            IDTypeFeatureWithSingleID("item", bad)


# ------------------------------------------------------------------ NonIDTypeFeature, Label


@pytest.mark.parametrize("cls,default", [(NonIDTypeFeature, "non_id_type_feature_anonymous"),
                                         (Label, "label_anonymous")])
def test_dense_types_default_names_and_swapped_order(cls, default):
    assert cls(np.zeros(3)).name == default
    f = cls("named", np.zeros((3, 2)))
    assert f.name == "named" and f.batch_size == 3 and len(f) == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_types_accept_every_supported_dtype(dtype):
    assert Label(np.zeros((2, 3), dtype), "l").data.dtype == dtype


@pytest.mark.parametrize("data,match", [
    (np.zeros(3, np.complex64), "complex64"), (np.array(["a"]), "<U1"),
    (np.array([None]), "object"), (np.zeros(2, "datetime64[s]"), "datetime64"),
    (np.float32(1.0), "numpy array"), ([1.0, 2.0], "numpy array"),
    (np.zeros((), np.float32), "rank >= 1"),
])
def test_dense_types_reject_unsupported_data(data, match):
    with pytest.raises(BadInput, match=match) as e:
        NonIDTypeFeature(data, name="height")
    assert "'height'" in str(e.value)


def test_dense_name_must_be_non_empty_str():
    with pytest.raises(BadInput, match="name"):
        Label(np.zeros(3), name="")


# ------------------------------------------------------------------------------ PersiaBatch


def test_batch_attributes():
    b = small_batch(batch_id=7, meta=b"m")
    assert b.batch_size == 5 and b.batch_id == 7 and b.meta == b"m" and b.requires_grad
    assert [f.name for f in b.id_type_features] == ["user_id"]
    assert [f.name for f in b.labels] == ["ctr"]


def test_persia_docs_inference_batch():
    b = PersiaBatch([IDTypeFeature("empty_sample", np.array([[]] * 5, dtype=U64))],
                    requires_grad=False)
    assert b.batch_size == 5 and b.labels == [] and b.non_id_type_features == []


@pytest.mark.parametrize("kw,names", [
    (dict(non_id_type_features=[NonIDTypeFeature(np.zeros((4, 1)), "dense")]), "'dense'"),
    (dict(labels=[Label(np.zeros(6), "ctr")]), "'ctr'"),
])
def test_batch_size_disagreement_names_feature_and_both_sizes(kw, names):
    with pytest.raises(BadInput) as e:
        small_batch(**kw)
    msg = str(e.value)
    assert names in msg and "'user_id'" in msg and "5" in msg
    assert ("4" in msg) or ("6" in msg)


def test_id_feature_batch_size_disagreement():
    with pytest.raises(BadInput, match=r"'other' has batch size 2, but id_type_feature "
                                       r"'user_id' has 5"):
        PersiaBatch([user_id(), IDTypeFeature("other", ids([1], [2]))], requires_grad=False)


@pytest.mark.parametrize("kw,field", [
    (dict(requires_grad=True, labels=None), "labels"),
    (dict(requires_grad=True, labels=[]), "labels"),
    (dict(requires_grad="yes"), "requires_grad"),
    (dict(meta="text"), "meta"),
    (dict(meta=bytearray(b"x")), "meta"),
    (dict(batch_id=-1), "batch_id"),
    (dict(batch_id=True), "batch_id"),
    (dict(batch_id=1.0), "batch_id"),
    (dict(batch_id=2 ** 64), "batch_id"),
    (dict(labels=[NonIDTypeFeature(np.zeros(5))]), "labels[0]"),
    (dict(non_id_type_features=np.zeros((5, 1))), "non_id_type_features"),
])
def test_batch_argument_errors_name_the_field(kw, field):
    with pytest.raises(BadInput) as e:
        small_batch(**kw)
    assert e.value.field == field


def test_requires_grad_without_labels_is_an_error_but_inference_is_fine():
    with pytest.raises(BadInput, match="requires_grad=True needs labels"):
        PersiaBatch([user_id()])
    PersiaBatch([user_id()], requires_grad=False)


def test_batch_needs_id_features_unique_names_and_samples():
    with pytest.raises(BadInput, match="at least one"):
        PersiaBatch([], requires_grad=False)
    with pytest.raises(BadInput, match="'user_id' appears twice"):
        PersiaBatch([user_id(), user_id()], requires_grad=False)
    with pytest.raises(BadInput, match="id_type_features\\[1\\]"):
        PersiaBatch([user_id(), "x"], requires_grad=False)
    with pytest.raises(BadInput, match="no samples"):
        PersiaBatch([IDTypeFeature("e", [])], requires_grad=False)


# ---------------------------------------------------------------------------- round trips


def assert_batches_equal(a: PersiaBatch, b: PersiaBatch):
    assert (a.batch_size, a.batch_id, a.requires_grad, a.meta, a.event_time) == \
           (b.batch_size, b.batch_id, b.requires_grad, b.meta, b.event_time)
    assert len(a.id_type_features) == len(b.id_type_features)
    for x, y in zip(a.id_type_features, b.id_type_features, strict=True):
        assert type(x) is type(y) and x.name == y.name
        assert np.array_equal(x.values, y.values) and np.array_equal(x.offsets, y.offsets)
    for xs, ys in ((a.non_id_type_features, b.non_id_type_features), (a.labels, b.labels)):
        assert [type(x) for x in xs] == [type(y) for y in ys]
        for x, y in zip(xs, ys, strict=True):
            assert x.name == y.name and x.data.dtype == y.data.dtype
            # Bytes, not values: a fuzzed float may be NaN, which equals nothing.
            assert x.data.shape == y.data.shape and x.data.tobytes() == y.data.tobytes()


def rich_batch():
    rng = np.random.default_rng(1)
    dense = [NonIDTypeFeature(rng.integers(0, 2, (5, 3)).astype(d), f"n_{d}") for d in DTYPES]
    dense.append(NonIDTypeFeature(np.ones((5, 4, 4, 3), np.uint8), "image"))
    dense.append(NonIDTypeFeature(np.arange(20.0).reshape(4, 5).T))  # non-contiguous
    labels = [Label(np.array([0, 1, 0, 1, 1], bool), "ctr"), Label(np.zeros((5, 1), ">f4"))]
    id_features = [user_id(), IDTypeFeature("empty", np.array([[]] * 5, U64)),
                   IDTypeFeatureWithSingleID("item", np.arange(5, dtype=U64) + 2 ** 63)]
    return PersiaBatch(id_features, dense, labels, batch_id=2 ** 64 - 1, meta=b"\x00meta",
                       event_time=1_750_000_000.125)


def test_bytes_round_trip_of_everything():
    b = rich_batch()
    out = PersiaBatch.from_bytes(b.to_bytes())
    assert_batches_equal(b, out)
    assert isinstance(out.id_type_features[2], IDTypeFeatureWithSingleID)


def test_from_bytes_is_zero_copy():
    buf = rich_batch().to_bytes()
    out = PersiaBatch.from_bytes(buf)
    whole = np.frombuffer(buf, np.uint8)
    arrays = [f.values for f in out.id_type_features] + [f.offsets for f in
                                                         out.id_type_features[:2]]
    arrays += [f.data for f in out.non_id_type_features + out.labels]
    for a in arrays:
        if a.size:
            assert np.shares_memory(a, whole) and not a.flags.writeable


def test_to_wire_holds_arrays_and_survives_an_enclosing_frame():
    b = small_batch(batch_id=3)
    d = b.to_wire()
    assert d["id_type_features"][0]["values"] is b.id_type_features[0].values
    assert_batches_equal(b, PersiaBatch.from_wire(d))
    rpc = wire.unpack(wire.pack({"method": "push", "args": {"batch": d}}))
    assert_batches_equal(b, PersiaBatch.from_wire(rpc["args"]["batch"]))


# ------------------------------------------------------------------- untrusted wire input


def _corrupt(path, value):
    d = small_batch().to_wire()
    *parents, last = path
    target = d
    for p in parents:
        target = target[p]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return d


@pytest.mark.parametrize("path,value,field", [
    (("batch_size",), 4, "batch.batch_size"),
    (("batch_size",), "5", "batch.batch_size"),
    (("batch_size",), 0, "batch.batch_size"),
    (("meta",), KeyError, "batch"),
    (("extra",), 1, "batch"),
    (("labels",), {}, "batch.labels"),
    (("labels",), [], "batch.labels"),  # requires_grad=True without labels
    (("requires_grad",), 1, "batch.requires_grad"),
    (("meta",), "text", "batch.meta"),
    (("batch_id",), -5, "batch.batch_id"),
    (("id_type_features",), [], "batch.id_type_features"),
    (("id_type_features", 0), [1], "batch.id_type_features[0]"),
    (("id_type_features", 0, "name"), 7, "batch.id_type_features[0]"),
    (("id_type_features", 0, "name"), "", "batch.id_type_features[0]"),
    (("id_type_features", 0, "values"), np.zeros(206, np.int64), "batch.id_type_features[0]"),
    (("id_type_features", 0, "values"), b"raw", "batch.id_type_features[0]"),
    (("id_type_features", 0, "offsets"), np.array([0, 2, 3, 3, 6, 206], np.int32),
     "batch.id_type_features[0]"),
    (("id_type_features", 0, "offsets"), np.array([0, 2, 1, 3, 6, 206]),
     "batch.id_type_features[0]"),
    (("id_type_features", 0, "offsets"), np.array([0, 2, 3, 3, 6, 205]),
     "batch.id_type_features[0]"),
    (("id_type_features", 0, "offsets"), np.array([1, 2, 3, 3, 6, 206]),
     "batch.id_type_features[0]"),
    (("id_type_features", 0, "offsets"), None, "batch.id_type_features[0]"),
    (("id_type_features", 0, "offsets"), [0, 206], "batch.id_type_features[0]"),
    (("labels", 0, "data"), np.zeros(4, bool), "batch.ctr"),
    (("labels", 0, "data"), np.zeros((), bool), "batch.labels[0]"),
    (("labels", 0, "data"), [0, 1], "batch.labels[0]"),
    (("labels", 0, "name"), None, "batch.labels[0].name"),
    (("non_id_type_features", 0, "data"), np.zeros((5, 1), np.complex128),
     "batch.non_id_type_features[0]"),
])
def test_from_wire_rejects_and_names_the_field(path, value, field):
    with pytest.raises(WireError) as e:
        PersiaBatch.from_wire(_corrupt(path, value))
    assert e.value.field == field, str(e.value)
    assert field.split(".")[-1].split("[")[0] in str(e.value)


# ------------------------------------------------------------------- event time

BAD_EVENT_TIMES = [-1.0, -1, float("nan"), float("inf"), float("-inf"), True, False, "1.5",
                   b"1", [1.0], {"t": 1.0}]


@pytest.mark.parametrize("t", [0, 0.0, 1_750_000_000.5, 1_750_000_000, np.float64(3.25),
                               np.int64(7), 2 ** 64 - 1])
def test_event_time_is_kept_as_a_float_and_survives_the_wire(t):
    b = small_batch(event_time=t)
    assert b.event_time == float(t) and type(b.event_time) is float
    assert b.to_wire()["event_time"] == float(t)
    out = PersiaBatch.from_bytes(b.to_bytes())
    assert out.event_time == float(t)
    assert "event_time=" in repr(out)


def test_a_batch_without_event_time_sends_no_key_and_an_old_frame_decodes_to_none():
    b = small_batch()
    assert b.event_time is None and "event_time" not in b.to_wire()
    assert PersiaBatch.from_bytes(b.to_bytes()).event_time is None
    # A frame written before event times existed: exactly the old keys.
    old = small_batch().to_wire()
    assert set(old) == {"batch_size", "batch_id", "requires_grad", "meta",
                        "id_type_features", "non_id_type_features", "labels"}
    assert PersiaBatch.from_wire(wire.unpack(wire.pack(old))).event_time is None
    # None on the wire (an encoder that writes the key anyway) is None too.
    assert PersiaBatch.from_wire({**old, "event_time": None}).event_time is None


@pytest.mark.parametrize("t", BAD_EVENT_TIMES)
def test_a_bad_event_time_is_refused_naming_the_field(t):
    with pytest.raises(BadInput) as e:
        small_batch(event_time=t)
    assert e.value.field == "event_time" and "event_time" in str(e.value)


@pytest.mark.parametrize("t", BAD_EVENT_TIMES)
def test_a_frame_with_a_bad_event_time_is_refused_naming_the_field(t):
    d = small_batch().to_wire()
    d["event_time"] = t
    with pytest.raises(WireError) as e:
        PersiaBatch.from_bytes(wire.pack(d))
    assert e.value.field == "batch.event_time" and "event_time" in str(e.value)


def test_stamped_keeps_a_given_event_time_and_never_changes_the_callers_batch():
    given = small_batch(event_time=5.0)
    assert given.stamped(99.0) is given and given.event_time == 5.0
    plain = small_batch(batch_id=4)
    copy = plain.stamped(12.5)
    assert plain.event_time is None and copy.event_time == 12.5
    assert copy.id_type_features[0] is plain.id_type_features[0]   # no array copied
    assert_batches_equal(copy, PersiaBatch.from_bytes(copy.to_bytes()))
    with pytest.raises(BadInput) as e:
        plain.stamped(float("nan"))
    assert e.value.field == "event_time"


def test_from_wire_rejects_non_dicts():
    for bad in (None, [], "batch", 3):
        with pytest.raises(WireError, match="batch must be a map"):
            PersiaBatch.from_wire(bad)


def test_from_bytes_errors_are_wire_errors():
    with pytest.raises(WireError):
        PersiaBatch.from_bytes(b"not a frame")
    with pytest.raises(WireError, match="batch must be a map"):
        PersiaBatch.from_bytes(wire.pack([1, 2]))
    with pytest.raises(WireError, match="max_frame_bytes"):
        PersiaBatch.from_bytes(rich_batch().to_bytes(), wire.WireLimits(max_frame_bytes=64))


@st.composite
def mutated_batch_bytes(draw):
    buf = bytearray(draw(st.sampled_from(_FRAMES)))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(buf) - 1))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if op == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del buf[i:i + draw(st.integers(1, 9))]
        else:
            del buf[i:]
        if not buf:
            break
    return bytes(buf)


_FRAMES = [small_batch().to_bytes(), rich_batch().to_bytes(),
           PersiaBatch([IDTypeFeatureWithSingleID("s", np.arange(3, dtype=U64))],
                       requires_grad=False).to_bytes()]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_batch_bytes())
def test_fuzz_mutated_batches_decode_or_raise_wire_error(buf):
    try:
        batch = PersiaBatch.from_bytes(buf)
    except WireError:
        return
    # whatever decodes is a consistent batch that re-encodes
    assert_batches_equal(batch, PersiaBatch.from_bytes(batch.to_bytes()))
