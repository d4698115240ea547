// The engine on the CUDA backend (issue 6: "the engine stress test of the engine issue passes on
// the CUDA backend"): the scenarios of tests/engine_model_scenarios.h, which
// tests/test_engine_model.c runs on the CPU, with device "cuda" (BF16 weights, activations and
// KV cache; decode steps through CUDA graphs, or eager). Runs only where a GPU is
// (make CUDA=1 gpu-tests; build-cuda/tests/gpu/test_cuda_engine from the repository root);
// without one every test prints why and passes.
//
//   cuda_engine_random_stress_equals_alone      llama_gqa, ~3000 steps of random arrivals,
//       shared prefixes, exact repeats and aborts on a 32-block pool (forced preemption),
//       token budget 16 (chunked prefill), decode graphs on: every block free and every id
//       forgotten at the end, the decode graphs replayed, every finished request equal to the
//       prompt decoded alone.
//   cuda_engine_random_stress_eager             the same on qwen3 (head_dim 128), --enforce-eager.
//   cuda_engine_moe_random_stress_equals_alone  the same on mixtral (MoE, sliding window 16).
//   cuda_engine_batched_under_preemption_equals_alone, cuda_engine_prefix_hit_identical_to_cold.
//   cuda_engine_gpt_oss_random_stress_equals_alone  the stress on gpt_oss_mxfp4, the batch under
//       preemption on gpt_oss: with per-layer-group block tables (the engine's default for hybrid
//       sliding / full models: the sliding layers' own pool and table, read by the CUDA attention
//       and KV writes through attn_metadata.sliding, decode graphs included) against alone runs
//       with one table for every layer.
//   cuda_engine_mla_random_stress_equals_alone  deepseek_v2 / v3 (MLA, latent cache).
//   cuda_engine_qwen3_next_random_stress_equals_alone  qwen3_next (Gated DeltaNet state slots).
//
// Tolerances. The CPU runs compare exactly (fp32, margin 1e-4). On the GPU a row's BF16 logits
// depend on the rest of its batch: cuBLASLt chooses its GEMM algorithm by M, the attention
// kernel's KV split depends on the batch shape, chunked and whole prefills sum in different
// orders, so a request run inside a changing batch and run alone are not bitwise equal, and
// exact equality cannot be asked. Instead: tokens must be equal up to the first position where
// the two runs differ, and that position must be a near tie of the alone run (top-2 logprob
// margin below MARGIN_TOL); logprobs must agree within LP_TOL wherever the contexts are still
// equal. MARGIN_TOL = LP_TOL = 0.3 is 5% of these fixtures' logit scale (max |logit| ~6), the
// BF16 tolerance tests/gpu/test_cuda_models.c states against HF fp32 (worst measured 3.05%);
// two GPU runs share the BF16 weight rounding, so they differ by less. At least 30% of all
// tokens must have been equal at a margin above MARGIN_TOL (about 55-60% of the tokens of
// these fixtures have such a margin), so the comparison cannot pass vacuously.
#include <stdio.h>

#include "backend/backend.h"
#include "engine_model_scenarios.h"
#include "test.h"

#define MARGIN_TOL 0.3f
#define LP_TOL 0.3f

#define CUDA_SETUP(eager)                                                                                              \
    {                                                                                                                  \
        .device = "cuda", .enforce_eager = (eager), .margin_tol = MARGIN_TOL, .lp_tol = LP_TOL,                        \
        .lp_tol_cached = LP_TOL, .min_clear = 0.3                                                                      \
    }
static const struct es_setup GRAPHS = CUDA_SETUP(false), EAGER = CUDA_SETUP(true);

// Whether a CUDA device can be opened (checked once; the tests skip without one).
static bool gpu_present(void) {
    static int state = -1;
    if (state < 0) {
        struct backend *b = NULL;
        struct error err = {0};
        struct backend_options o = {.device_id = 0, .kv_pool_bytes = 16u << 20};
        state = backend_create("cuda", &o, &b, &err) == ATOMC_OK;
        if (state)
            backend_destroy(b);
        else
            fprintf(stderr, "  no CUDA backend (%s): skipped\n", err.msg);
    }
    return state == 1;
}

TEST(cuda_engine_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&GRAPHS, "llama_gqa", 0x5eed1234ull, 32);
}

TEST(cuda_engine_random_stress_eager) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&EAGER, "qwen3", 0x0ddba11ull, 32);
}

TEST(cuda_engine_moe_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&GRAPHS, "mixtral", 0x5eed1234ull, 24);
}

TEST(cuda_engine_batched_under_preemption_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_batched_under_preemption_equals_alone(&GRAPHS, "llama_gqa");
}

TEST(cuda_engine_prefix_hit_identical_to_cold) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_prefix_hit_identical_to_cold(&GRAPHS, "qwen3");
}

// GPT-OSS (sinks, windows of 8 on layers 0 and 2, MXFP4 experts decoded in the MoE kernels).
TEST(cuda_engine_gpt_oss_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&GRAPHS, "gpt_oss_mxfp4", 0x5eed1234ull, 24);
    es_batched_under_preemption_equals_alone(&GRAPHS, "gpt_oss");
}

// MLA over the latent cache (cuda_mla.cu) with shared experts and both DeepSeek routings, graphs on.
TEST(cuda_engine_mla_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&GRAPHS, "deepseek_v2", 0x5eed1234ull, 32);
    es_random_stress_equals_alone(&GRAPHS, "deepseek_v3", 0x5eed4321ull, 32);
    es_prefix_hit_identical_to_cold(&GRAPHS, "deepseek_v2");
    // A small step budget (16 tokens): the MLA workspace is sized for it, not for MLA_WS_TOKENS.
    es_batched_under_preemption_equals_alone(&GRAPHS, "deepseek_v2");
}

// Qwen3-Next: Gated DeltaNet state slots (graph padding writes the dummy slot), recompute after
// preemption resets a sequence's state, prefix caching off for the recurrent model. Its fixture's
// random routers put 13-30% of the tokens near a top-k tie, and a batched BF16 run picks another
// expert at some of them (test_cuda_deltanet.c: HF's own BF16 run moves single positions by up to
// 5.4): on the H200 one logprob of ~6000 compared differed from alone by 0.34. So this stress
// allows logprobs within 0.6 (10% of the logit scale); tokens are compared as for the others, and a
// clear-margin parting passes only as a routing flip (es_route_flip: the fp32 CPU run gives one of
// the two tokens and, with one router of that position whose top-k gap is below 0.1 swapped, the
// other; at most 1% of the requests). Session 13 and 14's failure was one: request 414 at output
// 16, where the last MoE layer's 2nd and 3rd experts are 0.047 apart in fp32 and the alone
// (reference) run took the other one (test_qwen3_next_engine.c
// qwen3_next_routing_flip_explains_h200_parting); 0.1 is 1.5% of these routers' logit scale (max
// |logit| 6.4), where MARGIN_TOL is 5% of the output logits'.
TEST(cuda_engine_qwen3_next_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    static const struct es_setup QN = {.device = "cuda",
                                       .margin_tol = MARGIN_TOL,
                                       .lp_tol = 0.6f,
                                       .lp_tol_cached = 0.6f,
                                       .min_clear = 0.3,
                                       .route_tol = 0.1f};
    es_random_stress_equals_alone(&QN, "qwen3_next", 0x51ab1e5ull, 24);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
