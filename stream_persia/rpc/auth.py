"""The job secret and the RPC connection handshake: pure logic, no sockets.

Every role's RPC port (and its same-host Unix socket, :mod:`stream_persia.rpc.unix`) is
closed to anyone who does not hold the job's **role secret**, a shared string given to
every process of the job as ``PERSIA_ROLE_SECRET`` (inline) or ``PERSIA_ROLE_SECRET_FILE``
(a mounted secret file), the way the API's bearer token is given. A server without a
secret binds loopback only (:meth:`stream_persia.rpc.RpcServer.start` refuses any other
address).

Handshake (once per connection, before the first request; nothing per request after it).
Both sides prove they hold the secret without sending it: each proof is an HMAC-SHA256,
keyed by the secret, over a context string, a label and both sides' fresh random nonces,
so a proof is useless on another connection and an eavesdropper learns nothing it can
replay. The frames are ordinary RPC frames (:mod:`stream_persia.rpc`)::

    client -> server  {"auth": "hello", "v": 1, "nonce": cn}           cn: 32 random bytes
    server -> client  {"auth": "challenge", "nonce": sn,
                       "proof": HMAC(secret, CONTEXT | "server" | cn | sn)}
    client -> server  {"auth": "proof", "proof": HMAC(secret, CONTEXT | "client" | cn | sn)}
                    | {"auth": "mismatch"}              the server's proof was wrong: the
                                                        client closes (the server counts it)
    server -> client  {"auth": "ok"}
                    | {"id": None, "e": AuthError}                      then the server closes

The client checks the server's proof too (mutual authentication): a client holding the
secret never sends a request to a server that does not hold it. A mismatch either way,
a client without a secret talking to a server with one (its first frame is a request, not
a hello) and a client with one talking to a server without (a hello it does not expect)
all end in an :class:`~stream_persia.errors.AuthError` naming ``PERSIA_ROLE_SECRET`` on
both sides, never a hang or a bare reset. This authenticates peers; it does not encrypt
the traffic (run the job on a private network, or under a mesh that adds TLS).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from stream_persia.config.files import read_secret_file
from stream_persia.core.hosts import is_loopback
from stream_persia.core.secret_rule import MIN_SECRET_CHARS, check_secret
from stream_persia.core.wire import WireLimits
from stream_persia.errors import AuthError, ConfigError, WireError

__all__ = ["CONTEXT", "FROM_ENV", "FromEnv", "HANDSHAKE_LIMITS", "MIN_SECRET_CHARS",
           "NONCE_BYTES", "RoleSecret", "SAME_SECRET_HINT", "SECRET_ENV", "SECRET_FILE_ENV",
           "SETTING",
           "SecretSetting", "challenge", "check_bind", "check_challenge", "check_hello", "check_proof",
           "check_welcome", "client_proof", "hello", "is_hello", "mismatch", "new_nonce", "proof",
           "resolve", "welcome"]

SECRET_ENV: Final = "PERSIA_ROLE_SECRET"
SECRET_FILE_ENV: Final = "PERSIA_ROLE_SECRET_FILE"
#: what a refusal names as the setting to fix
SETTING: Final = f"{SECRET_ENV} / {SECRET_FILE_ENV}"
#: the hint of every refusal for a missing or different secret
SAME_SECRET_HINT: Final = (f"give every process of the job the same {SECRET_ENV} or "
                           f"{SECRET_FILE_ENV}")
NONCE_BYTES: Final = 32
VERSION: Final = 1
CONTEXT: Final = b"stream-persia rpc auth v1"
#: limits on frames received before a peer is authenticated: a stranger cannot make the
#: server allocate more than this (a request frame may otherwise announce 256 MiB)
HANDSHAKE_LIMITS: Final = WireLimits(max_frame_bytes=1024, max_body_bytes=1024,
                                     max_array_bytes=1, max_depth=2, max_container_len=8,
                                     max_objects=32)


@dataclass(frozen=True)
class RoleSecret:
    """The job's shared role secret (never shown in ``repr``).

    Args:
        value: the secret, at least :data:`MIN_SECRET_CHARS` characters.
        source: where it came from, for messages (e.g. ``PERSIA_ROLE_SECRET_FILE``).

    Raises:
        ConfigError: too short (naming ``source``).
    """

    value: str = field(repr=False)
    source: str = SECRET_ENV

    def __post_init__(self) -> None:
        check_secret(self.value, self.source, "the role secret")

    @property
    def key(self) -> bytes:
        return self.value.strip().encode("utf-8")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RoleSecret | None:
        """The secret from ``PERSIA_ROLE_SECRET`` or the file named by
        ``PERSIA_ROLE_SECRET_FILE`` (None when neither is set).

        Raises:
            ConfigError: both are set, the file cannot be read or is empty, or the secret
                is too short.
        """
        env = os.environ if environ is None else environ
        inline, path = env.get(SECRET_ENV) or None, env.get(SECRET_FILE_ENV) or None
        if inline is not None and path is not None:
            raise ConfigError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set",
                              field=SECRET_ENV, hint="keep one of them")
        if inline is not None:
            return cls(inline, SECRET_ENV)
        if path is None:
            return None
        value = read_secret_file(path, SECRET_FILE_ENV,
                                 "write the job's role secret into the file")
        return cls(value, SECRET_FILE_ENV)


class FromEnv:
    """Type of :data:`FROM_ENV`."""

    def __repr__(self) -> str:
        return "FROM_ENV"


#: default ``secret`` of clients and servers: :meth:`RoleSecret.from_env` of this process
#: when the client or server is built (pass None for none, or a RoleSecret)
FROM_ENV: Final = FromEnv()
SecretSetting = RoleSecret | FromEnv | None


def check_bind(host: str, secret: RoleSecret | None, what: str) -> None:
    """Refuse to serve RPC on a non-loopback ``host`` without a role secret.

    Raises:
        ConfigError: naming the secret's settings.
    """
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"{what} would listen on {host} without a role secret: anyone who reaches the "
            "port could clear, reconfigure or dump the job", field=SETTING,
            hint=f"set {SECRET_ENV} or {SECRET_FILE_ENV} (the same secret in every process "
                 "of the job), or listen on 127.0.0.1")


def resolve(secret: SecretSetting) -> RoleSecret | None:
    """The secret a ``secret`` argument stands for (:data:`FROM_ENV` read now)."""
    if isinstance(secret, FromEnv):
        return RoleSecret.from_env()
    if secret is not None and not isinstance(secret, RoleSecret):
        raise ConfigError(f"secret must be a RoleSecret, FROM_ENV or None, got "
                          f"{type(secret).__name__}", field="secret")
    return secret


# ----------------------------------------------------------------------------- frames

def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: RoleSecret, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 over the context, ``label`` (b"server" / b"client") and both nonces."""
    msg = b"\0".join((CONTEXT, label, client_nonce, server_nonce))
    return hmac.new(secret.key, msg, hashlib.sha256).digest()


def hello(client_nonce: bytes) -> dict[str, Any]:
    return {"auth": "hello", "v": VERSION, "nonce": client_nonce}


def challenge(secret: RoleSecret, client_nonce: bytes, server_nonce: bytes) -> dict[str, Any]:
    return {"auth": "challenge", "nonce": server_nonce,
            "proof": proof(secret, b"server", client_nonce, server_nonce)}


def client_proof(secret: RoleSecret, client_nonce: bytes, server_nonce: bytes
                 ) -> dict[str, Any]:
    return {"auth": "proof", "proof": proof(secret, b"client", client_nonce, server_nonce)}


def welcome() -> dict[str, Any]:
    return {"auth": "ok"}


def mismatch() -> dict[str, Any]:
    """What a client sends instead of its proof when the server's proof is wrong."""
    return {"auth": "mismatch"}


def is_hello(msg: Any) -> bool:
    return isinstance(msg, dict) and msg.get("auth") == "hello"


def _nonce(msg: dict, key: str, what: str) -> bytes:
    value = msg.get(key)
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise WireError(f"{what}: {key!r} must be {NONCE_BYTES} bytes", field=key)
    return value


def check_hello(msg: Any, peer: str, server: str) -> bytes:
    """The client nonce of a hello; AuthError if ``msg`` is not one (a client that sent
    a request first holds no secret)."""
    if not is_hello(msg):
        raise AuthError(f"{server} requires the job's role secret, but the client at {peer} "
                        "sent a request without authenticating", field=SETTING,
                        hint=SAME_SECRET_HINT)
    if msg.get("v") != VERSION:
        raise AuthError(f"{server}: the client at {peer} speaks handshake version "
                        f"{msg.get('v')!r}, this server {VERSION}", field="v",
                        hint="run the same stream-persia version in every role")
    return _nonce(msg, "nonce", f"hello from {peer}")


def check_challenge(msg: Any, secret: RoleSecret, client_nonce: bytes, peer: str) -> bytes:
    """The server nonce of a challenge whose proof is right; AuthError otherwise."""
    if not isinstance(msg, dict) or msg.get("auth") != "challenge":
        raise WireError(f"{peer} answered the handshake hello with something else",
                        field="auth")
    server_nonce = _nonce(msg, "nonce", f"challenge from {peer}")
    got = msg.get("proof")
    want = proof(secret, b"server", client_nonce, server_nonce)
    if not isinstance(got, bytes) or not hmac.compare_digest(got, want):
        raise AuthError(f"{peer} does not hold this job's role secret (its proof does not "
                        "match): refusing to talk to it", field=SETTING,
                        hint=SAME_SECRET_HINT)
    return server_nonce


def check_proof(msg: Any, secret: RoleSecret, client_nonce: bytes, server_nonce: bytes,
                peer: str, server: str) -> None:
    """AuthError unless ``msg`` is the client's proof for these nonces."""
    if isinstance(msg, dict) and msg.get("auth") == "mismatch":
        raise AuthError(f"{server} refused the client at {peer}: it holds another role "
                        "secret (it found this server's proof wrong)", field=SETTING,
                        hint=SAME_SECRET_HINT)
    got = msg.get("proof") if isinstance(msg, dict) and msg.get("auth") == "proof" else None
    want = proof(secret, b"client", client_nonce, server_nonce)
    if not isinstance(got, bytes) or not hmac.compare_digest(got, want):
        raise AuthError(f"{server} refused the client at {peer}: its role secret does not "
                        "match", field=SETTING,
                        hint=SAME_SECRET_HINT)


def check_welcome(msg: Any, peer: str) -> None:
    if not isinstance(msg, dict) or msg.get("auth") != "ok":
        raise WireError(f"{peer} did not confirm the handshake", field="auth")
