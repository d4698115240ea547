// Device building blocks of the quantized matmuls (cuda_qmatmul.cu) and quantized MoE experts
// (cuda_moe_quant.cu): reading quantized weight rows (with zero points and a column -> group
// map where the weight has them) and (quantized) activation rows as f32, and the dynamic and
// static activation quantization of core/weight.h.
//
// Every value a product multiplies is formed exactly as the CPU reference forms it
// (cpu_qmatmul.c): a weight is f32(q) * scale (one f32 multiply; FP8 and the integers convert
// to f32 exactly), an activation is bf16 -> f32, or f32(xq) * s for quantized activations; the
// products are accumulated with fp32 FMAs. So a GEMV result differs from the CPU's only by fp32
// summation order. The activation quantization (act_quant_*) computes the same bytes and scales
// as act_quant_row: amax / 448 (127) with an IEEE division, x / s with an IEEE division (nvcc
// without fast-math), e4m3 round-to-nearest-even with saturation, rint for INT8.
#ifndef ATOMC_BACKEND_CUDA_QDOT_CUH
#define ATOMC_BACKEND_CUDA_QDOT_CUH

#include "backend/cuda/cuda_common.cuh"

// Weight value formats and scale layouts (struct weight, core/weight.h).
enum qw_fmt { QW_FP8 = 0, QW_INT4, QW_INT8 };
enum qs_mode { QS_TENSOR = 0, QS_CHANNEL, QS_BLOCK, QS_GROUP };
// Activation formats as the kernels read them.
enum qa_fmt { QA_BF16 = 0, QA_F32, QA_FP8, QA_INT8 };

// A quantized weight (rows m, columns k) as kernels see it; expert e of a stacked weight is at
// q + e * e_bytes, its scales at s + e * e_scales.
struct qw_view {
    const uint8_t *q;
    const float *s;
    const float *z;      // GROUP zero points in s's layout (NULL: none); w = (q - z) * s
    const int32_t *gidx; // GROUP column -> group map (k; NULL: col / bc); 2-D weights only
    int64_t m, k;
    int64_t row_bytes;          // bytes of one row of values
    int64_t s_cols;             // scale columns (BLOCK / GROUP)
    int64_t e_bytes, e_scales;  // per-expert strides (0 for a single weight)
    int br, bc;                 // BLOCK: br x bc; GROUP: 1 x bc
    int mode;                   // qs_mode
};

// An activation matrix (rows, k): bf16 / f32 values, or quantized bytes with scales.
// Scales: per row s[row] (one group), or per 128-column group s[g * s_ld + row].
struct qa_view {
    const void *x;
    const float *s;
    int64_t k;
    int64_t s_ld;  // 0: one scale per row
};

// The index of the scale (and zero point) of (row, col) in the weight's scale array.
__device__ __forceinline__ int64_t qw_sidx(const struct qw_view &w, int64_t row, int64_t col) {
    switch (w.mode) {
    case QS_TENSOR:
        return 0;
    case QS_CHANNEL:
        return row;
    case QS_BLOCK:
        return (row / w.br) * w.s_cols + col / w.bc;
    default:
        return row * w.s_cols + (w.gidx ? (int64_t)__ldg(w.gidx + col) : col / w.bc);
    }
}

__device__ __forceinline__ float qw_scale(const struct qw_view &w, const float *s, int64_t row, int64_t col) {
    return s[qw_sidx(w, row, col)];
}

// A raw value (q) of (row, col) made a weight: (q - z) * s, z = 0 without zero points (q and z are
// small integers: q - z is exact, then one rounding, as the CPU's).
__device__ __forceinline__ float qw_apply(const struct qw_view &w, const float *s, const float *z, int64_t row,
                                          int64_t col, float q) {
    const int64_t i = qw_sidx(w, row, col);
    return (z ? q - z[i] : q) * s[i];
}

__device__ __forceinline__ float fp8_byte_to_f32(uint32_t b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

// Raw values (no scale) of weight row `row` at columns c .. c + 15 (c % 16 == 0; the row's
// bytes at that point 16-byte (FP8 / INT8) or 8-byte (INT4) aligned).
template <int FMT> __device__ __forceinline__ void qw_raw16(const uint8_t *rowp, int64_t c, float (&v)[16]) {
    if constexpr (FMT == QW_FP8) {
        uint4 u = ld_stream16(rowp + c);
        const uint32_t w4[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w4[i] & 0xffffu), __NV_E4M3);
            __half2_raw h1 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w4[i] >> 16), __NV_E4M3);
            float2 f0 = __half22float2(__half2(h0)), f1 = __half22float2(__half2(h1));
            v[4 * i] = f0.x;
            v[4 * i + 1] = f0.y;
            v[4 * i + 2] = f1.x;
            v[4 * i + 3] = f1.y;
        }
    } else if constexpr (FMT == QW_INT4) {
        uint2 u = __ldg(reinterpret_cast<const uint2 *>(rowp + c / 2));
        const uint32_t w2[2] = {u.x, u.y};
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                v[8 * i + j] = (float)((int)((w2[i] >> (4 * j)) & 15u) - 8);
    } else {
        uint4 u = ld_stream16(rowp + c);
        const uint32_t w4[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[4 * i + j] = (float)((int)((w4[i] >> (8 * j)) & 255u) - 128);
    }
}

// One raw value of a weight row at column c.
template <int FMT> __device__ __forceinline__ float qw_raw1(const uint8_t *rowp, int64_t c) {
    if constexpr (FMT == QW_FP8) {
        return fp8_byte_to_f32(rowp[c]);
    } else if constexpr (FMT == QW_INT4) {
        uint32_t u = reinterpret_cast<const uint32_t *>(rowp)[c / 8];
        return (float)((int)((u >> (4 * (c % 8))) & 15u) - 8);
    } else {
        uint32_t u = reinterpret_cast<const uint32_t *>(rowp)[c / 4];
        return (float)((int)((u >> (8 * (c % 4))) & 255u) - 128);
    }
}

__device__ __forceinline__ float qa_scale(const struct qa_view &a, int64_t row, int64_t c) {
    return a.s_ld ? a.s[(c / ACT_QUANT_GROUP) * a.s_ld + row] : a.s[row];
}

// Activation row `row` at columns c .. c + 15 as f32 (c % 16 == 0, 16-byte aligned rows).
template <int AF> __device__ __forceinline__ void qa_load16(const struct qa_view &a, int64_t row, int64_t c,
                                                           float (&v)[16]) {
    if constexpr (AF == QA_BF16) {
        const __nv_bfloat16 *p = (const __nv_bfloat16 *)a.x + row * a.k + c;
        float f[8];
        bf16x8_to_f32(__ldg(reinterpret_cast<const uint4 *>(p)), f);
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = f[i];
        bf16x8_to_f32(__ldg(reinterpret_cast<const uint4 *>(p + 8)), f);
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[8 + i] = f[i];
    } else if constexpr (AF == QA_F32) {
        const float4 *p = reinterpret_cast<const float4 *>((const float *)a.x + row * a.k + c);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 f = __ldg(p + i);
            v[4 * i] = f.x;
            v[4 * i + 1] = f.y;
            v[4 * i + 2] = f.z;
            v[4 * i + 3] = f.w;
        }
    } else {
        const float s = qa_scale(a, row, c); // a 16-column chunk never straddles a 128-column group
        uint4 u = __ldg(reinterpret_cast<const uint4 *>((const uint8_t *)a.x + row * a.k + c));
        const uint32_t w4[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint32_t b = (w4[i] >> (8 * j)) & 255u;
                float q = AF == QA_FP8 ? fp8_byte_to_f32(b) : (float)(int8_t)b;
                v[4 * i + j] = q * s;
            }
    }
}

template <int AF> __device__ __forceinline__ float qa_load1(const struct qa_view &a, int64_t row, int64_t c) {
    if constexpr (AF == QA_BF16) {
        return __bfloat162float(((const __nv_bfloat16 *)a.x)[row * a.k + c]);
    } else if constexpr (AF == QA_F32) {
        return ((const float *)a.x)[row * a.k + c];
    } else {
        uint32_t b = ((const uint8_t *)a.x)[row * a.k + c];
        float q = AF == QA_FP8 ? fp8_byte_to_f32(b) : (float)(int8_t)b;
        return q * qa_scale(a, row, c);
    }
}

// One lane's partial dot products of weight row `wrow` (of w, expert base wq / ws) with
// activation rows xr[0 .. nr) (nr <= NR) over the columns this lane owns: 16-column chunks
// lane * 16 + 512 i when `vec`, the rest (or everything) one column at a time.
template <int FMT, int AF, int NR>
__device__ __forceinline__ void qdot_lane(float (&acc)[NR], const struct qw_view &w, const uint8_t *wq,
                                          const float *ws, int64_t wrow, const struct qa_view &a,
                                          const int64_t (&xr)[NR], int nr, bool vec, int lane) {
    const uint8_t *rowp = wq + wrow * w.row_bytes;
    const int64_t k = w.k;
    const float *wz = w.z ? w.z + (ws - w.s) : nullptr; // this expert's zero points (scale's layout)
    // One scale per 16-column chunk unless blocks / groups are narrower or unaligned, or mapped.
    const bool chunk_scale = w.mode == QS_TENSOR || w.mode == QS_CHANNEL || (w.bc % 16 == 0 && !w.gidx);
    int64_t vend = vec ? k / 16 * 16 : 0;
    for (int64_t c = (int64_t)lane * 16; c < vend; c += 32 * 16) {
        float wv[16];
        qw_raw16<FMT>(rowp, c, wv);
        if (chunk_scale) {
            const int64_t si = qw_sidx(w, wrow, c);
            const float s = ws[si], z = wz ? wz[si] : 0.f;
#pragma unroll
            for (int i = 0; i < 16; i++)
                wv[i] = (wz ? wv[i] - z : wv[i]) * s;
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                wv[i] = qw_apply(w, ws, wz, wrow, c + i, wv[i]);
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= nr) break;
            float xv[16];
            qa_load16<AF>(a, xr[r], c, xv);
#pragma unroll
            for (int i = 0; i < 16; i++)
                acc[r] = fmaf(wv[i], xv[i], acc[r]);
        }
    }
    for (int64_t c = vend + lane; c < k; c += 32) {
        const float wf = qw_apply(w, ws, wz, wrow, c, qw_raw1<FMT>(rowp, c));
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= nr) break;
            acc[r] = fmaf(wf, qa_load1<AF>(a, xr[r], c), acc[r]);
        }
    }
}

// True when the 16-column vector path may be used for a weight and activation layout.
static inline bool qdot_vec_ok(int fmt, int af, const void *wq, int64_t row_bytes, int64_t e_bytes, const void *x,
                               int64_t k) {
    const int64_t wal = fmt == QW_INT4 ? 8 : 16;
    const int64_t xbytes = af == QA_BF16 ? 2 : af == QA_F32 ? 4 : 1;
    return k % 16 == 0 && (uintptr_t)wq % (uintptr_t)wal == 0 && row_bytes % wal == 0 && e_bytes % wal == 0 &&
           (uintptr_t)x % 16 == 0 && (k * xbytes) % 16 == 0;
}

// ---- Dynamic activation quantization (core/weight.h) ----

__device__ __forceinline__ uint8_t act_quant_byte(float v, bool int8, float qmin = -127.0f) {
    if (int8) {
        float r = isnan(v) ? 0.0f : rintf(v);
        r = fminf(fmaxf(r, qmin), 127.0f);
        return (uint8_t)(int8_t)r;
    }
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float act_dequant_byte(uint8_t b, bool int8, float s) {
    return (int8 ? (float)(int8_t)b : fp8_byte_to_f32(b)) * s;
}

// q (n_pad, k) bytes and scales of x (n, k) (T = bf16 or f32, row stride k): one block of
// QUANT_THREADS per row. GROUP = true: a scale per 128-column group at s[g * s_ld + row];
// else one per row at s[row] (INT8 or FP8 by `int8`). Rows n .. n_pad - 1 get zeros and
// scale 1 (padding the cuBLASLt block-scaled GEMM asks for). deq (optional, bf16 (n, k)):
// the dequantized values rounded to bf16, for the GEMM fallback. static_s > 0: static activations,
// every row's scale is static_s (no amax; INT8 then reaches -128, compressed-tensors' range).
#define QUANT_THREADS 256
template <typename T, bool GROUP>
__global__ void __launch_bounds__(QUANT_THREADS)
    act_quant_kernel(uint8_t *q, float *s, __nv_bfloat16 *deq, const T *x, int64_t n, int64_t k, int64_t s_ld,
                     bool int8, float static_s) {
    pdl_begin();
    const int64_t row = blockIdx.x;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float qmax = int8 ? ACT_QUANT_INT8_MAX : ACT_QUANT_FP8_MAX;
    uint8_t *qr = q + row * k;
    if (row >= n) { // padding row
        for (int64_t c = threadIdx.x; c < k; c += QUANT_THREADS)
            qr[c] = 0;
        if (GROUP)
            for (int64_t g = threadIdx.x; g * ACT_QUANT_GROUP < k; g += QUANT_THREADS)
                s[g * s_ld + row] = 1.0f;
        else if (threadIdx.x == 0)
            s[row] = 1.0f;
        return;
    }
    const T *xr = x + row * k;
    if (GROUP) { // a warp per group of 128 columns, 4 per lane
        const int64_t ng = (k + ACT_QUANT_GROUP - 1) / ACT_QUANT_GROUP;
        for (int64_t g = warp; g < ng; g += QUANT_THREADS / 32) {
            float v[4], amax = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int64_t c = g * ACT_QUANT_GROUP + lane * 4 + j;
                v[j] = c < k ? to_f32(xr[c]) : 0.f;
                amax = fmaxf(amax, fabsf(v[j]));
            }
            amax = warp_max(amax);
            float sc = amax / qmax;
            if (!(sc > 0.f)) sc = 1.f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int64_t c = g * ACT_QUANT_GROUP + lane * 4 + j;
                if (c < k) {
                    uint8_t b = act_quant_byte(v[j] / sc, int8);
                    qr[c] = b;
                    if (deq) deq[row * k + c] = __float2bfloat16_rn(act_dequant_byte(b, int8, sc));
                }
            }
            if (lane == 0) s[g * s_ld + row] = sc;
        }
    } else if (static_s > 0.f) {
        const float qmin = int8 ? -128.0f : -127.0f;
        for (int64_t c = threadIdx.x; c < k; c += QUANT_THREADS) {
            uint8_t b = act_quant_byte(to_f32(xr[c]) / static_s, int8, qmin);
            qr[c] = b;
            if (deq) deq[row * k + c] = __float2bfloat16_rn(act_dequant_byte(b, int8, static_s));
        }
        if (threadIdx.x == 0) s[row] = static_s;
    } else {
        __shared__ float red[QUANT_THREADS / 32];
        float amax = 0.f;
        for (int64_t c = threadIdx.x; c < k; c += QUANT_THREADS)
            amax = fmaxf(amax, fabsf(to_f32(xr[c])));
        amax = warp_max(amax);
        if (lane == 0) red[warp] = amax;
        __syncthreads();
        amax = 0.f;
#pragma unroll
        for (int i = 0; i < QUANT_THREADS / 32; i++)
            amax = fmaxf(amax, red[i]);
        float sc = amax / qmax;
        if (!(sc > 0.f)) sc = 1.f;
        for (int64_t c = threadIdx.x; c < k; c += QUANT_THREADS) {
            uint8_t b = act_quant_byte(to_f32(xr[c]) / sc, int8);
            qr[c] = b;
            if (deq) deq[row * k + c] = __float2bfloat16_rn(act_dequant_byte(b, int8, sc));
        }
        if (threadIdx.x == 0) s[row] = sc;
    }
}

// Shared host helpers (cuda_qmatmul.cu).
struct qw_view cuda_qw_view(const struct weight *w);
int cuda_qw_fmt(const struct weight *w);
int cuda_qa_fmt(const struct weight *w);
void *cuda_qmm_scratch(struct cuda_backend *cb, size_t need);
void cuda_act_quant(cudaStream_t s, enum weight_act act, float static_scale, uint8_t *q, float *sc,
                    __nv_bfloat16 *deq, const void *x, bool x_f32, int64_t n, int64_t n_pad, int64_t k, int64_t s_ld);

#endif
