"""Fan-out of lookups and updates to the embedding servers that own the ids.

Ids go to shard ``sharding.shard_of(id, S)``. One request per server carries every group of
a batch, all servers are called concurrently, and the replies are scattered back into
per-group arrays in the caller's id order, or, for pooled lookups, their partial sums are
added. Splitting is one stable argsort per group, or one pass of
:func:`stream_persia.segments.split` (no per-id Python work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from stream_persia import segments
from stream_persia.errors import BadInput
from stream_persia.rpc import RpcClient
from stream_persia.sharding import shard_of, split_by_shard

__all__ = ["ShardRouter"]


def _wire_group(group: tuple) -> dict:
    if len(group) == 2:
        return {"dim": group[0], "ids": group[1]}
    dim, ids, index, offsets = group
    return {"dim": dim, "ids": ids, "index": index, "offsets": offsets}


class ShardRouter:
    """Talks to every embedding server of a job.

    Args:
        addresses: ``host:port`` of server 0..S-1, in replica-index order.
        timeout_ms: per-call RPC timeout.
    """

    def __init__(self, addresses: Sequence[str], *, timeout_ms: int = 10_000):
        if not addresses:
            raise BadInput("at least one embedding server address is needed",
                           field="embedding_servers")
        self.addresses = list(addresses)
        self.clients = [RpcClient(a, timeout_ms=timeout_ms, name=f"embedding-server-{i}")
                        for i, a in enumerate(self.addresses)]

    @property
    def num_shards(self) -> int:
        return len(self.clients)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def broadcast(self, method: str, params: Any = None) -> list[Any]:
        """Call ``method`` on every server; results in replica-index order."""
        return list(await asyncio.gather(*(c.call(method, params) for c in self.clients)))

    async def lookup(self, groups: Sequence[tuple], mode: str
                     ) -> tuple[list[np.ndarray], int]:
        """Look up ``groups`` on the servers owning their ids; returns one float32 array per
        group and the missing count.

        A group is ``(dim, ids)``: the rows of ``ids``, ``(len(ids), dim)``; or ``(dim,
        ids, index, offsets)``, a pooled lookup (:mod:`stream_persia.segments`): the
        ``(len(offsets) - 1, dim)`` segment sums, which every server pools over the rows
        it owns and this adds up in server order. With one server the arrays are
        read-only views of its reply.
        """
        if self.num_shards == 1:  # nothing to split or scatter back
            reply = await self.clients[0].call(
                "lookup", {"mode": mode, "groups": [_wire_group(g) for g in groups]})
            return list(reply["rows"]), int(reply["missing"])
        parts = [self._split(g) for g in groups]
        calls, plan = [], []
        for s, client in enumerate(self.clients):
            sub, where = [], []
            for gi, (group, part) in enumerate(zip(groups, parts, strict=True)):
                if len(group) == 2:
                    pos = part.positions(s)
                    if pos.size:
                        sub.append({"dim": group[0], "ids": group[1][pos]})
                        where.append((gi, pos))
                elif part[s].positions.size:
                    sp = part[s]
                    sub.append({"dim": group[0], "ids": group[1][sp.positions],
                                "index": sp.index, "offsets": sp.offsets})
                    where.append((gi, None))
            if sub:
                calls.append(client.call("lookup", {"mode": mode, "groups": sub}))
                plan.append(where)
        replies = await asyncio.gather(*calls)
        out = [np.zeros((len(g[1]) if len(g) == 2 else len(g[3]) - 1, g[0]), dtype=np.float32)
               for g in groups]
        missing = 0
        for reply, where in zip(replies, plan, strict=True):
            missing += int(reply["missing"])
            for rows, (gi, pos) in zip(reply["rows"], where, strict=True):
                if pos is None:
                    out[gi] += rows         # partial sums, added in server order
                else:
                    out[gi][pos] = rows
        return out, missing

    def _split(self, group: tuple) -> Any:
        """A classic group's :class:`ShardSplit`, or a pooled group's per-server parts."""
        if len(group) == 2:
            return split_by_shard(group[1], self.num_shards)
        _, ids, index, offsets = group
        return segments.split(index, offsets, shard_of(ids, self.num_shards), self.num_shards)

    async def update(self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]]
                     ) -> tuple[int, int]:
        """Send ``[(dim, ids, grads)]`` to the owning servers; returns (applied, dropped)."""
        if self.num_shards == 1:
            reply = await self.clients[0].call("update", {"groups": [
                {"dim": d, "ids": i, "grads": np.ascontiguousarray(g)} for d, i, g in groups]})
            return int(reply["applied"]), int(reply["dropped"])
        splits = [split_by_shard(ids, self.num_shards) for _, ids, _ in groups]
        calls = []
        for s, client in enumerate(self.clients):
            sub = []
            for (dim, ids, grads), sp in zip(groups, splits, strict=True):
                pos = sp.positions(s)
                if pos.size:
                    sub.append({"dim": dim, "ids": ids[pos],
                                "grads": np.ascontiguousarray(grads[pos])})
            if sub:
                calls.append(client.call("update", {"groups": sub}))
        replies = await asyncio.gather(*calls)
        return (sum(int(r["applied"]) for r in replies),
                sum(int(r["dropped"]) for r in replies))
