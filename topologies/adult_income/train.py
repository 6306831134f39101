"""NN worker of the Adult income job: train on the stream, evaluate on the test split.

PERSIA's training loop (``TrainCtx`` + ``DataLoader(StreamingDataset)``). The test split
is encoded here with the vocabulary fitted on the training split (``prepare.py``), and
evaluated on rank 0 in an ``eval_ctx`` after every epoch and at the end.

Optimizers (chosen with ``check_standalone.py``, mean of 3 seeds, test AUC after 5
epochs: 0.908 at batch 128, 0.908 at batch 256): embedding Adagrad lr 1e-2 (PERSIA's
example), dense Adam lr 3e-3 (PERSIA's dense SGD lr 0.1 reaches 0.898 after 3 epochs).

Results go to ``$PERSIA_OUTPUT_DIR/metrics.json`` (schema: ``topologies/common.py``; here
also ``progressive``: ``TrainCtx.progressive()`` per task with its ``curve``,
``common.record_progressive``) and
the final checkpoint to ``$PERSIA_CKPT_DIR`` (default ``$PERSIA_OUTPUT_DIR/checkpoint``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
from data_loader import to_persia_batch  # noqa: E402
from model import DNN  # noqa: E402
from prepare import CATEGORICAL, NUMERIC, Split, load, resolve_data_dir  # noqa: E402

from stream_persia.config import load_embedding_config  # noqa: E402
from stream_persia.ctx import TrainCtx  # noqa: E402
from stream_persia.data import DataLoader, StreamingDataset  # noqa: E402
from stream_persia.embedding import EmbeddingConfig  # noqa: E402
from stream_persia.embedding.optim import Adagrad  # noqa: E402
from stream_persia.env import get_local_rank, get_rank, get_world_size  # noqa: E402
from stream_persia.utils import setup_seed  # noqa: E402

TASKS = ["income"]
EVAL_BATCH = 2048


def evaluate(model, test: Split, device_id) -> tuple[dict, dict, float]:
    t0 = time.monotonic()
    batches = (to_persia_batch(test.take(slice(lo, lo + EVAL_BATCH)), requires_grad=False)
               for lo in range(0, len(test), EVAL_BATCH))
    preds, labels = common.predict(model, batches, device_id=device_id)
    auc, loss = common.task_metrics(TASKS, preds, labels)
    return auc, loss, time.monotonic() - t0


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    setup_seed(settings.seed)
    rank, world_size = get_rank(), get_world_size()
    role = f"nn-worker-{rank}"

    train, test, _ = load(resolve_data_dir(settings.data))
    if settings.eval_samples:
        test = test.take(slice(0, settings.eval_samples))
    per_epoch = min(settings.samples, len(train)) if settings.samples else len(train)

    cuda = torch.cuda.is_available()
    device_id = get_local_rank() if cuda else None
    model = DNN(**common.model_kwargs(HERE))
    schema = load_embedding_config(common.embedding_config_path(HERE))
    if list(schema.slots) != list(CATEGORICAL) or model.num_slots != len(CATEGORICAL) \
            or {s.dim for s in schema.slots.values()} != {model.embedding_dim} \
            or len(NUMERIC) != train.dense.shape[1]:
        raise SystemExit(f"embedding_config.yml must list the slots {list(CATEGORICAL)} with "
                         f"dim {model.embedding_dim} (the model's), got "
                         f"{[(n, s.dim) for n, s in schema.slots.items()]}")
    if cuda:
        torch.cuda.set_device(device_id)
        model.cuda(device_id)

    dense_optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    embedding_optimizer = Adagrad(lr=1e-2)
    embedding_config = EmbeddingConfig(emb_initialization=(-0.01, 0.01), admit_probability=1.0,
                                       weight_bound=10.0)
    loss_fn = torch.nn.BCELoss()

    batches_per_epoch = common.num_batches(per_epoch, settings.batch_size)
    steps = common.steps_per_rank(settings.epochs * batches_per_epoch, world_size)
    eval_every = max(1, batches_per_epoch // world_size)
    curve_every = common.progressive_every(steps, settings.batch_size, world_size)
    metrics = common.MetricsLog("adult_income", settings, TASKS, rank, world_size)
    common.log(role, f"training {steps} steps of {settings.batch_size} ({settings.epochs} "
                     f"epoch(s) of {per_epoch} rows; staleness {settings.embedding_staleness},"
                     f" {world_size} rank(s)); test split {len(test)} rows")
    metrics.write()

    with TrainCtx(model=model, embedding_optimizer=embedding_optimizer,
                  dense_optimizer=dense_optimizer, embedding_config=embedding_config,
                  mixed_precision=cuda, device_id=device_id) as ctx:
        loader = DataLoader(StreamingDataset(buffer_size=10), timeout_ms=120_000,
                            reproducible=settings.reproducible,
                            embedding_staleness=settings.embedding_staleness,
                            max_batches=steps)
        progress = common.Progress(metrics, steps, world_size, role=role)
        for batch_idx, batch in enumerate(loader):
            output, labels = ctx.forward(batch)
            loss = loss_fn(output, labels[0])
            ctx.backward(loss)
            progress.step(labels[0].shape[0], loss.item())
            if (batch_idx + 1) % curve_every == 0:   # every rank: the read is collective
                common.record_progressive(metrics, ctx.progressive())
            if rank == 0 and (batch_idx + 1) % eval_every == 0 and batch_idx + 1 < steps:
                auc, _, _ = evaluate(model, test, device_id)
                metrics["eval_curve"].append([progress.job_samples, auc])
                common.log(role, f"epoch {(batch_idx + 1) // eval_every}: test AUC "
                                 f"{auc['income']:.4f}")
        progress.finish(common.all_ranks_sum(progress.samples))
        common.record_progressive(metrics, ctx.progressive())
        metrics["stats"] = ctx.stats()
        if progress.steps < steps:
            common.log(role, f"the stream ended after {progress.steps} of {steps} steps")

        if settings.checkpoint_dir:
            ctx.dump_checkpoint(settings.checkpoint_dir, with_jit_model=True)
            metrics["checkpoint"] = settings.checkpoint_dir
            common.log(role, f"checkpoint written to {settings.checkpoint_dir}")

        if rank == 0:
            auc, loss, seconds = evaluate(model, test, device_id)
            metrics["auc"], metrics["loss"] = auc, loss
            metrics["eval_curve"].append([progress.job_samples, auc])
            metrics["eval"] = {"samples": len(test), "seconds": round(seconds, 3)}
            common.log(role, f"test AUC {auc['income']:.4f} on {len(test)} rows "
                             f"(PERSIA's example asserts 0.8929)")
    metrics.write()


if __name__ == "__main__":
    main()
