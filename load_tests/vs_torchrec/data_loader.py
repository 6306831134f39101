"""Data loader of the benchmark job: sends the data set's training split, in order.

The batches are built from the arrays the benchmark wrote (``<data>/train_ids.npy``, the
raw 64-bit ids; ``train_dense.npy``; ``train_label.npy``) as the job goes, as a loader
reading files does; data loader ``i`` of ``n`` sends the batches with ``b % n == i``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "topologies"))

import common  # noqa: E402

from stream_persia.ctx import DataCtx  # noqa: E402
from stream_persia.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from stream_persia.env import get_replica_index, get_replica_size  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    if not settings.data:
        raise SystemExit("--data: the data set's directory (load_tests/bench_vs_torchrec.py "
                         "writes it)")
    data = Path(settings.data)
    ids = np.load(data / "train_ids.npy", mmap_mode="r")
    dense = np.load(data / "train_dense.npy", mmap_mode="r")
    label = np.load(data / "train_label.npy", mmap_mode="r")
    slots = [f"C{k + 1}" for k in range(ids.shape[1])]
    index, size = get_replica_index(), get_replica_size()
    bsz = settings.batch_size
    batches = len(label) // bsz
    with DataCtx() as ctx:
        for b in range(index, batches, size):
            lo, hi = b * bsz, (b + 1) * bsz
            feats = [IDTypeFeatureWithSingleID(name, np.ascontiguousarray(ids[lo:hi, k]))
                     for k, name in enumerate(slots)]
            ctx.send_data(PersiaBatch(
                feats, non_id_type_features=[NonIDTypeFeature(np.ascontiguousarray(
                    dense[lo:hi]), "dense")],
                labels=[Label(np.ascontiguousarray(label[lo:hi]).reshape(-1, 1), "click")]))
    common.log(f"data-loader-{index}", f"sent {len(range(index, batches, size))} batches")


if __name__ == "__main__":
    main()
