// Issue 28 item 9: a GGUF vocabulary whose token strings are not valid UTF-8. transformers'
// GGUF loader decodes every string strictly (bytes.decode("utf-8") raises UnicodeDecodeError,
// integrations/ggml.py _gguf_parse_value), so such a file does not load there; atomc refuses it
// the same way, with a message naming the token, for both tokenizer models ("gpt2" byte-level
// BPE, which before the fix re-spelled the raw bytes silently, and "llama" SentencePiece, which
// took them into its vocabulary as they were). The same vocabulary with valid strings loads.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "loader/gguf.h"
#include "test.h"
#include "tokenizer/tokenizer.h"

struct wbuf {
    unsigned char b[4096];
    size_t n;
};

static void put(struct wbuf *w, const void *p, size_t len) {
    CHECK(w->n + len <= sizeof w->b);
    memcpy(w->b + w->n, p, len);
    w->n += len;
}
static void put_u32(struct wbuf *w, uint32_t v) {
    put(w, &v, 4);
}
static void put_u64(struct wbuf *w, uint64_t v) {
    put(w, &v, 8);
}
static void put_str(struct wbuf *w, const char *s, size_t len) {
    put_u64(w, len);
    put(w, s, len);
}

// A tokenizer-only GGUF: tokenizer.ggml.model = model, tokens (with their lengths), and the
// scores ("llama", which then derives its merges) or the one merge "a b" ("gpt2").
static void make_gguf(struct wbuf *w, const char *model, const char *const *toks, const size_t *lens, int n) {
    w->n = 0;
    put(w, "GGUF", 4);
    put_u32(w, 3);
    put_u64(w, 0); // tensors
    put_u64(w, 4); // kv pairs
    put_str(w, "general.architecture", 20);
    put_u32(w, GGUF_TYPE_STRING);
    put_str(w, "llama", 5);
    put_str(w, "tokenizer.ggml.model", 20);
    put_u32(w, GGUF_TYPE_STRING);
    put_str(w, model, strlen(model));
    put_str(w, "tokenizer.ggml.tokens", 21);
    put_u32(w, GGUF_TYPE_ARRAY);
    put_u32(w, GGUF_TYPE_STRING);
    put_u64(w, (uint64_t)n);
    for (int i = 0; i < n; i++)
        put_str(w, toks[i], lens[i]);
    if (!strcmp(model, "llama")) {
        put_str(w, "tokenizer.ggml.scores", 21);
        put_u32(w, GGUF_TYPE_ARRAY);
        put_u32(w, GGUF_TYPE_FLOAT32);
        put_u64(w, (uint64_t)n);
        for (int i = 0; i < n; i++) {
            float f = -(float)i;
            put(w, &f, 4);
        }
    } else { // byte-level BPE needs merges
        put_str(w, "tokenizer.ggml.merges", 21);
        put_u32(w, GGUF_TYPE_ARRAY);
        put_u32(w, GGUF_TYPE_STRING);
        put_u64(w, 1);
        put_str(w, "a b", 3);
    }
}

static atomc_status load(const struct wbuf *w, struct error *e) {
    struct gguf_file *g;
    atomc_status st = gguf_open_memory(&g, w->b, w->n, "vocab.gguf", e);
    if (st) return st;
    struct tokenizer *t = NULL;
    st = tokenizer_load_gguf(g, &t, e);
    tokenizer_free(t);
    gguf_close(g);
    return st;
}

TEST(gguf_token_strings_must_be_utf8) {
    const char *models[] = {"gpt2", "llama"};
    for (int m = 0; m < 2; m++) {
        const char *good[] = {"a", "b", "ab", "\xc3\xa9", "\xe4\xbd\xa0"};
        size_t glen[] = {1, 1, 2, 2, 3};
        struct wbuf w;
        struct error e = {0};
        make_gguf(&w, models[m], good, glen, 5);
        if (load(&w, &e) != ATOMC_OK)
            test_fail(__FILE__, __LINE__, "%s: valid vocabulary refused: %s", models[m], e.msg);
        // Token 3: a lone continuation byte; token 4: a truncated 3-byte sequence; token 2: an
        // overlong encoding of '/'. Each is reported by id and offset.
        const struct {
            const char *tok;
            size_t len;
            int id;
            const char *needle;
        } bad[] = {
            {"x\x80", 2, 3, "tokenizer.ggml.tokens[3] is not valid UTF-8 (byte 0x80 at offset 1 of 2)"},
            {"\xe4\xbd", 2, 4, "tokenizer.ggml.tokens[4] is not valid UTF-8 (byte 0xe4 at offset 0 of 2)"},
            {"\xc0\xaf", 2, 2, "tokenizer.ggml.tokens[2] is not valid UTF-8 (byte 0xc0 at offset 0 of 2)"},
        };
        for (int k = 0; k < 3; k++) {
            const char *toks[5];
            size_t lens[5];
            memcpy(toks, good, sizeof toks);
            memcpy(lens, glen, sizeof lens);
            toks[bad[k].id] = bad[k].tok;
            lens[bad[k].id] = bad[k].len;
            make_gguf(&w, models[m], toks, lens, 5);
            atomc_status st = load(&w, &e);
            if (st != ATOMC_ERR_FORMAT || !strstr(e.msg, bad[k].needle) || !strstr(e.msg, "vocab.gguf"))
                test_fail(__FILE__, __LINE__, "%s case %d: status %d \"%s\"", models[m], k, (int)st, e.msg);
        }
    }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
