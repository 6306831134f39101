"""An NN rank whose dense model is slow to save, for the test of a rank killed while it
takes a checkpoint started over HTTP. Usage: ``slow_checkpoint_train.py OUT_DIR HOLD_S``
(embedding workers from ``PERSIA_EMBEDDING_WORKERS``).

Trains the API tests' ``Click`` model from the stream, slowly. Saving the dense model (the
``state_dict`` a checkpoint writes) takes ``HOLD_S`` seconds, as a large model's would, and
first creates ``OUT_DIR/in_dump`` so the test knows rank 0 is inside the dump.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from api_helpers import Click

from stream_persia.config import ModelUpdatesConfig
from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import SGD


class SlowToSave(Click):
    def __init__(self, marker: Path, hold_s: float):
        super().__init__(seed=5)
        self.marker, self.hold_s = marker, hold_s

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.marker.touch()
        time.sleep(self.hold_s)
        return super().state_dict(*args, **kwargs)


def main(out_dir: str, hold_s: str) -> None:
    torch.set_num_threads(1)
    model = SlowToSave(Path(out_dir) / "in_dump", float(hold_s))
    # Publishing for serving replicas would call the slow state_dict every few steps: off,
    # so that only the checkpoint takes it.
    with TrainCtx(SGD(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                  mixed_precision=False, ready_timeout_s=60,
                  model_updates=ModelUpdatesConfig(enabled=False)) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=2, timeout_ms=30_000):
            output, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            time.sleep(0.05)


if __name__ == "__main__":
    main(*sys.argv[1:3])
