// The Qwen3-Next family: Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM (Qwen3.5's text model).
// Hybrid layers (config layer_types / full_attention_interval):
//
//   linear attention (Gated DeltaNet), per layer a recurrent state per sequence:
//     qkvz = x Wqkvz^T, ba = x Wba^T                     (two GEMMs; rows reordered at load, below)
//     c = silu(causal depthwise conv1d(q, k, v; conv state))            deltanet_conv
//     o = gated delta rule(l2norm q, l2norm k, v, beta = sigmoid(b),
//                          g = -exp(A_log) softplus(a + dt_bias); state) deltanet_rule
//     h = (rmsnorm(o) * w * silu(z)) Wout^T                              rmsnorm_gated, matmul
//   full attention (gated):
//     [q | gate | k | v] = x W^T  (q_proj's per-head interleaved q / gate rows split at load)
//     q, k = per-head zero-centred RMSNorm, partial RoPE (rotary_dim = head_dim * 0.25), paged
//     attention, attn *= sigmoid(gate), h = attn Wo^T
//   FFN: MoE (softmax top-k, renormalised) + shared expert (dense MLP) times sigmoid(x . w_sg),
//     or a dense MLP on Qwen3-Next's mlp_only_layers.
//
// Load-time layout decisions (finish_load):
// - Qwen3-Next stores in_proj_qkvz / in_proj_ba grouped per key head ([q, k, v, z] of each key
//   head's value-head group; [b, a] likewise); Qwen3.5 stores them as separate in_proj_qkv / z /
//   b / a. Both load into one layout, Qwen3.5's: qkvz rows (q, k, v, z), ba rows (b, a), so the
//   forward is one code path and the conv reads q, k, v as contiguous columns.
// - q_proj's rows per head are (q (head_dim), gate (head_dim)); they are reordered into all q rows
//   then all gate rows, so q, k and v sit in the fused projection as in llama.c and the gate is one
//   strided view.
// - Zero-centred RMSNorm weights (input / post-attention / q / k / final norms: HF scales by
//   (1 + w)) get the 1 added once; on a backend with F32 activations (CPU) the result is kept F32,
//   so a BF16 checkpoint's (1 + w) is not rounded to BF16. The gated RMSNorm of the DeltaNet output
//   uses its weight as is. Dummy weights skip these fix-ups (random weights need no layout).
//
// Refused with a message: quantized checkpoints (the load-time row reorders are written for plain
// tensors), attention biases, tensor parallelism, sliding-window layers, non-softmax routing.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/arch.h"
#include "model/blocks.h"

#define L_FIELD(f) offsetof(struct model_layer, f)

// ---------------------------------------------------------------------------------------------
// Weights

static const struct weight_entry qnext_attn_weights[] = {
    {.field = L_FIELD(attn.gqa.qkv),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"self_attn.q_proj.weight", WDIM_Q_GATED},
               {"self_attn.k_proj.weight", WDIM_KV},
               {"self_attn.v_proj.weight", WDIM_KV}}},
    {.field = L_FIELD(attn.gqa.o),
     .is_weight = true,
     .cols = WDIM_Q,
     .parts = {{"self_attn.o_proj.weight", WDIM_HIDDEN}}},
    {.field = L_FIELD(attn.gqa.q_norm), .init = WINIT_NORM, .parts = {{"self_attn.q_norm.weight", WDIM_HEAD_DIM}}},
    {.field = L_FIELD(attn.gqa.k_norm), .init = WINIT_NORM, .parts = {{"self_attn.k_norm.weight", WDIM_HEAD_DIM}}},
    WEIGHT_TABLE_END,
};

#define DELTANET_COMMON_WEIGHTS                                                                                        \
    {.field = L_FIELD(attn.dn.conv),                                                                                   \
     .init = WINIT_MATRIX,                                                                                             \
     .cols = WDIM_LIN_KERNEL,                                                                                          \
     .parts = {{"linear_attn.conv1d.weight", WDIM_LIN_QKV}}},                                                          \
        {.field = L_FIELD(attn.dn.a_log), .init = WINIT_BIAS, .parts = {{"linear_attn.A_log", WDIM_LIN_VHEADS}}},      \
        {.field = L_FIELD(attn.dn.dt_bias), .init = WINIT_BIAS, .parts = {{"linear_attn.dt_bias", WDIM_LIN_VHEADS}}},  \
        {.field = L_FIELD(attn.dn.norm), .init = WINIT_NORM, .parts = {{"linear_attn.norm.weight", WDIM_LIN_VDIM}}}, { \
        .field = L_FIELD(attn.dn.out), .is_weight = true, .cols = WDIM_LIN_V, .parts = {                               \
            {"linear_attn.out_proj.weight", WDIM_HIDDEN}                                                               \
        }                                                                                                              \
    }

// Qwen3-Next: fused, grouped per key head (reordered in finish_load).
static const struct weight_entry qnext_deltanet_weights[] = {
    {.field = L_FIELD(attn.dn.qkvz),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"linear_attn.in_proj_qkvz.weight", WDIM_LIN_QKVZ}}},
    {.field = L_FIELD(attn.dn.ba),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"linear_attn.in_proj_ba.weight", WDIM_LIN_BA}}},
    DELTANET_COMMON_WEIGHTS,
    WEIGHT_TABLE_END,
};

// Qwen3.5: split projections, fused here in the canonical order.
static const struct weight_entry q35_deltanet_weights[] = {
    {.field = L_FIELD(attn.dn.qkvz),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"linear_attn.in_proj_qkv.weight", WDIM_LIN_QKV}, {"linear_attn.in_proj_z.weight", WDIM_LIN_V}}},
    {.field = L_FIELD(attn.dn.ba),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"linear_attn.in_proj_b.weight", WDIM_LIN_VHEADS}, {"linear_attn.in_proj_a.weight", WDIM_LIN_VHEADS}}},
    DELTANET_COMMON_WEIGHTS,
    WEIGHT_TABLE_END,
};

static const struct weight_entry qnext_moe_weights[] = {
    {.field = L_FIELD(ffn.moe_sh.moe.router),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.gate.weight", WDIM_EXPERTS}}},
    {.field = L_FIELD(ffn.moe_sh.moe.gate_up),
     .is_weight = true,
     .per_expert = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.experts.%d.gate_proj.weight", WDIM_MOE_INTER}, {"mlp.experts.%d.up_proj.weight", WDIM_MOE_INTER}}},
    {.field = L_FIELD(ffn.moe_sh.moe.down),
     .is_weight = true,
     .per_expert = true,
     .cols = WDIM_MOE_INTER,
     .parts = {{"mlp.experts.%d.down_proj.weight", WDIM_HIDDEN}}},
    {.field = L_FIELD(ffn.moe_sh.shared_gate_up),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.shared_expert.gate_proj.weight", WDIM_SHARED_INTER},
               {"mlp.shared_expert.up_proj.weight", WDIM_SHARED_INTER}}},
    {.field = L_FIELD(ffn.moe_sh.shared_down),
     .is_weight = true,
     .cols = WDIM_SHARED_INTER,
     .parts = {{"mlp.shared_expert.down_proj.weight", WDIM_HIDDEN}}},
    {.field = L_FIELD(ffn.moe_sh.shared_gate),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.shared_expert_gate.weight", WDIM_ONE}}},
    WEIGHT_TABLE_END,
};

static const struct weight_entry qnext_mlp_weights[] = {
    {.field = L_FIELD(ffn.dense.gate_up),
     .is_weight = true,
     .cols = WDIM_HIDDEN,
     .parts = {{"mlp.gate_proj.weight", WDIM_INTER}, {"mlp.up_proj.weight", WDIM_INTER}}},
    {.field = L_FIELD(ffn.dense.down),
     .is_weight = true,
     .cols = WDIM_INTER,
     .parts = {{"mlp.down_proj.weight", WDIM_HIDDEN}}},
    WEIGHT_TABLE_END,
};

// ---------------------------------------------------------------------------------------------
// Dimensions

struct qn_dims {
    int64_t hk, hv, dk, dv, conv_dim, qkvz, K;
};

static struct qn_dims qn_dims(const struct model_config *c) {
    struct qn_dims d = {.hk = c->linear_num_key_heads,
                        .hv = c->linear_num_value_heads,
                        .dk = c->linear_key_head_dim,
                        .dv = c->linear_value_head_dim,
                        .K = c->linear_conv_kernel_dim};
    d.conv_dim = 2 * d.hk * d.dk + d.hv * d.dv;
    d.qkvz = d.conv_dim + d.hv * d.dv;
    return d;
}

// ---------------------------------------------------------------------------------------------
// Config check and layer plan

static atomc_status qnext_check(const struct model_config *c, struct error *err) {
    if (strcmp(c->hidden_act, "silu") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "hidden_act '%s' is not supported (only silu)", c->hidden_act);
    if (c->quant.present)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quantized checkpoints (%s) are not implemented for this "
                         "family yet (its fused projections are reordered at load)",
                         c->architecture, c->quant.method_name);
    if (c->attention_bias || c->mlp_bias)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: attention / MLP biases are not implemented", c->architecture);
    if (c->num_experts <= 0 || c->num_experts > 1024 || c->num_experts_per_tok <= 0 ||
        c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0 ||
        c->shared_expert_intermediate_size <= 0)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s config: %d experts, top-%d, moe_intermediate_size %d, "
                         "shared_expert_intermediate_size %d (need 1..1024 experts, 1 <= top-k <= experts, positive "
                         "sizes)",
                         c->architecture, c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size,
                         c->shared_expert_intermediate_size);
    if (c->n_group > 1 || strcmp(c->scoring_func, "softmax"))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: grouped top-k or '%s' scoring is not implemented",
                         c->architecture, c->scoring_func);
    if (c->linear_num_key_heads <= 0 || c->linear_num_value_heads % c->linear_num_key_heads ||
        c->linear_key_head_dim <= 0 || c->linear_value_head_dim <= 0 || c->linear_conv_kernel_dim < 1 ||
        c->linear_conv_kernel_dim > 64)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: linear attention %d key heads x %d, %d value heads x %d, conv "
                         "kernel %d (value heads a multiple of key heads, kernel 1..64)",
                         c->architecture, c->linear_num_key_heads, c->linear_key_head_dim, c->linear_num_value_heads,
                         c->linear_value_head_dim, c->linear_conv_kernel_dim);
    if (!c->qk_norm)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: full attention without q/k norm is not implemented",
                         c->architecture);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] == LAYER_ATTN_SLIDING)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s layer %d: sliding-window attention is not implemented "
                             "for this family",
                             c->architecture, l);
    int n_full = 0;
    for (int l = 0; l < c->num_layers; l++)
        n_full += c->layer_types[l] == LAYER_ATTN_FULL;
    if (n_full == 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: every layer is linear attention; the runner needs at least "
                         "one full-attention layer (its paged KV pool sizes and tracks the sequences)",
                         c->architecture);
    if (c->attention_sinks || c->q_lora_rank > 0 || c->kv_lora_rank > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: attention sinks or MLA are not implemented", c->architecture);
    return ATOMC_OK;
}

static void qnext_plan_layer(const struct model *m, int l, struct layer_plan *p) {
    const struct model_config *c = &m->cfg;
    const bool linear = c->layer_types[l] == LAYER_ATTN_LINEAR, moe = model_config_layer_is_moe(c, l);
    const struct qn_dims d = qn_dims(c);
    *p = (struct layer_plan){
        .attn_kind = linear ? ATTN_KIND_GATED_DELTANET : ATTN_KIND_GQA_GATED,
        .ffn_kind = moe ? FFN_KIND_MOE_SHARED_GATED : FFN_KIND_DENSE,
        .tables = {weights_layer_norms,
                   !linear                            ? qnext_attn_weights
                   : c->arch == MODEL_ARCH_QWEN3_NEXT ? qnext_deltanet_weights
                                                      : q35_deltanet_weights,
                   moe ? qnext_moe_weights : qnext_mlp_weights},
    };
    if (linear)
        p->cache = (struct cache_spec){
            .kind = CACHE_KIND_RECURRENT,
            .conv_dim = (int)d.conv_dim,
            .conv_kernel = (int)d.K,
            .n_v_heads = (int)d.hv,
            .k_dim = (int)d.dk,
            .v_dim = (int)d.dv,
            .state_bytes = ((size_t)d.conv_dim * (size_t)(d.K - 1) + (size_t)(d.hv * d.dk * d.dv)) * sizeof(float)};
    else
        p->cache = (struct cache_spec){.kind = CACHE_KIND_FULL,
                                       .n_kv_heads = c->num_kv_heads,
                                       .head_dim_k = c->head_dim,
                                       .head_dim_v = c->head_dim};
}

// ---------------------------------------------------------------------------------------------
// Scratch: sub-buffers of scratch.extra, each max_tokens rows of a column count rounded up to 8.

enum { XB_QKVZ, XB_BA, XB_CONV, XB_CORE, XB_NORMED, XB_GQKV, XB_SGU, XB_SACT, XB_SH, XB_SG, XB_COUNT };

static int64_t round8(int64_t x) {
    return (x + 7) / 8 * 8;
}

static void qnext_extra_layout(const struct model *m, int64_t *off, int64_t *cols) {
    const struct model_config *c = &m->cfg;
    const struct qn_dims d = qn_dims(c);
    int64_t w[XB_COUNT] = {
        [XB_QKVZ] = d.qkvz,
        [XB_BA] = 2 * d.hv,
        [XB_CONV] = d.conv_dim,
        [XB_CORE] = d.hv * d.dv,
        [XB_NORMED] = d.hv * d.dv,
        [XB_GQKV] = 2 * (int64_t)m->q_dim + 2 * (int64_t)m->kv_dim,
        [XB_SGU] = 2 * (int64_t)c->shared_expert_intermediate_size,
        [XB_SACT] = c->shared_expert_intermediate_size,
        [XB_SH] = c->hidden_size,
        [XB_SG] = 1,
    };
    // Three groups that are never live at once: the DeltaNet layer's, the gated attention's and
    // the shared expert's buffers.
    int64_t o = 0, total = 0;
    for (int i = 0; i < XB_COUNT; i++) {
        if (i == XB_GQKV || i == XB_SGU) o = 0;
        off[i] = o;
        o += round8(w[i]);
        if (o > total) total = o;
    }
    *cols = total;
}

static int64_t qnext_extra_scratch_cols(const struct model *m) {
    int64_t off[XB_COUNT], cols;
    qnext_extra_layout(m, off, &cols);
    return cols;
}

// Sub-buffer i viewed as (T, cols).
static struct tensor xbuf(struct model *m, int i, int64_t T, int64_t cols) {
    int64_t off[XB_COUNT], total;
    qnext_extra_layout(m, off, &total);
    const enum dtype dt = m->backend->act_dtype;
    char *base = (char *)m->scratch.extra + (size_t)m->scratch.max_tokens * (size_t)off[i] * dtype_row_bytes(dt, 1);
    return tensor_2d(base, dt, T, cols);
}

// ---------------------------------------------------------------------------------------------
// Forward blocks (dispatched from blocks.c)

void attention_gqa_gated(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                         const struct attn_metadata *md) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct attn_gqa_weights *w = &ly->attn.gqa;
    const struct model_config *c = &m->cfg;
    const int64_t T = f->T, D = c->head_dim, stride = 2 * (int64_t)m->q_dim + 2 * (int64_t)m->kv_dim;
    const size_t e = dtype_row_bytes(b->act_dtype, 1);
    struct tensor g = xbuf(m, XB_GQKV, T, stride);
    ops->matmul(b, &g, &f->x, &w->qkv, NULL);
    char *base = g.data;
    struct tensor q = tensor_make(base, b->act_dtype, 3, (int64_t[]){T, c->num_heads, D});
    struct tensor gate = tensor_2d(base + (size_t)m->q_dim * e, b->act_dtype, T, m->q_dim);
    struct tensor k = tensor_make(base + 2 * (size_t)m->q_dim * e, b->act_dtype, 3, (int64_t[]){T, c->num_kv_heads, D});
    struct tensor v = tensor_make(base + (2 * (size_t)m->q_dim + (size_t)m->kv_dim) * e, b->act_dtype, 3,
                                  (int64_t[]){T, c->num_kv_heads, D});
    f->rope.q_norm = &w->q_norm;
    f->rope.k_norm = &w->k_norm;
    ops->rope_kv_write(b, &q, &k, &v, stride, &f->rope, kv, md);
    ops->attention(b, &f->attn, &q, stride, kv, md, 1.0f / sqrtf((float)D), 0, NULL);
    ops->gate_sigmoid_mul(b, &f->attn2, &gate, stride, m->q_dim);
    ops->matmul(b, &f->h, &f->attn2, &w->o, NULL);
}

void attention_gated_deltanet(struct model *m, struct fwd_state *f, const struct model_layer *ly, struct kv_layer *kv,
                              const struct attn_metadata *md) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct attn_deltanet_weights *w = &ly->attn.dn;
    const struct qn_dims d = qn_dims(&m->cfg);
    const int64_t T = f->T;
    const size_t e = dtype_row_bytes(b->act_dtype, 1);
    struct tensor qkvz = xbuf(m, XB_QKVZ, T, d.qkvz), ba = xbuf(m, XB_BA, T, 2 * d.hv);
    struct tensor conv = xbuf(m, XB_CONV, T, d.conv_dim);
    struct tensor core = xbuf(m, XB_CORE, T, d.hv * d.dv), normed = xbuf(m, XB_NORMED, T, d.hv * d.dv);
    ops->matmul(b, &qkvz, &f->x, &w->qkvz, NULL);
    ops->matmul(b, &ba, &f->x, &w->ba, NULL);
    struct tensor mixed = tensor_2d(qkvz.data, b->act_dtype, T, d.conv_dim);
    ops->deltanet_conv(b, &conv, &mixed, d.qkvz, &w->conv, kv, md);
    const struct deltanet_args a = {
        .n_k_heads = (int)d.hk, .n_v_heads = (int)d.hv, .k_dim = (int)d.dk, .v_dim = (int)d.dv};
    ops->deltanet_rule(b, &core, &conv, &ba, 2 * d.hv, &w->a_log, &w->dt_bias, kv, md, &a);
    struct tensor core_h = tensor_2d(core.data, b->act_dtype, T * d.hv, d.dv);
    struct tensor normed_h = tensor_2d(normed.data, b->act_dtype, T * d.hv, d.dv);
    struct tensor z = tensor_2d((char *)qkvz.data + (size_t)d.conv_dim * e, b->act_dtype, T * d.hv, d.dv);
    ops->rmsnorm_gated(b, &normed_h, &core_h, &z, d.qkvz, (int)d.hv, &w->norm, m->cfg.rms_norm_eps);
    ops->matmul(b, &f->h, &normed, &w->out, NULL);
}

void ffn_shared_expert_gated(struct model *m, struct fwd_state *f, const struct ffn_moe_shared_weights *w) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct model_config *c = &m->cfg;
    const int64_t T = f->T, I = c->shared_expert_intermediate_size;
    struct tensor gu = xbuf(m, XB_SGU, T, 2 * I), act = xbuf(m, XB_SACT, T, I);
    struct tensor sh = xbuf(m, XB_SH, T, c->hidden_size), sg = xbuf(m, XB_SG, T, 1);
    ops->matmul(b, &gu, &f->x, &w->shared_gate_up, NULL);
    ops->silu_mul(b, &act, &gu);
    ops->matmul(b, &sh, &act, &w->shared_down, NULL);
    ops->matmul(b, &sg, &f->x, &w->shared_gate, NULL);
    ops->gate_sigmoid_mul(b, &sh, &sg, 1, 1);
    ops->add(b, &f->h, &sh);
}

static void qnext_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
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

// ---------------------------------------------------------------------------------------------
// Load-time fix-ups

// Reorders the rows of a 2-D plain tensor in backend memory: row r of the result is row src[r].
static atomc_status permute_rows(struct model *m, struct tensor *t, const int64_t *src, const char *what, int l,
                                 struct error *err) {
    struct backend *b = m->backend;
    const int64_t rows = t->ne[0];
    const size_t rb = dtype_row_bytes(t->dtype, tensor_cols(t)), bytes = tensor_bytes(t);
    char *h = malloc(bytes), *o = malloc(bytes);
    if (!h || !o) {
        free(h);
        free(o);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d %s: no host memory to reorder %zu bytes", l, what,
                         bytes);
    }
    b->ops->synchronize(b);
    b->ops->copy_d2h(b, h, t->data, bytes);
    for (int64_t r = 0; r < rows; r++)
        memcpy(o + (size_t)r * rb, h + (size_t)src[r] * rb, rb);
    b->ops->copy_h2d(b, t->data, o, bytes);
    b->ops->synchronize(b);
    free(h);
    free(o);
    return ATOMC_OK;
}

// t <- 1 + t (a zero-centred RMSNorm weight); F32 afterwards when the backend computes in F32.
static atomc_status norm_add_one(struct model *m, struct tensor *t, const char *what, int l, struct error *err) {
    struct backend *b = m->backend;
    const int64_t n = tensor_numel(t);
    float *f = malloc((size_t)n * sizeof(float));
    void *raw = malloc(tensor_bytes(t));
    if (!f || !raw) {
        free(f);
        free(raw);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d %s: no host memory", l, what);
    }
    b->ops->synchronize(b);
    b->ops->copy_d2h(b, raw, t->data, tensor_bytes(t));
    dtype_to_f32(t->dtype, raw, f, n);
    for (int64_t i = 0; i < n; i++)
        f[i] += 1.0f;
    if (b->act_dtype == DTYPE_F32 && t->dtype != DTYPE_F32) {
        void *p = b->ops->alloc(b, (size_t)n * sizeof(float));
        if (!p) {
            free(f);
            free(raw);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "layer %d %s: cannot allocate an F32 norm weight", l, what);
        }
        m->weight_bytes += (size_t)n * sizeof(float) - tensor_bytes(t);
        b->ops->free(b, t->data);
        t->data = p;
        t->dtype = DTYPE_F32;
        b->ops->copy_h2d(b, t->data, f, (size_t)n * sizeof(float));
    } else {
        dtype_from_f32(t->dtype, f, raw, n);
        b->ops->copy_h2d(b, t->data, raw, tensor_bytes(t));
    }
    b->ops->synchronize(b);
    free(f);
    free(raw);
    return ATOMC_OK;
}

static atomc_status qnext_finish_load(struct model *m, struct weight_loader *L, const struct model_load_options *o,
                                      struct error *err) {
    (void)L;
    if (!o->files) return ATOMC_OK;
    const struct model_config *c = &m->cfg;
    const struct qn_dims d = qn_dims(c);
    const int64_t D = c->head_dim, qd = m->q_dim;
    int64_t max_rows = 2 * qd + 2 * m->kv_dim;
    if (d.qkvz > max_rows) max_rows = d.qkvz;
    int64_t *src = xmalloc((size_t)max_rows * sizeof *src);
    atomc_status st = ATOMC_OK;
    for (int l = 0; l < c->num_layers && st == ATOMC_OK; l++) {
        struct model_layer *ly = &m->layers[l];
        if ((st = norm_add_one(m, &ly->attn_norm, "input_layernorm", l, err))) break;
        if ((st = norm_add_one(m, &ly->ffn_norm, "post_attention_layernorm", l, err))) break;
        if (ly->attn_kind == ATTN_KIND_GQA_GATED) {
            if ((st = norm_add_one(m, &ly->attn.gqa.q_norm, "q_norm", l, err))) break;
            if ((st = norm_add_one(m, &ly->attn.gqa.k_norm, "k_norm", l, err))) break;
            // q_proj rows per head (q, gate) -> all q rows, then all gate rows.
            const int64_t rows = ly->attn.gqa.qkv.t.ne[0];
            for (int64_t r = 0; r < rows; r++)
                src[r] = r < qd ? (r / D) * 2 * D + r % D : r < 2 * qd ? ((r - qd) / D) * 2 * D + D + (r - qd) % D : r;
            st = permute_rows(m, &ly->attn.gqa.qkv.t, src, "q_proj", l, err);
        } else if (c->arch == MODEL_ARCH_QWEN3_NEXT) {
            // in_proj_qkvz grouped per key head g: (q (Dk), k (Dk), v (r Dv), z (r Dv)) -> (q, k, v, z).
            const int64_t rr = d.hv / d.hk, gw = 2 * d.dk + 2 * rr * d.dv, vg = rr * d.dv, kd = d.hk * d.dk;
            for (int64_t r = 0; r < d.qkvz; r++) {
                int64_t s;
                if (r < kd)
                    s = (r / d.dk) * gw + r % d.dk;
                else if (r < 2 * kd)
                    s = ((r - kd) / d.dk) * gw + d.dk + (r - kd) % d.dk;
                else if (r < d.conv_dim)
                    s = ((r - 2 * kd) / vg) * gw + 2 * d.dk + (r - 2 * kd) % vg;
                else
                    s = ((r - d.conv_dim) / vg) * gw + 2 * d.dk + vg + (r - d.conv_dim) % vg;
                src[r] = s;
            }
            if ((st = permute_rows(m, &ly->attn.dn.qkvz.t, src, "in_proj_qkvz", l, err))) break;
            // in_proj_ba grouped per key head: (b (r), a (r)) -> (b, a).
            for (int64_t r = 0; r < 2 * d.hv; r++)
                src[r] = r < d.hv ? (r / rr) * 2 * rr + r % rr : ((r - d.hv) / rr) * 2 * rr + rr + (r - d.hv) % rr;
            st = permute_rows(m, &ly->attn.dn.ba.t, src, "in_proj_ba", l, err);
        }
    }
    free(src);
    if (st == ATOMC_OK) st = norm_add_one(m, &m->final_norm, "model.norm", -1, err);
    return st;
}

static const enum model_arch qnext_archs[] = {MODEL_ARCH_QWEN3_NEXT, MODEL_ARCH_QWEN3_5_MOE, MODEL_ARCH_UNKNOWN};

const struct model_arch_def model_arch_qwen3_next = {
    .family = "qwen3_next",
    .archs = qnext_archs,
    .check = qnext_check,
    .plan_layer = qnext_plan_layer,
    .forward = qnext_forward,
    .extra_scratch_cols = qnext_extra_scratch_cols,
    .finish_load = qnext_finish_load,
    .no_tensor_parallel = true,
};
