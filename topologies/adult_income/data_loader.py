"""Data loader of the Adult income job: the training split, reshuffled every epoch.

Reads ``adult.data``/``adult.test`` from ``--data-dir`` (env ``STREAM_PERSIA_DATA``;
default ``<project>/../shared/data/adult``), fits the vocabulary on the training split
(``prepare.py``) and sends ``epochs`` passes over it, each in a fresh seeded order. Data
loader ``i`` of ``n`` sends the batches ``b`` of each epoch with ``b % n == i``, so the
job sees the same batches whatever the number of data loaders.

    PERSIA_EMBEDDING_WORKERS=127.0.0.1:9001 python data_loader.py --epochs 1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
from prepare import CATEGORICAL, Split, load, resolve_data_dir  # noqa: E402

from stream_persia.ctx import DataCtx  # noqa: E402
from stream_persia.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from stream_persia.env import get_replica_index, get_replica_size  # noqa: E402


def to_persia_batch(split: Split, *, requires_grad: bool = True) -> PersiaBatch:
    """One batch: an id per categorical slot, the numerics, the income label."""
    ids = [IDTypeFeatureWithSingleID(name, np.ascontiguousarray(split.ids[:, k]))
           for k, name in enumerate(CATEGORICAL)]
    return PersiaBatch(ids, non_id_type_features=[NonIDTypeFeature(split.dense, "numeric")],
                       labels=[Label(split.label.reshape(-1, 1), "income")],
                       requires_grad=requires_grad)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch (identical in every data loader replica)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    index, size = get_replica_index(), get_replica_size()
    role = f"data-loader-{index}"
    train, _test, _ = load(resolve_data_dir(settings.data))
    n = min(settings.samples, len(train)) if settings.samples else len(train)
    bs = settings.batch_size
    common.log(role, f"sending {n} training rows x {settings.epochs} epoch(s) in batches of "
                     f"{bs} (replica {index} of {size})")
    t0 = time.monotonic()
    sent = 0
    with DataCtx() as ctx:
        for epoch in range(settings.epochs):
            order = epoch_order(n, settings.seed, epoch)
            for b in range(index, common.num_batches(n, bs), size):
                ctx.send_data(to_persia_batch(train.take(order[b * bs:(b + 1) * bs])))
                sent += min(bs, n - b * bs)
    common.log(role, f"sent {sent} samples in {time.monotonic() - t0:.1f}s via {ctx.mode}")


if __name__ == "__main__":
    main()
