"""The TorchRec/FBGEMM side of ``load_tests/bench_vs_torchrec.py``: one process, CPU.

Run with the TorchRec environment's python (it imports torch, fbgemm_gpu and torchrec,
never stream_persia), by the benchmark::

    $VENV/bin/python load_tests/vs_torchrec/torchrec_train.py DATA_DIR OUT_DIR \
        --variant tbe --threads 1

Reads the data set the benchmark wrote (``DATA_DIR``: ``meta.json``, ``train_rows.npy``,
``train_dense.npy``, ``train_label.npy``, ``eval_rows.npy``, ``eval_dense.npy``), trains
one pass in the file's order, batch ``meta["batch"]``, then writes ``OUT_DIR/result.json``
(``samples_per_s``, ``cpu_us_per_sample`` over the batches after ``meta["warmup"]``) and
``OUT_DIR/eval_pred.npy`` (the eval split's predictions: the benchmark computes the AUC of
both sides with one function).

The embeddings (``--variant``):

- ``tbe``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` directly, one module for the
  26 tables, pooled sums, float32 rows in host memory, ``EXACT_ROWWISE_ADAGRAD`` applied in
  the backward pass (TorchRec's fused optimizer: no separate step, no gradient tensor of
  the table). The input is the flat id tensor and offsets.
- ``mlp``: no embeddings at all, a reference rather than a baseline: the same MLP and
  Adam fed one fixed random ``(batch, slots * dim)`` tensor as the embeddings (a fresh
  leaf each step, so that backward computes its gradient as both real sides do) beside
  the real dense features. Its samples/s at one thread is what an NN rank of one torch
  thread (what ``stream-persia run`` gives it on 2 cores) could reach if looking rows up
  and updating them cost nothing; the benchmark reports it as ``mlp_floor``.
- ``torchrec``: ``torchrec.modules.fused_embedding_modules.FusedEmbeddingBagCollection``
  with ``torchrec.optim.RowWiseAdagrad`` (it builds the same FBGEMM module) fed a
  ``KeyedJaggedTensor`` per batch, as a TorchRec model is written.

The rows' optimizer is matched to the stream-persia side (rowwise Adagrad, the same lr),
and its state starts at ``meta["adagrad_initial_accumulator"]`` (written into FBGEMM's
momentum tensors; FBGEMM has no such option). What FBGEMM does differently: it adds the
step's squared gradient to the accumulator *before* the step and puts ``eps`` outside the
square root (``w -= lr * g / (sqrt(acc) + eps)``); PERSIA's Adagrad steps with the
accumulator of the steps before (``w -= lr * g / sqrt(acc + eps)``, then ``acc += g²``).
Row ids: a row index per (slot, id) (the generator's popularity rank: a collision-free
vocabulary; the cost of mapping raw ids to it is not counted), where stream-persia gets the
raw 64-bit ids and hashes them itself.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch


def mlp(width: int, hidden: list[int]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers += [torch.nn.Linear(width, 1), torch.nn.Sigmoid()]
    return torch.nn.Sequential(*layers)


class TbeModel(torch.nn.Module):
    """FBGEMM's table-batched embedding bags (rowwise Adagrad fused) + the MLP."""

    def __init__(self, meta: dict):
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.slots, self.dim = meta["slots"], meta["dim"]
        self.emb = SplitTableBatchedEmbeddingBagsCodegen(
            [(meta["vocab"], self.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * self.slots,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=meta["emb_lr"],
            eps=meta["adagrad_eps"], pooling_mode=PoolingMode.SUM)
        init_rows(self.emb.split_embedding_weights(), self.emb.split_optimizer_states(), meta)
        self.mlp = mlp(self.slots * self.dim + meta["dense"], meta["mlp"])

    def forward(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        # rows: (B, slots) -> table-major flat ids, one id per bag
        b = rows.shape[0]
        flat = (rows.t() + 0).reshape(-1).long()
        offsets = torch.arange(0, self.slots * b + 1, dtype=torch.long)
        pooled = self.emb(flat, offsets)           # (B, slots * dim), table-major columns
        return self.mlp(torch.cat([pooled, dense], dim=1))


class MlpOnlyModel(torch.nn.Module):
    """The MLP alone (variant ``mlp``): fixed random rows in place of the embeddings."""

    def __init__(self, meta: dict):
        super().__init__()
        self.slots, self.dim = meta["slots"], meta["dim"]
        self.mlp = mlp(self.slots * self.dim + meta["dense"], meta["mlp"])
        g = torch.Generator().manual_seed(meta["seed"])
        self.rows = (torch.rand(meta["batch"], self.slots * self.dim, generator=g) * 2 - 1) \
            * meta["emb_init"]

    def forward(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        n = len(dense)
        emb = self.rows[:n] if n <= len(self.rows) else self.rows.repeat(
            -(-n // len(self.rows)), 1)[:n]
        if self.training:
            emb = emb.detach().requires_grad_()
        return self.mlp(torch.cat([emb, dense], dim=1))


class FusedEbcModel(torch.nn.Module):
    """TorchRec's FusedEmbeddingBagCollection (RowWiseAdagrad) + the MLP."""

    def __init__(self, meta: dict):
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim import RowWiseAdagrad

        self.slots, self.dim = meta["slots"], meta["dim"]
        self.keys = [f"C{k + 1}" for k in range(self.slots)]
        tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=self.dim,
                                     num_embeddings=meta["vocab"], feature_names=[k],
                                     weight_init_min=-meta["emb_init"],
                                     weight_init_max=meta["emb_init"])
                  for k in self.keys]
        self.ebc = FusedEmbeddingBagCollection(
            tables, optimizer_type=RowWiseAdagrad,
            optimizer_kwargs={"lr": meta["emb_lr"], "eps": meta["adagrad_eps"]},
            device=torch.device("cpu"))
        # TorchRec exposes no initial accumulator: its FBGEMM modules (a private list) take
        # the one stream-persia starts from, as TbeModel's does
        lookups = self.ebc._emb_modules
        if not lookups:
            raise RuntimeError("FusedEmbeddingBagCollection has no FBGEMM module to set up")
        for lookup in lookups:
            tbe = lookup._emb_module
            init_rows(tbe.split_embedding_weights(), tbe.split_optimizer_states(), meta)
        self.mlp = mlp(self.slots * self.dim + meta["dense"], meta["mlp"])

    def forward(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        b = rows.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys, values=(rows.t() + 0).reshape(-1).long(),
            lengths=torch.ones(self.slots * b, dtype=torch.int32))
        pooled = self.ebc(kjt).values()            # (B, slots * dim) in key order
        return self.mlp(torch.cat([pooled, dense], dim=1))


def init_rows(weights: list, states: list, meta: dict) -> None:
    """Rows uniform in ±``emb_init`` (stream-persia's initialisation) and the rowwise
    Adagrad accumulators at the stream-persia side's initial value."""
    lo = meta["emb_init"]
    with torch.no_grad():
        for w in weights:
            w.uniform_(-lo, lo)
        for s in states:
            s[0].fill_(meta["adagrad_initial_accumulator"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--variant", choices=("tbe", "torchrec", "mlp"), default="tbe")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    data, out = Path(args.data_dir), Path(args.out_dir)
    meta = json.loads((data / "meta.json").read_text())
    torch.set_num_threads(args.threads)
    torch.manual_seed(meta["seed"])

    rows = np.load(data / "train_rows.npy", mmap_mode="r")
    dense = np.load(data / "train_dense.npy", mmap_mode="r")
    label = np.load(data / "train_label.npy", mmap_mode="r")
    model = {"tbe": TbeModel, "torchrec": FusedEbcModel, "mlp": MlpOnlyModel}[args.variant](meta)
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=meta["dense_lr"])
    bsz, warmup = meta["batch"], meta["warmup"]
    steps = len(label) // bsz
    t0 = c0 = 0.0
    for i in range(steps):
        if i == warmup:
            t0, c0 = time.perf_counter(), time.process_time()
        lo, hi = i * bsz, (i + 1) * bsz
        # per batch, as a data loader hands them over: arrays -> tensors
        r = torch.from_numpy(np.ascontiguousarray(rows[lo:hi]))
        d = torch.from_numpy(np.ascontiguousarray(dense[lo:hi]))
        y = torch.from_numpy(np.ascontiguousarray(label[lo:hi])).view(-1, 1)
        loss = torch.nn.functional.binary_cross_entropy(model(r, d), y)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()              # the embedding rows are updated in here (fused)
        dense_opt.step()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    samples = (steps - warmup) * bsz

    model.eval()
    e_rows = np.load(data / "eval_rows.npy", mmap_mode="r")
    e_dense = np.load(data / "eval_dense.npy", mmap_mode="r")
    preds = []
    with torch.no_grad():
        for lo in range(0, len(e_rows), 4096):
            r = torch.from_numpy(np.ascontiguousarray(e_rows[lo:lo + 4096]))
            d = torch.from_numpy(np.ascontiguousarray(e_dense[lo:lo + 4096]))
            preds.append(model(r, d).view(-1).numpy().astype(np.float64))
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "eval_pred.npy", np.concatenate(preds))
    result = {"variant": args.variant, "threads": args.threads,
              "samples_per_s": samples / elapsed, "cpu_us_per_sample": cpu / samples * 1e6,
              "samples": samples, "steps": steps,
              "versions": {"torch": torch.__version__,
                           "fbgemm_gpu": version("fbgemm-gpu-cpu"),
                           "torchrec": version("torchrec")}}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
