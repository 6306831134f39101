"""Data loader of the synthetic click stream: generates its share and sends it.

Batch ``b`` of an epoch holds samples ``b * batch_size ..`` of the stream; data loader
``i`` of ``n`` (``REPLICA_INDEX``/``REPLICA_SIZE``) sends the batches with ``b % n == i``,
so the job trains on the same samples whatever the number of data loaders. Every epoch
replays the same samples (a stream has no reshuffle; the order of arrival is the order).

    PERSIA_EMBEDDING_WORKERS=127.0.0.1:9001 python data_loader.py --samples 100000

``STREAM_PERSIA_CONCEPT_SHIFT_AT=K`` (for ``load_tests/bench_freshness.py``) turns on the
generator's concept shift at sample ``K``; when the batch holding it is sent, its send time
goes to ``<output dir>/concept_shift.json``. The stream's other settings from the
environment: ``generator.ClickStream.from_env``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
from generator import ClickStream, to_persia_batch  # noqa: E402

from stream_persia.ctx import DataCtx  # noqa: E402
from stream_persia.env import get_replica_index, get_replica_size  # noqa: E402


def batch_ranges(samples: int, batch_size: int, replica_index: int, replica_size: int):
    """(start, n) of the batches of one epoch that this replica sends."""
    for b in range(replica_index, common.num_batches(samples, batch_size), replica_size):
        start = b * batch_size
        yield start, min(batch_size, samples - start)


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    index, size = get_replica_index(), get_replica_size()
    stream = ClickStream.from_env(settings.seed)
    shift_at = stream.shift_at
    slots = stream.slots
    role = f"data-loader-{index}"
    common.log(role, f"sending {settings.samples} samples x {settings.epochs} epoch(s) in "
                     f"batches of {settings.batch_size} (replica {index} of {size})")
    t0 = time.monotonic()
    sent = 0
    with DataCtx() as ctx:
        for _epoch in range(settings.epochs):
            for start, n in batch_ranges(settings.samples, settings.batch_size, index, size):
                ctx.send_data(to_persia_batch(stream.samples(start, n), slots))
                sent += n
                if start <= shift_at < start + n and settings.output_dir:
                    Path(settings.output_dir, "concept_shift.json").write_text(json.dumps(
                        {"sample": shift_at, "sent_at": time.time()}))
    elapsed = time.monotonic() - t0
    common.log(role, f"sent {sent} samples in {elapsed:.1f}s ({sent / max(elapsed, 1e-9):.0f}/s)"
                     f" via {ctx.mode}")


if __name__ == "__main__":
    main()
