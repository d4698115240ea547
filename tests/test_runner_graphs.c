// The runner's decode-graph path (bucket choice, padding to the bucket with slot -1 and a
// dummy block table, block tables re-strided to the capacity, logits of every slot from the
// fixed iota rows, recomputing when the rows asked for are a subset), exercised on the CPU:
// a wrapper backend implements graph_begin/end/launch by recording the ops issued during
// capture (their arguments by value, as a CUDA graph freezes kernel arguments) and replaying
// them (MoE and Gated DeltaNet ops too). Replayed steps must give the logits and tokens of a plain
// eager runner (dense, the MLA + MoE DeepSeek fixtures); for the recurrent model (qwen3_next) every sequence has its
// own state slot and the padding sequences write the runner's dummy slot. Speculative steps (runner_graphs.c's verify
// and MTP graphs): the schedule of tests/spec_graph_schedule.h (verify steps with 0..k drafts per
// sequence, MTP first and chained passes) against an eager runner, the eligibility rules, and the
// engine with ngram / mtp drafts on a recorded-graph runner against an eager engine.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "engine_model_scenarios.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "spec_graph_schedule.h"
#include "test.h"

enum rec_kind {
    REC_EMBED,
    REC_NORM,
    REC_ADD_NORM,
    REC_MATMUL,
    REC_ROPE,
    REC_ATTN,
    REC_SILU,
    REC_ADD,
    REC_GATHER,
    REC_CONVERT,
    REC_DN_CONV,
    REC_DN_RULE,
    REC_GNORM,
    REC_GATE,
    REC_MOE_ROUTE,
    REC_MOE_EXPERTS,
    REC_MLA_WRITE,
    REC_MLA_ATTN,
    REC_COPY_D2D,
    REC_ZERO
};

struct rec {
    enum rec_kind kind;
    struct tensor t[4];
    struct weight w; // REC_MATMUL: the weight operand
    bool has[4];
    const int32_t *ids;
    int64_t stride;
    float f;
    int n;
    struct rope_args rope;
    struct attn_metadata md;
    struct kv_layer *kv;
    struct deltanet_args dn;
    struct moe_route_args route;
    struct weight w2;           // REC_MOE_EXPERTS: down
    struct moe_experts_args ea; // REC_MOE_EXPERTS: the activation / biases (has[3]: given)
    struct mla_args ma;         // REC_MLA_*
    void *p[3];                 // REC_MOE_*: ids, weights, workspace; REC_COPY_D2D / REC_ZERO: dst, src
    size_t bytes;               // REC_COPY_D2D / REC_ZERO
};

struct rec_graph {
    struct rec *recs;
    int n, cap;
};

struct rec_backend {
    struct backend pub; // first: ops receive &pub
    struct backend *real;
    struct backend_ops ops;
    struct rec_graph *capturing;
    int n_captured, n_launched;
};

static struct rec_backend *rb_of(struct backend *b) {
    return (struct rec_backend *)b;
}

static struct rec *rec_push(struct rec_backend *rb, enum rec_kind k) {
    struct rec_graph *g = rb->capturing;
    if (g->n == g->cap) {
        g->cap = g->cap ? 2 * g->cap : 64;
        g->recs = realloc(g->recs, sizeof *g->recs * (size_t)g->cap);
    }
    struct rec *r = &g->recs[g->n++];
    memset(r, 0, sizeof *r);
    r->kind = k;
    return r;
}

#define REAL(rb) ((rb)->real)
#define OPT(r, i) ((r)->has[i] ? &(r)->t[i] : NULL)

static void w_embedding(struct backend *b, struct tensor *out, const struct tensor *table, const int32_t *ids) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->embedding(REAL(rb), out, table, ids);
    struct rec *r = rec_push(rb, REC_EMBED);
    r->t[0] = *out, r->t[1] = *table, r->ids = ids;
}
static void w_rmsnorm(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *w,
                      float eps) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->rmsnorm(REAL(rb), out, x, w, eps);
    struct rec *r = rec_push(rb, REC_NORM);
    r->t[0] = *out, r->t[1] = *x, r->t[2] = *w, r->f = eps;
}
static void w_add_rmsnorm(struct backend *b, struct tensor *out, struct tensor *res, const struct tensor *x,
                          const struct tensor *w, float eps) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->add_rmsnorm(REAL(rb), out, res, x, w, eps);
    struct rec *r = rec_push(rb, REC_ADD_NORM);
    r->t[0] = *out, r->t[1] = *res, r->t[3] = *w, r->f = eps;
    if (x) r->t[2] = *x, r->has[2] = true;
}
static void w_matmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                     const struct tensor *bias) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->matmul(REAL(rb), out, x, w, bias);
    struct rec *r = rec_push(rb, REC_MATMUL);
    r->t[0] = *out, r->t[1] = *x, r->w = *w;
    if (bias) r->t[3] = *bias, r->has[3] = true;
}
static void w_rope_kv_write(struct backend *b, struct tensor *q, struct tensor *k, const struct tensor *v,
                            int64_t stride, const struct rope_args *rope, struct kv_layer *kv,
                            const struct attn_metadata *md) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->rope_kv_write(REAL(rb), q, k, v, stride, rope, kv, md);
    struct rec *r = rec_push(rb, REC_ROPE);
    r->t[0] = *q, r->t[1] = *k, r->t[2] = *v, r->stride = stride, r->rope = *rope, r->kv = kv, r->md = *md;
}
static void w_attention(struct backend *b, struct tensor *out, const struct tensor *q, int64_t stride,
                        const struct kv_layer *kv, const struct attn_metadata *md, float scale, int window,
                        const struct tensor *sinks) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->attention(REAL(rb), out, q, stride, kv, md, scale, window, sinks);
    struct rec *r = rec_push(rb, REC_ATTN);
    r->t[0] = *out, r->t[1] = *q, r->stride = stride, r->kv = (struct kv_layer *)kv, r->md = *md, r->f = scale;
    r->n = window;
    if (sinks) r->t[2] = *sinks, r->has[2] = true;
}
static void w_silu_mul(struct backend *b, struct tensor *out, const struct tensor *gu) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->silu_mul(REAL(rb), out, gu);
    struct rec *r = rec_push(rb, REC_SILU);
    r->t[0] = *out, r->t[1] = *gu;
}
static void w_add(struct backend *b, struct tensor *out, const struct tensor *x) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->add(REAL(rb), out, x);
    struct rec *r = rec_push(rb, REC_ADD);
    r->t[0] = *out, r->t[1] = *x;
}
static void w_gather_rows(struct backend *b, struct tensor *out, const struct tensor *x, const int32_t *rows, int n) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->gather_rows(REAL(rb), out, x, rows, n);
    struct rec *r = rec_push(rb, REC_GATHER);
    r->t[0] = *out, r->t[1] = *x, r->ids = rows, r->n = n;
}
static void w_convert(struct backend *b, struct tensor *out, const struct tensor *x) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->convert(REAL(rb), out, x);
    struct rec *r = rec_push(rb, REC_CONVERT);
    r->t[0] = *out, r->t[1] = *x;
}

static void w_dn_conv(struct backend *b, struct tensor *out, const struct tensor *x, int64_t stride,
                      const struct tensor *w, struct kv_layer *kv, const struct attn_metadata *md) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->deltanet_conv(REAL(rb), out, x, stride, w, kv, md);
    struct rec *r = rec_push(rb, REC_DN_CONV);
    r->t[0] = *out, r->t[1] = *x, r->t[2] = *w, r->stride = stride, r->kv = kv, r->md = *md;
}
static void w_dn_rule(struct backend *b, struct tensor *out, const struct tensor *qkv, const struct tensor *ba,
                      int64_t stride, const struct tensor *a_log, const struct tensor *dt_bias, struct kv_layer *kv,
                      const struct attn_metadata *md, const struct deltanet_args *a) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->deltanet_rule(REAL(rb), out, qkv, ba, stride, a_log, dt_bias, kv, md, a);
    struct rec *r = rec_push(rb, REC_DN_RULE);
    r->t[0] = *out, r->t[1] = *qkv, r->t[2] = *ba, r->t[3] = *a_log, r->w.t = *dt_bias, r->stride = stride;
    r->kv = kv, r->md = *md, r->dn = *a;
}
static void w_gnorm(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *z,
                    int64_t stride, int heads, const struct tensor *w, float eps) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->rmsnorm_gated(REAL(rb), out, x, z, stride, heads, w, eps);
    struct rec *r = rec_push(rb, REC_GNORM);
    r->t[0] = *out, r->t[1] = *x, r->t[2] = *z, r->t[3] = *w, r->stride = stride, r->n = heads, r->f = eps;
}
static void w_gate(struct backend *b, struct tensor *x, const struct tensor *gate, int64_t stride, int cols) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->gate_sigmoid_mul(REAL(rb), x, gate, stride, cols);
    struct rec *r = rec_push(rb, REC_GATE);
    r->t[0] = *x, r->t[1] = *gate, r->stride = stride, r->n = cols;
}

static void w_moe_route(struct backend *b, const struct tensor *logits, const struct moe_route_args *a, int32_t *ids,
                        float *w) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->moe_route(REAL(rb), logits, a, ids, w);
    struct rec *r = rec_push(rb, REC_MOE_ROUTE);
    r->t[0] = *logits, r->route = *a, r->p[0] = ids, r->p[1] = w;
}
static void w_moe_experts(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gu,
                          const struct weight *down, const int32_t *ids, const float *w, int n_slots,
                          const struct moe_experts_args *ea, void *ws) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) {
        REAL(rb)->ops->moe_experts(REAL(rb), out, x, gu, down, ids, w, n_slots, ea, ws);
        return;
    }
    struct rec *r = rec_push(rb, REC_MOE_EXPERTS);
    r->t[0] = *out, r->t[1] = *x, r->w = *gu, r->w2 = *down, r->p[0] = (void *)ids, r->p[1] = (void *)w;
    r->p[2] = ws, r->n = n_slots;
    if (ea) r->ea = *ea, r->has[3] = true;
}

static void w_mla_latent_write(struct backend *b, struct tensor *q, const struct tensor *kv_a,
                               const struct tensor *norm, float eps, const struct rope_args *rope,
                               const struct mla_args *a, struct kv_layer *kv, const struct attn_metadata *md) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->mla_latent_write(REAL(rb), q, kv_a, norm, eps, rope, a, kv, md);
    struct rec *r = rec_push(rb, REC_MLA_WRITE);
    r->t[0] = *q, r->t[1] = *kv_a, r->t[2] = *norm, r->f = eps, r->rope = *rope, r->ma = *a, r->kv = kv, r->md = *md;
}
static void w_mla_attention(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                            const struct attn_metadata *md, const struct mla_args *a, void *ws) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->mla_attention(REAL(rb), out, q, kv, md, a, ws);
    struct rec *r = rec_push(rb, REC_MLA_ATTN);
    r->t[0] = *out, r->t[1] = *q, r->kv = (struct kv_layer *)kv, r->md = *md, r->ma = *a, r->p[2] = ws;
}

static void rec_replay(struct rec_backend *rb, struct rec_graph *g) {
    struct backend *b = REAL(rb);
    const struct backend_ops *o = b->ops;
    for (int i = 0; i < g->n; i++) {
        struct rec *r = &g->recs[i];
        switch (r->kind) {
        case REC_EMBED:
            o->embedding(b, &r->t[0], &r->t[1], r->ids);
            break;
        case REC_NORM:
            o->rmsnorm(b, &r->t[0], &r->t[1], &r->t[2], r->f);
            break;
        case REC_ADD_NORM:
            o->add_rmsnorm(b, &r->t[0], &r->t[1], OPT(r, 2), &r->t[3], r->f);
            break;
        case REC_MATMUL:
            o->matmul(b, &r->t[0], &r->t[1], &r->w, OPT(r, 3));
            break;
        case REC_ROPE:
            o->rope_kv_write(b, &r->t[0], &r->t[1], &r->t[2], r->stride, &r->rope, r->kv, &r->md);
            break;
        case REC_ATTN:
            o->attention(b, &r->t[0], &r->t[1], r->stride, r->kv, &r->md, r->f, r->n, OPT(r, 2));
            break;
        case REC_SILU:
            o->silu_mul(b, &r->t[0], &r->t[1]);
            break;
        case REC_ADD:
            o->add(b, &r->t[0], &r->t[1]);
            break;
        case REC_GATHER:
            o->gather_rows(b, &r->t[0], &r->t[1], r->ids, r->n);
            break;
        case REC_CONVERT:
            o->convert(b, &r->t[0], &r->t[1]);
            break;
        case REC_DN_CONV:
            o->deltanet_conv(b, &r->t[0], &r->t[1], r->stride, &r->t[2], r->kv, &r->md);
            break;
        case REC_DN_RULE:
            o->deltanet_rule(b, &r->t[0], &r->t[1], &r->t[2], r->stride, &r->t[3], &r->w.t, r->kv, &r->md, &r->dn);
            break;
        case REC_GNORM:
            o->rmsnorm_gated(b, &r->t[0], &r->t[1], &r->t[2], r->stride, r->n, &r->t[3], r->f);
            break;
        case REC_GATE:
            o->gate_sigmoid_mul(b, &r->t[0], &r->t[1], r->stride, r->n);
            break;
        case REC_MOE_ROUTE:
            o->moe_route(b, &r->t[0], &r->route, r->p[0], r->p[1]);
            break;
        case REC_MLA_WRITE:
            o->mla_latent_write(b, &r->t[0], &r->t[1], &r->t[2], r->f, &r->rope, &r->ma, r->kv, &r->md);
            break;
        case REC_MLA_ATTN:
            o->mla_attention(b, &r->t[0], &r->t[1], r->kv, &r->md, &r->ma, r->p[2]);
            break;
        case REC_MOE_EXPERTS:
            o->moe_experts(b, &r->t[0], &r->t[1], &r->w, &r->w2, r->p[0], r->p[1], r->n, r->has[3] ? &r->ea : NULL,
                           r->p[2]);
            break;
        case REC_COPY_D2D:
            o->copy_d2d(b, r->p[0], r->p[1], r->bytes);
            break;
        case REC_ZERO:
            o->memset_zero(b, r->p[0], r->bytes);
            break;
        }
    }
}

static atomc_status w_graph_begin(struct backend *b, struct error *err) {
    struct rec_backend *rb = rb_of(b);
    if (rb->capturing) return error_set(err, ATOMC_ERR_INTERNAL, "nested capture");
    rb->capturing = calloc(1, sizeof(struct rec_graph));
    return ATOMC_OK;
}
static atomc_status w_graph_end(struct backend *b, void **graph, struct error *err) {
    struct rec_backend *rb = rb_of(b);
    *graph = rb->capturing;
    rb->capturing = NULL;
    rb->n_captured++;
    return ATOMC_OK;
}
static atomc_status w_graph_launch(struct backend *b, void *graph, struct error *err) {
    struct rec_backend *rb = rb_of(b);
    rec_replay(rb, graph);
    rb->n_launched++;
    return ATOMC_OK;
}
static void w_graph_destroy(struct backend *b, void *graph) {
    struct rec_graph *g = graph;
    if (g) free(g->recs);
    free(g);
}

// Memory and sampling go straight to the real backend. Device-to-device copies and zero fills
// issued during a capture are recorded (CUDA stream capture makes cudaMemcpyAsync /
// cudaMemsetAsync graph nodes: the EAGLE-3 aux capture of the Llama forward is such a copy);
// a host transfer, a synchronization or a sampling call inside a capture would not be replayed
// here (and CUDA refuses or freezes them), so it aborts the test.
static void w_destroy(struct backend *b) {
    struct rec_backend *rb = rb_of(b);
    backend_destroy(rb->real);
    free(rb);
}
static void *w_alloc(struct backend *b, size_t n) {
    return REAL(rb_of(b))->ops->alloc(REAL(rb_of(b)), n);
}
static void w_free(struct backend *b, void *p) {
    REAL(rb_of(b))->ops->free(REAL(rb_of(b)), p);
}
static void w_h2d(struct backend *b, void *d, const void *s, size_t n) {
    CHECK_MSG(!rb_of(b)->capturing, "copy_h2d inside a graph capture");
    REAL(rb_of(b))->ops->copy_h2d(REAL(rb_of(b)), d, s, n);
}
static void w_d2h(struct backend *b, void *d, const void *s, size_t n) {
    CHECK_MSG(!rb_of(b)->capturing, "copy_d2h inside a graph capture");
    REAL(rb_of(b))->ops->copy_d2h(REAL(rb_of(b)), d, s, n);
}
static void w_d2d(struct backend *b, void *d, const void *s, size_t n) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->copy_d2d(REAL(rb), d, s, n);
    struct rec *r = rec_push(rb, REC_COPY_D2D);
    r->p[0] = d, r->p[1] = (void *)s, r->bytes = n;
}
static void w_zero(struct backend *b, void *d, size_t n) {
    struct rec_backend *rb = rb_of(b);
    if (!rb->capturing) return REAL(rb)->ops->memset_zero(REAL(rb), d, n);
    struct rec *r = rec_push(rb, REC_ZERO);
    r->p[0] = d, r->bytes = n;
}
static void w_sync(struct backend *b) {
    CHECK_MSG(!rb_of(b)->capturing, "synchronize inside a graph capture");
    REAL(rb_of(b))->ops->synchronize(REAL(rb_of(b)));
}
static void w_meminfo(struct backend *b, size_t *f, size_t *t) {
    REAL(rb_of(b))->ops->memory_info(REAL(rb_of(b)), f, t);
}
static atomc_status w_upload(struct backend *b, struct tensor *d, const struct tensor *s, struct error *e) {
    return REAL(rb_of(b))->ops->upload_weight(REAL(rb_of(b)), d, s, e);
}
static void w_sample(struct backend *b, const struct sample_args *a) {
    CHECK_MSG(!rb_of(b)->capturing, "sample inside a graph capture");
    REAL(rb_of(b))->ops->sample(REAL(rb_of(b)), a);
}

static struct rec_backend *rec_backend_create(void) {
    struct backend_options bo = {.num_threads = 2};
    struct backend *real = NULL;
    struct error err = {0};
    if (backend_create("cpu", &bo, &real, &err) != ATOMC_OK) return NULL;
    struct rec_backend *rb = calloc(1, sizeof *rb);
    rb->real = real;
    rb->pub = *real;
    rb->ops = (struct backend_ops){
        .name = "cpu+recorded-graphs",
        .destroy = w_destroy,
        .alloc = w_alloc,
        .free = w_free,
        .copy_h2d = w_h2d,
        .copy_d2h = w_d2h,
        .copy_d2d = w_d2d,
        .memset_zero = w_zero,
        .synchronize = w_sync,
        .memory_info = w_meminfo,
        .upload_weight = w_upload,
        .embedding = w_embedding,
        .rmsnorm = w_rmsnorm,
        .add_rmsnorm = w_add_rmsnorm,
        .matmul = w_matmul,
        .rope_kv_write = w_rope_kv_write,
        .attention = w_attention,
        .silu_mul = w_silu_mul,
        .add = w_add,
        .gather_rows = w_gather_rows,
        .convert = w_convert,
        .sample = w_sample,
        .graph_begin = w_graph_begin,
        .graph_end = w_graph_end,
        .graph_launch = w_graph_launch,
        .graph_destroy = w_graph_destroy,
        .moe_route = w_moe_route,
        .moe_experts = w_moe_experts,
        .mla_latent_write = w_mla_latent_write,
        .mla_attention = w_mla_attention,
        .deltanet_conv = w_dn_conv,
        .deltanet_rule = w_dn_rule,
        .rmsnorm_gated = w_gnorm,
        .gate_sigmoid_mul = w_gate,
    };
    rb->pub.ops = &rb->ops;
    return rb;
}

static struct model_runner *open_runner_groups(const char *model, struct backend *b, bool eager, bool groups) {
    char path[4096];
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", model);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .block_size = 4,
        .num_kv_blocks = 256,
        .max_num_seqs = 8,
        .max_num_batched_tokens = 128,
        .max_model_len = 128,
        .num_threads = 2,
        .enforce_eager = eager,
        .backend = b,
        .hybrid_kv_groups = groups,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  create: %s\n", err.msg);
    return r;
}

static struct model_runner *open_runner(const char *model, struct backend *b, bool eager) {
    return open_runner_groups(model, b, eager, false);
}

// Runs the same schedule on a graph runner and an eager runner: prefill of `n` prompts, then
// decode steps with a varying number of live sequences (so buckets 1, 2, 4 and 8 are used
// with padding), sometimes asking logits of only some sequences. Logits must agree. groups:
// per-layer-group block tables (hybrid models: the sliding layers' own pool and metadata).
static void run_schedule_groups(const char *model, bool groups) {
    struct rec_backend *rb = rec_backend_create();
    ASSERT_TRUE(rb != NULL);
    struct model_runner *rg = open_runner_groups(model, &rb->pub, false, groups);
    struct model_runner *re = open_runner_groups(model, NULL, true, groups);
    ASSERT_EQ(model_runner_kv_groups(rg, NULL, NULL), groups);
    ASSERT_TRUE(rg != NULL && re != NULL);
    ASSERT_EQ(model_runner_num_graphs(rg), 4); // buckets 1, 2, 4, 8
    ASSERT_EQ(model_runner_num_graphs(re), 0);
    const int V = model_runner_config(rg)->vocab_size;
    enum { N = 7 };
    struct sim *sg = malloc(sizeof *sg), *se = malloc(sizeof *se);
    sim_init(sg, rg, 123u);
    sim_init(se, re, 123u);
    struct sim_seq *qg = calloc(N, sizeof *qg), *qe = calloc(N, sizeof *qe);
    for (int i = 0; i < N; i++) {
        int32_t ids[40];
        for (int k = 0; k < 3 + 5 * i; k++)
            ids[k] = (int32_t)((i * 37 + k * 11) % (V - 4) + 4);
        sim_seq_init(&qg[i], ids, 3 + 5 * i);
        sim_seq_init(&qe[i], ids, 3 + 5 * i);
        qg[i].state_slot = qe[i].state_slot = (i + 3) % N; // recurrent models: a slot per sequence
    }
    float *lg = malloc(sizeof(float) * 8 * (size_t)V), *le = malloc(sizeof(float) * 8 * (size_t)V);
    struct error err = {0};
    // Prefill everyone (eager on both: not decode-only).
    for (int i = 0; i < N; i++) {
        sim_step_begin(sg);
        sim_step_begin(se);
        ASSERT_EQ(sim_step_add(sg, &qg[i], qg[i].n_ids, 1), 0);
        ASSERT_EQ(sim_step_add(se, &qe[i], qe[i].n_ids, 1), 0);
        struct forward_batch fg = sim_step_batch(sg), fe = sim_step_batch(se);
        ASSERT_OK(model_runner_execute_logits(rg, &fg, lg, &err));
        ASSERT_OK(model_runner_execute_logits(re, &fe, le, &err));
        sim_step_commit(sg);
        sim_step_commit(se);
        int best = 0;
        for (int v = 1; v < V; v++)
            best = le[v] > le[best] ? v : best;
        qg[i].ids[qg[i].n_ids++] = best;
        qe[i].ids[qe[i].n_ids++] = best;
    }
    ASSERT_EQ(model_runner_num_graph_replays(rg), 0);
    // Decode: live sets of sizes 3, 1, 7, 2, 5, 4, 6 (each padded to its bucket), two rounds.
    static const int live[] = {3, 1, 7, 2, 5, 4, 6, 3, 1, 7, 2, 5, 4, 6};
    double worst = 0;
    for (size_t st = 0; st < sizeof live / sizeof live[0]; st++) {
        int n = live[st];
        sim_step_begin(sg);
        sim_step_begin(se);
        for (int j = 0; j < n; j++) {
            int i = (int)((j * 3 + st) % N); // a different subset / order each step
            bool dup = false;
            for (int k = 0; k < sg->n_seqs; k++)
                dup |= sg->seqs[k] == &qg[i];
            if (dup) continue;
            ASSERT_EQ(sim_step_add(sg, &qg[i], 1, 1), 0);
            ASSERT_EQ(sim_step_add(se, &qe[i], 1, 1), 0);
        }
        struct forward_batch fg = sim_step_batch(sg), fe = sim_step_batch(se);
        if (st % 4 == 3 && fg.n_logits > 1) { // only some rows: the replay must recompute them
            sg->rows[0] = sg->rows[fg.n_logits - 1];
            se->rows[0] = se->rows[fe.n_logits - 1];
            fg.n_logits = fe.n_logits = 1;
        }
        uint64_t before = model_runner_num_graph_replays(rg);
        ASSERT_OK(model_runner_execute_logits(rg, &fg, lg, &err));
        ASSERT_OK(model_runner_execute_logits(re, &fe, le, &err));
        ASSERT_EQ(model_runner_num_graph_replays(rg), before + 1);
        sim_step_commit(sg);
        sim_step_commit(se);
        for (int k = 0; k < fe.n_logits * V; k++) {
            double d = fabs((double)lg[k] - le[k]);
            if (!(d <= worst)) worst = d;
        }
        // Every live sequence advances by its own greedy token (from the eager runner's
        // logits where available, else a fixed token), identically in both simulations.
        for (int k = 0; k < sg->n_seqs; k++) {
            int32_t t = 5;
            if (k < fe.n_logits && fe.n_logits == sg->n_seqs) {
                int best = 0;
                for (int v = 1; v < V; v++)
                    best = le[(size_t)k * V + v] > le[(size_t)k * V + best] ? v : best;
                t = best;
            }
            sg->seqs[k]->ids[sg->seqs[k]->n_ids++] = t;
            se->seqs[k]->ids[se->seqs[k]->n_ids++] = t;
        }
    }
    fprintf(stderr, "  %s: %d graphs, %llu replays, max |logit graph - eager| = %.2e\n", model,
            model_runner_num_graphs(rg), (unsigned long long)model_runner_num_graph_replays(rg), worst);
    ASSERT_TRUE(worst <= 1e-4);
    ASSERT_EQ(rb->n_launched, (int)(sizeof live / sizeof live[0]));
    free(lg);
    free(le);
    free(qg);
    free(qe);
    sim_free(sg);
    sim_free(se);
    free(sg);
    free(se);
    model_runner_free(rg);
    model_runner_free(re);
}

static void run_schedule(const char *model) {
    run_schedule_groups(model, false);
}

TEST(graphs_replay_equals_eager_llama) {
    run_schedule("llama_gqa");
}
TEST(graphs_replay_equals_eager_gpt_oss_kv_groups) {
    run_schedule_groups("gpt_oss", true);
}
TEST(graphs_replay_equals_eager_qwen3) {
    run_schedule("qwen3");
}
// Recurrent state under graphs: padding sequences write the dummy slot, every real one its own.
TEST(graphs_replay_equals_eager_qwen3_next) {
    run_schedule("qwen3_next");
}

// MLA over the latent cache, shared experts and grouped routing under recorded graphs (frozen
// arguments: mla_args, the route's per-layer correction bias, padded slots, re-strided tables).
TEST(graphs_replay_equals_eager_deepseek_v2) {
    run_schedule("deepseek_v2");
}
TEST(graphs_replay_equals_eager_deepseek_v3) {
    run_schedule("deepseek_v3");
}
TEST(graphs_replay_equals_eager_qwen3_moe) {
    run_schedule("qwen3_moe");
}

// Batches that are not decode-only, or larger than every bucket, run eagerly.
TEST(graphs_not_used_for_prefill) {
    struct rec_backend *rb = rec_backend_create();
    ASSERT_TRUE(rb != NULL);
    struct model_runner *r = open_runner("llama_gqa", &rb->pub, false);
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 1u);
    int32_t ids[4] = {4, 5, 6, 7};
    struct sim_seq *q = calloc(2, sizeof *q);
    sim_seq_init(&q[0], ids, 4);
    sim_seq_init(&q[1], ids, 2);
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, &q[0], 4, 1), 0);
    struct forward_batch fb = sim_step_batch(s);
    struct runner_output out;
    struct error err = {0};
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    sim_step_commit(s);
    q[0].ids[q[0].n_ids++] = out.ids[0];
    // One decode token mixed with a prefill: eager.
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, &q[0], 1, 1), 0);
    ASSERT_EQ(sim_step_add(s, &q[1], 2, 1), 0);
    fb = sim_step_batch(s);
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    ASSERT_EQ(model_runner_num_graph_replays(r), 0);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
}

// ---------------------------------------------------------------------------------------------
// Verify graphs (speculative steps of 1 + k tokens per sequence, runner_graphs.c) under recorded
// graphs against an eager runner: every step, each live sequence carries its last token and
// 0..k "drafts" (arbitrary ids), logits at every row; a random number of them is accepted (the
// sequence's cache then keeps only those, as after the engine's verification, so rejected slots
// are overwritten later). Steps where no sequence drafts are decode steps (decode graphs). With an
// MTP model, every step is followed by an MTP pass over the step's rows reading the hidden states
// through the verify graph's padded rows.

// eagle3: with the tiny_eagle3 head (llama_gqa only).
static struct model_runner *open_spec_runner_head(const char *model, struct backend *b, bool eager, bool groups,
                                                  bool mtp, bool eagle3) {
    char path[4096], head[4096] = "";
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", model);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    if (eagle3) snprintf(head, sizeof head, "%s", test_fixture("tiny_eagle3"));
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .block_size = 4,
        .num_kv_blocks = 256,
        .max_num_seqs = 8,
        .max_num_batched_tokens = 128,
        .max_logits_rows = 8 * (1 + SG_K),
        .max_model_len = 128,
        .num_threads = 2,
        .enforce_eager = eager,
        .backend = b,
        .hybrid_kv_groups = groups,
        .num_speculative_tokens = SG_K,
        .load_mtp = mtp,
        .eagle3_path = eagle3 ? head : NULL,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  create: %s\n", err.msg);
    return r;
}

static struct model_runner *open_spec_runner(const char *model, struct backend *b, bool eager, bool groups, bool mtp) {
    return open_spec_runner_head(model, b, eager, groups, mtp, false);
}

// tests/spec_graph_schedule.h under recorded graphs: fp32, so graph and eager agree to rounding
// (the padded batch changes only summation order), and the MTP / EAGLE-3 drafts are the same ids.
static void run_verify_schedule_head(const char *model, bool groups, bool mtp, bool eagle3) {
    struct rec_backend *rb = rec_backend_create();
    ASSERT_TRUE(rb != NULL);
    struct model_runner *rg = open_spec_runner_head(model, &rb->pub, false, groups, mtp, eagle3);
    struct model_runner *re = open_spec_runner_head(model, NULL, true, groups, mtp, eagle3);
    ASSERT_TRUE(rg != NULL && re != NULL);
    ASSERT_EQ(model_runner_num_graphs(rg), 4);        // decode buckets 1, 2, 4, 8
    ASSERT_EQ(model_runner_num_verify_graphs(rg), 4); // verify buckets 1, 2, 4, 8 of 1 + k = 4 tokens each
    ASSERT_EQ(model_runner_num_verify_graphs(re), 0);
    ASSERT_EQ(model_runner_num_mtp_graphs(rg), mtp ? 8 : 0); // MTP first-pass and chain buckets 1, 2, 4, 8
    struct sg_result res = sg_run(rg, re, mtp || eagle3, 0);
    fprintf(stderr,
            "  %s: %d decode + %d verify graphs, %d verify / %d decode steps (%d sequence-steps with fewer drafts "
            "than k), max |logit graph - eager| = %.2e, MTP chain logits %.2e (%llu MTP chain replays), %d MTP "
            "draft chains differ\n",
            model, model_runner_num_graphs(rg), model_runner_num_verify_graphs(rg), res.n_verify, res.n_decode,
            res.n_short, res.worst, res.worst_mtp, (unsigned long long)model_runner_num_mtp_graph_replays(rg),
            res.draft_diff);
    ASSERT_TRUE(!res.failed);
    ASSERT_TRUE(res.worst <= 1e-4);
    ASSERT_TRUE(res.worst_mtp <= 1e-4);
    ASSERT_EQ(res.draft_mismatch, 0);
    ASSERT_TRUE(res.n_verify >= 8 && res.n_decode >= 4 && res.n_short >= 4);
    if (mtp) ASSERT_TRUE(model_runner_num_mtp_graph_replays(rg) >= (uint64_t)res.n_verify + res.n_decode);
    ASSERT_EQ((uint64_t)rb->n_launched, res.n_verify + res.n_decode + model_runner_num_mtp_graph_replays(rg));
    model_runner_free(rg);
    model_runner_free(re);
}

static void run_verify_schedule(const char *model, bool groups, bool mtp) {
    run_verify_schedule_head(model, groups, mtp, false);
}

TEST(verify_graphs_replay_equals_eager_llama) {
    run_verify_schedule("llama_gqa", false, false);
}
TEST(verify_graphs_replay_equals_eager_gpt_oss_kv_groups) {
    run_verify_schedule("gpt_oss", true, false);
}
TEST(verify_graphs_replay_equals_eager_mistral_sliding) {
    run_verify_schedule("mistral_sliding", false, false);
}
TEST(verify_graphs_replay_equals_eager_deepseek_v3) {
    run_verify_schedule("deepseek_v3", false, false);
}
TEST(verify_graphs_replay_equals_eager_qwen3_moe) {
    run_verify_schedule("qwen3_moe", false, false);
}
// MTP drafts after verify replays read the target's hidden states through the padded rows.
TEST(verify_graphs_mtp_hidden_rows_equal_eager) {
    run_verify_schedule("deepseek_v3_mtp", false, true);
}
// EAGLE-3 drafts after verify replays read the aux states the verify graphs captured (device
// copies inside the graph) through the padded rows: the head's logits and drafts equal eager's.
TEST(verify_graphs_eagle3_aux_rows_equal_eager) {
    run_verify_schedule_head("llama_gqa", false, false, true);
}

// Verify steps that do not fit the verify graphs run eagerly: a prefill chunk in the step (not
// every row sampled), more than 1 + k tokens for a sequence; recurrent models get no verify graphs.
TEST(verify_graphs_not_used_for_mixed_steps) {
    struct rec_backend *rb = rec_backend_create();
    ASSERT_TRUE(rb != NULL);
    struct model_runner *r = open_spec_runner("llama_gqa", &rb->pub, false, false, false);
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 1u);
    int32_t ids[12] = {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    struct sim_seq *q = calloc(2, sizeof *q);
    sim_seq_init(&q[0], ids, 12);
    sim_seq_init(&q[1], ids, 6);
    int32_t rows[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    struct sample_row samp[16];
    for (int i = 0; i < 16; i++)
        samp[i] = (struct sample_row){.top_p = 1, .repetition_penalty = 1};
    struct runner_output out;
    struct error err = {0};
    // q0: 5 tokens (more than 1 + k), every row sampled: eager.
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, &q[0], 5, 0), 0);
    struct forward_batch fb = sim_step_batch(s);
    fb.n_logits = fb.n_tokens, fb.logits_rows = rows, fb.sampling = samp;
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    sim_step_commit(s);
    // q0: 2 tokens (a verify row set) next to q1's 4-token prefill chunk with its last row only.
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, &q[0], 2, 1), 0);
    ASSERT_EQ(sim_step_add(s, &q[1], 4, 1), 0);
    fb = sim_step_batch(s);
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    sim_step_commit(s);
    ASSERT_EQ(model_runner_num_graph_replays(r), 0);
    // Now a real verify step of both (4 and 2 tokens, every row): replayed.
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, &q[0], 4, 0), 0);
    ASSERT_EQ(sim_step_add(s, &q[1], 2, 0), 0);
    fb = sim_step_batch(s);
    fb.n_logits = fb.n_tokens, fb.logits_rows = rows, fb.sampling = samp;
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    ASSERT_EQ(model_runner_num_verify_graph_replays(r), 1);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
    struct rec_backend *rb2 = rec_backend_create();
    struct model_runner *rn = open_spec_runner("qwen3_next", &rb2->pub, false, false, false);
    ASSERT_TRUE(rn != NULL);
    ASSERT_EQ(model_runner_num_verify_graphs(rn), 0);
    ASSERT_TRUE(model_runner_num_graphs(rn) > 0);
    model_runner_free(rn);
}

// ---------------------------------------------------------------------------------------------
// The engine on a runner with recorded graphs: greedy output with ngram / mtp / eagle3 drafts, graphs vs
// enforce_eager, on a pool that forces preemption (and one that does not); verify steps, the MTP
// passes and decode steps replay graphs (verify-replay and MTP-replay counters > 0), every
// output is token-identical to the eager engine's (fp32: up to a near tie below 1e-4), and the
// speculation counters (drafts, draft tokens, accepted per position) and the steps are the eager
// run's: a drafter reading other inputs after a replay (stale EAGLE-3 aux states, wrong padded
// rows) still gives exact output but different drafts.

static atomc_status eg_execute(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                               struct error *err) {
    return model_runner_execute(ctx, fb, out, err);
}
static void eg_free(void *ctx) {
    model_runner_free(ctx);
}
static uint64_t eg_replays(void *ctx) {
    return model_runner_num_graph_replays(ctx);
}
static atomc_status eg_draft(void *ctx, const struct draft_batch *db, int32_t *drafts, struct error *err) {
    return model_runner_draft(ctx, db, drafts, err);
}

enum { EG_SEQS = 8, EG_BUDGET = 64, EG_K = 3 };

// An engine over runner r (owned by the engine from here) with method ngram, mtp or eagle3, k = EG_K.
static atomc_engine *eg_engine(struct model_runner *r, const char *method) {
    const bool ngram = !strcmp(method, "ngram");
    struct engine_setup su;
    memset(&su, 0, sizeof su);
    su.model = (struct engine_model_ops){.ctx = r,
                                         .execute = eg_execute,
                                         .free = eg_free,
                                         .graph_replays = eg_replays,
                                         .draft = ngram ? NULL : eg_draft};
    su.num_kv_blocks = model_runner_num_kv_blocks(r);
    su.vocab_size = model_runner_config(r)->vocab_size;
    su.max_model_len = model_runner_max_model_len(r);
    su.sliding_window = model_runner_sliding_window(r);
    su.info.model_name = su.info.architecture = "fixture";
    su.info.default_temperature = su.info.default_top_k = su.info.default_min_p = -1;
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = model_runner_block_size(r);
    o.max_num_seqs = EG_SEQS;
    o.max_num_batched_tokens = EG_BUDGET;
    o.enable_prefix_caching = true;
    o.speculative_method = method;
    static char head[4096];
    if (!strcmp(method, "eagle3")) snprintf(head, sizeof head, "%s", test_fixture("tiny_eagle3"));
    o.speculative_model = !strcmp(method, "eagle3") ? head : NULL;
    o.num_speculative_tokens = EG_K;
    o.prompt_lookup_min = ngram ? 1 : 0;
    o.prompt_lookup_max = ngram ? 3 : 0;
    o.speculative_disable_by_batch_size = -1;
    atomc_engine *e = NULL;
    struct error err = {0};
    CHECK_MSG(engine_create_with(&o, &su, &e, &err) == ATOMC_OK, "%s", err.msg);
    return e;
}

static struct model_runner *eg_runner(const char *model, struct backend *b, bool eager, const char *method,
                                      int num_blocks) {
    char rel[256], path[4096], head[4096] = "";
    snprintf(rel, sizeof rel, "models/%s", model);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    if (!strcmp(method, "eagle3")) snprintf(head, sizeof head, "%s", test_fixture("tiny_eagle3"));
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .block_size = 4,
        .num_kv_blocks = num_blocks,
        .max_num_seqs = EG_SEQS,
        .max_num_batched_tokens = EG_BUDGET,
        .max_logits_rows = EG_SEQS * (1 + EG_K),
        .max_model_len = 128,
        .num_threads = 2,
        .enforce_eager = eager,
        .backend = b,
        .num_speculative_tokens = EG_K,
        .load_mtp = !strcmp(method, "mtp"),
        .eagle3_path = *head ? head : NULL,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  create: %s\n", err.msg);
    return r;
}

static void engine_graphs_equal_eager(const char *model, const char *method, int num_blocks, bool preempt) {
    const bool mtp = !strcmp(method, "mtp");
    json_t *refs = es_load_refs(model);
    json_t *prompts = json_object_get(refs, "prompts");
    enum { MAXP = 16, MAXT = 24 };
    static int32_t ids[MAXP][128];
    int n_ids[MAXP], n_p = 0;
    for (size_t i = 0; i < json_array_size(prompts) && n_p + 1 < MAXP; i++) {
        int n = es_json_ids(json_object_get(json_array_get(prompts, i), "ids"), ids[n_p], 40);
        n_ids[n_p++] = n;
        memcpy(ids[n_p], ids[n_p - 1], (size_t)n * 4); // the prompt twice: ngram drafts get accepted
        memcpy(ids[n_p] + n, ids[n_p - 1], (size_t)n * 4);
        n_ids[n_p++] = 2 * n;
    }
    json_decref(refs);
    static struct es_out out[2][MAXP];
    uint64_t vrep = 0, mrep = 0;
    atomc_stats sst[2]; // graphs, eager
    for (int eager = 0; eager < 2; eager++) {
        struct rec_backend *rb = eager ? NULL : rec_backend_create();
        struct model_runner *r = eg_runner(model, rb ? &rb->pub : NULL, eager, method, num_blocks);
        ASSERT_TRUE(r != NULL);
        atomc_engine *e = eg_engine(r, method);
        for (int i = 0; i < n_p; i++)
            es_add(e, ids[i], n_ids[i], MAXT, &out[eager][i], NULL);
        es_run(e);
        atomc_stats st;
        atomc_engine_get_stats(e, &st);
        fprintf(stderr,
                "  %s %s%s: %d prompts, %llu steps, %llu preemptions, %llu graph replays (%llu verify, %llu MTP)%s\n",
                model, method, eager ? " (eager)" : "", n_p, (unsigned long long)st.num_steps,
                (unsigned long long)st.num_preemptions, (unsigned long long)model_runner_num_graph_replays(r),
                (unsigned long long)model_runner_num_verify_graph_replays(r),
                (unsigned long long)model_runner_num_mtp_graph_replays(r), es_spec_line(e));
        ASSERT_TRUE(st.spec_num_accepted_tokens > 0);
        if (preempt) ASSERT_TRUE(st.num_preemptions > 0);
        ASSERT_EQ(st.num_free_kv_blocks, num_blocks);
        sst[eager] = st;
        if (!eager) {
            vrep = model_runner_num_verify_graph_replays(r);
            mrep = model_runner_num_mtp_graph_replays(r);
        } else {
            ASSERT_EQ(model_runner_num_graph_replays(r), 0);
        }
        atomc_engine_free(e); // frees r
    }
    ASSERT_TRUE(vrep > 0);
    if (mtp) ASSERT_TRUE(mrep > 0);
    ASSERT_TRUE(sst[0].spec_num_draft_tokens < sst[0].spec_num_drafts * EG_K); // some carried fewer than k
    // The drafters see the same inputs under graphs (the verified rows' hidden / aux states through
    // the padded rows) and are argmax, so the drafts, and with them the schedule, are the eager run's.
    ASSERT_EQ(sst[0].spec_num_drafts, sst[1].spec_num_drafts);
    ASSERT_EQ(sst[0].spec_num_draft_tokens, sst[1].spec_num_draft_tokens);
    ASSERT_EQ(sst[0].spec_num_accepted_tokens, sst[1].spec_num_accepted_tokens);
    for (int i = 0; i < EG_K; i++)
        ASSERT_EQ(sst[0].spec_accepted_per_pos[i], sst[1].spec_accepted_per_pos[i]);
    ASSERT_EQ(sst[0].num_steps, sst[1].num_steps);
    ASSERT_EQ(sst[0].num_preemptions, sst[1].num_preemptions);
    for (int i = 0; i < n_p; i++) {
        ASSERT_EQ(out[0][i].n, MAXT);
        int same = es_compare(&out[1][i], &out[0][i], 1e-4f, NULL);
        if (same < 0) {
            test_fail(__FILE__, __LINE__, "%s prompt %d: graphs and eager differ", model, i);
            return;
        }
        for (int t = 0; t < same; t++)
            ASSERT_NEAR(out[0][i].lp[t], out[1][i].lp[t], 1e-4);
    }
}

TEST(engine_verify_graphs_equal_eager_ngram) {
    engine_graphs_equal_eager("llama_gqa", "ngram", 256, false);
}
TEST(engine_verify_graphs_equal_eager_ngram_preemption) {
    engine_graphs_equal_eager("llama_gqa", "ngram", 40, true);
}
TEST(engine_verify_graphs_equal_eager_mtp) {
    engine_graphs_equal_eager("deepseek_v3_mtp", "mtp", 256, false);
}
TEST(engine_verify_graphs_equal_eager_mtp_preemption) {
    engine_graphs_equal_eager("deepseek_v3_mtp", "mtp", 40, true);
}
// EAGLE-3: the head reads the aux states the target's verify graphs captured, through the padded rows.
TEST(engine_verify_graphs_equal_eager_eagle3) {
    engine_graphs_equal_eager("llama_gqa", "eagle3", 256, false);
}
TEST(engine_verify_graphs_equal_eager_eagle3_preemption) {
    engine_graphs_equal_eager("llama_gqa", "eagle3", 40, true);
}

// The engine issue's random stress (tests/engine_model_scenarios.h, the settings of
// tests/gpu/test_cuda_engine.c's qwen3_next case: 6 sequences, budget 16, 24 blocks of 4) on the
// recorded-graph CPU backend: decode steps replay graphs with padding sequences in the dummy
// state slot, mixed and prefill steps run eagerly, and every finished request must equal its
// prompt run alone on the plain CPU backend exactly (fp32).
static struct backend *rec_backend_make(void) {
    struct rec_backend *rb = rec_backend_create();
    return rb ? &rb->pub : NULL;
}

TEST(engine_recorded_graphs_qwen3_next_random_stress_equals_alone) {
    static const struct es_setup REC = {.device = "cpu",
                                        .margin_tol = 1e-4f,
                                        .lp_tol = 1e-3f,
                                        .lp_tol_cached = 1e-4f,
                                        .min_clear = 0.5,
                                        .make_backend = rec_backend_make};
    es_random_stress_equals_alone(&REC, "qwen3_next", 0x51ab1e5ull, 24);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
