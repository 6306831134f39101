"""Chunked readers of dataset files for ``stream-persia produce``: CSV/TSV (optionally
gzipped) and npz, one pass at a time, with memory bounded by one chunk.

A chunk is a dict of arrays sharing their first axis (the chunk's rows); see
:mod:`stream_persia.loader.produce` for the exact contract (names, dtype inference, npz slicing).
Errors name the file and the line or array that is wrong.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import zipfile
from collections.abc import Iterator
from typing import TextIO, cast

import numpy as np

from stream_persia.errors import BadInput, ConfigError

__all__ = ["FORMATS", "Columns", "detect_format", "read_chunks", "split_ids"]

FORMATS = ("csv", "tsv", "npz")
Columns = dict[str, np.ndarray]


def detect_format(path: str, fmt: str | None = None) -> str:
    """``fmt`` if given, else from the extension (``.csv``, ``.tsv``/``.tab``, ``.npz``,
    optionally followed by ``.gz`` for text)."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ConfigError(f"--format {fmt!r}", field="--format", hint=f"one of {FORMATS}")
        return fmt
    name = path.lower().removesuffix(".gz")
    for ext, found in ((".csv", "csv"), (".tsv", "tsv"), (".tab", "tsv"), (".npz", "npz")):
        if name.endswith(ext):
            return found
    raise ConfigError(f"cannot tell the format of {path} from its extension",
                      field="--format", hint=f"pass --format, one of {FORMATS}")


def read_chunks(path: str, fmt: str, batch_size: int, *, header: bool = True
                ) -> Iterator[Columns]:
    """Chunks of ``batch_size`` rows of one pass over ``path`` (see the module doc)."""
    if fmt == "npz":
        return _npz_chunks(path, batch_size)
    return _csv_chunks(path, batch_size, "\t" if fmt == "tsv" else ",", header)


def _open_text(path: str) -> TextIO:
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 (closed by caller)


def _csv_chunks(path: str, batch_size: int, delimiter: str, header: bool) -> Iterator[Columns]:
    with _open_text(path) as f:
        reader = csv.reader(f, delimiter=delimiter)
        names: list[str] | None = None
        rows: list[list[str]] = []
        try:
            for row in reader:
                if not row:
                    continue
                if names is None:
                    names = _header(row, path) if header else [f"col{i}" for i in range(len(row))]
                    if header:
                        continue
                if len(row) != len(names):
                    raise BadInput(
                        f"{path} line {reader.line_num}: expected {len(names)} fields, got "
                        f"{len(row)}", field=f"{path}:{reader.line_num}",
                        hint="one value per column; quote fields that hold the delimiter")
                rows.append(row)
                if len(rows) == batch_size:
                    yield _columns(names, rows)
                    rows = []
        except csv.Error as e:
            raise BadInput(f"{path} line {reader.line_num}: {e}",
                           field=f"{path}:{reader.line_num}") from None
        except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
            raise BadInput(f"{path} near line {reader.line_num} cannot be read as UTF-8 "
                           f"text: {e}", field=path) from None
        if rows and names is not None:
            yield _columns(names, rows)


def _header(row: list[str], path: str) -> list[str]:
    names = [n.strip() for n in row]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None or "" in names:
        what = f"column {dup!r} appears twice" if dup is not None else "a column has no name"
        raise BadInput(f"{path} header: {what}", field=f"{path}:1",
                       hint="give every column a unique name, or pass --no-header")
    return names


def _columns(names: list[str], rows: list[list[str]]) -> Columns:
    return {name: _infer(np.array(col)) for name, col in
            zip(names, zip(*rows, strict=True), strict=True)}


_EXACT = 2.0 ** 53   # float64 holds every integer up to this magnitude, not all beyond


def _infer(text: np.ndarray) -> np.ndarray:
    """int64, else uint64, else float64 (empty → NaN) unless that would round an integer,
    else the strings themselves."""
    try:
        return text.astype(np.int64)
    except OverflowError:
        with contextlib.suppress(ValueError, OverflowError):
            return text.astype(np.uint64)
    except ValueError:
        pass
    empty = text == ""
    if empty.all():
        return text
    try:
        if not empty.any():
            out = text.astype(np.float64)
        else:
            out = np.full(text.shape, np.nan)
            out[~empty] = text[~empty].astype(np.float64)
    except ValueError:
        return text
    return text if _rounds_integers(text, out) else out


def _rounds_integers(text: np.ndarray, floats: np.ndarray) -> bool:
    """Whether ``floats`` rounded an integer written in ``text``: one past 2**53, such as
    a hashed id in a column that also has an empty field or a negative number. Such a
    column stays text, so that no id is changed behind the mapping's back."""
    big = np.abs(floats) > _EXACT    # NaN is not
    if not big.any():
        return False
    digits = np.char.lstrip(np.char.strip(text[big]), "+-")
    return bool(np.char.isdigit(digits).any())


def _npz_chunks(path: str, batch_size: int) -> Iterator[Columns]:
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise BadInput(f"{path} is not an npz file: {e}", field=path) from None
    with archive, contextlib.ExitStack() as stack:
        arrays = {}
        for member in archive.namelist():
            if member.endswith(".npy"):
                arrays[member[:-4]] = _NpyStream(archive, member, path, stack)
        if not arrays:
            raise BadInput(f"{path} holds no arrays", field=path)
        lengths = {name: a.rows for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise BadInput(f"{path}: arrays differ in length along axis 0: {lengths}",
                           field=path, hint="every array needs one row per sample")
        total = next(iter(lengths.values()))
        for start in range(0, total, batch_size):
            n = min(batch_size, total - start)
            yield {name: a.read(n) for name, a in arrays.items()}


class _NpyStream:
    """Reads one ``.npy`` member of an npz archive row block by row block (bounded
    memory, compressed or not); Fortran-ordered arrays are loaded whole."""

    def __init__(self, archive: zipfile.ZipFile, member: str, path: str,
                 stack: contextlib.ExitStack):
        self.where = f"{path}:{member}"
        # a ZipExtFile in mode "r", whose readinto read() uses (typeshed says IO[bytes])
        f = stack.enter_context(cast(zipfile.ZipExtFile, archive.open(member)))
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                shape, fortran, dtype = (), True, None
        except ValueError as e:
            raise BadInput(f"{self.where} is not a valid .npy array: {e}",
                           field=self.where) from None
        self.whole: np.ndarray | None = None
        if dtype is None or (fortran and len(shape) > 1):
            f.close()
            with archive.open(member) as g:
                self.whole = np.lib.format.read_array(g, allow_pickle=False)
            shape, dtype = self.whole.shape, self.whole.dtype
        if dtype.hasobject:
            raise BadInput(f"{self.where} holds Python objects", field=self.where,
                           hint="store numeric or fixed-width string arrays")
        if not shape:
            raise BadInput(f"{self.where} is a 0-d array; it cannot be split into rows",
                           field=self.where)
        self.file, self.rows, self.shape, self.dtype = f, shape[0], shape[1:], dtype
        self.row_bytes = dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
        self.offset = 0

    def read(self, n: int) -> np.ndarray:
        if self.whole is not None:
            out = np.array(self.whole[self.offset:self.offset + n])
        else:
            buf = bytearray(n * self.row_bytes)
            got = self.file.readinto(buf) if buf else 0
            while got < len(buf):
                more = self.file.readinto(memoryview(buf)[got:])
                if not more:
                    raise BadInput(f"{self.where} is truncated", field=self.where)
                got += more
            out = np.frombuffer(buf, self.dtype).reshape((n, *self.shape))
        self.offset += n
        return out


def split_ids(column: np.ndarray, sep: str = "|") -> tuple[np.ndarray, np.ndarray]:
    """A column of id lists as text (``"12|7|93"``, ``""`` for none) → CSR ``(values,
    offsets)`` for ``IDTypeFeature.from_csr(name, values, offsets)``.

    Raises:
        BadInput: an id that is not an unsigned integer.
    """
    text = np.asarray(column).astype(str)
    counts = np.where(text == "", 0, np.char.count(text, sep) + 1)
    offsets = np.zeros(text.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    joined = sep.join(text[counts > 0].tolist())
    try:
        values = np.array(joined.split(sep) if joined else [], dtype=str).astype(np.uint64)
    except (ValueError, OverflowError) as e:
        raise BadInput(f"an id list holds something that is not an unsigned 64-bit integer: "
                       f"{e}", field="ids", hint=f"ids separated by {sep!r}") from None
    return values, offsets
