// GEMM through cuBLASLt: out(n, m) = x(n, k) @ w(m, k)^T (+ bias(m)).
//
// Row-major out(n, m) is column-major out^T (m, n), so each call is the column-major
// D(m, n) = W^T(m, k) . X(k, n) with W stored (k, m) and transposed: the "TN" layout that
// cuBLASLt runs fastest. Inputs BF16 (or F32/F16, all the same dtype), fp32 accumulation,
// output BF16 or F32 (F32 logits straight from the lm_head). The bias rides in the epilogue.
// Descriptors and the heuristic's algorithm are made once per (m, n, k, dtypes, bias) and
// cached in an open-addressing table; the 64 MiB workspace is allocated once at start-up,
// so a cached call is capture-safe.
//
// Single-row BF16 products (n = 1, k <= 8192, any m) skip cuBLASLt for a GEMV: one warp per
// output column streams its weight row once with 16-byte non-allocating loads (four per lane
// issued up front) and multiplies it into x (read through L1; it is tiny), warp-sum, bias, store.
// Four warps per block, so an m = 4096 projection runs 1024 blocks that spread evenly over the
// SMs, and there is no split-K reduce kernel: cuBLASLt's small-n kernels reached 63-76% of HBM
// bandwidth on the attention projections (docs/perf.md).
#include "backend/cuda/cuda_common.cuh"

#define GEMV_WARPS 4
// Only single rows take the GEMV: at n = 4 and 8 it is L1-bound (62% / 38% of HBM, every warp
// re-reads x) and slower than cuBLASLt (H200, docs/perf.md session 4).
#define GEMV_MAX_ROWS 1
// Single-row outputs of at most this many columns take the split-k GEMV. Qwen3-30B-A3B batch 1
// by limit: none 306.7, 1024 317.5, 4096 326.0, 8192 324.7 tok/s; Llama-3-8B 225.3 / 225.4 at
// 1024 / 8192 (H200 session 5, call 7: bench/results/h200-2026-11-29-s5/7-gemv-splitk-ab-1k1k-repeat.log;
// docs/perf.md session 5).
#define GEMV_SPLITK_MAX_M 4096
// Row GEMV: weight loads per lane issued before the PDL wait, and the blocks per SM its registers
// must allow (see gemv_bf16).
#define GEMV_ROW_PRE 4
#define GEMV_ROW_MINB 12

// The GEMVs issue their first weight loads before the PDL wait (weights are never written by
// the kernels they wait on), overlapping the previous kernel's tail: Qwen3-30B-A3B batch 1
// 340.2 -> 344.0 tok/s with both kernels (341.4 with the split-k one alone), Llama-3-8B unchanged
// (H200 session 6, call 6; docs/perf.md session 6). The host always passes early = true; the
// argument stays because it shapes the code: with an unconditional wait after the loads, ptxas
// (nvcc 13.0.88) schedules griddepcontrol.wait above the predicated weight loads, so nothing is
// loaded early (seen with nvdisasm); with the wait under `early` the loads stay ahead of it.

// out(1, m) = x(1, k) @ w(m, k)^T (+ bias); k % 8 == 0, x and w 16-byte aligned.
template <typename TO>
__global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_ROW_MINB)
    gemv_bf16_kernel(TO *out, const __nv_bfloat16 *x, const __nv_bfloat16 *w, const TO *bias, int64_t m, int64_t k,
                     bool early) {
    constexpr int PRE = GEMV_ROW_PRE;
    const int lane = threadIdx.x % 32;
    const int64_t col = (int64_t)blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    const __nv_bfloat16 *wr = w + (col < m ? col : 0) * k;
    if (!early) pdl_begin();
    uint4 wv[PRE];
#pragma unroll
    for (int i = 0; i < PRE; i++)
        if (lane * 8 + i * 256 < k) wv[i] = ld_stream16(wr + lane * 8 + i * 256);
    if (early) pdl_begin();
    if (col >= m) return;
    float acc = 0.f;
    auto fma_chunk = [&](int64_t kk, const uint4 &wq) {
        float wf[8], xf[8];
        bf16x8_to_f32(wq, wf);
        bf16x8_to_f32(__ldg(reinterpret_cast<const uint4 *>(x + kk)), xf);
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc = fmaf(wf[j], xf[j], acc);
    };
#pragma unroll
    for (int i = 0; i < PRE; i++)
        if (lane * 8 + i * 256 < k) fma_chunk(lane * 8 + i * 256, wv[i]);
#pragma unroll 8
    for (int64_t kk = lane * 8 + PRE * 256; kk < k; kk += 32 * 8)
        fma_chunk(kk, ld_stream16(wr + kk));
    float v = warp_sum(acc);
    if (lane == 0) {
        if (bias) v += to_f32(bias[col]);
        out[col] = from_f32<TO>(v);
    }
}

// Narrow outputs (m <= GEMV_SPLITK_MAX_M: the MoE router's 128 columns ran 32
// blocks, one round trip per warp of a 4 KB row; Qwen3-30B-A3B's o projection, 2048 columns of
// k = 4096, two round trips per warp; batch-1 decode 306.7 -> 326.0 tok/s, Llama-3-8B's
// projections unchanged, docs/perf.md session 5): the block's four warps share one
// column and take interleaved quarters of k (each lane's 16-byte steps 1 KB apart), then sum in
// shared memory in warp order (deterministic). One row of x only (decode).
// Registers bounded to 16 blocks per SM (32; 48 unbounded, 10 blocks) with 2 loads up front, so
// Qwen3-30B-A3B's o projection (2048 blocks) runs in one wave: batch 1 361.9 / 363.7 -> 369.8 /
// 371.1 tok/s, Llama-3-8B unchanged (H200 session 7, call 11; 4 loads at 16 blocks spill, +1.3%).
template <typename TO>
__global__ void __launch_bounds__(32 * GEMV_WARPS, 16)
    gemv_splitk_kernel(TO *out, const __nv_bfloat16 *x, const __nv_bfloat16 *w, const TO *bias, int64_t m, int64_t k,
                       bool early) {
    constexpr int PRE = 2; // weight loads per thread issued before the PDL wait
    __shared__ float part[GEMV_WARPS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t col = blockIdx.x;
    const __nv_bfloat16 *wr = w + col * k;
    const int64_t k0 = (int64_t)(warp * 32 + lane) * 8;
    if (!early) pdl_begin();
    uint4 wv[PRE];
#pragma unroll
    for (int i = 0; i < PRE; i++)
        if (k0 + i * GEMV_WARPS * 32 * 8 < k) wv[i] = ld_stream16(wr + k0 + i * GEMV_WARPS * 32 * 8);
    if (early) pdl_begin();
    float acc = 0.f;
    auto fma_chunk = [&](int64_t kk, const uint4 &wq) {
        float wf[8], xf[8];
        bf16x8_to_f32(wq, wf);
        bf16x8_to_f32(__ldg(reinterpret_cast<const uint4 *>(x + kk)), xf);
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc = fmaf(wf[j], xf[j], acc);
    };
    constexpr int STEP = GEMV_WARPS * 32 * 8;
#pragma unroll
    for (int i = 0; i < PRE; i++)
        if (k0 + i * STEP < k) fma_chunk(k0 + i * STEP, wv[i]);
#pragma unroll 4
    for (int64_t kk = k0 + PRE * STEP; kk < k; kk += STEP)
        fma_chunk(kk, ld_stream16(wr + kk));
    acc = warp_sum(acc);
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_WARPS; i++)
            v += part[i];
        if (bias) v += to_f32(bias[col]);
        out[col] = from_f32<TO>(v);
    }
}

// One row: out(1, m) = x(1, k) @ w(m, k)^T (+ bias).
template <typename TO>
static void gemv_bf16(cudaStream_t s, TO *out, const __nv_bfloat16 *x, const __nv_bfloat16 *w, const TO *bias,
                      int64_t m, int64_t k) {
    if (m <= GEMV_SPLITK_MAX_M) {
        pdl_launch(gemv_splitk_kernel<TO>, (unsigned)m, 32 * GEMV_WARPS, 0, s, out, x, w, bias, m, k, true);
        CUDA_CHECK_LAUNCH();
        return;
    }
    // GEMV_ROW_PRE 4 loads up front and registers bounded to GEMV_ROW_MINB 12 blocks per SM (40),
    // so the qkv projections of Qwen3-30B-A3B (1280 blocks) and Llama-3-8B (1536) run in one wave,
    // not two at 6 blocks per SM (76 registers with 8 loads up front). H200 batch 1 (session
    // 7, call 8): q3m 351.6/355.4 -> 360.2/360.6 tok/s, Llama-3-8B 216.4 -> 219.1/219.3.
    pdl_launch(gemv_bf16_kernel<TO>, cdiv(m, GEMV_WARPS), 32 * GEMV_WARPS, 0, s, out, x, w, bias, m, k, true);
    CUDA_CHECK_LAUNCH();
}

static cudaDataType_t lt_type(enum dtype t) {
    switch (t) {
    case DTYPE_F32:
        return CUDA_R_32F;
    case DTYPE_BF16:
        return CUDA_R_16BF;
    case DTYPE_F16:
        return CUDA_R_16F;
    default:
        CHECK_MSG(0, "matmul: unsupported dtype %s", dtype_name(t));
    }
    return CUDA_R_32F;
}

static uint64_t plan_hash(int64_t m, int64_t n, int64_t k, int it, int ot, bool bias) {
    uint64_t h = 1469598103934665603ull;
    uint64_t v[6] = {(uint64_t)m, (uint64_t)n, (uint64_t)k, (uint64_t)it, (uint64_t)ot, (uint64_t)bias};
    for (int i = 0; i < 6; i++) {
        h ^= v[i] + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h *= 1099511628211ull;
    }
    return h;
}

static void plan_release(struct matmul_plan *p) {
    if (!p->used) return;
    cublasLtMatmulDescDestroy(p->desc);
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->c);
    p->used = false;
}

void cuda_matmul_plans_destroy(struct cuda_backend *cb) {
    if (!cb->plans) return;
    for (int i = 0; i < MATMUL_PLAN_CAP; i++)
        plan_release(&cb->plans[i]);
    cb->n_plans = 0;
}

static struct matmul_plan *plan_get(struct cuda_backend *cb, int64_t m, int64_t n, int64_t k, enum dtype it,
                                    enum dtype ot, bool bias) {
    uint64_t h = plan_hash(m, n, k, it, ot, bias);
    for (int probe = 0; probe < MATMUL_PLAN_CAP; probe++) {
        struct matmul_plan *p = &cb->plans[(h + probe) % MATMUL_PLAN_CAP];
        if (!p->used) break;
        if (p->m == m && p->n == n && p->k == k && p->in_dtype == it && p->out_dtype == ot && p->has_bias == bias)
            return p;
    }
    // Not cached: make it. A full table (an unbounded stream of prefill sizes) starts over;
    // a plan in use by queued work is only host-side descriptors, so this is safe.
    if (cb->n_plans >= MATMUL_PLAN_CAP * 3 / 4) cuda_matmul_plans_destroy(cb);
    struct matmul_plan *p = NULL;
    for (int probe = 0; probe < MATMUL_PLAN_CAP; probe++) {
        p = &cb->plans[(h + probe) % MATMUL_PLAN_CAP];
        if (!p->used) break;
    }
    memset(p, 0, sizeof *p);
    p->m = m;
    p->n = n;
    p->k = k;
    p->in_dtype = it;
    p->out_dtype = ot;
    p->has_bias = bias;
    cublasComputeType_t ct = it == DTYPE_F32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, ct, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (bias) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        cudaDataType_t bt = lt_type(ot);
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, lt_type(it), k, m, k)); // W stored (k, m) col-major
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, lt_type(it), k, n, k)); // X stored (k, n) col-major
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, lt_type(ot), m, n, m)); // out (m, n) col-major
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = cb->lt_workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t res[1];
    int nres = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cb->lt, p->desc, p->a, p->b, p->c, p->c, pref, 1, res, &nres);
    cublasLtMatmulPreferenceDestroy(pref);
    CHECK_MSG(st == CUBLAS_STATUS_SUCCESS && nres > 0, "cuBLASLt has no algorithm for m=%lld n=%lld k=%lld %s->%s",
              (long long)m, (long long)n, (long long)k, dtype_name(it), dtype_name(ot));
    p->algo = res[0].algo;
    p->used = true;
    cb->n_plans++;
    return p;
}

void cuda_op_matmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *wq,
                    const struct tensor *bias) {
    struct cuda_backend *cb = cuda_impl(b);
    if (wq->scheme != WEIGHT_SCHEME_NONE) { // quantized weights: cuda_qmatmul.cu
        cuda_qmatmul(b, out, x, wq, bias);
        return;
    }
    const struct tensor *w = &wq->t;
    int64_t k = tensor_cols(x), n = tensor_rows(x), m = tensor_rows(w);
    CHECK_MSG(tensor_cols(w) == k, "matmul: x has %lld columns, w %lld", (long long)k, (long long)tensor_cols(w));
    CHECK_MSG(tensor_cols(out) == m && tensor_rows(out) == n, "matmul: out is not (%lld, %lld)", (long long)n,
              (long long)m);
    CHECK_MSG(x->dtype == w->dtype, "matmul: x %s, w %s (weights must be in the activation dtype on CUDA)",
              dtype_name(x->dtype), dtype_name(w->dtype));
    CHECK(!bias || (tensor_numel(bias) == m && bias->dtype == out->dtype));
    if (n == 0 || m == 0) return;
    if (k == 0) {
        CUDA_CHECK(cudaMemsetAsync(out->data, 0, tensor_bytes(out), cb->stream));
        return;
    }
    // The GEMV beats cuBLASLt's small-n kernels for single rows up to k = 8192 (measured on the
    // H200: qkv / o 79% / 71% of HBM bandwidth vs 73% / 63%; down at k = 14336 86% vs 90%; at
    // n = 4 and 8 it is L1-bound, 62% / 38%). Since its one-wave launches (session 7) it also
    // wins the widest single-row matmuls in the decode graph: Llama-3-8B's gate_up (m = 28672)
    // and the lm_heads (Llama-3-8B b1 +1.3%, Qwen3-30B-A3B +0.3%, docs/perf.md session 8).
    if (n <= GEMV_MAX_ROWS && k <= 8192 && x->dtype == DTYPE_BF16 && k % 8 == 0 && aligned16(x->data) &&
        aligned16(w->data) && (out->dtype == DTYPE_BF16 || out->dtype == DTYPE_F32)) {
        if (out->dtype == DTYPE_BF16)
            gemv_bf16<__nv_bfloat16>(cb->stream, (__nv_bfloat16 *)out->data, (const __nv_bfloat16 *)x->data,
                                     (const __nv_bfloat16 *)w->data, bias ? (const __nv_bfloat16 *)bias->data : nullptr,
                                     m, k);
        else
            gemv_bf16<float>(cb->stream, (float *)out->data, (const __nv_bfloat16 *)x->data,
                             (const __nv_bfloat16 *)w->data, bias ? (const float *)bias->data : nullptr, m, k);
        return;
    }
    struct matmul_plan *p = plan_get(cb, m, n, k, x->dtype, out->dtype, bias != NULL);
    if (bias) {
        const void *bp = bias->data;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp));
    }
    float alpha = 1.0f, beta = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(cb->lt, p->desc, &alpha, w->data, p->a, x->data, p->b, &beta, out->data, p->c,
                                out->data, p->c, &p->algo, cb->lt_workspace, cb->lt_workspace_bytes, cb->stream));
}
