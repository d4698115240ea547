// OpenAI response JSON builders (see openai_response.h).
#include "server/openai_response.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/check.h"

char *oai_utf8_sanitize(const char *s, size_t len, size_t *out_len) {
    char *out = xmalloc(3 * len + 1); // each invalid byte becomes 3 bytes (U+FFFD)
    size_t o = 0, i = 0;
    while (i < len) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &cp);
        if (n > 0 && cp != 0) {
            memcpy(out + o, s + i, (size_t)n);
            o += (size_t)n;
            i += (size_t)n;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i += 1;
        }
    }
    out[o] = '\0';
    if (out_len) *out_len = o;
    return out;
}

bool oai_utf8_valid(const char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &cp);
        if (n <= 0 || cp == 0) return false;
        i += (size_t)n;
    }
    return true;
}

size_t oai_utf8_length(const char *s, size_t len) {
    size_t count = 0, i = 0;
    while (i < len) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &cp);
        i += n > 0 ? (size_t)n : 1;
        count++;
    }
    return count;
}

char *oai_token_string(const struct oai_token_text *tt, int32_t id) {
    if (tt->as_ids) {
        char buf[32];
        snprintf(buf, sizeof buf, "token_id:%d", (int)id);
        return xstrdup(buf);
    }
    size_t len = 0;
    const char *b = tt->token_bytes ? tt->token_bytes(tt->ctx, id, &len) : NULL;
    if (!b) return xstrdup("");
    return oai_utf8_sanitize(b, len, NULL);
}

static json_t *token_bytes_json(const struct oai_token_text *tt, int32_t id) {
    json_t *a = json_array();
    size_t len = 0;
    const char *b = tt->token_bytes ? tt->token_bytes(tt->ctx, id, &len) : NULL;
    for (size_t i = 0; b && i < len; i++) json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

// JSON has no -Infinity: a logprob of -inf (probability 0) is reported as a very large negative number.
static json_t *logprob_json(float lp) {
    if (isnan(lp)) return json_null();
    if (isinf(lp)) return json_real(lp < 0 ? -9999.0 : 0.0);
    return json_real(lp);
}

json_t *oai_completion_logprobs_new(void) {
    json_t *o = json_object();
    json_object_set_new(o, "tokens", json_array());
    json_object_set_new(o, "token_logprobs", json_array());
    json_object_set_new(o, "top_logprobs", json_array());
    json_object_set_new(o, "text_offset", json_array());
    return o;
}

void oai_completion_logprobs_append(json_t *obj, const struct oai_token_text *tt, int32_t token,
                                    const atomc_token_logprobs *lp, int top_n, size_t *text_offset) {
    char *s = oai_token_string(tt, token);
    json_array_append_new(json_object_get(obj, "tokens"), json_string(s));
    json_array_append_new(json_object_get(obj, "text_offset"), json_integer((json_int_t)*text_offset));
    *text_offset += oai_utf8_length(s, strlen(s));
    if (!lp || isnan(lp->logprob)) {
        json_array_append_new(json_object_get(obj, "token_logprobs"), json_null());
        json_array_append_new(json_object_get(obj, "top_logprobs"), json_null());
        free(s);
        return;
    }
    json_array_append_new(json_object_get(obj, "token_logprobs"), logprob_json(lp->logprob));
    json_t *top = json_object();
    json_object_set_new(top, s, logprob_json(lp->logprob));
    for (int i = 0; i < lp->n_top && i < top_n; i++) {
        char *ts = oai_token_string(tt, lp->top[i].token);
        if (!json_object_get(top, ts)) json_object_set_new(top, ts, logprob_json(lp->top[i].logprob));
        free(ts);
    }
    json_array_append_new(json_object_get(obj, "top_logprobs"), top);
    free(s);
}

json_t *oai_chat_logprob_entry(const struct oai_token_text *tt, const atomc_token_logprobs *lp, int top_n) {
    json_t *e = json_object();
    char *s = oai_token_string(tt, lp->token);
    json_object_set_new(e, "token", json_string(s));
    free(s);
    json_object_set_new(e, "logprob", logprob_json(lp->logprob));
    json_object_set_new(e, "bytes", token_bytes_json(tt, lp->token));
    json_t *top = json_array();
    for (int i = 0; i < lp->n_top && i < top_n; i++) {
        json_t *t = json_object();
        char *ts = oai_token_string(tt, lp->top[i].token);
        json_object_set_new(t, "token", json_string(ts));
        free(ts);
        json_object_set_new(t, "logprob", logprob_json(lp->top[i].logprob));
        json_object_set_new(t, "bytes", token_bytes_json(tt, lp->top[i].token));
        json_array_append_new(top, t);
    }
    json_object_set_new(e, "top_logprobs", top);
    return e;
}

json_t *oai_usage_json(long prompt_tokens, long completion_tokens, long cached_tokens) {
    json_t *u = json_object();
    json_object_set_new(u, "prompt_tokens", json_integer(prompt_tokens));
    json_object_set_new(u, "completion_tokens", json_integer(completion_tokens));
    json_object_set_new(u, "total_tokens", json_integer(prompt_tokens + completion_tokens));
    json_t *d = json_object();
    json_object_set_new(d, "cached_tokens", json_integer(cached_tokens));
    json_object_set_new(u, "prompt_tokens_details", d);
    return u;
}

json_t *oai_finish_reason_json(atomc_finish_reason r) {
    switch (r) {
    case ATOMC_FINISH_NONE: return json_null();
    case ATOMC_FINISH_STOP: return json_string("stop");
    case ATOMC_FINISH_LENGTH: return json_string("length");
    case ATOMC_FINISH_ABORT: return json_string("abort");
    case ATOMC_FINISH_ERROR: return json_string("error");
    }
    return json_null();
}
