"""Labelled test-split batches for ``stream-persia run`` to predict through the API.

``eval_batches(n)`` yields the first ``n`` rows of ``adult.test``, encoded with the
vocabulary fitted on ``adult.data`` (the same rows ``train.py`` evaluates on).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from data_loader import to_persia_batch  # noqa: E402
from prepare import load, resolve_data_dir  # noqa: E402

BATCH = 2048


def eval_batches(n: int) -> Iterator:
    settings = common.load_settings(HERE, [])
    _, test, _ = load(resolve_data_dir(settings.data))
    n = min(n, len(test))
    for lo in range(0, n, BATCH):
        yield to_persia_batch(test.take(slice(lo, min(lo + BATCH, n))), requires_grad=False)
