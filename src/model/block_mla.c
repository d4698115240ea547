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
// The q_a / kv_a RMSNorms use eps 1e-6 whatever rms_norm_eps says: DeepSeek's reference code and
// transformers construct them with the RMSNorm default (MLA_LORA_NORM_EPS).
//
// The activations live in the model's qkv scratch (model.c sizes it for MLA: q, kv_a, qa, qa
// normed side by side, each a dense (T, width) region) and attn (T, H v).
#include <math.h>

#include "model/blocks.h"

#include "common/check.h"

#define MLA_LORA_NORM_EPS 1e-6f

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
    const struct mla_args a = {
        .n_heads = (int)H,
        .nope = c->qk_nope_head_dim,
        .rope = c->qk_rope_head_dim,
        .kv_lora = c->kv_lora_rank,
        .v_dim = c->v_head_dim,
        .scale = mla_softmax_scale(c),
        .kv_b = &w->kv_b,
    };
    ops->mla_latent_write(b, &q, &kv_a, &w->kv_a_norm, MLA_LORA_NORM_EPS, &f->rope, &a, kv, md);
    int64_t on[3] = {T, H, c->v_head_dim};
    struct tensor out = tensor_make(f->attn.data, dt, 3, on);
    ops->mla_attention(b, &out, &q, kv, md, &a, m->scratch.mla_workspace);
    struct tensor out2 = tensor_2d(f->attn.data, dt, T, H * c->v_head_dim);
    ops->matmul(b, &f->h, &out2, &w->o, NULL);
}
