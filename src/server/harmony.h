// GPT-OSS "harmony" output (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`).
// The generation prompt ends with "<|start|>assistant", so the output is a sequence of messages
//     HEADER <|message|> BODY END
// where the first HEADER continues the prompt's assistant header and later ones start with
// <|start|>assistant; HEADER holds <|channel|>CHANNEL, optionally " to=RECIPIENT" (in the role
// part or after the channel) and a content type ("<|constrain|>json" or " json"); END is <|end|>,
// <|call|>, <|return|> or the end of the generation (the engine stops at <|call|> / <|return|>,
// which may then be missing from the text). Special tokens must be in the text: the server
// detokenizes with skip_special_tokens false when this parser is on.
//
// Channels, as vLLM maps them to the OpenAI API:
//   analysis                               -> reasoning (streamed as it arrives)
//   final                                  -> content (streamed)
//   commentary (no recipient: a preamble)  -> content (streamed)
//   any channel to=functions.NAME          -> a tool call {"name": NAME, "arguments": BODY}, emitted
//                                             when the message ends
//   other recipients (built-in browser / python tools) -> dropped
// Text that never reaches <|message|> (a model not speaking harmony) is released as content at
// the end. Any split of the output gives the same reasoning, content and calls.
#ifndef ATOMC_SERVER_HARMONY_H
#define ATOMC_SERVER_HARMONY_H

#include <jansson.h>
#include <stdbool.h>

#include "server/tool_parser.h"

struct harmony_stream {
    int state;             // 0 = header, 1 = body, 2 = between messages
    int body_kind;         // where the current body goes: 0 reasoning, 1 content, 2 call, 3 dropped
    char *recipient;       // function name of the current call body
    struct tool_text held; // header text, a possible tag prefix, or the call body so far
    int n_calls;
    bool final_seen; // a final-channel message has started (reasoning over)
};

void harmony_stream_init(struct harmony_stream *h);
void harmony_stream_free(struct harmony_stream *h);
// Appends released reasoning / content, and completed calls (OpenAI shape, without "id") to calls.
void harmony_stream_feed(struct harmony_stream *h, const char *text, size_t len, struct tool_text *reasoning,
                         struct tool_text *content, json_t *calls);
void harmony_stream_finish(struct harmony_stream *h, struct tool_text *reasoning, struct tool_text *content,
                           json_t *calls);

#endif
