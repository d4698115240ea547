// KV transfer connector (src/kv_transfer/): --kv-transfer-config parsing, framing (partial
// frames, bad magic, oversize), handshake mismatches, and a producer + consumer pair on loopback
// over host "pools" (a fake pool view with the runner's per-layer row layout): chunked sends
// arrive byte-exact in other blocks, ACKs reach the producer, a refused handshake names the
// field, a producer that dies mid-transfer fails the transfer on the consumer.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "engine/block_manager.h"
#include "kv_transfer/kv_connector.h"
#include "test.h"

// --- config ------------------------------------------------------------------------------------

TEST(config_parses_vllm_json) {
    struct kv_transfer_config c;
    struct error e = {0};
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_connector\":\"tcp\",\"kv_role\":\"kv_producer\",\"kv_ip\":\"10.0.0.2\","
                                       "\"kv_port\":7000,\"kv_connector_extra_config\":{\"engine_id\":\"p0\","
                                       "\"timeout_s\":2.5}}",
                                       &c, &e),
              ATOMC_OK);
    ASSERT_EQ(c.kind, KV_CONNECTOR_TCP);
    ASSERT_EQ(c.role, KV_ROLE_PRODUCER);
    ASSERT_STREQ(c.ip, "10.0.0.2");
    ASSERT_EQ(c.port, 7000);
    ASSERT_STREQ(c.engine_id, "p0");
    ASSERT_TRUE(c.timeout_s == 2.5);
    ASSERT_EQ(c.n_producers, 1);
    ASSERT_STREQ(c.producers[0], "10.0.0.2:7000");
    // Defaults: tcp, 127.0.0.1:14579.
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_consumer\"}", &c, &e), ATOMC_OK);
    ASSERT_EQ(c.kind, KV_CONNECTOR_TCP);
    ASSERT_EQ(c.role, KV_ROLE_CONSUMER);
    ASSERT_STREQ(c.producers[0], "127.0.0.1:14579");
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_both\",\"kv_connector\":\"cuda_ipc\","
                                       "\"kv_connector_extra_config\":{\"producers\":[\"a:1\",\"b:2\"]}}",
                                       &c, &e),
              ATOMC_OK);
    ASSERT_EQ(c.kind, KV_CONNECTOR_CUDA_IPC);
    ASSERT_EQ(c.n_producers, 2);
}

TEST(config_rejects_bad_input) {
    struct kv_transfer_config c;
    struct error e = {0};
    ASSERT_EQ(kv_transfer_config_parse("not json", &c, &e), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(kv_transfer_config_parse("{}", &c, &e), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(e.msg, "kv_role") != NULL);
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_decoder\"}", &c, &e), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_producer\",\"kv_port\":70000}", &c, &e),
              ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(e.msg, "kv_port") != NULL);
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_producer\",\"kv_connector\":\"NixlConnector\"}", &c, &e),
              ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "NixlConnector") != NULL);
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_producer\",\"bogus\":1}", &c, &e),
              ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(e.msg, "bogus") != NULL);
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_producer\",\"kv_connector_extra_config\":{\"timeout_s\":-1}}",
                                       &c, &e),
              ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(kv_transfer_config_parse("{\"kv_role\":\"kv_consumer\",\"kv_connector_extra_config\":"
                                       "{\"producers\":[\"nocolon\"]}}",
                                       &c, &e),
              ATOMC_ERR_INVALID_ARGUMENT);
}

// --- framing -----------------------------------------------------------------------------------

TEST(frame_roundtrip_and_partial_reads) {
    uint8_t buf[256];
    size_t h = kv_frame_header(buf, KV_FRAME_DATA, "req-1", 5);
    memcpy(buf + h, "hello", 5);
    size_t total = h + 5;
    struct kv_frame f;
    struct error e = {0};
    for (size_t n = 0; n < total; n++)
        ASSERT_EQ(kv_frame_parse(buf, n, &f, &e), 0); // every partial prefix waits
    ASSERT_EQ(kv_frame_parse(buf, total, &f, &e), (long)total);
    ASSERT_EQ(f.type, KV_FRAME_DATA);
    ASSERT_STREQ(f.id, "req-1");
    ASSERT_EQ(f.body_len, 5);
    ASSERT_TRUE(!memcmp(f.body, "hello", 5));
    // Two frames back to back: the first parses alone.
    size_t h2 = kv_frame_header(buf + total, KV_FRAME_END, "req-1", 0);
    ASSERT_EQ(kv_frame_parse(buf, total + h2, &f, &e), (long)total);
    ASSERT_EQ(kv_frame_parse(buf + total, h2, &f, &e), (long)h2);
    ASSERT_EQ(f.type, KV_FRAME_END);
}

TEST(frame_rejects_garbage) {
    uint8_t buf[64];
    struct kv_frame f;
    struct error e = {0};
    memcpy(buf, "GET / HTTP/1.1\r\n", 16);
    ASSERT_EQ(kv_frame_parse(buf, 16, &f, &e), -1);
    ASSERT_TRUE(strstr(e.msg, "magic") != NULL);
    kv_frame_header(buf, KV_FRAME_ACK, "x", 0);
    uint16_t bad_type = 99;
    memcpy(buf + 4, &bad_type, 2);
    ASSERT_EQ(kv_frame_parse(buf, 13, &f, &e), -1);
    kv_frame_header(buf, KV_FRAME_ACK, "x", 0);
    uint32_t huge = 0x80000000u;
    memcpy(buf + 8, &huge, 4);
    ASSERT_EQ(kv_frame_parse(buf, 13, &f, &e), -1);
    kv_frame_header(buf, KV_FRAME_ACK, "x", 0);
    uint16_t long_id = KV_ID_MAX;
    memcpy(buf + 6, &long_id, 2);
    ASSERT_EQ(kv_frame_parse(buf, 64, &f, &e), -1);
}

// --- handshake ---------------------------------------------------------------------------------

static struct kv_handshake hs_base(const char *id) {
    struct kv_handshake h;
    memset(&h, 0, sizeof h);
    h.version = KV_PROTOCOL_VERSION;
    snprintf(h.engine_id, sizeof h.engine_id, "%s", id);
    snprintf(h.model, sizeof h.model, "tiny");
    snprintf(h.architecture, sizeof h.architecture, "LlamaForCausalLM");
    h.config_hash = 42;
    h.kv_dtype = 1;
    h.block_size = 4;
    h.n_layers = 2;
    h.tp_size = 1;
    h.token_bytes = 2 * (8 + 8);
    h.layer_bytes_hash = 7;
    return h;
}

TEST(handshake_mismatch_names_the_field) {
    struct kv_handshake a = hs_base("a"), b = hs_base("b");
    struct error e = {0};
    ASSERT_EQ(kv_handshake_check(&a, &b, &e), ATOMC_OK);
    struct {
        const char *word;
        void (*change)(struct kv_handshake *);
    } cases[] = {
        {"model", NULL},           {"dtype", NULL},        {"block size", NULL}, {"layer count", NULL},
        {"tensor-parallel", NULL}, {"architecture", NULL}, {"config", NULL},     {"bytes per token", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        b = hs_base("b");
        switch (i) {
        case 0:
            snprintf(b.model, sizeof b.model, "other");
            break;
        case 1:
            b.kv_dtype = 2;
            break;
        case 2:
            b.block_size = 16;
            break;
        case 3:
            b.n_layers = 3;
            break;
        case 4:
            b.tp_size = 2;
            break;
        case 5:
            snprintf(b.architecture, sizeof b.architecture, "Qwen3ForCausalLM");
            break;
        case 6:
            b.config_hash = 43;
            break;
        case 7:
            b.token_bytes = 64;
            break;
        }
        e.msg[0] = 0;
        ASSERT_EQ(kv_handshake_check(&a, &b, &e), ATOMC_ERR_UNSUPPORTED);
        if (!strstr(e.msg, cases[i].word)) {
            test_fail(__FILE__, __LINE__, "case %zu: \"%s\" not in \"%s\"", i, cases[i].word, e.msg);
            return;
        }
    }
}

// --- loopback pair over host pools -------------------------------------------------------------

#define L 2
#define BS 4
#define NB 16
static const size_t k_rows[L] = {8, 12}, v_rows[L] = {8, 4}; // bytes per token per layer

struct host_pool {
    uint8_t *k[L], *v[L]; // (NB, BS, row)
};

static atomc_status host_copy(void *ctx, int layer, const int32_t *blocks, int tok0, int n, void *host, bool to_pool,
                              struct error *err) {
    struct host_pool *p = ctx;
    uint8_t *h = host;
    for (int kv = 0; kv < 2; kv++) {
        size_t row = kv ? v_rows[layer] : k_rows[layer];
        uint8_t *base = kv ? p->v[layer] : p->k[layer];
        for (int t = tok0; t < tok0 + n; t++) {
            uint8_t *slot = base + ((size_t)blocks[t / BS] * BS + t % BS) * row;
            if (to_pool)
                memcpy(slot, h, row);
            else
                memcpy(h, slot, row);
            h += row;
        }
    }
    return ATOMC_OK;
}

static void pool_init(struct host_pool *p, struct kv_pool_view *v, uint8_t seed) {
    for (int l = 0; l < L; l++) {
        p->k[l] = malloc(NB * BS * k_rows[l]);
        p->v[l] = malloc(NB * BS * v_rows[l]);
        for (size_t i = 0; i < NB * BS * k_rows[l]; i++)
            p->k[l][i] = (uint8_t)(seed + i * 7 + l);
        for (size_t i = 0; i < NB * BS * v_rows[l]; i++)
            p->v[l][i] = (uint8_t)(seed + i * 13 + l * 3);
    }
    memset(v, 0, sizeof *v);
    v->n_layers = L;
    v->block_size = BS;
    v->num_blocks = NB;
    v->k_row_bytes = k_rows;
    v->v_row_bytes = v_rows;
    v->ctx = p;
    v->copy = host_copy;
}

static void pool_free(struct host_pool *p) {
    for (int l = 0; l < L; l++)
        free(p->k[l]), free(p->v[l]);
}

static struct kv_handshake hs_pool(const char *id) {
    struct kv_handshake h = hs_base(id);
    h.block_size = BS;
    h.n_layers = L;
    h.token_bytes = 8 + 8 + 12 + 4;
    return h;
}

static int n_acked;
static char last_ack[KV_ID_MAX];
static void on_ack(void *u, const char *id) {
    (void)u;
    n_acked++;
    snprintf(last_ack, sizeof last_ack, "%s", id);
}

static bool wait_for(bool (*cond)(void *), void *arg, double secs) {
    double end = time_now_s() + secs;
    while (time_now_s() < end) {
        if (cond(arg)) return true;
        usleep(2000);
    }
    return cond(arg);
}

static bool peers_up(void *arg) {
    struct kv_connector_stats s;
    kv_connector_get_stats(arg, &s);
    return s.peers >= 1;
}

struct lookup_arg {
    struct kv_connector *c;
    const char *id;
    enum kv_rx_state want;
};
static bool state_is(void *arg) {
    struct lookup_arg *a = arg;
    return kv_connector_lookup(a->c, a->id, NULL, NULL) == a->want;
}

static bool has_error(void *arg) {
    struct kv_connector_stats s;
    kv_connector_get_stats(arg, &s);
    return s.last_error[0] != 0;
}

static void make_pair(int port, struct kv_pool_view *pv, struct kv_pool_view *cv, struct kv_connector **prod,
                      struct kv_connector **cons, struct kv_handshake *chs) {
    struct kv_transfer_config pc, cc;
    struct error e = {0};
    char js[200];
    snprintf(js, sizeof js,
             "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"P\"}}", port);
    CHECK(kv_transfer_config_parse(js, &pc, &e) == ATOMC_OK);
    snprintf(js, sizeof js,
             "{\"kv_role\":\"kv_consumer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"C\"}}", port);
    CHECK(kv_transfer_config_parse(js, &cc, &e) == ATOMC_OK);
    struct kv_handshake ph = hs_pool("P");
    struct kv_handshake ch = chs ? *chs : hs_pool("C");
    CHECK(kv_connector_create(&pc, &ph, pv, NULL, NULL, prod, &e) == ATOMC_OK);
    CHECK(kv_connector_create(&cc, &ch, cv, NULL, NULL, cons, &e) == ATOMC_OK);
}

TEST(loopback_transfer_is_byte_exact_and_acked) {
    struct host_pool pp, cp;
    struct kv_pool_view pv, cv;
    pool_init(&pp, &pv, 1);
    pool_init(&cp, &cv, 200);
    struct kv_connector *prod, *cons;
    make_pair(test_free_port(), &pv, &cv, &prod, &cons, NULL);
    ASSERT_TRUE(wait_for(peers_up, prod, 5));
    ASSERT_TRUE(wait_for(peers_up, cons, 5));

    // A 10-token prompt in producer blocks {3, 7, 5}, sent in two chunks (6 then 4 tokens).
    int32_t tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, pblocks[3] = {3, 7, 5}, cblocks[3] = {9, 0, 12};
    uint64_t hashes[2];
    hashes[0] = block_hash_xxh64(tokens, BS, 0);
    hashes[1] = block_hash_xxh64(tokens + BS, BS, hashes[0]);
    struct kv_send s = {.transfer_id = "t1",
                        .tokens = tokens,
                        .n_tokens = 10,
                        .block_hashes = hashes,
                        .block_ids = pblocks,
                        .tok0 = 0,
                        .n_tok = 6,
                        .first = true};
    struct error e = {0};
    ASSERT_EQ(kv_connector_send(prod, &s, &e), ATOMC_OK);
    struct lookup_arg la = {cons, "t1", KV_RX_PENDING};
    ASSERT_TRUE(wait_for(state_is, &la, 5));
    s.tok0 = 6;
    s.n_tok = 4;
    s.first = false;
    s.last = true;
    ASSERT_EQ(kv_connector_send(prod, &s, &e), ATOMC_OK);
    la.want = KV_RX_READY;
    ASSERT_TRUE(wait_for(state_is, &la, 5));
    struct kv_rx_info info;
    ASSERT_EQ(kv_connector_lookup(cons, "t1", NULL, &info), KV_RX_READY);
    ASSERT_EQ(info.n_tokens, 10);
    ASSERT_TRUE(!memcmp(info.tokens, tokens, sizeof tokens));
    ASSERT_TRUE(info.block_hashes[0] == hashes[0] && info.block_hashes[1] == hashes[1]);
    ASSERT_EQ(kv_connector_claim(cons, "t1", cblocks, 3, &e), ATOMC_OK);
    for (int l = 0; l < L; l++)
        for (int t = 0; t < 10; t++) {
            size_t ps = (size_t)pblocks[t / BS] * BS + t % BS, cs = (size_t)cblocks[t / BS] * BS + t % BS;
            ASSERT_TRUE(!memcmp(pp.k[l] + ps * k_rows[l], cp.k[l] + cs * k_rows[l], k_rows[l]));
            ASSERT_TRUE(!memcmp(pp.v[l] + ps * v_rows[l], cp.v[l] + cs * v_rows[l], v_rows[l]));
        }
    // Slots past the prompt in the last consumer block are untouched.
    ASSERT_EQ(cp.k[0][((size_t)12 * BS + 3) * k_rows[0]], (uint8_t)(200 + ((size_t)12 * BS + 3) * k_rows[0] * 7));
    struct kv_connector_stats ps, cs;
    kv_connector_get_stats(cons, &cs);
    ASSERT_EQ(cs.bytes_received, 10 * (8 + 8 + 12 + 4));
    ASSERT_EQ(cs.blocks_received, 3);
    ASSERT_EQ(cs.transfers_received, 1);
    n_acked = 0;
    for (int i = 0; i < 500 && !n_acked; i++) {
        kv_connector_poll_acks(prod, on_ack, NULL);
        usleep(2000);
    }
    ASSERT_EQ(n_acked, 1);
    ASSERT_STREQ(last_ack, "t1");
    kv_connector_get_stats(prod, &ps);
    ASSERT_EQ(ps.bytes_sent, 10 * (8 + 8 + 12 + 4));
    ASSERT_EQ(ps.transfers_sent, 1);
    ASSERT_EQ(kv_connector_lookup(cons, "t1", NULL, NULL), KV_RX_FAILED); // claimed: gone (a tombstone)

    // A dropped transfer is acknowledged too (the producer frees its blocks).
    s = (struct kv_send){.transfer_id = "t2",
                         .tokens = tokens,
                         .n_tokens = 3,
                         .block_hashes = hashes,
                         .block_ids = pblocks,
                         .tok0 = 0,
                         .n_tok = 3,
                         .first = true,
                         .last = true};
    kv_connector_drop(cons, "t2"); // the decode side gave up before the KV came
    ASSERT_EQ(kv_connector_send(prod, &s, &e), ATOMC_OK);
    n_acked = 0;
    for (int i = 0; i < 500 && !n_acked; i++) {
        kv_connector_poll_acks(prod, on_ack, NULL);
        usleep(2000);
    }
    ASSERT_EQ(n_acked, 1);
    ASSERT_STREQ(last_ack, "t2");
    // Naming a consumer that is not connected fails at once.
    s.transfer_id = "t3";
    s.remote_engine_id = "nobody";
    ASSERT_EQ(kv_connector_send(prod, &s, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "nobody") != NULL);
    kv_connector_free(cons);
    kv_connector_free(prod);
    pool_free(&pp);
    pool_free(&cp);
}

TEST(loopback_handshake_mismatch_refused) {
    struct host_pool pp, cp;
    struct kv_pool_view pv, cv;
    pool_init(&pp, &pv, 1);
    pool_init(&cp, &cv, 2);
    struct kv_handshake bad = hs_pool("C");
    bad.block_size = 16;
    struct kv_connector *prod, *cons;
    make_pair(test_free_port(), &pv, &cv, &prod, &cons, &bad);
    ASSERT_TRUE(wait_for(has_error, cons, 5));
    ASSERT_TRUE(wait_for(has_error, prod, 5));
    struct kv_connector_stats s;
    kv_connector_get_stats(cons, &s);
    ASSERT_TRUE(strstr(s.last_error, "block size") != NULL);
    ASSERT_EQ(s.peers, 0);
    kv_connector_get_stats(prod, &s);
    ASSERT_TRUE(strstr(s.last_error, "block size") != NULL);
    ASSERT_EQ(s.peers, 0);
    kv_connector_free(cons);
    kv_connector_free(prod);
    pool_free(&pp);
    pool_free(&cp);
}

TEST(loopback_dead_producer_fails_pending_transfer) {
    struct host_pool pp, cp;
    struct kv_pool_view pv, cv;
    pool_init(&pp, &pv, 1);
    pool_init(&cp, &cv, 2);
    struct kv_connector *prod, *cons;
    make_pair(test_free_port(), &pv, &cv, &prod, &cons, NULL);
    ASSERT_TRUE(wait_for(peers_up, prod, 5));
    ASSERT_TRUE(wait_for(peers_up, cons, 5));
    int32_t tokens[6] = {1, 2, 3, 4, 5, 6}, blocks[2] = {0, 1};
    uint64_t h[1] = {block_hash_xxh64(tokens, BS, 0)};
    struct kv_send s = {.transfer_id = "t",
                        .tokens = tokens,
                        .n_tokens = 6,
                        .block_hashes = h,
                        .block_ids = blocks,
                        .tok0 = 0,
                        .n_tok = 4,
                        .first = true};
    struct error e = {0};
    ASSERT_EQ(kv_connector_send(prod, &s, &e), ATOMC_OK);
    struct lookup_arg la = {cons, "t", KV_RX_PENDING};
    ASSERT_TRUE(wait_for(state_is, &la, 5));
    kv_connector_free(prod); // dies before END
    la.want = KV_RX_FAILED;
    ASSERT_TRUE(wait_for(state_is, &la, 5));
    // A transfer from a named producer that is not connected cannot arrive: FAILED at once.
    ASSERT_EQ(kv_connector_lookup(cons, "other", "P", NULL), KV_RX_FAILED);
    ASSERT_EQ(kv_connector_lookup(cons, "other", NULL, NULL), KV_RX_UNKNOWN);
    kv_connector_free(cons);
    pool_free(&pp);
    pool_free(&cp);
}


// --- per-layer sends inside the forward --------------------------------------------------------

static bool layers_received_is(void *arg) {
    struct kv_connector_stats s;
    struct lookup_arg *a = arg;
    kv_connector_get_stats(a->c, &s);
    return s.layers_received == (uint64_t)a->want;
}

static void *waited[L];
static int n_waited;
static void host_wait(void *ctx, void *event) {
    (void)ctx;
    if (n_waited < L) waited[n_waited] = event;
    n_waited++;
}

// A step registered before the "forward", two layers reported one at a time: layer 0's rows
// reach the consumer before layer 1 is even reported (the forward is still running), each layer's
// event is waited for before its rows are read, and the result is byte-exact.
TEST(loopback_layers_are_sent_while_the_forward_runs) {
    struct host_pool pp, cp;
    struct kv_pool_view pv, cv;
    pool_init(&pp, &pv, 3);
    pool_init(&cp, &cv, 90);
    pv.wait = host_wait;
    n_waited = 0;
    struct kv_connector *prod, *cons;
    make_pair(test_free_port(), &pv, &cv, &prod, &cons, NULL);
    ASSERT_TRUE(wait_for(peers_up, prod, 5));
    ASSERT_TRUE(wait_for(peers_up, cons, 5));
    int32_t tokens[7] = {5, 4, 3, 2, 1, 0, 9}, pblocks[2] = {6, 2}, cblocks[2] = {1, 11};
    uint64_t hashes[1] = {block_hash_xxh64(tokens, BS, 0)};
    struct kv_send s = {.transfer_id = "layers",
                        .tokens = tokens,
                        .n_tokens = 7,
                        .block_hashes = hashes,
                        .block_ids = pblocks,
                        .tok0 = 0,
                        .n_tok = 7,
                        .first = true,
                        .last = true};
    struct error e = {0};
    ASSERT_EQ(kv_connector_step_add(prod, &s, &e), ATOMC_OK);
    int ev0, ev1; // stand-ins for the backend's per-layer events
    kv_connector_layer_ready(prod, 0, &ev0);
    struct lookup_arg la = {cons, "layers", 1};
    ASSERT_TRUE(wait_for(layers_received_is, &la, 5)); // layer 0 arrived; layer 1 not "computed" yet
    ASSERT_EQ(kv_connector_lookup(cons, "layers", NULL, NULL), KV_RX_PENDING);
    kv_connector_layer_ready(prod, 1, &ev1);
    la.want = 2;
    ASSERT_TRUE(wait_for(layers_received_is, &la, 5));
    bool failed = true;
    ASSERT_EQ(kv_connector_step_end(prod, true, &failed, 1), 1);
    ASSERT_TRUE(!failed);
    ASSERT_EQ(n_waited, 2);
    ASSERT_TRUE(waited[0] == &ev0 && waited[1] == &ev1);
    struct lookup_arg ready = {cons, "layers", KV_RX_READY};
    ASSERT_TRUE(wait_for(state_is, &ready, 5));
    ASSERT_EQ(kv_connector_claim(cons, "layers", cblocks, 2, &e), ATOMC_OK);
    for (int l = 0; l < L; l++)
        for (int t = 0; t < 7; t++) {
            size_t ps = (size_t)pblocks[t / BS] * BS + t % BS, cs = (size_t)cblocks[t / BS] * BS + t % BS;
            ASSERT_TRUE(!memcmp(pp.k[l] + ps * k_rows[l], cp.k[l] + cs * k_rows[l], k_rows[l]));
            ASSERT_TRUE(!memcmp(pp.v[l] + ps * v_rows[l], cp.v[l] + cs * v_rows[l], v_rows[l]));
        }
    struct kv_connector_stats ps;
    kv_connector_get_stats(prod, &ps);
    ASSERT_EQ(ps.layers_sent, 2);
    ASSERT_EQ(ps.layers_during_forward, 2); // both queued before step_end
    ASSERT_EQ(ps.bytes_sent, 7 * (8 + 8 + 12 + 4));

    // A failed forward drops the registered send: no DATA, no END.
    s.transfer_id = "failed-step";
    ASSERT_EQ(kv_connector_step_add(prod, &s, &e), ATOMC_OK);
    ASSERT_EQ(kv_connector_step_end(prod, false, &failed, 1), 1);
    ASSERT_TRUE(failed);
    kv_connector_send_abort(prod, "failed-step");
    struct lookup_arg gone = {cons, "failed-step", KV_RX_FAILED};
    ASSERT_TRUE(wait_for(state_is, &gone, 5));
    kv_connector_get_stats(prod, &ps);
    ASSERT_EQ(ps.layers_sent, 2);
    kv_connector_free(cons);
    kv_connector_free(prod);
    pool_free(&pp);
    pool_free(&cp);
}

// --- bounded send queue ------------------------------------------------------------------------

// A pool whose rows are big (128 KiB per token and layer) and generated, not stored.
#define BIG_ROW ((size_t)64 << 10)
static const size_t big_rows[L] = {BIG_ROW, BIG_ROW};
static atomc_status big_copy(void *ctx, int layer, const int32_t *blocks, int tok0, int n, void *host, bool to_pool,
                             struct error *err) {
    (void)ctx;
    (void)blocks;
    CHECK(!to_pool);
    memset(host, (int)(layer * 16 + tok0), (size_t)n * 2 * BIG_ROW);
    return ATOMC_OK;
}

// A consumer by hand over a raw socket with a small receive buffer: HELLO, then it reads only
// when told to.
static int raw_consumer(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int small = 32 << 10;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
    struct kv_handshake h = hs_pool("slow");
    h.role = KV_ROLE_CONSUMER;
    h.token_bytes = 2 * 2 * BIG_ROW;
    uint8_t buf[KV_FRAME_HEADER + 16 + sizeof h];
    size_t n = kv_frame_header(buf, KV_FRAME_HELLO, "slow", sizeof h);
    memcpy(buf + n, &h, sizeof h);
    CHECK(write(fd, buf, n + sizeof h) == (ssize_t)(n + sizeof h));
    return fd;
}

struct reader {
    int fd;
    uint64_t data_bytes;
    int n_end, n_hello_ok;
};

// Reads frames until END (or the connection closes); counts DATA payload bytes.
static void *raw_read_all(void *arg) {
    struct reader *r = arg;
    size_t cap = (size_t)64 << 20, len = 0;
    uint8_t *in = malloc(cap);
    for (;;) {
        ssize_t n = read(r->fd, in + len, cap - len);
        if (n <= 0) break;
        len += (size_t)n;
        size_t off = 0;
        for (;;) {
            struct kv_frame f;
            struct error e = {0};
            long k = kv_frame_parse(in + off, len - off, &f, &e);
            if (k <= 0) break;
            if (f.type == KV_FRAME_DATA) r->data_bytes += f.body_len - 12;
            if (f.type == KV_FRAME_END) r->n_end++;
            if (f.type == KV_FRAME_HELLO_OK) r->n_hello_ok++;
            off += (size_t)k;
        }
        memmove(in, in + off, len - off);
        len -= off;
        if (r->n_end) break;
    }
    free(in);
    return NULL;
}

struct sender {
    struct kv_connector *c;
    struct kv_send s;
    atomc_status st;
    double t_done;
};

static void *send_thread(void *arg) {
    struct sender *x = arg;
    struct error e = {0};
    x->st = kv_connector_send(x->c, &x->s, &e);
    x->t_done = time_now_s();
    return NULL;
}

static struct kv_connector *big_producer(int port, double send_timeout, struct kv_pool_view *pv) {
    memset(pv, 0, sizeof *pv);
    pv->n_layers = L;
    pv->block_size = BS;
    pv->num_blocks = NB;
    pv->k_row_bytes = big_rows;
    pv->v_row_bytes = big_rows;
    pv->copy = big_copy;
    char js[300];
    snprintf(js, sizeof js,
             "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"kv_connector_extra_config\":{\"engine_id\":\"P\","
             "\"send_queue_bytes\":1048576,\"send_timeout_s\":%g}}",
             port, send_timeout);
    struct kv_transfer_config pc;
    struct error e = {0};
    CHECK(kv_transfer_config_parse(js, &pc, &e) == ATOMC_OK);
    struct kv_handshake ph = hs_pool("P");
    ph.token_bytes = 2 * 2 * BIG_ROW;
    struct kv_connector *prod;
    CHECK(kv_connector_create(&pc, &ph, pv, NULL, NULL, &prod, &e) == ATOMC_OK);
    return prod;
}

// 16 MiB of KV for a consumer that reads nothing for a second: the producer's step waits (it
// does not queue the whole transfer: a layer's frame is queued only when the connection's queue
// is under the 1 MiB cap, and more than the socket buffers hold is in flight), the queue never
// holds more than the cap plus one frame, and once the consumer reads, every byte arrives.
TEST(send_queue_bounded_with_a_slow_consumer) {
    int port = test_free_port();
    struct kv_pool_view pv;
    struct kv_connector *prod = big_producer(port, 30, &pv);
    int fd = raw_consumer(port);
    ASSERT_TRUE(wait_for(peers_up, prod, 5));
    int32_t tokens[64], blocks[16];
    for (int i = 0; i < 64; i++) tokens[i] = i;
    for (int i = 0; i < 16; i++) blocks[i] = i;
    uint64_t hashes[16] = {0};
    // Step 1: 48 tokens (two layer frames of 6 MiB); step 2: the last 16.
    const uint64_t frame_max = 48 * 2 * BIG_ROW + 64, cap = (uint64_t)1 << 20;
    struct sender x = {.c = prod, .st = ATOMC_ERR_INTERNAL};
    x.s = (struct kv_send){.transfer_id = "big", .tokens = tokens, .n_tokens = 64, .block_hashes = hashes,
                           .block_ids = blocks, .tok0 = 0, .n_tok = 48, .first = true};
    double t0 = time_now_s();
    pthread_t th;
    pthread_create(&th, NULL, send_thread, &x);
    usleep(1000 * 1000); // the consumer reads nothing for 1 s
    bool done_early = x.t_done != 0;
    struct kv_connector_stats ps;
    kv_connector_get_stats(prod, &ps);
    ASSERT_TRUE(!done_early); // the step still waits for room
    ASSERT_TRUE(ps.send_queue_waits >= 1);
    ASSERT_TRUE(ps.send_queue_peak <= cap + frame_max + 4096);
    struct reader rd = {.fd = fd};
    pthread_t rt;
    pthread_create(&rt, NULL, raw_read_all, &rd);
    pthread_join(th, NULL);
    ASSERT_EQ(x.st, ATOMC_OK);
    ASSERT_TRUE(x.t_done - t0 >= 1.0);
    x.s.tok0 = 48;
    x.s.n_tok = 16;
    x.s.first = false;
    x.s.last = true;
    struct error e = {0};
    ASSERT_EQ(kv_connector_send(prod, &x.s, &e), ATOMC_OK);
    pthread_join(rt, NULL);
    ASSERT_EQ(rd.n_hello_ok, 1);
    ASSERT_EQ(rd.n_end, 1);
    ASSERT_EQ(rd.data_bytes, 64 * 2 * 2 * BIG_ROW);
    kv_connector_get_stats(prod, &ps);
    ASSERT_TRUE(ps.send_queue_peak <= cap + frame_max + 4096);
    ASSERT_EQ(ps.bytes_sent, 64 * 2 * 2 * BIG_ROW);
    fprintf(stderr, "  slow consumer: send queue peak %llu bytes (cap %llu, one frame %llu), %llu waits\n",
            (unsigned long long)ps.send_queue_peak, (unsigned long long)cap, (unsigned long long)frame_max,
            (unsigned long long)ps.send_queue_waits);
    close(fd);
    kv_connector_free(prod);
}

// A consumer that never reads: after send_timeout_s the producer gives up on it (the send fails,
// the connection is closed), instead of waiting forever.
TEST(send_queue_full_past_the_timeout_drops_the_consumer) {
    int port = test_free_port();
    struct kv_pool_view pv;
    struct kv_connector *prod = big_producer(port, 0.3, &pv);
    int fd = raw_consumer(port);
    ASSERT_TRUE(wait_for(peers_up, prod, 5));
    int32_t tokens[64] = {0}, blocks[16] = {0};
    uint64_t hashes[16] = {0};
    struct kv_send s = {.transfer_id = "stuck", .tokens = tokens, .n_tokens = 64, .block_hashes = hashes,
                        .block_ids = blocks, .tok0 = 0, .n_tok = 64, .first = true, .last = true};
    struct error e = {0};
    double t0 = time_now_s();
    ASSERT_EQ(kv_connector_send(prod, &s, &e), ATOMC_ERR_IO);
    double dt = time_now_s() - t0;
    ASSERT_TRUE(dt >= 0.3 && dt < 5);
    struct kv_connector_stats ps;
    for (int i = 0; i < 250; i++) {
        kv_connector_get_stats(prod, &ps);
        if (ps.peers == 0) break;
        usleep(20000);
    }
    ASSERT_EQ(ps.peers, 0);
    ASSERT_TRUE(ps.transfers_failed >= 1);
    close(fd);
    kv_connector_free(prod);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
