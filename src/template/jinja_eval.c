// Jinja evaluator: walks the AST against a per-render arena of values.
//
// Semantics follow jinja2 3.1 as HF transformers configures it (see jinja.h):
// - Undefined: prints as "", is falsy, iterates as empty, has length 0, compares equal
//   only to Undefined; attribute/item access, arithmetic, ordering or calling it is an
//   error naming what was undefined ("'foo' is undefined", "'dict object' has no
//   attribute 'bar'").
// - obj.name tries the Python attribute first (dict methods, str methods, ...), then
//   the item; obj[key] tries the item first, then the attribute.
// - for loops get a fresh scope per iteration (assignments inside do not leak or
//   survive to the next iteration); `if` does not open a scope; macros see the
//   template-level scope, call blocks the scope they were written in.
// - ImmutableSandboxedEnvironment: mutating methods (list.append, dict.update, ...) are
//   refused; range() is limited to 100000 items; namespace attributes may not start
//   with '_'.
// Every evaluation step is counted and nesting is bounded (struct jinja_limits).
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <utf8proc.h>

#include "common/check.h"
#include "template/jinja_internal.h"

#define MAX_RANGE 100000

struct scope {
    struct scope *parent;
    size_t n, cap;
    const char **names;
    struct jv *vals;
};

enum func_kind { FN_BUILTIN, FN_MACRO, FN_METHOD, FN_CALLER, FN_JOINER, FN_CYCLER };
enum builtin_id { B_RANGE, B_NAMESPACE, B_DICT, B_RAISE, B_STRFTIME, B_JOINER, B_CYCLER, B_COUNT };

struct jfunc {
    enum func_kind kind;
    int id;             // FN_BUILTIN: which; FN_JOINER: calls so far; FN_CYCLER: position
    const char *name;   // method / macro name
    struct jv self;     // FN_METHOD: the object; FN_JOINER: separator; FN_CYCLER: items (list)
    const struct node *node; // FN_MACRO: N_MACRO; FN_CALLER: N_CALLBLOCK
    struct scope *closure;   // FN_CALLER
};

struct jloop {
    size_t index0, length;
    const struct jv *items;
    bool has_last; // loop.changed() state
    struct jv last;
};

struct eval {
    const struct jinja_template *t;
    struct arena ar;
    struct error *err;
    bool failed;
    struct jinja_limits lim;
    uint64_t steps;
    int depth;
    struct scope *scope;
    struct scope *root;
    time_t now;
    struct jv placeholder;
    int loop_ctrl; // 1 break, 2 continue
    struct sbuf *out;
    struct jfunc builtins[B_COUNT];
};

struct args {
    struct jv *pos;
    int npos;
    const char **kwn;
    struct jv *kw;
    int nkw;
};

static bool ev_fail(struct eval *ev, const struct node *at, atomc_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool ev_fail(struct eval *ev, const struct node *at, atomc_status st, const char *fmt, ...) {
    if (ev->failed) return false;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at) error_set(ev->err, st, "template error at line %d, column %d: %s", at->line, at->col, msg);
    else error_set(ev->err, st, "template error: %s", msg);
    ev->failed = true;
    return false;
}
#define FAIL(at, ...) ev_fail(ev, at, ATOMC_ERR_INVALID_ARGUMENT, __VA_ARGS__)

static bool oom(struct eval *ev, const struct node *at) {
    return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "template used more than %zu bytes of memory while rendering",
                   ev->lim.max_memory_bytes);
}

static void *ev_alloc(struct eval *ev, const struct node *at, size_t n) {
    void *p = arena_alloc(&ev->ar, n);
    if (!p) oom(ev, at);
    return p;
}

static bool undefined_error(struct eval *ev, const struct node *at, const struct jv *u) {
    if (u->undef_owner) return FAIL(at, "'%s' has no attribute '%s'", u->undef_owner, u->u.undef_name ? u->u.undef_name : "?");
    if (u->u.undef_name) return FAIL(at, "'%s' is undefined", u->u.undef_name);
    return FAIL(at, "value is undefined");
}

static struct jv undef_attr(const char *owner, const char *name) {
    struct jv v = jv_undef(name);
    v.undef_owner = owner;
    return v;
}

static const char *owner_desc(const struct jv *v) {
    switch (v->t) {
    case JV_DICT: return "dict object";
    case JV_STR: return "str object";
    case JV_LIST: return v->u.l->kind != JL_LIST ? "object" : v->u.l->is_tuple ? "tuple object" : "list object";
    case JV_NONE: return "None";
    case JV_INT: return "int object";
    case JV_FLOAT: return "float object";
    case JV_BOOL: return "bool object";
    case JV_NS: return "Namespace object";
    default: return "object";
    }
}

// ---------------------------------------------------------------- value builders
static bool mk_str_copy(struct eval *ev, const struct node *at, const char *p, size_t n, struct jv *out) {
    char *s = ev_alloc(ev, at, n + 1);
    if (!s) return false;
    if (n) memcpy(s, p, n);
    s[n] = '\0';
    *out = jv_str(s, n);
    return true;
}

static bool sbuf_to_str(struct eval *ev, const struct node *at, struct sbuf *b, struct jv *out) {
    if (b->overflow) {
        sbuf_free(b);
        return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "template output exceeds %zu bytes", ev->lim.max_output_bytes);
    }
    bool ok = mk_str_copy(ev, at, b->p ? b->p : "", b->n, out);
    sbuf_free(b);
    return ok;
}

static struct jlist *mk_list(struct eval *ev, const struct node *at, size_t n, bool tuple) {
    struct jlist *l = ev_alloc(ev, at, sizeof *l);
    if (!l) return NULL;
    l->n = n;
    l->is_tuple = tuple;
    l->kind = JL_LIST;
    l->pos = 0;
    l->v = NULL;
    if (n) {
        if (n > ev->lim.max_memory_bytes / sizeof(struct jv)) {
            oom(ev, at);
            return NULL;
        }
        l->v = ev_alloc(ev, at, n * sizeof *l->v);
        if (!l->v) return NULL;
    }
    return l;
}

static struct jv list_val(struct jlist *l) {
    struct jv v = {.t = JV_LIST};
    v.u.l = l;
    return v;
}

static struct jdict *mk_dict(struct eval *ev, const struct node *at, size_t cap) {
    struct jdict *d = ev_alloc(ev, at, sizeof *d);
    if (!d) return NULL;
    d->n = 0;
    d->cap = cap;
    d->k = d->v = NULL;
    if (cap) {
        d->k = ev_alloc(ev, at, cap * sizeof *d->k);
        d->v = ev_alloc(ev, at, cap * sizeof *d->v);
        if (!d->k || !d->v) return NULL;
    }
    return d;
}

// Sets key in a dict under construction or a namespace (growing it in the arena).
static bool dict_set(struct eval *ev, const struct node *at, struct jdict *d, const struct jv *k, const struct jv *v) {
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(&d->k[i], k)) {
            d->v[i] = *v;
            return true;
        }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        struct jv *nk = ev_alloc(ev, at, cap * sizeof *nk), *nv = ev_alloc(ev, at, cap * sizeof *nv);
        if (!nk || !nv) return false;
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = *k;
    d->v[d->n] = *v;
    d->n++;
    return true;
}

static struct jv dict_val(struct jdict *d) {
    struct jv v = {.t = JV_DICT};
    v.u.d = d;
    return v;
}

static struct jv func_val(struct jfunc *f) {
    struct jv v = {.t = JV_FUNC};
    v.u.fn = f;
    return v;
}

static bool mk_method(struct eval *ev, const struct node *at, const struct jv *self, const char *name, struct jv *out) {
    struct jfunc *f = ev_alloc(ev, at, sizeof *f);
    if (!f) return false;
    memset(f, 0, sizeof *f);
    f->kind = FN_METHOD;
    f->self = *self;
    f->name = name;
    *out = func_val(f);
    return true;
}

// ---------------------------------------------------------------- scopes
static bool scope_set(struct eval *ev, const struct node *at, struct scope *s, const char *name, const struct jv *v) {
    for (size_t i = 0; i < s->n; i++)
        if (s->names[i] == name || (s->names[i][0] == name[0] && !strcmp(s->names[i], name))) {
            s->vals[i] = *v;
            return true;
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        const char **nn = ev_alloc(ev, at, cap * sizeof *nn);
        struct jv *nv = ev_alloc(ev, at, cap * sizeof *nv);
        if (!nn || !nv) return false;
        if (s->n) {
            memcpy(nn, s->names, s->n * sizeof *nn);
            memcpy(nv, s->vals, s->n * sizeof *nv);
        }
        s->names = nn;
        s->vals = nv;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n] = *v;
    s->n++;
    return true;
}

static const char *const BUILTIN_NAMES[B_COUNT] = {"range",        "namespace", "dict",  "raise_exception",
                                                   "strftime_now", "joiner",    "cycler"};

static struct jv lookup(struct eval *ev, const char *name) {
    for (struct scope *s = ev->scope; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (s->names[i] == name || (s->names[i][0] == name[0] && !strcmp(s->names[i], name))) return s->vals[i];
    for (int b = 0; b < B_COUNT; b++)
        if (!strcmp(BUILTIN_NAMES[b], name)) return func_val(&ev->builtins[b]);
    return jv_undef(name);
}

// ---------------------------------------------------------------- strings (code points)
// Byte offset of code point index `ci` in s (clamped to n).
static size_t cp_offset(const char *s, size_t n, size_t ci) {
    size_t i = 0;
    while (ci > 0 && i < n) {
        utf8_next(s, n, &i);
        ci--;
    }
    return i;
}

static size_t str_len_cp(const struct jv *v) { return utf8_count(v->u.s.p, v->u.s.n); }

static const char *memmem_s(const char *h, size_t hn, const char *nd, size_t nn) {
    if (nn == 0) return h;
    if (nn > hn) return NULL;
    return memmem(h, hn, nd, nn);
}

// ---------------------------------------------------------------- iteration
// Materializes an iterable into an array (dict -> keys, str -> chars, undefined -> empty).
static bool iterate(struct eval *ev, const struct node *at, const struct jv *v, const struct jv **items, size_t *n) {
    switch (v->t) {
    case JV_UNDEF: *items = NULL; *n = 0; return true;
    case JV_LIST:
        if (jlist_is_iter(v->u.l)) { // iterating consumes a generator
            *n = v->u.l->n - v->u.l->pos;
            *items = *n ? v->u.l->v + v->u.l->pos : NULL;
            v->u.l->pos = v->u.l->n;
            return true;
        }
        *items = v->u.l->v;
        *n = v->u.l->n;
        return true;
    case JV_DICT: *items = v->u.d->k; *n = v->u.d->n; return true;
    case JV_NS: *items = v->u.ns->d.k; *n = v->u.ns->d.n; return FAIL(at, "'Namespace' object is not iterable");
    case JV_STR: {
        size_t cnt = str_len_cp(v);
        struct jv *arr = cnt ? ev_alloc(ev, at, cnt * sizeof *arr) : NULL;
        if (cnt && !arr) return false;
        size_t i = 0, k = 0;
        while (i < v->u.s.n) {
            size_t st = i;
            utf8_next(v->u.s.p, v->u.s.n, &i);
            arr[k++] = jv_str(v->u.s.p + st, i - st);
        }
        *items = arr;
        *n = cnt;
        return true;
    }
    default:
        return FAIL(at, "'%s' object is not iterable", jv_type_name(v));
    }
}

// ---------------------------------------------------------------- forward decls
static bool eval_expr(struct eval *ev, const struct node *x, struct jv *out);
static bool exec_body(struct eval *ev, struct node *const *body, int n);
static bool get_attr(struct eval *ev, const struct node *at, const struct jv *obj, const char *name, struct jv *out);
static bool call_value(struct eval *ev, const struct node *at, const struct jv *fn, struct args *a,
                       const struct jv *caller, struct jv *out);
static bool apply_test(struct eval *ev, const struct node *at, const char *name, const struct jv *v, struct args *a,
                       bool *result);
static bool apply_filter(struct eval *ev, const struct node *at, const char *name, const struct jv *v, struct args *a,
                         struct jv *out);

static bool step(struct eval *ev, const struct node *at) {
    if (++ev->steps > ev->lim.max_steps)
        return ev_fail(ev, at, ATOMC_ERR_TOO_LONG,
                       "template evaluation exceeded %llu steps (a template loop that does not end?)",
                       (unsigned long long)ev->lim.max_steps);
    return true;
}

static const struct jv *arg_get(const struct args *a, int idx, const char *name) {
    if (idx >= 0 && idx < a->npos) return &a->pos[idx];
    for (int i = 0; i < a->nkw; i++)
        if (!strcmp(a->kwn[i], name)) return &a->kw[i];
    return NULL;
}

// Checks that only `max_pos` positional arguments and the named keywords are given.
static bool args_check(struct eval *ev, const struct node *at, const char *what, const struct args *a, int max_pos,
                       const char *const *kwnames) {
    if (a->npos > max_pos) return FAIL(at, "%s takes at most %d positional argument(s), %d given", what, max_pos, a->npos);
    for (int i = 0; i < a->nkw; i++) {
        bool ok = false;
        for (int j = 0; kwnames && kwnames[j]; j++)
            if (!strcmp(kwnames[j], a->kwn[i])) ok = true;
        if (!ok) return FAIL(at, "%s got an unexpected keyword argument '%s'", what, a->kwn[i]);
    }
    return true;
}

static bool eval_args(struct eval *ev, const struct node *x, struct args *a) {
    a->npos = x->n_list;
    a->nkw = x->n_list2;
    a->kwn = x->kwnames;
    a->pos = a->npos ? ev_alloc(ev, x, (size_t)a->npos * sizeof *a->pos) : NULL;
    a->kw = a->nkw ? ev_alloc(ev, x, (size_t)a->nkw * sizeof *a->kw) : NULL;
    if ((a->npos && !a->pos) || (a->nkw && !a->kw)) return false;
    for (int i = 0; i < a->npos; i++)
        if (!eval_expr(ev, x->list[i], &a->pos[i])) return false;
    for (int i = 0; i < a->nkw; i++)
        if (!eval_expr(ev, x->list2[i], &a->kw[i])) return false;
    return true;
}

// ---------------------------------------------------------------- arithmetic
static bool to_index(const struct jv *v, int64_t *out) {
    if (v->t == JV_INT) *out = v->u.i;
    else if (v->t == JV_BOOL) *out = v->u.b;
    else return false;
    return true;
}

static bool repeat_seq(struct eval *ev, const struct node *at, const struct jv *seq, int64_t times, struct jv *out) {
    if (times < 0) times = 0;
    if (seq->t == JV_STR) {
        size_t n = seq->u.s.n;
        if (n && (uint64_t)times > ev->lim.max_output_bytes / n)
            return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "string repetition result too large");
        char *p = ev_alloc(ev, at, n * (size_t)times + 1);
        if (!p) return false;
        for (int64_t i = 0; i < times; i++) memcpy(p + (size_t)i * n, seq->u.s.p, n);
        p[n * (size_t)times] = '\0';
        *out = jv_str(p, n * (size_t)times);
        return true;
    }
    size_t n = seq->u.l->n;
    if (n && (uint64_t)times > (ev->lim.max_memory_bytes / sizeof(struct jv)) / n) return oom(ev, at);
    struct jlist *l = mk_list(ev, at, n * (size_t)times, seq->u.l->is_tuple);
    if (!l) return false;
    for (int64_t i = 0; i < times; i++)
        if (n) memcpy(l->v + (size_t)i * n, seq->u.l->v, n * sizeof *l->v);
    *out = list_val(l);
    return true;
}

static double py_fmod(double a, double b) {
    double m = fmod(a, b);
    if (m != 0 && ((b < 0) != (m < 0))) m += b;
    return m;
}

// Python's printf-style `str % args` (conversions s r a d i u f F e E g G x X o c %, flags
// `-+ #0`, width, precision, %(key)s with a dict).
static bool percent_format(struct eval *ev, const struct node *at, const struct jv *fmt, const struct jv *args,
                           struct jv *out) {
    const struct jv *pos = args;
    size_t npos = 1, next = 0;
    bool is_map = args->t == JV_DICT;
    if (args->t == JV_LIST && args->u.l->is_tuple && jlist_is_plain(args->u.l)) {
        pos = args->u.l->v;
        npos = args->u.l->n;
    }
    bool tolerant = is_map || (args->t == JV_LIST && !args->u.l->is_tuple && jlist_is_plain(args->u.l)); // __getitem__
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    const char *p = fmt->u.s.p, *end = p + fmt->u.s.n;
    bool used_map = false;
    while (p < end) {
        const char *pc = memchr(p, '%', (size_t)(end - p));
        if (!pc) {
            sbuf_put(&b, p, (size_t)(end - p));
            break;
        }
        sbuf_put(&b, p, (size_t)(pc - p));
        p = pc + 1;
        if (p >= end) {
            sbuf_free(&b);
            return FAIL(at, "incomplete format");
        }
        const struct jv *arg = NULL;
        if (*p == '(') {
            const char *close = memchr(p, ')', (size_t)(end - p));
            if (!close) {
                sbuf_free(&b);
                return FAIL(at, "incomplete format key");
            }
            if (!is_map) {
                sbuf_free(&b);
                return FAIL(at, "format requires a mapping");
            }
            arg = jdict_get_str(args->u.d, p + 1, (size_t)(close - p - 1));
            if (!arg) {
                sbuf_free(&b);
                return FAIL(at, "'%.*s'", (int)(close - p - 1), p + 1);
            }
            used_map = true;
            p = close + 1;
        }
        char flags[8];
        int nf = 0;
        while (p < end && strchr("-+ #0", *p) && nf < 7) flags[nf++] = *p++;
        flags[nf] = '\0';
        int width = -1, prec = -1;
        if (p < end && *p == '*') {
            sbuf_free(&b);
            return FAIL(at, "'*' widths are not supported in %% formatting");
        }
        if (p < end && *p >= '0' && *p <= '9') {
            width = 0;
            while (p < end && *p >= '0' && *p <= '9' && width < 100000) width = width * 10 + (*p++ - '0');
        }
        if (p < end && *p == '.') {
            p++;
            prec = 0;
            while (p < end && *p >= '0' && *p <= '9' && prec < 1000) prec = prec * 10 + (*p++ - '0');
        }
        while (p < end && (*p == 'l' || *p == 'h' || *p == 'L')) p++;
        if (p >= end) {
            sbuf_free(&b);
            return FAIL(at, "incomplete format");
        }
        char conv = *p++;
        if (conv == '%') {
            sbuf_putc(&b, '%');
            continue;
        }
        if (!arg) {
            if (is_map && npos == 1 && !(args->t == JV_LIST)) arg = args;
            else if (next >= npos) {
                sbuf_free(&b);
                return FAIL(at, "not enough arguments for format string");
            } else arg = &pos[next++];
        }
        char spec[32], tmp[512];
        int k = 0;
        if (strchr("sra", conv)) {
            struct sbuf t;
            sbuf_init(&t, ev->lim.max_output_bytes);
            if (conv == 's') jv_write_str(&t, arg);
            else jv_write_repr(&t, arg);
            const char *sp = t.p ? t.p : "";
            size_t sn = t.n;
            if (prec >= 0) sn = cp_offset(sp, sn, (size_t)prec);
            int cps = (int)utf8_count(sp, sn);
            bool left = strchr(flags, '-') != NULL;
            if (!left)
                for (int i = cps; i < width; i++) sbuf_putc(&b, ' ');
            sbuf_put(&b, sp, sn);
            if (left)
                for (int i = cps; i < width; i++) sbuf_putc(&b, ' ');
            sbuf_free(&t);
            continue;
        }
        if (!jv_is_number(arg) && !(conv == 'c' && arg->t == JV_STR)) {
            sbuf_free(&b);
            return FAIL(at, "%%%c format: a real number is required, not %s", conv, jv_type_name(arg));
        }
        k = snprintf(spec, sizeof spec, "%%%s", flags);
        if (width >= 0) k += snprintf(spec + k, sizeof spec - (size_t)k, "%d", width);
        if (prec >= 0) k += snprintf(spec + k, sizeof spec - (size_t)k, ".%d", prec);
        if (strchr("diu", conv)) {
            double d = jv_as_double(arg);
            long long iv = arg->t == JV_FLOAT ? (long long)d : (long long)(arg->t == JV_INT ? arg->u.i : arg->u.b);
            if (arg->t == JV_FLOAT && !(fabs(d) < 9.2e18)) {
                sbuf_free(&b);
                return FAIL(at, "cannot convert float to integer");
            }
            snprintf(spec + k, sizeof spec - (size_t)k, "lld");
            snprintf(tmp, sizeof tmp, spec, iv);
        } else if (strchr("xXo", conv)) {
            if (arg->t == JV_FLOAT) {
                sbuf_free(&b);
                return FAIL(at, "%%%c format: an integer is required, not float", conv);
            }
            long long iv = arg->t == JV_INT ? arg->u.i : arg->u.b;
            snprintf(spec + k, sizeof spec - (size_t)k, "ll%c", conv);
            if (iv < 0) {
                char t2[480];
                snprintf(t2, sizeof t2, spec, -iv);
                snprintf(tmp, sizeof tmp, "-%s", t2);
            } else snprintf(tmp, sizeof tmp, spec, iv);
        } else if (strchr("fFeEgG", conv)) {
            spec[k] = conv;
            spec[k + 1] = '\0';
            snprintf(tmp, sizeof tmp, spec, jv_as_double(arg));
        } else if (conv == 'c') {
            struct sbuf t;
            sbuf_init(&t, 16);
            if (arg->t == JV_STR) {
                if (utf8_count(arg->u.s.p, arg->u.s.n) != 1) {
                    sbuf_free(&b);
                    return FAIL(at, "%%c requires int or char");
                }
                sbuf_put(&t, arg->u.s.p, arg->u.s.n);
            } else {
                int64_t cp = arg->t == JV_INT ? arg->u.i : arg->u.b;
                if (arg->t == JV_FLOAT || cp < 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
                    sbuf_free(&b);
                    return FAIL(at, "%%c arg not in range(0x110000)");
                }
                sbuf_put_utf8(&t, (uint32_t)cp);
            }
            snprintf(tmp, sizeof tmp, "%s", t.p ? t.p : "");
            sbuf_free(&t);
        } else {
            sbuf_free(&b);
            return FAIL(at, "unsupported format character '%c'", conv);
        }
        sbuf_puts(&b, tmp);
    }
    if (!tolerant && !used_map && next < npos) {
        sbuf_free(&b);
        return FAIL(at, "not all arguments converted during string formatting");
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool binop(struct eval *ev, const struct node *at, int op, const struct jv *a, const struct jv *b, struct jv *out) {
    if (op == '%' && a->t == JV_STR) return percent_format(ev, at, a, b, out); // str(Undefined) is ""
    if (a->t == JV_UNDEF) return undefined_error(ev, at, a);
    if (b->t == JV_UNDEF) return undefined_error(ev, at, b);
    bool na = jv_is_number(a), nb = jv_is_number(b);
    if (na && nb) {
        bool fl = a->t == JV_FLOAT || b->t == JV_FLOAT;
        int64_t x = 0, y = 0, r;
        double fx = jv_as_double(a), fy = jv_as_double(b);
        if (!fl) {
            to_index(a, &x);
            to_index(b, &y);
        }
        switch (op) {
        case '+':
            if (fl) *out = jv_float(fx + fy);
            else if (__builtin_add_overflow(x, y, &r)) return FAIL(at, "integer overflow");
            else *out = jv_int(r);
            return true;
        case '-':
            if (fl) *out = jv_float(fx - fy);
            else if (__builtin_sub_overflow(x, y, &r)) return FAIL(at, "integer overflow");
            else *out = jv_int(r);
            return true;
        case '*':
            if (fl) *out = jv_float(fx * fy);
            else if (__builtin_mul_overflow(x, y, &r)) return FAIL(at, "integer overflow");
            else *out = jv_int(r);
            return true;
        case '/':
            if (fy == 0) return FAIL(at, "division by zero");
            *out = jv_float(fl ? fx / fy : (double)x / (double)y);
            return true;
        case 'f':
            if (fy == 0) return FAIL(at, fl ? "float floor division by zero" : "integer division or modulo by zero");
            if (fl) *out = jv_float(floor(fx / fy));
            else {
                if (x == INT64_MIN && y == -1) return FAIL(at, "integer overflow");
                int64_t q = x / y;
                if ((x % y != 0) && ((x < 0) != (y < 0))) q--;
                *out = jv_int(q);
            }
            return true;
        case '%':
            if (fy == 0) return FAIL(at, fl ? "float modulo" : "integer division or modulo by zero");
            if (fl) *out = jv_float(py_fmod(fx, fy));
            else {
                if (y == -1) {
                    *out = jv_int(0);
                    return true;
                }
                int64_t m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) m += y;
                *out = jv_int(m);
            }
            return true;
        case 'p':
            if (!fl && y >= 0) {
                int64_t acc = 1, base = x;
                for (int64_t e = y; e > 0; e >>= 1) {
                    if ((e & 1) && __builtin_mul_overflow(acc, base, &acc)) return FAIL(at, "integer overflow");
                    if (e > 1 && __builtin_mul_overflow(base, base, &base)) return FAIL(at, "integer overflow");
                }
                *out = jv_int(acc);
            } else {
                if (fx == 0 && fy < 0) return FAIL(at, "0.0 cannot be raised to a negative power");
                *out = jv_float(pow(fx, fy));
            }
            return true;
        }
    }
    if (op == '+' && a->t == JV_STR && b->t == JV_STR) {
        size_t n = a->u.s.n + b->u.s.n;
        if (n > ev->lim.max_output_bytes) return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "string too large");
        char *p = ev_alloc(ev, at, n + 1);
        if (!p) return false;
        memcpy(p, a->u.s.p, a->u.s.n);
        memcpy(p + a->u.s.n, b->u.s.p, b->u.s.n);
        p[n] = '\0';
        *out = jv_str(p, n);
        return true;
    }
    if (op == '+' && a->t == JV_LIST && b->t == JV_LIST && a->u.l->is_tuple == b->u.l->is_tuple &&
        jlist_is_plain(a->u.l) && jlist_is_plain(b->u.l)) {
        struct jlist *l = mk_list(ev, at, a->u.l->n + b->u.l->n, a->u.l->is_tuple);
        if (!l) return false;
        if (a->u.l->n) memcpy(l->v, a->u.l->v, a->u.l->n * sizeof *l->v);
        if (b->u.l->n) memcpy(l->v + a->u.l->n, b->u.l->v, b->u.l->n * sizeof *l->v);
        *out = list_val(l);
        return true;
    }
    if (op == '*') {
        int64_t k;
        if ((a->t == JV_STR || (a->t == JV_LIST && jlist_is_plain(a->u.l))) && to_index(b, &k))
            return repeat_seq(ev, at, a, k, out);
        if ((b->t == JV_STR || (b->t == JV_LIST && jlist_is_plain(b->u.l))) && to_index(a, &k))
            return repeat_seq(ev, at, b, k, out);
    }
    if (op == '%' && a->t == JV_STR) return percent_format(ev, at, a, b, out);
    if (op == '+' && a->t == JV_STR)
        return FAIL(at, "can only concatenate str (not \"%s\") to str", jv_type_name(b));
    const char *opname = op == 'f' ? "//" : op == 'p' ? "**" : op == '+' ? "+" : op == '-' ? "-" : op == '*' ? "*"
                         : op == '/' ? "/" : "%";
    return FAIL(at, "unsupported operand type(s) for %s: '%s' and '%s'", opname, jv_type_name(a), jv_type_name(b));
}

static bool contains(struct eval *ev, const struct node *at, const struct jv *item, const struct jv *seq, bool *res) {
    switch (seq->t) {
    case JV_UNDEF: *res = false; return true;
    case JV_STR:
        if (item->t != JV_STR) return FAIL(at, "'in <string>' requires string as left operand, not %s", jv_type_name(item));
        *res = memmem_s(seq->u.s.p, seq->u.s.n, item->u.s.p, item->u.s.n) != NULL;
        return true;
    case JV_LIST: {
        *res = false;
        struct jlist *l = seq->u.l;
        size_t i0 = jlist_is_iter(l) ? l->pos : 0;
        for (size_t i = i0; i < l->n; i++) {
            bool eq = jv_equal(&l->v[i], item); // dict_items hold (key, value) tuples: same comparison
            if (jlist_is_iter(l)) l->pos = i + 1; // `in` consumes a generator up to the match
            if (eq) {
                *res = true;
                break;
            }
        }
        return true;
    }
    case JV_DICT:
        if ((item->t == JV_LIST && !item->u.l->is_tuple && item->u.l->kind == JL_LIST) || item->t == JV_DICT ||
            item->t == JV_NS)
            return FAIL(at, "unhashable type: '%s'", jv_type_name(item));
        *res = jdict_get(seq->u.d, item) != NULL;
        return true;
    default:
        return FAIL(at, "argument of type '%s' is not iterable", jv_type_name(seq));
    }
}

static bool compare(struct eval *ev, const struct node *at, int op, const struct jv *a, const struct jv *b, bool *res) {
    if (op == CMP_EQ) { *res = jv_equal(a, b); return true; }
    if (op == CMP_NE) { *res = !jv_equal(a, b); return true; }
    if (op == CMP_IN || op == CMP_NOTIN) {
        if (!contains(ev, at, a, b, res)) return false;
        if (op == CMP_NOTIN) *res = !*res;
        return true;
    }
    if (a->t == JV_UNDEF) return undefined_error(ev, at, a);
    if (b->t == JV_UNDEF) return undefined_error(ev, at, b);
    int c;
    static const char *const names[] = {"==", "!=", "<", "<=", ">", ">="};
    if (!jv_order(a, b, &c))
        return FAIL(at, "'%s' not supported between instances of '%s' and '%s'", names[op], jv_type_name(a),
                    jv_type_name(b));
    if (c == 2) { *res = false; return true; } // NaN
    switch (op) {
    case CMP_LT: *res = c < 0; break;
    case CMP_LE: *res = c <= 0; break;
    case CMP_GT: *res = c > 0; break;
    default: *res = c >= 0; break;
    }
    return true;
}

// ---------------------------------------------------------------- item access
static void slice_indices(int64_t len, const struct jv *s0, const struct jv *s1, int64_t step, int64_t *start,
                          int64_t *stop) {
    int64_t lo = step < 0 ? -1 : 0, hi = step < 0 ? len - 1 : len;
    int64_t v = 0;
    if (!s0 || s0->t == JV_NONE) *start = step < 0 ? hi : lo;
    else {
        to_index(s0, &v);
        if (v < 0) {
            v += len;
            if (v < lo) v = lo;
        } else if (v > hi) v = hi;
        *start = v;
    }
    if (!s1 || s1->t == JV_NONE) *stop = step < 0 ? lo : hi;
    else {
        to_index(s1, &v);
        if (v < 0) {
            v += len;
            if (v < lo) v = lo;
        } else if (v > hi) v = hi;
        *stop = v;
    }
}

static bool do_slice(struct eval *ev, const struct node *at, const struct jv *obj, const struct jv *a,
                     const struct jv *b, const struct jv *c, struct jv *out) {
    int64_t step = 1, tmp;
    if (c && c->t != JV_NONE) {
        if (!to_index(c, &step)) return FAIL(at, "slice indices must be integers or None");
        if (step == 0) return FAIL(at, "slice step cannot be zero");
    }
    if ((a && a->t != JV_NONE && !to_index(a, &tmp)) || (b && b->t != JV_NONE && !to_index(b, &tmp)))
        return FAIL(at, "slice indices must be integers or None");
    if (obj->t == JV_UNDEF) return undefined_error(ev, at, obj);
    if (obj->t == JV_LIST && jlist_is_plain(obj->u.l)) {
        int64_t len = (int64_t)obj->u.l->n, st, sp;
        slice_indices(len, a, b, step, &st, &sp);
        int64_t cnt = step > 0 ? (sp > st ? (sp - st + step - 1) / step : 0) : (st > sp ? (st - sp + (-step) - 1) / (-step) : 0);
        struct jlist *l = mk_list(ev, at, (size_t)cnt, obj->u.l->is_tuple);
        if (!l) return false;
        for (int64_t i = 0; i < cnt; i++) l->v[i] = obj->u.l->v[st + i * step];
        *out = list_val(l);
        return true;
    }
    if (obj->t == JV_STR) {
        const char *s = obj->u.s.p;
        size_t n = obj->u.s.n;
        int64_t len = (int64_t)str_len_cp(obj), st, sp;
        slice_indices(len, a, b, step, &st, &sp);
        if (step == 1) {
            size_t bs = cp_offset(s, n, (size_t)st);
            size_t be = sp > st ? bs + cp_offset(s + bs, n - bs, (size_t)(sp - st)) : bs;
            *out = jv_str(s + bs, be - bs);
            return true;
        }
        // general step: index code points
        size_t *offs = ev_alloc(ev, at, ((size_t)len + 1) * sizeof *offs);
        if (!offs) return false;
        size_t i = 0, k = 0;
        while (i < n) {
            offs[k++] = i;
            utf8_next(s, n, &i);
        }
        offs[k] = n;
        struct sbuf r;
        sbuf_init(&r, 0);
        int64_t cnt = step > 0 ? (sp > st ? (sp - st + step - 1) / step : 0) : (st > sp ? (st - sp + (-step) - 1) / (-step) : 0);
        for (int64_t j = 0; j < cnt; j++) {
            int64_t ci = st + j * step;
            sbuf_put(&r, s + offs[ci], offs[ci + 1] - offs[ci]);
        }
        return sbuf_to_str(ev, at, &r, out);
    }
    *out = jv_undef(NULL);
    return true;
}

static bool get_item(struct eval *ev, const struct node *at, const struct jv *obj, const struct jv *key, struct jv *out) {
    int64_t idx;
    switch (obj->t) {
    case JV_UNDEF: return undefined_error(ev, at, obj);
    case JV_DICT: {
        const struct jv *v = jdict_get(obj->u.d, key);
        if (v) {
            *out = *v;
            return true;
        }
        break;
    }
    case JV_LIST:
        if (!jlist_is_plain(obj->u.l)) break; // not subscriptable
        if (to_index(key, &idx)) {
            int64_t n = (int64_t)obj->u.l->n;
            if (idx < 0) idx += n;
            if (idx >= 0 && idx < n) *out = obj->u.l->v[idx];
            else *out = jv_undef(NULL);
            return true;
        }
        break;
    case JV_STR:
        if (to_index(key, &idx)) {
            int64_t n = (int64_t)str_len_cp(obj);
            if (idx < 0) idx += n;
            if (idx >= 0 && idx < n) {
                size_t b0 = cp_offset(obj->u.s.p, obj->u.s.n, (size_t)idx), b1 = b0;
                utf8_next(obj->u.s.p, obj->u.s.n, &b1);
                *out = jv_str(obj->u.s.p + b0, b1 - b0);
            } else {
                *out = jv_undef(NULL);
            }
            return true;
        }
        break;
    default: break;
    }
    if (key->t == JV_STR) {
        // fall back to the attribute (needs a NUL-terminated name)
        char name[128];
        if (key->u.s.n < sizeof name && !memchr(key->u.s.p, '\0', key->u.s.n)) {
            memcpy(name, key->u.s.p, key->u.s.n);
            name[key->u.s.n] = '\0';
            if (!get_attr(ev, at, obj, name, out)) return false;
            if (out->t == JV_UNDEF) {
                // keep a stable name pointer for messages
                char *nm = ev_alloc(ev, at, key->u.s.n + 1);
                if (!nm) return false;
                memcpy(nm, name, key->u.s.n + 1);
                out->u.undef_name = nm;
            }
            return true;
        }
    }
    *out = undef_attr(owner_desc(obj), NULL);
    return true;
}

static bool name_in(const char *name, const char *const *list) {
    for (int i = 0; list[i]; i++)
        if (list[i][0] == name[0] && !strcmp(list[i], name)) return true;
    return false;
}

static const char *const STR_METHODS[] = {
    "strip", "lstrip", "rstrip", "startswith", "endswith", "split", "rsplit", "replace", "upper", "lower",
    "title", "capitalize", "swapcase", "find", "rfind", "index", "rindex", "count", "join", "isdigit",
    "isalpha", "isalnum", "isspace", "isupper", "islower", "isnumeric", "isdecimal", "splitlines", "center",
    "ljust", "rjust", "zfill", "removeprefix", "removesuffix", "partition", "rpartition", "format", "encode",
    "casefold", "istitle", NULL};
static const char *const DICT_METHODS[] = {"items", "keys", "values", "get", "copy", "pop", "popitem",
                                           "setdefault", "update", "clear", NULL};
static const char *const LIST_METHODS[] = {"index", "count", "copy", "append", "extend", "insert", "pop", "remove",
                                           "reverse", "sort", "clear", NULL};
static const char *const LOOP_METHODS[] = {"cycle", "changed", NULL};

static bool get_attr(struct eval *ev, const struct node *at, const struct jv *obj, const char *name, struct jv *out) {
    switch (obj->t) {
    case JV_UNDEF: return undefined_error(ev, at, obj);
    case JV_DICT:
        if (name_in(name, DICT_METHODS)) return mk_method(ev, at, obj, name, out);
        {
            const struct jv *v = jdict_get_str(obj->u.d, name, strlen(name));
            *out = v ? *v : undef_attr("dict object", name);
        }
        return true;
    case JV_NS: {
        const struct jv *v = jdict_get_str(&obj->u.ns->d, name, strlen(name));
        *out = v ? *v : undef_attr("Namespace object", name);
        return true;
    }
    case JV_STR:
        if (name_in(name, STR_METHODS)) return mk_method(ev, at, obj, name, out);
        break;
    case JV_LIST:
        if (jlist_is_plain(obj->u.l) && name_in(name, LIST_METHODS)) return mk_method(ev, at, obj, name, out);
        break;
    case JV_FUNC:
        if (obj->u.fn->kind == FN_CYCLER) {
            const struct jlist *items = obj->u.fn->self.u.l;
            if (!strcmp(name, "current")) {
                *out = items->v[(size_t)obj->u.fn->id % items->n];
                return true;
            }
            if (!strcmp(name, "next") || !strcmp(name, "reset")) return mk_method(ev, at, obj, name, out);
        }
        break;
    case JV_LOOP: {
        const struct jloop *L = obj->u.loop;
        size_t i = L->index0, n = L->length;
        if (!strcmp(name, "index")) *out = jv_int((int64_t)i + 1);
        else if (!strcmp(name, "index0")) *out = jv_int((int64_t)i);
        else if (!strcmp(name, "revindex")) *out = jv_int((int64_t)(n - i));
        else if (!strcmp(name, "revindex0")) *out = jv_int((int64_t)(n - i - 1));
        else if (!strcmp(name, "first")) *out = jv_bool(i == 0);
        else if (!strcmp(name, "last")) *out = jv_bool(i + 1 == n);
        else if (!strcmp(name, "length")) *out = jv_int((int64_t)n);
        else if (!strcmp(name, "depth")) *out = jv_int(1);
        else if (!strcmp(name, "depth0")) *out = jv_int(0);
        else if (!strcmp(name, "previtem")) *out = i > 0 ? L->items[i - 1] : jv_undef("previtem");
        else if (!strcmp(name, "nextitem")) *out = i + 1 < n ? L->items[i + 1] : jv_undef("nextitem");
        else if (name_in(name, LOOP_METHODS)) return mk_method(ev, at, obj, name, out);
        else *out = undef_attr("LoopContext", name);
        return true;
    }
    default: break;
    }
    *out = undef_attr(owner_desc(obj), name);
    return true;
}

// ---------------------------------------------------------------- string methods
static bool cp_in(uint32_t cp, const struct jv *chars) {
    if (!chars) return py_isspace(cp);
    size_t i = 0;
    while (i < chars->u.s.n)
        if (utf8_next(chars->u.s.p, chars->u.s.n, &i) == cp) return true;
    return false;
}

static struct jv str_strip(const struct jv *s, const struct jv *chars, bool left, bool right) {
    const char *p = s->u.s.p;
    size_t a = 0, b = s->u.s.n;
    if (left)
        while (a < b) {
            size_t j = a;
            if (!cp_in(utf8_next(p, b, &j), chars)) break;
            a = j;
        }
    if (right)
        while (b > a) {
            size_t pr = utf8_prev(p, b), j = pr;
            if (!cp_in(utf8_next(p, b, &j), chars)) break;
            b = pr;
        }
    return jv_str(p + a, b - a);
}

static bool str_case(struct eval *ev, const struct node *at, const struct jv *s, int mode, struct jv *out) {
    // mode: 0 upper, 1 lower, 2 title (str.title), 3 capitalize, 4 swapcase, 5 jinja title filter
    struct sbuf b;
    sbuf_init(&b, 0);
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, i = 0;
    bool prev_cased = false, first = true, word_start = true;
    while (i < n) {
        uint32_t c = utf8_next(p, n, &i), r = c;
        switch (mode) {
        case 0: r = py_upper(c); break;
        case 1: r = py_lower(c); break;
        case 2:
            r = prev_cased ? py_lower(c) : py_upper(c);
            prev_cased = py_iscased_letter(c);
            break;
        case 3: r = first ? py_upper(c) : py_lower(c); break;
        case 4: r = py_upper(c) != c ? py_upper(c) : py_lower(c); break;
        case 5: {
            bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
            r = sep ? c : word_start ? py_upper(c) : py_lower(c);
            word_start = sep;
            break;
        }
        }
        first = false;
        sbuf_put_utf8(&b, r);
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool str_split(struct eval *ev, const struct node *at, const struct jv *s, const struct jv *sep, int64_t maxsplit,
                      bool from_right, struct jv *out) {
    const char *p = s->u.s.p;
    size_t n = s->u.s.n;
    struct jv parts_stack[64], *parts = parts_stack;
    size_t np = 0, cap = 64;
    bool ok = true;
#define PUSH_PART(ptr, len)                                                            \
    do {                                                                               \
        if (np == cap) {                                                               \
            struct jv *q = ev_alloc(ev, at, cap * 2 * sizeof *q);                      \
            if (!q) return false;                                                      \
            memcpy(q, parts, np * sizeof *q);                                          \
            parts = q;                                                                 \
            cap *= 2;                                                                  \
        }                                                                              \
        parts[np++] = jv_str((ptr), (len));                                            \
    } while (0)
    if (!sep || sep->t == JV_NONE) {
        if (!from_right) {
            size_t i = 0;
            while (i < n) {
                while (i < n) { // skip whitespace
                    size_t j = i;
                    if (!py_isspace(utf8_next(p, n, &j))) break;
                    i = j;
                }
                if (i >= n) break;
                if (maxsplit >= 0 && (int64_t)np >= maxsplit) { // the rest, as is
                    PUSH_PART(p + i, n - i);
                    break;
                }
                size_t st = i;
                while (i < n) {
                    size_t j = i;
                    if (py_isspace(utf8_next(p, n, &j))) break;
                    i = j;
                }
                PUSH_PART(p + st, i - st);
            }
        } else {
            size_t e = n;
            while (e > 0) {
                while (e > 0) {
                    size_t pr = utf8_prev(p, e), j = pr;
                    if (!py_isspace(utf8_next(p, n, &j))) break;
                    e = pr;
                }
                if (e == 0) break;
                if (maxsplit >= 0 && (int64_t)np >= maxsplit) {
                    PUSH_PART(p, e);
                    break;
                }
                size_t end = e;
                while (e > 0) {
                    size_t pr = utf8_prev(p, e), j = pr;
                    if (py_isspace(utf8_next(p, n, &j))) break;
                    e = pr;
                }
                PUSH_PART(p + e, end - e);
            }
            for (size_t i = 0; i < np / 2; i++) {
                struct jv t = parts[i];
                parts[i] = parts[np - 1 - i];
                parts[np - 1 - i] = t;
            }
        }
    } else {
        if (sep->t != JV_STR) return FAIL(at, "must be str or None, not %s", jv_type_name(sep));
        size_t sn = sep->u.s.n;
        if (sn == 0) return FAIL(at, "empty separator");
        if (!from_right) {
            size_t i = 0;
            while (true) {
                const char *hit = (maxsplit >= 0 && (int64_t)np >= maxsplit) ? NULL : memmem_s(p + i, n - i, sep->u.s.p, sn);
                if (!hit) {
                    PUSH_PART(p + i, n - i);
                    break;
                }
                PUSH_PART(p + i, (size_t)(hit - (p + i)));
                i = (size_t)(hit - p) + sn;
            }
        } else {
            size_t e = n;
            while (true) {
                const char *hit = NULL;
                if (!(maxsplit >= 0 && (int64_t)np >= maxsplit))
                    for (size_t k = e >= sn ? e - sn + 1 : 0; k-- > 0;)
                        if (!memcmp(p + k, sep->u.s.p, sn)) {
                            hit = p + k;
                            break;
                        }
                if (!hit) {
                    PUSH_PART(p, e);
                    break;
                }
                PUSH_PART(hit + sn, e - (size_t)(hit - p) - sn);
                e = (size_t)(hit - p);
            }
            for (size_t i = 0; i < np / 2; i++) {
                struct jv t = parts[i];
                parts[i] = parts[np - 1 - i];
                parts[np - 1 - i] = t;
            }
        }
    }
#undef PUSH_PART
    struct jlist *l = mk_list(ev, at, np, false);
    if (!l) return false;
    if (np) memcpy(l->v, parts, np * sizeof *parts);
    *out = list_val(l);
    return ok;
}

static bool str_replace(struct eval *ev, const struct node *at, const struct jv *s, const struct jv *old,
                        const struct jv *new_, int64_t count, struct jv *out) {
    if (old->t != JV_STR || new_->t != JV_STR) return FAIL(at, "replace() arguments must be str");
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, i = 0;
    int64_t done = 0;
    if (old->u.s.n == 0) {
        // Python inserts `new` before every code point and at the end
        while (true) {
            if (count < 0 || done < count) {
                sbuf_put(&b, new_->u.s.p, new_->u.s.n);
                done++;
            } else {
                sbuf_put(&b, p + i, n - i);
                break;
            }
            if (i >= n) break;
            size_t st = i;
            utf8_next(p, n, &i);
            sbuf_put(&b, p + st, i - st);
        }
        return sbuf_to_str(ev, at, &b, out);
    }
    while (i <= n) {
        const char *hit = (count >= 0 && done >= count) ? NULL : memmem_s(p + i, n - i, old->u.s.p, old->u.s.n);
        if (!hit) {
            sbuf_put(&b, p + i, n - i);
            break;
        }
        sbuf_put(&b, p + i, (size_t)(hit - (p + i)));
        sbuf_put(&b, new_->u.s.p, new_->u.s.n);
        i = (size_t)(hit - p) + old->u.s.n;
        done++;
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool affix_match(const struct jv *s, const struct jv *a, bool prefix) {
    if (a->u.s.n > s->u.s.n) return false;
    return !memcmp(prefix ? s->u.s.p : s->u.s.p + s->u.s.n - a->u.s.n, a->u.s.p, a->u.s.n);
}

static bool join_strs(struct eval *ev, const struct node *at, const struct jv *sep, const struct jv *items, size_t n,
                      bool strict, struct jv *out) {
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    for (size_t i = 0; i < n; i++) {
        if (i) sbuf_put(&b, sep->u.s.p, sep->u.s.n);
        if (strict && items[i].t != JV_STR) {
            sbuf_free(&b);
            return FAIL(at, "sequence item %zu: expected str instance, %s found", i, jv_type_name(&items[i]));
        }
        jv_write_str(&b, &items[i]);
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool to_str_val(struct eval *ev, const struct node *at, const struct jv *v, struct jv *out);

// One replacement field's value formatted with a Python format spec
// ([[fill]align][sign][0][width][.precision][type]; no grouping).
static bool format_value(struct eval *ev, const struct node *at, const struct jv *v, const char *spec, size_t sn,
                         struct sbuf *b) {
    if (sn == 0) {
        jv_write_str(b, v);
        return true;
    }
    size_t i = 0;
    char align = 0;
    const char *fill = " ";
    size_t fill_n = 1;
    // fill is any single code point followed by an align char
    if (sn >= 2) {
        size_t j = 0;
        utf8_next(spec, sn, &j);
        if (j < sn && strchr("<>=^", spec[j])) {
            fill = spec;
            fill_n = j;
            align = spec[j];
            i = j + 1;
        }
    }
    bool explicit_fill = align != 0;
    if (!align && i < sn && strchr("<>=^", spec[i])) align = spec[i++];
    bool explicit_align = align != 0;
    char sign = 0;
    if (i < sn && strchr("+- ", spec[i])) sign = spec[i++];
    bool alt = false, zero = false;
    if (i < sn && spec[i] == '#') {
        alt = true;
        i++;
    }
    if (i < sn && spec[i] == '0') {
        zero = true;
        i++;
    }
    int width = 0, prec = -1;
    while (i < sn && spec[i] >= '0' && spec[i] <= '9' && width < 100000) width = width * 10 + (spec[i++] - '0');
    if (i < sn && (spec[i] == ',' || spec[i] == '_')) return FAIL(at, "digit grouping in format specs is not supported");
    if (i < sn && spec[i] == '.') {
        i++;
        prec = 0;
        while (i < sn && spec[i] >= '0' && spec[i] <= '9' && prec < 1000) prec = prec * 10 + (spec[i++] - '0');
    }
    char type = i < sn ? spec[i++] : 0;
    if (i != sn) return FAIL(at, "Invalid format specifier '%.*s'", (int)sn, spec);
    struct sbuf body;
    sbuf_init(&body, ev->lim.max_output_bytes);
    bool numeric = false;
    if (v->t == JV_STR && (!type || type == 's')) {
        if (sign) {
            sbuf_free(&body);
            return FAIL(at, "Sign not allowed in string format specifier");
        }
        size_t n = prec >= 0 ? cp_offset(v->u.s.p, v->u.s.n, (size_t)prec) : v->u.s.n;
        sbuf_put(&body, v->u.s.p, n);
        if (!align) align = '<';
    } else if (jv_is_number(v) && !(v->t == JV_FLOAT && strchr("dxXobc", type ? type : 'g'))) {
        numeric = true;
        char fmt[32], tmp[512];
        int k = snprintf(fmt, sizeof fmt, "%%%s%s", sign == '+' ? "+" : sign == ' ' ? " " : "", alt ? "#" : "");
        if (prec >= 0 && type && strchr("eEfFgG%", type)) k += snprintf(fmt + k, sizeof fmt - (size_t)k, ".%d", prec);
        if (v->t != JV_FLOAT && (!type || strchr("dxXobcn", type))) {
            long long iv = v->t == JV_INT ? v->u.i : v->u.b;
            char t = !type || type == 'n' ? 'd' : type;
            if (t == 'c') {
                if (iv < 0 || iv > 0x10FFFF) {
                    sbuf_free(&body);
                    return FAIL(at, "%%c arg not in range(0x110000)");
                }
                sbuf_put_utf8(&body, (uint32_t)iv);
            } else if (t == 'b') {
                char bits[80];
                int nb = 0;
                unsigned long long u = iv < 0 ? (unsigned long long)(-(iv + 1)) + 1 : (unsigned long long)iv;
                do {
                    bits[nb++] = (char)('0' + (u & 1));
                    u >>= 1;
                } while (u);
                if (iv < 0) sbuf_putc(&body, '-');
                else if (sign == '+' || sign == ' ') sbuf_putc(&body, sign);
                if (alt) sbuf_puts(&body, "0b");
                while (nb) sbuf_putc(&body, bits[--nb]);
            } else {
                if (t == 'o' && alt) { // Python writes 0o17, C writes 017
                    snprintf(fmt + k - 1, sizeof fmt - (size_t)k + 1, "llo");
                    snprintf(tmp, sizeof tmp, fmt, iv < 0 ? -iv : iv);
                    sbuf_printf(&body, "%s0o%s", iv < 0 ? "-" : sign == '+' ? "+" : sign == ' ' ? " " : "", tmp);
                } else {
                    snprintf(fmt + k, sizeof fmt - (size_t)k, "ll%c", t);
                    if ((t == 'x' || t == 'X') && iv < 0) {
                        snprintf(tmp, sizeof tmp, fmt, -iv);
                        sbuf_printf(&body, "-%s", tmp);
                    } else {
                        snprintf(tmp, sizeof tmp, fmt, iv);
                        sbuf_puts(&body, tmp);
                    }
                }
            }
        } else {
            double d = jv_as_double(v);
            char t = type ? type : 0;
            if (!t) { // no type: like str() but honouring precision as 'g' with at least one digit kept
                if (prec < 0) {
                    char r[40];
                    py_float_repr(d, r);
                    if (sign == '+' && d >= 0) sbuf_putc(&body, '+');
                    else if (sign == ' ' && d >= 0) sbuf_putc(&body, ' ');
                    sbuf_puts(&body, r);
                } else {
                    snprintf(fmt + k, sizeof fmt - (size_t)k, ".%dg", prec ? prec : 1);
                    snprintf(tmp, sizeof tmp, fmt, d);
                    sbuf_puts(&body, tmp);
                }
            } else if (t == '%') {
                snprintf(fmt + k, sizeof fmt - (size_t)k, "%sf", prec >= 0 ? "" : ".6");
                snprintf(tmp, sizeof tmp, fmt, d * 100.0);
                sbuf_puts(&body, tmp);
                sbuf_putc(&body, '%');
            } else if (strchr("eEfFgG", t)) {
                snprintf(fmt + k, sizeof fmt - (size_t)k, "%s%c", prec >= 0 ? "" : (t == 'g' || t == 'G') ? "" : ".6", t);
                snprintf(tmp, sizeof tmp, fmt, d);
                sbuf_puts(&body, tmp);
            } else {
                sbuf_free(&body);
                return FAIL(at, "Unknown format code '%c' for object of type '%s'", t, jv_type_name(v));
            }
        }
        if (!align) align = '>';
    } else {
        sbuf_free(&body);
        if (v->t == JV_STR || jv_is_number(v))
            return FAIL(at, "Unknown format code '%c' for object of type '%s'", type, jv_type_name(v));
        return FAIL(at, "unsupported format string passed to %s.__format__", jv_type_name(v));
    }
    if (body.overflow) {
        sbuf_free(&body);
        return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "formatted value too large");
    }
    const char *bp = body.p ? body.p : "";
    size_t bn = body.n;
    int cps = (int)utf8_count(bp, bn);
    int pad = width > cps ? width - cps : 0;
    if (zero && !explicit_fill) { // '0' before the width: zero fill, sign-aware for numbers
        fill = "0";
        fill_n = 1;
        if (!explicit_align) align = numeric ? '=' : '<';
    }
    int left = align == '<' ? 0 : align == '^' ? pad / 2 : pad;
    if (align == '=' && bn && strchr("+- ", bp[0])) {
        sbuf_putc(b, bp[0]);
        bp++;
        bn--;
    }
    for (int k = 0; k < left; k++) sbuf_put(b, fill, fill_n);
    sbuf_put(b, bp, bn);
    for (int k = left; k < pad; k++) sbuf_put(b, fill, fill_n);
    sbuf_free(&body);
    return true;
}

// str.format(*args, **kwargs): {} {0} {name} {name.attr} {0[key]}, !r/!s/!a, format specs.
static bool str_format(struct eval *ev, const struct node *at, const struct jv *fmt, struct args *a, struct jv *out) {
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    const char *p = fmt->u.s.p, *end = p + fmt->u.s.n;
    int auto_idx = 0, mode = 0; // 1 automatic, 2 manual numbering
    bool ok = true;
    while (p < end && ok) {
        char c = *p;
        if (c == '}') {
            if (p + 1 < end && p[1] == '}') {
                sbuf_putc(&b, '}');
                p += 2;
                continue;
            }
            ok = FAIL(at, "Single '}' encountered in format string");
            break;
        }
        if (c != '{') {
            sbuf_putc(&b, c);
            p++;
            continue;
        }
        if (p + 1 < end && p[1] == '{') {
            sbuf_putc(&b, '{');
            p += 2;
            continue;
        }
        const char *close = memchr(p, '}', (size_t)(end - p));
        if (!close) {
            ok = FAIL(at, "Single '{' encountered in format string");
            break;
        }
        const char *f = p + 1, *fe = close, *conv = NULL, *spec = NULL;
        for (const char *q = f; q < fe; q++) {
            if (*q == '{') {
                ok = FAIL(at, "nested replacement fields in format specs are not supported");
                break;
            }
            if (*q == '!' && !conv && !spec) conv = q;
            if (*q == ':' && !spec) spec = q;
        }
        if (!ok) break;
        const char *name_end = conv ? conv : spec ? spec : fe;
        // argument name: digits, identifier, or empty; then .attr / [key] chain
        const char *q = f;
        while (q < name_end && *q != '.' && *q != '[') q++;
        struct jv val;
        if (q == f) {
            if (mode == 2) {
                ok = FAIL(at, "cannot switch from manual field specification to automatic field numbering");
                break;
            }
            mode = 1;
            if (auto_idx >= a->npos) {
                ok = FAIL(at, "tuple index out of range (replacement field %d)", auto_idx);
                break;
            }
            val = a->pos[auto_idx++];
        } else if (*f >= '0' && *f <= '9') {
            if (mode == 1) {
                ok = FAIL(at, "cannot switch from automatic field numbering to manual field specification");
                break;
            }
            mode = 2;
            long idx = strtol(f, NULL, 10);
            if (idx >= a->npos) {
                ok = FAIL(at, "tuple index out of range (replacement field %ld)", idx);
                break;
            }
            val = a->pos[idx];
        } else {
            const struct jv *kv = NULL;
            for (int k = 0; k < a->nkw; k++)
                if (strlen(a->kwn[k]) == (size_t)(q - f) && !memcmp(a->kwn[k], f, (size_t)(q - f))) kv = &a->kw[k];
            if (!kv) {
                ok = FAIL(at, "'%.*s'", (int)(q - f), f);
                break;
            }
            val = *kv;
        }
        while (ok && q < name_end) {
            if (*q == '.') {
                const char *e2 = q + 1;
                while (e2 < name_end && *e2 != '.' && *e2 != '[') e2++;
                char *nm = ev_alloc(ev, at, (size_t)(e2 - q));
                if (!nm) {
                    ok = false;
                    break;
                }
                memcpy(nm, q + 1, (size_t)(e2 - q - 1));
                nm[e2 - q - 1] = '\0';
                ok = get_attr(ev, at, &val, nm, &val);
                q = e2;
            } else { // [key]: digits index, else a string key
                const char *e2 = memchr(q, ']', (size_t)(name_end - q));
                if (!e2) {
                    ok = FAIL(at, "Missing ']' in format string");
                    break;
                }
                struct jv key = jv_str(q + 1, (size_t)(e2 - q - 1));
                bool digits = e2 > q + 1;
                for (const char *d = q + 1; d < e2; d++)
                    if (*d < '0' || *d > '9') digits = false;
                if (digits) key = jv_int(strtol(q + 1, NULL, 10));
                ok = get_item(ev, at, &val, &key, &val);
                q = e2 + 1;
            }
        }
        if (!ok) break;
        if (val.t == JV_UNDEF) { // format() of Undefined: str() is ""
            val = jv_str("", 0);
        }
        struct jv conv_v = val;
        if (conv) {
            char cc = conv + 1 < fe ? conv[1] : 0;
            if (cc == 'r' || cc == 'a') {
                struct sbuf t;
                sbuf_init(&t, ev->lim.max_output_bytes);
                jv_write_repr(&t, &val);
                ok = sbuf_to_str(ev, at, &t, &conv_v);
            } else if (cc == 's') {
                ok = to_str_val(ev, at, &val, &conv_v);
            } else {
                ok = FAIL(at, "Unknown conversion specifier %c", cc ? cc : '?');
            }
            if (!ok) break;
        }
        ok = format_value(ev, at, &conv_v, spec ? spec + 1 : fe, spec ? (size_t)(fe - spec - 1) : 0, &b);
        p = close + 1;
    }
    if (!ok) {
        sbuf_free(&b);
        return false;
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool call_str_method(struct eval *ev, const struct node *at, const struct jv *s, const char *m, struct args *a,
                            struct jv *out) {
    const struct jv *a0 = arg_get(a, 0, "\x01"), *a1 = arg_get(a, 1, "\x01");
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
        if (a0 && a0->t != JV_NONE && a0->t != JV_STR) return FAIL(at, "%s arg must be None or str", m);
        *out = str_strip(s, (a0 && a0->t == JV_STR) ? a0 : NULL, m[0] != 'r', m[0] != 'l');
        return true;
    }
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        if (!a0) return FAIL(at, "%s() takes at least 1 argument", m);
        bool prefix = m[0] == 's', r = false;
        if (a0->t == JV_STR) r = affix_match(s, a0, prefix);
        else if (a0->t == JV_LIST && a0->u.l->is_tuple) {
            for (size_t i = 0; i < a0->u.l->n; i++) {
                if (a0->u.l->v[i].t != JV_STR) return FAIL(at, "tuple for %s must only contain str", m);
                if (affix_match(s, &a0->u.l->v[i], prefix)) r = true;
            }
        } else return FAIL(at, "%s first arg must be str or a tuple of str, not %s", m, jv_type_name(a0));
        *out = jv_bool(r);
        return true;
    }
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        const struct jv *sep = arg_get(a, 0, "sep"), *ms = arg_get(a, 1, "maxsplit");
        int64_t maxsplit = -1;
        if (ms && !to_index(ms, &maxsplit)) return FAIL(at, "maxsplit must be an integer");
        return str_split(ev, at, s, sep, maxsplit, m[0] == 'r', out);
    }
    if (!strcmp(m, "replace")) {
        if (!a0 || !a1) return FAIL(at, "replace() takes at least 2 arguments");
        const struct jv *c = arg_get(a, 2, "count");
        int64_t count = -1;
        if (c && !to_index(c, &count)) return FAIL(at, "replace() count must be an integer");
        return str_replace(ev, at, s, a0, a1, count, out);
    }
    if (!strcmp(m, "upper")) return str_case(ev, at, s, 0, out);
    if (!strcmp(m, "lower") || !strcmp(m, "casefold")) return str_case(ev, at, s, 1, out);
    if (!strcmp(m, "title")) return str_case(ev, at, s, 2, out);
    if (!strcmp(m, "capitalize")) return str_case(ev, at, s, 3, out);
    if (!strcmp(m, "swapcase")) return str_case(ev, at, s, 4, out);
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "rindex") ||
        !strcmp(m, "count")) {
        if (!a0 || a0->t != JV_STR) return FAIL(at, "%s() argument must be str", m);
        const char *p = s->u.s.p, *hit = NULL;
        size_t n = s->u.s.n, sn = a0->u.s.n;
        if (!strcmp(m, "count")) {
            int64_t c = 0;
            if (sn == 0) c = (int64_t)str_len_cp(s) + 1;
            else
                for (size_t i = 0; i + sn <= n;) {
                    const char *h = memmem_s(p + i, n - i, a0->u.s.p, sn);
                    if (!h) break;
                    c++;
                    i = (size_t)(h - p) + sn;
                }
            *out = jv_int(c);
            return true;
        }
        if (m[0] == 'r') {
            for (size_t k = n >= sn ? n - sn + 1 : 0; k-- > 0;)
                if (!memcmp(p + k, a0->u.s.p, sn)) {
                    hit = p + k;
                    break;
                }
        } else hit = memmem_s(p, n, a0->u.s.p, sn);
        if (!hit && strstr(m, "index")) return FAIL(at, "substring not found");
        *out = jv_int(hit ? (int64_t)utf8_count(p, (size_t)(hit - p)) : -1);
        return true;
    }
    if (!strcmp(m, "join")) {
        if (!a0) return FAIL(at, "join() takes exactly one argument");
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, a0, &items, &n)) return false;
        return join_strs(ev, at, s, items, n, true, out);
    }
    if (!strncmp(m, "is", 2)) {
        const char *p = s->u.s.p;
        size_t n = s->u.s.n, i = 0;
        bool r = !strcmp(m, "isupper") || !strcmp(m, "islower") || !strcmp(m, "istitle") ? false : n > 0;
        bool any_cased = false;
        while (i < n) {
            uint32_t c = utf8_next(p, n, &i);
            if (!strcmp(m, "isspace")) r = r && py_isspace(c);
            else if (!strcmp(m, "isdigit") || !strcmp(m, "isnumeric") || !strcmp(m, "isdecimal"))
                r = r && ((c >= '0' && c <= '9') || (c >= 0x80 && utf8proc_category((utf8proc_int32_t)c) == UTF8PROC_CATEGORY_ND));
            else if (!strcmp(m, "isalpha")) r = r && (py_iscased_letter(c) || (c >= 0x80 && utf8proc_category((utf8proc_int32_t)c) <= UTF8PROC_CATEGORY_LO && utf8proc_category((utf8proc_int32_t)c) >= UTF8PROC_CATEGORY_LU));
            else if (!strcmp(m, "isalnum")) r = r && (py_iscased_letter(c) || (c >= '0' && c <= '9') || (c >= 0x80 && utf8proc_category((utf8proc_int32_t)c) <= UTF8PROC_CATEGORY_ND && utf8proc_category((utf8proc_int32_t)c) >= UTF8PROC_CATEGORY_LU));
            else if (!strcmp(m, "isupper") || !strcmp(m, "islower")) {
                if (py_iscased_letter(c)) {
                    bool up = py_lower(c) != c, lo = py_upper(c) != c;
                    if (!any_cased) r = true;
                    any_cased = true;
                    if (m[2] == 'u' ? lo : up) r = false;
                }
            } else if (!strcmp(m, "istitle")) return FAIL(at, "str.istitle() is not supported");
        }
        *out = jv_bool(r);
        return true;
    }
    if (!strcmp(m, "splitlines")) {
        struct jv parts[1];
        (void)parts;
        struct jlist *l = NULL;
        const char *p = s->u.s.p;
        size_t n = s->u.s.n, i = 0, st = 0, np = 0;
        struct jv *tmp = ev_alloc(ev, at, (n + 1) * sizeof *tmp);
        if (!tmp) return false;
        while (i < n) {
            size_t cs = i;
            uint32_t c = utf8_next(p, n, &i);
            if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e) || c == 0x85 ||
                c == 0x2028 || c == 0x2029) {
                tmp[np++] = jv_str(p + st, cs - st);
                if (c == '\r' && i < n && p[i] == '\n') i++;
                st = i;
            }
        }
        if (st < n) tmp[np++] = jv_str(p + st, n - st);
        l = mk_list(ev, at, np, false);
        if (!l) return false;
        if (np) memcpy(l->v, tmp, np * sizeof *tmp);
        *out = list_val(l);
        return true;
    }
    if (!strcmp(m, "removeprefix") || !strcmp(m, "removesuffix")) {
        if (!a0 || a0->t != JV_STR) return FAIL(at, "%s() argument must be str", m);
        bool pre = m[6] == 'p';
        *out = *s;
        if (affix_match(s, a0, pre)) {
            out->u.s.n -= a0->u.s.n;
            if (pre) out->u.s.p += a0->u.s.n;
        }
        return true;
    }
    if (!strcmp(m, "partition") || !strcmp(m, "rpartition")) {
        if (!a0 || a0->t != JV_STR || !a0->u.s.n) return FAIL(at, "%s() needs a non-empty str separator", m);
        const char *p = s->u.s.p, *hit = NULL;
        size_t n = s->u.s.n, sn = a0->u.s.n;
        if (m[0] == 'r') {
            for (size_t k = n >= sn ? n - sn + 1 : 0; k-- > 0;)
                if (!memcmp(p + k, a0->u.s.p, sn)) {
                    hit = p + k;
                    break;
                }
        } else hit = memmem_s(p, n, a0->u.s.p, sn);
        struct jlist *l = mk_list(ev, at, 3, true);
        if (!l) return false;
        if (!hit) {
            bool r = m[0] == 'r';
            l->v[0] = r ? jv_str(p, 0) : *s;
            l->v[1] = jv_str(p, 0);
            l->v[2] = r ? *s : jv_str(p, 0);
        } else {
            l->v[0] = jv_str(p, (size_t)(hit - p));
            l->v[1] = jv_str(hit, sn);
            l->v[2] = jv_str(hit + sn, n - (size_t)(hit - p) - sn);
        }
        *out = list_val(l);
        return true;
    }
    if (!strcmp(m, "center") || !strcmp(m, "ljust") || !strcmp(m, "rjust") || !strcmp(m, "zfill")) {
        int64_t w;
        if (!a0 || !to_index(a0, &w)) return FAIL(at, "%s() needs an integer width", m);
        if (w > (int64_t)ev->lim.max_output_bytes) return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "width too large");
        int64_t len = (int64_t)str_len_cp(s);
        struct sbuf b;
        sbuf_init(&b, 0);
        int64_t pad = w > len ? w - len : 0, left = 0;
        const char *fill = " ";
        size_t fill_n = 1;
        if (a1 && a1->t == JV_STR && utf8_count(a1->u.s.p, a1->u.s.n) == 1) {
            fill = a1->u.s.p;
            fill_n = a1->u.s.n;
        }
        if (!strcmp(m, "center")) left = pad / 2 + (pad & w & 1);
        else if (!strcmp(m, "rjust")) left = pad;
        else if (!strcmp(m, "zfill")) {
            left = pad;
            fill = "0";
            fill_n = 1;
        }
        const char *p = s->u.s.p;
        size_t n = s->u.s.n;
        if (!strcmp(m, "zfill") && n && (p[0] == '-' || p[0] == '+')) {
            sbuf_putc(&b, p[0]);
            p++;
            n--;
        }
        for (int64_t i = 0; i < left; i++) sbuf_put(&b, fill, fill_n);
        sbuf_put(&b, p, n);
        for (int64_t i = left; i < pad; i++) sbuf_put(&b, fill, fill_n);
        return sbuf_to_str(ev, at, &b, out);
    }
    if (!strcmp(m, "format")) return str_format(ev, at, s, a, out);
    return FAIL(at, "str.%s() is not supported", m);
}

// ---------------------------------------------------------------- builtins
static bool make_namespace(struct eval *ev, const struct node *at, struct args *a, struct jv *out) {
    struct jns *ns = ev_alloc(ev, at, sizeof *ns);
    if (!ns) return false;
    memset(ns, 0, sizeof *ns);
    for (int i = 0; i < a->npos; i++) {
        if (a->pos[i].t != JV_DICT) return FAIL(at, "namespace() positional arguments must be dicts");
        const struct jdict *d = a->pos[i].u.d;
        for (size_t k = 0; k < d->n; k++) {
            if (d->k[k].t == JV_STR && d->k[k].u.s.n && d->k[k].u.s.p[0] == '_')
                return FAIL(at, "chat templates cannot store underscore-prefixed attributes on a namespace");
            if (!dict_set(ev, at, &ns->d, &d->k[k], &d->v[k])) return false;
        }
    }
    for (int i = 0; i < a->nkw; i++) {
        if (a->kwn[i][0] == '_')
            return FAIL(at, "chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'",
                        a->kwn[i]);
        struct jv k = jv_str(a->kwn[i], strlen(a->kwn[i]));
        if (!dict_set(ev, at, &ns->d, &k, &a->kw[i])) return false;
    }
    out->t = JV_NS;
    out->u.ns = ns;
    return true;
}

static bool call_builtin(struct eval *ev, const struct node *at, int id, struct args *a, struct jv *out) {
    switch (id) {
    case B_RANGE: {
        int64_t v[3] = {0, 0, 1};
        if (a->nkw) return FAIL(at, "range() takes no keyword arguments");
        if (a->npos < 1 || a->npos > 3) return FAIL(at, "range expected 1 to 3 arguments, got %d", a->npos);
        for (int i = 0; i < a->npos; i++)
            if (!to_index(&a->pos[i], &v[i])) return FAIL(at, "'%s' object cannot be interpreted as an integer", jv_type_name(&a->pos[i]));
        int64_t start = a->npos == 1 ? 0 : v[0], stop = a->npos == 1 ? v[0] : v[1], stp = a->npos == 3 ? v[2] : 1;
        if (stp == 0) return FAIL(at, "range() arg 3 must not be zero");
        int64_t cnt = 0;
        if (stp > 0 && stop > start) cnt = (int64_t)(((__int128)stop - start + stp - 1) / stp);
        if (stp < 0 && stop < start) cnt = (int64_t)(((__int128)start - stop - stp - 1) / -stp);
        if (cnt > MAX_RANGE)
            return FAIL(at, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).", MAX_RANGE);
        struct jlist *l = mk_list(ev, at, (size_t)cnt, false);
        if (!l) return false;
        for (int64_t i = 0; i < cnt; i++) l->v[i] = jv_int(start + i * stp);
        *out = list_val(l);
        return true;
    }
    case B_NAMESPACE: return make_namespace(ev, at, a, out);
    case B_DICT: {
        struct jdict *d = mk_dict(ev, at, 0);
        if (!d) return false;
        for (int i = 0; i < a->npos; i++) {
            if (a->pos[i].t != JV_DICT) return FAIL(at, "dict() positional argument must be a mapping");
            for (size_t k = 0; k < a->pos[i].u.d->n; k++)
                if (!dict_set(ev, at, d, &a->pos[i].u.d->k[k], &a->pos[i].u.d->v[k])) return false;
        }
        for (int i = 0; i < a->nkw; i++) {
            struct jv k = jv_str(a->kwn[i], strlen(a->kwn[i]));
            if (!dict_set(ev, at, d, &k, &a->kw[i])) return false;
        }
        *out = dict_val(d);
        return true;
    }
    case B_RAISE: {
        const struct jv *m = arg_get(a, 0, "message");
        struct sbuf b;
        sbuf_init(&b, 400);
        if (m) jv_write_str(&b, m);
        ev_fail(ev, at, ATOMC_ERR_INVALID_ARGUMENT, "%s", b.p ? b.p : "");
        // raise_exception's message stands alone, as HF shows it (no template position)
        if (ev->err) snprintf(ev->err->msg, sizeof ev->err->msg, "%s", b.p ? b.p : "");
        sbuf_free(&b);
        return false;
    }
    case B_JOINER:
    case B_CYCLER: {
        struct jfunc *f = ev_alloc(ev, at, sizeof *f);
        if (!f) return false;
        memset(f, 0, sizeof *f);
        if (id == B_JOINER) {
            const struct jv *sep = arg_get(a, 0, "sep");
            f->kind = FN_JOINER;
            f->self = sep ? *sep : jv_str(", ", 2);
        } else {
            if (a->npos == 0) return FAIL(at, "at least one item has to be provided");
            struct jlist *l = mk_list(ev, at, (size_t)a->npos, false);
            if (!l) return false;
            for (int i = 0; i < a->npos; i++) l->v[i] = a->pos[i];
            f->kind = FN_CYCLER;
            f->self = list_val(l);
        }
        *out = func_val(f);
        return true;
    }
    case B_STRFTIME: {
        const struct jv *f = arg_get(a, 0, "format");
        if (!f || f->t != JV_STR) return FAIL(at, "strftime_now() needs a format string");
        if (f->u.s.n > 256) return FAIL(at, "strftime_now() format too long");
        char fmt[260], buf[1024];
        memcpy(fmt, f->u.s.p, f->u.s.n);
        fmt[f->u.s.n] = '\0';
        struct tm tm;
        time_t now = ev->now ? ev->now : time(NULL);
        localtime_r(&now, &tm);
        size_t k = fmt[0] ? strftime(buf, sizeof buf, fmt, &tm) : 0;
        return mk_str_copy(ev, at, buf, k, out);
    }
    }
    return FAIL(at, "unknown builtin");
}

static bool call_macro(struct eval *ev, const struct node *at, const struct jfunc *fn, struct args *a,
                       const struct jv *caller, struct jv *out) {
    const struct node *m = fn->node;
    if (ev->depth + 8 > ev->lim.max_depth)
        return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "macro calls nested too deeply (limit %d)", ev->lim.max_depth);
    struct scope s = {.parent = fn->kind == FN_CALLER ? fn->closure : ev->root};
    struct scope *saved_scope = ev->scope;
    struct sbuf *saved_out = ev->out;
    int saved_ctrl = ev->loop_ctrl;
    ev->scope = &s;
    struct jlist *varargs = mk_list(ev, at, a->npos > m->n_names ? (size_t)(a->npos - m->n_names) : 0, true);
    struct jdict *kwargs = mk_dict(ev, at, 0);
    bool ok = varargs && kwargs;
    for (int i = 0; ok && i < a->npos; i++) {
        if (i < m->n_names) ok = scope_set(ev, at, &s, m->names[i], &a->pos[i]);
        else varargs->v[i - m->n_names] = a->pos[i];
    }
    for (int i = 0; ok && i < a->nkw; i++) {
        int p = -1;
        for (int j = 0; j < m->n_names; j++)
            if (!strcmp(m->names[j], a->kwn[i])) p = j;
        if (p >= 0 && p < a->npos) {
            ok = FAIL(at, "macro '%s' got multiple values for argument '%s'", m->name ? m->name : "caller", a->kwn[i]);
        } else if (p >= 0) {
            ok = scope_set(ev, at, &s, m->names[p], &a->kw[i]);
        } else {
            struct jv k = jv_str(a->kwn[i], strlen(a->kwn[i]));
            ok = dict_set(ev, at, kwargs, &k, &a->kw[i]);
        }
    }
    for (int j = a->npos; ok && j < m->n_names; j++) {
        bool given = false;
        for (int i = 0; i < a->nkw; i++)
            if (!strcmp(m->names[j], a->kwn[i])) given = true;
        if (given) continue;
        struct jv v = jv_undef(m->names[j]);
        if (m->list && m->list[j] && !eval_expr(ev, m->list[j], &v)) {
            ok = false;
            break;
        }
        ok = scope_set(ev, at, &s, m->names[j], &v);
    }
    if (ok) {
        struct jv va = list_val(varargs), kw = dict_val(kwargs);
        ok = scope_set(ev, at, &s, "varargs", &va) && scope_set(ev, at, &s, "kwargs", &kw);
        if (ok && caller) ok = scope_set(ev, at, &s, "caller", caller);
    }
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    if (ok) {
        ev->out = &b;
        ev->loop_ctrl = 0;
        ev->depth += 8;
        ok = exec_body(ev, m->body, m->n_body);
        ev->depth -= 8;
    }
    ev->out = saved_out;
    ev->scope = saved_scope;
    ev->loop_ctrl = saved_ctrl;
    if (!ok) {
        sbuf_free(&b);
        return false;
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool call_method(struct eval *ev, const struct node *at, const struct jv *self, const char *m, struct args *a,
                        struct jv *out) {
    switch (self->t) {
    case JV_STR: return call_str_method(ev, at, self, m, a, out);
    case JV_DICT: {
        const struct jdict *d = self->u.d;
        if (!strcmp(m, "items") || !strcmp(m, "keys") || !strcmp(m, "values")) {
            struct jlist *l = mk_list(ev, at, d->n, false);
            if (!l) return false;
            l->kind = m[0] == 'k' ? JL_DICT_KEYS : m[0] == 'v' ? JL_DICT_VALUES : JL_DICT_ITEMS;
            for (size_t i = 0; i < d->n; i++) {
                if (m[0] == 'k') l->v[i] = d->k[i];
                else if (m[0] == 'v') l->v[i] = d->v[i];
                else {
                    struct jlist *p = mk_list(ev, at, 2, true);
                    if (!p) return false;
                    p->v[0] = d->k[i];
                    p->v[1] = d->v[i];
                    l->v[i] = list_val(p);
                }
            }
            *out = list_val(l);
            return true;
        }
        if (!strcmp(m, "get")) {
            const struct jv *k = arg_get(a, 0, "key"), *def = arg_get(a, 1, "default");
            if (!k) return FAIL(at, "get expected at least 1 argument, got 0");
            const struct jv *v = jdict_get(d, k);
            *out = v ? *v : def ? *def : jv_none();
            return true;
        }
        if (!strcmp(m, "copy")) {
            *out = *self;
            return true;
        }
        return FAIL(at, "access to attribute '%s' of 'dict' object is unsafe.", m);
    }
    case JV_LIST:
        if (!strcmp(m, "index") || !strcmp(m, "count")) {
            const struct jv *x = arg_get(a, 0, "value");
            if (!x) return FAIL(at, "%s() takes exactly one argument", m);
            int64_t c = 0;
            for (size_t i = 0; i < self->u.l->n; i++)
                if (jv_equal(&self->u.l->v[i], x)) {
                    if (m[0] == 'i') {
                        *out = jv_int((int64_t)i);
                        return true;
                    }
                    c++;
                }
            if (m[0] == 'i') return FAIL(at, "value is not in list");
            *out = jv_int(c);
            return true;
        }
        if (!strcmp(m, "copy")) {
            *out = *self;
            return true;
        }
        return FAIL(at, "access to attribute '%s' of '%s' object is unsafe.", m, jv_type_name(self));
    case JV_LOOP:
        if (!strcmp(m, "cycle")) {
            if (a->npos == 0) return FAIL(at, "no items for cycling given");
            *out = a->pos[self->u.loop->index0 % (size_t)a->npos];
            return true;
        }
        if (!strcmp(m, "changed")) { // True when the arguments differ from the previous call's
            struct jlist *l = mk_list(ev, at, (size_t)a->npos, true);
            if (!l) return false;
            for (int i = 0; i < a->npos; i++) l->v[i] = a->pos[i];
            struct jv cur = list_val(l);
            bool changed = !self->u.loop->has_last || !jv_equal(&self->u.loop->last, &cur);
            self->u.loop->last = cur;
            self->u.loop->has_last = true;
            *out = jv_bool(changed);
            return true;
        }
        return FAIL(at, "loop.%s() is not supported", m);
    case JV_FUNC:
        if (self->u.fn->kind == FN_CYCLER) {
            struct jfunc *f = self->u.fn;
            if (!strcmp(m, "reset")) {
                f->id = 0;
                *out = jv_none();
                return true;
            }
            *out = f->self.u.l->v[(size_t)f->id % f->self.u.l->n]; // next(): current item, then advance
            f->id = (int)(((size_t)f->id + 1) % f->self.u.l->n);
            return true;
        }
        break;
    default: break;
    }
    return FAIL(at, "'%s' object has no method '%s'", jv_type_name(self), m);
}

static bool call_value(struct eval *ev, const struct node *at, const struct jv *fn, struct args *a,
                       const struct jv *caller, struct jv *out) {
    if (fn->t == JV_UNDEF) return undefined_error(ev, at, fn);
    if (fn->t != JV_FUNC) return FAIL(at, "'%s' object is not callable", jv_type_name(fn));
    const struct jfunc *f = fn->u.fn;
    switch (f->kind) {
    case FN_BUILTIN: return call_builtin(ev, at, f->id, a, out);
    case FN_MACRO:
    case FN_CALLER: return call_macro(ev, at, f, a, f->kind == FN_MACRO ? caller : NULL, out);
    case FN_METHOD: return call_method(ev, at, &f->self, f->name, a, out);
    case FN_JOINER: { // "" the first time, the separator after
        struct jfunc *mf = fn->u.fn;
        *out = mf->id++ ? mf->self : jv_str("", 0);
        return true;
    }
    case FN_CYCLER: return FAIL(at, "'Cycler' object is not callable");
    }
    return FAIL(at, "not callable");
}

static bool eval_call(struct eval *ev, const struct node *x, const struct jv *caller, struct jv *out) {
    struct jv fn;
    struct args a;
    if (x->a->kind == N_ATTR) {
        // method call fast path: no bound-method object
        struct jv obj;
        if (!eval_expr(ev, x->a->a, &obj)) return false;
        const char *name = x->a->name;
        bool is_method = (obj.t == JV_STR && name_in(name, STR_METHODS)) ||
                         (obj.t == JV_DICT && name_in(name, DICT_METHODS)) ||
                         (obj.t == JV_LIST && jlist_is_plain(obj.u.l) && name_in(name, LIST_METHODS)) ||
                         (obj.t == JV_LOOP && name_in(name, LOOP_METHODS));
        if (is_method) {
            if (!eval_args(ev, x, &a)) return false;
            return call_method(ev, x, &obj, name, &a, out);
        }
        if (!get_attr(ev, x->a, &obj, name, &fn)) return false;
    } else if (!eval_expr(ev, x->a, &fn)) {
        return false;
    }
    if (!eval_args(ev, x, &a)) return false;
    return call_value(ev, x, &fn, &a, caller, out);
}

// ---------------------------------------------------------------- filters
static bool to_str_val(struct eval *ev, const struct node *at, const struct jv *v, struct jv *out) {
    if (v->t == JV_STR) {
        *out = *v;
        return true;
    }
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    jv_write_str(&b, v);
    return sbuf_to_str(ev, at, &b, out);
}

static bool len_of(struct eval *ev, const struct node *at, const struct jv *v, int64_t *n) {
    switch (v->t) {
    case JV_UNDEF: *n = 0; return true;
    case JV_STR: *n = (int64_t)str_len_cp(v); return true;
    case JV_LIST:
        if (jlist_is_iter(v->u.l)) return FAIL(at, "object of type '%s' has no len()", jv_type_name(v));
        *n = (int64_t)v->u.l->n;
        return true;
    case JV_DICT: *n = (int64_t)v->u.d->n; return true;
    default: return FAIL(at, "object of type '%s' has no len()", jv_type_name(v));
    }
}

// attribute path "a.b.0" as Jinja's make_attrgetter (dots; integer parts index lists)
static bool get_attr_path(struct eval *ev, const struct node *at, const struct jv *v, const struct jv *path,
                          struct jv *out) {
    if (path->t == JV_INT) return get_item(ev, at, v, path, out);
    if (path->t != JV_STR) return FAIL(at, "attribute name must be a string");
    struct jv cur = *v;
    const char *p = path->u.s.p, *end = p + path->u.s.n;
    while (p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        struct jv key = jv_str(p, n);
        bool digits = n > 0;
        int64_t iv = 0;
        for (size_t i = 0; i < n; i++) {
            if (p[i] < '0' || p[i] > '9' || iv > INT64_MAX / 10) digits = false;
            else iv = iv * 10 + (p[i] - '0');
        }
        if (digits) key = jv_int(iv);
        if (!get_item(ev, at, &cur, &key, &cur)) return false;
        if (!dot) break;
        p = dot + 1;
    }
    *out = cur;
    return true;
}

struct sort_ctx {
    struct eval *ev;
    const struct node *at;
    const struct jv *keys;
    bool case_insensitive, reverse, failed;
};

static int key_cmp(struct sort_ctx *c, const struct jv *a, const struct jv *b) {
    int r = 0;
    if (c->case_insensitive && a->t == JV_STR && b->t == JV_STR) {
        size_t i = 0, j = 0;
        while (i < a->u.s.n && j < b->u.s.n) {
            uint32_t x = py_lower(utf8_next(a->u.s.p, a->u.s.n, &i)), y = py_lower(utf8_next(b->u.s.p, b->u.s.n, &j));
            if (x != y) return x < y ? -1 : 1;
        }
        return (i < a->u.s.n) - (j < b->u.s.n);
    }
    if (!jv_order(a, b, &r)) {
        if (!c->failed)
            ev_fail(c->ev, c->at, ATOMC_ERR_INVALID_ARGUMENT, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
        c->failed = true;
        return 0;
    }
    return r == 2 ? 0 : r;
}

static int sort_cmp(const void *x, const void *y, void *ctx) {
    struct sort_ctx *c = ctx;
    size_t i = *(const size_t *)x, j = *(const size_t *)y;
    int r = key_cmp(c, &c->keys[i], &c->keys[j]);
    if (c->reverse) r = -r;
    return r ? r : (i < j ? -1 : i > j); // stable
}

static bool sorted_order(struct eval *ev, const struct node *at, const struct jv *keys, size_t n, bool ci, bool reverse,
                         size_t **order) {
    *order = n ? ev_alloc(ev, at, n * sizeof **order) : NULL;
    if (n && !*order) return false;
    for (size_t i = 0; i < n; i++) (*order)[i] = i;
    struct sort_ctx c = {ev, at, keys, ci, reverse, false};
    if (n > 1) qsort_r(*order, n, sizeof **order, sort_cmp, &c);
    return !c.failed;
}

static const char *const KNOWN_FILTERS[] = {
    "abs", "attr", "capitalize", "center", "count", "d", "default", "dictsort", "e", "escape", "first", "float",
    "forceescape", "indent", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min",
    "reject", "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string",
    "sum", "title", "tojson", "trim", "unique", "upper", "wordcount", NULL};

static bool select_items(struct eval *ev, const struct node *at, const struct jv *v, struct args *a, bool by_attr,
                         bool want, struct jv *out) {
    const struct jv *items = NULL;
    size_t n = 0;
    if (jv_truthy(v) && !iterate(ev, at, v, &items, &n)) return false; // jinja2: `if seq: for item in seq`
    int base = 0;
    const struct jv *attr = NULL;
    if (by_attr) {
        attr = arg_get(a, 0, "\x01");
        if (!attr) return FAIL(at, "missing parameter for attribute name");
        base = 1;
    }
    const struct jv *test = arg_get(a, base, "\x01");
    if (test && test->t != JV_STR) return FAIL(at, "test name must be a string");
    char tname[64] = "";
    if (test) {
        if (test->u.s.n >= sizeof tname) return FAIL(at, "no test named '%.*s'", (int)test->u.s.n, test->u.s.p);
        memcpy(tname, test->u.s.p, test->u.s.n);
        tname[test->u.s.n] = '\0';
    }
    struct args ta = {a->npos > base + 1 ? a->pos + base + 1 : NULL, a->npos > base + 1 ? a->npos - base - 1 : 0,
                      a->kwn, a->kw, a->nkw};
    struct jlist *l = mk_list(ev, at, n, false);
    if (!l) return false;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        struct jv x = items[i];
        if (attr && !get_attr_path(ev, at, &items[i], attr, &x)) return false;
        bool r;
        if (test) {
            if (!apply_test(ev, at, tname, &x, &ta, &r)) return false;
        } else r = jv_truthy(&x);
        if (r == want) l->v[k++] = items[i];
    }
    l->n = k;
    l->kind = JL_GENERATOR;
    *out = list_val(l);
    return true;
}

static bool filter_tojson(struct eval *ev, const struct node *at, const struct jv *v, struct args *a, struct jv *out) {
    static const char *const kws[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
    if (!args_check(ev, at, "tojson", a, 4, kws)) return false;
    const struct jv *ea = arg_get(a, 0, "ensure_ascii"), *ind = arg_get(a, 1, "indent"),
                    *seps = arg_get(a, 2, "separators"), *sk = arg_get(a, 3, "sort_keys");
    struct tojson_opts o = {.ensure_ascii = ea && jv_truthy(ea), .sort_keys = sk && jv_truthy(sk)};
    char spaces[256];
    if (ind && ind->t != JV_NONE) {
        int64_t w;
        if (ind->t == JV_STR) {
            o.indent = ind->u.s.p;
            o.indent_len = ind->u.s.n;
        } else if (to_index(ind, &w)) {
            if (w > 255) return FAIL(at, "tojson indent too large");
            if (w < 0) w = 0;
            memset(spaces, ' ', (size_t)w);
            o.indent = spaces;
            o.indent_len = (size_t)w;
        } else return FAIL(at, "tojson indent must be an int or a string");
    }
    o.item_sep = o.indent ? "," : ", ";
    o.item_sep_len = o.indent ? 1 : 2;
    o.key_sep = ": ";
    o.key_sep_len = 2;
    if (seps && seps->t != JV_NONE) {
        if (seps->t != JV_LIST || seps->u.l->n != 2 || seps->u.l->v[0].t != JV_STR || seps->u.l->v[1].t != JV_STR)
            return FAIL(at, "tojson separators must be a pair of strings");
        o.item_sep = seps->u.l->v[0].u.s.p;
        o.item_sep_len = seps->u.l->v[0].u.s.n;
        o.key_sep = seps->u.l->v[1].u.s.p;
        o.key_sep_len = seps->u.l->v[1].u.s.n;
    }
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    const char *bad = NULL;
    if (!jv_write_json(&b, v, &o, 0, &bad)) {
        sbuf_free(&b);
        if (v->t == JV_UNDEF && !bad) bad = "Undefined";
        return FAIL(at, "Object of type %s is not JSON serializable", bad ? bad : "?");
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool apply_filter(struct eval *ev, const struct node *at, const char *f, const struct jv *v, struct args *a,
                         struct jv *out) {
    const struct jv *a0 = arg_get(a, 0, "\x01");
    if (!strcmp(f, "tojson")) return filter_tojson(ev, at, v, a, out);
    if (!strcmp(f, "safe") || !strcmp(f, "string")) {
        if (!strcmp(f, "safe")) {
            *out = *v;
            if (v->t == JV_STR) return true;
        }
        return to_str_val(ev, at, v, out);
    }
    if (!strcmp(f, "trim")) {
        struct jv s;
        const struct jv *chars = arg_get(a, 0, "chars");
        if (!to_str_val(ev, at, v, &s)) return false;
        if (chars && chars->t != JV_NONE && chars->t != JV_STR) return FAIL(at, "trim chars must be a string");
        *out = str_strip(&s, chars && chars->t == JV_STR ? chars : NULL, true, true);
        return true;
    }
    if (!strcmp(f, "length") || !strcmp(f, "count")) {
        int64_t n = 0;
        if (!len_of(ev, at, v, &n)) return false;
        *out = jv_int(n);
        return true;
    }
    if (!strcmp(f, "upper") || !strcmp(f, "lower") || !strcmp(f, "capitalize") || !strcmp(f, "title")) {
        struct jv s;
        if (!to_str_val(ev, at, v, &s)) return false;
        return str_case(ev, at, &s, f[0] == 'u' ? 0 : f[0] == 'l' ? 1 : f[0] == 'c' ? 3 : 5, out);
    }
    if (!strcmp(f, "default") || !strcmp(f, "d")) {
        const struct jv *def = arg_get(a, 0, "default_value"), *boolean = arg_get(a, 1, "boolean");
        bool use = v->t == JV_UNDEF || (boolean && jv_truthy(boolean) && !jv_truthy(v));
        *out = use ? (def ? *def : jv_str("", 0)) : *v;
        return true;
    }
    if (!strcmp(f, "join")) {
        const struct jv *d = arg_get(a, 0, "d"), *attr = arg_get(a, 1, "attribute");
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        struct jv sep = jv_str("", 0);
        if (d && !to_str_val(ev, at, d, &sep)) return false;
        if (attr && attr->t != JV_NONE) {
            struct jv *mapped = n ? ev_alloc(ev, at, n * sizeof *mapped) : NULL;
            if (n && !mapped) return false;
            for (size_t i = 0; i < n; i++)
                if (!get_attr_path(ev, at, &items[i], attr, &mapped[i])) return false;
            items = mapped;
        }
        return join_strs(ev, at, &sep, items, n, false, out);
    }
    if (!strcmp(f, "items")) {
        if (v->t == JV_UNDEF) {
            struct jlist *l = mk_list(ev, at, 0, false);
            if (!l) return false;
            l->kind = JL_GENERATOR;
            *out = list_val(l);
            return true;
        }
        if (v->t != JV_DICT) return FAIL(at, "can only get item pairs from a mapping");
        struct args none = {0};
        if (!call_method(ev, at, v, "items", &none, out)) return false;
        out->u.l->kind = JL_GENERATOR;
        return true;
    }
    if (!strcmp(f, "list")) {
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        struct jlist *l = mk_list(ev, at, n, false);
        if (!l) return false;
        if (n) memcpy(l->v, items, n * sizeof *items);
        *out = list_val(l);
        return true;
    }
    if (!strcmp(f, "first") || !strcmp(f, "last")) {
        if (v->t == JV_LIST && jlist_is_iter(v->u.l)) {
            struct jlist *l = v->u.l;
            if (f[0] == 'l') return FAIL(at, "'%s' object is not reversible", jv_type_name(v));
            *out = l->pos < l->n ? l->v[l->pos++] : jv_undef(NULL); // next() consumes one item
            return true;
        }
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        *out = n ? items[f[0] == 'f' ? 0 : n - 1] : jv_undef(NULL);
        return true;
    }
    if (!strcmp(f, "reverse")) {
        if (v->t == JV_STR) {
            struct jv step = jv_int(-1);
            return do_slice(ev, at, v, NULL, NULL, &step, out);
        }
        // reversed(): an iterator for lists, dicts and views; a generator is listed then reversed
        bool was_iter = v->t == JV_LIST && jlist_is_iter(v->u.l);
        if (!(v->t == JV_LIST || v->t == JV_DICT || v->t == JV_UNDEF)) return FAIL(at, "argument must be iterable");
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        struct jlist *l = mk_list(ev, at, n, false);
        if (!l) return false;
        for (size_t i = 0; i < n; i++) l->v[i] = items[n - 1 - i];
        if (!was_iter) l->kind = JL_REVITER;
        *out = list_val(l);
        return true;
    }
    if (!strcmp(f, "map")) {
        const struct jv *items = NULL;
        size_t n = 0;
        if (jv_truthy(v) && !iterate(ev, at, v, &items, &n)) return false; // jinja2: `if value: for ...`
        struct jlist *l = mk_list(ev, at, n, false);
        if (!l) return false;
        const struct jv *attr = arg_get(a, -1, "attribute");
        if (attr) {
            const struct jv *def = arg_get(a, -1, "default");
            for (size_t i = 0; i < n; i++) {
                if (!get_attr_path(ev, at, &items[i], attr, &l->v[i])) return false;
                if (def && l->v[i].t == JV_UNDEF) l->v[i] = *def;
            }
        } else {
            if (!a0 || a0->t != JV_STR) return FAIL(at, "map requires a filter name or attribute=");
            char fname[64];
            if (a0->u.s.n >= sizeof fname) return FAIL(at, "no filter named '%.*s'", (int)a0->u.s.n, a0->u.s.p);
            memcpy(fname, a0->u.s.p, a0->u.s.n);
            fname[a0->u.s.n] = '\0';
            if (!name_in(fname, KNOWN_FILTERS)) return FAIL(at, "no filter named '%s'", fname);
            struct args fa = {a->npos > 1 ? a->pos + 1 : NULL, a->npos > 1 ? a->npos - 1 : 0, a->kwn, a->kw, a->nkw};
            for (size_t i = 0; i < n; i++)
                if (!apply_filter(ev, at, fname, &items[i], &fa, &l->v[i])) return false;
        }
        l->kind = JL_GENERATOR;
        *out = list_val(l);
        return true;
    }
    if (!strcmp(f, "select") || !strcmp(f, "reject")) return select_items(ev, at, v, a, false, f[0] == 's', out);
    if (!strcmp(f, "selectattr") || !strcmp(f, "rejectattr")) return select_items(ev, at, v, a, true, f[0] == 's', out);
    if (!strcmp(f, "int")) {
        const struct jv *def = arg_get(a, 0, "default"), *basev = arg_get(a, 1, "base");
        int64_t base = 10;
        if (basev && !to_index(basev, &base)) return FAIL(at, "int base must be an integer");
        struct jv d = def ? *def : jv_int(0);
        if (v->t == JV_INT) *out = *v;
        else if (v->t == JV_BOOL) *out = jv_int(v->u.b);
        else if (v->t == JV_FLOAT) *out = (isfinite(v->u.f) && fabs(v->u.f) < 9.2e18) ? jv_int((int64_t)v->u.f) : d;
        else if (v->t == JV_STR) {
            char buf[128];
            size_t n = v->u.s.n < sizeof buf - 1 ? v->u.s.n : sizeof buf - 1, k = 0;
            for (size_t i = 0; i < n; i++)
                if (v->u.s.p[i] != '_') buf[k++] = v->u.s.p[i];
            buf[k] = '\0';
            char *end;
            errno = 0;
            long long iv = strtoll(buf, &end, (int)base);
            while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
            if (!errno && end != buf && !*end && v->u.s.n < sizeof buf - 1) *out = jv_int(iv);
            else {
                double fv = strtod(buf, &end);
                while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
                *out = (end != buf && !*end && isfinite(fv) && fabs(fv) < 9.2e18) ? jv_int((int64_t)fv) : d;
            }
        } else *out = d;
        return true;
    }
    if (!strcmp(f, "float")) {
        const struct jv *def = arg_get(a, 0, "default");
        struct jv d = def ? *def : jv_float(0.0);
        if (jv_is_number(v)) *out = jv_float(jv_as_double(v));
        else if (v->t == JV_STR) {
            char buf[128];
            size_t n = v->u.s.n;
            if (n >= sizeof buf) *out = d;
            else {
                memcpy(buf, v->u.s.p, n);
                buf[n] = '\0';
                char *end;
                double fv = strtod(buf, &end);
                while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
                *out = (end != buf && !*end) ? jv_float(fv) : d;
            }
        } else *out = d;
        return true;
    }
    if (!strcmp(f, "replace")) {
        struct jv s;
        if (!to_str_val(ev, at, v, &s)) return false;
        const struct jv *old = arg_get(a, 0, "old"), *nw = arg_get(a, 1, "new"), *c = arg_get(a, 2, "count");
        if (!old || !nw) return FAIL(at, "replace filter needs old and new strings");
        struct jv so, sn;
        if (!to_str_val(ev, at, old, &so) || !to_str_val(ev, at, nw, &sn)) return false;
        int64_t count = -1;
        if (c && c->t != JV_NONE && !to_index(c, &count)) return FAIL(at, "replace count must be an integer");
        return str_replace(ev, at, &s, &so, &sn, count, out);
    }
    if (!strcmp(f, "abs")) {
        if (v->t == JV_INT) {
            if (v->u.i == INT64_MIN) return FAIL(at, "integer overflow");
            *out = jv_int(v->u.i < 0 ? -v->u.i : v->u.i);
        } else if (v->t == JV_BOOL) *out = jv_int(v->u.b);
        else if (v->t == JV_FLOAT) *out = jv_float(fabs(v->u.f));
        else return FAIL(at, "bad operand type for abs(): '%s'", jv_type_name(v));
        return true;
    }
    if (!strcmp(f, "round")) {
        const struct jv *pr = arg_get(a, 0, "precision"), *meth = arg_get(a, 1, "method");
        int64_t p = 0;
        if (pr && !to_index(pr, &p)) return FAIL(at, "round precision must be an integer");
        if (!jv_is_number(v)) return FAIL(at, "round needs a number, got '%s'", jv_type_name(v));
        double x = jv_as_double(v), m = pow(10.0, (double)p), r;
        const char *mm = meth && meth->t == JV_STR ? meth->u.s.p : "common";
        if (!strncmp(mm, "common", 6) && v->t != JV_FLOAT && p >= 0) { // Python round(int, n) is the int
            *out = jv_int(v->t == JV_INT ? v->u.i : v->u.b);
            return true;
        }
        if (!strncmp(mm, "common", 6)) r = nearbyint(x * m) / m; // Python round(): half to even
        else if (!strncmp(mm, "ceil", 4)) r = ceil(x * m) / m;
        else if (!strncmp(mm, "floor", 5)) r = floor(x * m) / m;
        else return FAIL(at, "method must be common, ceil or floor");
        *out = jv_float(r);
        return true;
    }
    if (!strcmp(f, "unique")) {
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        const struct jv *cs = arg_get(a, 0, "case_sensitive"), *attr = arg_get(a, 1, "attribute");
        struct jlist *l = mk_list(ev, at, n, false);
        struct jv *keys = n ? ev_alloc(ev, at, n * sizeof *keys) : NULL;
        if (!l || (n && !keys)) return false;
        size_t k = 0;
        struct sort_ctx c = {ev, at, NULL, !(cs && jv_truthy(cs)), false, false};
        for (size_t i = 0; i < n; i++) {
            struct jv key = items[i];
            if (attr && !get_attr_path(ev, at, &items[i], attr, &key)) return false;
            bool seen = false;
            for (size_t j = 0; j < k && !seen; j++)
                seen = (c.case_insensitive && key.t == JV_STR && keys[j].t == JV_STR) ? key_cmp(&c, &key, &keys[j]) == 0
                                                                                       : jv_equal(&key, &keys[j]);
            if (!seen) {
                keys[k] = key;
                l->v[k++] = items[i];
            }
        }
        l->n = k;
        l->kind = JL_GENERATOR;
        *out = list_val(l);
        return true;
    }
    if (!strcmp(f, "sort") || !strcmp(f, "min") || !strcmp(f, "max")) {
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        bool is_sort = f[0] == 's';
        const struct jv *rev = is_sort ? arg_get(a, 0, "reverse") : NULL;
        const struct jv *cs = arg_get(a, is_sort ? 1 : 0, "case_sensitive");
        const struct jv *attr = arg_get(a, is_sort ? 2 : 1, "attribute");
        struct jv *keys = n ? ev_alloc(ev, at, n * sizeof *keys) : NULL;
        if (n && !keys) return false;
        for (size_t i = 0; i < n; i++) {
            keys[i] = items[i];
            if (attr && attr->t != JV_NONE && !get_attr_path(ev, at, &items[i], attr, &keys[i])) return false;
        }
        size_t *order;
        if (!sorted_order(ev, at, keys, n, !(cs && jv_truthy(cs)), rev && jv_truthy(rev), &order)) return false;
        if (!is_sort) {
            *out = n ? items[order[f[1] == 'i' ? 0 : n - 1]] : jv_undef(NULL);
            return true;
        }
        struct jlist *l = mk_list(ev, at, n, false);
        if (!l) return false;
        for (size_t i = 0; i < n; i++) l->v[i] = items[order[i]];
        *out = list_val(l);
        return true;
    }
    if (!strcmp(f, "dictsort")) {
        if (v->t != JV_DICT) return FAIL(at, "dictsort needs a mapping");
        const struct jv *cs = arg_get(a, 0, "case_sensitive"), *by = arg_get(a, 1, "by"), *rev = arg_get(a, 2, "reverse");
        bool by_value = by && by->t == JV_STR && by->u.s.n == 5 && !memcmp(by->u.s.p, "value", 5);
        const struct jdict *d = v->u.d;
        size_t *order;
        if (!sorted_order(ev, at, by_value ? d->v : d->k, d->n, !(cs && jv_truthy(cs)), rev && jv_truthy(rev), &order))
            return false;
        struct jlist *l = mk_list(ev, at, d->n, false);
        if (!l) return false;
        for (size_t i = 0; i < d->n; i++) {
            struct jlist *p = mk_list(ev, at, 2, true);
            if (!p) return false;
            p->v[0] = d->k[order[i]];
            p->v[1] = d->v[order[i]];
            l->v[i] = list_val(p);
        }
        *out = list_val(l);
        return true;
    }
    if (!strcmp(f, "sum")) {
        const struct jv *items;
        size_t n;
        if (!iterate(ev, at, v, &items, &n)) return false;
        const struct jv *attr = arg_get(a, 0, "attribute"), *start = arg_get(a, 1, "start");
        struct jv acc = start ? *start : jv_int(0);
        for (size_t i = 0; i < n; i++) {
            struct jv x = items[i];
            if (attr && attr->t != JV_NONE && !get_attr_path(ev, at, &items[i], attr, &x)) return false;
            if (!binop(ev, at, '+', &acc, &x, &acc)) return false;
        }
        *out = acc;
        return true;
    }
    if (!strcmp(f, "attr")) {
        if (!a0 || a0->t != JV_STR) return FAIL(at, "attr filter needs a name");
        char nm[128];
        if (a0->u.s.n >= sizeof nm) {
            *out = jv_undef(NULL);
            return true;
        }
        memcpy(nm, a0->u.s.p, a0->u.s.n);
        nm[a0->u.s.n] = '\0';
        char *keep = ev_alloc(ev, at, a0->u.s.n + 1);
        if (!keep) return false;
        memcpy(keep, nm, a0->u.s.n + 1);
        if (v->t == JV_DICT && !name_in(keep, DICT_METHODS)) { // attribute only, never the item
            *out = undef_attr("dict object", keep);
            return true;
        }
        return get_attr(ev, at, v, keep, out);
    }
    if (!strcmp(f, "escape") || !strcmp(f, "e") || !strcmp(f, "forceescape")) {
        struct jv s;
        if (!to_str_val(ev, at, v, &s)) return false;
        struct sbuf b;
        sbuf_init(&b, ev->lim.max_output_bytes);
        for (size_t i = 0; i < s.u.s.n; i++) {
            char c = s.u.s.p[i];
            switch (c) {
            case '&': sbuf_puts(&b, "&amp;"); break;
            case '<': sbuf_puts(&b, "&lt;"); break;
            case '>': sbuf_puts(&b, "&gt;"); break;
            case '"': sbuf_puts(&b, "&#34;"); break;
            case '\'': sbuf_puts(&b, "&#39;"); break;
            default: sbuf_putc(&b, c);
            }
        }
        return sbuf_to_str(ev, at, &b, out);
    }
    if (!strcmp(f, "indent")) {
        struct jv s = *v;
        if (v->t != JV_STR) return FAIL(at, "unsupported operand type(s) for +=: '%s' and 'str'", jv_type_name(v));
        const struct jv *w = arg_get(a, 0, "width"), *first = arg_get(a, 1, "first"), *blank = arg_get(a, 2, "blank");
        struct jv ind = jv_str("    ", 4);
        if (w && w->t == JV_STR) ind = *w;
        else if (w) {
            int64_t k;
            if (!to_index(w, &k)) return FAIL(at, "indent width must be an int or a string");
            if (k < 0) k = 0;
            struct sbuf sp;
            sbuf_init(&sp, ev->lim.max_output_bytes);
            for (int64_t i = 0; i < k; i++) sbuf_putc(&sp, ' ');
            if (!sbuf_to_str(ev, at, &sp, &ind)) return false;
        }
        // lines of s + "\n" as str.splitlines() sees them
        struct jv s2;
        struct jv nl = jv_str("\n", 1);
        if (!binop(ev, at, '+', &s, &nl, &s2)) return false;
        struct args none = {0};
        struct jv lines;
        if (!call_str_method(ev, at, &s2, "splitlines", &none, &lines)) return false;
        struct sbuf b;
        sbuf_init(&b, ev->lim.max_output_bytes);
        if (first && jv_truthy(first)) sbuf_put(&b, ind.u.s.p, ind.u.s.n);
        for (size_t i = 0; i < lines.u.l->n; i++) {
            const struct jv *ln = &lines.u.l->v[i];
            if (i) {
                sbuf_putc(&b, '\n');
                if ((blank && jv_truthy(blank)) || ln->u.s.n) sbuf_put(&b, ind.u.s.p, ind.u.s.n);
            }
            sbuf_put(&b, ln->u.s.p, ln->u.s.n);
        }
        return sbuf_to_str(ev, at, &b, out);
    }
    if (!strcmp(f, "wordcount")) {
        struct jv s;
        if (!to_str_val(ev, at, v, &s)) return false;
        int64_t c = 0;
        bool in = false;
        size_t i = 0;
        while (i < s.u.s.n) {
            uint32_t cp = utf8_next(s.u.s.p, s.u.s.n, &i);
            bool w = cp == '_' || (cp < 0x80 ? ((cp | 32) >= 'a' && (cp | 32) <= 'z') || (cp >= '0' && cp <= '9') : !py_isspace(cp));
            if (w && !in) c++;
            in = w;
        }
        *out = jv_int(c);
        return true;
    }
    if (!strcmp(f, "center")) {
        struct jv s;
        if (!to_str_val(ev, at, v, &s)) return false;
        struct jv w = a0 ? *a0 : jv_int(80);
        struct args ca = {&w, 1, NULL, NULL, 0};
        return call_str_method(ev, at, &s, "center", &ca, out);
    }
    return FAIL(at, "no filter named '%s'", f);
}

// ---------------------------------------------------------------- tests
static const char *const KNOWN_TESTS[] = {
    "defined", "undefined", "none", "string", "mapping", "iterable", "number", "integer", "float", "sequence",
    "boolean", "true", "false", "equalto", "eq", "==", "ne", "!=", "lt", "<", "le", "<=", "gt", ">", "ge",
    ">=", "lessthan", "greaterthan", "in", "odd", "even", "divisibleby", "callable", "sameas", "lower", "upper",
    "escaped", "filter", "test", NULL};

static bool apply_test(struct eval *ev, const struct node *at, const char *t, const struct jv *v, struct args *a,
                       bool *r) {
    const struct jv *a0 = arg_get(a, 0, "\x01");
    if (!strcmp(t, "defined")) *r = v->t != JV_UNDEF;
    else if (!strcmp(t, "undefined")) *r = v->t == JV_UNDEF;
    else if (!strcmp(t, "none")) *r = v->t == JV_NONE;
    else if (!strcmp(t, "string")) *r = v->t == JV_STR;
    else if (!strcmp(t, "mapping")) *r = v->t == JV_DICT;
    else if (!strcmp(t, "iterable")) *r = v->t == JV_UNDEF || v->t == JV_STR || v->t == JV_LIST || v->t == JV_DICT;
    else if (!strcmp(t, "sequence")) // len() and __getitem__
        *r = v->t == JV_UNDEF || v->t == JV_STR || (v->t == JV_LIST && jlist_is_plain(v->u.l)) || v->t == JV_DICT;
    else if (!strcmp(t, "number")) *r = jv_is_number(v);
    else if (!strcmp(t, "integer")) *r = v->t == JV_INT;
    else if (!strcmp(t, "float")) *r = v->t == JV_FLOAT;
    else if (!strcmp(t, "boolean")) *r = v->t == JV_BOOL;
    else if (!strcmp(t, "true")) *r = v->t == JV_BOOL && v->u.b;
    else if (!strcmp(t, "false")) *r = v->t == JV_BOOL && !v->u.b;
    else if (!strcmp(t, "callable")) *r = v->t == JV_FUNC;
    else if (!strcmp(t, "escaped")) *r = false;
    else if (!strcmp(t, "filter") || !strcmp(t, "test")) {
        char nm[64] = "";
        if (v->t == JV_STR && v->u.s.n < sizeof nm) {
            memcpy(nm, v->u.s.p, v->u.s.n);
            nm[v->u.s.n] = '\0';
        }
        *r = v->t == JV_STR && name_in(nm, t[0] == 'f' ? KNOWN_FILTERS : KNOWN_TESTS);
    } else if (!strcmp(t, "lower") || !strcmp(t, "upper")) {
        if (v->t != JV_STR) {
            *r = false;
            return true;
        }
        struct jv conv;
        if (!str_case(ev, at, v, t[0] == 'l' ? 1 : 0, &conv)) return false;
        *r = jv_equal(&conv, v);
    } else if (!strcmp(t, "odd") || !strcmp(t, "even") || !strcmp(t, "divisibleby")) {
        int64_t x, y = 2;
        if (v->t == JV_UNDEF) return undefined_error(ev, at, v);
        if (v->t == JV_FLOAT || (t[0] == 'd' && a0 && a0->t == JV_FLOAT)) { // value % n on floats
            double d = a0 && t[0] == 'd' ? jv_as_double(a0) : 2.0;
            if (!jv_is_number(v) || (a0 && t[0] == 'd' && !jv_is_number(a0)))
                return FAIL(at, "test '%s' needs numbers", t);
            if (d == 0) return FAIL(at, "float modulo");
            double m = py_fmod(jv_as_double(v), d);
            *r = t[0] == 'o' ? m == 1.0 : m == 0.0;
            return true;
        }
        if (!to_index(v, &x)) return FAIL(at, "unsupported operand type(s) for %%: '%s' and 'int'", jv_type_name(v));
        if (t[0] == 'd') {
            if (!a0 || !to_index(a0, &y)) return FAIL(at, "divisibleby needs an integer argument");
            if (y == 0) return FAIL(at, "integer division or modulo by zero");
            *r = y == -1 || x % y == 0;
        } else *r = ((x % 2) != 0) == (t[0] == 'o');
    } else if (!strcmp(t, "sameas")) {
        if (!a0) return FAIL(at, "sameas needs an argument");
        // identity: singletons by value, containers by pointer
        if (v->t != a0->t) *r = false;
        else if (v->t == JV_NONE || v->t == JV_UNDEF) *r = true;
        else if (v->t == JV_BOOL) *r = v->u.b == a0->u.b;
        else if (v->t == JV_LIST) *r = v->u.l == a0->u.l;
        else if (v->t == JV_DICT) *r = v->u.d == a0->u.d;
        else *r = jv_equal(v, a0);
    } else if (!strcmp(t, "in")) {
        if (!a0) return FAIL(at, "test 'in' needs an argument");
        return contains(ev, at, v, a0, r);
    } else {
        int op = -1;
        if (!strcmp(t, "equalto") || !strcmp(t, "eq") || !strcmp(t, "==")) op = CMP_EQ;
        else if (!strcmp(t, "ne") || !strcmp(t, "!=")) op = CMP_NE;
        else if (!strcmp(t, "lt") || !strcmp(t, "<") || !strcmp(t, "lessthan")) op = CMP_LT;
        else if (!strcmp(t, "le") || !strcmp(t, "<=")) op = CMP_LE;
        else if (!strcmp(t, "gt") || !strcmp(t, ">") || !strcmp(t, "greaterthan")) op = CMP_GT;
        else if (!strcmp(t, "ge") || !strcmp(t, ">=")) op = CMP_GE;
        if (op < 0) return FAIL(at, "no test named '%s'", t);
        if (!a0) return FAIL(at, "test '%s' needs an argument", t);
        return compare(ev, at, op, v, a0, r);
    }
    return true;
}

// ---------------------------------------------------------------- expressions
static bool eval_expr(struct eval *ev, const struct node *x, struct jv *out) {
    if (!step(ev, x)) return false;
    if (++ev->depth > ev->lim.max_depth) {
        ev->depth--;
        return ev_fail(ev, x, ATOMC_ERR_TOO_LONG, "template nesting too deep (limit %d)", ev->lim.max_depth);
    }
    bool ok = true;
    struct jv a, b;
    switch (x->kind) {
    case N_LIT: *out = x->lit; break;
    case N_PLACEHOLDER: *out = ev->placeholder; break;
    case N_NAME: *out = lookup(ev, x->name); break;
    case N_ATTR: ok = eval_expr(ev, x->a, &a) && get_attr(ev, x, &a, x->name, out); break;
    case N_ITEM: ok = eval_expr(ev, x->a, &a) && eval_expr(ev, x->b, &b) && get_item(ev, x, &a, &b, out); break;
    case N_SLICE: {
        struct jv s0, s1, s2;
        if (!x->a) { // a slice inside a tuple subscript (x[1, 2:3]): no object takes it
            *out = jv_undef(NULL);
            break;
        }
        ok = eval_expr(ev, x->a, &a) && (!x->b || eval_expr(ev, x->b, &s0)) && (!x->c || eval_expr(ev, x->c, &s1)) &&
             (!x->d || eval_expr(ev, x->d, &s2)) &&
             do_slice(ev, x, &a, x->b ? &s0 : NULL, x->c ? &s1 : NULL, x->d ? &s2 : NULL, out);
        break;
    }
    case N_CALL: ok = eval_call(ev, x, NULL, out); break;
    case N_FILTER: {
        struct args args;
        ok = eval_expr(ev, x->a, &a) && eval_args(ev, x, &args) && apply_filter(ev, x, x->name, &a, &args, out);
        break;
    }
    case N_TEST: {
        struct args args;
        bool r = false;
        ok = eval_expr(ev, x->a, &a) && eval_args(ev, x, &args) && apply_test(ev, x, x->name, &a, &args, &r);
        *out = jv_bool(x->op ? !r : r);
        break;
    }
    case N_NEG:
    case N_POS:
        ok = eval_expr(ev, x->a, &a);
        if (!ok) break;
        if (a.t == JV_UNDEF) ok = undefined_error(ev, x, &a);
        else if (a.t == JV_FLOAT) *out = jv_float(x->kind == N_NEG ? -a.u.f : a.u.f);
        else if (a.t == JV_INT || a.t == JV_BOOL) {
            int64_t i = a.t == JV_INT ? a.u.i : a.u.b;
            if (x->kind == N_NEG && i == INT64_MIN) ok = FAIL(x, "integer overflow");
            else *out = jv_int(x->kind == N_NEG ? -i : i);
        } else ok = FAIL(x, "bad operand type for unary %s: '%s'", x->kind == N_NEG ? "-" : "+", jv_type_name(&a));
        break;
    case N_NOT:
        ok = eval_expr(ev, x->a, &a);
        *out = jv_bool(!jv_truthy(&a));
        break;
    case N_AND:
        ok = eval_expr(ev, x->a, &a);
        if (ok) {
            if (!jv_truthy(&a)) *out = a;
            else ok = eval_expr(ev, x->b, out);
        }
        break;
    case N_OR:
        ok = eval_expr(ev, x->a, &a);
        if (ok) {
            if (jv_truthy(&a)) *out = a;
            else ok = eval_expr(ev, x->b, out);
        }
        break;
    case N_BIN: ok = eval_expr(ev, x->a, &a) && eval_expr(ev, x->b, &b) && binop(ev, x, x->op, &a, &b, out); break;
    case N_CMP: {
        ok = eval_expr(ev, x->a, &a);
        bool r = true;
        for (int i = 0; ok && i < x->n_list && r; i++) {
            ok = eval_expr(ev, x->list[i], &b) && compare(ev, x, x->cmp_ops[i], &a, &b, &r);
            a = b;
        }
        *out = jv_bool(r);
        break;
    }
    case N_CONCAT: {
        struct sbuf s;
        sbuf_init(&s, ev->lim.max_output_bytes);
        for (int i = 0; ok && i < x->n_list; i++) {
            ok = eval_expr(ev, x->list[i], &a);
            if (ok) jv_write_str(&s, &a);
        }
        if (ok) ok = sbuf_to_str(ev, x, &s, out);
        else sbuf_free(&s);
        break;
    }
    case N_COND:
        ok = eval_expr(ev, x->a, &a);
        if (ok) {
            if (jv_truthy(&a)) ok = eval_expr(ev, x->b, out);
            else if (x->c) ok = eval_expr(ev, x->c, out);
            else *out = jv_undef(NULL);
        }
        break;
    case N_LIST:
    case N_TUPLE: {
        struct jlist *l = mk_list(ev, x, (size_t)x->n_list, x->kind == N_TUPLE);
        ok = l != NULL;
        for (int i = 0; ok && i < x->n_list; i++) ok = eval_expr(ev, x->list[i], &l->v[i]);
        if (ok) *out = list_val(l);
        break;
    }
    case N_DICT: {
        struct jdict *d = mk_dict(ev, x, (size_t)x->n_list);
        ok = d != NULL;
        for (int i = 0; ok && i < x->n_list; i++) {
            ok = eval_expr(ev, x->list[i], &a) && eval_expr(ev, x->list2[i], &b);
            if (ok && (a.t == JV_LIST && !a.u.l->is_tuple)) ok = FAIL(x, "unhashable type: 'list'");
            if (ok && (a.t == JV_DICT || a.t == JV_NS)) ok = FAIL(x, "unhashable type: '%s'", jv_type_name(&a));
            if (ok) ok = dict_set(ev, x, d, &a, &b);
        }
        if (ok) *out = dict_val(d);
        break;
    }
    default: ok = FAIL(x, "internal error: statement node in expression"); break;
    }
    ev->depth--;
    return ok && !ev->failed;
}

// ---------------------------------------------------------------- statements
static bool emit(struct eval *ev, const struct node *at, const struct jv *v) {
    jv_write_str(ev->out, v);
    if (ev->out->overflow)
        return ev_fail(ev, at, ATOMC_ERR_TOO_LONG, "template output exceeds %zu bytes", ev->lim.max_output_bytes);
    return true;
}

static bool assign_targets(struct eval *ev, const struct node *at, const char *const *names, int n, const struct jv *v) {
    if (n == 1) return scope_set(ev, at, ev->scope, names[0], v);
    if (v->t == JV_UNDEF) return undefined_error(ev, at, v);
    const struct jv *items;
    size_t cnt;
    if (!iterate(ev, at, v, &items, &cnt)) return false;
    if (cnt != (size_t)n)
        return FAIL(at, cnt > (size_t)n ? "too many values to unpack (expected %d)" : "not enough values to unpack (expected %d, got %zu)",
                    n, cnt);
    for (int i = 0; i < n; i++)
        if (!scope_set(ev, at, ev->scope, names[i], &items[i])) return false;
    return true;
}

// Renders body into a fresh string (block set, filter block).
static bool capture(struct eval *ev, const struct node *at, struct node *const *body, int n, struct jv *out) {
    struct sbuf b;
    sbuf_init(&b, ev->lim.max_output_bytes);
    struct sbuf *saved = ev->out;
    ev->out = &b;
    bool ok = exec_body(ev, body, n);
    ev->out = saved;
    if (!ok) {
        sbuf_free(&b);
        return false;
    }
    return sbuf_to_str(ev, at, &b, out);
}

static bool apply_chain(struct eval *ev, const struct node *chain, const struct jv *in, struct jv *out) {
    struct jv saved = ev->placeholder;
    ev->placeholder = *in;
    bool ok = eval_expr(ev, chain, out);
    ev->placeholder = saved;
    return ok;
}

static bool exec_for(struct eval *ev, const struct node *x) {
    struct jv it;
    if (!eval_expr(ev, x->a, &it)) return false;
    const struct jv *items;
    size_t n;
    if (!iterate(ev, x->a, &it, &items, &n)) return false;
    struct scope s = {.parent = ev->scope};
    struct scope *saved = ev->scope;
    ev->scope = &s;
    bool ok = true;
    if (x->b) { // `for x in xs if cond`: filter first; loop.* counts the kept items
        struct jv *kept = n ? ev_alloc(ev, x, n * sizeof *kept) : NULL;
        ok = !n || kept;
        size_t k = 0;
        for (size_t i = 0; ok && i < n; i++) {
            s.n = 0;
            struct jv c;
            ok = assign_targets(ev, x, x->names, x->n_names, &items[i]) && eval_expr(ev, x->b, &c);
            if (ok && jv_truthy(&c)) kept[k++] = items[i];
        }
        items = kept;
        n = k;
    }
    struct jloop L = {.items = items, .length = n};
    struct jv loopv = {.t = JV_LOOP};
    loopv.u.loop = &L;
    for (size_t i = 0; ok && i < n; i++) {
        if (!step(ev, x)) {
            ok = false;
            break;
        }
        s.n = 0; // fresh scope per iteration
        L.index0 = i;
        ok = scope_set(ev, x, &s, "loop", &loopv) && assign_targets(ev, x, x->names, x->n_names, &items[i]) &&
             exec_body(ev, x->body, x->n_body);
        if (ev->loop_ctrl == 1) {
            ev->loop_ctrl = 0;
            break;
        }
        ev->loop_ctrl = 0;
    }
    ev->scope = saved;
    if (ok && n == 0 && x->n_else) ok = exec_body(ev, x->else_body, x->n_else);
    return ok;
}

static bool exec_node(struct eval *ev, const struct node *x) {
    if (!step(ev, x)) return false;
    struct jv v;
    switch (x->kind) {
    case N_DATA: return emit(ev, x, &x->lit);
    case N_OUTPUT: return eval_expr(ev, x->a, &v) && emit(ev, x, &v);
    case N_IF:
        if (!eval_expr(ev, x->a, &v)) return false;
        return jv_truthy(&v) ? exec_body(ev, x->body, x->n_body) : exec_body(ev, x->else_body, x->n_else);
    case N_FOR: return exec_for(ev, x);
    case N_SET:
        if (x->b) {
            if (!eval_expr(ev, x->b, &v)) return false;
        } else {
            if (!capture(ev, x, x->body, x->n_body, &v)) return false;
            if (x->c && !apply_chain(ev, x->c, &v, &v)) return false;
        }
        if (x->a) {
            struct jv ns;
            if (!eval_expr(ev, x->a, &ns)) return false;
            if (ns.t != JV_NS) return FAIL(x, "can only assign attributes on a namespace(), '%s' is %s", x->a->name,
                                           ns.t == JV_UNDEF ? "undefined" : jv_type_name(&ns));
            if (x->name[0] == '_')
                return FAIL(x, "chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'",
                            x->name);
            struct jv k = jv_str(x->name, strlen(x->name));
            return dict_set(ev, x, &ns.u.ns->d, &k, &v);
        }
        return assign_targets(ev, x, x->names, x->n_names, &v);
    case N_MACRO: {
        struct jfunc *f = ev_alloc(ev, x, sizeof *f);
        if (!f) return false;
        memset(f, 0, sizeof *f);
        f->kind = FN_MACRO;
        f->node = x;
        f->name = x->name;
        struct jv fv = func_val(f);
        return scope_set(ev, x, ev->scope, x->name, &fv);
    }
    case N_CALLBLOCK: {
        struct jfunc *f = ev_alloc(ev, x, sizeof *f);
        if (!f) return false;
        memset(f, 0, sizeof *f);
        f->kind = FN_CALLER;
        f->node = x;
        f->closure = ev->scope;
        struct jv caller = func_val(f);
        return eval_call(ev, x->a, &caller, &v) && emit(ev, x, &v);
    }
    case N_FILTERBLOCK:
        return capture(ev, x, x->body, x->n_body, &v) && apply_chain(ev, x->c, &v, &v) && emit(ev, x, &v);
    case N_WITH: {
        struct scope s = {.parent = ev->scope};
        bool ok = true;
        struct jv *vals = x->n_list ? ev_alloc(ev, x, (size_t)x->n_list * sizeof *vals) : NULL;
        if (x->n_list && !vals) return false;
        for (int i = 0; ok && i < x->n_list; i++) ok = eval_expr(ev, x->list[i], &vals[i]);
        for (int i = 0; ok && i < x->n_names; i++) ok = scope_set(ev, x, &s, x->names[i], &vals[i]);
        struct scope *saved = ev->scope;
        ev->scope = &s;
        if (ok) ok = exec_body(ev, x->body, x->n_body);
        ev->scope = saved;
        return ok;
    }
    case N_BREAK: ev->loop_ctrl = 1; return true;
    case N_CONTINUE: ev->loop_ctrl = 2; return true;
    case N_GENERATION: return exec_body(ev, x->body, x->n_body);
    default: return eval_expr(ev, x, &v) && emit(ev, x, &v);
    }
}

static bool exec_body(struct eval *ev, struct node *const *body, int n) {
    if (++ev->depth > ev->lim.max_depth) {
        ev->depth--;
        return ev_fail(ev, n ? body[0] : NULL, ATOMC_ERR_TOO_LONG, "template nesting too deep (limit %d)",
                       ev->lim.max_depth);
    }
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        ok = exec_node(ev, body[i]);
        if (ev->loop_ctrl) break;
    }
    ev->depth--;
    return ok && !ev->failed;
}

// ---------------------------------------------------------------- validation (compile time)
// Unknown filters and tests are errors when the template is compiled, as in jinja2.
static bool check_names(const struct node *x, struct error *err, int depth) {
    if (!x || depth > 1000) return true;
    if (x->kind == N_FILTER && !name_in(x->name, KNOWN_FILTERS)) {
        error_set(err, ATOMC_ERR_FORMAT, "template error at line %d, column %d: no filter named '%s'", x->line, x->col,
                  x->name);
        return false;
    }
    if (x->kind == N_TEST && !name_in(x->name, KNOWN_TESTS)) {
        error_set(err, ATOMC_ERR_FORMAT, "template error at line %d, column %d: no test named '%s'", x->line, x->col,
                  x->name);
        return false;
    }
    const struct node *kids[] = {x->a, x->b, x->c, x->d};
    for (int i = 0; i < 4; i++)
        if (!check_names(kids[i], err, depth + 1)) return false;
    for (int i = 0; i < x->n_list; i++)
        if (!check_names(x->list[i], err, depth + 1)) return false;
    for (int i = 0; i < x->n_list2; i++)
        if (!check_names(x->list2[i], err, depth + 1)) return false;
    for (int i = 0; i < x->n_body; i++)
        if (!check_names(x->body[i], err, depth + 1)) return false;
    for (int i = 0; i < x->n_else; i++)
        if (!check_names(x->else_body[i], err, depth + 1)) return false;
    return true;
}

// ---------------------------------------------------------------- public API
void jinja_limits_init(struct jinja_limits *l) {
    l->max_output_bytes = (size_t)16 << 20;
    l->max_memory_bytes = (size_t)256 << 20;
    l->max_steps = 50000000;
    l->max_depth = 400;
}

atomc_status jinja_compile(const char *src, size_t len, struct jinja_template **out, struct error *err) {
    *out = NULL;
    if (!utf8_valid(src, len)) return error_set(err, ATOMC_ERR_FORMAT, "template source is not valid UTF-8");
    struct jinja_template *t = calloc(1, sizeof *t);
    if (!t) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory compiling template");
    arena_init(&t->ar, 0);
    t->src = malloc(len + 1);
    if (!t->src) {
        free(t);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory compiling template");
    }
    // newlines -> \n; drop one trailing newline (keep_trailing_newline=False)
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            t->src[o++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else t->src[o++] = src[i];
    }
    if (o && t->src[o - 1] == '\n') o--;
    t->src[o] = '\0';
    t->src_len = o;
    struct token *toks = NULL;
    size_t n_toks = 0;
    atomc_status st = jinja_lex(t, &toks, &n_toks, err);
    if (st == ATOMC_OK) st = jinja_parse(t, toks, n_toks, err);
    free(toks);
    for (int i = 0; st == ATOMC_OK && i < t->n_body; i++)
        if (!check_names(t->body[i], err, 0)) st = ATOMC_ERR_FORMAT;
    if (st != ATOMC_OK) {
        jinja_template_free(t);
        return st;
    }
    *out = t;
    return ATOMC_OK;
}

void jinja_template_free(struct jinja_template *t) {
    if (!t) return;
    arena_free_all(&t->ar);
    free(t->src);
    free(t);
}

atomc_status jinja_render(const struct jinja_template *t, const json_t *vars, const struct jinja_render_options *opt,
                          char **out, size_t *out_len, struct error *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    struct eval ev;
    memset(&ev, 0, sizeof ev);
    ev.t = t;
    ev.err = err;
    if (opt && opt->limits) ev.lim = *opt->limits;
    else jinja_limits_init(&ev.lim);
    ev.now = opt ? opt->now : 0;
    arena_init(&ev.ar, ev.lim.max_memory_bytes);
    for (int b = 0; b < B_COUNT; b++) {
        ev.builtins[b].kind = FN_BUILTIN;
        ev.builtins[b].id = b;
        ev.builtins[b].name = BUILTIN_NAMES[b];
    }
    struct scope root = {0};
    ev.root = ev.scope = &root;
    struct sbuf b;
    sbuf_init(&b, ev.lim.max_output_bytes);
    ev.out = &b;
    bool ok = true;
    if (vars) {
        if (!json_is_object(vars)) {
            arena_free_all(&ev.ar);
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "template variables must be a JSON object");
        }
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)vars, key, val) {
            struct jv v;
            if (!jv_from_json(&ev.ar, val, &v, 0)) {
                ok = ev_fail(&ev, NULL, ATOMC_ERR_INVALID_ARGUMENT,
                             "variable '%s' is nested too deeply or too large to convert", key);
                break;
            }
            if (!scope_set(&ev, NULL, &root, key, &v)) {
                ok = false;
                break;
            }
        }
    }
    if (ok) ok = exec_body(&ev, t->body, t->n_body);
    arena_free_all(&ev.ar);
    if (!ok) {
        sbuf_free(&b);
        return err ? err->status : ATOMC_ERR_INVALID_ARGUMENT;
    }
    if (b.overflow) {
        sbuf_free(&b);
        return error_set(err, ATOMC_ERR_TOO_LONG, "template output exceeds %zu bytes", ev.lim.max_output_bytes);
    }
    if (!b.p) {
        b.p = malloc(1);
        if (!b.p) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
        b.p[0] = '\0';
    }
    *out = b.p;
    if (out_len) *out_len = b.n;
    return ATOMC_OK;
}
