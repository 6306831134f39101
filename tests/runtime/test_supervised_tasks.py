"""A role's long-running background task that fails makes the role unhealthy and exit 1.

The process test launches a real embedding worker consuming the Kafka test broker. Its
ingest loop is made to crash by a record it cannot survive: the worker runs from a small
launcher script that wraps ``KafkaIngest._one`` to raise on a record keyed ``crash``
(the supervisor must turn *any* exception into a failure, so which one is immaterial;
nothing of the supervision is replaced). Before the crash the worker serves batches; after
it ``health`` answers not ok naming the task and the exception, and the process exits
with status 1 within seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from stream_persia.core.metrics import RoleMetrics
from stream_persia.core.supervisor import EXIT_GRACE_S, Supervisor
from stream_persia.kafka import BatchProducer
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import EMBEDDING_YAML, make_batch

LAUNCHER = '''\
import sys

from stream_persia.worker import ingest

_one = ingest.KafkaIngest._one


async def crashing_one(self, partition, rec):
    if rec.key == b"crash":
        raise RuntimeError(f"injected crash on offset {rec.offset}")
    return await _one(self, partition, rec)


ingest.KafkaIngest._one = crashing_one

from stream_persia.launch.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''


async def test_a_failed_task_is_recorded_counted_and_signalled():
    metrics = RoleMetrics("embedding_worker", 0)
    sup = Supervisor("embedding worker 0", metrics)

    async def forever():
        await asyncio.sleep(3600)

    async def boom():
        raise KeyError("lost")

    async def returns():
        return None

    cancelled = sup.watch(asyncio.ensure_future(forever()), "quiet")
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    await asyncio.sleep(0)
    assert sup.ok and not sup.failed.is_set(), "a cancelled task is its owner's business"

    task = sup.watch(asyncio.ensure_future(boom()), "kafka-ingest")
    await asyncio.wait_for(sup.failed.wait(), 5)
    assert task.done() and not sup.ok
    assert sup.error == "the background task 'kafka-ingest' failed: KeyError: 'lost'"
    sup.watch(asyncio.ensure_future(returns()), "ends-when-stopped", forever=False)
    await asyncio.sleep(0.01)
    assert len(sup.failures) == 1, "a task allowed to return did not fail"
    sup.watch(asyncio.ensure_future(returns()), "loop")
    await asyncio.sleep(0.01)
    assert "'loop' stopped" in sup.error
    text = metrics.render().decode()
    assert 'persia_embedding_worker_background_task_failures_total{task="kafka-ingest"} 1.0' \
        in text


@pytest.fixture
def server():
    with RoleProcess("embedding-server", ["--capacity", "10000"]) as proc:
        yield proc


async def health(address: str) -> dict | None:
    try:
        async with RpcClient(address, timeout_ms=1000) as c:
            return await c.call("health")
    except Exception:   # not listening yet, or gone
        return None


async def test_a_crashed_ingest_task_fails_health_and_exits_the_worker_nonzero(
        kafka_broker, server, tmp_path):
    topic = f"sup-{uuid.uuid4().hex[:10]}"
    kafka_broker.create_topic(topic, 1)
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    ready = tmp_path / "ready"
    log_path = tmp_path / "worker.log"
    cmd = [sys.executable, str(tmp_path / "launcher.py"), "launch", "embedding-worker",
           "--embedding-config", str(tmp_path / "embedding_config.yml"),
           "--embedding-servers", server.address, "--kafka", kafka_broker.bootstrap_servers,
           "--topic", topic, "--num-partitions", "1", "--ready-file", str(ready)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            await asyncio.sleep(0.05)
        address = ready.read_text().strip()
        assert (await health(address))["ok"] is True

        async with BatchProducer(topic, bootstrap_servers=kafka_broker.bootstrap_servers) as p:
            await p.send(make_batch(0), key="fine")
        async with RpcClient(address, timeout_ms=10_000) as c:   # ingest works
            served = await c.call("next_batch", {"timeout_ms": 10_000})
            assert served is not None and served["meta"] == b"batch-0"
            await c.call("push_gradients", {"batch_id": served["batch_id"],
                                            "grads": dict.fromkeys(("user", "item", "tags"))})

        async with BatchProducer(topic, bootstrap_servers=kafka_broker.bootstrap_servers) as p:
            await p.send(make_batch(1), key="crash")
        crashed_at = time.monotonic()
        seen = None
        while proc.poll() is None and time.monotonic() - crashed_at < 30:
            h = await health(address)
            if h is not None and not h["ok"]:
                seen = h
            await asyncio.sleep(0.05)
        code = proc.wait(timeout=30)
        took = time.monotonic() - crashed_at
        out = log_path.read_text()
        assert code == 1, out[-3000:]
        assert took < 15, f"exited {took:.1f} s after the crash"
        assert seen is not None, f"health never answered not ok before the exit: {out[-3000:]}"
        assert "kafka-ingest" in seen["error"] and "RuntimeError" in seen["error"]
        assert "injected crash on offset 1" in seen["error"]
        assert "injected crash on offset 1" in out and "exit status 1" in out
        assert took >= EXIT_GRACE_S * 0.5
        # The reason is also the last line, where a tail of the log (stream-persia run's
        # report of a failed role) finds it whatever was logged while the role drained.
        last = out.strip().splitlines()[-1]
        assert "exit status 1" in last and "injected crash on offset 1" in last, last
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


API_LAUNCHER = '''\
import sys

from stream_persia.api import batcher

_collect = batcher.MicroBatcher._collect


async def crashing_collect(self):
    raise RuntimeError("injected crash of the micro-batcher")


batcher.MicroBatcher._collect = crashing_collect

from stream_persia.launch.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''


async def test_a_crashed_api_batcher_fails_readiness_and_exits_the_api_nonzero(tmp_path):
    """The API's inference micro-batcher is supervised the same way: its crash is named
    by /readyz (503), and `launch api` exits 1 instead of queueing predictions forever."""
    import httpx

    (tmp_path / "launcher.py").write_text(API_LAUNCHER)
    ready = tmp_path / "ready"
    log_path = tmp_path / "api.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIA_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(tmp_path / "launcher.py"), "launch", "api", "--port", "0",
             "--checkpoint-dir", str(tmp_path), "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            await asyncio.sleep(0.05)
        url = "http://" + ready.read_text().strip()
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            r = await client.get("/readyz")
        assert r.status_code == 503, r.text
        assert any("predict-batcher" in p and "injected crash" in p
                   for p in r.json()["problems"]), r.json()
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 1, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
