// A loaded model: its weights as backend tensors, the cache each layer keeps, the precomputed
// RoPE frequencies, the scratch activations of one forward step, and the forward itself.
//
// The seam (docs/ARCHITECTURE.md, "How to add an architecture"):
// - An architecture is one entry of the table in src/model/arch.c (struct model_arch_def,
//   src/model/arch.h): config check, layer plan (which attention kind, which FFN kind, which
//   cache spec and which weight tables each layer has), forward. The forward of a family lives
//   in its own file (llama.c: Llama, Mistral, Qwen3, Qwen3-MoE, Mixtral) as a short loop over
//   the shared block functions of src/model/blocks.c (gpt_oss.c: GPT-OSS).
// - Weights are data: each family has tables (struct weight_entry, src/model/weight_loader.h)
//   mapping HF name suffixes to fields of struct model_layer with their shapes, fuse groups and
//   tensor-parallel shard kinds; src/model/weight_loader.c loads any table (checkpoint or dummy
//   weights, TP slices, fusion).
// - Each layer declares its cache (struct cache_spec): the runner sizes and lays out the KV pool
//   from the specs, and the engine frees sliding-window blocks from them.
// - model_load checks the config against the backend's capabilities (struct backend_caps)
//   before any weight is loaded; what the backend cannot run is a status, not an abort.
//
// Weight layout decisions (made at load, so the forward does fewer, larger GEMMs):
// - q, k and v projections are fused into one (q_dim + 2 kv_dim, hidden) matrix, rows in
//   that order; their biases likewise.
// - gate and up projections are fused into one (2 inter, hidden) matrix, gate rows first,
//   which is the layout silu_mul expects; experts likewise, stacked (E, 2 moe_inter, hidden).
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
struct model_arch_def;

// ---------------------------------------------------------------------------------------------
// Layers: an attention kind and an FFN kind, each with its own weights.

enum attn_kind {
    ATTN_KIND_GQA = 0, // multi-/grouped-query attention over a paged K/V cache (full or sliding window)
    ATTN_KIND_MLA,     // multi-head latent attention over a latent cache (DeepSeek-V2/V3, block_mla.c)
    ATTN_KIND_GQA_GATED,     // GQA whose q_proj also yields a sigmoid output gate per head (Qwen3-Next; qwen3_next.c)
    ATTN_KIND_GATED_DELTANET, // Gated DeltaNet linear attention over a per-sequence recurrent state (qwen3_next.c)
};

enum ffn_kind {
    FFN_KIND_DENSE = 0, // gate_up -> SiLU*mul -> down
    FFN_KIND_MOE,       // router -> top-k -> fused experts
    FFN_KIND_MOE_SHARED_GATED, // FFN_KIND_MOE + a shared expert (dense MLP) times sigmoid(x . w_gate) per token
};

struct attn_gqa_weights {
    struct weight qkv;          // (q_dim + 2 kv_dim, hidden)
    struct tensor qkv_bias;     // (q_dim + 2 kv_dim) or data == NULL
    struct tensor q_norm;       // (head_dim) Qwen3's per-head RMSNorm, or data == NULL
    struct tensor k_norm;       // (head_dim) or data == NULL
    struct weight o;            // (hidden, q_dim)
    struct tensor o_bias;       // (hidden) or data == NULL
    struct tensor sinks;        // (n_heads) F32 GPT-OSS's learned attention sinks, or data == NULL
};

// MLA (DeepSeek): H heads, nope / rope / v head dims, kv_lora_rank L, q_lora_rank Q (0 = direct q).
struct attn_mla_weights {
    struct weight q;            // (H (nope + rope), hidden) when Q == 0
    struct weight q_a;          // (Q, hidden) when Q > 0
    struct tensor q_a_norm;     // (Q)
    struct weight q_b;          // (H (nope + rope), Q)
    struct weight kv_a;         // (L + rope, hidden): compressed kv, then k_pe
    struct tensor kv_a_norm;    // (L)
    struct weight kv_b;         // (H (nope + v), L): per head W_UK (nope rows), W_UV (v rows); see struct mla_args
    struct weight o;            // (hidden, H v)
    // DSA lightning indexer (GLM-5 / DeepSeek-V3.2), on layers that run their own ("full"); IH heads
    // of ID dims. data == NULL without DSA and on "shared" layers.
    struct weight idx_wq_b;     // (IH ID, Q) from the normed q_a
    struct weight idx_wk;       // (ID, hidden)
    struct tensor idx_k_norm;   // (ID) LayerNorm weight
    struct tensor idx_k_norm_b; // (ID) LayerNorm bias
    struct weight idx_weights;  // (IH, hidden) weights_proj: per-head weights of the scores
};

// Gated DeltaNet (Qwen3-Next / Qwen3.5). Hk key heads of Dk, Hv value heads of Dv, conv_dim =
// 2 Hk Dk + Hv Dv. Rows of qkvz are (q, k, v, z) head-major as Qwen3.5 stores them (Qwen3-Next's
// per-key-head grouped in_proj_qkvz / in_proj_ba rows are reordered at load, qwen3_next.c).
struct attn_deltanet_weights {
    struct weight qkvz;         // (conv_dim + Hv Dv, hidden)
    struct weight ba;           // (2 Hv, hidden): b (beta) rows, then a (decay) rows
    struct tensor conv;         // (conv_dim, K) depthwise causal conv1d kernel
    struct tensor a_log;        // (Hv)
    struct tensor dt_bias;      // (Hv)
    struct tensor norm;         // (Dv) gated RMSNorm weight (plain, not zero-centred)
    struct weight out;          // (hidden, Hv Dv)
};

struct ffn_dense_weights {
    struct weight gate_up;      // (2 inter, hidden)
    struct tensor gate_up_bias; // (2 inter) or data == NULL
    struct weight down;         // (hidden, inter)
    struct tensor down_bias;    // (hidden) or data == NULL
};

struct ffn_moe_weights {
    struct weight router;       // (E, hidden)
    struct tensor router_bias;  // (E) F32 (GPT-OSS), or data == NULL
    // Stacked experts: E routed ones, then n_shared_experts shared ones, which moe_route's shared
    // slots select for every token. GLM-4-MoE's tables stack them at load (shared_parts);
    // DeepSeek loads them into shared_gate_up / shared_down and stacks them in finish_load.
    struct weight gate_up;      // (E + n_shared, 2 moe_inter, hidden): per expert gate rows, then up rows
    struct weight down;         // (E + n_shared, hidden, moe_inter)
    // Shared experts (DeepSeek: one MLP of n_shared * moe_inter): loaded into these, then stacked
    // after the routed experts as n_shared more experts of moe_inter each (gate_up / down become
    // (E + n_shared, ...)), the moe_route shared slots; data == NULL once stacked.
    struct weight shared_gate_up; // (2 n_shared moe_inter, hidden): gate rows, then up rows
    struct weight shared_down;    // (hidden, n_shared moe_inter)
    struct tensor score_bias;     // (E) F32 e_score_correction_bias (noaux_tc, GLM-4-MoE), or data == NULL
    struct tensor gate_up_bias; // (E, 2 moe_inter) as gate_up's rows (GPT-OSS), or data == NULL
    struct tensor down_bias;    // (E, hidden) (GPT-OSS), or data == NULL
};

// MoE with a shared expert scaled by its own per-token sigmoid gate (Qwen3-Next / Qwen3.5).
struct ffn_moe_shared_weights {
    struct ffn_moe_weights moe;
    struct weight shared_gate_up; // (2 shared_inter, hidden)
    struct weight shared_down;    // (hidden, shared_inter)
    struct weight shared_gate;    // (1, hidden)
};

struct model_layer {
    enum attn_kind attn_kind;
    enum ffn_kind ffn_kind;
    int sliding_window;         // attention window of this layer (0 = full)
    struct tensor attn_norm;    // (hidden)
    struct tensor ffn_norm;     // (hidden)
    union {
        struct attn_gqa_weights gqa; // GQA; GQA_GATED: qkv rows (q, gate, k, v)
        struct attn_mla_weights mla;
        struct attn_deltanet_weights dn;
    } attn;
    union {
        struct ffn_dense_weights dense;
        struct ffn_moe_weights moe;
        struct ffn_moe_shared_weights moe_sh;
    } ffn;
};

// A multi-token-prediction (MTP) layer (DeepSeek-V3 / GLM-4-MoE's num_nextn_predict_layers,
// stored as model.layers.<num_layers + i>.*; src/model/mtp.c): for position p it combines the
// target's final hidden state h_p with the embedding of token p + 1 and predicts token p + 2:
//   x = eh_proj [enorm(embed(t_{p+1})), hnorm(h_p)]  ->  decoder layer  ->  out (pre-norm)
//   logits = head(head_norm(out)); chained: out is the next position's h.
struct model_mtp_layer {
    struct model_layer layer;   // the decoder layer (the family's plan for index num_layers + i)
    struct tensor enorm, hnorm; // (hidden)
    struct weight eh_e, eh_h;   // (hidden, hidden) eh_proj's columns for the embedding / the hidden state
    struct tensor head_norm;    // (hidden) shared_head.norm
    struct weight head;         // (vocab, hidden) shared_head.head; aliases the model's lm_head when absent
    struct tensor embed;        // (vocab, hidden) embed_tokens; aliases the model's embeddings when absent
};
// An EAGLE-3 draft head (src/model/eagle3.c; loaded from its own directory for speculative method
// "eagle3", Llama targets only). For position p with token t_{p+1}:
//   hid  = fc [a_0(p) ; a_1(p) ; a_2(p)]   a_i: the target's residual stream entering layer
//          aux_layers[i], captured by the target's forward (chained steps: the previous step's out)
//   x    = [input_norm(embed(t_{p+1})) ; hidden_norm(hid)]     (2 hidden inputs to q / k / v)
//   h    = r + o(attention(x)), r = hid (norm_before_residual: hidden_norm(hid)), its own cache
//   out  = h + mlp(post_norm(h));  logits = head(norm(out)) over draft_vocab ids, draft id d
//          meaning target id d2t[d]
// The concatenations become sums of GEMMs over column blocks split at load (fc: 3, qkv: 2).
#define EAGLE3_N_AUX 3
struct model_eagle3 {
    int aux_layers[EAGLE3_N_AUX]; // target layers whose input residual stream is captured, in fc's column order
    int draft_vocab;              // rows of head
    int intermediate_size;        // the draft layer's MLP
    bool norm_before_residual;
    float eps;                    // the head's rms_norm_eps
    struct weight fc[EAGLE3_N_AUX];  // (hidden, hidden) column block i of fc.weight
    struct tensor fc_bias;        // (hidden) or data == NULL (speculators' heads have one)
    struct tensor input_norm, hidden_norm, post_norm, norm; // (hidden)
    struct weight qkv_e, qkv_h;   // (q_dim + 2 kv_dim, hidden): q/k/v rows over the embedding / hidden half
    struct weight o;              // (hidden, q_dim)
    struct weight gate_up, down;  // (2 inter, hidden), (hidden, inter)
    struct weight head;           // (draft_vocab, hidden)
    struct tensor embed;          // (vocab, hidden); aliases the model's embeddings when the head has none
    int32_t *d2t;                 // host (draft_vocab): the target id of each draft id
    float *inv_freq;              // the draft layer's own RoPE (its config's rope_theta / scaling)
    struct rope_args rope;
};

// The attention metadata layer ly reads: the sliding-window group's (its own block tables and
// slots) when the runner keeps per-layer-group block tables, else md.
static inline const struct attn_metadata *model_layer_metadata(const struct model_layer *ly,
                                                               const struct attn_metadata *md) {
    return ly->sliding_window > 0 && md->sliding ? md->sliding : md;
}

// ---------------------------------------------------------------------------------------------
// Cache specs: what a layer keeps per token (paged kinds) or per sequence (recurrent).

enum cache_kind {
    CACHE_KIND_FULL = 0, // K and V of every token: (blocks, block_size, kv_heads, head_dim_k / head_dim_v)
    CACHE_KIND_SLIDING,  // the same layout; only the last `window` tokens are read, older blocks may be freed
    CACHE_KIND_LATENT,   // one latent row per token (MLA): (blocks, block_size, 1, latent_dim); V only with DSA:
                         // the indexer keys (blocks, block_size, 1, index_dim)
    CACHE_KIND_RECURRENT, // a fixed state per sequence (linear attention), not paged
};

struct cache_spec {
    enum cache_kind kind;
    int n_kv_heads;          // FULL / SLIDING (this rank's, under tensor parallelism)
    int head_dim_k, head_dim_v;
    int latent_dim;          // LATENT
    int index_dim;           // LATENT with DSA: the indexer key per token (index_head_dim), kept as the layer's v
    int window;              // SLIDING: tokens each query attends to (itself included)
    size_t state_bytes;      // RECURRENT: bytes per sequence (F32 conv state + delta-rule state)
    int conv_dim, conv_kernel; // RECURRENT: conv state (conv_dim, conv_kernel - 1)
    int n_v_heads, k_dim, v_dim; // RECURRENT: delta-rule state (n_v_heads, k_dim, v_dim)
    // FULL / SLIDING: the checkpoint's static KV-cache scales (model_kv_scales_load, quant.h):
    // an FP8 cache stores K / k_scale and V / v_scale. 0 = none (the FP8 cache uses 1.0).
    float k_scale, v_scale;
};

// Bytes one token takes in a paged spec's cache (0 for RECURRENT) with elements of kv_dtype.
size_t cache_spec_token_bytes(const struct cache_spec *s, enum dtype kv_dtype);
const char *cache_kind_name(enum cache_kind k);

// ---------------------------------------------------------------------------------------------
// Scratch

// MoE scratch, allocated with the rest of the scratch when the model has MoE layers.
struct model_moe_scratch {
    float *logits;      // (max_tokens, E) F32 router logits
    int32_t *topk_ids;  // (max_tokens, top_k + n_shared) expert ids
    float *topk_w;      // (max_tokens, top_k + n_shared) F32 combine weights
    void *workspace;    // moe_workspace_bytes(max_tokens, top_k + n_shared, E + n_shared, hidden, moe_inter)
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
    void *extra;      // (max_tokens x the architecture's extra_scratch_cols) a family's own activations
    void *lg_res;     // (max_logits_rows, hidden) gathered residual rows
    void *lg_h;       // (max_logits_rows, hidden) gathered last-block output rows
    void *lg_x;       // (max_logits_rows, hidden) final-normed rows
    float *logits;    // (max_logits_rows, vocab) F32
    float *lg_shard;  // TP only: (max_logits_rows, vocab / tp) F32 this rank's vocab-parallel logits
    float *lg_gather; // TP only: (tp, max_logits_rows, vocab / tp) F32 staging of the all-gather
    struct model_moe_scratch moe;
    void *mla_workspace; // MLA models: mla_workspace_bytes(max_tokens, ...)
    void *mtp_a, *mtp_b, *mtp_c; // MTP layers or an EAGLE-3 head loaded: (max_tokens, hidden) each (mtp.c, eagle3.c)
    void *eagle3_aux[EAGLE3_N_AUX]; // EAGLE-3: (max_tokens, hidden) each, the aux layers' residual stream of the last forward
    void *eagle3_qkv;             // EAGLE-3: (max_tokens, qkv_dim) the hidden half's q/k/v
    size_t bytes;     // total allocated
};

// ---------------------------------------------------------------------------------------------
// The model

struct model {
    struct model_config cfg;
    const struct model_arch_def *arch; // the architecture table entry (arch.c)
    struct backend *backend;      // not owned
    enum dtype weight_dtype;      // the default dtype of weights in backend memory
    bool quant_weight_only;       // model_load_options.quant_weight_only
    bool online_fp8;              // model_load_options.online_fp8
    bool keep_file_dtypes;        // dtype auto: quantised / F16 / BF16 tensors the backend takes stay as in the file
    int q_dim, kv_dim, qkv_dim;   // n_heads * head_dim, n_kv_heads * head_dim, q_dim + 2 kv_dim

    struct tensor embed;          // (vocab, hidden)
    struct tensor final_norm;     // (hidden)
    struct weight lm_head;        // (vocab, hidden); .t aliases embed when tied
    struct model_layer *layers;   // (num_layers)
    struct cache_spec *layer_cache; // (n_cache_layers) what each layer keeps; MTP layers after the decoder's
    int n_cache_layers;           // num_layers + n_mtp: the runner's KV pool has one entry per cache layer
    int n_mtp;                    // MTP layers loaded (model_load_options.load_mtp), 0 otherwise
    struct model_mtp_layer *mtp;  // (n_mtp); their caches are layer_cache[num_layers + i]
    struct model_eagle3 *eagle3;  // EAGLE-3 head (model_load_options.eagle3_path) or NULL; its cache is
                                  // layer_cache[num_layers]

    float *inv_freq;              // (rotary_dim / 2) backend memory
    struct rope_args rope;
    // The sliding-window layers' RoPE when the config gives them their own (cfg.rope_sliding,
    // MiMo-V2-Flash); inv_freq NULL otherwise.
    float *inv_freq_sliding;
    struct rope_args rope_sliding;

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
    // Of weight_bytes, the quantized weights' (values + scales) per scheme; [NONE] stays 0.
    size_t weight_bytes_by_scheme[WEIGHT_SCHEME_COUNT];
    struct model_scratch scratch;
    struct moe_route_args moe_route; // MoE models: routing parameters
    int last_tokens;              // rows of the last model_forward (what compute_logits gathers from)
    // KV transfer (issue 24): when set, called at the end of every layer's attention block, once
    // that layer's KV writes of the batch are issued to the backend (CPU: done; CUDA: queued on
    // the stream, so the callee records an event). The runner sets it around one eager forward
    // and never while a CUDA graph is captured; NULL otherwise.
    void (*kv_layer_hook)(void *arg, int layer);
    void *kv_layer_hook_arg;
};

// Where weights come from: an opened checkpoint (HF directory or GGUF) or random numbers.
struct model_load_options {
    struct model_files *files;    // NULL = dummy (random) weights
    uint64_t dummy_seed;
    enum dtype weight_dtype;      // dtype weights are converted to in backend memory
    // dtype "auto": a tensor stored block-quantised (GGUF Q*), F16 or BF16 whose dtype the backend
    // lists in caps->weight_dtypes keeps that dtype; the others get weight_dtype. false (an
    // explicit --dtype): every tensor is converted to weight_dtype.
    bool keep_file_dtypes;
    enum dtype kv_dtype;          // the KV cache dtype the runner will use (checked against the backend)
    int block_size;               // the KV block size (checked against the backend); 0 = not checked
    // Tensor parallelism: this rank's slice of every sharded weight is read (through
    // model_files_get_tensor_slice); tp_size 0 or 1 = the whole model. comm: not owned.
    int tp_rank, tp_size;
    struct comm *comm;
    // BENCHMARK ONLY: MoE routing replaced by a balanced round-robin (token t, slot j -> expert
    // (t * top_k + j) mod E, weight 1 / top_k): random dummy routers concentrate traffic that
    // real routers spread. Set by the bench commands' --moe-uniform-routing, never by serving.
    bool moe_force_uniform;
    // W8A8 checkpoints computed weight-only: the input activations stay unquantized (struct
    // weight.act NONE), i.e. transformers' dequantize=True forward that the quant fixtures' refs
    // are. Default false: the activations are quantized as the checkpoint says, on every backend.
    bool quant_weight_only;
    // --quantization fp8 (vLLM's online fp8) of an unquantized checkpoint: every linear weight but
    // lm_head, the MoE routers and the experts becomes per-channel FP8 with dynamic per-token FP8
    // activations at load (weight_loader.c quantize_online_fp8).
    bool online_fp8;
    // Speculative method "mtp": also load the num_nextn_predict_layers MTP layers (src/model/mtp.c);
    // a family without MTP support or a config without MTP layers is refused. false: they are
    // skipped (the loader leaves their tensors unread by design).
    bool load_mtp;
    // Speculative method "eagle3": the EAGLE-3 head directory (src/model/eagle3.c); NULL = none.
    const char *eagle3_path;
};

// Loads (or generates) every weight of `cfg`'s architecture into backend memory, fuses
// qkv and gate_up, precomputes inv_freq. Checks the architecture, the config and the
// backend's capabilities first. On failure everything allocated is freed and the message
// names the architecture, field or tensor.
atomc_status model_load(struct model **out, struct backend *b, const struct model_config *cfg,
                        const struct model_load_options *o, struct error *err);
void model_free(struct model *m);

// The capability check model_load runs (exported for tests): the model of `cfg` (after the
// architecture's own check) against `caps` with the weight / KV dtypes and block size of `o`.
atomc_status model_check_backend_caps(const struct model_config *cfg, const struct backend_caps *caps,
                                      const struct model_load_options *o, struct error *err);

// Allocates the scratch activations for steps of up to max_tokens tokens and max_logits_rows rows.
atomc_status model_scratch_alloc(struct model *m, int max_tokens, int max_logits_rows, struct error *err);

// Parameters of a model of this config (embeddings counted once when tied).
int64_t model_param_count(const struct model_config *c);

// Host-side inverse RoPE frequencies for every scaling kind of rope_config (default, linear,
// llama3, yarn, dynamic computed as default). inv_freq has rotary_dim / 2 entries;
// *attn_factor receives the cos/sin multiplier (YaRN mscale, 1 otherwise).
void model_rope_inv_freq(const struct model_config *cfg, int rotary_dim, float *inv_freq, float *attn_factor);

// Runs the decoder stack over the batch (writes the cache of every new token into kv at
// md->slot_mapping; kv has one entry per layer, laid out by the layer's cache spec).
// Afterwards the scratch holds what model_compute_logits needs. token_ids: (n_tokens) backend int32.
void model_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                   struct kv_layer *kv);

// Errors of the collectives of a tensor-parallel forward are recorded in m->comm_status /
// m->comm_err (the forward itself cannot fail otherwise); the caller checks them.
//
// After model_forward: logits (F32, in m->scratch.logits) of n_rows rows (<= max_logits_rows)
// given by rows (backend int32 array of token row indices). Returns the F32 logits tensor.
struct tensor model_compute_logits(struct model *m, const int32_t *rows, int n_rows);
// The same with another final norm and head (MTP layers' shared_head).
struct tensor model_compute_logits_with(struct model *m, const int32_t *rows, int n_rows, const struct tensor *norm,
                                        const struct weight *head);

// MTP (src/model/mtp.c; m->n_mtp > 0). Runs MTP layer i over md's tokens (writing its cache in
// kv[num_layers + i]): token_ids are the tokens t_{p+1}; the hidden state of each token is row
// hidden_rows[t] of the last model_forward (final-normed, as the head sees it), or, hidden_rows
// NULL (chained steps), row t of the previous MTP pass's logits rows (its pre-norm output, left in
// scratch.lg_res by model_mtp_compute_logits). Then model_mtp_compute_logits gives the rows'
// F32 logits in scratch.logits and leaves their pre-norm output in scratch.lg_res.
void model_mtp_forward(struct model *m, int i, const int32_t *token_ids, const struct attn_metadata *md,
                       struct kv_layer *kv, const int32_t *hidden_rows);
struct tensor model_mtp_compute_logits(struct model *m, int i, const int32_t *rows, int n_rows);

// EAGLE-3 (src/model/eagle3.c; m->eagle3 set). As model_mtp_forward: token_ids are t_{p+1}; the
// hidden input of token t is fc over row hidden_rows[t] of the aux states the last model_forward
// captured, or (hidden_rows NULL, chained steps) row t of the previous pass's logits rows'
// pre-norm output (scratch.lg_res). The draft layer's cache is kv[num_layers].
// model_eagle3_compute_logits gives (n_rows, draft_vocab) F32 logits in scratch.logits (draft
// ids; m->eagle3->d2t maps them) and leaves the rows' pre-norm output in scratch.lg_res.
void model_eagle3_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                          struct kv_layer *kv, const int32_t *hidden_rows);
struct tensor model_eagle3_compute_logits(struct model *m, const int32_t *rows, int n_rows);

// Weight bytes one decode step of `batch` tokens reads: everything but the experts, plus the
// experts the step touches per MoE layer, min(E, batch * top_k) (exact under the benchmark's
// round-robin routing, an upper bound otherwise). weight_bytes: the model's total.
double model_moe_decode_weight_bytes(const struct model_config *c, double weight_bytes, int batch);

#endif
