// The chat output pipeline of one choice: generated text in, (reasoning, content, tool calls) out,
// the same code for streaming deltas and for a whole non-streamed text.
//   harmony (--reasoning-parser openai_gptoss, or --tool-call-parser openai on a request with
//            tools): harmony.h splits channels; analysis is reasoning only under openai_gptoss
//            (otherwise dropped: OpenAI says analysis is not for end users); calls only when the
//            request has tools (otherwise dropped).
//   otherwise: the reasoning parser (if any) splits <think> reasoning off; what it releases as
//            content goes through the tool-call parser when the request has tools.
#ifndef ATOMC_SERVER_CHAT_OUTPUT_H
#define ATOMC_SERVER_CHAT_OUTPUT_H

#include <jansson.h>
#include <stdbool.h>

#include "server/harmony.h"
#include "server/reasoning_parser.h"
#include "server/tool_parser.h"

struct chat_output {
    bool harmony, reasoning_on, tools_on;
    struct reasoning_stream rs;
    struct harmony_stream hs;
    struct tool_stream ts;
    int n_calls; // calls emitted so far
};

// tools: the request's tools (borrowed; NULL when none or tool_choice "none"): calls are parsed
// only with tools. prompt: the rendered prompt (a template may have opened <think> already).
void chat_output_init(struct chat_output *o, enum reasoning_parser_kind rk, enum tool_parser_kind tk, json_t *tools,
                      const char *prompt, size_t prompt_len);
void chat_output_free(struct chat_output *o);
// Whether any parsing happens (otherwise the text is plain content and needs no pipeline).
bool chat_output_active(const struct chat_output *o);
// Whether special tokens must stay in the detokenized text for the parsers to see their markers.
bool chat_output_needs_special_tokens(const struct chat_output *o);
// Whether the reasoning is over (the structured-output hook; true when there is no reasoning parser).
bool chat_output_reasoning_ended(const struct chat_output *o);
void chat_output_feed(struct chat_output *o, const char *text, size_t len, struct tool_text *reasoning,
                      struct tool_text *content, json_t *calls);
void chat_output_finish(struct chat_output *o, struct tool_text *reasoning, struct tool_text *content, json_t *calls);

#endif
