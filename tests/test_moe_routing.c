// The CPU moe_route (backend.h, struct moe_route_args) in its DeepSeek / GLM / MiMo modes: sigmoid
// scores, a per-expert correction bias that selects but does not weigh, and grouped top-k with
// groups scored by their max (DeepSeek-V2 group_limited_greedy) or by the sum of their two best
// keys (DeepSeek-V3 noaux_tc, GLM-4-MoE).
//
// Against (1) a naive double-precision reference written here, exactly (ids) and to fp32
// rounding (weights): random logits, exact ties between experts and between groups, groups of
// fewer experts than top_k, kept experts == top_k, renormalisation on / off, routed scaling,
// shared slots, BF16 logits, threaded batches; (2) HF transformers' own router modules
// (DeepseekV3TopkRouter, Glm4MoeTopkRouter, DeepseekV2TopkRouter) through the cases
// tests/py/test_moe_routing.py writes: tests/fixtures/moe_routing/hf_cases.json, or the file
// named by ATOMC_MOE_ROUTE_CASES (the pytest's fresh cases). Where torch.topk resolved an exact
// tie differently from our lower-id rule the selections must have equal multisets of keys.
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/dtype.h"
#include "test.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
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
// Naive reference (double)

// Scores and keys of one token in double.
static void ref_scores(const float *logits, const float *bias, int E, enum moe_scoring sc, double *p, double *q) {
    if (sc == MOE_SCORING_SIGMOID) {
        for (int e = 0; e < E; e++)
            p[e] = 1.0 / (1.0 + exp(-(double)logits[e]));
    } else {
        double mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++)
            mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < E; e++)
            sum += p[e] = exp((double)logits[e] - mx);
        for (int e = 0; e < E; e++)
            p[e] /= sum;
    }
    for (int e = 0; e < E; e++)
        q[e] = p[e] + (bias ? (double)bias[e] : 0.0);
}

// Group scores (n_group) of the keys q: the max, or the sum of the two largest.
static void ref_group_scores(const double *q, const struct moe_route_args *a, double *gs) {
    const int G = a->num_experts / a->n_group;
    for (int g = 0; g < a->n_group; g++) {
        // The group's keys sorted descending (insertion sort).
        double v[1024];
        for (int i = 0; i < G; i++) {
            double x = q[g * G + i];
            int j = i;
            while (j > 0 && v[j - 1] < x) {
                v[j] = v[j - 1];
                j--;
            }
            v[j] = x;
        }
        gs[g] = a->group_score == MOE_GROUP_SCORE_TOP2_SUM ? v[0] + v[1] : v[0];
    }
}

// The contract in plain loops: groups by max / top-2 sum of the keys, the topk_group best groups
// (ties: lower group), then the top_k keys among their experts (ties: lower id); weights from the
// scores. `bias` is the host copy of a->correction_bias.
static void ref_route(const float *logits, const float *bias, const struct moe_route_args *a, int32_t *ids, double *w) {
    const int E = a->num_experts;
    double p[1024], q[1024];
    ref_scores(logits, bias, E, a->scoring, p, q);
    bool allowed[1024];
    for (int e = 0; e < E; e++)
        allowed[e] = true;
    if (a->n_group > 1) {
        int G = E / a->n_group;
        double gs[1024];
        ref_group_scores(q, a, gs);
        bool keep[1024] = {0};
        for (int j = 0; j < a->topk_group; j++) {
            int best = -1;
            for (int g = 0; g < a->n_group; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g; // strict >: lower group on ties
            keep[best] = true;
        }
        for (int e = 0; e < E; e++)
            allowed[e] = keep[e / G];
    }
    double s = 0;
    for (int j = 0; j < a->top_k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (allowed[e] && (best < 0 || q[e] > q[best])) best = e;
        allowed[best] = false;
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

// DRAW_TIES: logits from {0, 0.5, ..., 2} and one bias for all experts, so experts and groups
// tie exactly. (Negative logits or several bias values would also make group sums equal in
// real numbers but not in floats, e.g. sigmoid(x) + sigmoid(-x) = 1: a float-rounding coin
// flip, not a tie rule.) DRAW_SKEWED: one expert per token far above the rest on average.
enum draw { DRAW_RANDOM, DRAW_TIES, DRAW_SKEWED };

// Routes n random tokens through the op (logits in `dt`) and compares every slot with ref_route.
static void check_route(struct backend *b, int n, struct moe_route_args a, bool with_bias, enum draw draw,
                        enum dtype dt) {
    const int E = a.num_experts, slots = a.top_k + a.n_shared;
    float *logits = malloc(sizeof(float) * (size_t)n * E), *bias = NULL;
    for (int i = 0; i < n * E; i++) {
        float x = draw == DRAW_TIES     ? 0.5f * (float)rng_int(5)
                  : draw == DRAW_SKEWED ? (rng_int(E) == 0 ? 4.0f : -4.0f) + rng_sym()
                                        : 3.0f * rng_sym();
        logits[i] = dt == DTYPE_BF16 ? bf16_to_f32(f32_to_bf16(x)) : x;
    }
    if (with_bias) {
        bias = malloc(sizeof(float) * (size_t)E);
        for (int e = 0; e < E; e++)
            bias[e] = draw == DRAW_TIES ? 0.25f : 0.2f * rng_sym();
    }
    a.correction_bias = bias; // CPU backend memory is host memory
    void *lg = logits;
    uint16_t *lb = NULL;
    if (dt == DTYPE_BF16) {
        lb = malloc(sizeof(uint16_t) * (size_t)n * E);
        dtype_from_f32(DTYPE_BF16, logits, lb, (int64_t)n * E);
        lg = lb;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * slots), rid[1024];
    float *w = malloc(sizeof(float) * (size_t)n * slots);
    double rw[1024];
    struct tensor lt = tensor_2d(lg, dt, n, E);
    b->ops->moe_route(b, &lt, &a, ids, w);
    int bad = 0;
    for (int t = 0; t < n && bad < 5; t++) {
        ref_route(logits + (size_t)t * E, bias, &a, rid, rw);
        for (int j = 0; j < slots; j++) {
            if (ids[t * slots + j] != rid[j]) {
                test_fail(__FILE__, __LINE__, "E=%d k=%d groups %d/%d token %d slot %d: expert %d, reference %d", E,
                          a.top_k, a.n_group, a.topk_group, t, j, ids[t * slots + j], rid[j]);
                bad++;
                break;
            }
            if (!(fabs(w[t * slots + j] - rw[j]) <= 2e-6 * (1 + fabs(rw[j])))) {
                test_fail(__FILE__, __LINE__, "E=%d token %d slot %d: weight %.9g, reference %.9g", E, t, j,
                          w[t * slots + j], rw[j]);
                bad++;
            }
        }
    }
    free(logits);
    free(bias);
    free(lb);
    free(ids);
    free(w);
}

static struct moe_route_args sig_args(int E, int k, int ng, int tg) {
    return (struct moe_route_args){.num_experts = E,
                                   .top_k = k,
                                   .scoring = MOE_SCORING_SIGMOID,
                                   .renormalize = true,
                                   .scale = 2.5f,
                                   .n_group = ng,
                                   .topk_group = tg,
                                   .group_score = MOE_GROUP_SCORE_TOP2_SUM};
}

TEST(moe_route_sigmoid_bias_groups_match_reference) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    for (int d = 0; d < 3; d++) {
        enum draw draw = (enum draw)d;
        check_route(b, 300, sig_args(256, 8, 8, 4), true, draw, DTYPE_F32); // DeepSeek-V3, threaded
        check_route(b, 7, sig_args(256, 8, 8, 4), true, draw, DTYPE_F32);
        check_route(b, 40, sig_args(160, 8, 1, 1), true, draw, DTYPE_F32);  // GLM-4.5: no groups
        check_route(b, 40, sig_args(128, 8, 0, 0), false, draw, DTYPE_F32); // sigmoid, no bias
        check_route(b, 64, sig_args(64, 6, 8, 3), true, draw, DTYPE_F32);
        check_route(b, 64, sig_args(8, 3, 4, 2), true, draw, DTYPE_F32);   // groups of 2 < top_k 3
        check_route(b, 64, sig_args(8, 4, 4, 2), true, draw, DTYPE_F32);   // top_k = kept experts
        check_route(b, 64, sig_args(16, 5, 8, 3), true, draw, DTYPE_F32);  // 6 kept experts, k 5
        check_route(b, 64, sig_args(12, 12, 1, 1), true, draw, DTYPE_F32); // top_k = E
        struct moe_route_args a = sig_args(32, 4, 4, 2);
        a.renormalize = false;
        a.scale = 1.0f;
        a.n_shared = 1;
        a.shared_weight = 1.0f;
        check_route(b, 33, a, true, draw, DTYPE_F32);                      // no renormalisation, one shared slot
        check_route(b, 33, sig_args(64, 6, 8, 3), true, draw, DTYPE_BF16); // BF16 logits
        // DeepSeek-V2 group_limited_greedy: softmax, groups by max, no bias.
        a = (struct moe_route_args){.num_experts = 160,
                                    .top_k = 6,
                                    .scoring = MOE_SCORING_SOFTMAX,
                                    .scale = 16.0f,
                                    .n_group = 8,
                                    .topk_group = 3,
                                    .group_score = MOE_GROUP_SCORE_MAX,
                                    .n_shared = 2,
                                    .shared_weight = 1.0f};
        check_route(b, 50, a, false, draw, DTYPE_F32);
        a.num_experts = 12;
        a.top_k = 4;
        a.n_group = 6;
        check_route(b, 50, a, false, draw, DTYPE_F32); // groups of 2
        a.group_score = MOE_GROUP_SCORE_TOP2_SUM;
        check_route(b, 50, a, true, draw, DTYPE_F32); // softmax with a bias and top-2 groups: any mix is defined
    }
    backend_destroy(b);
}

// Hand-made rows where each rule decides the outcome.
TEST(moe_route_bias_selects_scores_weigh) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    // Expert 3 has the lowest logit but a bias that lifts it to first place; its weight is its own
    // sigmoid, not the corrected key.
    float logits[4] = {1.0f, 0.5f, 0.0f, -1.0f}, bias[4] = {0, 0, 0, 0.4f};
    int32_t ids[2];
    float w[2];
    struct moe_route_args a = {
        .num_experts = 4, .top_k = 2, .scoring = MOE_SCORING_SIGMOID, .scale = 1.0f, .correction_bias = bias};
    struct tensor lt = tensor_2d(logits, DTYPE_F32, 1, 4);
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 0); // keys: 0.731, 0.622, 0.5, 0.269 + 0.4
    ASSERT_EQ(ids[1], 3);
    ASSERT_NEAR(w[0], 1.0 / (1.0 + exp(-1.0)), 1e-6);
    ASSERT_NEAR(w[1], 1.0 / (1.0 + exp(1.0)), 1e-6);
    bias[3] = 2.0f; // now first
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 3);
    ASSERT_EQ(ids[1], 0);
    a.renormalize = true;
    a.scale = 2.0f;
    b->ops->moe_route(b, &lt, &a, ids, w);
    double s3 = 1.0 / (1.0 + exp(1.0)), s0 = 1.0 / (1.0 + exp(-1.0));
    ASSERT_NEAR(w[0], 2.0 * s3 / (s3 + s0), 1e-6);
    ASSERT_NEAR(w[1], 2.0 * s0 / (s3 + s0), 1e-6);
    backend_destroy(b);
}

TEST(moe_route_group_scores_max_vs_top2_sum) {
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    // 3 groups of 3 (logits are the keys' order; sigmoid is monotone). Group 0 holds the best
    // single expert, group 1 the best pair; group 2 ties group 1 exactly.
    float logits[9] = {4.0f, -4.0f, -4.0f, 1.0f, 1.0f, -4.0f, 1.0f, 1.0f, -4.0f};
    int32_t ids[2];
    float w[2];
    struct moe_route_args a = {.num_experts = 9,
                               .top_k = 2,
                               .scoring = MOE_SCORING_SIGMOID,
                               .scale = 1.0f,
                               .n_group = 3,
                               .topk_group = 1,
                               .group_score = MOE_GROUP_SCORE_MAX};
    struct tensor lt = tensor_2d(logits, DTYPE_F32, 1, 9);
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 0); // max: group 0 (0.982) -> experts 0 and then 1 (ties 2: lower id)
    ASSERT_EQ(ids[1], 1);
    a.group_score = MOE_GROUP_SCORE_TOP2_SUM; // 0.982 + 0.018 = 1.0 < 2 x 0.731 = 1.462
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 3); // group 1 wins the exact tie with group 2 (lower group id)
    ASSERT_EQ(ids[1], 4);
    a.topk_group = 2; // groups 1 and 2 kept: experts 3, 4, 6, 7 tie; lower ids first
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 3);
    ASSERT_EQ(ids[1], 4);
    logits[7] = 1.5f; // group 2 now the best pair; its expert 7 the best key
    a.topk_group = 1;
    b->ops->moe_route(b, &lt, &a, ids, w);
    ASSERT_EQ(ids[0], 7);
    ASSERT_EQ(ids[1], 6);
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// HF's routers (cases from tests/py/test_moe_routing.py)

static int cmp_double_desc(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? 1 : a > b ? -1 : 0;
}

// Whether the experts hid (top_k of them) are what the contract chooses under some order of
// exact ties (groups and experts). Keys in double from the same floats: exact ties stay exact.
static bool hf_tie_equivalent(const float *logits, const float *bias, const struct moe_route_args *a, const int *hid) {
    const int E = a->num_experts, k = a->top_k;
    double p[1024], q[1024];
    ref_scores(logits, bias, E, a->scoring, p, q);
    bool chosen[1024] = {0}, kept[1024];
    double kmin = INFINITY;
    for (int j = 0; j < k; j++) {
        if (hid[j] < 0 || hid[j] >= E || chosen[hid[j]]) return false;
        chosen[hid[j]] = true;
        kmin = q[hid[j]] < kmin ? q[hid[j]] : kmin;
    }
    for (int e = 0; e < E; e++)
        kept[e] = true;
    if (a->n_group > 1) {
        const int ng = a->n_group, G = E / ng;
        double gs[1024], sorted[1024];
        ref_group_scores(q, a, gs);
        memcpy(sorted, gs, sizeof(double) * (size_t)ng);
        qsort(sorted, (size_t)ng, sizeof(double), cmp_double_desc);
        double thr = sorted[a->topk_group - 1];
        // Kept: every group above the threshold, the groups of HF's experts (which must reach the
        // threshold), then threshold groups with the smallest maxima until topk_group are kept.
        bool gk[1024] = {0};
        int n_kept = 0;
        for (int g = 0; g < ng; g++) {
            bool has = false;
            for (int e = g * G; e < (g + 1) * G; e++)
                has |= chosen[e];
            if (has && gs[g] < thr) return false;
            if (has || gs[g] > thr) {
                gk[g] = true;
                n_kept++;
            }
        }
        if (n_kept > a->topk_group) return false;
        while (n_kept < a->topk_group) {
            int best = -1;
            double best_max = INFINITY;
            for (int g = 0; g < ng; g++) {
                if (gk[g] || gs[g] != thr) continue;
                double mx = -INFINITY;
                for (int e = g * G; e < (g + 1) * G; e++)
                    mx = q[e] > mx ? q[e] : mx;
                if (mx < best_max) {
                    best_max = mx;
                    best = g;
                }
            }
            if (best < 0) return false;
            gk[best] = true;
            n_kept++;
        }
        for (int e = 0; e < E; e++)
            kept[e] = gk[e / G];
    }
    for (int e = 0; e < E; e++)
        if (chosen[e] ? !kept[e] : (kept[e] && q[e] > kmin)) return false;
    return true;
}

// One case: every token routed by the op; ids checked against ref_route exactly, and against HF
// as sets (weights per id) or, on a differently resolved exact tie, as equal key multisets.
static void check_hf_case(struct backend *b, json_t *c, int *n_tok, int *n_exact, int *n_tie) {
    const char *name = json_string_value(json_object_get(c, "name"));
    struct moe_route_args a = {0};
    a.num_experts = (int)json_integer_value(json_object_get(c, "num_experts"));
    a.top_k = (int)json_integer_value(json_object_get(c, "top_k"));
    a.n_group = (int)json_integer_value(json_object_get(c, "n_group"));
    a.topk_group = (int)json_integer_value(json_object_get(c, "topk_group"));
    a.renormalize = json_is_true(json_object_get(c, "renormalize"));
    a.scale = (float)json_number_value(json_object_get(c, "scale"));
    a.scoring =
        strcmp(json_string_value(json_object_get(c, "scoring")), "sigmoid") ? MOE_SCORING_SOFTMAX : MOE_SCORING_SIGMOID;
    a.group_score = strcmp(json_string_value(json_object_get(c, "group_score")), "top2_sum") ? MOE_GROUP_SCORE_MAX
                                                                                             : MOE_GROUP_SCORE_TOP2_SUM;
    const int E = a.num_experts, k = a.top_k;
    json_t *jl = json_object_get(c, "logits"), *jb = json_object_get(c, "bias");
    json_t *jids = json_object_get(c, "hf_ids"), *jw = json_object_get(c, "hf_weights");
    const int n = (int)json_array_size(jl);
    if (!name || E <= 0 || E > 1024 || k <= 0 || k > E || n <= 0 || (int)json_array_size(jids) != n) {
        test_fail(__FILE__, __LINE__, "malformed case %s", name ? name : "?");
        return;
    }
    float *logits = malloc(sizeof(float) * (size_t)n * E), bias[1024];
    for (int t = 0; t < n; t++)
        for (int e = 0; e < E; e++)
            logits[(size_t)t * E + e] = (float)json_number_value(json_array_get(json_array_get(jl, t), e));
    if (json_is_array(jb)) {
        for (int e = 0; e < E; e++)
            bias[e] = (float)json_number_value(json_array_get(jb, e));
        a.correction_bias = bias;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n * k), rid[1024];
    float *w = malloc(sizeof(float) * (size_t)n * k);
    double rw[1024];
    struct tensor lt = tensor_2d(logits, DTYPE_F32, n, E);
    b->ops->moe_route(b, &lt, &a, ids, w);
    for (int t = 0; t < n; t++) {
        const int32_t *mi = ids + (size_t)t * k;
        const float *mw = w + (size_t)t * k;
        ref_route(logits + (size_t)t * E, a.correction_bias, &a, rid, rw);
        for (int j = 0; j < k; j++)
            if (mi[j] != rid[j]) {
                test_fail(__FILE__, __LINE__, "%s token %d slot %d: expert %d, naive reference %d", name, t, j, mi[j],
                          rid[j]);
                goto done;
            }
        int hid[1024];
        double hw[1024];
        for (int j = 0; j < k; j++) {
            hid[j] = (int)json_integer_value(json_array_get(json_array_get(jids, t), j));
            hw[j] = json_number_value(json_array_get(json_array_get(jw, t), j));
        }
        bool same = true;
        for (int j = 0; j < k && same; j++) {
            bool found = false;
            for (int i = 0; i < k; i++)
                if (hid[i] == mi[j]) {
                    found = true;
                    if (!(fabs(mw[j] - hw[i]) <= 2e-6 * (1 + fabs(hw[i])))) {
                        test_fail(__FILE__, __LINE__, "%s token %d expert %d: weight %.9g, HF %.9g", name, t, mi[j],
                                  mw[j], hw[i]);
                        goto done;
                    }
                }
            same = found;
        }
        (*n_tok)++;
        if (same) {
            (*n_exact)++;
            continue;
        }
        // A different set: only exact ties may explain it. HF's experts must be a valid answer of
        // the contract under some tie order: their groups among the topk_group best (a tie at
        // the threshold may go either way), and no expert of the kept groups with a key above
        // the smallest chosen key.
        if (!hf_tie_equivalent(logits + (size_t)t * E, a.correction_bias, &a, hid)) {
            test_fail(__FILE__, __LINE__,
                      "%s token %d: HF's selection differs and is no tie resolution of the "
                      "contract",
                      name, t);
            goto done;
        }
        (*n_tie)++;
    }
done:
    free(logits);
    free(ids);
    free(w);
}

TEST(moe_route_hf_cases) {
    const char *env = getenv("ATOMC_MOE_ROUTE_CASES");
    json_t *root = NULL;
    if (env && *env) {
        json_error_t je;
        root = json_load_file(env, 0, &je);
        if (!root) test_fail(__FILE__, __LINE__, "%s: %s", env, je.text);
    } else {
        root = test_fixture_json("moe_routing/hf_cases.json");
        if (!root) test_fail(__FILE__, __LINE__, "fixture moe_routing/hf_cases.json missing");
    }
    if (!root) return;
    struct backend *b = cpu();
    ASSERT_TRUE(b != NULL);
    json_t *cases = json_object_get(root, "cases");
    int n_tok = 0, n_exact = 0, n_tie = 0;
    for (size_t i = 0; i < json_array_size(cases); i++)
        check_hf_case(b, json_array_get(cases, i), &n_tok, &n_exact, &n_tie);
    printf("hf routing cases: %zu cases, %d tokens, %d exact, %d tie-equivalent\n", json_array_size(cases), n_tok,
           n_exact, n_tie);
    ASSERT_TRUE(json_array_size(cases) > 0);
    ASSERT_TRUE(n_exact > 0);
    json_decref(root);
    backend_destroy(b);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
