// What the CUDA backend can run (struct backend_caps, backend.h). Plain C, compiled into every
// build: model loading checks a config against this table before anything reaches a kernel, and
// tests/test_backend_caps.c drives that check without a GPU. Each entry mirrors a kernel limit:
// attention is instantiated for head dims 64 and 128 with equal q/k and v dims
// (cuda_attention.cu), the KV cache is BF16 or FP8 E4M3 with power-of-two blocks, matmuls take
// BF16 weights (cuBLASLt / the GEMVs with BF16 activations) and the quantized schemes of
// cuda_qmatmul.cu / cuda_moe_quant.cu (FP8 E4M3 values per tensor / per channel / in blocks,
// with or without their dynamic FP8 activations; INT4 / INT8 packed in I32 words with group
// scales), routing is softmax top-k over at most CUDA_MOE_MAX_EXPERTS experts (cuda_moe.cu).
#include "backend/backend.h"
#include "backend/cuda/cuda_limits.h"

const struct backend_caps backend_cuda_caps = {
    .name = "cuda",
    .head_dims = {64, 128},
    .n_head_dims = 2,
    .split_v_head_dim = false,
    .max_qk_norm_head_dim = CUDA_QKN_MAX_HD,
    .kv_dtypes = BACKEND_CAP_BIT(DTYPE_BF16) | BACKEND_CAP_BIT(DTYPE_FP8_E4M3),
    .weight_dtypes = BACKEND_CAP_BIT(DTYPE_BF16) | BACKEND_CAP_BIT(DTYPE_FP8_E4M3) | BACKEND_CAP_BIT(DTYPE_I32),
    .weight_schemes = BACKEND_CAP_BIT(WEIGHT_SCHEME_NONE) | BACKEND_CAP_BIT(WEIGHT_SCHEME_PER_TENSOR) |
                      BACKEND_CAP_BIT(WEIGHT_SCHEME_PER_CHANNEL) | BACKEND_CAP_BIT(WEIGHT_SCHEME_BLOCK) |
                      BACKEND_CAP_BIT(WEIGHT_SCHEME_GROUP),
    .max_experts = CUDA_MOE_MAX_EXPERTS,
    .moe_sigmoid_scoring = false,
    .moe_grouped_topk = false,
    .pow2_block_size = true,
    .min_block_size = CUDA_ATTN_BN / 32,
};
