"""Embedding server role: one shard of every embedding table (PERSIA's embedding PS).

Ids are routed to shards by ``sharding.shard_of(id, replica_size)``; this process holds the
ids whose shard is its ``replica_index`` in an :class:`EmbeddingStore` and applies the
embedding optimizer in place. It is a thin asyncio layer around the store: every store
call runs on one dedicated thread (the Cython store releases the GIL), which both keeps
the event loop free to read frames and serialises access to the store. With
``store_threads`` > 1 the store is a :class:`~stream_persia.server.sharded.ShardedStore`,
which that thread fans out over its internal shards' threads for each call.

RPC methods (params → result):

- ``health`` → ``{"ok", "role", "replica_index", "replica_size", "rows", "implementation",
  "store_threads", "incarnation", "loads", "trained_through"}``
- ``lookup {"mode": "train"|"eval"|"infer", "groups": [{"dim", "ids"}], "incarnation"?}`` →
  ``{"rows": [float32 (n, dim)], "missing": int}`` (one entry per group, in order;
  ``missing`` counts ids absent from the store; eval/infer never insert or refresh). A
  group with ``"index"`` (int32) and ``"offsets"`` (int64) is a pooled lookup
  (:mod:`stream_persia.kernels.segments`): its entry is the ``(len(offsets) - 1, dim)`` segment
  sums of the rows instead of the rows.
- ``update {"groups": [{"dim", "ids", "grads"}], "token"?, "incarnation"?, "loads"?,
  "source"?, "event_time"?}`` →
  ``{"applied": int, "dropped": int}``. ``loads``: the table the update was computed
  from (a lookup reply's ``loads``); a load (a restore) replaced it since: refused
  (``ServerRestarted``, field ``loads``), since the gradients belong to rows no longer
  served. ``token`` (a string of 1-64 characters, unique to one batch's update on this
  server: the embedding workers send ``<worker incarnation>-<batch id>``) makes the update
  idempotent: the server remembers the tokens of the last ``update_tokens`` updates
  (default :data:`UPDATE_TOKENS`; a bounded FIFO checked and filled on the store thread,
  so a retry that overtakes or follows the first request alike sees it) and answers a
  token it holds with the first reply plus ``"duplicate": true``, applying nothing. A
  worker retries a push for at most ``push_retry_ms`` (see
  :mod:`stream_persia.worker.service`); a token forgotten sooner than
  :data:`UPDATE_TOKEN_MIN_AGE_S` after it was applied means a retry might no longer be
  recognised: that is logged and counted (``persia_embedding_server_update_tokens_
  evicted_young_total``; raise ``update_tokens``). Duplicates are counted in
  ``persia_embedding_server_update_tokens_duplicates_total``. A restarted server
  remembers nothing (nor holds the rows the first update changed).
  ``source`` (``{"topic", "partition", "offset", "writer"}``: the Kafka batch the update
  is for, and the worker stream that sends it) advances that partition's *stream
  watermark*, the highest offset applied; an update at or below a watermark another
  stream set is refused with :class:`~stream_persia.errors.StreamReplay` (field
  ``offset``), nothing applied: it would train that batch a second time
  (:mod:`stream_persia.core.watermarks`; counted in
  ``persia_embedding_server_stream_replays_refused_total``; the gauge
  ``persia_embedding_server_stream_partitions`` counts the partitions tracked). The
  token is checked first: a retried push is a duplicate, not a replay. An update naming
  the ``loads`` of a table replaced since is counted in
  ``persia_embedding_server_stream_stale_updates_refused_total``.
  ``event_time`` (seconds since the Unix epoch, finite, >= 0; BadInput on field
  ``event_time`` otherwise, nothing applied) is the event time of the batch the update is
  for (``PersiaBatch.event_time``). ``trained_through``, the newest event time of any
  update applied (None until one carries it; a duplicate or refused update changes
  nothing), is in ``health`` and the gauge
  ``persia_embedding_server_trained_through_seconds`` (absent while None), and is the
  ``applied`` stage watermark (``persia_stage_event_time_seconds{stage="applied"}`` and
  its ``persia_stage_lag_seconds``: :mod:`stream_persia.core.stages`). ``clear``
  resets it; a load sets it to the load's ``trained_through`` (the checkpoint's; None when
  not given): the restored rows are trained through that, not through what the replaced
  ones were (the stream is rewound with them).
- ``watermarks {"topic"?}`` → ``{"topics": {topic: {partition: {"offset", "writer"}}}}``:
  every partition's watermark (of ``topic`` only, when given; ``writer`` None: set by a
  load), read on the store thread after the updates received before it. Workers ask it
  before they serve a partition.
- **Incarnation.** Each server process draws a random ``incarnation`` (16 hex digits) when
  it starts; a process restarted at the same address (kill -9, OOM, a lost node, a
  StatefulSet bringing the pod back) has another one and none of the rows the previous
  one held. Lookup and update replies carry ``"incarnation"`` and ``"held"`` (the rows
  held after the request), lookup replies ``"loads"`` too, ``health`` the incarnation,
  ``rows`` and ``loads``. A lookup or update whose params
  name the ``incarnation`` the caller last saw is refused, before anything is looked up,
  admitted or applied, with :class:`~stream_persia.errors.ServerRestarted` (field
  ``incarnation``) when this process is another one: a retried update meets an empty
  table and must fail its batch, not be "applied once" there. A load (a restore) keeps
  the incarnation and counts in ``loads``: it is the legitimate way to replace the table,
  and ``loads`` > 0 tells a router that a restarted server was restored since
  (:mod:`stream_persia.worker.router`).
- ``slot_stats`` → ``{slot: {"rows", "admitted", ...}}``: the per-slot counts of the table
  policies (:mod:`stream_persia.server.slot_policies`), read on the store thread (as the
  ``metrics`` RPC reads them before it renders; the metrics port shows them as of the last
  expiry pass).
- ``size`` → int, ``clear`` → None (drops the rows and the stream watermarks: a job that
  trains the stream again on purpose clears the servers first)
- ``stats`` → ``{"rows", "capacity", "lookups", "misses", "admissions", "evictions",
  "updates", "dropped_updates", "removals", "nonfinite_updates", "loads"}``: the store's
  levels (``rows``, ``capacity``) and
  this server's counters (:data:`COUNTERS`, continuous across loads; ``loads`` counts the
  loads swapped in); the metrics export the counters as the Prometheus counters
  ``persia_embedding_server_store_<key>_total`` and the levels as the gauges
  ``persia_embedding_server_store_<key>``
  The gauge ``persia_embedding_server_restore_staged_rows`` shows the rows of a staged
  load waiting for its commit (a second table in memory; 0 when none).
- ``configure {"optimizer": dict | None, "embedding_config": dict | None, "policies"?:
  dict | None, "digest"?}`` → None; then ``get_config`` → ``{"digest", "optimizer",
  "embedding_config", "policies"?}`` (the store's whole configuration and a digest of it),
  or None while this process was never configured. A ``get_config`` reply is a valid
  ``configure``: with ``digest``, optimizer and embedding_config must be given and hash to
  it with the policies when given (BadInput on field ``digest`` otherwise, nothing changed).
  ``policies`` is the table policy of every feature group (admission, TTL, row caps, row
  dtype; its schema in :mod:`stream_persia.server.slot_policies`), applied with the store's
  ``set_policies``; a part left out (or None) is kept as it is. ``get_config`` has
  ``policies`` only while some group's policy is not the default, and only then do they
  count in the digest (a job without policies has the digest it had before they existed).
  The server's constructor takes the same ``policies`` (the launcher passes the
  ``embedding_config.yml`` ones), so a restarted server holds them before anyone
  configures it; workers and NN ranks that configure a restarted server from what they
  learned send them back too. A configure applies to a staged load too (below), so a
  restore committed after it serves what it set. While some policy has a TTL, an expiry pass runs on the
  store thread every :data:`~stream_persia.server.slot_policies.EXPIRE_INTERVAL_S` (at most
  :data:`~stream_persia.server.slot_policies.EXPIRE_ROWS` rows a pass, and a pass that
  reached it is followed by the next at once; the metrics
  ``persia_embedding_server_slot_*`` of that module come from the same pass).
  Lookup and update replies carry ``"config"``: that digest, or None. A lookup or update
  whose params carry ``"config"`` (the digest the caller expects) is refused with a
  Misuse on field ``config`` by a server never configured: a server restarted mid-job
  would otherwise apply the default optimizer and initialisation. The embedding workers
  (:class:`stream_persia.worker.router.ShardRouter`) learn the digest from the replies;
  a server restarted mid-job is failed by its incarnation first (above), and configured
  from what they learned only where the job opted to go on
  (``embedding_worker_config.on_server_restart: continue``).
- ``dump {"dir": url}`` → ``{"file", "rows", "bytes", "sha256", "config", "watermarks"}`` —
  the shard as one file; ``config`` is the store's configuration as ``get_config``
  describes it (also when this process was never configured), which the checkpoint
  manifest records; ``watermarks`` the stream watermarks at the dump (as ``watermarks``
  answers them: a checkpoint refuses offsets at or below them); ``tracking`` the store's
  position (``{"incarnation", "loads", "version"}``). With ``"since"``: a tracking a
  previous dump answered, the shard's *patch* since then (rows changed with their
  optimizer state, and a ``tombstones`` file of the ids evicted) when the store can tell
  what changed, else the full shard with ``full_because`` saying why
  (:mod:`stream_persia.server.patches`).
  ``dump`` and ``load`` take only directories under the server's checkpoint root
  (:mod:`stream_persia.checkpoint.root`; BadInput on field ``dir`` otherwise, Misuse when
  the server has no root), and their errors never quote a file's contents.
- ``load {"dir": url, "files": [...], "expected"?: {file: {"sha256"?, "bytes"?, "rows"?}},
  "cut"?: {topic: {partition: offset}}, "cut_fingerprints"?: {topic: {partition:
  fingerprint}}, "patches"?: [{"dir", "files", "tombstones", "expected"}],
  "trained_through"?: seconds}`` (``patches``: applied in order over the files, an incremental
  checkpoint's chain; the reply's ``rows`` is then the rows held after the last)
  → ``{"rows": int}`` — replaces the shard's rows with the rows it owns in every listed
  shard file, so a checkpoint written by S servers loads into S' servers; all or nothing.
  ``expected``, when given, has an entry for every listed file (the manifest's ``files``
  entry: hex sha256, size in bytes, rows in the file) and nothing else. ``cut``, a
  manifest's ``offsets`` (topic → partition → next offset), becomes the stream watermarks
  with the rows (each offset - 1, as restored); without it the server holds none after
  the load (the checkpoint records no stream position). ``cut_fingerprints``, the
  manifest's ``fingerprints``, go with those marks (a worker resuming at them checks the
  topic is still the one cut: :mod:`stream_persia.core.watermarks`). ``trained_through``: the event
  time the checkpoint is trained through (its manifest's ``extra``), the server's
  ``trained_through`` once the rows are in (above). With
  ``"stage": true`` the checked table is kept aside instead of swapped in, and the reply
  carries a ``"token"`` for the second phase:
- ``commit_load {"token"}`` → ``{"rows": int}`` swaps the staged table in (it cannot fail
  for want of memory: the table is already built); ``abort_load {"token"}`` → ``{"aborted":
  bool}`` drops it. A server holds at most one staged table: a newer stage replaces it, and
  it is dropped if not committed within ``stage_ttl_s``. A restore across servers
  (:func:`stream_persia.checkpoint.load_embeddings`) stages on every server and commits only
  once all of them staged, so one server failing alone (out of memory, a crash) leaves
  every server with what it held; a server that loses its staged table after that (it
  restarted, the table expired) is loaded again directly. ``stage_ttl_s`` is
  ``embedding_parameter_server_config.restore_stage_ttl_s`` for a launched server.

- ``put_dense`` / ``get_dense``: the newest dense model, published by NN rank 0 for
  serving replicas (kept by every server, sent to server 0 only; schema, lineages and
  bounds in :mod:`stream_persia.server.dense_hub`). ``clear`` and ``load`` keep it;
  nothing of it is checkpointed (a restarted server holds none, and remembers no
  replaced lineage).

The shard file format and the all-or-nothing load procedure (its checks, errors and
memory peak) are described in :mod:`stream_persia.server.shard_files`.

A successful load swaps in a new store, whose own counters and admission draws start
from zero; the counters the server reports (``stats``, the metrics) go on from where they
were, so they never drop: the old store's counts are carried over. They describe the
serving traffic (lookups and updates), so what the load itself counts (the evictions of a
checkpoint larger than the capacity) is left out; ``loads`` says that the rows changed.
``rows`` is a level and is the loaded table's. A failed load changes no counter, nor does a
staged one until it is committed.
Every handler must reach the store as ``self.store`` on the store thread, never through a
reference taken before its turn on that thread: a load queued ahead of it swaps the store.

Size: one module past 500 lines on purpose. The RPC schema above (STYLE.md habit 8) is
about 125 of its lines; the rest is one class whose handlers all reach the store through
its one store thread (above). The file format and the sharded store already live beside
it (``shard_files``, ``sharded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from stream_persia.checkpoint.root import CheckpointRoot, require_root
from stream_persia.core import optim as optim_mod
from stream_persia.core.data import check_event_time
from stream_persia.core.embedding_config import EmbeddingConfig
from stream_persia.core.metrics import RoleMetrics
from stream_persia.core.replies import (
    DumpReply,
    LoadReply,
    LookupReply,
    ServerConfig,
    ServerHealth,
    UpdateReply,
    WatermarksReply,
)
from stream_persia.core.stages import StageCollector
from stream_persia.core.watermarks import (
    Watermarks,
    check_topic,
    parse_cut,
    parse_cut_fingerprints,
    parse_source,
)
from stream_persia.errors import (
    BadInput,
    Misuse,
    ServerRestarted,
    StreamReplay,
    config_digest_param,
    require,
    require_hex16,
)
from stream_persia.kernels import segments
from stream_persia.rpc import RpcServer, auth
from stream_persia.rpc.server import CONNECTION_COUNTERS, ConnectionLimits
from stream_persia.server import patches
from stream_persia.server.dense_hub import DEFAULT_MAX_DENSE_BYTES, DenseHub
from stream_persia.server.shard_files import (
    check_load_request,
    shard_file_name,
    stage_shard_files,
    write_shard_file,
)
from stream_persia.server.sharded import make_store
from stream_persia.server.slot_policies import (
    EXPIRE_INTERVAL_S,
    EXPIRE_ROWS,
    SlotPolicies,
    SlotStats,
    apply_policies,
    parse_policies,
    policies_digest_part,
)
from stream_persia.server.store import IMPLEMENTATION
from stream_persia.server.updates import DenseRelay, UpdateFeed

log = logging.getLogger(__name__)

MODES = ("train", "eval", "infer")
#: The store statistics that only grow; the others (``rows``, ``capacity``) are levels.
COUNTERS = ("lookups", "misses", "admissions", "evictions", "updates", "dropped_updates",
            "removals", "nonfinite_updates")
#: Update tokens a server remembers by default (see ``update`` in the module docstring):
#: about 200 bytes each. It must exceed the updates one server takes while a worker may
#: still retry one (``push_retry_ms``).
UPDATE_TOKENS = 16_384
#: A token forgotten younger than this may still be retried by a worker (their retries
#: last at most ``embedding_worker_config.push_retry_ms``, which is capped below it).
UPDATE_TOKEN_MIN_AGE_S = 120.0


class _Serving(NamedTuple):
    """The store in force with what its counters are reported with, swapped as one."""

    store: Any
    carried: dict[str, int]   # added to the store's own counters (see _load; may be < 0)
    loads: int                # successful loads so far


class _Staged(NamedTuple):
    """A checked table waiting for ``commit_load`` (see ``load`` with ``stage``)."""

    token: str
    store: Any
    rows: int
    marks: Watermarks   # the stream watermarks it comes with (the load's ``cut``)
    trained_through: float | None   # what its rows are trained through (None: unknown)


def described(optimizer: optim_mod.Optimizer, embedding_config: EmbeddingConfig,
              policies: SlotPolicies | None = None) -> ServerConfig:
    """A configuration as ``get_config`` answers it: ``{"digest", "optimizer",
    "embedding_config", "policies"?}``, the digest being the first 16 hex digits of the
    sha256 of the others as sorted JSON (``policies`` only when some is not the default).
    ``configure`` takes it back as it is."""
    optimizer_d, embedding_d = optimizer.to_dict(), embedding_config.to_dict()
    parts: dict[str, Any] = {"optimizer": optimizer_d, "embedding_config": embedding_d}
    if policies is not None and policies_digest_part(policies) is not None:
        parts["policies"] = policies.to_wire()
    text = json.dumps(parts, sort_keys=True, default=repr).encode()
    out: ServerConfig = {"digest": hashlib.sha256(text).hexdigest()[:16],
                         "optimizer": optimizer_d, "embedding_config": embedding_d}
    if "policies" in parts:
        out["policies"] = parts["policies"]
    return out


def _ids(group: dict, where: str) -> np.ndarray:
    ids = group.get("ids") if isinstance(group, dict) else None
    if not (isinstance(ids, np.ndarray) and ids.dtype == np.uint64 and ids.ndim == 1):
        raise BadInput(f"{where}.ids must be a 1-D uint64 array, got {type(ids).__name__}"
                       f"{'' if not isinstance(ids, np.ndarray) else f' {ids.dtype} {ids.shape}'}",
                       field=f"{where}.ids")
    return ids


def _dim(group: dict, where: str) -> int:
    dim = group.get("dim") if isinstance(group, dict) else None
    if not isinstance(dim, int) or isinstance(dim, bool) or not (0 < dim <= 65536):
        raise BadInput(f"{where}.dim must be an int in [1, 65536], got {dim!r}",
                       field=f"{where}.dim")
    return dim


def _lookup_group(group: Any, where: str
                  ) -> tuple[int, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """(dim, ids, (index, offsets) of a pooled lookup or None), validated."""
    dim, ids = _dim(group, where), _ids(group, where)
    if "index" not in group and "offsets" not in group:
        return dim, ids, None
    index, offsets = group.get("index"), group.get("offsets")
    # The store checks again (~35 us a batch); checking here too refuses a bad group before
    # an earlier group of the same request has touched the store.
    segments.check_pooled(len(ids), index, offsets, where)
    return dim, ids, (index, offsets)


class EmbeddingServer:
    """One embedding shard served over RPC.

    Args:
        capacity: most embedding vectors this shard holds (LRU eviction beyond it).
        optimizer: embedding optimizer applied in place on update.
        embedding_config: initialisation, admission and weight bound.
        replica_index / replica_size: which shard of how many this is.
        stage_ttl_s: how long a staged load (``load`` with ``stage``) waits for its
            ``commit_load`` before it is dropped and its memory freed.
        store_threads: internal shards of the store, each looked up and updated on its own
            thread (:mod:`stream_persia.server.sharded`); 1: one store, one thread.
        checkpoint_root: where ``dump`` and ``load`` may write and read (a local
            directory or an fsspec URL prefix); None: they are refused.
        secret: the job's role secret clients must prove (see :class:`RpcServer`).
        connection_limits: the RPC server's connection cap and timeouts.
        max_dense_bytes: the largest dense model ``put_dense`` accepts
            (``model_updates.max_dense_bytes``).
        job: the job's name (``kafka.job_name``), in every update message.
        model_updates: whether this server keeps an update log of its changed rows for
            serving replicas (``model_updates.enabled``; :mod:`stream_persia.server.updates`).
        model_update_interval_ms: time between two passes of that log
            (``model_updates.model_update_interval_ms``).
        update_log_bytes: bound of the log in memory (``model_updates.update_log_bytes``).
        update_sink: a :class:`~stream_persia.kafka.updates.UpdateSink` that also produces
            the log to ``<job>.model.updates`` (None: replicas pull it over RPC).
        policies: the feature groups' table policies, as ``configure``'s ``policies``
            (:meth:`EmbeddingSchema.policy_params`; None: none).
        sketch_bytes: memory of the store's frequency admission sketch
            (``admission.sketch_bytes``; None: the store's default).
    """

    def __init__(self, capacity: int, optimizer: Any = None,
                 embedding_config: EmbeddingConfig | None = None, *, replica_index: int = 0,
                 replica_size: int = 1, host: str = "127.0.0.1", port: int = 0,
                 stage_ttl_s: float = 600.0, store_threads: int = 1,
                 update_tokens: int = UPDATE_TOKENS,
                 checkpoint_root: CheckpointRoot | str | None = None,
                 secret: auth.SecretSetting = auth.FROM_ENV,
                 connection_limits: ConnectionLimits = ConnectionLimits(),
                 job: str = "persia", model_updates: bool = True,
                 model_update_interval_ms: int = 200, update_log_bytes: int = 256 << 20,
                 update_sink: Any = None, max_dense_bytes: int = DEFAULT_MAX_DENSE_BYTES,
                 policies: dict[str, Any] | None = None, sketch_bytes: int | None = None):
        if not (0 <= replica_index < replica_size):
            raise BadInput(f"replica_index {replica_index} is not in [0, {replica_size})",
                           field="replica_index")
        if not (isinstance(stage_ttl_s, (int, float)) and 0 < stage_ttl_s < float("inf")):
            raise BadInput(f"stage_ttl_s must be a positive number of seconds, got "
                           f"{stage_ttl_s!r}", field="stage_ttl_s")
        if isinstance(update_tokens, bool) or not isinstance(update_tokens, int) \
                or not 1 <= update_tokens <= 1 << 24:
            raise BadInput(f"update_tokens must be an int in [1, {1 << 24}], got "
                           f"{update_tokens!r}", field="update_tokens")
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.stage_ttl_s = float(stage_ttl_s)
        # token -> (applied, dropped, monotonic time applied); store thread only.
        self._tokens: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        self.update_tokens = update_tokens
        self._token_counts = {"duplicates": 0, "evicted_young": 0}
        self.checkpoint_root = (CheckpointRoot(checkpoint_root)
                                if isinstance(checkpoint_root, str) else checkpoint_root)
        self._staged: _Staged | None = None   # read and replaced on the store thread only
        self._config_digest: str | None = None  # set by configure (see get_config)
        # How far each Kafka partition's updates are applied (stream_persia.core.watermarks);
        # store thread only, swapped with the table by a load.
        self._marks = Watermarks(f"embedding server {replica_index}")
        self._replays_refused = 0
        self._clears = 0          # clear requests applied (a checkpoint's cut must see them)
        self._stale_updates = 0   # updates refused: their rows' table was replaced by a load
        # The newest event time of any update applied (update in the module docstring);
        # written on the store thread, read anywhere (one float).
        self.trained_through: float | None = None
        # This process, as opposed to one restarted at its address (module docstring).
        self.incarnation = secrets.token_hex(8)
        self.sketch_bytes = sketch_bytes   # checked by make_store, with its bounds
        # The feature groups' table policies in force (store thread; see configure).
        self._policies: SlotPolicies | None = (
            None if policies is None else parse_policies(policies))
        self._serving = _Serving(
            make_store(capacity, optimizer or optim_mod.Adagrad(),
                       embedding_config or EmbeddingConfig(), shards=store_threads,
                       sketch_bytes=sketch_bytes),
            dict.fromkeys(COUNTERS, 0), 0)
        apply_policies(self._serving.store, self._policies)
        self._slot_stats = SlotStats(lambda: self._policies)
        self._slot_stats.snapshot(self._serving.store)
        self._expiry: asyncio.Task[None] | None = None
        self._expire_errors = 0
        self.store_threads = store_threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"store-{replica_index}")
        self.metrics = RoleMetrics("embedding_server", replica_index)
        self.metrics.add_callback("store", self._store_stats,
                                  counters={*COUNTERS, "loads", "clears"})
        # A staged restore holds a second table (as much memory again) until its commit.
        self.metrics.add_callback("restore", lambda: {
            "staged_rows": float(self._staged.rows if self._staged is not None else 0)})
        self.metrics.add_callback("update_tokens", lambda: {
            **{k: float(v) for k, v in self._token_counts.items()},
            "held": float(len(self._tokens))}, counters={"duplicates", "evicted_young"})
        self.metrics.add_callback("stream", lambda: {
            "replays_refused": float(self._replays_refused),
            "stale_updates_refused": float(self._stale_updates),
            "partitions": float(len(self._marks))},
            counters={"replays_refused", "stale_updates_refused"})
        self.metrics.registry.register(self._slot_stats)
        self.metrics.add_callback("expire", lambda: {"errors": float(self._expire_errors)},
                                  counters={"errors"})
        self.metrics.add_callback("trained_through", lambda: (
            {} if self.trained_through is None else {"seconds": self.trained_through}))
        self.metrics.registry.register(StageCollector(
            lambda: {"applied": self.trained_through}))
        self.dense = DenseHub(max_dense_bytes)
        # Server 0 relays the dense model to the update topic too (replicas on Kafka).
        self.dense_relay: DenseRelay | None = None
        if update_sink is not None and model_updates and replica_index == 0:
            self.dense_relay = DenseRelay(update_sink, job=job, shards=replica_size,
                                          incarnation=self.incarnation)
            self.dense.on_complete = self.dense_relay.offer
        self.metrics.add_callback("dense", self.dense.stats, counters={
            "published", "refused", "lineage_changes", "lineage_refused"})
        self._req = self.metrics.counter("requests_total", "RPC requests", ("method",))
        # What serving replicas follow (stream_persia.server.updates); None: not published.
        self.feed: UpdateFeed | None = None
        if model_updates:
            self.feed = UpdateFeed(
                store=lambda: self._serving.store, run=self._run,
                trained_through=lambda: self.trained_through, job=job, shard=replica_index,
                shards=replica_size, incarnation=self.incarnation,
                interval_ms=model_update_interval_ms, log_bytes=update_log_bytes,
                metrics=self.metrics, sink=update_sink)
        self.rpc = RpcServer({
            "health": self._health, "lookup": self._lookup, "update": self._update,
            "size": self._size, "clear": self._clear, "stats": self._stats,
            "configure": self._configure, "dump": self._dump, "load": self._load,
            "commit_load": self._commit_load, "abort_load": self._abort_load,
            "get_config": self._get_config, "metrics": self._metrics,
            "watermarks": self._watermarks, "slot_stats": self._slot_stats_rpc,
            "put_dense": self.dense.put_dense, "get_dense": self.dense.get_dense,
            **({} if self.feed is None else {"model_updates": self.feed.model_updates}),
        }, host=host, port=port, name=f"embedding-server-{replica_index}", secret=secret,
            connection_limits=connection_limits)
        self.metrics.add_callback("rpc", self.rpc.connection_stats,
                                  counters=CONNECTION_COUNTERS)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.rpc.start()
        if self.feed is not None:
            if self.feed.sink is not None:
                await self.feed.sink.start()
            self.feed.start()
        self._expiry = asyncio.create_task(self._expire_rows(), name="expire-rows")
        log.info("embedding server %d/%d listening on %s (store: %s, %d thread%s)",
                 self.replica_index, self.replica_size, self.rpc.address, IMPLEMENTATION,
                 self.store_threads, "" if self.store_threads == 1 else "s")

    async def stop(self) -> None:
        expiry, self._expiry = self._expiry, None
        if expiry is not None:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
        if self.dense_relay is not None:
            await self.dense_relay.stop()
        if self.feed is not None:
            await self.feed.stop()
            if self.feed.sink is not None:
                try:   # what the last pass logged, best effort
                    await asyncio.wait_for(self.feed.flush_sink(), 5.0)
                except TimeoutError:
                    pass
                await self.feed.sink.close()
        await self.rpc.stop()
        self._pool.shutdown(wait=True)
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.store.close()
        self._serving.store.close()

    @property
    def address(self) -> str:
        return self.rpc.address

    async def _expire_rows(self) -> None:
        """Every EXPIRE_INTERVAL_S: rows past their TTL evicted (bounded, while some policy
        has one) and the per-slot metrics read, on the store thread. A failed pass is
        logged and counted (``persia_embedding_server_expire_errors_total``); the next one
        tries again. A pass that evicted its bound of rows leaves a backlog: the next one
        is queued at once (requests queued meanwhile go first), so a backlog drains at the
        store's pace, not EXPIRE_ROWS a second."""
        expired = 0
        while True:
            await asyncio.sleep(0 if expired >= EXPIRE_ROWS else EXPIRE_INTERVAL_S)
            expired = 0
            try:
                expired = await self._run(self._expire_pass)
            except Exception as e:  # noqa: BLE001 - logged, counted; the next pass retries
                self._expire_errors += 1
                if self._expire_errors == 1 or self._expire_errors % 60 == 0:
                    log.error("embedding server %d: expiry pass failed (%d so far): %r",
                              self.replica_index, self._expire_errors, e)

    def _expire_pass(self) -> int:
        """One expiry pass and metrics snapshot (store thread); rows expired."""
        store = self.store
        expired = 0
        if self._policies is not None and self._policies.expires:
            expired = int(store.expire(max_rows=EXPIRE_ROWS))
        self._slot_stats.snapshot(store)
        return expired

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def on_store(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the store's thread, between the requests and the update log's
        passes (the store is not thread-safe: a call from another thread while one of
        those runs raises Misuse). For tools and tests that read the table in process."""
        return await self._run(fn, *args)

    @property
    def store(self) -> Any:
        """The EmbeddingStore in force (a successful load replaces it)."""
        return self._serving.store

    def store_stats(self) -> dict[str, int]:
        """The store's statistics with this server's counters (see the module docstring):
        ``rows`` and ``capacity`` of the store in force, every counter continuous across
        loads, ``loads`` and ``clears``."""
        serving = self._serving   # one read: a load swaps store and carried counts together
        stats = serving.store.stats()
        for key in COUNTERS:
            stats[key] += serving.carried[key]
        stats["loads"] = serving.loads
        stats["clears"] = self._clears
        return stats

    def _store_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.store_stats().items()}

    # ----------------------------------------------------------------- handlers
    async def _health(self, params: Any) -> ServerHealth:
        self._req.labels("health").inc()
        return {"ok": True, "role": "embedding-server", "replica_index": self.replica_index,
                "replica_size": self.replica_size, "rows": len(self.store),
                "implementation": IMPLEMENTATION, "store_threads": self.store_threads,
                "incarnation": self.incarnation, "loads": self._serving.loads,
                "trained_through": self.trained_through}

    def _check_incarnation(self, params: dict) -> None:
        """Refuse a request that expects another process at this address (it restarted
        since the caller last reached it); one comparison, before any work."""
        want = params.get("incarnation")
        if want is not None and want != self.incarnation:
            raise ServerRestarted(
                f"embedding server {self.replica_index} is incarnation {self.incarnation}, "
                f"not {str(want)[:40]!r} as the caller expects: it restarted since the "
                f"caller last reached it and holds none of the rows it held then; nothing "
                f"was done", field="incarnation",
                hint="restore the newest checkpoint into the embedding servers")

    async def _lookup(self, params: Any) -> LookupReply:
        self._req.labels("lookup").inc()
        mode = require(params, "mode", str)
        if mode not in MODES:
            raise BadInput(f"mode must be one of {MODES}, got {mode!r}", field="mode")
        groups = require(params, "groups", list)
        checked = [_lookup_group(g, f"groups[{i}]") for i, g in enumerate(groups)]
        train = mode == "train"
        want = config_digest_param(params)
        self._check_incarnation(params)

        def run() -> LookupReply:
            self._check_configured(want)
            store = self.store
            # An eval or infer lookup counts each id it finds no row for as a miss: the
            # store's counter gives ``missing`` without a second pass over the table
            # (contains() would cost about as much as the lookup itself).
            misses = 0 if train else store.stats()["misses"]
            rows = [store.lookup(ids, dim, train) if pooled is None
                    else store.lookup_pooled(ids, dim, *pooled, train)
                    for dim, ids, pooled in checked]
            missing = 0 if train else store.stats()["misses"] - misses
            return {"rows": rows, "missing": missing, "config": self._config_digest,
                    "incarnation": self.incarnation, "held": len(store),
                    "loads": self._serving.loads}

        return await self._run(run)

    async def _update(self, params: Any) -> UpdateReply:
        self._req.labels("update").inc()
        groups = require(params, "groups", list)
        checked = []
        for i, g in enumerate(groups):
            where = f"groups[{i}]"
            dim, ids = _dim(g, where), _ids(g, where)
            grads = g.get("grads")
            if not (isinstance(grads, np.ndarray) and grads.dtype == np.float32
                    and grads.shape == (ids.size, dim)):
                raise BadInput(f"{where}.grads must be float32 of shape {(ids.size, dim)}, got "
                               f"{getattr(grads, 'dtype', type(grads).__name__)} "
                               f"{getattr(grads, 'shape', '')}", field=f"{where}.grads")
            checked.append((ids, grads))
        want = config_digest_param(params)
        self._check_incarnation(params)
        table = params.get("loads")
        if table is not None and (isinstance(table, bool) or not isinstance(table, int)
                                  or table < 0):
            raise BadInput(f"loads must be an int >= 0 (a lookup reply's), got "
                           f"{str(table)[:40]!r}", field="loads")
        source = parse_source(params.get("source"))
        event_time = check_event_time(params.get("event_time"))
        token = params.get("token")
        if token is not None and not (isinstance(token, str) and 0 < len(token) <= 64):
            raise BadInput(f"token must be a string of 1-64 characters, got "
                           f"{str(token)[:80]!r}", field="token",
                           hint="one token per batch and server, the same on every retry")

        def run() -> UpdateReply:
            self._check_configured(want)
            if table is not None and table != self._serving.loads:
                self._stale_updates += 1
                raise ServerRestarted(
                    f"embedding server {self.replica_index}'s table was replaced by a load "
                    f"(a restore; load {self._serving.loads}, the update's rows are of "
                    f"load {table}) since this update's rows were looked up: it is not "
                    f"applied to the restored rows; nothing was done", field="loads",
                    hint="the batch fails; a job restored from a checkpoint trains from "
                         "its offsets")
            if token is not None and (first := self._tokens.get(token)) is not None:
                self._token_counts["duplicates"] += 1
                return {"applied": first[0], "dropped": first[1], "duplicate": True,
                        "config": self._config_digest, "incarnation": self.incarnation,
                        "held": len(self.store)}
            if source is not None:
                try:
                    self._marks.check(source)
                except StreamReplay as e:
                    self._replays_refused += 1
                    log.error("%s", e.message)
                    raise
            was = self.store.stats()
            for ids, grads in checked:
                self.store.update(ids, grads)
            now = self.store.stats()
            dropped = now["dropped_updates"] - was["dropped_updates"]
            refused = now["nonfinite_updates"] - was["nonfinite_updates"]
            if refused:
                log.warning("embedding server %d: %d id(s) of update %s were not stepped: "
                            "their summed gradients (or the optimizer steps) were not finite, "
                            "so their rows keep their values (counted in "
                            "persia_embedding_server_store_nonfinite_updates_total)",
                            self.replica_index, refused, token or "(no token)")
            applied = sum(int(ids.size) for ids, _ in checked) - dropped
            if source is not None:
                self._marks.advance(source)
            if event_time is not None and (self.trained_through is None
                                           or event_time > self.trained_through):
                self.trained_through = event_time
            if token is not None:
                self._remember(token, applied, dropped)
            return {"applied": applied, "dropped": dropped, "config": self._config_digest,
                    "incarnation": self.incarnation, "held": len(self.store)}

        return await self._run(run)

    def _remember(self, token: str, applied: int, dropped: int) -> None:
        """Keep ``token``'s reply, forgetting the oldest beyond ``update_tokens`` (store
        thread)."""
        tokens = self._tokens
        now = time.monotonic()
        tokens[token] = (applied, dropped, now)
        if len(tokens) > self.update_tokens:
            old, (_, _, at) = tokens.popitem(last=False)
            if now - at < UPDATE_TOKEN_MIN_AGE_S:
                self._token_counts["evicted_young"] += 1
                if self._token_counts["evicted_young"] == 1:
                    log.warning("embedding server %d forgot update token %s only %.1f s after "
                                "applying it: a worker retrying that push now would apply it "
                                "twice; raise update_tokens above %d (counted in "
                                "update_tokens_evicted_young_total)", self.replica_index,
                                old, now - at, self.update_tokens)

    async def _size(self, params: Any) -> int:
        return len(self.store)

    async def _clear(self, params: Any) -> None:
        self._req.labels("clear").inc()

        def run() -> None:
            self.store.clear()   # the store in force on its turn
            self._marks.clear()  # the stream is trained again from scratch, on purpose
            self.trained_through = None
            self._clears += 1

        await self._run(run)

    async def _watermarks(self, params: Any) -> WatermarksReply:
        self._req.labels("watermarks").inc()
        if params is not None and not isinstance(params, dict):
            raise BadInput(f"params must be a map {{topic?}}, got {type(params).__name__}",
                           field="params")
        topic = (params or {}).get("topic")
        if topic is not None:
            topic = check_topic(topic, "topic")
        # On the store thread: after every update received before it.
        return await self._run(lambda: {"topics": self._marks.to_wire(topic)})

    async def _stats(self, params: Any) -> dict[str, int]:
        return self.store_stats()

    async def _slot_stats_rpc(self, params: Any) -> dict[str, dict[str, int]]:
        """``slot_stats`` → ``{slot: {"rows", "admitted", "rejected", "expired",
        "evicted_lru", "evicted_cap", "dropped_grads"}}`` as of the last expiry pass (the
        ``persia_embedding_server_slot_*`` metrics); empty while the store reports none."""
        await self._run(self._snapshot_slots)
        return self._slot_stats.values()

    def _snapshot_slots(self) -> None:
        self._slot_stats.snapshot(self.store)   # the store in force on its turn

    async def _metrics(self, params: Any) -> bytes:
        await self._run(self._snapshot_slots)   # fresh per-slot counts for the API's relay
        return self.metrics.render()

    async def _configure(self, params: Any) -> None:
        self._req.labels("configure").inc()
        if not isinstance(params, dict):
            raise BadInput("configure takes a map", field="params")
        unknown = set(params) - {"optimizer", "embedding_config", "policies", "digest"}
        if unknown:
            raise BadInput(f"unknown configure field(s) {sorted(unknown)}",
                           field=sorted(unknown)[0],
                           hint="optimizer, embedding_config, policies, digest")
        opt = params.get("optimizer")
        cfg = params.get("embedding_config")
        optimizer = optim_mod.optimizer_from_dict(opt) if opt is not None else None
        emb_cfg = EmbeddingConfig.from_dict(cfg) if cfg is not None else None
        pol = params.get("policies")
        policies = parse_policies(pol) if pol is not None else None
        if params.get("digest") is not None:   # a get_config reply, given back as it is
            digest = require_hex16(params["digest"], "digest", "a configuration digest")
            if optimizer is None or emb_cfg is None:
                raise BadInput("a configure that names a digest gives the whole "
                               "configuration: optimizer and embedding_config", field="digest")
            got = described(optimizer, emb_cfg, policies)["digest"]
            if got != digest:
                raise BadInput(f"the configuration given has digest {got}, not {digest}",
                               field="digest", hint="send a get_config reply unchanged")

        def run() -> None:
            # Policies first: a store without them refuses, and nothing else has changed.
            apply_policies(self.store, policies)
            if policies is not None:
                self._policies = None if policies.is_default else policies
            self.store.configure(optimizer=optimizer, embedding_config=emb_cfg)
            self._config_digest = self._config()["digest"]
            staged = self._staged
            if staged is not None:   # built with the old config: it must not bring it back
                try:
                    apply_policies(staged.store, policies)
                    staged.store.configure(optimizer=optimizer, embedding_config=emb_cfg)
                except Exception as e:   # its commit fails; the restore loads again
                    self._drop_staged(f"the configure it was built before failed on it ({e})")

        await self._run(run)

    def _config(self) -> ServerConfig:
        """The store's whole configuration and its digest (store thread)."""
        return described(self.store.optimizer, self.store.embedding_config, self._policies)

    async def _get_config(self, params: Any) -> ServerConfig | None:
        self._req.labels("get_config").inc()
        if self._config_digest is None:
            return None
        return await self._run(self._config)

    def _check_configured(self, want: str | None) -> None:
        """Refuse traffic that expects a configuration (``want``) this process never
        received; on the store thread, after any configure queued ahead of it."""
        if want is not None and self._config_digest is None:
            raise Misuse(f"embedding server {self.replica_index} was never configured (it "
                         f"restarted?) but the caller expects configuration {want}: it "
                         "would apply the default optimizer and initialisation",
                         field="config", hint="configure it first (embedding workers do so "
                                              "by themselves from the configuration they "
                                              "learned)")

    # ----------------------------------------------------------------- checkpoints
    async def _dump(self, params: Any) -> DumpReply:
        self._req.labels("dump").inc()
        directory = self._confine(require(params, "dir", str))
        since = params.get("since")
        if since is not None:
            since = patches.check_since(since)
        name = shard_file_name(self.replica_index, self.replica_size)

        # dump() is called on the store thread: a load queued ahead of it swaps the store.
        # The reply names the configuration the rows were written with (their optimizer
        # state's kind), so that a restore can configure a server that holds none. With
        # ``since``, only what changed after it (stream_persia.server.patches), when the
        # store can tell; else the full shard and why.
        def run() -> DumpReply:
            store = self.store
            now = patches.tracking(self.incarnation, self._serving.loads, store)
            patch = full_because = None
            if since is not None:
                patch = patches.write_patch(store, since, now, directory,
                                            self.replica_index, self.replica_size)
                if patch is None:
                    full_because = patches.why_full(
                        since, now, store.evicted_since(since["version"])[2])
            info = patch["rows"] if patch is not None else \
                write_shard_file(store.dump(), directory, name)
            reply = DumpReply(**info, config=self._config(), watermarks=self._marks.to_wire(),
                              updates=None if self.feed is None else self.feed.position(),
                              tracking=now, held=len(store))
            if since is not None:
                reply["tombstones"] = None if patch is None else patch["tombstones"]
                reply["full_because"] = full_because
            return reply

        return await self._run(run)

    async def _load(self, params: Any) -> LoadReply:
        self._req.labels("load").inc()
        directory, files, expected, stage = check_load_request(params)
        directory = self._confine(directory)
        chain = patches.check_patches(params)
        for p in chain:
            p["dir"] = self._confine(p["dir"])
        marks = Watermarks(f"embedding server {self.replica_index}",
                           parse_cut(params.get("cut")),
                           parse_cut_fingerprints(params.get("cut_fingerprints")))
        through = check_event_time(params.get("trained_through"), "trained_through")

        def run() -> LoadReply:
            old = self._serving.store
            staging = make_store(old.capacity, old.optimizer, old.embedding_config,
                                 shards=self.store_threads, sketch_bytes=self.sketch_bytes)
            try:
                apply_policies(staging, self._policies)
            except BaseException:
                staging.close()
                raise
            self._drop_staged("replaced by a newer load")  # its memory, first
            try:
                kept = stage_shard_files(staging, directory, files, expected,
                                         self.replica_index, self.replica_size,
                                         held_rows=len(old))
                if chain:   # the rows held after the chain, not the base's
                    patches.stage_patches(staging, chain, self.replica_index,
                                          self.replica_size, held_rows=len(old))
                    kept = len(staging)
            except BaseException:
                staging.close()
                raise
            if not stage:
                self._swap_in(staging, marks, through)
                return {"rows": kept}
            token = secrets.token_hex(8)
            self._staged = _Staged(token, staging, kept, marks, through)
            return {"rows": kept, "token": token}

        reply = await self._run(run)
        if stage:   # dropped after the ttl unless committed, aborted or replaced by then
            asyncio.get_running_loop().call_later(self.stage_ttl_s, self._expire,
                                                  reply["token"])
        return reply

    def _confine(self, directory: str) -> str:
        """``directory`` of a dump or load, if under the checkpoint root (BadInput on
        ``dir`` otherwise; Misuse without a root)."""
        root = require_root(self.checkpoint_root, f"embedding server {self.replica_index}")
        return root.confine(directory, "dir")

    def _expire(self, token: str) -> None:
        with contextlib.suppress(RuntimeError):   # the server stopped: nothing to free
            self._pool.submit(self._drop_staged,
                              f"not committed within stage_ttl_s={self.stage_ttl_s:g} s", token)

    def _drop_staged(self, why: str, token: str | None = None) -> bool:
        """Forget the staged load (only if it is ``token``, when given); store thread."""
        staged = self._staged
        if staged is None or (token is not None and staged.token != token):
            return False
        self._staged = None
        staged.store.close()
        log.warning("embedding server %d: dropped the staged load %s (%d rows): %s",
                    self.replica_index, staged.token, staged.rows, why)
        return True

    def _swap_in(self, staging: Any, marks: Watermarks, through: float | None) -> None:
        """Serve ``staging``, with its stream watermarks ``marks``, from now on (store
        thread), trained through ``through`` (the checkpoint's event time, None: unknown;
        never what the replaced rows were trained through: a restore rewinds it). The
        reported counters go on from the old store's; the staging store's own counts are
        the load's, not traffic, and are subtracted. The old store is closed: its memory
        is freed now."""
        self._marks = marks
        self.trained_through = through
        serving = self._serving
        was, own = serving.store.stats(), staging.stats()
        carried = {k: serving.carried[k] + was[k] - own[k] for k in COUNTERS}
        self._serving = _Serving(staging, carried, serving.loads + 1)
        self._slot_stats.carry(serving.store, staging)
        serving.store.close()

    async def _commit_load(self, params: Any) -> LoadReply:
        self._req.labels("commit_load").inc()
        token = _token(params)

        def run() -> LoadReply:
            staged = self._staged
            if staged is None or staged.token != token:
                raise BadInput(f"no staged load {token!r} on embedding server "
                               f"{self.replica_index}: it was committed or aborted, replaced "
                               f"by a newer one, dropped after stage_ttl_s="
                               f"{self.stage_ttl_s:g} s, or the server restarted",
                               field="token", hint="load again")
            self._staged = None
            self._swap_in(staged.store, staged.marks, staged.trained_through)
            return {"rows": staged.rows}

        return await self._run(run)

    async def _abort_load(self, params: Any) -> dict[str, bool]:
        self._req.labels("abort_load").inc()
        token = _token(params)
        return {"aborted": await self._run(self._drop_staged, "aborted", token)}


def _token(params: Any) -> str:
    return require_hex16(require(params, "token", str), "token",
                         "a token a staged load returned")
