"""PERSIA's ``persia.embedding.data``, re-exported from :mod:`stream_persia.core.data` (pinned by tests/test_persia_paths.py)."""

from stream_persia.core.data import *  # noqa: F403
from stream_persia.core.data import __all__  # noqa: F401
