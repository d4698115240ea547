// Private header of the CUDA backend (only .cu files include it; C code sees backend.h alone).
//
// One `struct cuda_backend` per backend instance: its device, its one stream, the cuBLASLt
// handle with a workspace and a per-shape algorithm cache, and grow-only scratch buffers
// for split-KV attention and sampling. Scratch grows only outside stream capture; inside
// a capture the kernels adapt to the space they have (attention uses fewer KV splits), so
// captured decode graphs never allocate.
//
// Errors: every CUDA / cuBLAS call goes through CUDA_CHECK / CUBLAS_CHECK (abort with
// expression, file, line: a failing kernel launch or a device fault on the hot path leaves
// the device unusable) or CUDA_TRY (returns ATOMC_ERR_BACKEND with the same report, for
// create / allocation / upload paths driven by input).
#ifndef ATOMC_BACKEND_CUDA_COMMON_CUH
#define ATOMC_BACKEND_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <utility>

extern "C" {
#include "backend/backend.h"
#include "backend/cuda/cuda_limits.h"
#include "common/check.h"
#include "common/error.h"
}

#define CUDA_REPORT_ABORT(what, code_str, expr)                                                                        \
    do {                                                                                                               \
        fprintf(stderr, "atomc: %s error %s at %s:%d: %s\n", what, code_str, __FILE__, __LINE__, expr);                \
        abort();                                                                                                       \
    } while (0)

#define CUDA_CHECK(expr)                                                                                               \
    do {                                                                                                               \
        cudaError_t _e = (expr);                                                                                       \
        if (_e != cudaSuccess) CUDA_REPORT_ABORT("CUDA", cudaGetErrorString(_e), #expr);                               \
    } while (0)

#define CUBLAS_CHECK(expr)                                                                                             \
    do {                                                                                                               \
        cublasStatus_t _s = (expr);                                                                                    \
        if (_s != CUBLAS_STATUS_SUCCESS) CUDA_REPORT_ABORT("cuBLAS", cublas_status_str(_s), #expr);                    \
    } while (0)

// Checks the launch that just happened (configuration errors); device faults surface at the
// next synchronising call.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

// Status-returning form: on failure records "CUDA error <name> at file:line: expr" in err.
#define CUDA_TRY(err, expr)                                                                                            \
    do {                                                                                                               \
        cudaError_t _e = (expr);                                                                                       \
        if (_e != cudaSuccess) {                                                                                       \
            cudaGetLastError();                                                                                        \
            return error_set(err, _e == cudaErrorMemoryAllocation ? ATOMC_ERR_OUT_OF_MEMORY : ATOMC_ERR_BACKEND,       \
                             "CUDA error %s at %s:%d: %s", cudaGetErrorString(_e), __FILE__, __LINE__, #expr);         \
        }                                                                                                              \
    } while (0)

static inline const char *cublas_status_str(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
        return "MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
        return "INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "NOT_SUPPORTED";
    default:
        return "UNKNOWN";
    }
}

// cuBLASLt plan of one GEMM shape: descriptors plus the heuristic's algorithm, made once.
struct matmul_plan {
    bool used;
    int64_t m, n, k;
    int in_dtype, out_dtype;
    bool has_bias;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};

#define MATMUL_PLAN_CAP 4096

struct cuda_backend {
    struct backend base;
    int device;
    cudaStream_t stream;
    cudaStream_t side_stream; // copy_d2h_side (KV-transfer reads from another thread)
    int num_sms;
    size_t max_smem_optin;

    cublasLtHandle_t lt;
    void *lt_workspace;
    size_t lt_workspace_bytes;
    struct matmul_plan *plans; // open addressing, MATMUL_PLAN_CAP slots
    int n_plans;

    // Split-KV attention partials: (rows, splits, head_dim) f32 outputs + (rows, splits) lse.
    void *attn_scratch;
    size_t attn_scratch_bytes;
    // MLA expanded prefill (cuda_mla.cu): one sequence's C / KV / K / V / metadata, grow-only.
    void *mla_expand;
    size_t mla_expand_bytes;
    uint64_t mla_expanded_seqs; // sequences that took it (backend_cuda_mla_expanded_seqs)
    int attn_occupancy[4][2][2]; // resident CTAs per SM of each attention variant [D 64/128/256/192-128][1/4 warps][bf16/fp8]
    // Sampling: per-row token counts for penalties (n_rows, vocab) int32, kept zero between
    // calls; per-row work area.
    int32_t *sample_counts;
    size_t sample_counts_bytes;
    // Greedy arg-max across several CTAs per row: per-row tickets (int32, self-resetting) then
    // per-(row, part) partials {max, id, sum of exp}.
    void *argmax_scratch;
    size_t argmax_scratch_bytes;

    // Quantized matmuls / experts (cuda_qmatmul.cu, cuda_moe_quant.cu): one grow-only scratch
    // (quantized activations, scales, dequantized tiles) and their cuBLASLt plans (struct qmm_state).
    void *qmm_scratch;
    size_t qmm_scratch_bytes;
    void *qmm;
    void *qgemm; // the INT8 IMMA GEMM's cuBLASLt plans (cuda_qgemm.cu, struct qgemm_state)

    // Instantiated graphs alive (graph_end +1, graph_destroy -1). While any is, a scratch buffer
    // that grows is not freed: captured kernels hold its address, so it is kept in `retired`
    // until the last graph goes (a replay keeps using the old buffer, sized for its capture;
    // eager calls use the new one; both on the one stream, so never at once).
    int live_graphs;
    void **retired;
    int n_retired, retired_cap;

    // Weight upload: two pinned host buffers and two device buffers, double-buffered.
    void *pinned[2];
    void *staging[2];
    size_t staging_bytes;
    cudaEvent_t staging_done[2];
};

static inline struct cuda_backend *cuda_impl(struct backend *b) {
    return (struct cuda_backend *)b->impl;
}

// True when p may be read / written with 16-byte vector accesses.
static inline bool aligned16(const void *p) {
    return ((uintptr_t)p & 15) == 0;
}

// True while the backend stream is being captured into a graph (no allocation allowed).
static inline bool cuda_is_capturing(struct cuda_backend *cb) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(cb->stream, &st));
    return st != cudaStreamCaptureStatusNone;
}

// Grows a scratch buffer to at least `need` bytes when not capturing. Returns the capacity
// available (may be smaller than need while capturing).
size_t cuda_scratch_reserve(struct cuda_backend *cb, void **buf, size_t *cap, size_t need);

static inline unsigned cdiv(int64_t a, int64_t b) {
    return (unsigned)((a + b - 1) / b);
}

// Scalar load/store helpers for the activation types (float, bf16, half).
__device__ __forceinline__ float to_f32(float x) {
    return x;
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
__device__ __forceinline__ float to_f32(__half x) {
    return __half2float(x);
}
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) {
    return x;
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return __float2half_rn(x);
}

// N consecutive elements of T as f32; vectorised as 16-byte accesses when N * sizeof(T) is
// a multiple of 16 (the caller guarantees the alignment).
// LDG = false for memory the same kernel wrote (the read-only path is not coherent with it).
template <typename T, int N, bool LDG = true> __device__ __forceinline__ void vec_load(const T *p, float (&f)[N]) {
    if constexpr ((N * sizeof(T)) % 16 == 0) {
        constexpr int NV = N * sizeof(T) / 16;
#pragma unroll
        for (int v = 0; v < NV; v++) {
            uint4 u = LDG ? __ldg(reinterpret_cast<const uint4 *>(p) + v) : reinterpret_cast<const uint4 *>(p)[v];
            const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
            for (int i = 0; i < 16 / (int)sizeof(T); i++)
                f[v * (16 / sizeof(T)) + i] = to_f32(e[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i++)
            f[i] = to_f32(p[i]);
    }
}

template <typename T, int N> __device__ __forceinline__ void vec_store(T *p, const float (&f)[N]) {
    if constexpr ((N * sizeof(T)) % 16 == 0) {
        constexpr int NV = N * sizeof(T) / 16;
#pragma unroll
        for (int v = 0; v < NV; v++) {
            uint4 u;
            T *e = reinterpret_cast<T *>(&u);
#pragma unroll
            for (int i = 0; i < 16 / (int)sizeof(T); i++)
                e[i] = from_f32<T>(f[v * (16 / sizeof(T)) + i]);
            reinterpret_cast<uint4 *>(p)[v] = u;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i++)
            p[i] = from_f32<T>(f[i]);
    }
}

// Programmatic dependent launch (Hopper). Every kernel of this backend starts with pdl_begin():
// griddepcontrol.wait (returns once the grids it depends on have completed and their writes are
// visible; a no-op when launched without the attribute), then griddepcontrol.launch_dependents
// (once every block of this grid has passed it, the next kernel on the stream may be scheduled).
// Kernels are launched with pdl_launch, so the next kernel's launch and block scheduling overlap
// this kernel's run instead of following its completion: over the ~330 kernels of a decode step
// that shortens every gap of the replayed CUDA graph. cuBLASLt kernels are launched normally
// (they cannot wait), so a kernel after them still starts only after they finish.
// Before the wait a kernel may only read what no kernel of the chain it waits on writes, and
// writes nothing. Four do, to overlap their first loads with the previous kernel's tail
// (docs/perf.md sessions 6 and 8): the GEMVs and the block RMSNorm (weights), the attention
// in pure decode batches (host-copied metadata, and a first KV tile holding only earlier steps'
// positions) and the MoE slot down kernel (weights and the routing ids: its grid starts only after every gate_up
// block has passed its own wait, so the routing two kernels back has completed). A block's
// trigger always follows its wait, so a grid starts only after the grid two launches back has
// completed. Always on: Llama-3-8B batch-1 decode 215.4 -> 226.0 tok/s with graphs, 198.0 ->
// 219.0 eager; Qwen3-30B-A3B batch 1 (random router) 233.6 before PDL, 244.5 with (H200,
// docs/perf.md session 4).
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

template <typename... K, typename... A>
static inline void pdl_launch(void (*kernel)(K...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
}

// Tensor-core building blocks (mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async), shared by
// the attention and grouped-GEMM kernels.
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&v);
}

// 16-byte streaming load (read once: not kept in L1) and its eight bf16 -> f32.
__device__ __forceinline__ uint4 ld_stream16(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void bf16x8_to_f32(const uint4 &u, float (&f)[8]) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Op entry points implemented in the other .cu files (wired into the vtable by cuda_backend.cu).
void cuda_op_embedding(struct backend *b, struct tensor *out, const struct tensor *table, const int32_t *ids);
// Gated DeltaNet (cuda_deltanet.cu).
void cuda_op_deltanet_conv(struct backend *b, struct tensor *out, const struct tensor *x, int64_t x_row_stride,
                           const struct tensor *w, struct kv_layer *kv, const struct attn_metadata *md);
void cuda_op_deltanet_rule(struct backend *b, struct tensor *out, const struct tensor *qkv, const struct tensor *ba,
                           int64_t ba_row_stride, const struct tensor *a_log, const struct tensor *dt_bias,
                           struct kv_layer *kv, const struct attn_metadata *md, const struct deltanet_args *a);
void cuda_op_rmsnorm_gated(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *z,
                           int64_t z_row_stride, int z_heads, const struct tensor *w, float eps);
void cuda_op_gate_sigmoid_mul(struct backend *b, struct tensor *x, const struct tensor *gate, int64_t gate_row_stride,
                              int gate_cols);
void cuda_op_rmsnorm(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *w, float eps);
void cuda_op_add_rmsnorm(struct backend *b, struct tensor *out, struct tensor *residual, const struct tensor *x,
                         const struct tensor *w, float eps);
void cuda_op_matmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                    const struct tensor *bias);
void cuda_op_rope_kv_write(struct backend *b, struct tensor *q, struct tensor *k, const struct tensor *v,
                           int64_t row_stride, const struct rope_args *rope, struct kv_layer *kv,
                           const struct attn_metadata *md);
void cuda_op_attention(struct backend *b, struct tensor *out, const struct tensor *q, int64_t q_row_stride,
                       const struct kv_layer *kv, const struct attn_metadata *md, float scale, int sliding_window,
                       const struct tensor *sinks);
void cuda_op_silu_mul(struct backend *b, struct tensor *out, const struct tensor *gate_up);
void cuda_op_add(struct backend *b, struct tensor *out, const struct tensor *x);
void cuda_op_gather_rows(struct backend *b, struct tensor *out, const struct tensor *x, const int32_t *rows,
                         int n_rows);
void cuda_op_convert(struct backend *b, struct tensor *out, const struct tensor *x);
void cuda_op_sample(struct backend *b, const struct sample_args *a);
// Mixture of experts (cuda_moe.cu).
void cuda_op_moe_route(struct backend *b, const struct tensor *logits, const struct moe_route_args *a,
                       int32_t *topk_ids, float *topk_w);
void cuda_op_moe_experts(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up,
                         const struct weight *down, const int32_t *topk_ids, const float *topk_w, int n_slots,
                         const struct moe_experts_args *ea, void *workspace);
void cuda_op_mla_latent_write(struct backend *b, struct tensor *q, const struct tensor *kv_a,
                              const struct tensor *kv_norm, float eps, const struct rope_args *rope,
                              const struct mla_args *a, struct kv_layer *kv, const struct attn_metadata *md);
void cuda_op_mla_attention(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                           const struct attn_metadata *md, const struct mla_args *a, void *workspace);
void cuda_op_dsa_index_write(struct backend *b, struct tensor *iq, const struct tensor *ik, const struct tensor *norm_w,
                             const struct tensor *norm_b, const struct rope_args *rope, const struct dsa_args *a,
                             struct kv_layer *kv, const struct attn_metadata *md);
void cuda_op_dsa_topk(struct backend *b, int32_t *topk, const struct tensor *iq, const struct tensor *w,
                      const struct kv_layer *kv, const struct attn_metadata *md, const struct dsa_args *a);
atomc_status cuda_op_fill_uniform(struct backend *b, struct tensor *t, uint64_t seed, float lo, float hi,
                                  struct error *err);

// Quantized weights (struct weight with a scheme): cuda_qmatmul.cu, cuda_moe_quant.cu.
void cuda_qmatmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                  const struct tensor *bias);
void cuda_moe_experts_quant(struct backend *b, struct tensor *out, const struct tensor *x,
                            const struct weight *gate_up, const struct weight *down, const int32_t *topk_ids,
                            const float *topk_w, int n_slots, void *workspace);
void cuda_qmatmul_destroy(struct cuda_backend *cb);
// INT8 W8A8 prefill GEMM on cuBLASLt's IMMA (cuda_qgemm.cu): false when it does not take the
// weight / shape (nothing ran). cuda_qgemm_destroy frees its plans (from cuda_qmatmul_destroy).
bool cuda_qgemm_int8(struct cuda_backend *cb, struct tensor *out, const struct tensor *x, const struct weight *w,
                     const struct tensor *bias, int64_t n, int64_t m, int64_t k);
void cuda_qgemm_destroy(struct cuda_backend *cb);
// The grouped MoE path's pieces (cuda_moe.cu) that cuda_moe_quant.cu's prefill GEMM shares: the
// sort of the R routed rows by expert into tiles of bm rows (offsets / tile_start (E + 1), sorted,
// pos (R)), and the combine out[t] = sum_j w[t, j] y[pos[t * n_slots + j]] (bf16, slot order).
void cuda_moe_sort_launch(cudaStream_t s, const int32_t *ids, int64_t R, int E, int bm, int32_t *offsets,
                          int32_t *tile_start, int32_t *sorted, int32_t *pos);
void cuda_moe_combine_launch(cudaStream_t s, __nv_bfloat16 *out, const __nv_bfloat16 *y, const int32_t *ids,
                             const float *w, const int32_t *pos, int64_t n, int n_slots, int E, int64_t H);
void cuda_moe_quant_init(struct cuda_backend *cb); // shared-memory limits of cuda_moe_quant.cu's kernels

// The expert whose row tiles contain `tile`: the last e with tile_start[e] <= tile (binary
// search over the E + 1 prefix sums the sort kernel wrote). Shared by every grouped-GEMM kernel.
__device__ __forceinline__ int moe_tile_expert(const int32_t *tile_start, int E, int tile) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= tile)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}
void cuda_matmul_plans_destroy(struct cuda_backend *cb);
void cuda_attention_init(struct cuda_backend *cb);
void cuda_moe_init(struct cuda_backend *cb);
// Launches the dequantise/convert kernel: n elements of src (dtype sdt, device bytes) to dst (ddt).
void cuda_launch_dequant(cudaStream_t s, void *dst, enum dtype ddt, const void *src, enum dtype sdt, int64_t n);

#endif
