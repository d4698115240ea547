// Structured output: the cost of one step's grammar work per constrained request (fill the
// next-token bitmask + accept the token) for a JSON schema, over a tokenizer's vocabulary:
//
//   make bench && build/bench/grammar_mask_bench TOKENIZER_DIR [walks=20] [SCHEMA_JSON] [max_tokens_per_walk]
//
// Walks the schema with random allowed tokens (EOS as soon as allowed) and reports the compile
// time, the mean fill_mask and accept times per token, and the share of steps that needed a mask.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/timeutil.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

static const char *SCHEMA =
    "{\"type\": \"object\", \"properties\": {"
    "\"name\": {\"type\": \"string\", \"maxLength\": 20},"
    "\"age\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 120},"
    "\"tags\": {\"type\": \"array\", \"items\": {\"type\": \"string\", \"maxLength\": 8}, \"maxItems\": 4},"
    "\"address\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"},"
    "\"zip\": {\"type\": \"string\", \"pattern\": \"^[0-9]{5}$\"}}, \"required\": [\"city\", \"zip\"]}},"
    "\"required\": [\"name\", \"age\", \"tags\", \"address\"]}";

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TOKENIZER_DIR [walks]\n", argv[0]);
        return 2;
    }
    int walks = argc > 2 ? atoi(argv[2]) : 20;
    const char *schema = argc > 3 ? argv[3] : SCHEMA;
    long max_walk = argc > 4 ? atol(argv[4]) : 1000000;
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
