// Decoding: ids -> pieces -> the decoder chain of tokenizer.json (HF `decoders`), and the
// incremental detokenizer used for streaming.
//
// Each decoder maps a list of strings to a list of strings, as HF's decode_chain does; the
// final list is concatenated. Without a decoder pieces are joined with " " (HF's default).
// The raw variant (for tokenizer_token_bytes) skips start-of-text rules and UTF-8 repair.
//
// Streaming (detokenizer_step) decodes a short window of ids twice, without and with the new
// ids, and emits the difference once it no longer ends in U+FFFD (an incomplete character);
// the window then slides. Because both decodes start at the same token, start-of-text rules
// (Strip, Metaspace) apply equally to both, and at the true start they are the full decode's.
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

static const char REPLACEMENT_CHAR[] = "\xEF\xBF\xBD";

// ByteLevel: each piece whose chars are all byte chars becomes those bytes, others stay as they
// are; everything is concatenated into one piece (lossy UTF-8 unless raw).
static void dec_byte_level(const struct tokenizer *t, struct tok_pieces *in, struct tok_pieces *out, bool raw) {
    struct tok_buf bytes = {0};
    for (int i = 0; i < in->n; i++) {
        const char *s = in->text.p + in->v[i].off;
        size_t n = in->v[i].len, start = bytes.len;
        bool all = true;
        for (size_t k = 0; k < n && all;) {
            int32_t cp;
            int l = tok_utf8_decode(s + k, n - k, &cp);
            if (cp < 512 && t->char_byte[cp] >= 0 && tok_utf8_valid_len((const unsigned char *)s + k, n - k)) {
                tok_buf_putc(&bytes, (char)t->char_byte[cp]);
            } else {
                all = false;
            }
            k += (size_t)l;
        }
        if (!all) {
            bytes.len = start;
            tok_buf_append(&bytes, s, n);
        }
    }
    if (raw) {
        tok_pieces_push(out, bytes.p ? bytes.p : "", bytes.len, -1, false);
    } else {
        struct tok_buf clean = {0};
        tok_utf8_append_lossy(&clean, bytes.p ? bytes.p : "", bytes.len);
        tok_pieces_push(out, clean.p ? clean.p : "", clean.len, -1, false);
        if (clean.failed) out->failed = true;
        tok_buf_free(&clean);
    }
    if (bytes.failed) out->failed = true;
    tok_buf_free(&bytes);
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

// "<0xXX>" -> the byte, else -1.
static int byte_token_value(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    int hi = hex_value(s[3]), lo = hex_value(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static void flush_bytes(struct tok_buf *run, struct tok_pieces *out, bool raw) {
    if (!run->len) return;
    if (raw || tok_utf8_is_valid(run->p, run->len)) {
        tok_pieces_push(out, run->p, run->len, -1, false);
    } else {
        for (size_t i = 0; i < run->len; i++) tok_pieces_push(out, REPLACEMENT_CHAR, 3, -1, false);
    }
    run->len = 0;
}

static void dec_byte_fallback(struct tok_pieces *in, struct tok_pieces *out, bool raw) {
    struct tok_buf run = {0};
    for (int i = 0; i < in->n; i++) {
        const char *s = in->text.p + in->v[i].off;
        int b = byte_token_value(s, in->v[i].len);
        if (b >= 0) {
            tok_buf_putc(&run, (char)b);
            continue;
        }
        flush_bytes(&run, out, raw);
        tok_pieces_push(out, s, in->v[i].len, -1, false);
    }
    flush_bytes(&run, out, raw);
    if (run.failed) out->failed = true;
    tok_buf_free(&run);
}

static void dec_strip(const struct tok_decoder *d, struct tok_pieces *in, struct tok_pieces *out) {
    for (int i = 0; i < in->n; i++) {
        const char *s = in->text.p + in->v[i].off;
        size_t a = 0, b = in->v[i].len, cl = d->content_len;
        for (int k = 0; k < d->start && b - a >= cl && !memcmp(s + a, d->content, cl); k++) a += cl;
        for (int k = 0; k < d->stop && b - a >= cl && !memcmp(s + b - cl, d->content, cl); k++) b -= cl;
        tok_pieces_push(out, s + a, b - a, -1, false);
    }
}

static void replace_in(const char *s, size_t n, const char *pat, size_t plen, const char *rep, size_t rlen,
                       bool drop, struct tok_buf *out) {
    size_t i = 0, run = 0;
    while (i + plen <= n) {
        if (!memcmp(s + i, pat, plen)) {
            tok_buf_append(out, s + run, i - run);
            if (!drop) tok_buf_append(out, rep, rlen);
            i += plen;
            run = i;
        } else {
            i++;
        }
    }
    tok_buf_append(out, s + run, n - run);
}

static void decode_chain(const struct tokenizer *t, struct tok_pieces *tokens, struct tok_buf *result, bool raw) {
    if (!t->has_decoder) {
        for (int i = 0; i < tokens->n; i++) {
            if (i) tok_buf_putc(result, ' ');
            tok_buf_append(result, tokens->text.p + tokens->v[i].off, tokens->v[i].len);
        }
        return;
    }
    struct tok_pieces other = {0}, other2 = {0};
    struct tok_pieces *in = tokens, *out = &other;
    struct tok_buf tmp = {0};
    for (int k = 0; k < t->n_decoders && !in->failed; k++) {
        const struct tok_decoder *d = &t->decoders[k];
        tok_pieces_clear(out);
        switch (d->type) {
        case TOK_DEC_BYTE_LEVEL: dec_byte_level(t, in, out, raw); break;
        case TOK_DEC_BYTE_FALLBACK: dec_byte_fallback(in, out, raw); break;
        case TOK_DEC_FUSE:
            tmp.len = 0;
            for (int i = 0; i < in->n; i++) tok_buf_append(&tmp, in->text.p + in->v[i].off, in->v[i].len);
            tok_pieces_push(out, tmp.p ? tmp.p : "", tmp.len, -1, false);
            break;
        case TOK_DEC_STRIP:
            if (raw) {
                for (int i = 0; i < in->n; i++) tok_pieces_push(out, in->text.p + in->v[i].off, in->v[i].len, -1, false);
            } else {
                dec_strip(d, in, out);
            }
            break;
        case TOK_DEC_REPLACE:
        case TOK_DEC_METASPACE:
            for (int i = 0; i < in->n; i++) {
                tmp.len = 0;
                const char *s = in->text.p + in->v[i].off;
                if (d->type == TOK_DEC_REPLACE) {
                    replace_in(s, in->v[i].len, d->pattern, d->pattern_len, d->content, d->content_len, false, &tmp);
                } else {
                    bool drop = !raw && i == 0 && d->prepend_scheme != TOK_PREPEND_NEVER;
                    replace_in(s, in->v[i].len, d->replacement, d->replacement_len, " ", 1, drop, &tmp);
                }
                tok_pieces_push(out, tmp.p ? tmp.p : "", tmp.len, -1, false);
            }
            break;
        }
        if (tmp.failed) out->failed = true;
        // The caller's list is only read; after the first stage we ping-pong between our own two.
        in = out;
        out = in == &other ? &other2 : &other;
    }
    for (int i = 0; i < in->n; i++) tok_buf_append(result, in->text.p + in->v[i].off, in->v[i].len);
    if (in->failed) result->failed = true;
    tok_buf_free(&tmp);
    tok_pieces_free(&other);
    tok_pieces_free(&other2);
}

void tokenizer_decode_pieces(const struct tokenizer *t, struct tok_pieces *tokens, struct tok_buf *out) {
    decode_chain(t, tokens, out, false);
}

void tokenizer_decode_raw(const struct tokenizer *t, struct tok_pieces *tokens, struct tok_buf *out) {
    decode_chain(t, tokens, out, true);
}

// Decodes ids[0..n) into out (appending). Returns the index of the first invalid id, or -1.
static int decode_ids(const struct tokenizer *t, const int32_t *ids, int n, bool skip_special, struct tok_buf *out) {
    struct tok_pieces pieces = {0};
    for (int i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->vocab_size || !t->piece[id]) {
            tok_pieces_free(&pieces);
            return i;
        }
        if (skip_special && (t->flags[id] & TOK_FLAG_SPECIAL)) continue;
        tok_pieces_push(&pieces, t->piece[id], t->piece_len[id], id, false);
    }
    if (pieces.failed) out->failed = true;
    else decode_chain(t, &pieces, out, false);
    tok_pieces_free(&pieces);
    return -1;
}

atomc_status tokenizer_decode(const struct tokenizer *t, const int32_t *ids, int n_ids, bool skip_special_tokens,
                              char **out, struct error *err) {
    return tokenizer_decode_n(t, ids, n_ids, skip_special_tokens, out, NULL, err);
}

atomc_status tokenizer_decode_n(const struct tokenizer *t, const int32_t *ids, int n_ids, bool skip_special_tokens,
                                char **out, size_t *out_len, struct error *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (n_ids < 0 || (!ids && n_ids)) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tokenizer_decode: bad id array");
    struct tok_buf buf = {0};
    int bad = decode_ids(t, ids, n_ids, skip_special_tokens, &buf);
    if (bad >= 0) {
        tok_buf_free(&buf);
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tokenizer_decode: id %d at position %d is not in the vocabulary (size %d)",
                         ids[bad], bad, t->vocab_size);
    }
    tok_buf_putc(&buf, '\0');
    if (buf.failed) {
        tok_buf_free(&buf);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer_decode: out of memory");
    }
    *out = buf.p;
    if (out_len) *out_len = buf.len - 1;
    return ATOMC_OK;
}

// ---- incremental detokenizer
void detokenizer_init(struct detokenizer *d, const struct tokenizer *t, bool skip_special_tokens) {
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->skip_special_tokens = skip_special_tokens;
}

void detokenizer_free(struct detokenizer *d) {
    free(d->pending);
    d->pending = NULL;
    d->pending_len = d->pending_cap = 0;
}

static bool ends_incomplete(const char *s, size_t n) {
    return n >= 3 && !memcmp(s + n - 3, REPLACEMENT_CHAR, 3);
}

atomc_status detokenizer_step(struct detokenizer *d, const int32_t *ids, int n_ids, int n_new, bool final,
                              char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (n_ids < 0 || n_new < 0 || n_new > n_ids || n_ids < d->read_offset || (!ids && n_ids))
        return ATOMC_ERR_INVALID_ARGUMENT;
    const struct tokenizer *t = d->tok;
    // The window's text without the unread ids (kept in d->pending from the last emission).
    struct tok_buf prefix = {.p = d->pending, .len = d->pending_len, .cap = d->pending_cap};
    struct tok_buf full = {0};
    int bad = decode_ids(t, ids + d->prefix_offset, n_ids - d->prefix_offset, d->skip_special_tokens, &full);
    if (bad >= 0) {
        tok_buf_free(&full);
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    if (full.failed) {
        tok_buf_free(&full);
        return ATOMC_ERR_OUT_OF_MEMORY;
    }
    size_t common = 0;
    while (common < prefix.len && common < full.len && prefix.p[common] == full.p[common]) common++;
    bool extends = common == prefix.len;  // the window's text grew at its end only
    bool ready = full.len > prefix.len && extends && !ends_incomplete(full.p, full.len);
    atomc_status st = ATOMC_OK;
    if (ready || final) {
        // At the final flush a window whose text changed before its end (never seen with the
        // supported decoders) emits from the first differing byte, so nothing is dropped.
        size_t from = extends ? prefix.len : common;
        size_t n = full.len > from ? full.len - from : 0;
        char *delta = malloc(n + 1);
        if (!delta) {
            tok_buf_free(&full);
            return ATOMC_ERR_OUT_OF_MEMORY;
        }
        if (n) memcpy(delta, full.p + from, n);
        delta[n] = '\0';
        *out = delta;
        *out_len = n;
        // Slide: the new window starts where the unread ids began.
        struct tok_buf next = {0};
        int bad2 = decode_ids(t, ids + d->read_offset, n_ids - d->read_offset, d->skip_special_tokens, &next);
        if (bad2 >= 0 || next.failed) {
            tok_buf_free(&next);
            st = ATOMC_ERR_OUT_OF_MEMORY;
        } else {
            free(d->pending);
            d->pending = next.p;
            d->pending_len = next.len;
            d->pending_cap = next.cap;
            d->prefix_offset = d->read_offset;
            d->read_offset = n_ids;
        }
    }
    tok_buf_free(&full);
    return st;
}
