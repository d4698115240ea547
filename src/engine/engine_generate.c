// Offline generation: atomc_engine_generate, blocking, over the public API. Each request's
// outputs are gathered into its atomc_result by a callback; the caller waits on `done` while the
// loop thread runs, or runs the steps itself when it does not.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/error.h"
#include "engine/engine_internal.h"

// --- blocking generate -----------------------------------------------------------------------

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
