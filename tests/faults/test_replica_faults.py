"""Issue 18, item 8 on real processes: a serving replica, an embedding server and the
broker each killed (SIGKILL) mid-stream and restarted; the replica converges to the exact
state again, applies nothing twice, and the gap shows in its freshness metric.

Every role is a process of its own (``launch embedding-server``, ``launch
embedding-worker``, ``launch api --embeddings replica``); the test plays NN rank 0 over
RPC: it feeds batches stamped with their event time to the embedding worker, pushes
gradients for them, and publishes a dense model to server 0 every other batch
(``put_dense``), as :mod:`stream_persia.nn.dense_publisher` does. Training runs in the
background while a victim is killed.

Exactness, once training stopped and the replica drained: its predictions on a body that
holds every id of the vocabulary, one per sample and slot, equal (within 1e-6) those of
an API process that looks the same rows up on the training servers through the embedding
worker, with the same dense model; each shard's last applied mark is the server's last
mark (``GET /v1/model``). Nothing applied twice: the rows, tombstones, resets and marks
the replica counts as applied (``replica.shards[i].applied``) equal those of the server's
own log over the stretch it followed (read back with ``model_updates``), or, where it
resynced, a prefix of it and then everything from a reset on.

The broker is librdkafka's mock cluster (:mod:`stream_persia.testing.kafka_mock`), which
keeps its data in memory and listens on a port of the OS's choosing: it advertises a
:class:`~stream_persia.testing.proxy.LateProxy`'s address, so that every client reaches
it there, and a new broker put behind the proxy after the kill is, to the servers and
the replica, the old one restarted at its address, empty.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from stream_persia.checkpoint import JIT_FILENAME, CheckpointWriter
from stream_persia.errors import PersiaError
from stream_persia.launch.processes import RoleProcess
from stream_persia.nn.checkpointing import scripted
from stream_persia.rpc import RpcClient
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.proxy import LateProxy
from stream_persia.testing.roles import start_server
from stream_persia.testing.samples import EMBEDDING_YAML, make_batch

pytestmark = [pytest.mark.slow]

VOCAB = 50                  # ids per slot: the served body holds every one
BEFORE = 40                 # ids trained before the checkpoint (the rest only after it)
DENSE_EVERY = 2             # NN rank 0 publishes the dense model every other batch
STEP_SLEEP_S = 0.05         # spreads training over the kill


class Click(torch.nn.Module):
    """A PERSIA-signature model over testing.samples' schema (dense 3, user 8, item 8, raw
    tags 3x4) that is linear before its sigmoid, so that any row served differently
    changes the prediction of the sample that holds it."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(3 + 8 + 8 + 12, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        parts = [non_id[0]] + [e.reshape(e.shape[0], -1) for e in emb]
        return {"click": torch.sigmoid(self.linear(torch.cat(parts, dim=1))).squeeze(1)}


def dense_blob(step: int) -> bytes:
    buf = io.BytesIO()
    torch.save(Click(seed=step).state_dict(), buf)
    return buf.getvalue()


EVAL_BODY = {"id_type_features": {name: [[j] for j in range(VOCAB)]
                                  for name in ("user", "item", "tags")},
             "non_id_type_features": {"dense": [[0.1 * (j % 7), 0.2, -0.3]
                                                for j in range(VOCAB)]}}


class Job:
    """Embedding servers and one broker-less embedding worker, each a process; configs and
    logs in ``tmp`` (also the servers' checkpoint root)."""

    def __init__(self, tmp: Path, n_servers: int = 2, global_yaml: str | None = None):
        self.tmp, self.n = tmp, n_servers
        self.config = tmp / "embedding_config.yml"
        self.config.write_text(EMBEDDING_YAML)
        self.global_args: list[str] = []
        if global_yaml is not None:
            (tmp / "global_config.yml").write_text(global_yaml)
            self.global_args = ["--global-config", str(tmp / "global_config.yml")]
        self.servers: list[RoleProcess] = []
        self.worker: RoleProcess | None = None
        self.others: list[RoleProcess] = []
        try:
            self.servers = [self.start_server(i) for i in range(n_servers)]
            for s in self.servers:
                s.wait_ready()
            self.worker = self.start_worker("worker")
        except BaseException:
            self.kill()
            raise

    def start_server(self, i: int, port: str | None = None, name: str = "") -> RoleProcess:
        return start_server(self.tmp, name or f"server-{i}", port,
                            ["--replica-index", str(i), "--replica-size", str(self.n),
                             *self.global_args])

    def start_worker(self, name: str) -> RoleProcess:
        w = RoleProcess("embedding-worker", [
            "--embedding-config", str(self.config), "--embedding-servers",
            self.server_addresses],
            log_path=self.tmp / f"{name}.log", name=name).start()
        w.wait_ready()
        return w

    @property
    def server_addresses(self) -> str:
        return ",".join(s.wait_ready() for s in self.servers)

    def api(self, name: str, *args: str, env: dict[str, str] | None = None) -> RoleProcess:
        """An API process (``launch api``) of this job, ready."""
        p = RoleProcess("api", ["--port", "0", "--embedding-servers", self.server_addresses,
                                *args],
                        env={"PERSIA_EMBEDDING_CONFIG": str(self.config), **(env or {})},
                        log_path=self.tmp / f"{name}.log", name=name).start()
        self.others.append(p)
        p.wait_ready(90)
        return p

    def replica(self, name: str, ckpt: str, updates: str = "rpc") -> RoleProcess:
        return self.api(name, "--embeddings", "replica", "--model", ckpt, *self.global_args,
                        "--checkpoint-dir", str(Path(ckpt).parent),
                        env={"PERSIA_API_UPDATES": updates})

    def kill(self) -> None:
        for p in [*self.others, *([self.worker] if self.worker else []), *self.servers]:
            p.kill()


class Trainer:
    """Plays NN rank 0 over RPC (module docstring): batch ``step`` is ``make_batch(step)``
    stamped with the time it is sent; a dense model of step ``step`` every other batch.
    Ids are below ``vocab``: :data:`BEFORE` until a checkpoint is taken, then
    :data:`VOCAB`, so that rows exist after the checkpoint that it does not hold."""

    def __init__(self, job: Job):
        self.job = job
        self.vocab = BEFORE
        self.step = 0
        self.dense_step = -1
        self.trained_through: float | None = None
        self.rng = np.random.default_rng(7)

    async def train(self, n: int) -> None:
        for _ in range(n):
            await self.one()

    async def one(self) -> None:
        assert self.job.worker is not None
        async with RpcClient(self.job.worker.wait_ready(), timeout_ms=10_000) as w, \
                RpcClient(self.job.servers[0].wait_ready(), timeout_ms=10_000) as s0:
            self.step += 1
            t = time.time()
            batch = make_batch(self.step, seed=3, vocab=self.vocab).stamped(t)
            await w.call("ingest", {"batch": batch.to_wire()})
            served = await w.call("next_batch", {"timeout_ms": 5000})
            await w.call("push_gradients", {"batch_id": served["batch_id"], "grads": {
                e["name"]: self.rng.normal(size=e["emb"].shape).astype(np.float32)
                for e in served["embeddings"]}})
            self.trained_through = t
            if self.step % DENSE_EVERY == 0:
                blob = dense_blob(self.step)
                await s0.call("put_dense", {"version": self.step, "event_time": t,
                                            "chunk": 0, "chunks": 1, "data": blob,
                                            "sha256": hashlib.sha256(blob).hexdigest()})
                self.dense_step = self.step

    async def until(self, stop: asyncio.Event) -> BaseException | None:
        """Train until ``stop`` is set; a failure (a peer killed) ends it and is returned."""
        try:
            while not stop.is_set():
                await self.one()
                await asyncio.sleep(STEP_SLEEP_S)
        except PersiaError as e:
            return e
        return None

    async def checkpoint(self, dst: Path) -> str:
        """A checkpoint of the servers and the newest dense model, as NN rank 0 writes one
        (with its ``trained_through``; the manifest records each update log's position)."""
        model = Click(seed=self.dense_step)
        clients = [RpcClient(a, timeout_ms=20_000)
                   for a in self.job.server_addresses.split(",")]
        try:
            with CheckpointWriter(str(dst)) as w:
                w.write_torch("dense.pt", model.state_dict())
                w.write_bytes(JIT_FILENAME, scripted(model))
                await w.dump_embeddings(clients)
                w.commit(job="test", step=max(self.dense_step, 0), offsets={}, stream="direct",
                         extra={"trained_through": self.trained_through})
        finally:
            for c in clients:
                await c.close()
        self.vocab = VOCAB
        return str(dst)


# --------------------------------------------------------------------- reading the roles

async def server_log(address: str, from_seq: int = 0) -> tuple[str, list[dict[str, Any]]]:
    """A server's incarnation and its update log from ``from_seq`` to its end."""
    out: list[dict[str, Any]] = []
    async with RpcClient(address, timeout_ms=10_000) as c:
        while True:
            r = await c.call("model_updates", {"from_seq": from_seq, "max_bytes": 64 << 20})
            assert r["first_seq"] <= from_seq, "the test's log fell out of the server's bound"
            out += r["messages"]
            if not r["messages"] or out[-1]["seq"] + 1 >= r["next_seq"]:
                return r["incarnation"], out
            from_seq = out[-1]["seq"] + 1


def applied_by(messages: list[dict[str, Any]]) -> dict[str, int]:
    """What a reader that applies ``messages`` once each counts as applied."""
    out = {"rows": 0, "tombstones": 0, "resets": 0, "marks": 0}
    for m in messages:
        if m["kind"] in ("rows", "tombstones"):
            out[m["kind"]] += len(m["ids"])
        else:
            out[m["kind"] + "s"] += 1
    return out


async def settled_logs(job: Job) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every server's whole log once training stopped and its last pass ended (the log
    ends with a mark and stays the same for a while)."""
    async with asyncio.timeout(30):
        last = None
        while True:
            logs = [await server_log(a) for a in job.server_addresses.split(",")]
            ends = [(inc, len(ms), ms[-1]["kind"] if ms else None) for inc, ms in logs]
            if ends == last and all(k == "mark" for _, _, k in ends):
                return logs
            last = ends
            await asyncio.sleep(0.6)   # three passes of the default 200 ms


async def model_info(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/v1/model")
    assert r.status_code == 200, r.text
    return r.json()


async def quiet(client: httpx.AsyncClient) -> dict[str, Any]:
    """``GET /v1/model`` once it stays the same for half a second (a pull in flight when a
    peer died is applied by then)."""
    async with asyncio.timeout(30):
        last = None
        while True:
            info = await model_info(client)
            state = (info["trained_through"], info["replica"]["shards"])
            if state == last:
                return info
            last = state
            await asyncio.sleep(0.5)


async def drained(client: httpx.AsyncClient, logs: list, dense_step: int,
                  timeout_s: float = 30.0) -> dict[str, Any]:
    """``GET /v1/model`` once the replica applied every log to its end and the newest
    dense model."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                info = await model_info(client)
                shards = info["replica"]["shards"]
                if info["model_version"] == dense_step and all(
                        sh["incarnation"] == inc and sh["next_seq"] == ms[-1]["seq"] + 1
                        for sh, (inc, ms) in zip(shards, logs, strict=True)):
                    return info
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"the replica did not drain: {info['replica']['shards']}, "
                             f"model_version {info['model_version']} (want {dense_step})"
                             ) from None


async def predict(client: httpx.AsyncClient) -> np.ndarray:
    r = await client.post("/v1/predict", json=EVAL_BODY)
    assert r.status_code == 200, r.text
    return np.array([p["click"] for p in r.json()["predictions"]])


async def reference(job: Job, trainer: Trainer, tmp: Path) -> np.ndarray:
    """The predictions on :data:`EVAL_BODY` of an API process that looks rows up on the
    training servers (through the worker) with the newest dense model."""
    ckpt = await trainer.checkpoint(tmp / "reference" / str(trainer.step))
    assert job.worker is not None
    api = job.api("reference-api", "--embeddings", "workers", "--model", ckpt,
                  "--embedding-workers", job.worker.wait_ready())
    try:
        async with httpx.AsyncClient(base_url=f"http://{api.address}", timeout=30) as c:
            return await predict(c)
    finally:
        api.stop()


async def assert_exact(replica: httpx.AsyncClient, logs: list, info: dict[str, Any],
                       want: np.ndarray) -> None:
    """The replica serves what the training servers hold (module docstring)."""
    for sh, (_, ms) in zip(info["replica"]["shards"], logs, strict=True):
        assert sh["version"] == ms[-1]["version"] and not sh["resyncing"], sh
    np.testing.assert_allclose(await predict(replica), want, atol=1e-6, rtol=0)


def histogram(metrics: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram in Prometheus text (le -> count)."""
    out = {}
    for m in re.finditer(rf'^{name}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} (\S+)$', metrics,
                         re.M):
        out[float(m.group(1))] = float(m.group(2))
    assert out, f"no {name} in /metrics"
    return out


def above(buckets: dict[float, float], seconds: float) -> float:
    """Samples of a histogram above the largest bucket bound <= ``seconds``."""
    bound = max(b for b in buckets if b <= seconds)
    return buckets[float("inf")] - buckets[bound]


def counter(metrics: str, name: str) -> float:
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", metrics, re.M)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


async def wait_applying(client: httpx.AsyncClient, beyond: list[int]) -> None:
    """Until the replica applied something past ``beyond`` (each shard's next_seq)."""
    async with asyncio.timeout(30):
        while True:
            shards = (await model_info(client))["replica"]["shards"]
            if all(sh["next_seq"] > b for sh, b in zip(shards, beyond, strict=True)):
                return
            await asyncio.sleep(0.05)


# --------------------------------------------------------------------- the faults

@pytest.mark.timeout(180)
async def test_a_replica_killed_mid_stream_restarts_from_the_checkpoint_exactly(tmp_path):
    """A replica process is SIGKILLed while it follows training; training goes on; a new
    replica process restores the same checkpoint and catches up: the servers' rows
    exactly, each message after the checkpoint's place in each log applied once (none
    before it: the checkpoint holds those), and its first advance of trained_through (from
    the checkpoint's) is a freshness sample longer than the whole gap."""
    job = Job(tmp_path)
    stop = asyncio.Event()
    training = None
    try:
        trainer = Trainer(job)
        await trainer.train(4)
        ckpt = await trainer.checkpoint(tmp_path / "ckpts" / "c1")
        first = job.replica("replica-a", ckpt)
        training = asyncio.create_task(trainer.until(stop))
        async with httpx.AsyncClient(base_url=f"http://{first.address}", timeout=30) as c:
            at = [sh["next_seq"] for sh in (await model_info(c))["replica"]["shards"]]
            await wait_applying(c, at)      # mid-stream: following a moving log
        first.kill()
        step_at_kill = trainer.step
        while trainer.step < step_at_kill + 6:     # training goes on without a replica
            await asyncio.sleep(0.05)
        restarted_at = time.time()
        second = job.replica("replica-b", ckpt)    # a new process, the same checkpoint
        await asyncio.sleep(0.5)                   # ... catching up while training goes on
        stop.set()
        assert await training is None
        logs = await settled_logs(job)
        async with httpx.AsyncClient(base_url=f"http://{second.address}", timeout=30) as c:
            info = await drained(c, logs, trainer.dense_step)
            await assert_exact(c, logs, info, await reference(job, trainer, tmp_path))
            # Nothing applied twice: from each log's place in the checkpoint to its end,
            # every message once (none of those the checkpoint holds already).
            positions = json.loads((Path(ckpt) / "manifest.json").read_text())["model_updates"]
            for sh, pos, (inc, ms) in zip(info["replica"]["shards"], positions, logs,
                                          strict=True):
                assert pos["incarnation"] == inc
                assert sh["applied"] == applied_by(ms[pos["seq"]:]), (sh, pos)
                assert sh["resyncs"] == 0 and sh["applied"]["resets"] == 0
            # The gap: the new process starts trained through the checkpoint, and its
            # first advance covers everything since (the replica's death included).
            text = (await c.get("/metrics")).text
            gap = restarted_at - json.loads((Path(ckpt) / "manifest.json").read_text()
                                            )["extra"]["trained_through"]
            buckets = histogram(text, "persia_api_freshness_seconds")
            assert above(buckets, gap) >= 1, (gap, buckets)
    finally:
        stop.set()
        if training is not None:
            await training
        job.kill()


@pytest.mark.timeout(180)
async def test_a_server_killed_mid_stream_and_restored_is_followed_exactly(tmp_path):
    """Server 1 is SIGKILLed while training runs and comes back at its address, restored
    from the checkpoint (a StatefulSet plus the operator's restore); training goes on
    through a new embedding worker. The replica sees the new incarnation (a reset),
    converges to the servers' rows exactly, counts the restart, and its freshness
    histogram holds the outage."""
    job = Job(tmp_path)
    stop = asyncio.Event()
    training = None
    try:
        trainer = Trainer(job)
        await trainer.train(4)
        ckpt = await trainer.checkpoint(tmp_path / "ckpts" / "c1")
        replica = job.replica("replica", ckpt)
        async with httpx.AsyncClient(base_url=f"http://{replica.address}", timeout=30) as c:
            training = asyncio.create_task(trainer.until(stop))
            at = [sh["next_seq"] for sh in (await model_info(c))["replica"]["shards"]]
            await wait_applying(c, at)
            old_inc, old_log = await server_log(job.servers[1].wait_ready())
            victim = job.servers[1]
            address = victim.wait_ready()
            before = histogram((await c.get("/metrics")).text, "persia_api_freshness_seconds")
            victim.kill()
            killed_at = time.time()
            assert isinstance(await training, PersiaError)   # the stream stops: a peer died
            # What the replica applied of the old incarnation: nothing more can come.
            now = await quiet(c)
            shard1, held = now["replica"]["shards"][1], now["trained_through"]
            assert shard1["incarnation"] == old_inc
            if shard1["next_seq"] <= old_log[-1]["seq"] + 1:   # (else a pass slipped in)
                pos = json.loads((Path(ckpt) / "manifest.json").read_text()
                                 )["model_updates"][1]["seq"]
                assert shard1["applied"] == applied_by(old_log[pos:shard1["next_seq"]])

            job.servers[1] = job.start_server(1, address.rpartition(":")[2], "server-1b")
            assert job.servers[1].wait_ready() == address
            manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
            async with RpcClient(address, timeout_ms=20_000) as s1:
                await s1.call("load", {"dir": ckpt, "files": manifest["embedding_files"]})
            await asyncio.sleep(0.5)
            trainer.vocab = BEFORE   # rows trained since the checkpoint stay gone from shard 1
            # Nothing trained since the kill: what the restored shard is trained through is
            # not known (its new process applied nothing with an event time): None, never
            # the value from before the kill, which the checkpoint's rows do not reach.
            async with asyncio.timeout(20):
                while (await model_info(c))["trained_through"] is not None:
                    await asyncio.sleep(0.1)
            assert held is not None
            assert job.worker is not None
            job.worker.kill()            # it saw its server die; a new one takes over
            job.worker = job.start_worker("worker-b")
            outage = time.time() - killed_at
            await trainer.train(6)
            logs = await settled_logs(job)
            assert logs[1][0] != old_inc
            info = await drained(c, logs, trainer.dense_step)
            await assert_exact(c, logs, info, await reference(job, trainer, tmp_path))
            sh0, sh1 = info["replica"]["shards"]
            # the new incarnation from its first message (a reset) on, each message once
            assert logs[1][1][0]["kind"] == "reset"
            assert {k: sh1["applied"][k] - shard1["applied"][k] for k in shard1["applied"]} \
                == applied_by(logs[1][1])
            pos0 = manifest["model_updates"][0]["seq"]
            assert sh0["applied"] == applied_by(logs[0][1][pos0:])
            assert sh0["resyncs"] == sh1["resyncs"] == 0
            text = (await c.get("/metrics")).text
            assert counter(text, "persia_api_replica_server_restarts_total") == 1
            after = histogram(text, "persia_api_freshness_seconds")
            assert above(after, outage) - above(before, outage) >= 1, (outage, before, after)
    finally:
        stop.set()
        if training is not None:
            await training
        job.kill()


def kafka_broker(address: LateProxy, topic: str, shards: int) -> MockKafkaCluster:
    """A test broker reached only through ``address`` (its metadata names the proxy), with
    the update topic and its dead-letter topic."""
    broker = MockKafkaCluster().start()
    broker.advertise(address.address)
    broker.create_topic(topic, shards + 1)
    broker.create_topic(f"{topic}.dlq", 1)
    address.retarget(broker.bootstrap_servers)
    return broker


def applied_once(applied: dict[str, int], resyncs: int, log: list[dict[str, Any]],
                 start: int) -> bool:
    """Whether ``applied`` is what a reader of ``log`` from ``start`` on counts when it
    applied each message at most once, in order: everything (no resync), or a prefix
    and then, after a gap, everything from a later reset (where its skipping ended) on;
    never a message twice."""
    if resyncs == 0:
        return applied == applied_by(log[start:])
    for r in (i for i, m in enumerate(log) if m["kind"] == "reset" and i >= start):
        tail = applied_by(log[r:])
        if any(applied == {k: v + tail[k] for k, v in applied_by(log[start:n]).items()}
               for n in range(start, r + 1)):
            return True
    return False


@pytest.mark.kafka
@pytest.mark.timeout(180)
@pytest.mark.parametrize("lagging", [False, True], ids=["following", "lagging"])
async def test_a_broker_killed_mid_stream_and_restarted_empty_the_kafka_replica_converges(
        tmp_path, lagging):
    """The broker behind the update topic is SIGKILLed while training runs and comes back
    at its address, empty (the test broker keeps everything in memory; the topics are
    created again, as a deploy does). The servers keep what the broker did not
    acknowledge in their logs and publish it, and what follows, to the new broker; the
    replica (``updates=kafka``) stays up, its trained_through holds through the outage
    (a sample of the freshness histogram above it afterwards), and it converges to the
    servers' rows exactly, nothing applied twice.

    ``following``: the replica keeps up until the kill (whether it loses records that the
    old broker acknowledged but it had not read yet is a matter of milliseconds).
    ``lagging``: the replica is frozen (SIGSTOP) for a second of training before the kill,
    so the records of that second die with the broker: it must see the gap in every
    partition and ask each server for a full pass (a resync), never skip it silently."""
    from stream_persia.kafka.updates import updates_topic

    job_name = "faults"
    topic = updates_topic(job_name)
    address = LateProxy("127.0.0.1:1")
    address.start()
    broker = kafka_broker(address, topic, 2)
    stop = asyncio.Event()
    training = None
    job = None
    try:
        job = Job(tmp_path, global_yaml=f"kafka: {{bootstrap_servers: '{address.address}', "
                                        f"job_name: {job_name}}}\n")
        trainer = Trainer(job)
        await trainer.train(4)
        await asyncio.sleep(0.5)     # the passes reach Kafka: the checkpoint has offsets
        ckpt = await trainer.checkpoint(tmp_path / "ckpts" / "c1")
        replica = job.replica("replica", ckpt, updates="kafka")
        assert replica.proc is not None
        async with httpx.AsyncClient(base_url=f"http://{replica.address}", timeout=30) as c:
            training = asyncio.create_task(trainer.until(stop))
            at = [sh["next_seq"] for sh in (await model_info(c))["replica"]["shards"]]
            await wait_applying(c, at)
            before = histogram((await c.get("/metrics")).text, "persia_api_freshness_seconds")
            if lagging:
                os.killpg(replica.proc.pid, signal.SIGSTOP)
                step = trainer.step
                while trainer.step < step + 8:    # more than a second of passes
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)          # ... and on the broker
            broker.kill()
            killed_at = time.time()
            trainer.vocab = BEFORE   # rows new since the checkpoint change no more
            if lagging:
                os.killpg(replica.proc.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)    # training goes on; the replica cannot follow
            held = (await quiet(c))["trained_through"]
            await asyncio.sleep(1.0)
            assert (await model_info(c))["trained_through"] == held   # the gap
            broker = kafka_broker(address, topic, 2)
            outage = time.time() - killed_at
            await asyncio.sleep(1.0)
            stop.set()
            assert await training is None      # training never needed the broker
            logs = await settled_logs(job)
            info = await drained(c, logs, trainer.dense_step, timeout_s=60)
            want = await reference(job, trainer, tmp_path)
            await assert_exact(c, logs, info, want)
            manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
            for sh, pos, (_, ms) in zip(info["replica"]["shards"], manifest["model_updates"],
                                        logs, strict=True):
                assert applied_once(sh["applied"], sh["resyncs"], ms, pos["seq"]), (sh, pos)
                if lagging:
                    assert sh["resyncs"] >= 1, sh
            print("resyncs:", [sh["resyncs"] for sh in info["replica"]["shards"]])
            text = (await c.get("/metrics")).text
            after = histogram(text, "persia_api_freshness_seconds")
            assert above(after, outage) - above(before, outage) >= 1, (outage, before, after)
            assert counter(text, "persia_api_replica_resyncs_total") == sum(
                sh["resyncs"] for sh in info["replica"]["shards"])
            assert replica.alive()

        # A replica started now from the same checkpoint: its place in each log (and the
        # offset recorded for it) died with the old broker. It must see the gap and
        # resync, not start silently from whatever record it reads first.
        late = job.replica("replica-late", ckpt, updates="kafka")
        async with httpx.AsyncClient(base_url=f"http://{late.address}", timeout=30) as c:
            async with asyncio.timeout(30):    # its full passes, if it asked for them
                while any(sh["resyncing"] or sh["version"] is None
                          for sh in (await model_info(c))["replica"]["shards"]):
                    await asyncio.sleep(0.1)
            logs = await settled_logs(job)
            info = await drained(c, logs, trainer.dense_step)
            await assert_exact(c, logs, info, want)
            for sh, pos, (_, ms) in zip(info["replica"]["shards"], manifest["model_updates"],
                                        logs, strict=True):
                assert sh["resyncs"] >= 1, sh
                assert applied_once(sh["applied"], sh["resyncs"], ms, pos["seq"]), (sh, pos)
    finally:
        stop.set()
        if training is not None:
            await training
        if job is not None:
            job.kill()
        broker.kill()
        address.close()
