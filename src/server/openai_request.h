// Parsing and validation of OpenAI-style request bodies (/v1/completions, /v1/chat/completions,
// /tokenize, /detokenize) into plain structs. Pure functions of (body, limits): no engine, no
// network, so they are unit-tested directly (tests/test_server_request.c).
//
// Policy: every field is type- and range-checked; fields we do not implement are rejected with a
// 400 that names the field, except a short list of harmless OpenAI client fields (user, metadata,
// store=false, service_tier, parallel_tool_calls, logit_bias={}...) that change nothing and are
// accepted and ignored. JSON null means "absent" for every optional field.
#ifndef ATOMC_SERVER_OPENAI_REQUEST_H
#define ATOMC_SERVER_OPENAI_REQUEST_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"

enum oai_endpoint { OAI_ENDPOINT_COMPLETIONS = 0, OAI_ENDPOINT_CHAT };

// An HTTP-level error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
struct oai_error {
    int http_status;  // 400, 401, 404, 405, 413, 500, 503
    char type[40];    // "invalid_request_error", "authentication_error", "not_found_error", ...
    char code[40];    // "" (null) or a machine code such as "context_length_exceeded"
    char param[64];   // "" (null) or the offending field
    char message[512];
};

// Records an error; returns -1 so parsers can `return oai_error_set(...)`.
int oai_error_set(struct oai_error *e, int http_status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
// Renders {"error": {...}} as a compact JSON string (malloc'd).
char *oai_error_json(const struct oai_error *e);

struct oai_limits {
    int vocab_size;     // token ids must be in [0, vocab_size)
    int max_n;          // upper bound on n (default 64)
    int max_prompts;    // upper bound on prompt list length (default 256)
    int max_logprobs;   // upper bound on logprobs / top_logprobs (default 20)
    int max_stop;       // upper bound on the number of stop strings / stop token ids (default 64)
    int max_stop_len;   // bytes per stop string (default 1024)
};
void oai_limits_init(struct oai_limits *l, int vocab_size);

// One completions prompt: either text or token ids.
struct oai_prompt {
    char *text; // owned, NUL-terminated (may contain no NUL: JSON strings with \u0000 are rejected)
    size_t text_len;
    int32_t *ids; // owned
    int n_ids;
};

struct oai_request {
    enum oai_endpoint endpoint;
    char *model; // NULL = the default (first served) model
    // completions
    struct oai_prompt *prompts;
    int n_prompts;
    bool echo;
    // chat
    json_t *messages;             // owned ref: array of {role, content(string|null), ...}; content parts joined
    json_t *tools;                // owned ref or NULL
    bool tool_choice_none;        // "tool_choice": "none" (tools rendered, output never parsed for calls)
    bool tool_choice_required;    // "tool_choice": "required" or a named function: the output is a call
    char *tool_choice_name;       // owned: the named function ({"type": "function", "function": {"name"}})
    json_t *chat_template_kwargs; // owned ref (object) or NULL
    bool add_generation_prompt;   // default true
    bool continue_final_message;  // default false
    bool add_special_tokens;      // completions default true, chat default false
    // both
    bool stream;
    bool include_usage;           // stream_options.include_usage
    bool continuous_usage_stats;  // stream_options.continuous_usage_stats
    int n;
    int logprobs;                 // -1 = none; else number of alternatives (0..max_logprobs)
    bool max_tokens_set;          // max_tokens / max_completion_tokens given explicitly
    bool return_tokens_as_token_ids;
    atomc_sampling_params params; // stop / stop_token_ids point into the owned arrays below
    char **stop;
    int n_stop;
    int32_t *stop_token_ids;
    int n_stop_token_ids;
    // kv_transfer_params (vLLM's P/D proxies): do_remote_decode (prefill instance: ship the KV),
    // do_remote_prefill (decode instance: take it), remote_engine_id, and the transfer's key
    // remote_request_id (also accepted: transfer_id). Other keys (remote_block_ids, remote_host,
    // remote_port, tp_size) are type-checked and ignored: the connector already knows its peers.
    bool has_kv_params, kv_do_remote_decode, kv_do_remote_prefill;
    char *kv_transfer_id, *kv_remote_engine_id; // owned or NULL
    // Structured output: response_format json_object / json_schema / structural_tag, vLLM's
    // structured_outputs {json, regex, choice, grammar, json_object, structural_tag} or the older
    // guided_json / guided_regex / guided_choice / guided_grammar (at most one of them). The text
    // is what atomc_sampling_params.grammar takes for the kind (a schema as compact JSON, a
    // choice list as a JSON array); params.grammar points at it. grammar_param names the field
    // (for errors the engine reports later, e.g. a schema xgrammar cannot compile).
    atomc_grammar_kind grammar_kind;
    char *grammar;
    char grammar_param[64];
};

// Parses body into *r (zeroed first). Returns 0, or -1 with *e filled (400, param named).
int oai_request_parse(enum oai_endpoint ep, const char *body, size_t len, const struct oai_limits *lim,
                      struct oai_request *r, struct oai_error *e);
void oai_request_free(struct oai_request *r);

// tool_choice "required" / a named function: the structural tag (xgrammar's format, kind
// ATOMC_GRAMMAR_STRUCTURAL_TAG) of exactly one call of one of r->tools (or of the named one) in
// the tool-call format of `tool_parser` ("hermes": <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>;
// "llama3_json": {"name": N, "parameters": {...}}), arguments constrained by the tool's
// "parameters" schema. Returns a malloc'd string, or NULL with *e (400) naming the problem.
char *oai_tool_call_grammar(const struct oai_request *r, const char *tool_parser, struct oai_error *e);

// Parses a body into a JSON object (400 on malformed JSON, invalid UTF-8, non-object).
json_t *oai_body_parse(const char *body, size_t len, struct oai_error *e);

// /tokenize: {"model"?, "prompt": str, "add_special_tokens"?: bool} or
//            {"model"?, "messages": [...], "add_generation_prompt"?, "continue_final_message"?,
//             "add_special_tokens"?, "chat_template_kwargs"?, "tools"?, "return_token_strs"?: bool}
struct oai_tokenize_request {
    char *model;
    char *prompt; // owned or NULL (then messages is set)
    size_t prompt_len;
    json_t *messages, *tools, *chat_template_kwargs;
    bool add_generation_prompt, continue_final_message, add_special_tokens, return_token_strs;
};
int oai_tokenize_parse(const char *body, size_t len, struct oai_tokenize_request *r, struct oai_error *e);
void oai_tokenize_free(struct oai_tokenize_request *r);

// /detokenize: {"model"?, "tokens": [int...]}
struct oai_detokenize_request {
    char *model;
    int32_t *tokens;
    int n_tokens;
};
int oai_detokenize_parse(const char *body, size_t len, const struct oai_limits *lim,
                         struct oai_detokenize_request *r, struct oai_error *e);
void oai_detokenize_free(struct oai_detokenize_request *r);

// Validates and normalises chat messages in place (content part lists of {"type":"text"} are joined
// with "\n" into one string). Shared by chat completions, /tokenize and /apply-template.
int oai_messages_validate(json_t *messages, struct oai_error *e);

#endif
