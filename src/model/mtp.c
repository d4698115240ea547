// Multi-token-prediction layers (model.h struct model_mtp_layer): DeepSeek-V3's and GLM-4-MoE's
// num_nextn_predict_layers, stored as model.layers.<num_layers + i>.* with
//   enorm.weight, hnorm.weight (hidden)   eh_proj.weight (hidden, 2 hidden)
//   the family's decoder layer tensors    shared_head.norm.weight (hidden)
//   shared_head.head.weight (vocab, hidden), embed_tokens.weight (vocab, hidden): optional; the
//   model's lm_head / embeddings serve when a checkpoint omits them or ships byte-identical copies
//   (DeepSeek-V3 does), so they are not held twice.
//
// Forward (as vLLM's DeepSeekMultiTokenPredictorLayer and SGLang's deepseek_nextn, which the
// checkpoints were trained for; transformers has no MTP module): for token t_{p+1} at position p
//   x   = eh_proj [enorm(embed(t_{p+1})) ; hnorm(h_p)]     (the embedding half first)
//   out = decoder_layer(x) (its own residual stream, its own cache at position p)
//   logits = shared_head.head(shared_head.norm(out))        -> a draft for position p + 2
// h_p is the target's final hidden state after its final norm (what its lm_head reads); in a
// chain (k > 1 drafts) the next step's h is `out`. eh_proj is split at load into its embedding
// columns and its hidden columns, so the concatenation becomes two GEMMs whose sum the decoder
// layer's first add_rmsnorm forms (residual = e W_e^T + h W_h^T). vLLM also zeroes the embedding
// at position 0; we do not (the paper's formula and SGLang have no such mask), which only changes
// the draft at position 0, never an output token.
#include "model/mtp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "loader/model_files.h"
#include "model/blocks.h"

// The family's plan for MTP layer index l (>= num_layers): evaluated on a copy whose num_layers
// counts the MTP layers, as the families' layer rules (first_k_dense_replace, moe_layer_freq)
// apply to them (vLLM builds the MTP block with layer index num_layers + i).
static void mtp_plan(const struct model *m, int l, struct layer_plan *p) {
    struct model mm = *m;
    mm.cfg.num_layers = m->cfg.num_layers + (m->cfg.num_nextn_predict_layers > 0 ? m->cfg.num_nextn_predict_layers : 1);
    m->arch->plan_layer(&mm, l, p);
}

static void mtp_release(struct model *m, struct tensor *t, const void *alias) {
    if (t->data && t->data != alias) m->backend->ops->free(m->backend, t->data);
    t->data = NULL;
}

// Whether the checkpoint's tensor `name` is a byte-identical copy of the target's `target` (same
// dtype and shape): DeepSeek-V3 ships its MTP layer's embed_tokens and shared_head.head as copies of
// the model's (2 x 1.85 GB in BF16), which are then not loaded a second time.
static bool mtp_copy_of(struct weight_loader *L, const char *name, const char *target) {
    struct model_files *mf = weight_loader_files(L);
    struct tensor a, b;
    struct error e = {0};
    if (!mf || model_files_get_tensor(mf, name, &a, &e) != ATOMC_OK ||
        model_files_get_tensor(mf, target, &b, &e) != ATOMC_OK)
        return false;
    if (a.dtype != b.dtype || a.ndim != b.ndim) return false;
    for (int d = 0; d < a.ndim; d++)
        if (a.ne[d] != b.ne[d]) return false;
    return !memcmp(a.data, b.data, tensor_bytes(&a));
}

atomc_status model_mtp_load(struct model *m, struct weight_loader *L, struct error *err) {
    const struct model_config *c = &m->cfg;
    // The first MTP layer serves every draft of a chain (DeepSeek-V3 and GLM-4.x ship one; vLLM's
    // default for them); further ones stay unread by design (model_files.c).
    const int n = c->num_nextn_predict_layers > 0 ? 1 : 0, L0 = c->num_layers;
    if (!m->arch->mtp)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "speculative method mtp: MTP layers are not implemented for %s (family %s); supported: "
                         "DeepseekV3ForCausalLM, DeepseekV2ForCausalLM and Glm4MoeForCausalLM checkpoints with "
                         "num_nextn_predict_layers > 0",
                         c->architecture, m->arch->family);
    if (n <= 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "speculative method mtp: %s declares no MTP layers (num_nextn_predict_layers is 0)",
                         c->architecture);
    if (m->tp_size > 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "speculative method mtp with tensor parallelism is not implemented");
    if (L0 + n > MODEL_MAX_LAYERS)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%d layers + %d MTP layers (at most %d)", L0, n, MODEL_MAX_LAYERS);
    char first[96];
    snprintf(first, sizeof first, "model.layers.%d.enorm.weight", L0);
    if (weight_loader_files(L) && !weight_loader_has(L, first))
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "speculative method mtp: %s declares num_nextn_predict_layers %d but the checkpoint has no "
                         "MTP layer (tensor %s is missing)",
                         c->architecture, c->num_nextn_predict_layers, first);
    m->layer_cache = xrealloc(m->layer_cache, (size_t)(L0 + n) * sizeof *m->layer_cache);
    m->mtp = xcalloc((size_t)n, sizeof *m->mtp);
    m->n_mtp = n;
    const int64_t H = c->hidden_size, V = c->vocab_size;
    atomc_status st;
    for (int i = 0; i < n; i++) {
        const int l = L0 + i;
        struct model_mtp_layer *w = &m->mtp[i];
        struct layer_plan p;
        mtp_plan(m, l, &p);
        w->layer.attn_kind = p.attn_kind;
        w->layer.ffn_kind = p.ffn_kind;
        w->layer.sliding_window = p.sliding_window;
        m->layer_cache[l] = p.cache;
        m->n_cache_layers = l + 1;
        char name[96];
#define MTP_NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d." suffix, l), name)
        if ((st = weight_loader_load_tensor(L, &w->enorm, MTP_NAME("enorm.weight"), 1, (int64_t[]){H}, WINIT_NORM, -1,
                                            0, err)) ||
            (st = weight_loader_load_tensor(L, &w->hnorm, MTP_NAME("hnorm.weight"), 1, (int64_t[]){H}, WINIT_NORM, -1,
                                            0, err)) ||
            (st = weight_loader_load_tensor(L, &w->eh_e.t, MTP_NAME("eh_proj.weight"), 2, (int64_t[]){H, H},
                                            WINIT_MATRIX, 1, 0, err)) ||
            (st = weight_loader_load_tensor(L, &w->eh_h.t, MTP_NAME("eh_proj.weight"), 2, (int64_t[]){H, H},
                                            WINIT_MATRIX, 1, H, err)))
            return st;
        for (int t = 0; t < LAYER_MAX_TABLES && p.tables[t]; t++)
            if ((st = weight_loader_load_layer(L, p.tables[t], l, &w->layer, err))) return st;
        if ((st = weight_loader_load_tensor(L, &w->head_norm, MTP_NAME("shared_head.norm.weight"), 1, (int64_t[]){H},
                                            WINIT_NORM, -1, 0, err)))
            return st;
        const char *head_src = m->cfg.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
        if (weight_loader_has(L, MTP_NAME("shared_head.head.weight")) && !mtp_copy_of(L, name, head_src)) {
            if ((st = weight_loader_load_tensor(L, &w->head.t, name, 2, (int64_t[]){V, H}, WINIT_MATRIX, -1, 0, err)))
                return st;
        } else {
            w->head = m->lm_head;
        }
        if (weight_loader_has(L, MTP_NAME("embed_tokens.weight")) &&
            !mtp_copy_of(L, name, "model.embed_tokens.weight")) {
            if ((st = weight_loader_load_tensor(L, &w->embed, name, 2, (int64_t[]){V, H}, WINIT_MATRIX, -1, 0, err)))
                return st;
        } else {
            w->embed = m->embed;
        }
#undef MTP_NAME
    }
    LOG_INFO("%s: %d MTP layer(s) loaded (speculative method mtp)", c->architecture, n);
    return ATOMC_OK;
}

void model_mtp_free(struct model *m) {
    for (int i = 0; i < m->n_mtp; i++) {
        struct model_mtp_layer *w = &m->mtp[i];
        struct layer_plan p;
        mtp_plan(m, m->cfg.num_layers + i, &p);
        for (int t = 0; t < LAYER_MAX_TABLES && p.tables[t]; t++) weight_loader_free_layer(m, p.tables[t], &w->layer);
        mtp_release(m, &w->enorm, NULL);
        mtp_release(m, &w->hnorm, NULL);
        mtp_release(m, &w->eh_e.t, NULL);
        mtp_release(m, &w->eh_h.t, NULL);
        mtp_release(m, &w->head_norm, NULL);
        mtp_release(m, &w->head.t, m->lm_head.t.data);
        mtp_release(m, &w->embed, m->embed.data);
    }
    free(m->mtp);
    m->mtp = NULL;
    m->n_mtp = 0;
}

void model_mtp_forward(struct model *m, int i, const int32_t *token_ids, const struct attn_metadata *md,
                       struct kv_layer *kv, const int32_t *hidden_rows) {
    CHECK(i >= 0 && i < m->n_mtp);
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->scratch;
    const struct model_mtp_layer *w = &m->mtp[i];
    const enum dtype dt = b->act_dtype;
    const int64_t T = md->n_tokens, H = c->hidden_size;
    const float eps = c->rms_norm_eps;
    CHECK(s->mtp_a && T > 0 && T <= s->max_tokens);
    struct tensor A = tensor_2d(s->mtp_a, dt, T, H), B = tensor_2d(s->mtp_b, dt, T, H), C = tensor_2d(s->mtp_c, dt, T, H);
    if (hidden_rows) {
        // The target's final hidden state of each row: final_norm(residual + h) of its last forward.
        const int64_t T0 = m->last_tokens;
        struct tensor res = tensor_2d(s->residual, dt, T0, H), h = tensor_2d(s->h, dt, T0, H);
        ops->gather_rows(b, &A, &res, hidden_rows, (int)T);
        ops->gather_rows(b, &B, &h, hidden_rows, (int)T);
        ops->add_rmsnorm(b, &C, &A, &B, &m->final_norm, eps);
        ops->rmsnorm(b, &A, &C, &w->hnorm, eps);
    } else {
        CHECK(T <= s->max_logits_rows);
        struct tensor prev = tensor_2d(s->lg_res, dt, T, H);
        ops->rmsnorm(b, &A, &prev, &w->hnorm, eps);
    }
    ops->embedding(b, &B, &w->embed, token_ids);
    ops->rmsnorm(b, &C, &B, &w->enorm, eps);
    struct fwd_state f;
    fwd_begin(m, &f, md);
    ops->matmul(b, &f.residual, &C, &w->eh_e, NULL);
    ops->matmul(b, &f.h, &A, &w->eh_h, NULL);
    f.first = false; // the layer's first add_rmsnorm sums the two halves of eh_proj
    block_attention(m, &f, &w->layer, &kv[c->num_layers + i], md);
    block_ffn(m, &f, &w->layer);
    fwd_end(m, &f);
}

struct tensor model_mtp_compute_logits(struct model *m, int i, const int32_t *rows, int n_rows) {
    CHECK(i >= 0 && i < m->n_mtp);
    return model_compute_logits_with(m, rows, n_rows, &m->mtp[i].head_norm, &m->mtp[i].head);
}
