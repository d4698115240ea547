// The shared blocks (blocks.h): pre-norm GQA attention over the paged cache, the dense MLP, the
// MoE block, the final norm + logits. Per block, for T new tokens (prefill chunks and decode
// tokens mixed):
//
//   attention (GQA):  x = rmsnorm(residual += h)            (add_rmsnorm; the first block only norms)
//                     qkv = x @ Wqkv^T (+ b)                 (one fused GEMM)
//                     Qwen3: q, k = per-head rmsnorm(q, k)   (inside rope_kv_write)
//                     rope(q, k); write k, v into the paged cache at slot_mapping
//                     attn = paged_attention(q, cache)      (window: sliding-window layers;
//                                                            GPT-OSS: per-head sinks)
//                     h = attn @ Wo^T (+ b)
//   dense MLP:        x = rmsnorm(residual += h); h = down(silu(gate) * up)   (fused gate_up GEMM)
//   MoE:              x = rmsnorm(residual += h); logits = x @ W_router^T (+ b) (F32);
//                     ids, w = moe_route(logits); h = moe_experts(x, ids, w)
//                     (GPT-OSS: clamped SwiGLU and expert biases, struct moe_experts_args)
//   logits rows only: gather residual and h rows, add_rmsnorm with the final norm, lm_head
//
// Tensor parallelism (m->tp_size > 1, see model.h and src/parallel/): the same code runs on
// every rank with local head / intermediate counts in m->cfg; h is all-reduced after o_proj
// and after down_proj (row-parallel), and the vocab-parallel lm_head's logits are all-gathered.
//
// Q, K and V stay inside the fused qkv buffer: the RoPE/KV-write and attention ops take the
// row stride, so no copies.
#include "model/blocks.h"

#include <math.h>
#include <stddef.h>

#include "model/arch.h"

#include "common/check.h"
#include "parallel/comm.h"

static inline struct tensor view2(void *data, enum dtype dt, int64_t rows, int64_t cols) {
    return tensor_2d(data, dt, rows, cols);
}

static inline struct tensor view3(void *data, enum dtype dt, int64_t a, int64_t b, int64_t c) {
    int64_t ne[3] = {a, b, c};
    return tensor_make(data, dt, 3, ne);
}

static inline const struct tensor *opt(const struct tensor *t) {
    return t->data ? t : NULL;
}

// Tensor parallelism: sums a row-parallel output over the ranks (in place, backend memory).
static void model_tp_all_reduce(struct model *m, struct tensor *t) {
    if (!m->comm || m->comm_status != ATOMC_OK) return;
    m->comm_status = comm_all_reduce_sum(m->comm, t->data, t->dtype, (size_t)tensor_numel(t), &m->comm_err);
}

void fwd_begin(struct model *m, struct fwd_state *f, const struct attn_metadata *md) {
    struct backend *b = m->backend;
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->scratch;
    const int64_t T = md->n_tokens, H = c->hidden_size, D = c->head_dim, I = c->intermediate_size;
    const int64_t hq = c->num_heads, hk = c->num_kv_heads;
    CHECK_MSG(T > 0 && T <= s->max_tokens, "forward of %lld tokens, scratch holds %d", (long long)T, s->max_tokens);
    const enum dtype dt = b->act_dtype;
    const size_t e = dtype_row_bytes(dt, 1);
    char *qkv_base = s->qkv;
    *f = (struct fwd_state){
        .T = T,
        .first = true,
        .residual = view2(s->residual, dt, T, H),
        .x = view2(s->x, dt, T, H),
        .h = view2(s->h, dt, T, H),
        .qkv = view2(s->qkv, dt, T, m->qkv_dim),
        .q = view3(qkv_base, dt, T, hq, D),
        .k = view3(qkv_base + (size_t)m->q_dim * e, dt, T, hk, D),
        .v = view3(qkv_base + (size_t)(m->q_dim + m->kv_dim) * e, dt, T, hk, D),
        .attn = view3(s->attn, dt, T, hq, D),
        .attn2 = view2(s->attn, dt, T, m->q_dim),
        .gu = view2(s->gate_up, dt, T, 2 * I),
        .act = view2(s->act, dt, T, I),
        .rope = m->rope,
    };
    f->rope.norm_eps = c->rms_norm_eps;
}

void block_embed(struct model *m, struct fwd_state *f, const int32_t *token_ids) {
    m->backend->ops->embedding(m->backend, &f->residual, &m->embed, token_ids);
}

static void attention_gqa(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                          const struct attn_metadata *md_all) {
    const struct attn_metadata *md = model_layer_metadata(ly, md_all);
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct attn_gqa_weights *w = &ly->attn.gqa;
    const float scale = 1.0f / sqrtf((float)m->cfg.head_dim);
    ops->matmul(b, &f->qkv, &f->x, &w->qkv, opt(&w->qkv_bias));
    f->rope.q_norm = opt(&w->q_norm);
    f->rope.k_norm = opt(&w->k_norm);
    ops->rope_kv_write(b, &f->q, &f->k, &f->v, m->qkv_dim, &f->rope, kv, md);
    ops->attention(b, &f->attn, &f->q, m->qkv_dim, kv, md, scale, ly->sliding_window, opt(&w->sinks));
    ops->matmul(b, &f->h, &f->attn2, &w->o, opt(&w->o_bias));
    model_tp_all_reduce(m, &f->h);
}

void block_attention(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                     const struct attn_metadata *md) {
    m->backend->ops->add_rmsnorm(m->backend, &f->x, &f->residual, f->first ? NULL : &f->h, &ly->attn_norm,
                                 m->cfg.rms_norm_eps);
    f->first = false;
    switch (ly->attn_kind) {
    case ATTN_KIND_GQA: attention_gqa(m, f, ly, kv, md); break;
    case ATTN_KIND_MLA: block_attention_mla(m, f, ly, kv, md); break;
    case ATTN_KIND_GQA_GATED: attention_gqa_gated(m, f, ly, kv, md); break;
    case ATTN_KIND_GATED_DELTANET: attention_gated_deltanet(m, f, ly, kv, md); break;
    default: CHECK_MSG(0, "attention kind %d", (int)ly->attn_kind);
    }
    // The layer's KV rows of this batch are written (issued): a KV-transfer producer may ship them.
    if (m->kv_layer_hook) m->kv_layer_hook(m->kv_layer_hook_arg, (int)(ly - m->layers));
}

static void ffn_dense(struct model *m, struct fwd_state *f, const struct ffn_dense_weights *w) {
    struct backend *b = m->backend;
    b->ops->matmul(b, &f->gu, &f->x, &w->gate_up, opt(&w->gate_up_bias));
    b->ops->silu_mul(b, &f->act, &f->gu);
    b->ops->matmul(b, &f->h, &f->act, &w->down, opt(&w->down_bias));
    model_tp_all_reduce(m, &f->h);
}

// F32 router logits straight from the GEMM (matmul may write F32): routing decisions do not see a
// BF16 rounding of the logits on the GPU.
static void ffn_moe(struct model *m, struct fwd_state *f, const struct ffn_moe_weights *w) {
    struct backend *b = m->backend;
    const struct model_config *c = &m->cfg;
    struct model_moe_scratch *s = &m->scratch.moe;
    CHECK(s->workspace != NULL);
    struct tensor logits = tensor_2d(s->logits, DTYPE_F32, f->T, c->num_experts);
    b->ops->matmul(b, &logits, &f->x, &w->router, opt(&w->router_bias));
    struct moe_route_args ra = m->moe_route;
    ra.correction_bias = w->score_bias.data; // (E) F32 or NULL (DeepSeek-V3's e_score_correction_bias)
    b->ops->moe_route(b, &logits, &ra, s->topk_ids, s->topk_w);
    const struct moe_experts_args ea = {
        .act = c->swiglu_alpha > 0 ? MOE_ACT_SWIGLU_CLAMP : MOE_ACT_SILU,
        .alpha = c->swiglu_alpha,
        .limit = c->swiglu_limit,
        .gate_up_bias = opt(&w->gate_up_bias),
        .down_bias = opt(&w->down_bias),
    };
    b->ops->moe_experts(b, &f->h, &f->x, &w->gate_up, &w->down, s->topk_ids, s->topk_w,
                        m->moe_route.top_k + m->moe_route.n_shared, &ea, s->workspace);
}

void block_ffn(struct model *m, struct fwd_state *f, const struct model_layer *ly) {
    m->backend->ops->add_rmsnorm(m->backend, &f->x, &f->residual, &f->h, &ly->ffn_norm, m->cfg.rms_norm_eps);
    switch (ly->ffn_kind) {
    case FFN_KIND_DENSE: ffn_dense(m, f, &ly->ffn.dense); return;
    case FFN_KIND_MOE: ffn_moe(m, f, &ly->ffn.moe); return;
    case FFN_KIND_MOE_SHARED_GATED:
        ffn_moe(m, f, &ly->ffn.moe_sh.moe);
        ffn_shared_expert_gated(m, f, &ly->ffn.moe_sh);
        return;
    }
    CHECK_MSG(0, "FFN kind %d", (int)ly->ffn_kind);
}

void fwd_end(struct model *m, struct fwd_state *f) {
    m->last_tokens = (int)f->T;
}

void model_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md, struct kv_layer *kv) {
    m->arch->forward(m, token_ids, md, kv);
}

struct tensor model_compute_logits(struct model *m, const int32_t *rows, int n_rows) {
    return model_compute_logits_with(m, rows, n_rows, &m->final_norm, &m->lm_head);
}

struct tensor model_compute_logits_with(struct model *m, const int32_t *rows, int n_rows, const struct tensor *norm,
                                        const struct weight *head) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    struct model_scratch *s = &m->scratch;
    const struct model_config *c = &m->cfg;
    CHECK_MSG(n_rows > 0 && n_rows <= s->max_logits_rows, "%d logits rows, scratch holds %d", n_rows,
              s->max_logits_rows);
    const enum dtype dt = b->act_dtype;
    const int64_t T = m->last_tokens, H = c->hidden_size, V = c->vocab_size;
    struct tensor residual = view2(s->residual, dt, T, H), h = view2(s->h, dt, T, H);
    struct tensor gres = view2(s->lg_res, dt, n_rows, H), gh = view2(s->lg_h, dt, n_rows, H);
    struct tensor gx = view2(s->lg_x, dt, n_rows, H);
    struct tensor logits = view2(s->logits, DTYPE_F32, n_rows, V);
    ops->gather_rows(b, &gres, &residual, rows, n_rows);
    ops->gather_rows(b, &gh, &h, rows, n_rows);
    ops->add_rmsnorm(b, &gx, &gres, &gh, norm, c->rms_norm_eps);
    // F32 logits straight from the GEMM (backend.h: matmul may write F32 from act-dtype input),
    // so no rounding of logits to BF16 and no conversion pass.
    if (m->tp_size > 1) {
        // Vocab-parallel lm_head: this rank's (n, V/tp) logits, all-gathered side by side.
        int64_t Vs = V / m->tp_size;
        struct tensor shard = view2(s->lg_shard, DTYPE_F32, n_rows, Vs);
        ops->matmul(b, &shard, &gx, head, NULL);
        if (m->comm_status == ATOMC_OK)
            m->comm_status = comm_all_gather_cols(m->comm, s->logits, s->lg_shard, s->lg_gather, DTYPE_F32,
                                                  (size_t)n_rows, (size_t)Vs, &m->comm_err);
        return logits;
    }
    ops->matmul(b, &logits, &gx, head, NULL);
    return logits;
}

// The two RMSNorm weights of every pre-norm decoder layer, loaded first (the order dummy weights
// are drawn in).
const struct weight_entry weights_layer_norms[] = {
    {.field = offsetof(struct model_layer, attn_norm), .init = WINIT_NORM, .cols = WDIM_NONE,
     .parts = {{"input_layernorm.weight", WDIM_HIDDEN}}},
    {.field = offsetof(struct model_layer, ffn_norm), .init = WINIT_NORM, .cols = WDIM_NONE,
     .parts = {{"post_attention_layernorm.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// Routed experts in HF's Qwen-MoE / DeepSeek naming: the router mlp.gate and mlp.experts.E.{gate,up,
// down}_proj, stacked per expert. Qwen3-MoE layers; DeepSeek's MoE layers add their bias and shared
// experts in a table of their own.
const struct weight_entry weights_moe_routed[] = {
    {.field = offsetof(struct model_layer, ffn.moe.router), .is_weight = true, .cols = WDIM_HIDDEN,
     .parts = {{"mlp.gate.weight", WDIM_EXPERTS}}},
    {.field = offsetof(struct model_layer, ffn.moe.gate_up), .is_weight = true, .per_expert = true, .cols = WDIM_HIDDEN,
     .parts = {{"mlp.experts.%d.gate_proj.weight", WDIM_MOE_INTER}, {"mlp.experts.%d.up_proj.weight", WDIM_MOE_INTER}}},
    {.field = offsetof(struct model_layer, ffn.moe.down), .is_weight = true, .per_expert = true, .cols = WDIM_MOE_INTER,
     .parts = {{"mlp.experts.%d.down_proj.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// The dense gated MLP (HF's LlamaMLP shape: mlp.{gate,up,down}_proj, biases where the config has
// mlp_bias), column / row sharded under tensor parallelism. Llama-family dense layers, DeepSeek's
// and GLM-4-MoE's first_k_dense_replace layers.
const struct weight_entry weights_dense_mlp[] = {
    {.field = offsetof(struct model_layer, ffn.dense.gate_up), .is_weight = true, .shard = WSHARD_COL,
     .cols = WDIM_HIDDEN, .parts = {{"mlp.gate_proj.weight", WDIM_INTER}, {"mlp.up_proj.weight", WDIM_INTER}}},
    {.field = offsetof(struct model_layer, ffn.dense.down), .is_weight = true, .shard = WSHARD_ROW,
     .cols = WDIM_INTER, .parts = {{"mlp.down_proj.weight", WDIM_HIDDEN}}},
    {.field = offsetof(struct model_layer, ffn.dense.gate_up_bias), .init = WINIT_BIAS, .shard = WSHARD_COL,
     .cond = WCOND_MLP_BIAS, .parts = {{"mlp.gate_proj.bias", WDIM_INTER}, {"mlp.up_proj.bias", WDIM_INTER}}},
    {.field = offsetof(struct model_layer, ffn.dense.down_bias), .init = WINIT_BIAS, .shard = WSHARD_ROW_BIAS,
     .cond = WCOND_MLP_BIAS, .parts = {{"mlp.down_proj.bias", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};
