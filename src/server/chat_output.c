// Reasoning parser -> tool-call parser pipeline, or harmony (see chat_output.h).
#include "server/chat_output.h"

#include <string.h>

void chat_output_init(struct chat_output *o, enum reasoning_parser_kind rk, enum tool_parser_kind tk, json_t *tools,
                      const char *prompt, size_t prompt_len) {
    memset(o, 0, sizeof *o);
    o->tools_on = tk != TOOL_PARSER_NONE && tools && json_array_size(tools) > 0;
    o->harmony = rk == REASONING_PARSER_OPENAI_GPTOSS || (tk == TOOL_PARSER_OPENAI && o->tools_on);
    o->reasoning_on = rk != REASONING_PARSER_NONE;
    if (o->harmony) {
        harmony_stream_init(&o->hs);
        o->reasoning_on = rk == REASONING_PARSER_OPENAI_GPTOSS;
        o->tools_on = o->tools_on && tk == TOOL_PARSER_OPENAI;
        return;
    }
    if (o->reasoning_on) reasoning_stream_init(&o->rs, rk, prompt, prompt_len);
    if (tk == TOOL_PARSER_OPENAI) o->tools_on = false; // harmony calls without harmony output: nothing to find
    tool_stream_init(&o->ts, o->tools_on ? tk : TOOL_PARSER_HERMES);
    tool_stream_set_tools(&o->ts, tools);
}

void chat_output_free(struct chat_output *o) {
    if (o->harmony)
        harmony_stream_free(&o->hs);
    else {
        if (o->reasoning_on) reasoning_stream_free(&o->rs);
        tool_stream_free(&o->ts);
    }
    memset(o, 0, sizeof *o);
}

bool chat_output_active(const struct chat_output *o) {
    return o->harmony || o->reasoning_on || o->tools_on;
}

bool chat_output_needs_special_tokens(const struct chat_output *o) {
    // GLM's <think> is a special token as well.
    return o->harmony || (o->tools_on && tool_parser_needs_special_tokens(o->ts.kind)) ||
           (o->reasoning_on && o->rs.kind == REASONING_PARSER_GLM45);
}

bool chat_output_reasoning_ended(const struct chat_output *o) {
    if (o->harmony) return !o->reasoning_on || o->hs.final_seen || o->hs.n_calls > 0;
    return !o->reasoning_on || o->rs.ended;
}

// Content released by the reasoning parser goes on through the tool parser.
static void content_on(struct chat_output *o, struct tool_text *mid, struct tool_text *content, json_t *calls,
                       bool finish) {
    if (!o->tools_on) {
        tool_text_add(content, mid->p, mid->len);
        return;
    }
    json_t *got = json_array();
    tool_stream_feed(&o->ts, mid->p ? mid->p : "", mid->len, content, got);
    if (finish) tool_stream_finish(&o->ts, content);
    o->n_calls += (int)json_array_size(got);
    json_array_extend(calls, got);
    json_decref(got);
}

static void harmony_out(struct chat_output *o, struct tool_text *reasoning, struct tool_text *tmp_r, json_t *calls,
                        json_t *got) {
    if (o->reasoning_on) tool_text_add(reasoning, tmp_r->p, tmp_r->len);
    if (o->tools_on) {
        o->n_calls += (int)json_array_size(got);
        json_array_extend(calls, got);
    }
    json_decref(got);
    tool_text_free(tmp_r);
}

void chat_output_feed(struct chat_output *o, const char *text, size_t len, struct tool_text *reasoning,
                      struct tool_text *content, json_t *calls) {
    if (o->harmony) {
        struct tool_text r = {0};
        json_t *got = json_array();
        harmony_stream_feed(&o->hs, text, len, &r, content, got);
        harmony_out(o, reasoning, &r, calls, got);
        return;
    }
    if (!o->reasoning_on) {
        struct tool_text mid = {(char *)text, len, 0};
        content_on(o, &mid, content, calls, false);
        return;
    }
    struct tool_text mid = {0};
    reasoning_stream_feed(&o->rs, text, len, reasoning, &mid);
    content_on(o, &mid, content, calls, false);
    tool_text_free(&mid);
}

void chat_output_finish(struct chat_output *o, struct tool_text *reasoning, struct tool_text *content, json_t *calls) {
    if (o->harmony) {
        struct tool_text r = {0};
        json_t *got = json_array();
        harmony_stream_finish(&o->hs, &r, content, got);
        harmony_out(o, reasoning, &r, calls, got);
        return;
    }
    struct tool_text mid = {0};
    if (o->reasoning_on) reasoning_stream_finish(&o->rs, reasoning, &mid);
    content_on(o, &mid, content, calls, true);
    tool_text_free(&mid);
}
