"""PERSIA's ``persia.env``, re-exported from :mod:`stream_persia.nn.env` (pinned by tests/test_persia_paths.py)."""

from stream_persia.nn.env import *  # noqa: F403
from stream_persia.nn.env import __all__  # noqa: F401
