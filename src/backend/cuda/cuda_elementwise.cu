// Memory-bound ops: embedding, RMSNorm (+ fused residual add), SiLU*mul, add, gather_rows,
// convert. All math in f32; 16-byte vector accesses where the row length and alignment
// allow (a scalar path covers odd sizes). Each op is one launch with no host sync, so all
// are safe inside CUDA graph capture.
#include "backend/cuda/cuda_common.cuh"

// Dispatch helper: runs F with the C++ type of an activation dtype.
#define DISPATCH_ACT(dt, T, ...)                                                                                       \
    switch (dt) {                                                                                                      \
    case DTYPE_F32: {                                                                                                  \
        using T = float;                                                                                               \
        __VA_ARGS__;                                                                                                   \
    } break;                                                                                                           \
    case DTYPE_BF16: {                                                                                                 \
        using T = __nv_bfloat16;                                                                                       \
        __VA_ARGS__;                                                                                                   \
    } break;                                                                                                           \
    case DTYPE_F16: {                                                                                                  \
        using T = __half;                                                                                              \
        __VA_ARGS__;                                                                                                   \
    } break;                                                                                                           \
    default:                                                                                                           \
        CHECK_MSG(0, "CUDA op: unsupported dtype %s", dtype_name(dt));                                                 \
    }

// ---------------------------------------------------------------------------------------
// RMSNorm. One warp per row for d <= 1024, one block per row otherwise (256 threads, 512 from
// d = 4096; rows of up to two 16-byte vectors per thread in registers, see below).
// V = elements per vector access (16 bytes of T, or 1 on the scalar path).

// Pass 1 of one vector of the row at i: a = the residual plus x, rounded as stored and written
// back (ADD; x NULL: the residual alone), or x; its squares are added to ss in element order.
template <typename T, int V, bool ADD>
__device__ __forceinline__ void rmsnorm_pass1(float (&a)[V], float &ss, T *res, const T *x, int i) {
    if (ADD) {
        vec_load<T, V>(res + i, a);
        if (x) {
            float bx[V];
            vec_load<T, V>(x + i, bx);
#pragma unroll
            for (int j = 0; j < V; j++)
                a[j] = to_f32(from_f32<T>(a[j] + bx[j])); // the residual as stored
            vec_store<T, V>(res + i, a);
        }
    } else {
        vec_load<T, V>(x + i, a);
    }
#pragma unroll
    for (int j = 0; j < V; j++)
        ss += a[j] * a[j];
}

// 1 / rms of the row from every thread's sum of squares: over the warp, then over the block
// through red (NULL: the warp is the row).
__device__ __forceinline__ float rmsnorm_inv_rms(float ss, int d, float eps, int lane, int nthreads, float *red) {
    ss = warp_sum(ss);
    if (red) {
        if ((lane & 31) == 0) red[lane / 32] = ss;
        __syncthreads();
        float t = 0.f;
        for (int i = 0; i < nthreads / 32; i++)
            t += red[i];
        ss = t;
    }
    return rsqrtf(ss / (float)d + eps);
}

// Any row length: pass 2 reads the row (and the weights) again.
template <typename T, typename W, int V, bool ADD>
__device__ __forceinline__ void rmsnorm_row(T *out, T *res, const T *x, const W *w, int d, float eps, int lane,
                                            int nthreads, float *red) {
    float ss = 0.f;
    for (int i = lane * V; i < d; i += nthreads * V) {
        float a[V];
        rmsnorm_pass1<T, V, ADD>(a, ss, res, x, i);
    }
    const float r = rmsnorm_inv_rms(ss, d, eps, lane, nthreads, red);
    const T *src = ADD ? res : x;
    for (int i = lane * V; i < d; i += nthreads * V) {
        float a[V], ww[V];
        if (ADD) {
            vec_load<T, V, false>(src + i, a); // this thread wrote it in pass 1: plain loads, not __ldg
        } else {
            vec_load<T, V>(src + i, a);
        }
        vec_load<W, V>(w + i, ww);
#pragma unroll
        for (int j = 0; j < V; j++)
            a[j] = a[j] * r * ww[j];
        vec_store<T, V>(out + i, a);
    }
}

template <typename T, typename W, int V, bool ADD>
__global__ void rmsnorm_warp_kernel(T *out, T *res, const T *x, const W *w, int64_t rows, int d, float eps) {
    pdl_begin();
    int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    size_t off = (size_t)row * d;
    rmsnorm_row<T, W, V, ADD>(out + off, ADD ? res + off : nullptr, x ? x + off : nullptr, w, d, eps, threadIdx.x & 31,
                              32, nullptr);
}

template <typename T, typename W, int V, bool ADD>
__global__ void rmsnorm_block_kernel(T *out, T *res, const T *x, const W *w, int64_t rows, int d, float eps) {
    pdl_begin();
    __shared__ float red[32];
    size_t off = (size_t)blockIdx.x * d;
    rmsnorm_row<T, W, V, ADD>(out + off, ADD ? res + off : nullptr, x ? x + off : nullptr, w, d, eps, threadIdx.x,
                              blockDim.x, red);
}

// Rows of at most R vectors per thread (the hidden sizes of every model served: 2048 at 256
// threads, 4096-8192 at 512): the row stays in registers between the two passes and the
// weights are loaded before the PDL wait (no kernel writes them), so after the wait there is
// one global round trip (x and the residual) instead of three (x and the residual, the
// residual again, the weights). The arithmetic and its order are rmsnorm_row's. In the
// batch-1 decode chain this norm runs twice a layer between two GEMVs and is all latency.
template <typename T, typename W, int V, bool ADD, int R>
__global__ void rmsnorm_block_reg_kernel(T *out, T *res, const T *x, const W *w, int64_t rows, int d, float eps) {
    __shared__ float red[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    float ww[R][V], a[R][V];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = (tid + r * nt) * V;
        if (i < d) vec_load<W, V>(w + i, ww[r]);
    }
    pdl_begin();
    const size_t off = (size_t)blockIdx.x * d;
    float ss = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = (tid + r * nt) * V;
        if (i < d) rmsnorm_pass1<T, V, ADD>(a[r], ss, ADD ? res + off : nullptr, x ? x + off : nullptr, i);
    }
    const float rr = rmsnorm_inv_rms(ss, d, eps, tid, nt, red);
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = (tid + r * nt) * V;
        if (i >= d) continue;
#pragma unroll
        for (int j = 0; j < V; j++)
            a[r][j] = a[r][j] * rr * ww[r][j];
        vec_store<T, V>(out + off + i, a[r]);
    }
}

template <typename T, typename W, bool ADD>
static void rmsnorm_launch(cudaStream_t s, T *out, T *res, const T *x, const W *w, int64_t rows, int d, float eps) {
    constexpr int VT = 16 / sizeof(T);
    bool vec = d % VT == 0 && aligned16(out) && (!x || aligned16(x)) && (!res || aligned16(res)) && aligned16(w) &&
               (VT * sizeof(W)) % 16 == 0;
    if (rows == 0) return;
    if (d <= 1024) {
        unsigned grid = cdiv(rows, 8);
        if (vec)
            pdl_launch(rmsnorm_warp_kernel<T, W, VT, ADD>, grid, 256, 0, s, out, res, x, w, rows, d, eps);
        else
            pdl_launch(rmsnorm_warp_kernel<T, W, 1, ADD>, grid, 256, 0, s, out, res, x, w, rows, d, eps);
    } else {
        unsigned threads = d >= 4096 ? 512 : 256;
        if (vec && d <= (int64_t)threads * VT)
            pdl_launch(rmsnorm_block_reg_kernel<T, W, VT, ADD, 1>, (unsigned)rows, threads, 0, s, out, res, x, w, rows,
                       d, eps);
        else if (vec && d <= 2 * (int64_t)threads * VT)
            pdl_launch(rmsnorm_block_reg_kernel<T, W, VT, ADD, 2>, (unsigned)rows, threads, 0, s, out, res, x, w, rows,
                       d, eps);
        else if (vec)
            pdl_launch(rmsnorm_block_kernel<T, W, VT, ADD>, (unsigned)rows, threads, 0, s, out, res, x, w, rows, d,
                       eps);
        else
            pdl_launch(rmsnorm_block_kernel<T, W, 1, ADD>, (unsigned)rows, threads, 0, s, out, res, x, w, rows, d, eps);
    }
    CUDA_CHECK_LAUNCH();
}

template <bool ADD>
static void rmsnorm_dispatch(struct backend *b, struct tensor *out, struct tensor *res, const struct tensor *x,
                             const struct tensor *w, float eps) {
    const struct tensor *shape = ADD ? res : x;
    int64_t d = tensor_cols(shape), rows = tensor_rows(shape);
    CHECK(tensor_numel(out) == tensor_numel(shape) && tensor_cols(w) == d && tensor_numel(w) == d);
    CHECK(out->dtype == shape->dtype && (!x || x->dtype == shape->dtype));
    cudaStream_t s = cuda_impl(b)->stream;
    DISPATCH_ACT(shape->dtype, T, {
        T *o = (T *)out->data;
        T *r = ADD ? (T *)res->data : nullptr;
        const T *xp = x ? (const T *)x->data : nullptr;
        if (w->dtype == DTYPE_F32)
            rmsnorm_launch<T, float, ADD>(s, o, r, xp, (const float *)w->data, rows, (int)d, eps);
        else if (w->dtype == DTYPE_BF16)
            rmsnorm_launch<T, __nv_bfloat16, ADD>(s, o, r, xp, (const __nv_bfloat16 *)w->data, rows, (int)d, eps);
        else
            CHECK_MSG(0, "rmsnorm weight dtype %s", dtype_name(w->dtype));
    })
}

void cuda_op_rmsnorm(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *w, float eps) {
    rmsnorm_dispatch<false>(b, out, nullptr, x, w, eps);
}

void cuda_op_add_rmsnorm(struct backend *b, struct tensor *out, struct tensor *residual, const struct tensor *x,
                         const struct tensor *w, float eps) {
    rmsnorm_dispatch<true>(b, out, residual, x, w, eps);
}

// ---------------------------------------------------------------------------------------
// SiLU * mul: out(n, f) = silu(gu[:, :f]) * gu[:, f:].

template <typename T, int V> __global__ void silu_mul_kernel(T *out, const T *gu, int64_t n, int64_t f) {
    pdl_begin();
    int64_t per_row = f / V;
    int64_t total = n * per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / per_row, c = (i % per_row) * V;
        float g[V], u[V];
        vec_load<T, V>(gu + r * 2 * f + c, g);
        vec_load<T, V>(gu + r * 2 * f + f + c, u);
#pragma unroll
        for (int j = 0; j < V; j++)
            g[j] = g[j] / (1.f + __expf(-g[j])) * u[j];
        vec_store<T, V>(out + r * f + c, g);
    }
}

static unsigned grid_for(int64_t work, int threads) {
    int64_t g = (work + threads - 1) / threads;
    if (g > 65535 * 8) g = 65535 * 8;
    return (unsigned)(g > 0 ? g : 1);
}

void cuda_op_silu_mul(struct backend *b, struct tensor *out, const struct tensor *gu) {
    int64_t f = tensor_cols(out), n = tensor_rows(out);
    CHECK(tensor_cols(gu) == 2 * f && tensor_rows(gu) == n && out->dtype == gu->dtype);
    if (n == 0 || f == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    DISPATCH_ACT(out->dtype, T, {
        constexpr int VT = 16 / sizeof(T);
        if (f % VT == 0 && aligned16(out->data) && aligned16(gu->data))
            pdl_launch(silu_mul_kernel<T, VT>, grid_for(n * f / VT, 256), 256, 0, s, (T *)out->data,
                       (const T *)gu->data, n, f);
        else
            pdl_launch(silu_mul_kernel<T, 1>, grid_for(n * f, 256), 256, 0, s, (T *)out->data, (const T *)gu->data, n,
                       f);
    })
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// add: out += x.

template <typename T, int V> __global__ void add_kernel(T *out, const T *x, int64_t nvec) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (int64_t)gridDim.x * blockDim.x) {
        float a[V], c[V];
        vec_load<T, V>(out + i * V, a);
        vec_load<T, V>(x + i * V, c);
#pragma unroll
        for (int j = 0; j < V; j++)
            a[j] += c[j];
        vec_store<T, V>(out + i * V, a);
    }
}

void cuda_op_add(struct backend *b, struct tensor *out, const struct tensor *x) {
    int64_t n = tensor_numel(out);
    CHECK(tensor_numel(x) == n && x->dtype == out->dtype);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    DISPATCH_ACT(out->dtype, T, {
        constexpr int VT = 16 / sizeof(T);
        if (n % VT == 0 && aligned16(out->data) && aligned16(x->data))
            pdl_launch(add_kernel<T, VT>, grid_for(n / VT, 256), 256, 0, s, (T *)out->data, (const T *)x->data, n / VT);
        else
            pdl_launch(add_kernel<T, 1>, grid_for(n, 256), 256, 0, s, (T *)out->data, (const T *)x->data, n);
    })
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Row gathers with conversion: out[i] = convert(src[idx[i]]). Used by embedding (idx = token
// ids, bounds-checked: an id outside the table yields a zero row) and gather_rows.

template <typename TO, typename TI, int V>
__global__ void gather_kernel(TO *out, const TI *src, const int32_t *idx, int n_rows, int64_t src_rows, int64_t d) {
    pdl_begin();
    int row = blockIdx.x;
    if (row >= n_rows) return;
    int32_t r = idx[row];
    bool ok = r >= 0 && r < src_rows;
    for (int64_t c = (int64_t)threadIdx.x * V; c < d; c += (int64_t)blockDim.x * V) {
        float v[V];
        if (ok) {
            vec_load<TI, V>(src + (int64_t)r * d + c, v);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++)
                v[j] = 0.f;
        }
        vec_store<TO, V>(out + (int64_t)row * d + c, v);
    }
}

static void gather_launch(cudaStream_t s, struct tensor *out, const struct tensor *src, const int32_t *idx, int n) {
    int64_t d = tensor_cols(src);
    CHECK(tensor_cols(out) == d && tensor_rows(out) >= n);
    if (n == 0 || d == 0) return;
    unsigned threads = d >= 2048 ? 256 : 128;
    DISPATCH_ACT(out->dtype, TO, {DISPATCH_ACT(src->dtype, TI, {
                     constexpr int V = 8;
                     if (d % V == 0 && aligned16(out->data) && aligned16(src->data) && (V * sizeof(TO)) % 16 == 0 &&
                         (V * sizeof(TI)) % 16 == 0)
                         pdl_launch(gather_kernel<TO, TI, V>, (unsigned)n, threads, 0, s, (TO *)out->data,
                                    (const TI *)src->data, idx, n, tensor_rows(src), d);
                     else
                         pdl_launch(gather_kernel<TO, TI, 1>, (unsigned)n, threads, 0, s, (TO *)out->data,
                                    (const TI *)src->data, idx, n, tensor_rows(src), d);
                 })})
    CUDA_CHECK_LAUNCH();
}

void cuda_op_embedding(struct backend *b, struct tensor *out, const struct tensor *table, const int32_t *ids) {
    gather_launch(cuda_impl(b)->stream, out, table, ids, (int)tensor_rows(out));
}

void cuda_op_gather_rows(struct backend *b, struct tensor *out, const struct tensor *x, const int32_t *rows,
                         int n_rows) {
    gather_launch(cuda_impl(b)->stream, out, x, rows, n_rows);
}

// ---------------------------------------------------------------------------------------
// convert: x (any activation dtype) -> out (F32).

template <typename TI> __global__ void convert_kernel(float *out, const TI *x, int64_t n) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = to_f32(x[i]);
}

void cuda_op_convert(struct backend *b, struct tensor *out, const struct tensor *x) {
    int64_t n = tensor_numel(x);
    CHECK(tensor_numel(out) == n && out->dtype == DTYPE_F32);
    if (n == 0) return;
    cudaStream_t s = cuda_impl(b)->stream;
    if (x->dtype == DTYPE_F32) {
        if (out->data != x->data) CUDA_CHECK(cudaMemcpyAsync(out->data, x->data, n * 4, cudaMemcpyDeviceToDevice, s));
        return;
    }
    DISPATCH_ACT(x->dtype, TI, {
        pdl_launch(convert_kernel<TI>, grid_for(n, 256), 256, 0, s, (float *)out->data, (const TI *)x->data, n);
    })
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// fill_uniform: t[i] = lo + (hi - lo) * u(seed, i), u from splitmix64 of (seed, i), 24 bits.

template <typename T> __global__ void fill_uniform_kernel(T *t, int64_t n, float lo, float hi, uint64_t seed) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        t[i] = from_f32<T>(lo + (hi - lo) * u);
    }
}

atomc_status cuda_op_fill_uniform(struct backend *b, struct tensor *t, uint64_t seed, float lo, float hi,
                                  struct error *err) {
    int64_t n = tensor_numel(t);
    if (t->dtype != DTYPE_F32 && t->dtype != DTYPE_BF16 && t->dtype != DTYPE_F16)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "fill_uniform: %s tensors are not supported on CUDA",
                         dtype_name(t->dtype));
    if (n == 0) return ATOMC_OK;
    cudaStream_t s = cuda_impl(b)->stream;
    DISPATCH_ACT(t->dtype, T,
                 { pdl_launch(fill_uniform_kernel<T>, grid_for(n, 256), 256, 0, s, (T *)t->data, n, lo, hi, seed); })
    CUDA_TRY(err, cudaGetLastError());
    return ATOMC_OK;
}
