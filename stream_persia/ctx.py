"""PERSIA's contexts (``persia.ctx``): the entry points of data loaders and NN workers.

``DataCtx`` (data loaders) is imported eagerly; the NN worker contexts (``TrainCtx``,
``EmbeddingCtx``, ``eval_ctx``, ``InferCtx``, ``PreprocessMode``) on first use, so that a
data loader process never pays for importing torch.
"""

from typing import TYPE_CHECKING, Any

from stream_persia.loader.data_ctx import DataCtx

if TYPE_CHECKING:  # resolved lazily by __getattr__ below
    from stream_persia.nn.embedding_ctx import EmbeddingCtx, InferCtx, PreprocessMode, eval_ctx
    from stream_persia.nn.embedding_ctx import current_ctx as cnt_ctx
    from stream_persia.nn.train_ctx import TrainCtx

__all__ = ["DataCtx", "EmbeddingCtx", "InferCtx", "PreprocessMode", "TrainCtx", "cnt_ctx",
           "eval_ctx"]

# PERSIA's name -> the name stream_persia.nn (which resolves its own names lazily) gives it
_NN = {"TrainCtx": "TrainCtx", "EmbeddingCtx": "EmbeddingCtx", "InferCtx": "InferCtx",
       "PreprocessMode": "PreprocessMode", "eval_ctx": "eval_ctx", "cnt_ctx": "current_ctx"}


def __getattr__(name: str) -> Any:
    if name in _NN:
        import stream_persia.nn

        value = getattr(stream_persia.nn, _NN[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stream_persia.ctx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
