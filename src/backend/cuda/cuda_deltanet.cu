// Gated DeltaNet ops of the CUDA backend (backend.h "Gated DeltaNet"; the CPU reference is
// src/backend/cpu/cpu_deltanet.c, tests/gpu/test_cuda_deltanet.c compares them): the causal
// depthwise conv1d with its per-sequence conv state, the gated delta rule with its per-sequence
// state, the gated RMSNorm and the sigmoid gate. Activations BF16 / F16 / F32, weights BF16 or F32,
// states F32 in the slots md->state_slots names (read on the device: graph-capturable).
//
// deltanet_conv: one thread per (sequence, channel), walking the sequence's new tokens with the
// K - 1 previous inputs in registers (coalesced over channels).
//
// deltanet_rule: one block of DN_THREADS threads per (sequence, value head). The state S (Dk, Dv)
// lives in shared memory for the whole step; the sequence's new tokens are processed in chunks
// of DN_CHUNK (64; decode-only batches: 1) with the chunked (UT-transform) form documented in the
// CPU file: A = strictly-lower (beta_i k_i . k_j e^(cum_i - cum_j)), forward substitution for
// U = (I + A)^-1 beta v and W = (I + A)^-1 beta e^cum k, v' = U - W S, out_i = e^cum_i q_i S +
// sum_{j <= i} (q_i . k_j) e^(cum_i - cum_j) v'_j, S = e^cum_last S + sum_i e^(cum_last - cum_i)
// k_i v'_i^T. Every column of U, W, v', out and S belongs to one thread (columns tid, tid +
// DN_THREADS, ...), so the substitution needs no barrier between rows; the dot products A and
// q k^T are shared. FP32 on CUDA cores: the tensor-core (mma) form of the same chunk algebra is
// not written yet. Shared memory: (Dk Dv + CH (3 Dk + Dv) + CH^2 + 3 CH) floats, 209 KiB at
// Dk = Dv = 128 (cuda_limits.h CUDA_DN_MAX_HEAD_DIM).
#include "backend/cuda/cuda_common.cuh"

#define DN_THREADS 128
#define DN_CHUNK 64

// A float from a weight / activation array of dtype dt (F32, BF16 or F16).
__device__ __forceinline__ float dn_ld(const void *p, int dt, int64_t i) {
    if (dt == DTYPE_BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(p)[i]);
    if (dt == DTYPE_F16) return __half2float(reinterpret_cast<const __half *>(p)[i]);
    return reinterpret_cast<const float *>(p)[i];
}

__device__ __forceinline__ void dn_st(void *p, int dt, int64_t i, float v) {
    if (dt == DTYPE_BF16)
        reinterpret_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
    else if (dt == DTYPE_F16)
        reinterpret_cast<__half *>(p)[i] = __float2half_rn(v);
    else
        reinterpret_cast<float *>(p)[i] = v;
}

__device__ __forceinline__ float dn_silu(float x) {
    return x / (1.0f + __expf(-x));
}

static void dn_check_dtype(enum dtype d) {
    CHECK_MSG(d == DTYPE_F32 || d == DTYPE_BF16 || d == DTYPE_F16, "Gated DeltaNet op: dtype %s", dtype_name(d));
}

// ---------------------------------------------------------------------------------------------
// Causal depthwise conv1d + conv state

__global__ void dn_conv_kernel(void *out, const void *x, int64_t xs, int act_dt, const void *w, int w_dt, float *state,
                               const int32_t *qs, const int32_t *ctx, const int32_t *slots, int64_t C, int K) {
    pdl_begin();
    const int s = blockIdx.y;
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int t0 = qs[s], t1 = qs[s + 1];
    if (t1 <= t0) return;
    const int P = K - 1;
    const bool fresh = ctx[s] == t1 - t0;
    float *st = state + ((int64_t)slots[s] * C + c) * P;
    float win[CUDA_DN_MAX_CONV_KERNEL - 1], wk[CUDA_DN_MAX_CONV_KERNEL];
#pragma unroll
    for (int j = 0; j < CUDA_DN_MAX_CONV_KERNEL - 1; j++)
        win[j] = j < P && !fresh ? st[j] : 0.0f;
#pragma unroll
    for (int j = 0; j < CUDA_DN_MAX_CONV_KERNEL; j++)
        wk[j] = j < K ? dn_ld(w, w_dt, c * K + j) : 0.0f;
    for (int t = t0; t < t1; t++) {
        float xv = dn_ld(x, act_dt, (int64_t)t * xs + c);
        float acc = wk[P] * xv;
#pragma unroll
        for (int j = 0; j < CUDA_DN_MAX_CONV_KERNEL - 1; j++)
            if (j < P) acc += wk[j] * win[j];
        dn_st(out, act_dt, (int64_t)t * C + c, dn_silu(acc));
#pragma unroll
        for (int j = 0; j < CUDA_DN_MAX_CONV_KERNEL - 2; j++)
            if (j + 1 < P) win[j] = win[j + 1];
        if (P > 0) {
#pragma unroll
            for (int j = 0; j < CUDA_DN_MAX_CONV_KERNEL - 1; j++)
                if (j == P - 1) win[j] = xv;
        }
    }
#pragma unroll
    for (int j = 0; j < CUDA_DN_MAX_CONV_KERNEL - 1; j++)
        if (j < P) st[j] = win[j];
}

void cuda_op_deltanet_conv(struct backend *b, struct tensor *out, const struct tensor *x, int64_t x_row_stride,
                           const struct tensor *w, struct kv_layer *kv, const struct attn_metadata *md) {
    const int64_t C = tensor_cols(out), K = tensor_cols(w);
    dn_check_dtype(out->dtype);
    dn_check_dtype(w->dtype);
    CHECK(x->dtype == out->dtype && kv->k.dtype == DTYPE_F32 && md->state_slots);
    CHECK(tensor_rows(w) == C && K >= 1 && K <= CUDA_DN_MAX_CONV_KERNEL);
    CHECK(kv->k.ndim == 3 && kv->k.ne[1] == C && kv->k.ne[2] == K - 1);
    if (md->n_seqs == 0 || C == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    dim3 grid(cdiv(C, 128), (unsigned)md->n_seqs);
    pdl_launch(dn_conv_kernel, grid, dim3(128), 0, s, out->data, x->data, x_row_stride ? x_row_stride : C,
               (int)out->dtype, w->data, (int)w->dtype, (float *)kv->k.data, md->query_start, md->context_lens,
               md->state_slots, C, (int)K);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule

static size_t dn_rule_smem(int dk, int dv, int ch) {
    return ((size_t)dk * dv + (size_t)ch * (3 * (size_t)dk + dv) + (size_t)ch * ch + 3 * (size_t)ch) * sizeof(float);
}

__global__ void __launch_bounds__(DN_THREADS)
    dn_rule_kernel(void *out, const void *qkv, int act_dt, const void *ba, int64_t bas, const void *a_log,
                   const void *dt_bias, int w_dt, float *state, const int32_t *qs, const int32_t *ctx,
                   const int32_t *slots, int Hk, int Hv, int Dk, int Dv, int CH) {
    pdl_begin();
    extern __shared__ float sm[];
    float *S = sm;                   // (Dk, Dv)
    float *Q = S + (size_t)Dk * Dv;  // (CH, Dk)
    float *Kc = Q + (size_t)CH * Dk; // (CH, Dk)
    float *W = Kc + (size_t)CH * Dk; // (CH, Dk)
    float *U = W + (size_t)CH * Dk;  // (CH, Dv): v, then U, then v'
    float *A = U + (size_t)CH * Dv;  // (CH, CH): A, then the decayed q k^T
    float *g = A + (size_t)CH * CH, *beta = g + CH, *cum = beta + CH;
    const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nw = DN_THREADS / 32;
    const int t0 = qs[s], t1 = qs[s + 1];
    if (t1 <= t0) return;
    const int kh = h / (Hv / Hk);
    const int64_t conv_dim = 2 * (int64_t)Hk * Dk + (int64_t)Hv * Dv;
    float *st = state + ((int64_t)slots[s] * Hv + h) * (int64_t)Dk * Dv;
    const bool fresh = ctx[s] == t1 - t0;
    for (int i = tid; i < Dk * Dv; i += DN_THREADS)
        S[i] = fresh ? 0.0f : st[i];
    const float A_h = -__expf(dn_ld(a_log, w_dt, h)), dtb = dn_ld(dt_bias, w_dt, h);
    const float qscale = rsqrtf((float)Dk);
    __syncthreads();
    for (int c0 = t0; c0 < t1; c0 += CH) {
        const int L = t1 - c0 < CH ? t1 - c0 : CH;
        // Load the chunk: per token (one warp each) q, k L2-normed, v, g, beta.
        for (int i = warp; i < L; i += nw) {
            const int64_t row = (int64_t)(c0 + i) * conv_dim;
            float sq = 0, sk = 0;
            for (int e = lane; e < Dk; e += 32) {
                float qv = dn_ld(qkv, act_dt, row + (int64_t)kh * Dk + e);
                float kv = dn_ld(qkv, act_dt, row + (int64_t)(Hk + kh) * Dk + e);
                Q[i * Dk + e] = qv;
                Kc[i * Dk + e] = kv;
                sq += qv * qv;
                sk += kv * kv;
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            const float iq = qscale * rsqrtf(sq + 1e-6f), ik = rsqrtf(sk + 1e-6f);
            for (int e = lane; e < Dk; e += 32) {
                Q[i * Dk + e] *= iq;
                Kc[i * Dk + e] *= ik;
            }
            for (int e = lane; e < Dv; e += 32)
                U[i * Dv + e] = dn_ld(qkv, act_dt, row + 2 * (int64_t)Hk * Dk + (int64_t)h * Dv + e);
            if (lane == 0) {
                const int64_t br = (int64_t)(c0 + i) * bas;
                float bv = dn_ld(ba, act_dt, br + h), av = dn_ld(ba, act_dt, br + Hv + h) + dtb;
                beta[i] = 1.0f / (1.0f + __expf(-bv));
                g[i] = A_h * (av > 20.0f ? av : log1pf(__expf(av)));
            }
        }
        __syncthreads();
        if (tid == 0) {
            float run = 0;
            for (int i = 0; i < L; i++)
                cum[i] = (run += g[i]);
        }
        __syncthreads();
        // A (strictly lower): beta_i (k_i . k_j) e^(cum_i - cum_j).
        for (int p = tid; p < L * L; p += DN_THREADS) {
            int i = p / L, j = p % L;
            if (j >= i) continue;
            float d = 0;
            for (int e = 0; e < Dk; e++)
                d += Kc[i * Dk + e] * Kc[j * Dk + e];
            A[i * CH + j] = beta[i] * d * __expf(cum[i] - cum[j]);
        }
        __syncthreads();
        // Forward substitution, column-parallel: U = (I + A)^-1 beta v, W = (I + A)^-1 beta e^cum k.
        for (int e = tid; e < Dv; e += DN_THREADS)
            for (int i = 0; i < L; i++) {
                float u = beta[i] * U[i * Dv + e];
                for (int j = 0; j < i; j++)
                    u -= A[i * CH + j] * U[j * Dv + e];
                U[i * Dv + e] = u;
            }
        for (int e = tid; e < Dk; e += DN_THREADS)
            for (int i = 0; i < L; i++) {
                float wv = beta[i] * __expf(cum[i]) * Kc[i * Dk + e];
                for (int j = 0; j < i; j++)
                    wv -= A[i * CH + j] * W[j * Dk + e];
                W[i * Dk + e] = wv;
            }
        __syncthreads();
        // v' = U - W S (own columns), the decayed q k^T into A (j <= i), and into g (free now) the
        // state-update decays e^(cum_last - cum_i).
        for (int i = tid; i < L; i += DN_THREADS)
            g[i] = __expf(cum[L - 1] - cum[i]);
        for (int jv = tid; jv < Dv; jv += DN_THREADS)
            for (int i = 0; i < L; i++) {
                float acc = U[i * Dv + jv];
                for (int d = 0; d < Dk; d++)
                    acc -= W[i * Dk + d] * S[d * Dv + jv];
                U[i * Dv + jv] = acc;
            }
        for (int p = tid; p < L * L; p += DN_THREADS) {
            int i = p / L, j = p % L;
            if (j > i) continue;
            float d = 0;
            for (int e = 0; e < Dk; e++)
                d += Q[i * Dk + e] * Kc[j * Dk + e];
            A[i * CH + j] = d * __expf(cum[i] - cum[j]);
        }
        __syncthreads();
        // Outputs and the state after the chunk, per own column.
        const float el = __expf(cum[L - 1]);
        for (int jv = tid; jv < Dv; jv += DN_THREADS) {
            for (int i = 0; i < L; i++) {
                float o = 0;
                for (int d = 0; d < Dk; d++)
                    o += Q[i * Dk + d] * S[d * Dv + jv];
                o *= __expf(cum[i]);
                for (int j = 0; j <= i; j++)
                    o += A[i * CH + j] * U[j * Dv + jv];
                dn_st(out, act_dt, ((int64_t)(c0 + i) * Hv + h) * Dv + jv, o);
            }
            for (int d = 0; d < Dk; d++) {
                float acc = el * S[d * Dv + jv];
                for (int i = 0; i < L; i++)
                    acc += g[i] * Kc[i * Dk + d] * U[i * Dv + jv];
                S[d * Dv + jv] = acc;
            }
        }
        __syncthreads();
    }
    for (int i = tid; i < Dk * Dv; i += DN_THREADS)
        st[i] = S[i];
}

void cuda_op_deltanet_rule(struct backend *b, struct tensor *out, const struct tensor *qkv, const struct tensor *ba,
                           int64_t ba_row_stride, const struct tensor *a_log, const struct tensor *dt_bias,
                           struct kv_layer *kv, const struct attn_metadata *md, const struct deltanet_args *a) {
    struct cuda_backend *cb = cuda_impl(b);
    const int Hk = a->n_k_heads, Hv = a->n_v_heads, Dk = a->k_dim, Dv = a->v_dim;
    CHECK(Hk > 0 && Hv % Hk == 0 && Dk > 0 && Dv > 0 && Dk <= CUDA_DN_MAX_HEAD_DIM && Dv <= CUDA_DN_MAX_HEAD_DIM);
    dn_check_dtype(out->dtype);
    dn_check_dtype(a_log->dtype);
    CHECK(qkv->dtype == out->dtype && ba->dtype == out->dtype && dt_bias->dtype == a_log->dtype && md->state_slots);
    CHECK(tensor_cols(qkv) == 2 * (int64_t)Hk * Dk + (int64_t)Hv * Dv && tensor_numel(a_log) == Hv);
    const struct tensor *rs = &kv->v;
    CHECK(rs->dtype == DTYPE_F32 && rs->ndim == 4 && rs->ne[1] == Hv && rs->ne[2] == Dk && rs->ne[3] == Dv);
    if (md->n_seqs == 0) return;
    const int CH = md->decode_only ? 1 : DN_CHUNK;
    const size_t smem = dn_rule_smem(Dk, Dv, CH);
    CHECK_MSG(smem <= cb->max_smem_optin, "deltanet_rule: %zu bytes of shared memory, the device has %zu", smem,
              cb->max_smem_optin);
    // The attribute is set outside stream capture; captured decode graphs always follow an eager
    // warm-up run of the same configuration (runner_graphs.c), and the prefill size is the largest.
    if (!cuda_is_capturing(cb))
        CUDA_CHECK(cudaFuncSetAttribute(dn_rule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)dn_rule_smem(Dk, Dv, DN_CHUNK)));
    pdl_launch(dn_rule_kernel, dim3((unsigned)md->n_seqs, (unsigned)Hv), dim3(DN_THREADS), smem, cb->stream, out->data,
               qkv->data, (int)out->dtype, ba->data, ba_row_stride ? ba_row_stride : 2 * (int64_t)Hv, a_log->data,
               dt_bias->data, (int)a_log->dtype, (float *)rs->data, md->query_start, md->context_lens, md->state_slots,
               Hk, Hv, Dk, Dv, CH);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------------
// Gated RMSNorm and the sigmoid gate

__global__ void dn_gnorm_kernel(void *out, const void *x, const void *z, int act_dt, const void *w, int w_dt,
                                int64_t rows, int64_t d, int64_t zs, int zh, float eps) {
    pdl_begin();
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const int64_t zb = (r / zh) * zs + (r % zh) * d;
    float ss = 0;
    for (int64_t i = lane; i < d; i += 32) {
        float v = dn_ld(x, act_dt, r * d + i);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int64_t i = lane; i < d; i += 32) {
        float v = dn_ld(x, act_dt, r * d + i) * inv * dn_ld(w, w_dt, i);
        dn_st(out, act_dt, r * d + i, v * dn_silu(dn_ld(z, act_dt, zb + i)));
    }
}

void cuda_op_rmsnorm_gated(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *z,
                           int64_t z_row_stride, int z_heads, const struct tensor *w, float eps) {
    const int64_t d = tensor_cols(x), rows = tensor_rows(x);
    dn_check_dtype(out->dtype);
    dn_check_dtype(w->dtype);
    CHECK(x->dtype == out->dtype && z->dtype == out->dtype && z_heads > 0 && tensor_numel(w) == d &&
          tensor_numel(out) == tensor_numel(x));
    if (rows == 0) return;
    pdl_launch(dn_gnorm_kernel, dim3(cdiv(rows, 4)), dim3(128), 0, cuda_impl(b)->stream, out->data, x->data, z->data,
               (int)out->dtype, w->data, (int)w->dtype, rows, d, z_row_stride ? z_row_stride : d * z_heads, z_heads,
               eps);
    CUDA_CHECK_LAUNCH();
}

__global__ void dn_gate_kernel(void *x, int act_dt, const void *gate, int g_dt, int64_t rows, int64_t d, int64_t gs,
                               int gc) {
    pdl_begin();
    const int64_t n = rows * d;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / d, c = i % d;
        const float gv = dn_ld(gate, g_dt, r * gs + (gc == 1 ? 0 : c));
        dn_st(x, act_dt, i, dn_ld(x, act_dt, i) / (1.0f + __expf(-gv)));
    }
}

void cuda_op_gate_sigmoid_mul(struct backend *b, struct tensor *x, const struct tensor *gate, int64_t gate_row_stride,
                              int gate_cols) {
    const int64_t d = tensor_cols(x), rows = tensor_rows(x);
    dn_check_dtype(x->dtype);
    dn_check_dtype(gate->dtype);
    CHECK(gate_cols == 1 || gate_cols == d);
    if (rows * d == 0) return;
    int64_t blocks = (rows * d + 255) / 256;
    if (blocks > 65535 * 8) blocks = 65535 * 8;
    pdl_launch(dn_gate_kernel, dim3((unsigned)blocks), dim3(256), 0, cuda_impl(b)->stream, x->data, (int)x->dtype,
               gate->data, (int)gate->dtype, rows, d, gate_row_stride ? gate_row_stride : gate_cols, gate_cols);
    CUDA_CHECK_LAUNCH();
}
