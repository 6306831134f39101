"""Data loader of the Taobao PLE job: the generated stream, or CSV rows (``source.py``).

Data loader ``i`` of ``n`` (``REPLICA_INDEX``/``REPLICA_SIZE``) sends the batches ``b``
of each epoch with ``b % n == i``; every epoch replays the same rows in the same order.

    PERSIA_EMBEDDING_WORKERS=127.0.0.1:9001 python data_loader.py --samples 100000
    PERSIA_EMBEDDING_WORKERS=127.0.0.1:9001 python data_loader.py --data-file data/
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
import source  # noqa: E402
from schema import to_persia_batch  # noqa: E402

from stream_persia.ctx import DataCtx  # noqa: E402
from stream_persia.env import get_replica_index, get_replica_size  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    index, size = get_replica_index(), get_replica_size()
    role = f"data-loader-{index}"
    data = source.plan(settings)
    common.log(role, f"sending {data.train_rows} {data.kind} rows x {settings.epochs} "
                     f"epoch(s) in batches of {settings.batch_size} (replica {index} of {size})")
    t0 = time.monotonic()
    sent = 0
    with DataCtx() as ctx:
        for _epoch in range(settings.epochs):
            for chunk in data.train_batches(settings.batch_size, index, size):
                ctx.send_data(to_persia_batch(chunk))
                sent += len(chunk)
    common.log(role, f"sent {sent} samples in {time.monotonic() - t0:.1f}s via {ctx.mode}")


if __name__ == "__main__":
    main()
