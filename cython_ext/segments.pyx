# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""Segment kernels of the pooled lookup path (``stream_persia._segments``).

Use them through :mod:`stream_persia.segments`, which validates arguments, documents the
semantics and holds the numpy twins these loops must match bit for bit. Every loop runs
without the GIL; each float is summed in the order its terms appear, starting from 0.0, as
the twins and torch's ``embedding_bag`` do.

Error codes returned by the ``c_*`` loops: 0 ok, 1 an index out of range (the position is
written to ``at``), 2 malformed offsets, 3 an owner out of range (``c_split``).
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

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
    PF = 16          # ids hashed ahead in factorize


cdef inline uint64_t _mix64(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)


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
    cdef uint64_t mask = (<uint64_t>1 << bits) - 1, h, k
    cdef int shift = 64 - bits
    cdef uint64_t[::1] u = uniq
    cdef int32_t[::1] inv = inverse
    cdef int32_t *table = <int32_t*>malloc(sizeof(int32_t) << bits)
    cdef int32_t m = 0, e
    if table == NULL:
        raise MemoryError("factorize: out of memory")
    with nogil:
        memset(table, 0xFF, sizeof(int32_t) << bits)       # every slot -1
        for i in range(n):
            if i + PF < n:
                sg_prefetch(&table[_mix64(keys[i + PF]) >> shift])
            k = keys[i]
            h = _mix64(k) >> shift
            while True:
                e = table[h]
                if e < 0:
                    table[h] = m
                    u[m] = k
                    inv[i] = m
                    m += 1
                    break
                if u[e] == k:
                    inv[i] = e
                    break
                h = (h + 1) & mask
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
