// KV transfer connector (src/kv_transfer/): --kv-transfer-config parsing, framing (partial
// frames, bad magic, oversize), handshake mismatches, and a producer + consumer pair on loopback
// over host "pools" (a fake pool view with the runner's per-layer row layout): chunked sends
// arrive byte-exact in other blocks, ACKs reach the producer, a refused handshake names the
// field, a producer that dies mid-transfer fails the transfer on the consumer.
#include <stdlib.h>
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

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
