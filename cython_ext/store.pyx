# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""Cython LRU embedding store (``stream_persia.server._cstore``).

Same interface and the same results, bit for bit, as the pure-Python twin
``stream_persia.server._pystore.PyEmbeddingStore``, which documents the semantics, the
validation and the hash functions both use. Layout, chosen for memory (about 50 bytes of
bookkeeping per row at full load) and for loops that run without the GIL:

- ``entries``: one 32-byte ``Entry`` per stored row (id, intrusive doubly linked LRU list,
  arena and row of its vector), reused through a free list threaded through ``next``;
- ``table``: open addressing with linear probing, load <= 1/2, slots of (32-bit hash, entry)
  so that probing past other keys and rehashing never touch the entries; deletion shifts
  the cluster back (no tombstones, so probes stay short under constant eviction);
- one arena per (dim, weight dtype): rows ``[weights(dim) | optimizer state]`` in blocks of
  about 2 MiB (memory grows by a block, never by doubling), free rows threaded through their
  first word. Weights are float32, or float16 / bfloat16 for a group whose policy says so
  (compact rows, issue 20; the rounding is ``row_dtypes``'s), padded to 4 bytes, then the
  float32 state: a row is addressed in floats either way. The call's dim picks the float32
  arena; a hit in another arena of the same dim is a compact row, read and written through
  sp_widen / sp_narrow (store_kernels.h), and an update steps it in float32 in a loop of
  its own (``_apply_compact``), so a store without compact rows runs the loops it ran
  before (0.99x lookups, 0.99x updates of the build before in load_tests/bench_store.py
  --old-build). While a store has a compact arena (a policy with a compact dtype has
  been set and a training lookup or load of that dim ran), every call takes those
  loops: float16 rows run at 0.78x the lookup and 0.82x the update rate of float32 rows
  (bench_store --dtype-batches, dim 16, Adagrad). A pooled lookup then copies rows out
  (as ``lookup``) and pools them;
- change tracking (semantics in ``_pystore``'s docstring): each ``Entry`` holds the
  ``change_version`` of its row's last change, less the store's ``vbase``, in 32 bits that
  were update()'s per-call stamp: no byte more per row, and no cache line more on any hot
  path (a parallel int64 array cost 7-10% of lookup and update rates in
  load_tests/bench_store.py). ``update`` tells its first sight of an entry in a call by
  the entry already holding the call's version (restoring the old versions if the call
  fails); ``vbase`` moves once in 2**31 mutating calls (``_rebase``). Evictions and removals
  go to the eviction log, a ring of (id, version) that grows by doubling up to
  ``eviction_log`` entries (16 bytes each). ``changed_since`` reads entries in windows
  of ``chunk_rows``, each window read whole, GIL released, under the busy guard, so a pass
  is many short pauses. The entries are those of the *dirty list* when ``since`` is at or
  after its mark (the version of the previous such call): an int32 per entry changed
  since, appended when a stamp first takes an entry past the mark (one compare on the hot
  paths, which already write the entry's version), at most one per entry, so a publisher's
  pass costs what changed. Otherwise (an older ``since``) they are all the entries, a full
  scan (a few ms per million entries). See ``_dirty`` in store_table.pxi.

Table policies (issue 20: frequency admission, TTL, per-group caps; semantics in
``_pystore``'s docstring) are in store_policy.pxi: an entry's policy index fills its spare
16 bits, and what only policies need (the sketch, the per-policy LRU links and the stamps
of the last training lookup) is allocated only while a policy needs it, so a store without
policies reads and writes what it did before (0.98x the lookup rate and 1.00x the update
rate of the build before them in load_tests/bench_store.py, within its noise).

Large buffers are mapped directly and, past the first block, on transparent huge pages. The
store is bound by memory latency, so the batched loops prefetch a few ids ahead (table
slot, then entry, then row and LRU neighbours) and eviction prefetches the next victims.
Table slots are 8 per cache line and a probe often runs past the home slot's line (to the
empty slot ending a miss, or through the shift back after a deletion), so both fetch the
following line too (about 5% more lookups per second in load_tests/bench_store.py).
The optimizer kernels are C compiled without floating-point contraction so that they
perform the same float32 operations as the numpy reference in ``optim.py``. Every batched
loop runs with the GIL released. A store is not thread-safe: a second call while one is
running raises Misuse instead of corrupting it.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

import time

import numpy as np

from stream_persia.kernels import segments as _segments
from stream_persia.server import _pystore as _py
from stream_persia.server import policies as _pol
from stream_persia.server import row_dtypes as _rdt
from stream_persia.core.optim import as_optimizer
from stream_persia.errors import BadInput, Misuse

# This module's Cython is split by responsibility into the .pxi files included here (they
# compile as part of this module), and its C kernels are in store_kernels.h. The store's
# private routines are functions taking the store (``self``) rather than cdef methods
# because Cython allows no ``include`` in a class body; calls to them are direct C calls,
# as calls to the cdef methods of this final class were.
include "store_defs.pxi"      # the C kernels' declarations, structs, constants
include "store_memory.pxi"    # entries, hash table and arena memory; configuration
include "store_policy.pxi"    # table policies: admission sketch, TTL, per-group caps
include "store_table.pxi"     # hash table, LRU list, prefetching, admission, eviction
include "store_batch.pxi"     # guards; the batched loops of lookup, lookup_pooled, update


cdef list _changed_rows(CEmbeddingStore self, sel, bint with_state):
    """The chunks (one per dim) of the entries ``sel`` (int32): ids, weights, versions,
    and (``with_state``) the optimizer state read at the same moment."""
    cdef int32_t[::1] sv = sel, gv
    cdef int64_t m = sv.shape[0], k, g
    cdef uint64_t[::1] kv
    cdef float[:, ::1] wv, stv
    cdef bint copy_state
    cdef int64_t[::1] vv
    cdef Arena *a
    cdef Entry *x
    arena_of = np.empty(m, np.int32)
    gv = arena_of
    for k in range(m):
        gv[k] = self.entries[sv[k]].arena
    chunks = []
    for ai in np.unique(arena_of).tolist():
        members = np.ascontiguousarray(sel[arena_of == ai])
        gv = members
        g = members.shape[0]
        a = &self.arenas[<int>ai]
        ids = np.empty(g, np.uint64)
        weights = np.empty((g, a.dim), np.float32)
        versions = np.empty(g, np.int64)
        kv, wv, vv = ids, weights, versions
        copy_state = with_state and a.width > 0
        if with_state:
            state = np.empty((g, a.width), np.float32)
            if copy_state:
                stv = state
        with nogil:
            for k in range(g):
                if k + PF_ROW < g:
                    sp_prefetch(row_ptr(a, self.entries[gv[k + PF_ROW]].row))
                x = &self.entries[gv[k]]
                kv[k] = x.key
                vv[k] = self.vbase + x.ver
                sp_read_w(&wv[k, 0], row_ptr(a, x.row), a.dim, a.dtype)
                if copy_state:
                    memcpy(&stv[k, 0], row_ptr(a, x.row) + a.wlen, sizeof(float) * a.width)
        chunk = {"dim": a.dim, "ids": ids, "weights": weights, "versions": versions}
        if with_state:
            chunk.update(state=state, state_kind=self._opt_obj.state_kind)
        chunks.append(chunk)
    return chunks


def round_weights(x, int code):
    """float32 ``x`` (1-d) stored as dtype ``code`` by this store's kernels and read back:
    what ``row_dtypes.round_weights`` must equal bit for bit (for its tests)."""
    src = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.empty_like(src)
    cdef const float[::1] sv = src
    cdef float[::1] ov = out
    cdef int64_t n = src.shape[0], i, step = 1 << 20
    cdef int d
    cdef uint16_t *tmp
    if code == 0 or n == 0:
        return src.copy()
    tmp = <uint16_t*>malloc(sizeof(uint16_t) * step)
    if tmp == NULL:
        raise MemoryError()
    with nogil:
        i = 0
        while i < n:
            d = <int>(step if n - i > step else n - i)
            sp_narrow(tmp, &sv[i], d, code)
            sp_widen(&ov[i], tmp, d, code)
            i += d
    free(tmp)
    return out


@cython.final
cdef class CEmbeddingStore:
    """LRU embedding store in Cython; see ``PyEmbeddingStore`` for the full contract.

    Args:
        capacity: the most vectors stored (all dims together).
        optimizer: SGD, Adagrad or Adam (or its ``to_dict()``).
        embedding_config: initialisation, admission and clamping (defaults: PERSIA's).
        eviction_log: entries of the log of evicted ids.
        sketch_bytes: memory of the frequency-admission sketch.
    """

    cdef Entry *entries
    cdef int32_t ecap, eused, efree, head, tail, count, capacity_
    cdef Slot *table
    cdef int tbits
    cdef Arena *arenas
    cdef int narenas
    cdef SpOpt opt
    cdef float init_lo, init_span
    cdef double admit_p
    cdef float *gbuf         # scratch (see _scratch): update's summed gradients,
    cdef float **rbuf        # row pointers (update, lookup_pooled),
    cdef float *zbuf         # and the all-zero row a miss reads as
    cdef int32_t *ebuf       # update's entries of its unique ids, and their versions
    cdef uint32_t *obuf      # before the call (restored if it fails)
    cdef size_t gbuf_bytes, rbuf_bytes, zbuf_bytes, ebuf_bytes, obuf_bytes
    cdef int64_t n_lookups, n_misses, n_admissions, n_evictions, n_updates, n_dropped
    cdef int64_t n_removals, n_nonfinite
    cdef float *kbuf         # update's copy of a row before its step (see _step)
    cdef size_t kbuf_bytes
    cdef int64_t cver        # change_version
    cdef int64_t vbase       # Entry.ver is a version less vbase (see _rebase)
    cdef int64_t reset_ver   # change_version of the last clear() or close()
    cdef EvictionLog elog
    cdef int32_t *dlist      # the dirty list (see _dirty): entries stamped past the mark,
    cdef int64_t dlen, dcap  # each at most once
    cdef int64_t mark        # its mark, a change version
    cdef int64_t mrel        # mark - vbase while the list is kept, -1 while it is not
    cdef uint64_t draws
    cdef int64_t version
    cdef Pol *pol            # the policy table (store_policy.pxi), npol >= 1 entries
    cdef int32_t npol
    cdef int pbits
    cdef bint policed        # a policy is not the default: misses take _admit_policed
    cdef bint use_aux, has_ttl
    cdef Aux *aux            # parallel to entries while use_aux (a TTL or a cap exists)
    cdef Stamp *stamps       # parallel to entries while has_ttl
    cdef uint8_t *sketch     # SKETCH_DEPTH << sk_bits counters while a min_count > 1
    cdef int sk_bits
    cdef int64_t sk_count    # counts since the last halving
    cdef uint64_t seeds[SKETCH_DEPTH]
    cdef int64_t steps       # training lookup calls with at least one id
    cdef double epoch        # time.monotonic() when the store was made (the TTL clock)
    cdef Stamp stamp         # the stamp of the call under way (see _stamp_now)
    cdef float *ibuf         # lookup's initial row of an id below its min_count; the
                             # float32 weights of a compact row in update and admission
    cdef int32_t cur_ai[3]   # the call's arena of its dim per dtype (see _dt_arenas)
    cdef int ncompact        # arenas of compact rows (float16, bfloat16)
    cdef int dtmask          # bit dt: some policy stores new rows in dtype dt
    cdef int adm_dt          # dtype of the row _admit_policed last stored
    cdef size_t ibuf_bytes
    cdef bint busy, closed
    cdef object _opt_obj, _cfg, _dims

    implementation = "cython"

    def __init__(self, capacity, optimizer, embedding_config=None, *,
                 eviction_log=_py.EVICTION_LOG, sketch_bytes=_pol.SKETCH_BYTES):
        self.capacity_ = _py.check_capacity(capacity)
        self.sk_bits = _pol.sketch_bits(_pol.check_sketch_bytes(sketch_bytes))
        for j in range(SKETCH_DEPTH):
            self.seeds[j] = _pol.SKETCH_SEEDS[j]
        self.epoch = time.monotonic()
        self.pol = <Pol*>calloc(1, sizeof(Pol))
        if self.pol == NULL:
            raise MemoryError()
        self.npol = 1
        self.dtmask = 1
        self.pol[0].admit_p = self.pol[0].ttl_s = -1.0
        self.pol[0].min_count = 1
        self.elog.limit = _py.check_eviction_log(eviction_log)
        self.mrel = -1           # no list until the first changed_since
        self._opt_obj = as_optimizer(optimizer)
        _set_config(self, _py.check_config(embedding_config))
        _reset(self)

    def __dealloc__(self):
        _release(self)
        sp_free(self.ibuf, self.ibuf_bytes)
        sp_free(self.kbuf, self.kbuf_bytes)
        free(self.pol)

    # --- public interface ------------------------------------------------------------------

    @property
    def capacity(self):
        """Most vectors held."""
        return self.capacity_

    @property
    def optimizer(self):
        """The embedding optimizer."""
        return self._opt_obj

    @property
    def embedding_config(self):
        """The EmbeddingConfig in force."""
        return self._cfg

    def __len__(self):
        return self.count

    def close(self):
        """Free the rows now; see ``PyEmbeddingStore.close``. Idempotent."""
        if self.closed:
            return
        _enter(self)
        try:
            _release(self)
            self.count = self.ecap = self.eused = 0
            self.efree = self.head = self.tail = -1
            self.version += 1
            _bump(self)
            self.reset_ver = self.cver
            self.closed = True
        finally:
            self.busy = False

    def lookup(self, ids, dim, train=True):
        """Embeddings of ``ids`` as float32 (n, dim); see ``PyEmbeddingStore.lookup``."""
        _open(self)
        ids = _py.check_ids(ids)
        cdef int d = _py.check_dim(dim)
        cdef bint tr = bool(train)
        cdef int ai = _arena_index(self, d, tr)
        if tr and self.policed:
            _dt_arenas(self, d)
        cdef int64_t n = ids.shape[0]
        out = np.empty((n, d), np.float32)
        if n == 0:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef float[:, ::1] o = out
        cdef int64_t i = 0
        cdef int status = OK
        cdef const float *zero
        _enter(self)
        try:
            zero = _zeros(self, d)   # scratch grows only under the busy guard
            self.n_lookups += n
            if tr:
                self.version += 1
                _bump(self)
                self.steps += 1
                if self.use_aux:
                    _stamp_now(self)
                if self.policed:
                    _scratch(self, <void**>&self.ibuf, &self.ibuf_bytes, sizeof(float) * d)
            with nogil:
                if self.ncompact:
                    status = _lookup_mixed(self, &keys[0], n, ai, &o[0, 0], d, tr, &i, zero)
                else:
                    status = _lookup(self, &keys[0], n, ai, &o[0, 0], d, tr, &i, zero)
        finally:
            self.busy = False
        if status != OK:
            _raise(self, status, i, ids, d, "lookup")
        return out

    def lookup_pooled(self, ids, dim, index, offsets, train=True):
        """Segment sums of the rows of ``ids``; see ``PyEmbeddingStore.lookup_pooled``.

        The rows are added where they lie in the store, each as it is looked up, so the
        ``(len(ids), dim)`` rows are never copied out. A training lookup that could evict
        (more ids than free capacity) copies them first instead, as ``lookup`` does: an
        admission may evict a row that an earlier id of the same call returned."""
        _open(self)
        ids = _py.check_ids(ids)
        cdef int d = _py.check_dim(dim)
        _segments.check_pooled(ids.shape[0], index, offsets, "lookup_pooled")
        cdef bint tr = bool(train)
        cdef int ai = _arena_index(self, d, tr)
        cdef int64_t n = ids.shape[0], k = offsets.shape[0] - 1
        cdef const int32_t[::1] ix = index
        cdef const int64_t[::1] off = offsets
        cdef int64_t i = 0
        cdef int status = OK
        # With policies, an admission may evict (a cap) or return a row held in scratch;
        # a compact row is widened as it is copied out.
        if self.ncompact or (tr and (self.policed or <int64_t>self.count + n > self.capacity_)):
            return _segments.pool(self.lookup(ids, d, tr), index, offsets, "lookup_pooled")
        out = np.zeros((k, d), np.float32)
        if n == 0:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef float[:, ::1] o = out
        cdef const int32_t *ixp = &ix[0] if ix.shape[0] else NULL
        cdef const float *zero
        _enter(self)
        try:
            zero = _zeros(self, d)
            _scratch(self, <void**>&self.rbuf, &self.rbuf_bytes, sizeof(float*) * n)
            self.n_lookups += n
            if tr:
                self.version += 1
                _bump(self)
                self.steps += 1
            with nogil:
                status = _lookup_pooled(self, &keys[0], n, ai, d, tr, ixp, &off[0], k,
                                             &o[0, 0], &i, zero)
        finally:
            self.busy = False
        if status != OK:
            _raise(self, status, i, ids, d, "lookup")
        return out

    def update(self, ids, grads):
        """Apply the optimizer to the rows of ``ids``; see ``PyEmbeddingStore.update``."""
        _open(self)
        ids = _py.check_ids(ids)
        grads = _py.check_grads(grads, len(ids))
        cdef int64_t n = ids.shape[0], i = 0
        cdef int dim = grads.shape[1]
        if n == 0:
            return
        cdef int ai = _arena_index(self, dim, False)
        cdef const uint64_t[::1] keys = ids
        cdef const float[:, ::1] g = grads
        cdef int status = OK
        _enter(self)
        try:
            _scratch(self, <void**>&self.gbuf, &self.gbuf_bytes, sizeof(float) * n * dim)
            _scratch(self, <void**>&self.rbuf, &self.rbuf_bytes, sizeof(float*) * n)
            _scratch(self, <void**>&self.ebuf, &self.ebuf_bytes, sizeof(int32_t) * n)
            _scratch(self, <void**>&self.obuf, &self.obuf_bytes, sizeof(uint32_t) * n)
            # a row's weights and state (at most Adam's 2 dim + 2), kept for _step
            _scratch(self, <void**>&self.kbuf, &self.kbuf_bytes, sizeof(float) * (3 * dim + 2))
            if self.ncompact:
                _scratch(self, <void**>&self.ibuf, &self.ibuf_bytes, sizeof(float) * dim)
            with nogil:
                status = _update(self, &keys[0], &g[0, 0], n, dim, ai, &i)
        finally:
            self.busy = False
        if status != OK:
            _raise(self, status, i, ids, dim, "update")

    def contains(self, ids):
        """Which ids are stored (bool array); recency is not refreshed."""
        _open(self)
        ids = _py.check_ids(ids)
        cdef int64_t n = ids.shape[0], i
        out = np.zeros(n, np.bool_)
        if n == 0:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef unsigned char[::1] o = out.view(np.uint8)
        cdef Pipe p
        p.keys, p.n, p.lines, p.links = &keys[0], n, 0, False
        _enter(self)
        try:
            with nogil:
                for i in range(-PF_SLOT, n):
                    _stage(self, &p, i)
                    if i >= 0:
                        o[i] = _resolve(self, &p, i) >= 0
        finally:
            self.busy = False
        return out

    def clear(self):
        """Drop every row (statistics are kept)."""
        _open(self)
        _enter(self)
        try:
            _reset(self)
            self.version += 1
            _bump(self)
            self.reset_ver = self.cver
            _log_clear(&self.elog)
        finally:
            self.busy = False

    def configure(self, optimizer=None, embedding_config=None):
        """Replace the optimizer and/or config; see ``PyEmbeddingStore.configure``."""
        _open(self)
        cdef int ai
        opt = self._opt_obj if optimizer is None else as_optimizer(optimizer)
        cfg = self._cfg if embedding_config is None else _py.check_config(embedding_config)
        _enter(self)
        try:
            restate = opt.state_kind != self._opt_obj.state_kind
            self._opt_obj = opt
            _set_config(self, cfg)
            for ai in range(self.narenas):
                if restate:
                    _restate(self, &self.arenas[ai])
                else:
                    _set_arena_state(self, &self.arenas[ai])
            self.version += 1
        finally:
            self.busy = False

    def stats(self):
        """Counters: rows, capacity, lookups, misses, admissions, evictions, updates,
        dropped_updates, removals, nonfinite_updates."""
        return {"rows": self.count, "capacity": self.capacity_, "lookups": self.n_lookups,
                "misses": self.n_misses, "admissions": self.n_admissions,
                "evictions": self.n_evictions, "updates": self.n_updates,
                "dropped_updates": self.n_dropped, "removals": self.n_removals,
                "nonfinite_updates": self.n_nonfinite}

    # --- table policies (issue 20; see PyEmbeddingStore) ------------------------------

    def set_policies(self, prefix_bits, policies, *, now=None):
        """Replace the policy table; see ``PyEmbeddingStore.set_policies``."""
        _open(self)
        bits, pols = _pol.check_policies(prefix_bits, policies)
        cdef double t = time.monotonic() if now is None else float(now)
        _enter(self)
        try:
            _set_policies(self, bits, pols, t)
        finally:
            self.busy = False

    def expire(self, now=None, max_rows=_pol.EXPIRE_ROWS):
        """Evict rows past their TTL; see ``PyEmbeddingStore.expire``."""
        _open(self)
        cdef int64_t limit = _pol.check_expire_rows(max_rows), n = 0
        cdef double rel = (time.monotonic() if now is None else float(now)) - self.epoch
        if not self.has_ttl:
            return 0
        _enter(self)
        try:
            with nogil:
                n = _expire(self, rel, limit)
            if n:
                self.version += 1
        finally:
            self.busy = False
        return n

    def policy_stats(self):
        """Per policy index: rows, admitted, rejected, dropped_grads, expired,
        evicted_lru, evicted_cap."""
        return _policy_stats(self)

    def sketch_counts(self, ids):
        """The frequency sketch's estimates for ``ids``; see
        ``PyEmbeddingStore.sketch_counts``."""
        ids = _py.check_ids(ids)
        cdef int64_t n = ids.shape[0], i
        out = np.zeros(n, np.int64)
        if n == 0 or self.sketch == NULL:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef int64_t[::1] o = out
        _enter(self)    # set_policies may free the sketch while the loop reads it
        try:
            with nogil:
                for i in range(n):
                    o[i] = _sketch_estimate(self, keys[i])
        finally:
            self.busy = False
        return out

    def sketch_state(self):
        """``(counters, counted)``: a copy of the frequency sketch and its counts since the
        last halving, or None without one; see ``PyEmbeddingStore.sketch_state``."""
        _open(self)
        if self.sketch == NULL:
            return None
        out = np.empty((SKETCH_DEPTH, <int64_t>1 << self.sk_bits), np.uint8)
        cdef uint8_t[:, ::1] ov = out
        memcpy(&ov[0, 0], self.sketch, (<size_t>SKETCH_DEPTH) << self.sk_bits)
        return out, int(self.sk_count)

    def memory_bytes(self):
        """Bytes allocated for rows, entries (with their change versions), the hash table,
        block pointers, the eviction log, the dirty list, and the policies' sketch and
        per-entry links and stamps."""
        cdef int ai
        cdef Arena *a
        if self.closed:
            return 0
        cdef int64_t total = sizeof(Entry) * <int64_t>self.ecap
        total += sizeof(Pol) * self.npol
        if self.use_aux:
            total += sizeof(Aux) * <int64_t>self.ecap
        if self.has_ttl:
            total += sizeof(Stamp) * <int64_t>self.ecap
        if self.sketch != NULL:
            total += (<int64_t>SKETCH_DEPTH) << self.sk_bits
        total += sizeof(Evicted) * self.elog.cap + sizeof(int32_t) * self.dcap
        total += sizeof(Slot) * (<int64_t>1 << self.tbits)
        for ai in range(self.narenas):
            a = &self.arenas[ai]
            total += <int64_t>a.nblocks * (sizeof(float) * a.stride << a.shift)
            total += sizeof(float*) * a.blocks_cap + sizeof(Arena)
        return total

    def memory_breakdown(self):
        """``{"rows", "bookkeeping"}``: bytes of row storage (the arenas' blocks: weights
        and optimizer state) and of everything else ``memory_bytes`` counts; they add up
        to it."""
        cdef int ai
        cdef int64_t rows = 0
        if self.closed:
            return {"rows": 0, "bookkeeping": 0}
        for ai in range(self.narenas):
            rows += <int64_t>self.arenas[ai].nblocks * _block_bytes(&self.arenas[ai])
        return {"rows": rows, "bookkeeping": self.memory_bytes() - rows}

    def dump(self, chunk_rows=_py.DUMP_CHUNK_ROWS):
        """Yield rows with optimizer state, least recently used first; see
        ``PyEmbeddingStore.dump`` for the chunk format."""
        _open(self)
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise BadInput(f"chunk_rows must be an int >= 1, got {chunk_rows!r}",
                           field="chunk_rows")
        return self._dump(chunk_rows)

    def _dump(self, int64_t chunk_rows):
        cdef int64_t version = self.version, k, m, nw
        cdef int32_t e = self.tail
        cdef Arena *a
        cdef float *row
        cdef int32_t[::1] wv_e, wv_a, mv
        cdef uint64_t[::1] kv
        cdef float[:, ::1] wv, sv
        _open(self)   # closed between dump() and the first chunk
        while e >= 0:
            window = np.empty(chunk_rows, np.int32)
            dim_of = np.empty(chunk_rows, np.int32)   # a chunk per dim, whatever the dtype
            wv_e, wv_a = window, dim_of
            nw = 0
            while e >= 0 and nw < chunk_rows:
                wv_e[nw] = e
                wv_a[nw] = self.arenas[self.entries[e].arena].dim
                e = self.entries[e].prev
                nw += 1
            window, dim_of = window[:nw], dim_of[:nw]
            _, first = np.unique(dim_of, return_index=True)
            for dim in dim_of[np.sort(first)].tolist():
                members = np.ascontiguousarray(window[dim_of == dim])
                a = &self.arenas[self.entries[members[0]].arena]
                m = len(members)
                ids = np.empty(m, np.uint64)
                weights = np.empty((m, a.dim), np.float32)
                state = np.empty((m, a.width), np.float32)
                mv, kv, wv = members, ids, weights
                if a.width:
                    sv = state
                _enter(self)
                try:
                    with nogil:
                        for k in range(m):
                            a = &self.arenas[self.entries[mv[k]].arena]
                            row = row_ptr(a, self.entries[mv[k]].row)
                            kv[k] = self.entries[mv[k]].key
                            sp_read_w(&wv[k, 0], row, a.dim, a.dtype)
                            if a.width:
                                memcpy(&sv[k, 0], row + a.wlen, sizeof(float) * a.width)
                finally:
                    self.busy = False
                yield {"dim": a.dim, "ids": ids, "weights": weights, "state": state,
                       "state_kind": self._opt_obj.state_kind}
                if self.version != version:
                    raise Misuse("the embedding store changed while it was being dumped",
                                 hint="pause lookups and updates until dump() is exhausted")
        sketch = self.sketch_state()
        if sketch is not None:    # the frequency sketch's counts go with the rows
            yield _pol.sketch_chunk(*sketch)

    def __iter__(self):
        return self.dump()

    def load(self, chunks):
        """Insert dumped rows as the most recently used; see ``PyEmbeddingStore.load``."""
        _open(self)
        cdef int64_t n, i
        cdef int32_t e
        cdef int ai, status, dim
        cdef const uint64_t[::1] kv
        cdef const float[:, ::1] wv
        cdef const float[:, ::1] sv
        cdef float *row
        cdef Arena *a
        cdef bint has_state
        for chunk in chunks:
            dim, ids, weights, state = _py.check_chunk(chunk, self._opt_obj)
            if "sketch" in chunk:
                _merge_sketch(self, chunk)
                continue
            n = len(ids)
            if n == 0:
                continue
            ai = _arena_index(self, dim, True)
            _dt_arenas(self, dim)
            kv, wv = ids, weights
            for i in range(n):
                e = _find(self, kv[i])
                if e >= 0 and self.arenas[self.entries[e].arena].dim != dim:
                    raise _py.dim_error(int(kv[i]), self.arenas[self.entries[e].arena].dim,
                                        dim, "load")
            has_state = state is not None
            if has_state:
                sv = state
            _enter(self)
            status = OK
            self.version += 1
            _bump(self)
            if self.use_aux:
                _stamp_now(self)
            try:
                with nogil:
                    for i in range(n):
                        e = _find(self, kv[i])
                        if e < 0:
                            if self.policed:
                                _make_room_cap(self, _policy_of(self, kv[i]))
                            e = _insert(self, kv[i], self.cur_ai[
                                self.pol[_policy_of(self, kv[i])].dtype])
                            if e < 0:
                                status = E_NOMEM
                                break
                        else:
                            _touch(self, e)
                            if self.use_aux:
                                _pload(self, e)
                            _dirty(self, e, self.entries[e].ver)
                        self.entries[e].ver = _v32(self)
                        a = &self.arenas[self.entries[e].arena]
                        row = row_ptr(a, self.entries[e].row)
                        sp_write_w(row, &wv[i, 0], dim, a.dtype)
                        if a.width:
                            if has_state:
                                memcpy(row + a.wlen, &sv[i, 0], sizeof(float) * a.width)
                            else:
                                memcpy(row + a.wlen, a.init_state, sizeof(float) * a.width)
            finally:
                self.busy = False
            if status != OK:
                raise MemoryError("embedding store: out of memory")

    # --- changed-row tracking (see PyEmbeddingStore) ------------------------------------

    @property
    def change_version(self):
        """Version of the latest mutating call; see ``PyEmbeddingStore.change_version``."""
        return self.cver

    def advance_version(self, version):
        """``change_version = max(change_version, version)``."""
        cdef int64_t v = _py.check_version(version, "version")
        _enter(self)
        try:
            if v > self.cver:
                self.cver = v
                _rebase(self)
        finally:
            self.busy = False

    def remove(self, ids):
        """Drop the stored rows of ``ids``; see ``PyEmbeddingStore.remove``."""
        _open(self)
        ids = _py.check_ids(ids)
        cdef int64_t n = ids.shape[0], i, removed = 0
        cdef int32_t e
        if n == 0:
            return 0
        cdef const uint64_t[::1] keys = ids
        _enter(self)
        try:
            _bump(self)
            with nogil:
                for i in range(n):
                    e = _find(self, keys[i])
                    if e >= 0:
                        _drop(self, e)
                        removed += 1
            self.n_removals += removed
            if removed:
                self.version += 1
        finally:
            self.busy = False
        return removed

    def changed_since(self, since, chunk_rows=_py.DUMP_CHUNK_ROWS, *, state=False):
        """Rows changed after version ``since``, in chunks; see
        ``PyEmbeddingStore.changed_since``. Each chunk comes from one window of at most
        ``chunk_rows`` entries, read whole under the store's guard with the GIL released;
        between chunks the store may be used.

        The windows are of the dirty list (store_table.pxi) when ``since`` is at or after
        its mark, the version at which the previous such call was made: the pass reads
        only the entries stamped since that call (unless they are more than one in
        LISTED_COST of all entries: a scan is cheaper then), and the mark moves to
        ``change_version`` now. Otherwise (an older ``since``, or the first call) the
        windows are of all entries, a full scan; the first call starts the list."""
        _open(self)
        cdef int64_t s = _py.check_version(since, "since")
        cdef int64_t c = _py.check_chunk_rows(chunk_rows)
        cdef int32_t[::1] lv
        listed = None
        _enter(self)
        try:
            if self.mrel >= 0 and s >= self.mark:
                if self.dlen * LISTED_COST <= self.eused:   # else a scan is cheaper
                    listed = np.empty(self.dlen, np.int32)
                    if self.dlen:
                        lv = listed
                        memcpy(&lv[0], self.dlist, sizeof(int32_t) * self.dlen)
                _dirty_mark(self)
            elif self.mrel < 0:
                _dirty_mark(self)
        finally:
            self.busy = False
        return self._changed(s, c, listed, bool(state))

    def _changed(self, int64_t since, int64_t chunk_rows, listed, bint with_state):
        cdef int64_t pos = 0, end, m, k, total
        cdef int32_t e
        cdef int32_t[::1] sv
        cdef const int32_t[::1] lv
        cdef bint full = listed is None
        if not full:
            total = len(listed)
            # A listed entry costs about what LISTED_COST scanned ones do (it is read at
            # random, and so is its row): smaller windows keep each pause as short.
            chunk_rows = max(1, chunk_rows // LISTED_COST)
        while True:
            _open(self)   # closed between chunks
            if full:
                total = self.eused
            if pos >= total:
                return
            sel = np.empty(min(chunk_rows, total - pos), np.int32)
            sv = sel
            chunks = []
            if not full:   # in the order of the entries (and mostly of the rows)
                lv = np.sort(listed[pos:pos + chunk_rows])
            _enter(self)
            try:
                end = min(pos + chunk_rows, self.eused if full else total)
                m = 0
                with nogil:
                    if full:
                        for e in range(<int32_t>pos, <int32_t>end):
                            if self.vbase + self.entries[e].ver > since \
                                    and self.entries[e].arena != FREE_ARENA:
                                sv[m] = e
                                m += 1
                    else:
                        for k in range(end - pos):
                            if k + PF_ENTRY < end - pos:
                                sp_prefetch(&self.entries[lv[k + PF_ENTRY]])
                            e = lv[k]
                            if e < self.eused and self.vbase + self.entries[e].ver > since \
                                    and self.entries[e].arena != FREE_ARENA:
                                sv[m] = e
                                m += 1
                pos = end
                if m:
                    chunks = _changed_rows(self, sel[:m], with_state)
            finally:
                self.busy = False
            if not chunks:
                yield _py.empty_changes()
            for chunk in chunks:
                yield chunk

    def evicted_since(self, since):
        """Ids evicted or removed after version ``since``; see
        ``PyEmbeddingStore.evicted_since``."""
        cdef int64_t s = _py.check_version(since, "since"), lo, hi, mid, n, k
        cdef EvictionLog *lg = &self.elog
        cdef uint64_t[::1] kv
        cdef int64_t[::1] vv
        _enter(self)
        try:
            complete = s >= lg.dropped and s >= self.reset_ver
            lo, hi = 0, lg.len
            while lo < hi:     # entries are in order of version: the first one after since
                mid = (lo + hi) // 2
                if lg.ring[_log_at(lg, mid)].version > s:
                    hi = mid
                else:
                    lo = mid + 1
            n = lg.len - lo
            ids = np.empty(n, np.uint64)
            versions = np.empty(n, np.int64)
            kv, vv = ids, versions
            with nogil:
                for k in range(n):
                    kv[k] = lg.ring[_log_at(lg, lo + k)].key
                    vv[k] = lg.ring[_log_at(lg, lo + k)].version
        finally:
            self.busy = False
        return ids, versions, bool(complete)
