// Tokenizer unit tests: incremental detokenization (property: concatenated deltas == full decode,
// every delta valid UTF-8), SentencePiece first-token behaviour, accessors, errors on bad input,
// concurrent use. Real tokenizers come from ../shared/tokenizers ($ATOMC_SHARED); fixtures from
// tests/fixtures/tokenizer. Conformance to HF lives in test_tokenizer_conformance.c.
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "tokenizer/tokenizer.h"

// A shared tokenizer, or NULL: absent = the test is skipped (a failure under
// ATOMC_REQUIRE_FIXTURES=1); present but not loadable = the test fails.
static struct tokenizer *load_shared(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizers/%s", name);
    const char *path = test_shared_path(rel);
    if (!path) return NULL;
    struct error err = {0};
    struct tokenizer *t = NULL;
    if (tokenizer_load(path, &t, &err)) test_fail(__FILE__, __LINE__, "load %s: %s", path, err.msg);
    return t;
}

// A committed fixture tokenizer, or NULL with the test failed (a missing fixture is never a skip).
static struct tokenizer *load_fixture(const char *rel) {
    struct error err = {0};
    struct tokenizer *t = NULL;
    if (tokenizer_load(test_fixture(rel), &t, &err)) test_fail(__FILE__, __LINE__, "load %s: %s", rel, err.msg);
    return t;
}

static uint64_t rng_next(uint64_t *s) {  // xorshift64*
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static bool utf8_valid(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        int len = u[i] < 0x80 ? 1 : (u[i] >> 5) == 6 ? 2 : (u[i] >> 4) == 14 ? 3 : (u[i] >> 3) == 30 ? 4 : 0;
        if (!len || i + (size_t)len > n) return false;
        for (int k = 1; k < len; k++)
            if ((u[i + k] & 0xC0) != 0x80) return false;
        i += (size_t)len;
    }
    return true;
}

// Streams ids in random chunks; returns false (after reporting) if the deltas do not add up to the
// full decode or a delta is not valid UTF-8.
static bool stream_matches(const struct tokenizer *t, const int32_t *ids, int n, bool skip, uint64_t *rng) {
    char *full;
    size_t full_len;
    struct error err = {0};
    if (tokenizer_decode_n(t, ids, n, skip, &full, &full_len, &err)) {
        fprintf(stderr, "  decode: %s\n", err.msg);
        return false;
    }
    struct detokenizer d;
    detokenizer_init(&d, t, skip);
    char *acc = malloc(full_len * 2 + 64);
    size_t acc_len = 0, acc_cap = full_len * 2 + 64;
    bool ok = true;
    int fed = 0;
    while (ok) {
        bool final = fed == n;
        int step = final ? 0 : 1 + (int)(rng_next(rng) % 3);
        if (fed + step > n) step = n - fed;
        fed += step;
        char *delta;
        size_t dlen;
        if (detokenizer_step(&d, ids, fed, step, final, &delta, &dlen) != ATOMC_OK) {
            fprintf(stderr, "  detokenizer_step failed at %d\n", fed);
            ok = false;
            break;
        }
        if (!utf8_valid(delta, dlen)) {
            fprintf(stderr, "  delta at %d is not valid UTF-8\n", fed);
            ok = false;
        }
        if (acc_len + dlen > acc_cap) {
            acc_cap = (acc_len + dlen) * 2;
            acc = realloc(acc, acc_cap);
        }
        if (dlen) memcpy(acc + acc_len, delta, dlen);
        acc_len += dlen;
        free(delta);
        if (final) break;
    }
    if (ok && (acc_len != full_len || memcmp(acc, full, full_len))) {
        fprintf(stderr, "  stream \"%.*s\" != full \"%.*s\"\n", (int)(acc_len < 80 ? acc_len : 80), acc,
                (int)(full_len < 80 ? full_len : 80), full);
        ok = false;
    }
    detokenizer_free(&d);
    free(acc);
    free(full);
    return ok;
}

static const char *const SAMPLES[] = {
    "Hello world! This is a test of streaming.",
    "  leading spaces and\ttabs\r\nand CRLF",
    "你好，世界！日本語のテキスト。한국어",
    "emoji 👨‍👩‍👧‍👦 and 👍🏽 and 🇺🇸 flags",
    "caf\xC3\xA9 cafe\xCC\x81 na\xC3\xAFve",
    "<s>special</s> <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "def f(x):\n    return x ** 2  # comment\n",
    "invalid \xff\xfe bytes \xe4\xb8 end",
    " ",
    "12345678901234567890",
};

static void property_for(struct tokenizer *t, const char *name) {
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    int bad = 0;
    for (size_t s = 0; s < sizeof SAMPLES / sizeof SAMPLES[0]; s++) {
        int32_t *ids;
        int n;
        struct error err = {0};
        if (tokenizer_encode(t, SAMPLES[s], strlen(SAMPLES[s]), true, &ids, &n, &err)) {
            test_fail(__FILE__, __LINE__, "%s: encode: %s", name, err.msg);
            return;
        }
        for (int rep = 0; rep < 4; rep++) {
            if (!stream_matches(t, ids, n, rep & 1, &rng)) {
                fprintf(stderr, "  %s: sample %zu\n", name, s);
                bad++;
            }
        }
        free(ids);
    }
    // Random id sequences: arbitrary pieces, partial byte sequences included.
    int vocab = tokenizer_vocab_size(t);
    for (int rep = 0; rep < 60; rep++) {
        int n = 1 + (int)(rng_next(&rng) % 40);
        int32_t ids[40];
        for (int i = 0; i < n; i++) {
            do ids[i] = (int32_t)(rng_next(&rng) % (uint64_t)vocab);
            while (!tokenizer_token_text(t, ids[i]));
        }
        if (!stream_matches(t, ids, n, rep & 1, &rng)) {
            fprintf(stderr, "  %s: random sequence %d\n", name, rep);
            bad++;
        }
    }
    ASSERT_EQ(bad, 0);
}

#define PROPERTY_TEST(tname, loader)                 \
    TEST(detokenizer_stream_##tname) {               \
        struct tokenizer *t = loader;                \
        if (!t) return;                              \
        property_for(t, #tname);                     \
        tokenizer_free(t);                           \
    }

PROPERTY_TEST(llama2, load_shared("llama2"))
PROPERTY_TEST(llama3, load_shared("llama3"))
PROPERTY_TEST(qwen3, load_shared("qwen3"))
PROPERTY_TEST(deepseek_v3, load_shared("deepseek_v3"))
PROPERTY_TEST(gpt_oss, load_shared("gpt_oss"))
PROPERTY_TEST(tiny_spm, load_fixture("tokenizer/tiny_spm.gguf"))
PROPERTY_TEST(synth_word, load_fixture("tokenizer/synth_word.json"))
PROPERTY_TEST(synth_meta, load_fixture("tokenizer/synth_meta.json"))
PROPERTY_TEST(synth_bytelevel, load_fixture("tokenizer/synth_bytelevel.json"))
PROPERTY_TEST(tiny_bpe_qwen2, load_fixture("tokenizer/tiny_bpe_qwen2.gguf"))

// SentencePiece: the first streamed token loses its leading space exactly as the full decode does,
// later ones keep it.
TEST(detokenizer_sentencepiece_first_token) {
    struct tokenizer *t = load_shared("llama2");
    if (!t) return;
    int32_t *ids;
    int n;
    ASSERT_OK(tokenizer_encode(t, "Hello world", 11, false, &ids, &n, NULL));
    ASSERT_EQ(n, 2);
    struct detokenizer d;
    detokenizer_init(&d, t, true);
    char *delta;
    size_t len;
    ASSERT_OK(detokenizer_step(&d, ids, 1, 1, false, &delta, &len));
    ASSERT_STREQ(delta, "Hello");
    free(delta);
    ASSERT_OK(detokenizer_step(&d, ids, 2, 1, false, &delta, &len));
    ASSERT_STREQ(delta, " world");
    free(delta);
    ASSERT_OK(detokenizer_step(&d, ids, 2, 0, true, &delta, &len));
    ASSERT_EQ(len, 0);
    ASSERT_TRUE(delta == NULL || delta[0] == '\0');
    free(delta);
    detokenizer_free(&d);
    free(ids);
    tokenizer_free(t);
}

// A multi-byte character split over byte-fallback tokens is held back until complete.
TEST(detokenizer_holds_partial_utf8) {
    struct tokenizer *t = load_shared("llama2");
    if (!t) return;
    int32_t ids[4] = {tokenizer_token_id(t, "<0xF0>"), tokenizer_token_id(t, "<0x9F>"), tokenizer_token_id(t, "<0x98>"),
                      tokenizer_token_id(t, "<0x80>")};
    for (int i = 0; i < 4; i++) ASSERT_TRUE(ids[i] >= 0);
    struct detokenizer d;
    detokenizer_init(&d, t, false);
    char *delta;
    size_t len;
    for (int i = 1; i <= 3; i++) {
        ASSERT_OK(detokenizer_step(&d, ids, i, 1, false, &delta, &len));
        ASSERT_EQ(len, 0);
        free(delta);
    }
    ASSERT_OK(detokenizer_step(&d, ids, 4, 1, false, &delta, &len));
    ASSERT_STREQ(delta, "\xF0\x9F\x98\x80");
    free(delta);
    detokenizer_free(&d);
    tokenizer_free(t);
}

TEST(accessors_llama2) {
    struct tokenizer *t = load_shared("llama2");
    if (!t) return;
    ASSERT_EQ(tokenizer_vocab_size(t), 32000);
    ASSERT_EQ(tokenizer_bos_id(t), 1);
    ASSERT_EQ(tokenizer_eos_id(t), 2);
    ASSERT_STREQ(tokenizer_bos_text(t), "<s>");
    ASSERT_TRUE(tokenizer_adds_bos(t));
    ASSERT_TRUE(tokenizer_is_special(t, 1));
    ASSERT_TRUE(!tokenizer_is_special(t, 1000));
    ASSERT_EQ(tokenizer_token_id(t, "<0x0A>"), 13);
    size_t len;
    const char *b = tokenizer_token_bytes(t, 13, &len);
    ASSERT_TRUE(b && len == 1 && b[0] == '\n');
    b = tokenizer_token_bytes(t, tokenizer_token_id(t, "\xE2\x96\x81the"), &len);
    ASSERT_TRUE(b && len == 4 && !memcmp(b, " the", 4));
    ASSERT_TRUE(tokenizer_token_text(t, 32000) == NULL);
    ASSERT_TRUE(tokenizer_token_text(t, -1) == NULL);
    tokenizer_free(t);
}

TEST(accessors_qwen3_byte_level) {
    struct tokenizer *t = load_shared("qwen3");
    if (!t) return;
    ASSERT_STREQ(tokenizer_eos_text(t), "<|im_end|>");
    ASSERT_EQ(tokenizer_eos_id(t), tokenizer_token_id(t, "<|im_end|>"));
    ASSERT_EQ(tokenizer_bos_id(t), -1);
    ASSERT_TRUE(!tokenizer_adds_bos(t));
    ASSERT_TRUE(tokenizer_chat_template(t) != NULL);
    ASSERT_TRUE(strstr(tokenizer_chat_template(t), "<|im_start|>") != NULL);
    size_t len;
    const char *b = tokenizer_token_bytes(t, tokenizer_token_id(t, "\xC4\xA0the"), &len);  // "Ġthe"
    ASSERT_TRUE(b && len == 4 && !memcmp(b, " the", 4));
    b = tokenizer_token_bytes(t, tokenizer_token_id(t, "\xC3\xA4"), &len);  // byte 0xE4 alone
    ASSERT_TRUE(b && len == 1 && (unsigned char)b[0] == 0xE4);
    tokenizer_free(t);
}

TEST(accessors_deepseek_config_bos) {
    struct tokenizer *t = load_shared("deepseek_v3");
    if (!t) return;
    // tokenizer_config.json: add_bos_token with a LlamaTokenizerFast class and an AddedToken-dict bos.
    ASSERT_TRUE(tokenizer_adds_bos(t));
    ASSERT_EQ(tokenizer_bos_id(t), 0);
    ASSERT_STREQ(tokenizer_eos_text(t), "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>");
    tokenizer_free(t);
}

TEST(gguf_fixture_accessors) {
    struct tokenizer *t = load_fixture("tokenizer/tiny_spm.gguf");
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ(tokenizer_bos_id(t), 1);
    ASSERT_TRUE(tokenizer_adds_bos(t));
    ASSERT_STREQ(tokenizer_chat_template(t), "{% for m in messages %}{{ m['content'] }}{% endfor %}");
    ASSERT_TRUE(tokenizer_is_special(t, 2));
    int32_t tool = tokenizer_token_id(t, "<tool_call>");
    ASSERT_TRUE(tool >= 0 && !tokenizer_is_special(t, tool));
    tokenizer_free(t);
}

static const char *write_tmp(const char *name, const char *content) {
    static char path[256];
    snprintf(path, sizeof path, "/tmp/atomc_tok_test_%d_%s", (int)getpid(), name);
    FILE *f = fopen(path, "w");
    if (!f) return NULL;
    fputs(content, f);
    fclose(f);
    return path;
}

TEST(load_errors) {
    struct error err = {0};
    struct tokenizer *t = (struct tokenizer *)1;
    ASSERT_EQ(tokenizer_load("/nonexistent/dir/tokenizer.json", &t, &err), ATOMC_ERR_IO);
    ASSERT_TRUE(t == NULL);
    ASSERT_TRUE(strstr(err.msg, "/nonexistent/dir/tokenizer.json") != NULL);

    const char *p = write_tmp("bad.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,");
    ASSERT_EQ(tokenizer_load(p, &t, &err), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(err.msg, p) != NULL);
    unlink(p);

    p = write_tmp("wp.json", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}");
    ASSERT_EQ(tokenizer_load(p, &t, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "WordPiece") != NULL);
    unlink(p);

    p = write_tmp("merge.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}");
    ASSERT_EQ(tokenizer_load(p, &t, &err), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(err.msg, "merge 0") != NULL);
    unlink(p);

    p = write_tmp("regex.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []},"
                                "\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(unclosed\"},"
                                "\"behavior\": \"Isolated\", \"invert\": false}}");
    ASSERT_EQ(tokenizer_load(p, &t, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "(unclosed") != NULL);
    unlink(p);

    p = write_tmp("trunc.gguf", "GGUF\x03");
    ASSERT_TRUE(tokenizer_load(p, &t, &err) != ATOMC_OK);
    ASSERT_TRUE(t == NULL);
    unlink(p);
}

// A character outside the vocabulary with no unk token and no byte fallback is dropped, its
// neighbours merging as if it were absent (HF tokenizers 0.23 on this tokenizer: "abc" -> [2],
// "acb" -> [2], "cc" -> []); an out-of-range id to decode is an error, not a crash.
TEST(encode_unknown_char_dropped_as_hf) {
    const char *p = write_tmp("tiny.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2},"
                                           "\"merges\": [[\"a\", \"b\"]]}}");
    struct error err = {0};
    struct tokenizer *t;
    ASSERT_OK(tokenizer_load(p, &t, &err));
    unlink(p);
    int32_t *ids;
    int n;
    ASSERT_OK(tokenizer_encode(t, "abab", 4, true, &ids, &n, &err));
    ASSERT_EQ(n, 2);
    ASSERT_EQ(ids[0], 2);
    free(ids);
    const char *texts[] = {"abc", "acb", "cc"};
    const int want_n[] = {1, 1, 0};
    for (int k = 0; k < 3; k++) {
        ASSERT_OK(tokenizer_encode(t, texts[k], strlen(texts[k]), false, &ids, &n, &err));
        ASSERT_EQ(n, want_n[k]);
        if (n) ASSERT_EQ(ids[0], 2);
        free(ids);
    }
    char *text;
    int32_t bad[2] = {0, 7};
    ASSERT_EQ(tokenizer_decode(t, bad, 2, false, &text, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "7") != NULL);
    // No decoder: pieces joined with spaces (HF default).
    int32_t good[2] = {2, 0};
    ASSERT_OK(tokenizer_decode(t, good, 2, false, &text, &err));
    ASSERT_STREQ(text, "ab a");
    free(text);
    tokenizer_free(t);
}

// tokenizer_config.json handling from memory: AddedToken-dict bos/eos, add_bos/add_eos override for a
// Llama class, chat_template as a list of {name, template}; lstrip/rstrip added tokens.
TEST(config_overrides_from_buffer) {
    static const char json[] =
        "{\"added_tokens\": [{\"id\": 3, \"content\": \"<s>\", \"special\": true, \"normalized\": false},"
        "                   {\"id\": 4, \"content\": \"</s>\", \"special\": true, \"normalized\": false},"
        "                   {\"id\": 5, \"content\": \"<m>\", \"special\": true, \"normalized\": false,"
        "                    \"lstrip\": true, \"rstrip\": true}],"
        " \"post_processor\": {\"type\": \"ByteLevel\"},"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \" \": 2}, \"merges\": []}}";
    static const char cfg[] =
        "{\"tokenizer_class\": \"LlamaTokenizerFast\", \"add_bos_token\": true, \"add_eos_token\": true,"
        " \"bos_token\": {\"__type\": \"AddedToken\", \"content\": \"<s>\"}, \"eos_token\": \"</s>\","
        " \"model_max_length\": 1000000000000000019884624838656,"
        " \"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}, {\"name\": \"default\", \"template\": \"D\"}]}";
    struct error err = {0};
    struct tokenizer *t;
    ASSERT_OK(tokenizer_load_json_buffer(json, sizeof json - 1, cfg, sizeof cfg - 1, &t, &err));
    ASSERT_EQ(tokenizer_bos_id(t), 3);
    ASSERT_EQ(tokenizer_eos_id(t), 4);
    ASSERT_TRUE(tokenizer_adds_bos(t));
    ASSERT_STREQ(tokenizer_chat_template(t), "D");
    int32_t *ids;
    int n;
    ASSERT_OK(tokenizer_encode(t, "a  <m>  b", 9, true, &ids, &n, &err));
    // <s> a <m> (both-side whitespace absorbed) b </s>
    ASSERT_EQ(n, 5);
    ASSERT_EQ(ids[0], 3);
    ASSERT_EQ(ids[1], 0);
    ASSERT_EQ(ids[2], 5);
    ASSERT_EQ(ids[3], 1);
    ASSERT_EQ(ids[4], 4);
    free(ids);
    tokenizer_free(t);
    // Without the Llama class the post-processor of tokenizer.json stays (no bos/eos added).
    static const char cfg2[] = "{\"tokenizer_class\": \"Qwen2Tokenizer\", \"add_bos_token\": true, \"bos_token\": \"<s>\"}";
    ASSERT_OK(tokenizer_load_json_buffer(json, sizeof json - 1, cfg2, sizeof cfg2 - 1, &t, &err));
    ASSERT_TRUE(!tokenizer_adds_bos(t));
    ASSERT_OK(tokenizer_encode(t, "ab", 2, true, &ids, &n, &err));
    ASSERT_EQ(n, 2);
    free(ids);
    tokenizer_free(t);
    ASSERT_EQ(tokenizer_load_json_buffer(json, sizeof json - 1, "{", 1, &t, &err), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(err.msg, "tokenizer_config.json") != NULL);
}

struct thread_arg {
    const struct tokenizer *t;
    int32_t *ids;
    int n;
};

static void *encode_thread(void *p) {
    struct thread_arg *a = p;
    for (int rep = 0; rep < 20; rep++) {
        free(a->ids);
        tokenizer_encode(a->t, SAMPLES[rep % 8], strlen(SAMPLES[rep % 8]), true, &a->ids, &a->n, NULL);
    }
    return NULL;
}

TEST(encode_concurrent_threads) {
    struct tokenizer *t = load_fixture("tokenizer/synth_meta.json");
    ASSERT_TRUE(t != NULL);
    struct thread_arg args[4] = {{t, NULL, 0}, {t, NULL, 0}, {t, NULL, 0}, {t, NULL, 0}};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, encode_thread, &args[i]);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    int32_t *ids;
    int n;
    ASSERT_OK(tokenizer_encode(t, SAMPLES[19 % 8], strlen(SAMPLES[19 % 8]), true, &ids, &n, NULL));
    for (int i = 0; i < 4; i++) {
        ASSERT_EQ(args[i].n, n);
        ASSERT_TRUE(!memcmp(args[i].ids, ids, (size_t)n * sizeof *ids));
        free(args[i].ids);
    }
    free(ids);
    tokenizer_free(t);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
