// The engine end to end on the CPU backend with the tiny random-weight models of
// tests/fixtures/models (HF transformers references from tools/make_tiny_models.py):
// greedy continuations through atomc_engine equal HF's where the top-2 margin is clear;
// a batch run on a KV pool small enough to force preemption, with chunked prefill and shared
// prefixes, gives every request the same tokens (and logprobs) as running it alone; a
// prefix-cache hit gives the same tokens and logprobs as a cold run.
#include <jansson.h>
#include <stdlib.h>

#include "atomc.h"
#include "common/check.h"
#include "test.h"

struct out {
    int32_t toks[256];
    float lp[256], margin[256];
    int n, cached, preempted;
    atomc_finish_reason reason;
    char error[256];
};

static void on_out(void *user, const atomc_output *o) {
    struct out *c = user;
    for (int i = 0; i < o->n_new_tokens && c->n < 256; i++) {
        c->toks[c->n] = o->new_tokens[i];
        if (o->logprobs) {
            c->lp[c->n] = o->logprobs[i].logprob;
            c->margin[c->n] = o->logprobs[i].n_top >= 2 ? o->logprobs[i].top[0].logprob - o->logprobs[i].top[1].logprob
                                                        : 1e9f;
        }
        c->n++;
    }
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        c->reason = o->finish_reason;
        c->cached = o->cached_tokens;
        c->preempted = o->num_preemptions;
        snprintf(c->error, sizeof c->error, "%s", o->error ? o->error : "");
    }
}

static json_t *load_refs(const char *model) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s/refs.json", model);
    json_error_t je;
    json_t *j = json_load_file(test_fixture(rel), 0, &je);
    CHECK_MSG(j, "%s: %s", test_fixture(rel), je.text);
    return j;
}

static atomc_engine *make(const char *model, int block_size, int num_blocks, int max_len, int max_seqs, int budget,
                          bool cache) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", model);
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    char path[1024];
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    o.model_path = path;
    o.block_size = block_size;
    o.num_kv_blocks = num_blocks;
    o.max_model_len = max_len;
    o.max_num_seqs = max_seqs;
    o.max_num_batched_tokens = budget;
    o.enable_prefix_caching = cache;
    o.num_threads = 2;
    atomc_engine *e = NULL;
    char err[1024];
    CHECK_MSG(atomc_engine_create(&o, &e, err, sizeof err) == ATOMC_OK, "%s", err);
    return e;
}

static void add(atomc_engine *e, const int32_t *ids, int n, int max_tokens, struct out *c) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = ids;
    r.n_prompt_ids = n;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.logprobs = 2;
    r.on_output = on_out;
    memset(c, 0, sizeof *c);
    r.user = c;
    char err[512];
    CHECK_MSG(atomc_engine_add_request(e, &r, NULL, err, sizeof err) == ATOMC_OK, "%s", err);
}

static void run(atomc_engine *e) {
    while (atomc_engine_has_work(e)) atomc_engine_step(e);
}

static int json_ids(json_t *a, int32_t *out, int max) {
    int n = 0;
    for (size_t i = 0; i < json_array_size(a) && n < max; i++) out[n++] = (int32_t)json_integer_value(json_array_get(a, i));
    return n;
}

// Tokens of b must equal a's until a position where a's top-2 margin is below tol (a near tie
// that float noise may flip); returns the number of positions compared, or -1 on mismatch.
static int compare(const struct out *a, const struct out *b, float tol) {
    int n = a->n < b->n ? a->n : b->n;
    for (int k = 0; k < n; k++) {
        if (a->toks[k] != b->toks[k]) return -1;
        if (a->margin[k] < tol) return k + 1;
    }
    return n;
}

static const char *MODELS[] = {"llama_gqa", "llama_mha", "llama_tied", "llama_bias", "llama_rope_llama3",
                               "llama_rope_linear", "qwen3"};

TEST(engine_model_greedy_matches_hf) {
    for (size_t m = 0; m < sizeof MODELS / sizeof MODELS[0]; m++) {
        json_t *refs = load_refs(MODELS[m]);
        json_t *prompts = json_object_get(refs, "prompts");
        atomc_engine *e = make(MODELS[m], 16, 128, 0, 8, 64, true);
        static struct out outs[16];
        int32_t ids[16][256];
        int n_ids[16], n_p = (int)json_array_size(prompts);
        CHECK(n_p <= 16);
        for (int i = 0; i < n_p; i++) {
            json_t *p = json_array_get(prompts, (size_t)i);
            n_ids[i] = json_ids(json_object_get(p, "ids"), ids[i], 256);
            add(e, ids[i], n_ids[i], (int)json_array_size(json_object_get(p, "greedy")), &outs[i]);
        }
        run(e); // all prompts in one continuous batch (budget 64: chunked)
        for (int i = 0; i < n_p; i++) {
            json_t *p = json_array_get(prompts, (size_t)i);
            json_t *g = json_object_get(p, "greedy"), *mg = json_object_get(p, "greedy_margins");
            ASSERT_EQ(outs[i].reason, ATOMC_FINISH_LENGTH);
            for (size_t k = 0; k < json_array_size(g); k++) {
                if (outs[i].toks[k] != json_integer_value(json_array_get(g, k))) {
                    test_fail(__FILE__, __LINE__, "%s prompt %d token %zu: %d != HF %lld", MODELS[m], i, k,
                              outs[i].toks[k], json_integer_value(json_array_get(g, k)));
                    break;
                }
                if (json_real_value(json_array_get(mg, k)) < 1e-3) break; // near tie: later tokens may differ
            }
        }
        atomc_engine_free(e);
        json_decref(refs);
        if (test_failed_now()) return;
    }
}

TEST(engine_model_batched_under_preemption_equals_alone) {
    json_t *refs = load_refs("llama_gqa");
    json_t *prompts = json_object_get(refs, "prompts");
    // Prompts: the fixture's, plus variants sharing their prefixes (prefix-cache hits).
    enum { MAXP = 24 };
    int32_t ids[MAXP][128];
    int n_ids[MAXP], n_p = 0;
    for (size_t i = 0; i < json_array_size(prompts) && n_p < MAXP; i++) {
        json_t *p = json_array_get(prompts, i);
        int n = json_ids(json_object_get(p, "ids"), ids[n_p], 100);
        n_ids[n_p++] = n;
        for (int v = 1; v <= 3 && n >= 6; v++) { // same first n-v tokens, new tail
            memcpy(ids[n_p], ids[n_p - v], (size_t)n * sizeof(int32_t));
            int keep = n - v;
            for (int t = keep; t < keep + 5; t++) ids[n_p][t] = (int32_t)((t * 37 + v * 11) % 200 + 3);
            n_ids[n_p++] = keep + 5;
            if (n_p == MAXP) break;
        }
    }
    const int max_tokens = 20;
    // Batched: 24 blocks of 4 tokens (96 slots) for many sequences of up to ~60 tokens; budget 16.
    atomc_engine *e = make("llama_gqa", 4, 24, 96, 8, 16, true);
    static struct out batched[MAXP], alone[MAXP];
    for (int i = 0; i < n_p; i++) add(e, ids[i], n_ids[i], max_tokens, &batched[i]);
    run(e);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    fprintf(stderr, "  %d prompts: %llu steps, %llu preemptions, prefix hits %llu of %llu tokens\n", n_p,
            (unsigned long long)st.num_steps, (unsigned long long)st.num_preemptions,
            (unsigned long long)st.prefix_cache_hits, (unsigned long long)st.prefix_cache_queries);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(st.prefix_cache_hits > 0);
    ASSERT_EQ(st.num_free_kv_blocks, 24);
    atomc_engine_free(e);
    // Alone: a roomy engine, one request at a time, no prefix cache.
    e = make("llama_gqa", 16, 64, 256, 1, 256, false);
    for (int i = 0; i < n_p; i++) {
        add(e, ids[i], n_ids[i], max_tokens, &alone[i]);
        run(e);
    }
    atomc_engine_free(e);
    int compared = 0;
    for (int i = 0; i < n_p; i++) {
        ASSERT_EQ(batched[i].reason, ATOMC_FINISH_LENGTH);
        ASSERT_EQ(batched[i].n, max_tokens);
        int k = compare(&alone[i], &batched[i], 1e-4f);
        if (k < 0) {
            test_fail(__FILE__, __LINE__, "prompt %d (%d tokens, preempted %d times): batched output differs", i,
                      n_ids[i], batched[i].preempted);
            return;
        }
        for (int t = 0; t < k; t++) ASSERT_NEAR(batched[i].lp[t], alone[i].lp[t], 1e-3);
        compared += k;
    }
    ASSERT_TRUE(compared > n_p * max_tokens / 2);
    json_decref(refs);
}

TEST(engine_model_prefix_hit_identical_to_cold) {
    atomc_engine *e = make("qwen3", 16, 64, 0, 4, 256, true);
    int32_t ids[45];
    for (int i = 0; i < 45; i++) ids[i] = (int32_t)((i * 29 + 7) % 250 + 3);
    struct out cold, warm;
    add(e, ids, 45, 16, &cold);
    run(e);
    add(e, ids, 45, 16, &warm);
    run(e);
    ASSERT_EQ(cold.cached, 0);
    ASSERT_EQ(warm.cached, 32);
    ASSERT_EQ(warm.n, cold.n);
    for (int k = 0; k < cold.n; k++) {
        ASSERT_EQ(warm.toks[k], cold.toks[k]);
        ASSERT_NEAR(warm.lp[k], cold.lp[k], 1e-4);
    }
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.prefix_cache_hits, 32);
    ASSERT_EQ(st.prefix_cache_queries, 90);
    // Same-step sharing: two new identical prompts submitted together; the second reads the
    // first's blocks as they are written in the same forward pass.
    int32_t ids2[40];
    for (int i = 0; i < 40; i++) ids2[i] = (int32_t)((i * 53 + 11) % 250 + 3);
    struct out x, y;
    add(e, ids2, 40, 16, &x);
    add(e, ids2, 40, 16, &y);
    run(e);
    ASSERT_EQ(x.cached, 0);
    ASSERT_EQ(y.cached, 32);
    for (int k = 0; k < x.n; k++) {
        ASSERT_EQ(y.toks[k], x.toks[k]);
        ASSERT_NEAR(y.lp[k], x.lp[k], 1e-4);
    }
    atomc_engine_free(e);
}

// The randomized stress on the real CPU backend: random arrivals (shared prefixes,
// exact repeats), lengths and aborts over ~3000 steps on a pool that forces preemption; at the
// end every block is free and every finished request equals the prompt decoded alone.
struct sreq {
    int32_t ids[48];
    int n, max_tokens;
    uint64_t id;
    bool aborted;
    struct out o;
};

static uint64_t srng = 0x5eed1234ull;
static uint32_t srnd(uint32_t n) {
    srng ^= srng << 13;
    srng ^= srng >> 7;
    srng ^= srng << 17;
    return (uint32_t)(srng % n);
}

TEST(engine_model_random_stress_equals_alone) {
    enum { MAXR = 800 };
    static struct sreq r[MAXR];
    memset(r, 0, sizeof r);
    int n_r = 0;
    int32_t shared[3][32];
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 32; i++) shared[s][i] = (int32_t)(srnd(250) + 3);
    atomc_engine *e = make("llama_gqa", 4, 32, 96, 6, 16, true);
    for (int step = 0; step < 3000; step++) {
        if (srnd(100) < 18 && n_r < MAXR) {
            struct sreq *q = &r[n_r];
            if (n_r && srnd(5) == 0) {
                const struct sreq *old = &r[srnd((uint32_t)n_r)];
                memcpy(q->ids, old->ids, sizeof q->ids);
                q->n = old->n;
            } else {
                int pre = srnd(3) ? (int)srnd(33) : 0, suf = 1 + (int)srnd(12);
                const int32_t *b = shared[srnd(3)];
                for (int i = 0; i < pre; i++) q->ids[i] = b[i];
                for (int i = 0; i < suf; i++) q->ids[pre + i] = (int32_t)(srnd(250) + 3);
                q->n = pre + suf;
            }
            q->max_tokens = 1 + (int)srnd(30);
            atomc_request rq;
            atomc_request_init(&rq);
            rq.prompt_ids = q->ids;
            rq.n_prompt_ids = q->n;
            rq.params.temperature = 0;
            rq.params.max_tokens = q->max_tokens;
            rq.params.ignore_eos = true;
            rq.params.logprobs = 2;
            rq.on_output = on_out;
            rq.user = &q->o;
            char err[256];
            CHECK_MSG(atomc_engine_add_request(e, &rq, &q->id, err, sizeof err) == ATOMC_OK, "%s", err);
            n_r++;
        }
        if (n_r && srnd(100) < 4) { // abort a live request (waiting, mid-prefill or decoding)
            for (int tries = 0; tries < 8; tries++) {
                struct sreq *q = &r[n_r - 1 - (int)srnd((uint32_t)(n_r < 12 ? n_r : 12))];
                if (!q->o.reason && !q->aborted && atomc_engine_abort(e, q->id) == ATOMC_OK) {
                    q->aborted = true;
                    break;
                }
            }
        }
        atomc_engine_step(e);
    }
    run(e);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    fprintf(stderr, "  %d requests, %llu steps, %llu preemptions, %llu aborted, prefix hit rate %.1f%%\n", n_r,
            (unsigned long long)st.num_steps, (unsigned long long)st.num_preemptions,
            (unsigned long long)st.num_requests_aborted,
            st.prefix_cache_queries ? 100.0 * st.prefix_cache_hits / st.prefix_cache_queries : 0.0);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(st.num_steps >= 2000);
    atomc_engine_free(e);
    e = make("llama_gqa", 16, 16, 256, 1, 256, false);
    int checked = 0;
    for (int i = 0; i < n_r; i++) {
        if (r[i].o.reason == ATOMC_FINISH_ABORT) {
            ASSERT_TRUE(r[i].aborted);
            continue;
        }
        ASSERT_EQ(r[i].o.reason, ATOMC_FINISH_LENGTH);
        ASSERT_EQ(r[i].o.n, r[i].max_tokens);
        struct out alone;
        add(e, r[i].ids, r[i].n, r[i].max_tokens, &alone);
        run(e);
        if (compare(&alone, &r[i].o, 1e-4f) < 0) {
            test_fail(__FILE__, __LINE__, "request %d (%d prompt tokens, %d preemptions): differs from alone", i,
                      r[i].n, r[i].o.preempted);
            break;
        }
        checked++;
    }
    ASSERT_TRUE(checked > n_r / 2);
    atomc_engine_free(e);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
