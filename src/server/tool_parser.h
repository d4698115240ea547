// Tool calls in generated text, as vLLM's `--tool-call-parser hermes` reads them: Hermes, Qwen2.5
// and Qwen3 chat templates ask the model to answer a tool request with
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
// blocks (several in a row for parallel calls). The parser is incremental so that streaming and
// non-streaming responses share one code path: text deltas go in, in order; content that can no
// longer be the start of a tag comes out at once, a possible tag prefix ("<tool_c") is held back
// until the next delta decides it, and a call comes out when its closing tag has arrived.
//
// A call is {"type": "function", "function": {"name": NAME, "arguments": JSON_TEXT}} (the caller
// adds "id", and "index" when streaming). "arguments" may be given as an object (serialised
// compactly, UTF-8 kept) or as a string (passed through); a missing one is "{}". A block whose
// body is not such a JSON object is not a call: its raw text, tags included, becomes content,
// as does an unterminated block at the end of the generation.
#ifndef ATOMC_SERVER_TOOL_PARSER_H
#define ATOMC_SERVER_TOOL_PARSER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

enum tool_parser_kind { TOOL_PARSER_NONE = 0, TOOL_PARSER_HERMES };

// "hermes" -> TOOL_PARSER_HERMES; anything else -> TOOL_PARSER_NONE (caller reports the error).
enum tool_parser_kind tool_parser_from_name(const char *name);

struct tool_stream {
    bool in_call; // inside <tool_call> ... (waiting for the closing tag)
    char *held;   // held-back text: a possible opening-tag prefix, or the call body so far
    size_t held_len, held_cap;
    int n_calls; // calls emitted so far
};

// Growable output text (content released by the parser).
struct tool_text {
    char *p;
    size_t len, cap;
};

void tool_stream_init(struct tool_stream *t);
void tool_stream_free(struct tool_stream *t);
// Feeds `len` bytes of generated text; appends released content to *content and each completed
// call to `calls` (a JSON array).
void tool_stream_feed(struct tool_stream *t, const char *text, size_t len, struct tool_text *content, json_t *calls);
// End of generation: whatever is held back is released as content.
void tool_stream_finish(struct tool_stream *t, struct tool_text *content);

void tool_text_free(struct tool_text *s);

#endif
