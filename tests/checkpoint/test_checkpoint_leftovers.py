"""What killed writers leave beside checkpoints is removed once abandoned, and never what a
live writer or a recovery still needs (stream_persia.checkpoint.leftovers)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from stream_persia.checkpoint import CheckpointWriter, list_checkpoints, prune_checkpoints
from stream_persia.checkpoint.leftovers import find_leftovers, staging_owner, sweep_abandoned
from stream_persia.launch import cli

WRITER = """
import sys, time
from stream_persia.checkpoint import CheckpointWriter
w = CheckpointWriter(sys.argv[1])
w.write_bytes("dense.pt", b"x" * 100_000)
print(w.staging, flush=True)
time.sleep(600)
"""


def age(path: str, seconds: float) -> None:
    """Make ``path`` and everything right in it look unchanged for ``seconds``."""
    t = time.time() - seconds
    for name in os.listdir(path):
        os.utime(os.path.join(path, name), (t, t))
    os.utime(path, (t, t))


def leftover(root, name: str, files: int = 1) -> str:
    path = os.path.join(root, name)
    os.makedirs(path)
    for i in range(files):
        with open(os.path.join(path, f"f{i}.bin"), "wb") as f:
            f.write(b"y" * 1000)
    return path


def checkpoint(root, name: str, step: int = 1) -> str:
    with CheckpointWriter(os.path.join(root, name)) as w:
        w.write_bytes("dense.pt", b"x" * 10)
        w.commit(job="j", step=step, offsets={}, stream="direct")
    return os.path.join(root, name)


def test_a_writer_killed_with_minus_9_leaves_staging_that_retention_removes(tmp_path):
    root = str(tmp_path)
    checkpoint(root, "a")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", WRITER, f"{root}/b"], stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        staging = p.stdout.readline().strip()
        assert os.path.isdir(staging) and f"staging-{p.pid}." in staging
        # while the writer lives its staging is kept, however old it looks (short of stale)
        age(staging, 3600)
        assert sweep_abandoned(root) == []
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert os.path.isdir(staging)
    # gone, but changed recently: kept for idle_s (hosts sharing a name cannot collide)
    os.utime(staging)
    [lo] = find_leftovers(root)
    assert (lo.kind, lo.checkpoint, lo.abandoned) == ("staging", "b", False)
    age(staging, 400)
    [lo] = find_leftovers(root)
    assert lo.abandoned and f"pid {p.pid} on this host) is gone" in lo.why
    assert prune_checkpoints(root, 3) == []     # retention sweeps after its pass
    assert sorted(os.listdir(root)) == ["a"]
    assert [os.path.basename(m.path or "") for m in list_checkpoints(root)] == ["a"]


def test_a_live_writer_in_this_process_keeps_its_staging_until_stale(tmp_path):
    root = str(tmp_path)
    with CheckpointWriter(f"{root}/c") as w:
        w.write_bytes("dense.pt", b"x")
        assert f".c.staging-{staging_owner()}-" in w.staging
        age(w.staging, 23 * 3600)
        assert sweep_abandoned(root) == []
        age(w.staging, 25 * 3600)    # a pid reused by a live process: stale after a day
        assert [lo.kind for lo in sweep_abandoned(root, dry_run=True)] == ["staging"]
        age(w.staging, 0)
        w.commit(job="j", step=1, offsets={}, stream="direct")
    assert sweep_abandoned(root) == []
    assert [os.path.basename(m.path or "") for m in list_checkpoints(root)] == ["c"]


def test_other_hosts_namespaces_and_older_writers_staging_goes_only_when_stale(tmp_path):
    root = str(tmp_path)
    pid, start, ns, host = re.match(r"(\d+)\.(\d+)\.(\d+)@(.+)$", staging_owner()).groups()
    fresh = leftover(root, ".a.staging-123.456.789@elsewhere-3k2j1x9q")
    stale = leftover(root, ".b.staging-456.1.2@elsewhere-abcdefgh")
    unowned = leftover(root, ".c.staging-qwertyui")   # named before owners were recorded
    # this host's name but another pid namespace (a container, a pod on the host's network):
    # its pid says nothing here, so only staleness counts
    other_ns = leftover(root, f".d.staging-999999.5.{int(ns) + 1}@{host}-aaaaaaaa")
    # this host and namespace, our pid but another start time: the pid was reused
    reused = leftover(root, f".e.staging-{pid}.{int(start) + 1}.{ns}@{host}-bbbbbbbb")
    ours = leftover(root, f".f.staging-{pid}.{start}.{ns}@{host}-cccccccc")
    age(fresh, 3600)
    for p in (stale, unowned):
        age(p, 2 * 24 * 3600)
    for p in (other_ns, reused, ours):
        age(p, 3600)
    removed = sweep_abandoned(root)
    assert sorted(os.path.basename(lo.path) for lo in removed) == [
        ".b.staging-456.1.2@elsewhere-abcdefgh", ".c.staging-qwertyui",
        os.path.basename(reused)]
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p)
                                              for p in (fresh, other_ns, ours))
    # stale goes for every owner (even a live one: its pid may have been reused)
    assert {os.path.basename(lo.path) for lo in sweep_abandoned(root, stale_s=1800)} == {
        os.path.basename(p) for p in (fresh, other_ns, ours)}
    assert os.listdir(root) == []


def test_a_complete_staging_whose_rename_never_came_is_kept_while_it_is_the_only_copy(
        tmp_path):
    root = str(tmp_path)
    made = {}
    for name in ("new", "replaced"):
        w = CheckpointWriter(f"{root}/{name}")
        w.write_bytes("dense.pt", b"x")
        made[name] = w
    # the writers' staging, complete (a manifest) but never renamed: a kill between the two
    for w in made.values():
        with open(os.path.join(w.staging, "manifest.json"), "w") as f:
            f.write("{}")
    checkpoint(root, "replaced")      # ... and "replaced" was written again since
    gone_owner = f"{2**22 + 7}.1.{os.stat('/proc/self/ns/pid').st_ino}@" + \
        staging_owner().split("@", 1)[1]
    for w in made.values():
        dead = w.staging.replace(staging_owner(), gone_owner)
        os.rename(w.staging, dead)
        age(dead, 10 * 24 * 3600)
    found = {lo.checkpoint: lo for lo in find_leftovers(root)}
    assert not found["new"].abandoned and "rename it to" in found["new"].why
    assert found["replaced"].abandoned
    assert [lo.checkpoint for lo in sweep_abandoned(root)] == ["replaced"]
    assert [lo.checkpoint for lo in find_leftovers(root)] == ["new"]


def test_a_replaced_checkpoint_goes_only_when_its_successor_is_complete(tmp_path):
    root = str(tmp_path)
    checkpoint(root, "done")
    replaced = leftover(root, ".done.old-0123abcd")
    orphan = leftover(root, ".lost.old-4567cdef")      # crash between the two renames
    deleting = leftover(root, ".gone.deleting-89ab0123", files=3)
    for p in (replaced, orphan, deleting):
        age(p, 10 * 24 * 3600)
    # a rename keeps modification times but sets the change time: just renamed aside (its
    # deleter may be removing it now), none of them is idle yet
    assert sweep_abandoned(root) == []
    later = time.time() + 600
    found = {os.path.basename(lo.path): lo for lo in find_leftovers(root, now=later)}
    assert not found[".lost.old-4567cdef"].abandoned
    assert "may be its only copy" in found[".lost.old-4567cdef"].why
    removed = sweep_abandoned(root, now=later)
    assert sorted(os.path.basename(lo.path) for lo in removed) == [
        ".done.old-0123abcd", ".gone.deleting-89ab0123"]
    assert sorted(os.listdir(root)) == [".lost.old-4567cdef", "done"]


def test_what_is_not_a_leftover_is_never_touched(tmp_path):
    root = str(tmp_path)
    target = leftover(root, "elsewhere")
    os.symlink(target, os.path.join(root, ".x.staging-link"))
    with open(os.path.join(root, ".y.staging-file"), "w") as f:
        f.write("a file, not a directory")
    other = leftover(root, ".hidden-but-not-ours")
    for p in (target, other):
        age(p, 10 * 24 * 3600)
    assert sweep_abandoned(root, idle_s=0, stale_s=0) == []
    assert sorted(os.listdir(root)) == [".hidden-but-not-ours", ".x.staging-link",
                                        ".y.staging-file", "elsewhere"]
    assert sweep_abandoned(str(tmp_path / "missing")) == []
    assert sweep_abandoned("memory://root") == []       # remote writers write in place
    gone = leftover(root, ".z.deleting-00000000")       # a file:// URL is a local root
    assert [lo.path for lo in sweep_abandoned(f"file://{root}", now=time.time() + 600)] == [gone]


def test_clean_command_lists_then_removes(tmp_path, capsys):
    root = str(tmp_path)
    checkpoint(root, "a")
    stale = leftover(root, ".a.staging-9.1.1@elsewhere-zzzzzzzz")
    age(stale, 2 * 24 * 3600)
    kept = leftover(root, ".b.old-11112222")
    age(kept, 10 * 24 * 3600)
    assert cli.main(["checkpoint", "clean", root, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove  staging   {stale}" in out
    assert f"kept          old       {kept}" in out and "may be its only copy" in out
    assert os.path.isdir(stale)
    assert cli.main(["checkpoint", "clean", root]) == 0
    assert f"removed       staging   {stale}" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == [".b.old-11112222", "a"]
    assert cli.main(["checkpoint", "clean", root]) == 0
    assert cli.main(["checkpoint", "clean", str(tmp_path / "none")]) == 0
    assert "no leftovers under" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["checkpoint", "clean", root, "--idle-s", "-1"])
    assert e.value.code == 2
    assert "--idle-s" in capsys.readouterr().err
    assert cli.main(["checkpoint", "clean", os.path.join(root, "a", "manifest.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["checkpoint", "clean", "memory://bucket/ckpt"]) == 2
    assert "not a local directory" in capsys.readouterr().err
