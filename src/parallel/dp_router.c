// Data-parallel router over engine replicas (see dp_router.h).
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "common/check.h"
#include "parallel/dp_router.h"

struct dp_router {
    int n;
    atomc_engine **replicas;
    _Atomic int64_t *outstanding; // (n) tokens charged and not yet refunded
    int max_model_len;
};

// One routed request: forwards outputs to the caller's callback and refunds its charge.
struct dp_req {
    struct dp_router *r;
    int replica;
    int64_t charge;          // still charged to the replica (touched only on its loop thread)
    atomc_output_fn user_fn;
    void *user;
};

static void dp_on_output(void *arg, const atomc_output *o) {
    struct dp_req *q = arg;
    int64_t refund = o->n_new_tokens;
    bool final = o->finish_reason != ATOMC_FINISH_NONE;
    if (final || refund > q->charge) refund = q->charge;
    q->charge -= refund;
    atomic_fetch_sub(&q->r->outstanding[q->replica], refund);
    if (q->user_fn) {
        atomc_output routed = *o;
        routed.request_id = o->request_id * DP_ROUTER_MAX_REPLICAS + (uint64_t)q->replica;
        q->user_fn(q->user, &routed);
    }
    if (final) free(q);
}

atomc_status dp_router_create(const atomc_engine_options *o_in, int dp_size, struct dp_router **out, char *err,
                              size_t err_len) {
    *out = NULL;
    atomc_engine_options o_resolved = *o_in; // "auto" resolved once for every replica
    o_resolved.device = backend_resolve_device(o_in->device);
    const atomc_engine_options *o = &o_resolved;
    if (dp_size < 1 || dp_size > DP_ROUTER_MAX_REPLICAS) {
        snprintf(err, err_len, "data parallel size %d outside 1..%d", dp_size, DP_ROUTER_MAX_REPLICAS);
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    if (dp_size > 1 && o->device && !strcmp(o->device, "cuda")) {
        snprintf(err, err_len, "data parallel size %d on cuda needs a device id per replica, which the engine options "
                 "do not carry yet: run one server per GPU (CUDA_VISIBLE_DEVICES) behind a load balancer", dp_size);
        return ATOMC_ERR_UNSUPPORTED;
    }
    if (dp_size > 1 && o->kv_transfer_config && o->kv_transfer_config[0]) {
        snprintf(err, err_len, "--kv-transfer-config with data parallel size %d is not supported: the %d replicas "
                 "would share one KV connector port and engine id; run one prefill / decode instance per replica "
                 "(each its own kv_port and engine_id) behind `atomc proxy`", dp_size, dp_size);
        return ATOMC_ERR_UNSUPPORTED;
    }
    struct dp_router *r = xcalloc(1, sizeof *r);
    r->n = dp_size;
    r->replicas = xcalloc((size_t)dp_size, sizeof *r->replicas);
    r->outstanding = xcalloc((size_t)dp_size, sizeof *r->outstanding);
    int threads = o->num_threads > 0 ? o->num_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    for (int i = 0; i < dp_size; i++) {
        atomic_init(&r->outstanding[i], 0);
        atomc_engine_options ro = *o;
        ro.num_threads = threads / dp_size > 0 ? threads / dp_size : 1;
        char e[512];
        atomc_status st = atomc_engine_create(&ro, &r->replicas[i], e, sizeof e);
        if (st != ATOMC_OK) {
            snprintf(err, err_len, "data parallel replica %d of %d: %s", i, dp_size, e);
            dp_router_free(r);
            return st;
        }
    }
    atomc_model_info info;
    atomc_engine_get_model_info(r->replicas[0], &info);
    r->max_model_len = info.max_model_len;
    *out = r;
    return ATOMC_OK;
}

void dp_router_free(struct dp_router *r) {
    if (!r) return;
    for (int i = 0; i < r->n; i++) atomc_engine_free(r->replicas[i]); // final outputs free the dp_reqs
    free(r->replicas);
    free(r->outstanding);
    free(r);
}

static int64_t dp_charge(const struct dp_router *r, const atomc_request *req) {
    int64_t prompt = req->prompt_ids ? req->n_prompt_ids
                                     : (int64_t)((req->prompt_len ? req->prompt_len
                                                                  : (req->prompt ? strlen(req->prompt) : 0)) / 4 + 1);
    int64_t gen = req->params.max_tokens >= 0 ? req->params.max_tokens : (int64_t)r->max_model_len - prompt;
    return prompt + (gen > 0 ? gen : 0);
}

atomc_status dp_router_add_request(struct dp_router *r, const atomc_request *req, uint64_t *out_id, char *err,
                                   size_t err_len) {
    int best = 0;
    int64_t best_load = atomic_load(&r->outstanding[0]);
    for (int i = 1; i < r->n; i++) {
        int64_t l = atomic_load(&r->outstanding[i]);
        if (l < best_load) best = i, best_load = l;
    }
    struct dp_req *q = xmalloc(sizeof *q);
    *q = (struct dp_req){.r = r, .replica = best, .charge = dp_charge(r, req), .user_fn = req->on_output,
                         .user = req->user};
    atomic_fetch_add(&r->outstanding[best], q->charge); // before the replica can refund it
    atomc_request inner = *req;
    inner.on_output = dp_on_output;
    inner.user = q;
    uint64_t id = 0;
    atomc_status st = atomc_engine_add_request(r->replicas[best], &inner, &id, err, err_len);
    if (st != ATOMC_OK) {
        atomic_fetch_sub(&r->outstanding[best], q->charge);
        free(q);
        return st;
    }
    if (out_id) *out_id = id * DP_ROUTER_MAX_REPLICAS + (uint64_t)best;
    return ATOMC_OK;
}

atomc_status dp_router_abort(struct dp_router *r, uint64_t id) {
    int i = dp_router_replica_of(id);
    if (i >= r->n) return ATOMC_ERR_NOT_FOUND;
    return atomc_engine_abort(r->replicas[i], id / DP_ROUTER_MAX_REPLICAS);
}

atomc_status dp_router_start(struct dp_router *r) {
    for (int i = 0; i < r->n; i++) {
        atomc_status st = atomc_engine_start(r->replicas[i]);
        if (st != ATOMC_OK) return st;
    }
    return ATOMC_OK;
}

int dp_router_step(struct dp_router *r) {
    int n = 0;
    for (int i = 0; i < r->n; i++) n += atomc_engine_step(r->replicas[i]);
    return n;
}

bool dp_router_has_work(struct dp_router *r) {
    for (int i = 0; i < r->n; i++)
        if (atomc_engine_has_work(r->replicas[i])) return true;
    return false;
}

void dp_router_get_stats(struct dp_router *r, atomc_stats *s) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < r->n; i++) {
        atomc_stats x;
        atomc_engine_get_stats(r->replicas[i], &x);
        s->num_running += x.num_running;
        s->num_waiting += x.num_waiting;
        s->num_kv_blocks += x.num_kv_blocks;
        s->num_free_kv_blocks += x.num_free_kv_blocks;
        s->prefix_cache_queries += x.prefix_cache_queries;
        s->prefix_cache_hits += x.prefix_cache_hits;
        s->num_preemptions += x.num_preemptions;
        s->prompt_tokens_total += x.prompt_tokens_total;
        s->generation_tokens_total += x.generation_tokens_total;
        s->num_steps += x.num_steps;
        s->num_requests_finished += x.num_requests_finished;
        s->num_requests_aborted += x.num_requests_aborted;
        s->prefix_cache_evictions += x.prefix_cache_evictions;
        s->num_speculative_tokens = x.num_speculative_tokens; // the same options in every replica
        s->spec_num_drafts += x.spec_num_drafts;
        s->spec_num_draft_tokens += x.spec_num_draft_tokens;
        s->spec_num_accepted_tokens += x.spec_num_accepted_tokens;
        for (int p = 0; p < ATOMC_MAX_SPEC_TOKENS; p++)
            s->spec_accepted_per_pos[p] += x.spec_accepted_per_pos[p];
    }
    s->kv_cache_usage = s->num_kv_blocks ? 1.0 - (double)s->num_free_kv_blocks / s->num_kv_blocks : 0;
}

int dp_router_size(const struct dp_router *r) { return r->n; }
atomc_engine *dp_router_replica(struct dp_router *r, int i) { return r->replicas[i]; }
int64_t dp_router_outstanding(const struct dp_router *r, int i) { return atomic_load(&r->outstanding[i]); }
