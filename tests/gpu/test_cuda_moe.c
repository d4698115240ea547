// The CUDA fused MoE against the CPU backend's MoE ops (themselves checked against naive
// references in tests/test_moe_ops.c); the tiny MoE models against HF on CUDA run with the
// dense ones in tests/gpu/test_cuda_models.c. Runs only where a GPU is (make CUDA=1
// gpu-tests; build-cuda/tests/gpu/test_cuda_moe).
//
// Inputs are rounded to BF16 first and the CPU sees the same values in F32, so differences
// come from the GPU's BF16 intermediates (gate_up, SiLU*mul and down outputs are stored in
// BF16) and summation order: expert outputs within NMSE 1e-4 of the CPU's; routing ids equal
// wherever the k-th/(k+1)-th probability gap is above 1e-5 (fp32 summation-order noise);
// weights within 1e-5. Skewed routing: all tokens to one expert, most experts empty,
// top-k = number of experts; sigmoid / correction-bias / grouped routing with ties and skew;
// decode sizes (GEMV tiles), batched-decode sizes (16-row MMA tiles)
// and prefill sizes (64-row MMA tiles, CUDA-core fallback when K % 32 != 0);
// a CUDA graph of route + experts replayed with new inputs equals eager execution; GPT-OSS's
// experts (clamped SwiGLU, biases, BF16 or MXFP4 weights) equal the CPU op.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/dtype.h"
#include "test.h"

static struct backend *cpu_be, *gpu_be;
static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint64_t rng_next(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_sym(float s) {
    return (float)(((rng_next() >> 40) * (1.0 / 16777216.0)) * 2.0 - 1.0) * s;
}
static int rng_int(int n) {
    return (int)(rng_next() % (uint64_t)n);
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

// Device copy of n floats as BF16 (or F32 when bf16 is false).
static void *to_gpu(const float *x, int64_t n, bool bf16) {
    size_t bytes = (size_t)n * (bf16 ? 2 : 4);
    void *h = malloc(bytes);
    if (bf16)
        dtype_from_f32(DTYPE_BF16, x, h, n);
    else
        memcpy(h, x, bytes);
    void *d = gpu_be->ops->alloc(gpu_be, bytes);
    gpu_be->ops->copy_h2d(gpu_be, d, h, bytes);
    gpu_be->ops->synchronize(gpu_be);
    free(h);
    return d;
}

static void gpu_to_f32(float *dst, const void *src, int64_t n, bool bf16) {
    size_t bytes = (size_t)n * (bf16 ? 2 : 4);
    void *h = malloc(bytes);
    gpu_be->ops->synchronize(gpu_be);
    gpu_be->ops->copy_d2h(gpu_be, h, src, bytes);
    gpu_be->ops->synchronize(gpu_be);
    if (bf16)
        dtype_to_f32(DTYPE_BF16, h, dst, n);
    else
        memcpy(dst, h, bytes);
    free(h);
}

static void check_route(int n, int E, int k, bool renorm, bool uniform) {
    float *lg = malloc(sizeof(float) * (size_t)n * E);
    for (int i = 0; i < n * E; i++)
        lg[i] = rbf(rng_sym(4.0f));
    struct moe_route_args a = {
        .num_experts = E, .top_k = k, .renormalize = renorm, .scale = 1.0f, .force_uniform = uniform};
    int32_t *ci = malloc(sizeof(int32_t) * (size_t)n * k), *gi = malloc(sizeof(int32_t) * (size_t)n * k);
    float *cw = malloc(sizeof(float) * (size_t)n * k), *gw = malloc(sizeof(float) * (size_t)n * k);
    struct tensor ct = tensor_2d(lg, DTYPE_F32, n, E);
    cpu_be->ops->moe_route(cpu_be, &ct, &a, ci, cw);
    void *dl = to_gpu(lg, (int64_t)n * E, true);
    int32_t *di = gpu_be->ops->alloc(gpu_be, sizeof(int32_t) * (size_t)n * k);
    float *dw = gpu_be->ops->alloc(gpu_be, sizeof(float) * (size_t)n * k);
    struct tensor gt = tensor_2d(dl, DTYPE_BF16, n, E);
    gpu_be->ops->moe_route(gpu_be, &gt, &a, di, dw);
    gpu_be->ops->synchronize(gpu_be);
    gpu_be->ops->copy_d2h(gpu_be, gi, di, sizeof(int32_t) * (size_t)n * k);
    gpu_be->ops->copy_d2h(gpu_be, gw, dw, sizeof(float) * (size_t)n * k);
    gpu_be->ops->synchronize(gpu_be);
    int compared = 0;
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < k; j++) {
            int c = t * k + j;
            if (gi[c] != ci[c]) {
                // Only a near-tie (weights equal to fp32 summation noise) may swap experts; the
                // rest of this token's order may then differ too.
                if (!(fabsf(gw[c] - cw[c]) <= 1e-5f))
                    test_fail(__FILE__, __LINE__,
                              "route n=%d E=%d k=%d token %d slot %d: GPU expert %d (w %.7f), CPU %d "
                              "(w %.7f)",
                              n, E, k, t, j, gi[c], gw[c], ci[c], cw[c]);
                break;
            }
            ASSERT_NEAR(gw[c], cw[c], 1e-5);
            compared++;
        }
    }
    ASSERT_TRUE(compared >= n * k / 2);
    gpu_be->ops->free(gpu_be, dl);
    gpu_be->ops->free(gpu_be, di);
    gpu_be->ops->free(gpu_be, dw);
    free(lg);
    free(ci);
    free(gi);
    free(cw);
    free(gw);
}

TEST(cuda_moe_route_matches_cpu) {
    if (!backends_ready()) return;
    check_route(1, 128, 8, true, false); // Qwen3-30B-A3B decode
    check_route(37, 128, 8, true, false);
    check_route(300, 8, 2, true, false); // Mixtral-like
    check_route(64, 8, 2, false, false); // norm_topk_prob = false
    check_route(9, 4, 4, true, false);   // top-k = E
    check_route(65, 128, 8, true, true); // benchmark round-robin
}

// Sigmoid / correction-bias / grouped routing (DeepSeek-V3, GLM-4-MoE; softmax groups by max for
// DeepSeek-V2) against the CPU op. draw 0: random logits; 1: exact ties (logits from {0, 0.5, ..,
// 2}, one bias for all: the lower id must win on both backends); 2: skewed (one hot expert per
// token on average). A differing id is allowed only where the two experts' keys are within 1e-5
// (fp32 sigmoid / softmax rounding of a near-tie); the rest of that token is then skipped.
static void check_route_grouped(int n, struct moe_route_args a, bool with_bias, int draw) {
    const int E = a.num_experts, slots = a.top_k + a.n_shared;
    float *lg = malloc(sizeof(float) * (size_t)n * E), bias[1024];
    for (int i = 0; i < n * E; i++)
        lg[i] = rbf(draw == 1   ? 0.5f * (float)rng_int(5)
                    : draw == 2 ? (rng_int(E) == 0 ? 4.0f : -4.0f) + rng_sym(1.0f)
                                : rng_sym(3.0f));
    for (int e = 0; e < E; e++)
        bias[e] = draw == 1 ? 0.25f : rng_sym(0.2f);
    void *dbias = NULL;
    if (with_bias) {
        dbias = to_gpu(bias, E, false);
        a.correction_bias = bias;
    }
    int32_t *ci = malloc(sizeof(int32_t) * (size_t)n * slots), *gi = malloc(sizeof(int32_t) * (size_t)n * slots);
    float *cw = malloc(sizeof(float) * (size_t)n * slots), *gw = malloc(sizeof(float) * (size_t)n * slots);
    struct tensor ct = tensor_2d(lg, DTYPE_F32, n, E);
    cpu_be->ops->moe_route(cpu_be, &ct, &a, ci, cw);
    a.correction_bias = dbias;
    void *dl = to_gpu(lg, (int64_t)n * E, false); // F32 router logits, as the models give them
    int32_t *di = gpu_be->ops->alloc(gpu_be, sizeof(int32_t) * (size_t)n * slots);
    float *dw = gpu_be->ops->alloc(gpu_be, sizeof(float) * (size_t)n * slots);
    struct tensor gt = tensor_2d(dl, DTYPE_F32, n, E);
    gpu_be->ops->moe_route(gpu_be, &gt, &a, di, dw);
    gpu_be->ops->synchronize(gpu_be);
    gpu_be->ops->copy_d2h(gpu_be, gi, di, sizeof(int32_t) * (size_t)n * slots);
    gpu_be->ops->copy_d2h(gpu_be, gw, dw, sizeof(float) * (size_t)n * slots);
    gpu_be->ops->synchronize(gpu_be);
    int compared = 0;
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < slots; j++) {
            int c = t * slots + j;
            if (gi[c] != ci[c]) {
                double kq[2];
                for (int i = 0; i < 2; i++) {
                    int e = i ? gi[c] : ci[c];
                    float x = lg[(size_t)t * E + (e >= 0 && e < E ? e : 0)];
                    kq[i] = (a.scoring == MOE_SCORING_SIGMOID ? 1.0 / (1.0 + exp(-(double)x)) : (double)x) +
                            (with_bias ? bias[e >= 0 && e < E ? e : 0] : 0.0);
                }
                if (!(fabs(kq[0] - kq[1]) <= 1e-5))
                    test_fail(__FILE__, __LINE__,
                              "grouped route E=%d k=%d g%d/%d draw %d token %d slot %d: GPU %d, "
                              "CPU %d",
                              E, a.top_k, a.n_group, a.topk_group, draw, t, j, gi[c], ci[c]);
                break;
            }
            if (!(fabsf(gw[c] - cw[c]) <= 1e-5f * (1.0f + fabsf(cw[c]))))
                test_fail(__FILE__, __LINE__, "grouped route token %d slot %d: GPU w %.7f, CPU %.7f", t, j, gw[c],
                          cw[c]);
            compared++;
        }
    }
    ASSERT_TRUE(compared >= n * slots * 9 / 10);
    gpu_be->ops->free(gpu_be, dl);
    gpu_be->ops->free(gpu_be, di);
    gpu_be->ops->free(gpu_be, dw);
    if (dbias) gpu_be->ops->free(gpu_be, dbias);
    free(lg);
    free(ci);
    free(gi);
    free(cw);
    free(gw);
}

TEST(cuda_moe_route_sigmoid_grouped_matches_cpu) {
    if (!backends_ready()) return;
    for (int draw = 0; draw < 3; draw++) {
        struct moe_route_args a = {.num_experts = 256,
                                   .top_k = 8,
                                   .scoring = MOE_SCORING_SIGMOID,
                                   .renormalize = true,
                                   .scale = 2.5f,
                                   .n_group = 8,
                                   .topk_group = 4,
                                   .group_score = MOE_GROUP_SCORE_TOP2_SUM};
        check_route_grouped(1, a, true, draw); // DeepSeek-V3 decode
        check_route_grouped(300, a, true, draw);
        a.num_experts = 160; // GLM-4.5: one group, one shared expert
        a.n_group = a.topk_group = 1;
        a.n_shared = 1;
        a.shared_weight = 1.0f;
        check_route_grouped(77, a, true, draw);
        a = (struct moe_route_args){.num_experts = 8,
                                    .top_k = 3,
                                    .scoring = MOE_SCORING_SIGMOID,
                                    .renormalize = true,
                                    .scale = 1.0f,
                                    .n_group = 4,
                                    .topk_group = 2,
                                    .group_score = MOE_GROUP_SCORE_TOP2_SUM};
        check_route_grouped(64, a, true, draw); // groups of 2 < top_k
        a.top_k = 4;                            // top_k = kept experts
        a.renormalize = false;
        check_route_grouped(64, a, true, draw);
        a = (struct moe_route_args){.num_experts = 1024,
                                    .top_k = 8,
                                    .scoring = MOE_SCORING_SIGMOID,
                                    .renormalize = true,
                                    .scale = 1.0f,
                                    .n_group = 64,
                                    .topk_group = 8,
                                    .group_score = MOE_GROUP_SCORE_TOP2_SUM};
        check_route_grouped(20, a, true, draw); // the shared-memory limit: 1024 experts, 64 groups
        a = (struct moe_route_args){.num_experts = 160,
                                    .top_k = 6,
                                    .scoring = MOE_SCORING_SOFTMAX,
                                    .scale = 16.0f,
                                    .n_group = 8,
                                    .topk_group = 3,
                                    .group_score = MOE_GROUP_SCORE_MAX,
                                    .n_shared = 2,
                                    .shared_weight = 1.0f};
        check_route_grouped(50, a, false, draw); // DeepSeek-V2 group_limited_greedy
    }
}

enum routing { ROUTE_RANDOM, ROUTE_ONE_EXPERT, ROUTE_TWO_EXPERTS, ROUTE_ALL };

static void make_routing(int32_t *ids, float *w, int n, int E, int slots, enum routing rt) {
    for (int t = 0; t < n; t++)
        for (int j = 0; j < slots; j++) {
            int e = rt == ROUTE_ONE_EXPERT    ? E - 1
                    : rt == ROUTE_TWO_EXPERTS ? ((j % 2) ? 1 : E - 2)
                    : rt == ROUTE_ALL         ? j
                                              : rng_int(E);
            ids[t * slots + j] = e;
            w[t * slots + j] = 0.1f + (float)(rng_next() % 1000) / 1000.0f;
        }
}

static void check_experts(int n, int E, int slots, int H, int I, enum routing rt, bool graph) {
    int64_t ngu = (int64_t)E * 2 * I * H, ndn = (int64_t)E * H * I;
    float *x = malloc(sizeof(float) * (size_t)n * H), *gu = malloc(sizeof(float) * (size_t)ngu);
    float *dn = malloc(sizeof(float) * (size_t)ndn);
    for (int64_t i = 0; i < (int64_t)n * H; i++)
        x[i] = rbf(rng_sym(1.0f));
    for (int64_t i = 0; i < ngu; i++)
        gu[i] = rbf(rng_sym(1.0f / sqrtf((float)H)));
    for (int64_t i = 0; i < ndn; i++)
        dn[i] = rbf(rng_sym(1.0f / sqrtf((float)I)));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * slots);
    float *w = malloc(sizeof(float) * (size_t)n * slots);
    make_routing(ids, w, n, E, slots, rt);

    // CPU reference op.
    float *cout = malloc(sizeof(float) * (size_t)n * H);
    void *cws = cpu_be->ops->alloc(cpu_be, moe_workspace_bytes(n, slots, E, H, I, 4));
    struct tensor cgu = tensor_make(gu, DTYPE_F32, 3, (int64_t[]){E, 2 * I, H});
    struct tensor cdn = tensor_make(dn, DTYPE_F32, 3, (int64_t[]){E, H, I});
    struct tensor cx = tensor_2d(x, DTYPE_F32, n, H), co = tensor_2d(cout, DTYPE_F32, n, H);
    cpu_be->ops->moe_experts(cpu_be, &co, &cx, WEIGHT_PLAIN(&cgu), WEIGHT_PLAIN(&cdn), ids, w, slots, NULL, cws);

    // GPU.
    void *dx = to_gpu(x, (int64_t)n * H, true), *dgu = to_gpu(gu, ngu, true), *ddn = to_gpu(dn, ndn, true);
    int32_t *dids = gpu_be->ops->alloc(gpu_be, sizeof(int32_t) * (size_t)n * slots);
    float *dw = gpu_be->ops->alloc(gpu_be, sizeof(float) * (size_t)n * slots);
    gpu_be->ops->copy_h2d(gpu_be, dids, ids, sizeof(int32_t) * (size_t)n * slots);
    gpu_be->ops->copy_h2d(gpu_be, dw, w, sizeof(float) * (size_t)n * slots);
    size_t out_bytes = (size_t)n * H * 2;
    unsigned char *dout = gpu_be->ops->alloc(gpu_be, out_bytes + 256);
    unsigned char guard[256];
    memset(guard, 0xA5, sizeof guard);
    gpu_be->ops->copy_h2d(gpu_be, dout + out_bytes, guard, sizeof guard);
    void *gws = gpu_be->ops->alloc(gpu_be, moe_workspace_bytes(n, slots, E, H, I, 2));
    struct tensor ggu = tensor_make(dgu, DTYPE_BF16, 3, (int64_t[]){E, 2 * I, H});
    struct tensor gdn = tensor_make(ddn, DTYPE_BF16, 3, (int64_t[]){E, H, I});
    struct tensor gx = tensor_2d(dx, DTYPE_BF16, n, H), go = tensor_2d(dout, DTYPE_BF16, n, H);
    struct error err = {0};
    if (graph) {
        // Capture with these inputs' buffers, then replay with new routing written in place.
        void *g = NULL;
        ASSERT_OK(gpu_be->ops->graph_begin(gpu_be, &err));
        gpu_be->ops->moe_experts(gpu_be, &go, &gx, WEIGHT_PLAIN(&ggu), WEIGHT_PLAIN(&gdn), dids, dw, slots, NULL, gws);
        ASSERT_OK(gpu_be->ops->graph_end(gpu_be, &g, &err));
        make_routing(ids, w, n, E, slots, rt);
        cpu_be->ops->moe_experts(cpu_be, &co, &cx, WEIGHT_PLAIN(&cgu), WEIGHT_PLAIN(&cdn), ids, w, slots, NULL, cws);
        gpu_be->ops->copy_h2d(gpu_be, dids, ids, sizeof(int32_t) * (size_t)n * slots);
        gpu_be->ops->copy_h2d(gpu_be, dw, w, sizeof(float) * (size_t)n * slots);
        ASSERT_OK(gpu_be->ops->graph_launch(gpu_be, g, &err));
        gpu_be->ops->synchronize(gpu_be);
        gpu_be->ops->graph_destroy(gpu_be, g);
    } else {
        gpu_be->ops->moe_experts(gpu_be, &go, &gx, WEIGHT_PLAIN(&ggu), WEIGHT_PLAIN(&gdn), dids, dw, slots, NULL, gws);
    }
    float *gout = malloc(sizeof(float) * (size_t)n * H);
    gpu_to_f32(gout, dout, (int64_t)n * H, true);
    unsigned char back[256];
    gpu_be->ops->copy_d2h(gpu_be, back, dout + out_bytes, sizeof back);
    gpu_be->ops->synchronize(gpu_be);
    ASSERT_TRUE(memcmp(back, guard, sizeof guard) == 0);
    double num = 0, den = 0;
    for (int64_t i = 0; i < (int64_t)n * H; i++) {
        ASSERT_TRUE(isfinite(gout[i]));
        num += (gout[i] - cout[i]) * (double)(gout[i] - cout[i]);
        den += (double)cout[i] * cout[i];
    }
    double e2 = num / (den > 0 ? den : 1);
    fprintf(stderr, "  n=%d E=%d slots=%d H=%d I=%d routing %d%s: nmse %.2e\n", n, E, slots, H, I, (int)rt,
            graph ? " (graph)" : "", e2);
    ASSERT_TRUE(e2 < 1e-4);
    void *ptrs[] = {dx, dgu, ddn, dids, dw, dout, gws};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        gpu_be->ops->free(gpu_be, ptrs[i]);
    cpu_be->ops->free(cpu_be, cws);
    free(x);
    free(gu);
    free(dn);
    free(ids);
    free(w);
    free(cout);
    free(gout);
}

TEST(cuda_moe_experts_match_cpu) {
    if (!backends_ready()) return;
    check_experts(1, 128, 8, 256, 96, ROUTE_RANDOM, false);   // batch-1 decode, Qwen3-MoE-like routing width
    check_experts(13, 16, 4, 201, 72, ROUTE_RANDOM, false);   // odd sizes: tile edges, scalar-load path (K = 201)
    check_experts(300, 8, 2, 256, 128, ROUTE_RANDOM, false);  // prefill: 600 rows, 64-row tiles (tensor cores)
    check_experts(300, 8, 2, 200, 72, ROUTE_RANDOM, false);   // prefill, K % 32 != 0: CUDA-core fallback
    check_experts(1, 128, 8, 2048, 768, ROUTE_RANDOM, false); // Qwen3-30B-A3B layer shape, decode
    // Past the GEMV range (R > 128): mma.sync tiles of 16 rows (few rows per expert), 64 and 128 rows.
    check_experts(64, 128, 8, 256, 96, ROUTE_RANDOM, false);    // R 512, ~4 rows/expert: 16-row MMA tiles
    check_experts(160, 32, 4, 256, 80, ROUTE_RANDOM, false);    // N 160 (partial column block); down K 80: CUDA-core
    check_experts(256, 128, 8, 2048, 768, ROUTE_RANDOM, false); // Qwen3-30B-A3B shape, batch-256 decode
    check_experts(600, 128, 8, 512, 256, ROUTE_RANDOM, false);  // R 4800, ~37 rows/expert: 64-row MMA tiles
    check_experts(1000, 64, 4, 256, 128, ROUTE_RANDOM, false);  // R 4000, ~62 rows/expert: 64-row MMA tiles
    check_experts(1200, 16, 2, 256, 136, ROUTE_RANDOM, false);  // R 2400, ~150 rows/expert: 128-row MMA tiles
    // The slot-major path (R <= 32: no sort, SiLU*mul in the gate_up epilogue, combine in down).
    check_experts(4, 128, 8, 2048, 768, ROUTE_RANDOM, false); // Qwen3-30B-A3B shape, batch 4 (R 32)
    check_experts(3, 8, 2, 4096, 1024, ROUTE_RANDOM, false);  // Mixtral-like top-2, K 4096
    check_experts(2, 16, 5, 136, 40, ROUTE_RANDOM, false);    // 5 slots (8-slot kernel, 3 idle), K % 256 != 0
    check_experts(1, 8, 12, 64, 24, ROUTE_RANDOM, false);     // 12 slots: the 16-slot kernel
    check_experts(3, 16, 4, 201, 72, ROUTE_RANDOM, false);    // R 12 off the slot path (H % 8 != 0): GEMV + silu_mul
}

TEST(cuda_moe_experts_skewed_routing) {
    if (!backends_ready()) return;
    check_experts(100, 8, 2, 128, 64, ROUTE_ONE_EXPERT, false); // every token to one expert (several tiles)
    check_experts(300, 8, 2, 128, 64, ROUTE_ONE_EXPERT, false);
    check_experts(500, 4, 2, 128, 64, ROUTE_ONE_EXPERT, false);  // 128-row tiles, all 1000 rows in one expert
    check_experts(33, 16, 2, 128, 64, ROUTE_TWO_EXPERTS, false); // 14 of 16 experts empty
    check_experts(21, 4, 4, 128, 64, ROUTE_ALL, false);          // top-k = number of experts
    check_experts(4, 8, 2, 128, 64, ROUTE_ONE_EXPERT, false);    // slot path: one expert for every slot
    check_experts(2, 4, 4, 128, 64, ROUTE_ALL, false);           // slot path: top-k = number of experts
}

// GPT-OSS experts (moe_experts with struct moe_experts_args): the clamped SwiGLU (alpha 1.702;
// limit 1.0 so the clamps bite on these weights) with gate_up / down biases, the experts either
// BF16 or MXFP4 (random bytes and exponents 118..122, decoded by the GPU in registers), against
// the CPU op on the same values (the CPU dequantizes MX per tile). NMSE bound as above.
static void check_experts_gpt_oss(int n, int E, int slots, int H, int I, enum routing rt, bool mx) {
    const int64_t ngu = (int64_t)E * 2 * I * H, ndn = (int64_t)E * H * I;
    float *x = malloc(sizeof(float) * (size_t)n * H), *gu = malloc(sizeof(float) * (size_t)ngu);
    float *dn = malloc(sizeof(float) * (size_t)ndn), *bg = malloc(sizeof(float) * (size_t)E * 2 * I);
    float *bd = malloc(sizeof(float) * (size_t)E * H);
    uint8_t *qgu = malloc((size_t)ngu / 2), *qdn = malloc((size_t)ndn / 2);
    uint8_t *sgu = malloc((size_t)ngu / 32), *sdn = malloc((size_t)ndn / 32);
    for (int64_t i = 0; i < (int64_t)n * H; i++)
        x[i] = rbf(rng_sym(2.0f));
    for (int64_t i = 0; i < ngu; i++)
        gu[i] = rbf(rng_sym(3.0f / sqrtf((float)H)));
    for (int64_t i = 0; i < ndn; i++)
        dn[i] = rbf(rng_sym(1.0f / sqrtf((float)I)));
    for (int64_t i = 0; i < (int64_t)E * 2 * I; i++)
        bg[i] = rbf(rng_sym(0.5f));
    for (int64_t i = 0; i < (int64_t)E * H; i++)
        bd[i] = rbf(rng_sym(0.5f));
    for (int64_t i = 0; i < ngu / 2; i++)
        qgu[i] = (uint8_t)rng_next();
    for (int64_t i = 0; i < ndn / 2; i++)
        qdn[i] = (uint8_t)rng_next();
    for (int64_t i = 0; i < ngu / 32; i++)
        sgu[i] = (uint8_t)(118 + rng_int(5));
    for (int64_t i = 0; i < ndn / 32; i++)
        sdn[i] = (uint8_t)(118 + rng_int(5));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * slots);
    float *w = malloc(sizeof(float) * (size_t)n * slots);
    make_routing(ids, w, n, E, slots, rt);

    struct weight cgu, cdn, ggu, gdn;
    if (mx) {
        cgu = (struct weight){.t = tensor_make(qgu, DTYPE_U8, 3, (int64_t[]){E, 2 * I, H / 2}),
                              .scheme = WEIGHT_SCHEME_MX,
                              .scale = tensor_make(sgu, DTYPE_U8, 3, (int64_t[]){E, 2 * I, H / 32}),
                              .block_rows = 1,
                              .block_cols = 32};
        cdn = (struct weight){.t = tensor_make(qdn, DTYPE_U8, 3, (int64_t[]){E, H, I / 2}),
                              .scheme = WEIGHT_SCHEME_MX,
                              .scale = tensor_make(sdn, DTYPE_U8, 3, (int64_t[]){E, H, I / 32}),
                              .block_rows = 1,
                              .block_cols = 32};
        ggu = cgu;
        gdn = cdn;
        void *p[4] = {gpu_be->ops->alloc(gpu_be, (size_t)ngu / 2), gpu_be->ops->alloc(gpu_be, (size_t)ngu / 32),
                      gpu_be->ops->alloc(gpu_be, (size_t)ndn / 2), gpu_be->ops->alloc(gpu_be, (size_t)ndn / 32)};
        gpu_be->ops->copy_h2d(gpu_be, p[0], qgu, (size_t)ngu / 2);
        gpu_be->ops->copy_h2d(gpu_be, p[1], sgu, (size_t)ngu / 32);
        gpu_be->ops->copy_h2d(gpu_be, p[2], qdn, (size_t)ndn / 2);
        gpu_be->ops->copy_h2d(gpu_be, p[3], sdn, (size_t)ndn / 32);
        ggu.t.data = p[0];
        ggu.scale.data = p[1];
        gdn.t.data = p[2];
        gdn.scale.data = p[3];
    } else {
        cgu = (struct weight){.t = tensor_make(gu, DTYPE_F32, 3, (int64_t[]){E, 2 * I, H})};
        cdn = (struct weight){.t = tensor_make(dn, DTYPE_F32, 3, (int64_t[]){E, H, I})};
        ggu = (struct weight){.t = tensor_make(to_gpu(gu, ngu, true), DTYPE_BF16, 3, (int64_t[]){E, 2 * I, H})};
        gdn = (struct weight){.t = tensor_make(to_gpu(dn, ndn, true), DTYPE_BF16, 3, (int64_t[]){E, H, I})};
    }
    struct tensor cbg = tensor_2d(bg, DTYPE_F32, E, 2 * I), cbd = tensor_2d(bd, DTYPE_F32, E, H);
    struct tensor gbg = tensor_2d(to_gpu(bg, (int64_t)E * 2 * I, true), DTYPE_BF16, E, 2 * I);
    struct tensor gbd = tensor_2d(to_gpu(bd, (int64_t)E * H, true), DTYPE_BF16, E, H);
    const struct moe_experts_args cea = {MOE_ACT_SWIGLU_CLAMP, 1.702f, 1.0f, &cbg, &cbd};
    const struct moe_experts_args gea = {MOE_ACT_SWIGLU_CLAMP, 1.702f, 1.0f, &gbg, &gbd};

    float *cout = malloc(sizeof(float) * (size_t)n * H);
    void *cws = cpu_be->ops->alloc(cpu_be, moe_workspace_bytes(n, slots, E, H, I, 4));
    struct tensor cx = tensor_2d(x, DTYPE_F32, n, H), co = tensor_2d(cout, DTYPE_F32, n, H);
    cpu_be->ops->moe_experts(cpu_be, &co, &cx, &cgu, &cdn, ids, w, slots, &cea, cws);

    void *dx = to_gpu(x, (int64_t)n * H, true);
    int32_t *dids = gpu_be->ops->alloc(gpu_be, sizeof(int32_t) * (size_t)n * slots);
    float *dw = gpu_be->ops->alloc(gpu_be, sizeof(float) * (size_t)n * slots);
    gpu_be->ops->copy_h2d(gpu_be, dids, ids, sizeof(int32_t) * (size_t)n * slots);
    gpu_be->ops->copy_h2d(gpu_be, dw, w, sizeof(float) * (size_t)n * slots);
    void *dout = gpu_be->ops->alloc(gpu_be, (size_t)n * H * 2);
    void *gws = gpu_be->ops->alloc(gpu_be, moe_workspace_bytes(n, slots, E, H, I, 2));
    struct tensor gx = tensor_2d(dx, DTYPE_BF16, n, H), go = tensor_2d(dout, DTYPE_BF16, n, H);
    gpu_be->ops->moe_experts(gpu_be, &go, &gx, &ggu, &gdn, dids, dw, slots, &gea, gws);
    float *gout = malloc(sizeof(float) * (size_t)n * H);
    gpu_to_f32(gout, dout, (int64_t)n * H, true);
    double num = 0, den = 0;
    for (int64_t i = 0; i < (int64_t)n * H; i++) {
        ASSERT_TRUE(isfinite(gout[i]));
        num += (gout[i] - cout[i]) * (double)(gout[i] - cout[i]);
        den += (double)cout[i] * cout[i];
    }
    double e2 = num / (den > 0 ? den : 1);
    fprintf(stderr, "  gpt-oss experts %s n=%d E=%d slots=%d H=%d I=%d routing %d: nmse %.2e\n", mx ? "mxfp4" : "bf16",
            n, E, slots, H, I, (int)rt, e2);
    ASSERT_TRUE(e2 < 1e-4);
    void *ptrs[] = {dx, dids, dw, dout, gws, ggu.t.data, gdn.t.data, gbg.data, gbd.data,
                    mx ? ggu.scale.data : NULL, mx ? gdn.scale.data : NULL};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (ptrs[i]) gpu_be->ops->free(gpu_be, ptrs[i]);
    cpu_be->ops->free(cpu_be, cws);
    free(x);
    free(gu);
    free(dn);
    free(bg);
    free(bd);
    free(qgu);
    free(qdn);
    free(sgu);
    free(sdn);
    free(ids);
    free(w);
    free(cout);
    free(gout);
}

TEST(cuda_moe_experts_gpt_oss_match_cpu) {
    if (!backends_ready()) return;
    for (int mx = 0; mx < 2; mx++) {
        check_experts_gpt_oss(1, 32, 4, 2880, 2880, ROUTE_RANDOM, mx);   // gpt-oss-20b layer shape, decode
        check_experts_gpt_oss(7, 16, 4, 256, 96, ROUTE_RANDOM, mx);      // decode batch: 4-row tiles
        check_experts_gpt_oss(64, 32, 4, 512, 256, ROUTE_RANDOM, mx);    // R 256: 16-row tiles
        check_experts_gpt_oss(300, 8, 4, 256, 128, ROUTE_RANDOM, mx);    // prefill: 64 / 128-row tiles
        check_experts_gpt_oss(100, 8, 2, 128, 64, ROUTE_ONE_EXPERT, mx); // skewed: one expert takes everything
        check_experts_gpt_oss(33, 16, 2, 128, 64, ROUTE_TWO_EXPERTS, mx); // 14 of 16 experts empty
        check_experts_gpt_oss(5, 4, 4, 64, 32, ROUTE_ALL, mx);           // top-k = number of experts
    }
}

TEST(cuda_moe_experts_graph_replay) {
    if (!backends_ready()) return;
    check_experts(8, 128, 8, 256, 96, ROUTE_RANDOM, true); // decode batch of 8, new routing at replay
    check_experts(4, 8, 2, 128, 64, ROUTE_ONE_EXPERT, true);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
