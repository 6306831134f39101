"""``global_config.yml``: PERSIA's sections plus stream-persia's ``kafka`` and ``api``.

PERSIA's keys and documented defaults::

    common_config:
      job_type: Train                    # Eval and Infer are refused (no such jobs here)
      metrics_config: {enable_metrics: false, push_interval_sec: 10,   # true is refused:
                       job_name: persia_default_jobname}               # no push gateway
      checkpointing_config: {num_workers: 4,
                             keep_checkpoints: 3,  # ours: kept under the API's directory
                             every_steps: null,    # ours: periodic checkpoints every this
                             every_s: null,        #   many steps and/or seconds (null: off)
                             periodic_dir: null,   #   into here (null: the API's directory)
                             full_every: 8,        # ours: with incremental updates, a full
                                                   #   base after this many patches
                             compact_after: null}  # ours: compact a periodic chain this
                                                   #   many patches long (null: off)
      infer_config: {servers: [], embedding_checkpoint: null}   # a checkpoint is refused
    embedding_parameter_server_config:
      capacity: 1000000000               # embedding rows per server (LRU beyond it),
                                         # at most 2**30 (the store's limit)
      num_hashmap_internal_shards: 100
      full_amount_manager_buffer_size: 1000
      enable_incremental_update: false   # true: checkpoints are patches on a base
                                         # (checkpointing_config.full_every)
      incremental_buffer_size: 1000000
      incremental_dir: null
      incremental_channel_capacity: 1000
      restore_stage_ttl_s: 600           # ours: a staged restore not committed is dropped
      store_threads: 1                   # ours: internal shards, each on its own thread
    embedding_worker_config:
      ready_buffer_batches: 16           # batches waiting for NN workers (PERSIA's name:
                                         # forward_buffer_size; PERSIA's default was 1000)
      max_inflight_lookups: 16           # ours: concurrent lookups per worker
      rpc_timeout_ms: 10000              # ours
      # buffered_data_expired_sec is refused: PERSIA dropped late batches (data loss)

``kafka`` is described in :mod:`stream_persia.config.kafka`; ``api`` in :class:`ApiConfig`;
``rpc`` (bounds on every role's RPC connections) in :class:`RpcConfig`; ``model_updates``
(the update stream from training to serving replicas) in :class:`ModelUpdatesConfig`::

    model_updates:
      enabled: true                  # false: nothing is published (servers, NN rank 0)
      model_update_interval_ms: 200  # how often servers publish their changed rows
      dense_every_steps: 10          # NN rank 0 publishes the dense model every this many
      dense_interval_ms: 250         #   steps or this many ms, whichever comes first
      max_dense_bytes: 1073741824    # the largest dense blob sent or held
      update_log_bytes: 268435456    # each server's update log in memory

``progressive`` (progressive validation on the NN workers) in :class:`ProgressiveConfig`::

    progressive:
      enabled: true                  # false: TrainCtx keeps no progressive metrics
      window_samples: 100000         # samples in the windowed AUC, NE, calibration

``admission`` (frequency admission on the embedding servers, the ``min_count`` of
``embedding_config.yml``'s slots) in :class:`AdmissionConfig`::

    admission:
      sketch_bytes: 8388608          # each server's count-min sketch (its error bound:
                                     # the store's docstring)

Every key is either acted on or refused with the reason and what to use instead: keys
PERSIA accepted but never acted on, and values asking for a PERSIA feature stream-persia
does not have (incremental update, pushed metrics, Eval/Infer jobs, servers preloaded from
a checkpoint, dropping late batches). The only exceptions are :data:`INERT_KEYS`: PERSIA
keys accepted so that PERSIA's files load, each of which has no effect in PERSIA either
under the values accepted here, or only tuned the speed of a PERSIA internal that
stream-persia does not have. ``tests/config/test_config_keys.py`` fails on a key that is none of
these.

Size: one module past 500 lines on purpose: one dataclass per section of
``global_config.yml``, kept together so that the file's schema and its key list above
read in one place (``kafka`` has its own module).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stream_persia.config._base import (
    at_source,
    build,
    canonical_digest,
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_str,
    describe,
    error,
    parse_addresses,
    section_to_dict,
)
from stream_persia.config.files import read_secret_file
from stream_persia.config.kafka import KafkaConfig
from stream_persia.core.embedding_config import (
    MAX_CAPACITY,
    MAX_SKETCH_BYTES,
    MIN_SKETCH_BYTES,
    SKETCH_BYTES,
)
from stream_persia.errors import ConfigError

#: The most threads (internal shards) one embedding server's store may have.
MAX_STORE_THREADS = 256

__all__ = ["MetricsConfig", "CheckpointingConfig", "InferConfig", "CommonConfig",
           "EmbeddingParameterServerConfig", "EmbeddingWorkerConfig", "ApiConfig",
           "RpcConfig", "ModelUpdatesConfig", "ProgressiveConfig", "AdmissionConfig", "GlobalConfig", "JOB_TYPES", "INERT_KEYS"]

JOB_TYPES = ("Train", "Eval", "Infer")
_UNUSED = "PERSIA's {what}; stream-persia has no use for it: remove it"

#: Accepted keys that change nothing, by key path, with the reason (see the module
#: docstring). Anything else a file sets is acted on, or refused.
INERT_KEYS: dict[str, str] = {
    "common_config.metrics_config.push_interval_sec":
        "configures pushing to a gateway, which is off (enable_metrics: true is refused)",
    "common_config.metrics_config.job_name":
        "labels pushed metrics, which are off (enable_metrics: true is refused)",
    "common_config.checkpointing_config.num_workers":
        "PERSIA's dump/load threads per server; every server here writes and reads its "
        "shard in one stream, all servers at once",
    "embedding_parameter_server_config.num_hashmap_internal_shards":
        "PERSIA's lock striping of its hash map; the store here has none (its parallelism "
        "is store_threads)",
    "embedding_parameter_server_config.full_amount_manager_buffer_size":
        "a buffer of PERSIA's incremental update; stream-persia's incremental checkpoints "
        "read the store's own change tracking",
    "embedding_parameter_server_config.incremental_buffer_size":
        "PERSIA's incremental update buffer; incremental checkpoints here need none (the "
        "store's change tracking)",
    "embedding_parameter_server_config.incremental_dir":
        "PERSIA's incremental update directory; incremental checkpoints go where the "
        "checkpoints go",
    "embedding_parameter_server_config.incremental_channel_capacity":
        "PERSIA's incremental update channel; incremental checkpoints need none",
}


class _Section:
    """``to_dict`` shared by the sections."""

    #: fields that ``to_dict(redact=True)`` blanks
    _SECRETS: ClassVar[tuple[str, ...]] = ()

    def to_dict(self, *, redact: bool = False) -> dict[str, Any]:
        return section_to_dict(self, redact, self._SECRETS)


@dataclass(frozen=True)
class MetricsConfig(_Section):
    """``common_config.metrics_config`` (PERSIA's keys; ``push_interval_seconds`` too)."""

    enable_metrics: bool = False
    push_interval_sec: int = 10
    job_name: str = "persia_default_jobname"

    _ALIASES: ClassVar[dict[str, str]] = {"push_interval_seconds": "push_interval_sec"}

    def __post_init__(self) -> None:
        check_bool(self, "enable_metrics")
        check_int(self, "push_interval_sec", lo=1, hi=86_400)
        check_str(self, "job_name")
        if self.enable_metrics:
            raise error("enable_metrics", "true is not supported: stream-persia does not push "
                        "metrics to a Prometheus push gateway as PERSIA did",
                        "set it to false (or remove metrics_config): every role serves its "
                        "metrics for Prometheus to scrape (launch --metrics-port; the API's "
                        "GET /metrics)")


@dataclass(frozen=True)
class CheckpointingConfig(_Section):
    """``common_config.checkpointing_config``: concurrency of embedding dump and load.

    Ours: ``keep_checkpoints``, how many complete checkpoints the API keeps under its
    checkpoint directory (:mod:`stream_persia.checkpoint.retention`): after each one it
    takes, older ones beyond this number are deleted, never the model it serves nor one
    in use. 3 by default: the newest plus two to fall back on, since each holds every
    embedding row (as large as the servers' memory). 0 keeps them all (unbounded disk).

    Periodic checkpoints (ours; :mod:`stream_persia.nn.periodic`), off unless
    ``every_steps`` or ``every_s`` is set: NN rank 0 has every rank take the consistent
    cut of an on-request checkpoint every ``every_steps`` training steps and/or every
    ``every_s`` seconds, into ``periodic_dir`` (default: the job's checkpoint directory,
    ``PERSIA_CHECKPOINT_DIR``, where the API lists, restores and serves them), and keeps
    the ``keep_checkpoints`` newest periodic ones there (it deletes no other checkpoint).

    Incremental checkpoints (``embedding_parameter_server_config.enable_incremental_update:
    true``, PERSIA's key): a periodic checkpoint is a *patch* holding only the embedding
    rows changed since the previous one (:mod:`stream_persia.checkpoint.manifest`'s
    ``chain``), and every ``full_every``-th one after a base is a full base again (8 by
    default: a restore reads at most 8 patches after its base). Retention never deletes a
    checkpoint a kept patch needs. ``compact_after`` (null: off): once a periodic patch is
    that many patches from its base, NN rank 0 compacts its chain in the background into a
    new base (``stream-persia checkpoint compact``) which the next periodic patch patches,
    so chains stay short without the servers dumping a full table, and retention frees the
    old chain as it ages out.
    """

    num_workers: int = 4
    keep_checkpoints: int = 3
    every_steps: int | None = None
    every_s: float | None = None
    periodic_dir: str | None = None
    full_every: int = 8
    compact_after: int | None = None

    def __post_init__(self) -> None:
        check_int(self, "num_workers", lo=1, hi=1024)
        check_int(self, "keep_checkpoints", lo=0, hi=1_000_000,
                  hint="complete checkpoints kept under the checkpoint directory, e.g. 3; "
                       "0 keeps every one")
        check_int(self, "every_steps", lo=1, hi=10**12, optional=True,
                  hint="take a periodic checkpoint every this many training steps, e.g. "
                       "1000; null (or no key): not by steps")
        every_s = self.every_s
        if every_s is not None:
            if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) \
                    or not 0 < every_s <= 365 * 86_400:
                raise error("every_s", f"expected a number of seconds in (0, 31536000] or "
                            f"null, got {describe(every_s)}",
                            "take a periodic checkpoint every this many seconds, e.g. 600; "
                            "null (or no key): not by time")
            object.__setattr__(self, "every_s", float(every_s))
        check_str(self, "periodic_dir", optional=True,
                  hint="a directory or fsspec URL under the roles' checkpoint root")
        check_int(self, "full_every", lo=1, hi=100_000,
                  hint="with enable_incremental_update, a full base after this many "
                       "patches, e.g. 8")
        check_int(self, "compact_after", lo=1, hi=100_000, optional=True,
                  hint="with enable_incremental_update, compact a periodic chain into a new "
                       "base in the background once it has this many patches, e.g. 4; "
                       "null (or no key): never")
        if self.periodic_dir is not None and self.periodic_dir.startswith("~"):
            # No shell expands it: os.path.abspath made it ./~/... under the NN rank's
            # working directory, outside the checkpoint root, and every periodic
            # checkpoint failed (logged) while training went on.
            raise error("periodic_dir", f"{self.periodic_dir!r} starts with ~, which is not "
                        "expanded in a config file", "write the absolute path")
        if self.periodic_dir is not None and "::" in self.periodic_dir:
            raise error("periodic_dir", f"{self.periodic_dir!r} is a chained URL",
                        "give the storage URL itself")
        if self.periodic_dir is not None and not self.periodic:
            raise error("periodic_dir", "is set but neither every_steps nor every_s is: no "
                        "periodic checkpoint would be taken",
                        "set every_steps and/or every_s, or remove periodic_dir")

    @property
    def periodic(self) -> bool:
        """Whether periodic checkpoints are on."""
        return self.every_steps is not None or self.every_s is not None


@dataclass(frozen=True)
class InferConfig(_Section):
    """``common_config.infer_config``.

    Args:
        servers: embedding servers as ``host:port``; empty = the topology's addresses.
        embedding_checkpoint: checkpoint the servers load at start (PERSIA's docs also
            call it ``initial_sparse_checkpoint``).
    """

    servers: tuple[str, ...] = ()
    embedding_checkpoint: str | None = None

    _ALIASES: ClassVar[dict[str, str]] = {"initial_sparse_checkpoint": "embedding_checkpoint"}

    def __post_init__(self) -> None:
        if self.embedding_checkpoint is not None:
            raise error("embedding_checkpoint", "is not supported: embedding servers do not "
                        "load a checkpoint at start as PERSIA's inference servers did (they "
                        "would serve untrained rows)",
                        "remove it; serve a checkpoint with `stream-persia launch api --model "
                        "CKPT` (env PERSIA_API_MODEL), or restore it into running servers "
                        "with POST /v1/checkpoints/{id}/restore")
        servers = self.servers
        if servers is None:
            servers = ()
        if isinstance(servers, str) or not isinstance(servers, (list, tuple)):
            raise error("servers", f"expected a list of host:port, got {describe(servers)}")
        for i, s in enumerate(servers):
            if not isinstance(s, str) or "," in s or parse_addresses(s, f"servers[{i}]") is None:
                raise error(f"servers[{i}]", f"expected one host:port, got {describe(s)}")
        object.__setattr__(self, "servers", tuple(s.strip() for s in servers))
        check_str(self, "embedding_checkpoint", optional=True)


@dataclass(frozen=True)
class CommonConfig(_Section):
    """``common_config``: the job type and cross-role settings."""

    job_type: str = "Train"
    metrics_config: MetricsConfig = field(default_factory=MetricsConfig)
    checkpointing_config: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    infer_config: InferConfig = field(default_factory=InferConfig)

    _NESTED: ClassVar[dict[str, type]] = {"metrics_config": MetricsConfig,
                                          "checkpointing_config": CheckpointingConfig,
                                          "infer_config": InferConfig}
    _REJECTED: ClassVar[dict[str, str]] = {
        "intent": "PERSIA renamed it job_type (Train, Eval or Infer)",
        "servers": "it belongs under common_config.infer_config",
        "embedding_checkpoint": "it belongs under common_config.infer_config",
        "initial_sparse_checkpoint": "it belongs under common_config.infer_config "
                                     "(as embedding_checkpoint)",
    }

    def __post_init__(self) -> None:
        check_choice(self, "job_type", JOB_TYPES)
        if self.job_type != "Train":
            raise error("job_type", f"{self.job_type} is not supported: stream-persia has no "
                        "separate PERSIA-style Eval or Infer job",
                        "set it to Train (or remove it): evaluation runs inside the training "
                        "script, and serving is `stream-persia launch api`, which takes the "
                        "embedding servers from infer_config.servers")
        check_instance(self, "metrics_config", MetricsConfig)
        check_instance(self, "checkpointing_config", CheckpointingConfig)
        check_instance(self, "infer_config", InferConfig)


@dataclass(frozen=True)
class EmbeddingParameterServerConfig(_Section):
    """``embedding_parameter_server_config`` (PERSIA's keys and defaults).

    Of PERSIA's keys only ``capacity`` changes behaviour here: the store is one LRU table
    per server (or per internal shard, with ``store_threads``), so
    ``num_hashmap_internal_shards`` and ``full_amount_manager_buffer_size`` are accepted
    for compatibility and validated. Incremental update is not implemented:
    enabling it is an error; checkpoints (consistent with the Kafka offsets) replace it.

    Ours: ``restore_stage_ttl_s``, how long a server keeps a checkpoint it staged for a
    restore (a second table beside the served one, as much memory again) waiting for the
    commit; after it the staged table is dropped, so a restore whose coordinator died does
    not pin the memory (see :func:`stream_persia.checkpoint.load_embeddings`).
    ``store_threads``: the internal shards of each server's store, each looked up and
    updated on its own thread (:mod:`stream_persia.server.sharded`); 1 (the default):
    one store on one thread. PERSIA's ``num_hashmap_internal_shards`` only set lock
    striping, and at its default of 100 would be far too many threads.
    ``update_tokens``: how many recent gradient updates a server remembers by token, so
    that a worker's retry of one is answered without applying it twice
    (:mod:`stream_persia.server.service`); it must exceed the updates a server takes
    within a worker's ``push_retry_ms``.
    """

    capacity: int = 1_000_000_000
    num_hashmap_internal_shards: int = 100
    full_amount_manager_buffer_size: int = 1000
    enable_incremental_update: bool = False
    incremental_buffer_size: int = 1_000_000
    incremental_dir: str | None = None
    incremental_channel_capacity: int = 1000
    restore_stage_ttl_s: int = 600
    store_threads: int = 1
    update_tokens: int = 16_384

    _REJECTED: ClassVar[dict[str, str]] = {
        "num_embedding_io_workers": "PERSIA ignored it in this section; the concurrency of "
                                    "embedding dump/load is common_config."
                                    "checkpointing_config.num_workers: remove it here",
    } | {k: _UNUSED.format(what="older key (checkpoints go to any local path or fsspec URL)")
         for k in ("num_persistence_workers", "num_signs_per_file", "storage",
                   "local_buffer_dir")} | {
        "embedding_recycle_pool_capacity": _UNUSED.format(what="older memory-pool key"),
    }

    def __post_init__(self) -> None:
        # The store's own limit (any store_threads): more would pass here and then be
        # refused by the server at start, in a message naming neither file nor key.
        check_int(self, "capacity", lo=1, hi=MAX_CAPACITY,
                  hint=f"the most embedding rows one server holds, e.g. 1000000000; at "
                       f"most {MAX_CAPACITY} (2**30, the store's limit): add embedding "
                       "servers for more rows")
        check_int(self, "num_hashmap_internal_shards", lo=1, hi=1 << 20)
        check_int(self, "full_amount_manager_buffer_size", lo=1, hi=1 << 30)
        check_bool(self, "enable_incremental_update")
        check_int(self, "incremental_buffer_size", lo=1, hi=1 << 40)
        check_str(self, "incremental_dir", optional=True)
        check_int(self, "incremental_channel_capacity", lo=1, hi=1 << 30)
        check_int(self, "restore_stage_ttl_s", lo=1, hi=7 * 86_400,
                  hint="seconds a staged restore waits for its commit, e.g. 600")
        check_int(self, "store_threads", lo=1, hi=MAX_STORE_THREADS,
                  hint="threads (internal shards) of each server's store: one per core it "
                       "may use, e.g. 4")
        check_int(self, "update_tokens", lo=1, hi=1 << 24,
                  hint="recent update tokens a server remembers to recognise a retried "
                       "push (about 200 bytes each), e.g. 16384")
        if self.store_threads > self.capacity:
            raise error("store_threads", f"{self.store_threads} internal shards cannot share "
                        f"a capacity of {self.capacity} rows (each holds at least one)",
                        "lower store_threads or raise capacity")


#: ``embedding_worker_config.on_server_restart``: see :mod:`stream_persia.worker.router`.
ON_SERVER_RESTART = ("fail", "continue")


@dataclass(frozen=True)
class EmbeddingWorkerConfig(_Section):
    """``embedding_worker_config``: PERSIA's keys plus bounded buffers and RPC limits.

    Args:
        ready_buffer_batches: batches from the data side (Kafka or data loaders), checked
            and planned, waiting for NN workers to pull them; when it is full the data
            side waits (Kafka partitions paused, ``ingest`` calls held). PERSIA's name for
            this buffer, ``forward_buffer_size``, is accepted for it (not both).
        ready_buffer_bytes: and at most this many bytes of them (decoded arrays and lookup
            plans, about 3-4x the encoded batch; one batch always fits), so that a worker
            whose NN workers stop pulling holds a bounded amount of memory whatever the
            batch size; Kafka partitions are paused while the buffer is full.
        max_inflight_lookups: the most embedding lookups (one batch each, fanned out to
            the servers) a worker runs at once, training pulls and eval/inference lookups
            together; more wait their turn.
        rpc_timeout_ms: deadline of one RPC to an embedding server.
        push_retry_ms: how long a gradient push keeps retrying the embedding servers that
            have not applied it (unreachable, timed out, restarting) before the batch is
            failed (:mod:`stream_persia.worker.service`); at most 120000 (the servers
            remember update tokens at least that long, see ``update_tokens``).
        on_server_restart: fail|continue: what a worker does when an embedding server
            restarted (a new process at its address, holding none of the rows the old one
            held). ``fail`` (default): every lookup and push that needs it fails naming it,
            the worker's health is not ok and a launched worker exits 1, checkpoints refuse,
            until a checkpoint is restored. ``continue``: train on without those rows,
            logged at ERROR and counted (``persia_embedding_worker_server_restarts_total``);
            "every sample trained exactly once" then no longer holds
            (:mod:`stream_persia.worker.router`).

    PERSIA's ``buffered_data_expired_sec`` is refused: it dropped a served batch whose
    gradients had not come back in time, which would lose training data silently.
    """

    ready_buffer_batches: int = 16
    max_inflight_lookups: int = 16
    rpc_timeout_ms: int = 10_000
    push_retry_ms: int = 20_000
    ready_buffer_bytes: int = 32 * 1024 * 1024
    on_server_restart: str = "fail"

    _ALIASES: ClassVar[dict[str, str]] = {"forward_buffer_size": "ready_buffer_batches"}
    _REJECTED: ClassVar[dict[str, str]] = {
        "buffered_data_expired_sec": (
            "PERSIA dropped a batch served to an NN worker whose gradients had not come back "
            "after this long; stream-persia never drops one (exactly-once training): its "
            "gradients are applied once, or its NN worker returns it before a checkpoint, or "
            "the run fails naming it and a restore replays it from the checkpoint. Remove it"),
    }

    def __post_init__(self) -> None:
        check_int(self, "ready_buffer_batches", lo=1, hi=1 << 16,
                  hint="batches waiting for NN workers (PERSIA: forward_buffer_size), e.g. 16")
        check_int(self, "max_inflight_lookups", lo=1, hi=1 << 16,
                  hint="concurrent lookups of one worker, e.g. 16")
        check_int(self, "rpc_timeout_ms", lo=1, hi=3_600_000)
        check_int(self, "ready_buffer_bytes", lo=1 << 20, hi=1 << 40,
                  hint="bytes of planned batches a worker holds ready, e.g. 33554432")
        check_int(self, "push_retry_ms", lo=0, hi=120_000,
                  hint="milliseconds a gradient push retries the servers, e.g. 20000")
        check_choice(self, "on_server_restart", ON_SERVER_RESTART)


@dataclass(frozen=True)
class ApiConfig(_Section):
    """``api``: the HTTP control plane and inference service.

    Args:
        host: address to bind; 127.0.0.1 keeps it local.
        port: TCP port; 0 lets the OS pick (tests).
        token, token_file: bearer token required on every request except health probes;
            inline or read from a file (a mounted secret). Neither = no authentication.
        max_body_bytes: largest request body accepted.
        max_rows_per_request: most samples in one inference request.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_rows_per_request: int = 10_000

    _SECRETS: ClassVar[tuple[str, ...]] = ("token",)

    def __post_init__(self) -> None:
        check_str(self, "host")
        check_int(self, "port", lo=0, hi=65535)
        check_str(self, "token", optional=True)
        check_str(self, "token_file", optional=True)
        if self.token is not None and self.token_file is not None:
            raise error("token_file", "is given together with token", "keep one of them")
        check_int(self, "max_body_bytes", lo=1024, hi=1 << 32)
        check_int(self, "max_rows_per_request", lo=1, hi=1 << 24)

    def read_token(self) -> str | None:
        """The bearer token, from ``token_file`` when set; None = no authentication."""
        if self.token_file is None:
            return self.token
        return read_secret_file(self.token_file, "api.token_file",
                                "write the token into the file")


@dataclass(frozen=True)
class RpcConfig(_Section):
    """``rpc``: bounds on the RPC connections of every role (embedding servers and
    workers; see :class:`stream_persia.rpc.server.ConnectionLimits`).

    Args:
        max_connections: connections one role accepts at once; more are refused
            (counted in ``persia_<role>_rpc_connections_refused_total``).
        idle_timeout_s: a connection with no request for this long is closed (clients
            reconnect by themselves; ``..._rpc_idle_closed_total``), and one whose peer
            takes none of its queued replies' bytes for this long is aborted
            (``..._rpc_write_stalled_total``); 0: never.
        handshake_timeout_s: how long a new connection may take to prove the role secret
            (``..._rpc_auth_refused_total`` counts the failures).
    """

    max_connections: int = 1024
    idle_timeout_s: int = 300
    handshake_timeout_s: int = 10

    def __post_init__(self) -> None:
        check_int(self, "max_connections", lo=1, hi=1 << 20)
        check_int(self, "idle_timeout_s", lo=0, hi=7 * 86_400, hint="seconds; 0: never")
        check_int(self, "handshake_timeout_s", lo=1, hi=600)


@dataclass(frozen=True)
class ModelUpdatesConfig(_Section):
    """``model_updates``: the versioned update stream from training to serving replicas.

    Args:
        enabled: publish updates at all; false turns every publisher off (the embedding
            servers' changed rows and NN rank 0's dense model).
        model_update_interval_ms: how often each embedding server publishes the rows
            changed since its last publication.
        dense_every_steps, dense_interval_ms: NN rank 0 publishes the dense model when
            either this many steps or this many milliseconds passed since its last
            publication, whichever comes first (:mod:`stream_persia.nn.dense_publisher`).
        max_dense_bytes: the largest serialized dense model: rank 0 sends none larger,
            embedding server 0 accepts and holds none larger
            (:mod:`stream_persia.server.dense_hub`).
        update_log_bytes: the most memory each embedding server's update log holds
            (:mod:`stream_persia.server.updates`); a replica that falls further behind
            asks for a full pass.
    """

    enabled: bool = True
    model_update_interval_ms: int = 200
    dense_every_steps: int = 10
    dense_interval_ms: int = 250
    max_dense_bytes: int = 1 << 30
    update_log_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_int(self, "model_update_interval_ms", lo=10, hi=60_000,
                  hint="milliseconds between two publications of a server's changed rows, "
                       "e.g. 200")
        check_int(self, "dense_every_steps", lo=1, hi=1 << 40,
                  hint="training steps between two publications of the dense model, e.g. 50")
        check_int(self, "dense_interval_ms", lo=100, hi=600_000,
                  hint="milliseconds between two publications of the dense model, e.g. 1000")
        check_int(self, "max_dense_bytes", lo=1 << 10, hi=1 << 40,
                  hint="bytes of the largest serialized dense model, e.g. 1073741824")
        check_int(self, "update_log_bytes", lo=1 << 20, hi=1 << 40,
                  hint="bytes of an embedding server's update log, e.g. 268435456")


@dataclass(frozen=True)
class ProgressiveConfig(_Section):
    """``progressive``: progressive validation on the NN workers
    (:mod:`stream_persia.nn.progressive`).

    Args:
        enabled: accumulate the metrics of every training batch (on by default; its cost
            is a copy of the predictions and labels and a few sums per step).
        window_samples: samples in the windowed metrics (AUC, NE, calibration, log loss),
            over every NN rank together; bounds their memory (5 bytes a sample per rank).
    """

    enabled: bool = True
    window_samples: int = 100_000

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_int(self, "window_samples", lo=1, hi=1 << 30,
                  hint="samples in the windowed progressive metrics, e.g. 100000")


@dataclass(frozen=True)
class AdmissionConfig(_Section):
    """``admission``: frequency admission on the embedding servers (a slot's
    ``min_count`` in ``embedding_config.yml``).

    Args:
        sketch_bytes: memory of each embedding server's count-min sketch, which counts the
            training lookups of ids not yet admitted; more bytes, fewer ids admitted early
            by a collision (the bound is in the store's docstring). It bounds the server
            whole: each of its ``store_threads`` internal shards gets ``sketch_bytes //
            store_threads``, at least ``MIN_SKETCH_BYTES`` (GlobalConfig checks it).
    """

    sketch_bytes: int = SKETCH_BYTES

    def __post_init__(self) -> None:
        check_int(self, "sketch_bytes", lo=MIN_SKETCH_BYTES, hi=MAX_SKETCH_BYTES,
                  hint="bytes of each embedding server's count-min sketch, e.g. 8388608")


@dataclass(frozen=True)
class GlobalConfig(_Section):
    """The parsed ``global_config.yml``; every section has defaults."""

    common_config: CommonConfig = field(default_factory=CommonConfig)
    embedding_parameter_server_config: EmbeddingParameterServerConfig = field(
        default_factory=EmbeddingParameterServerConfig)
    embedding_worker_config: EmbeddingWorkerConfig = field(
        default_factory=EmbeddingWorkerConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    rpc: RpcConfig = field(default_factory=RpcConfig)
    model_updates: ModelUpdatesConfig = field(default_factory=ModelUpdatesConfig)
    progressive: ProgressiveConfig = field(default_factory=ProgressiveConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    _NESTED: ClassVar[dict[str, type]] = {
        "common_config": CommonConfig,
        "embedding_parameter_server_config": EmbeddingParameterServerConfig,
        "embedding_worker_config": EmbeddingWorkerConfig,
        "kafka": KafkaConfig, "api": ApiConfig, "rpc": RpcConfig,
        "model_updates": ModelUpdatesConfig, "progressive": ProgressiveConfig,
        "admission": AdmissionConfig}
    _REJECTED: ClassVar[dict[str, str]] = {
        "middleware_config": "PERSIA renamed it embedding_worker_config",
        "shard_server_config": "PERSIA renamed it embedding_parameter_server_config",
        "embedding_server_config": "PERSIA renamed it embedding_parameter_server_config",
    }

    def __post_init__(self) -> None:
        for name, cls in self._NESTED.items():
            check_instance(self, name, cls)
        # Each internal shard of a server's store has a sketch of its own, within the
        # server's sketch_bytes (server.sharded): each needs at least MIN_SKETCH_BYTES.
        threads = self.embedding_parameter_server_config.store_threads
        if self.admission.sketch_bytes // threads < MIN_SKETCH_BYTES:
            raise error("admission.sketch_bytes",
                        f"{self.admission.sketch_bytes} bytes cannot be shared by the "
                        f"{threads} store_threads of embedding_parameter_server_config: each "
                        f"internal shard's sketch takes at least {MIN_SKETCH_BYTES} bytes",
                        f"raise it to at least {threads * MIN_SKETCH_BYTES} or lower "
                        f"store_threads")

    @property
    def job_type(self) -> str:
        return self.common_config.job_type

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> GlobalConfig:
        """Build from a parsed ``global_config.yml`` mapping; errors name ``source``."""
        try:
            return build(cls, _move_legacy_keys(d), "")
        except ConfigError as err:
            raise at_source(err, source) from None

    def to_dict(self, *, redact: bool = False) -> dict[str, Any]:
        """The mapping form (round-trips through :meth:`from_dict`); ``redact`` blanks
        secrets (Kafka password, API token)."""
        return section_to_dict(self, redact)

    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON of the redacted :meth:`to_dict`, so rotating
        a secret does not change it."""
        return canonical_digest(self.to_dict(redact=True))


def _move_legacy_keys(d: Any) -> Any:
    """PERSIA's older ``common_config.num_embedding_io_workers`` meant what
    ``checkpointing_config.num_workers`` means now: carry it over (a conflict is an error)."""
    if not isinstance(d, Mapping):
        return d
    common = d.get("common_config")
    if not isinstance(common, Mapping) or "num_embedding_io_workers" not in common:
        return d
    common = dict(common)
    value = common.pop("num_embedding_io_workers")
    ckpt = common.get("checkpointing_config")
    ckpt = dict(ckpt) if isinstance(ckpt, Mapping) else ({} if ckpt is None else ckpt)
    if isinstance(ckpt, dict):
        if "num_workers" in ckpt and ckpt["num_workers"] != value:
            raise error("common_config.num_embedding_io_workers",
                        f"is {value!r} but checkpointing_config.num_workers is "
                        f"{ckpt['num_workers']!r}",
                        "keep only common_config.checkpointing_config.num_workers")
        ckpt["num_workers"] = value
    common["checkpointing_config"] = ckpt
    return {**d, "common_config": common}
