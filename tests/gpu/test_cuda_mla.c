// The CUDA MLA ops (src/backend/cuda/cuda_mla.cu) against the CPU backend's (src/backend/cpu/
// cpu_mla.c, checked against a naive expanded double loop in tests/test_mla_ops.c). Runs only
// where a GPU is (make CUDA=1 gpu-tests; build-cuda/tests/gpu/test_cuda_mla).
//
// Inputs are rounded to BF16 first and the CPU sees the same values in F32. Shapes: DeepSeek-V3's
// (128 heads, nope 128, rope 64, kv_lora 512, v 128) and the tiny fixture's (4 heads, 32 / 32 / 64,
// v 48); batches: a decode batch (split-KV path, contexts up to 300 keys), a prefill chunk after
// cached tokens, and a prefill longer than one workspace chunk (MLA_WS_TOKENS), all with shuffled
// block tables. Checks: latent cache rows (BF16: within 1e-2 relative; FP8: 7e-2), roped q, and the
// attention output within NMSE 1e-4 (BF16 cache) / 5e-3 (FP8 cache) of the CPU's over the same rows.
// Sequences of >= 16 new tokens with (nope + rope, v) = (192, 128) run expanded on the tensor cores
// (cuda_mla.cu; backend_cuda_mla_expanded_seqs counts them, asserted), and every one of their
// tokens must also equal the absorbed decode of that token alone over the same cache (the issue's
// "absorbed decode equals the expanded prefill path on the same cache"), within the same bounds.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/dtype.h"
#include "test.h"

static struct backend *cpu_be, *gpu_be;
static uint64_t rng_state = 0x7f4a7c159e3779b9ull;
static uint64_t rng_next(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_sym(float s) {
    return (float)(((rng_next() >> 40) * (1.0 / 16777216.0)) * 2.0 - 1.0) * s;
}
static float rbf(float x) {
    return bf16_to_f32(f32_to_bf16(x));
}

static int backends_ready(void) {
    if (cpu_be && gpu_be) return 1;
    struct error err = {0};
    struct backend_options o = {.num_threads = 0, .device_id = 0, .kv_pool_bytes = 64u << 20};
    if (backend_create("cpu", &o, &cpu_be, &err) != ATOMC_OK) return 0;
    if (backend_create("cuda", &o, &gpu_be, &err) != ATOMC_OK) {
        fprintf(stderr, "  no CUDA backend: %s\n", err.msg);
        return 0;
    }
    return 1;
}

static void *gpu_copy(const void *h, size_t bytes) {
    void *d = gpu_be->ops->alloc(gpu_be, bytes);
    gpu_be->ops->copy_h2d(gpu_be, d, h, bytes);
    return d;
}

static void *gpu_bf16(const float *x, int64_t n) {
    uint16_t *h = malloc((size_t)n * 2);
    dtype_from_f32(DTYPE_BF16, x, h, n);
    void *d = gpu_copy(h, (size_t)n * 2);
    gpu_be->ops->synchronize(gpu_be);
    free(h);
    return d;
}

static void gpu_read(void *dst, const void *src, size_t bytes) {
    gpu_be->ops->synchronize(gpu_be);
    gpu_be->ops->copy_d2h(gpu_be, dst, src, bytes);
    gpu_be->ops->synchronize(gpu_be);
}

struct shape {
    int H, NP, R, L, V;
};

// One batch: n_seqs sequences with q_len[s] new tokens after cached[s] cached ones.
static void check(const struct shape *sh, int n_seqs, const int *q_len, const int *cached, enum dtype kv_dt,
                  const char *what) {
    const int H = sh->H, NP = sh->NP, R = sh->R, L = sh->L, V = sh->V, D = L + R, DQ = NP + R, bs = 16;
    int T = 0, max_ctx = 0, max_blocks = 0, nblk = 0;
    for (int s = 0; s < n_seqs; s++) {
        T += q_len[s];
        int ctx = cached[s] + q_len[s], nb = (ctx + bs - 1) / bs;
        if (ctx > max_ctx) max_ctx = ctx;
        if (nb > max_blocks) max_blocks = nb;
        nblk += nb;
    }
    int32_t *qs = calloc((size_t)n_seqs + 1, 4), *ctx = calloc((size_t)n_seqs, 4);
    int32_t *bt = calloc((size_t)n_seqs * max_blocks, 4), *pos = calloc((size_t)T, 4), *slot = calloc((size_t)T, 4);
    int *perm = malloc(sizeof(int) * (size_t)nblk);
    for (int i = 0; i < nblk; i++)
        perm[i] = i;
    for (int i = nblk - 1; i > 0; i--) {
        int j = (int)(rng_next() % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int next = 0, t = 0, max_q = 0;
    for (int s = 0; s < n_seqs; s++) {
        qs[s] = t;
        ctx[s] = cached[s] + q_len[s];
        if (q_len[s] > max_q) max_q = q_len[s];
        for (int k = 0; k < (ctx[s] + bs - 1) / bs; k++)
            bt[s * max_blocks + k] = perm[next++];
        for (int i = 0; i < q_len[s]; i++, t++) {
            pos[t] = cached[s] + i;
            slot[t] = bt[s * max_blocks + pos[t] / bs] * bs + pos[t] % bs;
        }
    }
    qs[n_seqs] = T;
    // Host values (BF16-rounded) and the cached tokens' latent rows.
    size_t nkvb = (size_t)H * (NP + V) * L;
    float *kvb = malloc(nkvb * 4), *normw = malloc((size_t)L * 4), *q = malloc((size_t)T * H * DQ * 4);
    float *kva = malloc((size_t)T * D * 4), inv_freq[64];
    for (size_t i = 0; i < nkvb; i++)
        kvb[i] = rbf(rng_sym(0.08f));
    for (int i = 0; i < L; i++)
        normw[i] = rbf(1.0f + rng_sym(0.2f));
    for (int64_t i = 0; i < (int64_t)T * H * DQ; i++)
        q[i] = rbf(rng_sym(1.5f));
    for (int64_t i = 0; i < (int64_t)T * D; i++)
        kva[i] = rbf(rng_sym(1.5f));
    for (int i = 0; i < R / 2; i++)
        inv_freq[i] = (float)(1.0 / pow(10000.0, 2.0 * i / R));
    const size_t slots = (size_t)nblk * bs, row = dtype_row_bytes(kv_dt, D);
    unsigned char *cache_h = calloc(slots, row);
    float *f = malloc((size_t)D * 4);
    for (int s = 0; s < n_seqs; s++)
        for (int p = 0; p < cached[s]; p++) {
            for (int i = 0; i < D; i++)
                f[i] = rng_sym(1.2f);
            int64_t sl = bt[s * max_blocks + p / bs] * bs + p % bs;
            dtype_from_f32(kv_dt, f, cache_h + (size_t)sl * row, D);
        }
    // CPU: F32 activations, the BF16 weight, the cache in the same dtype.
    struct weight wc = {.scheme = WEIGHT_SCHEME_NONE}, wg = {.scheme = WEIGHT_SCHEME_NONE};
    struct tensor hw = tensor_2d(kvb, DTYPE_F32, H * (NP + V), L);
    wc.t = tensor_2d(NULL, DTYPE_BF16, H * (NP + V), L);
    wg.t = tensor_2d(NULL, DTYPE_BF16, H * (NP + V), L);
    struct error err = {0};
    ASSERT_OK(cpu_be->ops->upload_weight(cpu_be, &wc.t, &hw, &err));
    ASSERT_OK(gpu_be->ops->upload_weight(gpu_be, &wg.t, &hw, &err));
    struct mla_args ac = {.n_heads = H, .nope = NP, .rope = R, .kv_lora = L, .v_dim = V, .scale = 0.07f, .kv_b = &wc};
    struct mla_args ag = ac;
    ag.kv_b = &wg;
    struct attn_metadata md = {.n_seqs = n_seqs,
                               .n_tokens = T,
                               .max_query_len = max_q,
                               .max_context_len = max_ctx,
                               .max_blocks_per_seq = max_blocks,
                               .block_size = bs,
                               .decode_only = max_q == 1,
                               .h_query_start = qs,
                               .h_context_lens = ctx,
                               .h_block_tables = bt,
                               .h_positions = pos,
                               .h_slot_mapping = slot};
    struct attn_metadata mc = md;
    mc.query_start = qs;
    mc.context_lens = ctx;
    mc.block_tables = bt;
    mc.positions = pos;
    mc.slot_mapping = slot;
    struct attn_metadata mg = md;
    mg.query_start = gpu_copy(qs, (size_t)(n_seqs + 1) * 4);
    mg.context_lens = gpu_copy(ctx, (size_t)n_seqs * 4);
    mg.block_tables = gpu_copy(bt, (size_t)n_seqs * max_blocks * 4);
    mg.positions = gpu_copy(pos, (size_t)T * 4);
    mg.slot_mapping = gpu_copy(slot, (size_t)T * 4);
    unsigned char *cache_c = malloc(slots * row);
    memcpy(cache_c, cache_h, slots * row);
    void *cache_g = gpu_copy(cache_h, slots * row);
    struct kv_layer kc = {.k = tensor_make(cache_c, kv_dt, 4, (int64_t[]){nblk, bs, 1, D}), .k_scale = 1, .v_scale = 1};
    struct kv_layer kg = kc;
    kg.k.data = cache_g;
    float *qc = malloc((size_t)T * H * DQ * 4);
    memcpy(qc, q, (size_t)T * H * DQ * 4);
    void *qg = gpu_bf16(q, (int64_t)T * H * DQ), *kvag = gpu_bf16(kva, (int64_t)T * D);
    void *normg = gpu_bf16(normw, L);
    struct tensor tqc = tensor_make(qc, DTYPE_F32, 3, (int64_t[]){T, H, DQ});
    struct tensor tqg = tensor_make(qg, DTYPE_BF16, 3, (int64_t[]){T, H, DQ});
    struct tensor tkc = tensor_2d(kva, DTYPE_F32, T, D), tkg = tensor_2d(kvag, DTYPE_BF16, T, D);
    struct tensor nc = tensor_make(normw, DTYPE_F32, 1, (int64_t[]){L});
    struct tensor ng = tensor_make(normg, DTYPE_BF16, 1, (int64_t[]){L});
    struct rope_args rope_c = {.inv_freq = inv_freq, .rotary_dim = R, .attn_factor = 1.1f, .interleaved = true};
    struct rope_args rope_g = rope_c;
    rope_g.inv_freq = gpu_copy(inv_freq, sizeof(float) * (size_t)(R / 2));
    cpu_be->ops->mla_latent_write(cpu_be, &tqc, &tkc, &nc, 1e-6f, &rope_c, &ac, &kc, &mc);
    gpu_be->ops->mla_latent_write(gpu_be, &tqg, &tkg, &ng, 1e-6f, &rope_g, &ag, &kg, &mg);
    // Cache rows and roped q.
    unsigned char *back = malloc(slots * row);
    gpu_read(back, cache_g, slots * row);
    // BF16 rows: relative 1e-2. FP8 rows: the CUDA kernel rounds the normed latent to BF16 before
    // the FP8 conversion (what a separate BF16 rmsnorm would store), the CPU converts its F32 value
    // directly; the two differ by one e4m3 step where the BF16 rounding crosses an e4m3 midpoint, for
    // about bf16 ulp / e4m3 ulp = 2^-5 (3.1%) of the values (measured on the H200: 72 of 2304, 2852
    // of 91008). So: at most one e4m3 step (2^(e-3) at the larger magnitude) anywhere, on at most 5%.
    double worst_row = 0;
    long n_diff = 0;
    const bool fp8 = kv_dt == DTYPE_FP8_E4M3;
    for (int i = 0; i < T; i++) {
        float a[1024], b[1024];
        dtype_to_f32(kv_dt, cache_c + (size_t)slot[i] * row, a, D);
        dtype_to_f32(kv_dt, back + (size_t)slot[i] * row, b, D);
        for (int e = 0; e < D; e++) {
            const double m = fmax(fabs(a[e]), fabs(b[e]));
            double d = fabs(a[e] - b[e]) / (1 + fabs(a[e]));
            if (fp8) d = m > 0 ? fabs(a[e] - b[e]) / ldexp(1.0, (m < 0x1p-6 ? -6 : ilogb(m)) - 3) : 0;
            n_diff += a[e] != b[e];
            if (d > worst_row) worst_row = d;
        }
    }
    fprintf(stderr, "  %-34s %s cache rows: worst %.3g%s, %ld of %lld values differ\n", what, dtype_name(kv_dt),
            worst_row, fp8 ? " e4m3 steps" : " relative", n_diff, (long long)T * D);
    ASSERT_TRUE(worst_row <= (fp8 ? 1.0 : 1e-2));
    if (fp8) ASSERT_TRUE(n_diff * 20 <= (long long)T * D);
    // Attention over the (CPU-written) rows: the GPU reads the CPU cache's bytes so both attend to
    // the same values.
    gpu_be->ops->copy_h2d(gpu_be, cache_g, cache_c, slots * row);
    // q: the GPU attends with its own roped q; the CPU's q is rounded to BF16 for the comparison.
    float *qback = malloc((size_t)T * H * DQ * 4);
    uint16_t *qb16 = malloc((size_t)T * H * DQ * 2);
    gpu_read(qb16, qg, (size_t)T * H * DQ * 2);
    dtype_to_f32(DTYPE_BF16, qb16, qback, (int64_t)T * H * DQ);
    double qerr = 0;
    for (int64_t i = 0; i < (int64_t)T * H * DQ; i++) {
        double d = fabs(qback[i] - qc[i]) / (1 + fabs(qc[i]));
        if (d > qerr) qerr = d;
        qc[i] = qback[i];
    }
    ASSERT_TRUE(qerr <= 1e-2);
    float *oc = malloc((size_t)T * H * V * 4), *og = malloc((size_t)T * H * V * 4);
    void *outg = gpu_be->ops->alloc(gpu_be, (size_t)T * H * V * 2);
    size_t ws_bytes = mla_workspace_bytes(T, H, L, R);
    void *ws = gpu_be->ops->alloc(gpu_be, ws_bytes);
    struct tensor toc = tensor_make(oc, DTYPE_F32, 3, (int64_t[]){T, H, V});
    struct tensor tog = tensor_make(outg, DTYPE_BF16, 3, (int64_t[]){T, H, V});
    cpu_be->ops->mla_attention(cpu_be, &toc, &tqc, &kc, &mc, &ac, NULL);
    const uint64_t expanded_before = backend_cuda_mla_expanded_seqs(gpu_be);
    gpu_be->ops->mla_attention(gpu_be, &tog, &tqg, &kg, &mg, &ag, ws);
    uint16_t *ob = malloc((size_t)T * H * V * 2);
    gpu_read(ob, outg, (size_t)T * H * V * 2);
    dtype_to_f32(DTYPE_BF16, ob, og, (int64_t)T * H * V);
    double num = 0, den = 0;
    for (int64_t i = 0; i < (int64_t)T * H * V; i++) {
        if (!isfinite(og[i])) num = INFINITY;
        num += (og[i] - oc[i]) * (double)(og[i] - oc[i]);
        den += (double)oc[i] * oc[i];
    }
    const double nmse = num / (den > 0 ? den : 1), bound = kv_dt == DTYPE_FP8_E4M3 ? 5e-3 : 1e-4;
    fprintf(stderr, "  %-34s %s cache: rows %.1e, q %.1e, attention nmse %.2e (bound %.0e)\n", what, dtype_name(kv_dt),
            worst_row, qerr, nmse, bound);
    ASSERT_TRUE(nmse <= bound);
    // Sequences of >= MLA_EXPAND_MIN_QLEN (16) new tokens with head dims the flash kernel has ran
    // expanded (tensor cores); each of their tokens must equal the absorbed decode of that token
    // alone: a batch of one-token sequences over the same cache rows (context pos + 1, the
    // sequence's block table), which never expands.
    int n_exp = 0, T2 = 0;
    const bool dims_ok = (NP + R == V && (V == 64 || V == 128 || V == 256)) || (NP + R == 192 && V == 128);
    for (int s = 0; s < n_seqs; s++)
        if (dims_ok && q_len[s] >= 16) {
            n_exp++;
            T2 += q_len[s];
        }
    const uint64_t expanded = backend_cuda_mla_expanded_seqs(gpu_be) - expanded_before;
    ASSERT_EQ((long long)expanded, (long long)n_exp);
    if (T2 > 0) {
        int32_t *qs2 = calloc((size_t)T2 + 1, 4), *ctx2 = calloc((size_t)T2, 4), *src2 = calloc((size_t)T2, 4);
        int32_t *bt2 = calloc((size_t)T2 * max_blocks, 4);
        int k = 0;
        for (int s = 0; s < n_seqs; s++)
            if (dims_ok && q_len[s] >= 16)
                for (int i = 0; i < q_len[s]; i++, k++) {
                    qs2[k] = k;
                    ctx2[k] = cached[s] + i + 1;
                    src2[k] = qs[s] + i;
                    memcpy(bt2 + (size_t)k * max_blocks, bt + (size_t)s * max_blocks, (size_t)max_blocks * 4);
                }
        qs2[T2] = T2;
        // The decode batch's q: the batch's roped q rows of those tokens.
        uint16_t *q2h = malloc((size_t)T2 * H * DQ * 2);
        for (int i = 0; i < T2; i++)
            memcpy(q2h + (size_t)i * H * DQ, qb16 + (size_t)src2[i] * H * DQ, (size_t)H * DQ * 2);
        void *q2g = gpu_copy(q2h, (size_t)T2 * H * DQ * 2), *out2g = gpu_be->ops->alloc(gpu_be, (size_t)T2 * H * V * 2);
        void *ws2 = gpu_be->ops->alloc(gpu_be, mla_workspace_bytes(T2, H, L, R));
        struct attn_metadata m2 = {.n_seqs = T2,
                                   .n_tokens = T2,
                                   .max_query_len = 1,
                                   .max_context_len = max_ctx,
                                   .max_blocks_per_seq = max_blocks,
                                   .block_size = bs,
                                   .decode_only = true,
                                   .query_start = gpu_copy(qs2, (size_t)(T2 + 1) * 4),
                                   .context_lens = gpu_copy(ctx2, (size_t)T2 * 4),
                                   .block_tables = gpu_copy(bt2, (size_t)T2 * max_blocks * 4),
                                   .h_query_start = qs2,
                                   .h_context_lens = ctx2,
                                   .h_block_tables = bt2};
        struct tensor tq2 = tensor_make(q2g, DTYPE_BF16, 3, (int64_t[]){T2, H, DQ});
        struct tensor to2 = tensor_make(out2g, DTYPE_BF16, 3, (int64_t[]){T2, H, V});
        gpu_be->ops->mla_attention(gpu_be, &to2, &tq2, &kg, &m2, &ag, ws2);
        uint16_t *o2 = malloc((size_t)T2 * H * V * 2);
        gpu_read(o2, out2g, (size_t)T2 * H * V * 2);
        ASSERT_EQ((long long)(backend_cuda_mla_expanded_seqs(gpu_be) - expanded_before), (long long)n_exp);
        double n2 = 0, d2 = 0, worst = 0;
        for (int i = 0; i < T2; i++)
            for (int e = 0; e < H * V; e++) {
                const double x = bf16_to_f32(o2[(size_t)i * H * V + e]), y = og[(size_t)src2[i] * H * V + e];
                if (!isfinite(y)) n2 = INFINITY;
                n2 += (x - y) * (x - y);
                d2 += x * x;
                worst = fmax(worst, fabs(x - y));
            }
        const double nmse2 = n2 / (d2 > 0 ? d2 : 1);
        // And the same batch with the expansion switched off (mla_args.absorbed_only).
        struct mla_args aa = ag;
        aa.absorbed_only = true;
        gpu_be->ops->mla_attention(gpu_be, &tog, &tqg, &kg, &mg, &aa, ws);
        uint16_t *o3 = malloc((size_t)T * H * V * 2);
        gpu_read(o3, outg, (size_t)T * H * V * 2);
        ASSERT_EQ((long long)(backend_cuda_mla_expanded_seqs(gpu_be) - expanded_before), (long long)n_exp);
        double n3 = 0, d3 = 0;
        for (int64_t i = 0; i < (int64_t)T * H * V; i++) {
            const double x = bf16_to_f32(o3[i]);
            n3 += (x - og[i]) * (x - og[i]);
            d3 += x * x;
        }
        const double nmse3 = n3 / (d3 > 0 ? d3 : 1);
        fprintf(stderr, "  %-34s the batch absorbed_only vs expanded: nmse %.2e (bound %.0e)\n", what, nmse3, bound);
        ASSERT_TRUE(nmse3 <= bound);
        free(o3);
        fprintf(stderr,
                "  %-34s %d expanded sequence(s), %d tokens: vs absorbed decode nmse %.2e (bound %.0e), max |d| %.3g\n",
                what, n_exp, T2, nmse2, bound, worst);
        ASSERT_TRUE(nmse2 <= bound);
        gpu_be->ops->free(gpu_be, (void *)m2.query_start);
        gpu_be->ops->free(gpu_be, (void *)m2.context_lens);
        gpu_be->ops->free(gpu_be, (void *)m2.block_tables);
        gpu_be->ops->free(gpu_be, q2g);
        gpu_be->ops->free(gpu_be, out2g);
        gpu_be->ops->free(gpu_be, ws2);
        free(o2);
        free(q2h);
        free(qs2);
        free(ctx2);
        free(src2);
        free(bt2);
    }
    gpu_be->ops->free(gpu_be, outg);
    gpu_be->ops->free(gpu_be, ws);
    gpu_be->ops->free(gpu_be, cache_g);
    gpu_be->ops->free(gpu_be, qg);
    gpu_be->ops->free(gpu_be, kvag);
    gpu_be->ops->free(gpu_be, normg);
    gpu_be->ops->free(gpu_be, wg.t.data);
    cpu_be->ops->free(cpu_be, wc.t.data);
    free(ob);
    free(oc);
    free(og);
    free(qback);
    free(qb16);
    free(back);
    free(cache_c);
    free(cache_h);
    free(f);
    free(kvb);
    free(normw);
    free(q);
    free(qc);
    free(kva);
    free(qs);
    free(ctx);
    free(bt);
    free(pos);
    free(slot);
    free(perm);
}

static const struct shape V3 = {128, 128, 64, 512, 128}, TINY = {4, 32, 32, 64, 48},
                          MOONLIGHT = {16, 128, 64, 512, 128};

TEST(cuda_mla_decode_split_kv) {
    if (!backends_ready()) SKIP("no CUDA device");
    const int ql[4] = {1, 1, 1, 1}, cached[4] = {0, 17, 130, 299};
    check(&V3, 4, ql, cached, DTYPE_BF16, "V3 decode x4 (split-KV)");
    check(&V3, 4, ql, cached, DTYPE_FP8_E4M3, "V3 decode x4 (split-KV)");
    check(&TINY, 4, ql, cached, DTYPE_BF16, "tiny decode x4");
}

TEST(cuda_mla_prefill_chunks) {
    if (!backends_ready()) SKIP("no CUDA device");
    const int ql[3] = {40, 1, 23}, cached[3] = {0, 64, 33};
    check(&V3, 3, ql, cached, DTYPE_BF16, "V3 mixed prefill / decode");
    check(&TINY, 3, ql, cached, DTYPE_BF16, "tiny mixed prefill / decode");
    const int ql2[1] = {300}, cached2[1] = {20};
    check(&TINY, 1, ql2, cached2, DTYPE_BF16, "tiny prefill over 2 workspace chunks");
}

// The expanded (tensor-core) prefill: chunks of >= 16 new tokens, after cached prefixes (up to
// 1500) and from scratch, beside decode rows, in BF16 and FP8 caches; DeepSeek-V3's 128 heads and
// Moonlight's 16.
TEST(cuda_mla_expanded_prefill_equals_absorbed_decode) {
    if (!backends_ready()) SKIP("no CUDA device");
    const int ql[4] = {100, 1, 40, 17}, cached[4] = {200, 300, 0, 1000};
    check(&MOONLIGHT, 4, ql, cached, DTYPE_BF16, "Moonlight expanded prefill + decode");
    check(&MOONLIGHT, 4, ql, cached, DTYPE_FP8_E4M3, "Moonlight expanded prefill + decode");
    check(&V3, 4, ql, cached, DTYPE_BF16, "V3 expanded prefill + decode");
    const int ql2[2] = {700, 16}, cached2[2] = {1500, 63};
    check(&MOONLIGHT, 2, ql2, cached2, DTYPE_BF16, "Moonlight long prefill after 1500");
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
