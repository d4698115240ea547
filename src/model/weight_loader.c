// Table-driven weight loading (weight_loader.h): checkpoint tensors or dummy weights into
// backend memory, tensor-parallel slices, row fusion (qkv, gate_up, stacked experts).
//
// Quantized weights (an is_weight entry whose modules model_quant_weight_plan quantizes): the
// values are copied into backend memory as stored (FP8 bytes, or the I32 words of packed INT4),
// never widened; the scales are read in any float dtype, checked (shape, finite) and kept as F32.
// Fused parts (qkv, gate_up) and experts are stacked by rows, their scales with them: per-channel
// and group scales by rows; per-tensor scales of fused or stacked parts become per-channel ones
// (each row gets its part's scale: exact); 128x128 block scales stack as they are when every
// part's rows are whole blocks, else the fused weight gets blocks of g rows, g the largest common
// divisor of the block height and every part's rows, each with its part's block scale (exact:
// the same weights, a finer scale grid). Tensor-parallel shards of quantized weights are refused.
//
// Fusion: the parts are uploaded one by one, copied into the fused allocation in backend memory
// and freed, so the peak overhead is one entry's parts. Dummy weights fill the fused tensor in
// one go (one seed step per entry), so a table reproduces the same random model whatever its
// fusion.
#include "model/weight_loader.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "loader/model_files.h"
#include "model/quant.h"

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

// The dtype a checkpoint tensor of dtype `src` gets in backend memory. With --dtype auto
// (m->keep_file_dtypes) a block-quantised (GGUF Q*), F16 or BF16 tensor whose dtype the backend
// lists in caps->weight_dtypes stays as it is in the file (no expansion at load); everything
// else, and every tensor under an explicit --dtype, is converted to m->weight_dtype.
static enum dtype weight_dst_dtype(const struct model *m, enum dtype src) {
    if (!m->keep_file_dtypes || src == m->weight_dtype) return m->weight_dtype;
    bool keepable = dtype_block_elems(src) > 1 || src == DTYPE_F16 || src == DTYPE_BF16;
    const struct backend_caps *caps = m->backend->caps;
    if (keepable && caps && (caps->weight_dtypes & BACKEND_CAP_BIT(src))) return src;
    return m->weight_dtype;
}

// weight_loader_load_tensor with the destination dtype given (want >= 0: a fused entry's common
// dtype) or chosen by weight_dst_dtype (want < 0).
static atomc_status load_tensor_as(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                                   const int64_t *ne, enum winit kind, int slice_dim, int64_t slice_start, int want,
                                   struct error *err) {
    struct model *m = L->m;
    *dst = tensor_make(NULL, want >= 0 ? (enum dtype)want : m->weight_dtype, ndim, ne);
    // Norm weights and biases are stored in the weight dtype too: the ops take every weight in it.
    if (!L->files) {
        float a = kind == WINIT_MATRIX ? 1.0f / sqrtf((float)ne[ndim - 1]) : 0.02f;
        atomc_status st = kind == WINIT_NORM ? weight_fill_dummy(L, dst, 1.0f, 1.0f, name, err)
                                    : weight_fill_dummy(L, dst, -a, a, name, err);
        if (st == ATOMC_OK) m->weight_bytes += tensor_bytes(dst);
        return st;
    }
    if (m->cfg.quant.present && !strcmp(name, "lm_head.weight")) {
        // transformers keeps the output embedding unquantized unless the checkpoint says otherwise
        // (fp8 configs need not list it): a float lm_head without scales is plain.
        struct quant_weight_plan qp;
        model_quant_weight_plan(&m->cfg, "lm_head", &qp);
        char sname[64];
        snprintf(sname, sizeof sname, "lm_head.%s", qp.scale ? qp.scale : "weight_scale");
        if (qp.scheme != WEIGHT_SCHEME_NONE && (weight_loader_has(L, sname) || !weight_loader_has(L, name)))
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: a quantized lm_head (weight scheme %s) is not implemented; only checkpoints "
                             "that leave lm_head unquantized load",
                             m->cfg.quant.origin, weight_scheme_name(qp.scheme));
    }
    struct tensor src;
    atomc_status st = slice_dim < 0 ? model_files_get_tensor(L->files, name, &src, err)
                                    : model_files_get_tensor_slice(L->files, name, slice_dim, slice_start,
                                                                   ne[slice_dim], &src, err);
    if (st != ATOMC_OK) return st;
    if (tensor_numel(&src) != tensor_numel(dst) || tensor_cols(&src) != tensor_cols(dst)) {
        char want_s[96], got[96];
        shape_string(want_s, sizeof want_s, dst);
        shape_string(got, sizeof got, &src);
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s has shape %s, expected %s", name, got, want_s);
    }
    dst->dtype = want >= 0 ? (enum dtype)want : weight_dst_dtype(m, src.dtype);
    st = m->backend->ops->upload_weight(m->backend, dst, &src, err);
    if (st != ATOMC_OK) return error_prefix(err, "tensor %s: ", name);
    m->weight_bytes += tensor_bytes(dst);
    return ATOMC_OK;
}

// Loads one tensor named `name` of shape ne[0..ndim) into backend memory (dtype: weight_dst_dtype).
// slice_dim >= 0: ne is this rank's shard, read from the checkpoint as [slice_start,
// slice_start + ne[slice_dim]) of dim slice_dim (tensor parallelism); -1 = the whole tensor.
atomc_status weight_loader_load_tensor(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                                       const int64_t *ne, enum winit kind, int slice_dim, int64_t slice_start,
                                       struct error *err) {
    return load_tensor_as(L, dst, name, ndim, ne, kind, slice_dim, slice_start, -1, err);
}

// The dtype of a fused entry of n checkpoint parts: the parts' kept dtype when they agree (the
// fused rows are then the parts' bytes end to end), else the weight dtype for all of them.
static enum dtype fused_dst_dtype(struct weight_loader *L, int n, char (*names)[192], struct error *err,
                                  atomc_status *st) {
    struct model *m = L->m;
    *st = ATOMC_OK;
    if (!m->keep_file_dtypes) return m->weight_dtype;
    enum dtype common = m->weight_dtype;
    for (int i = 0; i < n; i++) {
        struct tensor src;
        if ((*st = model_files_get_tensor(L->files, names[i], &src, err)) != ATOMC_OK) return m->weight_dtype;
        enum dtype d = weight_dst_dtype(m, src.dtype);
        if (i == 0)
            common = d;
        else if (d != common)
            return m->weight_dtype;
    }
    return common;
}

// ---------------------------------------------------------------------------------------------
// Tables

static int64_t wdim_global(const struct model_config *c, enum wdim d);

// A model dimension with this rank's size and the first checkpoint index it holds.
static void wdim_resolve(const struct model *m, enum wdim d, int64_t *size, int64_t *start) {
    const struct model_config *c = &m->cfg;
    *start = 0;
    switch (d) {
    case WDIM_NONE: *size = 1; return;
    case WDIM_HIDDEN: *size = c->hidden_size; return;
    case WDIM_HEAD_DIM: *size = c->head_dim; return;
    case WDIM_Q: *size = m->q_dim; *start = (int64_t)m->q_head0 * c->head_dim; return;
    case WDIM_KV: *size = m->kv_dim; *start = (int64_t)m->kv_head0 * c->head_dim; return;
    case WDIM_INTER: *size = c->intermediate_size; *start = m->inter0; return;
    case WDIM_EXPERTS: *size = c->num_experts; return;
    case WDIM_MOE_INTER: *size = c->moe_intermediate_size; return;
    case WDIM_HEADS: *size = c->num_heads; *start = m->q_head0; return;
    case WDIM_MOE_INTER2: *size = 2 * (int64_t)c->moe_intermediate_size; return;
    default: *size = wdim_global(c, d); return; // the MLA dims (never sharded)
    }
}

// The same dimension at the checkpoint's (global) size, for parameter counts.
static int64_t wdim_global(const struct model_config *c, enum wdim d) {
    switch (d) {
    case WDIM_NONE: return 1;
    case WDIM_HIDDEN: return c->hidden_size;
    case WDIM_HEAD_DIM: return c->head_dim;
    case WDIM_Q: return (int64_t)c->num_heads * c->head_dim;
    case WDIM_KV: return (int64_t)c->num_kv_heads * c->head_dim;
    case WDIM_INTER: return c->intermediate_size;
    case WDIM_EXPERTS: return c->num_experts;
    case WDIM_MOE_INTER: return c->moe_intermediate_size;
    case WDIM_MLA_Q: return (int64_t)c->num_heads * (c->qk_nope_head_dim + c->qk_rope_head_dim);
    case WDIM_Q_LORA: return c->q_lora_rank;
    case WDIM_KV_A: return (int64_t)c->kv_lora_rank + c->qk_rope_head_dim;
    case WDIM_KV_LORA: return c->kv_lora_rank;
    case WDIM_KV_B: return (int64_t)c->num_heads * (c->qk_nope_head_dim + c->v_head_dim);
    case WDIM_MLA_O: return (int64_t)c->num_heads * c->v_head_dim;
    case WDIM_SHARED_INTER: // Qwen-style shared_expert_intermediate_size, else DeepSeek's n_shared MLPs of moe_inter
        return c->shared_expert_intermediate_size > 0 ? c->shared_expert_intermediate_size
                                                      : (int64_t)c->n_shared_experts * c->moe_intermediate_size;
    case WDIM_HEADS: return c->num_heads;
    case WDIM_MOE_INTER2: return 2 * (int64_t)c->moe_intermediate_size;
    case WDIM_Q_GATED: return 2 * (int64_t)c->num_heads * c->head_dim;
    case WDIM_ONE: return 1;
    case WDIM_LIN_QKV:
        return 2 * (int64_t)c->linear_num_key_heads * c->linear_key_head_dim +
               (int64_t)c->linear_num_value_heads * c->linear_value_head_dim;
    case WDIM_LIN_V: return (int64_t)c->linear_num_value_heads * c->linear_value_head_dim;
    case WDIM_LIN_QKVZ:
        return 2 * (int64_t)c->linear_num_key_heads * c->linear_key_head_dim +
               2 * (int64_t)c->linear_num_value_heads * c->linear_value_head_dim;
    case WDIM_LIN_VHEADS: return c->linear_num_value_heads;
    case WDIM_LIN_BA: return 2 * (int64_t)c->linear_num_value_heads;
    case WDIM_LIN_KERNEL: return c->linear_conv_kernel_dim;
    case WDIM_LIN_VDIM: return c->linear_value_head_dim;
    case WDIM_INDEX_Q: return (int64_t)c->index_n_heads * c->index_head_dim;
    case WDIM_INDEX_HEAD: return c->index_head_dim;
    case WDIM_INDEX_HEADS: return c->index_n_heads;
    case WDIM_KV_V: return (int64_t)c->num_kv_heads * c->v_head_dim;
    case WDIM_SWA_KV: return (int64_t)c->swa_num_kv_heads * c->head_dim;
    case WDIM_SWA_KV_V: return (int64_t)c->swa_num_kv_heads * c->v_head_dim;
    }
    return 0;
}

static void layer_name(char *buf, size_t n, int l, const char *part, int expert) {
    char suffix[160];
    if (expert >= 0)
        snprintf(suffix, sizeof suffix, part, expert);
    else
        snprintf(suffix, sizeof suffix, "%s", part);
    snprintf(buf, n, "model.layers.%d.%s", l, suffix);
}

// The conditions decided by the config alone (the MLA / DeepSeek ones).
static bool wcond_config(const struct model_config *c, enum wcond w) {
    switch (w) {
    case WCOND_Q_LORA: return c->q_lora_rank > 0;
    case WCOND_NO_Q_LORA: return c->q_lora_rank <= 0;
    case WCOND_SHARED_EXPERTS: return c->n_shared_experts > 0;
    case WCOND_SCORE_BIAS: return !strcmp(c->topk_method, "noaux_tc");
    default: return false;
    }
}

static bool entry_exists(const struct weight_loader *L, const struct weight_entry *e, int l) {
    const struct model_config *c = &L->m->cfg;
    switch (e->cond) {
    case WCOND_ALWAYS: return true;
    case WCOND_ATTN_BIAS: return c->attention_bias;
    case WCOND_MLP_BIAS: return c->mlp_bias;
    case WCOND_QK_NORM: return c->qk_norm;
    case WCOND_Q_LORA:
    case WCOND_NO_Q_LORA:
    case WCOND_SHARED_EXPERTS:
    case WCOND_SCORE_BIAS: return wcond_config(c, e->cond);
    case WCOND_ATTN_OUT_BIAS: {
        if (c->attention_bias || c->attention_out_bias) return true;
        char name[192];
        layer_name(name, sizeof name, l, e->parts[0].name, -1);
        return weight_loader_has(L, name);
    }
    }
    return false;
}

static struct tensor *entry_tensor(const struct weight_entry *e, struct model_layer *ly) {
    char *p = (char *)ly + e->field;
    return e->is_weight ? &((struct weight *)p)->t : (struct tensor *)p;
}

static int entry_n_parts(const struct weight_entry *e) {
    int n = 0;
    while (n < WEIGHT_MAX_PARTS && e->parts[n].name) n++;
    return n;
}

// Loads the n parts names[i] (rows[i] rows each, checkpoint rows from starts[i] when a
// column-parallel shard, cols columns or 1-D when cols == 0, input columns from col_start when
// a row-parallel shard) stacked by rows into dst. sdims (NULL = none): part i with sdims[i] >= 0
// is read as the slice [sstarts[i], + its size) of dim sdims[i] instead (shared experts).
static atomc_status load_stacked(struct weight_loader *L, struct tensor *dst, int n, char (*names)[192],
                                 const int64_t *rows, const int64_t *starts, int64_t cols, int64_t col_start,
                                 bool row_shard, const int *sdims, const int64_t *sstarts, enum winit init,
                                 struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += rows[i];
    int ndim = cols > 0 ? 2 : 1;
    int64_t ne[2] = {total, cols};
    if (n == 1 || !L->files) {
        // One tensor (or dummy weights for the whole fused entry).
        int slice_dim = -1;
        int64_t slice_start = 0;
        if (L->files && row_shard) {
            slice_dim = 1;
            slice_start = col_start;
        } else if (L->files && starts) {
            slice_dim = 0;
            slice_start = starts[0];
        }
        return weight_loader_load_tensor(L, dst, names[0], ndim, ne, init, slice_dim, slice_start, err);
    }
    atomc_status fst;
    enum dtype fdt = fused_dst_dtype(L, n, names, err, &fst);
    if (fst != ATOMC_OK) return fst;
    *dst = tensor_make(NULL, fdt, ndim, ne);
    size_t bytes = tensor_bytes(dst);
    dst->data = b->ops->alloc(b, bytes);
    if (!dst->data)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes for fused %s", bytes, names[0]);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        struct tensor part;
        int64_t pne[2] = {rows[i], cols};
        size_t wb = m->weight_bytes;
        int sd = starts ? 0 : -1;
        int64_t ss = starts ? starts[i] : 0;
        if (sdims && sdims[i] >= 0) sd = sdims[i], ss = sstarts[i];
        atomc_status st = load_tensor_as(L, &part, names[i], ndim, pne, init, sd, ss, (int)fdt, err);
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

// ---------------------------------------------------------------------------------------------
// Quantized weights (see the top of this file)

static int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

// "<module>.<suffix>" for names[i] = "<module>.weight".
static void quant_tensor_name(char *buf, size_t n, const char *weight_name, const char *suffix) {
    size_t l = strlen(weight_name), w = strlen(".weight");
    CHECK(l > w && !strcmp(weight_name + l - w, ".weight"));
    snprintf(buf, n, "%.*s.%s", (int)(l - w), weight_name, suffix);
}

// The (rows, cols) a scale tensor must have for one part of `rows` x `cols` under plan p;
// shape_ok() accepts the spellings checkpoints use ((rows, 1) or (rows) per channel, any
// one-element shape per tensor).
static void scale_shape(const struct quant_weight_plan *p, int64_t rows, int64_t cols, int64_t *sr, int64_t *sc) {
    switch (p->scheme) {
    case WEIGHT_SCHEME_BLOCK:
        *sr = ceil_div(rows, p->block_rows);
        *sc = ceil_div(cols, p->block_cols);
        return;
    case WEIGHT_SCHEME_PER_CHANNEL:
        *sr = rows;
        *sc = 1;
        return;
    case WEIGHT_SCHEME_PER_TENSOR:
        *sr = 1;
        *sc = 1;
        return;
    case WEIGHT_SCHEME_GROUP:
        *sr = rows;
        *sc = ceil_div(cols, p->block_cols);
        return;
    default:
        CHECK_MSG(0, "weight loader: scheme %s", weight_scheme_name(p->scheme));
    }
}

static bool scale_shape_ok(const struct quant_weight_plan *p, const struct tensor *t, int64_t sr, int64_t sc) {
    if (p->scheme == WEIGHT_SCHEME_PER_TENSOR) return tensor_numel(t) == 1 && t->ndim <= 2;
    if (p->scheme == WEIGHT_SCHEME_PER_CHANNEL && t->ndim == 1) return t->ne[0] == sr;
    return t->ndim == 2 && t->ne[0] == sr && t->ne[1] == sc;
}

// Reads part i's scale tensor into F32 `out` (sr * sc values), checked.
static atomc_status read_scale(struct weight_loader *L, const char *wname, const struct quant_weight_plan *p,
                               int64_t rows, int64_t cols, float *out, int64_t *sr, int64_t *sc, struct error *err) {
    char name[224];
    quant_tensor_name(name, sizeof name, wname, p->scale);
    struct tensor t;
    atomc_status st = model_files_get_tensor(L->files, name, &t, err);
    if (st != ATOMC_OK) return error_prefix(err, "%s weight scales: ", weight_scheme_name(p->scheme));
    scale_shape(p, rows, cols, sr, sc);
    if (t.dtype != DTYPE_F32 && t.dtype != DTYPE_BF16 && t.dtype != DTYPE_F16)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is %s; scales must be F32, BF16 or F16", name,
                         dtype_name(t.dtype));
    if (!scale_shape_ok(p, &t, *sr, *sc)) {
        char got[96];
        shape_string(got, sizeof got, &t);
        return error_set(err, ATOMC_ERR_FORMAT,
                         "tensor %s has shape %s, expected (%lld, %lld): the %s scales of a (%lld, %lld) weight", name,
                         got, (long long)*sr, (long long)*sc, weight_scheme_name(p->scheme), (long long)rows,
                         (long long)cols);
    }
    dtype_to_f32(t.dtype, t.data, out, *sr * *sc);
    for (int64_t i = 0; i < *sr * *sc; i++)
        if (!isfinite(out[i]))
            return error_set(err, ATOMC_ERR_FORMAT, "tensor %s: scale %lld is not finite", name, (long long)i);
    return ATOMC_OK;
}

// Part i's stored values, checked against the plan (dtype, shape, weight_shape), copied into
// backend memory at dst.
static atomc_status copy_values(struct weight_loader *L, const char *wname, const struct quant_weight_plan *p,
                                int64_t rows, int64_t cols, int64_t stored_cols, void *dst, struct error *err) {
    struct backend *b = L->m->backend;
    char name[224];
    quant_tensor_name(name, sizeof name, wname, p->values);
    struct tensor t;
    atomc_status st = model_files_get_tensor(L->files, name, &t, err);
    if (st != ATOMC_OK) return error_prefix(err, "%s weight values: ", weight_scheme_name(p->scheme));
    if (t.dtype != p->values_dtype)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is %s; the %s scheme stores %s values", name,
                         dtype_name(t.dtype), weight_scheme_name(p->scheme), dtype_name(p->values_dtype));
    if (t.ndim != 2 || t.ne[0] != rows || t.ne[1] != stored_cols) {
        char got[96];
        shape_string(got, sizeof got, &t);
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s has shape %s, expected (%lld, %lld)", name, got,
                         (long long)rows, (long long)stored_cols);
    }
    if (p->shape_tensor) {
        quant_tensor_name(name, sizeof name, wname, "weight_shape");
        struct tensor sh;
        if ((st = model_files_get_tensor(L->files, name, &sh, err)) != ATOMC_OK) return st;
        int64_t v[2] = {-1, -1};
        if ((sh.dtype == DTYPE_I64 || sh.dtype == DTYPE_I32) && tensor_numel(&sh) == 2)
            for (int k = 0; k < 2; k++)
                v[k] = sh.dtype == DTYPE_I64 ? ((const int64_t *)sh.data)[k] : ((const int32_t *)sh.data)[k];
        if (v[0] != rows || v[1] != cols)
            return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is not the integers [%lld, %lld] (%s, %lld elements)",
                             name, (long long)rows, (long long)cols, dtype_name(sh.dtype),
                             (long long)tensor_numel(&sh));
    }
    b->ops->copy_h2d(b, dst, t.data, tensor_bytes(&t));
    return ATOMC_OK;
}

// Dummy (--load-format dummy) quantized values of one part, copied to dst: random FP8 codes
// (finite, NaN bytes replaced by +-448) or random packed integer words, so benchmarks of a
// quantized config read the bytes a real checkpoint's kernels read.
static atomc_status dummy_values(struct weight_loader *L, const struct quant_weight_plan *p, int64_t rows,
                                 int64_t stored_cols, void *dst, struct error *err) {
    struct backend *b = L->m->backend;
    const size_t esz = dtype_row_bytes(p->values_dtype, 1), bytes = (size_t)rows * (size_t)stored_cols * esz;
    const size_t chunk = 8u << 20;
    uint8_t *h = malloc(bytes < chunk ? bytes : chunk);
    if (!h) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "dummy weights: out of host memory");
    for (size_t off = 0; off < bytes; off += chunk) {
        size_t nb = bytes - off < chunk ? bytes - off : chunk;
        for (size_t i = 0; i < nb; i += 8) {
            uint64_t r = splitmix64(&L->seed);
            memcpy(h + i, &r, nb - i < 8 ? nb - i : 8);
        }
        if (p->values_dtype == DTYPE_FP8_E4M3)
            for (size_t i = 0; i < nb; i++)
                if ((h[i] & 0x7f) == 0x7f) h[i] ^= 1; // NaN -> 448
        b->ops->copy_h2d(b, (char *)dst + off, h, nb);
    }
    b->ops->synchronize(b);
    free(h);
    return ATOMC_OK;
}

// Dummy scales of one part: the weights come out about uniform in +-1/sqrt(cols) (as dummy plain
// weights), FP8 codes reaching +-448, integers +-2^(bits-1).
static void dummy_scales(const struct quant_weight_plan *p, int64_t rows, int64_t cols, float *out, int64_t *sr,
                         int64_t *sc) {
    scale_shape(p, rows, cols, sr, sc);
    const float qmax = p->values_dtype == DTYPE_FP8_E4M3 ? 448.0f : (float)(1 << (p->bits - 1));
    const float s = 1.0f / sqrtf((float)cols) / qmax;
    for (int64_t i = 0; i < *sr * *sc; i++)
        out[i] = s * (0.75f + 0.5f * (float)(i % 7) / 7.0f);
}

// ---- Integer weights with zero points, g_idx maps, GPTQ / AWQ layouts, static input scales
// (issue 19 part 3; quant.h's enum quant_layout describes the stored layouts). Every layout
// becomes core/weight.h's GROUP rows: values as packed fields offset 2^(bits-1) (the unsigned
// GPTQ / AWQ values are those fields as they are), zero points as F32 in q's units.

// Reads <module>.<suffix> as an I32 tensor of exactly ne0 x ne1 (ne1 = 0: 1-D of ne0), or (for
// a 1-D tensor) any (ne0) / (ne0, 1) spelling.
static atomc_status get_i32_tensor(struct weight_loader *L, const char *wname, const char *suffix, int64_t ne0,
                                   int64_t ne1, struct tensor *t, struct error *err) {
    char name[224];
    quant_tensor_name(name, sizeof name, wname, suffix);
    atomc_status st = model_files_get_tensor(L->files, name, t, err);
    if (st != ATOMC_OK) return st;
    if (t->dtype != DTYPE_I32)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is %s; it must be I32", name, dtype_name(t->dtype));
    bool ok = ne1 > 0 ? t->ndim == 2 && t->ne[0] == ne0 && t->ne[1] == ne1 : tensor_numel(t) == ne0 && t->ndim <= 2;
    if (!ok) {
        char got[96];
        shape_string(got, sizeof got, t);
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s has shape %s, expected (%lld%s%lld)", name, got,
                         (long long)ne0, ne1 > 0 ? ", " : "", (long long)(ne1 > 0 ? ne1 : 0));
    }
    return ATOMC_OK;
}

// Field i (bits wide, low bits first) of word u.
static inline int32_t packed_field(uint32_t u, int bits, int i) {
    return (int32_t)((u >> (bits * i)) & ((1u << bits) - 1u));
}

// The stored field position of row r within its word. AWQ GEMM interleaves 4-bit rows: nibble i
// of a word holds row 8j + {0, 2, 4, 6, 1, 3, 5, 7}[i], so row 8j + t sits in nibble slot[t].
static int packed_slot(enum quant_layout layout, int64_t r, int per) {
    if (layout != QUANT_LAYOUT_AWQ) return (int)(r % per);
    static const int slot[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    return slot[r % per];
}

// GPTQ / AWQ values of one (rows, cols) part into host words h (rows, cols / per) in GROUP's
// layout. GPTQ: qweight (cols / per, rows), the words transposed (the fields keep their order
// along cols). AWQ: qweight (cols, rows / 8), unpacked from its interleaved order and repacked.
static atomc_status read_gptq_awq_values(struct weight_loader *L, const char *wname,
                                         const struct quant_weight_plan *p, int64_t rows, int64_t cols,
                                         uint32_t *h, struct error *err) {
    const int per = 32 / p->bits;
    struct tensor t;
    if (p->layout == QUANT_LAYOUT_GPTQ) {
        atomc_status st = get_i32_tensor(L, wname, p->values, cols / per, rows, &t, err);
        if (st != ATOMC_OK) return st;
        const uint32_t *q = t.data;
        for (int64_t kw = 0; kw < cols / per; kw++)
            for (int64_t r = 0; r < rows; r++)
                h[r * (cols / per) + kw] = q[kw * rows + r];
        return ATOMC_OK;
    }
    if (rows % per != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: AWQ packs %d rows per int32 word; %lld rows do not fill them",
                         wname, per, (long long)rows);
    atomc_status st = get_i32_tensor(L, wname, p->values, cols, rows / per, &t, err);
    if (st != ATOMC_OK) return st;
    const uint32_t *q = t.data;
    memset(h, 0, sizeof(uint32_t) * (size_t)(rows * (cols / per)));
    for (int64_t c = 0; c < cols; c++)
        for (int64_t r = 0; r < rows; r++) {
            const uint32_t v = (uint32_t)packed_field(q[c * (rows / per) + r / per], p->bits,
                                                      packed_slot(p->layout, r, per));
            h[r * (cols / per) + c / per] |= v << (p->bits * (c % per));
        }
    return ATOMC_OK;
}

// compressed-tensors int-quantized values: <module>.weight I8 (rows, cols) -> host words h (rows,
// cols / 4), each value + 128 in its byte field, low bits first (GROUP's 8-bit layout).
static atomc_status read_ct_int8_values(struct weight_loader *L, const char *wname, int64_t rows, int64_t cols,
                                        uint32_t *h, struct error *err) {
    struct tensor t;
    atomc_status st = model_files_get_tensor(L->files, wname, &t, err);
    if (st != ATOMC_OK) return st;
    if (t.dtype != DTYPE_I8 || t.ndim != 2 || t.ne[0] != rows || t.ne[1] != cols) {
        char got[96];
        shape_string(got, sizeof got, &t);
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is %s %s; int-quantized weights are I8 (%lld, %lld)", wname,
                         dtype_name(t.dtype), got, (long long)rows, (long long)cols);
    }
    const int8_t *q = t.data;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c += 4) {
            uint32_t u = 0;
            for (int i = 0; i < 4; i++)
                u |= (uint32_t)(uint8_t)(q[r * cols + c + i] + 128) << (8 * i);
            h[r * (cols / 4) + c / 4] = u;
        }
    return ATOMC_OK;
}

// GPTQ / AWQ scales (groups, rows) of any float dtype -> out (rows, groups) F32, checked.
static atomc_status read_gptq_awq_scales(struct weight_loader *L, const char *wname,
                                         const struct quant_weight_plan *p, int64_t rows, int64_t groups, float *out,
                                         struct error *err) {
    char name[224];
    quant_tensor_name(name, sizeof name, wname, p->scale);
    struct tensor t;
    atomc_status st = model_files_get_tensor(L->files, name, &t, err);
    if (st != ATOMC_OK) return st;
    if (t.dtype != DTYPE_F32 && t.dtype != DTYPE_BF16 && t.dtype != DTYPE_F16)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is %s; scales must be F32, BF16 or F16", name,
                         dtype_name(t.dtype));
    if (t.ndim != 2 || t.ne[0] != groups || t.ne[1] != rows) {
        char got[96];
        shape_string(got, sizeof got, &t);
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s has shape %s, expected (%lld, %lld)", name, got,
                         (long long)groups, (long long)rows);
    }
    float *tmp = malloc(sizeof(float) * (size_t)(rows * groups));
    if (!tmp) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of host memory for %s", name);
    dtype_to_f32(t.dtype, t.data, tmp, rows * groups);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t r = 0; r < rows; r++)
            out[r * groups + g] = tmp[g * rows + r];
    free(tmp);
    for (int64_t i = 0; i < rows * groups; i++)
        if (!isfinite(out[i]))
            return error_set(err, ATOMC_ERR_FORMAT, "tensor %s: scale %lld is not finite", name, (long long)i);
    return ATOMC_OK;
}

// Zero points of one part -> out (rows, groups) F32 in q's units (the zero minus 2^(bits-1)).
// compressed-tensors: weight_zero_point (ceil(rows / per), groups), packed along rows, offset
// 2^(bits-1) like the values (so the field minus the offset is the signed zero). GPTQ: qzeros
// (groups, rows / per) packed along rows, unsigned, +1 in the v1 format. AWQ: qzeros (groups,
// rows / 8) in its nibble order, unsigned.
static atomc_status read_zeros(struct weight_loader *L, const char *wname, const struct quant_weight_plan *p,
                               int64_t rows, int64_t groups, float *out, struct error *err) {
    const int per = 32 / p->bits, off = 1 << (p->bits - 1);
    struct tensor t;
    atomc_status st;
    if (p->layout == QUANT_LAYOUT_CT) {
        if ((st = get_i32_tensor(L, wname, p->zero, (rows + per - 1) / per, groups, &t, err)) != ATOMC_OK) return st;
        const uint32_t *z = t.data;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < groups; g++)
                out[r * groups + g] = (float)(packed_field(z[(r / per) * groups + g], p->bits, (int)(r % per)) - off);
        return ATOMC_OK;
    }
    if (rows % per != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: %s packs %d rows per int32 word of zeros; %lld rows do not fill "
                         "them", wname, p->layout == QUANT_LAYOUT_GPTQ ? "GPTQ" : "AWQ", per, (long long)rows);
    if ((st = get_i32_tensor(L, wname, p->zero, groups, rows / per, &t, err)) != ATOMC_OK) return st;
    const uint32_t *z = t.data;
    const int plus = p->gptq_zero_plus_one ? 1 : 0;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t r = 0; r < rows; r++)
            out[r * groups + g] =
                (float)(packed_field(z[g * (rows / per) + r / per], p->bits, packed_slot(p->layout, r, per)) + plus -
                        off);
    return ATOMC_OK;
}

// The column -> group map of one part into gidx (cols), checked (0 <= g < groups). *present =
// false when the checkpoint stores none (allowed unless the plan requires it); *trivial when
// every column's group is c / group_cols (the map then adds nothing).
static atomc_status read_gidx(struct weight_loader *L, const char *wname, const struct quant_weight_plan *p,
                              int64_t cols, int64_t groups, int64_t group_cols, int32_t *gidx, bool *present,
                              bool *trivial, struct error *err) {
    char name[224];
    quant_tensor_name(name, sizeof name, wname, p->gidx);
    *present = model_files_has_tensor(L->files, name);
    *trivial = true;
    if (!*present) {
        if (p->gidx_required)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: the config orders columns by activation (%s) but %s is missing",
                             L->m->cfg.quant.origin, p->layout == QUANT_LAYOUT_GPTQ ? "desc_act" : "actorder group",
                             name);
        return ATOMC_OK;
    }
    struct tensor t;
    atomc_status st = get_i32_tensor(L, wname, p->gidx, cols, 0, &t, err);
    if (st != ATOMC_OK) return st;
    memcpy(gidx, t.data, sizeof(int32_t) * (size_t)cols);
    for (int64_t c = 0; c < cols; c++) {
        if (gidx[c] < 0 || gidx[c] >= groups)
            return error_set(err, ATOMC_ERR_FORMAT, "tensor %s: column %lld's group %d is outside [0, %lld)", name,
                             (long long)c, (int)gidx[c], (long long)groups);
        if (gidx[c] != c / group_cols) *trivial = false;
    }
    return ATOMC_OK;
}

// The one-element static input scale of one part (<module>.input_scale), checked (> 0, finite).
static atomc_status read_input_scale(struct weight_loader *L, const char *wname, const struct quant_weight_plan *p,
                                     float *out, struct error *err) {
    char name[224];
    quant_tensor_name(name, sizeof name, wname, p->input_scale);
    struct tensor t;
    atomc_status st = model_files_get_tensor(L->files, name, &t, err);
    if (st != ATOMC_OK) return error_prefix(err, "static activation scale: ");
    if ((t.dtype != DTYPE_F32 && t.dtype != DTYPE_BF16 && t.dtype != DTYPE_F16) || tensor_numel(&t) != 1 ||
        t.ndim > 2)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s (%s, %lld elements) must be one F32 / BF16 / F16 value; "
                         "only per-tensor static activation scales are implemented", name, dtype_name(t.dtype),
                         (long long)tensor_numel(&t));
    dtype_to_f32(t.dtype, t.data, out, 1);
    if (!(*out > 0.0f) || !isfinite(*out))
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s: the input scale %g is not a positive finite number", name,
                         (double)*out);
    return ATOMC_OK;
}

// Part i's zero points (into zdst, (rows, groups), when the plan has them), g_idx (the first
// part's into gidx; later parts must store the same map, as q / k / v or gate / up do, their
// columns being one input) and static input scale (the fused parts must agree: one scale
// quantizes their common input).
static atomc_status read_part_extras(struct weight_loader *L, const char *wname, const struct quant_weight_plan *p,
                                     int i, bool stacked, int64_t rows, int64_t cols, int64_t groups, float *zdst,
                                     int32_t *gidx, int32_t *gpart, bool *gidx_used, float *act_scale,
                                     struct error *err) {
    atomc_status st = ATOMC_OK;
    if (zdst) st = read_zeros(L, wname, p, rows, groups, zdst, err);
    if (st == ATOMC_OK && gidx) {
        bool present, trivial;
        const int64_t gcols = p->block_cols > 0 ? p->block_cols : cols;
        st = read_gidx(L, wname, p, cols, groups, gcols, i == 0 ? gidx : gpart, &present, &trivial, err);
        if (st == ATOMC_OK && present && !trivial && stacked)
            st = error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %s: MoE experts with a column -> group map (desc_act / "
                           "actorder g_idx) are not implemented", L->m->cfg.quant.origin, wname);
        if (st == ATOMC_OK && i == 0) {
            *gidx_used = present && !trivial;
        } else if (st == ATOMC_OK) {
            const bool same = present ? !memcmp(gidx, gpart, sizeof(int32_t) * (size_t)cols) || (trivial && !*gidx_used)
                                      : !*gidx_used;
            if (!same)
                st = error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %s's column -> group map (g_idx) differs from the other "
                               "parts fused with it; fusing differently ordered parts is not implemented",
                               L->m->cfg.quant.origin, wname);
        }
    }
    if (st == ATOMC_OK && p->input_scale) {
        float v;
        st = read_input_scale(L, wname, p, &v, err);
        if (st == ATOMC_OK && i > 0 && v != *act_scale)
            st = error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %s's static input scale %g differs from %g of the parts fused "
                           "with it (one input, one scale); such checkpoints are not implemented",
                           L->m->cfg.quant.origin, wname, (double)v, (double)*act_scale);
        *act_scale = v;
    }
    return st;
}

// Loads the n parts names[i] (rows[i] x cols each; n = parts x E, expert-major) of a quantized
// is_weight entry into *w, under plan p; stacked (per-expert entries): (E, rows, cols) views.
static atomc_status load_quantized(struct weight_loader *L, struct weight *w, int n, int E, bool stacked,
                                   char (*names)[192], const int64_t *rows, int64_t cols,
                                   const struct quant_weight_plan *p, struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    struct quant_weight_plan pc = *p; // per-channel groups: one group of the whole row
    if (pc.scheme == WEIGHT_SCHEME_GROUP && pc.block_cols == 0) pc.block_cols = (int)cols;
    p = &pc;
    if (m->tp_size > 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: tensor-parallel shards of quantized weights (scheme %s, %s) are not implemented; use "
                         "tensor_parallel_size 1",
                         m->cfg.quant.origin, weight_scheme_name(p->scheme), names[0]);
    const bool packed = p->values_dtype == DTYPE_I32;
    const int per_word = packed ? 32 / p->bits : 1;
    if (cols % per_word != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: %lld columns do not fill whole int32 words of %d-bit values",
                         names[0], (long long)cols, p->bits);
    const int64_t stored_cols = cols / per_word;
    int64_t R = 0;
    for (int i = 0; i < n; i++)
        R += rows[i];
    // Scale layout of the fused weight.
    enum weight_scheme scheme = p->scheme;
    int br = p->block_rows;
    if (scheme == WEIGHT_SCHEME_PER_TENSOR && n > 1) scheme = WEIGHT_SCHEME_PER_CHANNEL;
    if (scheme == WEIGHT_SCHEME_BLOCK && n > 1)
        for (int i = 0; i < n; i++)
            br = (int)gcd64(br, rows[i]);
    int64_t scols = 1, srows = 0;
    if (scheme == WEIGHT_SCHEME_BLOCK) scols = ceil_div(cols, p->block_cols);
    if (scheme == WEIGHT_SCHEME_GROUP) scols = ceil_div(cols, p->block_cols);
    for (int i = 0; i < n; i++)
        srows += scheme == WEIGHT_SCHEME_BLOCK        ? ceil_div(rows[i], br)
                 : scheme == WEIGHT_SCHEME_PER_TENSOR ? 1
                                                      : rows[i];
    if (br != p->block_rows)
        LOG_DEBUG("%s: fused parts are not whole %d-row blocks; scales regridded to %d-row blocks", names[0],
                  p->block_rows, br);

    size_t esz = dtype_row_bytes(p->values_dtype, 1);
    size_t vbytes = (size_t)R * (size_t)stored_cols * esz, sbytes = (size_t)srows * (size_t)scols * sizeof(float);
    float *scale = malloc(sbytes), *part = NULL;
    void *vals = b->ops->alloc(b, vbytes);
    void *sdev = b->ops->alloc(b, sbytes);
    // Part 3: zero points (scale's layout), a shared column -> group map, a static input scale.
    const bool zeros = p->zero && L->files, want_gidx = p->gidx && L->files;
    float *zero = zeros ? malloc(sbytes) : NULL, act_scale = 0.0f;
    int32_t *gidx = want_gidx ? malloc(sizeof(int32_t) * (size_t)cols) : NULL;
    int32_t *gpart = want_gidx ? malloc(sizeof(int32_t) * (size_t)cols) : NULL;
    uint32_t *hvals = NULL; // GPTQ / AWQ values repacked on the host
    bool gidx_used = false;
    void *zdev = NULL, *gdev = NULL;
    atomc_status st = ATOMC_OK;
    if (!scale || !vals || !sdev || (zeros && !zero) || (want_gidx && (!gidx || !gpart))) {
        st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes for quantized %s", vbytes + sbytes,
                       names[0]);
        goto done;
    }
    int64_t row_off = 0, srow_off = 0;
    for (int i = 0; i < n && st == ATOMC_OK; i++) {
        int64_t sr, sc, want_r, want_c;
        scale_shape(p, rows[i], cols, &want_r, &want_c);
        free(part);
        part = malloc((size_t)(want_r * want_c) * sizeof(float));
        if (!part) {
            st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of host memory for the scales of %s", names[i]);
            break;
        }
        void *vdst = (char *)vals + (size_t)row_off * stored_cols * esz;
        if (!L->files) { // dummy weights of a quantized config
            st = dummy_values(L, p, rows[i], stored_cols, vdst, err);
            dummy_scales(p, rows[i], cols, part, &sr, &sc);
        } else if (p->layout != QUANT_LAYOUT_CT) { // GPTQ / AWQ / int-quantized: repacked into GROUP rows
            scale_shape(p, rows[i], cols, &sr, &sc);
            free(hvals);
            hvals = malloc(sizeof(uint32_t) * (size_t)(rows[i] * stored_cols));
            if (!hvals) {
                st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of host memory to repack %s", names[i]);
                break;
            }
            st = p->layout == QUANT_LAYOUT_CT_INT8 ? read_ct_int8_values(L, names[i], rows[i], cols, hvals, err)
                                                   : read_gptq_awq_values(L, names[i], p, rows[i], cols, hvals, err);
            if (st == ATOMC_OK) {
                b->ops->copy_h2d(b, vdst, hvals, sizeof(uint32_t) * (size_t)(rows[i] * stored_cols));
                b->ops->synchronize(b);
                st = p->layout == QUANT_LAYOUT_CT_INT8 ? read_scale(L, names[i], p, rows[i], cols, part, &sr, &sc, err)
                                                       : read_gptq_awq_scales(L, names[i], p, rows[i], sc, part, err);
            }
        } else {
            st = copy_values(L, names[i], p, rows[i], cols, stored_cols, vdst, err);
            if (st == ATOMC_OK) st = read_scale(L, names[i], p, rows[i], cols, part, &sr, &sc, err);
        }
        if (st == ATOMC_OK && L->files)
            st = read_part_extras(L, names[i], p, i, stacked, rows[i], cols, sc, zero ? zero + srow_off * scols : NULL,
                                  gidx, gpart, &gidx_used, &act_scale, err);
        if (st != ATOMC_OK) break;
        float *dst = scale + srow_off * scols;
        if (scheme == WEIGHT_SCHEME_BLOCK) { // part rows in blocks of br (br divides them when n > 1)
            int64_t nb = ceil_div(rows[i], br);
            for (int64_t k = 0; k < nb; k++)
                memcpy(dst + k * scols, part + (k * br / p->block_rows) * sc, (size_t)scols * sizeof(float));
            srow_off += nb;
        } else if (scheme == WEIGHT_SCHEME_PER_CHANNEL && p->scheme == WEIGHT_SCHEME_PER_TENSOR) {
            for (int64_t r = 0; r < rows[i]; r++)
                dst[r] = part[0];
            srow_off += rows[i];
        } else {
            memcpy(dst, part, (size_t)(sr * sc) * sizeof(float));
            srow_off += sr;
        }
        row_off += rows[i];
    }
    if (st != ATOMC_OK) goto done;
    CHECK(srow_off == srows && row_off == R);
    b->ops->copy_h2d(b, sdev, scale, sbytes);
    if (zero) { // all-zero zero points (symmetric GPTQ: stored 2^(bits-1)) add nothing: dropped
        bool any = false;
        for (int64_t i = 0; i < srows * scols && !any; i++)
            any = zero[i] != 0.0f;
        if (!any) {
            free(zero);
            zero = NULL;
        }
    }
    if (zero) {
        if (!(zdev = b->ops->alloc(b, sbytes))) {
            st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate the zero points of %s", names[0]);
            goto done;
        }
        b->ops->copy_h2d(b, zdev, zero, sbytes);
    }
    if (gidx_used) {
        if (!(gdev = b->ops->alloc(b, sizeof(int32_t) * (size_t)cols))) {
            st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate the g_idx of %s", names[0]);
            goto done;
        }
        b->ops->copy_h2d(b, gdev, gidx, sizeof(int32_t) * (size_t)cols);
    }
    b->ops->synchronize(b);
    *w = (struct weight){.scheme = scheme,
                         .block_rows = scheme == WEIGHT_SCHEME_BLOCK ? br : p->block_rows,
                         .block_cols = p->block_cols,
                         .bits = packed ? p->bits : 0,
                         .act = m->quant_weight_only ? WEIGHT_ACT_NONE : p->act,
                         .act_scale = weight_act_static(p->act) ? (L->files ? act_scale : 0.01f) : 0.0f};
    if (stacked) {
        w->t = tensor_make(vals, p->values_dtype, 3, (int64_t[]){E, R / E, stored_cols});
        w->scale = scheme == WEIGHT_SCHEME_PER_CHANNEL
                       ? tensor_2d(sdev, DTYPE_F32, E, srows / E)
                       : tensor_make(sdev, DTYPE_F32, 3, (int64_t[]){E, srows / E, scols});
    } else {
        w->t = tensor_2d(vals, p->values_dtype, R, stored_cols);
        w->scale = scheme == WEIGHT_SCHEME_PER_CHANNEL || scheme == WEIGHT_SCHEME_PER_TENSOR
                       ? tensor_make(sdev, DTYPE_F32, 1, (int64_t[]){srows})
                       : tensor_2d(sdev, DTYPE_F32, srows, scols);
    }
    if (zdev) w->zero = tensor_make(zdev, DTYPE_F32, w->scale.ndim, w->scale.ne);
    if (gdev) w->gidx = tensor_make(gdev, DTYPE_I32, 1, (int64_t[]){cols});
    const size_t extra = (zdev ? sbytes : 0) + (gdev ? sizeof(int32_t) * (size_t)cols : 0);
    m->weight_bytes += vbytes + sbytes + extra;
    m->weight_bytes_by_scheme[scheme] += vbytes + sbytes + extra;
    vals = sdev = zdev = gdev = NULL;
done:
    if (vals) b->ops->free(b, vals);
    if (sdev) b->ops->free(b, sdev);
    if (zdev) b->ops->free(b, zdev);
    if (gdev) b->ops->free(b, gdev);
    free(scale);
    free(part);
    free(zero);
    free(gidx);
    free(gpart);
    free(hvals);
    return st;
}

// The plan shared by every part of an is_weight entry (NONE unless the checkpoint quantizes
// them); parts planned differently are refused.
static atomc_status entry_plan(struct weight_loader *L, int n, char (*names)[192], struct quant_weight_plan *p,
                               struct error *err) {
    *p = (struct quant_weight_plan){.scheme = WEIGHT_SCHEME_NONE};
    if (!L->m->cfg.quant.present) return ATOMC_OK;
    for (int i = 0; i < n; i++) {
        char module[192];
        size_t l = strlen(names[i]), w = strlen(".weight");
        if (l <= w || strcmp(names[i] + l - w, ".weight")) return ATOMC_OK; // not a linear's weight
        snprintf(module, sizeof module, "%.*s", (int)(l - w), names[i]);
        struct quant_weight_plan q;
        model_quant_weight_plan(&L->m->cfg, module, &q);
        if (i == 0) {
            *p = q;
        } else if (q.scheme != p->scheme || q.block_cols != p->block_cols || q.values_dtype != p->values_dtype) {
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: %s (weight scheme %s) and %s (%s) are fused into one matmul, and fusing differently "
                             "quantized parts is not implemented",
                             L->m->cfg.quant.origin, names[0], weight_scheme_name(p->scheme), names[i],
                             weight_scheme_name(q.scheme));
        }
    }
    if (p->scheme == WEIGHT_SCHEME_NONE || !L->files) return ATOMC_OK; // dummy: random values in the scheme
    // A module the config targets but the checkpoint stores unquantized (a router or gate the
    // writer skipped without listing it): float weights and no scales are exact as they are.
    for (int i = 0; i < n; i++) {
        char sname[224];
        quant_tensor_name(sname, sizeof sname, names[i], p->scale);
        struct tensor t;
        if (weight_loader_has(L, sname) || !weight_loader_has(L, names[i])) return ATOMC_OK;
        if (model_files_get_tensor(L->files, names[i], &t, err) != ATOMC_OK)
            return err ? err->status : ATOMC_ERR_FORMAT;
        if (t.dtype != DTYPE_F32 && t.dtype != DTYPE_BF16 && t.dtype != DTYPE_F16) return ATOMC_OK;
    }
    LOG_DEBUG("%s: stored unquantized (%s, no %s) although %s targets it: loaded as a plain weight", names[0],
              "float values", p->scale, L->m->cfg.quant.origin);
    *p = (struct quant_weight_plan){.scheme = WEIGHT_SCHEME_NONE};
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// Stacked experts (WLAYOUT_STACKED, GPT-OSS)

// The stored row of loaded row r of an R-row stack (interleaved: gate r at 2r, up r at 2r + 1).
static int64_t stacked_src_row(bool interleaved, int64_t r, int64_t R) {
    if (!interleaved) return r;
    return r < R / 2 ? 2 * r : 2 * (r - R / 2) + 1;
}

static atomc_status stacked_shape_error(const char *name, const struct tensor *t, int ndim, const int64_t *want,
                                        struct error *err) {
    char got[96], exp[96];
    shape_string(got, sizeof got, t);
    struct tensor w = tensor_make(NULL, t->dtype, ndim, want);
    shape_string(exp, sizeof exp, &w);
    return error_set(err, ATOMC_ERR_FORMAT, "tensor %s has shape %s, expected %s", name, got, exp);
}

// MXFP4 experts: <name>_blocks (E, R, C / 32, 16) and <name>_scales (E, R, C / 32), both U8,
// rows de-interleaved, kept as stored.
static atomc_status load_stacked_mx(struct weight_loader *L, const struct weight_entry *e, const char *name,
                                    int64_t E, int64_t R, int64_t C, struct weight *w, struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    char bname[224], sname[224];
    snprintf(bname, sizeof bname, "%s_blocks", name);
    snprintf(sname, sizeof sname, "%s_scales", name);
    if (C % 32 != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: MXFP4 needs the input dimension (%lld) to be a multiple of 32",
                         bname, (long long)C);
    struct tensor tb, ts;
    atomc_status st = model_files_get_tensor(L->files, bname, &tb, err);
    if (st == ATOMC_OK) st = model_files_get_tensor(L->files, sname, &ts, err);
    if (st != ATOMC_OK) return st;
    const int64_t G = C / 32;
    const int64_t wb[4] = {E, R, G, 16}, ws[3] = {E, R, G};
    if (tb.dtype != DTYPE_U8 || ts.dtype != DTYPE_U8)
        return error_set(err, ATOMC_ERR_FORMAT, "MXFP4 tensors %s (%s) and %s (%s) must be U8", bname,
                         dtype_name(tb.dtype), sname, dtype_name(ts.dtype));
    if (tb.ndim != 4 || memcmp(tb.ne, wb, sizeof wb)) return stacked_shape_error(bname, &tb, 4, wb, err);
    if (ts.ndim != 3 || memcmp(ts.ne, ws, sizeof ws)) return stacked_shape_error(sname, &ts, 3, ws, err);
    const size_t vrow = (size_t)G * 16, srow = (size_t)G;
    const size_t vbytes = (size_t)(E * R) * vrow, sbytes = (size_t)(E * R) * srow;
    uint8_t *hv = malloc(vbytes), *hs = malloc(sbytes);
    void *dv = b->ops->alloc(b, vbytes), *ds = b->ops->alloc(b, sbytes);
    if (!hv || !hs || !dv || !ds) {
        free(hv);
        free(hs);
        if (dv) b->ops->free(b, dv);
        if (ds) b->ops->free(b, ds);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes for MXFP4 %s", vbytes + sbytes, name);
    }
    for (int64_t x = 0; x < E; x++)
        for (int64_t r = 0; r < R; r++) {
            int64_t sr = x * R + stacked_src_row(e->interleaved, r, R);
            memcpy(hv + (size_t)(x * R + r) * vrow, (const uint8_t *)tb.data + (size_t)sr * vrow, vrow);
            memcpy(hs + (size_t)(x * R + r) * srow, (const uint8_t *)ts.data + (size_t)sr * srow, srow);
        }
    b->ops->copy_h2d(b, dv, hv, vbytes);
    b->ops->copy_h2d(b, ds, hs, sbytes);
    b->ops->synchronize(b);
    free(hv);
    free(hs);
    *w = (struct weight){.t = tensor_make(dv, DTYPE_U8, 3, (int64_t[]){E, R, C / 2}),
                         .scheme = WEIGHT_SCHEME_MX,
                         .scale = tensor_make(ds, DTYPE_U8, 3, (int64_t[]){E, R, G}),
                         .block_rows = 1,
                         .block_cols = 32};
    m->weight_bytes += vbytes + sbytes;
    m->weight_bytes_by_scheme[WEIGHT_SCHEME_MX] += vbytes + sbytes;
    return ATOMC_OK;
}

// Dummy MXFP4 experts (a benchmark config that declares mxfp4, --load-format dummy): random
// nibbles with one exponent per tensor that puts the weights at about 1/sqrt(C), so the model
// keeps its MXFP4 size in memory (gpt-oss-120b fits one GPU only so).
static atomc_status dummy_stacked_mx(struct weight_loader *L, int64_t E, int64_t R, int64_t C, struct weight *w,
                                     const char *name, struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    const size_t vbytes = (size_t)(E * R * C / 2), sbytes = (size_t)(E * R * C / 32);
    void *dv = b->ops->alloc(b, vbytes), *ds = b->ops->alloc(b, sbytes);
    const size_t chunk = (size_t)1 << 22;
    uint8_t *h = malloc(chunk);
    if (!dv || !ds || !h) {
        if (dv) b->ops->free(b, dv);
        if (ds) b->ops->free(b, ds);
        free(h);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "dummy weights: cannot allocate %zu bytes for MXFP4 %s",
                         vbytes + sbytes, name);
    }
    uint64_t seed = L->seed;
    L->seed = splitmix64(&seed);
    for (size_t off = 0; off < vbytes; off += chunk) { // values
        size_t k = vbytes - off < chunk ? vbytes - off : chunk;
        for (size_t i = 0; i < k; i += 8) {
            uint64_t r = splitmix64(&seed);
            memcpy(h + i, &r, k - i < 8 ? k - i : 8);
        }
        b->ops->copy_h2d(b, (char *)dv + off, h, k);
        b->ops->synchronize(b);
    }
    // e2m1 magnitudes average ~2.3: 2^(e - 127) ~ 1 / (2.3 sqrt(C)).
    int ex = 127 - (int)lround(log2(2.3 * sqrt((double)C)));
    memset(h, ex, chunk);
    for (size_t off = 0; off < sbytes; off += chunk) {
        size_t k = sbytes - off < chunk ? sbytes - off : chunk;
        b->ops->copy_h2d(b, (char *)ds + off, h, k);
        b->ops->synchronize(b);
    }
    free(h);
    *w = (struct weight){.t = tensor_make(dv, DTYPE_U8, 3, (int64_t[]){E, R, C / 2}),
                         .scheme = WEIGHT_SCHEME_MX,
                         .scale = tensor_make(ds, DTYPE_U8, 3, (int64_t[]){E, R, C / 32}),
                         .block_rows = 1,
                         .block_cols = 32};
    m->weight_bytes += vbytes + sbytes;
    m->weight_bytes_by_scheme[WEIGHT_SCHEME_MX] += vbytes + sbytes;
    return ATOMC_OK;
}

// A WLAYOUT_STACKED entry of layer l: (E, R, C) (C = 0: (E, R)) into dst, from one checkpoint
// tensor (transposed / interleaved as the entry says) or MXFP4 blocks and scales.
static atomc_status load_stacked_experts(struct weight_loader *L, const struct weight_entry *e, int l,
                                         struct model_layer *ly, struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    CHECK_MSG(e->per_expert && entry_n_parts(e) == 1, "stacked weight entries are per-expert, of one part");
    char name[192];
    layer_name(name, sizeof name, l, e->parts[0].name, -1);
    int64_t E = m->cfg.num_experts, R, C = 0, start;
    wdim_resolve(m, e->parts[0].rows, &R, &start);
    if (e->cols != WDIM_NONE) wdim_resolve(m, e->cols, &C, &start);
    CHECK(!e->interleaved || R % 2 == 0);
    struct tensor *dst = entry_tensor(e, ly);
    const int ndim = C > 0 ? 3 : 2;
    const int64_t ne[3] = {E, R, C};
    if (!L->files && e->is_weight && C > 0 && C % 32 == 0 && m->cfg.quant.method == QUANT_METHOD_MXFP4)
        return dummy_stacked_mx(L, E, R, C, (struct weight *)((char *)ly + e->field), name, err);
    if (!L->files) return load_tensor_as(L, dst, name, ndim, ne, e->init, -1, 0, -1, err);
    char bname[224];
    snprintf(bname, sizeof bname, "%s_blocks", name);
    if (e->is_weight && C > 0 && weight_loader_has(L, bname)) {
        if (m->cfg.quant.method != QUANT_METHOD_MXFP4)
            return error_set(err, ATOMC_ERR_FORMAT, "%s is stored in MXFP4 blocks but the config declares no "
                             "quant_method 'mxfp4'", name);
        return load_stacked_mx(L, e, name, E, R, C, (struct weight *)((char *)ly + e->field), err);
    }
    struct tensor src;
    atomc_status st = model_files_get_tensor(L->files, name, &src, err);
    if (st != ATOMC_OK) return st;
    const int64_t want[3] = {E, e->transposed ? C : R, e->transposed ? R : C};
    if (src.ndim != ndim || memcmp(src.ne, want, sizeof(int64_t) * (size_t)ndim))
        return stacked_shape_error(name, &src, ndim, want, err);
    if (src.dtype != DTYPE_F32 && src.dtype != DTYPE_BF16 && src.dtype != DTYPE_F16)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s is %s; stacked experts must be F32, BF16 or F16", name,
                         dtype_name(src.dtype));
    // Reorder on the host in the stored dtype (transpose and de-interleave are permutations of
    // whole elements), then upload as one tensor.
    const size_t es = dtype_row_bytes(src.dtype, 1);
    const int64_t cols = C > 0 ? C : 1;
    const size_t bytes = (size_t)(E * R * cols) * es;
    char *h = malloc(bytes);
    if (!h) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu host bytes to reorder %s", bytes, name);
    const char *sp = src.data;
    for (int64_t x = 0; x < E; x++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t sr = stacked_src_row(e->interleaved, r, R);
            char *o = h + (size_t)((x * R + r) * cols) * es;
            if (!e->transposed || C == 0)
                memcpy(o, sp + (size_t)((x * R + sr) * cols) * es, (size_t)cols * es);
            else
                for (int64_t c = 0; c < C; c++)
                    memcpy(o + (size_t)c * es, sp + (size_t)((x * C + c) * R + sr) * es, es);
        }
    struct tensor host = tensor_make(h, src.dtype, ndim, ne);
    *dst = tensor_make(NULL, weight_dst_dtype(m, src.dtype), ndim, ne);
    st = b->ops->upload_weight(b, dst, &host, err);
    b->ops->synchronize(b);
    free(h);
    if (st != ATOMC_OK) return error_prefix(err, "tensor %s: ", name);
    m->weight_bytes += tensor_bytes(dst);
    return ATOMC_OK;
}

// --quantization fp8 (model_load_options.online_fp8): the plain weight *w, just loaded, becomes
// FP8 E4M3 with one scale per output channel (s = max |row| / 448, q = e4m3_rn(w / s), 1 for an
// all-zero row) and dynamic per-token FP8 activations, vLLM's online fp8. The values are read
// back from backend memory in the dtype they were loaded in (BF16, F32, or a GGUF block type) and
// converted exactly to f32 first.
static atomc_status quantize_online_fp8(struct weight_loader *L, struct weight *w, struct error *err) {
    struct model *m = L->m;
    struct backend *b = m->backend;
    const int64_t rows = tensor_rows(&w->t), cols = tensor_cols(&w->t);
    const size_t rb = dtype_row_bytes(w->t.dtype, cols), old = tensor_bytes(&w->t);
    int64_t chunk = (int64_t)((32u << 20) / (rb ? rb : 1)); // rows read back per copy
    if (chunk < 1) chunk = 1;
    if (chunk > rows) chunk = rows;
    uint8_t *raw = malloc(rb * (size_t)(chunk > 0 ? chunk : 1)), *q = malloc((size_t)(rows * cols));
    float *f = malloc(sizeof(float) * (size_t)cols), *sc = malloc(sizeof(float) * (size_t)rows);
    void *vals = b->ops->alloc(b, (size_t)(rows * cols)), *sdev = b->ops->alloc(b, sizeof(float) * (size_t)rows);
    atomc_status st = ATOMC_OK;
    if (!raw || !q || !f || !sc || !vals || !sdev) {
        st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "--quantization fp8: out of memory for a (%lld, %lld) weight",
                       (long long)rows, (long long)cols);
        goto done;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (r % chunk == 0) {
            const int64_t nr = rows - r < chunk ? rows - r : chunk;
            b->ops->copy_d2h(b, raw, (const char *)w->t.data + (size_t)r * rb, rb * (size_t)nr);
        }
        dtype_to_f32(w->t.dtype, raw + (size_t)(r % chunk) * rb, f, cols);
        float amax = 0.0f;
        for (int64_t c = 0; c < cols; c++)
            amax = fmaxf(amax, fabsf(f[c]));
        float s = amax / 448.0f;
        if (!(s > 0.0f)) s = 1.0f;
        sc[r] = s;
        for (int64_t c = 0; c < cols; c++)
            q[r * cols + c] = f32_to_fp8_e4m3(f[c] / s);
    }
    b->ops->copy_h2d(b, vals, q, (size_t)(rows * cols));
    b->ops->copy_h2d(b, sdev, sc, sizeof(float) * (size_t)rows);
    b->ops->synchronize(b);
    b->ops->free(b, w->t.data);
    *w = (struct weight){.t = tensor_2d(vals, DTYPE_FP8_E4M3, rows, cols),
                         .scheme = WEIGHT_SCHEME_PER_CHANNEL,
                         .scale = tensor_make(sdev, DTYPE_F32, 1, (int64_t[]){rows}),
                         .block_rows = 1,
                         .act = m->quant_weight_only ? WEIGHT_ACT_NONE : WEIGHT_ACT_FP8_TOKEN};
    m->weight_bytes = m->weight_bytes - old + (size_t)(rows * cols) + sizeof(float) * (size_t)rows;
    m->weight_bytes_by_scheme[WEIGHT_SCHEME_PER_CHANNEL] += (size_t)(rows * cols) + sizeof(float) * (size_t)rows;
    vals = sdev = NULL;
done:
    if (vals) b->ops->free(b, vals);
    if (sdev) b->ops->free(b, sdev);
    free(raw);
    free(q);
    free(f);
    free(sc);
    return st;
}

static atomc_status load_entry(struct weight_loader *L, const struct weight_entry *e, int l, struct model_layer *ly,
                               struct error *err) {
    struct model *m = L->m;
    if (e->layout == WLAYOUT_STACKED) return load_stacked_experts(L, e, l, ly, err);
    if (e->f32) { // a single 1-D / 2-D tensor kept in F32
        CHECK_MSG(!e->per_expert && entry_n_parts(e) == 1, "f32 weight entries have one part");
        char name[192];
        layer_name(name, sizeof name, l, e->parts[0].name, -1);
        int64_t rows, start, cols = 0, cstart;
        wdim_resolve(m, e->parts[0].rows, &rows, &start);
        if (e->cols != WDIM_NONE) wdim_resolve(m, e->cols, &cols, &cstart);
        const bool shard = m->tp_size > 1 && e->shard == WSHARD_COL;
        return load_tensor_as(L, entry_tensor(e, ly), name, cols > 0 ? 2 : 1, (int64_t[]){rows, cols}, e->init,
                              shard && L->files ? 0 : -1, start, DTYPE_F32, err);
    }
    const bool tp = m->tp_size > 1;
    if (e->shard == WSHARD_ROW_BIAS && tp && m->tp_rank != 0) return ATOMC_OK; // added once, before the all-reduce
    const int np = entry_n_parts(e);
    const int E_routed = e->per_expert ? m->cfg.num_experts : 1;
    const int n_shared =
        e->per_expert && e->shared_parts[0] && m->cfg.n_shared_experts > 0 ? m->cfg.n_shared_experts : 0;
    const int E = E_routed + n_shared;
    const int n = np * E;
    char(*names)[192] = xcalloc((size_t)n, sizeof *names);
    int64_t *rows = xcalloc((size_t)n, sizeof *rows), *starts = xcalloc((size_t)n, sizeof *starts);
    int *sdims = xcalloc((size_t)n, sizeof *sdims);
    int64_t *sstarts = xcalloc((size_t)n, sizeof *sstarts);
    int64_t cols = 0, col_start = 0;
    if (e->cols != WDIM_NONE) wdim_resolve(m, e->cols, &cols, &col_start);
    atomc_status st = ATOMC_OK;
    for (int x = 0; x < E; x++)
        for (int p = 0; p < np; p++) {
            int i = x * np + p;
            wdim_resolve(m, e->parts[p].rows, &rows[i], &starts[i]);
            sdims[i] = -1;
            if (x < E_routed) {
                layer_name(names[i], sizeof names[i], l, e->parts[p].name, e->per_expert ? x : -1);
                continue;
            }
            // Shared expert s = x - E_routed: its slice of the shared MLP's tensor.
            const int s = x - E_routed;
            layer_name(names[i], sizeof names[i], l, e->shared_parts[p], -1);
            const bool by_rows = e->parts[p].rows == WDIM_MOE_INTER;
            CHECK_MSG(by_rows || e->cols == WDIM_MOE_INTER, "shared part %s: no moe_intermediate dimension",
                      e->shared_parts[p]);
            sdims[i] = by_rows ? 0 : 1;
            sstarts[i] = (int64_t)s * (by_rows ? rows[i] : cols);
            if (L->files && s == 0 && st == ATOMC_OK) {
                struct tensor t;
                int64_t want_rows = by_rows ? rows[i] * n_shared : rows[i];
                int64_t want_cols = by_rows ? cols : cols * n_shared;
                if ((st = model_files_get_tensor(L->files, names[i], &t, err)) == ATOMC_OK &&
                    (t.ndim != 2 || t.ne[0] != want_rows || t.ne[1] != want_cols))
                    st = error_set(err, ATOMC_ERR_FORMAT, "tensor %s has %d dims (%lld, %lld), expected (%lld, %lld): "
                                   "n_shared_experts = %d x moe_intermediate_size", names[i], t.ndim,
                                   (long long)t.ne[0], (long long)(t.ndim > 1 ? t.ne[1] : 0), (long long)want_rows,
                                   (long long)want_cols, n_shared);
            }
        }
    const bool col_shard = tp && e->shard == WSHARD_COL, row_shard = tp && e->shard == WSHARD_ROW;
    struct tensor *dst = entry_tensor(e, ly);
    struct quant_weight_plan qp = {.scheme = WEIGHT_SCHEME_NONE};
    if (st == ATOMC_OK && e->is_weight) st = entry_plan(L, n, names, &qp, err);
    if (st == ATOMC_OK && qp.scheme != WEIGHT_SCHEME_NONE && n_shared > 1)
        st = error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %d quantized shared experts in one tensor (slicing quantized "
                       "weights) are not implemented", names[n - 1], n_shared);
    if (st == ATOMC_OK && qp.scheme != WEIGHT_SCHEME_NONE) {
        st = load_quantized(L, (struct weight *)((char *)ly + e->field), n, E, e->per_expert, names, rows, cols, &qp,
                            err);
        free(names);
        free(rows);
        free(starts);
        free(sdims);
        free(sstarts);
        return st;
    }
    if (st == ATOMC_OK)
        st = load_stacked(L, dst, n, names, rows, col_shard ? starts : NULL, cols, col_start, row_shard,
                          n_shared ? sdims : NULL, sstarts, e->init, err);
    // --quantization fp8: every linear but the MoE routers and experts (and lm_head, loaded apart).
    size_t nl = strlen(names[0]);
    const bool router = nl >= 12 && !strcmp(names[0] + nl - 12, ".gate.weight");
    if (st == ATOMC_OK && m->online_fp8 && e->is_weight && !e->per_expert && !router)
        st = quantize_online_fp8(L, (struct weight *)((char *)ly + e->field), err);
    free(names);
    free(rows);
    free(starts);
    free(sdims);
    free(sstarts);
    if (st != ATOMC_OK) return st;
    if (e->per_expert) { // (E * rows, cols) -> the stacked 3-D view (E, rows, cols)
        int64_t per = tensor_rows(dst) / E;
        *dst = tensor_make(dst->data, dst->dtype, 3, (int64_t[]){E, per, cols});
    }
    return ATOMC_OK;
}

atomc_status weight_loader_load_layer(struct weight_loader *L, const struct weight_entry *table, int l,
                                      struct model_layer *ly, struct error *err) {
    for (const struct weight_entry *e = table; e->parts[0].name; e++) {
        if (!entry_exists(L, e, l)) continue;
        atomc_status st = load_entry(L, e, l, ly, err);
        if (st != ATOMC_OK) return st;
    }
    return ATOMC_OK;
}

void weight_loader_free_layer(struct model *m, const struct weight_entry *table, struct model_layer *ly) {
    for (const struct weight_entry *e = table; e->parts[0].name; e++) {
        weight_release(m, entry_tensor(e, ly));
        if (e->is_weight) {
            struct weight *w = (struct weight *)((char *)ly + e->field);
            weight_release(m, &w->scale);
            weight_release(m, &w->zero);
        }
    }
}

bool weight_loader_has(const struct weight_loader *L, const char *name) {
    return L->files && model_files_has_tensor(L->files, name);
}

int64_t weight_table_params(const struct weight_entry *table, const struct model_config *c) {
    int64_t n = 0;
    for (const struct weight_entry *e = table; e->parts[0].name; e++) {
        bool exists = e->cond == WCOND_ALWAYS || (e->cond == WCOND_ATTN_BIAS && c->attention_bias) ||
                      (e->cond == WCOND_ATTN_OUT_BIAS && (c->attention_bias || c->attention_out_bias)) ||
                      (e->cond == WCOND_MLP_BIAS && c->mlp_bias) || (e->cond == WCOND_QK_NORM && c->qk_norm) ||
                      wcond_config(c, e->cond);
        if (!exists) continue;
        int64_t rows = 0;
        for (int p = 0; p < WEIGHT_MAX_PARTS && e->parts[p].name; p++) rows += wdim_global(c, e->parts[p].rows);
        int64_t experts = c->num_experts + (e->shared_parts[0] && c->n_shared_experts > 0 ? c->n_shared_experts : 0);
        n += rows * (e->cols != WDIM_NONE ? wdim_global(c, e->cols) : 1) * (e->per_expert ? experts : 1);
    }
    return n;
}

struct model_files *weight_loader_files(const struct weight_loader *L) { return L->files; }

struct weight_loader *weight_loader_create(struct model *m, struct model_files *files, uint64_t dummy_seed) {
    struct weight_loader *L = xcalloc(1, sizeof *L);
    L->m = m;
    L->files = files;
    L->seed = dummy_seed ^ 0x5eedULL;
    return L;
}

void weight_loader_free(struct weight_loader *L) {
    if (!L) return;
    L->m->backend->ops->synchronize(L->m->backend); // pools are host memory the copies may still read
    dummy_pools_free(L);
    free(L);
}
