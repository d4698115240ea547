// The Llama family: LlamaForCausalLM (also MistralForCausalLM), Qwen3ForCausalLM (per-head q/k
// RMSNorm), Qwen3MoeForCausalLM and MixtralForCausalLM (MoE layers). One forward for all of them:
// what differs (biases, q/k norm, tied embeddings, RoPE scaling, sliding-window layers, which
// layers are MoE, MoE tensor names) is config data and the weight tables below.
//
//   residual = embed[ids]
//   per layer:  block_attention (GQA over the paged K/V cache)
//               block_ffn       (dense MLP, or router + fused experts on MoE layers)
//   logits rows only: model_compute_logits (blocks.c)
// With an EAGLE-3 head loaded (eagle3.c), the residual stream entering its aux layers is copied
// aside for every row of the step.
#include <string.h>

#include "common/check.h"
#include "model/arch.h"
#include "model/blocks.h"
#include "model/eagle3.h"

// ---------------------------------------------------------------------------------------------
// Weights

#define L_FIELD(f) offsetof(struct model_layer, f)

static const struct weight_entry llama_attn_weights[] = {
    {.field = L_FIELD(attn.gqa.qkv), .is_weight = true, .shard = WSHARD_COL, .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.q_proj.weight", WDIM_Q}, {"self_attn.k_proj.weight", WDIM_KV},
               {"self_attn.v_proj.weight", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.qkv_bias), .init = WINIT_BIAS, .shard = WSHARD_COL, .cond = WCOND_ATTN_BIAS,
     .parts = {{"self_attn.q_proj.bias", WDIM_Q}, {"self_attn.k_proj.bias", WDIM_KV},
               {"self_attn.v_proj.bias", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.o), .is_weight = true, .shard = WSHARD_ROW, .cols = WDIM_Q,
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    // HF Llama and Qwen3 give o_proj a bias exactly when attention_bias is set.
    {.field = L_FIELD(attn.gqa.o_bias), .init = WINIT_BIAS, .shard = WSHARD_ROW_BIAS, .cond = WCOND_ATTN_OUT_BIAS,
     .parts = {{"self_attn.o_proj.bias", WDIM_HIDDEN}}},
    {.field = L_FIELD(attn.gqa.q_norm), .init = WINIT_NORM, .cond = WCOND_QK_NORM,
     .parts = {{"self_attn.q_norm.weight", WDIM_HEAD_DIM}}},
    {.field = L_FIELD(attn.gqa.k_norm), .init = WINIT_NORM, .cond = WCOND_QK_NORM,
     .parts = {{"self_attn.k_norm.weight", WDIM_HEAD_DIM}}},
    WEIGHT_TABLE_END,
};

// Mixtral: block_sparse_moe.gate and block_sparse_moe.experts.E.{w1 (gate), w3 (up), w2 (down)}.
static const struct weight_entry mixtral_moe_weights[] = {
    {.field = L_FIELD(ffn.moe.router), .is_weight = true, .cols = WDIM_HIDDEN,
     .parts = {{"block_sparse_moe.gate.weight", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.gate_up), .is_weight = true, .per_expert = true, .cols = WDIM_HIDDEN,
     .parts = {{"block_sparse_moe.experts.%d.w1.weight", WDIM_MOE_INTER},
               {"block_sparse_moe.experts.%d.w3.weight", WDIM_MOE_INTER}}},
    {.field = L_FIELD(ffn.moe.down), .is_weight = true, .per_expert = true, .cols = WDIM_MOE_INTER,
     .parts = {{"block_sparse_moe.experts.%d.w2.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// ---------------------------------------------------------------------------------------------
// Config check and layer plan

static bool llama_is_moe(const struct model_config *c) {
    return c->arch == MODEL_ARCH_QWEN3_MOE || c->arch == MODEL_ARCH_MIXTRAL;
}

static atomc_status llama_check(const struct model_config *c, struct error *err) {
    const bool moe = llama_is_moe(c);
    if (c->hidden_act[0] && strcmp(c->hidden_act, "silu") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "hidden_act '%s' is not supported (only silu)", c->hidden_act);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] == LAYER_ATTN_LINEAR)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "layer %d uses linear attention, which %s does not have",
                             l, c->architecture);
    if (moe && (c->num_experts <= 0 || c->num_experts > 1024 || c->num_experts_per_tok <= 0 ||
                c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0))
        return error_set(err, ATOMC_ERR_FORMAT, "%s config: %d experts, top-%d, moe_intermediate_size %d (need 1..1024 "
                         "experts, 1 <= top-k <= experts)", c->architecture, c->num_experts, c->num_experts_per_tok,
                         c->moe_intermediate_size);
    if (moe && c->n_shared_experts > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for %d shared experts, which the MoE block does "
                         "not load yet", c->architecture, c->n_shared_experts);
    if (moe && (c->n_group > 1 || (c->scoring_func[0] && strcmp(c->scoring_func, "softmax"))))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for grouped top-k (n_group %d) or '%s' scoring; "
                         "the MoE router implements softmax top-k only", c->architecture, c->n_group, c->scoring_func);
    if (c->attention_sinks || (c->num_experts > 0 && !moe) || c->q_lora_rank > 0 || c->kv_lora_rank > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for attention sinks, experts or MLA, which the "
                         "dense forward does not implement", c->architecture);
    return ATOMC_OK;
}

static void llama_plan_layer(const struct model *m, int l, struct layer_plan *p) {
    const struct model_config *c = &m->cfg;
    const bool moe = model_config_layer_is_moe(c, l);
    const int window = c->layer_types[l] == LAYER_ATTN_SLIDING ? c->sliding_window : 0;
    *p = (struct layer_plan){
        .attn_kind = ATTN_KIND_GQA,
        .ffn_kind = moe ? FFN_KIND_MOE : FFN_KIND_DENSE,
        .sliding_window = window,
        .cache = {.kind = window > 0 ? CACHE_KIND_SLIDING : CACHE_KIND_FULL, .n_kv_heads = c->num_kv_heads,
                  .head_dim_k = c->head_dim, .head_dim_v = c->head_dim, .window = window},
        .tables = {weights_layer_norms, llama_attn_weights,
                   !moe ? weights_dense_mlp : c->arch == MODEL_ARCH_MIXTRAL ? mixtral_moe_weights : weights_moe_routed},
    };
}

// ---------------------------------------------------------------------------------------------
// Forward

static void llama_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                          struct kv_layer *kv) {
    struct fwd_state f;
    fwd_begin(m, &f, md);
    block_embed(m, &f, token_ids);
    for (int l = 0; l < m->cfg.num_layers; l++) {
        if (m->eagle3) model_eagle3_capture(m, &f, l); // the residual stream entering l, for the EAGLE-3 head
        block_attention(m, &f, &m->layers[l], &kv[l], md);
        block_ffn(m, &f, &m->layers[l]);
    }
    fwd_end(m, &f);
}

static const enum model_arch llama_archs[] = {MODEL_ARCH_LLAMA, MODEL_ARCH_QWEN3, MODEL_ARCH_QWEN3_MOE,
                                              MODEL_ARCH_MIXTRAL, MODEL_ARCH_UNKNOWN};

const struct model_arch_def model_arch_llama = {
    .family = "llama",
    .archs = llama_archs,
    .check = llama_check,
    .plan_layer = llama_plan_layer,
    .forward = llama_forward,
};
