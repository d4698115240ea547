// Fused RoPE + paged KV-cache write: one block per token. The block computes the token's
// cos/sin table once (rotary_dim / 2 entries, f32, sincosf of pos * inv_freq like the CPU
// reference), rotates q in place and k (also in place), and stores k and v at the token's
// slot of the paged cache, quantised to FP8 E4M3 (value / scale) when the cache is FP8.
// Padding tokens (slot -1) are rotated but not stored. Metadata comes from device arrays,
// so the launch is graph-capture safe.
#include "backend/cuda/cuda_common.cuh"

template <typename C> __device__ __forceinline__ C cache_from_f32(float v, float inv_scale);
template <> __device__ __forceinline__ __nv_bfloat16 cache_from_f32<__nv_bfloat16>(float v, float) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 cache_from_f32<__nv_fp8_e4m3>(float v, float inv_scale) {
    return __nv_fp8_e4m3(v * inv_scale); // saturating conversion (satfinite)
}

// Rotates the head rows [0, nh) of x (token row base pointer) with the cos/sin table; pairs
// are (i, i + half) for NeoX, (2i, 2i+1) interleaved.
template <typename T>
__device__ __forceinline__ void rope_rotate_heads(T *x, int nh, int hd, int half, bool interleaved, const float *cs,
                                                  const float *sn) {
    for (int idx = threadIdx.x; idx < nh * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        T *row = x + (size_t)h * hd;
        int i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
        float a = to_f32(row[i0]), c = to_f32(row[i1]);
        row[i0] = from_f32<T>(a * cs[i] - c * sn[i]);
        row[i1] = from_f32<T>(c * cs[i] + a * sn[i]);
    }
}

template <typename T, typename C>
__global__ void rope_kv_write_kernel(T *q, T *k, const T *v, int64_t q_stride, int64_t k_stride, int64_t v_stride, int hq,
                                     int hk, int hd, int dv,
                                     const float *inv_freq, int rotary_dim, float attn_factor, bool interleaved,
                                     const int32_t *positions, const int32_t *slot_mapping, C *kc, C *vc, float k_inv,
                                     float v_inv) {
    extern __shared__ float tab[]; // cos (half), sin (half)
    int t = blockIdx.x;
    int half = rotary_dim / 2;
    float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        tab[i] = c * attn_factor;
        tab[half + i] = s * attn_factor;
    }
    __syncthreads();
    T *kt = k + (size_t)t * k_stride;
    if (q) rope_rotate_heads(q + (size_t)t * q_stride, hq, hd, half, interleaved, tab, tab + half);
    rope_rotate_heads(kt, hk, hd, half, interleaved, tab, tab + half);
    int32_t slot = slot_mapping[t];
    if (slot < 0) return;
    __syncthreads(); // k rotated by other threads
    const T *vt = v + (size_t)t * v_stride;
    for (int idx = threadIdx.x; idx < hk * hd; idx += blockDim.x) {
        int h = idx / hd, d = idx % hd;
        kc[(size_t)slot * hk * hd + idx] = cache_from_f32<C>(to_f32(kt[(size_t)h * hd + d]), k_inv);
    }
    for (int idx = threadIdx.x; idx < hk * dv; idx += blockDim.x) {
        int h = idx / dv, d = idx % dv;
        vc[(size_t)slot * hk * dv + idx] = cache_from_f32<C>(to_f32(vt[(size_t)h * dv + d]), v_inv);
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
    size_t smem = (size_t)rope->rotary_dim * sizeof(float) + 16;
    if (kv->k.dtype == DTYPE_BF16) {
        rope_kv_write_kernel<T, __nv_bfloat16><<<n, 128, smem, s>>>(
            qp, (T *)k->data, (const T *)v->data, qs, ks, vs, hq, hk, hd, dv, rope->inv_freq, rope->rotary_dim,
            rope->attn_factor, rope->interleaved, md->positions, md->slot_mapping, (__nv_bfloat16 *)kv->k.data,
            (__nv_bfloat16 *)kv->v.data, 1.f, 1.f);
    } else if (kv->k.dtype == DTYPE_FP8_E4M3) {
        rope_kv_write_kernel<T, __nv_fp8_e4m3><<<n, 128, smem, s>>>(
            qp, (T *)k->data, (const T *)v->data, qs, ks, vs, hq, hk, hd, dv, rope->inv_freq, rope->rotary_dim,
            rope->attn_factor, rope->interleaved, md->positions, md->slot_mapping, (__nv_fp8_e4m3 *)kv->k.data,
            (__nv_fp8_e4m3 *)kv->v.data, 1.f / kv->k_scale, 1.f / kv->v_scale);
    } else {
        CHECK_MSG(0, "CUDA KV cache dtype %s unsupported (BF16 or FP8_E4M3)", dtype_name(kv->k.dtype));
    }
    CUDA_CHECK_LAUNCH();
}
