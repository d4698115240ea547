// Inner loops of the CPU backend, compiled twice (portable C and AVX2+FMA) and chosen once
// at backend creation from the CPU's features (cpu_kernels_select). The portable versions
// are the specification; tests run whichever the machine selects and compare to references.
#ifndef ATOMC_BACKEND_CPU_CPU_KERNELS_H
#define ATOMC_BACKEND_CPU_CPU_KERNELS_H

#include <stdint.h>

struct cpu_kernels {
    const char *name; // "avx2" or "generic"
    // sum a[i] * b[i]
    float (*dot)(const float *a, const float *b, int64_t n);
    // y[i] += a * x[i]
    void (*axpy)(float *y, float a, const float *x, int64_t n);
    // y[i] += sum over t < nt of p[t] * v[t * vs + i], i < n (attention's P @ V for one row)
    void (*axpy_rows)(float *y, const float *p, const float *v, int64_t vs, int nt, int64_t n);
    // y[i] *= a
    void (*scale)(float *y, float a, int64_t n);
    // Skinny matmul for few rows (decode; also attention scores): for output columns j in
    // [j0, j1) and rows i < nx, with weight rows ws elements apart:
    //   out[i * out_stride + j] = dot(x + i * x_stride, w + j * ws, k) (+ bias[j] if bias)
    // Each weight row is read once per group of up to 4 rows (the weights are the traffic).
    void (*gemv)(float *out, int64_t out_stride, const float *x, int64_t x_stride, int nx, const float *w,
                 const float *bias, int64_t k, int64_t ws, int64_t j0, int64_t j1);
};

// Fills k with the best implementation this CPU supports (ATOMC_CPU_KERNELS=generic forces
// the portable one).
void cpu_kernels_select(struct cpu_kernels *k);

#endif
