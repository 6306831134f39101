"""Fan-out of lookups and updates to the embedding servers that own the ids.

Ids go to shard ``sharding.shard_of(id, S)``. One request per server carries every
(dim, ids) group of a batch, all servers are called concurrently, and the replies are
scattered back into per-group arrays in the caller's id order. Splitting is one stable
argsort per group (no per-id Python work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from stream_persia.errors import BadInput
from stream_persia.rpc import RpcClient
from stream_persia.sharding import split_by_shard

__all__ = ["ShardRouter"]


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

    async def lookup(self, groups: Sequence[tuple[int, np.ndarray]], mode: str
                     ) -> tuple[list[np.ndarray], int]:
        """Look up ``[(dim, ids)]``; returns float32 rows per group and the missing count
        (with one server, the rows are read-only views of its reply)."""
        if self.num_shards == 1:  # nothing to split or scatter back
            reply = await self.clients[0].call(
                "lookup", {"mode": mode, "groups": [{"dim": d, "ids": i} for d, i in groups]})
            return list(reply["rows"]), int(reply["missing"])
        splits = [split_by_shard(ids, self.num_shards) for _, ids in groups]
        calls, plan = [], []
        for s, client in enumerate(self.clients):
            sub, where = [], []
            for g, ((dim, ids), sp) in enumerate(zip(groups, splits, strict=True)):
                pos = sp.positions(s)
                if pos.size:
                    sub.append({"dim": dim, "ids": ids[pos]})
                    where.append((g, pos))
            if sub:
                calls.append(client.call("lookup", {"mode": mode, "groups": sub}))
                plan.append(where)
        replies = await asyncio.gather(*calls)
        out = [np.zeros((ids.size, dim), dtype=np.float32) for dim, ids in groups]
        missing = 0
        for reply, where in zip(replies, plan, strict=True):
            missing += int(reply["missing"])
            for rows, (g, pos) in zip(reply["rows"], where, strict=True):
                out[g][pos] = rows
        return out, missing

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
