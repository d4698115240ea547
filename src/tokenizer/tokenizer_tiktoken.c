// Tokenizers in tiktoken form: a directory with tiktoken.model (one "<base64 bytes> <rank>" line per
// token, ranks 0..N-1 each once; Kimi-K2, Moonlight, Kimi-Linear ship this) and tokenizer_config.json.
//
// Encoding. tiktoken merges, inside each pre-tokenized piece, the adjacent pair whose concatenation
// has the lowest rank, until none is in the vocabulary. That equals byte-level BPE over the same
// vocabulary (pieces spelled in the GPT-2 byte alphabet) with merges derived from the ranks: every
// split of a token into two tokens, ordered by the token's rank, then by the left and right ranks
// (the order of transformers' TikTokenConverter). So the vocabulary goes through the same encoder as
// tokenizer.json models; all 256 single bytes must be tokens (tiktoken needs them too). A piece that is
// itself a token is emitted whole before any merging, as tiktoken does (HF's ignore_merges).
//
// Pre-tokenizer (one Split, then ByteLevel without its own regex; decoder ByteLevel):
//   - tokenizer_config.json "pat_str" when it has one (the form tools/ conversions write);
//   - else Kimi's pattern when the config's auto_map points at tokenization_kimi (the pattern lives in
//     that Python file, not in the config). Upstream writes its letter classes as fancy-regex class
//     intersections [...&&[^\p{Han}]]; PCRE2 (10.42) has none, so each becomes a per-character
//     lookahead (?:(?!\p{Han})[...]), which matches the same characters;
//   - else the directory is refused, naming what is missing.
// Special tokens: tokenizer_config.json added_tokens_decoder ({"ID": {"content", "special", ...}}),
// ids from N on. Kimi reserves 256 ids after the ranks; those its config does not name are
// "<|reserved_token_ID|>" as its tokenizer code names them. bos_token / eos_token / chat_template come
// from the config as for tokenizer.json models; a BOS is prepended only when add_bos_token is true.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base64.h"
#include "common/mapped_file.h"
#include "tokenizer/tokenizer_internal.h"

#define KIMI_RESERVED_SPECIALS 256

// Kimi's pre-tokenizer (tokenization_kimi.py), its two letter-class intersections rewritten as lookaheads.
#define NOT_HAN_UPPER "(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])"
#define NOT_HAN_LOWER "(?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])"
static const char KIMI_PATTERN[] = "[\\p{Han}]+"
                                   "|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN_UPPER "*" NOT_HAN_LOWER
                                   "+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                                   "|[^\\r\\n\\p{L}\\p{N}]?" NOT_HAN_UPPER "+" NOT_HAN_LOWER
                                   "*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                                   "|\\p{N}{1,3}"
                                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                                   "|\\s*[\\r\\n]+"
                                   "|\\s+(?!\\S)"
                                   "|\\s+";

struct tt_loader {
    struct tokenizer *t;
    const char *path;
    struct error *err;
    // Per rank: the token's bytes (views into the mapped-and-decoded buffer).
    unsigned char *bytes; // all tokens' bytes, concatenated
    size_t *off;          // (n + 1) offsets into bytes
    int n;
};

static atomc_status tt_bad(struct tt_loader *L, atomc_status st, const char *fmt, const char *detail) {
    return error_set(L->err, st, "tokenizer: %s: %s%s", L->path, fmt, detail ? detail : "");
}

// Reads tiktoken.model into L->bytes / L->off indexed by rank.
static atomc_status read_ranks(struct tt_loader *L, const char *file) {
    struct mapped_file mf;
    atomc_status st = mapped_file_open(&mf, file, L->err);
    if (st) return error_prefix(L->err, "tokenizer: "), st;
    const char *p = (const char *)mf.data, *end = p + mf.size;
    size_t lines = 0;
    for (const char *q = p; q < end; q++) lines += *q == '\n';
    lines += mf.size && end[-1] != '\n';
    size_t cap = lines ? lines : 1;
    L->off = calloc(cap + 1, sizeof *L->off);
    long *rank_of_line = malloc(cap * sizeof *rank_of_line);
    size_t *line_off = malloc((cap + 1) * sizeof *line_off);
    L->bytes = malloc(mf.size + 4);
    if (!L->off || !rank_of_line || !line_off || !L->bytes) {
        st = tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "ranks", NULL);
        goto done;
    }
    size_t n = 0, used = 0;
    long max_rank = -1;
    for (size_t line = 1; p < end; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        const char *sp = memchr(p, ' ', (size_t)(le - p));
        const char *ls = le;
        while (ls > p && (ls[-1] == '\r' || ls[-1] == ' ')) ls--;
        if (ls == p) { // blank line
            p = nl ? nl + 1 : end;
            continue;
        }
        char where[64];
        snprintf(where, sizeof where, "%zu", line);
        if (!sp || sp >= ls) {
            st = tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model: not \"<base64> <rank>\" at line ", where);
            goto done;
        }
        char *rend;
        long rank = strtol(sp + 1, &rend, 10);
        if (rend != ls || rank < 0 || rank >= (1l << 24)) {
            st = tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model: bad rank at line ", where);
            goto done;
        }
        long blen = base64_decode(p, (size_t)(sp - p), L->bytes + used);
        if (blen <= 0) {
            st = tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model: bad base64 at line ", where);
            goto done;
        }
        rank_of_line[n] = rank;
        line_off[n] = used;
        used += (size_t)blen;
        n++;
        if (rank > max_rank) max_rank = rank;
        p = nl ? nl + 1 : end;
    }
    line_off[n] = used;
    if (n == 0) {
        st = tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model holds no tokens", NULL);
        goto done;
    }
    if (max_rank != (long)n - 1) {
        st = tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model: ranks are not 0..N-1 each once", NULL);
        goto done;
    }
    // Order by rank (files are normally already in rank order).
    unsigned char *sorted = malloc(used + 4);
    size_t *len_of_rank = calloc(n, sizeof *len_of_rank), *src_of_rank = malloc(n * sizeof *src_of_rank);
    if (!sorted || !len_of_rank || !src_of_rank) {
        free(sorted);
        free(len_of_rank);
        free(src_of_rank);
        st = tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "ranks", NULL);
        goto done;
    }
    bool dup = false;
    for (size_t i = 0; i < n; i++) {
        size_t r = (size_t)rank_of_line[i];
        if (len_of_rank[r]) dup = true;
        len_of_rank[r] = line_off[i + 1] - line_off[i];
        src_of_rank[r] = line_off[i];
    }
    size_t o = 0;
    for (size_t r = 0; r < n && !dup; r++) {
        L->off[r] = o;
        memcpy(sorted + o, L->bytes + src_of_rank[r], len_of_rank[r]);
        o += len_of_rank[r];
    }
    L->off[n] = o;
    free(len_of_rank);
    free(src_of_rank);
    free(L->bytes);
    L->bytes = sorted;
    L->n = (int)n;
    if (dup) st = tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model: a rank appears twice", NULL);
done:
    free(rank_of_line);
    free(line_off);
    mapped_file_close(&mf);
    return st;
}

// Spells every rank's bytes in the byte alphabet into t->piece / t->vocab; spell_off[r][k] is the
// spelled length of the first k bytes (kept for the merge derivation: splits are at byte boundaries).
static atomc_status build_vocab(struct tt_loader *L, struct tok_buf *spelled, size_t *spell_start) {
    struct tokenizer *t = L->t;
    for (int r = 0; r < L->n; r++) {
        spell_start[r] = spelled->len;
        for (size_t k = L->off[r]; k < L->off[r + 1]; k++)
            tok_buf_append(spelled, t->byte_char[L->bytes[k]], t->byte_char_len[L->bytes[k]]);
    }
    spell_start[L->n] = spelled->len;
    if (spelled->failed) return tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "vocabulary", NULL);
    for (int r = 0; r < L->n; r++) {
        size_t len = spell_start[r + 1] - spell_start[r];
        char *p = tokenizer_pool_strdup(t, spelled->p + spell_start[r], len);
        if (!p) return tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "vocabulary", NULL);
        if (tok_strmap_get(&t->vocab, p, len) >= 0) return tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model: a token appears twice", NULL);
        t->piece[r] = p;
        t->piece_len[r] = (uint32_t)len;
        tok_strmap_put(&t->vocab, p, len, r);
    }
    for (int b = 0; b < 256; b++)
        if (tok_strmap_get(&t->vocab, t->byte_char[b], t->byte_char_len[b]) < 0) {
            char hex[8];
            snprintf(hex, sizeof hex, "0x%02X", b);
            return tt_bad(L, ATOMC_ERR_FORMAT, "tiktoken.model lacks the single-byte token ", hex);
        }
    return ATOMC_OK;
}

struct tt_merge {
    int32_t l, r, merged;
};

static int cmp_merge(const void *a, const void *b) {
    const struct tt_merge *x = a, *y = b;
    if (x->l != y->l) return x->l < y->l ? -1 : 1;
    return (x->r > y->r) - (x->r < y->r);
}

// Merges from ranks, in rank order of the merged token, then (left rank, right rank). Collected
// first: the merge map is sized once from the exact count.
static atomc_status derive_merges(struct tt_loader *L) {
    struct tokenizer *t = L->t;
    size_t n = 0, cap = (size_t)L->n * 2 + 16;
    struct tt_merge *m = malloc(cap * sizeof *m);
    if (!m) return tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "merges", NULL);
    for (int r = 0; r < L->n; r++) {
        const char *s = t->piece[r];
        size_t nbytes = L->off[r + 1] - L->off[r], first = n, spelled = 0;
        for (size_t k = 0; k + 1 < nbytes; k++) {
            spelled += t->byte_char_len[L->bytes[L->off[r] + k]];
            int32_t a = tok_strmap_get(&t->vocab, s, spelled);
            int32_t b = tok_strmap_get(&t->vocab, s + spelled, t->piece_len[r] - spelled);
            if (a < 0 || b < 0) continue;
            if (n == cap) {
                cap *= 2;
                struct tt_merge *v = realloc(m, cap * sizeof *v);
                if (!v) {
                    free(m);
                    return tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "merges", NULL);
                }
                m = v;
            }
            m[n++] = (struct tt_merge){a, b, r};
        }
        qsort(m + first, n - first, sizeof *m, cmp_merge);
    }
    atomc_status st = tok_mergemap_init(&t->merges, n, L->err);
    for (size_t i = 0; !st && i < n; i++) tok_mergemap_put(&t->merges, m[i].l, m[i].r, (int32_t)i, m[i].merged);
    free(m);
    return st;
}

static bool config_is_kimi(json_t *cfg) {
    json_t *am = json_object_get(cfg, "auto_map");
    json_t *at = json_object_get(am, "AutoTokenizer");
    json_t *v;
    size_t i;
    if (json_is_string(at)) return strstr(json_string_value(at), "tokenization_kimi") != NULL;
    json_array_foreach(at, i, v) if (json_is_string(v) && strstr(json_string_value(v), "tokenization_kimi")) return true;
    return false;
}

static atomc_status add_specials(struct tt_loader *L, json_t *cfg, bool kimi, int total) {
    struct tokenizer *t = L->t;
    json_t *dec = json_object_get(cfg, "added_tokens_decoder");
    const char *key;
    json_t *v;
    json_object_foreach(dec, key, v) {
        char *end;
        long id = strtol(key, &end, 10);
        json_t *content = json_object_get(v, "content");
        if (*end || id < 0 || id >= total || !json_is_string(content))
            return tt_bad(L, ATOMC_ERR_FORMAT, "tokenizer_config.json: bad added_tokens_decoder entry ", key);
        if (id < L->n) continue; // an added token spelling a ranked token: the ranked one stands
        json_t *sp = json_object_get(v, "special");
        bool special = !json_is_boolean(sp) || json_is_true(sp);
        atomc_status st = tokenizer_add_token(t, (int32_t)id, json_string_value(content), json_string_length(content),
                                              special, json_is_true(json_object_get(v, "lstrip")),
                                              json_is_true(json_object_get(v, "rstrip")), false,
                                              json_is_true(json_object_get(v, "single_word")), L->err);
        if (st) return st;
    }
    for (int id = L->n; kimi && id < total; id++) {
        if (t->piece[id]) continue;
        char name[48];
        int len = snprintf(name, sizeof name, "<|reserved_token_%d|>", id);
        atomc_status st = tokenizer_add_token(t, id, name, (size_t)len, true, false, false, false, false, L->err);
        if (st) return st;
    }
    return ATOMC_OK;
}

static atomc_status build(struct tt_loader *L, const char *dir) {
    struct tokenizer *t = L->t;
    size_t n = strlen(dir) + 32;
    char *model = malloc(n), *cfgp = malloc(n);
    if (!model || !cfgp) {
        free(model);
        free(cfgp);
        return tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "path", NULL);
    }
    snprintf(model, n, "%s/tiktoken.model", dir);
    snprintf(cfgp, n, "%s/tokenizer_config.json", dir);
    json_t *cfg = NULL;
    atomc_status st = ATOMC_OK;
    FILE *f = fopen(cfgp, "r");
    if (f) {
        fclose(f);
        json_error_t je;
        cfg = json_load_file(cfgp, JSON_DECODE_INT_AS_REAL, &je);
        if (!cfg) st = error_set(L->err, ATOMC_ERR_FORMAT, "tokenizer: %s:%d: %s", cfgp, je.line, je.text);
    }
    bool kimi = cfg && config_is_kimi(cfg);
    const char *pattern = json_string_value(json_object_get(cfg, "pat_str"));
    if (!st && !pattern && !kimi)
        st = tt_bad(L, ATOMC_ERR_UNSUPPORTED,
                    "tiktoken.model without a known pre-tokenizer pattern: tokenizer_config.json has no \"pat_str\" "
                    "and its auto_map is not Kimi's tokenization_kimi",
                    NULL);
    if (!st) st = read_ranks(L, model);
    // Total ids: the ranks, Kimi's reserved block, and any added token beyond them.
    int total = L->n + (kimi ? KIMI_RESERVED_SPECIALS : 0);
    const char *key;
    json_t *v;
    json_object_foreach(json_object_get(cfg, "added_tokens_decoder"), key, v) {
        long id = strtol(key, NULL, 10);
        if (id >= total && id < (1l << 24)) total = (int)id + 1;
    }
    if (!st) st = tokenizer_reserve_ids(t, total, L->err);
    if (!st) st = tok_strmap_init(&t->vocab, (size_t)L->n, L->err);
    struct tok_buf spelled = {0};
    size_t *spell_start = st ? NULL : malloc(((size_t)L->n + 1) * sizeof *spell_start);
    if (!st && !spell_start) st = tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "vocabulary", NULL);
    if (!st) {
        tokenizer_init_byte_tables(t);
        st = build_vocab(L, &spelled, spell_start);
    }
    free(spell_start);
    tok_buf_free(&spelled);
    if (!st) st = derive_merges(L);
    t->ignore_merges = true; // tiktoken emits a piece that is itself a token whole, before any merge
    if (!st) st = tokenizer_push_pretok(t, TOK_PRETOK_SPLIT, pattern ? pattern : KIMI_PATTERN, L->err);
    if (!st) st = tokenizer_push_pretok(t, TOK_PRETOK_BYTE_LEVEL, NULL, L->err);
    if (!st && !tokenizer_push_decoder(t, TOK_DEC_BYTE_LEVEL)) st = tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "decoders", NULL);
    if (!st) st = add_specials(L, cfg, kimi, total);
    if (!st) st = tokenizer_apply_config(t, cfg, cfgp, L->path, L->err);
    if (!st) {
        bool add_bos = json_is_true(json_object_get(cfg, "add_bos_token")) && t->bos_id >= 0;
        free(t->tmpl);
        t->tmpl = malloc(2 * sizeof *t->tmpl);
        if (!t->tmpl) st = tt_bad(L, ATOMC_ERR_OUT_OF_MEMORY, "template", NULL);
        else {
            t->n_tmpl = 0;
            if (add_bos) t->tmpl[t->n_tmpl++] = t->bos_id;
            t->tmpl[t->n_tmpl++] = -1;
        }
    }
    json_decref(cfg);
    free(model);
    free(cfgp);
    if (!st) st = tokenizer_finish(t, L->err);
    return st;
}

atomc_status tokenizer_load_tiktoken(const char *dir, struct tokenizer **out, struct error *err) {
    *out = NULL;
    struct tokenizer *t = tokenizer_alloc();
    if (!t) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer");
    struct tt_loader L = {.t = t, .path = dir, .err = err};
    atomc_status st = build(&L, dir);
    free(L.bytes);
    free(L.off);
    if (st) {
        tokenizer_free(t);
        return st;
    }
    *out = t;
    return ATOMC_OK;
}
