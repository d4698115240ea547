// The reference sampler (src/backend/cpu/cpu_sampler.c) against its written specification:
// exact kept sets of top-k / top-p / min-p on handcrafted logits, greedy ties, penalties on
// handcrafted histories (expected values worked out by hand in the comments), raw logprobs,
// seed reproducibility, and a chi-square test of the draw.
//
// "Exact" draw checks: for a (seed, step) the op must pick the token that inverse-CDF sampling
// over the expected kept set and expected processed logits gives for u = sample_rng_uniform,
// computed here independently in double.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/sample_rng.h"
#include "test.h"

struct row_params {
    float temperature, top_p, min_p;
    int top_k;
    float presence, frequency, repetition;
    uint64_t seed, step;
    const int32_t *prompt;
    int n_prompt;
    const int32_t *output;
    int n_output;
    int n_logprobs;
    const uint32_t *mask; // structured output: ceil(V / 32) words, bit set = allowed; NULL = all
};

static struct row_params defaults(void) {
    struct row_params p = {.temperature = 1.0f, .top_p = 1.0f, .repetition = 1.0f};
    return p;
}

struct row_result {
    int32_t id;
    float logprob;
    int32_t top_ids[20];
    float top_lp[20];
};

static struct backend *sampler_backend(void) {
    static struct backend *b; // one per test binary; created on first use
    if (!b) {
        struct backend_options o = {.num_threads = 2};
        struct error err;
        if (backend_cpu_create(&o, &b, &err) != ATOMC_OK) abort();
    }
    return b;
}

// Samples n rows in one call (the same logits row repeated unless `logits` holds n rows).
static void sample_rows(const float *logits, int V, int n, const struct row_params *p, struct row_result *res) {
    struct backend *b = sampler_backend();
    float *temp = malloc(n * 4), *top_p = malloc(n * 4), *min_p = malloc(n * 4), *pres = malloc(n * 4);
    float *freq = malloc(n * 4), *rep = malloc(n * 4), *lp = malloc(n * 4);
    int32_t *top_k = malloc(n * 4), *hs = malloc((n + 1) * 4), *hpl = malloc(n * 4), *ids = malloc(n * 4);
    uint64_t *seed = malloc(n * 8), *step = malloc(n * 8);
    int total = 0, nlp = 0;
    for (int r = 0; r < n; r++) {
        total += p[r].n_prompt + p[r].n_output;
        if (p[r].n_logprobs > nlp) nlp = p[r].n_logprobs;
    }
    int32_t *hist = malloc((total + 1) * 4);
    int32_t *top_ids = malloc((size_t)(n * nlp + 1) * 4);
    float *top_lp = malloc((size_t)(n * nlp + 1) * 4);
    bool any_pen = false;
    hs[0] = 0;
    for (int r = 0; r < n; r++) {
        temp[r] = p[r].temperature;
        top_p[r] = p[r].top_p;
        min_p[r] = p[r].min_p;
        top_k[r] = p[r].top_k;
        pres[r] = p[r].presence;
        freq[r] = p[r].frequency;
        rep[r] = p[r].repetition;
        seed[r] = p[r].seed;
        step[r] = p[r].step;
        if (p[r].n_prompt) memcpy(hist + hs[r], p[r].prompt, p[r].n_prompt * 4);
        if (p[r].n_output) memcpy(hist + hs[r] + p[r].n_prompt, p[r].output, p[r].n_output * 4);
        hs[r + 1] = hs[r] + p[r].n_prompt + p[r].n_output;
        hpl[r] = p[r].n_prompt;
        if (pres[r] != 0 || freq[r] != 0 || rep[r] != 1) any_pen = true;
    }
    const int words = (V + 31) / 32;
    uint32_t *masks = NULL;
    for (int r = 0; r < n; r++)
        if (p[r].mask && !masks) masks = malloc((size_t)n * words * 4);
    for (int r = 0; masks && r < n; r++) {
        if (p[r].mask) memcpy(masks + (size_t)r * words, p[r].mask, (size_t)words * 4);
        else memset(masks + (size_t)r * words, 0xff, (size_t)words * 4);
    }
    struct tensor tl = tensor_2d((void *)logits, DTYPE_F32, n, V);
    struct sample_args a = {
        .n_rows = n,
        .vocab_size = V,
        .logits = &tl,
        .temperature = temp,
        .top_p = top_p,
        .top_k = top_k,
        .min_p = min_p,
        .presence_penalty = pres,
        .frequency_penalty = freq,
        .repetition_penalty = rep,
        .seed = seed,
        .step = step,
        .hist_start = hs,
        .hist_ids = hist,
        .hist_prompt_len = hpl,
        .any_penalty = any_pen,
        .n_logprobs = nlp,
        .out_ids = ids,
        .out_logprob = lp,
        .out_top_ids = top_ids,
        .out_top_logprobs = top_lp,
        .token_bitmask = masks,
        .bitmask_words = words,
    };
    b->ops->sample(b, &a);
    free(masks);
    for (int r = 0; r < n; r++) {
        res[r].id = ids[r];
        res[r].logprob = lp[r];
        for (int j = 0; j < nlp; j++) {
            res[r].top_ids[j] = top_ids[r * nlp + j];
            res[r].top_lp[j] = top_lp[r * nlp + j];
        }
    }
    free(temp);
    free(top_p);
    free(min_p);
    free(pres);
    free(freq);
    free(rep);
    free(lp);
    free(top_k);
    free(hs);
    free(hpl);
    free(ids);
    free(seed);
    free(step);
    free(hist);
    free(top_ids);
    free(top_lp);
}

// Samples one row whose logits are `logits` (a single row of V) with params p.
static struct row_result sample_one(const float *logits, int V, struct row_params p) {
    struct row_result r;
    sample_rows(logits, V, 1, &p, &r);
    return r;
}

// Inverse CDF over kept tokens in ascending id order, in double, with expected processed
// logits w (already divided by temperature).
static int expected_draw(const double *w, const int *kept, int V, double u) {
    double m = -INFINITY;
    for (int i = 0; i < V; i++)
        if (kept[i] && w[i] > m) m = w[i];
    double total = 0;
    for (int i = 0; i < V; i++)
        if (kept[i]) total += exp(w[i] - m);
    double acc = 0, target = u * total;
    int last = -1;
    for (int i = 0; i < V; i++) {
        if (!kept[i]) continue;
        acc += exp(w[i] - m);
        last = i;
        if (acc > target) return i;
    }
    return last;
}

// Checks n_draws draws (seed, steps 0..n_draws-1) of `p` on `logits` against expected_draw(w, kept).
// Returns the number of mismatches; *seen_out (V) counts how often each id came out.
static int check_draws_n(const float *logits, int V, struct row_params p, const double *w, const int *kept,
                         int *seen_out, int n_draws) {
    int bad = 0;
    for (int s = 0; s < n_draws; s++) {
        p.step = (uint64_t)s;
        struct row_result r = sample_one(logits, V, p);
        int e = expected_draw(w, kept, V, sample_rng_uniform(p.seed, p.step));
        if (r.id != e) {
            if (bad < 3) fprintf(stderr, "  step %d: got %d, expected %d\n", s, r.id, e);
            bad++;
        }
        if (seen_out && r.id >= 0 && r.id < V) seen_out[r.id]++;
    }
    return bad;
}

static int check_draws(const float *logits, int V, struct row_params p, const double *w, const int *kept,
                       int *seen_out) {
    return check_draws_n(logits, V, p, w, kept, seen_out, 300);
}

static void log_probs(float *logits, const double *probs, int V) {
    for (int i = 0; i < V; i++)
        logits[i] = (float)log(probs[i]);
}

// ---------------------------------------------------------------------------------------------

TEST(rng_is_counter_based_and_uniform_in_unit_interval) {
    ASSERT_TRUE(sample_rng_uniform(1, 2) == sample_rng_uniform(1, 2));
    ASSERT_TRUE(sample_rng_uniform(1, 2) != sample_rng_uniform(1, 3));
    ASSERT_TRUE(sample_rng_uniform(1, 2) != sample_rng_uniform(2, 2));
    // seed/step must not be interchangeable
    ASSERT_TRUE(sample_rng_uniform(5, 9) != sample_rng_uniform(9, 5));
    double mean = 0;
    for (int i = 0; i < 100000; i++) {
        double u = sample_rng_uniform(42, (uint64_t)i);
        ASSERT_TRUE(u >= 0.0 && u < 1.0);
        mean += u;
    }
    mean /= 100000;
    ASSERT_NEAR(mean, 0.5, 0.005);
}

TEST(greedy_picks_argmax_lowest_id_on_ties) {
    float l[6] = {1.0f, 3.0f, -2.0f, 3.0f, 2.9f, 3.0f};
    struct row_params p = defaults();
    p.temperature = 0.0f;
    ASSERT_EQ(sample_one(l, 6, p).id, 1);
    p.temperature = 1e-6f; // below the greedy threshold
    ASSERT_EQ(sample_one(l, 6, p).id, 1);
    p.temperature = NAN;
    ASSERT_EQ(sample_one(l, 6, p).id, 1);
    float l2[4] = {-5.0f, -1.0f, -1.0f, -3.0f}; // all negative
    p.temperature = 0.0f;
    ASSERT_EQ(sample_one(l2, 4, p).id, 1);
    // Greedy ignores top-k / top-p / min-p and the seed.
    p.top_k = 1;
    p.top_p = 0.1f;
    p.min_p = 0.9f;
    p.seed = 77;
    ASSERT_EQ(sample_one(l, 6, p).id, 1);
}

TEST(temperature_sampling_matches_inverse_cdf_exactly) {
    double probs[5] = {0.1, 0.25, 0.05, 0.4, 0.2};
    float l[5];
    log_probs(l, probs, 5);
    struct row_params p = defaults();
    p.temperature = 0.7f;
    p.seed = 1234;
    double w[5];
    int kept[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < 5; i++)
        w[i] = (double)(l[i] * (1.0f / 0.7f));
    int seen[5] = {0};
    ASSERT_EQ(check_draws(l, 5, p, w, kept, seen), 0);
    for (int i = 0; i < 5; i++)
        ASSERT_TRUE(seen[i] > 0);
}

TEST(top_k_keeps_k_largest_ties_by_lowest_id) {
    // Values: id 0: 2.0, ids 1, 2, 4: 1.0 (tied), id 3: 0.5. top_k = 2 keeps 0 and 1;
    // top_k = 3 keeps 0, 1, 2 (of the three tied, the lowest ids).
    float l[5] = {2.0f, 1.0f, 1.0f, 0.5f, 1.0f};
    struct row_params p = defaults();
    p.seed = 99;
    double w[5];
    for (int i = 0; i < 5; i++)
        w[i] = l[i];
    int k2[5] = {1, 1, 0, 0, 0}, k3[5] = {1, 1, 1, 0, 0}, k1[5] = {1, 0, 0, 0, 0}, all[5] = {1, 1, 1, 1, 1};
    int seen[5] = {0};
    p.top_k = 2;
    ASSERT_EQ(check_draws(l, 5, p, w, k2, seen), 0);
    ASSERT_TRUE(seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0 && seen[4] == 0);
    p.top_k = 3;
    ASSERT_EQ(check_draws(l, 5, p, w, k3, NULL), 0);
    p.top_k = 1;
    ASSERT_EQ(check_draws(l, 5, p, w, k1, NULL), 0);
    p.top_k = 5; // == vocab: off
    ASSERT_EQ(check_draws(l, 5, p, w, all, NULL), 0);
    p.top_k = -1; // off
    ASSERT_EQ(check_draws(l, 5, p, w, all, NULL), 0);
}

TEST(top_p_keeps_smallest_prefix_reaching_p) {
    // Probabilities by id: {0.1, 0.4, 0.2, 0.3}; sorted: id1 0.4, id3 0.3, id2 0.2, id0 0.1.
    double probs[4] = {0.1, 0.4, 0.2, 0.3};
    float l[4];
    log_probs(l, probs, 4);
    double w[4];
    for (int i = 0; i < 4; i++)
        w[i] = l[i];
    struct row_params p = defaults();
    p.seed = 7;
    int only1[4] = {0, 1, 0, 0}, k13[4] = {0, 1, 0, 1}, k123[4] = {0, 1, 1, 1}, all[4] = {1, 1, 1, 1};
    p.top_p = 0.35f; // 0.4 >= 0.35
    ASSERT_EQ(check_draws(l, 4, p, w, only1, NULL), 0);
    p.top_p = 0.5f; // 0.4 < 0.5 <= 0.7
    ASSERT_EQ(check_draws(l, 4, p, w, k13, NULL), 0);
    p.top_p = 0.85f; // 0.7 < 0.85 <= 0.9
    ASSERT_EQ(check_draws(l, 4, p, w, k123, NULL), 0);
    p.top_p = 0.95f;
    ASSERT_EQ(check_draws(l, 4, p, w, all, NULL), 0);
    p.top_p = 0.0f; // always at least one token
    ASSERT_EQ(check_draws(l, 4, p, w, only1, NULL), 0);
    // After top-k = 3 (drop id0), the renormalised probs are {0.4, 0.2, 0.3} / 0.9:
    // 0.444, 0.333, 0.222; top_p 0.75 needs 0.444 + 0.333 = 0.778 -> keep ids 1, 3.
    p.top_k = 3;
    p.top_p = 0.75f;
    ASSERT_EQ(check_draws(l, 4, p, w, k13, NULL), 0);
}

TEST(min_p_drops_tokens_below_fraction_of_max) {
    // Probabilities {0.5, 0.2, 0.04, 0.26}; min_p 0.1 -> threshold 0.05 drops id 2.
    double probs[4] = {0.5, 0.2, 0.04, 0.26};
    float l[4];
    log_probs(l, probs, 4);
    double w[4];
    for (int i = 0; i < 4; i++)
        w[i] = l[i];
    struct row_params p = defaults();
    p.seed = 5;
    p.min_p = 0.1f;
    int k[4] = {1, 1, 0, 1};
    ASSERT_EQ(check_draws(l, 4, p, w, k, NULL), 0);
    // min_p 0.45: threshold 0.225 keeps ids 0 and 3.
    p.min_p = 0.45f;
    int k2[4] = {1, 0, 0, 1};
    ASSERT_EQ(check_draws(l, 4, p, w, k2, NULL), 0);
    // min-p is applied before top-p: with min_p 0.1 the survivors {0.5, 0.2, 0.26} / 0.96 =
    // {0.521, 0.208, 0.271}; top_p 0.75 needs 0.521 + 0.271 = 0.792 -> ids 0 and 3 (without
    // min-p, 0.5 + 0.26 = 0.76 would also reach 0.75: choose 0.77 to tell the orders apart:
    // with min-p first 0.792 >= 0.77 keeps {0, 3}; top-p first would need id 1 too).
    p.min_p = 0.1f;
    p.top_p = 0.77f;
    ASSERT_EQ(check_draws(l, 4, p, w, k2, NULL), 0);
    // With temperature, min-p applies to the tempered distribution: T = 2 flattens
    // {0.5, 0.04} to ratio sqrt(0.08) = 0.283 > 0.1, so min_p 0.1 keeps everything.
    p.top_p = 1.0f;
    p.temperature = 2.0f;
    int all[4] = {1, 1, 1, 1};
    for (int i = 0; i < 4; i++)
        w[i] = (double)(l[i] * 0.5f);
    ASSERT_EQ(check_draws(l, 4, p, w, all, NULL), 0);
}

TEST(penalties_follow_vllm_definitions) {
    // logits        {2.0, -1.0, 0.5, 3.0, -2.0, 1.2}
    // prompt {0, 1}, output {3, 3, 1}; repetition 2, frequency 0.5, presence 0.25:
    //   id0 (prompt only):        2.0 / 2                        =  1.0
    //   id1 (prompt + output x1): -1.0 * 2 - 0.5 * 1 - 0.25      = -2.75
    //   id2 (never seen):                                           0.5
    //   id3 (output x2):          3.0 / 2 - 0.5 * 2 - 0.25       =  0.25
    //   id4 (never seen):                                          -2.0
    //   id5 (never seen):                                           1.2
    float l[6] = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.2f};
    int32_t prompt[2] = {0, 1}, output[3] = {3, 3, 1};
    struct row_params p = defaults();
    p.prompt = prompt;
    p.n_prompt = 2;
    p.output = output;
    p.n_output = 3;
    p.repetition = 2.0f;
    p.frequency = 0.5f;
    p.presence = 0.25f;
    p.seed = 31;
    double w[6] = {1.0, -2.75, 0.5, 0.25, -2.0, 1.2};
    int all[6] = {1, 1, 1, 1, 1, 1};
    ASSERT_EQ(check_draws(l, 6, p, w, all, NULL), 0);
    // Greedy after penalties: 1.2 (id5) beats 1.0 (id0) and 0.25 (id3, raw argmax).
    p.temperature = 0.0f;
    ASSERT_EQ(sample_one(l, 6, p).id, 5);
    // Repetition only: id0 -> 1.0, id1 -> -2.0, id3 -> 1.5: greedy = id3.
    p.frequency = p.presence = 0.0f;
    ASSERT_EQ(sample_one(l, 6, p).id, 3);
    // Presence/frequency ignore prompt tokens: frequency 1.0 alone: id3 -> 1.0, id0 stays 2.0.
    p.repetition = 1.0f;
    p.frequency = 1.0f;
    ASSERT_EQ(sample_one(l, 6, p).id, 0);
    // Negative penalties (encouragement) are allowed: frequency -1 lifts id1 to -1 + 1 = 0.0
    // and id3 to 3 + 2 = 5.0.
    p.frequency = -1.0f;
    p.temperature = 1.0f;
    double w2[6] = {2.0, 0.0, 0.5, 5.0, -2.0, 1.2};
    ASSERT_EQ(check_draws(l, 6, p, w2, all, NULL), 0);
    // Penalty scratch is cleared between calls: the same row without history is untouched.
    struct row_params q = defaults();
    q.seed = 31;
    double w3[6] = {2.0, -1.0, 0.5, 3.0, -2.0, 1.2};
    ASSERT_EQ(check_draws(l, 6, q, w3, all, NULL), 0);
}

TEST(logprobs_are_raw_log_softmax_with_sorted_top_n) {
    float l[6] = {1.0f, 3.0f, 0.0f, 3.0f, -1.0f, 2.0f};
    double lse = 0;
    for (int i = 0; i < 6; i++)
        lse += exp(l[i]);
    lse = log(lse);
    struct row_params p = defaults();
    p.n_logprobs = 4;
    p.temperature = 0.3f;
    p.repetition = 3.0f; // penalties and temperature do not change the reported logprobs
    int32_t out[1] = {1};
    p.output = out;
    p.n_output = 1;
    p.seed = 3;
    for (int s = 0; s < 20; s++) {
        p.step = (uint64_t)s;
        struct row_result r = sample_one(l, 6, p);
        ASSERT_NEAR(r.logprob, l[r.id] - lse, 1e-5);
        // Top 4 by (value desc, id asc): 1 (3.0), 3 (3.0), 5 (2.0), 0 (1.0).
        ASSERT_EQ(r.top_ids[0], 1);
        ASSERT_EQ(r.top_ids[1], 3);
        ASSERT_EQ(r.top_ids[2], 5);
        ASSERT_EQ(r.top_ids[3], 0);
        ASSERT_NEAR(r.top_lp[0], 3.0 - lse, 1e-5);
        ASSERT_NEAR(r.top_lp[2], 2.0 - lse, 1e-5);
        ASSERT_NEAR(r.top_lp[3], 1.0 - lse, 1e-5);
    }
    // More alternatives than the vocabulary: the rest are id -1, logprob -inf.
    p.n_logprobs = 8;
    struct row_result r = sample_one(l, 6, p);
    ASSERT_EQ(r.top_ids[5], 4);
    ASSERT_EQ(r.top_ids[6], -1);
    ASSERT_TRUE(isinf(r.top_lp[7]) && r.top_lp[7] < 0);
}

TEST(same_seed_same_tokens_and_batch_equals_single_rows) {
    enum { V = 1000, N = 40 };
    float *l = malloc((size_t)N * V * 4);
    uint64_t st = 88;
    for (int i = 0; i < N * V; i++) {
        st = st * 6364136223846793005ULL + 1442695040888963407ULL;
        l[i] = (float)((st >> 40) % 1000) / 100.0f;
    }
    struct row_params p[N];
    int32_t hist[3] = {5, 6, 5};
    for (int r = 0; r < N; r++) {
        p[r] = defaults();
        p[r].temperature = 0.5f + (r % 4) * 0.3f;
        p[r].top_k = (r % 3) * 20;
        p[r].top_p = r % 5 == 0 ? 0.8f : 1.0f;
        p[r].min_p = r % 7 == 0 ? 0.05f : 0.0f;
        p[r].seed = 1000 + (uint64_t)(r / 2); // rows 2k and 2k+1 share a seed...
        p[r].step = (uint64_t)(r % 2) * 3;    // ...but not the step
        p[r].n_logprobs = r % 3;
        if (r % 4 == 1) {
            p[r].output = hist;
            p[r].n_output = 3;
            p[r].frequency = 0.7f;
        }
    }
    struct row_result batch[N], again[N];
    sample_rows(l, V, N, p, batch);
    sample_rows(l, V, N, p, again);
    for (int r = 0; r < N; r++) {
        struct row_result one;
        sample_rows(l + (size_t)r * V, V, 1, &p[r], &one);
        ASSERT_EQ(batch[r].id, one.id);
        ASSERT_EQ(batch[r].id, again[r].id);
        ASSERT_TRUE(batch[r].logprob == one.logprob);
    }
    // Different steps of one seed do not all agree.
    int differ = 0;
    for (int s = 1; s < 20; s++) {
        struct row_params q = p[1];
        q.step = (uint64_t)s;
        struct row_result a;
        sample_rows(l + V, V, 1, &q, &a);
        differ += a.id != batch[1].id;
    }
    ASSERT_TRUE(differ > 0);
    free(l);
}

TEST(token_bitmask_applies_before_everything) {
    // Allowed ids {3, 17, 42, 99} of 100: greedy, draws (also with top-k larger than the allowed
    // set) and logprobs are those of the row with every other logit at -inf.
    enum { V = 100 };
    float logits[V];
    uint64_t st = 12345;
    for (int i = 0; i < V; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        logits[i] = (float)((st >> 40) % 1000) / 100.0f - 5.0f;
    }
    logits[50] = 20.0f; // the unmasked argmax, disallowed
    const int allowed[4] = {3, 17, 42, 99};
    uint32_t mask[4] = {0};
    int kept[V] = {0};
    for (int k = 0; k < 4; k++) {
        mask[allowed[k] >> 5] |= 1u << (allowed[k] & 31);
        kept[allowed[k]] = 1;
    }
    struct row_params p = defaults();
    p.mask = mask;
    p.temperature = 0;
    p.n_logprobs = 3;
    struct row_result r = sample_one(logits, V, p);
    int best = 3;
    for (int k = 0; k < 4; k++)
        if (logits[allowed[k]] > logits[best]) best = allowed[k];
    ASSERT_EQ(r.id, best);
    double mx = logits[best], sum = 0;
    for (int k = 0; k < 4; k++) sum += exp(logits[allowed[k]] - mx);
    ASSERT_NEAR(r.logprob, logits[best] - (mx + log(sum)), 1e-5);
    ASSERT_EQ(r.top_ids[0], best);
    for (int j = 0; j < 3; j++) ASSERT_TRUE(kept[r.top_ids[j]]);
    double w[V];
    for (int i = 0; i < V; i++) w[i] = logits[i] / 0.8f;
    p.temperature = 0.8f;
    p.n_logprobs = 0;
    p.seed = 77;
    int seen[V] = {0};
    ASSERT_EQ(check_draws(logits, V, p, w, kept, seen), 0);
    p.top_k = 50;
    ASSERT_EQ(check_draws(logits, V, p, w, kept, seen), 0);
    for (int i = 0; i < V; i++) ASSERT_TRUE(kept[i] || seen[i] == 0);
    // A batch with one masked and one free row: the free row still reaches token 50.
    struct row_params pr[2] = {p, defaults()};
    pr[1].temperature = 0;
    struct row_result rr[2];
    float two[2 * V];
    memcpy(two, logits, sizeof logits);
    memcpy(two + V, logits, sizeof logits);
    sample_rows(two, V, 2, pr, rr);
    ASSERT_TRUE(kept[rr[0].id]);
    ASSERT_EQ(rr[1].id, 50);
}

// The sampler's sparse path for masked rows (no top-k / top-p / min-p, no top alternatives,
// at most half the vocabulary allowed: structured output's usual case) must pick the same token
// with the same logprob as the dense path over the row with every masked logit at -inf (given
// here with no mask, so the dense path runs), for greedy and temperature draws, with penalties
// whose history holds masked and allowed tokens, ties, -inf logits, and masks of 1 .. V/2 ids.
TEST(sparse_masked_draw_equals_dense_masked_row) {
    enum { V = 1000 };
    static float logits[V], premasked[V];
    uint32_t mask[(V + 31) / 32];
    int32_t hist[12];
    uint64_t st = 987654321;
    int n_cases = 0, n_sparse_sized = 0;
    for (int c = 0; c < 400; c++) {
        for (int i = 0; i < V; i++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            logits[i] = (float)((st >> 40) % 2000) / 200.0f - 5.0f; // 0.005 steps: many ties
            if ((st >> 20) % 97 == 0) logits[i] = -INFINITY;
        }
        int n_allowed = c % 4 == 0 ? 1 + c % 7 : 1 + (int)((st >> 33) % (V / 2));
        memset(mask, 0, sizeof mask);
        for (int k = 0; k < n_allowed; k++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            int id = (int)((st >> 33) % V);
            mask[id >> 5] |= 1u << (id & 31);
        }
        int allowed_finite = 0;
        for (int i = 0; i < V; i++) {
            bool on = (mask[i >> 5] >> (i & 31)) & 1u;
            premasked[i] = on ? logits[i] : -INFINITY;
            allowed_finite += on && logits[i] > -INFINITY;
        }
        if (allowed_finite == 0) continue;
        for (int k = 0; k < 12; k++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            hist[k] = (int)((st >> 33) % V);
        }
        struct row_params p = defaults();
        p.temperature = c % 5 == 0 ? 0.0f : (c % 5 == 1 ? 0.7f : (c % 5 == 2 ? 1.0f : 1.6f));
        p.seed = 1000 + (uint64_t)c;
        p.step = (uint64_t)c * 3;
        if (c % 3 == 0) {
            p.prompt = hist;
            p.n_prompt = 6;
            p.output = hist + 6;
            p.n_output = 6;
            p.repetition = 1.3f;
            p.frequency = 0.4f;
            p.presence = 0.25f;
        }
        struct row_result dense = sample_one(premasked, V, p);
        p.mask = mask;
        struct row_result sparse = sample_one(logits, V, p);
        ASSERT_EQ(sparse.id, dense.id);
        ASSERT_TRUE((mask[sparse.id >> 5] >> (sparse.id & 31)) & 1u);
        ASSERT_TRUE(sparse.logprob == dense.logprob);
        n_cases++;
        n_sparse_sized += n_allowed <= V / 2;
    }
    ASSERT_TRUE(n_cases > 300 && n_sparse_sized == n_cases);
    // A NaN at an allowed id flags the row; at a masked id it is masked away.
    for (int i = 0; i < V; i++)
        logits[i] = (float)(i % 17) * 0.1f;
    memset(mask, 0, sizeof mask);
    mask[0] = 0x0000f0f0u;
    struct row_params p = defaults();
    p.mask = mask;
    logits[5] = NAN;
    ASSERT_EQ(sample_one(logits, V, p).id, SAMPLE_ID_NONFINITE);
    logits[5] = 0.0f;
    logits[3] = NAN;
    int32_t id = sample_one(logits, V, p).id;
    ASSERT_TRUE(id >= 4 && id < 16 && ((mask[0] >> id) & 1u));
}

// Issue 28 item 4: a row holding a NaN or +inf logit (a broken model) is flagged with
// SAMPLE_ID_NONFINITE and NaN logprobs whatever the parameters, instead of a fixed token;
// -inf entries are legal (masks, bans) and a NaN only in a masked-out position is masked away.
TEST(nonfinite_logit_rows_are_flagged_not_sampled) {
    enum { V = 64 };
    float rows[5 * V];
    for (int i = 0; i < 5 * V; i++)
        rows[i] = (float)((i * 37) % 11) * 0.25f;
    rows[0 * V + 9] = NAN;       // row 0: one NaN
    rows[1 * V + 63] = INFINITY; // row 1: +inf
    for (int i = 0; i < V; i++)
        rows[2 * V + i] = NAN;   // row 2: all NaN
    rows[3 * V + 5] = -INFINITY; // row 3: -inf only: a normal row
    rows[4 * V + 7] = NAN;       // row 4: NaN at a masked-out id: a normal row
    uint32_t mask[2] = {0xffffffffu & ~(1u << 7), 0xffffffffu};
    struct row_params p[5];
    const float temps[2] = {0.0f, 0.7f};
    for (int t = 0; t < 2; t++) {
        for (int r = 0; r < 5; r++) {
            p[r] = defaults();
            p[r].temperature = temps[t];
            p[r].top_k = r == 1 ? 5 : 0;
            p[r].n_logprobs = 3;
            p[r].seed = 11;
        }
        p[4].mask = mask;
        struct row_result res[5];
        sample_rows(rows, V, 5, p, res);
        for (int r = 0; r < 3; r++) {
            ASSERT_EQ(res[r].id, SAMPLE_ID_NONFINITE);
            ASSERT_TRUE(isnan(res[r].logprob));
            ASSERT_EQ(res[r].top_ids[0], -1);
        }
        for (int r = 3; r < 5; r++) {
            ASSERT_TRUE(res[r].id >= 0 && res[r].id < V);
            ASSERT_TRUE(isfinite(res[r].logprob));
        }
        ASSERT_TRUE(res[3].id != 5 && res[4].id != 7);
    }
}

TEST(logits_are_left_unchanged) {
    float l[5] = {0.3f, -1.0f, 2.0f, 0.0f, 1.5f}, copy[5];
    memcpy(copy, l, sizeof l);
    int32_t out[2] = {2, 2};
    struct row_params p = defaults();
    p.temperature = 0.5f;
    p.top_k = 2;
    p.output = out;
    p.n_output = 2;
    p.presence = 1.0f;
    sample_one(l, 5, p);
    ASSERT_TRUE(memcmp(l, copy, sizeof l) == 0);
}

static int cmp_desc(const void *a, const void *b) {
    const double *x = a, *y = b; // pairs (value, id)
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : 1;
}

TEST(large_vocab_top_k_top_p_match_sorted_reference) {
    enum { V = 50000 };
    float *l = malloc(V * 4);
    double *w = malloc(V * 8), *pairs = malloc(V * 16);
    int *kept = malloc(V * sizeof(int));
    uint64_t st = 4242;
    for (int i = 0; i < V; i++) {
        st = st * 6364136223846793005ULL + 1442695040888963407ULL;
        // Coarse values: many exact ties, so the id tie-break matters.
        l[i] = (float)((st >> 33) % 400) / 40.0f;
    }
    float temps[2] = {1.0f, 0.6f}, tps[3] = {0.9f, 0.5f, 1.0f};
    int tks[3] = {0, 50, 3000};
    for (int ti = 0; ti < 2; ti++)
        for (int pi = 0; pi < 3; pi++)
            for (int ki = 0; ki < 3; ki++) {
                if (tps[pi] == 1.0f && tks[ki] == 0) continue;
                float inv = 1.0f / temps[ti];
                for (int i = 0; i < V; i++) {
                    w[i] = (double)(l[i] * inv);
                    pairs[2 * i] = w[i];
                    pairs[2 * i + 1] = i;
                }
                qsort(pairs, V, 16, cmp_desc);
                int n = tks[ki] > 0 ? tks[ki] : V;
                double m = pairs[0], total = 0;
                for (int i = 0; i < n; i++)
                    total += exp(pairs[2 * i] - m);
                int cut = n;
                double acc = 0;
                for (int i = 0; i < n; i++) {
                    acc += exp(pairs[2 * i] - m);
                    if (acc >= tps[pi] * total) {
                        cut = i + 1;
                        break;
                    }
                }
                memset(kept, 0, V * sizeof(int));
                for (int i = 0; i < cut; i++)
                    kept[(int)pairs[2 * i + 1]] = 1;
                struct row_params p = defaults();
                p.temperature = temps[ti];
                p.top_p = tps[pi];
                p.top_k = tks[ki];
                p.seed = 555;
                int bad = check_draws_n(l, V, p, w, kept, NULL, 40);
                if (bad)
                    test_fail(__FILE__, __LINE__, "T %g top_p %g top_k %d: %d mismatches", temps[ti], tps[pi], tks[ki],
                              bad);
            }
    free(l);
    free(w);
    free(pairs);
    free(kept);
}

TEST(draw_distribution_chi_square) {
    // 20000 draws (one seed, steps 0..19999) from a known 5-token distribution.
    double probs[5] = {0.05, 0.3, 0.15, 0.4, 0.1};
    float l[5];
    log_probs(l, probs, 5);
    enum { N = 20000 };
    struct row_params *p = malloc(N * sizeof *p);
    float *ls = malloc((size_t)N * 5 * 4);
    for (int i = 0; i < N; i++) {
        p[i] = defaults();
        p[i].seed = 2024;
        p[i].step = (uint64_t)i;
        memcpy(ls + (size_t)i * 5, l, sizeof l);
    }
    struct row_result *r = malloc(N * sizeof *r);
    sample_rows(ls, 5, N, p, r);
    int count[5] = {0};
    for (int i = 0; i < N; i++)
        count[r[i].id]++;
    double chi = 0;
    for (int i = 0; i < 5; i++) {
        double e = probs[i] * N;
        chi += (count[i] - e) * (count[i] - e) / e;
    }
    // df = 4: P(chi2 > 18.47) = 0.001.
    if (!(chi < 18.47))
        test_fail(__FILE__, __LINE__, "chi-square %g (counts %d %d %d %d %d)", chi, count[0], count[1], count[2],
                  count[3], count[4]);
    free(p);
    free(ls);
    free(r);
}

int main(int argc, char **argv) {
    int rc = test_main(argc, argv);
    backend_destroy(sampler_backend());
    return rc;
}
