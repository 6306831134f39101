"""PERSIA's ``persia.data``, re-exported from :mod:`stream_persia.nn.data` (pinned by tests/test_persia_paths.py)."""

from stream_persia.nn.data import *  # noqa: F403
from stream_persia.nn.data import __all__  # noqa: F401
