// The communicator: collectives among the ranks of one tensor-parallel group.
//
// Two implementations share this interface:
// - comm_shm.c: CPU ranks on one host (threads of one process or separate processes)
//   over a POSIX shared-memory segment; buffers are host (= CPU backend) memory.
// - comm_nccl.cu (CUDA builds): NCCL on the CUDA backend's stream; buffers are device
//   memory, ops are enqueued asynchronously like every other backend op.
//
// Contract (every implementation):
// - Every rank calls the same sequence of ops with the same counts and dtypes (SPMD).
// - Ops return ATOMC_OK or a status with a message; a peer that does not arrive within
//   the communicator's timeout produces ATOMC_ERR_BACKEND naming the op and the wait,
//   never a hang. After any failure the communicator is broken: every later op fails at
//   once (the group must be rebuilt; the server reports unhealthy).
// - all_reduce_sum sums in place: F32 and BF16 (BF16 accumulates in F32). Results are
//   bitwise identical on every rank (one rank reduces each element, in rank order), so
//   replicated computation after a reduction stays identical across ranks.
// - all_gather: dst (world_size * count elements) receives rank r's src at offset
//   r * count; src and dst must not overlap.
// - all_gather_cols: every rank holds src (rows, cols); dst (rows, world_size * cols) gets
//   rank r's block in columns [r * cols, (r + 1) * cols) (the vocab-parallel lm_head's logits
//   shards side by side). tmp: world_size * rows * cols elements of backend memory that an
//   implementation may use for staging (NCCL gathers there, then one strided copy per rank).
// - broadcast_host: `bytes` of host memory from `root` to every rank.
#ifndef ATOMC_PARALLEL_COMM_H
#define ATOMC_PARALLEL_COMM_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"
#include "core/dtype.h"

struct comm;

struct comm_ops {
    const char *name;
    atomc_status (*all_reduce_sum)(struct comm *c, void *buf, enum dtype dt, size_t count, struct error *err);
    atomc_status (*all_gather)(struct comm *c, void *dst, const void *src, enum dtype dt, size_t count,
                               struct error *err);
    atomc_status (*all_gather_cols)(struct comm *c, void *dst, const void *src, void *tmp, enum dtype dt,
                                    size_t rows, size_t cols, struct error *err);
    atomc_status (*broadcast_host)(struct comm *c, void *buf, size_t bytes, int root, struct error *err);
    atomc_status (*barrier)(struct comm *c, struct error *err);
    void (*destroy)(struct comm *c);
};

struct comm {
    const struct comm_ops *ops;
    int rank;
    int world_size;
    double timeout_s;  // longest wait for a peer in one op
    bool broken;       // set by the first failed op
    void *impl;
};

// Default peer timeout: env ATOMC_COMM_TIMEOUT_S if set (> 0), else 300 s (a first
// forward of a large model on a slow rank must not trip it).
double comm_default_timeout_s(void);

// Wrappers: check the broken flag and the arguments, call the op, mark broken on failure.
atomc_status comm_all_reduce_sum(struct comm *c, void *buf, enum dtype dt, size_t count, struct error *err);
atomc_status comm_all_gather(struct comm *c, void *dst, const void *src, enum dtype dt, size_t count,
                             struct error *err);
atomc_status comm_all_gather_cols(struct comm *c, void *dst, const void *src, void *tmp, enum dtype dt, size_t rows,
                                  size_t cols, struct error *err);
atomc_status comm_broadcast_host(struct comm *c, void *buf, size_t bytes, int root, struct error *err);
atomc_status comm_barrier(struct comm *c, struct error *err);
void comm_destroy(struct comm *c);

// Shared-memory communicator (comm_shm.c). Every rank calls it with the same `name`
// (a POSIX shm name such as "/atomc-tp-1234-0") and world_size. Rank 0 creates the
// segment; the others attach, retrying until timeout_s; once all have attached the name
// is unlinked, so nothing is left in /dev/shm even if a rank later dies. slot_bytes is the
// staging size per rank (0 = 4 MiB); larger ops are done in chunks.
atomc_status comm_shm_create(const char *name, int rank, int world_size, size_t slot_bytes, double timeout_s,
                             struct comm **out, struct error *err);

#ifdef ATOMC_CUDA
struct backend;
// NCCL communicator on `b`'s stream (comm_nccl.cu). unique_id: the 128-byte ncclUniqueId
// made by comm_nccl_unique_id on rank 0 and handed out by the rendezvous.
#define COMM_NCCL_ID_BYTES 128
// Number of visible CUDA devices (for the "fewer GPUs than ranks" check).
atomc_status comm_nccl_device_count(int *count, struct error *err);
atomc_status comm_nccl_unique_id(unsigned char id[COMM_NCCL_ID_BYTES], struct error *err);
atomc_status comm_nccl_create(struct backend *b, const unsigned char id[COMM_NCCL_ID_BYTES], int rank,
                              int world_size, double timeout_s, struct comm **out, struct error *err);
#endif

#endif
