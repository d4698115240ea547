// Encoding: the HF `tokenizers` pipeline, stage by stage, on lists of pieces.
//
//   input (invalid UTF-8 replaced by U+FFFD, as Python's bytes.decode(errors="replace"))
//   -> split out added tokens whose `normalized` is false (leftmost-longest, lstrip/rstrip/single_word)
//   -> normalizers on the remaining text pieces
//   -> split out added tokens whose `normalized` is true
//   -> pre-tokenizers (each turns every text piece into sub-pieces)
//   -> BPE on every word: chars -> ids (byte fallback / unk), then merges lowest rank first
//      (ties: leftmost), with a binary heap and a linked list of symbols, as HF's word.rs
//   -> post-processor template (add_special_tokens)
// All scratch memory belongs to the call; the tokenizer is only read.
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "tokenizer/tokenizer_internal.h"

struct ids_buf {
    int32_t *v;
    int n, cap;
    bool failed;
};

static void ids_push(struct ids_buf *b, int32_t id) {
    if (b->failed) return;
    if (b->n == b->cap) {
        int cap = b->cap ? b->cap * 2 : 64;
        int32_t *v = realloc(b->v, (size_t)cap * sizeof *v);
        if (!v) {
            b->failed = true;
            return;
        }
        b->v = v;
        b->cap = cap;
    }
    b->v[b->n++] = id;
}

struct bpe_symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
    uint32_t len;        // bytes of the word covered; 0 = merged away
};
struct bpe_merge {
    int32_t rank, pos, new_id;
    int32_t left, right;  // the pair's ids when pushed (fast validity check)
};

struct encode_ctx {
    const struct tokenizer *t;
    pcre2_match_data *md;
    struct bpe_symbol *sym;
    size_t sym_cap;
    struct bpe_merge *heap;
    size_t heap_n, heap_cap;
    struct tok_buf tmp, tmp2;
    struct ids_buf ids;
    atomc_status status;  // first error of the call
};

// ---- Unicode helpers
static bool is_white_space(int32_t c) {  // the White_Space property (Rust's char::is_whitespace)
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

static bool is_numeric(int32_t c) {  // Rust's char::is_numeric: general categories Nd, Nl, No
    if (c < 0x80) return c >= '0' && c <= '9';
    utf8proc_category_t cat = utf8proc_category(c);
    return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

static bool is_word_char(int32_t c) {  // alphanumeric or '_', as HF's single_word check
    if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    utf8proc_category_t cat = utf8proc_category(c);
    return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) || is_numeric(c);
}

static int32_t last_char(const char *s, size_t n) {
    if (!n) return -1;
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    int32_t c;
    tok_utf8_decode(s + i, n - i, &c);
    return c;
}

static bool is_ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return false;
    return true;
}

// ---- regex
// Match iteration as HF's (Oniguruma-based) find_iter: empty matches are reported, except one that
// ends where the previous match ended; the search then resumes one character later.
struct regex_iter {
    size_t last_end;
    bool have_last;
    size_t last_match_end;
};

static bool regex_next(struct encode_ctx *c, const pcre2_code *re, const char *s, size_t n, struct regex_iter *it,
                       size_t *ms, size_t *me) {
    while (it->last_end <= n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, it->last_end, PCRE2_NO_UTF_CHECK, c->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(re, (PCRE2_SPTR)s, n, it->last_end, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) return false;
        if (rc < 0) {
            if (!c->status) c->status = ATOMC_ERR_INTERNAL;
            return false;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        if (ov[1] == ov[0] && it->have_last && it->last_match_end == ov[1]) {
            size_t step = 1;  // one character (one byte past the end)
            while (it->last_end + step < n && ((unsigned char)s[it->last_end + step] & 0xC0) == 0x80) step++;
            it->last_end += step;
            continue;
        }
        it->last_end = ov[1];
        it->have_last = true;
        it->last_match_end = ov[1];
        *ms = ov[0];
        *me = ov[1];
        return true;
    }
    return false;
}

// ---- normalizers
static void replace_literal(const char *s, size_t n, const char *pat, size_t plen, const char *rep, size_t rlen,
                            struct tok_buf *out) {
    size_t i = 0, run = 0;
    while (i + plen <= n) {
        if (!memcmp(s + i, pat, plen)) {
            tok_buf_append(out, s + run, i - run);
            tok_buf_append(out, rep, rlen);
            i += plen;
            run = i;
        } else {
            i++;
        }
    }
    tok_buf_append(out, s + run, n - run);
}

static void normalize_one(struct encode_ctx *c, const struct tok_normalizer *nm, const char *s, size_t n,
                          struct tok_buf *out) {
    switch (nm->type) {
    case TOK_NORM_NFC:
    case TOK_NORM_NFD:
    case TOK_NORM_NFKC:
    case TOK_NORM_NFKD: {
        if (is_ascii(s, n)) {  // ASCII is invariant under every normalization form
            tok_buf_append(out, s, n);
            return;
        }
        int opts = UTF8PROC_STABLE;
        if (nm->type == TOK_NORM_NFC || nm->type == TOK_NORM_NFKC) opts |= UTF8PROC_COMPOSE;
        else opts |= UTF8PROC_DECOMPOSE;
        if (nm->type == TOK_NORM_NFKC || nm->type == TOK_NORM_NFKD) opts |= UTF8PROC_COMPAT;
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst, (utf8proc_option_t)opts);
        if (r < 0) {
            tok_buf_append(out, s, n);  // cannot happen on valid UTF-8; keep the text
        } else {
            tok_buf_append(out, dst, (size_t)r);
        }
        free(dst);
        return;
    }
    case TOK_NORM_PREPEND:
        if (n) tok_buf_append(out, nm->str, nm->str_len);
        tok_buf_append(out, s, n);
        return;
    case TOK_NORM_REPLACE:
        if (!nm->re) {
            replace_literal(s, n, nm->str, nm->str_len, nm->content, nm->content_len, out);
        } else {
            size_t pos = 0, ms, me;
            struct regex_iter it = {0};
            while (regex_next(c, nm->re, s, n, &it, &ms, &me)) {
                tok_buf_append(out, s + pos, ms - pos);
                tok_buf_append(out, nm->content, nm->content_len);
                pos = me;
            }
            tok_buf_append(out, s + pos, n - pos);
        }
        return;
    case TOK_NORM_LOWERCASE:
        for (size_t i = 0; i < n;) {
            int32_t cp;
            int l = tok_utf8_decode(s + i, n - i, &cp);
            char buf[4];
            int k = tok_utf8_encode(utf8proc_tolower(cp), buf);
            tok_buf_append(out, buf, (size_t)k);
            i += (size_t)l;
        }
        return;
    case TOK_NORM_STRIP: {
        size_t a = 0, b = n;
        while (nm->left && a < b) {
            int32_t cp;
            int l = tok_utf8_decode(s + a, b - a, &cp);
            if (!is_white_space(cp)) break;
            a += (size_t)l;
        }
        while (nm->right && b > a) {
            size_t i = b - 1;
            while (i > a && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
            int32_t cp;
            tok_utf8_decode(s + i, b - i, &cp);
            if (!is_white_space(cp)) break;
            b = i;
        }
        tok_buf_append(out, s + a, b - a);
        return;
    }
    }
}

static void normalize_all(struct encode_ctx *c, const char *s, size_t n, struct tok_buf *out) {
    const struct tokenizer *t = c->t;
    if (!t->n_norms) {
        tok_buf_append(out, s, n);
        return;
    }
    // Ping-pong between two scratch buffers; the last stage writes to out.
    struct tok_buf *bufs[2] = {&c->tmp, &c->tmp2};
    const char *cur = s;
    size_t cur_n = n;
    for (int i = 0; i < t->n_norms; i++) {
        struct tok_buf *dst = i == t->n_norms - 1 ? out : bufs[i & 1];
        if (dst != out) dst->len = 0;
        normalize_one(c, &t->norms[i], cur, cur_n, dst);
        if (dst->failed) return;
        cur = dst->p ? dst->p : "";
        cur_n = dst->len;
        if (dst == out) break;
    }
}

void tokenizer_normalize_text(const struct tokenizer *t, const char *s, size_t n, struct tok_buf *out) {
    struct encode_ctx c = {.t = t};
    c.md = pcre2_match_data_create(4, NULL);
    if (!c.md) {
        out->failed = true;
        return;
    }
    normalize_all(&c, s, n, out);
    pcre2_match_data_free(c.md);
    tok_buf_free(&c.tmp);
    tok_buf_free(&c.tmp2);
}

// ---- added tokens
// Splits every text piece of `in` around the added tokens of trie (HF AddedVocabulary::find_matches).
static void split_added(struct encode_ctx *c, const struct tok_trie *tr, struct tok_pieces *in, struct tok_pieces *out) {
    const struct tokenizer *t = c->t;
    for (int p = 0; p < in->n; p++) {
        const struct tok_piece *pc = &in->v[p];
        const char *s = in->text.p + pc->off;
        size_t n = pc->len;
        if (pc->id >= 0 || !tr->n) {
            tok_pieces_push(out, s, n, pc->id, pc->at_start);
            continue;
        }
        size_t start_offset = 0, i = 0;
        while (i < n) {
            // Longest added token starting at i.
            int node = 0, best = -1;
            size_t best_end = 0;
            for (size_t j = i; j < n; j++) {
                int child = tr->nodes[node].first_child;
                while (child >= 0 && tr->nodes[child].byte != (unsigned char)s[j]) child = tr->nodes[child].next_sibling;
                if (child < 0) break;
                node = child;
                if (tr->nodes[node].added >= 0) {
                    best = tr->nodes[node].added;
                    best_end = j + 1;
                }
            }
            if (best < 0) {
                i++;
                continue;
            }
            const struct tok_added *a = &t->added[best];
            size_t start = i, stop = best_end;
            if (a->single_word) {
                bool start_space = start == 0 || !is_word_char(last_char(s, start));
                int32_t next = -1;
                if (stop < n) tok_utf8_decode(s + stop, n - stop, &next);
                bool stop_space = stop == n || !is_word_char(next);
                if (!start_space || !stop_space) {
                    i = best_end;
                    continue;
                }
            }
            if (a->lstrip) {
                size_t ns = start;
                while (ns > 0) {
                    size_t k = ns - 1;
                    while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
                    int32_t cp;
                    tok_utf8_decode(s + k, ns - k, &cp);
                    if (!is_white_space(cp)) break;
                    ns = k;
                }
                start = ns > start_offset ? ns : start_offset;
            }
            if (a->rstrip) {
                while (stop < n) {
                    int32_t cp;
                    int l = tok_utf8_decode(s + stop, n - stop, &cp);
                    if (!is_white_space(cp)) break;
                    stop += (size_t)l;
                }
            }
            if (start_offset < start) tok_pieces_push(out, s + start_offset, start - start_offset, -1, pc->at_start && start_offset == 0);
            tok_pieces_push(out, s + start, stop - start, a->id, false);
            start_offset = stop;
            i = stop;
        }
        if (start_offset < n) tok_pieces_push(out, s + start_offset, n - start_offset, -1, pc->at_start && start_offset == 0);
    }
}

// ---- pre-tokenizers
// A covering of a piece by spans, each a match of the pattern or not.
struct span {
    size_t a, b;
    bool match;
};
struct spans {
    struct span *v;
    int n, cap;
    bool failed;
};
static void spans_push(struct spans *sp, size_t a, size_t b, bool match) {
    if (sp->failed) return;
    if (sp->n == sp->cap) {
        int cap = sp->cap ? sp->cap * 2 : 64;
        struct span *v = realloc(sp->v, (size_t)cap * sizeof *v);
        if (!v) {
            sp->failed = true;
            return;
        }
        sp->v = v;
        sp->cap = cap;
    }
    sp->v[sp->n++] = (struct span){a, b, match};
}

// HF NormalizedString::split: turns the covering into output pieces per behaviour.
static void emit_splits(struct spans *sp, enum tok_split_behavior behavior, bool invert, const char *s, bool at_start,
                        struct tok_pieces *out) {
    if (invert)
        for (int i = 0; i < sp->n; i++) sp->v[i].match = !sp->v[i].match;
    int n = sp->n;
    struct span *v = sp->v;
    int m = 0;  // compacted result in v[0..m)
    switch (behavior) {
    case TOK_SPLIT_ISOLATED: m = n; break;
    case TOK_SPLIT_REMOVED:
        for (int i = 0; i < n; i++)
            if (!v[i].match) v[m++] = v[i];
        break;
    case TOK_SPLIT_MERGED_WITH_PREVIOUS: {
        bool prev = false;
        for (int i = 0; i < n; i++) {
            bool cur = v[i].match;
            if (cur && !prev && m > 0) v[m - 1].b = v[i].b;
            else v[m++] = v[i];
            prev = cur;
        }
        break;
    }
    case TOK_SPLIT_MERGED_WITH_NEXT: {
        // Right to left, then the result is in reverse order in v[n-m..n).
        bool prev = false;
        int w = n;
        for (int i = n - 1; i >= 0; i--) {
            bool cur = v[i].match;
            if (cur && !prev && w < n) v[w].a = v[i].a;
            else v[--w] = v[i];
            prev = cur;
        }
        m = n - w;
        memmove(v, v + w, (size_t)m * sizeof *v);
        break;
    }
    case TOK_SPLIT_CONTIGUOUS: {
        bool prev = false;
        for (int i = 0; i < n; i++) {
            bool cur = v[i].match;
            if (cur == prev && m > 0) v[m - 1].b = v[i].b;
            else v[m++] = v[i];
            prev = cur;
        }
        break;
    }
    }
    for (int i = 0; i < m; i++)
        if (v[i].b > v[i].a) tok_pieces_push(out, s + v[i].a, v[i].b - v[i].a, -1, at_start && v[i].a == 0);
}

static void spans_regex(struct encode_ctx *c, const pcre2_code *re, const char *s, size_t n, struct spans *sp) {
    size_t pos = 0, ms, me;
    struct regex_iter it = {0};
    while (regex_next(c, re, s, n, &it, &ms, &me)) {
        if (ms > pos) spans_push(sp, pos, ms, false);
        spans_push(sp, ms, me, true);
        pos = me;
    }
    if (pos < n) spans_push(sp, pos, n, false);
}

static void spans_literal(const char *pat, size_t plen, const char *s, size_t n, struct spans *sp) {
    size_t pos = 0, i = 0;
    while (i + plen <= n) {
        if (!memcmp(s + i, pat, plen)) {
            if (i > pos) spans_push(sp, pos, i, false);
            spans_push(sp, i, i + plen, true);
            i += plen;
            pos = i;
        } else {
            i++;
        }
    }
    if (pos < n) spans_push(sp, pos, n, false);
}

// Every char satisfying pred is its own match; runs of other chars are non-matches.
static void spans_chars(bool (*pred)(int32_t), const char *s, size_t n, struct spans *sp) {
    size_t pos = 0, i = 0;
    while (i < n) {
        int32_t cp;
        int l = tok_utf8_decode(s + i, n - i, &cp);
        if (pred(cp)) {
            if (i > pos) spans_push(sp, pos, i, false);
            spans_push(sp, i, i + (size_t)l, true);
            pos = i + (size_t)l;
        }
        i += (size_t)l;
    }
    if (pos < n) spans_push(sp, pos, n, false);
}

static void byte_level_map(const struct tokenizer *t, const char *s, size_t n, struct tok_buf *out) {
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        tok_buf_append(out, t->byte_char[b], t->byte_char_len[b]);
    }
}

static void pretok_apply(struct encode_ctx *c, const struct tok_pretok *pt, struct tok_pieces *in, struct tok_pieces *out) {
    const struct tokenizer *t = c->t;
    struct spans sp = {0};
    for (int p = 0; p < in->n && !out->failed; p++) {
        const struct tok_piece *pc = &in->v[p];
        const char *s = in->text.p + pc->off;
        size_t n = pc->len;
        if (pc->id >= 0) {
            tok_pieces_push(out, s, n, pc->id, pc->at_start);
            continue;
        }
        sp.n = 0;
        switch (pt->type) {
        case TOK_PRETOK_SPLIT:
            if (pt->re) spans_regex(c, pt->re, s, n, &sp);
            else spans_literal(pt->literal, pt->literal_len, s, n, &sp);
            emit_splits(&sp, pt->behavior, pt->invert, s, pc->at_start, out);
            break;
        case TOK_PRETOK_DIGITS:
            spans_chars(is_numeric, s, n, &sp);
            emit_splits(&sp, pt->individual_digits ? TOK_SPLIT_ISOLATED : TOK_SPLIT_CONTIGUOUS, false, s, pc->at_start, out);
            break;
        case TOK_PRETOK_WHITESPACE_SPLIT:
            spans_chars(is_white_space, s, n, &sp);
            emit_splits(&sp, TOK_SPLIT_REMOVED, false, s, pc->at_start, out);
            break;
        case TOK_PRETOK_BYTE_LEVEL: {
            c->tmp.len = 0;
            if (pt->add_prefix_space && (n == 0 || s[0] != ' ')) tok_buf_putc(&c->tmp, ' ');
            tok_buf_append(&c->tmp, s, n);
            if (c->tmp.failed) break;
            const char *w = c->tmp.p;
            size_t wn = c->tmp.len;
            if (pt->use_regex) spans_regex(c, pt->re, w, wn, &sp);
            else if (wn) spans_push(&sp, 0, wn, false);
            for (int i = 0; i < sp.n; i++) {
                c->tmp2.len = 0;
                byte_level_map(t, w + sp.v[i].a, sp.v[i].b - sp.v[i].a, &c->tmp2);
                if (c->tmp2.failed) break;
                tok_pieces_push(out, c->tmp2.p, c->tmp2.len, -1, pc->at_start && sp.v[i].a == 0);
            }
            break;
        }
        case TOK_PRETOK_METASPACE: {
            c->tmp.len = 0;
            replace_literal(s, n, " ", 1, pt->replacement, pt->replacement_len, &c->tmp);
            c->tmp2.len = 0;
            bool starts = c->tmp.len >= pt->replacement_len && !memcmp(c->tmp.p, pt->replacement, pt->replacement_len);
            bool prepend = !starts && (pt->prepend_scheme == TOK_PREPEND_ALWAYS ||
                                       (pt->prepend_scheme == TOK_PREPEND_FIRST && pc->at_start));
            if (prepend) tok_buf_append(&c->tmp2, pt->replacement, pt->replacement_len);
            tok_buf_append(&c->tmp2, c->tmp.p, c->tmp.len);
            if (c->tmp2.failed) break;
            if (pt->split) {
                spans_literal(pt->replacement, pt->replacement_len, c->tmp2.p, c->tmp2.len, &sp);
                emit_splits(&sp, TOK_SPLIT_MERGED_WITH_NEXT, false, c->tmp2.p, pc->at_start, out);
            } else if (c->tmp2.len) {
                tok_pieces_push(out, c->tmp2.p, c->tmp2.len, -1, pc->at_start);
            }
            break;
        }
        }
        if (sp.failed || c->tmp.failed || c->tmp2.failed) out->failed = true;
    }
    free(sp.v);
}

// ---- BPE
static void heap_push(struct encode_ctx *c, struct bpe_merge m) {
    if (c->heap_n == c->heap_cap) {
        size_t cap = c->heap_cap ? c->heap_cap * 2 : 256;
        struct bpe_merge *h = realloc(c->heap, cap * sizeof *h);
        if (!h) {
            c->status = ATOMC_ERR_OUT_OF_MEMORY;
            return;
        }
        c->heap = h;
        c->heap_cap = cap;
    }
    struct bpe_merge *h = c->heap;
    size_t i = c->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (h[parent].rank < m.rank || (h[parent].rank == m.rank && h[parent].pos < m.pos)) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = m;
}

static struct bpe_merge heap_pop(struct encode_ctx *c) {
    struct bpe_merge *h = c->heap, top = h[0], last = h[--c->heap_n];
    size_t i = 0, n = c->heap_n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        const struct bpe_merge *bm = &last;
        if (l < n && (h[l].rank < bm->rank || (h[l].rank == bm->rank && h[l].pos < bm->pos))) {
            best = l;
            bm = &h[l];
        }
        if (r < n && (h[r].rank < bm->rank || (h[r].rank == bm->rank && h[r].pos < bm->pos))) best = r;
        if (best == i) break;
        h[i] = h[best];
        i = best;
    }
    if (n) h[i] = last;
    return top;
}

static void bpe_add_symbol(struct encode_ctx *c, int *n_sym, int32_t id, uint32_t len) {
    int i = (*n_sym)++;
    c->sym[i] = (struct bpe_symbol){.id = id, .prev = i - 1, .next = -1, .len = len};
    if (i > 0) c->sym[i - 1].next = i;
}

static void bpe_word_uncached(struct encode_ctx *c, const char *w, size_t n);

// BPE of one pre-tokenized word, through the word cache for short words.
static void bpe_word(struct encode_ctx *c, const char *w, size_t n) {
    const struct tokenizer *t = c->t;
    if (!n) return;
    if (t->ignore_merges) {
        int32_t id = tok_strmap_get(&t->vocab, w, n);
        if (id >= 0) {
            ids_push(&c->ids, id);
            return;
        }
    }
    struct tokenizer *mt = (struct tokenizer *)t;  // the cache is the one mutable part (locked)
    if (!t->cache || n > TOK_CACHE_WORD) {
        bpe_word_uncached(c, w, n);
        return;
    }
    uint64_t h = XXH3_64bits(w, n);
    struct tok_cache_entry *e = &mt->cache[h & (TOK_CACHE_ENTRIES - 1)];
    int32_t ids[TOK_CACHE_IDS];
    int n_ids = -1;
    pthread_mutex_lock(&mt->cache_lock);
    if (e->hash == h && e->len == n && !memcmp(e->word, w, n)) {
        n_ids = e->n_ids;
        memcpy(ids, e->ids, (size_t)n_ids * sizeof *ids);
    }
    pthread_mutex_unlock(&mt->cache_lock);
    if (n_ids >= 0) {
        for (int i = 0; i < n_ids; i++) ids_push(&c->ids, ids[i]);
        return;
    }
    int start = c->ids.n;
    bpe_word_uncached(c, w, n);
    int got = c->ids.n - start;
    if (c->status || c->ids.failed || got > TOK_CACHE_IDS) return;
    pthread_mutex_lock(&mt->cache_lock);
    e->hash = h;
    e->len = (uint8_t)n;
    e->n_ids = (uint8_t)got;
    memcpy(e->word, w, n);
    memcpy(e->ids, c->ids.v + start, (size_t)got * sizeof *ids);
    pthread_mutex_unlock(&mt->cache_lock);
}

static void bpe_word_uncached(struct encode_ctx *c, const char *w, size_t n) {
    const struct tokenizer *t = c->t;
    if (n + 1 > c->sym_cap) {
        size_t cap = c->sym_cap ? c->sym_cap : 64;
        while (cap < n + 1) cap *= 2;
        struct bpe_symbol *s = realloc(c->sym, cap * sizeof *s);
        if (!s) {
            c->status = ATOMC_ERR_OUT_OF_MEMORY;
            return;
        }
        c->sym = s;
        c->sym_cap = cap;
    }
    int n_sym = 0;
    int32_t unk_id = -1;
    uint32_t unk_len = 0;
    bool has_affix = t->cont_prefix || t->end_suffix;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        size_t l = (size_t)tok_utf8_decode(w + i, n - i, &cp);
        const char *key = w + i;
        size_t key_len = l;
        if (has_affix) {
            c->tmp.len = 0;
            if (i > 0 && t->cont_prefix) tok_buf_append(&c->tmp, t->cont_prefix, t->cont_prefix_len);
            tok_buf_append(&c->tmp, w + i, l);
            if (i + l == n && t->end_suffix) tok_buf_append(&c->tmp, t->end_suffix, t->end_suffix_len);
            key = c->tmp.p;
            key_len = c->tmp.len;
        }
        int32_t id = tok_strmap_get(&t->vocab, key, key_len);
        if (id >= 0) {
            if (unk_id >= 0) {
                bpe_add_symbol(c, &n_sym, unk_id, unk_len);
                unk_id = -1;
            }
            bpe_add_symbol(c, &n_sym, id, (uint32_t)l);
        } else {
            bool done = false;
            if (t->byte_fallback) {
                bool all = true;
                for (size_t k = 0; k < key_len; k++) all = all && t->byte_token[(unsigned char)key[k]] >= 0;
                if (all) {
                    for (size_t k = 0; k < key_len; k++) {
                        if ((size_t)n_sym + 1 > c->sym_cap) {
                            size_t cap = c->sym_cap * 2;
                            struct bpe_symbol *s2 = realloc(c->sym, cap * sizeof *s2);
                            if (!s2) {
                                c->status = ATOMC_ERR_OUT_OF_MEMORY;
                                return;
                            }
                            c->sym = s2;
                            c->sym_cap = cap;
                        }
                        bpe_add_symbol(c, &n_sym, t->byte_token[(unsigned char)key[k]], 1);
                    }
                    done = true;
                }
            }
            // Neither in the vocabulary nor covered by byte fallback, and no unk token: the
            // character is dropped and its neighbours become adjacent, as HF tokenizers' BPE does
            // (a byte-level vocabulary may lack some byte characters: SmolLM2's lacks 0x04...).
            if (!done && t->unk_id >= 0) {
                if (unk_id >= 0 && t->fuse_unk) {
                    unk_len += (uint32_t)l;
                } else {
                    if (unk_id >= 0) bpe_add_symbol(c, &n_sym, unk_id, unk_len);
                    unk_id = t->unk_id;
                    unk_len = (uint32_t)l;
                }
            }
        }
        i += l;
        if ((size_t)n_sym + 4 > c->sym_cap) {  // byte fallback can add up to 4 symbols per char
            size_t cap = c->sym_cap * 2;
            struct bpe_symbol *s2 = realloc(c->sym, cap * sizeof *s2);
            if (!s2) {
                c->status = ATOMC_ERR_OUT_OF_MEMORY;
                return;
            }
            c->sym = s2;
            c->sym_cap = cap;
        }
    }
    if (unk_id >= 0) bpe_add_symbol(c, &n_sym, unk_id, unk_len);

    struct bpe_symbol *sym = c->sym;
    c->heap_n = 0;
    for (int i = 0; i + 1 < n_sym; i++) {
        const struct tok_merge_slot *m = tok_mergemap_get(&t->merges, sym[i].id, sym[i + 1].id);
        if (m) heap_push(c, (struct bpe_merge){m->rank, i, m->new_id, sym[i].id, sym[i + 1].id});
    }
    while (c->heap_n && !c->status) {
        struct bpe_merge top = heap_pop(c);
        struct bpe_symbol *cur = &sym[top.pos];
        if (!cur->len || cur->next < 0) continue;
        int nx = cur->next;
        const struct tok_merge_slot *m;
        // Stale entry unless the pair now there still merges into the same token (HF's rule: a
        // different pair with the same result is accepted too).
        if (cur->id != top.left || sym[nx].id != top.right) {
            m = tok_mergemap_get(&t->merges, cur->id, sym[nx].id);
            if (!m || m->new_id != top.new_id) continue;
        }
        cur->id = top.new_id;
        cur->len += sym[nx].len;
        cur->next = sym[nx].next;
        sym[nx].len = 0;
        if (cur->next >= 0) sym[cur->next].prev = top.pos;
        if (cur->prev >= 0) {
            m = tok_mergemap_get(&t->merges, sym[cur->prev].id, cur->id);
            if (m) heap_push(c, (struct bpe_merge){m->rank, cur->prev, m->new_id, sym[cur->prev].id, cur->id});
        }
        if (cur->next >= 0) {
            m = tok_mergemap_get(&t->merges, cur->id, sym[cur->next].id);
            if (m) heap_push(c, (struct bpe_merge){m->rank, top.pos, m->new_id, cur->id, sym[cur->next].id});
        }
    }
    for (int i = 0; i >= 0 && i < n_sym; i = sym[i].next) ids_push(&c->ids, sym[i].id);
}

// ---- the whole pipeline
atomc_status tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool add_special_tokens,
                              int32_t **ids, int *n_ids, struct error *err) {
    *ids = NULL;
    *n_ids = 0;
    if (!text && len) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tokenizer_encode: NULL text");
    if (len > (size_t)1 << 31) return error_set(err, ATOMC_ERR_TOO_LONG, "tokenizer_encode: input of %zu bytes", len);
    struct encode_ctx c = {.t = t};
    struct tok_pieces a = {0}, b = {0};
    c.md = pcre2_match_data_create(4, NULL);
    if (!c.md) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer_encode");

    // Invalid UTF-8 -> U+FFFD per maximal invalid subpart.
    if (tok_utf8_is_valid(text, len)) {
        tok_pieces_push(&a, text, len, -1, true);
    } else {
        struct tok_buf clean = {0};
        tok_utf8_append_lossy(&clean, text, len);
        tok_pieces_push(&a, clean.p, clean.len, -1, true);
        if (clean.failed) a.failed = true;
        tok_buf_free(&clean);
    }
    struct tok_pieces *in = &a, *out = &b, *sw;
    if (len) {
        split_added(&c, &t->trie_raw, in, out);
        sw = in, in = out, out = sw;
        if (t->n_norms) {
            tok_pieces_clear(out);
            for (int p = 0; p < in->n; p++) {
                const struct tok_piece *pc = &in->v[p];
                if (pc->id >= 0) {
                    tok_pieces_push(out, in->text.p + pc->off, pc->len, pc->id, pc->at_start);
                    continue;
                }
                struct tok_buf nb = {0};
                normalize_all(&c, in->text.p + pc->off, pc->len, &nb);
                if (nb.failed) out->failed = true;
                if (nb.len) tok_pieces_push(out, nb.p, nb.len, -1, pc->at_start);
                tok_buf_free(&nb);
            }
            sw = in, in = out, out = sw;
        }
        if (t->trie_norm.n) {
            tok_pieces_clear(out);
            split_added(&c, &t->trie_norm, in, out);
            sw = in, in = out, out = sw;
        }
        for (int i = 0; i < t->n_pretoks; i++) {
            tok_pieces_clear(out);
            pretok_apply(&c, &t->pretoks[i], in, out);
            sw = in, in = out, out = sw;
        }
    } else {
        in->n = 0;
    }
    // The model, then the template.
    struct ids_buf body = {0};
    for (int p = 0; p < in->n && !c.status; p++) {
        const struct tok_piece *pc = &in->v[p];
        if (pc->id >= 0) ids_push(&c.ids, pc->id);
        else bpe_word(&c, in->text.p + pc->off, pc->len);
    }
    if (add_special_tokens && !c.status) {
        body = c.ids;
        c.ids = (struct ids_buf){0};
        for (int i = 0; i < t->n_tmpl; i++) {
            if (t->tmpl[i] >= 0) ids_push(&c.ids, t->tmpl[i]);
            else
                for (int k = 0; k < body.n; k++) ids_push(&c.ids, body.v[k]);
        }
    }
    bool failed = a.failed || b.failed || c.ids.failed || body.failed || c.tmp.failed || c.tmp2.failed;
    atomc_status st = c.status;
    if (!st && failed) st = ATOMC_ERR_OUT_OF_MEMORY;
    free(body.v);
    tok_pieces_free(&a);
    tok_pieces_free(&b);
    tok_buf_free(&c.tmp);
    tok_buf_free(&c.tmp2);
    free(c.sym);
    free(c.heap);
    pcre2_match_data_free(c.md);
    if (st) {
        free(c.ids.v);
        return error_set(err, st, "tokenizer_encode: %s", st == ATOMC_ERR_OUT_OF_MEMORY ? "out of memory" : "regex failure");
    }
    if (!c.ids.v) {  // empty result: still hand back a valid (freeable) pointer
        c.ids.v = malloc(sizeof(int32_t));
        if (!c.ids.v) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer_encode");
    }
    *ids = c.ids.v;
    *n_ids = c.ids.n;
    return ATOMC_OK;
}
