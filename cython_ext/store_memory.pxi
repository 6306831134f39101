# Included by store.pyx (see the note there): the memory of a CEmbeddingStore (entries,
# hash table, one arena of rows per dim, scratch buffers) and its configuration.

cdef void _free_all(CEmbeddingStore self) noexcept:
    cdef int a
    cdef uint32_t b
    for a in range(self.narenas):
        for b in range(self.arenas[a].nblocks):
            sp_free(self.arenas[a].blocks[b], _block_bytes(&self.arenas[a]))
        free(self.arenas[a].blocks)
        free(self.arenas[a].init_state)
    free(self.arenas)
    sp_free(self.entries, sizeof(Entry) * self.ecap)
    sp_free(self.aux, sizeof(Aux) * self.ecap)
    self.aux = NULL
    sp_free(self.stamps, sizeof(Stamp) * self.ecap)
    self.stamps = NULL
    sp_free(self.table, sizeof(Slot) << self.tbits)
    self.arenas = NULL
    self.entries = NULL
    self.table = NULL
    self.narenas = 0


cdef void _release(CEmbeddingStore self) noexcept:
    """Free every buffer: the table's (``_free_all``) and the scratch of the batched calls."""
    _free_all(self)
    sp_free(self.gbuf, self.gbuf_bytes)
    sp_free(self.rbuf, self.rbuf_bytes)
    sp_free(self.zbuf, self.zbuf_bytes)
    sp_free(self.ebuf, self.ebuf_bytes)
    sp_free(self.obuf, self.obuf_bytes)
    self.gbuf, self.rbuf, self.zbuf, self.ebuf, self.obuf = NULL, NULL, NULL, NULL, NULL
    self.gbuf_bytes = self.rbuf_bytes = self.zbuf_bytes = self.ebuf_bytes = 0
    self.obuf_bytes = 0
    _log_free(&self.elog)
    _free_sketch(self)
    _dirty_off(self)
    free(self.dlist)
    self.dlist = NULL
    self.dcap = 0


cdef _reset(CEmbeddingStore self):
    _free_all(self)
    self._dims = {}
    self.ncompact = 0
    self.ecap = self.eused = self.count = 0
    self.efree = self.head = self.tail = -1
    self.dlen = 0            # the listed entries are gone; the mark still holds
    _reset_policy_lists(self)
    self.tbits = MIN_TABLE_BITS
    self.table = <Slot*>sp_alloc(sizeof(Slot) << self.tbits, False)
    if self.table == NULL:
        raise MemoryError()
    memset(self.table, 0xFF, sizeof(Slot) << self.tbits)


cdef _set_config(CEmbeddingStore self, cfg):
    self._cfg = cfg
    self.opt = make_opt(self._opt_obj, cfg)
    lo, hi = _py.init_bounds(cfg.emb_initialization)
    self.init_lo = lo
    self.init_span = hi - lo
    self.admit_p = cfg.admit_probability


cdef int _arena_index(CEmbeddingStore self, int dim, bint create) except -2:
    """The float32 arena of ``dim`` (-1 if none and not ``create``)."""
    return _arena_index_dt(self, dim, 0, create)


cdef _dt_arenas(CEmbeddingStore self, int dim):
    """``cur_ai[dt]``: the arena of ``dim`` and dtype ``dt`` for each dtype a policy
    stores new rows in (made now: the loops without the GIL cannot), else -1."""
    cdef int dt
    for dt in range(3):
        self.cur_ai[dt] = _arena_index_dt(self, dim, dt, True) if (self.dtmask >> dt) & 1 \
            else -1


cdef int _arena_index_dt(CEmbeddingStore self, int dim, int dt, bint create) except -2:
    """Arenas are per (dim, dtype); the float32 one is keyed by ``dim`` alone."""
    cdef object k = dim
    if dt:
        k = (dim, dt)
    idx = self._dims.get(k)
    if idx is not None:
        return idx
    if not create:
        return -1
    if self.narenas == 65535:
        raise BadInput("too many distinct dims in one store", field="dim")
    cdef Arena *grown = <Arena*>realloc(self.arenas, sizeof(Arena) * (self.narenas + 1))
    if grown == NULL:
        raise MemoryError()
    self.arenas = grown
    cdef Arena *a = &self.arenas[self.narenas]
    memset(a, 0, sizeof(Arena))
    a.dim = dim
    a.dtype = dt
    a.wlen = sp_wlen(dim, dt)
    a.free_head = NONE32
    _set_arena_state(self, a)
    self._dims[k] = self.narenas
    if dt:
        self.ncompact += 1
    self.narenas += 1
    return self.narenas - 1


cdef _set_arena_state(CEmbeddingStore self, Arena *a):
    """(Re)compute the state width and initial state of an arena; block geometry too
    while it holds no block."""
    init = self._opt_obj.initial_state(a.dim)
    cdef const float[::1] src = init
    cdef int width = len(init), shift = 4
    cdef float *state = <float*>malloc(sizeof(float) * (width + 1))
    if state == NULL:
        raise MemoryError()
    if width:
        memcpy(state, &src[0], sizeof(float) * width)
    free(a.init_state)
    a.init_state = state
    a.width = width
    a.stride = a.wlen + width
    if a.nblocks == 0:
        while (sizeof(float) * a.stride << (shift + 1)) <= BLOCK_BYTES and shift < 20:
            shift += 1
        a.shift = shift


cdef bint _grow_entries(CEmbeddingStore self) noexcept nogil:
    cdef int64_t cap = self.ecap + (self.ecap >> 1)
    if cap < 1024:
        cap = 1024
    if cap > self.capacity_:
        cap = self.capacity_
    cdef Entry *e = <Entry*>sp_alloc(sizeof(Entry) * cap, cap >= 1 << 17)
    cdef Aux *x = NULL
    cdef Stamp *t = NULL
    if e == NULL:
        return False
    if self.has_ttl:
        t = <Stamp*>sp_alloc(sizeof(Stamp) * cap, cap >= 1 << 17)
        if t == NULL:
            sp_free(e, sizeof(Entry) * cap)
            return False
    if self.use_aux:
        x = <Aux*>sp_alloc(sizeof(Aux) * cap, cap >= 1 << 17)
        if x == NULL:
            sp_free(e, sizeof(Entry) * cap)
            sp_free(t, sizeof(Stamp) * cap)
            return False
        if self.eused:
            memcpy(x, self.aux, sizeof(Aux) * self.eused)
        sp_free(self.aux, sizeof(Aux) * self.ecap)
        self.aux = x
    if self.has_ttl:
        if self.eused:
            memcpy(t, self.stamps, sizeof(Stamp) * self.eused)
        sp_free(self.stamps, sizeof(Stamp) * self.ecap)
        self.stamps = t
    if self.eused:
        memcpy(e, self.entries, sizeof(Entry) * self.eused)
    sp_free(self.entries, sizeof(Entry) * self.ecap)
    self.entries = e
    self.ecap = <int32_t>cap
    return True


cdef bint _grow_table(CEmbeddingStore self) noexcept nogil:
    cdef int bits = self.tbits + 1
    cdef Slot *t = <Slot*>sp_alloc(sizeof(Slot) << bits, bits >= 20)
    cdef uint32_t mask = (<uint32_t>1 << bits) - 1, i, k
    if t == NULL:
        return False
    memset(t, 0xFF, sizeof(Slot) << bits)
    for k in range(<uint32_t>1 << self.tbits):
        if self.table[k].e >= 0:
            i = self.table[k].h >> (32 - bits)
            while t[i].e >= 0:
                i = (i + 1) & mask
            t[i] = self.table[k]
    sp_free(self.table, sizeof(Slot) << self.tbits)
    self.table = t
    self.tbits = bits
    return True


cdef uint32_t _alloc_row(CEmbeddingStore self, Arena *a) noexcept nogil:
    cdef uint32_t r = a.free_head
    cdef float **blocks
    cdef uint32_t cap
    if r != NONE32:
        a.free_head = (<uint32_t*>row_ptr(a, r))[0]
        return r
    if (a.used >> a.shift) == a.nblocks:
        if a.nblocks == a.blocks_cap:
            cap = a.blocks_cap * 2 if a.blocks_cap else 16
            blocks = <float**>realloc(a.blocks, sizeof(float*) * cap)
            if blocks == NULL:
                return NONE32
            a.blocks = blocks
            a.blocks_cap = cap
        # The first block of a dim stays on small pages: small stores stay small.
        a.blocks[a.nblocks] = <float*>sp_alloc(_block_bytes(a), a.nblocks > 0)
        if a.blocks[a.nblocks] == NULL:
            return NONE32
        a.nblocks += 1
    a.used += 1
    return a.used - 1


cdef void *_scratch(CEmbeddingStore self, void **buf, size_t *have, size_t need) except NULL:
    """``buf`` (of ``have`` bytes) grown to at least ``need`` bytes; its contents are
    not kept. MemoryError when it cannot grow."""
    if have[0] < need:
        sp_free(buf[0], have[0])
        buf[0] = sp_alloc(need, False)
        have[0] = need if buf[0] != NULL else 0
        if buf[0] == NULL:
            raise MemoryError()
    return buf[0]


cdef const float *_zeros(CEmbeddingStore self, int dim) except NULL:
    """An all-zero row of ``dim`` floats: what a lookup miss that stores nothing reads."""
    cdef size_t need = sizeof(float) * dim
    if self.zbuf_bytes < need:
        _scratch(self, <void**>&self.zbuf, &self.zbuf_bytes, need)
        memset(self.zbuf, 0, need)
    return self.zbuf


cdef _restate(CEmbeddingStore self, Arena *a):
    """Re-layout an arena for a new state width: keep weights, reset state."""
    cdef int old_stride = a.stride, wlen = a.wlen
    cdef size_t old_bytes = _block_bytes(a)
    cdef uint32_t b, r, rows = <uint32_t>1 << a.shift
    cdef float *nb
    cdef float *ob
    cdef float *row
    _set_arena_state(self, a)
    for b in range(a.nblocks):
        nb = <float*>sp_alloc(_block_bytes(a), b > 0)
        if nb == NULL:
            raise MemoryError()
        ob = a.blocks[b]
        for r in range(rows):
            row = nb + <size_t>r * a.stride
            memcpy(row, ob + <size_t>r * old_stride, sizeof(float) * wlen)
            memcpy(row + wlen, a.init_state, sizeof(float) * a.width)
        sp_free(ob, old_bytes)
        a.blocks[b] = nb


# --- the eviction log (a ring; memory grows with use up to its limit) ------------------------

cdef inline int64_t _log_at(const EvictionLog *lg, int64_t k) noexcept nogil:
    """Ring index of the ``k``-th oldest entry."""
    k += lg.head
    return k - lg.cap if k >= lg.cap else k


cdef void _log_free(EvictionLog *lg) noexcept nogil:
    sp_free(lg.ring, sizeof(Evicted) * lg.cap)
    lg.ring = NULL
    lg.cap = lg.head = lg.len = 0


cdef inline void _log_clear(EvictionLog *lg) noexcept nogil:
    lg.head = lg.len = 0


cdef void _log_grow(EvictionLog *lg) noexcept nogil:
    """Double the ring (up to its limit), oldest entry first; unchanged when out of
    memory (the log then drops its oldest entries sooner, and says so). Large rings are
    on huge pages: a growing log is written to fresh memory at every eviction."""
    cdef int64_t cap = lg.cap * 2 if lg.cap else 1024, first
    if cap > lg.limit:
        cap = lg.limit
    cdef Evicted *ring = <Evicted*>sp_alloc(sizeof(Evicted) * cap, cap >= 1 << 17)
    if ring == NULL:
        return
    first = lg.cap - lg.head if lg.len > lg.cap - lg.head else lg.len
    if lg.len:
        memcpy(ring, lg.ring + lg.head, sizeof(Evicted) * first)
        memcpy(ring + first, lg.ring, sizeof(Evicted) * (lg.len - first))
    sp_free(lg.ring, sizeof(Evicted) * lg.cap)
    lg.ring, lg.cap, lg.head = ring, cap, 0


cdef inline void _log_add(EvictionLog *lg, uint64_t key, int64_t version) noexcept nogil:
    cdef Evicted *x
    if lg.len == lg.cap:
        if lg.cap < lg.limit:
            _log_grow(lg)
        if lg.len == lg.cap:       # full: drop the oldest
            if lg.cap == 0:
                lg.dropped = version
                return
            lg.dropped = lg.ring[lg.head].version
            lg.head = _log_at(lg, 1)
            lg.len -= 1
    x = &lg.ring[_log_at(lg, lg.len)]
    x.key = key
    x.version = version
    lg.len += 1
