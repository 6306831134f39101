"""NN worker of the Taobao PLE job: two tasks (click, buy), AUC per task.

PERSIA's training loop (``TrainCtx`` + ``DataLoader(StreamingDataset)``). The model
returns one probability tensor per task and the batch carries one label per task, in
the same order (click, buy); the loss is the sum of one binary cross-entropy per task,
so both towers and every expert they gate get gradients from one ``backward``.

Evaluation (rank 0, ``eval_ctx``) reports each task's AUC and, on the generated stream,
each task's Bayes-optimal AUC (the true probabilities are known: ``P(buy) = P(click) *
P(buy | click)``) and the share of the attainable lift reached.

Results go to ``$PERSIA_OUTPUT_DIR/metrics.json`` (schema: ``topologies/common.py``; here
also ``progressive``: ``TrainCtx.progressive()`` per task with its ``curve``
(``common.record_progressive``), and with a distribution shift (``--concept-shift-at``),
``drift``: the shift's sample and each task's Bayes-optimal AUC on either side) and
the final checkpoint to ``$PERSIA_CKPT_DIR`` (default ``$PERSIA_OUTPUT_DIR/checkpoint``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import common  # noqa: E402
import source  # noqa: E402
from model import PLE  # noqa: E402
from schema import SLOTS, to_persia_batch  # noqa: E402

from stream_persia.config import load_embedding_config  # noqa: E402
from stream_persia.ctx import TrainCtx  # noqa: E402
from stream_persia.data import DataLoader, StreamingDataset  # noqa: E402
from stream_persia.embedding import EmbeddingConfig  # noqa: E402
from stream_persia.embedding.optim import Adam  # noqa: E402
from stream_persia.env import get_local_rank, get_rank, get_world_size  # noqa: E402
from stream_persia.nn.progressive import progressive_config  # noqa: E402
from stream_persia.utils import roc_auc, setup_seed  # noqa: E402

TASKS = ["click", "buy"]
EVAL_POINTS = 5
EVAL_SUBSET = 20_000
EVAL_BATCH = 4096
BAYES_SAMPLES = 100_000    # per side of a distribution shift (sampling error ~6e-4)


def evaluate(model, data: source.Plan, rows: int, device_id) -> tuple[dict, dict, float]:
    t0 = time.monotonic()
    subset = dataclasses.replace(data, eval_rows=rows)
    batches = (to_persia_batch(c, requires_grad=False) for c in subset.eval_batches(EVAL_BATCH))
    preds, labels = common.predict(model, batches, device_id=device_id)
    auc, loss = common.task_metrics(TASKS, preds, labels)
    return auc, loss, time.monotonic() - t0


def bayes_aucs(data: source.Plan) -> dict[str, float]:
    """Per-task AUC of the true probabilities on the eval split (generated data only)."""
    chunks = list(data.eval_batches(65_536))
    clk, buy = np.concatenate([c.clk for c in chunks]), np.concatenate([c.buy for c in chunks])
    return {"click": roc_auc(clk, np.concatenate([c.p_click for c in chunks])),
            "buy": roc_auc(buy, np.concatenate([c.p_buy for c in chunks]))}


def drift_truth(stream, window: int) -> dict:
    """Each task's Bayes-optimal AUC on either side of the distribution shift
    (``TaobaoStream.bayes_auc``: each side is stationary) from ``BAYES_SAMPLES`` samples
    just after it and just before it (as many as there are)."""
    after = stream.bayes_auc(stream.shift_at, BAYES_SAMPLES)
    n_before = min(BAYES_SAMPLES, stream.shift_at)
    before = stream.bayes_auc(stream.shift_at - n_before, n_before) if n_before >= 1000 else {}
    return {"shift_at_samples": stream.shift_at, "window_samples": window,
            "bayes_auc_before": {t: before[t][0] if before else None for t in TASKS},
            "bayes_auc_after": {t: after[t][0] for t in TASKS},
            "bayes_auc_stderr": {t: {"before": before[t][1] if before else None,
                                     "after": after[t][1]} for t in TASKS},
            "bayes_samples": BAYES_SAMPLES}


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    setup_seed(settings.seed)
    rank, world_size = get_rank(), get_world_size()
    role = f"nn-worker-{rank}"
    data = source.plan(settings)

    cuda = torch.cuda.is_available()
    device_id = get_local_rank() if cuda else None
    model = PLE(**common.model_kwargs(HERE))
    schema = load_embedding_config(common.embedding_config_path(HERE))
    if list(schema.slots) != list(SLOTS) or model.num_slots != len(SLOTS) \
            or {s.dim for s in schema.slots.values()} != {model.embedding_dim} \
            or model.tasks != TASKS:
        raise SystemExit(f"embedding_config.yml must list the slots {list(SLOTS)} with dim "
                         f"{model.embedding_dim} and the model the tasks {TASKS}")
    if cuda:
        torch.cuda.set_device(device_id)
        model.cuda(device_id)

    dense_optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    embedding_optimizer = Adam(lr=2e-3)
    embedding_config = EmbeddingConfig(emb_initialization=(-0.01, 0.01), admit_probability=1.0,
                                       weight_bound=10.0)
    bce = torch.nn.BCELoss()

    steps = common.steps_per_rank(
        settings.epochs * common.num_batches(data.train_rows, settings.batch_size), world_size)
    metrics = common.MetricsLog("taobao_ple", settings, TASKS, rank, world_size)
    metrics["eval"] = {"data": data.kind}
    if rank == 0 and data.generated and data.eval_rows:
        metrics["bayes_auc"] = bayes_aucs(data)
        common.log(role, "Bayes-optimal AUC: " + ", ".join(
            f"{t} {v:.4f}" for t, v in metrics["bayes_auc"].items()))
    if rank == 0 and data.generated and data.shift_at >= 0:
        metrics["drift"] = drift_truth(data.stream(), progressive_config().window_samples)
        common.log(role, f"distribution shift at sample {data.shift_at}: Bayes-optimal AUC "
                         f"after it {metrics['drift']['bayes_auc_after']}")
    common.log(role, f"training {steps} steps of {settings.batch_size} on {data.kind} data "
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
            outputs, labels = ctx.forward(batch)
            # One BCE per task, summed: outputs and labels are both in TASKS order.
            loss = sum(bce(out, label) for out, label in zip(outputs, labels, strict=True))
            ctx.backward(loss)
            progress.step(labels[0].shape[0], loss.item())
            if (batch_idx + 1) % curve_every == 0:   # every rank: the read is collective
                common.record_progressive(metrics, ctx.progressive())
            if rank == 0 and (batch_idx + 1) % eval_every == 0 and batch_idx + 1 < steps:
                auc, _, _ = evaluate(model, data, min(EVAL_SUBSET, data.eval_rows), device_id)
                metrics["eval_curve"].append([progress.job_samples, auc])
                common.log(role, "eval AUC " + ", ".join(f"{t} {v:.4f}" for t, v in auc.items()))
        progress.finish(common.all_ranks_sum(progress.samples))
        common.record_progressive(metrics, ctx.progressive())
        metrics["stats"] = ctx.stats()
        if progress.steps < steps:
            common.log(role, f"the stream ended after {progress.steps} of {steps} steps")

        if settings.checkpoint_dir:
            ctx.dump_checkpoint(settings.checkpoint_dir, with_jit_model=True)
            metrics["checkpoint"] = settings.checkpoint_dir
            common.log(role, f"checkpoint written to {settings.checkpoint_dir}")

        if rank == 0 and data.eval_rows:
            auc, loss, seconds = evaluate(model, data, data.eval_rows, device_id)
            metrics["auc"], metrics["loss"] = auc, loss
            metrics["eval_curve"].append([progress.job_samples, auc])
            metrics["eval"].update(samples=data.eval_rows, seconds=round(seconds, 3))
            line = ", ".join(f"{t} {v:.4f}" for t, v in auc.items())
            if "bayes_auc" in metrics.data:
                bayes = metrics["bayes_auc"]
                metrics["bayes_lift"] = {t: (auc[t] - 0.5) / (bayes[t] - 0.5) for t in TASKS}
                line += " (Bayes-optimal " + ", ".join(
                    f"{t} {bayes[t]:.4f}" for t in TASKS) + ")"
            common.log(role, f"test AUC {line}")
    metrics.write()


if __name__ == "__main__":
    main()
