"""Incremental checkpoints and crashes: every role is a process, killed with SIGKILL.

An embedding server runs as a process of its own (``stream-persia embedding-server``,
small capacity: rows are evicted between checkpoints); the checkpoint writer is another
process (the script below, as NN rank 0 would be) that trains through the server, writes
a base and then patches, and after each one a full checkpoint of the same moment (the
truth). The writer is killed with SIGKILL while a patch is being written (its shard files
on disk, no manifest yet): the unfinished patch is invisible, and the chain before it
restores to exactly its truth (every row, its optimizer state; evicted ids stay evicted).
The server is then killed between two patches and restarted: the next checkpoint the
writer takes on the old chain is a full base that says why, and the old chain still
restores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from stream_persia.checkpoint import list_checkpoints, load_embeddings, read_manifest
from stream_persia.core import aio
from stream_persia.errors import BadInput
from stream_persia.rpc import RpcClient
from stream_persia.testing.roles import start_server
from stream_persia.testing.servers import dumped_rows

ROOT = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent('''
    import asyncio, sys
    import numpy as np
    from stream_persia.checkpoint import CheckpointWriter, read_manifest
    from stream_persia.worker.router import ShardRouter
    from stream_persia.worker.shards import RowLookup, UpdateGroup

    address, root, truth, first, count, hang, parent = sys.argv[1:8]

    async def main():
        router = ShardRouter([address], timeout_ms=10000)
        rng = np.random.default_rng(int(first))
        prev = None if parent == "-" else read_manifest(f"{root}/{parent}")
        for k in range(int(first), int(first) + int(count)):
            ids = np.unique(rng.choice(2000, size=200, replace=False)).astype(np.uint64)
            await router.lookup([RowLookup(8, ids)], "train")
            await router.update([UpdateGroup(8, ids, rng.normal(size=(ids.size, 8))
                                             .astype(np.float32))])
            name = f"ck-{k}"
            with CheckpointWriter(f"{root}/{name}") as w:
                await w.dump_embeddings(router.clients, parent=prev)
                if str(k) == hang:
                    print("dumped", name, flush=True)
                    await asyncio.sleep(600)
                prev = w.commit(job="j", step=k, offsets={}, stream="direct")
            with CheckpointWriter(f"{truth}/{name}") as w:
                await w.dump_embeddings(router.clients)
                w.commit(job="j", step=k, offsets={}, stream="direct")
            print("committed", name, prev.chain["depth"], prev.chain["full_because"],
                  flush=True)
        await router.close()

    asyncio.run(main())
''')


def writer(tmp: Path, address: str, first: int, count: int, hang: int | None = None,
           parent: str = "-") -> subprocess.Popen:
    script = tmp / "writer.py"
    script.write_text(WRITER)
    return subprocess.Popen(
        [sys.executable, str(script), address, str(tmp / "ck"), str(tmp / "truth"),
         str(first), str(count), str(hang if hang is not None else -1), parent],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def restore_and_read(address: str, src: Path, tmp: Path, tag: str) -> dict:
    async def load() -> None:
        async with RpcClient(address) as c:
            await load_embeddings(str(src), [c], verify_checksums=True)

    aio.run(load())
    return dumped_rows(address, str(tmp / "reads" / tag))


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, (w, s) in want.items():
        np.testing.assert_allclose(got[key][0], w, atol=1e-6, rtol=0)
        np.testing.assert_allclose(got[key][1], s, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_a_writer_killed_during_a_patch_and_a_server_killed_between_patches(tmp_path):
    args = ["--capacity", "300"]
    server = start_server(tmp_path, "server", args=args)
    w: subprocess.Popen | None = None
    try:
        address = server.wait_ready(60)
        w = writer(tmp_path, address, 0, 4, hang=3)
        lines = []
        for line in w.stdout:   # ck-0 (base), ck-1, ck-2 (patches), then ck-3 hangs
            lines.append(line.split())
            if line.startswith("dumped"):
                break
        assert [ln[:3] for ln in lines] == [["committed", "ck-0", "0"], ["committed", "ck-1", "1"],
                                            ["committed", "ck-2", "2"], ["dumped", "ck-3"]], \
            (lines, w.stderr.read() if w.poll() is not None else "")
        staging = [n for n in os.listdir(tmp_path / "ck") if n.startswith(".ck-3.staging")]
        assert staging and any("patch" in f for f in os.listdir(tmp_path / "ck" / staging[0]))
        os.kill(w.pid, signal.SIGKILL)
        w.wait(10)

        assert [Path(m.path or "").name for m in list_checkpoints(str(tmp_path / "ck"))] == \
            ["ck-0", "ck-1", "ck-2"]
        with pytest.raises(BadInput, match="incomplete"):
            read_manifest(str(tmp_path / "ck" / "ck-3"))
        truth = restore_and_read(address, tmp_path / "truth" / "ck-2", tmp_path, "t2")
        evicted = set(restore_and_read(address, tmp_path / "truth" / "ck-0", tmp_path, "t0")) \
            - set(truth)
        assert evicted, "rows must be evicted between the base and the patch"
        assert_same(restore_and_read(address, tmp_path / "ck" / "ck-2", tmp_path, "p2"), truth)

        server.kill()   # SIGKILL between two patches; a supervisor restarts it
        server = start_server(tmp_path, "server2", port=address.rsplit(":", 1)[1], args=args)
        address = server.wait_ready(60)
        w = writer(tmp_path, address, 4, 2, parent="ck-2")
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        assert [ln.split()[:3] for ln in out.splitlines()] == [
            ["committed", "ck-4", "0"], ["committed", "ck-5", "1"]]
        assert "restarted" in read_manifest(str(tmp_path / "ck" / "ck-4")).chain["full_because"]
        assert_same(restore_and_read(address, tmp_path / "ck" / "ck-5", tmp_path, "p5"),
                    restore_and_read(address, tmp_path / "truth" / "ck-5", tmp_path, "t5"))
        assert_same(restore_and_read(address, tmp_path / "ck" / "ck-2", tmp_path, "p2b"), truth)
    finally:
        if w is not None and w.poll() is None:
            w.kill()
            w.wait(10)
        server.stop()
