"""Standalone check: the Adult model and optimizers in one process, no stream-persia runtime.

Trains ``model.DNN`` on the prepared training split with the embedding rows updated the
way the embedding servers do it (``topologies/standalone.py``) and prints the test AUC
after every epoch, to pick optimizer settings that clear the gate (test AUC >= 0.90)
before running the distributed job.

    python check_standalone.py --epochs 3
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

from model import DNN  # noqa: E402
from prepare import load, resolve_data_dir  # noqa: E402
from standalone import RowTable  # noqa: E402

from stream_persia.utils import roc_auc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--emb-optimizer", choices=("adam", "adagrad"), default="adagrad")
    ap.add_argument("--emb-lr", type=float, default=1e-2)
    ap.add_argument("--dense-optimizer", choices=("sgd", "adam"), default="adam")
    ap.add_argument("--dense-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="seeds to average over")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, test, _ = load(resolve_data_dir(args.data_dir))
    finals = []
    for seed in range(args.seed, args.seed + args.repeats):
        torch.manual_seed(seed)
        model = DNN(embedding_dim=args.dim)
        table = RowTable(1 << 12, args.dim, args.emb_optimizer, args.emb_lr, seed=seed)
        if args.dense_optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=args.dense_lr)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=args.dense_lr)
        loss_fn = torch.nn.BCELoss()
        rng = np.random.default_rng(seed)
        t0 = time.time()
        for epoch in range(args.epochs):
            order = rng.permutation(len(train))
            for lo in range(0, len(train), args.batch_size):
                b = train.take(order[lo:lo + args.batch_size])
                rows = table.index(b.ids)
                emb = table.w[rows].requires_grad_(True)
                out = model([torch.from_numpy(b.dense)], list(emb.unbind(1)))
                loss = loss_fn(out, torch.from_numpy(b.label).reshape(-1, 1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                table.step(rows, emb.grad)
            with torch.no_grad():
                p = model([torch.from_numpy(test.dense)],
                          list(table.w[table.index(test.ids)].unbind(1))).numpy()
            auc = roc_auc(test.label, p)
            print(f"seed {seed} epoch {epoch + 1}: test AUC {auc:.4f} "
                  f"({time.time() - t0:.1f}s)", flush=True)
        finals.append(auc)
    print(f"final test AUC over {len(finals)} seed(s): mean {np.mean(finals):.4f} "
          f"min {np.min(finals):.4f} max {np.max(finals):.4f}")


if __name__ == "__main__":
    main()
