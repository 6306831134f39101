"""Fan-out of lookups and updates to the embedding servers that own the ids.

Ids go to shard ``sharding.shard_of(id, S)``. One request per server carries every group of
a batch, all servers are called concurrently, and the replies are scattered back into
per-group arrays in the caller's id order, or, for pooled lookups, their partial sums are
added. Splitting is one stable argsort per group, or one pass of
:func:`stream_persia.segments.split` (no per-id Python work).

A restarted server is configured again before it serves. The optimizer and
EmbeddingConfig reach the servers once (``configure``, from the NN rank 0 or the API); a
server process that restarts comes back with the defaults. So the router learns the job's
configuration from the servers: every lookup and update reply carries the server's
configuration digest, and on a digest it does not know yet the router fetches the
configuration (``get_config``) from that server. From then on its requests carry the
digest, a server that was never configured refuses them (a Misuse on field ``config``),
and the router configures it with what it learned and retries. A job that never
configures its servers sends no digest and is served as before.

Before its first request a router asks every server (:meth:`ShardRouter.learn`), so a
worker that restarts together with some of the servers learns the configuration from the
others before it sends anything, and configures the restarted ones first: otherwise the
first batch would reach them without a digest and be looked up and applied with the
defaults. When every server lost it too, only the NN side still knows it: an NN worker's
``next_batch`` names the digest it expects, the embedding worker answers a Misuse on field
``config`` while no server holds a configuration, and the NN side configures the servers
again (:mod:`stream_persia.nn.loader`).

Updates are idempotent and retried (:meth:`ShardRouter.push`). A batch's update is split
once into one request per owning server (:meth:`ShardRouter.split_update`, a
:class:`PendingUpdate`), each carrying the batch's token (``<worker incarnation>-<batch
id>``; the servers remember recent tokens and answer a repeated one with the first reply
without applying it, see :mod:`stream_persia.embedding_server`). A request that fails
because the server is unreachable, timed out, or was busy is sent again, to that server
only, with exponential backoff until the push's deadline; the servers that replied are
never asked again. A reply thus means the server applied the update exactly once, and a
timed-out request that the server did apply is recognised when it is retried.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stream_persia import segments
from stream_persia.errors import (
    Backpressure,
    BadInput,
    Misuse,
    PeerUnavailable,
    PersiaError,
    RemoteTimeout,
)
from stream_persia.rpc import RpcClient, auth
from stream_persia.sharding import shard_of, split_by_shard

__all__ = ["PendingUpdate", "ShardRouter"]

log = logging.getLogger(__name__)

#: Errors after which an update request is sent again: the server may be restarting, be
#: briefly unreachable or overloaded. A timed-out request may have been applied: its
#: token makes the retry harmless. Other errors (a refused request) are final.
RETRYABLE = (PeerUnavailable, RemoteTimeout, Backpressure)
_FIRST_RETRY_S, _MAX_RETRY_S = 0.05, 1.0


@dataclass(eq=False)
class PendingUpdate:
    """One batch's update, split per owning server, and what each server answered.

    ``parts`` maps a server index to the groups it owns; ``replies`` gets a server's reply
    once it applied them (or recognised the token); ``errors`` the last error of a server
    that has not replied.
    """

    token: str | None
    parts: dict[int, list[dict]]
    replies: dict[int, dict] = field(default_factory=dict)
    errors: dict[int, PersiaError] = field(default_factory=dict)

    def missing(self) -> list[int]:
        """Servers that have not replied yet, in index order."""
        return [s for s in self.parts if s not in self.replies]

    def done(self) -> bool:
        return len(self.replies) == len(self.parts)

    def totals(self) -> tuple[int, int]:
        """(applied, dropped) over the servers that replied."""
        return (sum(int(r["applied"]) for r in self.replies.values()),
                sum(int(r["dropped"]) for r in self.replies.values()))


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
        secret: the job's role secret (see :class:`~stream_persia.rpc.RpcClient`).
    """

    def __init__(self, addresses: Sequence[str], *, timeout_ms: int = 10_000,
                 secret: auth.SecretSetting = auth.FROM_ENV):
        if not addresses:
            raise BadInput("at least one embedding server address is needed",
                           field="embedding_servers")
        self.addresses = list(addresses)
        secret = auth.resolve(secret)   # read once for every client
        self.clients = [RpcClient(a, timeout_ms=timeout_ms, name=f"embedding-server-{i}",
                                  secret=secret)
                        for i, a in enumerate(self.addresses)]
        # The servers' configuration as last learned from them (see the module docstring).
        self.config: dict | None = None
        self._asked = False                # a learn() was answered (see _call)
        self._learning = asyncio.Lock()

    async def learn(self, *, once: bool = False) -> dict | None:
        """Ask every server for its configuration (``get_config``); adopt the one most of
        them hold and configure the servers that hold none with it. Returns what the
        router knows afterwards (None: no server is configured). A server that does not
        answer is skipped (its own requests fail, or configure it again, later); when none
        answers, the first one's error is raised.
        ``once``: only if no learn has been answered yet (before the first request)."""
        async with self._learning:
            if once and self._asked:
                return self.config
            replies = await asyncio.gather(*(c.call("get_config", None) for c in self.clients),
                                           return_exceptions=True)
            if all(isinstance(r, BaseException) for r in replies):
                raise replies[0]   # no server answers: say so (PeerUnavailable names it)
            self._asked = True
            held = [r for r in replies if isinstance(r, dict) and r.get("digest")]
            if held:
                digests = [r["digest"] for r in held]
                best = max(held, key=lambda r: digests.count(r["digest"]))
                if len(set(digests)) > 1:
                    log.warning("embedding servers hold different configurations %s; "
                                "following %s (the most common)", sorted(set(digests)),
                                best["digest"])
                self.config = best
            if self.config is not None:
                await asyncio.gather(*(self._configure(s) for s, r in enumerate(replies)
                                       if r is None))
            return self.config

    async def _configure(self, s: int) -> None:
        """Give server ``s``, which holds no configuration, the one learned."""
        assert self.config is not None
        log.warning("embedding server %d (%s) holds no configuration (restarted?): "
                    "configuring it with %s", s, self.addresses[s], self.config["digest"])
        await self.clients[s].call("configure", self.config)   # a get_config reply

    async def _call(self, s: int, method: str, params: dict,
                    timeout_ms: float | None = None) -> Any:
        """``method`` (lookup or update) on server ``s``, expecting the configuration
        learned so far; a server that lost it is configured again first."""
        if not self._asked:
            await self.learn(once=True)
        if self.config is not None:
            params["config"] = self.config["digest"]
        try:
            reply = await self.clients[s].call(method, params, timeout_ms)
        except Misuse as e:
            if e.field != "config" or self.config is None:
                raise
            await self._configure(s)
            reply = await self.clients[s].call(method, params, timeout_ms)
        digest = reply.get("config")
        if digest is not None and (self.config is None or digest != self.config["digest"]):
            learned = await self.clients[s].call("get_config", None)
            if learned is not None and learned.get("digest") == digest:
                self.config = learned
        return reply

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
            reply = await self._call(
                0, "lookup", {"mode": mode, "groups": [_wire_group(g) for g in groups]})
            return list(reply["rows"]), int(reply["missing"])
        parts = [self._split(g) for g in groups]
        calls, plan = [], []
        for s in range(self.num_shards):
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
                calls.append(self._call(s, "lookup", {"mode": mode, "groups": sub}))
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

    def split_update(self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]],
                     token: str | None = None) -> PendingUpdate:
        """``[(dim, ids, grads)]`` split into one request per owning server (one stable
        argsort per group; no per-id Python work)."""
        if not groups:   # nothing to apply (no gradients): no request at all
            return PendingUpdate(token, {})
        if self.num_shards == 1:
            return PendingUpdate(token, {0: [
                {"dim": d, "ids": i, "grads": np.ascontiguousarray(g)} for d, i, g in groups]})
        splits = [split_by_shard(ids, self.num_shards) for _, ids, _ in groups]
        parts: dict[int, list[dict]] = {}
        for s in range(self.num_shards):
            sub = []
            for (dim, ids, grads), sp in zip(groups, splits, strict=True):
                pos = sp.positions(s)
                if pos.size:
                    sub.append({"dim": dim, "ids": ids[pos],
                                "grads": np.ascontiguousarray(grads[pos])})
            if sub:
                parts[s] = sub
        return PendingUpdate(token, parts)

    async def push(self, update: PendingUpdate, retry_s: float = 0.0) -> tuple[int, int]:
        """Send ``update`` to every server that has not applied it yet; returns (applied,
        dropped) over all of its servers.

        A request failing with a :data:`RETRYABLE` error is sent again to that server
        only, with exponential backoff (50 ms doubling to 1 s, jittered), for up to
        ``retry_s`` seconds from now; each attempt is bounded by what is left of that
        time (and by the client's timeout). ``update`` records every reply, so a later
        ``push`` of it resumes where this one stopped.

        Raises:
            PersiaError: the first server's error when some server has not applied the
                update: a non-retryable one at once, else the last one at the deadline.
                ``update.missing()`` names the servers, ``update.errors`` their errors.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_s
        delay = _FIRST_RETRY_S
        while True:
            todo = update.missing()
            if not todo:
                return update.totals()
            limit_ms = max(1.0, (deadline - loop.time()) * 1000) if retry_s > 0 else None
            replies = await asyncio.gather(*(
                self._call(s, "update", self._update_params(update, s),
                           None if limit_ms is None
                           else min(limit_ms, self.clients[s].timeout_ms))
                for s in todo), return_exceptions=True)
            final = None
            for s, reply in zip(todo, replies, strict=True):
                if isinstance(reply, BaseException):
                    if not isinstance(reply, PersiaError):
                        raise reply
                    update.errors[s] = reply
                    if not isinstance(reply, RETRYABLE):
                        final = final or reply
                else:
                    update.replies[s] = reply
                    update.errors.pop(s, None)
            if update.done():
                return update.totals()
            wait = delay * (0.8 + 0.4 * random.random())
            if final is not None or loop.time() + wait >= deadline:
                raise final or update.errors[update.missing()[0]]
            log.warning("update %s: embedding server(s) %s did not apply it (%s); retrying "
                        "in %.2f s", update.token, update.missing(),
                        update.errors[update.missing()[0]].message, wait)
            await asyncio.sleep(wait)
            delay = min(2 * delay, _MAX_RETRY_S)

    @staticmethod
    def _update_params(update: PendingUpdate, s: int) -> dict:
        params: dict[str, Any] = {"groups": update.parts[s]}
        if update.token is not None:
            params["token"] = update.token
        return params

    async def update(self, groups: Sequence[tuple[int, np.ndarray, np.ndarray]],
                     token: str | None = None, retry_s: float = 0.0) -> tuple[int, int]:
        """Send ``[(dim, ids, grads)]`` to the owning servers; returns (applied, dropped).
        See :meth:`push` for ``token`` and ``retry_s``."""
        return await self.push(self.split_update(groups, token), retry_s)
