// The grammar shim (src/grammar/grammar.h over xgrammar): masks, accept, termination, the
// compile cache, invalid inputs, and real tokenizers' vocabularies (byte-level BPE and
// SentencePiece byte fallback) driven to a complete JSON document by random allowed tokens.
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"
#include "test.h"
#include "tokenizer/tokenizer.h"

static bool bit(const uint32_t *m, int id) {
    return (m[id >> 5] >> (id & 31)) & 1u;
}

// A tiny vocabulary: multi-character tokens, one special, EOS last (id 8); vocab_size 40 pads
// ids 9..39 (never allowed).
enum { T_A, T_B, T_C, T_AB, T_BC, T_ABC, T_X, T_SPECIAL, T_EOS, N_TINY };
static struct grammar_vocab *tiny_vocab(void) {
    static const char *toks[N_TINY] = {"a", "b", "c", "ab", "bc", "abc", "x", "<|special|>", "</s>"};
    size_t lens[N_TINY];
    bool special[N_TINY] = {0};
    special[T_SPECIAL] = special[T_EOS] = true;
    for (int i = 0; i < N_TINY; i++)
        lens[i] = strlen(toks[i]);
    int32_t eos = T_EOS;
    struct grammar_vocab *v = NULL;
    struct error err = {0};
    atomc_status st = grammar_vocab_create(toks, lens, special, N_TINY, 40, &eos, 1, NULL, &v, &err);
    if (st != ATOMC_OK) test_fail(__FILE__, __LINE__, "vocab: %s", err.msg);
    return v;
}

static struct grammar_matcher *matcher_for(struct grammar_vocab *v, enum grammar_kind k, const char *text) {
    struct grammar_compiled *g = NULL;
    struct error err = {0};
    if (grammar_compile(v, k, text, text ? strlen(text) : 0, &g, &err) != ATOMC_OK) {
        test_fail(__FILE__, __LINE__, "compile %s: %s", text ? text : "(null)", err.msg);
        return NULL;
    }
    struct grammar_matcher *m = NULL;
    if (grammar_matcher_create(g, 4, &m, &err) != ATOMC_OK) test_fail(__FILE__, __LINE__, "matcher: %s", err.msg);
    grammar_compiled_release(g);
    return m;
}

TEST(grammar_bitmask_words_round_up) {
    ASSERT_EQ(grammar_bitmask_words(1), 1);
    ASSERT_EQ(grammar_bitmask_words(32), 1);
    ASSERT_EQ(grammar_bitmask_words(33), 2);
    ASSERT_EQ(grammar_bitmask_words(49152), 1536);
}

TEST(grammar_regex_masks_accepts_and_terminates) {
    struct grammar_vocab *v = tiny_vocab();
    if (!v) return;
    struct grammar_matcher *m = matcher_for(v, GRAMMAR_REGEX, "[ab]+c");
    if (!m) return;
    uint32_t mask[2];
    ASSERT_TRUE(grammar_matcher_fill_mask(m, mask));
    // First token: any token that starts a match of [ab]+c.
    ASSERT_TRUE(bit(mask, T_A) && bit(mask, T_B) && bit(mask, T_AB) && bit(mask, T_BC) && bit(mask, T_ABC));
    ASSERT_TRUE(!bit(mask, T_C) && !bit(mask, T_X) && !bit(mask, T_SPECIAL) && !bit(mask, T_EOS));
    for (int id = N_TINY; id < 40; id++)
        ASSERT_TRUE(!bit(mask, id));
    ASSERT_TRUE(!grammar_matcher_can_end(m));
    ASSERT_TRUE(!grammar_matcher_accept(m, T_C)); // rejected, state unchanged
    ASSERT_TRUE(!grammar_matcher_accept(m, T_EOS));
    ASSERT_TRUE(grammar_matcher_accept(m, T_AB));
    grammar_matcher_fill_mask(m, mask);
    ASSERT_TRUE(bit(mask, T_A) && bit(mask, T_C) && bit(mask, T_BC) && !bit(mask, T_EOS) && !bit(mask, T_X));
    ASSERT_TRUE(grammar_matcher_accept(m, T_C));
    ASSERT_TRUE(grammar_matcher_can_end(m));
    ASSERT_TRUE(!grammar_matcher_is_terminated(m));
    grammar_matcher_fill_mask(m, mask);
    for (int id = 0; id < 40; id++)
        ASSERT_EQ(bit(mask, id), id == T_EOS); // only the end is left
    ASSERT_TRUE(grammar_matcher_accept(m, T_EOS));
    ASSERT_TRUE(grammar_matcher_is_terminated(m));
    // Rollback (the spec-decode hook): back before the EOS and the "c".
    grammar_matcher_rollback(m, 2);
    ASSERT_TRUE(!grammar_matcher_is_terminated(m) && !grammar_matcher_can_end(m));
    ASSERT_TRUE(grammar_matcher_accept(m, T_BC));
    ASSERT_TRUE(grammar_matcher_can_end(m));
    grammar_matcher_free(m);
    grammar_vocab_free(v);
}

TEST(grammar_choice_is_exactly_one_of_the_strings) {
    struct grammar_vocab *v = tiny_vocab();
    if (!v) return;
    struct grammar_matcher *m = matcher_for(v, GRAMMAR_CHOICE, "[\"abc\", \"x\", \"b\\u0063\"]");
    if (!m) return;
    uint32_t mask[2];
    grammar_matcher_fill_mask(m, mask);
    ASSERT_TRUE(bit(mask, T_A) && bit(mask, T_AB) && bit(mask, T_ABC) && bit(mask, T_X) && bit(mask, T_B) &&
                bit(mask, T_BC));
    ASSERT_TRUE(!bit(mask, T_C) && !bit(mask, T_EOS));
    ASSERT_TRUE(grammar_matcher_accept(m, T_X));
    grammar_matcher_fill_mask(m, mask);
    for (int id = 0; id < N_TINY; id++)
        ASSERT_EQ(bit(mask, id), id == T_EOS);
    grammar_matcher_free(m);
    m = matcher_for(v, GRAMMAR_CHOICE, "[\"abc\", \"x\", \"bc\"]");
    ASSERT_TRUE(grammar_matcher_accept(m, T_B));
    ASSERT_TRUE(!grammar_matcher_accept(m, T_A));
    ASSERT_TRUE(grammar_matcher_accept(m, T_C));
    ASSERT_TRUE(grammar_matcher_accept(m, T_EOS) && grammar_matcher_is_terminated(m));
    grammar_matcher_free(m);
    grammar_vocab_free(v);
}

TEST(grammar_ebnf_and_lark) {
    struct grammar_vocab *v = tiny_vocab();
    if (!v) return;
    struct grammar_matcher *m = matcher_for(v, GRAMMAR_EBNF, "root ::= \"a\" rest\nrest ::= \"b\" | \"c\" rest");
    if (!m) return;
    ASSERT_TRUE(grammar_matcher_accept(m, T_A));
    ASSERT_TRUE(grammar_matcher_accept(m, T_C));
    ASSERT_TRUE(!grammar_matcher_accept(m, T_A));
    ASSERT_TRUE(grammar_matcher_accept(m, T_BC) == false); // "bc" would leave a "c" after the end
    ASSERT_TRUE(grammar_matcher_accept(m, T_B));
    ASSERT_TRUE(grammar_matcher_accept(m, T_EOS) && grammar_matcher_is_terminated(m));
    grammar_matcher_free(m);
    m = matcher_for(v, GRAMMAR_LARK, "start: \"x\" \"a\"+");
    if (!m) return;
    ASSERT_TRUE(grammar_matcher_accept(m, T_X));
    ASSERT_TRUE(!grammar_matcher_can_end(m));
    ASSERT_TRUE(grammar_matcher_accept(m, T_A));
    ASSERT_TRUE(grammar_matcher_can_end(m));
    grammar_matcher_free(m);
    grammar_vocab_free(v);
}

TEST(grammar_compile_cache_by_kind_and_text) {
    struct grammar_vocab *v = tiny_vocab();
    if (!v) return;
    struct error err = {0};
    struct grammar_compiled *a = NULL, *b = NULL, *c = NULL;
    ASSERT_OK(grammar_compile(v, GRAMMAR_REGEX, "a+", 2, &a, &err));
    ASSERT_OK(grammar_compile(v, GRAMMAR_REGEX, "a+", 2, &b, &err));
    ASSERT_OK(grammar_compile(v, GRAMMAR_CHOICE, "[\"a+\"]", 6, &c, &err));
    ASSERT_TRUE(a == b);
    ASSERT_TRUE(a != c);
    int64_t hits, misses;
    int entries;
    grammar_vocab_cache_stats(v, &hits, &misses, &entries);
    ASSERT_EQ(hits, 1);
    ASSERT_EQ(misses, 2);
    ASSERT_EQ(entries, 2);
    grammar_compiled_release(a);
    grammar_compiled_release(b);
    grammar_compiled_release(c);
    // A failed compile is not cached and leaves the cache as it was.
    ASSERT_EQ(grammar_compile(v, GRAMMAR_REGEX, "(", 1, &a, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(a == NULL);
    grammar_vocab_cache_stats(v, NULL, NULL, &entries);
    ASSERT_EQ(entries, 2);
    grammar_vocab_free(v);
}

static void expect_invalid(struct grammar_vocab *v, enum grammar_kind k, const char *text, const char *needle) {
    struct grammar_compiled *g = (struct grammar_compiled *)1;
    struct error err = {0};
    atomc_status st = grammar_compile(v, k, text, strlen(text), &g, &err);
    if (st != ATOMC_ERR_INVALID_ARGUMENT || g != NULL)
        test_fail(__FILE__, __LINE__, "'%s' (kind %d) gave status %d, expected invalid", text, (int)k, (int)st);
    else if (!strstr(err.msg, needle))
        test_fail(__FILE__, __LINE__, "'%s': message '%s' lacks '%s'", text, err.msg, needle);
}

TEST(grammar_invalid_inputs_are_errors_naming_them) {
    struct grammar_vocab *v = tiny_vocab();
    if (!v) return;
    expect_invalid(v, GRAMMAR_REGEX, "(ab", "invalid regex");
    expect_invalid(v, GRAMMAR_REGEX, "", "regex: empty");
    expect_invalid(v, GRAMMAR_JSON_SCHEMA, "{\"type\": ", "invalid json schema");
    expect_invalid(v, GRAMMAR_JSON_SCHEMA, "{\"type\": \"no-such-type\"}", "invalid json schema");
    expect_invalid(v, GRAMMAR_EBNF, "root ::= ", "invalid grammar");
    expect_invalid(v, GRAMMAR_EBNF, "start ::= \"a\"", "invalid grammar"); // no root rule
    expect_invalid(v, GRAMMAR_LARK, "start: (", "invalid lark grammar");
    expect_invalid(v, GRAMMAR_CHOICE, "[]", "at least one");
    expect_invalid(v, GRAMMAR_CHOICE, "[\"a\", 3]", "JSON array of strings");
    expect_invalid(v, GRAMMAR_CHOICE, "[\"\"]", "must not be empty");
    expect_invalid(v, GRAMMAR_STRUCTURAL_TAG, "{\"type\": \"structural_tag\"}", "invalid structural tag");
    grammar_vocab_free(v);
    // Limits: the source size bound.
    static const char *toks[2] = {"a", "</s>"};
    size_t lens[2] = {1, 4};
    bool special[2] = {false, true};
    int32_t eos = 1;
    struct grammar_limits lim = {.max_text_bytes = 8};
    struct error err = {0};
    ASSERT_OK(grammar_vocab_create(toks, lens, special, 2, 2, &eos, 1, &lim, &v, &err));
    expect_invalid(v, GRAMMAR_REGEX, "aaaaaaaaa", "more than the limit of 8");
    grammar_vocab_free(v);
    // A vocabulary without any stop token cannot end a grammar.
    ASSERT_EQ(grammar_vocab_create(toks, lens, special, 2, 2, NULL, 0, NULL, &v, &err), ATOMC_ERR_UNSUPPORTED);
}

// maxLength 6 counts code points.
static bool utf8_len_ok(const char *s) {
    int n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n <= 6;
}

// Random walk over allowed tokens (EOS as soon as it is allowed) from a real tokenizer's
// vocabulary; the decoded text must be a complete document of the schema.
static void walk_json_schema(const char *tok_dir) {
    const char *path = test_shared_path(tok_dir);
    if (!path) return;
    struct tokenizer *t = NULL;
    struct error err = {0};
    if (tokenizer_load(path, &t, &err)) {
        test_fail(__FILE__, __LINE__, "load %s: %s", path, err.msg);
        return;
    }
    int V = tokenizer_vocab_size(t);
    const char **toks = calloc((size_t)V, sizeof *toks);
    size_t *lens = calloc((size_t)V, sizeof *lens);
    bool *special = calloc((size_t)V, sizeof *special);
    for (int i = 0; i < V; i++) {
        toks[i] = tokenizer_token_bytes(t, i, &lens[i]);
        special[i] = tokenizer_is_special(t, i);
    }
    int32_t eos = tokenizer_eos_id(t);
    struct grammar_vocab *v = NULL;
    ASSERT_OK(grammar_vocab_create(toks, lens, special, V, V + 64, &eos, 1, NULL, &v, &err));
    const char *schema = "{\"type\": \"object\", \"properties\": {"
                         "\"name\": {\"type\": \"string\", \"maxLength\": 6},"
                         "\"n\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 99},"
                         "\"tags\": {\"type\": \"array\", \"items\": {\"enum\": [\"x\", \"y\"]}, \"maxItems\": 3},"
                         "\"ok\": {\"type\": \"boolean\"}},"
                         "\"required\": [\"name\", \"n\", \"tags\", \"ok\"]}";
    int words = grammar_bitmask_words(V + 64);
    uint32_t *mask = malloc((size_t)words * 4);
    int32_t *ids = malloc(600 * sizeof *ids);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int trial = 0; trial < 4; trial++) {
        struct grammar_matcher *m = matcher_for(v, GRAMMAR_JSON_SCHEMA, schema);
        if (!m) break;
        int n = 0;
        while (!grammar_matcher_is_terminated(m) && n < 600) {
            grammar_matcher_fill_mask(m, mask);
            int n_allowed = 0, pick = -1;
            for (int i = 0; i < V + 64; i++)
                n_allowed += bit(mask, i);
            ASSERT_TRUE(n_allowed > 0);
            for (int i = V; i < V + 64; i++)
                ASSERT_TRUE(!bit(mask, i));
            if (bit(mask, eos)) {
                pick = eos;
            } else {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                int k = (int)(rng % (uint64_t)n_allowed);
                for (int i = 0; i < V + 64 && pick < 0; i++)
                    if (bit(mask, i) && k-- == 0) pick = i;
            }
            ASSERT_TRUE(grammar_matcher_accept(m, pick));
            ids[n++] = pick;
        }
        ASSERT_TRUE(grammar_matcher_is_terminated(m));
        char *text = NULL;
        ASSERT_OK(tokenizer_decode(t, ids, n - 1, true, &text, &err));
        json_error_t je;
        json_t *doc = json_loads(text, 0, &je);
        if (!doc) {
            test_fail(__FILE__, __LINE__, "%s: not JSON: %s (%s)", tok_dir, text, je.text);
            for (int i = 0; i < n; i++) {
                size_t l;
                const char *b = tokenizer_token_bytes(t, ids[i], &l);
                fprintf(stderr, "  id %d: '%.*s' (%zu bytes, first %02x)\n", ids[i], (int)l, b ? b : "", l,
                        l ? (unsigned char)b[0] : 0);
            }
        }
        json_t *nv = json_object_get(doc, "n"), *nm = json_object_get(doc, "name"), *tg = json_object_get(doc, "tags");
        ASSERT_TRUE(json_is_object(doc) && json_object_size(doc) == 4);
        ASSERT_TRUE(json_is_integer(nv) && json_integer_value(nv) >= 0 && json_integer_value(nv) <= 99);
        ASSERT_TRUE(json_is_string(nm) && utf8_len_ok(json_string_value(nm)));
        ASSERT_TRUE(json_is_array(tg) && json_array_size(tg) <= 3);
        ASSERT_TRUE(json_is_boolean(json_object_get(doc, "ok")));
        json_decref(doc);
        free(text);
        grammar_matcher_free(m);
    }
    free(ids);
    free(mask);
    grammar_vocab_free(v);
    free(toks);
    free(lens);
    free(special);
    tokenizer_free(t);
}

TEST(grammar_json_schema_walk_byte_level_bpe) {
    walk_json_schema("tokenizers/qwen3");
}
TEST(grammar_json_schema_walk_sentencepiece_byte_fallback) {
    walk_json_schema("tokenizers/llama2");
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
