"""On/off environment variables, read strictly.

The switches of the Unix-socket shortcut (:mod:`stream_persia.rpc.unix`), of uvloop
(:mod:`stream_persia.core.aio`) and of the pure-Python twins (:mod:`stream_persia.kernels.
twins`) each compared against one spelling: ``false`` left the shortcut on (only ``0``
turned it off), turned uvloop *off* (anything but ``0`` did) and ``true`` picked no twin
(only ``1`` did). Each is now read by :func:`env_switch`: true/false, 1/0, yes/no, on/off
in any case, empty or unset for the default, and anything else is a
:class:`~stream_persia.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import os

from stream_persia.errors import ConfigError

__all__ = ["parse_switch", "env_switch"]

_SWITCH = {"true": True, "1": True, "yes": True, "on": True,
           "false": False, "0": False, "no": False, "off": False}


def parse_switch(raw: str, name: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off, any case) as a bool.

    Raises:
        ConfigError: naming ``name`` for anything else.
    """
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise ConfigError(f"{name} = {raw!r} is not true or false", field=name,
                          hint="true or false (1/0, yes/no and on/off also work)")
    return value


def env_switch(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a bool; ``default`` when unset or empty."""
    raw = os.environ.get(name, "")
    return parse_switch(raw, name) if raw.strip() else default
