// Randomized stress of the whole engine loop over the TEST-ONLY fake model (engine_fake.h):
// thousands of steps with random arrivals, prompt lengths, shared prefixes, output lengths
// and aborts (while waiting, mid-prefill and decoding), a KV pool far too small for the load
// (forcing preemption and cache eviction) and a small token budget (forcing chunked prefill).
// Invariants, checked every step: block-manager structure consistent, refcounts never
// negative, no block written while shared, no slot written twice in a step, every KV read
// sees the position it expects. At the end: every block free, every finished request's
// greedy output equal to the prompt decoded alone, and preemptions / prefix hits actually
// happened.
#include <stdlib.h>

#include "engine_fake.h"
#include "test.h"

#define VOCAB 61
#define MAX_REQ 2048

#include "stress_req.h"

static int reference(const struct req *r, int32_t *out) {
    int32_t ctx[160];
    memcpy(ctx, r->prompt, (size_t)r->n_prompt * sizeof *ctx);
    int k = 0;
    while (k < r->max_tokens) {
        int32_t t = fake_reference_next(ctx, r->n_prompt + k, VOCAB);
        ctx[r->n_prompt + k] = t;
        out[k++] = t;
        if (t == FAKE_EOS && !r->ignore_eos) break;
    }
    return k;
}

static void stress(uint64_t seed, bool prefix_caching, int steps) {
    rng_state = seed;
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.max_num_seqs = 6;
    o.max_num_batched_tokens = 24;
    o.enable_prefix_caching = prefix_caching;
    atomc_engine *e;
    struct fake_model *m;
    struct error err;
    CHECK(fake_engine_create(&o, VOCAB, 40, 128, false, &e, &m, &err) == ATOMC_OK);
    struct block_manager *bm = engine_block_manager(e);

    static struct req reqs[MAX_REQ];
    memset(reqs, 0, sizeof reqs);
    int n_req = 0;
    int32_t shared[4][40];
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 40; i++) shared[s][i] = 1 + (int32_t)rnd(VOCAB - 1);

    for (int step = 0; step < steps; step++) {
        // Arrivals.
        int arrivals = rnd(10) < 3 ? 1 + (int)rnd(3) : 0;
        for (int a = 0; a < arrivals && n_req < MAX_REQ; a++) {
            struct req *r = &reqs[n_req];
            if (n_req > 0 && rnd(6) == 0) { // an exact repeat: whole prompt may be cached
                const struct req *old = &reqs[rnd((uint32_t)n_req)];
                memcpy(r->prompt, old->prompt, sizeof r->prompt);
                r->n_prompt = old->n_prompt;
            } else {
                int pre = rnd(3) ? (int)rnd(41) : 0, suf = 1 + (int)rnd(20);
                const int32_t *base = shared[rnd(4)];
                for (int i = 0; i < pre; i++) r->prompt[i] = base[i];
                for (int i = 0; i < suf; i++) r->prompt[pre + i] = 1 + (int32_t)rnd(VOCAB - 1);
                r->n_prompt = pre + suf;
            }
            r->max_tokens = 1 + (int)rnd(40);
            r->ignore_eos = rnd(2);
            atomc_request q;
            atomc_request_init(&q);
            q.prompt_ids = r->prompt;
            q.n_prompt_ids = r->n_prompt;
            q.params.temperature = 0;
            q.params.max_tokens = r->max_tokens;
            q.params.ignore_eos = r->ignore_eos;
            q.on_output = on_out;
            q.user = r;
            CHECK(atomc_engine_add_request(e, &q, &r->id, NULL, 0) == ATOMC_OK);
            n_req++;
        }
        // Aborts of random live requests (any state).
        if (n_req && rnd(100) < 5) { // abort a live request (waiting, mid-prefill or decoding)
            for (int tries = 0; tries < 8; tries++) {
                struct req *r = &reqs[n_req - 1 - (int)rnd((uint32_t)(n_req < 16 ? n_req : 16))];
                if (!r->done && !r->aborted_by_us && atomc_engine_abort(e, r->id) == ATOMC_OK) {
                    r->aborted_by_us = true;
                    break;
                }
            }
        }
        atomc_engine_step(e);
        struct error ce = {0};
        if (!block_manager_check(bm, &ce)) {
            test_fail(__FILE__, __LINE__, "step %d: %s", step, ce.msg);
            break;
        }
        if (m->violations) {
            test_fail(__FILE__, __LINE__, "step %d: %d KV invariant violations", step, m->violations);
            break;
        }
    }
    while (atomc_engine_has_work(e)) atomc_engine_step(e);

    // Every id is forgotten once finished (the live-id set empties completely).
    for (int i = 0; i < n_req; i++) ASSERT_EQ(atomc_engine_abort(e, reqs[i].id), ATOMC_ERR_NOT_FOUND);
    int n_free = 0, checked = 0, aborted = 0;
    for (int i = 0; i < bm->num_blocks; i++) n_free += bm->blocks[i].ref_count == 0;
    ASSERT_EQ(n_free, bm->num_blocks);
    ASSERT_EQ(m->violations, 0);
    for (int i = 0; i < n_req; i++) {
        struct req *r = &reqs[i];
        ASSERT_EQ(r->n_final, 1);
        if (r->reason == ATOMC_FINISH_ABORT) {
            ASSERT_TRUE(r->aborted_by_us);
            aborted++;
            continue;
        }
        int32_t ref[64];
        int n = reference(r, ref);
        if (r->n_out != n || memcmp(r->out, ref, (size_t)n * sizeof *ref)) {
            test_fail(__FILE__, __LINE__, "request %d (prompt %d, max %d): output differs from running it alone", i,
                      r->n_prompt, r->max_tokens);
            return;
        }
        checked++;
    }
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    fprintf(stderr, "  seed %llu cache %d: %d requests, %d checked, %d aborted, %llu steps, %llu preemptions, "
                    "prefix hit rate %.1f%%, %llu evictions, max batch %d tokens\n",
            (unsigned long long)seed, prefix_caching, n_req, checked, aborted, (unsigned long long)st.num_steps,
            (unsigned long long)st.num_preemptions,
            st.prefix_cache_queries ? 100.0 * st.prefix_cache_hits / st.prefix_cache_queries : 0.0,
            (unsigned long long)st.prefix_cache_evictions, m->max_batch_tokens);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(aborted > 0);
    ASSERT_TRUE(checked > n_req / 2);
    ASSERT_TRUE(m->max_batch_tokens <= 24);
    if (prefix_caching) ASSERT_TRUE(st.prefix_cache_hits > 0);
    atomc_engine_free(e);
}

TEST(engine_stress_prefix_caching_seed1) { stress(0x1234567ull, true, 3000); }
TEST(engine_stress_prefix_caching_seed2) { stress(0xfeedbeefull, true, 3000); }
TEST(engine_stress_no_prefix_caching) { stress(0xabcdefull, false, 3000); }

int main(int argc, char **argv) { return test_main(argc, argv); }
