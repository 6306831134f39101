"""Configuration: PERSIA's ``embedding_config.yml`` and ``global_config.yml``.

Both files keep PERSIA's keys and defaults so existing files load. They are read once at
the edge into frozen, validated dataclasses; unknown keys, wrong types and impossible
values raise :class:`~stream_persia.errors.ConfigError` naming the file, the key path, the
value received and the fix.

Where a path comes from: the explicit argument, else the environment variable
(``PERSIA_EMBEDDING_CONFIG`` / ``PERSIA_GLOBAL_CONFIG``), else an error naming it. Kafka's
bootstrap servers have their own precedence: :func:`resolve_bootstrap_servers`.

Example::

    schema = load_embedding_config("config/embedding_config.yml")
    ids = schema.prefix_ids("user_id", raw_ids)         # uint64, PERSIA's id spaces
    cfg = load_global_config()                          # $PERSIA_GLOBAL_CONFIG
    cfg.embedding_parameter_server_config.capacity
"""

from __future__ import annotations

import os

from stream_persia.config.embedding import (
    MAX_PREFIX_BIT,
    EmbeddingSchema,
    HashStackConfig,
    SlotConfig,
)
from stream_persia.config.files import parse_yaml, read_yaml
from stream_persia.config.global_config import (
    JOB_TYPES,
    AdmissionConfig,
    ApiConfig,
    CheckpointingConfig,
    CommonConfig,
    EmbeddingParameterServerConfig,
    EmbeddingWorkerConfig,
    GlobalConfig,
    InferConfig,
    MetricsConfig,
    ModelUpdatesConfig,
    ProgressiveConfig,
    RpcConfig,
)
from stream_persia.config.kafka import (
    ENV_KAFKA_BOOTSTRAP_SERVERS,
    KafkaConfig,
    resolve_bootstrap_servers,
)

__all__ = [
    "load_embedding_config", "load_global_config", "parse_yaml",
    "EmbeddingSchema", "SlotConfig", "HashStackConfig", "MAX_PREFIX_BIT",
    "GlobalConfig", "CommonConfig", "MetricsConfig", "CheckpointingConfig", "InferConfig",
    "EmbeddingParameterServerConfig", "EmbeddingWorkerConfig", "KafkaConfig", "ApiConfig",
    "RpcConfig", "ModelUpdatesConfig", "ProgressiveConfig", "AdmissionConfig", "JOB_TYPES", "resolve_bootstrap_servers",
    "ENV_EMBEDDING_CONFIG", "ENV_GLOBAL_CONFIG", "ENV_NN_WORKER_ENTRY",
    "ENV_DATALOADER_ENTRY", "ENV_KAFKA_BOOTSTRAP_SERVERS",
]

#: PERSIA's environment variables (DESIGN §4).
ENV_EMBEDDING_CONFIG = "PERSIA_EMBEDDING_CONFIG"
ENV_GLOBAL_CONFIG = "PERSIA_GLOBAL_CONFIG"
ENV_NN_WORKER_ENTRY = "PERSIA_NN_WORKER_ENTRY"
ENV_DATALOADER_ENTRY = "PERSIA_DATALOADER_ENTRY"


def load_embedding_config(path: str | os.PathLike[str] | None = None) -> EmbeddingSchema:
    """Read ``embedding_config.yml``.

    Args:
        path: the file; None reads the path from ``PERSIA_EMBEDDING_CONFIG``.

    Raises:
        ConfigError: no path, unreadable or invalid file; the message names the file and key.
    """
    data, source = read_yaml(path, "embedding_config", ENV_EMBEDDING_CONFIG)
    return EmbeddingSchema.from_dict(data, source=source)


def load_global_config(path: str | os.PathLike[str] | None = None) -> GlobalConfig:
    """Read ``global_config.yml``.

    Args:
        path: the file; None reads the path from ``PERSIA_GLOBAL_CONFIG``.

    Raises:
        ConfigError: no path, unreadable or invalid file; the message names the file and key.
    """
    data, source = read_yaml(path, "global_config", ENV_GLOBAL_CONFIG)
    return GlobalConfig.from_dict(data, source=source)
