// The engine end to end on the CPU backend with the tiny random-weight models of
// tests/fixtures/models (HF transformers references from tools/make_tiny_models.py):
// greedy continuations through atomc_engine equal HF's where the top-2 margin is clear;
// a batch run on a KV pool small enough to force preemption, with chunked prefill and shared
// prefixes, gives every request the same tokens (and logprobs) as running it alone; a
// prefix-cache hit gives the same tokens and logprobs as a cold run; the engine issue's
// randomized stress (thousands of steps, preemption, aborts) ends with every block free and
// every request equal to the prompt decoded alone (also on the MLA fixture deepseek_v2). The last three are the scenarios of
// engine_model_scenarios.h, which tests/gpu/test_cuda_engine.c runs on the CUDA backend.
#include <jansson.h>
#include <stdlib.h>

#include "atomc.h"
#include "common/check.h"
#include "engine_model_scenarios.h"
#include "test.h"

// fp32: a row's result does not depend on the batch beyond summation order.
static const struct es_setup CPU = {
    .device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f, .min_clear = 0.5};

static const char *MODELS[] = {"llama_gqa",         "llama_mha",         "llama_tied", "llama_bias",
                               "llama_rope_llama3", "llama_rope_linear", "qwen3",      "deepseek_v2", "deepseek_v3"};

TEST(engine_model_greedy_matches_hf) {
    for (size_t m = 0; m < sizeof MODELS / sizeof MODELS[0]; m++) {
        json_t *refs = es_load_refs(MODELS[m]);
        json_t *prompts = json_object_get(refs, "prompts");
        atomc_engine *e = es_make(&CPU, MODELS[m], 16, 128, 0, 8, 64, true);
        static struct es_out outs[16];
        int32_t ids[16][256];
        int n_ids[16], n_p = (int)json_array_size(prompts);
        CHECK(n_p <= 16);
        for (int i = 0; i < n_p; i++) {
            json_t *p = json_array_get(prompts, (size_t)i);
            n_ids[i] = es_json_ids(json_object_get(p, "ids"), ids[i], 256);
            es_add(e, ids[i], n_ids[i], (int)json_array_size(json_object_get(p, "greedy")), &outs[i], NULL);
        }
        es_run(e); // all prompts in one continuous batch (budget 64: chunked)
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
    es_batched_under_preemption_equals_alone(&CPU, "llama_gqa");
}

TEST(engine_model_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU, "qwen3");
}

TEST(engine_model_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, "llama_gqa", 0x5eed1234ull, 32);
}

// The same on a mixture-of-experts model with a sliding window (16) that long requests cross: its
// blocks out of the window are freed while it runs (a pool of 24 blocks still preempts).
TEST(engine_model_moe_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, "mixtral", 0x5eed1234ull, 24);
}

// The three scenarios on a multi-head latent attention model (DeepSeek-V2: latent cache, shared
// experts): preemption, chunked prefill, prefix hits and aborts over latent blocks.
TEST(engine_model_mla_batched_under_preemption_equals_alone) {
    es_batched_under_preemption_equals_alone(&CPU, "deepseek_v2");
}

TEST(engine_model_mla_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU, "deepseek_v2");
}

TEST(engine_model_mla_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, "deepseek_v2", 0x5eed1234ull, 32);
}

// DeepSeek-V3 (q_lora, noaux_tc grouped sigmoid routing, a dense first layer) under the same stress.
TEST(engine_model_mla_v3_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, "deepseek_v3", 0x5eed4321ull, 32);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
