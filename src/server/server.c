// HTTP plumbing of the OpenAI server: socket, routing, auth, limits, errors, the simple
// endpoints (/health, /v1/models, /metrics, /tokenize, /detokenize, /apply-template,
// /openapi.json, /version), the engine -> loop wake-up, and graceful shutdown.
// Threading contract in server.h; generation endpoints live in generate.c.
#include <errno.h>
#include <event2/buffer.h>
#include <event2/http.h> // evhttp_uridecode only (the transport is server_conn.c)
#include <llhttp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "server/anthropic.h"
#include "server/openai_response.h"
#include "server/server_internal.h"

void server_options_init(struct server_options *o) {
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->max_body_bytes = 32u << 20;
    o->max_header_bytes = 64u << 10;
    o->max_n = 64;
    o->drain_timeout_s = 30;
    o->max_pending_output_bytes = 64u << 20;
    o->idle_timeout_s = 300;
    o->timeout_keep_alive_s = 5;
    o->request_read_timeout_s = 60;
    o->install_signal_handlers = true;
    o->webui = true;
}

// ---------------------------------------------------------------- responses

static void add_common_headers(struct http_req *req, const char *content_type) {
    http_resp_add_header(req, "Content-Type", content_type);
    http_resp_add_header(req, "Server", "atomc");
    const char *rid = http_req_header(req, "X-Request-Id");
    if (rid && strlen(rid) < 256) http_resp_add_header(req, "X-Request-Id", rid);
}

static void send_body(struct server *s, struct http_req *req, int code, const char *ctype, const char *body,
                      size_t len) {
    if (code >= 400 && code < 600) s->metrics.http_errors_total[code / 100]++;
    add_common_headers(req, ctype);
    http_resp_send(req, code, body, len);
}

void server_send_json(struct server *s, struct http_req *req, int code, json_t *body) {
    char *txt = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    CHECK(txt);
    send_body(s, req, code, "application/json", txt, strlen(txt));
    free(txt);
}

// Errors of the Anthropic endpoints have Anthropic's shape.
static bool anthropic_path(struct http_req *req) {
    const char *path = http_req_path(req);
    return !strncmp(path, "/v1/messages", 12) && (path[12] == '\0' || path[12] == '/');
}

void server_send_error(struct server *s, struct http_req *req, const struct oai_error *e) {
    char *txt = anthropic_path(req) ? anthropic_error_json(e) : oai_error_json(e);
    if (e->http_status == 401) http_resp_add_header(req, "WWW-Authenticate", "Bearer");
    send_body(s, req, e->http_status, "application/json", txt, strlen(txt));
    free(txt);
}

static void send_error(struct server *s, struct http_req *req, int code, const char *param, const char *msg) {
    struct oai_error e;
    oai_error_set(&e, code, param, "%s", msg);
    server_send_error(s, req, &e);
}

// ---------------------------------------------------------------- engine -> loop wake-up

void server_ready_push(struct server *s, struct srv_req *r) {
    pthread_mutex_lock(&s->mu);
    bool was_empty = s->ready_head == NULL;
    r->ready_next = NULL;
    if (s->ready_tail) s->ready_tail->ready_next = r;
    else s->ready_head = r;
    s->ready_tail = r;
    pthread_mutex_unlock(&s->mu);
    if (was_empty) {
        uint64_t one = 1;
        // EAGAIN means the counter is already non-zero: the loop will wake anyway.
        ssize_t w = write(s->wake_fd, &one, sizeof one);
        (void)w;
    }
}

static void adopt_engine(struct server *s);
static void maybe_finish_drain(struct server *s);
static void begin_drain(struct server *s);

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    uint64_t v;
    ssize_t rd = read(fd, &v, sizeof v);
    (void)rd;
    pthread_mutex_lock(&s->mu);
    struct srv_req *list = s->ready_head;
    s->ready_head = s->ready_tail = NULL;
    struct srv_job *jobs = s->done_head;
    s->done_head = s->done_tail = NULL;
    bool shutdown = s->shutdown_requested;
    pthread_mutex_unlock(&s->mu);
    adopt_engine(s);
    while (list) {
        struct srv_req *r = list;
        list = r->ready_next;
        generate_process(r);
        srv_req_unref(r); // the ready list's reference
    }
    server_jobs_finish(s, jobs);
    if (shutdown) begin_drain(s);
    maybe_finish_drain(s);
}

static void adopt_engine(struct server *s) {
    if (s->have_engine) return;
    pthread_mutex_lock(&s->mu);
    bool ready = s->engine_ready;
    if (ready) s->eng = s->eng_pending;
    pthread_mutex_unlock(&s->mu);
    if (!ready) return;
    s->have_engine = true;
    oai_limits_init(&s->limits, s->eng.vocab_size);
    s->limits.max_n = s->opt.max_n;
    LOG_INFO("serving model '%s' (max_model_len %d) on http://%s:%d", s->model_names[0], s->eng.max_model_len, s->host,
             s->port);
}

void server_attach_engine(struct server *s, const struct server_engine *eng) {
    pthread_mutex_lock(&s->mu);
    s->eng_pending = *eng;
    s->engine_ready = true;
    pthread_mutex_unlock(&s->mu);
    uint64_t one = 1;
    ssize_t w = write(s->wake_fd, &one, sizeof one);
    (void)w;
}

void server_mark_failed(struct server *s, const char *msg) {
    pthread_mutex_lock(&s->mu);
    s->engine_failed = true;
    snprintf(s->failed_msg, sizeof s->failed_msg, "%s", msg ? msg : "engine failed");
    pthread_mutex_unlock(&s->mu);
}

static bool engine_failed(struct server *s, char *msg, size_t len) {
    pthread_mutex_lock(&s->mu);
    bool f = s->engine_failed;
    if (f && msg) snprintf(msg, len, "%s", s->failed_msg);
    pthread_mutex_unlock(&s->mu);
    return f;
}

// ---------------------------------------------------------------- request state

void srv_req_unref(struct srv_req *r) {
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    // Last reference: no thread can reach r any more. Frees memory only (no libevent calls).
    for (struct srv_event *e = r->ev_head; e;) {
        struct srv_event *n = e->next;
        free(e->text);
        free(e->lps);
        free(e->prompt_lps);
        free(e->stop_str);
        free(e->error);
        free(e);
        e = n;
    }
    for (int i = 0; i < r->n_choices; i++) {
        free(r->choices[i].text);
        chat_output_free(&r->choices[i].out);
        tool_text_free(&r->choices[i].a_pending);
        free(r->choices[i].stop_str);
        free(r->choices[i].error);
        json_decref(r->choices[i].logprobs);
    }
    free(r->choices);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].ids);
        free(r->prompts[i].text);
    }
    free(r->prompts);
    oai_request_free(&r->oai);
    free(r->model_name);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

// ---------------------------------------------------------------- simple endpoints

bool server_check_model(struct server *s, const char *model, struct oai_error *e) {
    if (!model) return true;
    for (int i = 0; i < s->n_model_names; i++)
        if (!strcmp(model, s->model_names[i])) return true;
    oai_error_set(e, 404, "model", "The model `%s` does not exist.", model);
    snprintf(e->code, sizeof e->code, "model_not_found");
    return false;
}

static json_t *model_card(struct server *s, const char *name) {
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(name));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer((json_int_t)s->created));
    json_object_set_new(m, "owned_by", json_string("atomc"));
    json_object_set_new(m, "root", json_string(s->eng.model_path ? s->eng.model_path : name));
    json_object_set_new(m, "parent", json_null());
    json_object_set_new(m, "max_model_len", json_integer(s->eng.max_model_len));
    return m;
}

static void handle_models(struct server *s, struct http_req *req, const char *path) {
    if (!strcmp(path, "/v1/models")) {
        json_t *data = json_array();
        for (int i = 0; i < s->n_model_names; i++) json_array_append_new(data, model_card(s, s->model_names[i]));
        json_t *o = json_object();
        json_object_set_new(o, "object", json_string("list"));
        json_object_set_new(o, "data", data);
        server_send_json(s, req, 200, o);
        return;
    }
    const char *name = path + strlen("/v1/models/");
    char *dec = evhttp_uridecode(name, 0, NULL);
    struct oai_error e;
    if (dec && server_check_model(s, dec, &e)) server_send_json(s, req, 200, model_card(s, dec));
    else if (dec) server_send_error(s, req, &e);
    else send_error(s, req, 404, "model", "invalid model name");
    free(dec);
}

static void handle_health(struct server *s, struct http_req *req) {
    char msg[256];
    json_t *o = json_object();
    int code = 200;
    if (engine_failed(s, msg, sizeof msg)) {
        code = 503;
        json_object_set_new(o, "status", json_string("failed"));
        json_object_set_new(o, "error", json_string(msg));
    } else if (!s->have_engine) {
        code = 503;
        json_object_set_new(o, "status", json_string("loading"));
    } else if (s->consecutive_errors >= SERVER_UNHEALTHY_AFTER_ERRORS) {
        code = 503;
        json_object_set_new(o, "status", json_string("failing"));
        snprintf(msg, sizeof msg, "the last %d requests failed in the engine: %.180s", s->consecutive_errors, s->last_error);
        json_object_set_new(o, "error", json_string(msg));
    } else if (s->draining) {
        code = 503;
        json_object_set_new(o, "status", json_string("shutting down"));
    } else {
        json_object_set_new(o, "status", json_string("ok"));
    }
    if (s->have_engine && s->eng.kv_role) { // P/D: what `atomc proxy` needs to route to this instance
        static const char *roles[] = {"none", "kv_producer", "kv_consumer", "kv_both"};
        json_t *kv = json_object();
        json_object_set_new(kv, "kv_role", json_string(roles[s->eng.kv_role & 3]));
        json_object_set_new(kv, "engine_id", json_string(s->eng.kv_engine_id ? s->eng.kv_engine_id : ""));
        json_object_set_new(o, "kv_transfer", kv);
    }
    server_send_json(s, req, code, o);
}

static void handle_metrics(struct server *s, struct http_req *req) {
    atomc_stats st;
    memset(&st, 0, sizeof st);
    if (s->have_engine) s->eng.get_stats(s->eng.ctx, &st);
    char *txt = NULL;
    size_t len = 0;
    if (metrics_render(&s->metrics, &st, &txt, &len)) {
        send_error(s, req, 500, NULL, "out of memory rendering metrics");
        return;
    }
    send_body(s, req, 200, "text/plain; version=0.0.4; charset=utf-8", txt, len);
    free(txt);
}

static void body_of(struct http_req *req, const char **p, size_t *len) { http_req_body(req, p, len); }

// The bodies of /tokenize, /apply-template and /detokenize, as pure functions of the request
// body (any thread: they read only what does not change while serving). Each returns the HTTP
// status and sets *out to the JSON response text (malloc'd), an error in OpenAI's shape or not.
static int error_text(const struct oai_error *e, char **out) {
    *out = oai_error_json(e);
    return e->http_status;
}

static int json_text(json_t *o, char **out) {
    *out = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    CHECK(*out);
    return 200;
}

int server_tokenize_compute(struct server *s, const char *body, size_t len, bool template_only, char **out) {
    struct oai_tokenize_request t;
    struct oai_error e;
    if (oai_tokenize_parse(body, len, &t, &e) || !server_check_model(s, t.model, &e)) {
        oai_tokenize_free(&t);
        return error_text(&e, out);
    }
    if (template_only && !t.messages) {
        oai_error_set(&e, 400, "messages", "'messages' is required");
        oai_tokenize_free(&t);
        return error_text(&e, out);
    }
    char *text = NULL;
    size_t text_len = 0;
    if (t.messages) {
        if (generate_render_chat(s, t.messages, t.tools, t.add_generation_prompt, t.continue_final_message,
                                 t.chat_template_kwargs, &text, &e)) {
            oai_tokenize_free(&t);
            return error_text(&e, out);
        }
        text_len = strlen(text);
    } else {
        text = t.prompt;
        text_len = t.prompt_len;
        t.prompt = NULL;
    }
    int code;
    if (template_only) {
        json_t *o = json_object();
        json_object_set_new(o, "prompt", json_stringn(text, text_len));
        code = json_text(o, out);
        free(text);
        oai_tokenize_free(&t);
        return code;
    }
    int32_t *ids = NULL;
    int n = 0;
    struct error err;
    error_clear(&err);
    if (s->eng.tokenize(s->eng.ctx, text, text_len, t.add_special_tokens, &ids, &n, &err) != ATOMC_OK) {
        oai_error_set(&e, 400, "prompt", "tokenization failed: %s", err.msg);
        code = error_text(&e, out);
    } else {
        json_t *o = json_object(), *toks = json_array();
        for (int i = 0; i < n; i++) json_array_append_new(toks, json_integer(ids[i]));
        json_object_set_new(o, "count", json_integer(n));
        json_object_set_new(o, "max_model_len", json_integer(s->eng.max_model_len));
        json_object_set_new(o, "tokens", toks);
        if (t.return_token_strs) {
            struct oai_token_text tt = {s->eng.token_bytes, s->eng.ctx, false};
            json_t *strs = json_array();
            for (int i = 0; i < n; i++) {
                char *ts = oai_token_string(&tt, ids[i]);
                json_array_append_new(strs, json_string(ts));
                free(ts);
            }
            json_object_set_new(o, "token_strs", strs);
        } else {
            json_object_set_new(o, "token_strs", json_null());
        }
        code = json_text(o, out);
    }
    free(ids);
    free(text);
    oai_tokenize_free(&t);
    return code;
}

int server_detokenize_compute(struct server *s, const char *body, size_t len, char **out) {
    struct oai_detokenize_request d;
    struct oai_error e;
    if (oai_detokenize_parse(body, len, &s->limits, &d, &e) || !server_check_model(s, d.model, &e)) {
        oai_detokenize_free(&d);
        return error_text(&e, out);
    }
    char *text = NULL;
    struct error err;
    error_clear(&err);
    int code;
    if (s->eng.detokenize(s->eng.ctx, d.tokens, d.n_tokens, false, &text, &err) != ATOMC_OK) {
        oai_error_set(&e, 400, "tokens", "detokenization failed: %s", err.msg);
        code = error_text(&e, out);
    } else {
        size_t sl;
        char *clean = oai_utf8_sanitize(text, strlen(text), &sl);
        json_t *o = json_object();
        json_object_set_new(o, "prompt", json_stringn(clean, sl));
        code = json_text(o, out);
        free(clean);
    }
    free(text);
    oai_detokenize_free(&d);
    return code;
}

void server_send_text(struct server *s, struct http_req *req, int code, char *json) {
    send_body(s, req, code, "application/json", json, strlen(json));
    free(json);
}

static void handle_tokenize(struct server *s, struct http_req *req, bool template_only) {
    const char *body;
    size_t len;
    body_of(req, &body, &len);
    char *out;
    int code = server_tokenize_compute(s, body, len, template_only, &out);
    server_send_text(s, req, code, out);
}

static void handle_detokenize(struct server *s, struct http_req *req) {
    const char *body;
    size_t len;
    body_of(req, &body, &len);
    char *out;
    int code = server_detokenize_compute(s, body, len, &out);
    server_send_text(s, req, code, out);
}

// GET /: the built-in chat page (src/server/webui/index.html, embedded by webui_embed.S). It talks
// to this server's own API; the policy confines it to this origin (no CDN, no third-party fetch).
extern const char atomc_webui_html[], atomc_webui_html_end[];

static void handle_webui(struct server *s, struct http_req *req) {
    http_resp_add_header(req, "Content-Security-Policy",
                         "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
                         "img-src 'self' data:; frame-ancestors 'none'");
    http_resp_add_header(req, "X-Content-Type-Options", "nosniff");
    http_resp_add_header(req, "Cache-Control", "no-cache");
    send_body(s, req, 200, "text/html; charset=utf-8", atomc_webui_html,
              (size_t)(atomc_webui_html_end - atomc_webui_html));
}

// GET /tokenizer_info (vLLM's): what a client needs to use the server as its tokenizer, e.g.
// lm-eval-harness with tokenizer_backend=remote (plus /tokenize and /detokenize).
static void handle_tokenizer_info(struct server *s, struct http_req *req) {
    json_t *o = json_object();
    json_object_set_new(o, "tokenizer_class", json_string("atomc"));
    json_object_set_new(o, "bos_token", s->eng.bos_token ? json_string(s->eng.bos_token) : json_null());
    json_object_set_new(o, "eos_token", s->eng.eos_token ? json_string(s->eng.eos_token) : json_null());
    json_object_set_new(o, "pad_token", json_null());
    json_object_set_new(o, "chat_template", s->eng.chat_template ? json_string(s->eng.chat_template) : json_null());
    json_object_set_new(o, "model_max_length", json_integer(s->eng.max_model_len));
    json_object_set_new(o, "vocab_size", json_integer(s->eng.vocab_size));
    server_send_json(s, req, 200, o);
}

// POST /start_profile, /stop_profile (vLLM's): per-step Chrome traces, needs --profile-dir.
static void handle_profile(struct server *s, struct http_req *req, bool start) {
    char msg[512] = "", path[4096] = "";
    atomc_status st;
    if (!s->opt.profiling || !s->eng.start_profile || !s->eng.stop_profile) {
        send_error(s, req, 404, NULL,
                   "profiling is off: start the server with a profile directory (--profile-dir DIR)");
        return;
    }
    if (start) {
        st = s->eng.start_profile(s->eng.ctx, msg, sizeof msg);
    } else {
        st = s->eng.stop_profile(s->eng.ctx, path, sizeof path, msg, sizeof msg);
    }
    if (st != ATOMC_OK) {
        // Stopping with no profile running is a state conflict, not a malformed request.
        send_error(s, req, st == ATOMC_ERR_IO ? 500 : st == ATOMC_ERR_INVALID_ARGUMENT ? 409 : 400, NULL, msg);
        return;
    }
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string(start ? "profiling" : "stopped"));
    if (!start) json_object_set_new(o, "trace", json_string(path));
    server_send_json(s, req, 200, o);
}

// ---------------------------------------------------------------- routing

enum route_flags { R_GET = 1, R_POST = 2, R_AUTH = 4, R_ENGINE = 8, R_PREFIX = 16 };

enum route_id { RT_WEBUI, RT_HEALTH, RT_PING, RT_METRICS, RT_MODELS, RT_MODEL, RT_COMPLETIONS, RT_CHAT, RT_TOKENIZE,
                RT_DETOKENIZE, RT_APPLY_TEMPLATE, RT_OPENAPI, RT_VERSION, RT_TOKENIZER_INFO, RT_START_PROFILE,
                RT_STOP_PROFILE, RT_MESSAGES, RT_COUNT_TOKENS };

static const struct route {
    const char *path;
    enum route_id id;
    int flags;
} routes[] = {
    {"/", RT_WEBUI, R_GET},
    {"/health", RT_HEALTH, R_GET},
    {"/ping", RT_PING, R_GET},
    {"/metrics", RT_METRICS, R_GET},
    {"/openapi.json", RT_OPENAPI, R_GET},
    {"/version", RT_VERSION, R_GET},
    {"/v1/models", RT_MODELS, R_GET | R_AUTH | R_ENGINE},
    {"/v1/models/", RT_MODEL, R_GET | R_AUTH | R_ENGINE | R_PREFIX},
    {"/v1/completions", RT_COMPLETIONS, R_POST | R_AUTH | R_ENGINE},
    {"/v1/chat/completions", RT_CHAT, R_POST | R_AUTH | R_ENGINE},
    {"/v1/messages", RT_MESSAGES, R_POST | R_AUTH | R_ENGINE},
    {"/v1/messages/count_tokens", RT_COUNT_TOKENS, R_POST | R_AUTH | R_ENGINE},
    {"/tokenize", RT_TOKENIZE, R_POST | R_AUTH | R_ENGINE},
    {"/detokenize", RT_DETOKENIZE, R_POST | R_AUTH | R_ENGINE},
    {"/apply-template", RT_APPLY_TEMPLATE, R_POST | R_AUTH | R_ENGINE},
    {"/tokenizer_info", RT_TOKENIZER_INFO, R_GET | R_AUTH | R_ENGINE},
    {"/start_profile", RT_START_PROFILE, R_POST | R_AUTH | R_ENGINE},
    {"/stop_profile", RT_STOP_PROFILE, R_POST | R_AUTH | R_ENGINE},
};

// Constant-time comparison so the key cannot be guessed byte by byte from response times.
static bool key_equal(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    unsigned char d = (unsigned char)(la != lb);
    for (size_t i = 0; i < lb; i++) d |= (unsigned char)(a[i < la ? i : 0] ^ b[i]);
    return d == 0;
}

static bool authorized(struct server *s, struct http_req *req) {
    if (!s->api_key) return true;
    // Anthropic clients send the key as "x-api-key: KEY".
    const char *x = http_req_header(req, "x-api-key");
    if (x && key_equal(x, s->api_key)) return true;
    const char *h = http_req_header(req, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    h += 7;
    while (*h == ' ') h++;
    return key_equal(h, s->api_key);
}

// The transport (server_conn.c) hands over each complete, well-framed request.
void server_handle_request(struct server *s, struct http_req *req) {
    adopt_engine(s);
    const char *path = http_req_path(req);
    const struct route *rt = NULL;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        const struct route *c = &routes[i];
        if (c->id == RT_WEBUI && !s->opt.webui) continue;
        if ((c->flags & R_PREFIX) ? (strncmp(path, c->path, strlen(c->path)) == 0 && path[strlen(c->path)])
                                  : strcmp(path, c->path) == 0) {
            rt = c;
            break;
        }
    }
    if (!rt) {
        char msg[160];
        snprintf(msg, sizeof msg, "Not Found: no route for %.100s", path);
        send_error(s, req, 404, NULL, msg);
        return;
    }
    int cmd = http_req_method(req);
    bool ok = ((rt->flags & R_GET) && (cmd == HTTP_GET || cmd == HTTP_HEAD)) ||
              ((rt->flags & R_POST) && cmd == HTTP_POST);
    if (!ok) {
        http_resp_add_header(req, "Allow", (rt->flags & R_GET) ? "GET, HEAD" : "POST");
        send_error(s, req, 405, NULL, (rt->flags & R_GET) ? "Method Not Allowed: use GET" : "Method Not Allowed: use POST");
        return;
    }
    if ((rt->flags & R_AUTH) && !authorized(s, req)) {
        struct oai_error e;
        oai_error_set(&e, 401, NULL, "Unauthorized: missing or invalid API key (send 'Authorization: Bearer <key>')");
        snprintf(e.code, sizeof e.code, "invalid_api_key");
        server_send_error(s, req, &e);
        return;
    }
    if (rt->flags & R_ENGINE) {
        char msg[256];
        if (engine_failed(s, msg, sizeof msg)) {
            char m2[320];
            snprintf(m2, sizeof m2, "the engine has failed: %s", msg);
            send_error(s, req, 503, NULL, m2);
            return;
        }
        if (!s->have_engine) {
            send_error(s, req, 503, NULL, "the model is still loading; retry when /health returns 200");
            return;
        }
        if (s->draining && (rt->id == RT_COMPLETIONS || rt->id == RT_CHAT || rt->id == RT_MESSAGES)) {
            send_error(s, req, 503, NULL, "the server is shutting down");
            return;
        }
    }
    switch (rt->id) {
    case RT_WEBUI: handle_webui(s, req); break;
    case RT_HEALTH: handle_health(s, req); break;
    case RT_PING: handle_health(s, req); break;
    case RT_METRICS: handle_metrics(s, req); break;
    case RT_OPENAPI:
        send_body(s, req, 200, "application/json", server_openapi_json, strlen(server_openapi_json));
        break;
    case RT_VERSION: {
        json_t *o = json_object();
        json_object_set_new(o, "version", json_string("0.1.0"));
        server_send_json(s, req, 200, o);
        break;
    }
    case RT_MODELS:
    case RT_MODEL: handle_models(s, req, path); break;
    // Large bodies are parsed, rendered and tokenized by a worker (server_work.c).
    case RT_COMPLETIONS:
        if (!server_offload(s, req, JOB_GENERATE, OAI_ENDPOINT_COMPLETIONS)) generate_handle(s, req, OAI_ENDPOINT_COMPLETIONS);
        break;
    case RT_CHAT:
        if (!server_offload(s, req, JOB_GENERATE, OAI_ENDPOINT_CHAT)) generate_handle(s, req, OAI_ENDPOINT_CHAT);
        break;
    case RT_MESSAGES: anthropic_handle_messages(s, req); break;
    case RT_COUNT_TOKENS: anthropic_handle_count_tokens(s, req); break;
    case RT_TOKENIZE:
        if (!server_offload(s, req, JOB_TOKENIZE, OAI_ENDPOINT_COMPLETIONS)) handle_tokenize(s, req, false);
        break;
    case RT_APPLY_TEMPLATE:
        if (!server_offload(s, req, JOB_TEMPLATE, OAI_ENDPOINT_COMPLETIONS)) handle_tokenize(s, req, true);
        break;
    case RT_DETOKENIZE:
        if (!server_offload(s, req, JOB_DETOKENIZE, OAI_ENDPOINT_COMPLETIONS)) handle_detokenize(s, req);
        break;
    case RT_TOKENIZER_INFO: handle_tokenizer_info(s, req); break;
    case RT_START_PROFILE:
    case RT_STOP_PROFILE: handle_profile(s, req, rt->id == RT_START_PROFILE); break;
    }
}

// ---------------------------------------------------------------- shutdown

static void on_force(evutil_socket_t fd, short what, void *arg);

// The drain ends when no request is in flight and every final response has been written. A
// response whose connection died mid-write never reports completion: a short timer bounds that.
static void maybe_finish_drain(struct server *s) {
    if (!s->draining || s->n_active > 0 || s->n_jobs > 0) return;
    if (s->n_writing <= 0) {
        event_base_loopbreak(s->base);
    } else if (!s->force_timer) {
        struct timeval tv = {2, 0};
        s->force_timer = evtimer_new(s->base, on_force, s);
        evtimer_add(s->force_timer, &tv);
    }
}

// The done callback of generate.c's final responses: written out (or their connection died).
void server_reply_done(void *arg) {
    struct server *s = arg;
    s->n_writing--;
    maybe_finish_drain(s);
}

static void on_force(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    LOG_WARN("shutdown: %d requests in flight, %d responses unwritten; exiting anyway", s->n_active, s->n_writing);
    event_base_loopbreak(s->base);
}

static void on_drain_timeout(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    LOG_WARN("shutdown: drain timeout; aborting %d in-flight requests", s->n_active);
    generate_abort_all(s);
    if (!s->force_timer) {
        struct timeval tv = {5, 0};
        s->force_timer = evtimer_new(s->base, on_force, s);
        evtimer_add(s->force_timer, &tv);
    }
}

// Loop thread: stop accepting, let in-flight requests finish (bounded), then leave the loop.
static void begin_drain(struct server *s) {
    if (s->draining) return;
    s->draining = true;
    server_conn_stop_accepting(s);
    LOG_INFO("shutdown: no longer accepting connections; draining %d in-flight requests (up to %.0f s)", s->n_active,
             s->opt.drain_timeout_s);
    if (s->n_active == 0) {
        maybe_finish_drain(s);
        return;
    }
    struct timeval tv = {(time_t)s->opt.drain_timeout_s,
                         (suseconds_t)((s->opt.drain_timeout_s - (time_t)s->opt.drain_timeout_s) * 1e6)};
    s->drain_timer = evtimer_new(s->base, on_drain_timeout, s);
    evtimer_add(s->drain_timer, &tv);
}

void server_shutdown(struct server *s) {
    pthread_mutex_lock(&s->mu);
    s->shutdown_requested = true;
    pthread_mutex_unlock(&s->mu);
    uint64_t one = 1;
    ssize_t w = write(s->wake_fd, &one, sizeof one); // the loop drains in on_wake
    (void)w;
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    struct server *s = arg;
    LOG_INFO("received %s", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    if (s->draining) {
        // A second signal: stop now.
        generate_abort_all(s);
        event_base_loopbreak(s->base);
        return;
    }
    begin_drain(s);
}

// ---------------------------------------------------------------- create / run / free

atomc_status server_create(const struct server_options *o, struct server **out, struct error *err) {
    struct server *s = xcalloc(1, sizeof *s);
    s->opt = *o;
    s->host = xstrdup(o->host ? o->host : "127.0.0.1");
    s->api_key = o->api_key && *o->api_key ? xstrdup(o->api_key) : NULL;
    for (int i = 0; i < o->n_model_names && i < SERVER_MAX_MODEL_NAMES; i++)
        s->model_names[s->n_model_names++] = xstrdup(o->model_names[i]);
    if (s->n_model_names == 0) s->model_names[s->n_model_names++] = xstrdup("model");
    s->opt.host = s->host;
    s->opt.api_key = s->api_key;
    pthread_mutex_init(&s->mu, NULL);
    s->wake_fd = -1;
    s->reserve_fd = -1;
    metrics_init(&s->metrics, s->model_names[0]);
    oai_limits_init(&s->limits, 0);
    s->rng = time_now_ns() ^ ((uint64_t)getpid() << 32) ^ 0x9e3779b97f4a7c15ull;
    s->created = time_wall_s();
    *out = NULL;

    s->base = event_base_new();
    if (!s->base) goto fail_msg;
    s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->wake_fd < 0) {
        error_set(err, ATOMC_ERR_INTERNAL, "eventfd: %s", strerror(errno));
        goto fail;
    }
    s->wake_ev = event_new(s->base, s->wake_fd, EV_READ | EV_PERSIST, on_wake, s);
    event_add(s->wake_ev, NULL);
    server_workers_start(s);
    if (server_conn_listen(s, err) != ATOMC_OK) goto fail;
    {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = server_conn_listen_fd(s);
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
            if (ss.ss_family == AF_INET) s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
            else if (ss.ss_family == AF_INET6) s->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        }
    }
    {
        // Writing to a client that has gone must fail with EPIPE, not kill the process: libevent
        // writes with writev. Left alone if the program already handles SIGPIPE.
        struct sigaction old;
        if (sigaction(SIGPIPE, NULL, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
    }
    if (o->install_signal_handlers) {
        s->sig_int = evsignal_new(s->base, SIGINT, on_signal, s);
        s->sig_term = evsignal_new(s->base, SIGTERM, on_signal, s);
        evsignal_add(s->sig_int, NULL);
        evsignal_add(s->sig_term, NULL);
    }
    *out = s;
    return ATOMC_OK;
fail_msg:
    error_set(err, ATOMC_ERR_INTERNAL, "libevent initialisation failed");
fail:
    server_free(s);
    return err ? err->status : ATOMC_ERR_INTERNAL;
}

int server_port(const struct server *s) { return s->port; }

int server_run(struct server *s) {
    event_base_dispatch(s->base);
    server_workers_stop(s); // before the caller frees the engine the workers use
    return 0;
}

void server_free(struct server *s) {
    if (!s) return;
    // The engine is gone by now (see server.h): close callbacks must not reach it.
    s->have_engine = false;
    server_workers_stop(s); // (no-op after server_run)
    server_workers_free(s);
    server_conn_close_all(s); // runs the close callbacks of requests still in progress
    // Outputs queued by the engine (it has been stopped by now) are applied and dropped.
    pthread_mutex_lock(&s->mu);
    struct srv_req *list = s->ready_head;
    s->ready_head = s->ready_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    while (list) {
        struct srv_req *r = list;
        list = r->ready_next;
        generate_process(r);
        srv_req_unref(r);
    }
    // Requests whose engine side never finished (engine freed without final callbacks) keep
    // their HTTP reference here; release it so nothing outlives the server.
    while (s->active) {
        struct srv_req *r = s->active;
        s->active = r->next;
        r->in_active = false;
        r->http = NULL;
        srv_req_unref(r);
    }
    server_conn_free(s);
    if (s->wake_ev) event_free(s->wake_ev);
    if (s->sig_int) event_free(s->sig_int);
    if (s->sig_term) event_free(s->sig_term);
    if (s->drain_timer) event_free(s->drain_timer);
    if (s->force_timer) event_free(s->force_timer);
    if (s->base) event_base_free(s->base);
    if (s->wake_fd >= 0) close(s->wake_fd);
    metrics_free(&s->metrics);
    pthread_mutex_destroy(&s->mu);
    for (int i = 0; i < s->n_model_names; i++) free(s->model_names[i]);
    free(s->host);
    free(s->api_key);
    free(s);
}
