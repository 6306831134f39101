"""RPC clients of the roles the API talks to, owned by the app's lifespan.

One :class:`~stream_persia.rpc.RpcClient` per embedding worker and per embedding server
(concurrent calls are pipelined on its one connection). Every error raised through
:meth:`Roles.call` carries ``peer`` (e.g. ``embedding-server-1 10.0.0.5:7001``) so the
HTTP error body can name the role that failed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from stream_persia.errors import Misuse, PersiaError, RemoteError
from stream_persia.rpc import RpcClient

__all__ = ["Role", "Roles", "WORKER", "SERVER"]

WORKER = "embedding-worker"
SERVER = "embedding-server"
HEALTH_TIMEOUT_MS = 2000


@dataclass(eq=False)
class Role:
    """One role instance: its kind, replica index, address and client."""

    kind: str
    index: int
    address: str
    client: RpcClient

    @property
    def peer(self) -> str:
        return f"{self.kind}-{self.index} {self.address}"


class Roles:
    """The job's embedding workers and servers, as the API sees them.

    Args:
        workers, servers: ``host:port`` addresses in replica order.
        timeout_ms: default deadline of one call.
    """

    def __init__(self, workers: tuple[str, ...] | list[str], servers: tuple[str, ...] | list[str],
                 *, timeout_ms: int = 10_000):
        self.timeout_ms = timeout_ms
        self.workers = [Role(WORKER, i, a, RpcClient(a, timeout_ms=timeout_ms,
                                                     name=f"{WORKER}-{i}"))
                        for i, a in enumerate(workers)]
        self.servers = [Role(SERVER, i, a, RpcClient(a, timeout_ms=timeout_ms,
                                                     name=f"{SERVER}-{i}"))
                        for i, a in enumerate(servers)]

    @property
    def all(self) -> list[Role]:
        return [*self.workers, *self.servers]

    async def close(self) -> None:
        await asyncio.gather(*(r.client.close() for r in self.all), return_exceptions=True)

    def require(self, kind: str) -> list[Role]:
        """The roles of ``kind``; Misuse (409) when the API was started without any."""
        roles = self.workers if kind == WORKER else self.servers
        if not roles:
            env = "PERSIA_EMBEDDING_WORKERS" if kind == WORKER else "PERSIA_EMBEDDING_SERVERS"
            raise Misuse(f"this API was started without any {kind} addresses",
                         field=env, hint=f"set {env} (comma-separated host:port) and restart")
        return roles

    @staticmethod
    async def call(role: Role, method: str, params: Any = None,
                   timeout_ms: float | None = None) -> Any:
        """Call ``method`` on ``role``; errors get ``peer`` set to the role."""
        try:
            return await role.client.call(method, params, timeout_ms=timeout_ms)
        except PersiaError as err:
            err.peer = role.peer  # type: ignore[attr-defined]
            raise

    async def fanout(self, roles: list[Role], method: str, params: Any = None, *,
                     timeout_ms: float | None = None) -> list[Any]:
        """Call ``method`` on every role concurrently; the first error is raised."""
        return list(await asyncio.gather(*(self.call(r, method, params, timeout_ms)
                                           for r in roles)))

    async def change_all(self, roles: list[Role], method: str, params: Any = None) -> list[Any]:
        """Make a change (``method``: configure, clear, pause or resume ingest) on every
        role in ``roles``, and never leave it made on some of them without saying so.

        Every role must answer ``health`` first, so that one that is down or unreachable
        refuses the request before any role has changed (its error, 503). Past that, a role
        that fails the change itself (a timeout, a refusal) is raised with its class and
        status, its message saying which roles did take the change and which did not (the
        change is idempotent: sending it again once they answer makes them agree).

        Returns:
            Every role's reply, in order.
        """
        # The change's own timeout: a worker busy serving pipelined predictions may take
        # longer than HEALTH_TIMEOUT_MS to answer, and would refuse a change that works.
        await self.fanout(roles, "health", timeout_ms=self.timeout_ms)
        out = await self.gather_settled(roles, method, params)
        failed = [(r, e) for r, e in zip(roles, out, strict=True) if isinstance(e, PersiaError)]
        if not failed:
            return out
        done = [r.peer for r, e in zip(roles, out, strict=True) if not isinstance(e, PersiaError)]
        first = failed[0][1]
        if not done:
            raise first
        message = (f"{method} was applied on {', '.join(done)} but not on "
                   f"{', '.join(r.peer for r, _ in failed)} ({first.message}): they differ now")
        hint = f"send the same request again once every {roles[0].kind} answers"
        try:
            err = type(first)(message, field=first.field, hint=hint)
        except TypeError:   # an error class with its own constructor: its family's 502
            err = RemoteError(message, field=first.field, hint=hint)
        err.peer = getattr(first, "peer", None)  # type: ignore[attr-defined]
        raise err

    async def gather_settled(self, roles: list[Role], method: str, params: Any = None, *,
                             timeout_ms: float | None = None) -> list[Any | PersiaError]:
        """Like :meth:`fanout`, but each role's error is returned in its place."""
        out = await asyncio.gather(*(self.call(r, method, params, timeout_ms) for r in roles),
                                   return_exceptions=True)
        for item in out:
            if isinstance(item, BaseException) and not isinstance(item, PersiaError):
                raise item
        return list(out)

    async def health(self, replies: dict[tuple[str, int], Any] | None = None
                     ) -> list[dict[str, Any]]:
        """Probe every role's ``health`` (short deadline); never raises for a role's failure.

        Args:
            replies: if given, filled with each answering role's ``health`` reply, by
                ``(kind, index)`` (``GET /v1/status`` reads the servers'
                ``trained_through`` there instead of asking them again).
        """
        async def probe(role: Role) -> dict[str, Any]:
            t0 = time.perf_counter()
            entry: dict[str, Any] = {"role": role.kind, "index": role.index,
                                     "address": role.address}
            try:
                reply = await self.call(role, "health", None, HEALTH_TIMEOUT_MS)
                if replies is not None:
                    replies[(role.kind, role.index)] = reply
                entry["healthy"] = bool(isinstance(reply, dict) and reply.get("ok"))
                why = reply.get("error") if isinstance(reply, dict) else None   # its reason
                entry["error"] = None if entry["healthy"] else (
                    str(why) if why else f"unexpected reply {reply!r}")
            except PersiaError as err:
                entry["healthy"] = False
                entry["error"] = err.message
            entry["latency_ms"] = round((time.perf_counter() - t0) * 1000, 3)
            return entry

        return list(await asyncio.gather(*(probe(r) for r in self.all)))
