// <think>...</think> reasoning extraction (see reasoning_parser.h for the contract).
#include "server/reasoning_parser.h"

#include <string.h>

#include "common/check.h"

static const char THINK_OPEN[] = "<think>";
static const char THINK_CLOSE[] = "</think>";
#define OPEN_LEN (sizeof THINK_OPEN - 1)
#define CLOSE_LEN (sizeof THINK_CLOSE - 1)

enum { R_START = 0, R_REASONING = 1, R_CONTENT = 2 };

enum reasoning_parser_kind reasoning_parser_from_name(const char *name) {
    if (!name) return REASONING_PARSER_NONE;
    if (!strcmp(name, "deepseek_r1")) return REASONING_PARSER_DEEPSEEK_R1;
    if (!strcmp(name, "qwen3")) return REASONING_PARSER_QWEN3;
    if (!strcmp(name, "glm45")) return REASONING_PARSER_GLM45;
    if (!strcmp(name, "openai_gptoss")) return REASONING_PARSER_OPENAI_GPTOSS;
    return REASONING_PARSER_NONE;
}

const char *reasoning_parser_names(void) {
    return "deepseek_r1, qwen3, glm45, openai_gptoss";
}

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

bool reasoning_prompt_opens(enum reasoning_parser_kind kind, const char *prompt, size_t len) {
    if (kind == REASONING_PARSER_DEEPSEEK_R1) return true;
    if (kind != REASONING_PARSER_QWEN3 && kind != REASONING_PARSER_GLM45) return false;
    while (len && is_space(prompt[len - 1]))
        len--;
    return len >= OPEN_LEN && !memcmp(prompt + len - OPEN_LEN, THINK_OPEN, OPEN_LEN);
}

bool reasoning_grammar_waits(enum reasoning_parser_kind kind, const char *prompt, size_t len) {
    if (kind != REASONING_PARSER_DEEPSEEK_R1 && kind != REASONING_PARSER_QWEN3 && kind != REASONING_PARSER_GLM45)
        return false;
    const size_t close_len = strlen(THINK_CLOSE);
    while (len && is_space(prompt[len - 1]))
        len--;
    return !(len >= close_len && !memcmp(prompt + len - close_len, THINK_CLOSE, close_len));
}

const char *reasoning_end_tag(enum reasoning_parser_kind kind) {
    return kind == REASONING_PARSER_OPENAI_GPTOSS ? "<|channel|>final" : THINK_CLOSE;
}

void reasoning_stream_init(struct reasoning_stream *r, enum reasoning_parser_kind kind, const char *prompt,
                           size_t prompt_len) {
    CHECK(kind != REASONING_PARSER_NONE && kind != REASONING_PARSER_OPENAI_GPTOSS);
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->opened = reasoning_prompt_opens(kind, prompt ? prompt : "", prompt ? prompt_len : 0);
}

void reasoning_stream_free(struct reasoning_stream *r) {
    tool_text_free(&r->held);
    r->held.len = 0;
}

static void held_drop(struct reasoning_stream *r, size_t n) {
    struct tool_text *h = &r->held;
    memmove(h->p, h->p + n, h->len - n);
    h->len -= n;
    if (h->p) h->p[h->len] = '\0';
}

static void mark_ended(struct reasoning_stream *r) {
    if (r->ended) return;
    r->ended = true;
    if (r->on_end) r->on_end(r->user);
}

// Length of the longest suffix of p[0, n) that is a proper prefix of tag.
static size_t tag_prefix_suffix(const char *p, size_t n, const char *tag, size_t tag_len) {
    size_t best = 0;
    for (size_t k = 1; k < tag_len && k <= n; k++)
        if (!memcmp(p + n - k, tag, k)) best = k;
    return best;
}

void reasoning_stream_feed(struct reasoning_stream *r, const char *text, size_t len, struct tool_text *reasoning,
                           struct tool_text *content) {
    tool_text_add(&r->held, text, len);
    for (;;) {
        struct tool_text *h = &r->held;
        if (h->len == 0) return;
        if (r->state == R_START) {
            // Leading whitespace, then either <think> (dropped), a prefix of it (wait), or anything else.
            size_t ws = 0;
            while (ws < h->len && is_space(h->p[ws]))
                ws++;
            size_t n = h->len - ws;
            if (n == 0) return;
            if (n >= OPEN_LEN && !memcmp(h->p + ws, THINK_OPEN, OPEN_LEN)) {
                held_drop(r, ws + OPEN_LEN);
                r->state = R_REASONING;
                continue;
            }
            if (n < OPEN_LEN && !memcmp(h->p + ws, THINK_OPEN, n)) return;
            r->state = r->opened ? R_REASONING : R_CONTENT;
            if (r->state == R_CONTENT) mark_ended(r);
            continue;
        }
        if (r->state == R_CONTENT) {
            tool_text_add(content, h->p, h->len);
            held_drop(r, h->len);
            return;
        }
        const char *close = memmem(h->p, h->len, THINK_CLOSE, CLOSE_LEN);
        if (close) {
            size_t before = (size_t)(close - h->p);
            tool_text_add(reasoning, h->p, before);
            held_drop(r, before + CLOSE_LEN);
            r->state = R_CONTENT;
            mark_ended(r);
            continue;
        }
        size_t keep = tag_prefix_suffix(h->p, h->len, THINK_CLOSE, CLOSE_LEN);
        tool_text_add(reasoning, h->p, h->len - keep);
        held_drop(r, h->len - keep);
        return;
    }
}

void reasoning_stream_finish(struct reasoning_stream *r, struct tool_text *reasoning, struct tool_text *content) {
    struct tool_text *h = &r->held;
    if (r->state == R_START) {
        // Only whitespace, or a cut-off "<thi": decided by where the output would have started.
        r->state = r->opened ? R_REASONING : R_CONTENT;
    }
    tool_text_add(r->state == R_REASONING ? reasoning : content, h->p, h->len);
    held_drop(r, h->len);
}
