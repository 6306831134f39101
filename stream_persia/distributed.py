"""PERSIA's ``persia.distributed``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.nn.distributed`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.nn.distributed import (  # noqa: F401
    BaguaDistributedOption,
    DDPOption,
    DistributedBaseOption,
    get_default_distributed_option,
)

__all__ = ['BaguaDistributedOption', 'DDPOption', 'DistributedBaseOption', 'get_default_distributed_option']
