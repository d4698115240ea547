// Structured output through the engine (src/engine/engine_grammar.c) with a REAL tokenizer
// (Llama-3's, ../shared/tokenizers) and the TEST-ONLY fake model, whose sampler honours
// sample_row.allowed like the real ones (the next allowed id after its hash pick): a batch of
// constrained and free requests at temperature 1 all finish with "stop" and text that is a
// document of their schema / a match of their regex; the grammar_start_token hook leaves the
// output free until that token; a bad schema is refused at add_request with its reason.
#include <jansson.h>
#include <regex.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine_fake.h"
#include "test.h"

struct collect {
    char text[8192];
    size_t len;
    int n_tokens;
    atomc_finish_reason reason;
    char error[256];
};

static void on_out(void *user, const atomc_output *o) {
    struct collect *c = user;
    c->n_tokens += o->n_new_tokens;
    if (c->len + o->text_len < sizeof c->text) {
        memcpy(c->text + c->len, o->text, o->text_len);
        c->len += o->text_len;
        c->text[c->len] = '\0';
    }
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        c->reason = o->finish_reason;
        snprintf(c->error, sizeof c->error, "%s", o->error ? o->error : "");
    }
}

struct ctx {
    atomc_engine *e;
    struct fake_model *m;
    struct tokenizer *tok; // owned by the engine
    int32_t prompt[4];
};

// grammar_threads / max_num_seqs: 0 = the defaults.
static bool setup_with(struct ctx *c, const char *tokenizer, int grammar_threads, int max_num_seqs) {
    const char *path = test_shared_path(tokenizer);
    if (!path) return false;
    struct error err = {0};
    CHECK_MSG(tokenizer_load(path, &c->tok, &err) == ATOMC_OK, "%s", err.msg);
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 16;
    o.grammar_threads = grammar_threads;
    o.max_num_seqs = max_num_seqs;
    CHECK(fake_engine_create_tok(&o, tokenizer_vocab_size(c->tok), 256, 1024, true, c->tok, &c->e, &c->m, &err) ==
          ATOMC_OK);
    for (int i = 0; i < 4; i++)
        c->prompt[i] = 1000 + i;
    return true;
}

static bool setup(struct ctx *c) {
    return setup_with(c, "tokenizers/llama3", 0, 0);
}

static uint64_t add_n(struct ctx *c, atomc_grammar_kind kind, const char *grammar, uint64_t seed, int32_t start_token,
                      int max_tokens, struct collect *out) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = c->prompt;
    r.n_prompt_ids = 4;
    r.params.max_tokens = max_tokens;
    r.params.temperature = 1.0f;
    r.params.has_seed = true;
    r.params.seed = seed;
    r.params.grammar_kind = kind;
    r.params.grammar = grammar;
    r.params.grammar_start_token = start_token;
    r.on_output = on_out;
    memset(out, 0, sizeof *out);
    r.user = out;
    char err[512];
    uint64_t id = 0;
    CHECK_MSG(atomc_engine_add_request(c->e, &r, &id, err, sizeof err) == ATOMC_OK, "%s", err);
    return id;
}

static void add(struct ctx *c, atomc_grammar_kind kind, const char *grammar, uint64_t seed, int32_t start_token,
                struct collect *out) {
    add_n(c, kind, grammar, seed, start_token, 400, out);
}

static const char *SCHEMA =
    "{\"type\": \"object\", \"properties\": {"
    "\"city\": {\"type\": \"string\", \"maxLength\": 10},"
    "\"n\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 500},"
    "\"tags\": {\"type\": \"array\", \"items\": {\"enum\": [\"a\", \"b\", \"c\"]}, \"maxItems\": 4}},"
    "\"required\": [\"city\", \"n\", \"tags\"], \"additionalProperties\": false}";

static void check_doc(const char *text) {
    json_error_t je;
    json_t *d = json_loads(text, 0, &je);
    if (!d) {
        test_fail(__FILE__, __LINE__, "not JSON: '%s' (%s)", text, je.text);
        return;
    }
    json_t *n = json_object_get(d, "n");
    ASSERT_TRUE(json_object_size(d) == 3 && json_is_string(json_object_get(d, "city")));
    ASSERT_TRUE(json_is_integer(n) && json_integer_value(n) >= 1 && json_integer_value(n) <= 500);
    ASSERT_TRUE(json_array_size(json_object_get(d, "tags")) <= 4);
    json_decref(d);
}

TEST(engine_grammar_batch_of_constrained_and_free_requests) {
    struct ctx c;
    if (!setup(&c)) return;
    enum { N = 12 };
    struct collect *o = calloc(N, sizeof *o);
    for (int i = 0; i < N; i++) {
        if (i % 3 == 0)
            add(&c, ATOMC_GRAMMAR_JSON_SCHEMA, SCHEMA, 7 + i, -1, &o[i]);
        else if (i % 3 == 1)
            add(&c, ATOMC_GRAMMAR_REGEX, "[a-z]{1,8}@[a-z]{2,5}\\.(com|org)", 7 + i, -1, &o[i]);
        else
            add(&c, ATOMC_GRAMMAR_NONE, NULL, 7 + i, -1, &o[i]);
    }
    while (atomc_engine_has_work(c.e))
        atomc_engine_step(c.e);
    regex_t re;
    ASSERT_EQ(regcomp(&re, "^[a-z]{1,8}@[a-z]{2,5}\\.(com|org)$", REG_EXTENDED), 0);
    for (int i = 0; i < N; i++) {
        if (i % 3 == 2) {
            ASSERT_TRUE(o[i].reason == ATOMC_FINISH_LENGTH || o[i].reason == ATOMC_FINISH_STOP); // unconstrained
            continue;
        }
        if (o[i].reason != ATOMC_FINISH_STOP) {
            test_fail(__FILE__, __LINE__, "request %d: reason %d (%s), text '%s'", i, o[i].reason, o[i].error,
                      o[i].text);
            continue;
        }
        if (i % 3 == 0)
            check_doc(o[i].text);
        else if (regexec(&re, o[i].text, 0, NULL, 0))
            test_fail(__FILE__, __LINE__, "'%s' does not match", o[i].text);
    }
    regfree(&re);
    free(o);
    atomc_engine_free(c.e);
}

TEST(engine_grammar_starts_after_the_start_token) {
    struct ctx c;
    if (!setup(&c)) return;
    // Scripted "thinking" (unconstrained) up to and including the start token, then the grammar.
    int32_t *script = NULL;
    int n = 0;
    struct error err = {0};
    const char *think = "Let me think. Ok</think>";
    ASSERT_OK(tokenizer_encode(c.tok, think, strlen(think), false, &script, &n, &err));
    int32_t start = script[n - 1]; // ">"-ending piece closing the thinking
    c.m->script = script;
    c.m->n_script = n;
    c.m->script_from = 4;
    struct collect o;
    add(&c, ATOMC_GRAMMAR_CHOICE, "[\"yes\", \"no\"]", 3, start, &o);
    while (atomc_engine_has_work(c.e))
        atomc_engine_step(c.e);
    ASSERT_EQ(o.reason, ATOMC_FINISH_STOP);
    size_t tl = strlen(think);
    ASSERT_TRUE(o.len > tl && !strncmp(o.text, think, tl));
    ASSERT_TRUE(!strcmp(o.text + tl, "yes") || !strcmp(o.text + tl, "no"));
    atomc_engine_free(c.e);
    free(script);
}

TEST(engine_grammar_invalid_is_refused_at_add) {
    struct ctx c;
    if (!setup(&c)) return;
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = c.prompt;
    r.n_prompt_ids = 4;
    char err[512];
    r.params.grammar_kind = ATOMC_GRAMMAR_JSON_SCHEMA;
    r.params.grammar = "{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 1}";
    ASSERT_EQ(atomc_engine_add_request(c.e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err, "json schema") != NULL);
    r.params.grammar_kind = ATOMC_GRAMMAR_REGEX;
    r.params.grammar = "[z-a]";
    ASSERT_EQ(atomc_engine_add_request(c.e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err, "regex") != NULL);
    r.params.grammar = NULL;
    ASSERT_EQ(atomc_engine_add_request(c.e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    r.params.grammar_kind = (atomc_grammar_kind)99;
    ASSERT_EQ(atomc_engine_add_request(c.e, &r, NULL, err, sizeof err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(!atomc_engine_has_work(c.e));
    atomc_engine_free(c.e);
}

// --- masks filled by a pool of threads equal the one-thread fills ------------------------------

// Every logits row of every step as the sampler saw it: (seed, tokens generated, hash of the
// whole mask; 0 = no mask).
struct mask_rec {
    uint64_t seed, step, hash;
};
struct mask_log {
    struct mask_rec *rec;
    int n, cap, words;
};

static void log_masks(void *user, const struct forward_batch *fb) {
    struct mask_log *l = user;
    for (int r = 0; r < fb->n_logits; r++) {
        const struct sample_row *sr = &fb->sampling[r];
        uint64_t h = 0;
        if (sr->allowed) {
            h = 1469598103934665603ull;
            for (int w = 0; w < l->words; w++)
                h = fake_mix(h, sr->allowed[w]);
        }
        l->rec = grow(l->rec, &l->cap, l->n + 1, sizeof *l->rec);
        l->rec[l->n++] = (struct mask_rec){sr->seed, sr->step, h};
    }
}

static int rec_cmp(const void *a, const void *b) {
    const struct mask_rec *x = a, *y = b;
    if (x->seed != y->seed) return x->seed < y->seed ? -1 : 1;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    return 0;
}

// Varied grammars: record schemas, a nested array, regexes, a choice, EBNF, any JSON object.
static const char *SCHEMA2 =
    "{\"type\": \"object\", \"properties\": {"
    "\"items\": {\"type\": \"array\", \"items\": {\"type\": \"object\", \"properties\": {"
    "\"id\": {\"type\": \"integer\"}, \"price\": {\"type\": \"number\"}, \"ok\": {\"type\": \"boolean\"}},"
    "\"required\": [\"id\", \"price\", \"ok\"]}, \"maxItems\": 3},"
    "\"note\": {\"anyOf\": [{\"type\": \"string\", \"maxLength\": 16}, {\"type\": \"null\"}]}},"
    "\"required\": [\"items\", \"note\"]}";

static void add_varied(struct ctx *c, int i, uint64_t *id, struct collect *out) {
    static const atomc_grammar_kind kinds[] = {
        ATOMC_GRAMMAR_JSON_SCHEMA, ATOMC_GRAMMAR_REGEX,       ATOMC_GRAMMAR_JSON_SCHEMA, ATOMC_GRAMMAR_CHOICE,
        ATOMC_GRAMMAR_EBNF,        ATOMC_GRAMMAR_JSON_OBJECT, ATOMC_GRAMMAR_REGEX,       ATOMC_GRAMMAR_NONE};
    static const char *texts[] = {NULL,
                                  "[a-z]{1,8}@[a-z]{2,5}\\.(com|org)",
                                  NULL,
                                  "[\"red\", \"green\", \"blue\", \"a much longer answer than the others\"]",
                                  "root ::= \"(\" expr \")\"\nexpr ::= [0-9]+ ((\"+\" | \"*\") [0-9]+)*",
                                  NULL,
                                  "(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]( [a-z ]{0,20})?",
                                  NULL};
    int k = i % 8;
    const char *text = k == 0 ? SCHEMA : k == 2 ? SCHEMA2 : texts[k];
    *id = add_n(c, kinds[k], text, 1000 + (uint64_t)i, -1, 48 + (i * 37) % 96, out);
}

struct pool_run {
    struct mask_log log;
    struct collect *out;
    uint64_t by_workers, by_join;
    int n_workers;
};

// n requests of varied grammars at max_num_seqs 32; with aborts: from step 3, every third step
// aborts a running request and adds a new one (same schedule in every run: the steps depend on
// the outputs only, which must be equal).
static bool pool_run(int threads, int n, bool aborts, struct pool_run *pr) {
    struct ctx c;
    memset(pr, 0, sizeof *pr);
    if (!setup_with(&c, "tokenizers/llama3", threads, 32)) return false;
    pr->log.words = (tokenizer_vocab_size(c.tok) + 31) / 32;
    c.m->on_masks = log_masks;
    c.m->on_masks_user = &pr->log;
    int total = aborts ? 2 * n : n;
    pr->out = calloc((size_t)total, sizeof *pr->out);
    uint64_t *ids = calloc((size_t)total, sizeof *ids);
    for (int i = 0; i < n; i++)
        add_varied(&c, i, &ids[i], &pr->out[i]);
    int added = n;
    for (int step = 0; atomc_engine_has_work(c.e); step++) {
        if (aborts && step >= 3 && step % 3 == 0 && added < total) {
            int victim = (step * 7) % added;
            if (pr->out[victim].reason == ATOMC_FINISH_NONE) atomc_engine_abort(c.e, ids[victim]);
            add_varied(&c, added, &ids[added], &pr->out[added]);
            added++;
        }
        atomc_engine_step(c.e);
    }
    engine_grammar_fill_counts(c.e, &pr->by_workers, &pr->by_join, &pr->n_workers);
    atomc_engine_free(c.e);
    free(ids);
    qsort(pr->log.rec, (size_t)pr->log.n, sizeof *pr->log.rec, rec_cmp);
    return true;
}

static void pool_run_free(struct pool_run *pr) {
    free(pr->log.rec);
    free(pr->out);
}

static void expect_same_masks(const struct pool_run *a, const struct pool_run *b, int total) {
    ASSERT_EQ(a->log.n, b->log.n);
    int masked = 0, diff = 0;
    for (int i = 0; i < a->log.n && i < b->log.n; i++) {
        masked += a->log.rec[i].hash != 0;
        if (rec_cmp(&a->log.rec[i], &b->log.rec[i]) || a->log.rec[i].hash != b->log.rec[i].hash) {
            if (diff++ < 5)
                test_fail(__FILE__, __LINE__, "row (seed %llu, step %llu): mask %016llx with one thread, %016llx",
                          (unsigned long long)a->log.rec[i].seed, (unsigned long long)a->log.rec[i].step,
                          (unsigned long long)a->log.rec[i].hash, (unsigned long long)b->log.rec[i].hash);
        }
    }
    ASSERT_TRUE(masked > 500); // the comparison covered many masked rows
    for (int i = 0; i < total; i++) {
        ASSERT_EQ(a->out[i].reason, b->out[i].reason);
        ASSERT_EQ(a->out[i].n_tokens, b->out[i].n_tokens);
        ASSERT_TRUE(!strcmp(a->out[i].text, b->out[i].text));
    }
}

TEST(engine_grammar_pool_masks_equal_one_thread) {
    enum { N = 32 };
    struct pool_run one, four;
    if (!pool_run(1, N, false, &one)) return;
    ASSERT_TRUE(pool_run(4, N, false, &four));
    expect_same_masks(&one, &four, N);
    ASSERT_EQ(one.n_workers, 1);
    ASSERT_EQ(four.n_workers, 4);
    ASSERT_TRUE(four.by_workers > 0);
    ASSERT_EQ(one.by_workers + one.by_join, four.by_workers + four.by_join);
    // The constrained requests that ended made documents of their grammar (schema 0 checked).
    for (int i = 0; i < N; i += 8)
        if (four.out[i].reason == ATOMC_FINISH_STOP) check_doc(four.out[i].text);
    printf("  rows filled: 4 threads %llu by the pool, %llu by the join; 1 thread %llu / %llu\n",
           (unsigned long long)four.by_workers, (unsigned long long)four.by_join, (unsigned long long)one.by_workers,
           (unsigned long long)one.by_join);
    pool_run_free(&one);
    pool_run_free(&four);
}

TEST(engine_grammar_pool_with_aborts_equals_one_thread) {
    enum { N = 24 };
    struct pool_run one, many;
    if (!pool_run(1, N, true, &one)) return;
    ASSERT_TRUE(pool_run(7, N, true, &many));
    ASSERT_TRUE(many.n_workers > 1 && many.by_workers > 0);
    int aborted = 0;
    for (int i = 0; i < 2 * N; i++)
        aborted += many.out[i].reason == ATOMC_FINISH_ABORT;
    ASSERT_TRUE(aborted > 3);
    expect_same_masks(&one, &many, 2 * N);
    pool_run_free(&one);
    pool_run_free(&many);
}

TEST(engine_grammar_pool_size_option_and_auto) {
    // The option sizes the pool; 0 (auto) leaves the forward's threads their cores: with the fake
    // model (no CPU backend threads) online cores minus one, at least 1. A step of 8 constrained
    // rows starts min(8, pool) threads.
    struct pool_run autosz, opt;
    if (!pool_run(0, 8, false, &autosz)) return;
    ASSERT_TRUE(pool_run(3, 8, false, &opt));
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int want = cores - 1 < 1 ? 1 : (int)cores - 1;
    ASSERT_EQ(autosz.n_workers, want < 8 ? want : 8);
    ASSERT_EQ(opt.n_workers, 3);
    pool_run_free(&autosz);
    pool_run_free(&opt);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
