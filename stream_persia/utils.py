"""PERSIA's ``persia.utils``, re-exported from :mod:`stream_persia.nn.utils` (pinned by tests/test_persia_paths.py)."""

from stream_persia.nn.utils import find_free_port, roc_auc, setup_seed  # noqa: F401

__all__ = ['find_free_port', 'roc_auc', 'setup_seed']
