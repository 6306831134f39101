"""An embedding store cut into internal shards that work on their own threads.

One :class:`~stream_persia.server.store.EmbeddingStore` runs a call on one core. An
embedding server with ``store_threads: k`` (``embedding_parameter_server_config``) holds a
:class:`ShardedStore` instead: ``k`` stores, each owning the ids whose
:func:`~stream_persia.kernels.segments.internal_owner` is its index. Every batched call is split
by owner, the parts run concurrently (the caller's thread takes part 0, a pool of
``k - 1`` threads the others; the Cython store releases the GIL), and the results are put
back in the caller's order. The owners are hashed once; each part is then cut out on its
own thread, so the split runs in parallel too. It has the store's interface, so the
server, its loads and its dumps use it unchanged. This is PERSIA's ``num_hashmap_internal_shards``
in function; that key sets lock striping in PERSIA and, at its default of 100, would be far
too many threads, so the thread count is a key of its own.

What differs from one store of the same total capacity:

- **Eviction is least recently used per internal shard.** Each shard holds
  ``capacity // k`` rows (the first ``capacity % k`` shards one more) and evicts its own
  oldest. Ids spread evenly over the shards, so this is LRU up to the shards' imbalance, as
  in PERSIA.
- **Pooled lookups add per-shard partial sums**, in shard order: equal to the sums of the
  rows up to float rounding, as with several servers
  (:func:`stream_persia.kernels.segments.split`).
- **Admission draws** (``admit_probability`` < 1) are counted per shard, so which ids a
  partial admission keeps differs from one store (as it does with another server count).
- **Errors after the checks**: every argument is checked before any shard runs, and a
  non-finite gradient is refused (naming its row) before any shard applies anything. An id
  stored with another dim is found by its shard only; the other shards may have applied
  their part of that call by then. (One store would have refused the whole update.)
- ``dump`` yields each shard's rows in turn, least recently used first within a shard;
  ``load`` routes every chunk's rows to their shards in order. Dumps of either kind load
  into either kind, at any ``k``. Each shard's frequency sketch goes with its rows
  (``sketch_part`` ``[s, k]``); a load at the same ``k`` gives each shard its own back,
  at another ``k`` every shard merges them all (``policies``: no count goes down).
- **Change tracking**: the sharded store keeps its own ``change_version``, counted by the
  rules of one store (``_pystore``'s docstring); before each mutating call it advances
  every shard to the version before the new one, so the shards stamp one version for one
  call and ``changed_since``/``evicted_since`` read as one store's would (rows of each
  shard in turn; evictions merged in order of version). The eviction log is split over the
  shards (``eviction_log // k`` entries each, at least 1), and ``complete`` is False when
  any shard's log no longer covers ``since``.
- **Table policies** (issue 20) apply per shard: a group's ``max_rows`` is split as the
  capacity is (a cap at least 1 row per shard), each shard's frequency sketch gets
  ``sketch_bytes // k`` bytes, so that the shards' sketches together stay within
  ``sketch_bytes`` (a ``sketch_bytes`` under ``k`` times a store's least sketch,
  ``MIN_SKETCH_BYTES``, is refused, naming it), a shard
  counts ``ttl_steps`` in the training lookups that had ids for it, and ``expire`` bounds
  each shard's work by ``max_rows``. ``set_policies`` and ``expire`` take one version when
  some shard evicts, none otherwise; ``policy_stats`` adds the shards' counters up.

Values (initialisation from the id, the optimizer, the weight bound) are per row and do not
depend on ``k``: without evictions and with full admission, every lookup and update gives
what one store gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from stream_persia.config.global_config import MAX_STORE_THREADS
from stream_persia.errors import BadInput
from stream_persia.kernels import segments
from stream_persia.server import _pystore as _py
from stream_persia.server import policies as _pol
from stream_persia.server.store import EmbeddingStore, Store

__all__ = ["ShardedStore", "make_store"]


def make_store(capacity: int, optimizer: Any, embedding_config: Any = None, *,
               shards: int = 1, eviction_log: int = _py.EVICTION_LOG,
               sketch_bytes: int | None = None) -> Store:
    """An ``EmbeddingStore``, or a :class:`ShardedStore` of ``shards`` of them when
    ``shards`` > 1. ``sketch_bytes``: the frequency admission sketch's memory over all
    shards (None: the store's default, ``admission.sketch_bytes``'s)."""
    if sketch_bytes is None:
        sketch_bytes = _pol.SKETCH_BYTES
    if shards == 1:
        return EmbeddingStore(capacity, optimizer, embedding_config, eviction_log=eviction_log,
                              sketch_bytes=sketch_bytes)
    return ShardedStore(capacity, optimizer, embedding_config, shards=shards,
                        eviction_log=eviction_log, sketch_bytes=sketch_bytes)


def _check_shards(shards: Any, capacity: int) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) \
            or not 1 <= shards <= MAX_STORE_THREADS:
        raise BadInput(f"store_threads must be an int in [1, {MAX_STORE_THREADS}], got "
                       f"{shards!r}", field="store_threads",
                       hint="one per core the server may use, e.g. 4")
    if capacity < shards:
        raise BadInput(f"{shards} store threads cannot share a capacity of {capacity} rows "
                       "(each internal shard holds at least one)", field="capacity",
                       hint="lower store_threads or raise capacity")
    return shards


def _shard_sketch_bytes(sketch_bytes: Any, k: int) -> int:
    """Each of ``k`` shards' sketch: ``sketch_bytes // k``, so that the shards' sketches
    together stay within ``sketch_bytes``; a BadInput naming ``sketch_bytes`` when that is
    below a store's least sketch."""
    total = _pol.check_sketch_bytes(sketch_bytes)
    if total // k < _pol.MIN_SKETCH_BYTES:
        raise BadInput(f"sketch_bytes {total} cannot be shared by {k} store threads: each "
                       f"internal shard's frequency sketch takes at least "
                       f"{_pol.MIN_SKETCH_BYTES} bytes", field="sketch_bytes",
                       hint=f"raise admission.sketch_bytes to at least "
                            f"{k * _pol.MIN_SKETCH_BYTES} or lower store_threads")
    return total // k


class ShardedStore:
    """``shards`` embedding stores behind one store interface (see the module docstring).

    Args:
        capacity: the most vectors held, over all shards.
        optimizer, embedding_config: as for the store.
        shards: internal shards, each on its own thread while a call runs.
        store_type: the store class (``EmbeddingStore``: the Cython store or its twin).
        eviction_log: entries of the eviction log, over all shards.
    """

    def __init__(self, capacity: int, optimizer: Any, embedding_config: Any = None, *,
                 shards: int, store_type: type = EmbeddingStore,
                 eviction_log: int = _py.EVICTION_LOG, sketch_bytes: int = _pol.SKETCH_BYTES):
        capacity = _py.check_capacity(capacity)
        k = _check_shards(shards, capacity)
        log = max(_py.check_eviction_log(eviction_log) // k, 1)
        sketch = _shard_sketch_bytes(sketch_bytes, k)
        self._capacity = capacity
        self._cver = 0
        self._stores = [store_type(capacity // k + (s < capacity % k), optimizer,
                                   embedding_config, eviction_log=log, sketch_bytes=sketch)
                        for s in range(k)]
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max(k - 1, 1), thread_name_prefix="store-shard")

    def close(self) -> None:
        """Stop the shard threads, after any call under way, and free every shard's rows.
        Idempotent; a closed store refuses further calls, as ``EmbeddingStore.close``. The
        server closes a store it stops serving (a load replaced it, or the server stopped),
        so neither its threads nor its memory outlive it."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)
            self._next_version()
        for store in self._stores:
            store.close()

    def __del__(self) -> None:   # a store dropped without close: let its threads go
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    # ----------------------------------------------------------------- plumbing
    @property
    def shards(self) -> int:
        """Number of internal shards."""
        return len(self._stores)

    def _next_version(self) -> None:
        """A mutating call begins: its shards will stamp ``change_version + 1``."""
        for store in self._stores:
            store.advance_version(self._cver)
        self._cver += 1

    def _owner(self, ids: np.ndarray) -> np.ndarray:
        return segments.internal_owner(ids, self.shards)

    def _map(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(s)`` for every shard ``s`` concurrently: shard 0 on this thread, the others
        on the pool. Waits for all; raises the first error in shard order. Results in shard
        order."""
        if self._pool is None:
            raise _py.closed_error()
        futures = [self._pool.submit(fn, s) for s in range(1, self.shards)]
        out: list[Any] = [None] * self.shards
        first_error: BaseException | None = None
        try:
            out[0] = fn(0)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others finish
            first_error = e
        for s, f in enumerate(futures, start=1):
            try:
                out[s] = f.result()
            except BaseException as e:  # noqa: BLE001
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return out

    # ----------------------------------------------------------------- the interface
    @property
    def capacity(self) -> int:
        """Most vectors held, over all shards."""
        return self._capacity

    @property
    def optimizer(self) -> Any:
        return self._stores[0].optimizer

    @property
    def embedding_config(self) -> Any:
        return self._stores[0].embedding_config

    def __len__(self) -> int:
        return sum(len(s) for s in self._stores)

    def lookup(self, ids: Any, dim: Any, train: bool = True) -> np.ndarray:
        """Embeddings of ``ids`` as float32 (n, dim), as ``EmbeddingStore.lookup``."""
        ids = _py.check_ids(ids)
        d = _py.check_dim(dim)
        owner = self._owner(ids)
        out = np.empty((len(ids), d), dtype=np.float32)

        def part(s: int) -> None:
            pos = np.flatnonzero(owner == s)
            if pos.size:
                out[pos] = self._stores[s].lookup(ids[pos], d, train)

        if train and len(ids):
            self._open()
            self._next_version()
        self._map(part)
        return out

    def lookup_pooled(self, ids: Any, dim: Any, index: Any, offsets: Any,
                      train: bool = True) -> np.ndarray:
        """Segment sums of the rows of ``ids`` (see the module docstring on rounding)."""
        ids = _py.check_ids(ids)
        d = _py.check_dim(dim)
        segments.check_pooled(len(ids), index, offsets, "lookup_pooled")
        owner = self._owner(ids)

        def part(s: int) -> np.ndarray | None:
            mine = segments.split_part(index, offsets, owner, s, self.shards)
            if not mine.positions.size:
                return None
            return self._stores[s].lookup_pooled(ids[mine.positions], d, mine.index,
                                                 mine.offsets, train)

        if train and len(ids):
            self._open()
            self._next_version()
        sums = self._map(part)
        out = np.zeros((len(offsets) - 1, d), dtype=np.float32)
        for piece in sums:
            if piece is not None:
                out += piece
        return out

    def update(self, ids: Any, grads: Any) -> None:
        """Apply the optimizer to the rows of ``ids``, as ``EmbeddingStore.update``."""
        ids = _py.check_ids(ids)
        grads = _py.check_grads(grads, len(ids))
        # NaN and infinity survive a sum, which costs a seventh of a row-wise isfinite; the
        # rows are checked only when it is not finite (a sum of finite terms may overflow).
        with np.errstate(over="ignore", invalid="ignore"):
            total = grads.sum()
        if not np.isfinite(total):
            finite = np.isfinite(grads).all(axis=1)
            if not finite.all():
                i = int(np.argmin(finite))
                raise _py.nonfinite_error(i, int(ids[i]))
        owner = self._owner(ids)

        def part(s: int) -> None:
            pos = np.flatnonzero(owner == s)
            if pos.size:
                self._stores[s].update(ids[pos], grads.take(pos, axis=0))

        if len(ids):
            self._open()
            self._next_version()
        self._map(part)

    def contains(self, ids: Any) -> np.ndarray:
        """Which ids are stored (bool array); recency is not refreshed."""
        ids = _py.check_ids(ids)
        owner = self._owner(ids)
        out = np.zeros(len(ids), dtype=np.bool_)

        def part(s: int) -> None:
            pos = np.flatnonzero(owner == s)
            out[pos] = self._stores[s].contains(ids[pos])

        self._map(part)
        return out

    def clear(self) -> None:
        """Drop every row (statistics are kept)."""
        self._open()
        self._next_version()
        self._map(lambda s: self._stores[s].clear())

    def configure(self, optimizer: Any = None, embedding_config: Any = None) -> None:
        """Replace the optimizer and/or config of every shard."""
        for store in self._stores:   # the first one checks the arguments before any change
            store.configure(optimizer, embedding_config)

    def stats(self) -> dict[str, int]:
        """The shards' counters added up; ``capacity`` is the total."""
        out: dict[str, int] = {}
        for store in self._stores:
            for key, value in store.stats().items():
                out[key] = out.get(key, 0) + value
        out["capacity"] = self._capacity
        return out

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self._stores)

    def memory_breakdown(self) -> dict[str, int]:
        out = {"rows": 0, "bookkeeping": 0}
        for s in self._stores:
            for key, value in s.memory_breakdown().items():
                out[key] += value
        return out

    # ----------------------------------------------------------------- table policies
    def _maybe_mutating(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn`` on every shard for a call that mutates only if it evicts: the shards
        that evict stamp ``change_version + 1``, which becomes this store's if any did."""
        self._open()
        for store in self._stores:
            store.advance_version(self._cver)
        out = self._map(fn)
        self._cver = max(s.change_version for s in self._stores)
        return out

    def set_policies(self, prefix_bits: int, policies: Any, *, now: float | None = None
                     ) -> None:
        """Every shard's table (a shard's cap is the group's ``max_rows`` split as the
        capacity is); see ``PyEmbeddingStore.set_policies``."""
        bits, pols = _pol.check_policies(prefix_bits, policies)
        k = self.shards

        def part(s: int) -> None:
            mine = [p if p.max_rows is None else dataclasses.replace(
                p, max_rows=max(p.max_rows // k + (s < p.max_rows % k), 1)) for p in pols]
            self._stores[s].set_policies(bits, mine, now=now)

        self._maybe_mutating(part)

    def expire(self, now: float | None = None, max_rows: int = _pol.EXPIRE_ROWS) -> int:
        """Every shard's expired rows (at most ``max_rows`` per shard); how many."""
        limit = _pol.check_expire_rows(max_rows)
        return sum(self._maybe_mutating(lambda s: self._stores[s].expire(now, limit)))

    def policy_stats(self) -> dict[int, dict[str, int]]:
        """The shards' policy counters added up."""
        out: dict[int, dict[str, int]] = {}
        for store in self._stores:
            for p, counts in store.policy_stats().items():
                mine = out.setdefault(p, dict.fromkeys(counts, 0))
                for key, value in counts.items():
                    mine[key] += value
        return out

    def sketch_counts(self, ids: Any) -> np.ndarray:
        """The sketch estimates of ``ids``, each from its shard."""
        ids = _py.check_ids(ids)
        out = np.zeros(len(ids), np.int64)
        owner = self._owner(ids)
        for s, store in enumerate(self._stores):
            pos = np.flatnonzero(owner == s)
            if pos.size:
                out[pos] = store.sketch_counts(ids[pos])
        return out

    def dump(self, chunk_rows: int = _py.DUMP_CHUNK_ROWS) -> Iterator[dict[str, Any]]:
        """Every shard's chunks in turn (see the module docstring); a shard's sketch chunk
        says which shard of how many it is (``sketch_part``)."""
        dumps = [s.dump(chunk_rows) for s in self._stores]   # each checks chunk_rows now
        k = len(self._stores)
        return ({**chunk, "sketch_part": [s, k]} if "sketch" in chunk else chunk
                for s, d in enumerate(dumps) for chunk in d)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.dump()

    def load(self, chunks: Iterable[dict[str, Any]]) -> None:
        """Insert dumped rows, each chunk's routed to their shards in order; a chunk is
        checked whole (shapes, dtypes, optimizer state) before any shard loads it."""
        for chunk in chunks:
            dim, ids, weights, state = _py.check_chunk(chunk, self.optimizer)
            if "sketch" in chunk:
                self._load_sketch(chunk)
                continue
            if not len(ids):
                continue
            owner = self._owner(ids)
            self._open()
            self._next_version()
            kind = chunk.get("state_kind")
            self._map(partial(self._load_part, owner, dim, ids, weights, state, kind))

    def _load_sketch(self, chunk: dict[str, Any]) -> None:
        """A sketch chunk goes to the shard it came from when the dump had as many shards
        (each gets its own sketch back), else to every shard (each merges it: no id is
        counted lower than it was)."""
        _, _, (j, k) = _pol.check_sketch_chunk(chunk)
        self._open()
        for s in ([j] if k == len(self._stores) else range(len(self._stores))):
            self._stores[s].load([chunk])

    def _load_part(self, owner: np.ndarray, dim: int, ids: np.ndarray, weights: np.ndarray,
                   state: np.ndarray | None, kind: Any, s: int) -> None:
        pos = np.flatnonzero(owner == s)
        if not pos.size:
            return
        sub = {"dim": dim, "ids": ids[pos], "weights": weights[pos]}
        if state is not None:
            sub["state"], sub["state_kind"] = state[pos], kind
        self._stores[s].load([sub])

    # ----------------------------------------------------------------- change tracking
    def _open(self) -> None:
        if self._pool is None:
            raise _py.closed_error()

    @property
    def change_version(self) -> int:
        """Version of the latest mutating call, as ``EmbeddingStore.change_version``."""
        return self._cver

    def advance_version(self, version: int) -> None:
        """``change_version = max(change_version, version)``, on every shard too."""
        self._cver = max(self._cver, _py.check_version(version, "version"))
        for store in self._stores:
            store.advance_version(self._cver)

    def remove(self, ids: Any) -> int:
        """Drop the stored rows of ``ids``; how many were removed."""
        ids = _py.check_ids(ids)
        self._open()
        if not len(ids):
            return 0
        owner = self._owner(ids)

        def part(s: int) -> int:
            pos = np.flatnonzero(owner == s)
            return int(self._stores[s].remove(ids[pos])) if pos.size else 0

        self._next_version()
        return sum(self._map(part))

    def changed_since(self, since: int, chunk_rows: int = _py.DUMP_CHUNK_ROWS, *,
                      state: bool = False) -> Iterator[dict[str, Any]]:
        """Every shard's changed rows in turn, as ``EmbeddingStore.changed_since``."""
        self._open()
        parts = [s.changed_since(since, chunk_rows, state=state)   # each checks
                 for s in self._stores]
        return (chunk for p in parts for chunk in p)

    def evicted_since(self, since: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The shards' evicted ids merged in order of version, as
        ``EmbeddingStore.evicted_since``; complete only if every shard's log is."""
        parts = [s.evicted_since(since) for s in self._stores]
        ids = np.concatenate([p[0] for p in parts])
        versions = np.concatenate([p[1] for p in parts])
        order = np.argsort(versions, kind="stable")
        return ids[order], versions[order], all(p[2] for p in parts)
