// Engine CPU overhead per step with a model that costs nothing: scheduling, block
// allocation, forward-batch building, stop checks, callbacks. Tells how much of a GPU decode
// step the engine itself would take. Build and run (from the repo root, after `make`):
//   cc -O2 -Iinclude -Isrc -Itests tools/bench_engine_overhead.c build/libatomc.a \
//      $(pkg-config --libs libxxhash jansson libpcre2-8 libutf8proc openblas) -lm -lpthread -o build/bench_engine_overhead
//   build/bench_engine_overhead [max_num_seqs] [requests] [prompt_len] [output_len]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/timeutil.h"
#include "engine/engine_internal.h"

struct null_model {
    int32_t *ids;
    float *lps;
    int cap;
};

static atomc_status null_execute(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                                 struct error *err) {
    (void)err;
    struct null_model *m = ctx;
    if (fb->n_logits > m->cap) {
        m->cap = fb->n_logits * 2;
        m->ids = realloc(m->ids, (size_t)m->cap * sizeof *m->ids);
        m->lps = realloc(m->lps, (size_t)m->cap * sizeof *m->lps);
    }
    for (int i = 0; i < fb->n_logits; i++) {
        m->ids[i] = 100 + fb->token_ids[fb->logits_rows[i]] % 1000;
        m->lps[i] = -1.0f;
    }
    memset(out, 0, sizeof *out);
    out->ids = m->ids;
    out->logprobs = m->lps;
    return ATOMC_OK;
}

static void null_free(void *ctx) {
    struct null_model *m = ctx;
    free(m->ids);
    free(m->lps);
    free(m);
}

static long long n_outputs;
static void on_out(void *user, const atomc_output *o) {
    (void)user;
    n_outputs += o->n_new_tokens;
}

int main(int argc, char **argv) {
    int max_seqs = argc > 1 ? atoi(argv[1]) : 256, n_req = argc > 2 ? atoi(argv[2]) : 1024;
    int plen = argc > 3 ? atoi(argv[3]) : 128, olen = argc > 4 ? atoi(argv[4]) : 256;
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.device = "cuda"; // GPU-like defaults: budget 8192
    o.max_num_seqs = max_seqs;
    struct engine_setup su;
    memset(&su, 0, sizeof su);
    su.model.ctx = calloc(1, sizeof(struct null_model));
    su.model.execute = null_execute;
    su.model.free = null_free;
    su.num_kv_blocks = (max_seqs * (plen + olen)) / 16 + 64;
    su.vocab_size = 32000;
    su.max_model_len = plen + olen;
    su.eos_ids[0] = 2;
    su.n_eos = 1;
    atomc_engine *e;
    struct error err;
    if (engine_create_with(&o, &su, &e, &err) != ATOMC_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int32_t *prompt = malloc((size_t)plen * sizeof *prompt);
    double t0 = time_now_s();
    for (int i = 0; i < n_req; i++) {
        for (int k = 0; k < plen; k++) prompt[k] = 3 + (i * 131 + k * 7) % 30000;
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = prompt;
        r.n_prompt_ids = plen;
        r.params.max_tokens = olen;
        r.params.ignore_eos = true;
        r.on_output = on_out;
        if (atomc_engine_add_request(e, &r, NULL, NULL, 0) != ATOMC_OK) return 1;
    }
    double t_add = time_now_s() - t0;
    long steps = 0;
    t0 = time_now_s();
    while (atomc_engine_has_work(e)) {
        atomc_engine_step(e);
        steps++;
    }
    double dt = time_now_s() - t0;
    printf("max_num_seqs %d, %d requests x (%d prompt + %d output): %ld steps in %.3f s\n", max_seqs, n_req, plen,
           olen, steps, dt);
    printf("engine overhead: %.1f us/step, %.3f us/output token (add_request %.2f us each)\n", dt / steps * 1e6,
           dt / (double)n_outputs * 1e6, t_add / n_req * 1e6);
    atomc_engine_free(e);
    free(prompt);
    return 0;
}
