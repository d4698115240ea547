#include "backend/cpu/cpu_kernels.h"

#include "core/dtype.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Portable versions (several accumulators so the compiler can overlap the adds).

static void axpy_generic(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] += a * x[i];
}

static void axpy_rows_generic(float *restrict y, const float *p, const float *restrict v, int64_t vs, int nt,
                              int64_t n) {
    for (int t = 0; t < nt; t++)
        axpy_generic(y, p[t], v + t * vs, n);
}

// axpy_rows over a 16-bit V read in place: each element widened exactly, then the same
// y[i] += p * v[i] as axpy_generic, t in order.
#define AXPY_ROWS16_GENERIC(SUFFIX, CVT)                                                                               \
    static void axpy_rows16_generic_##SUFFIX(float *y, int64_t ys, int nr, const float *p, int64_t ps,                \
                                             const uint16_t *v, int64_t vs, int nt, int64_t n) {                       \
        for (int r = 0; r < nr; r++)                                                                                   \
            for (int t = 0; t < nt; t++) {                                                                             \
                const float a = p[r * ps + t];                                                                         \
                const uint16_t *vr = v + t * vs;                                                                       \
                float *yr = y + r * ys;                                                                                \
                for (int64_t i = 0; i < n; i++)                                                                        \
                    yr[i] += a * CVT(vr[i]);                                                                           \
            }                                                                                                          \
    }
AXPY_ROWS16_GENERIC(bf16, bf16_to_f32)
AXPY_ROWS16_GENERIC(f16, f16_to_f32)

static float exp_sum_generic(float *y, int64_t n, float m) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        y[i] = expf(y[i] - m);
        s += y[i];
    }
    return s;
}

static void silu_mul_generic(float *restrict out, const float *g, const float *restrict u, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void scale_generic(float *y, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] *= a;
}

static void widen_generic_f32(float *dst, const void *src, int64_t n) {
    memcpy(dst, src, (size_t)n * 4);
}
static void widen_generic_bf16(float *dst, const void *src, int64_t n) {
    dtype_to_f32(DTYPE_BF16, src, dst, n);
}
static void widen_generic_f16(float *dst, const void *src, int64_t n) {
    dtype_to_f32(DTYPE_F16, src, dst, n);
}

// Weight element loaders of the portable skinny matmul, one per weight dtype.
static inline float wload_f32(const float *w, int64_t i) {
    return w[i];
}
static inline float wload_bf16(const uint16_t *w, int64_t i) {
    return bf16_to_f32(w[i]);
}
static inline float wload_f16(const uint16_t *w, int64_t i) {
    return f16_to_f32(w[i]);
}

#define GEMV_GENERIC(SUFFIX, WT, LOAD)                                                                                 \
    static void gemv_generic_##SUFFIX(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx,        \
                                      const void *wv, const float *bias, int64_t k, int64_t ws, int64_t j0,            \
                                      int64_t j1) {                                                                    \
        const WT *w = wv;                                                                                              \
        for (int64_t j = j0; j < j1; j++) {                                                                            \
            const WT *wr = w + j * ws;                                                                                 \
            for (int i = 0; i < nx; i++) {                                                                             \
                const float *xr = x + i * x_stride;                                                                    \
                float s[8] = {0};                                                                                      \
                int64_t t = 0;                                                                                         \
                for (; t + 8 <= k; t += 8)                                                                             \
                    for (int l = 0; l < 8; l++)                                                                        \
                        s[l] += xr[t + l] * LOAD(wr, t + l);                                                           \
                float v = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));                           \
                for (; t < k; t++)                                                                                     \
                    v += xr[t] * LOAD(wr, t);                                                                          \
                out[i * out_stride + j] = bias ? v + bias[j] : v;                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }
GEMV_GENERIC(f32, float, wload_f32)
GEMV_GENERIC(bf16, uint16_t, wload_bf16)
GEMV_GENERIC(f16, uint16_t, wload_f16)

// Quantised weights, portable: each 32-element block is dequantised with dtype_to_f32 into a
// stack buffer, then accumulated in the same lane order as GEMV_GENERIC (so the result equals
// the F32 path on dequantised weights).
#define GEMV_GENERIC_Q(SUFFIX, DT)                                                                                     \
    static void gemv_generic_##SUFFIX(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx,        \
                                      const void *wv, const float *bias, int64_t k, int64_t ws, int64_t j0,            \
                                      int64_t j1) {                                                                    \
        const uint8_t *w = wv;                                                                                         \
        const size_t bb = dtype_block_bytes(DT), rb = (size_t)(ws / 32) * bb;                                          \
        for (int64_t j = j0; j < j1; j++) {                                                                            \
            for (int i = 0; i < nx; i++) {                                                                             \
                const float *xr = x + i * x_stride;                                                                    \
                float s[8] = {0}, blk[32];                                                                             \
                for (int64_t t = 0; t < k; t += 32) {                                                                  \
                    dtype_to_f32(DT, w + (size_t)j * rb + (size_t)(t / 32) * bb, blk, 32);                             \
                    for (int q = 0; q < 32; q += 8)                                                                    \
                        for (int l = 0; l < 8; l++)                                                                    \
                            s[l] += xr[t + q + l] * blk[q + l];                                                        \
                }                                                                                                      \
                float v = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));                           \
                out[i * out_stride + j] = bias ? v + bias[j] : v;                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }
GEMV_GENERIC_Q(q8_0, DTYPE_Q8_0)
GEMV_GENERIC_Q(q4_0, DTYPE_Q4_0)
GEMV_GENERIC_Q(q4_1, DTYPE_Q4_1)

// K-quants (blocks of 256), portable and exact: as GEMV_GENERIC_Q, a super-block at a time.
#define GEMV_GENERIC_K(SUFFIX, DT)                                                                                     \
    static void gemv_generic_##SUFFIX(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx,        \
                                      const void *wv, const float *bias, int64_t k, int64_t ws, int64_t j0,            \
                                      int64_t j1) {                                                                    \
        const uint8_t *w = wv;                                                                                         \
        const size_t bb = dtype_block_bytes(DT), rb = (size_t)(ws / 256) * bb;                                         \
        float blk[256];                                                                                                \
        for (int64_t j = j0; j < j1; j++) {                                                                            \
            for (int i = 0; i < nx; i++) {                                                                             \
                const float *xr = x + i * x_stride;                                                                    \
                float s[8] = {0};                                                                                      \
                for (int64_t t = 0; t < k; t += 256) {                                                                 \
                    dtype_to_f32(DT, w + (size_t)j * rb + (size_t)(t / 256) * bb, blk, 256);                           \
                    for (int q = 0; q < 256; q += 8)                                                                   \
                        for (int l = 0; l < 8; l++)                                                                    \
                            s[l] += xr[t + q + l] * blk[q + l];                                                        \
                }                                                                                                      \
                float v = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));                           \
                out[i * out_stride + j] = bias ? v + bias[j] : v;                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    static void widen_generic_##SUFFIX(float *dst, const void *src, int64_t n) {                                       \
        dtype_to_f32(DT, src, dst, n);                                                                                 \
    }
GEMV_GENERIC_K(q4_k, DTYPE_Q4_K)
GEMV_GENERIC_K(q5_k, DTYPE_Q5_K)
GEMV_GENERIC_K(q6_k, DTYPE_Q6_K)
GEMV_GENERIC_K(q8_k, DTYPE_Q8_K)

static void widen_generic_q8_0(float *dst, const void *src, int64_t n) {
    dtype_to_f32(DTYPE_Q8_0, src, dst, n);
}
static void widen_generic_q4_0(float *dst, const void *src, int64_t n) {
    dtype_to_f32(DTYPE_Q4_0, src, dst, n);
}
static void widen_generic_q4_1(float *dst, const void *src, int64_t n) {
    dtype_to_f32(DTYPE_Q4_1, src, dst, n);
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA versions (x86-64 only; compiled with a target attribute, called only when the
// CPU reports both features).

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <stdbool.h>
#define AVX2_FN __attribute__((target("avx2,fma")))

AVX2_FN static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

// Columns in blocks of 32 (4 accumulators held across all nt rows of v), then 8, then scalar.
AVX2_FN static void axpy_rows_avx2(float *y, const float *p, const float *v, int64_t vs, int nt, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = _mm256_loadu_ps(y + i), a1 = _mm256_loadu_ps(y + i + 8);
        __m256 a2 = _mm256_loadu_ps(y + i + 16), a3 = _mm256_loadu_ps(y + i + 24);
        for (int t = 0; t < nt; t++) {
            const float *vr = v + t * vs + i;
            __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(y + i, a0);
        _mm256_storeu_ps(y + i + 8, a1);
        _mm256_storeu_ps(y + i + 16, a2);
        _mm256_storeu_ps(y + i + 24, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a0 = _mm256_loadu_ps(y + i);
        for (int t = 0; t < nt; t++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * vs + i), a0);
        _mm256_storeu_ps(y + i, a0);
    }
    for (; i < n; i++) {
        float a = y[i];
        for (int t = 0; t < nt; t++)
            a += p[t] * v[t * vs + i];
        y[i] = a;
    }
}

// exp for 8 lanes: n = round(x / ln 2), r = x - n ln 2 (two-part constant), a degree-6
// polynomial for exp(r) on [-ln2/2, ln2/2] (Cephes' expf coefficients), times 2^n built in the
// exponent bits. x is clamped to [-87.3, 88.3] (no inf / denormal results).
AVX2_FN static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AVX2_FN static float exp_sum_avx2(float *y, int64_t n, float m) {
    __m256 vm = _mm256_set1_ps(m), s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = exp256(_mm256_sub_ps(_mm256_loadu_ps(y + i), vm));
        _mm256_storeu_ps(y + i, v);
        s = _mm256_add_ps(s, v);
    }
    float t = hsum256(s);
    if (i < n) { // tail through the same exp: pad lanes with -inf-like values that give ~0
        float buf[8];
        int64_t r = n - i;
        for (int j = 0; j < 8; j++)
            buf[j] = j < r ? y[i + j] - m : -100.0f;
        __m256 v = exp256(_mm256_loadu_ps(buf));
        _mm256_storeu_ps(buf, v);
        for (int j = 0; j < r; j++) {
            y[i + j] = buf[j];
            t += buf[j];
        }
    }
    return t;
}

AVX2_FN static void silu_mul_avx2(float *out, const float *g, const float *u, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 den = _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++)
        out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

AVX2_FN static void scale_avx2(float *y, float a, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] *= a;
}

// The skinny matmul, generated for each weight dtype: LOADW(p) loads 8 weights from p as
// floats, SCALARW(p, t) one. Every (x row, weight row) pair is one 8-lane FMA chain in order
// over k, hsum256, then the scalar tail in order: the canonical dot order of this backend, so an
// output does not depend on how rows/columns are grouped. Blocking: 1 x row against 4 weight
// rows, 2 x rows against 4, 4 x rows against 3, written out by hand so the accumulators stay
// in registers (GCC at -O2 neither unrolls nor scalarises small accumulator arrays); each
// weight row streams once per group of up to 4 x rows.
#define LOADW_F32(p) _mm256_loadu_ps(p)
#define LOADW_BF16(p)                                                                                                  \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOADW_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define SCALARW_F32(p, t) ((p)[t])
#define SCALARW_BF16(p, t) bf16_to_f32((p)[t])
#define SCALARW_F16(p, t) f16_to_f32((p)[t])

#define GEMV_AVX2_FAMILY(SUFFIX, WT, LOADW, SCALARW)                                                                   \
    AVX2_FN static float dotw_##SUFFIX(const float *x, const WT *w, int64_t k) {                                       \
        __m256 s0 = _mm256_setzero_ps();                                                                               \
        int64_t i = 0;                                                                                                 \
        for (; i + 8 <= k; i += 8)                                                                                     \
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), LOADW(w + i), s0);                                            \
        float t = hsum256(s0);                                                                                         \
        for (; i < k; i++)                                                                                             \
            t += x[i] * SCALARW(w, i);                                                                                 \
        return t;                                                                                                      \
    }                                                                                                                  \
    AVX2_FN static void gemv1_##SUFFIX(float *out, const float *x, const WT *w, const float *bias, int64_t k,          \
                                       int64_t ws, int64_t j0, int64_t j1) {                                           \
        int64_t j = j0;                                                                                                \
        for (; j + 4 <= j1; j += 4) {                                                                                  \
            const WT *w0 = w + j * ws, *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;                                    \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                \
            int64_t kk = 0;                                                                                            \
            for (; kk + 8 <= k; kk += 8) {                                                                             \
                __m256 xv = _mm256_loadu_ps(x + kk);                                                                   \
                a0 = _mm256_fmadd_ps(xv, LOADW(w0 + kk), a0);                                                          \
                a1 = _mm256_fmadd_ps(xv, LOADW(w1 + kk), a1);                                                          \
                a2 = _mm256_fmadd_ps(xv, LOADW(w2 + kk), a2);                                                          \
                a3 = _mm256_fmadd_ps(xv, LOADW(w3 + kk), a3);                                                          \
            }                                                                                                          \
            float v[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};                                         \
            const WT *wr[4] = {w0, w1, w2, w3};                                                                        \
            for (int r = 0; r < 4; r++) {                                                                              \
                for (int64_t t = kk; t < k; t++)                                                                       \
                    v[r] += x[t] * SCALARW(wr[r], t);                                                                  \
                out[j + r] = bias ? v[r] + bias[j + r] : v[r];                                                         \
            }                                                                                                          \
        }                                                                                                              \
        for (; j < j1; j++) {                                                                                          \
            float v = dotw_##SUFFIX(x, w + j * ws, k);                                                                 \
            out[j] = bias ? v + bias[j] : v;                                                                           \
        }                                                                                                              \
    }                                                                                                                  \
    AVX2_FN static void gemv2_##SUFFIX(float *out, int64_t os, const float *x, int64_t xs, const WT *w,                \
                                       const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {             \
        const float *x0 = x, *x1 = x + xs;                                                                             \
        int64_t j = j0;                                                                                                \
        for (; j + 4 <= j1; j += 4) {                                                                                  \
            const WT *w0 = w + j * ws, *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;                                    \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;            \
            int64_t kk = 0;                                                                                            \
            for (; kk + 8 <= k; kk += 8) {                                                                             \
                __m256 xa = _mm256_loadu_ps(x0 + kk), xb = _mm256_loadu_ps(x1 + kk);                                   \
                __m256 v0 = LOADW(w0 + kk), v1 = LOADW(w1 + kk), v2 = LOADW(w2 + kk), v3 = LOADW(w3 + kk);             \
                a0 = _mm256_fmadd_ps(xa, v0, a0);                                                                      \
                a1 = _mm256_fmadd_ps(xa, v1, a1);                                                                      \
                a2 = _mm256_fmadd_ps(xa, v2, a2);                                                                      \
                a3 = _mm256_fmadd_ps(xa, v3, a3);                                                                      \
                b0 = _mm256_fmadd_ps(xb, v0, b0);                                                                      \
                b1 = _mm256_fmadd_ps(xb, v1, b1);                                                                      \
                b2 = _mm256_fmadd_ps(xb, v2, b2);                                                                      \
                b3 = _mm256_fmadd_ps(xb, v3, b3);                                                                      \
            }                                                                                                          \
            float va[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};                                        \
            float vb[4] = {hsum256(b0), hsum256(b1), hsum256(b2), hsum256(b3)};                                        \
            const WT *wr[4] = {w0, w1, w2, w3};                                                                        \
            for (int r = 0; r < 4; r++) {                                                                              \
                for (int64_t t = kk; t < k; t++) {                                                                     \
                    float wt = SCALARW(wr[r], t);                                                                      \
                    va[r] += x0[t] * wt;                                                                               \
                    vb[r] += x1[t] * wt;                                                                               \
                }                                                                                                      \
                out[j + r] = bias ? va[r] + bias[j + r] : va[r];                                                       \
                out[os + j + r] = bias ? vb[r] + bias[j + r] : vb[r];                                                  \
            }                                                                                                          \
        }                                                                                                              \
        for (; j < j1; j++) {                                                                                          \
            const WT *wr = w + j * ws;                                                                                 \
            float va = dotw_##SUFFIX(x0, wr, k), vb = dotw_##SUFFIX(x1, wr, k);                                        \
            out[j] = bias ? va + bias[j] : va;                                                                         \
            out[os + j] = bias ? vb + bias[j] : vb;                                                                    \
        }                                                                                                              \
    }                                                                                                                  \
    AVX2_FN static void gemv4_##SUFFIX(float *out, int64_t os, const float *x, int64_t xs, const WT *w,                \
                                       const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {             \
        const float *x0 = x, *x1 = x + xs, *x2 = x + 2 * xs, *x3 = x + 3 * xs;                                         \
        const float *xr[4] = {x0, x1, x2, x3};                                                                         \
        int64_t j = j0;                                                                                                \
        for (; j + 3 <= j1; j += 3) {                                                                                  \
            const WT *w0 = w + j * ws, *w1 = w0 + ws, *w2 = w1 + ws;                                                   \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;            \
            __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;                                                                 \
            int64_t kk = 0;                                                                                            \
            for (; kk + 8 <= k; kk += 8) {                                                                             \
                __m256 v0 = LOADW(w0 + kk), v1 = LOADW(w1 + kk), v2 = LOADW(w2 + kk);                                  \
                __m256 xv = _mm256_loadu_ps(x0 + kk);                                                                  \
                a0 = _mm256_fmadd_ps(xv, v0, a0);                                                                      \
                b0 = _mm256_fmadd_ps(xv, v1, b0);                                                                      \
                c0 = _mm256_fmadd_ps(xv, v2, c0);                                                                      \
                xv = _mm256_loadu_ps(x1 + kk);                                                                         \
                a1 = _mm256_fmadd_ps(xv, v0, a1);                                                                      \
                b1 = _mm256_fmadd_ps(xv, v1, b1);                                                                      \
                c1 = _mm256_fmadd_ps(xv, v2, c1);                                                                      \
                xv = _mm256_loadu_ps(x2 + kk);                                                                         \
                a2 = _mm256_fmadd_ps(xv, v0, a2);                                                                      \
                b2 = _mm256_fmadd_ps(xv, v1, b2);                                                                      \
                c2 = _mm256_fmadd_ps(xv, v2, c2);                                                                      \
                xv = _mm256_loadu_ps(x3 + kk);                                                                         \
                a3 = _mm256_fmadd_ps(xv, v0, a3);                                                                      \
                b3 = _mm256_fmadd_ps(xv, v1, b3);                                                                      \
                c3 = _mm256_fmadd_ps(xv, v2, c3);                                                                      \
            }                                                                                                          \
            float va[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};                                        \
            float vb[4] = {hsum256(b0), hsum256(b1), hsum256(b2), hsum256(b3)};                                        \
            float vc[4] = {hsum256(c0), hsum256(c1), hsum256(c2), hsum256(c3)};                                        \
            for (int i = 0; i < 4; i++) {                                                                              \
                for (int64_t t = kk; t < k; t++) {                                                                     \
                    va[i] += xr[i][t] * SCALARW(w0, t);                                                                \
                    vb[i] += xr[i][t] * SCALARW(w1, t);                                                                \
                    vc[i] += xr[i][t] * SCALARW(w2, t);                                                                \
                }                                                                                                      \
                out[i * os + j] = bias ? va[i] + bias[j] : va[i];                                                      \
                out[i * os + j + 1] = bias ? vb[i] + bias[j + 1] : vb[i];                                              \
                out[i * os + j + 2] = bias ? vc[i] + bias[j + 2] : vc[i];                                              \
            }                                                                                                          \
        }                                                                                                              \
        for (; j < j1; j++)                                                                                            \
            for (int i = 0; i < 4; i++) {                                                                              \
                float v = dotw_##SUFFIX(xr[i], w + j * ws, k);                                                         \
                out[i * os + j] = bias ? v + bias[j] : v;                                                              \
            }                                                                                                          \
    }                                                                                                                  \
    AVX2_FN static void gemv_avx2_##SUFFIX(float *out, int64_t os, const float *x, int64_t xs, int nx, const void *wv, \
                                           const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {         \
        const WT *w = wv;                                                                                              \
        int i = 0;                                                                                                     \
        for (; i + 4 <= nx; i += 4)                                                                                    \
            gemv4_##SUFFIX(out + i * os, os, x + i * xs, xs, w, bias, k, ws, j0, j1);                                  \
        for (; i + 2 <= nx; i += 2)                                                                                    \
            gemv2_##SUFFIX(out + i * os, os, x + i * xs, xs, w, bias, k, ws, j0, j1);                                  \
        if (i < nx) gemv1_##SUFFIX(out + i * os, x + i * xs, w, bias, k, ws, j0, j1);                                  \
    }

#define WIDEN_AVX2(SUFFIX, WT, LOADW, SCALARW)                                                                         \
    AVX2_FN static void widen_avx2_##SUFFIX(float *dst, const void *src, int64_t n) {                                  \
        const WT *s = src;                                                                                             \
        int64_t i = 0;                                                                                                 \
        for (; i + 8 <= n; i += 8)                                                                                     \
            _mm256_storeu_ps(dst + i, LOADW(s + i));                                                                   \
        for (; i < n; i++)                                                                                             \
            dst[i] = SCALARW(s, i);                                                                                    \
    }

WIDEN_AVX2(bf16, uint16_t, LOADW_BF16, SCALARW_BF16)
GEMV_AVX2_FAMILY(f32, float, LOADW_F32, SCALARW_F32)
GEMV_AVX2_FAMILY(bf16, uint16_t, LOADW_BF16, SCALARW_BF16)
#undef AVX2_FN
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
GEMV_AVX2_FAMILY(f16, uint16_t, LOADW_F16, SCALARW_F16)
WIDEN_AVX2(f16, uint16_t, LOADW_F16, SCALARW_F16)

// axpy_rows over a 16-bit V tile read in place, up to 4 rows (RN, a constant in each inlined
// copy, so the accumulators stay in registers) sharing each converted V vector; per element the
// same operations as axpy_rows_avx2 over the widened tile (an FMA chain in t order for the
// elements of whole 8-lane groups, a multiply and an add past them).
#define AXPY_ROWS16_AVX2(SUFFIX, LOADW, SCALARW)                                                                       \
    AVX2_FN __attribute__((always_inline)) static inline void axpy16_rows_##SUFFIX(                                    \
        float *yr, int64_t ys, const int RN, const float *pr, int64_t ps, const uint16_t *v, int64_t vs, int nt,       \
        int64_t n) {                                                                                                   \
        int64_t i = 0;                                                                                                 \
        for (; i + 16 <= n; i += 16) {                                                                                 \
            __m256 a[4][2];                                                                                            \
            _Pragma("GCC unroll 4") for (int r = 0; r < RN; r++) {                                                     \
                a[r][0] = _mm256_loadu_ps(yr + r * ys + i);                                                            \
                a[r][1] = _mm256_loadu_ps(yr + r * ys + i + 8);                                                        \
            }                                                                                                          \
            for (int t = 0; t < nt; t++) {                                                                             \
                const __m256 v0 = LOADW(v + t * vs + i), v1 = LOADW(v + t * vs + i + 8);                               \
                _Pragma("GCC unroll 4") for (int r = 0; r < RN; r++) {                                                 \
                    const __m256 pt = _mm256_set1_ps(pr[r * ps + t]);                                                  \
                    a[r][0] = _mm256_fmadd_ps(pt, v0, a[r][0]);                                                        \
                    a[r][1] = _mm256_fmadd_ps(pt, v1, a[r][1]);                                                        \
                }                                                                                                      \
            }                                                                                                          \
            _Pragma("GCC unroll 4") for (int r = 0; r < RN; r++) {                                                     \
                _mm256_storeu_ps(yr + r * ys + i, a[r][0]);                                                            \
                _mm256_storeu_ps(yr + r * ys + i + 8, a[r][1]);                                                        \
            }                                                                                                          \
        }                                                                                                              \
        for (; i + 8 <= n; i += 8)                                                                                     \
            for (int r = 0; r < RN; r++) {                                                                             \
                __m256 a0 = _mm256_loadu_ps(yr + r * ys + i);                                                          \
                for (int t = 0; t < nt; t++)                                                                           \
                    a0 = _mm256_fmadd_ps(_mm256_set1_ps(pr[r * ps + t]), LOADW(v + t * vs + i), a0);                   \
                _mm256_storeu_ps(yr + r * ys + i, a0);                                                                 \
            }                                                                                                          \
        for (; i < n; i++)                                                                                             \
            for (int r = 0; r < RN; r++) {                                                                             \
                float a0 = yr[r * ys + i];                                                                             \
                for (int t = 0; t < nt; t++)                                                                           \
                    a0 += pr[r * ps + t] * SCALARW(v + t * vs, i);                                                     \
                yr[r * ys + i] = a0;                                                                                   \
            }                                                                                                          \
    }                                                                                                                  \
    AVX2_FN static void axpy_rows16_avx2_##SUFFIX(float *y, int64_t ys, int nr, const float *p, int64_t ps,           \
                                                  const uint16_t *v, int64_t vs, int nt, int64_t n) {                  \
        for (int r0 = 0; r0 < nr; r0 += 4) {                                                                           \
            float *yr = y + r0 * ys;                                                                                   \
            const float *pr = p + r0 * ps;                                                                             \
            switch (nr - r0 < 4 ? nr - r0 : 4) {                                                                       \
            case 1: axpy16_rows_##SUFFIX(yr, ys, 1, pr, ps, v, vs, nt, n); break;                                      \
            case 2: axpy16_rows_##SUFFIX(yr, ys, 2, pr, ps, v, vs, nt, n); break;                                      \
            case 3: axpy16_rows_##SUFFIX(yr, ys, 3, pr, ps, v, vs, nt, n); break;                                      \
            default: axpy16_rows_##SUFFIX(yr, ys, 4, pr, ps, v, vs, nt, n); break;                                     \
            }                                                                                                          \
        }                                                                                                              \
    }
AXPY_ROWS16_AVX2(bf16, LOADW_BF16, SCALARW_BF16)
AXPY_ROWS16_AVX2(f16, LOADW_F16, SCALARW_F16)

// ---------------------------------------------------------------------------------------------
// Skinny matmul over GGUF block-quantised weights (Q8_0, Q4_0, Q4_1), dequantised in registers.
// DEQ_* produces a 32-element block as four 8-lane vectors with exactly dtype_to_f32's
// arithmetic (d * q, or a multiply then an add for d * q + m), and the dot products follow the
// canonical order of the F32 kernels (the block size 32 is a multiple of 8: no tail).
// Results are therefore bit-identical to dequantising at load and using the F32 kernels, with
// 5-6x less memory traffic.

AVX2_FN static inline float f16_scalar(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); // exact, like f16_to_f32
}

#define CVT8(q) _mm256_cvtepi32_ps(q)
#define Q8_LOAD8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define DEQ_Q8_0(blk, v)                                                                                               \
    do {                                                                                                               \
        __m256 d_ = _mm256_set1_ps(f16_scalar(blk));                                                                   \
        v##0 = _mm256_mul_ps(d_, CVT8(Q8_LOAD8((blk) + 2)));                                                           \
        v##1 = _mm256_mul_ps(d_, CVT8(Q8_LOAD8((blk) + 10)));                                                          \
        v##2 = _mm256_mul_ps(d_, CVT8(Q8_LOAD8((blk) + 18)));                                                          \
        v##3 = _mm256_mul_ps(d_, CVT8(Q8_LOAD8((blk) + 26)));                                                          \
    } while (0)
#define NIBBLES(qs, lo, hi)                                                                                            \
    __m128i lo = _mm_and_si128(qs, _mm_set1_epi8(0x0f));                                                               \
    __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0f))
#define DEQ_Q4_0(blk, v)                                                                                               \
    do {                                                                                                               \
        __m256 d_ = _mm256_set1_ps(f16_scalar(blk));                                                                   \
        __m128i q_ = _mm_loadu_si128((const __m128i *)((blk) + 2));                                                    \
        NIBBLES(q_, lo_, hi_);                                                                                         \
        __m256i e_ = _mm256_set1_epi32(8);                                                                             \
        v##0 = _mm256_mul_ps(d_, CVT8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(lo_), e_)));                               \
        v##1 = _mm256_mul_ps(d_, CVT8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo_, 8)), e_)));            \
        v##2 = _mm256_mul_ps(d_, CVT8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(hi_), e_)));                               \
        v##3 = _mm256_mul_ps(d_, CVT8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi_, 8)), e_)));            \
    } while (0)
#define DEQ_Q4_1(blk, v)                                                                                               \
    do {                                                                                                               \
        __m256 d_ = _mm256_set1_ps(f16_scalar(blk)), m_ = _mm256_set1_ps(f16_scalar((blk) + 2));                       \
        __m128i q_ = _mm_loadu_si128((const __m128i *)((blk) + 4));                                                    \
        NIBBLES(q_, lo_, hi_);                                                                                         \
        v##0 = _mm256_add_ps(_mm256_mul_ps(d_, CVT8(_mm256_cvtepu8_epi32(lo_))), m_);                                  \
        v##1 = _mm256_add_ps(_mm256_mul_ps(d_, CVT8(_mm256_cvtepu8_epi32(_mm_srli_si128(lo_, 8)))), m_);               \
        v##2 = _mm256_add_ps(_mm256_mul_ps(d_, CVT8(_mm256_cvtepu8_epi32(hi_))), m_);                                  \
        v##3 = _mm256_add_ps(_mm256_mul_ps(d_, CVT8(_mm256_cvtepu8_epi32(_mm_srli_si128(hi_, 8)))), m_);               \
    } while (0)

// acc = the pair's chain over one block (4 FMAs in element order).
#define QFMA4(acc, x, v)                                                                                               \
    do {                                                                                                               \
        acc = _mm256_fmadd_ps(_mm256_loadu_ps((x)), v##0, acc);                                                        \
        acc = _mm256_fmadd_ps(_mm256_loadu_ps((x) + 8), v##1, acc);                                                    \
        acc = _mm256_fmadd_ps(_mm256_loadu_ps((x) + 16), v##2, acc);                                                   \
        acc = _mm256_fmadd_ps(_mm256_loadu_ps((x) + 24), v##3, acc);                                                   \
    } while (0)

#define GEMV_Q_FAMILY(SUFFIX, BB, DEQ)                                                                                 \
    /* one x row, one weight row (tails) */                                                                            \
    AVX2_FN static float qdot_##SUFFIX(const float *x, const uint8_t *wr, int64_t nb) {                                \
        __m256 acc = _mm256_setzero_ps(), v0, v1, v2, v3;                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                                             \
            DEQ(wr + b * (BB), v);                                                                                     \
            QFMA4(acc, x + b * 32, v);                                                                                 \
        }                                                                                                              \
        return hsum256(acc);                                                                                           \
    }                                                                                                                  \
    /* four x rows against one weight row: the block is dequantised once for all four */                               \
    AVX2_FN static void gemvq4_##SUFFIX(float *out, int64_t os, const float *x, int64_t xs, const uint8_t *w,          \
                                        size_t rb, const float *bias, int64_t nb, int64_t j0, int64_t j1) {            \
        for (int64_t j = j0; j < j1; j++) {                                                                            \
            const uint8_t *wr = w + (size_t)j * rb;                                                                    \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, v0, v1, v2, v3;                                \
            for (int64_t b = 0; b < nb; b++) {                                                                         \
                DEQ(wr + b * (BB), v);                                                                                 \
                QFMA4(a0, x + b * 32, v);                                                                              \
                QFMA4(a1, x + xs + b * 32, v);                                                                         \
                QFMA4(a2, x + 2 * xs + b * 32, v);                                                                     \
                QFMA4(a3, x + 3 * xs + b * 32, v);                                                                     \
            }                                                                                                          \
            float bj = bias ? bias[j] : 0.0f;                                                                          \
            out[j] = bias ? hsum256(a0) + bj : hsum256(a0);                                                            \
            out[os + j] = bias ? hsum256(a1) + bj : hsum256(a1);                                                       \
            out[2 * os + j] = bias ? hsum256(a2) + bj : hsum256(a2);                                                   \
            out[3 * os + j] = bias ? hsum256(a3) + bj : hsum256(a3);                                                   \
        }                                                                                                              \
    }                                                                                                                  \
    /* one x row against four weight rows (four independent chains) */                                                 \
    AVX2_FN static void gemvq1_##SUFFIX(float *out, const float *x, const uint8_t *w, size_t rb, const float *bias,    \
                                        int64_t nb, int64_t j0, int64_t j1) {                                          \
        int64_t j = j0;                                                                                                \
        for (; j + 4 <= j1; j += 4) {                                                                                  \
            const uint8_t *r0 = w + (size_t)j * rb, *r1 = r0 + rb, *r2 = r1 + rb, *r3 = r2 + rb;                       \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, v0, v1, v2, v3;                                \
            for (int64_t b = 0; b < nb; b++) {                                                                         \
                const float *xb = x + b * 32;                                                                          \
                DEQ(r0 + b * (BB), v);                                                                                 \
                QFMA4(a0, xb, v);                                                                                      \
                DEQ(r1 + b * (BB), v);                                                                                 \
                QFMA4(a1, xb, v);                                                                                      \
                DEQ(r2 + b * (BB), v);                                                                                 \
                QFMA4(a2, xb, v);                                                                                      \
                DEQ(r3 + b * (BB), v);                                                                                 \
                QFMA4(a3, xb, v);                                                                                      \
            }                                                                                                          \
            float s[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};                                         \
            for (int r = 0; r < 4; r++)                                                                                \
                out[j + r] = bias ? s[r] + bias[j + r] : s[r];                                                         \
        }                                                                                                              \
        for (; j < j1; j++) {                                                                                          \
            float s = qdot_##SUFFIX(x, w + (size_t)j * rb, nb);                                                        \
            out[j] = bias ? s + bias[j] : s;                                                                           \
        }                                                                                                              \
    }                                                                                                                  \
    AVX2_FN static void gemv_avx2_##SUFFIX(float *out, int64_t os, const float *x, int64_t xs, int nx, const void *wv, \
                                           const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {         \
        const uint8_t *w = wv;                                                                                         \
        size_t rb = (size_t)(ws / 32) * (BB);                                                                          \
        int64_t nb = k / 32;                                                                                           \
        int i = 0;                                                                                                     \
        for (; i + 4 <= nx; i += 4)                                                                                    \
            gemvq4_##SUFFIX(out + i * os, os, x + i * xs, xs, w, rb, bias, nb, j0, j1);                                \
        for (; i < nx; i++)                                                                                            \
            gemvq1_##SUFFIX(out + i * os, x + i * xs, w, rb, bias, nb, j0, j1);                                        \
    }

GEMV_Q_FAMILY(q8_0, 34, DEQ_Q8_0)
GEMV_Q_FAMILY(q4_0, 18, DEQ_Q4_0)
GEMV_Q_FAMILY(q4_1, 20, DEQ_Q4_1)

// K-quants, exact: each super-block is dequantised with dtype_to_f32 into the stack, then every
// pair is one 8-lane FMA chain in element order (the canonical order of the F32 kernels), so
// results are bit-identical to dequantising at load. The fast decode path is gemv_xq.
#define GEMV_K_AVX2(SUFFIX, DT)                                                                                        \
    AVX2_FN static void gemv_avx2_##SUFFIX(float *out, int64_t os, const float *x, int64_t xs, int nx, const void *wv, \
                                           const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {         \
        const uint8_t *w = wv;                                                                                         \
        const size_t bb = dtype_block_bytes(DT), rb = (size_t)(ws / 256) * bb;                                         \
        float blk[256] __attribute__((aligned(32)));                                                                   \
        for (int64_t j = j0; j < j1; j++)                                                                              \
            for (int i0 = 0; i0 < nx; i0 += 8) {                                                                       \
                int ni = nx - i0 < 8 ? nx - i0 : 8;                                                                    \
                __m256 acc[8];                                                                                         \
                for (int i = 0; i < ni; i++) acc[i] = _mm256_setzero_ps();                                             \
                for (int64_t t = 0; t < k; t += 256) {                                                                 \
                    dtype_to_f32(DT, w + (size_t)j * rb + (size_t)(t / 256) * bb, blk, 256);                           \
                    for (int i = 0; i < ni; i++) {                                                                     \
                        const float *xr = x + (i0 + i) * xs + t;                                                       \
                        for (int q = 0; q < 256; q += 8)                                                               \
                            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + q), _mm256_load_ps(blk + q), acc[i]);        \
                    }                                                                                                  \
                }                                                                                                      \
                for (int i = 0; i < ni; i++) {                                                                         \
                    float v = hsum256(acc[i]);                                                                         \
                    out[(i0 + i) * os + j] = bias ? v + bias[j] : v;                                                   \
                }                                                                                                      \
            }                                                                                                          \
    }
GEMV_K_AVX2(q4_k, DTYPE_Q4_K)
GEMV_K_AVX2(q5_k, DTYPE_Q5_K)
GEMV_K_AVX2(q6_k, DTYPE_Q6_K)
GEMV_K_AVX2(q8_k, DTYPE_Q8_K)

#endif

void cpu_kernels_select(struct cpu_kernels *k) {
    *k = (struct cpu_kernels){.name = "generic",
                              .xq_name = "generic",
                              .axpy_rows = axpy_rows_generic,
                              .axpy_rows16 = {axpy_rows16_generic_bf16, axpy_rows16_generic_f16},
                              .exp_sum = exp_sum_generic,
                              .silu_mul = silu_mul_generic,
                              .scale = scale_generic,
                              .widen = {widen_generic_f32, widen_generic_bf16, widen_generic_f16, widen_generic_q8_0,
                                        widen_generic_q4_0, widen_generic_q4_1, widen_generic_q4_k,
                                        widen_generic_q5_k, widen_generic_q6_k, widen_generic_q8_k},
                              .gemv = {gemv_generic_f32, gemv_generic_bf16, gemv_generic_f16, gemv_generic_q8_0,
                                       gemv_generic_q4_0, gemv_generic_q4_1, gemv_generic_q4_k, gemv_generic_q5_k,
                                       gemv_generic_q6_k, gemv_generic_q8_k}};
    cpu_kernels_xq_generic(k);
#if defined(__x86_64__) && defined(__GNUC__)
    const char *force = getenv("ATOMC_CPU_KERNELS");
    if (force && !strcmp(force, "generic")) return;
    __builtin_cpu_init();
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)
        *k = (struct cpu_kernels){
            .name = "avx2",
            .axpy_rows = axpy_rows_avx2,
            .axpy_rows16 = {axpy_rows16_avx2_bf16, axpy_rows16_avx2_f16},
            .exp_sum = exp_sum_avx2,
            .silu_mul = silu_mul_avx2,
            .scale = scale_avx2,
            .widen = {widen_generic_f32, widen_avx2_bf16, widen_avx2_f16, widen_generic_q8_0, widen_generic_q4_0,
                      widen_generic_q4_1, widen_generic_q4_k, widen_generic_q5_k, widen_generic_q6_k,
                      widen_generic_q8_k},
            .gemv = {gemv_avx2_f32, gemv_avx2_bf16, gemv_avx2_f16, gemv_avx2_q8_0, gemv_avx2_q4_0, gemv_avx2_q4_1,
                     gemv_avx2_q4_k, gemv_avx2_q5_k, gemv_avx2_q6_k, gemv_avx2_q8_k}};
    if (!strcmp(k->name, "avx2")) {
        cpu_kernels_xq_avx2(k);
        k->xq_name = "avx2";
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
            cpu_kernels_xq_avx512(k);
            k->xq_name = "avx512";
        }
    }
#endif
}
