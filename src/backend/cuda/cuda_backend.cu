// The CUDA backend: creation, memory, weight upload, CUDA graphs and the op vtable.
// Kernels live in the sibling .cu files; this file owns the per-backend state.
//
// Contract (see backend.h): one stream per backend; every op is asynchronous on it; ops
// never allocate except the grow-only scratch buffers, which grow only outside stream
// capture. Activations and weights are BF16 (act_dtype / weight_dtype); ops also accept F32
// activations where that is cheap (norms, element-wise ops, conversions).
#include "backend/cuda/cuda_common.cuh"

#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------------------
// Dequantisation / conversion of uploaded weights (runs on the device, from raw host bytes).

__device__ __forceinline__ float half_bits_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)p[0] | ((uint16_t)p[1] << 8);
    return __half2float(__ushort_as_half(h));
}

template <typename D> __global__ void dequant_kernel(D *dst, const uint8_t *src, int sdt, int64_t n) {
    pdl_begin();
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        switch (sdt) {
        case DTYPE_F32:
            v = reinterpret_cast<const float *>(src)[i];
            break;
        case DTYPE_F16:
            v = __half2float(reinterpret_cast<const __half *>(src)[i]);
            break;
        case DTYPE_BF16:
            v = __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(src)[i]);
            break;
        case DTYPE_FP8_E4M3: {
            __nv_fp8_e4m3 f;
            f.__x = src[i];
            v = (float)f;
            break;
        }
        case DTYPE_Q8_0: {
            const uint8_t *blk = src + (i / 32) * 34;
            v = half_bits_to_f32(blk) * (float)(int8_t)blk[2 + i % 32];
            break;
        }
        case DTYPE_Q4_0: {
            const uint8_t *blk = src + (i / 32) * 18;
            int j = (int)(i % 32);
            int q = j < 16 ? (blk[2 + j] & 0xf) : (blk[2 + j - 16] >> 4);
            v = half_bits_to_f32(blk) * (float)(q - 8);
            break;
        }
        case DTYPE_Q4_1: {
            const uint8_t *blk = src + (i / 32) * 20;
            int j = (int)(i % 32);
            int q = j < 16 ? (blk[4 + j] & 0xf) : (blk[4 + j - 16] >> 4);
            v = half_bits_to_f32(blk) * (float)q + half_bits_to_f32(blk + 2);
            break;
        }
        default:
            v = 0.0f;
            break;
        }
        dst[i] = from_f32<D>(v);
    }
}

void cuda_launch_dequant(cudaStream_t s, void *dst, enum dtype ddt, const void *src, enum dtype sdt, int64_t n) {
    if (n == 0) return;
    unsigned grid = (unsigned)(n / 256 + 1 < 65536 ? n / 256 + 1 : 65536);
    const uint8_t *sp = (const uint8_t *)src;
    switch (ddt) {
    case DTYPE_F32:
        pdl_launch(dequant_kernel<float>, grid, 256, 0, s, (float *)dst, sp, sdt, n);
        break;
    case DTYPE_BF16:
        pdl_launch(dequant_kernel<__nv_bfloat16>, grid, 256, 0, s, (__nv_bfloat16 *)dst, sp, sdt, n);
        break;
    case DTYPE_F16:
        pdl_launch(dequant_kernel<__half>, grid, 256, 0, s, (__half *)dst, sp, sdt, n);
        break;
    default:
        CHECK_MSG(0, "dequant to %s unsupported", dtype_name(ddt));
    }
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------------------------------
// Memory.

static void *cuda_alloc(struct backend *b, size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 16;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError(); // clear the sticky-free allocation error
        return NULL;
    }
    return p;
}

static void cuda_free(struct backend *b, void *p) {
    if (p) CUDA_CHECK(cudaFree(p));
}

static void cuda_copy_h2d(struct backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_impl(b)->stream));
}

// Synchronous: the host buffer is valid when this returns.
static void cuda_copy_d2h(struct backend *b, void *dst, const void *src, size_t bytes) {
    struct cuda_backend *cb = cuda_impl(b);
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream));
    CUDA_CHECK(cudaStreamSynchronize(cb->stream));
}

static void cuda_copy_d2d(struct backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_impl(b)->stream));
}

static void cuda_memset_zero(struct backend *b, void *dst, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda_impl(b)->stream));
}

static void cuda_synchronize(struct backend *b) {
    CUDA_CHECK(cudaStreamSynchronize(cuda_impl(b)->stream));
}

// Events and the side stream (backend.h): the KV-transfer producer's I/O thread waits for a
// layer's event and reads that layer's rows on the side stream while later layers compute.
static void *cuda_event_new(struct backend *b) {
    cudaEvent_t ev = NULL;
    CUDA_CHECK(cudaSetDevice(cuda_impl(b)->device));
    CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    return (void *)ev;
}

static void cuda_event_free(struct backend *b, void *ev) {
    (void)b;
    if (ev) cudaEventDestroy((cudaEvent_t)ev);
}

static void cuda_event_record(struct backend *b, void *ev) {
    CUDA_CHECK(cudaEventRecord((cudaEvent_t)ev, cuda_impl(b)->stream));
}

static void cuda_event_sync(struct backend *b, void *ev) {
    CUDA_CHECK(cudaSetDevice(cuda_impl(b)->device));
    CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)ev));
}

static void cuda_copy_d2h_side(struct backend *b, void *dst, const void *src, size_t bytes) {
    struct cuda_backend *cb = cuda_impl(b);
    if (!bytes) return;
    CUDA_CHECK(cudaSetDevice(cb->device));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->side_stream));
    CUDA_CHECK(cudaStreamSynchronize(cb->side_stream));
}

static void cuda_memory_info(struct backend *b, size_t *free_bytes, size_t *total_bytes) {
    CUDA_CHECK(cudaSetDevice(cuda_impl(b)->device));
    CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

size_t cuda_scratch_reserve(struct cuda_backend *cb, void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return *cap;
    if (cuda_is_capturing(cb)) return *cap;
    size_t want = need + need / 4;
    void *p = NULL;
    // Earlier work on the stream may still read the old buffer.
    CUDA_CHECK(cudaStreamSynchronize(cb->stream));
    if (cudaMalloc(&p, want) != cudaSuccess) {
        cudaGetLastError();
        return *cap;
    }
    if (*buf && cb->live_graphs > 0) { // captured graphs may hold *buf: keep it until they are gone
        if (cb->n_retired == cb->retired_cap) {
            int cap = cb->retired_cap ? 2 * cb->retired_cap : 8;
            void **r = (void **)realloc(cb->retired, sizeof(void *) * (size_t)cap);
            CHECK_MSG(r, "out of host memory");
            cb->retired = r;
            cb->retired_cap = cap;
        }
        cb->retired[cb->n_retired++] = *buf;
    } else if (*buf) {
        CUDA_CHECK(cudaFree(*buf));
    }
    CUDA_CHECK(cudaMemsetAsync(p, 0, want, cb->stream));
    *buf = p;
    *cap = want;
    return want;
}

// ---------------------------------------------------------------------------------------
// Weight upload: host bytes -> pinned staging (memcpy on the host) -> device (async copy),
// then a conversion kernel when the dtypes differ. Two staging slots alternate so the host
// copy of chunk i+1 overlaps the transfer and conversion of chunk i.

static atomc_status cuda_upload_weight(struct backend *b, struct tensor *dst, const struct tensor *src,
                                       struct error *err) {
    struct cuda_backend *cb = cuda_impl(b);
    dst->data = NULL;
    if (tensor_numel(dst) != tensor_numel(src))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "upload_weight: %lld elements into a tensor of %lld",
                         (long long)tensor_numel(src), (long long)tensor_numel(dst));
    enum dtype sdt = src->dtype, ddt = dst->dtype;
    bool src_ok = sdt == DTYPE_F32 || sdt == DTYPE_F16 || sdt == DTYPE_BF16 || sdt == DTYPE_FP8_E4M3 ||
                  sdt == DTYPE_Q8_0 || sdt == DTYPE_Q4_0 || sdt == DTYPE_Q4_1;
    if (!src_ok || (sdt != ddt && ddt != DTYPE_F32 && ddt != DTYPE_BF16 && ddt != DTYPE_F16))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "upload_weight: %s -> %s is not supported on CUDA",
                         dtype_name(sdt), dtype_name(ddt));
    int64_t n = tensor_numel(src);
    int be = dtype_block_elems(sdt);
    if (n % be)
        return error_set(err, ATOMC_ERR_FORMAT, "upload_weight: %lld elements is not a multiple of the %s block (%d)",
                         (long long)n, dtype_name(sdt), be);
    size_t dbytes = tensor_bytes(dst);
    void *d = NULL;
    CUDA_TRY(err, cudaMalloc(&d, dbytes ? dbytes : 16));
    size_t bb = dtype_block_bytes(sdt);
    int64_t blocks_per_chunk = (int64_t)(cb->staging_bytes / bb);
    int64_t nblocks = n / be;
    const uint8_t *hs = (const uint8_t *)src->data;
    int slot = 0;
    for (int64_t blk0 = 0; blk0 < nblocks; blk0 += blocks_per_chunk, slot ^= 1) {
        int64_t nb = nblocks - blk0 < blocks_per_chunk ? nblocks - blk0 : blocks_per_chunk;
        size_t bytes = (size_t)nb * bb;
        cudaError_t e = cudaEventSynchronize(cb->staging_done[slot]);
        if (e == cudaSuccess) {
            memcpy(cb->pinned[slot], hs + (size_t)blk0 * bb, bytes);
            int64_t e0 = blk0 * be;
            if (sdt == ddt) {
                e = cudaMemcpyAsync((uint8_t *)d + (size_t)blk0 * bb, cb->pinned[slot], bytes, cudaMemcpyHostToDevice,
                                    cb->stream);
            } else {
                e = cudaMemcpyAsync(cb->staging[slot], cb->pinned[slot], bytes, cudaMemcpyHostToDevice, cb->stream);
                if (e == cudaSuccess)
                    cuda_launch_dequant(cb->stream, (uint8_t *)d + dtype_row_bytes(ddt, e0), ddt, cb->staging[slot],
                                        sdt, nb * be);
            }
        }
        if (e == cudaSuccess) e = cudaEventRecord(cb->staging_done[slot], cb->stream);
        if (e != cudaSuccess) {
            cudaStreamSynchronize(cb->stream);
            cudaFree(d);
            cudaGetLastError();
            return error_set(err, ATOMC_ERR_BACKEND, "upload_weight: CUDA error %s", cudaGetErrorString(e));
        }
    }
    dst->data = d;
    dst->scale = src->scale;
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------
// CUDA graphs: stream capture on the backend stream.

static atomc_status cuda_graph_begin(struct backend *b, struct error *err) {
    CUDA_TRY(err, cudaStreamBeginCapture(cuda_impl(b)->stream, cudaStreamCaptureModeThreadLocal));
    return ATOMC_OK;
}

static atomc_status cuda_graph_end(struct backend *b, void **graph, struct error *err) {
    cudaGraph_t g = NULL;
    *graph = NULL;
    CUDA_TRY(err, cudaStreamEndCapture(cuda_impl(b)->stream, &g));
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return error_set(err, ATOMC_ERR_BACKEND, "CUDA graph instantiation failed: %s", cudaGetErrorString(e));
    }
    *graph = exec;
    cuda_impl(b)->live_graphs++;
    return ATOMC_OK;
}

// Frees the scratch buffers retired while graphs were alive (none is left that holds them).
static void cuda_free_retired(struct cuda_backend *cb) {
    if (!cb->n_retired) return;
    CUDA_CHECK(cudaStreamSynchronize(cb->stream));
    for (int i = 0; i < cb->n_retired; i++)
        CUDA_CHECK(cudaFree(cb->retired[i]));
    cb->n_retired = 0;
}

static atomc_status cuda_graph_launch(struct backend *b, void *graph, struct error *err) {
    CUDA_TRY(err, cudaGraphLaunch((cudaGraphExec_t)graph, cuda_impl(b)->stream));
    return ATOMC_OK;
}

static void cuda_graph_destroy(struct backend *b, void *graph) {
    if (!graph) return;
    struct cuda_backend *cb = cuda_impl(b);
    CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
    if (--cb->live_graphs == 0) cuda_free_retired(cb);
}

// ---------------------------------------------------------------------------------------
// Creation.

static void cuda_destroy(struct backend *b) {
    struct cuda_backend *cb = cuda_impl(b);
    if (!cb) return;
    cudaSetDevice(cb->device);
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    cuda_matmul_plans_destroy(cb);
    cuda_qmatmul_destroy(cb);
    free(cb->plans);
    if (cb->lt) cublasLtDestroy(cb->lt);
    cudaFree(cb->lt_workspace);
    for (int i = 0; i < cb->n_retired; i++)
        cudaFree(cb->retired[i]);
    free(cb->retired);
    cudaFree(cb->attn_scratch);
    cudaFree(cb->mla_expand);
    cudaFree(cb->sample_counts);
    cudaFree(cb->argmax_scratch);
    for (int i = 0; i < 2; i++) {
        if (cb->pinned[i]) cudaFreeHost(cb->pinned[i]);
        cudaFree(cb->staging[i]);
        if (cb->staging_done[i]) cudaEventDestroy(cb->staging_done[i]);
    }
    if (cb->side_stream) cudaStreamDestroy(cb->side_stream);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    free(cb);
}

static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .copy_d2d = cuda_copy_d2d,
    .memset_zero = cuda_memset_zero,
    .synchronize = cuda_synchronize,
    .event_new = cuda_event_new,
    .event_free = cuda_event_free,
    .event_record = cuda_event_record,
    .event_sync = cuda_event_sync,
    .copy_d2h_side = cuda_copy_d2h_side,
    .memory_info = cuda_memory_info,
    .upload_weight = cuda_upload_weight,
    .embedding = cuda_op_embedding,
    .rmsnorm = cuda_op_rmsnorm,
    .add_rmsnorm = cuda_op_add_rmsnorm,
    .matmul = cuda_op_matmul,
    .rope_kv_write = cuda_op_rope_kv_write,
    .attention = cuda_op_attention,
    .silu_mul = cuda_op_silu_mul,
    .add = cuda_op_add,
    .gather_rows = cuda_op_gather_rows,
    .convert = cuda_op_convert,
    .sample = cuda_op_sample,
    .fill_uniform = cuda_op_fill_uniform,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_destroy = cuda_graph_destroy,
    .moe_route = cuda_op_moe_route,
    .moe_experts = cuda_op_moe_experts,
    .mla_latent_write = cuda_op_mla_latent_write,
    .mla_attention = cuda_op_mla_attention,
    .deltanet_conv = cuda_op_deltanet_conv,
    .deltanet_rule = cuda_op_deltanet_rule,
    .rmsnorm_gated = cuda_op_rmsnorm_gated,
    .gate_sigmoid_mul = cuda_op_gate_sigmoid_mul,
    .dsa_index_write = cuda_op_dsa_index_write,
    .dsa_topk = cuda_op_dsa_topk,
};

// Everything backend_cuda_create makes after the struct itself; on failure the caller frees
// what was made with cuda_destroy (every field it releases starts NULL).
static atomc_status cuda_create_resources(struct cuda_backend *cb, struct error *err) {
    CUDA_TRY(err, cudaSetDevice(cb->device));
    CUDA_TRY(err, cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking));
    CUDA_TRY(err, cudaStreamCreateWithFlags(&cb->side_stream, cudaStreamNonBlocking));
    cublasStatus_t ls = cublasLtCreate(&cb->lt);
    if (ls != CUBLAS_STATUS_SUCCESS) {
        cb->lt = NULL;
        return error_set(err, ATOMC_ERR_BACKEND, "cublasLtCreate failed: %s", cublas_status_str(ls));
    }
    cb->lt_workspace_bytes = 64u << 20;
    CUDA_TRY(err, cudaMalloc(&cb->lt_workspace, cb->lt_workspace_bytes));
    cb->plans = (struct matmul_plan *)calloc(MATMUL_PLAN_CAP, sizeof(struct matmul_plan));
    if (!cb->plans) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of host memory");
    cb->staging_bytes = 32u << 20;
    for (int i = 0; i < 2; i++) {
        CUDA_TRY(err, cudaHostAlloc(&cb->pinned[i], cb->staging_bytes, cudaHostAllocDefault));
        CUDA_TRY(err, cudaMalloc(&cb->staging[i], cb->staging_bytes));
        CUDA_TRY(err, cudaEventCreateWithFlags(&cb->staging_done[i], cudaEventDisableTiming));
    }
    // Initial scratch so that small captured batches need no growth.
    cuda_scratch_reserve(cb, &cb->attn_scratch, &cb->attn_scratch_bytes, 32u << 20);
    cuda_attention_init(cb);
    cuda_moe_init(cb);
    CUDA_TRY(err, cudaStreamSynchronize(cb->stream));
    return ATOMC_OK;
}

extern "C" bool backend_cuda_usable(char *why, size_t why_len) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        cudaGetLastError();
        snprintf(why, why_len, "%s", e != cudaSuccess ? cudaGetErrorString(e) : "0 CUDA devices");
        return false;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        cudaGetLastError();
        snprintf(why, why_len, "cannot query CUDA device 0");
        return false;
    }
    snprintf(why, why_len, "%s, sm_%d%d, %d device%s", prop.name, prop.major, prop.minor, ndev, ndev > 1 ? "s" : "");
    return prop.major >= 9;
}

extern "C" atomc_status backend_cuda_create(const struct backend_options *o, struct backend **out, struct error *err) {
    *out = NULL;
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        cudaGetLastError();
        return error_set(err, ATOMC_ERR_BACKEND, "no CUDA device available (%s)",
                         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    int dev = o ? o->device_id : 0;
    if (dev < 0 || dev >= ndev)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist (%d devices)", dev, ndev);
    cudaDeviceProp prop;
    CUDA_TRY(err, cudaGetDeviceProperties(&prop, dev));
    if (prop.major < 9)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "CUDA device %d (%s, sm_%d%d) is not Hopper: atomc is built for sm_90a", dev, prop.name,
                         prop.major, prop.minor);

    struct cuda_backend *cb = (struct cuda_backend *)calloc(1, sizeof *cb);
    if (!cb) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of host memory");
    cb->base.ops = &cuda_ops;
    cb->base.caps = &backend_cuda_caps;
    cb->base.kind = BACKEND_CUDA;
    cb->base.device_id = dev;
    cb->base.act_dtype = DTYPE_BF16;
    cb->base.weight_dtype = DTYPE_BF16;
    cb->base.num_threads = 1;
    cb->base.impl = cb;
    cb->device = dev;
    cb->num_sms = prop.multiProcessorCount;
    cb->max_smem_optin = prop.sharedMemPerBlockOptin;

    atomc_status st = cuda_create_resources(cb, err);
    if (st != ATOMC_OK) {
        cuda_destroy(&cb->base);
        return st;
    }
    *out = &cb->base;
    return ATOMC_OK;
}
