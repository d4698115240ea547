// Kernel microbenchmarks of the CUDA backend at Llama-3-8B shapes (hidden 4096, 32 q heads,
// 8 KV heads, head_dim 128, intermediate 14336, vocab 128256), through backend.h.
//
// Each measurement captures `reps` launches into one CUDA graph (launch gaps removed) and
// times graph replays with the host clock around a synchronize; inputs rotate over enough
// copies (>= 256 MiB) that repeated launches do not run out of the 60 MB L2. Prints one line
// per case: time per launch, achieved TFLOP/s and GB/s, and the ratio to the ceilings
// measured on the H200 (790 TFLOP/s dense bf16, 4.3 TB/s copy).
//
//   build-cuda/bench/gpu_kernels [matmul|quant [N]|attention|decode|moe [N]|norm|sample|mla|
//                                 qmatmul [N]|moeq [N]]
// mla: MLA prefill chunks (Moonlight's 16 heads, DeepSeek-V3's 128; nope 128 / rope 64 / v 128,
// kv_lora 512), mla_attention timed eagerly (the expanded prefill is never captured into graphs),
// expanded on the tensor cores vs mla_args.absorbed_only; FLOPs are the expanded form's (the
// kv_b GEMM over the context plus QK^T / PV over the causal range).
// (qmatmul and moeq only when named: INT8 W8A8 prefill GEMMs (cuda_qgemm.cu) and quantized MoE
// experts (cuda_moe_quant.cu), each against BF16 at the same shape)
// The split-KV heuristic's values are constants in src/backend/cuda/cuda_attention.cu (a sweep
// rebuilds with other values).
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "common/check.h"
#include "core/dtype.h"

#define PEAK_TFLOPS 790.0
#define PEAK_GBS 4300.0

static struct backend *B;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *alloc_rand(size_t bytes) {
    void *p = B->ops->alloc(B, bytes);
    CHECK_MSG(p, "out of device memory (%zu bytes)", bytes);
    // Random bf16 bit patterns of small magnitude: sign, exponent 120..127, random mantissa.
    size_t chunk = 1 << 24;
    uint16_t *h = malloc(chunk);
    uint64_t s = 0x9e3779b97f4a7c15ull ^ bytes;
    for (size_t i = 0; i < chunk / 2; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        h[i] = (uint16_t)((s & 0x807f) | ((120 + (s >> 20) % 8) << 7));
    }
    for (size_t off = 0; off < bytes; off += chunk) B->ops->copy_h2d(B, (char *)p + off, h, bytes - off < chunk ? bytes - off : chunk);
    free(h);
    return p;
}

typedef void (*bench_fn)(void *ctx, int i);

// Median of 5 timings of `reps` captured launches; returns seconds per launch.
static double time_graph(bench_fn fn, void *ctx, int reps) {
    struct error err = {0};
    fn(ctx, 0); // warm-up: plans, scratch
    B->ops->synchronize(B);
    void *g = NULL;
    CHECK(B->ops->graph_begin(B, &err) == ATOMC_OK);
    for (int i = 0; i < reps; i++) fn(ctx, i);
    CHECK_MSG(B->ops->graph_end(B, &g, &err) == ATOMC_OK, "%s", err.msg);
    CHECK(B->ops->graph_launch(B, g, &err) == ATOMC_OK);
    B->ops->synchronize(B);
    double t[5];
    for (int r = 0; r < 5; r++) {
        double t0 = now_s();
        CHECK(B->ops->graph_launch(B, g, &err) == ATOMC_OK);
        B->ops->synchronize(B);
        t[r] = (now_s() - t0) / reps;
    }
    B->ops->graph_destroy(B, g);
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (t[j] < t[i]) { double x = t[i]; t[i] = t[j]; t[j] = x; }
    return t[2];
}

static void report(const char *name, double sec, double flops, double bytes) {
    double tf = flops / sec / 1e12, gbs = bytes / sec / 1e9;
    printf("%-44s %9.2f us  %7.1f TFLOP/s (%5.1f%%)  %7.0f GB/s (%5.1f%%)\n", name, sec * 1e6, tf, 100 * tf / PEAK_TFLOPS,
           gbs, 100 * gbs / PEAK_GBS);
    fflush(stdout);
}

// ---------------------------------------------------------------------------------------
struct mm_ctx {
    int ncopies;
    struct tensor x, out, w[64];
};
static void mm_fn(void *c, int i) {
    struct mm_ctx *m = c;
    B->ops->matmul(B, &m->out, &m->x, WEIGHT_PLAIN(&m->w[i % m->ncopies]), NULL);
}

static double bench_matmul(const char *name, int64_t n, int64_t mdim, int64_t k) {
    struct mm_ctx m;
    size_t wbytes = (size_t)mdim * k * 2;
    m.ncopies = (int)((256u << 20) / wbytes + 1);
    if (m.ncopies > 64) m.ncopies = 64;
    for (int i = 0; i < m.ncopies; i++) m.w[i] = tensor_2d(alloc_rand(wbytes), DTYPE_BF16, mdim, k);
    m.x = tensor_2d(alloc_rand((size_t)n * k * 2), DTYPE_BF16, n, k);
    m.out = tensor_2d(alloc_rand((size_t)n * mdim * 2), DTYPE_BF16, n, mdim);
    double s = time_graph(mm_fn, &m, 40);
    char label[128];
    snprintf(label, sizeof label, "matmul %s n=%lld (m=%lld k=%lld)", name, (long long)n, (long long)mdim, (long long)k);
    report(label, s, 2.0 * n * mdim * k, (double)wbytes + (double)n * (k + mdim) * 2);
    for (int i = 0; i < m.ncopies; i++) B->ops->free(B, m.w[i].data);
    B->ops->free(B, m.x.data);
    B->ops->free(B, m.out.data);
    return s;
}

// ---------------------------------------------------------------------------------------
// Quantized matmuls (cuda_qmatmul.cu) at decode row counts: time per launch, GB/s over the
// weight's bytes (values + scales + zero points), its share of the copy ceiling, and the ratio
// to the bf16 matmul of the same shape timed just before in the same run (bf16 GB/s over its
// 2-byte weights): 1.00 = the quantized GEMV streams its bytes as fast as the bf16 one.
struct qscheme {
    const char *name;
    enum weight_scheme scheme;
    int bits, br, bc; // bits 0: FP8; bc 0: all of k
    enum weight_act act;
    bool zero;
};
static const struct qscheme QSCHEMES[] = {
    {"fp8 channel, fp8 token", WEIGHT_SCHEME_PER_CHANNEL, 0, 0, 0, WEIGHT_ACT_FP8_TOKEN, false},
    {"fp8 tensor, fp8 static", WEIGHT_SCHEME_PER_TENSOR, 0, 0, 0, WEIGHT_ACT_FP8_STATIC, false},
    {"fp8 block128, fp8 group128", WEIGHT_SCHEME_BLOCK, 0, 128, 128, WEIGHT_ACT_FP8_GROUP, false},
    {"int8 channel, int8 token", WEIGHT_SCHEME_GROUP, 8, 1, 0, WEIGHT_ACT_INT8_TOKEN, false},
    {"int4 group128 (w4a16)", WEIGHT_SCHEME_GROUP, 4, 1, 128, WEIGHT_ACT_NONE, false},
    {"int4 group128 + zero (w4a16)", WEIGHT_SCHEME_GROUP, 4, 1, 128, WEIGHT_ACT_NONE, true},
    {"int4 channel (w4a16)", WEIGHT_SCHEME_GROUP, 4, 1, 0, WEIGHT_ACT_NONE, false},
};

struct qmm_ctx {
    int ncopies;
    struct tensor x, out;
    struct weight w[64];
};
static void qmm_fn(void *c, int i) {
    struct qmm_ctx *q = c;
    B->ops->matmul(B, &q->out, &q->x, &q->w[i % q->ncopies], NULL);
}

static void bench_qmatmul(const struct qscheme *qs, const char *shape, int64_t n, int64_t mdim, int64_t k,
                          double bf16_s) {
    struct qmm_ctx q;
    const int bc = qs->bc ? qs->bc : (int)k;
    const int64_t vcols = qs->bits ? k / (32 / qs->bits) : k;
    const size_t vbytes = qs->bits ? (size_t)mdim * vcols * 4 : (size_t)mdim * k;
    int64_t sr = 1, sc = 1;
    if (qs->scheme == WEIGHT_SCHEME_PER_CHANNEL) sr = mdim;
    if (qs->scheme == WEIGHT_SCHEME_BLOCK) sr = (mdim + qs->br - 1) / qs->br, sc = (k + bc - 1) / bc;
    if (qs->scheme == WEIGHT_SCHEME_GROUP) sr = mdim, sc = (k + bc - 1) / bc;
    const size_t sbytes = sizeof(float) * (size_t)(sr * sc);
    const size_t wbytes = vbytes + sbytes * (qs->zero ? 2 : 1);
    q.ncopies = (int)((256u << 20) / wbytes + 1);
    if (q.ncopies > 64) q.ncopies = 64;
    // One allocation each for the copies' values, scales and zero points (filling is the slow part).
    const size_t sstride = (sbytes + 255) & ~(size_t)255;
    char *vall = alloc_rand(vbytes * q.ncopies), *sall = alloc_rand(sstride * q.ncopies);
    char *zall = qs->zero ? alloc_rand(sstride * q.ncopies) : NULL;
    for (int i = 0; i < q.ncopies; i++) {
        struct weight *w = &q.w[i];
        memset(w, 0, sizeof *w);
        w->t = tensor_2d(vall + vbytes * i, qs->bits ? DTYPE_I32 : DTYPE_FP8_E4M3, mdim, vcols);
        void *sd = sall + sstride * i;
        if (qs->scheme == WEIGHT_SCHEME_PER_TENSOR || qs->scheme == WEIGHT_SCHEME_PER_CHANNEL)
            w->scale = tensor_make(sd, DTYPE_F32, 1, (int64_t[]){sr});
        else
            w->scale = tensor_2d(sd, DTYPE_F32, sr, sc);
        if (qs->zero) w->zero = tensor_2d(zall + sstride * i, DTYPE_F32, sr, sc);
        w->scheme = qs->scheme;
        w->block_rows = qs->scheme == WEIGHT_SCHEME_BLOCK ? qs->br : 1;
        w->block_cols = qs->scheme == WEIGHT_SCHEME_BLOCK || qs->scheme == WEIGHT_SCHEME_GROUP ? bc : 0;
        w->bits = qs->bits;
        w->act = qs->act;
        w->act_scale = 0.01f;
    }
    q.x = tensor_2d(alloc_rand((size_t)n * k * 2), DTYPE_BF16, n, k);
    q.out = tensor_2d(alloc_rand((size_t)n * mdim * 2), DTYPE_BF16, n, mdim);
    double t = time_graph(qmm_fn, &q, 40);
    const double gbs = wbytes / t / 1e9, bf16_gbs = (double)mdim * k * 2 / bf16_s / 1e9;
    printf("qmatmul %-30s %-8s n=%-2lld (m=%lld k=%lld) %8.2f us %7.0f GB/s (%5.1f%%)  bf16 %7.0f GB/s  ratio %.2f\n",
           qs->name, shape, (long long)n, (long long)mdim, (long long)k, t * 1e6, gbs, 100 * gbs / PEAK_GBS, bf16_gbs,
           gbs / bf16_gbs);
    fflush(stdout);
    B->ops->free(B, vall);
    B->ops->free(B, sall);
    if (zall) B->ops->free(B, zall);
    B->ops->free(B, q.x.data);
    B->ops->free(B, q.out.data);
}

static void bench_qmatmul_all(int64_t only_n) {
    static const struct {
        const char *name;
        int64_t m, k;
    } shapes[] = {{"o", 4096, 4096}, {"qkv", 6144, 4096}, {"up", 14336, 4096}, {"down", 4096, 14336},
                  {"lm_head", 128256, 4096}};
    const int64_t ns[] = {1, 4, 8, 16};
    for (int ni = 0; ni < 4; ni++) {
        if (only_n && ns[ni] != only_n) continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            double bf = bench_matmul(shapes[si].name, ns[ni], shapes[si].m, shapes[si].k);
            for (size_t qi = 0; qi < sizeof QSCHEMES / sizeof QSCHEMES[0]; qi++)
                bench_qmatmul(&QSCHEMES[qi], shapes[si].name, ns[ni], shapes[si].m, shapes[si].k, bf);
        }
    }
}

// ---------------------------------------------------------------------------------------
// INT8 W8A8 (compressed-tensors int-quantized: per-channel INT8 weights packed in I32 words,
// dynamic per-token INT8 activations) through cuda_qmatmul: the IMMA GEMM of cuda_qgemm.cu above
// 8 rows. Reported against the BF16 matmul of the same shape timed right before it (qmm_ctx and
// qmm_fn are the ones above).

static double bench_time_bf16(int64_t n, int64_t mdim, int64_t k) {
    struct mm_ctx m;
    size_t wbytes = (size_t)mdim * k * 2;
    m.ncopies = (int)((256u << 20) / wbytes + 1);
    if (m.ncopies > 64) m.ncopies = 64;
    for (int i = 0; i < m.ncopies; i++) m.w[i] = tensor_2d(alloc_rand(wbytes), DTYPE_BF16, mdim, k);
    m.x = tensor_2d(alloc_rand((size_t)n * k * 2), DTYPE_BF16, n, k);
    m.out = tensor_2d(alloc_rand((size_t)n * mdim * 2), DTYPE_BF16, n, mdim);
    double s = time_graph(mm_fn, &m, 20);
    for (int i = 0; i < m.ncopies; i++) B->ops->free(B, m.w[i].data);
    B->ops->free(B, m.x.data);
    B->ops->free(B, m.out.data);
    return s;
}

static void bench_qmatmul_int8(const char *name, int64_t n, int64_t mdim, int64_t k) {
    struct qmm_ctx m;
    size_t wbytes = (size_t)mdim * k; // one byte per weight
    m.ncopies = (int)((256u << 20) / wbytes + 1);
    if (m.ncopies > 64) m.ncopies = 64;
    float *hs = malloc(sizeof(float) * (size_t)mdim);
    for (int64_t j = 0; j < mdim; j++) hs[j] = 0.001f + 0.0001f * (float)(j % 7);
    for (int i = 0; i < m.ncopies; i++) {
        struct weight *w = &m.w[i];
        memset(w, 0, sizeof *w);
        w->t = tensor_2d(alloc_rand(wbytes), DTYPE_I32, mdim, k / 4);
        float *sc = B->ops->alloc(B, sizeof(float) * (size_t)mdim);
        CHECK(sc);
        B->ops->copy_h2d(B, sc, hs, sizeof(float) * (size_t)mdim);
        w->scale = tensor_2d(sc, DTYPE_F32, mdim, 1);
        w->scheme = WEIGHT_SCHEME_GROUP;
        w->bits = 8;
        w->block_rows = 1;
        w->block_cols = (int)k;
        w->act = WEIGHT_ACT_INT8_TOKEN;
    }
    free(hs);
    m.x = tensor_2d(alloc_rand((size_t)n * k * 2), DTYPE_BF16, n, k);
    m.out = tensor_2d(alloc_rand((size_t)n * mdim * 2), DTYPE_BF16, n, mdim);
    double s = time_graph(qmm_fn, &m, 20);
    double sb = bench_time_bf16(n, mdim, k);
    char label[128];
    snprintf(label, sizeof label, "int8 w8a8 %s n=%lld (m=%lld k=%lld)", name, (long long)n, (long long)mdim,
             (long long)k);
    report(label, s, 2.0 * n * mdim * k, (double)wbytes + (double)n * (k + mdim) * 2);
    printf("%-44s bf16 matmul %9.2f us: int8 / bf16 time %.2f\n", "", sb * 1e6, s / sb);
    for (int i = 0; i < m.ncopies; i++) {
        B->ops->free(B, m.w[i].t.data);
        B->ops->free(B, m.w[i].scale.data);
    }
    B->ops->free(B, m.x.data);
    B->ops->free(B, m.out.data);
}

// ---------------------------------------------------------------------------------------
struct attn_ctx {
    int nlayers;
    struct kv_layer kv[64];
    struct tensor q, out;
    struct attn_metadata md;
};
static void attn_fn(void *c, int i) {
    struct attn_ctx *a = c;
    B->ops->attention(B, &a->out, &a->q, 0, &a->kv[i % a->nlayers], &a->md, 0.08838835f, 0, NULL);
}

// n_seqs sequences of context ctx, each with qlen new tokens (1 = decode).
static void bench_attention(int n_seqs, int ctx, int qlen, enum dtype kvdt) {
    const int hq = 32, hk = 8, D = 128, bs = 16;
    struct attn_ctx a;
    int bps = (ctx + bs - 1) / bs;
    int num_blocks = n_seqs * bps;
    size_t es = kvdt == DTYPE_FP8_E4M3 ? 1 : 2;
    size_t layer_bytes = (size_t)num_blocks * bs * hk * D * es;
    a.nlayers = (int)((512u << 20) / (2 * layer_bytes) + 1);
    if (a.nlayers > 64) a.nlayers = 64;
    int64_t ne[4] = {num_blocks, bs, hk, D};
    for (int l = 0; l < a.nlayers; l++) {
        a.kv[l].k = tensor_make(alloc_rand(layer_bytes), kvdt, 4, ne);
        a.kv[l].v = tensor_make(alloc_rand(layer_bytes), kvdt, 4, ne);
        a.kv[l].k_scale = a.kv[l].v_scale = 1.f;
    }
    int n_tok = n_seqs * qlen;
    int32_t *qs = malloc((n_seqs + 1) * 4), *cl = malloc(n_seqs * 4), *bt = malloc((size_t)n_seqs * bps * 4);
    for (int s = 0; s <= n_seqs; s++) qs[s] = s * qlen;
    for (int s = 0; s < n_seqs; s++) cl[s] = ctx;
    for (int i = 0; i < n_seqs * bps; i++) bt[i] = i;
    memset(&a.md, 0, sizeof a.md);
    a.md.n_seqs = n_seqs;
    a.md.n_tokens = n_tok;
    a.md.max_query_len = qlen;
    a.md.max_context_len = ctx;
    a.md.max_blocks_per_seq = bps;
    a.md.block_size = bs;
    a.md.decode_only = qlen == 1;
    int32_t *d_qs = B->ops->alloc(B, (n_seqs + 1) * 4), *d_cl = B->ops->alloc(B, n_seqs * 4),
            *d_bt = B->ops->alloc(B, (size_t)n_seqs * bps * 4);
    B->ops->copy_h2d(B, d_qs, qs, (n_seqs + 1) * 4);
    B->ops->copy_h2d(B, d_cl, cl, n_seqs * 4);
    B->ops->copy_h2d(B, d_bt, bt, (size_t)n_seqs * bps * 4);
    a.md.query_start = d_qs;
    a.md.context_lens = d_cl;
    a.md.block_tables = d_bt;
    a.md.h_query_start = qs;
    a.md.h_context_lens = cl;
    a.md.h_block_tables = bt;
    int64_t nq[3] = {n_tok, hq, D};
    a.q = tensor_make(alloc_rand((size_t)n_tok * hq * D * 2), DTYPE_BF16, 3, nq);
    a.out = tensor_make(alloc_rand((size_t)n_tok * hq * D * 2), DTYPE_BF16, 3, nq);
    double s = time_graph(attn_fn, &a, qlen == 1 ? 40 : 5);
    // FLOPs: QK^T and PV over the causal visible range; bytes: K and V once per sequence.
    double vis = qlen == 1 ? (double)ctx : (double)qlen * (ctx - qlen) + (double)qlen * (qlen + 1) / 2;
    double flops = 4.0 * n_seqs * hq * D * vis;
    double bytes = 2.0 * n_seqs * (double)ctx * hk * D * es + 2.0 * n_tok * hq * D * 2;
    char label[128];
    snprintf(label, sizeof label, "attention %s bs=%d ctx=%d q=%d %s", qlen == 1 ? "decode" : "prefill", n_seqs, ctx, qlen,
             dtype_name(kvdt));
    report(label, s, flops, bytes);
    for (int l = 0; l < a.nlayers; l++) {
        B->ops->free(B, a.kv[l].k.data);
        B->ops->free(B, a.kv[l].v.data);
    }
    B->ops->free(B, a.q.data);
    B->ops->free(B, a.out.data);
    B->ops->free(B, d_qs);
    B->ops->free(B, d_cl);
    B->ops->free(B, d_bt);
    free(qs); free(cl); free(bt);
}

// ---------------------------------------------------------------------------------------
// MLA prefill: n_seqs sequences of qlen new tokens after cached ones (context ctx each).
static double mla_time(struct tensor *out, struct tensor *q, struct kv_layer *kv, struct attn_metadata *md,
                       struct mla_args *a, void *ws, int reps) {
    B->ops->mla_attention(B, out, q, kv, md, a, ws); // warm-up: plans, the expansion buffer
    B->ops->synchronize(B);
    double t[3];
    for (int r = 0; r < 3; r++) {
        double t0 = now_s();
        for (int i = 0; i < reps; i++)
            B->ops->mla_attention(B, out, q, kv, md, a, ws);
        B->ops->synchronize(B);
        t[r] = (now_s() - t0) / reps;
    }
    double m = t[0] < t[1] ? (t[1] < t[2] ? t[1] : (t[0] < t[2] ? t[2] : t[0]))
                           : (t[0] < t[2] ? t[0] : (t[1] < t[2] ? t[2] : t[1]));
    return m;
}

static void bench_mla(int H, int n_seqs, int ctx, int qlen) {
    const int NP = 128, R = 64, L = 512, V = 128, D = L + R, DQ = NP + R, bs = 16;
    const int bps = (ctx + bs - 1) / bs, num_blocks = n_seqs * bps, n_tok = n_seqs * qlen;
    struct kv_layer kv = {0};
    int64_t ne[4] = {num_blocks, bs, 1, D};
    kv.k = tensor_make(alloc_rand((size_t)num_blocks * bs * D * 2), DTYPE_BF16, 4, ne);
    kv.k_scale = kv.v_scale = 1.f;
    struct weight kvb = {.scheme = WEIGHT_SCHEME_NONE};
    kvb.t = tensor_2d(alloc_rand((size_t)H * (NP + V) * L * 2), DTYPE_BF16, (int64_t)H * (NP + V), L);
    int32_t *qs = malloc((n_seqs + 1) * 4), *cl = malloc(n_seqs * 4), *bt = malloc((size_t)n_seqs * bps * 4);
    for (int s = 0; s <= n_seqs; s++)
        qs[s] = s * qlen;
    for (int s = 0; s < n_seqs; s++)
        cl[s] = ctx;
    for (int i = 0; i < n_seqs * bps; i++)
        bt[i] = i;
    struct attn_metadata md = {.n_seqs = n_seqs,
                               .n_tokens = n_tok,
                               .max_query_len = qlen,
                               .max_context_len = ctx,
                               .max_blocks_per_seq = bps,
                               .block_size = bs,
                               .h_query_start = qs,
                               .h_context_lens = cl,
                               .h_block_tables = bt};
    int32_t *d_qs = B->ops->alloc(B, (n_seqs + 1) * 4), *d_cl = B->ops->alloc(B, n_seqs * 4),
            *d_bt = B->ops->alloc(B, (size_t)n_seqs * bps * 4);
    B->ops->copy_h2d(B, d_qs, qs, (n_seqs + 1) * 4);
    B->ops->copy_h2d(B, d_cl, cl, n_seqs * 4);
    B->ops->copy_h2d(B, d_bt, bt, (size_t)n_seqs * bps * 4);
    md.query_start = d_qs;
    md.context_lens = d_cl;
    md.block_tables = d_bt;
    int64_t nq[3] = {n_tok, H, DQ}, no[3] = {n_tok, H, V};
    struct tensor q = tensor_make(alloc_rand((size_t)n_tok * H * DQ * 2), DTYPE_BF16, 3, nq);
    struct tensor out = tensor_make(alloc_rand((size_t)n_tok * H * V * 2), DTYPE_BF16, 3, no);
    void *ws = B->ops->alloc(B, mla_workspace_bytes(n_tok, H, L, R));
    struct mla_args a = {.n_heads = H, .nope = NP, .rope = R, .kv_lora = L, .v_dim = V, .scale = 0.0722f, .kv_b = &kvb};
    const uint64_t e0 = backend_cuda_mla_expanded_seqs(B);
    const double te = mla_time(&out, &q, &kv, &md, &a, ws, 3);
    const bool took = backend_cuda_mla_expanded_seqs(B) > e0;
    a.absorbed_only = true;
    const double ta = mla_time(&out, &q, &kv, &md, &a, ws, 1);
    double vis = (double)qlen * (ctx - qlen) + (double)qlen * (qlen + 1) / 2;
    double flops = 2.0 * n_seqs * ((double)ctx * L * H * (NP + V) + vis * H * (DQ + V));
    char label[128];
    snprintf(label, sizeof label, "mla prefill H=%d bs=%d ctx=%d q=%d expanded%s", H, n_seqs, ctx, qlen,
             took ? "" : " (NOT TAKEN)");
    report(label, te, flops, (double)n_seqs * ctx * D * 2);
    snprintf(label, sizeof label, "mla prefill H=%d bs=%d ctx=%d q=%d absorbed", H, n_seqs, ctx, qlen);
    report(label, ta, flops, (double)n_seqs * ctx * D * 2);
    printf("%-44s %9.2fx\n", "  absorbed / expanded time", ta / te);
    B->ops->free(B, kv.k.data);
    B->ops->free(B, kvb.t.data);
    B->ops->free(B, q.data);
    B->ops->free(B, out.data);
    B->ops->free(B, ws);
    B->ops->free(B, d_qs);
    B->ops->free(B, d_cl);
    B->ops->free(B, d_bt);
    free(qs);
    free(cl);
    free(bt);
}

// ---------------------------------------------------------------------------------------
struct norm_ctx {
    struct tensor x, res, out, w;
};
static void norm_fn(void *c, int i) {
    struct norm_ctx *n = c;
    B->ops->add_rmsnorm(B, &n->out, &n->res, &n->x, &n->w, 1e-5f);
}
static void silu_fn(void *c, int i) {
    struct norm_ctx *n = c;
    B->ops->silu_mul(B, &n->out, &n->x);
}

static void bench_norm_silu(int rows) {
    struct norm_ctx n;
    int d = 4096, f = 14336;
    n.x = tensor_2d(alloc_rand((size_t)rows * d * 2), DTYPE_BF16, rows, d);
    n.res = tensor_2d(alloc_rand((size_t)rows * d * 2), DTYPE_BF16, rows, d);
    n.out = tensor_2d(alloc_rand((size_t)rows * d * 2), DTYPE_BF16, rows, d);
    n.w = tensor_2d(alloc_rand((size_t)d * 2), DTYPE_BF16, 1, d);
    n.w.ndim = 1;
    n.w.ne[0] = d;
    double s = time_graph(norm_fn, &n, 50);
    char label[128];
    snprintf(label, sizeof label, "add_rmsnorm rows=%d d=%d", rows, d);
    report(label, s, 0, (double)rows * d * 2 * 4);
    B->ops->free(B, n.x.data);
    B->ops->free(B, n.out.data);
    n.x = tensor_2d(alloc_rand((size_t)rows * 2 * f * 2), DTYPE_BF16, rows, 2 * f);
    n.out = tensor_2d(alloc_rand((size_t)rows * f * 2), DTYPE_BF16, rows, f);
    s = time_graph(silu_fn, &n, 50);
    snprintf(label, sizeof label, "silu_mul rows=%d f=%d", rows, f);
    report(label, s, 0, (double)rows * f * 2 * 3);
    B->ops->free(B, n.x.data);
    B->ops->free(B, n.out.data);
    B->ops->free(B, n.res.data);
    B->ops->free(B, n.w.data);
}

// ---------------------------------------------------------------------------------------
struct sample_ctx {
    struct sample_args a;
    struct tensor logits;
};
static void sample_fn(void *c, int i) {
    struct sample_ctx *s = c;
    B->ops->sample(B, &s->a);
}

static void bench_sample(int rows, int vocab, float top_p, int top_k) {
    struct sample_ctx s;
    memset(&s, 0, sizeof s);
    s.logits = tensor_2d(alloc_rand((size_t)rows * vocab * 4), DTYPE_F32, rows, vocab);
    float *f = malloc(rows * 4 * 4);
    int32_t *k = malloc(rows * 4);
    uint64_t *u = malloc(rows * 8);
    for (int r = 0; r < rows; r++) { f[r] = 0.8f; f[rows + r] = top_p; f[2 * rows + r] = 0.f; k[r] = top_k; u[r] = r; }
    float *d_f = B->ops->alloc(B, rows * 4 * 4);
    int32_t *d_k = B->ops->alloc(B, rows * 4), *d_ids = B->ops->alloc(B, rows * 4);
    uint64_t *d_u = B->ops->alloc(B, rows * 8);
    B->ops->copy_h2d(B, d_f, f, rows * 4 * 4);
    B->ops->copy_h2d(B, d_k, k, rows * 4);
    B->ops->copy_h2d(B, d_u, u, rows * 8);
    s.a.n_rows = rows;
    s.a.vocab_size = vocab;
    s.a.logits = &s.logits;
    s.a.temperature = d_f;
    s.a.top_p = d_f + rows;
    s.a.min_p = d_f + 2 * rows;
    s.a.top_k = d_k;
    s.a.seed = d_u;
    s.a.step = d_u;
    s.a.out_ids = d_ids;
    double t = time_graph(sample_fn, &s, 10);
    char label[128];
    snprintf(label, sizeof label, "sample rows=%d vocab=%d top_p=%.2f top_k=%d", rows, vocab, top_p, top_k);
    report(label, t, 0, (double)rows * vocab * 4);
    B->ops->free(B, s.logits.data);
    B->ops->free(B, d_f); B->ops->free(B, d_k); B->ops->free(B, d_ids); B->ops->free(B, d_u);
    free(f); free(k); free(u);
}

// ---------------------------------------------------------------------------------------
// Fused MoE experts at Qwen3-30B-A3B's layer shape (128 experts, top-8, hidden 2048, expert
// intermediate 768). Bytes = the distinct experts' weights the routing touches + activations;
// weight copies rotate so consecutive launches do not find the previous layer in L2.
#define MOE_COPIES 3
struct moe_ctx {
    struct tensor x, out, gu[MOE_COPIES], dn[MOE_COPIES];
    int32_t *ids;
    float *w;
    int slots;
    void *ws;
};
static void moe_fn(void *c, int i) {
    struct moe_ctx *m = c;
    B->ops->moe_experts(B, &m->out, &m->x, WEIGHT_PLAIN(&m->gu[i % MOE_COPIES]), WEIGHT_PLAIN(&m->dn[i % MOE_COPIES]), m->ids, m->w, m->slots,
                        NULL, m->ws);
}

#define MOE_E 128
#define MOE_K 8
#define MOE_H 2048
#define MOE_I 768

// The rotating weight copies, allocated once for all cases (3 x 1.2 GB).
static void moe_weights_alloc(struct moe_ctx *m) {
    for (int c = 0; c < MOE_COPIES; c++) {
        m->gu[c] = tensor_make(alloc_rand((size_t)MOE_E * 2 * MOE_I * MOE_H * 2), DTYPE_BF16, 3,
                               (int64_t[]){MOE_E, 2 * MOE_I, MOE_H});
        m->dn[c] = tensor_make(alloc_rand((size_t)MOE_E * MOE_H * MOE_I * 2), DTYPE_BF16, 3,
                               (int64_t[]){MOE_E, MOE_H, MOE_I});
    }
}
static void moe_weights_free(struct moe_ctx *m) {
    for (int c = 0; c < MOE_COPIES; c++) {
        B->ops->free(B, m->gu[c].data);
        B->ops->free(B, m->dn[c].data);
    }
}

static void bench_moe(struct moe_ctx *weights, int n, bool uniform) {
    const int E = MOE_E, k = MOE_K;
    const int64_t H = MOE_H, I = MOE_I;
    struct moe_ctx m = *weights;
    m.slots = k;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * k);
    float *w = malloc(sizeof(float) * (size_t)n * k);
    bool used[MOE_E] = {0};
    uint64_t st = 0x2545f4914f6cdd1dull;
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < k; j++) {
            int e;
            if (uniform) {
                e = (int)(((int64_t)t * k + j) % E);
            } else { // k distinct experts per token, uniformly at random
                for (;;) {
                    st ^= st << 13; st ^= st >> 7; st ^= st << 17;
                    e = (int)(st % E);
                    bool dup = false;
                    for (int q = 0; q < j; q++) dup |= ids[t * k + q] == e;
                    if (!dup) break;
                }
            }
            ids[t * k + j] = e;
            w[t * k + j] = 1.0f / k;
            used[e] = true;
        }
    }
    int active = 0;
    for (int e = 0; e < E; e++) active += used[e];
    m.ids = B->ops->alloc(B, sizeof(int32_t) * (size_t)n * k);
    m.w = B->ops->alloc(B, sizeof(float) * (size_t)n * k);
    B->ops->copy_h2d(B, m.ids, ids, sizeof(int32_t) * (size_t)n * k);
    B->ops->copy_h2d(B, m.w, w, sizeof(float) * (size_t)n * k);
    m.x = tensor_2d(alloc_rand((size_t)n * H * 2), DTYPE_BF16, n, H);
    m.out = tensor_2d(alloc_rand((size_t)n * H * 2), DTYPE_BF16, n, H);
    m.ws = B->ops->alloc(B, moe_workspace_bytes(n, k, E, H, I, 2));
    double t = time_graph(moe_fn, &m, 30);
    char label[128];
    snprintf(label, sizeof label, "moe n=%d %s (%d experts active)", n, uniform ? "uniform" : "random", active);
    report(label, t, 2.0 * n * k * 3 * H * I, (double)active * 3 * H * I * 2 + (double)n * H * 4);
    B->ops->free(B, m.ids);
    B->ops->free(B, m.w);
    B->ops->free(B, m.x.data);
    B->ops->free(B, m.out.data);
    B->ops->free(B, m.ws);
    free(ids);
    free(w);
}

// Quantized experts at the MoE shape above (cuda_moe_quant.cu: the slot kernels up to 128 routed
// rows, the grouped tensor-core GEMM above): FP8 128x128 blocks with per-token-group FP8
// activations (DeepSeek / Qwen3-FP8) and INT4 group-128 weight-only (W4A16), random top-8 routing,
// each against the BF16 experts at the same n (bench_moe's path) timed right after.
struct moeq_ctx {
    struct tensor x, out;
    struct weight gu[MOE_COPIES], dn[MOE_COPIES];
    int32_t *ids;
    float *w;
    void *ws;
};
static void moeq_fn(void *c, int i) {
    struct moeq_ctx *m = c;
    B->ops->moe_experts(B, &m->out, &m->x, &m->gu[i % MOE_COPIES], &m->dn[i % MOE_COPIES], m->ids, m->w, MOE_K, NULL,
                        m->ws);
}

// A stacked quantized weight (E, rows, cols): random values, scales 0.01.
static struct weight moeq_weight(bool fp8, int64_t rows, int64_t cols) {
    struct weight w;
    memset(&w, 0, sizeof w);
    const int64_t E = MOE_E;
    const int64_t sr = fp8 ? (rows + 127) / 128 : rows, sc = (cols + 127) / 128;
    w.t = fp8 ? tensor_make(alloc_rand((size_t)(E * rows * cols)), DTYPE_FP8_E4M3, 3, (int64_t[]){E, rows, cols})
              : tensor_make(alloc_rand((size_t)(E * rows * cols / 2)), DTYPE_I32, 3, (int64_t[]){E, rows, cols / 8});
    const size_t ns = (size_t)(E * sr * sc);
    float *h = malloc(sizeof(float) * ns);
    for (size_t i = 0; i < ns; i++) h[i] = 0.01f;
    float *d = B->ops->alloc(B, sizeof(float) * ns);
    CHECK(d);
    B->ops->copy_h2d(B, d, h, sizeof(float) * ns);
    free(h);
    w.scale = tensor_make(d, DTYPE_F32, 3, (int64_t[]){E, sr, sc});
    w.scheme = fp8 ? WEIGHT_SCHEME_BLOCK : WEIGHT_SCHEME_GROUP;
    w.block_rows = fp8 ? 128 : 1;
    w.block_cols = 128;
    w.bits = fp8 ? 0 : 4;
    w.act = fp8 ? WEIGHT_ACT_FP8_GROUP : WEIGHT_ACT_NONE;
    return w;
}

static void bench_moe_quant(struct moe_ctx *bf16_weights, bool fp8, int n) {
    const int k = MOE_K;
    const int64_t H = MOE_H, I = MOE_I;
    struct moeq_ctx m;
    for (int c = 0; c < MOE_COPIES; c++) {
        m.gu[c] = moeq_weight(fp8, 2 * I, H);
        m.dn[c] = moeq_weight(fp8, H, I);
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * k);
    float *w = malloc(sizeof(float) * (size_t)n * k);
    uint64_t st = 0x2545f4914f6cdd1dull;
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) { // k distinct experts per token, uniformly at random
            int e;
            for (;;) {
                st ^= st << 13; st ^= st >> 7; st ^= st << 17;
                e = (int)(st % MOE_E);
                bool dup = false;
                for (int q = 0; q < j; q++) dup |= ids[t * k + q] == e;
                if (!dup) break;
            }
            ids[t * k + j] = e;
            w[t * k + j] = 1.0f / k;
        }
    m.ids = B->ops->alloc(B, sizeof(int32_t) * (size_t)n * k);
    m.w = B->ops->alloc(B, sizeof(float) * (size_t)n * k);
    B->ops->copy_h2d(B, m.ids, ids, sizeof(int32_t) * (size_t)n * k);
    B->ops->copy_h2d(B, m.w, w, sizeof(float) * (size_t)n * k);
    m.x = tensor_2d(alloc_rand((size_t)n * H * 2), DTYPE_BF16, n, H);
    m.out = tensor_2d(alloc_rand((size_t)n * H * 2), DTYPE_BF16, n, H);
    m.ws = B->ops->alloc(B, moe_workspace_bytes(n, k, MOE_E, H, I, 2));
    double t = time_graph(moeq_fn, &m, 20);
    struct moe_ctx b = *bf16_weights;
    b.slots = k;
    b.ids = m.ids;
    b.w = m.w;
    b.x = m.x;
    b.out = m.out;
    b.ws = m.ws;
    double tb = time_graph(moe_fn, &b, 20);
    char label[128];
    snprintf(label, sizeof label, "moe %s n=%d random", fp8 ? "fp8-block w8a8" : "int4-g128 w4a16", n);
    const double wb = fp8 ? 1.0 : 0.5;
    report(label, t, 2.0 * n * k * 3 * H * I, (double)MOE_E * 3 * H * I * wb + (double)n * H * 4);
    printf("%-44s bf16 experts %9.2f us: quantized / bf16 time %.2f\n", "", tb * 1e6, t / tb);
    for (int c = 0; c < MOE_COPIES; c++) {
        B->ops->free(B, m.gu[c].t.data);
        B->ops->free(B, m.gu[c].scale.data);
        B->ops->free(B, m.dn[c].t.data);
        B->ops->free(B, m.dn[c].scale.data);
    }
    B->ops->free(B, m.ids);
    B->ops->free(B, m.w);
    B->ops->free(B, m.x.data);
    B->ops->free(B, m.out.data);
    B->ops->free(B, m.ws);
    free(ids);
    free(w);
}

int main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : "";
    struct error err = {0};
    struct backend_options o = {.device_id = 0};
    if (backend_create("cuda", &o, &B, &err) != ATOMC_OK) {
        fprintf(stderr, "gpu_kernels: %s\n", err.msg);
        return 1;
    }
    printf("ceilings: %.0f TFLOP/s bf16 dense, %.0f GB/s copy (H200, measured)\n", PEAK_TFLOPS, PEAK_GBS);
    if (strstr("matmul", filter) || !*filter) {
        // n = 1: the row GEMV (qkv, gate_up, lm_head), the split-k GEMV (o, m = 4096), cuBLASLt for
        // down (k = 14336 > 8192); n >= 4: cuBLASLt.
        int64_t ns[] = {1, 4, 8, 16, 64, 256, 8192};
        for (int i = 0; i < 7; i++) {
            bench_matmul("qkv", ns[i], 6144, 4096);
            bench_matmul("o", ns[i], 4096, 4096);
            bench_matmul("gate_up", ns[i], 28672, 4096);
            bench_matmul("down", ns[i], 4096, 14336);
        }
        bench_matmul("lm_head", 1, 128256, 4096);
        bench_matmul("lm_head", 256, 128256, 4096);
    }
    if (!strcmp(filter, "moeq")) { // quantized experts (not in the default run)
        struct moe_ctx w;
        moe_weights_alloc(&w);
        const int n = argc > 2 ? atoi(argv[2]) : 4096; // gpu_kernels moeq [N]
        bench_moe_quant(&w, true, n);
        bench_moe_quant(&w, false, n);
        moe_weights_free(&w);
    }
    if (!strcmp(filter, "qmatmul")) { // quantized GEMMs (not in the default run)
        const int64_t n = argc > 2 ? atoll(argv[2]) : 4096; // gpu_kernels qmatmul [N]
        bench_qmatmul_int8("gate_up", n, 28672, 4096);
        bench_qmatmul_int8("down", n, 4096, 14336);
    }
    if (strstr("quant", filter) || !*filter) // gpu_kernels quant [N]: the quantized matmuls (rows N only)
        bench_qmatmul_all(!strcmp(filter, "quant") && argc > 2 ? atoll(argv[2]) : 0);
    bool decode_only = !strcmp(filter, "decode"); // decode attention cases alone (split-KV sweeps)
    if (strstr("attention", filter) || !*filter || decode_only) {
        int bss[] = {1, 1, 1, 8, 32, 64, 256};
        int ctxs[] = {1024, 4096, 32768, 4096, 4096, 2048, 1024};
        for (int i = 0; i < 7; i++) {
            bench_attention(bss[i], ctxs[i], 1, DTYPE_BF16);
            bench_attention(bss[i], ctxs[i], 1, DTYPE_FP8_E4M3);
        }
        if (!decode_only) {
            bench_attention(1, 1024, 1024, DTYPE_BF16);
            bench_attention(1, 8192, 8192, DTYPE_BF16);
            bench_attention(4, 2048, 2048, DTYPE_BF16);
        }
    }
    if (strstr("moe", filter) || !*filter) {
        int ns[] = {1, 2, 4, 8, 16, 64, 256, 512, 1024, 4096, 8192};
        struct moe_ctx w;
        moe_weights_alloc(&w);
        if (argc > 2) { // one batch size (profiling): gpu_kernels moe N
            bench_moe(&w, atoi(argv[2]), true);
        } else {
            for (int i = 0; i < 11; i++) bench_moe(&w, ns[i], true);
            bench_moe(&w, 1, false);
            bench_moe(&w, 4, false);
            bench_moe(&w, 512, false);
        }
        moe_weights_free(&w);
    }
    if (strstr("mla", filter) || !*filter) {
        bench_mla(16, 1, 4096, 4096);  // Moonlight: one 4K prompt in one chunk
        bench_mla(16, 2, 4096, 4096);  // bench-runner's prefill steps (8192 tokens)
        bench_mla(16, 4, 4096, 512);   // chunks after cached prefixes
        bench_mla(16, 16, 1024, 64);   // many short chunks
        bench_mla(128, 1, 2048, 2048); // DeepSeek-V3's heads
    }
    if (strstr("norm", filter) || !*filter) {
        bench_norm_silu(1);
        bench_norm_silu(256);
        bench_norm_silu(8192);
    }
    if (strstr("sample", filter) || !*filter) {
        bench_sample(1, 128256, 1.f, 0);
        bench_sample(256, 128256, 1.f, 0);
        bench_sample(256, 128256, 0.9f, 50);
        bench_sample(256, 128256, 0.9f, 0);
    }
    backend_destroy(B);
    return 0;
}
