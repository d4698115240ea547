// Structured output: a small pool of threads that fills a step's grammar masks in parallel
// (engine_grammar.c; bench/grammar_mask_bench.c times it). A job is n independent calls
// fill(ctx, 0..n-1); the threads, and the thread that joins, take the indices from one shared
// counter, so each index runs exactly once, on one thread. No hidden globals: two engines own
// two pools.
//
//   grammar_pool_begin  hands a job over and wakes min(n, max_threads) threads (started on
//                       first need); returns at once. false: no thread could be started, the
//                       job was not handed over (the caller runs it itself).
//   grammar_pool_join   takes the indices no thread has claimed yet (on a loaded machine the
//                       threads may not have been scheduled: the caller fills rather than
//                       waits), then waits for the claimed ones. A no-op when no job is pending,
//                       so it may be called twice per job. After it returns every fill's writes
//                       are visible to the caller.
// begin and join are called by one thread at a time (the engine's loop thread), in turn.
#ifndef ATOMC_GRAMMAR_GRAMMAR_POOL_H
#define ATOMC_GRAMMAR_GRAMMAR_POOL_H

#include <stdbool.h>
#include <stdint.h>

struct grammar_pool;
typedef void (*grammar_pool_fill_fn)(void *ctx, int index);

struct grammar_pool *grammar_pool_create(int max_threads); // max_threads >= 1
void grammar_pool_free(struct grammar_pool *p);            // joins the threads; no job pending
bool grammar_pool_begin(struct grammar_pool *p, int n, grammar_pool_fill_fn fill, void *ctx);
void grammar_pool_join(struct grammar_pool *p);
// Fills run by the pool's threads / by the joining thread so far, and the threads started.
void grammar_pool_counts(const struct grammar_pool *p, uint64_t *by_threads, uint64_t *by_join, int *n_threads);

#endif
