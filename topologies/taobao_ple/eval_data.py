"""Labelled eval batches (click and buy) for ``stream-persia run`` to predict through the API.

``eval_batches(n)`` yields the first ``n`` rows of the eval split that ``train.py``
evaluates on: generated rows, or the held-out part of ``--data-file``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import source  # noqa: E402
from schema import to_persia_batch  # noqa: E402

BATCH = 2048


def eval_batches(n: int) -> Iterator:
    data = source.plan(common.load_settings(HERE, []))
    data = dataclasses.replace(data, eval_rows=min(n, data.eval_rows))
    for chunk in data.eval_batches(BATCH):
        yield to_persia_batch(chunk, requires_grad=False)
