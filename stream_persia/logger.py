"""PERSIA's ``persia.logger``: a re-export, so that a PERSIA job ports by changing its import root.

The code lives in :mod:`stream_persia.core.logger`; this module only names it under PERSIA's path
(pinned by ``tests/test_persia_paths.py``).
"""

from stream_persia.core.logger import (  # noqa: F401
    DEFAULT_LOGGER_NAME,
    RepeatFilter,
    get_default_logger,
    get_logger,
)

__all__ = ['DEFAULT_LOGGER_NAME', 'RepeatFilter', 'get_default_logger', 'get_logger']
