// The HTTP/1.1 transport of the server and its connection management (issue 28 items 1, 5, 6):
// libevent for the loop and the sockets (an evconnlistener, one bufferevent per connection),
// llhttp (Node.js's parser, built from Debian's node-llhttp sources) for the bytes of requests.
//
// Requests. One request per connection at a time: when llhttp completes a message the parser is
// paused and the request handed to the router (server_handle_request); reading stops until its
// response has been written out, then the next (pipelined) request is parsed from what is
// buffered, so responses keep the order of requests. Bodies are decoded by llhttp (Content-Length
// or chunked) into an evbuffer. llhttp is strict by default (NUL / CR / control characters in
// values, whitespace before a colon, CL + TE, duplicate Content-Length, bad chunk sizes); on top
// of it, RFC 9112's rules where it is lenient are checked here on the raw header section (kept
// for each request, at most --max-header-bytes): a bare LF (a line feed not after a CR) and
// obs-fold (a header line that starts with whitespace), and on the parsed headers: one Host in
// HTTP/1.1, one Content-Length, no transfer coding but a final "chunked" (501), HTTP/1.0 or 1.1
// only (505), an Expect other than 100-continue (417), the body limit (413, from
// Content-Length before the body is read), the header limit (431). Each error is an OpenAI-style
// JSON body (server_send_error) with Connection: close, so bytes behind a bad request are never
// read as a next request.
//
// Responses: a complete body with Content-Length, or a stream in chunked coding (HTTP/1.0:
// unframed, ended by closing). After the final response the request belongs to the transport:
// its done callback runs when the response is written out or the connection dies, and the
// request is freed. A connection that dies (reset, write error, write timeout, eviction) before
// the final response runs the request's close callback, after which the request is freed.
// Half-close: end of input after a complete request is not a departure; the response is written
// and the connection closed after it.
//
// Connections: a cap (--max-connections), the keep-alive deadline (no byte of a next request for
// --timeout-keep-alive seconds) and the request-read deadline (headers and body together within
// --timeout-request-read seconds of the first byte), checked by a sweep every SWEEP_MS; on
// EMFILE/ENFILE the accept error callback sheds the newest connection through a reserved
// descriptor, evicts an idle connection, and backs off briefly. Everything runs on the loop thread.
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/listener.h>
#include <event2/util.h>
#include <fcntl.h>
#include <llhttp.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "server/server_internal.h"

#define SWEEP_MS 250
#define BACKOFF_MS 50
#define HEAD_PIECE 16384 // header bytes handed to llhttp at a time (the raw copy stays this small)
#define LINGER_S 2.0     // after refusing a request: how long its remaining bytes are read and dropped

// A growable byte string.
struct sbuf {
    char *p;
    size_t n, cap;
};

static void sbuf_add(struct sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        b->p = xrealloc(b->p, cap);
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

struct http_header {
    char *name, *value;
};

struct http_req {
    struct srv_conn *conn;
    struct sbuf raw;   // the header section as received (request line to the empty line)
    struct sbuf url;   // request target
    char *path;        // its path (before '?')
    struct sbuf field, value;
    struct http_header *headers;
    int n_headers, cap_headers;
    bool in_value;
    bool headers_done, checked, complete, kick;
    int method, major, minor;
    bool keep_alive;
    struct evbuffer *body;
    int err_code;      // set by a callback that stopped the parser
    char err_msg[200];
    // response
    struct sbuf out_headers; // "Name: value\r\n" lines added by the handler
    bool close_after;        // Connection: close
    bool started, ended, chunked;
    void (*closecb)(struct http_req *, void *);
    void *closecb_arg;
    void (*donecb)(void *);
    void *donecb_arg;
};

struct srv_conn {
    struct server *srv;
    struct bufferevent *bev;
    int fd;
    struct srv_conn *prev, *next; // s->conns, oldest first
    llhttp_t parser;
    struct http_req *req; // the request being read, handled or written out; NULL between requests
    bool busy;            // req was handed to the router; its response is not written out yet
    bool peer_eof;        // the client shut down its write side
    double t_idle;        // when the connection last became free of requests (open or response written)
    double t_request;     // when the first byte of the request being read arrived (0 = none yet)
    bool linger;          // refused a request: the client may still be sending; discard until it stops
    double t_linger;
    int depth;            // transport frames of this connection on the stack
    bool dead;            // closed while depth > 0: freed when the outermost frame returns
};

static llhttp_settings_t parser_settings;

// ---------------------------------------------------------------- rate-limited log lines

void server_log_limited(struct server_log_limit *l, const char *fmt, ...) {
    double now = time_now_s();
    l->count++;
    if (l->t_last > 0 && now - l->t_last < SERVER_LOG_LIMIT_S) return;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (l->count > 1)
        LOG_WARN("%s (%llu times since the last report)", msg, (unsigned long long)l->count);
    else
        LOG_WARN("%s", msg);
    l->count = 0;
    l->t_last = now;
}

// ---------------------------------------------------------------- requests

static struct http_req *req_new(struct srv_conn *c) {
    struct http_req *q = xcalloc(1, sizeof *q);
    q->conn = c;
    q->body = evbuffer_new();
    CHECK(q->body);
    return q;
}

static void req_free(struct http_req *q) {
    if (!q) return;
    free(q->raw.p);
    free(q->url.p);
    free(q->path);
    free(q->field.p);
    free(q->value.p);
    for (int i = 0; i < q->n_headers; i++) {
        free(q->headers[i].name);
        free(q->headers[i].value);
    }
    free(q->headers);
    if (q->body) evbuffer_free(q->body);
    free(q->out_headers.p);
    free(q);
}

int http_req_method(const struct http_req *q) { return q->method; }

const char *http_req_path(const struct http_req *q) { return q->path ? q->path : "/"; }

const char *http_req_header(const struct http_req *q, const char *name) {
    for (int i = 0; i < q->n_headers; i++)
        if (!strcasecmp(q->headers[i].name, name)) return q->headers[i].value;
    return NULL;
}

void http_req_body(struct http_req *q, const char **p, size_t *len) {
    *len = evbuffer_get_length(q->body);
    *p = *len ? (const char *)evbuffer_pullup(q->body, -1) : "";
}

struct evbuffer *http_req_body_buffer(struct http_req *q) { return q->body; }

int http_req_fd(const struct http_req *q) { return q->conn ? q->conn->fd : -1; }

size_t http_req_output_pending(const struct http_req *q) {
    return q->conn ? evbuffer_get_length(bufferevent_get_output(q->conn->bev)) : 0;
}

void http_req_set_closecb(struct http_req *q, void (*cb)(struct http_req *, void *), void *arg) {
    q->closecb = cb;
    q->closecb_arg = arg;
}

void http_req_set_donecb(struct http_req *q, void (*cb)(void *), void *arg) {
    q->donecb = cb;
    q->donecb_arg = arg;
}

// ---------------------------------------------------------------- responses

void http_resp_add_header(struct http_req *q, const char *name, const char *value) {
    CHECK(!q->started);
    // A value with CR or LF would split the response; handlers never pass one, refuse loudly.
    CHECK(!strpbrk(name, "\r\n:") && !strpbrk(value, "\r\n"));
    sbuf_add(&q->out_headers, name, strlen(name));
    sbuf_add(&q->out_headers, ": ", 2);
    sbuf_add(&q->out_headers, value, strlen(value));
    sbuf_add(&q->out_headers, "\r\n", 2);
}

void http_resp_close(struct http_req *q) { q->close_after = true; }

static const char *reason_phrase(int code) {
    switch (code) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    }
    return code < 300 ? "OK" : code < 500 ? "Client Error" : "Server Error";
}

static void write_head(struct http_req *q, int code, const char *framing) {
    struct evbuffer *out = bufferevent_get_output(q->conn->bev);
    q->started = true;
    if (!q->keep_alive) q->close_after = true;
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\n%s", code, reason_phrase(code), framing);
    if (q->close_after) evbuffer_add(out, "Connection: close\r\n", 19);
    else if (q->major == 1 && q->minor == 0) evbuffer_add(out, "Connection: keep-alive\r\n", 24);
    if (q->out_headers.n) evbuffer_add(out, q->out_headers.p, q->out_headers.n);
    evbuffer_add(out, "\r\n", 2);
}

void http_resp_send(struct http_req *q, int code, const char *body, size_t len) {
    CHECK(!q->started && !q->ended);
    if (!q->conn) return;
    char framing[64];
    snprintf(framing, sizeof framing, "Content-Length: %zu\r\n", len);
    write_head(q, code, framing);
    if (q->method != HTTP_HEAD && len) bufferevent_write(q->conn->bev, body, len);
    q->ended = true;
}

void http_resp_start(struct http_req *q, int code) {
    CHECK(!q->started);
    if (!q->conn) return;
    // HTTP/1.0 has no chunked coding: the stream ends when the connection closes.
    q->chunked = !(q->major == 1 && q->minor == 0);
    if (!q->chunked) q->close_after = true;
    write_head(q, code, q->chunked ? "Transfer-Encoding: chunked\r\n" : "");
}

void http_resp_chunk(struct http_req *q, const void *data, size_t len) {
    CHECK(q->started && !q->ended);
    if (!q->conn || !len) return;
    struct evbuffer *out = bufferevent_get_output(q->conn->bev);
    if (q->chunked) evbuffer_add_printf(out, "%zx\r\n", len);
    evbuffer_add(out, data, len);
    if (q->chunked) evbuffer_add(out, "\r\n", 2);
}

void http_resp_end(struct http_req *q) {
    CHECK(q->started && !q->ended);
    if (!q->conn) return;
    if (q->chunked) bufferevent_write(q->conn->bev, "0\r\n\r\n", 5);
    q->ended = true;
}

// ---------------------------------------------------------------- connection list

static void conn_unlink(struct server *s, struct srv_conn *c) {
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        s->conns_tail = c->prev;
    c->prev = c->next = NULL;
    s->n_conns--;
    s->metrics.connections_open = (uint64_t)s->n_conns;
}

static void conn_mark_idle(struct srv_conn *c) {
    c->t_idle = time_now_s();
    c->t_request = 0;
}

// Closes the connection now: a request handed to the router and not answered runs its close
// callback, one whose response was being written out its done callback; both are then freed.
static void conn_close(struct srv_conn *c) {
    if (!c->bev) return; // already closed, waiting for the outermost frame
    struct server *s = c->srv;
    struct http_req *q = c->req;
    c->req = NULL;
    bufferevent_free(c->bev); // closes the socket
    c->bev = NULL;
    c->fd = -1;
    conn_unlink(s, c);
    if (q) {
        q->conn = NULL;
        if (c->busy && !q->ended && q->closecb) q->closecb(q, q->closecb_arg);
        if (c->busy && q->donecb) q->donecb(q->donecb_arg);
        req_free(q);
    }
    c->busy = false;
    if (c->depth > 0) c->dead = true;
    else free(c);
}

void http_req_disconnect(struct http_req *q) {
    if (q->conn) conn_close(q->conn);
}

// Makes room for one more connection: the oldest connection with no request in progress,
// preferring one that has sent nothing. Returns false when every connection is busy.
static bool evict_one(struct server *s, struct srv_conn *except) {
    struct srv_conn *reading = NULL;
    for (struct srv_conn *c = s->conns; c; c = c->next) {
        if (c->busy || c == except) continue;
        if (!c->t_request) {
            s->metrics.connections_shed_total++;
            conn_close(c);
            return true;
        }
        if (!reading) reading = c;
    }
    if (!reading) return false;
    s->metrics.connections_shed_total++;
    conn_close(reading);
    return true;
}

// ---------------------------------------------------------------- parser callbacks

static struct http_req *req_of(llhttp_t *p) { return ((struct srv_conn *)p->data)->req; }

static int stop(struct http_req *q, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int stop(struct http_req *q, int code, const char *fmt, ...) {
    q->err_code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(q->err_msg, sizeof q->err_msg, fmt, ap);
    va_end(ap);
    return HPE_USER;
}

static int on_url(llhttp_t *p, const char *at, size_t n) {
    sbuf_add(&req_of(p)->url, at, n);
    return 0;
}

static void finish_header(struct http_req *q) {
    if (!q->in_value && !q->field.n) return;
    if (q->n_headers == q->cap_headers) {
        q->cap_headers = q->cap_headers ? 2 * q->cap_headers : 16;
        q->headers = xrealloc(q->headers, (size_t)q->cap_headers * sizeof *q->headers);
    }
    q->headers[q->n_headers].name = xstrdup(q->field.p ? q->field.p : "");
    q->headers[q->n_headers].value = xstrdup(q->value.p ? q->value.p : "");
    q->n_headers++;
    q->field.n = q->value.n = 0;
    if (q->field.p) q->field.p[0] = '\0';
    if (q->value.p) q->value.p[0] = '\0';
    q->in_value = false;
}

static int on_header_field(llhttp_t *p, const char *at, size_t n) {
    struct http_req *q = req_of(p);
    if (q->in_value) finish_header(q);
    sbuf_add(&q->field, at, n);
    return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n) {
    struct http_req *q = req_of(p);
    q->in_value = true;
    sbuf_add(&q->value, at, n);
    return 0;
}

// Pauses the parser so that the raw header section can be checked before any body byte.
static int on_headers_complete(llhttp_t *p) {
    struct http_req *q = req_of(p);
    finish_header(q);
    q->headers_done = true;
    q->method = llhttp_get_method(p);
    q->major = llhttp_get_http_major(p);
    q->minor = llhttp_get_http_minor(p);
    return HPE_PAUSED;
}

static int on_body(llhttp_t *p, const char *at, size_t n) {
    struct http_req *q = req_of(p);
    struct server *s = ((struct srv_conn *)p->data)->srv;
    if (evbuffer_get_length(q->body) + n > s->opt.max_body_bytes)
        return stop(q, 413, "request body larger than the limit of %zu bytes (--max-request-body-bytes)",
                    s->opt.max_body_bytes);
    evbuffer_add(q->body, at, n);
    return 0;
}

static int on_message_complete(llhttp_t *p) {
    struct http_req *q = req_of(p);
    q->complete = true;
    // No protocol upgrade (CONNECT, Upgrade): the request is answered and the connection closed.
    q->keep_alive = llhttp_should_keep_alive(p) && !llhttp_get_upgrade(p);
    return HPE_PAUSED;
}

static void settings_init(void) {
    if (parser_settings.on_message_complete) return;
    llhttp_settings_init(&parser_settings);
    parser_settings.on_url = on_url;
    parser_settings.on_header_field = on_header_field;
    parser_settings.on_header_value = on_header_value;
    parser_settings.on_headers_complete = on_headers_complete;
    parser_settings.on_body = on_body;
    parser_settings.on_message_complete = on_message_complete;
}

// ---------------------------------------------------------------- RFC 9112 checks

static size_t count_header(const struct http_req *q, const char *name) {
    size_t n = 0;
    for (int i = 0; i < q->n_headers; i++) n += !strcasecmp(q->headers[i].name, name);
    return n;
}

// What llhttp 8 lets through, checked once the header section is complete. 0 or the status
// with q->err_msg.
static int check_headers(struct srv_conn *c, struct http_req *q) {
    struct server *s = c->srv;
    const char *raw = q->raw.p ? q->raw.p : "";
    for (size_t i = 0; i < q->raw.n; i++) {
        if (raw[i] != '\n') continue;
        if (i == 0 || raw[i - 1] != '\r')
            return stop(q, 400, "bare LF in the request head (RFC 9112 2.2: lines end with CRLF)"), 400;
        if (i + 1 < q->raw.n && (raw[i + 1] == ' ' || raw[i + 1] == '\t'))
            return stop(q, 400, "obs-fold (a header line starting with whitespace) is not accepted (RFC 9112 5.2)"),
                   400;
    }
    if (q->major != 1 || q->minor > 1)
        return stop(q, 505, "HTTP/%d.%d is not supported (HTTP/1.0 and HTTP/1.1 only)", q->major, q->minor), 505;
    for (int i = 0; i < q->n_headers; i++) {
        const unsigned char *v = (const unsigned char *)q->headers[i].value;
        for (; *v; v++)
            if ((*v < 0x20 && *v != '\t') || *v == 0x7f)
                return stop(q, 400, "header '%.60s' has a control character (0x%02x) in its value", q->headers[i].name,
                            *v),
                       400;
    }
    if (count_header(q, "Content-Length") > 1)
        return stop(q, 400, "more than one Content-Length header (RFC 9112 6.3)"), 400;
    const char *te = http_req_header(q, "Transfer-Encoding");
    if (te && http_req_header(q, "Content-Length"))
        return stop(q, 400, "Content-Length together with Transfer-Encoding (RFC 9112 6.3)"), 400;
    if (count_header(q, "Transfer-Encoding") > 1 || (te && strcasecmp(te, "chunked")))
        return stop(q, 501, "unsupported Transfer-Encoding '%.60s' (only 'chunked')", te), 501;
    if (q->minor == 1 && count_header(q, "Host") != 1)
        return stop(q, 400, count_header(q, "Host") ? "more than one Host header (RFC 9112 3.2)"
                                                      : "HTTP/1.1 request without a Host header (RFC 9112 3.2)"),
               400;
    if ((c->parser.flags & F_CONTENT_LENGTH) && c->parser.content_length > s->opt.max_body_bytes)
        return stop(q, 413,
                    "request body of %llu bytes is larger than the limit of %zu bytes (--max-request-body-bytes)",
                    (unsigned long long)c->parser.content_length, s->opt.max_body_bytes),
               413;
    if ((q->method == HTTP_POST || q->method == HTTP_PUT || q->method == HTTP_PATCH) && !te &&
        !http_req_header(q, "Content-Length"))
        return stop(q, 411, "a %s request needs Content-Length (or Transfer-Encoding: chunked)",
                    llhttp_method_name((llhttp_method_t)q->method)),
               411;
    const char *expect = http_req_header(q, "Expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue") || count_header(q, "Expect") > 1)
            return stop(q, 417, "unsupported expectation '%.60s' (only '100-continue')", expect), 417;
        if (q->minor == 1 && ((c->parser.flags & F_CHUNKED) || c->parser.content_length > 0))
            bufferevent_write(c->bev, "HTTP/1.1 100 Continue\r\n\r\n", 25);
    }
    // The path of the target, NUL-terminated: origin form, or absolute form (RFC 9112 3.2.2).
    const char *u = q->url.p ? q->url.p : "";
    if (!strncasecmp(u, "http://", 7) || !strncasecmp(u, "https://", 8)) {
        u = strstr(u, "//") + 2;
        u += strcspn(u, "/?#");
    }
    size_t plen = strcspn(u, "?#");
    q->path = xcalloc(1, plen + 2);
    memcpy(q->path, u, plen);
    if (!plen) q->path[0] = '/';
    return 0;
}

// ---------------------------------------------------------------- reading

static void conn_parse(struct srv_conn *c);

// Answers the request being read with an error and closes the connection once it is written.
static void conn_fail(struct srv_conn *c, int code, const char *msg) {
    struct http_req *q = c->req;
    struct oai_error e;
    c->linger = true;
    oai_error_set(&e, code, NULL, "%s", msg);
    if (code == 413 || code == 431)
        snprintf(e.code, sizeof e.code, "%s", code == 413 ? "payload_too_large" : "headers_too_large");
    c->busy = true;
    bufferevent_disable(c->bev, EV_READ);
    http_resp_close(q);
    q->keep_alive = false;
    server_send_error(c->srv, q, &e);
}

static int parse_error_status(llhttp_errno_t e) {
    switch (e) {
    case HPE_INVALID_METHOD: return 501;
    case HPE_INVALID_TRANSFER_ENCODING: return 501;
    case HPE_INVALID_VERSION: return 505;
    default: return 400;
    }
}

static void conn_parse(struct srv_conn *c) {
    struct server *s = c->srv;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    while (c->bev && !c->busy) {
        size_t avail = evbuffer_get_length(in);
        // After the header section llhttp completes a message without a body only when called
        // again, with or without more bytes.
        bool kick = c->req && c->req->kick;
        if (!avail && !kick) break;
        if (!c->req) {
            c->req = req_new(c);
            if (!c->t_request) c->t_request = time_now_s();
        }
        struct http_req *q = c->req;
        q->kick = false;
        const char *data = "";
        size_t n = 0;
        if (avail) {
            struct evbuffer_iovec v;
            CHECK(evbuffer_peek(in, -1, NULL, &v, 1) >= 1);
            data = v.iov_base;
            n = v.iov_len;
        }
        bool head = !q->headers_done;
        if (head) {
            if (n > HEAD_PIECE) n = HEAD_PIECE;
            sbuf_add(&q->raw, data, n);
        }
        llhttp_errno_t e = llhttp_execute(&c->parser, data, n);
        size_t used = n;
        if (e != HPE_OK) {
            const char *pos = llhttp_get_error_pos(&c->parser);
            used = pos && pos >= data && pos <= data + n ? (size_t)(pos - data) : n;
        }
        if (head) q->raw.n -= n - used; // what follows the header section is not part of it
        if (used) evbuffer_drain(in, used);
        if (head && q->raw.n > s->opt.max_header_bytes) {
            conn_fail(c, 431, "request header section larger than the limit (--max-header-bytes)");
            return;
        }
        if (e == HPE_OK) continue;
        if (e == HPE_PAUSED || (e == HPE_PAUSED_UPGRADE && q->complete)) {
            llhttp_resume(&c->parser);
            if (q->headers_done && !q->checked) {
                q->checked = true;
                if (check_headers(c, q)) {
                    conn_fail(c, q->err_code, q->err_msg);
                    return;
                }
                q->kick = true;
            }
            if (q->complete) {
                // Handed to the router; reading waits until the response is written out.
                c->busy = true;
                bufferevent_disable(c->bev, EV_READ);
                s->metrics.http_requests_total++;
                server_handle_request(s, q);
                return;
            }
            continue;
        }
        if (e == HPE_USER) {
            conn_fail(c, q->err_code, q->err_msg);
            return;
        }
        char msg[200];
        const char *why = llhttp_get_error_reason(&c->parser);
        snprintf(msg, sizeof msg, "malformed HTTP request: %s (%s)", why ? why : llhttp_errno_name(e),
                 llhttp_errno_name(e));
        conn_fail(c, parse_error_status(e), msg);
        return;
    }
}

// Runs f on c with the connection kept alive until it returns.
#define CONN_ENTER(c) ((c)->depth++)
#define CONN_LEAVE(c)                                                                                                  \
    do {                                                                                                               \
        if (--(c)->depth == 0 && (c)->dead) {                                                                          \
            free(c);                                                                                                   \
            return;                                                                                                    \
        }                                                                                                              \
    } while (0)

static void on_read(struct bufferevent *bev, void *arg) {
    struct srv_conn *c = arg;
    if (c->t_linger > 0) { // the refusal is written; drop what the client still sends
        evbuffer_drain(bufferevent_get_input(bev), evbuffer_get_length(bufferevent_get_input(bev)));
        return;
    }
    CONN_ENTER(c);
    conn_parse(c);
    CONN_LEAVE(c);
}

// The response is written out: the next request, or the end of the connection.
static void response_done(struct srv_conn *c) {
    struct http_req *q = c->req;
    c->req = NULL;
    c->busy = false;
    bool close_after = q->close_after;
    if (q->donecb) q->donecb(q->donecb_arg);
    req_free(q);
    if (!c->bev) return;
    if (close_after && c->linger && !c->peer_eof) {
        // Closing with unread bytes would reset the connection, and the client could lose the
        // refusal before reading it: shut down the write side, read and drop for a while
        // (the sweep ends it), close on the client's end of input.
        c->t_linger = time_now_s();
        shutdown(c->fd, SHUT_WR);
        evbuffer_drain(bufferevent_get_input(c->bev), evbuffer_get_length(bufferevent_get_input(c->bev)));
        bufferevent_enable(c->bev, EV_READ);
        return;
    }
    if (close_after) {
        conn_close(c);
        return;
    }
    conn_mark_idle(c);
    if (c->peer_eof && evbuffer_get_length(bufferevent_get_input(c->bev)) == 0) {
        conn_close(c);
        return;
    }
    bufferevent_enable(c->bev, EV_READ);
    conn_parse(c);
}

static void on_write(struct bufferevent *bev, void *arg) {
    struct srv_conn *c = arg;
    if (!c->busy || !c->req || !c->req->ended) return;
    CONN_ENTER(c);
    response_done(c);
    CONN_LEAVE(c);
}

static void on_event(struct bufferevent *bev, short what, void *arg) {
    struct srv_conn *c = arg;
    CONN_ENTER(c);
    if ((what & BEV_EVENT_EOF) && !(what & BEV_EVENT_ERROR) && c->busy) {
        c->peer_eof = true; // half-close: the response is still written
    } else {
        if ((what & BEV_EVENT_EOF) && c->req && !c->busy && c->req->raw.n)
            LOG_DEBUG("connection closed by the client in the middle of a request");
        conn_close(c);
    }
    CONN_LEAVE(c);
}

// ---------------------------------------------------------------- deadlines

// Every SWEEP_MS: the keep-alive and request-read deadlines of connections with no request in
// progress (a request being handled is bounded by the engine and by the write timeout).
static void on_sweep(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    double now = time_now_s();
    for (struct srv_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (c->t_linger > 0) {
            if (now - c->t_linger > LINGER_S) conn_close(c);
            continue;
        }
        if (c->busy) continue;
        if (!c->t_request && now - c->t_idle > s->opt.timeout_keep_alive_s) {
            s->metrics.connections_timed_out_total++;
            conn_close(c);
        } else if (c->t_request && now - c->t_request > s->opt.request_read_timeout_s) {
            s->metrics.connections_timed_out_total++;
            server_log_limited(&s->log_slow, "closing a connection that sent an incomplete request for over %.0f s",
                               s->opt.request_read_timeout_s);
            conn_close(c);
        }
    }
}

// ---------------------------------------------------------------- accepting

static void on_accept(struct evconnlistener *lev, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg) {
    struct server *s = arg;
    struct bufferevent *bev = bufferevent_socket_new(s->base, fd, BEV_OPT_CLOSE_ON_FREE);
    if (!bev) {
        evutil_closesocket(fd);
        return;
    }
    struct srv_conn *c = xcalloc(1, sizeof *c);
    c->srv = s;
    c->bev = bev;
    c->fd = fd;
    llhttp_init(&c->parser, HTTP_REQUEST, &parser_settings);
    c->parser.data = c;
    c->prev = s->conns_tail;
    if (s->conns_tail)
        s->conns_tail->next = c;
    else
        s->conns = c;
    s->conns_tail = c;
    s->n_conns++;
    s->metrics.connections_open = (uint64_t)s->n_conns;
    s->metrics.connections_total++;
    conn_mark_idle(c);
    bufferevent_setcb(bev, on_read, on_write, on_event, c);
    // Stalled writes end the connection; reads are bounded by the sweep's deadlines.
    struct timeval w = {(time_t)s->opt.idle_timeout_s,
                        (suseconds_t)((s->opt.idle_timeout_s - (time_t)s->opt.idle_timeout_s) * 1e6)};
    bufferevent_set_timeouts(bev, NULL, &w);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    if (s->n_conns > s->max_connections && !evict_one(s, c)) {
        // Every other connection has a request in progress: this one goes.
        s->metrics.connections_shed_total++;
        server_log_limited(&s->log_cap, "connection limit (%d) reached with every connection busy; closing new ones",
                           s->max_connections);
        conn_close(c);
    }
}

static void on_backoff_end(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    if (s->listener) evconnlistener_enable(s->listener);
}

static void on_accept_error(struct evconnlistener *lev, void *arg) {
    struct server *s = arg;
    int err = EVUTIL_SOCKET_ERROR();
    if (err == EMFILE || err == ENFILE) {
        // Out of descriptors: the pending connection would make accept() fail forever (and the
        // loop spin). The reserved descriptor lets us take it and close it.
        s->metrics.connections_shed_total++;
        if (s->reserve_fd >= 0) {
            close(s->reserve_fd);
            s->reserve_fd = -1;
            int nfd = accept(evconnlistener_get_fd(lev), NULL, NULL);
            if (nfd >= 0) close(nfd);
            s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        }
        bool evicted = evict_one(s, NULL);
        server_log_limited(&s->log_accept, "accept(): %s; shed the newest connection (%d open, limit %d)",
                           strerror(err), s->n_conns, s->max_connections);
        if (evicted) return;
    } else {
        server_log_limited(&s->log_accept, "accept(): %s", strerror(err));
    }
    // Nothing could be freed: pause accepting briefly instead of retrying in a tight loop.
    evconnlistener_disable(lev);
    struct timeval tv = {0, BACKOFF_MS * 1000};
    evtimer_add(s->backoff_ev, &tv);
}

int server_default_max_connections(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 20)) return 1 << 16;
    long n = (long)rl.rlim_cur;
    long headroom = n / 8 > 64 ? n / 8 : 64; // model files, engine, log, listener, the reserve
    return n - headroom >= 16 ? (int)(n - headroom) : 16;
}

atomc_status server_conn_listen(struct server *s, struct error *err) {
    if (!(s->opt.timeout_keep_alive_s > 0) || !(s->opt.request_read_timeout_s > 0))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "--timeout-keep-alive and --timeout-request-read must be > 0");
    settings_init();
    s->max_connections = s->opt.max_connections > 0 ? s->opt.max_connections : server_default_max_connections();
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    s->backoff_ev = evtimer_new(s->base, on_backoff_end, s);
    s->sweep_ev = event_new(s->base, -1, EV_PERSIST, on_sweep, s);
    if (!s->backoff_ev || !s->sweep_ev) return error_set(err, ATOMC_ERR_INTERNAL, "libevent initialisation failed");
    struct timeval tv = {0, SWEEP_MS * 1000};
    event_add(s->sweep_ev, &tv);

    char port[16];
    snprintf(port, sizeof port, "%d", s->opt.port);
    struct evutil_addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_protocol = IPPROTO_TCP;
    hints.ai_flags = EVUTIL_AI_PASSIVE | EVUTIL_AI_ADDRCONFIG;
    int gai = evutil_getaddrinfo(s->host, port, &hints, &ai);
    if (gai != 0 || !ai)
        return error_set(err, ATOMC_ERR_IO, "cannot listen on %s:%d: %s", s->host, s->opt.port,
                         evutil_gai_strerror(gai));
    s->listener = evconnlistener_new_bind(s->base, on_accept, s,
                                          LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC, 1024,
                                          ai->ai_addr, (int)ai->ai_addrlen);
    int e = errno;
    evutil_freeaddrinfo(ai);
    if (!s->listener)
        return error_set(err, ATOMC_ERR_IO, "cannot listen on %s:%d: %s", s->host, s->opt.port, strerror(e));
    evconnlistener_set_error_cb(s->listener, on_accept_error);
    return ATOMC_OK;
}

int server_conn_listen_fd(const struct server *s) { return s->listener ? evconnlistener_get_fd(s->listener) : -1; }

void server_conn_stop_accepting(struct server *s) {
    if (s->listener) {
        evconnlistener_free(s->listener);
        s->listener = NULL;
    }
    if (s->backoff_ev) evtimer_del(s->backoff_ev);
}

void server_conn_close_all(struct server *s) {
    while (s->conns)
        conn_close(s->conns);
}

void server_conn_free(struct server *s) {
    server_conn_stop_accepting(s);
    server_conn_close_all(s);
    if (s->backoff_ev) event_free(s->backoff_ev);
    if (s->sweep_ev) event_free(s->sweep_ev);
    s->backoff_ev = s->sweep_ev = NULL;
    if (s->reserve_fd >= 0) close(s->reserve_fd);
    s->reserve_fd = -1;
}
