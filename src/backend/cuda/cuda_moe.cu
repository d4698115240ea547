// Fused mixture-of-experts on the GPU: moe_route and moe_experts of backend.h, with no host
// synchronisation and launch shapes that depend only on the number of tokens (decode batches
// stay graph-capturable).
//
// moe_route: one warp per token. Logits (act dtype or F32) -> fp32 softmax or sigmoid scores in
// shared memory -> selection keys (+ correction bias) -> grouped top-k: group scores (max or
// top-2 sum, a lane per group) and topk_group warp arg-max passes, the other groups' experts
// excluded -> top-k by k warp arg-max passes over the keys (larger first, ties to the lower id,
// as the CPU reference) -> weights from the uncorrected scores, renormalise / scale -> ids
// (int32) and weights (f32); benchmark-only round-robin routing and shared-expert slots as the
// contract says.
//
// moe_experts, per call (R = n_tokens * n_slots routed rows; workspace layout = CPU's):
//   1. moe_sort_kernel    (1 block)       counts per expert (shared atomics), offsets[e] and
//                                         tile_start[e] (block scans of counts and of
//                                         ceil(counts / BM)), sorted[p] = slot, pos[slot] = p:
//                                         expert e's rows are sorted positions
//                                         [offsets[e], offsets[e+1]), its row tiles the GEMM
//                                         tiles [tile_start[e], tile_start[e+1])
//   2. grouped GEMM       gate_up:  gu[p] = x[sorted[p] / n_slots] @ W_gu[e]^T   (x read through
//                                   the index: no gathered copy of x)
//   3. silu_mul over all R rows
//   4. grouped GEMM       down:     y[p] = act[p] @ W_down[e]^T
//   5. moe_combine_kernel out[t] = sum_j w[t, j] * y[pos[t * n_slots + j]] (fp32 sums, slot order)
// The grouped GEMM grid is (N / BN, min(R, ceil(R / BM) + E)): an upper bound on the number
// of row tiles over all experts (each expert adds at most one partial tile, and every tile
// holds a row), so the shape is fixed for a given R; a block looks its tile up in tile_start
// (binary search) and exits when it is past the last tile. Each (expert, column block) pair
// streams its weight slice once per row tile, so a decode batch (one tile per active expert,
// BM = 4) reads every active expert's weights once from HBM (further tiles of a busy expert
// re-read them mostly from L2). Inactive experts cost nothing.
//
// The smallest batches (R <= 32 routed rows, BF16) skip all of the above: a slot-major
// gate_up kernel (SiLU*mul in its epilogue) and a token-major down kernel that also does the
// combine (moe_slot_*: no sort, no combine launch; see there). Decode-sized batches (R <= 128,
// 4-row tiles) use a grouped GEMV (moe_gemv_kernel: a warp per four output columns streams
// their weight rows once with 16-byte loads); larger batches of BF16 use the mma.sync tensor-core
// kernel (moe_mma_kernel: 16-row tiles for batched decode, 64-row tiles for batch 512 and
// small prefills, 128-row tiles for prefill; cp.async multi-stage pipeline), other dtypes /
// unaligned shapes the CUDA-core tile kernel (moe_gemm_kernel). A Hopper wgmma/TMA pipeline
// is the next step for prefill-heavy loads.
#include "backend/cuda/cuda_common.cuh"

#include <cub/block/block_scan.cuh>
#include <type_traits>

#define MOE_ROUTE_WARPS 4
#define MOE_MAX_EXPERTS CUDA_MOE_MAX_EXPERTS
#define MOE_BN 64
#define MOE_BK 32
#define MOE_THREADS 256

// ---------------------------------------------------------------------------------------
// Routing

// Warp arg-max over the candidates that lane `lane` holds in (v, i): i == invalid marks "no
// candidate"; the larger value wins, then the lower index (the contract's total order).
__device__ __forceinline__ void route_warp_argmax(float &v, int &i, int invalid) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (oi != invalid && (i == invalid || ov > v || (ov == v && oi < i))) {
            v = ov;
            i = oi;
        }
    }
}

// One warp per token. Shared memory per warp: p (E) scores, q (E) selection keys (scores +
// correction bias; NaN marks an expert that can no longer be chosen: taken, or in a dropped
// group), gs (n_group) group scores (NaN marks a kept group).
template <typename T>
__global__ void moe_route_kernel(const T *logits, int64_t n, struct moe_route_args a, int32_t *ids_out, float *w_out) {
    pdl_begin();
    extern __shared__ float route_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t >= n) return;
    const int E = a.num_experts, k = a.top_k, slots = a.top_k + a.n_shared;
    const int ng = a.n_group > 1 ? a.n_group : 0;
    int32_t *ids = ids_out + t * slots;
    float *w = w_out + t * slots;
    if (a.force_uniform) {
        for (int j = lane; j < k; j += 32) {
            ids[j] = (int32_t)((t * k + j) % E);
            w[j] = 1.0f / (float)k;
        }
    } else {
        float *p = route_smem + (size_t)warp * (2 * E + ng), *q = p + E, *gs = q + E;
        const T *row = logits + t * E;
        if (a.scoring == MOE_SCORING_SIGMOID) {
            for (int e = lane; e < E; e += 32)
                p[e] = 1.0f / (1.0f + expf(-to_f32(row[e])));
        } else {
            float mx = -INFINITY;
            for (int e = lane; e < E; e += 32) {
                p[e] = to_f32(row[e]);
                mx = fmaxf(mx, p[e]);
            }
            mx = warp_max(mx);
            float sum = 0.f;
            for (int e = lane; e < E; e += 32) {
                p[e] = expf(p[e] - mx);
                sum += p[e];
            }
            sum = warp_sum(sum);
            float inv = 1.0f / sum;
            for (int e = lane; e < E; e += 32)
                p[e] *= inv;
        }
        for (int e = lane; e < E; e += 32)
            q[e] = a.correction_bias ? p[e] + a.correction_bias[e] : p[e];
        __syncwarp();
        if (ng) {
            const int G = E / ng;
            for (int g = lane; g < ng; g += 32) {
                float m1 = -INFINITY, m2 = -INFINITY;
                for (int e = g * G; e < (g + 1) * G; e++) {
                    float v = q[e];
                    if (v > m1) {
                        m2 = m1;
                        m1 = v;
                    } else if (v > m2) {
                        m2 = v;
                    }
                }
                gs[g] = a.group_score == MOE_GROUP_SCORE_TOP2_SUM ? m1 + m2 : m1;
            }
            __syncwarp();
            for (int j = 0; j < a.topk_group; j++) {
                float bv = -INFINITY;
                int bi = ng;
                for (int g = lane; g < ng; g += 32) {
                    float v = gs[g];
                    if (!isnan(v) && (bi == ng || v > bv)) {
                        bv = v;
                        bi = g;
                    }
                }
                route_warp_argmax(bv, bi, ng);
                if (lane == 0 && bi < ng) gs[bi] = NAN;
                __syncwarp();
            }
            for (int e = lane; e < E; e += 32)
                if (!isnan(gs[e / G])) q[e] = NAN;
            __syncwarp();
        }
        float picked_sum = 0.f;
        for (int j = 0; j < k; j++) {
            float bv = -INFINITY;
            int bi = E;
            for (int e = lane; e < E; e += 32) {
                float v = q[e];
                if (!isnan(v) && (bi == E || v > bv)) { // ascending ids: the first maximum is the lowest id
                    bv = v;
                    bi = e;
                }
            }
            route_warp_argmax(bv, bi, E);
            float pw = bi < E ? p[bi] : 0.f; // bi == E only for NaN logits (garbage in)
            picked_sum += pw;
            if (lane == 0) {
                ids[j] = bi < E ? bi : 0;
                w[j] = pw;
                if (bi < E) q[bi] = NAN;
            }
            __syncwarp();
        }
        float f = a.renormalize ? a.scale / (picked_sum + 1e-20f) : a.scale;
        __syncwarp();
        for (int j = lane; j < k; j += 32)
            w[j] *= f;
    }
    for (int j = lane; j < a.n_shared; j += 32) {
        ids[k + j] = E + j;
        w[k + j] = a.shared_weight;
    }
}

void cuda_op_moe_route(struct backend *b, const struct tensor *logits, const struct moe_route_args *a,
                       int32_t *topk_ids, float *topk_w) {
    CHECK(a->scoring == MOE_SCORING_SOFTMAX || a->scoring == MOE_SCORING_SIGMOID);
    CHECK(a->num_experts > 0 && a->num_experts <= MOE_MAX_EXPERTS && a->top_k >= 1 && a->top_k <= a->num_experts);
    CHECK(a->n_shared >= 0 && tensor_cols(logits) == a->num_experts);
    int ng = a->n_group > 1 ? a->n_group : 0;
    if (ng) {
        CHECK_MSG(a->num_experts % ng == 0 && a->topk_group >= 1 && a->topk_group <= ng,
                  "moe_route: n_group %d / topk_group %d over %d experts", ng, a->topk_group, a->num_experts);
        CHECK_MSG(a->topk_group * (a->num_experts / ng) >= a->top_k,
                  "moe_route: %d kept groups of %d experts hold fewer than top_k %d", a->topk_group,
                  a->num_experts / ng, a->top_k);
        CHECK(a->group_score == MOE_GROUP_SCORE_MAX ||
              (a->group_score == MOE_GROUP_SCORE_TOP2_SUM && a->num_experts / ng >= 2));
    }
    int64_t n = tensor_rows(logits);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    unsigned grid = cdiv(n, MOE_ROUTE_WARPS);
    // At most 4 warps x (2 x 1024 + 1024) floats = 48 KiB: the default dynamic limit.
    size_t smem = (size_t)MOE_ROUTE_WARPS * (2 * a->num_experts + ng) * sizeof(float);
    switch (logits->dtype) {
    case DTYPE_F32:
        pdl_launch(moe_route_kernel<float>, grid, 32 * MOE_ROUTE_WARPS, smem, s, (const float *)logits->data, n, *a,
                   topk_ids, topk_w);
        break;
    case DTYPE_BF16:
        pdl_launch(moe_route_kernel<__nv_bfloat16>, grid, 32 * MOE_ROUTE_WARPS, smem, s,
                   (const __nv_bfloat16 *)logits->data, n, *a, topk_ids, topk_w);
        break;
    case DTYPE_F16:
        pdl_launch(moe_route_kernel<__half>, grid, 32 * MOE_ROUTE_WARPS, smem, s, (const __half *)logits->data, n, *a,
                   topk_ids, topk_w);
        break;
    default:
        CHECK_MSG(0, "moe_route: logits dtype %s unsupported", dtype_name(logits->dtype));
    }
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Sorting rows by expert (counts / offsets / tiles on the device)

// One-block sort for every batch size (replaces count + scan + place: one launch instead of
// three, no serial scan): expert counts by shared-memory atomics, one BlockScan for offsets and
// one for tile starts, then each slot takes the next free position of its expert
// (atomicAdd on the shared cursor). Positions inside an expert's range are therefore not in
// slot order, which changes nothing: every GEMM/GEMV output row depends only on its own input
// row (the row's place in a tile does not change its summation order), and the combine sums a
// token's slots in slot order through pos. Slots with ids outside [0, E) are left out.
#define MOE_SORT_THREADS 1024
__global__ void __launch_bounds__(MOE_SORT_THREADS)
    moe_sort_kernel(const int32_t *ids, int64_t R, int E, int bm, int32_t *offsets, int32_t *tile_start,
                    int32_t *sorted, int32_t *pos) {
    pdl_begin();
    typedef cub::BlockScan<int, MOE_SORT_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage scan_tmp;
    __shared__ int cnt[MOE_MAX_EXPERTS], cur[MOE_MAX_EXPERTS];
    const int tid = threadIdx.x;
    for (int e = tid; e < E; e += MOE_SORT_THREADS)
        cnt[e] = 0;
    __syncthreads();
    for (int64_t s = tid; s < R; s += MOE_SORT_THREADS) {
        int e = ids[s];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    const int c = tid < E ? cnt[tid] : 0, tl = (c + bm - 1) / bm;
    int co, ctot, to, ttot;
    scan_t(scan_tmp).ExclusiveSum(c, co, ctot);
    __syncthreads();
    scan_t(scan_tmp).ExclusiveSum(tl, to, ttot);
    if (tid < E) {
        offsets[tid] = co;
        tile_start[tid] = to;
        cur[tid] = co;
    }
    if (tid == 0) {
        offsets[E] = ctot;
        tile_start[E] = ttot;
    }
    __syncthreads();
    for (int64_t s = tid; s < R; s += MOE_SORT_THREADS) {
        int e = ids[s];
        if (e < 0 || e >= E) continue;
        int p = atomicAdd(&cur[e], 1);
        sorted[p] = (int32_t)s;
        pos[s] = p;
    }
}

// (moe_tile_expert, the expert of a GEMM row tile, is in cuda_common.cuh: cuda_moe_quant.cu's
// grouped GEMM shares it.)

void cuda_moe_sort_launch(cudaStream_t s, const int32_t *ids, int64_t R, int E, int bm, int32_t *offsets,
                          int32_t *tile_start, int32_t *sorted, int32_t *pos) {
    pdl_launch(moe_sort_kernel, 1, MOE_SORT_THREADS, 0, s, ids, R, E, bm, offsets, tile_start, sorted, pos);
    CUDA_CHECK_LAUNCH();
}

// Grouped GEMM over experts: out[p, :] = A[row(p), :] @ W[e]^T for the sorted rows p of expert e.
// A row: a_index ? a_index[p] / n_slots (token of the slot) : p. W (E, N, K) stacked.
template <typename T, int BM>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_gemm_kernel(T *out, const T *A, const int32_t *a_index, int n_slots, const T *W, const int32_t *offsets,
                    const int32_t *tile_start, int E, int N, int K, bool vec) {
    pdl_begin();
    __shared__ float As[BM][MOE_BK + 1];
    __shared__ float Ws[MOE_BK][MOE_BN + 1];
    const int tile = blockIdx.y;
    if (tile >= tile_start[E]) return;
    const int e = moe_tile_expert(tile_start, E, tile);
    const int row0 = offsets[e] + (tile - tile_start[e]) * BM, row_end = offsets[e + 1];
    const int n0 = blockIdx.x * MOE_BN;
    const T *We = W + (size_t)e * N * K;
    // Thread layout: column c = tid % BN, rows r = (tid / BN) + i * (THREADS / BN).
    constexpr int RSTEP = MOE_THREADS / MOE_BN, RPT = BM / RSTEP > 0 ? BM / RSTEP : 1;
    const int c = threadIdx.x % MOE_BN, rr = threadIdx.x / MOE_BN;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++)
        acc[i] = 0.f;
    // vec: 16-byte loads (every row start of A and W is 16-byte aligned; checked by the launcher).
    constexpr int VEC = 16 / sizeof(T);
    for (int k0 = 0; k0 < K; k0 += MOE_BK) {
        if (vec) {
            for (int i = threadIdx.x; i < BM * (MOE_BK / VEC); i += MOE_THREADS) {
                int r = i / (MOE_BK / VEC), kv = (i % (MOE_BK / VEC)) * VEC, p = row0 + r;
                float f[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    f[j] = 0.f;
                if (p < row_end && k0 + kv < K) {
                    int64_t arow = a_index ? a_index[p] / n_slots : p;
                    vec_load<T, VEC>(A + arow * K + k0 + kv, f);
                }
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    As[r][kv + j] = f[j];
            }
            for (int i = threadIdx.x; i < MOE_BN * (MOE_BK / VEC); i += MOE_THREADS) {
                int n = i / (MOE_BK / VEC), kv = (i % (MOE_BK / VEC)) * VEC;
                float f[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    f[j] = 0.f;
                if (n0 + n < N && k0 + kv < K) vec_load<T, VEC>(We + (size_t)(n0 + n) * K + k0 + kv, f);
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    Ws[kv + j][n] = f[j];
            }
        } else {
            for (int i = threadIdx.x; i < BM * MOE_BK; i += MOE_THREADS) {
                int r = i / MOE_BK, kk = i % MOE_BK, p = row0 + r;
                float v = 0.f;
                if (p < row_end && k0 + kk < K) {
                    int64_t arow = a_index ? a_index[p] / n_slots : p;
                    v = to_f32(A[arow * K + k0 + kk]);
                }
                As[r][kk] = v;
            }
            for (int i = threadIdx.x; i < MOE_BN * MOE_BK; i += MOE_THREADS) {
                int n = i / MOE_BK, kk = i % MOE_BK;
                Ws[kk][n] = (n0 + n < N && k0 + kk < K) ? to_f32(We[(size_t)(n0 + n) * K + k0 + kk]) : 0.f;
            }
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < MOE_BK; kk++) {
            float wv = Ws[kk][c];
#pragma unroll
            for (int i = 0; i < RPT; i++)
                acc[i] += As[rr + i * RSTEP][kk] * wv;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int p = row0 + rr + i * RSTEP;
        if (rr + i * RSTEP < BM && p < row_end && n0 + c < N) out[(int64_t)p * N + n0 + c] = from_f32<T>(acc[i]);
    }
}

// Grouped tensor-core GEMM for batches past the GEMV range: out[p, n] = A[row(p)] . W[e][n] over
// BM-row tiles of one expert and BN columns; mma.sync m16n8k16 (bf16 in, f32 accumulate) from
// ldmatrix fragments, BK-wide slices of A and W streamed by cp.async through a STAGES-deep
// ring in shared memory (the slice for step kt + STAGES - 1 is issued before step
// kt computes), so each block keeps ~30 KB of weights in flight. BM = 16 (4 warps side by side,
// 16 x 16 each) when experts get a few rows each (batched decode: every active expert's weights
// stream once at full width, little MMA work wasted); BM = 64 (2 x 2 warps of 32 x 64) for
// prefill. Rows past the expert's range are zero-filled and not stored. Needs K % BK == 0,
// N even, 16-byte aligned A and W.
// Tile shapes. All take BK = 64 so that every weight row is read in whole 128-byte lines per
// stage (BK = 32 fetched 64-byte pieces of 128 rows at a time and reached ~58% of HBM bandwidth
// at batch 256 with 16-row tiles, 82% with BK = 64).
//   BM = 16: weight bound (batched decode): 4 warps side by side (16 x 16 each), BN = 64,
//            4 stages, 46 KB.
//   BM = 64: 2 x 2 warps of 32 x 64, BN = 128, 3 stages, 83 KB (batch 512: 398 us per layer
//            against 431 us with 32-row tiles and 610 us with 16-row ones, measured).
//   BM = 128: prefill (experts with >= 96 rows): 2 x 4 warps of 64 x 32, BN = 128, 3 stages,
//            111 KB: twice the MMA work per shared-memory byte of the 64-row tile.
// Dynamic shared memory, limits raised once by cuda_moe_init. Shared rows are padded by 8
// elements (144 bytes): conflict-free ldmatrix.
template <int BM> struct moe_mma_cfg {
    static constexpr int BN = BM == 16 ? 64 : 128, BK = 64, LD = BK + 8;
    static constexpr int WM = BM == 16 ? 1 : 2, WN = BM == 64 ? 2 : 4; // warp grid
    static constexpr int THREADS = 32 * WM * WN;
    static constexpr int TM = BM / WM, TN = BN / WN; // warp tile
    static constexpr int MT = TM / 16, NT = TN / 8;  // m16 / n8 tiles per warp
    static constexpr int STAGES = BM == 16 ? 4 : 3;
    static constexpr size_t SMEM = (size_t)STAGES * (BM + BN) * LD * sizeof(__nv_bfloat16); // 46 / 83 / 111 KB
    static constexpr int A_CH = BM * (BK / 8), A_PER = (A_CH + THREADS - 1) / THREADS;
    static constexpr int W_PER = BN * (BK / 8) / THREADS;
};

template <int BM>
__global__ void __launch_bounds__(moe_mma_cfg<BM>::THREADS)
    moe_mma_kernel(__nv_bfloat16 *out, const __nv_bfloat16 *A, const int32_t *a_index, int n_slots,
                   const __nv_bfloat16 *W, const int32_t *offsets, const int32_t *tile_start, int E, int N, int K) {
    pdl_begin();
    typedef moe_mma_cfg<BM> C;
    extern __shared__ __align__(128) unsigned char mma_smem[];
    typedef __nv_bfloat16 a_stage[BM * C::LD];
    typedef __nv_bfloat16 w_stage[C::BN * C::LD];
    a_stage *As = reinterpret_cast<a_stage *>(mma_smem);
    w_stage *Ws = reinterpret_cast<w_stage *>(mma_smem + (size_t)C::STAGES * sizeof(a_stage));
    const int tile = blockIdx.y;
    if (tile >= tile_start[E]) return;
    const int e = moe_tile_expert(tile_start, E, tile);
    const int row0 = offsets[e] + (tile - tile_start[e]) * BM, row_end = offsets[e + 1];
    const int n0 = blockIdx.x * C::BN;
    const __nv_bfloat16 *We = W + (size_t)e * N * K;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // This thread's 16-byte chunks of every A and W slice (fixed over k): source, destination.
    const __nv_bfloat16 *a_src[C::A_PER], *w_src[C::W_PER];
    int a_dst[C::A_PER], w_dst[C::W_PER];
    bool a_ok[C::A_PER], w_ok[C::W_PER];
#pragma unroll
    for (int i = 0; i < C::A_PER; i++) {
        int c = tid + i * C::THREADS, r = c / (C::BK / 8), kc = (c % (C::BK / 8)) * 8, p = row0 + r;
        a_ok[i] = c < C::A_CH && p < row_end;
        int64_t arow = a_ok[i] ? (a_index ? a_index[p] / n_slots : p) : 0;
        a_src[i] = A + arow * K + kc;
        a_dst[i] = r * C::LD + kc;
    }
#pragma unroll
    for (int i = 0; i < C::W_PER; i++) {
        int c = tid + i * C::THREADS, n = c / (C::BK / 8), kc = (c % (C::BK / 8)) * 8;
        w_ok[i] = n0 + n < N;
        w_src[i] = We + (size_t)(w_ok[i] ? n0 + n : 0) * K + kc;
        w_dst[i] = n * C::LD + kc;
    }
    auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * C::BK;
#pragma unroll
        for (int i = 0; i < C::A_PER; i++)
            if (tid + i * C::THREADS < C::A_CH) cp_async16(smem_addr(&As[stage][a_dst[i]]), a_src[i] + k0, a_ok[i]);
#pragma unroll
        for (int i = 0; i < C::W_PER; i++)
            cp_async16(smem_addr(&Ws[stage][w_dst[i]]), w_src[i] + k0, w_ok[i]);
    };
    const int KT = K / C::BK;
#pragma unroll
    for (int st = 0; st < C::STAGES - 1; st++) {
        if (st < KT) load_stage(st, st);
        cp_async_commit();
    }
    float acc[C::MT][C::NT][4];
#pragma unroll
    for (int i = 0; i < C::MT; i++)
#pragma unroll
        for (int j = 0; j < C::NT; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    const int wm = (warp / C::WN) * C::TM, wn = (warp % C::WN) * C::TN;
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<C::STAGES - 2>(); // slice kt has landed (this thread's part)
        __syncthreads();                // ... everyone's; and slice kt - 1's stage is free again
        const int nk = kt + C::STAGES - 1;
        if (nk < KT) load_stage(nk % C::STAGES, nk);
        cp_async_commit();
        const __nv_bfloat16 *as = As[kt % C::STAGES], *ws = Ws[kt % C::STAGES];
#pragma unroll
        for (int kk = 0; kk < C::BK; kk += 16) {
            uint32_t af[C::MT][4];
#pragma unroll
            for (int mt = 0; mt < C::MT; mt++)
                ldsm_x4(af[mt], smem_addr(as + (wm + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * C::LD + kk +
                                          (lane / 16) * 8));
#pragma unroll
            for (int j = 0; j < C::NT / 2; j++) {
                uint32_t bf[4];
                ldsm_x4(bf, smem_addr(ws + (wn + j * 16 + (lane % 8) + (lane / 16) * 8) * C::LD + kk +
                                      ((lane / 8) % 2) * 8));
#pragma unroll
                for (int mt = 0; mt < C::MT; mt++) {
                    mma_bf16(acc[mt][2 * j], af[mt], bf[0], bf[1]);
                    mma_bf16(acc[mt][2 * j + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    const int g = lane / 4, t4 = lane % 4;
#pragma unroll
    for (int mt = 0; mt < C::MT; mt++)
#pragma unroll
        for (int nt = 0; nt < C::NT; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int p = row0 + wm + mt * 16 + g + h * 8, n = n0 + wn + nt * 8 + 2 * t4;
                if (p < row_end && n < N)
                    *reinterpret_cast<uint32_t *>(out + (int64_t)p * N + n) =
                        pack_bf16(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
            }
}

// Decode-sized batches (4-row tiles: an expert with more rows gets more tiles, which re-read
// its weights mostly from L2; 16-row tiles needed 240 registers per thread, one block per SM,
// and ran at 13% of HBM bandwidth): a memory-bound grouped GEMV. Each warp owns one output
// column n of one expert's row tile and streams W[e][n, :] once with 16-byte loads (eight in
// flight per lane for K = 2048), multiplying it into every row of the tile (rows read through
// L1/L2; they are tiny next to the weights). Warp-sum at the end; no shared memory, no syncs.
#define MOE_GEMV_WARPS 8
#define MOE_GEMV_ROWS 4
#define MOE_GEMV_MAX_ROWS 128 // routed rows up to which the GEMV path runs (b16 x top-8); MMA tiles above

// Each warp computes MOE_GEMV_COLS adjacent output columns of its tile's rows: per 16-byte
// step it streams one vector of each column's weight row (MOE_GEMV_COLS loads in flight, eight
// steps unrolled) and reads each A row chunk once for all of them. One column per warp meant 16K warps of
// 1.5 KB each for the down projection: block scheduling, not HBM, set the pace.
#define MOE_GEMV_COLS 4
template <typename T>
__global__ void __launch_bounds__(32 * MOE_GEMV_WARPS)
    moe_gemv_kernel(T *out, const T *A, const int32_t *a_index, int n_slots, const T *W, const int32_t *offsets,
                    const int32_t *tile_start, int E, int N, int K, bool vec) {
    pdl_begin();
    const int tile = blockIdx.y;
    if (tile >= tile_start[E]) return;
    const int e = moe_tile_expert(tile_start, E, tile);
    const int row0 = offsets[e] + (tile - tile_start[e]) * MOE_GEMV_ROWS;
    const int nrows = min(MOE_GEMV_ROWS, offsets[e + 1] - row0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * MOE_GEMV_WARPS + warp) * MOE_GEMV_COLS;
    if (n0 >= N) return;
    const int ncols = min(MOE_GEMV_COLS, N - n0);
    const T *w[MOE_GEMV_COLS];
#pragma unroll
    for (int c = 0; c < MOE_GEMV_COLS; c++)
        w[c] = W + ((size_t)e * N + n0 + (c < ncols ? c : 0)) * K;
    const T *arow[MOE_GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; r++) {
        int p = row0 + (r < nrows ? r : 0);
        arow[r] = A + (int64_t)(a_index ? a_index[p] / n_slots : p) * K;
    }
    float acc[MOE_GEMV_ROWS][MOE_GEMV_COLS];
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; r++)
#pragma unroll
        for (int c = 0; c < MOE_GEMV_COLS; c++)
            acc[r][c] = 0.f;
    constexpr int VEC = 16 / sizeof(T);
    if (vec) {
#pragma unroll 2
        for (int k = lane * VEC; k < K; k += 32 * VEC) {
            float wv[MOE_GEMV_COLS][VEC];
#pragma unroll
            for (int c = 0; c < MOE_GEMV_COLS; c++)
                vec_load<T, VEC>(w[c] + k, wv[c]);
#pragma unroll
            for (int r = 0; r < MOE_GEMV_ROWS; r++) {
                if (r < nrows) {
                    float av[VEC];
                    vec_load<T, VEC>(arow[r] + k, av);
#pragma unroll
                    for (int c = 0; c < MOE_GEMV_COLS; c++)
#pragma unroll
                        for (int j = 0; j < VEC; j++)
                            acc[r][c] += wv[c][j] * av[j];
                }
            }
        }
    } else {
        for (int k = lane; k < K; k += 32) {
            float wv[MOE_GEMV_COLS];
#pragma unroll
            for (int c = 0; c < MOE_GEMV_COLS; c++)
                wv[c] = to_f32(w[c][k]);
#pragma unroll
            for (int r = 0; r < MOE_GEMV_ROWS; r++) {
                if (r < nrows) {
                    float av = to_f32(arow[r][k]);
#pragma unroll
                    for (int c = 0; c < MOE_GEMV_COLS; c++)
                        acc[r][c] += wv[c] * av;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_GEMV_ROWS; r++) {
        if (r < nrows) {
#pragma unroll
            for (int c = 0; c < MOE_GEMV_COLS; c++) {
                float v = warp_sum(acc[r][c]);
                if (lane == 0 && c < ncols) out[(int64_t)(row0 + r) * N + n0 + c] = from_f32<T>(v);
            }
        }
    }
}

// Launches the grouped GEMM for rows tiled by BM: the grouped GEMV for decode-sized tiles
// (BM = MOE_GEMV_ROWS), tensor cores for BF16 MMA tiles (K % 64 == 0, 16-byte aligned
// operands), the CUDA-core kernel otherwise. Grid rows:
// every tile holds at least one row, so there are at most min(R, ceil(R / BM) + E) of them -
// for a decode step of R = 8 routed rows, 8 rows of blocks instead of 129 (idle blocks cost
// launch slots even when they exit at once).
template <typename T, int BM>
static void moe_gemm(cudaStream_t s, T *out, const T *A, const int32_t *a_index, int n_slots, const T *W,
                     const int32_t *offsets, const int32_t *tiles, int E, int64_t R, int N, int K) {
    const int64_t max_tiles = R < cdiv(R, BM) + E ? R : cdiv(R, BM) + E;
    const bool aligned = ((uintptr_t)A % 16 == 0) && ((uintptr_t)W % 16 == 0);
    const bool vec = aligned && K % (16 / (int)sizeof(T)) == 0; // 16-byte loads in the CUDA-core kernels
    if constexpr (BM == MOE_GEMV_ROWS) {
        dim3 g(cdiv(N, MOE_GEMV_WARPS * MOE_GEMV_COLS), (unsigned)max_tiles);
        pdl_launch(moe_gemv_kernel<T>, g, 32 * MOE_GEMV_WARPS, 0, s, out, A, a_index, n_slots, W, offsets, tiles, E, N,
                   K, vec);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if constexpr (std::is_same<T, __nv_bfloat16>::value && BM != MOE_GEMV_ROWS) {
        if (K % moe_mma_cfg<BM>::BK == 0 && N % 2 == 0 && aligned) {
            dim3 gm(cdiv(N, moe_mma_cfg<BM>::BN), (unsigned)max_tiles);
            pdl_launch(moe_mma_kernel<BM>, gm, moe_mma_cfg<BM>::THREADS, moe_mma_cfg<BM>::SMEM, s, out, A, a_index,
                       n_slots, W, offsets, tiles, E, N, K);
            CUDA_CHECK_LAUNCH();
            return;
        }
    }
    const dim3 grid(cdiv(N, MOE_BN), (unsigned)max_tiles);
    pdl_launch(moe_gemm_kernel<T, BM>, grid, MOE_THREADS, 0, s, out, A, a_index, n_slots, W, offsets, tiles, E, N, K,
               vec);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Slot-major path for the smallest batches (R <= MOE_SLOT_MAX_ROWS, BF16): no sort, no gu
// buffer, no combine launch. At batch 1 every routed slot has its own expert anyway, so
// grouping rows by expert buys nothing and costs a launch; at R = 32 an expert shared by two
// tokens is streamed twice, the second time mostly from L2.
//   moe_slot_gate_up_kernel  grid (I / 8, R): a warp per (slot, column n) streams expert e's
//       gate row n and up row I + n (16-byte streaming loads, 8 in flight per lane), dots both with the slot's token
//       row x (staged once per block in shared memory) and writes act[slot, n] = silu(g) * u with g and u first rounded
//       to the activation dtype, exactly the gu -> silu_mul rounding of the grouped path.
//   moe_slot_down_kernel<S>  grid (H / 8, n): a warp per (token, column n) streams the down
//       rows n of all the token's experts (k outer, slots inner: 16-24 loads in flight per
//       lane), against the token's act rows in shared memory, keeps one
//       fp32 sum per slot, rounds each to the activation dtype and adds w * y in slot order:
//       the grouped path's y -> combine arithmetic, fused (out is written once, no y buffer).
// Slots with an id outside [0, E) contribute nothing, as in the grouped path.
#define MOE_SLOT_MAX_ROWS 32
#define MOE_SLOT_WARPS 8
#define MOE_SLOT_SMEM_MAX (96 * 1024)

// Both kernels issue their weight loads in explicit batches (every load of a batch lands in its
// own registers, out-of-range steps load a valid in-row address and are masked when consumed):
// a load under a branch that also consumes it is serialised by the compiler (the first
// version kept one or two loads in flight and ran the down projection at 33% of bandwidth).
// The first batch is issued before the block stages its activation rows in shared memory, so
// the staging round trip hides under the weight loads.
// gate_up: 4 k-steps per batch (8 loads in flight per lane) within the registers of 4 blocks per
// SM (64). Batch 1 of Qwen3-30B-A3B runs 768 blocks: 8 steps took 103 registers, 2 blocks per SM
// and three waves; 4 steps in 4 blocks per SM ran 1.6-2.2% faster end to end (docs/perf.md
// session 8; 2 steps at 6 blocks +0.8%, 4 steps at 6 blocks spilled and lost 8%).
#define MOE_SLOT_GU_STEPS 4
#define MOE_SLOT_GU_MINB 4

__global__ void __launch_bounds__(32 * MOE_SLOT_WARPS, MOE_SLOT_GU_MINB)
    moe_slot_gate_up_kernel(__nv_bfloat16 *act, const __nv_bfloat16 *x, const __nv_bfloat16 *wgu, const int32_t *ids,
                            int n_slots, int E, int I, int K) {
    pdl_begin();
    extern __shared__ __align__(16) unsigned char slot_smem[];
    __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(slot_smem);
    const int s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int e = ids[s];
    if (e < 0 || e >= E) return; // the whole block: the down kernel skips this slot
    const int n = blockIdx.x * MOE_SLOT_WARPS + warp;
    const __nv_bfloat16 *wg = wgu + ((size_t)e * 2 * I + (n < I ? n : 0)) * K, *wu = wg + (size_t)I * K;
    constexpr int U = MOE_SLOT_GU_STEPS;
    uint4 gv[U], uv[U];
    auto issue = [&](int k0) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int k = k0 + i * 256, kc = k < K ? k : 0;
            gv[i] = ld_stream16(wg + kc);
            uv[i] = ld_stream16(wu + kc);
        }
    };
    int k0 = lane * 8;
    if (k0 < K) issue(k0);
    const __nv_bfloat16 *xr = x + (int64_t)(s / n_slots) * K;
    for (int i = threadIdx.x * 8; i < K; i += 32 * MOE_SLOT_WARPS * 8)
        *reinterpret_cast<uint4 *>(xs + i) = __ldg(reinterpret_cast<const uint4 *>(xr + i));
    __syncthreads();
    if (n >= I) return;
    float ag = 0.f, au = 0.f;
    while (k0 < K) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int k = k0 + i * 256;
            if (k < K) {
                float g[8], u[8], xv[8];
                bf16x8_to_f32(gv[i], g);
                bf16x8_to_f32(uv[i], u);
                bf16x8_to_f32(*reinterpret_cast<const uint4 *>(xs + k), xv);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    ag = fmaf(g[j], xv[j], ag);
                    au = fmaf(u[j], xv[j], au);
                }
            }
        }
        k0 += U * 256;
        if (k0 < K) issue(k0);
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) {
        const float gr = __bfloat162float(__float2bfloat16(ag)), ur = __bfloat162float(__float2bfloat16(au));
        act[(int64_t)s * I + n] = __float2bfloat16(gr / (1.f + __expf(-gr)) * ur);
    }
}

// S slots (a power of two >= n_slots) x U k-steps per batch: 16 loads in flight per lane for
// 8 slots, within 128 registers so that two blocks fit per SM and a batch-1 grid (H / 8 = 256
// blocks for hidden 2048) runs in one wave (24 loads took 198 registers: one block per SM,
// two waves, and more waves still for 2-4 tokens).
template <int S>
__global__ void __launch_bounds__(32 * MOE_SLOT_WARPS, S >= 16 ? 1 : 2)
    moe_slot_down_kernel(__nv_bfloat16 *out, const __nv_bfloat16 *act, const __nv_bfloat16 *wd, const int32_t *ids,
                         const float *w, int n_slots, int E, int H, int K) {
    // The ids and the first weight batch are read before the PDL wait. The ids come from the
    // routing two kernels back: this grid starts only once every gate_up block has passed its own
    // wait, i.e. after the routing completed, so they are final (read through L2). Qwen3-30B-A3B
    // batch 1 331.8 -> 351.9 tok/s, batch 4 644 -> 668 (H200, docs/perf.md session 6).
    extern __shared__ __align__(16) unsigned char slot_smem[];
    __nv_bfloat16 *as = reinterpret_cast<__nv_bfloat16 *>(slot_smem);
    const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = blockIdx.x * MOE_SLOT_WARPS + warp, nc = n < H ? n : 0;
    const __nv_bfloat16 *wr[S];
    bool ok[S];
#pragma unroll
    for (int j = 0; j < S; j++) {
        const int e = j < n_slots ? __ldcg(ids + (int64_t)t * n_slots + j) : -1;
        ok[j] = e >= 0 && e < E;
        // An empty slot re-reads slot 0's row (an L2 hit) instead of streaming another row.
        wr[j] = ok[j] ? wd + ((size_t)e * H + nc) * K : j > 0 ? wr[0] : wd + (size_t)nc * K;
    }
    constexpr int U = S >= 8 ? 1 + 8 / S : 16 / S;
    uint4 wv[U][S];
    auto issue = [&](int k0) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int k = k0 + i * 256, kc = k < K ? k : 0;
#pragma unroll
            for (int j = 0; j < S; j++)
                wv[i][j] = ld_stream16(wr[j] + kc);
        }
    };
    int k0 = lane * 8;
    if (k0 < K) issue(k0);
    pdl_begin();
    const __nv_bfloat16 *ar = act + (int64_t)t * n_slots * K; // the token's n_slots act rows, contiguous
    for (int i = threadIdx.x * 8; i < n_slots * K; i += 32 * MOE_SLOT_WARPS * 8)
        *reinterpret_cast<uint4 *>(as + i) = __ldg(reinterpret_cast<const uint4 *>(ar + i));
    __syncthreads();
    if (n >= H) return;
    float acc[S];
#pragma unroll
    for (int j = 0; j < S; j++)
        acc[j] = 0.f;
    while (k0 < K) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int k = k0 + i * 256;
            if (k < K) {
#pragma unroll
                for (int j = 0; j < S; j++) {
                    if (ok[j]) {
                        float wf[8], af[8];
                        bf16x8_to_f32(wv[i][j], wf);
                        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(as + j * K + k), af);
#pragma unroll
                        for (int q = 0; q < 8; q++)
                            acc[j] = fmaf(wf[q], af[q], acc[j]);
                    }
                }
            }
        }
        k0 += U * 256;
        if (k0 < K) issue(k0);
    }
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < S; j++) {
        const float y = warp_sum(acc[j]);
        if (ok[j]) total += w[(int64_t)t * n_slots + j] * __bfloat162float(__float2bfloat16(y));
    }
    if (lane == 0) out[(int64_t)t * H + n] = __float2bfloat16(total);
}

// Whether the slot-major path takes this call: BF16, R <= MOE_SLOT_MAX_ROWS, 16-byte rows,
// at most 16 slots, and the token rows fit in shared memory. Every call that qualifies takes it:
// Qwen3-30B-A3B batch 1 253.3 tok/s on the grouped path, 293.2 on this one; one MoE layer at one
// token 41.5 -> 28.2 us (H200, docs/perf.md session 5). Other calls take the grouped path.
static bool moe_slot_path(enum dtype dt, int64_t R, int n_slots, int64_t H, int64_t I, const void *x, const void *wgu,
                          const void *wd) {
    const bool aligned = (uintptr_t)x % 16 == 0 && (uintptr_t)wgu % 16 == 0 && (uintptr_t)wd % 16 == 0;
    return dt == DTYPE_BF16 && R <= MOE_SLOT_MAX_ROWS && n_slots <= 16 && H % 8 == 0 && I % 8 == 0 && aligned &&
           H * 2 <= MOE_SLOT_SMEM_MAX && (int64_t)n_slots * I * 2 <= MOE_SLOT_SMEM_MAX;
}

static void moe_slot_launch(cudaStream_t s, __nv_bfloat16 *out, const __nv_bfloat16 *x, const __nv_bfloat16 *wgu,
                            const __nv_bfloat16 *wd, const int32_t *ids, const float *w, int n_slots, int64_t n, int E,
                            int64_t H, int64_t I, __nv_bfloat16 *act) {
    const int64_t R = n * n_slots;
    pdl_launch(moe_slot_gate_up_kernel, dim3(cdiv(I, MOE_SLOT_WARPS), (unsigned)R), 32 * MOE_SLOT_WARPS, (size_t)H * 2,
               s, act, x, wgu, ids, n_slots, E, (int)I, (int)H);
    CUDA_CHECK_LAUNCH();
    const dim3 g(cdiv(H, MOE_SLOT_WARPS), (unsigned)n);
    const size_t smem = (size_t)n_slots * I * 2;
#define MOE_SLOT_DOWN(S)                                                                                               \
    pdl_launch(moe_slot_down_kernel<S>, g, 32 * MOE_SLOT_WARPS, smem, s, out, act, wd, ids, w, n_slots, E, (int)H,     \
               (int)I)
    if (n_slots <= 2)
        MOE_SLOT_DOWN(2);
    else if (n_slots <= 4)
        MOE_SLOT_DOWN(4);
    else if (n_slots <= 8)
        MOE_SLOT_DOWN(8);
    else
        MOE_SLOT_DOWN(16);
#undef MOE_SLOT_DOWN
    CUDA_CHECK_LAUNCH();
}

// out[t, h..h+V) = sum_j w[t, j] * y[pos[t * slots + j], h..h+V) in fp32, slots in order;
// V = 16 bytes of T when H allows (the scalar version ran at ~30% of bandwidth on prefill
// batches: every element re-read its slot's id, weight and position).
template <typename T, int V>
__global__ void moe_combine_kernel(T *out, const T *y, const int32_t *ids, const float *w, const int32_t *pos,
                                   int64_t n, int slots, int E, int64_t H) {
    pdl_begin();
    const int64_t hv = H / V;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * hv; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / hv, h = (i % hv) * V;
        float acc[V];
#pragma unroll
        for (int q = 0; q < V; q++)
            acc[q] = 0.f;
        for (int j = 0; j < slots; j++) {
            const int64_t s = t * slots + j;
            const int e = ids[s];
            if (e < 0 || e >= E) continue;
            const float ws = w[s];
            float yv[V];
            vec_load<T, V>(y + (int64_t)pos[s] * H + h, yv);
#pragma unroll
            for (int q = 0; q < V; q++)
                acc[q] += ws * yv[q];
        }
        vec_store<T, V>(out + t * H + h, acc);
    }
}

void cuda_moe_combine_launch(cudaStream_t s, __nv_bfloat16 *out, const __nv_bfloat16 *y, const int32_t *ids,
                             const float *w, const int32_t *pos, int64_t n, int n_slots, int E, int64_t H) {
    constexpr int V = 8;
    const bool vec = H % V == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)y % 16 == 0;
    const int64_t total = vec ? n * H / V : n * H;
    const unsigned grid = (unsigned)(total / 256 + 1 < 65535 * 8 ? total / 256 + 1 : 65535 * 8);
    if (vec)
        pdl_launch(moe_combine_kernel<__nv_bfloat16, V>, grid, 256, 0, s, out, y, ids, w, pos, n, n_slots, E, H);
    else
        pdl_launch(moe_combine_kernel<__nv_bfloat16, 1>, grid, 256, 0, s, out, y, ids, w, pos, n, n_slots, E, H);
    CUDA_CHECK_LAUNCH();
}

template <typename T, int BM>
static void moe_experts_launch(cudaStream_t s, T *out, const T *x, const T *wgu, const T *wdown, const int32_t *ids,
                               const float *w, int n_slots, int64_t n, int E, int64_t H, int64_t I, int32_t *offsets,
                               int32_t *tiles, int32_t *sorted, int32_t *pos, T *gu, T *act, T *y, struct backend *b) {
    const int64_t R = n * n_slots;
    pdl_launch(moe_sort_kernel, 1, MOE_SORT_THREADS, 0, s, ids, R, E, BM, offsets, tiles, sorted, pos);
    CUDA_CHECK_LAUNCH();
    moe_gemm<T, BM>(s, gu, x, sorted, n_slots, wgu, offsets, tiles, E, R, (int)(2 * I), (int)H);
    // The act dtype of these buffers is T's (x's), not necessarily the backend's.
    const enum dtype dt = std::is_same<T, float>::value ? DTYPE_F32 : DTYPE_BF16;
    struct tensor gu_t = tensor_2d(gu, dt, R, 2 * I), act_t = tensor_2d(act, dt, R, I);
    cuda_op_silu_mul(b, &act_t, &gu_t);
    moe_gemm<T, BM>(s, y, act, (const int32_t *)NULL, 1, wdown, offsets, tiles, E, R, (int)H, (int)I);
    constexpr int V = 16 / sizeof(T);
    const bool vec = H % V == 0 && (uintptr_t)out % 16 == 0; // y rows are 256-byte aligned (workspace)
    const int64_t total = vec ? n * H / V : n * H;
    const unsigned grid = (unsigned)(total / 256 + 1 < 65535 * 8 ? total / 256 + 1 : 65535 * 8);
    if (vec)
        pdl_launch(moe_combine_kernel<T, V>, grid, 256, 0, s, out, y, ids, w, pos, n, n_slots, E, H);
    else
        pdl_launch(moe_combine_kernel<T, 1>, grid, 256, 0, s, out, y, ids, w, pos, n, n_slots, E, H);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// GPT-OSS experts (moe_experts with struct moe_experts_args, or MXFP4 weights): the grouped
// path above with three changes. MXFP4 weights (WEIGHT_SCHEME_MX: U8 bytes of two e2m1 values,
// the even column in the low nibble, and a U8 e8m0 exponent per 32 columns) go through
// moe_mx_gemm_kernel, the CUDA-core tile GEMM of moe_gemm_kernel whose weight tile is decoded
// from the packed bytes in registers on its way to shared memory (nothing is expanded in HBM:
// the kernel reads half a byte per weight plus a scale byte per 32). The gate_up bias and the
// activation (SiLU*mul or the clamped SwiGLU) are one pass over the R sorted rows
// (moe_bias_act_kernel), and the down bias is added to the sorted rows before the combine
// (moe_bias_rows_kernel). The expert of a sorted row is the last e with offsets[e] <= p.
// A tensor-core MXFP4 kernel (dequantizing fragments between ldmatrix and mma) is the next step
// for speed; this path is the correct one the model tests run.

// The e2m1 value of nibble v (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign).
__device__ __forceinline__ float mx_e2m1(unsigned v) {
    const unsigned m = v & 7u;
    const float mag = m < 4 ? 0.5f * (float)m : (float)(1u << ((m >> 1) - 1)) * ((m & 1u) ? 1.5f : 1.0f);
    return (v & 8u) ? -mag : mag;
}

// 2^(e - 127) exactly (e8m0; 0 is 2^-127, a subnormal; 255 is not a number in OCP MX, and
// transformers' ldexp makes it inf: so do we).
__device__ __forceinline__ float mx_e8m0(unsigned e) {
    if (e == 0) return __int_as_float(0x00400000);
    if (e == 255) return __int_as_float(0x7f800000);
    return __int_as_float((int)(e << 23));
}

// out[p, :] = A[row(p), :] @ W[e]^T with W in MXFP4 (Wq (E, N, K / 2), Ws (E, N, K / 32)); K % 32 == 0.
template <typename T, int BM>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_mx_gemm_kernel(T *out, const T *A, const int32_t *a_index, int n_slots, const uint8_t *Wq, const uint8_t *Ws,
                       const int32_t *offsets, const int32_t *tile_start, int E, int N, int K) {
    pdl_begin();
    __shared__ float As[BM][MOE_BK + 1];
    __shared__ float Wt[MOE_BK][MOE_BN + 1];
    const int tile = blockIdx.y;
    if (tile >= tile_start[E]) return;
    const int e = moe_tile_expert(tile_start, E, tile);
    const int row0 = offsets[e] + (tile - tile_start[e]) * BM, row_end = offsets[e + 1];
    const int n0 = blockIdx.x * MOE_BN;
    const uint8_t *Qe = Wq + (size_t)e * N * (K / 2), *Se = Ws + (size_t)e * N * (K / 32);
    constexpr int RSTEP = MOE_THREADS / MOE_BN, RPT = BM / RSTEP > 0 ? BM / RSTEP : 1;
    const int c = threadIdx.x % MOE_BN, rr = threadIdx.x / MOE_BN;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++)
        acc[i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += MOE_BK) { // MOE_BK == 32: one scale per weight row and step
        for (int i = threadIdx.x; i < BM * MOE_BK; i += MOE_THREADS) {
            int r = i / MOE_BK, kk = i % MOE_BK, p = row0 + r;
            float v = 0.f;
            if (p < row_end) {
                int64_t arow = a_index ? a_index[p] / n_slots : p;
                v = to_f32(A[arow * K + k0 + kk]);
            }
            As[r][kk] = v;
        }
        // Each thread decodes 4 bytes (8 values) of one weight row: 16 bytes per row and step.
        for (int i = threadIdx.x; i < MOE_BN * 4; i += MOE_THREADS) {
            const int n = i / 4, q = i % 4;
            float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (n0 + n < N) {
                const size_t row = (size_t)(n0 + n);
                const uint32_t bytes = *reinterpret_cast<const uint32_t *>(Qe + row * (K / 2) + k0 / 2 + q * 4);
                const float sc = mx_e8m0(Se[row * (K / 32) + k0 / 32]);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const unsigned byte = (bytes >> (8 * j)) & 0xffu;
                    f[2 * j] = mx_e2m1(byte & 15u) * sc;
                    f[2 * j + 1] = mx_e2m1(byte >> 4) * sc;
                }
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                Wt[q * 8 + j][n] = f[j];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < MOE_BK; kk++) {
            float wv = Wt[kk][c];
#pragma unroll
            for (int i = 0; i < RPT; i++)
                acc[i] += As[rr + i * RSTEP][kk] * wv;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int p = row0 + rr + i * RSTEP;
        if (rr + i * RSTEP < BM && p < row_end && n0 + c < N) out[(int64_t)p * N + n0 + c] = from_f32<T>(acc[i]);
    }
}

template <typename T, int BM>
static void moe_mx_gemm(cudaStream_t s, T *out, const T *A, const int32_t *a_index, int n_slots, const struct weight *w,
                        const int32_t *offsets, const int32_t *tiles, int E, int64_t R, int N, int K) {
    const int64_t max_tiles = R < cdiv(R, BM) + E ? R : cdiv(R, BM) + E;
    const dim3 grid(cdiv(N, MOE_BN), (unsigned)max_tiles);
    pdl_launch(moe_mx_gemm_kernel<T, BM>, grid, MOE_THREADS, 0, s, out, A, a_index, n_slots,
               (const uint8_t *)w->t.data, (const uint8_t *)w->scale.data, offsets, tiles, E, N, K);
    CUDA_CHECK_LAUNCH();
}

// A bias element as f32 (biases are weights: BF16 on this backend, F32 allowed).
__device__ __forceinline__ float moe_bias_at(const void *b, bool f32, int64_t i) {
    return f32 ? reinterpret_cast<const float *>(b)[i] : __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(b)[i]);
}

// ---------------------------------------------------------------------------------------
// MXFP4 slot path for the smallest batches (R <= MOE_SLOT_MAX_ROWS routed rows, GPT-OSS): the
// grouped path above re-reads each 64-column weight tile through a CUDA-core GEMM built for
// row tiles, which at batch 1 streamed the experts at 0.1-0.2 TB/s. Here, as in the BF16 slot
// path (moe_slot_*), a warp owns one output column of one slot and streams its packed row with
// 16-byte loads: one load is exactly one 32-column scale block (16 bytes of e2m1 pairs plus one
// e8m0 byte), so a chunk's dot is sum(lut[nibble] * x) times its scale, the nibbles decoded
// through a 16-entry table in shared memory (the 16 distinct addresses fall in distinct banks).
//   moe_mx_slot_gu_kernel    grid (ceil(I / 8), R): gate row n and up row I + n of expert ids[s]
//       against token s / n_slots (staged once per block as f32), each dot rounded to the act
//       dtype, plus the gate_up bias, then the activation: act[s, n]. The grouped path's
//       gu -> moe_bias_act_kernel rounding.
//   moe_mx_slot_down_kernel  grid (ceil(H / 8), n): a warp per (token t, column h) over the
//       token's slots: y = round(dot(act[s], down row h)), y = round(y + bias), out = sum of w * y
//       in slot order in f32, rounded once: moe_bias_rows_kernel + moe_combine_kernel's order.
// Slots with an id outside [0, E) contribute nothing. Loads are issued in batches of
// MOE_MX_SLOT_STEPS chunks per lane before any is consumed (see the BF16 slot kernels on why).
#define MOE_MX_SLOT_STEPS 4

__device__ __forceinline__ void moe_mx_lut_init(float *lut) {
    if (threadIdx.x < 16) lut[threadIdx.x] = mx_e2m1(threadIdx.x);
}

// sum over the 32 values of chunk q (16 bytes, low nibble = even column) times xs[0..32).
__device__ __forceinline__ float moe_mx_chunk_dot(uint4 q, const float *lut, const float *xs) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t byte = (w[i] >> (8 * j)) & 0xffu;
            acc = fmaf(lut[byte & 15u], xs[8 * i + 2 * j], acc);
            acc = fmaf(lut[byte >> 4], xs[8 * i + 2 * j + 1], acc);
        }
    return acc;
}

template <typename T>
__global__ void __launch_bounds__(32 * MOE_SLOT_WARPS)
    moe_mx_slot_gu_kernel(T *act, const T *x, const uint8_t *Wq, const uint8_t *Ws, const int32_t *ids, int n_slots,
                          int E, int I, int K, const void *bias, bool bias_f32, int clamp, float alpha, float limit) {
    pdl_begin();
    extern __shared__ __align__(16) float mx_slot_smem[];
    float *lut = mx_slot_smem, *xs = mx_slot_smem + 16;
    const int s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int e = ids[s];
    if (e < 0 || e >= E) return;
    const int n = blockIdx.x * MOE_SLOT_WARPS + warp, nc = n < I ? n : 0, chunks = K / 32;
    const uint8_t *qg = Wq + ((size_t)e * 2 * I + nc) * (K / 2), *qu = qg + (size_t)I * (K / 2);
    const uint8_t *sg = Ws + ((size_t)e * 2 * I + nc) * chunks, *su = sg + (size_t)I * chunks;
    constexpr int U = MOE_MX_SLOT_STEPS;
    uint4 gv[U], uv[U];
    auto issue = [&](int c0) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int c = c0 + i * 32, cc = c < chunks ? c : 0;
            gv[i] = ld_stream16(qg + (size_t)cc * 16);
            uv[i] = ld_stream16(qu + (size_t)cc * 16);
        }
    };
    int c0 = lane;
    if (c0 < chunks) issue(c0);
    moe_mx_lut_init(lut);
    const T *xr = x + (int64_t)(s / n_slots) * K;
    for (int i = threadIdx.x; i < K; i += blockDim.x)
        xs[i] = to_f32(xr[i]);
    __syncthreads();
    if (n >= I) return;
    float ag = 0.f, au = 0.f;
    while (c0 < chunks) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int c = c0 + i * 32;
            if (c < chunks) {
                ag = fmaf(mx_e8m0(sg[c]), moe_mx_chunk_dot(gv[i], lut, xs + c * 32), ag);
                au = fmaf(mx_e8m0(su[c]), moe_mx_chunk_dot(uv[i], lut, xs + c * 32), au);
            }
        }
        c0 += U * 32;
        if (c0 < chunks) issue(c0);
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) {
        float g = to_f32(from_f32<T>(ag)), u = to_f32(from_f32<T>(au));
        if (bias) {
            g += moe_bias_at(bias, bias_f32, (int64_t)e * 2 * I + n);
            u += moe_bias_at(bias, bias_f32, (int64_t)e * 2 * I + I + n);
        }
        float v;
        if (clamp) {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
            v = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
        } else {
            v = g / (1.0f + expf(-g)) * u;
        }
        act[(int64_t)s * I + n] = from_f32<T>(v);
    }
}

template <typename T>
__global__ void __launch_bounds__(32 * MOE_SLOT_WARPS)
    moe_mx_slot_down_kernel(T *out, const T *act, const uint8_t *Wq, const uint8_t *Ws, const int32_t *ids,
                            const float *w, int n_slots, int E, int H, int K, const void *bias, bool bias_f32) {
    pdl_begin();
    extern __shared__ __align__(16) float mx_slot_smem[];
    float *lut = mx_slot_smem, *as = mx_slot_smem + 16; // (n_slots, K) act rows of the token, f32
    const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.x * MOE_SLOT_WARPS + warp, hc = h < H ? h : 0, chunks = K / 32;
    moe_mx_lut_init(lut);
    for (int i = threadIdx.x; i < n_slots * K; i += blockDim.x) {
        const int j = i / K, e = ids[(int64_t)t * n_slots + j];
        as[i] = (e >= 0 && e < E) ? to_f32(act[((int64_t)t * n_slots + j) * K + i % K]) : 0.f;
    }
    __syncthreads();
    if (h >= H) return;
    float acc = 0.f;
    constexpr int U = MOE_MX_SLOT_STEPS;
    for (int j = 0; j < n_slots; j++) {
        const int64_t sl = (int64_t)t * n_slots + j;
        const int e = ids[sl];
        if (e < 0 || e >= E) continue;
        const uint8_t *q = Wq + ((size_t)e * H + hc) * (K / 2), *sc = Ws + ((size_t)e * H + hc) * chunks;
        const float *ar = as + (size_t)j * K;
        float d = 0.f;
        for (int c0 = lane; c0 < chunks; c0 += U * 32) {
            uint4 v[U];
#pragma unroll
            for (int i = 0; i < U; i++) {
                const int c = c0 + i * 32, cc = c < chunks ? c : 0;
                v[i] = ld_stream16(q + (size_t)cc * 16);
            }
#pragma unroll
            for (int i = 0; i < U; i++) {
                const int c = c0 + i * 32;
                if (c < chunks) d = fmaf(mx_e8m0(sc[c]), moe_mx_chunk_dot(v[i], lut, ar + c * 32), d);
            }
        }
        d = warp_sum(d);
        float y = to_f32(from_f32<T>(d));
        if (bias) y = to_f32(from_f32<T>(y + moe_bias_at(bias, bias_f32, (int64_t)e * H + h)));
        acc += w[sl] * y;
    }
    if (lane == 0) out[(int64_t)t * H + h] = from_f32<T>(acc);
}

// Whether the MXFP4 slot path takes this call: few routed rows, rows that fit shared memory,
// 16-byte aligned packed rows (K % 32 == 0 makes every row's stride a multiple of 16).
static bool moe_mx_slot_path(int64_t R, int n_slots, int64_t H, int64_t I, const void *gq, const void *dq) {
    const size_t smem_gu = (16 + (size_t)H) * sizeof(float), smem_dn = (16 + (size_t)n_slots * I) * sizeof(float);
    return R <= MOE_SLOT_MAX_ROWS && smem_gu <= MOE_SLOT_SMEM_MAX && smem_dn <= MOE_SLOT_SMEM_MAX &&
           (uintptr_t)gq % 16 == 0 && (uintptr_t)dq % 16 == 0;
}

template <typename T>
static void moe_mx_slot_launch(cudaStream_t s, T *out, const T *x, const struct weight *gu_w,
                               const struct weight *dn_w, const struct moe_experts_args *ea, const int32_t *ids,
                               const float *w, int n_slots, int64_t n, int E, int64_t H, int64_t I, T *act) {
    const struct tensor *bg = ea ? ea->gate_up_bias : NULL, *bd = ea ? ea->down_bias : NULL;
    const bool clamp = ea && ea->act == MOE_ACT_SWIGLU_CLAMP;
    // cuda_moe_init raised both kernels' dynamic shared memory limit to MOE_SLOT_SMEM_MAX.
    const size_t smem_gu = (16 + (size_t)H) * sizeof(float), smem_dn = (16 + (size_t)n_slots * I) * sizeof(float);
    pdl_launch(moe_mx_slot_gu_kernel<T>, dim3(cdiv(I, MOE_SLOT_WARPS), (unsigned)(n * n_slots)), 32 * MOE_SLOT_WARPS,
               smem_gu, s, act, x, (const uint8_t *)gu_w->t.data, (const uint8_t *)gu_w->scale.data, ids, n_slots, E,
               (int)I, (int)H, bg ? (const void *)bg->data : (const void *)NULL, bg && bg->dtype == DTYPE_F32,
               (int)clamp, ea ? ea->alpha : 0.f, ea ? ea->limit : 0.f);
    CUDA_CHECK_LAUNCH();
    pdl_launch(moe_mx_slot_down_kernel<T>, dim3(cdiv(H, MOE_SLOT_WARPS), (unsigned)n), 32 * MOE_SLOT_WARPS, smem_dn, s,
               out, (const T *)act, (const uint8_t *)dn_w->t.data, (const uint8_t *)dn_w->scale.data, ids, w, n_slots,
               E, (int)H, (int)I, bd ? (const void *)bd->data : (const void *)NULL, bd && bd->dtype == DTYPE_F32);
    CUDA_CHECK_LAUNCH();
}

// act[p, i] = f(gu[p, i] + bg[e, i], gu[p, I + i] + bg[e, I + i]) over the R sorted rows, e the
// expert of row p; f = SiLU*mul or the clamped SwiGLU (backend.h, MOE_ACT_SWIGLU_CLAMP).
template <typename T>
__global__ void moe_bias_act_kernel(T *act, const T *gu, const void *bias, bool bias_f32, const int32_t *offsets,
                                    int E, int64_t R, int64_t I, int clamp, float alpha, float limit) {
    pdl_begin();
    const int64_t rows = R > offsets[E] ? offsets[E] : R; // rows past the routed ones hold nothing
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * I; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t p = i / I, j = i % I;
        float g = to_f32(gu[p * 2 * I + j]), u = to_f32(gu[p * 2 * I + I + j]);
        if (bias) {
            const int e = moe_tile_expert(offsets, E, (int)p);
            g += moe_bias_at(bias, bias_f32, (int64_t)e * 2 * I + j);
            u += moe_bias_at(bias, bias_f32, (int64_t)e * 2 * I + I + j);
        }
        float v;
        if (clamp) {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
            v = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
        } else {
            v = g / (1.0f + expf(-g)) * u;
        }
        act[p * I + j] = from_f32<T>(v);
    }
}

// y[p, :] += bias[e, :] over the sorted rows (e the expert of row p).
template <typename T>
__global__ void moe_bias_rows_kernel(T *y, const void *bias, bool bias_f32, const int32_t *offsets, int E, int64_t R,
                                     int64_t H) {
    pdl_begin();
    const int64_t rows = R > offsets[E] ? offsets[E] : R;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * H; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t p = i / H, h = i % H;
        const int e = moe_tile_expert(offsets, E, (int)p);
        y[i] = from_f32<T>(to_f32(y[i]) + moe_bias_at(bias, bias_f32, (int64_t)e * H + h));
    }
}

static unsigned moe_elementwise_grid(int64_t total) {
    return (unsigned)(total / 256 + 1 < 65535 * 8 ? total / 256 + 1 : 65535 * 8);
}

// The GPT-OSS path of moe_experts (see above): sort, gate_up (MX or plain), bias + activation,
// down (MX or plain), down bias, combine.
template <typename T, int BM>
static void moe_experts_args_launch(cudaStream_t s, T *out, const T *x, const struct weight *gu_w,
                                    const struct weight *dn_w, const struct moe_experts_args *ea, const int32_t *ids,
                                    const float *w, int n_slots, int64_t n, int E, int64_t H, int64_t I,
                                    int32_t *offsets, int32_t *tiles, int32_t *sorted, int32_t *pos, T *gu, T *act,
                                    T *y) {
    const int64_t R = n * n_slots;
    pdl_launch(moe_sort_kernel, 1, MOE_SORT_THREADS, 0, s, ids, R, E, BM, offsets, tiles, sorted, pos);
    CUDA_CHECK_LAUNCH();
    if (gu_w->scheme == WEIGHT_SCHEME_MX)
        moe_mx_gemm<T, BM>(s, gu, x, sorted, n_slots, gu_w, offsets, tiles, E, R, (int)(2 * I), (int)H);
    else
        moe_gemm<T, BM>(s, gu, x, sorted, n_slots, (const T *)gu_w->t.data, offsets, tiles, E, R, (int)(2 * I), (int)H);
    const struct tensor *bg = ea ? ea->gate_up_bias : NULL, *bd = ea ? ea->down_bias : NULL;
    const bool clamp = ea && ea->act == MOE_ACT_SWIGLU_CLAMP;
    pdl_launch(moe_bias_act_kernel<T>, moe_elementwise_grid(R * I), 256, 0, s, act, (const T *)gu,
               bg ? (const void *)bg->data : (const void *)NULL, bg && bg->dtype == DTYPE_F32, (const int32_t *)offsets,
               E, R, I, (int)clamp, ea ? ea->alpha : 0.f, ea ? ea->limit : 0.f);
    CUDA_CHECK_LAUNCH();
    if (dn_w->scheme == WEIGHT_SCHEME_MX)
        moe_mx_gemm<T, BM>(s, y, act, (const int32_t *)NULL, 1, dn_w, offsets, tiles, E, R, (int)H, (int)I);
    else
        moe_gemm<T, BM>(s, y, act, (const int32_t *)NULL, 1, (const T *)dn_w->t.data, offsets, tiles, E, R, (int)H,
                        (int)I);
    if (bd) {
        pdl_launch(moe_bias_rows_kernel<T>, moe_elementwise_grid(R * H), 256, 0, s, y, (const void *)bd->data,
                   bd->dtype == DTYPE_F32, (const int32_t *)offsets, E, R, H);
        CUDA_CHECK_LAUNCH();
    }
    constexpr int V = 16 / sizeof(T);
    const bool vec = H % V == 0 && (uintptr_t)out % 16 == 0;
    const int64_t total = vec ? n * H / V : n * H;
    if (vec)
        pdl_launch(moe_combine_kernel<T, V>, moe_elementwise_grid(total), 256, 0, s, out, (const T *)y, ids, w,
                   (const int32_t *)pos, n, n_slots, E, H);
    else
        pdl_launch(moe_combine_kernel<T, 1>, moe_elementwise_grid(total), 256, 0, s, out, (const T *)y, ids, w,
                   (const int32_t *)pos, n, n_slots, E, H);
    CUDA_CHECK_LAUNCH();
}

void cuda_moe_init(struct cuda_backend *cb) {
    (void)cb;
    CUDA_CHECK(cudaFuncSetAttribute(moe_mma_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)moe_mma_cfg<16>::SMEM));
    CUDA_CHECK(cudaFuncSetAttribute(moe_mma_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)moe_mma_cfg<128>::SMEM));
    CUDA_CHECK(cudaFuncSetAttribute(moe_mma_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)moe_mma_cfg<64>::SMEM));
    CUDA_CHECK(
        cudaFuncSetAttribute(moe_slot_gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, MOE_SLOT_SMEM_MAX));
#define MOE_MX_SLOT_ATTR(K)                                                                                            \
    CUDA_CHECK(cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, MOE_SLOT_SMEM_MAX));
    MOE_MX_SLOT_ATTR(moe_mx_slot_gu_kernel<__nv_bfloat16>)
    MOE_MX_SLOT_ATTR(moe_mx_slot_gu_kernel<float>)
    MOE_MX_SLOT_ATTR(moe_mx_slot_down_kernel<__nv_bfloat16>)
    MOE_MX_SLOT_ATTR(moe_mx_slot_down_kernel<float>)
#undef MOE_MX_SLOT_ATTR
#define MOE_SLOT_ATTR(S)                                                                                               \
    CUDA_CHECK(cudaFuncSetAttribute(moe_slot_down_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize,              \
                                    MOE_SLOT_SMEM_MAX));
    MOE_SLOT_ATTR(2)
    MOE_SLOT_ATTR(4)
    MOE_SLOT_ATTR(8)
    MOE_SLOT_ATTR(16)
#undef MOE_SLOT_ATTR
    cuda_moe_quant_init(cb);
}

void cuda_op_moe_experts(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up_w,
                         const struct weight *down_w, const int32_t *topk_ids, const float *topk_w, int n_slots,
                         const struct moe_experts_args *ea, void *workspace) {
    const bool mx = gate_up_w->scheme == WEIGHT_SCHEME_MX;
    if (!mx && (gate_up_w->scheme != WEIGHT_SCHEME_NONE || down_w->scheme != WEIGHT_SCHEME_NONE)) { // cuda_moe_quant.cu
        CHECK_MSG(!ea || (ea->act == MOE_ACT_SILU && !ea->gate_up_bias && !ea->down_bias),
                  "CUDA moe_experts: quantized (%s) experts take SiLU without biases only",
                  weight_scheme_name(gate_up_w->scheme));
        cuda_moe_experts_quant(b, out, x, gate_up_w, down_w, topk_ids, topk_w, n_slots, workspace);
        return;
    }
    // The GPT-OSS path: a non-SiLU activation, expert biases or MXFP4 weights (both matrices MX,
    // or both plain in the act dtype).
    const bool args_path = mx || (ea && (ea->act != MOE_ACT_SILU || ea->gate_up_bias || ea->down_bias));
    CHECK_MSG(!ea || ea->act == MOE_ACT_SILU || ea->act == MOE_ACT_SWIGLU_CLAMP, "moe_experts: activation %d",
              (int)ea->act);
    CHECK_MSG((gate_up_w->scheme == WEIGHT_SCHEME_NONE || mx) && down_w->scheme == gate_up_w->scheme,
              "CUDA moe_experts: weight schemes %s / %s not implemented (none or mx, the same for both)",
              weight_scheme_name(gate_up_w->scheme), weight_scheme_name(down_w->scheme));
    const struct tensor *gate_up = &gate_up_w->t, *down = &down_w->t;
    CHECK(gate_up->ndim == 3 && down->ndim == 3 && x->dtype == out->dtype);
    if (mx)
        CHECK_MSG(gate_up->dtype == DTYPE_U8 && down->dtype == DTYPE_U8 && gate_up_w->scale.dtype == DTYPE_U8 &&
                      down_w->scale.dtype == DTYPE_U8 && gate_up_w->block_cols == 32 && down_w->block_cols == 32,
                  "CUDA moe_experts: MX weights must be U8 values with U8 e8m0 scales per 32");
    else
        CHECK(gate_up->dtype == x->dtype && down->dtype == x->dtype);
    const int64_t n = tensor_rows(x), H = tensor_cols(x), I = weight_cols(down_w);
    const int E = (int)gate_up->ne[0];
    CHECK_MSG(E >= 1 && E <= MOE_MAX_EXPERTS, "moe_experts: %d experts (at most %d)", E, MOE_MAX_EXPERTS);
    CHECK_MSG(gate_up->ne[1] == 2 * I && weight_cols(gate_up_w) == H && down->ne[0] == E && down->ne[1] == H,
              "moe_experts: stacked weight shapes do not match H %lld", (long long)H);
    CHECK_MSG(!mx || (H % 32 == 0 && I % 32 == 0), "CUDA moe_experts: MX weights need H, I multiples of 32");
    if (ea && ea->gate_up_bias)
        CHECK(tensor_rows(ea->gate_up_bias) == E && tensor_cols(ea->gate_up_bias) == 2 * I &&
              (ea->gate_up_bias->dtype == DTYPE_BF16 || ea->gate_up_bias->dtype == DTYPE_F32));
    if (ea && ea->down_bias)
        CHECK(tensor_rows(ea->down_bias) == E && tensor_cols(ea->down_bias) == H &&
              (ea->down_bias->dtype == DTYPE_BF16 || ea->down_bias->dtype == DTYPE_F32));
    CHECK(tensor_rows(out) == n && tensor_cols(out) == H && out->data != x->data && n_slots >= 1);
    if (n == 0) return;
    const int64_t R = n * n_slots;
    cudaStream_t s = cuda_impl(b)->stream;
    // Workspace layout (moe_workspace_bytes): ints [offsets | tiles | spare | spare] (E + 1 each),
    // sorted (R), pos (R), spare (R); then, 256-byte aligned, xs (unused here), gu, act, y.
    int32_t *offsets = (int32_t *)workspace, *tiles = offsets + (E + 1);
    int32_t *sorted = offsets + 4 * (E + 1), *pos = sorted + R;
    size_t ints = (size_t)(4 * (E + 1) + 3 * R + 64) * sizeof(int32_t);
    char *acts = (char *)workspace + ((ints + 255) & ~(size_t)255);
    size_t es = dtype_row_bytes(x->dtype, 1);
    // Each buffer starts 256-byte aligned (moe_workspace_bytes leaves room), so the GEMMs' 16-byte
    // loads see aligned rows whatever R, H and I are.
#define MOE_ALIGN256(p) ((char *)(((uintptr_t)(p) + 255) & ~(uintptr_t)255))
    char *gu = MOE_ALIGN256(acts + (size_t)R * H * es);
    char *act = MOE_ALIGN256(gu + (size_t)R * 2 * I * es);
    char *y = MOE_ALIGN256(act + (size_t)R * I * es);
#undef MOE_ALIGN256
    if (!args_path && moe_slot_path(x->dtype, R, n_slots, H, I, x->data, gate_up->data, down->data)) {
        moe_slot_launch(s, (__nv_bfloat16 *)out->data, (const __nv_bfloat16 *)x->data,
                        (const __nv_bfloat16 *)gate_up->data, (const __nv_bfloat16 *)down->data, topk_ids, topk_w,
                        n_slots, n, E, H, I, (__nv_bfloat16 *)act);
        return;
    }
    if (mx && moe_mx_slot_path(R, n_slots, H, I, gate_up->data, down->data)) {
        if (x->dtype == DTYPE_BF16)
            moe_mx_slot_launch(s, (__nv_bfloat16 *)out->data, (const __nv_bfloat16 *)x->data, gate_up_w, down_w, ea,
                               topk_ids, topk_w, n_slots, n, E, H, I, (__nv_bfloat16 *)act);
        else
            moe_mx_slot_launch(s, (float *)out->data, (const float *)x->data, gate_up_w, down_w, ea, topk_ids, topk_w,
                               n_slots, n, E, H, I, (float *)act);
        return;
    }
    const bool small = R <= MOE_GEMV_MAX_ROWS; // decode-sized batches: GEMV tiles of MOE_GEMV_ROWS rows
    // Tile rows: GEMV tiles for decode-sized batches; then MMA tiles of 16 rows while experts
    // average at most 16 rows (batched decode up to 256 at top-8 of 128), 64 rows below 96
    // (batch 512, small prefills), 128 rows beyond (prefill). One MoE layer of Qwen3-30B-A3B's
    // shape (docs/perf.md session 5): 512 tokens 16-row tiles 610 us, 32-row 431, 64-row 396;
    // 4096 tokens 64-row 1,591 us, 128-row 1,314.
    const int64_t per_expert = R / E;
    const int bm = small ? MOE_GEMV_ROWS : per_expert <= 16 ? 16 : per_expert < 96 ? 64 : 128;
#define MOE_LAUNCH(T, BMV)                                                                                             \
    do {                                                                                                               \
        if (args_path)                                                                                                 \
            moe_experts_args_launch<T, BMV>(s, (T *)out->data, (const T *)x->data, gate_up_w, down_w, ea, topk_ids,    \
                                            topk_w, n_slots, n, E, H, I, offsets, tiles, sorted, pos, (T *)gu,         \
                                            (T *)act, (T *)y);                                                         \
        else                                                                                                           \
            moe_experts_launch<T, BMV>(s, (T *)out->data, (const T *)x->data, (const T *)gate_up->data,                \
                                       (const T *)down->data, topk_ids, topk_w, n_slots, n, E, H, I, offsets, tiles,   \
                                       sorted, pos, (T *)gu, (T *)act, (T *)y, b);                                     \
    } while (0)
#define MOE_LAUNCH_BM(T)                                                                                               \
    do {                                                                                                               \
        if (bm == MOE_GEMV_ROWS)                                                                                       \
            MOE_LAUNCH(T, MOE_GEMV_ROWS);                                                                              \
        else if (bm == 16)                                                                                             \
            MOE_LAUNCH(T, 16);                                                                                         \
        else if (bm == 64)                                                                                             \
            MOE_LAUNCH(T, 64);                                                                                         \
        else                                                                                                           \
            MOE_LAUNCH(T, 128);                                                                                        \
    } while (0)
    switch (x->dtype) {
    case DTYPE_BF16:
        MOE_LAUNCH_BM(__nv_bfloat16);
        break;
    case DTYPE_F32:
        MOE_LAUNCH_BM(float);
        break;
    default:
        CHECK_MSG(0, "moe_experts: dtype %s unsupported", dtype_name(x->dtype));
    }
#undef MOE_LAUNCH_BM
#undef MOE_LAUNCH
}
