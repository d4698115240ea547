// Tool calls in generated text, as vLLM's `--tool-call-parser` reads them:
//   hermes       Hermes, Qwen2.5, Qwen3: <tool_call>{"name": N, "arguments": {...}}</tool_call>
//                blocks anywhere in the output (several in a row for parallel calls);
//   llama3_json  Llama 3.1-3.3 JSON tool calling: an output that starts (after whitespace, and an
//                optional <|python_tag|>, which default detokenization drops as a special token
//                anyway) with {"name": N, "parameters": {...}} objects, separated by ';' for
//                parallel calls; an output starting otherwise is plain content.
//   mistral      Mistral / Mixtral / Magistral: content, then [TOOL_CALLS] followed by a JSON list
//                of {"name", "arguments"} (tokenizer v3-v7) or NAME[ARGS]{...} per [TOOL_CALLS]
//                (v11+, with an optional [CALL_ID]ID before [ARGS]).
//   pythonic     Llama 3.2 / 4, ToolACE: the output is a Python list of calls
//                [get_weather(city="Paris"), f(x=1, flag=True)] (optionally in <|python_start|>
//                ... <|python_end|>); Python literals become JSON; any other output is content.
//   deepseek_v3  DeepSeek-V3 / R1 (and V3.1): <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
//                <｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//                (V3.1: NAME<｜tool▁sep｜>ARGS).
//   kimi_k2      Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
//                <|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>;
//                "functions.NAME:IDX" is kept as the call's id.
//   qwen3_coder  Qwen3-Coder (XML style): <tool_call><function=NAME><parameter=KEY>VALUE
//                </parameter>...</function></tool_call>; values are text, converted by the
//                parameter's JSON-schema type in the request's tools (string stays text; number,
//                boolean, object, array are parsed; unknown parameters are strings).
//   glm45        GLM-4.5 / 4.6 / 4.7: <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE
//                </arg_value>...</tool_call> (newlines between parts optional); values as for
//                qwen3_coder, except that unknown parameters are parsed as JSON when they are JSON.
//   openai       GPT-OSS harmony: not parsed here (harmony.h; chat_output.h routes it).
// A block whose body is not a call in its format becomes content, tags included.
// The parser is incremental so that streaming and non-streaming responses share one code path:
// text deltas go in, in order; content that can no longer be the start of a tag comes out at
// once, a possible tag prefix ("<tool_c") is held back until the next delta decides it, and a
// call comes out when its closing tag has arrived.
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

enum tool_parser_kind {
    TOOL_PARSER_NONE = 0,
    TOOL_PARSER_HERMES,
    TOOL_PARSER_LLAMA3_JSON,
    TOOL_PARSER_OPENAI, // GPT-OSS harmony: parsed by harmony.h (chat_output.h routes it), not here
    TOOL_PARSER_MISTRAL,
    TOOL_PARSER_PYTHONIC,
    TOOL_PARSER_DEEPSEEK_V3,
    TOOL_PARSER_KIMI_K2,
    TOOL_PARSER_QWEN3_CODER,
    TOOL_PARSER_GLM45,
};

// "hermes", "llama3_json", ... -> the kind; anything else -> TOOL_PARSER_NONE (caller reports the error).
enum tool_parser_kind tool_parser_from_name(const char *name);
// The comma-separated supported names (for error messages and --help).
const char *tool_parser_names(void);
// Whether the format's markers are special tokens (the server then keeps special tokens in the text).
bool tool_parser_needs_special_tokens(enum tool_parser_kind kind);

// Growable NUL-terminated text (content released by the parser, and its held-back text).
struct tool_text {
    char *p;
    size_t len, cap;
};

struct tool_stream {
    enum tool_parser_kind kind;
    int mode;              // llama3_json / pythonic: 0 = start not seen yet, 1 = calls, 2 = plain content;
                           // mistral: 2 = calls that did not parse (the rest is content)
    bool in_call;          // inside a call block (waiting for its closing tag) / after [TOOL_CALLS]
    bool in_section;       // deepseek_v3 / kimi_k2: inside the calls section
    struct tool_text held; // held-back text: a possible opening-tag prefix, or the call body so far
    int n_calls;           // calls emitted so far
    json_t *tools;         // borrowed: the request's tools (parameter types for XML-style formats) or NULL
};

void tool_stream_init(struct tool_stream *t, enum tool_parser_kind kind);
void tool_stream_free(struct tool_stream *t);
// The request's tools (borrowed, must outlive the stream); formats whose arguments are untyped text
// convert each value by its parameter's JSON-schema type.
void tool_stream_set_tools(struct tool_stream *t, json_t *tools);
// Feeds `len` bytes of generated text; appends released content to *content and each completed
// call to `calls` (a JSON array).
void tool_stream_feed(struct tool_stream *t, const char *text, size_t len, struct tool_text *content, json_t *calls);
// End of generation: whatever is held back is released as content.
void tool_stream_finish(struct tool_stream *t, struct tool_text *content);

void tool_text_add(struct tool_text *s, const char *p, size_t n);
void tool_text_free(struct tool_text *s);

#endif
