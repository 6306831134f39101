"""PERSIA's ``persia.embedding``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.core.embedding_config`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.core.embedding_config import (  # noqa: F401
    MAX_CAPACITY,
    EmbeddingConfig,
)

__all__ = ['MAX_CAPACITY', 'EmbeddingConfig']
