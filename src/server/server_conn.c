// Connection management of the HTTP server: the listening socket, the connection cap, the
// keep-alive and request-read deadlines, and descriptor-exhaustion handling (issue 28 item 1).
//
// evhttp (libevent 2.1) has no connection limit, no per-request deadline (its timeout is an
// inactivity timeout, which a client sending a byte a minute never trips) and no hook when a
// connection opens. So:
//   - the listener is ours (evconnlistener with an error callback), handed to evhttp with
//     evhttp_bind_listener; on EMFILE/ENFILE the error callback sheds the newest connection
//     through a reserved descriptor, evicts an idle connection, and backs off briefly, instead of
//     libevent's default of logging and retrying in a tight loop;
//   - evhttp's bufferevent callback tells us a connection is being made; the connection itself
//     (the evhttp_connection, found as the bufferevent's callback argument) is registered a moment
//     later, before any of its I/O runs, with a close callback that unregisters it;
//   - a sweep every SWEEP_MS closes connections that have no request in progress and either sent
//     nothing for --timeout-keep-alive seconds or have been sending one request for longer than
//     --timeout-request-read seconds (headers and body together: evhttp 2.1 tells a server nothing
//     between the first byte and the complete request). Arrival of bytes is read from the kernel
//     (TCP_INFO's count of bytes received), so nothing is read from the socket here.
// Everything runs on the loop thread.
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/listener.h>
#include <event2/util.h>
#include <fcntl.h>
#include <linux/tcp.h> // struct tcp_info with tcpi_bytes_received (glibc's lacks it)
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "server/server_internal.h"

#define SWEEP_MS 250
#define BACKOFF_MS 50

struct srv_conn {
    struct server *srv;
    struct evhttp_connection *evcon;
    int fd;
    struct srv_conn *prev, *next; // s->conns, oldest first
    bool busy;                    // a request was handed to the router and its response is not written yet
    double t_idle;                // when the connection last became free of requests (open or response written)
    long long rx_at_idle;         // bytes received by then (TCP_INFO), or -1 if the kernel does not say
    double t_request;             // when data of a next request was first seen (0 = none yet)
    void (*user_closecb)(struct evhttp_connection *, void *); // generate.c's, chained from ours
    void *user_closecb_arg;
};

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

// ---------------------------------------------------------------- helpers

// Bytes received on fd so far, from the kernel (Linux 4.1+); -1 if unknown.
static long long bytes_received(int fd) {
    struct tcp_info ti;
    memset(&ti, 0, sizeof ti);
    socklen_t len = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return -1;
    if (len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof ti.tcpi_bytes_received) return -1;
    return (long long)ti.tcpi_bytes_received;
}

static void conn_mark_idle(struct srv_conn *c) {
    c->busy = false;
    c->t_idle = time_now_s();
    c->rx_at_idle = bytes_received(c->fd);
    c->t_request = 0;
}

// Data of a next request has arrived since the connection became idle.
static bool conn_has_new_data(struct srv_conn *c) {
    if (c->rx_at_idle < 0) return false;
    return bytes_received(c->fd) > c->rx_at_idle;
}

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
    if (c->fd >= 0 && c->fd < s->conn_by_fd_cap && s->conn_by_fd[c->fd] == c) s->conn_by_fd[c->fd] = NULL;
}

static struct srv_conn *conn_of(struct server *s, struct evhttp_connection *evcon) {
    if (!evcon) return NULL;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(evcon);
    int fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0 || fd >= s->conn_by_fd_cap) return NULL;
    struct srv_conn *c = s->conn_by_fd[fd];
    return c && c->evcon == evcon ? c : NULL;
}

static void on_conn_closed(struct evhttp_connection *evcon, void *arg) {
    struct srv_conn *c = arg;
    struct server *s = c->srv;
    if (c->user_closecb) c->user_closecb(evcon, c->user_closecb_arg);
    conn_unlink(s, c);
    free(c);
}

// Closes a connection that has no request in progress (evhttp does the same on its own timeouts).
static void conn_close(struct srv_conn *c) {
    CHECK(!c->busy);
    evhttp_connection_free(c->evcon); // runs on_conn_closed
}

// Makes room for one more connection: the oldest connection with no request in progress,
// preferring one that has sent nothing. Returns false when every connection is busy.
static bool evict_one(struct server *s, struct srv_conn *except) {
    struct srv_conn *reading = NULL;
    for (struct srv_conn *c = s->conns; c; c = c->next) {
        if (c->busy || c == except) continue;
        if (!c->t_request && !conn_has_new_data(c)) {
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

// ---------------------------------------------------------------- registration

// evhttp asks for the new connection's bufferevent; the connection is registered once evhttp has
// built it (on_pending, activated now and run before any I/O of the new socket).
static struct bufferevent *on_new_bev(struct event_base *base, void *arg) {
    struct server *s = arg;
    struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    if (!bev) return NULL;
    if (s->n_pending == s->cap_pending) {
        s->cap_pending = s->cap_pending ? 2 * s->cap_pending : 16;
        s->pending = xrealloc(s->pending, (size_t)s->cap_pending * sizeof *s->pending);
    }
    s->pending[s->n_pending++] = bev;
    event_active(s->pending_ev, EV_TIMEOUT, 1);
    return bev;
}

static void register_conn(struct server *s, struct bufferevent *bev) {
    void *arg = NULL;
    bufferevent_getcb(bev, NULL, NULL, NULL, &arg);
    struct evhttp_connection *evcon = arg;
    int fd = bufferevent_getfd(bev);
    if (!evcon || evhttp_connection_get_bufferevent(evcon) != bev || fd < 0) return; // not evhttp's: untracked
    if (fd >= s->conn_by_fd_cap) {
        int cap = s->conn_by_fd_cap ? s->conn_by_fd_cap : 256;
        while (cap <= fd)
            cap *= 2;
        s->conn_by_fd = xrealloc(s->conn_by_fd, (size_t)cap * sizeof *s->conn_by_fd);
        memset(s->conn_by_fd + s->conn_by_fd_cap, 0, (size_t)(cap - s->conn_by_fd_cap) * sizeof *s->conn_by_fd);
        s->conn_by_fd_cap = cap;
    }
    struct srv_conn *c = xcalloc(1, sizeof *c);
    c->srv = s;
    c->evcon = evcon;
    c->fd = fd;
    c->prev = s->conns_tail;
    if (s->conns_tail)
        s->conns_tail->next = c;
    else
        s->conns = c;
    s->conns_tail = c;
    s->n_conns++;
    s->metrics.connections_open = (uint64_t)s->n_conns;
    s->conn_by_fd[fd] = c;
    conn_mark_idle(c);
    if (c->rx_at_idle > 0) c->t_request = c->t_idle; // a new connection: any data is a request
    evhttp_connection_set_closecb(evcon, on_conn_closed, c);
    s->metrics.connections_total++;
    if (s->n_conns > s->max_connections && !evict_one(s, c)) {
        // Every other connection has a request in progress: this one goes.
        s->metrics.connections_shed_total++;
        server_log_limited(&s->log_cap, "connection limit (%d) reached with every connection busy; closing new ones",
                           s->max_connections);
        conn_close(c);
    }
}

static void on_pending(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    // register_conn may close connections, which never adds to the pending list.
    for (int i = 0; i < s->n_pending; i++)
        register_conn(s, s->pending[i]);
    s->n_pending = 0;
}

void server_conn_set_closecb(struct server *s, struct evhttp_connection *evcon,
                             void (*cb)(struct evhttp_connection *, void *), void *arg) {
    struct srv_conn *c = conn_of(s, evcon);
    if (!c) {
        evhttp_connection_set_closecb(evcon, cb, arg);
        return;
    }
    c->user_closecb = cb;
    c->user_closecb_arg = arg;
}

void server_conn_request_begin(struct server *s, struct evhttp_request *req) {
    struct srv_conn *c = conn_of(s, evhttp_request_get_connection(req));
    if (c) c->busy = true;
}

void server_conn_request_end(struct server *s, struct evhttp_request *req) {
    struct srv_conn *c = conn_of(s, evhttp_request_get_connection(req));
    if (c) conn_mark_idle(c);
}

// ---------------------------------------------------------------- deadlines

// Every SWEEP_MS: the keep-alive and request-read deadlines of connections with no request in
// progress (a request being handled is bounded by the engine and by evhttp's write timeout).
static void on_sweep(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    double now = time_now_s();
    for (struct srv_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (c->busy) continue;
        if (!c->t_request && conn_has_new_data(c)) c->t_request = now;
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

static void on_backoff_end(evutil_socket_t fd, short what, void *arg) {
    struct server *s = arg;
    if (s->listener) evconnlistener_enable(s->listener);
}

static void on_sweep(evutil_socket_t fd, short what, void *arg);

static int find_sweep(const struct event_base *base, const struct event *ev, void *arg) {
    if (event_get_callback(ev) != on_sweep) return 0;
    *(struct server **)arg = event_get_callback_arg(ev);
    return 1;
}

// The listener's callback argument is evhttp's (evhttp_bind_listener sets it), so the server is
// found through its sweep timer, the one event of this base whose callback is on_sweep.
static void on_accept_error(struct evconnlistener *lev, void *http) {
    struct server *s = NULL;
    event_base_foreach_event(evconnlistener_get_base(lev), find_sweep, &s);
    CHECK(s);
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
    s->max_connections = s->opt.max_connections > 0 ? s->opt.max_connections : server_default_max_connections();
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    s->pending_ev = event_new(s->base, -1, 0, on_pending, s);
    s->backoff_ev = evtimer_new(s->base, on_backoff_end, s);
    s->sweep_ev = event_new(s->base, -1, EV_PERSIST, on_sweep, s);
    if (!s->pending_ev || !s->backoff_ev || !s->sweep_ev)
        return error_set(err, ATOMC_ERR_INTERNAL, "libevent initialisation failed");
    struct timeval tv = {0, SWEEP_MS * 1000};
    event_add(s->sweep_ev, &tv);
    evhttp_set_bevcb(s->http, on_new_bev, s);

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
    s->listener =
        evconnlistener_new_bind(s->base, NULL, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC,
                                1024, ai->ai_addr, (int)ai->ai_addrlen);
    int e = errno;
    evutil_freeaddrinfo(ai);
    if (!s->listener)
        return error_set(err, ATOMC_ERR_IO, "cannot listen on %s:%d: %s", s->host, s->opt.port, strerror(e));
    evconnlistener_set_error_cb(s->listener, on_accept_error);
    s->bound = evhttp_bind_listener(s->http, s->listener);
    if (!s->bound) {
        evconnlistener_free(s->listener);
        s->listener = NULL;
        return error_set(err, ATOMC_ERR_INTERNAL, "libevent initialisation failed");
    }
    return ATOMC_OK;
}

void server_conn_stop_accepting(struct server *s) {
    if (s->bound) {
        evhttp_del_accept_socket(s->http, s->bound); // frees the listener
        s->bound = NULL;
        s->listener = NULL;
    }
    if (s->backoff_ev) evtimer_del(s->backoff_ev);
}

void server_conn_free(struct server *s) {
    // evhttp_free has closed every connection by now (each unregistered itself).
    if (s->pending_ev) event_free(s->pending_ev);
    if (s->backoff_ev) event_free(s->backoff_ev);
    if (s->sweep_ev) event_free(s->sweep_ev);
    free(s->pending);
    free(s->conn_by_fd);
    if (s->reserve_fd >= 0) close(s->reserve_fd);
}
