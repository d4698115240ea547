// Speculative decoding (ngram, k = 4; mtp, k = 3 on deepseek_v3_mtp; eagle3, k = 3 on llama_gqa with
// tiny_eagle3) on the CUDA backend: the engine scenarios of
// tests/engine_model_scenarios.h with spec_k set, so the runs under test carry draft tokens
// (verify steps of 1 + k query tokens per sequence, run eagerly; steps without drafts still
// replay the decode graphs) and the references ("alone", without speculation) do not. BF16
// tolerances as in tests/gpu/test_cuda_engine.c (its top comment): tokens equal up to a near tie
// of the reference (margin < 0.3), logprobs within 0.3 while the contexts agree. Runs only where a
// GPU is (make CUDA=1 gpu-tests; build-cuda/tests/gpu/test_cuda_spec); without one every test
// is skipped with the reason (a failure under ATOMC_REQUIRE_FIXTURES=1).
//
// Benchmark commands for the H200 (the serving issue runs them): the verify path at a chosen
// acceptance on random weights,
//   build-cuda/atomc bench throughput --device cuda --model bench/configs/llama3_1_8b.json --load-format dummy
//       --num-prompts 64 --input-len 1024 --output-len 256 --method ngram --num-speculative-tokens 4
//       --spec-forced-acceptance 0.7 --max-num-seqs 1    (and 4, 16, 64: the fall-back rule)
// the MTP path (the MTP pass and its chain run for real; drafts forced to the chosen acceptance) on
// DeepSeek-V3 layer shapes with dummy weights,
//   build-cuda/atomc bench throughput --device cuda --model bench/configs/deepseek_v3_4layers.json
//       --load-format dummy --num-prompts 64 --input-len 1024 --output-len 256 --method mtp
//       --num-speculative-tokens 3 --spec-forced-acceptance 0.7 --max-num-seqs 1   (and 4, 16)
// the EAGLE-3 path (a random head of EAGLE3-LLaMA3.1-Instruct-8B's shape: its passes and chain run
// for real, drafts forced; the head's cost is the ratio to the same run with --method ngram),
//   build-cuda/atomc bench throughput --device cuda --model bench/configs/llama3_1_8b.json --load-format dummy
//       --num-prompts 64 --input-len 1024 --output-len 256 --speculative-config '{"method": "eagle3",
//       "model": "bench/configs/eagle3_llama3_1_8b.json", "num_speculative_tokens": 3}'
//       --spec-forced-acceptance 0.7 --max-num-seqs 1    (and 4, 16)
// and SmolLM2's copy-heavy workload with real drafts:
//   make CUDA=1 bench && build-cuda/bench/spec_ngram_bench SmolLM2-135M-Instruct.Q4_1.gguf 4 0 128 1,4,16,32 copy cuda
#include <stdio.h>

#include "backend/backend.h"
#include "engine_model_scenarios.h"
#include "test.h"

#define CUDA_SPEC(eager)                                                                                               \
    {                                                                                                                  \
        .device = "cuda", .enforce_eager = (eager), .margin_tol = 0.3f, .lp_tol = 0.3f, .lp_tol_cached = 0.3f,         \
        .min_clear = 0.3, .spec_k = 4                                                                                  \
    }
static const struct es_setup GRAPHS = CUDA_SPEC(false), EAGER = CUDA_SPEC(true);
// Method mtp on the DeepSeek-V3 fixture with an MTP layer (tools/make_tiny_mtp.py): the MTP pass
// and its chained drafts through the CUDA ops (MLA, MoE), plain decode steps through the graphs.
static const struct es_setup MTP_GRAPHS = {.device = "cuda", .margin_tol = 0.3f, .lp_tol = 0.3f,
                                           .lp_tol_cached = 0.3f, .min_clear = 0.3, .spec_k = 3,
                                           .spec_method = "mtp"};

// Method eagle3 on the tiny Llama target with the EAGLE-3 head tests/fixtures/tiny_eagle3
// (tools/make_tiny_eagle3.py): the aux-state capture inside the target's forward (graphs and
// eager), the head's passes and chained drafts through the CUDA ops (eager), verification as for
// every method.
static const struct es_setup E3_GRAPHS = {.device = "cuda", .margin_tol = 0.3f, .lp_tol = 0.3f,
                                          .lp_tol_cached = 0.3f, .min_clear = 0.3, .spec_k = 3,
                                          .spec_method = "eagle3", .spec_model = "tiny_eagle3"};
static const struct es_setup E3_EAGER = {.device = "cuda", .enforce_eager = true, .margin_tol = 0.3f, .lp_tol = 0.3f,
                                         .lp_tol_cached = 0.3f, .min_clear = 0.3, .spec_k = 3,
                                         .spec_method = "eagle3", .spec_model = "tiny_eagle3"};

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

TEST(cuda_spec_batched_under_preemption_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_batched_under_preemption_equals_alone(&GRAPHS, "llama_gqa");
}

TEST(cuda_spec_prefix_hit_identical_to_cold) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_prefix_hit_identical_to_cold(&EAGER, "qwen3");
}

TEST(cuda_spec_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&GRAPHS, "llama_gqa", 0x5eed1234ull, 32);
}

TEST(cuda_spec_moe_random_stress_eager) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&EAGER, "mixtral", 0x5eed1234ull, 24);
}

TEST(cuda_spec_mtp_batched_under_preemption_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_batched_under_preemption_equals_alone(&MTP_GRAPHS, "deepseek_v3_mtp");
}

TEST(cuda_spec_mtp_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&MTP_GRAPHS, "deepseek_v3_mtp", 0x5eed1234ull, 24);
}

TEST(cuda_spec_eagle3_batched_under_preemption_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_batched_under_preemption_equals_alone(&E3_GRAPHS, "llama_gqa");
    if (test_failed_now()) return;
    es_batched_under_preemption_equals_alone(&E3_EAGER, "llama_gqa");
}

TEST(cuda_spec_eagle3_prefix_hit_identical_to_cold) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_prefix_hit_identical_to_cold(&E3_GRAPHS, "llama_gqa");
}

TEST(cuda_spec_eagle3_random_stress_equals_alone) {
    if (!gpu_present()) SKIP("no CUDA device");
    es_random_stress_equals_alone(&E3_GRAPHS, "llama_gqa", 0x5eed3e3ull, 24);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
