// Inner loops of the CPU backend, compiled twice (portable C and AVX2+FMA) and chosen once
// at backend creation from the CPU's features (cpu_kernels_select). The portable versions
// are the specification; tests run whichever the machine selects and compare to references.
#ifndef ATOMC_BACKEND_CPU_CPU_KERNELS_H
#define ATOMC_BACKEND_CPU_CPU_KERNELS_H

#include <stdint.h>

// Weight dtypes of the matmul kernels (index of widen[] / gemv[]).
enum {
    CPU_WEIGHT_F32 = 0,
    CPU_WEIGHT_BF16,
    CPU_WEIGHT_F16,
    CPU_WEIGHT_Q8_0,
    CPU_WEIGHT_Q4_0,
    CPU_WEIGHT_Q4_1,
    CPU_WEIGHT_Q4_K, // the K-quants: blocks of 256 (k and ws multiples of 256)
    CPU_WEIGHT_Q5_K,
    CPU_WEIGHT_Q6_K,
    CPU_WEIGHT_Q8_K,
    CPU_WEIGHT_COUNT
};

// A block of 32 activations quantised for the integer dot products of quantised weights
// (cpu_kernels_xq.c): d = max|x| / 32767, q = round(x / d) (nearest even), s = d * sum(q).
struct cpu_xq_block {
    float d, s;
    int16_t q[32];
};

struct cpu_kernels {
    const char *name; // "avx2" (AVX2 + FMA + F16C) or "generic"
    const char *xq_name; // gemv_xq's set: "generic", "avx2" or "avx512" (AVX-512 F + BW for the 32-element types)
    // y[i] += sum over t < nt of p[t] * v[t * vs + i], i < n (attention's P @ V for one row)
    void (*axpy_rows)(float *y, const float *p, const float *v, int64_t vs, int nt, int64_t n);
    // The same over a 16-bit V read in place ([0] BF16, [1] F16) for nr rows at once:
    // y[r * ys + i] += sum over t < nt of p[r * ps + t] * f32(v[t * vs + i]); bit-identical to
    // axpy_rows over the widened V, row by row.
    void (*axpy_rows16[2])(float *y, int64_t ys, int nr, const float *p, int64_t ps, const uint16_t *v, int64_t vs,
                           int nt, int64_t n);
    // y[i] = exp(y[i] - m) in place; returns the sum of the new y (attention's softmax numerators).
    // The AVX2 version uses a polynomial exp within ~2 ulp of expf; inputs below -87 give ~1e-38.
    float (*exp_sum)(float *y, int64_t n, float m);
    // out[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i]
    void (*silu_mul)(float *out, const float *g, const float *u, int64_t n);
    // y[i] *= a
    void (*scale)(float *y, float a, int64_t n);
    // dst[i] = src[i] as F32, src in the weight dtype (index CPU_WEIGHT_*; n whole blocks for Q types).
    void (*widen[CPU_WEIGHT_COUNT])(float *dst, const void *src, int64_t n);
    // Skinny matmul for few rows (decode; also attention scores), one per weight dtype
    // (index CPU_WEIGHT_*): for output columns j in [j0, j1) and rows i < nx, with weight rows
    // ws elements apart (k and ws multiples of the block size for the Q types):
    //   out[i * out_stride + j] = dot(x + i * x_stride, w + j * ws, k) (+ bias[j] if bias)
    // Each weight row is read once per group of up to 4 rows (the weights are the traffic).
    void (*gemv[CPU_WEIGHT_COUNT])(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx,
                                   const void *w, const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1);
    // Quantised-weight decode path (not bit-identical to gemv: the activations are rounded to
    // int16, error bound in cpu_kernels_xq.c). quantize_xq: one row of k floats (k % 32 == 0) ->
    // k / 32 blocks. gemv_xq[wk] (NULL for the non-block dtypes): as gemv, with x given as nx
    // rows of quantised blocks xq_stride blocks apart.
    void (*quantize_xq)(struct cpu_xq_block *dst, const float *x, int64_t k);
    void (*gemv_xq[CPU_WEIGHT_COUNT])(float *out, int64_t out_stride, const struct cpu_xq_block *xq,
                                      int64_t xq_stride, int nx, const void *w, const float *bias, int64_t k,
                                      int64_t ws, int64_t j0, int64_t j1);
};

// The integer-dot kernels of cpu_kernels_xq.c, portable, AVX2 and AVX-512 (the last: AVX2's with
// the Q8_0 / Q4_0 / Q4_1 ones replaced; called by cpu_kernels_select).
void cpu_kernels_xq_generic(struct cpu_kernels *k);
void cpu_kernels_xq_avx2(struct cpu_kernels *k);
void cpu_kernels_xq_avx512(struct cpu_kernels *k);

// Fills k with the best implementation this CPU supports (ATOMC_CPU_KERNELS=generic forces
// the portable one).
void cpu_kernels_select(struct cpu_kernels *k);

#endif
