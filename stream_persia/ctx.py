"""PERSIA's contexts (``persia.ctx``): the entry points of data loaders and NN workers."""

from stream_persia.data_ctx import DataCtx

__all__ = ["DataCtx"]
