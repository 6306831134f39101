"""Standalone check: the PLE model on the generated Taobao stream, no stream-persia runtime.

Trains ``model.PLE`` in one process with the embedding rows updated the way the
embedding servers do it (``topologies/standalone.py``; the tag lists pooled as in the
embedding workers: sum / sqrt(n)) and prints each task's held-out AUC next to its
Bayes-optimal AUC.

    python check_standalone.py --samples 300000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from generator import TaobaoStream  # noqa: E402
from model import PLE  # noqa: E402
from schema import DIM, MULTI_ID, SLOTS, RawChunk, encode_ids  # noqa: E402
from standalone import RowTable  # noqa: E402

from stream_persia.utils import roc_auc  # noqa: E402


def embed(table: RowTable, chunk: RawChunk, train: bool):
    """Per-slot (batch, dim) tensors, plus (rows, leaf) pairs for the update."""
    n = len(chunk)
    tensors, pairs = [], []
    for k, name in enumerate(SLOTS):
        if name in MULTI_ID:
            values, offsets = chunk.multi[name]
            rows = table.index(encode_ids(name, values), slot=k)
            leaf = table.w[rows].requires_grad_(train)
            lengths = torch.from_numpy(np.diff(offsets))
            seg = torch.repeat_interleave(torch.arange(n), lengths)
            pooled = torch.zeros(n, DIM).index_add(0, seg, leaf)
            pooled = pooled / lengths.clamp(min=1).sqrt().unsqueeze(1)
        else:
            raw = chunk.price if name == "price" else chunk.single[name]
            rows = table.index(encode_ids(name, raw), slot=k)
            leaf = table.w[rows].requires_grad_(train)
            pooled = leaf
        tensors.append(pooled)
        pairs.append((rows, leaf))
    return tensors, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300_000)
    ap.add_argument("--eval-samples", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--emb-lr", type=float, default=2e-3)
    ap.add_argument("--dense-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    stream = TaobaoStream(seed=args.seed)
    ev = stream.eval_samples(args.eval_samples)
    bayes = {"click": roc_auc(ev.clk, ev.p_click), "buy": roc_auc(ev.buy, ev.p_buy)}
    model = PLE()
    table = RowTable(1 << 21, DIM, "adam", args.emb_lr, seed=args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.dense_lr)
    bce = torch.nn.BCELoss()

    def evaluate() -> dict[str, float]:
        preds = [[], []]
        with torch.no_grad():
            for lo in range(0, len(ev), 8192):
                idx = np.arange(lo, min(lo + 8192, len(ev)))
                chunk = stream.eval_samples(len(idx), lo)
                out = model([], embed(table, chunk, False)[0])
                for k in range(2):
                    preds[k].append(out[k].numpy().reshape(-1))
        return {"click": roc_auc(ev.clk, np.concatenate(preds[0])),
                "buy": roc_auc(ev.buy, np.concatenate(preds[1]))}

    t0 = time.time()
    seen = 0
    every = max(args.samples // 5, args.batch_size)
    nxt = every
    while seen < args.samples:
        n = min(args.batch_size, args.samples - seen)
        chunk = stream.samples(seen, n)
        tensors, pairs = embed(table, chunk, True)
        out = model([], tensors)
        loss = (bce(out[0], torch.from_numpy(chunk.clk).reshape(-1, 1))
                + bce(out[1], torch.from_numpy(chunk.buy).reshape(-1, 1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        for rows, leaf in pairs:
            table.step(rows, leaf.grad)
        seen += n
        if seen >= nxt or seen == args.samples:
            nxt += every
            auc = evaluate()
            print(f"{seen:>8} samples {time.time() - t0:6.1f}s " + "  ".join(
                f"{t} AUC {auc[t]:.4f} (Bayes {bayes[t]:.4f}, lift "
                f"{100 * (auc[t] - 0.5) / (bayes[t] - 0.5):.1f}%)" for t in auc), flush=True)


if __name__ == "__main__":
    main()
