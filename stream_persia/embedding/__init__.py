"""PERSIA's ``persia.embedding``, re-exported from :mod:`stream_persia.core.embedding_config` (pinned by tests/test_persia_paths.py)."""

from stream_persia.core.embedding_config import MAX_CAPACITY, EmbeddingConfig  # noqa: F401

__all__ = ['MAX_CAPACITY', 'EmbeddingConfig']
