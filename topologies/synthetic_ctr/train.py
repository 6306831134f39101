"""NN worker of the synthetic click stream: train, evaluate against the Bayes optimum.

PERSIA's training loop (``TrainCtx`` + ``DataLoader(StreamingDataset)``); evaluation
runs on rank 0 in an ``eval_ctx`` over a held-out split that the generator produces
here (it never overlaps the training range), whose true click probabilities give the
Bayes-optimal AUC. The gate of this topology is the share of the attainable lift that the
model reaches: ``bayes_lift = (auc - 0.5) / (bayes_auc - 0.5)``.

Results go to ``$PERSIA_OUTPUT_DIR/metrics.json`` (schema: ``topologies/common.py``; here
also ``progressive``: ``TrainCtx.progressive()`` per task, with a ``curve`` of
``[samples_scored, windowed_auc, windowed_ne]`` about every quarter window
(``common.progressive_every``); and with a concept shift, ``drift``: the shift's sample
and the Bayes-optimal AUC on each side of it (:func:`drift_truth`)) and
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
from generator import ClickStream, to_persia_batch  # noqa: E402
from model import DNN  # noqa: E402

from stream_persia.config import load_embedding_config  # noqa: E402
from stream_persia.ctx import TrainCtx  # noqa: E402
from stream_persia.data import DataLoader, StreamingDataset  # noqa: E402
from stream_persia.embedding import EmbeddingConfig  # noqa: E402
from stream_persia.embedding.optim import Adam  # noqa: E402
from stream_persia.env import get_local_rank, get_rank, get_world_size  # noqa: E402
from stream_persia.nn.progressive import progressive_config  # noqa: E402
from stream_persia.utils import roc_auc, setup_seed  # noqa: E402

TASKS = ["click"]
EVAL_POINTS = 5            # evaluations on a subset during training (the AUC curve)
EVAL_SUBSET = 20_000
EVAL_BATCH = 4096
BAYES_SAMPLES = 200_000    # per side of a concept shift (sampling error ~3e-4 at this size)


def eval_batches(stream: ClickStream, n: int):
    for start in range(0, n, EVAL_BATCH):
        yield to_persia_batch(stream.eval_samples(min(EVAL_BATCH, n - start), start),
                              stream.slots, requires_grad=False)


def evaluate(model, stream: ClickStream, n: int, device_id) -> tuple[dict, dict, float]:
    t0 = time.monotonic()
    preds, labels = common.predict(model, eval_batches(stream, n), device_id=device_id)
    auc, loss = common.task_metrics(TASKS, preds, labels)
    return auc, loss, time.monotonic() - t0


def drift_truth(stream: ClickStream, window: int) -> dict:
    """The Bayes-optimal AUC on each side of the concept shift, from the generator's true
    ``p`` of a sample of each side (``ClickStream.bayes_auc``; each side is stationary):
    ``BAYES_SAMPLES`` samples just after the shift (and just before it, or as many as
    there are), with their standard errors."""
    after, after_err = stream.bayes_auc(stream.shift_at, BAYES_SAMPLES)
    n_before = min(BAYES_SAMPLES, stream.shift_at)
    before, before_err = (stream.bayes_auc(stream.shift_at - n_before, n_before)
                          if n_before >= 1000 else (None, None))
    return {"shift_at_samples": stream.shift_at, "window_samples": window,
            "bayes_auc_before": {"click": before}, "bayes_auc_after": {"click": after},
            "bayes_auc_stderr": {"click": {"before": before_err, "after": after_err}},
            "bayes_samples": BAYES_SAMPLES}


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    setup_seed(settings.seed)
    rank, world_size = get_rank(), get_world_size()
    role = f"nn-worker-{rank}"

    cuda = torch.cuda.is_available()
    device_id = get_local_rank() if cuda else None
    stream = ClickStream.from_env(settings.seed)
    model = DNN(**common.model_kwargs(HERE))
    schema = load_embedding_config(common.embedding_config_path(HERE))
    dims = {schema.slot(s).dim for s in stream.slots}
    if dims != {model.embedding_dim} or model.num_slots != stream.num_slots:
        raise SystemExit(f"embedding_config.yml gives slot dims {sorted(dims)} for "
                         f"{stream.num_slots} slots but the model expects dim "
                         f"{model.embedding_dim} for {model.num_slots}: make them agree")
    if cuda:
        torch.cuda.set_device(device_id)
        model.cuda(device_id)

    # Adam on both sides: its updates do not depend on the scale of the gradients, which
    # for embeddings is tiny (a mean loss over 1024 samples, split over 26 slots).
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    embedding_optimizer = Adam(lr=2e-3)
    embedding_config = EmbeddingConfig(emb_initialization=(-0.01, 0.01), admit_probability=1.0,
                                       weight_bound=10.0)
    loss_fn = torch.nn.BCELoss()

    total_batches = settings.epochs * common.num_batches(settings.samples, settings.batch_size)
    steps = common.steps_per_rank(total_batches, world_size)
    metrics = common.MetricsLog("synthetic_ctr", settings, TASKS, rank, world_size)
    if rank == 0:
        truth = stream.eval_samples(settings.eval_samples)
        bayes = roc_auc(truth.label, truth.p)
        metrics["bayes_auc"] = {"click": bayes}
        common.log(role, f"Bayes-optimal AUC of the {settings.eval_samples} eval samples: "
                         f"{bayes:.4f}")
        if stream.shift_at >= 0:
            metrics["drift"] = drift_truth(stream, progressive_config().window_samples)
            common.log(role, f"concept shift at sample {stream.shift_at}: Bayes-optimal AUC "
                             f"{metrics['drift']['bayes_auc_before']['click']} before, "
                             f"{metrics['drift']['bayes_auc_after']['click']:.4f} after")
    common.log(role, f"training {steps} steps of {settings.batch_size} "
                     f"(staleness {settings.embedding_staleness}, {world_size} rank(s))")
    metrics.write()

    with TrainCtx(model=model, embedding_optimizer=embedding_optimizer,
                  dense_optimizer=dense_optimizer, embedding_config=embedding_config,
                  mixed_precision=cuda, device_id=device_id) as ctx:
        loader = DataLoader(StreamingDataset(buffer_size=10), timeout_ms=120_000,
                            reproducible=settings.reproducible,
                            embedding_staleness=settings.embedding_staleness,
                            max_batches=steps)
        progress = common.Progress(metrics, steps, world_size, role=role)
        eval_every = max(1, steps // EVAL_POINTS)
        curve_every = common.progressive_every(steps, settings.batch_size, world_size)
        for batch_idx, batch in enumerate(loader):
            output, labels = ctx.forward(batch)
            loss = loss_fn(output, labels[0])
            ctx.backward(loss)
            progress.step(labels[0].shape[0], loss.item())
            if (batch_idx + 1) % curve_every == 0:   # every rank: the read is collective
                common.record_progressive(metrics, ctx.progressive())
            if rank == 0 and (batch_idx + 1) % eval_every == 0 and batch_idx + 1 < steps:
                auc, _, _ = evaluate(model, stream, min(EVAL_SUBSET, settings.eval_samples),
                                     device_id)
                metrics["eval_curve"].append([progress.job_samples, auc])
                common.log(role, f"eval AUC {auc['click']:.4f} on "
                                 f"{min(EVAL_SUBSET, settings.eval_samples)} samples")
        progress.finish(common.all_ranks_sum(progress.samples))
        common.record_progressive(metrics, ctx.progressive())
        metrics["stats"] = ctx.stats()
        if progress.steps < steps:
            common.log(role, f"the stream ended after {progress.steps} of {steps} steps")

        if settings.checkpoint_dir:
            ctx.dump_checkpoint(settings.checkpoint_dir, with_jit_model=True)
            metrics["checkpoint"] = settings.checkpoint_dir
            common.log(role, f"checkpoint written to {settings.checkpoint_dir}")

        if rank == 0 and settings.eval_samples:
            auc, loss, seconds = evaluate(model, stream, settings.eval_samples, device_id)
            bayes = metrics["bayes_auc"]["click"]
            lift = (auc["click"] - 0.5) / (bayes - 0.5)
            metrics["auc"], metrics["loss"] = auc, loss
            metrics["bayes_lift"] = {"click": lift}
            metrics["eval_curve"].append([progress.job_samples, auc])
            metrics["eval"] = {"samples": settings.eval_samples, "seconds": round(seconds, 3)}
            common.log(role, f"test AUC {auc['click']:.4f}, Bayes-optimal {bayes:.4f}: "
                             f"{100 * lift:.1f}% of the attainable lift")
    metrics.write()


if __name__ == "__main__":
    main()
