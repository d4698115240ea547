// The engine loop (include/atomc.h over src/engine/engine*.c) driven by the TEST-ONLY fake model of
// tests/engine_fake.h: outputs equal the reference, batching / chunking / prefix caching do
// not change them, stop rules, streaming text with stop strings, logprobs plumbing,
// validation errors, abort in every state, the loop thread, stats, forward-pass failures.
#include <pthread.h>
#include <stdlib.h>

#include "engine_fake.h"
#include "test.h"

#define VOCAB 53

struct collect {
    int32_t toks[4096];
    int n;
    char text[8192];
    size_t text_len;
    int n_outputs, n_final;
    atomc_finish_reason reason;
    int32_t stop_token;
    char stop_str[64];
    int prompt_tokens, completion_tokens, cached_tokens;
    int n_logprobs_seen, top_ok;
    int n_prompt_lp;
    float prompt_lp0;
    double t_arrival, t_first_token, t_finish, t_sched;
    char error[256];
};

static void on_out(void *user, const atomc_output *o) {
    struct collect *c = user;
    c->n_outputs++;
    for (int i = 0; i < o->n_new_tokens; i++) c->toks[c->n++] = o->new_tokens[i];
    memcpy(c->text + c->text_len, o->text, o->text_len);
    c->text_len += o->text_len;
    c->text[c->text_len] = '\0';
    if (o->logprobs) {
        c->n_logprobs_seen += o->n_new_tokens;
        if (o->logprobs[0].token == o->new_tokens[0] && (o->logprobs[0].n_top == 0 || o->logprobs[0].top[0].token == o->new_tokens[0]))
            c->top_ok++;
    }
    if (o->prompt_logprobs) {
        c->n_prompt_lp = o->n_prompt_logprobs;
        c->prompt_lp0 = o->prompt_logprobs[0].logprob;
    }
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        c->n_final++;
        c->reason = o->finish_reason;
        c->stop_token = o->stop_token;
        snprintf(c->stop_str, sizeof c->stop_str, "%s", o->stop_str ? o->stop_str : "");
        c->prompt_tokens = o->prompt_tokens;
        c->completion_tokens = o->completion_tokens;
        c->cached_tokens = o->cached_tokens;
        c->t_arrival = o->arrival_time;
        c->t_first_token = o->first_token_time;
        c->t_finish = o->finish_time;
        c->t_sched = o->first_scheduled_time;
        snprintf(c->error, sizeof c->error, "%s", o->error ? o->error : "");
    }
}

static atomc_engine *make_engine(int num_blocks, int max_seqs, int budget, bool cache, struct fake_model **m) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.max_num_seqs = max_seqs;
    o.max_num_batched_tokens = budget;
    o.enable_prefix_caching = cache;
    atomc_engine *e = NULL;
    struct error err;
    struct fake_model *mm;
    CHECK_MSG(fake_engine_create(&o, VOCAB, num_blocks, 256, true, &e, m ? m : &mm, &err) == ATOMC_OK, "%s",
              err.msg);
    return e;
}

static void prompt_of(int32_t *p, int n, int seed) {
    for (int i = 0; i < n; i++) p[i] = 1 + (int32_t)((seed * 7 + i * 13 + (i * i) % 5) % (VOCAB - 1));
}

// Greedy reference: continuation of p until EOS or max tokens.
static int reference(const int32_t *p, int n, int max_tokens, int32_t *out, bool ignore_eos) {
    int32_t ctx[1024];
    memcpy(ctx, p, (size_t)n * sizeof *p);
    int k = 0;
    while (k < max_tokens) {
        int32_t t = fake_reference_next(ctx, n + k, VOCAB);
        ctx[n + k] = t;
        out[k++] = t;
        if (t == FAKE_EOS && !ignore_eos) break;
    }
    return k;
}

static atomc_status add(atomc_engine *e, const int32_t *p, int n, int max_tokens, struct collect *c, uint64_t *id) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = p;
    r.n_prompt_ids = n;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.on_output = on_out;
    r.user = c;
    char err[512];
    return atomc_engine_add_request(e, &r, id, err, sizeof err);
}

static void run_all(atomc_engine *e) {
    while (atomc_engine_has_work(e)) atomc_engine_step(e);
}

static bool all_free(atomc_engine *e) {
    struct block_manager *bm = engine_block_manager(e);
    struct error err = {0};
    bool ok = block_manager_check(bm, &err);
    if (!ok) fprintf(stderr, "  %s\n", err.msg);
    for (int i = 0; i < bm->num_blocks; i++)
        if (bm->blocks[i].ref_count != 0) return false;
    return ok;
}

TEST(engine_greedy_matches_reference_single_and_batched) {
    struct fake_model *m;
    atomc_engine *e = make_engine(64, 8, 16, true, &m);
    enum { N = 6 };
    static struct collect c[N];
    int32_t p[N][40];
    int len[N] = {3, 17, 40, 8, 1, 25};
    memset(c, 0, sizeof c);
    for (int i = 0; i < N; i++) {
        prompt_of(p[i], len[i], i);
        ASSERT_OK(add(e, p[i], len[i], 20, &c[i], NULL));
    }
    run_all(e);
    for (int i = 0; i < N; i++) {
        int32_t ref[64];
        int n = reference(p[i], len[i], 20, ref, false);
        ASSERT_EQ(c[i].n_final, 1);
        ASSERT_EQ(c[i].n, n);
        for (int k = 0; k < n; k++) ASSERT_EQ(c[i].toks[k], ref[k]);
        ASSERT_EQ(c[i].reason, ref[n - 1] == FAKE_EOS ? ATOMC_FINISH_STOP : ATOMC_FINISH_LENGTH);
        ASSERT_EQ(c[i].prompt_tokens, len[i]);
        ASSERT_EQ(c[i].completion_tokens, n);
        ASSERT_TRUE(c[i].t_arrival > 0 && c[i].t_sched >= c[i].t_arrival && c[i].t_first_token >= c[i].t_sched &&
                    c[i].t_finish >= c[i].t_first_token);
    }
    ASSERT_EQ(m->violations, 0);
    ASSERT_TRUE(m->max_batch_tokens <= 16);
    ASSERT_TRUE(m->max_batch_seqs > 1);
    ASSERT_TRUE(all_free(e));
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_running + st.num_waiting, 0);
    ASSERT_EQ(st.num_requests_finished, N);
    ASSERT_EQ(st.prompt_tokens_total, 3 + 17 + 40 + 8 + 1 + 25);
    atomc_engine_free(e);
}

TEST(engine_prefix_cache_hit_gives_identical_output) {
    struct fake_model *m;
    atomc_engine *e = make_engine(64, 8, 64, true, &m);
    int32_t p[30];
    prompt_of(p, 30, 3);
    struct collect a = {0}, b = {0};
    ASSERT_OK(add(e, p, 30, 12, &a, NULL));
    run_all(e);
    uint64_t before = m->executed_tokens;
    ASSERT_OK(add(e, p, 30, 12, &b, NULL));
    run_all(e);
    ASSERT_EQ(a.cached_tokens, 0);
    ASSERT_EQ(b.cached_tokens, 28); // 7 full blocks of 4, the last prompt token recomputed
    ASSERT_EQ(a.n, b.n);
    for (int k = 0; k < a.n; k++) ASSERT_EQ(a.toks[k], b.toks[k]);
    ASSERT_EQ(m->executed_tokens - before, 2 + (uint64_t)b.n - 1); // 2 prompt tokens + decodes
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.prefix_cache_queries, 60);
    ASSERT_EQ(st.prefix_cache_hits, 28);
    ASSERT_EQ(m->violations, 0);
    ASSERT_TRUE(all_free(e));
    atomc_engine_free(e);
}

TEST(engine_same_step_requests_share_the_prefix) {
    struct fake_model *m;
    atomc_engine *e = make_engine(64, 8, 128, true, &m);
    int32_t p[30];
    prompt_of(p, 30, 11);
    struct collect a = {0}, b = {0};
    ASSERT_OK(add(e, p, 30, 6, &a, NULL));
    ASSERT_OK(add(e, p, 30, 6, &b, NULL)); // same prompt, same step (like n > 1)
    atomc_engine_step(e);
    ASSERT_EQ(m->executed_tokens, 30 + 2); // b computed only what a's full blocks do not cover
    run_all(e);
    ASSERT_EQ(b.cached_tokens, 28);
    ASSERT_EQ(a.n, b.n);
    for (int k = 0; k < a.n; k++) ASSERT_EQ(a.toks[k], b.toks[k]);
    ASSERT_EQ(m->violations, 0);
    ASSERT_TRUE(all_free(e));
    // A failed step drops what it registered: a later identical prompt runs cold.
    struct collect c = {0}, d = {0};
    int32_t q[21];
    prompt_of(q, 21, 12);
    ASSERT_OK(add(e, q, 21, 3, &c, NULL));
    m->fail_next = 1;
    atomc_engine_step(e);
    ASSERT_EQ(c.reason, ATOMC_FINISH_ERROR);
    ASSERT_OK(add(e, q, 21, 3, &d, NULL));
    run_all(e);
    ASSERT_EQ(d.cached_tokens, 0);
    ASSERT_EQ(m->violations, 0);
    atomc_engine_free(e);
}

TEST(engine_stop_rules) {
    atomc_engine *e = make_engine(64, 8, 64, true, NULL);
    int32_t p[10];
    // Find a prompt whose greedy continuation hits EOS within 40 tokens.
    int32_t ref[64];
    int n = 0, seed = 0;
    for (seed = 0; seed < 500; seed++) {
        prompt_of(p, 10, seed);
        n = reference(p, 10, 40, ref, false);
        if (ref[n - 1] == FAKE_EOS && n >= 4) break;
    }
    ASSERT_TRUE(seed < 500);
    struct collect c;
    // EOS stops, counted, no text for it.
    memset(&c, 0, sizeof c);
    ASSERT_OK(add(e, p, 10, 40, &c, NULL));
    run_all(e);
    ASSERT_EQ(c.reason, ATOMC_FINISH_STOP);
    ASSERT_EQ(c.stop_token, FAKE_EOS);
    ASSERT_EQ(c.n, n);
    // ignore_eos: runs to max_tokens, through the EOS.
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = p;
    r.n_prompt_ids = 10;
    r.params.temperature = 0;
    r.params.max_tokens = n + 3;
    r.params.ignore_eos = true;
    r.on_output = on_out;
    memset(&c, 0, sizeof c);
    r.user = &c;
    ASSERT_OK(atomc_engine_add_request(e, &r, NULL, NULL, 0));
    run_all(e);
    ASSERT_EQ(c.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(c.n, n + 3);
    ASSERT_EQ(c.toks[n - 1], FAKE_EOS);
    // min_tokens: EOS is banned (sampler) and does not stop before it.
    r.params.ignore_eos = false;
    r.params.min_tokens = n + 1;
    r.params.max_tokens = n + 1;
    memset(&c, 0, sizeof c);
    ASSERT_OK(atomc_engine_add_request(e, &r, NULL, NULL, 0));
    run_all(e);
    ASSERT_EQ(c.n, n + 1);
    ASSERT_EQ(c.reason, ATOMC_FINISH_LENGTH);
    for (int k = 0; k < c.n; k++) ASSERT_NE(c.toks[k], FAKE_EOS);
    // stop_token_ids: stops on the third generated token.
    int32_t stop_id = ref[2];
    bool earlier = ref[0] == stop_id || ref[1] == stop_id;
    r.params.min_tokens = 0;
    r.params.max_tokens = 40;
    r.params.stop_token_ids = &stop_id;
    r.params.n_stop_token_ids = 1;
    memset(&c, 0, sizeof c);
    ASSERT_OK(atomc_engine_add_request(e, &r, NULL, NULL, 0));
    run_all(e);
    ASSERT_EQ(c.reason, ATOMC_FINISH_STOP);
    ASSERT_EQ(c.stop_token, stop_id);
    if (!earlier) ASSERT_EQ(c.n, 3);
    ASSERT_TRUE(all_free(e));
    atomc_engine_free(e);
}

static void gen_text(atomc_engine *e, const char *prompt, int max_tokens, const char *const *stops, int n_stops,
                     bool include, struct collect *c) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.stop = stops;
    r.params.n_stop = n_stops;
    r.params.include_stop_str_in_output = include;
    r.params.ignore_eos = true;
    r.on_output = on_out;
    memset(c, 0, sizeof *c);
    r.user = c;
    char err[256];
    CHECK_MSG(atomc_engine_add_request(e, &r, NULL, err, sizeof err) == ATOMC_OK, "%s", err);
    run_all(e);
}

// Streams and records each delta, to check that held-back text is never a part of the stop string.
struct stream_log {
    char deltas[64][64];
    int n;
};

TEST(engine_stop_strings_across_tokens) {
    atomc_engine *e = make_engine(64, 8, 64, true, NULL);
    struct collect full, c;
    gen_text(e, "hello", 30, NULL, 0, false, &full);
    ASSERT_EQ(full.reason, ATOMC_FINISH_LENGTH);
    ASSERT_TRUE(full.text_len >= 12);
    // A stop string spanning several tokens in the middle of the text.
    char stop[8];
    memcpy(stop, full.text + 5, 4);
    stop[4] = '\0';
    const char *first = strstr(full.text, stop);
    size_t at = (size_t)(first - full.text);
    const char *stops[2] = {"zzzzzzzz", stop};
    gen_text(e, "hello", 30, stops, 2, false, &c);
    ASSERT_EQ(c.reason, ATOMC_FINISH_STOP);
    ASSERT_STREQ(c.stop_str, stop);
    ASSERT_EQ(c.text_len, at);
    ASSERT_TRUE(!strncmp(c.text, full.text, at));
    ASSERT_TRUE(c.n < full.n);
    // Included in the output when asked.
    gen_text(e, "hello", 30, stops, 2, true, &c);
    ASSERT_EQ(c.text_len, at + 4);
    ASSERT_TRUE(!strncmp(c.text, full.text, at + 4));
    // A stop string that never occurs: the held-back tail is released at the end.
    const char *never[1] = {"qqqqqqqqqqqqqqq"};
    gen_text(e, "hello", 30, never, 1, false, &c);
    ASSERT_STREQ(c.text, full.text);
    ASSERT_EQ(c.reason, ATOMC_FINISH_LENGTH);
    ASSERT_TRUE(all_free(e));
    atomc_engine_free(e);
}

TEST(engine_logprobs_and_prompt_logprobs) {
    struct fake_model *m;
    atomc_engine *e = make_engine(64, 8, 8, true, &m);
    int32_t p[20];
    prompt_of(p, 20, 5);
    struct collect c = {0};
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = p;
    r.n_prompt_ids = 20;
    r.params.temperature = 0;
    r.params.max_tokens = 5;
    r.params.ignore_eos = true;
    r.params.logprobs = 3;
    r.params.prompt_logprobs = 2;
    r.on_output = on_out;
    r.user = &c;
    ASSERT_OK(atomc_engine_add_request(e, &r, NULL, NULL, 0));
    run_all(e); // prompt spans 3 chunks (budget 8): prompt logprobs gathered across them
    ASSERT_EQ(c.n, 5);
    ASSERT_EQ(c.n_logprobs_seen, 5);
    ASSERT_EQ(c.top_ok, 5);
    ASSERT_EQ(c.n_prompt_lp, 19);
    ASSERT_EQ(c.cached_tokens, 0);
    bool predicted = fake_reference_next(p, 1, VOCAB) == p[1];
    ASSERT_NEAR(c.prompt_lp0, predicted ? -0.25 : -4.0, 1e-6);
    ASSERT_EQ(m->violations, 0);
    atomc_engine_free(e);
}

TEST(engine_rejects_bad_requests) {
    atomc_engine *e = make_engine(64, 8, 64, true, NULL);
    atomc_request r;
    atomc_request_init(&r);
    char err[512];
    int32_t big[300];
    prompt_of(big, 300, 1);
    r.prompt_ids = big;
    r.n_prompt_ids = 300;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_TOO_LONG);
    ASSERT_TRUE(strstr(err, "maximum context length is 256 tokens. However, you requested 300 tokens") != NULL);
    r.n_prompt_ids = 0;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    int32_t bad[2] = {3, VOCAB};
    r.prompt_ids = bad;
    r.n_prompt_ids = 2;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err, "out of vocabulary") != NULL);
    bad[1] = 4;
    r.params.temperature = -1;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err, "temperature") != NULL);
    atomc_sampling_params_init(&r.params);
    r.params.top_p = 0;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    atomc_sampling_params_init(&r.params);
    r.params.max_tokens = 0;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    atomc_sampling_params_init(&r.params);
    r.params.min_tokens = 20;
    r.params.max_tokens = 10;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    atomc_sampling_params_init(&r.params);
    r.params.logprobs = 21;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    atomc_sampling_params_init(&r.params);
    const char *empty[1] = {""};
    r.params.stop = empty;
    r.params.n_stop = 1;
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    atomc_sampling_params_init(&r.params);
    r.prompt_ids = NULL;
    r.prompt = "ABC"; // the fake tokenizer knows only a-z
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(atomc_engine_abort(e, 12345), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(!atomc_engine_has_work(e));
    atomc_engine_free(e);
}

// The automatic scheduler limits (vLLM's defaults where they overlap): CPU 16 / 2048, CUDA 256 /
// 8192 for serving and 16384 offline; explicit values win; the token budget is raised to
// max_num_seqs only when it was left automatic.
TEST(engine_resolve_limits_defaults) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    int seqs = 0, tokens = 0;
    engine_resolve_limits(&o, &seqs, &tokens); // device NULL: the CPU
    ASSERT_EQ(seqs, 16);
    ASSERT_EQ(tokens, 2048);
    o.offline = true;
    engine_resolve_limits(&o, &seqs, &tokens);
    ASSERT_EQ(tokens, 2048); // the offline chunk is a CUDA default only
    o.device = "cuda";
    o.offline = false;
    engine_resolve_limits(&o, &seqs, &tokens);
    ASSERT_EQ(seqs, 256);
    ASSERT_EQ(tokens, 8192);
    o.offline = true;
    engine_resolve_limits(&o, &seqs, &tokens);
    ASSERT_EQ(tokens, 16384);
    o.max_num_batched_tokens = 4096;
    engine_resolve_limits(&o, &seqs, &tokens);
    ASSERT_EQ(tokens, 4096);
    o.max_num_batched_tokens = 0;
    o.max_num_seqs = 20000;
    engine_resolve_limits(&o, &seqs, &tokens);
    ASSERT_EQ(seqs, 20000);
    ASSERT_EQ(tokens, 20000);
}

// max_waiting counts the requests beyond the free running slots (issue 28 item 7: with 16 slots
// and max_waiting 8, 100 simultaneous requests must admit 24, not 8).
TEST(engine_max_waiting_gives_busy) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.max_num_seqs = 16;
    o.max_waiting = 8;
    atomc_engine *e0;
    struct fake_model *m0;
    struct error er;
    ASSERT_OK(fake_engine_create(&o, VOCAB, 256, 256, false, &e0, &m0, &er));
    int32_t p[4] = {1, 2, 3, 4};
    static struct collect many[100];
    memset(many, 0, sizeof many);
    int admitted = 0;
    for (int i = 0; i < 100; i++) admitted += add(e0, p, 4, 2, &many[i], NULL) == ATOMC_OK;
    ASSERT_EQ(admitted, 24);
    run_all(e0);
    atomc_engine_free(e0);

    o.max_num_seqs = 2;
    o.max_waiting = 1;
    atomc_engine *e;
    struct fake_model *m;
    ASSERT_OK(fake_engine_create(&o, VOCAB, 64, 256, false, &e, &m, &er));
    struct collect c[3];
    memset(c, 0, sizeof c);
    ASSERT_OK(add(e, p, 4, 2, &c[0], NULL));
    ASSERT_OK(add(e, p, 4, 2, &c[1], NULL));
    struct collect extra = {0};
    ASSERT_OK(add(e, p, 4, 2, &extra, NULL)); // two slots + one waiting
    ASSERT_EQ(add(e, p, 4, 2, &c[2], NULL), ATOMC_ERR_BUSY);
    run_all(e);
    ASSERT_OK(add(e, p, 4, 2, &c[2], NULL));
    run_all(e);
    ASSERT_EQ(c[2].n_final, 1);
    atomc_engine_free(e);
}

TEST(engine_abort_in_every_state) {
    struct fake_model *m;
    atomc_engine *e = make_engine(64, 8, 8, true, &m);
    int32_t p[40];
    prompt_of(p, 40, 9);
    struct collect waiting = {0}, prefill = {0}, decoding = {0}, other = {0};
    uint64_t id_dec, id_pre, id_wait, id_other;
    ASSERT_OK(add(e, p, 3, 100, &decoding, &id_dec));
    atomc_engine_step(e);
    ASSERT_OK(add(e, p, 40, 100, &prefill, &id_pre)); // 40-token prompt, budget 8: several steps
    atomc_engine_step(e);
    atomc_engine_step(e);
    ASSERT_EQ(prefill.n, 0);
    ASSERT_TRUE(decoding.n >= 2);
    // Abort a request that has not been scheduled at all (still in the inbox).
    ASSERT_OK(add(e, p, 5, 100, &waiting, &id_wait));
    ASSERT_OK(atomc_engine_abort(e, id_wait));
    ASSERT_OK(atomc_engine_abort(e, id_pre));
    ASSERT_OK(atomc_engine_abort(e, id_dec));
    ASSERT_OK(add(e, p, 6, 3, &other, &id_other));
    run_all(e);
    ASSERT_EQ(waiting.reason, ATOMC_FINISH_ABORT);
    ASSERT_EQ(waiting.n, 0);
    ASSERT_EQ(prefill.reason, ATOMC_FINISH_ABORT);
    ASSERT_EQ(decoding.reason, ATOMC_FINISH_ABORT);
    ASSERT_EQ(waiting.n_final + prefill.n_final + decoding.n_final, 3);
    ASSERT_EQ(other.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(atomc_engine_abort(e, id_dec), ATOMC_ERR_NOT_FOUND); // gone once finished
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_requests_aborted, 3);
    ASSERT_EQ(m->violations, 0);
    ASSERT_TRUE(all_free(e));
    atomc_engine_free(e);
}

TEST(engine_forward_failure_fails_batch_and_recovers) {
    struct fake_model *m;
    atomc_engine *e = make_engine(64, 8, 64, true, &m);
    int32_t p[9];
    prompt_of(p, 9, 2);
    struct collect a = {0}, b = {0};
    ASSERT_OK(add(e, p, 9, 4, &a, NULL));
    m->fail_next = 1;
    run_all(e);
    ASSERT_EQ(a.reason, ATOMC_FINISH_ERROR);
    ASSERT_TRUE(strstr(a.error, "fake device error") != NULL);
    ASSERT_TRUE(all_free(e));
    // Nothing from the failed step entered the prefix cache.
    ASSERT_OK(add(e, p, 9, 4, &b, NULL));
    run_all(e);
    ASSERT_EQ(b.cached_tokens, 0);
    ASSERT_EQ(b.reason == ATOMC_FINISH_LENGTH || b.reason == ATOMC_FINISH_STOP, 1);
    ASSERT_EQ(m->violations, 0);
    atomc_engine_free(e);
}

TEST(engine_seeded_sampling_is_reproducible) {
    atomc_engine *e = make_engine(64, 8, 64, false, NULL);
    int32_t p[6] = {5, 6, 7, 8, 9, 10};
    struct collect c[3];
    memset(c, 0, sizeof c);
    for (int i = 0; i < 3; i++) {
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = p;
        r.n_prompt_ids = 6;
        r.params.temperature = 0.8f;
        r.params.max_tokens = 12;
        r.params.ignore_eos = true;
        r.params.has_seed = i < 2;
        r.params.seed = 42;
        r.on_output = on_out;
        r.user = &c[i];
        ASSERT_OK(atomc_engine_add_request(e, &r, NULL, NULL, 0));
    }
    run_all(e);
    ASSERT_EQ(memcmp(c[0].toks, c[1].toks, 12 * sizeof(int32_t)), 0);
    ASSERT_NE(memcmp(c[0].toks, c[2].toks, 12 * sizeof(int32_t)), 0);
    atomc_engine_free(e);
}

// --- threads -------------------------------------------------------------------------------------

struct producer {
    atomc_engine *e;
    int base;
    struct collect c[8];
    int32_t p[8][16];
    uint64_t ids[8];
};

static void *produce(void *arg) {
    struct producer *pr = arg;
    for (int i = 0; i < 8; i++) {
        prompt_of(pr->p[i], 16, pr->base + i);
        CHECK(add(pr->e, pr->p[i], 16, 10, &pr->c[i], &pr->ids[i]) == ATOMC_OK);
    }
    return NULL;
}

static bool all_final(struct producer *pr, int n) {
    for (int t = 0; t < n; t++)
        for (int i = 0; i < 8; i++)
            if (__atomic_load_n(&pr[t].c[i].n_final, __ATOMIC_ACQUIRE) == 0) return false;
    return true;
}

TEST(engine_loop_thread_serves_many_producers) {
    struct fake_model *m;
    atomc_engine *e = make_engine(128, 8, 32, true, &m);
    ASSERT_OK(atomc_engine_start(e));
    static struct producer pr[3];
    memset(pr, 0, sizeof pr);
    pthread_t th[3];
    for (int t = 0; t < 3; t++) {
        pr[t].e = e;
        pr[t].base = 100 * t;
        pthread_create(&th[t], NULL, produce, &pr[t]);
    }
    for (int t = 0; t < 3; t++) pthread_join(th[t], NULL);
    // Blocking generate from this thread while the loop runs.
    int32_t q[7] = {1, 2, 3, 4, 5, 6, 7};
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = q;
    r.n_prompt_ids = 7;
    r.params.temperature = 0;
    r.params.max_tokens = 9;
    atomc_result res;
    char err[256];
    ASSERT_OK(atomc_engine_generate(e, &r, 1, &res, err, sizeof err));
    int32_t ref[16];
    int n = reference(q, 7, 9, ref, false);
    ASSERT_EQ(res.n_tokens, n);
    for (int k = 0; k < n; k++) ASSERT_EQ(res.tokens[k], ref[k]);
    ASSERT_TRUE(res.text != NULL);
    atomc_result_free(&res);
    for (int spin = 0; spin < 20000 && !all_final(pr, 3); spin++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    ASSERT_TRUE(all_final(pr, 3));
    atomc_engine_stop(e);
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 8; i++) {
            int n2 = reference(pr[t].p[i], 16, 10, ref, false);
            ASSERT_EQ(pr[t].c[i].n, n2);
            for (int k = 0; k < n2; k++) ASSERT_EQ(pr[t].c[i].toks[k], ref[k]);
        }
    ASSERT_EQ(m->violations, 0);
    ASSERT_TRUE(all_free(e));
    atomc_engine_free(e);
}

TEST(engine_free_aborts_pending_requests) {
    atomc_engine *e = make_engine(64, 8, 64, true, NULL);
    int32_t p[5] = {1, 2, 3, 4, 5};
    struct collect a = {0}, b = {0};
    ASSERT_OK(add(e, p, 5, 50, &a, NULL));
    atomc_engine_step(e);
    ASSERT_OK(add(e, p, 5, 50, &b, NULL));
    atomc_engine_free(e);
    ASSERT_EQ(a.reason, ATOMC_FINISH_ABORT);
    ASSERT_EQ(b.reason, ATOMC_FINISH_ABORT);
    ASSERT_EQ(a.n_final + b.n_final, 2);
}

TEST(engine_generate_batch_synchronously) {
    atomc_engine *e = make_engine(64, 4, 16, true, NULL);
    atomc_request r[5];
    int32_t p[5][12];
    for (int i = 0; i < 5; i++) {
        prompt_of(p[i], 12, 40 + i);
        atomc_request_init(&r[i]);
        r[i].prompt_ids = p[i];
        r[i].n_prompt_ids = 12;
        r[i].params.temperature = 0;
        r[i].params.max_tokens = 6;
    }
    atomc_result res[5];
    char err[256];
    ASSERT_OK(atomc_engine_generate(e, r, 5, res, err, sizeof err));
    for (int i = 0; i < 5; i++) {
        int32_t ref[8];
        int n = reference(p[i], 12, 6, ref, false);
        ASSERT_EQ(res[i].n_tokens, n);
        for (int k = 0; k < n; k++) ASSERT_EQ(res[i].tokens[k], ref[k]);
        atomc_result_free(&res[i]);
    }
    // One bad request: nothing runs, the error names it.
    r[3].params.top_p = 2;
    ASSERT_EQ(atomc_engine_generate(e, r, 5, res, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err, "request 3") != NULL);
    ASSERT_TRUE(all_free(e));
    atomc_engine_free(e);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
