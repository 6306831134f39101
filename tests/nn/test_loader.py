"""StreamPrefetcher (nn/loader.py) against real embedding workers, without a TrainCtx.

What the training loop relies on: at most ``staleness`` served batches hold a permit and at
most ``buffer_size`` wait on the NN side, whatever the workers have ready; evaluation
batches hold no permit; pausing hands back what was never taken, and the workers serve it
again first, in the order it was served; ``reproducible`` never leaves its worker; a
worker that goes away is raised to the training thread.

The job (embedding server and workers) runs on a loop thread of this process; the
prefetcher runs on the cluster's own loop thread, as in TrainCtx.
"""

from __future__ import annotations

import time

import pytest
from nn_helpers import LEARNABLE_SCHEMA, learnable_batches

from stream_persia.core.data import PersiaBatch
from stream_persia.errors import PersiaError
from stream_persia.loader.data_ctx import DataCtx
from stream_persia.nn.cluster import Cluster
from stream_persia.nn.loader import StreamPrefetcher

pytestmark = pytest.mark.timeout(60)


def tagged(n: int, start: int = 0, *, requires_grad: bool = True) -> list[PersiaBatch]:
    """Small learnable batches tagged ``meta=b"b<i>"``."""
    out = []
    for i, b in enumerate(learnable_batches(n, 8, seed=start, requires_grad=requires_grad),
                          start=start):
        out.append(PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                               requires_grad=requires_grad, meta=f"b{i}".encode()))
    return out


def send(job, worker: int, batches: list[PersiaBatch]) -> None:
    """Ingest ``batches`` into embedding worker ``worker``, in order."""
    with DataCtx(embedding_workers=[job.worker_addresses[worker]], max_inflight=1) as dc:
        for b in batches:
            dc.send_data(b)


@pytest.fixture
def cluster_of():
    made: list[Cluster] = []

    def make(job) -> Cluster:
        c = Cluster(job.worker_addresses, rpc_timeout_ms=5000, ready_timeout_s=20,
                    name="test-nn-rpc")
        made.append(c)
        c.start()
        return c

    yield make
    for c in made:
        c.close()


def started(cluster: Cluster, **kw) -> StreamPrefetcher:
    kw.setdefault("poll_ms", 50)
    pf = StreamPrefetcher(cluster, **kw)
    cluster.run(pf.start(), timeout=10)
    return pf


def settle(pf: StreamPrefetcher, served: int, timeout_s: float = 10.0) -> None:
    """Wait until ``served`` batches were fetched, then give it time to fetch more."""
    deadline = time.monotonic() + timeout_s
    while pf.served < served:
        assert time.monotonic() < deadline, f"only {pf.served} of {served} batches fetched"
        time.sleep(0.01)
    time.sleep(0.4)     # eight polls: a prefetcher ignoring its bound would fetch more


def release(cluster: Cluster, batch) -> None:
    async def on_loop() -> None:
        batch.ticket.release()

    cluster.run(on_loop(), timeout=10)


def stop(cluster: Cluster, pf: StreamPrefetcher) -> list:
    return cluster.run(pf.pause(), timeout=20)


def test_staleness_bounds_the_batches_served_and_not_yet_applied(job_factory, cluster_of):
    job = job_factory(LEARNABLE_SCHEMA)
    send(job, 0, tagged(6))
    cluster = cluster_of(job)
    pf = started(cluster, staleness=2, buffer_size=8)
    try:
        settle(pf, 2)
        assert (pf.served, len(pf.outstanding), len(job.workers[0].ready)) == (2, 2, 4)
        taken = [pf.get(5), pf.get(5)]
        settle(pf, 2)                           # taken, but not applied: still bounded
        assert pf.served == 2 and pf.get(0.2) is None
        release(cluster, taken[0])              # its gradients were applied
        settle(pf, 3)
        assert pf.served == 3 and len(job.workers[0].ready) == 3
        assert [b.meta for b in taken] + [pf.get(5).meta] == [b"b0", b"b1", b"b2"]
    finally:
        stop(cluster, pf)


def test_buffer_size_bounds_the_batches_waiting_for_the_training_loop(job_factory,
                                                                      cluster_of):
    job = job_factory(LEARNABLE_SCHEMA)
    send(job, 0, tagged(6))
    cluster = cluster_of(job)
    pf = started(cluster, staleness=8, buffer_size=2)
    try:
        settle(pf, 2)
        assert pf.served == 2 and len(job.workers[0].ready) == 4
        assert pf.get(5).meta == b"b0"          # a slot of the buffer comes free
        settle(pf, 3)
        assert pf.served == 3 and len(job.workers[0].ready) == 3
    finally:
        stop(cluster, pf)


def test_evaluation_batches_hold_no_permit(job_factory, cluster_of):
    job = job_factory(LEARNABLE_SCHEMA)
    send(job, 0, tagged(3, requires_grad=False))
    cluster = cluster_of(job)
    pf = started(cluster, staleness=1, buffer_size=8)
    try:
        settle(pf, 3)
        assert pf.outstanding == {}
        got = [pf.get(5) for _ in range(3)]
        assert [b.meta for b in got] == [b"b0", b"b1", b"b2"]
        assert all(b.ticket is None for b in got)
    finally:
        stop(cluster, pf)


def test_pause_hands_back_what_was_not_taken_and_it_is_served_again_first(job_factory,
                                                                         cluster_of):
    job = job_factory(LEARNABLE_SCHEMA)
    send(job, 0, tagged(5))
    cluster = cluster_of(job)
    pf = started(cluster, staleness=3, buffer_size=3)
    settle(pf, 3)
    first = pf.get(5)                           # taken by the training loop: kept
    left = stop(cluster, pf)
    assert [b.meta for b in left] == [b"b1", b"b2"]
    assert not pf.running
    cluster.run(pf.give_back(left), timeout=10)
    assert pf.returned == 2 and list(pf.outstanding) == [(0, first.batch_id)]
    assert len(job.workers[0].ready) == 4       # b1, b2 back ahead of b3, b4
    release(cluster, first)
    cluster.run(pf.start(), timeout=10)
    try:
        settle(pf, 6)                           # the buffer's slots came back with them
        assert pf.served == 6 and len(job.workers[0].ready) == 1
        again = [pf.get(5) for _ in range(2)]
        assert [b.meta for b in again] == [b"b1", b"b2"]
        assert [b.batch_id for b in again] == [b.batch_id for b in left]
    finally:
        stop(cluster, pf)


def test_a_pause_keeps_forward_only_batches_for_the_next_iteration(job_factory, cluster_of):
    """Forward-only batches (requires_grad=False) are settled by their worker when served:
    handed back they were dropped, so a checkpoint cut or the end of a loop with one in
    the ready buffer lost it, silently. They stay on the NN side, first in line."""
    job = job_factory(LEARNABLE_SCHEMA)
    send(job, 0, tagged(1) + tagged(2, 1, requires_grad=False) + tagged(1, 3))
    cluster = cluster_of(job)
    pf = started(cluster, staleness=4, buffer_size=4)
    settle(pf, 4)
    left = stop(cluster, pf)
    assert [b.meta for b in left] == [b"b0", b"b3"]    # only these go back to the worker
    cluster.run(pf.give_back(left), timeout=10)
    cluster.run(pf.start(), timeout=10)
    try:
        again = [pf.get(5) for _ in range(4)]
        assert [b.meta for b in again] == [b"b1", b"b2", b"b0", b"b3"]
        assert [b.requires_grad for b in again] == [False, False, True, True]
        assert pf.get(0.3) is None
    finally:
        stop(cluster, pf)


def test_reproducible_waits_on_its_worker_where_the_default_moves_on(job_factory,
                                                                      cluster_of):
    job = job_factory(LEARNABLE_SCHEMA, workers=2)
    send(job, 0, tagged(1))                     # worker 1 has nothing
    cluster = cluster_of(job)
    strict = started(cluster, staleness=2, buffer_size=2, reproducible=True,
                     first_worker=1)
    try:
        assert strict.get(0.8) is None          # it keeps asking worker 1
        assert len(job.workers[0].ready) == 1
    finally:
        stop(cluster, strict)
    moving = started(cluster, staleness=2, buffer_size=2, first_worker=1)
    try:
        got = moving.get(5)
        assert (got.meta, got.worker_index) == (b"b0", 0)
    finally:
        stop(cluster, moving)


def test_reproducible_alternates_workers_in_strict_order(job_factory, cluster_of):
    job = job_factory(LEARNABLE_SCHEMA, workers=2)
    send(job, 0, tagged(2, 0))
    send(job, 1, tagged(2, 10))
    cluster = cluster_of(job)
    pf = started(cluster, staleness=4, buffer_size=4, reproducible=True, first_worker=1)
    try:
        got = [pf.get(5) for _ in range(4)]
        assert [(b.worker_index, b.meta) for b in got] == [
            (1, b"b10"), (0, b"b0"), (1, b"b11"), (0, b"b1")]
    finally:
        stop(cluster, pf)


def test_a_worker_that_goes_away_is_raised_to_the_training_thread(job_factory, cluster_of):
    job = job_factory(LEARNABLE_SCHEMA)
    cluster = cluster_of(job)
    pf = started(cluster, staleness=1, buffer_size=1)
    try:
        job.loop.run(job.workers[0].stop(), timeout=10)
        deadline = time.monotonic() + 20
        with pytest.raises(PersiaError):
            while time.monotonic() < deadline:
                pf.get(0.2)
        assert pf.get(0.3) is None              # it stopped fetching: nothing more comes
    finally:
        stop(cluster, pf)


def test_a_fetch_error_pending_at_a_pause_is_raised_after_it(job_factory, cluster_of):
    """A checkpoint cut or the end of a loop pausing the prefetcher while a fetch's error
    waited in its ready queue dropped the error (a ServerRestarted, say): the next
    iteration fetched on as if nothing had happened."""
    job = job_factory(LEARNABLE_SCHEMA)
    cluster = cluster_of(job)
    pf = started(cluster, staleness=1, buffer_size=1)
    job.loop.run(job.workers[0].stop(), timeout=10)
    deadline = time.monotonic() + 20
    while not pf._ready.qsize():                # the fetch failed: its error is queued
        assert time.monotonic() < deadline, "the fetch never failed"
        time.sleep(0.05)
    assert stop(cluster, pf) == []
    with pytest.raises(PersiaError):
        pf.get(0.2)


@pytest.mark.parametrize("value", ["false", "0", 2, None, [True]])
def test_reproducible_must_be_a_bool(value):
    """``bool(reproducible)`` read ``"false"`` (an environment variable passed on) as True:
    the run fetched in strict round-robin, waiting on slow workers, with nothing to say
    it was asked not to."""
    from stream_persia.data import DataLoader, StreamingDataset
    from stream_persia.errors import Misuse

    with pytest.raises(Misuse) as err:
        DataLoader(StreamingDataset(), reproducible=value)
    assert err.value.field == "reproducible"
    for ok in (True, False, 1, 0):
        assert DataLoader(StreamingDataset(), reproducible=ok).reproducible is bool(ok)
