"""The wire format: round trips, zero-copy decoding, limits, and hostile bytes."""

from __future__ import annotations

import struct
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stream_persia.core import wire
from stream_persia.core.wire import DEFAULT_LIMITS, WireLimits, pack, unpack
from stream_persia.errors import BadInput, ConfigError, WireError

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = [np.dtype(d) for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                "uint32", "uint64", "float16", "float32", "float64")]


def frame(body: bytes, data: bytes = b"", version: int = 1, flags: int = 0,
          body_len: int | None = None) -> bytes:
    """A raw frame, built by hand so tests do not trust pack()."""
    n = len(body) if body_len is None else body_len
    head = b"SP" + bytes([version, flags]) + struct.pack("<I", n) + body
    return head + bytes(-len(head) % 8) + data


def ext_array(dcode: int, shape: tuple[int, ...], offset: int, ndim: int | None = None) -> bytes:
    nd = len(shape) if ndim is None else ndim
    payload = struct.pack(f"<BB{len(shape)}QQ", dcode, nd, *shape, offset)
    return msgpack.packb(msgpack.ExtType(1, payload))


def assert_same(a, b):
    """Deep equality where arrays compare by dtype, shape and bytes, tuples as lists."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert b.dtype == a.dtype.newbyteorder("<") or b.dtype == a.dtype
        assert b.shape == a.shape
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- round trips


def test_scalars_and_containers_round_trip():
    obj = {"none": None, "t": True, "f": False, "i": -(2 ** 63), "u": 2 ** 64 - 1,
           "x": 1.5, "s": "ü€", "b": b"\x00\xff", "l": [1, [2, [3]]], "d": {"e": {}},
           "empty": []}
    assert_same(obj, unpack(pack(obj)))


def test_header_layout():
    buf = pack({"a": 1})
    assert buf[:2] == b"SP" and buf[2] == wire.FORMAT_VERSION == 1 and buf[3] == 0
    (body_len,) = struct.unpack_from("<I", buf, 4)
    assert msgpack.unpackb(buf[8:8 + body_len]) == {"a": 1}
    assert len(buf) % 8 == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 2, 2)], ids=str)
def test_every_dtype_and_rank_round_trips(dtype, shape):
    rng = np.random.default_rng(0)
    a = (rng.integers(0, 2, size=shape) if dtype.kind == "b"
         else rng.integers(0, 100, size=shape)).astype(dtype)
    out = unpack(pack({"a": a}))["a"]
    assert out.dtype == dtype and out.shape == shape and np.array_equal(out, a)


def test_numpy_scalars_become_python_numbers():
    out = unpack(pack([np.int64(-3), np.uint64(2 ** 64 - 1), np.float32(0.5), np.bool_(True)]))
    assert out == [-3, 2 ** 64 - 1, 0.5, True]
    assert [type(x) for x in out] == [int, int, float, bool]


def test_non_contiguous_fortran_and_big_endian_arrays():
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    obj = {"strided": base[::2, 1::3], "fortran": np.asfortranarray(base),
           "big": np.arange(7, dtype=">i4"), "neg": base[::-1]}
    out = unpack(pack(obj))
    for k, v in obj.items():
        assert np.array_equal(out[k], v) and out[k].flags.c_contiguous
    assert out["big"].dtype == np.dtype("<i4")


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_arrays_are_read_only_zero_copy_views(kind):
    a = np.arange(1000, dtype=np.uint64)
    buf = kind(pack({"x": [a, a[:3].astype(np.int8), a.astype(np.float32)]}))
    out = unpack(buf)["x"]
    whole = np.frombuffer(buf, dtype=np.uint8)
    for arr in out:
        assert np.shares_memory(arr, whole)
        assert not arr.flags.writeable
    assert np.array_equal(out[0], a)
    # array data starts at a multiple of 8 inside the frame
    for arr in out:
        assert (arr.ctypes.data - whole.ctypes.data) % 8 == 0


def test_bytearray_cannot_be_resized_under_live_views():
    buf = bytearray(pack(np.zeros(4, np.int32)))
    arr = unpack(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")
    del arr


# ------------------------------------------------------------------------------- pack side


@pytest.mark.parametrize("obj", [
    {1: "int key"}, {b"k": 1}, {"s": {1, 2}}, np.zeros(2, np.complex64),
    np.array(["a"]), np.zeros(2, dtype=[("a", "i4")]), np.array([None]), 2 ** 64, -(2 ** 63) - 1,
    object(), np.datetime64("2020-01-01"),
], ids=repr)
def test_pack_rejects_what_unpack_would_not_accept(obj):
    with pytest.raises(WireError):
        pack(obj)


def test_pack_rejects_self_reference_and_too_deep():
    loop: list = []
    loop.append(loop)
    with pytest.raises(WireError):
        pack(loop)
    deep: list = []
    for _ in range(DEFAULT_LIMITS.max_depth):
        deep = [deep]
    with pytest.raises(WireError, match="max_depth"):
        pack(deep)
    pack(deep[0])


def test_pack_enforces_size_limits():
    small = WireLimits(max_frame_bytes=1024, max_array_bytes=512, max_array_ndim=2,
                       max_body_bytes=64)
    with pytest.raises(WireError, match="max_array_bytes"):
        pack(np.zeros(600, np.uint8), small)
    with pytest.raises(WireError, match="max_array_ndim"):
        pack(np.zeros((1, 1, 1)), small)
    with pytest.raises(WireError, match="max_frame_bytes") as e:
        pack([np.zeros(400, np.uint8)] * 3, small)
    assert e.value.field == "max_frame_bytes"
    with pytest.raises(WireError, match="max_body_bytes"):
        pack("x" * 100, small)


def test_wire_limits_are_validated():
    with pytest.raises(ConfigError, match="max_depth"):
        WireLimits(max_depth=0)
    with pytest.raises(ConfigError, match="max_body_bytes"):
        WireLimits(max_body_bytes=1 << 32)
    with pytest.raises(ConfigError):
        WireLimits(max_frame_bytes=1.5)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- hostile frames


def test_unknown_version_names_seen_and_supported():
    with pytest.raises(WireError) as e:
        unpack(frame(msgpack.packb(1), version=7))
    assert "version 7" in str(e.value) and "[1]" in str(e.value)
    assert e.value.field == "version"


@pytest.mark.parametrize("buf,match", [
    (b"", "shorter"), (b"SP\x01", "shorter"), (b"XX\x01\x00\x01\x00\x00\x00\xc0", "magic"),
    (frame(b"\xc0", flags=1), "flags"), (frame(b"\xc0", body_len=1000), "truncated"),
    (frame(b"\xc0\xc0"), "after its value"), (frame(b""), "truncated"),
    (frame(b"\x92\x01"), "declares 2 entries"), (frame(b"\xc1"), "0xc1"),
    (frame(b"\x81\x01\x02"), "not a str"), (frame(b"\x81\xc4\x01k\x02"), "not a str"),
    (frame(b"\xd6\xff\x00\x00\x00\x01"), "ext type -1"),  # msgpack timestamp
    (frame(b"\xd4\x05\x00"), "ext type 5"), (frame(b"\xa2\xff\xfe"), "UnicodeDecodeError"),
    (frame(b"\xdd\xff\xff\xff\xff"), "max_container_len"),
    (frame(b"\xdc\x00\x10" + b"\x01" * 3), "declares 16 entries"),
])
def test_malformed_frames_raise_wire_error(buf, match):
    with pytest.raises(WireError, match=match):
        unpack(buf)


@pytest.mark.parametrize("bad", ["text", None, 3, [1, 2]], ids=repr)
def test_non_buffers_raise_wire_error(bad):
    with pytest.raises(WireError):
        unpack(bad)


def test_wire_error_is_bad_input():
    with pytest.raises(BadInput):
        unpack(b"nonsense")


@pytest.mark.parametrize("body,data,match", [
    (ext_array(12, (1,), 0), b"\0" * 8, "dtype code 12"),
    (ext_array(0, (1,) * 9, 0), b"\0" * 8, "max_array_ndim"),
    (ext_array(0, (2,), 0, ndim=3), b"\0" * 8, "header of"),
    (ext_array(4, (4,), 0), b"\0" * 8, "outside"),
    (ext_array(4, (1,), 4), b"\0" * 16, "misaligned"),
    (ext_array(0, (2,), 0), b"\x01\x02" + b"\0" * 6, "bool"),
    (ext_array(8, (10 ** 12,), 0), b"\0" * 8, "max_array_bytes"),
    (ext_array(8, (2 ** 32, 2 ** 32, 2 ** 32), 0), b"", "max_array_bytes"),
    (ext_array(8, (0, 2 ** 64 - 1), 0), b"", "max_array_bytes"),
    (ext_array(8, (1,), 2 ** 64 - 8), b"\0" * 8, "outside"),
])
def test_bad_array_headers_raise_before_allocating(body, data, match):
    start = time.perf_counter()
    with pytest.raises(WireError, match=match):
        unpack(frame(body, data))
    assert time.perf_counter() - start < 1.0


def test_zero_size_array_at_end_of_data_section_is_fine():
    out = unpack(frame(ext_array(8, (0, 3), 0), b""))
    assert out.shape == (0, 3) and out.dtype == np.uint64


def test_frame_and_body_limits_checked_first():
    small = WireLimits(max_frame_bytes=64, max_body_bytes=16)
    with pytest.raises(WireError, match="max_frame_bytes"):
        unpack(frame(b"\xc0", b"\0" * 64), small)
    with pytest.raises(WireError, match="max_body_bytes"):
        unpack(frame(msgpack.packb("x" * 20)), small)


def test_depth_limit_and_100k_nested_lists():
    limits = WireLimits(max_depth=3)
    unpack(frame(b"\x91\x91\x91\xc0"), limits)
    with pytest.raises(WireError, match="max_depth"):
        unpack(frame(b"\x91\x91\x91\x91\xc0"), limits)
    with pytest.raises(WireError, match="max_depth"):
        unpack(frame(b"\x91" * 100_000 + b"\xc0"))
    with pytest.raises(WireError, match="max_depth"):
        unpack(frame(b"\x81\xa1k" * 100_000 + b"\xc0"))


def test_object_and_container_limits():
    limits = WireLimits(max_objects=10, max_container_len=5)
    unpack(pack([1, 2, 3, 4, 5]), limits)
    with pytest.raises(WireError, match="max_container_len"):
        unpack(pack([1] * 6), limits)
    with pytest.raises(WireError, match="max_objects"):
        unpack(pack([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), limits)


def test_nested_huge_container_claims_do_not_allocate():
    # Each header claims a million elements; msgpack would preallocate 8 MB per level.
    claim = b"\xdd" + (1 << 20).to_bytes(4, "big")
    buf = frame(claim * 30 + b"\xc0" * 100)
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            unpack(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# -------------------------------------------------------------------------------- fuzzing

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8))
arrays = hnp.arrays(st.sampled_from(DTYPES),
                    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
trees = st.recursive(scalars | arrays,
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                     max_leaves=12)


def _nan_safe_same(a, b):
    if isinstance(a, np.ndarray):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert a.tobytes() == b.tobytes() or np.array_equal(a, b, equal_nan=True)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _nan_safe_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _nan_safe_same(x, y)
    else:
        assert_same(a, b)


@FAST
@given(trees)
def test_fuzz_round_trip(obj):
    _nan_safe_same(obj, unpack(pack(obj)))


@FAST
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_raise_only_wire_error(data):
    with pytest.raises(WireError):
        unpack(data)


@FAST
@given(st.binary(max_size=120), st.binary(max_size=64))
def test_fuzz_random_body_behind_valid_header(body, data):
    try:
        unpack(frame(body, data))
    except WireError:
        pass


@st.composite
def mutated_frames(draw):
    buf = bytearray(pack(draw(trees)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[i] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del buf[i:i + draw(st.integers(1, 9))]
        else:
            del buf[i:]
    return bytes(buf)


@FAST
@given(mutated_frames())
def test_fuzz_mutated_frames_decode_or_raise_wire_error(buf):
    try:
        out = unpack(buf)
    except WireError:
        return
    pack(out)  # whatever decodes is a valid object within the limits
