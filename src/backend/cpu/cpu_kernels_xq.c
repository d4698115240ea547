// Integer dot products of the quantised-weight decode path (cpu_kernels.h: quantize_xq,
// gemv_xq): activations quantised per block of 32 to int16 with an F32 scale, weights in their
// GGUF block type, one int32 dot product per block (per 16 for Q6_K's scales) scaled by
// (weight scale x activation scale) in fp32, plus the weight's block offset x the activations'
// scaled sum for the types with a min (Q4_1, Q4_K, Q5_K; Q4_0 as offset -8 d).
//
// Why int16 and not llama.cpp's int8 (q8_0 / q8_1) activations: on SmolLM2-135M Q4_1 int8
// activations raised the perplexity of tests/fixtures/eval/declaration.txt by 0.67% over the F32
// expansion (docs/perf.md), int16 by <0.01%, at nearly the same cost (a 16-bit madd per 16
// weights instead of maddubs + madd per 32; the weights, not the activations, are the traffic).
//
// Tolerance: per block b the rounding of x is at most d_b / 2 = max|x_b| / 65534 per element,
// so an output differs from the exact dot product of the dequantised weights with x by at most
// sum_b max|x_b| / 65534 * sum_{i in b} |w_i|, plus fp32 rounding; tests/test_cpu_quant_ops.c
// checks every kernel against that bound.
//
// Portable versions (the specification) and AVX2 versions chosen at run time with the rest of
// cpu_kernels. For one (x row, weight row) pair each accumulates the blocks in order into one sum
// (8 lanes for AVX2), so an output does not depend on which other rows or columns a call
// computes (thread count, batch size up to 8).
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"

#define XQ_MAX 32767.0f

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// d = max|x| / 32767, q = x / d rounded to nearest even (lrintf in the default rounding mode; the
// AVX2 version rounds the same way), s = d * sum(q).
static void quantize_xq_generic(struct cpu_xq_block *dst, const float *x, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(xb[i]));
        float d = amax / XQ_MAX, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)lrintf(xb[i] * id);
            dst[b].q[i] = (int16_t)q;
            sum += q;
        }
        dst[b].d = d;
        dst[b].s = d * (float)sum;
    }
}

// The 32-element types: quants of block wb as 32 ints, its scale and offset (element = wd * q + wm).
static inline void w32_unpack(int wk, const uint8_t *wb, int *q, float *wd, float *wm) {
    *wd = f16_at(wb);
    switch (wk) {
    case CPU_WEIGHT_Q8_0:
        *wm = 0.0f;
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)wb[2 + i];
        return;
    case CPU_WEIGHT_Q4_0:
        *wm = -8.0f * *wd;
        for (int i = 0; i < 16; i++) {
            q[i] = wb[2 + i] & 0xf;
            q[i + 16] = wb[2 + i] >> 4;
        }
        return;
    default: // Q4_1
        *wm = f16_at(wb + 2);
        for (int i = 0; i < 16; i++) {
            q[i] = wb[4 + i] & 0xf;
            q[i + 16] = wb[4 + i] >> 4;
        }
        return;
    }
}

#define GEMV_XQ_GENERIC(SUFFIX, WK, DT)                                                                                \
    static void gemv_xq_generic_##SUFFIX(float *out, int64_t os, const struct cpu_xq_block *xq, int64_t xqs, int nx,   \
                                         const void *wv, const float *bias, int64_t k, int64_t ws, int64_t j0,         \
                                         int64_t j1) {                                                                 \
        const uint8_t *w = wv;                                                                                         \
        const size_t bb = dtype_block_bytes(DT), rb = (size_t)(ws / 32) * bb;                                          \
        const int64_t nb = k / 32;                                                                                     \
        for (int64_t j = j0; j < j1; j++)                                                                              \
            for (int i = 0; i < nx; i++) {                                                                             \
                const struct cpu_xq_block *xr = xq + i * xqs;                                                          \
                float acc = 0.0f, accm = 0.0f;                                                                         \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    int q[32], dot = 0;                                                                                \
                    float wd, wm;                                                                                      \
                    w32_unpack(WK, w + (size_t)j * rb + (size_t)b * bb, q, &wd, &wm);                                  \
                    for (int t = 0; t < 32; t++)                                                                       \
                        dot += q[t] * xr[b].q[t];                                                                      \
                    acc += wd * xr[b].d * (float)dot;                                                                  \
                    accm += wm * xr[b].s;                                                                              \
                }                                                                                                      \
                float v = acc + accm;                                                                                  \
                out[i * os + j] = bias ? v + bias[j] : v;                                                              \
            }                                                                                                          \
    }
GEMV_XQ_GENERIC(q8_0, CPU_WEIGHT_Q8_0, DTYPE_Q8_0)
GEMV_XQ_GENERIC(q4_0, CPU_WEIGHT_Q4_0, DTYPE_Q4_0)
GEMV_XQ_GENERIC(q4_1, CPU_WEIGHT_Q4_1, DTYPE_Q4_1)

// K-quant super-block (256) as small ints with a scale per 16 elements and an offset per 32:
// element e = sc16[e / 16] * q[e] + mn32[e / 32]. Q4_K / Q5_K: q = the 4 / 5-bit value,
// sc16 = d * scale_j, mn32 = -dmin * min_j; Q6_K: q = value - 32, sc16 = d * scale; Q8_K: q, d.
static void kq_unpack(int wk, const uint8_t *b, int16_t *q, float *sc16, float *mn32) {
    if (wk == CPU_WEIGHT_Q4_K || wk == CPU_WEIGHT_Q5_K) {
        float d = f16_at(b), dmin = f16_at(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *qs = wk == CPU_WEIGHT_Q4_K ? b + 16 : b + 48;
        for (int j = 0; j < 8; j++) {
            uint8_t s, m;
            dtype_kq_scale_min(sc, j, &s, &m);
            sc16[2 * j] = sc16[2 * j + 1] = d * (float)s;
            mn32[j] = -(dmin * (float)m);
            int g = j / 2, hi = j & 1;
            for (int l = 0; l < 32; l++) {
                int v = hi ? qs[g * 32 + l] >> 4 : qs[g * 32 + l] & 0xf;
                if (wk == CPU_WEIGHT_Q5_K && (qh[l] >> j) & 1) v += 16;
                q[j * 32 + l] = (int16_t)v;
            }
        }
    } else if (wk == CPU_WEIGHT_Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = f16_at(b + 208);
        for (int n = 0; n < 2; n++) {
            int16_t *y = q + n * 128;
            const uint8_t *L = b + n * 64, *H = b + 128 + n * 32;
            for (int l = 0; l < 32; l++) {
                y[l] = (int16_t)(((L[l] & 0xf) | (((H[l] >> 0) & 3) << 4)) - 32);
                y[l + 32] = (int16_t)(((L[l + 32] & 0xf) | (((H[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (int16_t)(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (int16_t)(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int g = 0; g < 16; g++)
            sc16[g] = d * (float)sc[g];
        for (int j = 0; j < 8; j++)
            mn32[j] = 0.0f;
    } else { // Q8_K
        float d;
        memcpy(&d, b, 4);
        for (int l = 0; l < 256; l++)
            q[l] = (int8_t)b[4 + l];
        for (int g = 0; g < 16; g++)
            sc16[g] = d;
        for (int j = 0; j < 8; j++)
            mn32[j] = 0.0f;
    }
}

// One (x row, weight row) pair over K-quant super-blocks: per 32-element sub-block b,
// acc += xd_b * (sc16[2b] * dot(first 16) + sc16[2b + 1] * dot(last 16)) + mn32[b] * xs_b.
static float kq_dot_generic(int wk, const uint8_t *wr, size_t bb, const struct cpu_xq_block *xr, int64_t nsb) {
    int16_t q[256];
    float sc16[16], mn32[8], acc = 0.0f;
    for (int64_t s = 0; s < nsb; s++) {
        kq_unpack(wk, wr + (size_t)s * bb, q, sc16, mn32);
        for (int b = 0; b < 8; b++) {
            const struct cpu_xq_block *x = xr + s * 8 + b;
            int lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) {
                lo += q[b * 32 + l] * x->q[l];
                hi += q[b * 32 + 16 + l] * x->q[16 + l];
            }
            acc += x->d * (sc16[2 * b] * (float)lo + sc16[2 * b + 1] * (float)hi) + mn32[b] * x->s;
        }
    }
    return acc;
}

#define GEMV_XQ_GENERIC_K(SUFFIX, WK, DT)                                                                              \
    static void gemv_xq_generic_##SUFFIX(float *out, int64_t os, const struct cpu_xq_block *xq, int64_t xqs, int nx,   \
                                         const void *wv, const float *bias, int64_t k, int64_t ws, int64_t j0,         \
                                         int64_t j1) {                                                                 \
        const uint8_t *w = wv;                                                                                         \
        const size_t bb = dtype_block_bytes(DT), rb = (size_t)(ws / 256) * bb;                                         \
        for (int64_t j = j0; j < j1; j++)                                                                              \
            for (int i = 0; i < nx; i++) {                                                                             \
                float v = kq_dot_generic(WK, w + (size_t)j * rb, bb, xq + i * xqs, k / 256);                           \
                out[i * os + j] = bias ? v + bias[j] : v;                                                              \
            }                                                                                                          \
    }
GEMV_XQ_GENERIC_K(q4_k, CPU_WEIGHT_Q4_K, DTYPE_Q4_K)
GEMV_XQ_GENERIC_K(q5_k, CPU_WEIGHT_Q5_K, DTYPE_Q5_K)
GEMV_XQ_GENERIC_K(q6_k, CPU_WEIGHT_Q6_K, DTYPE_Q6_K)
GEMV_XQ_GENERIC_K(q8_k, CPU_WEIGHT_Q8_K, DTYPE_Q8_K)

void cpu_kernels_xq_generic(struct cpu_kernels *k) {
    k->quantize_xq = quantize_xq_generic;
    k->gemv_xq[CPU_WEIGHT_Q8_0] = gemv_xq_generic_q8_0;
    k->gemv_xq[CPU_WEIGHT_Q4_0] = gemv_xq_generic_q4_0;
    k->gemv_xq[CPU_WEIGHT_Q4_1] = gemv_xq_generic_q4_1;
    k->gemv_xq[CPU_WEIGHT_Q4_K] = gemv_xq_generic_q4_k;
    k->gemv_xq[CPU_WEIGHT_Q5_K] = gemv_xq_generic_q5_k;
    k->gemv_xq[CPU_WEIGHT_Q6_K] = gemv_xq_generic_q6_k;
    k->gemv_xq[CPU_WEIGHT_Q8_K] = gemv_xq_generic_q8_k;
}

// ---------------------------------------------------------------------------------------------
// AVX2

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define XQ_AVX2_FN __attribute__((target("avx2,fma,f16c")))

XQ_AVX2_FN static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

XQ_AVX2_FN static inline float f16_at_avx2(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// Two adjacent f16 (a Q4_1 block's d and m) in one conversion.
XQ_AVX2_FN static inline void f16x2_at_avx2(const uint8_t *p, float *a, float *b) {
    uint32_t u;
    memcpy(&u, p, 4);
    __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
    *a = _mm_cvtss_f32(v);
    *b = _mm_cvtss_f32(_mm_movehdup_ps(v));
}

XQ_AVX2_FN static void quantize_xq_avx2(struct cpu_xq_block *dst, const float *x, int64_t k) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
               v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        float amax = _mm_cvtss_f32(h);
        float d = amax / XQ_MAX, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), rnd));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), rnd));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), rnd));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), rnd));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        // int32 -> int16 in element order: packs works within 128-bit lanes, the permute restores it.
        __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);
        __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xd8);
        _mm256_storeu_si256((__m256i *)dst[b].q, p0);
        _mm256_storeu_si256((__m256i *)(dst[b].q + 16), p1);
        dst[b].d = d;
        dst[b].s = d * (float)_mm_cvtsi128_si32(s4);
    }
}

// A 32-element weight block as two 16 x int16 halves (elements 0-15, 16-31) + scale and offset.
#define W16_Q8_0(wb, lo, hi, wd, wm)                                                                                   \
    __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((wb) + 2)));                                   \
    __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((wb) + 18)));                                  \
    float wd = f16_at_avx2(wb), wm = 0.0f;                                                                             \
    (void)wm
#define W16_NIBBLES(qs, lo, hi)                                                                                        \
    __m128i q_##lo = _mm_loadu_si128((const __m128i *)(qs));                                                           \
    __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(q_##lo, _mm_set1_epi8(0x0f)));                                     \
    __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q_##lo, 4), _mm_set1_epi8(0x0f)))
#define W16_Q4_0(wb, lo, hi, wd, wm)                                                                                   \
    W16_NIBBLES((wb) + 2, lo, hi);                                                                                     \
    float wd = f16_at_avx2(wb), wm = -8.0f * wd
#define W16_Q4_1(wb, lo, hi, wd, wm)                                                                                   \
    W16_NIBBLES((wb) + 4, lo, hi);                                                                                     \
    float wd, wm;                                                                                                      \
    f16x2_at_avx2(wb, &wd, &wm)

// int32 dot of a weight block (two int16 halves) with an activation block, in 8 lanes.
XQ_AVX2_FN static inline __m256i dot16(__m256i lo, __m256i hi, const struct cpu_xq_block *x) {
    __m256i a = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x->q));
    __m256i b = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x->q + 16)));
    return _mm256_add_epi32(a, b);
}

#define XSTEP(acc, accm, lo, hi, wd, wm, xb)                                                                           \
    do {                                                                                                               \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(lo, hi, xb)), _mm256_set1_ps((wd) * (xb)->d), acc);             \
        accm += (wm) * (xb)->s;                                                                                        \
    } while (0)

#define GEMV_XQ_AVX2(SUFFIX, BB, W16)                                                                                  \
    XQ_AVX2_FN static void gemv_xq_avx2_##SUFFIX(float *out, int64_t os, const struct cpu_xq_block *xq, int64_t xqs,   \
                                                 int nx, const void *wv_, const float *bias, int64_t k, int64_t ws,    \
                                                 int64_t j0, int64_t j1) {                                             \
        const uint8_t *w = wv_;                                                                                        \
        const size_t rb = (size_t)(ws / 32) * (BB);                                                                    \
        const int64_t nb = k / 32;                                                                                     \
        int i = 0;                                                                                                     \
        for (; i + 4 <= nx; i += 4) { /* four x rows share each unpacked weight block */                               \
            const struct cpu_xq_block *x0 = xq + i * xqs, *x1 = x0 + xqs, *x2 = x1 + xqs, *x3 = x2 + xqs;              \
            for (int64_t j = j0; j < j1; j++) {                                                                        \
                const uint8_t *wr = w + (size_t)j * rb;                                                                \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                            \
                float m0 = 0.0f, m1 = 0.0f, m2 = 0.0f, m3 = 0.0f;                                                      \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    W16(wr + b * (BB), lo, hi, wd, wm);                                                                \
                    XSTEP(a0, m0, lo, hi, wd, wm, x0 + b);                                                             \
                    XSTEP(a1, m1, lo, hi, wd, wm, x1 + b);                                                             \
                    XSTEP(a2, m2, lo, hi, wd, wm, x2 + b);                                                             \
                    XSTEP(a3, m3, lo, hi, wd, wm, x3 + b);                                                             \
                }                                                                                                      \
                float bj = bias ? bias[j] : 0.0f;                                                                      \
                out[i * os + j] = hsum8(a0) + m0 + bj;                                                                 \
                out[(i + 1) * os + j] = hsum8(a1) + m1 + bj;                                                           \
                out[(i + 2) * os + j] = hsum8(a2) + m2 + bj;                                                           \
                out[(i + 3) * os + j] = hsum8(a3) + m3 + bj;                                                           \
            }                                                                                                          \
        }                                                                                                              \
        for (; i < nx; i++) { /* one x row: two weight rows at a time for independent chains */                        \
            const struct cpu_xq_block *x0 = xq + i * xqs;                                                              \
            int64_t j = j0;                                                                                            \
            for (; j + 2 <= j1; j += 2) {                                                                              \
                const uint8_t *r0 = w + (size_t)j * rb, *r1 = r0 + rb;                                                 \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                                              \
                float m0 = 0.0f, m1 = 0.0f;                                                                            \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    W16(r0 + b * (BB), lo0, hi0, wd0, wm0);                                                            \
                    W16(r1 + b * (BB), lo1, hi1, wd1, wm1);                                                            \
                    XSTEP(a0, m0, lo0, hi0, wd0, wm0, x0 + b);                                                         \
                    XSTEP(a1, m1, lo1, hi1, wd1, wm1, x0 + b);                                                         \
                }                                                                                                      \
                out[i * os + j] = hsum8(a0) + m0 + (bias ? bias[j] : 0.0f);                                            \
                out[i * os + j + 1] = hsum8(a1) + m1 + (bias ? bias[j + 1] : 0.0f);                                    \
            }                                                                                                          \
            for (; j < j1; j++) {                                                                                      \
                const uint8_t *r0 = w + (size_t)j * rb;                                                                \
                __m256 a0 = _mm256_setzero_ps();                                                                       \
                float m0 = 0.0f;                                                                                       \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    W16(r0 + b * (BB), lo0, hi0, wd0, wm0);                                                            \
                    XSTEP(a0, m0, lo0, hi0, wd0, wm0, x0 + b);                                                         \
                }                                                                                                      \
                out[i * os + j] = hsum8(a0) + m0 + (bias ? bias[j] : 0.0f);                                            \
            }                                                                                                          \
        }                                                                                                              \
    }

GEMV_XQ_AVX2(q8_0, 34, W16_Q8_0)
GEMV_XQ_AVX2(q4_0, 18, W16_Q4_0)
GEMV_XQ_AVX2(q4_1, 20, W16_Q4_1)

// kq_unpack with the quants widened in AVX2 (the scales stay scalar: 8 or 16 per 256 weights).
XQ_AVX2_FN static void kq_unpack_avx2(int wk, const uint8_t *b, int16_t *q, float *sc16, float *mn32) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
#define STORE32(dst, v8)                                                                                               \
    do {                                                                                                               \
        _mm256_store_si256((__m256i *)(dst), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v8)));                        \
        _mm256_store_si256((__m256i *)((dst) + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v8, 1)));            \
    } while (0)
    if (wk == CPU_WEIGHT_Q4_K || wk == CPU_WEIGHT_Q5_K) {
        float d = f16_at_avx2(b), dmin = f16_at_avx2(b + 2);
        const uint8_t *sc = b + 4, *qs = wk == CPU_WEIGHT_Q4_K ? b + 16 : b + 48;
        __m256i h = wk == CPU_WEIGHT_Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            uint8_t sj, mj;
            dtype_kq_scale_min(sc, j, &sj, &mj);
            sc16[2 * j] = sc16[2 * j + 1] = d * (float)sj;
            mn32[j] = -(dmin * (float)mj);
        }
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + g * 32));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (wk == CPU_WEIGHT_Q5_K) { // bit 2g (low half) / 2g + 1 (high half) of each qh byte -> +16
                const __m256i one = _mm256_set1_epi8(1);
                __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g), one);
                __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g + 1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
            }
            STORE32(q + (2 * g) * 32, lo);
            STORE32(q + (2 * g + 1) * 32, hi);
        }
    } else if (wk == CPU_WEIGHT_Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = f16_at_avx2(b + 208);
        const __m256i m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        for (int n = 0; n < 2; n++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + n * 64));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + n * 64 + 32));
            __m256i hv = _mm256_loadu_si256((const __m256i *)(b + 128 + n * 32));
            __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hv, m3), 4);
            __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2), m3), 4);
            __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 4), m3), 4);
            __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 6), m3), 4);
            __m256i q0 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m4), h0), off);
            __m256i q1 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m4), h1), off);
            __m256i q2 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), h2), off);
            __m256i q3 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h3), off);
            STORE32(q + n * 128, q0);
            STORE32(q + n * 128 + 32, q1);
            STORE32(q + n * 128 + 64, q2);
            STORE32(q + n * 128 + 96, q3);
        }
        for (int g = 0; g < 16; g++)
            sc16[g] = d * (float)sc[g];
        for (int j = 0; j < 8; j++)
            mn32[j] = 0.0f;
    } else { // Q8_K
        float d;
        memcpy(&d, b, 4);
        for (int g = 0; g < 8; g++)
            STORE32(q + g * 32, _mm256_loadu_si256((const __m256i *)(b + 4 + g * 32)));
        for (int g = 0; g < 16; g++)
            sc16[g] = d;
        for (int j = 0; j < 8; j++)
            mn32[j] = 0.0f;
    }
#undef STORE32
}

// K-quants: each super-block is unpacked once (kq_unpack_avx2 into int16 + scales; shared by
// every x row of the call), then the dots run in AVX2: per sub-block of 32, the two halves'
// int32 dots are scaled by their own sc16 (Q6_K's scales are per 16) and accumulated in 8 lanes.
XQ_AVX2_FN static void gemv_xq_avx2_k(int wk, size_t bb, float *out, int64_t os, const struct cpu_xq_block *xq,
                                      int64_t xqs, int nx, const uint8_t *w, const float *bias, int64_t k, int64_t ws,
                                      int64_t j0, int64_t j1) {
    const size_t rb = (size_t)(ws / 256) * bb;
    const int64_t nsb = k / 256;
    int16_t q[256] __attribute__((aligned(32)));
    float sc16[16], mn32[8];
    for (int64_t j = j0; j < j1; j++)
        for (int i0 = 0; i0 < nx; i0 += 8) {
            int ni = nx - i0 < 8 ? nx - i0 : 8;
            __m256 acc[8];
            float accm[8];
            for (int i = 0; i < ni; i++) {
                acc[i] = _mm256_setzero_ps();
                accm[i] = 0.0f;
            }
            for (int64_t s = 0; s < nsb; s++) {
                kq_unpack_avx2(wk, w + (size_t)j * rb + (size_t)s * bb, q, sc16, mn32);
                for (int b = 0; b < 8; b++) {
                    __m256i lo = _mm256_load_si256((const __m256i *)(q + b * 32));
                    __m256i hi = _mm256_load_si256((const __m256i *)(q + b * 32 + 16));
                    // madd pairs stay within each half of 16: each half gets its own sc16.
                    for (int i = 0; i < ni; i++) {
                        const struct cpu_xq_block *x = xq + (i0 + i) * xqs + s * 8 + b;
                        __m256i dl = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x->q));
                        __m256i dh = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x->q + 16)));
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), _mm256_set1_ps(sc16[2 * b] * x->d), acc[i]);
                        acc[i] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_set1_ps(sc16[2 * b + 1] * x->d), acc[i]);
                        accm[i] += mn32[b] * x->s;
                    }
                }
            }
            for (int i = 0; i < ni; i++)
                out[(i0 + i) * os + j] = hsum8(acc[i]) + accm[i] + (bias ? bias[j] : 0.0f);
        }
}

#define GEMV_XQ_AVX2_K(SUFFIX, WK, DT)                                                                                 \
    XQ_AVX2_FN static void gemv_xq_avx2_##SUFFIX(float *out, int64_t os, const struct cpu_xq_block *xq, int64_t xqs,   \
                                                 int nx, const void *w, const float *bias, int64_t k, int64_t ws,      \
                                                 int64_t j0, int64_t j1) {                                             \
        gemv_xq_avx2_k(WK, dtype_block_bytes(DT), out, os, xq, xqs, nx, w, bias, k, ws, j0, j1);                       \
    }
GEMV_XQ_AVX2_K(q4_k, CPU_WEIGHT_Q4_K, DTYPE_Q4_K)
GEMV_XQ_AVX2_K(q5_k, CPU_WEIGHT_Q5_K, DTYPE_Q5_K)
GEMV_XQ_AVX2_K(q6_k, CPU_WEIGHT_Q6_K, DTYPE_Q6_K)
GEMV_XQ_AVX2_K(q8_k, CPU_WEIGHT_Q8_K, DTYPE_Q8_K)

void cpu_kernels_xq_avx2(struct cpu_kernels *k) {
    k->quantize_xq = quantize_xq_avx2;
    k->gemv_xq[CPU_WEIGHT_Q8_0] = gemv_xq_avx2_q8_0;
    k->gemv_xq[CPU_WEIGHT_Q4_0] = gemv_xq_avx2_q4_0;
    k->gemv_xq[CPU_WEIGHT_Q4_1] = gemv_xq_avx2_q4_1;
    k->gemv_xq[CPU_WEIGHT_Q4_K] = gemv_xq_avx2_q4_k;
    k->gemv_xq[CPU_WEIGHT_Q5_K] = gemv_xq_avx2_q5_k;
    k->gemv_xq[CPU_WEIGHT_Q6_K] = gemv_xq_avx2_q6_k;
    k->gemv_xq[CPU_WEIGHT_Q8_K] = gemv_xq_avx2_q8_k;
}
// ---------------------------------------------------------------------------------------------
// AVX-512 (F + BW), the 32-element types: one weight block is one zmm of 32 int16 (a single
// vpmaddwd against the activation block), and the per-block scales are computed 16 blocks at a
// time (one gather of the blocks' f16 headers, one multiply with the activations' scales, kept in
// a small stack array that the per-block FMA broadcasts from). Per (x row, weight row) pair the
// blocks accumulate in order into two 16-lane sums (even and odd blocks) and the offset terms
// into one 16-lane sum over the 16-block chunks, whatever the number of x rows or the column
// range of the call; rows with more than XQ512_MAX_NB blocks use the AVX2 kernels (a per-shape
// choice, so the invariance holds too).
#define XQ_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define XQ512_MAX_NB 1024 // blocks per row (k <= 32768)
#ifndef XQ512_PREFETCH
#define XQ512_PREFETCH 4096
#endif
#ifndef XQ512_HINT
#define XQ512_HINT _MM_HINT_T0
#endif

XQ_AVX512_FN static inline __m512i w512_nibbles(const uint8_t *qs) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    b = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
    return _mm512_cvtepu8_epi16(b);
}

// Block b's 32 quants as int16 (elements 0-31 in order).
#define W512_Q8_0(wb) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((wb) + 2)))
#define W512_Q4_0(wb) w512_nibbles((wb) + 2)
#define W512_Q4_1(wb) w512_nibbles((wb) + 4)
// The blocks' offsets from their gathered headers (low 16 bits: d as f16, high: Q4_1's m).
#define WM512_Q8_0(hdr, wd) _mm512_setzero_ps()
#define WM512_Q4_0(hdr, wd) _mm512_mul_ps(wd, _mm512_set1_ps(-8.0f))
#define WM512_Q4_1(hdr, wd) _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hdr, 16)))

// acc += cvt(dot(weight block, x block)) * sc (int32 lanes: pairs of elements).
#define X512STEP(acc, wq, xb, sc)                                                                                      \
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wq, _mm512_loadu_si512((const void *)(xb)->q))),       \
                          _mm512_set1_ps(sc), acc)

// One weight row against NI (1-4, a constant) x rows whose scales are in xd / xs (XQ512_MAX_NB
// apart, zero beyond nb up to a multiple of 16).
#define GEMV_XQ_AVX512_ROW(SUFFIX, BB, W512, WM512)                                                                    \
    XQ_AVX512_FN __attribute__((always_inline)) static inline void xq512_row_##SUFFIX(                                 \
        float *res, const uint8_t *wr, const struct cpu_xq_block *x0, int64_t xqs, const float *xd, const float *xs,   \
        int64_t nb, const int NI) {                                                                                    \
        __m512 a0[4], a1[4], mv[4];                                                                                    \
        _Pragma("GCC unroll 4") for (int i = 0; i < NI; i++) a0[i] = a1[i] = mv[i] = _mm512_setzero_ps();             \
        const __m512i idx = _mm512_mullo_epi32(                                                                        \
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(BB));           \
        float sc[4][16] __attribute__((aligned(64)));                                                                  \
        for (int64_t c = 0; c < nb; c += 16) {                                                                         \
            const int nc = nb - c < 16 ? (int)(nb - c) : 16;                                                           \
            const __mmask16 mk = (__mmask16)(nc == 16 ? 0xffffu : (1u << nc) - 1u);                                    \
            const uint8_t *wc = wr + (size_t)c * (BB);                                                                 \
            for (int p = 0; p < 16 * (BB); p += 64)                                                                    \
                _mm_prefetch((const char *)wc + XQ512_PREFETCH + p, XQ512_HINT);                                        \
            __m512i hdr = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, idx, wc, 1);                         \
            __m512 wd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));                                                   \
            __m512 wm = WM512(hdr, wd);                                                                                \
            (void)wm;                                                                                                  \
            _Pragma("GCC unroll 4") for (int i = 0; i < NI; i++) {                                                     \
                _mm512_store_ps(sc[i], _mm512_mul_ps(wd, _mm512_loadu_ps(xd + i * XQ512_MAX_NB + c)));                 \
                mv[i] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(xs + i * XQ512_MAX_NB + c), mv[i]);                        \
            }                                                                                                          \
            int b = 0;                                                                                                 \
            for (; b + 2 <= nc; b += 2) {                                                                              \
                __m512i q0 = W512(wc + (size_t)b * (BB)), q1 = W512(wc + (size_t)(b + 1) * (BB));                      \
                _Pragma("GCC unroll 4") for (int i = 0; i < NI; i++) {                                                 \
                    const struct cpu_xq_block *xb = x0 + i * xqs + c + b;                                              \
                    X512STEP(a0[i], q0, xb, sc[i][b]);                                                                 \
                    X512STEP(a1[i], q1, xb + 1, sc[i][b + 1]);                                                         \
                }                                                                                                      \
            }                                                                                                          \
            if (b < nc) {                                                                                              \
                __m512i q0 = W512(wc + (size_t)b * (BB));                                                              \
                _Pragma("GCC unroll 4") for (int i = 0; i < NI; i++) X512STEP(a0[i], q0, x0 + i * xqs + c + b,         \
                                                                             sc[i][b]);                                \
            }                                                                                                          \
        }                                                                                                              \
        _Pragma("GCC unroll 4") for (int i = 0; i < NI; i++) res[i] =                                                  \
            _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i])) + _mm512_reduce_add_ps(mv[i]);                           \
    }

#define GEMV_XQ_AVX512(SUFFIX, BB, W512, WM512)                                                                        \
    GEMV_XQ_AVX512_ROW(SUFFIX, BB, W512, WM512)                                                                        \
    XQ_AVX512_FN static void gemv_xq_avx512_##SUFFIX(float *out, int64_t os, const struct cpu_xq_block *xq,            \
                                                     int64_t xqs, int nx, const void *wv_, const float *bias,          \
                                                     int64_t k, int64_t ws, int64_t j0, int64_t j1) {                  \
        const uint8_t *w = wv_;                                                                                        \
        const size_t rb = (size_t)(ws / 32) * (BB);                                                                    \
        const int64_t nb = k / 32, nbp = (nb + 15) / 16 * 16;                                                          \
        if (nb > XQ512_MAX_NB) {                                                                                       \
            gemv_xq_avx2_##SUFFIX(out, os, xq, xqs, nx, wv_, bias, k, ws, j0, j1);                                     \
            return;                                                                                                    \
        }                                                                                                              \
        float xd[4 * XQ512_MAX_NB] __attribute__((aligned(64))), xs[4 * XQ512_MAX_NB] __attribute__((aligned(64)));  \
        for (int i0 = 0; i0 < nx; i0 += 4) {                                                                           \
            const int ni = nx - i0 < 4 ? nx - i0 : 4;                                                                  \
            const struct cpu_xq_block *x0 = xq + (int64_t)i0 * xqs;                                                    \
            for (int i = 0; i < ni; i++)                                                                               \
                for (int64_t b = 0; b < nbp; b++) {                                                                    \
                    xd[i * XQ512_MAX_NB + b] = b < nb ? x0[i * xqs + b].d : 0.0f;                                      \
                    xs[i * XQ512_MAX_NB + b] = b < nb ? x0[i * xqs + b].s : 0.0f;                                      \
                }                                                                                                      \
            for (int64_t j = j0; j < j1; j++) {                                                                        \
                float r[4];                                                                                            \
                const uint8_t *wr = w + (size_t)j * rb;                                                                \
                switch (ni) {                                                                                          \
                case 1: xq512_row_##SUFFIX(r, wr, x0, xqs, xd, xs, nb, 1); break;                                     \
                case 2: xq512_row_##SUFFIX(r, wr, x0, xqs, xd, xs, nb, 2); break;                                     \
                case 3: xq512_row_##SUFFIX(r, wr, x0, xqs, xd, xs, nb, 3); break;                                     \
                default: xq512_row_##SUFFIX(r, wr, x0, xqs, xd, xs, nb, 4); break;                                    \
                }                                                                                                      \
                const float bj = bias ? bias[j] : 0.0f;                                                                \
                for (int i = 0; i < ni; i++)                                                                           \
                    out[(i0 + i) * os + j] = r[i] + bj;                                                                \
            }                                                                                                          \
        }                                                                                                              \
    }

GEMV_XQ_AVX512(q8_0, 34, W512_Q8_0, WM512_Q8_0)
GEMV_XQ_AVX512(q4_0, 18, W512_Q4_0, WM512_Q4_0)
GEMV_XQ_AVX512(q4_1, 20, W512_Q4_1, WM512_Q4_1)

void cpu_kernels_xq_avx512(struct cpu_kernels *k) {
    cpu_kernels_xq_avx2(k);
    k->gemv_xq[CPU_WEIGHT_Q8_0] = gemv_xq_avx512_q8_0;
    k->gemv_xq[CPU_WEIGHT_Q4_0] = gemv_xq_avx512_q4_0;
    k->gemv_xq[CPU_WEIGHT_Q4_1] = gemv_xq_avx512_q4_1;
}
#endif
