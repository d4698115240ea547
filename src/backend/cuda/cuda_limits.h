// Limits of the CUDA kernels that decide what models the backend can run. Plain C so that both
// the kernels (.cu) and the capability table (cuda_caps.c, compiled into every build so the
// load-time check is unit-testable without a GPU) use the same numbers.
#ifndef ATOMC_BACKEND_CUDA_LIMITS_H
#define ATOMC_BACKEND_CUDA_LIMITS_H

#define CUDA_MOE_MAX_EXPERTS 1024 // routing kernel's shared-memory histogram
#define CUDA_QKN_MAX_HD 256       // per-head q/k RMSNorm fused into rope_kv_write
#define CUDA_ATTN_BN 64           // KV tokens per attention tile; block size >= CUDA_ATTN_BN / 32
#define CUDA_MLA_MAX_KV_LORA 512  // MLA: latent output dims a lane keeps in registers (L / 32 each)
#define CUDA_MLA_MAX_ROPE 128     // MLA: rope dims per head

#endif
