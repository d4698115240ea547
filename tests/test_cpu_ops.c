// Every op of the CPU backend against a naive reference written here (plain loops, double
// accumulation), on random shapes including odd sizes. Error is the normalised MSE
// sum((out - ref)^2) / sum(ref^2); outputs are checked for NaN/Inf and for writes past their
// end (guard bytes). These references are the specification the CUDA backend is held to
// through the CPU backend.
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/thread_pool.h"
#include "test.h"

// ---------------------------------------------------------------------------------------------
// Helpers

static uint64_t rng_state = 0x1234567;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_uniform(void) {
    return (float)((rng_u64() >> 11) * (1.0 / 9007199254740992.0));
}
static float rng_sym(void) {
    return 2.0f * rng_uniform() - 1.0f;
}
static int rng_int(int n) {
    return (int)(rng_u64() % (uint64_t)n);
}
static void fill_sym(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_sym() * scale;
}

#define GUARD 64
#define GUARD_BYTE 0xA5

// A buffer with GUARD guard bytes after `bytes`.
static void *gbuf(size_t bytes) {
    unsigned char *p = malloc(bytes + GUARD);
    memset(p, 0, bytes);
    memset(p + bytes, GUARD_BYTE, GUARD);
    return p;
}
static int guard_ok(const void *p, size_t bytes) {
    const unsigned char *g = (const unsigned char *)p + bytes;
    for (int i = 0; i < GUARD; i++)
        if (g[i] != GUARD_BYTE) return 0;
    return 1;
}

static double nmse(const float *out, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)out[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return num / (den > 1e-30 ? den : 1e-30);
}
static int all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

static struct backend *make_backend_opt(int threads, bool exact) {
    struct backend_options o = {.num_threads = threads, .kv_pool_bytes = 1 << 20, .exact_kernels = exact};
    struct backend *b = NULL;
    struct error err = {0};
    if (backend_cpu_create(&o, &b, &err) != ATOMC_OK) {
        fprintf(stderr, "backend_cpu_create: %s\n", err.msg);
        abort();
    }
    return b;
}

static struct backend *make_backend(int threads) { return make_backend_opt(threads, false); }

// ---------------------------------------------------------------------------------------------
// Thread pool

struct pool_count_ctx {
    int *hits;
};
static void pool_count(void *vctx, int64_t b, int64_t e, int tid) {
    struct pool_count_ctx *c = vctx;
    for (int64_t i = b; i < e; i++)
        __atomic_fetch_add(&c->hits[i], 1, __ATOMIC_RELAXED);
}

struct pool_thread_arg {
    struct thread_pool *p;
    int ok;
};
static void *pool_hammer(void *varg) {
    struct pool_thread_arg *a = varg;
    a->ok = 1;
    for (int rep = 0; rep < 200; rep++) {
        int n = 1 + rep * 7;
        int *hits = calloc((size_t)n, sizeof(int));
        struct pool_count_ctx c = {hits};
        thread_pool_parallel_for(a->p, n, 1 + rep % 3, pool_count, &c);
        for (int i = 0; i < n; i++)
            if (hits[i] != 1) a->ok = 0;
        free(hits);
    }
    return NULL;
}

TEST(thread_pool_covers_every_index_once_from_concurrent_callers) {
    struct thread_pool *p;
    struct error err;
    ASSERT_OK(thread_pool_create(3, &p, &err));
    ASSERT_EQ(thread_pool_size(p), 3);
    struct pool_thread_arg a[3] = {{p, 0}, {p, 0}, {p, 0}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++)
        pthread_create(&th[i], NULL, pool_hammer, &a[i]);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    thread_pool_free(p);
    for (int i = 0; i < 3; i++)
        ASSERT_TRUE(a[i].ok);
}

// More threads than cores (workers routinely descheduled mid-job): many small and large jobs
// still cover every index exactly once, and creating / destroying pools is clean.
TEST(thread_pool_oversubscribed_many_jobs) {
    struct thread_pool *p;
    struct error err;
    ASSERT_OK(thread_pool_create(8, &p, &err));
    for (int rep = 0; rep < 300; rep++) {
        int n = 1 + (rep * 37) % 5000;
        int *hits = calloc((size_t)n, sizeof(int));
        struct pool_count_ctx c = {hits};
        thread_pool_parallel_for(p, n, 1 + rep % 5, pool_count, &c);
        for (int i = 0; i < n; i++)
            if (hits[i] != 1) {
                test_fail(__FILE__, __LINE__, "job %d index %d hit %d times", rep, i, hits[i]);
                rep = 300;
                break;
            }
        free(hits);
    }
    thread_pool_free(p);
    for (int i = 0; i < 20; i++) {
        ASSERT_OK(thread_pool_create(1 + i % 6, &p, &err));
        thread_pool_free(p);
    }
}

// ---------------------------------------------------------------------------------------------
// Memory and weight upload

TEST(memory_ops_and_info) {
    struct backend *b = make_backend(2);
    ASSERT_EQ(b->act_dtype, DTYPE_F32);
    ASSERT_EQ(b->weight_dtype, DTYPE_F32);
    ASSERT_EQ(b->num_threads, 2);
    size_t fr = 0, tot = 0;
    b->ops->memory_info(b, &fr, &tot);
    ASSERT_EQ(fr, 1 << 20);
    unsigned char *p = b->ops->alloc(b, 1001), *q = b->ops->alloc(b, 1001);
    ASSERT_TRUE(p && q);
    ASSERT_EQ((uintptr_t)p % 64, 0);
    unsigned char src[1001];
    for (int i = 0; i < 1001; i++)
        src[i] = (unsigned char)(i * 31);
    b->ops->copy_h2d(b, p, src, 1001);
    b->ops->copy_d2d(b, q, p, 1001);
    unsigned char back[1001];
    b->ops->copy_d2h(b, back, q, 1001);
    ASSERT_TRUE(memcmp(back, src, 1001) == 0);
    b->ops->memset_zero(b, q, 500);
    b->ops->copy_d2h(b, back, q, 1001);
    ASSERT_EQ(back[499], 0);
    ASSERT_EQ(back[500], src[500]);
    b->ops->free(b, p);
    b->ops->free(b, q);
    b->ops->synchronize(b);
    backend_destroy(b);
}

TEST(create_rejects_bad_thread_count) {
    struct backend_options o = {.num_threads = -2};
    struct backend *b = (struct backend *)1;
    struct error err = {0};
    ASSERT_EQ(backend_cpu_create(&o, &b, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(b == NULL);
    ASSERT_TRUE(strstr(err.msg, "num_threads") != NULL);
}

static void make_quant_rows(enum dtype dt, void *dst, int64_t n_elems) {
    unsigned char *p = dst;
    int64_t blocks = n_elems / 32;
    size_t bb = dtype_block_bytes(dt);
    for (int64_t i = 0; i < blocks; i++) {
        unsigned char *blk = p + i * bb;
        for (size_t j = 0; j < bb; j++)
            blk[j] = (unsigned char)rng_u64();
        uint16_t d = f32_to_f16(0.01f + 0.1f * rng_uniform());
        memcpy(blk, &d, 2);
        if (dt == DTYPE_Q4_1) {
            uint16_t m = f32_to_f16(-0.5f * rng_uniform());
            memcpy(blk + 2, &m, 2);
        }
    }
}

TEST(upload_weight_dequantises_every_dtype) {
    struct backend *b = make_backend(2);
    enum dtype dts[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1};
    // Shapes: small (single-threaded path) and > 1M elements (parallel path, odd row count).
    int64_t shapes[][2] = {{3, 64}, {1031, 1056}};
    for (size_t si = 0; si < 2; si++) {
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
            enum dtype dt = dts[di];
            int64_t rows = shapes[si][0], cols = shapes[si][1], n = rows * cols;
            size_t bytes = dtype_row_bytes(dt, cols) * (size_t)rows;
            void *host = malloc(bytes);
            if (dt == DTYPE_Q8_0 || dt == DTYPE_Q4_0 || dt == DTYPE_Q4_1) {
                make_quant_rows(dt, host, n);
            } else {
                float *tmp = malloc((size_t)n * 4);
                fill_sym(tmp, n, 3.0f);
                dtype_from_f32(dt, tmp, host, n);
                free(tmp);
            }
            float *expect = malloc((size_t)n * 4);
            dtype_to_f32(dt, host, expect, n);
            struct tensor src = tensor_2d(host, dt, rows, cols);
            struct tensor dst = tensor_2d(NULL, DTYPE_F32, rows, cols);
            struct error err = {0};
            ASSERT_OK(b->ops->upload_weight(b, &dst, &src, &err));
            ASSERT_TRUE(dst.data != NULL);
            ASSERT_TRUE(memcmp(dst.data, expect, (size_t)n * 4) == 0);
            b->ops->free(b, dst.data);
            free(expect);
            free(host);
        }
    }
    // Half-precision destinations (kept as BF16 / F16 for the matmul): exactly the source
    // rounded once to the destination dtype (a copy when the dtypes match).
    enum dtype halves[] = {DTYPE_BF16, DTYPE_F16};
    for (int hi = 0; hi < 2; hi++)
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
            enum dtype dt = dts[di];
            int64_t rows = 1031, cols = 1056, n = rows * cols; // parallel path
            size_t bytes = dtype_row_bytes(dt, cols) * (size_t)rows;
            void *host = malloc(bytes);
            float *tmp = malloc((size_t)n * 4);
            if (dt == DTYPE_Q8_0 || dt == DTYPE_Q4_0 || dt == DTYPE_Q4_1) {
                make_quant_rows(dt, host, n);
            } else {
                fill_sym(tmp, n, 3.0f);
                dtype_from_f32(dt, tmp, host, n);
            }
            dtype_to_f32(dt, host, tmp, n);
            uint16_t *expect = malloc((size_t)n * 2);
            dtype_from_f32(halves[hi], tmp, expect, n);
            struct tensor src = tensor_2d(host, dt, rows, cols), dst = tensor_2d(NULL, halves[hi], rows, cols);
            struct error err = {0};
            ASSERT_OK(b->ops->upload_weight(b, &dst, &src, &err));
            ASSERT_TRUE(memcmp(dst.data, expect, (size_t)n * 2) == 0);
            b->ops->free(b, dst.data);
            free(host);
            free(tmp);
            free(expect);
        }
    // Errors: wrong destination dtype, element count mismatch, integer source.
    float w[64] = {0};
    struct tensor src = tensor_2d(w, DTYPE_F32, 4, 16);
    struct tensor dst = tensor_2d(NULL, DTYPE_FP8_E4M3, 4, 16);
    struct error err = {0};
    ASSERT_EQ(b->ops->upload_weight(b, &dst, &src, &err), ATOMC_ERR_UNSUPPORTED);
    dst = tensor_2d(NULL, DTYPE_F32, 4, 15);
    ASSERT_EQ(b->ops->upload_weight(b, &dst, &src, &err), ATOMC_ERR_INVALID_ARGUMENT);
    src.dtype = DTYPE_I32;
    dst = tensor_2d(NULL, DTYPE_F32, 4, 16);
    ASSERT_EQ(b->ops->upload_weight(b, &dst, &src, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(dst.data == NULL);
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// Embedding, gather, convert, add, silu_mul

TEST(embedding_and_gather_rows) {
    struct backend *b = make_backend(2);
    int vocab = 37, d = 13, n = 2600; // n * d > the parallel threshold
    float *table = malloc((size_t)vocab * d * 4);
    fill_sym(table, (int64_t)vocab * d, 1.0f);
    int32_t *ids = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++)
        ids[i] = rng_int(vocab);
    float *out = gbuf((size_t)n * d * 4);
    struct tensor tt = tensor_2d(table, DTYPE_F32, vocab, d), to = tensor_2d(out, DTYPE_F32, n, d);
    b->ops->embedding(b, &to, &tt, ids);
    for (int i = 0; i < n; i++)
        ASSERT_TRUE(memcmp(out + (size_t)i * d, table + (size_t)ids[i] * d, d * 4) == 0);
    ASSERT_TRUE(guard_ok(out, (size_t)n * d * 4));

    int32_t rows[5] = {7, 0, 2599, 7, 1234};
    float *g = gbuf(5 * (size_t)d * 4);
    struct tensor tg = tensor_2d(g, DTYPE_F32, 5, d);
    b->ops->gather_rows(b, &tg, &to, rows, 5);
    for (int i = 0; i < 5; i++)
        ASSERT_TRUE(memcmp(g + i * d, out + (size_t)rows[i] * d, d * 4) == 0);
    ASSERT_TRUE(guard_ok(g, 5 * (size_t)d * 4));
    free(table);
    free(ids);
    free(out);
    free(g);
    backend_destroy(b);
}

TEST(convert_add_silu_mul) {
    struct backend *b = make_backend(2);
    int shapes[][2] = {{1, 7}, {3, 13}, {129, 400}};
    for (int si = 0; si < 3; si++) {
        int n = shapes[si][0], f = shapes[si][1];
        int64_t ne = (int64_t)n * f;
        // convert BF16 / F16 / F32 -> F32
        float *x = malloc(ne * 4);
        fill_sym(x, ne, 4.0f);
        enum dtype dts[] = {DTYPE_BF16, DTYPE_F16, DTYPE_F32};
        for (int di = 0; di < 3; di++) {
            void *xs = malloc(ne * 4);
            dtype_from_f32(dts[di], x, xs, ne);
            float *o = gbuf(ne * 4);
            struct tensor tx = tensor_2d(xs, dts[di], n, f), to = tensor_2d(o, DTYPE_F32, n, f);
            b->ops->convert(b, &to, &tx);
            float *expect = malloc(ne * 4);
            dtype_to_f32(dts[di], xs, expect, ne);
            ASSERT_TRUE(memcmp(o, expect, ne * 4) == 0);
            ASSERT_TRUE(guard_ok(o, ne * 4));
            free(expect);
            free(o);
            free(xs);
        }
        // add
        float *acc = gbuf(ne * 4), *y = malloc(ne * 4);
        fill_sym(acc, ne, 1.0f);
        fill_sym(y, ne, 1.0f);
        double *ref = malloc(ne * 8);
        for (int64_t i = 0; i < ne; i++)
            ref[i] = (double)acc[i] + y[i];
        struct tensor ta = tensor_2d(acc, DTYPE_F32, n, f), ty = tensor_2d(y, DTYPE_F32, n, f);
        b->ops->add(b, &ta, &ty);
        ASSERT_TRUE(nmse(acc, ref, ne) < 1e-13);
        ASSERT_TRUE(guard_ok(acc, ne * 4));
        // silu_mul
        float *gu = malloc(ne * 8), *o = gbuf(ne * 4);
        fill_sym(gu, 2 * ne, 6.0f);
        for (int r = 0; r < n; r++)
            for (int i = 0; i < f; i++) {
                double g = gu[(int64_t)r * 2 * f + i], u = gu[(int64_t)r * 2 * f + f + i];
                ref[(int64_t)r * f + i] = g / (1.0 + exp(-g)) * u;
            }
        struct tensor tgu = tensor_2d(gu, DTYPE_F32, n, 2 * f), to = tensor_2d(o, DTYPE_F32, n, f);
        b->ops->silu_mul(b, &to, &tgu);
        ASSERT_TRUE(nmse(o, ref, ne) < 1e-12);
        ASSERT_TRUE(all_finite(o, ne));
        ASSERT_TRUE(guard_ok(o, ne * 4));
        free(acc);
        free(y);
        free(ref);
        free(gu);
        free(o);
        free(x);
    }
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

static void ref_rmsnorm(double *out, const float *h, const float *w, int d, float eps) {
    double ss = 0;
    for (int i = 0; i < d; i++)
        ss += (double)h[i] * h[i];
    double inv = 1.0 / sqrt(ss / d + eps);
    for (int i = 0; i < d; i++)
        out[i] = h[i] * inv * w[i];
}

TEST(rmsnorm_and_add_rmsnorm) {
    struct backend *b = make_backend(2);
    int shapes[][2] = {{1, 7}, {5, 64}, {3 * 13, 80}, {300, 576}}; // last: per-head-like view + parallel
    for (int si = 0; si < 4; si++) {
        int n = shapes[si][0], d = shapes[si][1];
        int64_t ne = (int64_t)n * d;
        float *x = malloc(ne * 4), *w = malloc(d * 4), *res = malloc(ne * 4), *o = gbuf(ne * 4);
        fill_sym(x, ne, 3.0f);
        fill_sym(w, d, 1.5f);
        fill_sym(res, ne, 2.0f);
        double *ref = malloc(ne * 8);
        for (int r = 0; r < n; r++)
            ref_rmsnorm(ref + (int64_t)r * d, x + (int64_t)r * d, w, d, 1e-6f);
        struct tensor tx = tensor_2d(x, DTYPE_F32, n, d), tw = tensor_2d(w, DTYPE_F32, 1, d);
        struct tensor to = tensor_2d(o, DTYPE_F32, n, d);
        tw.ndim = 1;
        tw.ne[0] = d;
        b->ops->rmsnorm(b, &to, &tx, &tw, 1e-6f);
        ASSERT_TRUE(nmse(o, ref, ne) < 1e-12);
        ASSERT_TRUE(guard_ok(o, ne * 4));
        // In place.
        float *xc = malloc(ne * 4);
        memcpy(xc, x, ne * 4);
        struct tensor txc = tensor_2d(xc, DTYPE_F32, n, d);
        b->ops->rmsnorm(b, &txc, &txc, &tw, 1e-6f);
        ASSERT_TRUE(memcmp(xc, o, ne * 4) == 0);
        // add_rmsnorm: residual += x; out = norm(residual) * w.
        float *h = malloc(ne * 4);
        for (int64_t i = 0; i < ne; i++)
            h[i] = res[i] + x[i];
        for (int r = 0; r < n; r++)
            ref_rmsnorm(ref + (int64_t)r * d, h + (int64_t)r * d, w, d, 1e-5f);
        struct tensor tr = tensor_2d(res, DTYPE_F32, n, d);
        b->ops->add_rmsnorm(b, &to, &tr, &tx, &tw, 1e-5f);
        ASSERT_TRUE(memcmp(res, h, ne * 4) == 0);
        ASSERT_TRUE(nmse(o, ref, ne) < 1e-12);
        // x = NULL: only the norm, residual unchanged.
        b->ops->add_rmsnorm(b, &to, &tr, NULL, &tw, 1e-5f);
        ASSERT_TRUE(memcmp(res, h, ne * 4) == 0);
        ASSERT_TRUE(nmse(o, ref, ne) < 1e-12);
        ASSERT_TRUE(all_finite(o, ne));
        ASSERT_TRUE(guard_ok(o, ne * 4));
        free(x);
        free(w);
        free(res);
        free(o);
        free(ref);
        free(xc);
        free(h);
    }
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// Matmul

TEST(matmul_with_and_without_bias) {
    struct backend *b = make_backend(2);
    // n <= 8 takes the skinny (decode) kernel, larger n OpenBLAS; k not a multiple of 8 and
    // m not a multiple of 4 exercise the kernels' tails; m * k >= 65536 the parallel path.
    int shapes[][3] = {{1, 7, 5},     {3, 64, 13},    {17, 129, 257}, {1, 576, 1536}, {33, 80, 1},
                       {2, 129, 257}, {4, 100, 1029}, {7, 31, 3},     {9, 40, 70}};
    for (int si = 0; si < 9; si++) {
        int n = shapes[si][0], k = shapes[si][1], m = shapes[si][2];
        float *x = malloc((size_t)n * k * 4), *w = malloc((size_t)m * k * 4), *bias = malloc(m * 4);
        float *o = gbuf((size_t)n * m * 4);
        double *ref = malloc((size_t)n * m * 8);
        fill_sym(x, (int64_t)n * k, 1.0f);
        fill_sym(w, (int64_t)m * k, 0.5f);
        fill_sym(bias, m, 1.0f);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            for (int i = 0; i < n; i++)
                for (int j = 0; j < m; j++) {
                    double s = with_bias ? bias[j] : 0.0;
                    for (int t = 0; t < k; t++)
                        s += (double)x[(size_t)i * k + t] * w[(size_t)j * k + t];
                    ref[(size_t)i * m + j] = s;
                }
            struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), tw = tensor_2d(w, DTYPE_F32, m, k);
            struct tensor to = tensor_2d(o, DTYPE_F32, n, m), tb = tensor_2d(bias, DTYPE_F32, 1, m);
            b->ops->matmul(b, &to, &tx, WEIGHT_PLAIN(&tw), with_bias ? &tb : NULL);
            double e = nmse(o, ref, (int64_t)n * m);
            if (!(e < 1e-11)) test_fail(__FILE__, __LINE__, "matmul %dx%dx%d bias %d nmse %g", n, k, m, with_bias, e);
            ASSERT_TRUE(all_finite(o, (int64_t)n * m));
            ASSERT_TRUE(guard_ok(o, (size_t)n * m * 4));
        }
        free(x);
        free(w);
        free(bias);
        free(o);
        free(ref);
    }
    backend_destroy(b);
}

// BF16 / F16 weights (fp32 compute): matmul (skinny and tiled-sgemm paths, half bias),
// embedding and norms, against double references over the weights' exact F32 values.
TEST(half_precision_weights) {
    struct backend *b = make_backend(2);
    enum dtype halves[] = {DTYPE_BF16, DTYPE_F16};
    int shapes[][3] = {{1, 129, 257}, {3, 64, 13}, {8, 200, 301}, {9, 72, 1500}, {33, 576, 2100}};
    for (int hi = 0; hi < 2; hi++) {
        enum dtype ht = halves[hi];
        for (int si = 0; si < 5; si++) {
            int n = shapes[si][0], k = shapes[si][1], m = shapes[si][2];
            float *x = malloc((size_t)n * k * 4), *wf = malloc((size_t)m * k * 4), *bf = malloc(m * 4);
            uint16_t *wh = malloc((size_t)m * k * 2), *bh = malloc(m * 2);
            float *o = gbuf((size_t)n * m * 4);
            double *ref = malloc((size_t)n * m * 8);
            fill_sym(x, (int64_t)n * k, 1.0f);
            fill_sym(wf, (int64_t)m * k, 0.5f);
            fill_sym(bf, m, 1.0f);
            dtype_from_f32(ht, wf, wh, (int64_t)m * k);
            dtype_to_f32(ht, wh, wf, (int64_t)m * k);
            dtype_from_f32(ht, bf, bh, m);
            dtype_to_f32(ht, bh, bf, m);
            for (int i = 0; i < n; i++)
                for (int j = 0; j < m; j++) {
                    double acc = bf[j];
                    for (int t = 0; t < k; t++)
                        acc += (double)x[(size_t)i * k + t] * wf[(size_t)j * k + t];
                    ref[(size_t)i * m + j] = acc;
                }
            struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), tw = tensor_2d(wh, ht, m, k);
            struct tensor to = tensor_2d(o, DTYPE_F32, n, m), tb = tensor_2d(bh, ht, 1, m);
            b->ops->matmul(b, &to, &tx, WEIGHT_PLAIN(&tw), &tb);
            double e = nmse(o, ref, (int64_t)n * m);
            if (!(e < 1e-11)) test_fail(__FILE__, __LINE__, "%s matmul %dx%dx%d nmse %g", dtype_name(ht), n, k, m, e);
            ASSERT_TRUE(guard_ok(o, (size_t)n * m * 4));
            free(x);
            free(wf);
            free(bf);
            free(wh);
            free(bh);
            free(o);
            free(ref);
        }
        // Embedding from a half table, norms with a half weight.
        int vocab = 50, d = 72, rows = 5;
        float *tf = malloc((size_t)vocab * d * 4), *nw = malloc(d * 4), *out = gbuf((size_t)rows * d * 4);
        uint16_t *th = malloc((size_t)vocab * d * 2), *nwh = malloc(d * 2);
        fill_sym(tf, (int64_t)vocab * d, 1.0f);
        fill_sym(nw, d, 1.0f);
        dtype_from_f32(ht, tf, th, (int64_t)vocab * d);
        dtype_to_f32(ht, th, tf, (int64_t)vocab * d);
        dtype_from_f32(ht, nw, nwh, d);
        dtype_to_f32(ht, nwh, nw, d);
        int32_t ids[5] = {3, 49, 0, 3, 17};
        struct tensor tt = tensor_2d(th, ht, vocab, d), to = tensor_2d(out, DTYPE_F32, rows, d);
        b->ops->embedding(b, &to, &tt, ids);
        for (int i = 0; i < rows; i++)
            ASSERT_TRUE(memcmp(out + i * d, tf + ids[i] * d, d * 4) == 0);
        double ref[5 * 72];
        for (int i = 0; i < rows; i++)
            ref_rmsnorm(ref + i * d, out + i * d, nw, d, 1e-5f);
        float *nout = gbuf((size_t)rows * d * 4);
        struct tensor tn = tensor_2d(nout, DTYPE_F32, rows, d), tnw = tensor_2d(nwh, ht, 1, d);
        b->ops->rmsnorm(b, &tn, &to, &tnw, 1e-5f);
        ASSERT_TRUE(nmse(nout, ref, rows * d) < 1e-12);
        b->ops->add_rmsnorm(b, &tn, &to, NULL, &tnw, 1e-5f);
        ASSERT_TRUE(nmse(nout, ref, rows * d) < 1e-12);
        ASSERT_TRUE(guard_ok(nout, (size_t)rows * d * 4) && guard_ok(out, (size_t)rows * d * 4));
        free(tf);
        free(nw);
        free(out);
        free(th);
        free(nwh);
        free(nout);
    }
    backend_destroy(b);
}

// GGUF quantised weights kept as is (Q8_0 / Q4_0 / Q4_1): the kernels dequantise in registers
// with dtype_to_f32's arithmetic, so the decode matmul (n <= 8) must equal the F32 path on the
// weights dequantised at load bit for bit, and the sgemm path (n > 8) to rounding. Embedding
// rows from a quantised table likewise.
TEST(quantised_weights_match_dequantised_f32) {
    // The exact kernels (backend_options.exact_kernels); the default decode path for quantised
    // weights (int16 activations, not bit-identical) is tested against its bound in test_cpu_quant_ops.c.
    struct backend *b = make_backend_opt(2, true);
    enum dtype qts[] = {DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1};
    int ks[] = {96, 576}, ns[] = {1, 2, 3, 4, 5, 8, 9, 33};
    const int m = 301;
    for (int qi = 0; qi < 3; qi++)
        for (int ki = 0; ki < 2; ki++) {
            enum dtype qt = qts[qi];
            int k = ks[ki];
            size_t qbytes = dtype_row_bytes(qt, k) * m;
            void *host = malloc(qbytes);
            make_quant_rows(qt, host, (int64_t)m * k);
            struct tensor src = tensor_2d(host, qt, m, k);
            struct tensor wq = tensor_2d(NULL, qt, m, k), wf = tensor_2d(NULL, DTYPE_F32, m, k);
            struct error err = {0};
            ASSERT_OK(b->ops->upload_weight(b, &wq, &src, &err));
            ASSERT_OK(b->ops->upload_weight(b, &wf, &src, &err));
            ASSERT_TRUE(memcmp(wq.data, host, qbytes) == 0);
            float *bias = malloc(m * 4);
            fill_sym(bias, m, 1.0f);
            struct tensor tb = tensor_2d(bias, DTYPE_F32, 1, m);
            for (int ni = 0; ni < 8; ni++) {
                int n = ns[ni];
                float *x = malloc((size_t)n * k * 4), *oq = gbuf((size_t)n * m * 4), *of = malloc((size_t)n * m * 4);
                fill_sym(x, (int64_t)n * k, 1.0f);
                struct tensor tx = tensor_2d(x, DTYPE_F32, n, k);
                struct tensor toq = tensor_2d(oq, DTYPE_F32, n, m), tof = tensor_2d(of, DTYPE_F32, n, m);
                b->ops->matmul(b, &toq, &tx, WEIGHT_PLAIN(&wq), &tb);
                b->ops->matmul(b, &tof, &tx, WEIGHT_PLAIN(&wf), &tb);
                if (n <= 8) {
                    if (memcmp(oq, of, (size_t)n * m * 4))
                        test_fail(__FILE__, __LINE__, "%s k %d n %d: differs from the F32 path", dtype_name(qt), k, n);
                } else {
                    double *ref = malloc((size_t)n * m * 8);
                    for (int64_t i = 0; i < (int64_t)n * m; i++)
                        ref[i] = of[i];
                    double e = nmse(oq, ref, (int64_t)n * m);
                    if (!(e < 1e-12)) test_fail(__FILE__, __LINE__, "%s k %d n %d: nmse %g", dtype_name(qt), k, n, e);
                    free(ref);
                }
                ASSERT_TRUE(guard_ok(oq, (size_t)n * m * 4));
                free(x);
                free(oq);
                free(of);
            }
            // Embedding rows from the quantised table equal those of the dequantised one.
            int32_t ids[4] = {0, 300, 17, 17};
            float *eq = malloc((size_t)4 * k * 4), *ef = malloc((size_t)4 * k * 4);
            struct tensor teq = tensor_2d(eq, DTYPE_F32, 4, k), tef = tensor_2d(ef, DTYPE_F32, 4, k);
            b->ops->embedding(b, &teq, &wq, ids);
            b->ops->embedding(b, &tef, &wf, ids);
            ASSERT_TRUE(memcmp(eq, ef, (size_t)4 * k * 4) == 0);
            free(eq);
            free(ef);
            free(bias);
            free(host);
            b->ops->free(b, wq.data);
            b->ops->free(b, wf.data);
        }
    // Quantised destinations only from the same quantised type.
    float w[64] = {0};
    struct tensor src = tensor_2d(w, DTYPE_F32, 2, 32), dst = tensor_2d(NULL, DTYPE_Q4_1, 2, 32);
    struct error err = {0};
    ASSERT_EQ(b->ops->upload_weight(b, &dst, &src, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "Q4_1") != NULL);
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// RoPE + KV write and paged attention

static double kv_tol(enum dtype dt) {
    return dt == DTYPE_F32 ? 1e-12 : dt == DTYPE_BF16 ? 1e-4 : dt == DTYPE_F16 ? 1e-5 : 5e-3;
}

// Reference RoPE of one head in double (angle from the fp32 product, as the op computes it).
static void ref_rope(double *x, int pos, const float *inv_freq, int rot, float attn_factor, bool inter) {
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float ang = (float)pos * inv_freq[i];
        double c = cos((double)ang) * attn_factor, s = sin((double)ang) * attn_factor;
        int a = inter ? 2 * i : i, bb = inter ? 2 * i + 1 : i + half;
        double x0 = x[a], x1 = x[bb];
        x[a] = x0 * c - x1 * s;
        x[bb] = x1 * c + x0 * s;
    }
}

static float kv_read(const struct tensor *t, float scale, int64_t idx) {
    switch (t->dtype) {
    case DTYPE_F32:
        return ((const float *)t->data)[idx];
    case DTYPE_BF16:
        return bf16_to_f32(((const uint16_t *)t->data)[idx]);
    case DTYPE_F16:
        return f16_to_f32(((const uint16_t *)t->data)[idx]);
    case DTYPE_FP8_E4M3:
        return fp8_e4m3_to_f32(((const uint8_t *)t->data)[idx]) * scale;
    default:
        abort();
    }
}

struct attn_case {
    int n_seqs;
    int q_lens[6];
    int ctx_lens[6];
    int hq, hk, d, dv, bs;
    int window;
    bool sinks;
    bool fused; // q/k/v as views into one (n, (hq + 2 hk) d) buffer
    bool interleaved;
    int rot; // rotary dim
    enum dtype kv_dtype;
};

// Runs one case: writes the earlier context of each sequence through rope_kv_write (as
// previous steps would have), then this step's tokens, then attention; checks q/k after RoPE,
// the cache contents and the attention output against double-precision references.
static void run_attn_case(struct backend *b, const struct attn_case *c) {
    const int hq = c->hq, hk = c->hk, d = c->d, dv = c->dv, bs = c->bs;
    int max_blocks = 0, total_blocks = 0, n_tokens = 0;
    int32_t qs[7] = {0};
    for (int s = 0; s < c->n_seqs; s++) {
        int nb = (c->ctx_lens[s] + bs - 1) / bs;
        if (nb > max_blocks) max_blocks = nb;
        total_blocks += nb;
        n_tokens += c->q_lens[s];
        qs[s + 1] = qs[s] + c->q_lens[s];
    }
    int num_blocks = total_blocks + 3; // some unused blocks
    // Non-contiguous block tables: a random permutation of physical blocks.
    int *perm = malloc(num_blocks * sizeof(int));
    for (int i = 0; i < num_blocks; i++)
        perm[i] = i;
    for (int i = num_blocks - 1; i > 0; i--) {
        int j = rng_int(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t *bt = calloc((size_t)c->n_seqs * max_blocks, 4);
    int used = 0;
    for (int s = 0; s < c->n_seqs; s++)
        for (int j = 0; j < (c->ctx_lens[s] + bs - 1) / bs; j++)
            bt[s * max_blocks + j] = perm[used++];

    size_t esz = dtype_block_bytes(c->kv_dtype);
    int64_t k_elems = (int64_t)num_blocks * bs * hk * d, v_elems = (int64_t)num_blocks * bs * hk * dv;
    void *kc = calloc(k_elems, esz), *vc = calloc(v_elems, esz);
    int64_t kne[4] = {num_blocks, bs, hk, d}, vne[4] = {num_blocks, bs, hk, dv};
    struct kv_layer kv = {tensor_make(kc, c->kv_dtype, 4, kne), tensor_make(vc, c->kv_dtype, 4, vne), 1.0f, 1.0f};
    if (c->kv_dtype == DTYPE_FP8_E4M3) {
        kv.k_scale = 0.02f;
        kv.v_scale = 0.015f;
    }

    int half = c->rot / 2;
    float *inv_freq = malloc((half > 0 ? half : 1) * 4);
    for (int i = 0; i < half; i++)
        inv_freq[i] = powf(10000.0f, -2.0f * i / c->rot);
    struct rope_args rope = {
        .inv_freq = inv_freq, .rotary_dim = c->rot, .attn_factor = 1.0f, .interleaved = c->interleaved};
    if (c->fused) rope.attn_factor = 1.1f;

    // Every token of every sequence (context), as raw q/k/v; the step processes the last q_len.
    int total_ctx = 0;
    int ctx_off[7] = {0};
    for (int s = 0; s < c->n_seqs; s++) {
        total_ctx += c->ctx_lens[s];
        ctx_off[s + 1] = total_ctx;
    }
    int64_t row = (int64_t)(hq + 2 * hk) * d; // fused row (dv == d when fused)
    float *all_q = malloc((size_t)total_ctx * hq * d * 4), *all_k = malloc((size_t)total_ctx * hk * d * 4);
    float *all_v = malloc((size_t)total_ctx * hk * dv * 4);
    fill_sym(all_q, (int64_t)total_ctx * hq * d, 1.0f);
    fill_sym(all_k, (int64_t)total_ctx * hk * d, 1.0f);
    fill_sym(all_v, (int64_t)total_ctx * hk * dv, 1.0f);
    float *sinks = malloc(hq * 4);
    fill_sym(sinks, hq, 2.0f);

    // Pass 1: earlier tokens (one "prefill" step per sequence, no attention), slot by block table.
    for (int s = 0; s < c->n_seqs; s++) {
        int n_prev = c->ctx_lens[s] - c->q_lens[s];
        if (n_prev == 0) continue;
        float *k = malloc((size_t)n_prev * hk * d * 4), *v = malloc((size_t)n_prev * hk * dv * 4);
        memcpy(k, all_k + (size_t)ctx_off[s] * hk * d, (size_t)n_prev * hk * d * 4);
        memcpy(v, all_v + (size_t)ctx_off[s] * hk * dv, (size_t)n_prev * hk * dv * 4);
        int32_t *pos = malloc(n_prev * 4), *slot = malloc(n_prev * 4);
        for (int i = 0; i < n_prev; i++) {
            pos[i] = i;
            slot[i] = bt[s * max_blocks + i / bs] * bs + i % bs;
        }
        struct attn_metadata md = {
            .n_seqs = 1, .n_tokens = n_prev, .block_size = bs, .h_positions = pos, .h_slot_mapping = slot};
        int64_t kne3[3] = {n_prev, hk, d}, vne3[3] = {n_prev, hk, dv};
        struct tensor tk = tensor_make(k, DTYPE_F32, 3, kne3), tv = tensor_make(v, DTYPE_F32, 3, vne3);
        b->ops->rope_kv_write(b, NULL, &tk, &tv, 0, &rope, &kv, &md);
        free(k);
        free(v);
        free(pos);
        free(slot);
    }

    // Pass 2: this step's tokens (plus one padding token with slot -1 at the end).
    int n_rows = n_tokens + 1;
    float *buf = NULL, *qb, *kb, *vb;
    int64_t qstride, kstride, vstride;
    if (c->fused) {
        buf = gbuf((size_t)n_rows * row * 4);
        qb = buf;
        kb = buf + (int64_t)hq * d;
        vb = buf + (int64_t)(hq + hk) * d;
        qstride = kstride = vstride = row;
    } else {
        buf = gbuf((size_t)n_rows * (hq * d + hk * d + hk * dv) * 4);
        qb = buf;
        kb = qb + (size_t)n_rows * hq * d;
        vb = kb + (size_t)n_rows * hk * d;
        qstride = (int64_t)hq * d;
        kstride = (int64_t)hk * d;
        vstride = (int64_t)hk * dv;
    }
    int32_t *pos = malloc(n_rows * 4), *slot = malloc(n_rows * 4);
    int t = 0;
    for (int s = 0; s < c->n_seqs; s++)
        for (int i = c->ctx_lens[s] - c->q_lens[s]; i < c->ctx_lens[s]; i++, t++) {
            int g = ctx_off[s] + i;
            memcpy(qb + t * qstride, all_q + (size_t)g * hq * d, (size_t)hq * d * 4);
            memcpy(kb + t * kstride, all_k + (size_t)g * hk * d, (size_t)hk * d * 4);
            memcpy(vb + t * vstride, all_v + (size_t)g * hk * dv, (size_t)hk * dv * 4);
            pos[t] = i;
            slot[t] = bt[s * max_blocks + i / bs] * bs + i % bs;
        }
    pos[t] = 0;
    slot[t] = -1; // padding: must not be written
    fill_sym(qb + t * qstride, (int64_t)hq * d, 1.0f);
    fill_sym(kb + t * kstride, (int64_t)hk * d, 1.0f);
    struct attn_metadata md = {
        .n_seqs = c->n_seqs,
        .n_tokens = n_tokens,
        .max_blocks_per_seq = max_blocks,
        .block_size = bs,
        .h_query_start = qs,
        .h_context_lens = c->ctx_lens,
        .h_block_tables = bt,
        .h_positions = pos,
        .h_slot_mapping = slot,
    };
    md.query_start = md.h_query_start;
    md.context_lens = md.h_context_lens;
    md.block_tables = md.h_block_tables;
    md.positions = md.h_positions;
    md.slot_mapping = md.h_slot_mapping;
    // Snapshot the cache to check the padding row writes nothing.
    int64_t qne[3] = {n_rows, hq, d}, kne3[3] = {n_rows, hk, d}, vne3[3] = {n_rows, hk, dv};
    struct tensor tq = tensor_make(qb, DTYPE_F32, 3, qne), tk = tensor_make(kb, DTYPE_F32, 3, kne3);
    struct tensor tv = tensor_make(vb, DTYPE_F32, 3, vne3);
    b->ops->rope_kv_write(b, &tq, &tk, &tv, c->fused ? row : 0, &rope, &kv, &md);

    // Check RoPE'd q/k of the step's tokens and the cache contents of every context token.
    double *ref = malloc((size_t)(hq > hk ? hq : hk) * (d > dv ? d : dv) * 8);
    double *rq = malloc((size_t)n_tokens * hq * d * 8);
    float *gq = malloc((size_t)n_tokens * hq * d * 4);
    double err_num = 0, err_den = 0;
    t = 0;
    for (int s = 0; s < c->n_seqs; s++)
        for (int i = c->ctx_lens[s] - c->q_lens[s]; i < c->ctx_lens[s]; i++, t++) {
            int g = ctx_off[s] + i;
            for (int h = 0; h < hq; h++) {
                double *r = rq + ((size_t)t * hq + h) * d;
                for (int e = 0; e < d; e++)
                    r[e] = all_q[((size_t)g * hq + h) * d + e];
                ref_rope(r, i, inv_freq, c->rot, rope.attn_factor, c->interleaved);
                for (int e = 0; e < d; e++)
                    gq[((size_t)t * hq + h) * d + e] = qb[t * qstride + h * d + e];
            }
        }
    double e_q = nmse(gq, rq, (int64_t)n_tokens * hq * d);
    if (!(e_q < 1e-11)) test_fail(__FILE__, __LINE__, "rope q nmse %g", e_q);
    for (int s = 0; s < c->n_seqs; s++)
        for (int i = 0; i < c->ctx_lens[s]; i++) {
            int g = ctx_off[s] + i;
            int64_t sl = (int64_t)bt[s * max_blocks + i / bs] * bs + i % bs;
            for (int h = 0; h < hk; h++) {
                for (int e = 0; e < d; e++)
                    ref[e] = all_k[((size_t)g * hk + h) * d + e];
                ref_rope(ref, i, inv_freq, c->rot, rope.attn_factor, c->interleaved);
                for (int e = 0; e < d; e++) {
                    double dd = kv_read(&kv.k, kv.k_scale, (sl * hk + h) * d + e) - ref[e];
                    err_num += dd * dd;
                    err_den += ref[e] * ref[e];
                }
                for (int e = 0; e < dv; e++) {
                    double r = all_v[((size_t)g * hk + h) * dv + e];
                    double dd = kv_read(&kv.v, kv.v_scale, (sl * hk + h) * dv + e) - r;
                    err_num += dd * dd;
                    err_den += r * r;
                }
            }
        }
    if (!(err_num / err_den < kv_tol(c->kv_dtype)))
        test_fail(__FILE__, __LINE__, "kv cache contents nmse %g (%s)", err_num / err_den, dtype_name(c->kv_dtype));
    // Unused blocks stay zero (the padding token's slot -1 wrote nothing).
    for (int i = used; i < num_blocks; i++) {
        const unsigned char *kb8 = (const unsigned char *)kc + (size_t)perm[i] * bs * hk * d * esz;
        for (size_t e = 0; e < (size_t)bs * hk * d * esz; e++)
            if (kb8[e]) {
                test_fail(__FILE__, __LINE__, "unused cache block %d written", perm[i]);
                i = num_blocks;
                break;
            }
    }

    // Attention.
    float *out = gbuf((size_t)n_tokens * hq * dv * 4);
    int64_t one[1] = {hq};
    struct tensor tsinks = tensor_make(sinks, DTYPE_F32, 1, one);
    int64_t one_ne[3] = {n_tokens, hq, d}, one_ne_o[3] = {n_tokens, hq, dv};
    struct tensor tq2 = tensor_make(qb, DTYPE_F32, 3, one_ne), to = tensor_make(out, DTYPE_F32, 3, one_ne_o);
    float scale = 1.0f / sqrtf((float)d);
    b->ops->attention(b, &to, &tq2, c->fused ? row : 0, &kv, &md, scale, c->window, c->sinks ? &tsinks : NULL);
    double *ro = malloc((size_t)n_tokens * hq * dv * 8);
    int maxctx = 0;
    for (int s = 0; s < c->n_seqs; s++)
        if (c->ctx_lens[s] > maxctx) maxctx = c->ctx_lens[s];
    double *sc = malloc((size_t)maxctx * 8);
    t = 0;
    for (int s = 0; s < c->n_seqs; s++)
        for (int i = c->ctx_lens[s] - c->q_lens[s]; i < c->ctx_lens[s]; i++, t++) {
            for (int h = 0; h < hq; h++) {
                int g = h / (hq / hk);
                const double *qv = rq + ((size_t)t * hq + h) * d;
                int lo = c->window > 0 && i - c->window + 1 > 0 ? i - c->window + 1 : 0;
                double mx = c->sinks ? sinks[h] : -INFINITY;
                for (int j = lo; j <= i; j++) {
                    int64_t sl = (int64_t)bt[s * max_blocks + j / bs] * bs + j % bs;
                    double acc = 0;
                    for (int e = 0; e < d; e++)
                        acc += qv[e] * kv_read(&kv.k, kv.k_scale, (sl * hk + g) * d + e);
                    sc[j] = acc * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                double den = c->sinks ? exp(sinks[h] - mx) : 0.0;
                for (int j = lo; j <= i; j++)
                    den += exp(sc[j] - mx);
                double *o = ro + ((size_t)t * hq + h) * dv;
                for (int e = 0; e < dv; e++)
                    o[e] = 0;
                for (int j = lo; j <= i; j++) {
                    int64_t sl = (int64_t)bt[s * max_blocks + j / bs] * bs + j % bs;
                    double p = exp(sc[j] - mx) / den;
                    for (int e = 0; e < dv; e++)
                        o[e] += p * kv_read(&kv.v, kv.v_scale, (sl * hk + g) * dv + e);
                }
            }
        }
    double e_o = nmse(out, ro, (int64_t)n_tokens * hq * dv);
    if (!(e_o < 1e-10))
        test_fail(__FILE__, __LINE__, "attention nmse %g (hq %d hk %d d %d bs %d window %d sinks %d %s)", e_o, hq, hk,
                  d, bs, c->window, c->sinks, dtype_name(c->kv_dtype));
    if (!all_finite(out, (int64_t)n_tokens * hq * dv)) test_fail(__FILE__, __LINE__, "attention output not finite");
    if (!guard_ok(out, (size_t)n_tokens * hq * dv * 4)) test_fail(__FILE__, __LINE__, "attention wrote past out");
    size_t buf_bytes = c->fused ? (size_t)n_rows * row * 4 : (size_t)n_rows * (hq * d + hk * d + hk * dv) * 4;
    if (!guard_ok(buf, buf_bytes)) test_fail(__FILE__, __LINE__, "rope_kv_write wrote past q/k/v");

    free(perm);
    free(bt);
    free(kc);
    free(vc);
    free(inv_freq);
    free(all_q);
    free(all_k);
    free(all_v);
    free(sinks);
    free(buf);
    free(pos);
    free(slot);
    free(ref);
    free(rq);
    free(gq);
    free(out);
    free(ro);
    free(sc);
}

TEST(attention_decode_only_gqa_ratios) {
    struct backend *b = make_backend(2);
    int ratios[][2] = {{13, 13}, {8, 2}, {16, 2}};
    for (int r = 0; r < 3; r++) {
        struct attn_case c = {.n_seqs = 4,
                              .q_lens = {1, 1, 1, 1},
                              .ctx_lens = {1, 17, 40, 16},
                              .hq = ratios[r][0],
                              .hk = ratios[r][1],
                              .d = 64,
                              .dv = 64,
                              .bs = 16,
                              .rot = 64,
                              .kv_dtype = DTYPE_F32};
        run_attn_case(b, &c);
        if (test_failed_now()) break;
    }
    backend_destroy(b);
}

TEST(attention_mixed_prefill_decode_head_dim_80) {
    struct backend *b = make_backend(2);
    // Fresh prefill, decode, chunked prefill over cached context, odd lengths.
    struct attn_case c = {.n_seqs = 4,
                          .q_lens = {21, 1, 37, 1},
                          .ctx_lens = {21, 50, 70, 3},
                          .hq = 12,
                          .hk = 3,
                          .d = 80,
                          .dv = 80,
                          .bs = 16,
                          .rot = 80,
                          .kv_dtype = DTYPE_F32};
    run_attn_case(b, &c);
    backend_destroy(b);
}

TEST(attention_sliding_window_sinks_partial_rotary_interleaved) {
    struct backend *b = make_backend(3);
    struct attn_case c = {.n_seqs = 3,
                          .q_lens = {19, 1, 5},
                          .ctx_lens = {40, 33, 5},
                          .hq = 8,
                          .hk = 1,
                          .d = 32,
                          .dv = 32,
                          .bs = 8,
                          .window = 7,
                          .sinks = true,
                          .interleaved = true,
                          .rot = 16,
                          .kv_dtype = DTYPE_F32};
    run_attn_case(b, &c);
    backend_destroy(b);
}

TEST(attention_fused_qkv_bf16_and_fp8_cache) {
    struct backend *b = make_backend(2);
    enum dtype dts[] = {DTYPE_BF16, DTYPE_FP8_E4M3, DTYPE_F16};
    for (int i = 0; i < 3; i++) {
        struct attn_case c = {.n_seqs = 3,
                              .q_lens = {9, 1, 1},
                              .ctx_lens = {25, 18, 64},
                              .hq = 8,
                              .hk = 2,
                              .d = 64,
                              .dv = 64,
                              .bs = 16,
                              .fused = true,
                              .rot = 48,
                              .kv_dtype = dts[i]};
        run_attn_case(b, &c);
        if (test_failed_now()) break;
    }
    backend_destroy(b);
}

// rope_kv_write's per-head q/k RMSNorm (Qwen3 qk_norm) is the rmsnorm op over each head followed
// by the rotation, bit for bit: fused qkv rows, partial rotary, BF16 norm weights, a padding
// token (rotated, not stored), and k-only calls (q NULL: q_norm ignored).
TEST(rope_kv_write_qk_norm_equals_rmsnorm_then_rope) {
    struct backend *b = make_backend(2);
    const int n = 5, hq = 4, hk = 2, d = 64, rot = 32, bs = 16, nb = 2;
    const int64_t row = (int64_t)(hq + 2 * hk) * d;
    float *qkv = malloc(n * row * 4), *ref = malloc(n * row * 4);
    fill_sym(qkv, n * row, 2.0f);
    memcpy(ref, qkv, n * row * 4);
    float wq[64], wk[64], inv_freq[16];
    uint16_t wk16[64];
    fill_sym(wq, d, 1.5f);
    fill_sym(wk, d, 1.5f);
    for (int i = 0; i < d; i++) {
        wk16[i] = f32_to_bf16(wk[i]);
        wk[i] = bf16_to_f32(wk16[i]);
    }
    for (int i = 0; i < rot / 2; i++)
        inv_freq[i] = powf(10000.0f, -2.0f * i / rot);
    int32_t pos[5] = {0, 3, 7, 8, 30}, slot[5] = {0, 5, -1, 17, 31};
    struct attn_metadata md = {
        .n_seqs = 1, .n_tokens = n, .block_size = bs, .h_positions = pos, .h_slot_mapping = slot};
    md.positions = pos;
    md.slot_mapping = slot;
    const float eps = 1e-6f;
    for (int pass = 0; pass < 2; pass++) { // pass 1: k only
        float *kc[2], *vc[2];
        struct kv_layer kv[2];
        for (int i = 0; i < 2; i++) {
            kc[i] = calloc((size_t)nb * bs * hk * d, 4);
            vc[i] = calloc((size_t)nb * bs * hk * d, 4);
            int64_t ne[4] = {nb, bs, hk, d};
            kv[i] =
                (struct kv_layer){tensor_make(kc[i], DTYPE_F32, 4, ne), tensor_make(vc[i], DTYPE_F32, 4, ne), 1.f, 1.f};
        }
        struct tensor twq = tensor_make(wq, DTYPE_F32, 1, (int64_t[]){d});
        struct tensor twk = tensor_make(wk16, DTYPE_BF16, 1, (int64_t[]){d});
        struct rope_args plain = {.inv_freq = inv_freq, .rotary_dim = rot, .attn_factor = 1.0f};
        struct rope_args fused = plain;
        fused.q_norm = &twq;
        fused.k_norm = &twk;
        fused.norm_eps = eps;
        // Reference: rmsnorm over every q / k head row (rows of d inside the fused buffer), then RoPE.
        struct tensor twk32 = tensor_make(wk, DTYPE_F32, 1, (int64_t[]){d});
        for (int t = 0; t < n; t++) {
            struct tensor qh = tensor_2d(ref + t * row, DTYPE_F32, hq, d);
            struct tensor kh = tensor_2d(ref + t * row + hq * d, DTYPE_F32, hk, d);
            if (pass == 0) b->ops->rmsnorm(b, &qh, &qh, &twq, eps);
            b->ops->rmsnorm(b, &kh, &kh, &twk32, eps);
        }
        float *bufs[2] = {ref, qkv};
        struct rope_args *args[2] = {&plain, &fused};
        for (int i = 0; i < 2; i++) {
            struct tensor q = tensor_make(bufs[i], DTYPE_F32, 3, (int64_t[]){n, hq, d});
            struct tensor k = tensor_make(bufs[i] + hq * d, DTYPE_F32, 3, (int64_t[]){n, hk, d});
            struct tensor v = tensor_make(bufs[i] + (hq + hk) * d, DTYPE_F32, 3, (int64_t[]){n, hk, d});
            b->ops->rope_kv_write(b, pass == 0 ? &q : NULL, &k, &v, row, args[i], &kv[i], &md);
        }
        ASSERT_TRUE(memcmp(qkv, ref, n * row * 4) == 0);
        ASSERT_TRUE(memcmp(kc[0], kc[1], (size_t)nb * bs * hk * d * 4) == 0);
        ASSERT_TRUE(memcmp(vc[0], vc[1], (size_t)nb * bs * hk * d * 4) == 0);
        for (int i = 0; i < 2; i++) {
            free(kc[i]);
            free(vc[i]);
        }
    }
    free(qkv);
    free(ref);
    backend_destroy(b);
}

TEST(attention_random_shapes) {
    struct backend *b = make_backend(2);
    for (int iter = 0; iter < 12 && !test_failed_now(); iter++) {
        struct attn_case c = {0};
        c.n_seqs = 1 + rng_int(5);
        int hks[] = {1, 2, 3}, reps[] = {1, 4, 8};
        c.hk = hks[rng_int(3)];
        c.hq = c.hk * reps[rng_int(3)];
        int ds[] = {16, 40, 64, 80};
        c.d = c.dv = ds[rng_int(4)];
        int bss[] = {1, 4, 16};
        c.bs = bss[rng_int(3)];
        for (int s = 0; s < c.n_seqs; s++) {
            c.ctx_lens[s] = 1 + rng_int(70);
            c.q_lens[s] = rng_int(2) ? 1 : 1 + rng_int(c.ctx_lens[s]);
        }
        c.window = rng_int(3) == 0 ? 1 + rng_int(20) : 0;
        c.sinks = rng_int(4) == 0;
        c.fused = rng_int(2);
        c.interleaved = rng_int(2);
        c.rot = c.d - 8 * rng_int(2);
        enum dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_FP8_E4M3, DTYPE_F16};
        c.kv_dtype = dts[rng_int(4)];
        run_attn_case(b, &c);
    }
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// Results do not depend on the thread count: every output element is computed by one thread
// in a fixed order, so 1 and 3 threads agree bit for bit (the skinny matmul, norms, attention),
// and a decode row's matmul output does not depend on the other rows of its batch (n <= 8).

TEST(outputs_identical_across_thread_counts) {
    struct backend *b1 = make_backend(1), *b3 = make_backend(3);
    int n = 3, k = 200, m = 700, d = 64, rows = 900;
    float *x = malloc((size_t)n * k * 4), *w = malloc((size_t)m * k * 4), *o1 = malloc((size_t)n * m * 4);
    float *o3 = malloc((size_t)n * m * 4), *nx = malloc((size_t)rows * d * 4), *nw = malloc(d * 4);
    float *r1 = malloc((size_t)rows * d * 4), *r3 = malloc((size_t)rows * d * 4);
    fill_sym(x, (int64_t)n * k, 1.0f);
    fill_sym(w, (int64_t)m * k, 1.0f);
    fill_sym(nx, (int64_t)rows * d, 2.0f);
    fill_sym(nw, d, 1.0f);
    struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), tw = tensor_2d(w, DTYPE_F32, m, k);
    struct tensor t1 = tensor_2d(o1, DTYPE_F32, n, m), t3 = tensor_2d(o3, DTYPE_F32, n, m);
    b1->ops->matmul(b1, &t1, &tx, WEIGHT_PLAIN(&tw), NULL);
    b3->ops->matmul(b3, &t3, &tx, WEIGHT_PLAIN(&tw), NULL);
    ASSERT_TRUE(memcmp(o1, o3, (size_t)n * m * 4) == 0);
    // Batch invariance of the skinny (decode) matmul: row i alone == row i of the batch of 3.
    for (int i = 0; i < n; i++) {
        struct tensor xi = tensor_2d(x + (size_t)i * k, DTYPE_F32, 1, k), oi = tensor_2d(o3, DTYPE_F32, 1, m);
        b3->ops->matmul(b3, &oi, &xi, WEIGHT_PLAIN(&tw), NULL);
        ASSERT_TRUE(memcmp(o3, o1 + (size_t)i * m, (size_t)m * 4) == 0);
    }
    struct tensor tnx = tensor_2d(nx, DTYPE_F32, rows, d), tnw = tensor_2d(nw, DTYPE_F32, 1, d);
    struct tensor tr1 = tensor_2d(r1, DTYPE_F32, rows, d), tr3 = tensor_2d(r3, DTYPE_F32, rows, d);
    b1->ops->rmsnorm(b1, &tr1, &tnx, &tnw, 1e-6f);
    b3->ops->rmsnorm(b3, &tr3, &tnx, &tnw, 1e-6f);
    ASSERT_TRUE(memcmp(r1, r3, (size_t)rows * d * 4) == 0);
    // Attention over a mixed batch: same cache, same queries.
    int hq = 8, hk = 2, bs = 16, n_seqs = 3;
    int32_t qs[4] = {0, 40, 41, 50}, cl[3] = {40, 70, 30}, bt[3 * 5], pos[50], slot[50];
    for (int i = 0; i < 15; i++)
        bt[i] = (i * 7) % 16;
    int64_t kne[4] = {16, bs, hk, d};
    float *kc = malloc((size_t)16 * bs * hk * d * 4), *vc = malloc((size_t)16 * bs * hk * d * 4);
    fill_sym(kc, (int64_t)16 * bs * hk * d, 1.0f);
    fill_sym(vc, (int64_t)16 * bs * hk * d, 1.0f);
    struct kv_layer kv = {tensor_make(kc, DTYPE_F32, 4, kne), tensor_make(vc, DTYPE_F32, 4, kne), 1.0f, 1.0f};
    struct attn_metadata md = {.n_seqs = n_seqs,
                               .n_tokens = 50,
                               .max_blocks_per_seq = 5,
                               .block_size = bs,
                               .h_query_start = qs,
                               .h_context_lens = cl,
                               .h_block_tables = bt,
                               .h_positions = pos,
                               .h_slot_mapping = slot};
    float *q = malloc((size_t)50 * hq * d * 4), *a1 = malloc((size_t)50 * hq * d * 4),
          *a3 = malloc((size_t)50 * hq * d * 4);
    fill_sym(q, (int64_t)50 * hq * d, 1.0f);
    int64_t qne[3] = {50, hq, d};
    struct tensor tq = tensor_make(q, DTYPE_F32, 3, qne), ta1 = tensor_make(a1, DTYPE_F32, 3, qne);
    struct tensor ta3 = tensor_make(a3, DTYPE_F32, 3, qne);
    b1->ops->attention(b1, &ta1, &tq, 0, &kv, &md, 0.125f, 0, NULL);
    b3->ops->attention(b3, &ta3, &tq, 0, &kv, &md, 0.125f, 0, NULL);
    ASSERT_TRUE(memcmp(a1, a3, (size_t)50 * hq * d * 4) == 0);
    free(x);
    free(w);
    free(o1);
    free(o3);
    free(nx);
    free(nw);
    free(r1);
    free(r3);
    free(kc);
    free(vc);
    free(q);
    free(a1);
    free(a3);
    backend_destroy(b1);
    backend_destroy(b3);
}

// Batch-invariant mode: every matmul goes through the row-independent kernel, so a row's output
// is the same bits whether it is computed alone or inside a large batch (prefill chunk); the
// default mode's OpenBLAS path (n > 8) does not promise that.
TEST(batch_invariant_mode_matmul_rows_independent_of_batch) {
    struct backend_options o = {.num_threads = 2, .batch_invariant = true};
    struct backend *b = NULL;
    struct error err = {0};
    ASSERT_OK(backend_cpu_create(&o, &b, &err));
    enum dtype wdts[] = {DTYPE_F32, DTYPE_BF16};
    for (int wi = 0; wi < 2; wi++) {
        int n = 75, k = 136, m = 203;
        float *x = malloc((size_t)n * k * 4), *wf = malloc((size_t)m * k * 4), *big = gbuf((size_t)n * m * 4);
        float *one = malloc((size_t)m * 4);
        void *w = malloc((size_t)m * k * 4);
        fill_sym(x, (int64_t)n * k, 1.0f);
        fill_sym(wf, (int64_t)m * k, 1.0f);
        dtype_from_f32(wdts[wi], wf, w, (int64_t)m * k);
        struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), tw = tensor_2d(w, wdts[wi], m, k);
        struct tensor tbig = tensor_2d(big, DTYPE_F32, n, m);
        b->ops->matmul(b, &tbig, &tx, WEIGHT_PLAIN(&tw), NULL);
        ASSERT_TRUE(guard_ok(big, (size_t)n * m * 4));
        double *ref = malloc((size_t)n * m * 8);
        dtype_to_f32(wdts[wi], w, wf, (int64_t)m * k);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < m; j++) {
                double acc = 0;
                for (int t = 0; t < k; t++)
                    acc += (double)x[(size_t)i * k + t] * wf[(size_t)j * k + t];
                ref[(size_t)i * m + j] = acc;
            }
        ASSERT_TRUE(nmse(big, ref, (int64_t)n * m) < 1e-11);
        for (int i = 0; i < n; i += 7) {
            struct tensor xi = tensor_2d(x + (size_t)i * k, DTYPE_F32, 1, k), oi = tensor_2d(one, DTYPE_F32, 1, m);
            b->ops->matmul(b, &oi, &xi, WEIGHT_PLAIN(&tw), NULL);
            ASSERT_TRUE(memcmp(one, big + (size_t)i * m, (size_t)m * 4) == 0);
        }
        free(x);
        free(wf);
        free(big);
        free(one);
        free(w);
        free(ref);
    }
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// Concurrent callers on one backend

struct conc_arg {
    struct backend *b;
    int ok;
};
static void *conc_matmul(void *varg) {
    struct conc_arg *a = varg;
    int n = 9, k = 300, m = 200;
    float *x = malloc((size_t)n * k * 4), *w = malloc((size_t)m * k * 4), *o = malloc((size_t)n * m * 4);
    float *o2 = malloc((size_t)n * m * 4), *res = malloc((size_t)n * m * 4), *nw = malloc((size_t)m * 4);
    for (int i = 0; i < n * k; i++)
        x[i] = (float)((i * 7) % 13) - 6;
    for (int i = 0; i < m * k; i++)
        w[i] = (float)((i * 5) % 11) - 5;
    for (int i = 0; i < m; i++)
        nw[i] = 1.0f;
    struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), tw = tensor_2d(w, DTYPE_F32, m, k);
    struct tensor to = tensor_2d(o, DTYPE_F32, n, m), to2 = tensor_2d(o2, DTYPE_F32, n, m);
    struct tensor tr = tensor_2d(res, DTYPE_F32, n, m), tn = tensor_2d(nw, DTYPE_F32, 1, m);
    a->b->ops->matmul(a->b, &to, &tx, WEIGHT_PLAIN(&tw), NULL);
    a->ok = 1;
    for (int it = 0; it < 50; it++) {
        a->b->ops->matmul(a->b, &to2, &tx, WEIGHT_PLAIN(&tw), NULL);
        if (memcmp(o, o2, (size_t)n * m * 4)) a->ok = 0; // integers: exact
        memset(res, 0, (size_t)n * m * 4);
        a->b->ops->add_rmsnorm(a->b, &to2, &tr, &to, &tn, 1e-6f);
        if (memcmp(res, o, (size_t)n * m * 4)) a->ok = 0;
    }
    free(x);
    free(w);
    free(o);
    free(o2);
    free(res);
    free(nw);
    return NULL;
}

TEST(concurrent_callers_share_one_backend) {
    struct backend *b = make_backend(2);
    struct conc_arg a[3] = {{b, 0}, {b, 0}, {b, 0}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++)
        pthread_create(&th[i], NULL, conc_matmul, &a[i]);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++)
        ASSERT_TRUE(a[i].ok);
    backend_destroy(b);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
