// moe_experts over quantized stacked experts (FP8 per tensor / channel / 128x128 blocks with
// their W8A8 activations, INT4 / INT8 W4A16 / W8A16 groups): the slot path of cuda_moe.cu for
// quantized weights. Reference: cpu_moe_experts over cpu_qmatmul (per-expert matmuls, f32
// SiLU*mul, the combine in slot order).
//
// Per call (R = n * n_slots routed rows):
//   1. x (n, H) quantized as the gate_up weight's act says (act_quant_kernel; per token, so
//      the gathered rows the CPU quantizes per expert get the same bytes), or read as bf16
//   2. moe_q_gate_up_kernel, grid (R, I / 4): a warp per (routed row, intermediate column c)
//      takes the dot products with gate row c and up row I + c of the row's expert (values
//      dequantized in registers, cuda_qdot.cuh) and stores silu(g) * u in f32 (R, I)
//   3. that f32 activation quantized per row as the down weight's act says (or read as f32)
//   4. moe_q_down_kernel, grid (n, H / 4): a warp per (token, output column) sums over the
//      token's slots, in slot order, weight x dot(down row of the slot's expert, activation row)
//      in f32, and stores bf16. Ids outside [0, E) contribute nothing (as cuda_moe.cu).
// Each routed row streams its expert's weights (one byte or half a byte per weight): the
// decode path. Larger batches re-read an expert's weights once per routed row (mostly from L2
// for a busy expert): correct at any size but not a grouped GEMM; a quantized grouped GEMM
// (rows sorted by expert, tensor cores) is the next step for prefill-heavy loads.
// Launch shapes depend only on n (graph-capturable); scratch comes from the quantized-matmul
// scratch (grown by the eager warm-up before a capture).
#include "backend/cuda/cuda_qdot.cuh"

#define MOEQ_WARPS 4

template <int FMT, int AF>
__global__ void __launch_bounds__(32 * MOEQ_WARPS)
    moe_q_gate_up_kernel(float *act, struct qa_view a, struct qw_view w, const int32_t *ids, int n_slots, int E,
                         int64_t I, bool vec) {
    pdl_begin();
    const int lane = threadIdx.x % 32;
    const int64_t c = (int64_t)blockIdx.y * MOEQ_WARPS + threadIdx.x / 32;
    const int64_t r = blockIdx.x;
    if (c >= I) return;
    const int e = ids[r];
    if (e < 0 || e >= E) {
        if (lane == 0) act[r * I + c] = 0.f;
        return;
    }
    const uint8_t *wq = w.q + (int64_t)e * w.e_bytes;
    const float *ws = w.s + (int64_t)e * w.e_scales;
    const int64_t xr[1] = {r / n_slots};
    float g[1] = {0.f}, u[1] = {0.f};
    qdot_lane<FMT, AF, 1>(g, w, wq, ws, c, a, xr, 1, vec, lane);
    qdot_lane<FMT, AF, 1>(u, w, wq, ws, I + c, a, xr, 1, vec, lane);
    const float gs = warp_sum(g[0]), us = warp_sum(u[0]);
    if (lane == 0) act[r * I + c] = gs / (1.f + expf(-gs)) * us;
}

template <int FMT, int AF>
__global__ void __launch_bounds__(32 * MOEQ_WARPS)
    moe_q_down_kernel(__nv_bfloat16 *out, struct qa_view a, struct qw_view w, const int32_t *ids, const float *tw,
                      int n_slots, int E, int64_t H, bool vec) {
    pdl_begin();
    const int lane = threadIdx.x % 32;
    const int64_t h = (int64_t)blockIdx.y * MOEQ_WARPS + threadIdx.x / 32;
    const int64_t t = blockIdx.x;
    if (h >= H) return;
    float total = 0.f;
    for (int j = 0; j < n_slots; j++) {
        const int64_t r = t * n_slots + j;
        const int e = ids[r];
        if (e < 0 || e >= E) continue;
        const int64_t xr[1] = {r};
        float acc[1] = {0.f};
        qdot_lane<FMT, AF, 1>(acc, w, w.q + (int64_t)e * w.e_bytes, w.s + (int64_t)e * w.e_scales, h, a, xr, 1, vec,
                              lane);
        total += tw[r] * warp_sum(acc[0]);
    }
    if (lane == 0) out[t * H + h] = __float2bfloat16_rn(total);
}

template <int FMT, int AF_GU, int AF_DN>
static void moe_q_launch(cudaStream_t s, __nv_bfloat16 *out, const struct qa_view &ax, const struct qw_view &gu,
                         float *act, const struct qa_view &aa, const struct qw_view &dn, const int32_t *ids,
                         const float *tw, int n_slots, int64_t n, int E, int64_t H, int64_t I, bool vec_gu, bool vec_dn,
                         enum weight_act dn_act, float dn_scale) {
    const int64_t R = n * n_slots;
    pdl_launch(moe_q_gate_up_kernel<FMT, AF_GU>, dim3((unsigned)R, cdiv(I, MOEQ_WARPS)), 32 * MOEQ_WARPS, 0, s, act, ax,
               gu, ids, n_slots, E, I, vec_gu);
    CUDA_CHECK_LAUNCH();
    if (dn_act != WEIGHT_ACT_NONE)
        cuda_act_quant(s, dn_act, dn_scale, (uint8_t *)aa.x, (float *)aa.s, NULL, act, true, R, R, I, aa.s_ld);
    pdl_launch(moe_q_down_kernel<FMT, AF_DN>, dim3((unsigned)n, cdiv(H, MOEQ_WARPS)), 32 * MOEQ_WARPS, 0, s, out, aa,
               dn, ids, tw, n_slots, E, H, vec_dn);
    CUDA_CHECK_LAUNCH();
}

static size_t moeq_align(size_t b) {
    return (b + 255) & ~(size_t)255;
}

void cuda_moe_experts_quant(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up,
                            const struct weight *down, const int32_t *topk_ids, const float *topk_w, int n_slots,
                            void *workspace) {
    (void)workspace;
    struct cuda_backend *cb = cuda_impl(b);
    cudaStream_t s = cb->stream;
    CHECK_MSG(gate_up->t.ndim == 3 && down->t.ndim == 3, "CUDA moe_experts: stacked (E, rows, cols) weights");
    CHECK_MSG(gate_up->scheme == down->scheme && cuda_qw_fmt(gate_up) == cuda_qw_fmt(down),
              "CUDA moe_experts: gate_up (%s) and down (%s) quantized differently", weight_scheme_name(gate_up->scheme),
              weight_scheme_name(down->scheme));
    CHECK(x->dtype == DTYPE_BF16 && out->dtype == DTYPE_BF16);
    const struct qw_view gu = cuda_qw_view(gate_up), dn = cuda_qw_view(down);
    const int fmt = cuda_qw_fmt(gate_up), af_gu = cuda_qa_fmt(gate_up), af_dn0 = cuda_qa_fmt(down);
    const int64_t n = tensor_rows(x), H = tensor_cols(x), I = dn.k;
    const int E = (int)gate_up->t.ne[0];
    CHECK_MSG(gu.m == 2 * I && gu.k == H && down->t.ne[0] == E && dn.m == H,
              "moe_experts: stacked weight shapes do not match H %lld", (long long)H);
    CHECK(tensor_rows(out) == n && tensor_cols(out) == H && out->data != x->data && n_slots >= 1);
    if (n == 0) return;
    const int64_t R = n * n_slots;
    const int64_t ngH = gate_up->act == WEIGHT_ACT_FP8_GROUP ? (H + 127) / 128 : 1;
    const int64_t ngI = down->act == WEIGHT_ACT_FP8_GROUP ? (I + 127) / 128 : 1;
    const bool qx = gate_up->act != WEIGHT_ACT_NONE, qa = down->act != WEIGHT_ACT_NONE;
    size_t off_xq = 0, off_xs = off_xq + (qx ? moeq_align((size_t)(n * H)) : 0);
    size_t off_act = off_xs + (qx ? moeq_align(sizeof(float) * (size_t)(n * ngH)) : 0);
    size_t off_aq = off_act + moeq_align(sizeof(float) * (size_t)(R * I));
    size_t off_as = off_aq + (qa ? moeq_align((size_t)(R * I)) : 0);
    size_t need = off_as + (qa ? moeq_align(sizeof(float) * (size_t)(R * ngI)) : 0);
    uint8_t *scr = (uint8_t *)cuda_qmm_scratch(cb, need);
    struct qa_view ax = {x->data, NULL, H, 0};
    if (qx) {
        const int64_t s_ld = gate_up->act == WEIGHT_ACT_FP8_GROUP ? n : 0;
        cuda_act_quant(s, gate_up->act, gate_up->act_scale, scr + off_xq, (float *)(scr + off_xs), NULL, x->data, false,
                       n, n, H, s_ld);
        ax = (struct qa_view){scr + off_xq, (const float *)(scr + off_xs), H, s_ld};
    }
    float *act = (float *)(scr + off_act);
    struct qa_view aa = {act, NULL, I, 0};
    int af_dn = QA_F32;
    if (qa) {
        aa =
            (struct qa_view){scr + off_aq, (const float *)(scr + off_as), I, down->act == WEIGHT_ACT_FP8_GROUP ? R : 0};
        af_dn = af_dn0;
    }
    const bool vec_gu = qdot_vec_ok(fmt, af_gu, gu.q, gu.row_bytes, gu.e_bytes, ax.x, H);
    const bool vec_dn = qdot_vec_ok(fmt, af_dn, dn.q, dn.row_bytes, dn.e_bytes, aa.x, I);
    __nv_bfloat16 *o = (__nv_bfloat16 *)out->data;
#define MOEQ(F, AG, AD)                                                                                                \
    moe_q_launch<F, AG, AD>(s, o, ax, gu, act, aa, dn, topk_ids, topk_w, n_slots, n, E, H, I, vec_gu, vec_dn,          \
                            down->act, down->act_scale)
    if (fmt == QW_FP8 && af_gu == QA_FP8 && af_dn == QA_FP8)
        MOEQ(QW_FP8, QA_FP8, QA_FP8);
    else if (fmt == QW_FP8 && af_gu == QA_BF16 && af_dn == QA_F32)
        MOEQ(QW_FP8, QA_BF16, QA_F32);
    else if (fmt == QW_INT4 && af_gu == QA_BF16 && af_dn == QA_F32)
        MOEQ(QW_INT4, QA_BF16, QA_F32);
    else if (fmt == QW_INT8 && af_gu == QA_BF16 && af_dn == QA_F32)
        MOEQ(QW_INT8, QA_BF16, QA_F32);
    else
        CHECK_MSG(0, "CUDA moe_experts: weight format %d with activation formats %d / %d not implemented", fmt, af_gu,
                  af_dn);
#undef MOEQ
}
