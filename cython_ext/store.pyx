# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""Cython LRU embedding store (``stream_persia.embedding._cstore``).

Same interface and the same results, bit for bit, as the pure-Python twin
``stream_persia.embedding._pystore.PyEmbeddingStore``, which documents the semantics, the
validation and the hash functions both use. Layout, chosen for memory (about 50 bytes of
bookkeeping per row at full load) and for loops that run without the GIL:

- ``entries``: one 32-byte ``Entry`` per stored row (id, intrusive doubly linked LRU list,
  arena and row of its vector), reused through a free list threaded through ``next``;
- ``table``: open addressing with linear probing, load <= 1/2, slots of (32-bit hash, entry)
  so that probing past other keys and rehashing never touch the entries; deletion shifts
  the cluster back (no tombstones, so probes stay short under constant eviction);
- one arena per dim: rows ``[weights(dim) | optimizer state]`` float32 in blocks of about
  2 MiB (memory grows by a block, never by doubling), free rows threaded through their
  first word.

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
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

import numpy as np

from stream_persia import segments as _segments
from stream_persia.embedding import _pystore as _py
from stream_persia.embedding.optim import as_optimizer
from stream_persia.errors import BadInput, Misuse

cdef extern from *:
    """
    #include <math.h>
    #include <stdlib.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* No fused multiply-add in the kernels (with -march flags that allow it): the stores
       must round every float32 operation as numpy does. */
    #if defined(__clang__)
    #pragma STDC FP_CONTRACT OFF
    #define SP_KERNEL static
    #elif defined(__GNUC__)
    #define SP_KERNEL static __attribute__((optimize("fp-contract=off")))
    #else
    #define SP_KERNEL static
    #endif
    #define SP_NONE32 0xFFFFFFFFu
    #define SP_PREFETCH_W(p) __builtin_prefetch((p), 1)

    typedef struct { int kind; int shared; float lr, momentum, wd, b1, b2, c1, c2, eps, g2m,
                     bound; } SpOpt;

    static inline uint64_t sp_mix64(uint64_t z) {
        z += 0x9E3779B97F4A7C15ULL;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    /* Top 32 bits of a multiplicative hash: the home slot is its top tbits bits. */
    static inline uint32_t sp_hash32(uint64_t key) {
        return (uint32_t)((key * 0x9E3779B97F4A7C15ULL) >> 32);
    }
    #if defined(__linux__)
    #include <sys/mman.h>
    #define SP_MMAP 1
    #else
    #define SP_MMAP 0
    #endif
    #define SP_HUGE (1u << 21)
    #define SP_MAP_MIN (1u << 18)
    /* Large buffers are mapped directly rather than taken from malloc: freeing them then
       returns the memory to the system at once (glibc's heap would keep it, and would
       fragment around the numpy temporaries of the caller). With `huge`, they are 2 MiB
       aligned and on transparent huge pages: the store is read at random, and with 4 KiB
       pages nearly every access to a large store would also miss the TLB. */
    static void *sp_alloc(size_t n, int huge) {
        void *p = NULL;
    #if SP_MMAP
        if (n >= SP_MAP_MIN) {
            size_t extra = huge ? SP_HUGE : 0;
            char *m = mmap(NULL, n + extra, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) return NULL;
            if (!extra) return m;
            char *a = (char *)(((uintptr_t)m + SP_HUGE - 1) & ~(uintptr_t)(SP_HUGE - 1));
            if (a > m) munmap(m, (size_t)(a - m));
            if (a + n < m + n + extra) munmap(a + n, (size_t)(m + n + extra - (a + n)));
    #if defined(MADV_HUGEPAGE)
            madvise(a, n, MADV_HUGEPAGE);
    #endif
            return a;
        }
    #endif
        return posix_memalign(&p, 64, n) == 0 ? p : NULL;
    }
    static void sp_free(void *p, size_t n) {
        if (p == NULL) return;
    #if SP_MMAP
        if (n >= SP_MAP_MIN) { munmap(p, n); return; }
    #endif
        free(p);
    }

    /* New row of `key`: see _pystore.initial_rows (two 24-bit draws per mix64). */
    SP_KERNEL void sp_init_row(float *w, int d, uint64_t key, float lo, float span) {
        const uint64_t base = sp_mix64(key);
        const float scale = 1.0f / 16777216.0f;
        int j = 0;
    #if defined(__SSE2__)
        const __m128 vscale = _mm_set1_ps(scale), vspan = _mm_set1_ps(span),
                     vlo = _mm_set1_ps(lo);
        for (; j + 4 <= d; j += 4) {
            uint64_t h0 = sp_mix64(base + (uint64_t)(j >> 1));
            uint64_t h1 = sp_mix64(base + (uint64_t)(j >> 1) + 1);
            __m128i bits = _mm_set_epi32((int)((h1 >> 8) & 0xFFFFFFu), (int)(h1 >> 40),
                                         (int)((h0 >> 8) & 0xFFFFFFu), (int)(h0 >> 40));
            __m128 u = _mm_mul_ps(_mm_cvtepi32_ps(bits), vscale);
            _mm_storeu_ps(w + j, _mm_add_ps(vlo, _mm_mul_ps(vspan, u)));
        }
    #endif
        for (; j < d; j += 2) {
            uint64_t h = sp_mix64(base + (uint64_t)(j >> 1));
            w[j] = lo + span * ((float)(h >> 40) * scale);
            if (j + 1 < d) w[j + 1] = lo + span * ((float)((h >> 8) & 0xFFFFFFu) * scale);
        }
    }

    /* Bit 31 is set if any of the n floats is NaN or inf (exponent bits all ones). */
    static inline uint32_t sp_nonfinite_bits(const float *x, int64_t n) {
        const uint32_t *b = (const uint32_t *)x;
        uint32_t acc = 0;
        int64_t i = 0;
    #if defined(__SSE2__)
        const __m128i e = _mm_set1_epi32(0x7f800000), one = _mm_set1_epi32(0x00800000);
        __m128i v = _mm_setzero_si128();
        for (; i + 4 <= n; i += 4)
            v = _mm_or_si128(v, _mm_add_epi32(
                _mm_and_si128(_mm_loadu_si128((const __m128i *)(b + i)), e), one));
        acc = (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(v));
        acc = acc ? 0x80000000u : 0;
    #endif
        for (; i < n; i++) acc |= (b[i] & 0x7f800000u) + 0x00800000u;
        return acc & 0x80000000u;
    }

    static inline void sp_add(float *restrict acc, const float *restrict g, int d) {
        int j = 0;
    #if defined(__SSE2__)
        for (; j + 4 <= d; j += 4)
            _mm_storeu_ps(acc + j, _mm_add_ps(_mm_loadu_ps(acc + j), _mm_loadu_ps(g + j)));
    #endif
        for (; j < d; j++) acc[j] = acc[j] + g[j];
    }
    /* acc = 0 + g: the first gradient of an id, summed from +0.0 like the numpy twin. */
    static inline void sp_first(float *restrict acc, const float *restrict g, int d) {
        int j = 0;
    #if defined(__SSE2__)
        for (; j + 4 <= d; j += 4)
            _mm_storeu_ps(acc + j, _mm_add_ps(_mm_setzero_ps(), _mm_loadu_ps(g + j)));
    #endif
        for (; j < d; j++) acc[j] = 0.0f + g[j];
    }

    /* One optimizer step and the clamp: the float32 twin of Optimizer.step in optim.py. */
    SP_KERNEL void sp_apply(const SpOpt *o, float *restrict w, float *restrict s,
                            float *restrict g, int d) {
        int j;
        if (o->wd != 0.0f)
            for (j = 0; j < d; j++) g[j] = g[j] + o->wd * w[j];
        if (o->kind == 0) {
            if (o->momentum > 0.0f) {
                for (j = 0; j < d; j++) {
                    s[j] = o->momentum * s[j] + g[j];
                    w[j] = w[j] - o->lr * s[j];
                }
            } else {
                for (j = 0; j < d; j++) w[j] = w[j] - o->lr * g[j];
            }
        } else if (o->kind == 1) {
            if (o->shared) {
                float sq = 0.0f, den = sqrtf(s[0] + o->eps);
                for (j = 0; j < d; j++) sq = sq + g[j] * g[j];
                for (j = 0; j < d; j++) w[j] = w[j] - o->lr * g[j] / den;
                s[0] = o->g2m * s[0] + sq / (float)d;
            } else {
                j = 0;
    #if defined(__SSE2__)
                /* GCC keeps sqrtf scalar (errno); SSE performs the same IEEE operations. */
                const __m128 lr = _mm_set1_ps(o->lr), eps = _mm_set1_ps(o->eps),
                             g2m = _mm_set1_ps(o->g2m);
                for (; j + 4 <= d; j += 4) {
                    __m128 gj = _mm_loadu_ps(g + j), sj = _mm_loadu_ps(s + j);
                    __m128 step = _mm_div_ps(_mm_mul_ps(lr, gj), _mm_sqrt_ps(_mm_add_ps(sj, eps)));
                    _mm_storeu_ps(w + j, _mm_sub_ps(_mm_loadu_ps(w + j), step));
                    _mm_storeu_ps(s + j, _mm_add_ps(_mm_mul_ps(g2m, sj), _mm_mul_ps(gj, gj)));
                }
    #endif
                for (; j < d; j++) {
                    w[j] = w[j] - o->lr * g[j] / sqrtf(s[j] + o->eps);
                    s[j] = o->g2m * s[j] + g[j] * g[j];
                }
            }
        } else {
            float p1 = s[2 * d] * o->b1, p2 = s[2 * d + 1] * o->b2;
            float *m = s, *v = s + d;
            s[2 * d] = p1;
            s[2 * d + 1] = p2;
            p1 = 1.0f - p1;
            p2 = 1.0f - p2;
            j = 0;
    #if defined(__SSE2__)
            const __m128 b1 = _mm_set1_ps(o->b1), b2 = _mm_set1_ps(o->b2),
                         c1 = _mm_set1_ps(o->c1), c2 = _mm_set1_ps(o->c2),
                         lr = _mm_set1_ps(o->lr), eps = _mm_set1_ps(o->eps),
                         q1 = _mm_set1_ps(p1), q2 = _mm_set1_ps(p2);
            for (; j + 4 <= d; j += 4) {
                __m128 gj = _mm_loadu_ps(g + j);
                __m128 mj = _mm_add_ps(_mm_mul_ps(b1, _mm_loadu_ps(m + j)), _mm_mul_ps(c1, gj));
                __m128 vj = _mm_add_ps(_mm_mul_ps(b2, _mm_loadu_ps(v + j)),
                                       _mm_mul_ps(c2, _mm_mul_ps(gj, gj)));
                __m128 step = _mm_div_ps(_mm_mul_ps(lr, _mm_div_ps(mj, q1)),
                                         _mm_add_ps(_mm_sqrt_ps(_mm_div_ps(vj, q2)), eps));
                _mm_storeu_ps(m + j, mj);
                _mm_storeu_ps(v + j, vj);
                _mm_storeu_ps(w + j, _mm_sub_ps(_mm_loadu_ps(w + j), step));
            }
    #endif
            for (; j < d; j++) {
                m[j] = o->b1 * m[j] + o->c1 * g[j];
                v[j] = o->b2 * v[j] + o->c2 * (g[j] * g[j]);
                w[j] = w[j] - o->lr * (m[j] / p1) / (sqrtf(v[j] / p2) + o->eps);
            }
        }
        for (j = 0; j < d; j++) {
            float x = w[j];
            w[j] = x > o->bound ? o->bound : (x < -o->bound ? -o->bound : x);
        }
    }
    """
    ctypedef struct SpOpt:
        int kind
        int shared
        float lr, momentum, wd, b1, b2, c1, c2, eps, g2m, bound
    uint64_t sp_mix64(uint64_t z) nogil
    uint32_t sp_hash32(uint64_t key) nogil
    void *sp_alloc(size_t n, int huge) nogil
    void sp_free(void *p, size_t n) nogil
    void sp_init_row(float *w, int d, uint64_t key, float lo, float span) nogil
    uint32_t sp_nonfinite_bits(const float *x, int64_t n) nogil
    void sp_add(float *acc, const float *g, int d) nogil
    void sp_first(float *acc, const float *g, int d) nogil
    void sp_apply(const SpOpt *o, float *w, float *s, float *g, int d) nogil
    void sp_prefetch "__builtin_prefetch"(const void *p) nogil
    void sp_prefetch_w "SP_PREFETCH_W"(const void *p) nogil
    uint32_t NONE32 "SP_NONE32"

cdef struct Entry:    # 32 bytes, 64-byte aligned array: one cache line per entry
    uint64_t key
    int32_t prev      # towards the most recently used end (head); -1 at the head
    int32_t next      # towards the least recently used end (tail); free-list link when free
    uint32_t row
    uint16_t arena    # FREE_ARENA while the entry is free
    uint16_t _pad
    uint32_t stamp    # update() call that last saw this entry, and the entry's position
    int32_t pos       # in that call's list of unique ids

cdef struct Slot:
    uint32_t h        # sp_hash32(key)
    int32_t e         # entry index, -1 when empty

cdef struct Arena:
    int32_t dim
    int32_t width     # optimizer state values per row
    int32_t stride    # dim + width
    int32_t shift     # log2(rows per block)
    uint32_t used     # rows handed out (high-water mark)
    uint32_t free_head
    uint32_t nblocks
    uint32_t blocks_cap
    float **blocks
    float *init_state

cdef struct Pipe:      # prefetch pipeline over a batch of ids (see _stage)
    const uint64_t *keys
    int64_t n
    int lines         # cache lines of each row to prefetch
    bint links        # prefetch the LRU neighbours too
    uint32_t h[128]    # RING
    int32_t e[128]

cdef enum:
    OK = 0
    E_NOMEM = 1
    E_DIM = 2
    E_NONFINITE = 3
    MIN_TABLE_BITS = 10
    BLOCK_BYTES = 1 << 21
    RING = 128        # prefetch distances, in ids (< RING)
    PF_SLOT = 64
    PF_ENTRY = 32
    PF_ROW = 12
    FREE_ARENA = 0xFFFF

cdef inline float* row_ptr(const Arena *a, uint32_t r) noexcept nogil:
    return a.blocks[r >> a.shift] + <size_t>(r & ((<uint32_t>1 << a.shift) - 1)) * a.stride


cdef inline size_t _block_bytes(const Arena *a) noexcept nogil:
    return sizeof(float) * a.stride << a.shift


cdef SpOpt make_opt(opt, cfg) except *:
    cdef SpOpt o
    memset(&o, 0, sizeof(SpOpt))
    o.kind = {"sgd": 0, "adagrad": 1, "adam": 2}[opt.name]
    o.lr = np.float32(opt.lr)
    o.wd = np.float32(opt.weight_decay)
    o.bound = np.float32(cfg.weight_bound)
    if o.kind == 0:
        o.momentum = np.float32(opt.momentum)
    elif o.kind == 1:
        o.eps = np.float32(opt.eps)
        o.g2m = np.float32(opt.g_square_momentum)
        o.shared = opt.vectorwise_shared
    else:
        o.b1, o.b2 = np.float32(opt.betas[0]), np.float32(opt.betas[1])
        o.c1, o.c2 = np.float32(1.0 - opt.betas[0]), np.float32(1.0 - opt.betas[1])
        o.eps = np.float32(opt.eps)
    return o


@cython.final
cdef class CEmbeddingStore:
    """LRU embedding store in Cython; see ``PyEmbeddingStore`` for the full contract.

    Args:
        capacity: the most vectors stored (all dims together).
        optimizer: SGD, Adagrad or Adam (or its ``to_dict()``).
        embedding_config: initialisation, admission and clamping (defaults: PERSIA's).
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
    cdef size_t gbuf_bytes, rbuf_bytes, zbuf_bytes
    cdef uint32_t stamp
    cdef int64_t n_lookups, n_misses, n_admissions, n_evictions, n_updates, n_dropped
    cdef uint64_t draws
    cdef int64_t version
    cdef bint busy
    cdef object _opt_obj, _cfg, _dims

    implementation = "cython"

    def __init__(self, capacity, optimizer, embedding_config=None):
        self.capacity_ = _py.check_capacity(capacity)
        self._opt_obj = as_optimizer(optimizer)
        self._set_config(_py.check_config(embedding_config))
        self._reset()

    def __dealloc__(self):
        self._free_all()
        sp_free(self.gbuf, self.gbuf_bytes)
        sp_free(self.rbuf, self.rbuf_bytes)
        sp_free(self.zbuf, self.zbuf_bytes)

    # --- memory ----------------------------------------------------------------------------

    cdef void _free_all(self) noexcept:
        cdef int a
        cdef uint32_t b
        for a in range(self.narenas):
            for b in range(self.arenas[a].nblocks):
                sp_free(self.arenas[a].blocks[b], _block_bytes(&self.arenas[a]))
            free(self.arenas[a].blocks)
            free(self.arenas[a].init_state)
        free(self.arenas)
        sp_free(self.entries, sizeof(Entry) * self.ecap)
        sp_free(self.table, sizeof(Slot) << self.tbits)
        self.arenas = NULL
        self.entries = NULL
        self.table = NULL
        self.narenas = 0

    cdef _reset(self):
        self._free_all()
        self._dims = {}
        self.ecap = self.eused = self.count = 0
        self.efree = self.head = self.tail = -1
        self.tbits = MIN_TABLE_BITS
        self.table = <Slot*>sp_alloc(sizeof(Slot) << self.tbits, False)
        if self.table == NULL:
            raise MemoryError()
        memset(self.table, 0xFF, sizeof(Slot) << self.tbits)

    cdef _set_config(self, cfg):
        self._cfg = cfg
        self.opt = make_opt(self._opt_obj, cfg)
        lo, hi = _py.init_bounds(cfg.emb_initialization)
        self.init_lo = lo
        self.init_span = hi - lo
        self.admit_p = cfg.admit_probability

    cdef int _arena_index(self, int dim, bint create) except -2:
        idx = self._dims.get(dim)
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
        a.free_head = NONE32
        self._set_arena_state(a)
        self._dims[dim] = self.narenas
        self.narenas += 1
        return self.narenas - 1

    cdef _set_arena_state(self, Arena *a):
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
        a.stride = a.dim + width
        if a.nblocks == 0:
            while (sizeof(float) * a.stride << (shift + 1)) <= BLOCK_BYTES and shift < 20:
                shift += 1
            a.shift = shift

    cdef bint _grow_entries(self) noexcept nogil:
        cdef int64_t cap = self.ecap + (self.ecap >> 1)
        if cap < 1024:
            cap = 1024
        if cap > self.capacity_:
            cap = self.capacity_
        cdef Entry *e = <Entry*>sp_alloc(sizeof(Entry) * cap, cap >= 1 << 17)
        if e == NULL:
            return False
        if self.eused:
            memcpy(e, self.entries, sizeof(Entry) * self.eused)
        sp_free(self.entries, sizeof(Entry) * self.ecap)
        self.entries = e
        self.ecap = <int32_t>cap
        return True

    cdef bint _grow_table(self) noexcept nogil:
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

    cdef uint32_t _alloc_row(self, Arena *a) noexcept nogil:
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

    cdef void *_scratch(self, void **buf, size_t *have, size_t need) except NULL:
        """``buf`` (of ``have`` bytes) grown to at least ``need`` bytes; its contents are
        not kept. MemoryError when it cannot grow."""
        if have[0] < need:
            sp_free(buf[0], have[0])
            buf[0] = sp_alloc(need, False)
            have[0] = need if buf[0] != NULL else 0
            if buf[0] == NULL:
                raise MemoryError()
        return buf[0]

    cdef const float *_zeros(self, int dim) except NULL:
        """An all-zero row of ``dim`` floats: what a lookup miss that stores nothing reads."""
        cdef size_t need = sizeof(float) * dim
        if self.zbuf_bytes < need:
            self._scratch(<void**>&self.zbuf, &self.zbuf_bytes, need)
            memset(self.zbuf, 0, need)
        return self.zbuf

    # --- hash table, LRU list, prefetching -------------------------------------------------

    cdef inline int32_t _find(self, uint64_t key) noexcept nogil:
        cdef uint32_t h = sp_hash32(key), mask = (<uint32_t>1 << self.tbits) - 1
        cdef uint32_t i = h >> (32 - self.tbits)
        cdef int32_t e
        while True:
            e = self.table[i].e
            if e < 0 or (self.table[i].h == h and self.entries[e].key == key):
                return e
            i = (i + 1) & mask

    cdef void _table_remove(self, uint64_t key, int32_t e) noexcept nogil:
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

    cdef inline void _stage(self, Pipe *p, int64_t i) noexcept nogil:
        """Advance the prefetch pipeline before id ``i`` is processed: fetch the table slot
        of id i+PF_SLOT; follow its probe chain by hash and fetch the entry of id
        i+PF_ENTRY (remembered in the ring); check that entry's key and fetch the row and
        LRU neighbours of id i+PF_ROW. Only hints: see :meth:`_resolve`."""
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

    cdef inline int32_t _resolve(self, Pipe *p, int64_t i) noexcept nogil:
        """Entry of id ``i`` (-1 if not stored). The entry remembered by the pipeline is
        used only if it still holds this id; the store may have changed since."""
        cdef int32_t e = p.e[i & (RING - 1)]
        if e >= 0 and self.entries[e].key == p.keys[i] and self.entries[e].arena != FREE_ARENA:
            return e
        return self._find(p.keys[i])

    cdef inline void _unlink(self, int32_t e) noexcept nogil:
        cdef Entry *x = &self.entries[e]
        if x.prev >= 0:
            self.entries[x.prev].next = x.next
        else:
            self.head = x.next
        if x.next >= 0:
            self.entries[x.next].prev = x.prev
        else:
            self.tail = x.prev

    cdef inline void _push_front(self, int32_t e) noexcept nogil:
        cdef Entry *x = &self.entries[e]
        x.prev = -1
        x.next = self.head
        if self.head >= 0:
            self.entries[self.head].prev = e
        else:
            self.tail = e
        self.head = e

    cdef inline void _touch(self, int32_t e) noexcept nogil:
        if e != self.head:
            self._unlink(e)
            self._push_front(e)

    cdef void _evict_tail(self) noexcept nogil:
        cdef int32_t e = self.tail
        cdef Entry *x = &self.entries[e]
        cdef Entry *y
        cdef Arena *a = &self.arenas[x.arena]
        cdef float *row
        cdef int k
        cdef uint32_t s
        self._table_remove(x.key, e)
        self._unlink(e)
        (<uint32_t*>row_ptr(a, x.row))[0] = a.free_head
        a.free_head = x.row
        x.next = self.efree
        x.arena = FREE_ARENA
        self.efree = e
        self.count -= 1
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

    cdef int32_t _insert(self, uint64_t key, int ai) noexcept nogil:
        """Store a new row for ``key`` (evicting beyond capacity); -1 when out of memory."""
        cdef int32_t e
        cdef uint32_t mask, i, r, h = sp_hash32(key)
        if self.count >= self.capacity_:
            self._evict_tail()
        if (<int64_t>self.count + 1) * 2 > (<int64_t>1 << self.tbits):
            if not self._grow_table():
                return -1
        r = self._alloc_row(&self.arenas[ai])
        if r == NONE32:
            return -1
        if self.efree >= 0:
            e = self.efree
            self.efree = self.entries[e].next
        else:
            if self.eused == self.ecap and not self._grow_entries():
                return -1
            e = self.eused
            self.eused += 1
        self.entries[e].key = key
        self.entries[e].row = r
        self.entries[e].arena = <uint16_t>ai
        self.entries[e].stamp = 0
        mask = (<uint32_t>1 << self.tbits) - 1
        i = h >> (32 - self.tbits)
        while self.table[i].e >= 0:
            i = (i + 1) & mask
        self.table[i].h = h
        self.table[i].e = e
        self._push_front(e)
        self.count += 1
        return e

    # --- guards ----------------------------------------------------------------------------

    cdef _enter(self):
        if self.busy:
            raise Misuse("EmbeddingStore is not thread-safe: another call is running on it",
                         hint="serialise calls (one event loop or one lock per store)")
        self.busy = True

    cdef _raise(self, int status, int64_t i, ids, int dim, str what):
        if status == E_NOMEM:
            raise MemoryError("embedding store: out of memory")
        key = int(ids[i])
        if status == E_NONFINITE:
            raise _py.nonfinite_error(int(i), key)
        e = self._find(<uint64_t>key)
        raise _py.dim_error(key, self.arenas[self.entries[e].arena].dim, dim, what)

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

    def lookup(self, ids, dim, train=True):
        """Embeddings of ``ids`` as float32 (n, dim); see ``PyEmbeddingStore.lookup``."""
        ids = _py.check_ids(ids)
        cdef int d = _py.check_dim(dim)
        cdef bint tr = bool(train)
        cdef int ai = self._arena_index(d, tr)
        cdef int64_t n = ids.shape[0]
        out = np.empty((n, d), np.float32)
        if n == 0:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef float[:, ::1] o = out
        cdef int64_t i = 0
        cdef int status = OK
        cdef const float *zero
        self._enter()
        try:
            zero = self._zeros(d)   # scratch grows only under the busy guard
            self.n_lookups += n
            if tr:
                self.version += 1
            with nogil:
                status = self._lookup(&keys[0], n, ai, &o[0, 0], d, tr, &i, zero)
        finally:
            self.busy = False
        if status != OK:
            self._raise(status, i, ids, d, "lookup")
        return out

    def lookup_pooled(self, ids, dim, index, offsets, train=True):
        """Segment sums of the rows of ``ids``; see ``PyEmbeddingStore.lookup_pooled``.

        The rows are added where they lie in the store, each as it is looked up, so the
        ``(len(ids), dim)`` rows are never copied out. A training lookup that could evict
        (more ids than free capacity) copies them first instead, as ``lookup`` does: an
        admission may evict a row that an earlier id of the same call returned."""
        ids = _py.check_ids(ids)
        cdef int d = _py.check_dim(dim)
        _segments.check_pooled(ids.shape[0], index, offsets, "lookup_pooled")
        cdef bint tr = bool(train)
        cdef int ai = self._arena_index(d, tr)
        cdef int64_t n = ids.shape[0], k = offsets.shape[0] - 1
        cdef const int32_t[::1] ix = index
        cdef const int64_t[::1] off = offsets
        cdef int64_t i = 0
        cdef int status = OK
        if tr and <int64_t>self.count + n > self.capacity_:
            return _segments.pool(self.lookup(ids, d, True), index, offsets, "lookup_pooled")
        out = np.zeros((k, d), np.float32)
        if n == 0:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef float[:, ::1] o = out
        cdef const int32_t *ixp = &ix[0] if ix.shape[0] else NULL
        cdef const float *zero
        self._enter()
        try:
            zero = self._zeros(d)
            self._scratch(<void**>&self.rbuf, &self.rbuf_bytes, sizeof(float*) * n)
            self.n_lookups += n
            if tr:
                self.version += 1
            with nogil:
                status = self._lookup_pooled(&keys[0], n, ai, d, tr, ixp, &off[0], k,
                                             &o[0, 0], &i, zero)
        finally:
            self.busy = False
        if status != OK:
            self._raise(status, i, ids, d, "lookup")
        return out

    cdef inline float *_row_of(self, Pipe *pipe, int64_t i, int ai, Arena *a, bint train,
                               const float *zero, int *status) noexcept nogil:
        """The row of id ``i`` of the pipeline's keys, for reading: refreshed (train), or
        admitted and initialised (a train miss that passes admission), or ``zero`` (a miss
        that stores nothing). NULL with ``status`` set on an error."""
        cdef uint64_t key = pipe.keys[i]
        cdef int32_t e = self._resolve(pipe, i)
        cdef Entry *x
        cdef double u
        cdef float *row
        cdef int dim
        if e >= 0:
            x = &self.entries[e]
            if x.arena != ai:
                status[0] = E_DIM
                return NULL
            if train:
                self._touch(e)
            return row_ptr(a, x.row)
        self.n_misses += 1
        if not train:
            return <float*>zero
        u = 0.0
        if self.admit_p < 1.0:
            u = <double>(sp_mix64(key ^ sp_mix64(self.draws)) >> 11) * (
                1.0 / 9007199254740992.0)
        self.draws += 1
        if not u < self.admit_p:
            return <float*>zero
        e = self._insert(key, ai)
        if e < 0:
            status[0] = E_NOMEM
            return NULL
        self.n_admissions += 1
        dim = a.dim
        row = row_ptr(a, self.entries[e].row)
        sp_init_row(row, dim, key, self.init_lo, self.init_span)
        memcpy(row + dim, a.init_state, sizeof(float) * a.width)
        return row

    cdef int _lookup(self, const uint64_t *keys, int64_t n, int ai, float *out, int dim,
                     bint train, int64_t *at, const float *zero) noexcept nogil:
        """Copy the row of each of ``keys`` to ``out`` (zeros for a miss)."""
        cdef int64_t i
        cdef int status = OK
        cdef const float *row
        cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
        cdef Pipe pipe
        pipe.keys, pipe.n, pipe.lines, pipe.links = keys, n, (dim + 15) // 16, train
        for i in range(-PF_SLOT, n):
            self._stage(&pipe, i)
            if i < 0:
                continue
            row = self._row_of(&pipe, i, ai, a, train, zero, &status)
            if row == NULL:
                at[0] = i
                return status
            memcpy(out + i * dim, row, sizeof(float) * dim)
        return OK

    cdef int _lookup_pooled(self, const uint64_t *keys, int64_t n, int ai, int dim,
                            bint train, const int32_t *index, const int64_t *offsets,
                            int64_t k, float *out, int64_t *at,
                            const float *zero) noexcept nogil:
        """Add each occurrence's row to its segment of ``out`` (zeroed), the occurrences
        in order, looking the ids up in order as they are first needed (and the ones no
        occurrence names at the end): the store sees exactly ``_lookup``'s sequence, and a
        worker's ids (in first-occurrence order) are added while their row is in cache.
        A later id's admission must not evict an earlier row: the caller ensures it."""
        cdef int64_t s, j, i = 0, want
        cdef int status = OK
        cdef float *acc
        cdef float **rows = self.rbuf
        cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
        cdef Pipe pipe
        pipe.keys, pipe.n, pipe.lines, pipe.links = keys, n, (dim + 15) // 16, train
        for i in range(-PF_SLOT, 0):
            self._stage(&pipe, i)
        i = 0
        for s in range(k):
            acc = out + s * dim
            for j in range(offsets[s], offsets[s + 1]):
                want = index[j]
                while i <= want:
                    self._stage(&pipe, i)
                    rows[i] = self._row_of(&pipe, i, ai, a, train, zero, &status)
                    if rows[i] == NULL:
                        at[0] = i
                        return status
                    i += 1
                sp_add(acc, rows[want], dim)  # acc + row in order, as segments.pool adds
        while i < n:
            self._stage(&pipe, i)
            if self._row_of(&pipe, i, ai, a, train, zero, &status) == NULL:
                at[0] = i
                return status
            i += 1
        return OK

    def update(self, ids, grads):
        """Apply the optimizer to the rows of ``ids``; see ``PyEmbeddingStore.update``."""
        ids = _py.check_ids(ids)
        grads = _py.check_grads(grads, len(ids))
        cdef int64_t n = ids.shape[0], i = 0
        cdef int dim = grads.shape[1]
        if n == 0:
            return
        cdef int ai = self._arena_index(dim, False)
        cdef const uint64_t[::1] keys = ids
        cdef const float[:, ::1] g = grads
        cdef int status = OK
        self._enter()
        try:
            self._scratch(<void**>&self.gbuf, &self.gbuf_bytes, sizeof(float) * n * dim)
            self._scratch(<void**>&self.rbuf, &self.rbuf_bytes, sizeof(float*) * n)
            self.stamp += 1
            if self.stamp == 0:  # wrapped (after 2**32 updates): forget every old stamp
                for i in range(self.eused):
                    self.entries[i].stamp = 0
                self.stamp = 1
            with nogil:
                status = self._update(&keys[0], &g[0, 0], n, dim, ai, &i)
        finally:
            self.busy = False
        if status != OK:
            self._raise(status, i, ids, dim, "update")

    cdef int _update(self, const uint64_t *keys, const float *g, int64_t n, int dim, int ai,
                     int64_t *at) noexcept nogil:
        cdef int64_t i
        cdef int32_t e, u, nu = 0
        cdef uint32_t stamp = self.stamp
        cdef Entry *x
        cdef Arena *a = &self.arenas[ai] if ai >= 0 else NULL
        cdef int64_t dropped = 0
        cdef int lines = (dim + (self.arenas[ai].width if ai >= 0 else 0) + 15) // 16, j
        cdef uint32_t bad = 0
        # Pass 1: resolve ids, sum the gradients of each stored id (in call order, from 0),
        # and check that every gradient is finite (on the same read of grads).
        cdef Pipe p
        p.keys, p.n, p.lines, p.links = keys, n, 0, False
        for i in range(-PF_SLOT, n):
            self._stage(&p, i)
            if i < 0:
                continue
            bad |= sp_nonfinite_bits(g + i * dim, dim)
            e = self._resolve(&p, i)
            if e < 0:
                dropped += 1
                continue
            x = &self.entries[e]
            if x.arena != ai:
                at[0] = i
                return self._first_nonfinite(g, n, dim, at, E_DIM)
            if x.stamp != stamp:
                x.stamp = stamp
                x.pos = nu
                self.rbuf[nu] = row_ptr(a, x.row)
                sp_first(self.gbuf + <int64_t>nu * dim, g + i * dim, dim)
                nu += 1
            else:
                sp_add(self.gbuf + <int64_t>x.pos * dim, g + i * dim, dim)
        if bad:
            return self._first_nonfinite(g, n, dim, at, OK)
        self.n_updates += n
        self.n_dropped += dropped
        self.version += 1
        # Pass 2: one optimizer step per stored id.
        for u in range(nu):
            if u + PF_ROW < nu:
                for j in range(lines):
                    sp_prefetch(self.rbuf[u + PF_ROW] + 16 * j)
            sp_apply(&self.opt, self.rbuf[u], self.rbuf[u] + dim,
                     self.gbuf + <int64_t>u * dim, dim)
        return OK

    cdef int _first_nonfinite(self, const float *g, int64_t n, int dim, int64_t *at,
                              int otherwise) noexcept nogil:
        """E_NONFINITE at the first non-finite row of grads, else ``otherwise`` (errors are
        reported in the order the twin checks them)."""
        cdef int64_t i
        for i in range(n):
            if sp_nonfinite_bits(g + i * dim, dim):
                at[0] = i
                return E_NONFINITE
        return otherwise

    def contains(self, ids):
        """Which ids are stored (bool array); recency is not refreshed."""
        ids = _py.check_ids(ids)
        cdef int64_t n = ids.shape[0], i
        out = np.zeros(n, np.bool_)
        if n == 0:
            return out
        cdef const uint64_t[::1] keys = ids
        cdef unsigned char[::1] o = out.view(np.uint8)
        cdef Pipe p
        p.keys, p.n, p.lines, p.links = &keys[0], n, 0, False
        self._enter()
        try:
            with nogil:
                for i in range(-PF_SLOT, n):
                    self._stage(&p, i)
                    if i >= 0:
                        o[i] = self._resolve(&p, i) >= 0
        finally:
            self.busy = False
        return out

    def clear(self):
        """Drop every row (statistics are kept)."""
        self._enter()
        try:
            self._reset()
            self.version += 1
        finally:
            self.busy = False

    def configure(self, optimizer=None, embedding_config=None):
        """Replace the optimizer and/or config; see ``PyEmbeddingStore.configure``."""
        cdef int ai
        opt = self._opt_obj if optimizer is None else as_optimizer(optimizer)
        cfg = self._cfg if embedding_config is None else _py.check_config(embedding_config)
        self._enter()
        try:
            restate = opt.state_kind != self._opt_obj.state_kind
            self._opt_obj = opt
            self._set_config(cfg)
            for ai in range(self.narenas):
                if restate:
                    self._restate(&self.arenas[ai])
                else:
                    self._set_arena_state(&self.arenas[ai])
            self.version += 1
        finally:
            self.busy = False

    cdef _restate(self, Arena *a):
        """Re-layout an arena for a new state width: keep weights, reset state."""
        cdef int old_stride = a.stride, dim = a.dim
        cdef size_t old_bytes = _block_bytes(a)
        cdef uint32_t b, r, rows = <uint32_t>1 << a.shift
        cdef float *nb
        cdef float *ob
        cdef float *row
        self._set_arena_state(a)
        for b in range(a.nblocks):
            nb = <float*>sp_alloc(_block_bytes(a), b > 0)
            if nb == NULL:
                raise MemoryError()
            ob = a.blocks[b]
            for r in range(rows):
                row = nb + <size_t>r * a.stride
                memcpy(row, ob + <size_t>r * old_stride, sizeof(float) * dim)
                memcpy(row + dim, a.init_state, sizeof(float) * a.width)
            sp_free(ob, old_bytes)
            a.blocks[b] = nb

    def stats(self):
        """Counters: rows, capacity, lookups, misses, admissions, evictions, updates,
        dropped_updates."""
        return {"rows": self.count, "capacity": self.capacity_, "lookups": self.n_lookups,
                "misses": self.n_misses, "admissions": self.n_admissions,
                "evictions": self.n_evictions, "updates": self.n_updates,
                "dropped_updates": self.n_dropped}

    def memory_bytes(self):
        """Bytes allocated for rows, entries, the hash table and block pointers."""
        cdef int ai
        cdef Arena *a
        cdef int64_t total = sizeof(Entry) * <int64_t>self.ecap
        total += sizeof(Slot) * (<int64_t>1 << self.tbits)
        for ai in range(self.narenas):
            a = &self.arenas[ai]
            total += <int64_t>a.nblocks * (sizeof(float) * a.stride << a.shift)
            total += sizeof(float*) * a.blocks_cap + sizeof(Arena)
        return total

    def dump(self, chunk_rows=_py.DUMP_CHUNK_ROWS):
        """Yield rows with optimizer state, least recently used first; see
        ``PyEmbeddingStore.dump`` for the chunk format."""
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
        while e >= 0:
            window = np.empty(chunk_rows, np.int32)
            arena_of = np.empty(chunk_rows, np.int32)
            wv_e, wv_a = window, arena_of
            nw = 0
            while e >= 0 and nw < chunk_rows:
                wv_e[nw] = e
                wv_a[nw] = self.entries[e].arena
                e = self.entries[e].prev
                nw += 1
            window, arena_of = window[:nw], arena_of[:nw]
            _, first = np.unique(arena_of, return_index=True)
            for ai in arena_of[np.sort(first)].tolist():
                members = np.ascontiguousarray(window[arena_of == ai])
                a = &self.arenas[<int>ai]
                m = len(members)
                ids = np.empty(m, np.uint64)
                weights = np.empty((m, a.dim), np.float32)
                state = np.empty((m, a.width), np.float32)
                mv, kv, wv = members, ids, weights
                if a.width:
                    sv = state
                self._enter()
                try:
                    with nogil:
                        for k in range(m):
                            row = row_ptr(a, self.entries[mv[k]].row)
                            kv[k] = self.entries[mv[k]].key
                            memcpy(&wv[k, 0], row, sizeof(float) * a.dim)
                            if a.width:
                                memcpy(&sv[k, 0], row + a.dim, sizeof(float) * a.width)
                finally:
                    self.busy = False
                yield {"dim": a.dim, "ids": ids, "weights": weights, "state": state,
                       "state_kind": self._opt_obj.state_kind}
                if self.version != version:
                    raise Misuse("the embedding store changed while it was being dumped",
                                 hint="pause lookups and updates until dump() is exhausted")

    def __iter__(self):
        return self.dump()

    def load(self, chunks):
        """Insert dumped rows as the most recently used; see ``PyEmbeddingStore.load``."""
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
            n = len(ids)
            if n == 0:
                continue
            ai = self._arena_index(dim, True)
            kv, wv = ids, weights
            for i in range(n):
                e = self._find(kv[i])
                if e >= 0 and self.entries[e].arena != ai:
                    raise _py.dim_error(int(kv[i]), self.arenas[self.entries[e].arena].dim,
                                        dim, "load")
            has_state = state is not None
            if has_state:
                sv = state
            a = &self.arenas[ai]
            self._enter()
            status = OK
            self.version += 1
            try:
                with nogil:
                    for i in range(n):
                        e = self._find(kv[i])
                        if e < 0:
                            e = self._insert(kv[i], ai)
                            if e < 0:
                                status = E_NOMEM
                                break
                        else:
                            self._touch(e)
                        row = row_ptr(a, self.entries[e].row)
                        memcpy(row, &wv[i, 0], sizeof(float) * dim)
                        if a.width:
                            if has_state:
                                memcpy(row + dim, &sv[i, 0], sizeof(float) * a.width)
                            else:
                                memcpy(row + dim, a.init_state, sizeof(float) * a.width)
            finally:
                self.busy = False
            if status != OK:
                raise MemoryError("embedding store: out of memory")
