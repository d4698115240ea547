// Value model support for the Jinja interpreter: arena, string builder, UTF-8 and
// Python-compatible text forms (str/repr of every value, json.dumps), equality and
// ordering with Python's rules, and conversion from jansson values.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/check.h"
#include "template/jinja_internal.h"

// ---------------------------------------------------------------- arena
struct arena_chunk {
    struct arena_chunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
};

void arena_init(struct arena *a, size_t limit) {
    a->head = NULL;
    a->used = 0;
    a->limit = limit;
}

void arena_free_all(struct arena *a) {
    struct arena_chunk *c = a->head;
    while (c) {
        struct arena_chunk *n = c->next;
        free(c);
        c = n;
    }
    a->head = NULL;
    a->used = 0;
}

void *arena_alloc(struct arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    struct arena_chunk *c = a->head;
    if (!c || c->size - c->used < n) {
        size_t size = n > 32768 ? n : 32768;
        if (c && c->size * 2 > size && c->size < ((size_t)4 << 20)) size = c->size * 2;
        if (a->limit && a->used + size + sizeof *c > a->limit) {
            size = n; // try the exact size before giving up
            if (a->used + size + sizeof *c > a->limit) return NULL;
        }
        c = malloc(sizeof *c + size);
        if (!c) return NULL;
        c->size = size;
        c->used = 0;
        c->next = a->head;
        a->head = c;
        a->used += size + sizeof *c;
    }
    void *p = c->data + c->used;
    c->used += n;
    return p;
}

// ---------------------------------------------------------------- sbuf
void sbuf_init(struct sbuf *b, size_t limit) {
    b->p = NULL;
    b->n = b->cap = 0;
    b->limit = limit;
    b->overflow = false;
}

void sbuf_free(struct sbuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

static bool sbuf_reserve(struct sbuf *b, size_t extra) {
    if (b->overflow) return false;
    if (b->limit && b->n + extra > b->limit) {
        b->overflow = true;
        return false;
    }
    if (b->n + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->overflow = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void sbuf_put(struct sbuf *b, const char *s, size_t n) {
    if (!n || !sbuf_reserve(b, n)) return;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

void sbuf_puts(struct sbuf *b, const char *s) { sbuf_put(b, s, strlen(s)); }

void sbuf_putc(struct sbuf *b, char c) { sbuf_put(b, &c, 1); }

void sbuf_printf(struct sbuf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    if ((size_t)k < sizeof tmp) {
        sbuf_put(b, tmp, (size_t)k);
        return;
    }
    if (!sbuf_reserve(b, (size_t)k)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)k;
}

void sbuf_put_utf8(struct sbuf *b, uint32_t cp) {
    char t[4];
    size_t n;
    if (cp < 0x80) {
        t[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        t[0] = (char)(0xC0 | (cp >> 6));
        t[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        t[0] = (char)(0xE0 | (cp >> 12));
        t[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        t[0] = (char)(0xF0 | (cp >> 18));
        t[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        t[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        t[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    sbuf_put(b, t, n);
}

// ---------------------------------------------------------------- UTF-8
uint32_t utf8_next(const char *s, size_t n, size_t *i) {
    const unsigned char *u = (const unsigned char *)s;
    size_t k = *i;
    uint32_t c = u[k];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (k + (size_t)len > n) len = 1;
    if (len == 1) {
        *i = k + 1;
        return c;
    }
    uint32_t cp = c & (0x3F >> (len - 1));
    for (int j = 1; j < len; j++) cp = (cp << 6) | (u[k + (size_t)j] & 0x3F);
    *i = k + (size_t)len;
    return cp;
}

size_t utf8_prev(const char *s, size_t i) {
    if (i == 0) return 0;
    i--;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    return i;
}

bool utf8_valid(const char *s, size_t n) {
    utf8proc_int32_t cp;
    size_t i = 0;
    while (i < n) {
        if ((unsigned char)s[i] < 0x80) {
            i++;
            continue;
        }
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

size_t utf8_count(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) c++;
    return c;
}

bool py_isspace(uint32_t cp) {
    if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20);
    switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
        return true;
    default:
        return cp >= 0x2000 && cp <= 0x200A;
    }
}

bool py_isprintable(uint32_t cp) {
    if (cp == ' ') return true;
    if (cp < 0x80) return cp > 0x20 && cp < 0x7F;
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_CS: case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN: case UTF8PROC_CATEGORY_ZL: case UTF8PROC_CATEGORY_ZP: case UTF8PROC_CATEGORY_ZS:
        return false;
    default:
        return true;
    }
}

uint32_t py_upper(uint32_t cp) {
    if (cp < 0x80) return (cp >= 'a' && cp <= 'z') ? cp - 32 : cp;
    return (uint32_t)utf8proc_toupper((utf8proc_int32_t)cp);
}

uint32_t py_lower(uint32_t cp) {
    if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
    return (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp);
}

bool py_iscased_letter(uint32_t cp) {
    if (cp < 0x80) return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z');
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}

// Python's float repr: the shortest digit string that round-trips, printed in fixed
// notation when the decimal exponent is in [-4, 16), else as d.ddde+XX.
void py_float_repr(double x, char buf[40]) {
    if (isnan(x)) {
        strcpy(buf, "nan");
        return;
    }
    if (isinf(x)) {
        strcpy(buf, x < 0 ? "-inf" : "inf");
        return;
    }
    char tmp[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, x);
        if (strtod(tmp, NULL) == x) break;
    }
    // tmp: [-]d[.ddd]e[+-]XX
    char digits[24];
    int nd = 0;
    const char *p = tmp;
    bool neg = false;
    if (*p == '-') {
        neg = true;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char *o = buf;
    if (neg) *o++ = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -exp10 - 1; i++) *o++ = '0';
            for (int i = 0; i < nd; i++) *o++ = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) *o++ = i < nd ? digits[i] : '0';
            *o++ = '.';
            if (nd > exp10 + 1)
                for (int i = exp10 + 1; i < nd; i++) *o++ = digits[i];
            else
                *o++ = '0';
        }
        *o = '\0';
    } else {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            for (int i = 1; i < nd; i++) *o++ = digits[i];
        }
        sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
}

// ---------------------------------------------------------------- values
const char *jv_type_name(const struct jv *v) {
    switch (v->t) {
    case JV_UNDEF: return "Undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST:
        switch (v->u.l->kind) {
        case JL_GENERATOR: return "generator";
        case JL_REVITER: return "list_reverseiterator";
        case JL_DICT_ITEMS: return "dict_items";
        case JL_DICT_KEYS: return "dict_keys";
        case JL_DICT_VALUES: return "dict_values";
        default: return v->u.l->is_tuple ? "tuple" : "list";
        }
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_FUNC: return "function";
    case JV_LOOP: return "LoopContext";
    }
    return "object";
}

bool jv_truthy(const struct jv *v) {
    switch (v->t) {
    case JV_UNDEF: case JV_NONE: return false;
    case JV_BOOL: return v->u.b;
    case JV_INT: return v->u.i != 0;
    case JV_FLOAT: return v->u.f != 0.0;
    case JV_STR: return v->u.s.n != 0;
    case JV_LIST: return jlist_is_iter(v->u.l) || v->u.l->n != 0;
    case JV_DICT: return v->u.d->n != 0;
    default: return true;
    }
}

bool jv_is_number(const struct jv *v) { return v->t == JV_BOOL || v->t == JV_INT || v->t == JV_FLOAT; }

double jv_as_double(const struct jv *v) {
    return v->t == JV_FLOAT ? v->u.f : v->t == JV_INT ? (double)v->u.i : v->t == JV_BOOL ? (double)v->u.b : 0.0;
}

static int64_t jv_as_int_exact(const struct jv *v) { return v->t == JV_INT ? v->u.i : (int64_t)v->u.b; }

bool jv_equal(const struct jv *a, const struct jv *b) {
    if (jv_is_number(a) && jv_is_number(b)) {
        if (a->t != JV_FLOAT && b->t != JV_FLOAT) return jv_as_int_exact(a) == jv_as_int_exact(b);
        return jv_as_double(a) == jv_as_double(b);
    }
    if (a->t != b->t) return false;
    switch (a->t) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.p, b->u.s.p, a->u.s.n);
    case JV_LIST:
        if (a->u.l == b->u.l) return true;
        if (jlist_is_iter(a->u.l) || jlist_is_iter(b->u.l) || a->u.l->kind != b->u.l->kind) return false;
        if (a->u.l->is_tuple != b->u.l->is_tuple || a->u.l->n != b->u.l->n) return false;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!jv_equal(&a->u.l->v[i], &b->u.l->v[i])) return false;
        return true;
    case JV_DICT:
        if (a->u.d->n != b->u.d->n) return false;
        for (size_t i = 0; i < a->u.d->n; i++) {
            const struct jv *o = jdict_get(b->u.d, &a->u.d->k[i]);
            if (!o || !jv_equal(&a->u.d->v[i], o)) return false;
        }
        return true;
    case JV_NS: return a->u.ns == b->u.ns;
    case JV_FUNC: return a->u.fn == b->u.fn;
    case JV_LOOP: return a->u.loop == b->u.loop;
    default: return false;
    }
}

bool jv_order(const struct jv *a, const struct jv *b, int *cmp) {
    if (jv_is_number(a) && jv_is_number(b)) {
        if (a->t != JV_FLOAT && b->t != JV_FLOAT) {
            int64_t x = jv_as_int_exact(a), y = jv_as_int_exact(b);
            *cmp = x < y ? -1 : x > y;
        } else {
            double x = jv_as_double(a), y = jv_as_double(b);
            if (isnan(x) || isnan(y)) {
                *cmp = 2; // unordered: every comparison is false
                return true;
            }
            *cmp = x < y ? -1 : x > y;
        }
        return true;
    }
    if (a->t == JV_STR && b->t == JV_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int c = memcmp(a->u.s.p, b->u.s.p, n);
        *cmp = c ? (c < 0 ? -1 : 1) : (a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n);
        return true;
    }
    if (a->t == JV_LIST && b->t == JV_LIST && a->u.l->is_tuple == b->u.l->is_tuple && jlist_is_plain(a->u.l) &&
        jlist_is_plain(b->u.l)) {
        size_t n = a->u.l->n < b->u.l->n ? a->u.l->n : b->u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (jv_equal(&a->u.l->v[i], &b->u.l->v[i])) continue;
            return jv_order(&a->u.l->v[i], &b->u.l->v[i], cmp);
        }
        *cmp = a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n;
        return true;
    }
    return false;
}

const struct jv *jdict_get(const struct jdict *d, const struct jv *key) {
    for (size_t i = d->n; i-- > 0;)
        if (jv_equal(&d->k[i], key)) return &d->v[i];
    return NULL;
}

const struct jv *jdict_get_str(const struct jdict *d, const char *key, size_t n) {
    for (size_t i = d->n; i-- > 0;)
        if (d->k[i].t == JV_STR && d->k[i].u.s.n == n && !memcmp(d->k[i].u.s.p, key, n)) return &d->v[i];
    return NULL;
}

// Python repr of a str: quote choice and escapes as CPython's unicode_repr.
static void write_str_repr(struct sbuf *b, const char *s, size_t n) {
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    sbuf_putc(b, q);
    size_t i = 0, run = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7F && c != '\\' && c != (unsigned char)q) {
            i++;
            run++;
            continue;
        }
        sbuf_put(b, s + i - run, run);
        run = 0;
        size_t st = i;
        uint32_t cp = utf8_next(s, n, &i);
        if (cp == '\\') sbuf_puts(b, "\\\\");
        else if (cp == (uint32_t)q) { sbuf_putc(b, '\\'); sbuf_putc(b, q); }
        else if (cp == '\n') sbuf_puts(b, "\\n");
        else if (cp == '\r') sbuf_puts(b, "\\r");
        else if (cp == '\t') sbuf_puts(b, "\\t");
        else if (py_isprintable(cp)) sbuf_put(b, s + st, i - st);
        else if (cp < 0x100) sbuf_printf(b, "\\x%02x", cp);
        else if (cp < 0x10000) sbuf_printf(b, "\\u%04x", cp);
        else sbuf_printf(b, "\\U%08x", cp);
    }
    sbuf_put(b, s + i - run, run);
    sbuf_putc(b, q);
}

static void write_repr_depth(struct sbuf *b, const struct jv *v, int depth);

static void write_seq(struct sbuf *b, const struct jv *v, int depth) {
    const struct jlist *l = v->u.l;
    if (jlist_is_iter(l)) { // CPython prints an address here; there is nothing to match
        sbuf_printf(b, "<%s object>", jv_type_name(v));
        return;
    }
    if (l->kind != JL_LIST) { // dict_items([...])
        sbuf_puts(b, jv_type_name(v));
        sbuf_putc(b, '(');
    }
    sbuf_putc(b, l->is_tuple ? '(' : '[');
    for (size_t i = 0; i < l->n; i++) {
        if (i) sbuf_puts(b, ", ");
        write_repr_depth(b, &l->v[i], depth + 1);
    }
    if (l->is_tuple && l->n == 1) sbuf_putc(b, ',');
    sbuf_putc(b, l->is_tuple ? ')' : ']');
    if (l->kind != JL_LIST) sbuf_putc(b, ')');
}

static void write_dict(struct sbuf *b, const struct jdict *d, int depth) {
    sbuf_putc(b, '{');
    for (size_t i = 0; i < d->n; i++) {
        if (i) sbuf_puts(b, ", ");
        write_repr_depth(b, &d->k[i], depth + 1);
        sbuf_puts(b, ": ");
        write_repr_depth(b, &d->v[i], depth + 1);
    }
    sbuf_putc(b, '}');
}

static void write_scalar(struct sbuf *b, const struct jv *v) {
    char tmp[40];
    switch (v->t) {
    case JV_NONE: sbuf_puts(b, "None"); break;
    case JV_BOOL: sbuf_puts(b, v->u.b ? "True" : "False"); break;
    case JV_INT: sbuf_printf(b, "%lld", (long long)v->u.i); break;
    case JV_FLOAT: py_float_repr(v->u.f, tmp); sbuf_puts(b, tmp); break;
    default: break;
    }
}

void jv_write_repr(struct sbuf *b, const struct jv *v) { write_repr_depth(b, v, 0); }

// Cycles are possible only through namespaces (the one mutable type); past a depth that
// no real value reaches, print "..." as Python does for recursive containers.
static void write_repr_depth(struct sbuf *b, const struct jv *v, int depth) {
    if (depth > 200) {
        sbuf_puts(b, "...");
        return;
    }
    switch (v->t) {
    case JV_UNDEF: sbuf_puts(b, "Undefined"); break;
    case JV_STR: write_str_repr(b, v->u.s.p, v->u.s.n); break;
    case JV_LIST: write_seq(b, v, depth); break;
    case JV_DICT: write_dict(b, v->u.d, depth); break;
    case JV_NS: sbuf_puts(b, "<Namespace "); write_dict(b, &v->u.ns->d, depth); sbuf_putc(b, '>'); break;
    case JV_FUNC: sbuf_puts(b, "<function>"); break;
    case JV_LOOP: sbuf_puts(b, "<LoopContext>"); break;
    default: write_scalar(b, v); break;
    }
}

void jv_write_str(struct sbuf *b, const struct jv *v) {
    if (v->t == JV_STR) sbuf_put(b, v->u.s.p, v->u.s.n);
    else if (v->t == JV_UNDEF) return;
    else jv_write_repr(b, v);
}

// ---------------------------------------------------------------- json.dumps
static void write_json_str(struct sbuf *b, const char *s, size_t n, bool ensure_ascii) {
    sbuf_putc(b, '"');
    size_t i = 0, run = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\' && (c < 0x80 || !ensure_ascii)) {
            i++;
            run++;
            continue;
        }
        sbuf_put(b, s + i - run, run);
        run = 0;
        uint32_t cp = utf8_next(s, n, &i);
        switch (cp) {
        case '"': sbuf_puts(b, "\\\""); break;
        case '\\': sbuf_puts(b, "\\\\"); break;
        case '\n': sbuf_puts(b, "\\n"); break;
        case '\r': sbuf_puts(b, "\\r"); break;
        case '\t': sbuf_puts(b, "\\t"); break;
        case '\b': sbuf_puts(b, "\\b"); break;
        case '\f': sbuf_puts(b, "\\f"); break;
        default:
            if (cp >= 0x10000) {
                uint32_t v = cp - 0x10000;
                sbuf_printf(b, "\\u%04x\\u%04x", 0xD800 | (v >> 10), 0xDC00 | (v & 0x3FF));
            } else {
                sbuf_printf(b, "\\u%04x", cp);
            }
        }
    }
    sbuf_put(b, s + i - run, run);
    sbuf_putc(b, '"');
}

static void json_newline(struct sbuf *b, const struct tojson_opts *o, int level) {
    sbuf_putc(b, '\n');
    for (int i = 0; i < level; i++) sbuf_put(b, o->indent, o->indent_len);
}

static void write_json_float(struct sbuf *b, double f) {
    if (isnan(f)) sbuf_puts(b, "NaN");
    else if (isinf(f)) sbuf_puts(b, f < 0 ? "-Infinity" : "Infinity");
    else {
        char tmp[40];
        py_float_repr(f, tmp);
        sbuf_puts(b, tmp);
    }
}

// json.dumps turns non-string keys into strings: True -> "true", None -> "null", 1.5 -> "1.5".
static bool write_json_key(struct sbuf *b, const struct jv *k, const struct tojson_opts *o, const char **bad) {
    char tmp[48];
    switch (k->t) {
    case JV_STR: write_json_str(b, k->u.s.p, k->u.s.n, o->ensure_ascii); return true;
    case JV_NONE: sbuf_puts(b, "\"null\""); return true;
    case JV_BOOL: sbuf_puts(b, k->u.b ? "\"true\"" : "\"false\""); return true;
    case JV_INT: sbuf_printf(b, "\"%lld\"", (long long)k->u.i); return true;
    case JV_FLOAT: {
        struct sbuf t;
        sbuf_init(&t, 0);
        write_json_float(&t, k->u.f);
        snprintf(tmp, sizeof tmp, "\"%s\"", t.p ? t.p : "");
        sbuf_free(&t);
        sbuf_puts(b, tmp);
        return true;
    }
    default:
        *bad = "keys must be str, int, float, bool or None";
        return false;
    }
}

static int cmp_keys(const void *x, const void *y, void *ctx) {
    const struct jdict *d = ctx;
    const struct jv *a = &d->k[*(const size_t *)x], *b = &d->k[*(const size_t *)y];
    int c = 0;
    jv_order(a, b, &c);
    return c;
}

bool jv_write_json(struct sbuf *b, const struct jv *v, const struct tojson_opts *o, int depth, const char **bad) {
    if (depth > 512) {
        *bad = "nesting too deep";
        return false;
    }
    switch (v->t) {
    case JV_NONE: sbuf_puts(b, "null"); return true;
    case JV_BOOL: sbuf_puts(b, v->u.b ? "true" : "false"); return true;
    case JV_INT: sbuf_printf(b, "%lld", (long long)v->u.i); return true;
    case JV_FLOAT: write_json_float(b, v->u.f); return true;
    case JV_STR: write_json_str(b, v->u.s.p, v->u.s.n, o->ensure_ascii); return true;
    case JV_LIST: {
        const struct jlist *l = v->u.l;
        if (!jlist_is_plain(l)) {
            *bad = jv_type_name(v);
            return false;
        }
        if (l->n == 0) {
            sbuf_puts(b, "[]");
            return true;
        }
        sbuf_putc(b, '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i) sbuf_put(b, o->item_sep, o->item_sep_len);
            if (o->indent) json_newline(b, o, depth + 1);
            if (!jv_write_json(b, &l->v[i], o, depth + 1, bad)) return false;
        }
        if (o->indent) json_newline(b, o, depth);
        sbuf_putc(b, ']');
        return true;
    }
    case JV_DICT: {
        const struct jdict *d = v->u.d;
        if (d->n == 0) {
            sbuf_puts(b, "{}");
            return true;
        }
        size_t order_stack[64], *order = order_stack;
        if (d->n > 64) {
            order = malloc(d->n * sizeof *order);
            if (!order) {
                *bad = "out of memory";
                return false;
            }
        }
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (o->sort_keys) qsort_r(order, d->n, sizeof *order, cmp_keys, (void *)d);
        bool ok = true;
        sbuf_putc(b, '{');
        for (size_t j = 0; j < d->n && ok; j++) {
            size_t i = order[j];
            if (j) sbuf_put(b, o->item_sep, o->item_sep_len);
            if (o->indent) json_newline(b, o, depth + 1);
            ok = write_json_key(b, &d->k[i], o, bad);
            if (!ok) break;
            sbuf_put(b, o->key_sep, o->key_sep_len);
            ok = jv_write_json(b, &d->v[i], o, depth + 1, bad);
        }
        if (order != order_stack) free(order);
        if (!ok) return false;
        if (o->indent) json_newline(b, o, depth);
        sbuf_putc(b, '}');
        return true;
    }
    default:
        *bad = jv_type_name(v);
        return false;
    }
}

// ---------------------------------------------------------------- from JSON
bool jv_from_json(struct arena *a, const json_t *j, struct jv *out, int depth) {
    if (depth > 256) return false;
    switch (json_typeof(j)) {
    case JSON_NULL: *out = jv_none(); return true;
    case JSON_TRUE: *out = jv_bool(true); return true;
    case JSON_FALSE: *out = jv_bool(false); return true;
    case JSON_INTEGER: *out = jv_int((int64_t)json_integer_value(j)); return true;
    case JSON_REAL: *out = jv_float(json_real_value(j)); return true;
    case JSON_STRING: *out = jv_str(json_string_value(j), json_string_length(j)); return true;
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        struct jlist *l = arena_alloc(a, sizeof *l);
        struct jv *v = n ? arena_alloc(a, n * sizeof *v) : NULL;
        if (!l || (n && !v)) return false;
        for (size_t i = 0; i < n; i++)
            if (!jv_from_json(a, json_array_get(j, i), &v[i], depth + 1)) return false;
        l->n = n;
        l->is_tuple = false;
        l->kind = JL_LIST;
        l->pos = 0;
        l->v = v;
        out->t = JV_LIST;
        out->u.l = l;
        return true;
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(j);
        struct jdict *d = arena_alloc(a, sizeof *d);
        struct jv *k = n ? arena_alloc(a, n * sizeof *k) : NULL, *v = n ? arena_alloc(a, n * sizeof *v) : NULL;
        if (!d || (n && (!k || !v))) return false;
        size_t i = 0;
        const char *key;
        json_t *val;
        void *it = json_object_iter((json_t *)j);
        while (it && i < n) {
            key = json_object_iter_key(it);
            val = json_object_iter_value(it);
            k[i] = jv_str(key, strlen(key));
            if (!jv_from_json(a, val, &v[i], depth + 1)) return false;
            i++;
            it = json_object_iter_next((json_t *)j, it);
        }
        d->n = d->cap = i;
        d->k = k;
        d->v = v;
        out->t = JV_DICT;
        out->u.d = d;
        return true;
    }
    }
    return false;
}
