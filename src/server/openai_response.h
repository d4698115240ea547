// JSON builders for OpenAI response shapes: logprobs (completions' parallel arrays, chat's
// content entries), usage, and the error envelope. Pure functions; unit-tested.
#ifndef ATOMC_SERVER_OPENAI_RESPONSE_H
#define ATOMC_SERVER_OPENAI_RESPONSE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"

// How token ids become the strings shown in logprobs.
struct oai_token_text {
    const char *(*token_bytes)(void *ctx, int32_t id, size_t *len); // raw bytes of a token
    void *ctx;
    bool as_ids; // return_tokens_as_token_ids: "token_id:123"
};

// The token's display string: its bytes with invalid/partial UTF-8 replaced by U+FFFD (malloc'd).
char *oai_token_string(const struct oai_token_text *tt, int32_t id);
// Number of Unicode code points in valid UTF-8 s (invalid bytes count one each).
size_t oai_utf8_length(const char *s, size_t len);
// True if s is valid UTF-8 without NUL bytes (what jansson's json_stringn accepts).
bool oai_utf8_valid(const char *s, size_t len);
// Copies s, replacing invalid UTF-8 sequences with U+FFFD (malloc'd, NUL-terminated; *out_len set).
char *oai_utf8_sanitize(const char *s, size_t len, size_t *out_len);

// Completions: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}.
json_t *oai_completion_logprobs_new(void);
// Appends one token. lp NULL = the first prompt token (null logprob / top). top_n alternatives are
// added to the top_logprobs dict together with the chosen token. *text_offset advances by the
// token string's length in code points.
void oai_completion_logprobs_append(json_t *obj, const struct oai_token_text *tt, int32_t token,
                                    const atomc_token_logprobs *lp, int top_n, size_t *text_offset);

// Chat: one entry of logprobs.content: {"token", "logprob", "bytes", "top_logprobs": [...]}.
json_t *oai_chat_logprob_entry(const struct oai_token_text *tt, const atomc_token_logprobs *lp, int top_n);

// {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}
json_t *oai_usage_json(long prompt_tokens, long completion_tokens, long cached_tokens);

// finish_reason as OpenAI spells it (NULL -> JSON null for still-running).
json_t *oai_finish_reason_json(atomc_finish_reason r);

#endif
