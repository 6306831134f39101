"""SIGTERM drains ``stream-persia launch nn-worker``: the ranks stop at a step boundary.

The NN worker runs as users run it (``launch nn-worker``: torchrun, one process per rank)
and is sent SIGTERM in the middle of training, as ``stream-persia run``, Kubernetes or
docker stop it. It must exit 0 in bounded time, having trained whole steps only: every
batch the embedding worker served was either applied or handed back (nothing stays in
flight), and the training script's own code after its loop runs (here it writes a
checkpoint). A later NN worker then trains exactly the batches the first one did not, and
a restore of that checkpoint into fresh processes finishes the stream so that the result
equals an uninterrupted run. With two DDP ranks both stop at the same step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from nn_helpers import LEARNABLE_SCHEMA, learnable_batches

from stream_persia.core import aio
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.testing.roles import KafkaRoles, assert_same_training, fill_topic

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "restore_train.py"
N = 12
DRAINED_WITHIN_S = 30.0


class Job(KafkaRoles):
    """An embedding server and an embedding worker (Kafka ingest), as processes."""

    def train(self, out: Path, *flags: str) -> None:
        """The training script in this process's child (no launcher), to completion."""
        log = self.tmp / f"{self.name}-{out.name}.log"
        with open(log, "ab") as f:
            code = subprocess.run([sys.executable, str(TRAIN), self.worker.address, str(out),
                                   "--batches", *flags], stdout=f, stderr=subprocess.STDOUT,
                                  timeout=120).returncode
        assert code == 0, log.read_text()[-3000:]

    def launch(self, out: Path, *flags: str) -> RoleProcess:
        """The training script under ``stream-persia launch nn-worker``."""
        return RoleProcess("nn-worker", [str(TRAIN), "--nproc-per-node", "1", "--",
                                         self.worker.address, str(out), "--batches", *flags],
                           log_path=self.tmp / f"{self.name}-nn.log",
                           name=f"{self.name}-nn").start()

    def call_worker(self, method: str):
        async def go():
            async with RpcClient(self.worker.address, timeout_ms=10_000) as c:
                return await c.call(method)

        return aio.run(go())


def _metas(out: Path) -> list[str]:
    try:
        return json.loads((out / "metas.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _wait_metas(out: Path, n: int, nn: RoleProcess, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_metas(out)) < n:
        assert nn.alive(), f"the NN worker exited early:\n{nn.log_tail()}"
        assert time.monotonic() < deadline, f"{n} batches not trained:\n{nn.log_tail()}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_sigterm_drains_the_nn_worker_and_a_restore_trains_the_rest_once(
        tmp_path, kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    fill_topic(kafka_broker.bootstrap_servers, topic, N, seed=3)

    # 1. Uninterrupted: N batches.
    full = Job(tmp_path, "full", kafka_broker.bootstrap_servers, topic)
    try:
        full.train(tmp_path / "full", str(N))
        full_rows = full.rows()
    finally:
        full.stop()
    full_metas = _metas(tmp_path / "full")
    assert full_metas == [f"batch-{i}" for i in range(N)]

    # 2. SIGTERM in the middle of training: exit 0, whole steps, nothing in flight.
    part = Job(tmp_path, "part", kafka_broker.bootstrap_servers, topic)
    try:
        ck = tmp_path / "ck"
        nn = part.launch(tmp_path / "part", str(N + 100), "--step-sleep", "0.3",
                         "--final-ckpt", str(ck))
        _wait_metas(tmp_path / "part", 4, nn)
        t0 = time.monotonic()
        code = nn.stop(grace_s=60)      # SIGTERM to its process group, as `run` stops it
        took = time.monotonic() - t0
        log = nn.log_tail(20_000)
        assert code == 0, log
        assert took < DRAINED_WITHIN_S, f"the drain took {took:.1f} s:\n{log}"
        assert "Traceback" not in log, log
        assert "stop requested (SIGTERM" in log or "launch nn-worker was asked to stop" in log
        trained = _metas(tmp_path / "part")
        assert 4 <= len(trained) < N, trained
        assert trained == full_metas[:len(trained)]
        stats = json.loads((tmp_path / "part" / "stats.json").read_text())
        assert stats["steps"] == len(trained)
        # Every batch served was applied or handed back: none left in flight.
        assert stats["served"] == len(trained) + stats["returned"], stats
        frontier = part.call_worker("frontier")
        assert frontier["inflight"] == 0 and not frontier.get("failed"), frontier
        # The checkpoint the script wrote after its loop is at the last trained step.
        manifest = json.loads((ck / "manifest.json").read_text())
        assert manifest["step"] == len(trained)

        # 3. A second NN worker on the same job trains the rest: the batches handed back
        # first, nothing twice, nothing lost.
        part.train(tmp_path / "cont", str(N - len(trained)))
        assert trained + _metas(tmp_path / "cont") == full_metas
    finally:
        part.stop()

    # 4. The checkpoint restored into fresh processes finishes the stream exactly once,
    # and the result equals the uninterrupted run.
    rest = Job(tmp_path, "rest", kafka_broker.bootstrap_servers, topic)
    try:
        rest.train(tmp_path / "rest", str(N - len(trained)), "--restore", str(ck))
        rest_rows = rest.rows()
    finally:
        rest.stop()
    assert trained + _metas(tmp_path / "rest") == full_metas, "every batch trained once"
    assert len(full_rows) > 100
    assert_same_training(tmp_path / "full" / "dense.pt", tmp_path / "rest" / "dense.pt",
                         full_rows, rest_rows)


def _launch_ddp(job, out: Path, *script_args: str) -> RoleProcess:
    env = {"PERSIA_EMBEDDING_WORKERS": ",".join(job.worker_addresses),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return RoleProcess("nn-worker", [str(HERE / "ddp_train.py"), "--nproc-per-node", "2",
                                     "--", str(out), *script_args],
                       env=env, log_path=out / "nn.log").start()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_stops_two_ddp_ranks_at_the_same_step(job_factory, tmp_path):
    job = job_factory(LEARNABLE_SCHEMA, ready_buffer_batches=256)
    fed = 200
    job.feed(learnable_batches(fed, 64), background=False)
    nn = _launch_ddp(job, tmp_path, "0.05")
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"progress{r}").exists() and
                  int((tmp_path / f"progress{r}").read_text() or 0) >= 5 for r in (0, 1)):
        assert nn.alive(), nn.log_tail()
        assert time.monotonic() < deadline, nn.log_tail()
        time.sleep(0.05)
    t0 = time.monotonic()
    code = nn.stop(grace_s=60)
    took = time.monotonic() - t0
    log = (tmp_path / "nn.log").read_text(errors="replace")
    assert code == 0, log[-5000:]
    assert took < DRAINED_WITHIN_S, f"the drain took {took:.1f} s:\n{log[-5000:]}"
    stats = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert stats[0]["steps"] == stats[1]["steps"] >= 5
    trained = stats[0]["steps"] + stats[1]["steps"]
    assert trained < fed, "stopped before the stream ran dry"
    dense = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for k in dense[0]:
        assert torch.equal(dense[0][k], dense[1][k]), k
    worker = job.workers[0]
    assert len(worker.inflight) == 0
    assert trained + len(worker.ready) == fed, "every batch trained once or back in line"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_before_training_starts_exits_0_and_serves_nothing(job_factory, tmp_path):
    job = job_factory(LEARNABLE_SCHEMA)
    job.feed(learnable_batches(8, 64), background=False)
    nn = _launch_ddp(job, tmp_path, "0.05")
    # The launcher has its signal handlers once it logs the torchrun command it starts (a
    # fixed sleep could signal it while it was still importing, on a loaded machine): then
    # torchrun is starting its ranks, which import torch.
    deadline = time.monotonic() + 60
    while "starting " not in (tmp_path / "nn.log").read_text(errors="replace"):
        assert nn.alive(), nn.log_tail()
        assert time.monotonic() < deadline, nn.log_tail()
        time.sleep(0.02)
    time.sleep(0.3)
    t0 = time.monotonic()
    code = nn.stop(grace_s=60)
    took = time.monotonic() - t0
    log = (tmp_path / "nn.log").read_text(errors="replace")
    assert code == 0, log[-5000:]
    assert took < DRAINED_WITHIN_S, log[-5000:]
    worker = job.workers[0]
    assert len(worker.inflight) == 0
    assert len(worker.ready) == 8 - sum(
        json.loads(p.read_text())["steps"] for p in tmp_path.glob("rank*.json"))
