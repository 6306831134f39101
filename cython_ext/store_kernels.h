/* C kernels of the Cython embedding store: store.pyx declares them in store_defs.pxi
   (`cdef extern from "store_kernels.h"`), and the generated store.c includes this header
   once. Hashes, allocation of large buffers, row initialisation, gradient sums and the
   optimizer step; everything is static. */
#ifndef STREAM_PERSIA_STORE_KERNELS_H
#define STREAM_PERSIA_STORE_KERNELS_H

#include <stdint.h>
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

/* Non-finite tests folded into the step's loops: bit 31 of (bits & exponent) + 2**23 is
   set only where the exponent is all ones (inf or NaN), so OR-ing these words over a row
   and keeping bit 31 tells whether any value is not finite (as sp_nonfinite_bits). */
static inline uint32_t sp_nf(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (b & 0x7f800000u) + 0x00800000u;
}
#if defined(__SSE2__)
static inline __m128i sp_nf4(__m128 x) {
    return _mm_add_epi32(_mm_and_si128(_mm_castps_si128(x), _mm_set1_epi32(0x7f800000)),
                         _mm_set1_epi32(0x00800000));
}
#endif

/* One optimizer step and the clamp (the float32 twin of Optimizer.step in optim.py) of
   weights w and state s with the summed gradient g, in place; the values it replaces are
   kept in kw (d weights) and ks (the state), from the same loads. Nonzero where g as
   given (before weight decay), a new weight (clamped) or a new state value is not
   finite: the caller then puts kw/ks back (update's guard, see _step in
   store_batch.pxi). The tests ride in the loops that compute the values, so that a
   finite step costs one store per value more (to kw/ks, in L1) than it did without
   them. g is scratch (the decay is added to it). */
SP_KERNEL uint32_t sp_step(const SpOpt *o, float *restrict w, float *restrict s,
                           float *restrict g, int d, float *restrict kw,
                           float *restrict ks) {
    int j;
    uint32_t acc = 0, gm = 0xFFFFFFFFu;   /* gm: g's test rides in the step's loop */
#if defined(__SSE2__)
    __m128i vacc = _mm_setzero_si128(), vgm;
#endif
    if (o->wd != 0.0f) {
        /* g is tested before the decay is added: the decayed g is not (as the twin). */
        for (j = 0; j < d; j++) {
            acc |= sp_nf(g[j]);
            g[j] = g[j] + o->wd * w[j];
        }
        gm = 0;
    }
#if defined(__SSE2__)
    vgm = _mm_set1_epi32((int)gm);
#endif
    if (o->kind == 0) {
        if (o->momentum > 0.0f) {
            for (j = 0; j < d; j++) {
                float sj = s[j], wj = w[j];
                ks[j] = sj;
                kw[j] = wj;
                sj = o->momentum * sj + g[j];
                s[j] = sj;
                w[j] = wj - o->lr * sj;
                acc |= (sp_nf(g[j]) & gm) | sp_nf(sj);
            }
        } else {
            for (j = 0; j < d; j++) {
                float wj = w[j];
                kw[j] = wj;
                w[j] = wj - o->lr * g[j];
                acc |= sp_nf(g[j]) & gm;
            }
        }
    } else if (o->kind == 1) {
        if (o->shared) {
            float sq = 0.0f, s0 = s[0], den = sqrtf(s0 + o->eps);
            for (j = 0; j < d; j++) {
                sq = sq + g[j] * g[j];
                acc |= sp_nf(g[j]) & gm;
            }
            for (j = 0; j < d; j++) {
                float wj = w[j];
                kw[j] = wj;
                w[j] = wj - o->lr * g[j] / den;
            }
            ks[0] = s0;
            s[0] = o->g2m * s0 + sq / (float)d;
            acc |= sp_nf(s[0]);
        } else {
            j = 0;
#if defined(__SSE2__)
            /* GCC keeps sqrtf scalar (errno); SSE performs the same IEEE operations. */
            const __m128 lr = _mm_set1_ps(o->lr), eps = _mm_set1_ps(o->eps),
                         g2m = _mm_set1_ps(o->g2m);
            for (; j + 4 <= d; j += 4) {
                __m128 gj = _mm_loadu_ps(g + j), sj = _mm_loadu_ps(s + j),
                       wj = _mm_loadu_ps(w + j);
                __m128 step = _mm_div_ps(_mm_mul_ps(lr, gj), _mm_sqrt_ps(_mm_add_ps(sj, eps)));
                __m128 nsj = _mm_add_ps(_mm_mul_ps(g2m, sj), _mm_mul_ps(gj, gj));
                _mm_storeu_ps(kw + j, wj);
                _mm_storeu_ps(ks + j, sj);
                _mm_storeu_ps(w + j, _mm_sub_ps(wj, step));
                _mm_storeu_ps(s + j, nsj);
                vacc = _mm_or_si128(vacc, _mm_or_si128(sp_nf4(nsj),
                                                       _mm_and_si128(sp_nf4(gj), vgm)));
            }
#endif
            for (; j < d; j++) {
                float sj = s[j], wj = w[j];
                kw[j] = wj;
                ks[j] = sj;
                w[j] = wj - o->lr * g[j] / sqrtf(sj + o->eps);
                sj = o->g2m * sj + g[j] * g[j];
                s[j] = sj;
                acc |= (sp_nf(g[j]) & gm) | sp_nf(sj);
            }
        }
    } else {
        float p1 = s[2 * d], p2 = s[2 * d + 1];
        float *m = s, *v = s + d, *km = ks, *kv = ks + d;
        ks[2 * d] = p1;
        ks[2 * d + 1] = p2;
        p1 = p1 * o->b1;
        p2 = p2 * o->b2;
        s[2 * d] = p1;
        s[2 * d + 1] = p2;
        acc |= sp_nf(p1) | sp_nf(p2);
        p1 = 1.0f - p1;
        p2 = 1.0f - p2;
        j = 0;
#if defined(__SSE2__)
        const __m128 b1 = _mm_set1_ps(o->b1), b2 = _mm_set1_ps(o->b2),
                     c1 = _mm_set1_ps(o->c1), c2 = _mm_set1_ps(o->c2),
                     lr = _mm_set1_ps(o->lr), eps = _mm_set1_ps(o->eps),
                     q1 = _mm_set1_ps(p1), q2 = _mm_set1_ps(p2);
        for (; j + 4 <= d; j += 4) {
            __m128 gj = _mm_loadu_ps(g + j), mo = _mm_loadu_ps(m + j),
                   vo = _mm_loadu_ps(v + j), wj = _mm_loadu_ps(w + j);
            __m128 mj = _mm_add_ps(_mm_mul_ps(b1, mo), _mm_mul_ps(c1, gj));
            __m128 vj = _mm_add_ps(_mm_mul_ps(b2, vo), _mm_mul_ps(c2, _mm_mul_ps(gj, gj)));
            __m128 step = _mm_div_ps(_mm_mul_ps(lr, _mm_div_ps(mj, q1)),
                                     _mm_add_ps(_mm_sqrt_ps(_mm_div_ps(vj, q2)), eps));
            _mm_storeu_ps(km + j, mo);
            _mm_storeu_ps(kv + j, vo);
            _mm_storeu_ps(kw + j, wj);
            _mm_storeu_ps(m + j, mj);
            _mm_storeu_ps(v + j, vj);
            _mm_storeu_ps(w + j, _mm_sub_ps(wj, step));
            vacc = _mm_or_si128(vacc, _mm_or_si128(_mm_or_si128(sp_nf4(mj), sp_nf4(vj)),
                                                   _mm_and_si128(sp_nf4(gj), vgm)));
        }
#endif
        for (; j < d; j++) {
            float mj = m[j], vj = v[j], wj = w[j];
            km[j] = mj;
            kv[j] = vj;
            kw[j] = wj;
            mj = o->b1 * mj + o->c1 * g[j];
            vj = o->b2 * vj + o->c2 * (g[j] * g[j]);
            m[j] = mj;
            v[j] = vj;
            w[j] = wj - o->lr * (mj / p1) / (sqrtf(vj / p2) + o->eps);
            acc |= (sp_nf(g[j]) & gm) | sp_nf(mj) | sp_nf(vj);
        }
    }
    /* The clamp (a NaN stays NaN, and is caught), and the test of the clamped weights. */
    j = 0;
#if defined(__SSE2__)
    {
        /* MINPS/MAXPS return their second operand (x) when either is a NaN; otherwise
           these are the scalar comparisons below, -0.0 included. */
        const __m128 hi = _mm_set1_ps(o->bound), lo = _mm_set1_ps(-o->bound);
        for (; j + 4 <= d; j += 4) {
            __m128 x = _mm_max_ps(lo, _mm_min_ps(hi, _mm_loadu_ps(w + j)));
            _mm_storeu_ps(w + j, x);
            vacc = _mm_or_si128(vacc, sp_nf4(x));
        }
        acc |= _mm_movemask_ps(_mm_castsi128_ps(vacc)) ? 0x80000000u : 0;
    }
#endif
    for (; j < d; j++) {
        float x = w[j];
        x = x > o->bound ? o->bound : (x < -o->bound ? -o->bound : x);
        w[j] = x;
        acc |= sp_nf(x);
    }
    return acc & 0x80000000u;
}

/* Compact rows (issue 20): weights stored as float16 (dt 1) or bfloat16 (dt 2), both
   rounded to nearest even; the twin is stream_persia/server/row_dtypes.py, bit for bit.
   float16: numpy's float->half (subnormals, NaN stays NaN with its top payload bits and
   the quiet bit set); a finite value beyond +-65504 SATURATES to +-65504 (and so does an
   infinity) rather than becoming inf: a stored row stays finite whatever weight_bound is.
   bfloat16: the top 16 bits rounded to nearest even; a value that rounds past the largest
   bfloat16 (+-3.3895e38: float32 values from about +-3.3961e38 up) SATURATES to it, and so
   does an infinity, as float16's; a NaN keeps its top bits with the quiet bit set. */
static inline uint16_t sp_f2h(uint32_t f) {
    uint32_t sgn = (f >> 16) & 0x8000u, e = f & 0x7f800000u, sig;
    if (e == 0x7f800000u && (f & 0x007fffffu))
        return (uint16_t)(sgn | 0x7e00u | ((f & 0x007fffffu) >> 13));
    if (e >= 0x47800000u)
        return (uint16_t)(sgn | 0x7bffu);
    if (e <= 0x38000000u) {
        if (e < 0x33000000u) return (uint16_t)sgn;
        e >>= 23;
        sig = 0x00800000u + (f & 0x007fffffu);
        uint32_t lost = f & 0x000007ffu;
        sig >>= (113 - e);
        if (((sig & 0x00003fffu) != 0x00001000u) || lost) sig += 0x00001000u;
        return (uint16_t)(sgn + (sig >> 13));
    }
    sig = f & 0x007fffffu;
    if ((sig & 0x00003fffu) != 0x00001000u) sig += 0x00001000u;
    uint32_t h = ((e - 0x38000000u) >> 13) + (sig >> 13);
    if (h >= 0x7c00u) h = 0x7bffu;     /* rounded past 65504: saturate */
    return (uint16_t)(sgn | h);
}
static inline float sp_h2f(uint16_t h) {
    uint32_t sgn = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    float f;
    if (e == 0) {
        f = (float)m * (1.0f / 16777216.0f);   /* exact: m * 2**-24 */
        memcpy(&b, &f, 4);
        b |= sgn;
    } else if (e == 31) {
        b = sgn | 0x7f800000u | (m << 13);
    } else {
        b = sgn | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &b, 4);
    return f;
}
static inline uint16_t sp_f2b(uint32_t f) {
    uint32_t r;
    if ((f & 0x7f800000u) == 0x7f800000u && (f & 0x007fffffu))
        return (uint16_t)((f >> 16) | 0x0040u);
    r = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
    if ((r & 0x7f80u) == 0x7f80u)      /* rounded past the largest bfloat16 (or an inf): */
        r = (r & 0x8000u) | 0x7f7fu;   /* saturate to +-3.3895e38 */
    return (uint16_t)r;
}
/* d weights of a row: float32 -> the row's dtype (dt 1 or 2) and back. Vectorised where
   the CPU allows (the results are the scalar routines' bit for bit: tests/server/
   test_store_dtypes.py compares them with the numpy twin over many bit patterns):
   bfloat16 with SSE2 integer operations, float16 with F16C (checked at run time; the
   build targets no particular CPU), clamped to +-65504 first so that it saturates as
   sp_f2h does (MAXPS/MINPS return their second operand, x, when it is a NaN). */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define SP_F16C 1
#include <immintrin.h>
__attribute__((target("f16c")))
static int sp_narrow_f16c(uint16_t *restrict o, const float *restrict src, int d) {
    const __m128 hi = _mm_set1_ps(65504.0f), lo = _mm_set1_ps(-65504.0f);
    int j = 0;
    for (; j + 4 <= d; j += 4) {
        __m128 x = _mm_min_ps(hi, _mm_max_ps(lo, _mm_loadu_ps(src + j)));
        _mm_storel_epi64((__m128i *)(o + j), _mm_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    return j;
}
__attribute__((target("f16c")))
static int sp_widen_f16c(float *restrict dst, const uint16_t *restrict x, int d) {
    int j = 0;
    for (; j + 4 <= d; j += 4)
        _mm_storeu_ps(dst + j, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(x + j))));
    return j;
}
#else
#define SP_F16C 0
#endif
static void sp_narrow(void *restrict dst, const float *restrict src, int d, int dt) {
    uint16_t *o = (uint16_t *)dst;
    uint32_t b;
    int j = 0;
    if (dt == 1) {
#if SP_F16C
        if (__builtin_cpu_supports("f16c")) j = sp_narrow_f16c(o, src, d);
#endif
        for (; j < d; j++) { memcpy(&b, src + j, 4); o[j] = sp_f2h(b); }
    } else {
#if defined(__SSE2__)
        const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff),
                      absm = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000),
                      quiet = _mm_set1_epi32(0x00400000),
                      bmax = _mm_set1_epi32(0x7f7f0000);
        for (; j + 8 <= d; j += 8) {
            __m128i r[2];
            int k;
            for (k = 0; k < 2; k++) {
                __m128i x = _mm_loadu_si128((const __m128i *)(src + j + 4 * k));
                __m128i up = _mm_add_epi32(x, _mm_add_epi32(
                    bias, _mm_and_si128(_mm_srli_epi32(x, 16), one)));
                __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(x, absm), inf);
                /* rounded to the all-ones exponent (not a NaN): saturate, as sp_f2b */
                __m128i ovf = _mm_andnot_si128(nan, _mm_cmpeq_epi32(_mm_and_si128(up, inf), inf));
                up = _mm_or_si128(_mm_andnot_si128(ovf, up), _mm_and_si128(ovf, _mm_or_si128(
                    _mm_andnot_si128(absm, x), bmax)));
                up = _mm_or_si128(_mm_andnot_si128(nan, up),
                                  _mm_and_si128(nan, _mm_or_si128(x, quiet)));
                r[k] = _mm_srai_epi32(up, 16);   /* sign-extended: packs keeps the bits */
            }
            _mm_storeu_si128((__m128i *)(o + j), _mm_packs_epi32(r[0], r[1]));
        }
#endif
        for (; j < d; j++) { memcpy(&b, src + j, 4); o[j] = sp_f2b(b); }
    }
}
static void sp_widen(float *restrict dst, const void *restrict src, int d, int dt) {
    const uint16_t *x = (const uint16_t *)src;
    uint32_t b;
    int j = 0;
    if (dt == 1) {
#if SP_F16C
        if (__builtin_cpu_supports("f16c")) j = sp_widen_f16c(dst, x, d);
#endif
        for (; j < d; j++) dst[j] = sp_h2f(x[j]);
    } else {
#if defined(__SSE2__)
        const __m128i zero = _mm_setzero_si128();
        for (; j + 8 <= d; j += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(x + j));
            _mm_storeu_si128((__m128i *)(dst + j), _mm_unpacklo_epi16(zero, h));
            _mm_storeu_si128((__m128i *)(dst + j + 4), _mm_unpackhi_epi16(zero, h));
        }
#endif
        for (; j < d; j++) { b = (uint32_t)x[j] << 16; memcpy(dst + j, &b, 4); }
    }
}
/* Weights read as float32 (a plain copy for dt 0). */
static inline void sp_read_w(float *restrict dst, const float *restrict row, int d, int dt) {
    if (dt == 0) memcpy(dst, row, sizeof(float) * (size_t)d);
    else sp_widen(dst, row, d, dt);
}
static inline void sp_write_w(float *restrict row, const float *restrict src, int d, int dt) {
    if (dt == 0) memcpy(row, src, sizeof(float) * (size_t)d);
    else sp_narrow(row, src, d, dt);
}
/* Floats of a row taken by d weights of dtype dt. */
static inline int sp_wlen(int d, int dt) { return dt == 0 ? d : (d + 1) / 2; }

#endif  /* STREAM_PERSIA_STORE_KERNELS_H */
