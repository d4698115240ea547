// Weight loading for the dense decoder architectures (Llama, Qwen3): maps HF tensor names
// to struct model fields, checks every shape, converts to the backend's weight dtype, fuses
// q/k/v and gate/up, and precomputes RoPE inverse frequencies. Also the dummy (random)
// weights of `--load-format dummy` and the scratch activations.
//
// Tensor parallelism: with tp_size > 1 each rank reads only its shard through
// model_files_get_tensor_slice (rows of q/k/v, gate/up and lm_head; input columns of o_proj
// and down_proj; row-parallel biases on rank 0 only) and m->cfg gets the local sizes.
//
// The weight source (struct model_files) already maps GGUF names to HF names and undoes
// llama.cpp's q/k row permutation, so this file only ever sees HF names and layouts.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "loader/model_files.h"
#include "model/model.h"
#include "model/moe.h"

// ---------------------------------------------------------------------------------------------
// RoPE inverse frequencies

static float rope_yarn_mscale(float scale, float m) {
    if (scale <= 1.0f) return 1.0f;
    return 0.1f * m * logf(scale) + 1.0f;
}

static double rope_yarn_correction_dim(double num_rotations, int dim, double base, double max_pos) {
    return (dim * log(max_pos / (num_rotations * 2.0 * M_PI))) / (2.0 * log(base));
}

void model_rope_inv_freq(const struct model_config *cfg, int rotary_dim, float *inv_freq, float *attn_factor) {
    const struct rope_config *r = &cfg->rope;
    double base = r->theta > 0 ? r->theta : 10000.0;
    int half = rotary_dim / 2;
    *attn_factor = 1.0f;
    for (int i = 0; i < half; i++) inv_freq[i] = (float)(1.0 / pow(base, (2.0 * i) / rotary_dim));
    double factor = r->factor > 0 ? r->factor : 1.0;
    switch (r->scaling) {
    case ROPE_SCALING_NONE:
    case ROPE_SCALING_DYNAMIC: // dynamic NTK is applied as the unscaled frequencies (as vLLM's default)
        break;
    case ROPE_SCALING_LINEAR:
        for (int i = 0; i < half; i++) inv_freq[i] = (float)(inv_freq[i] / factor);
        break;
    case ROPE_SCALING_LLAMA3: {
        double orig = r->original_max_position > 0 ? r->original_max_position : 8192;
        double lo = r->low_freq_factor > 0 ? r->low_freq_factor : 1.0;
        double hi = r->high_freq_factor > 0 ? r->high_freq_factor : 4.0;
        double low_wavelen = orig / lo, high_wavelen = orig / hi;
        for (int i = 0; i < half; i++) {
            double f = 1.0 / pow(base, (2.0 * i) / rotary_dim);
            double wavelen = 2.0 * M_PI / f;
            if (wavelen < high_wavelen) {
                inv_freq[i] = (float)f;
            } else if (wavelen > low_wavelen) {
                inv_freq[i] = (float)(f / factor);
            } else {
                double smooth = (orig / wavelen - lo) / (hi - lo);
                inv_freq[i] = (float)((1.0 - smooth) * f / factor + smooth * f);
            }
        }
        break;
    }
    case ROPE_SCALING_YARN: {
        double orig = r->original_max_position > 0 ? r->original_max_position : cfg->max_position_embeddings;
        double beta_fast = r->beta_fast > 0 ? r->beta_fast : 32.0, beta_slow = r->beta_slow > 0 ? r->beta_slow : 1.0;
        double low = rope_yarn_correction_dim(beta_fast, rotary_dim, base, orig);
        double high = rope_yarn_correction_dim(beta_slow, rotary_dim, base, orig);
        if (r->yarn_truncate) {
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0) low = 0;
        if (high > rotary_dim - 1) high = rotary_dim - 1;
        if (low == high) high += 0.001;
        for (int i = 0; i < half; i++) {
            double pos_freq = pow(base, (2.0 * i) / rotary_dim);
            double extrap = 1.0 / pos_freq, interp = 1.0 / (factor * pos_freq);
            double ramp = (i - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrap_factor = 1.0 - ramp;
            inv_freq[i] = (float)(interp * (1.0 - extrap_factor) + extrap * extrap_factor);
        }
        if (r->attention_factor > 0)
            *attn_factor = r->attention_factor;
        else if (r->mscale > 0 && r->mscale_all_dim > 0)
            *attn_factor = rope_yarn_mscale((float)factor, r->mscale) / rope_yarn_mscale((float)factor, r->mscale_all_dim);
        else
            *attn_factor = rope_yarn_mscale((float)factor, 1.0f);
        break;
    }
    }
}

// ---------------------------------------------------------------------------------------------
// Loading

// Dummy weights come from a few pools of random values (one per (lo, hi, dtype)), already
// converted to the weight dtype: each tensor copies a run of its pool starting at a seeded
// offset, wrapping around. Generating billions of independent numbers on one host thread
// would dominate the start-up of a dummy 8B model; the values only need to be random-looking,
// finite and of the right scale, and copying keeps dummy loading at the host-to-device rate.
#define DUMMY_POOL_ELEMS ((int64_t)1 << 22)
#define DUMMY_MAX_POOLS 8

struct dummy_pool {
    float lo, hi;
    enum dtype dtype;
    unsigned char *data; // DUMMY_POOL_ELEMS elements of dtype
};

struct weight_loader {
    struct model *m;
    struct model_files *files; // NULL = dummy
    uint64_t seed;             // dummy: advanced per tensor
    struct dummy_pool pools[DUMMY_MAX_POOLS];
    int n_pools;
};

static void weight_release(struct model *m, struct tensor *t) {
    if (t->data) m->backend->ops->free(m->backend, t->data);
    t->data = NULL;
}

// splitmix64: a tiny, good-enough generator for dummy weights (speed matters, quality not).
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static const struct dummy_pool *dummy_pool_get(struct weight_loader *L, float lo, float hi, enum dtype dt,
                                               struct error *err) {
    for (int i = 0; i < L->n_pools; i++)
        if (L->pools[i].lo == lo && L->pools[i].hi == hi && L->pools[i].dtype == dt) return &L->pools[i];
    if (L->n_pools == DUMMY_MAX_POOLS) { // many distinct scales: recycle the oldest pool
        free(L->pools[0].data);
        memmove(&L->pools[0], &L->pools[1], sizeof L->pools[0] * (DUMMY_MAX_POOLS - 1));
        L->n_pools--;
    }
    size_t esz = dtype_row_bytes(dt, 1);
    float *f = malloc((size_t)DUMMY_POOL_ELEMS * sizeof(float));
    unsigned char *data = malloc((size_t)DUMMY_POOL_ELEMS * esz);
    if (!f || !data) {
        free(f);
        free(data);
        error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "dummy weights: out of host memory");
        return NULL;
    }
    uint64_t s = L->seed ^ ((uint64_t)L->n_pools * 0x632be59bd9b4e019ull);
    for (int64_t i = 0; i < DUMMY_POOL_ELEMS; i++)
        f[i] = lo == hi ? lo : lo + (hi - lo) * (float)((splitmix64(&s) >> 40) * (1.0 / 16777216.0));
    dtype_from_f32(dt, f, data, DUMMY_POOL_ELEMS);
    free(f);
    struct dummy_pool *p = &L->pools[L->n_pools++];
    *p = (struct dummy_pool){.lo = lo, .hi = hi, .dtype = dt, .data = data};
    return p;
}

static void dummy_pools_free(struct weight_loader *L) {
    for (int i = 0; i < L->n_pools; i++) free(L->pools[i].data);
    L->n_pools = 0;
}

// Random weights in [lo, hi) (lo == hi: that constant) written into backend memory: on the
// device when the backend has fill_uniform (CUDA), else copied from a host pool.
static atomc_status weight_fill_dummy(struct weight_loader *L, struct tensor *t, float lo, float hi,
                                      const char *name, struct error *err) {
    struct backend *b = L->m->backend;
    size_t bytes = tensor_bytes(t);
    t->data = b->ops->alloc(b, bytes);
    if (!t->data)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "dummy weights: cannot allocate %zu bytes for %s", bytes, name);
    uint64_t seed = L->seed;
    L->seed = splitmix64(&seed);
    if (lo != hi && b->ops->fill_uniform) { // on the device: nothing crosses the host link
        atomc_status st = b->ops->fill_uniform(b, t, L->seed, lo, hi, err);
        if (st != ATOMC_OK) return error_prefix(err, "dummy weights %s: ", name);
        return ATOMC_OK;
    }
    const struct dummy_pool *p = dummy_pool_get(L, lo, hi, t->dtype, err);
    if (!p) return err ? err->status : ATOMC_ERR_OUT_OF_MEMORY;
    int64_t n = tensor_numel(t), esz = (int64_t)dtype_row_bytes(t->dtype, 1);
    int64_t src = (int64_t)(L->seed % (uint64_t)DUMMY_POOL_ELEMS);
    for (int64_t off = 0; off < n;) {
        int64_t k = DUMMY_POOL_ELEMS - src;
        if (k > n - off) k = n - off;
        b->ops->copy_h2d(b, (char *)t->data + off * esz, p->data + src * esz, (size_t)(k * esz));
        off += k;
        src = 0;
    }
    return ATOMC_OK;
}

static void shape_string(char *buf, size_t n, const struct tensor *t) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "(");
    for (int i = 0; i < t->ndim && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)t->ne[i]);
    if (o < n) snprintf(buf + o, n - o, ")");
}

// Loads one tensor named `name` of shape ne[0..ndim) into backend memory as `dt`.
// kind: 0 = matrix (dummy: uniform +-1/sqrt(cols)), 1 = norm weight (dummy: ones), 2 = bias (dummy: small).
// slice_dim >= 0: ne is this rank's shard, read from the checkpoint as [slice_start,
// slice_start + ne[slice_dim]) of dim slice_dim (tensor parallelism); -1 = the whole tensor.
static atomc_status weight_load_slice(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                                      const int64_t *ne, int kind, int slice_dim, int64_t slice_start,
                                      struct error *err) {
    struct model *m = L->m;
    *dst = tensor_make(NULL, m->weight_dtype, ndim, ne);
    // Norm weights and biases are stored in the weight dtype too: the ops take every weight in it.
    if (!L->files) {
        float a = kind == 0 ? 1.0f / sqrtf((float)ne[ndim - 1]) : 0.02f;
        atomc_status st = kind == 1 ? weight_fill_dummy(L, dst, 1.0f, 1.0f, name, err)
                                    : weight_fill_dummy(L, dst, -a, a, name, err);
        if (st == ATOMC_OK) m->weight_bytes += tensor_bytes(dst);
        return st;
    }
    struct tensor src;
    atomc_status st = slice_dim < 0 ? model_files_get_tensor(L->files, name, &src, err)
                                    : model_files_get_tensor_slice(L->files, name, slice_dim, slice_start,
                                                                   ne[slice_dim], &src, err);
    if (st != ATOMC_OK) return st;
    if (tensor_numel(&src) != tensor_numel(dst) || tensor_cols(&src) != tensor_cols(dst)) {
        char want[96], got[96];
        shape_string(want, sizeof want, dst);
        shape_string(got, sizeof got, &src);
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s has shape %s, expected %s", name, got, want);
    }
    st = m->backend->ops->upload_weight(m->backend, dst, &src, err);
    if (st != ATOMC_OK) return error_prefix(err, "tensor %s: ", name);
    m->weight_bytes += tensor_bytes(dst);
    return ATOMC_OK;
}

static atomc_status weight_load(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                                const int64_t *ne, int kind, struct error *err) {
    return weight_load_slice(L, dst, name, ndim, ne, kind, -1, 0, err);
}

// Loads `n` tensors with the same column count and stacks their rows into one tensor
// (q,k,v -> qkv; gate,up -> gate_up). Parts are uploaded, then copied into the fused
// allocation in backend memory and freed, so the peak overhead is one layer's parts.
// starts != NULL: part i is rows [starts[i], starts[i] + rows[i]) of its checkpoint tensor
// (a tensor-parallel shard).
static atomc_status weight_load_fused(struct weight_loader *L, struct tensor *dst, int n, const char *const *names,
                                      const int64_t *rows, const int64_t *starts, int64_t cols, int kind,
                                      struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += rows[i];
    int ndim = cols > 0 ? 2 : 1;
    int64_t ne[2] = {total, cols};
    if (ndim == 1) ne[0] = total;
    if (!L->files) return weight_load(L, dst, names[0], ndim, ne, kind, err);
    *dst = tensor_make(NULL, m->weight_dtype, ndim, ne);
    size_t bytes = tensor_bytes(dst);
    dst->data = b->ops->alloc(b, bytes);
    if (!dst->data)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes for fused %s", bytes, names[0]);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        struct tensor part;
        int64_t pne[2] = {rows[i], cols};
        if (ndim == 1) pne[0] = rows[i];
        size_t wb = m->weight_bytes;
        atomc_status st = weight_load_slice(L, &part, names[i], ndim, pne, kind, starts ? 0 : -1,
                                            starts ? starts[i] : 0, err);
        m->weight_bytes = wb;
        if (st != ATOMC_OK) {
            weight_release(m, dst);
            return st;
        }
        size_t pb = tensor_bytes(&part);
        b->ops->copy_d2d(b, (char *)dst->data + off, part.data, pb);
        off += pb;
        b->ops->synchronize(b);
        weight_release(m, &part);
    }
    m->weight_bytes += bytes;
    return ATOMC_OK;
}

atomc_status model_weight_load(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                               const int64_t *ne, int kind, struct error *err) {
    return weight_load(L, dst, name, ndim, ne, kind, err);
}

atomc_status model_weight_load_fused(struct weight_loader *L, struct tensor *dst, int n, const char *const *names,
                                     const int64_t *rows, int64_t cols, int kind, struct error *err) {
    return weight_load_fused(L, dst, n, names, rows, NULL, cols, kind, err);
}

static bool weight_exists(struct weight_loader *L, const char *name) {
    return L->files && model_files_has_tensor(L->files, name);
}

static atomc_status model_load_layer(struct weight_loader *L, int l, struct error *err) {
    struct model *m = L->m;
    const struct model_config *c = &m->cfg;
    struct model_layer *ly = &m->layers[l];
    int64_t H = c->hidden_size, I = c->intermediate_size, D = c->head_dim;
    char n[4][160];
    const char *names[4] = {n[0], n[1], n[2], n[3]};
    atomc_status st;
#define LNAME(buf, suffix) snprintf(buf, sizeof buf, "model.layers.%d.%s", l, suffix)

    LNAME(n[0], "input_layernorm.weight");
    if ((st = weight_load(L, &ly->attn_norm, n[0], 1, (int64_t[]){H}, 1, err))) return st;
    LNAME(n[0], "post_attention_layernorm.weight");
    if ((st = weight_load(L, &ly->mlp_norm, n[0], 1, (int64_t[]){H}, 1, err))) return st;

    int64_t qkv_rows[3] = {m->q_dim, m->kv_dim, m->kv_dim};
    // Tensor parallelism: this rank's heads / intermediate columns (all zero starts when tp_size == 1).
    const bool tp = m->tp_size > 1;
    int64_t qkv_starts[3] = {(int64_t)m->q_head0 * D, (int64_t)m->kv_head0 * D, (int64_t)m->kv_head0 * D};
    int64_t gu_starts[2] = {m->inter0, m->inter0};
    const int64_t *qkv_s = tp ? qkv_starts : NULL, *gu_s = tp ? gu_starts : NULL;
    const int row_dim = tp ? 1 : -1; // row-parallel o_proj / down_proj: their input columns are sharded
    const bool row_bias = !tp || m->tp_rank == 0; // row-parallel biases are added once, before the all-reduce
    LNAME(n[0], "self_attn.q_proj.weight");
    LNAME(n[1], "self_attn.k_proj.weight");
    LNAME(n[2], "self_attn.v_proj.weight");
    if ((st = weight_load_fused(L, &ly->qkv, 3, names, qkv_rows, qkv_s, H, 0, err))) return st;
    if (c->attention_bias) {
        LNAME(n[0], "self_attn.q_proj.bias");
        LNAME(n[1], "self_attn.k_proj.bias");
        LNAME(n[2], "self_attn.v_proj.bias");
        if ((st = weight_load_fused(L, &ly->qkv_bias, 3, names, qkv_rows, qkv_s, 0, 2, err))) return st;
    }
    LNAME(n[0], "self_attn.o_proj.weight");
    if ((st = weight_load_slice(L, &ly->o, n[0], 2, (int64_t[]){H, m->q_dim}, 0, row_dim,
                                (int64_t)m->q_head0 * D, err)))
        return st;
    LNAME(n[0], "self_attn.o_proj.bias");
    // HF Llama and Qwen3 give o_proj a bias exactly when attention_bias is set.
    if (row_bias && (c->attention_out_bias || c->attention_bias || weight_exists(L, n[0])))
        if ((st = weight_load(L, &ly->o_bias, n[0], 1, (int64_t[]){H}, 2, err))) return st;
    if (c->qk_norm) {
        LNAME(n[0], "self_attn.q_norm.weight");
        if ((st = weight_load(L, &ly->q_norm, n[0], 1, (int64_t[]){D}, 1, err))) return st;
        LNAME(n[0], "self_attn.k_norm.weight");
        if ((st = weight_load(L, &ly->k_norm, n[0], 1, (int64_t[]){D}, 1, err))) return st;
    }
    if (model_config_layer_is_moe(c, l)) return model_moe_load_layer(L, m, l, err); // moe.c
    int64_t gu_rows[2] = {I, I};
    LNAME(n[0], "mlp.gate_proj.weight");
    LNAME(n[1], "mlp.up_proj.weight");
    if ((st = weight_load_fused(L, &ly->gate_up, 2, names, gu_rows, gu_s, H, 0, err))) return st;
    LNAME(n[0], "mlp.down_proj.weight");
    if ((st = weight_load_slice(L, &ly->down, n[0], 2, (int64_t[]){H, I}, 0, row_dim, m->inter0, err))) return st;
    if (c->mlp_bias) {
        LNAME(n[0], "mlp.gate_proj.bias");
        LNAME(n[1], "mlp.up_proj.bias");
        if ((st = weight_load_fused(L, &ly->gate_up_bias, 2, names, gu_rows, gu_s, 0, 2, err))) return st;
        LNAME(n[0], "mlp.down_proj.bias");
        if (row_bias && (st = weight_load(L, &ly->down_bias, n[0], 1, (int64_t[]){H}, 2, err))) return st;
    }
#undef LNAME
    return ATOMC_OK;
}

static void model_layer_free(struct model *m, struct model_layer *ly) {
    struct tensor *ts[] = {&ly->attn_norm, &ly->qkv,      &ly->qkv_bias,     &ly->q_norm, &ly->k_norm,   &ly->o,
                           &ly->o_bias,    &ly->mlp_norm, &ly->gate_up,      &ly->gate_up_bias, &ly->down, &ly->down_bias};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) weight_release(m, ts[i]);
    model_moe_layer_free(m, ly);
}

static atomc_status model_check_config(const struct model_config *c, struct error *err) {
    bool moe_arch = c->arch == MODEL_ARCH_QWEN3_MOE || c->arch == MODEL_ARCH_MIXTRAL;
    if (c->arch != MODEL_ARCH_LLAMA && c->arch != MODEL_ARCH_QWEN3 && !moe_arch)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "architecture %s is not supported yet (supported: LlamaForCausalLM, Qwen3ForCausalLM, "
                         "Qwen3MoeForCausalLM, MixtralForCausalLM)",
                         c->architecture[0] ? c->architecture : model_arch_name(c->arch));
    if (c->hidden_size <= 0 || c->num_layers <= 0 || c->num_heads <= 0 || c->num_kv_heads <= 0 || c->head_dim <= 0 ||
        c->vocab_size <= 0 || c->intermediate_size <= 0)
        return error_set(err, ATOMC_ERR_FORMAT, "model config has a non-positive size (hidden %d, layers %d, heads %d/%d, "
                         "head_dim %d, vocab %d, intermediate %d)", c->hidden_size, c->num_layers, c->num_heads,
                         c->num_kv_heads, c->head_dim, c->vocab_size, c->intermediate_size);
    if (c->num_heads % c->num_kv_heads != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "num_attention_heads %d is not a multiple of num_key_value_heads %d",
                         c->num_heads, c->num_kv_heads);
    if (c->hidden_act[0] && strcmp(c->hidden_act, "silu") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "hidden_act '%s' is not supported (only silu)", c->hidden_act);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] == LAYER_ATTN_LINEAR)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "layer %d uses linear attention, which %s does not have",
                             l, c->architecture);
    if (moe_arch && (c->num_experts <= 0 || c->num_experts > 1024 || c->num_experts_per_tok <= 0 ||
                     c->num_experts_per_tok > c->num_experts || c->moe_intermediate_size <= 0))
        return error_set(err, ATOMC_ERR_FORMAT, "%s config: %d experts, top-%d, moe_intermediate_size %d (need 1..1024 "
                         "experts, 1 <= top-k <= experts)", c->architecture, c->num_experts, c->num_experts_per_tok,
                         c->moe_intermediate_size);
    if (moe_arch && c->n_shared_experts > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for %d shared experts, which the MoE block does "
                         "not load yet", c->architecture, c->n_shared_experts);
    if (moe_arch && (c->n_group > 1 || (c->scoring_func[0] && strcmp(c->scoring_func, "softmax"))))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for grouped top-k (n_group %d) or '%s' scoring; "
                         "the MoE router implements softmax top-k only", c->architecture, c->n_group, c->scoring_func);
    if (c->attention_sinks || (c->num_experts > 0 && !moe_arch) || c->q_lora_rank > 0 || c->kv_lora_rank > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s config asks for attention sinks, experts or MLA, which the "
                         "dense forward does not implement", c->architecture);
    int rd = c->rope.rotary_dim > 0 ? c->rope.rotary_dim : c->head_dim;
    if (rd % 2 != 0 || rd > c->head_dim)
        return error_set(err, ATOMC_ERR_FORMAT, "rotary dimension %d is odd or exceeds head_dim %d", rd, c->head_dim);
    return ATOMC_OK;
}

// Tensor parallelism over tp ranks: what must divide, with messages naming the numbers.
static atomc_status model_tp_check(const struct model_config *c, int tp, int rank, struct comm *comm,
                                   struct error *err) {
    if (rank < 0 || rank >= tp)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel rank %d outside [0, %d)", rank, tp);
    if (!comm)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d needs a communicator", tp);
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

atomc_status model_load(struct model **out, struct backend *b, const struct model_config *cfg,
                        const struct model_load_options *o, struct error *err) {
    *out = NULL;
    atomc_status st = model_check_config(cfg, err);
    if (st != ATOMC_OK) return st;
    const int tp = o->tp_size > 1 ? o->tp_size : 1;
    if (tp > 1 && (st = model_tp_check(cfg, tp, o->tp_rank, o->comm, err)) != ATOMC_OK) return st;
    struct model *m = xcalloc(1, sizeof *m);
    m->cfg = *cfg;
    m->backend = b;
    m->weight_dtype = o->weight_dtype;
    m->tp_size = tp;
    m->tp_rank = tp > 1 ? o->tp_rank : 0;
    m->comm = tp > 1 ? o->comm : NULL;
    m->global_num_heads = cfg->num_heads;
    m->global_num_kv_heads = cfg->num_kv_heads;
    m->global_intermediate_size = cfg->intermediate_size;
    if (tp > 1) {
        // Heads and intermediate columns split evenly; with fewer KV heads than ranks each KV
        // head is replicated on tp / num_kv_heads consecutive ranks (those whose query heads
        // it serves).
        int hq = cfg->num_heads / tp, hk = cfg->num_kv_heads >= tp ? cfg->num_kv_heads / tp : 1;
        m->q_head0 = m->tp_rank * hq;
        m->kv_head0 = cfg->num_kv_heads >= tp ? m->tp_rank * hk : m->tp_rank * cfg->num_kv_heads / tp;
        m->inter0 = m->tp_rank * (cfg->intermediate_size / tp);
        m->cfg.num_heads = hq;
        m->cfg.num_kv_heads = hk;
        m->cfg.intermediate_size = cfg->intermediate_size / tp;
    }
    m->q_dim = m->cfg.num_heads * cfg->head_dim;
    m->kv_dim = m->cfg.num_kv_heads * cfg->head_dim;
    m->qkv_dim = m->q_dim + 2 * m->kv_dim;
    m->layers = xcalloc((size_t)cfg->num_layers, sizeof *m->layers);
    if (cfg->num_experts > 0) m->moe_route = model_moe_route_args(cfg);
    struct weight_loader L = {.m = m, .files = o->files, .seed = o->dummy_seed ^ 0x5eedULL};
    int64_t V = cfg->vocab_size, H = cfg->hidden_size;

    if ((st = weight_load(&L, &m->embed, "model.embed_tokens.weight", 2, (int64_t[]){V, H}, 0, err))) goto fail;
    for (int l = 0; l < cfg->num_layers; l++)
        if ((st = model_load_layer(&L, l, err))) goto fail;
    if ((st = weight_load(&L, &m->final_norm, "model.norm.weight", 1, (int64_t[]){H}, 1, err))) goto fail;
    // A checkpoint without lm_head.weight ties it to the embeddings whatever the config says
    // (GGUF files drop output.weight when tied).
    bool tied = cfg->tie_word_embeddings || (o->files && !model_files_has_tensor(o->files, "lm_head.weight"));
    if (tp > 1) {
        // Vocab-parallel lm_head: this rank's rows (a copy of the embedding rows when tied).
        int64_t Vs = V / tp;
        const char *name = tied ? "model.embed_tokens.weight" : "lm_head.weight";
        if ((st = weight_load_slice(&L, &m->lm_head, name, 2, (int64_t[]){Vs, H}, 0, 0, (int64_t)m->tp_rank * Vs,
                                    err)))
            goto fail;
        if (tied) m->cfg.tie_word_embeddings = true;
    } else if (tied) {
        m->lm_head = m->embed;
        m->cfg.tie_word_embeddings = true;
    } else if ((st = weight_load(&L, &m->lm_head, "lm_head.weight", 2, (int64_t[]){V, H}, 0, err))) {
        goto fail;
    }

    int rd = cfg->rope.rotary_dim > 0 ? cfg->rope.rotary_dim : cfg->head_dim;
    float *h_inv = xmalloc((size_t)(rd / 2) * sizeof(float));
    float attn_factor;
    model_rope_inv_freq(&m->cfg, rd, h_inv, &attn_factor);
    m->inv_freq = b->ops->alloc(b, (size_t)(rd / 2) * sizeof(float));
    if (!m->inv_freq) {
        free(h_inv);
        st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate RoPE frequencies");
        goto fail;
    }
    b->ops->copy_h2d(b, m->inv_freq, h_inv, (size_t)(rd / 2) * sizeof(float));
    b->ops->synchronize(b);
    free(h_inv);
    m->rope = (struct rope_args){.inv_freq = m->inv_freq, .rotary_dim = rd, .attn_factor = attn_factor,
                                 .interleaved = cfg->rope.interleaved};
    b->ops->synchronize(b); // pools are host memory the copies may still read
    dummy_pools_free(&L);
    *out = m;
    return ATOMC_OK;
fail:
    b->ops->synchronize(b);
    dummy_pools_free(&L);
    model_free(m);
    return st;
}

int64_t model_param_count(const struct model_config *c) {
    int64_t H = c->hidden_size, I = c->intermediate_size, D = c->head_dim, V = c->vocab_size;
    int64_t q = (int64_t)c->num_heads * D, kv = (int64_t)c->num_kv_heads * D;
    int64_t layer = H * (q + 2 * kv) + q * H + 2 * H;
    if (c->attention_bias) layer += q + 2 * kv + H;
    if (c->mlp_bias) layer += 2 * I + H;
    if (c->qk_norm) layer += 2 * D;
    int64_t mlp = 0;
    for (int l = 0; l < c->num_layers; l++)
        mlp += model_config_layer_is_moe(c, l) ? model_moe_layer_params(c, false) : 3 * H * I;
    return V * H * (c->tie_word_embeddings ? 1 : 2) + layer * c->num_layers + mlp + H;
}

static void model_scratch_free(struct model *m) {
    struct model_scratch *s = &m->scratch;
    void **ps[] = {&s->residual, &s->x, &s->h, &s->qkv, &s->attn, &s->gate_up, &s->act,
                   &s->lg_res, &s->lg_h, &s->lg_x, (void **)&s->logits, (void **)&s->lg_shard,
                   (void **)&s->lg_gather};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        if (*ps[i]) m->backend->ops->free(m->backend, *ps[i]);
        *ps[i] = NULL;
    }
    s->bytes = 0;
    model_moe_scratch_free(m);
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
        {&s->lg_res, R * H * e},
        {&s->lg_h, R * H * e},
        {&s->lg_x, R * H * e},
        {(void **)&s->logits, R * (size_t)c->vocab_size * sizeof(float)},
        {(void **)&s->lg_shard, m->tp_size > 1 ? R * (size_t)(c->vocab_size / m->tp_size) * sizeof(float) : 0},
        {(void **)&s->lg_gather, m->tp_size > 1 ? R * (size_t)c->vocab_size * sizeof(float) : 0},
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
    atomc_status st = model_moe_scratch_alloc(m, max_tokens, err);
    if (st != ATOMC_OK) {
        model_scratch_free(m);
        return st;
    }
    s->bytes += s->moe.bytes;
    return ATOMC_OK;
}

void model_free(struct model *m) {
    if (!m) return;
    model_scratch_free(m);
    if (m->layers)
        for (int l = 0; l < m->cfg.num_layers; l++) model_layer_free(m, &m->layers[l]);
    free(m->layers);
    if (m->lm_head.data == m->embed.data) m->lm_head.data = NULL;
    weight_release(m, &m->lm_head);
    weight_release(m, &m->embed);
    weight_release(m, &m->final_norm);
    if (m->inv_freq) m->backend->ops->free(m->backend, m->inv_freq);
    free(m);
}
