"""PERSIA's ``persia.data``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.nn.data`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.nn.data import (  # noqa: F401
    DataLoader,
    Dataloder,
    IterableDataset,
    IterableDatasetBase,
    PersiaDataset,
    StreamingDataset,
)

__all__ = ['DataLoader', 'Dataloder', 'IterableDataset', 'IterableDatasetBase', 'PersiaDataset', 'StreamingDataset']
