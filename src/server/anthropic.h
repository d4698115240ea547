// Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.
//
// A request is validated and translated to the equivalent OpenAI chat request (system prompt ->
// a system message; text blocks -> content; tool_use blocks -> assistant tool_calls;
// tool_result blocks -> tool messages; tools[].input_schema -> function parameters;
// stop_sequences -> stop; tool_choice auto/any/tool/none -> auto/required/named/none;
// thinking enabled/disabled -> chat_template_kwargs.enable_thinking), which then runs through the
// same path as /v1/chat/completions (template, engine, output parsers). Only the rendering of
// the result differs: a "message" object with content blocks (thinking from the reasoning
// parser, text, tool_use from the tool-call parser), or the Anthropic event stream
// (message_start, content_block_start / _delta / _stop, message_delta with stop_reason and
// usage, message_stop). Errors have Anthropic's shape {"type":"error","error":{"type","message"}}.
#ifndef ATOMC_SERVER_ANTHROPIC_H
#define ATOMC_SERVER_ANTHROPIC_H

#include <jansson.h>
#include <stdbool.h>

#include "server/openai_request.h"

struct server;
struct srv_req;
struct srv_choice;
struct srv_event;
struct http_req;

// Pure translation (unit-testable): the Anthropic body -> a new OpenAI chat request object, or
// NULL with *e (400 naming the field). count_only: /count_tokens (max_tokens not required).
json_t *anthropic_to_openai(const char *body, size_t len, bool count_only, struct oai_error *e);
// {"type":"error","error":{"type": ..., "message": ...}} (malloc'd).
char *anthropic_error_json(const struct oai_error *e);

// Loop thread: the two endpoints.
void anthropic_handle_messages(struct server *s, struct http_req *req);
void anthropic_handle_count_tokens(struct server *s, struct http_req *req);

// generate.c's hooks for requests made here (srv_req.anthropic).
void anthropic_stream_start(struct srv_req *r, struct srv_choice *c);
void anthropic_stream_event(struct srv_req *r, struct srv_choice *c, const struct srv_event *ev);
void anthropic_stream_end(struct srv_req *r);
json_t *anthropic_final_body(struct srv_req *r, int *code);

#endif
