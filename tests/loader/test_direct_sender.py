"""DirectSender (the broker-less path of DataCtx) against real embedding workers.

The workers are real RPC servers on loopback: in this process on their own loop thread
for most tests, and child processes (``stream-persia launch``) for the one where a worker
is killed. The sender runs on its own loop thread and is driven from the test thread, as
DataCtx drives it.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from stream_persia.core.aio import LoopThread
from stream_persia.core.data import IDTypeFeature, PersiaBatch
from stream_persia.errors import Backpressure, BadInput, PeerUnavailable, RemoteTimeout
from stream_persia.launch.processes import RoleProcess
from stream_persia.loader.direct_sender import DirectSender
from stream_persia.rpc import RpcClient, RpcServer
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.roles import running
from stream_persia.testing.samples import make_batch
from stream_persia.testing.workers import WorkersOnLoop

pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sender:
    """A DirectSender on its own loop thread, closed with it."""

    def __init__(self, addresses: list[str], **kw):
        kw.setdefault("max_inflight", 1)
        kw.setdefault("timeout_ms", 10_000)
        self.lt = LoopThread(name="test-sender")
        self.sender = DirectSender(addresses, self.lt, **kw)

    def close(self) -> None:
        try:
            self.lt.run(self.sender.close(), timeout=20)
        finally:
            self.lt.close()


@pytest.fixture
def workers():
    made: list[WorkersOnLoop] = []

    def make(n: int = 1, **kw) -> WorkersOnLoop:
        made.append(WorkersOnLoop(n, **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


@pytest.fixture
def sender():
    made: list[Sender] = []

    def make(addresses: list[str], **kw) -> DirectSender:
        made.append(Sender(addresses, **kw))
        return made[-1].sender

    yield make
    for s in made:
        s.close()


def tag(i: int) -> bytes:
    return f"batch-{i}".encode()


def test_at_most_max_inflight_sends_are_unacknowledged(workers, sender):
    w = workers(1, ready=1)
    s = sender(w.addresses, max_inflight=2, timeout_ms=30_000)
    for i in range(3):
        s.submit(make_batch(i), seq=i)   # 0 fills the buffer; 1 and 2 wait in the worker
    blocked = threading.Thread(target=s.submit, args=(make_batch(3), 3), daemon=True)
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive(), "a third send went out while two were unacknowledged"
    assert w.ready(0) == 1 and s.stats()["in_flight"] == 2
    got = [w.pull_meta(0)]                # room for one: a send is acknowledged ...
    blocked.join(10)
    assert not blocked.is_alive()         # ... which lets the blocked submit through
    got += [w.pull_meta(0) for _ in range(3)]
    s.flush(10)
    assert sorted(got) == [tag(i) for i in range(4)]
    assert s.stats()["acked"] == 4 and s.stats()["peak_in_flight"] == 2


def test_pipelined_sends_to_a_lone_worker_keep_their_order_through_a_pause(workers, sender):
    """Sends waiting out a paused worker went on, once resumed, in the order their 0.25 s
    re-checks fell (and a full buffer let a newcomer overtake a waiting one): the batches
    of one data loader reached training out of order."""
    w = workers(1, ready=1)
    w.lt.run(w.clients[0].call("pause_ingest"), 10)
    s = sender(w.addresses, max_inflight=6, timeout_ms=30_000)
    for i in range(6):
        s.submit(make_batch(i), seq=i)
        time.sleep(0.07)    # arrivals spread over the waiters' re-check period
    time.sleep(0.4)
    assert w.ready(0) == 0
    w.lt.run(w.clients[0].call("resume_ingest"), 10)
    got = [w.pull_meta(0) for _ in range(6)]
    s.flush(10)
    assert got == [tag(i) for i in range(6)]
    assert s.stats()["retries"] == 0


def test_a_lone_worker_is_asked_to_wait_the_whole_timeout(sender):
    """With one worker there is nowhere else to send a batch: it is asked to wait for
    room for all of timeout_ms, so a batch is never re-offered behind later ones (it was
    every 10 s)."""
    asked: list[object] = []

    async def ingest(params):
        asked.append(params.get("timeout_ms"))
        return {"batch_id": len(asked)}

    async def health(params):
        return {"ok": True}

    lt = LoopThread(name="test-lone-worker")
    server = RpcServer({"ingest": ingest, "health": health}, name="lone-worker")
    try:
        lt.run(server.start(), 10)
        s = sender([server.address], timeout_ms=45_000)
        s.submit(make_batch(0), seq=0)
        s.flush(10)
        assert len(asked) == 1 and 44_000 < asked[0] <= 45_000, asked
    finally:
        lt.run(server.stop(), 10)
        lt.close()


def test_round_robin_starts_at_first_worker_and_keeps_order_per_worker(workers, sender):
    w = workers(3)
    s = sender(w.addresses, first_worker=2)
    for i in range(6):
        s.submit(make_batch(i), seq=i)
    s.flush(10)
    assert [w.ready(i) for i in range(3)] == [2, 2, 2]
    assert [w.pull_meta(2), w.pull_meta(2)] == [tag(0), tag(3)]
    assert [w.pull_meta(0), w.pull_meta(0)] == [tag(1), tag(4)]
    assert [w.pull_meta(1), w.pull_meta(1)] == [tag(2), tag(5)]
    assert s.stats()["retries"] == 0


def test_a_full_worker_passes_the_batch_on_to_the_next(workers, sender):
    w = workers(2, ready=1)
    w.ingest(0, make_batch(100))          # worker 0 is full, worker 1 has room
    s = sender(w.addresses, first_worker=0)
    s.submit(make_batch(0), seq=0)
    s.flush(10)
    assert (w.ready(0), w.ready(1)) == (1, 1)
    assert w.pull_meta(1) == tag(0) and w.pull_meta(0) == tag(100)
    assert s.stats()["retries"] == 1 and s.stats()["acked"] == 1


def test_a_batch_every_worker_refuses_for_lack_of_room_fails_after_timeout_ms(workers, sender):
    w = workers(2, ready=1)
    w.ingest(0, make_batch(100))
    w.ingest(1, make_batch(101))
    s = sender(w.addresses, timeout_ms=1200)
    s.submit(make_batch(0), seq=0)
    with pytest.raises(Backpressure) as err:
        s.flush(20)
    assert err.value.field == "timeout_ms"
    assert "batch 0 " in str(err.value)
    assert s.stats()["retries"] >= 2 and s.stats()["failed"] == 1
    assert (w.ready(0), w.ready(1)) == (1, 1)


def test_a_batch_a_worker_refuses_is_not_offered_to_the_others(workers, sender):
    w = workers(2)
    s = sender(w.addresses, max_inflight=2)
    bad = PersiaBatch([IDTypeFeature("nope", [np.array([1], np.uint64)])],
                      requires_grad=False)
    s.submit(bad, seq=0)
    s.submit(make_batch(1), seq=1)
    with pytest.raises(BadInput) as err:
        s.flush(10)
    assert "batch 0 " in str(err.value) and "nope" in str(err.value)
    assert s.stats()["retries"] == 0
    s.submit(make_batch(2), seq=2)        # the sender stays usable
    s.flush(10)
    assert w.ready(0) + w.ready(1) == 2


def test_an_earlier_failure_is_raised_by_the_next_submit(workers, sender):
    w = workers(1)
    s = sender(w.addresses)
    s.submit(PersiaBatch([IDTypeFeature("nope", [np.array([1], np.uint64)])],
                         requires_grad=False), seq=7)
    deadline = time.monotonic() + 10
    while s.stats()["failed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(BadInput, match="batch 7 "):
        s.submit(make_batch(0), seq=8)
    s.flush(10)                            # reported once
    assert w.ready(0) == 0                 # the submit that raised sent nothing


def test_flush_past_its_timeout_names_the_unacknowledged_count(workers, sender):
    w = workers(1, ready=1)
    s = sender(w.addresses, max_inflight=2, timeout_ms=30_000)
    s.submit(make_batch(0), seq=0)
    s.submit(make_batch(1), seq=1)        # waits for room in the worker
    with pytest.raises(RemoteTimeout) as err:
        s.flush(0.3)
    assert "1 batches were still unacknowledged" in str(err.value)
    assert w.pull_meta(0) == tag(0)       # room: the waiting send completes
    s.flush(10)
    assert w.pull_meta(0) == tag(1)


def test_a_sender_started_before_its_workers_waits_for_them(workers, sender):
    port = free_port()
    s = sender([f"127.0.0.1:{port}"], startup_timeout_s=30)
    s.submit(make_batch(0), seq=0)        # nobody listens yet
    time.sleep(0.5)
    assert s.stats()["acked"] == 0 and s.stats()["failed"] == 0
    w = workers(1, ports=[port])
    s.flush(20)
    assert w.pull_meta(0) == tag(0)


def test_workers_that_never_answer_fail_the_waiting_sends_and_the_next_send_waits_again(
        workers, sender):
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    s = sender(addresses, max_inflight=2, startup_timeout_s=0.5)
    s.submit(make_batch(0), seq=0)
    s.submit(make_batch(1), seq=1)
    with pytest.raises(PeerUnavailable) as err:
        s.flush(20)
    assert err.value.field == "embedding_workers"
    assert all(a in str(err.value) for a in addresses)
    assert s.stats()["failed"] == 2       # both waiting sends failed, not only the first
    w = workers(2, ports=ports)           # the workers come up after all
    s.submit(make_batch(2), seq=2)
    s.flush(20)
    assert w.ready(0) + w.ready(1) == 1


SUM_ONLY_YAML = """\
feature_index_prefix_bit: 8
slots_config:
  user: {dim: 8}
  item: {dim: 8}
  tags: {dim: 4}
"""


@pytest.fixture
def worker_processes(tmp_path):
    """Two embedding worker processes (summation slots only: they never load torch) and
    their embedding server on a loop thread of this process."""
    (tmp_path / "embedding_config.yml").write_text(SUM_ONLY_YAML)
    lt = LoopThread(name="test-server")
    server = EmbeddingServer(10_000)
    lt.run(server.start(), timeout=20)
    workers = [RoleProcess("embedding-worker", [
        "--replica-index", str(i), "--replica-size", "2",
        "--embedding-config", str(tmp_path / "embedding_config.yml"),
        "--embedding-servers", server.address,
    ], name=f"embedding-worker-{i}", log_path=tmp_path / f"worker-{i}.log") for i in range(2)]
    try:
        with running(workers) as procs:
            yield procs
    finally:
        try:
            lt.run(server.stop(), timeout=20)
        finally:
            lt.close()


def test_a_killed_worker_process_sends_its_share_to_the_survivor_then_fails_by_name(
        worker_processes, sender):
    procs = worker_processes
    addresses = [p.address for p in procs]
    s = sender(addresses, timeout_ms=1500)
    for i in range(4):
        s.submit(make_batch(i), seq=i)
    s.flush(20)
    procs[0].kill()                       # SIGKILL: its connection drops
    for i in range(4, 8):
        s.submit(make_batch(i), seq=i)
    s.flush(30)                           # nothing failed: the survivor took them all
    assert s.stats()["acked"] == 8 and s.stats()["failed"] == 0
    assert s.stats()["retries"] >= 1

    lt = LoopThread(name="test-pull")
    try:
        async def drain() -> list[bytes]:
            async with RpcClient(addresses[1], timeout_ms=5000) as c:
                got = []
                while (b := await c.call("next_batch", {"timeout_ms": 300})) is not None:
                    got.append(b["meta"])
                return got

        got = lt.run(drain(), timeout=30)
    finally:
        lt.close()
    # Round-robin from worker 0: 1 and 3 went to worker 1 before the kill, then 4..7.
    assert sorted(got) == sorted([tag(1), tag(3), *(tag(i) for i in range(4, 8))])

    procs[1].kill()                       # no worker left
    s.submit(make_batch(8), seq=8)
    with pytest.raises(PeerUnavailable) as err:
        s.flush(30)
    assert err.value.field == "embedding_workers" and "batch 8 " in str(err.value)
    assert addresses[0] in str(err.value) and addresses[1] in str(err.value)

