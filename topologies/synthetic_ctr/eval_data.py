"""Labelled held-out batches for ``stream-persia run`` to predict through the API.

``eval_batches(n)`` yields the first ``n`` samples of the eval split (the same samples
``train.py`` evaluates on), as ``PersiaBatch``es with labels. ``concept_shift_probe(n)``
gives held-out samples whose hidden CTR the concept shift changes (when
``STREAM_PERSIA_CONCEPT_SHIFT_AT`` turns it on; None otherwise) and their Bayes CTR after it.
Both use the job's stream (``generator.ClickStream.from_env``): the eval split lies after
any concept shift, so with one it holds the concept after the shift.
"""

from __future__ import annotations

import dataclasses
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
    stream = ClickStream.from_env(settings.seed)
    for start in range(0, n, BATCH):
        yield to_persia_batch(stream.eval_samples(min(BATCH, n - start), start), stream.slots,
                              requires_grad=False)


def concept_shift_probe(n: int) -> dict | None:
    settings = common.load_settings(HERE, [])
    stream = ClickStream.from_env(settings.seed)
    if stream.shift_at < 0:
        return None
    probe = stream.shift_probe(n)
    before = dataclasses.replace(stream, shift_at=-1).samples_at(probe.index)
    return {"sample": stream.shift_at, "batches": [to_persia_batch(probe, stream.slots,
                                                            requires_grad=False)],
            "bayes_before": float(before.p.mean()), "bayes_after": float(probe.p.mean())}
