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

_NN = {"TrainCtx": "train_ctx", "EmbeddingCtx": "embedding_ctx", "InferCtx": "embedding_ctx",
       "PreprocessMode": "embedding_ctx", "eval_ctx": "embedding_ctx",
       "cnt_ctx": "embedding_ctx"}


def __getattr__(name: str) -> Any:
    if name in _NN:
        import importlib

        module = importlib.import_module(f"stream_persia.nn.{_NN[name]}")
        value = getattr(module, "current_ctx" if name == "cnt_ctx" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stream_persia.ctx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
