// Declarative weight loading: a family describes its weights as tables of struct weight_entry
// (HF name suffixes -> a field, its shape in model dimensions, how its parts fuse, how it shards
// under tensor parallelism, when it exists); weight_loader.c turns any table into backend
// tensors, from a checkpoint (struct model_files, which also maps GGUF names to HF names) or as
// random dummy weights, and frees them again. No per-family loading code.
//
// Names: a layer entry's part names are relative to "model.layers.<l>."; in a per-expert entry
// "%d" in a part name is the expert index, and the parts of every expert are stacked in expert
// order, (gate_0, up_0, gate_1, up_1, ...) -> (E, sum of part rows, cols).
// Shapes: rows / cols are model dimensions (enum wdim) resolved with this rank's local sizes.
// Tensor parallelism (enum wshard): COL entries read rows [start, start + local) of every part,
// where start comes from the part's row dimension (query heads, KV heads, intermediate columns);
// ROW entries read the input columns of the entry's col dimension; ROW_BIAS entries (a
// row-parallel linear's bias) are loaded on rank 0 only, since the all-reduce sums the ranks.
#ifndef ATOMC_MODEL_WEIGHT_LOADER_H
#define ATOMC_MODEL_WEIGHT_LOADER_H

#include <stdbool.h>
#include <stddef.h>

#include "model/model.h"

enum wdim {
    WDIM_NONE = 0,  // cols only: a 1-D tensor (norm weight, bias)
    WDIM_HIDDEN,    // hidden_size
    WDIM_HEAD_DIM,  // head_dim
    WDIM_Q,         // this rank's query heads * head_dim   (TP start: q_head0 * head_dim)
    WDIM_KV,        // this rank's KV heads * head_dim      (TP start: kv_head0 * head_dim)
    WDIM_INTER,     // this rank's intermediate_size        (TP start: inter0)
    WDIM_EXPERTS,   // num_experts
    WDIM_MOE_INTER, // moe_intermediate_size
    // MLA (DeepSeek; no tensor parallelism yet, so local = global).
    WDIM_MLA_Q,     // num_heads * (qk_nope_head_dim + qk_rope_head_dim)
    WDIM_Q_LORA,    // q_lora_rank
    WDIM_KV_A,      // kv_lora_rank + qk_rope_head_dim
    WDIM_KV_LORA,   // kv_lora_rank
    WDIM_KV_B,      // num_heads * (qk_nope_head_dim + v_head_dim)
    WDIM_MLA_O,     // num_heads * v_head_dim
    WDIM_SHARED_INTER, // shared_expert_intermediate_size (Qwen), else n_shared_experts * moe_intermediate_size (DeepSeek)
    WDIM_HEADS,     // this rank's query heads               (TP start: q_head0)
    WDIM_MOE_INTER2, // 2 * moe_intermediate_size (gate and up rows of one stacked tensor)
    // Qwen3-Next / Qwen3.5 (no tensor parallelism: whole sizes).
    WDIM_Q_GATED,      // 2 q_dim: q_proj with the per-head output gate
    WDIM_ONE,          // 1 (the shared expert's gate row)
    WDIM_LIN_QKV,      // conv_dim = 2 Hk Dk + Hv Dv
    WDIM_LIN_V,        // Hv Dv
    WDIM_LIN_QKVZ,     // conv_dim + Hv Dv
    WDIM_LIN_VHEADS,   // Hv
    WDIM_LIN_BA,       // 2 Hv
    WDIM_LIN_KERNEL,   // linear_conv_kernel_dim
    WDIM_LIN_VDIM,     // Dv
    // DSA indexer (GLM-5 / DeepSeek-V3.2; whole sizes).
    WDIM_INDEX_Q,      // index_n_heads * index_head_dim
    WDIM_INDEX_HEAD,   // index_head_dim
    WDIM_INDEX_HEADS,  // index_n_heads
    // MiMo-V2-Flash (no tensor parallelism): K / V rows of full and sliding layers, whose KV head
    // counts differ and whose v heads are v_head_dim wide (o_proj's input: WDIM_MLA_O).
    WDIM_KV_V,         // num_kv_heads * v_head_dim
    WDIM_SWA_KV,       // swa_num_kv_heads * head_dim
    WDIM_SWA_KV_V,     // swa_num_kv_heads * v_head_dim
};

// How a checkpoint stores an entry.
enum wlayout {
    WLAYOUT_PARTS = 0, // one tensor per part (per expert for per_expert entries), fused by rows
    // GPT-OSS: one tensor holds every expert, (E, rows, cols) ((E, rows) for 1-D entries), or
    // (E, cols, rows) when `transposed`; a per_expert entry of one part whose name has no "%d".
    // Under quant_method mxfp4 an is_weight entry may instead be stored as <name>_blocks (U8
    // (E, rows, cols / 32, 16)) and <name>_scales (U8 (E, rows, cols / 32)), kept as they are
    // (WEIGHT_SCHEME_MX).
    WLAYOUT_STACKED,
};

enum wshard { WSHARD_NONE = 0, WSHARD_COL, WSHARD_ROW, WSHARD_ROW_BIAS };

// Dummy-weight distribution (and the kind of tensor): matrices uniform +-1/sqrt(cols), norm
// weights ones, biases small.
enum winit { WINIT_MATRIX = 0, WINIT_NORM, WINIT_BIAS };

// When an entry exists (evaluated on the checkpoint's config).
enum wcond {
    WCOND_ALWAYS = 0,
    WCOND_ATTN_BIAS,     // config attention_bias
    WCOND_ATTN_OUT_BIAS, // attention_bias, attention_out_bias, or the checkpoint has the tensor
    WCOND_MLP_BIAS,      // config mlp_bias
    WCOND_QK_NORM,       // config qk_norm
    WCOND_Q_LORA,        // q_lora_rank > 0 (MLA: q_a_proj, q_a_layernorm, q_b_proj)
    WCOND_NO_Q_LORA,     // q_lora_rank == 0 (MLA: q_proj)
    WCOND_SHARED_EXPERTS, // n_shared_experts > 0
    WCOND_SCORE_BIAS,    // noaux_tc routing: the router's e_score_correction_bias
};

#define WEIGHT_MAX_PARTS 3

struct weight_part {
    const char *name;  // HF suffix (relative to the layer prefix for layer entries)
    enum wdim rows;    // WDIM_NONE for 1-D entries: then `cols` is its length
};

struct weight_entry {
    size_t field;          // offsetof(struct model_layer, ...) of a struct tensor or struct weight
    bool is_weight;        // the field is a struct weight (a matmul operand), else a struct tensor
    enum winit init;
    enum wshard shard;
    enum wcond cond;
    bool per_expert;       // parts repeated per expert and stacked (E, rows, cols)
    enum wdim cols;        // WDIM_NONE: a 1-D entry whose length is the sum of its parts' rows
    struct weight_part parts[WEIGHT_MAX_PARTS]; // >1 part: fused by rows, in this order
    bool f32;              // kept in F32 whatever the weight dtype (ops that take F32 only: sinks,
                           // a bias added to F32 router logits); single-part, not per_expert
    enum wlayout layout;
    bool transposed;       // WLAYOUT_STACKED: stored (E, cols, rows)
    bool interleaved;      // WLAYOUT_STACKED: stored rows alternate between two halves (gate_0,
                           // up_0, gate_1, up_1, ...); loaded as (gate rows, then up rows)
    // per_expert entries: the shared-expert MLP's tensors, one per part (HF's shared_experts of
    // intermediate n_shared_experts x moe_intermediate_size), appended as n_shared_experts more
    // stacked experts: shared expert s takes rows [s I, (s + 1) I) of a part whose rows are
    // WDIM_MOE_INTER, else columns [s I, (s + 1) I) when the entry's cols are WDIM_MOE_INTER.
    const char *shared_parts[WEIGHT_MAX_PARTS];
};

// A table ends with an entry whose parts[0].name is NULL.
#define WEIGHT_TABLE_END {.parts = {{NULL, WDIM_NONE}}}

struct weight_loader;

// The loader's files (NULL for dummy weights).
struct model_files *weight_loader_files(const struct weight_loader *L);

// A loader over `files` (NULL: dummy weights from `dummy_seed`) for model m.
struct weight_loader *weight_loader_create(struct model *m, struct model_files *files, uint64_t dummy_seed);
void weight_loader_free(struct weight_loader *L);

// Loads every entry of `table` that exists for layer l into the fields of ly.
atomc_status weight_loader_load_layer(struct weight_loader *L, const struct weight_entry *table, int l,
                                      struct model_layer *ly, struct error *err);
// Frees the fields of ly that `table` describes (absent ones are NULL and skipped).
void weight_loader_free_layer(struct model *m, const struct weight_entry *table, struct model_layer *ly);

// One whole tensor by its full HF name, shape ne[0..ndim), into backend memory as the model's
// weight dtype (global weights: embeddings, final norm, lm_head). slice_dim >= 0: this rank's
// rows [slice_start, slice_start + ne[slice_dim]) of that dim.
atomc_status weight_loader_load_tensor(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                                       const int64_t *ne, enum winit init, int slice_dim, int64_t slice_start,
                                       struct error *err);

// True when the checkpoint has the tensor (always false for dummy weights).
bool weight_loader_has(const struct weight_loader *L, const char *name);

// Parameters a table's entries hold for layer l of a model with config c (whole checkpoint,
// no tensor parallelism), for model_param_count.
int64_t weight_table_params(const struct weight_entry *table, const struct model_config *c);

#endif
