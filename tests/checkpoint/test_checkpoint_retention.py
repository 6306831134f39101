"""Retention over a checkpoint root: the newest complete checkpoints are kept (by creation
time, so a job restored to an older step and checkpointed again keeps its new ones),
protected ones are never deleted, and what is not a complete checkpoint (a directory being
written, a hidden one, a symbolic link) is neither counted nor touched."""

from __future__ import annotations

import json
import os

from stream_persia.checkpoint import CheckpointWriter, list_checkpoints, prune_checkpoints
from stream_persia.checkpoint.retention import delete_checkpoint


def checkpoint(root: str, name: str, step: int, created: str) -> None:
    with CheckpointWriter(f"{root}/{name}") as w:
        w.write_bytes("dense.pt", b"x" * 10)
        w.commit(job="j", step=step, offsets={}, stream="direct")
    path = f"{root}/{name}/manifest.json"
    m = json.load(open(path))
    m["created_at"] = created   # the manifest carries no checksum of itself
    json.dump(m, open(path, "w"))


def test_prune_keeps_the_newest_and_what_is_protected(tmp_path):
    root = str(tmp_path)
    # step 300, then a restore to step 100 and checkpoints at 120 and 150 after it
    checkpoint(root, "a", 300, "2024-01-01T00:00:00Z")
    checkpoint(root, "b", 100, "2024-01-02T00:00:00Z")
    checkpoint(root, "c", 120, "2024-01-03T00:00:00Z")
    checkpoint(root, "d", 150, "2024-01-04T00:00:00Z")
    os.makedirs(f"{root}/partial")                       # no manifest: being written
    os.makedirs(f"{root}/.d.staging-x")
    os.symlink(f"{root}/a", f"{root}/link")
    assert prune_checkpoints(root, 2, protect={"b"}) == ["a"]
    assert sorted(os.listdir(root)) == [".d.staging-x", "b", "c", "d", "link", "partial"]
    assert prune_checkpoints(root, 2) == ["b"]
    assert prune_checkpoints(root, 2) == []
    assert prune_checkpoints(root, 0) == []             # 0 keeps every one
    assert [os.path.basename(m.path) for m in list_checkpoints(root)] == ["c", "d"]


def test_delete_never_leaves_a_half_checkpoint_visible(tmp_path):
    root = str(tmp_path)
    checkpoint(root, "a", 1, "2024-01-01T00:00:00Z")
    delete_checkpoint(f"{root}/a")
    assert os.listdir(root) == []
    assert list_checkpoints(root) == []
