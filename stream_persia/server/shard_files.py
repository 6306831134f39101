"""Embedding shard files: the format an embedding server dumps its shard in, and the
all-or-nothing procedure by which a server loads its rows from any number of them.

Format (``embedding-shard-<i>-of-<n>.bin``, see :func:`shard_file_name`): a sequence of
records, each a 4-byte big-endian length followed by a ``wire.pack``-ed store chunk (see
``EmbeddingStore.dump``), oldest rows first so loading reproduces LRU order. A store with
a frequency-admission sketch ends its dump with a *sketch chunk*
(:func:`stream_persia.server.policies.sketch_chunk`): a valid store chunk of no rows
carrying the sketch's counters, so the format's version is unchanged (a reader that does
not know the sketch loads no row from it and restores without the counts, as before), and
the file's sha256 and row count in the manifest cover it. A server restores the sketches of
its own file when the checkpoint had as many servers (its own counts back), else of every
file (merged: no id counted lower than it was).

Restoring a shard (the server's ``load``, :mod:`stream_persia.server.service`) is all or
nothing. The files are streamed into a fresh staging store built with the server's
capacity, optimizer and embedding config (:func:`stage_shard_files`), which replaces the
serving store only after every listed file has been read to its end and passed every
check; on any failure the staging store is dropped and the server holds exactly what it
held before (rows, LRU order, optimizer state, counters). On success the server's
reported counters go on from where they were, leaving out what the load itself counted
(see :mod:`stream_persia.server.service`). The checks, in order:

1. the request (checked by the server before any file is touched): plain, distinct file
   names; a well-formed ``expected``;
2. before any file is read: every file exists and has its expected size (so the common
   failures, a missing or truncated file, cost nothing);
3. while each file streams: framing (a record's length fits in what is left of the file),
   every record decodes to a valid store chunk for this server's optimizer
   (``EmbeddingStore.load``'s contract: dim, uint64 ids, float32 weights and state of the
   right shapes and kind) — every record, not only the rows this shard keeps, so all
   servers reach the same verdict on a file — then at its end its sha256 and row count;
4. inserting into the staging store (an id stored with two dims is refused there).

A failure is a BadInput whose message names the file (and record) and the reason, with
``field`` ``files[i]``; running out of memory halfway is one too (its hint says what to do).
An I/O error other than a missing or unreadable file is a RemoteError. Either way the
server is unchanged. A server may also keep the checked staging store aside until told to
swap it in (``load`` with ``stage``, then ``commit_load``): that is how
:func:`stream_persia.checkpoint.load_embeddings` makes a restore all or nothing across
servers, not only per server. Values are not checked for finiteness: a dump round-trips whatever
the store held; bit rot inside the float data is caught only by ``expected`` sha256, which
:func:`stream_persia.checkpoint.load_embeddings` always passes.

One pass, not a validation pass then a loading pass: every check has to be made again
while loading anyway (a file may change between two reads), so a first pass would only
buy failing before the new table grows, for the price of reading every file twice (each
server reads every shard file, perhaps from object storage); step 2 covers the usual
failures before anything is read.

Memory: the peak during a load is the old table plus the new one (plus one record). An
empty store holds a few KB (its tables grow with rows; ``clear`` frees them), so an empty
server loses nothing by keeping its old store until the swap. A server that holds rows but
cannot hold two tables can be ``clear``-ed before the load, giving up the fallback.
"""

from __future__ import annotations

import hashlib
import io
import re
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from stream_persia.core import wire
from stream_persia.core.replies import ShardFileInfo
from stream_persia.errors import BadInput, RemoteError, WireError, require
from stream_persia.kernels.sharding import shard_of
from stream_persia.server._pystore import check_chunk
from stream_persia.server.policies import check_sketch_chunk

__all__ = ["check_load_request", "is_plain_file_name", "read_shard_file", "shard_file_name",
           "stage_shard_files", "write_shard_file"]

_LEN = struct.Struct(">I")


_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"embedding-shard-(\d+)-of-(\d+)\.bin")
_EXPECTED_KEYS = ("sha256", "bytes", "rows")


def shard_file_name(replica_index: int, replica_size: int) -> str:
    return f"embedding-shard-{replica_index:05d}-of-{replica_size:05d}.bin"


def is_plain_file_name(name: object) -> bool:
    """Whether ``name`` can only name a file inside the checkpoint directory: a non-empty
    string with no path separator, not starting with '.'."""
    return (isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name
            and not name.startswith("."))


def stage_shard_files(staging: Any, directory: str, files: list[str],
                      expected: dict[str, dict[str, Any]], replica_index: int,
                      replica_size: int, *, held_rows: int = 0) -> int:
    """Load the rows shard ``replica_index`` of ``replica_size`` owns in ``files`` into
    ``staging`` (an empty store that is not serving); returns how many rows were kept.

    Runs the checks of the module docstring; on failure ``staging`` is left partly filled
    and must be dropped. ``held_rows`` (the serving table's size) only words the
    out-of-memory error.
    """
    fs, root = _filesystem(directory)
    for i, name in enumerate(files):   # the cheap checks of every file before reading any
        _file_size(fs, _join(root, name), expected.get(name), f"files[{i}]")
    kept = 0
    for i, name in enumerate(files):
        field, path = f"files[{i}]", _join(root, name)
        try:
            chunks = read_shard_file(directory, name, expected=expected.get(name),
                                     field=field)
            for k, chunk in enumerate(chunks):
                try:
                    owned = _owned_chunk(chunk, staging.optimizer, replica_index,
                                         replica_size, name)
                    if owned is not None:
                        staging.load([owned])
                        kept += len(owned["ids"])
                except BadInput as e:
                    raise BadInput(f"shard file {path} record {k}: {e.message}", field=field,
                                   hint=e.hint) from None
        except MemoryError:
            raise BadInput(f"out of memory loading shard file {path} into a new table beside "
                           f"the current one ({held_rows} rows), which is kept", field=field,
                           hint="clear the server first (giving up the fallback), give it "
                                "more memory, or restore into more servers") from None
    return kept


def _owned_chunk(chunk: Any, optimizer: Any, replica_index: int,
                 replica_size: int, name: str = "") -> dict | None:
    """The rows of ``chunk`` this shard owns as a store chunk (None if none), after
    checking the whole chunk against the store's contract. A sketch chunk of file
    ``name`` is this shard's unless the file is another server's of as many servers."""
    dim, ids, weights, state = check_chunk(chunk, optimizer)
    if "sketch" in chunk:
        check_sketch_chunk(chunk)
        m = _FILE_NAME.fullmatch(name)
        if m is not None and int(m[2]) == replica_size and int(m[1]) != replica_index:
            return None
        return chunk
    keep = shard_of(ids, replica_size) == replica_index
    if not keep.any():
        return None
    if not keep.all():
        ids, weights = ids[keep], weights[keep]
        state = None if state is None else state[keep]
    owned = {"dim": dim, "ids": ids, "weights": weights}
    if state is not None:
        owned.update(state=state, state_kind=optimizer.state_kind)
    return owned


def write_shard_file(chunks: Iterator[dict], directory: str, name: str) -> ShardFileInfo:
    """Stream store chunks into ``directory/name`` atomically (temp file + rename)."""
    fs, root = _filesystem(directory)
    fs.makedirs(root, exist_ok=True)
    final = _join(root, name)
    tmp = f"{final}.tmp"
    digest = hashlib.sha256()
    rows = size = 0
    with fs.open(tmp, "wb") as f:
        for chunk in chunks:
            body = wire.pack(chunk)
            head = _LEN.pack(len(body))
            for part in (head, body):
                f.write(part)
                digest.update(part)
            rows += len(chunk["ids"])
            size += len(head) + len(body)
    fs.mv(tmp, final)
    return {"file": name, "rows": rows, "bytes": size, "sha256": digest.hexdigest()}


def read_shard_file(directory: str, name: str, *, expected: dict[str, Any] | None = None,
                    field: str = "files") -> Iterator[dict]:
    """Yield the chunks of one shard file (limits of the wire format apply per chunk).

    Framing is checked as the file streams: a record must decode, be a map with ``ids``,
    and its length must fit in what is left of the file. ``expected`` (``{"sha256"?,
    "bytes"?, "rows"?}``, as in the checkpoint manifest) is checked too: the size before
    the first chunk (and the bytes read after the last), the sha256 and row count after
    the last, so only a consumer that exhausts the iterator has the whole file checked.

    Raises:
        BadInput: (``field``, naming the file) a bad name, a missing or unreadable file,
            a truncated or corrupt file, or one that differs from ``expected``.
        RemoteError: reading failed otherwise (the storage, not the file).
    """
    if not is_plain_file_name(name):
        raise BadInput(f"shard file name {name!r} must be a plain file name", field=field)
    fs, root = _filesystem(directory)
    path = _join(root, name)
    expected = expected or {}
    size = _file_size(fs, path, expected, field)
    digest = hashlib.sha256() if "sha256" in expected else None
    pos = rows = record = 0
    try:
        with _open_for_read(fs, path) as f:
            while True:
                head = f.read(_LEN.size)
                if not head:
                    break
                start, pos = pos, pos + len(head)
                if len(head) != _LEN.size:
                    raise BadInput(f"shard file {path} is truncated: record {record} at byte "
                                   f"{start} has a partial length", field=field)
                (n,) = _LEN.unpack(head)
                if size is not None and n > size - pos:
                    raise BadInput(f"shard file {path} is truncated (or corrupt): record "
                                   f"{record} at byte {start} declares {n} bytes but "
                                   f"{max(size - pos, 0)} remain", field=field)
                if n > wire.DEFAULT_LIMITS.max_frame_bytes:
                    raise BadInput(f"shard file {path} is corrupt: record {record} at byte "
                                   f"{start} declares {n} bytes", field=field)
                body = f.read(n)
                pos += len(body)
                if len(body) != n:
                    raise BadInput(f"shard file {path} is truncated: record {record} at byte "
                                   f"{start} has {len(body)} of its {n} bytes", field=field)
                if digest is not None:
                    digest.update(head)
                    digest.update(body)
                try:
                    chunk = wire.unpack(body)
                except WireError as e:
                    raise BadInput(f"shard file {path} is corrupt: record {record} at byte "
                                   f"{start} does not decode: {e.message}", field=field) from None
                if not isinstance(chunk, dict) or not isinstance(chunk.get("ids"), np.ndarray):
                    raise BadInput(f"shard file {path} is corrupt: record {record} is not a "
                                   f"store chunk", field=field)
                rows += len(chunk["ids"])
                record += 1
                yield chunk
    except OSError as e:
        raise _io_error(path, e, field) from e
    if pos != expected.get("bytes", pos):   # changed since it was sized, or size unknown
        raise BadInput(f"shard file {path} has {pos} bytes but {expected['bytes']} were "
                       f"expected (truncated or overwritten)", field=field)
    if digest is not None and digest.hexdigest() != expected["sha256"]:
        raise BadInput(f"shard file {path} is corrupt: its sha256 is {digest.hexdigest()[:12]}… "
                       f"but {expected['sha256'][:12]}… was expected", field=field)
    if "rows" in expected and rows != expected["rows"]:
        raise BadInput(f"shard file {path} holds {rows} rows but {expected['rows']} were "
                       f"expected", field=field)


def check_load_request(params: Any
                       ) -> tuple[str, list[str], dict[str, dict[str, Any]], bool]:
    """(dir, files, expected: file → checks ({} when not given), stage) of an embedding
    server's ``load`` request, validated (BadInput naming the field)."""
    directory = require(params, "dir", str)
    files = require(params, "files", list)
    # ``cut`` (the stream watermarks a load sets) and ``cut_fingerprints`` are the server's:
    # stream_persia.core.watermarks.
    # ``patches`` (applied over the files) are checked by stream_persia.server.patches.
    # ``trained_through`` (the checkpoint's event time) is checked by the server too.
    unknown = sorted(map(str, set(params) - {"dir", "files", "expected", "stage", "cut",
                                             "cut_fingerprints", "patches",
                                             "trained_through"}))
    if unknown:
        raise BadInput(f"unknown load field(s) {unknown}", field=unknown[0],
                       hint="dir, files, expected, stage, cut, cut_fingerprints, patches, "
                            "trained_through")
    stage = params.get("stage", False)
    if not isinstance(stage, bool):
        raise BadInput(f"stage must be true or false, got {stage!r}", field="stage")
    seen: set[str] = set()
    for i, name in enumerate(files):
        if not is_plain_file_name(name):
            raise BadInput(f"files[{i}] must be a plain shard file name, got {name!r}",
                           field=f"files[{i}]", hint="no '/', not starting with '.'")
        if name in seen:
            raise BadInput(f"files[{i}] {name!r} is listed twice", field=f"files[{i}]")
        seen.add(name)
    expected = params.get("expected")
    if expected is None:
        return directory, files, {}, stage
    if not isinstance(expected, dict):
        raise BadInput(f"expected must map file name -> {{sha256, bytes, rows}}, got "
                       f"{type(expected).__name__}", field="expected")
    for name in expected:
        if name not in seen:
            raise BadInput(f"expected has an entry for {name!r}, which files does not list",
                           field=f"expected.{name}")
    for name in files:
        entry = expected.get(name)
        where = f"expected.{name}"
        if entry is None:
            raise BadInput(f"expected has no entry for {name!r}", field=where,
                           hint="give every listed file an entry, or leave expected out")
        if not isinstance(entry, dict) or not entry:
            raise BadInput(f"{where} must be a non-empty map with keys from "
                           f"{list(_EXPECTED_KEYS)}, got {entry!r}", field=where)
        for key, value in entry.items():
            if key not in _EXPECTED_KEYS:
                raise BadInput(f"{where} has unknown key {key!r}", field=f"{where}.{key}",
                               hint=", ".join(_EXPECTED_KEYS))
            if key == "sha256":
                ok = isinstance(value, str) and _SHA256.fullmatch(value) is not None
                accepted = "64 lowercase hex digits"
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
                accepted = "an int >= 0"
            if not ok:
                raise BadInput(f"{where}.{key} must be {accepted}, got {value!r}",
                               field=f"{where}.{key}")
    return directory, files, expected, stage


def _filesystem(directory: str) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(directory)
    except (ValueError, ImportError) as e:   # an unknown protocol, or its package missing
        raise BadInput(f"dir {directory!r} cannot be opened: {type(e).__name__}: {e}",
                       field="dir") from None


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _file_size(fs: Any, path: str, expected: dict[str, Any] | None, field: str
               ) -> int | None:
    """The size of ``path`` in bytes (None where the storage does not tell), checked
    against ``expected["bytes"]``."""
    try:
        size = fs.size(path)
    except OSError as e:
        raise _io_error(path, e, field) from e
    if size is None:
        return None
    want = (expected or {}).get("bytes")
    if want is not None and size != want:
        raise BadInput(f"shard file {path} has {size} bytes but {want} were expected "
                       f"(truncated or overwritten)", field=field)
    return int(size)


def _io_error(path: str, exc: OSError, field: str) -> BadInput | RemoteError:
    if isinstance(exc, FileNotFoundError):
        return BadInput(f"shard file {path} does not exist", field=field)
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, PermissionError)):
        return BadInput(f"shard file {path} cannot be read: {exc}", field=field)
    return RemoteError(f"reading shard file {path} failed: {type(exc).__name__}: {exc}",
                       hint="the storage may be unavailable; retry")


def _open_for_read(fs: Any, path: str) -> Any:
    # fsspec's memory filesystem hands every opener the same file object (one shared
    # position), so servers of one process loading the same shard concurrently would
    # interleave their reads; its bytes are in memory already, so read a private copy.
    if "memory" in fs.protocol:
        return io.BytesIO(fs.cat_file(path))
    return fs.open(path, "rb")
