// Matmul over quantized weights on CUDA (struct weight with a scheme, core/weight.h):
// out(n, m) = x(n, k) @ w(m, k)^T (+ bias), x BF16, out BF16 or F32, dispatched from
// cuda_op_matmul by the weight's scheme. The CPU's cpu_qmatmul.c is the reference.
//
// Weights: FP8 E4M3 values per tensor / per channel / in blocks (br x bc, any br: regridded
// fused weights), or INT4 / INT8 packed in I32 words (offset 2^(bits-1), low bits first) with
// group scales, optionally F32 zero points ((q - z) * s) and a column -> group map (GPTQ
// desc_act). Activations: as the weight's act says (weight-only, FP8 per token, FP8 per token
// and 128-column group, INT8 per token, static FP8 / INT8 with the stored scale), quantized by
// act_quant_kernel (cuda_qdot.cuh: the bytes and scales of core/weight.h's act_quant_row).
// Implemented combinations: FP8 weights with NONE / FP8_TOKEN / FP8_GROUP / FP8_STATIC, packed
// integers with NONE / INT8_TOKEN / INT8_STATIC (anything else is a CHECK). Static FP8 over
// per-channel / per-tensor weights takes the per-token cuBLASLt path (every token's scale is the
// stored one).
//
// Paths, by rows n:
// - n <= QMMA_MAX_ROWS (16) with FP8 x FP8, INT8 x INT8 or INT4 x bf16 (no column -> group map,
//   blocks / groups of 128k columns or all of k, k % 16 == 0 (INT4 % 32), the staged x fits):
//   the tensor-core GEMV below, which quantizes the activations of 1-2 rows itself:
//   qgemv_tma_kernel (weights streamed by bulk copies into a shared-memory ring) where k % 128
//   == 0 and two CTAs fit on an SM, else qgemv_mma_kernel (weights prefetched into registers).
// - else n <= QMM_GEMV_MAX_ROWS (decode): qgemv_kernel, a warp per output column streams the weight
//   row once, one byte (FP8 / INT8) or half a byte (INT4) per weight, dequantized in registers
//   (value x scale), against every row of x (bf16, or the quantized bytes x their scales): no
//   expansion anywhere, the fp32 products of the CPU reference.
// - larger n, FP8 W8A8 with a cuBLASLt scaling mode (sm_90a, cuBLAS >= 12.9): per-token x
//   per-channel (OUTER_VEC_32F for both operands; per-tensor weights as a per-channel vector of
//   their one scale) and DeepSeek's blocks (weights BLK128x128_32F with 128 x 128 blocks, k a
//   multiple of 128; activations VEC128_32F, 128-column groups, scales token-major with the
//   token count padded to a multiple of 4, weight scales' k-blocks padded to a multiple of 4,
//   as cuBLASLt lays them out). Output BF16 / F32, bias added by a separate kernel.
// - larger n, INT8 W8A8 over per-channel INT8 weights (compressed-tensors int-quantized): the
//   IMMA GEMM of cuda_qgemm.cu (the offset-128 bytes made signed per chunk of rows, int32
//   accumulation, per-token x per-channel scales in its epilogue).
// - everything else (weight-only GEMMs: W4A16 / W8A16 prefill; INT8 W8A8 with zero points, group
//   scales or sizes the IMMA path does not take; blocks other than 128 x 128; shapes the
//   heuristic refuses): the weight rows are dequantized (value x scale, rounded to bf16) into
//   scratch in chunks of QMM_DEQ_CHUNK_BYTES and multiplied by cuBLASLt's BF16 GEMM; quantized
//   activations are quantized and dequantized to bf16 first (the same bytes and scales: the
//   W8A8 result up to bf16 rounding of both operands). Correct for every shape, not fast.
// Scratch (quantized x, scales, padded scales, dequantized tiles) is one grow-only buffer;
// it grows only outside graph capture (the runner's eager warm-up before each capture sizes
// it), and a captured call it cannot serve is a CHECK naming the shortfall.
#include "backend/cuda/cuda_qdot.cuh"

#include <string.h>

// 0 sends every n > QMM_GEMV_MAX_ROWS product to the dequantize-GEMM fallback (an A/B switch for the
// cuBLASLt scaled-FP8 path, whose scale layouts are cuBLASLt's documented ones, checked on the H200
// by tests/gpu/test_cuda_qmatmul.c).
#ifndef QMM_CUBLASLT_SCALED
#define QMM_CUBLASLT_SCALED 1
#endif
// 0: no tensor-core GEMV (qgemv_mma_kernel); the A/B switch against the CUDA-core qgemv_kernel.
#ifndef QMM_GEMV_MMA
#define QMM_GEMV_MMA 1
#endif
#define QMM_GEMV_MAX_ROWS 8
#define QMM_GEMV_WARPS 4
#define QMM_DEQ_CHUNK_BYTES (64u << 20)
#define QMM_PLAN_CAP 256

enum qmm_plan_kind { QPLAN_FP8_VEC = 1, QPLAN_FP8_BLOCK, QPLAN_BF16 };

struct qmm_plan {
    bool used;
    int kind;
    int64_t m, n, k, ldd;
    int out_dtype;
    bool bias;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    bool ok; // the heuristic found an algorithm
};

struct qmm_state {
    struct qmm_plan plans[QMM_PLAN_CAP];
    int n_plans;
};

static void qplan_release(struct qmm_plan *p) {
    if (!p->used) return;
    cublasLtMatmulDescDestroy(p->desc);
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->c);
    p->used = false;
}

void cuda_qmatmul_destroy(struct cuda_backend *cb) {
    struct qmm_state *q = (struct qmm_state *)cb->qmm;
    if (q)
        for (int i = 0; i < QMM_PLAN_CAP; i++)
            qplan_release(&q->plans[i]);
    free(q);
    cb->qmm = NULL;
    cuda_qgemm_destroy(cb);
    cudaFree(cb->qmm_scratch);
    cb->qmm_scratch = NULL;
    cb->qmm_scratch_bytes = 0;
}

static cudaDataType_t qlt_out_type(enum dtype t) {
    CHECK_MSG(t == DTYPE_BF16 || t == DTYPE_F32, "quantized matmul: output dtype %s", dtype_name(t));
    return t == DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// The plan of one GEMM: kind QPLAN_FP8_VEC / QPLAN_FP8_BLOCK (FP8 A = weights (k, m), B = x (k,
// n), scale modes set here, pointers per call) or QPLAN_BF16 (BF16 weights tile (k, m), ldd the
// output's leading dimension, bias in the epilogue). NULL-free: p->ok says whether cuBLASLt has
// an algorithm.
static struct qmm_plan *qplan_get(struct cuda_backend *cb, int kind, int64_t m, int64_t n, int64_t k, int64_t ldd,
                                  enum dtype ot, bool bias) {
    if (!cb->qmm) {
        cb->qmm = calloc(1, sizeof(struct qmm_state));
        CHECK_MSG(cb->qmm, "out of host memory");
    }
    struct qmm_state *q = (struct qmm_state *)cb->qmm;
    for (int i = 0; i < QMM_PLAN_CAP; i++) {
        struct qmm_plan *p = &q->plans[i];
        if (p->used && p->kind == kind && p->m == m && p->n == n && p->k == k && p->ldd == ldd &&
            p->out_dtype == (int)ot && p->bias == bias)
            return p;
    }
    if (q->n_plans >= QMM_PLAN_CAP) { // an unbounded stream of prefill sizes: start over
        for (int i = 0; i < QMM_PLAN_CAP; i++)
            qplan_release(&q->plans[i]);
        q->n_plans = 0;
    }
    struct qmm_plan *p = &q->plans[q->n_plans++];
    memset(p, 0, sizeof *p);
    p->used = true;
    p->kind = kind;
    p->m = m;
    p->n = n;
    p->k = k;
    p->ldd = ldd;
    p->out_dtype = ot;
    p->bias = bias;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cudaDataType_t in = kind == QPLAN_BF16 ? CUDA_R_16BF : CUDA_R_8F_E4M3;
    if (kind != QPLAN_BF16) {
        int32_t am = kind == QPLAN_FP8_VEC ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                                           : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        int32_t bm = kind == QPLAN_FP8_VEC ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                                           : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
    } else if (bias) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        cudaDataType_t bt = qlt_out_type(ot);
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, in, k, m, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, in, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, qlt_out_type(ot), m, n, ldd));
    if (kind != QPLAN_BF16) {
        // Scale pointers must be set for the heuristic to pick a scaled kernel; real ones come per call.
        const void *dummy = cb->lt_workspace;
        CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy, sizeof dummy));
        CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy, sizeof dummy));
    }
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = cb->lt_workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t res[1];
    int nres = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cb->lt, p->desc, p->a, p->b, p->c, p->c, pref, 1, res, &nres);
    cublasLtMatmulPreferenceDestroy(pref);
    p->ok = st == CUBLAS_STATUS_SUCCESS && nres > 0;
    if (p->ok) p->algo = res[0].algo;
    return p;
}

// ---------------------------------------------------------------------------------------
// Kernels

// out(n, m) = x(n, k) @ w(m, k)^T (+ bias), n <= NR: a warp per output column.
template <int FMT, int AF, int NR, typename TO>
__global__ void __launch_bounds__(32 * QMM_GEMV_WARPS)
    qgemv_kernel(TO *out, struct qa_view a, struct qw_view w, const TO *bias, int n, bool vec) {
    pdl_begin();
    const int lane = threadIdx.x % 32;
    const int64_t col = (int64_t)blockIdx.x * QMM_GEMV_WARPS + threadIdx.x / 32;
    if (col >= w.m) return;
    float acc[NR];
    int64_t xr[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        acc[r] = 0.f;
        xr[r] = r;
    }
    qdot_lane<FMT, AF, NR>(acc, w, w.q, w.s, col, a, xr, n, vec, lane);
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= n) break;
        float v = warp_sum(acc[r]);
        if (lane == 0) {
            if (bias) v += to_f32(bias[col]);
            out[(int64_t)r * w.m + col] = from_f32<TO>(v);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tensor-core GEMV (decode, n <= QMMA_MAX_ROWS): FP8 W8A8, INT8 W8A8, INT4 W4A16.
//
// One mma.sync per 32 (8-bit) or 16 (INT4 -> bf16) columns of k does the conversion, the
// products and their sum, so the weight stream is no longer bound by the per-weight
// convert / scale / FMA instructions of qgemv_kernel. The weights are the mma's B operand (8
// output columns, one per group of four lanes), the activation rows its A operand (16 rows:
// rows 0..7, and 8..15 for NT = 2). A lane's 16-byte weight load covers two 8-bit mmas (or
// eight INT4 ones): k is permuted inside each 128-column unit the same way for both operands
// (a dot product does not care about order), so each load reads 64 contiguous bytes per row
// per instruction and the activations come from shared memory in the matching order.
//
// Grid: 8 * QMMA_CG output columns per CTA; WK warps per column group split k by 128-column
// units (warp w takes units w, w + WK, ...), then sum in shared memory in warp order
// (deterministic). Each lane keeps PRE units of weight loads (and their scales) in flight; the
// first PRE are issued before the PDL wait (weights and scales are never written by the kernels
// it waits on). After the wait the CTA stages x in shared memory: for up to QMMA_FUSE_MAX_ROWS
// rows it quantizes x itself with act_quant_kernel's amax / scale / byte formulas (identical bytes
// and scales, and no act_quant launch before the W8A8 GEMV); more rows are quantized once by
// act_quant_kernel and the CTA copies the bytes and scales; W4A16 copies bf16 x. Plus the
// per-unit sums of x that zero points need.
//
// Per 128-column unit u the mma sums are promoted to fp32 on the CUDA cores (tensor cores keep
// fewer accumulation bits for FP8) with the unit's scales: total += (sum_u - z * sumx_u) *
// s_w(col, u) * s_x(row, u) for BLOCK / GROUP weights (a unit lies in one block / group:
// bc % 128 == 0 or bc >= k), total += sum_u * s_x(row, u) with s_w applied at the end for
// TENSOR / CHANNEL. Against the CPU's sum of (q_w s_w)(q_x s_x): the same bytes and scales,
// products exact, different fp32 rounding of the sums and scalings only.
#define QMMA_MAX_ROWS 16
// Rows up to which each CTA quantizes x itself; more rows are quantized once by act_quant_kernel
// (every CTA repeating n * k IEEE divisions would cost more than the launch saves).
#define QMMA_FUSE_MAX_ROWS 2
// Staging trips unrolled so their x loads overlap (k = 14336: 7 trips per half-warp).
#ifndef QMMA_STAGE_UNROLL
#define QMMA_STAGE_UNROLL 4
#endif
static constexpr int qmma_stage_unroll = QMMA_STAGE_UNROLL;
#define QMMA_CG 2
#define QMMA_WK 4
#define QMMA_SMEM_MAX (100u << 10)
#ifndef QMMA_MINB
#define QMMA_MINB 2
#endif

// QMA_PRE: x is already quantized (act_quant_kernel's bytes (n, k) and scales xs: per row, or
// per 128-column group at xs[g * s_ld + row] when s_ld > 0).
enum qmma_act { QMA_NONE = 0, QMA_TOKEN, QMA_GROUP, QMA_STATIC, QMA_PRE };
// Weight scales: applied at the end (TENSOR / CHANNEL), per unit (BLOCK / GROUP), per unit with zero points.
enum qmma_scm { QSC_END = 0, QSC_UNIT, QSC_UNIT_ZERO };

struct qmma_args {
    int n;          // activation rows
    int U;          // 128-column units of k
    int wk;         // warps per column group (k split)
    int act;        // qmma_act
    bool int8;      // INT8 activations (else FP8 where quantized)
    float static_s; // QMA_STATIC
    int64_t rs;     // staged row stride in bytes
    const float *xs; // QMA_PRE: the activation scales
    int64_t s_ld;    // QMA_PRE: 0 = one scale per row
};

__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 lds16(const uint8_t *p) {
    return *reinterpret_cast<const uint4 *>(p);
}

// Stages x (n, k) bf16 into shared memory: quantized bytes (row r at xq + r * rs, column c at
// byte c) or, for INT4 (bf16 activations), the bf16 values with each 8-column group in the order
// 0 4 1 5 2 6 3 7 (the pairs the INT4 -> bf16 conversion yields); columns k .. U * 128 are
// zeros. sx[r * U + u]: the activation scale of (r, unit u); sumx (may be NULL): the unit sums
// of the values the mma multiplies (quantized integers, or bf16 as f32). A half-warp per (row,
// unit), a lane per 8 columns.
// nthr: the threads that stage (threads 0 .. nthr - 1; all of the block, or a named barrier's).
__device__ __forceinline__ void qmma_sync(int nthr) {
    if (nthr == (int)blockDim.x)
        __syncthreads();
    else
        asm volatile("bar.sync 1, %0;\n" ::"r"(nthr) : "memory");
}

template <bool Q8>
__device__ __forceinline__ void qmma_stage(uint8_t *xq, float *sx, float *sumx, const void *xv, int64_t k,
                                           const struct qmma_args &p, int nthr) {
    const __nv_bfloat16 *x = (const __nv_bfloat16 *)xv;
    const int tid = threadIdx.x, hw = tid / 16, hl = tid % 16, nhw = nthr / 16;
    const int n = p.n, U = p.U;
    const float qmax = p.int8 ? ACT_QUANT_INT8_MAX : ACT_QUANT_FP8_MAX;
    const float qmin = p.act == QMA_STATIC && p.int8 ? -128.0f : -127.0f;
    auto load8 = [&](int r, int64_t c, uint4 &raw, float (&v)[8]) {
        raw = make_uint4(0u, 0u, 0u, 0u);
        if (c < k) raw = __ldg(reinterpret_cast<const uint4 *>(x + (int64_t)r * k + c));
        bf16x8_to_f32(raw, v);
    };
    auto hsum = [&](float s) {
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        return s;
    };
    auto hmax = [&](float s) {
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
            s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
        return s;
    };
    // Quantizes v with scale sc into the row's bytes (stored where `on`); the unit sum of the bytes
    // where asked. Every lane of the half-warp calls it (the sum's shuffles).
    auto put_q = [&](bool on, int r, int u, int64_t c, const float (&v)[8], float sc) {
        uint32_t lo = 0, hi = 0;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint8_t b = act_quant_byte(v[i] / sc, p.int8, qmin);
            if (i < 4)
                lo |= (uint32_t)b << (8 * i);
            else
                hi |= (uint32_t)b << (8 * (i - 4));
            if (sumx) s += p.int8 ? (float)(int8_t)b : fp8_byte_to_f32(b);
        }
        if (sumx) s = hsum(s); // sumx is block-uniform: the half-warp shuffles together
        if (!on) return;
        *reinterpret_cast<uint2 *>(xq + r * p.rs + c) = make_uint2(lo, hi);
        if (sumx && hl == 0) sumx[r * U + u] = s;
    };
    // The loops run whole half-warps (n * U pairs, nhw half-warps): the shuffles see full warps
    // only when both halves take part, so every half-warp runs the same trip count.
    const int pairs = n * U, trips = (pairs + nhw - 1) / nhw;
    if (!Q8) {
#pragma unroll qmma_stage_unroll
        for (int it = 0; it < trips; it++) {
            const int pi = hw + it * nhw;
            const bool on = pi < pairs;
            const int r = on ? pi / U : 0, u = on ? pi % U : 0;
            const int64_t c = (int64_t)u * 128 + hl * 8;
            uint4 raw;
            float v[8];
            load8(r, on ? c : k, raw, v);
            if (on) {
                uint4 o;
                o.x = (raw.x & 0xffffu) | (raw.z << 16);
                o.y = (raw.x >> 16) | (raw.z & 0xffff0000u);
                o.z = (raw.y & 0xffffu) | (raw.w << 16);
                o.w = (raw.y >> 16) | (raw.w & 0xffff0000u);
                *reinterpret_cast<uint4 *>(xq + r * p.rs + 2 * c) = o;
            }
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                s += v[i];
            s = hsum(s);
            if (on && sumx && hl == 0) sumx[r * U + u] = s;
        }
        return;
    }
    if (p.act == QMA_PRE) { // copy the bytes and scales (rows > QMMA_FUSE_MAX_ROWS: quantized once, not per CTA)
        const uint8_t *xb = (const uint8_t *)xv;
#pragma unroll qmma_stage_unroll
        for (int it = 0; it < trips; it++) {
            const int pi = hw + it * nhw;
            const bool on = pi < pairs;
            const int r = on ? pi / U : 0, u = on ? pi % U : 0;
            const int64_t c = (int64_t)u * 128 + hl * 8;
            uint2 b = make_uint2(0u, 0u);
            if (on && c < k) b = __ldg(reinterpret_cast<const uint2 *>(xb + (int64_t)r * k + c));
            float s = 0.f;
            if (sumx) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const uint32_t q = ((i < 4 ? b.x : b.y) >> (8 * (i % 4))) & 255u;
                    s += p.int8 ? (float)(int8_t)q : fp8_byte_to_f32(q);
                }
                s = hsum(s);
            }
            if (!on) continue;
            *reinterpret_cast<uint2 *>(xq + r * p.rs + c) = b;
            if (hl == 0) {
                sx[r * U + u] = p.s_ld ? p.xs[(int64_t)u * p.s_ld + r] : p.xs[r];
                if (sumx) sumx[r * U + u] = s;
            }
        }
        return;
    }
    if (p.act == QMA_TOKEN) { // pass 1: unit maxima; then the row's scale into every unit's slot
#pragma unroll qmma_stage_unroll
        for (int it = 0; it < trips; it++) {
            const int pi = hw + it * nhw;
            const bool on = pi < pairs;
            const int r = on ? pi / U : 0, u = on ? pi % U : 0;
            uint4 raw;
            float v[8], a = 0.f;
            load8(r, on ? (int64_t)u * 128 + hl * 8 : k, raw, v);
#pragma unroll
            for (int i = 0; i < 8; i++)
                a = fmaxf(a, fabsf(v[i]));
            a = hmax(a);
            if (on && hl == 0) sx[r * U + u] = a;
        }
        qmma_sync(nthr);
        const int warp = tid / 32, lane = tid % 32;
        for (int r = warp; r < n; r += nthr / 32) {
            float a = 0.f;
            for (int u = lane; u < U; u += 32)
                a = fmaxf(a, sx[r * U + u]);
            a = warp_max(a);
            float sc = a / qmax;
            if (!(sc > 0.f)) sc = 1.f;
            for (int u = lane; u < U; u += 32)
                sx[r * U + u] = sc;
        }
        qmma_sync(nthr);
    }
#pragma unroll qmma_stage_unroll
    for (int it = 0; it < trips; it++) {
        const int pi = hw + it * nhw;
        const bool on = pi < pairs;
        const int r = on ? pi / U : 0, u = on ? pi % U : 0;
        const int64_t c = (int64_t)u * 128 + hl * 8;
        uint4 raw;
        float v[8], sc;
        load8(r, on ? c : k, raw, v);
        if (p.act == QMA_GROUP) {
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                a = fmaxf(a, fabsf(v[i]));
            a = hmax(a);
            sc = a / qmax;
            if (!(sc > 0.f)) sc = 1.f;
        } else if (p.act == QMA_STATIC) {
            sc = p.static_s;
        } else {
            sc = on ? sx[r * U + u] : 1.f;
        }
        put_q(on, r, u, c, v, sc);
        if (on && p.act != QMA_TOKEN && hl == 0) sx[r * U + u] = sc;
    }
}

// One 128-column unit u of the tensor-core GEMVs: this lane's weight loads wv (Q8: bytes u * 128 +
// 16 t and + 64 of its row; INT4: the 16 bytes at u * 64 + 16 t) against the staged activations,
// the unit's sums promoted with its scales into tot (sw / zw: the unit's weight scales and zero
// points of this lane's two output columns, where SCM has them). c[0], c[1]: row g, columns
// 2 t, 2 t + 1 of the lane's column group; c[2], c[3]: row g + 8.
template <int FMT, int NT, int SCM>
__device__ __forceinline__ void qmma_unit(float (&tot)[4], const uint4 (&wv)[FMT != QW_INT4 ? 2 : 1],
                                          const float (&sw)[2], const float (&zw)[2], int64_t u, const uint8_t *xq,
                                          const float *sx, const float *sumx, const struct qmma_args &p, int g,
                                          int t) {
    constexpr bool Q8 = FMT != QW_INT4;
    constexpr bool pu = SCM != QSC_END, zp = SCM == QSC_UNIT_ZERO;
    const int n = p.n, U = p.U, r0 = g, r1 = g + 8;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (Q8) {
        uint4 xa0 = make_uint4(0u, 0u, 0u, 0u), xb0 = xa0, xa1 = xa0, xb1 = xa0;
        if (r0 < n) {
            const uint8_t *xp = xq + r0 * p.rs + u * 128 + 16 * t;
            xa0 = lds16(xp);
            xb0 = lds16(xp + 64);
        }
        if (NT == 2 && r1 < n) {
            const uint8_t *xp = xq + r1 * p.rs + u * 128 + 16 * t;
            xa1 = lds16(xp);
            xb1 = lds16(xp + 64);
        }
        uint4 w0 = wv[0], w1 = wv[1];
        const uint32_t a[4][4] = {{xa0.x, xa1.x, xa0.y, xa1.y},
                                  {xa0.z, xa1.z, xa0.w, xa1.w},
                                  {xb0.x, xb1.x, xb0.y, xb1.y},
                                  {xb0.z, xb1.z, xb0.w, xb1.w}};
        if constexpr (FMT == QW_FP8) {
            mma_e4m3(c, a[0], w0.x, w0.y);
            mma_e4m3(c, a[1], w0.z, w0.w);
            mma_e4m3(c, a[2], w1.x, w1.y);
            mma_e4m3(c, a[3], w1.z, w1.w);
        } else { // stored q + 128 -> signed q: flip each byte's top bit
            const uint32_t f = 0x80808080u;
            int ci[4] = {0, 0, 0, 0};
            mma_s8(ci, a[0], w0.x ^ f, w0.y ^ f);
            mma_s8(ci, a[1], w0.z ^ f, w0.w ^ f);
            mma_s8(ci, a[2], w1.x ^ f, w1.y ^ f);
            mma_s8(ci, a[3], w1.z ^ f, w1.w ^ f);
#pragma unroll
            for (int i = 0; i < 4; i++)
                c[i] = (float)ci[i];
        }
    } else {
        const uint32_t wq[4] = {wv[0].x, wv[0].y, wv[0].z, wv[0].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 x0 = make_uint4(0u, 0u, 0u, 0u), x1 = x0;
            if (r0 < n) x0 = lds16(xq + r0 * p.rs + (u * 128 + 32 * t + 8 * i) * 2);
            if (NT == 2 && r1 < n) x1 = lds16(xq + r1 * p.rs + (u * 128 + 32 * t + 8 * i) * 2);
            uint32_t b[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint32_t v = ((wq[i] >> (4 * j)) & 0x000f000fu) | 0x43004300u; // bf16 128 + u
                __nv_bfloat162 h = __hsub2(*reinterpret_cast<__nv_bfloat162 *>(&v),
                                           __floats2bfloat162_rn(136.0f, 136.0f)); // u - 8
                b[j] = *reinterpret_cast<uint32_t *>(&h);
            }
            const uint32_t a0[4] = {x0.x, x1.x, x0.y, x1.y}, a1[4] = {x0.z, x1.z, x0.w, x1.w};
            mma_bf16(c, a0, b[0], b[1]);
            mma_bf16(c, a1, b[2], b[3]);
        }
    }
    // Promote the unit's sums with its scales. c[0], c[1]: row r0, columns oc[0], oc[1]; c[2], c[3]: row r1.
    float fx[2] = {1.f, 1.f}, zs[2] = {0.f, 0.f};
    if (p.act != QMA_NONE) {
        fx[0] = r0 < n ? sx[r0 * U + u] : 0.f;
        fx[1] = NT == 2 && r1 < n ? sx[r1 * U + u] : 0.f;
    }
    if (zp) {
        zs[0] = r0 < n ? sumx[r0 * U + u] : 0.f;
        zs[1] = NT == 2 && r1 < n ? sumx[r1 * U + u] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int rr = i / 2, cc = i % 2;
        float v = zp ? c[i] - zw[cc] * zs[rr] : c[i];
        const float f = pu ? sw[cc] * fx[rr] : fx[rr];
        tot[i] = fmaf(v, f, tot[i]);
    }
}

// out(n, m) = x(n, k) @ w(m, k)^T (+ bias), n <= 8 * NT, FMT with its activation (FP8 x FP8,
// INT8 x INT8, INT4 x bf16). k % 16 == 0 (INT4: % 32), rows 16-byte aligned.
template <int FMT, int NT, int SCM, typename TO>
__global__ void __launch_bounds__(32 * QMMA_CG * QMMA_WK, QMMA_MINB)
    qgemv_mma_kernel(TO *out, const void *x, struct qw_view w, const TO *bias, struct qmma_args p,
                     bool early) {
    extern __shared__ __align__(16) uint8_t qsm[];
    constexpr bool Q8 = FMT != QW_INT4;
    constexpr int PRE = Q8 ? 4 : 8; // units in flight per lane
    constexpr int NW = Q8 ? 2 : 1;  // 16-byte weight loads per lane per unit
    const int n = p.n, U = p.U, WK = p.wk;
    const int64_t k = w.k, m = w.m;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wk = warp % WK, cgi = warp / WK;
    const int64_t col0 = (int64_t)blockIdx.x * (8 * QMMA_CG) + cgi * 8;
    const bool rok = col0 + g < m;
    const uint8_t *rowp = w.q + (rok ? col0 + g : 0) * w.row_bytes;
    const int64_t oc[2] = {col0 + 2 * t, col0 + 2 * t + 1}; // this lane's output columns
    constexpr bool pu = SCM != QSC_END, zp = SCM == QSC_UNIT_ZERO;
    const int nu = U > wk ? (U - wk + WK - 1) / WK : 0;

    // BLOCK / GROUP: the scale (and zero point) rows of this lane's two output columns, and the
    // units per scale column (0: one column for all of k).
    const float *srow[2] = {w.s, w.s}, *zrow[2] = {w.z, w.z};
    const int ub = w.bc >= k ? 0 : w.bc / 128;
    if constexpr (pu) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int64_t r = oc[j] < m ? oc[j] : 0;
            const int64_t off = (w.mode == QS_BLOCK ? r / w.br : r) * w.s_cols;
            srow[j] = w.s + off;
            if constexpr (zp) zrow[j] = w.z + off;
        }
    }
    uint4 buf[PRE][NW];
    float sbuf[pu ? PRE : 1][2] = {}, zbuf[zp ? PRE : 1][2] = {};
    auto fetch = [&](int slot, int i) {
        const int64_t u = wk + (int64_t)i * WK;
#pragma unroll
        for (int h = 0; h < NW; h++) {
            const int64_t c = Q8 ? u * 128 + 64 * h + 16 * t : u * 128 + 32 * t;
            buf[slot][h] = make_uint4(0u, 0u, 0u, 0u);
            if (rok && c < k) buf[slot][h] = ld_stream16(rowp + (Q8 ? c : c / 2));
        }
        if constexpr (pu) {
            const int sc = ub == 1 ? (int)u : ub ? (int)u / ub : 0; // the unit's scale column
#pragma unroll
            for (int j = 0; j < 2; j++) {
                sbuf[slot][j] = oc[j] < m ? __ldg(srow[j] + sc) : 0.f;
                if constexpr (zp) zbuf[slot][j] = oc[j] < m ? __ldg(zrow[j] + sc) : 0.f;
            }
        }
    };
    if (!early) pdl_begin();
#pragma unroll
    for (int q = 0; q < PRE; q++)
        if (q < nu) fetch(q, q);
    if (early) pdl_begin();

    const int64_t xbytes = (int64_t)n * p.rs;
    uint8_t *xq = qsm;
    float *sx = (float *)(qsm + xbytes);
    float *sumx = zp ? sx + (p.act != QMA_NONE ? n * U : 0) : nullptr;
    float *red = (float *)(qsm + xbytes + sizeof(float) * (size_t)((p.act != QMA_NONE ? n * U : 0) + (zp ? n * U : 0)));
    qmma_stage<Q8>(xq, sx, sumx, x, k, p, (int)blockDim.x);
    __syncthreads();

    const int r0 = g, r1 = g + 8; // this lane's activation rows (A rows) and accumulator rows
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i0 = 0; i0 < nu; i0 += PRE) {
#pragma unroll
        for (int q = 0; q < PRE; q++) {
            const int i = i0 + q;
            if (i < nu) {
                uint4 cur[NW];
                float cs[2] = {1.f, 1.f}, cz[2] = {0.f, 0.f};
                if constexpr (pu) cs[0] = sbuf[q][0], cs[1] = sbuf[q][1];
                if constexpr (zp) cz[0] = zbuf[q][0], cz[1] = zbuf[q][1];
#pragma unroll
                for (int h = 0; h < NW; h++)
                    cur[h] = buf[q][h];
                if (i + PRE < nu) fetch(q, i + PRE);
                qmma_unit<FMT, NT, SCM>(tot, cur, cs, cz, wk + (int64_t)i * WK, xq, sx, sumx, p, g, t);
            }
        }
    }
    if (WK > 1) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            red[(warp * 32 + lane) * 4 + i] = tot[i];
        __syncthreads();
        if (wk == 0)
            for (int j = 1; j < WK; j++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    tot[i] += red[((warp + j) * 32 + lane) * 4 + i];
    }
    if (wk != 0) return;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = i / 2 ? r1 : r0;
        const int64_t col = oc[i % 2];
        if (r >= n || col >= m) continue;
        float v = tot[i];
        if constexpr (!pu) v *= __ldg(w.s + (w.mode == QS_TENSOR ? 0 : col));
        if (bias) v += to_f32(bias[col]);
        out[(int64_t)r * m + col] = from_f32<TO>(v);
    }
}

// ---------------------------------------------------------------------------------------
// The same GEMV with the weights streamed by bulk copies (sm_90 cp.async.bulk, mbarrier
// completion). The register-prefetch kernel above keeps at most PRE units per lane in flight
// (64 KB per SM at its 97 registers and two CTAs): 1.5-2.3 TB/s on every Llama-3-8B shape at one
// row, lm_head included, so its rate is what it keeps in flight, not its fixed costs (H200,
// docs/perf.md session 15). Here one producer warp per CTA copies row chunks of QTMA_KC bytes of
// the CTA's weight tile (QTMA_ROWS = 8 output columns) into a ring of QTMA_ST shared-memory
// stages, each completed on its own mbarrier; QTMA_CW consumer warps split every chunk's
// 128-column units between them (warp w takes units w, w + QTMA_CW, ...), read their fragments
// from shared memory, run the same per-unit mma and scale promotion (qmma_unit) and release the
// stage. The grid is at most what fits at once (persistent CTAs over the tiles), so x is
// staged (quantized) once per CTA, not once per tile, and the ring keeps streaming across tile
// boundaries. Stage rows are QTMA_KC + QTMA_PAD bytes apart: the 16-byte fragment loads of the
// two rows a quarter-warp reads then fall in different banks. The first QTMA_ST stages are
// issued before the PDL wait (weights are never written by the kernels waited on).
// Takes k % 128 == 0 (whole units, so no stage holds bytes past a row's end) where the staged x,
// the ring and the partial sums fit; everything else takes the kernel above.
#define QTMA_ROWS 8
#define QTMA_CW 8
#define QTMA_KC 2048
#define QTMA_PAD 64
#define QTMA_ST 4
#define QTMA_RS (QTMA_KC + QTMA_PAD)
#define QTMA_RING ((size_t)QTMA_ST * QTMA_ROWS * QTMA_RS)
#ifndef QMM_GEMV_TMA
#define QMM_GEMV_TMA 1
#endif

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase of parity `parity` of bar has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    uint32_t done = 0;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, "
                     "p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst,
// counted against bar's transaction count.
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// Shared memory of qgemv_tma_kernel: ring, 2 x QTMA_ST mbarriers, staged x (n * rs), x scales and
// unit sums (nsx floats), two buffers of partial sums (one per tile parity).
static size_t qtma_smem(int64_t n, int64_t rs, size_t nsx) {
    return QTMA_RING + 2 * QTMA_ST * sizeof(uint64_t) + (size_t)n * (size_t)rs + sizeof(float) * nsx +
           2 * sizeof(float) * 4 * 32 * QTMA_CW;
}

template <int FMT, int NT, int SCM, typename TO>
__global__ void __launch_bounds__(32 * (QTMA_CW + 1), 2)
    qgemv_tma_kernel(TO *out, const void *x, struct qw_view w, const TO *bias, struct qmma_args p, int ntiles) {
    extern __shared__ __align__(16) uint8_t qtsm[];
    uint8_t *qsm = qtsm;
    constexpr bool Q8 = FMT != QW_INT4;
    constexpr int NW = Q8 ? 2 : 1;          // 16-byte fragment loads per lane per unit
    constexpr int UB = Q8 ? 128 : 64;       // weight bytes per 128-column unit
    constexpr int CU = QTMA_KC / UB;        // units per full chunk
    constexpr bool pu = SCM != QSC_END, zp = SCM == QSC_UNIT_ZERO;
    const int n = p.n, U = p.U;
    const int64_t k = w.k, m = w.m, rb = w.row_bytes;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int nch = (int)((rb + QTMA_KC - 1) / QTMA_KC);
    uint8_t *ring = qsm;
    uint64_t *full = (uint64_t *)(qsm + QTMA_RING), *empty = full + QTMA_ST;
    uint8_t *xq = (uint8_t *)(empty + QTMA_ST);
    float *sx = (float *)(xq + (int64_t)n * p.rs);
    float *sumx = zp ? sx + (p.act != QMA_NONE ? n * U : 0) : nullptr;
    float *red = sx + (p.act != QMA_NONE ? n * U : 0) + (zp ? n * U : 0);
    if (threadIdx.x == 0) {
        for (int s = 0; s < QTMA_ST; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], QTMA_CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp == QTMA_CW) { // producer: chunk `it` of the CTA's sequence goes to stage it % QTMA_ST
        int it = 0;
        for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
            const int64_t r0 = (int64_t)tile * QTMA_ROWS;
            const int rows = m - r0 < QTMA_ROWS ? (int)(m - r0) : QTMA_ROWS;
            for (int ch = 0; ch < nch; ch++, it++) {
                const int s = it % QTMA_ST;
                if (it == QTMA_ST) pdl_begin(); // the first ring's worth is issued before the wait
                if (it >= QTMA_ST) mbar_wait(&empty[s], ((it / QTMA_ST) & 1) ^ 1);
                const int64_t off = (int64_t)ch * QTMA_KC;
                const unsigned bytes = (unsigned)(rb - off < QTMA_KC ? rb - off : QTMA_KC);
                if (lane == 0) mbar_expect_tx(&full[s], bytes * (unsigned)rows);
                __syncwarp();
                if (lane < rows)
                    bulk_g2s(ring + ((size_t)s * QTMA_ROWS + lane) * QTMA_RS, w.q + (r0 + lane) * rb + off, bytes,
                             &full[s]);
            }
        }
        if (it <= QTMA_ST) pdl_begin();
        return;
    }

    pdl_begin();
    qmma_stage<Q8>(xq, sx, sumx, x, k, p, 32 * QTMA_CW);
    qmma_sync(32 * QTMA_CW);
    const int ub = w.bc >= k ? 0 : w.bc / 128;
    int it = 0, par = 0;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, par ^= 1) {
        const int64_t col0 = (int64_t)tile * QTMA_ROWS;
        const int64_t oc[2] = {col0 + 2 * t, col0 + 2 * t + 1};
        const float *srow[2] = {w.s, w.s}, *zrow[2] = {w.z, w.z};
        if constexpr (pu) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int64_t r = oc[j] < m ? oc[j] : 0;
                const int64_t off = (w.mode == QS_BLOCK ? r / w.br : r) * w.s_cols;
                srow[j] = w.s + off;
                if constexpr (zp) zrow[j] = w.z + off;
            }
        }
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        for (int ch = 0; ch < nch; ch++, it++) {
            const int s = it % QTMA_ST;
            const int64_t u0 = (int64_t)ch * CU;
            const int cu = (int)((rb - (int64_t)ch * QTMA_KC) / UB < CU ? (rb - (int64_t)ch * QTMA_KC) / UB : CU);
            mbar_wait(&full[s], (it / QTMA_ST) & 1);
            const uint8_t *rowp = ring + ((size_t)s * QTMA_ROWS + g) * QTMA_RS;
            for (int uc = warp; uc < cu; uc += QTMA_CW) {
                const int64_t u = u0 + uc;
                float sw[2] = {1.f, 1.f}, zw[2] = {0.f, 0.f};
                if constexpr (pu) {
                    const int sc = ub == 1 ? (int)u : ub ? (int)u / ub : 0;
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        sw[j] = oc[j] < m ? __ldg(srow[j] + sc) : 0.f;
                        if constexpr (zp) zw[j] = oc[j] < m ? __ldg(zrow[j] + sc) : 0.f;
                    }
                }
                uint4 wv[NW];
#pragma unroll
                for (int h = 0; h < NW; h++)
                    wv[h] = lds16(rowp + uc * UB + 64 * h + 16 * t);
                qmma_unit<FMT, NT, SCM>(tot, wv, sw, zw, u, xq, sx, sumx, p, g, t);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[s]);
        }
        // Sum the warps' partials in warp order (deterministic); tile parity picks the buffer, so
        // one barrier per tile suffices.
        float *rb2 = red + par * (4 * 32 * QTMA_CW);
#pragma unroll
        for (int i = 0; i < 4; i++)
            rb2[(warp * 32 + lane) * 4 + i] = tot[i];
        qmma_sync(32 * QTMA_CW);
        if (warp != 0) continue;
        for (int j = 1; j < QTMA_CW; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                tot[i] += rb2[(j * 32 + lane) * 4 + i];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = i / 2 ? g + 8 : g;
            const int64_t col = oc[i % 2];
            if (r >= n || col >= m) continue;
            float v = tot[i];
            if constexpr (!pu) v *= __ldg(w.s + (w.mode == QS_TENSOR ? 0 : col));
            if (bias) v += to_f32(bias[col]);
            out[(int64_t)r * m + col] = from_f32<TO>(v);
        }
    }
}

// dst (rows, k) bf16 = the weight rows [r0, r0 + rows) dequantized (value x scale, rounded).
template <int FMT>
__global__ void qdequant_rows_kernel(__nv_bfloat16 *dst, struct qw_view w, int64_t r0, int64_t rows) {
    pdl_begin();
    const int64_t total = rows * w.k;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = r0 + i / w.k, c = i % w.k;
        dst[i] = __float2bfloat16_rn(qw_apply(w, w.s, w.z, r, c, qw_raw1<FMT>(w.q + r * w.row_bytes, c)));
    }
}

template <typename TO> __global__ void qadd_bias_kernel(TO *out, const TO *bias, int64_t n, int64_t m) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * m; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = from_f32<TO>(to_f32(out[i]) + to_f32(bias[i % m]));
}

__global__ void qfill_kernel(float *dst, const float *src, int64_t m) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = src[0];
}

static unsigned qgrid(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 65535 * 4 ? 65535 * 4 : g);
}

// ---------------------------------------------------------------------------------------
// Host side

static int qw_format(const struct weight *w) {
    if (w->t.dtype == DTYPE_FP8_E4M3) return QW_FP8;
    CHECK_MSG(w->t.dtype == DTYPE_I32 && (w->bits == 4 || w->bits == 8),
              "CUDA matmul: weight values %s (%d bits) not implemented", dtype_name(w->t.dtype), w->bits);
    return w->bits == 4 ? QW_INT4 : QW_INT8;
}

// The device view of a 2-D (or stacked 3-D: per-expert strides) quantized weight.
struct qw_view cuda_qw_view(const struct weight *w) {
    const int fmt = qw_format(w);
    const bool stacked = w->t.ndim == 3;
    const int64_t m = w->t.ne[stacked ? 1 : 0], k = weight_cols(w);
    struct qw_view v = {};
    v.q = (const uint8_t *)w->t.data;
    v.s = (const float *)w->scale.data;
    v.m = m;
    v.k = k;
    v.row_bytes = fmt == QW_FP8 ? k : fmt == QW_INT4 ? k / 2 : k;
    v.br = w->block_rows > 0 ? w->block_rows : 1;
    v.bc = w->block_cols > 0 ? w->block_cols : (int)k;
    CHECK_MSG(w->scale.dtype == DTYPE_F32, "CUDA matmul: scales must be F32");
    switch (w->scheme) {
    case WEIGHT_SCHEME_PER_TENSOR:
        CHECK(fmt == QW_FP8);
        v.mode = QS_TENSOR;
        break;
    case WEIGHT_SCHEME_PER_CHANNEL:
        CHECK(fmt == QW_FP8);
        v.mode = QS_CHANNEL;
        break;
    case WEIGHT_SCHEME_BLOCK:
        CHECK(fmt == QW_FP8 && w->block_rows > 0 && w->block_cols > 0);
        v.mode = QS_BLOCK;
        v.s_cols = (k + v.bc - 1) / v.bc;
        break;
    case WEIGHT_SCHEME_GROUP:
        CHECK(fmt != QW_FP8 && w->block_cols > 0);
        v.mode = QS_GROUP;
        v.s_cols = w->gidx.data ? w->scale.ne[w->scale.ndim - 1] : (k + v.bc - 1) / v.bc;
        if (w->zero.data) {
            CHECK_MSG(w->zero.dtype == DTYPE_F32 && tensor_numel(&w->zero) == tensor_numel(&w->scale),
                      "CUDA matmul: zero points must be F32 in the scales' layout");
            v.z = (const float *)w->zero.data;
        }
        if (w->gidx.data) {
            CHECK_MSG(w->gidx.dtype == DTYPE_I32 && tensor_numel(&w->gidx) == k && !stacked,
                      "CUDA matmul: a column -> group map is I32 (k), of a 2-D weight");
            v.gidx = (const int32_t *)w->gidx.data;
        }
        break;
    default:
        CHECK_MSG(0, "CUDA matmul: weight scheme %s not implemented", weight_scheme_name(w->scheme));
    }
    if (stacked) {
        v.e_bytes = m * v.row_bytes;
        v.e_scales = tensor_numel(&w->scale) / w->scale.ne[0];
    }
    return v;
}

int cuda_qw_fmt(const struct weight *w) {
    return qw_format(w);
}

int cuda_qa_fmt(const struct weight *w) {
    const int fmt = qw_format(w);
    switch (w->act) {
    case WEIGHT_ACT_NONE:
        return QA_BF16;
    case WEIGHT_ACT_FP8_TOKEN:
    case WEIGHT_ACT_FP8_GROUP:
    case WEIGHT_ACT_FP8_STATIC:
        CHECK_MSG(fmt == QW_FP8, "CUDA matmul: FP8 activations over integer weights not implemented");
        return QA_FP8;
    case WEIGHT_ACT_INT8_TOKEN:
    case WEIGHT_ACT_INT8_STATIC:
        CHECK_MSG(fmt != QW_FP8, "CUDA matmul: INT8 activations over FP8 weights not implemented");
        return QA_INT8;
    default:
        CHECK_MSG(0, "CUDA matmul: activation mode %d", (int)w->act);
    }
    return QA_BF16;
}

// Bump allocation in the grow-only quantized-matmul scratch (256-byte aligned pieces).
struct qscratch {
    struct cuda_backend *cb;
    size_t need;
};

static size_t qalign(size_t b) {
    return (b + 255) & ~(size_t)255;
}

// Ensures cb->qmm_scratch holds `need` bytes (grows outside capture; CHECK inside).
void *cuda_qmm_scratch(struct cuda_backend *cb, size_t need) {
    size_t have = cuda_scratch_reserve(cb, &cb->qmm_scratch, &cb->qmm_scratch_bytes, need);
    CHECK_MSG(have >= need,
              "CUDA quantized matmul: scratch of %zu bytes needed, %zu held (a captured graph needs one eager step "
              "of its batch size first, or the device is out of memory)",
              need, have);
    return cb->qmm_scratch;
}

// Quantizes x (n, k) bf16 into q (n_pad, k) + scales as the weight's act says; deq: also the
// bf16 dequantized copy (may be NULL).
void cuda_act_quant(cudaStream_t s, enum weight_act act, float static_scale, uint8_t *q, float *sc,
                    __nv_bfloat16 *deq, const void *x, bool x_f32, int64_t n, int64_t n_pad, int64_t k, int64_t s_ld) {
    const bool group = act == WEIGHT_ACT_FP8_GROUP, int8 = weight_act_int8(act);
    const float st = weight_act_static(act) ? static_scale : 0.0f;
    CHECK_MSG(!weight_act_static(act) || static_scale > 0.0f, "CUDA act_quant: static scale %g", (double)static_scale);
    if (n_pad == 0) return;
    if (x_f32) {
        if (group)
            pdl_launch(act_quant_kernel<float, true>, (unsigned)n_pad, QUANT_THREADS, 0, s, q, sc, deq,
                       (const float *)x, n, k, s_ld, int8, st);
        else
            pdl_launch(act_quant_kernel<float, false>, (unsigned)n_pad, QUANT_THREADS, 0, s, q, sc, deq,
                       (const float *)x, n, k, s_ld, int8, st);
    } else {
        if (group)
            pdl_launch(act_quant_kernel<__nv_bfloat16, true>, (unsigned)n_pad, QUANT_THREADS, 0, s, q, sc, deq,
                       (const __nv_bfloat16 *)x, n, k, s_ld, int8, st);
        else
            pdl_launch(act_quant_kernel<__nv_bfloat16, false>, (unsigned)n_pad, QUANT_THREADS, 0, s, q, sc, deq,
                       (const __nv_bfloat16 *)x, n, k, s_ld, int8, st);
    }
    CUDA_CHECK_LAUNCH();
}

template <int FMT, int AF, typename TO>
static void qgemv_launch(cudaStream_t s, TO *out, const struct qa_view &a, const struct qw_view &w, const TO *bias,
                         int n, bool vec) {
    const unsigned grid = cdiv(w.m, QMM_GEMV_WARPS);
    if (n == 1)
        pdl_launch(qgemv_kernel<FMT, AF, 1, TO>, grid, 32 * QMM_GEMV_WARPS, 0, s, out, a, w, bias, n, vec);
    else
        pdl_launch(qgemv_kernel<FMT, AF, QMM_GEMV_MAX_ROWS, TO>, grid, 32 * QMM_GEMV_WARPS, 0, s, out, a, w, bias, n,
                   vec);
    CUDA_CHECK_LAUNCH();
}

template <typename TO>
static void qgemv_dispatch(cudaStream_t s, int fmt, int af, TO *out, const struct qa_view &a,
                           const struct qw_view &w, const TO *bias, int n, bool vec) {
    if (fmt == QW_FP8 && af == QA_BF16)
        qgemv_launch<QW_FP8, QA_BF16, TO>(s, out, a, w, bias, n, vec);
    else if (fmt == QW_FP8 && af == QA_FP8)
        qgemv_launch<QW_FP8, QA_FP8, TO>(s, out, a, w, bias, n, vec);
    else if (fmt == QW_INT4 && af == QA_BF16)
        qgemv_launch<QW_INT4, QA_BF16, TO>(s, out, a, w, bias, n, vec);
    else if (fmt == QW_INT4 && af == QA_INT8)
        qgemv_launch<QW_INT4, QA_INT8, TO>(s, out, a, w, bias, n, vec);
    else if (fmt == QW_INT8 && af == QA_BF16)
        qgemv_launch<QW_INT8, QA_BF16, TO>(s, out, a, w, bias, n, vec);
    else if (fmt == QW_INT8 && af == QA_INT8)
        qgemv_launch<QW_INT8, QA_INT8, TO>(s, out, a, w, bias, n, vec);
    else
        CHECK_MSG(0, "CUDA matmul: weight format %d with activation format %d not implemented", fmt, af);
}

template <int FMT, int NT, int SCM, typename TO>
static void qgemv_mma_launch(cudaStream_t s, unsigned grid, unsigned threads, size_t smem, TO *out,
                             const void *x, const struct qw_view &w, const TO *bias,
                             const struct qmma_args &p) {
    if (smem > (48u << 10))
        CUDA_CHECK(cudaFuncSetAttribute(qgemv_mma_kernel<FMT, NT, SCM, TO>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
    pdl_launch(qgemv_mma_kernel<FMT, NT, SCM, TO>, grid, threads, smem, s, out, x, w, bias, p, true);
    CUDA_CHECK_LAUNCH();
}

template <int FMT, int NT, int SCM, typename TO>
static void qgemv_tma_launch(cudaStream_t s, unsigned grid, unsigned threads, size_t smem, TO *out, const void *x,
                             const struct qw_view &w, const TO *bias, const struct qmma_args &p, int ntiles) {
    if (smem > (48u << 10))
        CUDA_CHECK(cudaFuncSetAttribute(qgemv_tma_kernel<FMT, NT, SCM, TO>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
    pdl_launch(qgemv_tma_kernel<FMT, NT, SCM, TO>, grid, threads, smem, s, out, x, w, bias, p, ntiles);
    CUDA_CHECK_LAUNCH();
}

// The tensor-core GEMV where it implements the weight, activation and shape (false: nothing ran):
// FP8 x FP8 (per tensor / channel / blocks), INT8 x INT8 and INT4 x bf16 (groups, zero points),
// n <= QMMA_MAX_ROWS, no column -> group map, blocks / groups a multiple of 128 columns (or all
// of k), k % 16 == 0 (INT4: % 32), 16-byte aligned rows, the staged x within QMMA_SMEM_MAX.
template <typename TO>
static bool qgemv_mma(struct cuda_backend *cb, TO *out, const struct tensor *x, const struct weight *wt,
                      const struct qw_view &v, int fmt, int af, const TO *bias, int64_t n) {
    const int64_t k = v.k, m = v.m;
    if (!QMM_GEMV_MMA || n < 1 || n > QMMA_MAX_ROWS || v.gidx) return false;
    if (!((fmt == QW_FP8 && af == QA_FP8) || (fmt == QW_INT8 && af == QA_INT8) || (fmt == QW_INT4 && af == QA_BF16)))
        return false;
    if ((v.mode == QS_BLOCK || v.mode == QS_GROUP) && !(v.bc % 128 == 0 || v.bc >= k)) return false;
    if (k % (fmt == QW_INT4 ? 32 : 16) != 0 || !aligned16(v.q) || v.row_bytes % 16 != 0 || !aligned16(x->data))
        return false;
    static_assert(ACT_QUANT_GROUP == 128, "the GEMV's units are the activation groups");
    struct qmma_args p = {};
    p.n = (int)n;
    p.U = (int)((k + 127) / 128);
    p.rs = (int64_t)p.U * 128 * (fmt == QW_INT4 ? 2 : 1) + 16;
    switch (wt->act) {
    case WEIGHT_ACT_NONE:
        p.act = QMA_NONE;
        break;
    case WEIGHT_ACT_FP8_TOKEN:
    case WEIGHT_ACT_INT8_TOKEN:
        p.act = QMA_TOKEN;
        break;
    case WEIGHT_ACT_FP8_GROUP:
        p.act = QMA_GROUP;
        break;
    default:
        CHECK_MSG(wt->act_scale > 0.0f, "CUDA act_quant: static scale %g", (double)wt->act_scale);
        p.act = QMA_STATIC;
        p.static_s = wt->act_scale;
    }
    p.int8 = weight_act_int8(wt->act);
    const int64_t ctas = cdiv(m, 8 * QMMA_CG);
    const size_t nsx = (size_t)n * p.U * ((p.act != QMA_NONE) + (v.z != nullptr));
    // The bulk-copy kernel where two CTAs fit on an SM (its registers allow two).
    const size_t smem_t = qtma_smem(n, p.rs, nsx);
    const bool tma = QMM_GEMV_TMA && k % 128 == 0 && 2 * (smem_t + 1024) <= (228u << 10);
    auto smem_of = [&](int wk) {
        return (size_t)n * p.rs + sizeof(float) * nsx + (wk > 1 ? sizeof(float) * 4 * 32 * QMMA_CG * (size_t)wk : 0);
    };
    // CTAs per SM: registers (<= 128 per thread: 16 warps) and shared memory (228 KB, 1 KB per CTA reserved).
    auto per_sm = [&](int wk) {
        const int by_reg = 16 / (QMMA_CG * wk), by_smem = (int)((228u << 10) / (smem_of(wk) + 1024));
        return by_reg < by_smem ? by_reg : by_smem;
    };
    // Four warps per column group; two where that makes the grid one wave instead of more
    // (Llama-3-8B's qkv, 6144 columns: 384 CTAs, 264 slots with four, 528 with two).
    p.wk = QMMA_WK;
    if (ctas > (int64_t)per_sm(4) * cb->num_sms && ctas <= (int64_t)per_sm(2) * cb->num_sms) p.wk = 2;
    if (p.wk > p.U) p.wk = p.U;
    const unsigned threads = tma ? 32u * (QTMA_CW + 1) : 32u * QMMA_CG * (unsigned)p.wk;
    const size_t smem = tma ? smem_t : smem_of(p.wk);
    if (!tma && smem > QMMA_SMEM_MAX) return false;
    const void *xp = x->data;
    if (p.act != QMA_NONE && n > QMMA_FUSE_MAX_ROWS) { // quantize once (act_quant_kernel), stage the bytes
        const int64_t ng = wt->act == WEIGHT_ACT_FP8_GROUP ? p.U : 1;
        uint8_t *scr = (uint8_t *)cuda_qmm_scratch(cb, qalign((size_t)(n * k)) + sizeof(float) * (size_t)(n * ng));
        float *xs = (float *)(scr + qalign((size_t)(n * k)));
        p.s_ld = wt->act == WEIGHT_ACT_FP8_GROUP ? n : 0;
        cuda_act_quant(cb->stream, wt->act, wt->act_scale, scr, xs, NULL, x->data, false, n, n, k, p.s_ld);
        p.act = QMA_PRE;
        p.xs = xs;
        xp = scr;
    }
    const void *xb = xp;
    cudaStream_t s = cb->stream;
    const unsigned grid = (unsigned)ctas;
    const int ntiles = (int)cdiv(m, QTMA_ROWS);
    const unsigned tgrid = (unsigned)(ntiles < 2 * cb->num_sms ? ntiles : 2 * cb->num_sms);
#define QMMA_GO(F, S)                                                                                                  \
    do {                                                                                                               \
        if (tma && n <= 8)                                                                                             \
            qgemv_tma_launch<F, 1, S, TO>(s, tgrid, threads, smem, out, xb, v, bias, p, ntiles);                      \
        else if (tma)                                                                                                  \
            qgemv_tma_launch<F, 2, S, TO>(s, tgrid, threads, smem, out, xb, v, bias, p, ntiles);                      \
        else if (n <= 8)                                                                                               \
            qgemv_mma_launch<F, 1, S, TO>(s, grid, threads, smem, out, xb, v, bias, p);                               \
        else                                                                                                           \
            qgemv_mma_launch<F, 2, S, TO>(s, grid, threads, smem, out, xb, v, bias, p);                               \
    } while (0)
    const bool unit = v.mode == QS_BLOCK || v.mode == QS_GROUP;
    if (fmt == QW_FP8 && !unit)
        QMMA_GO(QW_FP8, QSC_END);
    else if (fmt == QW_FP8 && !v.z)
        QMMA_GO(QW_FP8, QSC_UNIT);
    else if (fmt == QW_INT8 && !v.z && unit)
        QMMA_GO(QW_INT8, QSC_UNIT);
    else if (fmt == QW_INT8 && unit)
        QMMA_GO(QW_INT8, QSC_UNIT_ZERO);
    else if (fmt == QW_INT4 && !v.z && unit)
        QMMA_GO(QW_INT4, QSC_UNIT);
    else if (fmt == QW_INT4 && unit)
        QMMA_GO(QW_INT4, QSC_UNIT_ZERO);
    else
        return false;
#undef QMMA_GO
    return true;
}

static void qdequant_launch(cudaStream_t s, int fmt, __nv_bfloat16 *dst, const struct qw_view &w, int64_t r0,
                            int64_t rows) {
    const unsigned grid = qgrid(rows * w.k, 256);
    if (fmt == QW_FP8)
        pdl_launch(qdequant_rows_kernel<QW_FP8>, grid, 256, 0, s, dst, w, r0, rows);
    else if (fmt == QW_INT4)
        pdl_launch(qdequant_rows_kernel<QW_INT4>, grid, 256, 0, s, dst, w, r0, rows);
    else
        pdl_launch(qdequant_rows_kernel<QW_INT8>, grid, 256, 0, s, dst, w, r0, rows);
    CUDA_CHECK_LAUNCH();
}

static void qadd_bias(cudaStream_t s, struct tensor *out, const struct tensor *bias, int64_t n, int64_t m) {
    if (out->dtype == DTYPE_BF16)
        pdl_launch(qadd_bias_kernel<__nv_bfloat16>, qgrid(n * m, 256), 256, 0, s, (__nv_bfloat16 *)out->data,
                   (const __nv_bfloat16 *)bias->data, n, m);
    else
        pdl_launch(qadd_bias_kernel<float>, qgrid(n * m, 256), 256, 0, s, (float *)out->data,
                   (const float *)bias->data, n, m);
    CUDA_CHECK_LAUNCH();
}

// The cuBLASLt FP8 GEMM with scale modes; false when cuBLASLt has no algorithm (nothing ran).
static bool qmm_fp8_scaled(struct cuda_backend *cb, struct tensor *out, const struct tensor *x, const struct weight *w,
                           const struct tensor *bias, int64_t n, int64_t m, int64_t k) {
    cudaStream_t s = cb->stream;
    const bool block = w->scheme == WEIGHT_SCHEME_BLOCK;
    const int64_t n_pad = block ? (n + 3) / 4 * 4 : n;
    const int64_t kb = (k + 127) / 128, kb_pad = (kb + 3) / 4 * 4, mb = (m + 127) / 128;
    const size_t es = dtype_row_bytes(out->dtype, 1);
    struct qmm_plan *p = qplan_get(cb, block ? QPLAN_FP8_BLOCK : QPLAN_FP8_VEC, m, n_pad, k, m, out->dtype, false);
    if (!p->ok) return false;
    size_t off_q = 0, off_s = qalign((size_t)n_pad * k);
    size_t off_ws = off_s + qalign(sizeof(float) * (size_t)(block ? kb * n_pad : n_pad));
    size_t ws_bytes = block ? (kb % 4 ? sizeof(float) * (size_t)(mb * kb_pad) : 0)
                            : (w->scheme == WEIGHT_SCHEME_PER_TENSOR ? sizeof(float) * (size_t)m : 0);
    size_t off_d = off_ws + qalign(ws_bytes);
    size_t d_bytes = n_pad != n ? es * (size_t)(n_pad * m) : 0;
    uint8_t *scr = (uint8_t *)cuda_qmm_scratch(cb, off_d + qalign(d_bytes));
    uint8_t *xq = scr + off_q;
    float *xs = (float *)(scr + off_s);
    cuda_act_quant(s, w->act, w->act_scale, xq, xs, NULL, x->data, false, n, n_pad, k, block ? n_pad : 0);
    const float *wsp = (const float *)w->scale.data;
    if (ws_bytes) {
        float *wpad = (float *)(scr + off_ws);
        if (block) // k-blocks padded to a multiple of 4 (cuBLASLt's layout of 128 x 128 block scales)
            CUDA_CHECK(cudaMemcpy2DAsync(wpad, sizeof(float) * (size_t)kb_pad, wsp, sizeof(float) * (size_t)kb,
                                         sizeof(float) * (size_t)kb, (size_t)mb, cudaMemcpyDeviceToDevice, s));
        else { // per tensor as a per-channel vector
            pdl_launch(qfill_kernel, qgrid(m, 256), 256, 0, s, wpad, wsp, m);
            CUDA_CHECK_LAUNCH();
        }
        wsp = wpad;
    }
    void *d = d_bytes ? (void *)(scr + off_d) : out->data;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &wsp, sizeof wsp));
    const float *xsp = xs;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xsp, sizeof xsp));
    float alpha = 1.0f, beta = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(cb->lt, p->desc, &alpha, w->t.data, p->a, xq, p->b, &beta, d, p->c, d, p->c, &p->algo,
                                cb->lt_workspace, cb->lt_workspace_bytes, s));
    if (d_bytes) CUDA_CHECK(cudaMemcpyAsync(out->data, d, es * (size_t)(n * m), cudaMemcpyDeviceToDevice, s));
    if (bias) qadd_bias(s, out, bias, n, m);
    return true;
}

// Dequantize-and-GEMM: correct for every weight / activation combination.
static void qmm_dequant_gemm(struct cuda_backend *cb, struct tensor *out, const struct tensor *x,
                             const struct weight *w, const struct qw_view &v, int fmt, const struct tensor *bias,
                             int64_t n, int64_t m, int64_t k) {
    cudaStream_t s = cb->stream;
    int64_t chunk = (int64_t)(QMM_DEQ_CHUNK_BYTES / (2 * (size_t)k));
    if (chunk < 128) chunk = 128;
    if (chunk > m) chunk = m;
    const bool qa = w->act != WEIGHT_ACT_NONE;
    const int64_t ng = w->act == WEIGHT_ACT_FP8_GROUP ? (k + 127) / 128 : 1;
    size_t off_w = 0, off_x = qalign(sizeof(__nv_bfloat16) * (size_t)(chunk * k));
    size_t off_q = off_x + (qa ? qalign(sizeof(__nv_bfloat16) * (size_t)(n * k)) : 0);
    size_t off_s = off_q + (qa ? qalign((size_t)(n * k)) : 0);
    size_t need = off_s + (qa ? qalign(sizeof(float) * (size_t)(n * ng)) : 0);
    uint8_t *scr = (uint8_t *)cuda_qmm_scratch(cb, need);
    __nv_bfloat16 *wt = (__nv_bfloat16 *)(scr + off_w);
    const void *xb = x->data;
    if (qa) {
        __nv_bfloat16 *xd = (__nv_bfloat16 *)(scr + off_x);
        cuda_act_quant(s, w->act, w->act_scale, scr + off_q, (float *)(scr + off_s), xd, x->data, false, n, n, k,
                       w->act == WEIGHT_ACT_FP8_GROUP ? n : 0);
        xb = xd;
    }
    const size_t es = dtype_row_bytes(out->dtype, 1);
    for (int64_t j0 = 0; j0 < m; j0 += chunk) {
        const int64_t jn = m - j0 < chunk ? m - j0 : chunk;
        qdequant_launch(s, fmt, wt, v, j0, jn);
        struct qmm_plan *p = qplan_get(cb, QPLAN_BF16, jn, n, k, m, out->dtype, bias != NULL);
        CHECK_MSG(p->ok, "cuBLASLt has no BF16 algorithm for m=%lld n=%lld k=%lld", (long long)jn, (long long)n,
                  (long long)k);
        if (bias) {
            const void *bp = (const char *)bias->data + es * (size_t)j0;
            CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp));
        }
        float alpha = 1.0f, beta = 0.0f;
        void *d = (char *)out->data + es * (size_t)j0;
        CUBLAS_CHECK(cublasLtMatmul(cb->lt, p->desc, &alpha, wt, p->a, xb, p->b, &beta, d, p->c, d, p->c, &p->algo,
                                    cb->lt_workspace, cb->lt_workspace_bytes, s));
    }
}

void cuda_qmatmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                  const struct tensor *bias) {
    struct cuda_backend *cb = cuda_impl(b);
    cudaStream_t s = cb->stream;
    CHECK_MSG(w->t.ndim == 2, "CUDA matmul: a quantized weight must be 2-D");
    const int fmt = qw_format(w), af = cuda_qa_fmt(w);
    const struct qw_view v = cuda_qw_view(w);
    const int64_t n = tensor_rows(x), k = tensor_cols(x), m = v.m;
    CHECK_MSG(v.k == k, "matmul: x has %lld columns, w %lld", (long long)k, (long long)v.k);
    CHECK_MSG(tensor_cols(out) == m && tensor_rows(out) == n, "matmul: out is not (%lld, %lld)", (long long)n,
              (long long)m);
    CHECK_MSG(x->dtype == DTYPE_BF16, "CUDA quantized matmul: x must be BF16, not %s", dtype_name(x->dtype));
    CHECK(out->dtype == DTYPE_BF16 || out->dtype == DTYPE_F32);
    CHECK(!bias || (tensor_numel(bias) == m && bias->dtype == out->dtype));
    if (w->scheme == WEIGHT_SCHEME_BLOCK)
        CHECK(w->scale.ndim == 2 && w->scale.ne[0] == (m + v.br - 1) / v.br && w->scale.ne[1] == v.s_cols);
    else if (w->scheme == WEIGHT_SCHEME_PER_CHANNEL)
        CHECK(tensor_numel(&w->scale) == m);
    else if (w->scheme == WEIGHT_SCHEME_PER_TENSOR)
        CHECK(tensor_numel(&w->scale) == 1);
    else
        CHECK(w->scale.ndim == 2 && w->scale.ne[0] == m && w->scale.ne[1] == v.s_cols);
    if (n == 0 || m == 0) return;
    if (k == 0) {
        CUDA_CHECK(cudaMemsetAsync(out->data, 0, tensor_bytes(out), s));
        if (bias) qadd_bias(s, out, bias, n, m);
        return;
    }
    if (n <= QMMA_MAX_ROWS) {
        const bool ran = out->dtype == DTYPE_BF16
                             ? qgemv_mma<__nv_bfloat16>(cb, (__nv_bfloat16 *)out->data, x, w, v, fmt, af,
                                                        bias ? (const __nv_bfloat16 *)bias->data : nullptr, n)
                             : qgemv_mma<float>(cb, (float *)out->data, x, w, v, fmt, af,
                                                bias ? (const float *)bias->data : nullptr, n);
        if (ran) return;
    }
    if (n <= QMM_GEMV_MAX_ROWS) {
        struct qa_view a = {x->data, NULL, k, 0};
        if (af != QA_BF16) {
            const int64_t ng = w->act == WEIGHT_ACT_FP8_GROUP ? (k + 127) / 128 : 1;
            uint8_t *scr = (uint8_t *)cuda_qmm_scratch(cb, qalign((size_t)(n * k)) + sizeof(float) * (size_t)(n * ng));
            float *xs = (float *)(scr + qalign((size_t)(n * k)));
            const int64_t s_ld = w->act == WEIGHT_ACT_FP8_GROUP ? n : 0;
            cuda_act_quant(s, w->act, w->act_scale, scr, xs, NULL, x->data, false, n, n, k, s_ld);
            a = (struct qa_view){scr, xs, k, s_ld};
        }
        const bool vec = qdot_vec_ok(fmt, af, v.q, v.row_bytes, 0, a.x, k);
        if (out->dtype == DTYPE_BF16)
            qgemv_dispatch<__nv_bfloat16>(s, fmt, af, (__nv_bfloat16 *)out->data, a, v,
                                          bias ? (const __nv_bfloat16 *)bias->data : nullptr, (int)n, vec);
        else
            qgemv_dispatch<float>(s, fmt, af, (float *)out->data, a, v, bias ? (const float *)bias->data : nullptr,
                                  (int)n, vec);
        return;
    }
    const bool fp8_vec = fmt == QW_FP8 && (w->act == WEIGHT_ACT_FP8_TOKEN || w->act == WEIGHT_ACT_FP8_STATIC) &&
                         (w->scheme == WEIGHT_SCHEME_PER_CHANNEL || w->scheme == WEIGHT_SCHEME_PER_TENSOR);
    const bool fp8_block = fmt == QW_FP8 && w->act == WEIGHT_ACT_FP8_GROUP && w->scheme == WEIGHT_SCHEME_BLOCK &&
                           w->block_rows == 128 && w->block_cols == 128 && k % 128 == 0;
    if (QMM_CUBLASLT_SCALED && (fp8_vec || fp8_block) && k % 16 == 0 && aligned16(w->t.data) && aligned16(out->data) &&
        qmm_fp8_scaled(cb, out, x, w, bias, n, m, k))
        return;
    if (fmt == QW_INT8 && af == QA_INT8 && cuda_qgemm_int8(cb, out, x, w, bias, n, m, k)) return;
    qmm_dequant_gemm(cb, out, x, w, v, fmt, bias, n, m, k);
}
