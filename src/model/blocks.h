// Shared block functions of the decoder forward, written once against backend.h ops; a family's
// forward (llama.c, ...) is a short loop over them. Each block reads the layer's weights by kind
// (struct model_layer) and the step's activations from struct fwd_state (views into the model's
// scratch, made once per step by fwd_begin).
//
// The residual stream: every block starts with add_rmsnorm(x, residual += h, norm), so a block's
// output h is added to the residual by the next block (the first one only norms), and after the
// last layer residual + h hold the final hidden state that model_compute_logits gathers.
#ifndef ATOMC_MODEL_BLOCKS_H
#define ATOMC_MODEL_BLOCKS_H

#include "model/model.h"

struct fwd_state {
    int64_t T;                      // tokens of the step
    bool first;                     // no block has run yet: h holds nothing to add
    struct tensor residual, x, h;   // (T, hidden)
    struct tensor qkv;              // (T, qkv_dim)
    struct tensor q, k, v;          // views into qkv: (T, hq, D), (T, hk, D), (T, hk, D)
    struct tensor attn, attn2;      // (T, hq, D) and its (T, q_dim) view
    struct tensor gu, act;          // (T, 2 inter), (T, inter)
    struct rope_args rope;
};

// Views of the scratch for a step of md->n_tokens tokens.
void fwd_begin(struct model *m, struct fwd_state *f, const struct attn_metadata *md);
// residual = embed[token_ids]
void block_embed(struct model *m, struct fwd_state *f, const int32_t *token_ids);
// x = rmsnorm(residual += h) with ly's attn_norm, then the layer's attention kind into h.
void block_attention(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                     const struct attn_metadata *md);
// The MLA attention kind (block_mla.c): from the normed x into h.
void block_attention_mla(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                         const struct attn_metadata *md);
// x = rmsnorm(residual += h) with ly's ffn_norm, then the layer's FFN kind into h.
void block_ffn(struct model *m, struct fwd_state *f, const struct model_layer *ly);
// After the last layer: what model_compute_logits gathers from.
void fwd_end(struct model *m, struct fwd_state *f);

#endif
