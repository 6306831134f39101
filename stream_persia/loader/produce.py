"""``stream-persia produce``: stream a dataset file through a user mapping into a job.

::

    stream-persia produce DATA_FILE --mapping MAPPING [--format csv|tsv|npz]
        [--batch-size 1024] [--kafka HOST:PORT,... | --embedding-workers HOST:PORT,...]
        [--global-config FILE] [--embedding-config FILE] [--topic TOPIC]
        [--compression none|gzip|...] [--max-inflight 8] [--timeout-ms 600000]
        [--limit ROWS] [--repeat PASSES]
        [--no-header] [--no-progress]

The file is read in chunks of ``--batch-size`` rows (memory stays bounded by one chunk);
each chunk goes through the user's mapping, and the ``PersiaBatch`` it returns is sent
with :class:`~stream_persia.loader.data_ctx.DataCtx` (Kafka, or broker-less straight to the
embedding workers; the destination is resolved as DataCtx does).

**The mapping** (``--mapping pkg.module[:function]`` or ``--mapping path/file.py[:function]``;
the function defaults to ``make_batch``; a file's folder is put on ``sys.path`` first)::

    def make_batch(columns: dict[str, np.ndarray], batch_index: int) -> PersiaBatch | None

- It is called once per chunk, in file order, from one thread. A chunk holds
  ``--batch-size`` consecutive rows; the last chunk of a pass (or of ``--limit``) may be
  shorter.
- ``columns`` maps a name to a 1-D-or-more array whose first axis is the chunk's rows
  (every array has the same length). The arrays are new for every chunk and writable, so
  the mapping may keep or modify them.

  * CSV/TSV: one 1-D array per column, keyed by the header's names (``col0``, ``col1``,
    ... with ``--no-header``). The dtype is inferred per column and per chunk: ``int64``
    when every value is an integer that fits, ``uint64`` when they are non-negative and
    some exceed int64 (hashed ids), ``float64`` when every value is a number (empty
    fields become NaN) and no integer past 2**53 would be rounded (a hashed-id column
    with an empty field stays text), else ``str`` (numpy ``<U``). Inference is per chunk, so cast
    (``columns["x"].astype(np.float32)``) where a fixed dtype matters. Blank lines are
    skipped; a row with the wrong number of fields stops the run, naming its line.
    ``.gz`` files are read compressed. :func:`split_ids` (from
    :mod:`stream_persia.loader.readers`, re-exported here) turns a column of ``"1|2|3"``
    strings into CSR ids for ``IDTypeFeature.from_csr``.
  * npz: every array of the archive, keyed by its name, sliced along axis 0 (all arrays
    need the same length); dtype and trailing dimensions as stored.
- ``batch_index`` counts chunks from 0 across every ``--repeat`` pass, skipped ones
  included.
- Return a ``PersiaBatch`` to send, or None to skip the chunk. Anything else, or an
  exception, stops the run (exit 2) with a message naming the mapping and the chunk.

Exit status: 0 done; 1 the destination failed (unreachable, backpressure timeout); 2 bad
input (file, format, mapping, flags), with a message naming it; 130 interrupted (what
was sent is flushed first).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import itertools
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from stream_persia.config import flags
from stream_persia.config.kafka import COMPRESSION_TYPES
from stream_persia.core.data import PersiaBatch
from stream_persia.errors import BadInput, ConfigError, PersiaError
from stream_persia.loader.readers import FORMATS, Columns, detect_format, read_chunks, split_ids

log = logging.getLogger(__name__)

__all__ = ["Summary", "Progress", "add_arguments", "detect_format", "load_mapping", "main",
           "produce", "read_chunks", "split_ids"]

Mapping = Callable[[Columns, int], Any]


# ---------------------------------------------------------------------- mapping
def load_mapping(spec: str) -> Mapping:
    """Import ``module[:function]`` or ``file.py[:function]`` (function default make_batch).

    Raises:
        BadInput: naming ``--mapping`` when it cannot be imported, lacks the function, or
            the function cannot be called as ``f(columns, batch_index)``.
    """
    target, func = spec, "make_batch"
    head, colon, tail = spec.rpartition(":")
    if colon and head and tail.isidentifier():
        target, func = head, tail
    try:
        module = _import(target)
    except BadInput:
        raise
    except Exception as e:
        traceback.print_exc()
        raise BadInput(f"--mapping {target}: importing it raised {e!r}",
                       field="--mapping") from None
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and not k.startswith("_"))
        raise BadInput(f"--mapping {spec}: {target} has no function {func!r}",
                       field="--mapping", hint=f"name one with {target}:FUNCTION "
                       f"(functions there: {', '.join(defined) or 'none'})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # nothing to inspect (some builtins): trust it
        return fn
    try:
        signature.bind({}, 0)
    except TypeError:
        raise BadInput(f"--mapping {spec}: {func}{signature} cannot be called as "
                       "make_batch(columns, batch_index)", field="--mapping") from None
    return fn


def _import(target: str) -> Any:
    path = Path(target)
    if target.endswith(".py") or os.sep in target:
        if not path.is_file():
            raise BadInput(f"--mapping file {target} does not exist", field="--mapping")
        name = f"_stream_persia_mapping_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise BadInput(f"--mapping {target} is not a Python file", field="--mapping")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))  # like running it as a script
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and target.startswith(e.name):
            raise BadInput(f"--mapping: no module named {target!r}", field="--mapping",
                           hint="a module on PYTHONPATH, or a path ending in .py") from None
        raise


# ---------------------------------------------------------------------- progress
@dataclass
class Summary:
    """What a run did."""

    rows: int = 0
    batches: int = 0
    skipped: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        secs = max(self.seconds, 1e-9)
        skipped = f" ({self.skipped} chunks skipped)" if self.skipped else ""
        return (f"{self.rows:,} rows in {self.batches:,} batches{skipped}, "
                f"{self.bytes / 1e6:,.1f} MB in {self.seconds:.1f} s: "
                f"{self.rows / secs:,.0f} rows/s, {self.bytes / 1e6 / secs:,.2f} MB/s")


class Progress:
    """Progress on ``stream``: one line redrawn in place on a terminal, otherwise a log
    line every ``interval_s``.

    Args:
        stream: where to draw (default stderr).
        enabled: False draws nothing (the final summary is still printed by ``main``).
        tty: override the terminal check (tests).
        interval_s: seconds between updates (default 0.2 on a terminal, 10 otherwise).
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True,
                 tty: bool | None = None, interval_s: float | None = None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.tty else 10.0)
        self._last = time.monotonic()
        self._drawn = False

    def update(self, summary: Summary, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        if self.tty:
            self.stream.write(f"\r\x1b[Kproduce: {summary.line()}")
            self.stream.flush()
            self._drawn = True
        else:
            log.info("produce: %s", summary.line())

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# ---------------------------------------------------------------------- the run
def produce(path: str, mapping: Mapping, ctx: Any, *, fmt: str | None = None,
            batch_size: int = 1024, header: bool = True, limit: int | None = None,
            repeat: int = 1, progress: Progress | None = None,
            summary: Summary | None = None) -> Summary:
    """Stream ``path`` through ``mapping`` into ``ctx`` (a started ``DataCtx``, or
    anything with ``send_data`` and ``stats``).

    Args:
        limit: stop after this many rows in all (None: no limit).
        repeat: passes over the file; 0 repeats until interrupted. A file without rows
            is read once, with a warning.
        summary: filled in as the run goes (so a caller sees the counts on an error).

    Raises:
        BadInput: the file or the mapping's result is wrong (names the row or chunk).
    """
    fmt = detect_format(path, fmt)
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}", field="--batch-size")
    if repeat < 0 or (limit is not None and limit < 0):
        raise ConfigError("--repeat and --limit must be >= 0", field="--repeat")
    if not os.path.isfile(path):
        raise BadInput(f"data file {path} does not exist", field="DATA_FILE")
    name = getattr(mapping, "__name__", repr(mapping))
    summary = summary if summary is not None else Summary()
    progress = progress or Progress(enabled=False)
    start, index = time.monotonic(), 0
    passes = itertools.count() if repeat == 0 else range(repeat)
    for _ in passes:
        rows_before = summary.rows
        for columns in read_chunks(path, fmt, batch_size, header=header):
            n = len(next(iter(columns.values())))
            if limit is not None and summary.rows + n > limit:
                n = limit - summary.rows
                columns = {k: v[:n] for k, v in columns.items()}
            if n <= 0:
                break
            first_row = summary.rows + 1
            batch = _call(mapping, name, columns, index, first_row, n)
            index += 1
            summary.rows += n
            if batch is None:
                summary.skipped += 1
            else:
                ctx.send_data(batch)
                summary.batches += 1
            summary.bytes = ctx.stats()["bytes"]
            summary.seconds = time.monotonic() - start
            progress.update(summary)
        if limit is not None and summary.rows >= limit:
            break
        if summary.rows == rows_before:
            # Another pass would read nothing again (--repeat 0 would spin for ever).
            log.warning("produce: %s holds no rows: nothing to send%s", path,
                        "" if repeat == 1 else ", so it is not read again")
            break
    summary.bytes = ctx.stats()["bytes"]
    summary.seconds = time.monotonic() - start
    return summary


def _call(mapping: Mapping, name: str, columns: Columns, index: int, first_row: int,
          n: int) -> PersiaBatch | None:
    where = f"batch {index} (rows {first_row}-{first_row + n - 1})"
    try:
        batch = mapping(columns, index)
    except PersiaError as e:
        raise type(e)(f"mapping {name} on {where}: {e.message}", field=e.field or "--mapping",
                      hint=e.hint) from e
    except Exception as e:
        traceback.print_exc()
        raise BadInput(f"mapping {name} raised {e!r} on {where}", field="--mapping") from e
    if batch is not None and not isinstance(batch, PersiaBatch):
        raise BadInput(f"mapping {name} returned a {type(batch).__name__} for {where}",
                       field="--mapping",
                       hint="return a stream_persia.core.data.PersiaBatch, or None to "
                            "skip the chunk")
    return batch


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``produce`` subcommand's flags."""
    p.add_argument("data_file", metavar="DATA_FILE", help="CSV, TSV or npz file (.gz for text)")
    p.add_argument("--mapping", required=True,
                   help="module[:function] or file.py[:function] turning a chunk's columns "
                        "into a PersiaBatch (function default make_batch)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="default: from the file's extension")
    p.add_argument("--batch-size", type=flags.size(1), default=1024,
                   help="rows per chunk (1024)")
    dest = p.add_mutually_exclusive_group()
    dest.add_argument("--kafka", type=flags.addresses, default=None,
                      help="Kafka bootstrap servers (else env KAFKA_BOOTSTRAP_SERVERS, then "
                           "the global config)")
    dest.add_argument("--embedding-workers", type=flags.addresses, default=None,
                      help="broker-less: host:port,... of the embedding workers (else env "
                           "PERSIA_EMBEDDING_WORKERS when no Kafka is configured)")
    p.add_argument("--global-config", **flags.env("PERSIA_GLOBAL_CONFIG", flags.nonempty, None),
                   help="global_config.yml (env PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--embedding-config",
                   **flags.env("PERSIA_EMBEDDING_CONFIG", flags.nonempty, None),
                   help="embedding_config.yml: refuse batches with unknown slots before "
                        "sending (env PERSIA_EMBEDDING_CONFIG)")
    p.add_argument("--topic", type=flags.topic, default=None,
                   help="samples topic (default: global config)")
    p.add_argument("--compression", type=str.lower, choices=COMPRESSION_TYPES, default=None,
                   help="none|gzip|snappy|lz4|zstd (default: global config)")
    p.add_argument("--max-inflight", type=flags.integer(1), default=8,
                   help="batches sent but unacknowledged before waiting (8)")
    p.add_argument("--timeout-ms", type=flags.integer(1), default=600_000,
                   help="how long one batch may wait for room (600000)")
    p.add_argument("--limit", type=flags.size(1), default=None,
                   help="stop after this many rows")
    p.add_argument("--repeat", type=flags.integer(0), default=1,
                   help="passes over the file (1; 0 = until interrupted)")
    p.add_argument("--no-header", action="store_true",
                   help="CSV/TSV without a header row: columns are col0, col1, ...")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--log-level", **flags.env("LOG_LEVEL", flags.log_level, "info"),
                   help="debug, info, warning, error, critical (env LOG_LEVEL; default info)")


def main(args: argparse.Namespace) -> int:
    """Run ``stream-persia produce``; returns the exit status."""
    from stream_persia.config._base import parse_addresses
    from stream_persia.loader.data_ctx import DataCtx

    summary = Summary()
    progress = Progress(enabled=not args.no_progress)
    ctx: DataCtx | None = None
    status = 0
    started = time.monotonic()
    try:
        fmt = detect_format(args.data_file, args.format)
        mapping = load_mapping(args.mapping)
        ctx = DataCtx(kafka_bootstrap_servers=args.kafka,
                      embedding_workers=parse_addresses(args.embedding_workers,
                                                        "--embedding-workers"),
                      global_config=args.global_config, topic=args.topic,
                      compression_type=args.compression, max_inflight=args.max_inflight,
                      timeout_ms=args.timeout_ms,
                      embedding_config=args.embedding_config)
        with ctx:
            produce(args.data_file, mapping, ctx, fmt=fmt, batch_size=args.batch_size,
                    header=not args.no_header, limit=args.limit, repeat=args.repeat,
                    progress=progress, summary=summary)
    except KeyboardInterrupt:
        status = 130
    except PersiaError as e:
        # Bad input (file, flags, mapping) is the user's to fix; the rest is the job's.
        status = 2 if isinstance(e, BadInput) else 1
        progress.close()
        print(f"stream-persia produce: {e}", file=sys.stderr)
    summary.seconds = time.monotonic() - started  # the final flush included
    progress.close()
    if ctx is None:
        return status
    where = (f"Kafka topic {ctx.topic!r}" if ctx.mode == "kafka"
             else f"embedding workers {','.join(ctx.workers)}")
    word = {0: "produced", 130: "interrupted after"}.get(status, "stopped after")
    print(f"stream-persia produce: {word} {summary.line()} to {where}", file=sys.stderr)
    return status
