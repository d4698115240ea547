// The backend op interface: everything a model forward needs, implemented once per
// backend (cpu/, cuda/). Models are written once as sequences of these ops; fusion is
// expressed by fused ops (add+RMSNorm, RoPE+KV write, SiLU*mul), not per-backend models.
//
// Memory: every `struct tensor` / pointer passed to an op lives in the backend's memory
// (host memory for the CPU backend, device memory for CUDA). Activations use
// `backend->act_dtype` (F32 on CPU, BF16 on CUDA). Ops are asynchronous on CUDA (one
// stream per backend); `synchronize` waits. Ops never allocate on the hot path: scratch
// comes from buffers allocated at start-up.
//
// This header includes no CUDA header; the CUDA backend is created through
// backend_cuda_create(), defined in a .cu file behind extern "C".
#ifndef ATOMC_BACKEND_BACKEND_H
#define ATOMC_BACKEND_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "core/tensor.h"
#include "core/weight.h"

enum backend_kind { BACKEND_CPU = 0, BACKEND_CUDA };

// Per-step attention metadata. Device pointers (backend memory) unless prefixed h_
// (host copies, always valid; the CPU backend reads them directly).
struct attn_metadata {
    int n_seqs;
    int n_tokens;
    int max_query_len;
    int max_context_len;
    int max_blocks_per_seq;       // blocks per sequence block_tables holds (and its row stride, unless:)
    int block_table_stride;       // elements between consecutive sequences' rows; 0 = max_blocks_per_seq
                                  // (per-layer-group block tables interleave two tables' rows)
    int block_size;
    bool decode_only;             // every sequence has exactly one new token
    const int32_t *query_start;   // (n_seqs + 1) prefix sums of new tokens
    const int32_t *context_lens;  // (n_seqs) tokens in the KV cache after this step (cached + new)
    const int32_t *block_tables;  // (n_seqs, max_blocks_per_seq) physical block ids
    const int32_t *positions;     // (n_tokens)
    const int32_t *slot_mapping;  // (n_tokens) block * block_size + offset; -1 = padding, not written
    const int32_t *h_query_start;
    const int32_t *h_context_lens;
    const int32_t *h_block_tables;
    const int32_t *h_positions;
    const int32_t *h_slot_mapping;
    // Recurrent-state models (Gated DeltaNet layers): each sequence's state slot; NULL otherwise.
    const int32_t *state_slots;   // (n_seqs)
    const int32_t *h_state_slots;
    // Hybrid sliding / full models with per-layer-group block tables (runner_options
    // hybrid_kv_groups): the metadata of the sliding-window layers, whose K/V live in a pool of
    // their own: the same batch with that group's block tables and slot mapping (and the same
    // row stride). NULL: every layer reads this metadata. The model picks it per layer
    // (model_layer_metadata); ops never look at it.
    const struct attn_metadata *sliding;
};

// One layer's paged KV cache: k and v each (num_blocks, block_size, n_kv_heads, head_dim)
// in dtype BF16 / F32 / FP8_E4M3 (then k_scale / v_scale dequantise).
// A recurrent layer (Gated DeltaNet) keeps per-sequence state slots in the same two tensors,
// F32: k = the conv state (n_slots, conv_dim, K - 1), the last K - 1 conv inputs, oldest first;
// v = the delta-rule state (n_slots, Hv, Dk, Dv).
struct kv_layer {
    struct tensor k;
    struct tensor v;
    float k_scale, v_scale;
};

// RoPE applied with precomputed inverse frequencies (any scaling kind folds into them).
struct rope_args {
    const float *inv_freq; // (rotary_dim / 2) backend memory
    int rotary_dim;        // rotate the first rotary_dim dims of each head
    float attn_factor;     // multiplies cos/sin (YaRN mscale), 1.0 otherwise
    bool interleaved;      // pairs (2i, 2i+1) instead of (i, i + rotary_dim/2)
    // Optional per-head RMSNorm before the rotation (Qwen3's q_norm / k_norm, (head_dim)
    // weights; NULL = none): head <- rmsnorm(head) * w with norm_eps, stored in the activation
    // dtype (the value a separate rmsnorm op would store), then rotated.
    const struct tensor *q_norm, *k_norm;
    float norm_eps;
};

// Per-row sampling inputs (device arrays of length n_rows unless noted).
// out_ids value of a row whose logits are not all finite or -inf (sample_args): the per-row flag,
// read back with the ids in the same copy; the engine fails that request with a clear error.
#define SAMPLE_ID_NONFINITE (-2)

struct sample_args {
    int n_rows;
    int vocab_size;
    const struct tensor *logits;     // (n_rows, vocab) F32; a backend may modify it in place (CPU does not)
    const float *temperature;        // 0 = greedy
    const float *top_p;
    const int32_t *top_k;            // <= 0 = off
    const float *min_p;
    const float *presence_penalty;
    const float *frequency_penalty;
    const float *repetition_penalty;
    const uint64_t *seed;            // per row; the random draw uses (seed, step) so the same seed repeats
    const uint64_t *step;            // per row: number of tokens generated so far
    // Token history for penalties, ragged: row r's tokens are hist_ids[hist_start[r] .. hist_start[r+1]);
    // the first hist_prompt_len[r] of them are prompt tokens (repetition penalty only).
    const int32_t *hist_start;       // (n_rows + 1)
    const int32_t *hist_ids;
    const int32_t *hist_prompt_len;  // (n_rows)
    bool any_penalty;                // false = skip the penalty pass entirely
    int n_logprobs;                  // 0 = none; else top-n alternatives per row (max 20)
    bool all_greedy;                 // hint: every row greedy (temperature < 1e-5), no penalties, no
                                     // logprobs; a backend may then run a plain arg-max (same result)
    // Structured output: (n_rows, bitmask_words) uint32 words, bit (id & 31) of word (id >> 5)
    // set = token id allowed in that row (unconstrained rows are all ones); NULL = no row is
    // constrained. A backend treats a disallowed token's logit as -inf before anything else, so
    // logprobs, penalties, greedy, filters and the draw all see the masked row (vLLM applies the
    // grammar bitmask to the logits before its sampler, too). bitmask_words >= ceil(vocab / 32).
    const uint32_t *token_bitmask;
    int bitmask_words;
    // Outputs.
    int32_t *out_ids;                // (n_rows); SAMPLE_ID_NONFINITE where the row (after the grammar
                                     // mask) holds a NaN or +inf logit: a broken model, nothing is drawn
    float *out_logprob;              // (n_rows) logprob of the chosen token (of the raw distribution), may be NULL
    int32_t *out_top_ids;            // (n_rows, n_logprobs) if n_logprobs > 0
    float *out_top_logprobs;         // (n_rows, n_logprobs)
};

// Mixture-of-experts routing (moe_route). The router's logits (T, E) are turned into top_k
// expert ids and combine weights per token, in fp32:
//   scores = softmax(logits) over the E experts (SCORING_SOFTMAX), or sigmoid(logits) per
//            expert (SCORING_SIGMOID: DeepSeek-V3 / GLM-4-MoE / MiMo)
//   keys   = scores + correction_bias (the optional per-expert F32 e_score_correction_bias of
//            DeepSeek-V3 / GLM-4-MoE; keys = scores without it). Keys only SELECT experts; the
//            weights always come from the uncorrected scores, as HF does.
//   groups = when n_group > 1 (grouped top-k: the E experts are n_group consecutive groups of
//            G = E / n_group): each group's score is the max of its keys (GROUP_SCORE_MAX,
//            DeepSeek-V2 group_limited_greedy) or the sum of its two largest keys
//            (GROUP_SCORE_TOP2_SUM, DeepSeek-V3 noaux_tc / GLM-4-MoE; needs G >= 2); the
//            topk_group best groups are kept (ties to the lower group id) and the experts of
//            the other groups cannot be chosen. topk_group * G >= top_k (the kept groups hold
//            at least top_k experts; a group itself may hold fewer than top_k).
//   ids    = the top_k allowed experts by key, larger key first; exact ties go to the lower
//            expert id (a total order; torch.topk leaves tie order unspecified)
//   w      = the chosen experts' scores, divided by (their sum + 1e-20) when renormalize
//            (norm_topk_prob; Mixtral always, which equals a softmax over the top-k logits),
//            times scale (routed_scaling_factor, 1 otherwise)
// n_shared > 0 = shared experts folded into the same fused op: slots top_k .. top_k +
// n_shared - 1 of every token get expert ids E .. E + n_shared - 1 with weight shared_weight
// (the stacked expert weights then hold E + n_shared experts), so moe_experts needs no special
// case for them.
// force_uniform (BENCHMARK ONLY, the bench commands' --moe-uniform-routing via model_load_options): ignores the
// logits; token t's slot j gets expert (t * top_k + j) mod E with weight 1 / top_k, i.e. a
// perfectly balanced round-robin load over the experts (random dummy router weights otherwise
// concentrate traffic, which real routers spread).
enum moe_scoring { MOE_SCORING_SOFTMAX = 0, MOE_SCORING_SIGMOID };
enum moe_group_score { MOE_GROUP_SCORE_MAX = 0, MOE_GROUP_SCORE_TOP2_SUM };

struct moe_route_args {
    int num_experts;    // E (routed experts; the logits' columns)
    int top_k;
    enum moe_scoring scoring;
    bool renormalize;
    float scale;        // multiplies the routed weights (1.0 for Qwen3-MoE / Mixtral)
    int n_group, topk_group;          // grouped top-k (n_group 0/1 = off)
    enum moe_group_score group_score; // how a group is scored when n_group > 1
    const float *correction_bias;     // (E) F32 in backend memory, added to the selection keys;
                                      // NULL = none. Per layer: the model sets it per MoE layer
    int n_shared;       // shared-expert slots appended per token (0 = none)
    float shared_weight;
    bool force_uniform; // benchmark-only round-robin routing, see above
};

// Scratch bytes moe_experts needs for up to `n_tokens` tokens with `n_slots` (top_k + n_shared)
// experts each, E_total stacked experts, hidden H, expert intermediate I, activations of
// act_bytes per element. The caller allocates it in backend memory once (model scratch).
static inline size_t moe_workspace_bytes(int64_t n_tokens, int n_slots, int E_total, int64_t H, int64_t I,
                                         size_t act_bytes) {
    int64_t R = n_tokens * n_slots; // routed rows
    size_t ints = (size_t)(4 * (E_total + 1) + 3 * R + 64) * sizeof(int32_t);
    size_t acts = (size_t)R * (size_t)(H + 2 * I + I + H) * act_bytes;
    return ((ints + 255) & ~(size_t)255) + acts + 1024; // slack: backends may 256-align each buffer
}

// ---- MLA ----
// Multi-head latent attention (DeepSeek-V2/V3). Per token and layer the cache (CACHE_KIND_LATENT,
// kv_layer.k of shape (blocks, block_size, 1, kv_lora + rope); kv_layer.v unused but for DSA's
// indexer keys, struct dsa_args) holds one row:
// the RMS-normed compressed KV c (kv_lora values), then the roped shared key part k_pe (rope
// values). kv_b is HF's kv_b_proj weight, (n_heads * (nope + v_dim), kv_lora): per head h its
// rows [h (nope + v_dim), + nope) are W_UK_h (k_nope = W_UK_h c), the next v_dim rows W_UV_h
// (v = W_UV_h c). Unquantised (F32 / BF16 / F16) on the CPU.
struct mla_args {
    int n_heads;
    int nope, rope, kv_lora, v_dim; // qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
    float scale;                    // softmax scale: (nope + rope)^-1/2, times YaRN's mscale(mscale_all_dim)^2
    const struct weight *kv_b;
    // DSA (sparse MLA, NULL = dense): per new token t, topk[t * topk_k ..] lists the key positions
    // its query attends to, ascending, -1 after the last (dsa_topk's output); every listed
    // position is one the dense causal attention would see.
    const int32_t *topk;
    int topk_k;
    bool absorbed_only; // CUDA: never the expanded tensor-core prefill (A/B in tests and bench/gpu_kernels.c)
};

// ---- DSA ----
// DeepSeek Sparse Attention's lightning indexer (GLM-5, DeepSeek-V3.2): n_heads heads of head_dim,
// the first `rope` dims of each roped (pairs per rope_interleaved), scores scaled by head_dim^-1/2,
// and the topk keys each query keeps. Its keys live beside the latent: kv_layer.v of shape
// (blocks, block_size, 1, head_dim) in the cache dtype.
struct dsa_args {
    int n_heads, head_dim, rope, topk;
    bool rope_interleaved;
    float norm_eps; // the key LayerNorm's eps (1e-6)
};

// Workspace bytes mla_attention needs for steps of up to n tokens: a backend may process the
// tokens in chunks of MLA_WS_TOKENS, keeping per chunk the absorbed queries (chunk, heads,
// kv_lora + rope) and latent outputs (chunk, heads, kv_lora) in F32, and for chunks of at most
// MLA_WS_SPLIT_TOKENS tokens split-KV partials (chunk, heads, MLA_WS_MAX_SPLITS, kv_lora + 2).
#define MLA_WS_TOKENS 128
#define MLA_WS_SPLIT_TOKENS 16
#define MLA_WS_MAX_SPLITS 8
static inline size_t mla_workspace_bytes(int64_t n_tokens, int n_heads, int kv_lora, int rope) {
    size_t c = (size_t)(n_tokens < MLA_WS_TOKENS ? n_tokens : MLA_WS_TOKENS);
    size_t cs = (size_t)(n_tokens < MLA_WS_SPLIT_TOKENS ? n_tokens : MLA_WS_SPLIT_TOKENS);
    return (c * (size_t)(2 * kv_lora + rope) + cs * MLA_WS_MAX_SPLITS * (size_t)(kv_lora + 2)) * (size_t)n_heads *
               sizeof(float) +
           1024;
}

// The expert MLP's activation and biases (moe_experts). NULL args = SILU without biases.
//   SILU:         act = silu(g) * u
//   SWIGLU_CLAMP: (GPT-OSS) g' = min(g, limit), u' = clamp(u, -limit, limit),
//                 act = (u' + 1) * g' * sigmoid(alpha * g')
// where g, u are expert e's gate / up rows of gate_up x (+ gate_up_bias[e]); the expert output is
// down_e act (+ down_bias[e]), weighted by the slot's combine weight.
enum moe_act { MOE_ACT_SILU = 0, MOE_ACT_SWIGLU_CLAMP };

struct moe_experts_args {
    enum moe_act act;
    float alpha, limit;              // SWIGLU_CLAMP
    const struct tensor *gate_up_bias; // (E_total, 2I) gate entries then up entries per expert, or NULL
    const struct tensor *down_bias;  // (E_total, H) or NULL
};

// Gated DeltaNet shapes (deltanet_rule). The conv output row of a token is (q (Hk, Dk), k (Hk, Dk),
// v (Hv, Dv)) = conv_dim = 2 Hk Dk + Hv Dv values; value head h reads key head h / (Hv / Hk).
struct deltanet_args {
    int n_k_heads, n_v_heads; // Hk, Hv
    int k_dim, v_dim;         // Dk, Dv
};

// The row stride of md's block tables.
static inline int attn_md_table_stride(const struct attn_metadata *md) {
    return md->block_table_stride > 0 ? md->block_table_stride : md->max_blocks_per_seq;
}

struct backend;

struct backend_ops {
    const char *name;
    void (*destroy)(struct backend *b);

    // Memory. alloc returns NULL when out of memory (callers turn it into a status).
    void *(*alloc)(struct backend *b, size_t bytes);
    void (*free)(struct backend *b, void *p);
    void (*copy_h2d)(struct backend *b, void *dst, const void *src, size_t bytes);
    void (*copy_d2h)(struct backend *b, void *dst, const void *src, size_t bytes);
    void (*copy_d2d)(struct backend *b, void *dst, const void *src, size_t bytes);
    void (*memset_zero)(struct backend *b, void *dst, size_t bytes);
    void (*synchronize)(struct backend *b);
    // Reading backend memory from another thread while the stream computes (the KV-transfer
    // producer's per-layer sends, runner_kv.c). NULL on backends whose ops are complete when
    // they return (CPU). event_record marks the point of the compute stream after every op
    // issued so far (not called during graph capture); event_sync blocks the calling thread
    // (any thread) until the stream passed it; copy_d2h_side copies on a second stream, ordered
    // after nothing (wait for an event first), complete when it returns; any thread.
    void *(*event_new)(struct backend *b);
    void (*event_free)(struct backend *b, void *ev);
    void (*event_record)(struct backend *b, void *ev);
    void (*event_sync)(struct backend *b, void *ev);
    void (*copy_d2h_side)(struct backend *b, void *dst, const void *src, size_t bytes);
    // Free / total bytes available for the KV pool (CPU: from options; CUDA: cudaMemGetInfo).
    void (*memory_info)(struct backend *b, size_t *free_bytes, size_t *total_bytes);

    // Converts a host tensor (any dtype incl. GGUF quants) into a backend tensor of `dst->dtype`
    // whose data the backend allocates. dst->ne/ndim/dtype are set by the caller.
    atomc_status (*upload_weight)(struct backend *b, struct tensor *dst, const struct tensor *host_src,
                                  struct error *err);

    // out(n, d) = table[ids[i]] ; ids (n) device int32.
    void (*embedding)(struct backend *b, struct tensor *out, const struct tensor *table, const int32_t *ids);
    // out = x / rms(x) * w over the last dim; works on any (rows, d) view (also per-head q/k norm).
    // w is a weight, as in matmul (CUDA may read it before the previous kernel has finished).
    void (*rmsnorm)(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *w, float eps);
    // residual += x ; out = rmsnorm(residual) * w. (x may be NULL: then only the norm.) w: a weight.
    void (*add_rmsnorm)(struct backend *b, struct tensor *out, struct tensor *residual, const struct tensor *x,
                        const struct tensor *w, float eps);
    // out(n, m) = x(n, k) @ w(m, k)^T (+ bias(m)). w->t is in a weight dtype of the backend and
    // w->scheme one of its caps' weight_schemes (core/weight.h); out is in the act dtype or F32
    // (the lm_head writes F32 logits directly; bias, if any, in out's dtype).
    // w is a weight: no op of this step writes it (CUDA may read it before the previous kernel
    // has finished).
    void (*matmul)(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                   const struct tensor *bias);
    // Applies RoPE (after the optional per-head q/k RMSNorm of rope_args) to q (n, hq, d) in
    // place and to k (n, hk, d), then writes k and v into the paged cache at slot_mapping
    // (skipping -1). q/k/v may be views into one fused qkv buffer:
    // row_stride is the element distance between consecutive tokens' rows (0 = dense).
    void (*rope_kv_write)(struct backend *b, struct tensor *q, struct tensor *k, const struct tensor *v,
                          int64_t row_stride, const struct rope_args *rope, struct kv_layer *kv,
                          const struct attn_metadata *md);
    // Paged attention over the batch (mixed prefill + decode). out (n, hq, d_v), q (n, hq, d),
    // causal within each sequence, attending to all context_len tokens of its KV.
    // sliding_window > 0 limits attention to the last `sliding_window` positions;
    // sinks (hq) F32 optional (GPT-OSS).
    void (*attention)(struct backend *b, struct tensor *out, const struct tensor *q, int64_t q_row_stride,
                      const struct kv_layer *kv, const struct attn_metadata *md, float scale, int sliding_window,
                      const struct tensor *sinks);
    // out(n, f) = silu(gu[:, :f]) * gu[:, f:] where gu is (n, 2f).
    void (*silu_mul)(struct backend *b, struct tensor *out, const struct tensor *gate_up);
    // out += x (same shape).
    void (*add)(struct backend *b, struct tensor *out, const struct tensor *x);
    // out(n_rows, d) = x[rows[i]] ; rows (n_rows) device int32.
    void (*gather_rows)(struct backend *b, struct tensor *out, const struct tensor *x, const int32_t *rows,
                        int n_rows);
    // Converts x (any act dtype) into out (F32), same shape (logits to F32 for sampling).
    void (*convert)(struct backend *b, struct tensor *out, const struct tensor *x);
    // Sampling with penalties / temperature / top-k / top-p / min-p / seed; see sample_args.
    void (*sample)(struct backend *b, const struct sample_args *a);

    // Optional (may be NULL): fills t (any float dtype, backend memory) with uniform random
    // numbers in [lo, hi) from `seed`, on the device, so random weights of a large model need not
    // cross the host link. The dummy loader uses it when present, pooled host copies otherwise.
    atomc_status (*fill_uniform)(struct backend *b, struct tensor *t, uint64_t seed, float lo, float hi,
                                 struct error *err);

    // CUDA graphs (NULL on backends without them).
    atomc_status (*graph_begin)(struct backend *b, struct error *err);
    atomc_status (*graph_end)(struct backend *b, void **graph, struct error *err);
    atomc_status (*graph_launch)(struct backend *b, void *graph, struct error *err);
    void (*graph_destroy)(struct backend *b, void *graph);

    // ---- Mixture of experts (appended; see moe_route_args above) ----
    // Routes n tokens: logits (n, E) in act dtype or F32 -> topk_ids (n, top_k + n_shared) int32
    // and topk_w (n, top_k + n_shared) F32, both backend memory. No host synchronisation.
    void (*moe_route)(struct backend *b, const struct tensor *logits, const struct moe_route_args *a,
                      int32_t *topk_ids, float *topk_w);
    // The fused expert MLP: out(n, H) = sum_j topk_w[t, j] * down_e(act(gate_e x_t, up_e x_t))
    // with e = topk_ids[t, j], over j < n_slots. x (n, H) and out (n, H) in act dtype (out must not
    // alias x); gate_up (E_total, 2I, H) with gate rows first and down (E_total, H, I) are the
    // stacked expert weights in the weight dtype. workspace: moe_workspace_bytes(n, n_slots,
    // E_total, H, I, act bytes) of backend memory. Rows are grouped by expert (counts and offsets
    // computed by the backend, on the device for CUDA: no host sync, fixed launch shapes for a
    // given n, so decode stays graph-capturable); each active expert runs as one GEMM over its
    // rows; the combine sums a token's slots in slot order (deterministic). Ids outside
    // [0, E_total) are a programmer error (the CPU backend CHECKs them; CUDA skips the slot).
    // gate_up / down carry a weight scheme like matmul's w (the stacked tensors are their .t).
    // ea (may be NULL: SiLU, no biases) gives the activation and the expert biases (weights, in
    // the weight dtypes; see struct moe_experts_args).
    void (*moe_experts)(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up,
                        const struct weight *down, const int32_t *topk_ids, const float *topk_w, int n_slots,
                        const struct moe_experts_args *ea, void *workspace);

    // ---- MLA (multi-head latent attention: DeepSeek-V2/V3; see struct mla_args) ----
    // NULL on backends without MLA (caps.mla false: such models are refused at load).
    // Per new token t at md->h_positions[t]: RoPE (rope_args: interleaved or half pairs, attn_factor)
    // of q's rope part q[t, h, nope:] in place for every head; the cache row
    //   [ rmsnorm(kv_a[t, :kv_lora]) * kv_norm (eps),  rope(kv_a[t, kv_lora:]) ]
    // written to the latent cache at slot_mapping[t] (skipping -1), rounded to the cache dtype
    // (FP8: divided by kv->k_scale). q (n, n_heads, nope + rope) dense; kv_a (n, kv_lora + rope)
    // dense, not modified. Both in act dtype; kv_norm a weight (kv_lora).
    void (*mla_latent_write)(struct backend *b, struct tensor *q, const struct tensor *kv_a,
                             const struct tensor *kv_norm, float eps, const struct rope_args *rope,
                             const struct mla_args *a, struct kv_layer *kv, const struct attn_metadata *md);
    // Attention over the latent cache for the batch (mixed prefill + decode, causal within each
    // sequence over its context_len tokens, as `attention`): for query head h,
    //   score(t, j) = scale * (q_nope[t,h] . W_UK_h c_j + q_pe[t,h] . k_pe_j)
    //   out[t, h]   = W_UV_h sum_j softmax_j(score) c_j
    // with c_j / k_pe_j the cache row of key j. The absorbed form (q_nope through W_UK_h^T into the
    // latent space, one shared KV head of d_qk = kv_lora + rope and d_v = kv_lora, then W_UV_h) and
    // the expanded one (k_nope = W_UK c, v = W_UV c per head) are the same numbers up to rounding;
    // a backend picks per batch. out (n, n_heads, v_dim), q (n, n_heads, nope + rope) after
    // mla_latent_write, act dtype. workspace: mla_workspace_bytes(n, ...) of backend memory.
    void (*mla_attention)(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                          const struct attn_metadata *md, const struct mla_args *a, void *workspace);

    // ---- Gated DeltaNet (appended; Qwen3-Next / Qwen3.5 linear attention) ----
    // Recurrent state: per layer kv->k (conv state) and kv->v (delta-rule state), one slot per
    // sequence, md->state_slots (n_seqs) naming each sequence's. A sequence whose step starts its
    // cache (context_lens[s] == its new tokens: a new or a preempted-and-recomputed sequence) starts
    // from a zero state; any other continues its slot's state (chunked prefill, decode). Each op
    // writes the state after the sequence's last new token back into its slot. Padding sequences
    // of graph steps name a reserved dummy slot.
    //
    // out (n, C) = silu(causal depthwise conv1d over time of x (n, C), per sequence, with kernel
    // w (C, K) (w[c][K-1] multiplies the current token), the K - 1 inputs before the step coming
    // from the conv state); x rows x_row_stride elements apart (a view into a fused projection),
    // out dense. kv->k (slots, C, K - 1) F32 gets the last K - 1 inputs.
    void (*deltanet_conv)(struct backend *b, struct tensor *out, const struct tensor *x, int64_t x_row_stride,
                          const struct tensor *w, struct kv_layer *kv, const struct attn_metadata *md);
    // The gated delta rule over each sequence's new tokens. qkv (n, conv_dim) dense (the conv
    // output), ba (n, 2 Hv) rows ba_row_stride apart: b (Hv) then a (Hv); a_log, dt_bias (Hv).
    // Per token and value head h (fp32): q, k = l2norm(q), l2norm(k) (eps 1e-6), q *= Dk^-1/2,
    // g = -exp(a_log[h]) softplus(a[h] + dt_bias[h]), beta = sigmoid(b[h]); S (Dk, Dv) <- S exp(g);
    // S += k (beta (v - S^T k))^T; out = S^T q. out (n, Hv, Dv) in the act dtype. Sequences with
    // more than one new token run the chunked (WY / UT-transform) form in chunks of 64 tokens,
    // single tokens the recurrent step: the same function. kv->v (slots, Hv, Dk, Dv) F32.
    void (*deltanet_rule)(struct backend *b, struct tensor *out, const struct tensor *qkv, const struct tensor *ba,
                          int64_t ba_row_stride, const struct tensor *a_log, const struct tensor *dt_bias,
                          struct kv_layer *kv, const struct attn_metadata *md, const struct deltanet_args *a);
    // Gated RMSNorm: out (rows, d) = rmsnorm(x (rows, d)) * w (d) * silu(z) with eps. Rows are
    // z_heads heads per token: row r is token r / z_heads, head r % z_heads, whose z values are at
    // z->data + (r / z_heads) z_row_stride + (r % z_heads) d (z a view into a fused projection).
    void (*rmsnorm_gated)(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *z,
                          int64_t z_row_stride, int z_heads, const struct tensor *w, float eps);
    // x (n, d) *= sigmoid(gate) in place; gate rows gate_row_stride elements apart with d values
    // (gated attention output) or one value (gate_cols 1, broadcast over the row: the shared
    // expert's per-token gate); gate in the act dtype or F32.
    void (*gate_sigmoid_mul)(struct backend *b, struct tensor *x, const struct tensor *gate, int64_t gate_row_stride,
                             int gate_cols);

    // ---- DSA (appended; see struct dsa_args). NULL on backends without it (caps.dsa false). ----
    // Per new token t at md->h_positions[t]: RoPE of the first a->rope dims of every head of
    // iq (n, n_heads, head_dim) in place, and the key k = rope(LayerNorm(ik[t]) * norm_w + norm_b)
    // (ik (n, head_dim), eps a->norm_eps, the rope on its first a->rope dims) written to kv->v at
    // slot_mapping[t] (skipping -1). Act dtype; rope_args give inv_freq / attn_factor (its
    // `interleaved` is replaced by a->rope_interleaved).
    void (*dsa_index_write)(struct backend *b, struct tensor *iq, const struct tensor *ik, const struct tensor *norm_w,
                            const struct tensor *norm_b, const struct rope_args *rope, const struct dsa_args *a,
                            struct kv_layer *kv, const struct attn_metadata *md);
    // Top-k selection: for new token t of sequence s at position p (its query sees keys 0..p):
    //   score_j = n_heads^-1/2 sum_h w[t, h] * relu(head_dim^-1/2 * iq[t, h] . k_j)      (fp32)
    // with w (n, n_heads) the weights_proj output (act dtype) and k_j the cached
    // key of position j. topk (n, a->topk) int32 host-visible backend memory: the min(topk, p + 1)
    // best positions (ties to the lower position) in ascending order, then -1.
    void (*dsa_topk)(struct backend *b, int32_t *topk, const struct tensor *iq, const struct tensor *w,
                     const struct kv_layer *kv, const struct attn_metadata *md, const struct dsa_args *a);
};

// What a backend can run, reported once at create and checked by model loading
// (model_check_backend_caps in src/model/model.c) before any weight is loaded, so a config the
// backend cannot run is an error at load, never a CHECK inside a forward. Plain data: the CUDA
// table (src/backend/cuda/cuda_caps.c) is compiled into CPU-only builds too, so unit tests can
// drive the check with it without a GPU.
#define BACKEND_CAPS_MAX_HEAD_DIMS 8

struct backend_caps {
    const char *name;
    int head_dims[BACKEND_CAPS_MAX_HEAD_DIMS]; // attention q/k head dims; n_head_dims == 0: any
    int n_head_dims;
    bool split_v_head_dim;     // v head dim may differ from the q/k head dim (MiMo-V2-Flash's attention)
    int split_head_dims[BACKEND_CAPS_MAX_HEAD_DIMS][2]; // with split_v_head_dim: the (q/k, v) head dim
    int n_split_head_dims;                              // pairs the attention takes; 0 = any
    int max_qk_norm_head_dim;  // per-head q/k RMSNorm inside rope_kv_write; 0 = any
    uint32_t kv_dtypes;        // bit (1 << enum dtype) per KV-cache dtype
    uint32_t weight_dtypes;    // bit per storage dtype matmul / moe_experts take
    uint32_t weight_schemes;   // bit (1 << enum weight_scheme) per implemented scheme; NONE always
    int max_experts;           // moe_route / moe_experts: routed + shared experts; 0 = any
    bool moe_sigmoid_scoring;  // MOE_SCORING_SIGMOID and correction_bias
    bool moe_grouped_topk;     // n_group > 1 (both group scores)
    bool moe_swiglu_clamp;     // moe_experts: MOE_ACT_SWIGLU_CLAMP and expert biases (GPT-OSS)
    bool pow2_block_size;      // KV block size must be a power of two
    int min_block_size;        // smallest KV block size the attention tile takes
    bool mla;                  // MLA ops (mla_latent_write / mla_attention) over a latent cache
    int mla_max_kv_lora;       // MLA: kv_lora_rank at most this and a multiple of 32; 0 = any
    int mla_max_rope;          // MLA: qk_rope_head_dim at most this; 0 = any
    bool gated_deltanet;       // the Gated DeltaNet ops (deltanet_conv / deltanet_rule / rmsnorm_gated / gate_sigmoid_mul)
    int max_deltanet_head_dim; // largest linear-attention key / value head dim; 0 = any
    int max_deltanet_conv_kernel; // largest linear-attention conv kernel; 0 = any
    bool dsa;                  // DSA indexer ops (dsa_index_write / dsa_topk) and sparse mla_attention
};

#define BACKEND_CAP_BIT(x) (1u << (unsigned)(x))

// The capability tables, defined in plain C so every build has both.
extern const struct backend_caps backend_cpu_caps;
extern const struct backend_caps backend_cuda_caps;

struct backend {
    const struct backend_ops *ops;
    const struct backend_caps *caps;
    enum backend_kind kind;
    enum dtype act_dtype;  // activation dtype
    enum dtype weight_dtype; // default dtype weights are converted to
    int num_threads;
    int device_id;         // CUDA: the device (tensor-parallel rank k uses device k); CPU: 0
    void *impl;            // backend-private state
};

struct backend_options {
    int num_threads;       // CPU: 0 = cores
    int device_id;         // CUDA
    size_t kv_pool_bytes;  // CPU: memory_info reports this as free
    bool batch_invariant;  // CPU: every matmul through the row-independent kernel, so a token's
                           // results never depend on the rest of its batch (slower prefill);
                           // also set by env ATOMC_BATCH_INVARIANT=1
    bool exact_kernels;    // CPU: quantized weights decode through the bit-exact dequantise-in-registers
                           // kernels (F32 activations) instead of the int16-activation ones
};

atomc_status backend_cpu_create(const struct backend_options *o, struct backend **out, struct error *err);
#ifdef ATOMC_CUDA
atomc_status backend_cuda_create(const struct backend_options *o, struct backend **out, struct error *err);
#endif
// Creates the backend named "cpu" or "cuda" (ATOMC_ERR_UNSUPPORTED if not built in).
// Device names: "cpu", "cuda", or "auto" = "cuda" when this build has the CUDA backend and a usable
// GPU (Hopper, sm_90) is present, else "cpu". backend_resolve_device maps "auto" to one of the two
// and logs which and why; NULL maps to "cpu" (the library's default; the CLI's is "auto"); other
// names are returned unchanged (backend_create refuses unknown ones).
const char *backend_resolve_device(const char *name);
#ifdef ATOMC_CUDA
// True when a CUDA device 0 exists and is sm_90 or newer; otherwise false with the reason in why.
bool backend_cuda_usable(char *why, size_t why_len);
// Sequences whose MLA attention ran expanded on the tensor cores (cuda_mla.cu) since b was created.
uint64_t backend_cuda_mla_expanded_seqs(const struct backend *b);
#endif
atomc_status backend_create(const char *name, const struct backend_options *o, struct backend **out,
                            struct error *err);
void backend_destroy(struct backend *b);

#endif
