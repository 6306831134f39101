"""argparse types for the console script: every flag is checked when it is parsed.

A bad value ends the command at once with exit status 2 and argparse's
``argument --FLAG: <what is accepted>, got <value>``, before any role or connection is
started. Defaults read from the environment (``REPLICA_INDEX``, ``NPROC_PER_NODE``, ...)
are passed to argparse as strings, so they go through the same type (argparse converts a
string default only when the flag is not given) and a bad one names the flag and its
variable.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable
from typing import Any

__all__ = ["integer", "size", "number", "port", "addresses", "nonempty", "topic", "log_level",
           "env"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _bounds(lo: float | None, hi: float | None) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in [{lo}, {hi}]"


def integer(lo: int | None = None, hi: int | None = None, *, note: str = ""
            ) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` written as digits (``-5``, ``1.5``, ``abc`` refused)."""
    want = f"an integer {_bounds(lo, hi)}{note}"

    def parse(raw: str) -> int:
        try:
            value = int(str(raw).strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {raw!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {raw!r}")
        return value

    parse.__name__ = "integer"
    return parse


def size(lo: int = 0, hi: int | None = None, *, note: str = "") -> Callable[[str], int]:
    """A whole number in ``[lo, hi]`` that may be written ``1e6`` or ``1_000_000``
    (``1.5`` and ``2.5e0`` are refused: they are not whole)."""
    want = f"a whole number {_bounds(lo, hi)}{note}"

    def refuse(raw: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"must be {want}, got {raw!r} (1e6 and 1_000_000 "
                                          "are accepted too)")

    def parse(raw: str) -> int:
        text = str(raw).strip().replace("_", "")
        try:
            value = int(text, 10)
        except ValueError:
            try:
                number_ = float(text)
            except ValueError:
                raise refuse(raw) from None
            if not math.isfinite(number_) or not number_.is_integer():
                raise refuse(raw) from None
            value = int(number_)
        if value < lo or (hi is not None and value > hi):
            raise refuse(raw)
        return value

    parse.__name__ = "size"
    return parse


def number(lo: float, hi: float | None = None, *, lo_open: bool = False, note: str = ""
           ) -> Callable[[str], float]:
    """A finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); nan/inf refused."""
    low = f"> {lo}" if lo_open else f">= {lo}"
    want = f"a number {low}" + (f" and <= {hi}" if hi is not None else "") + note

    def parse(raw: str) -> float:
        try:
            value = float(str(raw).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {raw!r}") from None
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) \
                or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {raw!r}")
        return value

    parse.__name__ = "number"
    return parse


def port(*, zero: str | None = "any free port") -> Callable[[str], int]:
    """A TCP port: 1..65535, and 0 when ``zero`` says what 0 means."""
    if zero is None:
        return integer(1, 65535, note=" (a TCP port)")
    return integer(0, 65535, note=f" (0: {zero})")


def addresses(raw: str) -> str:
    """``host:port[,host:port...]``, normalised. An empty value is refused: given as a
    flag (``--kafka ""``, a shell variable that was not set) it used to read as "not
    given", so the environment's or the config file's addresses were used instead, or
    none; an empty environment variable still counts as unset (:func:`env`)."""
    from stream_persia.config._base import parse_addresses
    from stream_persia.errors import ConfigError

    try:
        value = parse_addresses(raw, "addresses")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(
            f"{getattr(e, 'detail', e.message)}; expected host:port[,host:port...], "
            "e.g. 127.0.0.1:9092 or [::1]:9092") from None
    if value is None:
        raise argparse.ArgumentTypeError(
            f"is empty ({raw!r}); expected host:port[,host:port...]: leave the flag out "
            "for the default")
    return value


def nonempty(raw: str) -> str:
    """A path or name that is not empty: ``--global-config ""`` (an unset shell variable)
    used to read as "not given", so the built-in defaults or the environment's file were
    used instead of the one the user meant."""
    if not str(raw).strip():
        raise argparse.ArgumentTypeError(f"is empty ({raw!r}): give a value, or leave the "
                                         "flag out for the default")
    return raw


def topic(raw: str) -> str:
    """A Kafka topic name (the characters and length Kafka accepts)."""
    from stream_persia.config.kafka import TOPIC_HINT, TOPIC_RE

    if not TOPIC_RE.fullmatch(raw):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a valid Kafka topic name: "
                                         f"{TOPIC_HINT}")
    return raw


def log_level(raw: str) -> str:
    """A logging level name, any case; returned in lower case."""
    value = str(raw).strip().lower()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, "
                                         f"got {raw!r}")
    return value


def level_of(name: str) -> int:
    """The ``logging`` level of a name accepted by :func:`log_level`."""
    return getattr(logging, name.upper())


def env(name: str, parse: Callable[[str], Any], default: str | None) -> dict[str, Any]:
    """``type=`` and ``default=`` for a flag whose default is the environment variable
    ``name`` (an empty variable counts as unset): a bad value in the environment is
    refused by argparse like a bad flag, and the message names the variable too."""

    def checked(raw: str) -> Any:
        try:
            return parse(raw)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (given as the flag, or by the environment "
                                             f"variable {name})") from None

    checked.__name__ = getattr(parse, "__name__", "value")
    return {"type": checked, "default": os.environ.get(name) or default}
