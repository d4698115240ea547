// Anthropic Messages API on top of the chat-completions path (see anthropic.h for the contract).
#include "server/anthropic.h"

#include <math.h>
#include <string.h>

#include "common/check.h"
#include "server/server_internal.h"

// ---------------------------------------------------------------- errors

static const char *error_type(int status) {
    switch (status) {
    case 400:
        return "invalid_request_error";
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 413:
        return "request_too_large";
    case 429:
        return "rate_limit_error";
    case 503:
    case 529:
        return "overloaded_error";
    default:
        return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

char *anthropic_error_json(const struct oai_error *e) {
    json_t *err = json_object(), *root = json_object();
    json_object_set_new(err, "type", json_string(error_type(e->http_status)));
    json_object_set_new(err, "message", json_string(e->message));
    json_object_set_new(root, "type", json_string("error"));
    json_object_set_new(root, "error", err);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    CHECK(s);
    return s;
}

// ---------------------------------------------------------------- request translation

static int bad(struct oai_error *e, const char *param, const char *msg, const char *a) {
    return oai_error_set(e, 400, param, msg, a);
}

// A text-block list or a string -> one string (blocks joined with "\n"); -1 on a non-text block.
static int text_of(json_t *v, const char *param, const char *where, char **out, struct oai_error *e) {
    if (json_is_string(v)) {
        *out = xstrdup(json_string_value(v));
        return 0;
    }
    if (!json_is_array(v)) return bad(e, param, "%s must be a string or a list of text blocks", where);
    size_t i, n = 0;
    json_t *b;
    json_array_foreach(v, i, b) {
        json_t *t = json_object_get(b, "text");
        if (!json_is_object(b) || !json_is_string(json_object_get(b, "type")) ||
            strcmp(json_string_value(json_object_get(b, "type")), "text") || !json_is_string(t))
            return bad(e, param, "%s: only text blocks ({\"type\": \"text\", \"text\": ...}) are supported here",
                       where);
        n += json_string_length(t) + 1;
    }
    char *s = xmalloc(n + 1), *p = s;
    json_array_foreach(v, i, b) {
        json_t *t = json_object_get(b, "text");
        if (i) *p++ = '\n';
        memcpy(p, json_string_value(t), json_string_length(t));
        p += json_string_length(t);
    }
    *p = '\0';
    *out = s;
    return 0;
}

// Appends the OpenAI messages for one Anthropic message.
static int message_translate(json_t *m, size_t idx, json_t *out, struct oai_error *e) {
    char where[64];
    snprintf(where, sizeof where, "messages[%zu]", idx);
    if (!json_is_object(m)) return bad(e, "messages", "%s must be an object", where);
    const char *role = json_string_value(json_object_get(m, "role"));
    if (!role || (strcmp(role, "user") && strcmp(role, "assistant")))
        return bad(e, "messages", "%s.role must be \"user\" or \"assistant\"", where);
    bool user = !strcmp(role, "user");
    json_t *content = json_object_get(m, "content");
    if (json_is_string(content)) {
        json_t *o = json_object();
        json_object_set_new(o, "role", json_string(role));
        json_object_set(o, "content", content);
        json_array_append_new(out, o);
        return 0;
    }
    if (!json_is_array(content))
        return bad(e, "messages", "%s.content must be a string or a list of content blocks", where);
    // Text blocks joined; tool_use -> tool_calls (assistant); tool_result -> tool messages (user),
    // which come first (they answer the previous assistant turn).
    json_t *calls = json_array(), *tool_msgs = json_array();
    size_t tl = 0, i;
    json_t *b;
    char *text = xstrdup("");
    int rc = 0;
    json_array_foreach(content, i, b) {
        const char *type = json_is_object(b) ? json_string_value(json_object_get(b, "type")) : NULL;
        char bw[96];
        snprintf(bw, sizeof bw, "%s.content[%zu]", where, i);
        if (!type) {
            rc = bad(e, "messages", "%s must be a content block with a \"type\"", bw);
            break;
        }
        if (!strcmp(type, "text")) {
            json_t *t = json_object_get(b, "text");
            if (!json_is_string(t)) {
                rc = bad(e, "messages", "%s.text must be a string", bw);
                break;
            }
            size_t n = json_string_length(t);
            text = xrealloc(text, tl + n + 2);
            if (tl) text[tl++] = '\n';
            memcpy(text + tl, json_string_value(t), n);
            tl += n;
            text[tl] = '\0';
        } else if (!strcmp(type, "tool_use")) {
            json_t *id = json_object_get(b, "id"), *name = json_object_get(b, "name"),
                   *input = json_object_get(b, "input");
            if (user) {
                rc = bad(e, "messages", "%s: tool_use blocks belong to assistant messages", bw);
                break;
            }
            if (!json_is_string(id) || !json_is_string(name) || !json_is_object(input)) {
                rc = bad(e, "messages", "%s: a tool_use block needs string \"id\" and \"name\" and an object \"input\"",
                         bw);
                break;
            }
            char *args = json_dumps(input, JSON_COMPACT);
            json_t *fn = json_object(), *call = json_object();
            json_object_set(fn, "name", name);
            json_object_set_new(fn, "arguments", json_string(args));
            free(args);
            json_object_set(call, "id", id);
            json_object_set_new(call, "type", json_string("function"));
            json_object_set_new(call, "function", fn);
            json_array_append_new(calls, call);
        } else if (!strcmp(type, "tool_result")) {
            json_t *id = json_object_get(b, "tool_use_id"), *c = json_object_get(b, "content");
            if (!user) {
                rc = bad(e, "messages", "%s: tool_result blocks belong to user messages", bw);
                break;
            }
            if (!json_is_string(id)) {
                rc = bad(e, "messages", "%s: a tool_result block needs a string \"tool_use_id\"", bw);
                break;
            }
            char *ctext = NULL;
            if (c && !json_is_null(c)) {
                char cw[128];
                snprintf(cw, sizeof cw, "%s.content", bw);
                if (text_of(c, "messages", cw, &ctext, e)) {
                    rc = -1;
                    break;
                }
            }
            json_t *is_error = json_object_get(b, "is_error");
            if (is_error && !json_is_boolean(is_error)) {
                free(ctext);
                rc = bad(e, "messages", "%s.is_error must be a boolean", bw);
                break;
            }
            json_t *o = json_object();
            json_object_set_new(o, "role", json_string("tool"));
            json_object_set(o, "tool_call_id", id);
            json_object_set_new(o, "content", json_string(ctext ? ctext : ""));
            free(ctext);
            json_array_append_new(tool_msgs, o);
        } else if (!strcmp(type, "thinking") || !strcmp(type, "redacted_thinking")) {
            if (user) {
                rc = bad(e, "messages", "%s: thinking blocks belong to assistant messages", bw);
                break;
            }
            // Earlier reasoning is not shown to the model again (chat templates drop it too).
        } else {
            rc = oai_error_set(e, 400, "messages",
                               "%s: content blocks of type '%s' are not supported (text, tool_use, "
                               "tool_result and thinking are)",
                               bw, type);
            break;
        }
    }
    if (!rc) {
        json_array_extend(out, tool_msgs);
        if (tl || json_array_size(calls) || !json_array_size(tool_msgs)) {
            json_t *o = json_object();
            json_object_set_new(o, "role", json_string(role));
            json_object_set_new(o, "content", json_string(text));
            if (json_array_size(calls)) json_object_set(o, "tool_calls", calls);
            json_array_append_new(out, o);
        }
    }
    free(text);
    json_decref(calls);
    json_decref(tool_msgs);
    return rc;
}

// Fields read below, then fields accepted and ignored (they change nothing here: caching, routing,
// account and diagnostic hints of the hosted API).
static const char *const KNOWN_FIELDS[] = {
    "model",           "messages",     "max_tokens",   "system",        "stop_sequences", "temperature",
    "top_p",           "top_k",        "stream",       "tools",         "tool_choice",    "thinking",
    "output_config",   "metadata",     "service_tier", "cache_control", "inference_geo",  "speed",
    "user_profile_id", "workspace_id", "diagnostics",  "container"};

json_t *anthropic_to_openai(const char *body, size_t len, bool count_only, struct oai_error *e) {
    json_t *in = oai_body_parse(body, len, e);
    if (!in) return NULL;
    json_t *out = json_object(), *msgs = json_array();
    json_object_set_new(out, "messages", msgs);
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach(in, key, v) {
        bool known = false;
        for (size_t i = 0; i < sizeof KNOWN_FIELDS / sizeof KNOWN_FIELDS[0]; i++)
            known |= !strcmp(key, KNOWN_FIELDS[i]);
        if (!known) {
            rc = oai_error_set(e, 400, key, "%s: Extra inputs are not permitted (unknown field)", key);
            goto done;
        }
    }
    v = json_object_get(in, "model");
    if (!json_is_string(v)) {
        rc = bad(e, "model", "%s: a string is required", "model");
        goto done;
    }
    json_object_set(out, "model", v);
    v = json_object_get(in, "max_tokens");
    if (!count_only || v) {
        if (!json_is_integer(v) || json_integer_value(v) < 1) {
            rc = bad(e, "max_tokens", "%s: a positive integer is required", "max_tokens");
            goto done;
        }
        json_object_set(out, "max_tokens", v);
    }
    v = json_object_get(in, "system");
    if (v && !json_is_null(v)) {
        char *sys = NULL;
        if (text_of(v, "system", "system", &sys, e)) {
            rc = -1;
            goto done;
        }
        json_t *o = json_object();
        json_object_set_new(o, "role", json_string("system"));
        json_object_set_new(o, "content", json_string(sys));
        free(sys);
        json_array_append_new(msgs, o);
    }
    v = json_object_get(in, "messages");
    if (!json_is_array(v) || json_array_size(v) == 0) {
        rc = bad(e, "messages", "%s: a non-empty list of messages is required", "messages");
        goto done;
    }
    size_t i;
    json_t *m;
    json_array_foreach(v, i, m) if ((rc = message_translate(m, i, msgs, e))) goto done;
    v = json_object_get(in, "stop_sequences");
    if (v && !json_is_null(v)) {
        if (!json_is_array(v)) {
            rc = bad(e, "stop_sequences", "%s must be a list of strings", "stop_sequences");
            goto done;
        }
        json_object_set(out, "stop", v); // element checks: the chat path's (400 names 'stop')
    }
    static const char *const num[] = {"temperature", "top_p"};
    for (int k = 0; k < 2; k++) {
        v = json_object_get(in, num[k]);
        if (v && !json_is_null(v)) {
            if (!json_is_number(v)) {
                rc = bad(e, num[k], "%s must be a number", num[k]);
                goto done;
            }
            double x = json_number_value(v);
            if (!(x >= 0 && x <= 1) || (k == 1 && x == 0)) {
                rc = bad(e, num[k], k ? "%s must be in (0, 1]" : "%s must be between 0 and 1", num[k]);
                goto done;
            }
            json_object_set(out, num[k], v);
        }
    }
    v = json_object_get(in, "top_k");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0) {
            rc = bad(e, "top_k", "%s must be a non-negative integer", "top_k");
            goto done;
        }
        if (json_integer_value(v) > 0) json_object_set(out, "top_k", v);
    }
    v = json_object_get(in, "stream");
    if (v && !json_is_null(v)) {
        if (!json_is_boolean(v)) {
            rc = bad(e, "stream", "%s must be a boolean", "stream");
            goto done;
        }
        if (!count_only) json_object_set(out, "stream", v);
    }
    v = json_object_get(in, "tools");
    if (v && !json_is_null(v)) {
        if (!json_is_array(v)) {
            rc = bad(e, "tools", "%s must be a list", "tools");
            goto done;
        }
        json_t *tools = json_array();
        json_object_set_new(out, "tools", tools);
        json_t *t;
        json_array_foreach(v, i, t) {
            json_t *name = json_object_get(t, "name"), *schema = json_object_get(t, "input_schema");
            const char *type = json_string_value(json_object_get(t, "type"));
            if (type && strcmp(type, "custom")) {
                rc = oai_error_set(e, 400, "tools", "tools[%zu]: server tools of type '%s' are not supported", i, type);
                goto done;
            }
            if (!json_is_string(name) || !json_is_object(schema)) {
                rc = oai_error_set(e, 400, "tools", "tools[%zu] needs a string \"name\" and an object \"input_schema\"",
                                   i);
                goto done;
            }
            json_t *fn = json_object(), *o = json_object();
            json_object_set(fn, "name", name);
            json_t *d = json_object_get(t, "description");
            if (json_is_string(d)) json_object_set(fn, "description", d);
            json_object_set(fn, "parameters", schema);
            json_object_set_new(o, "type", json_string("function"));
            json_object_set_new(o, "function", fn);
            json_array_append_new(tools, o);
        }
    }
    v = json_object_get(in, "tool_choice");
    if (v && !json_is_null(v)) {
        const char *type = json_string_value(json_object_get(v, "type"));
        if (!type) {
            rc = bad(e, "tool_choice", "%s must be an object with a \"type\"", "tool_choice");
            goto done;
        }
        if (!strcmp(type, "auto")) {
            json_object_set_new(out, "tool_choice", json_string("auto"));
        } else if (!strcmp(type, "none")) {
            json_object_set_new(out, "tool_choice", json_string("none"));
        } else if (!strcmp(type, "any")) {
            json_object_set_new(out, "tool_choice", json_string("required"));
        } else if (!strcmp(type, "tool")) {
            json_t *name = json_object_get(v, "name");
            if (!json_is_string(name)) {
                rc = bad(e, "tool_choice", "%s of type \"tool\" needs a \"name\"", "tool_choice");
                goto done;
            }
            json_t *fn = json_object(), *o = json_object();
            json_object_set(fn, "name", name);
            json_object_set_new(o, "type", json_string("function"));
            json_object_set_new(o, "function", fn);
            json_object_set_new(out, "tool_choice", o);
        } else {
            rc =
                oai_error_set(e, 400, "tool_choice", "tool_choice.type '%s' is not one of auto, any, tool, none", type);
            goto done;
        }
    }
    v = json_object_get(in, "thinking");
    if (v && !json_is_null(v)) {
        const char *type = json_string_value(json_object_get(v, "type"));
        if (!type || (strcmp(type, "enabled") && strcmp(type, "disabled") && strcmp(type, "adaptive"))) {
            rc = bad(e, "thinking", "%s.type must be \"enabled\", \"adaptive\" or \"disabled\"", "thinking");
            goto done;
        }
        if (strcmp(type, "adaptive")) { // adaptive: the template's default
            json_t *kw = json_object();
            json_object_set_new(kw, "enable_thinking", json_boolean(!strcmp(type, "enabled")));
            json_object_set_new(out, "chat_template_kwargs", kw);
        }
    }
    v = json_object_get(in, "output_config");
    if (v && !json_is_null(v)) {
        json_t *f = json_object_get(v, "format");
        if (!json_is_object(v) || (f && !json_is_null(f))) {
            rc = bad(e, "output_config", "%s: only \"effort\" is accepted (ignored); \"format\" is not supported",
                     "output_config");
            goto done;
        }
    }
done:
    json_decref(in);
    if (rc) {
        json_decref(out);
        return NULL;
    }
    return out;
}

// ---------------------------------------------------------------- handlers

static struct srv_req *prepare(struct server *s, struct http_req *req, bool count_only) {
    const char *body;
    size_t len;
    http_req_body(req, &body, &len);
    struct oai_error e;
    json_t *o = anthropic_to_openai(body, len, count_only, &e);
    if (!o) {
        server_send_error(s, req, &e);
        return NULL;
    }
    char *txt = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    CHECK(txt);
    struct srv_req *r = count_only ? generate_prepare_count(s, OAI_ENDPOINT_CHAT, txt, strlen(txt), &e)
                                   : generate_prepare(s, OAI_ENDPOINT_CHAT, txt, strlen(txt), &e);
    free(txt);
    if (!r) {
        server_send_error(s, req, &e);
        return NULL;
    }
    r->anthropic = true;
    return r;
}

void anthropic_handle_messages(struct server *s, struct http_req *req) {
    struct srv_req *r = prepare(s, req, false);
    if (r) generate_submit(s, req, OAI_ENDPOINT_CHAT, r);
}

void anthropic_handle_count_tokens(struct server *s, struct http_req *req) {
    struct srv_req *r = prepare(s, req, true);
    if (!r) return;
    json_t *o = json_object();
    json_object_set_new(o, "input_tokens", json_integer(r->prompts[0].n_ids));
    srv_req_unref(r);
    server_send_json(s, req, 200, o);
}

// ---------------------------------------------------------------- responses

static json_t *usage_json(struct srv_req *r, struct srv_choice *c) {
    json_t *u = json_object();
    json_object_set_new(u, "input_tokens", json_integer(c->prompt_tokens ? c->prompt_tokens : r->prompts[0].n_ids));
    json_object_set_new(u, "output_tokens", json_integer(c->completion_tokens));
    json_object_set_new(u, "cache_read_input_tokens", json_integer(c->cached_tokens));
    return u;
}

static json_t *stop_reason(struct srv_choice *c, json_t **sequence) {
    *sequence = json_null();
    switch (c->finish) {
    case ATOMC_FINISH_LENGTH:
        return json_string("max_tokens");
    case ATOMC_FINISH_STOP:
        if (c->stop_str) {
            json_decref(*sequence);
            *sequence = json_string(c->stop_str);
            return json_string("stop_sequence");
        }
        return json_string(c->out.n_calls > 0 ? "tool_use" : "end_turn");
    default:
        return json_string("end_turn");
    }
}

// A tool_use block from a parsed OpenAI call (id replaced by a toolu_ one).
static json_t *tool_use_block(struct srv_req *r, json_t *call, bool for_start) {
    json_t *fn = json_object_get(call, "function");
    const char *args = json_string_value(json_object_get(fn, "arguments"));
    json_t *input = args ? json_loads(args, JSON_DECODE_ANY, NULL) : NULL;
    if (!json_is_object(input)) { // the model wrote arguments that are not an object: keep them visible
        json_decref(input);
        input = json_object();
        if (args && *args) json_object_set_new(input, "_raw", json_string(args));
    }
    char id[64];
    generate_id(r->srv, "toolu_", id, sizeof id);
    json_t *b = json_object();
    json_object_set_new(b, "type", json_string("tool_use"));
    json_object_set_new(b, "id", json_string(id));
    json_object_set(b, "name", json_object_get(fn, "name"));
    json_object_set_new(b, "input", for_start ? json_object() : input);
    if (for_start) json_decref(input);
    return b;
}

json_t *anthropic_final_body(struct srv_req *r, int *code) {
    struct srv_choice *c = &r->choices[0];
    *code = 200;
    if (c->finish == ATOMC_FINISH_ERROR) {
        struct oai_error e;
        oai_error_set(&e, 500, NULL, "generation failed: %s", c->error ? c->error : "engine error");
        char *s = anthropic_error_json(&e);
        json_t *o = json_loads(s, 0, NULL);
        free(s);
        *code = 500;
        return o;
    }
    struct tool_text reasoning = {0}, content = {0};
    json_t *calls = json_array();
    if (c->parse_on) {
        chat_output_feed(&c->out, c->text ? c->text : "", c->text_len, &reasoning, &content, calls);
        chat_output_finish(&c->out, &reasoning, &content, calls);
    } else {
        tool_text_add(&content, c->text ? c->text : "", c->text_len);
    }
    json_t *blocks = json_array();
    if (reasoning.len) {
        json_t *b = json_object();
        json_object_set_new(b, "type", json_string("thinking"));
        json_object_set_new(b, "thinking", json_stringn(reasoning.p, reasoning.len));
        json_object_set_new(b, "signature", json_string(""));
        json_array_append_new(blocks, b);
    }
    size_t b0 = 0, e0 = content.len;
    if (json_array_size(calls) || reasoning.len) { // whitespace around calls / after reasoning is no text
        while (b0 < e0 && strchr(" \t\r\n", content.p[b0]))
            b0++;
        while (e0 > b0 && strchr(" \t\r\n", content.p[e0 - 1]))
            e0--;
    }
    if (e0 > b0 || (!json_array_size(calls) && !reasoning.len)) {
        json_t *b = json_object();
        json_object_set_new(b, "type", json_string("text"));
        json_object_set_new(b, "text", json_stringn(content.p ? content.p + b0 : "", e0 - b0));
        json_array_append_new(blocks, b);
    }
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) json_array_append_new(blocks, tool_use_block(r, call, false));
    json_decref(calls);
    tool_text_free(&reasoning);
    tool_text_free(&content);
    json_t *o = json_object(), *seq;
    json_object_set_new(o, "id", json_string(r->id));
    json_object_set_new(o, "type", json_string("message"));
    json_object_set_new(o, "role", json_string("assistant"));
    json_object_set_new(o, "model", json_string(r->model_name));
    json_object_set_new(o, "content", blocks);
    json_object_set_new(o, "stop_reason", stop_reason(c, &seq));
    json_object_set_new(o, "stop_sequence", seq);
    json_object_set_new(o, "usage", usage_json(r, c));
    return o;
}

// Streaming: blocks open and close as the kind of output changes (thinking, text, tool_use).
enum { BLOCK_NONE = 0, BLOCK_TEXT, BLOCK_THINKING };

static json_t *anth_event(const char *type) {
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string(type));
    return o;
}

static void block_close(struct srv_req *r, struct srv_choice *c) {
    if (c->a_open == BLOCK_NONE) return;
    json_t *o = anth_event("content_block_stop");
    json_object_set_new(o, "index", json_integer(c->a_index));
    generate_sse_event(r, "content_block_stop", o);
    c->a_open = BLOCK_NONE;
    c->a_index++;
}

static void block_text(struct srv_req *r, struct srv_choice *c, int kind, const char *p, size_t n) {
    if (!n) return;
    bool thinking = kind == BLOCK_THINKING;
    if (c->a_open != kind) {
        block_close(r, c);
        json_t *o = anth_event("content_block_start"), *b = json_object();
        json_object_set_new(o, "index", json_integer(c->a_index));
        json_object_set_new(b, "type", json_string(thinking ? "thinking" : "text"));
        json_object_set_new(b, thinking ? "thinking" : "text", json_string(""));
        if (thinking) json_object_set_new(b, "signature", json_string(""));
        json_object_set_new(o, "content_block", b);
        generate_sse_event(r, "content_block_start", o);
        c->a_open = kind;
    }
    json_t *o = anth_event("content_block_delta"), *d = json_object();
    json_object_set_new(o, "index", json_integer(c->a_index));
    json_object_set_new(d, "type", json_string(thinking ? "thinking_delta" : "text_delta"));
    json_object_set_new(d, thinking ? "thinking" : "text", json_stringn(p, n));
    json_object_set_new(o, "delta", d);
    generate_sse_event(r, "content_block_delta", o);
}

static void block_tool(struct srv_req *r, struct srv_choice *c, json_t *call) {
    block_close(r, c);
    json_t *o = anth_event("content_block_start");
    json_object_set_new(o, "index", json_integer(c->a_index));
    json_object_set_new(o, "content_block", tool_use_block(r, call, true));
    generate_sse_event(r, "content_block_start", o);
    const char *args = json_string_value(json_object_get(json_object_get(call, "function"), "arguments"));
    json_t *input = args ? json_loads(args, JSON_DECODE_ANY, NULL) : NULL;
    char *compact = json_is_object(input) ? json_dumps(input, JSON_COMPACT) : NULL;
    json_decref(input);
    o = anth_event("content_block_delta");
    json_t *d = json_object();
    json_object_set_new(o, "index", json_integer(c->a_index));
    json_object_set_new(d, "type", json_string("input_json_delta"));
    json_object_set_new(d, "partial_json", json_string(compact ? compact : "{}"));
    free(compact);
    json_object_set_new(o, "delta", d);
    generate_sse_event(r, "content_block_delta", o);
    c->a_open = BLOCK_TEXT; // any open kind: block_close ends it
    block_close(r, c);
}

void anthropic_stream_start(struct srv_req *r, struct srv_choice *c) {
    json_t *o = anth_event("message_start"), *m = json_object(), *u = json_object();
    json_object_set_new(m, "id", json_string(r->id));
    json_object_set_new(m, "type", json_string("message"));
    json_object_set_new(m, "role", json_string("assistant"));
    json_object_set_new(m, "model", json_string(r->model_name));
    json_object_set_new(m, "content", json_array());
    json_object_set_new(m, "stop_reason", json_null());
    json_object_set_new(m, "stop_sequence", json_null());
    json_object_set_new(u, "input_tokens", json_integer(r->prompts[0].n_ids));
    json_object_set_new(u, "output_tokens", json_integer(0));
    json_object_set_new(m, "usage", u);
    json_object_set_new(o, "message", m);
    generate_sse_event(r, "message_start", o);
}

void anthropic_stream_event(struct srv_req *r, struct srv_choice *c, const struct srv_event *ev) {
    if (ev->finish == ATOMC_FINISH_ERROR) return; // reported by anthropic_stream_end
    struct tool_text reasoning = {0}, content = {0};
    json_t *calls = json_array();
    if (c->parse_on) {
        chat_output_feed(&c->out, ev->text ? ev->text : "", ev->text_len, &reasoning, &content, calls);
        if (ev->finish != ATOMC_FINISH_NONE) chat_output_finish(&c->out, &reasoning, &content, calls);
    } else {
        tool_text_add(&content, ev->text ? ev->text : "", ev->text_len);
    }
    block_text(r, c, BLOCK_THINKING, reasoning.p, reasoning.len);
    // Whitespace right after the reasoning, or before a call, opens no text block: it is held
    // until something else arrives (and dropped if a call or the end comes first).
    tool_text_add(&c->a_pending, content.p, content.len);
    size_t n = c->a_pending.len, ws = 0;
    while (ws < n && strchr(" \t\r\n", c->a_pending.p[ws]))
        ws++;
    if (ws < n || (c->a_open == BLOCK_TEXT && n)) {
        // A text block after the thinking starts at its first non-space byte (as in the whole message).
        size_t skip = c->a_open != BLOCK_TEXT && (c->a_index > 0 || c->a_open == BLOCK_THINKING) ? ws : 0;
        block_text(r, c, BLOCK_TEXT, c->a_pending.p + skip, n - skip);
        c->a_pending.len = 0;
    }
    if (json_array_size(calls)) c->a_pending.len = 0;
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) block_tool(r, c, call);
    json_decref(calls);
    tool_text_free(&reasoning);
    tool_text_free(&content);
}

void anthropic_stream_end(struct srv_req *r) {
    struct srv_choice *c = &r->choices[0];
    if (c->finish == ATOMC_FINISH_ERROR) {
        struct oai_error e;
        oai_error_set(&e, 500, NULL, "generation failed: %s", c->error ? c->error : "engine error");
        char *s = anthropic_error_json(&e);
        generate_sse_event(r, "error", json_loads(s, 0, NULL));
        free(s);
        return;
    }
    if (c->a_index == 0 && c->a_open == BLOCK_NONE) { // nothing at all was generated: one empty text block
        json_t *o = anth_event("content_block_start"), *b = json_object();
        json_object_set_new(o, "index", json_integer(0));
        json_object_set_new(b, "type", json_string("text"));
        json_object_set_new(b, "text", json_string(""));
        json_object_set_new(o, "content_block", b);
        generate_sse_event(r, "content_block_start", o);
        c->a_open = BLOCK_TEXT;
    }
    block_close(r, c);
    json_t *o = anth_event("message_delta"), *d = json_object(), *seq, *u = json_object();
    json_object_set_new(d, "stop_reason", stop_reason(c, &seq));
    json_object_set_new(d, "stop_sequence", seq);
    json_object_set_new(o, "delta", d);
    json_object_set_new(u, "output_tokens", json_integer(c->completion_tokens));
    json_object_set_new(o, "usage", u);
    generate_sse_event(r, "message_delta", o);
    generate_sse_event(r, "message_stop", anth_event("message_stop"));
}
