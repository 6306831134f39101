"""Standalone learnability check: the synthetic stream, the same model, no stream-persia.

Trains ``model.DNN`` on the generated stream in one process with plain PyTorch, the
embeddings in one hashed table updated row by row the way the embedding servers do it
(gradients summed per row, then a per-row Adam or PERSIA-style Adagrad step), and prints
the held-out AUC next to the Bayes-optimal AUC. It answers "can this model learn this
stream at this size?" without the distributed pipeline, so a failing gate in
``stream-persia run`` can be told apart from a stream that is simply too hard.

    python check_standalone.py --samples 1000000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from generator import ClickStream  # noqa: E402
from model import DNN  # noqa: E402
from standalone import RowTable  # noqa: E402

from stream_persia.utils import roc_auc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--eval-samples", type=int, default=200_000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1 << 22, help="hashed table rows")
    ap.add_argument("--emb-optimizer", choices=("adam", "adagrad"), default="adam")
    ap.add_argument("--emb-lr", type=float, default=2e-3)
    ap.add_argument("--dense-lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    stream = ClickStream(seed=args.seed, **({"vocab_size": args.vocab} if args.vocab else {}))
    ev = stream.eval_samples(args.eval_samples)
    bayes = roc_auc(ev.label, ev.p)
    model = DNN(num_slots=stream.num_slots, embedding_dim=args.dim, num_dense=stream.num_dense)
    table = RowTable(args.rows, args.dim, args.emb_optimizer, args.emb_lr, seed=args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.dense_lr)
    loss_fn = torch.nn.BCELoss()

    def predict(s) -> np.ndarray:
        out = []
        with torch.no_grad():
            for lo in range(0, len(s), 8192):
                rows = table.index(s.ids[lo:lo + 8192])
                emb = table.w[rows]
                out.append(model([torch.from_numpy(s.dense[lo:lo + 8192])],
                                 list(emb.unbind(1))).numpy().reshape(-1))
        return np.concatenate(out)

    t0 = time.time()
    seen, losses = 0, []
    report_every = max(args.samples // 6, args.batch_size)
    next_report = report_every
    while seen < args.samples:
        n = min(args.batch_size, args.samples - seen)
        s = stream.samples(seen, n)
        rows = table.index(s.ids)
        emb = table.w[rows].requires_grad_(True)
        out = model([torch.from_numpy(s.dense)], list(emb.unbind(1)))
        loss = loss_fn(out, torch.from_numpy(s.label).reshape(-1, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        table.step(rows, emb.grad)
        losses.append(loss.item())
        seen += n
        if seen >= next_report or seen == args.samples:
            next_report += report_every
            auc = roc_auc(ev.label, predict(ev))
            lift = (auc - 0.5) / (bayes - 0.5)
            print(f"{seen:>9} samples {time.time() - t0:6.1f}s loss {np.mean(losses[-200:]):.4f}"
                  f" auc {auc:.4f} bayes {bayes:.4f} lift {100 * lift:.1f}%", flush=True)
    print(f"trained {seen} samples in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
