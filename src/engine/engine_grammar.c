// Structured output in the engine: a grammar matcher per constrained request and the per-row
// token bitmasks the sampler applies (src/grammar/grammar.h; sample_row.allowed).
//
// Life of a constrained request:
// - add_request (caller's thread): engine_grammar_attach compiles (kind, text) through the
//   engine's grammar vocabulary (built on first use from the tokenizer's decoded token bytes;
//   its compile cache is shared by all requests), creates the sequence's matcher and mask
//   buffer and turns speculative drafts off for it (no rollback). Errors are 400s upstream.
// - each step, after the batch is built: engine_grammar_begin_masks hands the constrained rows
//   to a pool of grammar threads (src/grammar/grammar_pool.c; started on demand, up to
//   grammar_pool_size: one per row, at most the pool), which fill the rows' masks from their
//   matchers while the model's forward runs, each thread taking the next unclaimed row from a
//   shared atomic counter. The runner calls engine_grammar_join (forward_batch.sample_ready)
//   before it reads the masks, and the step joins again after execute. The join takes unclaimed
//   rows too before it waits for the claimed ones, so rows the workers have not reached (a
//   loaded machine: the workers not yet scheduled) are filled by the joining thread instead of
//   waited for (with one worker that wait cost more than the fill: SmolLM2 decode lost 35% wall
//   time at the same CPU time per token). A row whose grammar allows every token gets allowed =
//   NULL. Why a pool: one thread filled every row one after another, ~1.2 ms a row on Llama-3's
//   128K vocabulary on an H200 host, so at batch 64 the masks took longer than the GPU's
//   forward (issue 27).
// - sample-then-check (su.sample_check: a backend whose sampler leaves the logits unchanged,
//   model_runner_sample_check_ok: the CPU and CUDA backends): a
//   row that is greedy or a pure temperature draw (no top-k / top-p / min-p; penalties are
//   fine, they commute with the mask) and wants no logprobs gets no mask before the forward.
//   The runner draws it unmasked and calls engine_grammar_check (forward_batch.sample_check)
//   with the ids: a token the matcher accepts is kept (the matcher has advanced); otherwise the
//   mask is filled now and the runner draws the row again under it with the step's second
//   random stream (SAMPLE_REDRAW_STEP). Exact, for the masked distribution q(t) = p(t) / S on
//   the allowed set A, S = sum of p over A: with two independent draws,
//     P(t) = P(first draw = t) + P(first rejected) * q(t) = p(t) + (1 - S) p(t) / S = p(t) / S
//   for t in A, and 0 outside A (the matcher accepts exactly the mask's tokens; a stop token
//   only where the grammar may end, as in the mask). Greedy: the unmasked arg-max, when
//   allowed, is the masked arg-max (ties go to the lowest id in both). Not exact with top-k /
//   top-p / min-p, whose kept set depends on the mask, nor for logprobs (those of the masked
//   row): such rows keep the masks filled during the forward. Why: the mask fill costs about
//   as much as the xgrammar accept of ~10 tokens (SmolLM2, docs/perf.md), most sampled tokens
//   are allowed, and at batch 1 the "overlapped" fill competed with the forward's threads for
//   the same cores. A seeded request gives the same output run to run in either mode, but the
//   two modes (check, or the mask filled first) pick different tokens for the same seed. The
//   rejected rows' fills run on the grammar pool (engine_grammar_check).
// - each sampled token: engine_grammar_accept advances the matcher (or, for a token that
//   engine_grammar_check accepted, only reports); a terminated grammar (it accepted a stop
//   token where it may end) finishes the request with "stop".
// - grammar_start_token (reasoning models): the grammar is inactive, and its rows unmasked,
//   until that token has been generated; the tokens after it are matched.
//
// Threads: matchers and masks of the step's rows are touched by the pool only between
// begin_masks and join, and by the loop thread otherwise; aborts and retirements happen outside
// that window (the inbox is drained before scheduling). Inside the window a row belongs to the
// one thread whose claim on the pool's counter took its index, so each matcher is used by one
// thread at a time. Different rows' matchers filled at once is safe in xgrammar 0.2.8 (read in
// its sources, src/cpp/grammar_matcher.cc and earley_parser.h): a GrammarMatcher keeps all of
// its mutable state in itself (the Earley parser's state history and per-rule flag caches, the
// fill's temporary bitsets); the CompiledGrammar (grammar, adaptive_token_mask_cache, an
// unordered_map only find()-ed) and the TokenizerInfo (sorted vocabulary, trie ranges, token
// character counts, all built in the constructor) it shares with other matchers are only read
// during FillNextTokenBitmask, through shared_ptr copies (atomic reference counts). xgrammar's
// own BatchGrammarMatcher fills different matchers from a thread pool the same way. The shim's
// fill builds its DLTensor on the stack. The vocabulary is created once under `mu` by whichever
// thread adds the first constrained request.
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "engine/engine_internal.h"
#include "engine/sequence.h"
#include "grammar/grammar.h"
#include "grammar/grammar_pool.h"

struct engine_grammar {
    pthread_mutex_t mu;
    struct grammar_vocab *vocab; // NULL until the first constrained request
    int words;                   // bitmask words per row
    // Ids no grammar allows (special or empty tokens, stop ids excepted): the check rejects them
    // without asking xgrammar, which logs a warning for each.
    uint8_t *never;

    // The mask pool (created with the engine, threads started on first use) and the step's
    // rows to fill (job i = batch row job_rows[i]).
    struct grammar_pool *pool;
    int *job_rows;
    int jobs_cap;
    atomc_engine *e;

    // Sample-then-check rows of the step (loop thread only) and the redraw list handed back.
    int *check_rows, n_check, check_cap;
    int32_t *redo;
    int redo_cap;
    uint64_t n_checked, n_redrawn; // counters (engine_grammar_check_counts)
    // Thread CPU seconds in the checks (accepts + the rejected rows' fills) and in the fills
    // before the draw (worker or join; fill_ns is atomic: both may add), logged at shutdown.
    double check_s;
    _Atomic uint64_t fill_ns, n_filled;
    _Atomic uint64_t redo_ns; // the rejected rows' fills (engine_grammar_check; pool threads too)
    bool check_on;            // sample-then-check allowed (default; engine_grammar_set_check)
};

#define GRAMMAR_MAX_THREADS 64

// Pool size: the option, else the cores the forward leaves free
// (online cores minus the CPU backend's threads; on a device backend minus one, the loop thread,
// which launches the forward and then joins and fills too), at least 1. Each step starts
// min(rows, size) of them.
static int grammar_pool_size(const atomc_engine_options *o, int host_threads) {
    int n = o ? o->grammar_threads : 0;
    if (n <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        n = (int)(cores > 0 ? cores : 1) - (host_threads > 0 ? host_threads : 1);
    }
    return n < 1 ? 1 : n > GRAMMAR_MAX_THREADS ? GRAMMAR_MAX_THREADS : n;
}

atomc_status engine_grammar_create(atomc_engine *e, const atomc_engine_options *o) {
    struct engine_grammar *g = xcalloc(1, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    g->e = e;
    g->check_on = true;
    g->pool = grammar_pool_create(grammar_pool_size(o, e->su.host_threads));
    e->grammar = g;
    return ATOMC_OK;
}

void engine_grammar_free(atomc_engine *e) {
    struct engine_grammar *g = e->grammar;
    if (!g) return;
    uint64_t by_pool, by_join;
    int n_threads;
    grammar_pool_counts(g->pool, &by_pool, &by_join, &n_threads);
    grammar_pool_free(g->pool);
    if (n_threads)
        LOG_INFO("structured output: %d mask threads; %llu rows filled by them, %llu by the join", n_threads,
                 (unsigned long long)by_pool, (unsigned long long)by_join);
    if (g->n_checked)
        LOG_INFO("structured output: %llu rows drawn unmasked and checked, %llu (%.1f%%) drawn again under the mask; "
                 "grammar CPU %.1f us a checked row",
                 (unsigned long long)g->n_checked, (unsigned long long)g->n_redrawn,
                 100.0 * (double)g->n_redrawn / (double)g->n_checked,
                 (1e6 * g->check_s + 1e-3 * (double)atomic_load(&g->redo_ns)) / (double)g->n_checked);
    uint64_t nf = atomic_load(&g->n_filled);
    if (nf)
        LOG_INFO("structured output: %llu masks filled before the draw, grammar CPU %.1f us each",
                 (unsigned long long)nf, 1e-3 * (double)atomic_load(&g->fill_ns) / (double)nf);
    grammar_vocab_free(g->vocab);
    pthread_mutex_destroy(&g->mu);
    free(g->job_rows);
    free(g->never);
    free(g->check_rows);
    free(g->redo);
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
                g->never = xcalloc((size_t)V, 1);
                for (int i = 0; i < V; i++)
                    g->never[i] = special[i] || !tok[i] || !len[i];
                for (int i = 0; i < e->su.n_eos; i++)
                    if (e->su.eos_ids[i] >= 0 && e->su.eos_ids[i] < V) g->never[e->su.eos_ids[i]] = 0;
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

// This thread's CPU time in ns.
static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// Fills row's mask from its matcher, adding the thread's CPU time to *ns; whether it restricts.
static bool fill_mask_timed(atomc_engine *e, int row, _Atomic uint64_t *ns) {
    uint64_t t0 = thread_cpu_ns();
    struct sequence *s = e->b_row_seq[row];
    bool restrict_ = grammar_matcher_fill_mask(s->grammar, s->grammar_mask);
    atomic_fetch_add(ns, thread_cpu_ns() - t0);
    return restrict_;
}

static void fill_row(atomc_engine *e, int row) {
    bool restrict_ = fill_mask_timed(e, row, &e->grammar->fill_ns);
    e->b_rows[row].allowed = restrict_ ? e->b_row_seq[row]->grammar_mask : NULL;
    atomic_fetch_add(&e->grammar->n_filled, 1);
}

static void fill_job(void *ctx, int i) {
    atomc_engine *e = ctx;
    fill_row(e, e->grammar->job_rows[i]);
}

// A sample-then-check row the grammar rejected: its mask for the second draw.
static void redo_fill_job(void *ctx, int i) {
    atomc_engine *e = ctx;
    fill_mask_timed(e, e->grammar->job_rows[i], &e->grammar->redo_ns);
}

// Whether drawing row sr without its mask, keeping the token when the grammar accepts it and
// otherwise drawing again under the mask, gives exactly the masked row's distribution (see the
// top comment): greedy, or a pure temperature draw (penalties allowed), and no logprobs.
static bool row_checkable(const struct sample_row *sr, const struct sequence *s, int V) {
    if (sr->n_logprobs > 0 || s->params.logprobs >= 0) return false; // those of the masked row
    if (!(sr->temperature >= 1e-5f)) return true;                    // greedy (cpu_sampler.c's test)
    if (sr->top_k > 0 && sr->top_k < V) return false;
    return !(sr->top_p < 1.0f) && !(sr->min_p > 0.0f);
}

void engine_grammar_begin_masks(atomc_engine *e, struct forward_batch *fb) {
    struct engine_grammar *g = e->grammar;
    if (!g || !g->vocab) return;
    int n = 0;
    g->n_check = 0;
    for (int r = 0; r < fb->n_logits; r++) {
        struct sequence *s = e->b_row_seq[r];
        if (!s->grammar || !s->grammar_active) continue;
        CHECK(s->n_draft == 0);
        s->grammar_checked = false;
        if (e->su.sample_check && g->check_on && row_checkable(&e->b_rows[r], s, e->su.vocab_size)) {
            g->check_rows = grow(g->check_rows, &g->check_cap, g->n_check + 1, sizeof *g->check_rows);
            g->check_rows[g->n_check++] = r;
            e->b_rows[r].allowed = NULL; // drawn unmasked first (engine_grammar_check)
            continue;
        }
        g->job_rows = grow(g->job_rows, &g->jobs_cap, n + 1, sizeof *g->job_rows);
        g->job_rows[n++] = r;
        e->b_rows[r].allowed = s->grammar_mask; // written by the worker before the join returns
    }
    if (g->n_check) {
        fb->sample_check = engine_grammar_check;
        fb->sample_check_ctx = e;
    }
    if (n == 0) return;
    if (!grammar_pool_begin(g->pool, n, fill_job, e)) { // no thread: fill here, before the forward
        for (int i = 0; i < n; i++)
            fill_row(e, g->job_rows[i]);
        return;
    }
    fb->sample_ready = engine_grammar_join;
    fb->sample_ready_ctx = e;
}

void engine_grammar_join(void *ctx) {
    atomc_engine *e = ctx;
    if (e->grammar) grammar_pool_join(e->grammar->pool);
}

int engine_grammar_check(void *ctx, const int32_t *ids, const int32_t **redo) {
    atomc_engine *e = ctx;
    struct engine_grammar *g = e->grammar;
    int n = 0;
    uint64_t t0 = thread_cpu_ns();
    g->redo = grow(g->redo, &g->redo_cap, g->n_check, sizeof *g->redo);
    for (int i = 0; i < g->n_check; i++) {
        int r = g->check_rows[i];
        struct sequence *s = e->b_row_seq[r];
        int32_t t = ids[r];
        g->n_checked++;
        // A non-finite row is drawn again under the mask too: the masked row may be finite.
        if (t >= 0 && t < e->su.vocab_size && !g->never[t] && grammar_matcher_accept(s->grammar, t)) {
            s->grammar_checked = true;
            s->grammar_checked_id = t;
            continue;
        }
        g->redo[n++] = r;
        g->n_redrawn++;
    }
    g->check_s += 1e-9 * (double)(thread_cpu_ns() - t0);
    // The rejected rows' masks, by the pool's threads and this one (the step's own fills were
    // joined before the draw, so the pool is idle; on a GPU host a batch's redraws would
    // otherwise cost one fill after another on the step's critical path).
    g->job_rows = grow(g->job_rows, &g->jobs_cap, n, sizeof *g->job_rows);
    memcpy(g->job_rows, g->redo, sizeof *g->redo * (size_t)n);
    if (n > 1 && grammar_pool_begin(g->pool, n, redo_fill_job, e))
        grammar_pool_join(g->pool);
    else
        for (int i = 0; i < n; i++)
            redo_fill_job(e, i);
    for (int i = 0; i < n; i++) {
        struct sequence *s = e->b_row_seq[g->redo[i]];
        e->b_rows[g->redo[i]].allowed = s->grammar_mask; // restricted: it refused the drawn id
    }
    *redo = g->redo;
    return n;
}

void engine_grammar_check_counts(atomc_engine *e, uint64_t *checked, uint64_t *redrawn) {
    struct engine_grammar *g = e->grammar;
    *checked = g ? g->n_checked : 0;
    *redrawn = g ? g->n_redrawn : 0;
}

void engine_grammar_fill_counts(atomc_engine *e, uint64_t *by_workers, uint64_t *by_join, int *n_workers) {
    struct engine_grammar *g = e->grammar;
    *by_workers = *by_join = 0;
    *n_workers = 0;
    if (g) grammar_pool_counts(g->pool, by_workers, by_join, n_workers);
}

void engine_grammar_set_check(atomc_engine *e, bool on) {
    if (e->grammar) e->grammar->check_on = on;
}

int engine_grammar_accept(atomc_engine *e, struct sequence *s, int32_t t) {
    (void)e;
    if (!s->grammar) return 0;
    if (!s->grammar_active) {
        if (t == s->params.grammar_start_token) s->grammar_active = true;
        return 0;
    }
    if (s->grammar_checked) { // accepted by engine_grammar_check this step
        s->grammar_checked = false;
        CHECK_MSG(t == s->grammar_checked_id, "structured output: token %d delivered, %d checked", t,
                  s->grammar_checked_id);
        return grammar_matcher_is_terminated(s->grammar) ? 1 : 0;
    }
    if (!grammar_matcher_accept(s->grammar, t)) return -1;
    return grammar_matcher_is_terminated(s->grammar) ? 1 : 0;
}
