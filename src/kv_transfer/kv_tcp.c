// The KV connector over TCP (kv_connector.h): listener / connections, framing, the handshake,
// producer transfers (queued frames, acknowledgements) and consumer transfers (staging buffers).
// The `cuda_ipc` connector is this one without DATA frames: HELLO_OK carries the producer pool's
// IPC handle and claim copies GPU to GPU (kv_cuda_ipc.c).
//
// Producer threads: the engine thread registers a step's sends and reports layers; a copy thread
// reads each reported layer's rows from the pool into DATA frames and queues them on the
// consumer's connection (waiting while that send queue is over its cap); the I/O thread writes.
//
// One I/O thread per connector: poll() over a wake pipe, the listening socket and every peer
// (non-blocking sockets; partial reads accumulate in the peer's input buffer until a frame is
// whole, partial writes resume where they stopped). A peer that sends a malformed frame, fails
// the handshake, stays silent past the handshake deadline or closes is dropped; what it had in
// flight fails (consumer) or counts as acknowledged (producer: its blocks are freed).
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "kv_transfer/kv_connector.h"

#define HANDSHAKE_TIMEOUT_S 10.0
#define RECONNECT_S 0.2
#define TOMBSTONE_S 120.0

struct qnode {
    struct qnode *next;
    size_t len, off;
    uint8_t data[];
};

struct peer {
    int fd;       // -1: slot free
    uint64_t gen; // unique per connection
    int prod;     // consumer side: index into cfg.producers; -1 for accepted connections
    bool ready;   // handshake done
    bool closing; // close once the queue is flushed (after HELLO_ERR)
    struct kv_handshake hs;
    void *ipc_base; // cuda_ipc consumer: the producer's pool mapped here
    uint8_t ipc_handle[KV_IPC_HANDLE_BYTES];
    struct qnode *q_head, *q_tail;
    size_t q_bytes; // queued, not yet written
    bool kill;      // close it (I/O thread): its send queue did not drain for send_timeout_s
    uint8_t *in;
    size_t in_len, in_cap;
    double t_open;
};

struct tx { // producer: a transfer until its ACK
    char id[KV_ID_MAX];
    int peer;
    uint64_t gen;
    int skip; // BEGIN's: leading tokens not sent
};

struct rx { // consumer: a transfer from BEGIN until claim / drop (then a tombstone)
    char id[KV_ID_MAX];
    int peer;
    uint64_t gen;
    enum kv_rx_state state;
    bool tombstone;
    int n_tokens, n_blocks, skip;
    int32_t *tokens, *src_blocks;
    uint64_t *hashes;
    uint8_t *data; // (n_layers) blocks of [K rows][V rows] of tokens [skip, n_tokens)
    size_t data_bytes, received;
    double t_begin, t_end, t_expire;
};

struct step_send { // producer: one transfer's part of the step being computed
    char id[KV_ID_MAX];
    int peer;
    uint64_t gen;
    int32_t *ids; // (n_blocks) the prompt's blocks (-1: not allocated yet)
    int n_tokens, n_blocks, tok0, n_tok, skip;
    bool last, failed;
};

struct step {
    struct step_send *s;
    int n, cap;
    int ready;    // layers reported written (layer_ready, or all at step_end)
    int done;     // layers whose frames the copy thread has queued
    bool copying; // the copy thread works on layer `done` (outside the lock)
    bool ending;  // step_end was called (the forward returned)
    bool cancel;
    void **ev;    // (n_layers) event of each reported layer
};

struct query { // consumer: a QUERY to answer (engine thread)
    char id[KV_ID_MAX];
    int peer;
    uint64_t gen;
    int n_tokens;
    int32_t *tokens;
};

struct have { // producer: a HAVE not taken yet
    char id[KV_ID_MAX];
    int n_blocks;
    double t;
};

struct kv_connector {
    struct kv_transfer_config cfg;
    struct kv_handshake hs;
    struct kv_pool_view pool;
    size_t token_bytes;
    void (*wake)(void *);
    void *wake_arg;

    pthread_mutex_t mu;
    pthread_cond_t cv; // step progress, send-queue drain (broadcast)
    pthread_t th, copy_th;
    bool th_on, copy_on, stop;
    struct step step;
    int wake_fd[2];
    int listen_fd;
    struct peer peers[KV_MAX_PEERS];
    uint64_t next_gen;
    double next_connect[KV_MAX_PRODUCERS];
    bool connected[KV_MAX_PRODUCERS];
    struct tx *tx;
    int n_tx, tx_cap;
    struct rx *rx;
    int n_rx, rx_cap;
    char (*acks)[KV_ID_MAX];
    int n_acks, acks_cap;
    struct query *queries;
    int n_queries, queries_cap;
    struct have *haves;
    int n_haves, haves_cap;
    struct kv_connector_stats st;
    bool ipc_ok;
    uint8_t ipc_handle[KV_IPC_HANDLE_BYTES];
};

static void *copy_main(void *arg);

static bool is_producer(const struct kv_connector *c) {
    return c->cfg.role & KV_ROLE_PRODUCER;
}

static void poke(struct kv_connector *c) {
    char b = 1;
    ssize_t n = write(c->wake_fd[1], &b, 1);
    (void)n;
}

static void *grow_arr(void *p, int *cap, int need, size_t elem) {
    if (need <= *cap) return p;
    int n = *cap ? *cap * 2 : 16;
    while (n < need)
        n *= 2;
    *cap = n;
    return xrealloc(p, (size_t)n * elem);
}

// --- queues and frames ------------------------------------------------------------------------

static struct qnode *frame_new(enum kv_frame_type type, const char *id, size_t body_len, uint8_t **body) {
    size_t idn = id ? strlen(id) : 0;
    struct qnode *q = xmalloc(sizeof *q + KV_FRAME_HEADER + idn + body_len);
    q->next = NULL;
    q->off = 0;
    q->len = kv_frame_header(q->data, type, id, body_len) + body_len;
    if (body) *body = q->data + q->len - body_len;
    return q;
}

static void peer_queue(struct kv_connector *c, struct peer *p, struct qnode *q) {
    p->q_bytes += q->len;
    c->st.send_queue_bytes += q->len;
    if (p->q_bytes > c->st.send_queue_peak) c->st.send_queue_peak = p->q_bytes;
    if (p->q_tail)
        p->q_tail->next = q;
    else
        p->q_head = q;
    p->q_tail = q;
}

static void peer_send_simple(struct kv_connector *c, struct peer *p, enum kv_frame_type t, const char *id,
                             const void *body, size_t len) {
    uint8_t *b;
    struct qnode *q = frame_new(t, id, len, &b);
    if (len) memcpy(b, body, len);
    peer_queue(c, p, q);
}

static struct peer *peer_by_gen(struct kv_connector *c, int i, uint64_t gen) {
    if (i < 0 || i >= KV_MAX_PEERS) return NULL;
    struct peer *p = &c->peers[i];
    return p->fd >= 0 && p->gen == gen ? p : NULL;
}

static struct rx *rx_find(struct kv_connector *c, const char *id) {
    for (int i = 0; i < c->n_rx; i++)
        if (!strcmp(c->rx[i].id, id)) return &c->rx[i];
    return NULL;
}

static void rx_free_data(struct rx *r) {
    free(r->tokens);
    free(r->src_blocks);
    free(r->hashes);
    free(r->data);
    r->tokens = r->src_blocks = NULL;
    r->hashes = NULL;
    r->data = NULL;
}

static void rx_remove_at(struct kv_connector *c, int i) {
    rx_free_data(&c->rx[i]);
    c->rx[i] = c->rx[--c->n_rx];
}

static void push_ack(struct kv_connector *c, const char *id) {
    c->acks = grow_arr(c->acks, &c->acks_cap, c->n_acks + 1, sizeof *c->acks);
    snprintf(c->acks[c->n_acks++], KV_ID_MAX, "%s", id);
}

// Turns r into a tombstone (late frames of its id are ignored) and acknowledges it to its
// producer when that connection still stands.
static void rx_bury(struct kv_connector *c, struct rx *r, bool ack) {
    struct peer *p = peer_by_gen(c, r->peer, r->gen);
    if (ack && p && p->ready) peer_send_simple(c, p, KV_FRAME_ACK, r->id, NULL, 0);
    rx_free_data(r);
    r->tombstone = true;
    r->state = KV_RX_FAILED;
    r->t_expire = time_now_s() + TOMBSTONE_S;
}

static void peer_close(struct kv_connector *c, struct peer *p, const char *why) {
    int idx = (int)(p - c->peers);
    if (why && p->ready) LOG_WARN("KV transfer: connection to %s closed: %s", p->hs.engine_id, why);
    close(p->fd);
    p->fd = -1;
    for (struct qnode *q = p->q_head, *n; q; q = n) {
        n = q->next;
        free(q);
    }
    p->q_head = p->q_tail = NULL;
    c->st.send_queue_bytes -= p->q_bytes;
    p->q_bytes = 0;
    p->kill = false;
    pthread_cond_broadcast(&c->cv);
    free(p->in);
    p->in = NULL;
    p->in_len = p->in_cap = 0;
    if (p->ipc_base) kv_ipc_close(p->ipc_base);
    p->ipc_base = NULL;
    if (p->prod >= 0) { // reconnect soon, unless a refusal (HELLO_ERR) asked for a longer pause
        c->connected[p->prod] = false;
        if (c->next_connect[p->prod] < time_now_s() + RECONNECT_S) c->next_connect[p->prod] = time_now_s() + RECONNECT_S;
    }
    // Producer: the consumer is gone, so nobody will read the blocks held for it.
    for (int i = 0; i < c->n_tx;) {
        if (c->tx[i].peer == idx && c->tx[i].gen == p->gen) {
            push_ack(c, c->tx[i].id);
            c->st.transfers_failed++;
            c->tx[i] = c->tx[--c->n_tx];
        } else {
            i++;
        }
    }
    // Consumer: incomplete transfers from this producer can no longer complete.
    bool woke = false;
    for (int i = 0; i < c->n_rx; i++) {
        struct rx *r = &c->rx[i];
        if (r->peer == idx && r->gen == p->gen && r->state == KV_RX_PENDING) {
            r->state = KV_RX_FAILED;
            c->st.transfers_failed++;
            woke = true;
        }
    }
    p->ready = false;
    if ((woke || c->n_acks) && c->wake) c->wake(c->wake_arg);
}

static struct peer *peer_add(struct kv_connector *c, int fd, int prod) {
    for (int i = 0; i < KV_MAX_PEERS; i++) {
        struct peer *p = &c->peers[i];
        if (p->fd >= 0) continue;
        memset(p, 0, sizeof *p);
        p->fd = fd;
        p->gen = ++c->next_gen;
        p->prod = prod;
        p->t_open = time_now_s();
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return p;
    }
    close(fd);
    LOG_WARN("KV transfer: more than %d connections; one refused", KV_MAX_PEERS);
    return NULL;
}

// --- frame handling (I/O thread, under mu) -----------------------------------------------------

static void hello_body(struct kv_connector *c, struct peer *p, enum kv_frame_type t) {
    uint8_t body[sizeof(struct kv_handshake) + KV_IPC_HANDLE_BYTES];
    memcpy(body, &c->hs, sizeof c->hs);
    size_t n = sizeof c->hs;
    if (c->ipc_ok) {
        memcpy(body + n, c->ipc_handle, KV_IPC_HANDLE_BYTES);
        n += KV_IPC_HANDLE_BYTES;
    }
    peer_send_simple(c, p, t, c->hs.engine_id, body, n);
}

static bool on_hello(struct kv_connector *c, struct peer *p, const struct kv_frame *f) {
    if (f->body_len < sizeof(struct kv_handshake)) {
        snprintf(c->st.last_error, sizeof c->st.last_error, "KV transfer: short HELLO from a peer");
        return false;
    }
    memcpy(&p->hs, f->body, sizeof p->hs);
    p->hs.engine_id[KV_ID_MAX - 1] = p->hs.model[sizeof p->hs.model - 1] = 0;
    p->hs.architecture[sizeof p->hs.architecture - 1] = 0;
    if (f->body_len >= sizeof(struct kv_handshake) + KV_IPC_HANDLE_BYTES)
        memcpy(p->ipc_handle, f->body + sizeof(struct kv_handshake), KV_IPC_HANDLE_BYTES);
    struct error e = {0};
    if (kv_handshake_check(&c->hs, &p->hs, &e) != ATOMC_OK) {
        snprintf(c->st.last_error, sizeof c->st.last_error, "%s", e.msg);
        LOG_ERROR("%s", e.msg);
        if (f->type == KV_FRAME_HELLO) {
            peer_send_simple(c, p, KV_FRAME_HELLO_ERR, c->hs.engine_id, e.msg, strlen(e.msg));
            p->closing = true;
            return true;
        }
        return false;
    }
    if (f->type == KV_FRAME_HELLO) hello_body(c, p, KV_FRAME_HELLO_OK);
    if (f->type == KV_FRAME_HELLO_OK && c->cfg.kind == KV_CONNECTOR_CUDA_IPC) {
        if (kv_ipc_open(p->ipc_handle, c->pool.device, &p->ipc_base, &e) != ATOMC_OK) {
            snprintf(c->st.last_error, sizeof c->st.last_error, "KV transfer (cuda_ipc): %.400s", e.msg);
            LOG_ERROR("%s", c->st.last_error);
            return false;
        }
    }
    p->ready = true;
    if (p->prod >= 0) c->connected[p->prod] = true;
    LOG_INFO("KV transfer: connected to %s (%s)", p->hs.engine_id, kv_role_name((enum kv_role)p->hs.role));
    return true;
}

static bool on_begin(struct kv_connector *c, struct peer *p, const struct kv_frame *f) {
    struct rx *old = rx_find(c, f->id);
    if (old) return true; // a tombstone (dropped before it arrived) or a duplicate: ignored
    uint32_t n_tok, n_blocks, skip;
    if (f->body_len < 12) return false;
    memcpy(&n_tok, f->body, 4);
    memcpy(&n_blocks, f->body + 4, 4);
    memcpy(&skip, f->body + 8, 4);
    int bs = c->pool.block_size;
    size_t n_full = n_tok / (uint32_t)bs;
    if (n_tok == 0 || n_blocks != (n_tok + (uint32_t)bs - 1) / (uint32_t)bs || skip >= n_tok || skip % (uint32_t)bs ||
        f->body_len != 12 + (size_t)n_tok * 4 + n_full * 8 + (size_t)n_blocks * 4)
        return false;
    const uint8_t *body = f->body + 12;
    c->rx = grow_arr(c->rx, &c->rx_cap, c->n_rx + 1, sizeof *c->rx);
    struct rx *r = &c->rx[c->n_rx++];
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "%s", f->id);
    r->peer = (int)(p - c->peers);
    r->gen = p->gen;
    r->state = KV_RX_PENDING;
    r->n_tokens = (int)n_tok;
    r->n_blocks = (int)n_blocks;
    r->skip = (int)skip;
    r->tokens = xmalloc((size_t)n_tok * 4);
    r->hashes = xmalloc(n_full ? n_full * 8 : 1);
    r->src_blocks = xmalloc((size_t)n_blocks * 4);
    memcpy(r->tokens, body, (size_t)n_tok * 4);
    memcpy(r->hashes, body + (size_t)n_tok * 4, n_full * 8);
    memcpy(r->src_blocks, body + (size_t)n_tok * 4 + n_full * 8, (size_t)n_blocks * 4);
    if (c->cfg.kind == KV_CONNECTOR_TCP) {
        r->data_bytes = (size_t)(n_tok - skip) * c->token_bytes;
        r->data = malloc(r->data_bytes ? r->data_bytes : 1);
        if (!r->data) {
            r->state = KV_RX_FAILED;
            LOG_ERROR("KV transfer %s: out of memory staging %zu bytes", r->id, r->data_bytes);
        }
    }
    r->t_begin = time_now_s();
    r->t_expire = r->t_begin + c->cfg.hold_timeout_s;
    return true;
}

// Staging offset of layer l's rows for a transfer of n tokens.
static size_t stage_offset(const struct kv_connector *c, int l, int n) {
    size_t off = 0;
    for (int i = 0; i < l; i++)
        off += (c->pool.k_row_bytes[i] + c->pool.v_row_bytes[i]) * (size_t)n;
    return off;
}

static bool on_data(struct kv_connector *c, struct peer *p, const struct kv_frame *f) {
    struct rx *r = rx_find(c, f->id);
    if (!r || r->tombstone || r->state != KV_RX_PENDING) return true; // dropped / failed: ignore
    uint32_t layer, tok0, n;
    if (f->body_len < 12) return false;
    memcpy(&layer, f->body, 4);
    memcpy(&tok0, f->body + 4, 4);
    memcpy(&n, f->body + 8, 4);
    if ((int)layer >= c->pool.n_layers || tok0 < (uint32_t)r->skip || tok0 + (uint64_t)n > (uint64_t)r->n_tokens)
        return false;
    size_t kr = c->pool.k_row_bytes[layer], vr = c->pool.v_row_bytes[layer];
    if (f->body_len != 12 + (size_t)n * (kr + vr)) return false;
    int m = r->n_tokens - r->skip; // staged rows per layer
    size_t t = tok0 - (uint32_t)r->skip;
    uint8_t *base = r->data + stage_offset(c, (int)layer, m);
    memcpy(base + t * kr, f->body + 12, (size_t)n * kr);
    memcpy(base + (size_t)m * kr + t * vr, f->body + 12 + (size_t)n * kr, (size_t)n * vr);
    r->received += (size_t)n * (kr + vr);
    c->st.layers_received++;
    (void)p;
    return true;
}

static void on_end(struct kv_connector *c, struct peer *p, const struct kv_frame *f, bool aborted) {
    struct rx *r = rx_find(c, f->id);
    if (!r) return;
    if (r->tombstone) {
        // Dropped before the producer finished: acknowledge now so it frees the blocks.
        if (!aborted) peer_send_simple(c, p, KV_FRAME_ACK, f->id, NULL, 0);
        return;
    }
    if (r->state != KV_RX_PENDING) return;
    r->t_end = time_now_s();
    if (!aborted && f->body_len == (size_t)r->n_blocks * 4 && r->src_blocks)
        memcpy(r->src_blocks, f->body, f->body_len);
    if (aborted) {
        r->state = KV_RX_FAILED;
        c->st.transfers_failed++;
    } else if (c->cfg.kind == KV_CONNECTOR_TCP && r->received != r->data_bytes) {
        LOG_WARN("KV transfer %s: END after %zu of %zu bytes", r->id, r->received, r->data_bytes);
        r->state = KV_RX_FAILED;
        c->st.transfers_failed++;
    } else {
        r->state = KV_RX_READY;
    }
    if (c->wake) c->wake(c->wake_arg);
}

static bool on_query(struct kv_connector *c, struct peer *p, const struct kv_frame *f) {
    uint32_t n;
    if (p->prod < 0 || f->body_len < 4) return false; // QUERYs come from producers we connected to
    memcpy(&n, f->body, 4);
    if (n == 0 || f->body_len != 4 + (size_t)n * 4) return false;
    c->queries = grow_arr(c->queries, &c->queries_cap, c->n_queries + 1, sizeof *c->queries);
    struct query *q = &c->queries[c->n_queries++];
    snprintf(q->id, sizeof q->id, "%s", f->id);
    q->peer = (int)(p - c->peers);
    q->gen = p->gen;
    q->n_tokens = (int)n;
    q->tokens = xmalloc((size_t)n * 4);
    memcpy(q->tokens, f->body + 4, (size_t)n * 4);
    if (c->wake) c->wake(c->wake_arg);
    return true;
}

static bool on_have(struct kv_connector *c, struct peer *p, const struct kv_frame *f) {
    uint32_t n;
    if (p->prod >= 0 || f->body_len != 4) return false;
    memcpy(&n, f->body, 4);
    c->haves = grow_arr(c->haves, &c->haves_cap, c->n_haves + 1, sizeof *c->haves);
    struct have *h = &c->haves[c->n_haves++];
    snprintf(h->id, sizeof h->id, "%s", f->id);
    h->n_blocks = (int)n;
    h->t = time_now_s();
    if (c->wake) c->wake(c->wake_arg);
    return true;
}

static void on_ack(struct kv_connector *c, const struct kv_frame *f) {
    for (int i = 0; i < c->n_tx; i++)
        if (!strcmp(c->tx[i].id, f->id)) {
            c->tx[i] = c->tx[--c->n_tx];
            break;
        }
    push_ack(c, f->id);
    if (c->wake) c->wake(c->wake_arg);
}

// Handles one frame; false drops the peer.
static bool on_frame(struct kv_connector *c, struct peer *p, const struct kv_frame *f) {
    if (!p->ready) {
        if (f->type == KV_FRAME_HELLO && p->prod < 0) return on_hello(c, p, f);
        if (f->type == KV_FRAME_HELLO_OK && p->prod >= 0) return on_hello(c, p, f);
        if (f->type == KV_FRAME_HELLO_ERR) {
            snprintf(c->st.last_error, sizeof c->st.last_error, "%.*s", (int)(f->body_len < 400 ? f->body_len : 400),
                     (const char *)f->body);
            LOG_ERROR("KV transfer: producer %s refused the connection: %s", f->id, c->st.last_error);
            if (p->prod >= 0) c->next_connect[p->prod] = time_now_s() + 5.0; // a mismatch does not fix itself soon
        }
        return false;
    }
    switch (f->type) {
    case KV_FRAME_BEGIN:
        return on_begin(c, p, f);
    case KV_FRAME_DATA:
        return on_data(c, p, f);
    case KV_FRAME_END:
        on_end(c, p, f, false);
        return true;
    case KV_FRAME_ABORT:
        on_end(c, p, f, true);
        return true;
    case KV_FRAME_ACK:
        on_ack(c, f);
        return true;
    case KV_FRAME_QUERY:
        return on_query(c, p, f);
    case KV_FRAME_HAVE:
        return on_have(c, p, f);
    default:
        return false;
    }
}

static void peer_read(struct kv_connector *c, struct peer *p) {
    for (;;) {
        if (p->in_cap - p->in_len < 65536) {
            p->in_cap = p->in_cap ? p->in_cap * 2 : 262144;
            p->in = xrealloc(p->in, p->in_cap);
        }
        ssize_t n = recv(p->fd, p->in + p->in_len, p->in_cap - p->in_len, 0);
        if (n == 0) return peer_close(c, p, "peer closed the connection");
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            return peer_close(c, p, strerror(errno));
        }
        p->in_len += (size_t)n;
        if (p->in_len < p->in_cap) break;
    }
    size_t off = 0;
    for (;;) {
        struct kv_frame f;
        struct error e = {0};
        long n = kv_frame_parse(p->in + off, p->in_len - off, &f, &e);
        if (n == 0) break;
        if (n < 0) {
            snprintf(c->st.last_error, sizeof c->st.last_error, "%s", e.msg);
            return peer_close(c, p, e.msg);
        }
        if (!on_frame(c, p, &f)) {
            char why[160];
            snprintf(why, sizeof why, "bad or unexpected frame (type %d)", f.type);
            return peer_close(c, p, why);
        }
        off += (size_t)n;
    }
    if (off) {
        memmove(p->in, p->in + off, p->in_len - off);
        p->in_len -= off;
    }
}

static void peer_write(struct kv_connector *c, struct peer *p) {
    while (p->q_head) {
        struct qnode *q = p->q_head;
        ssize_t n = send(p->fd, q->data + q->off, q->len - q->off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            if (errno == EINTR) continue;
            return peer_close(c, p, strerror(errno));
        }
        q->off += (size_t)n;
        if (q->off < q->len) return;
        p->q_head = q->next;
        if (!p->q_head) p->q_tail = NULL;
        p->q_bytes -= q->len;
        c->st.send_queue_bytes -= q->len;
        free(q);
        pthread_cond_broadcast(&c->cv); // a copy thread may wait for room
    }
    if (p->closing) peer_close(c, p, NULL);
}

// --- the I/O thread ---------------------------------------------------------------------------

static int tcp_connect(const char *hostport, char *why, size_t why_len) {
    char host[96];
    snprintf(host, sizeof host, "%s", hostport);
    char *colon = strrchr(host, ':');
    if (!colon) return snprintf(why, why_len, "bad address %s", hostport), -1;
    *colon = 0;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(host, colon + 1, &hints, &res);
    if (rc) return snprintf(why, why_len, "%s: %s", hostport, gai_strerror(rc)), -1;
    int fd = -1;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        struct timeval tv = {.tv_sec = 1};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        snprintf(why, why_len, "%s: %s", hostport, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static void io_housekeeping(struct kv_connector *c, double now) {
    for (int i = 0; i < c->n_haves;) // answers nobody took (the producer stopped waiting)
        if (now - c->haves[i].t > TOMBSTONE_S)
            c->haves[i] = c->haves[--c->n_haves];
        else
            i++;
    for (int i = 0; i < KV_MAX_PEERS; i++) {
        struct peer *p = &c->peers[i];
        if (p->fd >= 0 && !p->ready && !p->closing && now - p->t_open > HANDSHAKE_TIMEOUT_S)
            peer_close(c, p, "no handshake within 10 s");
        if (p->fd >= 0 && p->kill) peer_close(c, p, "the consumer read nothing while its send queue was full");
    }
    for (int i = 0; i < c->n_rx;) {
        struct rx *r = &c->rx[i];
        if (now < r->t_expire) {
            i++;
            continue;
        }
        if (r->tombstone) {
            rx_remove_at(c, i);
            continue;
        }
        // Never claimed (the decode request did not come): give the producer its blocks back.
        LOG_WARN("KV transfer %s: not claimed within %.0f s, dropped", r->id, c->cfg.hold_timeout_s);
        rx_bury(c, r, true);
        i++;
    }
}

static void *io_main(void *arg) {
    struct kv_connector *c = arg;
    struct pollfd pfd[KV_MAX_PEERS + 2];
    int who[KV_MAX_PEERS + 2];
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        double now = time_now_s();
        // Consumer: (re)connect to the producers that are down.
        for (int k = 0; k < c->cfg.n_producers && (c->cfg.role & KV_ROLE_CONSUMER); k++) {
            bool have = false;
            for (int i = 0; i < KV_MAX_PEERS; i++)
                if (c->peers[i].fd >= 0 && c->peers[i].prod == k) have = true;
            if (have || now < c->next_connect[k]) continue;
            char addr[96], why[200] = "";
            snprintf(addr, sizeof addr, "%s", c->cfg.producers[k]);
            pthread_mutex_unlock(&c->mu);
            int fd = tcp_connect(addr, why, sizeof why);
            pthread_mutex_lock(&c->mu);
            c->next_connect[k] = time_now_s() + RECONNECT_S;
            if (fd < 0) continue;
            struct peer *p = peer_add(c, fd, k);
            if (p) hello_body(c, p, KV_FRAME_HELLO);
        }
        int n = 0;
        pfd[n] = (struct pollfd){.fd = c->wake_fd[0], .events = POLLIN};
        who[n++] = -1;
        if (c->listen_fd >= 0) {
            pfd[n] = (struct pollfd){.fd = c->listen_fd, .events = POLLIN};
            who[n++] = -2;
        }
        for (int i = 0; i < KV_MAX_PEERS; i++) {
            struct peer *p = &c->peers[i];
            if (p->fd < 0) continue;
            pfd[n] = (struct pollfd){.fd = p->fd, .events = (short)(POLLIN | (p->q_head ? POLLOUT : 0))};
            who[n++] = i;
        }
        pthread_mutex_unlock(&c->mu);
        int rc = poll(pfd, (nfds_t)n, 100);
        pthread_mutex_lock(&c->mu);
        if (c->stop) break;
        if (rc < 0 && errno != EINTR) LOG_WARN("KV transfer: poll: %s", strerror(errno));
        for (int j = 0; rc > 0 && j < n; j++) {
            if (!pfd[j].revents) continue;
            if (who[j] == -1) {
                char buf[256];
                while (read(c->wake_fd[0], buf, sizeof buf) > 0) {
                }
            } else if (who[j] == -2) {
                int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
                if (fd >= 0) peer_add(c, fd, -1);
            } else {
                struct peer *p = &c->peers[who[j]];
                if (p->fd != pfd[j].fd) continue;
                if (pfd[j].revents & (POLLIN | POLLHUP | POLLERR)) peer_read(c, p);
                if (p->fd >= 0 && (pfd[j].revents & POLLOUT)) peer_write(c, p);
            }
        }
        // Frames queued by the engine since the poll started go out now rather than after 100 ms.
        for (int i = 0; i < KV_MAX_PEERS; i++)
            if (c->peers[i].fd >= 0 && c->peers[i].q_head) peer_write(c, &c->peers[i]);
        io_housekeeping(c, time_now_s());
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static atomc_status tcp_listen(struct kv_connector *c, struct error *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", c->cfg.port);
    int rc = getaddrinfo(c->cfg.ip, port, &hints, &res);
    if (rc) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "KV transfer: kv_ip %s: %s", c->cfg.ip, gai_strerror(rc));
    int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
    int one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        return error_set(err, ATOMC_ERR_IO, "KV transfer: cannot listen on %s:%d: %s", c->cfg.ip, c->cfg.port,
                         strerror(e));
    }
    freeaddrinfo(res);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    c->listen_fd = fd;
    return ATOMC_OK;
}

// --- public -----------------------------------------------------------------------------------

atomc_status kv_connector_create(const struct kv_transfer_config *cfg, const struct kv_handshake *hs,
                                 const struct kv_pool_view *pool, void (*wake)(void *), void *wake_arg,
                                 struct kv_connector **out, struct error *err) {
    *out = NULL;
    struct kv_connector *c = xcalloc(1, sizeof *c);
    c->cfg = *cfg;
    c->hs = *hs;
    c->hs.role = (int32_t)cfg->role;
    c->pool = *pool;
    c->token_bytes = kv_pool_token_bytes(pool);
    c->wake = wake;
    c->wake_arg = wake_arg;
    c->listen_fd = -1;
    c->wake_fd[0] = c->wake_fd[1] = -1;
    for (int i = 0; i < KV_MAX_PEERS; i++)
        c->peers[i].fd = -1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->step.ev = xcalloc((size_t)(pool->n_layers > 0 ? pool->n_layers : 1), sizeof *c->step.ev);
    atomc_status st = ATOMC_OK;
    if (cfg->kind == KV_CONNECTOR_CUDA_IPC) {
        if (!pool->on_device)
            st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                           "kv_connector \"cuda_ipc\" needs a CUDA KV pool (--device cuda); use \"tcp\" on the CPU");
        else if (is_producer(c) && (st = kv_ipc_export(pool, c->ipc_handle, err)) == ATOMC_OK)
            c->ipc_ok = true;
    }
    if (st == ATOMC_OK && pipe2(c->wake_fd, O_NONBLOCK | O_CLOEXEC) != 0)
        st = error_set(err, ATOMC_ERR_IO, "KV transfer: pipe: %s", strerror(errno));
    if (st == ATOMC_OK && is_producer(c)) st = tcp_listen(c, err);
    if (st == ATOMC_OK) {
        if (pthread_create(&c->th, NULL, io_main, c) != 0)
            st = error_set(err, ATOMC_ERR_INTERNAL, "KV transfer: cannot start the I/O thread");
        else
            c->th_on = true;
    }
    if (st == ATOMC_OK && is_producer(c)) {
        if (pthread_create(&c->copy_th, NULL, copy_main, c) != 0)
            st = error_set(err, ATOMC_ERR_INTERNAL, "KV transfer: cannot start the copy thread");
        else
            c->copy_on = true;
    }
    if (st != ATOMC_OK) {
        kv_connector_free(c);
        return st;
    }
    if (is_producer(c))
        LOG_INFO("KV transfer (%s): %s listening on %s:%d", cfg->kind == KV_CONNECTOR_TCP ? "tcp" : "cuda_ipc",
                 c->hs.engine_id, cfg->ip, cfg->port);
    *out = c;
    return ATOMC_OK;
}

void kv_connector_free(struct kv_connector *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->th_on) {
        poke(c);
        pthread_join(c->th, NULL);
    }
    if (c->copy_on) pthread_join(c->copy_th, NULL);
    for (int i = 0; i < c->step.n; i++)
        free(c->step.s[i].ids);
    free(c->step.s);
    free(c->step.ev);
    for (int i = 0; i < KV_MAX_PEERS; i++)
        if (c->peers[i].fd >= 0) peer_close(c, &c->peers[i], NULL);
    for (int i = 0; i < c->n_rx; i++)
        rx_free_data(&c->rx[i]);
    if (c->listen_fd >= 0) close(c->listen_fd);
    if (c->wake_fd[0] >= 0) close(c->wake_fd[0]);
    if (c->wake_fd[1] >= 0) close(c->wake_fd[1]);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->tx);
    free(c->rx);
    free(c->acks);
    for (int i = 0; i < c->n_queries; i++)
        free(c->queries[i].tokens);
    free(c->queries);
    free(c->haves);
    free(c);
}

void kv_connector_get_stats(struct kv_connector *c, struct kv_connector_stats *s) {
    pthread_mutex_lock(&c->mu);
    *s = c->st;
    s->peers = 0;
    for (int i = 0; i < KV_MAX_PEERS; i++)
        if (c->peers[i].fd >= 0 && c->peers[i].ready) s->peers++;
    pthread_mutex_unlock(&c->mu);
}

static int find_consumer(struct kv_connector *c, const char *engine_id, struct error *err) {
    int found = -1, n = 0;
    for (int i = 0; i < KV_MAX_PEERS; i++) {
        struct peer *p = &c->peers[i];
        if (p->fd < 0 || !p->ready || p->prod >= 0 || !(p->hs.role & KV_ROLE_CONSUMER)) continue;
        n++;
        if (engine_id && engine_id[0]) {
            if (!strcmp(p->hs.engine_id, engine_id)) return i;
        } else {
            found = i;
        }
    }
    if (engine_id && engine_id[0])
        return error_set(err, ATOMC_ERR_NOT_FOUND, "KV transfer: consumer \"%s\" is not connected", engine_id), -1;
    if (n == 1) return found;
    if (n == 0) return error_set(err, ATOMC_ERR_NOT_FOUND, "KV transfer: no consumer is connected"), -1;
    return error_set(err, ATOMC_ERR_NOT_FOUND,
                     "KV transfer: %d consumers are connected and the request names none (remote_engine_id)", n),
           -1;
}

// --- producer: per-layer sends -------------------------------------------------------------------

// Waits (under mu) until p's send queue has room for `len` more bytes; NULL when p went away or
// did not drain for send_timeout_s (then it is closed by the I/O thread).
static struct peer *wait_for_room(struct kv_connector *c, const struct step_send *e, size_t len) {
    struct peer *p = peer_by_gen(c, e->peer, e->gen);
    double t0 = 0;
    while (p && p->q_bytes > 0 && p->q_bytes + len > c->cfg.send_queue_bytes && !c->stop) {
        double now = time_now_s();
        if (t0 == 0) {
            t0 = now;
            c->st.send_queue_waits++;
        } else if (now - t0 > c->cfg.send_timeout_s) {
            LOG_WARN("KV transfer: consumer %s read nothing for %.1f s with %zu bytes queued; disconnecting",
                     p->hs.engine_id, c->cfg.send_timeout_s, p->q_bytes);
            p->kill = true;
            poke(c);
            return NULL;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        p = peer_by_gen(c, e->peer, e->gen);
    }
    return c->stop ? NULL : p;
}

// The copy thread: for each layer reported ready, one DATA frame per registered send (rows read
// outside the lock; the step's send list does not change while layers are in flight).
static void *copy_main(void *arg) {
    struct kv_connector *c = arg;
    struct step *sp = &c->step;
    struct qnode **frames = NULL;
    int frames_cap = 0;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        if (sp->cancel || sp->n == 0 || sp->done >= sp->ready) {
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        int l = sp->done, n = sp->n;
        void *ev = sp->ev[l];
        sp->copying = true;
        frames = grow_arr(frames, &frames_cap, n, sizeof *frames);
        pthread_mutex_unlock(&c->mu);
        if (ev && c->pool.wait) c->pool.wait(c->pool.ctx, ev);
        size_t row = c->pool.k_row_bytes[l] + c->pool.v_row_bytes[l];
        for (int i = 0; i < n; i++) {
            struct step_send *e = &sp->s[i];
            frames[i] = NULL;
            if (e->failed || e->n_tok == 0) continue;
            uint8_t *b;
            struct qnode *q = frame_new(KV_FRAME_DATA, e->id, 12 + (size_t)e->n_tok * row, &b);
            uint32_t hdr[3] = {(uint32_t)l, (uint32_t)e->tok0, (uint32_t)e->n_tok};
            memcpy(b, hdr, 12);
            struct error err = {0};
            if (c->pool.copy(c->pool.ctx, l, e->ids, e->tok0, e->n_tok, b + 12, false, &err) != ATOMC_OK) {
                LOG_ERROR("KV transfer %s: reading layer %d: %s", e->id, l, err.msg);
                free(q);
                e->failed = true;
                continue;
            }
            frames[i] = q;
        }
        pthread_mutex_lock(&c->mu);
        for (int i = 0; i < n; i++) {
            if (!frames[i]) continue;
            struct step_send *e = &sp->s[i];
            struct peer *p = sp->cancel ? NULL : wait_for_room(c, e, frames[i]->len);
            if (!p) {
                free(frames[i]);
                e->failed = true;
                continue;
            }
            peer_queue(c, p, frames[i]);
            c->st.bytes_sent += (size_t)e->n_tok * row;
            c->st.layers_sent++;
            if (!sp->ending) c->st.layers_during_forward++;
        }
        sp->done++;
        sp->copying = false;
        pthread_cond_broadcast(&c->cv);
        poke(c);
    }
    pthread_mutex_unlock(&c->mu);
    free(frames);
    return NULL;
}

atomc_status kv_connector_step_add(struct kv_connector *c, const struct kv_send *s, struct error *err) {
    CHECK(s->tok0 >= 0 && s->n_tok >= 0 && s->tok0 + s->n_tok <= s->n_tokens);
    CHECK(s->skip >= 0 && s->skip < s->n_tokens && s->skip % c->pool.block_size == 0 && (s->n_tok == 0 || s->tok0 >= s->skip));
    pthread_mutex_lock(&c->mu);
    struct step *sp = &c->step;
    CHECK_MSG(sp->ready == 0 && !sp->ending, "kv_connector_step_add during a forward");
    atomc_status st = ATOMC_OK;
    struct peer *p = NULL;
    struct tx *t = NULL;
    int bs = c->pool.block_size, n_blocks = (s->n_tokens + bs - 1) / bs;
    for (int i = 0; i < c->n_tx; i++)
        if (!strcmp(c->tx[i].id, s->transfer_id)) t = &c->tx[i];
    if (s->first && !t) {
        int pi = find_consumer(c, s->remote_engine_id, err);
        if (pi < 0) {
            st = err ? err->status : ATOMC_ERR_NOT_FOUND;
            goto out;
        }
        c->tx = grow_arr(c->tx, &c->tx_cap, c->n_tx + 1, sizeof *c->tx);
        t = &c->tx[c->n_tx++];
        snprintf(t->id, sizeof t->id, "%s", s->transfer_id);
        t->peer = pi;
        t->gen = c->peers[pi].gen;
        p = &c->peers[pi];
        int n_full = s->n_tokens / bs;
        size_t len = 12 + (size_t)s->n_tokens * 4 + (size_t)n_full * 8 + (size_t)n_blocks * 4;
        uint8_t *b;
        struct qnode *q = frame_new(KV_FRAME_BEGIN, s->transfer_id, len, &b);
        uint32_t hdr[3] = {(uint32_t)s->n_tokens, (uint32_t)n_blocks, (uint32_t)s->skip};
        memcpy(b, hdr, 12);
        b += 12;
        memcpy(b, s->tokens, (size_t)s->n_tokens * 4);
        memcpy(b + (size_t)s->n_tokens * 4, s->block_hashes, (size_t)n_full * 8);
        memcpy(b + (size_t)s->n_tokens * 4 + (size_t)n_full * 8, s->block_ids, (size_t)n_blocks * 4);
        peer_queue(c, p, q);
        t->skip = s->skip;
    } else if (t) {
        p = peer_by_gen(c, t->peer, t->gen);
    }
    if (!t || !p) {
        st = error_set(err, ATOMC_ERR_IO, "KV transfer %s: the consumer connection is gone", s->transfer_id);
        goto out;
    }
    sp->s = grow_arr(sp->s, &sp->cap, sp->n + 1, sizeof *sp->s);
    struct step_send *e = &sp->s[sp->n++];
    memset(e, 0, sizeof *e);
    snprintf(e->id, sizeof e->id, "%s", s->transfer_id);
    e->peer = t->peer;
    e->gen = t->gen;
    e->ids = xmalloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *e->ids);
    memcpy(e->ids, s->block_ids, (size_t)n_blocks * sizeof *e->ids);
    e->n_tokens = s->n_tokens;
    e->n_blocks = n_blocks;
    e->tok0 = s->tok0;
    e->n_tok = c->cfg.kind == KV_CONNECTOR_TCP ? s->n_tok : 0; // cuda_ipc: the consumer reads the pool itself
    e->last = s->last;
    e->skip = t->skip;
out:
    pthread_mutex_unlock(&c->mu);
    if (st == ATOMC_OK) poke(c);
    return st;
}

void kv_connector_layer_ready(struct kv_connector *c, int layer, void *event) {
    pthread_mutex_lock(&c->mu);
    struct step *sp = &c->step;
    // cuda_ipc sends no DATA: the consumer reads the pool after END.
    if (c->cfg.kind == KV_CONNECTOR_TCP && sp->n > 0 && layer == sp->ready && layer < c->pool.n_layers) {
        sp->ev[layer] = event;
        sp->ready++;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

int kv_connector_step_end(struct kv_connector *c, bool ok, bool *failed, int n_failed) {
    pthread_mutex_lock(&c->mu);
    struct step *sp = &c->step;
    int n = sp->n;
    if (n == 0) {
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
    sp->ending = true;
    if (ok) {
        // Layers the forward did not report (no hook: a fake model, a graph-less path) are
        // complete now that it returned.
        for (int l = sp->ready; l < c->pool.n_layers; l++)
            sp->ev[l] = NULL;
        sp->ready = c->pool.n_layers;
        pthread_cond_broadcast(&c->cv);
        while (sp->done < sp->ready && !c->stop)
            pthread_cond_wait(&c->cv, &c->mu);
    } else {
        sp->cancel = true;
        pthread_cond_broadcast(&c->cv);
        while (sp->copying)
            pthread_cond_wait(&c->cv, &c->mu);
    }
    for (int i = 0; i < n; i++) {
        struct step_send *e = &sp->s[i];
        struct peer *p = peer_by_gen(c, e->peer, e->gen);
        if (!p) e->failed = true;
        if (ok && !e->failed && e->last) {
            // END repeats the block ids: a chunked prefill allocates blocks as it goes, so BEGIN's may be partial.
            peer_send_simple(c, p, KV_FRAME_END, e->id, e->ids, (size_t)e->n_blocks * 4);
            c->st.transfers_sent++;
            c->st.blocks_sent += (uint64_t)(e->n_blocks - e->skip / c->pool.block_size);
            c->st.blocks_skipped += (uint64_t)(e->skip / c->pool.block_size);
            if (c->cfg.kind != KV_CONNECTOR_TCP) c->st.bytes_sent += (size_t)(e->n_tokens - e->skip) * c->token_bytes;
        }
        if (failed && i < n_failed) failed[i] = !ok || e->failed;
        free(e->ids);
    }
    sp->n = sp->ready = sp->done = 0;
    sp->ending = sp->cancel = false;
    pthread_mutex_unlock(&c->mu);
    poke(c);
    return n;
}

atomc_status kv_connector_send(struct kv_connector *c, const struct kv_send *s, struct error *err) {
    atomc_status st = kv_connector_step_add(c, s, err);
    if (st != ATOMC_OK) return st;
    bool failed = false;
    kv_connector_step_end(c, true, &failed, 1);
    if (failed) return error_set(err, ATOMC_ERR_IO, "KV transfer %s: the consumer connection is gone", s->transfer_id);
    return ATOMC_OK;
}

atomc_status kv_connector_query(struct kv_connector *c, const char *id, const char *remote_engine_id,
                                const int32_t *tokens, int n_tokens, struct error *err) {
    CHECK(n_tokens > 0);
    pthread_mutex_lock(&c->mu);
    int pi = find_consumer(c, remote_engine_id, err);
    if (pi >= 0) {
        uint8_t *b;
        struct qnode *q = frame_new(KV_FRAME_QUERY, id, 4 + (size_t)n_tokens * 4, &b);
        uint32_t n = (uint32_t)n_tokens;
        memcpy(b, &n, 4);
        memcpy(b + 4, tokens, (size_t)n_tokens * 4);
        peer_queue(c, &c->peers[pi], q);
    }
    pthread_mutex_unlock(&c->mu);
    if (pi < 0) return err ? err->status : ATOMC_ERR_NOT_FOUND;
    poke(c);
    return ATOMC_OK;
}

int kv_connector_take_have(struct kv_connector *c, const char *id) {
    pthread_mutex_lock(&c->mu);
    int n = -1;
    for (int i = 0; i < c->n_haves; i++)
        if (!strcmp(c->haves[i].id, id)) {
            n = c->haves[i].n_blocks;
            c->haves[i] = c->haves[--c->n_haves];
            break;
        }
    pthread_mutex_unlock(&c->mu);
    return n;
}

void kv_connector_answer_queries(struct kv_connector *c, int (*fn)(void *u, const int32_t *tokens, int n_tokens),
                                 void *u) {
    pthread_mutex_lock(&c->mu);
    int n = c->n_queries;
    struct query *qs = n ? xmalloc((size_t)n * sizeof *qs) : NULL;
    if (n) memcpy(qs, c->queries, (size_t)n * sizeof *qs);
    c->n_queries = 0;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n; i++) {
        int have = fn(u, qs[i].tokens, qs[i].n_tokens);
        uint32_t v = have > 0 ? (uint32_t)have : 0;
        pthread_mutex_lock(&c->mu);
        struct peer *p = peer_by_gen(c, qs[i].peer, qs[i].gen);
        if (p && p->ready) peer_send_simple(c, p, KV_FRAME_HAVE, qs[i].id, &v, 4);
        pthread_mutex_unlock(&c->mu);
        free(qs[i].tokens);
    }
    free(qs);
    if (n) poke(c);
}

void kv_connector_send_abort(struct kv_connector *c, const char *id) {
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n_tx; i++) {
        if (strcmp(c->tx[i].id, id)) continue;
        struct peer *p = peer_by_gen(c, c->tx[i].peer, c->tx[i].gen);
        if (p) peer_send_simple(c, p, KV_FRAME_ABORT, id, NULL, 0);
        c->tx[i] = c->tx[--c->n_tx];
        c->st.transfers_failed++;
        break;
    }
    pthread_mutex_unlock(&c->mu);
    poke(c);
}

void kv_connector_poll_acks(struct kv_connector *c, void (*fn)(void *u, const char *id), void *u) {
    pthread_mutex_lock(&c->mu);
    int n = c->n_acks;
    char(*ids)[KV_ID_MAX] = n ? xmalloc((size_t)n * sizeof *ids) : NULL;
    if (n) memcpy(ids, c->acks, (size_t)n * sizeof *ids);
    c->n_acks = 0;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n; i++)
        fn(u, ids[i]);
    free(ids);
}

enum kv_rx_state kv_connector_lookup(struct kv_connector *c, const char *id, const char *remote_engine_id,
                                     struct kv_rx_info *info) {
    pthread_mutex_lock(&c->mu);
    enum kv_rx_state s = KV_RX_UNKNOWN;
    struct rx *r = rx_find(c, id);
    if (r) {
        s = r->tombstone ? KV_RX_FAILED : r->state;
        if (info && !r->tombstone) {
            // The caller reads tokens / hashes after the lock is gone: keep the entry from expiring now.
            if (r->state == KV_RX_READY && r->t_expire < time_now_s() + 5) r->t_expire = time_now_s() + 5;
            info->n_tokens = r->n_tokens;
            info->tokens = r->tokens;
            info->block_hashes = r->hashes;
            info->skip = r->skip;
            info->t_begin = r->t_begin;
            info->t_end = r->t_end;
        }
    } else if (remote_engine_id && remote_engine_id[0]) {
        bool up = false;
        for (int i = 0; i < KV_MAX_PEERS; i++)
            if (c->peers[i].fd >= 0 && c->peers[i].ready && !strcmp(c->peers[i].hs.engine_id, remote_engine_id))
                up = true;
        if (!up) s = KV_RX_FAILED;
    }
    pthread_mutex_unlock(&c->mu);
    return s;
}

atomc_status kv_connector_claim(struct kv_connector *c, const char *id, const int32_t *block_ids, int n_blocks,
                                struct error *err) {
    pthread_mutex_lock(&c->mu);
    struct rx *r = rx_find(c, id);
    if (!r || r->tombstone || r->state != KV_RX_READY) {
        pthread_mutex_unlock(&c->mu);
        return error_set(err, ATOMC_ERR_NOT_FOUND, "KV transfer %s is not ready", id);
    }
    int n = r->n_tokens, skip = r->skip, peer = r->peer;
    uint64_t gen = r->gen;
    uint8_t *data = r->data;
    int32_t *src = r->src_blocks;
    r->data = NULL;
    r->src_blocks = NULL;
    struct peer *pp = peer_by_gen(c, peer, gen);
    void *ipc_base = pp ? pp->ipc_base : NULL;
    pthread_mutex_unlock(&c->mu);

    atomc_status st = ATOMC_OK;
    size_t bytes = 0;
    CHECK(n_blocks * c->pool.block_size >= n);
    int skip_blocks = skip / c->pool.block_size;
    if (c->cfg.kind == KV_CONNECTOR_TCP) {
        for (int l = 0; l < c->pool.n_layers && st == ATOMC_OK; l++)
            st = c->pool.copy(c->pool.ctx, l, block_ids, skip, n - skip, data + stage_offset(c, l, n - skip), true, err);
        bytes = (size_t)(n - skip) * c->token_bytes;
    } else if (!ipc_base) {
        st = error_set(err, ATOMC_ERR_IO, "KV transfer %s: the producer's connection is gone", id);
    } else {
        st = kv_ipc_copy(&c->pool, ipc_base, src + skip_blocks, block_ids + skip_blocks, n - skip, &bytes, err);
    }
    free(data);
    free(src);

    pthread_mutex_lock(&c->mu);
    r = rx_find(c, id);
    if (r) {
        if (st == ATOMC_OK) {
            c->st.bytes_received += bytes;
            c->st.blocks_received += (uint64_t)((n + c->pool.block_size - 1) / c->pool.block_size - skip_blocks);
            c->st.blocks_skipped += (uint64_t)skip_blocks;
            c->st.transfers_received++;
        } else {
            c->st.transfers_failed++;
        }
        rx_bury(c, r, true);
    }
    pthread_mutex_unlock(&c->mu);
    poke(c);
    return st;
}

void kv_connector_drop(struct kv_connector *c, const char *id) {
    pthread_mutex_lock(&c->mu);
    struct rx *r = rx_find(c, id);
    if (!r) {
        c->rx = grow_arr(c->rx, &c->rx_cap, c->n_rx + 1, sizeof *c->rx);
        r = &c->rx[c->n_rx++];
        memset(r, 0, sizeof *r);
        snprintf(r->id, sizeof r->id, "%s", id);
        r->peer = -1;
        rx_bury(c, r, false);
    } else if (!r->tombstone) {
        rx_bury(c, r, true);
    }
    pthread_mutex_unlock(&c->mu);
    poke(c);
}
