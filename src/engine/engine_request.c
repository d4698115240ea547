// Request intake: atomc_engine_add_request, atomc_engine_abort and atomc_engine_has_work
// (include/atomc.h), callable from any thread. A request's sampling parameters are validated and
// its sequence built (and its text prompt tokenized) on the caller's thread; the sequence then
// waits in the inbox, under `mu` with the abort ids and the set of live ids, until the step
// drains it (engine_drain_inbox: new sequences enter the scheduler, aborted ones finish at once).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/error.h"
#include "common/timeutil.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/stop_checker.h"

// --- the live-id set -------------------------------------------------------------------------

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

void engine_live_remove(atomc_engine *e, uint64_t id) {
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

// --- sequences -------------------------------------------------------------------------------

void engine_seq_free(atomc_engine *e, struct sequence *s) {
    if (!s) return;
    if (s->detok && e->su.text.detok_free) e->su.text.detok_free(s->detok);
    engine_grammar_seq_free(s);
    stop_checker_free(&s->stop);
    for (int i = 0; i < s->params.n_stop; i++) free(s->stop_strs[i]);
    free(s->stop_strs);
    free(s->stop_token_ids);
    free(s->min_ban);
    free(s->prompt_lp);
    free(s->prompt_lp_top);
    block_table_free(&s->bt);
    block_table_free(&s->bt_sw);
    free(s->kv_id);
    free(s->kv_remote);
    free(s->tokens);
    free(s);
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
    block_table_init(&s->bt_sw);
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
    atomc_status gst = engine_grammar_attach(e, s, err);
    if (gst != ATOMC_OK) {
        engine_seq_free(e, s);
        return gst;
    }
    s->t_arrival = time_now_s();
    if ((st = engine_kv_request(e, s, r, err)) != ATOMC_OK) {
        engine_seq_free(e, s);
        return st;
    }
    *out = s;
    return ATOMC_OK;
}

// --- the inbox -------------------------------------------------------------------------------

static struct sequence *find_seq(atomc_engine *e, uint64_t id) {
    struct scheduler *sc = e->sched;
    for (int i = 0; i < sc->n_running; i++)
        if (sc->running[i]->id == id) return sc->running[i];
    for (int i = 0; i < sc->n_waiting; i++) {
        struct sequence *s = scheduler_waiting_at(sc, i);
        if (s->id == id) return s;
    }
    return engine_kv_find(e, id);
}

void engine_drain_inbox(atomc_engine *e) {
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
        if (!engine_kv_admit(e, e->drained[i])) scheduler_add(e->sched, e->drained[i]);
        e->prompt_tokens_total += (uint64_t)e->drained[i]->n_prompt;
    }
    for (int i = 0; i < n_ab; i++) {
        struct sequence *s = find_seq(e, ab[i]);
        if (s) engine_retire(e, s, ATOMC_FINISH_ABORT, 0, NULL, NULL);
    }
    if (ab != ab_local) free(ab);
}

// --- public API ------------------------------------------------------------------------------

atomc_status atomc_engine_add_request(atomc_engine *e, const atomc_request *r, uint64_t *out_id, char *err_buf,
                                      size_t err_len) {
    struct error err = {0};
    struct sequence *s = NULL;
    atomc_status st = r ? seq_from_request(e, r, &s, &err)
                        : error_set(&err, ATOMC_ERR_INVALID_ARGUMENT, "no request given");
    if (st == ATOMC_OK) {
        pthread_mutex_lock(&e->mu);
        // max_waiting bounds the requests waiting beyond what the engine can take now (its free
        // running slots), not every request not yet scheduled (issue 28 item 7).
        int free_slots = e->max_num_seqs - e->stats.num_running;
        int beyond = e->n_inbox + e->stats.num_waiting - (free_slots > 0 ? free_slots : 0);
        if (e->max_waiting > 0 && beyond >= e->max_waiting) {
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
        if (st != ATOMC_OK) engine_seq_free(e, s);
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
