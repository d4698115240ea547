// Structured output through the engine (src/engine/engine_grammar.c) with a REAL tokenizer
// (Llama-3's, ../shared/tokenizers) and the TEST-ONLY fake model, whose sampler honours
// sample_row.allowed like the real ones (the next allowed id after its hash pick): a batch of
// constrained and free requests at temperature 1 all finish with "stop" and text that is a
// document of their schema / a match of their regex; the grammar_start_token hook leaves the
// output free until that token; a bad schema is refused at add_request with its reason.
#include <jansson.h>
#include <regex.h>
#include <stdlib.h>

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

static bool setup(struct ctx *c) {
    const char *path = test_shared_path("tokenizers/llama3");
    if (!path) return false;
    struct error err = {0};
    CHECK_MSG(tokenizer_load(path, &c->tok, &err) == ATOMC_OK, "%s", err.msg);
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 16;
    CHECK(fake_engine_create_tok(&o, tokenizer_vocab_size(c->tok), 256, 1024, true, c->tok, &c->e, &c->m, &err) ==
          ATOMC_OK);
    for (int i = 0; i < 4; i++)
        c->prompt[i] = 1000 + i;
    return true;
}

static void add(struct ctx *c, atomc_grammar_kind kind, const char *grammar, uint64_t seed, int32_t start_token,
                struct collect *out) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = c->prompt;
    r.n_prompt_ids = 4;
    r.params.max_tokens = 400;
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
    CHECK_MSG(atomc_engine_add_request(c->e, &r, NULL, err, sizeof err) == ATOMC_OK, "%s", err);
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

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
