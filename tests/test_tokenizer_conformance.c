// Conformance against HF `tokenizers`: every string of tests/fixtures/tokenizer/corpus.json must
// give the reference ids (with and without special tokens) and the reference decodes, for the
// real tokenizers in ../shared/tokenizers (or $ATOMC_SHARED/tokenizers) and SmolLM2's GGUF
// ($ATOMC_SMOLLM2). References come from tools/gen_tokenizer_refs.py. A missing shared tokenizer
// or SmolLM2 file is a skip (a failure under ATOMC_REQUIRE_FIXTURES=1); a missing committed
// fixture (tokenizer, corpus, reference) is a failure.
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base64.h"
#include "common/check.h"
#include "test.h"
#include "tokenizer/tokenizer.h"

struct corpus {
    char **text;
    size_t *len;
    int n;
};

static char *b64_decode(const char *s, size_t *out_len) {
    size_t n = strlen(s);
    char *out = malloc(n + 1);
    long k = base64_decode(s, n, (unsigned char *)out);
    CHECK_MSG(k >= 0, "corpus.json: bad base64 %s", s);
    out[k] = '\0';
    *out_len = (size_t)k;
    return out;
}

static bool corpus_load(struct corpus *c) {
    json_error_t jerr;
    json_t *root = json_load_file(test_fixture("tokenizer/corpus.json"), JSON_ALLOW_NUL, &jerr);
    if (!root) return false;
    c->n = (int)json_array_size(root);
    c->text = calloc((size_t)c->n, sizeof *c->text);
    c->len = calloc((size_t)c->n, sizeof *c->len);
    for (int i = 0; i < c->n; i++) {
        json_t *it = json_array_get(root, (size_t)i), *t = json_object_get(it, "text");
        if (t) {
            c->len[i] = json_string_length(t);
            c->text[i] = malloc(c->len[i] + 1);
            memcpy(c->text[i], json_string_value(t), c->len[i] + 1);
        } else {
            c->text[i] = b64_decode(json_string_value(json_object_get(it, "b64")), &c->len[i]);
        }
    }
    json_decref(root);
    return true;
}

static void corpus_free(struct corpus *c) {
    for (int i = 0; i < c->n; i++) free(c->text[i]);
    free(c->text);
    free(c->len);
}

static bool ids_equal(const int32_t *a, int na, json_t *b, int off) {
    for (int i = 0; i < na; i++)
        if (a[off + i] != json_integer_value(json_array_get(b, (size_t)i))) return false;
    return true;
}

static int first_diff(const int32_t *a, int na, json_t *b) {
    int nb = (int)json_array_size(b);
    for (int i = 0; i < na && i < nb; i++)
        if (a[i] != json_integer_value(json_array_get(b, (size_t)i))) return i;
    return na < nb ? na : nb;
}

// Checks one tokenizer against ref_<name>.json; returns the number of failing strings.
static int check_tokenizer(const char *name, const char *path_in) {
    char path[1024];  // test_fixture() returns a static buffer: keep a copy
    snprintf(path, sizeof path, "%s", path_in);
    if (access(path, R_OK) != 0) {
        test_fail(__FILE__, __LINE__, "%s: %s cannot be read", name, path);
        return 1;
    }
    struct corpus c;
    if (!corpus_load(&c)) {
        test_fail(__FILE__, __LINE__, "cannot read corpus.json");
        return 1;
    }
    char ref_path[256];
    snprintf(ref_path, sizeof ref_path, "tokenizer/ref_%s.json", name);
    json_error_t jerr;
    json_t *ref = json_load_file(test_fixture(ref_path), JSON_ALLOW_NUL, &jerr);
    if (!ref) {
        test_fail(__FILE__, __LINE__, "cannot read %s: %s", ref_path, jerr.text);
        corpus_free(&c);
        return 1;
    }
    struct error err = {0};
    struct tokenizer *t;
    if (tokenizer_load(path, &t, &err)) {
        test_fail(__FILE__, __LINE__, "%s: %s", name, err.msg);
        json_decref(ref);
        corpus_free(&c);
        return 1;
    }
    json_t *ids = json_object_get(ref, "ids"), *dec = json_object_get(ref, "decode"),
           *dec_skip = json_object_get(ref, "decode_skip"), *pre = json_object_get(ref, "special_prefix"),
           *suf = json_object_get(ref, "special_suffix");
    int n_pre = (int)json_array_size(pre), n_suf = (int)json_array_size(suf);
    int bad = 0, checked = 0;
    if ((int)json_array_size(ids) != c.n) {
        test_fail(__FILE__, __LINE__, "%s: reference has %zu entries, corpus %d", name, json_array_size(ids), c.n);
        c.n = 0;
        bad++;
    }
    for (int i = 0; i < c.n; i++) {
        json_t *want = json_array_get(ids, (size_t)i);
        int32_t *got;
        int n;
        bool ok = true;
        if (tokenizer_encode(t, c.text[i], c.len[i], false, &got, &n, &err)) {
            fprintf(stderr, "  %s #%d: encode failed: %s\n", name, i, err.msg);
            bad++;
            continue;
        }
        if (n != (int)json_array_size(want) || !ids_equal(got, n, want, 0)) {
            int d = first_diff(got, n, want);
            fprintf(stderr, "  %s #%d \"%.40s\": %d ids vs %zu, first difference at %d (%d vs %lld)\n", name, i,
                    c.text[i], n, json_array_size(want), d, d < n ? got[d] : -1,
                    (long long)json_integer_value(json_array_get(want, (size_t)d)));
            ok = false;
        }
        // Decode references.
        json_t *jdec = json_array_get(dec, (size_t)i);
        const char *want_dec = json_string_value(jdec);
        size_t want_dec_len = json_string_length(jdec), got_len = 0, skip_len = 0;
        char *got_dec = NULL, *got_skip = NULL;
        int32_t *w = malloc((json_array_size(want) + 1) * sizeof *w);
        int nw = (int)json_array_size(want);
        for (int k = 0; k < nw; k++) w[k] = (int32_t)json_integer_value(json_array_get(want, (size_t)k));
        if (tokenizer_decode_n(t, w, nw, false, &got_dec, &got_len, &err) == ATOMC_OK) {
            // null reference: the decode gives back the (valid UTF-8) input itself.
            bool same = want_dec ? got_len == want_dec_len && !memcmp(got_dec, want_dec, got_len)
                                 : got_len == c.len[i] && !memcmp(got_dec, c.text[i], c.len[i]);
            if (!same) {
                fprintf(stderr, "  %s #%d: decode \"%.60s\" != \"%.60s\"\n", name, i, got_dec,
                        want_dec ? want_dec : c.text[i]);
                ok = false;
            }
            json_t *jskip = json_array_get(dec_skip, (size_t)i);
            const char *want_skip = json_string_value(jskip);
            if (tokenizer_decode_n(t, w, nw, true, &got_skip, &skip_len, &err) == ATOMC_OK) {
                const char *exp = want_skip ? want_skip : got_dec;
                size_t exp_len = want_skip ? json_string_length(jskip) : got_len;
                if (skip_len != exp_len || memcmp(got_skip, exp, exp_len)) {
                    fprintf(stderr, "  %s #%d: decode(skip) \"%.60s\" != \"%.60s\"\n", name, i, got_skip, exp);
                    ok = false;
                }
            } else {
                ok = false;
            }
        } else {
            fprintf(stderr, "  %s #%d: decode failed: %s\n", name, i, err.msg);
            ok = false;
        }
        free(got_dec);
        free(got_skip);
        free(w);
        free(got);
        // With special tokens: the template around the same ids.
        if (tokenizer_encode(t, c.text[i], c.len[i], true, &got, &n, &err) == ATOMC_OK) {
            if (n != n_pre + nw + n_suf || !ids_equal(got, n_pre, pre, 0) || !ids_equal(got, nw, want, n_pre) ||
                !ids_equal(got, n_suf, suf, n_pre + nw)) {
                fprintf(stderr, "  %s #%d: add_special_tokens ids differ\n", name, i);
                ok = false;
            }
            free(got);
        } else {
            ok = false;
        }
        if (!ok) bad++;
        checked++;
    }
    fprintf(stderr, "  %s: %d strings, %d differ\n", name, checked, bad);
    tokenizer_free(t);
    json_decref(ref);
    corpus_free(&c);
    return bad;
}

static void check_shared(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizers/%s", name);
    const char *path = test_shared_path(rel);
    if (!path) return; // skipped (a failure under ATOMC_REQUIRE_FIXTURES=1)
    int bad = check_tokenizer(name, path);
    ASSERT_EQ(bad, 0);
}

TEST(conformance_llama2) { check_shared("llama2"); }
TEST(conformance_llama3) { check_shared("llama3"); }
TEST(conformance_qwen3) { check_shared("qwen3"); }
TEST(conformance_deepseek_v3) { check_shared("deepseek_v3"); }
TEST(conformance_gpt_oss) { check_shared("gpt_oss"); }

// Synthetic tokenizer.json files exercising the components the real ones do not use.
TEST(conformance_synth_word) { ASSERT_EQ(check_tokenizer("synth_word", test_fixture("tokenizer/synth_word.json")), 0); }
TEST(conformance_synth_bytelevel) {
    ASSERT_EQ(check_tokenizer("synth_bytelevel", test_fixture("tokenizer/synth_bytelevel.json")), 0);
}
TEST(conformance_synth_meta) { ASSERT_EQ(check_tokenizer("synth_meta", test_fixture("tokenizer/synth_meta.json")), 0); }

// A small SentencePiece GGUF (fixture): merges derived from scores, byte fallback, Metaspace.
TEST(conformance_tiny_spm_gguf) { ASSERT_EQ(check_tokenizer("tiny_spm", test_fixture("tokenizer/tiny_spm.gguf")), 0); }

// Small byte-level GGUFs (fixtures) with the Qwen2 and Llama-3 split regexes chosen by tokenizer.ggml.pre.
TEST(conformance_tiny_bpe_qwen2_gguf) {
    ASSERT_EQ(check_tokenizer("tiny_bpe_qwen2", test_fixture("tokenizer/tiny_bpe_qwen2.gguf")), 0);
}
TEST(conformance_tiny_bpe_llama_bpe_gguf) {
    ASSERT_EQ(check_tokenizer("tiny_bpe_llama_bpe", test_fixture("tokenizer/tiny_bpe_llama_bpe.gguf")), 0);
}

// tokenizer.ggml.pre = "deepseek-v3" against DeepSeek-V3's own pre-tokenizer (same small vocabulary).
TEST(conformance_tiny_dsv3_gguf) { ASSERT_EQ(check_tokenizer("tiny_dsv3", test_fixture("tokenizer/tiny_dsv3.gguf")), 0); }

TEST(conformance_smollm2_gguf) {
    const char *p = test_smollm2_path();
    if (!p) return;
    ASSERT_EQ(check_tokenizer("smollm2", p), 0);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
