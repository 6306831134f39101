"""Pure-Python twin of the Cython embedding store, and the rules both follow.

:class:`PyEmbeddingStore` is the readable reference: the Cython ``CEmbeddingStore``
(``cython_ext/store.pyx``) must give the same lookups, dumps and stats, bit for bit, for the
same call sequence (``tests/server/test_store.py`` checks it). This module also holds
what both share: argument validation (so errors read the same) and the two hash functions
that make behaviour deterministic:

- a new row of id ``k`` is ``lo + (hi - lo) * u_j`` in float32 arithmetic (lo, hi rounded
  to float32 first): with ``h = H(H(k) + j // 2)``, ``u_j = (h >> 40) / 2**24`` for
  even ``j`` and ``((h >> 8) & 0xFFFFFF) / 2**24`` for odd ``j``. It depends on the id only,
  never on the shard that holds it;
- the ``t``-th training miss of a store (t = 0, 1, ...) admits id ``k`` iff
  ``(H(k ^ H(t)) >> 11) / 2**53 < admit_probability``.

``H`` is :func:`stream_persia.kernels.sharding.stable_hash64` (SplitMix64's finaliser of
``z + 0x9E3779B97F4A7C15``, ``sp_mix64`` in ``cython_ext/store_kernels.h``), all arithmetic
modulo 2**64.

Semantics (DESIGN.md §3): ``capacity`` counts vectors of every dim; one LRU order; training
lookups insert and refresh, inference lookups do neither; gradients of one id in an update
are summed in call order before the optimizer runs once per id; ids not stored are dropped
and counted; rows are clamped to ±weight_bound after each update.

Change tracking (what serving replicas follow, issue 18). ``change_version`` counts the
store's mutating calls: a training ``lookup``/``lookup_pooled`` with at least one id, an
``update`` with at least one id that passes its checks, each non-empty chunk of a ``load``,
a ``remove`` with at least one id, ``clear`` and ``close``. Such a call first increments it
by one, then stamps every row it admits, updates or loads (inserted or overwritten) with
the new value, the row's *change version*, and logs every id it evicts or removes with that
value in the eviction log (a bounded ring, oldest dropped first). Inference lookups,
``contains``, ``configure``, ``dump`` and the readers below never change it; a call with
no ids changes nothing. A call that fails part-way (an id stored with another dim, in a
lookup) keeps its increment and the stamps of the rows it changed before the error. Rows
updated by one call all get its version whether or not their values changed (an SGD step
of lr 0 still counts). ``changed_since(v)`` lists the stored rows with a change version
> v, ``evicted_since(v)`` the ids logged after v; ``advance_version(v)`` raises
``change_version`` to at least v. Cost of a pass: this twin scans every row slot; the
Cython store keeps a *dirty list* of the entries changed since its previous
``changed_since`` call (the mark), so a pass from a ``since`` at or after the mark (a
publisher's pass from the version it read just before its previous pass, in the same
store-thread call that opened that pass) reads only those entries, and moves the mark to
now; an older ``since`` (a resync, an abandoned pass retried) scans every entry and leaves
the list alone. The rows returned are the same either way. A replica that applies
``evicted_since(v)`` (with ``remove``) and then ``changed_since(v)`` (with ``load``), for the
``v`` it last published through, holds exactly the store's rows; when ``evicted_since``
says its log no longer covers ``v``, it must start again from ``changed_since(0)``.
The one difference between the two stores: the Cython store keeps a row's version in 32
bits above a base that it moves once in 2**31 mutating calls (or when ``advance_version``
jumps further); a row last changed before the base is then reported with the base as its
version, later than it was (a reader may see it again, never misses it).

Table policies (issue 20; ``set_policies``). Each id has a *policy index* ``p``: its top
``prefix_bits`` bits (``g + 1`` for feature group ``g``), 0 when they are 0, not below
the number of policies, or ``prefix_bits`` is 0; ``policies[p]`` (a ``SlotPolicy``) rules
its rows, index 0 being the default (``SlotPolicy()`` unless given). Without policies
(the default) the store behaves exactly as before. A training miss of id ``k`` (policy
``P``): if ``P.min_count > 1``, ``k`` is counted in the frequency sketch
(:mod:`stream_persia.server.policies`); below ``min_count`` the lookup returns ``k``'s
initial row (:func:`initial_rows`), stores nothing, draws nothing, and counts
``rejected``. Then the admission draw as above with ``P.admit_probability`` (None: the
config's). An admitted id first makes room in its group if the group holds ``P.max_rows``
rows (``evicted_cap``, below), then evicts the globally least recently used row if the
store is full (``evicted_lru``).

While some policy has a TTL or a cap, each policy keeps its rows in its own *queue* (the
global LRU list is unchanged) and each row has a *mark* and a *stamp*. A row enters its
queue at the head, unmarked, when it is stored or loaded (stamped then) and when it is
*re-queued*; a training lookup that finds a row does not move it in its queue: it marks
it and, while some policy has a TTL, stamps it. The stamp is the time (float32 seconds
since the store was made) and step (the store's count of training lookup calls with at
least one id, mod 2**32) of the row's last training lookup or load, or the ``now`` and
step of the ``set_policies`` call that introduced the first TTL if that is later (times
on the monotonic clock, ``time.monotonic()``, as the ``now`` of ``set_policies`` and
``expire``: a step of the wall clock neither expires rows early nor keeps them). A group
at its cap evicts (``evicted_cap``) the first unmarked row from its queue's tail,
re-queueing (unmarked, stamp kept) the marked rows before it: second chance, as CLOCK
does. So the row a cap evicts was not looked up since it was last queued, every row of
the group queued before it was looked up since (and is re-queued), and it is not always
the group's least recently used row. ``expire(now)``
walks the queues of the policies with a TTL in index order, each from its tail: a row
with ``now - t >= ttl_s`` or ``step - s >= ttl_steps`` (its stamp ``t``, ``s``) is
evicted, else a marked row is re-queued, else the policy's walk ends; at most
``max_rows`` rows are evicted and at most ``max_rows`` re-queued per call. A row is
evicted by expire only when its stamp is past its TTL: expire never evicts a row looked
up in training within its TTL. A row is evicted by the first expire (with room in its
``max_rows``) at a time when it has not been looked up for its TTL since it was last
queued (every row queued before it is then past its TTL or marked); a row looked up since
is re-queued by the first expire that reaches it, at most one TTL later. So with expire
called at least every period ``d`` (and room), a row not looked up for ``2 * (ttl + d)``
(in steps alike) is gone. Cost: a hit writes the entry it reads (its mark) and, while a
TTL exists, the stamp; a re-queue is O(1) and each one clears a mark, so walks cost at
most one step per training lookup plus one per eviction. ``set_policies`` recomputes
every row's policy, rebuilds the queues in global LRU order (least recently used at the
tail) with every row unmarked, stamps rows as above, and applies lower caps at once (from
each queue's tail). ``expire`` and ``set_policies`` are mutating calls when they evict a
row: they increment ``change_version`` before the first, and log every row they evict.
Ids of an ``update`` not stored are counted per policy (``dropped_grads``).

Compact rows (``P.dtype``, :mod:`stream_persia.server.row_dtypes`): a row admitted or
loaded while its policy says ``float16`` or ``bfloat16`` stores its weights in that dtype,
its optimizer state in float32. Its initial weights and every value stored (an update's
result after the clamp to ±weight_bound, a loaded row) are rounded to nearest even; every
reader (lookups, pooled lookups, ``dump``, ``changed_since``) gets them as float32, so
checkpoints, the update stream and replicas carry float32 and a load converts to the
dtype of the loading store's group (float16 -> float32 exactly). An update reads the
weights as float32, runs the same float32 optimizer step and clamp as a float32 row, and
rounds. The initial row a rejected id (below its min_count) is served is not rounded
(nothing is stored). A change of a group's dtype by ``set_policies`` applies to rows
stored from then on: a row keeps the dtype it was stored with until it leaves the store
(evicted, expired, removed, cleared), which keeps ``set_policies`` free of a conversion
pass over the table. ``dump`` yields one chunk per dim and window whatever the rows'
dtypes. ``memory_breakdown`` splits ``memory_bytes`` into row storage and bookkeeping.

Size: one module past 500 lines on purpose: it is the store's contract written out as one
readable class (read beside ``cython_ext/store.pyx``, method for method) together with the
validation both stores share; cutting the class in two would split that contract.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from stream_persia.core.embedding_config import MAX_CAPACITY, EmbeddingConfig, SlotPolicy
from stream_persia.core.optim import Optimizer, as_optimizer
from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels import segments
from stream_persia.kernels.sharding import stable_hash64, stable_hash64_int
from stream_persia.server import policies as _pol
from stream_persia.server import row_dtypes as _rdt

__all__ = ["PyEmbeddingStore", "initial_rows", "admit_uniform"]

MAX_DIM = 1 << 16
DUMP_CHUNK_ROWS = 65536
EVICTION_LOG = 1 << 20        # default entries of the eviction log (16 bytes each)
MAX_EVICTION_LOG = 1 << 26


def init_bounds(init: tuple[float, float]) -> tuple[np.float32, np.float32]:
    """(lo, hi) of emb_initialization as the float32 values both stores compute with."""
    return np.float32(init[0]), np.float32(init[1])


def initial_rows(ids: np.ndarray, dim: int, init: tuple[float, float]) -> np.ndarray:
    """The deterministic initial vectors of ``ids``: float32 (n, dim)."""
    lo, hi = init_bounds(init)
    base = stable_hash64(np.asarray(ids, np.uint64))[:, None]
    h = stable_hash64(base + np.arange((dim + 1) // 2, dtype=np.uint64)[None, :])
    bits = np.empty((len(base), 2 * h.shape[1]), np.uint64)
    bits[:, 0::2] = h >> np.uint64(40)
    bits[:, 1::2] = (h >> np.uint64(8)) & np.uint64(0xFFFFFF)
    u = bits[:, :dim].astype(np.float32) * np.float32(1.0 / 16777216.0)
    return lo + (hi - lo) * u


def admit_uniform(key: int, draw: int) -> float:
    """The uniform [0, 1) number deciding admission of ``key`` at training miss ``draw``."""
    return (stable_hash64_int(key ^ stable_hash64_int(draw)) >> 11) * (1.0 / 9007199254740992.0)


# --- validation shared by both stores -------------------------------------------------------

def check_capacity(capacity: Any) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) \
            or not 1 <= capacity <= MAX_CAPACITY:
        raise BadInput(f"capacity must be an int in [1, {MAX_CAPACITY}], got {capacity!r}",
                       field="capacity", hint="the most embedding vectors this store holds")
    return int(capacity)


def check_config(cfg: Any) -> EmbeddingConfig:
    if cfg is None:
        return EmbeddingConfig()
    if isinstance(cfg, EmbeddingConfig):
        return cfg
    if isinstance(cfg, dict):
        return EmbeddingConfig.from_dict(cfg)
    raise BadInput(f"embedding_config must be an EmbeddingConfig (or its to_dict()), got {cfg!r}",
                   field="embedding_config")


def check_ids(ids: Any, field: str = "ids") -> np.ndarray:
    """A 1-D uint64 array (made C-contiguous); anything else is a BadInput."""
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        got = (f"{ids.dtype} array of shape {ids.shape}" if isinstance(ids, np.ndarray)
               else type(ids).__name__)
        raise BadInput(f"{field} must be a 1-D numpy array of uint64, got {got}", field=field,
                       hint="np.asarray(ids, dtype=np.uint64)")
    return np.ascontiguousarray(ids)


def check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) \
            or not 1 <= dim <= MAX_DIM:
        raise BadInput(f"dim must be an int in [1, {MAX_DIM}], got {dim!r}", field="dim")
    return int(dim)


def check_grads(grads: Any, n: int) -> np.ndarray:
    """float32 (n, dim); returns it C-contiguous (finiteness is checked by update)."""
    if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.ndim != 2 \
            or grads.shape[0] != n:
        got = (f"{grads.dtype} array of shape {grads.shape}" if isinstance(grads, np.ndarray)
               else type(grads).__name__)
        raise BadInput(f"grads must be a float32 array of shape ({n}, dim) (one row per id), "
                       f"got {got}", field="grads", hint="grads.astype(np.float32)")
    check_dim(grads.shape[1])
    return np.ascontiguousarray(grads)


def check_eviction_log(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) \
            or not 1 <= n <= MAX_EVICTION_LOG:
        raise BadInput(f"eviction_log must be an int in [1, {MAX_EVICTION_LOG}], got {n!r}",
                       field="eviction_log", hint="entries (16 bytes each) of the log of "
                       "evicted ids that evicted_since() reads, e.g. 1048576")
    return int(n)


def check_version(v: Any, field: str) -> int:
    """A change version: an int >= 0 (below 2**63)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 1 << 63:
        raise BadInput(f"{field} must be an int >= 0 (a change_version), got {v!r}",
                       field=field)
    return int(v)


def check_chunk_rows(chunk_rows: Any) -> int:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise BadInput(f"chunk_rows must be an int >= 1, got {chunk_rows!r}",
                       field="chunk_rows")
    return chunk_rows


def empty_changes() -> dict[str, Any]:
    """The chunk ``changed_since`` yields for a window with no changed row."""
    return {"dim": 0, "ids": np.empty(0, np.uint64), "weights": np.empty((0, 0), np.float32),
            "versions": np.empty(0, np.int64)}


def nonfinite_error(i: int, key: int) -> BadInput:
    return BadInput(f"grads row {i} (id {key}) is not finite (NaN or inf)", field="grads",
                    hint="skip the update of a step whose gradients overflowed")


def closed_error() -> Misuse:
    return Misuse("this embedding store was closed (its server stopped serving it)",
                  hint="use the store the server serves now")


def dim_error(key: int, stored: int, dim: int, what: str) -> BadInput:
    return BadInput(f"id {key} is stored with dim {stored} but this {what} uses dim {dim}",
                    field="ids", hint="each slot needs its own id prefix "
                    "(feature_index_prefix_bit) when slots have different dims")


def check_chunk(chunk: Any, opt: Optimizer) -> tuple[int, np.ndarray, np.ndarray, Any]:
    """Validate one dump chunk; returns (dim, ids, weights, state or None)."""
    if not isinstance(chunk, dict):
        raise BadInput(f"a dump chunk must be a dict, got {type(chunk).__name__}", field="chunk")
    missing = {"dim", "ids", "weights"} - set(chunk)
    if missing:
        raise BadInput(f"dump chunk lacks {sorted(missing)}", field=sorted(missing)[0],
                       hint="chunks are the dicts EmbeddingStore.dump() yields")
    dim = check_dim(chunk["dim"])
    ids = check_ids(chunk["ids"])
    n = len(ids)
    weights = chunk["weights"]
    if not isinstance(weights, np.ndarray) or weights.dtype != np.float32 \
            or weights.shape != (n, dim):
        raise BadInput(f"chunk weights must be float32 of shape ({n}, {dim}), got "
                       f"{getattr(weights, 'dtype', type(weights).__name__)} "
                       f"{getattr(weights, 'shape', '')}", field="weights")
    state = chunk.get("state")
    if state is not None:
        kind = chunk.get("state_kind")
        width = opt.state_width(dim)
        if kind != opt.state_kind:
            raise BadInput(f"chunk holds {kind!r} optimizer state but the store's optimizer "
                           f"keeps {opt.state_kind!r} state", field="state_kind",
                           hint="configure the store with the optimizer the dump was taken "
                           "with, or drop 'state' from the chunks to start fresh")
        if not isinstance(state, np.ndarray) or state.dtype != np.float32 \
                or state.shape != (n, width):
            raise BadInput(f"chunk state must be float32 of shape ({n}, {width}), got "
                           f"{getattr(state, 'dtype', type(state).__name__)} "
                           f"{getattr(state, 'shape', '')}", field="state")
        state = np.ascontiguousarray(state)
    return dim, ids, np.ascontiguousarray(weights), state


class _Arena:
    """Rows of one dim and weight dtype: ``[weights(dim) | optimizer state]`` float32, with
    a free list, and beside each row its id and change version (-1 while the row is free).
    A compact arena (``code`` 1 or 2) holds its weights already rounded to its dtype
    (:func:`row_dtypes.round_weights`): the values the Cython store's 16-bit rows hold."""

    def __init__(self, dim: int, opt: Optimizer, code: int = 0):
        self.dim = dim
        self.code = code
        self.init_state = opt.initial_state(dim)
        self.data = np.zeros((16, dim + len(self.init_state)), np.float32)
        self.keys = np.zeros(16, np.uint64)
        self.ver = np.full(16, -1, np.int64)
        self.used = 0
        self.free: list[int] = []

    def alloc(self, key: int, version: int) -> int:
        if self.free:
            r = self.free.pop()
        else:
            if self.used == len(self.data):
                grown = np.zeros((2 * len(self.data), self.data.shape[1]), np.float32)
                grown[:self.used] = self.data
                self.data = grown
                self.keys = np.concatenate([self.keys, np.zeros_like(self.keys)])
                self.ver = np.concatenate([self.ver, np.full_like(self.ver, -1)])
            self.used += 1
            r = self.used - 1
        self.keys[r], self.ver[r] = key, version
        return r

    def release(self, r: int) -> None:
        """Row ``r`` is no longer stored (``free`` takes it back when the caller says)."""
        self.ver[r] = -1

    def restate(self, opt: Optimizer) -> None:
        self.init_state = opt.initial_state(self.dim)
        data = np.empty((len(self.data), self.dim + len(self.init_state)), np.float32)
        data[:, :self.dim] = self.data[:, :self.dim]
        data[:, self.dim:] = self.init_state
        self.data = data


class PyEmbeddingStore:
    """LRU embedding store in plain Python and numpy (the reference twin).

    Args:
        capacity: the most vectors stored (all dims together); the least recently used
            rows are evicted beyond it.
        optimizer: SGD, Adagrad or Adam (or its ``to_dict()``).
        embedding_config: initialisation, admission and clamping (defaults: PERSIA's).
        eviction_log: entries of the log of evicted and removed ids that
            :meth:`evicted_since` reads (16 bytes each; its oldest are dropped beyond it).
        sketch_bytes: memory of the frequency-admission sketch (allocated only while a
            policy has ``min_count > 1``).
    """

    implementation = "python"

    def __init__(self, capacity: int, optimizer: Any, embedding_config: Any = None, *,
                 eviction_log: int = EVICTION_LOG, sketch_bytes: int = _pol.SKETCH_BYTES):
        self._capacity = check_capacity(capacity)
        self._sketch_bytes = _pol.check_sketch_bytes(sketch_bytes)
        self._elog: deque[tuple[int, int]] = deque(maxlen=check_eviction_log(eviction_log))
        self._elog_dropped = 0   # version of the newest entry the log dropped
        self._cver = 0           # change_version
        self._reset_ver = 0      # change_version of the last clear() or close()
        self._opt = as_optimizer(optimizer)
        self._cfg = check_config(embedding_config)
        self._lru: OrderedDict[int, tuple[_Arena, int]] = OrderedDict()  # oldest first
        self._arenas: dict[tuple[int, int], _Arena] = {}   # by (dim, dtype code)
        self._counts = dict.fromkeys(
            ("lookups", "misses", "admissions", "evictions", "updates", "dropped_updates",
             "removals", "nonfinite_updates"), 0)
        self._draws = 0
        self._version = 0
        self._closed = False
        # Policies (see the module docstring): the table, one counter dict per index,
        # the sketch (while a min_count > 1), and while a TTL or cap: one queue per index
        # (oldest first), the rows looked up since queued, and each row's stamp (float32
        # time, uint32 step).
        self._pbits = 0
        self._pols: list[SlotPolicy] = [SlotPolicy()]
        self._policed = False
        self._pstats = [dict.fromkeys(_pol.STAT_KEYS, 0)]
        self._sketch: _pol.PySketch | None = None
        self._plru: list[OrderedDict[int, None]] | None = None
        self._stamps: dict[int, tuple[np.float32, int]] = {}
        self._marked: set[int] = set()
        self._has_ttl = False
        self._epoch = time.monotonic()   # the TTL clock (a wall clock step moves no stamp)
        self._steps = 0
        self._stamp_now: tuple[np.float32, int] = (np.float32(0.0), 0)

    capacity = property(lambda self: self._capacity, doc="Most vectors held.")
    optimizer = property(lambda self: self._opt, doc="The embedding optimizer.")
    embedding_config = property(lambda self: self._cfg, doc="The EmbeddingConfig in force.")

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        """Free the rows now; later calls that read or change rows raise Misuse. Idempotent.
        ``len`` is then 0 and ``stats`` keeps the counters. The embedding server closes a
        store it stops serving (a load replaced it, or the server stopped)."""
        if not self._closed:
            self._cver += 1
            self._reset_ver = self._cver
        self._lru.clear()
        self._arenas.clear()
        self._elog.clear()
        self._forget_all()
        self._sketch = None
        self._version += 1
        self._closed = True

    def _open(self) -> None:
        if self._closed:
            raise closed_error()

    def _arena(self, dim: int, code: int = 0) -> _Arena:
        arena = self._arenas.get((dim, code))
        if arena is None:
            arena = self._arenas[dim, code] = _Arena(dim, self._opt, code)
        return arena

    def _evict_oldest(self, deferred: list[tuple[_Arena, int]] | None) -> None:
        self._drop(next(iter(self._lru)), deferred, "evicted_lru")
        self._counts["evictions"] += 1

    def _drop(self, key: int, deferred: list[tuple[_Arena, int]] | None,
              why: str | None) -> None:
        """Free the row of ``key`` (its slot to ``deferred`` if given) and log it;
        ``why`` is the policy counter it adds to (None for a removal)."""
        where = self._lru.pop(key)
        where[0].release(where[1])
        if deferred is None:
            where[0].free.append(where[1])
        else:
            deferred.append(where)
        self._log_eviction(key)
        p = self._policy(key)
        self._pstats[p]["rows"] -= 1
        if why is not None:
            self._pstats[p][why] += 1
        if self._plru is not None:
            del self._plru[p][key]
            del self._stamps[key]
            self._marked.discard(key)

    def _forget_all(self) -> None:
        for st in self._pstats:
            st["rows"] = 0
        if self._plru is not None:
            self._plru = [OrderedDict() for _ in self._pols]
        self._stamps.clear()
        self._marked.clear()

    def _policy(self, key: int) -> int:
        return _pol.policy_of(key, self._pbits, len(self._pols))

    def _stamp_call(self, train_call: bool) -> None:
        """A training lookup call (``train_call``) or a load begins: the stamp it gives."""
        if train_call:
            self._steps += 1
        if self._plru is not None:
            self._stamp_now = (np.float32(time.monotonic() - self._epoch),
                               self._steps & 0xFFFFFFFF)

    def _added(self, key: int, p: int) -> None:
        """Row of ``key`` (policy ``p``) was just stored or loaded: queued, unmarked,
        stamped."""
        if self._plru is not None:
            lru = self._plru[p]
            lru[key] = None
            lru.move_to_end(key)
            self._stamps[key] = self._stamp_now
            self._marked.discard(key)

    def _requeue(self, lru: OrderedDict[int, None], key: int) -> None:
        """Second chance: marked ``key`` (at the tail of its queue ``lru``) goes to the
        head, unmarked, keeping its stamp."""
        lru.move_to_end(key)
        self._marked.discard(key)

    def _make_room(self, p: int, deferred: list[tuple[_Arena, int]] | None) -> None:
        """Before a new row of policy ``p``: its group's cap (the first unmarked row from
        its queue's tail, the marked ones before it re-queued), then the capacity."""
        cap = self._pols[p].max_rows
        if cap is not None and self._pstats[p]["rows"] >= cap and self._plru is not None:
            lru = self._plru[p]
            key = next(iter(lru))
            while key in self._marked:
                self._requeue(lru, key)
                key = next(iter(lru))
            self._drop(key, deferred, "evicted_cap")
        if len(self._lru) >= self._capacity:
            self._evict_oldest(deferred)

    def _log_eviction(self, key: int) -> None:
        log = self._elog
        if len(log) == log.maxlen:
            self._elog_dropped = log[0][1]
        log.append((key, self._cver))

    def lookup(self, ids: np.ndarray, dim: int, train: bool = True) -> np.ndarray:
        """Embeddings of ``ids`` as float32 (n, dim); zeros for ids not stored.

        A training lookup refreshes hits and admits misses (with ``admit_probability``),
        evicting the least recently used rows beyond capacity; an inference lookup
        (``train=False``) changes nothing. An id stored with another dim is a BadInput
        raised at that id (earlier ids of the call have been processed).
        """
        self._open()
        ids, dim = check_ids(ids), check_dim(dim)
        rows = np.full(len(ids), -1, np.int64)
        src: list[_Arena | None] = [None] * len(ids)     # the arena of rows[i]
        admit_to = self._arena(dim) if train else None   # training admits misses into it
        new_rows: dict[_Arena, tuple[list[int], list[int]]] = {}   # rows, keys
        deferred: list[tuple[_Arena, int]] = []  # freed rows stay unused until the gather
        rejected: list[int] = []   # positions of ids below their min_count
        lru, counts, p = self._lru, self._counts, self._cfg.admit_probability
        counts["lookups"] += len(ids)
        if train:
            self._version += 1
            if len(ids):
                self._cver += 1
                self._stamp_call(True)
        try:
            for i, key in enumerate(ids.tolist()):
                where = lru.get(key)
                if where is not None:
                    if where[0].dim != dim:
                        raise dim_error(key, where[0].dim, dim, "lookup")
                    if train:
                        lru.move_to_end(key)
                        if self._plru is not None:     # marked; stays in its queue
                            self._marked.add(key)
                            if self._has_ttl:
                                self._stamps[key] = self._stamp_now
                    rows[i], src[i] = where[1], where[0]
                    continue
                counts["misses"] += 1
                if admit_to is None:
                    continue
                pi = self._policy(key)
                pol, st, pp = self._pols[pi], self._pstats[pi], p
                if self._policed:
                    if pol.min_count > 1 and self._sketch is not None \
                            and self._sketch.add(key) < pol.min_count:
                        st["rejected"] += 1
                        rejected.append(i)
                        continue
                    if pol.admit_probability is not None:
                        pp = pol.admit_probability
                draw, self._draws = self._draws, self._draws + 1
                if pp < 1.0 and not admit_uniform(key, draw) < pp:
                    continue
                self._make_room(pi, deferred)
                into = admit_to if pol.dtype == "float32" else \
                    self._arena(dim, _rdt.dtype_code(pol.dtype))
                r = into.alloc(key, self._cver)
                lru[key] = (into, r)
                self._added(key, pi)
                counts["admissions"] += 1
                st["admitted"] += 1
                st["rows"] += 1
                rows[i], src[i] = r, into
                new = new_rows.setdefault(into, ([], []))
                new[0].append(r)
                new[1].append(key)
        finally:
            for into, (rs, keys) in new_rows.items():
                into.data[rs, :dim] = _rdt.round_weights(initial_rows(
                    np.array(keys, np.uint64), dim, self._cfg.emb_initialization), into.code)
                into.data[rs, dim:] = into.init_state
            out = np.zeros((len(ids), dim), np.float32)
            for a in {id(a): a for a in src if a is not None}.values():
                hit = np.fromiter((s is a for s in src), bool, len(src))
                out[hit] = a.data[rows[hit], :dim]
            if rejected:
                out[rejected] = initial_rows(ids[rejected], dim, self._cfg.emb_initialization)
            for a, r in deferred:
                a.free.append(r)
        return out

    def lookup_pooled(self, ids: np.ndarray, dim: int, index: np.ndarray,
                      offsets: np.ndarray, train: bool = True) -> np.ndarray:
        """Segment sums of the rows of ``ids``: float32 ``(len(offsets) - 1, dim)`` whose
        row s adds ``lookup(ids, dim, train)[index[offsets[s]:offsets[s+1]]]`` in order
        from 0.0 (zeros for an empty segment), with the same effects on the store as
        ``lookup``; a pooled lookup of :mod:`stream_persia.kernels.segments`. ``index`` (int32)
        and ``offsets`` (int64) are checked before the store is touched: a malformed one
        is a BadInput naming ``lookup_pooled.index`` or ``lookup_pooled.offsets``."""
        self._open()
        ids, dim = check_ids(ids), check_dim(dim)
        segments.check_pooled(len(ids), index, offsets, "lookup_pooled")
        return segments.pool(self.lookup(ids, dim, train), index, offsets, "lookup_pooled")

    def update(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Apply the optimizer with ``grads`` (float32 (n, dim)) to the rows of ``ids``.

        Gradients of the same id are summed first; ids not stored are dropped and counted;
        rows are then clamped to ±weight_bound. Errors leave the store unchanged.

        A non-finite row of ``grads`` is a BadInput (nothing applied). Finite gradients of
        one id may still add up to inf (float32 sums of a batch that names it many times),
        and a finite sum may overflow the optimizer's state (``g * g``): such an id's row is
        not stepped (it keeps its weights and state, and gets the call's version like the
        others) and is counted in ``stats()["nonfinite_updates"]``, so no row ever holds
        inf or NaN from an update.
        """
        self._open()
        ids = check_ids(ids)
        grads = check_grads(grads, len(ids))
        dim = grads.shape[1]
        finite = np.isfinite(grads).all(axis=1)
        if not finite.all():
            i = int(np.argmin(finite))
            raise nonfinite_error(i, int(ids[i]))
        if not len(ids):
            return
        rows = np.full(len(ids), -1, np.int64)
        src: list[_Arena | None] = [None] * len(ids)
        for i, key in enumerate(ids.tolist()):
            where = self._lru.get(key)
            if where is not None:
                if where[0].dim != dim:
                    raise dim_error(key, where[0].dim, dim, "update")
                rows[i], src[i] = where[1], where[0]
        self._counts["updates"] += len(ids)
        self._version += 1
        self._cver += 1
        present = rows >= 0
        self._counts["dropped_updates"] += int(len(ids) - present.sum())
        for key in ids[~present].tolist():
            self._pstats[self._policy(key)]["dropped_grads"] += 1
        bound = np.float32(self._cfg.weight_bound)
        # Per arena (rows of one dtype); each row's step is independent of the others'.
        for arena in {id(a): a for a in src if a is not None}.values():
            mine = np.fromiter((s is arena for s in src), bool, len(src))
            uniq, inv = np.unique(rows[mine], return_inverse=True)
            g = np.zeros((len(uniq), dim), np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                np.add.at(g, inv, grads[mine])  # in call order, from 0.0, like the C loop
                ok = np.isfinite(g).all(axis=1)
                w = arena.data[uniq, :dim]
                s = arena.data[uniq, dim:]
                self._opt.step(w, s, g)   # in float32, on the stored (rounded) weights
                w = np.clip(w, -bound, bound)
            ok &= np.isfinite(w).all(axis=1) & np.isfinite(s).all(axis=1)
            self._counts["nonfinite_updates"] += int((~ok).sum())
            arena.data[uniq[ok], :dim] = _rdt.round_weights(w[ok], arena.code)
            arena.data[uniq[ok], dim:] = s[ok]
            arena.ver[uniq] = self._cver

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Which ids are stored (bool array); recency is not refreshed."""
        self._open()
        ids = check_ids(ids)
        return np.fromiter((k in self._lru for k in ids.tolist()), bool, len(ids))

    def clear(self) -> None:
        """Drop every row (statistics are kept)."""
        self._open()
        self._lru.clear()
        self._arenas.clear()
        self._elog.clear()
        self._forget_all()
        self._version += 1
        self._cver += 1
        self._reset_ver = self._cver

    def configure(self, optimizer: Any = None, embedding_config: Any = None) -> None:
        """Replace the optimizer and/or the embedding config.

        Rows keep their weights. They keep their optimizer state when the new optimizer
        has the same ``state_kind`` (e.g. only lr changed); otherwise their state is reset
        to the new optimizer's initial state.
        """
        self._open()
        opt = self._opt if optimizer is None else as_optimizer(optimizer)
        cfg = self._cfg if embedding_config is None else check_config(embedding_config)
        if opt.state_kind != self._opt.state_kind:
            for arena in self._arenas.values():
                arena.restate(opt)
        else:
            for arena in self._arenas.values():
                arena.init_state = opt.initial_state(arena.dim)
        self._opt, self._cfg = opt, cfg
        self._version += 1

    def stats(self) -> dict[str, int]:
        """Counters: rows, capacity, lookups, misses, admissions, evictions, updates,
        dropped_updates, removals, nonfinite_updates (ids of updates whose summed gradient
        or step was not finite: their rows were left as they were)."""
        return {"rows": len(self._lru), "capacity": self._capacity, **self._counts}

    # --- table policies (issue 20; semantics in the module docstring) --------------------

    def set_policies(self, prefix_bits: int, policies: Any, *, now: float | None = None
                     ) -> None:
        """Replace the policy table: ``policies[p]`` (a SlotPolicy; None: the default)
        rules the ids of policy index ``p``. Rows are re-assigned to the new indices;
        counters of indices kept are kept; a lower ``max_rows`` evicts at once, a shorter
        TTL expires at the next :meth:`expire`. ``now`` (default ``time.monotonic()``) stamps
        the rows present when the first TTL or cap appears."""
        self._open()
        bits, pols = _pol.check_policies(prefix_bits, policies)
        now = time.monotonic() if now is None else float(now)
        old = self._pstats
        self._pbits, self._pols = bits, pols
        self._pstats = [old[i] if i < len(old) else dict.fromkeys(_pol.STAT_KEYS, 0)
                        for i in range(len(pols))]
        for st in self._pstats:
            st["rows"] = 0
        self._policed = any(not q.is_default for q in pols)
        if any(q.min_count > 1 for q in pols):
            if self._sketch is None:
                self._sketch = _pol.PySketch(self._sketch_bytes)
        else:
            self._sketch = None
        need_ttl = any(q.ttl_s is not None or q.ttl_steps is not None for q in pols)
        if need_ttl or any(q.max_rows is not None for q in pols):
            if self._plru is None or (need_ttl and not self._has_ttl):
                t = (np.float32(now - self._epoch), self._steps & 0xFFFFFFFF)
                self._stamps = dict.fromkeys(self._lru, t)
            self._plru = [OrderedDict() for _ in pols]
            self._has_ttl = need_ttl
        else:
            self._plru, self._stamps, self._has_ttl = None, {}, False
        self._marked.clear()
        for key in self._lru:             # oldest first: each list in global LRU order
            pi = self._policy(key)
            self._pstats[pi]["rows"] += 1
            if self._plru is not None:
                self._plru[pi][key] = None
        bumped = False
        for pi, q in enumerate(pols):
            while self._plru is not None and q.max_rows is not None \
                    and self._pstats[pi]["rows"] > q.max_rows:
                if not bumped:
                    self._cver += 1
                    self._version += 1
                    bumped = True
                self._drop(next(iter(self._plru[pi])), None, "evicted_cap")

    def expire(self, now: float | None = None, max_rows: int = _pol.EXPIRE_ROWS) -> int:
        """Evict the rows past their policy's TTL (``now``, default ``time.monotonic()``),
        at most ``max_rows``; returns how many. See the module docstring."""
        self._open()
        limit = _pol.check_expire_rows(max_rows)
        rel = (time.monotonic() if now is None else float(now)) - self._epoch
        n = moved = 0
        if self._plru is None:
            return 0
        step = self._steps & 0xFFFFFFFF
        for pi, q in enumerate(self._pols):
            if q.ttl_s is None and q.ttl_steps is None:
                continue
            lru = self._plru[pi]
            while n < limit and lru:
                key = next(iter(lru))
                t, s = self._stamps[key]
                if (q.ttl_s is not None and rel - float(t) >= q.ttl_s) or \
                        (q.ttl_steps is not None and (step - s) & 0xFFFFFFFF >= q.ttl_steps):
                    if n == 0:
                        self._cver += 1
                        self._version += 1
                    self._drop(key, None, "expired")
                    n += 1
                elif key in self._marked and moved < limit:
                    self._requeue(lru, key)
                    moved += 1
                else:
                    break
        return n

    def policy_stats(self) -> dict[int, dict[str, int]]:
        """Per policy index: rows, admitted, rejected, dropped_grads, expired,
        evicted_lru, evicted_cap."""
        return {i: dict(st) for i, st in enumerate(self._pstats)}

    def sketch_counts(self, ids: np.ndarray) -> np.ndarray:
        """The frequency sketch's estimates for ``ids`` (int64; zeros without a sketch);
        counts nothing. For tests and diagnostics."""
        ids = check_ids(ids)
        if self._sketch is None:
            return np.zeros(len(ids), np.int64)
        return np.array([self._sketch.estimate(k) for k in ids.tolist()], np.int64)

    def sketch_state(self) -> tuple[np.ndarray, int] | None:
        """``(counters, counted)``: a copy of the frequency sketch (uint8 ``(SKETCH_DEPTH,
        w)``) and its counts since the last halving; None without a sketch. ``dump`` ends
        with it (:func:`policies.sketch_chunk`) and ``load`` merges it back."""
        self._open()
        if self._sketch is None:
            return None
        return self._sketch.counters.copy(), self._sketch.counted

    def _merge_sketch(self, chunk: dict[str, Any]) -> None:
        counters, counted, _ = _pol.check_sketch_chunk(chunk)
        if self._sketch is None:
            self._sketch = _pol.PySketch(self._sketch_bytes)
        sk = self._sketch
        _pol.merge_counters(sk.counters, counters)
        sk.counted = min(max(sk.counted, counted), sk.width)

    def memory_bytes(self) -> int:
        """Bytes held by row storage, with each row's id and change version, and by the
        eviction log (16 bytes an entry; the dict and list overhead is not counted), and
        by the frequency sketch."""
        return sum(self.memory_breakdown().values())

    def memory_breakdown(self) -> dict[str, int]:
        """``{"rows", "bookkeeping"}``: bytes of row storage (weights at their dtype's
        size, as the Cython store lays them out, and float32 optimizer state) and of
        everything else :meth:`memory_bytes` counts; they add up to it."""
        if self._closed:
            return {"rows": 0, "bookkeeping": 0}
        rows = sum(len(a.data) * (_rdt.weight_bytes(a.dim, a.code)
                                  + 4 * (a.data.shape[1] - a.dim))
                   for a in self._arenas.values())
        keys = sum(a.keys.nbytes + a.ver.nbytes for a in self._arenas.values())
        return {"rows": rows, "bookkeeping": keys + 16 * len(self._elog)
                + (self._sketch.nbytes if self._sketch is not None else 0)}

    def dump(self, chunk_rows: int = DUMP_CHUNK_ROWS) -> Iterator[dict[str, Any]]:
        """Yield the rows with their optimizer state, least recently used first.

        Rows are taken in windows of ``chunk_rows`` in LRU order; each window yields one chunk
        per dim (dims in order of first appearance), ``{"dim", "ids" (uint64 (n,)),
        "weights" (float32 (n, dim)), "state" (float32 (n, width)), "state_kind"}``. A
        store with a frequency sketch then yields it as a chunk of no rows
        (:func:`policies.sketch_chunk`), so that a checkpoint keeps the counts of ids not
        yet admitted.
        Loading the chunks in order reproduces the recency order exactly within a dim.
        Changing the store while iterating raises Misuse.
        """
        self._open()
        return self._dump(check_chunk_rows(chunk_rows))

    def _dump(self, chunk_rows: int) -> Iterator[dict[str, Any]]:
        self._open()   # closed between dump() and the first chunk
        version = self._version
        items = iter(list(self._lru.items()))
        while True:
            window = [kv for _, kv in zip(range(chunk_rows), items, strict=False)]
            if not window:
                break
            groups: dict[int, list[tuple[int, int]]] = {}
            for key, (arena, r) in window:
                groups.setdefault(arena.dim, []).append((key, r))
            for dim, members in groups.items():
                data = np.array([self._lru[k][0].data[r] for k, r in members], np.float32)
                chunk = {"dim": dim, "ids": np.array([k for k, _ in members], np.uint64),
                         "weights": np.ascontiguousarray(data[:, :dim]),
                         "state": np.ascontiguousarray(data[:, dim:]),
                         "state_kind": self._opt.state_kind}
                yield chunk
                if self._version != version:
                    raise Misuse("the embedding store changed while it was being dumped",
                                 hint="pause lookups and updates until dump() is exhausted")
        sketch = self.sketch_state()
        if sketch is not None:     # the frequency sketch's counts go with the rows
            yield _pol.sketch_chunk(*sketch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.dump()

    def load(self, chunks: Iterable[dict[str, Any]]) -> None:
        """Insert dumped rows (overwriting stored ids) as the most recently used, in order.

        A chunk without ``"state"`` gets the optimizer's initial state. A chunk is validated
        as a whole before any of it is applied. A sketch chunk (a dump's last, while its
        store had a frequency sketch) is merged into this store's sketch
        (:func:`policies.merge_counters`: no id's count goes down), which is made (within
        ``sketch_bytes``) if the store has none yet: policies set after a restore find the
        counts; a ``set_policies`` without a ``min_count`` drops it, as it drops any sketch.
        """
        self._open()
        for chunk in chunks:
            dim, ids, weights, state = check_chunk(chunk, self._opt)
            if "sketch" in chunk:
                self._merge_sketch(chunk)
                continue
            keys = ids.tolist()
            for key in keys:
                where = self._lru.get(key)
                if where is not None and where[0].dim != dim:
                    raise dim_error(key, where[0].dim, dim, "load")
            self._version += 1
            if keys:
                self._cver += 1
            self._stamp_call(False)
            for i, key in enumerate(keys):
                where = self._lru.get(key)
                pi = self._policy(key)
                if where is None:   # a new row takes its group's dtype (converted)
                    self._make_room(pi, None)
                    arena = self._arena(dim, _rdt.dtype_code(self._pols[pi].dtype))
                    where = (arena, arena.alloc(key, self._cver))
                    self._lru[key] = where
                    self._pstats[pi]["rows"] += 1
                else:
                    self._lru.move_to_end(key)
                self._added(key, pi)
                arena, r = where
                arena.ver[r] = self._cver
                arena.data[r, :dim] = _rdt.round_weights(weights[i], arena.code)
                arena.data[r, dim:] = arena.init_state if state is None else state[i]

    # --- changed-row tracking ----------------------------------------------------------

    @property
    def change_version(self) -> int:
        """Version of the latest mutating call (0 for a fresh store); see the module
        docstring for which calls count and what they stamp."""
        return self._cver

    def advance_version(self, version: int) -> None:
        """``change_version = max(change_version, version)``: the next mutating call stamps
        ``max(...) + 1``. A :class:`~stream_persia.server.sharded.ShardedStore` uses it to
        stamp one version across its shards."""
        self._cver = max(self._cver, check_version(version, "version"))

    def remove(self, ids: np.ndarray) -> int:
        """Drop the stored rows of ``ids`` (the others are ignored); returns how many were
        removed. Each is logged in the eviction log, counted in ``stats()["removals"]``
        (not in ``evictions``). A call with at least one id is a mutating call."""
        self._open()
        ids = check_ids(ids)
        if not len(ids):
            return 0
        self._cver += 1
        removed = 0
        for key in ids.tolist():
            if key in self._lru:
                self._drop(key, None, None)
                removed += 1
        self._counts["removals"] += removed
        if removed:
            self._version += 1
        return removed

    def changed_since(self, since: int, chunk_rows: int = DUMP_CHUNK_ROWS, *,
                      state: bool = False) -> Iterator[dict[str, Any]]:
        """The stored rows whose change version is > ``since``, in chunks
        ``{"dim", "ids" (uint64 (n,)), "weights" (float32 (n, dim)), "versions" (int64
        (n,))}`` of one dim each and at most ``chunk_rows`` rows; with ``state``, also
        their optimizer state read at the same moment (``"state"``, ``"state_kind"``, as
        ``dump`` gives them: an incremental checkpoint).

        The store is scanned in windows of at most ``chunk_rows`` row slots (the Cython
        store: entries); each ``next()`` reads one window whole (ids, weights and versions
        at the same moment) and yields its chunks, or one empty chunk (``dim`` 0, no rows)
        when nothing in it changed, so that every ``next()`` is a short, bounded pause
        and a pass over the store costs a scan of all its slots. The store may be used
        between chunks: a row changed after the call may or may not be included, with its
        value and version of when its window was read. A caller that publishes changes
        reads ``change_version`` *before* calling and gets the rest in its next pass.
        Order and chunking depend on the store's layout; the set of rows does not.
        """
        self._open()
        return self._changed(check_version(since, "since"), check_chunk_rows(chunk_rows),
                             bool(state))

    def _changed(self, since: int, chunk_rows: int, state: bool
                 ) -> Iterator[dict[str, Any]]:
        for (dim, code), arena in sorted(self._arenas.items()):
            pos = 0
            while True:
                self._open()   # closed between chunks
                if self._arenas.get((dim, code)) is not arena or pos >= arena.used:
                    break      # cleared: its rows are gone (evicted_since says so)
                end = min(pos + chunk_rows, arena.used)
                rows = np.flatnonzero(arena.ver[pos:end] > since) + pos
                pos = end
                if not len(rows):
                    yield empty_changes()
                    continue
                chunk = {"dim": dim, "ids": arena.keys[rows], "versions": arena.ver[rows],
                         "weights": np.ascontiguousarray(arena.data[rows, :dim])}
                if state:
                    chunk.update(state=np.ascontiguousarray(arena.data[rows, dim:]),
                                 state_kind=self._opt.state_kind)
                yield chunk

    def evicted_since(self, since: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """``(ids uint64, versions int64, complete)``: the ids evicted (LRU) or removed
        by calls with change version > ``since``, oldest first, from the eviction log.
        ``complete`` is False when the log no longer covers ``since``: it dropped an entry
        newer than ``since`` (it holds ``eviction_log`` entries), or a ``clear()`` or
        ``close()`` came after ``since``; the caller then resyncs from
        ``changed_since(0)``. Works on a closed store."""
        since = check_version(since, "since")
        complete = since >= self._elog_dropped and since >= self._reset_ver
        newer = [kv for kv in self._elog if kv[1] > since]
        ids = np.array([k for k, _ in newer], np.uint64)
        versions = np.array([v for _, v in newer], np.int64)
        return ids, versions, complete
