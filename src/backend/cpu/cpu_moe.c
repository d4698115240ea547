// Mixture-of-experts ops of the CPU backend (the reference the CUDA fused MoE is tested
// against): moe_route (fp32 softmax or sigmoid scores, correction bias, grouped top-k,
// renormalisation) and moe_experts (tokens grouped by expert, one GEMM per active expert through
// the backend's own matmul (so MXFP4 and the other quantized schemes dequantize a tile at a time,
// cpu_qmatmul.c), the activation, down, and a weighted combine back into token order). Contracts:
// backend.h, struct moe_route_args.
//
// moe_experts data flow, all inside the caller's workspace (no allocation):
//   counts[e] / offsets[e]   rows routed to expert e, prefix sums (E_total + 1)
//   sorted[p]                the routed slot s = t * n_slots + j at sorted position p; within an
//                            expert, slots keep token order (a stable counting sort)
//   pos[s]                   the inverse: sorted position of slot s
//   xs (R, H)                x rows gathered in sorted order
//   gu (R, 2I), act (R, I)   gate_up GEMM output per expert (+ its gate_up bias), then the
//                            activation over all rows (SiLU*mul, or GPT-OSS's clamped SwiGLU)
//   y (R, H)                 down GEMM output per expert (+ its down bias)
//   out[t] = sum_j w[t, j] * y[pos[t * n_slots + j]]   (slot order: deterministic)
// The GEMMs go through ops->matmul on per-expert 2-D views of the stacked weights, so they
// inherit its kernels (skinny kernel for few rows, OpenBLAS for many) and weight dtypes.
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_backend.h"
#include "common/check.h"

// ---------------------------------------------------------------------------------------------
// Routing

struct route_ctx {
    const struct tensor *logits;
    const struct moe_route_args *a;
    int32_t *ids;
    float *w;
    int E, k, slots;
};

// True when expert a ranks before expert b: larger key first, then the lower id.
static inline bool route_before(float sa, int a, float sb, int b) {
    return sa > sb || (sa == sb && a < b);
}

// p (E): logits in, scores out (softmax over the row or sigmoid per expert).
static void route_scores(float *p, int E, enum moe_scoring scoring) {
    if (scoring == MOE_SCORING_SIGMOID) {
        for (int e = 0; e < E; e++)
            p[e] = 1.0f / (1.0f + expf(-p[e]));
        return;
    }
    float mx = -INFINITY;
    for (int e = 0; e < E; e++)
        mx = p[e] > mx ? p[e] : mx;
    double sum = 0;
    for (int e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++)
        p[e] *= inv;
}

// Grouped top-k: clears allowed[e] for the experts outside the topk_group best groups (group
// score from the keys q: max, or the sum of the two largest; ties to the lower group id).
static void route_group_mask(const float *q, int E, const struct moe_route_args *a, bool *allowed) {
    const int ng = a->n_group, G = E / ng;
    float gs[1024];
    for (int g = 0; g < ng; g++) {
        float m1 = -INFINITY, m2 = -INFINITY;
        for (int e = g * G; e < (g + 1) * G; e++) {
            if (q[e] > m1) {
                m2 = m1;
                m1 = q[e];
            } else if (q[e] > m2) {
                m2 = q[e];
            }
        }
        gs[g] = a->group_score == MOE_GROUP_SCORE_TOP2_SUM ? m1 + m2 : m1;
    }
    bool keep[1024] = {0};
    for (int j = 0; j < a->topk_group; j++) {
        int best = -1;
        for (int g = 0; g < ng; g++)
            if (!keep[g] && (best < 0 || route_before(gs[g], g, gs[best], best))) best = g;
        keep[best] = true;
    }
    for (int e = 0; e < E; e++)
        allowed[e] = keep[e / G];
}

static void route_rows(void *vctx, int64_t t0, int64_t t1, int tid) {
    struct route_ctx *r = vctx;
    const struct moe_route_args *a = r->a;
    float p[1024], qbuf[1024];
    bool allowed[1024];
    const int E = r->E, k = r->k;
    for (int64_t t = t0; t < t1; t++) {
        int32_t *ids = r->ids + t * r->slots;
        float *w = r->w + t * r->slots;
        if (a->force_uniform) {
            for (int j = 0; j < k; j++) {
                ids[j] = (int32_t)((t * k + j) % E);
                w[j] = 1.0f / (float)k;
            }
        } else {
            if (r->logits->dtype == DTYPE_F32)
                memcpy(p, (const float *)r->logits->data + t * E, (size_t)E * sizeof(float));
            else
                dtype_to_f32(r->logits->dtype, (const char *)r->logits->data + dtype_row_bytes(r->logits->dtype, E) * t,
                             p, E);
            route_scores(p, E, a->scoring);
            const float *q = p; // selection keys
            if (a->correction_bias) {
                for (int e = 0; e < E; e++)
                    qbuf[e] = p[e] + a->correction_bias[e];
                q = qbuf;
            }
            if (a->n_group > 1)
                route_group_mask(q, E, a, allowed);
            else
                memset(allowed, 1, (size_t)E * sizeof(bool));
            // Selection of the top k under the total order (key desc, id asc): k <= E, small.
            for (int j = 0; j < k; j++) {
                int best = -1;
                for (int e = 0; e < E; e++)
                    if (allowed[e] && (best < 0 || route_before(q[e], e, q[best], best))) best = e;
                CHECK(best >= 0);
                allowed[best] = false;
                ids[j] = best;
                w[j] = p[best];
            }
            float s = 0;
            for (int j = 0; j < k; j++)
                s += w[j];
            float f = a->renormalize ? a->scale / (s + 1e-20f) : a->scale;
            for (int j = 0; j < k; j++)
                w[j] *= f;
        }
        for (int j = 0; j < a->n_shared; j++) {
            ids[k + j] = E + j;
            w[k + j] = a->shared_weight;
        }
    }
    (void)tid;
}

void cpu_moe_route(struct backend *b, const struct tensor *logits, const struct moe_route_args *a, int32_t *topk_ids,
                   float *topk_w) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(a->scoring == MOE_SCORING_SOFTMAX || a->scoring == MOE_SCORING_SIGMOID);
    CHECK(a->num_experts > 0 && a->num_experts <= 1024 && a->top_k >= 1 && a->top_k <= a->num_experts);
    CHECK(a->n_shared >= 0 && tensor_cols(logits) == a->num_experts);
    if (a->n_group > 1) {
        CHECK_MSG(a->num_experts % a->n_group == 0 && a->topk_group >= 1 && a->topk_group <= a->n_group,
                  "moe_route: n_group %d / topk_group %d over %d experts", a->n_group, a->topk_group, a->num_experts);
        CHECK_MSG(a->topk_group * (a->num_experts / a->n_group) >= a->top_k,
                  "moe_route: %d kept groups of %d experts hold fewer than top_k %d", a->topk_group,
                  a->num_experts / a->n_group, a->top_k);
        CHECK(a->group_score == MOE_GROUP_SCORE_MAX ||
              (a->group_score == MOE_GROUP_SCORE_TOP2_SUM && a->num_experts / a->n_group >= 2));
    }
    int64_t n = tensor_rows(logits);
    if (n == 0) return;
    struct route_ctx r = {logits, a, topk_ids, topk_w, a->num_experts, a->top_k, a->top_k + a->n_shared};
    cpu_lock(c);
    if (n * a->num_experts * a->top_k < 32768)
        route_rows(&r, 0, n, 0);
    else
        thread_pool_parallel_for(c->pool, n, 16, route_rows, &r);
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// Experts

struct gather_ctx {
    float *xs;
    const float *x;
    const int32_t *sorted;
    int slots;
    int64_t H;
};

static void gather_sorted_rows(void *vctx, int64_t p0, int64_t p1, int tid) {
    struct gather_ctx *g = vctx;
    for (int64_t p = p0; p < p1; p++)
        memcpy(g->xs + p * g->H, g->x + (int64_t)(g->sorted[p] / g->slots) * g->H, (size_t)g->H * sizeof(float));
    (void)tid;
}

struct combine_ctx {
    float *out;
    const float *y, *w;
    const int32_t *pos;
    int slots;
    int64_t H;
};

static void combine_rows(void *vctx, int64_t t0, int64_t t1, int tid) {
    struct combine_ctx *c = vctx;
    for (int64_t t = t0; t < t1; t++) {
        float *o = c->out + t * c->H;
        for (int64_t h = 0; h < c->H; h++)
            o[h] = 0.0f;
        for (int j = 0; j < c->slots; j++) {
            float wj = c->w[t * c->slots + j];
            const float *y = c->y + (int64_t)c->pos[t * c->slots + j] * c->H;
            for (int64_t h = 0; h < c->H; h++)
                o[h] += wj * y[h];
        }
    }
    (void)tid;
}

// GPT-OSS's clamped SwiGLU (backend.h, MOE_ACT_SWIGLU_CLAMP) over rows of (gate | up).
struct swiglu_ctx {
    float *out;
    const float *gu;
    int64_t f;
    float alpha, limit;
};

static void swiglu_clamp_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct swiglu_ctx *s = vctx;
    const float lim = s->limit, alpha = s->alpha;
    for (int64_t r = r0; r < r1; r++) {
        const float *g = s->gu + r * 2 * s->f, *u = g + s->f;
        float *o = s->out + r * s->f;
        for (int64_t i = 0; i < s->f; i++) {
            float gi = g[i] < lim ? g[i] : lim; // min(g, limit); NaN stays NaN
            float ui = u[i] < -lim ? -lim : u[i] > lim ? lim : u[i];
            o[i] = (ui + 1.0f) * (gi / (1.0f + expf(-alpha * gi)));
        }
    }
    (void)tid;
}

// Row e of a stacked (E, n) bias, as a 1-D tensor (NULL when there is no bias).
static const struct tensor *bias_row(const struct tensor *bias, int e, struct tensor *view) {
    if (!bias) return NULL;
    const int64_t n = tensor_cols(bias);
    *view = tensor_make((char *)bias->data + dtype_row_bytes(bias->dtype, n) * (size_t)e, bias->dtype, 1,
                        (int64_t[]){n});
    return view;
}

void cpu_moe_experts(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up_w,
                     const struct weight *down_w, const int32_t *topk_ids, const float *topk_w, int n_slots,
                     const struct moe_experts_args *ea, void *workspace) {
    struct cpu_backend *c = cpu_backend_of(b);
    const struct moe_experts_args plain = {.act = MOE_ACT_SILU};
    if (!ea) ea = &plain;
    CHECK_MSG(ea->act == MOE_ACT_SILU || ea->act == MOE_ACT_SWIGLU_CLAMP, "moe_experts: activation %d", (int)ea->act);
    // Quantized experts (any scheme cpu_qmatmul runs) go through per-expert weight views.
    CHECK_MSG((gate_up_w->scheme == WEIGHT_SCHEME_NONE || cpu_qweight_supported(gate_up_w)) &&
                  (down_w->scheme == WEIGHT_SCHEME_NONE || cpu_qweight_supported(down_w)),
              "CPU moe_experts: weight scheme %s not implemented", weight_scheme_name(gate_up_w->scheme));
    const struct tensor *gate_up = &gate_up_w->t, *down = &down_w->t;
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && gate_up->ndim == 3 && down->ndim == 3);
    const int64_t n = tensor_rows(x), H = tensor_cols(x), I = weight_cols(down_w);
    const int E = (int)gate_up->ne[0];
    CHECK_MSG(gate_up->ne[1] == 2 * I && weight_cols(gate_up_w) == H && down->ne[0] == E && down->ne[1] == H,
              "moe_experts: gate_up (%lld, %lld, %lld) and down (%lld, %lld, %lld) do not match H %lld",
              (long long)gate_up->ne[0], (long long)gate_up->ne[1], (long long)weight_cols(gate_up_w),
              (long long)down->ne[0], (long long)down->ne[1], (long long)I, (long long)H);
    CHECK(tensor_rows(out) == n && tensor_cols(out) == H && out->data != x->data && n_slots >= 1);
    CHECK(!ea->gate_up_bias || (tensor_rows(ea->gate_up_bias) == E && tensor_cols(ea->gate_up_bias) == 2 * I));
    CHECK(!ea->down_bias || (tensor_rows(ea->down_bias) == E && tensor_cols(ea->down_bias) == H));
    if (n == 0) return;
    const int64_t R = n * n_slots;
    // Workspace layout: must match moe_workspace_bytes.
    int32_t *counts = workspace, *offsets = counts + (E + 1), *fill = offsets + (E + 1);
    int32_t *sorted = fill + (E + 1), *pos = sorted + R;
    size_t ints = (size_t)(4 * (E + 1) + 3 * R + 64) * sizeof(int32_t);
    float *xs = (float *)((char *)workspace + ((ints + 255) & ~(size_t)255));
    float *gu = xs + R * H, *act = gu + R * 2 * I, *y = act + R * I;

    cpu_lock(c);
    memset(counts, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t s = 0; s < R; s++) {
        int32_t e = topk_ids[s];
        CHECK_MSG(e >= 0 && e < E, "moe_experts: slot %lld routed to expert %d of %d", (long long)s, e, E);
        counts[e]++;
    }
    offsets[0] = 0;
    for (int e = 0; e < E; e++)
        offsets[e + 1] = offsets[e] + counts[e];
    memcpy(fill, offsets, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t s = 0; s < R; s++) {
        int32_t p = fill[topk_ids[s]]++;
        sorted[p] = (int32_t)s;
        pos[s] = p;
    }
    struct gather_ctx g = {xs, x->data, sorted, n_slots, H};
    if (R * H < 32768)
        gather_sorted_rows(&g, 0, R, 0);
    else
        thread_pool_parallel_for(c->pool, R, 16, gather_sorted_rows, &g);
    cpu_unlock(c);

    // One GEMM per active expert (the matmul op takes the lock itself).
    for (int e = 0; e < E; e++) {
        if (!counts[e]) continue;
        struct tensor xe = tensor_2d(xs + (int64_t)offsets[e] * H, DTYPE_F32, counts[e], H);
        struct tensor ge = tensor_2d(gu + (int64_t)offsets[e] * 2 * I, DTYPE_F32, counts[e], 2 * I);
        struct weight we = cpu_weight_expert(gate_up_w, e);
        struct tensor bv;
        b->ops->matmul(b, &ge, &xe, &we, bias_row(ea->gate_up_bias, e, &bv));
    }
    struct tensor gu_all = tensor_2d(gu, DTYPE_F32, R, 2 * I), act_all = tensor_2d(act, DTYPE_F32, R, I);
    if (ea->act == MOE_ACT_SILU) {
        b->ops->silu_mul(b, &act_all, &gu_all);
    } else {
        struct swiglu_ctx sc = {act, gu, I, ea->alpha, ea->limit};
        cpu_lock(c);
        if (R * I < 32768)
            swiglu_clamp_rows(&sc, 0, R, 0);
        else
            thread_pool_parallel_for(c->pool, R, 4, swiglu_clamp_rows, &sc);
        cpu_unlock(c);
    }
    for (int e = 0; e < E; e++) {
        if (!counts[e]) continue;
        struct tensor ae = tensor_2d(act + (int64_t)offsets[e] * I, DTYPE_F32, counts[e], I);
        struct tensor ye = tensor_2d(y + (int64_t)offsets[e] * H, DTYPE_F32, counts[e], H);
        struct weight we = cpu_weight_expert(down_w, e);
        struct tensor bv;
        b->ops->matmul(b, &ye, &ae, &we, bias_row(ea->down_bias, e, &bv));
    }

    cpu_lock(c);
    struct combine_ctx cc = {out->data, y, topk_w, pos, n_slots, H};
    if (R * H < 32768)
        combine_rows(&cc, 0, n, 0);
    else
        thread_pool_parallel_for(c->pool, n, 4, combine_rows, &cc);
    cpu_unlock(c);
}
