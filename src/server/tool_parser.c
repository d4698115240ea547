// Tool-call extraction, hermes and llama3_json formats (see tool_parser.h for the contract).
#include "server/tool_parser.h"

#include <string.h>

#include "common/check.h"

static const char OPEN_TAG[] = "<tool_call>";
static const char CLOSE_TAG[] = "</tool_call>";
#define OPEN_LEN (sizeof OPEN_TAG - 1)
#define CLOSE_LEN (sizeof CLOSE_TAG - 1)

static const char PYTHON_TAG[] = "<|python_tag|>";
#define PYTHON_TAG_LEN (sizeof PYTHON_TAG - 1)

enum tool_parser_kind tool_parser_from_name(const char *name) {
    if (name && !strcmp(name, "hermes")) return TOOL_PARSER_HERMES;
    if (name && !strcmp(name, "llama3_json")) return TOOL_PARSER_LLAMA3_JSON;
    if (name && !strcmp(name, "openai")) return TOOL_PARSER_OPENAI;
    return TOOL_PARSER_NONE;
}

const char *tool_parser_names(void) { return "hermes, llama3_json, openai"; }

bool tool_parser_needs_special_tokens(enum tool_parser_kind kind) { return kind == TOOL_PARSER_OPENAI; }

void tool_stream_set_tools(struct tool_stream *t, json_t *tools) { t->tools = tools; }

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

void tool_stream_feed(struct tool_stream *t, const char *text, size_t len, struct tool_text *content, json_t *calls) {
    tool_text_add(&t->held, text, len);
    if (t->kind == TOOL_PARSER_LLAMA3_JSON) {
        llama3_feed(t, content, calls);
        return;
    }
    for (;;) {
        if (!t->in_call) {
            const char *open = memmem(t->held.p, t->held.len, OPEN_TAG, OPEN_LEN);
            if (open) {
                size_t before = (size_t)(open - t->held.p);
                tool_text_add(content, t->held.p, before);
                held_drop(t, before + OPEN_LEN);
                t->in_call = true;
                continue;
            }
            size_t keep = tag_prefix_suffix(t->held.p, t->held.len, OPEN_TAG, OPEN_LEN);
            tool_text_add(content, t->held.p, t->held.len - keep);
            held_drop(t, t->held.len - keep);
            return;
        }
        const char *close = memmem(t->held.p, t->held.len, CLOSE_TAG, CLOSE_LEN);
        if (!close) return; // the body is still arriving
        size_t body = (size_t)(close - t->held.p);
        json_t *call = call_from_json(json_loadb(t->held.p, body, JSON_DECODE_ANY, NULL));
        if (call) {
            json_array_append_new(calls, call);
            t->n_calls++;
        } else { // not a call: the block's raw text is content
            tool_text_add(content, OPEN_TAG, OPEN_LEN);
            tool_text_add(content, t->held.p, body + CLOSE_LEN);
        }
        held_drop(t, body + CLOSE_LEN);
        t->in_call = false;
    }
}

void tool_stream_finish(struct tool_stream *t, struct tool_text *content) {
    if (t->kind == TOOL_PARSER_HERMES && t->in_call) tool_text_add(content, OPEN_TAG, OPEN_LEN);
    tool_text_add(content, t->held.p, t->held.len);
    held_drop(t, t->held.len);
    t->in_call = false;
}
