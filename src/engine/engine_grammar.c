// Structured output in the engine: a grammar matcher per constrained request and the per-row
// token bitmasks the sampler applies (src/grammar/grammar.h; sample_row.allowed).
//
// Life of a constrained request:
// - add_request (caller's thread): engine_grammar_attach compiles (kind, text) through the
//   engine's grammar vocabulary (built on first use from the tokenizer's decoded token bytes;
//   its compile cache is shared by all requests), creates the sequence's matcher and mask
//   buffer and turns speculative drafts off for it (no rollback). Errors are 400s upstream.
// - each step, after the batch is built: engine_grammar_begin_masks hands every constrained row
//   to the grammar worker thread, which fills the rows' masks from their matchers while the
//   model's forward runs; the runner calls engine_grammar_join (forward_batch.sample_ready)
//   before it reads the masks, and the step joins again after execute (fake models never call
//   the hook). A join that finds the batch not yet started fills the masks itself instead of
//   sleeping until the worker is scheduled (on a loaded machine that wait cost more than the
//   fill: SmolLM2 decode lost 35% wall time at the same CPU time per token). A row whose
//   grammar allows every token gets allowed = NULL.
// - each sampled token: engine_grammar_accept advances the matcher; a terminated grammar (it
//   accepted a stop token where it may end) finishes the request with "stop".
// - grammar_start_token (reasoning models): the grammar is inactive, and its rows unmasked,
//   until that token has been generated; the tokens after it are matched.
//
// Threads: matchers and masks of the step's rows are touched by the worker only between
// begin_masks and join, and by the loop thread otherwise; aborts and retirements happen outside
// that window (the inbox is drained before scheduling). The vocabulary is created once under
// `mu` by whichever thread adds the first constrained request.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "engine/engine_internal.h"
#include "engine/sequence.h"
#include "grammar/grammar.h"

struct engine_grammar {
    pthread_mutex_t mu;
    struct grammar_vocab *vocab; // NULL until the first constrained request
    int words;                   // bitmask words per row

    // The mask worker (started with the first constrained step).
    pthread_t thread;
    bool thread_on, stop;
    pthread_cond_t cv_job, cv_done;
    int *job_rows; // rows of the step's batch to fill
    int n_jobs, jobs_cap;
    bool pending; // jobs handed over and not yet finished
    bool started; // the worker took them (else the join fills them itself)
    atomc_engine *e;
};

atomc_status engine_grammar_create(atomc_engine *e) {
    struct engine_grammar *g = xcalloc(1, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv_job, NULL);
    pthread_cond_init(&g->cv_done, NULL);
    g->e = e;
    e->grammar = g;
    return ATOMC_OK;
}

void engine_grammar_free(atomc_engine *e) {
    struct engine_grammar *g = e->grammar;
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    bool on = g->thread_on;
    g->stop = true;
    pthread_cond_broadcast(&g->cv_job);
    pthread_mutex_unlock(&g->mu);
    if (on) pthread_join(g->thread, NULL);
    grammar_vocab_free(g->vocab);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv_job);
    pthread_cond_destroy(&g->cv_done);
    free(g->job_rows);
    free(g);
    e->grammar = NULL;
}

// The vocabulary, created on first use (under g->mu).
static atomc_status grammar_vocab_get(atomc_engine *e, struct grammar_vocab **out, struct error *err) {
    struct engine_grammar *g = e->grammar;
    pthread_mutex_lock(&g->mu);
    atomc_status st = ATOMC_OK;
    if (!g->vocab) {
        const struct engine_text_ops *t = &e->su.text;
        if (!t->ctx || !t->token_bytes) {
            st = error_set(err, ATOMC_ERR_UNSUPPORTED, "structured output needs a tokenizer, and this engine has none");
        } else {
            int V = e->su.vocab_size;
            const char **tok = xcalloc((size_t)V, sizeof *tok);
            size_t *len = xcalloc((size_t)V, sizeof *len);
            bool *special = xcalloc((size_t)V, sizeof *special);
            for (int i = 0; i < V; i++) {
                tok[i] = t->token_bytes(t->ctx, i, &len[i]);
                special[i] = t->is_special && t->is_special(t->ctx, i);
            }
            double t0 = time_now_s();
            st = grammar_vocab_create(tok, len, special, V, V, e->su.eos_ids, e->su.n_eos, NULL, &g->vocab, err);
            if (st == ATOMC_OK) {
                g->words = grammar_bitmask_words(V);
                LOG_INFO("structured output: grammar vocabulary of %d tokens ready in %.2f s", V, time_now_s() - t0);
            }
            free(tok);
            free(len);
            free(special);
        }
    }
    *out = g->vocab;
    pthread_mutex_unlock(&g->mu);
    return st;
}

atomc_status engine_grammar_attach(atomc_engine *e, struct sequence *s, struct error *err) {
    const atomc_sampling_params *p = &s->params;
    if (p->grammar_kind == ATOMC_GRAMMAR_NONE) return ATOMC_OK;
    if (p->grammar_kind < ATOMC_GRAMMAR_NONE || p->grammar_kind > ATOMC_GRAMMAR_STRUCTURAL_TAG)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown grammar kind %d", (int)p->grammar_kind);
    if (p->grammar_kind != ATOMC_GRAMMAR_JSON_OBJECT && !p->grammar)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "structured output: no grammar text given");
    if (p->grammar_start_token < -1 || p->grammar_start_token >= e->su.vocab_size)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "grammar_start_token %d is out of vocabulary (size %d)",
                         p->grammar_start_token, e->su.vocab_size);
    struct grammar_vocab *v;
    atomc_status st = grammar_vocab_get(e, &v, err);
    if (st != ATOMC_OK) return st;
    size_t len = p->grammar ? (p->grammar_len ? p->grammar_len : strlen(p->grammar)) : 0;
    struct grammar_compiled *c;
    st = grammar_compile(v, (enum grammar_kind)p->grammar_kind, p->grammar, len, &c, err);
    if (st != ATOMC_OK) return st;
    st = grammar_matcher_create(c, 0, &s->grammar, err);
    grammar_compiled_release(c);
    if (st != ATOMC_OK) return st;
    s->grammar_mask = xmalloc((size_t)e->grammar->words * sizeof *s->grammar_mask);
    s->grammar_active = p->grammar_start_token < 0;
    s->params.no_speculation = true; // drafts would need matcher rollback
    s->params.grammar = NULL;        // not kept: the compiled grammar is
    return ATOMC_OK;
}

void engine_grammar_seq_free(struct sequence *s) {
    grammar_matcher_free(s->grammar);
    free(s->grammar_mask);
    s->grammar = NULL;
    s->grammar_mask = NULL;
}

static void fill_row(atomc_engine *e, int row) {
    struct sequence *s = e->b_row_seq[row];
    bool restrict_ = grammar_matcher_fill_mask(s->grammar, s->grammar_mask);
    e->b_rows[row].allowed = restrict_ ? s->grammar_mask : NULL;
}

static void *grammar_worker(void *arg) {
    struct engine_grammar *g = arg;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while (!g->stop && !g->pending)
            pthread_cond_wait(&g->cv_job, &g->mu);
        if (g->stop) break;
        if (g->started) { // the join took this batch itself
            pthread_cond_wait(&g->cv_job, &g->mu);
            continue;
        }
        g->started = true;
        int n = g->n_jobs;
        pthread_mutex_unlock(&g->mu);
        for (int i = 0; i < n; i++)
            fill_row(g->e, g->job_rows[i]);
        pthread_mutex_lock(&g->mu);
        g->pending = false;
        pthread_cond_broadcast(&g->cv_done);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

void engine_grammar_begin_masks(atomc_engine *e, struct forward_batch *fb) {
    struct engine_grammar *g = e->grammar;
    if (!g || !g->vocab) return;
    int n = 0;
    for (int r = 0; r < fb->n_logits; r++) {
        struct sequence *s = e->b_row_seq[r];
        if (!s->grammar || !s->grammar_active) continue;
        CHECK(s->n_draft == 0);
        g->job_rows = grow(g->job_rows, &g->jobs_cap, n + 1, sizeof *g->job_rows);
        g->job_rows[n++] = r;
        e->b_rows[r].allowed = s->grammar_mask; // written by the worker before the join returns
    }
    if (n == 0) return;
    pthread_mutex_lock(&g->mu);
    if (!g->thread_on) {
        if (pthread_create(&g->thread, NULL, grammar_worker, g) == 0) {
            g->thread_on = true;
        } else { // no thread: fill here, before the forward
            pthread_mutex_unlock(&g->mu);
            LOG_WARN("structured output: cannot start the mask thread; masks are computed before the forward");
            for (int i = 0; i < n; i++)
                fill_row(e, g->job_rows[i]);
            return;
        }
    }
    g->n_jobs = n;
    g->pending = true;
    g->started = false;
    pthread_cond_signal(&g->cv_job);
    pthread_mutex_unlock(&g->mu);
    fb->sample_ready = engine_grammar_join;
    fb->sample_ready_ctx = e;
}

void engine_grammar_join(void *ctx) {
    atomc_engine *e = ctx;
    struct engine_grammar *g = e->grammar;
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    if (g->pending && !g->started) {
        // The worker has not been scheduled yet (a loaded machine): fill the masks here rather
        // than sleep until it runs. It skips a batch it finds started.
        g->started = true;
        pthread_mutex_unlock(&g->mu);
        for (int i = 0; i < g->n_jobs; i++)
            fill_row(e, g->job_rows[i]);
        pthread_mutex_lock(&g->mu);
        g->pending = false;
    }
    while (g->pending)
        pthread_cond_wait(&g->cv_done, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

int engine_grammar_accept(atomc_engine *e, struct sequence *s, int32_t t) {
    (void)e;
    if (!s->grammar) return 0;
    if (!s->grammar_active) {
        if (t == s->params.grammar_start_token) s->grammar_active = true;
        return 0;
    }
    if (!grammar_matcher_accept(s->grammar, t)) return -1;
    return grammar_matcher_is_terminated(s->grammar) ? 1 : 0;
}
