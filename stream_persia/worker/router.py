"""Fan-out of lookups and updates to the embedding servers that own the ids.

Ids go to shard ``sharding.shard_of(id, S)``. One request per server carries every group of
a batch, all servers are called concurrently, and the replies are scattered back into
per-group arrays in the caller's id order, or, for pooled lookups, their partial sums are
added. Splitting and gathering are pure (:mod:`stream_persia.worker.shards`: no per-id
Python work).

**A server that restarted lost its table, and the job is told.** Every embedding server
process has a random *incarnation* (:mod:`stream_persia.server.service`); a process
killed and restarted at the same address (kill -9, OOM, a lost node, a StatefulSet
bringing the pod back) has another one and an empty table: every row the old one held, its
optimizer state and the contribution of every sample trained so far to those rows are
gone. The router remembers each server's incarnation from its first reply (and the rows it
held, from every reply), and its lookups and updates name it: the server refuses one meant
for another process before touching anything (:class:`~stream_persia.errors.
ServerRestarted`), and a reply from another process is noticed too (one string comparison
per reply, nothing per id). What happens then is ``on_server_restart``
(``embedding_worker_config.on_server_restart``):

- ``fail`` (default): the server is *lost*. Every lookup and update that needs it fails
  with ``ServerRestarted`` naming the server, its address, the two incarnations and the
  rows it held when last seen; an update being retried after a connection dropped meets
  the new process and fails its batch instead of being "applied once" to the empty
  table. The embedding worker reports it (``health`` not ok, its ``frontier`` names it so
  checkpoints refuse, the launched role exits 1: :mod:`stream_persia.worker.service`).
  The way back is a restore of a checkpoint into the servers
  (:func:`stream_persia.checkpoint.load_embeddings`): a server whose ``health`` reports
  ``loads`` > 0 had its table replaced on purpose since it started, and is served again
  (probed on the next request to it, on ``health`` and on ``reset_stream``).
- ``continue``: the old behaviour, as an explicit choice. The restart is logged at ERROR
  and counted (``on_restart``, the worker's ``server_restarts_total{server}``), the new
  incarnation adopted, and the server configured again (below) before it serves.

Configuration. The optimizer and EmbeddingConfig reach the servers once (``configure``,
from the NN rank 0 or the API); a server process that restarts comes back with the
defaults. So the router learns the job's configuration from the servers: every lookup and
update reply carries the server's configuration digest, and on a digest it does not know
yet the router fetches the configuration (``get_config``) from that server. From then on
its requests carry the digest, a server that was never configured refuses them (a Misuse
on field ``config``), and the router configures it with what it learned and retries (a
restarted server only gets there with ``continue``). A job that never configures its
servers sends no digest; its restarts are caught by the incarnation all the same.

Before its first request a router asks every server (:meth:`ShardRouter.learn`: ``health``
and ``get_config``), so it knows every incarnation before it sends anything. A worker that
restarts together with some of the servers cannot know their old incarnations; a server
that holds no configuration while the others hold the job's and hold rows restarted after
the job configured it, and is treated as a restart (its rows: unknown). Otherwise it is
configured first, so that the first batch is not looked up and applied with the defaults.
When every server lost its configuration too, only the NN side still knows it: an NN
worker's ``next_batch`` names the digest it expects, and the embedding worker answers
``ServerRestarted`` (``fail``) or a Misuse on field ``config`` (``continue``: the NN side
configures the servers again, :mod:`stream_persia.nn.loader`).

Updates are idempotent and retried (:meth:`ShardRouter.push`). A batch's update is split
once into one request per owning server (:meth:`ShardRouter.split_update`, a
:class:`PendingUpdate`), each carrying the batch's token (``<worker incarnation>-<batch
id>``; the servers remember recent tokens and answer a repeated one with the first reply
without applying it, see :mod:`stream_persia.server.service`). A request that fails
because the server is unreachable, timed out, or was busy is sent again, to that server
only, with exponential backoff until the push's deadline; the servers that replied are
never asked again. A reply thus means the server applied the update exactly once, and a
timed-out request that the server did apply is recognised when it is retried; a retry that
reaches a process restarted meanwhile is refused by its incarnation (above), and fails the
batch with ``on_server_restart: fail``, even when that process was restored from a
checkpoint and adopted since. The worker pins the update of a Kafka batch (one a restore
replays) to the processes its rows were looked up on and to their loads
(:meth:`ShardRouter.lookup`'s ``seen``, servers of this version): its gradients, applied
to a restored table (a restarted process's, or one a load replaced while the batch was in
flight), would count a batch the stream replays from the checkpoint's offsets twice.
With ``continue`` only the loads pin holds (another process takes every update there).
A batch of a direct stream, which nothing replays, is not pinned: it is applied as before. An update of a Kafka batch also carries the batch's
``source`` (topic, partition, offset and the worker stream sending it): the servers keep
per partition the highest offset applied and refuse another stream's replay
(:class:`~stream_persia.errors.StreamReplay`, final, not retried); :meth:`ShardRouter.
watermarks` reads them (:mod:`stream_persia.core.watermarks`).

Size: one module, since lookups, pushes and their retries all read and change the
per-server state one :class:`ShardRouter` keeps (incarnations, lost servers, the learned
configuration); the pure splitting and gathering live in :mod:`stream_persia.worker.shards`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from stream_persia.config.global_config import ON_SERVER_RESTART
from stream_persia.core import watermarks
from stream_persia.core.replies import LookupReply, ServerConfig, ServerHealth, WatermarksReply
from stream_persia.errors import (
    Backpressure,
    BadInput,
    InternalError,
    Misuse,
    PeerUnavailable,
    PersiaError,
    RemoteTimeout,
    ServerRestarted,
)
from stream_persia.rpc import RpcClient, auth
from stream_persia.worker import shards
from stream_persia.worker.shards import LookupGroup, PendingUpdate, UpdateGroup

__all__ = ["ON_SERVER_RESTART", "LostServer", "PendingUpdate", "ShardRouter", "Table"]

log = logging.getLogger(__name__)

#: Errors after which an update request is sent again: the server may be restarting, be
#: briefly unreachable or overloaded. A timed-out request may have been applied: its
#: token makes the retry harmless. Other errors (a refused request) are final.
RETRYABLE = (PeerUnavailable, RemoteTimeout, Backpressure)
_FIRST_RETRY_S, _MAX_RETRY_S = 0.05, 1.0
#: Sends of one request at most: a restart adopted (``continue``), a configure, the reply.
_ATTEMPTS = 4
_RESTORE_HINT = ("restore the newest checkpoint (TrainCtx.load_checkpoint, or POST "
                 "/v1/checkpoints/{id}/restore); embedding_worker_config.on_server_restart: "
                 "continue would train on without those rows")


class Table(NamedTuple):
    """The table a server's reply came from: its process (``incarnation``) and the
    number of loads that replaced its table in that process (None: a server that names
    none). An update is pinned to the tables its batch's rows were looked up in."""

    incarnation: str | None
    loads: int | None

    @classmethod
    def of(cls, reply: Any) -> Table:
        loads = reply.get("loads")
        return cls(reply.get("incarnation"),
                   loads if isinstance(loads, int) and not isinstance(loads, bool) else None)


class LostServer(NamedTuple):
    """A server found restarted with ``on_server_restart: fail``."""

    incarnation: str | None   # the restarted process's (None: the server names none)
    error: ServerRestarted


class ShardRouter:
    """Talks to every embedding server of a job.

    Args:
        addresses: ``host:port`` of server 0..S-1, in replica-index order.
        timeout_ms: per-call RPC timeout.
        secret: the job's role secret (see :class:`~stream_persia.rpc.RpcClient`).
        on_server_restart: ``fail`` or ``continue``: what a restarted server means (module
            docstring).
        on_restart: called with a server's index for each restart seen (both policies).
        on_lost: called whenever :attr:`lost` changed (a server lost, or restored).
    """

    def __init__(self, addresses: Sequence[str], *, timeout_ms: int = 10_000,
                 secret: auth.SecretSetting = auth.FROM_ENV, on_server_restart: str = "fail",
                 on_restart: Callable[[int], None] | None = None,
                 on_lost: Callable[[], None] | None = None):
        if not addresses:
            raise BadInput("at least one embedding server address is needed",
                           field="embedding_servers")
        if on_server_restart not in ON_SERVER_RESTART:
            raise BadInput(f"on_server_restart must be one of {ON_SERVER_RESTART}, got "
                           f"{on_server_restart!r}", field="on_server_restart")
        self.addresses = list(addresses)
        secret = auth.resolve(secret)   # read once for every client
        self.clients = [RpcClient(a, timeout_ms=timeout_ms, name=f"embedding-server-{i}",
                                  secret=secret)
                        for i, a in enumerate(self.addresses)]
        # The servers' configuration as last learned from them (see the module docstring).
        self.config: ServerConfig | None = None
        self._asked = False                # a learn() was answered (see _call)
        self._learning = asyncio.Lock()
        self.on_server_restart = on_server_restart
        n = len(self.addresses)
        # Per server: the incarnation served from (None: not reached yet), and the rows
        # it held in its last reply (None: unknown).
        self.incarnations: list[str | None] = [None] * n
        self.held: list[int | None] = [None] * n
        self.restarts = [0] * n            # restarts seen, per server
        self.lost: dict[int, LostServer] = {}
        self._on_restart = on_restart
        self._on_lost = on_lost

    async def learn(self, *, once: bool = False) -> ServerConfig | None:
        """Ask every server for its incarnation and configuration (``health``,
        ``get_config``); adopt the configuration most of them hold and configure the
        servers that hold none with it. Returns what the router knows afterwards (None: no
        server is configured). A server that does not answer is skipped (its own requests
        fail, or configure it again, later); when none answers, the first one's error is
        raised. A server found restarted is handled as ``on_server_restart`` says (module
        docstring): with ``fail`` the first such server's ServerRestarted is raised, after
        the others were configured.
        ``once``: only if no learn has been answered yet (before the first request)."""
        async with self._learning:
            if once and self._asked:
                return self.config
            replies = await asyncio.gather(*(self._ask(c) for c in self.clients),
                                           return_exceptions=True)
            failed = [r for r in replies if isinstance(r, BaseException)]
            if len(failed) == len(replies):
                raise failed[0]   # no server answers: say so (PeerUnavailable names it)
            self._asked = True
            answered = {s: r for s, r in enumerate(replies) if not isinstance(r, BaseException)}
            held = [c for _, c in answered.values() if c is not None and c.get("digest")]
            if held:
                digests = [c["digest"] for c in held]
                best = max(held, key=lambda c: digests.count(c["digest"]))
                if len(set(digests)) > 1:
                    log.warning("embedding servers hold different configurations %s; "
                                "following %s (the most common)", sorted(set(digests)),
                                best["digest"])
                self.config = best
            unknown = {s for s in answered if self.incarnations[s] is None}
            errors: list[ServerRestarted] = []
            for s, (health, _) in answered.items():
                try:
                    self._judge(s, health)
                except ServerRestarted as e:
                    errors.append(e)
            if self.config is not None:
                bare = [s for s, (_, c) in answered.items() if c is None and s not in self.lost]
                # Rows on the configured servers: the job trained after configuring them,
                # so a server this router meets only now that holds no configuration
                # restarted after that (before this worker started) and lost its rows.
                trained = sum(int(h.get("rows") or 0) for h, c in answered.values()
                              if c is not None)
                for s in [s for s in bare if s in unknown and trained]:
                    try:
                        self._restarted(s, None, answered[s][0], why=(
                            f"it holds no configuration while the other servers hold the "
                            f"job's ({self.config['digest']}) and {trained} rows: it "
                            f"restarted after the job configured it, before this worker "
                            f"reached it"))
                    except ServerRestarted as e:
                        errors.append(e)
                await asyncio.gather(*(self._configure(s) for s in bare if s not in self.lost))
            if errors:
                raise errors[0]
            return self.config

    async def _ask(self, client: RpcClient) -> tuple[ServerHealth, ServerConfig | None]:
        health, config = await asyncio.gather(client.call("health", None),
                                              client.call("get_config", None))
        return health, config

    async def _configure(self, s: int) -> None:
        """Give server ``s``, which holds no configuration, the one learned."""
        assert self.config is not None
        log.warning("embedding server %d (%s) holds no configuration (restarted?): "
                    "configuring it with %s", s, self.addresses[s], self.config["digest"])
        await self.clients[s].call("configure", self.config)   # a get_config reply

    async def _call(self, s: int, method: str, params: dict[str, Any],
                    timeout_ms: float | None = None, *, pinned: Table | None = None) -> Any:
        """``method`` (lookup or update) on server ``s``, expecting the incarnation and the
        configuration learned so far; its LookupReply or UpdateReply. A server that
        restarted is handled as ``on_server_restart`` says, one that lost its
        configuration is configured again. ``pinned``: the only table the request may
        reach (an update, to the process and load its rows came from); another process,
        even a restored one this router adopted, or another load fails it
        (:meth:`_stale`)."""
        if not self._asked:
            await self.learn(once=True)
        if pinned is not None and pinned.incarnation is None:
            pinned = None   # a server that names no process: nothing to pin to
        for _ in range(_ATTEMPTS):
            if s in self.lost:
                await self.check(s)   # raises its ServerRestarted unless restored since
            if self.config is not None:
                params["config"] = self.config["digest"]
            expect = self.incarnations[s]
            if pinned is not None and expect is not None and expect != pinned.incarnation:
                if self.on_server_restart != "continue":
                    raise self._stale(s, pinned)
                pinned = None   # continue: on with the process adopted, as before
                params.pop("loads", None)
            if pinned is not None:
                expect = pinned.incarnation
                if pinned.loads is not None:
                    params["loads"] = pinned.loads
            if expect is not None:
                params["incarnation"] = expect
            try:
                reply = await self.clients[s].call(method, params, timeout_ms)
            except ServerRestarted as e:
                await self.check(s)   # fail: raises; restored or continue: adopted
                if pinned is not None and (self.on_server_restart != "continue"
                                           or self.incarnations[s] == pinned.incarnation):
                    raise self._stale(s, pinned, e) from None
                continue
            except Misuse as e:
                if e.field != "config" or self.config is None:
                    raise
                await self._configure(s)
                continue
            got = reply.get("incarnation")
            if got != self.incarnations[s]:
                if self.incarnations[s] is None:
                    self.incarnations[s] = got          # the first reply of that server
                elif got is not None:
                    # Sent without one while another reply taught the router the old one:
                    # this reply comes from a new process.
                    await self.check(s)
            self.held[s] = reply.get("held")
            digest = reply.get("config")
            if digest is not None and (self.config is None or digest != self.config["digest"]):
                learned = await self.clients[s].call("get_config", None)
                if learned is not None and learned.get("digest") == digest:
                    self.config = learned
            return reply
        raise InternalError(f"embedding server {s} ({self.addresses[s]}) refused {method} "
                            f"{_ATTEMPTS} times over (restarted and unconfigured again?)")

    def _stale(self, s: int, pinned: Table,
               refused: ServerRestarted | None = None) -> ServerRestarted:
        """The error of an update pinned to ``pinned`` of server ``s``, whose table was
        replaced since: another process (restored from a checkpoint, adopted) serves it,
        or a load replaced it (``refused``: the server's refusal, field ``loads``)."""
        hint = "the batch fails; a job restored from a checkpoint trains from its offsets"
        if self.incarnations[s] == pinned.incarnation and refused is not None:
            return ServerRestarted(f"{self.addresses[s]}: {refused.message}", field="loads",
                                   hint=hint)
        return ServerRestarted(
            f"embedding server {s} ({self.addresses[s]}) is incarnation "
            f"{self.incarnations[s]}, restored from a checkpoint since this batch's rows were "
            f"looked up on incarnation {pinned.incarnation}: the batch's update is not "
            f"applied to the restored table (the stream replays the batch from the "
            f"checkpoint's offsets)", field="incarnation", hint=hint)

    # ----------------------------------------------------------------- restarts
    async def check(self, s: int, timeout_ms: float | None = None) -> None:
        """Find out whether server ``s`` is still the process this router knows (its
        ``health``) and act as the module docstring says: adopt a restored table, handle
        a restart as ``on_server_restart`` says.

        Raises:
            ServerRestarted: ``s`` is lost (``fail``), restarted without a restore.
            RemoteError: ``s`` did not answer.
        """
        self._judge(s, await self.clients[s].call("health", None, timeout_ms))

    async def verify(self) -> None:
        """:meth:`check` every server now (a checkpoint is about to be cut): a restart no
        request has met yet is found too. Servers that do not answer are skipped (the
        dump that follows fails on them); a restart is recorded, not raised."""
        replies = await asyncio.gather(*(c.call("health", None) for c in self.clients),
                                       return_exceptions=True)
        for s, health in enumerate(replies):
            if not isinstance(health, BaseException):
                with contextlib.suppress(ServerRestarted):
                    self._judge(s, health)

    async def recheck(self, timeout_ms: float | None = None) -> None:
        """:meth:`check` every lost server at once, so that those restored since are
        served again (the others stay lost, as do those that do not answer)."""
        await asyncio.gather(*(self.check(s, timeout_ms) for s in list(self.lost)),
                             return_exceptions=True)

    def _judge(self, s: int, health: ServerHealth) -> None:
        """Act on server ``s``'s ``health`` reply (see :meth:`check`)."""
        now = health.get("incarnation")
        known, lost = self.incarnations[s], self.lost.get(s)
        if now is None:   # a server that names no incarnation: nothing to compare
            return
        if lost is None and (known is None or now == known):
            self.incarnations[s] = now
            self.held[s] = health.get("rows")
            return
        if int(health.get("loads") or 0) > 0:
            # A load replaced its table since it started: a restore, on purpose.
            if lost is None:
                self.restarts[s] += 1
                if self._on_restart is not None:
                    self._on_restart(s)
            log.warning("embedding server %d (%s) restarted (incarnation %s, now %s) and was "
                        "restored from a checkpoint since: serving it again", s,
                        self.addresses[s], known, now)
            self.incarnations[s] = now
            self.held[s] = health.get("rows")
            if self.lost.pop(s, None) is not None and self._on_lost is not None:
                self._on_lost()
            return
        if lost is not None and lost.incarnation == now:
            raise ServerRestarted(lost.error.message, field=lost.error.field,
                                  hint=lost.error.hint)
        self._restarted(s, known, health)

    def _restarted(self, s: int, known: str | None, health: ServerHealth,
                   why: str | None = None) -> None:
        """Server ``s`` restarted (``health`` is the new process's, ``known`` the
        incarnation before, None: unknown): count it, then go on or mark it lost."""
        now = health.get("incarnation")
        held = self.held[s]
        rows = (f"the {held} rows it held when last seen" if held is not None
                else "every row it held")
        error = ServerRestarted(
            f"embedding server {s} ({self.addresses[s]}) restarted: "
            + (why or f"it is incarnation {now}, not {known}")
            + f"; {rows}, their optimizer state and what every batch trained so far added to "
              f"them are lost (it holds {health.get('rows')} rows now)",
            field="incarnation", hint=_RESTORE_HINT)
        self.restarts[s] += 1
        if self._on_restart is not None:
            self._on_restart(s)
        if self.on_server_restart == "continue":
            log.error("%s; training goes on without them (embedding_worker_config."
                      "on_server_restart: continue)", error.message)
            self.incarnations[s] = now
            self.held[s] = health.get("rows")
            return
        log.error("%s; every lookup and update that needs it fails until a checkpoint is "
                  "restored", error.message)
        self.lost[s] = LostServer(now, error)
        if self._on_lost is not None:
            self._on_lost()
        raise error

    def mark_lost(self, error: ServerRestarted) -> None:
        """Every server is lost with ``error`` (its configuration gone from all of them,
        seen from the NN side's request: :mod:`stream_persia.worker.service`), each at
        the incarnation this router knows now."""
        for s in range(self.num_shards):
            if s not in self.lost:
                self.restarts[s] += 1
                if self._on_restart is not None:
                    self._on_restart(s)
                self.lost[s] = LostServer(self.incarnations[s], error)
        if self._on_lost is not None:
            self._on_lost()

    @property
    def num_shards(self) -> int:
        return len(self.clients)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def watermarks(self, topic: str, timeout_ms: float | None = None
                         ) -> dict[int, watermarks.PartitionMark]:
        """Per partition of ``topic``, the highest stream watermark over every server
        (:func:`stream_persia.core.watermarks.merge`): how far they applied it. Every server
        must answer (one that does not may hold the highest): its error is raised."""
        replies: list[WatermarksReply] = await asyncio.gather(*(
            c.call("watermarks", {"topic": topic}, timeout_ms) for c in self.clients))
        return watermarks.merge(replies, topic)

    async def broadcast(self, method: str, params: Any = None) -> list[Any]:
        """Call ``method`` on every server; results in replica-index order."""
        return list(await asyncio.gather(*(c.call(method, params) for c in self.clients)))

    async def lookup(self, groups: Sequence[LookupGroup], mode: str, *,
                     seen: dict[int, Table] | None = None
                     ) -> tuple[list[np.ndarray], int]:
        """Look up ``groups`` on the servers owning their ids; returns one float32 array per
        group and the missing count: a :class:`~stream_persia.worker.shards.RowLookup`'s
        rows, or a :class:`~stream_persia.worker.shards.PooledLookup`'s segment sums (every
        server pools the rows it owns; this adds them up in server order). With one
        server the arrays are read-only views of its reply.

        ``seen``, if given, gets the :class:`Table` of each server that answered: the
        process and the load the rows came from, to which the batch's update is pinned
        (:meth:`split_update`).
        """
        if self.num_shards == 1:  # nothing to split or scatter back
            reply: LookupReply = await self._call(
                0, "lookup", {"mode": mode, "groups": [g.to_wire() for g in groups]})
            if seen is not None:
                seen[0] = Table.of(reply)
            return list(reply["rows"]), int(reply["missing"])
        plan = shards.plan_lookup(groups, self.num_shards)
        servers = list(plan.requests)
        replies: list[LookupReply] = await asyncio.gather(*(
            self._call(s, "lookup", {"mode": mode, "groups": plan.requests[s]})
            for s in servers))
        if seen is not None:
            seen.update((s, Table.of(r)) for s, r in zip(servers, replies, strict=True))
        out = shards.gather_lookup(groups, plan, {s: r["rows"]
                                                  for s, r in zip(servers, replies, strict=True)})
        return out, sum(int(r["missing"]) for r in replies)

    def split_update(self, groups: Sequence[UpdateGroup], token: str | None = None,
                     source: dict[str, Any] | None = None,
                     event_time: float | None = None,
                     tables: dict[int, Table] | None = None) -> PendingUpdate:
        """``groups`` split into one request per owning server (one stable argsort per
        group; no per-id Python work; no request at all without groups). ``source``: the
        Kafka batch the update is for (``update``'s ``source``: the servers advance, and
        check, that partition's stream watermark; :mod:`stream_persia.core.watermarks`).
        ``event_time``: the batch's event time, sent with every request (``update``'s
        ``event_time``: the servers' ``trained_through``). ``tables``: the tables the
        batch's rows were looked up in (:meth:`lookup`'s ``seen``): the update is applied
        to those or to none: a table a load replaced since refuses it, and so does another
        process, restored from a checkpoint and adopted since (with ``on_server_restart:
        continue`` another process takes it, as it takes every update: :meth:`push`)."""
        return PendingUpdate(token, shards.split_update(groups, self.num_shards), source,
                             event_time=event_time, tables=dict(tables or {}))

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
                           else min(limit_ms, self.clients[s].timeout_ms),
                           pinned=update.tables.get(s))
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
    def _update_params(update: PendingUpdate, s: int) -> dict[str, Any]:
        params: dict[str, Any] = {"groups": update.parts[s]}
        if update.token is not None:
            params["token"] = update.token
        if update.source is not None:
            params["source"] = update.source
        if update.event_time is not None:
            params["event_time"] = update.event_time
        return params

    async def update(self, groups: Sequence[UpdateGroup], token: str | None = None,
                     retry_s: float = 0.0) -> tuple[int, int]:
        """Send ``groups`` to the owning servers; returns (applied, dropped).
        See :meth:`push` for ``token`` and ``retry_s``."""
        return await self.push(self.split_update(groups, token), retry_s)
