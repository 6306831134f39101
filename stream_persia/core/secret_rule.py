"""The one length rule for the job's shared secrets: the role secret between roles
(:class:`stream_persia.rpc.auth.RoleSecret`) and the API's bearer token
(:class:`stream_persia.api.settings.ApiSettings`).

A short secret falls to an offline guess: an RPC handshake seen on the network or a
bearer token tried over HTTP (no rate limit stops a patient guesser), so both are refused
at start-up, naming the setting they came from.
"""

from __future__ import annotations

from typing import Final

from stream_persia.errors import ConfigError

__all__ = ["MIN_SECRET_CHARS", "check_secret"]

#: shorter secrets are refused at start-up
MIN_SECRET_CHARS: Final = 16


def check_secret(value: object, setting: str, what: str) -> str:
    """``value`` stripped of surrounding whitespace, when it is a secret long enough.

    Args:
        value: the secret as configured.
        setting: where it came from, named by the error (e.g. ``PERSIA_API_TOKEN_FILE``).
        what: what it is, for the message (e.g. ``the API token``).

    Raises:
        ConfigError: not a string, or under :data:`MIN_SECRET_CHARS` characters once
            stripped (an empty one included).
    """
    if not isinstance(value, str) or len(value.strip()) < MIN_SECRET_CHARS:
        got = len(value.strip()) if isinstance(value, str) else type(value).__name__
        raise ConfigError(f"{setting}: {what} must be at least {MIN_SECRET_CHARS} characters "
                          f"(got {got})", field=setting,
                          hint="generate one, e.g. `openssl rand -hex 32`")
    return value.strip()
