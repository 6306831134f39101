"""The checkpoint root: the one place role RPCs may read or write checkpoint files.

An embedding server's ``dump`` and ``load`` and the checkpoint mailbox's
``checkpoint_request`` (:mod:`stream_persia.worker.mailbox`) take a directory from the
network. Each role confines it to its configured root (``--checkpoint-root``, else
``PERSIA_CHECKPOINT_ROOT``, else ``PERSIA_CHECKPOINT_DIR``, the API's checkpoint
directory) before touching anything:

- a **local** root (a path, or ``file://``) accepts local paths (or ``file://`` URLs) that
  are the root or lie below it once made absolute (against the role's working directory)
  and ``..`` and every symlink are resolved (``os.path.realpath``), so neither
  ``/root/../etc`` nor a symlink inside the root that points out of it gets through; the
  resolved path is what the role uses (and hands on: the mailbox gives it to the NN ranks);
- an **fsspec URL** root (``s3://bucket/ckpt``, ``memory://``) accepts URLs of the same
  protocol whose path is the root's path or below it, with no ``.`` or ``..`` segment;
- nothing else: no other protocol, no chained URL (``simplecache::...``). The refusal is a :class:`~stream_persia.errors.BadInput` naming the request's
  field; a role with no root refuses every such request (:class:`~stream_persia.errors.
  Misuse` naming the setting).

This is string and path logic only: no filesystem is instantiated for a refused URL.
"""

from __future__ import annotations

import os
import posixpath
import re

from stream_persia.errors import BadInput, ConfigError, Misuse

__all__ = ["CheckpointRoot", "ROOT_ENV", "require_root"]

ROOT_ENV = "PERSIA_CHECKPOINT_ROOT"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_HINT = f"set --checkpoint-root (or {ROOT_ENV}) on the role to the directory checkpoints go to"


def _split(url: str) -> tuple[str | None, str]:
    """(protocol or None for a plain path, path); ``file://`` counts as plain."""
    m = _URL.match(url)
    if m is None:
        return None, url
    protocol, path = m.group(1).lower(), m.group(2)
    return (None, path) if protocol in ("file", "local") else (protocol, path)


def _segments(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


class CheckpointRoot:
    """A configured checkpoint root (a local directory or an fsspec URL prefix).

    Args:
        url: the root; a relative local path is resolved against the current directory.

    Raises:
        ConfigError: empty, chained (``a::b``), or with ``.``/``..`` segments in a URL.
    """

    def __init__(self, url: str):
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"the checkpoint root must be a non-empty path or URL, got "
                              f"{url!r}", field="checkpoint_root", hint=_HINT)
        url = url.strip()
        if "::" in url:
            raise ConfigError(f"the checkpoint root {url!r} is a chained URL; give the "
                              "storage URL itself", field="checkpoint_root")
        self.protocol, path = _split(url)
        if self.protocol is None:
            self.path = os.path.realpath(path)
            self.url = self.path
        else:
            segments = _segments(path)
            if any(s in (".", "..") for s in segments):
                raise ConfigError(f"the checkpoint root {url!r} has a '.' or '..' segment",
                                  field="checkpoint_root")
            self.path = "/".join(segments)
            self.url = f"{self.protocol}://{self.path}"

    def __repr__(self) -> str:
        return f"CheckpointRoot({self.url!r})"

    def confine(self, location: object, field: str) -> str:
        """``location`` if it is this root or lies below it, as a role should use it (a
        local path with symlinks resolved; a URL unchanged).

        Raises:
            BadInput: (``field``) not a string, another protocol, a chained URL, a
                ``.``/``..`` segment in a URL, or outside the root.
        """
        return self.locate(location, field)[0]

    def locate(self, location: object, field: str) -> tuple[str, list[str]]:
        """(``location`` as :meth:`confine` returns it, its path segments below the root:
        ``[]`` for the root itself). The API's checkpoint ids build on this
        (:mod:`stream_persia.api.checkpoint_root`: one segment, an id).

        Raises:
            BadInput: as :meth:`confine`.
        """
        if not isinstance(location, str) or not location:
            raise BadInput(f"{field} must be a non-empty path or URL, got "
                           f"{type(location).__name__}", field=field)
        shown = location if len(location) <= 200 else location[:200] + "..."
        outside = BadInput(f"{field} {shown!r} is not under the checkpoint root {self.url}",
                           field=field, hint="checkpoints are read and written under the "
                                             "root only")
        if "::" in location:
            raise outside
        protocol, path = _split(location)
        if protocol != self.protocol:
            raise BadInput(f"{field} {shown!r}: only "
                           f"{'local paths' if self.protocol is None else self.protocol + '://'}"
                           f" under the checkpoint root {self.url} are accepted", field=field)
        if self.protocol is None:
            if not path or "\0" in path:
                raise outside
            resolved = os.path.realpath(path)
            if os.path.commonpath([resolved, self.path]) != self.path:
                raise outside
            return resolved, _segments(resolved[len(self.path):])
        segments = _segments(path)
        if any(s in (".", "..") for s in segments) or \
                posixpath.normpath(path).startswith(".."):
            raise outside
        root = _segments(self.path)
        if segments[:len(root)] != root:
            raise outside
        return location, segments[len(root):]


def require_root(root: CheckpointRoot | None, role: str) -> CheckpointRoot:
    """``root``, or the Misuse a role without one answers checkpoint requests with."""
    if root is None:
        raise Misuse(f"{role} has no checkpoint root, so it reads and writes no checkpoint "
                     "files", field="checkpoint_root", hint=_HINT)
    return root
