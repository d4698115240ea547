// Speculative decoding (ngram) on the CPU backend with real weights: greedy output with drafts is
// token-identical to greedy output without them
//   - on every tiny fixture of tests/fixtures/models, all its prompts in one continuous batch
//     (mixed prefill / decode steps, chunked prompts) plus copy-heavy variants that make prompt
//     lookup hit;
//   - under preemption, chunked prefill and prefix-cache hits, and in the randomized stress with
//     aborts (the scenarios of engine_model_scenarios.h with spec_k set: the runs under test use
//     drafts, the "alone" references do not);
//   - on SmolLM2-135M (real GGUF weights; skipped without $ATOMC_SMOLLM2): HF's greedy tokens and
//     the plain engine's, on its reference prompts and on a copy-heavy prompt, where most drafts
//     are accepted.
// "Identical" is es_compare's rule: equal up to the first position where the reference's top-2
// margin is an fp32 near tie (< 1e-4), since a verify row is computed in a multi-token query
// (another summation order than a one-token decode). The logs count how many sequences were
// exactly equal to the end.
#include <jansson.h>
#include <stdlib.h>

#include "atomc.h"
#include "common/check.h"
#include "engine_model_scenarios.h"
#include "test.h"

static const struct es_setup CPU_SPEC = {
    .device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f, .min_clear = 0.5, .spec_k = 4};

static const char *ALL_MODELS[] = {
    "llama_gqa",       "llama_mha", "llama_tied", "llama_bias", "llama_rope_llama3", "llama_rope_linear",
    "mistral_sliding", "mixtral",   "qwen3",      "qwen3_moe",  "qwen3_moe_sparse2", "qwen3_yarn"};

// All of a fixture's prompts plus copy-heavy variants (the prompt's ids twice, and a short
// pattern repeated), 24 new tokens each, in one batch on engine e.
static int run_batch(atomc_engine *e, const char *model, struct es_out *outs, int max_p) {
    json_t *refs = es_load_refs(model);
    json_t *prompts = json_object_get(refs, "prompts");
    static int32_t ids[32][256];
    int n_ids[32], n_p = 0;
    for (size_t i = 0; i < json_array_size(prompts) && n_p + 2 <= max_p; i++) {
        int n = es_json_ids(json_object_get(json_array_get(prompts, i), "ids"), ids[n_p], 100);
        n_ids[n_p++] = n;
        memcpy(ids[n_p], ids[n_p - 1], (size_t)n * sizeof(int32_t)); // the prompt twice: a quote
        memcpy(ids[n_p] + n, ids[n_p - 1], (size_t)n * sizeof(int32_t));
        n_ids[n_p++] = 2 * n;
    }
    for (int i = 0; i < 40; i++)
        ids[n_p][i] = (int32_t)(3 + (i % 5) * 17);
    n_ids[n_p++] = 40;
    json_decref(refs);
    for (int i = 0; i < n_p; i++)
        es_add(e, ids[i], n_ids[i], 24, &outs[i], NULL);
    es_run(e);
    return n_p;
}

TEST(spec_model_greedy_identical_every_fixture) {
    struct es_setup plain = es_plain(&CPU_SPEC);
    uint64_t total_acc = 0;
    for (size_t m = 0; m < sizeof ALL_MODELS / sizeof ALL_MODELS[0]; m++) {
        static struct es_out ref[32], got[32];
        atomc_engine *e = es_make(&plain, ALL_MODELS[m], 16, 128, 0, 8, 64, true);
        int n_p = run_batch(e, ALL_MODELS[m], ref, 32);
        atomc_engine_free(e);
        e = es_make(&CPU_SPEC, ALL_MODELS[m], 16, 128, 0, 8, 64, true);
        ASSERT_EQ(run_batch(e, ALL_MODELS[m], got, 32), n_p);
        atomc_stats st;
        atomc_engine_get_stats(e, &st);
        int exact = 0;
        for (int i = 0; i < n_p; i++) {
            ASSERT_EQ(got[i].reason, ATOMC_FINISH_LENGTH);
            ASSERT_EQ(got[i].n, 24);
            int k = es_compare(&ref[i], &got[i], CPU_SPEC.margin_tol, NULL);
            if (k < 0) {
                test_fail(__FILE__, __LINE__, "%s prompt %d: output with ngram drafts differs at a clear margin",
                          ALL_MODELS[m], i);
                break;
            }
            for (int t = 0; t < k; t++)
                ASSERT_NEAR(got[i].lp[t], ref[i].lp[t], CPU_SPEC.lp_tol);
            exact += k == 24;
        }
        fprintf(stderr, "  %-18s %2d prompts, %2d identical to the end%s\n", ALL_MODELS[m], n_p, exact,
                es_spec_line(e));
        ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
        ASSERT_TRUE(st.spec_num_drafts > 0);
        total_acc += st.spec_num_accepted_tokens;
        atomc_engine_free(e);
        if (test_failed_now()) return;
    }
    ASSERT_TRUE(total_acc > 0);
}

// Tensor parallel (2 CPU ranks) with drafts: the runner's larger logits capacity reaches every rank.
TEST(spec_model_tensor_parallel_identical) {
    struct es_setup plain = es_plain(&CPU_SPEC);
    static struct es_out ref[32], got[32];
    atomc_engine *e = es_make(&plain, "llama_gqa", 16, 128, 0, 8, 64, true);
    int n_p = run_batch(e, "llama_gqa", ref, 32);
    atomc_engine_free(e);
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    char path[1024];
    snprintf(path, sizeof path, "%s", test_fixture("models/llama_gqa"));
    o.model_path = path;
    o.num_kv_blocks = 128;
    o.max_num_seqs = 8;
    o.max_num_batched_tokens = 64;
    o.num_threads = 1;
    o.tensor_parallel_size = 2;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 4;
    o.prompt_lookup_min = 1;
    o.prompt_lookup_max = 3;
    o.speculative_disable_by_batch_size = -1;
    char err[512];
    ASSERT_EQ(atomc_engine_create(&o, &e, err, sizeof err), ATOMC_OK);
    ASSERT_EQ(run_batch(e, "llama_gqa", got, 32), n_p);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    fprintf(stderr, "  llama_gqa tp=2%s\n", es_spec_line(e));
    ASSERT_TRUE(st.spec_num_accepted_tokens > 0);
    for (int i = 0; i < n_p; i++) {
        ASSERT_EQ(got[i].n, 24);
        ASSERT_TRUE(es_compare(&ref[i], &got[i], 1e-3f, NULL) >= 0); // TP sums in another order too
    }
    atomc_engine_free(e);
}

TEST(spec_model_batched_under_preemption_equals_alone) {
    es_batched_under_preemption_equals_alone(&CPU_SPEC, "llama_gqa");
    if (test_failed_now()) return;
    es_batched_under_preemption_equals_alone(&CPU_SPEC, "qwen3_moe");
}

TEST(spec_model_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU_SPEC, "qwen3");
}

TEST(spec_model_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU_SPEC, "llama_gqa", 0x5eed1234ull, 32);
}

TEST(spec_model_sliding_window_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU_SPEC, "mixtral", 0x5eed1234ull, 24);
}

// SmolLM2: the reference prompts (64 greedy tokens, against HF's and the plain engine's) and a
// copy-heavy request (quote a paragraph back), all in one batch, with and without ngram drafts.
#define SMOL_NEW 64
struct smol_run {
    struct es_out out[10];
    atomc_stats st;
    int n;
};

static void smol_run(const char *path, int k, int32_t ids[][512], const int *n_ids, int n, struct smol_run *r) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = path;
    o.max_model_len = 512;
    o.max_num_seqs = 8;
    o.max_num_batched_tokens = 256;
    o.cpu_kv_cache_bytes = 64u << 20;
    if (k) {
        o.speculative_method = "ngram";
        o.num_speculative_tokens = k;
        o.prompt_lookup_min = 2;
        o.prompt_lookup_max = 4;
    }
    atomc_engine *e;
    char err[512];
    CHECK_MSG(atomc_engine_create(&o, &e, err, sizeof err) == ATOMC_OK, "%s", err);
    for (int i = 0; i < n; i++)
        es_add(e, ids[i], n_ids[i], SMOL_NEW, &r->out[i], NULL);
    es_run(e);
    atomc_engine_get_stats(e, &r->st);
    r->n = n;
    atomc_engine_free(e);
}

TEST(spec_model_smollm2_greedy_identical) {
    const char *path = test_smollm2_path();
    if (!path) return;
    json_error_t je;
    json_t *root = json_load_file(test_fixture("models/smollm2_refs.json"), 0, &je);
    ASSERT_TRUE(root != NULL);
    json_t *prompts = json_object_get(root, "prompts");
    static int32_t ids[10][512], hf[10][SMOL_NEW];
    static float hf_margin[10][SMOL_NEW];
    int n_ids[10], n = 0;
    for (size_t i = 0; i < json_array_size(prompts) && n < 9; i++, n++) {
        json_t *p = json_array_get(prompts, i);
        n_ids[n] = es_json_ids(json_object_get(p, "ids"), ids[n], 512);
        es_json_ids(json_object_get(p, "greedy"), hf[n], SMOL_NEW);
        json_t *mg = json_object_get(p, "greedy_margins");
        for (int t = 0; t < SMOL_NEW; t++)
            hf_margin[n][t] = (float)json_number_value(json_array_get(mg, (size_t)t));
    }
    json_decref(root);
    int n_hf = n;
    // Copy-heavy: the chat template's shape written out, asking to repeat a paragraph.
    static const char *quote =
        "<|im_start|>user\nRepeat the following paragraph exactly, word for word.\n\nThe old lighthouse stood "
        "at the edge of the cliff, its white paint peeling in long strips. Every night the keeper climbed the "
        "ninety-nine steps to light the lamp, and every morning he climbed them again to put it out.<|im_end|>\n"
        "<|im_start|>assistant\n";
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = path;
    o.max_model_len = 512;
    o.cpu_kv_cache_bytes = 64u << 20;
    atomc_engine *e;
    char err[512];
    ASSERT_EQ(atomc_engine_create(&o, &e, err, sizeof err), ATOMC_OK);
    int32_t *q = NULL;
    int nq = 0;
    ASSERT_EQ(atomc_engine_tokenize(e, quote, strlen(quote), false, &q, &nq), ATOMC_OK);
    atomc_engine_free(e);
    ASSERT_TRUE(nq > 30 && nq < 512);
    memcpy(ids[n], q, (size_t)nq * sizeof *q);
    n_ids[n++] = nq;
    atomc_free(q);

    static struct smol_run plain, spec;
    smol_run(path, 0, ids, n_ids, n, &plain);
    smol_run(path, 4, ids, n_ids, n, &spec);
    int exact = 0;
    for (int i = 0; i < n; i++) {
        ASSERT_EQ(spec.out[i].n, SMOL_NEW);
        int k = es_compare(&plain.out[i], &spec.out[i], 1e-4f, NULL);
        if (k < 0) {
            test_fail(__FILE__, __LINE__, "prompt %d: output with ngram drafts differs from the plain engine", i);
            return;
        }
        exact += k == SMOL_NEW;
        if (i < n_hf) { // and from HF's greedy tokens, up to a near tie of HF's
            int same = 0;
            while (same < SMOL_NEW && spec.out[i].toks[same] == hf[i][same])
                same++;
            if (same < SMOL_NEW && hf_margin[i][same] > 2e-3f)
                test_fail(__FILE__, __LINE__, "prompt %d: token %d is %d, HF %d", i, same, spec.out[i].toks[same],
                          hf[i][same]);
        }
    }
    const atomc_stats *st = &spec.st;
    fprintf(stderr,
            "  SmolLM2 %d prompts x %d tokens (the last copy-heavy): %d identical to the plain engine to the end; "
            "steps %llu plain, %llu with ngram k=4; %llu drafts, %llu of %llu draft tokens accepted (%.1f%%), "
            "mean acceptance length %.2f\n",
            n, SMOL_NEW, exact, (unsigned long long)plain.st.num_steps, (unsigned long long)st->num_steps,
            (unsigned long long)st->spec_num_drafts, (unsigned long long)st->spec_num_accepted_tokens,
            (unsigned long long)st->spec_num_draft_tokens,
            st->spec_num_draft_tokens ? 100.0 * st->spec_num_accepted_tokens / st->spec_num_draft_tokens : 0.0,
            st->spec_num_drafts ? 1.0 + (double)st->spec_num_accepted_tokens / st->spec_num_drafts : 0.0);
    ASSERT_TRUE(st->spec_num_accepted_tokens > 20);
    ASSERT_TRUE(st->num_steps < plain.st.num_steps);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
