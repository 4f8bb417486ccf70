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
 * The group kernel also measures every quantization group of a symmetric scheme: its largest
 * magnitude (the range) in the same pass, then, from a second pass over the group while it is
 * still in L1, how many non-zero elements round to zero on that range's grid and whether the
 * largest stands alone (then the range without it is the second largest). The definitions are
 * those of deadweight/probes/quantization.py, element for element. Groups go in batches: the
 * grids of a batch are computed together in vectors while the previous batch's second pass
 * runs, and counts come from compare masks as scalars, so a group needs no horizontal sum.
 * bf16 rows of one group of 128 have a loop of their own where the CPU has bf16 dot
 * products (fast_groups_bf16), with their grids looked up in a table of every bf16
 * magnitude's grid; there, and for float32 groups of 128 on AVX-512 (lanes_pass2_f32), pass
 * 2 counts in vector lanes added up once a batch, and the blocks behind a scalar are tested
 * 16 groups to a vector.
 */
#define _DEFAULT_SOURCE /* madvise, also under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

/* Elements summed in float lanes before they are added into doubles: 128 per lane keeps the
 * float rounding of a flush near 1e-7 of its magnitude. */
#define FLUSH 2048
/* Groups whose grids are computed together between their two passes. */
#define GROUP_BATCH 16
_Static_assert(GROUP_BATCH <= 32, "a batch's lanes are bits of a uint32_t (joint_batch)");

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

/* Keeps block `id` as the worst so far if its ratio is larger (the lowest of equals: blocks
 * come in order). */
static inline void note_block(dw_groups *g, double ratio, int64_t id) {
    if (ratio > g->worst_ratio || g->worst_block < 0) {
        g->worst_ratio = ratio;
        g->worst_block = id;
    }
}

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
/* Whether bf16 groups of 128 have their loop on the CPU's bf16 dot product (fast_groups_bf16). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && VBYTES == 64
#define FAST_BF16 1
#else
#define FAST_BF16 0
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

/* A vector folded by maximum into its first 16 bytes (the groups kernel stops there: the
 * last lanes of a batch of groups are folded together in tops_*, across the batch). */
static inline vf4 fold_max_vf(vf v) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && VBYTES == 64
    const __m256 h = _mm256_max_ps(_mm512_extractf32x8_ps((__m512)v, 1), _mm512_castps512_ps256((__m512)v));
    return (vf4)_mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
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
    return m;
#endif
}
static inline vd2 fold_max_vd(vd v) {
    const char *p = (const char *)&v;
    vd2 m;
    memcpy(&m, p, 16);
    for (int o = 16; o < VBYTES; o += 16) {
        vd2 x;
        memcpy(&x, p + o, 16);
        vl2 bigger = (vl2)(x > m);
        m = (vd2)(((vl2)x & bigger) | ((vl2)m & ~bigger));
    }
    return m;
}

static inline float hmax_vf(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    const vf4 m = fold_max_vf(v);
    float r = m[0];
    for (int j = 1; j < 4; j++) r = m[j] > r ? m[j] : r;
    return r;
#endif
}

static inline double hmax_vd(vd v) {
    const vd2 m = fold_max_vd(v);
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

typedef uint16_t vw __attribute__((vector_size(VBYTES)));
typedef int16_t vwm __attribute__((vector_size(VBYTES)));

/* How many lanes of a comparison hold, as a scalar, so that a group's count needs no
 * horizontal sum of a vector: AVX-512 compares into a mask register and counts its bits, AVX
 * and SSE2 take the lanes' sign bits with movemask, other targets sum the lanes. */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define COUNT_CMP_PS(a, b, op) __builtin_popcount(_mm512_cmp_ps_mask((__m512)(a), (__m512)(b), op))
#define COUNT_CMP_PD(a, b, op) __builtin_popcount(_mm512_cmp_pd_mask((__m512d)(a), (__m512d)(b), op))
static inline int64_t count_le_vf(vf a, vf b) { return COUNT_CMP_PS(a, b, _CMP_LE_OQ); }
static inline int64_t count_ge_vf(vf a, vf b) { return COUNT_CMP_PS(a, b, _CMP_GE_OQ); }
static inline int64_t count_eq_vf(vf a, vf b) { return COUNT_CMP_PS(a, b, _CMP_EQ_OQ); }
static inline int64_t count_le_vd(vd a, vd b) { return COUNT_CMP_PD(a, b, _CMP_LE_OQ); }
static inline int64_t count_ge_vd(vd a, vd b) { return COUNT_CMP_PD(a, b, _CMP_GE_OQ); }
static inline int64_t count_eq_vd(vd a, vd b) { return COUNT_CMP_PD(a, b, _CMP_EQ_OQ); }
static inline int64_t count_le_vw(vw a, vw b) {
    return __builtin_popcount(_mm512_cmple_epu16_mask((__m512i)a, (__m512i)b));
}
static inline int64_t count_ge_vw(vw a, vw b) {
    return __builtin_popcount(_mm512_cmpge_epu16_mask((__m512i)a, (__m512i)b));
}
static inline int64_t count_mask_vf(vfm m) { return __builtin_popcount(_mm512_movepi32_mask((__m512i)m)); }
static inline int64_t count_mask_vd(vdm m) { return __builtin_popcount(_mm512_movepi64_mask((__m512i)m)); }
/* zeros are counted as scalars too, not in vector lanes (see ACC_ADD) */
#define SCALAR_ZEROS 1
#else
#if defined(__AVX__) && VBYTES == 32
static inline int64_t count_vfm(vfm m) { return __builtin_popcount(_mm256_movemask_ps((__m256)m)); }
static inline int64_t count_vdm(vdm m) { return __builtin_popcount(_mm256_movemask_pd((__m256d)m)); }
#else
#if defined(__SSE2__) && VBYTES == 16
static inline int64_t count_vfm(vfm m) { return __builtin_popcount(_mm_movemask_ps((__m128)m)); }
static inline int64_t count_vdm(vdm m) { return __builtin_popcount(_mm_movemask_pd((__m128d)m)); }
#else
static inline int64_t count_vfm(vfm m) { return -hsum_vfm(m); } /* true lanes are -1 */
static inline int64_t count_vdm(vdm m) { return -hsum_vdm(m); }
#endif
#endif
#if defined(__AVX2__) && VBYTES == 32
/* a 16-bit lane gives two bits of the byte mask */
static inline int64_t count_vwm(vwm m) { return __builtin_popcount(_mm256_movemask_epi8((__m256i)m)) / 2; }
#elif defined(__SSE2__) && VBYTES == 16
static inline int64_t count_vwm(vwm m) { return __builtin_popcount(_mm_movemask_epi8((__m128i)m)) / 2; }
#else
static inline int64_t count_vwm(vwm m) { /* true lanes are 0xffff */
    return hsum_vfm((vfm)(((vu32)m & 0xffffu) + ((vu32)m >> 16))) / 0xffff;
}
#endif
static inline int64_t count_mask_vf(vfm m) { return count_vfm(m); }
static inline int64_t count_mask_vd(vdm m) { return count_vdm(m); }
static inline int64_t count_le_vf(vf a, vf b) { return count_vfm((vfm)(a <= b)); }
static inline int64_t count_ge_vf(vf a, vf b) { return count_vfm((vfm)(a >= b)); }
static inline int64_t count_le_vd(vd a, vd b) { return count_vdm((vdm)(a <= b)); }
static inline int64_t count_ge_vd(vd a, vd b) { return count_vdm((vdm)(a >= b)); }
static inline int64_t count_le_vw(vw a, vw b) { return count_vwm((vwm)(a <= b)); }
static inline int64_t count_ge_vw(vw a, vw b) { return count_vwm((vwm)(a >= b)); }
#endif

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


/* A batch's grids at once, in vectors of GROUP_BATCH lanes (the compiler splits them into
 * the target's registers): the scale top / qmax in double and its float inverse, as
 * quantization.py computes them, and the zero bound by the same fixed steps as
 * zero_bound_f. Lanes whose steps were not enough (none, in practice) get the exact search. */
typedef float vbf __attribute__((vector_size(4 * GROUP_BATCH)));
typedef uint32_t vbu __attribute__((vector_size(4 * GROUP_BATCH)));
typedef int32_t vbm __attribute__((vector_size(4 * GROUP_BATCH)));
typedef double vbd __attribute__((vector_size(8 * GROUP_BATCH)));
typedef uint64_t vbul __attribute__((vector_size(8 * GROUP_BATCH)));
typedef int64_t vbdm __attribute__((vector_size(8 * GROUP_BATCH)));

/* The batch's largest magnitudes: the largest of each group's lanes (what is left of its
 * vector maximum, fold_max_vf, one 16-byte row per group) and its tail, and at least 0. */
static void tops_f(float part[GROUP_BATCH][4], const float *tails, float *tops) {
    for (int j = 0; j < GROUP_BATCH; j++) {
        float t = tails[j] > 0 ? tails[j] : 0;
        for (int l = 0; l < 4; l++) t = part[j][l] > t ? part[j][l] : t;
        tops[j] = t;
    }
}
static void tops_d(double part[GROUP_BATCH][4], const double *tails, double *tops) {
    for (int j = 0; j < GROUP_BATCH; j++) {
        double t = tails[j] > 0 ? tails[j] : 0;
        for (int l = 0; l < 2; l++) t = part[j][l] > t ? part[j][l] : t;
        tops[j] = t;
    }
}

/* Whether every lane of a batch mask is set: then no lane needs the slow exact search. */
static inline int every_lane(vbm m) {
    int all = 1;
    for (int j = 0; j < GROUP_BATCH; j++) all &= m[j] != 0;
    return all;
}

static void grids_f(const float *tops, double qmax, float *invs, float *bounds, int nb) {
    vbf top;
    memcpy(&top, tops, sizeof top);
    vbd scale = __builtin_convertvector(top, vbd) / qmax;
    const vbdm positive = (vbdm)(scale > 0);
    scale = (vbd)(((vbdm)scale & positive) | ((vbdm)((vbd){} + 1.0) & ~positive));
    const vbf inv = __builtin_convertvector(1.0 / scale, vbf);
    vbu t = (vbu)__builtin_convertvector(scale * 0.5, vbf); /* 0.5 / inv, within an ulp */
    t += (vbu)((vbf)t * inv > 0.5f); /* a true lane is all ones: one step down */
    t += (vbu)((vbf)t * inv > 0.5f);
    t -= (vbu)((vbf)(t + 1) * inv <= 0.5f);
    t -= (vbu)((vbf)(t + 1) * inv <= 0.5f);
    const vbm exact = (vbm)((vbf)t * inv <= 0.5f) &
                      (((vbm)((t & 0x7fffffffu) == 0x7f800000u)) | ~(vbm)((vbf)(t + 1) * inv <= 0.5f)) &
                      (vbm)(inv > 0) & (vbm)(inv < INFINITY);
    memcpy(invs, &inv, sizeof inv);
    const vbu b = t & (vbu)exact;
    memcpy(bounds, &b, sizeof b);
    if (!every_lane(exact))
        for (int j = 0; j < nb; j++)
            if (!exact[j]) bounds[j] = zero_bound_f(inv[j]);
}

static void grids_d(const double *tops, double qmax, double *invs, double *bounds, int nb) {
    vbd top;
    memcpy(&top, tops, sizeof top);
    vbd scale = top / qmax;
    const vbdm positive = (vbdm)(scale > 0);
    scale = (vbd)(((vbdm)scale & positive) | ((vbdm)((vbd){} + 1.0) & ~positive));
    const vbd inv = 1.0 / scale;
    vbul t = (vbul)(0.5 / inv);
    t += (vbul)((vbd)t * inv > 0.5);
    t += (vbul)((vbd)t * inv > 0.5);
    t -= (vbul)((vbd)(t + 1) * inv <= 0.5);
    t -= (vbul)((vbd)(t + 1) * inv <= 0.5);
    const vbdm exact =
        (vbdm)((vbd)t * inv <= 0.5) &
        (((vbdm)((t & 0x7fffffffffffffffULL) == 0x7ff0000000000000ULL)) | ~(vbdm)((vbd)(t + 1) * inv <= 0.5)) &
        (vbdm)(inv > 0) & (vbdm)(inv < INFINITY);
    memcpy(invs, &inv, sizeof inv);
    for (int j = 0; j < nb; j++) {
        double b;
        memcpy(&b, (const char *)&t + 8 * j, sizeof b);
        bounds[j] = exact[j] ? b : zero_bound_d(inv[j]);
    }
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

#ifdef SCALAR_ZEROS
#define ZERO_ADD(VM, v, Z) (sz += _Generic((v), vf: count_eq_vf, vd: count_eq_vd)((v), (__typeof__(v)){}))
#else
#define ZERO_ADD(VM, v, Z) (Z -= (VM)((v) == 0)) /* a true lane is -1 */
#endif

#define ACC_ADD(MIN, MAX, VM, v, sh, LO, HI, S, Q, Z)                                       \
    do {                                                                                    \
        LO = MIN((v), LO);                                                                  \
        HI = MAX((v), HI);                                                                  \
        S += (v);                                                                           \
        Q += ((v) - (sh)) * ((v) - (sh));                                                   \
        ZERO_ADD(VM, v, Z);                                                                 \
    } while (0)

#define ACC_ADD_SCALAR(v, sh)                                                               \
    do {                                                                                    \
        slo = (v) < slo ? (v) : slo;                                                        \
        shi = (v) > shi ? (v) : shi;                                                        \
        ss += (v);                                                                          \
        sq += ((v) - (sh)) * ((v) - (sh));                                                  \
        sz += ((v) == 0);                                                                   \
    } while (0)

/* The lanes of a flush's accumulators, taken by value so that the accumulators themselves
 * are never indexed by lane (which would keep them in memory instead of registers), and
 * reduced as vectors: a flush's sums are not one long chain of scalar additions. */
typedef float vfh __attribute__((vector_size(VBYTES / 2)));
static inline double hsum_vd(vd v) {
    const char *p = (const char *)&v;
    vd2 t;
    memcpy(&t, p, 16);
    for (int o = 16; o < VBYTES; o += 16) {
        vd2 x;
        memcpy(&x, p + o, 16);
        t += x;
    }
    return t[0] + t[1];
}
#if defined(__AVX512F__) && defined(__AVX512DQ__) && VBYTES == 64
/* with intrinsics: halves taken through memory would keep the accumulators in memory */
static inline vd widen_low(vf v) { return (vd)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v)); }
static inline vd widen_high(vf v) { return (vd)_mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)v, 1)); }
#else
static inline vd widen_low(vf v) {
    vfh h;
    memcpy(&h, &v, sizeof h);
    return __builtin_convertvector(h, vd);
}
static inline vd widen_high(vf v) {
    vfh h;
    memcpy(&h, (const char *)&v + sizeof h, sizeof h);
    return __builtin_convertvector(h, vd);
}
#endif
static inline double lanes_sum_vf(double t, vf a, vf b) {
    return t + hsum_vd((widen_low(a) + widen_high(a)) + (widen_low(b) + widen_high(b)));
}
static inline double lanes_sum_vd(double t, vd a, vd b) { return t + hsum_vd(a + b); }
static inline double lanes_min_vf(double t, vf a, vf b) {
    const double m = -hmax_vf(-min_vf(a, b));
    return m < t ? m : t;
}
static inline double lanes_max_vf(double t, vf a, vf b) {
    const double m = hmax_vf(max_vf(a, b));
    return m > t ? m : t;
}
static inline double lanes_min_vd(double t, vd a, vd b) {
    const double m = -hmax_vd(-min_vd(a, b));
    return m < t ? m : t;
}
static inline double lanes_max_vd(double t, vd a, vd b) {
    const double m = hmax_vd(max_vd(a, b));
    return m > t ? m : t;
}
static inline int64_t lanes_count_vfm(vfm a, vfm b) { return hsum_vfm(a) + hsum_vfm(b); }
static inline int64_t lanes_count_vdm(vdm a, vdm b) { return hsum_vdm(a) + hsum_vdm(b); }
#define LANES(OP, t, a, b) _Generic((a), vf: lanes_##OP##_vf, vd: lanes_##OP##_vd)(t, a, b)
#define LANES_COUNT(a, b) _Generic((a), vfm: lanes_count_vfm, vdm: lanes_count_vdm)(a, b)

/* Adds a flush of `n` elements (their sum, squares, extremes and zeros) into *m; returns 0,
 * adding nothing, when they held NaN/Inf (or squares beyond float range): the caller must
 * redo those elements with the slow path. */
static inline int add_flush(dw_moments *m, int64_t n, double fs, double fq, double flo, double fhi,
                            int64_t fz) {
    if (!(isfinite(fs) && isfinite(fq) && isfinite(flo) && isfinite(fhi))) return 0;
    m->count += n;
    m->sum += fs;
    m->squares += fq;
    m->zeros += fz;
    if (flo < m->min) m->min = flo;
    if (fhi > m->max) m->max = fhi;
    return 1;
}
/* add_flush of the accumulators of `n` elements into *m, `ok` its answer. */
#define ACC_FLUSH(W, n, ok)                                                                 \
    do {                                                                                    \
        double fs = LANES(sum, ss, s, s2), fq = LANES(sum, sq, q, q2);                      \
        double flo = LANES(min, slo, lo, lo2), fhi = LANES(max, shi, hi, hi2);              \
        ok = add_flush(m, (n), fs, fq, flo, fhi, sz + LANES_COUNT(z, z2));                  \
    } while (0)

/*
 * bf16 groups of 128 with the CPU's bf16 dot product (AVX512-BF16). VDPBF16PS multiplies
 * pairs of bf16 exactly into float and adds them: x * 1 gives the sum, x * x the squares
 * about 0, which each flush moves to the shift in double (sum((x - c)^2) = sum(x^2) -
 * 2c sum(x) + n c^2). That loses nothing the float lanes keep: a product of two bf16 has
 * 16 significant bits, so a lane's 128 products of one binade add up exactly in float, and
 * the cancellation happens in double. It reads subnormal inputs as 0 (a change below 1e-38
 * per element in the sums). Minimum, maximum, each group's largest magnitude and the zeros
 * are integer operations on the 16-bit words, 32 per instruction: the words of values that
 * are not negative order like signed integers, the others like unsigned ones (larger is
 * more negative), and a magnitude (sign cleared) orders like its value. Zeros are counted
 * only in a group whose smallest magnitude is 0. A group's 32 lanes of largest magnitudes
 * are kept: the batch's tops are folded from them together (fast_tops), and pass 2 counts
 * the lanes near the top before it counts elements (fast_pass2). A flush whose sums are not
 * finite held NaN/Inf (any of them makes the sum NaN or infinite) and is redone by the slow
 * path, as in the float lanes.
 */
#if FAST_BF16
typedef struct {
    __m512 s0, s1, q0, q1; /* the flush's sums and squares */
    __m512i smax, umax; /* the flush's words: signed and unsigned maximum */
    __m512i mmin;       /* and their smallest magnitude */
    int64_t zeros;
    int groups; /* groups in the flush */
} fast_acc;
static inline void fast_init(fast_acc *a) {
    a->s0 = a->s1 = a->q0 = a->q1 = _mm512_setzero_ps();
    a->smax = _mm512_set1_epi16(INT16_MIN);
    a->umax = _mm512_setzero_si512();
    a->mmin = _mm512_set1_epi16(0x7fff);
    a->zeros = 0;
    a->groups = 0;
}
typedef __m512i fast_lanes;
/* Adds the group of 128 at p, and keeps its 32 lanes' largest magnitudes (each of 4
 * elements) in *lanes for pass 2. */
static inline void fast_bf16(const uint16_t *p, fast_acc *a, fast_lanes *lanes) {
    const __m512i mag = _mm512_set1_epi16(0x7fff);
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
    const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 32);
    const __m512i w2 = _mm512_loadu_si512(p + 64), w3 = _mm512_loadu_si512(p + 96);
    a->s0 = _mm512_dpbf16_ps(a->s0, (__m512bh)w0, one);
    a->q0 = _mm512_dpbf16_ps(a->q0, (__m512bh)w0, (__m512bh)w0);
    a->s1 = _mm512_dpbf16_ps(a->s1, (__m512bh)w1, one);
    a->q1 = _mm512_dpbf16_ps(a->q1, (__m512bh)w1, (__m512bh)w1);
    a->s0 = _mm512_dpbf16_ps(a->s0, (__m512bh)w2, one);
    a->q0 = _mm512_dpbf16_ps(a->q0, (__m512bh)w2, (__m512bh)w2);
    a->s1 = _mm512_dpbf16_ps(a->s1, (__m512bh)w3, one);
    a->q1 = _mm512_dpbf16_ps(a->q1, (__m512bh)w3, (__m512bh)w3);
    const __m512i s01 = _mm512_max_epi16(w0, w1), s23 = _mm512_max_epi16(w2, w3);
    a->smax = _mm512_max_epi16(a->smax, _mm512_max_epi16(s01, s23));
    const __m512i u01 = _mm512_max_epu16(w0, w1), u23 = _mm512_max_epu16(w2, w3);
    a->umax = _mm512_max_epu16(a->umax, _mm512_max_epu16(u01, u23));
    const __m512i m0 = _mm512_and_si512(w0, mag), m1 = _mm512_and_si512(w1, mag);
    const __m512i m2 = _mm512_and_si512(w2, mag), m3 = _mm512_and_si512(w3, mag);
    /* zeros are counted only in a group that has one (its smallest magnitude is 0) */
    const __m512i low = _mm512_min_epu16(_mm512_min_epu16(m0, m1), _mm512_min_epu16(m2, m3));
    a->mmin = _mm512_min_epu16(a->mmin, low);
    if (__builtin_expect(_mm512_testn_epi16_mask(low, low) != 0, 0)) {
        const uint64_t z01 = (uint64_t)_mm512_testn_epi16_mask(m0, m0) |
                             (uint64_t)_mm512_testn_epi16_mask(m1, m1) << 32;
        const uint64_t z23 = (uint64_t)_mm512_testn_epi16_mask(m2, m2) |
                             (uint64_t)_mm512_testn_epi16_mask(m3, m3) << 32;
        a->zeros += __builtin_popcountll(z01) + __builtin_popcountll(z23);
    }
    /* the group's largest magnitudes, 4 elements to a lane: folded with the batch's other
     * groups (fast_tops), and kept for pass 2 */
    *lanes = _mm512_max_epu16(_mm512_max_epu16(m0, m1), _mm512_max_epu16(m2, m3));
    a->groups++;
}
/* Pass 2 of a fast group: adds its elements with |v| <= the lower word to *counts (16-bit
 * lanes, 64 a batch at most: fast_count adds them up) and returns how many have 2|v| >= top
 * (the upper word), or a lower bound on it: the number of lanes holding such an element.
 * From 3 up that is all the callers need (the top is not alone, nor in the block one
 * element earlier); below 3, the elements are counted. */
static inline int64_t fast_pass2(const uint16_t *p, const fast_lanes *lanes, uint32_t words,
                                 fast_lanes *counts) {
    const __m512i mag = _mm512_set1_epi16(0x7fff), one = _mm512_set1_epi16(1);
    const __m512i lo = _mm512_set1_epi16((short)(words & 0xffff));
    const __m512i hi = _mm512_set1_epi16((short)(words >> 16));
    __m512i c = *counts;
    for (int i = 0; i < 128; i += 32) {
        const __m512i u = _mm512_and_si512(_mm512_loadu_si512(p + i), mag);
        c = _mm512_mask_add_epi16(c, _mm512_cmple_epu16_mask(u, lo), c, one);
    }
    *counts = c;
    const int lanes_near = __builtin_popcount(_mm512_cmpge_epu16_mask(*lanes, hi));
    if (__builtin_expect(lanes_near >= 3, 1)) return lanes_near;
    int64_t near = 0;
    for (int i = 0; i < 128; i += 32) {
        const __m512i u = _mm512_and_si512(_mm512_loadu_si512(p + i), mag);
        near += __builtin_popcount(_mm512_cmpge_epu16_mask(u, hi));
    }
    return near;
}
static inline int64_t fast_count(fast_lanes *counts) {
    const __m512i pairs = _mm512_madd_epi16(*counts, _mm512_set1_epi16(1));
    *counts = _mm512_setzero_si512();
    return _mm512_reduce_add_epi32(pairs);
}
/* The largest magnitudes of a batch's groups from their lanes, as floats: the 16 vectors are
 * folded together, two into one at each step, so a group costs about 3 instructions rather
 * than a fold of its own. After the steps, dword 4k + s holds group 4s + k. */
_Static_assert(GROUP_BATCH == 16, "fast_tops folds 16 groups");
static inline void fast_tops(const fast_lanes *lanes, float *tops) {
    __m512i c[8], d[4], e[2];
    for (int i = 0; i < 8; i++) { /* group 2i in 128-bit lanes 0-1, 2i + 1 in 2-3 */
        const __m512i a = lanes[2 * i], b = lanes[2 * i + 1];
        c[i] = _mm512_max_epu16(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xee));
    }
    for (int i = 0; i < 4; i++) /* group 4i + k in 128-bit lane k */
        d[i] = _mm512_max_epu16(_mm512_shuffle_i64x2(c[2 * i], c[2 * i + 1], 0x88),
                                _mm512_shuffle_i64x2(c[2 * i], c[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* lane k: group 8i + k, then 8i + 4 + k, 4 words each */
        e[i] = _mm512_max_epu16(_mm512_unpacklo_epi64(d[2 * i], d[2 * i + 1]),
                                _mm512_unpackhi_epi64(d[2 * i], d[2 * i + 1]));
    /* lane k, dword s: group 4s + k, 2 words */
    const __m512 e0 = _mm512_castsi512_ps(e[0]), e1 = _mm512_castsi512_ps(e[1]);
    __m512i f = _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(e0, e1, 0x88)),
                                 _mm512_castps_si512(_mm512_shuffle_ps(e0, e1, 0xdd)));
    f = _mm512_max_epu16(f, _mm512_srli_epi32(f, 16)); /* the low word of each dword */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    f = _mm512_slli_epi32(_mm512_permutexvar_epi32(order, f), 16);
    _mm512_storeu_si512(tops, f);
}
static inline uint16_t hmin_epu16(__m512i v) {
    const __m256i h = _mm256_min_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    const __m128i q = _mm_min_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return (uint16_t)_mm_cvtsi128_si32(_mm_minpos_epu16(q));
}
/* The largest word is the complement of the smallest complement. */
static inline uint16_t hmax_epu16(__m512i v) {
    return (uint16_t)~hmin_epu16(_mm512_xor_si512(v, _mm512_set1_epi32(-1)));
}
/* The flush's smallest and largest values from its words' extremes (see above). Without a
 * value of one sign, the other extreme is the value of the smallest magnitude. */
static inline void fast_range(__m512i smax, __m512i umax, __m512i mmin, double *lo, double *hi) {
    const uint16_t s = (uint16_t)(hmax_epu16(_mm512_xor_si512(smax, _mm512_set1_epi16(INT16_MIN))) ^ 0x8000);
    const uint16_t u = hmax_epu16(umax), n = hmin_epu16(mmin);
    /* none positive: the negative nearest 0 */
    *hi = load_bf16(&(uint16_t){(int16_t)s >= 0 ? s : (uint16_t)(n | 0x8000)}, 0);
    *lo = load_bf16(&(uint16_t){u >= 0x8000 ? u : n}, 0); /* none negative: the smallest */
}
/* Adds the flush's fast groups into its totals. */
static inline void fast_flush(fast_acc *a, double sh, double *fs, double *fq, double *flo, double *fhi,
                              int64_t *fz) {
    if (!a->groups) return;
    const double s = lanes_sum_vf(0.0, (vf)a->s0, (vf)a->s1), q = lanes_sum_vf(0.0, (vf)a->q0, (vf)a->q1);
    *fs += s;
    *fq += q - 2.0 * sh * s + (double)a->groups * 128.0 * sh * sh; /* about the shift */
    *fz += a->zeros;
    double lo, hi;
    fast_range(a->smax, a->umax, a->mmin, &lo, &hi);
    *flo = lo < *flo ? lo : *flo;
    *fhi = hi > *fhi ? hi : *fhi;
    fast_init(a);
}
#endif

/* Asks for the lines of [p, p + bytes) ahead of their use by the group kernels: 4 KB ahead
 * into L1, and 32 KB ahead into L2, which is where a stream from memory gains: the hardware
 * prefetchers alone do not keep two threads of those kernels fed. Measured here on a freshly
 * written 2.15 GB file, two threads over 8 MB pieces (median of 5-7): bf16 groups 21.0 GB/s
 * with the 8 KB prefetch into L1 that came before, 25.9-30.3 with this; float32 groups 15.1
 * -> 23.2 and 17.8 -> 30.1; one thread 11.5 -> 17.8 (bf16) and 10.6 -> 18.6 (float32). The
 * moments kernel, with a few instructions an element, is faster without it (float32 35.4
 * -> 21.0 GB/s with it). */
static inline void prefetch_ahead(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch((const char *)p + b + 4096);
        __builtin_prefetch((const char *)p + b + 32768, 0, 1);
    }
}

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
 * change in zero-rounded elements relative to the own block. When the grid changes (the
 * block's top was its last element, or the element before is larger), the block is counted
 * again in vectors over all its elements, and the last element's share taken out after.
 */
#define DEFINE_JOINT(NAME, SRC, VAL, V, VM, W, VLOAD2, ABS, MAXV, HMAX, COUNT_MASK, LOAD)   \
    static inline int64_t rounds_##NAME(VAL v, VAL inv) {                                   \
        const VAL scaled = v * inv;                                                         \
        return (v != 0) & (scaled <= (VAL)0.5) & (scaled >= (VAL)-0.5);                     \
    }                                                                                       \
    /* Over the whole block: the largest magnitude below `top`, and how many reach it (a    \
     * block whose last element is its top keeps top without it when top recurs). */       \
    static VAL below_top_##NAME(const SRC *p, int64_t len, VAL top, int64_t *at_top) {      \
        const V vt = (V){} + top;                                                           \
        V m = (V){}, m2 = (V){};                                                            \
        int64_t c = 0, k = 0;                                                               \
        for (; k + 2 * (W) <= len; k += 2 * (W)) {                                          \
            V v, w;                                                                         \
            VLOAD2(p, k, &v, &w);                                                           \
            const V a = ABS(v), b = ABS(w);                                                 \
            m = MAXV(m, (V)((VM)a & (VM)(a < vt)));                                         \
            m2 = MAXV(m2, (V)((VM)b & (VM)(b < vt)));                                       \
            c += COUNT_MASK((VM)(a >= vt)) + COUNT_MASK((VM)(b >= vt));                     \
        }                                                                                   \
        VAL r = HMAX(MAXV(m, m2));                                                          \
        for (; k < len; k++) {                                                              \
            const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                                   \
            if (a < top && a > r) r = a;                                                    \
            c += a >= top;                                                                  \
        }                                                                                   \
        *at_top = c;                                                                        \
        return r;                                                                           \
    }                                                                                       \
    /* Over the whole block: the elements rounding to 0 on the grids `inv` and `inv_j`      \
     * (zeros left out), and those with 2|v| >= tj. */                                      \
    static void regrid_##NAME(const SRC *p, int64_t len, VAL inv, VAL inv_j, VAL tj,        \
                              int64_t *own, int64_t *joint, int64_t *near) {                \
        const V vi = (V){} + inv, vj = (V){} + inv_j, vt = (V){} + tj;                      \
        const V half = (V){} + (VAL)0.5, zero = (V){};                                      \
        int64_t o = 0, jn = 0, n = 0, k = 0;                                                \
        for (; k + 2 * (W) <= len; k += 2 * (W)) {                                          \
            V v, w;                                                                         \
            VLOAD2(p, k, &v, &w);                                                           \
            const VM nv = (VM)(v != zero), nw = (VM)(w != zero);                            \
            o += COUNT_MASK(nv & (VM)(ABS(v * vi) <= half));                                \
            o += COUNT_MASK(nw & (VM)(ABS(w * vi) <= half));                                \
            jn += COUNT_MASK(nv & (VM)(ABS(v * vj) <= half));                               \
            jn += COUNT_MASK(nw & (VM)(ABS(w * vj) <= half));                               \
            const V a = ABS(v), b = ABS(w);                                                 \
            n += COUNT_MASK((VM)(a + a >= vt)) + COUNT_MASK((VM)(b + b >= vt));             \
        }                                                                                   \
        for (; k < len; k++) {                                                              \
            const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                                   \
            o += rounds_##NAME(v, inv);                                                     \
            jn += rounds_##NAME(v, inv_j);                                                  \
            n += a + a >= tj;                                                               \
        }                                                                                   \
        *own = o;                                                                           \
        *joint = jn;                                                                        \
        *near = n;                                                                          \
    }                                                                                       \
    static void joint_##NAME(const SRC *p, int64_t len, VAL pv, VAL top, int64_t near,      \
                             VAL inv, double qmax, int64_t id, dw_groups *gj) {             \
        const VAL last = LOAD(p, len - 1);                                                  \
        const VAL al = last < 0 ? -last : last, ap = pv < 0 ? -pv : pv;                     \
        VAL top_rest = top; /* largest magnitude of p[0 .. len-2] */                        \
        if (al == top) { /* the last is the top: the others' largest, or top again */      \
            int64_t at_top;                                                                 \
            const VAL below = below_top_##NAME(p, len, top, &at_top);                       \
            top_rest = at_top >= 2 ? top : below;                                           \
        } else if (!(al < top)) { /* NaN */                                                 \
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
        } else { /* a new grid: count the block again, then take the last out */            \
            double scale = (double)tj / qmax;                                               \
            if (!(scale > 0)) scale = 1.0;                                                  \
            const VAL inv_j = (VAL)(1.0 / scale);                                           \
            int64_t own, joint, n;                                                          \
            regrid_##NAME(p, len, inv, inv_j, tj, &own, &joint, &n);                        \
            joint += rounds_##NAME(pv, inv_j) - rounds_##NAME(last, inv_j);                 \
            near_j = n - (al + al >= tj) + (ap + ap >= tj);                                 \
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
        const double ratio =                                                                \
            bulk == tj ? 1.0 : (bulk > 0 ? fmax((double)tj / (double)bulk, 1.0) : 1.0);     \
        note_block(gj, ratio, id);                                                          \
    }

/* The next of a batch's joint blocks (lane bits in `rest`, taken out as they are done) that
 * needs joint_*, or -1 when none is left. Once a worst block exists, every usual block left
 * only changes the count of elements rounding to 0 (`rp` for the element before it, `rl`
 * for the last one it drops): its ratio is 1, and it cannot become the worst. */
static inline int joint_next_slow(uint32_t *rest, uint32_t usual, uint32_t rp, uint32_t rl,
                                  dw_groups *gj) {
    if (gj->worst_block >= 0) {
        gj->zero_rounded += __builtin_popcount(*rest & usual & rp) -
                            __builtin_popcount(*rest & usual & rl);
        *rest &= ~usual;
    }
    if (!*rest) return -1;
    const int j = __builtin_ctz(*rest);
    *rest &= *rest - 1;
    return j;
}

/*
 * The joint blocks of a batch of own blocks (all of `len` elements), in vectors: in nearly
 * every block the element before it and its own last element are both below its largest
 * magnitude, so the grid is the same, the change in zero-rounded elements is two compares,
 * and the range ratio is 1 unless the top is alone. Those blocks are done here together; the
 * others, and the tensor's first joint block, go through joint_* one by one, in order (a
 * ratio of 1 never replaces a worst block already found, so the order is kept).
 */
#define DEFINE_JOINT_BATCH(NAME, SRC, VAL, VB, VBM, LOAD)                                    \
    static void joint_batch_##NAME(const SRC *const *ptr, int64_t len, const VAL *tops,     \
                                   const VAL *invs, const int64_t *nears, int nb,           \
                                   const SRC *x, const SRC *joint_prev, double qmax,        \
                                   int64_t first_id, dw_groups *gj) {                       \
        VAL prev[GROUP_BATCH] = {0}, last[GROUP_BATCH] = {0};                               \
        VAL near[GROUP_BATCH] = {0}, has[GROUP_BATCH] = {0};                                \
        for (int j = 0; j < nb; j++) {                                                      \
            const SRC *p = ptr[j];                                                          \
            has[j] = p > x || joint_prev != NULL;                                           \
            prev[j] = p > x ? LOAD(p, -1) : joint_prev != NULL ? LOAD(joint_prev, 0) : 0;   \
            last[j] = LOAD(p, len - 1);                                                     \
            near[j] = (VAL)nears[j];                                                        \
        }                                                                                   \
        VB top, inv, pv, lv, nv, hv;                                                        \
        memcpy(&top, tops, sizeof top);                                                     \
        memcpy(&inv, invs, sizeof inv);                                                     \
        memcpy(&pv, prev, sizeof pv);                                                       \
        memcpy(&lv, last, sizeof lv);                                                       \
        memcpy(&nv, near, sizeof nv);                                                       \
        memcpy(&hv, has, sizeof hv);                                                        \
        const VBM pneg = (VBM)(pv < 0), lneg = (VBM)(lv < 0);                               \
        const VB ap = (VB)(((VBM)-pv & pneg) | ((VBM)pv & ~pneg)),                          \
                 al = (VB)(((VBM)-lv & lneg) | ((VBM)lv & ~lneg));                          \
        /* near count of the joint block: the own block's, less its last, plus the one     \
         * before (counts are small integers, exact in VAL) */                              \
        const VB near_j = nv - (VB)((VBM)(al + al >= top) & (VBM)((VB){} + (VAL)1)) +       \
                          (VB)((VBM)(ap + ap >= top) & (VBM)((VB){} + (VAL)1));             \
        VBM usual = (VBM)(hv != 0) & (VBM)(al < top) & (VBM)(ap <= top) &                   \
                    ((VBM)(near_j != 1) | (VBM)((VB){} + (VAL)len == 1));                   \
        const VB sp = pv * inv, sl = lv * inv;                                              \
        const VBM rp = (VBM)(pv != 0) & (VBM)(sp <= (VAL)0.5) & (VBM)(sp >= (VAL)-0.5);     \
        const VBM rl = (VBM)(lv != 0) & (VBM)(sl <= (VAL)0.5) & (VBM)(sl >= (VAL)-0.5);     \
        /* lanes as bits (has is 0 beyond nb, and usual only where has) */                 \
        uint32_t usual_bits = 0, has_bits = 0, rp_bits = 0, rl_bits = 0;                    \
        for (int j = 0; j < GROUP_BATCH; j++) {                                             \
            usual_bits |= (uint32_t)(usual[j] != 0) << j;                                   \
            has_bits |= (uint32_t)(hv[j] != 0) << j;                                        \
            rp_bits |= (uint32_t)(rp[j] != 0) << j;                                         \
            rl_bits |= (uint32_t)(rl[j] != 0) << j;                                         \
        }                                                                                   \
        for (int j; (j = joint_next_slow(&has_bits, usual_bits, rp_bits, rl_bits, gj)) >= 0;) \
            joint_##NAME(ptr[j], len, prev[j], tops[j], nears[j], invs[j], qmax, first_id + j, gj); \
    }

/*
 * Pass 2 over one group, from L1: adds to *below the elements with |v| <= bound
 * and returns how many have 2|v| >= top.
 */
#define DEFINE_PASS2(NAME, SRC, VAL, V, W, ABS, COUNT_LE, COUNT_GE, VLOAD2, LOAD)           \
    static inline int64_t pass2_##NAME(const SRC *p, int64_t len, VAL top, VAL bound,       \
                                       uint32_t words, int64_t *below) {                    \
        (void)words;                                                                        \
        const VAL half = top * (VAL)0.5;                                                    \
        const V vbound = (V){} + bound, vhalf = (V){} + half, vtop = (V){} + top;           \
        int64_t k = 0, near = 0, r = 0;                                                     \
        if (half + half == top) {                                                           \
            for (; k + 2 * (W) <= len; k += 2 * (W)) {                                      \
                V v, w;                                                                     \
                VLOAD2(p, k, &v, &w);                                                       \
                const V a = ABS(v), b = ABS(w);                                             \
                r += COUNT_LE(a, vbound) + COUNT_LE(b, vbound);                             \
                near += COUNT_GE(a, vhalf) + COUNT_GE(b, vhalf);                            \
            }                                                                               \
        } else { /* top / 2 is not exact (a subnormal top): compare 2|v| */                 \
            for (; k + 2 * (W) <= len; k += 2 * (W)) {                                      \
                V v, w;                                                                     \
                VLOAD2(p, k, &v, &w);                                                       \
                const V a = ABS(v), b = ABS(w);                                             \
                r += COUNT_LE(a, vbound) + COUNT_LE(b, vbound);                             \
                near += COUNT_GE(a + a, vtop) + COUNT_GE(b + b, vtop);                      \
            }                                                                               \
        }                                                                                   \
        for (; k < len; k++) {                                                              \
            const VAL v = LOAD(p, k), a = v < 0 ? -v : v;                                   \
            r += a <= bound;                                                                \
            near += a + a >= top;                                                           \
        }                                                                                   \
        *below += r;                                                                        \
        return near;                                                                        \
    }

/* Pass 2 of a float group of 128 from its lanes' largest magnitudes (the vector of the
 * group's maxima of |v|, kept from pass 1), as fast_pass2 does for bf16: the elements with
 * |v| <= bound go to *counts (32-bit lanes, added up once a batch), and the lanes with
 * 2|v| >= top are a lower bound on the elements, counted when it is under 3. */
#if defined(__AVX512F__) && VBYTES == 64
static inline int64_t lanes_pass2_f32(const float *p, const vf *lanes, float top, float bound,
                                      vf *counts) {
    const __m512 vb = _mm512_set1_ps(bound), vt = _mm512_set1_ps(top);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i c = (__m512i)*counts;
    for (int i = 0; i < 128; i += 16) {
        const __m512 a = (__m512)abs_vf((vf)_mm512_loadu_ps(p + i));
        c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, vb, _CMP_LE_OQ), c, one);
    }
    *counts = (vf)c;
    const __m512 l = (__m512)*lanes;
    const int lanes_near = __builtin_popcount(_mm512_cmp_ps_mask(_mm512_add_ps(l, l), vt, _CMP_GE_OQ));
    if (__builtin_expect(lanes_near >= 3, 1)) return lanes_near;
    int64_t near = 0;
    for (int i = 0; i < 128; i += 16) {
        const __m512 a = (__m512)abs_vf((vf)_mm512_loadu_ps(p + i));
        near += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_add_ps(a, a), vt, _CMP_GE_OQ));
    }
    return near;
}
static inline int64_t lanes_count_f32(vf *counts) {
    const int64_t n = _mm512_reduce_add_epi32((__m512i)*counts);
    *counts = (vf){};
    return n;
}
#define LANES_F32 1
#else
static inline int64_t lanes_pass2_f32(const float *p, const vf *lanes, float top, float bound,
                                      vf *counts) {
    (void)p, (void)lanes, (void)top, (void)bound, (void)counts;
    return 0;
}
static inline int64_t lanes_count_f32(vf *counts) {
    (void)counts;
    return 0;
}
#define LANES_F32 0
#endif

/* bf16 compares as its 16-bit words: for a magnitude (sign bit cleared) that is not NaN the
 * order of the words is the order of the values, so |v| <= bound and 2|v| >= top become
 * integer compares on twice as many lanes as floats, with no conversion. The thresholds are
 * the largest word whose value is <= bound (bound's float bits, truncated: bound >= 0) and
 * the smallest word w with 2 * value(w) >= top. A NaN word lies above both; NaN makes the
 * whole tensor's risk undefined anyway. */
static inline uint16_t bf16_near_word(float top) {
    if (!(top <= 0x1.fep127f)) return 0x7f80; /* Inf/NaN: no tensor risk is computed */
    uint32_t bits;
    const float half = top * 0.5f;
    memcpy(&bits, &half, sizeof bits);
    uint16_t w = (uint16_t)(bits >> 16);
    while (w > 0 && load_bf16(&(uint16_t){(uint16_t)(w - 1)}, 0) * 2.0f >= top) w--;
    while (!(load_bf16(&w, 0) * 2.0f >= top)) w++;
    return w;
}

/* The two words of a batch of groups, `lo | hi << 16` each (see words_bf16). */
static void words_bf16(const float *tops, const float *bounds, uint32_t *words, int nb) {
    vbf top, bound;
    memcpy(&top, tops, sizeof top);
    memcpy(&bound, bounds, sizeof bound);
    const vbu lo = (vbu)bound >> 16;
    vbu hi = (vbu)(top * 0.5f) >> 16; /* exact for any normal top; else a step or two off */
    hi += (vbu)((vbf)((hi - 1) << 16) * 2.0f >= top) & (vbu)(hi > 0); /* a step down */
    hi -= ~(vbu)((vbf)(hi << 16) * 2.0f >= top);                      /* a step up */
    const vbm exact = (vbm)((vbf)(hi << 16) * 2.0f >= top) &
                      ((vbm)(hi == 0) | ~(vbm)((vbf)((hi - 1) << 16) * 2.0f >= top)) &
                      (vbm)(top <= 0x1.fep127f);
    const vbu both = lo | hi << 16;
    memcpy(words, &both, sizeof both);
    if (!every_lane(exact))
        for (int j = 0; j < nb; j++)
            if (!exact[j]) words[j] = lo[j] | (uint32_t)bf16_near_word(tops[j]) << 16;
}
static void no_words(const float *tops, const float *bounds, uint32_t *words, int nb) {
    (void)tops, (void)bounds, (void)words, (void)nb;
}
static void no_words_d(const double *tops, const double *bounds, uint32_t *words, int nb) {
    (void)tops, (void)bounds, (void)words, (void)nb;
}

/* The grid of every bf16 magnitude for one qmax, as grids_f and words_bf16 give it: entry
 * 2w is the words (`lo | hi << 16`) of the magnitude whose word is w, entry 2w + 1 its float
 * inverse scale's bits. The fast bf16 groups look their grids up here (a batch's grids cost
 * two double divisions a lane), with the table built once per qmax by the caller. */
void dw_grid_table_bf16(double qmax, uint32_t *table) {
    for (uint32_t w = 0; w < 0x8000; w += GROUP_BATCH) {
        float tops[GROUP_BATCH], invs[GROUP_BATCH], bounds[GROUP_BATCH];
        uint32_t words[GROUP_BATCH];
        for (int j = 0; j < GROUP_BATCH; j++) tops[j] = load_bf16(&(uint16_t){(uint16_t)(w + j)}, 0);
        grids_f(tops, qmax, invs, bounds, GROUP_BATCH);
        words_bf16(tops, bounds, words, GROUP_BATCH);
        for (int j = 0; j < GROUP_BATCH; j++) {
            table[2 * (w + j)] = words[j];
            memcpy(&table[2 * (w + j) + 1], &invs[j], sizeof invs[j]);
        }
    }
}
static inline void table_grids(const uint32_t *table, const float *tops, float *invs, uint32_t *words) {
    for (int j = 0; j < GROUP_BATCH; j++) {
        uint32_t bits;
        memcpy(&bits, &tops[j], sizeof bits);
        const uint32_t *e = table + 2 * (bits >> 16 & 0x7fff);
        words[j] = e[0];
        memcpy(&invs[j], &e[1], sizeof invs[j]);
    }
}

static inline int64_t pass2_bf16(const uint16_t *p, int64_t len, float top, float bound,
                                 uint32_t words, int64_t *below) {
    (void)top, (void)bound;
    const uint16_t lo = (uint16_t)words, hi = (uint16_t)(words >> 16);
    const vw vlo = (vw){} + lo, vhi = (vw){} + hi;
    int64_t k = 0, near = 0, r = 0;
    for (; k + VBYTES / 2 <= len; k += VBYTES / 2) {
        vw u;
        memcpy(&u, p + k, sizeof u);
        u &= 0x7fff;
        r += count_le_vw(u, vlo);
        near += count_ge_vw(u, vhi);
    }
    for (; k < len; k++) {
        const uint16_t u = p[k] & 0x7fff;
        r += u <= lo;
        near += u >= hi;
    }
    *below += r;
    return near;
}

/* The range ratio of a block whose largest magnitude `top` stands alone (no other element has
 * 2|v| >= top): the bulk ends at the second largest magnitude. */
#define DEFINE_ALONE(NAME, SRC, VAL, LOAD)                                                  \
    static double alone_ratio_##NAME(const SRC *p, int64_t len, VAL top) {                  \
        VAL second = 0;                                                                     \
        for (int64_t e = 0; e < len; e++) {                                                 \
            const VAL v = LOAD(p, e), a = v < 0 ? -v : v;                                   \
            if (!(a + a >= top) && a > second) second = a;                                  \
        }                                                                                   \
        return second > 0 ? fmax((double)top / (double)second, 1.0) : 1.0;                  \
    }
DEFINE_ALONE(f32, float, float, load_f32)
DEFINE_ALONE(bf16, uint16_t, float, load_bf16)
DEFINE_ALONE(f16, uint16_t, float, load_f16)
DEFINE_ALONE(f64, double, double, load_f64)

/*
 * Moments plus symmetric per-group quantization of `rows` whole rows of `cols` elements,
 * cut into groups of `group` along each row (the last one shorter when `group` does not
 * divide `cols`). Only for groups too small for the bulk quantile to exclude anything, where
 * the bulk is the block without its largest magnitude if that more than doubles the range
 * (quantization.py's "tiny" blocks). `first_block` numbers the first group.
 *
 * Pass 1 (from memory) takes the moments, with the minimum and maximum kept per group: the
 * group's largest magnitude `top` is the larger of its maximum and minus its minimum. The
 * grids of a batch of groups are then computed together (grids_f, grids_d). Pass 2 (from L1)
 * counts the non-zero elements that round to 0 on the grid, and decides whether top is
 * dropped from the bulk: top > 2 * second exactly when top is the only element with
 * 2|x| >= top, and then the second largest magnitude is the largest of the others.
 *
 * With `gj`, also the blocks of the tensor quantized behind a scalar (see DEFINE_JOINT); only
 * when `cols == group`. `joint_prev` points at the element before x, or is NULL when x starts
 * the tensor (that block holds the scalar; the caller measures it).
 */
#define DEFINE_GROUPS(NAME, SRC, VAL, V, VM, W, MIN, MAX, R16, FOLD, TOPS, GRIDS, WORDS,        \
                      FAST_GROUPS, LANES, VLOAD2, LOAD)                                     \
    static void groups_##NAME(const SRC *x, int64_t rows, int64_t cols, int64_t group,      \
                              double qmax, int64_t first_block, double shift, dw_moments *m, \
                              dw_groups *g, const SRC *joint_prev, dw_groups *gj) {          \
        const VAL sh = (VAL)shift;                                                          \
        const int64_t per_row = (cols + group - 1) / group;                                 \
        const int64_t blocks = rows * per_row;                                              \
        ACC_STATE(VAL, V, VM)                                                               \
        ACC_RESET(VAL, V, VM);                                                              \
        const int64_t zeros_before = m->zeros;                                              \
        int64_t pending = 0; /* elements accumulated since the last flush */                \
        const SRC *flush_start = x;                                                         \
        /* two batches in flight: pass 2 of the previous batch runs while the grids of the  \
         * current one, a long chain of divisions, are computed */                          \
        const SRC *ptrs[2][GROUP_BATCH];                                                    \
        int64_t lengths[2][GROUP_BATCH];                                                    \
        VAL topss[2][GROUP_BATCH], invss[2][GROUP_BATCH], boundss[2][GROUP_BATCH];          \
        uint32_t wordss[2][GROUP_BATCH];                                                    \
        /* float groups of 128: their lanes' largest magnitudes, and lanes_pass2_f32's counts */ \
        vf lanes_f[LANES ? 2 : 1][LANES ? GROUP_BATCH : 1], counts_f = (vf){};              \
        const int by_lanes = LANES && group == 128 && cols % 128 == 0;                      \
        int64_t nears[GROUP_BATCH] = {0};                                                   \
        VAL part[GROUP_BATCH][4] = {{0}}, tails[GROUP_BATCH] = {0};                         \
        int64_t row = 0, col = 0; /* where the next block starts */                         \
        int64_t before = 0;       /* the previous batch's first block */                    \
        int nb_before = 0, cur = 0;                                                         \
        for (int64_t first = 0;; first += GROUP_BATCH) {                                    \
            const int nb = first >= blocks ? 0                                              \
                           : blocks - first < GROUP_BATCH ? (int)(blocks - first)           \
                                                          : GROUP_BATCH;                    \
            const SRC **ptr = ptrs[cur];                                                    \
            int64_t *lens = lengths[cur];                                                   \
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
                prefetch_ahead(p, len * (int64_t)sizeof(SRC));                              \
                V glo = (V){} + (VAL)INFINITY, ghi = (V){} - (VAL)INFINITY;                 \
                V glo2 = glo, ghi2 = ghi;                                                   \
                VAL u1 = 0;                                                                 \
                int64_t i = 0;                                                              \
                if (len == 128) { /* the usual group: a constant count, unrolled */         \
                    for (; i < 128; i += 2 * (W)) {                                         \
                        V v, w;                                                             \
                        VLOAD2(p, i, &v, &w);                                               \
                        ACC_ADD(MIN, MAX, VM, v, sh, glo, ghi, s, q, z);                    \
                        ACC_ADD(MIN, MAX, VM, w, sh, glo2, ghi2, s2, q2, z2);               \
                    }                                                                       \
                }                                                                           \
                for (; i + 2 * (W) <= len; i += 2 * (W)) {                                  \
                    V v, w;                                                                 \
                    VLOAD2(p, i, &v, &w);                                                   \
                    ACC_ADD(MIN, MAX, VM, v, sh, glo, ghi, s, q, z);                        \
                    ACC_ADD(MIN, MAX, VM, w, sh, glo2, ghi2, s2, q2, z2);                   \
                }                                                                           \
                for (; i < len; i++) {                                                      \
                    const VAL v = LOAD(p, i);                                               \
                    ACC_ADD_SCALAR(v, sh);                                                  \
                    const VAL a = v < 0 ? -v : v;                                           \
                    u1 = a > u1 ? a : u1;                                                   \
                }                                                                           \
                glo = MIN(glo, glo2);                                                       \
                ghi = MAX(ghi, ghi2);                                                       \
                lo = MIN(glo, lo);                                                          \
                hi = MAX(ghi, hi);                                                          \
                /* NaN never enters the minimum or maximum on x86; elsewhere it             \
                 * makes top NaN, and the tensor's risk is undefined with NaN anyway */     \
                const V top_lanes = MAX(ghi, -glo);                                         \
                if (by_lanes) memcpy(&lanes_f[LANES ? cur : 0][LANES ? j : 0], &top_lanes,  \
                                     sizeof top_lanes);                                     \
                const R16 folded = FOLD(top_lanes);                                         \
                memcpy(part[j], &folded, sizeof folded);                                    \
                tails[j] = u1;                                                              \
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
            if (nb) {                                                                       \
                TOPS(part, tails, topss[cur]);                                              \
                GRIDS(topss[cur], qmax, invss[cur], boundss[cur], nb);                      \
                WORDS(topss[cur], boundss[cur], wordss[cur], nb);                           \
            }                                                                               \
            /* pass 2 of the previous batch, from L1 or L2: elements rounding to 0, and     \
             * whether the top is alone */                                                  \
            const int old = cur ^ 1;                                                        \
            const VAL *tops = topss[old], *invs = invss[old], *bounds = boundss[old];       \
            int64_t below = 0;                                                              \
            for (int j = 0; j < nb_before; j++) {                                           \
                const SRC *p = ptrs[old][j];                                                \
                const int64_t len = lengths[old][j];                                        \
                const VAL top = tops[j];                                                    \
                const uint32_t words = wordss[old][j];                                      \
                const int64_t near = by_lanes ? lanes_pass2_f32((const float *)p,         \
                                                                  &lanes_f[LANES ? old : 0][LANES ? j : 0], \
                                                                  (float)top, (float)bounds[j], &counts_f) \
                                     : len == 128                                           \
                                         ? pass2_##NAME(p, 128, top, bounds[j], words, &below) \
                                         : pass2_##NAME(p, len, top, bounds[j], words, &below); \
                /* top alone: the bulk ends at the second largest */                        \
                const double ratio = len > 1 && near == 1 ? alone_ratio_##NAME(p, len, top) : 1.0; \
                note_block(g, ratio, first_block + before + j);                             \
                nears[j] = near;                                                            \
            }                                                                               \
            if (gj != NULL && nb_before && by_lanes)                                        \
                lanes_joint_batch_f32((const float *const *)ptrs[old], (const float *)tops, \
                                      (const float *)invs, nears, nb_before, (const float *)x, \
                                      (const float *)joint_prev, qmax, first_block + before, gj); \
            else if (gj != NULL && nb_before)                                               \
                joint_batch_##NAME(ptrs[old], group, tops, invs, nears, nb_before, x,       \
                                   joint_prev, qmax, first_block + before, gj);             \
            if (by_lanes) below += lanes_count_f32(&counts_f);                              \
            /* every zero was counted as rounding to 0 (they are taken out at the end) */   \
            g->zero_rounded += below;                                                       \
            if (!nb) break;                                                                 \
            before = first;                                                                 \
            nb_before = nb;                                                                 \
            cur = old;                                                                      \
        }                                                                                   \
        if (pending) {                                                                      \
            int ok;                                                                         \
            ACC_FLUSH(W, pending, ok);                                                      \
            if (!ok) slow_##NAME(flush_start, pending, (double)sh, m);                      \
        }                                                                                   \
        /* every zero was counted as rounding to 0: it is not a non-zero element */         \
        g->zero_rounded -= m->zeros - zeros_before;                                         \
    }                                                                                       \
    void dw_groups_##NAME(const SRC *x, int64_t rows, int64_t cols, int64_t group,          \
                          double qmax, int64_t first_block, double shift, dw_moments *m,    \
                          dw_groups *g, const SRC *joint_prev, dw_groups *gj,               \
                          const uint32_t *grid_table) {                                     \
        if (!FAST_GROUPS(x, rows, cols, group, qmax, first_block, shift, m, g, joint_prev, gj, \
                         grid_table))                                                       \
            groups_##NAME(x, rows, cols, group, qmax, first_block, shift, m, g, joint_prev, gj); \
    }

DEFINE_MOMENTS(f32, float, float, vf, vfm, VF_LANES, min_vf, max_vf, vload2_f32, load_f32)
DEFINE_MOMENTS(bf16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, vload2_bf16, load_bf16)
DEFINE_MOMENTS(f16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, vload2_f16, load_f16)
DEFINE_MOMENTS(f64, double, double, vd, vdm, VD_LANES, min_vd, max_vd, vload2_f64, load_f64)
DEFINE_JOINT(f32, float, float, vf, vfm, VF_LANES, vload2_f32, abs_vf, max_vf, hmax_vf, count_mask_vf,
             load_f32)
DEFINE_JOINT(bf16, uint16_t, float, vf, vfm, VF_LANES, vload2_bf16, abs_vf, max_vf, hmax_vf, count_mask_vf,
             load_bf16)
DEFINE_JOINT(f16, uint16_t, float, vf, vfm, VF_LANES, vload2_f16, abs_vf, max_vf, hmax_vf, count_mask_vf,
             load_f16)
DEFINE_JOINT(f64, double, double, vd, vdm, VD_LANES, vload2_f64, abs_vd, max_vd, hmax_vd, count_mask_vd,
             load_f64)
DEFINE_JOINT_BATCH(f32, float, float, vbf, vbm, load_f32)
DEFINE_JOINT_BATCH(bf16, uint16_t, float, vbf, vbm, load_bf16)
DEFINE_JOINT_BATCH(f16, uint16_t, float, vbf, vbm, load_f16)
DEFINE_JOINT_BATCH(f64, double, double, vbd, vbdm, load_f64)

#if FAST_BF16
/* joint_batch_bf16 for a batch of fast groups, with its tests on the 16-bit words of all 16
 * groups in one vector. The groups are rows of their own and follow each other, so the
 * element before a block is the last element of the block before. Words order as their
 * magnitudes, NaN aside: a block whose top is NaN is never usual (as with the floats). */
static void fast_joint_batch(const uint16_t *const *ptr, const float *tops, const float *invs,
                             const uint32_t *words, const int64_t *nears, int nb, const uint16_t *x,
                             const uint16_t *joint_prev, double qmax, int64_t first_id, dw_groups *gj) {
    const __mmask16 live = (__mmask16)((1u << nb) - 1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* words 126 and 127 of each group: its last element in the high half */
    const __m512i at = _mm512_add_epi32(_mm512_slli_epi32(lane, 8), _mm512_set1_epi32(252));
    const __m512i last = _mm512_srli_epi32(
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, ptr[0], 1), 16);
    const int has_first = ptr[0] > x || joint_prev != NULL;
    const uint16_t first_prev = ptr[0] > x ? ptr[0][-1] : joint_prev != NULL ? joint_prev[0] : 0;
    const __m512i prev = _mm512_alignr_epi32(last, _mm512_set1_epi32(first_prev), 15);
    const __m512i mag = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i ap = _mm512_and_si512(prev, mag), al = _mm512_and_si512(last, mag);
    const __m512i top = _mm512_srli_epi32(_mm512_loadu_si512(tops), 16);
    const __m512i w = _mm512_loadu_si512(words);
    const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi32(0xffff)), hi = _mm512_srli_epi32(w, 16);
    const __m512i nv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_loadu_si512(nears))),
                                          _mm512_cvtepi64_epi32(_mm512_loadu_si512(nears + 8)), 1);
    /* the own block's near count, less its last, plus the one before */
    __m512i near_j = _mm512_mask_sub_epi32(nv, _mm512_cmpge_epu32_mask(al, hi), nv, one);
    near_j = _mm512_mask_add_epi32(near_j, _mm512_cmpge_epu32_mask(ap, hi), near_j, one);
    const __mmask16 has = live & (__mmask16)(has_first ? 0xffff : 0xfffe);
    const uint32_t usual = has & _mm512_cmple_epu32_mask(top, _mm512_set1_epi32(0x7f80)) &
                     _mm512_cmplt_epu32_mask(al, top) & _mm512_cmple_epu32_mask(ap, top) &
                     _mm512_cmpneq_epi32_mask(near_j, one);
    const uint32_t rp = _mm512_test_epi32_mask(ap, ap) & _mm512_cmple_epu32_mask(ap, lo);
    const uint32_t rl = _mm512_test_epi32_mask(al, al) & _mm512_cmple_epu32_mask(al, lo);
    uint32_t rest = has;
    for (int j; (j = joint_next_slow(&rest, usual, rp, rl, gj)) >= 0;)
        joint_bf16(ptr[j], 128, j ? load_bf16(ptr[j], -1) : load_bf16(&first_prev, 0), tops[j], nears[j],
                   invs[j], qmax, first_id + j, gj);
}

/* The groups of DEFINE_GROUPS when they are bf16 rows of one group of 128 each, back to back,
 * and the caller gives the grid table: the same passes and results with nothing the other
 * layouts need. Every batch of 16 groups is one flush (FLUSH elements). Returns 0, having
 * done nothing, for any other layout. */
_Static_assert(FLUSH == 128 * GROUP_BATCH, "a batch of fast groups is one flush");
static int fast_groups_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t group, double qmax,
                            int64_t first_block, double shift, dw_moments *m, dw_groups *g,
                            const uint16_t *joint_prev, dw_groups *gj, const uint32_t *table) {
    if (table == NULL || group != 128 || cols % 128 != 0) return 0;
    const int64_t blocks = rows * (cols / 128);
    const float sh = (float)shift;
    const int64_t zeros_before = m->zeros;
    fast_acc fa;
    fast_init(&fa);
    fast_lanes lanes[2][GROUP_BATCH];
    memset(lanes, 0, sizeof lanes); /* a short batch's unused lanes are folded too */
    fast_lanes counts = _mm512_setzero_si512();
    float tops[2][GROUP_BATCH], invs[2][GROUP_BATCH];
    uint32_t words[2][GROUP_BATCH];
    const uint16_t *ptrs[2][GROUP_BATCH];
    int64_t nears[GROUP_BATCH] = {0}, zero_rounded = 0;
    int64_t before = 0; /* the previous batch's first block */
    int nb_before = 0, cur = 0;
    for (int64_t first = 0;; first += GROUP_BATCH) {
        const int nb = first >= blocks ? 0 : blocks - first < GROUP_BATCH ? (int)(blocks - first) : GROUP_BATCH;
        /* pass 1, from memory */
        const uint16_t *batch = x + first * 128;
        for (int j = 0; j < nb; j++) {
            const uint16_t *p = batch + 128 * j;
            ptrs[cur][j] = p;
            prefetch_ahead(p, 256);
            fast_bf16(p, &fa, &lanes[cur][j]);
        }
        if (nb) { /* the flush, as ACC_FLUSH adds it; NaN/Inf sends it to the slow path */
            double fs = 0.0, fq = 0.0, flo = INFINITY, fhi = -INFINITY;
            int64_t fz = 0;
            fast_flush(&fa, (double)sh, &fs, &fq, &flo, &fhi, &fz);
            if (!add_flush(m, 128 * nb, fs, fq, flo, fhi, fz))
                slow_bf16(batch, 128 * nb, (double)sh, m);
            fast_tops(lanes[cur], tops[cur]);
            table_grids(table, tops[cur], invs[cur], words[cur]);
        }
        /* pass 2 of the previous batch, from L1 */
        const int old = cur ^ 1;
        for (int j = 0; j < nb_before; j++) {
            const uint16_t *p = ptrs[old][j];
            const int64_t near = fast_pass2(p, &lanes[old][j], words[old][j], &counts);
            /* top alone: the bulk ends at the second largest */
            const double ratio =
                __builtin_expect(near == 1, 0) ? alone_ratio_bf16(p, 128, tops[old][j]) : 1.0;
            note_block(g, ratio, first_block + before + j);
            nears[j] = near;
        }
        if (gj != NULL && nb_before)
            fast_joint_batch(ptrs[old], tops[old], invs[old], words[old], nears, nb_before, x, joint_prev,
                             qmax, first_block + before, gj);
        zero_rounded += fast_count(&counts);
        if (!nb) break;
        before = first;
        nb_before = nb;
        cur = old;
    }
    /* every zero was counted as rounding to 0: it is not a non-zero element */
    g->zero_rounded += zero_rounded - (m->zeros - zeros_before);
    return 1;
}
#else
#define fast_groups_bf16 no_fast_groups
#endif
/* The types without a path of their own (and bf16 where the CPU has no bf16 dot product). */
#define no_fast_groups(x, rows, cols, group, qmax, first_block, shift, m, g, joint_prev, gj, table) \
    ((void)(table), 0)
#if defined(__AVX512F__) && VBYTES == 64
/* joint_batch_f32 for a batch of float groups of 128 (one per row, so each block's element
 * before is the last of the block before), its tests on all 16 groups in one vector, with
 * the same float compares. */
static void lanes_joint_batch_f32(const float *const *ptr, const float *tops, const float *invs,
                                  const int64_t *nears, int nb, const float *x, const float *joint_prev,
                                  double qmax, int64_t first_id, dw_groups *gj) {
    const __mmask16 live = (__mmask16)((1u << nb) - 1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i at = _mm512_add_epi32(_mm512_slli_epi32(lane, 9), _mm512_set1_epi32(508));
    const __m512 last = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, ptr[0], 1);
    const int has_first = ptr[0] > x || joint_prev != NULL;
    const float first_prev = ptr[0] > x ? ptr[0][-1] : joint_prev != NULL ? joint_prev[0] : 0.0f;
    const __m512 prev = _mm512_castsi512_ps(
        _mm512_alignr_epi32(_mm512_castps_si512(last), _mm512_castps_si512(_mm512_set1_ps(first_prev)), 15));
    const __m512 ap = (__m512)abs_vf((vf)prev), al = (__m512)abs_vf((vf)last);
    const __m512 top = _mm512_loadu_ps(tops), inv = _mm512_loadu_ps(invs);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i nv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_loadu_si512(nears))),
                                          _mm512_cvtepi64_epi32(_mm512_loadu_si512(nears + 8)), 1);
    /* the own block's near count, less its last, plus the one before */
    __m512i near_j = _mm512_mask_sub_epi32(nv, _mm512_cmp_ps_mask(_mm512_add_ps(al, al), top, _CMP_GE_OQ), nv, one);
    near_j = _mm512_mask_add_epi32(near_j, _mm512_cmp_ps_mask(_mm512_add_ps(ap, ap), top, _CMP_GE_OQ), near_j, one);
    const __mmask16 has = live & (__mmask16)(has_first ? 0xffff : 0xfffe);
    const uint32_t usual = has & _mm512_cmp_ps_mask(al, top, _CMP_LT_OQ) & _mm512_cmp_ps_mask(ap, top, _CMP_LE_OQ) &
                     _mm512_cmpneq_epi32_mask(near_j, one);
    const __m512 sp = _mm512_mul_ps(prev, inv), sl = _mm512_mul_ps(last, inv);
    const __m512 half = _mm512_set1_ps(0.5f), minus_half = _mm512_set1_ps(-0.5f);
    const uint32_t rp = _mm512_cmp_ps_mask(prev, _mm512_setzero_ps(), _CMP_NEQ_UQ) &
                        _mm512_cmp_ps_mask(sp, half, _CMP_LE_OQ) & _mm512_cmp_ps_mask(sp, minus_half, _CMP_GE_OQ);
    const uint32_t rl = _mm512_cmp_ps_mask(last, _mm512_setzero_ps(), _CMP_NEQ_UQ) &
                        _mm512_cmp_ps_mask(sl, half, _CMP_LE_OQ) & _mm512_cmp_ps_mask(sl, minus_half, _CMP_GE_OQ);
    uint32_t rest = has;
    for (int j; (j = joint_next_slow(&rest, usual, rp, rl, gj)) >= 0;)
        joint_f32(ptr[j], 128, j ? ptr[j][-1] : first_prev, tops[j], nears[j], invs[j], qmax,
                  first_id + j, gj);
}
#else
static inline void lanes_joint_batch_f32(const float *const *ptr, const float *tops, const float *invs,
                                         const int64_t *nears, int nb, const float *x,
                                         const float *joint_prev, double qmax, int64_t first_id,
                                         dw_groups *gj) {
    (void)ptr, (void)tops, (void)invs, (void)nears, (void)nb, (void)x;
    (void)joint_prev, (void)qmax, (void)first_id, (void)gj;
}
#endif
DEFINE_PASS2(f32, float, float, vf, VF_LANES, abs_vf, count_le_vf, count_ge_vf, vload2_f32, load_f32)
DEFINE_PASS2(f16, uint16_t, float, vf, VF_LANES, abs_vf, count_le_vf, count_ge_vf, vload2_f16, load_f16)
DEFINE_PASS2(f64, double, double, vd, VD_LANES, abs_vd, count_le_vd, count_ge_vd, vload2_f64, load_f64)
DEFINE_GROUPS(f32, float, float, vf, vfm, VF_LANES, min_vf, max_vf, vf4, fold_max_vf, tops_f, grids_f,
              no_words, no_fast_groups, LANES_F32, vload2_f32, load_f32)
DEFINE_GROUPS(bf16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, vf4, fold_max_vf, tops_f, grids_f,
              words_bf16, fast_groups_bf16, 0, vload2_bf16, load_bf16)
DEFINE_GROUPS(f16, uint16_t, float, vf, vfm, VF_LANES, min_vf, max_vf, vf4, fold_max_vf, tops_f, grids_f,
              no_words, no_fast_groups, 0, vload2_f16, load_f16)
DEFINE_GROUPS(f64, double, double, vd, vdm, VD_LANES, min_vd, max_vd, vd2, fold_max_vd, tops_d, grids_d,
              no_words_d, no_fast_groups, 0, vload2_f64, load_f64)

/* Whether bf16 groups of 128 take the bf16 dot-product path (fast_groups_bf16). */
int dw_fast_bf16(void) { return FAST_BF16; }

/*
 * The pieces of one chunk, each the work of one dw_moments_* or dw_groups_* call, taken one
 * by one by every thread that calls dw_run_pieces with the same `next` counter: the callers
 * (the calling thread and the pool's, with the GIL released) share the chunk without going
 * back to Python between its pieces. A piece with `drop` set then drops those pages of the
 * reader's file map from the process (they stay in the page cache), from the thread that
 * read them.
 */
typedef struct {
    const void *x;       /* the piece's first element */
    int64_t rows, cols;  /* whole rows; group 0: moments only, of rows * cols elements */
    int64_t group, first_block;
    const void *joint_prev; /* as dw_groups_* take them */
    dw_moments *m;
    dw_groups *g, *gj;
    void *drop; /* pages to drop once read (whole pages of a file map), or NULL */
    int64_t drop_len;
} dw_piece;

#if defined(__unix__) || defined(__APPLE__)
static void drop_pages(void *p, int64_t n) { (void)madvise(p, (size_t)n, MADV_DONTNEED); }
#else
static void drop_pages(void *p, int64_t n) { (void)p, (void)n; }
#endif

/* kind: 0 float32, 1 bf16, 2 float16, 3 float64 (KIND_CODES in native_reduce.py). */
void dw_run_pieces(int kind, const dw_piece *pieces, int64_t n, int64_t *next, double qmax, double shift,
                   const uint32_t *grid_table) {
    for (int64_t i; (i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < n;) {
        const dw_piece *c = &pieces[i];
        const int64_t size = c->rows * c->cols;
#define RUN_PIECE(NAME, SRC)                                                                \
    if (c->group == 0)                                                                      \
        dw_moments_##NAME((const SRC *)c->x, size, shift, c->m);                            \
    else                                                                                    \
        dw_groups_##NAME((const SRC *)c->x, c->rows, c->cols, c->group, qmax, c->first_block, \
                         shift, c->m, c->g, (const SRC *)c->joint_prev, c->gj, grid_table)
        switch (kind) {
        case 0: RUN_PIECE(f32, float); break;
        case 1: RUN_PIECE(bf16, uint16_t); break;
        case 2: RUN_PIECE(f16, uint16_t); break;
        case 3: RUN_PIECE(f64, double); break;
        default: return;
        }
#undef RUN_PIECE
        if (c->drop != NULL && c->drop_len > 0) drop_pages(c->drop, c->drop_len);
    }
}

/* Lets the loader check that it talks to the code it compiled. */
int dw_abi_version(void) { return 5; }
