// Internals shared by the jinja_*.c files: arena, string builder, UTF-8 helpers, the
// value model, tokens and the AST. Not for use outside src/template/.
//
// Values are small by-value structs (struct jv); strings are (pointer, length) views of
// valid UTF-8 that live in the template (literals), in the caller's JSON (inputs) or in
// the render arena. Lists, tuples and dicts are immutable once built (the sandbox
// forbids mutating methods); only namespaces are mutable. So values may share storage
// freely and everything is released at once with the arena.
#ifndef ATOMC_TEMPLATE_JINJA_INTERNAL_H
#define ATOMC_TEMPLATE_JINJA_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "template/jinja.h"

// ---------------------------------------------------------------- arena
struct arena_chunk;
struct arena {
    struct arena_chunk *head;
    size_t used;  // bytes handed out + chunk overheads
    size_t limit; // 0 = unlimited
};
void arena_init(struct arena *a, size_t limit);
void arena_free_all(struct arena *a);
// Returns NULL when the limit is reached or malloc fails (caller reports the error).
void *arena_alloc(struct arena *a, size_t n);

// ---------------------------------------------------------------- string builder
struct sbuf {
    char *p;
    size_t n, cap;
    size_t limit;  // 0 = unlimited
    bool overflow; // a write went past limit or malloc failed; contents truncated
};
void sbuf_init(struct sbuf *b, size_t limit);
void sbuf_free(struct sbuf *b);
void sbuf_put(struct sbuf *b, const char *s, size_t n);
void sbuf_puts(struct sbuf *b, const char *s);
void sbuf_putc(struct sbuf *b, char c);
void sbuf_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sbuf_put_utf8(struct sbuf *b, uint32_t cp);

// ---------------------------------------------------------------- UTF-8 / Python text
// Decodes one code point at s[*i] (valid UTF-8 assumed; invalid bytes decode as themselves).
uint32_t utf8_next(const char *s, size_t n, size_t *i);
size_t utf8_prev(const char *s, size_t i); // start of the code point ending before i
bool utf8_valid(const char *s, size_t n);
size_t utf8_count(const char *s, size_t n); // code points
bool py_isspace(uint32_t cp);               // Python str.isspace() for one code point
bool py_isprintable(uint32_t cp);           // Python str.isprintable() for one code point
uint32_t py_upper(uint32_t cp);
uint32_t py_lower(uint32_t cp);
bool py_iscased_letter(uint32_t cp); // has case (for title())
// Python float repr (shortest round-trip, 'r' formatting): "1.0", "1e+16", "inf", "nan".
void py_float_repr(double x, char buf[40]);

// ---------------------------------------------------------------- values
enum jv_type {
    JV_UNDEF = 0,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST, // list or tuple (jlist.is_tuple)
    JV_DICT,
    JV_NS,   // namespace(): the one mutable object
    JV_FUNC, // macro, builtin, bound method, caller
    JV_LOOP, // the `loop` variable of a for loop
};

struct jlist;
struct jdict;
struct jns;
struct jfunc;
struct jloop;

struct jv {
    enum jv_type t;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        struct jlist *l;
        struct jdict *d;
        struct jns *ns;
        struct jfunc *fn;
        struct jloop *loop;
        const char *undef_name; // JV_UNDEF: what was looked up (for messages), may be NULL
    } u;
    const char *undef_owner; // JV_UNDEF from a missing attribute: the owner's description
};

// What Python object a JV_LIST stands for. jinja2's map/select/reject/selectattr/
// rejectattr/unique/items filters return generators and |reverse a list_reverseiterator:
// always truthy, no len(), not subscriptable, consumed by iteration. dict.items()/keys()/
// values() return views: sized, iterable, printed as dict_items([...]), not subscriptable.
enum jlist_kind {
    JL_LIST = 0, // list, or tuple when is_tuple
    JL_GENERATOR,
    JL_REVITER,
    JL_DICT_ITEMS,
    JL_DICT_KEYS,
    JL_DICT_VALUES,
};

struct jlist {
    size_t n;
    bool is_tuple;
    unsigned char kind; // enum jlist_kind
    size_t pos;         // iterators: items before pos are consumed
    struct jv *v;
};

static inline bool jlist_is_iter(const struct jlist *l) { return l->kind == JL_GENERATOR || l->kind == JL_REVITER; }
static inline bool jlist_is_plain(const struct jlist *l) { return l->kind == JL_LIST; }

struct jdict { // also the storage of namespaces (then mutable, grown by cap)
    size_t n, cap;
    struct jv *k;
    struct jv *v;
};

struct jns {
    struct jdict d;
};

static inline struct jv jv_undef(const char *name) {
    struct jv v = {.t = JV_UNDEF};
    v.u.undef_name = name;
    return v;
}
static inline struct jv jv_none(void) { return (struct jv){.t = JV_NONE}; }
static inline struct jv jv_bool(bool b) {
    struct jv v = {.t = JV_BOOL};
    v.u.b = b;
    return v;
}
static inline struct jv jv_int(int64_t i) {
    struct jv v = {.t = JV_INT};
    v.u.i = i;
    return v;
}
static inline struct jv jv_float(double f) {
    struct jv v = {.t = JV_FLOAT};
    v.u.f = f;
    return v;
}
static inline struct jv jv_str(const char *p, size_t n) {
    struct jv v = {.t = JV_STR};
    v.u.s.p = p;
    v.u.s.n = n;
    return v;
}

const char *jv_type_name(const struct jv *v); // Python's type name: "str", "NoneType", ...
bool jv_truthy(const struct jv *v);
bool jv_equal(const struct jv *a, const struct jv *b);
// Python ordering for <, <=, ...: returns false (not comparable) or true with *cmp set.
bool jv_order(const struct jv *a, const struct jv *b, int *cmp);
bool jv_is_number(const struct jv *v); // bool, int, float
double jv_as_double(const struct jv *v);

// Python str(v) / repr(v) appended to b.
void jv_write_str(struct sbuf *b, const struct jv *v);
void jv_write_repr(struct sbuf *b, const struct jv *v);

struct tojson_opts {
    bool ensure_ascii;
    const char *indent; // NULL = no newlines; else the indent unit ("" for indent=0)
    size_t indent_len;
    const char *item_sep, *key_sep; // defaults ", " / ": " (indent: "," / ": ")
    size_t item_sep_len, key_sep_len;
    bool sort_keys;
};
// json.dumps(v, ...). Returns false and names the offending type in *bad_type when a
// value is not serializable (Undefined, namespace, function).
bool jv_write_json(struct sbuf *b, const struct jv *v, const struct tojson_opts *o, int depth, const char **bad_type);

// JSON -> value (strings point into the json_t, which must outlive the render).
bool jv_from_json(struct arena *a, const json_t *j, struct jv *out, int depth);

// dict lookup by key (Python equality); returns NULL if absent.
const struct jv *jdict_get(const struct jdict *d, const struct jv *key);
const struct jv *jdict_get_str(const struct jdict *d, const char *key, size_t n);

// ---------------------------------------------------------------- tokens
enum tok_type {
    TK_EOF = 0,
    TK_DATA,        // literal template text (already whitespace-controlled)
    TK_VAR_BEGIN,   // {{
    TK_VAR_END,     // }}
    TK_BLOCK_BEGIN, // {%
    TK_BLOCK_END,   // %}
    TK_NAME,
    TK_STRING, // decoded value in (str, str_len)
    TK_INT,
    TK_FLOAT,
    TK_OP, // operator text in (p, n)
};

struct token {
    enum tok_type t;
    const char *p; // source text
    size_t n;
    char *str; // TK_STRING: decoded (arena of the template), TK_NAME: NUL-terminated copy
    size_t str_len;
    int64_t i;
    double f;
    int line, col;
};

// ---------------------------------------------------------------- AST
enum node_kind {
    // statements
    N_DATA,    // str
    N_OUTPUT,  // a
    N_IF,      // a = cond, body, else_body
    N_FOR,     // names/n_names (targets), a = iterable, b = filter cond, body, else_body
    N_SET,     // names (targets) or a = namespace expr + name = attr; b = value; block set: body + c = filter chain
    N_MACRO,   // name, params (names, defaults in list), body
    N_CALLBLOCK, // a = call expression, names/list = caller params/defaults, body
    N_FILTERBLOCK, // c = filter chain (on N_PLACEHOLDER), body
    N_WITH,    // names + list = values, body
    N_BREAK,
    N_CONTINUE,
    N_GENERATION, // HF's {% generation %}: renders its body
    // expressions
    N_LIT,     // lit
    N_NAME,    // name
    N_ATTR,    // a.name
    N_ITEM,    // a[b]
    N_SLICE,   // a[b:c:d] (b, c, d may be NULL)
    N_CALL,    // a(list..., kwnames=list2...)
    N_FILTER,  // a | name(list..., kw...)
    N_TEST,    // a is [not] name(list..., kw...); op = negated
    N_NEG,
    N_POS,
    N_NOT,
    N_BIN,     // op: '+', '-', '*', '/', 'f' (//), '%', 'p' (**)
    N_AND,
    N_OR,
    N_CMP,     // a, then list[i] with cmp_ops[i]
    N_CONCAT,  // list (~)
    N_COND,    // b if a else c
    N_LIST,    // list
    N_TUPLE,   // list
    N_DICT,    // list = keys, list2 = values
    N_PLACEHOLDER, // the value a filter chain of a block set / filter block applies to
};

enum cmp_op { CMP_EQ, CMP_NE, CMP_LT, CMP_LE, CMP_GT, CMP_GE, CMP_IN, CMP_NOTIN };

struct node {
    enum node_kind kind;
    int op;
    int line, col;
    struct node *a, *b, *c, *d;
    struct node **list; // args / items / keys / defaults
    int n_list;
    struct node **list2; // kwarg values / dict values
    const char **kwnames;
    int n_list2;
    struct node **body, **else_body;
    int n_body, n_else;
    const char **names; // targets / params
    int n_names;
    const char *name; // NUL-terminated
    int *cmp_ops;
    struct jv lit; // N_LIT, N_DATA (string)
};

struct jinja_template {
    struct arena ar; // tokens, AST, literal strings
    char *src;       // normalized source (newlines -> \n, trailing newline dropped)
    size_t src_len;
    struct node **body;
    int n_body;
};

// Lexer: fills *toks (arena-allocated, TK_EOF terminated). Errors -> err with line/col.
atomc_status jinja_lex(struct jinja_template *t, struct token **toks, size_t *n_toks, struct error *err);
// Parser: builds t->body from the tokens.
atomc_status jinja_parse(struct jinja_template *t, struct token *toks, size_t n_toks, struct error *err);

#endif
