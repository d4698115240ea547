// --kv-transfer-config parsing, the handshake check and the frame codec (kv_connector.h).
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kv_transfer/kv_connector.h"

const char *kv_role_name(enum kv_role r) {
    switch (r) {
    case KV_ROLE_PRODUCER:
        return "kv_producer";
    case KV_ROLE_CONSUMER:
        return "kv_consumer";
    case KV_ROLE_BOTH:
        return "kv_both";
    default:
        return "none";
    }
}

static atomc_status bad(struct error *err, const char *key, const char *what) {
    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--kv-transfer-config: \"%s\" %s", key, what);
}

static atomc_status take_timeout(json_t *v, const char *key, double *out, struct error *err) {
    if (!json_is_number(v) || json_number_value(v) <= 0 || json_number_value(v) > 86400)
        return bad(err, key, "must be a number of seconds in (0, 86400]");
    *out = json_number_value(v);
    return ATOMC_OK;
}

static atomc_status parse_extra(json_t *x, struct kv_transfer_config *c, struct error *err) {
    if (!json_is_object(x)) return bad(err, "kv_connector_extra_config", "must be an object");
    const char *k;
    json_t *v;
    json_object_foreach(x, k, v) {
        atomc_status st = ATOMC_OK;
        if (!strcmp(k, "engine_id")) {
            if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) >= KV_ID_MAX)
                return bad(err, "engine_id", "must be a non-empty string of fewer than 96 bytes");
            snprintf(c->engine_id, sizeof c->engine_id, "%s", json_string_value(v));
        } else if (!strcmp(k, "timeout_s")) {
            st = take_timeout(v, "timeout_s", &c->timeout_s, err);
        } else if (!strcmp(k, "hold_timeout_s")) {
            st = take_timeout(v, "hold_timeout_s", &c->hold_timeout_s, err);
        } else if (!strcmp(k, "query_timeout_s")) {
            st = take_timeout(v, "query_timeout_s", &c->query_timeout_s, err);
        } else if (!strcmp(k, "send_timeout_s")) {
            st = take_timeout(v, "send_timeout_s", &c->send_timeout_s, err);
        } else if (!strcmp(k, "send_queue_bytes")) {
            if (!json_is_integer(v) || json_integer_value(v) < 4096)
                return bad(err, "send_queue_bytes", "must be an integer of at least 4096 bytes");
            c->send_queue_bytes = (uint64_t)json_integer_value(v);
        } else if (!strcmp(k, "producers")) {
            if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > KV_MAX_PRODUCERS)
                return bad(err, "producers", "must be a list of 1 to 8 \"host:port\" strings");
            c->n_producers = 0;
            for (size_t i = 0; i < json_array_size(v); i++) {
                json_t *p = json_array_get(v, i);
                const char *s = json_string_value(p);
                const char *colon = s ? strrchr(s, ':') : NULL;
                if (!s || !colon || colon == s || strlen(s) >= sizeof c->producers[0] || atoi(colon + 1) <= 0 ||
                    atoi(colon + 1) > 65535)
                    return bad(err, "producers", "entries must be \"host:port\" strings");
                snprintf(c->producers[c->n_producers++], sizeof c->producers[0], "%s", s);
            }
        } else {
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "--kv-transfer-config: unsupported kv_connector_extra_config key \"%s\" (supported: "
                             "engine_id, timeout_s, hold_timeout_s, query_timeout_s, send_queue_bytes, send_timeout_s, producers)",
                             k);
        }
        if (st != ATOMC_OK) return st;
    }
    return ATOMC_OK;
}

atomc_status kv_transfer_config_parse(const char *text, struct kv_transfer_config *c, struct error *err) {
    memset(c, 0, sizeof *c);
    c->kind = KV_CONNECTOR_TCP;
    snprintf(c->ip, sizeof c->ip, "127.0.0.1");
    c->port = 14579;
    c->timeout_s = 10;
    c->hold_timeout_s = 60;
    c->send_queue_bytes = (uint64_t)64 << 20;
    c->send_timeout_s = 30;
    c->query_timeout_s = 0.5;
    json_error_t je;
    json_t *j = json_loads(text ? text : "", 0, &je);
    if (!json_is_object(j)) {
        json_decref(j);
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--kv-transfer-config expects a JSON object, got '%.80s'",
                         text ? text : "");
    }
    atomc_status st = ATOMC_OK;
    bool role_set = false;
    const char *k;
    json_t *v;
    json_object_foreach(j, k, v) {
        if (json_is_null(v)) continue;
        if (!strcmp(k, "kv_connector")) {
            const char *s = json_string_value(v);
            if (!s)
                st = bad(err, k, "must be a string");
            else if (!strcmp(s, "tcp") || !strcmp(s, "TcpConnector"))
                c->kind = KV_CONNECTOR_TCP;
            else if (!strcmp(s, "cuda_ipc") || !strcmp(s, "CudaIpcConnector"))
                c->kind = KV_CONNECTOR_CUDA_IPC;
            else
                st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                               "--kv-transfer-config: kv_connector \"%s\" is not implemented (atomc has \"tcp\" and "
                               "\"cuda_ipc\")",
                               s);
        } else if (!strcmp(k, "kv_role")) {
            const char *s = json_string_value(v);
            role_set = true;
            if (s && !strcmp(s, "kv_producer"))
                c->role = KV_ROLE_PRODUCER;
            else if (s && !strcmp(s, "kv_consumer"))
                c->role = KV_ROLE_CONSUMER;
            else if (s && !strcmp(s, "kv_both"))
                c->role = KV_ROLE_BOTH;
            else
                st = bad(err, k, "must be \"kv_producer\", \"kv_consumer\" or \"kv_both\"");
        } else if (!strcmp(k, "kv_ip")) {
            if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) >= sizeof c->ip)
                st = bad(err, k, "must be a host name or address");
            else
                snprintf(c->ip, sizeof c->ip, "%s", json_string_value(v));
        } else if (!strcmp(k, "kv_port")) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 65535)
                st = bad(err, k, "must be an integer port in [1, 65535]");
            else
                c->port = (int)json_integer_value(v);
        } else if (!strcmp(k, "kv_connector_extra_config")) {
            st = parse_extra(v, c, err);
        } else if (!strcmp(k, "kv_rank") || !strcmp(k, "kv_parallel_size") || !strcmp(k, "kv_buffer_device") ||
                   !strcmp(k, "kv_buffer_size") || !strcmp(k, "engine_id")) {
            // vLLM fields with no meaning here; engine_id at the top level is vLLM's spelling too.
            if (!strcmp(k, "engine_id") && json_is_string(v) && json_string_length(v) < KV_ID_MAX)
                snprintf(c->engine_id, sizeof c->engine_id, "%s", json_string_value(v));
        } else {
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                           "--kv-transfer-config: unsupported key \"%s\" (supported: kv_connector, kv_role, kv_ip, "
                           "kv_port, kv_connector_extra_config)",
                           k);
        }
        if (st != ATOMC_OK) break;
    }
    json_decref(j);
    if (st != ATOMC_OK) return st;
    if (!role_set) return bad(err, "kv_role", "is required");
    if (!c->n_producers) {
        snprintf(c->producers[0], sizeof c->producers[0], "%s:%d", c->ip, c->port);
        c->n_producers = 1;
    }
    if (!c->engine_id[0])
        snprintf(c->engine_id, sizeof c->engine_id, "%s-%ld", c->role == KV_ROLE_PRODUCER ? "prefill" : "decode",
                 (long)getpid());
    return ATOMC_OK;
}

atomc_status kv_handshake_check(const struct kv_handshake *a, const struct kv_handshake *b, struct error *err) {
#define MISMATCH(what, fa, fb, ...)                                                                                    \
    return error_set(err, ATOMC_ERR_UNSUPPORTED,                                                                       \
                     "KV transfer handshake refused: " what " differs (this instance " fa ", peer %s " fb ")",         \
                     __VA_ARGS__)
    if (a->version != b->version) MISMATCH("protocol version", "%u", "%u", a->version, b->engine_id, b->version);
    if (strcmp(a->model, b->model)) MISMATCH("model", "\"%s\"", "\"%s\"", a->model, b->engine_id, b->model);
    if (strcmp(a->architecture, b->architecture))
        MISMATCH("architecture", "%s", "%s", a->architecture, b->engine_id, b->architecture);
    // Before the config hash: a rank's config holds its share of the heads, so a TP mismatch
    // changes the hash too, and the layout is the real difference.
    if (a->tp_size != b->tp_size || a->tp_rank != b->tp_rank)
        MISMATCH("tensor-parallel layout", "tp %d rank %d", "tp %d rank %d", a->tp_size, a->tp_rank, b->engine_id,
                 b->tp_size, b->tp_rank);
    if (a->config_hash != b->config_hash)
        MISMATCH("model config", "hash %016llx", "hash %016llx", (unsigned long long)a->config_hash, b->engine_id,
                 (unsigned long long)b->config_hash);
    if (a->kv_dtype != b->kv_dtype) MISMATCH("KV dtype", "%d", "%d", a->kv_dtype, b->engine_id, b->kv_dtype);
    if (a->block_size != b->block_size) MISMATCH("block size", "%d", "%d", a->block_size, b->engine_id, b->block_size);
    if (a->n_layers != b->n_layers) MISMATCH("layer count", "%d", "%d", a->n_layers, b->engine_id, b->n_layers);
    if (a->token_bytes != b->token_bytes || a->layer_bytes_hash != b->layer_bytes_hash)
        MISMATCH("KV bytes per token", "%llu", "%llu", (unsigned long long)a->token_bytes, b->engine_id,
                 (unsigned long long)b->token_bytes);
#undef MISMATCH
    return ATOMC_OK;
}

size_t kv_pool_token_bytes(const struct kv_pool_view *p) {
    size_t t = 0;
    for (int l = 0; l < p->n_layers; l++)
        t += p->k_row_bytes[l] + p->v_row_bytes[l];
    return t;
}

long kv_frame_parse(const uint8_t *buf, size_t len, struct kv_frame *f, struct error *err) {
    if (len < KV_FRAME_HEADER) return 0;
    uint32_t magic, body;
    uint16_t type, id_len;
    memcpy(&magic, buf, 4);
    memcpy(&type, buf + 4, 2);
    memcpy(&id_len, buf + 6, 2);
    memcpy(&body, buf + 8, 4);
    if (magic != KV_FRAME_MAGIC)
        return error_set(err, ATOMC_ERR_FORMAT, "KV transfer: bad frame magic %08x (not an atomc KV peer?)", magic), -1;
    if (type < KV_FRAME_HELLO || type > KV_FRAME_HAVE)
        return error_set(err, ATOMC_ERR_FORMAT, "KV transfer: unknown frame type %u", type), -1;
    if (id_len >= KV_ID_MAX)
        return error_set(err, ATOMC_ERR_FORMAT, "KV transfer: frame id of %u bytes (at most %d)", id_len,
                         KV_ID_MAX - 1),
               -1;
    if ((uint64_t)body >= KV_FRAME_MAX_BODY)
        return error_set(err, ATOMC_ERR_FORMAT, "KV transfer: frame body of %u bytes", body), -1;
    size_t total = (size_t)KV_FRAME_HEADER + id_len + body;
    if (len < total) return 0;
    f->type = (enum kv_frame_type)type;
    memcpy(f->id, buf + KV_FRAME_HEADER, id_len);
    f->id[id_len] = 0;
    if (memchr(f->id, 0, id_len)) return error_set(err, ATOMC_ERR_FORMAT, "KV transfer: NUL in a frame id"), -1;
    f->body = buf + KV_FRAME_HEADER + id_len;
    f->body_len = body;
    return (long)total;
}

size_t kv_frame_header(uint8_t *out, enum kv_frame_type type, const char *id, size_t body_len) {
    uint32_t magic = KV_FRAME_MAGIC, body = (uint32_t)body_len;
    size_t n = id ? strlen(id) : 0;
    uint16_t t = (uint16_t)type, id_len = (uint16_t)n;
    memcpy(out, &magic, 4);
    memcpy(out + 4, &t, 2);
    memcpy(out + 6, &id_len, 2);
    memcpy(out + 8, &body, 4);
    if (n) memcpy(out + KV_FRAME_HEADER, id, n);
    return KV_FRAME_HEADER + n;
}
