#!/usr/bin/env python3
"""Generates src/server/openapi.c: the server's own OpenAPI 3.0 description (GET /openapi.json).

The schema mirrors the validation in src/server/openai_request.c (types, ranges, required fields),
so schemathesis can generate valid requests from it. Run after changing the API:
    python3 tools/gen_openapi.py > src/server/openapi.c
"""
import json

def ref(n): return {"$ref": f"#/components/schemas/{n}"}

FLT_MAX = 3.4028234663852886e38
FLT_TRUE_MIN = 1.401298464324817e-45
# Free-form JSON (chat_template_kwargs, tools, extra message keys): any value jansson can hold, so
# integers within int64 and numbers within double range.
json_value = {"nullable": True, "anyOf": [
    {"type": "string"}, {"type": "boolean"},
    {"type": "integer", "minimum": -9223372036854775808, "maximum": 9223372036854775807},
    {"type": "number"},
    {"type": "array", "items": ref("JsonValue")},
    {"type": "object", "additionalProperties": ref("JsonValue")}]}
free_object = {"type": "object", "additionalProperties": ref("JsonValue")}

ERR = {"description": "error", "content": {"application/json": {"schema": ref("ErrorResponse")}}}
def errs(*codes):
    return {str(c): ERR for c in codes}

token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 49151}, "minItems": 1, "maxItems": 64}
stop = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 64},
                  {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 64}, "maxItems": 4}],
        "nullable": True}
sampling = {
    "model": {"type": "string", "nullable": True, "description": "a served model name; omitted = the default"},
    "stream": {"type": "boolean", "nullable": True},
    # true needs stream=true (a constraint between fields): only false is declared.
    "stream_options": {"type": "object", "nullable": True, "additionalProperties": False,
                       "properties": {"include_usage": {"type": "boolean", "enum": [False, None], "nullable": True},
                                      "continuous_usage_stats": {"type": "boolean", "enum": [False, None], "nullable": True}},
                       "description": "include_usage / continuous_usage_stats true only with stream=true"},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 32, "nullable": True,
                   "description": "prompt + max_tokens must fit in max_model_len (400 otherwise)"},
    # Float parameters: the server's exact bounds, which are 32-bit float limits (FLT_MAX, and
    # FLT_TRUE_MIN where 0 itself is excluded).
    "temperature": {"type": "number", "minimum": 0, "maximum": FLT_MAX, "nullable": True},
    "top_p": {"type": "number", "minimum": FLT_TRUE_MIN, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": -1, "maximum": 1000, "nullable": True},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "seed": {"type": "integer", "nullable": True},
    "stop": stop,
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 49151}, "maxItems": 8, "nullable": True},
    "n": {"type": "integer", "minimum": 1, "maximum": 4, "nullable": True},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "repetition_penalty": {"type": "number", "minimum": FLT_TRUE_MIN, "maximum": 2, "nullable": True},
    "ignore_eos": {"type": "boolean", "nullable": True},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 0, "nullable": True,
                   "description": "must not exceed max_tokens"},
    "include_stop_str_in_output": {"type": "boolean", "nullable": True},
    "skip_special_tokens": {"type": "boolean", "nullable": True},
    "return_tokens_as_token_ids": {"type": "boolean", "nullable": True},
    "add_special_tokens": {"type": "boolean", "nullable": True},
    "user": {"type": "string", "nullable": True, "description": "accepted and ignored"},
    "service_tier": {"type": "string", "nullable": True, "description": "accepted and ignored"},
}

completion_req = {
    "type": "object", "required": ["prompt"], "additionalProperties": False,
    "properties": {
        # String sizes keep every schema-valid request within a 256-token context (a character can
        # take 4 byte-level tokens, plus 32 generated): the server refuses longer ones with 400.
        "prompt": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 40},
                             {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 40}, "minItems": 1, "maxItems": 4},
                             token_ids,
                             {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 4}]},
        "echo": {"type": "boolean", "nullable": True},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
        # best_of is accepted when it equals n, a constraint between fields OpenAPI 3.0 cannot
        # state, so it is left out of the schema (see tests/py/test_server_schemathesis.py).
        "suffix": {"type": "string", "maxLength": 0, "nullable": True, "description": "only empty"},
        **sampling,
    },
}
message = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {"oneOf": [{"type": "string", "maxLength": 8},
                              {"type": "array", "maxItems": 4, "items": {
                                  "type": "object", "required": ["type", "text"], "additionalProperties": False,
                                  "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string", "maxLength": 2}}}}]},
        "name": {"type": "string"},
    },
    "additionalProperties": ref("JsonValue"),
}
chat_req = {
    "type": "object", "required": ["messages"], "additionalProperties": False,
    "properties": {
        "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1, "maxItems": 4},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 32, "nullable": True},
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True,
                         "description": "values > 0 require logprobs=true"},
        "chat_template_kwargs": {**free_object, "nullable": True},
        "add_generation_prompt": {"type": "boolean", "nullable": True},
        # true needs add_generation_prompt=false and a final assistant message, which a schema
        # cannot state: only false is declared.
        "continue_final_message": {"type": "boolean", "enum": [False, None], "nullable": True,
                                   "description": "true (with add_generation_prompt=false and a final assistant message) "
                                                  "continues that message"},
        "tools": {"type": "array", "items": free_object, "nullable": True},
        "tool_choice": {"type": "string", "enum": ["none", "auto"], "nullable": True},
        "parallel_tool_calls": {"type": "boolean", "nullable": True, "description": "accepted and ignored"},
        "metadata": {**free_object, "nullable": True, "description": "accepted and ignored"},
        "response_format": {"type": "object", "nullable": True, "required": ["type"],
                            "properties": {"type": {"type": "string", "enum": ["text"]}},
                            "additionalProperties": ref("JsonValue")},
        **sampling,
    },
}
usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
finish = {"type": "string", "enum": ["stop", "length", "abort", "error"], "nullable": True}
# Chat choices that called tools (server started with --enable-auto-tool-choice) finish with "tool_calls".
chat_finish = {"type": "string", "enum": ["stop", "length", "abort", "error", "tool_calls"], "nullable": True}
tool_call = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
completion_resp = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": finish,
        "logprobs": {"type": "object", "nullable": True}, "stop_reason": {"nullable": True}}}},
    "usage": usage}}
chat_resp = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": chat_finish, "logprobs": {"type": "object", "nullable": True},
        "message": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string"}, "content": {"type": "string", "nullable": True},
            "tool_calls": {"type": "array", "items": tool_call}}}}}},
    "usage": usage}}
error = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": True},
        "code": {"nullable": True}}}}}

# Streaming (stream=true): text/event-stream, one `data: <chunk JSON>` event per delta, then
# `data: [DONE]`. OpenAPI 3.0 cannot type the events of a stream, so the body is a string whose
# format is described, and the chunk objects are components (CompletionChunk, ChatCompletionChunk).
completion_chunk = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]}, "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text"], "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": finish,
        "logprobs": {"type": "object", "nullable": True}, "stop_reason": {"nullable": True}}}},
    "usage": {"allOf": [usage], "nullable": True}}}
chat_chunk = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion.chunk"]}, "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "delta"], "properties": {
        "index": {"type": "integer"}, "finish_reason": chat_finish, "logprobs": {"type": "object", "nullable": True},
        "delta": {"type": "object", "properties": {"role": {"type": "string"}, "content": {"type": "string", "nullable": True},
                                                   "tool_calls": {"type": "array", "items": {"type": "object"}}}}}}},
    "usage": {"allOf": [usage], "nullable": True}}}

def post(summary, req_schema, resp_schema, stream=None, extra=(400, 401, 404, 413, 503)):
    ok = {"description": "OK", "content": {"application/json": {"schema": resp_schema}}}
    if stream:
        # One server-sent event (schemathesis checks each against this): `data` holds one
        # CompletionChunk / ChatCompletionChunk as JSON text, an ErrorResponse if the generation
        # failed mid-stream, or "[DONE]" last. OpenAPI 3.0 cannot type the JSON inside a string.
        ok["content"]["text/event-stream"] = {
            "schema": {"type": "object", "required": ["data"], "properties": {
                "data": {"type": "string", "description": f"one {stream} (JSON, #/components/schemas/{stream}), "
                                                          "an ErrorResponse, or [DONE]"},
                "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}},
                "x-sse-data-schema": ref(stream)},
            "example": "data: {...}\n\ndata: [DONE]\n\n"}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": req_schema}}},
                     "responses": {"200": ok, **errs(*extra)}}}

def get(summary, schema, ctype="application/json", extra=()):
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {ctype: {"schema": schema}}}, **errs(*extra)}}}

# JSON null means absent for every optional field (openai_request.h), so each is nullable.
tokenize_req = {"type": "object", "additionalProperties": False, "properties": {
    "model": {"type": "string", "nullable": True},
    "prompt": {"type": "string", "maxLength": 500},
    "add_special_tokens": {"type": "boolean", "nullable": True}, "return_token_strs": {"type": "boolean", "nullable": True}},
    "required": ["prompt"]}
tokenize_chat_req = {"type": "object", "additionalProperties": False, "required": ["messages"], "properties": {
    "model": {"type": "string", "nullable": True},
    "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1, "maxItems": 8},
    "add_generation_prompt": {"type": "boolean", "nullable": True}, "add_special_tokens": {"type": "boolean", "nullable": True},
    "continue_final_message": {"type": "boolean", "enum": [False, None], "nullable": True,
                               "description": "true as in chat completions"},
    "return_token_strs": {"type": "boolean", "nullable": True}, "chat_template_kwargs": {**free_object, "nullable": True},
    "tools": {"type": "array", "items": free_object, "nullable": True}}}

# Anthropic Messages API (src/server/anthropic.c). Declared: what it accepts for any model
# (text content; tool_use / tool_result history and tool_choice any / tool depend on the roles and
# on a tool-call parser, constraints OpenAPI 3.0 cannot state, so they are left out).
anth_text_block = {"type": "object", "required": ["type", "text"], "additionalProperties": False, "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string", "maxLength": 2}}}
# Lengths as the chat schema's: every schema-valid prompt fits the short context of the fuzz run.
anth_text = {"oneOf": [{"type": "string", "maxLength": 8},
                       {"type": "array", "items": anth_text_block, "maxItems": 4}]}
anth_msg_fields = {
    "model": {"type": "string", "description": "a served model name (404 otherwise)"},
    "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]}, "content": anth_text}}},
    "system": {**anth_text, "nullable": True},
    "tools": {"type": "array", "nullable": True, "maxItems": 4, "items": {
        "type": "object", "required": ["name", "input_schema"], "additionalProperties": False, "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "description": {"type": "string", "maxLength": 16},
            "input_schema": free_object}}},
    "tool_choice": {"type": "object", "nullable": True, "required": ["type"], "additionalProperties": False,
                    "properties": {"type": {"type": "string", "enum": ["auto", "none"]}}},
    "thinking": {"type": "object", "nullable": True, "required": ["type"], "additionalProperties": False, "properties": {
        "type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]},
        "budget_tokens": {"type": "integer", "minimum": 0, "maximum": 100000}}},
    "metadata": {**free_object, "nullable": True},
}
anth_req = {"type": "object", "additionalProperties": False, "required": ["model", "messages", "max_tokens"], "properties": {
    **anth_msg_fields,
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 32},
    "stop_sequences": {"type": "array", "nullable": True, "maxItems": 4,
                       "items": {"type": "string", "minLength": 1, "maxLength": 64}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "top_p": {"type": "number", "minimum": FLT_TRUE_MIN, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 1000, "nullable": True},
    "stream": {"type": "boolean", "nullable": True}}}
anth_count_req = {"type": "object", "additionalProperties": False, "required": ["model", "messages"],
                  "properties": anth_msg_fields}
anth_block = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "thinking", "tool_use"]}, "text": {"type": "string"},
    "thinking": {"type": "string"}, "signature": {"type": "string"}, "id": {"type": "string"},
    "name": {"type": "string"}, "input": {"type": "object"}}}
anth_resp = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["message"]},
    "role": {"type": "string", "enum": ["assistant"]}, "model": {"type": "string"},
    "content": {"type": "array", "items": anth_block},
    "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
    "stop_sequence": {"type": "string", "nullable": True},
    "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
        "cache_read_input_tokens": {"type": "integer"}}}}}
anth_error = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"type": "string", "enum": ["error"]},
    "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
ANTH_ERR = {"description": "error (Anthropic's shape)", "content": {"application/json": {"schema": ref("AnthropicError")}}}
anth_event = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": [
    "message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
    "message_stop", "error"]}}}


def anth_post(summary, req, resp, stream):
    ok = {"description": "OK", "content": {"application/json": {"schema": resp}}}
    if stream:
        ok["content"]["text/event-stream"] = {
            "schema": {"type": "object", "required": ["data"], "properties": {
                "event": {"type": "string", "description": "the event's type (message_start ... message_stop, error)"},
                "data": {"type": "string", "description": "one AnthropicEvent (JSON)"},
                "id": {"type": "string"}, "retry": {"type": "integer"}},
                "x-sse-data-schema": ref("AnthropicEvent")},
            "example": "event: message_start\ndata: {...}\n\n"}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": req}}},
                     "responses": {"200": ok, **{str(c): ANTH_ERR for c in (400, 401, 404, 413, 503)}}}}


doc = {
    "openapi": "3.0.3",
    "info": {"title": "atomc OpenAI-compatible server", "version": "0.1.0",
             "description": "OpenAI-compatible completions and chat completions, the Anthropic Messages API, plus vLLM's /tokenize, /detokenize and /metrics. "
                            "Endpoints under /v1, /tokenize, /detokenize and /apply-template require 'Authorization: Bearer <key>' (or 'x-api-key: <key>') when the server runs with --api-key."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {"ErrorResponse": error, "ChatMessage": message, "Usage": usage,
                    "CompletionChunk": completion_chunk, "ChatCompletionChunk": chat_chunk, "JsonValue": json_value,
                    "AnthropicError": anth_error, "AnthropicEvent": anth_event},
    },
    "paths": {
        "/health": {"get": {"summary": "200 when serving; 503 while loading, after an engine failure or while shutting down",
                            "responses": {"200": {"description": "serving", "content": {"application/json": {"schema": {"type": "object"}}}},
                                          "503": {"description": "not ready", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/ping": {"get": {"summary": "same as /health", "responses": {
            "200": {"description": "serving", "content": {"application/json": {"schema": {"type": "object"}}}},
            "503": {"description": "not ready", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/version": get("server version", {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}),
        "/metrics": get("Prometheus metrics (vLLM names)", {"type": "string"}, "text/plain"),
        "/tokenizer_info": get("tokenizer facts for remote-tokenizer clients (vLLM's)", {"type": "object", "required": ["bos_token", "eos_token", "chat_template", "model_max_length"], "properties": {
            "tokenizer_class": {"type": "string"}, "bos_token": {"type": "string", "nullable": True},
            "eos_token": {"type": "string", "nullable": True}, "pad_token": {"type": "string", "nullable": True},
            "chat_template": {"type": "string", "nullable": True}, "model_max_length": {"type": "integer"},
            "vocab_size": {"type": "integer"}}}, extra=(401, 503)),
        "/start_profile": {"post": {"summary": "start recording per-step Chrome traces (404 without --profile-dir)",
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}, **errs(401, 404, 503)}}},
        "/stop_profile": {"post": {"summary": "stop recording and write the trace (path in 'trace'); 409 when none is running, 404 without --profile-dir",
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}, **errs(401, 404, 409, 500, 503)}}},
        "/openapi.json": get("this document", {"type": "object"}),
        "/v1/models": get("served models", {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"], "properties": {
                "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}}}}, extra=(401, 503)),
        "/v1/models/{model}": {"get": {"summary": "one served model", "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}, **errs(401, 404, 503)}}},
        "/v1/completions": post("text completion", completion_req, completion_resp, stream="CompletionChunk"),
        "/v1/chat/completions": post("chat completion", chat_req, chat_resp, stream="ChatCompletionChunk"),
        "/v1/messages": anth_post("Anthropic Messages API (message or event stream)", anth_req, anth_resp, True),
        "/v1/messages/count_tokens": anth_post("Anthropic token count of a Messages request", anth_count_req,
                                               {"type": "object", "required": ["input_tokens"],
                                                "properties": {"input_tokens": {"type": "integer"}}}, False),
        "/tokenize": post("tokenize a prompt or chat messages", {"oneOf": [tokenize_req, tokenize_chat_req]},
                          {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
                              "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                              "tokens": {"type": "array", "items": {"type": "integer"}},
                              "token_strs": {"type": "array", "items": {"type": "string"}, "nullable": True}}}),
        "/detokenize": post("token ids to text", {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
                                "model": {"type": "string", "nullable": True},
                                "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 49151},
                                           "description": "any length (the server takes up to 2^24 ids)"}}},
                            {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
        "/apply-template": post("render chat messages with the model's chat template (as llama-server)", tokenize_chat_req,
                                {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
    },
}

text = json.dumps(doc, separators=(",", ":"))
print("// Generated by tools/gen_openapi.py; do not edit by hand. The server's OpenAPI description.")
print("// Token id bounds in it are SmolLM2's vocabulary (49152); the server checks the real model's.")
print('#include "server/server_internal.h"\n')
print("const char server_openapi_json[] =")
for i in range(0, len(text), 100):
    chunk = text[i:i + 100].replace("\\", "\\\\").replace('"', '\\"')
    print(f'    "{chunk}"')
print(";")
