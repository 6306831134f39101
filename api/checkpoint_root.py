"""The checkpoint directory: the only place an HTTP request may name a checkpoint in.

A request names a checkpoint (``POST /v1/model/reload``'s ``checkpoint``, the id in
``/v1/checkpoints/{id}``) by one of:

- its **id**: the name of a directory right under the root (``ckpt-20250101T000000Z-a1b2``);
- its **full path or URL**, spelled as the root is (``/ckpt/ckpt-1`` under the local root
  ``/ckpt``, ``s3://bucket/ckpt/ckpt-1`` under ``s3://bucket/ckpt``).

Anything else is a :class:`BadInput` naming the field: a path outside the root or deeper in
it, another protocol (``file://``, ``http://``, ``webhdfs://``, ``tar://``, ...) or a
chained URL (``simplecache::...``). The confinement itself (protocols, chained URLs, ``..``,
real paths and symbolic links) is the roles' :class:`~stream_persia.checkpoint.root.
CheckpointRoot`; this module adds the API's rules on top: one level below the root, an id's
syntax, and a local root's checkpoints named by path (not ``file://``). So a request can
neither read files outside the root nor make the API open a connection to a host of its
choosing (fsspec's network protocols), and an fsspec implementation that is not installed
is never imported because of a request.

The root itself comes from the operator (``PERSIA_CHECKPOINT_DIR``), as does the model
served at start-up (``PERSIA_API_MODEL``), which may be anywhere.
"""

from __future__ import annotations

import re

from stream_persia.api.schemas import CHECKPOINT_ID_PATTERN

from stream_persia.checkpoint._common import Location
from stream_persia.checkpoint.root import CheckpointRoot
from stream_persia.errors import BadInput, ConfigError

__all__ = ["CheckpointDir"]

_ID = re.compile(CHECKPOINT_ID_PATTERN)


class CheckpointDir:
    """The configured checkpoint directory (None: no request may name a checkpoint).

    Args:
        root: a local path or an fsspec URL (``PERSIA_CHECKPOINT_DIR``).

    Raises:
        ConfigError: (``checkpoint_dir``) ``root`` cannot be a checkpoint root (a chained
            URL, a ``..`` segment in a URL).
    """

    def __init__(self, root: str | None):
        self.configured = root
        self._base: str | None = None
        self._root: CheckpointRoot | None = None
        if root is not None:
            try:
                self._root = CheckpointRoot(root)
            except ConfigError as e:
                raise ConfigError(e.message, field="checkpoint_dir",
                                  hint="set PERSIA_CHECKPOINT_DIR to a directory or an "
                                       "fsspec URL") from None

    @property
    def local(self) -> bool:
        return self._root is not None and self._root.protocol is None

    @property
    def base(self) -> str:
        """The root's canonical form: its real path (local) or its URL as fsspec writes it
        (remote; the filesystem is made on first use)."""
        assert self._root is not None
        if self._base is None:
            if self.local:
                self._base = self._root.path
            else:
                try:
                    self._base = Location(self._root.url).url.rstrip("/")
                except (ImportError, ValueError) as e:   # e.g. s3:// without s3fs installed
                    raise ConfigError(f"the checkpoint directory {self.configured!r} cannot "
                                      f"be used: {e}", field="checkpoint_dir") from None
        return self._base

    def resolve(self, value: str, field: str = "checkpoint") -> str:
        """Where the checkpoint ``value`` (an id, or a full path/URL under the root) lives.

        Returns:
            The real path of the directory (local root) or its URL (remote root). It may
            not exist: reading it says so.

        Raises:
            BadInput: no root is configured, or ``value`` is not an id nor a path/URL right
                under the root, or (local) its real path is not right under the root's.
        """
        if self._root is None:
            raise BadInput(f"{field}: no checkpoint directory is configured, so no "
                           f"checkpoint can be named in a request", field=field,
                           hint="set PERSIA_CHECKPOINT_DIR (or --checkpoint-dir); requests "
                                "name checkpoints under it")
        if _ID.fullmatch(value):
            try:
                where, below = self._root.locate(f"{self._root.url}/{value}", field)
            except BadInput:
                raise BadInput(f"{field}: {value!r} is a symbolic link that leads out of the "
                               f"checkpoint directory {self.configured}", field=field,
                               hint="name a checkpoint stored in the checkpoint "
                                    "directory") from None
        else:
            where, below = self._right_under(value, field)
        if len(below) != 1:    # a link to a directory deeper in the root, or the root itself
            raise self._refusal(value, field)
        return where if self.local else f"{self.base}/{below[0]}"

    def _right_under(self, value: str, field: str) -> tuple[str, list[str]]:
        """(where, segments below the root) of a full path/URL; BadInput unless it is one
        level below the root and spelled as the root is."""
        assert self._root is not None
        if ".." in value.split("/") or (self.local and "://" in value):
            raise self._refusal(value, field)
        try:
            where, below = self._root.locate(value, field)
        except BadInput:
            raise self._refusal(value, field) from None
        if len(below) != 1 or not _ID.fullmatch(below[0]):
            raise self._refusal(value, field)
        return where, below

    def _refusal(self, value: str, field: str) -> BadInput:
        return BadInput(f"{field}: {value!r} is neither a checkpoint id nor a checkpoint "
                        f"right under the checkpoint directory {self.configured}",
                        field=field, hint=f"an id ({CHECKPOINT_ID_PATTERN}) or "
                                          f"{str(self.configured).rstrip('/')}/<id>; other "
                                          f"paths, '..', and other protocols or chained URLs "
                                          f"are refused")

    def id_of(self, path: str | None) -> str | None:
        """The id of the checkpoint at ``path`` if it is right under the root, else None
        (compares real paths for a local root; no filesystem but the local one is used)."""
        if not path or self._root is None:
            return None
        try:
            _, below = self._root.locate(path, "path")
        except BadInput:
            return None
        return below[0] if len(below) == 1 else None
