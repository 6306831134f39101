"""The dense model as embedding server 0 keeps it for serving replicas (issue 18).

NN rank 0 publishes the dense model (:mod:`stream_persia.nn.dense_publisher`) as one
versioned blob: ``torch.save`` of the model's ``state_dict()``, cut into chunks of
:data:`DENSE_CHUNK_BYTES`. Embedding server 0 assembles the chunks and keeps only the
newest complete blob; serving replicas pull it chunk by chunk. Nothing is written to
disk: a restarted server holds none until rank 0's next publication (replicas wait), and
``clear`` (which drops the rows) keeps it.

RPC methods (params → result), served by :class:`DenseHub` on the server's loop:

- ``put_dense {"version", "event_time", "chunk", "chunks", "data", "sha256"}`` →
  ``{"complete": bool}``. ``version``: int >= 0, the training step the model is at;
  ``event_time``: float or None, the event time of the newest sample trained into it;
  ``chunk``: this chunk's index in ``[0, chunks)``; ``chunks``: int >= 1, how many the
  blob has; ``data``: bytes, exactly :data:`DENSE_CHUNK_BYTES` except the last chunk's
  (1 to :data:`DENSE_CHUNK_BYTES`); ``sha256``: 64 lowercase hex digits of the whole
  blob. Chunks of one version assemble in any order (a chunk sent twice replaces
  itself); the metadata of every chunk of a version must agree. A chunk of a newer
  version than the one assembling drops the unfinished one; a chunk of an older one is
  refused. A ``version`` at or below the one held complete is refused (the held version
  only grows). When the last chunk arrives the blob is checked against ``sha256`` (a
  mismatch drops it: BadInput on ``sha256``) and, if no newer one completed meanwhile,
  replaces the held one: ``complete`` is then True. Bounds: ``chunks`` at most what
  ``max_dense_bytes`` allows, so at most ``max_dense_bytes`` are ever assembling and at
  most that much held. Every bad param, unknown keys too, is a BadInput naming it.
- ``get_dense {"since"?: int >= -1 (default -1), "chunk"?: int >= 0 (default 0)}`` →
  ``{"version", "event_time", "chunks", "chunk", "data", "sha256"}``: the held blob's
  metadata and its chunk ``chunk`` as ``data``; ``data`` None (and only the metadata)
  when the held version is not newer than ``since``; ``version`` None (``chunks`` 0)
  when none is held. A replica fetches chunks ``0..chunks-1`` of one version with
  ``since`` below it, checks that every reply names that same ``version`` (a newer
  publication may replace the blob between two calls: then it starts over with the new
  one), joins them and checks ``sha256``. ``chunk`` past the held blob's is a BadInput.

Metrics (:meth:`DenseHub.stats`): ``persia_embedding_server_dense_version`` (-1: none
held), ``..._dense_bytes`` held, ``..._dense_assembling_bytes``, and the counters
``..._dense_published_total`` (blobs completed) and ``..._dense_refused_total`` (puts
refused).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from stream_persia.errors import BadInput

__all__ = ["DEFAULT_MAX_DENSE_BYTES", "DENSE_CHUNK_BYTES", "DenseChunk", "DenseHub",
           "chunk_count"]

log = logging.getLogger(__name__)

#: Bytes of every chunk but the last (well under the RPC frame and body limits).
DENSE_CHUNK_BYTES = 1 << 20
#: ``model_updates.max_dense_bytes``'s default.
DEFAULT_MAX_DENSE_BYTES = 1 << 30

_PUT_KEYS = frozenset({"version", "event_time", "chunk", "chunks", "data", "sha256"})
_GET_KEYS = frozenset({"since", "chunk"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DenseChunk(TypedDict):
    """A ``get_dense`` reply."""

    version: int | None
    event_time: float | None
    chunks: int
    chunk: int
    data: bytes | None
    sha256: str | None


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


def _check_keys(params: Any, allowed: frozenset[str], method: str) -> dict:
    if not isinstance(params, dict):
        raise BadInput(f"{method} takes a map, got {type(params).__name__}", field="params")
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        raise BadInput(f"unknown {method} field(s) {unknown}", field=unknown[0],
                       hint=", ".join(sorted(allowed)))
    return params


class DenseHub:
    """Embedding server 0's newest dense model (module docstring: RPC and bounds).

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
        self.published = 0
        self.refused = 0
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
            held = self.held
            if held is not None and held.version >= blob.version:
                # A newer version completed while this one was being hashed.
                raise BadInput(f"dense version {blob.version} completed after version "
                               f"{held.version}: dropped", field="version")
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
        held = self.held
        if held is not None and version <= held.version:
            raise BadInput(f"dense version {version} is not newer than version "
                           f"{held.version}, which this server holds", field="version",
                           hint="versions are training steps and only grow; a job restored "
                                "to an earlier step publishes again once past it")
        blob = self._assembling
        if blob is not None and version < blob.version:
            raise BadInput(f"dense version {version} is older than version {blob.version} "
                           "being assembled", field="version")
        if blob is None or version > blob.version:
            if blob is not None:
                log.info("dense version %d dropped unfinished (%d of %d chunks) for version "
                         "%d", blob.version, len(blob.parts), blob.chunks, version)
            blob = self._assembling = _Blob(version, event_time, chunks, sha)
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

    # ----------------------------------------------------------------- get_dense
    async def get_dense(self, params: Any) -> DenseChunk:
        """The ``get_dense`` RPC handler."""
        params = _check_keys({} if params is None else params, _GET_KEYS, "get_dense")
        since = _int(params, "since", -1) if "since" in params else -1
        chunk = _int(params, "chunk", 0) if "chunk" in params else 0
        held = self.held
        if held is None:
            return {"version": None, "event_time": None, "chunks": 0, "chunk": chunk,
                    "data": None, "sha256": None}
        data = None
        if held.version > since:
            if chunk >= held.chunks:
                raise BadInput(f"chunk {chunk} is past dense version {held.version}'s "
                               f"{held.chunks} chunks", field="chunk")
            data = held.data[chunk * DENSE_CHUNK_BYTES:(chunk + 1) * DENSE_CHUNK_BYTES]
        return {"version": held.version, "event_time": held.event_time,
                "chunks": held.chunks, "chunk": chunk, "data": data, "sha256": held.sha256}

    # ----------------------------------------------------------------- metrics
    def stats(self) -> dict[str, float]:
        """Gauges ``version`` (-1: none), ``bytes``, ``assembling_bytes``; counters
        ``published`` and ``refused``."""
        held, assembling = self.held, self._assembling
        return {"version": float(held.version if held is not None else -1),
                "bytes": float(len(held.data) if held is not None else 0),
                "assembling_bytes": float(assembling.assembling_bytes
                                          if assembling is not None else 0),
                "published": float(self.published), "refused": float(self.refused)}
