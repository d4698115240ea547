// Qwen3-Next / Qwen3.5-MoE through the whole engine on the CPU (tiny fixtures of
// tools/make_tiny_qwen3_next.py): recurrent-state slots under load. 1000 requests arrive at
// random with random prompt and output lengths on a KV pool small enough to force preemption
// (recompute from position 0 into whatever slot is free) and a token budget that chunks
// prefills; 4% of the steps abort a live request (waiting, mid-prefill or decoding). Every
// step: the free state slots plus the running sequences make max_num_seqs. At the end: every KV
// block and every state slot is free, every id is forgotten, and every finished request's greedy
// output equals the prompt run alone (tests/engine_model_scenarios.h's es_compare). Also:
// prefix caching is switched off for these models (no hits, no queries) and speculative decoding
// is refused.
#include <stdlib.h>

#include "atomc.h"
#include "engine_model_scenarios.h"
#include "test.h"

static const struct es_setup CPU = {
    .device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f, .min_clear = 0.5};

enum { N_REQ = 1000, MAX_SEQS = 6 };

static void stress(const char *model, uint64_t seed) {
    static struct es_sreq r[N_REQ];
    memset(r, 0, sizeof r);
    es_rng = seed;
    int n_r = 0, step = 0, aborts = 0;
    // 30 blocks of 4 tokens for 6 sequences of up to ~70 tokens: preemption; budget 16: chunks.
    atomc_engine *e = es_make(&CPU, model, 4, 30, 96, MAX_SEQS, 16, true);
    ASSERT_EQ(engine_num_free_state_slots(e), MAX_SEQS);
    while (n_r < N_REQ || atomc_engine_has_work(e)) {
        int arrivals = n_r < N_REQ && es_rnd(100) < 45 ? 1 + (int)es_rnd(2) : 0;
        for (int a = 0; a < arrivals && n_r < N_REQ; a++) {
            struct es_sreq *q = &r[n_r++];
            q->n = 1 + (int)es_rnd(40);
            for (int i = 0; i < q->n; i++)
                q->ids[i] = (int32_t)(es_rnd(250) + 3);
            q->max_tokens = 1 + (int)es_rnd(24);
            es_add(e, q->ids, q->n, q->max_tokens, &q->o, &q->id);
        }
        if (n_r && es_rnd(100) < 4) {
            for (int tries = 0; tries < 8; tries++) {
                struct es_sreq *q = &r[n_r - 1 - (int)es_rnd((uint32_t)(n_r < 12 ? n_r : 12))];
                if (!q->o.reason && !q->aborted && atomc_engine_abort(e, q->id) == ATOMC_OK) {
                    q->aborted = true;
                    aborts++;
                    break;
                }
            }
        }
        atomc_engine_step(e);
        atomc_stats st;
        atomc_engine_get_stats(e, &st);
        if (engine_num_free_state_slots(e) + st.num_running != MAX_SEQS) {
            test_fail(__FILE__, __LINE__, "step %d: %d free state slots with %d running (max_num_seqs %d)", step,
                      engine_num_free_state_slots(e), st.num_running, MAX_SEQS);
            break;
        }
        step++;
    }
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    fprintf(stderr,
            "  %s: %d requests, %d steps, %llu preemptions, %d aborts asked (%llu aborted), prefix queries %llu\n",
            model, n_r, step, (unsigned long long)st.num_preemptions, aborts,
            (unsigned long long)st.num_requests_aborted, (unsigned long long)st.prefix_cache_queries);
    ASSERT_EQ(n_r, N_REQ);
    ASSERT_EQ(engine_num_free_state_slots(e), MAX_SEQS);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(st.num_requests_aborted > 0);
    ASSERT_EQ(st.prefix_cache_queries, 0); // switched off for recurrent-state models
    for (int i = 0; i < n_r; i++)
        ASSERT_EQ(atomc_engine_abort(e, r[i].id), ATOMC_ERR_NOT_FOUND);
    atomc_engine_free(e);

    // Every finished request against the prompt run alone (one sequence, roomy pool).
    e = es_make(&CPU, model, 16, 16, 256, 1, 256, false);
    int checked = 0, tokens = 0, compared = 0, preempted = 0;
    for (int i = 0; i < n_r; i++) {
        if (r[i].o.reason == ATOMC_FINISH_ABORT) {
            ASSERT_TRUE(r[i].aborted);
            continue;
        }
        ASSERT_EQ(r[i].o.reason, ATOMC_FINISH_LENGTH);
        ASSERT_EQ(r[i].o.n, r[i].max_tokens);
        struct es_out alone;
        es_add(e, r[i].ids, r[i].n, r[i].max_tokens, &alone, NULL);
        es_run(e);
        int clear = 0, k = es_compare(&alone, &r[i].o, CPU.margin_tol, &clear);
        if (k < 0) {
            test_fail(__FILE__, __LINE__, "%s request %d (%d prompt tokens, %d preemptions): differs from alone", model,
                      i, r[i].n, r[i].o.preempted);
            break;
        }
        for (int t = 0; t < k; t++)
            ASSERT_NEAR(r[i].o.lp[t], alone.lp[t], CPU.lp_tol);
        checked++;
        tokens += r[i].o.n;
        compared += clear;
        preempted += r[i].o.preempted > 0;
    }
    ASSERT_EQ(engine_num_free_state_slots(e), 1);
    atomc_engine_free(e);
    fprintf(stderr, "  %d finished requests equal to alone (%d of them preempted): %d of %d tokens at a clear margin\n",
            checked, preempted, compared, tokens);
    ASSERT_TRUE(checked > n_r / 2);
    ASSERT_TRUE(preempted > 0);
    ASSERT_TRUE(compared >= CPU.min_clear * tokens);
}

TEST(qwen3_next_engine_1000_requests_random_aborts) {
    stress("qwen3_next", 0x51ab1e5ull);
}
TEST(qwen3_5_moe_engine_1000_requests_random_aborts) {
    stress("qwen3_5_moe", 0x7e57ull);
}

// The H200 stress (tests/gpu/test_cuda_engine.c) parted request 414 from its alone run at output
// 16: alone gave token 230 (logprob -1.55, margin 1.54), batched 113 (-2.77). In fp32 the position
// is 113 (-2.83, margin 0.06) with the last MoE layer's 2nd and 3rd experts 0.047 apart; swapping
// them gives 230 (-1.73, margin 1.46): the GPU reference run took the other expert under BF16
// rounding. es_route_flip explains that parting (either run flipped) and no other token.
TEST(qwen3_next_routing_flip_explains_h200_parting) {
    static const struct es_setup S = {.device = "cpu", .route_tol = 0.1f};
    const int32_t ids[] = {42, 165, 61, 147, 12, 195, 121, 51, 75, 85}; // request 414 of seed 0x51ab1e5
    static struct es_out fp32, flipped;
    es_route_run("qwen3_next", ids, 10, 26, -1, -1, &fp32);
    ASSERT_EQ(es_rt.n_calls[16], 3); // MoE layers 0, 1 and 3 (layer 2 is dense)
    ASSERT_TRUE(es_rt.gap[16][2] < 0.05f);
    ASSERT_EQ(fp32.toks[16], 113);
    es_route_run("qwen3_next", ids, 10, 26, 16, 2, &flipped);
    ASSERT_EQ(es_first_diff(&fp32, &flipped), 16);
    ASSERT_EQ(flipped.toks[16], 230);
    ASSERT_TRUE(flipped.margin[16] > 1.0f);
    ASSERT_TRUE(es_route_flip(&S, "qwen3_next", ids, 10, 26, &flipped, &fp32, 16)); // the reference flipped
    ASSERT_TRUE(es_route_flip(&S, "qwen3_next", ids, 10, 26, &fp32, &flipped, 16)); // the batched run flipped
    struct es_out bad = fp32;
    bad.toks[16] = 7; // a token no near-tie flip gives (a corrupted state)
    ASSERT_TRUE(!es_route_flip(&S, "qwen3_next", ids, 10, 26, &flipped, &bad, 16));
    bad = fp32;
    bad.toks[12] = 7; // at output 12 (routers 0.006, 1.06 and 2.58 from a tie)
    ASSERT_TRUE(!es_route_flip(&S, "qwen3_next", ids, 10, 26, &fp32, &bad, 12));
}

TEST(qwen3_next_engine_refuses_speculative_decoding) {
    char path[1024];
    snprintf(path, sizeof path, "%s", test_fixture("models/qwen3_next"));
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = path;
    o.device = "cpu";
    o.num_kv_blocks = 64;
    o.max_model_len = 128;
    o.max_num_seqs = 4;
    o.num_threads = 2;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 2;
    atomc_engine *e = NULL;
    char err[512] = "";
    ASSERT_EQ(atomc_engine_create(&o, &e, err, sizeof err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err, "speculative decoding") != NULL);
}

// P/D disaggregation moves paged KV blocks only: a recurrent model is refused before any socket opens.
TEST(qwen3_next_engine_refuses_kv_transfer) {
    char path[1024];
    snprintf(path, sizeof path, "%s", test_fixture("models/qwen3_next"));
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = path;
    o.device = "cpu";
    o.num_kv_blocks = 64;
    o.max_model_len = 128;
    o.max_num_seqs = 4;
    o.num_threads = 2;
    o.kv_transfer_config = "{\"kv_connector\": \"tcp\", \"kv_role\": \"kv_producer\", \"kv_ip\": \"127.0.0.1\", "
                           "\"kv_port\": 1}";
    atomc_engine *e = NULL;
    char err[512] = "";
    ASSERT_EQ(atomc_engine_create(&o, &e, err, sizeof err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err, "recurrent state") != NULL);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
