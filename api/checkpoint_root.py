"""The checkpoint directory: the only place an HTTP request may name a checkpoint in.

A request names a checkpoint (``POST /v1/model/reload``'s ``checkpoint``, the id in
``/v1/checkpoints/{id}``) by one of:

- its **id**: the name of a directory right under the root (``ckpt-20250101T000000Z-a1b2``);
- its **full path or URL**, spelled as the root is (``/ckpt/ckpt-1`` under the local root
  ``/ckpt``, ``s3://bucket/ckpt/ckpt-1`` under ``s3://bucket/ckpt``).

Anything else is a :class:`BadInput` naming the field, decided from the text alone before
any filesystem is touched: a path outside the root or deeper in it, ``..``, another
protocol (``file://``, ``http://``, ``webhdfs://``, ``tar://``, ...) or a chained URL
(``simplecache::...``). So a request can neither read files outside the root nor make the
API open a connection to a host of its choosing (fsspec's network protocols), and an
fsspec implementation that is not installed is never imported because of a request. For a
local root the directory's real path (symlinks resolved) must be right under the root's
real path too, so a symbolic link in the root cannot lead out of it.

The root itself comes from the operator (``PERSIA_CHECKPOINT_DIR``), as does the model
served at start-up (``PERSIA_API_MODEL``), which may be anywhere.
"""

from __future__ import annotations

import os
import re

from api.schemas import CHECKPOINT_ID_PATTERN
from stream_persia.checkpoint._common import Location
from stream_persia.errors import BadInput, ConfigError

__all__ = ["CheckpointRoot"]

_ID = re.compile(CHECKPOINT_ID_PATTERN)


class CheckpointRoot:
    """The configured checkpoint directory (None: no request may name a checkpoint).

    Args:
        root: a local path or an fsspec URL (``PERSIA_CHECKPOINT_DIR``).
    """

    def __init__(self, root: str | None):
        self.configured = root
        self._loc: Location | None = None

    def _location(self) -> Location:
        if self._loc is None:
            assert self.configured is not None
            try:
                self._loc = Location(self.configured)
            except (ImportError, ValueError) as e:   # e.g. s3:// without s3fs installed
                raise ConfigError(f"the checkpoint directory {self.configured!r} cannot be "
                                  f"used: {e}", field="checkpoint_dir") from None
        return self._loc

    @property
    def local(self) -> bool:
        return self._location().local

    @property
    def base(self) -> str:
        """The root's canonical form: its real path (local) or its URL (remote)."""
        return self._base()

    def _base(self) -> str:
        loc = self._location()
        return os.path.realpath(loc.path) if loc.local else loc.url.rstrip("/")

    def _spellings(self) -> set[str]:
        """How a full path or URL under the root may start (without the trailing ``/``)."""
        assert self.configured is not None
        loc = self._location()
        out = {self.configured.rstrip("/"), loc.url.rstrip("/")}
        if loc.local:
            out |= {loc.path.rstrip("/"), self._base()}
        return {s for s in out if s}

    def resolve(self, value: str, field: str = "checkpoint") -> str:
        """Where the checkpoint ``value`` (an id, or a full path/URL under the root) lives.

        Returns:
            The real path of the directory (local root) or its URL (remote root). It may
            not exist: reading it says so.

        Raises:
            BadInput: no root is configured, or ``value`` is not an id nor a path/URL right
                under the root, or (local) its real path is not right under the root's.
        """
        if self.configured is None:
            raise BadInput(f"{field}: no checkpoint directory is configured, so no "
                           f"checkpoint can be named in a request", field=field,
                           hint="set PERSIA_CHECKPOINT_DIR (or --checkpoint-dir); requests "
                                "name checkpoints under it")
        ident = value if _ID.fullmatch(value) else self._id_in(value, field)
        base = self._base()
        if not self.local:
            return f"{base}/{ident}"
        real = os.path.realpath(os.path.join(base, ident))
        if os.path.dirname(real) != base:
            raise BadInput(f"{field}: {value!r} is a symbolic link that leads out of the "
                           f"checkpoint directory {self.configured}", field=field,
                           hint="name a checkpoint stored in the checkpoint directory")
        return real

    def _id_in(self, value: str, field: str) -> str:
        """The id that a full path/URL right under the root names; BadInput otherwise."""
        for prefix in self._spellings():
            if value.startswith(prefix + "/"):
                rest = value[len(prefix) + 1:].rstrip("/")
                if _ID.fullmatch(rest):
                    return rest
        raise BadInput(f"{field}: {value!r} is neither a checkpoint id nor a checkpoint "
                       f"right under the checkpoint directory {self.configured}",
                       field=field, hint=f"an id ({CHECKPOINT_ID_PATTERN}) or "
                                         f"{self.configured.rstrip('/')}/<id>; other paths, "
                                         f"'..', and other protocols or chained URLs are "
                                         f"refused")

    def id_of(self, path: str | None) -> str | None:
        """The id of the checkpoint at ``path`` if it is right under the root, else None
        (compares real paths for a local root; no filesystem but the local one is used)."""
        if not path or self.configured is None:
            return None
        if self.local:
            if "://" in path or "::" in path:
                return None
            real = os.path.realpath(path)
            return os.path.basename(real) if os.path.dirname(real) == self._base() else None
        try:
            return self._id_in(path, "path")
        except BadInput:
            return None
