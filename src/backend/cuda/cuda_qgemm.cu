// INT8 W8A8 GEMM on the tensor cores (cuBLASLt IMMA) for prefill-sized batches, called by
// cuda_qmatmul (cuda_qmatmul.cu) for rows n > its GEMV bound. The weight: compressed-tensors
// int-quantized (llm-compressor W8A8 INT8) as the loader keeps it, WEIGHT_SCHEME_GROUP with 8-bit
// values packed four per I32 word (byte = q + 128, low byte first), one F32 scale per output
// channel (one group of the whole row), no zero points, no column map. The activations: INT8 per
// token (INT8_TOKEN) or static (INT8_STATIC), quantized by cuda_act_quant into signed bytes and one
// scale per row, exactly as the CPU reference (core/weight.h act_quant_row).
//
// out(n, m) = (sum_k xq(t, k) * q(j, k)) * sx(t) * sw(j) (+ bias(j)): the integer sum is exact
// (int32 accumulation in the IMMA kernel), the two scales are applied in fp32 by the epilogue
// kernel below, so the result differs from the CPU's fp32 sum of dequantized products only by fp32
// rounding (far below the BF16 fallback's weight rounding). The offset-128 bytes are made signed
// (XOR 0x80) into scratch in chunks of weight rows (QGEMM_CHUNK_BYTES with the chunk's int32
// accumulator), then one cuBLASLt GEMM per chunk (A = the chunk's rows (k, mc) transposed, B = xq
// (k, n), D int32 (mc, n); CUBLAS_COMPUTE_32I, the TN layout IMMA takes). Scratch is
// cuda_qmm_scratch's (grow-only; not grown during graph capture).
//
// cuda_qgemm_int8 returns false (nothing ran) for anything it does not take (other formats,
// zero points, group scales, k or m not a multiple of 16, 16 rows or fewer, misaligned pointers) or when cuBLASLt
// has no IMMA algorithm for the shape; the caller then takes its dequantize-GEMM fallback.
#include "backend/cuda/cuda_qdot.cuh"

#include <string.h>

// 0 sends INT8 W8A8 prefill back to cuda_qmatmul's dequantize-GEMM fallback (an A/B switch).
#ifndef QGEMM_INT8_IMMA
#define QGEMM_INT8_IMMA 1
#endif
#define QGEMM_CHUNK_BYTES (64u << 20)
#define QGEMM_PLAN_CAP 128

struct qgemm_plan {
    bool used, ok;
    int64_t m, n, k;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};

struct qgemm_state {
    struct qgemm_plan plans[QGEMM_PLAN_CAP];
    int n_plans;
};

static void qgemm_plan_release(struct qgemm_plan *p) {
    if (!p->used) return;
    cublasLtMatmulDescDestroy(p->desc);
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->c);
    p->used = false;
}

void cuda_qgemm_destroy(struct cuda_backend *cb) {
    struct qgemm_state *q = (struct qgemm_state *)cb->qgemm;
    if (q)
        for (int i = 0; i < QGEMM_PLAN_CAP; i++)
            qgemm_plan_release(&q->plans[i]);
    free(q);
    cb->qgemm = NULL;
}

// The IMMA plan of D (m, n) int32 = A (k, m)^T int8 x B (k, n) int8, column-major.
static struct qgemm_plan *qgemm_plan_get(struct cuda_backend *cb, int64_t m, int64_t n, int64_t k) {
    if (!cb->qgemm) {
        cb->qgemm = calloc(1, sizeof(struct qgemm_state));
        CHECK_MSG(cb->qgemm, "out of host memory");
    }
    struct qgemm_state *q = (struct qgemm_state *)cb->qgemm;
    for (int i = 0; i < q->n_plans; i++) {
        struct qgemm_plan *p = &q->plans[i];
        if (p->used && p->m == m && p->n == n && p->k == k) return p;
    }
    if (q->n_plans >= QGEMM_PLAN_CAP) { // an unbounded stream of prefill sizes: start over
        for (int i = 0; i < QGEMM_PLAN_CAP; i++)
            qgemm_plan_release(&q->plans[i]);
        q->n_plans = 0;
    }
    struct qgemm_plan *p = &q->plans[q->n_plans++];
    memset(p, 0, sizeof *p);
    p->used = true;
    p->m = m;
    p->n = n;
    p->k = k;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32I, CUDA_R_32I));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8I, k, m, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8I, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32I, m, n, m));
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

// dst (rows, k) int8 = weight rows [r0, r0 + rows) of offset-128 bytes, made signed (k % 16 == 0:
// whole 16-byte vectors).
__global__ void qgemm_signed_rows_kernel(uint4 *dst, const uint4 *src, int64_t n_vec) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += (int64_t)gridDim.x * blockDim.x) {
        uint4 v = src[i];
        v.x ^= 0x80808080u;
        v.y ^= 0x80808080u;
        v.z ^= 0x80808080u;
        v.w ^= 0x80808080u;
        dst[i] = v;
    }
}

// out[t * ldo + j] = acc[t * mc + j] * sx[t] * sw[j] (+ bias[j]) for t < n, j < mc.
template <typename TO>
__global__ void qgemm_epilogue_kernel(TO *out, int64_t ldo, const int32_t *acc, int64_t mc, int64_t n, const float *sx,
                                      const float *sw, const TO *bias) {
    pdl_begin();
    const int64_t total = n * mc;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / mc, j = i % mc;
        float v = (float)acc[i] * sx[t] * sw[j];
        if (bias) v += to_f32(bias[j]);
        out[t * ldo + j] = from_f32<TO>(v);
    }
}

static unsigned qgemm_grid(int64_t total, int threads) {
    int64_t g = (total + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 65535 * 4 ? 65535 * 4 : g);
}

static size_t qgemm_align(size_t b) {
    return (b + 255) & ~(size_t)255;
}

bool cuda_qgemm_int8(struct cuda_backend *cb, struct tensor *out, const struct tensor *x, const struct weight *w,
                     const struct tensor *bias, int64_t n, int64_t m, int64_t k) {
    if (!QGEMM_INT8_IMMA) return false;
    if (w->t.dtype != DTYPE_I32 || w->bits != 8 || w->scheme != WEIGHT_SCHEME_GROUP || w->t.ndim != 2) return false;
    if (w->act != WEIGHT_ACT_INT8_TOKEN && w->act != WEIGHT_ACT_INT8_STATIC) return false;
    if (w->zero.data || w->gidx.data || tensor_numel(&w->scale) != m || w->block_cols < k) return false;
    // More than 16 rows (torch._int_mm asks the same of cuBLASLt's int8 GEMM); 9..16 rows take the fallback.
    if (n <= 16 || k % 16 || m % 16 || !aligned16(w->t.data) || !aligned16(out->data)) return false;
    cudaStream_t s = cb->stream;
    // Chunk of weight rows: its signed copy (mc, k) and int32 accumulator (n, mc) within the budget.
    int64_t mc = (int64_t)(QGEMM_CHUNK_BYTES / (size_t)(k + 4 * n)) / 16 * 16;
    if (mc < 16) mc = 16;
    if (mc > m) mc = m;
    struct qgemm_plan *p = qgemm_plan_get(cb, mc, n, k);
    if (!p->ok) return false;
    const int64_t tail = m % mc;
    struct qgemm_plan *pt = tail ? qgemm_plan_get(cb, tail, n, k) : NULL;
    if (pt && !pt->ok) return false;
    const size_t off_q = 0, off_s = qgemm_align((size_t)(n * k));
    const size_t off_w = off_s + qgemm_align(sizeof(float) * (size_t)n);
    const size_t off_acc = off_w + qgemm_align((size_t)(mc * k));
    const size_t need = off_acc + qgemm_align(sizeof(int32_t) * (size_t)(n * mc));
    uint8_t *scr = (uint8_t *)cuda_qmm_scratch(cb, need);
    uint8_t *xq = scr + off_q, *wq = scr + off_w;
    float *xs = (float *)(scr + off_s);
    int32_t *acc = (int32_t *)(scr + off_acc);
    cuda_act_quant(s, w->act, w->act_scale, xq, xs, NULL, x->data, false, n, n, k, 0);
    const float *sw = (const float *)w->scale.data;
    const size_t es = dtype_row_bytes(out->dtype, 1);
    for (int64_t j0 = 0; j0 < m; j0 += mc) {
        const int64_t jn = m - j0 < mc ? m - j0 : mc;
        struct qgemm_plan *pp = jn == mc ? p : pt;
        const int64_t n_vec = jn * k / 16;
        pdl_launch(qgemm_signed_rows_kernel, qgemm_grid(n_vec, 256), 256, 0, s, (uint4 *)wq,
                   (const uint4 *)((const uint8_t *)w->t.data + (size_t)(j0 * k)), n_vec);
        CUDA_CHECK_LAUNCH();
        int32_t alpha = 1, beta = 0;
        const cublasStatus_t st = cublasLtMatmul(cb->lt, pp->desc, &alpha, wq, pp->a, xq, pp->b, &beta, acc, pp->c, acc,
                                                 pp->c, &pp->algo, cb->lt_workspace, cb->lt_workspace_bytes, s);
        if (st != CUBLAS_STATUS_SUCCESS) { // an algorithm the heuristic offered but the shape does not take:
            pp->ok = false;                // this shape takes the fallback from now on (it recomputes everything)
            return false;
        }
        // acc is (jn, n) column-major = (n, jn) row-major.
        void *o = (char *)out->data + es * (size_t)j0;
        if (out->dtype == DTYPE_BF16)
            pdl_launch(qgemm_epilogue_kernel<__nv_bfloat16>, qgemm_grid(n * jn, 256), 256, 0, s, (__nv_bfloat16 *)o, m,
                       (const int32_t *)acc, jn, n, (const float *)xs, sw + j0,
                       bias ? (const __nv_bfloat16 *)bias->data + j0 : (const __nv_bfloat16 *)nullptr);
        else
            pdl_launch(qgemm_epilogue_kernel<float>, qgemm_grid(n * jn, 256), 256, 0, s, (float *)o, m,
                       (const int32_t *)acc, jn, n, (const float *)xs, sw + j0,
                       bias ? (const float *)bias->data + j0 : (const float *)nullptr);
        CUDA_CHECK_LAUNCH();
    }
    return true;
}
