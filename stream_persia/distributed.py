"""PERSIA's ``persia.distributed``, re-exported from :mod:`stream_persia.nn.distributed` (pinned by tests/test_persia_paths.py)."""

from stream_persia.nn.distributed import *  # noqa: F403
from stream_persia.nn.distributed import __all__  # noqa: F401
