// Speculative decoding (ngram) in the engine loop, over the TEST-ONLY fake model (engine_fake.h):
// the proposer and the verification rule on their own; options and their errors; stops, min /
// max tokens inside an accepted run (scripted model); and randomized stress with drafts on: every
// finished request's output equals the prompt decoded alone without speculation (greedy, and
// seeded sampling, which verification reproduces draw for draw, spec.h), under preemption, prefix
// hits, chunked prefill, mixed batches and random aborts, with the block manager consistent every
// step and every KV block (and draft slot) back in the pool at the end.
#include <stdlib.h>

#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/spec.h"
#include "engine_fake.h"
#include "server/metrics.h"
#include "test.h"

TEST(spec_ngram_finds_longest_latest_match) {
    int32_t out[8];
    // ... 1 2 3 [9] ... 2 3 [7] ... 1 2 3: the 3-gram "1 2 3" wins over the later 2-gram "2 3".
    int32_t a[] = {1, 2, 3, 9, 4, 2, 3, 7, 5, 1, 2, 3};
    ASSERT_EQ(spec_ngram_propose(a, 12, 1, 4, 3, out), 3);
    ASSERT_EQ(out[0], 9);
    ASSERT_EQ(out[1], 4);
    ASSERT_EQ(out[2], 2);
    // max_n 2: "2 3" occurs twice; the latest occurrence (followed by 7) wins.
    ASSERT_EQ(spec_ngram_propose(a, 12, 1, 2, 2, out), 2);
    ASSERT_EQ(out[0], 7);
    ASSERT_EQ(out[1], 5);
    // min_n 4: no earlier 4-gram "x 1 2 3".
    ASSERT_EQ(spec_ngram_propose(a, 12, 4, 5, 3, out), 0);
    // The continuation is cut at the end of the tokens; a periodic run proposes its own period.
    int32_t b[] = {5, 6, 5, 6, 5};
    ASSERT_EQ(spec_ngram_propose(b, 5, 2, 3, 4, out), 2); // "5 6 5" at 0..2, then 6 5
    ASSERT_EQ(out[0], 6);
    ASSERT_EQ(out[1], 5);
    int32_t c[] = {4, 4};
    ASSERT_EQ(spec_ngram_propose(c, 2, 1, 1, 4, out), 1);
    ASSERT_EQ(out[0], 4);
    ASSERT_EQ(spec_ngram_propose(c, 1, 1, 1, 4, out), 0);
    ASSERT_EQ(spec_ngram_propose(a, 12, 1, 4, 0, out), 0);
}

TEST(spec_accepted_length_is_the_matching_prefix) {
    int32_t d[] = {1, 2, 3};
    int32_t t0[] = {1, 2, 3, 4}, t1[] = {1, 9, 3, 4}, t2[] = {7, 2, 3, 4};
    ASSERT_EQ(spec_accepted_length(d, 3, t0), 3);
    ASSERT_EQ(spec_accepted_length(d, 3, t1), 1);
    ASSERT_EQ(spec_accepted_length(d, 3, t2), 0);
    ASSERT_EQ(spec_accepted_length(d, 0, t2), 0);
}

static atomc_status make(atomc_engine_options *o, int vocab, int blocks, atomc_engine **e, struct fake_model **m,
                         char *msg) {
    struct error err = {0};
    atomc_status st = fake_engine_create(o, vocab, blocks, 128, false, e, m, &err);
    snprintf(msg, 256, "%.200s", err.msg);
    return st;
}

TEST(spec_options_checked) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    atomc_engine *e;
    struct fake_model *m;
    char msg[256];
    o.num_speculative_tokens = 3; // no method
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "without a speculative method"));
    o.speculative_method = "mtp"; // the fake model has no MTP layer to draft with
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(msg, "cannot draft"));
    o.speculative_method = "eagle3"; // no head directory
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "needs the EAGLE-3 head"));
    o.speculative_model = "head"; // the fake model cannot draft with it either
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(msg, "cannot draft"));
    o.speculative_model = NULL;
    o.speculative_method = "eagle";
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(msg, "\"eagle\" is not implemented"));
    o.speculative_method = "nrgam";
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "unknown speculative method \"nrgam\""));
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 0;
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "num_speculative_tokens must be in 1..16, got 0"));
    o.num_speculative_tokens = 17;
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    o.num_speculative_tokens = 4;
    o.prompt_lookup_min = 4;
    o.prompt_lookup_max = 2;
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "prompt_lookup_min (4) is larger than prompt_lookup_max (2)"));
    o.prompt_lookup_min = -1;
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    o.prompt_lookup_min = 2;
    o.prompt_lookup_max = 0;
    o.speculative_disable_by_batch_size = -2;
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    o.speculative_disable_by_batch_size = 0;
    ASSERT_EQ(make(&o, 16, 64, &e, &m, msg), ATOMC_OK);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_speculative_tokens, 4);
    atomc_engine_free(e);
}

// Scripted model: the token after a context of L tokens is 5 + L % 4 (a period-4 text), so
// prompt lookup proposes exactly what the model says and every draft is accepted.
struct sout {
    int32_t toks[64];
    int n, n_outputs, completion;
    atomc_finish_reason reason;
    int32_t stop_token;
};
static void s_on_out(void *user, const atomc_output *o) {
    struct sout *c = user;
    for (int i = 0; i < o->n_new_tokens; i++)
        c->toks[c->n++] = o->new_tokens[i];
    c->n_outputs++;
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        c->reason = o->finish_reason;
        c->stop_token = o->stop_token;
        c->completion = o->completion_tokens;
    }
}

static atomc_engine *scripted(int k, struct fake_model **m) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = k;
    o.prompt_lookup_min = 2;
    o.prompt_lookup_max = 2;
    atomc_engine *e;
    char msg[256];
    CHECK_MSG(make(&o, 16, 64, &e, m, msg) == ATOMC_OK, "%s", msg);
    static int32_t script[128];
    for (int i = 0; i < 128; i++)
        script[i] = 5 + i % 4;
    (*m)->script = script;
    (*m)->n_script = 128;
    (*m)->script_from = 0;
    return e;
}

static void run_scripted(atomc_engine *e, int max_tokens, int min_tokens, int32_t stop_id, struct sout *c) {
    static const int32_t prompt[] = {5, 6, 7, 8, 5, 6}; // the script's first 6 tokens
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = prompt;
    r.n_prompt_ids = 6;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.min_tokens = min_tokens;
    r.params.stop_token_ids = &stop_id;
    r.params.n_stop_token_ids = stop_id >= 0 ? 1 : 0;
    r.on_output = s_on_out;
    memset(c, 0, sizeof *c);
    r.user = c;
    CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
}

TEST(spec_all_accepted_run_in_one_step) {
    struct fake_model *m;
    atomc_engine *e = scripted(4, &m);
    struct sout c;
    run_scripted(e, 11, 0, -1, &c);
    // Step 1: prefill -> 7. Step 2: drafts 8 5 6 7 all accepted + the target's 8. Step 3: drafts
    // capped at what max_tokens leaves (11 - 6 - 1 = 4): 5 6 7 8 + 5. Step 4: none left.
    ASSERT_EQ(c.n, 11);
    for (int i = 0; i < 11; i++)
        ASSERT_EQ(c.toks[i], 5 + (6 + i) % 4);
    ASSERT_EQ(c.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(c.n_outputs, 11); // one output per token
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_steps, 3);
    ASSERT_EQ(st.spec_num_drafts, 2);
    ASSERT_EQ(st.spec_num_draft_tokens, 8);
    ASSERT_EQ(st.spec_num_accepted_tokens, 8);
    for (int i = 0; i < 4; i++)
        ASSERT_EQ(st.spec_accepted_per_pos[i], 2);
    ASSERT_EQ(st.spec_accepted_per_pos[4], 0);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_EQ(st.generation_tokens_total, 11);
    ASSERT_EQ(m->violations, 0);
    ASSERT_EQ(m->max_batch_tokens, 6);
    atomc_engine_free(e);
}

TEST(spec_stop_inside_accepted_run_ends_there) {
    struct fake_model *m;
    atomc_engine *e = scripted(4, &m);
    struct sout c;
    run_scripted(e, 30, 0, 6, &c); // 7, then drafts 8 5 6 7: the stop id 6 is the third
    ASSERT_EQ(c.n, 4);
    ASSERT_EQ(c.toks[0], 7);
    ASSERT_EQ(c.toks[1], 8);
    ASSERT_EQ(c.toks[2], 5);
    ASSERT_EQ(c.toks[3], 6);
    ASSERT_EQ(c.reason, ATOMC_FINISH_STOP);
    ASSERT_EQ(c.stop_token, 6);
    ASSERT_EQ(c.completion, 4);
    // min_tokens 5: the stop id is banned (and not a stop) until 5 outputs; the scripted model
    // ignores bans but the engine must not stop at the 6 inside the first run (output 4).
    run_scripted(e, 30, 5, 6, &c);
    ASSERT_EQ(c.reason, ATOMC_FINISH_STOP);
    ASSERT_EQ(c.n, 8); // 7 8 5 6 | 7 8 5 6: the second 6 (output 8) stops
    ASSERT_EQ(c.toks[7], 6);
    // max_tokens inside a run: 3 tokens = 7 (prefill), then one draft (8) + the target's 5.
    run_scripted(e, 3, 0, -1, &c);
    ASSERT_EQ(c.n, 3);
    ASSERT_EQ(c.reason, ATOMC_FINISH_LENGTH);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_EQ(m->violations, 0);
    atomc_engine_free(e);
}

// Stop strings on the detokenized text inside an accepted run (fake tokenizer: id k > 0 is the
// letter 'a' + k - 1, so the script 5 6 7 8 reads "efgh").
struct tout {
    char text[256];
    size_t len;
    int n_tokens;
    atomc_finish_reason reason;
    char stop_str[16];
};
static void t_on_out(void *user, const atomc_output *o) {
    struct tout *c = user;
    memcpy(c->text + c->len, o->text, o->text_len);
    c->len += o->text_len;
    c->text[c->len] = 0;
    c->n_tokens += o->n_new_tokens;
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        c->reason = o->finish_reason;
        snprintf(c->stop_str, sizeof c->stop_str, "%s", o->stop_str ? o->stop_str : "");
    }
}

TEST(spec_stop_string_inside_accepted_run) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 4;
    o.prompt_lookup_min = o.prompt_lookup_max = 2;
    atomc_engine *e;
    struct fake_model *m;
    struct error err = {0};
    ASSERT_EQ(fake_engine_create(&o, 16, 64, 128, true, &e, &m, &err), ATOMC_OK);
    static int32_t script[128];
    for (int i = 0; i < 128; i++)
        script[i] = 5 + i % 4;
    m->script = script;
    m->n_script = 128;
    for (int include = 0; include < 2; include++) {
        static const int32_t prompt[] = {5, 6, 7, 8, 5, 6};
        const char *stop[] = {"hef"};
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = prompt;
        r.n_prompt_ids = 6;
        r.params.temperature = 0;
        r.params.max_tokens = 30;
        r.params.stop = stop;
        r.params.n_stop = 1;
        r.params.include_stop_str_in_output = include;
        struct tout c;
        memset(&c, 0, sizeof c);
        r.on_output = t_on_out;
        r.user = &c;
        CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
        while (atomc_engine_has_work(e))
            atomc_engine_step(e);
        // Output g (prefill), then the run h e f g + h: "hef" completes at the 4th output token.
        ASSERT_EQ(c.reason, ATOMC_FINISH_STOP);
        ASSERT_STREQ(c.stop_str, "hef");
        ASSERT_EQ(c.n_tokens, 4);
        ASSERT_STREQ(c.text, include ? "ghef" : "g");
    }
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_TRUE(st.spec_num_accepted_tokens > 0);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    atomc_engine_free(e);
}

// The opt-out rule (spec.h): a sequence whose drafts keep missing drafts in bursts of
// SPEC_OPT_OUT_MISSES steps separated by SPEC_OPT_OUT_PAUSE steps without drafts.
TEST(spec_useless_drafts_pause) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 2;
    o.prompt_lookup_min = o.prompt_lookup_max = 1;
    atomc_engine *e;
    struct fake_model *m;
    char msg[256];
    CHECK(make(&o, 64, 64, &e, &m, msg) == ATOMC_OK);
    // A text where prompt lookup guesses wrong: token L is 1 + (7 L^2 + 3 L) % 61 (no accepted draft
    // is asserted below).
    static int32_t script[128];
    for (int i = 0; i < 128; i++)
        script[i] = 1 + (int32_t)((i * i * 7 + i * 3) % 61);
    m->script = script;
    m->n_script = 128;
    int32_t prompt[4] = {script[0], script[1], script[2], script[3]};
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = prompt;
    r.n_prompt_ids = 4;
    r.params.temperature = 0;
    r.params.max_tokens = 60;
    r.params.ignore_eos = true;
    struct sout c;
    memset(&c, 0, sizeof c);
    r.on_output = s_on_out;
    r.user = &c;
    CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(c.n, 60);
    for (int i = 0; i < 60; i++)
        ASSERT_EQ(c.toks[i], script[4 + i]);
    fprintf(stderr, "  %llu steps, %llu drafted, %llu draft tokens accepted\n", (unsigned long long)st.num_steps,
            (unsigned long long)st.spec_num_drafts, (unsigned long long)st.spec_num_accepted_tokens);
    ASSERT_EQ(st.spec_num_accepted_tokens, 0);
    // Without the rule nearly every one of the ~59 decode steps would draft; with it at most
    // 8 of every 24.
    ASSERT_TRUE(st.spec_num_drafts >= 8);
    ASSERT_TRUE(st.spec_num_drafts <= 8 * (st.num_steps / 24 + 1));
    atomc_engine_free(e);
}

TEST(spec_failed_verify_step_frees_everything) {
    struct fake_model *m;
    atomc_engine *e = scripted(4, &m);
    static const int32_t prompt[] = {5, 6, 7, 8, 5, 6};
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = prompt;
    r.n_prompt_ids = 6;
    r.params.temperature = 0;
    r.params.max_tokens = 20;
    struct sout c;
    memset(&c, 0, sizeof c);
    r.on_output = s_on_out;
    r.user = &c;
    CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
    atomc_engine_step(e); // prefill
    m->fail_next = 1;     // the verify step (1 + 4 tokens) fails
    atomc_engine_step(e);
    ASSERT_EQ(c.reason, ATOMC_FINISH_ERROR);
    ASSERT_EQ(c.n, 1);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_EQ(st.spec_num_drafts, 0);
    run_scripted(e, 11, 0, -1, &c); // the engine keeps serving, with drafts
    ASSERT_EQ(c.n, 11);
    ASSERT_EQ(c.reason, ATOMC_FINISH_LENGTH);
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.spec_num_accepted_tokens, 8);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    ASSERT_EQ(m->violations, 0);
    atomc_engine_free(e);
}

TEST(spec_opt_out_and_batch_fallback) {
    struct fake_model *m;
    atomc_engine *e = scripted(4, &m);
    static const int32_t prompt[] = {5, 6, 7, 8, 5, 6};
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = prompt;
    r.n_prompt_ids = 6;
    r.params.temperature = 0;
    r.params.max_tokens = 8;
    r.params.no_speculation = true;
    struct sout c;
    memset(&c, 0, sizeof c);
    r.on_output = s_on_out;
    r.user = &c;
    CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(c.n, 8);
    ASSERT_EQ(st.spec_num_drafts, 0);
    ASSERT_EQ(st.num_steps, 8);
    atomc_engine_free(e);

    // Batch fall-back: with speculative_disable_by_batch_size 2, three decoding sequences get no
    // drafts; once two remain, they do.
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 2;
    o.prompt_lookup_min = o.prompt_lookup_max = 2;
    o.speculative_disable_by_batch_size = 2;
    char msg[256];
    CHECK(make(&o, 16, 64, &e, &m, msg) == ATOMC_OK);
    static int32_t script[128];
    for (int i = 0; i < 128; i++)
        script[i] = 5 + i % 4;
    m->script = script;
    m->n_script = 128;
    struct sout cs[3];
    for (int i = 0; i < 3; i++) {
        memset(&cs[i], 0, sizeof cs[i]);
        r.params.no_speculation = false;
        r.params.max_tokens = i == 0 ? 3 : 12; // the first finishes after 3 plain decode steps
        r.user = &cs[i];
        CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
    }
    atomc_engine_step(e); // prefills
    atomc_engine_step(e); // 3 decoding: no drafts
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.spec_num_drafts, 0);
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
    atomc_engine_get_stats(e, &st);
    ASSERT_TRUE(st.spec_num_drafts > 0);
    for (int i = 0; i < 3; i++) {
        ASSERT_EQ(cs[i].n, i == 0 ? 3 : 12);
        for (int t = 0; t < cs[i].n; t++)
            ASSERT_EQ(cs[i].toks[t], 5 + (6 + t) % 4);
    }
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    atomc_engine_free(e);
}

TEST(spec_metrics_rendered_with_vllm_names) {
    struct metrics mt;
    metrics_init(&mt, "m");
    atomc_stats st = {.num_speculative_tokens = 2,
                      .spec_num_drafts = 7,
                      .spec_num_draft_tokens = 13,
                      .spec_num_accepted_tokens = 9,
                      .spec_accepted_per_pos = {6, 3}};
    char *txt;
    size_t len;
    ASSERT_EQ(metrics_render(&mt, &st, &txt, &len), 0);
    ASSERT_TRUE(strstr(txt, "# TYPE vllm:spec_decode_num_drafts_total counter\n"));
    ASSERT_TRUE(strstr(txt, "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 7\n"));
    ASSERT_TRUE(strstr(txt, "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 13\n"));
    ASSERT_TRUE(strstr(txt, "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 9\n"));
    ASSERT_TRUE(strstr(txt, "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",position=\"0\"} 6\n"));
    ASSERT_TRUE(strstr(txt, "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",position=\"1\"} 3\n"));
    ASSERT_TRUE(!strstr(txt, "position=\"2\""));
    free(txt);
    st.num_speculative_tokens = 0; // off: no spec_decode series at all
    ASSERT_EQ(metrics_render(&mt, &st, &txt, &len), 0);
    ASSERT_TRUE(!strstr(txt, "spec_decode"));
    free(txt);
    metrics_free(&mt);
}

TEST(spec_truncate_releases_only_the_tail) {
    struct block_manager *bm;
    struct error err;
    ASSERT_EQ(block_manager_create(8, 4, true, &bm, &err), ATOMC_OK);
    struct block_table bt;
    block_table_init(&bt);
    int32_t toks[16];
    for (int i = 0; i < 16; i++)
        toks[i] = 100 + i;
    ASSERT_TRUE(block_manager_allocate(bm, &bt, 14)); // 4 blocks: 9 verified tokens + 5 draft slots
    block_manager_commit(bm, &bt, toks, 9);           // 2 full verified blocks registered
    ASSERT_EQ(bt.n_hashed, 2);
    ASSERT_EQ(block_manager_num_free(bm), 4);
    ASSERT_EQ(block_manager_truncate(bm, &bt, 10), 1); // keep ceil(10 / 4) = 3 blocks
    ASSERT_EQ(bt.n, 3);
    ASSERT_EQ(block_manager_num_free(bm), 5);
    ASSERT_EQ(block_manager_truncate(bm, &bt, 12), 0);
    ASSERT_TRUE(block_manager_check(bm, &err));
    ASSERT_EQ(bm->n_lru, 0); // the released block was never registered: plain free stack
    block_manager_release(bm, &bt);
    ASSERT_EQ(block_manager_num_free(bm), 8);
    block_table_free(&bt);
    block_manager_free(bm);
}

TEST(spec_forced_acceptance_for_benchmarks) {
    for (int pass = 0; pass < 3; pass++) {
        double rate = pass == 0 ? 1.0 : pass == 1 ? 1e-12 : 0.5;
        atomc_engine_options o;
        atomc_engine_options_init(&o);
        o.block_size = 4;
        o.speculative_method = "ngram";
        o.num_speculative_tokens = 3;
        o.spec_forced_acceptance = rate;
        atomc_engine *e;
        struct fake_model *m;
        char msg[256];
        CHECK_MSG(make(&o, 61, 64, &e, &m, msg) == ATOMC_OK, "%s", msg);
        static const int32_t prompt[] = {9, 10, 11};
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = prompt;
        r.n_prompt_ids = 3;
        r.params.temperature = 0;
        r.params.max_tokens = 25;
        r.params.ignore_eos = true;
        struct sout c;
        memset(&c, 0, sizeof c);
        r.on_output = s_on_out;
        r.user = &c;
        CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
        while (atomc_engine_has_work(e))
            atomc_engine_step(e);
        atomc_stats st;
        atomc_engine_get_stats(e, &st);
        ASSERT_EQ(c.n, 25);
        ASSERT_TRUE(st.spec_num_drafts > 0);
        if (pass == 0) { // all accepted: 1 prefill step + 24 tokens in steps of 4
            ASSERT_EQ(st.spec_num_accepted_tokens, st.spec_num_draft_tokens);
            ASSERT_EQ(st.num_steps, 7);
        } else if (pass == 1) {
            ASSERT_EQ(st.spec_num_accepted_tokens, 0);
            ASSERT_EQ(st.num_steps, 25);
        } else {
            ASSERT_TRUE(st.spec_num_accepted_tokens > 0 && st.spec_num_accepted_tokens < st.spec_num_draft_tokens);
        }
        ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
        ASSERT_EQ(m->violations, 0);
        atomc_engine_free(e);
    }
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.spec_forced_acceptance = 0.5; // needs a method
    atomc_engine *e;
    struct fake_model *m;
    char msg[256];
    ASSERT_EQ(make(&o, 61, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
    o.speculative_method = "ngram";
    o.num_speculative_tokens = 2;
    o.spec_forced_acceptance = 1.5;
    ASSERT_EQ(make(&o, 61, 64, &e, &m, msg), ATOMC_ERR_INVALID_ARGUMENT);
}

// --- randomized stress: speculation on vs the plain reference -------------------------------------

#define VOCAB 6 // a small vocabulary: the hash model's text repeats, so prompt lookup often hits
#define MAX_REQ 2048

#include "stress_req.h"

static void add_req(atomc_engine *e, struct req *r) {
    atomc_request q;
    atomc_request_init(&q);
    q.prompt_ids = r->prompt;
    q.n_prompt_ids = r->n_prompt;
    q.params.temperature = r->sampled ? 0.8f : 0.0f;
    q.params.has_seed = r->sampled;
    q.params.seed = r->seed;
    q.params.max_tokens = r->max_tokens;
    q.params.ignore_eos = r->ignore_eos;
    q.on_output = on_out;
    q.user = r;
    CHECK(atomc_engine_add_request(e, &q, &r->id, NULL, 0) == ATOMC_OK);
}

static void spec_stress(uint64_t seed, bool prefix_caching, int k, int steps) {
    rng_state = seed;
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.max_num_seqs = 6;
    o.max_num_batched_tokens = 24;
    o.enable_prefix_caching = prefix_caching;
    o.speculative_method = "ngram";
    o.num_speculative_tokens = k;
    o.prompt_lookup_min = 1;
    o.prompt_lookup_max = 3;
    o.speculative_disable_by_batch_size = -1;
    atomc_engine *e;
    struct fake_model *m;
    char msg[256];
    CHECK_MSG(make(&o, VOCAB, 40, &e, &m, msg) == ATOMC_OK, "%s", msg);
    struct block_manager *bm = engine_block_manager(e);
    static struct req reqs[MAX_REQ];
    memset(reqs, 0, sizeof reqs);
    int n_req = 0;
    int32_t shared[4][40];
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 40; i++)
            shared[s][i] = 1 + (int32_t)rnd(VOCAB - 1);
    for (int step = 0; step < steps; step++) {
        int arrivals = rnd(10) < 3 ? 1 + (int)rnd(3) : 0;
        for (int a = 0; a < arrivals && n_req < MAX_REQ; a++) {
            struct req *r = &reqs[n_req];
            if (n_req > 0 && rnd(6) == 0) {
                const struct req *old = &reqs[rnd((uint32_t)n_req)];
                memcpy(r->prompt, old->prompt, sizeof r->prompt);
                r->n_prompt = old->n_prompt;
            } else {
                int pre = rnd(3) ? (int)rnd(41) : 0, suf = 1 + (int)rnd(20);
                const int32_t *base = shared[rnd(4)];
                for (int i = 0; i < pre; i++)
                    r->prompt[i] = base[i];
                for (int i = 0; i < suf; i++)
                    r->prompt[pre + i] = 1 + (int32_t)rnd(VOCAB - 1);
                r->n_prompt = pre + suf;
            }
            r->max_tokens = 1 + (int)rnd(40);
            r->ignore_eos = rnd(2);
            r->sampled = rnd(3) == 0;
            r->seed = rnd(1000);
            add_req(e, r);
            n_req++;
        }
        if (n_req && rnd(100) < 5) {
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
        // Draft slots never outlive their step: between steps no sequence carries drafts or holds a
        // block beyond its known tokens.
        for (int i = 0; i < e->sched->n_running; i++) {
            const struct sequence *q = e->sched->running[i];
            if (q->n_draft != 0 || q->bt.n > block_manager_blocks_for(bm, q->n_tokens)) {
                test_fail(__FILE__, __LINE__, "step %d: sequence %llu keeps %d drafts, %d blocks for %d tokens", step,
                          (unsigned long long)q->id, q->n_draft, q->bt.n, q->n_tokens);
                step = steps;
                break;
            }
        }
    }
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
    for (int i = 0; i < n_req; i++)
        ASSERT_EQ(atomc_engine_abort(e, reqs[i].id), ATOMC_ERR_NOT_FOUND);
    int n_free = 0;
    for (int i = 0; i < bm->num_blocks; i++)
        n_free += bm->blocks[i].ref_count == 0;
    ASSERT_EQ(n_free, bm->num_blocks);
    ASSERT_EQ(m->violations, 0);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    atomc_engine_free(e);

    // The reference: each request alone on a plain engine (no speculation, no prefix cache).
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.enable_prefix_caching = false;
    CHECK(make(&o, VOCAB, 64, &e, &m, msg) == ATOMC_OK);
    int checked = 0, aborted = 0, sampled = 0;
    for (int i = 0; i < n_req; i++) {
        struct req *r = &reqs[i];
        ASSERT_EQ(r->n_final, 1);
        if (r->reason == ATOMC_FINISH_ABORT) {
            ASSERT_TRUE(r->aborted_by_us);
            aborted++;
            continue;
        }
        struct req alone = *r;
        alone.n_out = 0;
        alone.n_final = 0;
        alone.done = false;
        add_req(e, &alone);
        while (atomc_engine_has_work(e))
            atomc_engine_step(e);
        if (r->n_out != alone.n_out || memcmp(r->out, alone.out, (size_t)alone.n_out * sizeof *alone.out) ||
            r->reason != alone.reason) {
            test_fail(__FILE__, __LINE__, "request %d (prompt %d, max %d, sampled %d): output differs from alone", i,
                      r->n_prompt, r->max_tokens, r->sampled);
            break;
        }
        checked++;
        sampled += r->sampled;
    }
    atomc_engine_free(e);
    fprintf(stderr,
            "  seed %llu cache %d k %d: %d requests (%d checked, %d sampled, %d aborted), %llu steps, %llu "
            "preemptions, prefix hits %llu, drafts %llu, draft tokens %llu, accepted %llu (%.1f%%)\n",
            (unsigned long long)seed, prefix_caching, k, n_req, checked, sampled, aborted,
            (unsigned long long)st.num_steps, (unsigned long long)st.num_preemptions,
            (unsigned long long)st.prefix_cache_hits, (unsigned long long)st.spec_num_drafts,
            (unsigned long long)st.spec_num_draft_tokens, (unsigned long long)st.spec_num_accepted_tokens,
            st.spec_num_draft_tokens ? 100.0 * st.spec_num_accepted_tokens / st.spec_num_draft_tokens : 0.0);
    ASSERT_TRUE(st.num_preemptions > 0);
    ASSERT_TRUE(aborted > 0);
    ASSERT_TRUE(checked > n_req / 2);
    ASSERT_TRUE(sampled > 0);
    ASSERT_TRUE(st.spec_num_drafts > 100);
    ASSERT_TRUE(st.spec_num_accepted_tokens > 50);
    ASSERT_TRUE(st.spec_num_accepted_tokens < st.spec_num_draft_tokens); // rejections happened too
    if (prefix_caching) ASSERT_TRUE(st.prefix_cache_hits > 0);
}

TEST(spec_stress_prefix_caching_k3) {
    spec_stress(0x1234567ull, true, 3, 3000);
}
TEST(spec_stress_prefix_caching_k5) {
    spec_stress(0xfeedbeefull, true, 5, 3000);
}
TEST(spec_stress_no_prefix_caching_k2) {
    spec_stress(0xabcdefull, false, 2, 3000);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
