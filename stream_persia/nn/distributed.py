"""Data parallelism of the dense part across NN workers (PERSIA's ``persia.distributed``).

The dense model trains synchronously: :class:`DDPOption` wraps it in PyTorch's
``DistributedDataParallel``, which all-reduces gradients on every backward. The process
group comes from the environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); ``stream-persia launch nn-worker``
runs torchrun for you.

PERSIA also offered Bagua. Bagua is not supported here: :class:`BaguaDistributedOption`
exists so that ported code fails at once with a message saying what to use instead.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

from stream_persia.errors import ConfigError

__all__ = ["BaguaDistributedOption", "DDPOption", "DistributedBaseOption",
           "get_default_distributed_option"]

log = logging.getLogger(__name__)

_INIT_METHODS = ("tcp", "env", "file")
_BACKENDS = ("nccl", "gloo")


class DistributedBaseOption:
    """Base of the data-parallel options accepted by ``TrainCtx(distributed_option=...)``."""

    def init_process_group(self, rank: int, world_size: int, device_id: int | None,
                           timeout_s: float = 1800.0) -> bool:
        """Join the job's process group; returns True when this call created it."""
        raise NotImplementedError

    def convert2distributed_model(self, model: Any, device_id: int | None) -> Any:
        """Wrap ``model`` for synchronous data-parallel training."""
        raise NotImplementedError


class DDPOption(DistributedBaseOption):
    """PyTorch DistributedDataParallel for the dense part.

    Args:
        initialization_method: how ranks find each other: ``"tcp"`` (``tcp://MASTER_ADDR:
            MASTER_PORT``, PERSIA's default), ``"env"`` (``env://``) or ``"file"``
            (``file://<init_file>``). PERSIA's docs also spell it ``init_method``; both work.
        backend: ``"nccl"`` or ``"gloo"``. PERSIA defaulted to nccl, which cannot run
            without CUDA; None here picks nccl on CUDA and gloo on CPU.
        init_file: the shared file for ``initialization_method="file"``.
        **options: passed to ``torch.nn.parallel.DistributedDataParallel`` (for example
            ``find_unused_parameters=True``, ``bucket_cap_mb=50``).

    Raises:
        ConfigError: unknown method or backend, or ``"file"`` without ``init_file``.
    """

    def __init__(self, initialization_method: str = "tcp", backend: str | None = None,
                 init_file: str | None = None, **options: Any):
        if "init_method" in options:
            initialization_method = options.pop("init_method")
        if initialization_method not in _INIT_METHODS:
            raise ConfigError(f"DDPOption initialization_method must be one of "
                              f"{_INIT_METHODS}, got {initialization_method!r}",
                              field="initialization_method")
        if backend is not None and backend not in _BACKENDS:
            raise ConfigError(f"DDPOption backend must be one of {_BACKENDS} (or None: nccl "
                              f"on CUDA, gloo on CPU), got {backend!r}", field="backend")
        if initialization_method == "file" and not init_file:
            raise ConfigError("DDPOption(initialization_method='file') needs init_file, a "
                              "path every rank can reach", field="init_file")
        self.initialization_method = initialization_method
        self.backend = backend
        self.init_file = init_file
        self.options = options

    def __repr__(self) -> str:
        return (f"DDPOption(initialization_method={self.initialization_method!r}, "
                f"backend={self.backend!r}, options={self.options!r})")

    def resolve_backend(self, device_id: int | None) -> str:
        """The backend this option uses on ``device_id`` (None: CPU)."""
        backend = self.backend or ("nccl" if device_id is not None else "gloo")
        if backend == "nccl" and device_id is None:
            raise ConfigError("DDPOption(backend='nccl') needs CUDA, but the NN worker runs "
                              "on CPU (device_id=None)", field="backend",
                              hint="use backend='gloo' on CPU, or pass device_id")
        return backend

    def _init_url(self) -> str:
        if self.initialization_method == "env":
            return "env://"
        if self.initialization_method == "file":
            return f"file://{os.path.abspath(str(self.init_file))}"
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT", "")
        if not port.isdigit():
            raise ConfigError(f"MASTER_PORT={port!r}: DDP over tcp needs the rendezvous port",
                              field="MASTER_PORT",
                              hint="launch with `stream-persia launch nn-worker` (torchrun "
                                   "sets it) or export MASTER_ADDR and MASTER_PORT")
        return f"tcp://{addr}:{port}"

    def init_process_group(self, rank: int, world_size: int, device_id: int | None,
                           timeout_s: float = 1800.0) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise ConfigError(
                    f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) "
                    f"already exists, but this NN worker is rank {rank} of {world_size}",
                    field="WORLD_SIZE")
            return False
        backend = self.resolve_backend(device_id)
        url = self._init_url()
        log.info("joining the process group: rank %d of %d, %s over %s", rank, world_size,
                 backend, url)
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return True

    def convert2distributed_model(self, model: Any, device_id: int | None) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        if device_id is not None:
            return DistributedDataParallel(model, device_ids=[device_id],
                                           output_device=device_id, **self.options)
        return DistributedDataParallel(model, **self.options)


class BaguaDistributedOption(DistributedBaseOption):
    """PERSIA's Bagua option; not supported by stream-persia (raises at construction).

    Raises:
        ConfigError: always, naming the supported alternative.
    """

    def __init__(self, algorithm: str, **options: Any):
        raise ConfigError(
            f"BaguaDistributedOption(algorithm={algorithm!r}) is not supported: "
            "stream-persia trains the dense part with PyTorch DDP only",
            field="distributed_option",
            hint="use stream_persia.nn.distributed.DDPOption() (the default when WORLD_SIZE > 1)")


def get_default_distributed_option(device_id: int | None = None) -> DDPOption:
    """DDP over tcp: nccl on CUDA (``device_id`` given), gloo on CPU."""
    return DDPOption(initialization_method="tcp",
                     backend="nccl" if device_id is not None else "gloo")
