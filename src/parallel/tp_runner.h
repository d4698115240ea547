// Tensor-parallel model runner: tp_size model runners (one per rank, each holding its shard of
// the weights and of the KV heads) driven by one caller. Ranks are threads of this process:
// rank 0 runs on the caller's thread, ranks 1..N-1 on worker threads that wait for the next
// step. Every step the caller hands all ranks the same forward batch (the scheduler runs
// once); the ranks meet in the all-reduces of the forward; every rank computes the same
// logits (replicated lm_head) and rank 0's sampled ids are returned.
//
// Communicator: the shared-memory one on the CPU backend; NCCL (one GPU per rank, device id
// = rank) in CUDA builds. The KV block pool the engine sees is the smallest rank's.
#ifndef ATOMC_PARALLEL_TP_RUNNER_H
#define ATOMC_PARALLEL_TP_RUNNER_H

#include "common/error.h"
#include "runtime/model_runner.h"

struct tp_runner;

// Creates tp_size ranks of the runner described by o (o->backend must be NULL; o->tp_* are
// set per rank). On the CPU each rank gets num_threads / tp_size threads and
// cpu_kv_cache_bytes / tp_size of KV memory. Errors: tp_size < 2, a model whose heads /
// intermediate size it does not divide, fewer GPUs than tp_size, communicator failures.
atomc_status tp_runner_create(const struct runner_options *o, int tp_size, struct tp_runner **out,
                              struct error *err);
void tp_runner_free(struct tp_runner *t);

// As model_runner_execute / model_runner_execute_logits, on every rank; the outputs are
// rank 0's. A failing rank fails the step with its message (prefixed by its rank).
atomc_status tp_runner_execute(struct tp_runner *t, const struct forward_batch *fb, struct runner_output *out,
                               struct error *err);
atomc_status tp_runner_execute_logits(struct tp_runner *t, const struct forward_batch *fb, float *logits,
                                      struct error *err);

int tp_runner_size(const struct tp_runner *t);
struct model_runner *tp_runner_rank(struct tp_runner *t, int rank);
int tp_runner_num_kv_blocks(const struct tp_runner *t); // smallest rank's pool

#endif
