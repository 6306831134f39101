"""What interrupted writers leave beside checkpoints, and removing it once it is abandoned.

A local checkpoint is staged in a hidden sibling ``.<name>.staging-<owner>-<random>``,
replaces an existing one by renaming that aside to ``.<name>.old-<random>``, and is
deleted by first renaming it to ``.<name>.deleting-<random>`` (the package docstring and
:mod:`stream_persia.checkpoint.retention`). A writer killed with ``-9`` (or a host that
lost power) leaves such a directory behind, as large as a checkpoint; nothing else would
ever remove it, so a job that is killed now and then would fill its disk.

:func:`sweep_abandoned` removes the hidden directories right under a root that no live
writer can still need. It runs after every retention pass (the API's and the periodic
checkpoints'), and from ``stream-persia checkpoint clean ROOT``. A directory is abandoned
when:

- ``.staging-``: its owner (``<pid>@<host>`` in the name, written by this version's
  writer) is a process of this host that no longer runs, and nothing in it changed for
  ``idle_s`` (default 5 minutes: hosts that share a name and a volume, such as two
  containers, cannot then remove each other's live staging, which a writer refreshes as
  it writes). A staging directory of another host, or of an older writer without an
  owner in its name, is abandoned once nothing in it changed for ``stale_s`` (default
  24 hours; so is one whose owner's pid was reused);
- ``.old-``: the checkpoint it was renamed aside from is complete again (it has a
  manifest), and nothing in it changed for ``idle_s``. Without that checkpoint the
  ``.old-`` directory may be the only complete copy (a crash between the two renames of
  a replace: :func:`~stream_persia.checkpoint.read_manifest` says to rename it back), so
  it is kept;
- ``.deleting-``: nothing in it changed for ``idle_s`` (it was already out of readers'
  view; its deleter died).

"Changed" is the newest modification time of the directory and of the files right in it
(a server dumping a shard keeps its file's time fresh). Remote roots (fsspec URLs) have no
hidden siblings (their writers write in place) and are not swept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass

from stream_persia.checkpoint.manifest import MANIFEST_NAME

__all__ = ["IDLE_S", "STALE_S", "Leftover", "find_leftovers", "staging_owner",
           "sweep_abandoned"]

log = logging.getLogger(__name__)

#: Seconds without a change after which a leftover whose owner is known to be gone is removed.
IDLE_S = 300.0
#: Seconds without a change after which any staging directory is taken as abandoned.
STALE_S = 24 * 3600.0

_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>staging|old|deleting)-(?P<rest>.+)$")
_OWNER = re.compile(r"^(?P<pid>\d+)@(?P<host>[A-Za-z0-9.-]+)-")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"


def staging_owner() -> str:
    """``<pid>@<host>`` of this process, as the writer puts it in a staging directory's name."""
    return f"{os.getpid()}@{_host()}"


@dataclass(frozen=True)
class Leftover:
    """A hidden directory under a checkpoint root (see the module docstring)."""
    path: str
    kind: str            # "staging", "old" or "deleting"
    checkpoint: str      # the name of the checkpoint it belongs to
    idle_s: float        # seconds since anything in it changed
    abandoned: bool
    why: str             # why it is (or is not) taken as abandoned


def _idle_s(path: str, now: float) -> float:
    newest = os.stat(path, follow_symlinks=False).st_mtime
    with os.scandir(path) as it:
        for e in it:
            try:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return max(0.0, now - newest)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, under another user
        return True
    return True


def _judge(root: str, kind: str, name: str, rest: str, idle: float, idle_s: float,
           stale_s: float) -> tuple[bool, str]:
    if kind == "deleting":
        return idle >= idle_s, f"a deletion left unfinished, unchanged for {idle:.0f} s"
    if kind == "old":
        if not os.path.isfile(os.path.join(root, name, MANIFEST_NAME)):
            return False, f"kept: {name} is not complete, so this may be its only copy"
        return idle >= idle_s, f"{name} was replaced; unchanged for {idle:.0f} s"
    owner = _OWNER.match(rest)
    if owner is not None and owner["host"] == _host():
        pid = int(owner["pid"])
        if not _pid_alive(pid):
            return idle >= idle_s, (f"its writer (pid {pid} on this host) is gone; unchanged "
                                    f"for {idle:.0f} s")
    who = "owner unknown" if owner is None else f"written by pid {owner['pid']}@{owner['host']}"
    return idle >= stale_s, f"{who}; unchanged for {idle:.0f} s (stale after {stale_s:.0f} s)"


def find_leftovers(root: str, *, idle_s: float = IDLE_S, stale_s: float = STALE_S,
                   now: float | None = None) -> list[Leftover]:
    """The hidden leftovers right under the local directory ``root`` (none for a missing
    root), each judged abandoned or not (module docstring)."""
    now = time.time() if now is None else now
    out: list[Leftover] = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        m = _HIDDEN.match(e.name)
        if m is None or not e.is_dir(follow_symlinks=False):
            continue
        try:
            idle = _idle_s(e.path, now)
        except FileNotFoundError:    # removed meanwhile
            continue
        abandoned, why = _judge(root, m["kind"], m["name"], m["rest"], idle, idle_s, stale_s)
        out.append(Leftover(e.path, m["kind"], m["name"], idle, abandoned, why))
    return out


def _size(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                continue
    return total


def sweep_abandoned(root: str, *, idle_s: float = IDLE_S, stale_s: float = STALE_S,
                    dry_run: bool = False) -> list[Leftover]:
    """Remove the abandoned leftovers under the local directory ``root`` (module
    docstring); returns those removed (with ``dry_run``, those it would remove). Blocking;
    a leftover that cannot be removed is logged and left. A remote root is not swept."""
    if "://" in root and not root.startswith("file://"):
        return []
    root = root.removeprefix("file://")
    removed = []
    for lo in find_leftovers(root, idle_s=idle_s, stale_s=stale_s):
        if not lo.abandoned:
            continue
        if not dry_run:
            size = _size(lo.path)
            try:
                shutil.rmtree(lo.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("checkpoint leftovers: could not remove %s: %s", lo.path, e)
                continue
            log.info("checkpoint leftovers: removed %s (%.1f MiB; %s)", lo.path,
                     size / 2**20, lo.why)
        removed.append(lo)
    return removed
