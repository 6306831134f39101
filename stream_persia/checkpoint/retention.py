"""Retention: how many checkpoints a root keeps, and deleting one without a reader ever
seeing it half gone.

``common_config.checkpointing_config.keep_checkpoints`` (default 3, 0 = keep every one)
is how many complete checkpoints the API keeps under its checkpoint directory: after
each checkpoint it takes, the oldest beyond that number are deleted (newest = latest
``created_at``, then highest step), except the ones the caller protects (the model being
served, a checkpoint being restored or loaded, the one just written). Directories without
a manifest (being written, or abandoned) are not checkpoints and are never counted or
touched, nor are symbolic links.

Chains (incremental checkpoints, :mod:`stream_persia.checkpoint.manifest`'s ``chain``):
a checkpoint that a kept one's chain needs (its parent, the parent's parent, ... up to its
base) is never deleted, whatever its age or whether ``select`` accepts it: a restore of
the kept patch reads them all. A compacted base (``stream-persia checkpoint compact``,
:mod:`stream_persia.server.compaction`) needs nothing, so the chain it was made from is
freed once no kept patch needs it.

In use meanwhile: ``protect`` is a snapshot taken before the pass, and a restore or a
reload may start using a checkpoint while the pass runs (in a thread). ``guard``, when
given, is asked just before each deletion, with the checkpoint's name and the names of
the checkpoints that deleting it would break (itself and the expired patches whose chain
needs it); it decides in one step, against the caller's live in-use set, whether the
deletion may go ahead and, if so, marks it as being deleted until it is done (a restore
or reload of it is then refused, naming it). A refused one is kept for the next pass.

Leftovers: after each pass, the hidden directories that killed writers left under the
root (staging, replaced and half-deleted checkpoints) are removed once abandoned
(:mod:`stream_persia.checkpoint.leftovers`), so a job killed now and then does not fill
its disk.

Deleting (:func:`delete_checkpoint`): a local checkpoint is first renamed to a hidden
sibling ``.<name>.deleting-<random>`` (one atomic step: readers skip hidden names), then
removed; a remote one loses its manifest first (readers then treat it as incomplete),
then its files. Once hidden, it is kept (made visible again, ``Misuse``) if a checkpoint
not being deleted with it needs it: a patch published while the deletion went on. Each
deletion lists the root's manifests again for that (one listing per checkpoint deleted).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext

from stream_persia.checkpoint._common import Location
from stream_persia.checkpoint.leftovers import rmtree_racing, sweep_abandoned
from stream_persia.checkpoint.manifest import MANIFEST_NAME, Manifest
from stream_persia.checkpoint.reader import list_checkpoints, newest_last
from stream_persia.errors import Misuse

__all__ = ["delete_checkpoint", "dependents", "expired", "prune_checkpoints"]

log = logging.getLogger(__name__)

#: ``guard(name, users)``: a context manager entered just before ``name`` is deleted; it
#: yields None when the deletion may go ahead (and keeps ``name`` marked as being deleted
#: until it exits), or why not (one of ``users`` is in use).
Guard = Callable[[str, Collection[str]], AbstractContextManager[str | None]]

def expired(manifests: Sequence[Manifest], keep: int, protect: Collection[str] = ()
            ) -> list[Manifest]:
    """The checkpoints beyond the ``keep`` newest, oldest first, leaving out those whose
    directory name is in ``protect``. ``keep`` 0 keeps every one."""
    if keep <= 0:
        return []
    ordered = sorted(manifests, key=newest_last)
    old = ordered[:-keep] if len(ordered) > keep else []
    return [m for m in old if Location(m.path or "").name not in protect]


def prune_checkpoints(root: str, keep: int, protect: Collection[str] = (),
                      select: Callable[[Manifest], bool] | None = None,
                      guard: Guard | None = None) -> list[str]:
    """Delete the complete checkpoints right under ``root`` beyond the ``keep`` newest,
    except those named (directory name) in ``protect``; returns the names deleted.
    ``select``: only the checkpoints it accepts are counted and deleted (periodic
    checkpoints keep their own ``keep`` newest in a directory shared with others).
    ``guard``: asked just before each deletion (see the module docstring). Blocking. A
    checkpoint that cannot be deleted is logged and left."""
    loc = Location(root)
    found = [m for m in list_checkpoints(root)
             if not (loc.local and os.path.islink(m.path or ""))
             and (select is None or select(m))]
    deleted = []
    old = expired(found, keep, protect)
    every = list_checkpoints(root)
    doomed = {Location(m.path or "").name for m in old}
    needed = _needed(every, doomed)
    by_name = _by_name(every)
    for m in old:
        name = Location(m.path or "").name
        if name in needed:
            log.info("retention: keeping checkpoint %s (step %d): a kept patch's chain "
                     "needs it", m.path, m.step)
            continue
        users = {name} | {n for n in doomed
                          if n in by_name and name in _ancestors(by_name[n], by_name)}
        with guard(name, users) if guard is not None else nullcontext() as busy:
            if busy is not None:
                log.info("retention: keeping checkpoint %s (step %d): %s", m.path, m.step,
                         busy)
                continue
            try:
                delete_checkpoint(m.path or "", going=users)
            except Misuse as e:   # a patch of it was published meanwhile
                log.info("retention: %s", e.message)
                continue
            except OSError as e:
                log.warning("retention: could not delete checkpoint %s: %s", m.path, e)
                continue
        log.info("retention: deleted checkpoint %s (step %d), keeping the %d newest under %s",
                 m.path, m.step, keep, loc.url)
        deleted.append(name)
    if loc.local:
        try:
            sweep_abandoned(loc.path)
        except OSError as e:    # tried again after the next checkpoint
            log.warning("retention: could not sweep the leftovers under %s: %s", loc.url, e)
    return deleted


def _ancestors(m: Manifest, by_name: dict[str, Manifest]) -> set[str]:
    """The names of the checkpoints ``m``'s chain needs: its parent, the parent's parent,
    ... up to its base (a missing one ends the walk)."""
    out: set[str] = set()
    link = m.chain
    while link is not None and link["parent"] is not None and link["parent"] not in out:
        out.add(link["parent"])
        parent = by_name.get(link["parent"])
        link = None if parent is None else parent.chain
    return out


def _by_name(every: Sequence[Manifest]) -> dict[str, Manifest]:
    return {Location(m.path or "").name: m for m in every}


def _needed(every: Sequence[Manifest], doomed: Collection[str]) -> set[str]:
    """Names of the checkpoints that a checkpoint not in ``doomed`` needs, among
    ``every`` under one root."""
    by_name = _by_name(every)
    return {n for name, m in by_name.items() if name not in doomed
            for n in _ancestors(m, by_name)}


def dependents(root: str, name: str) -> list[str]:
    """The complete checkpoints under ``root`` whose chain needs the checkpoint ``name``
    (patches of it, and patches of those), by name: deleting it breaks their restore."""
    by_name = _by_name(list_checkpoints(root))
    return sorted(n for n, m in by_name.items() if name in _ancestors(m, by_name))


def delete_checkpoint(src: str, going: Collection[str] = ()) -> None:
    """Delete the checkpoint directory ``src`` (blocking; see the module docstring).

    A checkpoint that another one needs (a patch of it, not named in ``going``: the
    patches of it that the caller deletes too) is kept. That is checked once ``src`` is
    hidden, so it holds against a patch published meanwhile: its writer checks the parent
    just before publishing and again after (and withdraws the patch if the parent went),
    so each side sees the other, and they never both go ahead. Both may back off; then
    the check is made once more after the patch was withdrawn.

    Raises:
        Misuse: a checkpoint needs it (``checkpoint``, naming them); it is kept.
        OSError: it could not be deleted (a local one is then either still complete or
            already gone from readers' view under its hidden name).
    """
    loc = Location(src)
    root, name = loc.url.rstrip("/").rsplit("/", 1)
    needed: list[str] = []
    for _ in range(2):   # a patch withdrawn meanwhile is gone the second time
        if loc.local:
            hidden = os.path.join(os.path.dirname(loc.path),
                                  f".{name}.deleting-{uuid.uuid4().hex[:12]}")
            os.rename(loc.path, hidden)
            needed = [n for n in dependents(root, name) if n not in going]
            if not needed:
                rmtree_racing(hidden)   # a sweep may remove parts of it meanwhile
                return
            os.rename(hidden, loc.path)
            continue
        manifest = loc.join(MANIFEST_NAME)
        if not loc.fs.exists(manifest):
            break
        data = loc.fs.cat_file(manifest)
        loc.fs.rm_file(manifest)
        with contextlib.suppress(AttributeError, OSError, ValueError):
            loc.fs.invalidate_cache(root)   # the listing must see what is there now
        needed = [n for n in dependents(root, name) if n not in going]
        if not needed:
            break
        loc.fs.pipe_file(manifest, data)
    if needed:
        raise Misuse(f"checkpoint {name!r} was kept: incremental checkpoint(s) "
                     f"{needed[:5]} need it", field="checkpoint",
                     hint="delete the patches that depend on it first (newest first)")
    if not loc.local:
        loc.fs.rm(loc.path, recursive=True)
