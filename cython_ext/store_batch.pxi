# Included by store.pyx (see the note there): the guards of the public methods and the
# batched loops behind lookup, lookup_pooled and update (run with the GIL released).

cdef _open(CEmbeddingStore self):
    """Every public method that reads or changes rows starts here: a closed store has
    none (its buffers are freed)."""
    if self.closed:
        raise _py.closed_error()


cdef _enter(CEmbeddingStore self):
    if self.busy:
        raise Misuse("EmbeddingStore is not thread-safe: another call is running on it",
                     hint="serialise calls (one event loop or one lock per store)")
    self.busy = True


cdef _raise(CEmbeddingStore self, int status, int64_t i, ids, int dim, str what):
    if status == E_NOMEM:
        raise MemoryError("embedding store: out of memory")
    key = int(ids[i])
    if status == E_NONFINITE:
        raise _py.nonfinite_error(int(i), key)
    e = _find(self, <uint64_t>key)
    raise _py.dim_error(key, self.arenas[self.entries[e].arena].dim, dim, what)


cdef inline void _hit_mark(CEmbeddingStore self, Entry *x, int32_t e) noexcept nogil:
    """A training lookup's hit while the store has policy queues (see store_policy.pxi):
    mark the row (REF) and, while a TTL exists, stamp it (its line was fetched by
    _stage). Inlined in the loops, not called through a pointer as the other policy
    routines are: one call per hit cost about 4% of the lookup rate with a TTL."""
    x.pol |= REF
    if self.has_ttl:
        self.stamps[e] = self.stamp


cdef inline float *_row_of(CEmbeddingStore self, Pipe *pipe, int64_t i, int ai, Arena *a,
                           bint train, const float *zero, int *status) noexcept nogil:
    """The row of id ``i`` of the pipeline's keys, for reading: refreshed (train), or
    admitted and initialised (a train miss that passes admission), or ``zero`` (a miss
    that stores nothing). NULL with ``status`` set on an error."""
    cdef uint64_t key = pipe.keys[i]
    cdef int32_t e = _resolve(self, pipe, i)
    cdef Entry *x
    if e >= 0:
        x = &self.entries[e]
        if x.arena != ai:
            status[0] = E_DIM
            return NULL
        if train:
            _touch(self, e)
            if self.use_aux:
                _hit_mark(self, x, e)
        return row_ptr(a, x.row)
    self.n_misses += 1
    if not train:
        return <float*>zero
    if self.policed:
        return P_ADMIT(self, key, ai, a, zero, status)
    # A call (misses are the rare case): _row_of stays small enough, with _hit_mark, for
    # the compiler to inline it in the loops (it did not with this admission inline).
    return _admit_plain(self, key, ai, a, zero, status)


cdef int _lookup(CEmbeddingStore self, const uint64_t *keys, int64_t n, int ai, float *out, int dim,
                 bint train, int64_t *at, const float *zero) noexcept nogil:
    """Copy the row of each of ``keys`` to ``out`` (zeros for a miss)."""
    cdef int64_t i
    cdef int status = OK
    cdef const float *row
    cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
    cdef Pipe pipe
    pipe.keys, pipe.n, pipe.lines, pipe.links = keys, n, (dim + 15) // 16, train
    for i in range(-PF_SLOT, n):
        _stage(self, &pipe, i)
        if i < 0:
            continue
        row = _row_of(self, &pipe, i, ai, a, train, zero, &status)
        if row == NULL:
            at[0] = i
            return status
        memcpy(out + i * dim, row, sizeof(float) * dim)
    return OK


cdef float *_row_mixed(CEmbeddingStore self, Pipe *pipe, int64_t i, int ai, Arena *a, int dim,
                       bint train, const float *zero, int *status, int *dt) noexcept nogil:
    """``_row_of`` while the store has compact rows: a hit may be in another arena of
    ``dim`` (``dt`` its dtype), and an admission may store a compact row (``adm_dt``)."""
    cdef int32_t e = _resolve(self, pipe, i)
    cdef Arena *xa
    cdef float *row
    if e >= 0 and self.entries[e].arena != ai:
        xa = &self.arenas[self.entries[e].arena]
        if xa.dim != dim:
            status[0] = E_DIM
            return NULL
        dt[0] = xa.dtype
        if train:
            _touch(self, e)
            if self.use_aux:
                _hit_mark(self, &self.entries[e], e)
        return row_ptr(xa, self.entries[e].row)
    dt[0] = 0
    if e >= 0:
        if train:
            _touch(self, e)
            if self.use_aux:
                _hit_mark(self, &self.entries[e], e)
        return row_ptr(a, self.entries[e].row)
    # A miss: as _row_of's.
    self.n_misses += 1
    if not train:
        return <float*>zero
    if self.policed:
        self.adm_dt = 0
        row = P_ADMIT(self, pipe.keys[i], ai, a, zero, status)
        dt[0] = self.adm_dt
        return row
    return _admit_plain(self, pipe.keys[i], ai, a, zero, status)


cdef float *_admit_plain(CEmbeddingStore self, uint64_t key, int ai, Arena *a,
                         const float *zero, int *status) noexcept nogil:
    """A training miss without policies (_row_of's and _row_mixed's)."""
    cdef double u = 0.0
    cdef int32_t e
    cdef float *row
    if self.admit_p < 1.0:
        u = <double>(sp_mix64(key ^ sp_mix64(self.draws)) >> 11) * (
            1.0 / 9007199254740992.0)
    self.draws += 1
    if not u < self.admit_p:
        return <float*>zero
    e = _insert(self, key, ai)
    if e < 0:
        status[0] = E_NOMEM
        return NULL
    self.n_admissions += 1
    self.pol[self.entries[e].pol].admitted += 1
    row = row_ptr(a, self.entries[e].row)
    sp_init_row(row, a.dim, key, self.init_lo, self.init_span)
    memcpy(row + a.dim, a.init_state, sizeof(float) * a.width)
    return row


cdef int _lookup_mixed(CEmbeddingStore self, const uint64_t *keys, int64_t n, int ai,
                       float *out, int dim, bint train, int64_t *at,
                       const float *zero) noexcept nogil:
    """``_lookup`` while the store has compact rows (a loop of its own: the float32 one
    stays as the compiler inlined it)."""
    cdef int64_t i
    cdef int status = OK, dt = 0
    cdef const float *row
    cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
    cdef Pipe pipe
    pipe.keys, pipe.n, pipe.lines, pipe.links = keys, n, (dim + 15) // 16, train
    for i in range(-PF_SLOT, n):
        _stage(self, &pipe, i)
        if i < 0:
            continue
        row = _row_mixed(self, &pipe, i, ai, a, dim, train, zero, &status, &dt)
        if row == NULL:
            at[0] = i
            return status
        sp_read_w(out + i * dim, row, dim, dt)
    return OK


cdef int _lookup_pooled(CEmbeddingStore self, const uint64_t *keys, int64_t n, int ai, int dim,
                        bint train, const int32_t *index, const int64_t *offsets,
                        int64_t k, float *out, int64_t *at,
                        const float *zero) noexcept nogil:
    """Add each occurrence's row to its segment of ``out`` (zeroed), the occurrences
    in order, looking the ids up in order as they are first needed (and the ones no
    occurrence names at the end): the store sees exactly ``_lookup``'s sequence, and a
    worker's ids (in first-occurrence order) are added while their row is in cache.
    A later id's admission must not evict an earlier row, and no row is compact: the
    caller ensures both."""
    cdef int64_t s, j, i = 0, want
    cdef int status = OK
    cdef float *acc
    cdef float **rows = self.rbuf
    cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
    cdef Pipe pipe
    pipe.keys, pipe.n, pipe.lines, pipe.links = keys, n, (dim + 15) // 16, train
    for i in range(-PF_SLOT, 0):
        _stage(self, &pipe, i)
    i = 0
    for s in range(k):
        acc = out + s * dim
        for j in range(offsets[s], offsets[s + 1]):
            want = index[j]
            while i <= want:
                _stage(self, &pipe, i)
                rows[i] = _row_of(self, &pipe, i, ai, a, train, zero, &status)
                if rows[i] == NULL:
                    at[0] = i
                    return status
                i += 1
            sp_add(acc, rows[want], dim)  # acc + row in order, as segments.pool adds
    while i < n:
        _stage(self, &pipe, i)
        if _row_of(self, &pipe, i, ai, a, train, zero, &status) == NULL:
            at[0] = i
            return status
        i += 1
    return OK


cdef int _update(CEmbeddingStore self, const uint64_t *keys, const float *g, int64_t n, int dim,
                 int ai, int64_t *at) noexcept nogil:
    cdef int64_t i
    cdef int32_t e, u, nu = 0
    # This call's version as entries store it (cver - vbase < 2**32 - 1: see _rebase). No
    # entry holds it yet: the first sight of an entry sets it (the old value kept in obuf
    # to undo it if the call fails), and later ids of the call find their sum by pos.
    cdef uint32_t v32 = <uint32_t>(self.cver + 1 - self.vbase)
    cdef Entry *x
    cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
    cdef Arena *xa
    cdef float *row
    cdef int64_t dropped = 0
    cdef int lines = (dim + (self.arenas[ai].width if ai >= 0 else 0) + 15) // 16, j, width
    cdef uint32_t bad = 0
    # Pass 1: resolve ids, sum the gradients of each stored id (in call order, from 0),
    # and check that every gradient is finite (on the same read of grads).
    cdef Pipe p
    p.keys, p.n, p.lines, p.links = keys, n, 0, False
    for i in range(-PF_SLOT, n):
        _stage(self, &p, i)
        if i < 0:
            continue
        bad |= sp_nonfinite_bits(g + i * dim, dim)
        e = _resolve(self, &p, i)
        if e < 0:
            dropped += 1
            self.ebuf[n - dropped] = <int32_t>i   # from the end: nu + dropped <= n
            continue
        x = &self.entries[e]
        xa = a
        if x.arena != ai:
            xa = &self.arenas[x.arena]
            if xa.dim != dim:
                at[0] = i
                _unstamp(self, nu)
                return _first_nonfinite(self, g, n, dim, at, E_DIM)
        if x.ver != v32:
            self.ebuf[nu] = e
            self.obuf[nu] = x.ver
            x.ver = v32
            x.pos = nu
            self.rbuf[nu] = row_ptr(xa, x.row)
            sp_first(self.gbuf + <int64_t>nu * dim, g + i * dim, dim)
            nu += 1
        else:
            sp_add(self.gbuf + <int64_t>x.pos * dim, g + i * dim, dim)
    if bad:
        _unstamp(self, nu)
        return _first_nonfinite(self, g, n, dim, at, OK)
    # The entries this update takes past the dirty list's mark (from their old versions,
    # kept in obuf), appended here rather than in pass 1: it cannot fail any more, and
    # pass 1, the loop bound by memory latency, keeps one branch less.
    if self.mrel >= 0:
        for u in range(nu):
            _dirty(self, self.ebuf[u], self.obuf[u])
    self.n_updates += n
    self.n_dropped += dropped
    for i in range(dropped):
        self.pol[_policy_of(self, keys[self.ebuf[n - 1 - i]])].dropped += 1
    self.version += 1
    _bump(self)
    # Pass 2: one optimizer step per stored id (none where its sum or step is not finite).
    if self.ncompact:
        _apply_compact(self, nu, dim, lines)
        return OK
    width = self.arenas[ai].width if ai >= 0 else 0
    for u in range(nu):
        if u + PF_ROW < nu:
            for j in range(lines):
                sp_prefetch(self.rbuf[u + PF_ROW] + 16 * j)
        if _step(self, self.rbuf[u], self.gbuf + <int64_t>u * dim, dim, width):
            self.n_nonfinite += 1
    return OK


cdef inline bint _step(CEmbeddingStore self, float *row, float *g, int dim,
                       int width) noexcept nogil:
    """One optimizer step (and the clamp) of a float32 row with its summed gradient ``g``,
    unless ``g`` or the step's result (weights or state) is not finite: then the row keeps
    its values and the result is True. Finite gradients of one id can add up to inf (a
    batch naming it many times), and a finite one can overflow the state (g * g): neither
    may leave inf or NaN in a row (the clamp turns inf weights into the bound, not NaN).
    sp_step tests the values as it computes them, keeping the ones it replaces in
    ``kbuf`` (put back on a refusal)."""
    if sp_step(&self.opt, row, row + dim, g, dim, self.kbuf, self.kbuf + dim):
        memcpy(row, self.kbuf, sizeof(float) * (dim + width))
        return True
    return False


cdef void _apply_compact(CEmbeddingStore self, int32_t nu, int dim, int lines) noexcept nogil:
    """Pass 2 of ``_update`` while some rows are compact: a compact row's weights are
    read to float32 (``ibuf``), stepped and clamped as a float32 row's are, and stored
    back rounded (sp_narrow). A separate loop: the float32 store's stays as it was."""
    cdef int32_t u
    cdef int j
    cdef Arena *xa
    cdef float *row
    cdef float *g
    for u in range(nu):
        if u + PF_ROW < nu:   # as pass 2 does (a compact row has fewer lines: no harm)
            for j in range(lines):
                sp_prefetch(self.rbuf[u + PF_ROW] + 16 * j)
            sp_prefetch(&self.entries[self.ebuf[u + PF_ROW]])
        xa = &self.arenas[self.entries[self.ebuf[u]].arena]
        row = self.rbuf[u]
        g = self.gbuf + <int64_t>u * dim
        if xa.dtype == 0:
            if _step(self, row, g, dim, xa.width):
                self.n_nonfinite += 1
        else:   # as _step, from the weights read to float32, stored back rounded
            sp_widen(self.ibuf, row, dim, xa.dtype)
            if sp_step(&self.opt, self.ibuf, row + xa.wlen, g, dim, self.kbuf,
                       self.kbuf + dim):
                memcpy(row + xa.wlen, self.kbuf + dim, sizeof(float) * xa.width)
                self.n_nonfinite += 1
            else:
                sp_narrow(row, self.ibuf, dim, xa.dtype)


cdef void _unstamp(CEmbeddingStore self, int32_t nu) noexcept nogil:
    """Undo pass 1's versions of a failed update (it changes nothing)."""
    cdef int32_t u
    for u in range(nu):
        self.entries[self.ebuf[u]].ver = self.obuf[u]


cdef int _first_nonfinite(CEmbeddingStore self, const float *g, int64_t n, int dim, int64_t *at,
                          int otherwise) noexcept nogil:
    """E_NONFINITE at the first non-finite row of grads, else ``otherwise`` (errors are
    reported in the order the twin checks them)."""
    cdef int64_t i
    for i in range(n):
        if sp_nonfinite_bits(g + i * dim, dim):
            at[0] = i
            return E_NONFINITE
    return otherwise
