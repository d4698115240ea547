// Small building blocks of the tokenizer: growable buffers, piece lists, UTF-8 validation with
// "maximal subpart" replacement (the rule Python's errors="replace" and Rust's from_utf8_lossy
// share), and open-addressing hash maps keyed with xxhash.
#include <stdlib.h>
#include <string.h>
#define XXH_INLINE_ALL  // inline xxhash's XXH3 into the map probes
#include <xxhash.h>

#include "tokenizer/tokenizer_internal.h"

// ---- buffers
static bool tok_buf_grow(struct tok_buf *b, size_t need) {
    if (b->failed) return false;
    if (b->len + need <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + need) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void tok_buf_append(struct tok_buf *b, const void *data, size_t n) {
    if (!n || !tok_buf_grow(b, n)) return;
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

void tok_buf_putc(struct tok_buf *b, char c) {
    if (!tok_buf_grow(b, 1)) return;
    b->p[b->len++] = c;
}

void tok_buf_free(struct tok_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

// ---- piece lists
void tok_pieces_push(struct tok_pieces *p, const char *s, size_t len, int32_t id, bool at_start) {
    if (p->failed) return;
    if (p->n == p->cap) {
        int cap = p->cap ? p->cap * 2 : 16;
        struct tok_piece *v = realloc(p->v, (size_t)cap * sizeof *v);
        if (!v) {
            p->failed = true;
            return;
        }
        p->v = v;
        p->cap = cap;
    }
    if (!p->text.p) {  // keep text.p non-NULL so `text.p + off` is defined even for empty pieces
        tok_buf_putc(&p->text, '\0');
        p->text.len = 0;
    }
    size_t off = p->text.len;
    tok_buf_append(&p->text, s, len);
    if (p->text.failed) {
        p->failed = true;
        return;
    }
    p->v[p->n++] = (struct tok_piece){.off = off, .len = len, .id = id, .at_start = at_start};
}

void tok_pieces_clear(struct tok_pieces *p) {
    p->n = 0;
    p->text.len = 0;
}

void tok_pieces_free(struct tok_pieces *p) {
    free(p->v);
    tok_buf_free(&p->text);
    memset(p, 0, sizeof *p);
}

// ---- UTF-8
// Allowed range of the second byte for each lead byte (Unicode Table 3-7); later bytes are 80..BF.
static int utf8_need(unsigned char c, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return 2;
    if (c < 0xF0) {
        if (c == 0xE0) *lo = 0xA0;
        if (c == 0xED) *hi = 0x9F;
        return 3;
    }
    if (c < 0xF5) {
        if (c == 0xF0) *lo = 0x90;
        if (c == 0xF4) *hi = 0x8F;
        return 4;
    }
    return 0;
}

// Number of leading bytes at s that are consistent with a valid sequence (0 if the lead byte is bad).
static int utf8_prefix(const unsigned char *s, size_t n, int *need_out) {
    unsigned char lo, hi;
    int need = utf8_need(s[0], &lo, &hi);
    *need_out = need;
    if (need <= 1) return need;
    int k = 1;
    while (k < need && (size_t)k < n) {
        unsigned char c = s[k];
        if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
        k++;
    }
    return k;
}

int tok_utf8_valid_len(const unsigned char *s, size_t n) {
    if (!n) return 0;
    int need;
    int k = utf8_prefix(s, n, &need);
    return k == need ? need : 0;
}

int tok_utf8_invalid_len(const unsigned char *s, size_t n) {
    int need;
    int k = utf8_prefix(s, n, &need);
    return k > 0 ? k : 1;
}

bool tok_utf8_is_valid(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int l = tok_utf8_valid_len(u + i, n - i);
        if (!l) return false;
        i += (size_t)l;
    }
    return true;
}

void tok_utf8_append_lossy(struct tok_buf *out, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0;  // run: start of the pending valid stretch
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int l = tok_utf8_valid_len(u + i, n - i);
        if (l) {
            i += (size_t)l;
            continue;
        }
        tok_buf_append(out, s + run, i - run);
        tok_buf_append(out, "\xEF\xBF\xBD", 3);
        i += (size_t)tok_utf8_invalid_len(u + i, n - i);
        run = i;
    }
    tok_buf_append(out, s + run, n - run);
}

int tok_utf8_decode(const char *s, size_t n, int32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    int l = tok_utf8_valid_len(u, n);
    switch (l) {
    case 1: *cp = u[0]; return 1;
    case 2: *cp = ((u[0] & 0x1F) << 6) | (u[1] & 0x3F); return 2;
    case 3: *cp = ((u[0] & 0x0F) << 12) | ((u[1] & 0x3F) << 6) | (u[2] & 0x3F); return 3;
    case 4: *cp = ((u[0] & 0x07) << 18) | ((u[1] & 0x3F) << 12) | ((u[2] & 0x3F) << 6) | (u[3] & 0x3F); return 4;
    default: *cp = 0xFFFD; return 1;
    }
}

int tok_utf8_encode(int32_t cp, char out[4]) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// ---- hash maps
static size_t map_capacity(size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2 + 1) cap *= 2;  // load factor <= 0.5
    return cap;
}

atomc_status tok_strmap_init(struct tok_strmap *m, size_t expected, struct error *err) {
    size_t cap = map_capacity(expected);
    m->slots = calloc(cap, sizeof *m->slots);
    if (!m->slots) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: vocabulary map of %zu entries", cap);
    m->mask = cap - 1;
    m->count = 0;
    return ATOMC_OK;
}

static void strmap_grow(struct tok_strmap *m) {
    size_t cap = (m->mask + 1) * 2;
    struct tok_strmap_slot *slots = calloc(cap, sizeof *slots);
    if (!slots) return;  // stays correct, just fuller
    for (size_t i = 0; i <= m->mask; i++) {
        struct tok_strmap_slot *s = &m->slots[i];
        if (!s->key) continue;
        size_t h = (size_t)XXH3_64bits(s->key, s->len) & (cap - 1);
        while (slots[h].key) h = (h + 1) & (cap - 1);
        slots[h] = *s;
    }
    free(m->slots);
    m->slots = slots;
    m->mask = cap - 1;
}

void tok_strmap_put(struct tok_strmap *m, const char *key, size_t len, int32_t value) {
    if ((m->count + 1) * 4 > (m->mask + 1) * 3) strmap_grow(m);
    size_t h = (size_t)XXH3_64bits(key, len) & m->mask;
    for (;;) {
        struct tok_strmap_slot *s = &m->slots[h];
        if (!s->key) {
            if ((m->count + 1) > m->mask) return;  // full (only if growth failed): drop
            *s = (struct tok_strmap_slot){.key = key, .len = (uint32_t)len, .value = value};
            m->count++;
            return;
        }
        if (s->len == len && !memcmp(s->key, key, len)) {
            s->value = value;
            return;
        }
        h = (h + 1) & m->mask;
    }
}

int32_t tok_strmap_get(const struct tok_strmap *m, const char *key, size_t len) {
    if (!m->slots) return -1;
    size_t h = (size_t)XXH3_64bits(key, len) & m->mask;
    for (;;) {
        const struct tok_strmap_slot *s = &m->slots[h];
        if (!s->key) return -1;
        if (s->len == len && !memcmp(s->key, key, len)) return s->value;
        h = (h + 1) & m->mask;
    }
}

void tok_strmap_free(struct tok_strmap *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

static inline size_t merge_hash(uint64_t key, size_t mask) {
    return (size_t)XXH3_64bits(&key, sizeof key) & mask;
}

atomc_status tok_mergemap_init(struct tok_mergemap *m, size_t expected, struct error *err) {
    size_t cap = map_capacity(expected);
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: merge map of %zu entries", cap);
    for (size_t i = 0; i < cap; i++) m->slots[i].key = UINT64_MAX;
    m->mask = cap - 1;
    m->count = 0;
    return ATOMC_OK;
}

void tok_mergemap_put(struct tok_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    if (m->count + 1 > m->mask / 2) return;  // sized by init from the merge count; never exceeded
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t h = merge_hash(key, m->mask);
    while (m->slots[h].key != UINT64_MAX) {
        if (m->slots[h].key == key) return;
        h = (h + 1) & m->mask;
    }
    m->slots[h] = (struct tok_merge_slot){.key = key, .rank = rank, .new_id = new_id};
    m->count++;
}

const struct tok_merge_slot *tok_mergemap_get(const struct tok_mergemap *m, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t h = merge_hash(key, m->mask);
    for (;;) {
        const struct tok_merge_slot *s = &m->slots[h];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
        h = (h + 1) & m->mask;
    }
}

void tok_mergemap_free(struct tok_mergemap *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}
