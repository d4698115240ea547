// The engine's text path with a REAL tokenizer (Llama-3's tokenizer.json from ../shared/
// tokenizers or $ATOMC_SHARED) and the TEST-ONLY scripted fake model: streamed deltas are
// whole UTF-8 characters and concatenate to tokenizer_decode of the ids; stop strings are
// found across token boundaries (also inside multi-byte characters' token splits) and cut
// from the text (or kept with include_stop_str_in_output); EOS text never appears.
// Skipped when the shared tokenizers are absent (failed under ATOMC_REQUIRE_FIXTURES=1).
#include <stdlib.h>

#include "engine_fake.h"
#include "test.h"

static const char *TEXT = "Hello, w\xc3\xb6rld! \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86"
                          "\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88 \xf0\x9f\x8e\x89\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd and "
                          "then STOP here, more text follows.";

struct collect {
    char text[4096];
    size_t len;
    int n_tokens, n_outputs;
    bool bad_utf8;
    atomc_finish_reason reason;
    char stop_str[64];
    int32_t stop_token;
};

static bool valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return false;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80) return false;
        i += k;
    }
    return true;
}

static void on_out(void *user, const atomc_output *o) {
    struct collect *c = user;
    c->n_outputs++;
    c->n_tokens += o->n_new_tokens;
    if (!valid_utf8((const unsigned char *)o->text, o->text_len)) c->bad_utf8 = true;
    memcpy(c->text + c->len, o->text, o->text_len);
    c->len += o->text_len;
    c->text[c->len] = '\0';
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        c->reason = o->finish_reason;
        snprintf(c->stop_str, sizeof c->stop_str, "%s", o->stop_str ? o->stop_str : "");
        c->stop_token = o->stop_token;
    }
}

struct ctx {
    atomc_engine *e;
    struct fake_model *m;
    struct tokenizer *tok; // owned by the engine
    int32_t *script;
    int n_script;
    int32_t prompt[4];
};

static bool setup(struct ctx *c) {
    const char *path = test_shared_path("tokenizers/llama3");
    if (!path) return false; // skipped (a failure under ATOMC_REQUIRE_FIXTURES=1)
    struct error err = {0};
    CHECK_MSG(tokenizer_load(path, &c->tok, &err) == ATOMC_OK, "%s", err.msg);
    CHECK(tokenizer_encode(c->tok, TEXT, strlen(TEXT), false, &c->script, &c->n_script, &err) == ATOMC_OK);
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 16;
    CHECK(fake_engine_create_tok(&o, tokenizer_vocab_size(c->tok), 64, 512, true, c->tok, &c->e, &c->m, &err) ==
          ATOMC_OK);
    for (int i = 0; i < 4; i++) c->prompt[i] = 1000 + i;
    c->m->script = c->script;
    c->m->n_script = c->n_script;
    c->m->script_from = 4;
    return true;
}

static void teardown(struct ctx *c) {
    atomc_engine_free(c->e);
    free(c->script);
}

static void run(struct ctx *c, const char *stop, bool include, int max_tokens, struct collect *out) {
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = c->prompt;
    r.n_prompt_ids = 4;
    r.params.max_tokens = max_tokens;
    r.params.temperature = 0;
    const char *stops[1] = {stop};
    if (stop) {
        r.params.stop = stops;
        r.params.n_stop = 1;
    }
    r.params.include_stop_str_in_output = include;
    r.on_output = on_out;
    memset(out, 0, sizeof *out);
    r.user = out;
    char err[256];
    CHECK_MSG(atomc_engine_add_request(c->e, &r, NULL, err, sizeof err) == ATOMC_OK, "%s", err);
    while (atomc_engine_has_work(c->e)) atomc_engine_step(c->e);
}

TEST(engine_text_stream_equals_decode) {
    struct ctx c;
    if (!setup(&c)) return;
    struct collect o;
    run(&c, NULL, false, c.n_script, &o);
    ASSERT_EQ(o.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(o.n_tokens, c.n_script);
    ASSERT_TRUE(!o.bad_utf8);
    char *ref = NULL;
    struct error err;
    ASSERT_OK(tokenizer_decode(c.tok, c.script, c.n_script, true, &ref, &err));
    ASSERT_STREQ(o.text, ref);
    ASSERT_STREQ(o.text, TEXT);
    free(ref);
    teardown(&c);
}

TEST(engine_text_stop_strings_real_tokenizer) {
    struct ctx c;
    if (!setup(&c)) return;
    const char *stops[] = {"STOP", "\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86", "\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd", "lo, w"};
    for (int i = 0; i < 4; i++) {
        const char *at = strstr(TEXT, stops[i]);
        ASSERT_TRUE(at != NULL);
        size_t cut = (size_t)(at - TEXT);
        struct collect o;
        run(&c, stops[i], false, c.n_script, &o);
        ASSERT_EQ(o.reason, ATOMC_FINISH_STOP);
        ASSERT_STREQ(o.stop_str, stops[i]);
        ASSERT_EQ(o.len, cut);
        ASSERT_TRUE(!strncmp(o.text, TEXT, cut));
        ASSERT_TRUE(!o.bad_utf8);
        ASSERT_TRUE(o.n_tokens < c.n_script);
        run(&c, stops[i], true, c.n_script, &o);
        ASSERT_EQ(o.len, cut + strlen(stops[i]));
        ASSERT_TRUE(!strncmp(o.text, TEXT, o.len));
    }
    teardown(&c);
}

TEST(engine_text_token_bytes) {
    struct ctx c;
    if (!setup(&c)) return;
    size_t len = 0, total = 0;
    char buf[1024];
    for (int i = 0; i < c.n_script; i++) {
        const char *b = atomc_engine_token_bytes(c.e, c.script[i], &len);
        ASSERT_TRUE(b != NULL);
        memcpy(buf + total, b, len);
        total += len;
    }
    buf[total] = '\0';
    ASSERT_STREQ(buf, TEXT); // the pieces' bytes concatenate to the text
    ASSERT_TRUE(atomc_engine_token_bytes(c.e, -1, &len) == NULL);
    teardown(&c);
}

TEST(engine_text_eos_has_no_text) {
    struct ctx c;
    if (!setup(&c)) return;
    int32_t eos = tokenizer_eos_id(c.tok);
    ASSERT_TRUE(eos >= 0);
    int32_t *s2 = xmalloc((size_t)(c.n_script + 1) * sizeof *s2);
    memcpy(s2, c.script, (size_t)c.n_script * sizeof *s2);
    s2[c.n_script] = eos;
    c.m->script = s2;
    c.m->n_script = c.n_script + 1;
    struct collect o;
    run(&c, NULL, false, 1000, &o);
    ASSERT_EQ(o.reason, ATOMC_FINISH_STOP);
    ASSERT_EQ(o.stop_token, eos);
    ASSERT_EQ(o.n_tokens, c.n_script + 1);
    ASSERT_STREQ(o.text, TEXT);
    teardown(&c);
    free(s2);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
