// The step (atomc_engine_step) and what it delivers; it runs on the thread that owns the
// scheduler (engine.c says which).
//
// A step: drain the inbox (admit new sequences, finish aborted ones) -> scheduler_schedule
// -> build the forward batch in reusable buffers -> model execute -> scheduler_complete_step
// (KV now computed, full blocks enter the prefix cache) -> for every sampled row: append the
// token, stop rules, incremental detokenization, stop strings, callback; finished sequences
// leave the scheduler (their blocks return to the pool) and are freed.
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "common/trace.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/spec.h"
#include "engine/stop_checker.h"

// --- small helpers ---------------------------------------------------------------------------

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

static void seq_append(struct sequence *s, int32_t t) {
    if (s->n_tokens == s->cap) {
        s->cap *= 2;
        s->tokens = xrealloc(s->tokens, (size_t)s->cap * sizeof *s->tokens);
    }
    s->tokens[s->n_tokens++] = t;
}

// --- outputs ---------------------------------------------------------------------------------

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
    o.kv_transfer_s = s->kv_transfer_s;
    o.kv_fallback = s->kv_fallback;
    if (s->on_output) s->on_output(s->user, &o);
}

// Ends s: out of the scheduler (blocks back to the pool), final output (with its last n_new
// tokens), forgotten, freed.
void engine_retire(atomc_engine *e, struct sequence *s, atomc_finish_reason reason, int n_new,
                   const atomc_token_logprobs *lp, const char *error) {
    bool waiting_for_kv = engine_kv_on_retire(e, s);
    if (s->status != SEQ_STATUS_FINISHED && !waiting_for_kv) scheduler_remove(e->sched, s);
    s->status = SEQ_STATUS_FINISHED;
    s->finish_reason = reason;
    s->t_finish = time_now_s();
    emit(e, s, n_new, lp, error);
    pthread_mutex_lock(&e->mu);
    engine_live_remove(e, s->id);
    pthread_cond_broadcast(&e->done);
    pthread_mutex_unlock(&e->mu);
    e->num_finished++;
    if (reason == ATOMC_FINISH_ABORT) e->num_aborted++;
    engine_seq_free(e, s);
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
    int g = engine_grammar_accept(e, s, t);
    if (g < 0) {
        char msg[160];
        snprintf(msg, sizeof msg, "structured output: the grammar does not allow the sampled token %d", t);
        engine_retire(e, s, ATOMC_FINISH_ERROR, 1, lp, msg);
        return true;
    }
    if (g > 0) stop_tok = true; // the grammar ended on a stop token: ends the request, also under ignore_eos
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
    engine_retire(e, s, reason, 1, lp, NULL);
    return true;
}

// --- the step --------------------------------------------------------------------------------

void engine_refresh_stats(atomc_engine *e) {
    atomc_stats st;
    memset(&st, 0, sizeof st);
    st.num_running = scheduler_num_running(e->sched);
    st.num_waiting = scheduler_num_waiting(e->sched);
    st.num_kv_blocks = e->bm->num_blocks;
    st.num_free_kv_blocks = block_manager_num_free(e->bm);
    st.kv_cache_usage = 1.0 - (double)st.num_free_kv_blocks / e->bm->num_blocks;
    if (e->bm_sw) {
        st.num_kv_blocks_sw = e->bm_sw->num_blocks;
        st.num_free_kv_blocks_sw = block_manager_num_free(e->bm_sw);
    }
    st.peak_kv_blocks_used = e->peak_used;
    st.peak_kv_blocks_used_sw = e->peak_used_sw;
    st.prefix_cache_queries = e->bm->queries;
    st.prefix_cache_hits = e->bm->hits;
    st.prefix_cache_evictions = e->bm->evictions;
    st.num_preemptions = e->sched->num_preemptions;
    st.prompt_tokens_total = e->prompt_tokens_total;
    st.generation_tokens_total = e->generation_tokens_total;
    st.num_steps = e->num_steps;
    st.num_requests_finished = e->num_finished;
    st.num_requests_aborted = e->num_aborted;
    st.num_speculative_tokens = e->spec_k;
    st.spec_num_drafts = e->spec_drafts;
    st.spec_num_draft_tokens = e->spec_draft_tokens;
    st.spec_num_accepted_tokens = e->spec_accepted;
    memcpy(st.spec_accepted_per_pos, e->spec_accepted_pos, sizeof st.spec_accepted_per_pos);
    st.prompt_tokens_computed = e->prompt_tokens_computed;
    engine_kv_fill_stats(e, &st);
    pthread_mutex_lock(&e->mu);
    e->stats = st;
    e->sched_seqs = st.num_running + st.num_waiting + engine_kv_n_work(e);
    pthread_mutex_unlock(&e->mu);
}

// Row j of s's step: the sample a plain decode would draw at output position n_output + j, with
// the drafts before it (tokens[n_tokens .. n_tokens + j)) as its latest outputs (spec.h).
static void fill_sample_row(const atomc_engine *e, const struct sequence *s, int j, struct sample_row *r) {
    const atomc_sampling_params *p = &s->params;
    int n_out = sequence_n_output(s) + j;
    memset(r, 0, sizeof *r);
    r->temperature = p->temperature;
    r->top_p = p->top_p;
    r->min_p = p->min_p;
    r->top_k = p->top_k;
    r->presence_penalty = p->presence_penalty;
    r->frequency_penalty = p->frequency_penalty;
    r->repetition_penalty = p->repetition_penalty;
    r->seed = p->has_seed ? p->seed : mix64(e->seed ^ mix64(s->id));
    r->step = (uint64_t)n_out;
    r->prompt_ids = s->tokens;
    r->n_prompt = s->n_prompt;
    r->output_ids = s->tokens + s->n_prompt;
    r->n_output = n_out;
    r->n_logprobs = p->logprobs > 0 ? p->logprobs : 0;
    if (n_out < p->min_tokens) {
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
        e->b_slots_sw = xrealloc(e->b_slots_sw, (size_t)e->b_tok_cap * sizeof *e->b_slots_sw);
    }
    if (e->b_seq_cap < n_seqs + 1) {
        e->b_seq_cap = n_seqs + 1 < e->max_num_seqs + 1 ? e->max_num_seqs + 1 : n_seqs + 1;
        size_t c = (size_t)e->b_seq_cap;
        e->b_qstart = xrealloc(e->b_qstart, c * sizeof *e->b_qstart);
        e->b_ctx = xrealloc(e->b_ctx, c * sizeof *e->b_ctx);
        e->b_sslots = xrealloc(e->b_sslots, c * sizeof *e->b_sslots);
    }
    int rows_need = 0;
    for (int i = 0; i < n_seqs; i++)
        rows_need += 1 + so->seqs[i]->n_draft;
    if (e->b_row_cap < rows_need) {
        int c = e->max_num_seqs * (1 + e->spec_k);
        e->b_row_cap = c > rows_need ? c : rows_need;
        e->b_logit_rows = xrealloc(e->b_logit_rows, (size_t)e->b_row_cap * sizeof *e->b_logit_rows);
        e->b_rows = xrealloc(e->b_rows, (size_t)e->b_row_cap * sizeof *e->b_rows);
        e->b_row_seq = xrealloc(e->b_row_seq, (size_t)e->b_row_cap * sizeof *e->b_row_seq);
    }
    for (int i = 0; i < n_seqs; i++)
        if (so->seqs[i]->bt.n > max_blocks) max_blocks = so->seqs[i]->bt.n;
    size_t table_need = (size_t)n_seqs * max_blocks;
    if (table_need > e->b_tables_cap) {
        e->b_tables_cap = table_need * 2;
        e->b_tables = xrealloc(e->b_tables, e->b_tables_cap * sizeof *e->b_tables);
        if (e->bm_sw) e->b_tables_sw = xrealloc(e->b_tables_sw, e->b_tables_cap * sizeof *e->b_tables_sw);
    }

    int tok = 0, n_logits = 0, n_plp = 0, plp_k = 0;
    for (int i = 0; i < n_seqs; i++) {
        struct sequence *s = so->seqs[i];
        e->b_qstart[i] = tok;
        if (e->spec_mtp) { // the MTP pass after the step reads these rows' hidden states
            s->in_step = true;
            s->step_pos0 = s->n_computed;
            s->step_row0 = tok;
        }
        for (int p = s->n_computed; p < s->n_computed + s->n_sched; p++) {
            e->b_tokens[tok] = s->tokens[p];
            e->b_positions[tok] = p;
            e->b_slots[tok] = s->bt.ids[p / bs] * bs + p % bs;
            if (e->bm_sw) e->b_slots_sw[tok] = s->bt_sw.ids[p / bs] * bs + p % bs;
            tok++;
        }
        e->b_ctx[i] = s->n_computed + s->n_sched;
        e->b_sslots[i] = s->state_slot;
        int32_t *row = e->b_tables + (size_t)i * max_blocks;
        memcpy(row, s->bt.ids, (size_t)s->bt.n * sizeof *row);
        for (int b = s->bt.n; b < max_blocks; b++) row[b] = 0; // padding, never read
        if (e->bm_sw) { // the sliding group's table: as many entries (its dropped ones keep their ids)
            CHECK(s->bt_sw.n == s->bt.n);
            int32_t *row_sw = e->b_tables_sw + (size_t)i * max_blocks;
            memcpy(row_sw, s->bt_sw.ids, (size_t)s->bt_sw.n * sizeof *row_sw);
            for (int b = s->bt_sw.n; b < max_blocks; b++) row_sw[b] = 0;
        }
        if (s->n_computed + s->n_sched == s->n_tokens + s->n_draft) { // the last known token and the drafts
            for (int j = 0; j <= s->n_draft; j++) {
                e->b_logit_rows[n_logits] = tok - 1 - s->n_draft + j;
                fill_sample_row(e, s, j, &e->b_rows[n_logits]);
                e->b_row_seq[n_logits] = s;
                n_logits++;
            }
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
    fb->block_tables_sw = e->bm_sw ? e->b_tables_sw : NULL;
    fb->slot_mapping_sw = e->bm_sw ? e->b_slots_sw : NULL;
    fb->state_slots = e->su.num_state_slots > 0 ? e->b_sslots : NULL;
    fb->n_logits = n_logits;
    fb->logits_rows = e->b_logit_rows;
    fb->sampling = e->b_rows;
    fb->n_prompt_lp = n_plp;
    fb->prompt_lp_rows = e->b_plp_rows;
    fb->prompt_lp_targets = e->b_plp_targets;
    fb->prompt_lp_k = plp_k;
}

#define NONFINITE_MSG                                                                                                  \
    "the model produced non-finite logits (NaN or +inf) for this request; its weights or numerics are broken"

// Stores this step's prompt logprobs into their sequences. A sequence with a non-finite row is
// marked (prompt_lp_nonfinite) and listed once in e->drained[0 .. return value): the caller fails
// it after the step's rows are delivered, skipping its own rows.
static int collect_prompt_logprobs(atomc_engine *e, const struct forward_batch *fb, const struct runner_output *ro) {
    int n_bad = 0;
    for (int j = 0; j < fb->n_prompt_lp; j++) {
        struct sequence *s = e->b_plp_seq[j];
        if (s->prompt_lp_nonfinite) continue;
        if (isnan(ro->prompt_lp[j])) {
            s->prompt_lp_nonfinite = true;
            e->drained = grow(e->drained, &e->drained_cap, n_bad + 1, sizeof *e->drained);
            e->drained[n_bad++] = s;
            continue;
        }
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
    return n_bad;
}

// Token t for s with row r's logprobs, through the output path (append, stop rules,
// detokenization, callback). Returns true if s finished (then it is freed).
static bool deliver_token(atomc_engine *e, struct sequence *s, const struct runner_output *ro, int r, int32_t t,
                          double now) {
    atomc_token_logprobs lp, *lpp = NULL;
    if (s->params.logprobs >= 0) {
        int k = s->params.logprobs;
        e->o_top = grow(e->o_top, &e->o_top_cap, k + 1, sizeof *e->o_top);
        for (int i = 0; i < k; i++) {
            e->o_top[i].token = ro->top_ids[(size_t)r * ro->top_stride + i];
            e->o_top[i].logprob = ro->top_logprobs[(size_t)r * ro->top_stride + i];
        }
        lp.token = t;
        lp.logprob = ro->logprobs[r];
        lp.n_top = k;
        lp.top = e->o_top;
        lpp = &lp;
    }
    if (t == RUNNER_ID_NONFINITE) {
        engine_retire(e, s, ATOMC_FINISH_ERROR, 0, NULL, NONFINITE_MSG);
        return true;
    }
    if (t < 0 || t >= e->su.vocab_size) {
        char msg[128];
        snprintf(msg, sizeof msg, "the model produced an invalid token id %d", t);
        engine_retire(e, s, ATOMC_FINISH_ERROR, 0, NULL, msg);
        return true;
    }
    return process_token(e, s, t, lpp, now);
}

static bool deliver_row(atomc_engine *e, struct sequence *s, const struct runner_output *ro, int r, double now) {
    return deliver_token(e, s, ro, r, ro->ids[r], now);
}

// BENCHMARK ONLY (spec_force): accepted drafts of a step by a chain of draws with probability
// spec_force each, from (sequence, output position, draft index).
static int forced_accepted_length(const atomc_engine *e, const struct sequence *s, int n_draft) {
    int m = 0;
    uint64_t h = mix64(s->id * 0x9e3779b97f4a7c15ull ^ (uint64_t)sequence_n_output(s));
    while (m < n_draft && (double)(mix64(h + (uint64_t)m) >> 11) * 0x1.0p-53 < e->spec_force)
        m++;
    return m;
}

// Verification of s's drafts (spec.h) from its rows r .. r + n_draft: the accepted tokens and the
// target's next one go through the output path one at a time (a stop among them ends s there);
// the KV of accepted drafts counts as computed; the blocks that only held rejected drafts go
// back to the pool and the verified full blocks enter the prefix cache.
static void verify_drafts(atomc_engine *e, struct sequence *s, const struct runner_output *ro, int r, double now) {
    int n_draft = s->n_draft, n0 = s->n_tokens;
    int32_t draft[ATOMC_MAX_SPEC_TOKENS];
    memcpy(draft, s->tokens + n0, (size_t)n_draft * sizeof *draft);
    int m =
        e->spec_force > 0 ? forced_accepted_length(e, s, n_draft) : spec_accepted_length(draft, n_draft, ro->ids + r);
    e->spec_drafts++;
    e->spec_draft_tokens += (uint64_t)n_draft;
    e->spec_accepted += (uint64_t)m;
    for (int j = 0; j < m; j++)
        e->spec_accepted_pos[j]++;
    if (m > 0)
        s->spec_misses = 0;
    else if (++s->spec_misses >= SPEC_OPT_OUT_MISSES) {
        s->spec_pause = SPEC_OPT_OUT_PAUSE;
        s->spec_misses = 0;
    }
    s->n_draft = 0;
    for (int j = 0; j <= m; j++) {
        if (j > 0) s->n_computed++; // the KV of draft j (== the token just delivered) is in the cache
        int32_t t = j < m ? draft[j] : ro->ids[r + j]; // == ro->ids[r + j] unless forced
        if (deliver_token(e, s, ro, r + j, t, now)) return;
    }
    block_manager_truncate(e->bm, &s->bt, s->n_tokens);
    block_manager_commit(e->bm, &s->bt, s->tokens, s->n_computed);
    if (e->bm_sw) {
        block_manager_truncate(e->bm_sw, &s->bt_sw, s->n_tokens);
        block_manager_commit(e->bm_sw, &s->bt_sw, s->tokens, s->n_computed);
    }
}

// Proposes the drafts of this step's decoding sequences (before scheduling; the scheduler may cut
// them). None when more sequences decode than spec_max_batch (verification would cost more than
// it saves at that batch), for requests that opted out, and for sequences paused by the opt-out
// rule; at most what the sequence may still output minus the target's own token.
static void propose_drafts(atomc_engine *e) {
    struct scheduler *sc = e->sched;
    int n_dec = 0;
    for (int i = 0; i < sc->n_running; i++)
        n_dec += sequence_n_remaining(sc->running[i]) == 1;
    if (n_dec == 0 || n_dec > e->spec_max_batch) return;
    for (int i = 0; i < sc->n_running; i++) {
        struct sequence *s = sc->running[i];
        s->n_draft = 0;
        if (sequence_n_remaining(s) != 1 || s->params.no_speculation) continue;
        if (s->spec_pause > 0) {
            s->spec_pause--;
            continue;
        }
        int k = s->max_output - sequence_n_output(s) - 1;
        if (k > e->spec_k) k = e->spec_k;
        if (k <= 0) continue;
        if (s->n_tokens + k > s->cap) {
            while (s->n_tokens + k > s->cap)
                s->cap *= 2;
            s->tokens = xrealloc(s->tokens, (size_t)s->cap * sizeof *s->tokens);
        }
        if (e->spec_force > 0) { // BENCHMARK ONLY: k drafts always (the last token repeated)
            for (int j = 0; j < k; j++)
                s->tokens[s->n_tokens + j] = s->tokens[s->n_tokens - 1];
            s->n_draft = k;
            continue;
        }
        if (e->spec_mtp) { // made by the last step's MTP pass for this very n_tokens (engine_spec_mtp.c)
            s->n_draft = s->mtp_ready_at == s->n_tokens ? (s->mtp_ready < k ? s->mtp_ready : k) : 0;
            s->mtp_ready = 0;
            continue;
        }
        s->n_draft = spec_ngram_propose(s->tokens, s->n_tokens, e->spec_min, e->spec_max, k, s->tokens + s->n_tokens);
    }
}

int atomc_engine_step(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool foreign = e->thread_on && !pthread_equal(pthread_self(), e->thread);
    pthread_mutex_unlock(&e->mu);
    CHECK_MSG(!foreign, "atomc_engine_step called while the engine's loop thread runs");
    engine_drain_inbox(e);
    engine_kv_poll(e);
    if (e->spec_k > 0) {
        trace_begin(e->trace, "propose");
        propose_drafts(e);
        trace_end(e->trace, "propose");
    }
    double now = time_now_s();
    struct scheduler_output so;
    trace_begin(e->trace, "schedule");
    scheduler_schedule(e->sched, now, &so);
    trace_end(e->trace, "schedule");
    int used = e->bm->num_blocks - block_manager_num_free(e->bm);
    if (used > e->peak_used) e->peak_used = used;
    if (e->bm_sw && (used = e->bm_sw->num_blocks - block_manager_num_free(e->bm_sw)) > e->peak_used_sw)
        e->peak_used_sw = used;
    if (so.n_seqs == 0) {
        engine_refresh_stats(e);
        return 0;
    }
    trace_begin(e->trace, "step");
    trace_counter(e->trace, "batch_seqs", so.n_seqs);
    struct forward_batch fb;
    trace_begin(e->trace, "prepare_inputs");
    build_batch(e, &so, &fb);
    engine_grammar_begin_masks(e, &fb);
    trace_end(e->trace, "prepare_inputs");
    trace_counter(e->trace, "batch_tokens", fb.n_tokens);
    struct runner_output ro;
    memset(&ro, 0, sizeof ro);
    struct error err = {0};
    engine_kv_before_forward(e, &so, &fb);
    trace_begin(e->trace, "execute");
    atomc_status st = e->su.model.execute(e->su.model.ctx, &fb, &ro, &err);
    if (fb.sample_ready) engine_grammar_join(e); // the masks are not touched after the step's rows
    trace_end(e->trace, "execute");
    int n_seqs = so.n_seqs;
    e->num_steps++;
    if (st != ATOMC_OK) {
        // The batch failed: its sequences fail with the message; the engine keeps serving.
        LOG_ERROR("forward pass failed: %s", err.msg);
        engine_kv_after_forward(e, &so, false); // before the retires abort the transfers
        e->drained = grow(e->drained, &e->drained_cap, n_seqs, sizeof *e->drained);
        memcpy(e->drained, so.seqs, (size_t)n_seqs * sizeof *e->drained); // retire compacts so.seqs
        for (int i = 0; i < n_seqs; i++) engine_retire(e, e->drained[i], ATOMC_FINISH_ERROR, 0, NULL, err.msg);
        scheduler_complete_step(e->sched);
        // Blocks registered for this step hold no valid KV: with the batch released they are all
        // cached-but-free, and dropping those keeps them out of every later lookup.
        block_manager_reset_prefix_cache(e->bm);
        if (e->bm_sw) block_manager_reset_prefix_cache(e->bm_sw);
        engine_refresh_stats(e);
        trace_end(e->trace, "step");
        return n_seqs;
    }
    trace_begin(e->trace, "postprocess");
    for (int i = 0; i < n_seqs; i++) {
        const struct sequence *s = so.seqs[i];
        if (s->n_computed < s->n_prompt)
            e->prompt_tokens_computed +=
                (uint64_t)((s->n_computed + s->n_sched < s->n_prompt ? s->n_computed + s->n_sched : s->n_prompt) -
                           s->n_computed);
    }
    engine_kv_after_forward(e, &so, true);
    scheduler_complete_step(e->sched);
    int n_bad = fb.n_prompt_lp ? collect_prompt_logprobs(e, &fb, &ro) : 0;
    now = time_now_s();
    for (int r = 0; r < fb.n_logits;) {
        struct sequence *s = e->b_row_seq[r];
        int n_rows = 1 + s->n_draft;
        if (s->prompt_lp_nonfinite) { // failed below, with the others of collect_prompt_logprobs
        } else if (s->n_draft > 0) {
            verify_drafts(e, s, &ro, r, now);
        } else {
            deliver_row(e, s, &ro, r, now);
        }
        r += n_rows;
    }
    for (int i = 0; i < n_bad; i++)
        engine_retire(e, e->drained[i], ATOMC_FINISH_ERROR, 0, NULL, NONFINITE_MSG);
    if (e->spec_mtp) {
        trace_begin(e->trace, "mtp_draft");
        engine_mtp_after_step(e);
        trace_end(e->trace, "mtp_draft");
    }
    engine_refresh_stats(e);
    trace_end(e->trace, "postprocess");
    trace_end(e->trace, "step");
    return n_seqs;
}
