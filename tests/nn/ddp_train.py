"""Training script run by ``stream-persia launch nn-worker`` in the DDP test (one per rank).

Trains from the stream until it runs dry (or a stop is requested: test_nn_drain.py), then
writes this rank's dense state dict and counters to ``OUT_DIR/rank<r>.pt`` / ``.json``
(with ``ctx.progressive()``, read on both ranks, and this rank's predictions and labels
in ``OUT_DIR/scored<r>.npy``).
Usage: ``ddp_train.py OUT_DIR [STEP_SLEEP_S]``; with a step sleep it also writes the steps
taken so far to ``OUT_DIR/progress<r>`` after each step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from nn_helpers import SumModel

from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.distributed import DDPOption
from stream_persia.embedding.optim import Adagrad
from stream_persia.env import get_rank, get_world_size
from stream_persia.utils import setup_seed


def main(out_dir: str, step_sleep_s: float = 0.0) -> None:
    rank = get_rank()
    out = Path(out_dir)
    # Different seeds per rank: DDP's initial broadcast must make the models identical.
    setup_seed(100 + rank)
    torch.set_num_threads(1)
    model = SumModel(13, hidden=8)
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    steps = 0
    scored = []
    with TrainCtx(Adagrad(lr=0.05), dense_optimizer, model=model, mixed_precision=False,
                  distributed_option=DDPOption(backend="gloo"), ready_timeout_s=60) as ctx:
        assert ctx.world_size == get_world_size() == 2, ctx.world_size
        loader = DataLoader(StreamingDataset(4), embedding_staleness=4, timeout_ms=1500)
        for batch in loader:
            output, labels = ctx.forward(batch)
            loss = torch.nn.functional.binary_cross_entropy(output, labels[0])
            scored.append(torch.cat([output.detach(), labels[0]], dim=1).numpy())
            ctx.backward(loss)
            steps += 1
            if step_sleep_s:
                (out / f"progress{rank}").write_text(str(steps))
                time.sleep(step_sleep_s)
        stats = ctx.stats()
        progressive = ctx.progressive()     # collective: both ranks, same step
    np.save(out / f"scored{rank}.npy", np.concatenate(scored) if scored else np.zeros((0, 2)))
    torch.save(model.state_dict(), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, **stats,
                                                     "progressive": progressive}))


if __name__ == "__main__":
    main(sys.argv[1], *(float(a) for a in sys.argv[2:3]))
