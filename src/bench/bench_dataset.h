// Benchmark workloads for `atomc bench serve`: each request is a prompt (token ids or text)
// plus the number of output tokens to ask for. Workloads follow vLLM's benchmark names:
//   random             uniform random token ids, lengths in [len*(1-r), len*(1+r)]
//   sharegpt           first human turn of each conversation of a ShareGPT JSON file
//   prefix_repetition  N shared prefixes, each request = one prefix + a random suffix
#ifndef ATOMC_BENCH_DATASET_H
#define ATOMC_BENCH_DATASET_H

#include <stdint.h>

#include "common/error.h"

struct bench_request {
    int32_t *ids;  // prompt as token ids (NULL when text is used)
    int n_ids;
    char *text;    // prompt as text (NULL when ids are used)
    int prompt_len; // tokens (estimated as bytes/4 for text without a tokenizer)
    int output_len;
};

struct bench_dataset {
    struct bench_request *reqs;
    int n;
};

struct bench_dataset_options {
    const char *name;        // "random" | "sharegpt" | "prefix_repetition"
    const char *path;        // sharegpt file
    int num_prompts;
    int input_len, output_len;
    double range_ratio;
    int prefix_len;          // random: a shared prefix of this many tokens before each prompt
    int vocab_size;          // ids drawn from [first_id, vocab_size)
    int first_id;
    int num_prefixes, suffix_len; // prefix_repetition (prefix length = prefix_len)
    int sharegpt_output_len; // fixed output length for sharegpt (0 = estimate from the answer)
    uint64_t seed;
    const char *tokenizer;   // optional (model dir, tokenizer.json or GGUF): token-id prompts are
                             // sent as text (their decoding, as vLLM does), ids drawn from its vocab
};

atomc_status bench_dataset_build(const struct bench_dataset_options *o, struct bench_dataset *d, struct error *err);
void bench_dataset_free(struct bench_dataset *d);

// Deterministic 64-bit generator (splitmix64) and helpers shared by the benchmark.
uint64_t bench_rng_next(uint64_t *state);
double bench_rng_uniform(uint64_t *state); // [0, 1)
// Gamma(shape, scale) draw (Marsaglia-Tsang), for bursty Poisson-like arrivals.
double bench_rng_gamma(uint64_t *state, double shape, double scale);

#endif
