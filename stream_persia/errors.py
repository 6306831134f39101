"""One exception root with four families (STYLE.md habit 5).

- :class:`BadInput` — something from outside (a Kafka message, an RPC frame, an HTTP body,
  a config file, a CLI flag) is invalid. Raised at the edge; never crashes a worker.
- :class:`Misuse` — the API was called wrongly by the program using it.
- :class:`RemoteError` — a peer failed, timed out or is unreachable.
- :class:`InternalError` — a bug in stream-persia.

Every error carries a human message that names the field, the value received and what
would be accepted; ``field`` and ``hint`` are also kept as attributes so callers (the HTTP
API, the dead-letter topic) can report them structurally.
"""

from __future__ import annotations

import re
from typing import Any


class PersiaError(Exception):
    """Root of every error stream-persia raises on purpose."""

    #: short machine-readable family name, used in RPC error replies and DLQ records
    kind = "error"

    def __init__(self, message: str, *, field: str | None = None, hint: str | None = None):
        self.message = message
        self.field = field
        self.hint = hint
        text = message
        if hint:
            text = f"{message} (hint: {hint})"
        super().__init__(text)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "type": type(self).__name__, "message": self.message,
                "field": self.field, "hint": self.hint}


class BadInput(PersiaError, ValueError):
    """Invalid input from outside the process."""

    kind = "bad_input"


class ConfigError(BadInput):
    """A config file, environment variable or CLI flag is invalid."""

    kind = "config"
    #: set by :mod:`stream_persia.config._base`: the message without its key path (so that
    #: a caller can put a prefix in front of the path), and whether the path is complete
    detail: str | None = None
    scoped: bool = False


class WireError(BadInput):
    """Bytes that are not a valid stream-persia frame or message."""

    kind = "wire"


class Misuse(PersiaError, RuntimeError):
    """The API was called in a way it does not support."""

    kind = "misuse"


class RemoteError(PersiaError):
    """A peer failed to answer, answered with an error, or cannot be reached."""

    kind = "remote"


class PeerUnavailable(RemoteError, ConnectionError):
    """The peer cannot be reached (refused, reset, closed)."""

    kind = "unavailable"


class RemoteTimeout(RemoteError, TimeoutError):
    """The peer did not answer in time."""

    kind = "timeout"


class PushFailed(RemoteError):
    """A batch's gradients could not be applied on every embedding server it needed within
    the worker's retry bound: some servers may hold them, others not. The batch stays
    failed on its worker (it pins the checkpoint frontier, and checkpoints refuse naming
    it) until a push of it completes or a restore replaces the state
    (:mod:`stream_persia.worker.service`). ``field`` is ``batch_id``."""

    kind = "push_failed"


class ServerRestarted(RemoteError):
    """An embedding server restarted (a new process at its address: kill, OOM, node loss)
    and lost the rows it held, with their optimizer state. A worker that notices it
    (:mod:`stream_persia.worker.router`) fails what needs that server instead of training
    on over an empty table, until a restore of a checkpoint replaces the table
    (``embedding_worker_config.on_server_restart``). ``field`` is ``incarnation``."""

    kind = "server_restarted"


class StreamReplay(Misuse):
    """Serving or applying a Kafka batch would train it a second time: the embedding
    servers already applied the updates of that partition's batches at or after its offset
    (a worker restarted alone starts its partitions over, or two workers read one
    partition). Nothing is served or applied; a restore of a checkpoint rewinds the
    servers and the stream together (:mod:`stream_persia.core.watermarks`). ``field`` is
    ``offset``."""

    kind = "stream_replay"


class DataLost(RemoteError):
    """Data the job needs is gone from where it was kept (Kafka retention deleted samples
    a checkpoint would replay: :class:`~stream_persia.kafka.loss.KafkaDataLoss`); asking
    again does not bring it back. The message names what was lost."""

    kind = "data_lost"


class AuthError(RemoteError):
    """An RPC peer refused the connection's authentication, or failed ours: the job's
    role secret is missing or differs (``field`` names the setting)."""

    kind = "auth"


class Backpressure(PersiaError):
    """A bounded buffer stayed full for longer than the caller was willing to wait."""

    kind = "backpressure"


class InternalError(PersiaError):
    """A bug: an invariant of stream-persia itself was broken."""

    kind = "internal"


_BY_KIND: dict[str, type[PersiaError]] = {
    cls.kind: cls
    for cls in (PersiaError, BadInput, ConfigError, WireError, Misuse, RemoteError,
                PeerUnavailable, RemoteTimeout, PushFailed, ServerRestarted, StreamReplay,
                DataLost,
                AuthError, Backpressure, InternalError)
}


def error_from_dict(d: dict[str, Any]) -> PersiaError:
    """Rebuild an error sent as :meth:`PersiaError.to_dict` (e.g. in an RPC error reply)."""
    cls = _BY_KIND.get(str(d.get("kind")), RemoteError)
    return cls(str(d.get("message", "remote error")), field=d.get("field"), hint=d.get("hint"))


def refused_as_unknown(error: BadInput, key: str) -> bool:
    """Whether a peer refused a request because it does not know the field ``key`` (a
    peer from before that field, whose "unknown <method> field(s)" check named it),
    rather than for its value: a caller newer than its peer then goes on without it."""
    message = str(getattr(error, "message", "") or error)
    return getattr(error, "field", None) == key and "unknown" in message \
        and "field" in message


def require(params: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    """``params[key]`` of a request map, which must be present and of type ``kind``;
    BadInput naming ``key`` otherwise."""
    if not isinstance(params, dict) or key not in params:
        raise BadInput(f"request is missing {key!r}", field=key)
    value = params[key]
    if not isinstance(value, kind):
        raise BadInput(f"{key!r} has type {type(value).__name__}", field=key,
                       hint=f"expected {kind}")
    return value


def require_hex16(value: Any, key: str, what: str) -> str:
    """``value`` if it is 16 lowercase hex digits (a configuration digest, a staged load's
    token); BadInput naming ``key`` otherwise."""
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{16}", value):
        raise BadInput(f"{key} must be the 16 hex digits of {what}, got {str(value)[:40]!r}",
                       field=key)
    return value


def config_digest_param(params: Any) -> str | None:
    """The configuration digest a request expects (its optional ``config``), if any."""
    want = params.get("config") if isinstance(params, dict) else None
    return None if want is None else require_hex16(want, "config", "a configuration digest")
