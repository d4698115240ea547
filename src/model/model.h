// A loaded model: its weights as backend tensors, the precomputed RoPE frequencies, the
// scratch activations of one forward step, and the forward itself.
//
// Dense decoder architectures (LlamaForCausalLM, Qwen3ForCausalLM) share one forward
// (llama.c), written once against backend.h ops; what differs (biases, per-head q/k
// RMSNorm, tied embeddings, RoPE scaling) is data in struct model_config.
//
// Weight layout decisions (made at load, so the forward does fewer, larger GEMMs):
// - q, k and v projections are fused into one (q_dim + 2 kv_dim, hidden) matrix, rows in
//   that order; their biases likewise.
// - gate and up projections are fused into one (2 inter, hidden) matrix, gate rows first,
//   which is the layout silu_mul expects.
// - tied embeddings: lm_head aliases the embedding table (one copy in memory).
//
// Contract: every struct tensor here lives in the backend's memory and is owned by the
// model (freed by model_free), except lm_head when tied (it aliases embed).
#ifndef ATOMC_MODEL_MODEL_H
#define ATOMC_MODEL_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "common/error.h"
#include "model/config.h"

struct model_files;
struct comm;

struct model_layer {
    struct tensor attn_norm;    // (hidden)
    struct tensor qkv;          // (q_dim + 2 kv_dim, hidden)
    struct tensor qkv_bias;     // (q_dim + 2 kv_dim) or data == NULL
    struct tensor q_norm;       // (head_dim) Qwen3 only
    struct tensor k_norm;       // (head_dim) Qwen3 only
    struct tensor o;            // (hidden, q_dim)
    struct tensor o_bias;       // (hidden) or data == NULL
    struct tensor mlp_norm;     // (hidden)
    struct tensor gate_up;      // (2 inter, hidden)
    struct tensor gate_up_bias; // (2 inter) or data == NULL
    struct tensor down;         // (hidden, inter)
    struct tensor down_bias;    // (hidden) or data == NULL
    // Mixture-of-experts layers (moe.c): then gate_up/down above are unused (data == NULL).
    bool moe;
    struct tensor router;        // (E, hidden)
    struct tensor exp_gate_up;   // (E, 2 moe_inter, hidden): per expert gate rows, then up rows
    struct tensor exp_down;      // (E, hidden, moe_inter)
};

// MoE scratch (moe.c), allocated with the rest of the scratch when the model has MoE layers.
struct model_moe_scratch {
    float *logits;      // (max_tokens, E) F32 router logits
    int32_t *topk_ids;  // (max_tokens, top_k) expert ids
    float *topk_w;      // (max_tokens, top_k) F32 combine weights
    void *workspace;    // moe_workspace_bytes(max_tokens, top_k, E, hidden, moe_inter)
    size_t bytes;
};

// Activations of one step, allocated once for `max_tokens` rows (max_num_batched_tokens)
// and `max_logits_rows` logits rows. Sizes are in backend->act_dtype unless noted.
struct model_scratch {
    int max_tokens;
    int max_logits_rows;
    void *residual;   // (max_tokens, hidden)
    void *x;          // (max_tokens, hidden) normed input of a block
    void *h;          // (max_tokens, hidden) output of o_proj / down_proj
    void *qkv;        // (max_tokens, qkv_dim)
    void *attn;       // (max_tokens, q_dim)
    void *gate_up;    // (max_tokens, 2 inter)
    void *act;        // (max_tokens, inter)
    void *lg_res;     // (max_logits_rows, hidden) gathered residual rows
    void *lg_h;       // (max_logits_rows, hidden) gathered last-block output rows
    void *lg_x;       // (max_logits_rows, hidden) final-normed rows
    float *logits;    // (max_logits_rows, vocab) F32
    float *lg_shard;  // TP only: (max_logits_rows, vocab / tp) F32 this rank's vocab-parallel logits
    float *lg_gather; // TP only: (tp, max_logits_rows, vocab / tp) F32 staging of the all-gather
    size_t bytes;     // total allocated
    struct model_moe_scratch moe;
};

struct model {
    struct model_config cfg;
    struct backend *backend;      // not owned
    enum dtype weight_dtype;
    int q_dim, kv_dim, qkv_dim;   // n_heads * head_dim, n_kv_heads * head_dim, q_dim + 2 kv_dim

    struct tensor embed;          // (vocab, hidden)
    struct tensor final_norm;     // (hidden)
    struct tensor lm_head;        // (vocab, hidden); aliases embed when tied
    struct model_layer *layers;   // (num_layers)

    float *inv_freq;              // (rotary_dim / 2) backend memory
    struct rope_args rope;

    // Tensor parallelism (tp_size > 1): this rank holds heads [q_head0, q_head0 + cfg.num_heads),
    // KV heads [kv_head0, kv_head0 + cfg.num_kv_heads) (replicated when the model has fewer KV
    // heads than ranks) and intermediate columns [inter0, inter0 + cfg.intermediate_size): cfg
    // holds this rank's LOCAL sizes, global_* the checkpoint's. o_proj and down_proj are
    // row-parallel (their outputs are all-reduced over `comm`; their biases live on rank 0
    // only). lm_head is vocab-parallel: rows [tp_rank V/tp, (tp_rank+1) V/tp) (of the embedding
    // table when tied), whose logits are all-gathered so every rank holds (and samples) the
    // same full logits. Embeddings and norms are replicated.
    int tp_rank, tp_size;
    struct comm *comm;            // not owned; NULL when tp_size == 1
    int global_num_heads, global_num_kv_heads, global_intermediate_size;
    int q_head0, kv_head0, inter0;
    atomc_status comm_status;     // first collective failure (ATOMC_OK otherwise); sticky: the
                                  // group is unusable after it, every later forward reports it
    struct error comm_err;

    size_t weight_bytes;          // bytes of weights in backend memory
    struct model_scratch scratch;
    struct moe_route_args moe_route; // MoE models: routing parameters (moe.c)
    int last_tokens;              // rows of the last model_forward (what compute_logits gathers from)
};

// Where weights come from: an opened checkpoint (HF directory or GGUF) or random numbers.
struct model_load_options {
    struct model_files *files;    // NULL = dummy (random) weights
    uint64_t dummy_seed;
    enum dtype weight_dtype;      // dtype weights are converted to in backend memory
    // Tensor parallelism: this rank's slice of every sharded weight is read (through
    // model_files_get_tensor_slice); tp_size 0 or 1 = the whole model. comm: not owned.
    int tp_rank, tp_size;
    struct comm *comm;
};

// Loads (or generates) every weight of `cfg`'s architecture into backend memory, fuses
// qkv and gate_up, precomputes inv_freq. On failure everything allocated is freed and the
// message names the tensor.
atomc_status model_load(struct model **out, struct backend *b, const struct model_config *cfg,
                        const struct model_load_options *o, struct error *err);
void model_free(struct model *m);

// Allocates the scratch activations for steps of up to max_tokens tokens and max_logits_rows rows.
atomc_status model_scratch_alloc(struct model *m, int max_tokens, int max_logits_rows, struct error *err);

// Parameters of a dense model of this config (embeddings counted once when tied).
int64_t model_param_count(const struct model_config *c);

// Host-side inverse RoPE frequencies for every scaling kind of rope_config (default, linear,
// llama3, yarn, dynamic computed as default). inv_freq has rotary_dim / 2 entries;
// *attn_factor receives the cos/sin multiplier (YaRN mscale, 1 otherwise).
void model_rope_inv_freq(const struct model_config *cfg, int rotary_dim, float *inv_freq, float *attn_factor);

// Runs the decoder stack over the batch (writes K/V of every new token into kv at
// md->slot_mapping). Afterwards residual + h hold the final hidden state of every row.
// token_ids: (n_tokens) backend int32.
void model_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                   struct kv_layer *kv);

// Errors of the collectives of a tensor-parallel forward are recorded in m->comm_status /
// m->comm_err (the forward itself cannot fail otherwise); the caller checks them.
//
// After model_forward: logits (F32, in m->scratch.logits) of n_rows rows (<= max_logits_rows)
// given by rows (backend int32 array of token row indices). Returns the F32 logits tensor.
struct tensor model_compute_logits(struct model *m, const int32_t *rows, int n_rows);

#endif
