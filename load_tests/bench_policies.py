"""Table policies (issue 20) against the model quality they cost: rows, bytes and test AUC.

Stream: ``--slots`` ID slots (default 3), one id per slot per sample. Each id is, with
probability ``--tail`` (0.05), a one-shot id (a fresh id that never occurs again, in
training or in test) and otherwise a Zipf(``--zipf`` 1.05)-distributed rank over a
vocabulary of ``--vocab`` (100,000) frequent ids per slot. Ground truth: every frequent id
has a hidden weight drawn from N(0, ``--sigma``² = 1.2²); one-shot ids weigh 0 (they carry
no learnable signal, by construction), and a sample's label is Bernoulli(sigmoid(bias +
the sum of its ids' weights)). The training split (``--samples``, 3M) and the held-out
test split (``--test-samples``, 200k) are drawn from the same distribution; the
Bayes-optimal test AUC (of the true probabilities) is printed beside the models' as their
ceiling. At the default sizes about two thirds of the distinct training ids are seen once
(one-shot ids and the rarest Zipf ranks), so frequency >= 2 keeps about a third of the
rows, and the frequent ids repeat enough for the unbounded model to reach within ~0.03 of
the Bayes AUC (0.83 against 0.856).

Model: a logistic regression over the sum of the slots' embeddings (dim ``--dim``, a dense
weight vector and bias trained here by SGD), with the embeddings in the REAL Cython store
(``CEmbeddingStore``, in process, Adagrad): per batch one training lookup of every slot's ids
(prefixed by feature group, ``feature_index_prefix_bit`` 8, as the workers send them),
forward, gradients, one ``store.update`` (``--optimizer sgd``: the store keeps no optimizer
state, as a float16 row's share of the memory is then largest). One pass over the
training split, then test AUC from inference lookups (``train=False``: an id not stored reads zeros).

Configurations (one fresh store each, same stream):
  - ``unbounded``: no policy, capacity above the stream's distinct ids (the reference);
  - ``lru``: no policy, global capacity ``--lru-fraction`` of the unbounded run's rows;
  - ``freq2``: ``SlotPolicy(min_count=2)`` on every slot (an id gets a row at its 2nd
    training lookup);
  - ``ttl``: ``SlotPolicy(ttl_steps=--ttl-steps)`` on every slot, ``expire()`` every 10
    batches (steps are training lookup calls: one per batch here);
  - ``fp16``: ``SlotPolicy(dtype="float16")`` on every slot.
Rows and bytes are the store's own (``len(store)``, ``memory_bytes()``) at the end of
training; rows per GiB = rows * 2**30 / bytes.

A configuration left out of ``--configs`` has null JSON figures.

Targets, printed beside the figures: freq2 holds <= 0.5x the rows of unbounded at an AUC
loss <= 0.002; fp16 holds >= 1.9x the rows per GiB of fp32 (the unbounded run) at an AUC
loss <= 0.001. Losses are positive numbers: reference AUC minus the policy's AUC. The
fp16 ratio counts the whole store (row ids, LRU links, hash table, optimizer state kept in
float32), so its ceiling for a given dim and optimizer is printed too: a float16 row halves
only the weights.

adult_income with float16 rows (issue 20: "also on adult_income"): run the example job
twice, once as shipped and once with ``dtype: float16`` added to every slot of a copy of
its ``embedding_config.yml``, and compare the test AUC of the two reports (see
``--adult-help``, which prints the exact commands).

Usage: ``python load_tests/bench_policies.py [--samples N] [--json PATH] ...``; the default
sizes run in under a minute on 2 cores (``--samples`` scales the training split).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from stream_persia.core.embedding_config import SlotPolicy  # noqa: E402
from stream_persia.core.optim import SGD, Adagrad, Optimizer  # noqa: E402
from stream_persia.kernels.ids import index_prefix, prefix_ids  # noqa: E402
from stream_persia.nn.utils import roc_auc  # noqa: E402
from stream_persia.server.store import CEmbeddingStore  # noqa: E402

PREFIX_BITS = 8

TARGETS = {"freq2_rows_vs_unbounded": ("<=", 0.5), "freq2_auc_loss": ("<=", 0.002),
           "fp16_rows_per_gib_vs_fp32": (">=", 1.9), "fp16_auc_loss": ("<=", 0.001)}

ADULT_HELP = """\
adult_income with float16 rows, from the project root: the
topology as shipped and a copy whose slots all have dtype float16 (the copy takes the
whole topologies/ folder: the roles import topologies/common.py), then their test AUCs.

  d=$(mktemp -d) && cp -r topologies "$d/topologies"
  python3 -c 'import sys, yaml; p = sys.argv[1]; c = yaml.safe_load(open(p)); [s.update(dtype="float16") for s in c["slots_config"].values()]; yaml.safe_dump(c, open(p, "w"), sort_keys=False)' "$d/topologies/adult_income/embedding_config.yml"
  stream-persia run topologies/adult_income --data-dir ../shared/data/adult --output-dir "$d/fp32"
  stream-persia run "$d/topologies/adult_income" --data-dir ../shared/data/adult --output-dir "$d/fp16"
  python3 -c 'import json, sys; a, b = (json.load(open(f"{sys.argv[1]}/{r}/report.json"))["auc"] for r in ("fp32", "fp16")); print({t: round(a[t] - b[t], 5) for t in a})' "$d"

Target: the printed loss (float32 test AUC minus float16 test AUC) <= 0.001.
"""


@dataclass(frozen=True)
class Split:
    ids: np.ndarray      # uint64 (n, slots), prefixed per slot as the workers send them
    labels: np.ndarray   # float32 (n,)
    truth: np.ndarray    # float64 (n,), the true probability of label 1


class Stream:
    """The synthetic stream: Zipf frequent ids with hidden weights, one-shot ids without."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        ranks = np.arange(1, args.vocab + 1, dtype=np.float64)
        cdf = np.cumsum(ranks ** -args.zipf)
        self.cdf = cdf / cdf[-1]
        self.weights = self.rng.normal(0.0, args.sigma, (args.slots, args.vocab))
        self.next_one_shot = args.vocab   # raw one-shot ids count up from the vocabulary
        self.prefixes = [index_prefix(s, PREFIX_BITS) for s in range(args.slots)]

    def split(self, n: int) -> Split:
        a = self.args
        raw = np.empty((n, a.slots), np.uint64)
        logit = np.full(n, a.bias, np.float64)
        for s in range(a.slots):
            rank = np.searchsorted(self.cdf, self.rng.random(n))
            rank = np.minimum(rank, a.vocab - 1)
            tail = self.rng.random(n) < a.tail
            logit += np.where(tail, 0.0, self.weights[s, rank])
            k = int(tail.sum())
            col = rank.astype(np.uint64)
            col[tail] = np.arange(self.next_one_shot, self.next_one_shot + k, dtype=np.uint64)
            self.next_one_shot += k
            raw[:, s] = prefix_ids(col, index_prefix=self.prefixes[s], prefix_bits=PREFIX_BITS)
        truth = 1.0 / (1.0 + np.exp(-logit))
        labels = (self.rng.random(n) < truth).astype(np.float32)
        return Split(raw, labels, truth)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


def new_store(capacity: int, args: argparse.Namespace, eviction_log: int) -> Any:
    if CEmbeddingStore is None:
        raise SystemExit("the Cython store is not built (see the README's build step)")
    return CEmbeddingStore(capacity, store_optimizer(args), eviction_log=eviction_log)


def policies_for(name: str, args: argparse.Namespace) -> list[Any]:
    """set_policies' list for a configuration (index g + 1 for slot g; 0: the default)."""
    kw: dict[str, Any] = {"freq2": {"min_count": 2}, "ttl": {"ttl_steps": args.ttl_steps},
                          "fp16": {"dtype": "float16"}}[name]
    return [None] + [SlotPolicy(**kw) for _ in range(args.slots)]


def run_config(name: str, capacity: int, train: Split, test: Split,
               args: argparse.Namespace) -> dict[str, Any]:
    """Train one fresh store (and dense weights) on the training split; test AUC and size."""
    store = new_store(capacity, args, args.eviction_log)
    try:
        if name in ("freq2", "ttl", "fp16"):
            store.set_policies(PREFIX_BITS, policies_for(name, args))
        return train_and_test(name, store, train, test, args)
    finally:
        store.close()


def train_and_test(name: str, store: Any, train: Split, test: Split,
                   args: argparse.Namespace) -> dict[str, Any]:
    dim, slots, b = args.dim, args.slots, args.batch
    rng = np.random.default_rng(args.seed + 1)   # same dense init for every configuration
    w = (rng.standard_normal(dim) / np.sqrt(dim) + 1.0 / np.sqrt(dim)).astype(np.float64)
    bias = 0.0
    expired = 0
    t0 = time.perf_counter()
    for step, i in enumerate(range(0, len(train.labels), b)):
        ids = train.ids[i:i + b]
        y = train.labels[i:i + b].astype(np.float64)
        n = len(y)
        flat = np.ascontiguousarray(ids.T).reshape(-1)   # slot-major: slot s at [s*n:(s+1)*n]
        emb = store.lookup(flat, dim, True).reshape(slots, n, dim).sum(axis=0, dtype=np.float64)
        p = sigmoid(emb @ w + bias)
        err = p - y                                       # dLoss/dlogit of the mean BCE * n
        grad_emb = (err[:, None] * w[None, :]).astype(np.float32)
        store.update(flat, np.tile(grad_emb, (slots, 1)))
        w -= args.dense_lr * (err @ emb) / n
        bias -= args.dense_lr * float(err.mean())
        if name == "ttl" and step % 10 == 9:
            expired += store.expire(max_rows=1 << 20)
    train_s = time.perf_counter() - t0
    rows, nbytes = len(store), store.memory_bytes()
    scores = np.empty(len(test.labels))
    for i in range(0, len(test.labels), b):
        ids = test.ids[i:i + b]
        flat = np.ascontiguousarray(ids.T).reshape(-1)
        emb = store.lookup(flat, dim, False).reshape(slots, len(ids), dim).sum(axis=0)
        scores[i:i + b] = emb.astype(np.float64) @ w + bias
    out: dict[str, Any] = {
        "rows": rows, "bytes": nbytes, "bytes_per_row": nbytes / max(rows, 1),
        "rows_per_gib": rows * 2**30 / nbytes if nbytes else 0.0,
        "auc": roc_auc(test.labels, scores), "train_s": train_s}
    out["policy_stats"] = {str(k): v for k, v in store.policy_stats().items()}
    if name == "ttl":
        out["expired"] = expired
    return out


def store_optimizer(args: argparse.Namespace) -> Optimizer:
    if args.optimizer == "sgd":
        return SGD(lr=args.emb_lr)
    return Adagrad(lr=args.emb_lr, initial_accumulator_value=args.acc_init)


def fp16_ceiling(dim: int, state_width: int, overhead: float) -> float:
    """Rows per GiB of float16 over float32 rows when only the weights shrink."""
    return (4 * dim + 4 * state_width + overhead) / (2 * dim + 4 * state_width + overhead)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--samples", type=int, default=3_000_000, help="training samples")
    ap.add_argument("--test-samples", type=int, default=200_000, help="held-out samples")
    ap.add_argument("--slots", type=int, default=3, help="ID slots (one feature group each)")
    ap.add_argument("--vocab", type=int, default=100_000, help="frequent ids per slot")
    ap.add_argument("--zipf", type=float, default=1.05, help="exponent of the frequent ids")
    ap.add_argument("--tail", type=float, default=0.05,
                    help="probability that an id is a one-shot id")
    ap.add_argument("--sigma", type=float, default=1.2, help="std of the hidden weights")
    ap.add_argument("--bias", type=float, default=-0.5, help="hidden bias (label balance)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--optimizer", choices=("adagrad", "sgd"), default="adagrad",
                    help="the store's optimizer (SGD keeps no per-row state)")
    ap.add_argument("--emb-lr", type=float, default=0.15, help="lr of the store's optimizer")
    ap.add_argument("--acc-init", type=float, default=0.1,
                    help="Adagrad initial accumulator of the store")
    ap.add_argument("--dense-lr", type=float, default=0.05, help="SGD lr of w and bias")
    ap.add_argument("--lru-fraction", type=float, default=0.5,
                    help="LRU capacity as a fraction of the unbounded run's rows")
    ap.add_argument("--ttl-steps", type=int, default=100,
                    help="TTL in training lookup calls (batches)")
    ap.add_argument("--eviction-log", type=int, default=1024,
                    help="eviction log entries of every store (bytes count in memory)")
    ap.add_argument("--configs", default="unbounded,lru,freq2,ttl,fp16",
                    help="comma-separated configurations to run (unbounded always runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adult-help", action="store_true",
                    help="print the adult_income float16 commands and exit")
    args = ap.parse_args(argv)
    if args.adult_help:
        print(ADULT_HELP)
        return {}
    for flag in ("samples", "test_samples", "slots", "vocab", "dim", "batch", "ttl_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.tail < 1.0 or not 0.0 < args.lru_fraction <= 1.0:
        ap.error("--tail must be in [0, 1) and --lru-fraction in (0, 1]")
    if args.slots >= (1 << PREFIX_BITS) - 1:
        ap.error(f"--slots must be < {(1 << PREFIX_BITS) - 1}")
    wanted = ["unbounded"] + [c for c in args.configs.split(",") if c and c != "unbounded"]
    unknown = set(wanted) - {"unbounded", "lru", "freq2", "ttl", "fp16"}
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}")

    t0 = time.perf_counter()
    stream = Stream(args)
    train = stream.split(args.samples)
    test = stream.split(args.test_samples)
    distinct = len(np.unique(train.ids))
    bayes = roc_auc(test.labels, test.truth)
    print(f"stream: {args.samples:,} training samples x {args.slots} slots, {distinct:,} "
          f"distinct ids; test {args.test_samples:,}; label rate {train.labels.mean():.3f}; "
          f"Bayes-optimal test AUC {bayes:.4f} ({time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)

    table: dict[str, dict[str, Any]] = {}
    capacity = distinct + 1024
    for name in wanted:
        if name == "lru":
            capacity = max(1, int(args.lru_fraction * table["unbounded"]["rows"]))
        print(f"{name} ...", file=sys.stderr)
        table[name] = run_config(name, capacity, train, test, args)
        capacity = distinct + 1024

    ref = table["unbounded"]
    for r in table.values():
        r["rows_vs_unbounded"] = r["rows"] / ref["rows"]
        r["auc_loss"] = ref["auc"] - r["auc"]
    f2, f16 = table.get("freq2", {}), table.get("fp16", {})
    opt = store_optimizer(args)
    overhead = ref["bytes_per_row"] - 4 * (args.dim + opt.state_width(args.dim))
    res: dict[str, Any] = {
        "freq2_rows_vs_unbounded": f2.get("rows_vs_unbounded"),
        "freq2_auc_loss": f2.get("auc_loss"),
        "fp16_rows_per_gib_vs_fp32": (f16["rows_per_gib"] / ref["rows_per_gib"]
                                      if "rows" in f16 else None),
        "fp16_auc_loss": f16.get("auc_loss"),
        "fp16_rows_per_gib_ceiling": fp16_ceiling(args.dim, opt.state_width(args.dim),
                                                  overhead),
        "bayes_auc": bayes, "distinct_train_ids": distinct,
        "table": table,
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "adult_help")},
    }

    print(f"{'':10}{'rows':>12}{'x unbnd':>9}{'MiB':>9}{'B/row':>8}{'test AUC':>10}"
          f"{'loss':>9}{'train s':>9}")
    for name, r in table.items():
        print(f"{name:10}{r['rows']:12,}{r['rows_vs_unbounded']:9.3f}{r['bytes'] / 2**20:9.1f}"
              f"{r['bytes_per_row']:8.1f}{r['auc']:10.4f}{r['auc_loss']:9.4f}{r['train_s']:9.1f}")
    print(f"Bayes-optimal test AUC {bayes:.4f}; unbounded's lift above chance is "
          f"{(ref['auc'] - 0.5) / (bayes - 0.5):.0%} of the Bayes-optimal lift")
    for key, (op, target) in TARGETS.items():
        v = res[key]
        if v is None:
            print(f"{key}: not run   (target {op} {target})")
        else:
            ok = v <= target if op == "<=" else v >= target
            print(f"{key}: {v:.4f}   (target {op} {target}: {'met' if ok else 'NOT met'})")
    print(f"fp16 rows per GiB ceiling with this dim and optimizer (only the weights halve, "
          f"{overhead:.0f} B/row of ids, links and table): "
          f"{res['fp16_rows_per_gib_ceiling']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
