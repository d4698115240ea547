// model_load / model_free and what every architecture shares: the generic config checks, the
// backend-capability check, the global weights (embeddings, final norm, lm_head), the layer
// plans and their weight tables (arch.h), RoPE frequencies, the scratch activations, parameter
// counts and the MoE routing parameters.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "loader/model_files.h"
#include "model/arch.h"
#include "model/eagle3.h"
#include "model/mtp.h"
#include "model/model.h"
#include "model/quant.h"
#include "model/weight_loader.h"

// ---------------------------------------------------------------------------------------------
// Cache specs

size_t cache_spec_token_bytes(const struct cache_spec *s, enum dtype kv_dtype) {
    size_t e = dtype_row_bytes(kv_dtype, 1);
    switch (s->kind) {
    case CACHE_KIND_FULL:
    case CACHE_KIND_SLIDING: return (size_t)s->n_kv_heads * (size_t)(s->head_dim_k + s->head_dim_v) * e;
    case CACHE_KIND_LATENT: return (size_t)(s->latent_dim + s->index_dim) * e;
    case CACHE_KIND_RECURRENT: return 0;
    }
    return 0;
}

const char *cache_kind_name(enum cache_kind k) {
    switch (k) {
    case CACHE_KIND_FULL: return "full attention K/V";
    case CACHE_KIND_SLIDING: return "sliding-window K/V";
    case CACHE_KIND_LATENT: return "latent (MLA)";
    case CACHE_KIND_RECURRENT: return "recurrent state";
    }
    return "?";
}

// ---------------------------------------------------------------------------------------------
// Checks

// What every architecture needs (sizes positive, heads divisible, RoPE dims), then the family's own.
static atomc_status model_check_config(const struct model_config *c, const struct model_arch_def **def,
                                       struct error *err) {
    *def = model_arch_find(c->arch);
    if (!*def) {
        char list[256];
        model_arch_supported_list(list, sizeof list);
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "architecture %s is not supported yet (supported: %s)",
                         c->architecture[0] ? c->architecture : model_arch_name(c->arch), list);
    }
    if (c->hidden_size <= 0 || c->num_layers <= 0 || c->num_heads <= 0 || c->num_kv_heads <= 0 || c->head_dim <= 0 ||
        c->vocab_size <= 0 || c->intermediate_size <= 0)
        return error_set(err, ATOMC_ERR_FORMAT, "model config has a non-positive size (hidden %d, layers %d, heads %d/%d, "
                         "head_dim %d, vocab %d, intermediate %d)", c->hidden_size, c->num_layers, c->num_heads,
                         c->num_kv_heads, c->head_dim, c->vocab_size, c->intermediate_size);
    if (c->num_layers > MODEL_MAX_LAYERS)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%d layers (at most %d)", c->num_layers, MODEL_MAX_LAYERS);
    if (c->num_heads % c->num_kv_heads != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "num_attention_heads %d is not a multiple of num_key_value_heads %d",
                         c->num_heads, c->num_kv_heads);
    atomc_status st = (*def)->check(c, err);
    if (st != ATOMC_OK) return st;
    int rd = c->rope.rotary_dim > 0 ? c->rope.rotary_dim : c->head_dim;
    if (rd % 2 != 0 || rd > c->head_dim)
        return error_set(err, ATOMC_ERR_FORMAT, "rotary dimension %d is odd or exceeds head_dim %d", rd, c->head_dim);
    return ATOMC_OK;
}

atomc_status model_check_backend_caps(const struct model_config *c, const struct backend_caps *caps,
                                      const struct model_load_options *o, struct error *err) {
    const char *be = caps->name;
    // Quantized weights' schemes and dtypes (dummy weights of a quantized config are random values
    // in its scheme, so they are checked too).
    atomc_status qst = model_quant_check_backend(c, caps, err);
    if (qst != ATOMC_OK) return qst;
    if (c->kv_lora_rank > 0 && !caps->mla)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: multi-head latent attention (kv_lora_rank %d) is not "
                         "implemented by the %s backend", c->architecture, c->kv_lora_rank, be);
    if (c->kv_lora_rank > 0 && ((caps->mla_max_kv_lora > 0 && (c->kv_lora_rank > caps->mla_max_kv_lora ||
                                                                 c->kv_lora_rank % 32 != 0)) ||
                                (caps->mla_max_rope > 0 && c->qk_rope_head_dim > caps->mla_max_rope)))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: MLA with kv_lora_rank %d and qk_rope_head_dim %d exceeds the "
                         "%s backend's kernels (kv_lora_rank a multiple of 32 up to %d, rope up to %d)",
                         c->architecture, c->kv_lora_rank, c->qk_rope_head_dim, be, caps->mla_max_kv_lora,
                         caps->mla_max_rope);
    if (c->index_n_heads > 0 && !caps->dsa)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: DeepSeek Sparse Attention (the DSA lightning indexer, "
                         "index_topk %d) is not implemented by the %s backend", c->architecture, c->index_topk, be);
    // MiMo-V2-Flash's attention has a v head dim of its own; the backend takes it only as one of
    // its (q/k, v) pairs. Every other attention has v = q/k head dim (MLA runs its own ops).
    const bool split = c->arch == MODEL_ARCH_MIMO_V2_FLASH && c->v_head_dim > 0 && c->v_head_dim != c->head_dim;
    if (split && !caps->split_v_head_dim)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: v head dim %d differs from the q/k head dim %d, which the "
                         "%s backend's attention does not implement", c->architecture, c->v_head_dim, c->head_dim, be);
    if (split && caps->n_split_head_dims > 0) {
        bool ok = false;
        char list[96];
        size_t n = 0;
        list[0] = 0;
        for (int i = 0; i < caps->n_split_head_dims; i++) {
            ok = ok || (caps->split_head_dims[i][0] == c->head_dim && caps->split_head_dims[i][1] == c->v_head_dim);
            if (n < sizeof list)
                n += (size_t)snprintf(list + n, sizeof list - n, "%s%d / %d", i ? ", " : "",
                                      caps->split_head_dims[i][0], caps->split_head_dims[i][1]);
        }
        if (!ok)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: q/k head dim %d with v head dim %d is not supported by "
                             "the %s backend's attention (q/k / v head dims %s)", c->architecture, c->head_dim,
                             c->v_head_dim, be, list);
    }
    if (!split && caps->n_head_dims > 0 && c->kv_lora_rank <= 0) {
        bool ok = false;
        for (int i = 0; i < caps->n_head_dims; i++) ok = ok || caps->head_dims[i] == c->head_dim;
        if (!ok) {
            char list[64];
            size_t n = 0;
            list[0] = 0;
            for (int i = 0; i < caps->n_head_dims && n < sizeof list; i++)
                n += (size_t)snprintf(list + n, sizeof list - n, "%s%d", i ? ", " : "", caps->head_dims[i]);
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: head_dim %d is not supported by the %s backend's "
                             "attention (head dims %s)", c->architecture, c->head_dim, be, list);
        }
    }
    if (c->qk_norm && caps->max_qk_norm_head_dim > 0 && c->head_dim > caps->max_qk_norm_head_dim)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: per-head q/k RMSNorm of head_dim %d exceeds the %s "
                         "backend's limit of %d", c->architecture, c->head_dim, be, caps->max_qk_norm_head_dim);
    if (!(caps->weight_dtypes & BACKEND_CAP_BIT(o->weight_dtype)))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "weight dtype %s is not supported by the %s backend",
                         dtype_name(o->weight_dtype), be);
    if (!(caps->kv_dtypes & BACKEND_CAP_BIT(o->kv_dtype)))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "KV cache dtype %s is not supported by the %s backend",
                         dtype_name(o->kv_dtype), be);
    if (o->block_size > 0) {
        if (caps->pow2_block_size && (o->block_size & (o->block_size - 1)) != 0)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "KV block size %d: the %s backend needs a power of two",
                             o->block_size, be);
        if (o->block_size < caps->min_block_size)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "KV block size %d: the %s backend needs at least %d",
                             o->block_size, be, caps->min_block_size);
    }
    for (int l = 0; l < c->num_layers; l++) {
        if (c->layer_types[l] != LAYER_ATTN_LINEAR) continue;
        if (!caps->gated_deltanet)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s layer %d: the %s backend does not run Gated "
                             "DeltaNet (linear attention) layers", c->architecture, l, be);
        int hd = c->linear_key_head_dim > c->linear_value_head_dim ? c->linear_key_head_dim : c->linear_value_head_dim;
        if (caps->max_deltanet_head_dim > 0 && hd > caps->max_deltanet_head_dim)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: linear-attention head dims %d / %d exceed the %s "
                             "backend's limit of %d", c->architecture, c->linear_key_head_dim,
                             c->linear_value_head_dim, be, caps->max_deltanet_head_dim);
        if (caps->max_deltanet_conv_kernel > 0 && c->linear_conv_kernel_dim > caps->max_deltanet_conv_kernel)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: linear_conv_kernel_dim %d exceeds the %s backend's "
                             "limit of %d", c->architecture, c->linear_conv_kernel_dim, be,
                             caps->max_deltanet_conv_kernel);
        break;
    }
    if (c->num_experts > 0) {
        int total = c->num_experts + (c->n_shared_experts > 0 ? c->n_shared_experts : 0);
        if (caps->max_experts > 0 && total > caps->max_experts)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %d experts exceed the %s backend's limit of %d",
                             c->architecture, total, be, caps->max_experts);
        if (c->scoring_func[0] && !strcmp(c->scoring_func, "sigmoid") && !caps->moe_sigmoid_scoring)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: sigmoid expert scoring is not supported by the %s "
                             "backend", c->architecture, be);
        if (c->swiglu_alpha > 0 && !caps->moe_swiglu_clamp)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: the experts' clamped SwiGLU with biases (GPT-OSS) is not "
                             "implemented by the %s backend yet", c->architecture, be);
        if (c->n_group > 1 && !caps->moe_grouped_topk)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: grouped top-k routing (n_group %d) is not supported by "
                             "the %s backend", c->architecture, c->n_group, be);
    }
    return ATOMC_OK;
}

static atomc_status model_tp_check(const struct model_config *c, int tp, int rank, struct comm *comm,
                                   struct error *err) {
    if (rank < 0 || rank >= tp)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel rank %d outside [0, %d)", rank, tp);
    if (!comm)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d needs a communicator", tp);
    if (c->kv_lora_rank > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "tensor parallelism of multi-head latent attention (%s) is not "
                         "implemented yet; use tensor_parallel_size 1", c->architecture);
    if (c->num_experts > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "tensor parallelism of mixture-of-experts models (%s) is not "
                         "implemented yet (expert shards are the next step); use tensor_parallel_size 1",
                         c->architecture);
    if (c->num_heads % tp != 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d does not divide "
                         "num_attention_heads %d", tp, c->num_heads);
    if (c->num_kv_heads % tp != 0 && tp % c->num_kv_heads != 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d and num_key_value_heads %d: one "
                         "must divide the other (KV heads are split, or replicated when fewer than ranks)", tp,
                         c->num_kv_heads);
    if (c->vocab_size % tp != 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d does not divide vocab_size %d "
                         "(the lm_head is split by vocabulary rows)", tp, c->vocab_size);
    if (c->intermediate_size % tp != 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d does not divide intermediate_size "
                         "%d", tp, c->intermediate_size);
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// MoE routing

// Routing parameters of cfg: softmax or sigmoid (scoring_func) top-k, renormalised over the k when
// norm_topk_prob (config.c sets it for Mixtral, whose softmax over the top-k logits is the same
// thing), times routed_scaling_factor (1 unless the config says otherwise); grouped top-k when
// n_group > 1, except under DeepSeek's topk_method "greedy" (which ignores the groups), scored by
// the group max for "group_limited_greedy" and the top-2 sum otherwise (noaux_tc, GLM-4-MoE);
// shared experts (stacked after the routed ones at load) are n_shared extra slots of weight 1.
// The per-layer correction bias is set by the MoE block (ffn_moe).
static struct moe_route_args model_moe_route_args(const struct model_config *c, bool force_uniform) {
    const bool grouped = c->n_group > 1 && strcmp(c->topk_method, "greedy") != 0;
    return (struct moe_route_args){
        .num_experts = c->num_experts,
        .top_k = c->num_experts_per_tok,
        .scoring = !strcmp(c->scoring_func, "sigmoid") ? MOE_SCORING_SIGMOID : MOE_SCORING_SOFTMAX,
        .renormalize = c->norm_topk_prob,
        .scale = c->routed_scaling_factor > 0 ? c->routed_scaling_factor : 1.0f,
        .n_group = grouped ? c->n_group : 0,
        .topk_group = grouped ? c->topk_group : 0,
        .group_score = !strcmp(c->topk_method, "group_limited_greedy") ? MOE_GROUP_SCORE_MAX : MOE_GROUP_SCORE_TOP2_SUM,
        .n_shared = c->n_shared_experts,
        .shared_weight = 1.0f,
        .force_uniform = force_uniform,
    };
}

double model_moe_decode_weight_bytes(const struct model_config *c, double weight_bytes, int batch) {
    if (c->num_experts <= 0) return weight_bytes;
    // MXFP4 experts (GPT-OSS): half a byte per weight plus an e8m0 byte per 32; else the average.
    double per_param = c->quant.method == QUANT_METHOD_MXFP4 ? 17.0 / 32.0
                                                             : weight_bytes / (double)model_param_count(c);
    int64_t touched = (int64_t)batch * c->num_experts_per_tok;
    if (touched > c->num_experts) touched = c->num_experts;
    double idle = 0;
    for (int l = 0; l < c->num_layers; l++)
        if (model_config_layer_is_moe(c, l))
            idle += (double)(c->num_experts - touched) * 3.0 * c->hidden_size * c->moe_intermediate_size;
    return weight_bytes - idle * per_param;
}

// ---------------------------------------------------------------------------------------------
// Load / free

// The plan of every layer under cfg's architecture, evaluated on a model holding only cfg (the
// plan depends on the config alone), for parameter counts. 0 for an architecture the engine does
// not implement (such a model never loads).
int64_t model_param_count(const struct model_config *c) {
    const struct model_arch_def *def = model_arch_find(c->arch);
    if (!def) return 0;
    struct model m = {.cfg = *c, .q_dim = c->num_heads * c->head_dim, .kv_dim = c->num_kv_heads * c->head_dim};
    int64_t n = (int64_t)c->vocab_size * c->hidden_size * (c->tie_word_embeddings ? 1 : 2) + c->hidden_size;
    for (int l = 0; l < c->num_layers; l++) {
        struct layer_plan p;
        def->plan_layer(&m, l, &p);
        for (int t = 0; t < LAYER_MAX_TABLES && p.tables[t]; t++) n += weight_table_params(p.tables[t], c);
    }
    return n;
}

static void model_free_layers(struct model *m) {
    if (!m->layers) return;
    for (int l = 0; l < m->cfg.num_layers; l++) {
        struct layer_plan p;
        m->arch->plan_layer(m, l, &p);
        for (int t = 0; t < LAYER_MAX_TABLES && p.tables[t]; t++) weight_loader_free_layer(m, p.tables[t], &m->layers[l]);
    }
}

static void tensor_release(struct model *m, struct tensor *t) {
    if (t->data) m->backend->ops->free(m->backend, t->data);
    t->data = NULL;
}

// RoPE frequencies of `rc` (cfg's rope or rope_sliding) into backend memory.
static atomc_status model_rope_upload(struct model *m, const struct rope_config *rc, float **inv,
                                      struct rope_args *out, struct error *err) {
    struct backend *b = m->backend;
    struct model_config cfg = m->cfg;
    cfg.rope = *rc;
    int rd = cfg.rope.rotary_dim > 0 ? cfg.rope.rotary_dim : cfg.head_dim;
    float *h_inv = xmalloc((size_t)(rd / 2) * sizeof(float));
    float attn_factor;
    model_rope_inv_freq(&cfg, rd, h_inv, &attn_factor);
    *inv = b->ops->alloc(b, (size_t)(rd / 2) * sizeof(float));
    if (!*inv) {
        free(h_inv);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate RoPE frequencies");
    }
    b->ops->copy_h2d(b, *inv, h_inv, (size_t)(rd / 2) * sizeof(float));
    b->ops->synchronize(b);
    free(h_inv);
    *out = (struct rope_args){.inv_freq = *inv, .rotary_dim = rd, .attn_factor = attn_factor,
                              .interleaved = cfg.rope.interleaved};
    return ATOMC_OK;
}

static atomc_status model_load_rope(struct model *m, struct error *err) {
    atomc_status st = model_rope_upload(m, &m->cfg.rope, &m->inv_freq, &m->rope, err);
    if (st == ATOMC_OK && m->cfg.rope_sliding.rotary_dim > 0)
        st = model_rope_upload(m, &m->cfg.rope_sliding, &m->inv_freq_sliding, &m->rope_sliding, err);
    return st;
}

// The final norm and lm_head (vocab-parallel under TP; tied: aliases the embeddings), loaded
// after the layers as they always were (the order dummy weights are drawn in).
static atomc_status model_load_head(struct model *m, struct weight_loader *L, const struct model_files *files,
                                    struct error *err) {
    const struct model_config *cfg = &m->cfg;
    const int tp = m->tp_size;
    int64_t V = cfg->vocab_size, H = cfg->hidden_size;
    atomc_status st;
    if ((st = weight_loader_load_tensor(L, &m->final_norm, "model.norm.weight", 1, (int64_t[]){H}, WINIT_NORM, -1, 0,
                                        err)))
        return st;
    // A checkpoint without lm_head.weight ties it to the embeddings whatever the config says
    // (GGUF files drop output.weight when tied).
    bool tied = cfg->tie_word_embeddings || (files && !model_files_has_tensor(files, "lm_head.weight"));
    if (tp > 1) {
        // Vocab-parallel lm_head: this rank's rows (a copy of the embedding rows when tied).
        int64_t Vs = V / tp;
        const char *name = tied ? "model.embed_tokens.weight" : "lm_head.weight";
        if ((st = weight_loader_load_tensor(L, &m->lm_head.t, name, 2, (int64_t[]){Vs, H}, WINIT_MATRIX, 0,
                                            (int64_t)m->tp_rank * Vs, err)))
            return st;
        if (tied) m->cfg.tie_word_embeddings = true;
    } else if (tied) {
        m->lm_head.t = m->embed;
        m->cfg.tie_word_embeddings = true;
    } else if ((st = weight_loader_load_tensor(L, &m->lm_head.t, "lm_head.weight", 2, (int64_t[]){V, H}, WINIT_MATRIX,
                                               -1, 0, err))) {
        return st;
    }
    return ATOMC_OK;
}

// Tensor parallelism: this rank's heads and intermediate columns; cfg gets the local sizes.
static void model_tp_setup(struct model *m, const struct model_config *cfg, int tp, int rank) {
    m->global_num_heads = cfg->num_heads;
    m->global_num_kv_heads = cfg->num_kv_heads;
    m->global_intermediate_size = cfg->intermediate_size;
    if (tp <= 1) return;
    // Heads and intermediate columns split evenly; with fewer KV heads than ranks each KV head is
    // replicated on tp / num_kv_heads consecutive ranks (those whose query heads it serves).
    int hq = cfg->num_heads / tp, hk = cfg->num_kv_heads >= tp ? cfg->num_kv_heads / tp : 1;
    m->q_head0 = rank * hq;
    m->kv_head0 = cfg->num_kv_heads >= tp ? rank * hk : rank * cfg->num_kv_heads / tp;
    m->inter0 = rank * (cfg->intermediate_size / tp);
    m->cfg.num_heads = hq;
    m->cfg.num_kv_heads = hk;
    m->cfg.intermediate_size = cfg->intermediate_size / tp;
}

atomc_status model_load(struct model **out, struct backend *b, const struct model_config *cfg,
                        const struct model_load_options *o, struct error *err) {
    *out = NULL;
    const struct model_arch_def *def;
    atomc_status st = model_check_config(cfg, &def, err);
    if (st != ATOMC_OK) return st;
    CHECK_MSG(b->caps, "backend %s reports no capabilities", b->ops->name);
    if ((st = model_check_backend_caps(cfg, b->caps, o, err)) != ATOMC_OK) return st;
    const int tp = o->tp_size > 1 ? o->tp_size : 1;
    if (tp > 1 && def->no_tensor_parallel)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: tensor parallelism is not implemented for the %s family",
                         cfg->architecture, def->family);
    if (tp > 1 && (st = model_tp_check(cfg, tp, o->tp_rank, o->comm, err)) != ATOMC_OK) return st;
    struct model *m = xcalloc(1, sizeof *m);
    m->cfg = *cfg;
    m->arch = def;
    m->backend = b;
    m->weight_dtype = o->weight_dtype;
    m->keep_file_dtypes = o->keep_file_dtypes;
    m->quant_weight_only = o->quant_weight_only;
    m->online_fp8 = o->online_fp8;
    m->tp_size = tp;
    m->tp_rank = tp > 1 ? o->tp_rank : 0;
    m->comm = tp > 1 ? o->comm : NULL;
    model_tp_setup(m, cfg, tp, m->tp_rank);
    m->q_dim = m->cfg.num_heads * cfg->head_dim;
    m->kv_dim = m->cfg.num_kv_heads * cfg->head_dim;
    m->qkv_dim = m->q_dim + 2 * m->kv_dim;
    if (cfg->kv_lora_rank > 0) {
        // MLA (block_mla.c): the qkv scratch holds q (H (nope + rope)), kv_a (L + rope) and the
        // q_lora projection and its norm (2 Q) side by side; attn holds the (H v) output.
        const int H = m->cfg.num_heads;
        m->q_dim = H * cfg->v_head_dim;
        m->kv_dim = cfg->kv_lora_rank + cfg->qk_rope_head_dim;
        m->qkv_dim = H * (cfg->qk_nope_head_dim + cfg->qk_rope_head_dim) + m->kv_dim + 2 * cfg->q_lora_rank;
    }
    if (cfg->arch == MODEL_ARCH_MIMO_V2_FLASH) {
        // mimo.c: per layer q (H D), k (hk D), v (hk Dv) with hk the full or sliding layers' KV
        // heads: the qkv scratch holds the wider of the two; attn holds (H Dv) <= q_dim.
        // kv_dim stays the full layers' (WDIM_KV).
        int hk = cfg->num_kv_heads > cfg->swa_num_kv_heads ? cfg->num_kv_heads : cfg->swa_num_kv_heads;
        m->qkv_dim = m->q_dim + hk * (cfg->head_dim + cfg->v_head_dim);
    }
    m->layers = xcalloc((size_t)cfg->num_layers, sizeof *m->layers);
    m->layer_cache = xcalloc((size_t)cfg->num_layers, sizeof *m->layer_cache);
    m->n_cache_layers = cfg->num_layers;
    if (cfg->num_experts > 0) m->moe_route = model_moe_route_args(cfg, o->moe_force_uniform);
    struct weight_loader *L = weight_loader_create(m, o->files, o->dummy_seed);

    if ((st = weight_loader_load_tensor(L, &m->embed, "model.embed_tokens.weight", 2,
                                        (int64_t[]){cfg->vocab_size, cfg->hidden_size}, WINIT_MATRIX, -1, 0, err)))
        goto fail;
    for (int l = 0; l < cfg->num_layers; l++) {
        struct layer_plan p;
        def->plan_layer(m, l, &p);
        struct model_layer *ly = &m->layers[l];
        ly->attn_kind = p.attn_kind;
        ly->ffn_kind = p.ffn_kind;
        ly->sliding_window = p.sliding_window;
        m->layer_cache[l] = p.cache;
        for (int t = 0; t < LAYER_MAX_TABLES && p.tables[t]; t++)
            if ((st = weight_loader_load_layer(L, p.tables[t], l, ly, err))) goto fail;
    }
    if ((st = model_load_head(m, L, o->files, err))) goto fail;
    if ((st = model_kv_scales_load(m, o->files, err))) goto fail;
    if ((st = model_load_rope(m, err))) goto fail;
    if (o->load_mtp && (st = model_mtp_load(m, L, err))) goto fail;
    if (o->eagle3_path && (st = model_eagle3_load(m, o->eagle3_path, !o->files, o->dummy_seed, err))) goto fail;
    if (def->finish_load && (st = def->finish_load(m, L, o, err))) goto fail;
    weight_loader_free(L);
    *out = m;
    return ATOMC_OK;
fail:
    weight_loader_free(L);
    model_free(m);
    return st;
}

// ---------------------------------------------------------------------------------------------
// Scratch

static void model_scratch_free(struct model *m) {
    struct model_scratch *s = &m->scratch;
    void **ps[] = {&s->residual, &s->x, &s->h, &s->qkv, &s->attn, &s->gate_up, &s->act, &s->extra,
                   &s->lg_res, &s->lg_h, &s->lg_x, (void **)&s->logits, (void **)&s->lg_shard,
                   (void **)&s->lg_gather, (void **)&s->moe.logits, (void **)&s->moe.topk_ids,
                   (void **)&s->moe.topk_w, &s->moe.workspace, &s->mla_workspace, &s->mtp_a, &s->mtp_b,
                   &s->mtp_c, &s->eagle3_aux[0], &s->eagle3_aux[1], &s->eagle3_aux[2], &s->eagle3_qkv};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        if (*ps[i]) m->backend->ops->free(m->backend, *ps[i]);
        *ps[i] = NULL;
    }
    s->bytes = 0;
}

atomc_status model_scratch_alloc(struct model *m, int max_tokens, int max_logits_rows, struct error *err) {
    model_scratch_free(m);
    struct model_scratch *s = &m->scratch;
    const struct model_config *c = &m->cfg;
    struct backend *b = m->backend;
    size_t e = dtype_row_bytes(b->act_dtype, 1);
    size_t T = (size_t)max_tokens, R = (size_t)max_logits_rows, H = (size_t)c->hidden_size;
    s->max_tokens = max_tokens;
    s->max_logits_rows = max_logits_rows;
    const bool moe = c->num_experts > 0;
    // Slots per token: the routed top-k, then the shared experts (stacked after the routed ones).
    const size_t n_sh = moe && c->n_shared_experts > 0 ? (size_t)c->n_shared_experts : 0;
    size_t E = moe ? (size_t)c->num_experts + n_sh : 0, k = moe ? (size_t)c->num_experts_per_tok + n_sh : 0;
    struct {
        void **p;
        size_t bytes;
    } want[] = {
        {&s->residual, T * H * e},
        {&s->x, T * H * e},
        {&s->h, T * H * e},
        {&s->qkv, T * (size_t)m->qkv_dim * e},
        {&s->attn, T * (size_t)m->q_dim * e},
        {&s->gate_up, T * 2 * (size_t)c->intermediate_size * e},
        {&s->act, T * (size_t)c->intermediate_size * e},
        {&s->extra, m->arch && m->arch->extra_scratch_cols ? T * (size_t)m->arch->extra_scratch_cols(m) * e : 0},
        {&s->lg_res, R * H * e},
        {&s->lg_h, R * H * e},
        {&s->lg_x, R * H * e},
        {(void **)&s->logits, R * (size_t)c->vocab_size * sizeof(float)},
        {(void **)&s->lg_shard, m->tp_size > 1 ? R * (size_t)(c->vocab_size / m->tp_size) * sizeof(float) : 0},
        {(void **)&s->lg_gather, m->tp_size > 1 ? R * (size_t)c->vocab_size * sizeof(float) : 0},
        {(void **)&s->moe.logits, T * (E - n_sh) * sizeof(float)},
        {(void **)&s->moe.topk_ids, T * k * sizeof(int32_t)},
        {(void **)&s->moe.topk_w, T * k * sizeof(float)},
        {&s->moe.workspace, moe ? moe_workspace_bytes((int64_t)T, (int)k, (int)E, c->hidden_size,
                                                      c->moe_intermediate_size, e)
                                : 0},
        {&s->mla_workspace, c->kv_lora_rank > 0 ? mla_workspace_bytes((int64_t)T, c->num_heads, c->kv_lora_rank,
                                                                       c->qk_rope_head_dim)
                                                 : 0},
        {&s->mtp_a, m->n_mtp || m->eagle3 ? T * H * e : 0},
        {&s->mtp_b, m->n_mtp || m->eagle3 ? T * H * e : 0},
        {&s->mtp_c, m->n_mtp || m->eagle3 ? T * H * e : 0},
        {&s->eagle3_aux[0], m->eagle3 ? T * H * e : 0},
        {&s->eagle3_aux[1], m->eagle3 ? T * H * e : 0},
        {&s->eagle3_aux[2], m->eagle3 ? T * H * e : 0},
        {&s->eagle3_qkv, m->eagle3 ? T * (size_t)m->qkv_dim * e : 0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (!want[i].bytes) continue;
        *want[i].p = b->ops->alloc(b, want[i].bytes);
        if (!*want[i].p) {
            size_t total = s->bytes + want[i].bytes;
            model_scratch_free(m);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY,
                             "cannot allocate %.1f MiB of activations for %d batched tokens (lower "
                             "max_num_batched_tokens)", (double)total / (1 << 20), max_tokens);
        }
        s->bytes += want[i].bytes;
    }
    return ATOMC_OK;
}

void model_free(struct model *m) {
    if (!m) return;
    model_scratch_free(m);
    model_mtp_free(m);
    model_eagle3_free(m);
    model_free_layers(m);
    free(m->layers);
    free(m->layer_cache);
    if (m->lm_head.t.data == m->embed.data) m->lm_head.t.data = NULL;
    tensor_release(m, &m->lm_head.t);
    tensor_release(m, &m->embed);
    tensor_release(m, &m->final_norm);
    if (m->inv_freq) m->backend->ops->free(m->backend, m->inv_freq);
    if (m->inv_freq_sliding) m->backend->ops->free(m->backend, m->inv_freq_sliding);
    free(m);
}
