// Quantized checkpoints as whole models on the CUDA backend (cuda_qmatmul.cu, cuda_moe_quant.cu)
// against the references the CPU matches tightly (tests/test_quant_cpu.c): the fixtures of
// tests/fixtures/quant whose head_dim CUDA's attention takes (64):
//   ct_w4a16_group128    compressed-tensors INT4 group 128, weight-only     -> refs.json
//   ct_w8a16_group128    compressed-tensors INT8 group 128, weight-only     -> refs.json
//   qwen3_moe_fp8_block  fp8 128x128 blocks, attention, dense MLP and MoE experts: weight-only
//                        (quant_weight_only) -> refs.json, and with its dynamic per-token-group
//                        FP8 activations (W8A8, the default) -> refs_w8a8.json
//                        (tools/make_w8a8_refs.py: torch's fake-quantized forward)
//   gptq_w4_g64_asym_desc_act_hd64, awq_w4_g64_hd64   GPTQ (zero points, desc_act g_idx) / AWQ GEMM,
//                        weight-only -> refs.json
//   fp8_static_hd64      quant_method fp8, per-tensor weights and static input scales: weight-only
//                        -> refs.json, W8A8 with the stored scales -> refs_w8a8.json
//   ct_w8a8_int8_static_hd64  compressed-tensors int-quantized INT8 weights, static INT8 activations:
//                        weight-only -> refs.json, W8A8 -> refs_w8a8.json
//   deepseek_v3_fp8_block  DeepSeek-V3 (MLA, grouped noaux_tc routing, a shared expert) in fp8
//                        blocks: weight-only -> refs.json, W8A8 -> refs_w8a8.json (kv_b_proj
//                        dequantized at load, its input unquantized; tools/make_tiny_deepseek_fp8.py)
//   ct_fp8_kv_hd64       compressed-tensors FP8 weights + kv_cache_scheme: the FP8 KV cache with the
//                        checkpoint's per-layer k_scale / v_scale -> refs_kv.json (K / V fake-quantized)
// Prefill logits at the reference positions within BF16_RTOL of max(1, max |ref|) (as
// test_cuda_models.c: BF16 activations, residual stream and KV; W8A8: W8A8_RTOL, see there),
// then 16 greedy steps whose decode steps replay CUDA graphs (quantized GEMVs and MoE slot
// kernels captured), equal to the reference's at every step with a clear top-2 margin. Also
// --quantization fp8 on CUDA against the CPU (cuda_online_fp8_matches_cpu). Runs only where a GPU
// is (make CUDA=1 gpu-test).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define BF16_RTOL 5e-2
#define BF16_MARGIN_FACTOR 1.2

// W8A8 on CUDA against torch's f32 fake-quantized forward: CUDA quantizes BF16 activations (BF16
// residual stream and attention), the reference f32 ones, so FP8 roundings flip apart all through
// the model, as in cuda_online_fp8_matches_cpu below (same bound). Measured on the H200:
// qwen3_moe_fp8_block W8A8 0.67 / 0.43 off refs_w8a8.json, while the W8A8 ops match the CPU at
// this fixture's shapes (test_cuda_qmatmul: k = 64, H 64 / I 32 experts, NMSE ~3e-6) and the
// same checkpoint weight-only (quant_weight_only) is 0.034 / 0.091 off refs.json: the weight-only
// run is the tight check of the block-FP8 weights, the W8A8 one a loose check of the activations.
#define W8A8_RTOL 0.25

static const struct {
    const char *name;
    const char *refs; // file beside the fixture
    bool weight_only; // quant_weight_only: the checkpoint's weights with BF16 activations
    double rtol;
} QMODELS[] = {
    {"ct_w4a16_group128", "refs.json", false, BF16_RTOL},
    {"ct_w8a16_group128", "refs.json", false, BF16_RTOL},
    {"qwen3_moe_fp8_block", "refs.json", true, BF16_RTOL},
    {"qwen3_moe_fp8_block", "refs_w8a8.json", false, W8A8_RTOL},
    // Issue 19 part 3 (tests/test_quant_formats.c on the CPU): GPTQ with desc_act's g_idx and zero
    // points, AWQ GEMM, quant_method fp8 with static per-tensor input scales (weight-only -> refs.json,
    // W8A8 with the stored scales -> refs_w8a8.json).
    {"gptq_w4_g64_asym_desc_act_hd64", "refs.json", false, BF16_RTOL},
    {"awq_w4_g64_hd64", "refs.json", false, BF16_RTOL},
    {"fp8_static_hd64", "refs.json", true, BF16_RTOL},
    {"fp8_static_hd64", "refs_w8a8.json", false, W8A8_RTOL},
    {"ct_w8a8_int8_static_hd64", "refs.json", true, BF16_RTOL},
    {"ct_w8a8_int8_static_hd64", "refs_w8a8.json", false, W8A8_RTOL},
    // DeepSeek-V3 in fp8 blocks (tools/make_tiny_deepseek_fp8.py): MLA over the latent cache with
    // q_a / q_b / kv_a / o on the block-FP8 GEMM / GEMV, kv_b_proj dequantized to BF16 at load for
    // the absorbed decode, routed + shared experts on the FP8 MoE path, layer 0's dense MLP plain.
    {"deepseek_v3_fp8_block", "refs.json", true, BF16_RTOL},
    {"deepseek_v3_fp8_block", "refs_w8a8.json", false, W8A8_RTOL},
    // compressed-tensors kv_cache_scheme (static FP8 per tensor): --kv-cache-dtype auto picks the FP8
    // cache, which stores K / k_scale and V / v_scale per layer (cuda_rope.cu) and multiplies back in
    // attention (cuda_attention.cu); refs_kv.json fake-quantizes K / V with the stored scales. The
    // fixture's K / V exceed 448, so scales ignored (1.0) would saturate them (tests/test_quant_kv.c).
    {"ct_fp8_kv_hd64", "refs_kv.json", true, BF16_RTOL},
};

TEST(cuda_quant_models_match_refs) {
    for (size_t mi = 0; mi < sizeof QMODELS / sizeof QMODELS[0]; mi++) {
        const char *name = QMODELS[mi].name;
        char rel[256], path[4096];
        snprintf(rel, sizeof rel, "quant/%s/%s", name, QMODELS[mi].refs);
        struct refs R;
        ASSERT_EQ(refs_load_rel(rel, &R, QMODELS[mi].rtol, BF16_MARGIN_FACTOR), 0);
        snprintf(rel, sizeof rel, "quant/%s", name);
        snprintf(path, sizeof path, "%s", test_fixture(rel));
        struct runner_options o = {
            .model_path = path, .device = "cuda", .dtype = "auto", .load_format = "auto", .kv_cache_dtype = "auto",
            .block_size = 16, .num_kv_blocks = 256, .max_num_seqs = 8, .max_num_batched_tokens = 512,
            .max_model_len = 128, .gpu_memory_utilization = 0.3, .enforce_eager = false,
            .quant_weight_only = QMODELS[mi].weight_only,
        };
        struct model_runner *r = NULL;
        struct error err = {0};
        if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  %s: %s\n", name, err.msg);
        ASSERT_TRUE(r != NULL);
        ASSERT_TRUE(model_runner_num_graphs(r) > 0);
        if (!strcmp(QMODELS[mi].refs, "refs_kv.json")) ASSERT_EQ(model_runner_kv_dtype_bytes(r), 1); // auto: FP8
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 41u + (unsigned)mi);
        double worst = 0;
        int checked = 0;
        float *lg = malloc(sizeof(float) * MAX_POS * (size_t)R.vocab);
        for (int pi = 0; pi < R.n; pi++) {
            struct ref_prompt *p = &R.p[pi];
            struct sim_seq *q = malloc(sizeof *q);
            sim_seq_init(q, p->ids, p->n);
            sim_step_begin(s);
            ASSERT_EQ(sim_step_add(s, q, p->n, 0), 0);
            for (int k = 0; k < p->n_pos; k++) s->rows[k] = p->pos[k];
            s->n_rows = p->n_pos;
            struct forward_batch fb = sim_step_batch(s);
            ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
            sim_step_commit(s);
            double d = max_abs_diff(lg, p->logits, p->n_pos * R.vocab);
            if (!(d <= R.tol))
                test_fail(__FILE__, __LINE__, "%s prompt %d: max |logit - ref| = %g > %g", name, pi, d, R.tol);
            worst = d > worst ? d : worst;
            int32_t got[N_GREEDY];
            const float *last = lg + (size_t)(p->n_pos - 1) * R.vocab;
            int best = 0;
            for (int v = 1; v < R.vocab; v++) best = last[v] > last[best] ? v : best;
            got[0] = best;
            q->ids[q->n_ids++] = best;
            for (int k = 1; k < N_GREEDY; k++) {
                sim_step_begin(s);
                ASSERT_EQ(sim_step_add(s, q, 1, 1), 0);
                fb = sim_step_batch(s);
                struct runner_output out;
                ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
                sim_step_commit(s);
                got[k] = out.ids[0];
                q->ids[q->n_ids++] = out.ids[0];
            }
            char what[128];
            snprintf(what, sizeof what, "%s (CUDA) prompt %d", name, pi);
            int c = greedy_compare(&R, p, got, what);
            ASSERT_TRUE(c >= 0);
            checked += c;
            sim_seq_release(s, q);
            free(q);
        }
        fprintf(stderr,
                "  %-20s %s max |logit - ref| = %.3g (tol %.3g), %d clear-margin greedy steps equal, %llu graph "
                "replays\n",
                name, QMODELS[mi].refs, worst, R.tol, checked, (unsigned long long)model_runner_num_graph_replays(r));
        ASSERT_TRUE(model_runner_num_graph_replays(r) > 0);
        free(lg);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// --quantization fp8 on CUDA against the same online quantization on the CPU (which reproduces
// torch's forward of it, tests/test_quant_cpu.c quant_online_fp8): llama_gqa and llama_bias (qkv
// biases through the quantized matmul), prefill logits of a 9-token prompt at every position.
// Weight-only (quant_weight_only): within BF16_RTOL of max(1, max |CPU logit|), the BF16
// activation tolerance of the other model tests. W8A8 (the default): the CUDA run quantizes
// bf16 activations, the CPU f32 ones, so near-ties round apart and these tiny random models
// amplify each flip (0.088 of ~2.6 seen on the CPU): bounded by W8A8_RTOL = 25% and printed.
static double logits_run(const char *path, const char *device, const char *dtype, bool weight_only, float *lg,
                         int *vocab) {
    struct runner_options o = {
        .model_path = path, .device = device, .dtype = dtype, .load_format = "auto", .kv_cache_dtype = "auto",
        .block_size = 16, .num_kv_blocks = 64, .max_num_seqs = 4, .max_num_batched_tokens = 64,
        .max_model_len = 64, .gpu_memory_utilization = 0.3, .enforce_eager = true, .num_threads = 2,
        .quantization = "fp8", .quant_weight_only = weight_only,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) {
        fprintf(stderr, "  %s on %s: %s\n", path, device, err.msg);
        return -1;
    }
    *vocab = model_runner_config(r)->vocab_size;
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 61u);
    const int32_t ids[9] = {3, 17, 29, 41, 5, 60, 77, 12, 90};
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, ids, 9);
    sim_step_begin(s);
    if (sim_step_add(s, q, 9, 0) != 0) return -1;
    for (int k = 0; k < 4; k++) s->rows[k] = 2 * k + 2; // positions 2, 4, 6, 8
    s->n_rows = 4;
    struct forward_batch fb = sim_step_batch(s);
    atomc_status st = model_runner_execute_logits(r, &fb, lg, &err);
    sim_seq_release(s, q);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
    return st == ATOMC_OK ? 0 : -1;
}

// The CPU reference loads the weights as BF16 (dtype bfloat16), as the CUDA backend stores an F32
// checkpoint's: online fp8 quantizes the weights as loaded, and FP8 rounding of BF16-rounded
// values differs from that of the F32 ones (llama_gqa is an F32 checkpoint: CPU F32 vs CPU BF16
// weights alone differ by 0.35 weight-only on the H200 run, CUDA vs CPU BF16 by 0.14).
TEST(cuda_online_fp8_matches_cpu) {
    static const char *const models[] = {"llama_gqa", "llama_bias"};
    for (int mi = 0; mi < 2; mi++) {
        char rel[256], path[4096];
        snprintf(rel, sizeof rel, "models/%s", models[mi]);
        snprintf(path, sizeof path, "%s", test_fixture(rel));
        for (int wo = 1; wo >= 0; wo--) {
            float *lc = malloc(sizeof(float) * 4 * 4096), *lg = malloc(sizeof(float) * 4 * 4096);
            int vc = 0, vg = 0;
            ASSERT_TRUE(logits_run(path, "cpu", "bfloat16", wo, lc, &vc) == 0);
            ASSERT_TRUE(vc <= 4096);
            ASSERT_TRUE(logits_run(path, "cuda", "auto", wo, lg, &vg) == 0);
            ASSERT_EQ(vc, vg);
            double scale = 1, d = max_abs_diff(lg, lc, 4 * vc);
            for (int i = 0; i < 4 * vc; i++) scale = fabs(lc[i]) > scale ? fabs(lc[i]) : scale;
            const double tol = (wo ? BF16_RTOL : W8A8_RTOL) * scale;
            fprintf(stderr, "  %-10s --quantization fp8 %s: max |CUDA - CPU| = %.4f (tol %.4f)\n", models[mi],
                    wo ? "weight-only" : "W8A8", d, tol);
            if (!(d <= tol)) test_fail(__FILE__, __LINE__, "%s online fp8 (weight-only %d): %g > %g", models[mi], wo, d, tol);
            free(lc);
            free(lg);
        }
    }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
