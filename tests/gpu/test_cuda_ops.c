// CUDA backend ops against the CPU reference backend, both driven through backend.h.
//
// Every test draws random inputs (odd sizes included), rounds them to what both backends
// can hold exactly (bf16, or fp8 for FP8 caches), runs the op on each backend and compares
// the results as normalised MSE  sum((gpu - cpu)^2) / sum(cpu^2)  under a per-dtype
// threshold, rejects NaN/Inf, and checks that guard bytes after every GPU buffer are
// untouched. Outputs start poisoned (NaN bytes), so an unwritten element fails the test.
// Runs only where a GPU is (make CUDA=1 gpu-test on the GPU machine).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "common/check.h"
#include "core/dtype.h"
#include "test.h"

#define GUARD 256
#define NMSE_BF16 1e-4 // bf16 outputs of f32-accumulated ops
#define NMSE_FP8 4e-3  // values that went through an FP8 cache

// ---------------------------------------------------------------------------------------
// Fixture: one CPU and one CUDA backend for the whole binary (tests stay independent: each
// frees what it allocates).

static struct backend *cpu_be, *gpu_be;
static uint64_t rng_state = 0x1234567887654321ull;

static int backends_ready(void) {
    if (gpu_be) return 1;
    struct error err = {0};
    struct backend_options o = {.num_threads = 0, .device_id = 0, .kv_pool_bytes = 64u << 20};
    if (backend_create("cpu", &o, &cpu_be, &err) != ATOMC_OK) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return 0;
    }
    if (backend_create("cuda", &o, &gpu_be, &err) != ATOMC_OK) {
        fprintf(stderr, "cuda backend: %s\n", err.msg);
        return 0;
    }
    return 1;
}

static uint64_t rng_next(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}
static float rng_uniform(void) { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)); } // [0,1)
static float rng_sym(float scale) { return (2.f * rng_uniform() - 1.f) * scale; }
static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }
static float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static float *rand_vec(int64_t n, float scale) {
    float *v = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = round_bf16(rng_sym(scale));
    return v;
}

// ---------------------------------------------------------------------------------------
// Allocations with guard bytes, tracked per test.

#define MAX_ALLOCS 2048 // per test (the attention case over 3 head dims x 3 groups x 2 KV dtypes allocates many)
struct pool {
    int n;
    struct {
        struct backend *b;
        void *p;
        size_t bytes;
        bool guarded; // false: a weight allocation made by upload_weight (no guard after it)
    } a[MAX_ALLOCS];
};

static unsigned char guard_pattern[GUARD];

static void *pool_alloc(struct pool *P, struct backend *b, size_t bytes) {
    void *p = b->ops->alloc(b, bytes + GUARD);
    CHECK(p && P->n < MAX_ALLOCS);
    if (!guard_pattern[0])
        for (int i = 0; i < GUARD; i++) guard_pattern[i] = (unsigned char)(0xA5 ^ (i * 29));
    b->ops->copy_h2d(b, (char *)p + bytes, guard_pattern, GUARD);
    P->a[P->n].b = b;
    P->a[P->n].p = p;
    P->a[P->n].bytes = bytes;
    P->a[P->n].guarded = true;
    P->n++;
    return p;
}

// Checks every allocation's guard, frees everything; returns the number of broken guards.
static int pool_release(struct pool *P) {
    int bad = 0;
    unsigned char g[GUARD];
    for (int i = 0; i < P->n; i++) {
        struct backend *b = P->a[i].b;
        if (P->a[i].guarded) b->ops->copy_d2h(b, g, (char *)P->a[i].p + P->a[i].bytes, GUARD);
        if (P->a[i].guarded && memcmp(g, guard_pattern, GUARD)) {
            fprintf(stderr, "  guard bytes overwritten after a %zu-byte %s buffer\n", P->a[i].bytes, b->ops->name);
            bad++;
        }
        b->ops->free(b, P->a[i].p);
    }
    P->n = 0;
    return bad;
}

// A tensor of dtype dt on backend b holding host values (NULL: poisoned with 0xff bytes, NaN
// in every float type).
static struct tensor mk(struct pool *P, struct backend *b, enum dtype dt, int ndim, const int64_t *ne, const float *host) {
    struct tensor t = tensor_make(NULL, dt, ndim, ne);
    size_t bytes = tensor_bytes(&t);
    t.data = pool_alloc(P, b, bytes);
    void *tmp = malloc(bytes ? bytes : 1);
    if (host) dtype_from_f32(dt, host, tmp, tensor_numel(&t));
    else memset(tmp, 0xff, bytes);
    b->ops->copy_h2d(b, t.data, tmp, bytes);
    free(tmp);
    return t;
}
static struct tensor mk2(struct pool *P, struct backend *b, enum dtype dt, int64_t r, int64_t c, const float *host) {
    int64_t ne[2] = {r, c};
    return mk(P, b, dt, 2, ne, host);
}

static int32_t *mk_i32(struct pool *P, struct backend *b, const int32_t *host, int n) {
    int32_t *p = pool_alloc(P, b, (size_t)(n > 0 ? n : 1) * 4);
    if (n > 0) b->ops->copy_h2d(b, p, host, (size_t)n * 4);
    return p;
}
static void *mk_raw(struct pool *P, struct backend *b, const void *host, size_t bytes) {
    void *p = pool_alloc(P, b, bytes);
    b->ops->copy_h2d(b, p, host, bytes);
    return p;
}

// Backend tensor -> malloc'd f32 (FP8 scaled by t->scale).
static float *get(struct backend *b, const struct tensor *t) {
    size_t bytes = tensor_bytes(t);
    int64_t n = tensor_numel(t);
    void *raw = malloc(bytes ? bytes : 1);
    b->ops->copy_d2h(b, raw, t->data, bytes);
    float *f = malloc((size_t)(n ? n : 1) * sizeof(float));
    dtype_to_f32(t->dtype, raw, f, n);
    if (t->dtype == DTYPE_FP8_E4M3)
        for (int64_t i = 0; i < n; i++) f[i] *= t->scale;
    free(raw);
    return f;
}

// Normalised MSE of a against the reference r; -1 if a has NaN/Inf.
static double nmse(const float *a, const float *r, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return -1;
        double d = (double)a[i] - r[i];
        num += d * d;
        den += (double)r[i] * r[i];
    }
    return den > 0 ? num / den : num;
}

#define ASSERT_NMSE(gpu, cpu, n, thr)                                                              \
    do {                                                                                           \
        double _e = nmse(gpu, cpu, n);                                                             \
        if (!(_e >= 0 && _e <= (thr))) {                                                           \
            test_fail(__FILE__, __LINE__, "%s vs %s: nmse %g (threshold %g; -1 = NaN/Inf)", #gpu, #cpu, _e, \
                      (double)(thr));                                                              \
            return;                                                                                \
        }                                                                                          \
    } while (0)

// Compares tensor a (gpu) against tensor r (cpu) and frees the host copies.
static double cmp_tensors(const struct tensor *g, const struct tensor *c) {
    float *fg = get(gpu_be, g), *fc = get(cpu_be, c);
    double e = nmse(fg, fc, tensor_numel(c));
    free(fg);
    free(fc);
    return e;
}
#define ASSERT_TENSORS(g, c, thr)                                                                        \
    do {                                                                                                 \
        double _e = cmp_tensors(&(g), &(c));                                                             \
        if (!(_e >= 0 && _e <= (thr))) {                                                                 \
            test_fail(__FILE__, __LINE__, "%s vs %s: nmse %g (threshold %g; -1 = NaN/Inf)", #g, #c, _e, (double)(thr)); \
            return;                                                                                      \
        }                                                                                                \
    } while (0)

#define BEGIN()                       \
    struct pool P = {0};              \
    ASSERT_TRUE(backends_ready());    \
    struct backend *G = gpu_be, *CP = cpu_be; \
    (void)G; (void)CP
#define END() ASSERT_EQ(pool_release(&P), 0)

static struct tensor upload_w(struct pool *P, struct backend *b, const float *host, int64_t r, int64_t c) {
    struct tensor src = tensor_2d((void *)host, DTYPE_F32, r, c);
    struct tensor dst = tensor_2d(NULL, b->weight_dtype, r, c);
    struct error err = {0};
    CHECK(b->ops->upload_weight(b, &dst, &src, &err) == ATOMC_OK);
    CHECK(P->n < MAX_ALLOCS);
    // Tracked without a guard (the backend owns the layout of weight allocations).
    P->a[P->n].b = b;
    P->a[P->n].p = dst.data;
    P->a[P->n].bytes = 0;
    P->a[P->n].guarded = false;
    P->n++;
    return dst;
}

// ---------------------------------------------------------------------------------------
// Weight upload and the element-wise ops.

TEST(cuda_upload_weight_dequantises_every_source_dtype) {
    BEGIN();
    enum dtype srcs[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1};
    for (size_t s = 0; s < sizeof srcs / sizeof srcs[0]; s++) {
        int64_t rows = 37, cols = 96;
        int64_t n = rows * cols;
        size_t bytes = dtype_row_bytes(srcs[s], cols) * rows;
        uint8_t *raw = malloc(bytes);
        if (srcs[s] == DTYPE_F32 || srcs[s] == DTYPE_F16 || srcs[s] == DTYPE_BF16) {
            float *v = rand_vec(n, 3.f);
            dtype_from_f32(srcs[s], v, raw, n);
            free(v);
        } else {
            size_t bb = dtype_block_bytes(srcs[s]);
            for (size_t i = 0; i < bytes; i++) raw[i] = (uint8_t)rng_next();
            for (size_t blk = 0; blk < bytes / bb; blk++) { // sane f16 scale / min
                uint16_t d = f32_to_f16(rng_sym(0.1f));
                memcpy(raw + blk * bb, &d, 2);
                if (srcs[s] == DTYPE_Q4_1) {
                    uint16_t m = f32_to_f16(rng_sym(1.f));
                    memcpy(raw + blk * bb + 2, &m, 2);
                }
            }
        }
        float *ref = malloc(n * sizeof(float));
        dtype_to_f32(srcs[s], raw, ref, n);
        for (int64_t i = 0; i < n; i++) ref[i] = round_bf16(ref[i]);
        struct tensor src = tensor_2d(raw, srcs[s], rows, cols);
        struct tensor dst = tensor_2d(NULL, DTYPE_BF16, rows, cols);
        struct error err = {0};
        ASSERT_OK(G->ops->upload_weight(G, &dst, &src, &err));
        float *got = get(G, &dst);
        ASSERT_NMSE(got, ref, n, 1e-6);
        G->ops->free(G, dst.data);
        free(got);
        free(ref);
        free(raw);
    }
    // A mismatched element count is an error, not a crash.
    float v[4] = {0};
    struct tensor src = tensor_2d(v, DTYPE_F32, 2, 2), dst = tensor_2d(NULL, DTYPE_BF16, 3, 2);
    struct error err = {0};
    ASSERT_NE(G->ops->upload_weight(G, &dst, &src, &err), ATOMC_OK);
    END();
}

TEST(cuda_embedding_matches_cpu) {
    BEGIN();
    int64_t shapes[][2] = {{1000, 4096}, {517, 100}, {64, 7}};
    for (int s = 0; s < 3; s++) {
        int64_t V = shapes[s][0], d = shapes[s][1];
        float *tab = rand_vec(V * d, 1.f);
        int n = 29;
        int32_t ids[29];
        for (int i = 0; i < n; i++) ids[i] = rng_int((int)V);
        struct tensor tg = upload_w(&P, G, tab, V, d), tc = upload_w(&P, CP, tab, V, d);
        struct tensor og = mk2(&P, G, G->act_dtype, n, d, NULL), oc = mk2(&P, CP, CP->act_dtype, n, d, NULL);
        G->ops->embedding(G, &og, &tg, mk_i32(&P, G, ids, n));
        CP->ops->embedding(CP, &oc, &tc, mk_i32(&P, CP, ids, n));
        ASSERT_TENSORS(og, oc, 1e-7);
        free(tab);
    }
    END();
}

TEST(cuda_rmsnorm_and_add_rmsnorm_match_cpu) {
    BEGIN();
    // Block kernels with the row in registers: 2048 (256 threads, one vector each), 4096 and
    // 8192 (512 threads, one and two), 6000 (the second vector of some threads only); 2049:
    // the scalar path; 12288: past the register rows.
    int64_t shapes[][2] = {{7, 4096}, {33 * 8, 128}, {5, 100}, {3, 1000}, {2, 8192},
                           {1, 2049}, {3, 2048},    {1, 6000}, {2, 12288}};
    for (int s = 0; s < 9; s++) {
        int64_t r = shapes[s][0], d = shapes[s][1];
        float *x = rand_vec(r * d, 2.f), *res = rand_vec(r * d, 2.f), *w = rand_vec(d, 1.f);
        struct tensor wg = upload_w(&P, G, w, 1, d), wc = upload_w(&P, CP, w, 1, d);
        wg.ndim = wc.ndim = 1;
        wg.ne[0] = wc.ne[0] = d;
        struct tensor xg = mk2(&P, G, G->act_dtype, r, d, x), xc = mk2(&P, CP, CP->act_dtype, r, d, x);
        struct tensor og = mk2(&P, G, G->act_dtype, r, d, NULL), oc = mk2(&P, CP, CP->act_dtype, r, d, NULL);
        G->ops->rmsnorm(G, &og, &xg, &wg, 1e-5f);
        CP->ops->rmsnorm(CP, &oc, &xc, &wc, 1e-5f);
        ASSERT_TENSORS(og, oc, NMSE_BF16);
        struct tensor rg = mk2(&P, G, G->act_dtype, r, d, res), rc = mk2(&P, CP, CP->act_dtype, r, d, res);
        G->ops->add_rmsnorm(G, &og, &rg, &xg, &wg, 1e-6f);
        CP->ops->add_rmsnorm(CP, &oc, &rc, &xc, &wc, 1e-6f);
        ASSERT_TENSORS(rg, rc, NMSE_BF16);
        ASSERT_TENSORS(og, oc, NMSE_BF16);
        // x == NULL: the norm of the residual alone.
        G->ops->add_rmsnorm(G, &og, &rg, NULL, &wg, 1e-6f);
        CP->ops->add_rmsnorm(CP, &oc, &rc, NULL, &wc, 1e-6f);
        ASSERT_TENSORS(og, oc, NMSE_BF16);
        free(x); free(res); free(w);
    }
    END();
}

TEST(cuda_matmul_matches_cpu) {
    BEGIN();
    // (n, m, k, bias). n = 1 with k % 8 == 0 runs a GEMV kernel (m <= 4096: split-k over a
    // block's warps, k not a multiple of the 1 KB step, bias; wider: a warp per column, also
    // past m = 16384 like an lm_head), the rest cuBLASLt (n >= 2; k = 201).
    int64_t shapes[][4] = {{1, 1024, 512, 0}, {37, 3000, 1000, 1}, {128, 512, 4096, 0}, {5, 96, 200, 1},
                           {300, 130, 64, 0}, {8, 4099, 1032, 1}, {2, 77, 201, 0},  {9, 640, 1024, 0},
                           {4, 6144, 4096, 0}, {1, 128, 2056, 1}, {1, 5000, 1000, 1}, {1, 40001, 512, 1}};
    for (int s = 0; s < 12; s++) {
        int64_t n = shapes[s][0], m = shapes[s][1], k = shapes[s][2];
        int bias = (int)shapes[s][3];
        float *x = rand_vec(n * k, 1.f), *w = rand_vec(m * k, 0.05f), *bv = rand_vec(m, 1.f);
        struct tensor wg = upload_w(&P, G, w, m, k), wc = upload_w(&P, CP, w, m, k);
        struct tensor xg = mk2(&P, G, G->act_dtype, n, k, x), xc = mk2(&P, CP, CP->act_dtype, n, k, x);
        struct tensor og = mk2(&P, G, G->act_dtype, n, m, NULL), oc = mk2(&P, CP, CP->act_dtype, n, m, NULL);
        struct tensor bg = mk2(&P, G, G->act_dtype, 1, m, bv), bc = mk2(&P, CP, CP->act_dtype, 1, m, bv);
        G->ops->matmul(G, &og, &xg, WEIGHT_PLAIN(&wg), bias ? &bg : NULL);
        CP->ops->matmul(CP, &oc, &xc, WEIGHT_PLAIN(&wc), bias ? &bc : NULL);
        ASSERT_TENSORS(og, oc, NMSE_BF16);
        // Same shape again: the cached plan gives the same result.
        struct tensor og2 = mk2(&P, G, G->act_dtype, n, m, NULL);
        G->ops->matmul(G, &og2, &xg, WEIGHT_PLAIN(&wg), bias ? &bg : NULL);
        ASSERT_TENSORS(og2, oc, NMSE_BF16);
        free(x); free(w); free(bv);
    }
    // F32 output straight from bf16 inputs (logits; n = 1: the MoE router's split-k GEMV, then a
    // vocabulary-wide lm_head through the row GEMV; n = 3: cuBLASLt).
    int64_t f32_shapes[][3] = {{1, 128, 2048}, {3, 1000, 256}, {1, 50000, 256}};
    for (int s = 0; s < 3; s++) {
        int64_t n = f32_shapes[s][0], m = f32_shapes[s][1], k = f32_shapes[s][2];
        float *x = rand_vec(n * k, 1.f), *w = rand_vec(m * k, 0.1f);
        struct tensor wg = upload_w(&P, G, w, m, k), wc = upload_w(&P, CP, w, m, k);
        struct tensor xg = mk2(&P, G, G->act_dtype, n, k, x), xc = mk2(&P, CP, CP->act_dtype, n, k, x);
        struct tensor og = mk2(&P, G, DTYPE_F32, n, m, NULL), oc = mk2(&P, CP, CP->act_dtype, n, m, NULL);
        G->ops->matmul(G, &og, &xg, WEIGHT_PLAIN(&wg), NULL);
        CP->ops->matmul(CP, &oc, &xc, WEIGHT_PLAIN(&wc), NULL);
        ASSERT_TENSORS(og, oc, 1e-5);
        free(x); free(w);
    }
    END();
}

TEST(cuda_silu_mul_add_gather_convert_match_cpu) {
    BEGIN();
    int64_t shapes[][2] = {{9, 14336}, {3, 100}, {17, 7}};
    for (int s = 0; s < 3; s++) {
        int64_t n = shapes[s][0], f = shapes[s][1];
        float *gu = rand_vec(n * 2 * f, 4.f), *y = rand_vec(n * f, 1.f);
        struct tensor gg = mk2(&P, G, G->act_dtype, n, 2 * f, gu), gc = mk2(&P, CP, CP->act_dtype, n, 2 * f, gu);
        struct tensor og = mk2(&P, G, G->act_dtype, n, f, NULL), oc = mk2(&P, CP, CP->act_dtype, n, f, NULL);
        G->ops->silu_mul(G, &og, &gg);
        CP->ops->silu_mul(CP, &oc, &gc);
        ASSERT_TENSORS(og, oc, NMSE_BF16);
        struct tensor yg = mk2(&P, G, G->act_dtype, n, f, y), yc = mk2(&P, CP, CP->act_dtype, n, f, y);
        G->ops->add(G, &og, &yg);
        CP->ops->add(CP, &oc, &yc);
        ASSERT_TENSORS(og, oc, NMSE_BF16);
        int32_t rows[5] = {(int32_t)n - 1, 0, (int32_t)(n / 2), 0, (int32_t)n - 1};
        struct tensor rg = mk2(&P, G, G->act_dtype, 5, f, NULL), rc = mk2(&P, CP, CP->act_dtype, 5, f, NULL);
        G->ops->gather_rows(G, &rg, &og, mk_i32(&P, G, rows, 5), 5);
        CP->ops->gather_rows(CP, &rc, &oc, mk_i32(&P, CP, rows, 5), 5);
        ASSERT_TENSORS(rg, rc, NMSE_BF16);
        struct tensor fg = mk2(&P, G, DTYPE_F32, 5, f, NULL), fc = mk2(&P, CP, DTYPE_F32, 5, f, NULL);
        G->ops->convert(G, &fg, &rg);
        CP->ops->convert(CP, &fc, &rc);
        ASSERT_TENSORS(fg, fc, NMSE_BF16);
        free(gu); free(y);
    }
    END();
}

// ---------------------------------------------------------------------------------------
// Paged KV batches.

struct kv_batch {
    int n_seqs, n_tokens, max_q, max_ctx, max_blocks, block_size, num_blocks;
    int32_t qs[65], ctx[64];
    int32_t *bt, *pos, *slot;
};

// Sequences with (new tokens, context after the step); blocks drawn from a shuffled pool.
static void kv_batch_make(struct kv_batch *kb, int n, const int *qlen, const int *ctx, int num_blocks) {
    memset(kb, 0, sizeof *kb);
    kb->n_seqs = n;
    kb->block_size = 16;
    kb->num_blocks = num_blocks;
    for (int s = 0; s < n; s++) {
        kb->qs[s + 1] = kb->qs[s] + qlen[s];
        kb->ctx[s] = ctx[s];
        if (qlen[s] > kb->max_q) kb->max_q = qlen[s];
        if (ctx[s] > kb->max_ctx) kb->max_ctx = ctx[s];
    }
    kb->n_tokens = kb->qs[n];
    kb->max_blocks = (kb->max_ctx + 15) / 16 + 1;
    int *perm = malloc(num_blocks * sizeof(int));
    for (int i = 0; i < num_blocks; i++) perm[i] = i;
    for (int i = num_blocks - 1; i > 0; i--) {
        int j = rng_int(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    kb->bt = malloc((size_t)n * kb->max_blocks * 4);
    int used = 0;
    for (int s = 0; s < n; s++)
        for (int b = 0; b < kb->max_blocks; b++) {
            bool need = b * 16 < ctx[s];
            CHECK(!need || used < num_blocks);
            kb->bt[s * kb->max_blocks + b] = need ? perm[used++] : -1;
        }
    kb->pos = malloc((size_t)kb->n_tokens * 4);
    kb->slot = malloc((size_t)kb->n_tokens * 4);
    for (int s = 0; s < n; s++)
        for (int j = 0; j < qlen[s]; j++) {
            int t = kb->qs[s] + j, p = ctx[s] - qlen[s] + j;
            kb->pos[t] = p;
            kb->slot[t] = kb->bt[s * kb->max_blocks + p / 16] * 16 + p % 16;
        }
    free(perm);
}

static void kv_batch_free(struct kv_batch *kb) {
    free(kb->bt);
    free(kb->pos);
    free(kb->slot);
}

static struct attn_metadata kv_md(struct pool *P, struct backend *b, const struct kv_batch *kb) {
    struct attn_metadata md = {0};
    md.n_seqs = kb->n_seqs;
    md.n_tokens = kb->n_tokens;
    md.max_query_len = kb->max_q;
    md.max_context_len = kb->max_ctx;
    md.max_blocks_per_seq = kb->max_blocks;
    md.block_size = kb->block_size;
    md.decode_only = kb->max_q == 1;
    md.query_start = mk_i32(P, b, kb->qs, kb->n_seqs + 1);
    md.context_lens = mk_i32(P, b, kb->ctx, kb->n_seqs);
    md.block_tables = mk_i32(P, b, kb->bt, kb->n_seqs * kb->max_blocks);
    md.positions = mk_i32(P, b, kb->pos, kb->n_tokens);
    md.slot_mapping = mk_i32(P, b, kb->slot, kb->n_tokens);
    md.h_query_start = kb->qs;
    md.h_context_lens = kb->ctx;
    md.h_block_tables = kb->bt;
    md.h_positions = kb->pos;
    md.h_slot_mapping = kb->slot;
    return md;
}

// A KV layer on both backends with identical contents: random values, exact in the GPU
// cache dtype (bf16, or fp8 * scale); the CPU cache holds them as F32. K rows of D, V rows of DV.
static void kv_make_dv(struct pool *P, int num_blocks, int hk, int D, int DV, enum dtype gdt, float scale,
                       struct kv_layer *kg, struct kv_layer *kc) {
    for (int which = 0; which < 2; which++) {
        int64_t ne[4] = {num_blocks, 16, hk, which ? DV : D};
        int64_t n = (int64_t)num_blocks * 16 * hk * ne[3];
        float *vals = malloc(n * sizeof(float));
        uint8_t *raw = malloc(n * 2);
        for (int64_t i = 0; i < n; i++) {
            float v = rng_sym(2.f);
            if (gdt == DTYPE_FP8_E4M3) {
                uint8_t q = f32_to_fp8_e4m3(v / scale);
                raw[i] = q;
                vals[i] = fp8_e4m3_to_f32(q) * scale;
            } else {
                uint16_t h = f32_to_bf16(v);
                memcpy(raw + 2 * i, &h, 2);
                vals[i] = bf16_to_f32(h);
            }
        }
        struct tensor tg = tensor_make(NULL, gdt, 4, ne);
        tg.data = mk_raw(P, gpu_be, raw, tensor_bytes(&tg));
        tg.scale = gdt == DTYPE_FP8_E4M3 ? scale : 1.f;
        struct tensor tc = mk(P, cpu_be, DTYPE_F32, 4, ne, vals);
        if (which == 0) { kg->k = tg; kc->k = tc; } else { kg->v = tg; kc->v = tc; }
        free(vals);
        free(raw);
    }
    kg->k_scale = kg->v_scale = gdt == DTYPE_FP8_E4M3 ? scale : 1.f;
    kc->k_scale = kc->v_scale = 1.f;
}

static void kv_make(struct pool *P, int num_blocks, int hk, int D, enum dtype gdt, float scale, struct kv_layer *kg,
                    struct kv_layer *kc) {
    kv_make_dv(P, num_blocks, hk, D, D, gdt, scale, kg, kc);
}

static struct tensor view3(struct tensor t, int64_t a, int64_t b, int64_t c) {
    t.ndim = 3;
    t.ne[0] = a; t.ne[1] = b; t.ne[2] = c;
    return t;
}

// DV: the value head dim (D but for the split q/k vs v case, MiMo-V2-Flash's 192 / 128).
static void run_attention_case_dv(struct pool *P, int D, int DV, int hq, int hk, enum dtype kvdt, int n,
                                  const int *qlen, const int *ctx, int window, bool sinks, double thr) {
    struct kv_batch kb;
    kv_batch_make(&kb, n, qlen, ctx, 1024);
    struct attn_metadata mg = kv_md(P, gpu_be, &kb), mc = kv_md(P, cpu_be, &kb);
    struct kv_layer kg, kc;
    kv_make_dv(P, kb.num_blocks, hk, D, DV, kvdt, 0.05f, &kg, &kc);
    float *q = rand_vec((int64_t)kb.n_tokens * hq * D, 1.f);
    int64_t nq[3] = {kb.n_tokens, hq, D}, no[3] = {kb.n_tokens, hq, DV};
    struct tensor qg = mk(P, gpu_be, DTYPE_BF16, 3, nq, q), qc = mk(P, cpu_be, cpu_be->act_dtype, 3, nq, q);
    struct tensor og = mk(P, gpu_be, DTYPE_BF16, 3, no, NULL), oc = mk(P, cpu_be, cpu_be->act_dtype, 3, no, NULL);
    float *sk = rand_vec(hq, 2.f);
    struct tensor sg = mk2(P, gpu_be, DTYPE_F32, 1, hq, sk), sc = mk2(P, cpu_be, DTYPE_F32, 1, hq, sk);
    float scale = 1.f / sqrtf((float)D);
    gpu_be->ops->attention(gpu_be, &og, &qg, 0, &kg, &mg, scale, window, sinks ? &sg : NULL);
    cpu_be->ops->attention(cpu_be, &oc, &qc, 0, &kc, &mc, scale, window, sinks ? &sc : NULL);
    double e = cmp_tensors(&og, &oc);
    if (!(e >= 0 && e <= thr))
        test_fail(__FILE__, __LINE__, "attention D=%d DV=%d hq=%d hk=%d kv=%s window=%d sinks=%d: nmse %g (threshold %g)",
                  D, DV, hq, hk, dtype_name(kvdt), window, (int)sinks, e, thr);
    free(q);
    free(sk);
    kv_batch_free(&kb);
}

static void run_attention_case(struct pool *P, int D, int hq, int hk, enum dtype kvdt, int n, const int *qlen,
                               const int *ctx, int window, bool sinks, double thr) {
    run_attention_case_dv(P, D, D, hq, hk, kvdt, n, qlen, ctx, window, sinks, thr);
}

TEST(cuda_attention_mixed_batches_match_cpu) {
    BEGIN();
    // decode rows, a fresh prefill, a chunked prefill over cached context, odd lengths.
    int qlen[] = {1, 1, 70, 37, 1, 5};
    int ctx[] = {1, 900, 70, 500, 3001, 17};
    int Ds[] = {64, 128, 256};
    int groups[][2] = {{8, 8}, {32, 8}, {16, 2}};
    enum dtype kvs[] = {DTYPE_BF16, DTYPE_FP8_E4M3};
    for (int d = 0; d < 3; d++)
        for (int g = 0; g < 3; g++)
            for (int k = 0; k < 2; k++) {
                run_attention_case(&P, Ds[d], groups[g][0], groups[g][1], kvs[k], 6, qlen, ctx, 0, false, NMSE_BF16);
                if (test_failed_now()) return;
            }
    END();
}

TEST(cuda_attention_decode_split_kv_long_context) {
    BEGIN();
    int qlen[] = {1, 1};
    int ctx[] = {7000, 123};
    run_attention_case(&P, 128, 32, 8, DTYPE_BF16, 2, qlen, ctx, 0, false, NMSE_BF16);
    run_attention_case(&P, 128, 32, 8, DTYPE_FP8_E4M3, 2, qlen, ctx, 0, false, NMSE_BF16);
    END();
}

// Decode batches split only a few ways (the 2-tile splits allowed while the grid stays within
// one CTA per SM), combined by the reduce kernel: Qwen3-30B-A3B's heads (32 q / 4 KV) at a
// 640-token context, its batch-1 decode shape (6 splits, 24 CTAs); a second sequence of one tile
// (5 empty splits); FP8; sinks at D = 64. The other decode-only cases split 17 ways or more.
TEST(cuda_attention_decode_few_splits) {
    BEGIN();
    int qlen[] = {1, 1};
    int ctx[] = {640, 40};
    run_attention_case(&P, 128, 32, 4, DTYPE_BF16, 1, qlen, ctx, 0, false, NMSE_BF16);
    run_attention_case(&P, 128, 32, 4, DTYPE_BF16, 2, qlen, ctx, 0, false, NMSE_BF16);
    run_attention_case(&P, 128, 32, 4, DTYPE_FP8_E4M3, 2, qlen, ctx, 0, false, NMSE_BF16);
    int c2[] = {700};
    run_attention_case(&P, 64, 16, 2, DTYPE_BF16, 1, qlen, c2, 0, true, NMSE_BF16);
    END();
}

TEST(cuda_attention_sliding_window_and_sinks) {
    BEGIN();
    int qlen[] = {1, 90, 1};
    int ctx[] = {600, 300, 40};
    run_attention_case(&P, 64, 16, 2, DTYPE_BF16, 3, qlen, ctx, 128, true, NMSE_BF16);   // prefill: 1 split
    int q2[] = {1};
    int c2[] = {5000};
    run_attention_case(&P, 64, 16, 2, DTYPE_BF16, 1, q2, c2, 0, true, NMSE_BF16);       // split-KV with sinks
    run_attention_case(&P, 128, 8, 8, DTYPE_BF16, 1, q2, c2, 1000, false, NMSE_BF16);
    END();
}

// MiMo-V2-Flash's split head dims (q/k 192, v 128; cuda_attention.cu's DV != D kernels): mixed
// prefill / decode batches in BF16 and FP8, its sliding layers' window 128 with sinks (64 q / 8
// KV heads), its full layers (64 / 4), split-KV decode of a long context. (The CUDA caps do not
// list split head dims yet, so the model itself is refused on CUDA until this passes on the GPU.)
TEST(cuda_attention_split_qk_v_head_dims_match_cpu) {
    BEGIN();
    int qlen[] = {1, 1, 70, 37, 1, 5};
    int ctx[] = {1, 900, 70, 500, 3001, 17};
    enum dtype kvs[] = {DTYPE_BF16, DTYPE_FP8_E4M3};
    for (int k = 0; k < 2; k++) {
        run_attention_case_dv(&P, 192, 128, 64, 4, kvs[k], 6, qlen, ctx, 0, false, NMSE_BF16);
        run_attention_case_dv(&P, 192, 128, 64, 8, kvs[k], 6, qlen, ctx, 129, true, NMSE_BF16);
        if (test_failed_now()) return;
    }
    int q2[] = {1, 1};
    int c2[] = {7000, 123};
    run_attention_case_dv(&P, 192, 128, 64, 4, DTYPE_BF16, 2, q2, c2, 0, false, NMSE_BF16);
    run_attention_case_dv(&P, 192, 128, 16, 8, DTYPE_BF16, 2, q2, c2, 129, true, NMSE_BF16);
    END();
}

// ---------------------------------------------------------------------------------------
// RoPE + KV write.

static void run_rope_case(struct pool *P, int D, int rotary_dim, bool interleaved, enum dtype kvdt, bool qk_norm) {
    int hq = 8, hk = 2;
    int qlen[] = {1, 19, 1, 6};
    int ctx[] = {40, 19, 1200, 30};
    struct kv_batch kb;
    kv_batch_make(&kb, 4, qlen, ctx, 256);
    kb.slot[3] = -1; // a padding token: rotated, not written
    struct attn_metadata mg = kv_md(P, gpu_be, &kb), mc = kv_md(P, cpu_be, &kb);
    int64_t stride = (int64_t)(hq + 2 * hk) * D;
    float *qkv = rand_vec(kb.n_tokens * stride, 2.f);
    struct tensor fg = mk2(P, gpu_be, DTYPE_BF16, kb.n_tokens, stride, qkv);
    struct tensor fc = mk2(P, cpu_be, cpu_be->act_dtype, kb.n_tokens, stride, qkv);
    size_t es_g = 2, es_c = dtype_row_bytes(cpu_be->act_dtype, 1);
    struct tensor qg = view3(fg, kb.n_tokens, hq, D), qc = view3(fc, kb.n_tokens, hq, D);
    struct tensor kg_ = view3(fg, kb.n_tokens, hk, D), kc_ = view3(fc, kb.n_tokens, hk, D);
    struct tensor vg = view3(fg, kb.n_tokens, hk, D), vc = view3(fc, kb.n_tokens, hk, D);
    kg_.data = (char *)fg.data + es_g * hq * D;
    kc_.data = (char *)fc.data + es_c * hq * D;
    vg.data = (char *)fg.data + es_g * (hq + hk) * D;
    vc.data = (char *)fc.data + es_c * (hq + hk) * D;
    float inv[64];
    for (int i = 0; i < rotary_dim / 2; i++) inv[i] = powf(500000.f, -2.f * i / rotary_dim);
    struct rope_args rg = {.rotary_dim = rotary_dim, .attn_factor = 1.f, .interleaved = interleaved};
    struct rope_args rc = rg;
    struct tensor ig = mk2(P, gpu_be, DTYPE_F32, 1, rotary_dim / 2, inv), ic = mk2(P, cpu_be, DTYPE_F32, 1, rotary_dim / 2, inv);
    rg.inv_freq = ig.data;
    rc.inv_freq = ic.data;
    struct tensor nq_g, nk_g, nq_c, nk_c;
    if (qk_norm) { // Qwen3: per-head RMSNorm of q (F32 weight) and k (BF16 weight) before the rotation
        float *wq = rand_vec(D, 1.5f), *wk = rand_vec(D, 1.5f);
        nq_g = mk2(P, gpu_be, DTYPE_F32, 1, D, wq);
        nk_g = mk2(P, gpu_be, DTYPE_BF16, 1, D, wk);
        nq_c = mk2(P, cpu_be, DTYPE_F32, 1, D, wq);
        nk_c = mk2(P, cpu_be, DTYPE_BF16, 1, D, wk);
        rg.q_norm = &nq_g;
        rg.k_norm = &nk_g;
        rc.q_norm = &nq_c;
        rc.k_norm = &nk_c;
        rg.norm_eps = rc.norm_eps = 1e-6f;
        free(wq);
        free(wk);
    }
    // Caches start as zeros on both sides.
    struct kv_layer kvg, kvc;
    int64_t ne[4] = {kb.num_blocks, 16, hk, D};
    int64_t ncache = (int64_t)kb.num_blocks * 16 * hk * D;
    float *zeros = calloc(ncache, sizeof(float));
    kvg.k = mk(P, gpu_be, kvdt, 4, ne, zeros);
    kvg.v = mk(P, gpu_be, kvdt, 4, ne, zeros);
    kvc.k = mk(P, cpu_be, DTYPE_F32, 4, ne, zeros);
    kvc.v = mk(P, cpu_be, DTYPE_F32, 4, ne, zeros);
    float sc = kvdt == DTYPE_FP8_E4M3 ? 0.02f : 1.f;
    kvg.k.scale = kvg.v.scale = kvg.k_scale = kvg.v_scale = sc;
    kvc.k_scale = kvc.v_scale = 1.f;
    gpu_be->ops->rope_kv_write(gpu_be, &qg, &kg_, &vg, stride, &rg, &kvg, &mg);
    cpu_be->ops->rope_kv_write(cpu_be, &qc, &kc_, &vc, stride, &rc, &kvc, &mc);
    // q (rotated in place, inside the fused rows)
    float *a = get(gpu_be, &fg), *b = get(cpu_be, &fc);
    float *qa = malloc(kb.n_tokens * hq * D * sizeof(float)), *qb = malloc(kb.n_tokens * hq * D * sizeof(float));
    for (int t = 0; t < kb.n_tokens; t++) {
        memcpy(qa + (size_t)t * hq * D, a + t * stride, hq * D * sizeof(float));
        memcpy(qb + (size_t)t * hq * D, b + t * stride, hq * D * sizeof(float));
    }
    double e = nmse(qa, qb, kb.n_tokens * hq * D);
    if (!(e >= 0 && e < NMSE_BF16)) test_fail(__FILE__, __LINE__, "rope q: nmse %g", e);
    double thr = kvdt == DTYPE_FP8_E4M3 ? NMSE_FP8 : NMSE_BF16;
    e = cmp_tensors(&kvg.k, &kvc.k);
    if (!(e >= 0 && e < thr)) test_fail(__FILE__, __LINE__, "rope k cache (%s): nmse %g", dtype_name(kvdt), e);
    e = cmp_tensors(&kvg.v, &kvc.v);
    if (!(e >= 0 && e < thr)) test_fail(__FILE__, __LINE__, "rope v cache (%s): nmse %g", dtype_name(kvdt), e);
    // The padding token (token 3: sequence 1, its would-be position) left its slot untouched.
    float *kcache = get(gpu_be, &kvg.k);
    int p3 = kb.pos[3];
    int64_t pad_slot = (int64_t)kb.bt[1 * kb.max_blocks + p3 / 16] * 16 + p3 % 16;
    for (int i = 0; i < hk * D; i++)
        if (kcache[pad_slot * hk * D + i] != 0.f) {
            test_fail(__FILE__, __LINE__, "slot -1 token was written to the cache");
            break;
        }
    free(kcache);
    free(a); free(b); free(qa); free(qb); free(qkv); free(zeros);
    kv_batch_free(&kb);
}

TEST(cuda_rope_kv_write_matches_cpu) {
    BEGIN();
    run_rope_case(&P, 128, 128, false, DTYPE_BF16, false);
    if (test_failed_now()) return;
    run_rope_case(&P, 64, 64, true, DTYPE_BF16, false);
    if (test_failed_now()) return;
    run_rope_case(&P, 128, 64, false, DTYPE_BF16, false); // partial rotary
    if (test_failed_now()) return;
    run_rope_case(&P, 128, 128, false, DTYPE_FP8_E4M3, false);
    if (test_failed_now()) return;
    // With the fused q/k RMSNorm (one warp per head): plain, interleaved + partial, FP8 cache.
    run_rope_case(&P, 128, 128, false, DTYPE_BF16, true);
    if (test_failed_now()) return;
    run_rope_case(&P, 64, 32, true, DTYPE_BF16, true);
    if (test_failed_now()) return;
    run_rope_case(&P, 128, 128, false, DTYPE_FP8_E4M3, true);
    if (test_failed_now()) return;
    // GLM-4-MoE: q/k norm with partial rotary in NeoX halves (GLM-4.5: 128 / 64; the fixture: 64 / 32).
    run_rope_case(&P, 128, 64, false, DTYPE_BF16, true);
    if (test_failed_now()) return;
    run_rope_case(&P, 64, 32, false, DTYPE_BF16, true);
    if (test_failed_now()) return;
    END();
}

// ---------------------------------------------------------------------------------------
// Sampling: the GPU sampler picks the same ids as the CPU sampler.

struct sample_case {
    float temperature, top_p, min_p;
    int top_k;
    float presence, frequency, repetition;
    int n_logprobs;
    int mask_keep; // structured output: > 0 = a token bitmask allowing about 1 token in mask_keep
    int poison;    // > 0: rows r % 3 == 0 get a NaN logit, rows r % 3 == 1 a +inf (SAMPLE_ID_NONFINITE expected)
};

static int run_sample_case(struct pool *P, int n_rows, int vocab, const struct sample_case *sc, int *mismatch,
                           double *max_lp_err) {
    float *logits = malloc((size_t)n_rows * vocab * sizeof(float));
    for (int64_t i = 0; i < (int64_t)n_rows * vocab; i++) logits[i] = rng_sym(6.f);
    for (int r = 0; sc->poison && r < n_rows; r++)
        if (r % 3 < 2) logits[(size_t)r * vocab + rng_int(vocab)] = r % 3 == 0 ? NAN : INFINITY;
    float temp[64], tp[64], mp[64], pp[64], fp[64], rp[64];
    int32_t tk[64], hs[65], hpl[64];
    uint64_t seed[64], step[64];
    int32_t *hist = malloc((size_t)n_rows * 40 * 4);
    hs[0] = 0;
    for (int r = 0; r < n_rows; r++) {
        temp[r] = sc->temperature; tp[r] = sc->top_p; mp[r] = sc->min_p; tk[r] = sc->top_k;
        pp[r] = sc->presence; fp[r] = sc->frequency; rp[r] = sc->repetition;
        seed[r] = 1000 + r; step[r] = (uint64_t)r * 7;
        int h = 10 + rng_int(30);
        for (int i = 0; i < h; i++) hist[hs[r] + i] = rng_int(vocab / 10); // repeats likely
        hs[r + 1] = hs[r] + h;
        hpl[r] = h / 2;
    }
    int nh = hs[n_rows];
    int nl = sc->n_logprobs;
    const int words = (vocab + 31) / 32;
    uint32_t *mask = NULL;
    if (sc->mask_keep > 0) { // random allowed sets, at least one token per row
        mask = calloc((size_t)n_rows * words, 4);
        for (int r = 0; r < n_rows; r++) {
            for (int i = 0; i < vocab; i++)
                if (rng_int(sc->mask_keep) == 0) mask[(size_t)r * words + i / 32] |= 1u << (i % 32);
            int one = rng_int(vocab);
            mask[(size_t)r * words + one / 32] |= 1u << (one % 32);
        }
    }
    int32_t ids[2][64], top_ids[2][64 * 20];
    float lp[2][64], top_lp[2][64 * 20];
    for (int side = 0; side < 2; side++) {
        struct backend *b = side ? cpu_be : gpu_be;
        struct tensor lt = mk2(P, b, DTYPE_F32, n_rows, vocab, logits);
        struct sample_args a = {0};
        a.n_rows = n_rows;
        a.vocab_size = vocab;
        a.logits = &lt;
        a.temperature = mk_raw(P, b, temp, n_rows * 4);
        a.top_p = mk_raw(P, b, tp, n_rows * 4);
        a.top_k = mk_raw(P, b, tk, n_rows * 4);
        a.min_p = mk_raw(P, b, mp, n_rows * 4);
        a.presence_penalty = mk_raw(P, b, pp, n_rows * 4);
        a.frequency_penalty = mk_raw(P, b, fp, n_rows * 4);
        a.repetition_penalty = mk_raw(P, b, rp, n_rows * 4);
        a.seed = mk_raw(P, b, seed, n_rows * 8);
        a.step = mk_raw(P, b, step, n_rows * 8);
        a.hist_start = mk_i32(P, b, hs, n_rows + 1);
        a.hist_ids = mk_i32(P, b, hist, nh);
        a.hist_prompt_len = mk_i32(P, b, hpl, n_rows);
        a.any_penalty = sc->presence != 0 || sc->frequency != 0 || sc->repetition != 1;
        a.n_logprobs = nl;
        a.all_greedy = sc->temperature < 1e-5f && !a.any_penalty && nl == 0; // CUDA: the multi-CTA arg-max
        if (mask) {
            a.token_bitmask = mk_raw(P, b, mask, (size_t)n_rows * words * 4);
            a.bitmask_words = words;
        }
        a.out_ids = pool_alloc(P, b, n_rows * 4);
        a.out_logprob = pool_alloc(P, b, n_rows * 4);
        if (nl) {
            a.out_top_ids = pool_alloc(P, b, (size_t)n_rows * nl * 4);
            a.out_top_logprobs = pool_alloc(P, b, (size_t)n_rows * nl * 4);
        }
        b->ops->sample(b, &a);
        b->ops->copy_d2h(b, ids[side], a.out_ids, n_rows * 4);
        b->ops->copy_d2h(b, lp[side], a.out_logprob, n_rows * 4);
        if (nl) {
            b->ops->copy_d2h(b, top_ids[side], a.out_top_ids, (size_t)n_rows * nl * 4);
            b->ops->copy_d2h(b, top_lp[side], a.out_top_logprobs, (size_t)n_rows * nl * 4);
        }
    }
    *mismatch = 0;
    *max_lp_err = 0;
    for (int r = 0; r < n_rows; r++) {
        if (ids[0][r] != ids[1][r]) (*mismatch)++;
        if (sc->poison && r % 3 < 2) { // flagged on both sides, NaN logprobs, nothing drawn
            for (int side = 0; side < 2; side++)
                if (ids[side][r] != SAMPLE_ID_NONFINITE || !isnan(lp[side][r])) (*mismatch) += 1000;
            continue;
        }
        if (ids[0][r] < 0 || ids[0][r] >= vocab) (*mismatch) += 1000;
        for (int side = 0; mask && side < 2; side++) // a masked token is never chosen
            if (ids[side][r] >= 0 && ids[side][r] < vocab &&
                !((mask[(size_t)r * words + ids[side][r] / 32] >> (ids[side][r] % 32)) & 1u))
                (*mismatch) += 1000;
        double e = fabs(lp[0][r] - lp[1][r]);
        if (!(e <= *max_lp_err)) *max_lp_err = isnan(e) ? 1e9 : e;
        for (int j = 0; j < nl; j++) {
            if (top_ids[0][r * nl + j] != top_ids[1][r * nl + j]) (*mismatch)++;
            double e2 = top_lp[0][r * nl + j] == top_lp[1][r * nl + j] // equal -inf of masked tokens
                            ? 0.0
                            : fabs(top_lp[0][r * nl + j] - top_lp[1][r * nl + j]);
            if (!(e2 <= *max_lp_err)) *max_lp_err = isnan(e2) ? 1e9 : e2;
        }
    }
    free(logits);
    free(hist);
    free(mask);
    return 0;
}

TEST(cuda_sampler_agrees_with_cpu_sampler) {
    BEGIN();
    struct sample_case cases[] = {
        {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 5, 0, 0},        // greedy + top-5 logprobs
        {1.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 0, 0},        // plain temperature
        {0.7f, 0.9f, 0.f, 0, 0.f, 0.f, 1.f, 2, 0, 0},      // top-p
        {1.3f, 1.f, 0.f, 40, 0.f, 0.f, 1.f, 0, 0, 0},      // top-k
        {1.f, 1.f, 0.1f, 0, 0.f, 0.f, 1.f, 0, 0, 0},       // min-p
        {0.8f, 0.95f, 0.05f, 50, 0.f, 0.f, 1.f, 20, 0, 0}, // all filters
        {1.f, 1.f, 0.f, 0, 0.5f, 0.3f, 1.2f, 3, 0, 0},     // penalties
        {0.f, 1.f, 0.f, 0, 1.f, 1.f, 1.5f, 0, 0, 0},       // greedy with penalties
        {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 0, 0},        // plain greedy: the all_greedy arg-max path
    };
    int vocabs[] = {32000, 128256, 1000};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int v = 0; v < 3; v++) {
            int mismatch;
            double lp_err;
            run_sample_case(&P, 24, vocabs[v], &cases[c], &mismatch, &lp_err);
            ASSERT_EQ(pool_release(&P), 0);
            if (mismatch || lp_err > 2e-3)
                test_fail(__FILE__, __LINE__, "sample case %zu vocab %d: %d id mismatches, logprob error %g", c, vocabs[v],
                          mismatch, lp_err);
        }
    END();
}

TEST(cuda_sampler_token_bitmask_agrees_with_cpu_sampler) {
    BEGIN();
    // Structured output masks: every path (greedy arg-max, filters, penalties, logprobs) sees the
    // masked row, as the CPU sampler's; dense (1 in 2) and sparse (1 in 5000) allowed sets.
    struct sample_case cases[] = {
        {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 2, 0},       // all_greedy arg-max
        {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 3, 5000, 0},    // greedy + logprobs of the masked row
        {1.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 2, 0},       // temperature
        {1.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 5000, 0},    // temperature, few allowed
        {0.8f, 0.95f, 0.05f, 50, 0.f, 0.f, 1.f, 2, 3, 0}, // all filters
        {1.3f, 1.f, 0.f, 40, 0.f, 0.f, 1.f, 0, 5000, 0},  // top-k larger than the allowed set
        {1.f, 1.f, 0.f, 0, 0.5f, 0.3f, 1.2f, 0, 7, 0},    // penalties
    };
    int vocabs[] = {49152, 151936, 1000};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int v = 0; v < 3; v++) {
            int mismatch;
            double lp_err;
            run_sample_case(&P, 24, vocabs[v], &cases[c], &mismatch, &lp_err);
            ASSERT_EQ(pool_release(&P), 0);
            if (mismatch || lp_err > 2e-3)
                test_fail(__FILE__, __LINE__, "masked sample case %zu vocab %d: %d id mismatches, logprob error %g", c,
                          vocabs[v], mismatch, lp_err);
        }
    END();
}

TEST(cuda_sampler_greedy_argmax_any_batch) {
    BEGIN();
    // The all_greedy path splits a row over many CTAs when the batch is small: ids equal the
    // CPU's, logprobs close, for batch sizes from 1 (most parts per row) to 64.
    struct sample_case sc = {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 0, 0};
    int rows[] = {1, 2, 7, 64};
    int vocabs[] = {128256, 151936, 1000, 49152};
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < 4; v++) {
            int mismatch;
            double lp_err;
            run_sample_case(&P, rows[i], vocabs[v], &sc, &mismatch, &lp_err);
            ASSERT_EQ(pool_release(&P), 0);
            if (mismatch || lp_err > 2e-3)
                test_fail(__FILE__, __LINE__, "greedy rows %d vocab %d: %d id mismatches, logprob error %g", rows[i],
                          vocabs[v], mismatch, lp_err);
        }
    END();
}

// Issue 28 item 4: rows with a NaN or +inf logit come back as SAMPLE_ID_NONFINITE with NaN
// logprobs from every sampling path (the multi-CTA arg-max, greedy with logprobs, the filters
// and draws), exactly as on the CPU; the healthy rows of the same batch are unaffected.
TEST(cuda_sampler_flags_nonfinite_rows_as_cpu) {
    BEGIN();
    struct sample_case cases[] = {
        {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 0, 0, 1},       // all_greedy arg-max
        {0.f, 1.f, 0.f, 0, 0.f, 0.f, 1.f, 5, 0, 1},       // greedy + logprobs
        {0.8f, 0.95f, 0.05f, 50, 0.f, 0.f, 1.f, 2, 0, 1}, // all filters
        {1.f, 1.f, 0.f, 0, 0.5f, 0.3f, 1.2f, 0, 0, 1},    // penalties
    };
    int rows[] = {1, 2, 24};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int i = 0; i < 3; i++) {
            int mismatch;
            double lp_err;
            run_sample_case(&P, rows[i], 49152, &cases[c], &mismatch, &lp_err);
            ASSERT_EQ(pool_release(&P), 0);
            if (mismatch || lp_err > 2e-3)
                test_fail(__FILE__, __LINE__, "non-finite case %zu rows %d: %d mismatches, logprob error %g", c,
                          rows[i], mismatch, lp_err);
        }
    END();
}

TEST(cuda_sampler_same_seed_same_ids) {
    BEGIN();
    struct sample_case sc = {1.f, 0.95f, 0.f, 0, 0.f, 0.f, 1.f, 0, 0, 0};
    int m1, m2;
    double e;
    uint64_t saved = rng_state;
    run_sample_case(&P, 16, 50000, &sc, &m1, &e);
    ASSERT_EQ(pool_release(&P), 0);
    rng_state = saved;
    run_sample_case(&P, 16, 50000, &sc, &m2, &e);
    ASSERT_EQ(m1, 0);
    ASSERT_EQ(m2, 0);
    END();
}

// ---------------------------------------------------------------------------------------
// CUDA graphs: a captured decode step replays to the same bytes as eager execution, also
// after its device-side inputs change in place.

TEST(cuda_graph_replay_equals_eager) {
    BEGIN();
    ASSERT_TRUE(G->ops->graph_begin != NULL);
    const int D = 128, hq = 32, hk = 8, dm = 512;
    int qlen[] = {1, 1, 1, 1};
    int ctx[] = {100, 1500, 33, 700};
    struct kv_batch kb;
    kv_batch_make(&kb, 4, qlen, ctx, 512);
    struct attn_metadata md = kv_md(&P, G, &kb);
    struct kv_layer kv, kvc_unused;
    kv_make(&P, kb.num_blocks, hk, D, DTYPE_BF16, 1.f, &kv, &kvc_unused);
    float *x = rand_vec(4 * dm, 1.f), *w = rand_vec((int64_t)(hq + 2 * hk) * D * dm, 0.05f), *nw = rand_vec(dm, 1.f);
    float *wo = rand_vec((int64_t)dm * hq * D, 0.05f);
    struct tensor xt = mk2(&P, G, DTYPE_BF16, 4, dm, x);
    struct tensor nwt = upload_w(&P, G, nw, 1, dm);
    struct tensor wt = upload_w(&P, G, w, (hq + 2 * hk) * D, dm), wot = upload_w(&P, G, wo, dm, hq * D);
    struct tensor h = mk2(&P, G, DTYPE_BF16, 4, dm, NULL), qkv = mk2(&P, G, DTYPE_BF16, 4, (hq + 2 * hk) * D, NULL);
    struct tensor att = mk(&P, G, DTYPE_BF16, 3, (int64_t[]){4, hq, D}, NULL);
    struct tensor out = mk2(&P, G, DTYPE_F32, 4, dm, NULL);
    float inv[64];
    for (int i = 0; i < 64; i++) inv[i] = powf(10000.f, -2.f * i / 128);
    struct tensor it = mk2(&P, G, DTYPE_F32, 1, 64, inv);
    struct rope_args ra = {.inv_freq = it.data, .rotary_dim = 128, .attn_factor = 1.f, .interleaved = false};
    int64_t stride = (int64_t)(hq + 2 * hk) * D;
    struct tensor q = view3(qkv, 4, hq, D), k = view3(qkv, 4, hk, D), v = view3(qkv, 4, hk, D);
    k.data = (char *)qkv.data + 2 * hq * D;
    v.data = (char *)qkv.data + 2 * (hq + hk) * D;
    nwt.ndim = 1;
    nwt.ne[0] = dm;
    struct tensor att2 = tensor_2d(att.data, DTYPE_BF16, 4, hq * D);
    struct tensor outb = mk2(&P, G, DTYPE_BF16, 4, dm, NULL);
#define STEP()                                                                       \
    do {                                                                             \
        G->ops->rmsnorm(G, &h, &xt, &nwt, 1e-5f);                                    \
        G->ops->matmul(G, &qkv, &h, WEIGHT_PLAIN(&wt), NULL);                                      \
        G->ops->rope_kv_write(G, &q, &k, &v, stride, &ra, &kv, &md);                 \
        G->ops->attention(G, &att, &q, stride, &kv, &md, 0.0883883f, 0, NULL);       \
        G->ops->matmul(G, &outb, &att2, WEIGHT_PLAIN(&wot), NULL);                                 \
        G->ops->convert(G, &out, &outb);                                             \
    } while (0)
    float *eager[2], *replay[2];
    // Eager run (warms plans and scratch), then capture.
    STEP();
    G->ops->synchronize(G);
    struct error err = {0};
    void *graph = NULL;
    ASSERT_OK(G->ops->graph_begin(G, &err));
    STEP();
    ASSERT_OK(G->ops->graph_end(G, &graph, &err));
    for (int round = 0; round < 2; round++) {
        if (round == 1) { // new inputs in place: positions advance, contexts grow
            for (int s = 0; s < 4; s++) {
                kb.ctx[s] += 1;
                kb.pos[s] += 1;
                int p = kb.pos[s];
                if (kb.bt[s * kb.max_blocks + p / 16] < 0) kb.bt[s * kb.max_blocks + p / 16] = 500 + s;
                kb.slot[s] = kb.bt[s * kb.max_blocks + p / 16] * 16 + p % 16;
            }
            G->ops->copy_h2d(G, (void *)md.context_lens, kb.ctx, 16);
            G->ops->copy_h2d(G, (void *)md.positions, kb.pos, 16);
            G->ops->copy_h2d(G, (void *)md.slot_mapping, kb.slot, 16);
            G->ops->copy_h2d(G, (void *)md.block_tables, kb.bt, 4 * kb.max_blocks * 4);
            float *x2 = rand_vec(4 * dm, 1.f);
            float *tmp = malloc(4 * dm * 2);
            dtype_from_f32(DTYPE_BF16, x2, tmp, 4 * dm);
            G->ops->copy_h2d(G, xt.data, tmp, 4 * dm * 2);
            free(x2);
            free(tmp);
        }
        STEP(); // eager (re-writes the same KV slots with the same values)
        eager[round] = get(G, &out);
        ASSERT_OK(G->ops->graph_launch(G, graph, &err));
        replay[round] = get(G, &out);
        if (memcmp(eager[round], replay[round], 4 * dm * sizeof(float)))
            test_fail(__FILE__, __LINE__, "graph replay differs from eager (round %d)", round);
    }
    if (!memcmp(eager[0], eager[1], 4 * dm * sizeof(float))) test_fail(__FILE__, __LINE__, "inputs did not change");
    G->ops->graph_destroy(G, graph);
    for (int i = 0; i < 2; i++) { free(eager[i]); free(replay[i]); }
    free(x); free(w); free(nw); free(wo);
    kv_batch_free(&kb);
    END();
#undef STEP
}

TEST(cuda_fill_uniform_range_and_seeds) {
    BEGIN();
    ASSERT_TRUE(G->ops->fill_uniform != NULL);
    int64_t n = 1 << 20;
    struct tensor a = mk2(&P, G, DTYPE_F32, 1024, n / 1024, NULL), bt = mk2(&P, G, DTYPE_BF16, 1024, n / 1024, NULL);
    struct tensor c = mk2(&P, G, DTYPE_F32, 1024, n / 1024, NULL);
    struct error err = {0};
    ASSERT_OK(G->ops->fill_uniform(G, &a, 42, -0.5f, 1.5f, &err));
    ASSERT_OK(G->ops->fill_uniform(G, &bt, 42, -0.5f, 1.5f, &err));
    ASSERT_OK(G->ops->fill_uniform(G, &c, 43, -0.5f, 1.5f, &err));
    float *fa = get(G, &a), *fb = get(G, &bt), *fc = get(G, &c);
    double mean = 0, var = 0;
    int64_t same = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!(fa[i] >= -0.5f && fa[i] < 1.5f)) { test_fail(__FILE__, __LINE__, "value %g out of range", fa[i]); break; }
        if (fabsf(fb[i] - round_bf16(fa[i])) > 0.01f) { test_fail(__FILE__, __LINE__, "bf16 fill differs"); break; }
        same += fa[i] == fc[i];
        mean += fa[i];
        var += (double)fa[i] * fa[i];
    }
    mean /= n;
    var = var / n - mean * mean;
    ASSERT_NEAR(mean, 0.5, 0.01);
    ASSERT_NEAR(var, 4.0 / 12.0, 0.01); // (hi - lo)^2 / 12
    ASSERT_TRUE(same < n / 1000);       // another seed, another stream
    free(fa); free(fb); free(fc);
    END();
}

int main(int argc, char **argv) {
    int rc = test_main(argc, argv);
    backend_destroy(gpu_be);
    backend_destroy(cpu_be);
    return rc;
}
