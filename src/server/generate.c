// /v1/completions and /v1/chat/completions: request -> prompts -> engine requests (one per
// choice) -> outputs queued by the engine thread -> SSE chunks or one JSON body on the loop thread.
//
// Ownership: a srv_req starts with one reference held by the HTTP side. Each submitted engine
// request adds one (dropped by the callback that delivers its final output), and being on the
// server's ready list adds one (dropped after the loop applied the queued outputs). The HTTP
// reference is dropped when every choice is done and the response is finished (or the client
// is gone), so the request is freed exactly when both the network and the engine let go.
#include <event2/buffer.h>
#include <event2/buffer.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <event2/http.h>
#include <math.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "server/anthropic.h"
#include "server/openai_response.h"
#include "server/server_internal.h"

// ---------------------------------------------------------------- engine thread side

static atomc_token_logprobs *copy_logprobs(const atomc_token_logprobs *src, int n) {
    if (!src || n <= 0) return NULL;
    size_t n_top = 0;
    for (int i = 0; i < n; i++) n_top += (size_t)(src[i].n_top > 0 ? src[i].n_top : 0);
    atomc_token_logprobs *dst = xmalloc((size_t)n * sizeof *dst + n_top * sizeof(atomc_top_logprob));
    atomc_top_logprob *tops = (atomc_top_logprob *)(dst + n);
    for (int i = 0; i < n; i++) {
        dst[i] = src[i];
        int k = src[i].n_top > 0 ? src[i].n_top : 0;
        if (k && src[i].top) memcpy(tops, src[i].top, (size_t)k * sizeof *tops);
        else k = 0;
        dst[i].n_top = k;
        dst[i].top = tops;
        tops += k;
    }
    return dst;
}

// atomc_request.on_output: runs on the engine's loop thread. Never blocks on the network:
// copies the delta, queues it on the request and wakes the event loop.
static void on_engine_output(void *user, const atomc_output *o) {
    struct srv_choice *c = user;
    struct srv_req *r = c->req;
    int nt = o->n_new_tokens > 0 ? o->n_new_tokens : 0;
    struct srv_event *ev = xcalloc(1, sizeof *ev + (size_t)nt * sizeof(int32_t));
    ev->choice = (int)(c - r->choices);
    ev->t = time_now_s();
    if (o->text_len) {
        // JSON strings must be valid UTF-8: a delta that is not (which the engine promises never
        // to send) is repaired with U+FFFD rather than dropped.
        if (oai_utf8_valid(o->text, o->text_len)) {
            ev->text = xmalloc(o->text_len + 1);
            memcpy(ev->text, o->text, o->text_len);
            ev->text[o->text_len] = '\0';
            ev->text_len = o->text_len;
        } else {
            ev->text = oai_utf8_sanitize(o->text, o->text_len, &ev->text_len);
        }
    }
    ev->n_tokens = nt;
    if (nt && o->new_tokens) memcpy(ev->tokens, o->new_tokens, (size_t)nt * sizeof(int32_t));
    ev->lps = copy_logprobs(o->logprobs, nt);
    ev->prompt_lps = copy_logprobs(o->prompt_logprobs, o->n_prompt_logprobs);
    ev->n_prompt_lps = ev->prompt_lps ? o->n_prompt_logprobs : 0;
    ev->finish = o->finish_reason;
    ev->stop_str = o->stop_str ? xstrdup(o->stop_str) : NULL;
    ev->stop_token = o->stop_token;
    ev->prompt_tokens = o->prompt_tokens;
    ev->completion_tokens = o->completion_tokens;
    ev->cached_tokens = o->cached_tokens;
    ev->kv_transfer_s = o->kv_transfer_s;
    ev->kv_fallback = o->kv_fallback;
    ev->error = o->error ? xstrdup(o->error) : NULL;
    ev->arrival_time = o->arrival_time;
    ev->first_scheduled_time = o->first_scheduled_time;
    ev->first_token_time = o->first_token_time;
    ev->finish_time = o->finish_time;

    pthread_mutex_lock(&r->mu);
    if (r->ev_tail) r->ev_tail->next = ev;
    else r->ev_head = ev;
    r->ev_tail = ev;
    bool push = !r->queued;
    if (push) {
        r->queued = true;
        atomic_fetch_add(&r->refs, 1); // the ready list's reference
    }
    pthread_mutex_unlock(&r->mu);
    if (push) server_ready_push(r->srv, r);
    if (o->finish_reason != ATOMC_FINISH_NONE) srv_req_unref(r); // this engine request's reference
}

// ---------------------------------------------------------------- helpers (loop thread)

void generate_id(struct server *s, const char *prefix, char *out, size_t len) {
    uint64_t a, b;
    s->rng ^= s->rng << 13, s->rng ^= s->rng >> 7, s->rng ^= s->rng << 17, a = s->rng * 0x2545F4914F6CDD1Dull;
    s->rng ^= s->rng << 13, s->rng ^= s->rng >> 7, s->rng ^= s->rng << 17, b = s->rng * 0x2545F4914F6CDD1Dull;
    snprintf(out, len, "%s%016llx%016llx", prefix, (unsigned long long)a, (unsigned long long)b);
}

static void text_append(struct srv_choice *c, const char *p, size_t n) {
    if (!n) return;
    if (c->text_len + n + 1 > c->text_cap) {
        c->text_cap = (c->text_len + n + 1) * 2;
        c->text = xrealloc(c->text, c->text_cap);
    }
    memcpy(c->text + c->text_len, p, n);
    c->text_len += n;
    c->text[c->text_len] = '\0';
}

static struct oai_token_text token_text(struct srv_req *r) {
    struct oai_token_text tt = {r->srv->eng.token_bytes, r->srv->eng.ctx, r->oai.return_tokens_as_token_ids};
    return tt;
}

static json_t *usage_of(struct srv_req *r) {
    long prompt = 0, completion = 0, cached = 0;
    for (int i = 0; i < r->n_choices; i++) {
        struct srv_choice *c = &r->choices[i];
        completion += c->completion_tokens;
        if (i % r->oai.n == 0) { // prompt tokens count once per prompt, not once per choice
            prompt += c->prompt_tokens ? c->prompt_tokens : r->prompts[c->prompt_idx].n_ids;
            cached += c->cached_tokens;
        }
    }
    return oai_usage_json(prompt, completion, cached);
}

static bool is_chat(struct srv_req *r) { return r->oai.endpoint == OAI_ENDPOINT_CHAT; }

static json_t *chunk_new(struct srv_req *r) {
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(r->id));
    json_object_set_new(o, "object", json_string(is_chat(r) ? "chat.completion.chunk" : "text_completion"));
    json_object_set_new(o, "created", json_integer(r->created));
    json_object_set_new(o, "model", json_string(r->model_name));
    return o;
}

// vLLM's stop_reason: the stop string or the requested stop token id that ended the choice;
// null for EOS (and for every other finish).
static json_t *stop_reason_json(struct srv_req *r, struct srv_choice *c) {
    if (c->finish != ATOMC_FINISH_STOP) return json_null();
    if (c->stop_str) return json_string(c->stop_str);
    for (int i = 0; i < r->oai.n_stop_token_ids; i++)
        if (r->oai.stop_token_ids[i] == c->stop_token) return json_integer(c->stop_token);
    return json_null();
}

static bool http_alive(struct srv_req *r) { return r->http && !r->client_gone && !r->responded; }

static void clear_closecb(struct srv_req *r) {
    if (r->close_watch) {
        event_free(r->close_watch);
        r->close_watch = NULL;
    }
    if (r->http && !r->client_gone) http_req_set_closecb(r->http, NULL, NULL);
}

static void abort_engine(struct srv_req *r) {
    struct server *s = r->srv;
    if (!s->have_engine) return;
    for (int i = 0; i < r->n_choices; i++)
        if (r->choices[i].submitted && !r->choices[i].done) s->eng.abort_request(s->eng.ctx, r->choices[i].engine_id);
}

// Writes one SSE event. A client that stopped reading (output piling up past the limit) is
// disconnected, which aborts its engine requests through the close callback. (Not
// http_alive: finish_response writes the closing events after marking the request responded.)
static void sse_write_event(struct srv_req *r, const char *name, const char *data, size_t len) {
    if (!r->http || r->client_gone) return;
    struct evbuffer *b = evbuffer_new();
    if (name) evbuffer_add_printf(b, "event: %s\n", name);
    evbuffer_add(b, "data: ", 6);
    evbuffer_add(b, data, len);
    evbuffer_add(b, "\n\n", 2);
    http_resp_chunk(r->http, evbuffer_pullup(b, -1), evbuffer_get_length(b));
    evbuffer_free(b);
    if (http_req_output_pending(r->http) > r->srv->opt.max_pending_output_bytes) {
        LOG_WARN("request %s: client is not reading (over %zu bytes pending); disconnecting", r->id,
                 r->srv->opt.max_pending_output_bytes);
        http_req_disconnect(r->http); // fires the close callback
    }
}

static void sse_write(struct srv_req *r, const char *data, size_t len) { sse_write_event(r, NULL, data, len); }

void generate_sse_event(struct srv_req *r, const char *name, json_t *o) {
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    CHECK(s);
    sse_write_event(r, name, s, strlen(s));
    free(s);
}

static void sse_json(struct srv_req *r, json_t *o) {
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    CHECK(s);
    sse_write(r, s, strlen(s));
    free(s);
}

// ---------------------------------------------------------------- applying outputs

// The first streamed chunk of a choice: the assistant role (chat) or the echoed prompt (completions).
static void stream_start_choice(struct srv_req *r, struct srv_choice *c) {
    if (c->started) return;
    c->started = true;
    if (r->anthropic) {
        anthropic_stream_start(r, c);
        return;
    }
    if (is_chat(r)) {
        json_t *o = chunk_new(r), *ch = json_object(), *delta = json_object();
        json_object_set_new(delta, "role", json_string("assistant"));
        json_object_set_new(delta, "content", json_string(""));
        json_object_set_new(ch, "index", json_integer(c->index));
        json_object_set_new(ch, "delta", delta);
        json_object_set_new(ch, "logprobs", json_null());
        json_object_set_new(ch, "finish_reason", json_null());
        json_t *arr = json_array();
        json_array_append_new(arr, ch);
        json_object_set_new(o, "choices", arr);
        sse_json(r, o);
    }
}

// Echo + logprobs: prompt tokens' entries (the engine reports the last n_prompt_lps prompt
// tokens; earlier ones, at least the first, have no logprob).
static void append_prompt_logprobs(struct srv_req *r, struct srv_choice *c, json_t *lp, const struct srv_event *ev) {
    struct srv_prompt *p = &r->prompts[c->prompt_idx];
    struct oai_token_text tt = token_text(r);
    int off = p->n_ids - ev->n_prompt_lps;
    for (int i = 0; i < p->n_ids; i++) {
        const atomc_token_logprobs *x = (i >= off && ev->prompt_lps) ? &ev->prompt_lps[i - off] : NULL;
        oai_completion_logprobs_append(lp, &tt, p->ids[i], x, r->oai.logprobs, &c->text_offset);
    }
}

static json_t *event_logprobs(struct srv_req *r, struct srv_choice *c, const struct srv_event *ev, bool with_prompt) {
    struct oai_token_text tt = token_text(r);
    if (is_chat(r)) {
        json_t *content = json_array();
        for (int i = 0; i < ev->n_tokens; i++) {
            if (ev->lps) json_array_append_new(content, oai_chat_logprob_entry(&tt, &ev->lps[i], r->oai.logprobs));
        }
        json_t *o = json_object();
        json_object_set_new(o, "content", content);
        return o;
    }
    json_t *o = oai_completion_logprobs_new();
    if (with_prompt) append_prompt_logprobs(r, c, o, ev);
    for (int i = 0; i < ev->n_tokens; i++)
        oai_completion_logprobs_append(o, &tt, ev->tokens[i], ev->lps ? &ev->lps[i] : NULL, r->oai.logprobs,
                                       &c->text_offset);
    return o;
}

static void merge_logprobs(json_t *acc, json_t *add) {
    const char *k;
    json_t *v;
    json_object_foreach(add, k, v) json_array_extend(json_object_get(acc, k), v);
    json_decref(add);
}

// Tool calls found by the parser get their OpenAI ids ("chatcmpl-tool-..."), and in a stream
// their position among the choice's calls ("index", first = index of calls[0]).
static void tool_calls_finish(struct srv_req *r, json_t *calls, int first) {
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) {
        char id[64];
        generate_id(r->srv, "chatcmpl-tool-", id, sizeof id);
        if (!json_is_string(json_object_get(call, "id"))) // a format's own ids (Kimi's) are kept
            json_object_set_new(call, "id", json_string(id));
        if (first >= 0) json_object_set_new(call, "index", json_integer(first + (json_int_t)i));
    }
}

// A choice that called tools and then stopped reports "tool_calls" (as OpenAI / vLLM do).
static json_t *choice_finish_json(struct srv_choice *c, atomc_finish_reason f) {
    if (f == ATOMC_FINISH_STOP && c->parse_on && c->out.n_calls > 0) return json_string("tool_calls");
    return oai_finish_reason_json(f);
}

static void stream_event(struct srv_req *r, struct srv_choice *c, const struct srv_event *ev, bool first) {
    stream_start_choice(r, c);
    if (r->anthropic) {
        anthropic_stream_event(r, c, ev);
        return;
    }
    if (ev->finish == ATOMC_FINISH_ERROR) {
        struct oai_error e;
        oai_error_set(&e, 500, NULL, "generation failed: %s", c->error ? c->error : "engine error");
        char *s = oai_error_json(&e);
        sse_write(r, s, strlen(s));
        free(s);
    }
    bool echo = first && !is_chat(r) && r->oai.echo;
    if (!ev->text_len && !ev->n_tokens && ev->finish == ATOMC_FINISH_NONE && !echo) return;
    json_t *o = chunk_new(r), *ch = json_object();
    json_object_set_new(ch, "index", json_integer(c->index));
    if (is_chat(r) && c->parse_on) {
        // Reasoning and content the parsers have released, and the calls completed by this delta.
        struct tool_text reasoning = {0}, content = {0};
        json_t *calls = json_array();
        int before = c->out.n_calls;
        chat_output_feed(&c->out, ev->text ? ev->text : "", ev->text_len, &reasoning, &content, calls);
        if (ev->finish != ATOMC_FINISH_NONE) chat_output_finish(&c->out, &reasoning, &content, calls);
        json_t *delta = json_object();
        if (reasoning.len) {
            json_object_set_new(delta, "reasoning_content", json_stringn(reasoning.p, reasoning.len));
            json_object_set_new(delta, "reasoning", json_stringn(reasoning.p, reasoning.len));
        }
        if (content.len || (ev->finish == ATOMC_FINISH_NONE && !json_array_size(calls) && !reasoning.len))
            json_object_set_new(delta, "content", json_stringn(content.p ? content.p : "", content.len));
        if (json_array_size(calls)) {
            tool_calls_finish(r, calls, before);
            json_object_set_new(delta, "tool_calls", calls);
        } else {
            json_decref(calls);
        }
        tool_text_free(&reasoning);
        tool_text_free(&content);
        json_object_set_new(ch, "delta", delta);
    } else if (is_chat(r)) {
        json_t *delta = json_object();
        if (ev->text_len || ev->finish == ATOMC_FINISH_NONE)
            json_object_set_new(delta, "content", json_stringn(ev->text ? ev->text : "", ev->text_len));
        json_object_set_new(ch, "delta", delta);
    } else {
        struct srv_prompt *p = &r->prompts[c->prompt_idx];
        char *t = NULL;
        size_t tl = 0;
        if (echo) {
            t = xmalloc(p->text_len + ev->text_len + 1);
            memcpy(t, p->text, p->text_len);
            if (ev->text_len) memcpy(t + p->text_len, ev->text, ev->text_len);
            tl = p->text_len + ev->text_len;
        }
        json_object_set_new(ch, "text", echo ? json_stringn(t, tl) : json_stringn(ev->text ? ev->text : "", ev->text_len));
        free(t);
    }
    json_object_set_new(ch, "logprobs",
                        r->oai.logprobs >= 0 && (ev->n_tokens || echo) ? event_logprobs(r, c, ev, echo && r->oai.echo)
                                                                       : json_null());
    json_object_set_new(ch, "finish_reason",
                        choice_finish_json(c, ev->finish == ATOMC_FINISH_NONE ? ATOMC_FINISH_NONE : c->finish));
    if (ev->finish != ATOMC_FINISH_NONE) json_object_set_new(ch, "stop_reason", stop_reason_json(r, c));
    json_t *arr = json_array();
    json_array_append_new(arr, ch);
    json_object_set_new(o, "choices", arr);
    if (r->oai.continuous_usage_stats) json_object_set_new(o, "usage", usage_of(r));
    sse_json(r, o);
}

static void accumulate_event(struct srv_req *r, struct srv_choice *c, const struct srv_event *ev, bool first) {
    if (first && !is_chat(r) && r->oai.echo) {
        struct srv_prompt *p = &r->prompts[c->prompt_idx];
        text_append(c, p->text, p->text_len);
    }
    text_append(c, ev->text, ev->text_len);
    if (r->oai.logprobs >= 0 && (ev->n_tokens || (first && r->oai.echo))) {
        json_t *add = event_logprobs(r, c, ev, first && r->oai.echo && !is_chat(r));
        if (!c->logprobs) c->logprobs = add;
        else merge_logprobs(c->logprobs, add);
    }
}

static void finish_response(struct srv_req *r);

static void apply_event(struct srv_req *r, struct srv_event *ev) {
    struct server *s = r->srv;
    struct srv_choice *c = &r->choices[ev->choice];
    if (c->done) return; // outputs after the final one are a contract violation; ignore them
    bool first = !c->seen;
    c->seen = true;
    if (r->score_only) {
        // Only the prompt (and its logprobs) is wanted; hide the one token generated to get them.
        ev->n_tokens = 0;
        ev->text_len = 0;
        ev->completion_tokens = 0;
        if (ev->finish != ATOMC_FINISH_NONE && ev->finish != ATOMC_FINISH_ABORT && ev->finish != ATOMC_FINISH_ERROR) {
            ev->finish = ATOMC_FINISH_LENGTH;
            free(ev->stop_str);
            ev->stop_str = NULL;
            ev->stop_token = -1;
        }
    }
    if (ev->n_tokens > 0) {
        if (c->t_first == 0) {
            c->t_first = ev->t;
        } else {
            double itl = (ev->t - c->t_last) / ev->n_tokens;
            for (int i = 0; i < ev->n_tokens; i++) histogram_observe(&s->metrics.itl, itl);
        }
        c->t_last = ev->t;
    }
    if (ev->prompt_tokens) c->prompt_tokens = ev->prompt_tokens;
    if (r->score_only) c->completion_tokens = 0;
    else if (ev->completion_tokens > 0) c->completion_tokens = ev->completion_tokens; // cumulative, from the engine
    else c->completion_tokens += ev->n_tokens;
    if (ev->cached_tokens) c->cached_tokens = ev->cached_tokens;
    if (ev->finish != ATOMC_FINISH_NONE) {
        c->finish = ev->finish;
        c->stop_str = ev->stop_str;
        ev->stop_str = NULL;
        c->stop_token = ev->stop_token;
        c->error = ev->error;
        ev->error = NULL;
    }
    if (!r->responded) {
        if (r->oai.stream) {
            if (http_alive(r)) stream_event(r, c, ev, first);
        } else {
            accumulate_event(r, c, ev, first);
        }
    }
    if (ev->finish != ATOMC_FINISH_NONE) {
        c->done = true;
        r->n_done++;
        // Latencies as the client sees them (from the HTTP request's arrival, so parsing, chat
        // rendering and tokenization count); queue time from the engine's own clock.
        double queue = -1;
        if (ev->arrival_time > 0 && ev->first_scheduled_time >= ev->arrival_time)
            queue = ev->first_scheduled_time - ev->arrival_time;
        metrics_record_request(&s->metrics, c->finish, c->prompt_tokens, c->completion_tokens,
                               c->t_first > 0 ? c->t_first - r->t_arrival : -1, ev->t - r->t_arrival, queue);
        if (ev->kv_transfer_s > 0) histogram_observe(&s->metrics.kv_transfer_time, ev->kv_transfer_s);
        if (c->finish == ATOMC_FINISH_ERROR) {
            if (c->error) LOG_WARN("request %s: %s", r->id, c->error);
            s->consecutive_errors++;
            snprintf(s->last_error, sizeof s->last_error, "%s", c->error ? c->error : "engine error");
        } else if (c->finish != ATOMC_FINISH_ABORT) {
            s->consecutive_errors = 0;
        }
    }
}

// The prefill instance's answer to kv_transfer_params.do_remote_decode, in vLLM's shape: what the
// proxy passes on to the decode instance.
static json_t *kv_params_json(struct srv_req *r) {
    const struct server_engine *g = &r->srv->eng;
    json_t *p = json_object();
    json_object_set_new(p, "do_remote_prefill", json_true());
    json_object_set_new(p, "do_remote_decode", json_false());
    json_object_set_new(p, "remote_engine_id", g->kv_engine_id ? json_string(g->kv_engine_id) : json_null());
    json_object_set_new(p, "remote_request_id", json_string(r->oai.kv_transfer_id ? r->oai.kv_transfer_id : r->id));
    json_object_set_new(p, "remote_block_ids", json_null());
    json_object_set_new(p, "remote_host", g->kv_host ? json_string(g->kv_host) : json_null());
    json_object_set_new(p, "remote_port", g->kv_port ? json_integer(g->kv_port) : json_null());
    json_object_set_new(p, "tp_size", json_integer(1));
    return p;
}

static json_t *final_body(struct srv_req *r, int *code) {
    *code = 200;
    for (int i = 0; i < r->n_choices; i++) {
        if (r->choices[i].finish == ATOMC_FINISH_ERROR) {
            struct oai_error e;
            oai_error_set(&e, 500, NULL, "generation failed: %s",
                          r->choices[i].error ? r->choices[i].error : "engine error");
            char *s = oai_error_json(&e);
            json_t *o = json_loads(s, 0, NULL);
            free(s);
            *code = 500;
            return o;
        }
    }
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(r->id));
    json_object_set_new(o, "object", json_string(is_chat(r) ? "chat.completion" : "text_completion"));
    json_object_set_new(o, "created", json_integer(r->created));
    json_object_set_new(o, "model", json_string(r->model_name));
    json_t *choices = json_array();
    for (int i = 0; i < r->n_choices; i++) {
        struct srv_choice *c = &r->choices[i];
        json_t *ch = json_object();
        json_object_set_new(ch, "index", json_integer(c->index));
        if (is_chat(r)) {
            json_t *msg = json_object();
            json_object_set_new(msg, "role", json_string("assistant"));
            json_t *calls = json_array();
            if (c->parse_on) { // the whole text through the same parsers as a stream
                struct tool_text reasoning = {0}, content = {0};
                chat_output_feed(&c->out, c->text ? c->text : "", c->text_len, &reasoning, &content, calls);
                chat_output_finish(&c->out, &reasoning, &content, calls);
                if (json_array_size(calls) || (reasoning.len && !content.len)) {
                    // Around calls, whitespace-only content is no content (null), as vLLM returns it.
                    size_t b = 0, e = content.len;
                    while (b < e && strchr(" \t\r\n", content.p[b])) b++;
                    while (e > b && strchr(" \t\r\n", content.p[e - 1])) e--;
                    json_object_set_new(msg, "content", e > b ? json_stringn(content.p + b, e - b) : json_null());
                    tool_calls_finish(r, calls, -1);
                } else {
                    json_object_set_new(msg, "content", json_stringn(content.p ? content.p : "", content.len));
                }
                if (c->out.reasoning_on) {
                    json_t *rv = reasoning.len ? json_stringn(reasoning.p, reasoning.len) : json_null();
                    json_object_set(msg, "reasoning_content", rv);
                    json_object_set_new(msg, "reasoning", rv);
                }
                tool_text_free(&reasoning);
                tool_text_free(&content);
            } else {
                json_object_set_new(msg, "content", json_stringn(c->text ? c->text : "", c->text_len));
            }
            json_object_set_new(msg, "tool_calls", calls);
            json_object_set_new(ch, "message", msg);
        } else {
            json_object_set_new(ch, "text", json_stringn(c->text ? c->text : "", c->text_len));
        }
        json_t *lp = c->logprobs;
        if (!lp && r->oai.logprobs >= 0) {
            if (is_chat(r)) {
                lp = json_object();
                json_object_set_new(lp, "content", json_array());
            } else {
                lp = oai_completion_logprobs_new();
            }
        }
        c->logprobs = NULL;
        json_object_set_new(ch, "logprobs", lp ? lp : json_null());
        json_object_set_new(ch, "finish_reason", choice_finish_json(c, c->finish));
        json_object_set_new(ch, "stop_reason", stop_reason_json(r, c));
        json_array_append_new(choices, ch);
    }
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage_of(r));
    if (r->oai.kv_do_remote_decode) json_object_set_new(o, "kv_transfer_params", kv_params_json(r));
    return o;
}

// All choices done: send what is left and let go of the HTTP side.
static void finish_response(struct srv_req *r) {
    struct server *s = r->srv;
    if (!r->responded) {
        r->responded = true;
        if (r->http && !r->client_gone) {
            clear_closecb(r);
            // The shutdown drain waits until this response is written out, not just queued.
            s->n_writing++;
            http_req_set_donecb(r->http, server_reply_done, s);
            if (r->oai.stream && r->anthropic) {
                anthropic_stream_end(r);
                if (r->http) http_resp_end(r->http);
            } else if (r->oai.stream) {
                if (r->oai.include_usage) {
                    json_t *o = chunk_new(r);
                    json_object_set_new(o, "choices", json_array());
                    json_object_set_new(o, "usage", usage_of(r));
                    char *txt = json_dumps(o, JSON_COMPACT);
                    json_decref(o);
                    sse_write(r, txt, strlen(txt));
                    free(txt);
                }
                sse_write(r, "[DONE]", 6);
                if (r->http) http_resp_end(r->http);
            } else {
                int code;
                json_t *body = r->anthropic ? anthropic_final_body(r, &code) : final_body(r, &code);
                server_send_json(s, r->http, code, body);
            }
            r->http = NULL;
        }
    }
    if (r->in_active) {
        if (r->prev) r->prev->next = r->next;
        else s->active = r->next;
        if (r->next) r->next->prev = r->prev;
        r->in_active = false;
        s->n_active--;
        srv_req_unref(r); // the HTTP side's reference
    }
}

void generate_process(struct srv_req *r) {
    pthread_mutex_lock(&r->mu);
    struct srv_event *list = r->ev_head;
    r->ev_head = r->ev_tail = NULL;
    r->queued = false;
    pthread_mutex_unlock(&r->mu);
    while (list) {
        struct srv_event *ev = list;
        list = ev->next;
        apply_event(r, ev);
        free(ev->text);
        free(ev->lps);
        free(ev->prompt_lps);
        free(ev->stop_str);
        free(ev->error);
        free(ev);
    }
    if (r->n_done == r->n_choices && r->in_active) finish_response(r);
}

void generate_abort_all(struct server *s) {
    for (struct srv_req *r = s->active; r; r = r->next) abort_engine(r);
}

// Client disconnect (or the server closing connections at exit).
static void on_conn_close(struct http_req *req, void *arg) {
    struct srv_req *r = arg;
    if (r->close_watch) {
        event_free(r->close_watch);
        r->close_watch = NULL;
    }
    r->client_gone = true;
    r->http = NULL; // the transport frees the request right after this callback
    abort_engine(r);
}

// After the client's end of input, after PROBE_FIRST_US and then every PROBE_S: a client that closed its socket altogether
// answered the probe below with a reset; one that only shut down its write side did not.
#define PROBE_S 0.25
#define PROBE_FIRST_US 5000

static void on_probe_check(evutil_socket_t fd_unused, short what, void *arg) {
    struct srv_req *r = arg;
    int fd = r->http ? http_req_fd(r->http) : -1;
    // recv keeps reporting the end of input after a reset: the socket's error and state tell.
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    struct tcp_info ti;
    socklen_t tl = sizeof ti;
    memset(&ti, 0, sizeof ti);
    bool gone = fd < 0 || (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr != 0) ||
                (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0 && ti.tcpi_state == TCP_CLOSE);
    if (gone && r->http && !r->client_gone) {
        event_free(r->close_watch);
        r->close_watch = NULL;
        http_req_disconnect(r->http); // runs on_conn_close, which aborts the engine requests
        return;
    }
    struct timeval tv = {0, (suseconds_t)(PROBE_S * 1e6)};
    event_add(r->close_watch, &tv);
}

// The socket of a waiting non-streaming request became readable. An error (reset) means the
// client left: freeing the connection runs on_conn_close, which aborts the engine requests.
// End of input is not a departure by itself: a client may shut down its write side after the
// request and still read the response (half-close). The two look alike (a FIN) until something is
// sent, so an interim "100 Continue" (which an HTTP/1.1 client must accept before any final
// response, RFC 9110 15.2) is sent as a probe: a closed socket answers it with a reset, noticed by
// on_probe_check. Data (a pipelined next request) is left for libevent and the watch ends.
static void on_client_readable(evutil_socket_t fd, short what, void *arg) {
    struct srv_req *r = arg;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        event_add(r->close_watch, NULL);
        return;
    }
    event_free(r->close_watch);
    r->close_watch = NULL;
    if (n < 0 && r->http && !r->client_gone) {
        http_req_disconnect(r->http);
    } else if (n == 0 && r->http && !r->client_gone) {
        static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
        ssize_t w = send(fd, probe, sizeof probe - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            http_req_disconnect(r->http);
            return;
        }
        r->close_watch = evtimer_new(r->srv->base, on_probe_check, r);
        struct timeval tv = {0, PROBE_FIRST_US}; // the reset of a nearby client is back by then
        event_add(r->close_watch, &tv);
    }
}

// ---------------------------------------------------------------- request intake

int generate_render_chat(struct server *s, json_t *messages, json_t *tools, bool add_gen, bool cont, json_t *kwargs,
                         char **out, struct oai_error *e) {
    struct error err;
    error_clear(&err);
    atomc_status st = s->eng.render_chat(s->eng.ctx, messages, tools, add_gen, cont, kwargs, out, &err);
    if (st == ATOMC_OK) return 0;
    if (st == ATOMC_ERR_UNSUPPORTED)
        return oai_error_set(e, 400, "messages", "this model has no chat template (start the server with --chat-template): %s", err.msg);
    return oai_error_set(e, st == ATOMC_ERR_OUT_OF_MEMORY || st == ATOMC_ERR_INTERNAL ? 500 : 400, "messages",
                         "chat template rendering failed: %s", err.msg);
}

static int status_to_http(atomc_status st) {
    switch (st) {
    case ATOMC_ERR_INVALID_ARGUMENT:
    case ATOMC_ERR_TOO_LONG:
    case ATOMC_ERR_UNSUPPORTED:
    case ATOMC_ERR_NOT_FOUND: return 400;
    case ATOMC_ERR_BUSY: return 503;
    default: return 500;
    }
}

// Tokenizes / copies every prompt; checks lengths against the context.
static int build_prompts(struct server *s, struct srv_req *r, struct oai_error *e) {
    struct oai_request *q = &r->oai;
    struct error err;
    error_clear(&err);
    if (q->endpoint == OAI_ENDPOINT_CHAT) {
        char *text = NULL;
        if (generate_render_chat(s, q->messages, q->tools, q->add_generation_prompt, q->continue_final_message,
                                 q->chat_template_kwargs, &text, e))
            return -1;
        r->prompts = xcalloc(1, sizeof *r->prompts);
        r->n_prompts = 1;
        r->prompts[0].text = text;
        r->prompts[0].text_len = strlen(text);
    } else {
        r->prompts = xcalloc((size_t)q->n_prompts, sizeof *r->prompts);
        r->n_prompts = q->n_prompts;
        for (int i = 0; i < q->n_prompts; i++) {
            struct srv_prompt *p = &r->prompts[i];
            if (q->prompts[i].ids) {
                p->n_ids = q->prompts[i].n_ids;
                p->ids = xmalloc((size_t)(p->n_ids ? p->n_ids : 1) * sizeof(int32_t));
                memcpy(p->ids, q->prompts[i].ids, (size_t)p->n_ids * sizeof(int32_t));
                if (q->echo) {
                    char *raw = NULL;
                    if (s->eng.detokenize(s->eng.ctx, p->ids, p->n_ids, false, &raw, &err) != ATOMC_OK)
                        return oai_error_set(e, 400, "prompt", "cannot decode the prompt's token ids: %s", err.msg);
                    // Ids may end inside a UTF-8 sequence; the echo must still be valid JSON text.
                    p->text = oai_utf8_sanitize(raw, strlen(raw), &p->text_len);
                    free(raw);
                }
            } else {
                p->text = xmalloc(q->prompts[i].text_len + 1);
                memcpy(p->text, q->prompts[i].text, q->prompts[i].text_len + 1);
                p->text_len = q->prompts[i].text_len;
            }
        }
    }
    for (int i = 0; i < r->n_prompts; i++) {
        struct srv_prompt *p = &r->prompts[i];
        if (!p->ids) {
            if (s->eng.tokenize(s->eng.ctx, p->text, p->text_len, q->add_special_tokens, &p->ids, &p->n_ids, &err) !=
                ATOMC_OK)
                return oai_error_set(e, 400, q->endpoint == OAI_ENDPOINT_CHAT ? "messages" : "prompt",
                                     "tokenization failed: %s", err.msg);
        }
        if (p->n_ids == 0) return oai_error_set(e, 400, "prompt", "the prompt is empty (0 tokens)");
        int max_len = s->eng.max_model_len;
        long want = q->max_tokens_set ? q->params.max_tokens : 0;
        if (r->count_only) continue; // a token count answers for any length
        if (p->n_ids + want > max_len || p->n_ids > max_len || (!q->max_tokens_set && p->n_ids >= max_len)) {
            if (q->max_tokens_set)
                oai_error_set(e, 400, q->endpoint == OAI_ENDPOINT_CHAT ? "messages" : "prompt",
                              "This model's maximum context length is %d tokens. However, you requested %ld tokens "
                              "(%d in the %s, %ld in the completion). Please reduce the length of the %s or completion.",
                              max_len, p->n_ids + want, p->n_ids, q->endpoint == OAI_ENDPOINT_CHAT ? "messages" : "prompt",
                              want, q->endpoint == OAI_ENDPOINT_CHAT ? "messages" : "prompt");
            else
                oai_error_set(e, 400, q->endpoint == OAI_ENDPOINT_CHAT ? "messages" : "prompt",
                              "This model's maximum context length is %d tokens. However, your request has %d input "
                              "tokens, which leaves no room for the completion. Please reduce the length of the %s.",
                              max_len, p->n_ids, q->endpoint == OAI_ENDPOINT_CHAT ? "messages" : "prompt");
            snprintf(e->code, sizeof e->code, "context_length_exceeded");
            return -1;
        }
    }
    return 0;
}

static void stream_begin(struct srv_req *r) {
    http_resp_add_header(r->http, "Content-Type", "text/event-stream");
    http_resp_add_header(r->http, "Cache-Control", "no-cache");
    http_resp_add_header(r->http, "Server", "atomc");
    http_resp_start(r->http, 200);
    for (int i = 0; i < r->n_choices; i++) stream_start_choice(r, &r->choices[i]);
}

// tool_choice "required" / a named function: the output is constrained to one call of the
// given tools in the served tool parser's format (openai_request.c oai_tool_call_grammar).
static int force_tool_call(struct server *s, struct oai_request *q, struct oai_error *e) {
    if (!q->tool_choice_required) return 0;
    const char *parser = s->opt.tool_parser == TOOL_PARSER_HERMES        ? "hermes"
                         : s->opt.tool_parser == TOOL_PARSER_LLAMA3_JSON ? "llama3_json"
                                                                         : NULL;
    char *g = oai_tool_call_grammar(q, parser, e);
    if (!g) return -1;
    free(q->grammar);
    q->grammar = g;
    q->grammar_kind = q->params.grammar_kind = ATOMC_GRAMMAR_STRUCTURAL_TAG;
    q->params.grammar = g;
    snprintf(q->grammar_param, sizeof q->grammar_param, "tool_choice");
    return 0;
}

// Structured output under a reasoning parser (as vLLM): the grammar applies from the reasoning's
// end tag on (params.grammar_start_token, engine_grammar.c) unless the prompt already closed the
// reasoning (reasoning_grammar_waits). The tag must be one token of the vocabulary, else a 400.
static int grammar_after_reasoning(struct server *s, struct srv_req *r, struct oai_error *e) {
    struct oai_request *q = &r->oai;
    if (q->endpoint != OAI_ENDPOINT_CHAT || !q->params.grammar || r->n_prompts != 1) return 0;
    const struct srv_prompt *p = &r->prompts[0];
    if (!reasoning_grammar_waits(s->opt.reasoning_parser, p->text, p->text_len)) return 0;
    const char *tag = reasoning_end_tag(s->opt.reasoning_parser);
    int32_t *ids = NULL;
    int n = 0;
    struct error err = {0};
    atomc_status st = s->eng.tokenize(s->eng.ctx, tag, strlen(tag), false, &ids, &n, &err);
    int32_t id = st == ATOMC_OK && n == 1 ? ids[0] : -1;
    free(ids);
    if (id < 0)
        return oai_error_set(e, 400, q->grammar_param,
                             "structured output after reasoning needs the reasoning end tag '%s' to be one token of "
                             "this model's vocabulary (it is %d); serve without --reasoning-parser to constrain "
                             "the whole output",
                             tag, n);
    q->params.grammar_start_token = id;
    return 0;
}

static struct srv_req *prepare_request(struct server *s, enum oai_endpoint ep, const char *body, size_t len,
                                       bool count_only, struct oai_error *e) {
    struct srv_req *r = xcalloc(1, sizeof *r);
    atomic_init(&r->refs, 1);
    pthread_mutex_init(&r->mu, NULL);
    r->srv = s;
    r->count_only = count_only;
    r->t_arrival = time_now_s();
    if (oai_request_parse(ep, body, len, &s->limits, &r->oai, e) || !server_check_model(s, r->oai.model, e) ||
        force_tool_call(s, &r->oai, e) || build_prompts(s, r, e) || grammar_after_reasoning(s, r, e)) {
        srv_req_unref(r);
        return NULL;
    }
    return r;
}

struct srv_req *generate_prepare(struct server *s, enum oai_endpoint ep, const char *body, size_t len,
                                 struct oai_error *e) {
    return prepare_request(s, ep, body, len, false, e);
}

struct srv_req *generate_prepare_count(struct server *s, enum oai_endpoint ep, const char *body, size_t len,
                                       struct oai_error *e) {
    return prepare_request(s, ep, body, len, true, e);
}

void generate_handle(struct server *s, struct http_req *req, enum oai_endpoint ep) {
    const char *body;
    size_t len;
    http_req_body(req, &body, &len);
    struct oai_error e;
    struct srv_req *r = generate_prepare(s, ep, body, len, &e);
    if (!r) {
        server_send_error(s, req, &e);
        return;
    }
    generate_submit(s, req, ep, r);
}

void generate_submit(struct server *s, struct http_req *req, enum oai_endpoint ep, struct srv_req *r) {
    struct oai_request *q = &r->oai;
    generate_id(s, r->anthropic ? "msg_" : ep == OAI_ENDPOINT_CHAT ? "chatcmpl-" : "cmpl-", r->id, sizeof r->id);
    r->created = (long)time_wall_s();
    r->model_name = xstrdup(q->model ? q->model : s->model_names[0]);
    r->n_choices = r->n_prompts * q->n;
    r->choices = xcalloc((size_t)r->n_choices, sizeof *r->choices);
    for (int i = 0; i < r->n_choices; i++) {
        r->choices[i].req = r;
        r->choices[i].index = i;
        r->choices[i].prompt_idx = i / q->n;
        r->choices[i].stop_token = -1;
        if (ep == OAI_ENDPOINT_CHAT) {
            struct srv_prompt *p = &r->prompts[r->choices[i].prompt_idx];
            chat_output_init(&r->choices[i].out, s->opt.reasoning_parser, s->opt.tool_parser,
                             q->tool_choice_none ? NULL : q->tools, p->text, p->text_len);
            r->choices[i].parse_on = chat_output_active(&r->choices[i].out);
        }
    }

    // Submit one engine request per choice.
    atomc_status st = ATOMC_OK;
    char err[ERROR_MSG_MAX] = "";
    for (int i = 0; i < r->n_choices; i++) {
        struct srv_choice *c = &r->choices[i];
        struct srv_prompt *p = &r->prompts[c->prompt_idx];
        atomc_request ar;
        atomc_request_init(&ar);
        ar.prompt_ids = p->ids;
        ar.n_prompt_ids = p->n_ids;
        ar.params = q->params;
        // Parsers whose markers are special tokens (harmony's <|channel|>...) must see them.
        if (c->parse_on && chat_output_needs_special_tokens(&c->out)) ar.params.skip_special_tokens = false;
        int room = s->eng.max_model_len - p->n_ids;
        if (!q->max_tokens_set) ar.params.max_tokens = ep == OAI_ENDPOINT_CHAT ? room : (room < 16 ? room : 16);
        if (ar.params.max_tokens == 0) {
            // lm-eval-harness style scoring (echo + logprobs + max_tokens 0): the engine needs at
            // least one output token; it is generated and dropped (see apply_event).
            r->score_only = true;
            ar.params.max_tokens = 1;
            ar.params.min_tokens = 0;
            ar.params.logprobs = -1;
        }
        if (ar.params.min_tokens > ar.params.max_tokens) ar.params.min_tokens = ar.params.max_tokens;
        // n > 1 with a seed: distinct but reproducible samples per choice.
        if (ar.params.has_seed) ar.params.seed += (uint64_t)(i % q->n);
        ar.on_output = on_engine_output;
        ar.user = c;
        if (q->kv_do_remote_decode || q->kv_do_remote_prefill) { // one choice (checked when parsed)
            if (!q->kv_transfer_id) q->kv_transfer_id = xstrdup(r->id); // producer: this response names it
            ar.kv_transfer_id = q->kv_transfer_id;
            ar.kv_remote_engine_id = q->kv_remote_engine_id;
            ar.kv_do_remote_decode = q->kv_do_remote_decode;
            ar.kv_do_remote_prefill = q->kv_do_remote_prefill;
        }
        atomic_fetch_add(&r->refs, 1);
        st = s->eng.add_request(s->eng.ctx, &ar, &c->engine_id, err, sizeof err);
        if (st != ATOMC_OK) {
            atomic_fetch_sub(&r->refs, 1);
            break;
        }
        c->submitted = true;
    }
    r->http = req;
    r->in_active = true;
    r->next = s->active;
    if (s->active) s->active->prev = r;
    s->active = r;
    s->n_active++;
    if (st != ATOMC_OK) {
        // Nothing was sent yet: answer with the error, abort what was submitted, and count the
        // unsubmitted choices as done so the request is released once the aborts arrive.
        if (st == ATOMC_ERR_BUSY) s->metrics.rejected_busy_total++;
        if (st == ATOMC_ERR_BACKEND || st == ATOMC_ERR_INTERNAL) LOG_ERROR("engine rejected request: %s", err);
        struct oai_error e;
        oai_error_set(&e, status_to_http(st), NULL, "%s", err[0] ? err : atomc_status_name(st));
        if (st == ATOMC_ERR_TOO_LONG) snprintf(e.code, sizeof e.code, "context_length_exceeded");
        server_send_error(s, req, &e);
        r->http = NULL;
        r->responded = true;
        abort_engine(r);
        for (int i = 0; i < r->n_choices; i++)
            if (!r->choices[i].submitted) {
                r->choices[i].done = true;
                r->n_done++;
            }
        if (r->n_done == r->n_choices) finish_response(r);
        return;
    }
    http_req_set_closecb(req, on_conn_close, r);
    if (q->stream) {
        stream_begin(r); // the transport notices a vanished client on the next write
    } else {
        // While a request is handled the transport does not read its socket, so it would not
        // notice the client leaving a waiting non-streaming request. Watch the socket here.
        int fd = http_req_fd(req);
        if (fd >= 0) {
            r->close_watch = event_new(s->base, fd, EV_READ, on_client_readable, r);
            event_add(r->close_watch, NULL);
        }
    }
}
