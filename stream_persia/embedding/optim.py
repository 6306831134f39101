"""PERSIA's ``persia.embedding.optim``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.core.optim`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.core.optim import (  # noqa: F401
    SGD,
    Adagrad,
    Adam,
    Optimizer,
    as_optimizer,
    optimizer_from_dict,
)

__all__ = ['SGD', 'Adagrad', 'Adam', 'Optimizer', 'as_optimizer', 'optimizer_from_dict']
