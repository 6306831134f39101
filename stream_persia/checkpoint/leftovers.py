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

- ``.staging-``: its owner (``<pid>.<start>.<pidns>@<host>`` in the name, written by
  this version's writer: the process id, its start time in clock ticks after boot and
  its pid namespace) is a process of this host and pid namespace that no longer runs (no
  process has that pid, or one started at another time has it), and nothing in it
  changed for ``idle_s`` (default 5 minutes). A staging directory of another host or pid
  namespace (another container, a pod with the host's network and name), or of an older
  writer, is abandoned once nothing in it changed for ``stale_s`` (default 24 hours).
  Never while it holds a manifest and the checkpoint it was to become is not complete: a
  writer killed between its manifest and its rename left the only complete copy there
  (:func:`~stream_persia.checkpoint.read_manifest` says to rename it into place);
- ``.old-``: the checkpoint it was renamed aside from is complete again (it has a
  manifest), and nothing in it changed for ``idle_s``. Without that checkpoint the
  ``.old-`` directory may be the only complete copy (a crash between the two renames of
  a replace: :func:`~stream_persia.checkpoint.read_manifest` says to rename it back), so
  it is kept;
- ``.deleting-``: nothing in it changed for ``idle_s`` (it was already out of readers'
  view; its deleter died).

"Changed" is the newest modification time of the directory and of the files right in it
(a server dumping a shard keeps its file's time fresh); for ``.old-`` and ``.deleting-``
also the directory's status change time, which the rename that made it sets (a rename
keeps modification times, so a checkpoint renamed aside a moment ago is not taken as
idle while its deleter still removes it). One entry that cannot be read is logged and
skipped; the others are swept. Remote roots (fsspec URLs) have no
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

from stream_persia.checkpoint._common import Location
from stream_persia.checkpoint.manifest import MANIFEST_NAME

__all__ = ["IDLE_S", "STALE_S", "Leftover", "find_leftovers", "rmtree_racing",
           "staging_owner", "sweep_abandoned"]

log = logging.getLogger(__name__)

#: Seconds without a change after which a leftover whose owner is known to be gone is removed.
IDLE_S = 300.0
#: Seconds without a change after which any staging directory is taken as abandoned.
STALE_S = 24 * 3600.0

_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>staging|old|deleting)-(?P<rest>.+)$")
_OWNER = re.compile(r"^(?P<pid>\d{1,10})\.(?P<start>\d{1,20})\.(?P<ns>\d{1,20})"
                    r"@(?P<host>[A-Za-z0-9.-]+)-")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"


def _start_ticks(pid: int | str) -> int | None:
    """When process ``pid`` started (clock ticks after boot; /proc), None without it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:   # the fields after the command (which may hold spaces) in parentheses
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def staging_owner() -> str:
    """``<pid>.<start>.<pidns>@<host>`` of this process, as the writer puts it in a
    staging directory's name (0 for what this platform does not tell)."""
    return f"{os.getpid()}.{_start_ticks('self') or 0}.{_pid_namespace()}@{_host()}"


@dataclass(frozen=True)
class Leftover:
    """A hidden directory under a checkpoint root (see the module docstring)."""
    path: str
    kind: str            # "staging", "old" or "deleting"
    checkpoint: str      # the name of the checkpoint it belongs to
    idle_s: float        # seconds since anything in it changed
    abandoned: bool
    why: str             # why it is (or is not) taken as abandoned


def _idle_s(path: str, now: float, renamed: bool) -> float:
    st = os.stat(path, follow_symlinks=False)
    newest = max(st.st_mtime, st.st_ctime) if renamed else st.st_mtime
    with os.scandir(path) as it:
        for e in it:
            try:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return max(0.0, now - newest)


def _owner_gone(owner: re.Match[str]) -> bool:
    """Whether the writer ``owner`` names is known to run no more: it ran on this host in
    this pid namespace, and its pid is free or taken by a process started at another time."""
    if owner["host"] != _host() or int(owner["ns"]) == 0 \
            or int(owner["ns"]) != _pid_namespace() or int(owner["start"]) == 0:
        return False
    started = _start_ticks(int(owner["pid"]))
    return started is None or started != int(owner["start"])


def _judge(root: str, kind: str, name: str, rest: str, path: str, idle: float,
           idle_s: float, stale_s: float) -> tuple[bool, str]:
    if kind == "deleting":
        return idle >= idle_s, f"a deletion left unfinished, unchanged for {idle:.0f} s"
    complete = os.path.isfile(os.path.join(root, name, MANIFEST_NAME))
    if kind == "old":
        if not complete:
            return False, f"kept: {name} is not complete, so this may be its only copy"
        return idle >= idle_s, f"{name} was replaced; unchanged for {idle:.0f} s"
    if not complete and os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return False, (f"kept: it is complete and {name} is not (its writer stopped before "
                       f"the rename): rename it to {os.path.join(root, name)}")
    owner = _OWNER.match(rest)
    if owner is not None and _owner_gone(owner):
        return idle >= idle_s, (f"its writer (pid {owner['pid']} on this host) is gone; "
                                f"unchanged for {idle:.0f} s")
    who = "owner unknown" if owner is None else \
        f"written by pid {owner['pid']} on {owner['host']}"
    return idle >= stale_s, f"{who}; unchanged for {idle:.0f} s (stale after {stale_s:.0f} s)"


def find_leftovers(root: str, *, idle_s: float = IDLE_S, stale_s: float = STALE_S,
                   now: float | None = None) -> list[Leftover]:
    """The hidden leftovers right under the local directory ``root`` (a path or a
    ``file://`` URL; none for a missing or remote root), each judged abandoned or not
    (module docstring)."""
    now = time.time() if now is None else now
    out: list[Leftover] = []
    loc = Location(root)
    if not loc.local:
        return out
    root = loc.path
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        m = _HIDDEN.match(e.name)
        try:
            if m is None or not e.is_dir(follow_symlinks=False):
                continue
            idle = _idle_s(e.path, now, renamed=m["kind"] != "staging")
            abandoned, why = _judge(root, m["kind"], m["name"], m["rest"], e.path, idle,
                                    idle_s, stale_s)
        except FileNotFoundError:    # removed meanwhile
            continue
        except (OSError, ValueError) as err:   # one unreadable entry stops no other
            log.warning("checkpoint leftovers: skipping %s: %s: %s", e.path,
                        type(err).__name__, err)
            continue
        out.append(Leftover(e.path, m["kind"], m["name"], idle, abandoned, why))
    return out


def rmtree_racing(path: str) -> None:
    """``shutil.rmtree`` that ignores what another remover took first (two sweeps, or a
    sweep and a deleter, on one directory); other errors raise."""
    def onerror(_func: object, _path: str, exc: tuple) -> None:
        if not isinstance(exc[1], FileNotFoundError):
            raise exc[1]

    shutil.rmtree(path, onerror=onerror)


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
                    dry_run: bool = False, now: float | None = None) -> list[Leftover]:
    """Remove the abandoned leftovers under the local directory ``root`` (module
    docstring); returns those removed (with ``dry_run``, those it would remove). Blocking;
    a leftover that cannot be removed is logged and left. A remote root is not swept."""
    removed = []
    for lo in find_leftovers(root, idle_s=idle_s, stale_s=stale_s, now=now):
        if not lo.abandoned:
            continue
        if not dry_run:
            size = _size(lo.path)
            try:
                rmtree_racing(lo.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("checkpoint leftovers: could not remove %s: %s", lo.path, e)
                continue
            log.info("checkpoint leftovers: removed %s (%.1f MiB; %s)", lo.path,
                     size / 2**20, lo.why)
        removed.append(lo)
    return removed
