// Speculative decoding with ngram (prompt lookup) drafts on a copy-heavy workload: acceptance and
// decode speed, with and without drafts, side by side in one run (docs/perf.md):
//
//   make bench && build/bench/spec_ngram_bench MODEL [k=4] [threads=1] [max_tokens=128] [batches=1,4,8,16]
//       [copy|free] [cpu|cuda]
//
// "free" swaps the workload for open questions, where few drafts are accepted: the cost side of
// the large-batch fall-back rule.
//
// Speeds are given twice: wall-clock tokens/s, and process CPU time per token, which a shared
// machine disturbs much less (with threads = 1 it is the single-core cost of a token).
//
// Workload: chat requests (SmolLM2's chat template written out, its default system prompt
// included) that ask to repeat or lightly edit a paragraph given in the prompt, greedy, up to
// max_tokens or EOS. Batch 1: each prompt alone, plain twice then with drafts
// twice (the better of each pair: a shared machine only slows runs down);
// decode speed = (tokens - 1) / (last token time - first token time), so prefill is excluded.
// Then each batch size B: B requests at once (the prompts cycled), plain then with drafts
// (speculative_disable_by_batch_size -1, so drafts run at every B), decode tokens/s of the whole
// batch: the basis of the large-batch fall-back rule. Outputs with drafts must equal the plain
// ones (greedy): the count of identical outputs is printed.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "atomc.h"
#include "common/timeutil.h"

static const char *TEXTS[] = {
    "Repeat the following paragraph exactly, word for word.\n\nThe old lighthouse stood at the edge of the cliff, "
    "its white paint peeling in long strips. Every night the keeper climbed the ninety-nine steps to light the "
    "lamp, and every morning he climbed them again to put it out. Ships passed far below, and none of them ever "
    "knew his name.",
    "Copy this list back to me, unchanged:\n1. Preheat the oven to 200 degrees.\n2. Mix the flour, the sugar and "
    "the butter in a large bowl.\n3. Add two eggs and stir until smooth.\n4. Pour the batter into the tin and bake "
    "for twenty-five minutes.\n5. Let the cake cool before cutting it.",
    "Rewrite this sentence replacing 'cat' with 'dog', keeping everything else the same: The cat sat on the "
    "warm windowsill, watching the rain fall on the garden, while the cat's owner read a book by the fire and the "
    "cat slowly fell asleep.",
    "Quote the following code exactly:\nint add(int a, int b) {\n    return a + b;\n}\n\nint mul(int a, int b) {\n"
    "    return a * b;\n}\n\nint main(void) {\n    return add(2, mul(3, 4));\n}",
};
static const char *FREE_TEXTS[] = {
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a birthday party in the park.",
    "What are the main differences between a violin and a cello?",
};
#define N_TEXTS 4

struct run_out {
    int32_t toks[1024];
    int n;
    double t_first, t_last; // wall clock of the first and last token
    double c_first, c_last; // process CPU time at those callbacks
    bool done;
};

static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void on_out(void *user, const atomc_output *o) {
    struct run_out *r = user;
    for (int i = 0; i < o->n_new_tokens && r->n < 1024; i++)
        r->toks[r->n++] = o->new_tokens[i];
    double c = cpu_now();
    if (o->first_token_time && !r->t_first) {
        r->t_first = o->first_token_time;
        r->c_first = c;
    }
    r->t_last = o->last_token_time;
    r->c_last = c;
    if (o->finish_reason != ATOMC_FINISH_NONE) r->done = true;
}

static atomc_engine *make(const char *model, const char *device, int k, int threads) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = model;
    o.device = device;
    o.max_model_len = 1024;
    o.num_threads = threads;
    o.max_num_seqs = 32;
    if (k) {
        o.speculative_method = "ngram";
        o.num_speculative_tokens = k;
        o.prompt_lookup_min = 2;
        o.prompt_lookup_max = 4;
        o.speculative_disable_by_batch_size = -1;
    }
    atomc_engine *e;
    char err[512];
    if (atomc_engine_create(&o, &e, err, sizeof err) != ATOMC_OK) {
        fprintf(stderr, "engine: %s\n", err);
        exit(1);
    }
    return e;
}

static int32_t *prompt_ids[N_TEXTS];
static int n_prompt_ids[N_TEXTS];

// Runs B requests at once (prompt (first + i) % N_TEXTS); returns the wall time from the first request's
// first token to the last token of all.
static double run(atomc_engine *e, int first, int B, int max_tokens, struct run_out *outs) {
    for (int i = 0; i < B; i++) {
        memset(&outs[i], 0, sizeof outs[i]);
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = prompt_ids[(first + i) % N_TEXTS];
        r.n_prompt_ids = n_prompt_ids[(first + i) % N_TEXTS];
        r.params.temperature = 0;
        r.params.max_tokens = max_tokens;
        r.on_output = on_out;
        r.user = &outs[i];
        char err[256];
        if (atomc_engine_add_request(e, &r, NULL, err, sizeof err) != ATOMC_OK) {
            fprintf(stderr, "request: %s\n", err);
            exit(1);
        }
    }
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
    double t0 = 1e30, t1 = 0;
    for (int i = 0; i < B; i++) {
        if (outs[i].t_first < t0) t0 = outs[i].t_first;
        if (outs[i].t_last > t1) t1 = outs[i].t_last;
    }
    return t1 - t0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr,
                "usage: %s MODEL [k=4] [threads=1] [max_tokens=128] [batches=1,4,8,16] [copy|free] [cpu|cuda]\n",
                argv[0]);
        return 2;
    }
    const char *model = argv[1];
    int k = argc > 2 ? atoi(argv[2]) : 4, threads = argc > 3 ? atoi(argv[3]) : 1;
    int max_tokens = argc > 4 ? atoi(argv[4]) : 128;
    const char *batches = argc > 5 ? argv[5] : "1,4,8,16";
    bool free_text = argc > 6 && !strcmp(argv[6], "free");
    const char **texts = free_text ? FREE_TEXTS : TEXTS;
    const char *device = argc > 7 ? argv[7] : "cpu";
    atomc_engine *plain = make(model, device, 0, threads), *spec = make(model, device, k, threads);
    for (int i = 0; i < N_TEXTS; i++) {
        char buf[2048];
        snprintf(buf, sizeof buf,
                 "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                 "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n",
                 texts[i]);
        if (atomc_engine_tokenize(plain, buf, strlen(buf), false, &prompt_ids[i], &n_prompt_ids[i]) != ATOMC_OK) {
            fprintf(stderr, "tokenize failed\n");
            return 1;
        }
    }
    static struct run_out a[32], b[32];
    printf("SmolLM2 %s workload, greedy,", free_text ? "free-text (few drafts accepted)" : "copy-heavy");
    printf(" %d output tokens per request, ngram k=%d (lookup 2..4)\n", max_tokens, k);
    printf("wall: decode tokens/s (best of 2); cpu: process CPU ms per decoded token (best of 2)\n");
    printf("%-6s %6s %6s %11s %11s %8s %9s %9s %8s %9s %9s %9s\n", "prompt", "tokens", "output", "plain tok/s",
           "ngram tok/s", "wall x", "plain ms", "ngram ms", "cpu x", "accepted", "mean acc.", "identical");
    double sum_plain = 0, sum_spec = 0;
    atomc_stats s0, s1;
    for (int i = 0; i < N_TEXTS; i++) {
        double tp = 0, ts = 0, cp = 1e30, cs = 1e30;
        atomc_engine_get_stats(spec, &s0);
        for (int rep = 0; rep < 2; rep++) { // the better of two runs each: a shared machine only slows runs
            run(plain, i, 1, max_tokens, &a[0]);
            double w = (a[0].n - 1) / (a[0].t_last - a[0].t_first), c = (a[0].c_last - a[0].c_first) / (a[0].n - 1);
            tp = w > tp ? w : tp;
            cp = c < cp ? c : cp;
            run(spec, i, 1, max_tokens, &b[0]);
            w = (b[0].n - 1) / (b[0].t_last - b[0].t_first);
            c = (b[0].c_last - b[0].c_first) / (b[0].n - 1);
            ts = w > ts ? w : ts;
            cs = c < cs ? c : cs;
        }
        atomc_engine_get_stats(spec, &s1);
        uint64_t dr = s1.spec_num_drafts - s0.spec_num_drafts, dt = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens;
        uint64_t ac = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens;
        bool same = a[0].n == b[0].n && !memcmp(a[0].toks, b[0].toks, (size_t)a[0].n * sizeof(int32_t));
        printf("%-6d %6d %6d %11.2f %11.2f %7.2fx %9.2f %9.2f %7.2fx %8.1f%% %9.2f %9s\n", i, n_prompt_ids[i], a[0].n,
               tp, ts, ts / tp, 1e3 * cp, 1e3 * cs, cp / cs, dt ? 100.0 * ac / dt : 0.0,
               dr ? 1.0 + (double)ac / dr : 1.0, same ? "yes" : "NO");
        sum_plain += cp;
        sum_spec += cs;
    }
    printf("mean CPU time per decoded token: plain %.2f ms, ngram %.2f ms: %.2fx\n\n", 1e3 * sum_plain / N_TEXTS,
           1e3 * sum_spec / N_TEXTS, sum_plain / sum_spec);
    printf("batches: output tokens/s over the batch (wall), process CPU ms per output token (prefill included)\n");
    printf("%-6s %14s %14s %9s %9s %9s %9s %9s %9s\n", "batch", "plain tok/s", "ngram tok/s", "wall x", "plain ms",
           "ngram ms", "cpu x", "accepted", "identical");
    for (const char *p = batches; *p;) {
        int B = atoi(p);
        if (B < 1 || B > 32) break;
        atomc_engine_get_stats(spec, &s0);
        double c0 = cpu_now();
        double t_plain = run(plain, 0, B, max_tokens, a);
        double c1 = cpu_now();
        double t_spec = run(spec, 0, B, max_tokens, b);
        double cpu_a = c1 - c0, cpu_b = cpu_now() - c1; // (includes the batch's prefill, the same in both)
        atomc_engine_get_stats(spec, &s1);
        int same = 0, tok_a = 0, tok_b = 0;
        for (int i = 0; i < B; i++) {
            same += a[i].n == b[i].n && !memcmp(a[i].toks, b[i].toks, (size_t)a[i].n * sizeof(int32_t));
            tok_a += a[i].n;
            tok_b += b[i].n;
        }
        uint64_t dt = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens;
        uint64_t ac = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens;
        double ra = tok_a / t_plain, rb = tok_b / t_spec;
        printf("%-6d %14.2f %14.2f %8.2fx %9.2f %9.2f %8.2fx %8.1f%% %6d/%d\n", B, ra, rb, rb / ra, 1e3 * cpu_a / tok_a,
               1e3 * cpu_b / tok_b, (cpu_a / tok_a) / (cpu_b / tok_b), dt ? 100.0 * ac / dt : 0.0, same, B);
        while (*p && *p != ',')
            p++;
        if (*p == ',') p++;
    }
    for (int i = 0; i < N_TEXTS; i++)
        atomc_free(prompt_ids[i]);
    atomc_engine_free(plain);
    atomc_engine_free(spec);
    return 0;
}
