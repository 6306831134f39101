"""stream_persia.worker.shards: groups split per owning server and gathered back, without
sockets (the router's fan-out over real servers is in test_batchplan and
test_server_restart)."""

from __future__ import annotations

import numpy as np
import pytest

from stream_persia.kernels import segments
from stream_persia.kernels.sharding import shard_of
from stream_persia.worker.shards import (
    LookupGroup,
    PooledLookup,
    RowLookup,
    UpdateGroup,
    gather_lookup,
    plan_lookup,
    split_update,
)

pytestmark = pytest.mark.timeout(30)
DIM = 3


def table(ids: np.ndarray) -> np.ndarray:
    """A row per id, a function of the id alone (what every server would hold)."""
    return (ids.astype(np.float64)[:, None] * [1.0, 0.5, -2.0] % 97).astype(np.float32)


def serve(wire: dict) -> np.ndarray:
    rows = table(wire["ids"])
    return segments.pool(rows, wire["index"], wire["offsets"]) if "index" in wire else rows


def groups() -> list[LookupGroup]:
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(0, 2**63, 40, dtype=np.uint64))
    index = rng.integers(0, len(ids), 90).astype(np.int32)
    offsets = np.array([0, 10, 10, 45, 90], np.int64)   # an empty segment too
    return [RowLookup(DIM, ids[:17]), PooledLookup(DIM, ids, index, offsets),
            RowLookup(DIM, np.zeros(0, np.uint64))]


@pytest.mark.parametrize("servers", [1, 2, 5])
def test_a_lookup_split_per_server_gathers_back_to_the_whole(servers):
    gs = groups()
    plan = plan_lookup(gs, servers)
    for s, wires in plan.requests.items():
        for w in wires:   # each server gets only the ids it owns
            assert (shard_of(w["ids"], servers) == s).all()
    got = gather_lookup(gs, plan, {s: [serve(w) for w in wires]
                                   for s, wires in plan.requests.items()})
    rows, pooled, empty = got
    np.testing.assert_array_equal(rows, table(gs[0].ids))
    whole = gs[1]
    assert isinstance(whole, PooledLookup)
    want = segments.pool(table(whole.ids), whole.index, whole.offsets)
    np.testing.assert_allclose(pooled, want, rtol=1e-6)
    assert empty.shape == (0, DIM) and pooled.shape == (4, DIM)


@pytest.mark.parametrize("servers", [1, 4])
def test_an_update_split_per_server_sends_each_row_once_to_its_owner(servers):
    ids = np.arange(1, 30, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    grads = np.arange(ids.size * DIM, dtype=np.float32).reshape(ids.size, DIM)
    parts = split_update([UpdateGroup(DIM, ids, grads)], servers)
    sent = {}
    for s, wires in parts.items():
        for w in wires:
            assert (shard_of(w["ids"], servers) == s).all() and w["grads"].flags.c_contiguous
            sent.update(zip(w["ids"].tolist(), map(tuple, w["grads"].tolist()), strict=True))
    assert sent == dict(zip(ids.tolist(), map(tuple, grads.tolist()), strict=True))
    assert split_update([], servers) == {}
