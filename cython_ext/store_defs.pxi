# Included by store.pyx (see the note there): the declarations of the C kernels in
# store_kernels.h, the store's structs and constants, row addressing, and the optimizer's
# parameters as the kernels read them.

cdef extern from "store_kernels.h":
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
    uint32_t sp_step(const SpOpt *o, float *w, float *s, float *g, int d, float *kw,
                     float *ks) nogil
    void sp_read_w(float *dst, const float *row, int d, int dt) nogil
    void sp_write_w(float *row, const float *src, int d, int dt) nogil
    void sp_narrow(void *dst, const float *src, int d, int dt) nogil
    void sp_widen(float *dst, const void *src, int d, int dt) nogil
    int sp_wlen(int d, int dt) nogil
    void sp_prefetch "__builtin_prefetch"(const void *p) nogil
    void sp_prefetch_w "SP_PREFETCH_W"(const void *p) nogil
    uint32_t NONE32 "SP_NONE32"

cdef struct Entry:    # 32 bytes, 64-byte aligned array: one cache line per entry
    uint64_t key
    int32_t prev      # towards the most recently used end (head); -1 at the head
    int32_t next      # towards the least recently used end (tail); free-list link when free
    uint32_t row
    uint16_t arena    # FREE_ARENA while the entry is free
    uint16_t pol      # policy index, and REF: looked up since queued (store_policy.pxi)
    uint32_t ver      # change version of the row's last change, less the store's vbase
    int32_t pos       # position in update()'s list of unique ids (valid while ver says
                      # that this update() has seen the entry: see _update)

cdef struct Evicted:
    uint64_t key
    int64_t version

cdef struct EvictionLog:  # ring of evicted ids, oldest first (versions ascending)
    Evicted *ring
    int64_t cap       # allocated (grows by doubling up to limit)
    int64_t limit     # the constructor's eviction_log
    int64_t head      # index of the oldest entry
    int64_t len
    int64_t dropped   # version of the newest entry overwritten (0: none)

cdef struct Slot:
    uint32_t h        # sp_hash32(key)
    int32_t e         # entry index, -1 when empty

cdef struct Arena:
    int32_t dim
    int32_t width     # optimizer state values per row
    int32_t dtype     # storage of the weights: 0 float32, 1 float16, 2 bfloat16
    int32_t wlen      # floats taken by the weights: dim, or (dim + 1) // 2 if compact
    int32_t stride    # wlen + width (the state follows the weights at row + wlen)
    int32_t shift     # log2(rows per block)
    uint32_t used     # rows handed out (high-water mark)
    uint32_t free_head
    uint32_t nblocks
    uint32_t blocks_cap
    float **blocks
    float *init_state

cdef struct Pol:       # one policy of the table (see store_policy.pxi)
    double admit_p    # < 0: the EmbeddingConfig's
    double ttl_s      # < 0: none
    int64_t ttl_steps # 0: none
    int64_t max_rows  # 0: none
    int32_t min_count
    int32_t dtype     # storage dtype of new rows (Arena.dtype)
    int32_t head, tail  # the policy's queue (kept while the store has aux)
    int64_t rows, admitted, rejected, dropped, expired, evicted_lru, evicted_cap

cdef struct Aux:       # per entry, only while a policy has a TTL or a cap
    int32_t prev, next  # the policy's queue

cdef struct Stamp:     # per entry, only while a policy has a TTL
    float t           # seconds since the store was made, of its last training lookup
    uint32_t step     # the store's training lookup calls then (mod 2**32)

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
    SKETCH_DEPTH = 4
    REF = 0x8000      # Entry.pol: the row was looked up since it was queued
    PMASK = 0x7FFF    # Entry.pol: the policy index (policies.MAX_POLICIES)
    LISTED_COST = 8   # changed_since: a listed entry costs about 8 scanned ones (measured
                      # in load_tests/bench_store.py): the windows of the dirty list are
                      # chunk_rows // 8 entries, and a list over 1/8 of the entries is scanned

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
