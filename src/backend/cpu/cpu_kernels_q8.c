// Integer dot products of the quantised-weight decode path (cpu_kernels.h: quantize_q8,
// gemv_q8): activations quantised per block of 32 to int8 (llama.cpp's q8_0 / q8_1 activation
// scheme, with an F32 scale), weights in their GGUF block type, one int32 dot product per block
// scaled by (weight scale x activation scale) in fp32.
//
// Not bit-identical to the F32 path (the activations are rounded): per block b the rounding of
// x is at most d_x,b / 2 = max|x_b| / 254 per element, so an output differs from the exact dot
// product of the dequantised weights with x by at most sum_b max|x_b| / 254 * sum_{i in b} |w_i|
// (plus fp32 rounding); tests/test_cpu_quant_ops.c checks every kernel against that bound.
//
// Portable versions (the specification) and AVX2 versions (maddubs / madd over 32 bytes, chosen
// at run time with the rest of cpu_kernels). For one (x row, weight row) pair both accumulate the
// blocks in order into one 8-lane (AVX2) or scalar (portable) sum, so an output does not depend
// on which other rows or columns a call computes (thread count, batch size up to 8).
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// d = max|x| / 127, q = x / d rounded to nearest even (lrintf in the default rounding mode; the
// AVX2 version rounds the same way), s = d * sum(q).
static void quantize_q8_generic(struct cpu_q8_block *dst, const float *x, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(xb[i]));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)lrintf(xb[i] * id);
            dst[b].q[i] = (int8_t)q;
            sum += q;
        }
        dst[b].d = d;
        dst[b].s = d * (float)sum;
    }
}

// Integer dot of one weight block with one activation block; *m_term receives the Q4_1 offset
// term (weight min x activation sum), 0 for the symmetric types.
static inline int qdot_block_generic(int wk, const uint8_t *wb, const int8_t *xq, float *wd, float *wm) {
    int dot = 0;
    switch (wk) {
    case CPU_WEIGHT_Q8_0:
        *wd = f16_at(wb);
        *wm = 0.0f;
        for (int i = 0; i < 32; i++)
            dot += (int)(int8_t)wb[2 + i] * xq[i];
        return dot;
    case CPU_WEIGHT_Q4_0:
        *wd = f16_at(wb);
        *wm = 0.0f;
        for (int i = 0; i < 16; i++)
            dot += ((wb[2 + i] & 0xf) - 8) * xq[i] + ((wb[2 + i] >> 4) - 8) * xq[i + 16];
        return dot;
    default: // Q4_1
        *wd = f16_at(wb);
        *wm = f16_at(wb + 2);
        for (int i = 0; i < 16; i++)
            dot += (wb[4 + i] & 0xf) * xq[i] + (wb[4 + i] >> 4) * xq[i + 16];
        return dot;
    }
}

#define GEMV_Q8_GENERIC(SUFFIX, WK)                                                                                    \
    static void gemv_q8_generic_##SUFFIX(float *out, int64_t os, const struct cpu_q8_block *xq, int64_t xqs, int nx,   \
                                         const void *wv, const float *bias, int64_t k, int64_t ws, int64_t j0,         \
                                         int64_t j1) {                                                                 \
        const uint8_t *w = wv;                                                                                         \
        const size_t bb = dtype_block_bytes(WK == CPU_WEIGHT_Q8_0 ? DTYPE_Q8_0                                         \
                                            : WK == CPU_WEIGHT_Q4_0 ? DTYPE_Q4_0                                       \
                                                                    : DTYPE_Q4_1);                                     \
        const size_t rb = (size_t)(ws / 32) * bb;                                                                      \
        const int64_t nb = k / 32;                                                                                     \
        for (int64_t j = j0; j < j1; j++)                                                                              \
            for (int i = 0; i < nx; i++) {                                                                             \
                const struct cpu_q8_block *xr = xq + i * xqs;                                                          \
                float acc = 0.0f, accm = 0.0f;                                                                         \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    float wd, wm;                                                                                      \
                    int dot = qdot_block_generic(WK, w + (size_t)j * rb + (size_t)b * bb, xr[b].q, &wd, &wm);          \
                    acc += wd * xr[b].d * (float)dot;                                                                  \
                    accm += wm * xr[b].s;                                                                              \
                }                                                                                                      \
                float v = acc + accm;                                                                                  \
                out[i * os + j] = bias ? v + bias[j] : v;                                                              \
            }                                                                                                          \
    }
GEMV_Q8_GENERIC(q8_0, CPU_WEIGHT_Q8_0)
GEMV_Q8_GENERIC(q4_0, CPU_WEIGHT_Q4_0)
GEMV_Q8_GENERIC(q4_1, CPU_WEIGHT_Q4_1)

void cpu_kernels_q8_generic(struct cpu_kernels *k) {
    k->quantize_q8 = quantize_q8_generic;
    k->gemv_q8[CPU_WEIGHT_Q8_0] = gemv_q8_generic_q8_0;
    k->gemv_q8[CPU_WEIGHT_Q4_0] = gemv_q8_generic_q4_0;
    k->gemv_q8[CPU_WEIGHT_Q4_1] = gemv_q8_generic_q4_1;
}

// ---------------------------------------------------------------------------------------------
// AVX2

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define Q8_AVX2_FN __attribute__((target("avx2,fma,f16c")))

Q8_AVX2_FN static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

Q8_AVX2_FN static inline float f16_at_avx2(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

Q8_AVX2_FN static void quantize_q8_avx2(struct cpu_q8_block *dst, const float *x, int64_t k) {
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
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
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
        // int32 -> int8 in element order: packs work within 128-bit lanes, the permute restores it.
        __m256i p16a = _mm256_packs_epi32(i0, i1), p16b = _mm256_packs_epi32(i2, i3);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)dst[b].q, p8);
        dst[b].d = d;
        dst[b].s = d * (float)_mm_cvtsi128_si32(s4);
    }
}

// Weight block -> 32 int8 in element order. Q4_0: nibble - 8 (signed); Q4_1: nibble (0..15).
Q8_AVX2_FN static inline __m256i w32_q4(const uint8_t *qs) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
    return _mm256_set_m128i(hi, lo);
}

// Signed x signed int8 dot in 8 int32 lanes (|w| <= 128, |x| <= 127: the pair sums fit int16).
Q8_AVX2_FN static inline __m256i dot_ss(__m256i w, __m256i x) {
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
// Unsigned (0..15) x signed int8 dot in 8 int32 lanes.
Q8_AVX2_FN static inline __m256i dot_us(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// WLOAD(wb, wv, wd, wm): the block at wb as 32 int8 in wv, its scale in wd, its min in wm.
#define WLOAD_Q8_0(wb, wv, wd, wm)                                                                                     \
    __m256i wv = _mm256_loadu_si256((const __m256i *)((wb) + 2));                                                      \
    float wd = f16_at_avx2(wb), wm = 0.0f;                                                                             \
    (void)wm
#define WLOAD_Q4_0(wb, wv, wd, wm)                                                                                     \
    __m256i wv = _mm256_sub_epi8(w32_q4((wb) + 2), _mm256_set1_epi8(8));                                               \
    float wd = f16_at_avx2(wb), wm = 0.0f;                                                                             \
    (void)wm
#define WLOAD_Q4_1(wb, wv, wd, wm)                                                                                     \
    __m256i wv = w32_q4((wb) + 4);                                                                                     \
    float wd = f16_at_avx2(wb), wm = f16_at_avx2((wb) + 2)

// One (x row, weight row) step over block b: acc += cvt(dot) * (wd * xd); accm += wm * xs.
#define QSTEP(DOT, acc, accm, wv, wd, wm, xb)                                                                          \
    do {                                                                                                               \
        __m256i xv_ = _mm256_loadu_si256((const __m256i *)(xb)->q);                                                    \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(wv, xv_)), _mm256_set1_ps((wd) * (xb)->d), acc);                  \
        accm += (wm) * (xb)->s;                                                                                        \
    } while (0)

#define GEMV_Q8_AVX2(SUFFIX, BB, WLOAD, DOT)                                                                           \
    Q8_AVX2_FN static void gemv_q8_avx2_##SUFFIX(float *out, int64_t os, const struct cpu_q8_block *xq, int64_t xqs,   \
                                                 int nx, const void *wv_, const float *bias, int64_t k, int64_t ws,    \
                                                 int64_t j0, int64_t j1) {                                             \
        const uint8_t *w = wv_;                                                                                        \
        const size_t rb = (size_t)(ws / 32) * (BB);                                                                    \
        const int64_t nb = k / 32;                                                                                     \
        int i = 0;                                                                                                     \
        for (; i + 4 <= nx; i += 4) { /* four x rows share each unpacked weight block */                               \
            const struct cpu_q8_block *x0 = xq + i * xqs, *x1 = x0 + xqs, *x2 = x1 + xqs, *x3 = x2 + xqs;              \
            for (int64_t j = j0; j < j1; j++) {                                                                        \
                const uint8_t *wr = w + (size_t)j * rb;                                                                \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                            \
                float m0 = 0.0f, m1 = 0.0f, m2 = 0.0f, m3 = 0.0f;                                                      \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    WLOAD(wr + b * (BB), wv, wd, wm);                                                                  \
                    QSTEP(DOT, a0, m0, wv, wd, wm, x0 + b);                                                            \
                    QSTEP(DOT, a1, m1, wv, wd, wm, x1 + b);                                                            \
                    QSTEP(DOT, a2, m2, wv, wd, wm, x2 + b);                                                            \
                    QSTEP(DOT, a3, m3, wv, wd, wm, x3 + b);                                                            \
                }                                                                                                      \
                float bj = bias ? bias[j] : 0.0f;                                                                      \
                out[i * os + j] = hsum8(a0) + m0 + bj;                                                                 \
                out[(i + 1) * os + j] = hsum8(a1) + m1 + bj;                                                           \
                out[(i + 2) * os + j] = hsum8(a2) + m2 + bj;                                                           \
                out[(i + 3) * os + j] = hsum8(a3) + m3 + bj;                                                           \
            }                                                                                                          \
        }                                                                                                              \
        for (; i < nx; i++) { /* one x row: two weight rows at a time for independent chains */                       \
            const struct cpu_q8_block *x0 = xq + i * xqs;                                                              \
            int64_t j = j0;                                                                                            \
            for (; j + 2 <= j1; j += 2) {                                                                              \
                const uint8_t *r0 = w + (size_t)j * rb, *r1 = r0 + rb;                                                 \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                                              \
                float m0 = 0.0f, m1 = 0.0f;                                                                            \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    WLOAD(r0 + b * (BB), wv0, wd0, wm0);                                                               \
                    WLOAD(r1 + b * (BB), wv1, wd1, wm1);                                                               \
                    QSTEP(DOT, a0, m0, wv0, wd0, wm0, x0 + b);                                                         \
                    QSTEP(DOT, a1, m1, wv1, wd1, wm1, x0 + b);                                                         \
                }                                                                                                      \
                out[i * os + j] = hsum8(a0) + m0 + (bias ? bias[j] : 0.0f);                                            \
                out[i * os + j + 1] = hsum8(a1) + m1 + (bias ? bias[j + 1] : 0.0f);                                    \
            }                                                                                                          \
            for (; j < j1; j++) {                                                                                      \
                const uint8_t *r0 = w + (size_t)j * rb;                                                                \
                __m256 a0 = _mm256_setzero_ps();                                                                       \
                float m0 = 0.0f;                                                                                       \
                for (int64_t b = 0; b < nb; b++) {                                                                     \
                    WLOAD(r0 + b * (BB), wv0, wd0, wm0);                                                               \
                    QSTEP(DOT, a0, m0, wv0, wd0, wm0, x0 + b);                                                         \
                }                                                                                                      \
                out[i * os + j] = hsum8(a0) + m0 + (bias ? bias[j] : 0.0f);                                            \
            }                                                                                                          \
        }                                                                                                              \
    }

GEMV_Q8_AVX2(q8_0, 34, WLOAD_Q8_0, dot_ss)
GEMV_Q8_AVX2(q4_0, 18, WLOAD_Q4_0, dot_ss)
GEMV_Q8_AVX2(q4_1, 20, WLOAD_Q4_1, dot_us)

void cpu_kernels_q8_avx2(struct cpu_kernels *k) {
    k->quantize_q8 = quantize_q8_avx2;
    k->gemv_q8[CPU_WEIGHT_Q8_0] = gemv_q8_avx2_q8_0;
    k->gemv_q8[CPU_WEIGHT_Q4_0] = gemv_q8_avx2_q4_0;
    k->gemv_q8[CPU_WEIGHT_Q4_1] = gemv_q8_avx2_q4_1;
}
#endif
