"""Zero-config single host: the roles' well-known local ports, and finding peers there.

PERSIA's roles met through NATS, so its Procfile gives no addresses. Ours meet at fixed
ports instead: an embedding server or worker started with no ``--port`` listens on
127.0.0.1 at the port its role and replica index give, and a role given no peer
addresses (an embedding worker no ``--embedding-servers`` / ``PERSIA_EMBEDDING_SERVERS``;
a data loader's ``DataCtx`` and an NN worker's ``TrainCtx`` no ``PERSIA_EMBEDDING_WORKERS``
and, for the data loader, no Kafka either) looks for them at theirs::

    role                 replica i listens on          base B: PERSIA_BASE_PORT
    embedding server     127.0.0.1:B + i               (--base-port; default 10000)
    embedding worker     127.0.0.1:B + 100 + i         i < 100 in either role

With the default base the servers sit where PERSIA's own Procfile example puts them
(``--port 10000``, ``10001``, ...). A port that is taken fails the role at once, naming
the port and what moves it; nothing falls back to a random port, which its peers would
not find. The API (``api.port``, 8080) and the NN worker's rendezvous (a free port on one
node) are found by nobody and stay as they were; metrics stay off unless asked for.

**How many peers.** The number of replicas is not guessed from the caller's own flags:
replica 0 of the peer role is asked (its ``health`` reply names its ``replica_size``),
then every replica 0..size-1 is awaited and must answer as the replica the plan puts at
its port (role, index and size), so a mismatched ``--replica-size`` is an error, not a
job that silently leaves a shard out. A role whose peers are not up yet waits for them,
logging every :data:`PROGRESS_EVERY_S` seconds, up to its start-up bound (the embedding
worker's ``--peer-timeout-s``, ``DataCtx``'s ``startup_timeout_ms``, ``TrainCtx``'s
ready timeout); then it fails with :class:`~stream_persia.errors.PeerUnavailable` naming
the address it waited for and how to give addresses instead.

**Security.** The well-known ports are on loopback only. Without a role secret
(``PERSIA_ROLE_SECRET`` / ``PERSIA_ROLE_SECRET_FILE``) they are unauthenticated: every
user of this machine can reach them (:mod:`stream_persia.rpc.auth`). Give every role the
same secret on a shared machine; discovery presents it like any other client.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any, Final

from stream_persia.errors import ConfigError, PeerUnavailable

__all__ = ["DEFAULT_BASE_PORT", "LOCAL_HOST", "MAX_BASE_PORT", "MAX_REPLICAS", "MIN_BASE_PORT",
           "BASE_PORT_ENV", "PROGRESS_EVERY_S", "ROLE_OFFSETS", "check_port_free",
           "find_local", "base_port", "well_known_address", "well_known_port"]

log = logging.getLogger(__name__)

BASE_PORT_ENV: Final = "PERSIA_BASE_PORT"
DEFAULT_BASE_PORT: Final = 10000
#: replicas of one role the plan has room for
MAX_REPLICAS: Final = 100
#: each role's first port, from the base
ROLE_OFFSETS: Final = {"embedding-server": 0, "embedding-worker": MAX_REPLICAS}
MIN_BASE_PORT: Final = 1024
MAX_BASE_PORT: Final = 65535 - len(ROLE_OFFSETS) * MAX_REPLICAS + 1
LOCAL_HOST: Final = "127.0.0.1"
PROGRESS_EVERY_S: Final = 10.0
#: the first "waiting for" line comes this soon: a role started first says what it awaits
FIRST_PROGRESS_S: Final = 0.5
_NAMES: Final = {"embedding-server": "embedding server", "embedding-worker": "embedding worker"}
_ADDRESSES_ENV: Final = {"embedding-server": "PERSIA_EMBEDDING_SERVERS",
                         "embedding-worker": "PERSIA_EMBEDDING_WORKERS"}


def base_port(environ: Mapping[str, str] | None = None) -> int:
    """``PERSIA_BASE_PORT`` (default :data:`DEFAULT_BASE_PORT`).

    Raises:
        ConfigError: not an integer in [:data:`MIN_BASE_PORT`, :data:`MAX_BASE_PORT`].
    """
    env = os.environ if environ is None else environ
    raw = (env.get(BASE_PORT_ENV) or "").strip()
    if not raw:
        return DEFAULT_BASE_PORT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not MIN_BASE_PORT <= value <= MAX_BASE_PORT:
        raise ConfigError(f"{BASE_PORT_ENV}={raw!r} is not an integer in [{MIN_BASE_PORT}, "
                          f"{MAX_BASE_PORT}]", field=BASE_PORT_ENV,
                          hint="the first of the job's well-known local ports; unset: "
                               f"{DEFAULT_BASE_PORT}")
    return value


def _check_role(role: str) -> None:
    if role not in ROLE_OFFSETS:
        raise ConfigError(f"no well-known port for role {role!r}", field="role",
                          hint=f"one of {sorted(ROLE_OFFSETS)}")


def well_known_port(role: str, replica_index: int, base: int) -> int:
    """The port replica ``replica_index`` of ``role`` listens on with no ``--port``.

    Raises:
        ConfigError: an unknown role, or an index beyond :data:`MAX_REPLICAS`.
    """
    _check_role(role)
    if not 0 <= replica_index < MAX_REPLICAS:
        raise ConfigError(f"{_NAMES[role]} {replica_index}: the well-known local ports have "
                          f"room for replicas 0..{MAX_REPLICAS - 1}", field="--port",
                          hint="pass --port for each replica, and the addresses to its "
                               f"peers ({_ADDRESSES_ENV[role]})")
    return base + ROLE_OFFSETS[role] + replica_index


def well_known_address(role: str, replica_index: int, base: int) -> str:
    return f"{LOCAL_HOST}:{well_known_port(role, replica_index, base)}"


def check_port_free(host: str, port: int, what: str) -> None:
    """Fail now, by name, when ``host:port`` (a well-known port) cannot be listened on.

    Binds and closes a socket the way asyncio's server will (``SO_REUSEADDR``: a port in
    TIME_WAIT is free, one another process listens on is not); a role that waits for its
    peers before it listens checks its own port first.

    Raises:
        ConfigError: naming the port, ``--port`` and ``PERSIA_BASE_PORT``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise taken(host, port, what, e) from None


def taken(host: str, port: int, what: str, error: OSError) -> ConfigError:
    """The error of a well-known port that cannot be listened on."""
    why = "is taken" if error.errno == errno.EADDRINUSE else "cannot be listened on"
    return ConfigError(
        f"{what}: well-known port {port} on {host} {why} ({error.strerror or error})",
        field="--port",
        hint=f"stop what listens there (another job on this machine?), or move every role "
             f"of this job to other well-known ports with {BASE_PORT_ENV} (or --base-port; "
             f"the same for every role), or pass --port (0: any free port) and give the "
             f"peers this role's address")


async def _wait(client: Any, what: str, env: str, deadline: float, timeout_s: float
                ) -> dict[str, Any]:
    """``health`` of ``client`` once it answers, logging while it does not."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    step = FIRST_PROGRESS_S
    while True:
        left = deadline - loop.time()
        try:
            await client.wait_ready(max(0.05, min(step, left)))
            reply = await client.call("health", None, timeout_ms=max(1000.0, left * 1000))
            return dict(reply) if isinstance(reply, Mapping) else {}
        except PeerUnavailable as e:
            if loop.time() >= deadline:
                raise PeerUnavailable(
                    f"no {what} answered at {client.address} within {timeout_s:g} s (no "
                    f"addresses given, so it was looked for at its well-known local "
                    f"port): {e.message}", field="addresses",
                    hint=f"start it (with the same {BASE_PORT_ENV}), or give the "
                         f"addresses ({env})") from None
            log.info("waiting for %s at %s (well-known local port; %.0f s of %g s)", what,
                     client.address, loop.time() - start, timeout_s)
            step = PROGRESS_EVERY_S


async def find_local(role: str, *, timeout_s: float, base: int | None = None,
                     **client_kwargs: Any) -> list[str]:
    """The addresses of every replica of ``role`` on this host's well-known ports.

    Args:
        role: ``embedding-server`` or ``embedding-worker``.
        timeout_s: how long to wait for all of them together.
        base: the port base (default: ``PERSIA_BASE_PORT``).
        client_kwargs: passed to each :class:`~stream_persia.rpc.RpcClient` (``secret``).

    Raises:
        PeerUnavailable: a replica did not answer in time (naming its address).
        ConfigError: a port answered as another role or replica than the plan puts there.
    """
    from stream_persia.rpc.client import RpcClient

    _check_role(role)
    base = base_port() if base is None else base
    name, env = _NAMES[role], _ADDRESSES_ENV[role]
    deadline = asyncio.get_running_loop().time() + timeout_s
    addresses: list[str] = []
    size = 1
    i = 0
    while i < size:
        address = well_known_address(role, i, base)
        async with RpcClient(address, name=f"{name} {i}", timeout_ms=max(1000, timeout_s * 1000),
                             **client_kwargs) as client:
            health = await _wait(client, f"{name} {i}", env, deadline, timeout_s)
        got = (health.get("role"), health.get("replica_index"), health.get("replica_size"))
        if i == 0 and isinstance(got[2], int) and not isinstance(got[2], bool) \
                and 1 <= got[2] <= MAX_REPLICAS:
            size = got[2]
        if got != (role, i, size):
            raise ConfigError(
                f"{address} answers as {got[0]} {got[1]} of {got[2]}, where the well-known "
                f"local ports put {name} {i} of {size}", field=env,
                hint=f"start replica i of {size} with --replica-index i --replica-size "
                     f"{size} and no --port, or give the addresses ({env})")
        addresses.append(address)
        i += 1
    log.info("found %d %s(s) on well-known local ports: %s", size, name, ",".join(addresses))
    return addresses
