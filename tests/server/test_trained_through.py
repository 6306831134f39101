"""An embedding server's ``trained_through`` over real sockets (issue 18): the newest event
time of any update it applied, from the ``update`` RPC's ``event_time``. A bad one is
refused naming the field with nothing applied; a duplicate or a refused update changes
nothing; ``clear`` resets it and a load sets the checkpoint's; ``health`` and the metrics
show it. The worker that sends it: tests/nn/test_nn_train.py (through a real worker and TrainCtx).
"""

from __future__ import annotations

import numpy as np
import pytest

from stream_persia.errors import BadInput, StreamReplay
from stream_persia.rpc import RpcClient
from stream_persia.testing.servers import running_servers

pytestmark = pytest.mark.timeout(30)

DIM = 4
GAUGE = b"persia_embedding_server_trained_through_seconds"


def update(event_time=None, *, token: str | None = None, source: dict | None = None) -> dict:
    ids = np.arange(1, 9, dtype=np.uint64)
    params: dict = {"groups": [{"dim": DIM, "ids": ids,
                                "grads": np.ones((ids.size, DIM), np.float32)}]}
    if event_time is not None:
        params["event_time"] = event_time
    if token is not None:
        params["token"] = token
    if source is not None:
        params["source"] = source
    return params


async def trained_through(c: RpcClient):
    return (await c.call("health"))["trained_through"]


async def gauge(c: RpcClient) -> float | None:
    for line in (await c.call("metrics")).splitlines():
        if line.startswith(GAUGE + b" "):
            return float(line.split()[1])
    return None


async def test_trained_through_is_the_newest_event_time_applied():
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        assert await trained_through(c) is None and await gauge(c) is None
        await c.call("update", update())                  # an update without one: unknown
        assert await trained_through(c) is None
        for t, newest in ((1_750_000_010.5, 1_750_000_010.5), (1_750_000_000, 1_750_000_010.5),
                          (1_750_000_020, 1_750_000_020.0), (None, 1_750_000_020.0)):
            await c.call("update", update(t))
            assert await trained_through(c) == newest == server.trained_through
            assert await gauge(c) == newest


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), True, "1.0", [1.0],
                                 {"t": 1}])
async def test_a_bad_event_time_is_refused_naming_the_field_and_nothing_is_applied(bad):
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        await c.call("update", update(5.0))
        rows = server.store.lookup(np.arange(1, 9, dtype=np.uint64), DIM, False).copy()
        with pytest.raises(BadInput) as err:
            await c.call("update", update(bad, token="bad-1"))
        assert err.value.field == "event_time" and "event_time" in str(err.value)
        np.testing.assert_array_equal(
            server.store.lookup(np.arange(1, 9, dtype=np.uint64), DIM, False), rows)
        assert await trained_through(c) == 5.0
        # The token was not spent: the same update with a good time applies.
        reply = await c.call("update", update(6.0, token="bad-1"))
        assert "duplicate" not in reply and await trained_through(c) == 6.0


async def test_a_duplicate_or_refused_update_does_not_move_it():
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        source = {"topic": "t", "partition": 0, "offset": 3, "writer": "a.1"}
        await c.call("update", update(10.0, token="w-1", source=source))
        again = await c.call("update", update(99.0, token="w-1", source=source))
        assert again["duplicate"] is True and await trained_through(c) == 10.0
        with pytest.raises(StreamReplay):   # another stream replaying offset 3
            await c.call("update", update(99.0, source={**source, "writer": "b.1"}))
        assert await trained_through(c) == 10.0


async def test_clear_resets_it_and_a_load_sets_the_checkpoints(tmp_path):
    """A load replaces the rows: they are trained through what the load says (the
    checkpoint's), never through what the replaced rows were (a restore to an older
    checkpoint would claim a freshness it does not have); unknown when not given."""
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        await c.call("update", update(7.25))
        dst = str(tmp_path / "ck")
        await c.call("dump", {"dir": dst})
        await c.call("update", update(9.5, token="later"))
        await c.call("load", {"dir": dst, "files": [], "trained_through": 7.25})
        assert (await c.call("health"))["loads"] == 1 and await trained_through(c) == 7.25
        await c.call("update", update(8.0, token="replayed"))
        assert await trained_through(c) == 8.0     # the replay moves it on from there
        staged = await c.call("load", {"dir": dst, "files": [], "stage": True,
                                       "trained_through": 7.0})
        assert await trained_through(c) == 8.0     # only the commit swaps the rows in
        await c.call("commit_load", {"token": staged["token"]})
        assert await trained_through(c) == 7.0
        await c.call("load", {"dir": dst, "files": []})
        assert await trained_through(c) is None and await gauge(c) is None
        with pytest.raises(BadInput) as err:
            await c.call("load", {"dir": dst, "files": [], "trained_through": -1})
        assert err.value.field == "trained_through"
        await c.call("update", update(7.25, token="again"))
        await c.call("clear")
        assert await trained_through(c) is None and await gauge(c) is None
