// Engine scenarios on the tiny real-weight fixtures (tests/fixtures/models), shared by the CPU
// test (tests/test_engine_model.c) and the CUDA test (tests/gpu/test_cuda_engine.c), which run
// the same code with a different `struct es_setup`. Header-only.
//
//   es_batched_under_preemption_equals_alone  the fixture's prompts plus variants sharing their
//       prefixes, batched on a KV pool small enough to force preemption (chunked prefill,
//       prefix hits), against each prompt run alone on a roomy engine without a prefix cache.
//   es_prefix_hit_identical_to_cold  a prompt run twice (the second time 2 blocks come from the
//       prefix cache), and two identical new prompts in one step (the second reads the blocks
//       the first writes in the same forward); exact hit / query counts.
//   es_random_stress_equals_alone  the engine issue's randomized stress: ~3000 steps of random
//       arrivals (shared prefixes, exact repeats), lengths and aborts (waiting, mid-prefill,
//       decoding) on a pool that forces preemption; at the end every block is free (of both pools
//       of a hybrid model's per-layer-group block tables), every id is forgotten and every
//       finished request equals the prompt decoded alone.
// The reference ("alone") runs keep one block table for every layer
// (disable_hybrid_kv_cache_manager), so on hybrid sliding / full fixtures the scenarios also show
// that per-layer-group block tables change no output.
//
// "Equals alone" (es_compare): the greedy tokens of the batched run equal the alone run's up to
// the first position where they differ, and that position must be a near tie of the alone run
// (top-2 logprob margin below setup->margin_tol); from there the continuations legitimately
// differ. Logprobs agree within setup->lp_tol wherever the contexts are still the same, and a
// fraction setup->min_clear of all tokens must have been equal at a clear margin. The CPU
// backend is fp32 and gives a row the same result whatever the batch up to summation order, so
// its margin_tol is fp32 noise (1e-4). On the GPU a row's bf16 logits depend on the batch (cuBLASLt picks its
// algorithm by M; attention splits by batch shape; chunked vs whole prefill), so a near tie
// there is anything below that noise; see tests/gpu/test_cuda_engine.c.
#ifndef ATOMC_TESTS_ENGINE_MODEL_SCENARIOS_H
#define ATOMC_TESTS_ENGINE_MODEL_SCENARIOS_H

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "backend/backend.h"
#include "common/check.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "test.h"

struct es_setup {
    const char *device;  // "cpu" or "cuda"
    bool enforce_eager;  // CUDA: no graphs
    float margin_tol;    // a reference top-2 logprob margin below this is a near tie (see es_compare)
    float lp_tol;        // |logprob - alone| at compared positions (batched vs alone)
    float lp_tol_cached; // |logprob - cold| at compared positions (prefix-cache hit vs cold run)
    double min_clear;    // fraction of all tokens that must have been equal at a clear margin
    int spec_k;          // > 0: the runs under test use ngram speculative decoding with k drafts
                         // (prompt lookup 1..3, at every batch size); the reference runs never do
    const char *spec_method; // NULL: "ngram"; "mtp": the model's MTP layer drafts (same k, batch sizes);
                             // "eagle3": the EAGLE-3 head in tests/fixtures/<spec_model> drafts
    const char *spec_model;  // "eagle3": the head's fixture directory (relative to tests/fixtures)
    bool one_table;      // disable_hybrid_kv_cache_manager (always on in the reference runs)
    const struct backend_caps *caps; // non-NULL: every engine (reference runs too) runs on a `device`
                                     // backend with this capability table (a GPU test of a model
                                     // the shipped table still refuses; engine_create_on_backend)
    // non-NULL: the engines under test (not the reference runs) run on the backend it makes, which
    // captures and replays graphs (tests/test_runner_graphs.c's CPU recording backend); graphs are
    // then expected unless enforce_eager.
    struct backend *(*make_backend)(void);
    // > 0 (the random stress): a clear-margin parting that one MoE router's near tie explains (a
    // top-k gap below this in an fp32 CPU run, es_route_flip) is a rounding flip, not a failure
    // (GPU runs of fixtures with random routers).
    float route_tol;
};

// The setup of the reference runs: s without speculation.
static struct es_setup es_plain(const struct es_setup *s) {
    struct es_setup p = *s;
    p.spec_k = 0;
    p.one_table = true;
    p.make_backend = NULL;
    p.route_tol = 0;
    return p;
}

// Speculative decoding statistics of e, for the scenario logs ("" without speculation).
static const char *es_spec_line(atomc_engine *e) {
    static char buf[160];
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    buf[0] = 0;
    if (st.num_speculative_tokens > 0)
        snprintf(buf, sizeof buf, ", %s k=%d: %llu drafts, %llu of %llu draft tokens accepted",
                 e->spec_mtp ? "mtp/eagle3" : "ngram",
                 st.num_speculative_tokens, (unsigned long long)st.spec_num_drafts,
                 (unsigned long long)st.spec_num_accepted_tokens, (unsigned long long)st.spec_num_draft_tokens);
    return buf;
}

// Whether the engine's model replayed CUDA graphs exactly when it should (cuda, not eager).
static bool es_graphs_as_expected(const struct es_setup *s, atomc_engine *e) {
    bool graphs = (!strcmp(s->device, "cuda") || s->make_backend) && !s->enforce_eager;
    return (engine_graph_replays(e) > 0) == graphs;
}

struct es_out {
    int32_t toks[256];
    float lp[256], margin[256];
    int n, cached, preempted;
    atomc_finish_reason reason;
    char error[256];
};

static void es_on_out(void *user, const atomc_output *o) {
    struct es_out *c = user;
    for (int i = 0; i < o->n_new_tokens && c->n < 256; i++) {
        c->toks[c->n] = o->new_tokens[i];
        if (o->logprobs) {
            c->lp[c->n] = o->logprobs[i].logprob;
            c->margin[c->n] =
                o->logprobs[i].n_top >= 2 ? o->logprobs[i].top[0].logprob - o->logprobs[i].top[1].logprob : 1e9f;
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

__attribute__((unused)) static json_t *es_load_refs(const char *model) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s/refs.json", model);
    json_error_t je;
    json_t *j = json_load_file(test_fixture(rel), 0, &je);
    CHECK_MSG(j, "%s: %s", test_fixture(rel), je.text);
    return j;
}

// An engine over tests/fixtures/models/<model> on setup's device; aborts if it cannot be made
// (the callers check for a GPU first).
static atomc_engine *es_make(const struct es_setup *s, const char *model, int block_size, int num_blocks, int max_len,
                             int max_seqs, int budget, bool cache) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", model);
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    char path[1024];
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    o.model_path = path;
    o.device = s->device;
    o.enforce_eager = s->enforce_eager;
    o.block_size = block_size;
    o.num_kv_blocks = num_blocks;
    o.max_model_len = max_len;
    o.max_num_seqs = max_seqs;
    o.max_num_batched_tokens = budget;
    o.enable_prefix_caching = cache;
    o.disable_hybrid_kv_cache_manager = s->one_table;
    o.num_threads = 2;
    o.gpu_memory_utilization = 0.3; // the pool is num_blocks; leave the GPU to others
    char spec_path[1024];
    if (s->spec_k > 0) {
        bool eagle3 = s->spec_method && !strcmp(s->spec_method, "eagle3");
        bool mtp = eagle3 || (s->spec_method && !strcmp(s->spec_method, "mtp"));
        o.speculative_method = eagle3 ? "eagle3" : mtp ? "mtp" : "ngram";
        if (eagle3) {
            snprintf(spec_path, sizeof spec_path, "%s", test_fixture(s->spec_model));
            o.speculative_model = spec_path;
        }
        o.num_speculative_tokens = s->spec_k;
        o.prompt_lookup_min = mtp ? 0 : 1;
        o.prompt_lookup_max = mtp ? 0 : 3;
        o.speculative_disable_by_batch_size = -1;
    }
    atomc_engine *e = NULL;
    char err[1024];
    if (s->make_backend) {
        struct backend *b = s->make_backend();
        CHECK(b);
        CHECK_MSG(engine_create_on_backend(&o, b, &e, err, sizeof err) == ATOMC_OK, "%s", err);
        return e;
    }
    if (s->caps) {
        struct backend *b = NULL;
        struct error be = {0};
        struct backend_options bo = {.num_threads = 2, .device_id = 0};
        CHECK_MSG(backend_create(s->device, &bo, &b, &be) == ATOMC_OK, "%s", be.msg);
        b->caps = s->caps;
        CHECK_MSG(engine_create_on_backend(&o, b, &e, err, sizeof err) == ATOMC_OK, "%s", err);
        return e;
    }
    CHECK_MSG(atomc_engine_create(&o, &e, err, sizeof err) == ATOMC_OK, "%s", err);
    return e;
}

// Greedy, ignore_eos, logprobs with the top 2 (their gap is the margin).
static void es_add(atomc_engine *e, const int32_t *ids, int n, int max_tokens, struct es_out *c, uint64_t *id) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = ids;
    r.n_prompt_ids = n;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.logprobs = 2;
    r.on_output = es_on_out;
    memset(c, 0, sizeof *c);
    r.user = c;
    char err[512];
    CHECK_MSG(atomc_engine_add_request(e, &r, id, err, sizeof err) == ATOMC_OK, "%s", err);
}

static void es_run(atomc_engine *e) {
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
}

static int es_json_ids(json_t *a, int32_t *out, int max) {
    int n = 0;
    for (size_t i = 0; i < json_array_size(a) && n < max; i++)
        out[n++] = (int32_t)json_integer_value(json_array_get(a, i));
    return n;
}

// Run b against the reference run a of the same prompt: their tokens must agree until the first
// position where they differ, and that position must be a near tie of a (top-2 margin below
// tol, which rounding may flip; the continuations then legitimately differ). Returns the
// number of leading positions where both agree (same context so far: logprobs comparable),
// or -1 on a difference at a clear margin; *clear (may be NULL) gets how many of those had a
// margin of at least tol.
static int es_compare(const struct es_out *a, const struct es_out *b, float tol, int *clear) {
    int n = a->n < b->n ? a->n : b->n, k = 0, c = 0;
    for (; k < n; k++) {
        if (a->toks[k] != b->toks[k]) {
            if (a->margin[k] >= tol) return -1;
            break;
        }
        c += a->margin[k] >= tol;
    }
    if (clear) *clear = c;
    return k;
}

// On a mismatch: where the two runs part, the reference's margin there, both tokens and logprobs,
// and the largest logprob gap over the positions before it (drift vs a real divergence).
__attribute__((unused)) static void es_explain(const struct es_out *ref, const struct es_out *got) {
    int n = ref->n < got->n ? ref->n : got->n, k = 0;
    double drift = 0;
    for (; k < n && ref->toks[k] == got->toks[k]; k++)
        drift = fmax(drift, fabs((double)ref->lp[k] - got->lp[k]));
    if (k == n) return;
    fprintf(stderr,
            "    parted at output %d of %d: reference token %d (logprob %.4f, top-2 margin %.4f), got %d (logprob "
            "%.4f); max |logprob gap| before it %.4f\n",
            k, n, ref->toks[k], ref->lp[k], ref->margin[k], got->toks[k], got->lp[k], drift);
}

// The first output where b differs from a (their common length if none).
static int es_first_diff(const struct es_out *a, const struct es_out *b) {
    int n = a->n < b->n ? a->n : b->n, k = 0;
    while (k < n && a->toks[k] == b->toks[k])
        k++;
    return k;
}

// Routing near ties (es_setup.route_tol). A MoE router whose top_k-th and next logits nearly tie
// picks either expert under BF16 rounding, and the two choices move that token's logits by far
// more than any margin tolerance: a discrete change, not drift (the tiny fixtures' random routers
// put many tokens near such a tie; tests/gpu/test_cuda_deltanet.c). On the CPU (fp32) the
// prompt runs alone through a wrapper backend (es_route) that records, for every forward (one per
// output: a lone sequence's prefill fits one step), the gap between the top_k-th and the next
// router logit of the sampled (last) row of each MoE layer, and can swap those two experts at
// one (forward, layer).
enum { ES_ROUTE_FWD = 256, ES_ROUTE_CALLS = 64 };
struct es_route {
    struct backend pub; // first: ops receive &pub
    struct backend *real;
    struct backend_ops ops;
};
static struct {
    int fwd, call;           // forwards sampled so far (= the output being computed), MoE layer in it
    int flip_fwd, flip_call; // the router to flip (-1: none)
    float gap[ES_ROUTE_FWD][ES_ROUTE_CALLS];
    int n_calls[ES_ROUTE_FWD];
} es_rt;

// Selection by the raw logits: softmax or sigmoid scoring without groups or correction bias.
static void es_route_moe(struct backend *b, const struct tensor *logits, const struct moe_route_args *a, int32_t *ids,
                         float *w) {
    struct es_route *rt = (struct es_route *)b;
    const int64_t T = tensor_rows(logits), E = tensor_cols(logits);
    CHECK(logits->dtype == DTYPE_F32 && a->top_k < E && E <= 512 && a->n_group <= 1 && !a->correction_bias);
    float *l = (float *)logits->data + (T - 1) * E;
    unsigned char taken[512] = {0};
    int kth = -1, next = -1; // the top_k-th and the (top_k + 1)-th largest logits
    for (int r = 0; r <= a->top_k; r++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || l[e] > l[best])) best = e;
        taken[best] = 1;
        if (r == a->top_k - 1) kth = best;
        if (r == a->top_k) next = best;
    }
    if (es_rt.fwd < ES_ROUTE_FWD && es_rt.call < ES_ROUTE_CALLS) {
        es_rt.gap[es_rt.fwd][es_rt.call] = l[kth] - l[next];
        es_rt.n_calls[es_rt.fwd] = es_rt.call + 1;
    }
    if (es_rt.fwd == es_rt.flip_fwd && es_rt.call == es_rt.flip_call) {
        float t = l[kth];
        l[kth] = l[next];
        l[next] = t;
    }
    es_rt.call++;
    rt->real->ops->moe_route(rt->real, logits, a, ids, w);
}
static void es_route_sample(struct backend *b, const struct sample_args *a) {
    struct es_route *rt = (struct es_route *)b;
    rt->real->ops->sample(rt->real, a);
    es_rt.fwd++;
    es_rt.call = 0;
}
static void es_route_destroy(struct backend *b) {
    struct es_route *rt = (struct es_route *)b;
    backend_destroy(rt->real);
    free(rt);
}
static struct backend *es_route_make(void) {
    struct backend_options bo = {.num_threads = 2};
    struct backend *real = NULL;
    struct error err = {0};
    CHECK_MSG(backend_create("cpu", &bo, &real, &err) == ATOMC_OK, "%s", err.msg);
    struct es_route *rt = calloc(1, sizeof *rt);
    CHECK(rt);
    rt->real = real;
    rt->pub = *real;
    rt->ops = *real->ops;
    rt->ops.moe_route = es_route_moe;
    rt->ops.sample = es_route_sample;
    rt->ops.destroy = es_route_destroy;
    rt->pub.ops = &rt->ops;
    return &rt->pub;
}

// The prompt alone on the CPU (fp32, eager) through es_route, flipping router (flip_fwd,
// flip_call) unless flip_fwd < 0; es_rt holds its router gaps afterwards.
static void es_route_run(const char *model, const int32_t *ids, int n, int max_tokens, int flip_fwd, int flip_call,
                         struct es_out *out) {
    static const struct es_setup cpu = {.device = "cpu", .enforce_eager = true, .make_backend = es_route_make};
    atomc_engine *e = es_make(&cpu, model, 16, 16, 256, 1, 256, false);
    memset(&es_rt, 0, sizeof es_rt);
    es_rt.flip_fwd = flip_fwd;
    es_rt.flip_call = flip_call;
    es_add(e, ids, n, max_tokens, out, NULL);
    es_run(e);
    atomc_engine_free(e);
}

// Whether got's parting from ref at output k (a clear margin of ref) is a routing flip: the fp32
// run gives ref's tokens before k and one of the two runs' tokens at k, and the other run's
// token at k once one router of output k whose gap is below s->route_tol has its top_k-th and
// next experts swapped. A corrupted state or cache gives tokens no such flip reproduces.
__attribute__((unused)) static bool es_route_flip(const struct es_setup *s, const char *model, const int32_t *ids,
                                                  int n, int max_tokens, const struct es_out *ref,
                                                  const struct es_out *got, int k) {
    CHECK(k < ES_ROUTE_FWD && k < ref->n && k < got->n && es_first_diff(ref, got) == k);
    struct es_out fp32, flipped;
    es_route_run(model, ids, n, max_tokens, -1, -1, &fp32);
    const int n_calls = es_rt.n_calls[k];
    float gap[ES_ROUTE_CALLS];
    memcpy(gap, es_rt.gap[k], sizeof gap);
    if (fp32.n <= k || es_first_diff(&fp32, ref) < k) {
        fprintf(stderr, "    fp32 CPU run parts from the reference before output %d: not a routing flip\n", k);
        return false;
    }
    const bool got_is_fp32 = fp32.toks[k] == got->toks[k];
    if (!got_is_fp32 && fp32.toks[k] != ref->toks[k]) {
        fprintf(stderr, "    fp32 CPU run gives token %d at output %d, neither run's: not a routing flip\n",
                fp32.toks[k], k);
        return false;
    }
    const int other = got_is_fp32 ? ref->toks[k] : got->toks[k];
    for (int c = 0; c < n_calls; c++) {
        if (gap[c] >= s->route_tol) continue;
        es_route_run(model, ids, n, max_tokens, k, c, &flipped);
        if (flipped.n > k && flipped.toks[k] == other) {
            fprintf(stderr,
                    "    routing flip: fp32 gives token %d (the %s run's); MoE router %d of %d has a top-k gap of "
                    "%.4f (< %g) at output %d and swapping its experts gives %d (logprob %.4f, margin %.4f), the %s "
                    "run's\n",
                    fp32.toks[k], got_is_fp32 ? "batched" : "reference", c, n_calls, gap[c], s->route_tol, k, other,
                    flipped.lp[k], flipped.margin[k], got_is_fp32 ? "reference" : "batched");
            return true;
        }
    }
    fprintf(stderr, "    no MoE router within %g of a tie at output %d gives token %d: not a routing flip\n",
            s->route_tol, k, other);
    return false;
}

__attribute__((unused)) static void es_batched_under_preemption_equals_alone(const struct es_setup *s,
                                                                             const char *model) {
    json_t *refs = es_load_refs(model);
    json_t *prompts = json_object_get(refs, "prompts");
    // Prompts: the fixture's, plus variants sharing their prefixes (prefix-cache hits).
    enum { MAXP = 24 };
    int32_t ids[MAXP][128];
    int n_ids[MAXP], n_p = 0;
    for (size_t i = 0; i < json_array_size(prompts) && n_p < MAXP; i++) {
        json_t *p = json_array_get(prompts, i);
        int n = es_json_ids(json_object_get(p, "ids"), ids[n_p], 100);
        n_ids[n_p++] = n;
        for (int v = 1; v <= 3 && n >= 6; v++) { // same first n-v tokens, new tail
            memcpy(ids[n_p], ids[n_p - v], (size_t)n * sizeof(int32_t));
            int keep = n - v;
            for (int t = keep; t < keep + 5; t++)
                ids[n_p][t] = (int32_t)((t * 37 + v * 11) % 200 + 3);
            n_ids[n_p++] = keep + 5;
            if (n_p == MAXP) break;
        }
    }
    json_decref(refs);
    const int max_tokens = 20;
    // Batched: 24 blocks of 4 tokens (96 slots) for many sequences of up to ~60 tokens; budget 16.
    atomc_engine *e = es_make(s, model, 4, 24, 96, 8, 16, true);
    static struct es_out batched[MAXP], alone[MAXP];
    for (int i = 0; i < n_p; i++)
        es_add(e, ids[i], n_ids[i], max_tokens, &batched[i], NULL);
    es_run(e);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    fprintf(stderr,
            "  %s on %s%s: %d prompts: %llu steps, %llu preemptions, prefix hits %llu of %llu tokens, "
            "%llu graph replays%s\n",
            model, s->device, s->enforce_eager ? " (eager)" : "", n_p, (unsigned long long)st.num_steps,
            (unsigned long long)st.num_preemptions, (unsigned long long)st.prefix_cache_hits,
            (unsigned long long)st.prefix_cache_queries, (unsigned long long)engine_graph_replays(e), es_spec_line(e));
    if (s->spec_k > 0) ASSERT_TRUE(st.spec_num_accepted_tokens > 0);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(st.prefix_cache_hits > 0);
    ASSERT_EQ(st.num_free_kv_blocks, 24);
    ASSERT_TRUE(es_graphs_as_expected(s, e));
    atomc_engine_free(e);
    // Alone: a roomy engine, one request at a time, no prefix cache, no speculation.
    struct es_setup plain = es_plain(s);
    e = es_make(&plain, model, 16, 64, 256, 1, 256, false);
    for (int i = 0; i < n_p; i++) {
        es_add(e, ids[i], n_ids[i], max_tokens, &alone[i], NULL);
        es_run(e);
    }
    atomc_engine_free(e);
    int compared = 0;
    double worst_lp = 0;
    for (int i = 0; i < n_p; i++) {
        ASSERT_EQ(batched[i].reason, ATOMC_FINISH_LENGTH);
        ASSERT_EQ(batched[i].n, max_tokens);
        int clear = 0, k = es_compare(&alone[i], &batched[i], s->margin_tol, &clear);
        if (k < 0) {
            test_fail(__FILE__, __LINE__, "prompt %d (%d tokens, preempted %d times): batched output differs", i,
                      n_ids[i], batched[i].preempted);
            return;
        }
        for (int t = 0; t < k; t++) {
            double d = fabs((double)batched[i].lp[t] - alone[i].lp[t]);
            worst_lp = d > worst_lp ? d : worst_lp;
            ASSERT_NEAR(batched[i].lp[t], alone[i].lp[t], s->lp_tol);
        }
        compared += clear;
    }
    fprintf(stderr, "  %d of %d tokens equal at a clear margin (>= %g), max |logprob - alone| %.3g\n", compared,
            n_p * max_tokens, s->margin_tol, worst_lp);
    ASSERT_TRUE(compared >= s->min_clear * n_p * max_tokens);
}

// Two identical new prompts of n tokens (ids (i * a + b) % 250 + 3) submitted in one step: the
// second shares the first's full blocks while they are being written. Their outputs must agree;
// adds the clear-margin positions compared to *compared and the first's token count to *n_total.
static void es_same_step_pair(const struct es_setup *s, atomc_engine *e, int n, int a, int b, int *compared,
                              int *n_total) {
    int32_t ids[128];
    CHECK(n <= 128);
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * a + b) % 250 + 3);
    struct es_out x, y;
    es_add(e, ids, n, 16, &x, NULL);
    es_add(e, ids, n, 16, &y, NULL);
    es_run(e);
    ASSERT_EQ(x.cached, 0);
    ASSERT_EQ(y.cached, (n - 1) / 16 * 16); // full blocks short of the last token
    ASSERT_EQ(y.n, x.n);
    int clear = 0, k = es_compare(&x, &y, s->margin_tol, &clear);
    ASSERT_TRUE(k >= 0);
    for (int t = 0; t < k; t++)
        ASSERT_NEAR(y.lp[t], x.lp[t], s->lp_tol_cached);
    *compared += clear;
    *n_total += x.n;
}

__attribute__((unused)) static void es_prefix_hit_identical_to_cold(const struct es_setup *s, const char *model) {
    atomc_engine *e = es_make(s, model, 16, 64, 0, 4, 256, true);
    int32_t ids[45];
    for (int i = 0; i < 45; i++)
        ids[i] = (int32_t)((i * 29 + 7) % 250 + 3);
    struct es_out cold, warm;
    es_add(e, ids, 45, 16, &cold, NULL);
    es_run(e);
    es_add(e, ids, 45, 16, &warm, NULL);
    es_run(e);
    ASSERT_EQ(cold.cached, 0);
    ASSERT_EQ(warm.cached, 32);
    ASSERT_EQ(warm.n, cold.n);
    int compared = 0, clear = 0, k = es_compare(&cold, &warm, s->margin_tol, &clear);
    ASSERT_TRUE(k >= 0);
    for (int t = 0; t < k; t++)
        ASSERT_NEAR(warm.lp[t], cold.lp[t], s->lp_tol_cached);
    compared += clear;
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.prefix_cache_hits, 32);
    ASSERT_EQ(st.prefix_cache_queries, 90);
    // Same-step sharing: two new identical prompts submitted together; the second reads the
    // first's blocks as they are written in the same forward pass. 40 tokens: 2 shared blocks;
    // 100 tokens: 6, more than a whole 64-token attention tile before the sharer's new tokens
    // (CUDA must not read that tile ahead of the KV write it depends on).
    int n_same = 0;
    es_same_step_pair(s, e, 40, 53, 11, &compared, &n_same);
    es_same_step_pair(s, e, 100, 37, 5, &compared, &n_same);
    fprintf(stderr, "  %s on %s: %d of %d tokens equal at a clear margin (>= %g)%s\n", model, s->device, compared,
            cold.n + n_same, s->margin_tol, es_spec_line(e));
    ASSERT_TRUE(compared >= s->min_clear * (cold.n + n_same));
    ASSERT_TRUE(es_graphs_as_expected(s, e));
    atomc_engine_free(e);
}

struct es_sreq {
    int32_t ids[48];
    int n, max_tokens;
    uint64_t id;
    bool aborted;
    struct es_out o;
};

static uint64_t es_rng;
static uint32_t es_rnd(uint32_t n) {
    es_rng ^= es_rng << 13;
    es_rng ^= es_rng >> 7;
    es_rng ^= es_rng << 17;
    return (uint32_t)(es_rng % n);
}

// Token ids are drawn from [3, 253): every fixture's vocabulary (256) holds them. num_blocks: the
// pool (blocks of 4 tokens; at least 24 = one max_model_len sequence); sliding-window models free
// blocks out of their window while running, so they need a smaller pool to be preempted at all.
__attribute__((unused)) static void es_random_stress_equals_alone(const struct es_setup *s, const char *model,
                                                                  uint64_t seed, int num_blocks) {
    enum { MAXR = 800 };
    static struct es_sreq r[MAXR];
    memset(r, 0, sizeof r);
    es_rng = seed;
    int n_r = 0;
    int32_t shared[3][32];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 32; j++)
            shared[i][j] = (int32_t)(es_rnd(250) + 3);
    atomc_engine *e = es_make(s, model, 4, num_blocks, 96, 6, 16, true);
    for (int step = 0; step < 3000; step++) {
        if (es_rnd(100) < 18 && n_r < MAXR) {
            struct es_sreq *q = &r[n_r];
            if (n_r && es_rnd(5) == 0) {
                const struct es_sreq *old = &r[es_rnd((uint32_t)n_r)];
                memcpy(q->ids, old->ids, sizeof q->ids);
                q->n = old->n;
            } else {
                int pre = es_rnd(3) ? (int)es_rnd(33) : 0, suf = 1 + (int)es_rnd(12);
                const int32_t *b = shared[es_rnd(3)];
                for (int i = 0; i < pre; i++)
                    q->ids[i] = b[i];
                for (int i = 0; i < suf; i++)
                    q->ids[pre + i] = (int32_t)(es_rnd(250) + 3);
                q->n = pre + suf;
            }
            q->max_tokens = 1 + (int)es_rnd(30);
            es_add(e, q->ids, q->n, q->max_tokens, &q->o, &q->id);
            n_r++;
        }
        if (n_r && es_rnd(100) < 4) { // abort a live request (waiting, mid-prefill or decoding)
            for (int tries = 0; tries < 8; tries++) {
                struct es_sreq *q = &r[n_r - 1 - (int)es_rnd((uint32_t)(n_r < 12 ? n_r : 12))];
                if (!q->o.reason && !q->aborted && atomc_engine_abort(e, q->id) == ATOMC_OK) {
                    q->aborted = true;
                    break;
                }
            }
        }
        atomc_engine_step(e);
    }
    es_run(e);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    uint64_t replays = engine_graph_replays(e);
    fprintf(stderr,
            "  %s on %s%s: %d requests, %llu steps, %llu preemptions, %llu aborted, prefix hit rate %.1f%%, "
            "%llu graph replays%s\n",
            model, s->device, s->enforce_eager ? " (eager)" : "", n_r, (unsigned long long)st.num_steps,
            (unsigned long long)st.num_preemptions, (unsigned long long)st.num_requests_aborted,
            st.prefix_cache_queries ? 100.0 * st.prefix_cache_hits / st.prefix_cache_queries : 0.0,
            (unsigned long long)replays, es_spec_line(e));
    if (s->spec_k > 0) ASSERT_TRUE(st.spec_num_accepted_tokens > 0);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_EQ(st.num_free_kv_blocks_sw, st.num_kv_blocks_sw);
    {
        struct error berr = {0};
        ASSERT_TRUE(block_manager_check(engine_block_manager(e), &berr));
        if (engine_block_manager_sw(e)) ASSERT_TRUE(block_manager_check(engine_block_manager_sw(e), &berr));
    }
    if (st.num_kv_blocks_sw > 0)
        fprintf(stderr, "  per-layer-group block tables: peak %d of %d full-layer blocks, %d of %d sliding-layer "
                "blocks in use\n", st.peak_kv_blocks_used, st.num_kv_blocks, st.peak_kv_blocks_used_sw,
                st.num_kv_blocks_sw);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(st.num_steps >= 2000);
    ASSERT_TRUE(es_graphs_as_expected(s, e));
    for (int i = 0; i < n_r; i++)
        ASSERT_EQ(atomc_engine_abort(e, r[i].id), ATOMC_ERR_NOT_FOUND);
    atomc_engine_free(e);
    struct es_setup plain = es_plain(s);
    e = es_make(&plain, model, 16, 16, 256, 1, 256, false);
    int checked = 0, tokens = 0, compared = 0, flips = 0;
    double worst_lp = 0;
    for (int i = 0; i < n_r; i++) {
        if (r[i].o.reason == ATOMC_FINISH_ABORT) {
            ASSERT_TRUE(r[i].aborted);
            continue;
        }
        ASSERT_EQ(r[i].o.reason, ATOMC_FINISH_LENGTH);
        ASSERT_EQ(r[i].o.n, r[i].max_tokens);
        struct es_out alone;
        es_add(e, r[i].ids, r[i].n, r[i].max_tokens, &alone, NULL);
        es_run(e);
        int clear = 0, k = es_compare(&alone, &r[i].o, s->margin_tol, &clear);
        if (k < 0) {
            int p = es_first_diff(&alone, &r[i].o);
            fprintf(stderr, "  request %d (%d prompt tokens, %d preemptions) differs from alone\n", i, r[i].n,
                    r[i].o.preempted);
            es_explain(&alone, &r[i].o);
            if (!(s->route_tol > 0 && es_route_flip(s, model, r[i].ids, r[i].n, r[i].max_tokens, &alone, &r[i].o, p))) {
                test_fail(__FILE__, __LINE__, "request %d (%d prompt tokens, %d preemptions): differs from alone", i,
                          r[i].n, r[i].o.preempted);
                break;
            }
            flips++;
            k = p;
            for (int t = 0; t < p; t++)
                clear += alone.margin[t] >= s->margin_tol;
        }
        for (int t = 0; t < k; t++) {
            double d = fabs((double)r[i].o.lp[t] - alone.lp[t]);
            worst_lp = d > worst_lp ? d : worst_lp;
            ASSERT_NEAR(r[i].o.lp[t], alone.lp[t], s->lp_tol);
        }
        checked++;
        tokens += r[i].o.n;
        compared += clear;
    }
    fprintf(stderr,
            "  %d finished requests checked: %d of %d tokens equal at a clear margin (>= %g), "
            "max |logprob - alone| %.3g, %d routing flips\n",
            checked, compared, tokens, s->margin_tol, worst_lp, flips);
    ASSERT_TRUE(checked > n_r / 2);
    ASSERT_TRUE(flips <= 1 + checked / 100); // rare, or not rounding
    ASSERT_TRUE(compared >= s->min_clear * tokens);
    atomc_engine_free(e);
}

#endif
