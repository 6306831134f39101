"""Settings of the API process, resolved once at the edge from config, environment and flags.

Precedence for every value: the explicit argument (CLI flag), then the environment, then
``global_config.yml``'s ``api`` section (:class:`~stream_persia.config.ApiConfig`), then the
default. Environment variables:

- ``PERSIA_API_TOKEN`` / ``PERSIA_API_TOKEN_FILE``: the bearer token (inline or a mounted
  secret file); they override ``api.token`` / ``api.token_file``.
- ``PERSIA_API_PREDICT_AUTH=1``: ``POST /v1/predict`` requires the token too.
- ``PERSIA_EMBEDDING_WORKERS`` / ``PERSIA_EMBEDDING_SERVERS``: role addresses.
- ``PERSIA_EMBEDDING_CONFIG``: the embedding schema that inference requests are checked
  against.
- ``PERSIA_CHECKPOINT_DIR``: where checkpoints started over HTTP are written and listed.
- ``PERSIA_API_MODEL``: the checkpoint served at start-up; ``PERSIA_API_MODEL_CLASS``
  (``module:Class``) when it holds no TorchScript ``jit_dense.pt``;
  ``PERSIA_API_EMBEDDINGS`` = ``workers`` | ``local`` (where served embeddings come from).
- ``PERSIA_API_TORCH_THREADS``: torch's intra-op threads in the API process (default 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from stream_persia.config import (
    ApiConfig,
    CheckpointingConfig,
    EmbeddingParameterServerConfig,
    EmbeddingSchema,
    GlobalConfig,
    KafkaConfig,
    load_embedding_config,
)
from stream_persia.config.files import read_secret_file
from stream_persia.config.kafka import resolve_bootstrap_servers, resolve_idempotence
from stream_persia.core.embedding_config import MAX_CAPACITY
from stream_persia.core.hosts import is_loopback
from stream_persia.core.secret_rule import check_secret
from stream_persia.errors import ConfigError

__all__ = ["ApiSettings", "EMBEDDING_SOURCES"]

EMBEDDING_SOURCES = ("auto", "workers", "local", "replica")
#: Where a serving replica reads the update stream: Kafka when the job has brokers (auto).
UPDATE_SOURCES = ("auto", "rpc", "kafka")


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _env_list(name: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in (_env(name) or "").split(",") if a.strip())


def _env_bool(name: str) -> bool | None:
    raw = _env(name)
    if raw is None:
        return None
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a boolean", field=name,
                      hint="use 1/0, true/false, yes/no or on/off")


def _read_token_file(path: str, where: str) -> str:
    return read_secret_file(path, where, "write the token into the file")


@dataclass(frozen=True)
class ApiSettings:
    """Everything :func:`api.create_app` needs.

    Args:
        host, port: where uvicorn binds (used for the loopback check and by ``launch api``).
        token: bearer token for control and checkpoint routes, at least
            :data:`~stream_persia.core.secret_rule.MIN_SECRET_CHARS` characters (the role
            secret's rule); None = no authentication, which is refused unless ``host`` is a
            loopback address.
        predict_requires_token: ``POST /v1/predict`` needs the token as well.
        max_body_bytes: larger request bodies get 413.
        max_rows_per_request: more samples in one inference request get 413.
        embedding_workers, embedding_servers: role addresses (``host:port``).
        schema: the embedding schema inference requests are validated against (None:
            inference is unavailable until one is given).
        checkpoint_dir: root of checkpoints started over HTTP (None: those routes 409),
            and the only place a request may name a checkpoint in (reload, restore,
            delete; :mod:`stream_persia.api.checkpoint_root`).
        keep_checkpoints: complete checkpoints kept under ``checkpoint_dir`` after each
            one the API takes (0: every one); ``common_config.checkpointing_config
            .keep_checkpoints``.
        model_checkpoint: checkpoint served at start-up (None: no model until a reload).
        model_class: ``module:Class`` of the dense model when the checkpoint holds no
            ``jit_dense.pt``.
        embeddings: ``workers`` (lookups through the embedding workers), ``local`` (a
            read-only store loaded from the checkpoint in this process) or ``auto``
            (workers when any are configured, else local).
        rpc_timeout_ms: deadline of one RPC to a role.
        batch_wait_ms, max_batch_rows: micro-batching: concurrent inference requests are
            collected for up to ``batch_wait_ms`` or ``max_batch_rows`` rows.
        predict_timeout_ms: an inference request waiting longer gets 503.
        inline_max_rows: micro-batches of at most this many samples are computed on the
            event loop instead of the forward thread (0: always the thread).
        torch_threads: intra-op threads of torch in this process. 1 by default: requests
            are small, and torch's thread pool spinning against the event loop and the
            other roles on the same cores costs far more than it saves (a 4-request
            pooling pass measured 27 ms with 2 threads on 2 busy cores, 0.5 ms with 1).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = field(default=None, repr=False)
    predict_requires_token: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    max_rows_per_request: int = 10_000
    embedding_workers: tuple[str, ...] = ()
    embedding_servers: tuple[str, ...] = ()
    schema: EmbeddingSchema | None = None
    checkpoint_dir: str | None = None
    keep_checkpoints: int = CheckpointingConfig.keep_checkpoints
    model_checkpoint: str | None = None
    model_class: str | None = None
    embeddings: str = "auto"
    rpc_timeout_ms: int = 10_000
    batch_wait_ms: float = 2.0
    max_batch_rows: int = 1024
    predict_timeout_ms: int = 30_000
    torch_threads: int = 1
    inline_max_rows: int = 16
    table_rows: int | None = None
    updates: str = "auto"
    global_config: GlobalConfig | None = None

    def __post_init__(self) -> None:
        if self.embeddings not in EMBEDDING_SOURCES:
            raise ConfigError(f"embeddings must be one of {EMBEDDING_SOURCES}, got "
                              f"{self.embeddings!r}", field="embeddings")
        if self.token is not None:
            check_secret(self.token, "token", "the API token")
        for name in ("max_body_bytes", "max_rows_per_request", "rpc_timeout_ms",
                     "max_batch_rows", "predict_timeout_ms", "torch_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", field=name)
        if isinstance(self.keep_checkpoints, bool) or not isinstance(self.keep_checkpoints,
                                                                     int) \
                or self.keep_checkpoints < 0:
            raise ConfigError(f"keep_checkpoints must be an integer >= 0, got "
                              f"{self.keep_checkpoints!r}", field="keep_checkpoints")
        if isinstance(self.inline_max_rows, bool) or not isinstance(self.inline_max_rows, int) \
                or self.inline_max_rows < 0:
            raise ConfigError(f"inline_max_rows must be an integer >= 0, got "
                              f"{self.inline_max_rows!r}", field="inline_max_rows")
        if not (0 <= float(self.batch_wait_ms) <= 1000):
            raise ConfigError(f"batch_wait_ms must be in [0, 1000], got {self.batch_wait_ms!r}",
                              field="batch_wait_ms")
        if self.embeddings == "replica" and not self.embedding_servers:
            raise ConfigError("a serving replica follows the embedding servers' updates: "
                              "none are configured", field="PERSIA_EMBEDDING_SERVERS",
                              hint="set PERSIA_EMBEDDING_SERVERS=host:port[,...]")
        if self.updates not in UPDATE_SOURCES:
            raise ConfigError(f"updates must be one of {UPDATE_SOURCES}, got "
                              f"{self.updates!r}", field="PERSIA_API_UPDATES")
        if self.updates == "kafka" and self._bootstrap() is None:
            raise ConfigError("a replica following Kafka needs the job's brokers",
                              field="PERSIA_API_UPDATES",
                              hint="set kafka.bootstrap_servers or KAFKA_BOOTSTRAP_SERVERS")
        if self.table_rows is not None and (isinstance(self.table_rows, bool)
                                            or not isinstance(self.table_rows, int)
                                            or not 1 <= self.table_rows <= MAX_CAPACITY):
            raise ConfigError(f"table_rows must be an int in [1, {MAX_CAPACITY}], got "
                              f"{self.table_rows!r}", field="PERSIA_API_TABLE_ROWS")
        if self.model_class is not None and ":" not in self.model_class:
            raise ConfigError(f"model_class must be 'module:Class', got {self.model_class!r}",
                              field="model_class", hint="e.g. 'my_model:DNN'")

    def _bootstrap(self) -> str | None:
        return resolve_bootstrap_servers(self.global_config, None)

    def updates_kafka(self) -> tuple[str, str, dict[str, Any], bool] | None:
        """(bootstrap servers, update topic, security settings, producer idempotence) when
        a replica follows Kafka (``updates`` kafka, or auto with brokers configured), else
        None (RPC)."""
        if self.updates == "rpc":
            return None
        bootstrap = self._bootstrap()
        if bootstrap is None:
            return None
        from stream_persia.kafka.updates import updates_topic

        kafka = self.global_config.kafka if self.global_config is not None else KafkaConfig()
        return (bootstrap, updates_topic(kafka.job_name), kafka.security_kwargs(),
                resolve_idempotence(kafka))

    def replica_rows(self) -> int:
        """Rows a serving replica's table holds: ``table_rows``, else what the servers may
        hold together (their capacity times their number)."""
        if self.table_rows is not None:
            return self.table_rows
        gc = self.global_config
        per = (gc.embedding_parameter_server_config.capacity if gc is not None
               else EmbeddingParameterServerConfig.capacity)
        return min(MAX_CAPACITY, per * max(1, len(self.embedding_servers)))

    @property
    def job_name(self) -> str:
        """The job's name (``kafka.job_name``): what its checkpoints record as ``job``."""
        kafka = self.global_config.kafka if self.global_config is not None else KafkaConfig()
        return kafka.job_name

    @property
    def source(self) -> str:
        """The embedding source actually used (``auto`` resolved)."""
        if self.embeddings != "auto":
            return self.embeddings
        return "workers" if self.embedding_workers else "local"

    def check_bind(self) -> None:
        """Refuse to serve control routes without a token on a non-loopback address.

        Raises:
            ConfigError: no token is configured and ``host`` is not loopback.
        """
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(
                f"the API would listen on {self.host} without a token: control and checkpoint "
                f"routes would be open to the network", field="api.token",
                hint="set PERSIA_API_TOKEN or PERSIA_API_TOKEN_FILE (or api.token / "
                     "api.token_file), or bind to 127.0.0.1")

    @classmethod
    def from_env(cls, global_config: GlobalConfig | None = None, **overrides: Any
                 ) -> ApiSettings:
        """Build settings from the environment and ``global_config``'s ``api`` section.

        Keyword arguments override both (None values are ignored, so CLI flags that were
        not given can be passed through as they are).
        """
        api = global_config.api if global_config is not None else ApiConfig()
        token = None
        env_token, env_file = _env("PERSIA_API_TOKEN"), _env("PERSIA_API_TOKEN_FILE")
        if env_token is not None and env_file is not None:
            raise ConfigError("both PERSIA_API_TOKEN and PERSIA_API_TOKEN_FILE are set",
                              field="PERSIA_API_TOKEN", hint="keep one of them")
        if env_token is not None:
            token, source = env_token, "PERSIA_API_TOKEN"
        elif env_file is not None:
            token, source = _read_token_file(env_file, "PERSIA_API_TOKEN_FILE"), \
                "PERSIA_API_TOKEN_FILE"
        else:
            token = api.read_token()
            source = "api.token_file" if api.token_file is not None else "api.token"
        if token is not None:   # the same rule as the role secret, naming where it was set
            token = check_secret(token, source, "the API token")
        values: dict[str, Any] = {
            "host": api.host, "port": api.port, "token": token,
            "max_body_bytes": api.max_body_bytes,
            "max_rows_per_request": api.max_rows_per_request,
            "embedding_workers": _env_list("PERSIA_EMBEDDING_WORKERS"),
            "embedding_servers": (_env_list("PERSIA_EMBEDDING_SERVERS")
                                  or (global_config.common_config.infer_config.servers
                                      if global_config is not None else ())),
            "checkpoint_dir": _env("PERSIA_CHECKPOINT_DIR"),
            "model_checkpoint": _env("PERSIA_API_MODEL"),
            "model_class": _env("PERSIA_API_MODEL_CLASS"),
            "embeddings": _env("PERSIA_API_EMBEDDINGS") or "auto",
            "updates": _env("PERSIA_API_UPDATES") or "auto",
            "global_config": global_config,
        }
        threads = _env("PERSIA_API_TORCH_THREADS")
        if threads is not None:
            if not threads.isdigit() or int(threads) < 1:
                raise ConfigError(f"PERSIA_API_TORCH_THREADS={threads!r} is not an integer "
                                  f">= 1", field="PERSIA_API_TORCH_THREADS")
            values["torch_threads"] = int(threads)
        rows = _env("PERSIA_API_TABLE_ROWS")
        if rows is not None:
            if not rows.isdigit():
                raise ConfigError(f"PERSIA_API_TABLE_ROWS={rows!r} is not an integer",
                                  field="PERSIA_API_TABLE_ROWS")
            values["table_rows"] = int(rows)
        predict_auth = _env_bool("PERSIA_API_PREDICT_AUTH")
        if predict_auth is not None:
            values["predict_requires_token"] = predict_auth
        if global_config is not None:
            values["rpc_timeout_ms"] = global_config.embedding_worker_config.rpc_timeout_ms
            values["keep_checkpoints"] = (global_config.common_config.checkpointing_config
                                          .keep_checkpoints)
        if "schema" not in overrides and _env("PERSIA_EMBEDDING_CONFIG") is not None:
            values["schema"] = load_embedding_config()
        values.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("embedding_workers", "embedding_servers"):
            values[key] = tuple(values[key])
        return cls(**values)
