// Continuous-batching scheduler with chunked prefill and preemption by recompute.
//
// Each step fills a token budget (max_num_batched_tokens) for at most max_num_seqs running
// sequences, in three passes (the fairness rule is vLLM's: decodes first, then prefill chunks
// that share what is left of the budget, each at most long_prefill_token_threshold tokens):
//   1. decodes: every running sequence with exactly one token to compute gets it. If its
//      next block cannot be allocated, the most recently admitted running sequence not yet
//      scheduled is preempted (possibly itself, if it is the most recent);
//   2. ongoing chunked prefills (running, more than one token to compute), oldest first: each
//      gets min(remaining, budget, threshold) tokens, cut down to the free blocks; if not even
//      one token fits, more recently admitted unscheduled sequences are preempted for it;
//   3. admissions from the waiting queue, strictly FCFS (the head blocks the queue when it does
//      not fit): prefix-cache lookup, then a first chunk of min(remaining, budget, threshold)
//      tokens cut down to the free blocks. No admissions in a step that preempted (it would only
//      thrash).
// threshold = cfg.long_prefill_token_threshold (0 = none: a chunk may take the whole budget).
// It bounds the work one long prompt puts into a step, so (a) a step, and with it the wait of a
// request that arrives during it, lasts at most about budget tokens of compute with the long
// prompt taking only `threshold` of them, and (b) the rest of the budget is left for decodes
// and for the admission of requests that arrive while a long prompt is prefilled: a short
// request is admitted in the first step after it arrives (budget - threshold * (long prefills
// in flight) tokens remain for it) and decodes in every step after that, instead of waiting for
// the whole long prompt. Prompt logprobs (echo) are computed with each chunk, so they add to
// the chunk's step, not to one step at the end.
//   1b. speculative decoding: each decode that carries n_draft proposed tokens (sequence.h) gets
//      them too, as far as the budget left and the free pool allow (all or none of a sequence's
//      drafts); a decode whose drafts do not fit just decodes without them (nothing is preempted
//      for drafts). Its n_sched is then 1 + n_draft;
// Decodes therefore never wait behind a long prompt (the budget must be >= max_num_seqs), and
// a long prompt is spread over as many steps as its length needs. New prompts are admitted as
// soon as a slot, budget and blocks allow (prefill-first admission).
//
// Sliding-window models (cfg.sliding_window = W > 0): before a running sequence is scheduled,
// its blocks wholly before position n_computed - W + 1 (the first key its next token reads) are
// released (block_manager_drop_before), so a long sequence holds about W / block_size blocks.
//
// Hybrid models with per-layer-group block tables (scheduler_set_sliding_group): the sliding-window
// layers keep their KV in a block manager of their own (bm_sw, window W), each sequence a second
// table (sequence.bt_sw) that grows with the full one and drops its blocks wholly before
// n_computed - W + 1, while the full group keeps every block. A sequence is scheduled only when
// both groups have room; a prefix hit of k blocks needs the full group's k blocks and the sliding
// group's blocks of the window before token k * bs (block_manager_lookup_window); preemption,
// finish and abort release both tables.
//
// A preempted sequence loses its blocks (n_computed = 0), keeps its tokens, and goes to the
// FRONT of the waiting queue; on re-admission it re-prefills prompt + generated tokens (a
// prefix-cache hit makes that cheap when its blocks are still cached).
//
// Recurrent-state models (cfg.state_slots = S > 0, S >= max_num_seqs): each running sequence
// holds one of S state slots (sequence.state_slot), taken at admission and given back when it
// is preempted or removed (finish, abort); a preempted sequence recomputes from position 0 in
// whatever slot it gets next, and the ops start a sequence at position 0 from a zero state.
//
// Single-threaded: the engine loop owns it. Sequence memory is owned by the engine.
#ifndef ATOMC_ENGINE_SCHEDULER_H
#define ATOMC_ENGINE_SCHEDULER_H

#include <stdint.h>

#include "common/error.h"
#include "engine/block_manager.h"
#include "engine/sequence.h"

struct scheduler_config {
    int max_num_seqs;
    int max_num_batched_tokens;
    int sliding_window; // > 0: every layer attends to the last W tokens only (model_runner_sliding_window);
                        // blocks before the window of a running sequence's next token are freed
    int state_slots;    // > 0: recurrent-state slots to hand out (at least max_num_seqs); 0 = none
    int long_prefill_token_threshold; // > 0: most tokens of one prefill chunk per step (see above); 0 = no cap
};

struct scheduler {
    struct scheduler_config cfg;
    struct block_manager *bm;
    struct sequence **waiting; // ring buffer (wait_cap) of n_waiting entries from wait_head
    int wait_head, n_waiting, wait_cap;
    struct sequence **running; // (n_running) in admission order
    int n_running, run_cap;
    struct sequence **scheduled; // (n_scheduled) this step: decodes, then chunks, then admissions
    int n_scheduled;
    int32_t *match;              // prefix lookup scratch
    int match_cap;
    struct block_manager *bm_sw; // hybrid models: the sliding-window group's blocks, or NULL
    int sw_window;               // its window (tokens each query attends to, itself included)
    int32_t *match_sw;           // its lookup scratch
    int match_sw_cap;
    int32_t *free_slots;         // (cfg.state_slots) stack of free recurrent-state slots
    int n_free_slots;
    uint64_t admit_counter;
    uint64_t num_preemptions;
};

struct scheduler_output {
    struct sequence *const *seqs; // each with n_sched > 0; valid until the next schedule
    int n_seqs;
    int n_tokens;
    int n_decodes;    // seqs[0 .. n_decodes) are single-token steps from pass 1
    int n_preempted;  // preemptions this step
};

atomc_status scheduler_create(const struct scheduler_config *cfg, struct block_manager *bm, struct scheduler **out,
                              struct error *err);
void scheduler_free(struct scheduler *s); // does not free sequences

void scheduler_add(struct scheduler *s, struct sequence *seq); // to the back of the waiting queue

// Hybrid sliding / full models: the sliding-window layers' own block manager and window (see
// above). Before any sequence is added; bm_sw has the block size and prefix-caching setting of
// the scheduler's bm and outlives the scheduler; cfg.sliding_window must be 0.
void scheduler_set_sliding_group(struct scheduler *s, struct block_manager *bm_sw, int window);

// Picks this step's batch (see above); sets n_sched on each scheduled sequence, allocates
// their blocks, sets t_first_scheduled on first admission.
void scheduler_schedule(struct scheduler *s, double now, struct scheduler_output *out);

// After the forward pass: n_computed += n_sched - n_draft for each scheduled sequence (drafts
// count only once verified: the engine adds the accepted ones), n_sched reset.
// (Blocks a step fills are registered in the prefix cache when it is scheduled; if the forward
// pass fails, the caller must drop them: block_manager_reset_prefix_cache once the batch's
// sequences are released.)
void scheduler_complete_step(struct scheduler *s);

// Removes a sequence from the waiting queue or the running set and releases its blocks; also
// drops it from the current step's scheduled list (so it may be called between schedule and
// complete_step, e.g. when the forward pass failed; that compacts the output's seqs array).
// The caller sets its finish status and frees it.
void scheduler_remove(struct scheduler *s, struct sequence *seq);

// KV transfer (engine_kv_transfer.c): puts seq, whose block table already holds the KV of its
// first n_computed tokens (received from a prefill instance), straight into the running set, as
// an admission. False (nothing changed) when max_num_seqs sequences are running.
bool scheduler_admit_prefilled(struct scheduler *s, struct sequence *seq, double now);

static inline int scheduler_num_waiting(const struct scheduler *s) { return s->n_waiting; }
static inline int scheduler_num_free_state_slots(const struct scheduler *s) { return s->n_free_slots; }
static inline int scheduler_num_running(const struct scheduler *s) { return s->n_running; }
struct sequence *scheduler_waiting_at(const struct scheduler *s, int i); // i-th from the front

#endif
