"""The RPC replies the roles exchange, as TypedDicts: one place that names their fields.

Each is what a handler returns (msgpack-encoded as is, :mod:`stream_persia.core.wire`) and
what its callers read; the module that answers documents the method
(:mod:`stream_persia.server.service`, :mod:`stream_persia.worker.service`). TypedDicts
check nothing at run time: a reader of a reply from another process still validates what
it relies on (as :func:`stream_persia.core.watermarks.merge` does).

Embedding server: ``health`` (:class:`ServerHealth`), ``get_config``
(:class:`ServerConfig`, or None), ``lookup`` (:class:`LookupReply`), ``update``
(:class:`UpdateReply`), ``watermarks`` (:class:`WatermarksReply`), ``dump``
(:class:`DumpReply`), ``load`` and ``commit_load`` (:class:`LoadReply`).
Embedding worker: ``health`` (:class:`WorkerHealth`), ``status`` (:class:`WorkerStatus`),
``frontier`` (:class:`FrontierReply`), ``push_gradients`` (:class:`PushReply`). A served
batch (``next_batch``, ``lookup_batch``) is :class:`stream_persia.core.served.ServedBatch`.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

import numpy as np

__all__ = ["DumpReply", "FailedPush", "FrontierReply", "LoadReply", "LookupReply",
           "LostServerInfo", "MarkWire", "PushReply", "ServerConfig", "ServerHealth",
           "ShardFileInfo", "UpdatePosition", "UpdateReply", "WatermarksReply", "WorkerHealth", "WorkerStatus"]


# ------------------------------------------------------------------ embedding server
class ServerHealth(TypedDict):
    """An embedding server's ``health``: who answers (``incarnation``: a random id per
    process), what its table holds (``loads``: restores swapped in since it started) and
    the newest event time of an update it applied (``trained_through``)."""

    ok: bool
    role: str
    replica_index: int
    replica_size: int
    rows: int
    implementation: str
    store_threads: int
    incarnation: str
    loads: int
    trained_through: float | None   # newest event time of an update applied (seconds)


class ServerConfig(TypedDict):
    """``get_config``: the store's whole configuration and its digest (also a valid
    ``configure`` request)."""

    digest: str
    optimizer: dict[str, Any] | None
    embedding_config: dict[str, Any] | None
    policies: NotRequired[dict[str, Any]]   # only while some feature group has a policy


class _ServedByServer(TypedDict):
    config: str | None     # the configuration digest (None: never configured)
    incarnation: str
    held: int              # rows held after the request
    loads: NotRequired[int]   # the loads that replaced its table so far (its table's age)


class LookupReply(_ServedByServer):
    """``lookup``: one float32 array per group (rows or pooled sums) and, for eval and
    infer lookups, the ids no row was found for."""

    rows: list[np.ndarray]
    missing: int


class UpdateReply(_ServedByServer):
    """``update``: gradient rows applied and dropped (``duplicate``: a repeated token,
    answered with the first reply and not applied again)."""

    applied: int
    dropped: int
    duplicate: NotRequired[bool]


class MarkWire(TypedDict):
    """One partition's stream watermark (``writer`` None: set by a load, with the
    checkpoint's fingerprint of the record at ``offset`` when the load had one)."""

    offset: int
    writer: str | None
    fingerprint: NotRequired[dict[str, Any]]


class WatermarksReply(TypedDict):
    """``watermarks``: topic -> partition (str) -> its watermark."""

    topics: dict[str, dict[str, MarkWire]]


class ShardFileInfo(TypedDict):
    """A shard file written: its name, rows, size and hex sha256."""

    file: str
    rows: int
    bytes: int
    sha256: str


class UpdatePosition(TypedDict):
    """Where a serving replica restored from a dump starts following the server's update
    log (:mod:`stream_persia.server.updates`): the server process, a log sequence and,
    when the log goes to Kafka too, an offset at or before it in the server's partition."""

    incarnation: str
    seq: int
    offset: NotRequired[int]


class DumpReply(ShardFileInfo):
    """``dump``: the shard file, the configuration its rows were written with, the
    stream watermarks at the dump (topic -> partition (str) -> watermark) and the update
    log's position at the dump (None: the server publishes no updates)."""

    config: ServerConfig
    watermarks: dict[str, dict[str, MarkWire]]
    updates: UpdatePosition | None
    #: the store's position at the dump (a later dump's ``since``;
    #: :mod:`stream_persia.server.patches`), and, for a dump given ``since``, the patch's
    #: tombstone file (None: the full shard was written, ``full_because`` says why)
    tracking: NotRequired[dict[str, Any]]
    held: NotRequired[int]   # rows the store held at the dump
    tombstones: NotRequired[ShardFileInfo | None]
    full_because: NotRequired[str | None]




class LoadReply(TypedDict):
    """``load`` and ``commit_load``: the rows now held (``token``: a staged load's, for
    ``commit_load``/``abort_load``)."""

    rows: int
    token: NotRequired[str]


# ------------------------------------------------------------------ embedding worker
class FailedPush(TypedDict):
    """A batch whose push could not complete (``frontier``/``status``'s ``failed``)."""

    batch_id: int
    partition: int | None
    offset: int | None
    servers: list[str]      # the servers that have not applied it
    applied_on: list[str]   # those that have
    error: str


class LostServerInfo(TypedDict):
    """An embedding server found restarted (``frontier``'s ``lost``)."""

    server: int
    address: str
    error: str


class WorkerHealth(TypedDict):
    ok: bool
    role: str
    replica_index: int
    replica_size: int
    ready: int
    inflight: int
    error: str | None


class WorkerStatus(TypedDict):
    """An embedding worker's ``status`` (``frontier``: partition (str) -> offset)."""

    replica_index: int
    ready: int
    ready_capacity: int
    ready_bytes: int
    ready_capacity_bytes: int | None   # None: not bounded in bytes
    inflight: int
    pending: int
    frontier: dict[str, int]
    ingest_paused: bool
    failed: list[FailedPush]
    kafka: NotRequired[dict[str, Any]]   # with a Kafka stream: its consumer's status
    #: stage -> event time (stream_persia.core.stages)
    watermarks: dict[str, float | None]
    #: with a Kafka stream: per partition {"topic", "partition", "messages", "seconds"}
    kafka_lag: NotRequired[list[Any]]


class FrontierReply(TypedDict):
    """An embedding worker's ``frontier``, what a checkpoint cut reads: per partition
    (str) the first offset a restore must consume, and what refuses a cut now (batches
    in flight or pending, failed pushes, servers lost)."""

    stream: Literal["kafka", "direct"]
    offsets: dict[str, int]
    inflight: int
    pending: int
    failed: list[FailedPush]
    lost: list[LostServerInfo]
    #: Partitions of the samples topic as the worker's consumer knows them (Kafka only):
    #: a cut refuses partitions no worker reads.
    topic_partitions: NotRequired[int]


class PushReply(TypedDict):
    """``push_gradients``: rows applied and dropped over every server, and the slots
    skipped for non-finite gradients (``duplicate``: a repeated push, answered with the
    first reply)."""

    applied: int
    dropped: int
    skipped_slots: list[str]
    duplicate: NotRequired[bool]
