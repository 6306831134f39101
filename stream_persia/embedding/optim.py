"""PERSIA's ``persia.embedding.optim``, re-exported from :mod:`stream_persia.core.optim` (pinned by tests/test_persia_paths.py)."""

from stream_persia.core.optim import *  # noqa: F403
from stream_persia.core.optim import __all__  # noqa: F401
