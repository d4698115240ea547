// Tokenizers from GGUF metadata (tokenizer.ggml.*), built into the same pipeline as tokenizer.json.
//
// tokenizer.ggml.model:
//   "gpt2"  byte-level BPE: tokens (re-spelled in the GPT-2 byte alphabet when a file stores them
//           as plain text), merges "a b"; pre-tokenizer chosen by tokenizer.ggml.pre:
//             llama3 / llama-v3 / llama-bpe / falcon3 / dbrx / smaug-bpe -> the Llama-3 split regex
//             qwen2 / deepseek-r1-qwen                                  -> Llama-3's with single digits
//             deepseek-v3                                               -> DeepSeek-V3's three splits
//             gpt-4o / llama4                                           -> the o200k split regex
//             anything else (default, gpt2, smollm, ...)                -> GPT-2's ByteLevel regex
//           then ByteLevel; decoder ByteLevel.
//   "llama" SentencePiece-style BPE with byte fallback: merges from the file, or derived from the
//           vocabulary and scores (every split of a token into two tokens, best score first, as
//           transformers' generate_merges); Metaspace (prepend "first" unless
//           tokenizer.ggml.add_space_prefix is false, no split); decoder Replace(U+2581 -> " "),
//           ByteFallback, Fuse, Strip(1 leading space).
// Token types: CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, both
// matched by their text as stored (transformers skips byte-level ones not spelled in the byte
// alphabet, e.g. DeepSeek's <\uff5cbegin\u2581of\u2581sentence\uff5c>; we keep them, as llama.cpp does);
// bos/eos/unk/padding ids are special too.
// add_bos_token (default: true for "llama", false otherwise) / add_eos_token give the template.
// A token string that is not valid UTF-8 is refused, naming the token: transformers' GGUF loader
// decodes every string strictly (bytes.decode("utf-8") raises), and gguf-py's writer can only
// store str, so such a file is damaged (llama.cpp would load it and turn each bad byte into
// U+FFFD only where it reads code points, a vocabulary that no longer round-trips).
// This mirrors transformers' GGUF tokenizer conversion, the reference of the conformance test.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/gguf.h"
#include "tokenizer/tokenizer_internal.h"

enum { GGUF_TOKEN_NORMAL = 1, GGUF_TOKEN_UNKNOWN = 2, GGUF_TOKEN_CONTROL = 3, GGUF_TOKEN_USER_DEFINED = 4 };

const char tokenizer_llama3_pattern[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
                                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_SPLIT[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                                  "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char O200K_SPLIT[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char DSV3_SPLIT_1[] = "\\p{N}{1,3}";
static const char DSV3_SPLIT_2[] = "[\\x{4e00}-\\x{9fa5}\\x{3040}-\\x{309f}\\x{30a0}-\\x{30ff}]+";
static const char DSV3_SPLIT_3[] = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                                   "|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*"
                                   "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct gguf_builder {
    struct tokenizer *t;
    const struct gguf_file *g;
    struct error *err;
};

static atomc_status gbad(struct gguf_builder *B, atomc_status st, const char *what) {
    return error_set(B->err, st, "tokenizer: %s: %s", B->g->path ? B->g->path : "gguf", what);
}

static atomc_status push_pretok(struct gguf_builder *B, enum tok_pretok_type type, const char *regex) {
    atomc_status st = tokenizer_push_pretok(B->t, type, regex, B->err);
    return st == ATOMC_ERR_OUT_OF_MEMORY ? gbad(B, st, "pre-tokenizers") : st;
}

static struct tok_decoder *push_decoder(struct gguf_builder *B, enum tok_decoder_type type) {
    return tokenizer_push_decoder(B->t, type);
}

static atomc_status setup_byte_level(struct gguf_builder *B, const char *pre) {
    const char *split = NULL;
    static const char *const llama3[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", NULL};
    static const char *const qwen2[] = {"qwen2", "deepseek-r1-qwen", NULL};
    for (int i = 0; pre && llama3[i]; i++)
        if (!strcmp(pre, llama3[i])) split = tokenizer_llama3_pattern;
    for (int i = 0; pre && qwen2[i]; i++)
        if (!strcmp(pre, qwen2[i])) split = QWEN2_SPLIT;
    if (pre && (!strcmp(pre, "gpt-4o") || !strcmp(pre, "llama4"))) split = O200K_SPLIT;
    atomc_status st = ATOMC_OK;
    if (pre && !strcmp(pre, "deepseek-v3")) {
        st = push_pretok(B, TOK_PRETOK_SPLIT, DSV3_SPLIT_1);
        if (!st) st = push_pretok(B, TOK_PRETOK_SPLIT, DSV3_SPLIT_2);
        if (!st) st = push_pretok(B, TOK_PRETOK_SPLIT, DSV3_SPLIT_3);
        if (!st) st = push_pretok(B, TOK_PRETOK_BYTE_LEVEL, NULL);
    } else if (split) {
        st = push_pretok(B, TOK_PRETOK_SPLIT, split);
        if (!st) st = push_pretok(B, TOK_PRETOK_BYTE_LEVEL, NULL);
    } else {
        st = push_pretok(B, TOK_PRETOK_BYTE_LEVEL, tokenizer_gpt2_pattern);
    }
    if (st) return st;
    if (!push_decoder(B, TOK_DEC_BYTE_LEVEL)) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "decoders");
    return ATOMC_OK;
}

static atomc_status setup_sentencepiece(struct gguf_builder *B, bool add_space_prefix) {
    atomc_status st = push_pretok(B, TOK_PRETOK_METASPACE, NULL);
    if (st) return st;
    struct tok_pretok *p = &B->t->pretoks[B->t->n_pretoks - 1];
    p->prepend_scheme = add_space_prefix ? TOK_PREPEND_FIRST : TOK_PREPEND_NEVER;
    p->split = false;
    struct tok_decoder *d = push_decoder(B, TOK_DEC_REPLACE);
    if (!d) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "decoders");
    d->pattern = tokenizer_pool_strdup(B->t, "\xE2\x96\x81", 3);
    d->pattern_len = 3;
    d->content = tokenizer_pool_strdup(B->t, " ", 1);
    d->content_len = 1;
    if (!push_decoder(B, TOK_DEC_BYTE_FALLBACK) || !push_decoder(B, TOK_DEC_FUSE))
        return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "decoders");
    if (add_space_prefix) {
        d = push_decoder(B, TOK_DEC_STRIP);
        if (!d) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "decoders");
        d->content = tokenizer_pool_strdup(B->t, " ", 1);
        d->content_len = 1;
        d->start = 1;
    }
    return ATOMC_OK;
}

// Is every char of s one of the 256 byte-alphabet chars?
static bool in_byte_alphabet(const struct tokenizer *t, const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int l = tok_utf8_valid_len((const unsigned char *)s + i, n - i);
        if (!l) return false;
        int32_t cp;
        tok_utf8_decode(s + i, n - i, &cp);
        if (cp >= 512 || t->char_byte[cp] < 0) return false;
        i += (size_t)l;
    }
    return true;
}

// ---- merges derived from scores (SentencePiece vocabularies without merges)
struct derived_merge {
    float score;
    int32_t len_l, len_r;  // code points
    int32_t merged, left, right;
};

static int utf8_count(const char *s, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

static int cmp_derived(const void *pa, const void *pb) {
    const struct derived_merge *a = pa, *b = pb;
    // Best score first; then longer left, longer right; then file order (stable order of the reference).
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    if (a->len_l != b->len_l) return a->len_l > b->len_l ? -1 : 1;
    if (a->len_r != b->len_r) return a->len_r > b->len_r ? -1 : 1;
    if (a->merged != b->merged) return a->merged < b->merged ? -1 : 1;
    if (a->left != b->left) return a->left < b->left ? -1 : 1;
    return (a->right > b->right) - (a->right < b->right);
}

static atomc_status derive_merges(struct gguf_builder *B, const float *scores, int n_vocab) {
    struct tokenizer *t = B->t;
    size_t n = 0, cap = 1024;
    struct derived_merge *m = malloc(cap * sizeof *m);
    if (!m) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "merges");
    for (int id = 0; id < n_vocab; id++) {
        const char *s = t->piece[id];
        size_t len = t->piece_len[id];
        if (!s) continue;
        // The reference walks a {token: score} dict: a duplicated token string counts once, at its last id.
        if (tok_strmap_get(&t->vocab, s, len) != id) continue;
        for (size_t k = 1; k < len; k++) {
            if (((unsigned char)s[k] & 0xC0) == 0x80) continue;
            int32_t l = tok_strmap_get(&t->vocab, s, k), r = tok_strmap_get(&t->vocab, s + k, len - k);
            if (l < 0 || r < 0) continue;
            if (n == cap) {
                cap *= 2;
                struct derived_merge *m2 = realloc(m, cap * sizeof *m2);
                if (!m2) {
                    free(m);
                    return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "merges");
                }
                m = m2;
            }
            m[n++] = (struct derived_merge){scores[id], utf8_count(s, k), utf8_count(s + k, len - k), id, l, r};
        }
    }
    qsort(m, n, sizeof *m, cmp_derived);
    atomc_status st = tok_mergemap_init(&t->merges, n, B->err);
    for (size_t i = 0; !st && i < n; i++) tok_mergemap_put(&t->merges, m[i].left, m[i].right, (int32_t)i, m[i].merged);
    free(m);
    return st;
}

static atomc_status file_merges(struct gguf_builder *B, const struct gguf_value *mv) {
    struct tokenizer *t = B->t;
    atomc_status st = tok_mergemap_init(&t->merges, mv->arr_len, B->err);
    if (st) return st;
    struct tok_buf joined = {0};
    for (uint64_t i = 0; i < mv->arr_len; i++) {
        const char *s;
        size_t len;
        if (!gguf_value_arr_str(mv, i, &s, &len)) {
            tok_buf_free(&joined);
            return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.merges is not an array of strings");
        }
        const char *sp = memchr(s, ' ', len);
        if (!sp) {
            tok_buf_free(&joined);
            return gbad(B, ATOMC_ERR_FORMAT, "a merge in tokenizer.ggml.merges is not \"left right\"");
        }
        size_t alen = (size_t)(sp - s), blen = len - alen - 1;
        joined.len = 0;
        tok_buf_append(&joined, s, alen);
        tok_buf_append(&joined, sp + 1, blen);
        int32_t a = tok_strmap_get(&t->vocab, s, alen), b = tok_strmap_get(&t->vocab, sp + 1, blen);
        int32_t c = joined.failed ? -1 : tok_strmap_get(&t->vocab, joined.p, joined.len);
        if (a < 0 || b < 0 || c < 0) {
            error_set(B->err, ATOMC_ERR_FORMAT, "tokenizer: %s: merge %llu (\"%.*s\") uses a token not in the vocab",
                      B->g->path ? B->g->path : "gguf", (unsigned long long)i, (int)len, s);
            tok_buf_free(&joined);
            return ATOMC_ERR_FORMAT;
        }
        tok_mergemap_put(&t->merges, a, b, (int32_t)i, c);
    }
    tok_buf_free(&joined);
    return ATOMC_OK;
}

static int32_t opt_id(const struct gguf_file *g, const char *key, int n_vocab) {
    uint32_t v;
    if (!gguf_has_key(g, key) || gguf_get_u32(g, key, &v, NULL) != ATOMC_OK || v >= (uint32_t)n_vocab) return -1;
    return (int32_t)v;
}

static bool opt_bool(const struct gguf_file *g, const char *key, bool dflt) {
    bool v;
    if (!gguf_has_key(g, key) || gguf_get_bool(g, key, &v, NULL) != ATOMC_OK) return dflt;
    return v;
}

static atomc_status build(struct gguf_builder *B) {
    const struct gguf_file *g = B->g;
    struct tokenizer *t = B->t;
    const char *model;
    size_t model_len;
    atomc_status st = gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len, B->err);
    if (st) return st;
    bool byte_level = !strcmp(model, "gpt2"), spm = !strcmp(model, "llama");
    if (!byte_level && !spm) {
        char msg[160];
        snprintf(msg, sizeof msg, "tokenizer.ggml.model \"%.60s\" is not supported (gpt2, llama)", model);
        return gbad(B, ATOMC_ERR_UNSUPPORTED, msg);
    }
    const struct gguf_value *tv = gguf_get_value(g, "tokenizer.ggml.tokens");
    if (!tv || tv->type != GGUF_TYPE_ARRAY || tv->arr_type != GGUF_TYPE_STRING || !tv->arr_len)
        return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.tokens is missing or not a string array");
    if (tv->arr_len >= (1u << 24)) return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.tokens is too long");
    int n_vocab = (int)tv->arr_len;
    const struct gguf_value *typ = gguf_get_value(g, "tokenizer.ggml.token_type");
    if (typ && (typ->type != GGUF_TYPE_ARRAY || typ->arr_len != tv->arr_len))
        return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.token_type does not match tokenizer.ggml.tokens");
    st = tokenizer_reserve_ids(t, n_vocab, B->err);
    if (!st) st = tok_strmap_init(&t->vocab, (size_t)n_vocab, B->err);
    if (st) return st;
    tokenizer_init_byte_tables(t);
    struct tok_buf spelled = {0};
    for (int id = 0; id < n_vocab; id++) {
        const char *s;
        size_t len;
        if (!gguf_value_arr_str(tv, (uint64_t)id, &s, &len)) return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.tokens");
        if (!tok_utf8_is_valid(s, len)) {
            size_t at = 0;
            while (at < len &&
                   ((unsigned char)s[at] < 0x80 || tok_utf8_valid_len((const unsigned char *)s + at, len - at) > 0))
                at += (unsigned char)s[at] < 0x80 ? 1
                                                  : (size_t)tok_utf8_valid_len((const unsigned char *)s + at, len - at);
            char msg[200];
            snprintf(msg, sizeof msg,
                     "tokenizer.ggml.tokens[%d] is not valid UTF-8 (byte 0x%02x at offset %zu of %zu); transformers "
                     "refuses such a file too",
                     id, (unsigned char)s[at < len ? at : 0], at, len);
            tok_buf_free(&spelled);
            return gbad(B, ATOMC_ERR_FORMAT, msg);
        }
        if (byte_level && !in_byte_alphabet(t, s, len)) {
            spelled.len = 0;
            for (size_t k = 0; k < len; k++) tok_buf_append(&spelled, t->byte_char[(unsigned char)s[k]], t->byte_char_len[(unsigned char)s[k]]);
            if (spelled.failed) break;
            s = spelled.p;
            len = spelled.len;
        }
        char *p = tokenizer_pool_strdup(t, s, len);
        if (!p) {
            spelled.failed = true;
            break;
        }
        t->piece[id] = p;
        t->piece_len[id] = (uint32_t)len;
        tok_strmap_put(&t->vocab, p, len, id);
    }
    bool failed = spelled.failed;
    tok_buf_free(&spelled);
    if (failed) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "vocabulary");

    const struct gguf_value *mv = gguf_get_value(g, "tokenizer.ggml.merges");
    if (mv && (mv->type != GGUF_TYPE_ARRAY || mv->arr_type != GGUF_TYPE_STRING))
        return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.merges is not a string array");
    if (mv) {
        st = file_merges(B, mv);
    } else if (spm) {
        const struct gguf_value *sv = gguf_get_value(g, "tokenizer.ggml.scores");
        if (!sv || sv->type != GGUF_TYPE_ARRAY || sv->arr_len != tv->arr_len)
            return gbad(B, ATOMC_ERR_FORMAT, "SentencePiece vocabulary without merges needs tokenizer.ggml.scores");
        float *scores = malloc((size_t)n_vocab * sizeof *scores);
        if (!scores) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "scores");
        for (int i = 0; i < n_vocab; i++) {
            double d;
            if (!gguf_value_arr_f64(sv, (uint64_t)i, &d)) {
                free(scores);
                return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.scores is not numeric");
            }
            scores[i] = (float)d;
        }
        st = derive_merges(B, scores, n_vocab);
        free(scores);
    } else {
        return gbad(B, ATOMC_ERR_FORMAT, "byte-level vocabulary without tokenizer.ggml.merges");
    }
    if (st) return st;

    int32_t bos = opt_id(g, "tokenizer.ggml.bos_token_id", n_vocab), eos = opt_id(g, "tokenizer.ggml.eos_token_id", n_vocab);
    int32_t unk = opt_id(g, "tokenizer.ggml.unknown_token_id", n_vocab), pad = opt_id(g, "tokenizer.ggml.padding_token_id", n_vocab);
    if (spm) {
        t->byte_fallback = true;
        t->fuse_unk = true;
        t->unk_id = unk >= 0 ? unk : tok_strmap_get(&t->vocab, "<unk>", 5);
        st = setup_sentencepiece(B, opt_bool(g, "tokenizer.ggml.add_space_prefix", true));
    } else {
        const char *pre = NULL;
        size_t pre_len;
        if (gguf_has_key(g, "tokenizer.ggml.pre") && gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len, NULL)) pre = NULL;
        st = setup_byte_level(B, pre);
    }
    if (st) return st;

    // Added tokens: control -> special, user-defined -> plain; then bos/eos/unk/pad as special.
    for (int id = 0; id < n_vocab && typ; id++) {
        int64_t ty;
        if (!gguf_value_arr_i64(typ, (uint64_t)id, &ty)) return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.token_type");
        if (ty == GGUF_TOKEN_CONTROL || ty == GGUF_TOKEN_USER_DEFINED) {
            // Added tokens match their text as written in the file. A byte-level file may store them
            // as plain text (DeepSeek's "<\xEF\xBD\x9Cbegin\xE2\x96\x81of...>"): use the original, as
            // llama.cpp does (transformers' conversion drops such tokens).
            const char *orig;
            size_t olen;
            if (!gguf_value_arr_str(tv, (uint64_t)id, &orig, &olen)) return gbad(B, ATOMC_ERR_FORMAT, "tokenizer.ggml.tokens");
            if (!olen) continue;
            st = tokenizer_add_token(t, id, orig, olen, ty == GGUF_TOKEN_CONTROL, false, false, false, false, B->err);
        }
        if (st) return st;
    }
    int32_t specials[4] = {bos, eos, unk, pad};
    for (int k = 0; k < 4; k++) {
        int32_t id = specials[k];
        if (id < 0 || (t->flags[id] & TOK_FLAG_ADDED) || !t->piece_len[id]) continue;
        if (byte_level && !in_byte_alphabet(t, t->piece[id], t->piece_len[id])) continue;
        st = tokenizer_add_token(t, id, t->piece[id], t->piece_len[id], true, false, false, false, false, B->err);
        if (st) return st;
    }

    t->bos_id = bos;
    t->eos_id = eos;
    if (bos >= 0) t->bos_text = (char *)t->piece[bos];
    if (eos >= 0) t->eos_text = (char *)t->piece[eos];
    bool add_bos = opt_bool(g, "tokenizer.ggml.add_bos_token", spm), add_eos = opt_bool(g, "tokenizer.ggml.add_eos_token", false);
    int32_t tmpl[3];
    int n_tmpl = 0;
    if (add_bos && bos >= 0) tmpl[n_tmpl++] = bos;
    tmpl[n_tmpl++] = -1;
    if (add_eos && eos >= 0) tmpl[n_tmpl++] = eos;
    t->tmpl = malloc(sizeof tmpl);
    if (!t->tmpl) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "template");
    memcpy(t->tmpl, tmpl, (size_t)n_tmpl * sizeof *tmpl);
    t->n_tmpl = n_tmpl;

    const char *ct;
    size_t ct_len;
    if (gguf_has_key(g, "tokenizer.chat_template") && !gguf_get_str(g, "tokenizer.chat_template", &ct, &ct_len, NULL)) {
        t->chat_template = tokenizer_pool_strdup(t, ct, ct_len);
        if (!t->chat_template) return gbad(B, ATOMC_ERR_OUT_OF_MEMORY, "chat template");
    }
    return tokenizer_finish(t, B->err);
}

atomc_status tokenizer_load_gguf(const struct gguf_file *g, struct tokenizer **out, struct error *err) {
    *out = NULL;
    struct tokenizer *t = tokenizer_alloc();
    if (!t) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer");
    struct gguf_builder B = {.t = t, .g = g, .err = err};
    atomc_status st = build(&B);
    if (st) {
        tokenizer_free(t);
        return st;
    }
    *out = t;
    return ATOMC_OK;
}

atomc_status tokenizer_load_gguf_path(const char *path, struct tokenizer **out, struct error *err) {
    *out = NULL;
    struct gguf_file *g;
    atomc_status st = gguf_open(&g, path, err);
    if (st) return st;
    st = tokenizer_load_gguf(g, out, err);
    gguf_close(g);
    return st;
}
