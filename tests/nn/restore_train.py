"""An NN worker process for the restore-equals-uninterrupted test (tests/nn/).

    python restore_train.py WORKER_ADDR OUT_DIR --batches N [--checkpoint-at K --ckpt DIR]
                            [--checkpoint-every C --ckpt DIR] [--restore DIR] [--step-sleep S]
                            [--final-ckpt DIR]

Trains ``N`` batches (PERSIA's loop, staleness 1, reproducible) with Adam on the dense
part and Adagrad on embeddings. With ``--checkpoint-at K`` it dumps a checkpoint after
batch K, writes ``OUT_DIR/checkpointed`` and keeps training until killed. With
``--checkpoint-every C`` it dumps one after every C batches, into ``DIR/step-<n>`` (the
fault suite, tests/faults/). With ``--restore DIR`` it loads the checkpoint first.
``--step-sleep`` waits that many seconds after each batch (spreads a run over time, so
that a fault lands at a random point of it). ``--final-ckpt DIR`` dumps a checkpoint
when the loop ends (the stream ran dry, ``--batches`` were trained, or a stop was
requested: tests/nn/test_nn_drain.py). It writes the metas of the batches it trained
(``metas.json``), the context's counters (``stats.json``) and the final dense state
(``dense.pt``) to ``OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nn_helpers import SumModel  # noqa: E402

from stream_persia.ctx import TrainCtx  # noqa: E402
from stream_persia.data import DataLoader, StreamingDataset  # noqa: E402
from stream_persia.embedding.optim import Adagrad  # noqa: E402
from stream_persia.utils import setup_seed  # noqa: E402

IN_DIM = 3 + 8 + 8 + 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("worker")
    p.add_argument("out")
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--checkpoint-at", type=int, default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--restore", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--final-ckpt", default=None)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setup_seed(0)
    model = SumModel(IN_DIM, hidden=8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    metas: list[str] = []
    with TrainCtx(Adagrad(lr=0.1), opt, model=model, embedding_workers=[a.worker],
                  mixed_precision=False, ready_timeout_s=30) as ctx:
        if a.restore:
            ctx.load_checkpoint(a.restore)
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, reproducible=True,
                             max_batches=a.batches, timeout_ms=30_000):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            metas.append(tb.meta.decode())
            tmp = out / "metas.json.tmp"      # atomic: the test reads it while we train
            tmp.write_text(json.dumps(metas))
            os.replace(tmp, out / "metas.json")
            if a.checkpoint_at is not None and len(metas) == a.checkpoint_at:
                ctx.dump_checkpoint(a.ckpt)
                (out / "checkpointed").write_text("1")
            if a.checkpoint_every and len(metas) % a.checkpoint_every == 0:
                ctx.dump_checkpoint(f"{a.ckpt}/step-{len(metas):04d}")
            if a.step_sleep:
                time.sleep(a.step_sleep)
        if a.final_ckpt:
            ctx.dump_checkpoint(a.final_ckpt)
        (out / "stats.json").write_text(json.dumps(ctx.stats()))
    torch.save(model.state_dict(), out / "dense.pt")


if __name__ == "__main__":
    main()
