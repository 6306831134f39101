"""One NN rank of the two-rank test of checkpoints started over HTTP (run by
``stream-persia launch nn-worker``). Usage: ``ddp_checkpoint_train.py OUT_DIR``.

Trains the API tests' ``Click`` model from the stream until it runs dry, slowly enough for
the test to start a checkpoint meanwhile; writes the step at which this rank took it, its
step count and its dense state to ``OUT_DIR/rank<r>.json`` / ``.pt``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from api_helpers import Click

from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.distributed import DDPOption
from stream_persia.embedding.optim import SGD
from stream_persia.env import get_rank


def main(out_dir: str) -> None:
    rank = get_rank()
    torch.set_num_threads(1)
    model = Click(seed=10 + rank)     # DDP's first broadcast makes the ranks identical
    taken_at = None
    with TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                  mixed_precision=False, distributed_option=DDPOption(backend="gloo"),
                  ready_timeout_s=60, checkpoint_poll_steps=2) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, timeout_ms=1500):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            if taken_at is None and ctx.checkpoint_poller.taken:
                taken_at = ctx.steps
            time.sleep(0.05)
        taken = list(ctx.checkpoint_poller.taken)
        steps = ctx.steps
    out = Path(out_dir)
    torch.save(model.state_dict(), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "taken": taken,
                                                      "taken_at": taken_at}))


if __name__ == "__main__":
    main(sys.argv[1])
