// Multi-head latent attention on CUDA (backend.h "---- MLA ----"; the CPU reference is
// src/backend/cpu/cpu_mla.c, tests/gpu/test_cuda_mla.c compares the two).
//
// mla_write_kernel: grid (token). RoPE of every head's q_pe in place (sincosf of pos * inv_freq
// in f32, as the CPU), and, for a real slot, the latent row [rmsnorm(c) * w, rope(k_pe)] in the
// cache dtype (BF16, or FP8 E4M3 as value / k_scale).
//
// Decode rows (and every row of a short chunk) run absorbed, in chunks of at most MLA_WS_TOKENS
// tokens (the workspace is sized for one chunk, so its size does not grow with the batch):
//   mla_absorb_kernel   grid (token, head): qa = scale * [W_UK_h^T q_nope, q_pe] (f32, D = L + R)
//   mla_attend_kernel   grid (token, head tile of MLA_HT heads, split): the tile's heads share every
//                       latent tile of MLA_TK keys (loaded once into shared memory as f32); warp
//                       w is head w, lane j scores key j, online softmax in f32, each lane keeps
//                       L / 32 latent output dims in registers. Decode-sized chunks
//                       (<= MLA_WS_SPLIT_TOKENS tokens) split the keys over MLA_WS_MAX_SPLITS blocks
//                       (split-KV) and mla_combine_kernel merges the partials.
//   mla_out_kernel      grid (token, head): out[t, h, j] = W_UV_h[j] . o_lat (a warp per j)
// (absorb and out run as the tiled kernels below, one weight tile per block over the chunk's
// tokens, where the shapes allow).
//
// Expanded prefill (tensor cores). A sequence with at least MLA_EXPAND_MIN_QLEN new tokens in a
// step that is not being captured into a graph (decode graphs never take it: their rows have one
// or a few tokens, and capture is checked too), on a dense MLA layer (no DSA top-k) whose head
// dims the paged flash kernel has ((nope + rope, v) in (64, 64), (128, 128), (256, 256),
// (192, 128): DeepSeek-V2 / V3, Kimi-K2, Moonlight are 192 / 128), runs as ordinary multi-head
// attention over its whole context, cached prefix included:
//   mla_expand_gather_kernel  its latent rows 0..ctx-1 (through its block table; FP8 rows times
//                             k_scale) into C (N, L) bf16, and k_pe broadcast into every head's
//                             K row tail; N = ctx rounded up to CUDA_ATTN_BN, pad rows zero
//   cuda_op_matmul            KV = C @ kv_b^T (N, H (nope + v)) on cuBLASLt
//   mla_expand_split_kernel   K (N, H, nope + rope) = [k_nope, k_pe], V (N, H, v): contiguous
//                             pages of CUDA_ATTN_BN tokens (identity block table)
//   cuda_op_attention         cuda_attention.cu's paged flash kernel (H KV heads, causal on the
//                             absolute positions, the MLA softmax scale incl. YaRN's mscale)
// Its rows are then skipped by the absorbed kernels (they run over the other sequences' token
// ranges). The expansion buffer (cb->mla_expand) holds one sequence at a time, (L + H (2 nope + 2 v
// + rope)) bf16 per context token (19.5 KB for Moonlight's 16 heads, 148 KB for DeepSeek-V3's
// 128), grown on demand up to MLA_EXPAND_MAX_BYTES; a sequence whose context needs more, or when
// the allocation fails, runs absorbed (correct, slower).
// DSA (mla_args.topk): a key outside the query's top-k list scores -inf in mla_attend_kernel (a
// binary search of the ascending list per key and lane).
// Sequence lookup, positions, context lengths, block tables and slots come from the device
// arrays and loops are bounded by the device context_lens, so decode launches are graph-capture
// safe (the launch shape depends on n only).
#include "backend/cuda/cuda_common.cuh"

#include <math.h>
#include <type_traits>

#define MLA_HT 8                               // heads per attention block (one warp each)
#define MLA_EXPAND_MIN_QLEN 16                 // new tokens of a sequence from which its step runs expanded (see above)
#define MLA_EXPAND_MAX_BYTES ((size_t)2 << 30) // the expansion buffer's cap
#define MLA_TK 32                              // keys per shared-memory tile (one per lane)

template <typename C> __device__ __forceinline__ float mla_cache_f32(C v, float scale);
template <> __device__ __forceinline__ float mla_cache_f32<__nv_bfloat16>(__nv_bfloat16 v, float) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float mla_cache_f32<__nv_fp8_e4m3>(__nv_fp8_e4m3 v, float scale) {
    return (float)v * scale;
}
template <typename C> __device__ __forceinline__ C mla_cache_from(float v, float inv_scale);
template <> __device__ __forceinline__ __nv_bfloat16 mla_cache_from<__nv_bfloat16>(float v, float) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 mla_cache_from<__nv_fp8_e4m3>(float v, float inv_scale) {
    return __nv_fp8_e4m3(v * inv_scale);
}

// The sequence owning token t (query_start is ascending, n_seqs + 1 entries).
__device__ __forceinline__ int mla_seq_of(const int32_t *query_start, int n_seqs, int t) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

template <typename C>
__global__ void __launch_bounds__(256)
    mla_write_kernel(__nv_bfloat16 *q, const __nv_bfloat16 *kv_a, const void *norm_w, bool norm_f32, float eps, int H,
                     int NP, int R, int L, const float *inv_freq, float af, bool inter, const int32_t *positions,
                     const int32_t *slot_mapping, C *cache, float inv_scale) {
    pdl_begin();
    const int t = blockIdx.x, half = R / 2, DQ = NP + R;
    const float pos = (float)positions[t];
    for (int idx = threadIdx.x; idx < H * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        __nv_bfloat16 *row = q + ((size_t)t * H + h) * DQ + NP;
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        cs *= af;
        sn *= af;
        const int i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + half;
        const float a = __bfloat162float(row[i0]), b = __bfloat162float(row[i1]);
        row[i0] = __float2bfloat16_rn(a * cs - b * sn);
        row[i1] = __float2bfloat16_rn(b * cs + a * sn);
    }
    const int32_t slot = slot_mapping[t];
    if (slot < 0) return;
    const __nv_bfloat16 *src = kv_a + (size_t)t * (L + R);
    __shared__ float red[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < L; i += blockDim.x) {
        const float v = __bfloat162float(src[i]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float inv = rsqrtf(red[0] / (float)L + eps);
    C *dst = cache + (size_t)slot * (L + R);
    for (int i = threadIdx.x; i < L; i += blockDim.x) {
        const float w = norm_f32 ? ((const float *)norm_w)[i] : __bfloat162float(((const __nv_bfloat16 *)norm_w)[i]);
        // The normed value is rounded to BF16 first (what a separate rmsnorm would store).
        const float c = __bfloat162float(__float2bfloat16_rn(__bfloat162float(src[i]) * inv * w));
        dst[i] = mla_cache_from<C>(c, inv_scale);
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        cs *= af;
        sn *= af;
        const int i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + half;
        const float a = __bfloat162float(src[L + i0]), b = __bfloat162float(src[L + i1]);
        dst[L + i0] = mla_cache_from<C>(__bfloat162float(__float2bfloat16_rn(a * cs - b * sn)), inv_scale);
        dst[L + i1] = mla_cache_from<C>(__bfloat162float(__float2bfloat16_rn(b * cs + a * sn)), inv_scale);
    }
}

// qa[t, h] = scale * [W_UK_h^T q_nope[t, h], q_pe[t, h]]; W_UK_h = kv_b rows h (NP + V) .. + NP.
__global__ void __launch_bounds__(128) mla_absorb_kernel(const __nv_bfloat16 *q, const __nv_bfloat16 *kv_b, float *qa,
                                                         int t0, int H, int NP, int R, int L, int V, float scale) {
    pdl_begin();
    extern __shared__ float qn[]; // (NP)
    const int t = t0 + blockIdx.x, h = blockIdx.y, DQ = NP + R, D = L + R;
    const __nv_bfloat16 *qt = q + ((size_t)t * H + h) * DQ;
    for (int i = threadIdx.x; i < NP; i += blockDim.x)
        qn[i] = __bfloat162float(qt[i]);
    __syncthreads();
    const __nv_bfloat16 *w = kv_b + (size_t)h * (NP + V) * L;
    float *dst = qa + ((size_t)blockIdx.x * H + h) * D;
    for (int c = threadIdx.x; c < L; c += blockDim.x) {
        float acc = 0.f;
        for (int i = 0; i < NP; i++)
            acc += qn[i] * __bfloat162float(w[(size_t)i * L + c]);
        dst[c] = acc * scale;
    }
    for (int i = threadIdx.x; i < R; i += blockDim.x)
        dst[L + i] = __bfloat162float(qt[NP + i]) * scale;
}

// The tiled projections (MLA_TILED_PROJ; the per-(token, head) kernels above streamed W_UK_h /
// W_UV_h, 128 KB each, through one block per head: 16 blocks at Moonlight's batch 1, ~20-35 GB/s,
// 150 of a decode layer's ~430 us on the H200, session-12 ncu). Here a block owns one weight tile
// (kept in shared memory) and loops over the chunk's tokens, so the weights are read once per
// chunk by H x L / 64 (absorb) or H x V / 16 (out) blocks: 128 at Moonlight's 16 heads.
//   mla_absorb_tiled_kernel  grid (head, L / 64): W_UK_h's 64-column tile (nope x 64 bf16); four
//                            tokens per pass (q_nope staged in shared memory), a thread per column
//   mla_out_tiled_kernel     grid (head, V / 16): W_UV_h's 16 rows (16 x L bf16); per token the
//                            o_lat row staged in shared memory, a warp per row
#define MLA_TILED_PROJ 1 // 0: the per-(token, head) kernels

__global__ void __launch_bounds__(256)
    mla_absorb_tiled_kernel(const __nv_bfloat16 *q, const __nv_bfloat16 *kv_b, float *qa, int t0, int nc, int H, int NP,
                            int R, int L, int V, float scale) {
    pdl_begin();
    extern __shared__ float abs_sm[]; // q_nope of 4 tokens (4, NP) f32, then the tile (NP, 64) bf16
    float *qn = abs_sm;
    __nv_bfloat16 *wt = (__nv_bfloat16 *)(abs_sm + 4 * NP);
    const int h = blockIdx.x, c0 = blockIdx.y * 64, DQ = NP + R, D = L + R;
    const __nv_bfloat16 *w = kv_b + (size_t)h * (NP + V) * L + c0;
    for (int i = threadIdx.x; i < NP * 8; i += blockDim.x)
        ((uint4 *)(wt + (size_t)(i / 8) * 64))[i % 8] = *(const uint4 *)(w + (size_t)(i / 8) * L + (i % 8) * 8);
    const int c = threadIdx.x & 63, sub = threadIdx.x >> 6;
    for (int p = 0; p < nc; p += 4) {
        __syncthreads(); // the previous pass has read qn (and, the first time, the tile is written)
        for (int i = threadIdx.x; i < 4 * NP; i += blockDim.x) {
            const int tt = p + i / NP;
            qn[i] = tt < nc ? __bfloat162float(q[((size_t)(t0 + tt) * H + h) * DQ + i % NP]) : 0.f;
        }
        __syncthreads();
        const int tt = p + sub;
        if (tt < nc) {
            const float *qt = qn + sub * NP;
            float acc = 0.f;
            for (int i = 0; i < NP; i++)
                acc += qt[i] * __bfloat162float(wt[i * 64 + c]);
            qa[((size_t)tt * H + h) * D + c0 + c] = acc * scale;
        }
    }
    if (blockIdx.y == 0)
        for (int i = threadIdx.x; i < nc * R; i += blockDim.x) {
            const int tt = i / R, r = i % R;
            qa[((size_t)tt * H + h) * D + L + r] = __bfloat162float(q[((size_t)(t0 + tt) * H + h) * DQ + NP + r]) * scale;
        }
}

__global__ void __launch_bounds__(256) mla_out_tiled_kernel(const float *o_lat, const __nv_bfloat16 *kv_b,
                                                            __nv_bfloat16 *out, int t0, int nc, int H, int NP, int L,
                                                            int V) {
    pdl_begin();
    extern __shared__ float out_sm[]; // the o_lat row (L) f32, then the 16 rows (16, L) bf16
    __nv_bfloat16 *wr = (__nv_bfloat16 *)(out_sm + L);
    const int h = blockIdx.x, j0 = blockIdx.y * 16, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    const uint4 *w = (const uint4 *)(kv_b + ((size_t)h * (NP + V) + NP + j0) * L);
    for (int i = threadIdx.x; i < 16 * L / 8; i += blockDim.x)
        ((uint4 *)wr)[i] = w[i];
    for (int tt = 0; tt < nc; tt++) {
        __syncthreads();
        const float *ol = o_lat + ((size_t)tt * H + h) * L;
        for (int i = threadIdx.x; i < L; i += blockDim.x)
            out_sm[i] = ol[i];
        __syncthreads();
        for (int jj = warp; jj < 16; jj += nw) {
            const __nv_bfloat16 *wj = wr + (size_t)jj * L;
            float acc = 0.f;
            for (int i = lane; i < L; i += 32)
                acc += __bfloat162float(wj[i]) * out_sm[i];
            acc = warp_sum(acc);
            if (lane == 0) out[((size_t)(t0 + tt) * H + h) * V + j0 + jj] = __float2bfloat16_rn(acc);
        }
    }
}

// DSA: whether position j is in a query's top-k list (ascending, -1 after the last entry).
__device__ __forceinline__ bool dsa_listed(const int32_t *list, int k, int j) {
    int lo = 0, hi = k; // first entry >= j, treating -1 as past the end
    while (lo < hi) {
        const int mid = (lo + hi) / 2, v = list[mid];
        if (v >= 0 && v < j)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < k && list[lo] == j;
}

// One block: token t0 + blockIdx.x, heads [blockIdx.y * MLA_HT, + MLA_HT), key split blockIdx.z of
// gridDim.z. Dynamic shared memory: qa tile (MLA_HT, D) f32, then the key tile (MLA_TK, D + 1) f32
// (rows padded by one float so that lanes scoring different keys hit different banks).
// Writes o (unnormalised, relative to m), m and l per (token, head, split) into part when
// gridDim.z > 1, else the normalised o_lat.
template <typename C, int NC>
__global__ void __launch_bounds__(32 * MLA_HT)
    mla_attend_kernel(const float *qa, const C *cache, float k_scale, const int32_t *query_start,
                      const int32_t *context_lens, const int32_t *block_tables, int max_blocks, int n_seqs, int bs,
                      int t0, int H, int L, int R, float *o_lat, float *part, const int32_t *topk, int topk_k) {
    pdl_begin();
    extern __shared__ float sm[];
    const int D = L + R, DP = D + 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tok = t0 + blockIdx.x, h0 = blockIdx.y * MLA_HT, split = blockIdx.z, S = gridDim.z;
    const int nh = H - h0 < MLA_HT ? H - h0 : MLA_HT;
    float *sq = sm, *sk = sm + MLA_HT * D;
    const int s = mla_seq_of(query_start, n_seqs, tok);
    const int q_len = query_start[s + 1] - query_start[s], ctx = context_lens[s];
    const int pos = ctx - q_len + (tok - query_start[s]); // keys 0..pos
    const int chunk = (pos + 1 + S - 1) / S, k0 = split * chunk;
    const int k1 = min(pos + 1, k0 + chunk);
    for (int i = threadIdx.x; i < nh * D; i += blockDim.x)
        sq[i] = qa[((size_t)blockIdx.x * H + h0) * D + i];
    float o[NC];
#pragma unroll
    for (int c = 0; c < NC; c++)
        o[c] = 0.f;
    float m = -INFINITY, l = 0.f;
    const int32_t *bt = block_tables + (size_t)s * max_blocks;
    for (int j0 = k0; j0 < k1; j0 += MLA_TK) {
        const int nk = min(MLA_TK, k1 - j0);
        __syncthreads();
        for (int i = threadIdx.x; i < nk * D; i += blockDim.x) {
            const int j = j0 + i / D, d = i % D;
            const int64_t row = (int64_t)bt[j / bs] * bs + j % bs;
            sk[(i / D) * DP + d] = mla_cache_f32<C>(cache[row * D + d], k_scale);
        }
        __syncthreads();
        if (warp < nh) {
            const float *qh = sq + warp * D;
            float sc = -INFINITY;
            if (lane < nk && (!topk || dsa_listed(topk + (size_t)tok * topk_k, topk_k, j0 + lane))) {
                const float *kr = sk + lane * DP;
                float acc = 0.f;
                for (int d = 0; d < D; d++)
                    acc += qh[d] * kr[d];
                sc = acc;
            }
            const float tmax = warp_max(sc), mnew = fmaxf(m, tmax);
            if (mnew == -INFINITY) continue;     // DSA: no listed key in this tile yet (m stays -inf)
            const float corr = __expf(m - mnew); // 0 when m was -inf
            const float p = lane < nk ? __expf(sc - mnew) : 0.f;
            l = l * corr + warp_sum(p);
#pragma unroll
            for (int c = 0; c < NC; c++)
                o[c] *= corr;
            for (int j = 0; j < nk; j++) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                const float *kr = sk + j * DP;
#pragma unroll
                for (int c = 0; c < NC; c++)
                    if (lane + 32 * c < L) o[c] += pj * kr[lane + 32 * c];
            }
            m = mnew;
        }
    }
    if (warp >= nh) return;
    const int h = h0 + warp;
    if (S == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        float *dst = o_lat + ((size_t)blockIdx.x * H + h) * L;
#pragma unroll
        for (int c = 0; c < NC; c++)
            if (lane + 32 * c < L) dst[lane + 32 * c] = o[c] * inv;
        return;
    }
    float *dst = part + (((size_t)blockIdx.x * H + h) * S + split) * (L + 2);
#pragma unroll
    for (int c = 0; c < NC; c++)
        if (lane + 32 * c < L) dst[lane + 32 * c] = o[c];
    if (lane == 0) {
        dst[L] = m;
        dst[L + 1] = l;
    }
}

__global__ void __launch_bounds__(128) mla_combine_kernel(const float *part, int S, int H, int L, float *o_lat) {
    pdl_begin();
    const size_t th = (size_t)blockIdx.x * H + blockIdx.y;
    const float *p = part + th * S * (L + 2);
    float mx = -INFINITY;
    for (int s = 0; s < S; s++)
        mx = fmaxf(mx, p[s * (L + 2) + L]);
    float den = 0.f;
    for (int s = 0; s < S; s++)
        if (p[s * (L + 2) + L + 1] > 0.f) den += __expf(p[s * (L + 2) + L] - mx) * p[s * (L + 2) + L + 1];
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int c = threadIdx.x; c < L; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < S; s++)
            if (p[s * (L + 2) + L + 1] > 0.f) acc += __expf(p[s * (L + 2) + L] - mx) * p[s * (L + 2) + c];
        o_lat[th * L + c] = acc * inv;
    }
}

// out[t, h, j] = W_UV_h[j] . o_lat[t, h]; W_UV_h = kv_b rows h (NP + V) + NP .. + V. A warp per j.
__global__ void __launch_bounds__(128) mla_out_kernel(const float *o_lat, const __nv_bfloat16 *kv_b, __nv_bfloat16 *out,
                                                      int t0, int H, int NP, int L, int V) {
    pdl_begin();
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float *ol = o_lat + ((size_t)blockIdx.x * H + h) * L;
    const __nv_bfloat16 *w = kv_b + ((size_t)h * (NP + V) + NP) * L;
    for (int j = warp; j < V; j += nw) {
        float acc = 0.f;
        for (int c = lane; c < L; c += 32)
            acc += __bfloat162float(w[(size_t)j * L + c]) * ol[c];
        acc = warp_sum(acc);
        if (lane == 0) out[((size_t)(t0 + blockIdx.x) * H + h) * V + j] = __float2bfloat16_rn(acc);
    }
}

void cuda_op_mla_latent_write(struct backend *b, struct tensor *q, const struct tensor *kv_a,
                              const struct tensor *kv_norm, float eps, const struct rope_args *rope,
                              const struct mla_args *a, struct kv_layer *kv, const struct attn_metadata *md) {
    const int n = md->n_tokens, L = a->kv_lora, R = a->rope;
    CHECK(q->dtype == DTYPE_BF16 && kv_a->dtype == DTYPE_BF16 && tensor_cols(kv_a) == L + R);
    CHECK(rope->rotary_dim == R && tensor_numel(kv_norm) == L &&
          (kv_norm->dtype == DTYPE_BF16 || kv_norm->dtype == DTYPE_F32));
    CHECK(kv->k.ndim == 4 && kv->k.ne[2] == 1 && kv->k.ne[3] == L + R);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    auto launch = [&](auto *cache, float inv) {
        using C = std::remove_pointer_t<decltype(cache)>;
        pdl_launch(mla_write_kernel<C>, dim3((unsigned)n), 256, 0, s, (__nv_bfloat16 *)q->data,
                   (const __nv_bfloat16 *)kv_a->data, (const void *)kv_norm->data, kv_norm->dtype == DTYPE_F32, eps,
                   a->n_heads, a->nope, R, L, rope->inv_freq, rope->attn_factor, rope->interleaved, md->positions,
                   md->slot_mapping, cache, inv);
    };
    if (kv->k.dtype == DTYPE_BF16)
        launch((__nv_bfloat16 *)kv->k.data, 1.f);
    else if (kv->k.dtype == DTYPE_FP8_E4M3)
        launch((__nv_fp8_e4m3 *)kv->k.data, 1.f / kv->k_scale);
    else
        CHECK_MSG(0, "CUDA MLA latent cache dtype %s unsupported (BF16 or FP8_E4M3)", dtype_name(kv->k.dtype));
    CUDA_CHECK_LAUNCH();
}

// ---- Expanded prefill ----

// Row j of C (N, L) and the k_pe tail of every head's K row j: the latent row of sequence s's
// position j (j < ctx), zeros past it.
template <typename C>
__global__ void __launch_bounds__(128)
    mla_expand_gather_kernel(const C *cache, float k_scale, const int32_t *bt, int bs, int ctx, int H, int NP, int R,
                             int L, __nv_bfloat16 *c_out, __nv_bfloat16 *k_out) {
    pdl_begin();
    const int j = blockIdx.x;
    __nv_bfloat16 *cr = c_out + (size_t)j * L;
    __nv_bfloat16 *kr = k_out + (size_t)j * H * (NP + R) + NP;
    if (j >= ctx) {
        for (int i = threadIdx.x; i < L; i += blockDim.x)
            cr[i] = __float2bfloat16_rn(0.f);
        for (int i = threadIdx.x; i < H * R; i += blockDim.x)
            kr[(size_t)(i / R) * (NP + R) + i % R] = __float2bfloat16_rn(0.f);
        return;
    }
    const C *src = cache + ((size_t)bt[j / bs] * bs + j % bs) * (L + R);
    for (int i = threadIdx.x; i < L; i += blockDim.x)
        cr[i] = __float2bfloat16_rn(mla_cache_f32<C>(src[i], k_scale));
    for (int i = threadIdx.x; i < H * R; i += blockDim.x)
        kr[(size_t)(i / R) * (NP + R) + i % R] = __float2bfloat16_rn(mla_cache_f32<C>(src[L + i % R], k_scale));
}

// KV row j (H, nope + v) into K row j's heads (their first nope values) and V row j (H, v), 8
// bf16 at a time (nope, v, rope are multiples of 8).
__global__ void __launch_bounds__(256) mla_expand_split_kernel(const __nv_bfloat16 *kv, int H, int NP, int R, int V,
                                                               __nv_bfloat16 *k_out, __nv_bfloat16 *v_out) {
    pdl_begin();
    const int j = blockIdx.x, W = NP + V, n8 = H * W / 8;
    const uint4 *src = (const uint4 *)(kv + (size_t)j * H * W);
    for (int i = threadIdx.x; i < n8; i += blockDim.x) {
        const int e = i * 8, h = e / W, c = e % W;
        __nv_bfloat16 *dst =
            c < NP ? k_out + ((size_t)j * H + h) * (NP + R) + c : v_out + ((size_t)j * H + h) * V + (c - NP);
        *(uint4 *)dst = src[i];
    }
}

// The one-sequence metadata of an expanded launch: query_start {0, q_len}, context_lens {ctx},
// then the identity block table of npages pages.
__global__ void mla_expand_meta_kernel(int32_t *meta, int q_len, int ctx, int npages) {
    pdl_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < npages + 3; i += gridDim.x * blockDim.x)
        meta[i] = i == 0 ? 0 : i == 1 ? q_len : i == 2 ? ctx : i - 3;
}

static bool mla_expand_dims_ok(int DQK, int V) {
    return (DQK == V && (DQK == 64 || DQK == 128 || DQK == 256)) || (DQK == 192 && V == 128);
}

static size_t mla_align256(size_t x) {
    return (x + 255) & ~(size_t)255;
}

// Sequence s of md (q_len new tokens, ctx in the cache, host values) expanded; false (nothing
// launched) when the expansion buffer cannot hold its context.
static bool mla_expand_seq(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                           const struct attn_metadata *md, const struct mla_args *a, int s, int q0, int q_len,
                           int ctx) {
    struct cuda_backend *cb = cuda_impl(b);
    const int H = a->n_heads, L = a->kv_lora, R = a->rope, NP = a->nope, V = a->v_dim, DQ = NP + R;
    const int BNP = CUDA_ATTN_BN, npages = (int)cdiv(ctx, BNP), N = npages * BNP;
    const size_t e = sizeof(__nv_bfloat16);
    const size_t c_bytes = mla_align256((size_t)N * L * e), kv_bytes = mla_align256((size_t)N * H * (NP + V) * e);
    const size_t k_bytes = mla_align256((size_t)N * H * DQ * e), v_bytes = mla_align256((size_t)N * H * V * e);
    const size_t need = c_bytes + kv_bytes + k_bytes + v_bytes + mla_align256((size_t)(npages + 3) * 4);
    if (need > MLA_EXPAND_MAX_BYTES) return false;
    if (cuda_scratch_reserve(cb, &cb->mla_expand, &cb->mla_expand_bytes, need) < need) return false;
    char *w = (char *)cb->mla_expand;
    __nv_bfloat16 *cbuf = (__nv_bfloat16 *)w, *kvbuf = (__nv_bfloat16 *)(w + c_bytes);
    __nv_bfloat16 *kbuf = (__nv_bfloat16 *)(w + c_bytes + kv_bytes);
    __nv_bfloat16 *vbuf = (__nv_bfloat16 *)(w + c_bytes + kv_bytes + k_bytes);
    int32_t *meta = (int32_t *)(w + c_bytes + kv_bytes + k_bytes + v_bytes);
    cudaStream_t st = cb->stream;
    const int32_t *bt = md->block_tables + (size_t)s * attn_md_table_stride(md);
    if (kv->k.dtype == DTYPE_BF16)
        pdl_launch(mla_expand_gather_kernel<__nv_bfloat16>, dim3((unsigned)N), 128, 0, st,
                   (const __nv_bfloat16 *)kv->k.data, 1.f, bt, md->block_size, ctx, H, NP, R, L, cbuf, kbuf);
    else
        pdl_launch(mla_expand_gather_kernel<__nv_fp8_e4m3>, dim3((unsigned)N), 128, 0, st,
                   (const __nv_fp8_e4m3 *)kv->k.data, kv->k_scale, bt, md->block_size, ctx, H, NP, R, L, cbuf, kbuf);
    struct tensor tc = tensor_2d(cbuf, DTYPE_BF16, N, L), tkv = tensor_2d(kvbuf, DTYPE_BF16, N, (int64_t)H * (NP + V));
    cuda_op_matmul(b, &tkv, &tc, a->kv_b, NULL);
    pdl_launch(mla_expand_split_kernel, dim3((unsigned)N), 256, 0, st, (const __nv_bfloat16 *)kvbuf, H, NP, R, V, kbuf,
               vbuf);
    pdl_launch(mla_expand_meta_kernel, dim3(cdiv(npages + 3, 256)), 256, 0, st, meta, q_len, ctx, npages);
    CUDA_CHECK_LAUNCH();
    const int64_t kne[4] = {npages, BNP, H, DQ}, vne[4] = {npages, BNP, H, V}, qne[3] = {q_len, H, DQ},
                  one[3] = {q_len, H, V};
    struct kv_layer kx = {};
    kx.k = tensor_make(kbuf, DTYPE_BF16, 4, kne);
    kx.v = tensor_make(vbuf, DTYPE_BF16, 4, vne);
    kx.k_scale = kx.v_scale = 1.f;
    struct attn_metadata mx = {.n_seqs = 1,
                               .n_tokens = q_len,
                               .max_query_len = q_len,
                               .max_context_len = ctx,
                               .max_blocks_per_seq = npages,
                               .block_size = BNP,
                               .query_start = meta,
                               .context_lens = meta + 2,
                               .block_tables = meta + 3};
    struct tensor qs = tensor_make((char *)q->data + (size_t)q0 * H * DQ * e, DTYPE_BF16, 3, qne);
    struct tensor os = tensor_make((char *)out->data + (size_t)q0 * H * V * e, DTYPE_BF16, 3, one);
    cuda_op_attention(b, &os, &qs, 0, &kx, &mx, a->scale, 0, NULL);
    cb->mla_expanded_seqs++;
    return true;
}

extern "C" uint64_t backend_cuda_mla_expanded_seqs(const struct backend *b) {
    return ((const struct cuda_backend *)b->impl)->mla_expanded_seqs;
}

// The absorbed kernels over the tokens [ta, tb) of md (whole sequences).
static void mla_absorbed_range(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                               const struct attn_metadata *md, const struct mla_args *a, void *workspace, int ta,
                               int tb) {
    struct cuda_backend *cb = cuda_impl(b);
    const int H = a->n_heads, L = a->kv_lora, R = a->rope, NP = a->nope, V = a->v_dim, D = L + R;
    cudaStream_t s = cb->stream;
    const __nv_bfloat16 *kvb = (const __nv_bfloat16 *)a->kv_b->t.data;
    // Workspace (mla_workspace_bytes): per chunk of nc tokens, qa (nc, H, D) f32, o_lat (nc, H, L)
    // f32, then the partials (nc, H, splits, L + 2) of a split chunk, packed by nc: the workspace
    // is sized for min(max tokens, MLA_WS_TOKENS) (and min(max tokens, MLA_WS_SPLIT_TOKENS) split)
    // tokens, so offsets by the full MLA_WS_TOKENS would run past it when the step budget is small.
    const size_t attend_smem = ((size_t)MLA_HT * D + (size_t)MLA_TK * (D + 1)) * sizeof(float);
    // Tiled projections where the shapes tile (L a multiple of 64, v of 16, nope <= 256: 48 KB of
    // shared memory at most).
    const bool tiled = MLA_TILED_PROJ && L % 64 == 0 && V % 16 == 0 && NP <= 256 && NP % 8 == 0;
    for (int t0 = ta; t0 < tb; t0 += MLA_WS_TOKENS) {
        const int nc = tb - t0 < MLA_WS_TOKENS ? tb - t0 : MLA_WS_TOKENS;
        const int S = nc <= MLA_WS_SPLIT_TOKENS ? MLA_WS_MAX_SPLITS : 1;
        float *qa = (float *)workspace;
        float *o_lat = qa + (size_t)nc * H * D;
        float *part = o_lat + (size_t)nc * H * L;
        if (tiled)
            pdl_launch(mla_absorb_tiled_kernel, dim3((unsigned)H, (unsigned)(L / 64)), 256,
                       (size_t)4 * NP * sizeof(float) + (size_t)NP * 64 * sizeof(__nv_bfloat16), s,
                       (const __nv_bfloat16 *)q->data, kvb, qa, t0, nc, H, NP, R, L, V, a->scale);
        else
            pdl_launch(mla_absorb_kernel, dim3((unsigned)nc, (unsigned)H), 128, (size_t)NP * sizeof(float), s,
                       (const __nv_bfloat16 *)q->data, kvb, qa, t0, H, NP, R, L, V, a->scale);
        const dim3 g((unsigned)nc, cdiv(H, MLA_HT), (unsigned)S);
        auto attend = [&](auto *cache, float scale) {
            using C = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
            auto kern = mla_attend_kernel<C, CUDA_MLA_MAX_KV_LORA / 32>;
            static size_t smem_set[2]; // per cache type: the opt-in shared memory set so far
            size_t &set = smem_set[std::is_same<C, __nv_bfloat16>::value ? 0 : 1];
            if (attend_smem > set) {
                CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)attend_smem));
                set = attend_smem;
            }
            pdl_launch(kern, g, 32 * MLA_HT, attend_smem, s, (const float *)qa, (const C *)cache, scale,
                       md->query_start, md->context_lens, md->block_tables, attn_md_table_stride(md), md->n_seqs,
                       md->block_size, t0, H, L, R, o_lat, part, a->topk, a->topk_k);
        };
        if (kv->k.dtype == DTYPE_BF16)
            attend((const __nv_bfloat16 *)kv->k.data, 1.f);
        else if (kv->k.dtype == DTYPE_FP8_E4M3)
            attend((const __nv_fp8_e4m3 *)kv->k.data, kv->k_scale);
        else
            CHECK_MSG(0, "CUDA MLA latent cache dtype %s unsupported", dtype_name(kv->k.dtype));
        if (S > 1)
            pdl_launch(mla_combine_kernel, dim3((unsigned)nc, (unsigned)H), 128, 0, s, (const float *)part, S, H, L,
                       o_lat);
        if (tiled)
            pdl_launch(mla_out_tiled_kernel, dim3((unsigned)H, (unsigned)(V / 16)), 256,
                       (size_t)L * sizeof(float) + (size_t)16 * L * sizeof(__nv_bfloat16), s, (const float *)o_lat, kvb,
                       (__nv_bfloat16 *)out->data, t0, nc, H, NP, L, V);
        else
            pdl_launch(mla_out_kernel, dim3((unsigned)nc, (unsigned)H), 128, 0, s, (const float *)o_lat, kvb,
                       (__nv_bfloat16 *)out->data, t0, H, NP, L, V);
    }
    CUDA_CHECK_LAUNCH();
}

void cuda_op_mla_attention(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                           const struct attn_metadata *md, const struct mla_args *a, void *workspace) {
    struct cuda_backend *cb = cuda_impl(b);
    const int n = md->n_tokens, H = a->n_heads, L = a->kv_lora, R = a->rope, NP = a->nope, V = a->v_dim, D = L + R;
    CHECK(out->dtype == DTYPE_BF16 && q->dtype == DTYPE_BF16 && workspace);
    CHECK(a->kv_b && a->kv_b->scheme == WEIGHT_SCHEME_NONE && a->kv_b->t.dtype == DTYPE_BF16 &&
          tensor_cols(&a->kv_b->t) == L && a->kv_b->t.ne[0] == (int64_t)H * (NP + V));
    CHECK_MSG(L % 32 == 0 && L <= CUDA_MLA_MAX_KV_LORA && R % 2 == 0 && R <= CUDA_MLA_MAX_ROPE,
              "CUDA MLA: kv_lora_rank %d (multiple of 32, <= %d), rope %d", L, CUDA_MLA_MAX_KV_LORA, R);
    CHECK(kv->k.ndim == 4 && kv->k.ne[2] == 1 && kv->k.ne[3] == D && kv->k.ne[1] == md->block_size);
    CHECK(kv->k.dtype == DTYPE_BF16 || kv->k.dtype == DTYPE_FP8_E4M3);
    if (n == 0) return;
    // Expanded sequences first (host values: such steps are never captured), then the absorbed
    // kernels over the token runs of the others.
    const bool expand = !a->topk && !a->absorbed_only && md->max_query_len >= MLA_EXPAND_MIN_QLEN && md->h_query_start &&
                        md->h_context_lens && mla_expand_dims_ok(NP + R, V) && NP % 8 == 0 && V % 8 == 0 &&
                        R % 8 == 0 && !cuda_is_capturing(cb);
    if (!expand) {
        mla_absorbed_range(b, out, q, kv, md, a, workspace, 0, n);
        return;
    }
    int run0 = 0; // start of the pending absorbed run
    for (int s = 0; s < md->n_seqs; s++) {
        const int q0 = md->h_query_start[s], q1 = md->h_query_start[s + 1], ctx = md->h_context_lens[s];
        if (q1 - q0 >= MLA_EXPAND_MIN_QLEN && mla_expand_seq(b, out, q, kv, md, a, s, q0, q1 - q0, ctx)) {
            if (run0 < q0) mla_absorbed_range(b, out, q, kv, md, a, workspace, run0, q0);
            run0 = q1;
        }
    }
    if (run0 < n) mla_absorbed_range(b, out, q, kv, md, a, workspace, run0, n);
}
