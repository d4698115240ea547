// Jinja parser: tokens -> AST, following jinja2.parser's grammar and precedence:
//   condexpr (a if c else b) < or < and < not < compare (==, !=, <, <=, >, >=, in, not in)
//   < + - < ~ < * / // % < ** < unary - + < postfix (.attr, [item], (call)) and filters/tests.
// Statements: if/elif/else, for (targets, `if` filter, else, recursive unsupported),
// set (targets, namespace attribute, block set with filters), macro, call, filter, with,
// break/continue (inside loops), generation (HF), raw (handled by the lexer).
// Errors name the line and column and what was expected. Nesting is bounded so hostile
// input cannot overflow the stack.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/jinja_internal.h"

#define PARSE_MAX_DEPTH 200

struct parser {
    struct jinja_template *t;
    struct token *tk;
    size_t n, i;
    struct error *err;
    bool failed;
    int depth;
    int loop_depth;
};

static struct token *cur(struct parser *P) { return &P->tk[P->i]; }
static struct token *peek(struct parser *P, size_t k) {
    size_t j = P->i + k;
    return &P->tk[j < P->n ? j : P->n - 1];
}

static void tok_describe(const struct token *k, char *buf, size_t n) {
    switch (k->t) {
    case TK_EOF: snprintf(buf, n, "end of template"); break;
    case TK_DATA: snprintf(buf, n, "template data"); break;
    case TK_VAR_BEGIN: snprintf(buf, n, "'{{'"); break;
    case TK_VAR_END: snprintf(buf, n, "end of print statement"); break;
    case TK_BLOCK_BEGIN: snprintf(buf, n, "'{%%'"); break;
    case TK_BLOCK_END: snprintf(buf, n, "end of statement block"); break;
    case TK_STRING: snprintf(buf, n, "string"); break;
    case TK_INT: snprintf(buf, n, "integer"); break;
    case TK_FLOAT: snprintf(buf, n, "float"); break;
    default: snprintf(buf, n, "'%.*s'", (int)(k->n > 40 ? 40 : k->n), k->p); break;
    }
}

static void *pfail(struct parser *P, const struct token *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void *pfail(struct parser *P, const struct token *at, const char *fmt, ...) {
    if (P->failed) return NULL;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    error_set(P->err, ATOMC_ERR_FORMAT, "template syntax error at line %d, column %d: %s", at->line, at->col, msg);
    P->failed = true;
    return NULL;
}

static bool is_op(const struct token *k, const char *op) {
    size_t m = strlen(op);
    return k->t == TK_OP && k->n == m && !memcmp(k->p, op, m);
}
static bool is_name(const struct token *k, const char *nm) { return k->t == TK_NAME && !strcmp(k->str, nm); }

static bool expect_op(struct parser *P, const char *op) {
    if (is_op(cur(P), op)) {
        P->i++;
        return true;
    }
    char d[64];
    tok_describe(cur(P), d, sizeof d);
    pfail(P, cur(P), "expected '%s', got %s", op, d);
    return false;
}

static bool expect_block_end(struct parser *P) {
    if (cur(P)->t == TK_BLOCK_END) {
        P->i++;
        return true;
    }
    char d[64];
    tok_describe(cur(P), d, sizeof d);
    pfail(P, cur(P), "expected end of statement block, got %s", d);
    return false;
}

static struct node *mk(struct parser *P, enum node_kind kind, const struct token *at) {
    struct node *x = arena_alloc(&P->t->ar, sizeof *x);
    if (!x) return pfail(P, at, "out of memory");
    memset(x, 0, sizeof *x);
    x->kind = kind;
    x->line = at->line;
    x->col = at->col;
    return x;
}

// Growable pointer vectors (node pointers, name strings): malloc while building, copied into
// the arena by pvec_finish.
struct pvec {
    void **v;
    int n, cap;
};
static bool pvec_push(struct parser *P, struct pvec *a, const void *x) {
    if (a->n == a->cap) {
        int cap = a->cap ? a->cap * 2 : 8;
        void **p = realloc(a->v, (size_t)cap * sizeof *p);
        if (!p) {
            pfail(P, cur(P), "out of memory");
            return false;
        }
        a->v = p;
        a->cap = cap;
    }
    a->v[a->n++] = (void *)x;
    return true;
}
static void **pvec_finish(struct parser *P, struct pvec *a, int *n) {
    *n = a->n;
    void **out = NULL;
    if (a->n) {
        out = arena_alloc(&P->t->ar, (size_t)a->n * sizeof *out);
        if (out) memcpy(out, a->v, (size_t)a->n * sizeof *out);
        else pfail(P, cur(P), "out of memory");
    }
    free(a->v);
    a->v = NULL;
    a->n = a->cap = 0;
    return out;
}
#define nvec_finish(P, a, n) ((struct node **)pvec_finish((P), (a), (n)))
#define svec_finish(P, a, n) ((const char **)pvec_finish((P), (a), (n)))

static struct node *parse_expression(struct parser *P, bool with_condexpr);
static struct node *parse_tuple(struct parser *P, bool with_condexpr, const char *extra_end, bool explicit_parens);
static struct node *parse_unary(struct parser *P, bool with_filter);
static struct node *parse_primary(struct parser *P);
static struct node *parse_postfix(struct parser *P, struct node *node);
static struct node *parse_filter_expr(struct parser *P, struct node *node);

static bool enter(struct parser *P) {
    if (++P->depth > PARSE_MAX_DEPTH) {
        pfail(P, cur(P), "expression or blocks nested too deeply (limit %d)", PARSE_MAX_DEPTH);
        return false;
    }
    return true;
}
static void leave(struct parser *P) { P->depth--; }

// (args, kw=values) after '('; fills node->list / kwnames / list2.
static bool parse_call_args(struct parser *P, struct node *call) {
    if (!expect_op(P, "(")) return false;
    struct pvec args = {0}, kwv = {0};
    struct pvec kwn = {0};
    bool ok = true;
    while (!is_op(cur(P), ")")) {
        if (args.n || kwv.n) {
            if (!expect_op(P, ",")) {
                ok = false;
                break;
            }
            if (is_op(cur(P), ")")) break;
        }
        if (is_op(cur(P), "*") || is_op(cur(P), "**")) {
            pfail(P, cur(P), "*args / **kwargs in calls are not supported");
            ok = false;
            break;
        }
        if (cur(P)->t == TK_NAME && is_op(peek(P, 1), "=")) {
            const char *nm = cur(P)->str;
            P->i += 2;
            struct node *v = parse_expression(P, true);
            if (!v || !pvec_push(P, &kwn, nm) || !pvec_push(P, &kwv, v)) {
                ok = false;
                break;
            }
        } else {
            if (kwv.n) {
                pfail(P, cur(P), "positional argument follows keyword argument");
                ok = false;
                break;
            }
            struct node *v = parse_expression(P, true);
            if (!v || !pvec_push(P, &args, v)) {
                ok = false;
                break;
            }
        }
    }
    if (ok) ok = expect_op(P, ")");
    int nk;
    call->list = nvec_finish(P, &args, &call->n_list);
    call->list2 = nvec_finish(P, &kwv, &call->n_list2);
    call->kwnames = svec_finish(P, &kwn, &nk);
    return ok && !P->failed;
}

// Dotted filter/test name: name(.name)*
static const char *parse_dotted_name(struct parser *P) {
    struct token *k = cur(P);
    if (k->t != TK_NAME) {
        char d[64];
        tok_describe(k, d, sizeof d);
        return pfail(P, k, "expected a filter or test name, got %s", d);
    }
    P->i++;
    if (!is_op(cur(P), ".")) return k->str;
    struct sbuf b;
    sbuf_init(&b, 0);
    sbuf_puts(&b, k->str);
    while (is_op(cur(P), ".") && peek(P, 1)->t == TK_NAME) {
        sbuf_putc(&b, '.');
        sbuf_puts(&b, peek(P, 1)->str);
        P->i += 2;
    }
    char *s = arena_alloc(&P->t->ar, b.n + 1);
    if (s) memcpy(s, b.p, b.n + 1);
    sbuf_free(&b);
    return s;
}

static struct node *parse_filter(struct parser *P, struct node *node, bool start_inline) {
    while (is_op(cur(P), "|") || start_inline) {
        struct token *at = cur(P);
        if (!start_inline) P->i++;
        start_inline = false;
        struct node *f = mk(P, N_FILTER, at);
        if (!f) return NULL;
        f->a = node;
        f->name = parse_dotted_name(P);
        if (!f->name) return NULL;
        if (is_op(cur(P), "(") && !parse_call_args(P, f)) return NULL;
        node = f;
    }
    return node;
}

static struct node *parse_test(struct parser *P, struct node *node) {
    struct token *at = cur(P);
    P->i++; // 'is'
    bool negated = false;
    if (is_name(cur(P), "not")) {
        P->i++;
        negated = true;
    }
    struct node *t = mk(P, N_TEST, at);
    if (!t) return NULL;
    t->a = node;
    t->op = negated;
    t->name = parse_dotted_name(P);
    if (!t->name) return NULL;
    struct token *k = cur(P);
    if (is_op(k, "(")) {
        if (!parse_call_args(P, t)) return NULL;
    } else if ((k->t == TK_NAME || k->t == TK_STRING || k->t == TK_INT || k->t == TK_FLOAT || is_op(k, "[") ||
                is_op(k, "{")) &&
               !is_name(k, "else") && !is_name(k, "or") && !is_name(k, "and")) {
        if (is_name(k, "is")) return pfail(P, k, "you cannot chain multiple tests with is");
        struct node *arg = parse_primary(P);
        if (!arg) return NULL;
        arg = parse_postfix(P, arg);
        if (!arg) return NULL;
        t->list = arena_alloc(&P->t->ar, sizeof *t->list);
        if (!t->list) return pfail(P, k, "out of memory");
        t->list[0] = arg;
        t->n_list = 1;
    }
    return t;
}

static struct node *parse_filter_expr(struct parser *P, struct node *node) {
    while (node && !P->failed) {
        struct token *k = cur(P);
        if (is_op(k, "|")) node = parse_filter(P, node, false);
        else if (is_name(k, "is")) node = parse_test(P, node);
        else if (is_op(k, "(")) {
            struct node *c = mk(P, N_CALL, k);
            if (!c) return NULL;
            c->a = node;
            if (!parse_call_args(P, c)) return NULL;
            node = c;
        } else break;
    }
    return node;
}

static struct node *parse_subscribed(struct parser *P) {
    struct token *at = cur(P);
    struct node *parts[3] = {NULL, NULL, NULL};
    if (is_op(cur(P), ":")) {
        P->i++;
    } else {
        struct node *x = parse_expression(P, true);
        if (!x) return NULL;
        if (!is_op(cur(P), ":")) return x;
        parts[0] = x;
        P->i++;
    }
    if (!is_op(cur(P), "]") && !is_op(cur(P), ",") && !is_op(cur(P), ":")) {
        parts[1] = parse_expression(P, true);
        if (!parts[1]) return NULL;
    }
    if (is_op(cur(P), ":")) {
        P->i++;
        if (!is_op(cur(P), "]") && !is_op(cur(P), ",")) {
            parts[2] = parse_expression(P, true);
            if (!parts[2]) return NULL;
        }
    }
    struct node *s = mk(P, N_SLICE, at);
    if (!s) return NULL;
    s->b = parts[0];
    s->c = parts[1];
    s->d = parts[2];
    return s;
}

static struct node *parse_postfix(struct parser *P, struct node *node) {
    while (node && !P->failed) {
        struct token *k = cur(P);
        if (is_op(k, ".")) {
            P->i++;
            struct token *a = cur(P);
            if (a->t == TK_NAME) {
                struct node *x = mk(P, N_ATTR, k);
                if (!x) return NULL;
                x->a = node;
                x->name = a->str;
                P->i++;
                node = x;
            } else if (a->t == TK_INT) {
                struct node *x = mk(P, N_ITEM, k), *lit = mk(P, N_LIT, a);
                if (!x || !lit) return NULL;
                lit->lit = jv_int(a->i);
                x->a = node;
                x->b = lit;
                P->i++;
                node = x;
            } else {
                return pfail(P, a, "expected name or number after '.'");
            }
        } else if (is_op(k, "[")) {
            P->i++;
            struct pvec args = {0};
            while (!is_op(cur(P), "]")) {
                if (args.n && !expect_op(P, ",")) break;
                if (args.n && is_op(cur(P), "]")) break;
                struct node *x = parse_subscribed(P);
                if (!x || !pvec_push(P, &args, x)) break;
            }
            if (P->failed || !expect_op(P, "]")) {
                free(args.v);
                return NULL;
            }
            if (args.n == 0) {
                free(args.v);
                return pfail(P, k, "empty subscript");
            }
            struct node *arg;
            if (args.n == 1) {
                arg = args.v[0];
                free(args.v);
            } else {
                for (int j = 0; j < args.n; j++)
                    if (((struct node *)args.v[j])->kind == N_SLICE) { // jinja2 emits invalid Python for this
                        free(args.v);
                        return pfail(P, k, "a slice cannot be part of a tuple subscript");
                    }
                arg = mk(P, N_TUPLE, k);
                if (!arg) return NULL;
                arg->list = nvec_finish(P, &args, &arg->n_list);
            }
            if (arg->kind == N_SLICE) {
                arg->a = node;
                node = arg;
            } else {
                struct node *x = mk(P, N_ITEM, k);
                if (!x) return NULL;
                x->a = node;
                x->b = arg;
                node = x;
            }
        } else if (is_op(k, "(")) {
            struct node *c = mk(P, N_CALL, k);
            if (!c) return NULL;
            c->a = node;
            if (!parse_call_args(P, c)) return NULL;
            node = c;
        } else break;
    }
    return node;
}

static struct node *parse_primary(struct parser *P) {
    struct token *k = cur(P);
    struct node *x = NULL;
    if (!enter(P)) return NULL;
    if (k->t == TK_NAME) {
        P->i++;
        if (!strcmp(k->str, "true") || !strcmp(k->str, "True") || !strcmp(k->str, "false") ||
            !strcmp(k->str, "False")) {
            x = mk(P, N_LIT, k);
            if (x) x->lit = jv_bool(k->str[0] == 't' || k->str[0] == 'T');
        } else if (!strcmp(k->str, "none") || !strcmp(k->str, "None")) {
            x = mk(P, N_LIT, k);
            if (x) x->lit = jv_none();
        } else {
            x = mk(P, N_NAME, k);
            if (x) x->name = k->str;
        }
    } else if (k->t == TK_STRING) {
        // adjacent string literals concatenate
        size_t total = 0, j = P->i;
        while (P->tk[j].t == TK_STRING) total += P->tk[j++].str_len;
        char *s = arena_alloc(&P->t->ar, total + 1);
        if (!s) {
            leave(P);
            return pfail(P, k, "out of memory");
        }
        size_t o = 0;
        while (cur(P)->t == TK_STRING) {
            memcpy(s + o, cur(P)->str, cur(P)->str_len);
            o += cur(P)->str_len;
            P->i++;
        }
        s[o] = '\0';
        x = mk(P, N_LIT, k);
        if (x) x->lit = jv_str(s, o);
    } else if (k->t == TK_INT || k->t == TK_FLOAT) {
        P->i++;
        x = mk(P, N_LIT, k);
        if (x) x->lit = k->t == TK_INT ? jv_int(k->i) : jv_float(k->f);
    } else if (is_op(k, "(")) {
        P->i++;
        x = parse_tuple(P, true, NULL, true);
        if (x && !expect_op(P, ")")) x = NULL;
    } else if (is_op(k, "[")) {
        P->i++;
        struct pvec items = {0};
        while (!is_op(cur(P), "]")) {
            if (items.n && !expect_op(P, ",")) break;
            if (is_op(cur(P), "]")) break;
            struct node *e = parse_expression(P, true);
            if (!e || !pvec_push(P, &items, e)) break;
        }
        if (!P->failed && expect_op(P, "]")) {
            x = mk(P, N_LIST, k);
            if (x) x->list = nvec_finish(P, &items, &x->n_list);
        }
        free(items.v);
    } else if (is_op(k, "{")) {
        P->i++;
        struct pvec keys = {0}, vals = {0};
        while (!is_op(cur(P), "}")) {
            if (keys.n && !expect_op(P, ",")) break;
            if (is_op(cur(P), "}")) break;
            struct node *kk = parse_expression(P, true);
            if (!kk || !expect_op(P, ":")) break;
            struct node *vv = parse_expression(P, true);
            if (!vv || !pvec_push(P, &keys, kk) || !pvec_push(P, &vals, vv)) break;
        }
        if (!P->failed && expect_op(P, "}")) {
            x = mk(P, N_DICT, k);
            if (x) {
                x->list = nvec_finish(P, &keys, &x->n_list);
                x->list2 = nvec_finish(P, &vals, &x->n_list2);
            }
        }
        free(keys.v);
        free(vals.v);
    } else {
        char d[64];
        tok_describe(k, d, sizeof d);
        pfail(P, k, "unexpected %s", d);
    }
    leave(P);
    return P->failed ? NULL : x;
}

static struct node *parse_unary(struct parser *P, bool with_filter) {
    struct token *k = cur(P);
    struct node *node;
    if (!enter(P)) return NULL;
    if (is_op(k, "-") || is_op(k, "+")) {
        P->i++;
        struct node *x = parse_unary(P, false);
        node = x ? mk(P, is_op(k, "-") ? N_NEG : N_POS, k) : NULL;
        if (node) node->a = x;
    } else {
        node = parse_primary(P);
    }
    if (node) node = parse_postfix(P, node);
    if (node && with_filter) node = parse_filter_expr(P, node);
    leave(P);
    return node;
}

static struct node *mk_bin(struct parser *P, struct token *at, int op, struct node *l, struct node *r) {
    struct node *x = mk(P, N_BIN, at);
    if (!x) return NULL;
    x->op = op;
    x->a = l;
    x->b = r;
    return x;
}

static struct node *parse_pow(struct parser *P) {
    struct node *l = parse_unary(P, true);
    while (l && is_op(cur(P), "**")) {
        struct token *at = cur(P);
        P->i++;
        struct node *r = parse_unary(P, true);
        l = r ? mk_bin(P, at, 'p', l, r) : NULL;
    }
    return l;
}

static struct node *parse_math2(struct parser *P) {
    struct node *l = parse_pow(P);
    while (l) {
        struct token *at = cur(P);
        int op = is_op(at, "*") ? '*' : is_op(at, "/") ? '/' : is_op(at, "//") ? 'f' : is_op(at, "%") ? '%' : 0;
        if (!op) break;
        P->i++;
        struct node *r = parse_pow(P);
        l = r ? mk_bin(P, at, op, l, r) : NULL;
    }
    return l;
}

static struct node *parse_concat(struct parser *P) {
    struct token *at = cur(P);
    struct node *first = parse_math2(P);
    if (!first || !is_op(cur(P), "~")) return first;
    struct pvec args = {0};
    pvec_push(P, &args, first);
    while (is_op(cur(P), "~")) {
        P->i++;
        struct node *x = parse_math2(P);
        if (!x || !pvec_push(P, &args, x)) {
            free(args.v);
            return NULL;
        }
    }
    struct node *c = mk(P, N_CONCAT, at);
    if (!c) {
        free(args.v);
        return NULL;
    }
    c->list = nvec_finish(P, &args, &c->n_list);
    return c;
}

static struct node *parse_math1(struct parser *P) {
    struct node *l = parse_concat(P);
    while (l) {
        struct token *at = cur(P);
        int op = is_op(at, "+") ? '+' : is_op(at, "-") ? '-' : 0;
        if (!op) break;
        P->i++;
        struct node *r = parse_concat(P);
        l = r ? mk_bin(P, at, op, l, r) : NULL;
    }
    return l;
}

static struct node *parse_compare(struct parser *P) {
    struct token *at = cur(P);
    struct node *expr = parse_math1(P);
    if (!expr) return NULL;
    struct pvec ops = {0};
    int opcodes[64];
    while (!P->failed) {
        struct token *k = cur(P);
        int op;
        if (is_op(k, "==")) op = CMP_EQ;
        else if (is_op(k, "!=")) op = CMP_NE;
        else if (is_op(k, "<")) op = CMP_LT;
        else if (is_op(k, "<=")) op = CMP_LE;
        else if (is_op(k, ">")) op = CMP_GT;
        else if (is_op(k, ">=")) op = CMP_GE;
        else if (is_name(k, "in")) op = CMP_IN;
        else if (is_name(k, "not") && is_name(peek(P, 1), "in")) {
            op = CMP_NOTIN;
            P->i++;
        } else break;
        P->i++;
        if (ops.n >= 64) {
            free(ops.v);
            return pfail(P, k, "comparison chain too long");
        }
        struct node *r = parse_math1(P);
        if (!r || !pvec_push(P, &ops, r)) {
            free(ops.v);
            return NULL;
        }
        opcodes[ops.n - 1] = op;
    }
    if (!ops.n) return expr;
    struct node *c = mk(P, N_CMP, at);
    if (!c) {
        free(ops.v);
        return NULL;
    }
    c->a = expr;
    c->cmp_ops = arena_alloc(&P->t->ar, (size_t)ops.n * sizeof(int));
    if (!c->cmp_ops) return pfail(P, at, "out of memory");
    memcpy(c->cmp_ops, opcodes, (size_t)ops.n * sizeof(int));
    c->list = nvec_finish(P, &ops, &c->n_list);
    return c;
}

static struct node *parse_not(struct parser *P) {
    struct token *k = cur(P);
    if (is_name(k, "not")) {
        if (!enter(P)) return NULL;
        P->i++;
        struct node *x = parse_not(P);
        leave(P);
        struct node *n = x ? mk(P, N_NOT, k) : NULL;
        if (n) n->a = x;
        return n;
    }
    return parse_compare(P);
}

// Left-associative chain `operand (word operand)*` of one boolean operator ("and" over not-
// expressions, "or" over and-chains).
static struct node *parse_bool_chain(struct parser *P, const char *word, enum node_kind kind,
                                     struct node *(*operand)(struct parser *)) {
    struct node *l = operand(P);
    while (l && is_name(cur(P), word)) {
        struct token *at = cur(P);
        P->i++;
        struct node *r = operand(P);
        struct node *x = r ? mk(P, kind, at) : NULL;
        if (x) {
            x->a = l;
            x->b = r;
        }
        l = x;
    }
    return l;
}

static struct node *parse_and(struct parser *P) { return parse_bool_chain(P, "and", N_AND, parse_not); }

static struct node *parse_or(struct parser *P) { return parse_bool_chain(P, "or", N_OR, parse_and); }

static struct node *parse_condexpr(struct parser *P) {
    if (!enter(P)) return NULL;
    struct node *e1 = parse_or(P);
    while (e1 && is_name(cur(P), "if")) {
        struct token *at = cur(P);
        P->i++;
        struct node *cond = parse_or(P);
        if (!cond) {
            e1 = NULL;
            break;
        }
        struct node *e3 = NULL;
        if (is_name(cur(P), "else")) {
            P->i++;
            e3 = parse_condexpr(P);
            if (!e3) {
                e1 = NULL;
                break;
            }
        }
        struct node *x = mk(P, N_COND, at);
        if (!x) {
            e1 = NULL;
            break;
        }
        x->a = cond;
        x->b = e1;
        x->c = e3;
        e1 = x;
    }
    leave(P);
    return e1;
}

static struct node *parse_expression(struct parser *P, bool with_condexpr) {
    return with_condexpr ? parse_condexpr(P) : parse_or(P);
}

static bool is_tuple_end(struct parser *P, const char *extra_end) {
    struct token *k = cur(P);
    if (k->t == TK_VAR_END || k->t == TK_BLOCK_END || k->t == TK_EOF || is_op(k, ")")) return true;
    return extra_end && is_name(k, extra_end);
}

static struct node *parse_tuple(struct parser *P, bool with_condexpr, const char *extra_end, bool explicit_parens) {
    struct token *at = cur(P);
    struct pvec items = {0};
    bool is_tuple = false;
    while (true) {
        if (items.n) {
            if (!is_op(cur(P), ",")) break;
            P->i++;
            is_tuple = true;
        }
        if (is_tuple_end(P, extra_end)) break;
        struct node *x = parse_expression(P, with_condexpr);
        if (!x || !pvec_push(P, &items, x)) {
            free(items.v);
            return NULL;
        }
    }
    if (!is_tuple) {
        if (items.n == 0) {
            free(items.v);
            if (explicit_parens) { // ()
                struct node *t = mk(P, N_TUPLE, at);
                return t;
            }
            char d[64];
            tok_describe(cur(P), d, sizeof d);
            return pfail(P, cur(P), "expected an expression, got %s", d);
        }
        struct node *x = items.v[0];
        free(items.v);
        return x;
    }
    struct node *t = mk(P, N_TUPLE, at);
    if (!t) {
        free(items.v);
        return NULL;
    }
    t->list = nvec_finish(P, &items, &t->n_list);
    return t;
}

// ---------------------------------------------------------------- statements
static bool parse_body(struct parser *P, const char *const *end_tags, struct node ***body, int *n_body,
                       const char **which_end, const struct token *opened_at, const char *opened_tag);

// name or name, name (optionally in parentheses)
static bool parse_assign_names(struct parser *P, struct pvec *names, const char *stop_word) {
    bool paren = false;
    if (is_op(cur(P), "(")) {
        paren = true;
        P->i++;
    }
    while (true) {
        struct token *k = cur(P);
        if (k->t != TK_NAME) {
            char d[64];
            tok_describe(k, d, sizeof d);
            pfail(P, k, "expected a variable name to assign to, got %s", d);
            return false;
        }
        if (!strcmp(k->str, "true") || !strcmp(k->str, "false") || !strcmp(k->str, "none") ||
            !strcmp(k->str, "True") || !strcmp(k->str, "False") || !strcmp(k->str, "None")) {
            pfail(P, k, "cannot assign to '%s'", k->str);
            return false;
        }
        if (!pvec_push(P, names, k->str)) return false;
        P->i++;
        if (!is_op(cur(P), ",")) break;
        P->i++;
        if ((paren && is_op(cur(P), ")")) || (stop_word && is_name(cur(P), stop_word))) break;
    }
    if (paren && !expect_op(P, ")")) return false;
    return true;
}

static struct node *parse_for(struct parser *P, struct token *at) {
    struct node *f = mk(P, N_FOR, at);
    if (!f) return NULL;
    struct pvec names = {0};
    if (!parse_assign_names(P, &names, "in")) {
        free(names.v);
        return NULL;
    }
    f->names = svec_finish(P, &names, &f->n_names);
    if (!is_name(cur(P), "in")) return pfail(P, cur(P), "expected 'in' in for loop");
    P->i++;
    f->a = parse_tuple(P, false, "recursive", false);
    if (!f->a) return NULL;
    if (is_name(cur(P), "if")) {
        P->i++;
        f->b = parse_expression(P, true);
        if (!f->b) return NULL;
    }
    if (is_name(cur(P), "recursive")) return pfail(P, cur(P), "recursive for loops are not supported");
    if (!expect_block_end(P)) return NULL;
    static const char *const ends1[] = {"endfor", "else", NULL};
    static const char *const ends2[] = {"endfor", NULL};
    const char *which;
    P->loop_depth++;
    bool ok = parse_body(P, ends1, &f->body, &f->n_body, &which, at, "for");
    P->loop_depth--;
    if (!ok) return NULL;
    if (!strcmp(which, "else") && !parse_body(P, ends2, &f->else_body, &f->n_else, &which, at, "for")) return NULL;
    return f;
}

static struct node *parse_if(struct parser *P, struct token *at) {
    struct node *x = mk(P, N_IF, at);
    if (!x) return NULL;
    x->a = parse_tuple(P, false, NULL, false);
    if (!x->a || !expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endif", "elif", "else", NULL};
    static const char *const ends2[] = {"endif", NULL};
    const char *which;
    if (!parse_body(P, ends, &x->body, &x->n_body, &which, at, "if")) return NULL;
    if (!strcmp(which, "elif")) {
        struct token *at2 = &P->tk[P->i - 1]; // the 'elif' name
        struct node *e = parse_if(P, at2);
        if (!e) return NULL;
        x->else_body = arena_alloc(&P->t->ar, sizeof *x->else_body);
        if (!x->else_body) return pfail(P, at, "out of memory");
        x->else_body[0] = e;
        x->n_else = 1;
    } else if (!strcmp(which, "else")) {
        if (!parse_body(P, ends2, &x->else_body, &x->n_else, &which, at, "if")) return NULL;
    }
    return x;
}

static struct node *parse_set(struct parser *P, struct token *at) {
    struct node *x = mk(P, N_SET, at);
    if (!x) return NULL;
    struct token *k = cur(P);
    if (k->t == TK_NAME && is_op(peek(P, 1), ".") && peek(P, 2)->t == TK_NAME) {
        // namespace attribute: ns.attr = value
        struct node *nsn = mk(P, N_NAME, k);
        if (!nsn) return NULL;
        nsn->name = k->str;
        x->a = nsn;
        x->name = peek(P, 2)->str;
        P->i += 3;
    } else {
        struct pvec names = {0};
        if (!parse_assign_names(P, &names, NULL)) {
            free(names.v);
            return NULL;
        }
        x->names = svec_finish(P, &names, &x->n_names);
    }
    if (is_op(cur(P), "=")) {
        P->i++;
        x->b = parse_tuple(P, true, NULL, false);
        if (!x->b || !expect_block_end(P)) return NULL;
        return x;
    }
    // block set: {% set x | filters %}...{% endset %}
    if (x->a || x->n_names != 1) return pfail(P, cur(P), "block set needs exactly one plain variable name");
    if (is_op(cur(P), "|")) {
        struct node *ph = mk(P, N_PLACEHOLDER, cur(P));
        if (!ph) return NULL;
        x->c = parse_filter(P, ph, false);
        if (!x->c) return NULL;
    }
    if (!expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endset", NULL};
    const char *which;
    if (!parse_body(P, ends, &x->body, &x->n_body, &which, at, "set")) return NULL;
    return x;
}

// (a, b=default, ...) for macros and call blocks
static bool parse_signature(struct parser *P, struct node *x) {
    struct pvec names = {0};
    struct pvec defs = {0};
    bool ok = expect_op(P, "(");
    while (ok && !is_op(cur(P), ")")) {
        if (names.n && !(ok = expect_op(P, ","))) break;
        if (is_op(cur(P), ")")) break;
        struct token *k = cur(P);
        if (k->t != TK_NAME) {
            pfail(P, k, "expected a parameter name");
            ok = false;
            break;
        }
        P->i++;
        struct node *def = NULL;
        if (is_op(cur(P), "=")) {
            P->i++;
            def = parse_expression(P, true);
            if (!def) {
                ok = false;
                break;
            }
        } else if (defs.n && defs.v[defs.n - 1]) {
            pfail(P, k, "non-default argument follows default argument");
            ok = false;
            break;
        }
        if (!pvec_push(P, &names, k->str) || !pvec_push(P, &defs, def)) {
            ok = false;
            break;
        }
    }
    if (ok) ok = expect_op(P, ")");
    x->names = svec_finish(P, &names, &x->n_names);
    x->list = nvec_finish(P, &defs, &x->n_list);
    return ok && !P->failed;
}

static struct node *parse_macro(struct parser *P, struct token *at) {
    struct node *x = mk(P, N_MACRO, at);
    if (!x) return NULL;
    if (cur(P)->t != TK_NAME) return pfail(P, cur(P), "expected macro name");
    x->name = cur(P)->str;
    P->i++;
    if (!parse_signature(P, x) || !expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endmacro", NULL};
    const char *which;
    int saved = P->loop_depth;
    P->loop_depth = 0;
    bool ok = parse_body(P, ends, &x->body, &x->n_body, &which, at, "macro");
    P->loop_depth = saved;
    return ok ? x : NULL;
}

static struct node *parse_call_block(struct parser *P, struct token *at) {
    struct node *x = mk(P, N_CALLBLOCK, at);
    if (!x) return NULL;
    if (is_op(cur(P), "(") && !parse_signature(P, x)) return NULL;
    x->a = parse_expression(P, true);
    if (!x->a) return NULL;
    if (x->a->kind != N_CALL) return pfail(P, at, "expected a call after {%% call %%}");
    if (!expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endcall", NULL};
    const char *which;
    int saved = P->loop_depth;
    P->loop_depth = 0;
    bool ok = parse_body(P, ends, &x->body, &x->n_body, &which, at, "call");
    P->loop_depth = saved;
    return ok ? x : NULL;
}

static struct node *parse_filter_block(struct parser *P, struct token *at) {
    struct node *x = mk(P, N_FILTERBLOCK, at);
    if (!x) return NULL;
    struct node *ph = mk(P, N_PLACEHOLDER, cur(P));
    if (!ph) return NULL;
    x->c = parse_filter(P, ph, true);
    if (!x->c || !expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endfilter", NULL};
    const char *which;
    return parse_body(P, ends, &x->body, &x->n_body, &which, at, "filter") ? x : NULL;
}

static struct node *parse_with(struct parser *P, struct token *at) {
    struct node *x = mk(P, N_WITH, at);
    if (!x) return NULL;
    struct pvec names = {0};
    struct pvec vals = {0};
    while (cur(P)->t != TK_BLOCK_END && !P->failed) {
        if (names.n && !expect_op(P, ",")) break;
        struct token *k = cur(P);
        if (k->t != TK_NAME) {
            pfail(P, k, "expected a name in 'with'");
            break;
        }
        P->i++;
        if (!expect_op(P, "=")) break;
        struct node *v = parse_expression(P, true);
        if (!v || !pvec_push(P, &names, k->str) || !pvec_push(P, &vals, v)) break;
    }
    x->names = svec_finish(P, &names, &x->n_names);
    x->list = nvec_finish(P, &vals, &x->n_list);
    if (P->failed || !expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endwith", NULL};
    const char *which;
    return parse_body(P, ends, &x->body, &x->n_body, &which, at, "with") ? x : NULL;
}

static struct node *parse_statement(struct parser *P) {
    struct token *k = cur(P);
    if (k->t != TK_NAME) {
        char d[64];
        tok_describe(k, d, sizeof d);
        return pfail(P, k, "expected a statement name after '{%%', got %s", d);
    }
    P->i++;
    const char *nm = k->str;
    struct node *x = NULL;
    if (!enter(P)) return NULL;
    if (!strcmp(nm, "for")) x = parse_for(P, k);
    else if (!strcmp(nm, "if")) x = parse_if(P, k);
    else if (!strcmp(nm, "set")) x = parse_set(P, k);
    else if (!strcmp(nm, "macro")) x = parse_macro(P, k);
    else if (!strcmp(nm, "call")) x = parse_call_block(P, k);
    else if (!strcmp(nm, "filter")) x = parse_filter_block(P, k);
    else if (!strcmp(nm, "with")) x = parse_with(P, k);
    else if (!strcmp(nm, "break") || !strcmp(nm, "continue")) {
        if (!P->loop_depth) pfail(P, k, "'%s' outside of a for loop", nm);
        else if ((x = mk(P, nm[0] == 'b' ? N_BREAK : N_CONTINUE, k)) && !expect_block_end(P)) x = NULL;
    } else if (!strcmp(nm, "generation")) {
        x = mk(P, N_GENERATION, k);
        static const char *const ends[] = {"endgeneration", NULL};
        const char *which;
        if (x && (!expect_block_end(P) || !parse_body(P, ends, &x->body, &x->n_body, &which, k, "generation")))
            x = NULL;
    } else if (!strcmp(nm, "include") || !strcmp(nm, "extends") || !strcmp(nm, "import") || !strcmp(nm, "from") ||
               !strcmp(nm, "block")) {
        pfail(P, k, "'%s' is not supported in chat templates (no template loader)", nm);
    } else {
        pfail(P, k, "encountered unknown tag '%s'", nm);
    }
    leave(P);
    return P->failed ? NULL : x;
}

// Parses nodes until one of end_tags (NULL-terminated list; NULL list = top level, until EOF).
static bool parse_body(struct parser *P, const char *const *end_tags, struct node ***body, int *n_body,
                       const char **which_end, const struct token *opened_at, const char *opened_tag) {
    struct pvec out = {0};
    bool ok = false;
    while (!P->failed) {
        struct token *k = cur(P);
        if (k->t == TK_EOF) {
            if (!end_tags) {
                ok = true;
                break;
            }
            pfail(P, k, "unexpected end of template: the '%s' block opened at line %d was never closed (expected '%s')",
                  opened_tag, opened_at->line, end_tags[0]);
            break;
        }
        if (k->t == TK_DATA) {
            struct node *d = mk(P, N_DATA, k);
            if (!d) break;
            d->lit = jv_str(k->str, k->str_len);
            P->i++;
            if (!pvec_push(P, &out, d)) break;
        } else if (k->t == TK_VAR_BEGIN) {
            P->i++;
            struct node *o = mk(P, N_OUTPUT, k);
            if (!o) break;
            o->a = parse_tuple(P, true, NULL, false);
            if (!o->a) break;
            if (cur(P)->t != TK_VAR_END) {
                char d[64];
                tok_describe(cur(P), d, sizeof d);
                pfail(P, cur(P), "expected end of print statement, got %s", d);
                break;
            }
            P->i++;
            if (!pvec_push(P, &out, o)) break;
        } else if (k->t == TK_BLOCK_BEGIN) {
            struct token *nm = peek(P, 1);
            if (end_tags && nm->t == TK_NAME) {
                const char *hit = NULL;
                for (int j = 0; end_tags[j]; j++)
                    if (!strcmp(nm->str, end_tags[j])) hit = end_tags[j];
                if (hit) {
                    P->i += 2;
                    *which_end = hit;
                    // end tags take no arguments except 'elif' (its condition follows)
                    if (strcmp(hit, "elif") && !expect_block_end(P)) break;
                    ok = true;
                    break;
                }
            }
            if (nm->t == TK_NAME && (!strncmp(nm->str, "end", 3) || !strcmp(nm->str, "elif") || !strcmp(nm->str, "else"))) {
                if (end_tags)
                    pfail(P, nm, "unexpected '%s' (the innermost open block is '%s' from line %d, expecting '%s')",
                          nm->str, opened_tag, opened_at->line, end_tags[0]);
                else
                    pfail(P, nm, "unexpected '%s' with no open block", nm->str);
                break;
            }
            P->i++;
            struct node *s = parse_statement(P);
            if (!s || !pvec_push(P, &out, s)) break;
        } else {
            char d[64];
            tok_describe(k, d, sizeof d);
            pfail(P, k, "unexpected %s", d);
            break;
        }
    }
    *body = nvec_finish(P, &out, n_body);
    return ok && !P->failed;
}

atomc_status jinja_parse(struct jinja_template *t, struct token *toks, size_t n_toks, struct error *err) {
    struct parser P = {.t = t, .tk = toks, .n = n_toks, .err = err};
    const char *which = NULL;
    if (!parse_body(&P, NULL, &t->body, &t->n_body, &which, toks, "template")) return err ? err->status : ATOMC_ERR_FORMAT;
    return ATOMC_OK;
}
