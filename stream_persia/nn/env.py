"""Where this process sits in the job (PERSIA's ``persia.env``).

NN workers are started by ``torchrun`` (``stream-persia launch nn-worker``), which sets
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; the other roles get ``REPLICA_INDEX`` and
``REPLICA_SIZE`` from their launcher. Unset variables mean a single process: rank 0 of 1.
Values are read on every call (cheap), so a test or a launcher that sets the environment
after import is honoured.
"""

from __future__ import annotations

import os

from stream_persia.errors import ConfigError

__all__ = ["get_local_rank", "get_rank", "get_replica_index", "get_replica_size",
           "get_world_size"]


def _int_env(name: str, default: int, lo: int) -> int:
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer",
                          field=name, hint=f"an integer >= {lo}") from None
    if value < lo:
        raise ConfigError(f"environment variable {name}={value} must be >= {lo}", field=name)
    return value


def get_world_size() -> int:
    """Number of NN worker processes in the job (env ``WORLD_SIZE``; default 1)."""
    return _int_env("WORLD_SIZE", 1, 1)


def get_rank() -> int:
    """Global rank of this NN worker process (env ``RANK``; default 0).

    Raises:
        ConfigError: ``RANK`` is not in ``[0, WORLD_SIZE)``.
    """
    rank = _int_env("RANK", 0, 0)
    world = get_world_size()
    if rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}", field="RANK")
    return rank


def get_local_rank() -> int:
    """Rank of this process on its node (env ``LOCAL_RANK``; default 0): its CUDA device."""
    return _int_env("LOCAL_RANK", 0, 0)


def get_replica_size() -> int:
    """Replicas of this role (env ``REPLICA_SIZE``, else ``WORLD_SIZE``; default 1)."""
    if os.environ.get("REPLICA_SIZE", "").strip():
        return _int_env("REPLICA_SIZE", 1, 1)
    return get_world_size()


def get_replica_index() -> int:
    """Index of this replica (env ``REPLICA_INDEX``, else ``RANK``; default 0).

    Raises:
        ConfigError: the index is not in ``[0, replica size)``.
    """
    if os.environ.get("REPLICA_INDEX", "").strip():
        index, name = _int_env("REPLICA_INDEX", 0, 0), "REPLICA_INDEX"
    else:
        index, name = get_rank(), "RANK"
    size = get_replica_size()
    if index >= size:
        raise ConfigError(f"{name}={index} is not below the replica size {size}", field=name)
    return index
