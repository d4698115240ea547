// The engine's side of prefill/decode disaggregation (src/kv_transfer/kv_connector.h): which
// sequences send or receive KV, when, and what happens to their blocks. Everything here runs on
// the thread that runs the steps, like the scheduler and block manager it touches; the
// connector's I/O thread only wakes the loop (engine_kv_wake).
//
// Producer (kv_do_remote_decode): before every forward step, each producer sequence that will
// compute prompt tokens registers them with the connector (BEGIN with the first chunk; the
// prefix-cache hit of the first chunk is sent too, since the consumer has none of it); the batch
// carries a per-layer hook, so each layer's rows go out while later layers compute (the
// connector's copy thread); after the forward the step waits until every layer is queued and
// END goes out with the last chunk. When the
// sequence finishes (max_tokens 1: after its first token) its block table moves to the held
// list, so the blocks stay allocated until the consumer's ACK (or hold_timeout_s, or the
// consumer's connection dropping) releases them.
//
// Consumer (kv_do_remote_prefill): a new sequence waits in the pending list instead of the
// scheduler. Each step start checks its transfer: READY with the same prompt tokens and block
// hashes equal to our own chain -> blocks allocated, KV claimed into them, full blocks
// registered in the prefix cache, n_computed = n_prompt - 1, straight into the running set (the
// next step computes only the last prompt token and samples). FAILED, a mismatch, or no KV by
// timeout_s -> the sequence enters the scheduler as an ordinary request (local prefill; counted
// as a fallback). Aborts of pending sequences drop the transfer (the producer is acknowledged
// so it frees its blocks).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "kv_transfer/kv_connector.h"

struct held {
    char id[KV_ID_MAX];
    struct block_table bt;
    double deadline;
    int acks; // ranks that acknowledged (released at n_ranks)
};

#define KV_MAX_RANKS 8

struct engine_kv {
    struct kv_transfer_config cfg;
    // Tensor parallelism: one connector per rank (rank r on kv_port + r, to the producers'
    // port + r), each moving that rank's slice of the KV heads; rank 0 also carries QUERY / HAVE.
    int n_ranks;
    struct kv_connector *conn[KV_MAX_RANKS];
    struct kv_pool_view pool[KV_MAX_RANKS];
    struct sequence **pending;
    int n_pending, pending_cap;
    struct sequence **querying; // producer: asked the consumer what it has cached, waiting for HAVE
    int n_querying, querying_cap;
    struct held *held;
    int n_held, held_cap;
    int held_blocks;
    uint64_t fallbacks;
    uint64_t *hashes;
    int hashes_cap;
    int32_t *match; // block_manager_lookup scratch
    int match_cap;
    // The sends of the step being computed (engine_kv_before_forward -> after_forward).
    struct sequence **step;
    int *step_end; // prompt tokens sent once the step's send completes
    bool *step_failed;
    int *step_ranks; // ranks [0, step_ranks[i]) registered send i
    int n_step, step_cap, step_end_cap, step_failed_cap, step_ranks_cap;
};

static void drop_all(struct engine_kv *k, const char *id) {
    for (int r = 0; r < k->n_ranks; r++)
        kv_connector_drop(k->conn[r], id);
}

static void abort_all(struct engine_kv *k, const char *id) {
    for (int r = 0; r < k->n_ranks; r++)
        kv_connector_send_abort(k->conn[r], id);
}

// cfg for rank r: its port, and each producer's address with the port moved by r.
static void rank_config(const struct kv_transfer_config *c, int r, struct kv_transfer_config *out) {
    *out = *c;
    out->port = c->port + r;
    for (int i = 0; i < c->n_producers; i++) {
        char host[96];
        snprintf(host, sizeof host, "%s", c->producers[i]);
        char *colon = strrchr(host, ':');
        CHECK(colon); // kv_transfer_config_parse checked "host:port"
        *colon = 0;
        snprintf(out->producers[i], sizeof out->producers[i], "%.80s:%d", host, atoi(colon + 1) + r);
    }
}

static void engine_kv_wake(void *arg) {
    atomc_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    e->kv_poke = true; // an idle loop steps once (answers a QUERY, takes a HAVE or an ACK)
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

atomc_status engine_kv_create(atomc_engine *e, const atomc_engine_options *o, struct error *err) {
    e->kv = NULL;
    if (!o->kv_transfer_config || !o->kv_transfer_config[0]) return ATOMC_OK;
    struct engine_kv *k = xcalloc(1, sizeof *k);
    atomc_status st = kv_transfer_config_parse(o->kv_transfer_config, &k->cfg, err);
    if (st == ATOMC_OK && !e->su.model.kv_pool)
        st = error_set(err, ATOMC_ERR_UNSUPPORTED, "--kv-transfer-config: this engine's model cannot expose its KV pool");
    if (st == ATOMC_OK && e->su.num_state_slots > 0)
        st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                       "--kv-transfer-config: %s keeps per-sequence recurrent state, which KV transfer does not "
                       "carry (only paged KV blocks)",
                       e->su.info.architecture ? e->su.info.architecture : "this model");
    if (st != ATOMC_OK) {
        free(k);
        return st;
    }
    k->n_ranks = e->su.model.kv_ranks > 0 ? e->su.model.kv_ranks : 1;
    if (k->n_ranks > KV_MAX_RANKS || k->cfg.port + k->n_ranks - 1 > 65535) {
        int n = k->n_ranks;
        free(k);
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "--kv-transfer-config: %d tensor-parallel ranks (at most %d, "
                         "on kv_port .. kv_port + tp - 1 <= 65535)", n, KV_MAX_RANKS);
    }
    for (int r = 0; r < k->n_ranks && st == ATOMC_OK; r++) {
        struct kv_pool_view *pool = &k->pool[r];
        e->su.model.kv_pool(e->su.model.ctx, r, pool);
        struct kv_handshake hs;
        memset(&hs, 0, sizeof hs);
        hs.version = KV_PROTOCOL_VERSION;
        snprintf(hs.engine_id, sizeof hs.engine_id, "%s", k->cfg.engine_id);
        snprintf(hs.model, sizeof hs.model, "%s", e->su.info.model_name ? e->su.info.model_name : "");
        snprintf(hs.architecture, sizeof hs.architecture, "%s",
                 e->su.info.architecture ? e->su.info.architecture : "");
        hs.config_hash = e->su.config_hash;
        hs.kv_dtype = pool->kv_dtype;
        hs.block_size = e->block_size;
        hs.n_layers = pool->n_layers;
        hs.tp_size = k->n_ranks; // the peer's rank r must be ours: rank r connects to port + r
        hs.tp_rank = r;
        hs.token_bytes = kv_pool_token_bytes(pool); // this rank's KV heads
        XXH64_state_t *x = XXH64_createState();
        XXH64_reset(x, 0);
        XXH64_update(x, pool->k_row_bytes, (size_t)pool->n_layers * sizeof(size_t));
        XXH64_update(x, pool->v_row_bytes, (size_t)pool->n_layers * sizeof(size_t));
        hs.layer_bytes_hash = XXH64_digest(x);
        XXH64_freeState(x);
        CHECK(pool->block_size == e->block_size);
        struct kv_transfer_config rc;
        rank_config(&k->cfg, r, &rc);
        st = kv_connector_create(&rc, &hs, pool, engine_kv_wake, e, &k->conn[r], err);
        if (st != ATOMC_OK && k->n_ranks > 1) error_prefix(err, "tensor-parallel rank %d: ", r);
    }
    if (st != ATOMC_OK) {
        for (int r = 0; r < k->n_ranks; r++)
            kv_connector_free(k->conn[r]);
        free(k);
        return st;
    }
    e->kv = k;
    return ATOMC_OK;
}

atomc_status engine_kv_request(atomc_engine *e, struct sequence *s, const atomc_request *r, struct error *err) {
    if (!r->kv_do_remote_decode && !r->kv_do_remote_prefill) return ATOMC_OK;
    if (!e->kv)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "kv_transfer_params ask for a remote %s, but this instance runs without --kv-transfer-config",
                         r->kv_do_remote_decode ? "decode" : "prefill");
    if (r->kv_do_remote_decode && r->kv_do_remote_prefill)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true");
    enum kv_role role = e->kv->cfg.role;
    if (r->kv_do_remote_decode && !(role & KV_ROLE_PRODUCER))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "kv_transfer_params.do_remote_decode needs a kv_producer (this instance is a %s)",
                         kv_role_name(role));
    if (r->kv_do_remote_prefill && !(role & KV_ROLE_CONSUMER))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "kv_transfer_params.do_remote_prefill needs a kv_consumer (this instance is a %s)",
                         kv_role_name(role));
    const char *id = r->kv_transfer_id;
    if (!id || !id[0] || strlen(id) >= KV_ID_MAX)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "kv_transfer_params need a transfer id (remote_request_id) of 1 to %d bytes", KV_ID_MAX - 1);
    if (r->kv_remote_engine_id && strlen(r->kv_remote_engine_id) >= KV_ID_MAX)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "kv_transfer_params.remote_engine_id is too long");
    // Prompt logprobs need every prompt row computed here: such a request simply prefills locally.
    if (r->kv_do_remote_prefill && s->params.prompt_logprobs >= 0) return ATOMC_OK;
    s->kv_mode = r->kv_do_remote_decode ? 1 : 2;
    s->kv_id = xstrdup(id);
    s->kv_remote = r->kv_remote_engine_id && r->kv_remote_engine_id[0] ? xstrdup(r->kv_remote_engine_id) : NULL;
    return ATOMC_OK;
}

bool engine_kv_admit(atomc_engine *e, struct sequence *s) {
    if (!e->kv || !s->kv_mode) return false;
    struct engine_kv *k = e->kv;
    if (s->kv_mode == 1) {
        // Ask the consumer which leading blocks it has cached before computing anything; a prompt
        // shorter than one full block (plus its last token) has nothing to skip.
        if (s->n_prompt <= e->block_size) return false;
        struct error err = {0};
        if (kv_connector_query(k->conn[0], s->kv_id, s->kv_remote, s->tokens, s->n_prompt, &err) != ATOMC_OK)
            return false; // no such consumer: the first send fails and says so
        s->kv_deadline = time_now_s() + k->cfg.query_timeout_s;
        k->querying = grow(k->querying, &k->querying_cap, k->n_querying + 1, sizeof *k->querying);
        k->querying[k->n_querying++] = s;
        return true;
    }
    s->kv_deadline = time_now_s() + k->cfg.timeout_s;
    k->pending = grow(k->pending, &k->pending_cap, k->n_pending + 1, sizeof *k->pending);
    k->pending[k->n_pending++] = s;
    return true;
}

struct sequence *engine_kv_find(atomc_engine *e, uint64_t id) {
    if (!e->kv) return NULL;
    for (int i = 0; i < e->kv->n_pending; i++)
        if (e->kv->pending[i]->id == id) return e->kv->pending[i];
    for (int i = 0; i < e->kv->n_querying; i++)
        if (e->kv->querying[i]->id == id) return e->kv->querying[i];
    return NULL;
}

static bool list_remove(struct sequence **list, int *n, struct sequence *s) {
    for (int i = 0; i < *n; i++)
        if (list[i] == s) {
            memmove(list + i, list + i + 1, (size_t)(*n - i - 1) * sizeof *list);
            (*n)--;
            return true;
        }
    return false;
}

bool engine_kv_on_retire(atomc_engine *e, struct sequence *s) {
    struct engine_kv *k = e->kv;
    if (!k || !s->kv_mode) return false;
    if (s->kv_mode == 2) {
        if (!list_remove(k->pending, &k->n_pending, s)) return false;
        drop_all(k, s->kv_id);
        return true;
    }
    if (list_remove(k->querying, &k->n_querying, s)) return true; // aborted before it was scheduled
    if (s->kv_sent == 0 || s->kv_failed) return false; // nothing sent: the blocks go back as usual
    if (s->kv_sent < s->n_prompt) {                    // ended mid-prompt (abort, error)
        abort_all(k, s->kv_id);
        return false;
    }
    // The consumer may still be reading (cuda_ipc) or about to claim: keep the blocks until its ACK.
    k->held = grow(k->held, &k->held_cap, k->n_held + 1, sizeof *k->held);
    struct held *h = &k->held[k->n_held++];
    snprintf(h->id, sizeof h->id, "%s", s->kv_id);
    h->bt = s->bt;
    h->deadline = time_now_s() + k->cfg.hold_timeout_s;
    h->acks = 0;
    k->held_blocks += s->bt.n - s->bt.n_dropped;
    block_table_init(&s->bt);
    return false;
}

static void held_release_at(atomc_engine *e, int i) {
    struct engine_kv *k = e->kv;
    struct held *h = &k->held[i];
    k->held_blocks -= h->bt.n - h->bt.n_dropped;
    block_manager_release(e->bm, &h->bt);
    block_table_free(&h->bt);
    k->held[i] = k->held[--k->n_held];
}

// kv_connector_answer_queries: leading full blocks of tokens in our prefix cache.
static int cached_blocks(void *u, const int32_t *tokens, int n_tokens) {
    atomc_engine *e = u;
    struct engine_kv *k = e->kv;
    k->match = grow(k->match, &k->match_cap, n_tokens / e->block_size + 1, sizeof *k->match);
    int revived = 0;
    return block_manager_lookup(e->bm, tokens, n_tokens, k->match, &revived);
}

static void on_ack(void *u, const char *id) {
    atomc_engine *e = u;
    for (int i = 0; i < e->kv->n_held; i++)
        if (!strcmp(e->kv->held[i].id, id)) {
            if (++e->kv->held[i].acks >= e->kv->n_ranks) held_release_at(e, i); // every rank's consumer has it
            return;
        }
}

static void fall_back(atomc_engine *e, struct sequence *s, int i, const char *why) {
    struct engine_kv *k = e->kv;
    LOG_WARN("request %llu: KV transfer %s %s; prefilling locally", (unsigned long long)s->id, s->kv_id, why);
    drop_all(k, s->kv_id);
    memmove(k->pending + i, k->pending + i + 1, (size_t)(k->n_pending - i - 1) * sizeof *k->pending);
    k->n_pending--;
    s->kv_fallback = true;
    k->fallbacks++;
    scheduler_add(e->sched, s);
}

// The transfer of s is READY (info): checks it, allocates, claims. Returns 1 admitted, 0 not now
// (no room), -1 unusable (caller falls back; *why says why).
static int try_admit(atomc_engine *e, struct sequence *s, const struct kv_rx_info *info, const char **why) {
    struct engine_kv *k = e->kv;
    if (info->n_tokens != s->n_prompt || memcmp(info->tokens, s->tokens, (size_t)s->n_prompt * sizeof *s->tokens)) {
        *why = "carries other prompt tokens";
        return -1;
    }
    int bs = e->block_size, n_full = s->n_prompt / bs;
    uint64_t parent = 0;
    for (int i = 0; i < n_full; i++) {
        uint64_t h = e->bm->hash_fn(s->tokens + (size_t)i * bs, bs, parent);
        if (h != info->block_hashes[i]) {
            *why = "has block hashes that differ from ours";
            return -1;
        }
        parent = h;
    }
    if (scheduler_num_running(e->sched) >= e->max_num_seqs) return 0;
    if (info->skip > 0) {
        // The producer did not send our cached prefix (HAVE): it must still be cached.
        int need = info->skip / bs;
        k->match = grow(k->match, &k->match_cap, n_full + 1, sizeof *k->match);
        int revived = 0, n_match = block_manager_lookup(e->bm, s->tokens, s->n_prompt, k->match, &revived);
        if (n_match < need) {
            *why = "skipped blocks this instance no longer has cached";
            return -1;
        }
        // Room for the rest (revived counts every matched block that is free now: an upper bound).
        if (block_manager_num_free(e->bm) < revived + block_manager_blocks_for(e->bm, s->n_prompt) - need) return 0;
        block_manager_acquire_prefix(e->bm, &s->bt, k->match, need, s->n_prompt);
    }
    if (!block_manager_allocate(e->bm, &s->bt, s->n_prompt)) {
        block_manager_release(e->bm, &s->bt);
        return 0;
    }
    struct error err = {0};
    atomc_status cst = ATOMC_OK;
    for (int r = 0; r < k->n_ranks; r++) // each rank's slice of the heads into the same blocks
        if (cst == ATOMC_OK)
            cst = kv_connector_claim(k->conn[r], s->kv_id, s->bt.ids, s->bt.n, &err);
        else
            kv_connector_drop(k->conn[r], s->kv_id);
    if (cst != ATOMC_OK) {
        block_manager_release(e->bm, &s->bt);
        LOG_WARN("request %llu: %s", (unsigned long long)s->id, err.msg);
        *why = "could not be copied into the pool";
        return -1;
    }
    block_manager_commit(e->bm, &s->bt, s->tokens, s->n_prompt - 1);
    s->n_computed = s->n_prompt - 1;
    s->kv_transfer_s = info->t_end > info->t_begin ? info->t_end - info->t_begin : 0;
    CHECK(scheduler_admit_prefilled(e->sched, s, time_now_s()));
    return 1;
}

// The transfer's state over every rank: READY when all are, FAILED when one is; info: rank 0's.
static enum kv_rx_state lookup_all(struct engine_kv *k, const char *id, const char *remote, struct kv_rx_info *info) {
    enum kv_rx_state st = kv_connector_lookup(k->conn[0], id, remote, info);
    for (int r = 1; r < k->n_ranks && st != KV_RX_FAILED; r++) {
        enum kv_rx_state sr = kv_connector_lookup(k->conn[r], id, remote, NULL);
        if (sr == KV_RX_FAILED)
            st = KV_RX_FAILED;
        else if (sr != KV_RX_READY && st == KV_RX_READY)
            st = KV_RX_PENDING;
    }
    return st;
}

void engine_kv_poll(atomc_engine *e) {
    struct engine_kv *k = e->kv;
    if (!k) return;
    for (int r = 0; r < k->n_ranks; r++)
        kv_connector_poll_acks(k->conn[r], on_ack, e);
    if (k->cfg.role & KV_ROLE_CONSUMER) kv_connector_answer_queries(k->conn[0], cached_blocks, e);
    double now = time_now_s();
    for (int i = 0; i < k->n_querying;) { // producer: HAVE answered (or no answer in time): compute
        struct sequence *s = k->querying[i];
        int have = kv_connector_take_have(k->conn[0], s->kv_id);
        if (have < 0 && now <= s->kv_deadline) {
            i++;
            continue;
        }
        int max_skip = (s->n_prompt - 1) / e->block_size; // never the last token (the consumer computes it)
        s->kv_skip = (have > max_skip ? max_skip : have > 0 ? have : 0) * e->block_size;
        list_remove(k->querying, &k->n_querying, s);
        scheduler_add(e->sched, s);
    }
    for (int i = 0; i < k->n_held;) {
        if (now > k->held[i].deadline) {
            LOG_WARN("KV transfer %s: no acknowledgement within %.0f s; its blocks are freed", k->held[i].id,
                     k->cfg.hold_timeout_s);
            held_release_at(e, i);
        } else {
            i++;
        }
    }
    for (int i = 0; i < k->n_pending;) {
        struct sequence *s = k->pending[i];
        struct kv_rx_info info;
        enum kv_rx_state st = lookup_all(k, s->kv_id, s->kv_remote, &info);
        const char *why = NULL;
        int r = 0;
        if (st == KV_RX_READY)
            r = try_admit(e, s, &info, &why);
        else if (st == KV_RX_FAILED)
            r = -1, why = "failed (producer gone or transfer aborted)";
        else if (now > s->kv_deadline)
            r = -1, why = "did not arrive in time";
        if (r == 1) {
            memmove(k->pending + i, k->pending + i + 1, (size_t)(k->n_pending - i - 1) * sizeof *k->pending);
            k->n_pending--;
        } else if (r < 0) {
            fall_back(e, s, i, why);
        } else {
            i++;
        }
    }
}

// forward_batch.kv_layer_done: the forward wrote layer `layer` of this step's KV.
static void kv_layer_done(void *ctx, int rank, int layer, void *event) {
    struct engine_kv *k = ctx;
    CHECK(rank >= 0 && rank < k->n_ranks);
    kv_connector_layer_ready(k->conn[rank], layer, event);
}

void engine_kv_before_forward(atomc_engine *e, const struct scheduler_output *so, struct forward_batch *fb) {
    struct engine_kv *k = e->kv;
    if (!k) return;
    k->n_step = 0;
    for (int i = 0; i < so->n_seqs; i++) {
        struct sequence *s = so->seqs[i];
        if (s->kv_mode != 1 || s->kv_failed) continue;
        int end = s->n_computed + s->n_sched;
        if (end > s->n_prompt) end = s->n_prompt;
        if (end <= s->kv_sent) continue;
        int bs = e->block_size, n_full = s->n_prompt / bs;
        if (s->kv_sent == 0) { // BEGIN carries the chained hashes of every full prompt block
            k->hashes = grow(k->hashes, &k->hashes_cap, n_full + 1, sizeof *k->hashes);
            uint64_t parent = 0;
            for (int b = 0; b < n_full; b++)
                parent = k->hashes[b] = e->bm->hash_fn(s->tokens + (size_t)b * bs, bs, parent);
        }
        // Ids of blocks not allocated yet (later chunks) are sent as -1; END carries them all.
        int need = (s->n_prompt + bs - 1) / bs;
        int32_t ids_local[64], *ids = need <= 64 ? ids_local : xmalloc((size_t)need * sizeof *ids);
        for (int b = 0; b < need; b++)
            ids[b] = b < s->bt.n ? s->bt.ids[b] : -1;
        // The first chunk sends the prefix-cache hit too (the consumer has none of it).
        int lo = s->kv_sent > s->kv_skip ? s->kv_sent : s->kv_skip; // the consumer has [0, skip)
        struct kv_send snd = {.transfer_id = s->kv_id,
                              .remote_engine_id = s->kv_remote,
                              .tokens = s->tokens,
                              .n_tokens = s->n_prompt,
                              .block_hashes = k->hashes,
                              .block_ids = ids,
                              .tok0 = end > lo ? lo : s->kv_skip,
                              .n_tok = end > lo ? end - lo : 0,
                              .first = s->kv_sent == 0,
                              .last = end == s->n_prompt,
                              .skip = s->kv_skip};
        struct error err = {0};
        int r = 0;
        while (r < k->n_ranks && kv_connector_step_add(k->conn[r], &snd, &err) == ATOMC_OK)
            r++;
        k->step = grow(k->step, &k->step_cap, k->n_step + 1, sizeof *k->step);
        k->step_end = grow(k->step_end, &k->step_end_cap, k->n_step + 1, sizeof *k->step_end);
        k->step_ranks = grow(k->step_ranks, &k->step_ranks_cap, k->n_step + 1, sizeof *k->step_ranks);
        k->step[k->n_step] = s;
        k->step_end[k->n_step] = end;
        k->step_ranks[k->n_step++] = r; // registered on ranks [0, r)
        if (r < k->n_ranks) {
            LOG_WARN("request %llu: %s; its KV stays here", (unsigned long long)s->id, err.msg);
            s->kv_failed = true; // after the step: aborted on every rank
        }
        if (ids != ids_local) free(ids);
    }
    if (k->n_step) {
        fb->kv_layer_done = kv_layer_done;
        fb->kv_layer_ctx = k;
    }
}

void engine_kv_after_forward(atomc_engine *e, const struct scheduler_output *so, bool ok) {
    (void)so;
    struct engine_kv *k = e->kv;
    if (!k || !k->n_step) return;
    k->step_failed = grow(k->step_failed, &k->step_failed_cap, k->n_step, sizeof *k->step_failed);
    bool *rank_failed = xcalloc((size_t)k->n_step, sizeof *rank_failed);
    memset(k->step_failed, 0, (size_t)k->n_step * sizeof *k->step_failed);
    for (int r = 0; r < k->n_ranks; r++) {
        // Rank r's sends are the steps' entries registered on it, in order.
        int n = kv_connector_step_end(k->conn[r], ok, rank_failed, k->n_step);
        for (int i = 0, j = 0; i < k->n_step; i++)
            if (r < k->step_ranks[i]) k->step_failed[i] |= j < n && rank_failed[j++];
    }
    free(rank_failed);
    for (int i = 0; i < k->n_step; i++) {
        struct sequence *s = k->step[i];
        bool failed = k->step_failed[i] || k->step_ranks[i] < k->n_ranks;
        if (!ok) { // BEGIN may be out already (sent before the forward): the consumer must hear
            abort_all(k, s->kv_id);
            s->kv_failed = true;
            continue;
        }
        if (failed) {
            if (!s->kv_failed)
                LOG_WARN("request %llu: KV transfer %s lost its consumer; its KV stays here",
                         (unsigned long long)s->id, s->kv_id);
            abort_all(k, s->kv_id);
            s->kv_failed = true;
        } else {
            s->kv_sent = k->step_end[i];
        }
    }
    k->n_step = 0;
}

// The connectors' counters over every rank: payload bytes and layer frames add up; transfers,
// blocks and peers are rank 0's (the same transfers and blocks travel on every rank), peers the
// fewest of any rank (a transfer needs them all).
static void connector_stats(struct engine_kv *k, atomc_stats *st) {
    struct kv_connector_stats cs;
    for (int r = 0; r < k->n_ranks; r++) {
        kv_connector_get_stats(k->conn[r], &cs);
        if (r == 0) {
            st->kv_bytes_sent = st->kv_bytes_received = st->kv_layers_sent = st->kv_layers_during_forward = 0;
            st->kv_send_queue_peak = st->kv_send_queue_waits = 0;
            st->kv_blocks_sent = cs.blocks_sent;
            st->kv_blocks_received = cs.blocks_received;
            st->kv_transfers_sent = cs.transfers_sent;
            st->kv_transfers_received = cs.transfers_received;
            st->kv_transfers_failed = cs.transfers_failed;
            st->kv_blocks_skipped = cs.blocks_skipped;
            st->kv_peers = cs.peers;
        }
        st->kv_bytes_sent += cs.bytes_sent;
        st->kv_bytes_received += cs.bytes_received;
        st->kv_layers_sent += cs.layers_sent;
        st->kv_layers_during_forward += cs.layers_during_forward;
        st->kv_send_queue_waits += cs.send_queue_waits;
        if (cs.send_queue_peak > st->kv_send_queue_peak) st->kv_send_queue_peak = cs.send_queue_peak;
        if (cs.peers < st->kv_peers) st->kv_peers = cs.peers;
    }
}

void engine_kv_fill_stats(atomc_engine *e, atomc_stats *st) {
    struct engine_kv *k = e->kv;
    if (!k) return;
    st->kv_role = (int)k->cfg.role;
    connector_stats(k, st);
    st->kv_fallbacks = k->fallbacks;
    st->kv_held_blocks = k->held_blocks;
    st->kv_waiting = k->n_pending;
}

// The connector's counters (its own lock) as of now, over the snapshot of the last step: an idle
// engine does not step, but connections and transfers go on.
void engine_kv_live_stats(atomc_engine *e, atomc_stats *st) {
    struct engine_kv *k = e->kv; // set before the engine is shared, never changed while it lives
    if (!k) return;
    connector_stats(k, st);
}

int engine_kv_n_work(const atomc_engine *e) {
    return e->kv ? e->kv->n_pending + e->kv->n_held + e->kv->n_querying : 0;
}

void engine_kv_free(atomc_engine *e) {
    struct engine_kv *k = e->kv;
    if (!k) return;
    while (k->n_pending)
        engine_retire(e, k->pending[0], ATOMC_FINISH_ABORT, 0, NULL, NULL);
    while (k->n_querying)
        engine_retire(e, k->querying[0], ATOMC_FINISH_ABORT, 0, NULL, NULL);
    while (k->n_held)
        held_release_at(e, 0);
    for (int r = 0; r < k->n_ranks; r++)
        kv_connector_free(k->conn[r]);
    free(k->pending);
    free(k->querying);
    free(k->match);
    free(k->held);
    free(k->hashes);
    free(k->step);
    free(k->step_end);
    free(k->step_failed);
    free(k->step_ranks);
    free(k);
    e->kv = NULL;
}

void atomc_engine_get_kv_info(atomc_engine *e, atomc_kv_info *out) {
    memset(out, 0, sizeof *out);
    if (!e->kv) return;
    out->role = (int)e->kv->cfg.role;
    out->engine_id = e->kv->cfg.engine_id;
    out->host = e->kv->cfg.ip;
    out->port = e->kv->cfg.port;
}
