// Fused RoPE + paged KV-cache write (and, for Qwen3, the per-head q/k RMSNorm: see
// qk_norm_rope_kv_kernel below): grid (token, item block). Each thread rotates one (i,
// i + half) pair of a q or k head (sincosf of pos * inv_freq, f32, like the CPU reference) in
// place, or copies one k / v element; k and v land at the token's slot of the paged cache,
// quantised to FP8 E4M3 (value / scale) when the cache is FP8.
// Padding tokens (slot -1) are rotated but not stored. Metadata comes from device arrays,
// so the launch is graph-capture safe.
#include "backend/cuda/cuda_common.cuh"

#include <type_traits>

template <typename C> __device__ __forceinline__ C cache_from_f32(float v, float inv_scale);
template <> __device__ __forceinline__ __nv_bfloat16 cache_from_f32<__nv_bfloat16>(float v, float) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 cache_from_f32<__nv_fp8_e4m3>(float v, float inv_scale) {
    return __nv_fp8_e4m3(v * inv_scale); // saturating conversion (satfinite)
}

// Work items of one token, in this order: q rotation pairs (hq * half), k rotation pairs
// (hk * half, each also stores its two rotated elements), k elements past rotary_dim (partial
// rotary: copied to the cache unrotated), v elements (hk * dv). Every item is independent, so
// a token's items spread over grid.y blocks (a batch-1 decode step runs ~14 blocks instead of
// one), and each thread recomputes its own sincosf (exact, as the CPU reference).
template <typename T, typename C>
__global__ void __launch_bounds__(256)
    rope_kv_write_kernel(T *q, T *k, const T *v, int64_t q_stride, int64_t k_stride, int64_t v_stride, int hq, int hk,
                         int hd, int dv, const float *inv_freq, int rotary_dim, float attn_factor, bool interleaved,
                         const int32_t *positions, const int32_t *slot_mapping, C *kc, C *vc, float k_inv,
                         float v_inv) {
    pdl_begin();
    const int t = blockIdx.x;
    const int half = rotary_dim / 2, pass = hd - rotary_dim;
    const int nq = q ? hq * half : 0, nk = hk * half, np = hk * pass, nv = hk * dv;
    const int total = nq + nk + np + nv;
    const int32_t slot = slot_mapping[t];
    const float pos = (float)positions[t];
    for (int idx = blockIdx.y * blockDim.x + threadIdx.x; idx < total; idx += gridDim.y * blockDim.x) {
        if (idx < nq + nk) {
            const bool is_q = idx < nq;
            const int j = is_q ? idx : idx - nq, h = j / half, i = j % half;
            T *row = is_q ? q + (size_t)t * q_stride + (size_t)h * hd : k + (size_t)t * k_stride + (size_t)h * hd;
            float sn, cs;
            sincosf(pos * inv_freq[i], &sn, &cs);
            cs *= attn_factor;
            sn *= attn_factor;
            const int i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
            const float a = to_f32(row[i0]), c = to_f32(row[i1]);
            const T r0 = from_f32<T>(a * cs - c * sn), r1 = from_f32<T>(c * cs + a * sn);
            row[i0] = r0;
            row[i1] = r1;
            if (!is_q && slot >= 0) {
                C *dst = kc + (size_t)slot * hk * hd + (size_t)h * hd;
                dst[i0] = cache_from_f32<C>(to_f32(r0), k_inv);
                dst[i1] = cache_from_f32<C>(to_f32(r1), k_inv);
            }
        } else if (slot < 0) {
            break; // padding token: nothing left to do (only stores follow)
        } else if (idx < nq + nk + np) {
            const int j = idx - nq - nk, h = j / pass, d = rotary_dim + j % pass;
            kc[(size_t)slot * hk * hd + (size_t)h * hd + d] =
                cache_from_f32<C>(to_f32(k[(size_t)t * k_stride + (size_t)h * hd + d]), k_inv);
        } else {
            const int j = idx - nq - nk - np, h = j / dv, d = j % dv;
            vc[(size_t)slot * hk * dv + j] =
                cache_from_f32<C>(to_f32(v[(size_t)t * v_stride + (size_t)h * dv + d]), v_inv);
        }
    }
}

// With Qwen3's per-head q/k RMSNorm (rope_args q_norm / k_norm): one warp per head unit of a
// token (q heads, k heads, then v heads, which are only stored). A q/k warp loads its head into
// shared memory, normalises it (fp32 sum of squares, rsqrtf, times the weight, rounded to bf16
// exactly as the rmsnorm op stores it), then rotates it and writes it back (k also to the
// cache). The block computes its token's cos/sin table once (the pair kernel above recomputes
// sincosf per head). One launch instead of the rmsnorm + rmsnorm + RoPE of the unfused path.
#define QKN_WARPS 8
#define QKN_MAX_HD CUDA_QKN_MAX_HD

__device__ __forceinline__ float norm_weight(const void *w, bool f32, int j) {
    return f32 ? static_cast<const float *>(w)[j] : __bfloat162float(static_cast<const __nv_bfloat16 *>(w)[j]);
}

template <typename T, typename C>
__global__ void __launch_bounds__(32 * QKN_WARPS)
    qk_norm_rope_kv_kernel(T *q, T *k, const T *v, int64_t q_stride, int64_t k_stride, int64_t v_stride, int hq, int hk,
                           int hd, int dv, const float *inv_freq, int rotary_dim, float attn_factor, bool interleaved,
                           const void *qw, bool qw_f32, const void *kw, bool kw_f32, float eps,
                           const int32_t *positions, const int32_t *slot_mapping, C *kc, C *vc, float k_inv,
                           float v_inv) {
    pdl_begin();
    __shared__ float cs_[QKN_MAX_HD / 2], sn_[QKN_MAX_HD / 2];
    __shared__ float xs[QKN_WARPS][QKN_MAX_HD];
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = rotary_dim / 2;
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        cs_[i] = cs * attn_factor;
        sn_[i] = sn * attn_factor;
    }
    __syncthreads();
    const int nq = q ? hq : 0, u = blockIdx.y * QKN_WARPS + warp;
    if (u >= nq + 2 * hk) return;
    const int32_t slot = slot_mapping[t];
    if (u >= nq + hk) { // a v head: only stored
        if (slot < 0) return;
        const int h = u - nq - hk;
        for (int j = lane; j < dv; j += 32)
            vc[((size_t)slot * hk + h) * dv + j] =
                cache_from_f32<C>(to_f32(v[t * v_stride + (int64_t)h * dv + j]), v_inv);
        return;
    }
    const bool is_q = u < nq;
    const int h = is_q ? u : u - nq;
    T *row = is_q ? q + t * q_stride + (int64_t)h * hd : k + t * k_stride + (int64_t)h * hd;
    const void *w = is_q ? qw : kw;
    const bool wf = is_q ? qw_f32 : kw_f32;
    float *x = xs[warp];
    float ss = 0.f;
    for (int j = lane; j < hd; j += 32) {
        const float a = to_f32(row[j]);
        x[j] = a;
        ss += a * a;
    }
    if (w) {
        const float r = rsqrtf(warp_sum(ss) / (float)hd + eps);
        for (int j = lane; j < hd; j += 32)
            x[j] = to_f32(from_f32<T>(x[j] * r * norm_weight(w, wf, j)));
    }
    __syncwarp();
    for (int j = lane; j < hd; j += 32) {
        float o = x[j];
        if (j < rotary_dim) {
            const bool first = interleaved ? j % 2 == 0 : j < half;
            const int i = interleaved ? j / 2 : first ? j : j - half;
            const int pj = interleaved ? (first ? j + 1 : j - 1) : (first ? j + half : j - half);
            o = first ? x[j] * cs_[i] - x[pj] * sn_[i] : x[j] * cs_[i] + x[pj] * sn_[i];
        }
        const T ot = from_f32<T>(o);
        row[j] = ot; // the other lanes read the head from x, not from row
        if (!is_q && slot >= 0) kc[((size_t)slot * hk + h) * hd + j] = cache_from_f32<C>(to_f32(ot), k_inv);
    }
}

typedef __nv_bfloat16 T;

void cuda_op_rope_kv_write(struct backend *b, struct tensor *q, struct tensor *k, const struct tensor *v,
                           int64_t row_stride, const struct rope_args *rope, struct kv_layer *kv,
                           const struct attn_metadata *md) {
    // q may be NULL (rotate and store k only); v's head dim may differ from k's.
    CHECK(k->ndim == 3 && v->ndim == 3);
    int n = (int)k->ne[0], hk = (int)k->ne[1], hd = (int)k->ne[2], dv = (int)v->ne[2];
    int hq = q ? (int)q->ne[1] : 0;
    CHECK(!q || (q->ndim == 3 && q->ne[0] == n && q->ne[2] == hd && q->dtype == DTYPE_BF16));
    CHECK(v->ne[0] == n && v->ne[1] == hk && k->dtype == DTYPE_BF16 && v->dtype == DTYPE_BF16);
    CHECK(rope->rotary_dim >= 0 && rope->rotary_dim % 2 == 0 && rope->rotary_dim <= hd);
    CHECK(kv->k.dtype == kv->v.dtype && kv->k.ndim == 4 && kv->k.ne[2] == hk && kv->k.ne[3] == hd && kv->v.ne[3] == dv);
    if (n == 0) return;
    int64_t qs = row_stride ? row_stride : (int64_t)hq * hd;
    int64_t ks = row_stride ? row_stride : (int64_t)hk * hd;
    int64_t vs = row_stride ? row_stride : (int64_t)hk * dv;
    T *qp = q ? (T *)q->data : nullptr;
    cudaStream_t s = cuda_impl(b)->stream;
    const struct tensor *qn = q ? rope->q_norm : NULL, *kn = rope->k_norm;
    if (qn || kn) {
        CHECK_MSG(hd <= QKN_MAX_HD, "rope_kv_write: q/k norm needs head_dim <= %d (got %d)", QKN_MAX_HD, hd);
        for (const struct tensor *w : {qn, kn})
            CHECK(!w || (tensor_numel(w) == hd && (w->dtype == DTYPE_F32 || w->dtype == DTYPE_BF16)));
    }
    // One launch for cache element type C (BF16, or FP8 E4M3 stored as value / scale).
    auto launch = [&](auto *kc, auto *vc, float k_inv, float v_inv) {
        using C = std::remove_pointer_t<decltype(kc)>;
        if (qn || kn) {
            const dim3 g((unsigned)n, (unsigned)cdiv((q ? hq : 0) + 2 * hk, QKN_WARPS));
            pdl_launch(qk_norm_rope_kv_kernel<T, C>, g, 32 * QKN_WARPS, 0, s, qp, (T *)k->data, (const T *)v->data, qs,
                       ks, vs, hq, hk, hd, dv, rope->inv_freq, rope->rotary_dim, rope->attn_factor, rope->interleaved,
                       qn ? qn->data : nullptr, qn && qn->dtype == DTYPE_F32, kn ? kn->data : nullptr,
                       kn && kn->dtype == DTYPE_F32, rope->norm_eps, md->positions, md->slot_mapping, kc, vc, k_inv,
                       v_inv);
        } else {
            const int items = hq * (rope->rotary_dim / 2) + hk * (hd - rope->rotary_dim / 2) + hk * dv;
            const dim3 grid((unsigned)n, (unsigned)cdiv(items, 256));
            pdl_launch(rope_kv_write_kernel<T, C>, grid, 256, 0, s, qp, (T *)k->data, (const T *)v->data, qs, ks, vs,
                       hq, hk, hd, dv, rope->inv_freq, rope->rotary_dim, rope->attn_factor, rope->interleaved,
                       md->positions, md->slot_mapping, kc, vc, k_inv, v_inv);
        }
    };
    if (kv->k.dtype == DTYPE_BF16)
        launch((__nv_bfloat16 *)kv->k.data, (__nv_bfloat16 *)kv->v.data, 1.f, 1.f);
    else if (kv->k.dtype == DTYPE_FP8_E4M3)
        launch((__nv_fp8_e4m3 *)kv->k.data, (__nv_fp8_e4m3 *)kv->v.data, 1.f / kv->k_scale, 1.f / kv->v_scale);
    else
        CHECK_MSG(0, "CUDA KV cache dtype %s unsupported (BF16 or FP8_E4M3)", dtype_name(kv->k.dtype));
    CUDA_CHECK_LAUNCH();
}
