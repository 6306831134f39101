# Included by store.pyx (see the note there): the hash table, the LRU list, the prefetch
# pipeline of the batched loops, admission of new rows and eviction.

cdef inline int32_t _find(CEmbeddingStore self, uint64_t key) noexcept nogil:
    cdef uint32_t h = sp_hash32(key), mask = (<uint32_t>1 << self.tbits) - 1
    cdef uint32_t i = h >> (32 - self.tbits)
    cdef int32_t e
    while True:
        e = self.table[i].e
        if e < 0 or (self.table[i].h == h and self.entries[e].key == key):
            return e
        i = (i + 1) & mask


cdef inline uint32_t _v32(CEmbeddingStore self) noexcept nogil:
    """``change_version`` as an entry stores it."""
    return <uint32_t>(self.cver - self.vbase)


cdef void _rebase(CEmbeddingStore self) noexcept nogil:
    """Keep ``cver - vbase`` below 2**32 - 1 (so that the version an update is about to
    stamp fits an entry's 32 bits): move ``vbase`` to ``cver - 2**31``, once in 2**31
    mutating calls (or after ``advance_version`` jumps). A row last changed before the new
    base is then reported with the base as its version: later than it was, never earlier,
    so a reader may see it again but never misses it."""
    cdef int64_t nb = self.cver - (<int64_t>1 << 31), t
    cdef int32_t e
    if self.cver - self.vbase < <int64_t>0xFFFFFFFF:
        return
    for e in range(self.eused):
        t = self.vbase + self.entries[e].ver
        self.entries[e].ver = <uint32_t>(t - nb) if t > nb else 0
    self.vbase = nb
    # Rows moved up to the base would pass a mark below it without being listed.
    if self.mrel >= 0:
        if self.mark < nb:
            _dirty_off(self)
        else:
            self.mrel = self.mark - nb


# --- the dirty list (what makes an incremental changed_since cost what changed) -------------
#
# While it is kept (mrel >= 0) it holds every entry, live or free, whose change version is
# above the mark: an entry is appended when a stamp takes its version from <= mark to above
# it. Versions only grow (a failed update appends nothing), so an entry is listed at most
# once and the list never outgrows ``eused``. changed_since(since >= mark) takes the list,
# moves the mark to change_version (a new, empty list) and reads only the listed entries;
# an older ``since`` scans them all and leaves the list alone.

cdef inline void _dirty(CEmbeddingStore self, int32_t e, uint32_t old) noexcept nogil:
    """Entry ``e``, of version ``old`` (less vbase; 0 for a new entry), is being stamped."""
    if <int64_t>old <= self.mrel:
        if self.dlen == self.dcap and not _dirty_grow(self):
            _dirty_off(self)      # out of memory: the next pass scans everything
            return
        self.dlist[self.dlen] = e
        self.dlen += 1


cdef bint _dirty_grow(CEmbeddingStore self) noexcept nogil:
    cdef int64_t cap = self.dcap * 2 if self.dcap else 1024
    if cap > self.ecap:
        cap = self.ecap          # one element per entry at most (see above)
    if cap <= self.dcap:
        return False
    cdef int32_t *grown = <int32_t*>realloc(self.dlist, sizeof(int32_t) * cap)
    if grown == NULL:
        return False
    self.dlist, self.dcap = grown, cap
    return True


cdef inline void _dirty_off(CEmbeddingStore self) noexcept nogil:
    self.mrel = -1
    self.dlen = 0


cdef inline void _dirty_mark(CEmbeddingStore self) noexcept nogil:
    """Start a new, empty list at mark ``change_version`` (nothing is above it yet)."""
    self.mark = self.cver
    self.mrel = self.cver - self.vbase
    self.dlen = 0


cdef inline void _bump(CEmbeddingStore self) noexcept nogil:
    """A mutating call begins (or, for update, has succeeded)."""
    self.cver += 1
    if self.cver - self.vbase >= <int64_t>0xFFFFFFFF:
        _rebase(self)


cdef void _table_remove(CEmbeddingStore self, uint64_t key, int32_t e) noexcept nogil:
    cdef int sh = 32 - self.tbits
    cdef uint32_t mask = (<uint32_t>1 << self.tbits) - 1
    cdef uint32_t i = sp_hash32(key) >> sh, j, k
    while self.table[i].e != e:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if self.table[j].e < 0:
            break
        k = self.table[j].h >> sh
        # The slot at j may move back to the hole at i unless its home k lies in (i, j].
        if (i < k <= j) if i <= j else (i < k or k <= j):
            continue
        self.table[i] = self.table[j]
        i = j
    self.table[i].e = -1


cdef inline void _stage(CEmbeddingStore self, Pipe *p, int64_t i) noexcept nogil:
    """Advance the prefetch pipeline before id ``i`` is processed: fetch the table slot
    of id i+PF_SLOT; follow its probe chain by hash and fetch the entry of id
    i+PF_ENTRY (remembered in the ring); check that entry's key and fetch the row and
    LRU neighbours of id i+PF_ROW. Only hints: see :func:`_resolve`."""
    cdef int64_t j = i + PF_SLOT
    cdef int sh = 32 - self.tbits, k
    cdef uint32_t h, s, mask
    cdef int32_t e
    cdef Entry *x
    cdef const float *row
    if 0 <= j < p.n:
        h = sp_hash32(p.keys[j])
        p.h[j & (RING - 1)] = h
        s = h >> sh
        sp_prefetch(&self.table[s])
        if s & 7:  # the probe (to an empty slot, on a miss) may run into the next line
            sp_prefetch(&self.table[(s + 7) & ((<uint32_t>1 << self.tbits) - 1)])
    j = i + PF_ENTRY
    if 0 <= j < p.n:
        h = p.h[j & (RING - 1)]
        mask = (<uint32_t>1 << self.tbits) - 1
        s = h >> sh
        e = -1
        while self.table[s].e >= 0:
            if self.table[s].h == h:
                e = self.table[s].e
                sp_prefetch(&self.entries[e])
                if self.has_ttl:   # a hit writes its stamp
                    sp_prefetch_w(&self.stamps[e])
                break
            s = (s + 1) & mask
        p.e[j & (RING - 1)] = e
    j = i + PF_ROW
    if 0 <= j < p.n:
        e = p.e[j & (RING - 1)]
        if e >= 0:
            x = &self.entries[e]
            if x.key != p.keys[j] or x.arena == FREE_ARENA:
                p.e[j & (RING - 1)] = -1
            else:
                if p.lines:
                    row = row_ptr(&self.arenas[x.arena], x.row)
                    for k in range(p.lines):
                        sp_prefetch(row + 16 * k)
                if p.links and x.prev >= 0:
                    sp_prefetch(&self.entries[x.prev])
                if p.links and x.next >= 0:
                    sp_prefetch(&self.entries[x.next])
        if p.links and self.sketch != NULL:
            P_STAGE(self, p.keys[j], p.e[j & (RING - 1)])


cdef inline int32_t _resolve(CEmbeddingStore self, Pipe *p, int64_t i) noexcept nogil:
    """Entry of id ``i`` (-1 if not stored). The entry remembered by the pipeline is
    used only if it still holds this id; the store may have changed since."""
    cdef int32_t e = p.e[i & (RING - 1)]
    if e >= 0 and self.entries[e].key == p.keys[i] and self.entries[e].arena != FREE_ARENA:
        return e
    return _find(self, p.keys[i])


cdef inline void _unlink(CEmbeddingStore self, int32_t e) noexcept nogil:
    cdef Entry *x = &self.entries[e]
    if x.prev >= 0:
        self.entries[x.prev].next = x.next
    else:
        self.head = x.next
    if x.next >= 0:
        self.entries[x.next].prev = x.prev
    else:
        self.tail = x.prev


cdef inline void _push_front(CEmbeddingStore self, int32_t e) noexcept nogil:
    cdef Entry *x = &self.entries[e]
    x.prev = -1
    x.next = self.head
    if self.head >= 0:
        self.entries[self.head].prev = e
    else:
        self.tail = e
    self.head = e


cdef inline void _touch(CEmbeddingStore self, int32_t e) noexcept nogil:
    if e != self.head:
        _unlink(self, e)
        _push_front(self, e)


cdef inline void _drop(CEmbeddingStore self, int32_t e) noexcept nogil:
    """Free entry ``e`` and its row, and log the id in the eviction log."""
    cdef Entry *x = &self.entries[e]
    cdef Arena *a = &self.arenas[x.arena]
    if self.use_aux:
        P_UNLINK(self, e)
    self.pol[x.pol & PMASK].rows -= 1
    _table_remove(self, x.key, e)
    _unlink(self, e)
    (<uint32_t*>row_ptr(a, x.row))[0] = a.free_head
    a.free_head = x.row
    x.next = self.efree
    x.arena = FREE_ARENA
    self.efree = e
    self.count -= 1
    _log_add(&self.elog, x.key, self.cver)


cdef void _evict_tail(CEmbeddingStore self) noexcept nogil:
    cdef Entry *y
    cdef Arena *a
    cdef float *row
    cdef int k
    cdef uint32_t s
    self.pol[self.entries[self.tail].pol & PMASK].evicted_lru += 1
    _drop(self, self.tail)
    self.n_evictions += 1
    # The next victims are cold: fetch what evicting them will touch, two evictions
    # ahead for their table slot and row (their entry was fetched one eviction ago)
    # and three ahead for the entry.
    if self.tail >= 0 and self.entries[self.tail].prev >= 0:
        y = &self.entries[self.entries[self.tail].prev]
        s = sp_hash32(y.key) >> (32 - self.tbits)
        sp_prefetch_w(&self.table[s])
        if s & 7:  # the search for the slot and the shift back run past the home line
            sp_prefetch_w(&self.table[(s + 7) & ((<uint32_t>1 << self.tbits) - 1)])
        a = &self.arenas[y.arena]
        row = row_ptr(a, y.row)
        for k in range(0, a.stride, 16):  # the row is rewritten if the next id has its dim
            sp_prefetch_w(row + k)
        if y.prev >= 0:
            sp_prefetch(&self.entries[y.prev])
        if self.use_aux:
            P_STAGE_EVICT(self, self.entries[self.tail].prev)


cdef int32_t _insert(CEmbeddingStore self, uint64_t key, int ai) noexcept nogil:
    """Store a new row for ``key`` (evicting beyond capacity); -1 when out of memory."""
    cdef int32_t e
    cdef uint32_t mask, i, r, h = sp_hash32(key)
    if self.count >= self.capacity_:
        _evict_tail(self)
    if (<int64_t>self.count + 1) * 2 > (<int64_t>1 << self.tbits):
        if not _grow_table(self):
            return -1
    r = _alloc_row(self, &self.arenas[ai])
    if r == NONE32:
        return -1
    if self.efree >= 0:
        e = self.efree
        self.efree = self.entries[e].next
        _dirty(self, e, self.entries[e].ver)
    else:
        if self.eused == self.ecap and not _grow_entries(self):
            return -1
        e = self.eused
        self.eused += 1
        _dirty(self, e, 0)
    self.entries[e].key = key
    self.entries[e].row = r
    self.entries[e].arena = <uint16_t>ai
    self.entries[e].ver = _v32(self)
    mask = (<uint32_t>1 << self.tbits) - 1
    i = h >> (32 - self.tbits)
    while self.table[i].e >= 0:
        i = (i + 1) & mask
    self.table[i].h = h
    self.table[i].e = e
    _push_front(self, e)
    self.count += 1
    self.entries[e].pol = _policy_of(self, key)
    self.pol[self.entries[e].pol].rows += 1
    if self.use_aux:
        P_PUSH(self, e)
    return e
