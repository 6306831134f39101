"""Labelled held-out batches for ``stream-persia run`` to predict through the API.

``eval_batches(n)`` yields the first ``n`` samples of the eval split (the same samples
``train.py`` evaluates on), as ``PersiaBatch``es with labels.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
from generator import ClickStream, to_persia_batch  # noqa: E402

BATCH = 1024


def eval_batches(n: int) -> Iterator:
    settings = common.load_settings(HERE, [])
    stream = ClickStream(seed=settings.seed)
    for start in range(0, n, BATCH):
        yield to_persia_batch(stream.eval_samples(min(BATCH, n - start), start), stream.slots,
                              requires_grad=False)
