/*
 * One pass over a tensor's elements: moments, and the per-group quantization range.
 *
 * Compiled on first use by deadweight/probes/native_reduce.py with the system C compiler and
 * loaded with ctypes; without a compiler the same numbers come from torch/numpy, slower.
 *
 * Every element is read from memory once. The moments (min, max, sum, sum of squares about a
 * shift, exact zeros) accumulate in LANES independent float lanes, which the compiler turns
 * into SIMD registers without any reassociation of its own, and are added into doubles every
 * FLUSH elements. A flush whose sums are not finite (NaN/Inf in the data, or squares beyond
 * float range) is done again element by element in double, counting the non-finite values.
 *
 * The group kernel also finds, for every quantization group of a symmetric scheme, its two
 * largest magnitudes (the range and the range without its most extreme element) and, from a
 * second pass over the group while it is in L1, how many non-zero elements round to zero.
 * The definitions are those of deadweight/probes/quantization.py, element for element.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Elements summed in float lanes before they are added into doubles: 128 per lane keeps the
 * float rounding of a flush near 1e-7 of its magnitude. */
#define FLUSH 2048
/* Groups whose grids are computed together between their two passes. */
#define GROUP_BATCH 16

typedef struct {
    double sum;     /* finite elements */
    double squares; /* sum of (x - shift)^2 over finite elements */
    double min, max;
    int64_t count; /* finite elements */
    int64_t zeros;
    int64_t nonfinite;
} dw_moments;

typedef struct {
    double worst_ratio;   /* largest block range / bulk range, >= 1 */
    int64_t worst_block;  /* its global block index, the lowest of equals; -1 before any */
    int64_t zero_rounded; /* non-zero elements that quantize to 0 */
} dw_groups;

/* Portable SIMD through the compiler's vector extension (GCC and Clang), as wide as the
 * target's registers: 64 bytes with AVX-512, 32 with AVX, 16 otherwise (SSE2, NEON). Minimum
 * and maximum use the target's instruction where there is one; what they do with NaN does not
 * matter, because a NaN also makes the flush's sum NaN and the flush is redone element by
 * element. Comparisons give lane masks of all ones or zeros. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VBYTES 64
#elif defined(__AVX__)
#include <immintrin.h>
#define VBYTES 32
#elif defined(__SSE2__)
#include <emmintrin.h>
#define VBYTES 16
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define VBYTES 16
#else
#define VBYTES 16
#endif
typedef float vf __attribute__((vector_size(VBYTES)));
typedef int32_t vfm __attribute__((vector_size(VBYTES)));
typedef uint32_t vu32 __attribute__((vector_size(VBYTES)));
typedef uint16_t vu16 __attribute__((vector_size(VBYTES / 2)));
typedef double vd __attribute__((vector_size(VBYTES)));
typedef int64_t vdm __attribute__((vector_size(VBYTES)));
#define VF_LANES (VBYTES / 4)
#define VD_LANES (VBYTES / 8)

static inline vf sel_vf(vfm mask, vf a, vf b) { return (vf)(((vfm)a & mask) | ((vfm)b & ~mask)); }
static inline vd sel_vd(vdm mask, vd a, vd b) { return (vd)(((vdm)a & mask) | ((vdm)b & ~mask)); }
static inline vf abs_vf(vf v) { return (vf)((vfm)v & 0x7fffffff); }
static inline vd abs_vd(vd v) { return (vd)((vdm)v & 0x7fffffffffffffffLL); }

#if defined(__AVX512F__)
static inline vf min_vf(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
static inline vf max_vf(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
static inline vd min_vd(vd a, vd b) { return (vd)_mm512_min_pd((__m512d)a, (__m512d)b); }
static inline vd max_vd(vd a, vd b) { return (vd)_mm512_max_pd((__m512d)a, (__m512d)b); }
#elif defined(__AVX__)
static inline vf min_vf(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
static inline vf max_vf(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
static inline vd min_vd(vd a, vd b) { return (vd)_mm256_min_pd((__m256d)a, (__m256d)b); }
static inline vd max_vd(vd a, vd b) { return (vd)_mm256_max_pd((__m256d)a, (__m256d)b); }
#elif defined(__SSE2__)
static inline vf min_vf(vf a, vf b) { return (vf)_mm_min_ps((__m128)a, (__m128)b); }
static inline vf max_vf(vf a, vf b) { return (vf)_mm_max_ps((__m128)a, (__m128)b); }
static inline vd min_vd(vd a, vd b) { return (vd)_mm_min_pd((__m128d)a, (__m128d)b); }
static inline vd max_vd(vd a, vd b) { return (vd)_mm_max_pd((__m128d)a, (__m128d)b); }
#elif defined(__ARM_NEON) && defined(__aarch64__)
static inline vf min_vf(vf a, vf b) { return (vf)vminq_f32((float32x4_t)a, (float32x4_t)b); }
static inline vf max_vf(vf a, vf b) { return (vf)vmaxq_f32((float32x4_t)a, (float32x4_t)b); }
static inline vd min_vd(vd a, vd b) { return (vd)vminq_f64((float64x2_t)a, (float64x2_t)b); }
static inline vd max_vd(vd a, vd b) { return (vd)vmaxq_f64((float64x2_t)a, (float64x2_t)b); }
#else
static inline vf min_vf(vf a, vf b) { return sel_vf((vfm)(a < b), a, b); }
static inline vf max_vf(vf a, vf b) { return sel_vf((vfm)(a > b), a, b); }
static inline vd min_vd(vd a, vd b) { return sel_vd((vdm)(a < b), a, b); }
static inline vd max_vd(vd a, vd b) { return sel_vd((vdm)(a > b), a, b); }
#endif

/* Horizontal reductions, folding 16-byte pieces together before the last few lanes. */
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef double vd2 __attribute__((vector_size(16)));
typedef int64_t vl2 __attribute__((vector_size(16)));

static inline float hmax_vf(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    const char *p = (const char *)&v;
    vf4 m;
    memcpy(&m, p, 16);
    for (int o = 16; o < VBYTES; o += 16) {
        vf4 x;
        memcpy(&x, p + o, 16);
        vi4 bigger = (vi4)(x > m);
        m = (vf4)(((vi4)x & bigger) | ((vi4)m & ~bigger));
    }
    float r = m[0];
    for (int j = 1; j < 4; j++) r = m[j] > r ? m[j] : r;
    return r;
#endif
}

static inline double hmax_vd(vd v) {
    const char *p = (const char *)&v;
    vd2 m;
    memcpy(&m, p, 16);
    for (int o = 16; o < VBYTES; o += 16) {
        vd2 x;
        memcpy(&x, p + o, 16);
        vl2 bigger = (vl2)(x > m);
        m = (vd2)(((vl2)x & bigger) | ((vl2)m & ~bigger));
    }
    return m[1] > m[0] ? m[1] : m[0];
}
static inline int64_t hsum_vfm(vfm v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_epi32((__m512i)v);
#else
    const char *p = (const char *)&v;
    vi4 t;
    memcpy(&t, p, 16);
    for (int o = 16; o < VBYTES; o += 16) {
        vi4 x;
        memcpy(&x, p + o, 16);
        t += x;
    }
    return (int64_t)t[0] + t[1] + t[2] + t[3];
#endif
}

static inline int64_t hsum_vdm(vdm v) {
    const char *p = (const char *)&v;
    vl2 t;
    memcpy(&t, p, 16);
    for (int o = 16; o < VBYTES; o += 16) {
        vl2 x;
        memcpy(&x, p + o, 16);
        t += x;
    }
    return t[0] + t[1];
}

static inline float f32_from_bits(uint32_t bits) {
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* The largest magnitude t with t * inv rounding to at most 0.5 (so to 0 on the grid): the
 * product is monotone in t, so start from 0.5 / inv and step by one unit in the last place. */
static inline float step_f(float x, int up) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = up ? bits + 1 : bits - 1;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline double step_d(double x, int up) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = up ? bits + 1 : bits - 1;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline float zero_bound_f(float inv) {
    if (!(inv > 0) || isinf(inv)) return 0; /* inv = inf: 0 * inf is NaN, nothing rounds to 0 */
    float t = 0.5f / inv;
    /* t is within an ulp or two of the answer: fixed steps (no unpredictable branches),
     * then a check, with the exact search only if they were not enough */
    t = t * inv > 0.5f ? step_f(t, 0) : t;
    t = t * inv > 0.5f ? step_f(t, 0) : t;
    float up = step_f(t, 1);
    t = up * inv <= 0.5f ? up : t;
    up = step_f(t, 1);
    t = up * inv <= 0.5f ? up : t;
    if (!(t * inv <= 0.5f) || (!isinf(t) && step_f(t, 1) * inv <= 0.5f)) {
        while (t > 0 && t * inv > 0.5f) t = step_f(t, 0);
        while (!isinf(t) && step_f(t, 1) * inv <= 0.5f) t = step_f(t, 1);
    }
    return t;
}
static inline double zero_bound_d(double inv) {
    if (!(inv > 0) || isinf(inv)) return 0;
    double t = 0.5 / inv;
    /* t is within an ulp or two of the answer: fixed steps (no unpredictable branches),
     * then a check, with the exact search only if they were not enough */
    t = t * inv > 0.5 ? step_d(t, 0) : t;
    t = t * inv > 0.5 ? step_d(t, 0) : t;
    double up = step_d(t, 1);
    t = up * inv <= 0.5 ? up : t;
    up = step_d(t, 1);
    t = up * inv <= 0.5 ? up : t;
    if (!(t * inv <= 0.5) || (!isinf(t) && step_d(t, 1) * inv <= 0.5)) {
        while (t > 0 && t * inv > 0.5) t = step_d(t, 0);
        while (!isinf(t) && step_d(t, 1) * inv <= 0.5) t = step_d(t, 1);
    }
    return t;
}

/* Scalar loads (group tails, the slow path). */
static inline float load_f32(const float *x, int64_t i) { return x[i]; }
static inline double load_f64(const double *x, int64_t i) { return x[i]; }
/* bf16 is the top half of a float32: exact. */
static inline float load_bf16(const uint16_t *x, int64_t i) {
    return f32_from_bits((uint32_t)x[i] << 16);
}
/* IEEE half to float, exact for every bit pattern: exponent and mantissa moved into float32
 * position and rescaled by 2^112 (which also normalises subnormals); Inf/NaN (exponent 31)
 * get float32's all-ones exponent. */
static inline float load_f16(const uint16_t *x, int64_t i) {
    uint32_t h = x[i];
    uint32_t magnitude = (h & 0x7fffu) << 13;
    float value = f32_from_bits(magnitude) * 0x1p112f;
    if (magnitude >= 0x0f800000u) value = f32_from_bits(magnitude | 0x7f800000u);
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return f32_from_bits(bits | ((h & 0x8000u) << 16));
}

/* Vector loads of one vector's worth of elements starting at x + i. */
static inline vf vload_f32(const float *x, int64_t i) {
    vf v;
    memcpy(&v, x + i, sizeof v);
    return v;
}
static inline vd vload_f64(const double *x, int64_t i) {
    vd v;
    memcpy(&v, x + i, sizeof v);
    return v;
}
static inline vf vload_bf16(const uint16_t *x, int64_t i) {
    vu16 h;
    memcpy(&h, x + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu32) << 16);
}
static inline vf vload_f16(const uint16_t *x, int64_t i) {
    vu16 h;
    memcpy(&h, x + i, sizeof h);
    vu32 u = __builtin_convertvector(h, vu32);
    vu32 magnitude = (u & 0x7fffu) << 13;
    vf value = (vf)magnitude * 0x1p112f;
    value = sel_vf((vfm)(magnitude >= 0x0f800000u), (vf)(magnitude | 0x7f800000u), value);
    return (vf)((vu32)value | ((u & 0x8000u) << 16));
}

/* Two vectors' worth of elements from x + i, in any order: every use is a reduction. bf16
 * comes as 32-bit words holding two elements each, so one load, one shift and one mask give
 * both vectors. */
static inline void vload2_f32(const float *x, int64_t i, vf *a, vf *b) {
    *a = vload_f32(x, i);
    *b = vload_f32(x, i + VF_LANES);
}
static inline void vload2_f64(const double *x, int64_t i, vd *a, vd *b) {
    *a = vload_f64(x, i);
    *b = vload_f64(x, i + VD_LANES);
}
static inline void vload2_f16(const uint16_t *x, int64_t i, vf *a, vf *b) {
    *a = vload_f16(x, i);
    *b = vload_f16(x, i + VF_LANES);
}
static inline void vload2_bf16(const uint16_t *x, int64_t i, vf *a, vf *b) {
    vu32 words;
    memcpy(&words, x + i, sizeof words);
    *a = (vf)(words << 16);
    *b = (vf)(words & 0xffff0000u);
}

/* Element by element in double: the path for a flush holding NaN/Inf. */
#define DEFINE_SLOW(NAME, SRC, LOAD)                                                        \
    static void slow_##NAME(const SRC *x, int64_t n, double shift, dw_moments *m) {         \
        for (int64_t i = 0; i < n; i++) {                                                   \
            double v = (double)LOAD(x, i);                                                  \
            if (!isfinite(v)) {                                                             \
                m->nonfinite++;                                                             \
                continue;                                                                   \
            }                                                                               \
            double d = v - shift;                                                           \
            m->count++;                                                                     \
            m->sum += v;                                                                    \
            m->squares += d * d;                                                            \
            m->zeros += (v == 0.0);                                                         \
            if (v < m->min) m->min = v;                                                     \
            if (v > m->max) m->max = v;                                                     \
        }                                                                                   \
    }

/* The accumulators of one flush: two sets of vector lanes (two independent dependency
 * chains keep the adders busy), plus scalars for elements that do not fill a vector. */
#define ACC_STATE(VAL, V, VM)                                                               \
    V lo, hi, s, q, lo2, hi2, s2, q2;                                                       \
    VM z, z2;                                                                               \
    VAL slo, shi, ss, sq;                                                                   \
    int64_t sz;

#define ACC_RESET(VAL, V, VM)                                                               \
    do {                                                                                    \
        lo = lo2 = (V){} + (VAL)INFINITY;                                                   \
        hi = hi2 = (V){} - (VAL)INFINITY;                                                   \
        s = q = s2 = q2 = (V){};                                                            \
        z = z2 = (VM){};                                                                    \
        slo = (VAL)INFINITY;                                                                \
        shi = (VAL)-INFINITY;                                                               \
        ss = sq = 0;                                                                        \
        sz = 0;                                                                             \
    } while (0)

#define ACC_ADD(MIN, MAX, VM, v, sh, LO, HI, S, Q, Z)                                       \
    do {                                                                                    \
        LO = MIN((v), LO);                                                                  \
        HI = MAX((v), HI);                                                                  \
        S += (v);                                                                           \
        Q += ((v) - (sh)) * ((v) - (sh));                                                   \
        Z -= (VM)((v) == 0); /* a true lane is -1 */                                        \
    } while (0)

#define ACC_ADD_SCALAR(v, sh)                                                               \
    do {                                                                                    \
        slo = (v) < slo ? (v) : slo;                                                        \
        shi = (v) > shi ? (v) : shi;                                                        \
        ss += (v);                                                                          \
        sq += ((v) - (sh)) * ((v) - (sh));                                                  \
        sz += ((v) == 0);                                                                   \
    } while (0)

/* Adds the accumulators of `n` elements into *m; `ok` becomes 0 when they held NaN/Inf (or
 * squares beyond float range) and the caller must redo those elements with the slow path. */
#define ACC_FLUSH(W, n, ok)                                                                 \
    do {                                                                                    \
        double fs = ss, fq = sq, flo = slo, fhi = shi;                                      \
        int64_t fz = sz;                                                                    \
        for (int j = 0; j < (W); j++) {                                                     \
            fs += (double)s[j] + (double)s2[j];                                             \
            fq += (double)q[j] + (double)q2[j];                                             \
            fz += z[j] + z2[j];                                                             \
            if (lo[j] < flo) flo = lo[j];                                                   \
            if (lo2[j] < flo) flo = lo2[j];                                                 \
            if (hi[j] > fhi) fhi = hi[j];                                                   \
            if (hi2[j] > fhi) fhi = hi2[j];                                                 \
        }                                                                                   \
        ok = isfinite(fs) && isfinite(fq) && isfinite(flo) && isfinite(fhi);                \
        if (ok) {                                                                           \
            m->count += (n);                                                                \
            m->sum += fs;                                                                   \
            m->squares += fq;                                                               \
            m->zeros += fz;                                                                 \
            if (flo < m->min) m->min = flo;                                                 \
            if (fhi > m->max) m->max = fhi;                                                 \
        }                                                                                   \
    } while (0)

/* Moments of n elements. */
#define DEFINE_MOMENTS(NAME, SRC, VAL, V, VM, W, MIN, MAX, VLOAD2, LOAD)                    \
    DEFINE_SLOW(NAME, SRC, LOAD)                                                            \
    void dw_moments_##NAME(const SRC *x, int64_t n, double shift, dw_moments *m) {          \
        const VAL sh = (VAL)shift;                                                          \
        ACC_STATE(VAL, V, VM)                                                               \
        for (int64_t start = 0; start < n; start += FLUSH) {                                \
            const int64_t len = n - start < FLUSH ? n - start : FLUSH;                      \
            const SRC *p = x + start;                                                       \
            ACC_RESET(VAL, V, VM);                                                          \
            int64_t i = 0;                                                                  \
            for (; i + 2 * (W) <= len; i += 2 * (W)) {                                      \
                V v, w;                                                                     \
                VLOAD2(p, i, &v, &w);                                                       \
                ACC_ADD(MIN, MAX, VM, v, sh, lo, hi, s, q, z);                              \
                ACC_ADD(MIN, MAX, VM, w, sh, lo2, hi2, s2, q2, z2);                         \
            }                                                                               \
            for (; i < len; i++) {                                                          \
                const VAL v = LOAD(p, i);                                                   \
                ACC_ADD_SCALAR(v, sh);                                                      \
            }                                                                               \
            int ok;                                                                         \
            ACC_FLUSH(W, len, ok);                                                          \
            if (!ok) slow_##NAME(p, len, (double)sh, m);                                    \
        }                                                                                   \
    }

/*
 * The block that starts one element earlier than an own block p[0 .. len-1] of a tensor cut
 * into groups of `len`: the element before it (`pv`), then p[0 .. len-2]. That is the layout
 * of the tensor quantized as one row with a scalar put in front of it (quantization.py's
 * joint_risk). It reuses the own block's largest magnitude, grid and count of elements near
 * it whenever the grid is the same (all but about 2 blocks in `len`), and adds to gj the
 * change in zero-rounded elements relative to the own block.
 */
#define DEFINE_JOINT(NAME, SRC, VAL, LOAD)                                                  \
    static inline int64_t rounds_##NAME(VAL v, VAL inv) {                                   \
        const VAL scaled = v * inv;                                                         \
        return (v != 0) & (scaled <= (VAL)0.5) & (scaled >= (VAL)-0.5);                     \
    }                                                                                       \
    static void joint_##NAME(const SRC *p, int64_t len, VAL pv, VAL top, int64_t near,      \
                             VAL inv, double qmax, int64_t id, dw_groups *gj) {             \
        const VAL last = LOAD(p, len - 1);                                                  \
        const VAL al = last < 0 ? -last : last, ap = pv < 0 ? -pv : pv;                     \
        VAL top_rest = top; /* largest magnitude of p[0 .. len-2] */                        \
        if (!(al < top)) {                                                                  \
            top_rest = 0;                                                                   \
            for (int64_t k = 0; k + 1 < len; k++) {                                         \
                const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                               \
                top_rest = a > top_rest ? a : top_rest;                                     \
            }                                                                               \
        }                                                                                   \
        const VAL tj = ap > top_rest ? ap : top_rest;                                       \
        int64_t near_j;                                                                     \
        if (tj == top) { /* the same grid: adjust the own block's counts */                 \
            gj->zero_rounded += rounds_##NAME(pv, inv) - rounds_##NAME(last, inv);          \
            near_j = near - (al + al >= top) + (ap + ap >= top);                            \
        } else {                                                                            \
            double scale = (double)tj / qmax;                                               \
            if (!(scale > 0)) scale = 1.0;                                                  \
            const VAL inv_j = (VAL)(1.0 / scale);                                           \
            int64_t own = 0, joint = rounds_##NAME(pv, inv_j);                              \
            near_j = (ap + ap >= tj);                                                       \
            for (int64_t k = 0; k < len; k++) {                                             \
                const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                               \
                own += rounds_##NAME(v, inv);                                               \
                if (k + 1 < len) {                                                          \
                    joint += rounds_##NAME(v, inv_j);                                       \
                    near_j += (a + a >= tj);                                                \
                }                                                                           \
            }                                                                               \
            gj->zero_rounded += joint - own;                                                \
        }                                                                                   \
        VAL bulk = tj;                                                                      \
        if (len > 1 && near_j == 1) {                                                       \
            VAL second = (ap + ap >= tj) ? 0 : ap;                                          \
            for (int64_t k = 0; k + 1 < len; k++) {                                         \
                const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                               \
                if (!(a + a >= tj) && a > second) second = a;                               \
            }                                                                               \
            bulk = second;                                                                  \
        }                                                                                   \
        const double ratio = bulk > 0 ? fmax((double)tj / (double)bulk, 1.0) : 1.0;         \
        if (ratio > gj->worst_ratio || gj->worst_block < 0) {                               \
            gj->worst_ratio = ratio;                                                        \
            gj->worst_block = id;                                                           \
        }                                                                                   \
    }

/*
 * Moments plus symmetric per-group quantization of `rows` whole rows of `cols` elements,
 * cut into groups of `group` along each row (the last one shorter when `group` does not
 * divide `cols`). Only for groups too small for the bulk quantile to exclude anything, where
 * the bulk is the block without its largest magnitude if that more than doubles the range
 * (quantization.py's "tiny" blocks). `first_block` numbers the first group.
 *
 * Pass 1 (from memory) finds the group's largest magnitude `top`. Pass 2 (from L1) counts the
 * non-zero elements that round to 0 on the grid top sets, and decides whether top is dropped
 * from the bulk: top > 2 * second exactly when top is the only element with 2|x| >= top, and
 * then the second largest magnitude is the largest of the others.
 *
 * With `gj`, also the blocks of the tensor quantized behind a scalar (see DEFINE_JOINT); only
 * when `cols == group`. `joint_prev` points at the element before x, or is NULL when x starts
 * the tensor (that block holds the scalar; the caller measures it).
 */
#define DEFINE_GROUPS(NAME, SRC, VAL, V, VM, W, MIN, MAX, ABS, HMAX, HSUM, ZBOUND, VLOAD2, LOAD) \
    void dw_groups_##NAME(const SRC *x, int64_t rows, int64_t cols, int64_t group,          \
                          double qmax, int64_t first_block, double shift, dw_moments *m,    \
                          dw_groups *g, const SRC *joint_prev, dw_groups *gj) {             \
        const VAL sh = (VAL)shift;                                                          \
        const int64_t per_row = (cols + group - 1) / group;                                 \
        const int64_t blocks = rows * per_row;                                              \
        ACC_STATE(VAL, V, VM)                                                               \
        ACC_RESET(VAL, V, VM);                                                              \
        VM rounded = (VM){};                                                                \
        const int64_t zeros_before = m->zeros;                                              \
        int64_t pending = 0; /* elements accumulated since the last flush */                \
        const SRC *flush_start = x;                                                         \
        const SRC *ptr[GROUP_BATCH];                                                        \
        int64_t lens[GROUP_BATCH];                                                          \
        VAL tops[GROUP_BATCH], invs[GROUP_BATCH], bounds[GROUP_BATCH];                      \
        int64_t row = 0, col = 0; /* where the next block starts */                         \
        for (int64_t first = 0; first < blocks; first += GROUP_BATCH) {                     \
            const int nb = blocks - first < GROUP_BATCH ? (int)(blocks - first) : GROUP_BATCH; \
            /* pass 1, from memory: moments, and each group's largest magnitude */          \
            for (int j = 0; j < nb; j++) {                                                  \
                const int64_t len = cols - col < group ? cols - col : group;                \
                const SRC *p = x + row * cols + col;                                        \
                ptr[j] = p;                                                                 \
                lens[j] = len;                                                              \
                col += group;                                                               \
                if (col >= cols) {                                                          \
                    col = 0;                                                                \
                    row++;                                                                  \
                }                                                                           \
                V t1 = (V){}, t2 = (V){};                                                   \
                VAL u1 = 0;                                                                 \
                int64_t i = 0;                                                              \
                for (; i + 2 * (W) <= len; i += 2 * (W)) {                                  \
                    V v, w;                                                                 \
                    VLOAD2(p, i, &v, &w);                                                   \
                    ACC_ADD(MIN, MAX, VM, v, sh, lo, hi, s, q, z);                          \
                    ACC_ADD(MIN, MAX, VM, w, sh, lo2, hi2, s2, q2, z2);                     \
                    t1 = MAX(ABS(v), t1);                                                   \
                    t2 = MAX(ABS(w), t2);                                                   \
                }                                                                           \
                for (; i < len; i++) {                                                      \
                    const VAL v = LOAD(p, i);                                               \
                    ACC_ADD_SCALAR(v, sh);                                                  \
                    const VAL a = v < 0 ? -v : v;                                           \
                    u1 = a > u1 ? a : u1;                                                   \
                }                                                                           \
                const VAL top = HMAX(MAX(t1, t2));                                          \
                tops[j] = u1 > top ? u1 : top;                                              \
                pending += len;                                                             \
                if (pending >= FLUSH) {                                                     \
                    int ok;                                                                 \
                    ACC_FLUSH(W, pending, ok);                                              \
                    if (!ok) slow_##NAME(flush_start, pending, (double)sh, m);              \
                    ACC_RESET(VAL, V, VM);                                                  \
                    flush_start = p + len;                                                  \
                    pending = 0;                                                            \
                }                                                                           \
            }                                                                               \
            /* the batch's grids together: independent divisions overlap */                \
            for (int j = 0; j < nb; j++) {                                                  \
                double scale = (double)tops[j] / qmax;                                      \
                scale = scale > 0 ? scale : 1.0;                                            \
                invs[j] = (VAL)(1.0 / scale);                                               \
            }                                                                               \
            /* |v| <= bound exactly when v * inv rounds to 0; zeros are among them and are  \
             * taken out of the total at the end */                                         \
            for (int j = 0; j < nb; j++) bounds[j] = ZBOUND(invs[j]);                       \
            /* pass 2, from L1: elements rounding to 0, and whether the top is alone */     \
            for (int j = 0; j < nb; j++) {                                                  \
                const SRC *p = ptr[j];                                                      \
                const int64_t len = lens[j];                                                \
                const VAL top = tops[j], bound = bounds[j], half = top * (VAL)0.5;          \
                VM near_top = (VM){};                                                       \
                int64_t k = 0;                                                              \
                if (half + half == top) {                                                   \
                    for (; k + 2 * (W) <= len; k += 2 * (W)) {                              \
                        V v, w;                                                             \
                        VLOAD2(p, k, &v, &w);                                               \
                        const V a = ABS(v), b = ABS(w);                                     \
                        rounded -= (VM)(a <= bound);                                        \
                        rounded -= (VM)(b <= bound);                                        \
                        near_top -= (VM)(a >= half);                                        \
                        near_top -= (VM)(b >= half);                                        \
                    }                                                                       \
                } else { /* top / 2 is not exact (a subnormal top): compare 2|v| */         \
                    for (; k + 2 * (W) <= len; k += 2 * (W)) {                              \
                        V v, w;                                                             \
                        VLOAD2(p, k, &v, &w);                                               \
                        const V a = ABS(v), b = ABS(w);                                     \
                        rounded -= (VM)(a <= bound);                                        \
                        rounded -= (VM)(b <= bound);                                        \
                        near_top -= (VM)(a + a >= top);                                        \
                        near_top -= (VM)(b + b >= top);                                        \
                    }                                                                       \
                }                                                                           \
                int64_t near = 0, below = 0;                                                \
                for (; k < len; k++) {                                                      \
                    const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                           \
                    below += a <= bound;                                                    \
                    near += a + a >= top;                                                   \
                }                                                                           \
                g->zero_rounded += below;                                                   \
                near += HSUM(near_top);                                                     \
                double ratio = 1.0;                                                         \
                if (len > 1 && near == 1) { /* top is alone: the bulk ends at the second */ \
                    VAL second = 0;                                                         \
                    for (int64_t e = 0; e < len; e++) {                                     \
                        const VAL v = LOAD(p, e), a = v < 0 ? -v : v;                       \
                        if (!(a + a >= top) && a > second) second = a;                      \
                    }                                                                       \
                    ratio = second > 0 ? fmax((double)top / (double)second, 1.0) : 1.0;    \
                }                                                                           \
                const int64_t id = first_block + first + j;                                 \
                if (ratio > g->worst_ratio || g->worst_block < 0) {                         \
                    g->worst_ratio = ratio;                                                 \
                    g->worst_block = id;                                                    \
                }                                                                           \
                if (gj != NULL && (p > x || joint_prev != NULL))                            \
                    joint_##NAME(p, len, p > x ? LOAD(p, -1) : LOAD(joint_prev, 0), top, near, \
                                 invs[j], qmax, id, gj);                                    \
            }                                                                               \
        }                                                                                   \
        if (pending) {                                                                      \
            int ok;                                                                         \
            ACC_FLUSH(W, pending, ok);                                                      \
            if (!ok) slow_##NAME(flush_start, pending, (double)sh, m);                      \
        }                                                                                   \
        g->zero_rounded += HSUM(rounded);                                                   \
        /* every zero was counted as rounding to 0: it is not a non-zero element */         \
        g->zero_rounded -= m->zeros - zeros_before;                                         \
    }

DEFINE_MOMENTS(f32, float, float, vf, vfm, VF_LANES, min_vf, max_vf, vload2_f32, load_f32)
DEFINE_MOMENTS(bf16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, vload2_bf16, load_bf16)
DEFINE_MOMENTS(f16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, vload2_f16, load_f16)
DEFINE_MOMENTS(f64, double, double, vd, vdm, VD_LANES, min_vd, max_vd, vload2_f64, load_f64)
DEFINE_JOINT(f32, float, float, load_f32)
DEFINE_JOINT(bf16, uint16_t, float, load_bf16)
DEFINE_JOINT(f16, uint16_t, float, load_f16)
DEFINE_JOINT(f64, double, double, load_f64)
DEFINE_GROUPS(f32, float, float, vf, vfm, VF_LANES, min_vf, max_vf, abs_vf, hmax_vf, hsum_vfm, zero_bound_f,
              vload2_f32, load_f32)
DEFINE_GROUPS(bf16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, abs_vf, hmax_vf, hsum_vfm, zero_bound_f,
              vload2_bf16, load_bf16)
DEFINE_GROUPS(f16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, abs_vf, hmax_vf, hsum_vfm, zero_bound_f,
              vload2_f16, load_f16)
DEFINE_GROUPS(f64, double, double, vd, vdm, VD_LANES, min_vd, max_vd, abs_vd, hmax_vd, hsum_vdm, zero_bound_d,
              vload2_f64, load_f64)

/* Lets the loader check that it talks to the code it compiled. */
int dw_abi_version(void) { return 3; }
