"""Helpers shared by the checkpoint writer and readers: locations, hashing, server sets."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from stream_persia.errors import BadInput, Misuse

#: Read size when hashing files.
HASH_BLOCK_BYTES = 1 << 20
#: Dumping or loading a big shard takes far longer than an ordinary RPC.
DEFAULT_SHARD_TIMEOUT_MS = 30 * 60 * 1000


class Location:
    """A directory on a local or fsspec filesystem (``/ckpt/step-10``, ``s3://b/ckpt``).

    Args:
        url: a local path (relative paths are made absolute, since embedding servers may
            run in another working directory) or an fsspec URL.
    """

    def __init__(self, url: str):
        if not isinstance(url, str) or not url:
            raise BadInput(f"a checkpoint location must be a non-empty path or URL, got "
                           f"{url!r}", field="path")
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.fs, path = fsspec.core.url_to_fs(url)
        self.path = path.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    @property
    def url(self) -> str:
        """The form handed to other processes (embedding servers) and shown to users."""
        return self.path if self.local else self.fs.unstrip_protocol(self.path)

    def join(self, name: str) -> str:
        return f"{self.path}/{name}"

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


class HashingWriter:
    """A write-only file wrapper that hashes and counts what goes through it."""

    def __init__(self, f: Any):
        self._f = f
        self.digest = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.bytes += view.nbytes
        self._f.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def sha256_file(fs: Any, path: str) -> tuple[str, int]:
    """(hex sha256, size in bytes) of one file, read in blocks."""
    digest = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while True:
            block = f.read(HASH_BLOCK_BYTES)
            if not block:
                return digest.hexdigest(), size
            digest.update(block)
            size += len(block)


async def check_server_set(clients: Sequence[Any], timeout_ms: float) -> None:
    """Every embedding server of one job, in replica order (client i is replica i of n).

    A shard file is named by its replica index, so a duplicated or missing server would
    silently lose rows; a wrong order would break routing. Both are refused here.
    """
    if not clients:
        raise Misuse("no embedding servers given", hint="pass one RpcClient per server, "
                     "in replica-index order (e.g. ShardRouter(...).clients)")
    health = await asyncio.gather(*(c.call("health", None, timeout_ms=timeout_ms)
                                    for c in clients))
    for i, h in enumerate(health):
        check_replica(h, i, len(clients))


def check_replica(health: dict, i: int, n: int) -> None:
    """The server that answered ``health`` is replica ``i`` of ``n``; Misuse otherwise."""
    if health.get("replica_index") != i or health.get("replica_size") != n:
        raise Misuse(f"server #{i} in the list reports replica {health.get('replica_index')} "
                     f"of {health.get('replica_size')}, expected replica {i} of {n}",
                     hint="pass every embedding server of the job, in replica-index order")
