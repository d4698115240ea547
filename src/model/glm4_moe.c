// GLM-4-MoE: Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7). A pre-norm decoder of GQA
// attention and MoE layers, written with the shared blocks (blocks.c) as Llama is:
//
//   residual = embed[ids]
//   per layer:  block_attention  GQA with q/k/v biases (attention_bias), optional per-head q/k
//                                RMSNorm (use_qk_norm), partial rotary: RoPE on the first
//                                head_dim * partial_rotary_factor dims of each head (NeoX halves of
//                                that part, as HF's rotate_half on q[..., :rotary_dim]), no o_proj bias
//               block_ffn        dense MLP on the first first_k_dense_replace layers; else MoE:
//                                router (F32 logits) -> sigmoid scores, + e_score_correction_bias to
//                                select, n_group / topk_group groups scored by their top-2 sum,
//                                top-k, weights from the uncorrected scores, renormalised
//                                (norm_topk_prob) and times routed_scaling_factor; the shared expert
//                                (HF's shared_experts, intermediate n_shared_experts x
//                                moe_intermediate_size) is stacked after the routed experts and
//                                selected for every token with weight 1 (moe_route's shared slots)
//   logits rows only: model_compute_logits
//
// Multi-token-prediction layers (num_nextn_predict_layers, stored as model.layers.<num_layers>.*)
// load through src/model/mtp.c for speculative method mtp (the plan above serves their index);
// otherwise the loader skips them by name (model_files.c).
#include <string.h>

#include "common/check.h"
#include "model/arch.h"
#include "model/blocks.h"

#define L_FIELD(f) offsetof(struct model_layer, f)

// HF Glm4MoeAttention: q/k/v biases when attention_bias, o_proj never biased.
static const struct weight_entry glm4_attn_weights[] = {
    {.field = L_FIELD(attn.gqa.qkv),
     .is_weight = true,
     .shard = WSHARD_COL,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.q_proj.weight", WDIM_Q},
               {"self_attn.k_proj.weight", WDIM_KV},
               {"self_attn.v_proj.weight", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.qkv_bias),
     .init = WINIT_BIAS,
     .shard = WSHARD_COL,
     .cond = WCOND_ATTN_BIAS,
     .parts = {{"self_attn.q_proj.bias", WDIM_Q},
               {"self_attn.k_proj.bias", WDIM_KV},
               {"self_attn.v_proj.bias", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.o),
     .is_weight = true,
     .shard = WSHARD_ROW,
     .cols = WDIM_Q,
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    {.field = L_FIELD(attn.gqa.q_norm),
     .init = WINIT_NORM,
     .cond = WCOND_QK_NORM,
     .parts = {{"self_attn.q_norm.weight", WDIM_HEAD_DIM}}},
    {.field = L_FIELD(attn.gqa.k_norm),
     .init = WINIT_NORM,
     .cond = WCOND_QK_NORM,
     .parts = {{"self_attn.k_norm.weight", WDIM_HEAD_DIM}}},
    WEIGHT_TABLE_END,
};

// MoE layers: mlp.gate (router + its F32 correction bias), mlp.experts.E.*, mlp.shared_experts.*
// (stacked after the routed experts, weight_loader.h shared_parts).
static const struct weight_entry glm4_moe_weights[] = {
    {.field = L_FIELD(ffn.moe.router),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.gate.weight", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.score_bias),
     .init = WINIT_BIAS,
     .f32 = true,
     .parts = {{"mlp.gate.e_score_correction_bias", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.gate_up),
     .is_weight = true,
     .per_expert = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.experts.%d.gate_proj.weight", WDIM_MOE_INTER}, {"mlp.experts.%d.up_proj.weight", WDIM_MOE_INTER}},
     .shared_parts = {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"}},
    {.field = L_FIELD(ffn.moe.down),
     .is_weight = true,
     .per_expert = true,
     .cols = WDIM_MOE_INTER,
     .parts = {{"mlp.experts.%d.down_proj.weight", WDIM_HIDDEN}},
     .shared_parts = {"mlp.shared_experts.down_proj.weight"}},
    WEIGHT_TABLE_END,
};

// What HF's Glm4Moe modules compute and this file implements; the rest is refused by name.
static atomc_status glm4_moe_check(const struct model_config *c, struct error *err) {
    if (c->hidden_act[0] && strcmp(c->hidden_act, "silu") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: hidden_act '%s' is not supported (only silu)",
                         c->architecture, c->hidden_act);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] != LAYER_ATTN_FULL)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: layer %d is not a full-attention layer (sliding "
                             "window / linear attention), which GLM-4-MoE does not have",
                             c->architecture, l);
    if (c->attention_sinks || c->q_lora_rank > 0 || c->kv_lora_rank > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s config asks for attention sinks or MLA, which GLM-4-MoE "
                         "does not have",
                         c->architecture);
    if (c->num_experts <= 0 || c->num_experts > 1024 || c->num_experts_per_tok <= 0 ||
        c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s config: %d experts, top-%d, moe_intermediate_size %d (need 1..1024 "
                         "experts, 1 <= top-k <= experts)",
                         c->architecture, c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size);
    // HF's router always scores by sigmoid, whatever scoring_func says: a config asking otherwise
    // is not what the reference computes.
    if (strcmp(c->scoring_func, "sigmoid") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: scoring_func '%s': GLM-4-MoE routes by sigmoid only",
                         c->architecture, c->scoring_func);
    int ng = c->n_group > 0 ? c->n_group : 1, tg = c->topk_group > 0 ? c->topk_group : 1;
    if (c->num_experts % ng != 0 || tg > ng || (ng > 1 && c->num_experts / ng < 2))
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: n_group %d / topk_group %d over %d experts (groups are scored "
                         "by their two best experts: at least 2 per group)",
                         c->architecture, ng, tg, c->num_experts);
    if (ng == 1 && tg != 1)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: topk_group %d with one group", c->architecture, tg);
    if (c->n_shared_experts < 0 || c->num_experts + c->n_shared_experts > 1024)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: n_shared_experts %d", c->architecture, c->n_shared_experts);
    if (c->decoder_sparse_step != 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: decoder_sparse_step %d (GLM-4-MoE: every layer from "
                         "first_k_dense_replace on is MoE)",
                         c->architecture, c->decoder_sparse_step);
    for (int l = 0; l < c->num_layers; l++)
        if (c->mlp_only_layers[l])
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: mlp_only_layers is not a GLM-4-MoE key", c->architecture);
    if (c->rope.interleaved)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: interleaved RoPE (GLM-4-MoE rotates halves)",
                         c->architecture);
    return ATOMC_OK;
}

static void glm4_moe_plan_layer(const struct model *m, int l, struct layer_plan *p) {
    const struct model_config *c = &m->cfg;
    const bool moe = model_config_layer_is_moe(c, l);
    *p = (struct layer_plan){
        .attn_kind = ATTN_KIND_GQA,
        .ffn_kind = moe ? FFN_KIND_MOE : FFN_KIND_DENSE,
        .cache = {.kind = CACHE_KIND_FULL,
                  .n_kv_heads = c->num_kv_heads,
                  .head_dim_k = c->head_dim,
                  .head_dim_v = c->head_dim},
        .tables = {weights_layer_norms, glm4_attn_weights, moe ? glm4_moe_weights : weights_dense_mlp},
    };
}

static void glm4_moe_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                             struct kv_layer *kv) {
    struct fwd_state f;
    fwd_begin(m, &f, md);
    block_embed(m, &f, token_ids);
    for (int l = 0; l < m->cfg.num_layers; l++) {
        block_attention(m, &f, &m->layers[l], &kv[l], md);
        block_ffn(m, &f, &m->layers[l]);
    }
    fwd_end(m, &f);
}

static const enum model_arch glm4_moe_archs[] = {MODEL_ARCH_GLM4_MOE, MODEL_ARCH_UNKNOWN};

const struct model_arch_def model_arch_glm4_moe = {
    .family = "glm4_moe",
    .archs = glm4_moe_archs,
    .check = glm4_moe_check,
    .plan_layer = glm4_moe_plan_layer,
    .forward = glm4_moe_forward,
    .mtp = true,
};
