// The CPU backend's MoE ops (moe_route, moe_experts) against naive references written here
// (plain loops, double accumulation): the specification the CUDA fused MoE is held to through
// the CPU ops (tests/gpu/test_cuda_moe.c). Routing is checked exactly (ids) and to fp32
// rounding (weights), including exact ties, renormalisation on/off, top-k = E, shared-expert
// slots and the benchmark-only round-robin mode. The fused experts are checked with random
// and skewed routing: every token to one expert, most experts empty, top-k = number of
// experts, one token, decode-sized and prefill-sized batches, F32 and BF16 weights; guard
// bytes after the output must stay untouched.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "common/check.h"
#include "test.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_sym(void) {
    return (float)((rng_u64() >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}
static int rng_int(int n) {
    return (int)(rng_u64() % (uint64_t)n);
}

static struct backend *cpu(void) {
    struct backend_options o = {.num_threads = 2};
    struct backend *b = NULL;
    struct error err = {0};
    if (backend_cpu_create(&o, &b, &err) != ATOMC_OK) return NULL;
    return b;
}

// ---------------------------------------------------------------------------------------------
// Routing

// Reference: softmax in double, the top k by (prob desc, id asc), renormalised in double.
static void ref_route(const float *logits, int E, const struct moe_route_args *a, int32_t *ids, double *w) {
    double mx = -INFINITY, sum = 0, p[1024];
    for (int e = 0; e < E; e++)
        mx = logits[e] > mx ? logits[e] : mx;
    for (int e = 0; e < E; e++)
        sum += p[e] = exp((double)logits[e] - mx);
    for (int e = 0; e < E; e++)
        p[e] /= sum;
    bool used[1024] = {0};
    double s = 0;
    for (int j = 0; j < a->top_k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!used[e] && (best < 0 || p[e] > p[best])) best = e; // strict >: the first (lowest) id wins ties
        used[best] = true;
        ids[j] = best;
        w[j] = p[best];
        s += p[best];
    }
    for (int j = 0; j < a->top_k; j++)
        w[j] = (a->renormalize ? w[j] / s : w[j]) * a->scale;
    for (int j = 0; j < a->n_shared; j++) {
        ids[a->top_k + j] = E + j;
        w[a->top_k + j] = a->shared_weight;
    }
}

static void check_route(struct backend *b, int n, int E, struct moe_route_args a, bool ties) {
    a.num_experts = E;
    int slots = a.top_k + a.n_shared;
    float *logits = malloc(sizeof(float) * (size_t)n * E);
    for (int i = 0; i < n * E; i++)
        logits[i] = ties ? (float)rng_int(3) : 3.0f * rng_sym();
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * slots), *rid = malloc(sizeof(int32_t) * (size_t)slots);
    float *w = malloc(sizeof(float) * (size_t)n * slots);
    double *rw = malloc(sizeof(double) * (size_t)slots);
    struct tensor lt = tensor_2d(logits, DTYPE_F32, n, E);
    b->ops->moe_route(b, &lt, &a, ids, w);
    for (int t = 0; t < n; t++) {
        ref_route(logits + (size_t)t * E, E, &a, rid, rw);
        for (int j = 0; j < slots; j++) {
            if (ids[t * slots + j] != rid[j])
                test_fail(__FILE__, __LINE__, "route n=%d E=%d k=%d token %d slot %d: expert %d, reference %d", n, E,
                          a.top_k, t, j, ids[t * slots + j], rid[j]);
            if (!(fabs(w[t * slots + j] - rw[j]) <= 1e-6 * (1 + fabs(rw[j]))))
                test_fail(__FILE__, __LINE__, "route token %d slot %d: weight %.9g, reference %.9g", t, j,
                          w[t * slots + j], rw[j]);
        }
    }
    free(logits);
    free(ids);
    free(rid);
    free(w);
    free(rw);
}

TEST(moe_route_matches_reference) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    struct moe_route_args a = {.top_k = 2, .renormalize = true, .scale = 1.0f};
    check_route(b, 7, 8, a, false); // Qwen3-MoE-like, tiny
    a.top_k = 8;
    check_route(b, 300, 128, a, false); // Qwen3-30B-A3B's 128 experts top-8, threaded rows
    a.renormalize = false;
    check_route(b, 33, 128, a, false); // norm_topk_prob = false
    a.top_k = 4;
    check_route(b, 5, 4, a, false); // top-k = number of experts
    a.renormalize = true;
    a.top_k = 3;
    check_route(b, 64, 6, a, true); // exact ties: the lower expert id first
    a.top_k = 2;
    a.scale = 2.5f;
    a.n_shared = 2;
    a.shared_weight = 1.0f;
    check_route(b, 9, 8, a, false); // routed scaling + shared-expert slots (DeepSeek hooks)
    backend_destroy(b);
}

TEST(moe_route_exact_tie_order) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    float logits[6] = {0.1f, 0.3f, 0.3f, 0.3f, 0.2f, 0.3f};
    int32_t ids[3];
    float w[3];
    struct moe_route_args a = {.num_experts = 6, .top_k = 3, .renormalize = true, .scale = 1.0f};
    struct tensor lt = tensor_2d(logits, DTYPE_F32, 1, 6);
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 1);
    ASSERT_EQ(ids[1], 2);
    ASSERT_EQ(ids[2], 3);
    ASSERT_NEAR(w[0], 1.0 / 3, 1e-6);
    ASSERT_NEAR(w[0] + w[1] + w[2], 1.0, 1e-6);
    backend_destroy(b);
}

TEST(moe_route_force_uniform_is_balanced) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    const int n = 64, E = 128, k = 8;
    float *logits = calloc((size_t)n * E, sizeof(float));
    logits[5] = 100.0f; // a router that would pick expert 5: ignored
    int32_t *ids = malloc(sizeof(int32_t) * n * k);
    float *w = malloc(sizeof(float) * n * k);
    struct moe_route_args a = {.num_experts = E, .top_k = k, .renormalize = true, .scale = 1.0f, .force_uniform = true};
    struct tensor lt = tensor_2d(logits, DTYPE_F32, n, E);
    b->ops->moe_route(b, &lt, &a, ids, w);
    int count[128] = {0};
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            ASSERT_EQ(ids[t * k + j], (t * k + j) % E);
            ASSERT_NEAR(w[t * k + j], 1.0 / k, 1e-7);
            count[ids[t * k + j]]++;
        }
    for (int e = 0; e < E; e++)
        ASSERT_EQ(count[e], n * k / E);
    free(logits);
    free(ids);
    free(w);
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// Fused experts

static double silu(double g) {
    return g / (1.0 + exp(-g));
}

// out[t] = sum_j w[t,j] * down_e(silu(gate_e x) * up_e x), e = ids[t,j]; weights as F32.
static void ref_experts(double *out, const float *x, const float *gu, const float *dn, const int32_t *ids,
                        const float *w, int n, int slots, int H, int I) {
    double *a = malloc(sizeof(double) * (size_t)I);
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < H; h++)
            out[(size_t)t * H + h] = 0;
        for (int j = 0; j < slots; j++) {
            int e = ids[t * slots + j];
            const float *G = gu + (size_t)e * 2 * I * H, *D = dn + (size_t)e * H * I;
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int h = 0; h < H; h++) {
                    g += (double)G[(size_t)i * H + h] * x[(size_t)t * H + h];
                    u += (double)G[(size_t)(I + i) * H + h] * x[(size_t)t * H + h];
                }
                a[i] = silu(g) * u;
            }
            for (int h = 0; h < H; h++) {
                double s = 0;
                for (int i = 0; i < I; i++)
                    s += (double)D[(size_t)h * I + i] * a[i];
                out[(size_t)t * H + h] += w[t * slots + j] * s;
            }
        }
    }
    free(a);
}

enum routing { ROUTE_RANDOM, ROUTE_ONE_EXPERT, ROUTE_TWO_EXPERTS, ROUTE_ALL };

// Runs moe_experts on n tokens, E experts, `slots` per token, weights stored as wdt.
static void check_experts(struct backend *b, int n, int E, int slots, int H, int I, enum routing rt, enum dtype wdt) {
    float *x = malloc(sizeof(float) * (size_t)n * H);
    float *gu = malloc(sizeof(float) * (size_t)E * 2 * I * H), *dn = malloc(sizeof(float) * (size_t)E * H * I);
    for (int i = 0; i < n * H; i++)
        x[i] = rng_sym();
    for (size_t i = 0; i < (size_t)E * 2 * I * H; i++)
        gu[i] = rng_sym() / sqrtf((float)H);
    for (size_t i = 0; i < (size_t)E * H * I; i++)
        dn[i] = rng_sym() / sqrtf((float)I);
    if (wdt == DTYPE_BF16) { // the reference sees the rounded weights
        for (size_t i = 0; i < (size_t)E * 2 * I * H; i++)
            gu[i] = bf16_to_f32(f32_to_bf16(gu[i]));
        for (size_t i = 0; i < (size_t)E * H * I; i++)
            dn[i] = bf16_to_f32(f32_to_bf16(dn[i]));
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * slots);
    float *w = malloc(sizeof(float) * (size_t)n * slots);
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < slots; j++) {
            int e;
            switch (rt) {
            case ROUTE_ONE_EXPERT:
                e = E - 1;
                break; // every slot of every token: one expert
            case ROUTE_TWO_EXPERTS:
                e = (j % 2) ? 1 : E - 2;
                break; // all other experts empty
            case ROUTE_ALL:
                e = j;
                break; // top-k = E: every expert, every token
            default:
                e = rng_int(E);
                break;
            }
            ids[t * slots + j] = e;
            w[t * slots + j] = 0.1f + (float)(rng_u64() % 1000) / 1000.0f;
        }
    }
    struct tensor hgu = tensor_make(gu, DTYPE_F32, 3, (int64_t[]){E, 2 * I, H});
    struct tensor hdn = tensor_make(dn, DTYPE_F32, 3, (int64_t[]){E, H, I});
    struct tensor tgu = tensor_make(NULL, wdt, 3, hgu.ne), tdn = tensor_make(NULL, wdt, 3, hdn.ne);
    struct error err = {0};
    ASSERT_OK(b->ops->upload_weight(b, &tgu, &hgu, &err));
    ASSERT_OK(b->ops->upload_weight(b, &tdn, &hdn, &err));
    size_t ws_bytes = moe_workspace_bytes(n, slots, E, H, I, sizeof(float));
    void *ws = b->ops->alloc(b, ws_bytes);
    size_t out_bytes = sizeof(float) * (size_t)n * H;
    unsigned char *out = malloc(out_bytes + 64);
    memset(out + out_bytes, 0xA5, 64);
    struct tensor tx = tensor_2d(x, DTYPE_F32, n, H), to = tensor_2d(out, DTYPE_F32, n, H);
    b->ops->moe_experts(b, &to, &tx, WEIGHT_PLAIN(&tgu), WEIGHT_PLAIN(&tdn), ids, w, slots, NULL, ws);
    double *ref = malloc(sizeof(double) * (size_t)n * H);
    ref_experts(ref, x, gu, dn, ids, w, n, slots, H, I);
    double num = 0, den = 0;
    const float *o = (const float *)out;
    for (int i = 0; i < n * H; i++) {
        ASSERT_TRUE(isfinite(o[i]));
        num += (o[i] - ref[i]) * (o[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    double e2 = num / (den > 0 ? den : 1);
    if (!(e2 < 1e-10))
        test_fail(__FILE__, __LINE__, "moe_experts n=%d E=%d slots=%d H=%d I=%d routing %d %s: nmse %.3g", n, E, slots,
                  H, I, (int)rt, dtype_name(wdt), e2);
    for (int i = 0; i < 64; i++)
        ASSERT_EQ(out[out_bytes + i], 0xA5);
    // Deterministic: the same call again gives the same bits.
    float *again = malloc(out_bytes);
    struct tensor ta = tensor_2d(again, DTYPE_F32, n, H);
    b->ops->moe_experts(b, &ta, &tx, WEIGHT_PLAIN(&tgu), WEIGHT_PLAIN(&tdn), ids, w, slots, NULL, ws);
    ASSERT_TRUE(memcmp(again, out, out_bytes) == 0);
    free(again);
    b->ops->free(b, ws);
    b->ops->free(b, tgu.data);
    b->ops->free(b, tdn.data);
    free(x);
    free(gu);
    free(dn);
    free(ids);
    free(w);
    free(out);
    free(ref);
}

// GPT-OSS experts: clamped SwiGLU (alpha 1.702, limit 1.5: x and weights are large enough that
// both clamps bite) with gate_up / down biases, weights F32 or MXFP4 (random bytes and exponents),
// against a naive double reference with the weights decoded by the MX definition.
static void check_experts_gpt_oss(struct backend *b, int n, int E, int slots, int H, int I, enum routing rt, bool mx) {
    const float alpha = 1.702f, limit = 1.5f;
    const size_t ngu = (size_t)E * 2 * I * H, ndn = (size_t)E * H * I;
    float *x = malloc(sizeof(float) * (size_t)n * H), *gu = malloc(sizeof(float) * ngu), *dn = malloc(sizeof(float) * ndn);
    float *bg = malloc(sizeof(float) * (size_t)E * 2 * I), *bd = malloc(sizeof(float) * (size_t)E * H);
    uint8_t *q[2] = {malloc(ngu / 2), malloc(ndn / 2)}, *sc[2] = {malloc(ngu / 32), malloc(ndn / 32)};
    for (int i = 0; i < n * H; i++)
        x[i] = 2.0f * rng_sym();
    for (size_t i = 0; i < (size_t)E * 2 * I; i++)
        bg[i] = 0.5f * rng_sym();
    for (size_t i = 0; i < (size_t)E * H; i++)
        bd[i] = 0.5f * rng_sym();
    static const float lut[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    float *full[2] = {gu, dn};
    const size_t cnt[2] = {ngu, ndn};
    const int cols[2] = {H, I};
    for (int m = 0; m < 2; m++) {
        for (size_t i = 0; i < cnt[m] / 2; i++)
            q[m][i] = (uint8_t)rng_u64();
        for (size_t i = 0; i < cnt[m] / 32; i++)
            sc[m][i] = (uint8_t)(122 + rng_int(3)); // 2^-5 .. 2^-3
        for (size_t i = 0; i < cnt[m]; i++)
            full[m][i] = mx ? lut[(i % 2) ? q[m][i / 2] >> 4 : q[m][i / 2] & 15] * ldexpf(1.0f, (int)sc[m][i / 32] - 127)
                            : 3.0f * rng_sym() / sqrtf((float)cols[m]);
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * slots);
    float *w = malloc(sizeof(float) * (size_t)n * slots);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < slots; j++) {
            ids[t * slots + j] = rt == ROUTE_ONE_EXPERT ? E - 1 : rt == ROUTE_ALL ? j : rng_int(E);
            w[t * slots + j] = 0.1f + (float)(rng_u64() % 1000) / 1000.0f;
        }
    struct weight wgu, wdn;
    if (mx) {
        wgu = (struct weight){.t = tensor_make(q[0], DTYPE_U8, 3, (int64_t[]){E, 2 * I, H / 2}), .scheme = WEIGHT_SCHEME_MX,
                              .scale = tensor_make(sc[0], DTYPE_U8, 3, (int64_t[]){E, 2 * I, H / 32}), .block_rows = 1,
                              .block_cols = 32};
        wdn = (struct weight){.t = tensor_make(q[1], DTYPE_U8, 3, (int64_t[]){E, H, I / 2}), .scheme = WEIGHT_SCHEME_MX,
                              .scale = tensor_make(sc[1], DTYPE_U8, 3, (int64_t[]){E, H, I / 32}), .block_rows = 1,
                              .block_cols = 32};
    } else {
        wgu = (struct weight){.t = tensor_make(gu, DTYPE_F32, 3, (int64_t[]){E, 2 * I, H})};
        wdn = (struct weight){.t = tensor_make(dn, DTYPE_F32, 3, (int64_t[]){E, H, I})};
    }
    struct tensor tbg = tensor_2d(bg, DTYPE_F32, E, 2 * I), tbd = tensor_2d(bd, DTYPE_F32, E, H);
    const struct moe_experts_args ea = {MOE_ACT_SWIGLU_CLAMP, alpha, limit, &tbg, &tbd};
    void *ws = b->ops->alloc(b, moe_workspace_bytes(n, slots, E, H, I, sizeof(float)));
    float *out = malloc(sizeof(float) * (size_t)n * H);
    struct tensor tx = tensor_2d(x, DTYPE_F32, n, H), to = tensor_2d(out, DTYPE_F32, n, H);
    b->ops->moe_experts(b, &to, &tx, &wgu, &wdn, ids, w, slots, &ea, ws);
    double num = 0, den = 0;
    int clamped_g = 0, clamped_u = 0;
    double *act = malloc(sizeof(double) * (size_t)I);
    for (int t = 0; t < n; t++) {
        double ref[512] = {0};
        CHECK(H <= 512);
        for (int j = 0; j < slots; j++) {
            const int e = ids[t * slots + j];
            for (int i = 0; i < I; i++) {
                double g = bg[(size_t)e * 2 * I + i], u = bg[(size_t)e * 2 * I + I + i];
                for (int h = 0; h < H; h++) {
                    g += (double)x[t * H + h] * gu[((size_t)e * 2 * I + i) * H + h];
                    u += (double)x[t * H + h] * gu[((size_t)e * 2 * I + I + i) * H + h];
                }
                clamped_g += g > limit;
                clamped_u += fabs(u) > limit;
                g = g < limit ? g : limit;
                u = u < -limit ? -limit : u > limit ? limit : u;
                act[i] = (u + 1.0) * g / (1.0 + exp(-alpha * g));
            }
            for (int h = 0; h < H; h++) {
                double y = bd[(size_t)e * H + h];
                for (int i = 0; i < I; i++)
                    y += act[i] * dn[((size_t)e * H + h) * I + i];
                ref[h] += w[t * slots + j] * y;
            }
        }
        for (int h = 0; h < H; h++) {
            ASSERT_TRUE(isfinite(out[t * H + h]));
            num += (out[t * H + h] - ref[h]) * (out[t * H + h] - ref[h]);
            den += ref[h] * ref[h];
        }
    }
    double e2 = num / (den > 0 ? den : 1);
    if (!(e2 < 1e-10))
        test_fail(__FILE__, __LINE__, "gpt-oss moe_experts n=%d E=%d slots=%d H=%d I=%d %s: nmse %.3g", n, E, slots, H, I,
                  mx ? "mxfp4" : "f32", e2);
    ASSERT_TRUE(clamped_g > 0 && clamped_u > 0); // the clamps were exercised
    b->ops->free(b, ws);
    free(act);
    free(x);
    free(gu);
    free(dn);
    free(bg);
    free(bd);
    for (int m = 0; m < 2; m++) {
        free(q[m]);
        free(sc[m]);
    }
    free(ids);
    free(w);
    free(out);
}

TEST(moe_experts_gpt_oss_clamped_swiglu_biases) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    for (int mx = 0; mx < 2; mx++) {
        check_experts_gpt_oss(b, 1, 8, 4, 64, 32, ROUTE_RANDOM, mx);      // decode token (skinny kernel)
        check_experts_gpt_oss(b, 37, 8, 4, 96, 64, ROUTE_RANDOM, mx);     // prefill (sgemm per expert)
        check_experts_gpt_oss(b, 20, 4, 2, 64, 32, ROUTE_ONE_EXPERT, mx); // skewed: one expert
        check_experts_gpt_oss(b, 9, 4, 4, 64, 32, ROUTE_ALL, mx);         // top-k = E
    }
    backend_destroy(b);
}

TEST(moe_experts_random_routing) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    check_experts(b, 1, 8, 2, 64, 32, ROUTE_RANDOM, DTYPE_F32);   // one decode token
    check_experts(b, 5, 8, 4, 64, 48, ROUTE_RANDOM, DTYPE_F32);   // decode batch (skinny kernel per expert)
    check_experts(b, 67, 16, 4, 72, 40, ROUTE_RANDOM, DTYPE_F32); // prefill (OpenBLAS per expert), odd sizes
    check_experts(b, 40, 8, 2, 64, 32, ROUTE_RANDOM, DTYPE_BF16); // BF16 stacked weights
    backend_destroy(b);
}

TEST(moe_experts_skewed_routing) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    check_experts(b, 50, 8, 2, 64, 32, ROUTE_ONE_EXPERT, DTYPE_F32); // all tokens (both slots) to one expert
    check_experts(b, 3, 8, 2, 64, 32, ROUTE_ONE_EXPERT, DTYPE_F32);
    check_experts(b, 33, 16, 2, 64, 32, ROUTE_TWO_EXPERTS, DTYPE_F32); // 14 of 16 experts empty
    check_experts(b, 21, 4, 4, 64, 32, ROUTE_ALL, DTYPE_F32);          // top-k = number of experts
    check_experts(b, 1, 4, 4, 64, 32, ROUTE_ALL, DTYPE_BF16);
    backend_destroy(b);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
