"""Embedding server role: one shard of every embedding table (PERSIA's embedding PS).

Ids are routed to shards by ``sharding.shard_of(id, replica_size)``; this process holds the
ids whose shard is its ``replica_index`` in an :class:`EmbeddingStore` and applies the
embedding optimizer in place. It is a thin asyncio layer around the store: every store
call runs on one dedicated thread (the Cython store releases the GIL), which both keeps
the event loop free to read frames and serialises access to the store.

RPC methods (params → result):

- ``health`` → ``{"ok", "role", "replica_index", "replica_size", "rows", "implementation"}``
- ``lookup {"mode": "train"|"eval"|"infer", "groups": [{"dim", "ids"}]}`` →
  ``{"rows": [float32 (n, dim)], "missing": int}`` (one entry per group, in order;
  ``missing`` counts ids absent from the store; eval/infer never insert or refresh). A
  group with ``"index"`` (int32) and ``"offsets"`` (int64) is a pooled lookup
  (:mod:`stream_persia.segments`): its entry is the ``(len(offsets) - 1, dim)`` segment
  sums of the rows instead of the rows.
- ``update {"groups": [{"dim", "ids", "grads"}]}`` → ``{"applied": int, "dropped": int}``
- ``size`` → int, ``clear`` → None, ``stats`` → dict
- ``configure {"optimizer": dict | None, "embedding_config": dict | None}`` → None
- ``dump {"dir": url}`` → ``{"file", "rows", "bytes", "sha256"}`` — the shard as one file
- ``load {"dir": url, "files": [...]}`` → ``{"rows": int}`` — reads every listed shard
  file and keeps the rows this shard owns, so a checkpoint written by S servers loads
  into S' servers.

Shard file format (``embedding-shard-<i>-of-<n>.bin``): a sequence of records, each a
4-byte big-endian length followed by a ``wire.pack``-ed store chunk (see
``EmbeddingStore.dump``), oldest rows first so loading reproduces LRU order.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from stream_persia import segments, wire
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding import optim as optim_mod
from stream_persia.embedding.store import IMPLEMENTATION, EmbeddingStore
from stream_persia.errors import BadInput
from stream_persia.metrics import RoleMetrics
from stream_persia.rpc import RpcServer
from stream_persia.sharding import shard_of

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MODES = ("train", "eval", "infer")


def shard_file_name(replica_index: int, replica_size: int) -> str:
    return f"embedding-shard-{replica_index:05d}-of-{replica_size:05d}.bin"


def _require(params: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(params, dict) or key not in params:
        raise BadInput(f"request is missing {key!r}", field=key)
    value = params[key]
    if not isinstance(value, kind):
        raise BadInput(f"{key!r} has type {type(value).__name__}", field=key,
                       hint=f"expected {kind}")
    return value


def _ids(group: dict, where: str) -> np.ndarray:
    ids = group.get("ids") if isinstance(group, dict) else None
    if not (isinstance(ids, np.ndarray) and ids.dtype == np.uint64 and ids.ndim == 1):
        raise BadInput(f"{where}.ids must be a 1-D uint64 array, got {type(ids).__name__}"
                       f"{'' if not isinstance(ids, np.ndarray) else f' {ids.dtype} {ids.shape}'}",
                       field=f"{where}.ids")
    return ids


def _dim(group: dict, where: str) -> int:
    dim = group.get("dim") if isinstance(group, dict) else None
    if not isinstance(dim, int) or isinstance(dim, bool) or not (0 < dim <= 65536):
        raise BadInput(f"{where}.dim must be an int in [1, 65536], got {dim!r}",
                       field=f"{where}.dim")
    return dim


def _lookup_group(group: Any, where: str
                  ) -> tuple[int, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """(dim, ids, (index, offsets) of a pooled lookup or None), validated."""
    dim, ids = _dim(group, where), _ids(group, where)
    if "index" not in group and "offsets" not in group:
        return dim, ids, None
    index, offsets = group.get("index"), group.get("offsets")
    segments.check_pooled(len(ids), index, offsets, where)
    return dim, ids, (index, offsets)


class EmbeddingServer:
    """One embedding shard served over RPC.

    Args:
        capacity: most embedding vectors this shard holds (LRU eviction beyond it).
        optimizer: embedding optimizer applied in place on update.
        embedding_config: initialisation, admission and weight bound.
        replica_index / replica_size: which shard of how many this is.
    """

    def __init__(self, capacity: int, optimizer: Any = None,
                 embedding_config: EmbeddingConfig | None = None, *, replica_index: int = 0,
                 replica_size: int = 1, host: str = "127.0.0.1", port: int = 0):
        if not (0 <= replica_index < replica_size):
            raise BadInput(f"replica_index {replica_index} is not in [0, {replica_size})",
                           field="replica_index")
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.store = EmbeddingStore(capacity, optimizer or optim_mod.Adagrad(),
                                    embedding_config or EmbeddingConfig())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"store-{replica_index}")
        self.metrics = RoleMetrics("embedding_server", replica_index)
        self.metrics.add_callback("store", self._store_stats)
        self._req = self.metrics.counter("requests_total", "RPC requests", ("method",))
        self.rpc = RpcServer({
            "health": self._health, "lookup": self._lookup, "update": self._update,
            "size": self._size, "clear": self._clear, "stats": self._stats,
            "configure": self._configure, "dump": self._dump, "load": self._load,
            "metrics": self._metrics,
        }, host=host, port=port, name=f"embedding-server-{replica_index}")

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.rpc.start()
        log.info("embedding server %d/%d listening on %s (store: %s)", self.replica_index,
                 self.replica_size, self.rpc.address, IMPLEMENTATION)

    async def stop(self) -> None:
        await self.rpc.stop()
        self._pool.shutdown(wait=True)

    @property
    def address(self) -> str:
        return self.rpc.address

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _store_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.store.stats().items()}

    # ----------------------------------------------------------------- handlers
    async def _health(self, params: Any) -> dict:
        self._req.labels("health").inc()
        return {"ok": True, "role": "embedding-server", "replica_index": self.replica_index,
                "replica_size": self.replica_size, "rows": len(self.store),
                "implementation": IMPLEMENTATION}

    async def _lookup(self, params: Any) -> dict:
        self._req.labels("lookup").inc()
        mode = _require(params, "mode", str)
        if mode not in MODES:
            raise BadInput(f"mode must be one of {MODES}, got {mode!r}", field="mode")
        groups = _require(params, "groups", list)
        checked = [_lookup_group(g, f"groups[{i}]") for i, g in enumerate(groups)]
        train = mode == "train"

        def run() -> dict:
            rows, missing = [], 0
            for dim, ids, pooled in checked:
                if not train:
                    missing += int(ids.size - np.count_nonzero(self.store.contains(ids)))
                found = self.store.lookup(ids, dim, train)
                rows.append(found if pooled is None else segments.pool(found, *pooled))
            return {"rows": rows, "missing": missing}

        return await self._run(run)

    async def _update(self, params: Any) -> dict:
        self._req.labels("update").inc()
        groups = _require(params, "groups", list)
        checked = []
        for i, g in enumerate(groups):
            where = f"groups[{i}]"
            dim, ids = _dim(g, where), _ids(g, where)
            grads = g.get("grads")
            if not (isinstance(grads, np.ndarray) and grads.dtype == np.float32
                    and grads.shape == (ids.size, dim)):
                raise BadInput(f"{where}.grads must be float32 of shape {(ids.size, dim)}, got "
                               f"{getattr(grads, 'dtype', type(grads).__name__)} "
                               f"{getattr(grads, 'shape', '')}", field=f"{where}.grads")
            checked.append((ids, grads))

        def run() -> dict:
            before = self.store.stats()["dropped_updates"]
            for ids, grads in checked:
                self.store.update(ids, grads)
            dropped = self.store.stats()["dropped_updates"] - before
            return {"applied": sum(int(ids.size) for ids, _ in checked) - dropped,
                    "dropped": dropped}

        return await self._run(run)

    async def _size(self, params: Any) -> int:
        return len(self.store)

    async def _clear(self, params: Any) -> None:
        self._req.labels("clear").inc()
        await self._run(self.store.clear)

    async def _stats(self, params: Any) -> dict:
        return self.store.stats()

    async def _metrics(self, params: Any) -> bytes:
        return self.metrics.render()

    async def _configure(self, params: Any) -> None:
        self._req.labels("configure").inc()
        if not isinstance(params, dict):
            raise BadInput("configure takes a map", field="params")
        unknown = set(params) - {"optimizer", "embedding_config"}
        if unknown:
            raise BadInput(f"unknown configure field(s) {sorted(unknown)}",
                           field=sorted(unknown)[0], hint="optimizer, embedding_config")
        opt = params.get("optimizer")
        cfg = params.get("embedding_config")
        optimizer = optim_mod.optimizer_from_dict(opt) if opt is not None else None
        emb_cfg = EmbeddingConfig.from_dict(cfg) if cfg is not None else None
        await self._run(lambda: self.store.configure(optimizer=optimizer,
                                                     embedding_config=emb_cfg))

    # ----------------------------------------------------------------- checkpoints
    async def _dump(self, params: Any) -> dict:
        self._req.labels("dump").inc()
        directory = _require(params, "dir", str)
        name = shard_file_name(self.replica_index, self.replica_size)
        return await self._run(write_shard_file, self.store.dump(), directory, name)

    async def _load(self, params: Any) -> dict:
        self._req.labels("load").inc()
        directory = _require(params, "dir", str)
        files = _require(params, "files", list)
        if not all(isinstance(f, str) for f in files):
            raise BadInput("files must be a list of shard file names", field="files")

        def run() -> dict:
            self.store.clear()
            kept = 0
            for f in files:
                for chunk in read_shard_file(directory, f):
                    chunk = _owned_rows(chunk, self.replica_index, self.replica_size)
                    if len(chunk["ids"]):
                        self.store.load([chunk])
                        kept += len(chunk["ids"])
            return {"rows": kept}

        return await self._run(run)


def _owned_rows(chunk: dict, replica_index: int, replica_size: int) -> dict:
    ids = chunk["ids"]
    keep = shard_of(ids, replica_size) == replica_index
    if keep.all():
        return chunk
    n = ids.shape[0]
    return {k: (v[keep] if isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == n
                else v) for k, v in chunk.items()}


def write_shard_file(chunks: Iterator[dict], directory: str, name: str) -> dict:
    """Stream store chunks into ``directory/name`` atomically (temp file + rename)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    final = f"{root.rstrip('/')}/{name}"
    tmp = f"{final}.tmp"
    digest = hashlib.sha256()
    rows = size = 0
    with fs.open(tmp, "wb") as f:
        for chunk in chunks:
            body = wire.pack(chunk)
            head = _LEN.pack(len(body))
            for part in (head, body):
                f.write(part)
                digest.update(part)
            rows += len(chunk["ids"])
            size += len(head) + len(body)
    fs.mv(tmp, final)
    return {"file": name, "rows": rows, "bytes": size, "sha256": digest.hexdigest()}


def read_shard_file(directory: str, name: str) -> Iterator[dict]:
    """Yield the chunks of one shard file (limits of the wire format apply per chunk)."""
    import fsspec

    if "/" in name or name.startswith("."):
        raise BadInput(f"shard file name {name!r} must be a plain file name", field="files")
    fs, root = fsspec.core.url_to_fs(directory)
    path = f"{root.rstrip('/')}/{name}"
    if not fs.exists(path):
        raise BadInput(f"shard file {path} does not exist", field="files")
    with _open_for_read(fs, path) as f:
        while True:
            head = f.read(_LEN.size)
            if not head:
                return
            if len(head) != _LEN.size:
                raise BadInput(f"shard file {path} is truncated", field="files")
            (n,) = _LEN.unpack(head)
            if n > wire.DEFAULT_LIMITS.max_frame_bytes:
                raise BadInput(f"shard file {path} has a record of {n} bytes", field="files")
            body = f.read(n)
            if len(body) != n:
                raise BadInput(f"shard file {path} is truncated", field="files")
            chunk = wire.unpack(body)
            if not isinstance(chunk, dict) or not isinstance(chunk.get("ids"), np.ndarray):
                raise BadInput(f"shard file {path} holds a record that is not a store chunk",
                               field="files")
            yield chunk


def _open_for_read(fs: Any, path: str) -> Any:
    # fsspec's memory filesystem hands every opener the same file object (one shared
    # position), so servers of one process loading the same shard concurrently would
    # interleave their reads; its bytes are in memory already, so read a private copy.
    if "memory" in fs.protocol:
        return io.BytesIO(fs.cat_file(path))
    return fs.open(path, "rb")
