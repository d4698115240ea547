// Tool-call extraction in the formats tool_parser.h lists (see there for the contract).
#include "server/tool_parser.h"

#include <string.h>

#include "common/check.h"

static const char PYTHON_TAG[] = "<|python_tag|>";
#define PYTHON_TAG_LEN (sizeof PYTHON_TAG - 1)

enum tool_parser_kind tool_parser_from_name(const char *name) {
    if (name && !strcmp(name, "hermes")) return TOOL_PARSER_HERMES;
    if (name && !strcmp(name, "llama3_json")) return TOOL_PARSER_LLAMA3_JSON;
    if (name && !strcmp(name, "openai")) return TOOL_PARSER_OPENAI;
    if (name && !strcmp(name, "mistral")) return TOOL_PARSER_MISTRAL;
    if (name && !strcmp(name, "pythonic")) return TOOL_PARSER_PYTHONIC;
    if (name && !strcmp(name, "deepseek_v3")) return TOOL_PARSER_DEEPSEEK_V3;
    if (name && !strcmp(name, "kimi_k2")) return TOOL_PARSER_KIMI_K2;
    if (name && !strcmp(name, "qwen3_coder")) return TOOL_PARSER_QWEN3_CODER;
    if (name && !strcmp(name, "glm45")) return TOOL_PARSER_GLM45;
    return TOOL_PARSER_NONE;
}

const char *tool_parser_names(void) {
    return "hermes, llama3_json, mistral, pythonic, deepseek_v3, kimi_k2, qwen3_coder, glm45, openai";
}

bool tool_parser_needs_special_tokens(enum tool_parser_kind kind) {
    // [TOOL_CALLS] (Mistral), Kimi's <|tool_call...|>, GLM's <tool_call> / <arg_key> are special
    // tokens that default detokenization would drop; DeepSeek's and Qwen's markers are not.
    return kind == TOOL_PARSER_OPENAI || kind == TOOL_PARSER_MISTRAL || kind == TOOL_PARSER_KIMI_K2 ||
           kind == TOOL_PARSER_GLM45;
}

void tool_stream_set_tools(struct tool_stream *t, json_t *tools) {
    t->tools = tools;
}

void tool_text_add(struct tool_text *s, const char *p, size_t n) {
    if (!n) return;
    if (s->len + n + 1 > s->cap) {
        s->cap = (s->len + n + 1) * 2;
        s->p = xrealloc(s->p, s->cap);
    }
    memcpy(s->p + s->len, p, n);
    s->len += n;
    s->p[s->len] = '\0';
}

void tool_text_free(struct tool_text *s) {
    free(s->p);
    memset(s, 0, sizeof *s);
}

void tool_stream_init(struct tool_stream *t, enum tool_parser_kind kind) {
    memset(t, 0, sizeof *t);
    t->kind = kind;
}

void tool_stream_free(struct tool_stream *t) {
    tool_text_free(&t->held);
    memset(t, 0, sizeof *t);
}

static void held_drop(struct tool_stream *t, size_t n) {
    struct tool_text *h = &t->held;
    memmove(h->p, h->p + n, h->len - n);
    h->len -= n;
    if (h->p) h->p[h->len] = '\0';
}

// Length of the longest suffix of p[0, n) that is a proper prefix of the tag.
static size_t tag_prefix_suffix(const char *p, size_t n, const char *tag, size_t tag_len) {
    size_t best = 0;
    for (size_t k = 1; k < tag_len && k <= n; k++)
        if (!memcmp(p + n - k, tag, k)) best = k;
    return best;
}

// {"type": "function", "function": {"name": name, "arguments": args_text}}.
static json_t *call_make(const char *name, size_t name_len, const char *args_text) {
    json_t *fn = json_object(), *call = json_object();
    json_object_set_new(fn, "name", json_stringn(name, name_len));
    json_object_set_new(fn, "arguments", json_string(args_text));
    json_object_set_new(call, "type", json_string("function"));
    json_object_set_new(call, "function", fn);
    return call;
}

// The call object of a parsed JSON value (reference taken over), or NULL if it is not
// {"name": STRING, "arguments" (or llama3's "parameters")?: ...}.
static json_t *call_from_json(json_t *o) {
    if (!json_is_object(o)) {
        json_decref(o);
        return NULL;
    }
    json_t *name = json_object_get(o, "name"), *args = json_object_get(o, "arguments");
    if (!args) args = json_object_get(o, "parameters");
    if (!json_is_string(name) || json_string_length(name) == 0) {
        json_decref(o);
        return NULL;
    }
    char *args_text = NULL;
    if (json_is_string(args))
        args_text = strdup(json_string_value(args));
    else if (args)
        args_text = json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY);
    else
        args_text = strdup("{}");
    CHECK(args_text != NULL);
    json_t *fn = json_object(), *call = json_object();
    json_object_set(fn, "name", name);
    json_object_set_new(fn, "arguments", json_string(args_text));
    free(args_text);
    json_object_set_new(call, "type", json_string("function"));
    json_object_set_new(call, "function", fn);
    json_decref(o);
    return call;
}

enum { L3_START = 0, L3_CALLS = 1, L3_CONTENT = 2 };

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

// llama3_json: decide at the first non-space bytes whether the output is calls; then take one
// JSON object at a time off the front (jansson stops after the first value and says how many
// bytes it read; "premature end of input" means the object is still arriving).
static void llama3_feed(struct tool_stream *t, struct tool_text *content, json_t *calls) {
    for (;;) {
        if (t->mode == L3_CONTENT) {
            tool_text_add(content, t->held.p, t->held.len);
            held_drop(t, t->held.len);
            return;
        }
        size_t ws = 0;
        while (ws < t->held.len && (is_space(t->held.p[ws]) || (t->mode == L3_CALLS && t->held.p[ws] == ';')))
            ws++;
        const char *rest = t->held.p + ws;
        size_t n = t->held.len - ws;
        if (n == 0) return; // only whitespace / separators so far
        if (t->mode == L3_START) {
            if (rest[0] == '{') {
                t->mode = L3_CALLS;
            } else if (n < PYTHON_TAG_LEN && !memcmp(rest, PYTHON_TAG, n)) {
                return; // maybe the tag, still arriving
            } else if (n >= PYTHON_TAG_LEN && !memcmp(rest, PYTHON_TAG, PYTHON_TAG_LEN)) {
                held_drop(t, ws + PYTHON_TAG_LEN);
                t->mode = L3_CALLS;
            } else {
                t->mode = L3_CONTENT;
            }
            continue;
        }
        if (rest[0] != '{') { // text after the calls: content from here on
            held_drop(t, ws);
            t->mode = L3_CONTENT;
            continue;
        }
        json_error_t err;
        json_t *v = json_loadb(rest, n, JSON_DISABLE_EOF_CHECK, &err);
        if (!v && json_error_code(&err) == json_error_premature_end_of_input) return;
        size_t used = v ? (size_t)err.position : 0;
        json_t *call = v ? call_from_json(v) : NULL;
        if (!call) { // not a call: the rest is content
            held_drop(t, ws);
            t->mode = L3_CONTENT;
            continue;
        }
        json_array_append_new(calls, call);
        t->n_calls++;
        held_drop(t, ws + used);
    }
}

// ---------------------------------------------------------------- argument values by schema

// The JSON-schema "type" of parameter `key` of tool `name` in the request's tools, or NULL.
static const char *param_type(json_t *tools, const char *name, size_t name_len, const char *key, size_t key_len) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        json_t *n = json_object_get(fn, "name");
        if (!json_is_string(n) || json_string_length(n) != name_len || memcmp(json_string_value(n), name, name_len))
            continue;
        json_t *props = json_object_get(json_object_get(fn, "parameters"), "properties");
        char *k = strndup(key, key_len);
        CHECK(k != NULL);
        json_t *ty = json_object_get(json_object_get(props, k), "type");
        free(k);
        if (json_is_array(ty)) ty = json_array_get(ty, 0); // ["integer", "null"]: the first
        return json_string_value(ty);
    }
    return NULL;
}

// An XML-style argument's text as a JSON value: a string for string parameters; for other
// types (or unknown parameters, when json_unknown) the text parsed as JSON if it is JSON
// (numbers, booleans, objects, arrays), else the string.
static json_t *arg_value(const char *type, const char *v, size_t n, bool json_unknown) {
    if ((type && !strcmp(type, "string")) || (!type && !json_unknown)) return json_stringn(v, n);
    json_t *x = json_loadb(v, n, JSON_DECODE_ANY, NULL);
    if (x) return x;
    if (type && !strcmp(type, "boolean") && n == 4 && !memcmp(v, "True", 4)) return json_true();
    if (type && !strcmp(type, "boolean") && n == 5 && !memcmp(v, "False", 5)) return json_false();
    return json_stringn(v, n);
}

static char *args_dump(json_t *args) {
    char *s = json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY);
    CHECK(s != NULL);
    return s;
}

static void trim(const char **p, size_t *n) {
    while (*n && is_space(**p))
        (*p)++, (*n)--;
    while (*n && is_space((*p)[*n - 1]))
        (*n)--;
}

// ---------------------------------------------------------------- call bodies

// qwen3_coder: <function=NAME> <parameter=KEY>VALUE</parameter>... </function> (one leading and
// one trailing newline of a value are layout; a missing </parameter> ends at the next tag).
static json_t *body_qwen3_coder(struct tool_stream *t, const char *p, size_t n) {
    const char *end = p + n, *f = memmem(p, n, "<function=", 10);
    if (!f) return NULL;
    const char *name = f + 10, *gt = memchr(name, '>', (size_t)(end - name));
    if (!gt || gt == name) return NULL;
    size_t name_len = (size_t)(gt - name);
    json_t *args = json_object();
    const char *q = gt + 1;
    for (;;) {
        const char *pa = memmem(q, (size_t)(end - q), "<parameter=", 11);
        if (!pa) break;
        const char *key = pa + 11, *kg = memchr(key, '>', (size_t)(end - key));
        if (!kg) break;
        const char *v = kg + 1;
        const char *ve = memmem(v, (size_t)(end - v), "</parameter>", 12);
        const char *next = memmem(v, (size_t)(end - v), "<parameter=", 11);
        const char *fe = memmem(v, (size_t)(end - v), "</function>", 11);
        if (!ve || (next && next < ve)) ve = next ? next : fe ? fe : end;
        size_t vn = (size_t)(ve - v);
        if (vn && v[0] == '\n') v++, vn--;
        if (vn && v[vn - 1] == '\n') vn--;
        const char *type = param_type(t->tools, name, name_len, key, (size_t)(kg - key));
        char *k = strndup(key, (size_t)(kg - key));
        CHECK(k != NULL);
        json_object_set_new(args, k, arg_value(type, v, vn, false));
        free(k);
        q = ve;
        if (q < end && !memcmp(q, "</parameter>", q + 12 <= end ? 12 : 0)) q += 12;
    }
    char *a = args_dump(args);
    json_decref(args);
    json_t *call = call_make(name, name_len, a);
    free(a);
    return call;
}

// glm45: NAME <arg_key>KEY</arg_key> <arg_value>VALUE</arg_value>... (GLM-4.5 / 4.6 put newlines
// between them, GLM-4.7 none).
static json_t *body_glm45(struct tool_stream *t, const char *p, size_t n) {
    const char *end = p + n, *k0 = memmem(p, n, "<arg_key>", 9);
    const char *name = p;
    size_t name_len = (size_t)((k0 ? k0 : end) - p);
    trim(&name, &name_len);
    if (!name_len || memchr(name, '<', name_len) || memchr(name, '{', name_len)) return NULL;
    json_t *args = json_object();
    const char *q = k0;
    while (q) {
        const char *key = q + 9, *ke = memmem(key, (size_t)(end - key), "</arg_key>", 10);
        if (!ke) break;
        const char *v0 = memmem(ke, (size_t)(end - ke), "<arg_value>", 11);
        if (!v0) break;
        const char *v = v0 + 11, *ve = memmem(v, (size_t)(end - v), "</arg_value>", 12);
        if (!ve) break;
        size_t kn = (size_t)(ke - key);
        trim(&key, &kn);
        const char *type = param_type(t->tools, name, name_len, key, kn);
        char *k = strndup(key, kn);
        CHECK(k != NULL);
        json_object_set_new(args, k, arg_value(type, v, (size_t)(ve - v), true));
        free(k);
        q = memmem(ve, (size_t)(end - ve), "<arg_key>", 9);
    }
    char *a = args_dump(args);
    json_decref(args);
    json_t *call = call_make(name, name_len, a);
    free(a);
    return call;
}

// JSON object text -> compact arguments, or NULL if it is not an object.
static char *object_args(const char *p, size_t n) {
    json_t *o = json_loadb(p, n, JSON_DECODE_ANY, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        return NULL;
    }
    char *a = args_dump(o);
    json_decref(o);
    return a;
}

static const char DS_SEP[] = "<｜tool▁sep｜>";

// deepseek_v3: function<｜tool▁sep｜>NAME\n```json\nARGS\n``` (V3 / R1), or NAME<｜tool▁sep｜>ARGS (V3.1).
static json_t *body_deepseek_v3(struct tool_stream *t, const char *p, size_t n) {
    const char *end = p + n, *sep = memmem(p, n, DS_SEP, sizeof DS_SEP - 1);
    if (!sep) return NULL;
    const char *left = p, *right = sep + sizeof DS_SEP - 1;
    size_t ln = (size_t)(sep - p), rn = (size_t)(end - right);
    trim(&left, &ln);
    const char *name, *args;
    size_t name_len, an;
    if (ln == 8 && !memcmp(left, "function", 8)) {
        const char *nl = memchr(right, '\n', rn);
        if (!nl) return NULL;
        name = right;
        name_len = (size_t)(nl - right);
        args = nl + 1;
        an = (size_t)(end - args);
        trim(&args, &an);
        if (an >= 7 && !memcmp(args, "```json", 7))
            args += 7, an -= 7;
        else if (an >= 3 && !memcmp(args, "```", 3))
            args += 3, an -= 3;
        if (an >= 3 && !memcmp(args + an - 3, "```", 3)) an -= 3;
    } else {
        name = left;
        name_len = ln;
        args = right;
        an = rn;
    }
    trim(&name, &name_len);
    if (!name_len) return NULL;
    char *a = object_args(args, an);
    if (!a) return NULL;
    json_t *call = call_make(name, name_len, a);
    free(a);
    return call;
}

static const char KIMI_ARGS[] = "<|tool_call_argument_begin|>";

// kimi_k2: functions.NAME:INDEX<|tool_call_argument_begin|>ARGS; the id is "functions.NAME:INDEX"
// (Kimi's own call ids, kept as the OpenAI id as vLLM does).
static json_t *body_kimi_k2(struct tool_stream *t, const char *p, size_t n) {
    const char *end = p + n, *sep = memmem(p, n, KIMI_ARGS, sizeof KIMI_ARGS - 1);
    if (!sep) return NULL;
    const char *id = p;
    size_t id_len = (size_t)(sep - p);
    trim(&id, &id_len);
    const char *colon = NULL;
    for (size_t i = id_len; i > 0; i--)
        if (id[i - 1] == ':') {
            colon = id + i - 1;
            break;
        }
    const char *name = id;
    const char *name_end = colon ? colon : id + id_len;
    const char *dot = memchr(id, '.', (size_t)(name_end - id));
    if (dot) name = dot + 1;
    if (name_end <= name) return NULL;
    const char *args = sep + sizeof KIMI_ARGS - 1;
    char *a = object_args(args, (size_t)(end - args));
    if (!a) return NULL;
    json_t *call = call_make(name, (size_t)(name_end - name), a);
    free(a);
    json_object_set_new(call, "id", json_stringn(id, id_len));
    return call;
}

static json_t *body_hermes(struct tool_stream *t, const char *p, size_t n) {
    return call_from_json(json_loadb(p, n, JSON_DECODE_ANY, NULL));
}

// ---------------------------------------------------------------- tagged blocks

// Formats whose calls are blocks OPEN body CLOSE, optionally grouped in a SECTION_OPEN ...
// SECTION_CLOSE (whitespace between the calls of a section is layout, not content).
struct block_format {
    const char *open, *close, *section_open, *section_close;
    json_t *(*body)(struct tool_stream *t, const char *p, size_t n);
};

static const struct block_format *block_format_of(enum tool_parser_kind kind) {
    static const struct block_format hermes = {"<tool_call>", "</tool_call>", NULL, NULL, body_hermes};
    static const struct block_format qwen3_coder = {"<tool_call>", "</tool_call>", NULL, NULL, body_qwen3_coder};
    static const struct block_format glm45 = {"<tool_call>", "</tool_call>", NULL, NULL, body_glm45};
    static const struct block_format deepseek = {"<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                                                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", body_deepseek_v3};
    static const struct block_format kimi = {"<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_calls_section_begin|>",
                                             "<|tool_calls_section_end|>", body_kimi_k2};
    switch (kind) {
    case TOOL_PARSER_QWEN3_CODER:
        return &qwen3_coder;
    case TOOL_PARSER_GLM45:
        return &glm45;
    case TOOL_PARSER_DEEPSEEK_V3:
        return &deepseek;
    case TOOL_PARSER_KIMI_K2:
        return &kimi;
    default:
        return &hermes;
    }
}

// The earliest of tags a, b (either may be NULL) in the held text: which (0 / 1) and where; -1 if none.
static int find_first(const struct tool_text *h, const char *a, const char *b, size_t *at) {
    const char *pa = a ? memmem(h->p, h->len, a, strlen(a)) : NULL;
    const char *pb = b ? memmem(h->p, h->len, b, strlen(b)) : NULL;
    if (pa && (!pb || pa <= pb)) return *at = (size_t)(pa - h->p), 0;
    if (pb) return *at = (size_t)(pb - h->p), 1;
    return -1;
}

static size_t hold_for(const struct tool_text *h, const char *a, const char *b) {
    size_t ka = a ? tag_prefix_suffix(h->p, h->len, a, strlen(a)) : 0;
    size_t kb = b ? tag_prefix_suffix(h->p, h->len, b, strlen(b)) : 0;
    return ka > kb ? ka : kb;
}

static void blocks_feed(struct tool_stream *t, struct tool_text *content, json_t *calls) {
    const struct block_format *f = block_format_of(t->kind);
    for (;;) {
        struct tool_text *h = &t->held;
        size_t at = 0;
        if (h->len == 0) return; // (h->p may be NULL: nothing to search)
        if (t->in_call) {
            const char *close = memmem(h->p, h->len, f->close, strlen(f->close));
            if (!close) return; // the body is still arriving
            size_t body = (size_t)(close - h->p);
            json_t *call = f->body(t, h->p, body);
            if (call) {
                json_array_append_new(calls, call);
                t->n_calls++;
            } else { // not a call: the block's raw text is content
                tool_text_add(content, f->open, strlen(f->open));
                tool_text_add(content, h->p, body + strlen(f->close));
            }
            held_drop(t, body + strlen(f->close));
            t->in_call = false;
            continue;
        }
        if (t->in_section) {
            size_t ws = 0;
            while (ws < h->len && is_space(h->p[ws]))
                ws++;
            held_drop(t, ws);
            if (h->len == 0) return;
            int w = find_first(h, f->open, f->section_close, &at);
            if (w >= 0 && at == 0) {
                held_drop(t, strlen(w == 0 ? f->open : f->section_close));
                if (w == 0)
                    t->in_call = true;
                else
                    t->in_section = false;
                continue;
            }
            if (w < 0 && hold_for(h, f->open, f->section_close) == h->len) return; // a tag still arriving
            t->in_section = false;                                                 // other text: the section is over
            continue;
        }
        int w = find_first(h, f->section_open ? f->section_open : f->open, f->section_open ? f->open : NULL, &at);
        if (w >= 0) {
            tool_text_add(content, h->p, at);
            bool section = f->section_open && w == 0;
            held_drop(t, at + strlen(section ? f->section_open : f->open));
            if (section)
                t->in_section = true;
            else
                t->in_call = true;
            continue;
        }
        size_t keep = hold_for(h, f->section_open ? f->section_open : f->open, f->section_open ? f->open : NULL);
        tool_text_add(content, h->p, h->len - keep);
        held_drop(t, h->len - keep);
        return;
    }
}

// ---------------------------------------------------------------- mistral

static const char MISTRAL_TAG[] = "[TOOL_CALLS]";
#define MISTRAL_LEN (sizeof MISTRAL_TAG - 1)
static const char MISTRAL_ARGS[] = "[ARGS]";
static const char MISTRAL_CALL_ID[] = "[CALL_ID]";

// Calls after [TOOL_CALLS]: a JSON list (or one object) of {"name", "arguments"} (tokenizers up to
// v7), or NAME[ARGS]{...} / NAME[CALL_ID]ID[ARGS]{...} (v11+), one per [TOOL_CALLS]. Returns 1
// when a call (or list) was taken off the front, 0 when more text is needed, -1 when the text
// is not calls.
static int mistral_take(struct tool_stream *t, json_t *calls) {
    struct tool_text *h = &t->held;
    size_t ws = 0;
    while (ws < h->len && is_space(h->p[ws]))
        ws++;
    const char *p = h->p + ws;
    size_t n = h->len - ws;
    if (n == 0) return 0;
    if (p[0] == '[' || p[0] == '{') {
        json_error_t err;
        json_t *v = json_loadb(p, n, JSON_DISABLE_EOF_CHECK, &err);
        if (!v) return json_error_code(&err) == json_error_premature_end_of_input ? 0 : -1;
        size_t used = (size_t)err.position;
        json_t *list = json_is_array(v) ? v : NULL;
        json_t *got = json_array();
        if (list) {
            size_t i;
            json_t *x;
            json_array_foreach(list, i, x) {
                json_t *c = call_from_json(json_incref(x));
                if (!c) break;
                json_array_append_new(got, c);
            }
            if (json_array_size(got) != json_array_size(list) || !json_array_size(got)) {
                json_decref(got);
                json_decref(v);
                return -1;
            }
            json_decref(v);
        } else {
            json_t *c = call_from_json(v);
            if (!c) {
                json_decref(got);
                return -1;
            }
            json_array_append_new(got, c);
        }
        t->n_calls += (int)json_array_size(got);
        json_array_extend(calls, got);
        json_decref(got);
        held_drop(t, ws + used);
        return 1;
    }
    size_t name_end = 0;
    while (name_end < n &&
           (p[name_end] == '_' || p[name_end] == '-' || p[name_end] == '.' ||
            (p[name_end] >= '0' && p[name_end] <= '9') || ((p[name_end] | 32) >= 'a' && (p[name_end] | 32) <= 'z')))
        name_end++;
    const char *rest = p + name_end;
    size_t rn = n - name_end, al = sizeof MISTRAL_ARGS - 1, cl = sizeof MISTRAL_CALL_ID - 1;
    const char *args = NULL;
    if (rn >= al && !memcmp(rest, MISTRAL_ARGS, al)) {
        args = rest;
    } else if (rn >= cl && !memcmp(rest, MISTRAL_CALL_ID, cl)) {
        args = memmem(rest + cl, rn - cl, MISTRAL_ARGS, al);
        if (!args) return rn > 256 ? -1 : 0; // the call id, then [ARGS], still to come
    } else if ((rn < al && !memcmp(rest, MISTRAL_ARGS, rn)) || (rn < cl && !memcmp(rest, MISTRAL_CALL_ID, rn))) {
        return name_end > 256 ? -1 : 0; // a name, then [ARGS], still arriving
    } else {
        return -1;
    }
    if (name_end == 0) return -1;
    const char *a = args + sizeof MISTRAL_ARGS - 1;
    size_t an = (size_t)(p + n - a), aws = 0;
    while (aws < an && is_space(a[aws]))
        aws++;
    if (aws == an) return 0;
    json_error_t err;
    json_t *v = json_loadb(a + aws, an - aws, JSON_DISABLE_EOF_CHECK, &err);
    if (!v) return json_error_code(&err) == json_error_premature_end_of_input ? 0 : -1;
    if (!json_is_object(v)) {
        json_decref(v);
        return -1;
    }
    char *s = args_dump(v);
    json_decref(v);
    json_array_append_new(calls, call_make(p, name_end, s));
    free(s);
    t->n_calls++;
    held_drop(t, (size_t)(a + aws - h->p) + (size_t)err.position);
    return 1;
}

static void mistral_feed(struct tool_stream *t, struct tool_text *content, json_t *calls) {
    for (;;) {
        struct tool_text *h = &t->held;
        if (h->len == 0) return;
        if (t->mode == 2) { // calls failed to parse: the rest is content
            tool_text_add(content, h->p, h->len);
            held_drop(t, h->len);
            return;
        }
        if (!t->in_call) {
            const char *m = memmem(h->p, h->len, MISTRAL_TAG, MISTRAL_LEN);
            if (m) {
                tool_text_add(content, h->p, (size_t)(m - h->p));
                held_drop(t, (size_t)(m - h->p) + MISTRAL_LEN);
                t->in_call = true;
                continue;
            }
            size_t keep = tag_prefix_suffix(h->p, h->len, MISTRAL_TAG, MISTRAL_LEN);
            tool_text_add(content, h->p, h->len - keep);
            held_drop(t, h->len - keep);
            return;
        }
        int r = mistral_take(t, calls);
        if (r == 0) return;
        if (r < 0) {
            tool_text_add(content, MISTRAL_TAG, MISTRAL_LEN);
            t->mode = 2;
            continue;
        }
        t->in_call = false; // the next [TOOL_CALLS] (or content) follows
    }
}

// ---------------------------------------------------------------- pythonic

// A Python literal (the subset models write in calls) -> JSON. *pos advances; returns NULL with
// *incomplete set when the text ended first, or NULL on a syntax error.
struct py_in {
    const char *p;
    size_t n, i;
    bool incomplete;
};

static void py_ws(struct py_in *in) {
    while (in->i < in->n && is_space(in->p[in->i]))
        in->i++;
}

static bool py_more(struct py_in *in) {
    py_ws(in);
    if (in->i >= in->n) in->incomplete = true;
    return in->i < in->n;
}

static json_t *py_value(struct py_in *in, int depth);

static json_t *py_string(struct py_in *in) {
    char q = in->p[in->i++];
    struct tool_text s = {0};
    while (in->i < in->n && in->p[in->i] != q) {
        char c = in->p[in->i++];
        if (c == '\\') {
            if (in->i >= in->n) break;
            char e = in->p[in->i++];
            switch (e) {
            case 'n':
                c = '\n';
                break;
            case 't':
                c = '\t';
                break;
            case 'r':
                c = '\r';
                break;
            case '0':
                c = '\0';
                break;
            default:
                c = e;
                break; // \\ \' \" and anything else taken literally
            }
            if (!c) continue;
        }
        tool_text_add(&s, &c, 1);
    }
    if (in->i >= in->n) {
        in->incomplete = true;
        tool_text_free(&s);
        return NULL;
    }
    in->i++;
    json_t *v = json_stringn(s.p ? s.p : "", s.len);
    tool_text_free(&s);
    return v; // NULL for invalid UTF-8
}

// Items until `close`; dict: key ':' value pairs.
static json_t *py_seq(struct py_in *in, char close, bool dict, int depth) {
    in->i++;
    json_t *out = dict ? json_object() : json_array();
    for (;;) {
        if (!py_more(in)) break;
        if (in->p[in->i] == close) {
            in->i++;
            return out;
        }
        json_t *k = py_value(in, depth + 1);
        if (!k) break;
        if (dict) {
            if (!py_more(in) || in->p[in->i] != ':' || !json_is_string(k)) {
                json_decref(k);
                break;
            }
            in->i++;
            json_t *v = py_value(in, depth + 1);
            if (!v) {
                json_decref(k);
                break;
            }
            json_object_set_new(out, json_string_value(k), v);
            json_decref(k);
        } else {
            json_array_append_new(out, k);
        }
        if (!py_more(in)) break;
        if (in->p[in->i] == ',')
            in->i++;
        else if (in->p[in->i] != close)
            break;
    }
    json_decref(out);
    return NULL;
}

static json_t *py_value(struct py_in *in, int depth) {
    if (depth > 64 || !py_more(in)) return NULL;
    char c = in->p[in->i];
    if (c == '"' || c == '\'') return py_string(in);
    if (c == '[') return py_seq(in, ']', false, depth);
    if (c == '(') return py_seq(in, ')', false, depth);
    if (c == '{') return py_seq(in, '}', true, depth);
    size_t b = in->i;
    while (in->i < in->n && !strchr(",)]}: \t\r\n", in->p[in->i]))
        in->i++;
    if (in->i >= in->n) {
        in->incomplete = true;
        return NULL;
    }
    size_t len = in->i - b;
    const char *w = in->p + b;
    if (len == 4 && !memcmp(w, "True", 4)) return json_true();
    if (len == 5 && !memcmp(w, "False", 5)) return json_false();
    if (len == 4 && !memcmp(w, "None", 4)) return json_null();
    json_t *num = json_loadb(w, len, JSON_DECODE_ANY, NULL);
    if (json_is_number(num)) return num;
    json_decref(num);
    return NULL;
}

// [NAME(KEY=VALUE, ...), ...] -> calls; 1 parsed (*used set), 0 incomplete, -1 not calls.
static int py_calls(const char *p, size_t n, json_t *calls, size_t *used) {
    struct py_in in = {p, n, 0, false};
    if (!py_more(&in) || p[in.i] != '[') return in.incomplete ? 0 : -1;
    in.i++;
    json_t *got = json_array();
    int rc = -1;
    for (;;) {
        if (!py_more(&in)) break;
        if (p[in.i] == ']') {
            in.i++;
            rc = json_array_size(got) ? 1 : -1;
            break;
        }
        size_t nb = in.i;
        while (in.i < n && (p[in.i] == '_' || p[in.i] == '.' || (p[in.i] >= '0' && p[in.i] <= '9') ||
                            ((p[in.i] | 32) >= 'a' && (p[in.i] | 32) <= 'z')))
            in.i++;
        size_t name_len = in.i - nb;
        if (!py_more(&in)) break;
        if (!name_len || p[in.i] != '(') break;
        in.i++;
        json_t *args = json_object();
        bool ok = false;
        for (;;) {
            if (!py_more(&in)) break;
            if (p[in.i] == ')') {
                in.i++;
                ok = true;
                break;
            }
            size_t kb = in.i;
            while (in.i < n && (p[in.i] == '_' || (p[in.i] >= '0' && p[in.i] <= '9') ||
                                ((p[in.i] | 32) >= 'a' && (p[in.i] | 32) <= 'z')))
                in.i++;
            size_t kn = in.i - kb;
            if (!py_more(&in)) break;
            if (!kn || p[in.i] != '=') break;
            in.i++;
            json_t *v = py_value(&in, 0);
            if (!v) break;
            char *k = strndup(p + kb, kn);
            CHECK(k != NULL);
            json_object_set_new(args, k, v);
            free(k);
            if (!py_more(&in)) break;
            if (p[in.i] == ',')
                in.i++;
            else if (p[in.i] != ')')
                break;
        }
        if (!ok) {
            json_decref(args);
            break;
        }
        char *a = args_dump(args);
        json_decref(args);
        json_array_append_new(got, call_make(p + nb, name_len, a));
        free(a);
        if (!py_more(&in)) break;
        if (p[in.i] == ',')
            in.i++;
        else if (p[in.i] != ']')
            break;
    }
    if (rc < 0 && in.incomplete) rc = 0;
    if (rc == 1) {
        json_array_extend(calls, got);
        *used = in.i;
    }
    json_decref(got);
    return rc;
}

static const char PY_START[] = "<|python_start|>", PY_END[] = "<|python_end|>";

// pythonic (Llama 3.2 / 4, ToolACE...): the whole output is [f(a=1), g(b="x")] (Llama 4 may wrap
// it in <|python_start|> ... <|python_end|>); anything else is content.
static void pythonic_feed(struct tool_stream *t, struct tool_text *content, json_t *calls) {
    struct tool_text *h = &t->held;
    for (;;) {
        if (t->mode == L3_CONTENT) {
            tool_text_add(content, h->p, h->len);
            held_drop(t, h->len);
            return;
        }
        size_t ws = 0;
        while (ws < h->len && is_space(h->p[ws]))
            ws++;
        if (ws == h->len) return;
        const char *rest = h->p + ws;
        size_t n = h->len - ws;
        if (t->mode == L3_START) {
            size_t pl = sizeof PY_START - 1;
            if (n < pl && !memcmp(rest, PY_START, n)) return;
            if (n >= pl && !memcmp(rest, PY_START, pl)) {
                held_drop(t, ws + pl);
                t->mode = L3_CALLS;
                continue;
            }
            t->mode = rest[0] == '[' ? L3_CALLS : L3_CONTENT;
            continue;
        }
        if (t->n_calls > 0) { // after the call list: an end tag, then content
            size_t el = sizeof PY_END - 1;
            if (n < el && !memcmp(rest, PY_END, n)) return;
            if (n >= el && !memcmp(rest, PY_END, el)) held_drop(t, ws + el);
            t->mode = L3_CONTENT;
            continue;
        }
        size_t used = 0, before = json_array_size(calls);
        int r = py_calls(rest, n, calls, &used);
        if (r == 0) return;
        if (r < 0) {
            t->mode = L3_CONTENT;
            continue;
        }
        t->n_calls += (int)(json_array_size(calls) - before);
        held_drop(t, ws + used);
    }
}

// ---------------------------------------------------------------- dispatch

void tool_stream_feed(struct tool_stream *t, const char *text, size_t len, struct tool_text *content, json_t *calls) {
    CHECK(t->kind != TOOL_PARSER_OPENAI); // harmony.h parses those
    tool_text_add(&t->held, text, len);
    switch (t->kind) {
    case TOOL_PARSER_LLAMA3_JSON:
        llama3_feed(t, content, calls);
        return;
    case TOOL_PARSER_MISTRAL:
        mistral_feed(t, content, calls);
        return;
    case TOOL_PARSER_PYTHONIC:
        pythonic_feed(t, content, calls);
        return;
    default:
        blocks_feed(t, content, calls);
        return;
    }
}

void tool_stream_finish(struct tool_stream *t, struct tool_text *content) {
    if (t->kind == TOOL_PARSER_MISTRAL) {
        if (t->in_call && t->mode != 2) tool_text_add(content, MISTRAL_TAG, MISTRAL_LEN);
    } else if (t->in_call)
        tool_text_add(content, block_format_of(t->kind)->open, strlen(block_format_of(t->kind)->open));
    tool_text_add(content, t->held.p, t->held.len);
    held_drop(t, t->held.len);
    t->in_call = false;
    t->in_section = false;
}
