// DeepSeek Sparse Attention's lightning indexer on CUDA (backend.h "---- DSA ----"; the CPU
// reference is src/backend/cpu/cpu_dsa.c, tests/gpu/test_cuda_dsa.c compares the two). Written and
// compiled; caps.dsa stays false (models are refused at load) until that test has passed on a GPU.
//
// dsa_write_kernel: grid (token). RoPE (sincosf of pos * inv_freq, pairs or halves) of the first
//   `rope` dims of every indexer query head in place, and for a real slot the key
//   rope(LayerNorm(ik) * w + b) in the cache dtype (BF16, or FP8 E4M3 as value / v_scale).
// dsa_topk_kernel: grid (token), DSA_TB threads, the token's query heads (IH x ID f32) and head
//   weights in shared memory. A thread scores one key at a time (IH dot products of ID, relu,
//   weighted sum, fp32). The k-th best score is found without a score buffer by a radix select
//   over the scores' order-preserving u32 keys, 8 bits per pass (4 passes, a 256-bin shared
//   histogram; each pass rescores the keys, the same arithmetic so the same floats), then one more
//   pass emits, in ascending position order (block-wide prefix counts), every key above the k-th
//   score and the lowest-positioned ones equal to it. Contexts of at most topk keys take them all.
//   Cost: 5 x IH x ID MACs per (token, key): a correct baseline, not the fast indexer (that one
//   keeps FP8 keys, scores with tensor cores and selects from a buffered score row).
// Every bound comes from the device positions / block tables, so decode launches are graph-safe.
#include "backend/cuda/cuda_common.cuh"

#include <math.h>
#include <type_traits>

#define DSA_TB 256

template <typename C> __device__ __forceinline__ float dsa_cache_f32(C v, float scale);
template <> __device__ __forceinline__ float dsa_cache_f32<__nv_bfloat16>(__nv_bfloat16 v, float) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float dsa_cache_f32<__nv_fp8_e4m3>(__nv_fp8_e4m3 v, float scale) {
    return (float)v * scale;
}
template <typename C> __device__ __forceinline__ C dsa_cache_from(float v, float inv_scale);
template <> __device__ __forceinline__ __nv_bfloat16 dsa_cache_from<__nv_bfloat16>(float v, float) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 dsa_cache_from<__nv_fp8_e4m3>(float v, float inv_scale) {
    return __nv_fp8_e4m3(v * inv_scale);
}

__device__ __forceinline__ float dsa_param(const void *p, bool f32, int i) {
    return f32 ? ((const float *)p)[i] : __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

// Block-wide sum of v (all threads get it); red holds 32 floats.
__device__ __forceinline__ float dsa_block_sum(float v, float *red) {
    v = warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++)
        s += red[i];
    return s;
}

template <typename C>
__global__ void __launch_bounds__(256)
    dsa_write_kernel(__nv_bfloat16 *iq, const __nv_bfloat16 *ik, const void *nw, const void *nb, bool norm_f32,
                     float eps, int IH, int D, int R, const float *inv_freq, float af, bool inter,
                     const int32_t *positions, const int32_t *slot_mapping, C *cache, float inv_scale) {
    pdl_begin();
    __shared__ float red[32];
    extern __shared__ float krow[]; // (D)
    const int t = blockIdx.x, half = R / 2;
    const float pos = (float)positions[t];
    for (int idx = threadIdx.x; idx < IH * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        __nv_bfloat16 *row = iq + ((size_t)t * IH + h) * D;
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
    if (slot < 0) return; // uniform over the block
    const __nv_bfloat16 *src = ik + (size_t)t * D;
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        s += __bfloat162float(src[i]);
    const float mean = dsa_block_sum(s, red) / (float)D;
    float v = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float d = __bfloat162float(src[i]) - mean;
        v += d * d;
    }
    const float inv = rsqrtf(dsa_block_sum(v, red) / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        krow[i] = (__bfloat162float(src[i]) - mean) * inv * dsa_param(nw, norm_f32, i) + dsa_param(nb, norm_f32, i);
    __syncthreads();
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        cs *= af;
        sn *= af;
        const int i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + half;
        const float a = krow[i0], b = krow[i1];
        krow[i0] = a * cs - b * sn;
        krow[i1] = b * cs + a * sn;
    }
    __syncthreads();
    C *dst = cache + (size_t)slot * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        dst[i] = dsa_cache_from<C>(krow[i], inv_scale);
}

// The sequence owning token t (query_start ascending, n_seqs + 1 entries).
__device__ __forceinline__ int dsa_seq_of(const int32_t *query_start, int n_seqs, int t) {
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

// Order-preserving map of a float to u32 (larger float -> larger key).
__device__ __forceinline__ uint32_t dsa_key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <typename C>
__device__ __forceinline__ float dsa_score(const float *sq, const float *sw, const C *cache, float k_scale,
                                           const int32_t *bt, int bs, int j, int IH, int D, float qscale) {
    const C *k = cache + ((size_t)bt[j / bs] * bs + j % bs) * D;
    float sc = 0.f;
    for (int h = 0; h < IH; h++) {
        const float *qh = sq + (size_t)h * D;
        float dot = 0.f;
        for (int d = 0; d < D; d++)
            dot += qh[d] * dsa_cache_f32<C>(k[d], k_scale);
        dot *= qscale;
        if (dot > 0.f) sc += sw[h] * dot;
    }
    return sc;
}

// Exclusive prefix of flag over the block (in thread order) and the block total.
__device__ __forceinline__ int dsa_block_scan(int flag, int *wcount, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned m = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(m & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) wcount[warp] = __popc(m);
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nw; w++) {
        if (w < warp) before += wcount[w];
        all += wcount[w];
    }
    *total = all;
    return before + in_warp;
}

template <typename C>
__global__ void __launch_bounds__(DSA_TB)
    dsa_topk_kernel(int32_t *topk, const __nv_bfloat16 *iq, const __nv_bfloat16 *w, const C *cache, float k_scale,
                    const int32_t *positions, const int32_t *query_start, const int32_t *block_tables, int max_blocks,
                    int n_seqs, int bs, int IH, int D, int K) {
    pdl_begin();
    extern __shared__ float sm[];
    float *sq = sm, *sw = sm + (size_t)IH * D;
    __shared__ unsigned hist[256];
    __shared__ int wcount[DSA_TB / 32];
    __shared__ uint32_t s_prefix;
    __shared__ int s_need;
    const int t = blockIdx.x;
    const int s = dsa_seq_of(query_start, n_seqs, t);
    const int n = positions[t] + 1; // keys 0..pos
    int32_t *out = topk + (size_t)t * K;
    if (n <= K) { // all of them
        for (int j = threadIdx.x; j < K; j += blockDim.x)
            out[j] = j < n ? j : -1;
        return;
    }
    for (int i = threadIdx.x; i < IH * D; i += blockDim.x)
        sq[i] = __bfloat162float(iq[(size_t)t * IH * D + i]);
    const float wscale = rsqrtf((float)IH), qscale = rsqrtf((float)D);
    for (int i = threadIdx.x; i < IH; i += blockDim.x)
        sw[i] = __bfloat162float(w[(size_t)t * IH + i]) * wscale;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = K;
    }
    __syncthreads();
    const int32_t *bt = block_tables + (size_t)s * max_blocks;
    // Radix select of the K-th largest key, 8 bits per pass from the top.
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            hist[i] = 0;
        __syncthreads();
        const uint32_t prefix = s_prefix;
        const uint32_t hi_mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const uint32_t u = dsa_key(dsa_score<C>(sq, sw, cache, k_scale, bt, bs, j, IH, D, qscale));
            if ((u & hi_mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int need = s_need, b = 255;
            for (; b > 0; b--) {
                if ((int)hist[b] >= need) break;
                need -= (int)hist[b];
            }
            s_need = need; // how many of the keys in bin b (at this digit) are still to take
            s_prefix = prefix | ((uint32_t)b << shift);
        }
        __syncthreads();
    }
    const uint32_t thr = s_prefix; // the K-th largest key; take every key above, s_need equal to it
    const int need_eq = s_need;
    int written = 0, eq_taken = 0;
    for (int j0 = 0; j0 < n; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        uint32_t u = 0;
        if (j < n) u = dsa_key(dsa_score<C>(sq, sw, cache, k_scale, bt, bs, j, IH, D, qscale));
        int n_eq = 0;
        const int eq_before = dsa_block_scan(j < n && u == thr, wcount, &n_eq);
        const bool take = j < n && (u > thr || (u == thr && eq_taken + eq_before < need_eq));
        int n_take = 0;
        const int before = dsa_block_scan(take, wcount, &n_take);
        if (take) out[written + before] = j;
        written += n_take;
        eq_taken += n_eq;
    }
    for (int i = written + threadIdx.x; i < K; i += blockDim.x)
        out[i] = -1;
}

void cuda_op_dsa_index_write(struct backend *b, struct tensor *iq, const struct tensor *ik, const struct tensor *norm_w,
                             const struct tensor *norm_b, const struct rope_args *rope, const struct dsa_args *a,
                             struct kv_layer *kv, const struct attn_metadata *md) {
    const int n = md->n_tokens, D = a->head_dim, R = a->rope;
    CHECK(iq->dtype == DTYPE_BF16 && ik->dtype == DTYPE_BF16 && R <= D && R % 2 == 0);
    CHECK(norm_w->dtype == norm_b->dtype && (norm_w->dtype == DTYPE_BF16 || norm_w->dtype == DTYPE_F32));
    CHECK(tensor_numel(norm_w) == D && tensor_numel(norm_b) == D);
    CHECK(kv->v.ndim == 4 && kv->v.ne[2] == 1 && kv->v.ne[3] == D);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    auto launch = [&](auto *cache, float inv) {
        using C = std::remove_pointer_t<decltype(cache)>;
        pdl_launch(dsa_write_kernel<C>, dim3((unsigned)n), 256, (size_t)D * sizeof(float), s, (__nv_bfloat16 *)iq->data,
                   (const __nv_bfloat16 *)ik->data, (const void *)norm_w->data, (const void *)norm_b->data,
                   norm_w->dtype == DTYPE_F32, a->norm_eps, a->n_heads, D, R, rope->inv_freq, rope->attn_factor,
                   a->rope_interleaved, md->positions, md->slot_mapping, cache, inv);
    };
    if (kv->v.dtype == DTYPE_BF16)
        launch((__nv_bfloat16 *)kv->v.data, 1.f);
    else if (kv->v.dtype == DTYPE_FP8_E4M3)
        launch((__nv_fp8_e4m3 *)kv->v.data, 1.f / kv->v_scale);
    else
        CHECK_MSG(0, "CUDA DSA key cache dtype %s unsupported (BF16 or FP8_E4M3)", dtype_name(kv->v.dtype));
    CUDA_CHECK_LAUNCH();
}

void cuda_op_dsa_topk(struct backend *b, int32_t *topk, const struct tensor *iq, const struct tensor *w,
                      const struct kv_layer *kv, const struct attn_metadata *md, const struct dsa_args *a) {
    const int n = md->n_tokens, IH = a->n_heads, D = a->head_dim;
    CHECK(iq->dtype == DTYPE_BF16 && w->dtype == DTYPE_BF16 && a->topk > 0);
    CHECK(kv->v.ndim == 4 && kv->v.ne[3] == D && kv->v.ne[1] == md->block_size);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    const size_t smem = ((size_t)IH * D + (size_t)IH) * sizeof(float);
    auto launch = [&](auto *cache, float scale) {
        using C = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
        auto kern = dsa_topk_kernel<C>;
        if (smem > 48 * 1024)
            CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        pdl_launch(kern, dim3((unsigned)n), DSA_TB, smem, s, topk, (const __nv_bfloat16 *)iq->data,
                   (const __nv_bfloat16 *)w->data, (const C *)cache, scale, md->positions, md->query_start,
                   md->block_tables, attn_md_table_stride(md), md->n_seqs, md->block_size, IH, D, a->topk);
    };
    if (kv->v.dtype == DTYPE_BF16)
        launch((const __nv_bfloat16 *)kv->v.data, 1.f);
    else if (kv->v.dtype == DTYPE_FP8_E4M3)
        launch((const __nv_fp8_e4m3 *)kv->v.data, kv->v_scale);
    else
        CHECK_MSG(0, "CUDA DSA key cache dtype %s unsupported", dtype_name(kv->v.dtype));
    CUDA_CHECK_LAUNCH();
}
