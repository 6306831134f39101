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
- ``size`` → int, ``clear`` → None
- ``stats`` → ``{"rows", "capacity", "lookups", "misses", "admissions", "evictions",
  "updates", "dropped_updates", "loads"}``: the store's levels (``rows``, ``capacity``) and
  this server's counters (:data:`COUNTERS`, continuous across loads; ``loads`` counts the
  successful ``load`` requests); the metrics export each as the gauge
  ``persia_embedding_server_store_<key>``
- ``configure {"optimizer": dict | None, "embedding_config": dict | None}`` → None
- ``dump {"dir": url}`` → ``{"file", "rows", "bytes", "sha256"}`` — the shard as one file
- ``load {"dir": url, "files": [...], "expected"?: {file: {"sha256"?, "bytes"?, "rows"?}}}``
  → ``{"rows": int}`` — replaces the shard's rows with the rows it owns in every listed
  shard file, so a checkpoint written by S servers loads into S' servers; all or nothing.
  ``expected``, when given, has an entry for every listed file (the manifest's ``files``
  entry: hex sha256, size in bytes, rows in the file) and nothing else.

The shard file format and the all-or-nothing load procedure (its checks, errors and
memory peak) are described in :mod:`stream_persia.shard_files`.

A successful load swaps in a new store, whose own counters and admission draws start
from zero; the counters the server reports (``stats``, the metrics) go on from where they
were, so they never drop: the old store's counts are carried over. They describe the
serving traffic (lookups and updates), so what the load itself counts (the evictions of a
checkpoint larger than the capacity) is left out; ``loads`` says that the rows changed.
``rows`` is a level and is the loaded table's. A failed load changes no counter.
Every handler must reach the store as ``self.store`` on the store thread, never through a
reference taken before its turn on that thread: a load queued ahead of it swaps the store.
"""

from __future__ import annotations

import asyncio
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from stream_persia import segments
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding import optim as optim_mod
from stream_persia.embedding.store import IMPLEMENTATION, EmbeddingStore
from stream_persia.errors import BadInput
from stream_persia.metrics import RoleMetrics
from stream_persia.rpc import RpcServer
from stream_persia.shard_files import (
    is_plain_file_name,
    shard_file_name,
    stage_shard_files,
    write_shard_file,
)

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_EXPECTED_KEYS = ("sha256", "bytes", "rows")
MODES = ("train", "eval", "infer")
#: The store statistics that only grow; the others (``rows``, ``capacity``) are levels.
COUNTERS = ("lookups", "misses", "admissions", "evictions", "updates", "dropped_updates")


class _Serving(NamedTuple):
    """The store in force with what its counters are reported with, swapped as one."""

    store: Any
    carried: dict[str, int]   # added to the store's own counters (see _load; may be < 0)
    loads: int                # successful loads so far


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
    # The store checks again (~35 us a batch); checking here too refuses a bad group before
    # an earlier group of the same request has touched the store.
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
        self._serving = _Serving(EmbeddingStore(capacity, optimizer or optim_mod.Adagrad(),
                                                embedding_config or EmbeddingConfig()),
                                 dict.fromkeys(COUNTERS, 0), 0)
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

    @property
    def store(self) -> Any:
        """The EmbeddingStore in force (a successful load replaces it)."""
        return self._serving.store

    def store_stats(self) -> dict[str, int]:
        """The store's statistics with this server's counters (see the module docstring):
        ``rows`` and ``capacity`` of the store in force, every counter continuous across
        loads, and ``loads``."""
        serving = self._serving   # one read: a load swaps store and carried counts together
        stats = serving.store.stats()
        for key in COUNTERS:
            stats[key] += serving.carried[key]
        stats["loads"] = serving.loads
        return stats

    def _store_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.store_stats().items()}

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
                rows.append(self.store.lookup(ids, dim, train) if pooled is None
                            else self.store.lookup_pooled(ids, dim, *pooled, train))
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
        await self._run(lambda: self.store.clear())   # the store in force on its turn

    async def _stats(self, params: Any) -> dict:
        return self.store_stats()

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
        # dump() is called on the store thread: a load queued ahead of it swaps the store.
        return await self._run(
            lambda: write_shard_file(self.store.dump(), directory, name))

    async def _load(self, params: Any) -> dict:
        self._req.labels("load").inc()
        directory, files, expected = _load_params(params)

        def run() -> dict:
            serving = self._serving
            old = serving.store
            staging = EmbeddingStore(old.capacity, old.optimizer, old.embedding_config)
            kept = stage_shard_files(staging, directory, files, expected,
                                     self.replica_index, self.replica_size,
                                     held_rows=len(old))
            # The reported counters go on from the old store's; the staging store's own
            # counts so far are the load's, not traffic, and are subtracted.
            was, own = old.stats(), staging.stats()
            carried = {k: serving.carried[k] + was[k] - own[k] for k in COUNTERS}
            # The swap; the old table goes with its last reference.
            self._serving = _Serving(staging, carried, serving.loads + 1)
            return {"rows": kept}

        return await self._run(run)


def _load_params(params: Any) -> tuple[str, list[str], dict[str, dict[str, Any]]]:
    """(dir, files, expected: file → checks, {} when not given) of a load request."""
    directory = _require(params, "dir", str)
    files = _require(params, "files", list)
    unknown = sorted(map(str, set(params) - {"dir", "files", "expected"}))
    if unknown:
        raise BadInput(f"unknown load field(s) {unknown}", field=unknown[0],
                       hint="dir, files, expected")
    seen: set[str] = set()
    for i, name in enumerate(files):
        if not is_plain_file_name(name):
            raise BadInput(f"files[{i}] must be a plain shard file name, got {name!r}",
                           field=f"files[{i}]", hint="no '/', not starting with '.'")
        if name in seen:
            raise BadInput(f"files[{i}] {name!r} is listed twice", field=f"files[{i}]")
        seen.add(name)
    expected = params.get("expected")
    if expected is None:
        return directory, files, {}
    if not isinstance(expected, dict):
        raise BadInput(f"expected must map file name -> {{sha256, bytes, rows}}, got "
                       f"{type(expected).__name__}", field="expected")
    for name in expected:
        if name not in seen:
            raise BadInput(f"expected has an entry for {name!r}, which files does not list",
                           field=f"expected.{name}")
    for name in files:
        entry = expected.get(name)
        where = f"expected.{name}"
        if entry is None:
            raise BadInput(f"expected has no entry for {name!r}", field=where,
                           hint="give every listed file an entry, or leave expected out")
        if not isinstance(entry, dict) or not entry:
            raise BadInput(f"{where} must be a non-empty map with keys from "
                           f"{list(_EXPECTED_KEYS)}, got {entry!r}", field=where)
        for key, value in entry.items():
            if key not in _EXPECTED_KEYS:
                raise BadInput(f"{where} has unknown key {key!r}", field=f"{where}.{key}",
                               hint=", ".join(_EXPECTED_KEYS))
            if key == "sha256":
                ok = isinstance(value, str) and _SHA256.fullmatch(value) is not None
                accepted = "64 lowercase hex digits"
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
                accepted = "an int >= 0"
            if not ok:
                raise BadInput(f"{where}.{key} must be {accepted}, got {value!r}",
                               field=f"{where}.{key}")
    return directory, files, expected
