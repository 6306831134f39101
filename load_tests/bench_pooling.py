"""Pooled batches/s of the embedding worker's pure logic against a torch EmbeddingBag baseline.

A batch of 1024 samples with 26 slots (dim 16; 20 summation, 4 summation with sqrt
scaling, 2 raw with ``sample_fixed_size`` 10), Poisson(3) ids per sample (so some samples
are empty) drawn Zipf(1.2) from a large vocabulary. One timed iteration is the worker's
whole per-batch CPU path: plan every slot, merge lookups per dim, pool from the fetched
rows, and reduce a gradient for every slot back to the servers' ids. The rows "fetched"
are made once per batch outside the timing.

Baseline, same invocation, same work: per slot, prefix the ids, ``torch.unique`` them,
``embedding_bag`` (``embedding`` + mask for raw slots) over a leaf tensor of the unique
rows, and ``backward`` a gradient to get one gradient row per unique id: what a worker
written directly in torch autograd would do, one lookup per slot.

The third line is the worker's path since summation slots are pooled on the servers
(``stream_persia.worker.batchplan``): plan (one hash de-duplication per dim), assemble the
outputs from the servers' sums, reduce the gradients. What moved to the server, pooling
the fetched rows (``segments.pool``), is timed on its own line.

Run: ``python load_tests/bench_pooling.py [--batch 1024] [--slots 26] [--repeat 30]``.
Figures are machine-dependent; read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from stream_persia.kernels import segments
from stream_persia.kernels.ids import prefix_ids
from stream_persia.worker import batchplan
from stream_persia.worker.pooling import merge_lookups, pool_batch
from stream_persia.worker.shards import PooledLookup

DIM, PREFIX_BITS = 16, 8


@dataclass(frozen=True)
class HashStack:
    hash_stack_rounds: int = 0
    embedding_size: int = 0


@dataclass(frozen=True)
class Slot:
    name: str
    dim: int = DIM
    sample_fixed_size: int = 10
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    hash_stack_config: HashStack = field(default_factory=HashStack)
    index_prefix: int = 0


@dataclass
class Schema:
    slots: dict
    feature_index_prefix_bit: int = PREFIX_BITS

    def slot(self, name):
        return self.slots[name]


@dataclass
class Feature:
    name: str
    values: np.ndarray
    offsets: np.ndarray


def make_schema(n_slots: int) -> Schema:
    slots = {}
    for i in range(n_slots):
        raw, sqrt = i >= n_slots - 2, n_slots - 6 <= i < n_slots - 2
        slots[f"s{i}"] = Slot(f"s{i}", embedding_summation=not raw, sqrt_scaling=sqrt,
                              index_prefix=(i + 1) << (64 - PREFIX_BITS))
    return Schema(slots)


def make_batch(schema: Schema, batch: int, rng: np.random.Generator) -> list[Feature]:
    features = []
    for name in schema.slots:
        counts = rng.poisson(3, batch)
        offsets = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ranks = rng.zipf(1.2, int(offsets[-1])).astype(np.uint64)
        features.append(Feature(name, ranks * np.uint64(0x9E3779B97F4A7C15), offsets))
    return features


def plan_classic(features, schema):
    """Every slot pooled on the worker (the path before server pooling)."""
    return batchplan.plan_batch(features, schema, server_pooling=False)


def ours(schema, features, rows_by_dim):
    plan = plan_classic(features, schema)
    plans = plan.classic
    merged = merge_lookups(plans)
    if rows_by_dim is None:  # first call for this batch: "fetch" the rows
        rng = np.random.default_rng(0)
        return {d: rng.standard_normal((len(m.ids), d)).astype(np.float32)
                for d, m in merged.items()}
    outputs = pool_batch(plans, merged, rows_by_dim)
    grads = {n: np.ones_like(o.embeddings) for n, o in outputs.items()}
    return batchplan.reduce_gradients(plan, grads)


def fetch_pooled(plan):
    """What the servers would answer a batch plan with: random rows for the classic
    lookups, and pooled sums of random rows for the pooled ones."""
    rng = np.random.default_rng(0)
    merged, groups = plan.lookup_groups()
    rows = [rng.standard_normal((len(g.ids), g.dim)).astype(np.float32) for g in groups]
    results = [segments.pool(r, g.index, g.offsets) if isinstance(g, PooledLookup) else r
               for g, r in zip(groups, rows, strict=True)]
    return merged, groups, rows, results


def ours_pooled(schema, features, results):
    plan = batchplan.plan_batch(features, schema)
    merged, _ = plan.lookup_groups()
    outputs = plan.outputs(merged, results)
    grads = {n: np.ones_like(o.embeddings) for n, o in outputs.items()}
    return batchplan.reduce_gradients(plan, grads)


def baseline(schema, features):
    result = []
    for f in features:
        slot = schema.slot(f.name)
        ids = prefix_ids(f.values, index_prefix=slot.index_prefix, prefix_bits=PREFIX_BITS)
        offsets = torch.from_numpy(f.offsets)
        counts = offsets[1:] - offsets[:-1]
        if not slot.embedding_summation:  # keep the first sample_fixed_size ids
            pos = torch.arange(len(ids)) - torch.repeat_interleave(offsets[:-1], counts)
            keep = (pos < slot.sample_fixed_size).numpy()
            ids, pos = ids[keep], pos[keep]
        unique, inverse = torch.unique(torch.from_numpy(ids.view(np.int64)),
                                       return_inverse=True)
        rows = torch.randn(len(unique), slot.dim, requires_grad=True)
        if slot.embedding_summation:
            out = torch.nn.functional.embedding_bag(inverse, rows, offsets[:-1], mode="sum")
            if slot.sqrt_scaling:
                out = out * counts.clamp(min=1).rsqrt()[:, None]
        else:
            index = torch.zeros(len(counts), slot.sample_fixed_size, dtype=torch.int64)
            samples = torch.repeat_interleave(torch.arange(len(counts)), counts)
            index[samples[torch.from_numpy(keep)], pos] = inverse + 1
            padded = torch.cat([torch.zeros(1, slot.dim), rows])
            out = torch.nn.functional.embedding(index, padded) * (index > 0)[..., None]
        out.backward(torch.ones_like(out))
        result.append((unique, rows.grad))
    return result


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=26)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the worker's event loop thread; no intra-op fan-out
    schema = make_schema(args.slots)
    features = make_batch(schema, args.batch, np.random.default_rng(1))
    rows = ours(schema, features, None)
    nnz = sum(len(f.values) for f in features)
    print(f"batch {args.batch} x {args.slots} slots, {nnz} ids, "
          f"{sum(len(r) for r in rows.values())} distinct; median of {args.repeat} runs")

    classic = plan_classic(features, schema)
    plans = classic.classic
    merged = merge_lookups(plans)
    outputs = pool_batch(plans, merged, rows)
    grads = {n: np.ones_like(o.embeddings) for n, o in outputs.items()}
    stages = {
        "plan_batch": lambda: plan_classic(features, schema),
        "merge_lookups": lambda: merge_lookups(plans),
        "pool_batch": lambda: pool_batch(plans, merged, rows),
        "reduce_gradients (classic)": lambda: batchplan.reduce_gradients(classic, grads),
    }
    base = timed(lambda: baseline(schema, features), args.repeat)
    print(f"{'baseline (torch embedding_bag + autograd)':44s} {1 / base:9.1f} batches/s  1.00x")
    for impl in ("torch", "numpy"):
        segments.SEGMENT_SUM_IMPLEMENTATION = impl
        t = timed(lambda: ours(schema, features, rows), args.repeat)
        print(f"{'stream-persia, segment sums: ' + impl:44s} {1 / t:9.1f} batches/s "
              f"{base / t:5.2f}x")
        for name, fn in stages.items():
            print(f"    {name:40s} {timed(fn, args.repeat) * 1e3:8.2f} ms")

    segments.SEGMENT_SUM_IMPLEMENTATION = "torch"
    plan = batchplan.plan_batch(features, schema)
    merged, groups, fetched, results = fetch_pooled(plan)
    outputs = plan.outputs(merged, results)
    grads = {n: np.ones_like(o.embeddings) for n, o in outputs.items()}
    t = timed(lambda: ours_pooled(schema, features, results), args.repeat)
    print(f"{'stream-persia, pooled on the servers':44s} {1 / t:9.1f} batches/s "
          f"{base / t:5.2f}x")
    pooled_stages = {
        "plan_batch (batchplan)": lambda: batchplan.plan_batch(features, schema),
        "outputs": lambda: plan.outputs(merged, results),
        "reduce_gradients": lambda: batchplan.reduce_gradients(plan, grads),
        "(on the server) segments.pool": lambda: [
            segments.pool(r, g.index, g.offsets) for g, r in zip(groups, fetched, strict=True)
            if isinstance(g, PooledLookup)],
    }
    for name, fn in pooled_stages.items():
        print(f"    {name:40s} {timed(fn, args.repeat) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
