// Fused mixture-of-experts on the GPU: moe_route and moe_experts of backend.h, with no host
// synchronisation and launch shapes that depend only on the number of tokens (decode batches
// stay graph-capturable).
//
// moe_route: one warp per token. Logits (act dtype) -> fp32 softmax in shared memory -> top-k
// by k warp arg-max passes (larger probability first, ties to the lower expert id, as the CPU
// reference) -> renormalise / scale -> ids (int32) and weights (f32); benchmark-only round-robin
// routing and shared-expert slots as the contract says.
//
// moe_experts, per call (R = n_tokens * n_slots routed rows; workspace layout = CPU's):
//   1. moe_count_kernel   (grid E_total)  counts[e] = slots routed to e (block-wide ballots)
//   2. moe_scan_kernel    (1 block)       offsets[e] (prefix sums) and tile_start[e] (prefix sums
//                                         of ceil(counts / BM)): expert e's rows are sorted
//                                         positions [offsets[e], offsets[e+1]) and its row tiles
//                                         the GEMM tiles [tile_start[e], tile_start[e+1])
//   3. moe_place_kernel   (grid E_total)  sorted[p] = slot, pos[slot] = p, stable in slot order
//   4. moe_gemm_kernel    gate_up:  gu[p] = x[sorted[p] / n_slots] @ W_gu[e]^T   (x read through
//                                   the index: no gathered copy of x)
//   5. silu_mul over all R rows (cuda_op_silu_mul)
//   6. moe_gemm_kernel    down:     y[p] = act[p] @ W_down[e]^T
//   7. moe_combine_kernel out[t] = sum_j w[t, j] * y[pos[t * n_slots + j]] (fp32 sums, slot order)
// The grouped GEMM grid is (N / BN, ceil(R / BM) + E_total): an upper bound on the number of
// row tiles over all experts (each expert adds at most one partial tile), so the shape is
// fixed for a given R; a block looks its tile up in tile_start (binary search) and exits when
// it is past the last tile. Each (expert, column block) pair streams its weight slice once
// per row tile, so a decode batch (one tile per active expert, BM = 16) reads every active
// expert's weights exactly once: the memory-bound grouped GEMV. Inactive experts cost nothing.
//
// This first version computes the GEMMs with fp32 FMAs on CUDA cores from shared-memory
// tiles (no tensor cores): right for decode, which is bound by weight bandwidth; prefill of
// large batches is compute-bound and wants a tensor-core (wgmma) grouped GEMM next.
#include "backend/cuda/cuda_common.cuh"

#define MOE_ROUTE_WARPS 4
#define MOE_MAX_EXPERTS 1024
#define MOE_BN 64
#define MOE_BK 32
#define MOE_THREADS 256

// ---------------------------------------------------------------------------------------
// Routing

template <typename T>
__global__ void moe_route_kernel(const T *logits, int64_t n, struct moe_route_args a, int32_t *ids_out,
                                 float *w_out) {
    extern __shared__ float route_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t >= n) return;
    const int E = a.num_experts, k = a.top_k, slots = a.top_k + a.n_shared;
    int32_t *ids = ids_out + t * slots;
    float *w = w_out + t * slots;
    if (a.force_uniform) {
        for (int j = lane; j < k; j += 32) {
            ids[j] = (int32_t)((t * k + j) % E);
            w[j] = 1.0f / (float)k;
        }
    } else {
        float *p = route_smem + (size_t)warp * E;
        const T *row = logits + t * E;
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
        for (int e = lane; e < E; e += 32) p[e] *= inv;
        __syncwarp();
        float picked_sum = 0.f;
        for (int j = 0; j < k; j++) {
            float bv = -1.0f;
            int bi = E;
            for (int e = lane; e < E; e += 32)
                if (p[e] > bv) { // lanes scan ascending ids: the first maximum is the lowest id
                    bv = p[e];
                    bi = e;
                }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
            picked_sum += bv;
            if (lane == 0) {
                ids[j] = bi;
                w[j] = bv;
                p[bi] = -2.0f; // probabilities are >= 0: taken experts never win again
            }
            __syncwarp();
        }
        float f = a.renormalize ? a.scale / picked_sum : a.scale;
        __syncwarp();
        for (int j = lane; j < k; j += 32) w[j] *= f;
    }
    for (int j = lane; j < a.n_shared; j += 32) {
        ids[k + j] = E + j;
        w[k + j] = a.shared_weight;
    }
}

void cuda_op_moe_route(struct backend *b, const struct tensor *logits, const struct moe_route_args *a,
                                  int32_t *topk_ids, float *topk_w) {
    CHECK_MSG(a->scoring == MOE_SCORING_SOFTMAX, "moe_route: only softmax scoring is implemented");
    CHECK_MSG(a->n_group <= 1, "moe_route: grouped top-k is not implemented yet");
    CHECK(a->num_experts > 0 && a->num_experts <= MOE_MAX_EXPERTS && a->top_k >= 1 && a->top_k <= a->num_experts);
    CHECK(tensor_cols(logits) == a->num_experts);
    int64_t n = tensor_rows(logits);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    unsigned grid = cdiv(n, MOE_ROUTE_WARPS);
    size_t smem = (size_t)MOE_ROUTE_WARPS * a->num_experts * sizeof(float);
    switch (logits->dtype) {
    case DTYPE_F32:
        moe_route_kernel<float><<<grid, 32 * MOE_ROUTE_WARPS, smem, s>>>((const float *)logits->data, n, *a, topk_ids,
                                                                         topk_w);
        break;
    case DTYPE_BF16:
        moe_route_kernel<__nv_bfloat16><<<grid, 32 * MOE_ROUTE_WARPS, smem, s>>>(
            (const __nv_bfloat16 *)logits->data, n, *a, topk_ids, topk_w);
        break;
    case DTYPE_F16:
        moe_route_kernel<__half><<<grid, 32 * MOE_ROUTE_WARPS, smem, s>>>((const __half *)logits->data, n, *a,
                                                                          topk_ids, topk_w);
        break;
    default: CHECK_MSG(0, "moe_route: logits dtype %s unsupported", dtype_name(logits->dtype));
    }
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Sorting rows by expert (counts / offsets / tiles on the device)

// Block-wide exclusive scan of one flag per thread (blockDim.x == MOE_THREADS); returns the
// thread's rank among flagged threads and writes the block total to *total.
__device__ __forceinline__ int block_rank(bool flag, int *warp_tot, int *total) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned m = __ballot_sync(0xffffffffu, flag);
    int r = __popc(m & ((1u << lane) - 1u));
    if (lane == 0) warp_tot[warp] = __popc(m);
    __syncthreads();
    int before = 0, all = 0;
    for (int i = 0; i < MOE_THREADS / 32; i++) {
        if (i < warp) before += warp_tot[i];
        all += warp_tot[i];
    }
    __syncthreads();
    *total = all;
    return before + r;
}

__global__ void moe_count_kernel(const int32_t *ids, int64_t R, int32_t *counts) {
    __shared__ int warp_tot[MOE_THREADS / 32];
    const int e = blockIdx.x;
    int c = 0;
    for (int64_t s0 = 0; s0 < R; s0 += MOE_THREADS) {
        int64_t s = s0 + threadIdx.x;
        int tot;
        block_rank(s < R && ids[s] == e, warp_tot, &tot);
        c += tot;
    }
    if (threadIdx.x == 0) counts[e] = c;
}

__global__ void moe_scan_kernel(const int32_t *counts, int E, int bm, int32_t *offsets, int32_t *tile_start) {
    if (threadIdx.x != 0) return;
    int32_t o = 0, t = 0;
    for (int e = 0; e < E; e++) {
        offsets[e] = o;
        tile_start[e] = t;
        o += counts[e];
        t += (counts[e] + bm - 1) / bm;
    }
    offsets[E] = o;
    tile_start[E] = t;
}

__global__ void moe_place_kernel(const int32_t *ids, int64_t R, const int32_t *offsets, int32_t *sorted,
                                 int32_t *pos) {
    __shared__ int warp_tot[MOE_THREADS / 32];
    const int e = blockIdx.x;
    int base = offsets[e];
    for (int64_t s0 = 0; s0 < R; s0 += MOE_THREADS) {
        int64_t s = s0 + threadIdx.x;
        bool mine = s < R && ids[s] == e;
        int tot;
        int r = block_rank(mine, warp_tot, &tot);
        if (mine) {
            sorted[base + r] = (int32_t)s;
            pos[s] = base + r;
        }
        base += tot;
    }
}

// ---------------------------------------------------------------------------------------
// Grouped GEMM over experts: out[p, :] = A[row(p), :] @ W[e]^T for the sorted rows p of expert e.
// A row: a_index ? a_index[p] / n_slots (token of the slot) : p. W (E, N, K) stacked.
template <typename T, int BM>
__global__ void __launch_bounds__(MOE_THREADS) moe_gemm_kernel(T *out, const T *A, const int32_t *a_index, int n_slots,
                                                               const T *W, const int32_t *offsets,
                                                               const int32_t *tile_start, int E, int N, int K) {
    __shared__ float As[BM][MOE_BK + 1];
    __shared__ float Ws[MOE_BK][MOE_BN + 1];
    const int tile = blockIdx.y;
    if (tile >= tile_start[E]) return;
    int lo = 0, hi = E - 1; // the expert whose tiles contain `tile`: last e with tile_start[e] <= tile
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    const int e = lo;
    const int row0 = offsets[e] + (tile - tile_start[e]) * BM, row_end = offsets[e + 1];
    const int n0 = blockIdx.x * MOE_BN;
    const T *We = W + (size_t)e * N * K;
    // Thread layout: column c = tid % BN, rows r = (tid / BN) + i * (THREADS / BN).
    constexpr int RSTEP = MOE_THREADS / MOE_BN, RPT = BM / RSTEP > 0 ? BM / RSTEP : 1;
    const int c = threadIdx.x % MOE_BN, rr = threadIdx.x / MOE_BN;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) acc[i] = 0.f;
    // 16-byte loads when every row start is 16-byte aligned (K a multiple of the vector).
    constexpr int VEC = 16 / sizeof(T);
    const bool vec = K % VEC == 0;
    for (int k0 = 0; k0 < K; k0 += MOE_BK) {
        if (vec) {
            for (int i = threadIdx.x; i < BM * (MOE_BK / VEC); i += MOE_THREADS) {
                int r = i / (MOE_BK / VEC), kv = (i % (MOE_BK / VEC)) * VEC, p = row0 + r;
                float f[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++) f[j] = 0.f;
                if (p < row_end && k0 + kv < K) {
                    int64_t arow = a_index ? a_index[p] / n_slots : p;
                    vec_load<T, VEC>(A + arow * K + k0 + kv, f);
                }
#pragma unroll
                for (int j = 0; j < VEC; j++) As[r][kv + j] = f[j];
            }
            for (int i = threadIdx.x; i < MOE_BN * (MOE_BK / VEC); i += MOE_THREADS) {
                int n = i / (MOE_BK / VEC), kv = (i % (MOE_BK / VEC)) * VEC;
                float f[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++) f[j] = 0.f;
                if (n0 + n < N && k0 + kv < K) vec_load<T, VEC>(We + (size_t)(n0 + n) * K + k0 + kv, f);
#pragma unroll
                for (int j = 0; j < VEC; j++) Ws[kv + j][n] = f[j];
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
            for (int i = 0; i < RPT; i++) acc[i] += As[rr + i * RSTEP][kk] * wv;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int p = row0 + rr + i * RSTEP;
        if (rr + i * RSTEP < BM && p < row_end && n0 + c < N) out[(int64_t)p * N + n0 + c] = from_f32<T>(acc[i]);
    }
}

template <typename T>
__global__ void moe_combine_kernel(T *out, const T *y, const int32_t *ids, const float *w, const int32_t *pos,
                                   int64_t n, int slots, int E, int64_t H) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * H; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / H, h = i % H;
        float acc = 0.f;
        for (int j = 0; j < slots; j++) {
            int64_t s = t * slots + j;
            int e = ids[s];
            if (e < 0 || e >= E) continue;
            acc += w[s] * to_f32(y[(int64_t)pos[s] * H + h]);
        }
        out[i] = from_f32<T>(acc);
    }
}

template <typename T, int BM>
static void moe_experts_launch(cudaStream_t s, T *out, const T *x, const T *wgu, const T *wdown, const int32_t *ids,
                               const float *w, int n_slots, int64_t n, int E, int64_t H, int64_t I, int32_t *offsets,
                               int32_t *tiles, int32_t *sorted, int32_t *pos, T *gu, T *act, T *y,
                               struct backend *b) {
    const int64_t R = n * n_slots;
    moe_scan_kernel<<<1, 32, 0, s>>>(offsets + 3 * (E + 1), E, BM, offsets, tiles); // counts live after tiles
    CUDA_CHECK_LAUNCH();
    moe_place_kernel<<<E, MOE_THREADS, 0, s>>>(ids, R, offsets, sorted, pos);
    CUDA_CHECK_LAUNCH();
    dim3 g1(cdiv(2 * I, MOE_BN), (unsigned)(cdiv(R, BM) + E));
    moe_gemm_kernel<T, BM><<<g1, MOE_THREADS, 0, s>>>(gu, x, sorted, n_slots, wgu, offsets, tiles, E, (int)(2 * I),
                                                      (int)H);
    CUDA_CHECK_LAUNCH();
    struct tensor gu_t = tensor_2d(gu, b->act_dtype, R, 2 * I), act_t = tensor_2d(act, b->act_dtype, R, I);
    cuda_op_silu_mul(b, &act_t, &gu_t);
    dim3 g2(cdiv(H, MOE_BN), (unsigned)(cdiv(R, BM) + E));
    moe_gemm_kernel<T, BM><<<g2, MOE_THREADS, 0, s>>>(y, act, NULL, 1, wdown, offsets, tiles, E, (int)H, (int)I);
    CUDA_CHECK_LAUNCH();
    int64_t total = n * H;
    unsigned grid = (unsigned)(total / 256 + 1 < 65535 * 8 ? total / 256 + 1 : 65535 * 8);
    moe_combine_kernel<T><<<grid, 256, 0, s>>>(out, y, ids, w, pos, n, n_slots, E, H);
    CUDA_CHECK_LAUNCH();
}

void cuda_op_moe_experts(struct backend *b, struct tensor *out, const struct tensor *x,
                                    const struct tensor *gate_up, const struct tensor *down, const int32_t *topk_ids,
                                    const float *topk_w, int n_slots, void *workspace) {
    CHECK(gate_up->ndim == 3 && down->ndim == 3 && x->dtype == out->dtype && gate_up->dtype == x->dtype &&
          down->dtype == x->dtype);
    const int64_t n = tensor_rows(x), H = tensor_cols(x), I = down->ne[2];
    const int E = (int)gate_up->ne[0];
    CHECK_MSG(gate_up->ne[1] == 2 * I && gate_up->ne[2] == H && down->ne[0] == E && down->ne[1] == H,
              "moe_experts: stacked weight shapes do not match H %lld", (long long)H);
    CHECK(tensor_rows(out) == n && tensor_cols(out) == H && out->data != x->data && n_slots >= 1);
    if (n == 0) return;
    const int64_t R = n * n_slots;
    cudaStream_t s = cuda_impl(b)->stream;
    // Workspace layout (moe_workspace_bytes): ints [offsets | tiles | spare | counts] (E + 1 each),
    // sorted (R), pos (R), spare (R); then, 256-byte aligned, xs (unused here), gu, act, y.
    int32_t *offsets = (int32_t *)workspace, *tiles = offsets + (E + 1), *counts = offsets + 3 * (E + 1);
    int32_t *sorted = offsets + 4 * (E + 1), *pos = sorted + R;
    size_t ints = (size_t)(4 * (E + 1) + 3 * R + 64) * sizeof(int32_t);
    char *acts = (char *)workspace + ((ints + 255) & ~(size_t)255);
    size_t es = dtype_row_bytes(x->dtype, 1);
    char *gu = acts + (size_t)R * H * es, *act = gu + (size_t)R * 2 * I * es, *y = act + (size_t)R * I * es;
    moe_count_kernel<<<E, MOE_THREADS, 0, s>>>(topk_ids, R, counts);
    CUDA_CHECK_LAUNCH();
    const bool small = R <= 512; // decode-sized batches: 16-row tiles (one per active expert)
    switch (x->dtype) {
    case DTYPE_BF16: {
        typedef __nv_bfloat16 T;
        if (small)
            moe_experts_launch<T, 16>(s, (T *)out->data, (const T *)x->data, (const T *)gate_up->data,
                                      (const T *)down->data, topk_ids, topk_w, n_slots, n, E, H, I, offsets, tiles,
                                      sorted, pos, (T *)gu, (T *)act, (T *)y, b);
        else
            moe_experts_launch<T, 64>(s, (T *)out->data, (const T *)x->data, (const T *)gate_up->data,
                                      (const T *)down->data, topk_ids, topk_w, n_slots, n, E, H, I, offsets, tiles,
                                      sorted, pos, (T *)gu, (T *)act, (T *)y, b);
        break;
    }
    case DTYPE_F32: {
        typedef float T;
        if (small)
            moe_experts_launch<T, 16>(s, (T *)out->data, (const T *)x->data, (const T *)gate_up->data,
                                      (const T *)down->data, topk_ids, topk_w, n_slots, n, E, H, I, offsets, tiles,
                                      sorted, pos, (T *)gu, (T *)act, (T *)y, b);
        else
            moe_experts_launch<T, 64>(s, (T *)out->data, (const T *)x->data, (const T *)gate_up->data,
                                      (const T *)down->data, topk_ids, topk_w, n_slots, n, E, H, I, offsets, tiles,
                                      sorted, pos, (T *)gu, (T *)act, (T *)y, b);
        break;
    }
    default: CHECK_MSG(0, "moe_experts: dtype %s unsupported", dtype_name(x->dtype));
    }
}
