// The MLA attention block (DeepSeek-V2/V3, blocks.h): from the normed hidden states x of T new
// tokens into h, over the layer's latent cache (CACHE_KIND_LATENT, backend.h "---- MLA ----").
//
//   q_lora > 0:  qa = rmsnorm(x @ W_qa^T) ; q = qa @ W_qb^T      (T, H, nope + rope)
//   else:        q = x @ W_q^T
//   kv_a = x @ W_kva^T                                            (T, kv_lora + rope)
//   mla_latent_write: rope(q_pe) in place; cache row [rmsnorm(c), rope(k_pe)] at slot_mapping
//   mla_attention:    attn (T, H, v) over the latent cache (absorbed W_UK / W_UV of kv_b)
//   h = attn @ W_o^T
//
// DSA (GLM-5 / DeepSeek-V3.2, index_n_heads > 0): before the attention, a layer with its own
// indexer computes iq = qa_normed @ W_iq^T (T, IH, ID), ik = x @ W_ik^T, iw = x @ W_iw^T (T, IH);
// dsa_index_write ropes iq and caches LayerNorm'd, roped ik beside the latent (kv->v); dsa_topk
// picks each query's index_topk keys into the extra scratch, which mla_attention then reads
// (mla_args.topk). A "shared" layer (GLM-5's indexer_types) reuses the list the previous full layer
// left there: the same tokens at the same positions. The extra scratch (deepseek.c sizes it)
// holds [iq | ik | iw | topk as int32] per step.
//
// The q_a / kv_a RMSNorms use eps 1e-6 whatever rms_norm_eps says: DeepSeek's reference code and
// transformers construct them with the RMSNorm default (MLA_LORA_NORM_EPS).
//
// The activations live in the model's qkv scratch (model.c sizes it for MLA: q, kv_a, qa, qa
// normed side by side, each a dense (T, width) region) and attn (T, H v).
#include <math.h>

#include "model/blocks.h"

#include "common/check.h"

#define MLA_LORA_NORM_EPS 1e-6f
#define DSA_K_NORM_EPS 1e-6f // the indexer's key LayerNorm (transformers' GlmMoeDsaIndexer / DeepseekV32Indexer)

// The softmax scale of cfg's MLA: (nope + rope)^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2
// when the RoPE is scaled and mscale_all_dim is given (DeepSeek's correction; transformers'
// yarn_apply_mscale applies it for every non-default rope type).
static float mla_softmax_scale(const struct model_config *c) {
    float s = 1.0f / sqrtf((float)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    const struct rope_config *r = &c->rope;
    if (r->scaling != ROPE_SCALING_NONE && r->mscale_all_dim != 0.0f && r->factor > 1.0f) {
        float ms = 0.1f * r->mscale_all_dim * logf(r->factor) + 1.0f;
        s *= ms * ms;
    }
    return s;
}

void block_attention_mla(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                         const struct attn_metadata *md) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct model_config *c = &m->cfg;
    const struct attn_mla_weights *w = &ly->attn.mla;
    const int64_t T = f->T, H = c->num_heads, DQ = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const int64_t KA = c->kv_lora_rank + c->qk_rope_head_dim, QL = c->q_lora_rank;
    const enum dtype dt = b->act_dtype;
    const size_t e = dtype_row_bytes(dt, 1);
    char *base = f->qkv.data;
    int64_t qn[3] = {T, H, DQ};
    struct tensor q = tensor_make(base, dt, 3, qn);
    struct tensor q2 = tensor_2d(base, dt, T, H * DQ);
    struct tensor kv_a = tensor_2d(base + (size_t)(T * H * DQ) * e, dt, T, KA);
    if (QL > 0) {
        struct tensor qa = tensor_2d(base + (size_t)(T * (H * DQ + KA)) * e, dt, T, QL);
        struct tensor qan = tensor_2d(base + (size_t)(T * (H * DQ + KA + QL)) * e, dt, T, QL);
        ops->matmul(b, &qa, &f->x, &w->q_a, NULL);
        ops->rmsnorm(b, &qan, &qa, &w->q_a_norm, MLA_LORA_NORM_EPS);
        ops->matmul(b, &q2, &qan, &w->q_b, NULL);
    } else {
        ops->matmul(b, &q2, &f->x, &w->q, NULL);
    }
    ops->matmul(b, &kv_a, &f->x, &w->kv_a, NULL);
    struct mla_args a = {
        .n_heads = (int)H,
        .nope = c->qk_nope_head_dim,
        .rope = c->qk_rope_head_dim,
        .kv_lora = c->kv_lora_rank,
        .v_dim = c->v_head_dim,
        .scale = mla_softmax_scale(c),
        .kv_b = &w->kv_b,
    };
    ops->mla_latent_write(b, &q, &kv_a, &w->kv_a_norm, MLA_LORA_NORM_EPS, &f->rope, &a, kv, md);
    if (c->index_n_heads > 0) { // DSA: this layer's top-k (or the previous full layer's, kept in extra)
        const int64_t IH = c->index_n_heads, ID = c->index_head_dim;
        char *xb = m->scratch.extra;
        struct tensor iq = tensor_2d(xb, dt, T, IH * ID);
        struct tensor ik = tensor_2d(xb + (size_t)(T * IH * ID) * e, dt, T, ID);
        struct tensor iw = tensor_2d(xb + (size_t)(T * (IH * ID + ID)) * e, dt, T, IH);
        int32_t *topk = (int32_t *)(xb + (((size_t)(T * (IH * ID + ID + IH)) * e + 15) & ~(size_t)15));
        const struct dsa_args da = {.n_heads = (int)IH,
                                    .head_dim = (int)ID,
                                    .rope = c->qk_rope_head_dim,
                                    .topk = c->index_topk,
                                    .rope_interleaved = c->index_rope_interleaved,
                                    .norm_eps = DSA_K_NORM_EPS};
        if (w->idx_wq_b.t.data) {
            struct tensor qan = tensor_2d(base + (size_t)(T * (H * DQ + KA + QL)) * e, dt, T, QL);
            ops->matmul(b, &iq, &qan, &w->idx_wq_b, NULL);
            ops->matmul(b, &ik, &f->x, &w->idx_wk, NULL);
            ops->matmul(b, &iw, &f->x, &w->idx_weights, NULL);
            ops->dsa_index_write(b, &iq, &ik, &w->idx_k_norm, &w->idx_k_norm_b, &f->rope, &da, kv, md);
            ops->dsa_topk(b, topk, &iq, &iw, kv, md, &da);
        }
        a.topk = topk;
        a.topk_k = c->index_topk;
    }
    int64_t on[3] = {T, H, c->v_head_dim};
    struct tensor out = tensor_make(f->attn.data, dt, 3, on);
    ops->mla_attention(b, &out, &q, kv, md, &a, m->scratch.mla_workspace);
    struct tensor out2 = tensor_2d(f->attn.data, dt, T, H * c->v_head_dim);
    ops->matmul(b, &f->h, &out2, &w->o, NULL);
}
