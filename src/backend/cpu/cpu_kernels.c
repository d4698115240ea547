#include "backend/cpu/cpu_kernels.h"

#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// Portable versions (several accumulators so the compiler can overlap the adds).

static float dot_generic(const float *a, const float *b, int64_t n) {
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

static void axpy_generic(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void axpy_rows_generic(float *restrict y, const float *p, const float *restrict v, int64_t vs, int nt,
                              int64_t n) {
    for (int t = 0; t < nt; t++) axpy_generic(y, p[t], v + t * vs, n);
}

static void scale_generic(float *y, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] *= a;
}

static void gemv_generic(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx, const float *w,
                         const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        const float *wr = w + j * ws;
        for (int i = 0; i < nx; i++) {
            float v = dot_generic(x + i * x_stride, wr, k);
            out[i * out_stride + j] = bias ? v + bias[j] : v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA versions (x86-64 only; compiled with a target attribute, called only when the
// CPU reports both features).

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX2_FN __attribute__((target("avx2,fma")))

AVX2_FN static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

AVX2_FN static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i + 8 <= n) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        i += 8;
    }
    float t = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

AVX2_FN static void axpy_avx2(float *y, float a, const float *x, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
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
        for (int t = 0; t < nt; t++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * vs + i), a0);
        _mm256_storeu_ps(y + i, a0);
    }
    for (; i < n; i++) {
        float a = y[i];
        for (int t = 0; t < nt; t++) a += p[t] * v[t * vs + i];
        y[i] = a;
    }
}

AVX2_FN static void scale_avx2(float *y, float a, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] *= a;
}

// Rows of x against 4 weight rows at a time, written out by hand so the accumulators stay in
// registers (GCC at -O2 neither unrolls nor scalarises small accumulator arrays). The weight
// rows stream from memory once per call; x (<= 2 rows) stays in L1.
AVX2_FN static void gemv_avx2_1(float *out, int64_t os, const float *x, int64_t xs, const float *w,
                                const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {
    (void)os;
    (void)xs;
    for (int64_t j = j0; j < j1; j++) {
        const float *wr = w + j * ws;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        int64_t kk = 0;
        for (; kk + 32 <= k; kk += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + kk), _mm256_loadu_ps(wr + kk), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + kk + 8), _mm256_loadu_ps(wr + kk + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + kk + 16), _mm256_loadu_ps(wr + kk + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + kk + 24), _mm256_loadu_ps(wr + kk + 24), a3);
        }
        for (; kk + 8 <= k; kk += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + kk), _mm256_loadu_ps(wr + kk), a0);
        float v = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; kk < k; kk++) v += x[kk] * wr[kk];
        out[j] = bias ? v + bias[j] : v;
    }
}

AVX2_FN static void gemv_avx2_2(float *out, int64_t os, const float *x, int64_t xs, const float *w,
                                const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {
    const float *x0 = x, *x1 = x + xs;
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *w0 = w + j * ws, *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        int64_t kk = 0;
        for (; kk + 8 <= k; kk += 8) {
            __m256 xa = _mm256_loadu_ps(x0 + kk), xb = _mm256_loadu_ps(x1 + kk);
            __m256 v0 = _mm256_loadu_ps(w0 + kk), v1 = _mm256_loadu_ps(w1 + kk);
            __m256 v2 = _mm256_loadu_ps(w2 + kk), v3 = _mm256_loadu_ps(w3 + kk);
            a0 = _mm256_fmadd_ps(xa, v0, a0);
            a1 = _mm256_fmadd_ps(xa, v1, a1);
            a2 = _mm256_fmadd_ps(xa, v2, a2);
            a3 = _mm256_fmadd_ps(xa, v3, a3);
            b0 = _mm256_fmadd_ps(xb, v0, b0);
            b1 = _mm256_fmadd_ps(xb, v1, b1);
            b2 = _mm256_fmadd_ps(xb, v2, b2);
            b3 = _mm256_fmadd_ps(xb, v3, b3);
        }
        float va[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};
        float vb[4] = {hsum256(b0), hsum256(b1), hsum256(b2), hsum256(b3)};
        const float *wr[4] = {w0, w1, w2, w3};
        for (int r = 0; r < 4; r++) {
            for (int64_t t = kk; t < k; t++) {
                va[r] += x0[t] * wr[r][t];
                vb[r] += x1[t] * wr[r][t];
            }
            out[j + r] = bias ? va[r] + bias[j + r] : va[r];
            out[os + j + r] = bias ? vb[r] + bias[j + r] : vb[r];
        }
    }
    for (; j < j1; j++) {
        const float *wr = w + j * ws;
        float va = dot_avx2(x0, wr, k), vb = dot_avx2(x1, wr, k);
        out[j] = bias ? va + bias[j] : va;
        out[os + j] = bias ? vb + bias[j] : vb;
    }
}

// Four rows of x against 2 weight rows at a time (8 accumulators + 2 weight + 4 x registers).
AVX2_FN static void gemv_avx2_4(float *out, int64_t os, const float *x, int64_t xs, const float *w,
                                const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {
    const float *x0 = x, *x1 = x + xs, *x2 = x + 2 * xs, *x3 = x + 3 * xs;
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) {
        const float *w0 = w + j * ws, *w1 = w0 + ws;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        int64_t kk = 0;
        for (; kk + 8 <= k; kk += 8) {
            __m256 v0 = _mm256_loadu_ps(w0 + kk), v1 = _mm256_loadu_ps(w1 + kk);
            __m256 xv = _mm256_loadu_ps(x0 + kk);
            a0 = _mm256_fmadd_ps(xv, v0, a0);
            b0 = _mm256_fmadd_ps(xv, v1, b0);
            xv = _mm256_loadu_ps(x1 + kk);
            a1 = _mm256_fmadd_ps(xv, v0, a1);
            b1 = _mm256_fmadd_ps(xv, v1, b1);
            xv = _mm256_loadu_ps(x2 + kk);
            a2 = _mm256_fmadd_ps(xv, v0, a2);
            b2 = _mm256_fmadd_ps(xv, v1, b2);
            xv = _mm256_loadu_ps(x3 + kk);
            a3 = _mm256_fmadd_ps(xv, v0, a3);
            b3 = _mm256_fmadd_ps(xv, v1, b3);
        }
        float va[4] = {hsum256(a0), hsum256(a1), hsum256(a2), hsum256(a3)};
        float vb[4] = {hsum256(b0), hsum256(b1), hsum256(b2), hsum256(b3)};
        const float *xr[4] = {x0, x1, x2, x3};
        for (int i = 0; i < 4; i++) {
            for (int64_t t = kk; t < k; t++) {
                va[i] += xr[i][t] * w0[t];
                vb[i] += xr[i][t] * w1[t];
            }
            out[i * os + j] = bias ? va[i] + bias[j] : va[i];
            out[i * os + j + 1] = bias ? vb[i] + bias[j + 1] : vb[i];
        }
    }
    for (; j < j1; j++)
        for (int i = 0; i < 4; i++) {
            float v = dot_avx2(x + i * xs, w + j * ws, k);
            out[i * os + j] = bias ? v + bias[j] : v;
        }
}

AVX2_FN static void gemv_avx2(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx,
                              const float *w, const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1) {
    int i = 0;
    for (; i + 4 <= nx; i += 4)
        gemv_avx2_4(out + i * out_stride, out_stride, x + i * x_stride, x_stride, w, bias, k, ws, j0, j1);
    for (; i + 2 <= nx; i += 2)
        gemv_avx2_2(out + i * out_stride, out_stride, x + i * x_stride, x_stride, w, bias, k, ws, j0, j1);
    if (i < nx) gemv_avx2_1(out + i * out_stride, out_stride, x + i * x_stride, x_stride, w, bias, k, ws, j0, j1);
}
#endif
void cpu_kernels_select(struct cpu_kernels *k) {
    *k = (struct cpu_kernels){.name = "generic", .dot = dot_generic, .axpy = axpy_generic,
                              .axpy_rows = axpy_rows_generic, .scale = scale_generic, .gemv = gemv_generic};
#if defined(__x86_64__) && defined(__GNUC__)
    const char *force = getenv("ATOMC_CPU_KERNELS");
    if (force && !strcmp(force, "generic")) return;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        *k = (struct cpu_kernels){.name = "avx2", .dot = dot_avx2, .axpy = axpy_avx2,
                                  .axpy_rows = axpy_rows_avx2, .scale = scale_avx2, .gemv = gemv_avx2};
#endif
}
