// MiMo-V2-Flash: MiMoV2FlashForCausalLM, as transformers' modeling_mimo_v2_flash computes it. A
// pre-norm decoder of GQA attention and MoE layers, written with the shared blocks (blocks.c)
// except for its attention, whose shapes differ per layer type:
//
//   residual = embed[ids]
//   per layer:  x = rmsnorm(residual += h)
//               attention   q (heads x head_dim), k (kv x head_dim), v (kv x v_head_dim) from one
//                           fused GEMM (no biases unless attention_bias); full layers have
//                           num_key_value_heads KV heads, sliding layers swa_num_kv_heads (2x) and
//                           per-head sinks (self_attn.attention_sink_bias, HF's `sinks`); RoPE on
//                           the first rotary_dim dims of q / k (NeoX halves of that part), with the
//                           layer type's theta and partial factor (model.rope / model.rope_sliding);
//                           softmax scale head_dim^-1/2; window `sliding_window` on sliding layers
//                           (HF's mask: the last W positions, itself included)
//                           out = o_proj(attention_value_scale x attn): HF multiplies v by the
//                           scale before the cache, the same linear map; it is folded into o_proj's
//                           weights at load (finish_load)
//               x = rmsnorm(residual += h)
//               block_ffn   dense MLP on mlp_layer_types "dense" layers (mlp_only_layers); else the
//                           routed experts: F32 router logits -> sigmoid, + e_score_correction_bias
//                           to select (n_group / topk_group as DeepSeek-V3), top-k, weights from
//                           the uncorrected scores renormalised (norm_topk_prob) x
//                           routed_scaling_factor; no shared experts
//   logits rows only: model_compute_logits
//
// The checkpoint's model.mtp.* tensors (multi-token prediction) are not loaded, as transformers
// ignores them; the count is logged. The FP8 release (quant_method fp8: every linear of the
// decoder layers in FP8 e4m3 with 128x128 block scales, weight_scale_inv; routers, sinks, norms,
// embeddings and lm_head as stored) loads through the shared quantized-weight loader (fused q/k/v
// regridded to common row blocks, experts stacked with their scales); attention_value_scale goes
// into o_proj's block scales. Its config.json is in the release's own format (hybrid_layer_pattern,
// swa_*, moe_layer_freq: config.c parse_mimo_original). Refused: other quant methods, tensor
// parallelism, v_head_dim > head_dim, shared experts, non-sigmoid scoring, and a backend whose
// attention lacks the (q/k, v) head dims (caps.split_v_head_dim / split_head_dims).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "loader/model_files.h"
#include "loader/safetensors.h"
#include "model/arch.h"
#include "model/blocks.h"

#define L_FIELD(f) offsetof(struct model_layer, f)

// Full-attention layers: num_key_value_heads KV heads, no sinks.
static const struct weight_entry mimo_full_attn_weights[] = {
    {.field = L_FIELD(attn.gqa.qkv),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.q_proj.weight", WDIM_Q},
               {"self_attn.k_proj.weight", WDIM_KV},
               {"self_attn.v_proj.weight", WDIM_KV_V}}},
    {.field = L_FIELD(attn.gqa.qkv_bias),
     .init = WINIT_BIAS,
     .cond = WCOND_ATTN_BIAS,
     .parts = {{"self_attn.q_proj.bias", WDIM_Q},
               {"self_attn.k_proj.bias", WDIM_KV},
               {"self_attn.v_proj.bias", WDIM_KV_V}}},
    {.field = L_FIELD(attn.gqa.o),
     .is_weight = true,
     .cols = WDIM_MLA_O, // num_heads * v_head_dim
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// Sliding-window layers: swa_num_kv_heads KV heads and per-head sinks (F32, as attention takes them).
static const struct weight_entry mimo_swa_attn_weights[] = {
    {.field = L_FIELD(attn.gqa.qkv),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.q_proj.weight", WDIM_Q},
               {"self_attn.k_proj.weight", WDIM_SWA_KV},
               {"self_attn.v_proj.weight", WDIM_SWA_KV_V}}},
    {.field = L_FIELD(attn.gqa.qkv_bias),
     .init = WINIT_BIAS,
     .cond = WCOND_ATTN_BIAS,
     .parts = {{"self_attn.q_proj.bias", WDIM_Q},
               {"self_attn.k_proj.bias", WDIM_SWA_KV},
               {"self_attn.v_proj.bias", WDIM_SWA_KV_V}}},
    {.field = L_FIELD(attn.gqa.o),
     .is_weight = true,
     .cols = WDIM_MLA_O,
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    {.field = L_FIELD(attn.gqa.sinks),
     .init = WINIT_BIAS,
     .f32 = true,
     .parts = {{"self_attn.attention_sink_bias", WDIM_HEADS}}},
    WEIGHT_TABLE_END,
};

// MoE layers: the router mlp.gate (F32 in the checkpoint) with its F32 correction bias, the
// routed experts mlp.experts.E.* stacked per expert.
static const struct weight_entry mimo_moe_weights[] = {
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
     .parts = {{"mlp.experts.%d.gate_proj.weight", WDIM_MOE_INTER}, {"mlp.experts.%d.up_proj.weight", WDIM_MOE_INTER}}},
    {.field = L_FIELD(ffn.moe.down),
     .is_weight = true,
     .per_expert = true,
     .cols = WDIM_MOE_INTER,
     .parts = {{"mlp.experts.%d.down_proj.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

static atomc_status mimo_check(const struct model_config *c, struct error *err) {
    const char *a = c->architecture;
    // The release's quant_method fp8 (FP8 e4m3 in 128x128 blocks; model_quant_check has refused the
    // variants quant.c lacks). Other methods are not implemented for MiMo (nor tested).
    if (c->quant.present && c->quant.method != QUANT_METHOD_FP8)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quantized checkpoints of quant_method '%s' are not implemented for MiMo-V2-Flash "
                         "(only quant_method 'fp8', as the release ships)",
                         a, c->quant.method_name[0] ? c->quant.method_name : c->quant.origin);
    if (c->v_head_dim <= 0 || c->v_head_dim > c->head_dim)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: v_head_dim %d must be in [1, head_dim %d]", a, c->v_head_dim,
                         c->head_dim);
    if (c->swa_num_kv_heads <= 0 || c->num_heads % c->swa_num_kv_heads != 0)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: %d sliding-layer KV heads (2 x num_key_value_heads) do not "
                         "divide %d attention heads",
                         a, c->swa_num_kv_heads, c->num_heads);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] == LAYER_ATTN_LINEAR)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: layer %d is a linear-attention layer, which MiMo-V2-Flash "
                             "does not have",
                             a, l);
    if (c->q_lora_rank > 0 || c->kv_lora_rank > 0 || c->qk_norm || c->mlp_bias || c->rope.interleaved ||
        c->rope_sliding.interleaved || c->attention_out_bias)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s config asks for MLA, q/k norm, mlp_bias, an o_proj bias or "
                         "interleaved RoPE, which MiMo-V2-Flash does not have",
                         a);
    if (c->num_experts <= 0 || c->num_experts > 1024 || c->num_experts_per_tok <= 0 ||
        c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s config: %d experts, top-%d, moe_intermediate_size %d (need 1..1024 "
                         "experts, 1 <= top-k <= experts)",
                         a, c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size);
    if (strcmp(c->scoring_func, "sigmoid") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: scoring_func '%s': MiMo-V2-Flash routes by sigmoid only", a,
                         c->scoring_func);
    if (c->n_shared_experts > 0 || c->first_k_dense_replace > 0 || c->decoder_sparse_step != 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: n_shared_experts / first_k_dense_replace / "
                         "decoder_sparse_step are not MiMo-V2-Flash keys (dense layers come from mlp_layer_types)",
                         a);
    int ng = c->n_group > 0 ? c->n_group : 1, tg = c->topk_group > 0 ? c->topk_group : 1;
    if (c->num_experts % ng != 0 || tg > ng || (ng > 1 && c->num_experts / ng < 2) || (ng == 1 && tg != 1))
        return error_set(err, ATOMC_ERR_FORMAT, "%s: n_group %d / topk_group %d over %d experts", a, ng, tg,
                         c->num_experts);
    return ATOMC_OK;
}

static void mimo_plan_layer(const struct model *m, int l, struct layer_plan *p) {
    const struct model_config *c = &m->cfg;
    const bool moe = model_config_layer_is_moe(c, l), swa = c->layer_types[l] == LAYER_ATTN_SLIDING;
    *p = (struct layer_plan){
        .attn_kind = ATTN_KIND_GQA,
        .ffn_kind = moe ? FFN_KIND_MOE : FFN_KIND_DENSE,
        .sliding_window = swa ? c->sliding_window : 0,
        .cache = {.kind = swa ? CACHE_KIND_SLIDING : CACHE_KIND_FULL,
                  .n_kv_heads = swa ? c->swa_num_kv_heads : c->num_kv_heads,
                  .head_dim_k = c->head_dim,
                  .head_dim_v = c->v_head_dim,
                  .window = swa ? c->sliding_window : 0},
        .tables = {weights_layer_norms, swa ? mimo_swa_attn_weights : mimo_full_attn_weights,
                   moe ? mimo_moe_weights : weights_dense_mlp},
    };
}

// The attention of one layer from the normed f->x into f->h, with the layer's KV head count, its
// RoPE and the split q/k vs v head dims; Q, K, V stay in the fused qkv rows (row stride qkv_l).
static void mimo_attention(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                           const struct attn_metadata *md_all, bool swa) {
    const struct attn_metadata *md = model_layer_metadata(ly, md_all);
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct model_config *c = &m->cfg;
    const struct attn_gqa_weights *w = &ly->attn.gqa;
    const enum dtype dt = b->act_dtype;
    const size_t e = dtype_row_bytes(dt, 1);
    const int64_t T = f->T, hq = c->num_heads, D = c->head_dim, Dv = c->v_head_dim;
    const int64_t hk = swa ? c->swa_num_kv_heads : c->num_kv_heads;
    const int64_t qkv_l = hq * D + hk * (D + Dv);
    char *base = m->scratch.qkv;
    struct tensor qkv = tensor_2d(base, dt, T, qkv_l);
    struct tensor q = tensor_make(base, dt, 3, (int64_t[]){T, hq, D});
    struct tensor k = tensor_make(base + (size_t)(hq * D) * e, dt, 3, (int64_t[]){T, hk, D});
    struct tensor v = tensor_make(base + (size_t)(hq * D + hk * D) * e, dt, 3, (int64_t[]){T, hk, Dv});
    struct tensor out = tensor_make(m->scratch.attn, dt, 3, (int64_t[]){T, hq, Dv});
    struct tensor out2 = tensor_2d(m->scratch.attn, dt, T, hq * Dv);
    struct rope_args rope = swa && m->rope_sliding.inv_freq ? m->rope_sliding : m->rope;
    ops->matmul(b, &qkv, &f->x, &w->qkv, w->qkv_bias.data ? &w->qkv_bias : NULL);
    ops->rope_kv_write(b, &q, &k, &v, qkv_l, &rope, kv, md);
    ops->attention(b, &out, &q, qkv_l, kv, md, 1.0f / sqrtf((float)D), ly->sliding_window,
                   w->sinks.data ? &w->sinks : NULL);
    ops->matmul(b, &f->h, &out2, &w->o, NULL);
}

static void mimo_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                         struct kv_layer *kv) {
    struct fwd_state f;
    fwd_begin(m, &f, md);
    block_embed(m, &f, token_ids);
    for (int l = 0; l < m->cfg.num_layers; l++) {
        const struct model_layer *ly = &m->layers[l];
        m->backend->ops->add_rmsnorm(m->backend, &f.x, &f.residual, f.first ? NULL : &f.h, &ly->attn_norm,
                                     m->cfg.rms_norm_eps);
        f.first = false;
        mimo_attention(m, &f, ly, &kv[l], md, m->cfg.layer_types[l] == LAYER_ATTN_SLIDING);
        block_ffn(m, &f, ly);
    }
    fwd_end(m, &f);
}

// o_proj <- attention_value_scale x o_proj, so the forward needs no scaling pass. Where the
// model's weight dtype is F32 (the CPU backend) a 16-bit o_proj becomes F32, so the product is
// exact (the fp32 reference's v x scale rounds nothing either); otherwise it keeps its dtype (one
// rounding, as HF's bf16 v x scale has). A quantized o_proj (the FP8 release: values x block
// scale) takes the factor in its F32 scales, exactly, its values untouched.
static atomc_status mimo_fold_value_scale(struct model *m, int l, struct weight *o, struct error *err) {
    struct backend *b = m->backend;
    const float s = m->cfg.attention_value_scale;
    struct tensor *t = o->scheme == WEIGHT_SCHEME_NONE ? &o->t : &o->scale;
    if (o->scheme != WEIGHT_SCHEME_NONE &&
        (o->scale.dtype != DTYPE_F32 || o->zero.data || o->scheme == WEIGHT_SCHEME_MX))
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s layer %d: o_proj in weight scheme %s cannot take "
                         "attention_value_scale",
                         m->cfg.architecture, l, weight_scheme_name(o->scheme));
    if (t->dtype != DTYPE_F32 && t->dtype != DTYPE_BF16 && t->dtype != DTYPE_F16)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s layer %d: o_proj in %s cannot take attention_value_scale",
                         m->cfg.architecture, l, dtype_name(t->dtype));
    const int64_t n = tensor_numel(t);
    const size_t bytes = tensor_bytes(t);
    void *h = xmalloc(bytes);
    float *fv = xmalloc((size_t)n * sizeof(float));
    b->ops->synchronize(b);
    b->ops->copy_d2h(b, h, t->data, bytes);
    b->ops->synchronize(b);
    dtype_to_f32(t->dtype, h, fv, n);
    for (int64_t i = 0; i < n; i++)
        fv[i] *= s;
    if (o->scheme == WEIGHT_SCHEME_NONE && m->weight_dtype == DTYPE_F32 && t->dtype != DTYPE_F32) {
        void *d = b->ops->alloc(b, (size_t)n * sizeof(float));
        if (!d) {
            free(h);
            free(fv);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d: cannot allocate o_proj in F32", l);
        }
        b->ops->copy_h2d(b, d, fv, (size_t)n * sizeof(float));
        b->ops->synchronize(b);
        b->ops->free(b, t->data);
        m->weight_bytes += (size_t)n * sizeof(float) - bytes;
        *t = tensor_make(d, DTYPE_F32, t->ndim, t->ne);
    } else {
        dtype_from_f32(t->dtype, fv, h, n);
        b->ops->copy_h2d(b, t->data, h, bytes);
        b->ops->synchronize(b);
    }
    free(h);
    free(fv);
    return ATOMC_OK;
}

static atomc_status mimo_finish_load(struct model *m, struct weight_loader *L, const struct model_load_options *o,
                                     struct error *err) {
    (void)o;
    const struct model_config *c = &m->cfg;
    if (c->attention_value_scale != 1.0f)
        for (int l = 0; l < c->num_layers; l++) {
            atomc_status st = mimo_fold_value_scale(m, l, &m->layers[l].attn.gqa.o, err);
            if (st != ATOMC_OK) return st;
        }
    struct model_files *mf = weight_loader_files(L);
    if (mf && mf->kind == MODEL_FILES_HF && mf->st) {
        size_t n = 0;
        for (size_t k = 0; k < mf->st->n_entries; k++)
            if (!strncmp(mf->st->entries[k].name, "model.mtp.", 10))
                n += model_files_mark_consumed(mf, mf->st->entries[k].name);
        if (n) LOG_INFO("%s: %zu multi-token-prediction tensors (model.mtp.*) not loaded", c->architecture, n);
    }
    return ATOMC_OK;
}

static const enum model_arch mimo_archs[] = {MODEL_ARCH_MIMO_V2_FLASH, MODEL_ARCH_UNKNOWN};

const struct model_arch_def model_arch_mimo = {
    .family = "mimo",
    .archs = mimo_archs,
    .check = mimo_check,
    .plan_layer = mimo_plan_layer,
    .forward = mimo_forward,
    .finish_load = mimo_finish_load,
    .no_tensor_parallel = true,
};
