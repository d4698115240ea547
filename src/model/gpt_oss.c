// The GPT-OSS family: GptOssForCausalLM (gpt-oss-20b / 120b), in the bf16 layout and in the MXFP4
// checkpoints OpenAI ships. Every layer is pre-norm GQA attention + a routed MoE:
//
//   attention: q/k/v/o with biases, head_dim 64, NeoX-halves RoPE (YaRN as HF applies it, with
//              `truncate: false` kept: config.c), per-head learned sinks (the softmax denominator
//              gets exp(sink), no value: backend.h attention `sinks`), layer_types alternating
//              sliding_attention (window 128, a SLIDING cache spec whose old blocks the engine
//              frees) and full_attention.
//   MoE:       router logits = x W^T + b (F32); top-k of the logits with a softmax over the k
//              selected, which is moe_route's softmax + renormalisation (same order, same
//              weights); experts: gate_up x + b -> clamped SwiGLU (alpha, limit: config.h) ->
//              down + b (moe_experts with MOE_ACT_SWIGLU_CLAMP and biases).
//
// Checkpoint layout (HF names under model.layers.<l>.): mlp.router.{weight, bias};
// mlp.experts.gate_up_proj (E, H, 2I) with gate / up columns interleaved (gate_j at 2j, up_j at
// 2j + 1) and gate_up_proj_bias (E, 2I) likewise; mlp.experts.down_proj (E, I, H) and
// down_proj_bias (E, H); self_attn.sinks (heads). The loader transposes the experts into the
// (E, rows, cols) layout moe_experts takes and de-interleaves gate_up into (gate rows, up rows)
// (weight_loader.h, WLAYOUT_STACKED). MXFP4 checkpoints store the experts as
// <name>_blocks / <name>_scales (rows = output features, 32-value blocks along the input), kept
// in MXFP4 in memory (WEIGHT_SCHEME_MX); attention, router, embeddings and lm_head are bf16.
#include <string.h>

#include "common/check.h"
#include "model/arch.h"
#include "model/blocks.h"

#define L_FIELD(f) offsetof(struct model_layer, f)

static const struct weight_entry gpt_oss_attn_weights[] = {
    {.field = L_FIELD(attn.gqa.qkv), .is_weight = true, .shard = WSHARD_COL, .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.q_proj.weight", WDIM_Q}, {"self_attn.k_proj.weight", WDIM_KV},
               {"self_attn.v_proj.weight", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.qkv_bias), .init = WINIT_BIAS, .shard = WSHARD_COL, .cond = WCOND_ATTN_BIAS,
     .parts = {{"self_attn.q_proj.bias", WDIM_Q}, {"self_attn.k_proj.bias", WDIM_KV},
               {"self_attn.v_proj.bias", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.o), .is_weight = true, .shard = WSHARD_ROW, .cols = WDIM_Q,
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    {.field = L_FIELD(attn.gqa.o_bias), .init = WINIT_BIAS, .shard = WSHARD_ROW_BIAS, .cond = WCOND_ATTN_OUT_BIAS,
     .parts = {{"self_attn.o_proj.bias", WDIM_HIDDEN}}},
    {.field = L_FIELD(attn.gqa.sinks), .init = WINIT_BIAS, .shard = WSHARD_COL, .f32 = true,
     .parts = {{"self_attn.sinks", WDIM_HEADS}}},
    WEIGHT_TABLE_END,
};

static const struct weight_entry gpt_oss_moe_weights[] = {
    {.field = L_FIELD(ffn.moe.router), .is_weight = true, .cols = WDIM_HIDDEN,
     .parts = {{"mlp.router.weight", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.router_bias), .init = WINIT_BIAS, .f32 = true, .parts = {{"mlp.router.bias", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.gate_up), .is_weight = true, .per_expert = true, .cols = WDIM_HIDDEN,
     .layout = WLAYOUT_STACKED, .transposed = true, .interleaved = true,
     .parts = {{"mlp.experts.gate_up_proj", WDIM_MOE_INTER2}}},
    {.field = L_FIELD(ffn.moe.gate_up_bias), .init = WINIT_BIAS, .per_expert = true, .layout = WLAYOUT_STACKED,
     .interleaved = true, .parts = {{"mlp.experts.gate_up_proj_bias", WDIM_MOE_INTER2}}},
    {.field = L_FIELD(ffn.moe.down), .is_weight = true, .per_expert = true, .cols = WDIM_MOE_INTER,
     .layout = WLAYOUT_STACKED, .transposed = true, .parts = {{"mlp.experts.down_proj", WDIM_HIDDEN}}},
    {.field = L_FIELD(ffn.moe.down_bias), .init = WINIT_BIAS, .per_expert = true, .layout = WLAYOUT_STACKED,
     .parts = {{"mlp.experts.down_proj_bias", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

static atomc_status gpt_oss_check(const struct model_config *c, struct error *err) {
    if (c->num_experts <= 0 || c->num_experts > 1024 || c->num_experts_per_tok <= 0 ||
        c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0)
        return error_set(err, ATOMC_ERR_FORMAT, "%s config: %d experts, top-%d, intermediate_size %d (need 1..1024 "
                         "experts, 1 <= top-k <= experts)", c->architecture, c->num_experts, c->num_experts_per_tok,
                         c->moe_intermediate_size);
    for (int l = 0; l < c->num_layers; l++) {
        if (c->layer_types[l] == LAYER_ATTN_LINEAR)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "layer %d uses linear attention, which %s does not have", l,
                             c->architecture);
        if (!model_config_layer_is_moe(c, l))
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config makes layer %d dense (decoder_sparse_step / "
                             "mlp_only_layers / first_k_dense_replace); GPT-OSS layers are all MoE", c->architecture, l);
    }
    if (!c->norm_topk_prob || c->n_shared_experts > 0 || c->n_group > 1 || strcmp(c->scoring_func, "softmax") ||
        c->routed_scaling_factor != 1.0f)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config changes the router (norm_topk_prob %d, %d shared "
                         "experts, n_group %d, scoring '%s', routed_scaling_factor %g); GPT-OSS routes by a softmax "
                         "over the top-k logits only", c->architecture, (int)c->norm_topk_prob, c->n_shared_experts,
                         c->n_group, c->scoring_func, c->routed_scaling_factor);
    if (!(c->swiglu_alpha > 0.0f) || c->qk_norm || c->mlp_bias || c->rope.interleaved || c->q_lora_rank > 0 ||
        c->kv_lora_rank > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for q/k norm, mlp_bias, interleaved RoPE or MLA, "
                         "or has no swiglu_alpha, which the GPT-OSS forward does not implement", c->architecture);
    return ATOMC_OK;
}

static void gpt_oss_plan_layer(const struct model *m, int l, struct layer_plan *p) {
    const struct model_config *c = &m->cfg;
    const int window = c->layer_types[l] == LAYER_ATTN_SLIDING ? c->sliding_window : 0;
    *p = (struct layer_plan){
        .attn_kind = ATTN_KIND_GQA,
        .ffn_kind = FFN_KIND_MOE,
        .sliding_window = window,
        .cache = {.kind = window > 0 ? CACHE_KIND_SLIDING : CACHE_KIND_FULL, .n_kv_heads = c->num_kv_heads,
                  .head_dim_k = c->head_dim, .head_dim_v = c->head_dim, .window = window},
        .tables = {weights_layer_norms, gpt_oss_attn_weights, gpt_oss_moe_weights},
    };
}

static void gpt_oss_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
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

static const enum model_arch gpt_oss_archs[] = {MODEL_ARCH_GPT_OSS, MODEL_ARCH_UNKNOWN};

const struct model_arch_def model_arch_gpt_oss = {
    .family = "gpt_oss",
    .archs = gpt_oss_archs,
    .check = gpt_oss_check,
    .plan_layer = gpt_oss_plan_layer,
    .forward = gpt_oss_forward,
};
