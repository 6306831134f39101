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

Users import these from :mod:`stream_persia.ctx` and :mod:`stream_persia.nn.data`.
"""

from stream_persia.nn.batch import EmbeddingSlot, PersiaTrainingBatch
from stream_persia.nn.embedding_ctx import (
    EmbeddingCtx,
    InferCtx,
    PreprocessMode,
    current_ctx,
    eval_ctx,
)
from stream_persia.nn.train_ctx import TrainCtx

__all__ = ["EmbeddingCtx", "EmbeddingSlot", "InferCtx", "PersiaTrainingBatch",
           "PreprocessMode", "TrainCtx", "current_ctx", "eval_ctx"]
