"""PERSIA's ``persia.logger``, re-exported from :mod:`stream_persia.core.logger` (pinned by tests/test_persia_paths.py)."""

from stream_persia.core.logger import *  # noqa: F403
from stream_persia.core.logger import __all__  # noqa: F401
