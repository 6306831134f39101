# Included by store.pyx (see the note there): the table policies of issue 20 (semantics in
# _pystore's docstring). Each entry keeps its policy index in the 16 bits Entry.pol; the
# store keeps a Pol per index (its counters and, while some policy has a TTL or a cap, the
# head and tail of its own LRU list). The links of those lists and each row's stamp (time
# and step of its last training lookup) are in ``aux``, an array parallel to the entries
# allocated only while a TTL or a cap exists: a store without them reads and writes no byte
# more per row (a parallel array on the hot paths cost 7-10% of lookup and update rates).
# Frequency admission counts misses in a count-min sketch of 8-bit counters
# (stream_persia/server/policies.py states its layout and error bound), allocated only while
# a policy has min_count > 1.
#
# The hot loops reach this file's routines only while policies are set, and through
# function pointers (the P_* below): the compiler inlines _row_of and _drop into the loops
# only while they stay small, and inlining these routines into them made it stop (10% of
# the lookup rate of a store without policies, in load_tests/bench_store.py).

ctypedef void (*entry_fn)(CEmbeddingStore, int32_t) noexcept nogil
ctypedef float *(*admit_fn)(CEmbeddingStore, uint64_t, int, Arena *, const float *,
                            int *) noexcept nogil
cdef entry_fn P_PUSH, P_UNLINK, P_TOUCH, P_DROP
cdef admit_fn P_ADMIT
ctypedef void (*stage_fn)(CEmbeddingStore, uint64_t, int32_t) noexcept nogil
cdef stage_fn P_STAGE

cdef inline uint16_t _policy_of(CEmbeddingStore self, uint64_t key) noexcept nogil:
    cdef uint64_t p
    if self.pbits == 0:
        return 0
    p = key >> (64 - self.pbits)
    return <uint16_t>p if p < <uint64_t>self.npol else 0


cdef void _ppush(CEmbeddingStore self, int32_t e) noexcept nogil:
    """Put entry ``e`` at the front of its policy's list, stamped with the call's stamp."""
    cdef Pol *P = &self.pol[self.entries[e].pol]
    cdef Aux *x = &self.aux[e]
    x.prev = -1
    x.next = P.head
    if P.head >= 0:
        self.aux[P.head].prev = e
    else:
        P.tail = e
    P.head = e
    x.t = self.tnow
    x.step = self.snow


cdef void _punlink(CEmbeddingStore self, int32_t e) noexcept nogil:
    cdef Pol *P = &self.pol[self.entries[e].pol]
    cdef Aux *x = &self.aux[e]
    if x.prev >= 0:
        self.aux[x.prev].next = x.next
    else:
        P.head = x.next
    if x.next >= 0:
        self.aux[x.next].prev = x.prev
    else:
        P.tail = x.prev


cdef void _ptouch(CEmbeddingStore self, int32_t e) noexcept nogil:
    """A training lookup's hit: its policy's list moves a row at its first lookup in the
    call (``steps`` counts the calls); the later ones of a hot id cost no list update."""
    if self.aux[e].step == self.snow:
        return
    _punlink(self, e)
    _ppush(self, e)


cdef _stamp_now(CEmbeddingStore self):
    """The stamp of the rows this call refreshes or stores (a training lookup, a load)."""
    self.tnow = <float>(time.time() - self.epoch)
    self.snow = <uint32_t>self.steps


cdef inline void _make_room_cap(CEmbeddingStore self, uint16_t p) noexcept nogil:
    """Before a new row of policy ``p``: evict its group's oldest row if at its cap (the
    capacity is _insert's)."""
    cdef Pol *P = &self.pol[p]
    cdef int32_t t, y
    cdef Entry *x
    cdef Arena *a
    cdef float *row
    cdef uint32_t s
    cdef int k
    if P.max_rows and P.rows >= P.max_rows and P.tail >= 0:
        P.evicted_cap += 1
        P_DROP(self, P.tail)
        # The next victims are cold: as _evict_tail does, fetch the table slot and row of
        # the next one (its entry was fetched one eviction ago) and the entry after it.
        t = P.tail
        if t >= 0:
            x = &self.entries[t]
            s = sp_hash32(x.key) >> (32 - self.tbits)
            sp_prefetch_w(&self.table[s])
            if s & 7:
                sp_prefetch_w(&self.table[(s + 7) & ((<uint32_t>1 << self.tbits) - 1)])
            a = &self.arenas[x.arena]
            row = row_ptr(a, x.row)
            for k in range(0, a.stride, 16):
                sp_prefetch_w(row + k)
            y = self.aux[t].prev
            if y >= 0:
                sp_prefetch(&self.entries[y])
                sp_prefetch(&self.aux[y])


cdef uint32_t _sketch_add(CEmbeddingStore self, uint64_t key) noexcept nogil:
    """Count ``key`` (conservative update); its new estimate."""
    cdef int64_t w = <int64_t>1 << self.sk_bits, k
    cdef uint64_t *words
    cdef int64_t cell[SKETCH_DEPTH]
    cdef uint32_t m = 255, c
    cdef int j
    if self.sk_count >= w:      # halve every counter, eight at a time
        words = <uint64_t*>self.sketch
        for k in range(w * SKETCH_DEPTH // 8):
            words[k] = (words[k] >> 1) & <uint64_t>0x7F7F7F7F7F7F7F7F
        self.sk_count = 0
    self.sk_count += 1
    for j in range(SKETCH_DEPTH):
        cell[j] = j * w + <int64_t>(sp_mix64(key ^ self.seeds[j]) >> (64 - self.sk_bits))
        c = self.sketch[cell[j]]
        if c < m:
            m = c
    if m < 255:
        m += 1
    for j in range(SKETCH_DEPTH):
        if self.sketch[cell[j]] < m:
            self.sketch[cell[j]] = <uint8_t>m
    return m


cdef void _stage_policy(CEmbeddingStore self, uint64_t key, int32_t e) noexcept nogil:
    """_stage's step for the policies, PF_ROW ids ahead in a training lookup: a miss's
    sketch counters (admission counts it), a hit's neighbours in its policy's list."""
    cdef int64_t w = <int64_t>1 << self.sk_bits
    cdef int j
    cdef Aux *x
    if e < 0 and self.sketch != NULL:
        for j in range(SKETCH_DEPTH):
            sp_prefetch(&self.sketch[j * w + <int64_t>(sp_mix64(key ^ self.seeds[j])
                                                       >> (64 - self.sk_bits))])
    elif e >= 0 and self.use_aux:
        x = &self.aux[e]
        if x.prev >= 0:
            sp_prefetch(&self.aux[x.prev])
        if x.next >= 0:
            sp_prefetch(&self.aux[x.next])


cdef inline uint32_t _sketch_estimate(CEmbeddingStore self, uint64_t key) noexcept nogil:
    cdef int64_t w = <int64_t>1 << self.sk_bits
    cdef uint32_t m = 255, c
    cdef int j
    for j in range(SKETCH_DEPTH):
        c = self.sketch[j * w + <int64_t>(sp_mix64(key ^ self.seeds[j]) >> (64 - self.sk_bits))]
        if c < m:
            m = c
    return m


cdef float *_admit_policed(CEmbeddingStore self, uint64_t key, int ai, Arena *a,
                           const float *zero, int *status) noexcept nogil:
    """A training miss while policies are set: frequency admission, the policy's draw,
    its cap, then _insert. The row to read (the id's initial row in ``ibuf`` while it is
    below its min_count, ``zero`` if the draw refuses it); NULL with ``status`` on error.
    A policy with a compact dtype stores the row in ``cur_ai[dtype]`` (and says so in
    ``adm_dt``), its initial weights rounded."""
    cdef uint16_t p = _policy_of(self, key)
    cdef Pol *P = &self.pol[p]
    cdef double u = 0.0, ap
    cdef int32_t e
    cdef float *row
    if P.min_count > 1 and self.sketch != NULL:
        if _sketch_add(self, key) < <uint32_t>P.min_count:
            P.rejected += 1
            sp_init_row(self.ibuf, a.dim, key, self.init_lo, self.init_span)
            return self.ibuf
    ap = P.admit_p if P.admit_p >= 0 else self.admit_p
    if ap < 1.0:
        u = <double>(sp_mix64(key ^ sp_mix64(self.draws)) >> 11) * (
            1.0 / 9007199254740992.0)
    self.draws += 1
    if not u < ap:
        return <float*>zero
    _make_room_cap(self, p)
    if P.dtype:
        ai = self.cur_ai[P.dtype]
    e = _insert(self, key, ai)
    if e < 0:
        status[0] = E_NOMEM
        return NULL
    self.n_admissions += 1
    P.admitted += 1
    if P.dtype:
        self.adm_dt = P.dtype
        a = &self.arenas[ai]
        row = row_ptr(a, self.entries[e].row)
        sp_init_row(self.ibuf, a.dim, key, self.init_lo, self.init_span)
        sp_narrow(row, self.ibuf, a.dim, P.dtype)
        memcpy(row + a.wlen, a.init_state, sizeof(float) * a.width)
        return row
    row = row_ptr(a, self.entries[e].row)
    sp_init_row(row, a.dim, key, self.init_lo, self.init_span)
    memcpy(row + a.dim, a.init_state, sizeof(float) * a.width)
    return row


cdef int64_t _expire(CEmbeddingStore self, double rel, int64_t limit) noexcept nogil:
    """Evict rows past their TTL (``rel``: now, in seconds since the store was made),
    oldest first per policy, at most ``limit``."""
    cdef uint32_t step = <uint32_t>self.steps
    cdef int64_t n = 0
    cdef int32_t i
    cdef Pol *P
    cdef Aux *x
    for i in range(self.npol):
        P = &self.pol[i]
        if P.ttl_s < 0 and P.ttl_steps == 0:
            continue
        while n < limit and P.tail >= 0:
            x = &self.aux[P.tail]
            if not ((P.ttl_s >= 0 and rel - <double>x.t >= P.ttl_s) or
                    (P.ttl_steps > 0 and <int64_t>(<uint32_t>(step - x.step)) >= P.ttl_steps)):
                break
            if n == 0:
                _bump(self)
            P.expired += 1
            P_DROP(self, P.tail)
            n += 1
    return n


cdef _set_policies(CEmbeddingStore self, int bits, list pols, double now):
    """Install the table (checked by _pol.check_policies); see set_policies."""
    cdef int32_t n = len(pols), i, e
    cdef uint16_t p
    cdef Pol *P
    cdef bint need_aux = False, need_sketch = False, bumped = False
    cdef Pol *table = <Pol*>calloc(n, sizeof(Pol))
    cdef int64_t sk_bytes
    if table == NULL:
        raise MemoryError()
    for i in range(n):
        q = pols[i]
        P = &table[i]
        if i < self.npol:
            P.admitted, P.rejected = self.pol[i].admitted, self.pol[i].rejected
            P.dropped, P.expired = self.pol[i].dropped, self.pol[i].expired
            P.evicted_lru, P.evicted_cap = self.pol[i].evicted_lru, self.pol[i].evicted_cap
        P.admit_p = -1.0 if q.admit_probability is None else q.admit_probability
        P.ttl_s = -1.0 if q.ttl_s is None else q.ttl_s
        P.ttl_steps = 0 if q.ttl_steps is None else q.ttl_steps
        P.max_rows = 0 if q.max_rows is None else q.max_rows
        P.min_count = q.min_count
        P.dtype = _rdt.dtype_code(q.dtype)
        P.head = P.tail = -1
        if q.ttl_s is not None or q.ttl_steps is not None or q.max_rows is not None:
            need_aux = True
        if q.min_count > 1:
            need_sketch = True
    if need_sketch and self.sketch == NULL:
        sk_bytes = (<int64_t>SKETCH_DEPTH) << self.sk_bits
        self.sketch = <uint8_t*>sp_alloc(sk_bytes, sk_bytes >= BLOCK_BYTES)
        if self.sketch == NULL:
            free(table)
            raise MemoryError()
        memset(self.sketch, 0, sk_bytes)
        self.sk_count = 0
    elif not need_sketch:
        _free_sketch(self)
    if need_aux and not self.use_aux:
        if self.ecap:
            self.aux = <Aux*>sp_alloc(sizeof(Aux) * self.ecap, self.ecap >= 1 << 17)
            if self.aux == NULL:
                free(table)
                raise MemoryError()
        self.use_aux = True
        self.tnow = <float>(now - self.epoch)
        self.snow = <uint32_t>self.steps
        for e in range(self.eused):   # rows present now are stamped with ``now``
            self.aux[e].t = self.tnow
            self.aux[e].step = self.snow
    elif not need_aux and self.use_aux:
        sp_free(self.aux, sizeof(Aux) * self.ecap)
        self.aux = NULL
        self.use_aux = False
    free(self.pol)
    self.pol, self.npol, self.pbits = table, n, bits
    self.policed = any(not q.is_default for q in pols)
    # New rows of a group take its dtype; rows stored before keep theirs (see set_policies).
    self.dtmask = 1
    for i in range(n):
        self.dtmask |= 1 << self.pol[i].dtype
    self.has_ttl = any(q.ttl_s is not None or q.ttl_steps is not None for q in pols)
    with nogil:
        e = self.tail       # least recently used first: each list in the global order
        while e >= 0:
            p = _policy_of(self, self.entries[e].key)
            self.entries[e].pol = p
            self.pol[p].rows += 1
            if self.use_aux:
                _relink(self, e)
            e = self.entries[e].prev
        for i in range(n):
            P = &self.pol[i]
            while P.max_rows and P.rows > P.max_rows:
                if not bumped:
                    _bump(self)
                    self.version += 1
                    bumped = True
                P.evicted_cap += 1
                P_DROP(self, P.tail)


cdef inline void _relink(CEmbeddingStore self, int32_t e) noexcept nogil:
    """_ppush keeping the entry's stamp."""
    cdef Pol *P = &self.pol[self.entries[e].pol]
    cdef Aux *x = &self.aux[e]
    x.prev = -1
    x.next = P.head
    if P.head >= 0:
        self.aux[P.head].prev = e
    else:
        P.tail = e
    P.head = e


cdef void _free_sketch(CEmbeddingStore self) noexcept nogil:
    if self.sketch != NULL:
        sp_free(self.sketch, (<size_t>SKETCH_DEPTH) << self.sk_bits)
        self.sketch = NULL


cdef void _reset_policy_lists(CEmbeddingStore self) noexcept nogil:
    cdef int32_t i
    for i in range(self.npol):
        self.pol[i].rows = 0
        self.pol[i].head = self.pol[i].tail = -1


cdef dict _policy_stats(CEmbeddingStore self):
    cdef int32_t i
    out = {}
    for i in range(self.npol):
        P = self.pol[i]
        out[i] = {"rows": P.rows, "admitted": P.admitted, "rejected": P.rejected,
                  "dropped_grads": P.dropped, "expired": P.expired,
                  "evicted_lru": P.evicted_lru, "evicted_cap": P.evicted_cap}
    return out


cdef void _drop_out_of_line(CEmbeddingStore self, int32_t e) noexcept nogil:
    _drop(self, e)


P_PUSH, P_UNLINK, P_TOUCH, P_ADMIT = _ppush, _punlink, _ptouch, _admit_policed
P_DROP, P_STAGE = _drop_out_of_line, _stage_policy
