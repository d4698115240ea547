// TCP rendezvous (see rendezvous.h). Blocking sockets driven by poll() with one deadline,
// so no step can wait forever.
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "parallel/rendezvous.h"

#define RDV_MAGIC 0x61524456u // "aRDV"
#define RDV_MAX_BLOB (64 * 1024)
enum { RDV_HELLO = 1, RDV_BLOB, RDV_BARRIER, RDV_ERROR };

struct rendezvous {
    int nnodes, node_rank;
    double timeout_s;
    int *fds; // node 0: (nnodes) fds[k] = connection to node k (fds[0] unused); others: fds[0] = master
};

struct rdv_msg {
    uint32_t type, a, b, len;
};

static int ms_left(double deadline) {
    double left = deadline - time_now_s();
    return left <= 0 ? 0 : (int)(left * 1000) + 1;
}

// Sends or receives exactly n bytes before the deadline. Returns 0, or -1 with errno
// (ETIMEDOUT on deadline, ECONNRESET when the peer closed).
static int io_all(int fd, void *buf, size_t n, bool sending, double deadline) {
    unsigned char *p = buf;
    while (n > 0) {
        struct pollfd pf = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
        int pr = poll(&pf, 1, ms_left(deadline));
        if (pr < 0 && errno == EINTR) continue;
        if (pr < 0) return -1;
        if (pr == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k < 0) return -1;
        if (k == 0) {
            errno = ECONNRESET;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int msg_send(int fd, uint32_t type, uint32_t a, uint32_t b, const void *payload, uint32_t len,
                    double deadline) {
    uint32_t h[5] = {htonl(RDV_MAGIC), htonl(type), htonl(a), htonl(b), htonl(len)};
    if (io_all(fd, h, sizeof h, true, deadline)) return -1;
    return len ? io_all(fd, (void *)payload, len, true, deadline) : 0;
}

// Receives a header (and the payload into a malloc'ed *payload if payload != NULL).
static atomc_status msg_recv(int fd, struct rdv_msg *m, void **payload, double deadline, const char *peer,
                             struct error *err) {
    uint32_t h[5];
    if (io_all(fd, h, sizeof h, false, deadline))
        return error_set(err, ATOMC_ERR_BACKEND, "rendezvous: %s %s", peer,
                         errno == ETIMEDOUT ? "did not answer before the deadline"
                                            : "closed the connection (the process died or gave up)");
    if (ntohl(h[0]) != RDV_MAGIC)
        return error_set(err, ATOMC_ERR_FORMAT, "rendezvous: %s sent a message without the atomc magic (another "
                         "program on the port?)", peer);
    *m = (struct rdv_msg){ntohl(h[1]), ntohl(h[2]), ntohl(h[3]), ntohl(h[4])};
    if (m->len > RDV_MAX_BLOB)
        return error_set(err, ATOMC_ERR_FORMAT, "rendezvous: %s sent a %u-byte message (limit %d)", peer, m->len,
                         RDV_MAX_BLOB);
    char *buf = xmalloc(m->len + 1);
    if (m->len && io_all(fd, buf, m->len, false, deadline)) {
        free(buf);
        return error_set(err, ATOMC_ERR_BACKEND, "rendezvous: %s stopped in the middle of a message", peer);
    }
    buf[m->len] = 0;
    if (m->type == RDV_ERROR) {
        error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "rendezvous: %s refused this node: %s", peer, buf);
        free(buf);
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    if (payload) *payload = buf;
    else free(buf);
    return ATOMC_OK;
}

static atomc_status rdv_listen(const struct rendezvous_options *o, double deadline, int *out, struct error *err) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return error_set(err, ATOMC_ERR_IO, "rendezvous: socket: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->master_port)};
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    // Bind may fail for a moment when a previous group's socket on the port is closing.
    while (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (errno != EADDRINUSE || ms_left(deadline) == 0) {
            int e = errno;
            close(fd);
            return error_set(err, ATOMC_ERR_IO, "rendezvous: node 0 cannot listen on port %d: %s", o->master_port,
                             strerror(e));
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (listen(fd, o->nnodes) != 0) {
        int e = errno;
        close(fd);
        return error_set(err, ATOMC_ERR_IO, "rendezvous: listen on port %d: %s", o->master_port, strerror(e));
    }
    *out = fd;
    return ATOMC_OK;
}

static atomc_status rdv_connect(const struct rendezvous_options *o, double deadline, int *out, struct error *err) {
    const char *host = o->master_addr && o->master_addr[0] ? o->master_addr : "127.0.0.1";
    char port[16];
    snprintf(port, sizeof port, "%d", o->master_port);
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int gr = getaddrinfo(host, port, &hints, &ai);
    if (gr != 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "rendezvous: cannot resolve --master-addr %s: %s", host,
                         gai_strerror(gr));
    int last = 0;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) {
            freeaddrinfo(ai);
            return error_set(err, ATOMC_ERR_IO, "rendezvous: socket: %s", strerror(errno));
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            freeaddrinfo(ai);
            *out = fd;
            return ATOMC_OK;
        }
        last = errno;
        close(fd);
        if (ms_left(deadline) == 0) break;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(ai);
    return error_set(err, ATOMC_ERR_BACKEND, "rendezvous: node %d could not reach node 0 at %s:%d within %.1f s: %s%s",
                     o->node_rank, host, o->master_port, o->timeout_s, strerror(last),
                     last == ECONNREFUSED ? " (is node 0 running with the same --master-port?)" : "");
}

void rendezvous_close(struct rendezvous *r) {
    if (!r) return;
    for (int k = 0; k < (r->node_rank == 0 ? r->nnodes : 1); k++)
        if (r->fds[k] >= 0) close(r->fds[k]);
    free(r->fds);
    free(r);
}

static atomc_status rdv_barrier_until(struct rendezvous *r, double deadline, struct error *err) {
    char peer[48];
    struct rdv_msg m;
    atomc_status st;
    if (r->node_rank == 0) {
        for (int k = 1; k < r->nnodes; k++) {
            snprintf(peer, sizeof peer, "node %d", k);
            if ((st = msg_recv(r->fds[k], &m, NULL, deadline, peer, err))) return st;
            if (m.type != RDV_BARRIER)
                return error_set(err, ATOMC_ERR_FORMAT, "rendezvous: node %d sent message %u instead of a barrier", k,
                                 m.type);
        }
        for (int k = 1; k < r->nnodes; k++)
            if (msg_send(r->fds[k], RDV_BARRIER, 0, 0, NULL, 0, deadline))
                return error_set(err, ATOMC_ERR_BACKEND, "rendezvous: node %d went away during a barrier: %s", k,
                                 strerror(errno));
        return ATOMC_OK;
    }
    if (msg_send(r->fds[0], RDV_BARRIER, 0, 0, NULL, 0, deadline))
        return error_set(err, ATOMC_ERR_BACKEND, "rendezvous: node 0 went away during a barrier: %s", strerror(errno));
    if ((st = msg_recv(r->fds[0], &m, NULL, deadline, "node 0", err))) return st;
    if (m.type != RDV_BARRIER)
        return error_set(err, ATOMC_ERR_FORMAT, "rendezvous: node 0 sent message %u instead of a barrier", m.type);
    return ATOMC_OK;
}

atomc_status rendezvous_barrier(struct rendezvous *r, struct error *err) {
    return rdv_barrier_until(r, time_now_s() + r->timeout_s, err);
}

atomc_status rendezvous_join(const struct rendezvous_options *o, const void *blob, size_t blob_len,
                             struct rendezvous **out, void **blob_out, size_t *blob_out_len, struct error *err) {
    *out = NULL;
    *blob_out = NULL;
    *blob_out_len = 0;
    if (o->nnodes < 1 || o->node_rank < 0 || o->node_rank >= o->nnodes)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "rendezvous: --node-rank %d outside [0, --nnodes %d)",
                         o->node_rank, o->nnodes);
    if (o->nnodes > 1 && (o->master_port < 1 || o->master_port > 65535))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "rendezvous: --master-port %d outside 1..65535",
                         o->master_port);
    if (o->node_rank == 0 && blob_len > RDV_MAX_BLOB)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "rendezvous: blob of %zu bytes (limit %d)", blob_len,
                         RDV_MAX_BLOB);
    double timeout = o->timeout_s > 0 ? o->timeout_s : 300.0, deadline = time_now_s() + timeout;
    struct rendezvous *r = xcalloc(1, sizeof *r);
    r->nnodes = o->nnodes;
    r->node_rank = o->node_rank;
    r->timeout_s = timeout;
    int nfds = o->node_rank == 0 ? o->nnodes : 1;
    r->fds = xmalloc((size_t)nfds * sizeof(int));
    for (int k = 0; k < nfds; k++) r->fds[k] = -1;
    atomc_status st = ATOMC_OK;
    char peer[48];
    struct rdv_msg m;
    if (o->nnodes == 1) {
        // A group of one: nothing to meet.
    } else if (o->node_rank == 0) {
        int lfd = -1;
        if ((st = rdv_listen(o, deadline, &lfd, err))) goto fail;
        int joined = 0;
        while (joined < o->nnodes - 1) {
            struct pollfd pf = {.fd = lfd, .events = POLLIN};
            int pr = poll(&pf, 1, ms_left(deadline));
            if (pr < 0 && errno == EINTR) continue;
            if (pr <= 0) {
                close(lfd);
                st = error_set(err, ATOMC_ERR_BACKEND, "rendezvous: node 0 timed out after %.1f s on port %d: %d of "
                               "%d nodes joined", timeout, o->master_port, joined + 1, o->nnodes);
                goto fail;
            }
            int fd = accept(lfd, NULL, NULL);
            if (fd < 0) continue;
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            if ((st = msg_recv(fd, &m, NULL, deadline, "a joining node", err))) {
                close(fd);
                close(lfd);
                goto fail;
            }
            char why[160] = "";
            if (m.type != RDV_HELLO) snprintf(why, sizeof why, "expected a hello, got message %u", m.type);
            else if ((int)m.a != o->nnodes)
                snprintf(why, sizeof why, "world size mismatch: node %u has --nnodes %u, node 0 has %d", m.b, m.a,
                         o->nnodes);
            else if (m.b < 1 || (int)m.b >= o->nnodes)
                snprintf(why, sizeof why, "node rank %u outside [1, %d)", m.b, o->nnodes);
            else if (r->fds[m.b] >= 0) snprintf(why, sizeof why, "node rank %u joined twice", m.b);
            if (why[0]) {
                msg_send(fd, RDV_ERROR, 0, 0, why, (uint32_t)strlen(why), deadline);
                close(fd);
                close(lfd);
                st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "rendezvous: %s", why);
                goto fail;
            }
            r->fds[m.b] = fd;
            joined++;
        }
        close(lfd);
        for (int k = 1; k < o->nnodes; k++)
            if (msg_send(r->fds[k], RDV_BLOB, 0, 0, blob, (uint32_t)blob_len, deadline)) {
                st = error_set(err, ATOMC_ERR_BACKEND, "rendezvous: sending the group blob to node %d: %s", k,
                               strerror(errno));
                goto fail;
            }
    } else {
        if ((st = rdv_connect(o, deadline, &r->fds[0], err))) goto fail;
        if (msg_send(r->fds[0], RDV_HELLO, (uint32_t)o->nnodes, (uint32_t)o->node_rank, NULL, 0, deadline)) {
            st = error_set(err, ATOMC_ERR_BACKEND, "rendezvous: node 0 closed the connection: %s", strerror(errno));
            goto fail;
        }
        snprintf(peer, sizeof peer, "node 0 (%s:%d)", o->master_addr ? o->master_addr : "127.0.0.1",
                 o->master_port);
        void *payload = NULL;
        if ((st = msg_recv(r->fds[0], &m, &payload, deadline, peer, err))) goto fail;
        if (m.type != RDV_BLOB) {
            free(payload);
            st = error_set(err, ATOMC_ERR_FORMAT, "rendezvous: node 0 sent message %u instead of the group blob", m.type);
            goto fail;
        }
        *blob_out = payload;
        *blob_out_len = m.len;
    }
    if (o->node_rank == 0 || o->nnodes == 1) {
        *blob_out = xmalloc(blob_len + 1);
        if (blob_len) memcpy(*blob_out, blob, blob_len);
        ((char *)*blob_out)[blob_len] = 0;
        *blob_out_len = blob_len;
    }
    if (o->nnodes > 1 && (st = rdv_barrier_until(r, deadline, err))) goto fail;
    *out = r;
    return ATOMC_OK;
fail:
    free(*blob_out);
    *blob_out = NULL;
    *blob_out_len = 0;
    rendezvous_close(r);
    return st;
}
