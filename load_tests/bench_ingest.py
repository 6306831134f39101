"""Ingest throughput: Kafka → embedding worker → embedding server → a pulling NN client.

The issue's benchmark. Batches of 1,024 samples × 26 ID slots (1–5 ids per sample, dim 16,
summation) are produced to the test broker (librdkafka's mock cluster), consumed by one
embedding worker process that looks their ids up on one embedding server process and
serves them to this process, which pulls with ``--concurrency`` pipelined ``next_batch``
calls and pushes empty gradients (``{slot: None}``) so each batch is released; nothing is
trained. The baseline, run in the same invocation on the same records, only consumes the
topic with aiokafka (through :class:`~stream_persia.kafka.SampleConsumer`, as the worker
does) and decodes every message with ``PersiaBatch.from_bytes``: the ceiling of any
Kafka client. Target: ≥ 0.5× that ceiling.

The summation slots are pooled on the server (``stream_persia.worker.batchplan``): the
worker sends a batch's distinct ids with the segment structure and gets back the
``(26 x 1,024, 16)`` sums, 1.7 MB instead of 5 MB of rows; the server adds the rows where
they lie in its store (``EmbeddingStore.lookup_pooled``).

Every process here, the baseline's included, keeps freed memory for reuse
(``stream_persia.launch.memory.keep_freed_memory``, as the roles do): with glibc's defaults the
consume-only baseline alternated between rounds at ~450k and ~650k samples/s (page faults
on fresh buffers), which made the ratio swing with it.

Each repeat pauses the worker's ingest, produces a fresh round of batches (the mock keeps
only ~5 MiB per partition, so a round is spread over ``--partitions`` with at most ~4
batches of ~0.9 MB each per partition), times the baseline reading it, then resumes the
worker and times the pipeline. Throughput is steady state: from the arrival of batch
``--warmup`` to the last one. Figures are medians over ``--repeats``, leaving out the first
round: the server's table is empty then and grows through it (page faults on new rows:
13–15 ms of server CPU per batch against ~5 ms after), which is start-up, not steady state;
it is still printed and kept in the JSON.

Next to the measured ratio it prints the CPU milliseconds each process (worker, server,
this client, the broker) spent per batch, read from ``/proc`` (with the part spent in the
kernel: socket copies, page faults), and the ratio a machine with a free core per process
would reach (the busiest process sets the pace). On a small shared machine the four
processes compete for the cores and the measured ratio is far below that estimate; the
CPU figures are what to compare across changes. Last, it prints a floor: the baseline's
consume-and-decode CPU plus the CPU of the server's pooled store lookups alone (the same
ids and segments, timed in this process), which every pipeline spends at least; divided
over the machine's cores, it bounds the ratio any pipeline could reach here. With it, the
part of those lookups that keeps the LRU order (train minus eval mode), which is all a
cheaper eviction policy could save; and the same sums over rows whose place is already
known (a layout-free gather: no hashing, no LRU, one cache line per id), what the store
spends beyond which a more compact layout could save, with the floor the pipeline would
have at that cost::

    python load_tests/bench_ingest.py [--batches 64] [--repeats 5] [--zipf 1.2]
        [--store-threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stream_persia.config import load_embedding_config
from stream_persia.core import aio
from stream_persia.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch
from stream_persia.embedding.optim import Adagrad
from stream_persia.kafka import SampleConsumer, create_producer
from stream_persia.kernels import segments
from stream_persia.launch import memory as launch
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.server.store import EmbeddingStore
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.worker import batchplan

MAX_BATCH_BYTES = 4 * 1024 * 1024


def slot_names(n: int) -> list[str]:
    return [f"slot_{i:02d}" for i in range(n)]


def embedding_yaml(slots: int, dim: int) -> str:
    lines = ["feature_index_prefix_bit: 8", "slots_config:"]
    lines += [f"  {name}: {{dim: {dim}}}" for name in slot_names(slots)]
    return "\n".join(lines) + "\n"


def draw_ids(rng: np.random.Generator, n: int, vocab: int, zipf: float) -> np.ndarray:
    """``n`` ids below ``vocab``: uniform when ``zipf`` is 0, else Zipf-distributed with
    exponent ``zipf`` (a few hot ids, a long tail, as in CTR logs), scrambled so that hot
    ids are not the small ones."""
    if zipf <= 0:
        return rng.integers(0, vocab, size=n).astype(np.uint64)
    ranks = (rng.zipf(zipf, size=n) - 1) % vocab
    return ((ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(vocab))


def make_batches(n: int, batch_size: int, slots: int, vocab: int, seed: int,
                 zipf: float = 0.0) -> list[bytes]:
    """Encoded batches: per sample and slot 1–5 ids below ``vocab`` (see :func:`draw_ids`)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        feats = []
        for name in slot_names(slots):
            lens = rng.integers(1, 6, size=batch_size)
            offsets = np.zeros(batch_size + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            values = draw_ids(rng, int(offsets[-1]), vocab, zipf)
            feats.append(IDTypeFeature.from_csr(name, values, offsets))
        dense = rng.normal(size=(batch_size, 13)).astype(np.float32)
        label = (rng.random((batch_size, 1)) < 0.25).astype(np.float32)
        out.append(PersiaBatch(feats, non_id_type_features=[NonIDTypeFeature(dense, "dense")],
                               labels=[Label(label, "click")]).to_bytes())
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU time of a process (Linux /proc; zeros elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_snapshot(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def steady_rate(arrivals: list[float], batch_size: int, warmup: int) -> float:
    """Samples/s from the ``warmup``-th arrival to the last."""
    arrivals = sorted(arrivals)
    span = arrivals[-1] - arrivals[warmup]
    return (len(arrivals) - 1 - warmup) * batch_size / span


async def produce(bootstrap: str, topic: str, payloads: list[bytes], partitions: int,
                  first_key: int) -> None:
    """Round-robin over the partitions (keys would hash unevenly and overflow the mock's
    per-partition retention)."""
    producer = await create_producer(bootstrap, max_message_bytes=MAX_BATCH_BYTES)
    try:
        sends = [await producer.send(topic, payload, key=str(first_key + i).encode(),
                                     partition=i % partitions)
                 for i, payload in enumerate(payloads)]
        await asyncio.gather(*sends)
    finally:
        await producer.stop()


async def consume_only(bootstrap: str, topic: str, start: dict[int, int], n: int,
                       timeout_s: float) -> list[float]:
    """The baseline: read ``n`` records from ``start`` and decode each; arrival times."""
    consumer = SampleConsumer(bootstrap, topic, max_message_bytes=MAX_BATCH_BYTES)
    await consumer.start(start)
    arrivals: list[float] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(arrivals) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"consume-only read {len(arrivals)} of {n} records")
            for records in (await consumer.getmany(timeout_ms=200, max_records=32)).values():
                for rec in records:
                    PersiaBatch.from_bytes(rec.value)
                    arrivals.append(time.perf_counter())
    finally:
        await consumer.stop()
    return arrivals


async def pull(worker: RpcClient, n: int, slots: list[str], concurrency: int,
               timeout_s: float) -> list[float]:
    """Pipelined pulls, each released with empty gradients; arrival times."""
    arrivals: list[float] = []
    claimed = 0
    deadline = time.monotonic() + timeout_s
    no_grads = dict.fromkeys(slots)

    async def lane() -> None:
        nonlocal claimed
        while claimed < n:
            claimed += 1
            while (served := await worker.call("next_batch", {"timeout_ms": 1000})) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the pipeline served {len(arrivals)} of {n} batches")
            arrivals.append(time.perf_counter())
            await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": no_grads})

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return arrivals


async def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = SampleConsumer(bootstrap, topic, max_message_bytes=MAX_BATCH_BYTES)
    await consumer.start()
    try:
        return await consumer.end_offsets()
    finally:
        await consumer.stop()


async def run_rounds(args: argparse.Namespace, bootstrap: str, topic: str,
                     worker_address: str, pids: dict[str, int]) -> list[dict]:
    slots = slot_names(args.slots)
    rounds = []
    async with RpcClient(worker_address, timeout_ms=60_000) as worker:
        for r in range(args.repeats):
            payloads = make_batches(args.batches, args.batch_size, args.slots, args.vocab,
                                    seed=1000 + r, zipf=args.zipf)
            await worker.call("pause_ingest")
            await asyncio.sleep(0.5)  # let a poll already under way return
            start = await end_offsets(bootstrap, topic)
            await produce(bootstrap, topic, payloads, args.partitions, first_key=r * args.batches)
            base_cpu0 = time.process_time()
            base = await consume_only(bootstrap, topic, start, args.batches, args.timeout)
            base_cpu = (time.process_time() - base_cpu0) * 1000 / args.batches
            cpu0 = cpu_snapshot(pids)
            await worker.call("resume_ingest")
            pipe = await pull(worker, args.batches, slots, args.concurrency, args.timeout)
            cpu1 = cpu_snapshot(pids)
            status = await worker.call("status")
            rounds.append({
                "consume_only_samples_per_s": steady_rate(base, args.batch_size, args.warmup),
                "samples_per_s": steady_rate(pipe, args.batch_size, args.warmup),
                "message_bytes": int(np.mean([len(p) for p in payloads])),
                "worker_ready_after": status["ready"],
                "consume_only_cpu_ms_per_batch": round(base_cpu, 2),
                # CPU ms each process spent per batch during the pipeline stage, and the
                # part of it spent in the kernel (sockets, page faults).
                "cpu_ms_per_batch": {k: round((sum(cpu1[k]) - sum(cpu0[k])) * 1000
                                              / args.batches, 2) for k in pids},
                "sys_ms_per_batch": {k: round((cpu1[k][1] - cpu0[k][1]) * 1000
                                              / args.batches, 2) for k in pids},
            })
            print(f"  repeat {r}: pipeline {rounds[-1]['samples_per_s']:10.0f} samples/s, "
                  f"consume-only {rounds[-1]['consume_only_samples_per_s']:10.0f} samples/s, "
                  f"CPU ms/batch {rounds[-1]['cpu_ms_per_batch']} "
                  f"(kernel {rounds[-1]['sys_ms_per_batch']})", flush=True)
    return rounds


def store_lookup_ms(args: argparse.Namespace, config_path: Path) -> dict[str, float]:
    """CPU ms per batch of the server's store work alone, in this process.

    ``train``: the pooled lookups (``EmbeddingStore.lookup_pooled``, train mode) of the last
    round's batches as the worker plans them, in a store that has seen every round's
    batches, as the server's has by then. Part of the floor that no pipeline goes below
    (with the baseline's consume and decode): every id must be looked up and every
    occurrence summed, whichever process sums it.

    ``eval``: the same lookups in eval mode, which keeps no LRU order: the difference is
    what the LRU upkeep costs (what a cheaper eviction policy could save).

    ``gather``: the same work for a store that knew each row's place without looking
    (no hashing, no probing, no LRU: one cache line per id at dim 16): each distinct id of
    the round gets a fixed random row of an array as large as the store's table, fetched
    with ``np.take``, then the same segment sums (``segments.pool``). An id keeps its row
    over the batches, so hot ids stay as cached as they are in the store. What the store
    spends over this is what a more compact layout of the same rows could save."""
    schema = load_embedding_config(config_path)
    store = EmbeddingStore(1_000_000_000, Adagrad())
    last: list[batchplan.PooledGroup] = []
    for r in range(args.repeats):
        last = [batchplan.plan_batch(PersiaBatch.from_bytes(p).id_type_features, schema,
                                     requires_grad=False).pooled[args.dim]
                for p in make_batches(args.batches, args.batch_size, args.slots, args.vocab,
                                      seed=1000 + r, zipf=args.zipf)]
        for g in last:
            store.lookup(g.ids, args.dim, True)
    spent = {}
    for mode in ("train", "eval"):
        t0 = time.process_time()
        for g in last:
            store.lookup_pooled(g.ids, args.dim, g.index, g.offsets, mode == "train")
        spent[mode] = (time.process_time() - t0) * 1000 / len(last)
    held = len(store)
    store.close()
    rng = np.random.default_rng(7)
    table = rng.random((held, args.dim), dtype=np.float32)
    seen = np.unique(np.concatenate([g.ids for g in last]))
    rows_of = rng.choice(held, size=len(seen), replace=False)   # fixed, scattered
    rows = [rows_of[np.searchsorted(seen, g.ids)] for g in last]
    buf = np.empty((max(len(g.ids) for g in last), args.dim), dtype=np.float32)
    t0 = time.process_time()
    for g, r in zip(last, rows, strict=True):
        got = buf[:len(r)]
        np.take(table, r, axis=0, out=got)
        segments.pool(got, g.index, g.offsets)
    spent["gather"] = (time.process_time() - t0) * 1000 / len(last)
    return spent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=64, help="batches per repeat")
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds; the first warms the server's table up and is not counted")
    p.add_argument("--warmup", type=int, default=8, help="batches left out of the rate")
    p.add_argument("--concurrency", type=int, default=4, help="pipelined next_batch calls")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--slots", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=100_000, help="distinct ids per slot")
    p.add_argument("--zipf", type=float, default=0.0,
                   help="Zipf exponent of the ids (> 1; 0: uniform, the default and the "
                        "worst case for the store's caches)")
    p.add_argument("--store-threads", type=int, default=1,
                   help="the server's store_threads (internal shards on their own threads)")
    p.add_argument("--timeout", type=float, default=60.0, help="per stage, seconds")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.zipf and args.zipf <= 1:
        p.error("--zipf must be > 1 (or 0 for uniform ids)")
    if args.repeats < 2:
        p.error("--repeats must be >= 2 (the first round only warms the table up)")
    if args.batches <= args.warmup + 1:
        p.error("--batches must exceed --warmup + 1")
    per_partition = -(-args.batches // args.partitions)
    if per_partition > 4:
        p.error(f"{per_partition} batches per partition would outgrow the mock broker's "
                "~5 MiB per partition: raise --partitions")

    # The roles keep freed memory for reuse (launch.keep_freed_memory); so does this
    # process, or the baseline alternates between rounds that reuse memory and rounds
    # that fault in fresh pages (~25,000 faults, 1.7 against 2.5 ms CPU per batch), and
    # the ratio with it.
    launch.keep_freed_memory()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    (tmp / "embedding_config.yml").write_text(embedding_yaml(args.slots, args.dim))
    (tmp / "global_config.yml").write_text(
        f"kafka:\n  max_batch_bytes: {MAX_BATCH_BYTES}\n"
        "embedding_worker_config:\n  ready_buffer_batches: 16\n  rpc_timeout_ms: 60000\n")
    topic = "bench-ingest"
    with MockKafkaCluster() as cluster:
        cluster.create_topic(topic, args.partitions)
        server = RoleProcess("embedding-server", [
            "--global-config", str(tmp / "global_config.yml"),
            "--store-threads", str(args.store_threads)], log_path=tmp / "server.log")
        with server:
            worker = RoleProcess("embedding-worker", [
                "--embedding-config", str(tmp / "embedding_config.yml"),
                "--global-config", str(tmp / "global_config.yml"),
                "--embedding-servers", server.address,
                "--kafka", cluster.bootstrap_servers, "--topic", topic,
            ], log_path=tmp / "worker.log")
            with worker:
                pids = {"worker": worker.proc.pid, "server": server.proc.pid,
                        "client": os.getpid(), "broker": cluster.pid}
                rounds = aio.run(run_rounds(args, cluster.bootstrap_servers, topic,
                                            worker.address, pids))

    rounds_all, rounds = rounds, rounds[1:]   # the first round fills the table: start-up
    pipe = statistics.median(r["samples_per_s"] for r in rounds)
    base = statistics.median(r["consume_only_samples_per_s"] for r in rounds)
    ratio = pipe / base
    print()
    print(f"{'stage':<44}{'samples/s':>12}{'batches/s':>11}{'ratio':>8}")
    print(f"{'consume only (aiokafka + decode), baseline':<44}{base:>12.0f}"
          f"{base / args.batch_size:>11.1f}{1.0:>8.2f}")
    print(f"{'worker + server + pulling client':<44}{pipe:>12.0f}"
          f"{pipe / args.batch_size:>11.1f}{ratio:>8.2f}")
    cpu = {k: statistics.median(r["cpu_ms_per_batch"][k] for r in rounds)
           for k in rounds[0]["cpu_ms_per_batch"]}
    base_cpu = statistics.median(r["consume_only_cpu_ms_per_batch"] for r in rounds)
    print(f"CPU ms per batch: consume-only {base_cpu:.1f}; pipeline "
          + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
          + f" (total {sum(cpu.values()):.1f}; this machine has {os.cpu_count()} cores)")
    # With a core per process the stages overlap and the busiest process sets the pace:
    # an estimate of the ratio on a machine that is not short of cores (this one has 2
    # for 4 processes, and is shared), next to the measured one.
    cpu_bound_ratio = 1000 / max(cpu.values()) / (base / args.batch_size)
    print(f"ratio if every process had its own core (CPU-time bound): {cpu_bound_ratio:.2f}")
    # The floor: the worker consumes and decodes as the baseline does, and the server looks
    # every distinct id up; RPC, pooling, serving, the client and the broker only add. With
    # the cores shared perfectly, no pipeline on this machine beats this ratio.
    store_ms = store_lookup_ms(args, tmp / "embedding_config.yml")
    lookup_ms, eval_lookup_ms, gather_ms = store_ms["train"], store_ms["eval"], store_ms["gather"]
    shutil.rmtree(tmp, ignore_errors=True)  # kept only when a run fails (the roles' logs)
    floor_ms = base_cpu + lookup_ms
    cores = os.cpu_count() or 1
    floor_ratio = cores * (1000 * args.batch_size / base) / floor_ms
    print(f"floor: consume + decode {base_cpu:.1f} ms + pooled store lookups {lookup_ms:.1f} ms "
          f"(train mode, same ids, in this process) = {floor_ms:.1f} ms CPU per batch; on "
          f"{cores} cores no pipeline exceeds {floor_ratio:.2f}x consume-only")
    print(f"of the lookups, LRU upkeep: {lookup_ms - eval_lookup_ms:.1f} ms (eval mode, which "
          f"keeps no LRU order, {eval_lookup_ms:.1f} ms)")
    # What a more compact store layout could gain: the same sums over rows whose place is
    # known, one cache line per id (see store_lookup_ms), and the floor the pipeline would
    # have with lookups that cheap.
    gather_floor = cores * (1000 * args.batch_size / base) / (base_cpu + gather_ms)
    print(f"a layout-free gather of the same rows + the same sums: {gather_ms:.1f} ms; the "
          f"store spends {lookup_ms / gather_ms:.2f}x that. With lookups that cheap the "
          f"floor would be {gather_floor:.2f}x consume-only")
    print(f"\ntarget >= 0.50x consume-only: {'met' if ratio >= 0.5 else 'NOT met'}")
    result = {
        "samples_per_s": pipe, "consume_only_samples_per_s": base, "vs_consume_only": ratio,
        "target": 0.5, "config": {k: v for k, v in vars(args).items() if k != "json"},
        "message_bytes": rounds[0]["message_bytes"], "cpu_ms_per_batch": cpu,
        "consume_only_cpu_ms_per_batch": base_cpu, "cpu_bound_ratio": cpu_bound_ratio,
        "store_lookup_ms_per_batch": lookup_ms, "eval_lookup_ms_per_batch": eval_lookup_ms,
        "gather_ms_per_batch": gather_ms, "gather_floor_ratio": gather_floor,
        "floor_ratio": floor_ratio,
        "repeats": rounds_all, "counted_repeats": f"1..{len(rounds_all) - 1}",
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
