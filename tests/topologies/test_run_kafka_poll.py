"""``stream-persia run --kafka`` polls every embedding worker's status for data loss
(:func:`stream_persia.launch.run.check_kafka`): a worker that cannot be reached reports nothing
(its own exit fails the run), but any other refusal fails the run naming the worker, so
that the data-loss check is never silently off (another role secret, a bug).

A real embedding worker on a loopback port, with the run's secret or another one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_persia.core.aio import LoopThread
from stream_persia.launch.cli import build_parser
from stream_persia.launch.run import Job, check_kafka
from stream_persia.launch.topology import load_topology
from stream_persia.rpc.auth import RoleSecret
from stream_persia.testing.proxy import free_port
from stream_persia.testing.samples import SCHEMA
from stream_persia.worker.service import EmbeddingWorker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def run_job(tmp_path):
    """The Job of ``run topologies/synthetic_ctr --kafka ...`` (no role started)."""
    args = build_parser().parse_args(["run", str(ROOT / "topologies/synthetic_ctr"),
                                      "--kafka", "127.0.0.1:9"])
    return Job(load_topology(args.topology), args, tmp_path)


@pytest.fixture
def worker_with():
    """Start an embedding worker (broker-less: its status has no Kafka part) that proves
    the given role secret."""
    loop = LoopThread(name="poll-test")
    workers: list[EmbeddingWorker] = []

    def start(secret: str) -> str:
        async def go() -> str:
            w = EmbeddingWorker(SCHEMA, ["127.0.0.1:9"], secret=RoleSecret(secret))
            await w.start()
            workers.append(w)
            return w.address

        return loop.run(go(), timeout=10)

    yield start
    for w in workers:
        loop.run(w.stop(), timeout=10)
    loop.close()


def test_a_worker_that_refuses_the_poll_fails_the_run(run_job, worker_with):
    run_job.env["PERSIA_EMBEDDING_WORKERS"] = worker_with("another job's secret " * 2)
    with pytest.raises(RuntimeError) as err:
        check_kafka(run_job)
    assert "embedding-worker-0" in str(err.value) and "data loss" in str(err.value)
    assert "PERSIA_ROLE_SECRET" in str(err.value)


def test_only_a_worker_out_of_reach_is_left_out(run_job, worker_with):
    run_job.env["PERSIA_EMBEDDING_WORKERS"] = f"127.0.0.1:{free_port()}"   # none listens
    assert check_kafka(run_job) == {}
    run_job.env["PERSIA_EMBEDDING_WORKERS"] = worker_with(run_job.role_secret)
    assert run_job.kafka_state() == ([], {}, [])
