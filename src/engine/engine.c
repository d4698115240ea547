// The engine: the implementation of include/atomc.h (except atomc_engine_create, which
// loads a model: engine_create.c).
//
// Threads. Any thread may add requests, abort them, read stats or tokenize. New sequences
// and abort ids go through an inbox under `mu`; the step drains it. The scheduler, block
// manager and sequences belong to whichever thread runs the steps (the loop thread once
// started, else the caller of atomc_engine_step). The loop thread sleeps on `wake` when
// there is no work. Callbacks run without `mu` held.
//
// A step: drain the inbox (admit new sequences, finish aborted ones) -> scheduler_schedule
// -> build the forward batch in reusable buffers -> model execute -> scheduler_complete_step
// (KV now computed, full blocks enter the prefix cache) -> for every sampled row: append the
// token, stop rules, incremental detokenization, stop strings, callback; finished sequences
// leave the scheduler (their blocks return to the pool) and are freed.
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "common/trace.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"

#define ENGINE_MAX_LOGPROBS 20

struct atomc_engine {
    struct engine_setup su;
    int max_model_len, block_size, max_num_seqs, max_num_batched_tokens, max_waiting;
    uint64_t seed;
    struct block_manager *bm;
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

    // Loop-side counters.
    uint64_t prompt_tokens_total, generation_tokens_total, num_steps, num_finished, num_aborted;

    // Per-step buffers, grown on demand, never shrunk (no per-token allocation). They back the
    // forward_batch that build_batch hands the model; capacities in *_cap.
    int32_t *b_tokens, *b_positions, *b_slots; // (n_tokens) ids, positions, KV slot of each new token
    int b_tok_cap;
    int32_t *b_qstart;                // (n_seqs + 1) prefix sums of new tokens
    int32_t *b_ctx;                   // (n_seqs) tokens in KV after the step
    int32_t *b_logit_rows;            // (n_logits) token row sampled for each finishing prefill / decode
    struct sample_row *b_rows;        // (n_logits) sampling parameters of those rows
    struct sequence **b_row_seq;      // (n_logits) the sequence each row belongs to
    int b_seq_cap;
    int32_t *b_tables;                // (n_seqs, max_blocks_per_seq) block ids, zero-padded
    size_t b_tables_cap;
    int32_t *b_plp_rows, *b_plp_targets, *b_plp_pos; // (n_prompt_lp) prompt-logprob row, next id, position
    struct sequence **b_plp_seq;      // (n_prompt_lp) owner of each prompt-logprob row
    int b_plp_cap;
    atomc_top_logprob *o_top;         // (k + 1) top logprobs of the output being delivered
    int o_top_cap;
    struct sequence **drained;        // (n_inbox) requests taken from the inbox; also a failed batch's sequences
    int drained_cap;

    // Profiling (options.profile_dir): spans of every step; NVTX ranges in CUDA builds.
    struct trace *trace;
    char *profile_dir;
    int profile_count;
};

// --- defaults ------------------------------------------------------------------------------------

void atomc_engine_options_init(atomc_engine_options *o) {
    memset(o, 0, sizeof *o);
    o->device = "cpu";
    o->dtype = "auto";
    o->load_format = "auto";
    o->kv_cache_dtype = "auto";
    o->generation_config = "auto";
    o->block_size = 16;
    o->gpu_memory_utilization = 0.9;
    o->enable_prefix_caching = true;
    o->tensor_parallel_size = 1;
}

void atomc_sampling_params_init(atomc_sampling_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->max_tokens = 16;
    p->skip_special_tokens = true;
    p->logprobs = -1;
    p->prompt_logprobs = -1;
}

void atomc_request_init(atomc_request *r) {
    memset(r, 0, sizeof *r);
    r->add_special_tokens = true;
    atomc_sampling_params_init(&r->params);
}

void atomc_free(void *p) { free(p); }

void atomc_result_free(atomc_result *r) {
    if (!r) return;
    free(r->tokens);
    free(r->text);
    memset(r, 0, sizeof *r);
}

struct block_manager *engine_block_manager(atomc_engine *e) { return e->bm; }
uint64_t engine_graph_replays(atomc_engine *e) {
    return e->su.model.graph_replays ? e->su.model.graph_replays(e->su.model.ctx) : 0;
}

// --- small helpers -----------------------------------------------------------------------------

static void *grow(void *p, int *cap, int need, size_t elem) {
    if (need <= *cap) return p;
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    *cap = c;
    return xrealloc(p, (size_t)c * elem);
}

static uint64_t mix64(uint64_t x) { // splitmix64 finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// The set of live request ids (under mu): linear probing in a power-of-two table kept at most
// half full, deletion by backward shift (no tombstones). Ids are never 0.
static size_t live_slot(uint64_t id, int cap) { return (size_t)(mix64(id) & (uint64_t)(cap - 1)); }

static bool live_contains(const atomc_engine *e, uint64_t id) {
    if (!e->live_cap) return false;
    for (size_t i = live_slot(id, e->live_cap);; i = (i + 1) & (size_t)(e->live_cap - 1)) {
        if (e->live[i] == id) return true;
        if (e->live[i] == 0) return false;
    }
}

static void live_insert_nogrow(uint64_t *t, int cap, uint64_t id) {
    size_t i = live_slot(id, cap);
    while (t[i]) i = (i + 1) & (size_t)(cap - 1);
    t[i] = id;
}

static void live_insert(atomc_engine *e, uint64_t id) {
    if (2 * (e->n_live + 1) > e->live_cap) {
        int cap = e->live_cap ? e->live_cap * 2 : 64;
        uint64_t *t = xcalloc((size_t)cap, sizeof *t);
        for (int i = 0; i < e->live_cap; i++)
            if (e->live[i]) live_insert_nogrow(t, cap, e->live[i]);
        free(e->live);
        e->live = t;
        e->live_cap = cap;
    }
    live_insert_nogrow(e->live, e->live_cap, id);
    e->n_live++;
}

static void live_remove(atomc_engine *e, uint64_t id) {
    size_t mask = (size_t)e->live_cap - 1, i = live_slot(id, e->live_cap);
    while (e->live[i] != id) {
        CHECK(e->live[i] != 0);
        i = (i + 1) & mask;
    }
    // Backward-shift deletion: move later entries of the probe run into the hole when their
    // home slot does not lie cyclically in (hole, j].
    size_t hole = i;
    for (size_t j = (i + 1) & mask; e->live[j]; j = (j + 1) & mask) {
        size_t home = live_slot(e->live[j], e->live_cap);
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            e->live[hole] = e->live[j];
            hole = j;
        }
    }
    e->live[hole] = 0;
    e->n_live--;
}

static bool is_eos(const atomc_engine *e, int32_t t) {
    for (int i = 0; i < e->su.n_eos; i++)
        if (e->su.eos_ids[i] == t) return true;
    return false;
}

static bool in_list(const int32_t *ids, int n, int32_t t) {
    for (int i = 0; i < n; i++)
        if (ids[i] == t) return true;
    return false;
}

// --- sequences ---------------------------------------------------------------------------------

static void seq_free(atomc_engine *e, struct sequence *s) {
    if (!s) return;
    if (s->detok && e->su.text.detok_free) e->su.text.detok_free(s->detok);
    stop_checker_free(&s->stop);
    for (int i = 0; i < s->params.n_stop; i++) free(s->stop_strs[i]);
    free(s->stop_strs);
    free(s->stop_token_ids);
    free(s->min_ban);
    free(s->prompt_lp);
    free(s->prompt_lp_top);
    block_table_free(&s->bt);
    free(s->tokens);
    free(s);
}

static void seq_append(struct sequence *s, int32_t t) {
    if (s->n_tokens == s->cap) {
        s->cap *= 2;
        s->tokens = xrealloc(s->tokens, (size_t)s->cap * sizeof *s->tokens);
    }
    s->tokens[s->n_tokens++] = t;
}

static atomc_status validate_params(const atomc_engine *e, const atomc_sampling_params *p, struct error *err) {
    if (!(p->temperature >= 0.0f))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "temperature must be non-negative, got %g.", p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "top_p must be in (0, 1], got %g.", p->top_p);
    if (p->top_k < -1)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "top_k must be -1 (disable), 0 (disable) or at least 1, got %d.",
                         p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "min_p must be in [0, 1], got %g.", p->min_p);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "presence_penalty must be in [-2, 2], got %g.",
                         p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "frequency_penalty must be in [-2, 2], got %g.",
                         p->frequency_penalty);
    if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 2.0f))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "repetition_penalty must be in (0, 2], got %g.",
                         p->repetition_penalty);
    if (p->max_tokens == 0 || p->max_tokens < -1)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "max_tokens must be at least 1, got %d.", p->max_tokens);
    if (p->min_tokens < 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "min_tokens must be greater than or equal to 0, got %d.",
                         p->min_tokens);
    if (p->max_tokens > 0 && p->min_tokens > p->max_tokens)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "min_tokens must be less than or equal to max_tokens=%d, got %d.", p->max_tokens,
                         p->min_tokens);
    if (p->logprobs < -1 || p->logprobs > ENGINE_MAX_LOGPROBS)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "logprobs must be in [0, %d] (or -1 for none), got %d.",
                         ENGINE_MAX_LOGPROBS, p->logprobs);
    if (p->prompt_logprobs < -1 || p->prompt_logprobs > ENGINE_MAX_LOGPROBS)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "prompt_logprobs must be in [0, %d] (or -1 for none), got %d.", ENGINE_MAX_LOGPROBS,
                         p->prompt_logprobs);
    if (p->n_stop < 0 || (p->n_stop > 0 && !p->stop))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "invalid stop string list");
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i] || !p->stop[i][0])
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "stop strings must be non-empty (stop[%d]).", i);
    if (p->n_stop > 0 && !e->su.text.ctx)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "stop strings need a tokenizer, and this engine has none");
    if (p->n_stop_token_ids < 0 || (p->n_stop_token_ids > 0 && !p->stop_token_ids))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "invalid stop_token_ids list");
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] < 0 || p->stop_token_ids[i] >= e->su.vocab_size)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "stop_token_ids[%d] = %d is out of vocabulary (size %d).",
                             i, p->stop_token_ids[i], e->su.vocab_size);
    return ATOMC_OK;
}

// Builds a sequence from a request (on the caller's thread: tokenization happens here).
static atomc_status seq_from_request(atomc_engine *e, const atomc_request *r, struct sequence **out,
                                     struct error *err) {
    *out = NULL;
    atomc_status st = validate_params(e, &r->params, err);
    if (st != ATOMC_OK) return st;
    int32_t *ids = NULL;
    int n = 0;
    if (r->prompt_ids) {
        if (r->n_prompt_ids < 0) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "negative prompt length");
        for (int i = 0; i < r->n_prompt_ids; i++)
            if (r->prompt_ids[i] < 0 || r->prompt_ids[i] >= e->su.vocab_size)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                 "Token id %d (prompt position %d) is out of vocabulary (size %d).", r->prompt_ids[i],
                                 i, e->su.vocab_size);
        n = r->n_prompt_ids;
    } else if (r->prompt) {
        if (!e->su.text.ctx)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "text prompts need a tokenizer, and this engine has none");
        size_t len = r->prompt_len ? r->prompt_len : strlen(r->prompt);
        st = e->su.text.encode(e->su.text.ctx, r->prompt, len, r->add_special_tokens, &ids, &n, err);
        if (st != ATOMC_OK) return st;
    } else {
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "the request has neither a prompt nor prompt token ids");
    }
    if (n == 0) {
        free(ids);
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "The prompt cannot be empty.");
    }
    if (n > e->max_model_len) {
        free(ids);
        return error_set(err, ATOMC_ERR_TOO_LONG,
                         "This model's maximum context length is %d tokens. However, you requested %d tokens in the "
                         "prompt. Please reduce the length of the prompt.",
                         e->max_model_len, n);
    }

    struct sequence *s = calloc(1, sizeof *s);
    if (!s) {
        free(ids);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
    }
    const atomc_sampling_params *p = &r->params;
    long room = (long)e->max_model_len - n;
    long max_out = p->max_tokens < 0 ? room : (p->max_tokens < room ? p->max_tokens : room);
    s->max_output = max_out < 1 ? 1 : (int)max_out; // a full-context prompt still samples one token
    s->cap = n + (s->max_output < 64 ? s->max_output : 64);
    s->tokens = malloc((size_t)s->cap * sizeof *s->tokens);
    if (!s->tokens) {
        free(ids);
        free(s);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory for a %d-token prompt", n);
    }
    memcpy(s->tokens, ids ? ids : r->prompt_ids, (size_t)n * sizeof *s->tokens);
    free(ids);
    s->n_tokens = s->n_prompt = n;
    block_table_init(&s->bt);
    s->status = SEQ_STATUS_WAITING;
    s->params = *p;
    if (p->n_stop) {
        s->stop_strs = xcalloc((size_t)p->n_stop, sizeof *s->stop_strs);
        for (int i = 0; i < p->n_stop; i++) s->stop_strs[i] = xstrdup(p->stop[i]);
    }
    s->params.stop = (const char *const *)s->stop_strs;
    if (p->n_stop_token_ids) {
        s->stop_token_ids = xmalloc((size_t)p->n_stop_token_ids * sizeof *s->stop_token_ids);
        memcpy(s->stop_token_ids, p->stop_token_ids, (size_t)p->n_stop_token_ids * sizeof *s->stop_token_ids);
    }
    s->params.stop_token_ids = s->stop_token_ids;
    if (p->min_tokens > 0) { // ids banned from sampling until min_tokens outputs
        s->min_ban = xmalloc((size_t)(e->su.n_eos + p->n_stop_token_ids + 1) * sizeof *s->min_ban);
        if (!p->ignore_eos)
            for (int i = 0; i < e->su.n_eos; i++) s->min_ban[s->n_min_ban++] = e->su.eos_ids[i];
        for (int i = 0; i < p->n_stop_token_ids; i++) s->min_ban[s->n_min_ban++] = p->stop_token_ids[i];
    }
    s->no_prefix_cache = p->prompt_logprobs >= 0;
    s->stop_token = -1;
    s->on_output = r->on_output;
    s->user = r->user;
    stop_checker_init(&s->stop, s->params.stop, p->n_stop, p->include_stop_str_in_output);
    if (e->su.text.ctx) s->detok = e->su.text.detok_new(e->su.text.ctx, p->skip_special_tokens);
    s->t_arrival = time_now_s();
    *out = s;
    return ATOMC_OK;
}

// --- outputs -----------------------------------------------------------------------------------

// Delivers one output for s: n_new newest tokens (with logprobs lp, or NULL), the text the stop
// checker releases, and, when finishing, the final fields.
static void emit(atomc_engine *e, struct sequence *s, int n_new, const atomc_token_logprobs *lp, const char *error) {
    atomc_output o;
    memset(&o, 0, sizeof o);
    bool final = s->finish_reason != ATOMC_FINISH_NONE;
    o.request_id = s->id;
    o.new_tokens = s->tokens + s->n_tokens - n_new;
    o.n_new_tokens = n_new;
    stop_checker_take(&s->stop, final, &o.text, &o.text_len);
    if (!o.text) o.text = "";
    o.logprobs = n_new ? lp : NULL;
    if (s->params.prompt_logprobs >= 0 && !s->prompt_lp_sent && s->prompt_lp && (n_new || final)) {
        o.prompt_logprobs = s->prompt_lp;
        o.n_prompt_logprobs = s->n_prompt - 1;
        s->prompt_lp_sent = true;
    }
    o.finish_reason = s->finish_reason;
    o.stop_str = s->stop.matched >= 0 ? s->stop_strs[s->stop.matched] : NULL;
    o.stop_token = s->stop_token;
    o.prompt_tokens = s->n_prompt;
    o.completion_tokens = sequence_n_output(s);
    o.cached_tokens = s->n_cached;
    o.error = error;
    o.arrival_time = s->t_arrival;
    o.first_scheduled_time = s->t_first_scheduled;
    o.first_token_time = s->t_first_token;
    o.last_token_time = s->t_last_token;
    o.finish_time = s->t_finish;
    o.num_preemptions = s->n_preemptions;
    if (s->on_output) s->on_output(s->user, &o);
}

// Ends s: out of the scheduler (blocks back to the pool), final output (with its last n_new
// tokens), forgotten, freed.
static void retire(atomc_engine *e, struct sequence *s, atomc_finish_reason reason, int n_new,
                   const atomc_token_logprobs *lp, const char *error) {
    if (s->status != SEQ_STATUS_FINISHED) scheduler_remove(e->sched, s);
    s->status = SEQ_STATUS_FINISHED;
    s->finish_reason = reason;
    s->t_finish = time_now_s();
    emit(e, s, n_new, lp, error);
    pthread_mutex_lock(&e->mu);
    live_remove(e, s->id);
    pthread_cond_broadcast(&e->done);
    pthread_mutex_unlock(&e->mu);
    e->num_finished++;
    if (reason == ATOMC_FINISH_ABORT) e->num_aborted++;
    seq_free(e, s);
}

// Feeds the detokenizer: n_ids output ids of which n_new are new; appends the delta to the stop
// checker (searching stop strings if check). Returns true if a stop string matched.
static bool detok_feed(atomc_engine *e, struct sequence *s, int n_ids, int n_new, bool final, bool check) {
    if (!s->detok || s->stop.matched >= 0) return false;
    char *delta = NULL;
    size_t len = 0;
    trace_begin(e->trace, "detokenize");
    atomc_status st =
        e->su.text.detok_step(s->detok, s->tokens + s->n_prompt, n_ids, n_new, final, &delta, &len);
    trace_end(e->trace, "detokenize");
    if (st != ATOMC_OK) {
        LOG_WARN("request %llu: detokenization failed (%s)", (unsigned long long)s->id, atomc_status_name(st));
        free(delta);
        return false;
    }
    int m = stop_checker_append(&s->stop, delta ? delta : "", len, check);
    free(delta);
    return m >= 0;
}

// A new token was sampled for s: append, apply the stop rules, deliver. Returns true if s finished.
static bool process_token(atomc_engine *e, struct sequence *s, int32_t t, const atomc_token_logprobs *lp, double now) {
    seq_append(s, t);
    e->generation_tokens_total++;
    if (!s->t_first_token) s->t_first_token = now;
    s->t_last_token = now;
    int n_out = sequence_n_output(s);
    bool can_stop = n_out >= s->params.min_tokens;
    bool stop_tok = can_stop && ((!s->params.ignore_eos && is_eos(e, t)) ||
                                 in_list(s->stop_token_ids, s->params.n_stop_token_ids, t));
    atomc_finish_reason reason = ATOMC_FINISH_NONE;
    if (stop_tok) {
        // The stop token's text is not output (unless asked); flush what precedes it.
        if (s->params.include_stop_str_in_output) detok_feed(e, s, n_out, 1, true, false);
        else detok_feed(e, s, n_out - 1, 0, true, false);
        reason = ATOMC_FINISH_STOP;
        s->stop_token = t;
    } else if (detok_feed(e, s, n_out, 1, false, can_stop)) {
        reason = ATOMC_FINISH_STOP;
    } else if (n_out >= s->max_output) {
        if (detok_feed(e, s, n_out, 0, true, can_stop)) reason = ATOMC_FINISH_STOP;
        else reason = ATOMC_FINISH_LENGTH;
    }
    if (reason == ATOMC_FINISH_NONE) {
        emit(e, s, 1, lp, NULL);
        return false;
    }
    retire(e, s, reason, 1, lp, NULL);
    return true;
}

// --- the step ----------------------------------------------------------------------------------

static struct sequence *find_seq(atomc_engine *e, uint64_t id) {
    struct scheduler *sc = e->sched;
    for (int i = 0; i < sc->n_running; i++)
        if (sc->running[i]->id == id) return sc->running[i];
    for (int i = 0; i < sc->n_waiting; i++) {
        struct sequence *s = scheduler_waiting_at(sc, i);
        if (s->id == id) return s;
    }
    return NULL;
}

static void drain_inbox(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    int n_new = e->n_inbox, n_ab = e->n_aborts;
    e->drained = grow(e->drained, &e->drained_cap, n_new + 1, sizeof *e->drained);
    if (n_new) memcpy(e->drained, e->inbox, (size_t)n_new * sizeof *e->inbox);
    e->n_inbox = 0;
    uint64_t ab_local[64];
    uint64_t *ab = n_ab <= 64 ? ab_local : xmalloc((size_t)n_ab * sizeof *ab);
    if (n_ab) memcpy(ab, e->aborts, (size_t)n_ab * sizeof *ab);
    e->n_aborts = 0;
    pthread_mutex_unlock(&e->mu);

    for (int i = 0; i < n_new; i++) {
        scheduler_add(e->sched, e->drained[i]);
        e->prompt_tokens_total += (uint64_t)e->drained[i]->n_prompt;
    }
    for (int i = 0; i < n_ab; i++) {
        struct sequence *s = find_seq(e, ab[i]);
        if (s) retire(e, s, ATOMC_FINISH_ABORT, 0, NULL, NULL);
    }
    if (ab != ab_local) free(ab);
}

static void refresh_stats(atomc_engine *e) {
    atomc_stats st;
    memset(&st, 0, sizeof st);
    st.num_running = scheduler_num_running(e->sched);
    st.num_waiting = scheduler_num_waiting(e->sched);
    st.num_kv_blocks = e->bm->num_blocks;
    st.num_free_kv_blocks = block_manager_num_free(e->bm);
    st.kv_cache_usage = 1.0 - (double)st.num_free_kv_blocks / e->bm->num_blocks;
    st.prefix_cache_queries = e->bm->queries;
    st.prefix_cache_hits = e->bm->hits;
    st.prefix_cache_evictions = e->bm->evictions;
    st.num_preemptions = e->sched->num_preemptions;
    st.prompt_tokens_total = e->prompt_tokens_total;
    st.generation_tokens_total = e->generation_tokens_total;
    st.num_steps = e->num_steps;
    st.num_requests_finished = e->num_finished;
    st.num_requests_aborted = e->num_aborted;
    pthread_mutex_lock(&e->mu);
    e->stats = st;
    e->sched_seqs = st.num_running + st.num_waiting;
    pthread_mutex_unlock(&e->mu);
}

static void fill_sample_row(const atomc_engine *e, const struct sequence *s, struct sample_row *r) {
    const atomc_sampling_params *p = &s->params;
    memset(r, 0, sizeof *r);
    r->temperature = p->temperature;
    r->top_p = p->top_p;
    r->min_p = p->min_p;
    r->top_k = p->top_k;
    r->presence_penalty = p->presence_penalty;
    r->frequency_penalty = p->frequency_penalty;
    r->repetition_penalty = p->repetition_penalty;
    r->seed = p->has_seed ? p->seed : mix64(e->seed ^ mix64(s->id));
    r->step = (uint64_t)sequence_n_output(s);
    r->prompt_ids = s->tokens;
    r->n_prompt = s->n_prompt;
    r->output_ids = s->tokens + s->n_prompt;
    r->n_output = sequence_n_output(s);
    r->n_logprobs = p->logprobs > 0 ? p->logprobs : 0;
    if (sequence_n_output(s) < p->min_tokens) {
        r->banned_ids = s->min_ban;
        r->n_banned = s->n_min_ban;
    }
}

// Appends the prompt-logprob rows of s computed this step (rows from q_start; the last prompt
// token has no target) at b_plp_*[*n_plp], growing them; whether any were added.
static bool add_prompt_logprob_rows(atomc_engine *e, struct sequence *s, int q_start, int *n_plp) {
    int first = s->n_computed, last = s->n_computed + s->n_sched; // positions [first, last)
    if (last > s->n_prompt - 1) last = s->n_prompt - 1;
    if (last <= first) return false;
    int need = *n_plp + (last - first);
    if (need > e->b_plp_cap) {
        int c = e->b_plp_cap;
        e->b_plp_rows = grow(e->b_plp_rows, &c, need, sizeof *e->b_plp_rows);
        e->b_plp_targets = xrealloc(e->b_plp_targets, (size_t)c * sizeof *e->b_plp_targets);
        e->b_plp_pos = xrealloc(e->b_plp_pos, (size_t)c * sizeof *e->b_plp_pos);
        e->b_plp_seq = xrealloc(e->b_plp_seq, (size_t)c * sizeof *e->b_plp_seq);
        e->b_plp_cap = c;
    }
    for (int p = first; p < last; p++, (*n_plp)++) {
        e->b_plp_rows[*n_plp] = q_start + (p - s->n_computed);
        e->b_plp_targets[*n_plp] = s->tokens[p + 1];
        e->b_plp_pos[*n_plp] = p;
        e->b_plp_seq[*n_plp] = s;
    }
    return true;
}

// Fills the per-step buffers from the scheduler output.
static void build_batch(atomc_engine *e, const struct scheduler_output *so, struct forward_batch *fb) {
    int n_seqs = so->n_seqs, n_tok = so->n_tokens, bs = e->block_size, max_blocks = 1;
    if (n_tok > e->b_tok_cap) {
        e->b_tokens = grow(e->b_tokens, &e->b_tok_cap, n_tok, sizeof *e->b_tokens);
        e->b_positions = xrealloc(e->b_positions, (size_t)e->b_tok_cap * sizeof *e->b_positions);
        e->b_slots = xrealloc(e->b_slots, (size_t)e->b_tok_cap * sizeof *e->b_slots);
    }
    if (e->b_seq_cap < n_seqs + 1) {
        e->b_seq_cap = n_seqs + 1 < e->max_num_seqs + 1 ? e->max_num_seqs + 1 : n_seqs + 1;
        size_t c = (size_t)e->b_seq_cap;
        e->b_qstart = xrealloc(e->b_qstart, c * sizeof *e->b_qstart);
        e->b_ctx = xrealloc(e->b_ctx, c * sizeof *e->b_ctx);
        e->b_logit_rows = xrealloc(e->b_logit_rows, c * sizeof *e->b_logit_rows);
        e->b_rows = xrealloc(e->b_rows, c * sizeof *e->b_rows);
        e->b_row_seq = xrealloc(e->b_row_seq, c * sizeof *e->b_row_seq);
    }
    for (int i = 0; i < n_seqs; i++)
        if (so->seqs[i]->bt.n > max_blocks) max_blocks = so->seqs[i]->bt.n;
    size_t table_need = (size_t)n_seqs * max_blocks;
    if (table_need > e->b_tables_cap) {
        e->b_tables_cap = table_need * 2;
        e->b_tables = xrealloc(e->b_tables, e->b_tables_cap * sizeof *e->b_tables);
    }

    int tok = 0, n_logits = 0, n_plp = 0, plp_k = 0;
    for (int i = 0; i < n_seqs; i++) {
        struct sequence *s = so->seqs[i];
        e->b_qstart[i] = tok;
        for (int p = s->n_computed; p < s->n_computed + s->n_sched; p++) {
            e->b_tokens[tok] = s->tokens[p];
            e->b_positions[tok] = p;
            e->b_slots[tok] = s->bt.ids[p / bs] * bs + p % bs;
            tok++;
        }
        e->b_ctx[i] = s->n_computed + s->n_sched;
        int32_t *row = e->b_tables + (size_t)i * max_blocks;
        memcpy(row, s->bt.ids, (size_t)s->bt.n * sizeof *row);
        for (int b = s->bt.n; b < max_blocks; b++) row[b] = 0; // padding, never read
        if (s->n_computed + s->n_sched == s->n_tokens) {
            e->b_logit_rows[n_logits] = tok - 1;
            fill_sample_row(e, s, &e->b_rows[n_logits]);
            e->b_row_seq[n_logits] = s;
            n_logits++;
        }
        bool wants_plp = s->params.prompt_logprobs >= 0 && !s->prompt_lp_sent;
        if (wants_plp && add_prompt_logprob_rows(e, s, e->b_qstart[i], &n_plp) && s->params.prompt_logprobs > plp_k)
            plp_k = s->params.prompt_logprobs;
    }
    e->b_qstart[n_seqs] = tok;
    CHECK(tok == n_tok);

    memset(fb, 0, sizeof *fb);
    fb->n_seqs = n_seqs;
    fb->n_tokens = n_tok;
    fb->token_ids = e->b_tokens;
    fb->positions = e->b_positions;
    fb->query_start = e->b_qstart;
    fb->context_lens = e->b_ctx;
    fb->block_tables = e->b_tables;
    fb->max_blocks_per_seq = max_blocks;
    fb->slot_mapping = e->b_slots;
    fb->n_logits = n_logits;
    fb->logits_rows = e->b_logit_rows;
    fb->sampling = e->b_rows;
    fb->n_prompt_lp = n_plp;
    fb->prompt_lp_rows = e->b_plp_rows;
    fb->prompt_lp_targets = e->b_plp_targets;
    fb->prompt_lp_k = plp_k;
}

// Stores this step's prompt logprobs into their sequences.
static void collect_prompt_logprobs(atomc_engine *e, const struct forward_batch *fb, const struct runner_output *ro) {
    for (int j = 0; j < fb->n_prompt_lp; j++) {
        struct sequence *s = e->b_plp_seq[j];
        int k = s->params.prompt_logprobs, n = s->n_prompt - 1, p = e->b_plp_pos[j];
        if (!s->prompt_lp) {
            s->prompt_lp = xcalloc((size_t)n, sizeof *s->prompt_lp);
            s->prompt_lp_top = xcalloc((size_t)n * (k ? k : 1), sizeof *s->prompt_lp_top);
        }
        atomc_token_logprobs *lp = &s->prompt_lp[p];
        lp->token = fb->prompt_lp_targets[j];
        lp->logprob = ro->prompt_lp[j];
        lp->n_top = k;
        lp->top = s->prompt_lp_top + (size_t)p * k;
        for (int t = 0; t < k; t++) {
            s->prompt_lp_top[(size_t)p * k + t].token = ro->prompt_top_ids[(size_t)j * fb->prompt_lp_k + t];
            s->prompt_lp_top[(size_t)p * k + t].logprob = ro->prompt_top_logprobs[(size_t)j * fb->prompt_lp_k + t];
        }
    }
}

int atomc_engine_step(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool foreign = e->thread_on && !pthread_equal(pthread_self(), e->thread);
    pthread_mutex_unlock(&e->mu);
    CHECK_MSG(!foreign, "atomc_engine_step called while the engine's loop thread runs");
    drain_inbox(e);
    double now = time_now_s();
    struct scheduler_output so;
    trace_begin(e->trace, "schedule");
    scheduler_schedule(e->sched, now, &so);
    trace_end(e->trace, "schedule");
    if (so.n_seqs == 0) {
        refresh_stats(e);
        return 0;
    }
    trace_begin(e->trace, "step");
    trace_counter(e->trace, "batch_seqs", so.n_seqs);
    struct forward_batch fb;
    trace_begin(e->trace, "prepare_inputs");
    build_batch(e, &so, &fb);
    trace_end(e->trace, "prepare_inputs");
    trace_counter(e->trace, "batch_tokens", fb.n_tokens);
    struct runner_output ro;
    memset(&ro, 0, sizeof ro);
    struct error err = {0};
    trace_begin(e->trace, "execute");
    atomc_status st = e->su.model.execute(e->su.model.ctx, &fb, &ro, &err);
    trace_end(e->trace, "execute");
    int n_seqs = so.n_seqs;
    e->num_steps++;
    if (st != ATOMC_OK) {
        // The batch failed: its sequences fail with the message; the engine keeps serving.
        LOG_ERROR("forward pass failed: %s", err.msg);
        e->drained = grow(e->drained, &e->drained_cap, n_seqs, sizeof *e->drained);
        memcpy(e->drained, so.seqs, (size_t)n_seqs * sizeof *e->drained); // retire compacts so.seqs
        for (int i = 0; i < n_seqs; i++) retire(e, e->drained[i], ATOMC_FINISH_ERROR, 0, NULL, err.msg);
        scheduler_complete_step(e->sched);
        // Blocks registered for this step hold no valid KV: with the batch released they are all
        // cached-but-free, and dropping those keeps them out of every later lookup.
        block_manager_reset_prefix_cache(e->bm);
        refresh_stats(e);
        trace_end(e->trace, "step");
        return n_seqs;
    }
    trace_begin(e->trace, "postprocess");
    scheduler_complete_step(e->sched);
    if (fb.n_prompt_lp) collect_prompt_logprobs(e, &fb, &ro);
    now = time_now_s();
    for (int r = 0; r < fb.n_logits; r++) {
        struct sequence *s = e->b_row_seq[r];
        atomc_token_logprobs lp, *lpp = NULL;
        if (s->params.logprobs >= 0) {
            int k = s->params.logprobs;
            e->o_top = grow(e->o_top, &e->o_top_cap, k + 1, sizeof *e->o_top);
            for (int t = 0; t < k; t++) {
                e->o_top[t].token = ro.top_ids[(size_t)r * ro.top_stride + t];
                e->o_top[t].logprob = ro.top_logprobs[(size_t)r * ro.top_stride + t];
            }
            lp.token = ro.ids[r];
            lp.logprob = ro.logprobs[r];
            lp.n_top = k;
            lp.top = e->o_top;
            lpp = &lp;
        }
        int32_t t = ro.ids[r];
        if (t < 0 || t >= e->su.vocab_size) {
            char msg[128];
            snprintf(msg, sizeof msg, "the model produced an invalid token id %d", t);
            retire(e, s, ATOMC_FINISH_ERROR, 0, NULL, msg);
            continue;
        }
        process_token(e, s, t, lpp, now);
    }
    refresh_stats(e);
    trace_end(e->trace, "postprocess");
    trace_end(e->trace, "step");
    return n_seqs;
}

// --- public API --------------------------------------------------------------------------------

static int resolve(int v, int dflt) { return v > 0 ? v : dflt; }

void engine_resolve_limits(const atomc_engine_options *o, int *max_num_seqs, int *max_num_batched_tokens) {
    bool cuda = o->device && !strcmp(o->device, "cuda");
    *max_num_seqs = resolve(o->max_num_seqs, cuda ? 256 : 16);
    // CUDA: vLLM's defaults on H100 / H200-class GPUs, 16384 for its offline (LLM-class) engines
    // and 8192 for its server; larger prefill chunks keep the grouped MoE GEMMs of a chunk fuller
    // (Qwen3-30B-A3B 1K/1K +1.1%, docs/perf.md session 8).
    *max_num_batched_tokens = resolve(o->max_num_batched_tokens, cuda ? (o->offline ? 16384 : 8192) : 2048);
    if (*max_num_batched_tokens < *max_num_seqs && o->max_num_batched_tokens <= 0)
        *max_num_batched_tokens = *max_num_seqs;
}

atomc_status engine_create_with(const atomc_engine_options *o, struct engine_setup *setup, atomc_engine **out,
                                struct error *err) {
    *out = NULL;
    atomc_engine *e = xcalloc(1, sizeof *e);
    e->su = *setup;
    memset(setup, 0, sizeof *setup); // ownership moved
    e->block_size = o->block_size > 0 ? o->block_size : 16;
    engine_resolve_limits(o, &e->max_num_seqs, &e->max_num_batched_tokens);
    e->max_waiting = o->max_waiting;
    e->seed = o->seed;

    e->max_model_len = e->su.max_model_len;
    atomc_status st = ATOMC_OK;
    if (o->max_model_len < 0) {
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "max_model_len must be positive, got %d", o->max_model_len);
    } else if (o->max_model_len > 0) {
        if (e->max_model_len > 0 && o->max_model_len > e->max_model_len)
            LOG_WARN("max_model_len %d exceeds the model's %d; using it as asked", o->max_model_len,
                     e->max_model_len);
        e->max_model_len = o->max_model_len;
    }
    if (st == ATOMC_OK && e->max_model_len <= 0)
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "the model declares no context length; pass max_model_len");
    if (st == ATOMC_OK && e->su.vocab_size <= 0)
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "the model has no vocabulary");
    if (st == ATOMC_OK && (long)e->su.num_kv_blocks * e->block_size < e->max_model_len)
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                       "The model's max seq len (%d) is larger than the maximum number of tokens that can be stored "
                       "in KV cache (%ld = %d blocks of %d). Try increasing the KV cache size or decreasing "
                       "max_model_len.",
                       e->max_model_len, (long)e->su.num_kv_blocks * e->block_size, e->su.num_kv_blocks,
                       e->block_size);
    if (st == ATOMC_OK && o->profile_dir && *o->profile_dir) {
        if (mkdir(o->profile_dir, 0755) != 0 && errno != EEXIST) {
            st = error_set(err, ATOMC_ERR_IO, "profile directory %s: %s", o->profile_dir, strerror(errno));
        } else {
            e->profile_dir = xstrdup(o->profile_dir);
            e->trace = trace_create(0);
        }
    }
    if (st == ATOMC_OK)
        st = block_manager_create(e->su.num_kv_blocks, e->block_size, o->enable_prefix_caching, &e->bm, err);
    if (st == ATOMC_OK) {
        struct scheduler_config sc = {.max_num_seqs = e->max_num_seqs,
                                      .max_num_batched_tokens = e->max_num_batched_tokens,
                                      .sliding_window = e->su.sliding_window};
        st = scheduler_create(&sc, e->bm, &e->sched, err);
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->done, NULL);
    e->next_id = 1;
    e->su.info.max_model_len = e->max_model_len;
    e->su.info.block_size = e->block_size;
    e->su.info.vocab_size = e->su.vocab_size;
    if (st != ATOMC_OK) {
        atomc_engine_free(e);
        return st;
    }
    refresh_stats(e);
    *out = e;
    return ATOMC_OK;
}

atomc_status atomc_engine_add_request(atomc_engine *e, const atomc_request *r, uint64_t *out_id, char *err_buf,
                                      size_t err_len) {
    struct error err = {0};
    struct sequence *s = NULL;
    atomc_status st = r ? seq_from_request(e, r, &s, &err)
                        : error_set(&err, ATOMC_ERR_INVALID_ARGUMENT, "no request given");
    if (st == ATOMC_OK) {
        pthread_mutex_lock(&e->mu);
        if (e->max_waiting > 0 && e->n_inbox + e->stats.num_waiting >= e->max_waiting) {
            st = error_set(&err, ATOMC_ERR_BUSY, "the engine is overloaded: %d requests are already waiting",
                           e->n_inbox + e->stats.num_waiting);
        } else {
            s->id = e->next_id++;
            e->inbox = grow(e->inbox, &e->inbox_cap, e->n_inbox + 1, sizeof *e->inbox);
            e->inbox[e->n_inbox++] = s;
            live_insert(e, s->id);
            if (out_id) *out_id = s->id;
            pthread_cond_signal(&e->wake);
        }
        pthread_mutex_unlock(&e->mu);
        if (st != ATOMC_OK) seq_free(e, s);
    }
    if (st != ATOMC_OK && err_buf && err_len) snprintf(err_buf, err_len, "%s", err.msg);
    return st;
}

atomc_status atomc_engine_abort(atomc_engine *e, uint64_t id) {
    atomc_status st = ATOMC_OK;
    pthread_mutex_lock(&e->mu);
    if (id == 0 || !live_contains(e, id)) {
        st = ATOMC_ERR_NOT_FOUND;
    } else {
        e->aborts = grow(e->aborts, &e->aborts_cap, e->n_aborts + 1, sizeof *e->aborts);
        e->aborts[e->n_aborts++] = id;
        pthread_cond_signal(&e->wake);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

bool atomc_engine_has_work(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool w = e->n_inbox > 0 || e->n_aborts > 0 || e->sched_seqs > 0;
    pthread_mutex_unlock(&e->mu);
    return w;
}

static void *loop_main(void *arg) {
    atomc_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    while (!e->stop_requested) {
        if (e->n_inbox == 0 && e->n_aborts == 0 && e->sched_seqs == 0) {
            pthread_cond_wait(&e->wake, &e->mu);
            continue;
        }
        pthread_mutex_unlock(&e->mu);
        int n = atomc_engine_step(e);
        pthread_mutex_lock(&e->mu);
        if (n == 0 && e->n_inbox == 0 && e->n_aborts == 0 && !e->stop_requested) {
            // Work exists but nothing could run (cannot happen while max_model_len fits the
            // pool); wait a little rather than spin.
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 1000000;
            if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&e->wake, &e->mu, &ts);
        }
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

atomc_status atomc_engine_start(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    atomc_status st = ATOMC_OK;
    if (!e->thread_on) {
        e->stop_requested = false;
        if (pthread_create(&e->thread, NULL, loop_main, e) != 0) st = ATOMC_ERR_INTERNAL;
        else e->thread_on = true;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void atomc_engine_stop(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool on = e->thread_on;
    e->stop_requested = true;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
    if (on) pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->mu);
    e->thread_on = false;
    e->stop_requested = false;
    pthread_mutex_unlock(&e->mu);
}

void atomc_engine_free(atomc_engine *e) {
    if (!e) return;
    if (e->sched) {
        atomc_engine_stop(e);
        drain_inbox(e);
        while (scheduler_num_running(e->sched) > 0) retire(e, e->sched->running[0], ATOMC_FINISH_ABORT, 0, NULL, NULL);
        while (scheduler_num_waiting(e->sched) > 0)
            retire(e, scheduler_waiting_at(e->sched, 0), ATOMC_FINISH_ABORT, 0, NULL, NULL);
    }
    scheduler_free(e->sched);
    block_manager_free(e->bm);
    if (e->su.model.free) e->su.model.free(e->su.model.ctx);
    if (e->su.text.free) e->su.text.free(e->su.text.ctx);
    for (int i = 0; i < 8; i++) free(e->su.owned_strings[i]);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->done);
    free(e->inbox);
    free(e->aborts);
    free(e->live);
    free(e->b_tokens);
    free(e->b_positions);
    free(e->b_slots);
    free(e->b_qstart);
    free(e->b_ctx);
    free(e->b_logit_rows);
    free(e->b_rows);
    free(e->b_row_seq);
    free(e->b_tables);
    free(e->b_plp_rows);
    free(e->b_plp_targets);
    free(e->b_plp_pos);
    free(e->b_plp_seq);
    free(e->o_top);
    free(e->drained);
    trace_free(e->trace);
    free(e->profile_dir);
    free(e);
}

static void copy_msg(char *buf, size_t len, const char *msg) {
    if (buf && len) snprintf(buf, len, "%s", msg);
}

atomc_status atomc_engine_start_profile(atomc_engine *e, char *err, size_t err_len) {
    if (!e->trace) {
        copy_msg(err, err_len, "profiling is off: start the engine with a profile directory (--profile-dir DIR)");
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    trace_start(e->trace);
    return ATOMC_OK;
}

atomc_status atomc_engine_stop_profile(atomc_engine *e, char *path_out, size_t path_len, char *err_buf,
                                       size_t err_len) {
    if (!e->trace) {
        copy_msg(err_buf, err_len, "profiling is off: start the engine with a profile directory (--profile-dir DIR)");
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    if (!trace_is_enabled(e->trace)) {
        copy_msg(err_buf, err_len, "no profile is running (start one first)");
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    trace_stop(e->trace);
    char path[4096];
    pthread_mutex_lock(&e->mu);
    int n = e->profile_count++;
    pthread_mutex_unlock(&e->mu);
    snprintf(path, sizeof path, "%s/atomc-trace-%d-%d.json", e->profile_dir, (int)getpid(), n);
    struct error err = {0};
    atomc_status st = trace_write_json(e->trace, path, NULL, &err);
    if (st != ATOMC_OK) {
        copy_msg(err_buf, err_len, err.msg);
        return st;
    }
    copy_msg(path_out, path_len, path);
    return ATOMC_OK;
}

void atomc_engine_get_stats(atomc_engine *e, atomc_stats *s) {
    pthread_mutex_lock(&e->mu);
    *s = e->stats;
    s->num_waiting += e->n_inbox;
    pthread_mutex_unlock(&e->mu);
}

void atomc_engine_get_model_info(atomc_engine *e, atomc_model_info *info) { *info = e->su.info; }

atomc_status atomc_engine_tokenize(atomc_engine *e, const char *text, size_t len, bool add_special_tokens,
                                   int32_t **ids, int *n_ids) {
    if (!e->su.text.ctx) return ATOMC_ERR_UNSUPPORTED;
    return e->su.text.encode(e->su.text.ctx, text, len, add_special_tokens, ids, n_ids, NULL);
}

atomc_status atomc_engine_detokenize(atomc_engine *e, const int32_t *ids, int n_ids, bool skip_special_tokens,
                                     char **text) {
    if (!e->su.text.ctx) return ATOMC_ERR_UNSUPPORTED;
    return e->su.text.decode(e->su.text.ctx, ids, n_ids, skip_special_tokens, text, NULL);
}

const char *atomc_engine_token_bytes(atomc_engine *e, int32_t id, size_t *len) {
    *len = 0;
    if (!e->su.text.ctx || !e->su.text.token_bytes || id < 0) return NULL;
    return e->su.text.token_bytes(e->su.text.ctx, id, len);
}

// --- blocking generate ---------------------------------------------------------------------------

struct gen_slot {
    atomc_engine *e;
    atomc_result *res;
    size_t text_len, text_cap;
    int tok_cap;
    bool done;
};

static void gen_on_output(void *user, const atomc_output *o) {
    struct gen_slot *g = user;
    atomc_result *r = g->res;
    if (o->n_new_tokens) {
        if (r->n_tokens + o->n_new_tokens > g->tok_cap) {
            g->tok_cap = (r->n_tokens + o->n_new_tokens) * 2;
            r->tokens = xrealloc(r->tokens, (size_t)g->tok_cap * sizeof *r->tokens);
        }
        memcpy(r->tokens + r->n_tokens, o->new_tokens, (size_t)o->n_new_tokens * sizeof *r->tokens);
        r->n_tokens += o->n_new_tokens;
    }
    if (o->text_len) {
        if (g->text_len + o->text_len + 1 > g->text_cap) {
            g->text_cap = (g->text_len + o->text_len + 1) * 2;
            r->text = xrealloc(r->text, g->text_cap);
        }
        memcpy(r->text + g->text_len, o->text, o->text_len);
        g->text_len += o->text_len;
        r->text[g->text_len] = '\0';
    }
    r->prompt_tokens = o->prompt_tokens;
    r->cached_tokens = o->cached_tokens;
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        r->finish_reason = o->finish_reason;
        if (!r->text) r->text = xstrdup("");
        pthread_mutex_lock(&g->e->mu);
        g->done = true;
        pthread_mutex_unlock(&g->e->mu);
    }
}

static bool gen_all_done(atomc_engine *e, struct gen_slot *g, int n) {
    pthread_mutex_lock(&e->mu);
    bool all = true;
    for (int i = 0; i < n && all; i++) all = g[i].done;
    pthread_mutex_unlock(&e->mu);
    return all;
}

static void gen_wait(atomc_engine *e, struct gen_slot *g, int n) {
    pthread_mutex_lock(&e->mu);
    bool threaded = e->thread_on;
    pthread_mutex_unlock(&e->mu);
    if (threaded) {
        pthread_mutex_lock(&e->mu);
        for (;;) {
            bool all = true;
            for (int i = 0; i < n && all; i++) all = g[i].done;
            if (all) break;
            pthread_cond_wait(&e->done, &e->mu);
        }
        pthread_mutex_unlock(&e->mu);
    } else {
        while (!gen_all_done(e, g, n)) atomc_engine_step(e);
    }
}

atomc_status atomc_engine_generate(atomc_engine *e, const atomc_request *reqs, int n, atomc_result *results,
                                   char *err, size_t err_len) {
    if (n <= 0) return ATOMC_OK;
    struct gen_slot *g = xcalloc((size_t)n, sizeof *g);
    uint64_t *ids = xcalloc((size_t)n, sizeof *ids);
    atomc_status st = ATOMC_OK;
    int added = 0;
    for (int i = 0; i < n; i++) {
        memset(&results[i], 0, sizeof results[i]);
        g[i].e = e;
        g[i].res = &results[i];
        atomc_request r = reqs[i];
        r.on_output = gen_on_output;
        r.user = &g[i];
        char msg[ERROR_MSG_MAX];
        st = atomc_engine_add_request(e, &r, &ids[i], msg, sizeof msg);
        if (st != ATOMC_OK) {
            if (err && err_len) snprintf(err, err_len, "request %d: %s", i, msg);
            break;
        }
        added++;
    }
    if (st != ATOMC_OK)
        for (int i = 0; i < added; i++) atomc_engine_abort(e, ids[i]);
    gen_wait(e, g, added);
    if (st != ATOMC_OK)
        for (int i = 0; i < added; i++) atomc_result_free(&results[i]);
    free(g);
    free(ids);
    return st;
}
