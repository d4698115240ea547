#include "bench/bench_dataset.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "tokenizer/tokenizer.h"

uint64_t bench_rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double bench_rng_uniform(uint64_t *s) { return (double)(bench_rng_next(s) >> 11) * 0x1.0p-53; }

static double rng_normal(uint64_t *s) {
    double u1 = bench_rng_uniform(s), u2 = bench_rng_uniform(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

double bench_rng_gamma(uint64_t *s, double shape, double scale) {
    if (shape < 1.0) {
        double u = bench_rng_uniform(s);
        return bench_rng_gamma(s, shape + 1.0, scale) * pow(u > 0 ? u : 1e-300, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = rng_normal(s), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = bench_rng_uniform(s);
        if (u < 1.0 - 0.0331 * x * x * x * x || log(u) < 0.5 * x * x + d * (1.0 - v + log(v))) return d * v * scale;
    }
}

static int rand_len(uint64_t *rng, int len, double ratio) {
    int lo = (int)floor(len * (1.0 - ratio)), hi = (int)ceil(len * (1.0 + ratio));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return lo + (int)(bench_rng_next(rng) % (uint64_t)(hi - lo + 1));
}

static void fill_ids(uint64_t *rng, int32_t *ids, int n, const struct bench_dataset_options *o) {
    uint64_t span = (uint64_t)(o->vocab_size - o->first_id);
    for (int i = 0; i < n; i++) ids[i] = o->first_id + (int32_t)(bench_rng_next(rng) % span);
}

static atomc_status build_random(const struct bench_dataset_options *o, struct bench_dataset *d, uint64_t *rng) {
    int32_t *prefix = xmalloc(sizeof(int32_t) * (size_t)(o->prefix_len + 1));
    fill_ids(rng, prefix, o->prefix_len, o);
    for (int i = 0; i < d->n; i++) {
        struct bench_request *r = &d->reqs[i];
        int in = rand_len(rng, o->input_len, o->range_ratio);
        r->output_len = rand_len(rng, o->output_len, o->range_ratio);
        r->n_ids = o->prefix_len + in;
        r->ids = xmalloc(sizeof(int32_t) * (size_t)r->n_ids);
        memcpy(r->ids, prefix, sizeof(int32_t) * (size_t)o->prefix_len);
        fill_ids(rng, r->ids + o->prefix_len, in, o);
        r->prompt_len = r->n_ids;
    }
    free(prefix);
    return ATOMC_OK;
}

static atomc_status build_prefix_repetition(const struct bench_dataset_options *o, struct bench_dataset *d,
                                            uint64_t *rng, struct error *err) {
    if (o->num_prefixes < 1) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--prefix-repetition-num-prefixes must be >= 1");
    int np = o->num_prefixes, plen = o->prefix_len;
    int32_t *prefixes = xmalloc(sizeof(int32_t) * (size_t)np * (size_t)(plen + 1));
    fill_ids(rng, prefixes, np * plen, o);
    for (int i = 0; i < d->n; i++) {
        struct bench_request *r = &d->reqs[i];
        int p = (int)(bench_rng_next(rng) % (uint64_t)np);
        r->n_ids = plen + o->suffix_len;
        r->ids = xmalloc(sizeof(int32_t) * (size_t)(r->n_ids + 1));
        memcpy(r->ids, prefixes + (size_t)p * plen, sizeof(int32_t) * (size_t)plen);
        fill_ids(rng, r->ids + plen, o->suffix_len, o);
        r->prompt_len = r->n_ids;
        r->output_len = o->output_len;
    }
    free(prefixes);
    return ATOMC_OK;
}

// ShareGPT: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}, ...]
static atomc_status build_sharegpt(const struct bench_dataset_options *o, struct bench_dataset *d, uint64_t *rng,
                                   struct error *err) {
    if (!o->path) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--dataset-name sharegpt needs --dataset-path");
    json_error_t je;
    json_t *root = json_load_file(o->path, 0, &je);
    if (!root) return error_set(err, ATOMC_ERR_FORMAT, "%s:%d: %s", o->path, je.line, je.text);
    if (!json_is_array(root)) {
        json_decref(root);
        return error_set(err, ATOMC_ERR_FORMAT, "%s: expected a JSON array of conversations", o->path);
    }
    size_t total = json_array_size(root);
    // Shuffle indices deterministically, take conversations with a human turn then a gpt turn.
    size_t *order = xmalloc(sizeof(size_t) * (total + 1));
    for (size_t i = 0; i < total; i++) order[i] = i;
    for (size_t i = total; i > 1; i--) {
        size_t j = bench_rng_next(rng) % i;
        size_t t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    int got = 0;
    for (size_t k = 0; k < total && got < d->n; k++) {
        json_t *conv = json_object_get(json_array_get(root, order[k]), "conversations");
        if (!json_is_array(conv) || json_array_size(conv) < 2) continue;
        const char *q = json_string_value(json_object_get(json_array_get(conv, 0), "value"));
        const char *a = json_string_value(json_object_get(json_array_get(conv, 1), "value"));
        if (!q || !a || strlen(q) < 4) continue;
        struct bench_request *r = &d->reqs[got++];
        r->text = xstrdup(q);
        r->prompt_len = (int)(strlen(q) / 4) + 1;
        r->output_len = o->sharegpt_output_len > 0 ? o->sharegpt_output_len : (int)(strlen(a) / 4) + 1;
    }
    free(order);
    json_decref(root);
    if (got < d->n)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: only %d usable conversations, %d requested", o->path, got, d->n);
    return ATOMC_OK;
}

// Replaces token-id prompts by their text (special tokens skipped, so the server tokenizes
// ordinary text); the token count stays the id count (an estimate once re-tokenized).
static atomc_status ids_to_text(const struct tokenizer *tok, struct bench_dataset *d, struct error *err) {
    for (int i = 0; i < d->n; i++) {
        struct bench_request *r = &d->reqs[i];
        if (!r->ids) continue;
        char *text = NULL;
        atomc_status st = tokenizer_decode(tok, r->ids, r->n_ids, true, &text, err);
        if (st != ATOMC_OK) return st;
        free(r->ids);
        r->ids = NULL;
        r->text = text;
    }
    return ATOMC_OK;
}

atomc_status bench_dataset_build(const struct bench_dataset_options *o, struct bench_dataset *d, struct error *err) {
    memset(d, 0, sizeof *d);
    if (o->num_prompts < 1) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--num-prompts must be >= 1");
    if (o->vocab_size <= o->first_id)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "vocabulary size %d too small", o->vocab_size);
    struct tokenizer *tok = NULL;
    struct bench_dataset_options oo = *o;
    if (o->tokenizer) {
        atomc_status ts = tokenizer_load(o->tokenizer, &tok, err);
        if (ts != ATOMC_OK) return ts;
        oo.vocab_size = tokenizer_vocab_size(tok);
        o = &oo;
    }
    uint64_t rng = o->seed ^ 0x5eed5eedull;
    d->n = o->num_prompts;
    d->reqs = xcalloc((size_t)d->n, sizeof *d->reqs);
    atomc_status st;
    if (!strcmp(o->name, "random")) {
        if (o->input_len < 1 || o->output_len < 1)
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--random-input-len and --random-output-len must be >= 1");
        else st = build_random(o, d, &rng);
    } else if (!strcmp(o->name, "prefix_repetition")) {
        st = build_prefix_repetition(o, d, &rng, err);
    } else if (!strcmp(o->name, "sharegpt")) {
        st = build_sharegpt(o, d, &rng, err);
    } else {
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                       "unknown --dataset-name '%s' (expected random, sharegpt or prefix_repetition)", o->name);
    }
    if (st == ATOMC_OK && tok) st = ids_to_text(tok, d, err);
    tokenizer_free(tok);
    if (st != ATOMC_OK) bench_dataset_free(d);
    return st;
}

void bench_dataset_free(struct bench_dataset *d) {
    for (int i = 0; i < d->n && d->reqs; i++) {
        free(d->reqs[i].ids);
        free(d->reqs[i].text);
    }
    free(d->reqs);
    memset(d, 0, sizeof *d);
}
