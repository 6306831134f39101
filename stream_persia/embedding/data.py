"""PERSIA's ``persia.embedding.data``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.core.data`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.core.data import (  # noqa: F401
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)

__all__ = ['IDTypeFeature', 'IDTypeFeatureWithSingleID', 'Label', 'NonIDTypeFeature', 'PersiaBatch']
