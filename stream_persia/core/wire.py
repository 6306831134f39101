"""The one wire format of stream-persia: Kafka message values and RPC frames (DESIGN.md §5).

Frame layout (all integers little-endian)::

    offset  size       field
    0       2          magic b"SP"
    2       1          format version (FORMAT_VERSION = 1)
    3       1          flags, must be 0 (reserved)
    4       4          body_len: u32, length of the msgpack body
    8       body_len   msgpack body: exactly one object
    ...     0..7       zero padding, so the data section starts at a multiple of 8
    D       rest       data section: raw little-endian bytes of every numpy array in the body

Body objects: nil, bool, int (-2**63 .. 2**64-1), float, str (UTF-8), bin, array, map with
str keys, and numpy arrays as msgpack ext type 1 whose payload is::

    u8 dtype code | u8 ndim | ndim x u64 shape | u64 offset

``offset`` is where the array's C-ordered bytes start in the data section (a multiple of the
itemsize; pack() aligns to 8). Dtype codes: 0 bool, 1 int8, 2 int16, 3 int32, 4 int64,
5 uint8, 6 uint16, 7 uint32, 8 uint64, 9 float16, 10 float32, 11 float64.

Array bytes live outside the msgpack body because msgpack-python hands ext payloads to
``ext_hook`` as fresh ``bytes``: inline payloads could not be decoded without a copy.
Out of band, :func:`unpack` returns each array as a read-only ``np.frombuffer`` view of the
caller's buffer, aligned for its dtype when the buffer is.

Hostile input: before msgpack allocates anything, a linear scan of the body checks that
every declared length is backed by bytes actually present, and enforces :class:`WireLimits`
(frame and body size, object count, container length, nesting depth, str keys, known ext
types). msgpack preallocates a container from its declared length, so without the scan a
few bytes could claim gigabytes. Array headers are checked (known dtype, ndim, shape product
computed without overflow, bounds, alignment) before the view is made. Peak memory of
unpack() is therefore about body_len + 100 bytes x max_objects, whatever the input.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from stream_persia.errors import ConfigError, WireError

__all__ = ["FORMAT_VERSION", "SUPPORTED_VERSIONS", "MAGIC", "HEADER_SIZE", "WireLimits",
           "DEFAULT_LIMITS", "SUPPORTED_DTYPES", "pack", "pack_parts", "unpack"]

FORMAT_VERSION: int = 1
SUPPORTED_VERSIONS = (1,)
MAGIC = b"SP"
HEADER_SIZE = 8
_HEADER = struct.Struct("<2sBBI")
_ALIGN = 8
_EXT_NDARRAY = 1

_DTYPE_CODES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")
_DTYPE_BY_CODE = tuple(np.dtype("<" + s) for s in _DTYPE_CODES)
_CODE_BY_KIND = {s: i for i, s in enumerate(_DTYPE_CODES)}
# The code of every little-endian (or byte-order-free) dtype, looked up by the dtype itself:
# one dict probe per array instead of building its ``dtype.str``.
_CODE_BY_DTYPE = {np.dtype("<" + s): i for i, s in enumerate(_DTYPE_CODES)}
# An array header (dtype code, ndim, shape, offset) per ndim, compiled once.
_EXT_HEADERS = tuple(struct.Struct(f"<BB{n}QQ") for n in range(33))
_EXT_SHAPES = tuple(struct.Struct(f"<{n}QQ") for n in range(33))
# msgpack.ExtType's own __new__ re-checks its arguments in Python for every array; the
# code and payload made here are valid by construction.
_new_ext = tuple.__new__
#: numpy dtypes that can travel in a frame (any byte order; sent little-endian)
SUPPORTED_DTYPES = tuple(np.dtype(s) for s in
                         ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                          "uint32", "uint64", "float16", "float32", "float64"))

_MiB = 1 << 20


@dataclass(frozen=True)
class WireLimits:
    """Hard limits that :func:`unpack` enforces before allocating (and :func:`pack` honours).

    Args:
        max_frame_bytes: whole frame, header and arrays included.
        max_body_bytes: the msgpack body (everything except array data); < 4 GiB.
        max_array_bytes: one array's data.
        max_array_ndim: dimensions of one array.
        max_depth: nesting of lists/maps (a flat list has depth 1).
        max_container_len: elements of one list, or entries of one map.
        max_objects: every value in the body, containers and map keys included.
    """

    max_frame_bytes: int = 256 * _MiB
    max_body_bytes: int = 64 * _MiB
    max_array_bytes: int = 256 * _MiB
    max_array_ndim: int = 8
    max_depth: int = 32
    max_container_len: int = 1 << 20
    max_objects: int = 1 << 21

    def __post_init__(self) -> None:
        caps = {"max_body_bytes": (1 << 32) - 1, "max_array_ndim": 32, "max_depth": 512}
        for name in ("max_frame_bytes", "max_body_bytes", "max_array_bytes", "max_array_ndim",
                     "max_depth", "max_container_len", "max_objects"):
            value = getattr(self, name)
            cap = caps.get(name, 1 << 62)
            if type(value) is not int or not 1 <= value <= cap:
                raise ConfigError(f"WireLimits.{name} must be an int in [1, {cap}], "
                                  f"got {value!r}", field=name)


DEFAULT_LIMITS = WireLimits()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


# --------------------------------------------------------------------------------- pack


def pack(obj: Any, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``obj`` as one frame.

    Accepts None, bool, int, float, str, bytes (also bytearray/memoryview), list, tuple,
    dict with str keys, numpy arrays of :data:`SUPPORTED_DTYPES` (any layout or byte
    order) and numpy bool/int/float scalars. Tuples come back as lists, scalars as Python
    numbers.

    Raises:
        WireError: ``obj`` holds an unsupported type or a non-str key, or the frame would
            break ``limits`` (so every frame pack() returns is accepted by unpack()).
    """
    return b"".join(pack_parts(obj, limits, copy_below=1 << 62))


def pack_parts(obj: Any, limits: WireLimits = DEFAULT_LIMITS, *,
               copy_below: int = 8192) -> list[bytes | memoryview]:
    """:func:`pack` as a list of pieces whose concatenation is the frame, for
    scatter-gather writes (``transport.writelines``, ``socket.sendmsg``).

    The data of every array of ``copy_below`` bytes or more is a ``memoryview`` of the
    array itself (of a little-endian C-ordered copy when the array is neither), so the
    caller must not modify such an array until the pieces are written. Everything else
    is joined into as few ``bytes`` as possible.

    Raises:
        WireError: as :func:`pack`.
    """
    arrays: list[tuple[int, np.ndarray]] = []
    cursor = [0]

    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            return _array_ext(o, arrays, cursor, limits)
        if isinstance(o, (np.bool_, np.integer, np.floating)):
            return o.item()
        raise WireError(f"cannot encode a value of type {type(o).__name__}",
                        hint="use None/bool/int/float/str/bytes/list/dict or a numpy array "
                             "of " + ", ".join(str(d) for d in SUPPORTED_DTYPES))

    try:
        body = msgpack.packb(obj, default=default, use_bin_type=True)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode object: {type(e).__name__}: {e}") from e
    if len(body) > limits.max_body_bytes:
        raise WireError(f"msgpack body of {len(body)} bytes exceeds max_body_bytes "
                        f"{limits.max_body_bytes}", field="max_body_bytes",
                        hint="move bulk data into numpy arrays or raise the limit")
    _scan(body, limits)
    data_start = _align(HEADER_SIZE + len(body))
    total = data_start + cursor[0]
    if total > limits.max_frame_bytes:
        raise WireError(f"frame of {total} bytes exceeds max_frame_bytes "
                        f"{limits.max_frame_bytes}", field="max_frame_bytes",
                        hint="split the batch or raise the limit on both ends")
    # Array data is referenced, not copied: large arrays become their own pieces, and
    # only the header, the body, padding and small arrays are joined into one bytes.
    pieces: list[bytes | memoryview] = []
    small: list[Any] = [_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body)), body,
                        bytes(data_start - HEADER_SIZE - len(body))]
    pos = 0
    for off, arr in arrays:
        if off > pos:
            small.append(bytes(off - pos))
        raw = arr.reshape(-1).view(np.uint8).data
        pos = off + raw.nbytes
        if raw.nbytes < copy_below:
            small.append(raw)
        else:
            pieces.append(b"".join(small))
            pieces.append(raw)
            small = []
    if small:
        pieces.append(b"".join(small))
    return pieces


def _array_ext(a: np.ndarray, arrays: list, cursor: list[int],
               limits: WireLimits) -> msgpack.ExtType:
    code = _CODE_BY_DTYPE.get(a.dtype)
    if code is None and a.dtype.fields is None:   # big-endian, or an unsupported dtype
        code = _CODE_BY_KIND.get(a.dtype.str[1:])
    if code is None:
        raise WireError(f"cannot encode a numpy array of dtype {a.dtype}",
                        hint="supported: " + ", ".join(str(d) for d in SUPPORTED_DTYPES))
    if a.ndim > limits.max_array_ndim:
        raise WireError(f"array of ndim {a.ndim} exceeds max_array_ndim "
                        f"{limits.max_array_ndim}", field="max_array_ndim")
    if a.nbytes > limits.max_array_bytes:
        raise WireError(f"array of {a.nbytes} bytes exceeds max_array_bytes "
                        f"{limits.max_array_bytes}", field="max_array_bytes")
    if a.dtype.str[0] == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # not ascontiguousarray: it turns 0-d arrays into 1-d
    off = _align(cursor[0])
    arrays.append((off, a))
    cursor[0] = off + a.nbytes
    return _new_ext(msgpack.ExtType,
                    (_EXT_NDARRAY, _EXT_HEADERS[a.ndim].pack(code, a.ndim, *a.shape, off)))


# ------------------------------------------------------------------------------- unpack


def unpack(buf: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """Decode one frame made by :func:`pack`.

    numpy arrays come back as read-only views of ``buf`` (no copy); they keep ``buf``
    alive, and a bytearray cannot be resized while they exist.

    Raises:
        WireError: for anything that is not a valid frame within ``limits``. No other
            exception escapes for any input (MemoryError aside, which the limits keep out
            of reach).
    """
    try:
        return _unpack(buf, limits)
    except (WireError, MemoryError):
        raise
    except Exception as e:  # hostile input may trip anything inside msgpack or numpy
        raise WireError(f"invalid frame: {type(e).__name__}: {e}") from e


def _unpack(buf: Any, limits: WireLimits) -> Any:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise WireError(f"a frame must be bytes, bytearray or memoryview, got "
                        f"{type(buf).__name__}") from None
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    n = mv.nbytes
    if n > limits.max_frame_bytes:
        raise WireError(f"frame of {n} bytes exceeds max_frame_bytes {limits.max_frame_bytes}",
                        field="max_frame_bytes")
    if n < HEADER_SIZE:
        raise WireError(f"frame of {n} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, body_len = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        # The bytes found are not quoted: the frame may be any file's or peer's data.
        raise WireError(f"bad magic: a frame starts with {MAGIC!r}",
                        hint="this is not a stream-persia frame")
    if version not in SUPPORTED_VERSIONS:
        raise WireError(f"unsupported wire format version {version}; this build reads "
                        f"version(s) {list(SUPPORTED_VERSIONS)}", field="version",
                        hint="upgrade the reading side or downgrade the writer")
    if flags != 0:
        raise WireError(f"unknown frame flags 0x{flags:02x}; version {version} defines none",
                        field="flags")
    if body_len > limits.max_body_bytes:
        raise WireError(f"body of {body_len} bytes exceeds max_body_bytes "
                        f"{limits.max_body_bytes}", field="max_body_bytes")
    data_start = _align(HEADER_SIZE + body_len)
    if data_start > n:
        raise WireError(f"truncated frame: header declares a {body_len}-byte body but the "
                        f"frame has {n} bytes")
    body = mv[HEADER_SIZE:HEADER_SIZE + body_len]
    data = mv[data_start:]
    _scan(body, limits)
    writable = not mv.readonly

    def ext_hook(code: int, payload: bytes) -> np.ndarray:
        return _array_from_ext(code, payload, data, writable, limits)

    blen = max(body_len, 1)
    return msgpack.unpackb(body, ext_hook=ext_hook, raw=False, strict_map_key=True,
                           use_list=True, max_str_len=blen, max_bin_len=blen,
                           max_array_len=min(blen, limits.max_container_len),
                           max_map_len=min(blen, limits.max_container_len),
                           max_ext_len=10 + 8 * limits.max_array_ndim)


def _array_from_ext(code: int, payload: bytes, data: memoryview, writable: bool,
                    limits: WireLimits) -> np.ndarray:
    if code != _EXT_NDARRAY or len(payload) < 2:
        raise WireError(f"unknown ext type {code} or short payload")
    dcode, ndim = payload[0], payload[1]
    if dcode >= len(_DTYPE_BY_CODE):
        raise WireError(f"array has unknown dtype code {dcode}",
                        hint=f"known codes 0..{len(_DTYPE_BY_CODE) - 1}")
    if ndim > limits.max_array_ndim:
        raise WireError(f"array ndim {ndim} exceeds max_array_ndim {limits.max_array_ndim}",
                        field="max_array_ndim")
    if len(payload) != 10 + 8 * ndim:
        raise WireError(f"array header of {len(payload)} bytes, expected {10 + 8 * ndim} "
                        f"for ndim {ndim}")
    *shape, off = _EXT_SHAPES[ndim].unpack_from(payload, 2)
    dtype = _DTYPE_BY_CODE[dcode]
    if ndim == 1:   # most arrays: the loop below, unrolled
        count = shape[0]
        if count > limits.max_array_bytes:
            raise WireError(f"array dimension {count} exceeds max_array_bytes "
                            f"{limits.max_array_bytes}", field="max_array_bytes")
        if count * dtype.itemsize > limits.max_array_bytes:
            raise WireError(f"array of shape {tuple(shape)} and dtype {dtype} exceeds "
                            f"max_array_bytes {limits.max_array_bytes}",
                            field="max_array_bytes")
        return _array_view(dtype, count, off, shape, data, writable)
    count = 1
    for dim in shape:
        # Checking each factor keeps the running product small (no bignum blow-up) and
        # rejects absurd dims of zero-size arrays that numpy would accept.
        if dim > limits.max_array_bytes:
            raise WireError(f"array dimension {dim} exceeds max_array_bytes "
                            f"{limits.max_array_bytes}", field="max_array_bytes")
        count *= dim
        if count * dtype.itemsize > limits.max_array_bytes:
            raise WireError(f"array of shape {tuple(shape)} and dtype {dtype} exceeds "
                            f"max_array_bytes {limits.max_array_bytes}",
                            field="max_array_bytes")
    return _array_view(dtype, count, off, shape, data, writable)


def _array_view(dtype: np.dtype, count: int, off: int, shape: list[int], data: memoryview,
                writable: bool) -> np.ndarray:
    """The checked array's view of the data section (``count`` items of ``shape``)."""
    nbytes = count * dtype.itemsize
    if off % dtype.itemsize or off + nbytes > data.nbytes:
        raise WireError(f"array data [{off}, {off + nbytes}) is misaligned or outside the "
                        f"{data.nbytes}-byte data section")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=off)
    if len(shape) != 1:
        arr = arr.reshape(shape)
    if dtype.kind == "b" and count and arr.view(np.uint8).max() > 1:
        raise WireError("bool array holds bytes other than 0 and 1")
    if writable:
        arr.flags.writeable = False
    return arr


# --------------------------------------------------------------------------------- scan

# First byte -> (kind, n): kind 0 = scalar of n bytes in all; 1 = str with n-byte length;
# 2 = bin with n-byte length; 3 = ext with n-byte length; 4 = fixext of n data bytes;
# 5 = array with n-byte count; 6 = map with n-byte count; 7 = invalid; 8 = fixstr;
# 9 = fixarray; 10 = fixmap.
_TABLE: list[tuple[int, int]] = [(0, 1)] * 256
for _b in range(0x80, 0x90):
    _TABLE[_b] = (10, _b & 0x0F)
for _b in range(0x90, 0xA0):
    _TABLE[_b] = (9, _b & 0x0F)
for _b in range(0xA0, 0xC0):
    _TABLE[_b] = (8, _b & 0x1F)
_TABLE[0xC1] = (7, 0)
for _b, _kn in {0xC4: (2, 1), 0xC5: (2, 2), 0xC6: (2, 4), 0xC7: (3, 1), 0xC8: (3, 2),
                0xC9: (3, 4), 0xCA: (0, 5), 0xCB: (0, 9), 0xCC: (0, 2), 0xCD: (0, 3),
                0xCE: (0, 5), 0xCF: (0, 9), 0xD0: (0, 2), 0xD1: (0, 3), 0xD2: (0, 5),
                0xD3: (0, 9), 0xD4: (4, 1), 0xD5: (4, 2), 0xD6: (4, 4), 0xD7: (4, 8),
                0xD8: (4, 16), 0xD9: (1, 1), 0xDA: (1, 2), 0xDB: (1, 4), 0xDC: (5, 2),
                0xDD: (5, 4), 0xDE: (6, 2), 0xDF: (6, 4)}.items():
    _TABLE[_b] = _kn
_TABLE_T = tuple(_TABLE)
del _TABLE, _b, _kn


def _scan(body: Any, limits: WireLimits) -> None:
    """Walk the msgpack body without building objects; raise WireError if unpacking it
    could break ``limits`` or it is not exactly one well-formed object."""
    b = bytes(body) if not isinstance(body, bytes) else body
    end = len(b)
    pos = 0
    objects = 0
    # The innermost open container is kept in locals (this loop runs for every value of
    # every frame): r = items it has left (for a map keys and values both count, and an
    # even remainder means the next item is a key), m = whether it is a map. Enclosing
    # containers wait on the stack. The root is a pseudo-container of one item.
    r, m = 1, False
    stack: list[tuple[int, bool]] = []
    max_depth, max_len = limits.max_depth, limits.max_container_len
    max_objects = limits.max_objects
    max_ext = 10 + 8 * limits.max_array_ndim
    table = _TABLE_T
    while True:
        if r == 0:
            if not stack:
                break
            r, m = stack.pop()
            continue
        key = m and not r & 1
        r -= 1
        if pos >= end:
            raise WireError(f"truncated body: value expected at offset {pos} of {end}")
        objects += 1
        if objects > max_objects:
            raise WireError(f"body holds more than max_objects {max_objects} values",
                            field="max_objects", hint="send bulk data as numpy arrays")
        kind, n = table[b[pos]]
        if kind == 8:  # fixstr: the most common value (every map key)
            pos += 1 + n
            continue
        if key and kind != 1:
            raise WireError(f"map key at body offset {pos} is not a str "
                            f"(msgpack type byte 0x{b[pos]:02x})", hint="maps need str keys")
        if kind == 0:
            pos += n
            continue
        if kind == 7:
            raise WireError(f"invalid msgpack type byte 0xc1 at body offset {pos}")
        if kind == 4:  # fixext: type byte, then n data bytes
            _check_ext_type(b, pos + 1, pos)
            pos += 2 + n
            continue
        if kind == 9 or kind == 10:
            count = n
            pos += 1
        else:
            if pos + 1 + n > end:
                raise WireError(f"truncated body: length field at offset {pos}")
            count = int.from_bytes(b[pos + 1:pos + 1 + n], "big")  # msgpack is big-endian
            pos += 1 + n
            if kind == 1 or kind == 2:  # str, bin: skip the payload
                pos += count
                continue
            if kind == 3:  # ext: type byte, then count data bytes
                _check_ext_type(b, pos, pos - 1 - n)
                if count > max_ext:
                    raise WireError(f"ext of {count} bytes at body offset {pos - 1 - n} is "
                                    f"longer than an array header of max_array_ndim "
                                    f"{limits.max_array_ndim} dimensions",
                                    field="max_array_ndim")
                pos += 1 + count
                continue
        # a list or map of `count` entries
        if count > max_len:
            raise WireError(f"container of {count} entries exceeds max_container_len "
                            f"{max_len}", field="max_container_len")
        if len(stack) >= max_depth:
            raise WireError(f"nesting deeper than max_depth {max_depth}", field="max_depth")
        items = count * 2 if kind == 6 or kind == 10 else count
        if items > end - pos:
            raise WireError(f"container at body offset {pos} declares {count} entries but "
                            f"only {end - pos} bytes follow")
        stack.append((r, m))
        r, m = items, kind == 6 or kind == 10
    if pos != end:
        raise WireError(f"body has {end - pos} bytes after its value"
                        if pos < end else f"truncated body: needs {pos} bytes, has {end}")


def _check_ext_type(b: bytes, at: int, pos: int) -> None:
    if at >= len(b):
        raise WireError(f"truncated ext at body offset {pos}")
    if b[at] != _EXT_NDARRAY:
        code = b[at] - 256 if b[at] > 127 else b[at]
        raise WireError(f"unknown msgpack ext type {code} at body offset {pos}",
                        hint=f"version {FORMAT_VERSION} frames only use ext type "
                             f"{_EXT_NDARRAY} (numpy arrays)")
