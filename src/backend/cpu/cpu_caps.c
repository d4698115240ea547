// What the CPU backend (the reference) can run (struct backend_caps, backend.h): attention of any
// head dim, F32 / BF16 / F16 / FP8 E4M3 KV, weights in F32 / BF16 / F16 and GGUF Q8_0 / Q4_0 / Q4_1 /
// Q4_K / Q5_K / Q6_K / Q8_K (cpu_backend.c upload_weight and matmul), softmax / sigmoid (grouped) top-k routing,
// MLA over a latent cache (cpu_mla.c), and
// the quantized weight schemes of cpu_qmatmul.c: FP8 E4M3 values per tensor / per channel / in
// blocks, packed integers (I32 words) with group scales, and MXFP4 (U8 nibbles, e8m0 scales);
// moe_experts with GPT-OSS's clamped SwiGLU and expert biases.
#include "backend/backend.h"

const struct backend_caps backend_cpu_caps = {
    .name = "cpu",
    .n_head_dims = 0,
    .split_v_head_dim = true, // cpu_attention takes any v head dim (MiMo-V2-Flash)
    .max_qk_norm_head_dim = 0,
    .kv_dtypes = BACKEND_CAP_BIT(DTYPE_F32) | BACKEND_CAP_BIT(DTYPE_BF16) | BACKEND_CAP_BIT(DTYPE_F16) |
                 BACKEND_CAP_BIT(DTYPE_FP8_E4M3),
    .weight_dtypes = BACKEND_CAP_BIT(DTYPE_F32) | BACKEND_CAP_BIT(DTYPE_BF16) | BACKEND_CAP_BIT(DTYPE_F16) |
                     BACKEND_CAP_BIT(DTYPE_Q8_0) | BACKEND_CAP_BIT(DTYPE_Q4_0) | BACKEND_CAP_BIT(DTYPE_Q4_1) |
                     BACKEND_CAP_BIT(DTYPE_Q4_K) | BACKEND_CAP_BIT(DTYPE_Q5_K) | BACKEND_CAP_BIT(DTYPE_Q6_K) |
                     BACKEND_CAP_BIT(DTYPE_Q8_K) | BACKEND_CAP_BIT(DTYPE_FP8_E4M3) | BACKEND_CAP_BIT(DTYPE_I32) |
                     BACKEND_CAP_BIT(DTYPE_U8),
    .weight_schemes = BACKEND_CAP_BIT(WEIGHT_SCHEME_NONE) | BACKEND_CAP_BIT(WEIGHT_SCHEME_PER_TENSOR) |
                      BACKEND_CAP_BIT(WEIGHT_SCHEME_PER_CHANNEL) | BACKEND_CAP_BIT(WEIGHT_SCHEME_BLOCK) |
                      BACKEND_CAP_BIT(WEIGHT_SCHEME_GROUP) | BACKEND_CAP_BIT(WEIGHT_SCHEME_MX),
    .max_experts = 0,
    .moe_sigmoid_scoring = true,
    .moe_grouped_topk = true,
    .moe_swiglu_clamp = true,
    .pow2_block_size = false,
    .min_block_size = 1,
    .mla = true,
    .dsa = true,
    .gated_deltanet = true,
    .max_deltanet_head_dim = 0,
    .max_deltanet_conv_kernel = 64,
};
