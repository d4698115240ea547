// GGUF reader. See gguf.h for the contract. Parsing is a single forward pass over a
// bounds-checked cursor; every count read from the file is checked against the bytes
// that remain before anything is allocated for it (each element needs at least one
// byte on disk), so allocations are bounded by the file size.
#include "loader/gguf.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

// ---------------------------------------------------------------------------------
// String arena: chunks of NUL-terminated copies, freed together.

struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    char data[];
};

static char *arena_copy(void **arena, const unsigned char *src, uint64_t len) {
    struct arena_chunk *c = *arena;
    size_t need = (size_t)len + 1;
    if (!c || c->cap - c->used < need) {
        size_t cap = need > (1u << 20) ? need : (1u << 20);
        struct arena_chunk *n = malloc(sizeof *n + cap);
        if (!n) return NULL;
        n->next = c;
        n->used = 0;
        n->cap = cap;
        *arena = n;
        c = n;
    }
    char *dst = c->data + c->used;
    if (len) memcpy(dst, src, (size_t)len);
    dst[len] = '\0';
    c->used += need;
    return dst;
}

static void arena_free(void *arena) {
    struct arena_chunk *c = arena;
    while (c) {
        struct arena_chunk *n = c->next;
        free(c);
        c = n;
    }
}

// ---------------------------------------------------------------------------------
// Type tables.

const char *gguf_type_name(enum gguf_type t) {
    static const char *names[GGUF_TYPE_COUNT] = {"uint8", "int8",  "uint16", "int16", "uint32", "int32",  "float32",
                                                 "bool",  "string", "array", "uint64", "int64", "float64"};
    return (unsigned)t < GGUF_TYPE_COUNT ? names[t] : "invalid";
}

// Bytes of one scalar of a fixed-size metadata type; 0 for STRING/ARRAY/invalid.
static size_t gguf_scalar_size(enum gguf_type t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

struct ggml_type_desc {
    const char *name;
    int block_elems; // 0 = unknown id
    int block_bytes;
};

static struct ggml_type_desc ggml_type_desc(uint32_t t) {
    switch (t) {
    case 0: return (struct ggml_type_desc){"F32", 1, 4};
    case 1: return (struct ggml_type_desc){"F16", 1, 2};
    case 2: return (struct ggml_type_desc){"Q4_0", 32, 18};
    case 3: return (struct ggml_type_desc){"Q4_1", 32, 20};
    case 6: return (struct ggml_type_desc){"Q5_0", 32, 22};
    case 7: return (struct ggml_type_desc){"Q5_1", 32, 24};
    case 8: return (struct ggml_type_desc){"Q8_0", 32, 34};
    case 9: return (struct ggml_type_desc){"Q8_1", 32, 40};
    case 10: return (struct ggml_type_desc){"Q2_K", 256, 84};
    case 11: return (struct ggml_type_desc){"Q3_K", 256, 110};
    case 12: return (struct ggml_type_desc){"Q4_K", 256, 144};
    case 13: return (struct ggml_type_desc){"Q5_K", 256, 176};
    case 14: return (struct ggml_type_desc){"Q6_K", 256, 210};
    case 15: return (struct ggml_type_desc){"Q8_K", 256, 292};
    case 16: return (struct ggml_type_desc){"IQ2_XXS", 256, 66};
    case 17: return (struct ggml_type_desc){"IQ2_XS", 256, 74};
    case 18: return (struct ggml_type_desc){"IQ3_XXS", 256, 98};
    case 19: return (struct ggml_type_desc){"IQ1_S", 256, 50};
    case 20: return (struct ggml_type_desc){"IQ4_NL", 32, 18};
    case 21: return (struct ggml_type_desc){"IQ3_S", 256, 110};
    case 22: return (struct ggml_type_desc){"IQ2_S", 256, 82};
    case 23: return (struct ggml_type_desc){"IQ4_XS", 256, 136};
    case 24: return (struct ggml_type_desc){"I8", 1, 1};
    case 25: return (struct ggml_type_desc){"I16", 1, 2};
    case 26: return (struct ggml_type_desc){"I32", 1, 4};
    case 27: return (struct ggml_type_desc){"I64", 1, 8};
    case 28: return (struct ggml_type_desc){"F64", 1, 8};
    case 29: return (struct ggml_type_desc){"IQ1_M", 256, 56};
    case 30: return (struct ggml_type_desc){"BF16", 1, 2};
    case 34: return (struct ggml_type_desc){"TQ1_0", 256, 54};
    case 35: return (struct ggml_type_desc){"TQ2_0", 256, 66};
    case 39: return (struct ggml_type_desc){"MXFP4", 32, 17};
    case 40: return (struct ggml_type_desc){"NVFP4", 64, 36};
    case 41: return (struct ggml_type_desc){"Q1_0", 128, 18};
    default: return (struct ggml_type_desc){"unknown", 0, 0};
    }
}

const char *ggml_type_name(uint32_t t) { return ggml_type_desc(t).name; }

static bool ggml_type_to_dtype(uint32_t t, enum dtype *out) {
    switch (t) {
    case GGML_TYPE_F32: *out = DTYPE_F32; return true;
    case GGML_TYPE_F16: *out = DTYPE_F16; return true;
    case GGML_TYPE_BF16: *out = DTYPE_BF16; return true;
    case GGML_TYPE_Q8_0: *out = DTYPE_Q8_0; return true;
    case GGML_TYPE_Q4_0: *out = DTYPE_Q4_0; return true;
    case GGML_TYPE_Q4_1: *out = DTYPE_Q4_1; return true;
    case GGML_TYPE_Q4_K: *out = DTYPE_Q4_K; return true;
    case GGML_TYPE_Q5_K: *out = DTYPE_Q5_K; return true;
    case GGML_TYPE_Q6_K: *out = DTYPE_Q6_K; return true;
    case GGML_TYPE_Q8_K: *out = DTYPE_Q8_K; return true;
    default: return false;
    }
}

// ---------------------------------------------------------------------------------
// Bounds-checked little-endian cursor.

struct cursor {
    const unsigned char *p;
    size_t size, pos;
    const char *name; // file name for messages
    struct error *err;
};

static uint64_t rd_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

// Adds context after the file name: "<file>: <ctx><rest of the message>". Returns st, so
// callers keep the original status even when err is NULL.
static atomc_status with_ctx(atomc_status st, struct error *err, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static atomc_status with_ctx(atomc_status st, struct error *err, const char *path, const char *fmt, ...) {
    if (!err || st == ATOMC_OK) return st;
    char ctx[ERROR_MSG_MAX], tmp[3 * ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx, sizeof ctx, fmt, ap);
    va_end(ap);
    const char *rest = err->msg;
    size_t pl = strlen(path);
    if (strncmp(rest, path, pl) == 0 && rest[pl] == ':' && rest[pl + 1] == ' ') rest += pl + 2;
    snprintf(tmp, sizeof tmp, "%s: %s%s", path, ctx, rest);
    size_t n = strnlen(tmp, sizeof err->msg - 1);
    memcpy(err->msg, tmp, n);
    err->msg[n] = '\0';
    return st;
}

static atomc_status cur_need(struct cursor *c, uint64_t n, const char *what) {
    if (n > c->size - c->pos)
        return error_set(c->err, ATOMC_ERR_FORMAT,
                         "%s: truncated GGUF header: %s needs %" PRIu64 " bytes at offset %zu but the file has %zu",
                         c->name, what, n, c->pos, c->size);
    return ATOMC_OK;
}

static atomc_status cur_u32(struct cursor *c, uint32_t *v, const char *what) {
    atomc_status st = cur_need(c, 4, what);
    if (st) return st;
    *v = (uint32_t)rd_le(c->p + c->pos, 4);
    c->pos += 4;
    return ATOMC_OK;
}

static atomc_status cur_u64(struct cursor *c, uint64_t *v, const char *what) {
    atomc_status st = cur_need(c, 8, what);
    if (st) return st;
    *v = rd_le(c->p + c->pos, 8);
    c->pos += 8;
    return ATOMC_OK;
}

// Reads a GGUF string (u64 length + bytes) into the arena.
static atomc_status cur_string(struct cursor *c, void **arena, struct gguf_string *out, const char *what) {
    uint64_t len;
    atomc_status st = cur_u64(c, &len, what);
    if (st) return st;
    if ((st = cur_need(c, len, what))) return st;
    out->s = arena_copy(arena, c->p + c->pos, len);
    if (!out->s) return error_set(c->err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory reading %s", c->name, what);
    out->len = len;
    c->pos += (size_t)len;
    return ATOMC_OK;
}

static void value_free(struct gguf_value *v) {
    if (v->type != GGUF_TYPE_ARRAY) return;
    free(v->strs);
    if (v->items) {
        for (uint64_t i = 0; i < v->arr_len; i++) value_free(&v->items[i]);
        free(v->items);
    }
    v->strs = NULL;
    v->items = NULL;
}

// A fixed-size scalar's little-endian bits `raw` into the union member its type uses: signed
// types sign-extended into i64, floats widened into f64, unsigned and bool into u64.
static void scalar_from_raw(enum gguf_type type, uint64_t raw, struct gguf_value *v) {
    switch (type) {
    case GGUF_TYPE_INT8: v->v.i64 = (int8_t)raw; break;
    case GGUF_TYPE_INT16: v->v.i64 = (int16_t)raw; break;
    case GGUF_TYPE_INT32: v->v.i64 = (int32_t)raw; break;
    case GGUF_TYPE_INT64: v->v.i64 = (int64_t)raw; break;
    case GGUF_TYPE_FLOAT32: {
        uint32_t u = (uint32_t)raw;
        float f;
        memcpy(&f, &u, 4);
        v->v.f64 = f;
        break;
    }
    case GGUF_TYPE_FLOAT64: memcpy(&v->v.f64, &raw, 8); break;
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_UINT64:
    case GGUF_TYPE_BOOL: v->v.u64 = raw; break;
    default: CHECK(0); // only called for the types gguf_scalar_size knows
    }
}

static atomc_status read_value(struct cursor *c, void **arena, enum gguf_type type, struct gguf_value *v,
                               const char *key, int depth);

static atomc_status read_array(struct cursor *c, void **arena, struct gguf_value *v, const char *key, int depth) {
    if (depth >= GGUF_MAX_ARRAY_DEPTH)
        return error_set(c->err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': arrays nested deeper than %d", c->name,
                         key, GGUF_MAX_ARRAY_DEPTH);
    uint32_t et;
    uint64_t n;
    atomc_status st;
    if ((st = cur_u32(c, &et, "array element type")) || (st = cur_u64(c, &n, "array length")))
        return with_ctx(st, c->err, c->name, "metadata key '%s': ", key);
    if (et >= GGUF_TYPE_COUNT)
        return error_set(c->err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': invalid array element type %u", c->name, key,
                         et);
    v->arr_type = (enum gguf_type)et;
    size_t remaining = c->size - c->pos;
    size_t es = gguf_scalar_size(v->arr_type);
    if (es) {
        if (n > remaining / es)
            return error_set(c->err, ATOMC_ERR_FORMAT,
                             "%s: metadata key '%s': array of %" PRIu64 " %s elements runs past the end of the file",
                             c->name, key, n, gguf_type_name(v->arr_type));
        v->raw = c->p + c->pos;
        v->arr_len = n;
        c->pos += (size_t)(n * es);
        if (v->arr_type == GGUF_TYPE_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (v->raw[i] > 1)
                    return error_set(c->err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': bool element %" PRIu64
                                     " has value %u", c->name, key, i, v->raw[i]);
        return ATOMC_OK;
    }
    // Strings take >= 8 bytes each, nested arrays >= 12: bound n before allocating.
    size_t min_elem = v->arr_type == GGUF_TYPE_STRING ? 8 : 12;
    if (n > remaining / min_elem)
        return error_set(c->err, ATOMC_ERR_FORMAT,
                         "%s: metadata key '%s': array of %" PRIu64 " %s elements runs past the end of the file",
                         c->name, key, n, gguf_type_name(v->arr_type));
    if (v->arr_type == GGUF_TYPE_STRING) {
        v->strs = calloc(n ? n : 1, sizeof *v->strs);
        if (!v->strs) return error_set(c->err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory reading '%s'", c->name, key);
        v->arr_len = n;
        for (uint64_t i = 0; i < n; i++)
            if ((st = cur_string(c, arena, &v->strs[i], "array string")))
                return with_ctx(st, c->err, c->name, "metadata key '%s' element %" PRIu64 ": ", key, i);
        return ATOMC_OK;
    }
    v->items = calloc(n ? n : 1, sizeof *v->items);
    if (!v->items) return error_set(c->err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory reading '%s'", c->name, key);
    v->arr_len = n;
    for (uint64_t i = 0; i < n; i++) {
        v->items[i].type = GGUF_TYPE_ARRAY;
        if ((st = read_array(c, arena, &v->items[i], key, depth + 1))) {
            v->arr_len = i + 1; // free what was built
            return st;
        }
    }
    return ATOMC_OK;
}

static atomc_status read_value(struct cursor *c, void **arena, enum gguf_type type, struct gguf_value *v,
                               const char *key, int depth) {
    memset(v, 0, sizeof *v);
    v->type = type;
    atomc_status st;
    size_t es = gguf_scalar_size(type);
    if (es) {
        if ((st = cur_need(c, es, "metadata value"))) return with_ctx(st, c->err, c->name, "metadata key '%s': ", key);
        uint64_t raw = rd_le(c->p + c->pos, (int)es);
        c->pos += es;
        if (type == GGUF_TYPE_BOOL && raw > 1)
            return error_set(c->err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': bool has value %" PRIu64, c->name,
                             key, raw);
        scalar_from_raw(type, raw, v);
        return ATOMC_OK;
    }
    if (type == GGUF_TYPE_STRING) {
        if ((st = cur_string(c, arena, &v->v.str, "string value")))
            return with_ctx(st, c->err, c->name, "metadata key '%s': ", key);
        return ATOMC_OK;
    }
    if (type == GGUF_TYPE_ARRAY) return read_array(c, arena, v, key, depth);
    return error_set(c->err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': invalid value type %u", c->name, key,
                     (unsigned)type);
}

// ---------------------------------------------------------------------------------
// Open / close.

// Keys are compared as byte strings (they may, in principle, contain NUL bytes).
static int cmp_bytes(const char *a, uint64_t alen, const char *b, uint64_t blen) {
    int c = memcmp(a, b, (size_t)(alen < blen ? alen : blen));
    if (c) return c;
    return alen < blen ? -1 : alen > blen ? 1 : 0;
}

static int cmp_kv(const void *a, const void *b) {
    const struct gguf_kv *x = *(struct gguf_kv *const *)a, *y = *(struct gguf_kv *const *)b;
    return cmp_bytes(x->key.s, x->key.len, y->key.s, y->key.len);
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp((*(struct gguf_tensor_info *const *)a)->name, (*(struct gguf_tensor_info *const *)b)->name);
}

void gguf_close(struct gguf_file *g) {
    if (!g) return;
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) value_free(&g->kv[i].value);
    free(g->kv);
    free(g->tensors);
    free(g->kv_by_key);
    free(g->tensors_by_name);
    arena_free(g->arena);
    if (g->map.data || g->map.path) mapped_file_close(&g->map);
    free(g->path);
    free(g);
}

static atomc_status check_no_overlap(struct gguf_file *g, struct error *err);

static atomc_status gguf_parse(struct gguf_file *g, struct error *err) {
    struct cursor c = {.p = g->data, .size = g->size, .pos = 0, .name = g->path, .err = err};
    atomc_status st;
    if (g->size < 4 || memcmp(g->data, GGUF_MAGIC, 4) != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: not a GGUF file (bad magic)", g->path);
    c.pos = 4;
    if ((st = cur_u32(&c, &g->version, "version"))) return st;
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: big-endian GGUF files are not supported", g->path);
    if (g->version == 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: GGUF version 1 is not supported (need 2 or 3)", g->path);
    if (g->version != 2 && g->version != 3)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: unknown GGUF version %u", g->path, g->version);
    if ((st = cur_u64(&c, &g->n_tensors, "tensor count")) || (st = cur_u64(&c, &g->n_kv, "metadata count")))
        return st;
    // Each kv needs >= 13 bytes (key length, empty key, type, 1-byte value); each tensor
    // info >= 24 (name length, ndim, type, offset).
    if (g->n_kv > (g->size - c.pos) / 13)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata count %" PRIu64 " is larger than the file allows",
                         g->path, g->n_kv);
    if (g->n_tensors > (g->size - c.pos) / 24)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor count %" PRIu64 " is larger than the file allows",
                         g->path, g->n_tensors);
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    uint64_t n_kv_total = g->n_kv;
    g->n_kv = 0; // count of parsed entries, for cleanup
    if (!g->kv) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", g->path);
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < n_kv_total; i++) {
        struct gguf_kv *kv = &g->kv[i];
        if ((st = cur_string(&c, &g->arena, &kv->key, "metadata key")))
            return with_ctx(st, err, g->path, "metadata entry %" PRIu64 ": ", i);
        uint32_t type;
        if ((st = cur_u32(&c, &type, "metadata value type"))) return with_ctx(st, err, g->path, "key '%s': ", kv->key.s);
        g->n_kv = i + 1;
        if (type >= GGUF_TYPE_COUNT)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': invalid value type %u", g->path,
                             kv->key.s, type);
        if ((st = read_value(&c, &g->arena, (enum gguf_type)type, &kv->value, kv->key.s, 0))) return st;
    }
    g->kv_by_key = malloc((g->n_kv ? g->n_kv : 1) * sizeof *g->kv_by_key);
    if (!g->kv_by_key) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_kv; i++) g->kv_by_key[i] = &g->kv[i];
    qsort(g->kv_by_key, g->n_kv, sizeof *g->kv_by_key, cmp_kv);
    for (uint64_t i = 1; i < g->n_kv; i++)
        if (cmp_kv(&g->kv_by_key[i - 1], &g->kv_by_key[i]) == 0)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: duplicate metadata key '%s'", g->path, g->kv_by_key[i]->key.s);
    const struct gguf_value *al = gguf_get_value(g, "general.alignment");
    if (al) {
        uint32_t a;
        if ((st = gguf_get_u32(g, "general.alignment", &a, err))) return st;
        if (a == 0 || (a & (a - 1)) != 0)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: general.alignment %u is not a power of two", g->path, a);
        g->alignment = a;
    }

    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->tensors) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor_info *t = &g->tensors[i];
        struct gguf_string name;
        if ((st = cur_string(&c, &g->arena, &name, "tensor name")))
            return with_ctx(st, err, g->path, "tensor info %" PRIu64 ": ", i);
        t->name = name.s;
        uint32_t nd;
        if ((st = cur_u32(&c, &nd, "tensor ndim"))) return with_ctx(st, err, g->path, "tensor '%s': ", t->name);
        if (nd == 0 || nd > GGUF_MAX_DIMS)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': %u dimensions (must be 1..%d)", g->path, t->name,
                             nd, GGUF_MAX_DIMS);
        t->ndim = (int)nd;
        uint64_t dims[GGUF_MAX_DIMS];
        uint64_t numel = 1;
        for (uint32_t d = 0; d < nd; d++) {
            if ((st = cur_u64(&c, &dims[d], "tensor dimension"))) return with_ctx(st, err, g->path, "tensor '%s': ", t->name);
            if (dims[d] == 0 || dims[d] > (uint64_t)INT64_MAX || numel > (uint64_t)INT64_MAX / dims[d])
                return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': invalid dimension %" PRIu64, g->path,
                                 t->name, dims[d]);
            numel *= dims[d];
        }
        for (uint32_t d = 0; d < nd; d++) t->ne[d] = (int64_t)dims[nd - 1 - d];
        if ((st = cur_u32(&c, &t->ggml_type, "tensor type")) || (st = cur_u64(&c, &t->offset, "tensor offset")))
            return with_ctx(st, err, g->path, "tensor '%s': ", t->name);
        struct ggml_type_desc td = ggml_type_desc(t->ggml_type);
        t->supported = ggml_type_to_dtype(t->ggml_type, &t->dtype);
        if (td.block_elems) {
            if (dims[0] % (uint64_t)td.block_elems != 0)
                return error_set(err, ATOMC_ERR_FORMAT,
                                 "%s: tensor '%s': innermost dimension %" PRIu64 " is not a multiple of the %s block "
                                 "size %d", g->path, t->name, dims[0], td.name, td.block_elems);
            uint64_t blocks = numel / (uint64_t)td.block_elems;
            if (blocks > UINT64_MAX / (uint64_t)td.block_bytes)
                return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': size overflows", g->path, t->name);
            t->nbytes = blocks * (uint64_t)td.block_bytes;
        }
        if (t->offset % g->alignment != 0)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': data offset %" PRIu64
                             " is not a multiple of the alignment %u", g->path, t->name, t->offset, g->alignment);
    }
    g->tensors_by_name = malloc((g->n_tensors ? g->n_tensors : 1) * sizeof *g->tensors_by_name);
    if (!g->tensors_by_name) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_tensors; i++) g->tensors_by_name[i] = &g->tensors[i];
    qsort(g->tensors_by_name, g->n_tensors, sizeof *g->tensors_by_name, cmp_tensor);
    for (uint64_t i = 1; i < g->n_tensors; i++)
        if (strcmp(g->tensors_by_name[i - 1]->name, g->tensors_by_name[i]->name) == 0)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: duplicate tensor name '%s'", g->path,
                             g->tensors_by_name[i]->name);
    uint64_t pad = (g->alignment - c.pos % g->alignment) % g->alignment;
    g->data_offset = c.pos + pad;
    if (g->n_tensors > 0 && g->data_offset > g->size)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: truncated: tensor data section starts at %" PRIu64
                         " but the file has %zu bytes", g->path, g->data_offset, g->size);
    uint64_t data_size = g->data_offset <= g->size ? g->size - g->data_offset : 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor_info *t = &g->tensors[i];
        if (!t->nbytes) continue; // unknown type: cannot check, never served
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return error_set(err, ATOMC_ERR_FORMAT,
                             "%s: tensor '%s': data [%" PRIu64 ", %" PRIu64 ") runs past the end of the file "
                             "(data section holds %" PRIu64 " bytes; truncated file?)",
                             g->path, t->name, t->offset, t->offset + t->nbytes, data_size);
        t->data = g->data + g->data_offset + t->offset;
    }
    return check_no_overlap(g, err);
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const struct gguf_tensor_info *x = *(const struct gguf_tensor_info *const *)a, *y = *(const struct gguf_tensor_info *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

// No two tensors of known size may share bytes (a crafted file could alias weights).
static atomc_status check_no_overlap(struct gguf_file *g, struct error *err) {
    if (g->n_tensors < 2) return ATOMC_OK;
    struct gguf_tensor_info **by = malloc(g->n_tensors * sizeof *by);
    if (!by) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", g->path);
    size_t n = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].nbytes) by[n++] = &g->tensors[i];
    qsort(by, n, sizeof *by, cmp_tensor_offset);
    atomc_status st = ATOMC_OK;
    const struct gguf_tensor_info *prev = NULL;
    for (size_t i = 0; i < n && !st; i++) {
        const struct gguf_tensor_info *t = by[i];
        if (prev && t->offset < prev->offset + prev->nbytes)
            st = error_set(err, ATOMC_ERR_FORMAT,
                           "%s: tensors '%s' [%" PRIu64 ", %" PRIu64 ") and '%s' [%" PRIu64 ", %" PRIu64 ") overlap",
                           g->path, prev->name, prev->offset, prev->offset + prev->nbytes, t->name, t->offset,
                           t->offset + t->nbytes);
        if (!prev || t->offset + t->nbytes > prev->offset + prev->nbytes) prev = t;
    }
    free(by);
    return st;
}

static atomc_status gguf_open_common(struct gguf_file *g, struct gguf_file **out, struct error *err) {
    atomc_status st = gguf_parse(g, err);
    if (st) {
        gguf_close(g);
        return st;
    }
    *out = g;
    return ATOMC_OK;
}

atomc_status gguf_open_memory(struct gguf_file **out, const void *data, size_t size, const char *name,
                              struct error *err) {
    *out = NULL;
    struct gguf_file *g = xcalloc(1, sizeof *g);
    g->path = xstrdup(name ? name : "(memory)");
    g->data = data;
    g->size = size;
    return gguf_open_common(g, out, err);
}

atomc_status gguf_open(struct gguf_file **out, const char *path, struct error *err) {
    *out = NULL;
    struct gguf_file *g = xcalloc(1, sizeof *g);
    g->path = xstrdup(path);
    atomc_status st = mapped_file_open(&g->map, path, err);
    if (st) {
        gguf_close(g);
        return st;
    }
    g->data = g->map.data;
    g->size = g->map.size;
    return gguf_open_common(g, out, err);
}

// ---------------------------------------------------------------------------------
// Metadata accessors.

int64_t gguf_find_key(const struct gguf_file *g, const char *key) {
    struct gguf_kv probe = {.key = {.s = key, .len = strlen(key)}};
    const struct gguf_kv *pp = &probe;
    struct gguf_kv **hit = bsearch(&pp, g->kv_by_key, g->n_kv, sizeof *g->kv_by_key, cmp_kv);
    return hit ? (int64_t)(*hit - g->kv) : -1;
}

const struct gguf_value *gguf_get_value(const struct gguf_file *g, const char *key) {
    int64_t i = gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i].value;
}

bool gguf_has_key(const struct gguf_file *g, const char *key) { return gguf_find_key(g, key) >= 0; }

static atomc_status get_typed(const struct gguf_file *g, const char *key, const struct gguf_value **v,
                              struct error *err) {
    *v = gguf_get_value(g, key);
    if (!*v) return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: metadata key '%s' not found", g->path, key);
    return ATOMC_OK;
}

static bool is_uint(enum gguf_type t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_UINT64;
}
static bool is_sint(enum gguf_type t) {
    return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_INT64;
}

// Integer value as (negative?, magnitude) so every width/sign coerces exactly.
static bool value_int(const struct gguf_value *v, bool *neg, uint64_t *mag) {
    if (is_uint(v->type)) {
        *neg = false;
        *mag = v->v.u64;
        return true;
    }
    if (is_sint(v->type)) {
        *neg = v->v.i64 < 0;
        *mag = *neg ? (uint64_t)0 - (uint64_t)v->v.i64 : (uint64_t)v->v.i64;
        return true;
    }
    return false;
}

static atomc_status get_int_range(const struct gguf_file *g, const char *key, int64_t lo, uint64_t hi, bool *neg,
                                  uint64_t *mag, struct error *err) {
    const struct gguf_value *v;
    atomc_status st = get_typed(g, key, &v, err);
    if (st) return st;
    if (!value_int(v, neg, mag))
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' has type %s, expected an integer", g->path, key,
                         gguf_type_name(v->type));
    bool ok = *neg ? (lo < 0 && *mag <= (uint64_t)0 - (uint64_t)lo) : *mag <= hi;
    if (!ok)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' value %s%" PRIu64 " is out of range", g->path,
                         key, *neg ? "-" : "", *mag);
    return ATOMC_OK;
}

atomc_status gguf_get_u32(const struct gguf_file *g, const char *key, uint32_t *out, struct error *err) {
    bool neg;
    uint64_t m;
    atomc_status st = get_int_range(g, key, 0, UINT32_MAX, &neg, &m, err);
    if (!st) *out = (uint32_t)m;
    return st;
}

atomc_status gguf_get_i32(const struct gguf_file *g, const char *key, int32_t *out, struct error *err) {
    bool neg;
    uint64_t m;
    atomc_status st = get_int_range(g, key, INT32_MIN, INT32_MAX, &neg, &m, err);
    if (!st) *out = neg ? (int32_t)(-(int64_t)m) : (int32_t)m;
    return st;
}

atomc_status gguf_get_u64(const struct gguf_file *g, const char *key, uint64_t *out, struct error *err) {
    bool neg;
    uint64_t m;
    atomc_status st = get_int_range(g, key, 0, UINT64_MAX, &neg, &m, err);
    if (!st) *out = m;
    return st;
}

atomc_status gguf_get_i64(const struct gguf_file *g, const char *key, int64_t *out, struct error *err) {
    bool neg;
    uint64_t m;
    atomc_status st = get_int_range(g, key, INT64_MIN, INT64_MAX, &neg, &m, err);
    if (!st) *out = neg ? (int64_t)((uint64_t)0 - m) : (int64_t)m;
    return st;
}

atomc_status gguf_get_f32(const struct gguf_file *g, const char *key, float *out, struct error *err) {
    const struct gguf_value *v;
    atomc_status st = get_typed(g, key, &v, err);
    if (st) return st;
    if (v->type != GGUF_TYPE_FLOAT32 && v->type != GGUF_TYPE_FLOAT64)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' has type %s, expected a float", g->path, key,
                         gguf_type_name(v->type));
    *out = (float)v->v.f64;
    return ATOMC_OK;
}

atomc_status gguf_get_bool(const struct gguf_file *g, const char *key, bool *out, struct error *err) {
    const struct gguf_value *v;
    atomc_status st = get_typed(g, key, &v, err);
    if (st) return st;
    bool neg;
    uint64_t m;
    if (v->type == GGUF_TYPE_BOOL) *out = v->v.u64 != 0;
    else if (value_int(v, &neg, &m)) *out = m != 0;
    else
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' has type %s, expected a bool", g->path, key,
                         gguf_type_name(v->type));
    return ATOMC_OK;
}

atomc_status gguf_get_str(const struct gguf_file *g, const char *key, const char **out, size_t *len,
                          struct error *err) {
    const struct gguf_value *v;
    atomc_status st = get_typed(g, key, &v, err);
    if (st) return st;
    if (v->type != GGUF_TYPE_STRING)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' has type %s, expected a string", g->path, key,
                         gguf_type_name(v->type));
    *out = v->v.str.s;
    if (len) *len = (size_t)v->v.str.len;
    return ATOMC_OK;
}

atomc_status gguf_get_arr_info(const struct gguf_file *g, const char *key, enum gguf_type *elem_type, uint64_t *n,
                               struct error *err) {
    const struct gguf_value *v;
    atomc_status st = get_typed(g, key, &v, err);
    if (st) return st;
    if (v->type != GGUF_TYPE_ARRAY)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' has type %s, expected an array", g->path, key,
                         gguf_type_name(v->type));
    if (elem_type) *elem_type = v->arr_type;
    if (n) *n = v->arr_len;
    return ATOMC_OK;
}

bool gguf_value_arr_str(const struct gguf_value *v, uint64_t i, const char **out, size_t *len) {
    if (v->type != GGUF_TYPE_ARRAY || v->arr_type != GGUF_TYPE_STRING || i >= v->arr_len) return false;
    *out = v->strs[i].s;
    if (len) *len = (size_t)v->strs[i].len;
    return true;
}

// Element i of a fixed-size scalar array as a scalar gguf_value.
static bool arr_scalar(const struct gguf_value *v, uint64_t i, struct gguf_value *e) {
    size_t es = gguf_scalar_size(v->arr_type);
    if (v->type != GGUF_TYPE_ARRAY || !es || i >= v->arr_len) return false;
    uint64_t raw = rd_le(v->raw + i * es, (int)es);
    memset(e, 0, sizeof *e);
    e->type = v->arr_type;
    scalar_from_raw(v->arr_type, raw, e);
    return true;
}

bool gguf_value_arr_i64(const struct gguf_value *v, uint64_t i, int64_t *out) {
    struct gguf_value e;
    if (!arr_scalar(v, i, &e)) return false;
    if (is_sint(e.type)) *out = e.v.i64;
    else if (is_uint(e.type) || e.type == GGUF_TYPE_BOOL) {
        if (e.v.u64 > (uint64_t)INT64_MAX) return false;
        *out = (int64_t)e.v.u64;
    } else return false;
    return true;
}

bool gguf_value_arr_f64(const struct gguf_value *v, uint64_t i, double *out) {
    struct gguf_value e;
    if (!arr_scalar(v, i, &e)) return false;
    if (e.type == GGUF_TYPE_FLOAT32 || e.type == GGUF_TYPE_FLOAT64) *out = e.v.f64;
    else if (is_sint(e.type)) *out = (double)e.v.i64;
    else if (is_uint(e.type)) *out = (double)e.v.u64;
    else return false;
    return true;
}

atomc_status gguf_get_arr_str(const struct gguf_file *g, const char *key, uint64_t i, const char **out, size_t *len,
                              struct error *err) {
    enum gguf_type et;
    uint64_t n;
    atomc_status st = gguf_get_arr_info(g, key, &et, &n, err);
    if (st) return st;
    if (et != GGUF_TYPE_STRING)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' is an array of %s, expected strings", g->path,
                         key, gguf_type_name(et));
    if (i >= n)
        return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: metadata key '%s': index %" PRIu64 " out of range (%" PRIu64
                         " elements)", g->path, key, i, n);
    gguf_value_arr_str(gguf_get_value(g, key), i, out, len);
    return ATOMC_OK;
}

static atomc_status arr_check(const struct gguf_file *g, const char *key, uint64_t n, const struct gguf_value **v,
                              struct error *err) {
    enum gguf_type et;
    uint64_t have;
    atomc_status st = gguf_get_arr_info(g, key, &et, &have, err);
    if (st) return st;
    if (!gguf_scalar_size(et) || et == GGUF_TYPE_BOOL)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' is an array of %s, expected numbers", g->path,
                         key, gguf_type_name(et));
    if (have != n)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' has %" PRIu64 " elements, expected %" PRIu64,
                         g->path, key, have, n);
    *v = gguf_get_value(g, key);
    return ATOMC_OK;
}

atomc_status gguf_get_arr_i32(const struct gguf_file *g, const char *key, int32_t *out, uint64_t n,
                              struct error *err) {
    const struct gguf_value *v;
    atomc_status st = arr_check(g, key, n, &v, err);
    if (st) return st;
    if (v->arr_type == GGUF_TYPE_FLOAT32 || v->arr_type == GGUF_TYPE_FLOAT64)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' is an array of %s, expected integers", g->path,
                         key, gguf_type_name(v->arr_type));
    for (uint64_t i = 0; i < n; i++) {
        int64_t x;
        if (!gguf_value_arr_i64(v, i, &x) || x < INT32_MIN || x > INT32_MAX)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s': element %" PRIu64 " does not fit in int32",
                             g->path, key, i);
        out[i] = (int32_t)x;
    }
    return ATOMC_OK;
}

atomc_status gguf_get_arr_f32(const struct gguf_file *g, const char *key, float *out, uint64_t n,
                              struct error *err) {
    const struct gguf_value *v;
    atomc_status st = arr_check(g, key, n, &v, err);
    if (st) return st;
    for (uint64_t i = 0; i < n; i++) {
        double x = 0;
        gguf_value_arr_f64(v, i, &x);
        out[i] = (float)x;
    }
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------
// Tensors.

const struct gguf_tensor_info *gguf_find_tensor(const struct gguf_file *g, const char *name) {
    struct gguf_tensor_info probe = {.name = name};
    const struct gguf_tensor_info *pp = &probe;
    struct gguf_tensor_info **hit = bsearch(&pp, g->tensors_by_name, g->n_tensors, sizeof *g->tensors_by_name, cmp_tensor);
    return hit ? *hit : NULL;
}

atomc_status gguf_get_tensor(const struct gguf_file *g, const char *name, struct tensor *out, struct error *err) {
    const struct gguf_tensor_info *t = gguf_find_tensor(g, name);
    if (!t) return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: tensor '%s' not found", g->path, name);
    if (!t->supported) {
        struct ggml_type_desc td = ggml_type_desc(t->ggml_type);
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: tensor '%s' has GGML type %s (%u), which atomc does not support "
                         "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
                         g->path, name, td.name, t->ggml_type);
    }
    *out = tensor_make((void *)t->data, t->dtype, t->ndim, t->ne);
    return ATOMC_OK;
}
