// A sequence: one request's token ids (prompt then generated), its sampling parameters and
// stop rules, its KV block table, its place in the scheduler and its timestamps.
//
// Token accounting (the same for prefill, chunked prefill, decode and recompute after
// preemption): tokens[0..n_tokens) are known; the KV of tokens[0..n_computed) is in the
// cache. A step computes tokens[n_computed .. n_computed + n_sched); when that reaches
// n_tokens, the last row's logits are sampled and the new token is appended. A decode is
// simply n_tokens - n_computed == 1. Preemption drops the KV (n_computed = 0) but keeps the
// tokens, so the recompute re-prefills prompt + generated tokens.
//
// Speculative decoding: a decoding sequence may carry n_draft proposed tokens, stored right
// after the known ones in tokens[n_tokens .. n_tokens + n_draft) (so penalty histories and the
// forward batch read them like any token). They are not part of n_tokens: a step schedules
// n_sched = 1 + n_draft tokens, verification appends the accepted ones (and the target's own
// next token) through the normal output path, and n_computed then covers only verified tokens.
#ifndef ATOMC_ENGINE_SEQUENCE_H
#define ATOMC_ENGINE_SEQUENCE_H

#include <stdbool.h>
#include <stdint.h>

#include "atomc.h"
#include "engine/block_manager.h"
#include "engine/stop_checker.h"

enum seq_status {
    SEQ_STATUS_WAITING = 0, // in the waiting queue (new or preempted)
    SEQ_STATUS_RUNNING,     // admitted: holds blocks; prefilling (maybe in chunks) or decoding
    SEQ_STATUS_FINISHED,
};

struct sequence {
    uint64_t id;
    enum seq_status status;
    atomc_finish_reason finish_reason;

    int32_t *tokens; // (cap) prompt ids then generated ids
    int n_tokens, cap;
    int n_prompt;
    int n_computed;          // tokens whose KV is in the cache
    int n_cached;            // prompt tokens served by the prefix cache at first admission
    bool no_prefix_cache;    // skip prefix lookups (prompt logprobs need every prompt row)
    struct block_table bt;
    struct block_table bt_sw; // hybrid models: the sliding-window group's blocks (scheduler.h), else empty
    int state_slot;          // recurrent-state slot while running (models with recurrent layers), else -1

    // Scheduler state.
    uint64_t admit_order;    // increases with each admission; preemption picks the largest
    int n_sched;             // tokens scheduled this step (0 = not scheduled)
    bool admitted_once;
    int n_preemptions;

    // Speculative decoding (see the top comment). n_draft is set by the proposer before a step
    // and cut (or zeroed) by the scheduler; it is 0 outside the step.
    int n_draft;
    uint32_t spec_misses; // drafted steps in a row without an accepted draft (opt-out rule, spec.h)
    uint32_t spec_pause;  // steps left without drafts (opt-out rule)
    // Method "mtp" (engine_spec_mtp.c): the step computed positions [step_pos0, ...) at token rows
    // step_row0 + ... of its batch (in_step: set by build_batch, cleared by the MTP pass); the MTP
    // pass leaves mtp_ready drafts in tokens[n_tokens ..) made when n_tokens was mtp_ready_at.
    bool in_step;
    int step_pos0, step_row0;
    int mtp_ready, mtp_ready_at;

    // Request parameters (owned copies).
    atomc_sampling_params params; // params.stop / stop_token_ids point into the fields below
    char **stop_strs;
    int32_t *stop_token_ids;
    int32_t *min_ban;        // (n_min_ban) EOS + stop token ids, banned until min_tokens
    int n_min_ban;
    int max_output;          // generation limit from max_tokens and the context length
    atomc_output_fn on_output;
    void *user;

    // Output side (engine loop).
    struct stop_checker stop;
    void *detok;             // detokenizer state (engine text ops)
    int32_t stop_token;      // -1 unless finished by EOS / a stop token
    atomc_token_logprobs *prompt_lp; // (n_prompt) collected for echo+logprobs, delivered once
    atomc_top_logprob *prompt_lp_top; // (n_prompt, params.prompt_logprobs)
    int n_prompt_lp;         // prompt rows done so far (row 0 has no logprob)
    bool prompt_lp_sent;
    bool prompt_lp_nonfinite; // this step's prompt logprobs came from NaN / +inf logits: fail the request
    bool abort_requested;

    // KV transfer (engine_kv_transfer.c). kv_mode: 0 none, 1 producer (send the prompt's KV),
    // 2 consumer (wait for it in the KV layer's pending list, then start decoding).
    int kv_mode;
    char *kv_id, *kv_remote;   // owned
    int kv_sent;               // producer: prompt tokens sent so far (or skipped)
    int kv_skip;               // producer: leading prompt tokens the consumer has cached (not sent)
    bool kv_failed;            // producer: the transfer is off (no consumer, broken connection)
    bool kv_fallback;          // consumer: prefilled locally after all
    double kv_deadline;        // consumer: fall back after this; producer: stop waiting for HAVE (monotonic s)
    double kv_transfer_s;      // consumer: BEGIN -> END of its transfer
    // Structured output (engine_grammar.c): the matcher (NULL = unconstrained), the row mask it
    // fills each step, and whether it applies yet (params.grammar_start_token).
    struct grammar_matcher *grammar;
    uint32_t *grammar_mask;
    bool grammar_active;
    // Sample-then-check: the grammar already accepted this step's token grammar_checked_id.
    bool grammar_checked;
    int32_t grammar_checked_id;

    // Timestamps (monotonic seconds), 0 = not yet.
    double t_arrival, t_first_scheduled, t_first_token, t_last_token, t_finish;
};

static inline int sequence_n_output(const struct sequence *s) { return s->n_tokens - s->n_prompt; }
static inline int sequence_n_remaining(const struct sequence *s) { return s->n_tokens - s->n_computed; }

#endif
