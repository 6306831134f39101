"""Checkpoint-root confinement (stream_persia/checkpoint/root.py): pure path logic."""

from __future__ import annotations

import os

import pytest

from stream_persia.checkpoint.root import CheckpointRoot, require_root
from stream_persia.errors import BadInput, ConfigError, Misuse


def test_a_local_root_accepts_itself_and_what_lies_below(tmp_path):
    root = CheckpointRoot(str(tmp_path / "ck"))
    assert root.confine(str(tmp_path / "ck"), "dir") == str(tmp_path / "ck")
    assert root.confine(str(tmp_path / "ck" / "a" / "b"), "dir") == str(tmp_path / "ck/a/b")
    assert root.confine(f"file://{tmp_path}/ck/a", "dir") == str(tmp_path / "ck/a")
    assert root.confine(f"{tmp_path}/ck/a/../b", "dir") == str(tmp_path / "ck/b")


def test_relative_paths_are_resolved_against_the_working_directory(tmp_path, monkeypatch):
    """As the Procfile job spells them (its roles share the repository root): what the
    role uses, and hands on, is the absolute path."""
    monkeypatch.chdir(tmp_path)
    root = CheckpointRoot("runs/ck")
    assert root.url == str(tmp_path / "runs/ck")
    assert root.confine(str(tmp_path / "runs/ck/1"), "dst") == str(tmp_path / "runs/ck/1")
    assert root.confine("runs/ck/2", "dst") == str(tmp_path / "runs/ck/2")
    with pytest.raises(BadInput):
        root.confine("runs/ck/../elsewhere", "dst")


@pytest.mark.parametrize("make", [
    lambda t: str(t / "elsewhere"),
    lambda t: f"{t}/ck/../elsewhere",
    lambda t: f"{t}/ck2",                        # a sibling sharing the prefix
    lambda t: "/etc",
    lambda t: f"file://{t}/elsewhere",
    lambda t: "ck/1",                            # relative: below the working directory
    lambda t: f"simplecache::{t}/ck/1",
    lambda t: f"memory://{t}/ck/1",
    lambda t: "http://127.0.0.1:9/ck",
    lambda t: "webhdfs://127.0.0.1:9/ck",
    lambda t: "s3://bucket/ck",
    lambda t: "",
    lambda t: 5,
])
def test_a_local_root_refuses_everything_else_naming_the_field(tmp_path, make):
    root = CheckpointRoot(str(tmp_path / "ck"))
    with pytest.raises(BadInput) as e:
        root.confine(make(tmp_path), "dst")
    assert e.value.field == "dst"


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "ck" / "link")
    root = CheckpointRoot(str(tmp_path / "ck"))
    for path in (tmp_path / "ck" / "link", tmp_path / "ck" / "link" / "x"):
        with pytest.raises(BadInput, match="not under the checkpoint root"):
            root.confine(str(path), "dir")


def test_a_root_reached_through_a_symlink_accepts_both_spellings(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    root = CheckpointRoot(str(tmp_path / "alias"))
    assert root.confine(str(tmp_path / "real" / "1"), "dir") == str(tmp_path / "real" / "1")
    assert root.confine(str(tmp_path / "alias" / "1"), "dir") == str(tmp_path / "real" / "1")


def test_an_fsspec_root_accepts_its_protocol_under_its_prefix_only():
    root = CheckpointRoot("s3://bucket/jobs/ctr")
    assert root.url == "s3://bucket/jobs/ctr"
    assert root.confine("s3://bucket/jobs/ctr/step-1", "dir") == "s3://bucket/jobs/ctr/step-1"
    assert root.confine("s3://bucket/jobs/ctr", "dir") == "s3://bucket/jobs/ctr"
    for bad in ("s3://bucket/jobs/ctr2", "s3://bucket/jobs", "s3://other/jobs/ctr/1",
                "s3://bucket/jobs/ctr/../x", "s3://bucket/jobs/ctr/./1", "gcs://bucket/jobs/ctr",
                "/bucket/jobs/ctr", "simplecache::s3://bucket/jobs/ctr/1"):
        with pytest.raises(BadInput) as e:
            root.confine(bad, "dir")
        assert e.value.field == "dir", bad


def test_a_whole_memory_filesystem_root():
    root = CheckpointRoot("memory://")
    assert root.confine("memory://ck-1/step", "dir") == "memory://ck-1/step"
    with pytest.raises(BadInput):
        root.confine("/tmp/x", "dir")


@pytest.mark.parametrize("bad", ["", "  ", "simplecache::s3://b/x", "s3://b/../x"])
def test_bad_roots_are_config_errors(bad):
    with pytest.raises(ConfigError) as e:
        CheckpointRoot(bad)
    assert e.value.field == "checkpoint_root"


def test_no_root_refuses_with_the_setting_named():
    with pytest.raises(Misuse, match="no checkpoint root") as e:
        require_root(None, "embedding server 0")
    assert e.value.field == "checkpoint_root" and "PERSIA_CHECKPOINT_ROOT" in str(e.value)
