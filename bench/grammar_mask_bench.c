// Structured output: the cost of one step's grammar work per constrained request (fill the
// next-token bitmask + accept the token) for a JSON schema, over a tokenizer's vocabulary:
//
//   make bench && build/bench/grammar_mask_bench TOKENIZER_DIR [walks=20] [SCHEMA_JSON] [max_tokens_per_walk]
//
// Walks the schema with random allowed tokens (EOS as soon as allowed) and reports the compile
// time, the mean fill_mask and accept times per token, and the share of steps that needed a mask.
//
//   build/bench/grammar_mask_bench TOKENIZER_DIR --pool ROWS [THREADS=1,2,4] [STEPS=100] [SCHEMA_JSON]
//
// A decode step's mask work for ROWS constrained rows (each its own random walk over the schema,
// restarted when it ends): the wall time of filling all ROWS masks on one thread, then through
// the engine's grammar pool (src/grammar/grammar_pool.c) with each THREADS count, begin then
// join at once from the main thread (which takes unclaimed rows too, as the engine's join
// does: up to THREADS + 1 fillers). Every configuration replays the same walks; a checksum of
// every mask must be equal across them.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/timeutil.h"
#include "grammar/grammar.h"
#include "grammar/grammar_pool.h"
#include "tokenizer/tokenizer.h"

static const char *SCHEMA =
    "{\"type\": \"object\", \"properties\": {"
    "\"name\": {\"type\": \"string\", \"maxLength\": 20},"
    "\"age\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 120},"
    "\"tags\": {\"type\": \"array\", \"items\": {\"type\": \"string\", \"maxLength\": 8}, \"maxItems\": 4},"
    "\"address\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"},"
    "\"zip\": {\"type\": \"string\", \"pattern\": \"^[0-9]{5}$\"}}, \"required\": [\"city\", \"zip\"]}},"
    "\"required\": [\"name\", \"age\", \"tags\", \"address\"]}";

struct pool_bench {
    struct grammar_matcher **m; // (rows)
    uint32_t **mask;            // (rows, words)
};

static void pool_fill(void *ctx, int i) {
    struct pool_bench *b = ctx;
    grammar_matcher_fill_mask(b->m[i], b->mask[i]);
}

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    return h ^ (h >> 33);
}

// Random allowed token of mask (EOS as soon as allowed).
static int32_t pick_allowed(const uint32_t *mask, int V, int32_t eos, uint64_t *rng) {
    if ((mask[eos >> 5] >> (eos & 31)) & 1u) return eos;
    int n = 0;
    for (int i = 0; i < V; i++)
        n += (mask[i >> 5] >> (i & 31)) & 1u;
    *rng ^= *rng << 13, *rng ^= *rng >> 7, *rng ^= *rng << 17;
    int k = (int)(*rng % (uint64_t)(n ? n : 1));
    for (int i = 0; i < V; i++)
        if (((mask[i >> 5] >> (i & 31)) & 1u) && k-- == 0) return i;
    return eos;
}

static double process_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// threads 0 = serial on this thread. Returns mean wall ms per step (fills only), *cpu_ms the
// process CPU ms per step over the fills; *sum = checksum of every mask.
static double pool_run(struct grammar_compiled *g, int V, int32_t eos, int rows, int threads, int steps, uint64_t *sum,
                       double *cpu_ms) {
    struct error err = {0};
    int words = grammar_bitmask_words(V);
    struct pool_bench b = {calloc((size_t)rows, sizeof *b.m), calloc((size_t)rows, sizeof *b.mask)};
    uint64_t *rng = calloc((size_t)rows, sizeof *rng);
    for (int r = 0; r < rows; r++) {
        grammar_matcher_create(g, 0, &b.m[r], &err);
        b.mask[r] = malloc((size_t)words * 4);
        rng[r] = 88172645463325252ull + 7919ull * (uint64_t)r;
    }
    struct grammar_pool *p = threads > 0 ? grammar_pool_create(threads) : NULL;
    double t = 0, cpu = 0;
    *sum = 0;
    for (int s = 0; s < steps; s++) {
        double a = time_now_s(), ca = process_cpu_s();
        if (p && grammar_pool_begin(p, rows, pool_fill, &b)) {
            grammar_pool_join(p);
        } else {
            for (int r = 0; r < rows; r++)
                pool_fill(&b, r);
        }
        if (s > 0) { // the first step starts the threads
            t += time_now_s() - a;
            cpu += process_cpu_s() - ca;
        }
        for (int r = 0; r < rows; r++) {
            for (int w = 0; w < words; w++)
                *sum = mix(*sum, b.mask[r][w]);
            grammar_matcher_accept(b.m[r], pick_allowed(b.mask[r], V, eos, &rng[r]));
            if (grammar_matcher_is_terminated(b.m[r])) { // a new document on this row
                grammar_matcher_free(b.m[r]);
                grammar_matcher_create(g, 0, &b.m[r], &err);
            }
        }
    }
    grammar_pool_free(p);
    for (int r = 0; r < rows; r++) {
        grammar_matcher_free(b.m[r]);
        free(b.mask[r]);
    }
    free(b.m);
    free(b.mask);
    free(rng);
    *cpu_ms = cpu / (steps - 1) * 1e3;
    return t / (steps - 1) * 1e3;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr,
                "usage: %s TOKENIZER_DIR [walks] [SCHEMA_JSON] [max_tokens_per_walk]\n"
                "       %s TOKENIZER_DIR --pool ROWS [THREADS=1,2,4] [STEPS=100] [SCHEMA_JSON]\n",
                argv[0], argv[0]);
        return 2;
    }
    bool pool = argc > 2 && !strcmp(argv[2], "--pool");
    int walks = argc > 2 && !pool ? atoi(argv[2]) : 20;
    const char *schema = argc > 3 && !pool ? argv[3] : SCHEMA;
    long max_walk = argc > 4 && !pool ? atol(argv[4]) : 1000000;
    int rows = pool && argc > 3 ? atoi(argv[3]) : 16;
    const char *thread_list = pool && argc > 4 ? argv[4] : "1,2,4";
    int pool_steps = pool && argc > 5 ? atoi(argv[5]) : 100;
    if (pool && argc > 6) schema = argv[6];
    if (rows < 1 || pool_steps < 2) {
        fprintf(stderr, "--pool: ROWS >= 1 and STEPS >= 2\n");
        return 2;
    }
    struct tokenizer *t = NULL;
    struct error err = {0};
    if (tokenizer_load(argv[1], &t, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int V = tokenizer_vocab_size(t);
    const char **toks = calloc((size_t)V, sizeof *toks);
    size_t *lens = calloc((size_t)V, sizeof *lens);
    bool *special = calloc((size_t)V, sizeof *special);
    for (int i = 0; i < V; i++) {
        toks[i] = tokenizer_token_bytes(t, i, &lens[i]);
        special[i] = tokenizer_is_special(t, i);
    }
    int32_t eos = tokenizer_eos_id(t);
    struct grammar_vocab *v = NULL;
    double t0 = time_now_s();
    if (grammar_vocab_create(toks, lens, special, V, V, &eos, 1, NULL, &v, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double t1 = time_now_s();
    struct grammar_compiled *g = NULL;
    if (grammar_compile(v, GRAMMAR_JSON_SCHEMA, schema, strlen(schema), &g, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double t2 = time_now_s();
    if (pool) {
        printf("vocab %d: compile %.1f ms; %d rows, %d steps (each row its own random walk)\n", V, (t2 - t1) * 1e3,
               rows, pool_steps);
        uint64_t ref = 0;
        double cpu;
        double serial = pool_run(g, V, eos, rows, 0, pool_steps, &ref, &cpu);
        printf("  one thread, serial: %8.2f ms a step (%.1f us a row), CPU %.2f ms\n", serial, serial * 1e3 / rows,
               cpu);
        const char *c = thread_list;
        int bad = 0;
        while (*c) {
            int th = atoi(c);
            if (th >= 1) {
                uint64_t sum = 0;
                double ms = pool_run(g, V, eos, rows, th, pool_steps, &sum, &cpu);
                printf("  pool of %2d (+ join): %8.2f ms a step, %.2fx the serial fill, CPU %.2f ms; masks %s\n", th,
                       ms, serial / ms, cpu, sum == ref ? "equal" : "DIFFER");
                bad += sum != ref;
            }
            c += strcspn(c, ",");
            c += *c == ',';
        }
        grammar_compiled_release(g);
        grammar_vocab_free(v);
        tokenizer_free(t);
        free(toks);
        free(lens);
        free(special);
        return bad ? 1 : 0;
    }
    int words = grammar_bitmask_words(V);
    uint32_t *mask = malloc((size_t)words * 4);
    uint64_t rng = 88172645463325252ull;
    double fill = 0, acc = 0;
    long steps = 0, masked = 0;
    for (int w = 0; w < walks; w++) {
        struct grammar_matcher *m = NULL;
        grammar_matcher_create(g, 0, &m, &err);
        long w0 = steps;
        while (!grammar_matcher_is_terminated(m) && steps - w0 < max_walk) {
            double a = time_now_s();
            masked += grammar_matcher_fill_mask(m, mask);
            double b = time_now_s();
            int pick = -1;
            if ((mask[eos >> 5] >> (eos & 31)) & 1u) {
                pick = eos;
            } else {
                int n = 0;
                for (int i = 0; i < V; i++)
                    n += (mask[i >> 5] >> (i & 31)) & 1u;
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                int k = (int)(rng % (uint64_t)n);
                for (int i = 0; i < V && pick < 0; i++)
                    if (((mask[i >> 5] >> (i & 31)) & 1u) && k-- == 0) pick = i;
            }
            double c = time_now_s();
            grammar_matcher_accept(m, pick);
            acc += time_now_s() - c;
            fill += b - a;
            steps++;
        }
        grammar_matcher_free(m);
    }
    printf("vocab %d: vocabulary %.1f ms, compile %.1f ms; %ld tokens over %d walks: fill_mask %.1f us, accept %.1f "
           "us per token; %.0f%% of steps masked\n",
           V, (t1 - t0) * 1e3, (t2 - t1) * 1e3, steps, walks, fill / steps * 1e6, acc / steps * 1e6,
           100.0 * masked / steps);
    grammar_compiled_release(g);
    grammar_vocab_free(v);
    tokenizer_free(t);
    free(mask);
    free(toks);
    free(lens);
    free(special);
    return 0;
}
