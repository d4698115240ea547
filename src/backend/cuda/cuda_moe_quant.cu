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
// decode path, taken up to MOEQ_MMA_MIN_ROWS routed rows (and for shapes the GEMM below does not
// take). Larger batches (prefill) take the grouped tensor-core GEMM further down (rows sorted by
// expert, weight tiles dequantized to bf16 in shared memory feeding mma.sync).
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

// ---------------------------------------------------------------------------------------
// Prefill: a grouped tensor-core GEMM over the quantized experts

// Batches past MOEQ_MMA_MIN_ROWS routed rows take the grouped path of cuda_moe.cu (rows sorted by
// expert, cuda_moe_sort_launch; GEMM tiles of one expert; SiLU*mul; combine in slot order,
// cuda_moe_combine_launch) with moe_q_mma_kernel as its GEMM: mma.sync m16n8k16 (bf16 in, f32
// accumulate) where the weight tile of each BK-step is read as stored (one byte per FP8 / INT8
// weight, half a byte per INT4), dequantized in registers ((q - z) * s, rounded to bf16) and
// stored to shared memory, and the activation tile comes by cp.async. Activations: bf16 x, or for
// W8A8 experts the activation quantization's bf16 dequantized copy (cuda_act_quant's deq: the
// stored bytes times their scales); gate_up's output is bf16 (R, 2I), SiLU*mul is the BF16 op, and
// down's input is quantized from that bf16 activation. So the result differs from the CPU
// reference (f32 products of the unrounded dequantized values, f32 SiLU*mul) by bf16 roundings of
// both operands and of gate_up's output: the dequantize-GEMM fallback's precision (cuda_qmatmul.cu).
// Shapes: H and I multiples of MOEQ_BK, group / block widths multiples of 8, no column map.
#ifndef MOEQ_MMA_MIN_ROWS
#define MOEQ_MMA_MIN_ROWS 128
#endif
// 0 keeps every batch on the slot kernels (an A/B switch).
#ifndef MOEQ_MMA
#define MOEQ_MMA 1
#endif
#define MOEQ_BM 64
#define MOEQ_BN 128
#define MOEQ_BK 64
#define MOEQ_LD (MOEQ_BK + 8) // padded shared rows: conflict-free ldmatrix
#define MOEQ_STAGES 3
#define MOEQ_WM 2 // warp grid 2 x 4: warp tiles of 32 x 32
#define MOEQ_WN 4
#define MOEQ_THREADS (32 * MOEQ_WM * MOEQ_WN)
#define MOEQ_SMEM ((size_t)MOEQ_STAGES * (MOEQ_BM + MOEQ_BN) * MOEQ_LD * sizeof(__nv_bfloat16))
#define MOEQ_W_PER (MOEQ_BN * (MOEQ_BK / 8) / MOEQ_THREADS) // 8-value weight chunks per thread and step
#define MOEQ_A_PER (MOEQ_BM * (MOEQ_BK / 8) / MOEQ_THREADS) // 16-byte activation chunks per thread and step

// Raw values of 8 weights (row `row` of expert view w, columns c .. c + 7, c % 8 == 0) as stored.
template <int FMT> struct moeq_raw8 { uint32_t u[FMT == QW_INT4 ? 1 : 2]; };
template <int FMT>
__device__ __forceinline__ moeq_raw8<FMT> moeq_load8(const uint8_t *wq, int64_t row_bytes, int64_t row, int64_t c) {
    moeq_raw8<FMT> r;
    if constexpr (FMT == QW_INT4) {
        r.u[0] = __ldg(reinterpret_cast<const uint32_t *>(wq + row * row_bytes + c / 2));
    } else {
        const uint2 v = __ldg(reinterpret_cast<const uint2 *>(wq + row * row_bytes + c));
        r.u[0] = v.x;
        r.u[1] = v.y;
    }
    return r;
}

// The 8 weights dequantized ((q - z) * s, the scale of (row, c): group / block widths are
// multiples of 8) and packed as bf16 pairs.
template <int FMT>
__device__ __forceinline__ uint4 moeq_dequant8(const moeq_raw8<FMT> &r, const struct qw_view &w, const float *s,
                                               const float *z, int64_t row, int64_t c) {
    const int64_t i = qw_sidx(w, row, c);
    const float sc = s[i], zp = z ? z[i] : 0.f;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float q;
        if constexpr (FMT == QW_FP8)
            q = fp8_byte_to_f32((r.u[j / 4] >> (8 * (j % 4))) & 255u);
        else if constexpr (FMT == QW_INT8)
            q = (float)((int)((r.u[j / 4] >> (8 * (j % 4))) & 255u) - 128);
        else
            q = (float)((int)((r.u[0] >> (4 * j)) & 15u) - 8);
        v[j] = (q - zp) * sc;
    }
    return make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}

// out[p, n] = A[row(p)] . deq(W[e][n]) for the sorted rows p of expert e (row(p) = a_index[p] /
// n_slots, or p), bf16 out, over MOEQ_BM-row tiles of one expert and MOEQ_BN columns.
template <int FMT>
__global__ void __launch_bounds__(MOEQ_THREADS)
    moe_q_mma_kernel(__nv_bfloat16 *out, const __nv_bfloat16 *A, const int32_t *a_index, int n_slots, struct qw_view w,
                     const int32_t *offsets, const int32_t *tile_start, int E, int N, int K) {
    pdl_begin();
    extern __shared__ __align__(128) unsigned char moeq_smem[];
    typedef __nv_bfloat16 a_stage[MOEQ_BM * MOEQ_LD];
    typedef __nv_bfloat16 w_stage[MOEQ_BN * MOEQ_LD];
    a_stage *As = reinterpret_cast<a_stage *>(moeq_smem);
    w_stage *Ws = reinterpret_cast<w_stage *>(moeq_smem + (size_t)MOEQ_STAGES * sizeof(a_stage));
    const int tile = blockIdx.y;
    if (tile >= tile_start[E]) return;
    const int e = moe_tile_expert(tile_start, E, tile);
    const int row0 = offsets[e] + (tile - tile_start[e]) * MOEQ_BM, row_end = offsets[e + 1];
    const int n0 = blockIdx.x * MOEQ_BN;
    const uint8_t *wq = w.q + (int64_t)e * w.e_bytes;
    const float *ws = w.s + (int64_t)e * w.e_scales, *wz = w.z ? w.z + (int64_t)e * w.e_scales : nullptr;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const __nv_bfloat16 *a_src[MOEQ_A_PER];
    int a_dst[MOEQ_A_PER];
    bool a_ok[MOEQ_A_PER];
#pragma unroll
    for (int i = 0; i < MOEQ_A_PER; i++) {
        const int c = tid + i * MOEQ_THREADS, r = c / (MOEQ_BK / 8), kc = (c % (MOEQ_BK / 8)) * 8, p = row0 + r;
        a_ok[i] = p < row_end;
        const int64_t arow = a_ok[i] ? (a_index ? a_index[p] / n_slots : p) : 0;
        a_src[i] = A + arow * K + kc;
        a_dst[i] = r * MOEQ_LD + kc;
    }
    int w_row[MOEQ_W_PER], w_kc[MOEQ_W_PER];
    bool w_ok[MOEQ_W_PER];
#pragma unroll
    for (int i = 0; i < MOEQ_W_PER; i++) {
        const int c = tid + i * MOEQ_THREADS;
        w_row[i] = c / (MOEQ_BK / 8);
        w_kc[i] = (c % (MOEQ_BK / 8)) * 8;
        w_ok[i] = n0 + w_row[i] < N;
    }
    auto load_a = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < MOEQ_A_PER; i++)
            cp_async16(smem_addr(&As[stage][a_dst[i]]), a_src[i] + kt * MOEQ_BK, a_ok[i]);
    };
    moeq_raw8<FMT> wr[MOEQ_W_PER] = {};
    auto fetch_w = [&](int kt) {
#pragma unroll
        for (int i = 0; i < MOEQ_W_PER; i++)
            if (w_ok[i]) wr[i] = moeq_load8<FMT>(wq, w.row_bytes, n0 + w_row[i], (int64_t)kt * MOEQ_BK + w_kc[i]);
    };
    auto store_w = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < MOEQ_W_PER; i++) {
            const uint4 v = w_ok[i]
                                ? moeq_dequant8<FMT>(wr[i], w, ws, wz, n0 + w_row[i], (int64_t)kt * MOEQ_BK + w_kc[i])
                                : make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4 *>(&Ws[stage][w_row[i] * MOEQ_LD + w_kc[i]]) = v;
        }
    };
    const int KT = K / MOEQ_BK;
#pragma unroll
    for (int st = 0; st < MOEQ_STAGES - 1; st++) {
        if (st < KT) {
            load_a(st, st);
            fetch_w(st);
            store_w(st, st);
        }
        cp_async_commit();
    }
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    const int wm = (warp / MOEQ_WN) * 32, wn = (warp % MOEQ_WN) * 32;
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<MOEQ_STAGES - 2>(); // activation slice kt has landed (this thread's part)
        __syncthreads();                  // ... everyone's, and the weight slice; slice kt - 1's stage is free
        const int nk = kt + MOEQ_STAGES - 1;
        if (nk < KT) {
            load_a(nk % MOEQ_STAGES, nk);
            fetch_w(nk); // in flight during this step's MMAs; dequantized and stored after them
        }
        cp_async_commit();
        const __nv_bfloat16 *as = As[kt % MOEQ_STAGES], *wsm = Ws[kt % MOEQ_STAGES];
#pragma unroll
        for (int kk = 0; kk < MOEQ_BK; kk += 16) {
            uint32_t af[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ldsm_x4(af[mt], smem_addr(as + (wm + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * MOEQ_LD + kk +
                                          (lane / 16) * 8));
#pragma unroll
            for (int j = 0; j < 2; j++) {
                uint32_t bf[4];
                ldsm_x4(bf, smem_addr(wsm + (wn + j * 16 + (lane % 8) + (lane / 16) * 8) * MOEQ_LD + kk +
                                      ((lane / 8) % 2) * 8));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_bf16(acc[mt][2 * j], af[mt], bf[0], bf[1]);
                    mma_bf16(acc[mt][2 * j + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
        if (nk < KT) store_w(nk % MOEQ_STAGES, nk); // that stage was freed by this step's barrier
    }
    cp_async_wait<0>();
    const int g = lane / 4, t4 = lane % 4;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int p = row0 + wm + mt * 16 + g + h * 8, n = n0 + wn + nt * 8 + 2 * t4;
                if (p < row_end && n < N)
                    *reinterpret_cast<uint32_t *>(out + (int64_t)p * N + n) =
                        pack_bf16(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
            }
}

static size_t moeq_align(size_t b) {
    return (b + 255) & ~(size_t)255;
}

void cuda_moe_quant_init(struct cuda_backend *cb) {
    (void)cb;
    CUDA_CHECK(
        cudaFuncSetAttribute(moe_q_mma_kernel<QW_FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MOEQ_SMEM));
    CUDA_CHECK(
        cudaFuncSetAttribute(moe_q_mma_kernel<QW_INT4>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MOEQ_SMEM));
    CUDA_CHECK(
        cudaFuncSetAttribute(moe_q_mma_kernel<QW_INT8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)MOEQ_SMEM));
}

// Whether the grouped tensor-core path takes these experts: scales whose group / block width is a
// multiple of 8 (a chunk of 8 weights has one scale), no column map, K multiples of MOEQ_BK.
static bool moeq_mma_ok(const struct qw_view &v) {
    if (v.gidx || v.k % MOEQ_BK || v.m % 2) return false;
    if (v.mode == QS_BLOCK || v.mode == QS_GROUP) return v.bc % 8 == 0;
    return true;
}

template <int FMT>
static void moeq_mma_launch(cudaStream_t s, __nv_bfloat16 *out, const __nv_bfloat16 *A, const int32_t *a_index,
                            int n_slots, const struct qw_view &w, const int32_t *offsets, const int32_t *tiles, int E,
                            int64_t R, int N, int K) {
    const int64_t max_tiles = R < cdiv(R, MOEQ_BM) + E ? R : cdiv(R, MOEQ_BM) + E;
    const dim3 grid(cdiv(N, MOEQ_BN), (unsigned)max_tiles);
    pdl_launch(moe_q_mma_kernel<FMT>, grid, MOEQ_THREADS, MOEQ_SMEM, s, out, A, a_index, n_slots, w, offsets, tiles, E,
               N, K);
    CUDA_CHECK_LAUNCH();
}

static void moeq_mma(cudaStream_t s, int fmt, __nv_bfloat16 *out, const __nv_bfloat16 *A, const int32_t *a_index,
                     int n_slots, const struct qw_view &w, const int32_t *offsets, const int32_t *tiles, int E,
                     int64_t R, int N, int K) {
    if (fmt == QW_FP8)
        moeq_mma_launch<QW_FP8>(s, out, A, a_index, n_slots, w, offsets, tiles, E, R, N, K);
    else if (fmt == QW_INT4)
        moeq_mma_launch<QW_INT4>(s, out, A, a_index, n_slots, w, offsets, tiles, E, R, N, K);
    else
        moeq_mma_launch<QW_INT8>(s, out, A, a_index, n_slots, w, offsets, tiles, E, R, N, K);
}

// The prefill path (see above). Workspace: moe_workspace_bytes' layout as cuda_op_moe_experts reads
// it (ints: offsets | tiles | 2 spare (E + 1 each), sorted (R), pos (R), spare (R); then 256-byte
// aligned bf16 buffers xs (R, H), gu (R, 2I), act (R, I), y (R, H)); xs holds x's dequantized
// activation copy (n <= R rows). The down activation's quantized bytes and its bf16 copy live in
// the quantized-matmul scratch.
static void moeq_prefill(struct cuda_backend *cb, struct backend *b, __nv_bfloat16 *out, const struct tensor *x,
                         const struct weight *gate_up, const struct weight *down, const struct qw_view &gu,
                         const struct qw_view &dn, int fmt, const int32_t *ids, const float *tw, int n_slots, int64_t n,
                         int E, int64_t H, int64_t I, void *workspace) {
    cudaStream_t s = cb->stream;
    const int64_t R = n * n_slots;
    int32_t *offsets = (int32_t *)workspace, *tiles = offsets + (E + 1);
    int32_t *sorted = offsets + 4 * (E + 1), *pos = sorted + R;
    const size_t ints = (size_t)(4 * (E + 1) + 3 * R + 64) * sizeof(int32_t);
    char *base = (char *)workspace + moeq_align(ints);
#define MOEQ_ALIGN256(p) ((char *)(((uintptr_t)(p) + 255) & ~(uintptr_t)255))
    __nv_bfloat16 *xs = (__nv_bfloat16 *)base;
    char *gu_b = MOEQ_ALIGN256(base + (size_t)R * H * 2);
    char *act_b = MOEQ_ALIGN256(gu_b + (size_t)R * 2 * I * 2);
    char *y_b = MOEQ_ALIGN256(act_b + (size_t)R * I * 2);
#undef MOEQ_ALIGN256
    __nv_bfloat16 *gub = (__nv_bfloat16 *)gu_b, *act = (__nv_bfloat16 *)act_b, *y = (__nv_bfloat16 *)y_b;
    cuda_moe_sort_launch(s, ids, R, E, MOEQ_BM, offsets, tiles, sorted, pos);
    const __nv_bfloat16 *A = (const __nv_bfloat16 *)x->data;
    const bool qx = gate_up->act != WEIGHT_ACT_NONE, qa = down->act != WEIGHT_ACT_NONE;
    const int64_t ngH = gate_up->act == WEIGHT_ACT_FP8_GROUP ? (H + 127) / 128 : 1;
    const int64_t ngI = down->act == WEIGHT_ACT_FP8_GROUP ? (I + 127) / 128 : 1;
    const size_t off_xq = 0, off_xsc = off_xq + (qx ? moeq_align((size_t)(n * H)) : 0);
    const size_t off_aq = off_xsc + (qx ? moeq_align(sizeof(float) * (size_t)(n * ngH)) : 0);
    const size_t off_asc = off_aq + (qa ? moeq_align((size_t)(R * I)) : 0);
    const size_t off_ad = off_asc + (qa ? moeq_align(sizeof(float) * (size_t)(R * ngI)) : 0);
    const size_t need = off_ad + (qa ? moeq_align(sizeof(__nv_bfloat16) * (size_t)(R * I)) : 0);
    uint8_t *scr = need ? (uint8_t *)cuda_qmm_scratch(cb, need) : NULL;
    if (qx) { // W8A8: x's quantized bytes times their scales, as bf16
        cuda_act_quant(s, gate_up->act, gate_up->act_scale, scr + off_xq, (float *)(scr + off_xsc), xs, x->data, false,
                       n, n, H, gate_up->act == WEIGHT_ACT_FP8_GROUP ? n : 0);
        A = xs;
    }
    moeq_mma(s, fmt, gub, A, sorted, n_slots, gu, offsets, tiles, E, R, (int)(2 * I), (int)H);
    struct tensor gu_t = tensor_2d(gub, DTYPE_BF16, R, 2 * I), act_t = tensor_2d(act, DTYPE_BF16, R, I);
    cuda_op_silu_mul(b, &act_t, &gu_t);
    const __nv_bfloat16 *A2 = act;
    if (qa) {
        __nv_bfloat16 *ad = (__nv_bfloat16 *)(scr + off_ad);
        cuda_act_quant(s, down->act, down->act_scale, scr + off_aq, (float *)(scr + off_asc), ad, act, false, R, R, I,
                       down->act == WEIGHT_ACT_FP8_GROUP ? R : 0);
        A2 = ad;
    }
    moeq_mma(s, fmt, y, A2, (const int32_t *)NULL, 1, dn, offsets, tiles, E, R, (int)H, (int)I);
    cuda_moe_combine_launch(s, out, y, ids, tw, pos, n, n_slots, E, H);
}

void cuda_moe_experts_quant(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up,
                            const struct weight *down, const int32_t *topk_ids, const float *topk_w, int n_slots,
                            void *workspace) {
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
    if (MOEQ_MMA && R > MOEQ_MMA_MIN_ROWS && workspace && E <= CUDA_MOE_MAX_EXPERTS && moeq_mma_ok(gu) &&
        moeq_mma_ok(dn)) {
        moeq_prefill(cb, b, (__nv_bfloat16 *)out->data, x, gate_up, down, gu, dn, fmt, topk_ids, topk_w, n_slots, n, E,
                     H, I, workspace);
        return;
    }
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
