// Structured output's sample-then-check on the CPU (src/engine/engine_grammar.c top comment,
// forward_batch.sample_check, runner_sample.c's redraw): the real engine over a real model
// runner (the tiny random-weight Llama fixture, vocabulary 256) and a TEST-ONLY text seam whose
// 256 tokens are letters, digits and two-character strings, under the regex [a-m][a-z0-9]{3}
// (its first token: the 13 single letters a..m and the pairs starting with one, about a third
// of the vocabulary, so about half the unmasked first draws are rejected).
//
// - Distribution: N = 20000 seeded one-token requests at temperature 1.5. The exact masked
//   distribution of the first token, q(t) = softmax(logits / 1.5)(t) / S over the allowed set, comes
//   from the same model's logits (model_runner_execute_logits on a second runner) and the
//   allowed set from the tokens' strings, both here without engine code. Pearson's chi-square
//   goodness of fit (cells of expected count < 5 pooled) must stay below its alpha = 1e-4
//   critical value, with sample-then-check and with the masks filled before the draw (the
//   reference path); both paths must have run (rows checked, rows drawn again).
//   Power: against the unmasked distribution's draws kept only when allowed and otherwise
//   replaced by the masked arg-max (a plausible wrong redraw), the statistic is printed and must
//   exceed the critical value by far (measured: 4232 against a critical 36). A redraw with the
//   first draw's uniform instead of the second stream (tried by hand) gives 4498 against the
//   exact distribution (critical 48).
// - Greedy: for 24 prompts, 4-character outputs with and without the check are the same tokens.
// - Sampled outputs under the check match the regex and end with "stop"; a seed repeats.
#include <math.h>
#include <regex.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "engine/engine_internal.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

// tests/gpu/test_cuda_grammar_check.c builds this file with GRAMMAR_CHECK_DEVICE "cuda": the same
// checks through the CUDA runner and sampler (BF16 weights and KV there, F32 here).
#ifndef GRAMMAR_CHECK_DEVICE
#define GRAMMAR_CHECK_DEVICE "cpu"
#define GRAMMAR_CHECK_DTYPE "float32"
#else
#define GRAMMAR_CHECK_DTYPE "auto"
#endif

#define V 256
#define N_REQ 20000
#define REGEX "[a-m][a-z0-9]{3}"
#define TEMP 1.5f // the distribution test's: flatter than 1, so more cells have expected counts >= 5

static const char ALPHA[] = "abcdefghijklmnopqrstuvwxyz0123456789";

struct toy_vocab {
    char text[V][3];
    size_t len[V];
};

static void toy_vocab_init(struct toy_vocab *tv) {
    for (int i = 0; i < V; i++) {
        if (i < 3) { // 0 pad, 1 bos, 2 eos: special
            tv->len[i] = 0;
        } else if (i < 3 + 36) {
            tv->text[i][0] = ALPHA[i - 3];
            tv->len[i] = 1;
        } else {
            tv->text[i][0] = ALPHA[(i * 7) % 36];
            tv->text[i][1] = ALPHA[(i * 13 + 5) % 36];
            tv->len[i] = 2;
        }
        tv->text[i][tv->len[i]] = '\0';
    }
}

static const char *toy_token_bytes(void *ctx, int32_t id, size_t *len) {
    struct toy_vocab *tv = ctx;
    *len = tv->len[id];
    return tv->text[id];
}
static bool toy_is_special(void *ctx, int32_t id) {
    (void)ctx;
    return id < 3;
}
static atomc_status toy_encode(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids, int *n,
                               struct error *err) {
    (void)ctx, (void)text, (void)len, (void)add_special, (void)ids, (void)n;
    return error_set(err, ATOMC_ERR_UNSUPPORTED, "toy vocabulary: token ids only");
}
static atomc_status toy_decode(void *ctx, const int32_t *ids, int n, bool skip_special, char **out, struct error *err) {
    (void)err, (void)skip_special;
    struct toy_vocab *tv = ctx;
    char *s = xmalloc((size_t)n * 2 + 1);
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        memcpy(s + o, tv->text[ids[i]], tv->len[ids[i]]);
        o += tv->len[ids[i]];
    }
    s[o] = '\0';
    *out = s;
    return ATOMC_OK;
}
static void *toy_detok_new(void *ctx, bool skip_special) {
    (void)skip_special;
    return ctx;
}
static atomc_status toy_detok_step(void *state, const int32_t *ids, int n_ids, int n_new, bool final, char **out,
                                   size_t *out_len) {
    (void) final;
    atomc_status st = toy_decode(state, ids + n_ids - n_new, n_new, true, out, NULL);
    *out_len = strlen(*out);
    return st;
}
static void toy_detok_free(void *state) {
    (void)state;
}

static atomc_status runner_exec(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                                struct error *err) {
    return model_runner_execute(ctx, fb, out, err);
}
static void runner_free_ctx(void *ctx) {
    model_runner_free(ctx);
}

// Whether the backend opens (the CUDA build of this test skips without a device).
static bool toy_device_ready(void) {
    struct backend *b = NULL;
    struct error err = {0};
    struct backend_options bo = {.num_threads = 1, .kv_pool_bytes = 16u << 20};
    if (backend_create(GRAMMAR_CHECK_DEVICE, &bo, &b, &err) != ATOMC_OK) return false;
    backend_destroy(b);
    return true;
}

static struct model_runner *toy_runner(void) {
    const char *path = test_fixture("models/llama_tied");
    struct runner_options o = {
        .model_path = path,
        .device = GRAMMAR_CHECK_DEVICE,
        .dtype = GRAMMAR_CHECK_DTYPE,
        .load_format = "auto",
        .kv_cache_dtype = GRAMMAR_CHECK_DTYPE,
        .block_size = 16,
        .num_kv_blocks = 512,
        .max_num_seqs = 64,
        .max_num_batched_tokens = 512,
        .max_model_len = 128,
        .num_threads = 2,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    CHECK_MSG(model_runner_create(&o, &r, &err) == ATOMC_OK, "%s: %s", path, err.msg);
    CHECK(model_runner_config(r)->vocab_size == V);
    return r;
}

static atomc_engine *toy_engine(struct toy_vocab *tv) {
    struct model_runner *r = toy_runner();
    struct engine_setup su;
    memset(&su, 0, sizeof su);
    su.model = (struct engine_model_ops){.ctx = r, .execute = runner_exec, .free = runner_free_ctx};
    su.text = (struct engine_text_ops){.ctx = tv,
                                       .encode = toy_encode,
                                       .decode = toy_decode,
                                       .detok_new = toy_detok_new,
                                       .detok_step = toy_detok_step,
                                       .detok_free = toy_detok_free,
                                       .token_bytes = toy_token_bytes,
                                       .is_special = toy_is_special};
    su.num_kv_blocks = model_runner_num_kv_blocks(r);
    su.vocab_size = V;
    su.max_model_len = model_runner_max_model_len(r);
    su.eos_ids[0] = 2;
    su.n_eos = 1;
    su.sample_check = model_runner_sample_check_ok(r);
    CHECK(su.sample_check);
    su.info.architecture = "LlamaForCausalLM";
    su.info.model_name = "llama_tied";
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 16;
    o.max_num_seqs = 64;
    o.max_num_batched_tokens = 512;
    atomc_engine *e;
    struct error err = {0};
    CHECK_MSG(engine_create_with(&o, &su, &e, &err) == ATOMC_OK, "%s", err.msg);
    return e;
}

struct res {
    int32_t toks[16];
    int n;
    char text[64];
    size_t len;
    atomc_finish_reason reason;
};
static void on_out(void *user, const atomc_output *o) {
    struct res *r = user;
    for (int i = 0; i < o->n_new_tokens && r->n < 16; i++)
        r->toks[r->n++] = o->new_tokens[i];
    if (r->len + o->text_len < sizeof r->text) {
        memcpy(r->text + r->len, o->text, o->text_len);
        r->len += o->text_len;
        r->text[r->len] = '\0';
    }
    if (o->finish_reason != ATOMC_FINISH_NONE) r->reason = o->finish_reason;
}

static void add(atomc_engine *e, const int32_t *prompt, int n_prompt, float temp, uint64_t seed, int max_tokens,
                struct res *out) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = prompt;
    r.n_prompt_ids = n_prompt;
    r.params.max_tokens = max_tokens;
    r.params.temperature = temp;
    r.params.has_seed = true;
    r.params.seed = seed;
    r.params.grammar_kind = ATOMC_GRAMMAR_REGEX;
    r.params.grammar = REGEX;
    r.on_output = on_out;
    memset(out, 0, sizeof *out);
    r.user = out;
    char err[256];
    CHECK_MSG(atomc_engine_add_request(e, &r, NULL, err, sizeof err) == ATOMC_OK, "%s", err);
}

static void drain(atomc_engine *e) {
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
}

static const int32_t PROMPT[] = {1, 40, 77, 5, 130, 9};
#define N_PROMPT 6

// Whether token t may start the regex's match: its text is [a-m] or [a-m][a-z0-9].
static bool first_allowed(const struct toy_vocab *tv, int t) {
    if (tv->len[t] == 0) return false;
    char c = tv->text[t][0];
    return c >= 'a' && c <= 'm';
}

// The model's logits after PROMPT (a second runner: the engine owns its own).
static void prompt_logits(float *out) {
    struct model_runner *r = toy_runner();
    struct sim s;
    sim_init(&s, r, 7);
    struct sim_seq q;
    sim_seq_init(&q, PROMPT, N_PROMPT);
    sim_step_begin(&s);
    sim_step_add(&s, &q, N_PROMPT, 1);
    struct forward_batch fb = sim_step_batch(&s);
    struct error err = {0};
    CHECK_MSG(model_runner_execute_logits(r, &fb, out, &err) == ATOMC_OK, "%s", err.msg);
    sim_free(&s);
    model_runner_free(r);
}

// Pearson's chi-square of counts against probabilities q (cells of expected < 5 pooled); *df set.
static double chi_square(const int *counts, const double *q, int n, int *df) {
    double stat = 0, pool_e = 0, pool_o = 0;
    int cells = 0;
    for (int t = 0; t < V; t++) {
        if (q[t] <= 0) {
            CHECK_MSG(counts[t] == 0, "token %d has probability 0 and was drawn %d times", t, counts[t]);
            continue;
        }
        double ex = q[t] * n;
        if (ex < 5) {
            pool_e += ex;
            pool_o += counts[t];
            continue;
        }
        stat += (counts[t] - ex) * (counts[t] - ex) / ex;
        cells++;
    }
    if (pool_e > 0) {
        stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        cells++;
    }
    *df = cells - 1;
    return stat;
}

// Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4 (z = 3.719).
static double chi_square_critical(int df) {
    double k = df, z = 3.719, a = 2.0 / (9.0 * k);
    return k * pow(1.0 - a + z * sqrt(a), 3.0);
}

// First tokens of N_REQ seeded requests (seed = i + 1) at temperature 1.
static void first_tokens(bool check, int *counts, uint64_t *checked, uint64_t *redrawn) {
    struct toy_vocab *tv = xcalloc(1, sizeof *tv);
    toy_vocab_init(tv);
    atomc_engine *e = toy_engine(tv);
    engine_grammar_set_check(e, check);
    static struct res res[256];
    memset(counts, 0, V * sizeof *counts);
    for (int i = 0; i < N_REQ; i += 256) {
        int n = N_REQ - i < 256 ? N_REQ - i : 256;
        for (int j = 0; j < n; j++)
            add(e, PROMPT, N_PROMPT, TEMP, (uint64_t)(i + j) + 1, 1, &res[j]);
        drain(e);
        for (int j = 0; j < n; j++) {
            CHECK(res[j].n == 1);
            counts[res[j].toks[0]]++;
        }
    }
    engine_grammar_check_counts(e, checked, redrawn);
    atomc_engine_free(e);
    free(tv);
}

TEST(grammar_check_keeps_the_masked_distribution) {
    if (!toy_device_ready()) SKIP("no " GRAMMAR_CHECK_DEVICE " device");
    struct toy_vocab tv;
    toy_vocab_init(&tv);
    static float lg[V];
    prompt_logits(lg);
    double mx = -INFINITY, z = 0, q[V], p[V], S = 0;
    for (int t = 0; t < V; t++) {
        lg[t] /= TEMP;
        mx = lg[t] > mx ? lg[t] : mx;
    }
    for (int t = 0; t < V; t++)
        z += exp((double)lg[t] - mx);
    int n_allowed = 0;
    for (int t = 0; t < V; t++) {
        p[t] = exp((double)lg[t] - mx) / z;
        if (first_allowed(&tv, t)) {
            S += p[t];
            n_allowed++;
        }
    }
    for (int t = 0; t < V; t++)
        q[t] = first_allowed(&tv, t) ? p[t] / S : 0.0;
    printf("  %d of %d first tokens allowed, allowed mass S = %.3f\n", n_allowed, V, S);
    ASSERT_TRUE(S > 0.1 && S < 0.9); // both outcomes of the check are common

    static int counts[V];
    for (int mode = 1; mode >= 0; mode--) {
        uint64_t checked, redrawn;
        first_tokens(mode == 1, counts, &checked, &redrawn);
        int df;
        double stat = chi_square(counts, q, N_REQ, &df), crit = chi_square_critical(df);
        printf("  %s: chi-square %.1f (df %d, critical %.1f at 1e-4); %llu rows checked, %llu drawn again\n",
               mode ? "sample-then-check" : "masks before the draw", stat, df, crit, (unsigned long long)checked,
               (unsigned long long)redrawn);
        ASSERT_TRUE(stat < crit);
        if (mode == 1) {
            ASSERT_EQ(checked, (uint64_t)N_REQ);
            // About 1 - S of them drawn again (binomial; 6 sigma).
            double ex = (1.0 - S) * N_REQ, sd = sqrt(N_REQ * S * (1.0 - S));
            ASSERT_TRUE(fabs((double)redrawn - ex) < 6 * sd);
        } else {
            ASSERT_EQ(checked, (uint64_t)0);
        }
        // Power: the sample is far from a wrong redraw rule's distribution (a rejected draw
        // replaced by the masked arg-max): P(t) = p(t) + (1 - S) [t = argmax of the allowed].
        int best = -1;
        for (int t = 0; t < V; t++)
            if (q[t] > 0 && (best < 0 || lg[t] > lg[best])) best = t;
        double wrong[V];
        for (int t = 0; t < V; t++)
            wrong[t] = (q[t] > 0 ? p[t] : 0.0) + (t == best ? 1.0 - S : 0.0);
        int df2;
        double stat2 = chi_square(counts, wrong, N_REQ, &df2);
        printf("  against the wrong redraw rule: chi-square %.1f (critical %.1f)\n", stat2, chi_square_critical(df2));
        ASSERT_TRUE(stat2 > 10 * chi_square_critical(df2));
    }
}

TEST(grammar_check_greedy_equals_masked_greedy_and_outputs_match) {
    if (!toy_device_ready()) SKIP("no " GRAMMAR_CHECK_DEVICE " device");
    struct toy_vocab *tv = xcalloc(1, sizeof *tv);
    toy_vocab_init(tv);
    regex_t re;
    ASSERT_EQ(regcomp(&re, "^" REGEX "$", REG_EXTENDED | REG_NOSUB), 0);
    enum { NP = 24 };
    int32_t prompts[NP][5];
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < 5; j++)
            prompts[i][j] = 3 + (i * 37 + j * 101) % (V - 3);
    static struct res greedy[2][NP], sampled[3][NP];
    uint64_t redrawn_greedy = 0;
    for (int mode = 0; mode < 2; mode++) {
        atomc_engine *e = toy_engine(tv);
        engine_grammar_set_check(e, mode == 1);
        for (int i = 0; i < NP; i++)
            add(e, prompts[i], 5, 0.0f, 0, 10, &greedy[mode][i]);
        drain(e);
        if (mode == 1) {
            uint64_t c;
            engine_grammar_check_counts(e, &c, &redrawn_greedy);
            ASSERT_TRUE(c > 0);
            for (int k = 0; k < 2; k++) { // sampled, twice with the same seeds
                for (int i = 0; i < NP; i++)
                    add(e, prompts[i], 5, 1.0f, 500 + (uint64_t)i, 10, &sampled[k][i]);
                drain(e);
            }
        }
        atomc_engine_free(e);
    }
    ASSERT_TRUE(redrawn_greedy > 0); // the arg-max was disallowed somewhere
    for (int i = 0; i < NP; i++) {
        ASSERT_EQ(greedy[1][i].n, greedy[0][i].n);
        for (int k = 0; k < greedy[0][i].n; k++)
            ASSERT_EQ(greedy[1][i].toks[k], greedy[0][i].toks[k]);
        for (int m = 0; m < 2; m++) {
            ASSERT_EQ((int)greedy[m][i].reason, (int)ATOMC_FINISH_STOP);
            ASSERT_EQ(regexec(&re, greedy[m][i].text, 0, NULL, 0), 0);
        }
        for (int k = 0; k < 2; k++) {
            ASSERT_EQ((int)sampled[k][i].reason, (int)ATOMC_FINISH_STOP);
            ASSERT_EQ(regexec(&re, sampled[k][i].text, 0, NULL, 0), 0);
        }
        ASSERT_EQ(sampled[1][i].n, sampled[0][i].n);
        for (int k = 0; k < sampled[0][i].n; k++)
            ASSERT_EQ(sampled[1][i].toks[k], sampled[0][i].toks[k]);
    }
    regfree(&re);
    free(tv);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
