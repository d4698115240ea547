// Prefill/decode disaggregation between two engines of one process (issue 24), shared by the
// CPU test (tests/test_kv_engine.c) and the CUDA test (tests/gpu/test_cuda_kv_engine.c) over the
// tiny real-weight fixture llama_gqa (3 layers, block size 4). Header-only.
//
//   ke_pd_equals_single  a producer engine (chunked prefill: budget 8 tokens, so every prompt
//       is sent over several steps, each layer by the per-layer hook inside the forward) and a
//       consumer engine on loopback TCP; greedy outputs equal a single engine's (es_compare); the
//       consumer computes one prompt token per request; the bytes sent equal the prompts' KV.
//       Then prompts that share 6 leading blocks with one the consumer decoded before: the
//       consumer's HAVE makes the producer skip exactly those blocks (bytes sent drop by their
//       size), the outputs stay equal. At the end every block is free on both engines.
//       On CUDA (graphs on) the consumer's decode steps replay graphs while the producer's
//       prefill steps, which carry the hook, run eagerly. tp 2 (CPU): both instances tensor-
//       parallel, one connector per rank (ports kv_port, kv_port + 1), each rank sending its KV
//       head; the totals are the same as with tp 1.
//   ke_tp_mismatch_refused  a tp 1 consumer and a tp 2 producer: the handshake refuses them
//       (no connection comes up on either side) and the consumer's request prefills locally
//       with the same output.
#ifndef ATOMC_TESTS_KV_ENGINE_SCENARIOS_H
#define ATOMC_TESTS_KV_ENGINE_SCENARIOS_H

#include <stdio.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "engine_model_scenarios.h"

#define KE_BS 4
#define KE_BLOCKS 96
#define KE_MAX_TOKENS 6

static atomc_engine *ke_make(const struct es_setup *s, const char *kv_config, int budget, int tp) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    char path[1024];
    snprintf(path, sizeof path, "%s", test_fixture("models/llama_gqa"));
    o.model_path = path;
    o.device = s->device;
    o.enforce_eager = s->enforce_eager;
    o.block_size = KE_BS;
    o.num_kv_blocks = KE_BLOCKS;
    o.max_model_len = 128;
    o.max_num_seqs = 8;
    o.max_num_batched_tokens = budget;
    o.enable_prefix_caching = true;
    o.num_threads = 1;
    o.gpu_memory_utilization = 0.3;
    o.kv_transfer_config = kv_config;
    o.tensor_parallel_size = tp;
    atomc_engine *e = NULL;
    char err[1024];
    CHECK_MSG(atomc_engine_create(&o, &e, err, sizeof err) == ATOMC_OK, "%s", err);
    return e;
}

static void ke_add(atomc_engine *e, const int32_t *ids, int n, int max_tokens, struct es_out *c, const char *kv_id,
                   bool producer) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = ids;
    r.n_prompt_ids = n;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.logprobs = 2;
    r.on_output = es_on_out;
    memset(c, 0, sizeof *c);
    r.user = c;
    if (kv_id) {
        r.kv_transfer_id = kv_id;
        r.kv_do_remote_decode = producer;
        r.kv_do_remote_prefill = !producer;
        r.kv_remote_engine_id = producer ? "ke-c" : "ke-p";
    }
    char err[512];
    uint64_t id;
    CHECK_MSG(atomc_engine_add_request(e, &r, &id, err, sizeof err) == ATOMC_OK, "%s", err);
}

// Steps both engines until neither has work (the consumer waits for KV, the producer for ACKs).
static void ke_run_pair(atomc_engine *p, atomc_engine *c) {
    double end = time_now_s() + 120;
    while ((atomc_engine_has_work(p) || atomc_engine_has_work(c)) && time_now_s() < end) {
        int n = 0;
        if (atomc_engine_has_work(p)) n += atomc_engine_step(p);
        if (atomc_engine_has_work(c)) n += atomc_engine_step(c);
        if (!n) usleep(200); // waiting on the network
    }
    CHECK_MSG(!atomc_engine_has_work(p) && !atomc_engine_has_work(c), "the P/D pair did not finish in 120 s");
}

static bool ke_equal(const struct es_setup *s, const struct es_out *ref, const struct es_out *got, int i) {
    if (got->reason != ATOMC_FINISH_LENGTH || got->n != KE_MAX_TOKENS) {
        test_fail(__FILE__, __LINE__, "prompt %d: %d tokens, reason %d, error \"%s\"", i, got->n, (int)got->reason,
                  got->error);
        return false;
    }
    if (es_compare(ref, got, s->margin_tol, NULL) < 0) {
        test_fail(__FILE__, __LINE__, "prompt %d: the P/D output differs from the single engine's at a clear margin",
                  i);
        return false;
    }
    return true;
}

#define KE_N 6
#define KE_N2 3

__attribute__((unused)) static void ke_pd_equals_single(const struct es_setup *s, int tp) {
    // Prompts of 5..45 tokens (partial last blocks too); round 2 shares prompt 5's first 24.
    static int32_t ids[KE_N + KE_N2][64];
    int n_ids[KE_N + KE_N2];
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < KE_N; i++) {
        n_ids[i] = 5 + i * 8;
        for (int t = 0; t < n_ids[i]; t++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            ids[i][t] = (int32_t)(1 + (x >> 33) % 250);
        }
    }
    for (int j = 0; j < KE_N2; j++) {
        int i = KE_N + j;
        n_ids[i] = 24 + 3 + j * 5;
        memcpy(ids[i], ids[KE_N - 1], 24 * sizeof(int32_t));
        for (int t = 24; t < n_ids[i]; t++)
            ids[i][t] = (int32_t)(7 + t * 3 + j) % 250 + 1;
    }
    static struct es_out ref[KE_N + KE_N2], got[KE_N + KE_N2], pre[KE_N + KE_N2];
    atomc_engine *plain = ke_make(s, NULL, 64, 1);
    for (int i = 0; i < KE_N + KE_N2; i++) {
        ke_add(plain, ids[i], n_ids[i], KE_MAX_TOKENS, &ref[i], NULL, false);
        es_run(plain);
    }
    atomc_engine_free(plain);

    int port = test_free_port();
    char pc[300], cc[300];
    snprintf(pc, sizeof pc,
             "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"ke-p\","
             "\"query_timeout_s\":5}}",
             port);
    snprintf(cc, sizeof cc,
             "{\"kv_role\":\"kv_consumer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"ke-c\","
             "\"timeout_s\":30}}",
             port);
    atomc_engine *p = ke_make(s, pc, 8, tp), *c = ke_make(s, cc, 64, tp);
    atomc_stats ps, cs;
    double end = time_now_s() + 20;
    do {
        usleep(2000);
        atomc_engine_get_stats(p, &ps);
        atomc_engine_get_stats(c, &cs);
    } while ((ps.kv_peers < 1 || cs.kv_peers < 1) && time_now_s() < end);
    ASSERT_EQ(ps.kv_peers, 1);
    ASSERT_EQ(cs.kv_peers, 1);

    // Round 1: nothing cached on the consumer.
    char kv_id[KE_N + KE_N2][32];
    int tokens1 = 0, blocks1 = 0;
    for (int i = 0; i < KE_N; i++) {
        snprintf(kv_id[i], sizeof kv_id[i], "ke-%d", i);
        ke_add(p, ids[i], n_ids[i], 1, &pre[i], kv_id[i], true);
        ke_add(c, ids[i], n_ids[i], KE_MAX_TOKENS, &got[i], kv_id[i], false);
        tokens1 += n_ids[i];
        blocks1 += (n_ids[i] + KE_BS - 1) / KE_BS;
    }
    ke_run_pair(p, c);
    for (int i = 0; i < KE_N; i++) {
        ASSERT_EQ(pre[i].n, 1);
        if (!ke_equal(s, &ref[i], &got[i], i)) return;
    }
    atomc_engine_get_stats(p, &ps);
    atomc_engine_get_stats(c, &cs);
    // 3 layers x (K, V) x 2 KV heads x 64 dims x the KV element (4 bytes fp32 on the CPU, 2 bf16).
    uint64_t tb = ps.kv_bytes_sent / (uint64_t)tokens1;
    fprintf(stderr,
            "  %s tp %d: round 1: %d prompts, %llu KV bytes (%llu per token), %llu layer frames (%llu during the "
            "forward), %llu graph replays on the consumer\n",
            s->device, tp, KE_N, (unsigned long long)ps.kv_bytes_sent, (unsigned long long)tb,
            (unsigned long long)ps.kv_layers_sent, (unsigned long long)ps.kv_layers_during_forward,
            (unsigned long long)engine_graph_replays(c));
    ASSERT_EQ(ps.kv_bytes_sent, (uint64_t)tokens1 * tb);
    ASSERT_TRUE(tb == 3 * 2 * 2 * 64 * 4 || tb == 3 * 2 * 2 * 64 * 2);
    ASSERT_EQ(cs.kv_bytes_received, ps.kv_bytes_sent);
    ASSERT_EQ(ps.kv_transfers_sent, KE_N);
    ASSERT_EQ(cs.kv_transfers_received, KE_N);
    ASSERT_EQ(ps.kv_blocks_sent, blocks1);
    ASSERT_EQ(cs.kv_fallbacks, 0);
    ASSERT_EQ(cs.prompt_tokens_computed, KE_N); // the last prompt token of each
    ASSERT_EQ(ps.kv_blocks_skipped, 0);
    // Budget 8: a prompt of n tokens is sent over ceil(n / 8) steps (more when batched with
    // others), one frame per layer per step and rank.
    ASSERT_TRUE(ps.kv_layers_sent % (3 * (uint64_t)tp) == 0 && ps.kv_layers_sent >= 3 * (uint64_t)tp * (tokens1 / 8));
    ASSERT_TRUE(es_graphs_as_expected(s, c));

    // Round 2: 6 leading blocks (24 tokens) of each prompt are cached on the consumer.
    uint64_t bytes0 = ps.kv_bytes_sent;
    int tokens2 = 0;
    for (int i = KE_N; i < KE_N + KE_N2; i++) {
        snprintf(kv_id[i], sizeof kv_id[i], "ke-%d", i);
        ke_add(p, ids[i], n_ids[i], 1, &pre[i], kv_id[i], true);
        ke_add(c, ids[i], n_ids[i], KE_MAX_TOKENS, &got[i], kv_id[i], false);
        ke_run_pair(p, c); // one at a time: the consumer caches nothing of one for the next
        tokens2 += n_ids[i];
    }
    for (int i = KE_N; i < KE_N + KE_N2; i++)
        if (!ke_equal(s, &ref[i], &got[i], i)) return;
    atomc_engine_get_stats(p, &ps);
    atomc_engine_get_stats(c, &cs);
    fprintf(stderr, "  %s tp %d: round 2: %d prompts sharing 6 cached blocks: %llu KV bytes sent (%llu without the skip)\n",
            s->device, tp, KE_N2, (unsigned long long)(ps.kv_bytes_sent - bytes0), (unsigned long long)(tokens2 * tb));
    ASSERT_EQ(ps.kv_blocks_skipped, 6 * KE_N2);
    ASSERT_EQ(cs.kv_blocks_skipped, 6 * KE_N2);
    ASSERT_EQ(ps.kv_bytes_sent - bytes0, (uint64_t)(tokens2 - 24 * KE_N2) * tb);
    ASSERT_EQ(cs.kv_bytes_received, ps.kv_bytes_sent);
    ASSERT_EQ(cs.kv_fallbacks, 0);
    ASSERT_EQ(cs.prompt_tokens_computed, KE_N + KE_N2);
    // No block leaks: the producer's held blocks came back with the ACKs.
    ASSERT_EQ(ps.kv_held_blocks, 0);
    ASSERT_EQ(ps.num_free_kv_blocks, KE_BLOCKS);
    ASSERT_EQ(cs.num_free_kv_blocks, KE_BLOCKS);
    atomc_engine_free(c);
    atomc_engine_free(p);
}

__attribute__((unused)) static void ke_tp_mismatch_refused(const struct es_setup *s) {
    int32_t ids[20];
    for (int t = 0; t < 20; t++) ids[t] = 3 + t * 11 % 240;
    static struct es_out ref, got;
    atomc_engine *plain = ke_make(s, NULL, 64, 1);
    ke_add(plain, ids, 20, KE_MAX_TOKENS, &ref, NULL, false);
    es_run(plain);
    atomc_engine_free(plain);
    int port = test_free_port();
    char pc[300], cc[300];
    snprintf(pc, sizeof pc, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"ke-p\"}}",
             port);
    snprintf(cc, sizeof cc,
             "{\"kv_role\":\"kv_consumer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"ke-c\","
             "\"timeout_s\":1}}",
             port);
    atomc_engine *p = ke_make(s, pc, 64, 2), *c = ke_make(s, cc, 64, 1);
    usleep(1500 * 1000); // the consumer connects (and is refused) in the background
    atomc_stats ps, cs;
    atomc_engine_get_stats(p, &ps);
    atomc_engine_get_stats(c, &cs);
    ASSERT_EQ(ps.kv_peers, 0);
    ASSERT_EQ(cs.kv_peers, 0);
    ke_add(c, ids, 20, KE_MAX_TOKENS, &got, "ke-x", false);
    es_run(c);
    ASSERT_TRUE(ke_equal(s, &ref, &got, 0));
    atomc_engine_get_stats(c, &cs);
    ASSERT_EQ(cs.kv_fallbacks, 1);
    ASSERT_EQ(cs.num_free_kv_blocks, KE_BLOCKS);
    atomc_engine_free(c);
    atomc_engine_free(p);
}

#endif
