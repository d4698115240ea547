// Data parallelism: N independent engine replicas (each with its own model copy, KV pool,
// scheduler and loop thread) behind one request interface that sends every new request to
// the replica with the fewest outstanding tokens.
//
// Outstanding tokens of a replica = sum over its live requests of (prompt tokens + tokens
// still to generate): a request is charged prompt + max_tokens when routed (text prompts:
// bytes / 4 as the token estimate; max_tokens -1: max_model_len - prompt), every output
// refunds its new tokens, and the final output refunds the rest. Counters are atomics: outputs
// arrive on the replicas' loop threads. Ties go to the lowest replica index.
//
// Request ids are (replica's id) * DP_ROUTER_MAX_REPLICAS + replica, so abort finds the
// replica without a table. Callbacks see the routed id in atomc_output.request_id.
//
// Replicas run on the CPU backend (num_threads split between them); on CUDA each replica
// would need its own device id, which atomc_engine_options does not carry yet, so
// data_parallel_size > 1 with device "cuda" is rejected with a clear message.
#ifndef ATOMC_PARALLEL_DP_ROUTER_H
#define ATOMC_PARALLEL_DP_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"

#define DP_ROUTER_MAX_REPLICAS 64

struct dp_router;

atomc_status dp_router_create(const atomc_engine_options *o, int dp_size, struct dp_router **out, char *err,
                              size_t err_len);
void dp_router_free(struct dp_router *r); // stops the replicas' loops, aborts their requests

// Routes the request (see above); *out_id receives the routed id.
atomc_status dp_router_add_request(struct dp_router *r, const atomc_request *req, uint64_t *out_id, char *err,
                                   size_t err_len);
atomc_status dp_router_abort(struct dp_router *r, uint64_t id);

// Background loops of every replica (serving), or stepping by hand (tests, offline runs).
atomc_status dp_router_start(struct dp_router *r);
int dp_router_step(struct dp_router *r);     // one step of every replica; sequences processed
bool dp_router_has_work(struct dp_router *r);

// Sums of the replicas' counters; kv_cache_usage = used blocks / total blocks over all replicas.
void dp_router_get_stats(struct dp_router *r, atomc_stats *s);

int dp_router_size(const struct dp_router *r);
atomc_engine *dp_router_replica(struct dp_router *r, int i);
int64_t dp_router_outstanding(const struct dp_router *r, int i);
static inline int dp_router_replica_of(uint64_t id) { return (int)(id % DP_ROUTER_MAX_REPLICAS); }

#endif
