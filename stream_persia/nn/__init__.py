"""The NN worker side: PERSIA's training API on stream-persia's runtime.

- :mod:`~stream_persia.nn.batch`: ``PersiaTrainingBatch`` (a served batch as tensors).
- :mod:`~stream_persia.nn.cluster`: the context's RPC clients and loop thread.
- :mod:`~stream_persia.nn.loader`: prefetching under the staleness bound.
- :mod:`~stream_persia.nn.embedding_ctx`: ``EmbeddingCtx``, ``eval_ctx``, ``InferCtx``.
- :mod:`~stream_persia.nn.train_ctx`: ``TrainCtx`` (backward, DDP, mixed precision).
- :mod:`~stream_persia.nn.checkpointing`: consistent checkpoints from the NN side.
- :mod:`~stream_persia.nn.checkpoint_poller`: checkpoints requested over HTTP, taken at a
  step boundary.
- :mod:`~stream_persia.nn.seams`: the contexts as checkpoints, the poller and the
  DataLoader see them (Protocols), so that those import no context.

Users import these from :mod:`stream_persia.ctx` and :mod:`stream_persia.data`. The names
below resolve on first use, so that importing a torch-free module of this package
(:mod:`~stream_persia.nn.env`, :mod:`~stream_persia.nn.utils`: PERSIA's ``persia.env`` and
``persia.utils``, which data loaders use) does not import torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stream_persia.nn.batch import EmbeddingSlot, PersiaTrainingBatch
    from stream_persia.nn.embedding_ctx import (
        EmbeddingCtx,
        InferCtx,
        PreprocessMode,
        current_ctx,
        eval_ctx,
    )
    from stream_persia.nn.train_ctx import TrainCtx

_HOMES = {"EmbeddingSlot": "batch", "PersiaTrainingBatch": "batch",
          "EmbeddingCtx": "embedding_ctx", "InferCtx": "embedding_ctx",
          "PreprocessMode": "embedding_ctx", "current_ctx": "embedding_ctx",
          "eval_ctx": "embedding_ctx", "TrainCtx": "train_ctx"}

__all__ = ["EmbeddingCtx", "EmbeddingSlot", "InferCtx", "PersiaTrainingBatch",
           "PreprocessMode", "TrainCtx", "current_ctx", "eval_ctx"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(f"stream_persia.nn.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
