# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""Segment kernels of the pooled lookup path (``stream_persia.kernels._segments``).

Use them through :mod:`stream_persia.kernels.segments`, which validates arguments, documents the
semantics and holds the numpy twins these loops must match bit for bit. Every loop runs
without the GIL; each float is summed in the order its terms appear, starting from 0.0, as
the twins and torch's ``embedding_bag`` do.

Error codes returned by the ``c_*`` loops: 0 ok, 1 an index out of range (the position is
written to ``at``), 2 malformed offsets, 3 an owner out of range (``c_split``), 4 values
that are not a 1-D uint64 array (``c_pooled_lookup``, which writes the slot to ``at`` for
codes 2 and 4).
"""

cimport cython
from cpython.buffer cimport (
    PyBUF_FORMAT,
    PyBUF_STRIDES,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

import numpy as np

cdef extern from *:
    """
    #define SG_PREFETCH(p) __builtin_prefetch((p))
    """
    void sg_prefetch "SG_PREFETCH"(const void *p) nogil

cdef enum:
    OK = 0
    E_INDEX = 1
    E_OFFSETS = 2
    E_OWNER = 3
    E_VALUES = 4
    PF = 16          # ids hashed ahead in factorize
    CHUNK = 64       # ids prefixed and hashed at once in c_pooled_lookup


cdef inline uint64_t _mix64(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)


cdef inline int32_t _intern(int32_t *table, uint64_t mask, uint64_t h, uint64_t key,
                            uint64_t *uniq, int32_t *m) noexcept nogil:
    """The position of ``key`` among ``uniq[:m]``, appending it if new; ``table`` is the
    open-addressing index of ``uniq`` (-1 when empty, linear probing from slot ``h``)."""
    cdef int32_t e
    while True:
        e = table[h]
        if e < 0:
            table[h] = m[0]
            uniq[m[0]] = key
            m[0] += 1
            return m[0] - 1
        if uniq[e] == key:
            return e
        h = (h + 1) & mask


def factorize(const uint64_t[::1] keys):
    """(distinct keys in first-occurrence order, int32 position of every key among them)."""
    cdef Py_ssize_t n = keys.shape[0], i
    uniq = np.empty(n, np.uint64)
    inverse = np.empty(n, np.int32)
    if n == 0:
        return uniq, inverse
    if n >= 1 << 31:
        raise ValueError(f"factorize: {n} keys exceed int32 positions")
    cdef int bits = max(4, int(2 * n - 1).bit_length())     # load <= 1/2
    cdef uint64_t mask = (<uint64_t>1 << bits) - 1, k
    cdef int shift = 64 - bits
    cdef uint64_t[::1] u = uniq
    cdef int32_t[::1] inv = inverse
    cdef int32_t *table = <int32_t*>malloc(sizeof(int32_t) << bits)
    cdef int32_t m = 0
    if table == NULL:
        raise MemoryError("factorize: out of memory")
    with nogil:
        memset(table, 0xFF, sizeof(int32_t) << bits)       # every slot -1
        for i in range(n):
            if i + PF < n:
                sg_prefetch(&table[_mix64(keys[i + PF]) >> shift])
            k = keys[i]
            inv[i] = _intern(table, mask, _mix64(k) >> shift, k, &u[0], &m)
    free(table)
    return uniq[:m], inverse


cdef int _check_offsets(const int64_t[::1] offsets, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t s, k = offsets.shape[0] - 1
    if k < 0 or offsets[0] != 0 or offsets[k] != n:
        return E_OFFSETS
    for s in range(k):
        if offsets[s + 1] < offsets[s]:
            return E_OFFSETS
    return OK


cdef int _check_lookup(const int32_t[::1] index, const int64_t[::1] offsets, Py_ssize_t m,
                       int64_t[::1] at) noexcept nogil:
    """A pooled lookup's offsets (see _check_offsets) and every index in [0, m)."""
    cdef Py_ssize_t j, n = index.shape[0]
    if _check_offsets(offsets, n) != OK:
        return E_OFFSETS
    for j in range(n):
        if index[j] < 0 or index[j] >= m:
            at[0] = j
            return E_INDEX
    return OK


def c_pool(const float[:, ::1] rows, const int32_t[::1] index, const int64_t[::1] offsets,
           float[:, ::1] out, int64_t[::1] at):
    """``out[s] += sum(rows[index[offsets[s]:offsets[s+1]]])``; ``out`` zeroed by the
    caller. Returns an error code (index errors: the position in ``at[0]``)."""
    cdef Py_ssize_t k = offsets.shape[0] - 1, s, j, d, n = index.shape[0]
    cdef Py_ssize_t dim = rows.shape[1]
    cdef int32_t m = <int32_t>rows.shape[0]
    cdef float *acc
    cdef const float *src
    cdef int status = OK
    with nogil:
        status = _check_lookup(index, offsets, m, at)
        if status == OK:
            for s in range(k):
                acc = &out[s, 0]
                for j in range(offsets[s], offsets[s + 1]):
                    if j + 8 < offsets[k]:
                        sg_prefetch(&rows[index[j + 8], 0])
                    src = &rows[index[j], 0]
                    for d in range(dim):
                        acc[d] += src[d]
    return status


def c_scatter(const float[:, ::1] grads, const int32_t[::1] index,
              const int64_t[::1] offsets, const uint8_t[::1] active, float[:, ::1] out,
              uint8_t[::1] touched, int64_t[::1] at):
    """For every active segment s and every j in it: ``out[index[j]] += grads[s]`` and
    ``touched[index[j]] = 1`` (``out``/``touched`` zeroed by the caller)."""
    cdef Py_ssize_t k = offsets.shape[0] - 1, s, j, d, n = index.shape[0]
    cdef Py_ssize_t dim = grads.shape[1]
    cdef int32_t m = <int32_t>out.shape[0], u
    cdef float *acc
    cdef const float *g
    cdef int status = OK
    with nogil:
        status = _check_lookup(index, offsets, m, at)
        if status == OK:
            for s in range(k):
                if not active[s]:
                    continue
                g = &grads[s, 0]
                for j in range(offsets[s], offsets[s + 1]):
                    u = index[j]
                    touched[u] = 1
                    acc = &out[u, 0]
                    for d in range(dim):
                        acc[d] += g[d]
    return status


def c_split(const int32_t[::1] index, const int64_t[::1] offsets, const int64_t[::1] owner,
            int parts, int64_t[::1] id_order, int64_t[::1] id_starts, int32_t[::1] local_index,
            int64_t[::1] index_starts, int64_t[:, ::1] part_offsets, int64_t[::1] at):
    """Partition a pooled lookup by the part (server) owning each distinct id.

    ``owner[u]`` in [0, parts) is the part of distinct id u. Fills: ``id_order`` the
    distinct ids grouped by part (stable) with part p at ``id_starts[p]:id_starts[p+1]``;
    ``local_index`` every occurrence's position among its part's ids, grouped by part
    (stable) with part p at ``index_starts[p]:index_starts[p+1]``; ``part_offsets[p]`` the
    segment offsets into part p's occurrences. Error codes as the other kernels, and
    E_OWNER with the distinct id's position for an owner out of range.
    """
    cdef Py_ssize_t k = offsets.shape[0] - 1, s, j, n = index.shape[0]
    cdef Py_ssize_t m = owner.shape[0], u
    cdef int64_t p
    cdef int status = OK
    cdef int64_t *ucount = <int64_t*>malloc(sizeof(int64_t) * parts)
    cdef int64_t *ocount = <int64_t*>malloc(sizeof(int64_t) * parts)
    cdef int32_t *local = <int32_t*>malloc(sizeof(int32_t) * (m if m > 0 else 1))
    if ucount == NULL or ocount == NULL or local == NULL:
        free(ucount)
        free(ocount)
        free(local)
        raise MemoryError("split: out of memory")
    with nogil:
        memset(ucount, 0, sizeof(int64_t) * parts)
        memset(ocount, 0, sizeof(int64_t) * parts)
        status = _check_lookup(index, offsets, m, at)
        if status == OK:
            for u in range(m):
                p = owner[u]
                if p < 0 or p >= parts:
                    at[0] = u
                    status = E_OWNER
                    break
                local[u] = <int32_t>ucount[p]
                ucount[p] += 1
        if status == OK:
            for j in range(n):
                ocount[owner[index[j]]] += 1
        if status == OK:
            id_starts[0] = 0
            index_starts[0] = 0
            for p in range(parts):
                id_starts[p + 1] = id_starts[p] + ucount[p]
                index_starts[p + 1] = index_starts[p] + ocount[p]
                ucount[p] = id_starts[p]        # now: the next free place of part p
                ocount[p] = index_starts[p]
                part_offsets[p, 0] = 0
            for u in range(m):
                p = owner[u]
                id_order[ucount[p]] = u
                ucount[p] += 1
            for s in range(k):
                for j in range(offsets[s], offsets[s + 1]):
                    u = index[j]
                    p = owner[u]
                    local_index[ocount[p]] = local[u]
                    ocount[p] += 1
                for p in range(parts):
                    part_offsets[p, s + 1] = ocount[p] - index_starts[p]
    free(ucount)
    free(ocount)
    free(local)
    return status


def c_internal_owner(const uint64_t[::1] ids, int64_t parts, int64_t[::1] out):
    """``out[i] = (splitmix64(ids[i] + 0x9E3779B97F4A7C15) >> 32) % parts``: the internal
    shard of each id (``segments.internal_owner`` holds the numpy twin)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef uint64_t q = <uint64_t>parts
    with nogil:
        for i in range(n):
            out[i] = <int64_t>((_mix64(ids[i] + <uint64_t>0x9E3779B97F4A7C15) >> 32) % q)


def c_split_part(const int32_t[::1] index, const int64_t[::1] offsets,
                 const int64_t[::1] owner, int64_t part, int64_t[::1] positions,
                 int32_t[::1] local_index, int64_t[::1] part_offsets, int64_t[::1] at):
    """Part ``part`` of ``c_split`` alone: fills ``positions`` (its distinct ids, in
    order), ``local_index`` (its occurrences' positions among them, in order) and
    ``part_offsets`` (k + 1). Writes the counts of ids and occurrences to ``at[0]`` and
    ``at[1]``; returns an error code as c_split (no owner is out of range here: the
    others are simply not this part's). One pass over the ids and one over the
    occurrences, so that every part can be cut on its own thread."""
    cdef Py_ssize_t k = offsets.shape[0] - 1, s, j, n = index.shape[0]
    cdef Py_ssize_t m = owner.shape[0], u
    cdef int64_t nu = 0, no = 0, mine
    cdef int32_t l
    cdef int status = OK
    cdef int32_t *local = <int32_t*>malloc(sizeof(int32_t) * (m if m > 0 else 1))
    if local == NULL:
        raise MemoryError("split_part: out of memory")
    with nogil:
        status = _check_lookup(index, offsets, m, at)
        if status == OK:
            # Branch-free: which part owns an id is a coin toss, and mispredicted branches
            # made these loops 4x slower. Every step writes; only the counts advance.
            for u in range(m):
                mine = owner[u] == part
                positions[nu] = u                  # nu <= u < m
                local[u] = <int32_t>nu | -(<int32_t>(1 - mine))
                nu += mine
            part_offsets[0] = 0
            for s in range(k):
                for j in range(offsets[s], offsets[s + 1]):
                    l = local[index[j]]
                    local_index[no] = l              # no <= j < n
                    no += l >= 0
                part_offsets[s + 1] = no
            at[0] = nu
            at[1] = no
    free(local)
    return status


# ---------------------------------------------------------------------------- pooled lookup
cdef struct Slot:
    const char *values       # the slot's ids, values_stride bytes apart (any alignment)
    const char *offsets      # its CSR offsets, offsets_stride bytes apart
    Py_ssize_t values_stride
    Py_ssize_t offsets_stride
    Py_ssize_t n             # number of ids
    uint64_t prefix          # 0: the ids are taken as they are
    bint sqrt


cdef inline uint64_t _load_u64(const char *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)         # one unaligned load: wire arrays need not be aligned
    return v


cdef inline int64_t _load_i64(const char *p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint64_t _prefixed(uint64_t v, uint64_t modulus, uint64_t prefix) noexcept nogil:
    """config.apply_index_prefix for one id: ``v % modulus + prefix`` (uint64, wrapping);
    ids below the modulus skip the division."""
    if v >= modulus:
        v = v % modulus
    return v + prefix


cdef bint _acquire(object obj, Py_buffer *buf, const char *codes):
    """Hold ``obj``'s buffer if it is a 1-D ndarray of 8-byte items whose native format is
    one of ``codes``; False, holding nothing, otherwise."""
    if not isinstance(obj, np.ndarray):
        return False
    try:
        PyObject_GetBuffer(obj, buf, PyBUF_STRIDES | PyBUF_FORMAT)
    except (BufferError, TypeError, ValueError):     # e.g. datetime64: no buffer format
        return False
    cdef const char *f = buf.format
    if buf.ndim == 1 and buf.itemsize == 8 and f != NULL:
        if f[0] == b'@' or f[0] == b'=':
            f += 1
        if f[0] != 0 and f[1] == 0 and (f[0] == codes[0] or f[0] == codes[1]):
            return True
    PyBuffer_Release(buf)
    return False


cdef int _check_slot(const Slot *slot, Py_ssize_t batch) noexcept nogil:
    """E_OFFSETS unless the slot's offsets run nondecreasing from 0 to its number of ids."""
    cdef Py_ssize_t b
    cdef int64_t prev = _load_i64(slot.offsets), cur
    if prev != 0:
        return E_OFFSETS
    for b in range(1, batch + 1):
        cur = _load_i64(slot.offsets + b * slot.offsets_stride)
        if cur < prev:
            return E_OFFSETS
        prev = cur
    return OK if prev == slot.n else E_OFFSETS


def c_pooled_lookup(list values, list offsets, int prefix_bits,
                    const uint64_t[::1] index_prefixes, const uint8_t[::1] sqrt_scaling,
                    bint scaled, int64_t[::1] at):
    """The pooled lookup of several CSR slots of one dim, in one pass.

    Slot i holds ``values[i]`` (1-D uint64) and ``offsets[i]`` (1-D int64, the same length
    for every slot: batch + 1). Its ids are prefixed as ``config.apply_index_prefix`` does
    (taken as they are when ``prefix_bits`` or ``index_prefixes[i]`` is 0; else
    ``id % (2**(64 - prefix_bits) - 1) + index_prefixes[i]``), the slots are concatenated,
    and the keys de-duplicated as :func:`factorize` does.

    Returns ``(status, ids, index, offsets, scale)``: the distinct keys in first-occurrence
    order, every key's int32 position among them, the int64 bounds of one segment per
    (slot, sample) in slot-major order, and, when ``scaled``, float32 ``1/sqrt(n)`` per
    segment of a slot with ``sqrt_scaling[i]`` (0 for an empty sample, 1 elsewhere), else
    None. A nonzero status (E_VALUES, E_OFFSETS; the slot in ``at[0]``) comes with Nones.
    """
    cdef Py_ssize_t k = len(values), i, j, b, n = 0, batch = 0, base
    if len(offsets) != k or index_prefixes.shape[0] != k or sqrt_scaling.shape[0] != k:
        raise ValueError("c_pooled_lookup: one values, offsets, index prefix and flag per slot")
    if not 0 <= prefix_bits < 64:
        raise ValueError(f"c_pooled_lookup: prefix_bits must lie in [0, 64), got {prefix_bits}")
    cdef uint64_t modulus = (<uint64_t>1 << (64 - prefix_bits)) - 1 if prefix_bits else 0
    cdef Py_buffer *bufs = <Py_buffer*>calloc(2 * k + 1, sizeof(Py_buffer))
    cdef Slot *slots = <Slot*>calloc(k + 1, sizeof(Slot))
    cdef Py_ssize_t held = 0     # buffers acquired (released in the finally)
    cdef int status = OK
    cdef int bits, shift
    cdef uint64_t mask, key
    cdef uint64_t kbuf[CHUNK]
    cdef uint64_t hbuf[CHUNK]
    cdef const char *p
    cdef Py_ssize_t stride, c0, c, t
    cdef uint64_t prefix
    cdef int32_t *table = NULL
    cdef int32_t m = 0
    cdef const Slot *slot
    cdef int64_t count
    cdef uint64_t[::1] u
    cdef int32_t[::1] inv
    cdef int64_t[::1] seg
    cdef float[::1] sc
    if bufs == NULL or slots == NULL:
        free(bufs)
        free(slots)
        raise MemoryError("c_pooled_lookup: out of memory")
    try:
        for i in range(k):
            if not _acquire(values[i], &bufs[held], b"LQ"):
                at[0] = i
                return E_VALUES, None, None, None, None
            held += 1
            if not _acquire(offsets[i], &bufs[held], b"lq"):
                at[0] = i
                return E_OFFSETS, None, None, None, None
            held += 1
            if bufs[held - 1].shape[0] < 1 or bufs[held - 1].shape[0] != bufs[1].shape[0]:
                at[0] = i
                return E_OFFSETS, None, None, None, None
            slots[i].values = <const char*>bufs[held - 2].buf
            slots[i].values_stride = bufs[held - 2].strides[0]
            slots[i].n = bufs[held - 2].shape[0]
            slots[i].offsets = <const char*>bufs[held - 1].buf
            slots[i].offsets_stride = bufs[held - 1].strides[0]
            slots[i].prefix = index_prefixes[i] if prefix_bits else 0
            slots[i].sqrt = sqrt_scaling[i] != 0
            n += slots[i].n
        if k:
            batch = bufs[1].shape[0] - 1
        with nogil:
            for i in range(k):
                status = _check_slot(&slots[i], batch)
                if status != OK:
                    at[0] = i
                    break
        if status != OK:
            return status, None, None, None, None
        if n >= 1 << 31:
            raise ValueError(f"pooled lookup: {n} ids exceed int32 positions")
        ids = np.empty(n, np.uint64)
        index = np.empty(n, np.int32)
        bounds = np.empty(k * batch + 1, np.int64)
        scale = np.empty(k * batch, np.float32) if scaled else None
        u, inv, seg = ids, index, bounds
        if scaled:
            sc = scale
        bits = max(4, int(2 * n - 1).bit_length())           # load <= 1/2, as factorize
        mask = (<uint64_t>1 << bits) - 1
        shift = 64 - bits
        table = <int32_t*>malloc(sizeof(int32_t) << bits)
        if table == NULL:
            raise MemoryError("c_pooled_lookup: out of memory")
        with nogil:
            base = 0
            for i in range(k):
                slot = &slots[i]
                for b in range(batch):
                    count = _load_i64(slot.offsets + b * slot.offsets_stride)
                    seg[i * batch + b] = base + count
                    if scaled:
                        count = _load_i64(slot.offsets + (b + 1) * slot.offsets_stride) - count
                        if not slot.sqrt:
                            sc[i * batch + b] = 1.0
                        elif count > 0:
                            sc[i * batch + b] = <float>(1.0 / sqrt(<double>count))
                        else:
                            sc[i * batch + b] = 0.0
                base += slot.n
            seg[k * batch] = base
            # The keys of every slot in turn, as np.concatenate would lay them out, a chunk
            # at a time: prefix and hash the chunk, prefetching its table slots, then
            # insert it (its first slots have arrived by then).
            memset(table, 0xFF, sizeof(int32_t) << bits)        # every slot -1
            j = 0
            for i in range(k):
                slot = &slots[i]
                p = slot.values
                stride = slot.values_stride
                prefix = slot.prefix
                c0 = 0
                while c0 < slot.n:
                    c = CHUNK if slot.n - c0 > CHUNK else slot.n - c0
                    for t in range(c):
                        key = _load_u64(p + (c0 + t) * stride)
                        if prefix != 0:
                            key = _prefixed(key, modulus, prefix)
                        kbuf[t] = key
                        hbuf[t] = _mix64(key) >> shift
                        sg_prefetch(&table[hbuf[t]])
                    for t in range(c):
                        inv[j] = _intern(table, mask, hbuf[t], kbuf[t], &u[0], &m)
                        j += 1
                    c0 += c
        return OK, ids[:m], index, bounds, scale
    finally:
        free(table)
        for i in range(held):
            PyBuffer_Release(&bufs[i])
        free(bufs)
        free(slots)
