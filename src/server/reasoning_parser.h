// Reasoning in generated chat text, as vLLM's `--reasoning-parser` reads it:
//   deepseek_r1   DeepSeek-R1, QwQ: the output is reasoning until </think>, then content. A leading
//                 <think> is dropped (R1-0528 writes it; older R1 templates already opened it in the
//                 prompt). An output without </think> is all reasoning (vLLM's behaviour).
//   qwen3, glm45  Qwen3, GLM-4.5: reasoning is <think>...</think> at the start of the output; an
//                 output that does not start with <think> is all content (Qwen3 with
//                 chat_template_kwargs {"enable_thinking": false}: its template already wrote an
//                 empty <think></think> into the prompt). When the prompt itself ends inside an open
//                 <think> (Qwen3-Thinking-2507 templates), the output starts as reasoning.
//   openai_gptoss GPT-OSS harmony channels: handled by harmony.h (analysis = reasoning); this
//                 parser only names it (reasoning_parser_from_name) so the server can pick harmony.
// The parser is incremental: text deltas go in, in order; reasoning and content come out as soon
// as they cannot be part of a tag (a possible "</thi" prefix is held back until the next delta).
// Any split of the output gives the same reasoning and content as the whole text.
//
// Structured output hook: `ended` turns true (and on_end, if set, is called once) at the moment
// the reasoning is over: at </think>, or at the first content byte when the output has no
// reasoning. reasoning_prompt_opens() and reasoning_end_tag() let an engine-side consumer (a
// grammar that must only apply after the reasoning) find the same point in the token stream.
#ifndef ATOMC_SERVER_REASONING_PARSER_H
#define ATOMC_SERVER_REASONING_PARSER_H

#include <stdbool.h>
#include <stddef.h>

#include "server/tool_parser.h"

enum reasoning_parser_kind {
    REASONING_PARSER_NONE = 0,
    REASONING_PARSER_DEEPSEEK_R1,
    REASONING_PARSER_QWEN3,
    REASONING_PARSER_GLM45,
    REASONING_PARSER_OPENAI_GPTOSS,
};

// "deepseek_r1", "qwen3", "glm45", "openai_gptoss" -> the kind; anything else -> NONE.
enum reasoning_parser_kind reasoning_parser_from_name(const char *name);
// The comma-separated supported names (for error messages and --help).
const char *reasoning_parser_names(void);

// Whether the output of this prompt starts inside the reasoning: always for deepseek_r1; for
// qwen3 / glm45 when the prompt ends (trailing whitespace aside) with an unclosed <think>.
bool reasoning_prompt_opens(enum reasoning_parser_kind kind, const char *prompt, size_t len);
// The text that ends the reasoning ("</think>"; harmony: "<|channel|>final").
const char *reasoning_end_tag(enum reasoning_parser_kind kind);
// Structured output with a reasoning parser applies after the reasoning, as vLLM does: whether a
// request with this rendered prompt must wait for the end tag before its grammar applies. The
// <think> kinds wait unless the prompt itself already closed the reasoning (it ends, whitespace
// aside, with "</think>": Qwen3's enable_thinking false, a template that pre-fills an empty
// block); NONE and harmony never wait (harmony's end is several tokens: its grammar applies from
// the start, docs/ARCHITECTURE.md).
bool reasoning_grammar_waits(enum reasoning_parser_kind kind, const char *prompt, size_t len);

struct reasoning_stream {
    enum reasoning_parser_kind kind;
    int state;             // 0 = start (is there a leading <think>?), 1 = reasoning, 2 = content
    bool opened;           // the output starts inside the reasoning (see reasoning_prompt_opens)
    bool ended;            // the reasoning is over (content from here on)
    struct tool_text held; // a possible tag prefix not released yet
    void (*on_end)(void *user);
    void *user;
};

// kind must be one of the <think> kinds (not NONE, not OPENAI_GPTOSS). prompt: the rendered prompt.
void reasoning_stream_init(struct reasoning_stream *r, enum reasoning_parser_kind kind, const char *prompt,
                           size_t prompt_len);
void reasoning_stream_free(struct reasoning_stream *r);
// Feeds `len` bytes; appends released reasoning to *reasoning and released content to *content.
void reasoning_stream_feed(struct reasoning_stream *r, const char *text, size_t len, struct tool_text *reasoning,
                           struct tool_text *content);
// End of generation: what is held back is released where it belongs.
void reasoning_stream_finish(struct reasoning_stream *r, struct tool_text *reasoning, struct tool_text *content);

#endif
