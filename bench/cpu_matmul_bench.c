// One CPU matmul shape, timed by the calling thread's CPU time (robust on a shared machine):
//
//   make bench && build/bench/cpu_matmul_bench N K M [batch_invariant 0|1] [threads]
//
// out(N, M) = x(N, K) @ w(M, K)^T with F32 weights; batch_invariant 1 routes every matmul
// through the row-independent kernel instead of OpenBLAS (see docs/ARCHITECTURE.md).
// With threads > 1 the CPU time of the calling thread alone is meaningless: use 1 (default).
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "backend/backend.h"

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s N K M [batch_invariant 0|1] [threads]\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]), k = atoi(argv[2]), m = atoi(argv[3]);
    int bi = argc > 4 ? atoi(argv[4]) : 0, threads = argc > 5 ? atoi(argv[5]) : 1;
    if (n <= 0 || k <= 0 || m <= 0) {
        fprintf(stderr, "N, K, M must be positive\n");
        return 2;
    }
    struct backend_options o = {.num_threads = threads, .batch_invariant = bi != 0};
    struct backend *b;
    struct error err;
    if (backend_cpu_create(&o, &b, &err) != ATOMC_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    float *x = b->ops->alloc(b, (size_t)n * k * 4), *w = b->ops->alloc(b, (size_t)m * k * 4);
    float *out = b->ops->alloc(b, (size_t)n * m * 4);
    if (!x || !w || !out) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (size_t)n * k; i++) x[i] = (float)(i % 13) * 0.01f;
    for (size_t i = 0; i < (size_t)m * k; i++) w[i] = (float)(i % 7) * 0.01f;
    struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), tw = tensor_2d(w, DTYPE_F32, m, k);
    struct tensor to = tensor_2d(out, DTYPE_F32, n, m);
    b->ops->matmul(b, &to, &tx, WEIGHT_PLAIN(&tw), NULL);
    const int reps = 3;
    double t = thread_cpu_s();
    for (int r = 0; r < reps; r++) b->ops->matmul(b, &to, &tx, WEIGHT_PLAIN(&tw), NULL);
    t = thread_cpu_s() - t;
    printf("n %d k %d m %d batch_invariant %d threads %d: %.1f GFLOP/s\n", n, k, m, bi, b->num_threads,
           reps * 2.0 * n * k * m / t / 1e9);
    b->ops->free(b, x);
    b->ops->free(b, w);
    b->ops->free(b, out);
    backend_destroy(b);
    return 0;
}
