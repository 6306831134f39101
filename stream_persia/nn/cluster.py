"""The NN worker's connections to the rest of the job, and the loop they run on.

NN workers find embedding workers from ``embedding_workers=[...]`` or the environment
(``PERSIA_EMBEDDING_WORKERS``, comma-separated ``host:port``), else (zero-config, one host)
at their well-known local ports (:mod:`stream_persia.rpc.local_ports`), and the embedding
servers from a worker's ``servers`` RPC. Every call runs on one :class:`~stream_persia.core.aio.
LoopThread` owned by the context, so the synchronous training loop never blocks on the
network except where it must wait for a result.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from stream_persia.core.aio import LoopThread
from stream_persia.errors import ConfigError, PeerUnavailable
from stream_persia.rpc import RpcClient, local_ports

__all__ = ["Cluster", "worker_addresses_from_env"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def worker_addresses_from_env() -> list[str]:
    """``PERSIA_EMBEDDING_WORKERS`` as a list of ``host:port``."""
    raw = os.environ.get("PERSIA_EMBEDDING_WORKERS", "")
    return [a.strip() for a in raw.split(",") if a.strip()]


class Cluster:
    """Clients for every embedding worker and embedding server, on one loop thread.

    Args:
        worker_addresses: embedding workers (default: env ``PERSIA_EMBEDDING_WORKERS``,
            else their well-known local ports, found by :meth:`start`).
        rpc_timeout_ms: default timeout of one call.
        ready_timeout_s: how long :meth:`start` waits for every role to answer.
        name: loop thread name.

    Raises:
        ConfigError: a bad ``PERSIA_BASE_PORT`` (with no worker address given).
    """

    def __init__(self, worker_addresses: list[str] | None = None, *,
                 rpc_timeout_ms: float = 30_000, ready_timeout_s: float = 300.0,
                 name: str = "nn-worker-rpc"):
        addresses = list(worker_addresses) if worker_addresses else worker_addresses_from_env()
        # None given: the workers' well-known local ports (the base is checked now).
        self._base_port = local_ports.base_port() if not addresses else None
        self.worker_addresses = addresses
        self.server_addresses: list[str] = []
        self.rpc_timeout_ms = rpc_timeout_ms
        self.ready_timeout_s = ready_timeout_s
        self.loop = LoopThread(name=name)
        self.workers: list[RpcClient] = []
        self.servers: list[RpcClient] = []
        # The servers' configuration ({"digest", "optimizer", "embedding_config"}) as this
        # NN worker set it or learned it; None while the job has not configured them.
        # Fetches name its digest so that an embedding worker whose servers all lost it
        # says so, and :meth:`restore_server_config` puts it back.
        self.server_config: dict | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for its result."""
        return self.loop.run(coro, timeout)

    def start(self, *, need_servers: bool = True) -> None:
        """Connect to every worker (and server), waiting until each answers ``health``.

        Raises:
            PeerUnavailable: a role did not answer within ``ready_timeout_s`` (names it).
        """
        self.run(self._start(need_servers))

    async def _start(self, need_servers: bool) -> None:
        if self._base_port is not None and not self.worker_addresses:
            self.worker_addresses = await local_ports.find_local(
                "embedding-worker", timeout_s=self.ready_timeout_s, base=self._base_port)
        self.workers = [RpcClient(a, timeout_ms=self.rpc_timeout_ms,
                                  name=f"embedding worker {i}")
                        for i, a in enumerate(self.worker_addresses)]
        await self.wait_workers_ready()
        if not need_servers:
            return
        lists = await asyncio.gather(*(w.call("servers") for w in self.workers))
        servers = list(lists[0])
        for i, other in enumerate(lists[1:], start=1):
            if list(other) != servers:
                raise ConfigError(
                    f"embedding workers disagree on the embedding servers: worker 0 uses "
                    f"{servers}, worker {i} uses {list(other)}", field="embedding_servers",
                    hint="start every embedding worker with the same --embedding-servers")
        self.server_addresses = servers
        self.servers = [RpcClient(a, timeout_ms=self.rpc_timeout_ms,
                                  name=f"embedding server {i}") for i, a in enumerate(servers)]
        await self.wait_servers_ready()

    async def wait_workers_ready(self) -> None:
        """Wait until every embedding worker answers ``health`` (``ready_timeout_s``)."""
        await self._wait_ready(self.workers, "embedding workers")

    async def wait_servers_ready(self) -> None:
        """Wait until every embedding server answers ``health`` (``ready_timeout_s``)."""
        await self._wait_ready(self.servers, "embedding servers")

    async def _wait_ready(self, clients: list[RpcClient], what: str) -> None:
        results = await asyncio.gather(
            *(c.wait_ready(self.ready_timeout_s, probe="health") for c in clients),
            return_exceptions=True)
        failed = [(c, r) for c, r in zip(clients, results, strict=True)
                  if isinstance(r, BaseException)]
        if failed:
            first = failed[0][1]
            names = ", ".join(c.peer for c, _ in failed)
            raise PeerUnavailable(f"{len(failed)} of {len(clients)} {what} not ready within "
                                  f"{self.ready_timeout_s:g} s ({names}): {first}",
                                  hint="is every role of the job running, and are the "
                                       "addresses right?") from first

    async def call_servers(self, method: str, params: Any = None,
                           timeout_ms: float | None = None) -> list[Any]:
        """Call ``method`` on every embedding server; results in server order."""
        return list(await asyncio.gather(*(s.call(method, params, timeout_ms)
                                           for s in self.servers)))

    async def configure_servers(self, params: dict) -> None:
        """``configure`` every embedding server, then learn the configuration they hold."""
        await self.call_servers("configure", params)
        await self.learn_server_config()

    async def learn_server_config(self) -> dict | None:
        """The configuration embedding server 0 holds (``get_config``), kept as
        :attr:`server_config` when it has one."""
        if self.servers:
            learned = await self.servers[0].call("get_config", None)
            if learned is not None:
                self.server_config = learned
        return self.server_config

    async def restore_server_config(self) -> None:
        """Configure every embedding server with :attr:`server_config` again (they
        restarted and lost it, and the embedding workers go on: ``on_server_restart:
        continue``; see :mod:`stream_persia.worker.router`)."""
        cfg = self.server_config
        if cfg is None:
            return
        log.warning("the embedding servers lost their configuration (restarted?): "
                    "configuring them again with %s", cfg["digest"])
        await self.call_servers("configure", cfg)   # a get_config reply, as it came

    async def call_workers(self, method: str, params: Any = None,
                           timeout_ms: float | None = None) -> list[Any]:
        """Call ``method`` on every embedding worker; results in worker order."""
        return list(await asyncio.gather(*(w.call(method, params, timeout_ms)
                                           for w in self.workers)))

    async def _close(self) -> None:
        for c in [*self.workers, *self.servers]:
            await c.close()

    def close(self) -> None:
        """Close every client and stop the loop thread. Idempotent."""
        try:
            self.loop.run(self._close(), timeout=30)
        except Exception as e:  # the loop may already be gone; closing must not raise
            log.debug("closing RPC clients: %r", e)
        finally:
            self.loop.close()
