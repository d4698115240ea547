// The HTTP server end to end over loopback sockets, driven by a scripted fake engine (a thread
// that emits one byte-token per step), so routing, auth, limits, SSE, n>1, client-disconnect
// aborts, the bounded queue and graceful shutdown are tested without a model. The real engine
// is covered by tests/py/test_server*.py.
#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "server/server.h"
#include "test.h"

// ---------------------------------------------------------------- fake engine

#define FAKE_MAX 256
struct fake_req {
    bool live, aborted;
    uint64_t id;
    int32_t prompt[64];
    int n_prompt, generated, max_tokens;
    atomc_output_fn fn;
    void *user;
};

struct fake_engine {
    pthread_mutex_t mu;
    struct fake_req reqs[FAKE_MAX];
    uint64_t next_id;
    int max_live;        // ATOMC_ERR_BUSY past this many
    atomic_int aborts;   // abort calls that hit a live request
    atomic_int finished; // final outputs delivered
    int step_us;
    atomic_bool fail_all; // every request finishes with ATOMC_FINISH_ERROR (a broken device)
    const char *script;   // if set: the text every request generates (one byte per step), then stop
    atomic_bool stop;
    pthread_t thread;
};

static atomc_status fake_add(void *ctx, const atomc_request *r, uint64_t *id, char *err, size_t err_len) {
    struct fake_engine *f = ctx;
    pthread_mutex_lock(&f->mu);
    int live = 0, slot = -1;
    for (int i = 0; i < FAKE_MAX; i++) {
        if (f->reqs[i].live)
            live++;
        else if (slot < 0)
            slot = i;
    }
    if (live >= f->max_live || slot < 0) {
        pthread_mutex_unlock(&f->mu);
        snprintf(err, err_len, "waiting queue is full");
        return ATOMC_ERR_BUSY;
    }
    struct fake_req *q = &f->reqs[slot];
    memset(q, 0, sizeof *q);
    q->live = true;
    q->id = ++f->next_id;
    q->n_prompt = r->n_prompt_ids < 64 ? r->n_prompt_ids : 64;
    memcpy(q->prompt, r->prompt_ids, (size_t)q->n_prompt * sizeof(int32_t));
    q->max_tokens = r->params.max_tokens;
    q->fn = r->on_output;
    q->user = r->user;
    *id = q->id;
    pthread_mutex_unlock(&f->mu);
    return ATOMC_OK;
}

static atomc_status fake_abort(void *ctx, uint64_t id) {
    struct fake_engine *f = ctx;
    pthread_mutex_lock(&f->mu);
    atomc_status st = ATOMC_ERR_NOT_FOUND;
    for (int i = 0; i < FAKE_MAX; i++)
        if (f->reqs[i].live && f->reqs[i].id == id) {
            f->reqs[i].aborted = true;
            st = ATOMC_OK;
            atomic_fetch_add(&f->aborts, 1);
        }
    pthread_mutex_unlock(&f->mu);
    return st;
}

static void fake_stats(void *ctx, atomc_stats *s) {
    struct fake_engine *f = ctx;
    memset(s, 0, sizeof *s);
    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < FAKE_MAX; i++)
        s->num_running += f->reqs[i].live;
    pthread_mutex_unlock(&f->mu);
    s->num_kv_blocks = 100;
    s->num_free_kv_blocks = 100 - s->num_running;
    s->kv_cache_usage = s->num_running / 100.0;
}

// Byte-level "tokenizer": token id = byte value.
static atomc_status fake_tokenize(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids, int *n,
                                  struct error *err) {
    *ids = malloc((len + 1) * sizeof **ids);
    for (size_t i = 0; i < len; i++)
        (*ids)[i] = (unsigned char)text[i];
    *n = (int)len;
    return ATOMC_OK;
}

static atomc_status fake_detokenize(void *ctx, const int32_t *ids, int n, bool skip, char **text, struct error *err) {
    *text = malloc((size_t)n + 1);
    for (int i = 0; i < n; i++)
        (*text)[i] = (char)ids[i];
    (*text)[n] = '\0';
    return ATOMC_OK;
}

static const char fake_bytes[256] = {
#define B4(i) (char)(i), (char)(i + 1), (char)(i + 2), (char)(i + 3)
#define B16(i) B4(i), B4(i + 4), B4(i + 8), B4(i + 12)
#define B64(i) B16(i), B16(i + 16), B16(i + 32), B16(i + 48)
    B64(0), B64(64), B64(128), B64(192)};

static const char *fake_token_bytes(void *ctx, int32_t id, size_t *len) {
    if (id < 0 || id > 255) return NULL;
    *len = 1;
    return &fake_bytes[id];
}

static atomc_status fake_render(void *ctx, json_t *messages, json_t *tools, bool add_gen, bool cont, json_t *kwargs,
                                char **out, struct error *err) {
    size_t i;
    json_t *m;
    char buf[4096] = "";
    json_array_foreach(messages, i, m) {
        strncat(buf, json_string_value(json_object_get(m, "role")), sizeof buf - strlen(buf) - 1);
        strncat(buf, ":", sizeof buf - strlen(buf) - 1);
        const char *c = json_string_value(json_object_get(m, "content"));
        strncat(buf, c ? c : "", sizeof buf - strlen(buf) - 1);
        strncat(buf, "\n", sizeof buf - strlen(buf) - 1);
    }
    if (add_gen) strncat(buf, "assistant:", sizeof buf - strlen(buf) - 1);
    *out = strdup(buf);
    return ATOMC_OK;
}

// One step: every live request gets the next letter ('a' + k % 26); finishes at max_tokens.
static void *fake_loop(void *arg) {
    struct fake_engine *f = arg;
    while (!atomic_load(&f->stop)) {
        usleep((useconds_t)f->step_us);
        for (int i = 0; i < FAKE_MAX; i++) {
            pthread_mutex_lock(&f->mu);
            struct fake_req q = f->reqs[i];
            if (!q.live) {
                pthread_mutex_unlock(&f->mu);
                continue;
            }
            atomc_output o;
            memset(&o, 0, sizeof o);
            o.request_id = q.id;
            o.prompt_tokens = q.n_prompt;
            o.stop_token = -1;
            int32_t tok = f->script ? (unsigned char)f->script[q.generated] : 'a' + q.generated % 26;
            char text[2] = {(char)tok, 0};
            if (q.aborted) {
                o.finish_reason = ATOMC_FINISH_ABORT;
            } else if (atomic_load(&f->fail_all)) {
                o.finish_reason = ATOMC_FINISH_ERROR;
                o.error = "device lost";
            } else {
                o.new_tokens = &tok;
                o.n_new_tokens = 1;
                o.text = text;
                o.text_len = 1;
                f->reqs[i].generated++;
                if (f->script && !f->script[f->reqs[i].generated])
                    o.finish_reason = ATOMC_FINISH_STOP;
                else if (f->reqs[i].generated >= q.max_tokens)
                    o.finish_reason = ATOMC_FINISH_LENGTH;
            }
            o.completion_tokens = f->reqs[i].generated;
            if (o.finish_reason != ATOMC_FINISH_NONE) f->reqs[i].live = false;
            pthread_mutex_unlock(&f->mu);
            q.fn(q.user, &o); // outside the lock, like a real engine step
            if (o.finish_reason != ATOMC_FINISH_NONE) atomic_fetch_add(&f->finished, 1);
        }
    }
    return NULL;
}

// ---------------------------------------------------------------- harness

struct harness {
    struct fake_engine fe;
    struct server *srv;
    pthread_t loop;
    int port;
};

static void *server_thread(void *arg) {
    server_run(arg);
    return NULL;
}

static double harness_idle_timeout = 300;
static enum tool_parser_kind harness_tool_parser = TOOL_PARSER_NONE;
static int harness_max_model_len = 64;

static void harness_start(struct harness *h, const char *api_key, int step_us, int max_live) {
    memset(h, 0, sizeof *h);
    pthread_mutex_init(&h->fe.mu, NULL);
    h->fe.step_us = step_us;
    h->fe.max_live = max_live;
    pthread_create(&h->fe.thread, NULL, fake_loop, &h->fe);
    struct server_options o;
    server_options_init(&o);
    o.port = 0;
    o.api_key = api_key;
    o.model_names[0] = "fake";
    o.n_model_names = 1;
    o.max_body_bytes = 1 << 16;
    o.install_signal_handlers = false;
    o.drain_timeout_s = 5;
    o.idle_timeout_s = harness_idle_timeout;
    o.tool_parser = harness_tool_parser;
    struct error err;
    CHECK(server_create(&o, &h->srv, &err) == ATOMC_OK);
    h->port = server_port(h->srv);
    pthread_create(&h->loop, NULL, server_thread, h->srv);
}

static void harness_attach(struct harness *h) {
    struct server_engine e = {.ctx = &h->fe,
                              .add_request = fake_add,
                              .abort_request = fake_abort,
                              .get_stats = fake_stats,
                              .tokenize = fake_tokenize,
                              .detokenize = fake_detokenize,
                              .token_bytes = fake_token_bytes,
                              .render_chat = fake_render,
                              .max_model_len = harness_max_model_len,
                              .vocab_size = 256,
                              .model_path = "/models/fake"};
    server_attach_engine(h->srv, &e);
}

static void harness_stop(struct harness *h) {
    server_shutdown(h->srv);
    pthread_join(h->loop, NULL);
    atomic_store(&h->fe.stop, true);
    pthread_join(h->fe.thread, NULL);
    // Deliver final outputs of anything still live, as atomc_engine_free does.
    for (int i = 0; i < FAKE_MAX; i++)
        if (h->fe.reqs[i].live) {
            atomc_output o;
            memset(&o, 0, sizeof o);
            o.finish_reason = ATOMC_FINISH_ABORT;
            o.stop_token = -1;
            h->fe.reqs[i].live = false;
            h->fe.reqs[i].fn(h->fe.reqs[i].user, &o);
        }
    server_free(h->srv);
}

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

static void send_request(int fd, const char *method, const char *path, const char *headers, const char *body) {
    char head[1024];
    snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%sContent-Length: %zu\r\n\r\n",
             method, path, headers ? headers : "", body ? strlen(body) : 0);
    send_all(fd, head, strlen(head));
    if (body) send_all(fd, body, strlen(body));
}

struct response {
    int status;
    char *head;
    char *body; // de-chunked
};

// Reads until EOF (Connection: close) and decodes chunked transfer encoding.
static struct response http(int port, const char *method, const char *path, const char *headers, const char *body) {
    int fd = connect_to(port);
    send_request(fd, method, path, headers, body);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t r = recv(fd, buf + len, cap - len - 1, 0);
        if (r <= 0) break;
        len += (size_t)r;
    }
    buf[len] = '\0';
    close(fd);
    struct response res = {0};
    sscanf(buf, "HTTP/1.%*d %d", &res.status);
    char *sep = strstr(buf, "\r\n\r\n");
    if (!sep) {
        res.head = buf;
        res.body = strdup("");
        return res;
    }
    *sep = '\0';
    res.head = buf;
    char *p = sep + 4;
    if (strcasestr(buf, "Transfer-Encoding: chunked")) {
        char *out = malloc(strlen(p) + 1);
        size_t o = 0;
        for (;;) {
            unsigned long n = strtoul(p, &p, 16);
            p = strstr(p, "\r\n");
            if (!p || n == 0) break;
            p += 2;
            memcpy(out + o, p, n);
            o += n;
            p += n + 2;
        }
        out[o] = '\0';
        res.body = out;
    } else {
        res.body = strdup(p);
    }
    return res;
}

static void response_free(struct response *r) {
    free(r->head);
    free(r->body);
}

static json_t *json_of(const struct response *r) {
    return json_loads(r->body, 0, NULL);
}

static const char *error_message(json_t *j) {
    return json_string_value(json_object_get(json_object_get(j, "error"), "message"));
}

static double metric_value(int port, const char *needle) {
    struct response r = http(port, "GET", "/metrics", NULL, NULL);
    double v = -1;
    char *p = strstr(r.body, needle);
    if (p) v = strtod(p + strlen(needle), NULL);
    response_free(&r);
    return v;
}

static void wait_until(bool (*cond)(void *), void *arg) {
    for (int i = 0; i < 500 && !cond(arg); i++)
        usleep(10000);
}

// ---------------------------------------------------------------- tests

TEST(health_is_503_while_loading_then_200) {
    struct harness h;
    harness_start(&h, NULL, 1000, 64);
    struct response r = http(h.port, "GET", "/health", NULL, NULL);
    ASSERT_EQ(r.status, 503);
    response_free(&r);
    r = http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\"}");
    ASSERT_EQ(r.status, 503);
    response_free(&r);
    harness_attach(&h);
    r = http(h.port, "GET", "/health", NULL, NULL);
    ASSERT_EQ(r.status, 200);
    response_free(&r);
    harness_stop(&h);
}

TEST(completion_non_stream_counts_tokens) {
    struct harness h;
    harness_start(&h, NULL, 200, 64);
    harness_attach(&h);
    struct response r = http(h.port, "POST", "/v1/completions", NULL,
                             "{\"model\":\"fake\",\"prompt\":\"hello\",\"max_tokens\":5,\"n\":2}");
    ASSERT_EQ(r.status, 200);
    json_t *j = json_of(&r);
    ASSERT_TRUE(j);
    json_t *choices = json_object_get(j, "choices");
    ASSERT_EQ(json_array_size(choices), 2);
    for (int i = 0; i < 2; i++) {
        json_t *c = json_array_get(choices, (size_t)i);
        ASSERT_EQ(json_integer_value(json_object_get(c, "index")), i);
        ASSERT_STREQ(json_string_value(json_object_get(c, "text")), "abcde");
        ASSERT_STREQ(json_string_value(json_object_get(c, "finish_reason")), "length");
    }
    json_t *u = json_object_get(j, "usage");
    ASSERT_EQ(json_integer_value(json_object_get(u, "prompt_tokens")), 5);
    ASSERT_EQ(json_integer_value(json_object_get(u, "completion_tokens")), 10);
    ASSERT_EQ(json_integer_value(json_object_get(u, "total_tokens")), 15);
    ASSERT_TRUE(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
    ASSERT_STREQ(json_string_value(json_object_get(j, "object")), "text_completion");
    json_decref(j);
    response_free(&r);
    harness_stop(&h);
}

TEST(chat_stream_sends_role_content_usage_done) {
    struct harness h;
    harness_start(&h, NULL, 200, 64);
    harness_attach(&h);
    struct response r = http(h.port, "POST", "/v1/chat/completions", NULL,
                             "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}],"
                             "\"max_tokens\":3,\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strcasestr(r.head, "text/event-stream") != NULL);
    // Parse every "data: " event.
    char text[64] = "";
    int n_events = 0;
    bool saw_role = false, saw_usage = false, saw_done = false, saw_finish = false;
    for (char *p = r.body; (p = strstr(p, "data: "));) {
        p += 6;
        char *end = strstr(p, "\n\n");
        ASSERT_TRUE(end != NULL);
        *end = '\0';
        n_events++;
        if (!strcmp(p, "[DONE]")) {
            saw_done = true;
        } else {
            json_t *j = json_loads(p, 0, NULL);
            ASSERT_TRUE(j);
            ASSERT_STREQ(json_string_value(json_object_get(j, "object")), "chat.completion.chunk");
            json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
            if (ch) {
                json_t *d = json_object_get(ch, "delta");
                if (json_object_get(d, "role")) saw_role = true;
                const char *c = json_string_value(json_object_get(d, "content"));
                if (c) strncat(text, c, sizeof text - strlen(text) - 1);
                if (json_is_string(json_object_get(ch, "finish_reason"))) saw_finish = true;
            } else {
                json_t *u = json_object_get(j, "usage");
                ASSERT_EQ(json_integer_value(json_object_get(u, "completion_tokens")), 3);
                // fake template: "user:hi\nassistant:" = 18 byte-tokens
                ASSERT_EQ(json_integer_value(json_object_get(u, "prompt_tokens")), 18);
                saw_usage = true;
            }
            json_decref(j);
        }
        p = end + 1;
    }
    ASSERT_TRUE(saw_role && saw_usage && saw_done && saw_finish);
    ASSERT_STREQ(text, "abc");
    response_free(&r);
    harness_stop(&h);
}

TEST(errors_have_openai_shape_and_status) {
    struct harness h;
    harness_start(&h, "sekret", 200, 64);
    harness_attach(&h);
    const char *auth = "Authorization: Bearer sekret\r\n";
    struct {
        const char *method, *path, *headers, *body;
        int status;
        const char *msg_part;
    } cases[] = {
        {"GET", "/nope", NULL, NULL, 404, "Not Found"},
        {"GET", "/v1/completions", auth, NULL, 405, "POST"},
        {"POST", "/v1/completions", NULL, "{\"prompt\":\"x\"}", 401, "API key"},
        {"POST", "/v1/completions", "Authorization: Bearer wrong\r\n", "{\"prompt\":\"x\"}", 401, "API key"},
        {"POST", "/v1/completions", auth, "{\"prompt\":", 400, "invalid JSON"},
        {"POST", "/v1/completions", auth, "{\"prompt\":\"x\",\"bogus\":1}", 400, "bogus"},
        {"POST", "/v1/completions", auth, "{\"prompt\":\"x\",\"model\":\"other\"}", 404, "does not exist"},
        {"POST", "/v1/completions", auth, "{\"prompt\":\"x\",\"temperature\":-1}", 400, "temperature"},
        {"POST", "/v1/completions", auth, "{\"prompt\":\"x\",\"max_tokens\":100}", 400, "maximum context length is 64"},
        {"POST", "/v1/completions", auth, "{\"prompt\":[300]}", 400, "out of range"},
        {"POST", "/v1/completions", auth, "{\"prompt\":\"\xff\xfe\"}", 400, "invalid JSON"},
        {"POST", "/v1/chat/completions", auth, "{\"messages\":[]}", 400, "messages"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct response r = http(h.port, cases[i].method, cases[i].path, cases[i].headers, cases[i].body);
        if (r.status != cases[i].status) fprintf(stderr, "case %zu: %s\n", i, r.body);
        ASSERT_EQ(r.status, cases[i].status);
        json_t *j = json_of(&r);
        ASSERT_TRUE(j);
        const char *m = error_message(j);
        if (!m || !strstr(m, cases[i].msg_part)) fprintf(stderr, "case %zu: %s\n", i, r.body);
        ASSERT_TRUE(m && strstr(m, cases[i].msg_part));
        ASSERT_TRUE(json_is_string(json_object_get(json_object_get(j, "error"), "type")));
        json_decref(j);
        response_free(&r);
    }
    // Too large a body: 413 from the HTTP layer.
    char *big = malloc(1 << 17);
    memset(big, ' ', 1 << 17);
    big[(1 << 17) - 1] = '\0';
    struct response r = http(h.port, "POST", "/v1/completions", auth, big);
    ASSERT_EQ(r.status, 413);
    response_free(&r);
    free(big);
    // Unauthenticated endpoints stay open; the server still serves afterwards.
    r = http(h.port, "GET", "/metrics", NULL, NULL);
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "vllm:num_requests_running{model_name=\"fake\"}") != NULL);
    response_free(&r);
    r = http(h.port, "GET", "/v1/models", auth, NULL);
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "\"id\":\"fake\"") != NULL);
    response_free(&r);
    harness_stop(&h);
}

static bool aborted_one(void *arg) {
    return atomic_load(&((struct harness *)arg)->fe.aborts) >= 1;
}

TEST(client_disconnect_mid_stream_aborts_request) {
    struct harness h;
    harness_start(&h, NULL, 2000, 64);
    harness_attach(&h);
    int fd = connect_to(h.port);
    send_request(fd, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":50,\"stream\":true}");
    char buf[256];
    ssize_t got = recv(fd, buf, sizeof buf, 0); // the response has started
    ASSERT_TRUE(got > 0);
    close(fd);
    wait_until(aborted_one, &h);
    ASSERT_EQ(atomic_load(&h.fe.aborts), 1);
    for (int i = 0;
         i < 100 &&
         metric_value(h.port, "vllm:request_success_total{finished_reason=\"abort\",model_name=\"fake\"} ") < 1;
         i++)
        usleep(10000);
    ASSERT_NEAR(metric_value(h.port, "vllm:request_success_total{finished_reason=\"abort\",model_name=\"fake\"} "), 1,
                0);
    ASSERT_NEAR(metric_value(h.port, "vllm:num_requests_running{model_name=\"fake\"} "), 0, 0);
    harness_stop(&h);
}

TEST(client_disconnect_while_waiting_non_stream_aborts) {
    struct harness h;
    harness_start(&h, NULL, 2000, 64);
    harness_attach(&h);
    int fd = connect_to(h.port);
    send_request(fd, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":60}");
    usleep(20000);
    close(fd);
    wait_until(aborted_one, &h);
    ASSERT_EQ(atomic_load(&h.fe.aborts), 1);
    harness_stop(&h);
}

TEST(full_queue_gives_503_and_server_keeps_serving) {
    struct harness h;
    harness_start(&h, NULL, 2000, 1);
    harness_attach(&h);
    int fd = connect_to(h.port);
    send_request(fd, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":30,\"stream\":true}");
    char buf[64];
    ASSERT_TRUE(recv(fd, buf, sizeof buf, 0) > 0);
    struct response r = http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":2}");
    ASSERT_EQ(r.status, 503);
    response_free(&r);
    close(fd);
    harness_stop(&h);
}

struct drain_arg {
    int port;
    struct response r;
};
static void *drain_client(void *arg) {
    struct drain_arg *a = arg;
    a->r = http(a->port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":20}");
    return NULL;
}

TEST(shutdown_drains_in_flight_requests) {
    struct harness h;
    harness_start(&h, NULL, 5000, 64);
    harness_attach(&h);
    struct drain_arg a = {.port = h.port};
    pthread_t t;
    pthread_create(&t, NULL, drain_client, &a);
    usleep(30000);
    server_shutdown(h.srv); // like SIGTERM: stop accepting, finish the in-flight request
    pthread_join(h.loop, NULL);
    pthread_join(t, NULL);
    ASSERT_EQ(a.r.status, 200);
    json_t *j = json_of(&a.r);
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text")),
                 "abcdefghijklmnopqrst");
    json_decref(j);
    response_free(&a.r);
    // The listener is closed.
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)h.port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    ASSERT_TRUE(connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0);
    close(fd);
    atomic_store(&h.fe.stop, true);
    pthread_join(h.fe.thread, NULL);
    server_free(h.srv);
}

TEST(engine_errors_give_500_and_unhealthy_until_a_success) {
    struct harness h;
    harness_start(&h, NULL, 200, 64);
    harness_attach(&h);
    atomic_store(&h.fe.fail_all, true);
    for (int i = 0; i < 8; i++) {
        struct response r = http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":3}");
        ASSERT_EQ(r.status, 500);
        json_t *j = json_of(&r);
        ASSERT_TRUE(strstr(error_message(j), "device lost") != NULL);
        json_decref(j);
        response_free(&r);
    }
    // Streaming: the error arrives as an SSE error event, then [DONE].
    struct response r =
        http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":3,\"stream\":true}");
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "\"error\"") && strstr(r.body, "device lost") && strstr(r.body, "data: [DONE]"));
    response_free(&r);
    r = http(h.port, "GET", "/health", NULL, NULL);
    ASSERT_EQ(r.status, 503);
    ASSERT_TRUE(strstr(r.body, "failing") != NULL);
    response_free(&r);
    atomic_store(&h.fe.fail_all, false);
    r = http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":2}");
    ASSERT_EQ(r.status, 200);
    response_free(&r);
    r = http(h.port, "GET", "/health", NULL, NULL);
    ASSERT_EQ(r.status, 200);
    response_free(&r);
    harness_stop(&h);
}

// A request waiting longer than the idle timeout for its tokens is not cut off (streaming with
// no output yet, and non-streaming), while an idle keep-alive connection still is.
TEST(slow_generation_outlives_idle_timeout) {
    struct harness h;
    harness_idle_timeout = 0.3;
    harness_start(&h, NULL, 400000, 64); // one token per 400 ms: gaps longer than the timeout
    harness_idle_timeout = 300;
    harness_attach(&h);
    struct response r =
        http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":3,\"stream\":true}");
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "data: [DONE]") != NULL);
    response_free(&r);
    r = http(h.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":3}");
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "abc") != NULL);
    response_free(&r);
    int fd = connect_to(h.port); // idle: closed by the server after ~0.3 s
    char c;
    ASSERT_EQ(recv(fd, &c, 1, 0), 0);
    close(fd);
    harness_stop(&h);
}

// ---------------------------------------------------------------- tool calls (hermes parser)

static const char TOOL_SCRIPT[] = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                                  "{\"city\": \"Paris\"}}\n</tool_call>";
static const char TOOL_REQ[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"}],\"max_tokens\":200,"
                               "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                               "\"parameters\":{\"type\":\"object\"}}}]%s}";

static void tool_harness_start_script(struct harness *h, enum tool_parser_kind parser, const char *script) {
    harness_tool_parser = parser;
    harness_max_model_len = 512;
    harness_start(h, NULL, 100, 64);
    h->fe.script = script;
    harness_attach(h);
    harness_tool_parser = TOOL_PARSER_NONE;
    harness_max_model_len = 64;
}

static void tool_harness_start(struct harness *h, enum tool_parser_kind parser) {
    tool_harness_start_script(h, parser, TOOL_SCRIPT);
}

static json_t *tool_chat(struct harness *h, const char *extra) {
    char body[1024];
    snprintf(body, sizeof body, TOOL_REQ, extra);
    struct response r = http(h->port, "POST", "/v1/chat/completions", NULL, body);
    CHECK(r.status == 200);
    json_t *j = json_of(&r);
    response_free(&r);
    return json_array_get(json_object_get(j, "choices"), 0) ? j : NULL;
}

TEST(chat_tool_calls_parsed_non_stream) {
    struct harness h;
    tool_harness_start(&h, TOOL_PARSER_HERMES);
    json_t *j = tool_chat(&h, "");
    ASSERT_TRUE(j != NULL);
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0), *msg = json_object_get(ch, "message");
    ASSERT_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls");
    ASSERT_STREQ(json_string_value(json_object_get(msg, "content")), "Sure.");
    json_t *calls = json_object_get(msg, "tool_calls");
    ASSERT_EQ(json_array_size(calls), 1);
    json_t *call = json_array_get(calls, 0), *fn = json_object_get(call, "function");
    ASSERT_STREQ(json_string_value(json_object_get(call, "type")), "function");
    ASSERT_TRUE(!strncmp(json_string_value(json_object_get(call, "id")), "chatcmpl-tool-", 14));
    ASSERT_STREQ(json_string_value(json_object_get(fn, "name")), "get_weather");
    ASSERT_STREQ(json_string_value(json_object_get(fn, "arguments")), "{\"city\":\"Paris\"}");
    json_decref(j);
    // tool_choice "none": the text comes back as it was generated.
    j = tool_chat(&h, ",\"tool_choice\":\"none\"");
    ch = json_array_get(json_object_get(j, "choices"), 0);
    msg = json_object_get(ch, "message");
    ASSERT_STREQ(json_string_value(json_object_get(msg, "content")), TOOL_SCRIPT);
    ASSERT_EQ(json_array_size(json_object_get(msg, "tool_calls")), 0);
    ASSERT_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "stop");
    json_decref(j);
    harness_stop(&h);
    // Without --enable-auto-tool-choice the server never parses.
    tool_harness_start(&h, TOOL_PARSER_NONE);
    j = tool_chat(&h, "");
    msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    ASSERT_STREQ(json_string_value(json_object_get(msg, "content")), TOOL_SCRIPT);
    json_decref(j);
    harness_stop(&h);
}

TEST(chat_tool_calls_parsed_stream) {
    struct harness h;
    tool_harness_start(&h, TOOL_PARSER_HERMES);
    char body[1024];
    snprintf(body, sizeof body, TOOL_REQ, ",\"stream\":true");
    struct response r = http(h.port, "POST", "/v1/chat/completions", NULL, body);
    ASSERT_EQ(r.status, 200);
    char content[256] = "";
    int n_calls = 0;
    const char *finish = NULL;
    json_t *first_call = NULL;
    for (char *p = r.body; (p = strstr(p, "data: "));) {
        p += 6;
        char *end = strstr(p, "\n\n");
        ASSERT_TRUE(end != NULL);
        *end = '\0';
        if (strcmp(p, "[DONE]")) {
            json_t *j = json_loads(p, 0, NULL);
            ASSERT_TRUE(j);
            json_t *ch = json_array_get(json_object_get(j, "choices"), 0), *d = json_object_get(ch, "delta");
            const char *c = json_string_value(json_object_get(d, "content"));
            if (c) strncat(content, c, sizeof content - strlen(content) - 1);
            json_t *calls = json_object_get(d, "tool_calls");
            for (size_t i = 0; i < json_array_size(calls); i++, n_calls++)
                if (!first_call) first_call = json_incref(json_array_get(calls, i));
            if (json_is_string(json_object_get(ch, "finish_reason")))
                finish = strdup(json_string_value(json_object_get(ch, "finish_reason")));
            json_decref(j);
        }
        p = end + 1;
    }
    // The tags never reach the client as content; the call arrives whole, with its index.
    ASSERT_STREQ(content, "Sure.\n");
    ASSERT_EQ(n_calls, 1);
    ASSERT_EQ(json_integer_value(json_object_get(first_call, "index")), 0);
    ASSERT_TRUE(!strncmp(json_string_value(json_object_get(first_call, "id")), "chatcmpl-tool-", 14));
    json_t *fn = json_object_get(first_call, "function");
    ASSERT_STREQ(json_string_value(json_object_get(fn, "name")), "get_weather");
    ASSERT_STREQ(json_string_value(json_object_get(fn, "arguments")), "{\"city\":\"Paris\"}");
    ASSERT_STREQ(finish, "tool_calls");
    free((void *)finish);
    json_decref(first_call);
    response_free(&r);
    harness_stop(&h);
}

TEST(chat_tool_calls_llama3_json) {
    struct harness h;
    tool_harness_start_script(&h, TOOL_PARSER_LLAMA3_JSON,
                              "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}");
    json_t *j = tool_chat(&h, "");
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0), *msg = json_object_get(ch, "message");
    ASSERT_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls");
    ASSERT_TRUE(json_is_null(json_object_get(msg, "content")));
    json_t *fn = json_object_get(json_array_get(json_object_get(msg, "tool_calls"), 0), "function");
    ASSERT_STREQ(json_string_value(json_object_get(fn, "name")), "get_weather");
    ASSERT_STREQ(json_string_value(json_object_get(fn, "arguments")), "{\"city\":\"Paris\"}");
    json_decref(j);
    harness_stop(&h);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}

// Sends raw bytes on a fresh connection and reads until the server closes (bounded by the
// socket timeout set in connect_to): everything the server wrote, NUL-terminated.
static char *raw_exchange(int port, const char *bytes, size_t n) {
    int fd = connect_to(port);
    send_all(fd, bytes, n);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t r = recv(fd, buf + len, cap - len - 1, 0);
        if (r <= 0) break;
        len += (size_t)r;
    }
    buf[len] = '\0';
    close(fd);
    return buf;
}

// Status lines in a byte stream: "HTTP/1.x " at the start or after a newline.
static int count_responses(const char *out) {
    int n = 0;
    for (const char *p = out; (p = strstr(p, "HTTP/1.")); p++)
        if (p == out || p[-1] == '\n') n++;
    return n;
}

// One raw request must get exactly one response with `status`, an OpenAI-style JSON error body
// whose message contains `part`, and the connection closed (nothing smuggled behind it answered).
static bool rejected_with(int port, const char *raw, int status, const char *part) {
    char *out = raw_exchange(port, raw, strlen(raw));
    int st = 0;
    sscanf(out, "HTTP/1.%*d %d", &st);
    char *body = strstr(out, "\r\n\r\n");
    json_t *j = body ? json_loads(body + 4, 0, NULL) : NULL;
    const char *msg = j ? error_message(j) : NULL;
    bool ok = st == status && msg && (!part || strstr(msg, part)) && count_responses(out) == 1 &&
              strcasestr(out, "Content-Type: application/json");
    if (!ok) fprintf(stderr, "  request %.60s... -> %s\n", raw, out);
    json_decref(j);
    free(out);
    return ok;
}

TEST(strict_http_framing_is_enforced) {
    struct harness h;
    harness_start(&h, NULL, 1000, 64);
    harness_attach(&h);
    const char *smuggle = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    char raw[1024];
    // Two different lengths: evhttp would read by the first and take the rest as a next request.
    snprintf(raw, sizeof raw,
             "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\nContent-Length: %zu\r\n\r\n{\"prompt\":\"a\"}%s",
             15 + strlen(smuggle), smuggle);
    ASSERT_TRUE(rejected_with(h.port, raw, 400, "Content-Length"));
    // Duplicates, even equal, are refused (RFC 9112 6.3 allows refusing; a proxy may differ).
    ASSERT_TRUE(rejected_with(h.port,
                              "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 14\r\nContent-Length: 14\r\n\r\n"
                              "{\"prompt\":\"a\"}",
                              400, "Content-Length"));
    // Content-Length with Transfer-Encoding, in either order: a JSON 400, nothing behind it served.
    const char *codings[] = {"chunked", "identity"};
    for (int i = 0; i < 2; i++) {
        snprintf(raw, sizeof raw,
                 "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: %s\r\n\r\n"
                 "e\r\n{\"prompt\":\"a\"}\r\n0\r\n\r\n%s",
                 codings[i], smuggle);
        ASSERT_TRUE(rejected_with(h.port, raw, 400, "Transfer-Encoding"));
        snprintf(raw, sizeof raw,
                 "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: %s\r\nContent-Length: 4\r\n\r\n"
                 "e\r\n{\"prompt\":\"a\"}\r\n0\r\n\r\n%s",
                 codings[i], smuggle);
        ASSERT_TRUE(rejected_with(h.port, raw, 400, "Transfer-Encoding"));
    }
    // A transfer coding other than chunked.
    ASSERT_TRUE(rejected_with(h.port,
                              "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                              "e\r\n{\"prompt\":\"a\"}\r\n0\r\n\r\n",
                              501, "Transfer-Encoding"));
    // Whitespace between a field name and its colon; control characters in a value.
    ASSERT_TRUE(rejected_with(h.port, "GET /health HTTP/1.1\r\nHost: x\r\nContent-Length : 0\r\n\r\n", 400, "header"));
    ASSERT_TRUE(rejected_with(h.port, "GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x01" "b\r\n\r\n", 400, "header"));
    // HTTP/1.1 without Host.
    ASSERT_TRUE(rejected_with(h.port, "GET /health HTTP/1.1\r\n\r\n", 400, "Host"));
    // A body with any method is read as a body, never taken for a next request.
    const char *trace = "TRACE /detokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 28\r\n\r\n"
                        "PUT /x HTTP/1.1\r\nHost: x\r\n\r\n"; // 28 bytes
    char *tr = raw_exchange(h.port, trace, strlen(trace));
    if (!(strncmp(tr, "HTTP/1.1 405", 12) == 0 && count_responses(tr) == 1)) fprintf(stderr, "  TRACE -> %s\n", tr);
    ASSERT_TRUE(strncmp(tr, "HTTP/1.1 405", 12) == 0 && count_responses(tr) == 1);
    free(tr);
    // Still fine: one length, chunked alone, HTTP/1.0 without Host.
    char *ok = raw_exchange(h.port, "GET /health HTTP/1.0\r\n\r\n", strlen("GET /health HTTP/1.0\r\n\r\n"));
    ASSERT_TRUE(strncmp(ok, "HTTP/1.1 200", 12) == 0 || strncmp(ok, "HTTP/1.0 200", 12) == 0);
    free(ok);
    const char *chunked = "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                          "e\r\n{\"prompt\":\"a\"}\r\n0\r\n\r\n";
    ok = raw_exchange(h.port, chunked, strlen(chunked));
    ASSERT_TRUE(strncmp(ok, "HTTP/1.1 200", 12) == 0);
    free(ok);
    harness_stop(&h);
}

// Issue 28 item 5: what evhttp 2.1 let through or answered in HTML. Each case is one raw request
// that must get exactly one OpenAI-style JSON error with the connection closed after it.
TEST(http_layer_errors_are_strict_and_json) {
    struct harness h;
    harness_start(&h, NULL, 1000, 64);
    harness_attach(&h);
    static const char nul[] = "GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\0b\r\n\r\n";
    char *out = raw_exchange(h.port, nul, sizeof nul - 1);
    bool nul_refused = strncmp(out, "HTTP/1.1 400", 12) == 0 && strstr(out, "\"error\"") && count_responses(out) == 1;
    if (!nul_refused) fprintf(stderr, "  NUL -> %s\n", out);
    free(out);
    ASSERT_TRUE(nul_refused);
    struct {
        const char *raw;
        int status;
        const char *part;
    } cases[] = {
        // obs-fold: a header line continued on the next line after whitespace
        {"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", 400, "obs-fold"},
        {"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n\tb\r\n\r\n", 400, "obs-fold"},
        // bare LF: in the request line, between headers, as the empty line
        {"GET /health HTTP/1.1\nHost: x\r\n\r\n", 400, NULL},
        {"GET /health HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n", 400, NULL},
        {"GET /health HTTP/1.1\r\nHost: x\r\n\n", 400, "bare LF"},
        // CR inside a value
        {"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", 400, NULL},
        // two Host headers
        {"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "Host"},
        // a body over --max-request-body-bytes (64 KiB here): refused from its Content-Length
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n{", 413, "limit"},
        // an expectation other than 100-continue
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n{}", 417, "expectation"},
        // an unknown method, an unsupported version
        {"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method"},
        {"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP/2.0"},
        {"GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 505, NULL},
        // a POST without any length
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length"},
        // malformed lengths and chunks
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length"},
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 1\r\n\r\n", 400, "Content-Length"},
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "chunk"},
        {"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 501, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (!rejected_with(h.port, cases[i].raw, cases[i].status, cases[i].part)) fprintf(stderr, "  case %zu\n", i);
        ASSERT_TRUE(rejected_with(h.port, cases[i].raw, cases[i].status, cases[i].part));
    }
    // A header section over --max-header-bytes: 431 in JSON.
    size_t big = (64u << 10) + 100;
    char *raw = malloc(big + 128);
    int k = snprintf(raw, 128, "GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ");
    memset(raw + k, 'a', big);
    strcpy(raw + k + big, "\r\n\r\n");
    ASSERT_TRUE(rejected_with(h.port, raw, 431, "header"));
    // A chunked body growing past the limit: 413 once it does.
    k = snprintf(raw, 128, "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%zx\r\n", big);
    memset(raw + k, 'a', big);
    strcpy(raw + k + big, "\r\n0\r\n\r\n");
    ASSERT_TRUE(rejected_with(h.port, raw, 413, "limit"));
    free(raw);
    // Expect: 100-continue gets the interim response, then the final one; pipelined requests are
    // answered in order on one connection, keep-alive.
    const char *cont = "POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 14\r\n\r\n"
                       "{\"prompt\":\"a\"}"
                       "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                       "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    out = raw_exchange(h.port, cont, strlen(cont));
    const char *a = strstr(out, "HTTP/1.1 100 Continue\r\n\r\n"), *b = strstr(out, "HTTP/1.1 200");
    const char *c = b ? strstr(b + 1, "HTTP/1.1 200") : NULL, *d = c ? strstr(c + 1, "HTTP/1.1 404") : NULL;
    int n_status = 0; // bodies do not end in a newline: count every status line
    for (const char *p = out; (p = strstr(p, "HTTP/1.1 ")); p++) n_status++;
    bool ordered = a == out && b && c && d && n_status == 4 && strstr(b, "\"tokens\"") &&
                   strstr(c, "\"status\"");
    if (!ordered) fprintf(stderr, "  100-continue + pipelining -> %s\n", out);
    free(out);
    ASSERT_TRUE(ordered);
    harness_stop(&h);
}
