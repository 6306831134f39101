"""PERSIA's ``persia.utils``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.nn.utils`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.nn.utils import (  # noqa: F401
    find_free_port,
    roc_auc,
    setup_seed,
)

__all__ = ['find_free_port', 'roc_auc', 'setup_seed']
