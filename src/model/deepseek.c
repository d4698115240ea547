// The DeepSeek family: DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (DeepSeek-V2 / V2-Lite,
// DeepSeek-V3 / R1, Kimi-K2, Moonlight use these). Per layer:
//
//   block_attention: MLA over the latent cache (block_mla.c; q_lora_rank 0 = direct q_proj)
//   block_ffn:       dense MLP on the first first_k_dense_replace layers (and off the
//                    moe_layer_freq grid), else router + routed experts + shared experts
//
// Shared experts: HF keeps them as one MLP of n_shared * moe_inter (mlp.shared_experts.*);
// finish_load stacks them after the routed experts as n_shared experts of moe_inter each (chunk j
// = gate / up rows [j I, (j + 1) I) and down columns [j I, (j + 1) I)), which moe_route gives
// every token as fixed slots of weight 1 (backend.h moe_route_args): the same sum, one fused op.
//
// Routing (moe_route, backend.h): V2 softmax top-k (topk_method greedy; group_limited_greedy keeps
// the topk_group groups with the largest max), V3 noaux_tc (sigmoid scores, selection by score +
// e_score_correction_bias within the topk_group groups of largest top-2 sum, weights from the plain
// scores), times routed_scaling_factor, renormalised when norm_topk_prob (as DeepSeek's code and
// vLLM; transformers' DeepseekV2 router never renormalises, so the V2 fixture keeps it false). The
// correction bias is kept in F32 (finish_load converts it), as moe_route takes it.
//
// FP8 checkpoints (quant_method fp8, 128x128 blocks: DeepSeek-V3 / R1, Kimi-K2): every linear the
// checkpoint stores in FP8 (q_a / q_b / q / kv_a / o, dense MLPs, routed and shared experts) stays
// FP8 in memory and runs on the matmul / moe_experts block-FP8 paths (W8A8 with per-token
// 128-column activation groups, or weight-only); the shared expert is stacked by the loader
// (ds_moe_quant_weights), and kv_b_proj, which the absorbed attention reads as W_UK / W_UV, is
// dequantized at load into the plain weight dtype (deepseek_dequant_kv_b). Routers stay plain
// (transformers never converts them); modules_to_not_convert is honoured by quant.c's plans.
// Other quant methods and quantized checkpoints with more than one shared expert are refused.
//
// DSA (GlmMoeDsaForCausalLM = GLM-5, DeepseekV32ForCausalLM; index_n_heads > 0): the same MLA
// layers plus the lightning indexer (self_attn.indexer.*: wq_b from the normed q_a, wk with a
// LayerNorm, weights_proj) on every layer whose indexer_types entry is "full"; its keys are cached
// per token beside the latent (cache_spec.index_dim, kv->v) and each query attends to its
// index_topk best keys (block_mla.c, backend.h "---- DSA ----"). "shared" layers reuse the previous
// full layer's selection. Quantized DSA checkpoints and backends without the DSA ops are refused.
//
// MTP layers (num_nextn_predict_layers, stored as model.layers.<num_hidden_layers + i>.*) load
// through src/model/mtp.c for speculative method mtp (finish_load stacks their experts and
// dequantizes their kv_b too); otherwise their tensors are marked read with a log line.
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "loader/model_files.h"
#include "loader/safetensors.h"
#include "model/arch.h"
#include "model/blocks.h"

#define L_FIELD(f) offsetof(struct model_layer, f)

static const struct weight_entry ds_mla_weights[] = {
    {.field = L_FIELD(attn.mla.q),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .cond = WCOND_NO_Q_LORA,
     .parts = {{"self_attn.q_proj.weight", WDIM_MLA_Q}}},
    {.field = L_FIELD(attn.mla.q_a),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .cond = WCOND_Q_LORA,
     .parts = {{"self_attn.q_a_proj.weight", WDIM_Q_LORA}}},
    {.field = L_FIELD(attn.mla.q_a_norm),
     .init = WINIT_NORM,
     .cond = WCOND_Q_LORA,
     .parts = {{"self_attn.q_a_layernorm.weight", WDIM_Q_LORA}}},
    {.field = L_FIELD(attn.mla.q_b),
     .is_weight = true,
     .cols = WDIM_Q_LORA,
     .cond = WCOND_Q_LORA,
     .parts = {{"self_attn.q_b_proj.weight", WDIM_MLA_Q}}},
    {.field = L_FIELD(attn.mla.kv_a),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.kv_a_proj_with_mqa.weight", WDIM_KV_A}}},
    {.field = L_FIELD(attn.mla.kv_a_norm),
     .init = WINIT_NORM,
     .parts = {{"self_attn.kv_a_layernorm.weight", WDIM_KV_LORA}}},
    {.field = L_FIELD(attn.mla.kv_b),
     .is_weight = true,
     .cols = WDIM_KV_LORA,
     .parts = {{"self_attn.kv_b_proj.weight", WDIM_KV_B}}},
    {.field = L_FIELD(attn.mla.o),
     .is_weight = true,
     .cols = WDIM_MLA_O,
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// DSA's lightning indexer (GLM-5 / DeepSeek-V3.2), on the layers that run their own.
static const struct weight_entry ds_dsa_weights[] = {
    {.field = L_FIELD(attn.mla.idx_wq_b),
     .is_weight = true,
     .cols = WDIM_Q_LORA,
     .parts = {{"self_attn.indexer.wq_b.weight", WDIM_INDEX_Q}}},
    {.field = L_FIELD(attn.mla.idx_wk),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.indexer.wk.weight", WDIM_INDEX_HEAD}}},
    {.field = L_FIELD(attn.mla.idx_k_norm),
     .init = WINIT_NORM,
     .parts = {{"self_attn.indexer.k_norm.weight", WDIM_INDEX_HEAD}}},
    {.field = L_FIELD(attn.mla.idx_k_norm_b),
     .init = WINIT_BIAS,
     .parts = {{"self_attn.indexer.k_norm.bias", WDIM_INDEX_HEAD}}},
    {.field = L_FIELD(attn.mla.idx_weights),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.indexer.weights_proj.weight", WDIM_INDEX_HEADS}}},
    WEIGHT_TABLE_END,
};

// MoE layers beyond weights_moe_routed (router + experts): noaux_tc's correction bias and the shared
// experts (stacked after the routed ones by finish_load).
static const struct weight_entry ds_moe_extra_weights[] = {
    {.field = L_FIELD(ffn.moe.score_bias),
     .init = WINIT_BIAS,
     .cond = WCOND_SCORE_BIAS,
     .f32 = true, // loaded as F32 whatever the weight dtype: BF16 would round it and move expert selection
     .parts = {{"mlp.gate.e_score_correction_bias", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.shared_gate_up),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .cond = WCOND_SHARED_EXPERTS,
     .parts = {{"mlp.shared_experts.gate_proj.weight", WDIM_SHARED_INTER},
               {"mlp.shared_experts.up_proj.weight", WDIM_SHARED_INTER}}},
    {.field = L_FIELD(ffn.moe.shared_down),
     .is_weight = true,
     .cols = WDIM_SHARED_INTER,
     .cond = WCOND_SHARED_EXPERTS,
     .parts = {{"mlp.shared_experts.down_proj.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// MoE layers of a quantized checkpoint: the router, its bias and the experts with the shared expert
// stacked after the routed ones by the loader (weight_loader.h shared_parts), which keeps the FP8
// values and their block scales as stored; finish_load's byte-copy stacking takes plain weights.
static const struct weight_entry ds_moe_quant_weights[] = {
    {.field = L_FIELD(ffn.moe.router),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.gate.weight", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe.score_bias),
     .init = WINIT_BIAS,
     .cond = WCOND_SCORE_BIAS,
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

// ---------------------------------------------------------------------------------------------
// Config check and layer plan

static atomc_status deepseek_check(const struct model_config *c, struct error *err) {
    const char *a = c->architecture;
    if (c->kv_lora_rank <= 0 || c->qk_nope_head_dim <= 0 || c->qk_rope_head_dim <= 0 || c->v_head_dim <= 0 ||
        c->q_lora_rank < 0)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s config: kv_lora_rank %d, qk_nope_head_dim %d, qk_rope_head_dim %d, "
                         "v_head_dim %d, q_lora_rank %d (MLA needs the first four positive)",
                         a, c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim, c->q_lora_rank);
    if (c->qk_rope_head_dim % 2 != 0 || c->rope.rotary_dim != c->qk_rope_head_dim)
        return error_set(err, ATOMC_ERR_FORMAT, "%s config: qk_rope_head_dim %d must be even and fully rotated", a,
                         c->qk_rope_head_dim);
    if (c->hidden_act[0] && strcmp(c->hidden_act, "silu"))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: hidden_act '%s' is not supported (only silu)", a,
                         c->hidden_act);
    if (c->attention_bias || c->mlp_bias)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: attention_bias / mlp_bias are not implemented for MLA", a);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] != LAYER_ATTN_FULL)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: layer %d is not full attention, which MLA does not "
                             "implement",
                             a, l);
    // Quantized checkpoints: quant_method fp8 (DeepSeek-V3 / R1 / Kimi-K2's 128x128 FP8 blocks) only;
    // model_quant_check has already refused the fp8 variants quant.c lacks. Other methods (INT4
    // groups, compressed-tensors) would need kv_b_proj dequantized from their formats: refused.
    if (c->quant.present && c->quant.method != QUANT_METHOD_FP8)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quantized checkpoints of quant_method '%s' are not implemented for DeepSeek "
                         "(only quant_method 'fp8', FP8 e4m3 weights in 128x128 blocks)",
                         a, c->quant.method_name[0] ? c->quant.method_name : c->quant.origin);
    if (c->quant.present && c->n_shared_experts > 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: %d shared experts in a quantized checkpoint: slicing the FP8 shared MLP into "
                         "experts is not implemented (one shared expert is, as DeepSeek-V3 / Kimi-K2 have)",
                         a, c->n_shared_experts);
    if (c->attention_sinks) return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: attention sinks with MLA", a);
    if (c->index_n_heads > 0) { // DSA
        if (c->q_lora_rank <= 0 || c->index_head_dim < c->qk_rope_head_dim || c->index_topk <= 0 ||
            c->index_topk > (1 << 20))
            return error_set(err, ATOMC_ERR_FORMAT,
                             "%s config: the DSA indexer needs q_lora_rank > 0 (%d), index_head_dim >= "
                             "qk_rope_head_dim (%d, %d) and 0 < index_topk <= 2^20 (%d)",
                             a, c->q_lora_rank, c->index_head_dim, c->qk_rope_head_dim, c->index_topk);
        if (c->quant.present)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: quantized checkpoints with the DSA indexer (quant_method '%s') are not implemented",
                             a, c->quant.method_name);
    }
    if (c->num_experts > 0) {
        if (c->num_experts > 1024 || c->num_experts_per_tok <= 0 || c->num_experts_per_tok > c->num_experts ||
            c->moe_intermediate_size <= 0 || c->n_shared_experts < 0 || c->n_shared_experts > 64)
            return error_set(err, ATOMC_ERR_FORMAT,
                             "%s config: %d experts, top-%d, %d shared, moe_intermediate_size "
                             "%d",
                             a, c->num_experts, c->num_experts_per_tok, c->n_shared_experts, c->moe_intermediate_size);
        // transformers: V2 routes by softmax (greedy / group_limited_greedy), V3 by sigmoid (noaux_tc).
        const bool noaux = !strcmp(c->topk_method, "noaux_tc"), sig = !strcmp(c->scoring_func, "sigmoid");
        if (noaux != sig)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: topk_method '%s' with scoring_func '%s' is not "
                             "implemented (noaux_tc scores by sigmoid, greedy / group_limited_greedy by softmax)",
                             a, c->topk_method, c->scoring_func);
        if (strcmp(c->topk_method, "greedy") && c->n_group > 1) {
            const int G = c->num_experts / c->n_group;
            if (c->num_experts % c->n_group || c->topk_group < 1 || c->topk_group > c->n_group ||
                c->topk_group * G < c->num_experts_per_tok || (noaux && G < 2))
                return error_set(err, ATOMC_ERR_FORMAT,
                                 "%s config: %d experts in n_group %d, topk_group %d, top-%d "
                                 "(the kept groups must hold at least top-k experts; noaux_tc groups at least 2)",
                                 a, c->num_experts, c->n_group, c->topk_group, c->num_experts_per_tok);
        }
        if (!(c->routed_scaling_factor > 0))
            return error_set(err, ATOMC_ERR_FORMAT, "%s config: routed_scaling_factor %g must be positive", a,
                             c->routed_scaling_factor);
    }
    return ATOMC_OK;
}

static void deepseek_plan_layer(const struct model *m, int l, struct layer_plan *p) {
    const struct model_config *c = &m->cfg;
    const bool moe = model_config_layer_is_moe(c, l);
    *p = (struct layer_plan){
        .attn_kind = ATTN_KIND_MLA,
        .ffn_kind = moe ? FFN_KIND_MOE : FFN_KIND_DENSE,
        .cache = {.kind = CACHE_KIND_LATENT, .latent_dim = c->kv_lora_rank + c->qk_rope_head_dim},
        .tables = {weights_layer_norms, ds_mla_weights, moe ? weights_moe_routed : weights_dense_mlp,
                   moe ? ds_moe_extra_weights : NULL},
    };
    if (moe && c->quant.present) {
        p->tables[2] = ds_moe_quant_weights;
        p->tables[3] = NULL;
    }
    if (c->index_n_heads > 0 && !c->index_shared[l]) { // DSA: its indexer, its keys beside the latent
        p->cache.index_dim = c->index_head_dim;
        for (int t = LAYER_MAX_TABLES - 1; t > 2; t--)
            p->tables[t] = p->tables[t - 1];
        p->tables[2] = ds_dsa_weights;
    }
}

// ---------------------------------------------------------------------------------------------
// Load: shared experts stacked after the routed ones; MTP layers skipped.

static bool plain_float(const struct weight *w) {
    return w->scheme == WEIGHT_SCHEME_NONE &&
           (w->t.dtype == DTYPE_F32 || w->t.dtype == DTYPE_BF16 || w->t.dtype == DTYPE_F16);
}

// Routed (E, 2I, H) / (E, H, I) plus the shared MLP (2 S I, H) / (H, S I) -> (E + S, 2I, H) /
// (E + S, H, I), one new allocation each; the four inputs are freed.
static atomc_status deepseek_stack_shared(struct model *m, int l, struct ffn_moe_weights *w, struct error *err) {
    struct backend *b = m->backend;
    const int64_t E = w->gate_up.t.ne[0], I = m->cfg.moe_intermediate_size, H = m->cfg.hidden_size;
    const int64_t S = m->cfg.n_shared_experts;
    const enum dtype dt = w->gate_up.t.dtype;
    if (!plain_float(&w->gate_up) || !plain_float(&w->down) || !plain_float(&w->shared_gate_up) ||
        !plain_float(&w->shared_down) || w->down.t.dtype != dt || w->shared_gate_up.t.dtype != dt ||
        w->shared_down.t.dtype != dt)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "layer %d: stacking shared experts needs the routed and shared "
                         "expert weights in one plain float dtype (got %s / %s / %s / %s)",
                         l, dtype_name(w->gate_up.t.dtype), dtype_name(w->down.t.dtype),
                         dtype_name(w->shared_gate_up.t.dtype), dtype_name(w->shared_down.t.dtype));
    CHECK(w->gate_up.t.ne[1] == 2 * I && w->gate_up.t.ne[2] == H && w->shared_gate_up.t.ne[0] == 2 * S * I &&
          w->shared_down.t.ne[0] == H && w->shared_down.t.ne[1] == S * I);
    const size_t row_h = dtype_row_bytes(dt, H), row_i = dtype_row_bytes(dt, I);
    const size_t gu_bytes = (size_t)((E + S) * 2 * I) * row_h, dn_bytes = (size_t)((E + S) * H) * row_i;
    char *gu = b->ops->alloc(b, gu_bytes), *dn = b->ops->alloc(b, dn_bytes);
    if (!gu || !dn) {
        if (gu) b->ops->free(b, gu);
        if (dn) b->ops->free(b, dn);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d: cannot allocate %zu bytes for the stacked experts", l,
                         gu_bytes + dn_bytes);
    }
    b->ops->copy_d2d(b, gu, w->gate_up.t.data, (size_t)(E * 2 * I) * row_h);
    b->ops->copy_d2d(b, dn, w->down.t.data, (size_t)(E * H) * row_i);
    const char *sgu = w->shared_gate_up.t.data, *sdn = w->shared_down.t.data;
    for (int64_t j = 0; j < S; j++) {
        char *dst = gu + (size_t)((E + j) * 2 * I) * row_h;
        b->ops->copy_d2d(b, dst, sgu + (size_t)(j * I) * row_h, (size_t)I * row_h); // gate rows
        b->ops->copy_d2d(b, dst + (size_t)I * row_h, sgu + (size_t)((S + j) * I) * row_h, (size_t)I * row_h); // up
        char *ddst = dn + (size_t)((E + j) * H) * row_i;
        if (S == 1) {
            b->ops->copy_d2d(b, ddst, sdn, (size_t)H * row_i);
        } else {
            const size_t srow = dtype_row_bytes(dt, S * I);
            for (int64_t r = 0; r < H; r++)
                b->ops->copy_d2d(b, ddst + (size_t)r * row_i, sdn + (size_t)r * srow + (size_t)j * row_i, row_i);
        }
    }
    b->ops->synchronize(b);
    b->ops->free(b, w->gate_up.t.data);
    b->ops->free(b, w->down.t.data);
    b->ops->free(b, w->shared_gate_up.t.data);
    b->ops->free(b, w->shared_down.t.data);
    w->shared_gate_up.t.data = w->shared_down.t.data = NULL;
    w->gate_up.t = tensor_make(gu, dt, 3, (int64_t[]){E + S, 2 * I, H});
    w->down.t = tensor_make(dn, dt, 3, (int64_t[]){E + S, H, I});
    return ATOMC_OK;
}

// The correction bias in F32 (moe_route's contract), converted through the host if stored otherwise.
static atomc_status deepseek_bias_f32(struct model *m, int l, struct tensor *t, struct error *err) {
    if (!t->data || t->dtype == DTYPE_F32) return ATOMC_OK;
    struct backend *b = m->backend;
    const int64_t n = tensor_numel(t);
    void *h = xmalloc(tensor_bytes(t));
    float *f = xmalloc((size_t)n * sizeof(float));
    b->ops->synchronize(b);
    b->ops->copy_d2h(b, h, t->data, tensor_bytes(t));
    b->ops->synchronize(b);
    dtype_to_f32(t->dtype, h, f, n);
    void *d = b->ops->alloc(b, (size_t)n * sizeof(float));
    if (!d) {
        free(h);
        free(f);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d: cannot allocate the routing bias", l);
    }
    b->ops->copy_h2d(b, d, f, (size_t)n * sizeof(float));
    b->ops->synchronize(b);
    free(h);
    free(f);
    m->weight_bytes += (size_t)n * sizeof(float) - tensor_bytes(t);
    b->ops->free(b, t->data);
    *t = tensor_make(d, DTYPE_F32, 1, (int64_t[]){n});
    return ATOMC_OK;
}

// kv_b_proj of an FP8 checkpoint, dequantized into the model's plain weight dtype (F32 on the CPU,
// BF16 on CUDA): mla_latent_write / mla_attention absorb W_UK into the query and apply W_UV after
// attention as plain-weight products over the latent (backend.h mla_args), as vLLM and SGLang
// dequantize it for their absorbed MLA. w = fp8 * scale per 128x128 block (or per channel /
// tensor), computed in fp32 then rounded once to the weight dtype; the latent input is not
// activation-quantized (the W8A8 refs leave kv_b's input unrounded too).
static atomc_status deepseek_dequant_kv_b(struct model *m, int l, struct weight *w, struct error *err) {
    if (w->scheme == WEIGHT_SCHEME_NONE || !w->t.data) return ATOMC_OK;
    struct backend *b = m->backend;
    if (w->t.dtype != DTYPE_FP8_E4M3 || w->t.ndim != 2 ||
        (w->scheme != WEIGHT_SCHEME_BLOCK && w->scheme != WEIGHT_SCHEME_PER_CHANNEL &&
         w->scheme != WEIGHT_SCHEME_PER_TENSOR))
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "layer %d: kv_b_proj in weight scheme %s with %s values: dequantizing it for the absorbed "
                         "MLA is implemented for FP8 blocks / channels / tensors only",
                         l, weight_scheme_name(w->scheme), dtype_name(w->t.dtype));
    const int64_t R = w->t.ne[0], C = w->t.ne[1], n = R * C;
    const size_t sbytes = tensor_bytes(&w->scale);
    uint8_t *q = xmalloc((size_t)n);
    float *sc = xmalloc(sbytes), *f = xmalloc((size_t)n * sizeof(float));
    b->ops->synchronize(b);
    b->ops->copy_d2h(b, q, w->t.data, (size_t)n);
    b->ops->copy_d2h(b, sc, w->scale.data, sbytes);
    b->ops->synchronize(b);
    const int64_t scols = w->scheme == WEIGHT_SCHEME_BLOCK ? (C + w->block_cols - 1) / w->block_cols : 1;
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < C; k++) {
            float s = w->scheme == WEIGHT_SCHEME_BLOCK         ? sc[(r / w->block_rows) * scols + k / w->block_cols]
                      : w->scheme == WEIGHT_SCHEME_PER_CHANNEL ? sc[r]
                                                               : sc[0];
            f[r * C + k] = fp8_e4m3_to_f32(q[r * C + k]) * s;
        }
    const enum dtype dt = m->weight_dtype;
    const size_t bytes = dtype_row_bytes(dt, C) * (size_t)R;
    void *h = xmalloc(bytes), *d = b->ops->alloc(b, bytes);
    atomc_status st = ATOMC_OK;
    if (!d) {
        st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d: cannot allocate %zu bytes for kv_b_proj", l, bytes);
    } else {
        dtype_from_f32(dt, f, h, n);
        b->ops->copy_h2d(b, d, h, bytes);
        b->ops->synchronize(b);
        const size_t qbytes = (size_t)n + sbytes;
        m->weight_bytes += bytes - qbytes;
        m->weight_bytes_by_scheme[w->scheme] -= qbytes;
        b->ops->free(b, w->t.data);
        b->ops->free(b, w->scale.data);
        *w = (struct weight){.t = tensor_2d(d, dt, R, C), .scheme = WEIGHT_SCHEME_NONE};
    }
    free(q);
    free(sc);
    free(f);
    free(h);
    return st;
}

static atomc_status deepseek_finish_load(struct model *m, struct weight_loader *L, const struct model_load_options *o,
                                         struct error *err) {
    (void)o;
    const struct model_config *c = &m->cfg;
    int kv_b_dequantized = 0;
    for (int l = 0; l < c->num_layers + m->n_mtp; l++) { // the MTP layers (mtp.c) after the decoder's
        struct model_layer *ly = l < c->num_layers ? &m->layers[l] : &m->mtp[l - c->num_layers].layer;
        if (ly->attn.mla.kv_b.scheme != WEIGHT_SCHEME_NONE) {
            atomc_status st = deepseek_dequant_kv_b(m, l, &ly->attn.mla.kv_b, err);
            if (st != ATOMC_OK) return st;
            kv_b_dequantized++;
        }
        if (ly->ffn_kind != FFN_KIND_MOE) continue;
        atomc_status st = deepseek_bias_f32(m, l, &ly->ffn.moe.score_bias, err);
        // Quantized checkpoints have the shared expert stacked by the loader (ds_moe_quant_weights).
        if (st == ATOMC_OK && c->n_shared_experts > 0 && ly->ffn.moe.shared_gate_up.t.data)
            st = deepseek_stack_shared(m, l, &ly->ffn.moe, err);
        if (st != ATOMC_OK) return st;
    }
    if (kv_b_dequantized)
        LOG_INFO("%s: kv_b_proj of %d layer(s) dequantized to %s at load (the absorbed MLA's W_UK / W_UV)",
                 c->architecture, kv_b_dequantized, dtype_name(m->weight_dtype));
    struct model_files *mf = weight_loader_files(L);
    if (mf && c->num_nextn_predict_layers > 0 && m->n_mtp == 0) {
        size_t n = 0;
        for (int i = 0; i < c->num_nextn_predict_layers; i++) {
            char prefix[48];
            int pl = snprintf(prefix, sizeof prefix, "model.layers.%d.", c->num_layers + i);
            if (mf->kind == MODEL_FILES_HF && mf->st) {
                for (size_t k = 0; k < mf->st->n_entries; k++)
                    if (!strncmp(mf->st->entries[k].name, prefix, (size_t)pl))
                        n += model_files_mark_consumed(mf, mf->st->entries[k].name);
            }
        }
        LOG_INFO("%s: %d MTP layer(s) (num_nextn_predict_layers) not loaded: %zu tensors skipped", c->architecture,
                 c->num_nextn_predict_layers, n);
    }
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// Forward

static void deepseek_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
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

// DSA (scratch.extra): per token the indexer's q (IH ID), k (ID), head weights (IH) and the
// top-k list (index_topk int32, 16-byte aligned), in act-dtype columns.
static int64_t deepseek_extra_scratch_cols(const struct model *m) {
    const struct model_config *c = &m->cfg;
    if (c->index_n_heads <= 0) return 0;
    const int64_t e = (int64_t)dtype_row_bytes(m->backend->act_dtype, 1);
    return (int64_t)c->index_n_heads * c->index_head_dim + c->index_head_dim + c->index_n_heads +
           ((int64_t)c->index_topk * (int64_t)sizeof(int32_t) + e - 1) / e + 16 / e; // + 16: the list 16-aligned
}

static const enum model_arch deepseek_archs[] = {MODEL_ARCH_DEEPSEEK_V2, MODEL_ARCH_DEEPSEEK_V3, MODEL_ARCH_GLM_MOE_DSA,
                                                 MODEL_ARCH_DEEPSEEK_V32, MODEL_ARCH_UNKNOWN};

const struct model_arch_def model_arch_deepseek = {
    .family = "deepseek",
    .archs = deepseek_archs,
    .check = deepseek_check,
    .plan_layer = deepseek_plan_layer,
    .forward = deepseek_forward,
    .finish_load = deepseek_finish_load,
    .extra_scratch_cols = deepseek_extra_scratch_cols,
    .mtp = true,
};
