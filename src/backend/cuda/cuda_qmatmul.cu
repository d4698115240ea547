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
// - n <= QMM_GEMV_MAX_ROWS (decode): qgemv_kernel, a warp per output column streams the weight
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
