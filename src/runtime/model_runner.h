// The model runner: owns the backend, the model weights and the paged KV pool, and turns
// one engine step's forward batch into sampled token ids. It knows nothing about
// scheduling or HTTP; the engine (src/engine/) builds `struct forward_batch` every step.
#ifndef ATOMC_RUNTIME_MODEL_RUNNER_H
#define ATOMC_RUNTIME_MODEL_RUNNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"
#include "common/error.h"
#include "model/config.h"

struct backend;
struct comm;

// Sampling parameters of one logits row (copied from the request's atomc_sampling_params).
struct sample_row {
    float temperature, top_p, min_p;
    int top_k;
    float presence_penalty, frequency_penalty, repetition_penalty;
    uint64_t seed;              // resolved seed (request seed, or engine seed mixed with request id)
    uint64_t step;              // tokens generated so far by this sequence (seeds the draw)
    const int32_t *prompt_ids;  // penalties: the sequence's prompt ...
    int n_prompt;
    const int32_t *output_ids;  // ... and its generated tokens so far
    int n_output;
    int n_logprobs;             // 0 = none
    // Token ids whose logits must be set to -inf before sampling (the engine bans EOS and
    // stop tokens this way while a sequence has fewer than min_tokens outputs). Added by the
    // engine; a sampler that ignores it still gets correct stop behaviour (the engine does not
    // stop on them before min_tokens) but may emit them as text.
    const int32_t *banned_ids;
    int n_banned;
    // Structured output: the grammar's allowed next tokens, ceil(vocab_size / 32) words (bit set
    // = allowed; see sample_args.token_bitmask), host memory; NULL = unconstrained. It may still
    // be being written when model_runner_execute starts: it is read only after
    // forward_batch.sample_ready returns.
    const uint32_t *allowed;
};

// One step's batch (host memory, valid for the duration of model_runner_execute).
// Sequences are laid out back to back: sequence s owns token rows
// [query_start[s], query_start[s+1]).
struct forward_batch {
    int n_seqs;
    int n_tokens;
    const int32_t *token_ids;    // (n_tokens)
    const int32_t *positions;    // (n_tokens)
    const int32_t *query_start;  // (n_seqs + 1)
    const int32_t *context_lens; // (n_seqs) tokens in KV after this step
    const int32_t *block_tables; // (n_seqs, max_blocks_per_seq)
    int max_blocks_per_seq;
    const int32_t *slot_mapping; // (n_tokens)
    // Hybrid models with per-layer-group block tables (model_runner_kv_groups true): the
    // sliding-window layers' own block tables (n_seqs, max_blocks_per_seq) and slots (n_tokens),
    // in that group's pool of model_runner_kv_groups' num_blocks_sw blocks; required then,
    // ignored otherwise.
    const int32_t *block_tables_sw;
    const int32_t *slot_mapping_sw;
    // Models with recurrent layers (model_runner_num_state_slots > 0): each sequence's state slot
    // in [0, num_state_slots), distinct within the batch; the engine assigns a sequence one at
    // admission and keeps it until the sequence finishes, aborts or is preempted. NULL otherwise.
    const int32_t *state_slots;  // (n_seqs)

    // Rows whose logits are needed and sampled: normally the last new token of each sequence
    // that completes its prompt or decodes this step.
    int n_logits;
    const int32_t *logits_rows;        // (n_logits) token row indices
    const struct sample_row *sampling; // (n_logits)
    // Called (when set) after the forward is launched and before the sampling rows' `allowed`
    // masks are read: the engine computes the masks while the forward runs and joins here.
    void (*sample_ready)(void *ctx);
    void *sample_ready_ctx;
    // Structured output, sample-then-check (engine_grammar.c; set only for a runner whose
    // model_runner_sample_check_ok is true). After the rows are drawn, called with the n_logits
    // sampled ids: it advances the grammars that accept their row's id and returns how many rows
    // must be drawn again, listed in *redo (the hook's memory), whose `allowed` masks it has
    // filled meanwhile. The runner draws each of them once more under its mask, with the second
    // random stream of the step (SAMPLE_REDRAW_STEP, backend/sample_rng.h), and returns those ids.
    int (*sample_check)(void *ctx, const int32_t *ids, const int32_t **redo);
    void *sample_check_ctx;

    // Prompt logprobs (echo + logprobs): for these token rows, the logprob of target_ids[i]
    // (the next prompt token) and the top-k alternatives are returned.
    int n_prompt_lp;
    const int32_t *prompt_lp_rows;    // (n_prompt_lp)
    const int32_t *prompt_lp_targets; // (n_prompt_lp)
    int prompt_lp_k;

    // KV transfer (engine_kv_transfer.c): when set, called from inside the forward after layer
    // l's KV rows of this batch are written, in layer order, once per layer and per tensor-
    // parallel rank (rank: the runner's, 0 without TP; ranks call from their own threads). event: NULL when the
    // rows are in memory already (CPU), else a backend event recorded on the compute stream right
    // after the layer's KV write (kv_pool_view.wait waits for it before the rows are read).
    // A batch with this set never runs as a CUDA graph replay (so captured graphs hold no hook).
    void (*kv_layer_done)(void *ctx, int rank, int layer, void *event);
    void *kv_layer_ctx;
};

// Filled by model_runner_execute; arrays are owned by the runner, valid until the next call.
#define RUNNER_ID_NONFINITE (-2) // == SAMPLE_ID_NONFINITE (backend.h)

struct runner_output {
    const int32_t *ids;          // (n_logits) sampled ids; RUNNER_ID_NONFINITE for a row whose logits hold a
                                 // NaN or +inf (a broken model: nothing was sampled)
    const float *logprobs;       // (n_logits) logprob of each sampled id
    const int32_t *top_ids;      // (n_logits, max n_logprobs) best first
    const float *top_logprobs;
    int top_stride;              // columns of top_ids / top_logprobs
    const float *prompt_lp;      // (n_prompt_lp); NaN where the row's logits are not finite (a broken model)
    const int32_t *prompt_top_ids;   // (n_prompt_lp, prompt_lp_k)
    const float *prompt_top_logprobs;
};

struct runner_options {
    const char *model_path;
    const char *device;       // "cpu" | "cuda"
    const char *dtype;        // "auto" | "bfloat16" | "float16" | "float32"
    const char *load_format;  // "auto" | "dummy"
    const char *kv_cache_dtype;
    int block_size;
    int num_kv_blocks;        // 0 = size from memory
    double gpu_memory_utilization;
    size_t cpu_kv_cache_bytes;
    int max_num_seqs;
    int max_num_batched_tokens;
    int max_logits_rows; // logits rows per step; 0 = max_num_seqs (speculative decoding: max_num_seqs * (1 + k))
    int max_model_len;
    bool enforce_eager;
    // Speculative decoding with k drafts per sequence: besides the decode graphs, CUDA graphs of
    // verify steps (1 + k query tokens per sequence, logits at every row) per batch bucket
    // (runner_graphs.c). 0: decode graphs only. Needs max_logits_rows >= max_num_seqs * (1 + k)
    // for the largest bucket; smaller buckets are captured as far as the rows allow.
    int num_speculative_tokens;
    int num_threads;
    bool cpu_exact_kernels; // CPU: backend_options.exact_kernels (--cpu-exact-kernels)
    uint64_t dummy_seed;
    // Optional: run on this already created backend instead of creating one from `device`.
    // Ownership passes to the runner (freed by model_runner_free, also on a failed create).
    struct backend *backend;
    // Tensor parallelism (src/parallel/tp_runner.c drives one runner per rank): this runner
    // loads rank tp_rank's shard of a tp_size-way split and all-reduces over comm (not owned).
    // tp_size 0 or 1 = the whole model.
    int tp_rank, tp_size;
    struct comm *comm;
    // BENCHMARK ONLY: balanced round-robin MoE routing (struct model_load_options).
    bool moe_uniform_routing;
    // W8A8 checkpoints computed weight-only (struct model_load_options.quant_weight_only).
    bool quant_weight_only;
    // "fp8": online quantization of an unquantized checkpoint (struct model_load_options.online_fp8);
    // NULL, "" or "none": as the checkpoint is.
    const char *quantization;
    // Speculative method "mtp": load the model's MTP layers (struct model_load_options.load_mtp)
    // and give them a cache layer each in the KV pool; model_runner_draft then proposes drafts.
    bool load_mtp;
    // Speculative method "eagle3": the EAGLE-3 head directory (struct model_load_options.eagle3_path;
    // its draft layer gets a cache layer in the KV pool); NULL = none. model_runner_draft then drafts
    // with the head exactly as with an MTP layer (hidden_rows index the aux states it captured).
    const char *eagle3_path;
    // Hybrid sliding / full models (layers of both kinds, one window): the sliding-window layers'
    // K/V in a pool of their own, addressed by a second block table per sequence
    // (forward_batch.block_tables_sw), so the engine can free their out-of-window blocks while
    // the full layers keep every block (vLLM's hybrid KV-cache manager). false: one table for all.
    bool hybrid_kv_groups;
};

struct model_runner;

atomc_status model_runner_create(const struct runner_options *o, struct model_runner **out, struct error *err);
void model_runner_free(struct model_runner *r);

const struct model_config *model_runner_config(const struct model_runner *r);
int model_runner_num_kv_blocks(const struct model_runner *r);

// KV transfer (src/kv_transfer/kv_connector.h): this runner's paged pool as a connector sees it
// (per-layer row sizes and offsets, a row copy between pool and host). Valid while the runner
// lives and its pool is not reallocated.
struct kv_pool_view;
void model_runner_kv_pool_view(struct model_runner *r, struct kv_pool_view *v);

// Runs the forward pass, writes K/V for every new token at slot_mapping, samples the
// logits rows. The only host-device synchronisation is reading the results.
atomc_status model_runner_execute(struct model_runner *r, const struct forward_batch *fb, struct runner_output *out,
                                  struct error *err);

// Like model_runner_execute but instead of sampling copies the F32 logits of the
// fb->n_logits rows into logits (n_logits, vocab_size) on the host (fb->sampling is ignored).
// For tests and scoring; K/V are written exactly as by execute.
atomc_status model_runner_execute_logits(struct model_runner *r, const struct forward_batch *fb, float *logits,
                                         struct error *err);

// MTP drafts (speculative method "mtp"; the runner was created with load_mtp). Called after a
// model_runner_execute whose hidden states it reads (nothing may run in between):
// db->fb is a forward batch over the MTP layer's cache: for every position p verified by that
// step, token t_{p+1} at position p (fb.token_ids / positions / slot_mapping / block tables /
// context lengths as for the target), its hidden state in row hidden_rows[t] of the executed
// batch. fb.logits_rows are the last rows of the sequences that want drafts (fb.sampling is
// ignored: drafts are the argmax), in order of non-increasing n_drafts; row i wants n_drafts[i]
// (1..max_drafts) drafts, chained through the MTP layer at positions context_lens[row_seq[i]] + j
// - 1 (j = 1 .. n_drafts[i] - 1) whose cache slots are chain_slots[i * (max_drafts - 1) + j - 1]
// (inside the sequence's block table). Writes drafts (n_logits, max_drafts) row-major; entries
// past n_drafts[i] are left as they are.
struct draft_batch {
    struct forward_batch fb;
    const int32_t *hidden_rows;  // (fb.n_tokens)
    const int32_t *n_drafts;     // (fb.n_logits)
    const int32_t *row_seq;      // (fb.n_logits) sequence index in fb of each logits row
    int max_drafts;
    const int32_t *chain_slots;  // (fb.n_logits, max_drafts - 1)
};
atomc_status model_runner_draft(struct model_runner *r, const struct draft_batch *db, int32_t *drafts,
                                struct error *err);
// Draft layers loaded: MTP layers, or 1 for an EAGLE-3 head (0: none, model_runner_draft refuses).
int model_runner_num_mtp_layers(const struct model_runner *r);

int model_runner_max_model_len(const struct model_runner *r);
int model_runner_block_size(const struct model_runner *r);
// The attention window of the model when every layer's cache is sliding-window K/V with that one
// window (Mistral with sliding_window): blocks whose tokens all lie before the window of a
// sequence's next token are never read again, and the engine frees them while it runs. 0 when
// any layer keeps full history (hybrid sliding / full models keep every block).
int model_runner_sliding_window(const struct model_runner *r);
// Per-layer-group block tables (runner_options.hybrid_kv_groups on a hybrid model): true with the
// sliding group's window and pool size (model_runner_num_kv_blocks is the full group's); false
// when every layer reads one table.
bool model_runner_kv_groups(const struct model_runner *r, int *window, int *num_blocks_sw);
size_t model_runner_weight_bytes(const struct model_runner *r);  // weights in backend memory
// Recurrent-state slots the engine may assign (max_num_seqs; 0 when the model keeps no
// recurrent state) and their bytes in backend memory.
// Whether structured output may sample then check (forward_batch.sample_check): the backend's
// sampler leaves the logits rows it draws from unchanged, so a rejected row can be drawn again
// under its mask. The CPU sampler works on copies; the CUDA sample kernel reads the logits
// const, and only a row drawn under a mask has its logits changed (-inf outside the mask).
bool model_runner_sample_check_ok(const struct model_runner *r);
// Host threads the forward computes on: the CPU backend's pool size; 0 on a GPU backend.
int model_runner_host_threads(const struct model_runner *r);
int model_runner_num_state_slots(const struct model_runner *r);
size_t model_runner_state_bytes(const struct model_runner *r);
int model_runner_kv_dtype_bytes(const struct model_runner *r);   // bytes per KV element
int model_runner_num_graphs(const struct model_runner *r);        // captured decode graphs
uint64_t model_runner_num_graph_replays(const struct model_runner *r); // decode and verify replays
int model_runner_num_verify_graphs(const struct model_runner *r); // captured verify graphs (1 + k tokens per sequence)
uint64_t model_runner_num_verify_graph_replays(const struct model_runner *r);
int model_runner_num_mtp_graphs(const struct model_runner *r);    // captured MTP graphs (first pass + chain steps)
uint64_t model_runner_num_mtp_graph_replays(const struct model_runner *r);

#endif
