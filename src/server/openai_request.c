// OpenAI request parsing and validation (contract in openai_request.h).
#include "server/openai_request.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

int oai_error_set(struct oai_error *e, int http_status, const char *param, const char *fmt, ...) {
    if (!e) return -1;
    e->http_status = http_status;
    const char *type = "invalid_request_error";
    if (http_status == 401) type = "authentication_error";
    else if (http_status == 404) type = "not_found_error";
    else if (http_status == 503) type = "service_unavailable_error";
    else if (http_status >= 500) type = "server_error";
    snprintf(e->type, sizeof e->type, "%s", type);
    e->code[0] = '\0';
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

char *oai_error_json(const struct oai_error *e) {
    json_t *err = json_object();
    json_object_set_new(err, "message", json_string(e->message));
    json_object_set_new(err, "type", json_string(e->type));
    json_object_set_new(err, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(err, "code", e->code[0] ? json_string(e->code) : json_integer(e->http_status));
    json_t *root = json_object();
    json_object_set_new(root, "error", err);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    CHECK(s);
    return s;
}

void oai_limits_init(struct oai_limits *l, int vocab_size) {
    l->vocab_size = vocab_size;
    l->max_n = 64;
    l->max_prompts = 256;
    l->max_logprobs = 20;
    l->max_stop = 64;
    l->max_stop_len = 1024;
}

json_t *oai_body_parse(const char *body, size_t len, struct oai_error *e) {
    if (len == 0) {
        oai_error_set(e, 400, NULL, "request body is empty; expected a JSON object");
        return NULL;
    }
    json_error_t je;
    // jansson rejects invalid UTF-8, NaN/Infinity literals, numbers that overflow, and nesting
    // deeper than its parser limit, each with a message that we pass on.
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        oai_error_set(e, 400, NULL, "invalid JSON body: %s (line %d, column %d)", je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        oai_error_set(e, 400, NULL, "request body must be a JSON object");
        return NULL;
    }
    return root;
}

// ---- typed field readers: each returns 0, or -1 with a 400 naming the field ----

static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    }
    return "value";
}

static int read_bool(const json_t *v, const char *name, bool *out, struct oai_error *e) {
    if (!json_is_boolean(v)) return oai_error_set(e, 400, name, "'%s' must be a boolean, got %s", name, json_type_name(v));
    *out = json_is_true(v);
    return 0;
}

static int read_number(const json_t *v, const char *name, double *out, struct oai_error *e) {
    if (!json_is_number(v)) return oai_error_set(e, 400, name, "'%s' must be a number, got %s", name, json_type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d)) return oai_error_set(e, 400, name, "'%s' must be finite", name);
    *out = d;
    return 0;
}

// A sampling parameter the engine holds as a float. The range [lo, hi] (or (lo, hi] with lo_open,
// lo = 0 then) is checked on the double, with the float's limits: |x| <= FLT_MAX, and for an open
// 0 bound x >= FLT_TRUE_MIN, the smallest positive float. lo and hi being floats, the converted
// value is then in range too, so what is checked is what the engine gets (1e308 would become inf,
// a positive 5e-324 would become 0), and the bounds are the ones /openapi.json states.
static int read_float(const json_t *v, const char *name, double lo, bool lo_open, double hi, float *out,
                      struct oai_error *e) {
    double d = 0;
    if (read_number(v, name, &d, e)) return -1;
    CHECK(!lo_open || lo == 0);
    if (hi > FLT_MAX) hi = FLT_MAX;
    double min = lo_open ? (double)FLT_TRUE_MIN : lo;
    if (!(d >= min))
        return oai_error_set(e, 400, name, "'%s' must be %s %g%s, got %g", name, lo_open ? ">" : ">=", lo,
                             lo_open && lo == 0 ? " (at least 1.4e-45, the smallest positive 32-bit float)" : "", d);
    if (!(d <= hi))
        return oai_error_set(e, 400, name, "'%s' must be at most %g%s, got %g", name, hi,
                             hi == FLT_MAX ? " (the largest 32-bit float)" : "", d);
    float f = (float)d;
    CHECK(isfinite(f) && (lo_open ? f > lo : f >= lo) && f <= hi);
    *out = f;
    return 0;
}

static int read_int(const json_t *v, const char *name, long long lo, long long hi, long long *out,
                    struct oai_error *e) {
    long long x;
    if (json_is_integer(v)) {
        x = (long long)json_integer_value(v);
    } else if (json_is_real(v) && isfinite(json_real_value(v)) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v); // 5.0 is accepted as 5, as Python's pydantic does
    } else {
        return oai_error_set(e, 400, name, "'%s' must be an integer, got %s", name, json_type_name(v));
    }
    if (x < lo || x > hi) return oai_error_set(e, 400, name, "'%s' must be between %lld and %lld, got %lld", name, lo, hi, x);
    *out = x;
    return 0;
}

static int read_string(const json_t *v, const char *name, char **out, size_t *len, struct oai_error *e) {
    if (!json_is_string(v)) return oai_error_set(e, 400, name, "'%s' must be a string, got %s", name, json_type_name(v));
    size_t n = json_string_length(v);
    const char *s = json_string_value(v);
    if (memchr(s, 0, n)) return oai_error_set(e, 400, name, "'%s' must not contain NUL characters", name);
    *out = xstrdup(s);
    if (len) *len = n;
    return 0;
}

static int read_token_ids(const json_t *v, const char *name, const struct oai_limits *lim, int max_len,
                          int32_t **out, int *n_out, struct oai_error *e) {
    if (!json_is_array(v)) return oai_error_set(e, 400, name, "'%s' must be a list of token ids", name);
    size_t n = json_array_size(v);
    if ((long long)n > max_len) return oai_error_set(e, 400, name, "'%s' has %zu token ids; at most %d are allowed", name, n, max_len);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return oai_error_set(e, 500, name, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *x = json_array_get(v, i);
        if (!json_is_integer(x)) {
            free(ids);
            return oai_error_set(e, 400, name, "'%s'[%zu] must be an integer token id, got %s", name, i, json_type_name(x));
        }
        json_int_t id = json_integer_value(x);
        if (id < 0 || id >= lim->vocab_size) {
            free(ids);
            return oai_error_set(e, 400, name, "'%s'[%zu]: token id %lld is out of range [0, %d)", name, i,
                                 (long long)id, lim->vocab_size);
        }
        ids[i] = (int32_t)id;
    }
    *out = ids;
    *n_out = (int)n;
    return 0;
}

static bool is_int_list(const json_t *v) {
    if (!json_is_array(v) || json_array_size(v) == 0) return false;
    return json_is_integer(json_array_get(v, 0));
}

static int parse_prompt(const json_t *v, const struct oai_limits *lim, struct oai_request *r, struct oai_error *e) {
    const int max_ids = 1 << 24;
    if (json_is_string(v)) {
        r->prompts = xcalloc(1, sizeof *r->prompts);
        r->n_prompts = 1;
        return read_string(v, "prompt", &r->prompts[0].text, &r->prompts[0].text_len, e);
    }
    if (!json_is_array(v))
        return oai_error_set(e, 400, "prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists, got %s", json_type_name(v));
    size_t n = json_array_size(v);
    if (n == 0) return oai_error_set(e, 400, "prompt", "'prompt' must not be empty");
    if (is_int_list(v)) {
        r->prompts = xcalloc(1, sizeof *r->prompts);
        r->n_prompts = 1;
        return read_token_ids(v, "prompt", lim, max_ids, &r->prompts[0].ids, &r->prompts[0].n_ids, e);
    }
    if ((long long)n > lim->max_prompts)
        return oai_error_set(e, 400, "prompt", "'prompt' has %zu entries; at most %d are allowed", n, lim->max_prompts);
    r->prompts = xcalloc(n, sizeof *r->prompts);
    r->n_prompts = (int)n;
    bool any_str = false, any_ids = false;
    for (size_t i = 0; i < n; i++) {
        const json_t *x = json_array_get(v, i);
        if (json_is_string(x)) {
            any_str = true;
            if (read_string(x, "prompt", &r->prompts[i].text, &r->prompts[i].text_len, e)) return -1;
        } else if (json_is_array(x)) {
            any_ids = true;
            if (json_array_size(x) == 0) return oai_error_set(e, 400, "prompt", "'prompt'[%zu] is an empty token list", i);
            if (read_token_ids(x, "prompt", lim, max_ids, &r->prompts[i].ids, &r->prompts[i].n_ids, e)) return -1;
        } else {
            return oai_error_set(e, 400, "prompt", "'prompt'[%zu] must be a string or a list of token ids, got %s", i, json_type_name(x));
        }
    }
    if (any_str && any_ids) return oai_error_set(e, 400, "prompt", "'prompt' must not mix strings and token-id lists");
    return 0;
}

static int parse_stop(const json_t *v, const struct oai_limits *lim, struct oai_request *r, struct oai_error *e) {
    size_t n = json_is_string(v) ? 1 : json_is_array(v) ? json_array_size(v) : 0;
    if (!json_is_string(v) && !json_is_array(v))
        return oai_error_set(e, 400, "stop", "'stop' must be a string or a list of strings, got %s", json_type_name(v));
    if ((long long)n > lim->max_stop) return oai_error_set(e, 400, "stop", "'stop' has %zu entries; at most %d are allowed", n, lim->max_stop);
    r->stop = xcalloc(n ? n : 1, sizeof *r->stop);
    for (size_t i = 0; i < n; i++) {
        const json_t *x = json_is_string(v) ? v : json_array_get(v, i);
        if (!json_is_string(x)) return oai_error_set(e, 400, "stop", "'stop'[%zu] must be a string, got %s", i, json_type_name(x));
        size_t len;
        if (read_string(x, "stop", &r->stop[r->n_stop], &len, e)) return -1;
        r->n_stop++;
        if (len == 0) return oai_error_set(e, 400, "stop", "'stop' strings must not be empty");
        if ((long long)len > lim->max_stop_len)
            return oai_error_set(e, 400, "stop", "'stop' string of %zu bytes exceeds the limit of %d", len, lim->max_stop_len);
    }
    return 0;
}

// The text of one message content: a string, null, or a list of {"type":"text","text":...} parts.
static int normalize_content(json_t *msg, size_t idx, struct oai_error *e) {
    json_t *c = json_object_get(msg, "content");
    if (!c || json_is_null(c) || json_is_string(c)) return 0;
    if (!json_is_array(c))
        return oai_error_set(e, 400, "messages", "messages[%zu].content must be a string, a list of content parts or null, got %s", idx, json_type_name(c));
    size_t cap = 64, len = 0;
    char *s = xmalloc(cap);
    s[0] = '\0';
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part) {
        const json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type)) {
            free(s);
            return oai_error_set(e, 400, "messages", "messages[%zu].content[%zu] must be an object with a 'type'", idx, i);
        }
        if (strcmp(json_string_value(type), "text") != 0) {
            free(s);
            return oai_error_set(e, 400, "messages", "messages[%zu].content[%zu]: content part type '%s' is not supported (text only)", idx, i, json_string_value(type));
        }
        if (!json_is_string(text)) {
            free(s);
            return oai_error_set(e, 400, "messages", "messages[%zu].content[%zu].text must be a string", idx, i);
        }
        size_t tl = json_string_length(text);
        while (len + tl + 2 > cap) {
            cap *= 2;
            s = xrealloc(s, cap);
        }
        if (i > 0) s[len++] = '\n';
        memcpy(s + len, json_string_value(text), tl);
        len += tl;
        s[len] = '\0';
    }
    json_object_set_new(msg, "content", json_stringn(s, len));
    free(s);
    return 0;
}

int oai_messages_validate(json_t *messages, struct oai_error *e) {
    if (!json_is_array(messages)) return oai_error_set(e, 400, "messages", "'messages' must be a list of message objects");
    if (json_array_size(messages) == 0) return oai_error_set(e, 400, "messages", "'messages' must not be empty");
    static const char *roles[] = {"system", "user", "assistant", "tool", "developer", "function"};
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) return oai_error_set(e, 400, "messages", "messages[%zu] must be an object", i);
        const json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) return oai_error_set(e, 400, "messages", "messages[%zu].role must be a string", i);
        bool ok = false;
        for (size_t k = 0; k < sizeof roles / sizeof roles[0]; k++) ok |= !strcmp(json_string_value(role), roles[k]);
        if (!ok) return oai_error_set(e, 400, "messages", "messages[%zu].role '%s' is not one of system, user, assistant, tool, developer", i, json_string_value(role));
        if (!json_object_get(m, "content") && !json_object_get(m, "tool_calls"))
            return oai_error_set(e, 400, "messages", "messages[%zu] has no 'content'", i);
        if (normalize_content(m, i, e)) return -1;
    }
    return 0;
}

// ---- the field table ----

enum field_id {
    F_MODEL, F_PROMPT, F_MESSAGES, F_STREAM, F_STREAM_OPTIONS, F_MAX_TOKENS, F_MAX_COMPLETION_TOKENS, F_TEMPERATURE,
    F_TOP_P, F_TOP_K, F_MIN_P, F_SEED, F_STOP, F_STOP_TOKEN_IDS, F_N, F_LOGPROBS, F_TOP_LOGPROBS, F_PRESENCE_PENALTY,
    F_FREQUENCY_PENALTY, F_REPETITION_PENALTY, F_IGNORE_EOS, F_MIN_TOKENS, F_ECHO, F_INCLUDE_STOP_STR,
    F_SKIP_SPECIAL_TOKENS, F_RETURN_TOKENS_AS_IDS, F_CHAT_TEMPLATE_KWARGS, F_ADD_GENERATION_PROMPT,
    F_CONTINUE_FINAL_MESSAGE, F_ADD_SPECIAL_TOKENS, F_TOOLS, F_TOOL_CHOICE, F_RESPONSE_FORMAT, F_BEST_OF, F_SUFFIX,
    F_LOGIT_BIAS, F_STORE, F_KV_TRANSFER_PARAMS, F_IGNORED, // user, metadata, service_tier, parallel_tool_calls
    F_STRUCTURED_OUTPUTS, F_GUIDED_JSON, F_GUIDED_REGEX, F_GUIDED_CHOICE, F_GUIDED_GRAMMAR, F_GUIDED_BACKEND,
    F_GUIDED_WHITESPACE,
};

#define EP_C (1 << OAI_ENDPOINT_COMPLETIONS)
#define EP_CH (1 << OAI_ENDPOINT_CHAT)

static const struct field {
    const char *name;
    enum field_id id;
    int endpoints;
} fields[] = {
    {"model", F_MODEL, EP_C | EP_CH},
    {"prompt", F_PROMPT, EP_C},
    {"messages", F_MESSAGES, EP_CH},
    {"stream", F_STREAM, EP_C | EP_CH},
    {"stream_options", F_STREAM_OPTIONS, EP_C | EP_CH},
    {"max_tokens", F_MAX_TOKENS, EP_C | EP_CH},
    {"max_completion_tokens", F_MAX_COMPLETION_TOKENS, EP_CH},
    {"temperature", F_TEMPERATURE, EP_C | EP_CH},
    {"top_p", F_TOP_P, EP_C | EP_CH},
    {"top_k", F_TOP_K, EP_C | EP_CH},
    {"min_p", F_MIN_P, EP_C | EP_CH},
    {"seed", F_SEED, EP_C | EP_CH},
    {"stop", F_STOP, EP_C | EP_CH},
    {"stop_token_ids", F_STOP_TOKEN_IDS, EP_C | EP_CH},
    {"n", F_N, EP_C | EP_CH},
    {"logprobs", F_LOGPROBS, EP_C | EP_CH},
    {"top_logprobs", F_TOP_LOGPROBS, EP_CH},
    {"presence_penalty", F_PRESENCE_PENALTY, EP_C | EP_CH},
    {"frequency_penalty", F_FREQUENCY_PENALTY, EP_C | EP_CH},
    {"repetition_penalty", F_REPETITION_PENALTY, EP_C | EP_CH},
    {"ignore_eos", F_IGNORE_EOS, EP_C | EP_CH},
    {"min_tokens", F_MIN_TOKENS, EP_C | EP_CH},
    {"echo", F_ECHO, EP_C},
    {"include_stop_str_in_output", F_INCLUDE_STOP_STR, EP_C | EP_CH},
    {"skip_special_tokens", F_SKIP_SPECIAL_TOKENS, EP_C | EP_CH},
    {"return_tokens_as_token_ids", F_RETURN_TOKENS_AS_IDS, EP_C | EP_CH},
    {"chat_template_kwargs", F_CHAT_TEMPLATE_KWARGS, EP_CH},
    {"add_generation_prompt", F_ADD_GENERATION_PROMPT, EP_CH},
    {"continue_final_message", F_CONTINUE_FINAL_MESSAGE, EP_CH},
    {"add_special_tokens", F_ADD_SPECIAL_TOKENS, EP_C | EP_CH},
    {"tools", F_TOOLS, EP_CH},
    {"tool_choice", F_TOOL_CHOICE, EP_CH},
    {"response_format", F_RESPONSE_FORMAT, EP_C | EP_CH},
    {"best_of", F_BEST_OF, EP_C},
    {"suffix", F_SUFFIX, EP_C},
    {"logit_bias", F_LOGIT_BIAS, EP_C | EP_CH},
    {"store", F_STORE, EP_CH},
    {"kv_transfer_params", F_KV_TRANSFER_PARAMS, EP_C | EP_CH},
    {"user", F_IGNORED, EP_C | EP_CH},
    {"metadata", F_IGNORED, EP_CH},
    {"service_tier", F_IGNORED, EP_C | EP_CH},
    {"parallel_tool_calls", F_IGNORED, EP_CH},
    {"structured_outputs", F_STRUCTURED_OUTPUTS, EP_C | EP_CH},
    {"guided_json", F_GUIDED_JSON, EP_C | EP_CH},
    {"guided_regex", F_GUIDED_REGEX, EP_C | EP_CH},
    {"guided_choice", F_GUIDED_CHOICE, EP_C | EP_CH},
    {"guided_grammar", F_GUIDED_GRAMMAR, EP_C | EP_CH},
    {"guided_decoding_backend", F_GUIDED_BACKEND, EP_C | EP_CH},
    {"guided_whitespace_pattern", F_GUIDED_WHITESPACE, EP_C | EP_CH},
};

// ---- structured output ----

// Records the request's one constraint (kind, text owned by the caller, moved in).
static int set_grammar(struct oai_request *r, const char *param, atomc_grammar_kind kind, char *text,
                       struct oai_error *e) {
    if (r->grammar_kind != ATOMC_GRAMMAR_NONE) {
        free(text);
        return oai_error_set(e, 400, param, "only one kind of structured output may be given ('%s' and '%s')",
                             r->grammar_param, param);
    }
    r->grammar_kind = kind;
    r->grammar = text;
    snprintf(r->grammar_param, sizeof r->grammar_param, "%s", param);
    return 0;
}

// A JSON schema given as an object (or a boolean schema), or as a string holding one.
static int grammar_json(struct oai_request *r, const char *param, const json_t *v, struct oai_error *e) {
    json_t *owned = NULL;
    if (json_is_string(v)) {
        json_error_t je;
        owned = json_loadb(json_string_value(v), json_string_length(v), JSON_DECODE_ANY, &je);
        if (!owned) return oai_error_set(e, 400, param, "'%s' is not valid JSON: %s", param, je.text);
        v = owned;
    }
    if (!json_is_object(v) && !json_is_boolean(v)) {
        json_decref(owned);
        return oai_error_set(e, 400, param, "'%s' must be a JSON schema object, got %s", param, json_type_name(v));
    }
    char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(owned);
    return set_grammar(r, param, ATOMC_GRAMMAR_JSON_SCHEMA, text, e);
}

static int grammar_string(struct oai_request *r, const char *param, const json_t *v, atomc_grammar_kind kind,
                          struct oai_error *e) {
    if (!json_is_string(v)) return oai_error_set(e, 400, param, "'%s' must be a string, got %s", param, json_type_name(v));
    if (json_string_length(v) == 0) return oai_error_set(e, 400, param, "'%s' must not be empty", param);
    const char *s = json_string_value(v);
    if (memchr(s, 0, json_string_length(v))) return oai_error_set(e, 400, param, "'%s' contains a NUL character", param);
    // An EBNF grammar (GBNF, "root ::= ...") or a Lark one ("start: ..."), as vLLM's xgrammar
    // backend tells them apart.
    if (kind == ATOMC_GRAMMAR_EBNF && !strstr(s, "::=")) kind = ATOMC_GRAMMAR_LARK;
    return set_grammar(r, param, kind, xstrdup(s), e);
}

static int grammar_choice(struct oai_request *r, const char *param, const json_t *v, struct oai_error *e) {
    if (!json_is_array(v) || json_array_size(v) == 0)
        return oai_error_set(e, 400, param, "'%s' must be a non-empty list of strings", param);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *c = json_array_get(v, i);
        if (!json_is_string(c) || json_string_length(c) == 0)
            return oai_error_set(e, 400, param, "'%s'[%zu] must be a non-empty string", param, i);
    }
    return set_grammar(r, param, ATOMC_GRAMMAR_CHOICE, json_dumps(v, JSON_COMPACT), e);
}

static int grammar_structural_tag(struct oai_request *r, const char *param, const json_t *v, struct oai_error *e) {
    if (json_is_string(v)) return grammar_string(r, param, v, ATOMC_GRAMMAR_STRUCTURAL_TAG, e);
    if (!json_is_object(v)) return oai_error_set(e, 400, param, "'%s' must be an object, got %s", param, json_type_name(v));
    return set_grammar(r, param, ATOMC_GRAMMAR_STRUCTURAL_TAG, json_dumps(v, JSON_COMPACT), e);
}

static int parse_response_format(struct oai_request *r, const json_t *v, struct oai_error *e) {
    const char *key = "response_format";
    const json_t *t = json_is_object(v) ? json_object_get(v, "type") : NULL;
    if (!json_is_string(t))
        return oai_error_set(e, 400, key, "'response_format' must be an object with a string 'type'");
    const char *type = json_string_value(t);
    if (!strcmp(type, "text")) return 0;
    if (!strcmp(type, "json_object")) return set_grammar(r, key, ATOMC_GRAMMAR_JSON_OBJECT, NULL, e);
    if (!strcmp(type, "json_schema")) {
        const json_t *js = json_object_get(v, "json_schema");
        if (!json_is_object(js))
            return oai_error_set(e, 400, "response_format.json_schema",
                                 "'response_format.json_schema' must be an object with a 'schema'");
        const json_t *strict = json_object_get(js, "strict");
        if (strict && !json_is_null(strict) && !json_is_boolean(strict))
            return oai_error_set(e, 400, "response_format.json_schema.strict", "'strict' must be a boolean");
        const json_t *name = json_object_get(js, "name");
        if (name && !json_is_null(name) && !json_is_string(name))
            return oai_error_set(e, 400, "response_format.json_schema.name", "'name' must be a string");
        // The schema is always enforced, strict or not (strict = true is what OpenAI guarantees).
        const json_t *schema = json_object_get(js, "schema");
        if (!schema || json_is_null(schema))
            return oai_error_set(e, 400, "response_format.json_schema.schema",
                                 "'response_format.json_schema.schema' is required");
        return grammar_json(r, "response_format.json_schema.schema", schema, e);
    }
    if (!strcmp(type, "structural_tag")) {
        const json_t *f = json_object_get(v, "format");
        if (!json_is_object(f))
            return oai_error_set(e, 400, "response_format.format", "'response_format.format' must be an object");
        char *text = json_dumps(v, JSON_COMPACT);
        return set_grammar(r, key, ATOMC_GRAMMAR_STRUCTURAL_TAG, text, e);
    }
    return oai_error_set(e, 400, key,
                         "unsupported response_format type '%s' (text, json_object, json_schema, structural_tag)", type);
}

// vLLM's structured_outputs object: one of json / regex / choice / grammar / json_object /
// structural_tag; its options that change nothing here (backend names, disable_fallback) are
// accepted, the ones that would change the output (whitespace_pattern, disable_* ) refused.
static int parse_structured_outputs(struct oai_request *r, const json_t *v, struct oai_error *e) {
    if (!json_is_object(v)) return oai_error_set(e, 400, "structured_outputs", "'structured_outputs' must be an object");
    const char *k;
    json_t *x;
    int rc = 0;
    json_object_foreach((json_t *)v, k, x) {
        if (json_is_null(x)) continue;
        char param[64];
        snprintf(param, sizeof param, "structured_outputs.%s", k);
        if (!strcmp(k, "json")) rc = grammar_json(r, param, x, e);
        else if (!strcmp(k, "regex")) rc = grammar_string(r, param, x, ATOMC_GRAMMAR_REGEX, e);
        else if (!strcmp(k, "choice")) rc = grammar_choice(r, param, x, e);
        else if (!strcmp(k, "grammar")) rc = grammar_string(r, param, x, ATOMC_GRAMMAR_EBNF, e);
        else if (!strcmp(k, "structural_tag")) rc = grammar_structural_tag(r, param, x, e);
        else if (!strcmp(k, "json_object")) {
            if (!json_is_boolean(x)) rc = oai_error_set(e, 400, param, "'%s' must be a boolean", param);
            else if (json_is_true(x)) rc = set_grammar(r, param, ATOMC_GRAMMAR_JSON_OBJECT, NULL, e);
        } else if (!strcmp(k, "backend") || !strcmp(k, "disable_fallback") || !strcmp(k, "_backend")) {
            continue;
        } else {
            rc = oai_error_set(e, 400, param, "unsupported field '%s'", param);
        }
        if (rc) return rc;
    }
    return 0;
}

// ---- tool_choice "required" / named: the tool-call grammar ----

char *oai_tool_call_grammar(const struct oai_request *r, const char *tool_parser, struct oai_error *e) {
    bool hermes = tool_parser && !strcmp(tool_parser, "hermes");
    bool llama = tool_parser && !strcmp(tool_parser, "llama3_json");
    if (!hermes && !llama) {
        oai_error_set(e, 400, "tool_choice",
                      "'tool_choice' \"required\" or a named function needs the server's --enable-auto-tool-choice --tool-call-parser "
                      "(hermes or llama3_json)");
        return NULL;
    }
    if (!r->tools || json_array_size(r->tools) == 0) {
        oai_error_set(e, 400, "tool_choice", "'tool_choice' \"required\" or a named function needs 'tools'");
        return NULL;
    }
    json_t *alts = json_array();
    size_t i;
    json_t *tool;
    json_array_foreach(r->tools, i, tool) {
        const json_t *fn = json_object_get(tool, "function");
        const char *type = json_string_value(json_object_get(tool, "type"));
        const char *name = json_string_value(json_object_get(fn, "name"));
        if ((type && strcmp(type, "function")) || !json_is_object(fn) || !name || !name[0]) {
            json_decref(alts);
            oai_error_set(e, 400, "tools", "tools[%zu] must be {\"type\": \"function\", \"function\": {\"name\": ...}}", i);
            return NULL;
        }
        if (r->tool_choice_name && strcmp(name, r->tool_choice_name)) continue;
        json_t *params = json_object_get(fn, "parameters");
        if (params && !json_is_null(params) && !json_is_object(params)) {
            json_decref(alts);
            oai_error_set(e, 400, "tools", "tools[%zu].function.parameters must be a JSON schema object", i);
            return NULL;
        }
        json_t *args = params && json_is_object(params) ? json_deep_copy(params) : json_pack("{s:s}", "type", "object");
        json_t *alt = json_pack("{s:s, s:{s:{s:s}, s:o}, s:[s,s], s:b}", "type", "object", "properties", "name",
                                "const", name, llama ? "parameters" : "arguments", args, "required", "name",
                                llama ? "parameters" : "arguments", "additionalProperties", 0);
        json_array_append_new(alts, alt);
    }
    if (json_array_size(alts) == 0) {
        json_decref(alts);
        oai_error_set(e, 400, "tool_choice", "'tool_choice' names the function '%s', which is not in 'tools'",
                      r->tool_choice_name);
        return NULL;
    }
    json_t *schema = json_array_size(alts) == 1 ? json_incref(json_array_get(alts, 0)) : json_pack("{s:O}", "anyOf", alts);
    json_decref(alts);
    json_t *content = json_pack("{s:s, s:o, s:i}", "type", "json_schema", "json_schema", schema, "max_whitespace_cnt", 1);
    json_t *fmt = hermes ? json_pack("{s:s, s:s, s:o, s:s}", "type", "tag", "begin", "<tool_call>\n", "content", content,
                                     "end", "\n</tool_call>")
                         : content;
    json_t *st = json_pack("{s:s, s:o}", "type", "structural_tag", "format", fmt);
    char *out = json_dumps(st, JSON_COMPACT);
    json_decref(st);
    return out;
}

static const struct field *field_find(const char *name, enum oai_endpoint ep) {
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (!strcmp(fields[i].name, name)) return (fields[i].endpoints & (1 << ep)) ? &fields[i] : NULL;
    return NULL;
}

// Fields whose meaning depends on others; resolved after all fields are read.
struct parse_ctx {
    long long best_of;      // 0 = absent
    long long top_logprobs; // -1 = absent
};

// kv_transfer_params: see openai_request.h.
static int parse_kv_params(const json_t *v, struct oai_request *r, struct oai_error *e) {
    if (!json_is_object(v)) return oai_error_set(e, 400, "kv_transfer_params", "'kv_transfer_params' must be an object");
    r->has_kv_params = true;
    const char *k;
    json_t *x;
    json_object_foreach((json_t *)v, k, x) {
        if (json_is_null(x)) continue;
        if (!strcmp(k, "do_remote_decode") || !strcmp(k, "do_remote_prefill")) {
            if (!json_is_boolean(x))
                return oai_error_set(e, 400, "kv_transfer_params", "'kv_transfer_params.%s' must be a boolean", k);
            if (k[10] == 'd') r->kv_do_remote_decode = json_is_true(x);
            else r->kv_do_remote_prefill = json_is_true(x);
        } else if (!strcmp(k, "remote_engine_id") || !strcmp(k, "remote_request_id") || !strcmp(k, "transfer_id")) {
            if (!json_is_string(x) || json_string_length(x) == 0 || json_string_length(x) > 95)
                return oai_error_set(e, 400, "kv_transfer_params",
                                     "'kv_transfer_params.%s' must be a string of 1 to 95 bytes", k);
            char **dst = !strcmp(k, "remote_engine_id") ? &r->kv_remote_engine_id : &r->kv_transfer_id;
            free(*dst);
            *dst = xstrdup(json_string_value(x));
        } else if (!strcmp(k, "remote_port") || !strcmp(k, "tp_size")) {
            if (!json_is_integer(x))
                return oai_error_set(e, 400, "kv_transfer_params", "'kv_transfer_params.%s' must be an integer", k);
        } else if (!strcmp(k, "remote_host")) {
            if (!json_is_string(x))
                return oai_error_set(e, 400, "kv_transfer_params", "'kv_transfer_params.remote_host' must be a string");
        } else if (!strcmp(k, "remote_block_ids")) {
            if (!json_is_array(x))
                return oai_error_set(e, 400, "kv_transfer_params",
                                     "'kv_transfer_params.remote_block_ids' must be a list");
        }
        // Other keys belong to other connectors (vLLM passes the dict through): ignored.
    }
    if (r->kv_do_remote_decode && r->kv_do_remote_prefill)
        return oai_error_set(e, 400, "kv_transfer_params",
                             "'kv_transfer_params': do_remote_decode and do_remote_prefill cannot both be true");
    if (r->kv_do_remote_prefill && !r->kv_transfer_id)
        return oai_error_set(e, 400, "kv_transfer_params",
                             "'kv_transfer_params.do_remote_prefill' needs 'remote_request_id' (the prefill "
                             "instance's response carries it)");
    return 0;
}

static int parse_field(const struct field *f, const char *key, const json_t *v, const struct oai_limits *lim,
                       struct oai_request *r, struct parse_ctx *pc, struct oai_error *e) {
    atomc_sampling_params *p = &r->params;
    long long x;
    bool b;
    switch (f->id) {
    case F_MODEL: return read_string(v, key, &r->model, NULL, e);
    case F_PROMPT: return parse_prompt(v, lim, r, e);
    case F_MESSAGES:
        if (!json_is_array(v)) return oai_error_set(e, 400, key, "'messages' must be a list of message objects");
        r->messages = json_deep_copy(v);
        return oai_messages_validate(r->messages, e);
    case F_STREAM: return read_bool(v, key, &r->stream, e);
    case F_STREAM_OPTIONS: {
        if (!json_is_object(v)) return oai_error_set(e, 400, key, "'stream_options' must be an object");
        const char *k;
        json_t *x2;
        json_object_foreach((json_t *)v, k, x2) {
            if (json_is_null(x2)) continue;
            if (!strcmp(k, "include_usage")) {
                if (read_bool(x2, "stream_options.include_usage", &r->include_usage, e)) return -1;
            } else if (!strcmp(k, "continuous_usage_stats")) {
                if (read_bool(x2, "stream_options.continuous_usage_stats", &r->continuous_usage_stats, e)) return -1;
            } else {
                return oai_error_set(e, 400, "stream_options", "unsupported field 'stream_options.%s'", k);
            }
        }
        return 0;
    }
    case F_MAX_TOKENS:
    case F_MAX_COMPLETION_TOKENS:
        if (read_int(v, key, 0, 1 << 30, &x, e)) return -1;
        p->max_tokens = (int)x;
        r->max_tokens_set = true;
        return 0;
    case F_TEMPERATURE: return read_float(v, key, 0, false, FLT_MAX, &p->temperature, e);
    case F_TOP_P: return read_float(v, key, 0, true, 1, &p->top_p, e);
    case F_TOP_K:
        if (read_int(v, key, -1, 1 << 30, &x, e)) return -1;
        p->top_k = (int)x;
        return 0;
    case F_MIN_P: return read_float(v, key, 0, false, 1, &p->min_p, e);
    case F_SEED:
        if (!json_is_integer(v)) return oai_error_set(e, 400, key, "'seed' must be an integer, got %s", json_type_name(v));
        p->has_seed = true;
        p->seed = (uint64_t)json_integer_value(v);
        return 0;
    case F_STOP: return parse_stop(v, lim, r, e);
    case F_STOP_TOKEN_IDS:
        if (json_is_array(v) && (long long)json_array_size(v) > lim->max_stop)
            return oai_error_set(e, 400, key, "'stop_token_ids' has %zu entries; at most %d are allowed", json_array_size(v), lim->max_stop);
        return read_token_ids(v, key, lim, lim->max_stop, &r->stop_token_ids, &r->n_stop_token_ids, e);
    case F_N:
        if (read_int(v, key, 1, lim->max_n, &x, e)) return -1;
        r->n = (int)x;
        return 0;
    case F_LOGPROBS:
        if (r->endpoint == OAI_ENDPOINT_CHAT) {
            if (read_bool(v, key, &b, e)) return -1;
            if (b && r->logprobs < 0) r->logprobs = 0;
            if (!b) r->logprobs = -2; // explicitly off: top_logprobs > 0 is then an error
            return 0;
        }
        if (read_int(v, key, 0, lim->max_logprobs, &x, e)) return -1;
        r->logprobs = (int)x;
        return 0;
    case F_TOP_LOGPROBS:
        if (read_int(v, key, 0, lim->max_logprobs, &x, e)) return -1;
        pc->top_logprobs = x;
        return 0;
    case F_PRESENCE_PENALTY: return read_float(v, key, -2, false, 2, &p->presence_penalty, e);
    case F_FREQUENCY_PENALTY: return read_float(v, key, -2, false, 2, &p->frequency_penalty, e);
    // (0, 2] is the engine's range (engine.c validate_params); checked here so the error names it.
    case F_REPETITION_PENALTY: return read_float(v, key, 0, true, 2, &p->repetition_penalty, e);
    case F_IGNORE_EOS: return read_bool(v, key, &p->ignore_eos, e);
    case F_MIN_TOKENS:
        if (read_int(v, key, 0, 1 << 30, &x, e)) return -1;
        p->min_tokens = (int)x;
        return 0;
    case F_ECHO: return read_bool(v, key, &r->echo, e);
    case F_INCLUDE_STOP_STR: return read_bool(v, key, &p->include_stop_str_in_output, e);
    case F_SKIP_SPECIAL_TOKENS: return read_bool(v, key, &p->skip_special_tokens, e);
    case F_RETURN_TOKENS_AS_IDS: return read_bool(v, key, &r->return_tokens_as_token_ids, e);
    case F_CHAT_TEMPLATE_KWARGS:
        if (!json_is_object(v)) return oai_error_set(e, 400, key, "'chat_template_kwargs' must be an object");
        r->chat_template_kwargs = json_deep_copy(v);
        return 0;
    case F_ADD_GENERATION_PROMPT: return read_bool(v, key, &r->add_generation_prompt, e);
    case F_CONTINUE_FINAL_MESSAGE: return read_bool(v, key, &r->continue_final_message, e);
    case F_ADD_SPECIAL_TOKENS: return read_bool(v, key, &r->add_special_tokens, e);
    case F_TOOLS:
        if (!json_is_array(v)) return oai_error_set(e, 400, key, "'tools' must be a list");
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!json_is_object(json_array_get(v, i))) return oai_error_set(e, 400, key, "tools[%zu] must be an object", i);
        r->tools = json_deep_copy(v);
        return 0;
    case F_TOOL_CHOICE:
        if (json_is_string(v)) {
            const char *c = json_string_value(v);
            if (!strcmp(c, "none") || !strcmp(c, "auto") || !strcmp(c, "required")) {
                r->tool_choice_none = !strcmp(c, "none");
                r->tool_choice_required = !strcmp(c, "required");
                return 0;
            }
        } else if (json_is_object(v)) {
            const json_t *fn = json_object_get(v, "function");
            const char *type = json_string_value(json_object_get(v, "type"));
            const char *name = json_string_value(json_object_get(fn, "name"));
            if (type && !strcmp(type, "function") && name && name[0]) {
                r->tool_choice_required = true;
                r->tool_choice_name = xstrdup(name);
                return 0;
            }
        }
        return oai_error_set(e, 400, key,
                             "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}");
    case F_RESPONSE_FORMAT: return parse_response_format(r, v, e);
    case F_STRUCTURED_OUTPUTS: return parse_structured_outputs(r, v, e);
    case F_GUIDED_JSON: return grammar_json(r, key, v, e);
    case F_GUIDED_REGEX: return grammar_string(r, key, v, ATOMC_GRAMMAR_REGEX, e);
    case F_GUIDED_CHOICE: return grammar_choice(r, key, v, e);
    case F_GUIDED_GRAMMAR: return grammar_string(r, key, v, ATOMC_GRAMMAR_EBNF, e);
    case F_GUIDED_BACKEND:
        if (!json_is_string(v)) return oai_error_set(e, 400, key, "'%s' must be a string", key);
        return 0; // one engine here (xgrammar), whatever the name
    case F_GUIDED_WHITESPACE: return oai_error_set(e, 400, key, "'%s' is not supported", key);
    case F_BEST_OF:
        if (read_int(v, key, 1, lim->max_n, &x, e)) return -1;
        pc->best_of = x;
        return 0;
    case F_SUFFIX:
        if (json_is_string(v) && json_string_length(v) == 0) return 0;
        return oai_error_set(e, 400, key, "'suffix' is not supported");
    case F_LOGIT_BIAS:
        if (json_is_object(v) && json_object_size(v) == 0) return 0;
        return oai_error_set(e, 400, key, "'logit_bias' is not supported");
    case F_STORE:
        if (json_is_false(v)) return 0;
        return oai_error_set(e, 400, key, "'store' is not supported (only false)");
    case F_KV_TRANSFER_PARAMS: return parse_kv_params(v, r, e);
    case F_IGNORED: // accepted and ignored, but of the type OpenAI defines
        if (!strcmp(key, "metadata")) {
            if (!json_is_object(v)) return oai_error_set(e, 400, key, "'metadata' must be an object, got %s", json_type_name(v));
            return 0;
        }
        if (!strcmp(key, "parallel_tool_calls")) return read_bool(v, key, &b, e);
        if (!json_is_string(v)) return oai_error_set(e, 400, key, "'%s' must be a string, got %s", key, json_type_name(v));
        return 0;
    }
    return oai_error_set(e, 500, key, "unhandled field");
}

int oai_request_parse(enum oai_endpoint ep, const char *body, size_t len, const struct oai_limits *lim,
                      struct oai_request *r, struct oai_error *e) {
    memset(r, 0, sizeof *r);
    r->endpoint = ep;
    r->n = 1;
    r->logprobs = -1;
    r->add_generation_prompt = true;
    r->add_special_tokens = ep == OAI_ENDPOINT_COMPLETIONS;
    // The same defaults as atomc_sampling_params_init, set here so this pure parser has no link
    // dependency on the engine (tests/test_server_request.c checks they agree).
    r->params.temperature = 1.0f;
    r->params.top_p = 1.0f;
    r->params.repetition_penalty = 1.0f;
    r->params.skip_special_tokens = true;
    r->params.logprobs = -1;
    r->params.prompt_logprobs = -1;
    r->params.max_tokens = ep == OAI_ENDPOINT_COMPLETIONS ? 16 : -1;
    json_t *root = oai_body_parse(body, len, e);
    if (!root) return -1;
    struct parse_ctx pc = {.best_of = 0, .top_logprobs = -1};
    bool have_max_completion_tokens = false;
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, key, v) {
        const struct field *f = field_find(key, ep);
        if (!f) {
            rc = oai_error_set(e, 400, key, "unsupported field '%s' for %s", key,
                               ep == OAI_ENDPOINT_CHAT ? "/v1/chat/completions" : "/v1/completions");
            break;
        }
        if (json_is_null(v)) continue;
        if (f->id == F_MAX_TOKENS && have_max_completion_tokens) continue;
        if (f->id == F_MAX_COMPLETION_TOKENS) have_max_completion_tokens = true;
        if ((rc = parse_field(f, key, v, lim, r, &pc, e))) break;
    }
    json_decref(root);
    if (rc) return -1;

    // Cross-field rules.
    if (ep == OAI_ENDPOINT_COMPLETIONS && r->n_prompts == 0) return oai_error_set(e, 400, "prompt", "'prompt' is required");
    if (ep == OAI_ENDPOINT_CHAT && !r->messages) return oai_error_set(e, 400, "messages", "'messages' is required");
    if (pc.best_of > 0 && pc.best_of != r->n)
        return oai_error_set(e, 400, "best_of", "'best_of' other than n is not supported (got best_of=%lld, n=%d)", pc.best_of, r->n);
    if (ep == OAI_ENDPOINT_CHAT) {
        if (pc.top_logprobs > 0 && r->logprobs < 0)
            return oai_error_set(e, 400, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
        if (r->logprobs == -2) r->logprobs = -1;
        if (r->logprobs >= 0 && pc.top_logprobs >= 0) r->logprobs = (int)pc.top_logprobs;
        if (r->continue_final_message && r->add_generation_prompt)
            return oai_error_set(e, 400, "continue_final_message",
                                 "'continue_final_message' and 'add_generation_prompt' cannot both be true");
        if (r->continue_final_message) {
            json_t *last = json_array_get(r->messages, json_array_size(r->messages) - 1);
            const char *role = json_string_value(json_object_get(last, "role"));
            if (!role || strcmp(role, "assistant"))
                return oai_error_set(e, 400, "continue_final_message",
                                     "'continue_final_message' requires the last message to be from the assistant");
        }
    }
    if (r->params.max_tokens == 0 && !(r->echo && ep == OAI_ENDPOINT_COMPLETIONS))
        return oai_error_set(e, 400, "max_tokens", "'max_tokens' must be at least 1 (0 is allowed only with echo, for prompt logprobs)");
    if (r->max_tokens_set && r->params.min_tokens > r->params.max_tokens)
        return oai_error_set(e, 400, "min_tokens", "'min_tokens' (%d) must not exceed 'max_tokens' (%d)",
                             r->params.min_tokens, r->params.max_tokens);
    if ((r->include_usage || r->continuous_usage_stats) && !r->stream)
        return oai_error_set(e, 400, "stream_options", "'stream_options' is only allowed when 'stream' is true");
    if (r->n_prompts * (long long)r->n > lim->max_n * 4LL)
        return oai_error_set(e, 400, "n", "%d prompts x n=%d choices exceeds the limit of %d sequences per request",
                             r->n_prompts, r->n, lim->max_n * 4);
    if ((r->kv_do_remote_decode || r->kv_do_remote_prefill) && (ep == OAI_ENDPOINT_CHAT ? 1 : r->n_prompts) * r->n != 1)
        return oai_error_set(e, 400, "kv_transfer_params",
                             "'kv_transfer_params' with a remote prefill or decode need exactly one prompt and n = 1");
    r->params.logprobs = r->logprobs;
    r->params.prompt_logprobs = (r->echo && r->logprobs >= 0) ? r->logprobs : -1;
    r->params.stop = (const char *const *)r->stop;
    r->params.n_stop = r->n_stop;
    r->params.stop_token_ids = r->stop_token_ids;
    r->params.n_stop_token_ids = r->n_stop_token_ids;
    if (r->tool_choice_required && r->grammar_kind != ATOMC_GRAMMAR_NONE)
        return oai_error_set(e, 400, "tool_choice",
                             "'tool_choice' \"required\" or a named function cannot be combined with '%s'", r->grammar_param);
    r->params.grammar_kind = r->grammar_kind;
    r->params.grammar = r->grammar;
    r->params.grammar_start_token = -1;
    return 0;
}

void oai_request_free(struct oai_request *r) {
    free(r->model);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    json_decref(r->messages);
    json_decref(r->tools);
    json_decref(r->chat_template_kwargs);
    free(r->tool_choice_name);
    free(r->grammar);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->stop_token_ids);
    free(r->kv_transfer_id);
    free(r->kv_remote_engine_id);
    memset(r, 0, sizeof *r);
}

int oai_tokenize_parse(const char *body, size_t len, struct oai_tokenize_request *r, struct oai_error *e) {
    memset(r, 0, sizeof *r);
    r->add_special_tokens = true;
    r->add_generation_prompt = true;
    bool add_special_set = false;
    json_t *root = oai_body_parse(body, len, e);
    if (!root) return -1;
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, key, v) {
        if (json_is_null(v)) continue;
        if (!strcmp(key, "model")) rc = read_string(v, key, &r->model, NULL, e);
        else if (!strcmp(key, "prompt")) rc = read_string(v, key, &r->prompt, &r->prompt_len, e);
        else if (!strcmp(key, "messages")) {
            if (!json_is_array(v)) rc = oai_error_set(e, 400, key, "'messages' must be a list of message objects");
            else {
                r->messages = json_deep_copy(v);
                rc = oai_messages_validate(r->messages, e);
            }
        } else if (!strcmp(key, "add_special_tokens")) {
            rc = read_bool(v, key, &r->add_special_tokens, e);
            add_special_set = true;
        } else if (!strcmp(key, "add_generation_prompt")) rc = read_bool(v, key, &r->add_generation_prompt, e);
        else if (!strcmp(key, "continue_final_message")) rc = read_bool(v, key, &r->continue_final_message, e);
        else if (!strcmp(key, "return_token_strs")) rc = read_bool(v, key, &r->return_token_strs, e);
        else if (!strcmp(key, "chat_template_kwargs")) {
            if (!json_is_object(v)) rc = oai_error_set(e, 400, key, "'chat_template_kwargs' must be an object");
            else r->chat_template_kwargs = json_deep_copy(v);
        } else if (!strcmp(key, "tools")) {
            if (!json_is_array(v)) rc = oai_error_set(e, 400, key, "'tools' must be a list");
            for (size_t i = 0; !rc && i < json_array_size(v); i++)
                if (!json_is_object(json_array_get(v, i))) rc = oai_error_set(e, 400, key, "tools[%zu] must be an object", i);
            if (!rc) r->tools = json_deep_copy(v);
        } else rc = oai_error_set(e, 400, key, "unsupported field '%s' for /tokenize", key);
        if (rc) break;
    }
    json_decref(root);
    if (rc) return -1;
    if (!r->prompt == !r->messages)
        return oai_error_set(e, 400, r->prompt ? "messages" : "prompt", "exactly one of 'prompt' and 'messages' is required");
    if (r->messages && !add_special_set) r->add_special_tokens = false; // the template already adds BOS
    if (r->continue_final_message && r->add_generation_prompt && r->messages)
        return oai_error_set(e, 400, "continue_final_message", "'continue_final_message' and 'add_generation_prompt' cannot both be true");
    if (r->continue_final_message && r->messages) { // as chat completions: only an assistant message continues
        json_t *last = json_array_get(r->messages, json_array_size(r->messages) - 1);
        const char *role = json_string_value(json_object_get(last, "role"));
        if (!role || strcmp(role, "assistant"))
            return oai_error_set(e, 400, "continue_final_message",
                                 "'continue_final_message' requires the last message to be from the assistant");
    }
    return 0;
}

void oai_tokenize_free(struct oai_tokenize_request *r) {
    free(r->model);
    free(r->prompt);
    json_decref(r->messages);
    json_decref(r->tools);
    json_decref(r->chat_template_kwargs);
    memset(r, 0, sizeof *r);
}

int oai_detokenize_parse(const char *body, size_t len, const struct oai_limits *lim,
                         struct oai_detokenize_request *r, struct oai_error *e) {
    memset(r, 0, sizeof *r);
    json_t *root = oai_body_parse(body, len, e);
    if (!root) return -1;
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, key, v) {
        if (json_is_null(v)) continue;
        if (!strcmp(key, "model")) rc = read_string(v, key, &r->model, NULL, e);
        else if (!strcmp(key, "tokens")) rc = read_token_ids(v, key, lim, 1 << 24, &r->tokens, &r->n_tokens, e);
        else rc = oai_error_set(e, 400, key, "unsupported field '%s' for /detokenize", key);
        if (rc) break;
    }
    json_decref(root);
    if (rc) return -1;
    if (!r->tokens) return oai_error_set(e, 400, "tokens", "'tokens' is required");
    return 0;
}

void oai_detokenize_free(struct oai_detokenize_request *r) {
    free(r->model);
    free(r->tokens);
    memset(r, 0, sizeof *r);
}
