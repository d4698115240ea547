// NCCL communicator on the CUDA backend's stream (see comm.h). Compiled only with CUDA=1.
//
// - Creation: rank 0 makes the ncclUniqueId (comm_nccl_unique_id), the TCP rendezvous hands
//   it out, every rank calls comm_nccl_create on its own backend (one GPU per rank).
//   NCCL_NVLS_ENABLE=0 is set before the first NCCL call: NVLink SHARP / multicast must stay
//   off on the lent H200 machines. The communicator is created non-blocking
//   (config.blocking = 0) and polled with ncclCommGetAsyncError until the deadline, so a
//   rank that never arrives at init is a timeout error (after ncclCommAbort), not a hang.
// - all_reduce_sum / all_gather are enqueued on the backend stream like every other op
//   (asynchronous, capturable into the decode CUDA graphs). Their completion is observed at
//   the next host synchronisation; barrier() (and broadcast_host) wait for the stream with a
//   bounded poll of an event plus ncclCommGetAsyncError, and abort the communicator on
//   timeout, so a dead peer turns into an error at the step boundary.
#include <nccl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_common.cuh"

extern "C" {
#include "common/timeutil.h"
#include "parallel/comm.h"
}

static_assert(sizeof(ncclUniqueId) == COMM_NCCL_ID_BYTES, "ncclUniqueId size");

struct nccl_comm {
    struct comm base;
    struct backend *backend;
    ncclComm_t nc;
    cudaEvent_t done;
    void *d_scratch;       // device bytes for barrier / broadcast staging
    size_t scratch_bytes;
};

static void nccl_env_defaults(void) {
    setenv("NCCL_NVLS_ENABLE", "0", 1); // NVLink multicast off on these machines (forced)
}

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static atomc_status nccl_fail(struct nccl_comm *c, struct error *err, const char *what, ncclResult_t r) {
    return error_set(err, ATOMC_ERR_BACKEND, "NCCL communicator rank %d of %d: %s: %s%s", c->base.rank,
                     c->base.world_size, what, ncclGetErrorString(r),
                     r == ncclRemoteError ? " (a peer failed or died)" : "");
}

// Waits (bounded) until pending NCCL work is issued and, if `stream_too`, until the stream
// has run it. On timeout or an asynchronous NCCL error the communicator is aborted.
static atomc_status nccl_wait(struct nccl_comm *c, bool stream_too, const char *what, struct error *err) {
    struct cuda_backend *cb = cuda_impl(c->backend);
    double deadline = time_now_s() + c->base.timeout_s;
    if (stream_too) CUDA_TRY(err, cudaEventRecord(c->done, cb->stream));
    for (long us = 10;; us = us < 2000 ? us * 2 : 2000) {
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(c->nc, &async);
        if (r != ncclSuccess) return nccl_fail(c, err, what, r);
        if (async != ncclSuccess && async != ncclInProgress) {
            ncclCommAbort(c->nc);
            c->nc = NULL;
            return nccl_fail(c, err, what, async);
        }
        bool issued = async == ncclSuccess;
        bool ran = true;
        if (issued && stream_too) {
            cudaError_t q = cudaEventQuery(c->done);
            if (q != cudaSuccess && q != cudaErrorNotReady) CUDA_TRY(err, q);
            ran = q == cudaSuccess;
        }
        if (issued && ran) return ATOMC_OK;
        if (time_now_s() > deadline) {
            ncclCommAbort(c->nc);
            c->nc = NULL;
            return error_set(err, ATOMC_ERR_BACKEND, "NCCL communicator rank %d of %d: timed out after %.1f s in %s "
                             "(a peer died or hangs); communicator aborted", c->base.rank, c->base.world_size,
                             c->base.timeout_s, what);
        }
        sleep_us(us);
    }
}

static ncclDataType_t nccl_type(enum dtype dt) {
    switch (dt) {
    case DTYPE_F32: return ncclFloat32;
    case DTYPE_BF16: return ncclBfloat16;
    case DTYPE_I32: return ncclInt32;
    default: CHECK_MSG(0, "NCCL dtype %s", dtype_name(dt)); return ncclFloat32;
    }
}

static atomc_status nccl_enqueued(struct nccl_comm *c, ncclResult_t r, const char *what, struct error *err) {
    if (r == ncclInProgress) return nccl_wait(c, false, what, err); // non-blocking comm: wait until issued
    if (r != ncclSuccess) return nccl_fail(c, err, what, r);
    return ATOMC_OK;
}

static atomc_status nccl_all_reduce_sum(struct comm *cm, void *buf, enum dtype dt, size_t count, struct error *err) {
    struct nccl_comm *c = (struct nccl_comm *)cm;
    ncclResult_t r = ncclAllReduce(buf, buf, count, nccl_type(dt), ncclSum, c->nc, cuda_impl(c->backend)->stream);
    return nccl_enqueued(c, r, "all_reduce", err);
}

static atomc_status nccl_all_gather(struct comm *cm, void *dst, const void *src, enum dtype dt, size_t count,
                                    struct error *err) {
    struct nccl_comm *c = (struct nccl_comm *)cm;
    ncclResult_t r = ncclAllGather(src, dst, count, nccl_type(dt), c->nc, cuda_impl(c->backend)->stream);
    return nccl_enqueued(c, r, "all_gather", err);
}

static atomc_status nccl_all_gather_cols(struct comm *cm, void *dst, const void *src, void *tmp, enum dtype dt,
                                        size_t rows, size_t cols, struct error *err) {
    struct nccl_comm *c = (struct nccl_comm *)cm;
    cudaStream_t s = cuda_impl(c->backend)->stream;
    const size_t esz = dtype_row_bytes(dt, 1), block = rows * cols;
    atomc_status st = nccl_enqueued(c, ncclAllGather(src, tmp, block, nccl_type(dt), c->nc, s), "all_gather_cols", err);
    if (st != ATOMC_OK) return st;
    // tmp is (world, rows, cols): rank r's block goes to columns [r cols, (r+1) cols) of dst.
    for (int r = 0; r < cm->world_size; r++)
        CUDA_TRY(err, cudaMemcpy2DAsync((char *)dst + (size_t)r * cols * esz, (size_t)cm->world_size * cols * esz,
                                        (const char *)tmp + (size_t)r * block * esz, cols * esz, cols * esz, rows,
                                        cudaMemcpyDeviceToDevice, s));
    return ATOMC_OK;
}

static atomc_status nccl_broadcast_host(struct comm *cm, void *buf, size_t bytes, int root, struct error *err) {
    struct nccl_comm *c = (struct nccl_comm *)cm;
    cudaStream_t s = cuda_impl(c->backend)->stream;
    for (size_t off = 0; off < bytes; off += c->scratch_bytes) {
        size_t n = bytes - off < c->scratch_bytes ? bytes - off : c->scratch_bytes;
        if (cm->rank == root) CUDA_TRY(err, cudaMemcpyAsync(c->d_scratch, (char *)buf + off, n, cudaMemcpyHostToDevice, s));
        atomc_status st = nccl_enqueued(c, ncclBroadcast(c->d_scratch, c->d_scratch, n, ncclUint8, root, c->nc, s),
                                        "broadcast", err);
        if (st != ATOMC_OK) return st;
        CUDA_TRY(err, cudaMemcpyAsync((char *)buf + off, c->d_scratch, n, cudaMemcpyDeviceToHost, s));
        if ((st = nccl_wait(c, true, "broadcast", err)) != ATOMC_OK) return st;
    }
    return ATOMC_OK;
}

static atomc_status nccl_barrier(struct comm *cm, struct error *err) {
    struct nccl_comm *c = (struct nccl_comm *)cm;
    ncclResult_t r = ncclAllReduce(c->d_scratch, c->d_scratch, 1, ncclInt32, ncclSum, c->nc,
                                   cuda_impl(c->backend)->stream);
    atomc_status st = nccl_enqueued(c, r, "barrier", err);
    if (st != ATOMC_OK) return st;
    return nccl_wait(c, true, "barrier", err);
}

static void nccl_destroy(struct comm *cm) {
    struct nccl_comm *c = (struct nccl_comm *)cm;
    if (c->nc) {
        if (cm->broken) ncclCommAbort(c->nc);
        else ncclCommDestroy(c->nc);
    }
    if (c->done) cudaEventDestroy(c->done);
    if (c->d_scratch) cudaFree(c->d_scratch);
    free(c);
}

static const struct comm_ops NCCL_OPS = {
    "nccl", nccl_all_reduce_sum, nccl_all_gather, nccl_all_gather_cols, nccl_broadcast_host, nccl_barrier, nccl_destroy,
};

extern "C" atomc_status comm_nccl_device_count(int *count, struct error *err) {
    *count = 0;
    cudaError_t e = cudaGetDeviceCount(count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        cudaGetLastError();
        *count = 0;
        return ATOMC_OK;
    }
    CUDA_TRY(err, e);
    return ATOMC_OK;
}

extern "C" atomc_status comm_nccl_unique_id(unsigned char id[COMM_NCCL_ID_BYTES], struct error *err) {
    nccl_env_defaults();
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) return error_set(err, ATOMC_ERR_BACKEND, "ncclGetUniqueId: %s", ncclGetErrorString(r));
    memcpy(id, &u, sizeof u);
    return ATOMC_OK;
}

extern "C" atomc_status comm_nccl_create(struct backend *b, const unsigned char id[COMM_NCCL_ID_BYTES], int rank,
                                         int world_size, double timeout_s, struct comm **out, struct error *err) {
    *out = NULL;
    if (b->kind != BACKEND_CUDA)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "NCCL communicator needs the CUDA backend, got %s", b->ops->name);
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "NCCL communicator: rank %d outside world size %d", rank,
                         world_size);
    nccl_env_defaults();
    struct cuda_backend *cb = cuda_impl(b);
    CUDA_TRY(err, cudaSetDevice(cb->device));
    struct nccl_comm *c = (struct nccl_comm *)calloc(1, sizeof *c);
    CHECK(c);
    c->base.ops = &NCCL_OPS;
    c->base.rank = rank;
    c->base.world_size = world_size;
    c->base.timeout_s = timeout_s > 0 ? timeout_s : comm_default_timeout_s();
    c->backend = b;
    c->scratch_bytes = (size_t)1 << 20;
    atomc_status st = ATOMC_OK;
    cudaError_t ce = cudaMalloc(&c->d_scratch, c->scratch_bytes);
    if (ce == cudaSuccess) ce = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (ce != cudaSuccess) {
        st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "NCCL communicator: %s", cudaGetErrorString(ce));
        nccl_destroy(&c->base);
        return st;
    }
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&c->nc, world_size, u, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = error_set(err, ATOMC_ERR_BACKEND, "ncclCommInitRank (rank %d of %d): %s", rank, world_size,
                       ncclGetErrorString(r));
        c->nc = NULL;
        nccl_destroy(&c->base);
        return st;
    }
    if ((st = nccl_wait(c, false, "init", err)) != ATOMC_OK) {
        nccl_destroy(&c->base);
        return st;
    }
    *out = &c->base;
    return ATOMC_OK;
}
