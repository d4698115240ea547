// GPT-OSS harmony output parsing (see harmony.h for the contract).
#include "server/harmony.h"

#include <string.h>

#include "common/check.h"

enum { H_HEADER = 0, H_BODY = 1, H_BETWEEN = 2 };
enum { B_REASONING = 0, B_CONTENT = 1, B_CALL = 2, B_DROP = 3 };

static const char T_START[] = "<|start|>", T_CHANNEL[] = "<|channel|>", T_MESSAGE[] = "<|message|>";
static const char *const BODY_ENDS[] = {"<|end|>", "<|call|>", "<|return|>", "<|start|>"};
#define N_BODY_ENDS 4

void harmony_stream_init(struct harmony_stream *h) {
    memset(h, 0, sizeof *h);
}

void harmony_stream_free(struct harmony_stream *h) {
    tool_text_free(&h->held);
    free(h->recipient);
    memset(h, 0, sizeof *h);
}

static void held_drop(struct harmony_stream *h, size_t n) {
    struct tool_text *t = &h->held;
    memmove(t->p, t->p + n, t->len - n);
    t->len -= n;
    if (t->p) t->p[t->len] = '\0';
}

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

// A word of the header: bytes from p up to whitespace, '<' or the end.
static size_t word_len(const char *p, const char *end) {
    size_t n = 0;
    while (p + n < end && !is_space(p[n]) && p[n] != '<')
        n++;
    return n;
}

// Decides where the body after header [p, p + n) goes.
static void header_classify(struct harmony_stream *h, const char *p, size_t n) {
    const char *end = p + n;
    free(h->recipient);
    h->recipient = NULL;
    char channel[32] = "";
    const char *c = memmem(p, n, T_CHANNEL, sizeof T_CHANNEL - 1);
    if (c) {
        c += sizeof T_CHANNEL - 1;
        size_t w = word_len(c, end);
        snprintf(channel, sizeof channel, "%.*s", (int)(w < sizeof channel ? w : sizeof channel - 1), c);
    }
    const char *to = memmem(p, n, "to=", 3);
    if (to) {
        to += 3;
        size_t w = word_len(to, end);
        static const char FN[] = "functions.";
        if (w > sizeof FN - 1 && !memcmp(to, FN, sizeof FN - 1)) {
            h->recipient = strndup(to + sizeof FN - 1, w - (sizeof FN - 1));
            CHECK(h->recipient != NULL);
            h->body_kind = B_CALL;
        } else {
            h->body_kind = B_DROP; // built-in tools (browser.*, python) are not served
        }
        return;
    }
    if (!strcmp(channel, "analysis")) {
        h->body_kind = B_REASONING;
    } else {
        if (!strcmp(channel, "final")) h->final_seen = true;
        h->body_kind = B_CONTENT;
    }
}

// The earliest body terminator in the held text: its offset and length, or false.
static bool find_body_end(const struct tool_text *t, size_t *at, size_t *len) {
    bool found = false;
    for (int i = 0; i < N_BODY_ENDS; i++) {
        size_t l = strlen(BODY_ENDS[i]);
        const char *q = memmem(t->p, t->len, BODY_ENDS[i], l);
        if (q && (!found || (size_t)(q - t->p) < *at)) {
            found = true;
            *at = (size_t)(q - t->p);
            *len = l;
        }
    }
    return found;
}

// Length of the longest suffix of the held text that is a proper prefix of a body terminator.
static size_t end_prefix_suffix(const struct tool_text *t) {
    size_t best = 0;
    for (int i = 0; i < N_BODY_ENDS; i++) {
        size_t l = strlen(BODY_ENDS[i]);
        for (size_t k = 1; k < l && k <= t->len; k++)
            if (k > best && !memcmp(t->p + t->len - k, BODY_ENDS[i], k)) best = k;
    }
    return best;
}

static void emit_call(struct harmony_stream *h, const char *body, size_t n, json_t *calls) {
    while (n && is_space(*body))
        body++, n--;
    while (n && is_space(body[n - 1]))
        n--;
    json_t *fn = json_object(), *call = json_object();
    json_object_set_new(fn, "name", json_string(h->recipient));
    json_object_set_new(fn, "arguments", n ? json_stringn(body, n) : json_string("{}"));
    json_object_set_new(call, "type", json_string("function"));
    json_object_set_new(call, "function", fn);
    json_array_append_new(calls, call);
    h->n_calls++;
}

static struct tool_text *body_sink(struct harmony_stream *h, struct tool_text *reasoning, struct tool_text *content) {
    return h->body_kind == B_REASONING ? reasoning : h->body_kind == B_CONTENT ? content : NULL;
}

void harmony_stream_feed(struct harmony_stream *h, const char *text, size_t len, struct tool_text *reasoning,
                         struct tool_text *content, json_t *calls) {
    tool_text_add(&h->held, text, len);
    for (;;) {
        struct tool_text *t = &h->held;
        if (t->len == 0) return;
        if (h->state == H_BETWEEN) {
            size_t ws = 0;
            while (ws < t->len && is_space(t->p[ws]))
                ws++;
            held_drop(h, ws);
            if (t->len == 0) return;
            h->state = H_HEADER;
            continue;
        }
        if (h->state == H_HEADER) {
            const char *m = memmem(t->p, t->len, T_MESSAGE, sizeof T_MESSAGE - 1);
            if (!m) return; // the header is still arriving
            size_t hl = (size_t)(m - t->p);
            header_classify(h, t->p, hl);
            held_drop(h, hl + sizeof T_MESSAGE - 1);
            h->state = H_BODY;
            continue;
        }
        size_t at = 0, el = 0;
        bool found = find_body_end(t, &at, &el);
        struct tool_text *sink = body_sink(h, reasoning, content);
        if (found) {
            if (h->body_kind == B_CALL)
                emit_call(h, t->p, at, calls);
            else if (sink)
                tool_text_add(sink, t->p, at);
            bool start = el == sizeof T_START - 1 && !memcmp(t->p + at, T_START, el);
            held_drop(h, start ? at : at + el); // a <|start|> begins the next header
            h->state = start ? H_HEADER : H_BETWEEN;
            continue;
        }
        if (h->body_kind == B_CALL) return; // the arguments are still arriving
        size_t keep = end_prefix_suffix(t);
        if (sink) tool_text_add(sink, t->p, t->len - keep);
        held_drop(h, t->len - keep);
        return;
    }
}

void harmony_stream_finish(struct harmony_stream *h, struct tool_text *reasoning, struct tool_text *content,
                           json_t *calls) {
    struct tool_text *t = &h->held;
    if (h->state == H_BODY) {
        // The engine stopped at <|call|> / <|return|> (or the length limit): the message ends here.
        if (h->body_kind == B_CALL)
            emit_call(h, t->p ? t->p : "", t->len, calls);
        else if (body_sink(h, reasoning, content))
            tool_text_add(body_sink(h, reasoning, content), t->p, t->len);
    } else if (h->state == H_HEADER && t->len && !memmem(t->p, t->len, "<|", 2)) {
        tool_text_add(content, t->p, t->len); // not harmony at all: plain text
    }
    held_drop(h, t->len);
    h->state = H_BETWEEN;
}
