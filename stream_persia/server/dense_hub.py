"""The dense model as embedding server 0 keeps it for serving replicas (issue 18).

NN rank 0 publishes the dense model (:mod:`stream_persia.nn.dense_publisher`) as one
versioned blob: ``torch.save`` of the model's ``state_dict()``, cut into chunks of
:data:`DENSE_CHUNK_BYTES`. Embedding server 0 assembles the chunks and keeps only the
newest complete blob; serving replicas pull it chunk by chunk. Nothing is written to
disk: a restarted server holds none until rank 0's next publication (replicas wait), and
``clear`` (which drops the rows) keeps it.

Lineages. The version is the trainer's step count, which starts again from 0 (or from a
checkpoint's step) when the trainer restarts: versions only order the publications of one
trainer incarnation. So every publication names its **lineage**, an id its publisher drew
when it was created (and again when its trainer restored a checkpoint): versions are
compared only within one lineage. A chunk of a lineage other than the current one (the
lineage of the last chunk accepted) makes it current: the previous lineage is *replaced*
(its unfinished blob is dropped, its puts are refused from then on: a stale trainer still
running cannot publish over its successor) and the blob of the new one, once complete,
replaces the held blob whatever their versions. The :data:`REPLACED_LINEAGES_KEPT` most
recently replaced lineages are remembered (a server restart forgets them, like the
blob). A put without ``lineage`` (a publisher from before lineages) is of the
:data:`LEGACY_LINEAGE`: with only such publishers everything is as it was before
lineages existed (the held version only grows).

RPC methods (params → result), served by :class:`DenseHub` on the server's loop:

- ``put_dense {"version", "event_time", "chunk", "chunks", "data", "sha256",
  "lineage"?}`` → ``{"complete": bool}``. ``version``: int >= 0, the training step the
  model is at; ``event_time``: float or None, the event time of the newest sample trained
  into it; ``chunk``: this chunk's index in ``[0, chunks)``; ``chunks``: int >= 1, how
  many the blob has; ``data``: bytes, exactly :data:`DENSE_CHUNK_BYTES` except the last
  chunk's (1 to :data:`DENSE_CHUNK_BYTES`); ``sha256``: 64 lowercase hex digits of the
  whole blob; ``lineage``: int in ``[0, MAX_LINEAGE]`` (absent or None:
  :data:`LEGACY_LINEAGE`). A replaced ``lineage`` is refused (BadInput on ``lineage``).
  Within one lineage: chunks of one version assemble in any order (a chunk sent twice
  replaces itself); the metadata of every chunk of a version must agree. A chunk of a
  newer version than the one assembling drops the unfinished one; a chunk of an older
  one is refused. A ``version`` at or below the one held complete of the same lineage is
  refused (within a lineage the held version only grows). When the last chunk arrives
  the blob is checked against ``sha256`` (a mismatch drops it: BadInput on ``sha256``)
  and, if its lineage is still the current one (else BadInput on ``lineage``) and no
  newer version of it completed meanwhile, replaces the held one: ``complete`` is then
  True. Bounds: ``chunks`` at most what ``max_dense_bytes`` allows, so at most
  ``max_dense_bytes`` are ever assembling and at most that much held. Every bad param,
  unknown keys too, is a BadInput naming it.
- ``get_dense {"since"?: int >= -1 (default -1), "chunk"?: int >= 0 (default 0),
  "lineage"?: int in [0, MAX_LINEAGE] or None}`` → ``{"version", "event_time", "chunks",
  "chunk", "data", "sha256", "lineage"}``: the held blob's metadata and its chunk
  ``chunk`` as ``data``; ``data`` None (and only the metadata) when the held version is
  not newer than ``since`` and the held lineage is ``lineage`` (``lineage`` absent or
  None: versions alone are compared, as before lineages); ``version`` and ``lineage``
  None (``chunks`` 0) when none is held. A replica passes the version and lineage it
  serves: it gets the held blob when that is newer *or of another lineage* (a restarted
  trainer's, at a lower step). It fetches chunks ``0..chunks-1`` of one blob, checks that
  every reply names that same ``version`` and ``lineage`` (a newer publication may
  replace the blob between two calls: then it starts over with the new one), joins them
  and checks ``sha256``. ``chunk`` past the held blob's is a BadInput.

Metrics (:meth:`DenseHub.stats`): ``persia_embedding_server_dense_version`` (-1: none
held), ``..._dense_bytes`` held, ``..._dense_assembling_bytes``, and the counters
``..._dense_published_total`` (blobs completed), ``..._dense_refused_total`` (puts
refused, for any reason), ``..._dense_lineage_changes_total`` (held blobs that replaced
one of another lineage) and ``..._dense_lineage_refused_total`` (puts refused because
their lineage was replaced: a stale trainer publishing).

The hub is pure logic on the server's event loop (no lock: one thread) except the
sha256 of a completed blob, which runs on a worker thread (hashlib releases the GIL) so
that a 1 GiB blob does not stop the server's lookups.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from stream_persia.errors import BadInput, refused_as_unknown

__all__ = ["DEFAULT_MAX_DENSE_BYTES", "DENSE_CHUNK_BYTES", "LEGACY_LINEAGE", "MAX_LINEAGE",
           "REPLACED_LINEAGES_KEPT", "DenseChunk", "DenseHub", "LineageCalls", "check_lineage", "chunk_count",
           "lineage_or_legacy"]

log = logging.getLogger(__name__)

#: Bytes of every chunk but the last (well under the RPC frame and body limits).
DENSE_CHUNK_BYTES = 1 << 20
#: ``model_updates.max_dense_bytes``'s default.
DEFAULT_MAX_DENSE_BYTES = 1 << 30

#: The lineage of a publication that names none (a publisher from before lineages).
LEGACY_LINEAGE = 0
#: The largest lineage (an int64, for every reader); publishers draw theirs in
#: ``[1, MAX_LINEAGE]``.
MAX_LINEAGE = (1 << 63) - 1
#: Replaced lineages remembered (their puts refused); the oldest is forgotten first.
REPLACED_LINEAGES_KEPT = 1024

_PUT_KEYS = frozenset({"version", "event_time", "chunk", "chunks", "data", "sha256",
                       "lineage"})
_GET_KEYS = frozenset({"since", "chunk", "lineage"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DenseChunk(TypedDict):
    """A ``get_dense`` reply."""

    version: int | None
    event_time: float | None
    chunks: int
    chunk: int
    data: bytes | None
    sha256: str | None
    lineage: int | None


def chunk_count(size: int) -> int:
    """How many chunks a blob of ``size`` bytes (> 0) is cut into."""
    return max(1, math.ceil(size / DENSE_CHUNK_BYTES))


@dataclass
class _Blob:
    """One version's blob: complete (``data``) or assembling (``parts``)."""

    version: int
    event_time: float | None
    chunks: int
    sha256: str
    lineage: int = LEGACY_LINEAGE
    parts: dict[int, bytes] = field(default_factory=dict)
    data: bytes = b""

    @property
    def assembling_bytes(self) -> int:
        return sum(map(len, self.parts.values()))


def _int(params: dict, key: str, lo: int, hi: int | None = None) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise BadInput(f"{key} must be {want}, got {str(value)[:40]!r}", field=key)
    return value


def check_lineage(value: Any, key: str = "lineage") -> int:
    """A lineage as it must be: an int in ``[0, MAX_LINEAGE]`` (BadInput naming ``key``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
            0 <= value <= MAX_LINEAGE):
        raise BadInput(f"{key} must be an int in [0, 2**63 - 1], got {str(value)[:40]!r}",
                       field=key, hint="the id the publisher drew; leave it out for the "
                                       "legacy lineage")
    return value


def lineage_or_legacy(value: Any, key: str = "lineage") -> int:
    """A ``lineage`` field as received: None (absent: from before lineages) is the
    :data:`LEGACY_LINEAGE`, else :func:`check_lineage`."""
    return LEGACY_LINEAGE if value is None else check_lineage(value, key)


class LineageCalls:
    """A peer's calls of server 0's dense methods with ``lineage``: once a server 0 from
    before lineages refused the field (a rolling upgrade that reached the caller first),
    the calls go on without it, as the legacy lineage, logged once (``who`` names the
    caller)."""

    def __init__(self, who: str):
        self.who = who
        self.legacy = False

    async def call(self, call: Callable[[dict], Awaitable[Any]], params: dict,
                   lineage: int) -> Any:
        if not self.legacy:
            try:
                return await call({**params, "lineage": lineage})
            except BadInput as e:
                if not refused_as_unknown(e, "lineage"):
                    raise
                self.legacy = True
                log.warning("%s: embedding server 0 does not know dense lineages (an older "
                            "version): going on without them until it is upgraded", self.who)
        return await call(params)


def _check_keys(params: Any, allowed: frozenset[str], method: str) -> dict:
    if not isinstance(params, dict):
        raise BadInput(f"{method} takes a map, got {type(params).__name__}", field="params")
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        raise BadInput(f"unknown {method} field(s) {unknown}", field=unknown[0],
                       hint=", ".join(sorted(allowed)))
    return params


class DenseHub:
    """Embedding server 0's newest dense model (module docstring: RPC, lineages, bounds).

    Args:
        max_dense_bytes: the largest blob accepted (``model_updates.max_dense_bytes``).
    """

    def __init__(self, max_dense_bytes: int = DEFAULT_MAX_DENSE_BYTES):
        if isinstance(max_dense_bytes, bool) or not isinstance(max_dense_bytes, int) \
                or max_dense_bytes < 1:
            raise BadInput(f"max_dense_bytes must be a positive int, got {max_dense_bytes!r}",
                           field="max_dense_bytes")
        self.max_dense_bytes = max_dense_bytes
        self.max_chunks = chunk_count(max_dense_bytes)
        self.held: _Blob | None = None
        self._assembling: _Blob | None = None
        #: the current lineage: of the last chunk accepted (None: none yet)
        self.lineage: int | None = None
        self._replaced: OrderedDict[int, None] = OrderedDict()
        self.published = 0
        self.refused = 0
        self.lineage_changes = 0
        self.lineage_refused = 0
        #: Called with each newly held blob (the server relays it to Kafka, if any).
        self.on_complete: Callable[[_Blob], None] | None = None

    # ----------------------------------------------------------------- put_dense
    async def put_dense(self, params: Any) -> dict[str, bool]:
        """The ``put_dense`` RPC handler."""
        try:
            blob = self._put(params)
            if blob is None:
                return {"complete": False}
            data = b"".join(blob.parts[i] for i in range(blob.chunks))
            blob.parts = {}
            digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
            if digest != blob.sha256:
                raise BadInput(f"dense version {blob.version}: the {len(data)} bytes "
                               f"assembled have sha256 {digest}, not {blob.sha256}; dropped",
                               field="sha256", hint="publish the version again")
            if blob.lineage != self.lineage:
                # Another publisher took over while this blob was being hashed.
                self.lineage_refused += 1
                raise BadInput(f"dense lineage {blob.lineage} was replaced by lineage "
                               f"{self.lineage} while its version {blob.version} was "
                               "checked: dropped", field="lineage")
            held = self.held
            if held is not None and held.lineage == blob.lineage \
                    and held.version >= blob.version:
                # A newer version completed while this one was being hashed.
                raise BadInput(f"dense version {blob.version} completed after version "
                               f"{held.version}: dropped", field="version")
            if held is not None and held.lineage != blob.lineage:
                self.lineage_changes += 1
                log.warning("dense model: lineage %d (version %d) replaces lineage %d "
                            "(version %d): a restarted trainer publishes", blob.lineage,
                            blob.version, held.lineage, held.version)
            blob.data = data
            self.held = blob
            self.published += 1
            if self.on_complete is not None:
                self.on_complete(blob)
            return {"complete": True}
        except BadInput:
            self.refused += 1
            raise

    def _put(self, params: Any) -> _Blob | None:
        """Validate one chunk and file it; the blob when it was the last one missing
        (taken out of assembly), else None."""
        params = _check_keys(params, _PUT_KEYS, "put_dense")
        version = _int(params, "version", 0)
        lineage = lineage_or_legacy(params.get("lineage"))
        chunks = _int(params, "chunks", 1)
        if chunks > self.max_chunks:
            raise BadInput(f"chunks={chunks} would exceed max_dense_bytes="
                           f"{self.max_dense_bytes} ({self.max_chunks} chunks of "
                           f"{DENSE_CHUNK_BYTES} bytes at most)", field="chunks",
                           hint="raise model_updates.max_dense_bytes, or publish a smaller "
                                "model")
        chunk = _int(params, "chunk", 0, chunks - 1)
        event_time = params.get("event_time")
        if event_time is not None and (isinstance(event_time, bool) or not isinstance(
                event_time, (int, float)) or not math.isfinite(event_time)):
            raise BadInput(f"event_time must be a finite number (seconds) or None, got "
                           f"{str(event_time)[:40]!r}", field="event_time")
        event_time = None if event_time is None else float(event_time)
        sha = params.get("sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise BadInput(f"sha256 must be the 64 lowercase hex digits of the whole blob, "
                           f"got {str(sha)[:80]!r}", field="sha256")
        data = params.get("data")
        if not isinstance(data, bytes):
            raise BadInput(f"data must be bytes, got {type(data).__name__}", field="data")
        last = chunk == chunks - 1
        if (len(data) != DENSE_CHUNK_BYTES) if not last else not (
                0 < len(data) <= DENSE_CHUNK_BYTES):
            want = (f"1 to {DENSE_CHUNK_BYTES}" if last else f"exactly {DENSE_CHUNK_BYTES}")
            raise BadInput(f"chunk {chunk} of {chunks} has {len(data)} bytes, not {want}",
                           field="data", hint="cut the blob into chunks of DENSE_CHUNK_BYTES")
        if last and (chunks - 1) * DENSE_CHUNK_BYTES + len(data) > self.max_dense_bytes:
            raise BadInput(f"dense version {version} has "
                           f"{(chunks - 1) * DENSE_CHUNK_BYTES + len(data)} bytes, over "
                           f"max_dense_bytes={self.max_dense_bytes}", field="data",
                           hint="raise model_updates.max_dense_bytes")
        if lineage in self._replaced:
            self.lineage_refused += 1
            raise BadInput(f"dense lineage {lineage} was replaced by lineage {self.lineage} "
                           f"(another publisher: a restarted trainer); version {version} "
                           "refused", field="lineage",
                           hint="a trainer that was replaced is still running: stop it")
        if lineage != self.lineage:
            self._take_over(lineage)
        held = self.held
        if held is not None and held.lineage == lineage and version <= held.version:
            raise BadInput(f"dense version {version} is not newer than version "
                           f"{held.version}, which this server holds", field="version",
                           hint="versions are training steps and only grow within one "
                                "publisher's lineage")
        blob = self._assembling
        if blob is not None and version < blob.version:
            raise BadInput(f"dense version {version} is older than version {blob.version} "
                           "being assembled", field="version")
        if blob is None or version > blob.version:
            if blob is not None:
                log.info("dense version %d dropped unfinished (%d of %d chunks) for version "
                         "%d", blob.version, len(blob.parts), blob.chunks, version)
            blob = self._assembling = _Blob(version, event_time, chunks, sha, lineage)
        else:
            agree: tuple[tuple[str, object, object], ...] = (
                ("chunks", chunks, blob.chunks), ("sha256", sha, blob.sha256),
                ("event_time", event_time, blob.event_time))
            for key, got, held_as in agree:
                if got != held_as:
                    raise BadInput(f"dense version {version}: chunk {chunk} says {key}="
                                   f"{got!r} but its earlier chunks said {held_as!r}", field=key)
        blob.parts[chunk] = data
        if len(blob.parts) < blob.chunks:
            return None
        self._assembling = None
        return blob

    def _take_over(self, lineage: int) -> None:
        """``lineage`` (never replaced) becomes the current one: the current one, if any,
        is replaced, and its unfinished blob dropped."""
        old, blob = self.lineage, self._assembling
        if blob is not None:
            log.info("dense version %d of lineage %d dropped unfinished (%d of %d chunks) "
                     "for lineage %d", blob.version, blob.lineage, len(blob.parts),
                     blob.chunks, lineage)
            self._assembling = None
        if old is not None:
            self._replaced[old] = None
            while len(self._replaced) > REPLACED_LINEAGES_KEPT:
                self._replaced.popitem(last=False)
            log.info("dense model: lineage %d replaces lineage %d (its puts are refused "
                     "from now on)", lineage, old)
        self.lineage = lineage

    # ----------------------------------------------------------------- get_dense
    async def get_dense(self, params: Any) -> DenseChunk:
        """The ``get_dense`` RPC handler."""
        params = _check_keys({} if params is None else params, _GET_KEYS, "get_dense")
        since = _int(params, "since", -1) if "since" in params else -1
        chunk = _int(params, "chunk", 0) if "chunk" in params else 0
        lineage = params.get("lineage")
        lineage = None if lineage is None else check_lineage(lineage)
        held = self.held
        if held is None:
            return {"version": None, "event_time": None, "chunks": 0, "chunk": chunk,
                    "data": None, "sha256": None, "lineage": None}
        data = None
        if held.version > since or (lineage is not None and held.lineage != lineage):
            if chunk >= held.chunks:
                raise BadInput(f"chunk {chunk} is past dense version {held.version}'s "
                               f"{held.chunks} chunks", field="chunk")
            data = held.data[chunk * DENSE_CHUNK_BYTES:(chunk + 1) * DENSE_CHUNK_BYTES]
        return {"version": held.version, "event_time": held.event_time,
                "chunks": held.chunks, "chunk": chunk, "data": data, "sha256": held.sha256,
                "lineage": held.lineage}

    # ----------------------------------------------------------------- metrics
    def stats(self) -> dict[str, float]:
        """Gauges ``version`` (-1: none), ``bytes``, ``assembling_bytes``; counters
        ``published``, ``refused``, ``lineage_changes`` and ``lineage_refused``."""
        held, assembling = self.held, self._assembling
        return {"version": float(held.version if held is not None else -1),
                "bytes": float(len(held.data) if held is not None else 0),
                "assembling_bytes": float(assembling.assembling_bytes
                                          if assembling is not None else 0),
                "published": float(self.published), "refused": float(self.refused),
                "lineage_changes": float(self.lineage_changes),
                "lineage_refused": float(self.lineage_refused)}
