// Quantized matmul and MoE experts on CUDA (cuda_qmatmul.cu, cuda_moe_quant.cu) against the CPU
// reference (cpu_qmatmul.c), both driven through backend.h with the same stored bytes.
//
// Every scheme the loader produces: FP8 E4M3 per tensor / per channel / 128x128 blocks (and a
// regridded 32-row block grid), each weight-only and with its dynamic FP8 activations (per
// token; per token and 128-column group for blocks); INT4 and INT8 packed in I32 words with
// group-32 / group-128 / per-channel scales, weight-only and INT8-per-token W8A8; GROUP weights
// with zero points and a column -> group map, static FP8 / INT8 activations. Odd sizes
// (k not a multiple of 16: the GEMVs' scalar path and the dequantize-GEMM fallback; partial
// blocks and groups; k-block counts that are not a multiple of 4: the padded scale copy of the
// cuBLASLt block-scaled GEMM; token counts not a multiple of 4: its padded rows). Rows 1, 3,
// 8, 9 and 16 take the GEMVs (the tensor-core one up to 16 rows where it applies), 33 and 200
// the GEMMs. Bias and F32 outputs too.
// Pass: normalised MSE against the CPU within NMSE_Q (bf16 output rounding; the activation
// bytes and scales are the same on both backends since both quantize the same bf16 values
// with IEEE arithmetic), no NaN/Inf (outputs start poisoned), guard bytes intact; and a W8A8
// result must differ from the weight-only CPU product by at least its activation rounding
// (NMSE_ACT_MIN), so the GPU really quantizes the activations.
// Runs only where a GPU is (make CUDA=1 gpu-test on the GPU machine).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "common/check.h"
#include "core/dtype.h"
#include "test.h"

#define GUARD 256
#define NMSE_Q 1e-4       // bf16 outputs (the dequantize-GEMM fallback: also bf16 operands)
#define NMSE_MOE_W8A8 1e-3 // MoE W8A8: the SiLU*mul activation is quantized from f32 sums whose order differs
#define NMSE_ACT_MIN 1e-5 // W8A8 vs weight-only: FP8 activation rounding is ~2% RMS (nmse ~4e-4)

static struct backend *cpu_be, *gpu_be;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

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
static float rng_uniform(void) { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)); }
static float rng_sym(float s) { return (2.f * rng_uniform() - 1.f) * s; }
static float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// ---- guarded allocations ----
#define MAX_ALLOCS 64
struct pool {
    int n;
    struct {
        struct backend *b;
        void *p;
        size_t bytes;
    } a[MAX_ALLOCS];
};
static unsigned char guard_pattern[GUARD];

static void *pool_put(struct pool *P, struct backend *b, const void *host, size_t bytes) {
    void *p = b->ops->alloc(b, bytes + GUARD);
    CHECK(p && P->n < MAX_ALLOCS);
    if (!guard_pattern[0])
        for (int i = 0; i < GUARD; i++) guard_pattern[i] = (unsigned char)(0xA5 ^ (i * 29));
    if (host) b->ops->copy_h2d(b, p, host, bytes);
    else {
        void *t = malloc(bytes ? bytes : 1);
        memset(t, 0xff, bytes);
        b->ops->copy_h2d(b, p, t, bytes);
        free(t);
    }
    b->ops->copy_h2d(b, (char *)p + bytes, guard_pattern, GUARD);
    P->a[P->n].b = b;
    P->a[P->n].p = p;
    P->a[P->n].bytes = bytes;
    P->n++;
    return p;
}

static int pool_release(struct pool *P) {
    int bad = 0;
    unsigned char g[GUARD];
    for (int i = 0; i < P->n; i++) {
        struct backend *b = P->a[i].b;
        b->ops->synchronize(b);
        b->ops->copy_d2h(b, g, (char *)P->a[i].p + P->a[i].bytes, GUARD);
        if (memcmp(g, guard_pattern, GUARD)) {
            fprintf(stderr, "  guard bytes overwritten after a %zu-byte %s buffer\n", P->a[i].bytes, b->ops->name);
            bad++;
        }
        b->ops->free(b, P->a[i].p);
    }
    P->n = 0;
    return bad;
}

// A tensor of dtype dt holding host f32 values (NULL: poisoned).
static struct tensor put_f(struct pool *P, struct backend *b, enum dtype dt, int64_t r, int64_t c, const float *h) {
    struct tensor t = tensor_2d(NULL, dt, r, c);
    size_t bytes = tensor_bytes(&t);
    void *tmp = NULL;
    if (h) {
        tmp = malloc(bytes ? bytes : 1);
        dtype_from_f32(dt, h, tmp, r * c);
    }
    t.data = pool_put(P, b, tmp, bytes);
    free(tmp);
    return t;
}

static float *get_f(struct backend *b, const struct tensor *t) {
    size_t bytes = tensor_bytes(t);
    int64_t n = tensor_numel(t);
    void *raw = malloc(bytes ? bytes : 1);
    b->ops->synchronize(b);
    b->ops->copy_d2h(b, raw, t->data, bytes);
    float *f = malloc((size_t)(n ? n : 1) * sizeof(float));
    dtype_to_f32(t->dtype, raw, f, n);
    free(raw);
    return f;
}

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

// ---- quantized weights on the host ----
struct hq {
    enum weight_scheme scheme;
    int E, bits, br, bc; // bits 0: FP8
    int64_t m, k;
    void *vals;
    size_t vbytes;
    float *scale;
    int64_t ns, sr, sc;
    float *zero;   // GROUP zero points in scale's layout (NULL: none)
    int32_t *gidx; // GROUP column -> group map (k; NULL: none)
};

// Random zero points in [-2^(bits-1), 2^(bits-1)) (q's units) for a GROUP weight.
static void hq_add_zero(struct hq *q) {
    const int off = 1 << (q->bits - 1);
    q->zero = malloc(sizeof(float) * (size_t)q->ns);
    for (int64_t i = 0; i < q->ns; i++)
        q->zero[i] = (float)((int)(rng_next() >> 40) % (2 * off) - off);
}

// A random act-order map: the contiguous group of each column, shuffled (GPTQ desc_act).
static void hq_add_map(struct hq *q) {
    q->gidx = malloc(sizeof(int32_t) * (size_t)q->k);
    for (int64_t c = 0; c < q->k; c++)
        q->gidx[c] = (int32_t)(c / q->bc);
    for (int64_t c = q->k - 1; c > 0; c--) {
        int64_t j = (int64_t)(rng_next() % (uint64_t)(c + 1));
        int32_t t = q->gidx[c];
        q->gidx[c] = q->gidx[j];
        q->gidx[j] = t;
    }
}

static struct hq hq_make(enum weight_scheme s, int E, int bits, int64_t m, int64_t k, int br, int bc) {
    struct hq q = {.scheme = s, .E = E, .bits = bits, .br = br, .bc = bc, .m = m, .k = k};
    q.sr = 1, q.sc = 1;
    if (s == WEIGHT_SCHEME_BLOCK) q.sr = (m + br - 1) / br, q.sc = (k + bc - 1) / bc;
    if (s == WEIGHT_SCHEME_PER_CHANNEL) q.sr = m;
    if (s == WEIGHT_SCHEME_GROUP) q.sr = m, q.sc = (k + bc - 1) / bc;
    q.ns = (int64_t)E * q.sr * q.sc;
    q.scale = malloc(sizeof(float) * (size_t)q.ns);
    for (int64_t i = 0; i < q.ns; i++)
        q.scale[i] = bits ? 0.002f + 0.01f * rng_uniform() : 0.0005f + 0.002f * rng_uniform();
    if (bits) {
        const int per = 32 / bits;
        const int64_t words = k / per;
        q.vbytes = sizeof(uint32_t) * (size_t)(E * m * words);
        uint32_t *p = malloc(q.vbytes);
        for (int64_t i = 0; i < E * m * words; i++) {
            uint32_t u = 0;
            for (int j = 0; j < per; j++)
                u |= (uint32_t)(rng_next() >> 50 & ((1u << bits) - 1)) << (bits * j);
            p[i] = u;
        }
        q.vals = p;
    } else {
        q.vbytes = (size_t)(E * m * k);
        uint8_t *p = malloc(q.vbytes);
        for (size_t i = 0; i < q.vbytes; i++)
            p[i] = f32_to_fp8_e4m3(rng_sym(400.f));
        q.vals = p;
    }
    return q;
}

static void hq_free(struct hq *q) {
    free(q->vals);
    free(q->scale);
    free(q->zero);
    free(q->gidx);
}

// The weight on backend b (values and scales copied as they are).
static struct weight hq_put(struct pool *P, struct backend *b, const struct hq *q, enum weight_act act) {
    struct weight w = {0};
    void *v = pool_put(P, b, q->vals, q->vbytes);
    float *s = pool_put(P, b, q->scale, sizeof(float) * (size_t)q->ns);
    const enum dtype vt = q->bits ? DTYPE_I32 : DTYPE_FP8_E4M3;
    const int64_t cols = q->bits ? q->k / (32 / q->bits) : q->k;
    w.t = q->E > 1 ? tensor_make(v, vt, 3, (int64_t[]){q->E, q->m, cols}) : tensor_2d(v, vt, q->m, cols);
    if (q->scheme == WEIGHT_SCHEME_PER_TENSOR)
        w.scale = tensor_make(s, DTYPE_F32, 1, (int64_t[]){q->E});
    else if (q->scheme == WEIGHT_SCHEME_PER_CHANNEL)
        w.scale = q->E > 1 ? tensor_2d(s, DTYPE_F32, q->E, q->m) : tensor_make(s, DTYPE_F32, 1, (int64_t[]){q->m});
    else
        w.scale = q->E > 1 ? tensor_make(s, DTYPE_F32, 3, (int64_t[]){q->E, q->sr, q->sc})
                           : tensor_2d(s, DTYPE_F32, q->sr, q->sc);
    w.scheme = q->scheme;
    w.block_rows = q->scheme == WEIGHT_SCHEME_BLOCK ? q->br : 1;
    w.block_cols = q->bc;
    w.bits = q->bits;
    w.act = act;
    if (q->zero) {
        float *z = pool_put(P, b, q->zero, sizeof(float) * (size_t)q->ns);
        w.zero = tensor_make(z, DTYPE_F32, w.scale.ndim, w.scale.ne);
    }
    if (q->gidx)
        w.gidx = tensor_make(pool_put(P, b, q->gidx, sizeof(int32_t) * (size_t)q->k), DTYPE_I32, 1,
                             (int64_t[]){q->k});
    return w;
}

// ---------------------------------------------------------------------------------------

static const struct qcase {
    enum weight_scheme s;
    int bits, br, bc;
    int64_t m, k;
    enum weight_act act;
} QCASES[] = {
    {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 512, 1024, WEIGHT_ACT_FP8_TOKEN},
    {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 512, 1024, WEIGHT_ACT_NONE},
    {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 300, 200, WEIGHT_ACT_FP8_TOKEN}, // k % 16 != 0
    {WEIGHT_SCHEME_PER_TENSOR, 0, 0, 0, 256, 512, WEIGHT_ACT_FP8_TOKEN},
    {WEIGHT_SCHEME_PER_TENSOR, 0, 0, 0, 96, 160, WEIGHT_ACT_NONE},
    {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 384, 1024, WEIGHT_ACT_FP8_GROUP}, // kb 8
    {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 300, 640, WEIGHT_ACT_FP8_GROUP},  // kb 5 (padded), partial row block
    {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 256, 200, WEIGHT_ACT_FP8_GROUP},  // partial column block
    {WEIGHT_SCHEME_BLOCK, 0, 32, 128, 160, 512, WEIGHT_ACT_FP8_GROUP},   // a regridded fused weight
    {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 256, 512, WEIGHT_ACT_NONE},
    {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 512, 64, WEIGHT_ACT_FP8_GROUP}, // k < 128: one partial block (tiny MoE qkv)
    {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 64, 256, WEIGHT_ACT_FP8_GROUP}, // m < 128 (tiny o_proj)
    {WEIGHT_SCHEME_GROUP, 4, 1, 128, 256, 1024, WEIGHT_ACT_NONE},  // W4A16 group 128
    {WEIGHT_SCHEME_GROUP, 4, 1, 32, 100, 320, WEIGHT_ACT_NONE},    // group 32
    {WEIGHT_SCHEME_GROUP, 4, 1, 200, 64, 200, WEIGHT_ACT_NONE},    // per channel (one group), k % 16 != 0
    {WEIGHT_SCHEME_GROUP, 4, 1, 36, 40, 72, WEIGHT_ACT_NONE},      // groups that split words
    {WEIGHT_SCHEME_GROUP, 8, 1, 128, 200, 384, WEIGHT_ACT_NONE},   // W8A16
    {WEIGHT_SCHEME_GROUP, 8, 1, 256, 128, 256, WEIGHT_ACT_INT8_TOKEN}, // INT8 W8A8 (per channel)
    {WEIGHT_SCHEME_GROUP, 4, 1, 128, 128, 256, WEIGHT_ACT_INT8_TOKEN},
};

static const int NS[] = {1, 3, 8, 9, 16, 33, 200};

// Zero points, a column -> group map and a static activation scale (0: none) for a case.
struct qextra {
    bool zero, map;
    float act_scale;
};

// Returns the normalised MSE of the GPU result against the CPU's.
static double run_case_x(const struct qcase *c, const struct qextra *x, int n, bool with_bias, enum dtype ot) {
    struct pool P = {0};
    struct hq q = hq_make(c->s, 1, c->bits, c->m, c->k, c->br, c->bc);
    if (x->zero) hq_add_zero(&q);
    if (x->map) hq_add_map(&q);
    const int64_t m = c->m, k = c->k;
    float *xh = malloc(sizeof(float) * (size_t)(n * k)), *bh = malloc(sizeof(float) * (size_t)m);
    for (int64_t i = 0; i < n * k; i++)
        xh[i] = round_bf16(rng_sym(1.f) * (i % 29 == 0 ? 6.f : 1.f));
    for (int64_t j = 0; j < m; j++)
        bh[j] = ot == DTYPE_BF16 ? round_bf16(rng_sym(0.5f)) : rng_sym(0.5f);
    struct weight wc = hq_put(&P, cpu_be, &q, c->act), wg = hq_put(&P, gpu_be, &q, c->act);
    wc.act_scale = wg.act_scale = x->act_scale;
    struct weight wc_only = wc;
    wc_only.act = WEIGHT_ACT_NONE;
    struct tensor xc = put_f(&P, cpu_be, DTYPE_F32, n, k, xh), xg = put_f(&P, gpu_be, DTYPE_BF16, n, k, xh);
    struct tensor bc = put_f(&P, cpu_be, DTYPE_F32, 1, m, bh), bg = put_f(&P, gpu_be, ot, 1, m, bh);
    bc = tensor_make(bc.data, DTYPE_F32, 1, (int64_t[]){m});
    bg = tensor_make(bg.data, ot, 1, (int64_t[]){m});
    struct tensor yc = put_f(&P, cpu_be, DTYPE_F32, n, m, NULL), yw = put_f(&P, cpu_be, DTYPE_F32, n, m, NULL);
    struct tensor yg = put_f(&P, gpu_be, ot, n, m, NULL);
    cpu_be->ops->matmul(cpu_be, &yc, &xc, &wc, with_bias ? &bc : NULL);
    cpu_be->ops->matmul(cpu_be, &yw, &xc, &wc_only, with_bias ? &bc : NULL);
    gpu_be->ops->matmul(gpu_be, &yg, &xg, &wg, with_bias ? &bg : NULL);
    float *fc = get_f(cpu_be, &yc), *fw = get_f(cpu_be, &yw), *fg = get_f(gpu_be, &yg);
    double e = nmse(fg, fc, n * m), ea = nmse(fg, fw, n * m);
    if (!(e >= 0 && e <= NMSE_Q))
        test_fail(__FILE__, __LINE__,
                  "%s bits %d %lldx%lld br %d bc %d act %s zero %d map %d n=%d bias=%d out %s: nmse %g > %g",
                  weight_scheme_name(c->s), c->bits, (long long)m, (long long)k, c->br, c->bc, weight_act_name(c->act),
                  x->zero, x->map, n, with_bias, dtype_name(ot), e, NMSE_Q);
    if (c->act != WEIGHT_ACT_NONE && !(ea > NMSE_ACT_MIN))
        test_fail(__FILE__, __LINE__, "%s act %s n=%d: GPU result equals the weight-only product (nmse %g)",
                  weight_scheme_name(c->s), weight_act_name(c->act), n, ea);
    free(fc);
    free(fw);
    free(fg);
    free(xh);
    free(bh);
    hq_free(&q);
    if (pool_release(&P) != 0) test_fail(__FILE__, __LINE__, "guard bytes or NaN/Inf outputs");
    return e;
}

static void run_case(const struct qcase *c, int n, bool with_bias, enum dtype ot) {
    const struct qextra none = {false, false, 0.0f};
    run_case_x(c, &none, n, with_bias, ot);
}

TEST(cuda_qmatmul_matches_cpu_every_scheme) {
    ASSERT_TRUE(backends_ready());
    for (size_t ci = 0; ci < sizeof QCASES / sizeof QCASES[0]; ci++)
        for (size_t ni = 0; ni < sizeof NS / sizeof NS[0]; ni++)
            run_case(&QCASES[ci], NS[ni], false, DTYPE_BF16);
}

TEST(cuda_qmatmul_bias_and_f32_output) {
    ASSERT_TRUE(backends_ready());
    static const int idx[] = {0, 3, 6, 10, 15};
    for (size_t i = 0; i < sizeof idx / sizeof idx[0]; i++)
        for (int ni = 0; ni < 6; ni += 2) {
            run_case(&QCASES[idx[i]], NS[ni] + 2 * ni, true, DTYPE_BF16);
            run_case(&QCASES[idx[i]], NS[ni + 1], ni == 2, DTYPE_F32);
        }
}

// Issue 19 part 3: GROUP weights with zero points (GPTQ / AWQ / asymmetric compressed-tensors)
// and a column -> group map (desc_act), and static activation scales (x up to +-6: the scales
// below saturate the largest inputs), against the CPU.
TEST(cuda_qmatmul_zero_points_gidx_static_match_cpu) {
    ASSERT_TRUE(backends_ready());
    static const struct {
        struct qcase c;
        struct qextra x;
    } cases[] = {
        {{WEIGHT_SCHEME_GROUP, 4, 1, 32, 100, 320, WEIGHT_ACT_NONE}, {true, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 128, 256, 1024, WEIGHT_ACT_NONE}, {true, true, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 32, 96, 200, WEIGHT_ACT_NONE}, {true, true, 0.0f}}, // k % 16 != 0
        {{WEIGHT_SCHEME_GROUP, 4, 1, 36, 40, 72, WEIGHT_ACT_NONE}, {true, false, 0.0f}},  // groups split words
        {{WEIGHT_SCHEME_GROUP, 4, 1, 200, 64, 200, WEIGHT_ACT_NONE}, {true, false, 0.0f}}, // per channel
        {{WEIGHT_SCHEME_GROUP, 8, 1, 256, 128, 256, WEIGHT_ACT_INT8_TOKEN}, {true, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 64, 128, 256, WEIGHT_ACT_INT8_STATIC}, {false, false, 6.0f / 127 / 2}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 32, 96, 256, WEIGHT_ACT_INT8_STATIC}, {true, true, 6.0f / 127 / 2}},
        {{WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 512, 1024, WEIGHT_ACT_FP8_STATIC}, {false, false, 6.0f / 448 / 2}},
        {{WEIGHT_SCHEME_PER_TENSOR, 0, 0, 0, 96, 160, WEIGHT_ACT_FP8_STATIC}, {false, false, 6.0f / 448 / 2}},
        {{WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 300, 200, WEIGHT_ACT_FP8_STATIC}, {false, false, 1.0f / 448}},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ni = 0; ni < sizeof NS / sizeof NS[0]; ni++)
            run_case_x(&cases[ci].c, &cases[ci].x, NS[ni], ni == 2, ni == 4 ? DTYPE_F32 : DTYPE_BF16);
}

// INT8 W8A8 over per-channel INT8 weights (compressed-tensors int-quantized) at prefill sizes: the
// IMMA GEMM (cuda_qgemm.cu) where k and m are multiples of 16 and n > 16, the dequantize-GEMM
// fallback elsewhere. With F32 output the IMMA result is the exact integer sum times the two fp32
// scales, so it matches the CPU's fp32 sum of dequantized products to fp32 rounding (NMSE_IMMA);
// the fallback's bf16 weights would be ~1e-6 off, so this also shows which path ran (printed per
// case; asserted for n 200 and 512, not for n 33, which cuBLASLt may refuse).
#define NMSE_IMMA 1e-9
TEST(cuda_qgemm_int8_imma_matches_cpu) {
    ASSERT_TRUE(backends_ready());
    static const struct {
        int64_t m, k;
        enum weight_act act;
        bool imma; // the IMMA path is expected to take it
    } cases[] = {
        {128, 256, WEIGHT_ACT_INT8_TOKEN, true},  {528, 1024, WEIGHT_ACT_INT8_TOKEN, true},
        {2048, 4096, WEIGHT_ACT_INT8_TOKEN, true}, {256, 512, WEIGHT_ACT_INT8_STATIC, true},
        {100, 320, WEIGHT_ACT_INT8_TOKEN, false}, // m % 16 != 0: fallback
        {96, 200, WEIGHT_ACT_INT8_TOKEN, false},  // k % 16 != 0: fallback
    };
    static const int ns[] = {9, 16, 33, 200, 512};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            const struct qcase c = {WEIGHT_SCHEME_GROUP, 8, 1, (int)cases[ci].k, cases[ci].m, cases[ci].k,
                                    cases[ci].act};
            const struct qextra x = {false, false, cases[ci].act == WEIGHT_ACT_INT8_STATIC ? 6.0f / 127 / 2 : 0.0f};
            double e = run_case_x(&c, &x, ns[ni], ni % 2 == 1, DTYPE_F32);
            double eb = run_case_x(&c, &x, ns[ni], ni % 2 == 0, DTYPE_BF16);
            fprintf(stderr, "  int8 w8a8 m %5lld k %5lld n %3d %s: f32 nmse %.2e (%s), bf16 nmse %.2e\n",
                    (long long)c.m, (long long)c.k, ns[ni], weight_act_name(c.act), e,
                    e <= NMSE_IMMA ? "exact: IMMA" : "bf16 operands: fallback", eb);
            if (cases[ci].imma && ns[ni] > 16 && ns[ni] % 4 == 0 && !(e <= NMSE_IMMA))
                test_fail(__FILE__, __LINE__, "m %lld k %lld n %d: nmse %g > %g: the IMMA GEMM did not run",
                          (long long)c.m, (long long)c.k, ns[ni], e, NMSE_IMMA);
        }
}

// A captured INT8 IMMA GEMM replays the eager result after x changes in place.
TEST(cuda_qgemm_int8_graph_capture_replays) {
    ASSERT_TRUE(backends_ready());
    if (!gpu_be->ops->graph_begin) return;
    struct pool P = {0};
    const int64_t m = 256, k = 512;
    const int n = 64;
    struct hq q = hq_make(WEIGHT_SCHEME_GROUP, 1, 8, m, k, 1, (int)k);
    struct weight wg = hq_put(&P, gpu_be, &q, WEIGHT_ACT_INT8_TOKEN);
    float *xh = malloc(sizeof(float) * (size_t)(n * k));
    for (int64_t i = 0; i < n * k; i++) xh[i] = round_bf16(rng_sym(1.f));
    struct tensor xg = put_f(&P, gpu_be, DTYPE_BF16, n, k, xh);
    struct tensor y1 = put_f(&P, gpu_be, DTYPE_BF16, n, m, NULL), y2 = put_f(&P, gpu_be, DTYPE_BF16, n, m, NULL);
    struct error err = {0};
    gpu_be->ops->matmul(gpu_be, &y1, &xg, &wg, NULL); // eager warm-up (scratch, plans)
    void *graph = NULL;
    ASSERT_OK(gpu_be->ops->graph_begin(gpu_be, &err));
    gpu_be->ops->matmul(gpu_be, &y2, &xg, &wg, NULL);
    ASSERT_OK(gpu_be->ops->graph_end(gpu_be, &graph, &err));
    for (int64_t i = 0; i < n * k; i++) xh[i] = round_bf16(rng_sym(2.f));
    uint16_t *raw = malloc(sizeof(uint16_t) * (size_t)(n * k));
    for (int64_t i = 0; i < n * k; i++) raw[i] = f32_to_bf16(xh[i]);
    gpu_be->ops->copy_h2d(gpu_be, xg.data, raw, sizeof(uint16_t) * (size_t)(n * k));
    ASSERT_OK(gpu_be->ops->graph_launch(gpu_be, graph, &err));
    gpu_be->ops->matmul(gpu_be, &y1, &xg, &wg, NULL);
    float *a = get_f(gpu_be, &y1), *b = get_f(gpu_be, &y2);
    ASSERT_TRUE(nmse(b, a, n * m) == 0.0);
    gpu_be->ops->graph_destroy(gpu_be, graph);
    free(a);
    free(b);
    free(raw);
    free(xh);
    hq_free(&q);
    ASSERT_EQ(pool_release(&P), 0);
}

// The tensor-core GEMVs (cuda_qmatmul.cu qgemv_tma_kernel / qgemv_mma_kernel, rows 1..16; the prologue quantizes the
// activations of rows 1 and 2 itself, more rows come quantized by act_quant_kernel) on the shapes
// that reach their branches. The register kernel (k % 128 != 0): more units per warp than it keeps
// in flight (k 6160 / 9248), the two-warp k split (m over 2 CTAs per SM), partial units (k < 128),
// partial column groups (m % 16 != 0), static activations. The bulk-copy kernel (k % 128 == 0):
// the cases listed with it below, and the rest with k 6144 / 9216 / 2048 / 256. Both: zero points,
// per-channel INT4 (one group of all k); rows 9..16 take the second row tile.
TEST(cuda_qmatmul_mma_gemv_matches_cpu) {
    ASSERT_TRUE(backends_ready());
    static const struct {
        struct qcase c;
        struct qextra x;
    } cases[] = {
        {{WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 200, 6144, WEIGHT_ACT_FP8_TOKEN}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 200, 6160, WEIGHT_ACT_FP8_TOKEN}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 256, 4300, 2064, WEIGHT_ACT_INT8_TOKEN}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 9248, 72, 9248, WEIGHT_ACT_NONE}, {true, false, 0.0f}},
        {{WEIGHT_SCHEME_BLOCK, 0, 128, 128, 520, 6144, WEIGHT_ACT_FP8_GROUP}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_BLOCK, 0, 128, 128, 100, 2112, WEIGHT_ACT_FP8_GROUP}, {false, false, 0.0f}}, // partial unit
        {{WEIGHT_SCHEME_PER_TENSOR, 0, 0, 0, 40, 48, WEIGHT_ACT_FP8_STATIC}, {false, false, 6.0f / 448 / 2}},
        {{WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 72, 1040, WEIGHT_ACT_FP8_STATIC}, {false, false, 1.0f / 448}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 128, 100, 6144, WEIGHT_ACT_INT8_TOKEN}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 256, 4300, 2048, WEIGHT_ACT_INT8_TOKEN}, {false, false, 0.0f}}, // 4-warp split
        {{WEIGHT_SCHEME_GROUP, 8, 1, 128, 96, 400, WEIGHT_ACT_INT8_TOKEN}, {true, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 128, 64, 256, WEIGHT_ACT_INT8_STATIC}, {true, false, 6.0f / 127 / 2}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 128, 100, 9216, WEIGHT_ACT_NONE}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 128, 100, 9216, WEIGHT_ACT_NONE}, {true, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 9216, 72, 9216, WEIGHT_ACT_NONE}, {true, false, 0.0f}}, // per channel
        {{WEIGHT_SCHEME_GROUP, 4, 1, 128, 72, 160, WEIGHT_ACT_NONE}, {true, false, 0.0f}},   // partial unit
        {{WEIGHT_SCHEME_GROUP, 4, 1, 256, 4300, 2048, WEIGHT_ACT_NONE}, {true, false, 0.0f}},
        // The bulk-copy kernel (k % 128 == 0): more tiles than CTAs (2 per SM) with a partial last
        // tile, the stage ring wrapping within and across tiles (5 chunks a row), a partial last
        // chunk (17 units), INT4 chunks of 64-byte units with zero points.
        {{WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, 2204, 10240, WEIGHT_ACT_FP8_TOKEN}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_BLOCK, 0, 128, 128, 2204, 2176, WEIGHT_ACT_FP8_GROUP}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 8, 1, 128, 2204, 10240, WEIGHT_ACT_INT8_TOKEN}, {false, false, 0.0f}},
        {{WEIGHT_SCHEME_GROUP, 4, 1, 128, 2204, 10240, WEIGHT_ACT_NONE}, {true, false, 0.0f}},
    };
    static const int ns[] = {1, 2, 7, 8, 9, 15, 16};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
            run_case_x(&cases[ci].c, &cases[ci].x, ns[ni], ni == 3, ni == 5 ? DTYPE_F32 : DTYPE_BF16);
}

// The FP8 linears of the MiMo-V2-Flash release fixture (tests/fixtures/quant/mimo_v2_flash_fp8) in
// the layout the loader gives them (weight_loader.c load_quantized: fused parts regridded to the
// gcd of their row counts and 128), W8A8 with 128-column activation groups, at the fixture's
// prompt lengths (1, 6, 19, 37 rows: the fused-quantizing and pre-quantized tensor-core GEMV, the
// dequantize-GEMM fallback) and 13 (the test's position count): layer 0's fused q/k/v (768 + 384 +
// 256 rows, k = 64 < 128), layer 1's (768 + 768 + 512), the dense MLP's fused gate / up (64 + 64
// rows: 64-row blocks, k = 64), its down (64 x 64, one partial block) and o_proj (64 x 512: one
// partial row block, 4 column blocks; 19 / 37 rows take the cuBLASLt block-scaled GEMM).
TEST(cuda_qmatmul_mimo_fp8_shapes_match_cpu) {
    ASSERT_TRUE(backends_ready());
    static const struct qcase cases[] = {
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 1408, 64, WEIGHT_ACT_FP8_GROUP}, // layer 0 q / k / v
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 2048, 64, WEIGHT_ACT_FP8_GROUP}, // layer 1 q / k / v
        {WEIGHT_SCHEME_BLOCK, 0, 64, 128, 128, 64, WEIGHT_ACT_FP8_GROUP},   // dense gate / up, regridded
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 64, 64, WEIGHT_ACT_FP8_GROUP},   // dense down
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, 64, 512, WEIGHT_ACT_FP8_GROUP},  // o_proj
    };
    static const int ns[] = {1, 6, 13, 19, 37};
    const struct qextra none = {false, false, 0.0f};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            double e = run_case_x(&cases[ci], &none, ns[ni], false, DTYPE_BF16);
            fprintf(stderr, "  mimo fp8 %lldx%lld br %d n=%d: nmse %.2e\n", (long long)cases[ci].m,
                    (long long)cases[ci].k, cases[ci].br, ns[ni], e);
        }
}

// A captured graph of a quantized GEMV and GEMM replays the eager result after x changes in place:
// FP8 blocks at 1 and 16 rows (both take the tensor-core GEMV) and 40 rows (the GEMM), and a
// per-channel weight whose staged activations need more than 48 KB of shared memory (the
// GEMV sets its attribute while the graph is captured).
TEST(cuda_qmatmul_graph_capture_replays) {
    ASSERT_TRUE(backends_ready());
    if (!gpu_be->ops->graph_begin) return;
    static const struct {
        enum weight_scheme s;
        int64_t m, k;
        enum weight_act act;
        int n, grow; // grow > 0: between capture and replay, an eager call of `grow` rows
    } cfg[] = {
        {WEIGHT_SCHEME_BLOCK, 256, 512, WEIGHT_ACT_FP8_GROUP, 1, 0},
        {WEIGHT_SCHEME_BLOCK, 256, 512, WEIGHT_ACT_FP8_GROUP, 16, 0},
        {WEIGHT_SCHEME_BLOCK, 256, 512, WEIGHT_ACT_FP8_GROUP, 40, 0},
        {WEIGHT_SCHEME_PER_CHANNEL, 200, 6144, WEIGHT_ACT_FP8_TOKEN, 8, 0},
        // The eager call grows the quantized-matmul scratch past the captured one: the backend
        // keeps the captured buffer while graphs exist (it used to free it, and the replay wrote
        // freed memory: bench-runner's FP8 decode graphs at batch 64 / 100 died after the prefill
        // grew the scratch, session 14).
        {WEIGHT_SCHEME_PER_CHANNEL, 200, 6144, WEIGHT_ACT_FP8_TOKEN, 40, 2000},
    };
    for (size_t t = 0; t < sizeof cfg / sizeof cfg[0]; t++) {
        struct pool P = {0};
        const int n = cfg[t].n;
        const int64_t m = cfg[t].m, k = cfg[t].k;
        struct hq q = hq_make(cfg[t].s, 1, 0, m, k, 128, 128);
        struct weight wg = hq_put(&P, gpu_be, &q, cfg[t].act);
        float *xh = malloc(sizeof(float) * (size_t)(n * k));
        for (int64_t i = 0; i < n * k; i++) xh[i] = round_bf16(rng_sym(1.f));
        struct tensor xg = put_f(&P, gpu_be, DTYPE_BF16, n, k, xh);
        struct tensor y1 = put_f(&P, gpu_be, DTYPE_BF16, n, m, NULL), y2 = put_f(&P, gpu_be, DTYPE_BF16, n, m, NULL);
        struct error err = {0};
        gpu_be->ops->matmul(gpu_be, &y1, &xg, &wg, NULL); // eager warm-up (scratch, plans)
        void *graph = NULL;
        ASSERT_OK(gpu_be->ops->graph_begin(gpu_be, &err));
        gpu_be->ops->matmul(gpu_be, &y2, &xg, &wg, NULL);
        ASSERT_OK(gpu_be->ops->graph_end(gpu_be, &graph, &err));
        if (cfg[t].grow) {
            const int g = cfg[t].grow;
            float *gh = calloc((size_t)(g * k), sizeof(float));
            struct tensor xb = put_f(&P, gpu_be, DTYPE_BF16, g, k, gh), yb = put_f(&P, gpu_be, DTYPE_BF16, g, m, NULL);
            gpu_be->ops->matmul(gpu_be, &yb, &xb, &wg, NULL);
            free(gh);
        }
        for (int64_t i = 0; i < n * k; i++) xh[i] = round_bf16(rng_sym(2.f));
        uint16_t *raw = malloc(sizeof(uint16_t) * (size_t)(n * k));
        for (int64_t i = 0; i < n * k; i++) raw[i] = f32_to_bf16(xh[i]);
        gpu_be->ops->copy_h2d(gpu_be, xg.data, raw, sizeof(uint16_t) * (size_t)(n * k));
        ASSERT_OK(gpu_be->ops->graph_launch(gpu_be, graph, &err));
        gpu_be->ops->matmul(gpu_be, &y1, &xg, &wg, NULL);
        float *a = get_f(gpu_be, &y1), *b = get_f(gpu_be, &y2);
        ASSERT_TRUE(nmse(b, a, n * m) == 0.0);
        gpu_be->ops->graph_destroy(gpu_be, graph);
        free(a);
        free(b);
        free(raw);
        free(xh);
        hq_free(&q);
        ASSERT_EQ(pool_release(&P), 0);
    }
}

// moe_experts over quantized stacked experts: the GPU's slot kernels against the CPU's
// per-expert matmuls.
TEST(cuda_moe_experts_quantized_match_cpu) {
    ASSERT_TRUE(backends_ready());
    static const struct {
        enum weight_scheme s;
        int bits, br, bc;
        enum weight_act act;
        bool zero;       // zero points (issue 19 part 3)
        float act_scale; // static activations
    } cases[] = {
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, WEIGHT_ACT_FP8_GROUP, false, 0.0f},
        {WEIGHT_SCHEME_BLOCK, 0, 32, 128, WEIGHT_ACT_FP8_GROUP, false, 0.0f}, // regridded 32-row gate / up parts
        {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, WEIGHT_ACT_FP8_TOKEN, false, 0.0f},
        {WEIGHT_SCHEME_PER_TENSOR, 0, 0, 0, WEIGHT_ACT_FP8_TOKEN, false, 0.0f},
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, WEIGHT_ACT_NONE, false, 0.0f},
        {WEIGHT_SCHEME_GROUP, 4, 1, 128, WEIGHT_ACT_NONE, false, 0.0f}, // W4A16 experts
        {WEIGHT_SCHEME_GROUP, 8, 1, 32, WEIGHT_ACT_NONE, false, 0.0f},
        {WEIGHT_SCHEME_GROUP, 4, 1, 32, WEIGHT_ACT_NONE, true, 0.0f}, // GPTQ / AWQ-style experts
        {WEIGHT_SCHEME_GROUP, 8, 1, 128, WEIGHT_ACT_NONE, true, 0.0f},
        {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, WEIGHT_ACT_FP8_STATIC, false, 1.0f / 448},
    };
    const int E = 8, slots = 3;
    // I 192: one and a half 128-column groups; H 64, I 32: single partial blocks (qwen3_moe_fp8_block)
    for (int shp = 0; shp < 2; shp++) {
        const int64_t H = shp ? 64 : 256, I = shp ? 32 : 192;
        const int ns[] = {1, 5, 40};
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
            for (size_t ni = 0; ni < 3; ni++) {
                const int n = ns[ni];
                if (shp && cases[ci].s == WEIGHT_SCHEME_GROUP) continue; // groups wider than I
                struct pool P = {0};
                struct hq gu = hq_make(cases[ci].s, E, cases[ci].bits, 2 * I, H, cases[ci].br, cases[ci].bc);
                struct hq dn = hq_make(cases[ci].s, E, cases[ci].bits, H, I, cases[ci].br, cases[ci].bc);
                if (cases[ci].zero) {
                    hq_add_zero(&gu);
                    hq_add_zero(&dn);
                }
                struct weight guc = hq_put(&P, cpu_be, &gu, cases[ci].act);
                struct weight gug = hq_put(&P, gpu_be, &gu, cases[ci].act);
                struct weight dnc = hq_put(&P, cpu_be, &dn, cases[ci].act);
                struct weight dng = hq_put(&P, gpu_be, &dn, cases[ci].act);
                guc.act_scale = gug.act_scale = dnc.act_scale = dng.act_scale = cases[ci].act_scale;
                float *xh = malloc(sizeof(float) * (size_t)(n * H)), *wh = malloc(sizeof(float) * (size_t)(n * slots));
                int32_t *ih = malloc(sizeof(int32_t) * (size_t)(n * slots));
                for (int64_t i = 0; i < n * H; i++) xh[i] = round_bf16(rng_sym(1.f));
                for (int i = 0; i < n * slots; i++) {
                    ih[i] = (int32_t)((i * 5 + i / slots) % E);
                    wh[i] = 0.2f + 0.3f * rng_uniform();
                }
                struct tensor xc = put_f(&P, cpu_be, DTYPE_F32, n, H, xh), xg = put_f(&P, gpu_be, DTYPE_BF16, n, H, xh);
                struct tensor yc = put_f(&P, cpu_be, DTYPE_F32, n, H, NULL);
                struct tensor yg = put_f(&P, gpu_be, DTYPE_BF16, n, H, NULL);
                int32_t *idc = pool_put(&P, cpu_be, ih, sizeof(int32_t) * (size_t)(n * slots));
                int32_t *idg = pool_put(&P, gpu_be, ih, sizeof(int32_t) * (size_t)(n * slots));
                float *twc = pool_put(&P, cpu_be, wh, sizeof(float) * (size_t)(n * slots));
                float *twg = pool_put(&P, gpu_be, wh, sizeof(float) * (size_t)(n * slots));
                void *wsc = pool_put(&P, cpu_be, NULL, moe_workspace_bytes(n, slots, E, H, I, 4));
                void *wsg = pool_put(&P, gpu_be, NULL, moe_workspace_bytes(n, slots, E, H, I, 2));
                cpu_be->ops->moe_experts(cpu_be, &yc, &xc, &guc, &dnc, idc, twc, slots, NULL, wsc);
                gpu_be->ops->moe_experts(gpu_be, &yg, &xg, &gug, &dng, idg, twg, slots, NULL, wsg);
                float *fc = get_f(cpu_be, &yc), *fg = get_f(gpu_be, &yg);
                const double thr = cases[ci].act != WEIGHT_ACT_NONE ? NMSE_MOE_W8A8 : NMSE_Q;
                double e = nmse(fg, fc, n * H);
                if (shp)
                    fprintf(stderr, "  moe H %lld I %lld %s br %d act %s n=%d: nmse %.2e\n", (long long)H, (long long)I,
                            weight_scheme_name(cases[ci].s), cases[ci].br, weight_act_name(cases[ci].act), n, e);
                if (!(e >= 0 && e <= thr))
                    test_fail(__FILE__, __LINE__, "moe %s bits %d br %d act %s n=%d: nmse %g > %g",
                              weight_scheme_name(cases[ci].s), cases[ci].bits, cases[ci].br,
                              weight_act_name(cases[ci].act), n, e, thr);
                free(fc);
                free(fg);
                free(xh);
                free(wh);
                free(ih);
                hq_free(&gu);
                hq_free(&dn);
                ASSERT_EQ(pool_release(&P), 0);
            }
    }
}

// The MoE layer of the MiMo-V2-Flash FP8 release fixture (tests/fixtures/quant/mimo_v2_flash_fp8):
// 4 experts, top-2, H 64, moe_intermediate_size 16, in the loader's layout: gate_up's per-expert
// gate and up parts (16 rows each) regridded to 16-row blocks (each half its own scale), down's 64
// rows one 64-row block with k = 16 (a partial 128-column activation group), W8A8 with 128-column
// groups; routed rows 2 .. 74 (the fixture's prompts: slot kernels; its k = 16 keeps the grouped
// GEMM off at any size) and 140.
TEST(cuda_moe_experts_mimo_fp8_shapes_match_cpu) {
    ASSERT_TRUE(backends_ready());
    const int E = 4, slots = 2;
    const int64_t H = 64, I = 16;
    static const int ns[] = {1, 6, 13, 19, 37, 70};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        const int n = ns[ni];
        struct pool P = {0};
        struct hq gu = hq_make(WEIGHT_SCHEME_BLOCK, E, 0, 2 * I, H, 16, 128);
        struct hq dn = hq_make(WEIGHT_SCHEME_BLOCK, E, 0, H, I, 64, 128);
        struct weight guc = hq_put(&P, cpu_be, &gu, WEIGHT_ACT_FP8_GROUP);
        struct weight gug = hq_put(&P, gpu_be, &gu, WEIGHT_ACT_FP8_GROUP);
        struct weight dnc = hq_put(&P, cpu_be, &dn, WEIGHT_ACT_FP8_GROUP);
        struct weight dng = hq_put(&P, gpu_be, &dn, WEIGHT_ACT_FP8_GROUP);
        struct weight guw = guc, dnw = dnc; // the weight-only product: the GPU must differ from it
        guw.act = dnw.act = WEIGHT_ACT_NONE;
        float *xh = malloc(sizeof(float) * (size_t)(n * H)), *wh = malloc(sizeof(float) * (size_t)(n * slots));
        int32_t *ih = malloc(sizeof(int32_t) * (size_t)(n * slots));
        for (int64_t i = 0; i < n * H; i++)
            xh[i] = round_bf16(rng_sym(1.f));
        for (int t = 0; t < n; t++) {
            const int e0 = (t * 3 + 1) % E, e1 = (e0 + 1 + t % (E - 1)) % E; // two distinct experts
            ih[t * slots] = e0;
            ih[t * slots + 1] = e1;
            wh[t * slots] = 0.2f + 0.6f * rng_uniform();
            wh[t * slots + 1] = 0.2f + 0.6f * rng_uniform();
        }
        struct tensor xc = put_f(&P, cpu_be, DTYPE_F32, n, H, xh), xg = put_f(&P, gpu_be, DTYPE_BF16, n, H, xh);
        struct tensor yc = put_f(&P, cpu_be, DTYPE_F32, n, H, NULL), yw = put_f(&P, cpu_be, DTYPE_F32, n, H, NULL);
        struct tensor yg = put_f(&P, gpu_be, DTYPE_BF16, n, H, NULL);
        int32_t *idc = pool_put(&P, cpu_be, ih, sizeof(int32_t) * (size_t)(n * slots));
        int32_t *idg = pool_put(&P, gpu_be, ih, sizeof(int32_t) * (size_t)(n * slots));
        float *twc = pool_put(&P, cpu_be, wh, sizeof(float) * (size_t)(n * slots));
        float *twg = pool_put(&P, gpu_be, wh, sizeof(float) * (size_t)(n * slots));
        void *wsc = pool_put(&P, cpu_be, NULL, moe_workspace_bytes(n, slots, E, H, I, 4));
        void *wsg = pool_put(&P, gpu_be, NULL, moe_workspace_bytes(n, slots, E, H, I, 2));
        cpu_be->ops->moe_experts(cpu_be, &yc, &xc, &guc, &dnc, idc, twc, slots, NULL, wsc);
        cpu_be->ops->moe_experts(cpu_be, &yw, &xc, &guw, &dnw, idc, twc, slots, NULL, wsc);
        gpu_be->ops->moe_experts(gpu_be, &yg, &xg, &gug, &dng, idg, twg, slots, NULL, wsg);
        float *fc = get_f(cpu_be, &yc), *fw = get_f(cpu_be, &yw), *fg = get_f(gpu_be, &yg);
        const double e = nmse(fg, fc, n * H), ea = nmse(fg, fw, n * H);
        fprintf(stderr, "  mimo fp8 moe E %d top-%d H %lld I %lld n=%d: nmse %.2e (vs weight-only %.2e)\n", E, slots,
                (long long)H, (long long)I, n, e, ea);
        if (!(e >= 0 && e <= NMSE_MOE_W8A8))
            test_fail(__FILE__, __LINE__, "mimo fp8 moe n=%d: nmse %g > %g", n, e, NMSE_MOE_W8A8);
        if (!(ea > NMSE_ACT_MIN))
            test_fail(__FILE__, __LINE__, "mimo fp8 moe n=%d: GPU result equals the weight-only product (nmse %g)", n,
                      ea);
        free(fc);
        free(fw);
        free(fg);
        free(xh);
        free(wh);
        free(ih);
        hq_free(&gu);
        hq_free(&dn);
        ASSERT_EQ(pool_release(&P), 0);
    }
}

// Prefill-sized quantized MoE (more than 128 routed rows: cuda_moe_quant.cu's grouped tensor-core
// GEMM, weight tiles dequantized to bf16 in shared memory) against the CPU, with skewed routing:
// 3/8 of all slots on expert 0 (slot 0 of every token, slot 1 of even ones), expert 5 never chosen,
// the rest spread; H and I multiples of 64. n 20 (80 routed rows) stays on the slot path, 129 and 300
// (516, 1200 rows: tiles of 64 rows, a partial one per expert) take the GEMM.
// Tolerances as the slot path's (the GEMM's bf16 operands are the dequantize-GEMM fallback's).
TEST(cuda_moe_experts_quantized_prefill_match_cpu) {
    ASSERT_TRUE(backends_ready());
    static const struct {
        enum weight_scheme s;
        int bits, br, bc;
        enum weight_act act;
        bool zero;
        float act_scale;
    } cases[] = {
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, WEIGHT_ACT_FP8_GROUP, false, 0.0f}, // DeepSeek / Qwen3-FP8 experts
        {WEIGHT_SCHEME_BLOCK, 0, 128, 128, WEIGHT_ACT_NONE, false, 0.0f},
        {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, WEIGHT_ACT_FP8_TOKEN, false, 0.0f},
        {WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, WEIGHT_ACT_FP8_STATIC, false, 1.0f / 448},
        {WEIGHT_SCHEME_GROUP, 4, 1, 128, WEIGHT_ACT_NONE, false, 0.0f}, // W4A16 experts
        {WEIGHT_SCHEME_GROUP, 4, 1, 32, WEIGHT_ACT_NONE, true, 0.0f},   // GPTQ / AWQ-style, zero points
        {WEIGHT_SCHEME_GROUP, 8, 1, 128, WEIGHT_ACT_NONE, false, 0.0f}, // W8A16
    };
    const int E = 8, slots = 4;
    for (int shp = 0; shp < 2; shp++) {
        const int64_t H = shp ? 512 : 256, I = shp ? 384 : 192;
        const int ns[] = {20, 129, 300};
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
            for (size_t ni = 0; ni < 3; ni++) {
                const int n = ns[ni];
                struct pool P = {0};
                struct hq gu = hq_make(cases[ci].s, E, cases[ci].bits, 2 * I, H, cases[ci].br, cases[ci].bc);
                struct hq dn = hq_make(cases[ci].s, E, cases[ci].bits, H, I, cases[ci].br, cases[ci].bc);
                if (cases[ci].zero) {
                    hq_add_zero(&gu);
                    hq_add_zero(&dn);
                }
                struct weight guc = hq_put(&P, cpu_be, &gu, cases[ci].act);
                struct weight gug = hq_put(&P, gpu_be, &gu, cases[ci].act);
                struct weight dnc = hq_put(&P, cpu_be, &dn, cases[ci].act);
                struct weight dng = hq_put(&P, gpu_be, &dn, cases[ci].act);
                guc.act_scale = gug.act_scale = dnc.act_scale = dng.act_scale = cases[ci].act_scale;
                float *xh = malloc(sizeof(float) * (size_t)(n * H)), *wh = malloc(sizeof(float) * (size_t)(n * slots));
                int32_t *ih = malloc(sizeof(int32_t) * (size_t)(n * slots));
                for (int64_t i = 0; i < n * H; i++) xh[i] = round_bf16(rng_sym(1.f));
                static const int spread[] = {1, 2, 3, 4, 6, 7}; // expert 5 never chosen
                for (int t = 0; t < n; t++)
                    for (int j = 0; j < slots; j++) {
                        ih[t * slots + j] = j == 0 || (j == 1 && t % 2 == 0) ? 0 : spread[(t * 7 + j * 3) % 6];
                        wh[t * slots + j] = 0.2f + 0.3f * rng_uniform();
                    }
                struct tensor xc = put_f(&P, cpu_be, DTYPE_F32, n, H, xh), xg = put_f(&P, gpu_be, DTYPE_BF16, n, H, xh);
                struct tensor yc = put_f(&P, cpu_be, DTYPE_F32, n, H, NULL);
                struct tensor yg = put_f(&P, gpu_be, DTYPE_BF16, n, H, NULL);
                int32_t *idc = pool_put(&P, cpu_be, ih, sizeof(int32_t) * (size_t)(n * slots));
                int32_t *idg = pool_put(&P, gpu_be, ih, sizeof(int32_t) * (size_t)(n * slots));
                float *twc = pool_put(&P, cpu_be, wh, sizeof(float) * (size_t)(n * slots));
                float *twg = pool_put(&P, gpu_be, wh, sizeof(float) * (size_t)(n * slots));
                void *wsc = pool_put(&P, cpu_be, NULL, moe_workspace_bytes(n, slots, E, H, I, 4));
                void *wsg = pool_put(&P, gpu_be, NULL, moe_workspace_bytes(n, slots, E, H, I, 2));
                cpu_be->ops->moe_experts(cpu_be, &yc, &xc, &guc, &dnc, idc, twc, slots, NULL, wsc);
                gpu_be->ops->moe_experts(gpu_be, &yg, &xg, &gug, &dng, idg, twg, slots, NULL, wsg);
                float *fc = get_f(cpu_be, &yc), *fg = get_f(gpu_be, &yg);
                const double thr = cases[ci].act != WEIGHT_ACT_NONE ? NMSE_MOE_W8A8 : NMSE_Q;
                double e = nmse(fg, fc, n * H);
                fprintf(stderr, "  moe prefill H %lld I %lld %s bits %d act %s n=%d (%d routed rows): nmse %.2e\n",
                        (long long)H, (long long)I, weight_scheme_name(cases[ci].s), cases[ci].bits,
                        weight_act_name(cases[ci].act), n, n * slots, e);
                if (!(e >= 0 && e <= thr))
                    test_fail(__FILE__, __LINE__, "moe prefill %s bits %d act %s n=%d: nmse %g > %g",
                              weight_scheme_name(cases[ci].s), cases[ci].bits, weight_act_name(cases[ci].act), n, e,
                              thr);
                free(fc);
                free(fg);
                free(xh);
                free(wh);
                free(ih);
                hq_free(&gu);
                hq_free(&dn);
                ASSERT_EQ(pool_release(&P), 0);
            }
    }
}

int main(int argc, char **argv) {
    int rc = test_main(argc, argv);
    if (gpu_be) backend_destroy(gpu_be);
    if (cpu_be) backend_destroy(cpu_be);
    return rc;
}
