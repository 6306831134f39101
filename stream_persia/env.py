"""PERSIA's ``persia.env``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.nn.env`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.nn.env import (  # noqa: F401
    get_local_rank,
    get_rank,
    get_replica_index,
    get_replica_size,
    get_world_size,
)

__all__ = ['get_local_rank', 'get_rank', 'get_replica_index', 'get_replica_size', 'get_world_size']
