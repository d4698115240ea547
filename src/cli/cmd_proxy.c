// `atomc proxy`: the OpenAI-compatible front of a prefill/decode disaggregated deployment.
//
//   atomc proxy --host H --port N --prefill URL[,URL...] --decode URL[,URL...]
//
// Each /v1/completions or /v1/chat/completions request: pick a decode instance D (round robin,
// or --policy least_tokens: the fewest outstanding tokens, prompt bytes / 4 + max_tokens per
// request), send the request to a prefill instance (round robin over the healthy ones) with
// max_tokens 1, stream off and kv_transfer_params {do_remote_decode: true, remote_engine_id: D's
// engine id}; then send the original request to D with the kv_transfer_params the prefill
// instance answered, and relay D's answer (SSE chunks as they arrive, or the JSON body). This is
// the flow of vLLM's disaggregation proxies, so atomc instances and the proxy interoperate with
// their fields.
//
// Faults: a prefill instance that does not answer (connection refused / reset, timeout, 5xx) is
// marked down and the next healthy one is tried; with none left, D gets the request without
// kv_transfer_params and prefills it itself. A decode instance that fails before its answer
// started is marked down and the request goes to another (which prefills locally). Health: every
// --health-interval seconds GET /health on every instance; an instance is used only while it
// answers 200 (its /health also names its KV engine id). The proxy's own /health is 200 while at
// least one decode instance is up; /metrics counts requests, failovers and fallbacks.
//
// One thread: libevent's evhttp serves the clients and is the client of the instances (one
// keep-alive connection per in-flight upstream request, reused from a per-instance idle list).
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/check.h"
#include "common/log.h"

#define PROXY_MAX_UPSTREAMS 32

struct upstream {
    char host[128];
    int port;
    char url[200];
    bool prefill;
    bool healthy;
    bool checking;
    char engine_id[96];
    long outstanding; // tokens charged (decode)
    long inflight;
    struct evhttp_connection *idle[64];
    int n_idle;
};

struct proxy {
    struct event_base *base;
    struct evhttp *http;
    struct upstream up[PROXY_MAX_UPSTREAMS];
    int n_prefill, n_decode; // up[0..n_prefill) prefill, then decode
    int rr_prefill, rr_decode;
    bool least_tokens;
    double health_interval_s, timeout_s;
    struct event *health_ev, *sig_int, *sig_term;
    uint64_t n_requests, n_prefill_failovers, n_local_prefill, n_decode_retries, n_errors;
};

struct preq {
    struct proxy *px;
    struct evhttp_request *client; // NULL once the client is gone
    char path[64];
    json_t *body; // the client's request
    bool stream;
    int decode, prefill;                  // upstream indices, -1 = none
    unsigned tried_prefill, tried_decode; // bit masks
    json_t *kv_params;                    // the prefill instance's answer (NULL: local prefill)
    bool started;                         // reply to the client started (streaming relay)
    long charge;
    struct evhttp_connection *conn; // the upstream connection in use
    int conn_up;
};

static struct upstream *decode_at(struct proxy *px, int i) {
    return &px->up[px->n_prefill + i];
}

// --- upstream connections ------------------------------------------------------------------------

static struct evhttp_connection *conn_get(struct proxy *px, struct upstream *u) {
    if (u->n_idle) return u->idle[--u->n_idle];
    struct evhttp_connection *c = evhttp_connection_base_new(px->base, NULL, u->host, (ev_uint16_t)u->port);
    if (c) evhttp_connection_set_timeout(c, (int)px->timeout_s);
    return c;
}

static void conn_put(struct upstream *u, struct evhttp_connection *c, bool ok) {
    if (!c) return;
    if (ok && u->n_idle < (int)(sizeof u->idle / sizeof u->idle[0]))
        u->idle[u->n_idle++] = c;
    else
        evhttp_connection_free(c);
}

// POSTs (or GETs when body is NULL) path to u; cb(req, arg) gets the answer (req NULL or code 0:
// no answer). Returns false when no request could be made.
static bool upstream_send(struct proxy *px, struct upstream *u, const char *path, const char *body,
                          void (*cb)(struct evhttp_request *, void *), void *arg, struct evhttp_connection **conn_out,
                          void (*chunk_cb)(struct evhttp_request *, void *)) {
    struct evhttp_connection *c = conn_get(px, u);
    if (!c) return false;
    struct evhttp_request *r = evhttp_request_new(cb, arg);
    if (chunk_cb) evhttp_request_set_chunked_cb(r, chunk_cb);
    struct evkeyvalq *h = evhttp_request_get_output_headers(r);
    char hostport[160];
    snprintf(hostport, sizeof hostport, "%s:%d", u->host, u->port);
    evhttp_add_header(h, "Host", hostport);
    if (body) {
        evhttp_add_header(h, "Content-Type", "application/json");
        evbuffer_add(evhttp_request_get_output_buffer(r), body, strlen(body));
    }
    if (evhttp_make_request(c, r, body ? EVHTTP_REQ_POST : EVHTTP_REQ_GET, path) != 0) {
        evhttp_connection_free(c);
        return false;
    }
    *conn_out = c;
    u->inflight++;
    return true;
}

// --- replies to the client -----------------------------------------------------------------------

static void client_closed(struct evhttp_connection *c, void *arg) {
    (void)c;
    struct preq *q = arg;
    q->client = NULL;
}

// The client's request for its final reply: the close callback is cleared first (libevent frees
// the request once the reply is out), and q forgets it.
static struct evhttp_request *client_take(struct preq *q) {
    struct evhttp_request *c = q->client;
    if (c) evhttp_connection_set_closecb(evhttp_request_get_connection(c), NULL, NULL);
    q->client = NULL;
    return c;
}

static void reply_json(struct preq *q, int code, const char *msg) {
    struct evhttp_request *client = client_take(q);
    if (!client) return;
    json_t *e = json_pack("{s:{s:s,s:s,s:n,s:i}}", "error", "message", msg, "type",
                          code >= 500 ? "server_error" : "invalid_request_error", "param", "code", code);
    char *txt = json_dumps(e, JSON_COMPACT);
    json_decref(e);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, txt, strlen(txt));
    free(txt);
    evhttp_add_header(evhttp_request_get_output_headers(client), "Content-Type", "application/json");
    evhttp_send_reply(client, code, code == 200 ? "OK" : "Error", b);
    evbuffer_free(b);
}

static void preq_free(struct preq *q) {
    client_take(q);
    json_decref(q->body);
    json_decref(q->kv_params);
    free(q);
}

// --- the request flow ------------------------------------------------------------------------------

static void start_decode(struct preq *q);

static int pick_prefill(struct proxy *px, struct preq *q) {
    for (int k = 0; k < px->n_prefill; k++) {
        int i = (px->rr_prefill + k) % px->n_prefill;
        if (px->up[i].healthy && !(q->tried_prefill & (1u << i))) {
            px->rr_prefill = (i + 1) % px->n_prefill;
            return i;
        }
    }
    return -1;
}

static int pick_decode(struct proxy *px, struct preq *q) {
    int best = -1;
    for (int k = 0; k < px->n_decode; k++) {
        int i = (px->rr_decode + k) % px->n_decode;
        struct upstream *u = decode_at(px, i);
        if (!u->healthy || (q->tried_decode & (1u << i))) continue;
        if (!px->least_tokens) {
            best = i;
            break;
        }
        if (best < 0 || u->outstanding < decode_at(px, best)->outstanding) best = i;
    }
    if (best >= 0) px->rr_decode = (best + 1) % px->n_decode;
    return best;
}

static long charge_of(json_t *body) {
    long n = 0;
    json_t *p = json_object_get(body, "prompt"), *m = json_object_get(body, "messages");
    char *txt = json_dumps(p ? p : m ? m : json_null(), JSON_COMPACT | JSON_ENCODE_ANY);
    if (txt) n = (long)strlen(txt) / 4;
    free(txt);
    json_t *mt = json_object_get(body, "max_tokens");
    if (!mt) mt = json_object_get(body, "max_completion_tokens");
    n += json_is_integer(mt) ? (long)json_integer_value(mt) : 16;
    return n;
}

static void on_prefill_done(struct evhttp_request *r, void *arg);

static void start_prefill(struct preq *q) {
    struct proxy *px = q->px;
    q->prefill = pick_prefill(px, q);
    if (q->prefill < 0) { // no prefill instance left: the decode instance prefills itself
        px->n_local_prefill++;
        start_decode(q);
        return;
    }
    q->tried_prefill |= 1u << q->prefill;
    json_t *b = json_deep_copy(q->body);
    json_object_set_new(b, "max_tokens", json_integer(1));
    if (json_object_get(b, "max_completion_tokens")) json_object_set_new(b, "max_completion_tokens", json_integer(1));
    json_object_set_new(b, "stream", json_false());
    json_object_del(b, "stream_options");
    json_object_del(b, "min_tokens");
    json_t *kv = json_object();
    json_object_set_new(kv, "do_remote_decode", json_true());
    json_object_set_new(kv, "do_remote_prefill", json_false());
    struct upstream *d = decode_at(px, q->decode);
    json_object_set_new(kv, "remote_engine_id", d->engine_id[0] ? json_string(d->engine_id) : json_null());
    json_object_set_new(b, "kv_transfer_params", kv);
    char *txt = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    struct upstream *u = &px->up[q->prefill];
    bool ok = upstream_send(px, u, q->path, txt, on_prefill_done, q, &q->conn, NULL);
    free(txt);
    q->conn_up = q->prefill;
    if (!ok) {
        u->healthy = false;
        px->n_prefill_failovers++;
        start_prefill(q);
    }
}

static void on_prefill_done(struct evhttp_request *r, void *arg) {
    struct preq *q = arg;
    struct proxy *px = q->px;
    struct upstream *u = &px->up[q->prefill];
    u->inflight--;
    int code = r ? evhttp_request_get_response_code(r) : 0;
    conn_put(u, q->conn, code != 0);
    q->conn = NULL;
    if (code == 200) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        size_t n = evbuffer_get_length(in);
        json_t *j = json_loadb((const char *)evbuffer_pullup(in, -1), n, 0, NULL);
        json_t *kv = json_object_get(j, "kv_transfer_params");
        if (json_is_object(kv)) q->kv_params = json_incref(kv);
        json_decref(j);
        if (!q->kv_params) px->n_local_prefill++; // not a P/D-aware instance: the decode side prefills
        start_decode(q);
        return;
    }
    if (code >= 400 && code < 500) { // the request itself is bad: the client gets the answer as it is
        struct evhttp_request *client = client_take(q);
        if (client) {
            evhttp_add_header(evhttp_request_get_output_headers(client), "Content-Type", "application/json");
            evhttp_send_reply(client, code, "Error", evhttp_request_get_input_buffer(r));
        }
        decode_at(px, q->decode)->outstanding -= q->charge;
        preq_free(q);
        return;
    }
    LOG_WARN("proxy: prefill instance %s failed (%s); trying the next", u->url, code ? "HTTP error" : "no answer");
    if (!code) u->healthy = false;
    px->n_prefill_failovers++;
    start_prefill(q);
}

static void relay_chunk(struct evhttp_request *r, void *arg) {
    struct preq *q = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(r);
    if (!q->client) {
        evbuffer_drain(in, evbuffer_get_length(in));
        return;
    }
    if (!q->started) {
        q->started = true;
        int code = evhttp_request_get_response_code(r);
        const char *ct = evhttp_find_header(evhttp_request_get_input_headers(r), "Content-Type");
        struct evkeyvalq *h = evhttp_request_get_output_headers(q->client);
        evhttp_add_header(h, "Content-Type", ct ? ct : "application/json");
        if (q->stream) evhttp_add_header(h, "Cache-Control", "no-cache");
        evhttp_send_reply_start(q->client, code ? code : 200, "OK");
    }
    evhttp_send_reply_chunk(q->client, in);
}

static void on_decode_done(struct evhttp_request *r, void *arg) {
    struct preq *q = arg;
    struct proxy *px = q->px;
    struct upstream *u = decode_at(px, q->decode);
    u->inflight--;
    int code = r ? evhttp_request_get_response_code(r) : 0;
    conn_put(u, q->conn, code != 0);
    q->conn = NULL;
    if (code == 0 && !q->started) { // nothing reached the client yet: another decode instance, local prefill
        LOG_WARN("proxy: decode instance %s gave no answer; retrying elsewhere", u->url);
        u->healthy = false;
        u->outstanding -= q->charge;
        px->n_decode_retries++;
        json_decref(q->kv_params);
        q->kv_params = NULL;
        q->decode = pick_decode(px, q);
        if (q->decode < 0) {
            px->n_errors++;
            reply_json(q, 503, "no decode instance is available");
            preq_free(q);
            return;
        }
        q->tried_decode |= 1u << q->decode;
        q->charge = charge_of(q->body);
        decode_at(px, q->decode)->outstanding += q->charge;
        start_decode(q);
        return;
    }
    u->outstanding -= q->charge;
    struct evhttp_request *client = client_take(q);
    if (client) {
        if (!q->started) {
            struct evkeyvalq *h = evhttp_request_get_output_headers(client);
            const char *ct = evhttp_find_header(evhttp_request_get_input_headers(r), "Content-Type");
            evhttp_add_header(h, "Content-Type", ct ? ct : "application/json");
            evhttp_send_reply(client, code, "OK", evhttp_request_get_input_buffer(r));
        } else {
            if (r && evbuffer_get_length(evhttp_request_get_input_buffer(r)))
                evhttp_send_reply_chunk(client, evhttp_request_get_input_buffer(r));
            evhttp_send_reply_end(client);
        }
    }
    if (code == 0) px->n_errors++;
    preq_free(q);
}

static void start_decode(struct preq *q) {
    struct proxy *px = q->px;
    json_t *b = json_deep_copy(q->body);
    if (q->kv_params)
        json_object_set(b, "kv_transfer_params", q->kv_params);
    else
        json_object_del(b, "kv_transfer_params");
    char *txt = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    struct upstream *u = decode_at(px, q->decode);
    bool ok = upstream_send(px, u, q->path, txt, on_decode_done, q, &q->conn, relay_chunk);
    free(txt);
    if (!ok) {
        u->inflight++; // on_decode_done takes it back
        on_decode_done(NULL, q);
    }
}

static void handle_generate(struct proxy *px, struct evhttp_request *req, const char *path) {
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(in);
    json_error_t je;
    json_t *body = json_loadb(n ? (const char *)evbuffer_pullup(in, -1) : "", n, 0, &je);
    struct preq *q = xcalloc(1, sizeof *q);
    q->px = px;
    q->client = req;
    q->prefill = q->decode = -1;
    snprintf(q->path, sizeof q->path, "%.60s", path);
    px->n_requests++;
    if (!json_is_object(body)) {
        json_decref(body);
        char msg[300];
        snprintf(msg, sizeof msg, "the body must be a JSON object (%.200s)", je.text);
        reply_json(q, 400, msg);
        free(q);
        return;
    }
    q->body = body;
    q->stream = json_is_true(json_object_get(body, "stream"));
    q->decode = pick_decode(px, q);
    if (q->decode < 0) {
        px->n_errors++;
        reply_json(q, 503, "no decode instance is available");
        preq_free(q);
        return;
    }
    q->tried_decode = 1u << q->decode;
    q->charge = charge_of(body);
    decode_at(px, q->decode)->outstanding += q->charge;
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), client_closed, q);
    json_t *nj = json_object_get(body, "n");
    if (json_is_integer(nj) && json_integer_value(nj) > 1) { // one KV transfer per request: n > 1 prefills on D
        px->n_local_prefill++;
        start_decode(q);
        return;
    }
    start_prefill(q);
}

// --- health, metrics, routing ------------------------------------------------------------------

static void on_health(struct evhttp_request *r, void *arg) {
    struct upstream *u = arg;
    u->checking = false;
    int code = r ? evhttp_request_get_response_code(r) : 0;
    bool was = u->healthy;
    u->healthy = code == 200;
    if (u->healthy) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        json_t *j = json_loadb((const char *)evbuffer_pullup(in, -1), evbuffer_get_length(in), 0, NULL);
        const char *id = json_string_value(json_object_get(json_object_get(j, "kv_transfer"), "engine_id"));
        snprintf(u->engine_id, sizeof u->engine_id, "%s", id ? id : "");
        json_decref(j);
    }
    if (was != u->healthy)
        LOG_INFO("proxy: %s instance %s is %s%s%s", u->prefill ? "prefill" : "decode", u->url,
                 u->healthy ? "up" : "down", u->engine_id[0] ? ", engine " : "", u->engine_id);
}

static void health_tick(evutil_socket_t fd, short ev, void *arg) {
    (void)fd;
    (void)ev;
    struct proxy *px = arg;
    for (int i = 0; i < px->n_prefill + px->n_decode; i++) {
        struct upstream *u = &px->up[i];
        if (u->checking) continue;
        // Health checks use their own short-lived connections (freed by libevent with the request).
        struct evhttp_connection *c = evhttp_connection_base_new(px->base, NULL, u->host, (ev_uint16_t)u->port);
        if (!c) continue;
        evhttp_connection_set_timeout(c, 5);
        evhttp_connection_free_on_completion(c);
        struct evhttp_request *r = evhttp_request_new(on_health, u);
        evhttp_add_header(evhttp_request_get_output_headers(r), "Host", u->host);
        if (evhttp_make_request(c, r, EVHTTP_REQ_GET, "/health") == 0)
            u->checking = true;
        else
            evhttp_connection_free(c);
    }
    struct timeval tv = {(time_t)px->health_interval_s,
                         (suseconds_t)((px->health_interval_s - (time_t)px->health_interval_s) * 1e6)};
    evtimer_add(px->health_ev, &tv);
}

static void handle_metrics(struct proxy *px, struct evhttp_request *req) {
    struct evbuffer *b = evbuffer_new();
    evbuffer_add_printf(
        b,
        "# HELP atomc_proxy:requests_total Requests received.\n# TYPE atomc_proxy:requests_total counter\n"
        "atomc_proxy:requests_total %llu\n"
        "# HELP atomc_proxy:prefill_failovers_total Prefill instances that failed a request.\n"
        "# TYPE atomc_proxy:prefill_failovers_total counter\natomc_proxy:prefill_failovers_total %llu\n"
        "# HELP atomc_proxy:local_prefill_total Requests the decode instance prefilled itself.\n"
        "# TYPE atomc_proxy:local_prefill_total counter\natomc_proxy:local_prefill_total %llu\n"
        "# HELP atomc_proxy:decode_retries_total Requests moved to another decode instance.\n"
        "# TYPE atomc_proxy:decode_retries_total counter\natomc_proxy:decode_retries_total %llu\n"
        "# HELP atomc_proxy:errors_total Requests answered with an error by the proxy.\n"
        "# TYPE atomc_proxy:errors_total counter\natomc_proxy:errors_total %llu\n"
        "# HELP atomc_proxy:instance_up Whether an instance answers /health.\n"
        "# TYPE atomc_proxy:instance_up gauge\n",
        (unsigned long long)px->n_requests, (unsigned long long)px->n_prefill_failovers,
        (unsigned long long)px->n_local_prefill, (unsigned long long)px->n_decode_retries,
        (unsigned long long)px->n_errors);
    for (int i = 0; i < px->n_prefill + px->n_decode; i++)
        evbuffer_add_printf(b, "atomc_proxy:instance_up{role=\"%s\",url=\"%s\"} %d\n",
                            px->up[i].prefill ? "prefill" : "decode", px->up[i].url, px->up[i].healthy ? 1 : 0);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

static void on_models_done(struct evhttp_request *r, void *arg) {
    struct evhttp_request *client = arg;
    int code = r ? evhttp_request_get_response_code(r) : 0;
    if (!code) {
        evhttp_send_error(client, 502, "no answer from the decode instance");
        return;
    }
    evhttp_add_header(evhttp_request_get_output_headers(client), "Content-Type", "application/json");
    evhttp_send_reply(client, code, "OK", evhttp_request_get_input_buffer(r));
}

static void on_request(struct evhttp_request *req, void *arg) {
    struct proxy *px = arg;
    const char *uri = evhttp_request_get_uri(req);
    char path[256];
    snprintf(path, sizeof path, "%s", uri ? uri : "/");
    char *qm = strchr(path, '?');
    if (qm) *qm = 0;
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    if (!strcmp(path, "/health")) {
        bool any = false;
        for (int i = 0; i < px->n_decode; i++)
            any |= decode_at(px, i)->healthy;
        struct evbuffer *b = evbuffer_new();
        evbuffer_add_printf(b, "{\"status\":\"%s\"}", any ? "ok" : "no decode instance is up");
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
        evhttp_send_reply(req, any ? 200 : 503, any ? "OK" : "Unavailable", b);
        evbuffer_free(b);
    } else if (!strcmp(path, "/metrics")) {
        handle_metrics(px, req);
    } else if (m == EVHTTP_REQ_POST && (!strcmp(path, "/v1/completions") || !strcmp(path, "/v1/chat/completions"))) {
        handle_generate(px, req, path);
    } else if (m == EVHTTP_REQ_GET && !strncmp(path, "/v1/models", 10)) {
        struct preq tmp = {.px = px, .tried_decode = 0};
        int d = pick_decode(px, &tmp);
        struct evhttp_connection *c = NULL;
        if (d < 0 || !upstream_send(px, decode_at(px, d), path, NULL, on_models_done, req, &c, NULL)) {
            evhttp_send_error(req, 503, "no decode instance is available");
        } else {
            decode_at(px, d)->inflight--;
            evhttp_connection_free_on_completion(c);
        }
    } else {
        struct preq tmp = {.client = req};
        reply_json(&tmp, 404,
                   "not found (the proxy serves /v1/completions, /v1/chat/completions, /v1/models, "
                   "/health, /metrics)");
    }
}

static void on_signal(evutil_socket_t fd, short ev, void *arg) {
    (void)fd;
    (void)ev;
    event_base_loopexit(((struct proxy *)arg)->base, NULL);
}

// --- command line ------------------------------------------------------------------------------

static bool add_upstreams(struct proxy *px, const char *list, bool prefill) {
    char *dup = xstrdup(list), *save = NULL;
    bool ok = true;
    for (char *t = strtok_r(dup, ",", &save); t && ok; t = strtok_r(NULL, ",", &save)) {
        if (px->n_prefill + px->n_decode >= PROXY_MAX_UPSTREAMS) {
            fprintf(stderr, "atomc proxy: at most %d instances\n", PROXY_MAX_UPSTREAMS);
            ok = false;
            break;
        }
        char url[200];
        snprintf(url, sizeof url, "%s%s", strstr(t, "://") ? "" : "http://", t);
        struct evhttp_uri *uri = evhttp_uri_parse(url);
        const char *host = uri ? evhttp_uri_get_host(uri) : NULL;
        const char *scheme = uri ? evhttp_uri_get_scheme(uri) : NULL;
        int port = uri ? evhttp_uri_get_port(uri) : -1;
        if (!host || !*host || (scheme && strcmp(scheme, "http"))) {
            fprintf(stderr, "atomc proxy: '%s' is not an http://host:port URL\n", t);
            ok = false;
        } else {
            struct upstream *u = &px->up[px->n_prefill + px->n_decode];
            memset(u, 0, sizeof *u);
            snprintf(u->host, sizeof u->host, "%s", host);
            u->port = port > 0 ? port : 80;
            snprintf(u->url, sizeof u->url, "http://%s:%d", host, u->port);
            u->prefill = prefill;
            if (prefill)
                px->n_prefill++;
            else
                px->n_decode++;
        }
        if (uri) evhttp_uri_free(uri);
    }
    free(dup);
    return ok;
}

static void proxy_usage(FILE *f) {
    fprintf(f, "usage: atomc proxy --prefill URL[,URL...] --decode URL[,URL...] [options]\n\n"
               "OpenAI-compatible front of prefill/decode disaggregated atomc (or vLLM) instances: each request\n"
               "is prefilled on a prefill instance (max_tokens 1, kv_transfer_params) and decoded on a decode\n"
               "instance, whose answer is streamed back.\n\n"
               "options:\n"
               "  --host H                 address to listen on (default 127.0.0.1)\n"
               "  --port N                 TCP port (default 8000)\n"
               "  --prefill URL[,URL...]   prefill instances (kv_producer), round robin\n"
               "  --decode URL[,URL...]    decode instances (kv_consumer)\n"
               "  --policy round_robin|least_tokens   decode choice (default round_robin)\n"
               "  --health-interval S      seconds between health checks (default 1)\n"
               "  --timeout S              upstream request timeout in seconds (default 600)\n"
               "  -h, --help\n");
}

// Requests with the prefill list's order matter: prefill instances come first in px->up.
int cmd_proxy(int argc, char **argv) {
    struct proxy px;
    memset(&px, 0, sizeof px);
    px.health_interval_s = 1;
    px.timeout_s = 600;
    const char *host = "127.0.0.1", *prefill = NULL, *decode = NULL;
    int port = 8000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            proxy_usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "atomc proxy: unknown option or missing value: '%s' (see --help)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--host"))
            host = v;
        else if (!strcmp(a, "--port")) {
            if (!cli_parse_int(v, "--port", 0, 65535, &port)) return 2;
        } else if (!strcmp(a, "--prefill"))
            prefill = v;
        else if (!strcmp(a, "--decode"))
            decode = v;
        else if (!strcmp(a, "--policy")) {
            if (!strcmp(v, "least_tokens"))
                px.least_tokens = true;
            else if (strcmp(v, "round_robin")) {
                fprintf(stderr, "atomc proxy: --policy must be round_robin or least_tokens, got '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--health-interval") || !strcmp(a, "--timeout")) {
            double d;
            if (!cli_parse_double(v, a, &d) || d <= 0 || d > 86400) {
                fprintf(stderr, "atomc proxy: %s must be a number of seconds in (0, 86400]\n", a);
                return 2;
            }
            if (a[2] == 'h')
                px.health_interval_s = d;
            else
                px.timeout_s = d;
        } else {
            fprintf(stderr, "atomc proxy: unknown option '%s' (see --help)\n", a);
            return 2;
        }
    }
    if (!prefill || !decode) {
        fprintf(stderr, "atomc proxy: --prefill and --decode are required (see --help)\n");
        return 2;
    }
    // Prefill instances first, then decode (decode_at indexes past them).
    if (!add_upstreams(&px, prefill, true) || !add_upstreams(&px, decode, false)) return 2;
    signal(SIGPIPE, SIG_IGN);
    px.base = event_base_new();
    px.http = px.base ? evhttp_new(px.base) : NULL;
    if (!px.http) {
        fprintf(stderr, "atomc proxy: cannot create the event loop\n");
        return 1;
    }
    evhttp_set_allowed_methods(px.http, EVHTTP_REQ_GET | EVHTTP_REQ_POST);
    evhttp_set_gencb(px.http, on_request, &px);
    if (!evhttp_bind_socket_with_handle(px.http, host, (ev_uint16_t)port)) {
        fprintf(stderr, "atomc proxy: cannot listen on %s:%d\n", host, port);
        evhttp_free(px.http);
        event_base_free(px.base);
        return 1;
    }
    px.health_ev = evtimer_new(px.base, health_tick, &px);
    px.sig_int = evsignal_new(px.base, SIGINT, on_signal, &px);
    px.sig_term = evsignal_new(px.base, SIGTERM, on_signal, &px);
    event_add(px.sig_int, NULL);
    event_add(px.sig_term, NULL);
    health_tick(-1, 0, &px);
    LOG_INFO("proxy: listening on %s:%d, %d prefill and %d decode instances (%s)", host, port, px.n_prefill,
             px.n_decode, px.least_tokens ? "least outstanding tokens" : "round robin");
    event_base_dispatch(px.base);
    for (int i = 0; i < px.n_prefill + px.n_decode; i++)
        for (int k = 0; k < px.up[i].n_idle; k++)
            evhttp_connection_free(px.up[i].idle[k]);
    event_free(px.health_ev);
    event_free(px.sig_int);
    event_free(px.sig_term);
    evhttp_free(px.http);
    event_base_free(px.base);
    return 0;
}
