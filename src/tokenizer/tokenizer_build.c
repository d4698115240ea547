// Construction, ownership and accessors of `struct tokenizer`, shared by the tokenizer.json and
// GGUF loaders: id tables, the string pool, added tokens and their match tries, regex
// compilation, the GPT-2 byte<->char tables and per-id output bytes.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/check.h"
#include "common/mapped_file.h"
#include "tokenizer/tokenizer_internal.h"

const char tokenizer_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

#define POOL_BLOCK (1u << 20)

atomc_status tokenizer_push_pretok(struct tokenizer *t, enum tok_pretok_type type, const char *regex, struct error *err) {
    struct tok_pretok *v = realloc(t->pretoks, (size_t)(t->n_pretoks + 1) * sizeof *v);
    if (!v) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: pre-tokenizers");
    t->pretoks = v;
    struct tok_pretok *p = &v[t->n_pretoks++];
    memset(p, 0, sizeof *p);
    p->type = type;
    p->behavior = TOK_SPLIT_ISOLATED;
    if (type == TOK_PRETOK_BYTE_LEVEL) p->use_regex = regex != NULL;
    if (type == TOK_PRETOK_METASPACE) {
        memcpy(p->replacement, "\xE2\x96\x81", 3);
        p->replacement_len = 3;
    }
    if (regex) return tokenizer_compile_regex(regex, strlen(regex), &p->re, err);
    return ATOMC_OK;
}

struct tok_decoder *tokenizer_push_decoder(struct tokenizer *t, enum tok_decoder_type type) {
    struct tok_decoder *v = realloc(t->decoders, (size_t)(t->n_decoders + 1) * sizeof *v);
    if (!v) return NULL;
    t->decoders = v;
    struct tok_decoder *d = &v[t->n_decoders++];
    memset(d, 0, sizeof *d);
    d->type = type;
    t->has_decoder = true;
    return d;
}

struct tokenizer *tokenizer_alloc(void) {
    struct tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->unk_id = -1;
    t->bos_id = -1;
    t->eos_id = -1;
    for (int i = 0; i < 256; i++) t->byte_token[i] = -1;
    pthread_mutex_init(&t->cache_lock, NULL);
    return t;
}

char *tokenizer_pool_strdup(struct tokenizer *t, const char *s, size_t n) {
    if (t->pool_used + n + 1 > t->pool_cap || !t->n_pool_blocks) {
        size_t cap = n + 1 > POOL_BLOCK ? n + 1 : POOL_BLOCK;
        char **blocks = realloc(t->pool_blocks, (size_t)(t->n_pool_blocks + 1) * sizeof *blocks);
        if (!blocks) return NULL;
        t->pool_blocks = blocks;
        char *b = malloc(cap);
        if (!b) return NULL;
        blocks[t->n_pool_blocks++] = b;
        t->pool_used = 0;
        t->pool_cap = cap;
    }
    char *p = t->pool_blocks[t->n_pool_blocks - 1] + t->pool_used;
    memcpy(p, s, n);
    p[n] = '\0';
    t->pool_used += n + 1;
    return p;
}

atomc_status tokenizer_reserve_ids(struct tokenizer *t, int vocab_size, struct error *err) {
    if (vocab_size <= t->vocab_size) return ATOMC_OK;
    if (vocab_size > (1 << 24)) return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: token id %d out of range", vocab_size - 1);
    size_t n = (size_t)vocab_size;
    const char **piece = realloc(t->piece, n * sizeof *piece);
    if (piece) t->piece = piece;
    uint32_t *plen = realloc(t->piece_len, n * sizeof *plen);
    if (plen) t->piece_len = plen;
    uint8_t *flags = realloc(t->flags, n);
    if (flags) t->flags = flags;
    if (!piece || !plen || !flags) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: %d ids", vocab_size);
    for (int i = t->vocab_size; i < vocab_size; i++) {
        t->piece[i] = NULL;
        t->piece_len[i] = 0;
        t->flags[i] = 0;
    }
    t->vocab_size = vocab_size;
    return ATOMC_OK;
}

atomc_status tokenizer_add_token(struct tokenizer *t, int32_t id, const char *content, size_t len, bool special,
                                 bool lstrip, bool rstrip, bool normalized, bool single_word, struct error *err) {
    if (id < 0) return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: added token \"%.*s\" has a negative id", (int)len, content);
    if (!len) return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: added token %d has empty content", id);
    atomc_status st = tokenizer_reserve_ids(t, id + 1, err);
    if (st) return st;
    struct tok_added *a = realloc(t->added, (size_t)(t->n_added + 1) * sizeof *a);
    if (!a) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: added tokens");
    t->added = a;
    char *c = tokenizer_pool_strdup(t, content, len);
    if (!c) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: added tokens");
    a[t->n_added++] = (struct tok_added){.id = id, .content = c, .len = len, .special = special, .lstrip = lstrip,
                                         .rstrip = rstrip, .normalized = normalized, .single_word = single_word};
    t->piece[id] = c;
    t->piece_len[id] = (uint32_t)len;
    t->flags[id] |= TOK_FLAG_ADDED | (special ? TOK_FLAG_SPECIAL : 0);
    if (!t->added_map.slots) {
        st = tok_strmap_init(&t->added_map, 64, err);
        if (st) return st;
    }
    tok_strmap_put(&t->added_map, c, len, id);
    return ATOMC_OK;
}

atomc_status tokenizer_compile_regex(const char *pattern, size_t len, pcre2_code **out, struct error *err) {
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, PCRE2_UTF | PCRE2_UCP, &code, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "tokenizer: regex \"%.*s\" at offset %zu: %s", (int)len, pattern,
                         (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // interpreter fallback if JIT is unavailable
    *out = re;
    return ATOMC_OK;
}

// ---- tries over added-token contents
static int trie_node_new(struct tok_trie *tr, unsigned char byte) {
    if (tr->n == tr->cap) {
        int cap = tr->cap ? tr->cap * 2 : 256;
        struct tok_trie_node *nodes = realloc(tr->nodes, (size_t)cap * sizeof *nodes);
        if (!nodes) return -1;
        tr->nodes = nodes;
        tr->cap = cap;
    }
    tr->nodes[tr->n] = (struct tok_trie_node){.first_child = -1, .next_sibling = -1, .added = -1, .byte = byte};
    return tr->n++;
}

static bool trie_insert(struct tok_trie *tr, const char *s, size_t len, int added_index) {
    if (!tr->n && trie_node_new(tr, 0) < 0) return false;
    int node = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        int child = tr->nodes[node].first_child;
        while (child >= 0 && tr->nodes[child].byte != c) child = tr->nodes[child].next_sibling;
        if (child < 0) {
            child = trie_node_new(tr, c);
            if (child < 0) return false;
            tr->nodes[child].next_sibling = tr->nodes[node].first_child;
            tr->nodes[node].first_child = child;
        }
        node = child;
    }
    if (tr->nodes[node].added < 0) tr->nodes[node].added = added_index;
    return true;
}

// GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the others to 256+k in order.
void tokenizer_init_byte_tables(struct tokenizer *t) {
    for (int i = 0; i < 512; i++) t->char_byte[i] = -1;
    int k = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        int cp = printable ? b : 256 + k++;
        char buf[4];
        int n = tok_utf8_encode(cp, buf);
        memcpy(t->byte_char[b], buf, (size_t)n);
        t->byte_char_len[b] = (uint8_t)n;
        t->char_byte[cp] = (int16_t)b;
    }
}

atomc_status tokenizer_finish(struct tokenizer *t, struct error *err) {
    tokenizer_init_byte_tables(t);
    for (int b = 0; b < 256; b++) {
        char name[8];
        static const char hex[] = "0123456789ABCDEF";
        memcpy(name, "<0x", 3);
        name[3] = hex[b >> 4];
        name[4] = hex[b & 15];
        name[5] = '>';
        t->byte_token[b] = tok_strmap_get(&t->vocab, name, 6);
        if (t->byte_token[b] >= 0 && t->byte_token[b] < t->vocab_size) t->flags[t->byte_token[b]] |= TOK_FLAG_BYTE;
    }
    for (int i = 0; i < t->n_added; i++) {
        struct tok_added *a = &t->added[i];
        bool ok;
        if (a->normalized && t->n_norms) {
            struct tok_buf nb = {0};
            tokenizer_normalize_text(t, a->content, a->len, &nb);
            ok = !nb.failed && nb.len && trie_insert(&t->trie_norm, nb.p, nb.len, i);
            tok_buf_free(&nb);
        } else {
            ok = trie_insert(a->normalized ? &t->trie_norm : &t->trie_raw, a->content, a->len, i);
        }
        if (!ok) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: added-token trie");
    }
    // Output bytes of each id: the decoder chain on the lone piece, without start-of-text rules
    // and without UTF-8 repair (a byte-level piece may hold part of a character).
    t->out_bytes = calloc((size_t)t->vocab_size, sizeof *t->out_bytes);
    t->out_len = calloc((size_t)t->vocab_size, sizeof *t->out_len);
    if (!t->out_bytes || !t->out_len) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: id tables");
    struct tok_pieces one = {0};
    struct tok_buf out = {0};
    for (int id = 0; id < t->vocab_size; id++) {
        if (!t->piece[id]) continue;
        tok_pieces_clear(&one);
        out.len = 0;
        tok_pieces_push(&one, t->piece[id], t->piece_len[id], id, false);
        tokenizer_decode_raw(t, &one, &out);
        if (out.failed || one.failed) break;
        const char *p = tokenizer_pool_strdup(t, out.p ? out.p : "", out.len);
        if (!p) {
            out.failed = true;
            break;
        }
        t->out_bytes[id] = p;
        t->out_len[id] = (uint32_t)out.len;
    }
    bool failed = out.failed || one.failed;
    tok_buf_free(&out);
    tok_pieces_free(&one);
    if (failed) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: output bytes");
    t->cache = calloc(TOK_CACHE_ENTRIES, sizeof *t->cache);  // optional: encoding works without it
    if (t->bos_id >= t->vocab_size) t->bos_id = -1;
    if (t->eos_id >= t->vocab_size) t->eos_id = -1;
    return ATOMC_OK;
}

void tokenizer_free(struct tokenizer *t) {
    if (!t) return;
    free(t->piece);
    free(t->piece_len);
    free(t->flags);
    free(t->out_bytes);
    free(t->out_len);
    tok_strmap_free(&t->vocab);
    tok_strmap_free(&t->added_map);
    tok_mergemap_free(&t->merges);
    for (int i = 0; i < t->n_norms; i++)
        if (t->norms[i].re) pcre2_code_free(t->norms[i].re);
    free(t->norms);
    for (int i = 0; i < t->n_pretoks; i++)
        if (t->pretoks[i].re) pcre2_code_free(t->pretoks[i].re);
    free(t->pretoks);
    free(t->decoders);
    free(t->added);
    free(t->trie_raw.nodes);
    free(t->trie_norm.nodes);
    free(t->tmpl);
    free(t->cache);
    pthread_mutex_destroy(&t->cache_lock);
    for (int i = 0; i < t->n_pool_blocks; i++) free(t->pool_blocks[i]);
    free(t->pool_blocks);
    free(t);
}

// ---- loading entry point
static bool has_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcasecmp(s + n - m, suffix);
}

atomc_status tokenizer_load(const char *path, struct tokenizer **out, struct error *err) {
    *out = NULL;
    if (!path || !*path) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tokenizer: empty path");
    if (dir_exists(path)) {
        size_t n = strlen(path);
        char *json = malloc(n + 32), *cfg = malloc(n + 32);
        if (!json || !cfg) {
            free(json);
            free(cfg);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: path");
        }
        snprintf(json, n + 32, "%s/tokenizer.json", path);
        snprintf(cfg, n + 32, "%s/tokenizer_config.json", path);
        atomc_status st;
        char *tt = malloc(n + 32);
        if (tt) snprintf(tt, n + 32, "%s/tiktoken.model", path);
        if (file_exists(json)) {
            st = tokenizer_load_json(json, file_exists(cfg) ? cfg : NULL, out, err);
        } else if (tt && file_exists(tt)) {
            st = tokenizer_load_tiktoken(path, out, err);
        } else {
            st = error_set(err, ATOMC_ERR_IO, "tokenizer: %s: no tokenizer.json (or tiktoken.model) in the model "
                           "directory (for a GGUF model pass the .gguf file)", path);
        }
        free(tt);
        free(json);
        free(cfg);
        return st;
    }
    if (!file_exists(path)) return error_set(err, ATOMC_ERR_IO, "tokenizer: %s: no such file or directory", path);
    if (has_suffix(path, ".gguf")) return tokenizer_load_gguf_path(path, out, err);
    // A tokenizer.json file: pick up tokenizer_config.json beside it.
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    char *cfg = malloc(dir_len + 32);
    if (!cfg) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: path");
    memcpy(cfg, path, dir_len);
    strcpy(cfg + dir_len, "tokenizer_config.json");
    atomc_status st = tokenizer_load_json(path, file_exists(cfg) ? cfg : NULL, out, err);
    free(cfg);
    return st;
}

// ---- accessors
int tokenizer_vocab_size(const struct tokenizer *t) { return t->vocab_size; }

const char *tokenizer_token_text(const struct tokenizer *t, int32_t id) {
    return id >= 0 && id < t->vocab_size ? t->piece[id] : NULL;
}

bool tokenizer_is_special(const struct tokenizer *t, int32_t id) {
    return id >= 0 && id < t->vocab_size && (t->flags[id] & TOK_FLAG_SPECIAL);
}

int32_t tokenizer_token_id(const struct tokenizer *t, const char *piece) {
    size_t n = strlen(piece);
    int32_t id = tok_strmap_get(&t->added_map, piece, n);
    return id >= 0 ? id : tok_strmap_get(&t->vocab, piece, n);
}

int32_t tokenizer_bos_id(const struct tokenizer *t) { return t->bos_id; }
int32_t tokenizer_eos_id(const struct tokenizer *t) { return t->eos_id; }
const char *tokenizer_bos_text(const struct tokenizer *t) { return t->bos_text; }
const char *tokenizer_eos_text(const struct tokenizer *t) { return t->eos_text; }
const char *tokenizer_chat_template(const struct tokenizer *t) { return t->chat_template; }

bool tokenizer_adds_bos(const struct tokenizer *t) {
    return t->bos_id >= 0 && t->n_tmpl > 0 && t->tmpl[0] == t->bos_id;
}

const char *tokenizer_token_bytes(const struct tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->vocab_size || !t->out_bytes[id]) {
        *len = 0;
        return NULL;
    }
    *len = t->out_len[id];
    return t->out_bytes[id];
}
