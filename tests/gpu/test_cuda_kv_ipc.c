// The cuda_ipc KV connector (src/kv_transfer/kv_cuda_ipc.c over kv_tcp.c's control channel):
// two processes on one GPU. The producer's pool (device memory, the runner's layout: per layer
// K then V, (blocks, block_size, row) each) is filled with a pattern; it exports its IPC handle in
// the handshake and sends BEGIN / END of a 10-token transfer in blocks {3, 7, 5}; the consumer maps
// the producer's pool, claims the transfer into its blocks {9, 0, 12} (cudaMemcpyAsync device to
// device), and checks every copied row and that the rest of its pool is untouched; the producer
// then sees the ACK. Runs only where a GPU is (make CUDA=1 gpu-tests;
// build-cuda/tests/gpu/test_cuda_kv_ipc); without one it is skipped with the reason.
//
// The processes are forked before either touches CUDA (a CUDA context does not survive fork).
//
// cuda_tcp_layer_sends_wait_for_their_events: the producer side of per-layer sends over `tcp`
// with a device pool, as the runner drives it: for each layer, work that keeps the CUDA backend's
// stream busy, then the layer's rows written into the pool (device to device) and an event
// recorded; kv_connector_layer_ready(layer, event). The connector's copy thread must wait for
// the event (kv_pool_view.wait = the backend's event_sync) and read the rows on the side stream
// (copy_d2h_side): a read that did not wait would see the zeroed pool. The consumer (host pool)
// gets every row exactly.
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "common/timeutil.h"
#include "kv_transfer/kv_connector.h"
#include "test.h"

#define L 2
#define BS 4
#define NB 16
#define ROW 64 // bytes of one token's K (and V) row per layer
#define N_TOK 10
#define SKIP_RC 77

static const size_t rows[L] = {ROW, ROW};
static size_t offs_k[L], offs_v[L];
static const size_t POOL = (size_t)L * 2 * NB * BS * ROW;

static uint8_t pattern(size_t byte) {
    return (uint8_t)(byte * 131 + 7);
}

static atomc_status dev_copy(void *ctx, int layer, const int32_t *blocks, int tok0, int n, void *host, bool to_pool,
                             struct error *err) {
    char *base = ctx, *h = host;
    for (int kv = 0; kv < 2; kv++)
        for (int t = tok0; t < tok0 + n; t++) {
            char *slot = base + (kv ? offs_v[layer] : offs_k[layer]) + ((size_t)blocks[t / BS] * BS + t % BS) * ROW;
            cudaError_t e = to_pool ? cudaMemcpy(slot, h, ROW, cudaMemcpyHostToDevice)
                                    : cudaMemcpy(h, slot, ROW, cudaMemcpyDeviceToHost);
            if (e != cudaSuccess) return error_set(err, ATOMC_ERR_BACKEND, "%s", cudaGetErrorString(e));
            h += ROW;
        }
    return ATOMC_OK;
}

static void view_init(struct kv_pool_view *v, void *d_pool) {
    for (int l = 0; l < L; l++) {
        offs_k[l] = (size_t)l * 2 * NB * BS * ROW;
        offs_v[l] = offs_k[l] + (size_t)NB * BS * ROW;
    }
    memset(v, 0, sizeof *v);
    v->n_layers = L;
    v->block_size = BS;
    v->num_blocks = NB;
    v->k_row_bytes = v->v_row_bytes = rows;
    v->ctx = d_pool;
    v->copy = dev_copy;
    v->base = d_pool;
    v->bytes = POOL;
    v->on_device = true;
    v->k_offset = offs_k;
    v->v_offset = offs_v;
}

static struct kv_handshake hs(const char *id) {
    struct kv_handshake h;
    memset(&h, 0, sizeof h);
    h.version = KV_PROTOCOL_VERSION;
    snprintf(h.engine_id, sizeof h.engine_id, "%s", id);
    snprintf(h.model, sizeof h.model, "ipc-test");
    h.block_size = BS;
    h.n_layers = L;
    h.tp_size = 1;
    h.token_bytes = L * 2 * ROW;
    return h;
}

static int n_acks;
static void on_ack(void *u, const char *id) {
    (void)u;
    if (!strcmp(id, "ipc-1")) n_acks++;
}

static int producer(int port) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return SKIP_RC;
    void *d = NULL;
    if (cudaMalloc(&d, POOL) != cudaSuccess) return 2;
    uint8_t *h = malloc(POOL);
    for (size_t i = 0; i < POOL; i++)
        h[i] = pattern(i);
    cudaMemcpy(d, h, POOL, cudaMemcpyHostToDevice);
    free(h);
    struct kv_pool_view v;
    view_init(&v, d);
    char js[160];
    snprintf(js, sizeof js, "{\"kv_connector\":\"cuda_ipc\",\"kv_role\":\"kv_producer\",\"kv_port\":%d}", port);
    struct kv_transfer_config c;
    struct error e = {0};
    struct kv_connector *k = NULL;
    struct kv_handshake p = hs("P");
    if (kv_transfer_config_parse(js, &c, &e) || kv_connector_create(&c, &p, &v, NULL, NULL, &k, &e)) {
        fprintf(stderr, "producer: %s\n", e.msg);
        return 3;
    }
    struct kv_connector_stats st;
    double end = time_now_s() + 30;
    do {
        kv_connector_get_stats(k, &st);
        usleep(2000);
    } while (st.peers < 1 && time_now_s() < end);
    int32_t tokens[N_TOK] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, blocks[3] = {3, 7, 5};
    uint64_t hashes[2] = {11, 22};
    struct kv_send s = {.transfer_id = "ipc-1",
                        .tokens = tokens,
                        .n_tokens = N_TOK,
                        .block_hashes = hashes,
                        .block_ids = blocks,
                        .tok0 = 0,
                        .n_tok = N_TOK,
                        .first = true,
                        .last = true};
    if (kv_connector_send(k, &s, &e) != ATOMC_OK) {
        fprintf(stderr, "producer: %s\n", e.msg);
        return 4;
    }
    while (!n_acks && time_now_s() < end) { // the consumer acknowledges after its copy
        kv_connector_poll_acks(k, on_ack, NULL);
        usleep(2000);
    }
    kv_connector_get_stats(k, &st);
    int acked = n_acks == 1 && st.transfers_sent == 1 && st.bytes_sent == (uint64_t)N_TOK * L * 2 * ROW;
    sleep(1); // the consumer's checks run on its side; give it the pool until it is done
    kv_connector_free(k);
    cudaFree(d);
    return acked ? 0 : 5;
}

static int consumer(int port) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return SKIP_RC;
    void *d = NULL;
    if (cudaMalloc(&d, POOL) != cudaSuccess) return 2;
    cudaMemset(d, 0, POOL);
    struct kv_pool_view v;
    view_init(&v, d);
    char js[160];
    snprintf(js, sizeof js, "{\"kv_connector\":\"cuda_ipc\",\"kv_role\":\"kv_consumer\",\"kv_port\":%d}", port);
    struct kv_transfer_config c;
    struct error e = {0};
    struct kv_connector *k = NULL;
    struct kv_handshake ch = hs("C");
    if (kv_transfer_config_parse(js, &c, &e) || kv_connector_create(&c, &ch, &v, NULL, NULL, &k, &e)) {
        fprintf(stderr, "consumer: %s\n", e.msg);
        return 3;
    }
    double end = time_now_s() + 30;
    while (kv_connector_lookup(k, "ipc-1", NULL, NULL) != KV_RX_READY && time_now_s() < end)
        usleep(2000);
    int32_t dst[3] = {9, 0, 12}, src[3] = {3, 7, 5};
    if (kv_connector_claim(k, "ipc-1", dst, 3, &e) != ATOMC_OK) {
        fprintf(stderr, "consumer: claim: %s\n", e.msg);
        return 4;
    }
    uint8_t *h = malloc(POOL);
    cudaMemcpy(h, d, POOL, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            size_t off = kv ? offs_v[l] : offs_k[l];
            for (int b = 0; b < NB; b++)
                for (int t = 0; t < BS; t++) {
                    int j = -1; // which transferred block this is, if any
                    for (int i = 0; i < 3; i++)
                        if (dst[i] == b && i * BS + t < N_TOK) j = i;
                    for (int x = 0; x < ROW; x++) {
                        size_t at = off + ((size_t)b * BS + t) * ROW + x;
                        uint8_t want = j < 0 ? 0 : pattern(off + ((size_t)src[j] * BS + t) * ROW + x);
                        if (h[at] != want) bad++;
                    }
                }
        }
    free(h);
    struct kv_connector_stats st;
    kv_connector_get_stats(k, &st);
    if (st.bytes_received != (uint64_t)N_TOK * L * 2 * ROW) bad++;
    usleep(200000); // the ACK goes out on the I/O thread
    kv_connector_free(k);
    cudaFree(d);
    if (bad) fprintf(stderr, "consumer: %d bytes differ\n", bad);
    return bad ? 6 : 0;
}

TEST(cuda_ipc_two_processes_copy_blocks) {
    int port = test_free_port();
    pid_t p = fork();
    if (p == 0) _exit(producer(port));
    pid_t c = fork();
    if (c == 0) _exit(consumer(port));
    int sp = 0, sc = 0;
    waitpid(p, &sp, 0);
    waitpid(c, &sc, 0);
    int rp = WIFEXITED(sp) ? WEXITSTATUS(sp) : 100, rc = WIFEXITED(sc) ? WEXITSTATUS(sc) : 100;
    if (rp == SKIP_RC || rc == SKIP_RC) SKIP("no CUDA device");
    ASSERT_EQ(rc, 0);
    ASSERT_EQ(rp, 0);
}


// --- per-layer sends from a device pool over tcp ------------------------------------------------

static struct backend *g_b;

static atomc_status side_copy(void *ctx, int layer, const int32_t *blocks, int tok0, int n, void *host, bool to_pool,
                              struct error *err) {
    char *base = ctx, *h = host;
    if (to_pool) return error_set(err, ATOMC_ERR_INTERNAL, "producer pool: no writes");
    for (int kv = 0; kv < 2; kv++)
        for (int t = tok0; t < tok0 + n; t++) {
            char *slot = base + (kv ? offs_v[layer] : offs_k[layer]) + ((size_t)blocks[t / BS] * BS + t % BS) * ROW;
            g_b->ops->copy_d2h_side(g_b, h, slot, ROW);
            h += ROW;
        }
    return ATOMC_OK;
}

static void side_wait(void *ctx, void *event) {
    (void)ctx;
    if (event) g_b->ops->event_sync(g_b, event);
}

static atomc_status host_rows(void *ctx, int layer, const int32_t *blocks, int tok0, int n, void *host, bool to_pool,
                              struct error *err) {
    uint8_t *base = ctx, *h = host;
    (void)err;
    for (int kv = 0; kv < 2; kv++)
        for (int t = tok0; t < tok0 + n; t++) {
            uint8_t *slot = base + (kv ? offs_v[layer] : offs_k[layer]) + ((size_t)blocks[t / BS] * BS + t % BS) * ROW;
            if (to_pool)
                memcpy(slot, h, ROW);
            else
                memcpy(h, slot, ROW);
            h += ROW;
        }
    return ATOMC_OK;
}

TEST(cuda_tcp_layer_sends_wait_for_their_events) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) SKIP("no CUDA device");
    struct backend_options bo = {.device_id = 0, .kv_pool_bytes = 16u << 20};
    struct error e = {0};
    if (backend_create("cuda", &bo, &g_b, &e) != ATOMC_OK) SKIP("no CUDA backend: %s", e.msg);
    ASSERT_TRUE(g_b->ops->event_new && g_b->ops->event_record && g_b->ops->event_sync && g_b->ops->copy_d2h_side);
    size_t busy_bytes = (size_t)1 << 30;
    void *pool = g_b->ops->alloc(g_b, POOL), *src = g_b->ops->alloc(g_b, POOL), *busy = g_b->ops->alloc(g_b, busy_bytes);
    ASSERT_TRUE(pool && src && busy);
    uint8_t *h = malloc(POOL), *host_pool = calloc(1, POOL);
    for (size_t i = 0; i < POOL; i++)
        h[i] = pattern(i);
    g_b->ops->copy_h2d(g_b, src, h, POOL);
    g_b->ops->memset_zero(g_b, pool, POOL);
    g_b->ops->synchronize(g_b);
    struct kv_pool_view pv, cv;
    view_init(&pv, pool);
    pv.copy = side_copy;
    pv.wait = side_wait;
    pv.on_device = false; // tcp: the rows travel in DATA frames
    view_init(&cv, host_pool);
    cv.copy = host_rows;
    cv.on_device = false;
    int port = test_free_port();
    char js[160];
    struct kv_transfer_config pc, cc;
    snprintf(js, sizeof js, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d}", port);
    ASSERT_EQ(kv_transfer_config_parse(js, &pc, &e), ATOMC_OK);
    snprintf(js, sizeof js, "{\"kv_role\":\"kv_consumer\",\"kv_port\":%d}", port);
    ASSERT_EQ(kv_transfer_config_parse(js, &cc, &e), ATOMC_OK);
    struct kv_handshake ph = hs("P"), ch = hs("C");
    struct kv_connector *prod = NULL, *cons = NULL;
    ASSERT_EQ(kv_connector_create(&pc, &ph, &pv, NULL, NULL, &prod, &e), ATOMC_OK);
    ASSERT_EQ(kv_connector_create(&cc, &ch, &cv, NULL, NULL, &cons, &e), ATOMC_OK);
    struct kv_connector_stats st;
    double end = time_now_s() + 20;
    do {
        usleep(2000);
        kv_connector_get_stats(prod, &st);
    } while (st.peers < 1 && time_now_s() < end);
    ASSERT_EQ(st.peers, 1);
    int32_t tokens[N_TOK] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, blocks[3] = {3, 7, 5}, dst[3] = {9, 0, 12};
    uint64_t hashes[2] = {11, 22};
    struct kv_send s = {.transfer_id = "layers", .tokens = tokens, .n_tokens = N_TOK, .block_hashes = hashes,
                        .block_ids = blocks, .tok0 = 0, .n_tok = N_TOK, .first = true, .last = true};
    ASSERT_EQ(kv_connector_step_add(prod, &s, &e), ATOMC_OK);
    void *ev[L];
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < 20; k++) // ~10 ms of stream work before the layer's rows exist
            g_b->ops->memset_zero(g_b, busy, busy_bytes);
        g_b->ops->copy_d2d(g_b, (char *)pool + offs_k[l], (char *)src + offs_k[l], 2 * (size_t)NB * BS * ROW);
        ev[l] = g_b->ops->event_new(g_b);
        g_b->ops->event_record(g_b, ev[l]);
        kv_connector_layer_ready(prod, l, ev[l]); // returns at once: the stream is still busy
    }
    bool failed = true;
    ASSERT_EQ(kv_connector_step_end(prod, true, &failed, 1), 1);
    ASSERT_TRUE(!failed);
    end = time_now_s() + 20;
    while (kv_connector_lookup(cons, "layers", NULL, NULL) != KV_RX_READY && time_now_s() < end)
        usleep(2000);
    ASSERT_EQ(kv_connector_claim(cons, "layers", dst, 3, &e), ATOMC_OK);
    int bad = 0;
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int t = 0; t < N_TOK; t++) {
                size_t off = kv ? offs_v[l] : offs_k[l];
                size_t ps = off + ((size_t)blocks[t / BS] * BS + t % BS) * ROW;
                size_t cs = off + ((size_t)dst[t / BS] * BS + t % BS) * ROW;
                for (int x = 0; x < ROW; x++) bad += host_pool[cs + x] != pattern(ps + x);
            }
    kv_connector_get_stats(prod, &st);
    fprintf(stderr, "  device pool over tcp: %llu layer frames, %llu queued before step_end, %d bytes differ\n",
            (unsigned long long)st.layers_sent, (unsigned long long)st.layers_during_forward, bad);
    ASSERT_EQ(bad, 0);
    ASSERT_EQ(st.layers_sent, L);
    kv_connector_free(cons);
    kv_connector_free(prod);
    for (int l = 0; l < L; l++) g_b->ops->event_free(g_b, ev[l]);
    g_b->ops->free(g_b, busy);
    g_b->ops->free(g_b, src);
    g_b->ops->free(g_b, pool);
    backend_destroy(g_b);
    free(h);
    free(host_pool);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
