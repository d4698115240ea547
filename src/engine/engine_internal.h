// The engine's seams: what it needs from the model side and the text side, as function
// pointers. atomc_engine_create (engine_create.c) plugs in the real model runner and
// tokenizer; tests plug in a deterministic fake model (and fake tokenizer) so the whole
// engine loop (scheduling, batching, stop rules, streaming, threading) runs without weights.
#ifndef ATOMC_ENGINE_ENGINE_INTERNAL_H
#define ATOMC_ENGINE_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"
#include "common/check.h"
#include "common/error.h"
#include "runtime/model_runner.h"

struct kv_pool_view;

struct engine_model_ops {
    void *ctx;
    // Computes fb (writes KV at slot_mapping, samples logits rows); see model_runner_execute.
    atomc_status (*execute)(void *ctx, const struct forward_batch *fb, struct runner_output *out, struct error *err);
    void (*free)(void *ctx); // may be NULL
    // CUDA graph replays so far (tests check the decode graphs ran); may be NULL (= 0).
    uint64_t (*graph_replays)(void *ctx);
    // KV transfer: the paged KV pool of tensor-parallel rank `rank` (model_runner_kv_pool_view),
    // for rank in [0, kv_ranks) (kv_ranks 0 = 1); NULL = not available.
    void (*kv_pool)(void *ctx, int rank, struct kv_pool_view *out);
    int kv_ranks;
    // Speculative method "mtp": drafts from the model's MTP layer after an execute
    // (model_runner_draft); NULL = the model cannot draft (mtp is refused).
    atomc_status (*draft)(void *ctx, const struct draft_batch *db, int32_t *drafts, struct error *err);
};

// Text side. ctx NULL = no tokenizer: text prompts and stop strings are rejected, outputs
// carry no text.
struct engine_text_ops {
    void *ctx;
    atomc_status (*encode)(void *ctx, const char *text, size_t len, bool add_special_tokens, int32_t **ids,
                           int *n_ids, struct error *err);
    atomc_status (*decode)(void *ctx, const int32_t *ids, int n_ids, bool skip_special_tokens, char **out,
                           struct error *err);
    // Incremental detokenizer of one sequence (see tokenizer.h detokenizer_step).
    void *(*detok_new)(void *ctx, bool skip_special_tokens);
    atomc_status (*detok_step)(void *state, const int32_t *ids, int n_ids, int n_new, bool final, char **out,
                               size_t *out_len);
    void (*detok_free)(void *state);
    const char *(*token_bytes)(void *ctx, int32_t id, size_t *len); // may be NULL
    bool (*is_special)(void *ctx, int32_t id); // may be NULL (= none); structured output never emits them
    void (*free)(void *ctx); // may be NULL
};

struct tokenizer;
// Text ops over a loaded tokenizer (engine_text.c); the ops own it (freed with the engine).
void engine_text_ops_from_tokenizer(struct engine_text_ops *ops, struct tokenizer *tok);

#define ENGINE_MAX_EOS 16

struct engine_setup {
    struct engine_model_ops model;
    struct engine_text_ops text;
    int num_kv_blocks;
    int vocab_size;
    int max_model_len;              // the model's limit (options may lower it)
    int sliding_window;             // model_runner_sliding_window: > 0 frees blocks out of the window
    int sw_window, num_kv_blocks_sw; // model_runner_kv_groups: > 0 = the sliding-window layers' own pool
                                    // (per-layer-group block tables: a second table per sequence)
    int num_state_slots;            // model_runner_num_state_slots: > 0 = recurrent-state model (a slot per
                                    // running sequence; no prefix caching, no speculative decoding)
    bool sample_check;              // execute honours forward_batch.sample_check (model_runner_sample_check_ok)
    int host_threads;               // threads the forward computes on in this process (CPU backend, all
                                    // ranks); 0 = the forward runs on a device (sizes the grammar pool)
    int32_t eos_ids[ENGINE_MAX_EOS]; // config + generation_config + tokenizer
    int n_eos;
    atomc_model_info info;          // strings must outlive the engine (owned by ctx / strings below)
    uint64_t config_hash;           // KV transfer handshake: hash of the model's shape (0 = unknown)
    char *owned_strings[8];         // freed with the engine
};

// Takes ownership of setup's contexts (freed with the engine, also on failure).
atomc_status engine_create_with(const atomc_engine_options *o, struct engine_setup *setup, atomc_engine **out,
                                struct error *err);

// For tests: atomc_engine_create on backend b (created by the caller, e.g. with a capability table
// widened for a GPU test; owned by the engine from here, also on failure) instead of one made from
// o->device; tensor_parallel_size 1 only.
struct backend;
atomc_status engine_create_on_backend(const atomc_engine_options *o, struct backend *b, atomc_engine **out,
                                      char *err_buf, size_t err_len);

// max_num_seqs / max_num_batched_tokens after defaults (0 = auto: 256 / 8192 on cuda, 16 / 2048
// on cpu; the token budget is raised to max_num_seqs when only the latter was given).
void engine_resolve_limits(const atomc_engine_options *o, int *max_num_seqs, int *max_num_batched_tokens);
// The scheduler's long_prefill_token_threshold after defaults (atomc.h; -1 = auto).
int engine_resolve_long_prefill(const atomc_engine_options *o);

// Speculative decoding options after defaults and checks (k = 0: off; max_batch: drafts only in
// steps with at most this many decoding sequences). Also called before the model is loaded.
// Whether o asks for speculative method "mtp" (or its vLLM aliases deepseek_mtp / glm4_moe_mtp).
bool engine_spec_is_mtp(const atomc_engine_options *o);
bool engine_spec_is_eagle3(const atomc_engine_options *o);
atomc_status engine_resolve_spec(const atomc_engine_options *o, int *k, int *min_n, int *max_n, int *max_batch,
                                 struct error *err);

// For tests: the engine's block manager (only touch it between steps, loop thread stopped), and
// the sliding-window group's (NULL without per-layer-group block tables).
struct block_manager *engine_block_manager(atomc_engine *e);
struct block_manager *engine_block_manager_sw(atomc_engine *e);
// For tests: free recurrent-state slots (== su.num_state_slots when no sequence runs; 0 for other models).
int engine_num_free_state_slots(atomc_engine *e);
// For tests: the model's CUDA graph replays so far (0 on the CPU or with --enforce-eager).
uint64_t engine_graph_replays(atomc_engine *e);

// --- private to engine.c, engine_request.c, engine_step.c, engine_generate.c ----------------------
// struct atomc_engine and the functions these files share. Threads and ownership: engine.c's
// top comment (the fields under mu are shared, the rest belong to the thread running the steps).

struct block_manager;
struct scheduler;
struct sequence;
struct trace;

#define ENGINE_MAX_LOGPROBS 20

struct atomc_engine {
    struct engine_setup su;
    int max_model_len, block_size, max_num_seqs, max_num_batched_tokens, max_waiting;
    uint64_t seed;
    struct block_manager *bm;
    struct block_manager *bm_sw; // per-layer-group block tables: the sliding-window layers' pool, or NULL
    int peak_used, peak_used_sw; // most blocks of each pool in use at the end of a schedule
    struct scheduler *sched;

    // Shared state, under mu.
    pthread_mutex_t mu;
    pthread_cond_t wake; // loop thread: work arrived or stop requested
    pthread_cond_t done; // atomc_engine_generate: one of its requests finished
    struct sequence **inbox;
    int n_inbox, inbox_cap;
    uint64_t *aborts;
    int n_aborts, aborts_cap;
    uint64_t *live; // (live_cap) open-addressing set of ids not yet finished; 0 = empty slot
    int n_live, live_cap;
    uint64_t next_id;
    bool thread_on, stop_requested;
    pthread_t thread;
    atomc_stats stats; // refreshed at the end of every step
    int sched_seqs;    // waiting + running in the scheduler, as of the last step
    bool kv_poke;      // the KV connector has news (a QUERY to answer, a HAVE, an ACK): step once

    // Loop-side counters.
    uint64_t prompt_tokens_total, generation_tokens_total, num_steps, num_finished, num_aborted;
    uint64_t prompt_tokens_computed;

    // Prefill/decode disaggregation (engine_kv_transfer.c); NULL = off.
    struct engine_kv *kv;

    // Speculative decoding (spec.h; options speculative_*): k = 0 is off.
    int spec_k, spec_min, spec_max;
    int spec_max_batch; // drafts only in steps with at most this many decoding sequences (INT_MAX: always)
    bool spec_mtp;      // methods "mtp" / "eagle3": drafts from a draft layer (the model's MTP layer or an
                        // EAGLE-3 head, engine_spec_mtp.c), else n-gram
    double spec_force;  // BENCHMARK ONLY: forced acceptance probability (options.spec_forced_acceptance), 0 = off
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted, spec_accepted_pos[ATOMC_MAX_SPEC_TOKENS];

    // Per-step buffers, grown on demand, never shrunk (no per-token allocation). They back the
    // forward_batch that build_batch hands the model; capacities in *_cap.
    int32_t *b_tokens, *b_positions, *b_slots; // (n_tokens) ids, positions, KV slot of each new token
    int b_tok_cap;
    int32_t *b_qstart;                // (n_seqs + 1) prefix sums of new tokens
    int32_t *b_ctx;                   // (n_seqs) tokens in KV after the step
    int32_t *b_sslots;                // (n_seqs) recurrent-state slots (recurrent models)
    int b_seq_cap;
    int32_t *b_logit_rows;            // (n_logits) token row sampled for each finishing prefill / decode
                                      // (1 + n_draft rows for a decode with drafts)
    struct sample_row *b_rows;        // (n_logits) sampling parameters of those rows
    struct sequence **b_row_seq;      // (n_logits) the sequence each row belongs to
    int b_row_cap;
    int32_t *b_tables;                // (n_seqs, max_blocks_per_seq) block ids, zero-padded
    int32_t *b_tables_sw;             // per-layer-group block tables: the sliding group's, same shape
    size_t b_tables_cap;
    int32_t *b_slots_sw;              // (n_tokens) their KV slots (per-layer-group block tables)
    int32_t *b_plp_rows, *b_plp_targets, *b_plp_pos; // (n_prompt_lp) prompt-logprob row, next id, position
    struct sequence **b_plp_seq;      // (n_prompt_lp) owner of each prompt-logprob row
    int b_plp_cap;
    atomc_top_logprob *o_top;         // (k + 1) top logprobs of the output being delivered
    int o_top_cap;
    struct sequence **drained;        // (n_inbox) requests taken from the inbox; also a failed batch's sequences
    int drained_cap;

    // MTP drafting pass (engine_spec_mtp.c): its draft batch, grown on demand.
    struct {
        int32_t *tok, *pos, *slot, *hrows; // (tokens)
        int tok_cap;
        int32_t *qs, *ctx, *lrows, *ndraft, *row_seq, *chain_slots, *drafts; // per sequence (qs: + 1)
        struct sequence **seqs, **order;
        int seq_cap;
        int32_t *tables;
        size_t tables_cap;
    } mtp;

    struct engine_grammar *grammar; // structured output (engine_grammar.c)

    // Profiling (options.profile_dir): spans of every step; NVTX ranges in CUDA builds.
    struct trace *trace;
    char *profile_dir;
    int profile_count;
};

// Grows a buffer of *cap elements of elem bytes to hold need (doubling; at least 16); p if it
// already does.
static inline void *grow(void *p, int *cap, int need, size_t elem) {
    if (need <= *cap) return p;
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    *cap = c;
    return xrealloc(p, (size_t)c * elem);
}

static inline uint64_t mix64(uint64_t x) { // splitmix64 finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// engine_request.c: forgets a finished id (under mu); frees a sequence that no longer is in the
// scheduler; moves the inbox's new sequences into the scheduler and finishes the aborted ones
// (on the thread running the steps).
void engine_live_remove(atomc_engine *e, uint64_t id);
void engine_seq_free(atomc_engine *e, struct sequence *s);
void engine_drain_inbox(atomc_engine *e);

// engine_spec_mtp.c: after a step's outputs, the MTP layer over the positions the step verified and
// the next step's drafts of the decoding sequences (spec.h).
void engine_mtp_after_step(atomc_engine *e);
// Frees the drafting pass's buffers (atomc_engine_free).
void engine_mtp_free(atomc_engine *e);

// engine_step.c: ends s with reason (see its comment); snapshots the stats under mu.
void engine_retire(atomc_engine *e, struct sequence *s, atomc_finish_reason reason, int n_new,
                   const atomc_token_logprobs *lp, const char *error);
void engine_refresh_stats(atomc_engine *e);

// engine_kv_transfer.c (its top comment): created after the block manager (NULL kv = off);
// request parameters into s; admit: true when a new sequence waits for its KV instead of entering
// the scheduler; find: a waiting one by id; on_retire: before s leaves the scheduler (true: s was
// waiting for KV, not in the scheduler); poll: step start (acknowledgements, timeouts, arrivals);
// before_forward: registers the step's producer sends and sets the batch's per-layer hook;
// after_forward(ok): waits until they are queued (END for finished prompts), or drops them when
// the forward failed; stats; pending + held transfers (the loop keeps stepping).
struct scheduler_output;
atomc_status engine_kv_create(atomc_engine *e, const atomc_engine_options *o, struct error *err);
void engine_kv_free(atomc_engine *e);
atomc_status engine_kv_request(atomc_engine *e, struct sequence *s, const atomc_request *r, struct error *err);
bool engine_kv_admit(atomc_engine *e, struct sequence *s);
struct sequence *engine_kv_find(atomc_engine *e, uint64_t id);
bool engine_kv_on_retire(atomc_engine *e, struct sequence *s);
void engine_kv_poll(atomc_engine *e);
struct forward_batch;
void engine_kv_before_forward(atomc_engine *e, const struct scheduler_output *so, struct forward_batch *fb);
void engine_kv_after_forward(atomc_engine *e, const struct scheduler_output *so, bool ok);
void engine_kv_fill_stats(atomc_engine *e, atomc_stats *st);
void engine_kv_live_stats(atomc_engine *e, atomc_stats *st); // any thread: the connector's counters now
int engine_kv_n_work(const atomc_engine *e);
// engine_grammar.c (structured output; its top comment has the protocol): create / free with the
// engine; attach compiles a sequence's grammar (caller's thread); begin_masks starts filling the
// step's constrained rows' masks (after build_batch) and sets fb->sample_ready = join; accept
// advances a sequence's matcher by its new token: 1 = the grammar has ended, 0 = go on, -1 = the
// grammar rejects the token.
atomc_status engine_grammar_create(atomc_engine *e, const atomc_engine_options *o);
void engine_grammar_free(atomc_engine *e);
atomc_status engine_grammar_attach(atomc_engine *e, struct sequence *s, struct error *err);
void engine_grammar_seq_free(struct sequence *s);
void engine_grammar_begin_masks(atomc_engine *e, struct forward_batch *fb);
void engine_grammar_join(void *e);
int engine_grammar_accept(atomc_engine *e, struct sequence *s, int32_t t);
// forward_batch.sample_check (set by begin_masks when su.sample_check and a row qualifies).
int engine_grammar_check(void *e, const int32_t *ids, const int32_t **redo);
// For tests and benchmarks: rows drawn unmasked first and checked / of them drawn again; and
// sample-then-check on (the default) or off (every constrained row masked before its draw).
void engine_grammar_check_counts(atomc_engine *e, uint64_t *checked, uint64_t *redrawn);
void engine_grammar_set_check(atomc_engine *e, bool on);
// For tests: masks filled before the draw by the pool and by the joining thread, and the pool's
// threads started so far.
void engine_grammar_fill_counts(atomc_engine *e, uint64_t *by_workers, uint64_t *by_join, int *n_workers);

#endif
