# Included by store.pyx (see the note there): the table policies of issue 20 (semantics in
# _pystore's docstring). Each entry keeps its policy index in the low 15 bits of Entry.pol
# and, in its top bit (REF), whether a training lookup found it since it was queued. The
# store keeps a Pol per index (its counters and, while some policy has a TTL or a cap, the
# head and tail of its own queue). The links of those queues are in ``aux``, an array
# parallel to the entries allocated only while a TTL or a cap exists, and each row's stamp
# (time and step of its last training lookup) in ``stamps``, another, only while a TTL
# exists: a store without them reads and writes no byte more per row (a parallel array on
# the hot paths cost 7-10% of lookup and update rates). A training lookup's hit does not
# move the row in its queue (that cost three more cache lines per row, 20% of the lookup
# rate in load_tests/bench_store.py): it sets REF in the entry (already in cache) and,
# while a TTL exists, writes the stamp (8 bytes, fetched ahead by _stage), in the loop
# (_hit_mark in store_batch.pxi). Cap evictions and expire() re-queue the REF rows they
# meet at the tail (second chance, as CLOCK does) and evict the others.
# Frequency admission counts misses in a count-min sketch of 8-bit counters
# (stream_persia/server/policies.py states its layout and error bound), allocated only while
# a policy has min_count > 1.
#
# The hot loops reach this file's routines only while policies are set, and through
# function pointers (the P_* below): the compiler inlines _row_of and _drop into the loops
# only while they stay small, and inlining these routines into them made it stop (10% of
# the lookup rate of a store without policies, in load_tests/bench_store.py). A hit's
# marking is the exception (two stores, inlined: the call through a pointer per hit cost
# about 4% of the lookup rate with a TTL); _row_of calls out for its misses to make room.

ctypedef void (*entry_fn)(CEmbeddingStore, int32_t) noexcept nogil
ctypedef float *(*admit_fn)(CEmbeddingStore, uint64_t, int, Arena *, const float *,
                            int *) noexcept nogil
cdef entry_fn P_PUSH, P_UNLINK, P_DROP
cdef admit_fn P_ADMIT
ctypedef void (*stage_fn)(CEmbeddingStore, uint64_t, int32_t) noexcept nogil
cdef stage_fn P_STAGE
cdef entry_fn P_STAGE_EVICT

cdef inline uint16_t _policy_of(CEmbeddingStore self, uint64_t key) noexcept nogil:
    cdef uint64_t p
    if self.pbits == 0:
        return 0
    p = key >> (64 - self.pbits)
    return <uint16_t>p if p < <uint64_t>self.npol else 0


cdef void _ppush(CEmbeddingStore self, int32_t e) noexcept nogil:
    """Queue entry ``e`` at the head of its policy's queue, stamped with the call's stamp."""
    _relink(self, e)
    if self.has_ttl:
        self.stamps[e] = self.stamp


cdef void _punlink(CEmbeddingStore self, int32_t e) noexcept nogil:
    cdef Pol *P = &self.pol[self.entries[e].pol & PMASK]
    cdef Aux *x = &self.aux[e]
    if x.prev >= 0:
        self.aux[x.prev].next = x.next
    else:
        P.head = x.next
    if x.next >= 0:
        self.aux[x.next].prev = x.prev
    else:
        P.tail = x.prev


cdef void _pload(CEmbeddingStore self, int32_t e) noexcept nogil:
    """A load overwrites stored entry ``e``: re-queue it, unmarked, with the call's stamp."""
    _punlink(self, e)
    self.entries[e].pol &= PMASK
    _ppush(self, e)


cdef inline void _requeue(CEmbeddingStore self, int32_t e) noexcept nogil:
    """Second chance: marked entry ``e`` (at its queue's tail) goes to the head, unmarked,
    keeping its stamp."""
    _punlink(self, e)
    self.entries[e].pol &= PMASK
    _relink(self, e)


cdef _stamp_now(CEmbeddingStore self):
    """The stamp of the rows this call refreshes or stores (a training lookup, a load)."""
    self.stamp.t = <float>(time.monotonic() - self.epoch)
    self.stamp.step = <uint32_t>self.steps


cdef inline void _prefetch_victim(CEmbeddingStore self, int32_t t) noexcept nogil:
    """The next victims of a cap are cold: as _evict_tail does, fetch the table slot and
    row of the queue's tail ``t`` (its entry was fetched one eviction ago) and the entry
    before it."""
    cdef Entry *x = &self.entries[t]
    cdef uint32_t s = sp_hash32(x.key) >> (32 - self.tbits)
    cdef Arena *a = &self.arenas[x.arena]
    cdef float *row = row_ptr(a, x.row)
    cdef int32_t y
    cdef int k
    sp_prefetch_w(&self.table[s])
    if s & 7:
        sp_prefetch_w(&self.table[(s + 7) & ((<uint32_t>1 << self.tbits) - 1)])
    for k in range(0, a.stride, 16):
        sp_prefetch_w(row + k)
    y = self.aux[t].prev
    if y >= 0:
        sp_prefetch(&self.entries[y])
        sp_prefetch(&self.aux[y])


cdef inline void _make_room_cap(CEmbeddingStore self, uint16_t p) noexcept nogil:
    """Before a new row of policy ``p``: if its group is at its cap, evict the first
    unmarked row from its queue's tail, re-queueing the marked ones before it (the
    capacity is _insert's). Ends: each re-queue clears a mark."""
    cdef Pol *P = &self.pol[p]
    cdef int32_t t
    if P.max_rows and P.rows >= P.max_rows and P.tail >= 0:
        t = P.tail
        while self.entries[t].pol & REF:
            _requeue(self, t)
            t = P.tail
            if self.aux[t].prev >= 0:   # the candidate after this one
                sp_prefetch(&self.entries[self.aux[t].prev])
                sp_prefetch(&self.aux[self.aux[t].prev])
        P.evicted_cap += 1
        P_DROP(self, t)
        if P.tail >= 0:
            _prefetch_victim(self, P.tail)


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
    """_stage's step for the sketch, PF_ROW ids ahead in a training lookup: a miss's
    counters (admission counts it)."""
    cdef int64_t w = <int64_t>1 << self.sk_bits
    cdef int j
    if e < 0:
        for j in range(SKETCH_DEPTH):
            sp_prefetch(&self.sketch[j * w + <int64_t>(sp_mix64(key ^ self.seeds[j])
                                                       >> (64 - self.sk_bits))])


cdef void _stage_evict(CEmbeddingStore self, int32_t y) noexcept nogil:
    """_evict_tail's step for the queues: the next victim ``y`` (its entry and, since the
    previous eviction, its aux are in flight) will be unlinked from its queue: fetch its
    neighbours there and its stamp (the new row reusing its entry writes it), and the
    aux of the victim after it."""
    cdef Aux *x = &self.aux[y]
    if x.prev >= 0:
        sp_prefetch_w(&self.aux[x.prev])
    if x.next >= 0:
        sp_prefetch_w(&self.aux[x.next])
    if self.has_ttl:
        sp_prefetch_w(&self.stamps[y])
    y = self.entries[y].prev
    if y >= 0:
        sp_prefetch_w(&self.aux[y])


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
    """Evict rows past their TTL (``rel``: now, in seconds since the store was made), policy
    by policy from each queue's tail: a row past its TTL is evicted, a marked one
    re-queued, an unmarked one ends the policy's walk; at most ``limit`` of each."""
    cdef uint32_t step = <uint32_t>self.steps
    cdef int64_t n = 0, moved = 0
    cdef int32_t i, t
    cdef Pol *P
    cdef Stamp *x
    for i in range(self.npol):
        P = &self.pol[i]
        if P.ttl_s < 0 and P.ttl_steps == 0:
            continue
        while n < limit and P.tail >= 0:
            t = P.tail
            x = &self.stamps[t]
            if (P.ttl_s >= 0 and rel - <double>x.t >= P.ttl_s) or \
                    (P.ttl_steps > 0 and <int64_t>(<uint32_t>(step - x.step)) >= P.ttl_steps):
                if n == 0:
                    _bump(self)
                P.expired += 1
                P_DROP(self, t)
                n += 1
            elif self.entries[t].pol & REF and moved < limit:
                _requeue(self, t)
                moved += 1
            else:
                break
    return n


cdef _set_policies(CEmbeddingStore self, int bits, list pols, double now):
    """Install the table (checked by _pol.check_policies); see set_policies."""
    cdef int32_t n = len(pols), i, e
    cdef uint16_t p
    cdef Pol *P
    cdef bint need_aux = False, need_sketch = False, bumped = False, need_ttl, failed = False
    cdef Pol *table = <Pol*>calloc(n, sizeof(Pol))
    cdef int64_t sk_bytes
    cdef uint8_t *sketch = NULL
    cdef Aux *aux = NULL
    cdef Stamp *stamps = NULL
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
    need_ttl = any(q.ttl_s is not None or q.ttl_steps is not None for q in pols)
    # Allocate what the table needs first, then change the store: a MemoryError leaves
    # the table in force with all it had (its sketch, queues and stamps).
    sk_bytes = (<int64_t>SKETCH_DEPTH) << self.sk_bits
    if need_sketch and self.sketch == NULL:
        sketch = <uint8_t*>sp_alloc(sk_bytes, sk_bytes >= BLOCK_BYTES)
        failed = sketch == NULL
    if need_aux and not self.use_aux and self.ecap and not failed:
        aux = <Aux*>sp_alloc(sizeof(Aux) * self.ecap, self.ecap >= 1 << 17)
        failed = aux == NULL
    if need_ttl and not self.has_ttl and self.ecap and not failed:
        stamps = <Stamp*>sp_alloc(sizeof(Stamp) * self.ecap, self.ecap >= 1 << 17)
        failed = stamps == NULL
    if failed:
        sp_free(sketch, sk_bytes)
        sp_free(aux, sizeof(Aux) * self.ecap)
        free(table)
        raise MemoryError()
    if sketch != NULL:
        memset(sketch, 0, sk_bytes)
        self.sketch = sketch
        self.sk_count = 0
    elif not need_sketch:
        _free_sketch(self)
    if need_aux and not self.use_aux:
        self.aux = aux
        self.use_aux = True
    elif not need_aux and self.use_aux:
        sp_free(self.aux, sizeof(Aux) * self.ecap)
        self.aux = NULL
        self.use_aux = False
    if need_ttl and not self.has_ttl:
        self.stamps = stamps
        self.has_ttl = True
        # Stamps are kept only while a TTL exists: the rows present now get ``now``.
        self.stamp.t = <float>(now - self.epoch)
        self.stamp.step = <uint32_t>self.steps
        for e in range(self.eused):
            self.stamps[e] = self.stamp
    elif not need_ttl and self.has_ttl:
        sp_free(self.stamps, sizeof(Stamp) * self.ecap)
        self.stamps = NULL
        self.has_ttl = False
    free(self.pol)
    self.pol, self.npol, self.pbits = table, n, bits
    self.policed = any(not q.is_default for q in pols)
    # New rows of a group take its dtype; rows stored before keep theirs (see set_policies).
    self.dtmask = 1
    for i in range(n):
        self.dtmask |= 1 << self.pol[i].dtype
    with nogil:
        # Least recently used first: each queue in the global order, every row unmarked.
        e = self.tail
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
    cdef Pol *P = &self.pol[self.entries[e].pol & PMASK]
    cdef Aux *x = &self.aux[e]
    x.prev = -1
    x.next = P.head
    if P.head >= 0:
        self.aux[P.head].prev = e
    else:
        P.tail = e
    P.head = e


cdef _merge_sketch(CEmbeddingStore self, chunk):
    """A dump's sketch chunk (policies.sketch_chunk) merged into the sketch, which is made
    if the store has none (see PyEmbeddingStore.load)."""
    cdef size_t sk_bytes = (<size_t>SKETCH_DEPTH) << self.sk_bits
    cdef uint8_t *sketch
    cdef uint8_t[:, ::1] mv
    counters, counted, _ = _pol.check_sketch_chunk(chunk)
    if self.sketch == NULL:
        sketch = <uint8_t*>sp_alloc(sk_bytes, sk_bytes >= BLOCK_BYTES)
        if sketch == NULL:
            raise MemoryError()
        memset(sketch, 0, sk_bytes)
        self.sketch = sketch
        self.sk_count = 0
    into, have = self.sketch_state()
    _pol.merge_counters(into, counters)
    mv = into
    memcpy(self.sketch, &mv[0, 0], sk_bytes)
    self.sk_count = min(max(have, counted), <int64_t>1 << self.sk_bits)


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


P_PUSH, P_UNLINK, P_ADMIT = _ppush, _punlink, _admit_policed
P_DROP, P_STAGE, P_STAGE_EVICT = _drop_out_of_line, _stage_policy, _stage_evict
