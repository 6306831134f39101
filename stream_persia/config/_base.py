"""Shared machinery of the config loaders: errors that carry a key path, value checks used
by every ``__post_init__`` and the mapping → dataclass builder (files are read by
:mod:`stream_persia.config.files`).

Errors are built in two steps so that every message names the file, the full key path, the
value received and a fix, whether the config came from a file or from Python:

- a dataclass's ``__post_init__`` raises :func:`error` with the field name relative to
  itself (``"capacity"``);
- :func:`build` re-raises it with the path of the section (``"embedding_parameter_server_
  config.capacity"``), and the public ``from_dict`` prefixes the source (file name).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import numbers
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from stream_persia.errors import ConfigError

__all__ = ["error", "rescope", "at_source", "describe", "did_you_mean", "build",
           "check_int", "check_bool", "check_str", "check_choice", "check_instance",
           "check_no_unknown", "parse_addresses", "section_to_dict", "canonical_digest"]


def error(field: str, detail: str, hint: str | None = None) -> ConfigError:
    """A :class:`ConfigError` about ``field`` (a dotted key path), not yet tied to a file."""
    err = ConfigError(f"{field}: {detail}", field=field, hint=hint)
    err.detail = detail  # kept apart so a caller can re-prefix the path without re-parsing
    return err


def rescope(err: ConfigError, prefix: str, source: str | None = None) -> ConfigError:
    """Return ``err`` with ``prefix`` put in front of its key path (and ``source`` named)."""
    detail = err.detail if err.detail is not None else err.message
    field = err.field or ""
    if prefix:
        field = f"{prefix}.{field}" if field else prefix
    if source is None:
        return error(field, detail, err.hint)
    new = ConfigError(f"{source}: {field}: {detail}", field=field, hint=err.hint)
    new.detail = detail
    return new


def describe(value: Any) -> str:
    """``repr`` of a received value with its type, kept short for messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


# ---- value checks (called from __post_init__; they normalise through object.__setattr__)

def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def check_int(obj: Any, name: str, *, lo: int | None = None, hi: int | None = None,
              optional: bool = False, hint: str | None = None) -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        extra = ""
        if isinstance(value, str) and value.strip().replace("_", "").isdigit():
            extra = "; write the number without quotes"
        elif isinstance(value, str) and _looks_numeric(value):
            extra = "; YAML reads 1e9 as text, so write the digits (1000000000)"
        want = "an integer or null" if optional else "an integer"
        raise error(name, f"expected {want}, got {describe(value)}{extra}", hint)
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hi is None:
            rng = f">= {lo}"
        elif lo is None:
            rng = f"<= {hi}"
        else:
            rng = f"in [{lo}, {hi}]"
        raise error(name, f"must be an integer {rng}, got {value}", hint)
    _set(obj, name, value)


def _looks_numeric(text: str) -> bool:
    try:
        float(text.replace("_", ""))
    except ValueError:
        return False
    return True


def check_bool(obj: Any, name: str, hint: str | None = None) -> None:
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise error(name, f"expected true or false, got {describe(value)}", hint)


def check_str(obj: Any, name: str, *, optional: bool = False, nonempty: bool = True,
              hint: str | None = None) -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    if not isinstance(value, str):
        want = "a string or null" if optional else "a string"
        raise error(name, f"expected {want}, got {describe(value)}", hint)
    if nonempty and not value.strip():
        raise error(name, "must not be empty", hint)


def check_choice(obj: Any, name: str, choices: Iterable[str], *, optional: bool = False,
                 case_insensitive: bool = True) -> None:
    """Check a string enum and normalise it to the spelling in ``choices``."""
    value = getattr(obj, name)
    choices = list(choices)
    if value is None and optional:
        return
    if isinstance(value, str):
        for choice in choices:
            if value == choice or (case_insensitive and value.lower() == choice.lower()):
                _set(obj, name, choice)
                return
    raise error(name, f"expected one of {', '.join(choices)}, got {describe(value)}",
                did_you_mean(value, choices))


def check_instance(obj: Any, name: str, cls: type) -> None:
    value = getattr(obj, name)
    if isinstance(value, Mapping):
        # Programmatic convenience: a plain dict for a section is built like a file's.
        _set(obj, name, build(cls, value, name))
        return
    if not isinstance(value, cls):
        raise error(name, f"expected a {cls.__name__} (or a mapping), got {describe(value)}")


def did_you_mean(value: Any, accepted: Iterable[str]) -> str | None:
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, list(accepted), n=1, cutoff=0.6)
    if not close:
        close = [a for a in accepted if a.lower() == value.lower()]
    return f"did you mean {close[0]!r}?" if close else None


def parse_addresses(value: Any, name: str) -> str | None:
    """``"host:port,host:port"`` (or a list of them) → normalised string; ``""`` → None.

    Hosts are names or IPv4 addresses, or IPv6 addresses in brackets (``[::1]:9092``).
    """
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) for v in value):
            raise error(name, f"expected host:port strings, got {describe(value)}")
        value = ",".join(value)
    if not isinstance(value, str):
        raise error(name, f"expected 'host:port[,host:port...]', got {describe(value)}")
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts:
        return None
    for part in parts:
        host, sep, port = part.rpartition(":")
        ok = bool(sep and host) and port.isdigit() and 1 <= int(port) <= 65535
        if ok and host.startswith("["):
            ok = host.endswith("]") and len(host) > 2
        elif ok:
            ok = ":" not in host and "/" not in host
        if not ok:
            raise error(name, f"{part!r} is not host:port", "for example localhost:9092 or "
                        "[::1]:9092; separate several brokers with commas")
    return ",".join(parts)


# ---- mapping → dataclass

def build(cls: type, raw: Any, path: str, **extra: Any) -> Any:
    """Build config dataclass ``cls`` from a YAML mapping found at key path ``path``.

    The class may declare ``_ALIASES`` (other spellings PERSIA used → field name),
    ``_REJECTED`` (keys refused with a specific explanation), ``_NESTED`` (field name →
    section dataclass) and ``_FLAT`` (field name → dataclass whose keys stand in the
    mapping itself: they are gathered into a dict for that field, which the class's
    ``__post_init__`` turns into the dataclass). ``extra`` supplies fields that do not come from the mapping (a
    slot's name). Unknown keys, missing required keys and the class's own validation
    errors come back as :class:`ConfigError` naming the full key path.
    """
    if raw is None:
        raw = {}  # an empty YAML section (``metrics_config:``) means "all defaults"
    if not isinstance(raw, Mapping):
        raise error(path, f"expected a mapping of keys to values, got {describe(raw)}")
    flat: dict[str, type] = getattr(cls, "_FLAT", {})
    fields = {f.name: f for f in dataclasses.fields(cls)
              if f.init and f.name not in extra and f.name not in flat}
    # key -> the field it is gathered into (a dict the class's __post_init__ builds from)
    gathered = {f.name: name for name, c in flat.items() for f in dataclasses.fields(c)}
    aliases: dict[str, str] = getattr(cls, "_ALIASES", {})
    rejected: dict[str, str] = getattr(cls, "_REJECTED", {})
    nested: dict[str, type] = getattr(cls, "_NESTED", {})
    kwargs: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        if not isinstance(key, str):
            raise error(where, f"keys must be strings, got {describe(key)}")
        if key in rejected:
            raise error(where, "is not accepted", rejected[key])
        name = aliases.get(key, key)
        if name in gathered and name not in rejected:
            kwargs.setdefault(gathered[name], {})[name] = value
            continue
        if name not in fields or name in rejected:
            accepted = sorted([f for f in fields if f not in rejected] + list(gathered))
            hint = did_you_mean(key, accepted + list(aliases)) or ""
            hint = (hint + " " if hint else "") + f"accepted keys: {', '.join(accepted)}"
            raise error(where, "unknown key", hint)
        if name in given_as:
            raise error(where, f"is given twice (also as {given_as[name]!r})",
                        f"keep only {name!r}")
        given_as[name] = key
        if name in nested:
            value = build(nested[name], value, where)
        kwargs[name] = value
    for name, f in fields.items():
        no_default = (f.default is dataclasses.MISSING
                      and f.default_factory is dataclasses.MISSING)
        if no_default and name not in kwargs:
            where = f"{path}.{name}" if path else name
            raise error(where, "required key is missing (it has no default)")
    try:
        return cls(**kwargs, **extra)
    except ConfigError as err:
        if err.scoped:
            raise
        new = rescope(err, path)
        new.scoped = True
        raise new from None


def check_no_unknown(raw: Mapping[str, Any], accepted: Iterable[str], path: str,
                     aliases: Mapping[str, str] | None = None,
                     rejected: Mapping[str, str] | None = None) -> None:
    """Key check for hand-written parsers (the embedding config's top level)."""
    accepted = list(accepted)
    for key in raw:
        where = f"{path}.{key}" if path else str(key)
        if not isinstance(key, str):
            raise error(where, f"keys must be strings, got {describe(key)}")
        if rejected and key in rejected:
            raise error(where, "is not accepted", rejected[key])
        if key in accepted or (aliases and key in aliases):
            continue
        hint = did_you_mean(key, accepted + list(aliases or ())) or ""
        hint = (hint + " " if hint else "") + f"accepted keys: {', '.join(sorted(accepted))}"
        raise error(where, "unknown key", hint)


def at_source(err: ConfigError, source: str) -> ConfigError:
    """Final form of an error: ``<source>: <key path>: <detail>``."""
    return rescope(err, "", source)


def section_to_dict(obj: Any, redact: bool, secrets: Collection[str] = ()) -> dict[str, Any]:
    """A config dataclass as plain data in field order (sections recursively); with
    ``redact``, the fields named in ``secrets`` read ``"<redacted>"``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):   # a section: its own to_dict knows its secrets
            to_dict = getattr(value, "to_dict", None)
            value = (to_dict(redact=redact) if callable(to_dict)
                     else section_to_dict(value, redact))
        elif isinstance(value, tuple):
            value = list(value)
        if redact and f.name in secrets and value is not None:
            value = "<redacted>"
        out[f.name] = value
    return out


def canonical_digest(d: Mapping[str, Any]) -> str:
    """Hex SHA-256 of ``d`` as compact JSON.

    Keys keep their insertion order (not sorted) because the order of slots and feature
    groups is meaningful: it decides the id prefixes. ``to_dict`` builds keys in a fixed
    order, so the JSON is canonical for a given config.
    """
    text = json.dumps(d, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
