// The cuda_ipc connector's GPU side (kv_connector.h): export the KV pool's IPC handle, open a
// peer's, copy blocks between the two pools with cudaMemcpyAsync on one stream. Two processes
// on one host (one GPU or two; the copy is device to device either way). Compiled with the
// CUDA runtime API in CUDA builds; without CUDA every entry point is UNSUPPORTED.
//
// Layout: both pools have the same geometry (the handshake checked dtype, block size, layers
// and per-token bytes), so block b of layer l, K side, lives at k_offset[l] + b * bs * k_row in
// both; a block's first n rows are contiguous (rows are token-major inside a block).
#include <string.h>

#include "kv_transfer/kv_connector.h"

#ifdef ATOMC_CUDA
#include <cuda_runtime_api.h>

atomc_status kv_ipc_export(const struct kv_pool_view *pool, uint8_t handle[KV_IPC_HANDLE_BYTES], struct error *err) {
    cudaIpcMemHandle_t h;
    _Static_assert(sizeof h <= KV_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t is 64 bytes");
    cudaError_t e = cudaSetDevice(pool->device);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&h, pool->base);
    if (e != cudaSuccess)
        return error_set(err, ATOMC_ERR_BACKEND, "cudaIpcGetMemHandle of the KV pool: %s", cudaGetErrorString(e));
    memset(handle, 0, KV_IPC_HANDLE_BYTES);
    memcpy(handle, &h, sizeof h);
    return ATOMC_OK;
}

atomc_status kv_ipc_open(const uint8_t handle[KV_IPC_HANDLE_BYTES], int device, void **remote_base, struct error *err) {
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaIpcOpenMemHandle(remote_base, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        *remote_base = NULL;
        return error_set(err, ATOMC_ERR_BACKEND, "cudaIpcOpenMemHandle of the producer's KV pool: %s",
                         cudaGetErrorString(e));
    }
    return ATOMC_OK;
}

void kv_ipc_close(void *remote_base) {
    if (remote_base) cudaIpcCloseMemHandle(remote_base);
}

atomc_status kv_ipc_copy(const struct kv_pool_view *pool, void *remote_base, const int32_t *src_blocks,
                         const int32_t *dst_blocks, int n_tokens, size_t *bytes, struct error *err) {
    *bytes = 0;
    cudaError_t e = cudaSetDevice(pool->device);
    cudaStream_t s = NULL;
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    int bs = pool->block_size, n_blocks = (n_tokens + bs - 1) / bs;
    for (int l = 0; l < pool->n_layers && e == cudaSuccess; l++) {
        size_t rows[2] = {pool->k_row_bytes[l], pool->v_row_bytes[l]};
        size_t offs[2] = {pool->k_offset[l], pool->v_offset[l]};
        for (int kv = 0; kv < 2 && e == cudaSuccess; kv++) {
            if (!rows[kv]) continue;
            for (int b = 0; b < n_blocks && e == cudaSuccess; b++) {
                int n = n_tokens - b * bs < bs ? n_tokens - b * bs : bs;
                size_t blk = (size_t)bs * rows[kv], len = (size_t)n * rows[kv];
                const char *src = (const char *)remote_base + offs[kv] + (size_t)src_blocks[b] * blk;
                char *dst = (char *)pool->base + offs[kv] + (size_t)dst_blocks[b] * blk;
                e = cudaMemcpyAsync(dst, src, len, cudaMemcpyDeviceToDevice, s);
                *bytes += len;
            }
        }
    }
    if (s) {
        cudaError_t e2 = cudaStreamSynchronize(s);
        if (e == cudaSuccess) e = e2;
        cudaStreamDestroy(s);
    }
    if (e != cudaSuccess)
        return error_set(err, ATOMC_ERR_BACKEND, "copying KV blocks from the producer's pool: %s",
                         cudaGetErrorString(e));
    return ATOMC_OK;
}

#else

atomc_status kv_ipc_export(const struct kv_pool_view *pool, uint8_t handle[KV_IPC_HANDLE_BYTES], struct error *err) {
    (void)pool;
    (void)handle;
    return error_set(err, ATOMC_ERR_UNSUPPORTED, "kv_connector \"cuda_ipc\" needs a CUDA build (make CUDA=1)");
}

atomc_status kv_ipc_open(const uint8_t handle[KV_IPC_HANDLE_BYTES], int device, void **remote_base, struct error *err) {
    (void)handle;
    (void)device;
    *remote_base = NULL;
    return error_set(err, ATOMC_ERR_UNSUPPORTED, "kv_connector \"cuda_ipc\" needs a CUDA build (make CUDA=1)");
}

void kv_ipc_close(void *remote_base) {
    (void)remote_base;
}

atomc_status kv_ipc_copy(const struct kv_pool_view *pool, void *remote_base, const int32_t *src_blocks,
                         const int32_t *dst_blocks, int n_tokens, size_t *bytes, struct error *err) {
    (void)pool;
    (void)remote_base;
    (void)src_blocks;
    (void)dst_blocks;
    (void)n_tokens;
    *bytes = 0;
    return error_set(err, ATOMC_ERR_UNSUPPORTED, "kv_connector \"cuda_ipc\" needs a CUDA build (make CUDA=1)");
}

#endif
