// Data-parallel router: replicas of a tiny fixture model behind dp_router. Requests go to the
// replica with the fewest outstanding tokens (checked request by request), every request's
// greedy tokens equal those of a single engine, the outstanding counters return to zero, and
// abort reaches the right replica.
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "parallel/dp_router.h"
#include "test.h"

struct out {
    int32_t toks[64];
    int n;
    uint64_t id;
    atomc_finish_reason reason;
};

static void on_out(void *user, const atomc_output *o) {
    struct out *c = user;
    for (int i = 0; i < o->n_new_tokens && c->n < 64; i++) c->toks[c->n++] = o->new_tokens[i];
    c->id = o->request_id;
    if (o->finish_reason != ATOMC_FINISH_NONE) c->reason = o->finish_reason;
}

static atomc_engine_options options(char *path, size_t n) {
    snprintf(path, n, "%s", test_fixture("models/llama_gqa"));
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = path;
    o.block_size = 4;
    o.num_kv_blocks = 64;
    o.max_num_seqs = 8;
    o.max_num_batched_tokens = 32;
    o.num_threads = 2;
    return o;
}

static atomc_request request(const int32_t *ids, int n, int max_tokens, struct out *c) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = ids;
    r.n_prompt_ids = n;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.on_output = on_out;
    memset(c, 0, sizeof *c);
    r.user = c;
    return r;
}

TEST(dp_router_routes_by_fewest_outstanding_tokens) {
    char path[1024], err[512];
    atomc_engine_options o = options(path, sizeof path);
    struct dp_router *r = NULL;
    ASSERT_OK(dp_router_create(&o, 2, &r, err, sizeof err));
    static int32_t ids[6][48];
    const int plen[6] = {40, 5, 5, 5, 30, 6}, gen[6] = {40, 5, 5, 5, 10, 8};
    // charges (prompt + max_tokens): 80 -> r0 (tie: lowest index); 10, 10, 10 -> r1 (r1 < 80);
    // 40 -> r1 (30 < 80); 14 -> r1 (70 < 80)
    const int want[6] = {0, 1, 1, 1, 1, 1};
    struct out outs[6];
    uint64_t rid[6];
    for (int p = 0; p < 6; p++) {
        for (int i = 0; i < plen[p]; i++) ids[p][i] = (int32_t)((p * 31 + i * 7 + 1) % 250 + 1);
        atomc_request q = request(ids[p], plen[p], gen[p], &outs[p]);
        ASSERT_OK(dp_router_add_request(r, &q, &rid[p], err, sizeof err));
        ASSERT_EQ(dp_router_replica_of(rid[p]), want[p]);
    }
    ASSERT_EQ(dp_router_outstanding(r, 0), 80);
    ASSERT_EQ(dp_router_outstanding(r, 1), 10 + 10 + 10 + 40 + 14);
    while (dp_router_has_work(r)) dp_router_step(r);
    ASSERT_EQ(dp_router_outstanding(r, 0), 0);
    ASSERT_EQ(dp_router_outstanding(r, 1), 0);

    // Same requests on one engine: identical greedy tokens.
    atomc_engine *e = NULL;
    ASSERT_OK(atomc_engine_create(&o, &e, err, sizeof err));
    struct out single[6];
    for (int p = 0; p < 6; p++) {
        atomc_request q = request(ids[p], plen[p], gen[p], &single[p]);
        ASSERT_OK(atomc_engine_add_request(e, &q, NULL, err, sizeof err));
    }
    while (atomc_engine_has_work(e)) atomc_engine_step(e);
    for (int p = 0; p < 6; p++) {
        ASSERT_EQ(outs[p].reason, ATOMC_FINISH_LENGTH);
        ASSERT_EQ(outs[p].n, gen[p]);
        ASSERT_EQ(outs[p].id, rid[p]); // callbacks see the routed id
        for (int k = 0; k < gen[p]; k++) ASSERT_EQ(outs[p].toks[k], single[p].toks[k]);
    }
    atomc_engine_free(e);
    dp_router_free(r);
}

TEST(dp_router_abort_reaches_the_replica) {
    char path[1024], err[512];
    atomc_engine_options o = options(path, sizeof path);
    struct dp_router *r = NULL;
    ASSERT_OK(dp_router_create(&o, 3, &r, err, sizeof err));
    int32_t ids[8] = {5, 6, 7, 8, 9, 10, 11, 12};
    struct out a, b;
    uint64_t ida, idb;
    atomc_request qa = request(ids, 8, 30, &a), qb = request(ids, 4, 30, &b);
    ASSERT_OK(dp_router_add_request(r, &qa, &ida, err, sizeof err));
    ASSERT_OK(dp_router_add_request(r, &qb, &idb, err, sizeof err));
    ASSERT_NE(dp_router_replica_of(ida), dp_router_replica_of(idb));
    dp_router_step(r);
    ASSERT_OK(dp_router_abort(r, idb));
    while (dp_router_has_work(r)) dp_router_step(r);
    ASSERT_EQ(a.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(b.reason, ATOMC_FINISH_ABORT);
    ASSERT_TRUE(b.n < 30);
    for (int i = 0; i < 3; i++) ASSERT_EQ(dp_router_outstanding(r, i), 0);
    ASSERT_EQ(dp_router_abort(r, ida), ATOMC_ERR_NOT_FOUND); // finished: unknown now
    ASSERT_EQ(dp_router_abort(r, 63), ATOMC_ERR_NOT_FOUND);  // replica 63 does not exist
    dp_router_free(r);
}

TEST(dp_router_bad_sizes) {
    char path[1024], err[512];
    atomc_engine_options o = options(path, sizeof path);
    struct dp_router *r = NULL;
    ASSERT_EQ(dp_router_create(&o, 0, &r, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    o.device = "cuda";
    ASSERT_EQ(dp_router_create(&o, 2, &r, err, sizeof err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err, "device id per replica") != NULL);
    // KV transfer (issue 24): one connector port per replica is not there, so DP is refused by name.
    o.device = "cpu";
    o.kv_transfer_config = "{\"kv_role\":\"kv_producer\"}";
    ASSERT_EQ(dp_router_create(&o, 2, &r, err, sizeof err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err, "kv-transfer-config") != NULL && strstr(err, "data parallel size 2") != NULL);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
