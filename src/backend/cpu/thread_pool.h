// A persistent pool of worker threads for the CPU backend: one parallel-for over an index
// range [0, n) at a time, split into chunks that threads claim dynamically, with the calling
// thread working as thread 0 and returning only when every chunk is done (the barrier).
//
// Threads are created once (thread_pool_create) and sleep on a condition variable between
// jobs after a short spin, so an op costs a wake-up, not a pthread_create. Any thread may call
// thread_pool_parallel_for; concurrent callers are serialised by a dispatch mutex. A job must
// not call thread_pool_parallel_for on the same pool (it would deadlock; CHECKed).
#ifndef ATOMC_BACKEND_CPU_THREAD_POOL_H
#define ATOMC_BACKEND_CPU_THREAD_POOL_H

#include <stdint.h>

#include "common/error.h"

// Runs items [begin, end) on worker `tid` (0 = the calling thread, < thread_pool_size()).
typedef void (*thread_pool_fn)(void *ctx, int64_t begin, int64_t end, int tid);

struct thread_pool;

// n_threads >= 1 counts the calling thread: n_threads - 1 workers are started.
atomc_status thread_pool_create(int n_threads, struct thread_pool **out, struct error *err);
void thread_pool_free(struct thread_pool *p);
int thread_pool_size(const struct thread_pool *p);

// Calls fn over [0, n) in chunks of at least `grain` items (grain >= 1) on all threads and waits.
// Runs inline on the calling thread when n <= grain or the pool has one thread.
void thread_pool_parallel_for(struct thread_pool *p, int64_t n, int64_t grain, thread_pool_fn fn, void *ctx);

#endif
