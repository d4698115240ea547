// The output parsers end to end over HTTP, through the official Python SDKs: the real server
// (src/server) with the real parsers, driven by an "echo" fake engine whose output is the text of
// the request's last user message, cut into deltas of 1-3 bytes (so tags arrive split over
// many SSE chunks). The SDK side is tests/py/parser_http_client.py (openai / anthropic clients);
// each TEST starts a server with the parsers it names and runs one client mode against it.
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "server/server.h"
#include "test.h"

#define ECHO_MAX 16

struct echo_req {
    bool live, aborted;
    uint64_t id;
    char *text;
    size_t len, pos;
    int max_tokens, generated, prompt_tokens;
    void (*fn)(void *, const atomc_output *);
    void *user;
};

struct echo_engine {
    pthread_mutex_t mu;
    struct echo_req reqs[ECHO_MAX];
    uint64_t next_id;
    atomic_bool stop;
    pthread_t thread;
    atomic_int skip_special_false; // requests that asked to keep special tokens
};

static atomc_status echo_add(void *ctx, const atomc_request *r, uint64_t *id, char *err, size_t err_len) {
    struct echo_engine *f = ctx;
    pthread_mutex_lock(&f->mu);
    int slot = -1;
    for (int i = 0; i < ECHO_MAX && slot < 0; i++)
        if (!f->reqs[i].live) slot = i;
    if (slot < 0) {
        pthread_mutex_unlock(&f->mu);
        snprintf(err, err_len, "busy");
        return ATOMC_ERR_BUSY;
    }
    struct echo_req *q = &f->reqs[slot];
    memset(q, 0, sizeof *q);
    q->live = true;
    q->id = ++f->next_id;
    q->text = xmalloc((size_t)r->n_prompt_ids + 1);
    for (int i = 0; i < r->n_prompt_ids; i++)
        q->text[i] = (char)r->prompt_ids[i];
    q->len = (size_t)r->n_prompt_ids;
    q->prompt_tokens = r->n_prompt_ids;
    q->max_tokens = r->params.max_tokens;
    q->fn = r->on_output;
    q->user = r->user;
    if (!r->params.skip_special_tokens) atomic_fetch_add(&f->skip_special_false, 1);
    *id = q->id;
    pthread_mutex_unlock(&f->mu);
    return ATOMC_OK;
}

static atomc_status echo_abort(void *ctx, uint64_t id) {
    struct echo_engine *f = ctx;
    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < ECHO_MAX; i++)
        if (f->reqs[i].live && f->reqs[i].id == id) f->reqs[i].aborted = true;
    pthread_mutex_unlock(&f->mu);
    return ATOMC_OK;
}

static void echo_stats(void *ctx, atomc_stats *s) {
    memset(s, 0, sizeof *s);
}

static atomc_status echo_tokenize(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids, int *n,
                                  struct error *err) {
    *ids = xmalloc((len + 1) * sizeof **ids);
    for (size_t i = 0; i < len; i++)
        (*ids)[i] = (unsigned char)text[i];
    *n = (int)len;
    return ATOMC_OK;
}

static atomc_status echo_detokenize(void *ctx, const int32_t *ids, int n, bool skip, char **text, struct error *err) {
    *text = xmalloc((size_t)n + 1);
    for (int i = 0; i < n; i++)
        (*text)[i] = (char)ids[i];
    (*text)[n] = '\0';
    return ATOMC_OK;
}

static const char echo_bytes[256] = {
#define B4(i) (char)(i), (char)(i + 1), (char)(i + 2), (char)(i + 3)
#define B16(i) B4(i), B4(i + 4), B4(i + 8), B4(i + 12)
#define B64(i) B16(i), B16(i + 16), B16(i + 32), B16(i + 48)
    B64(0), B64(64), B64(128), B64(192)};

static const char *echo_token_bytes(void *ctx, int32_t id, size_t *len) {
    if (id < 0 || id > 255) return NULL;
    *len = 1;
    return &echo_bytes[id];
}

// The "prompt" is the last user message's text: the engine generates exactly that.
static atomc_status echo_render(void *ctx, json_t *messages, json_t *tools, bool add_gen, bool cont, json_t *kwargs,
                                char **out, struct error *err) {
    const char *last = "";
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        const char *c = json_string_value(json_object_get(m, "content"));
        if (role && !strcmp(role, "user") && c) last = c;
    }
    *out = xstrdup(last);
    return ATOMC_OK;
}

// Each step hands every live request its next 1-3 bytes (the cut varies with the step).
static void *echo_loop(void *arg) {
    struct echo_engine *f = arg;
    unsigned step = 0;
    while (!atomic_load(&f->stop)) {
        usleep(300);
        step++;
        for (int i = 0; i < ECHO_MAX; i++) {
            pthread_mutex_lock(&f->mu);
            struct echo_req *q = &f->reqs[i];
            if (!q->live) {
                pthread_mutex_unlock(&f->mu);
                continue;
            }
            atomc_output o;
            memset(&o, 0, sizeof o);
            o.request_id = q->id;
            o.prompt_tokens = q->prompt_tokens;
            o.stop_token = -1;
            int32_t toks[3];
            char text[4];
            size_t k = 1 + (step + (unsigned)i) % 3;
            if (k > q->len - q->pos) k = q->len - q->pos;
            if ((int)k > q->max_tokens - q->generated) k = (size_t)(q->max_tokens - q->generated);
            if (q->aborted) {
                o.finish_reason = ATOMC_FINISH_ABORT;
            } else {
                for (size_t j = 0; j < k; j++) {
                    text[j] = q->text[q->pos + j];
                    toks[j] = (unsigned char)text[j];
                }
                o.new_tokens = toks;
                o.n_new_tokens = (int)k;
                o.text = text;
                o.text_len = k;
                q->pos += k;
                q->generated += (int)k;
                if (q->pos >= q->len)
                    o.finish_reason = ATOMC_FINISH_STOP;
                else if (q->generated >= q->max_tokens)
                    o.finish_reason = ATOMC_FINISH_LENGTH;
            }
            o.completion_tokens = q->generated;
            void (*fn)(void *, const atomc_output *) = q->fn;
            void *user = q->user;
            if (o.finish_reason != ATOMC_FINISH_NONE) {
                q->live = false;
                free(q->text);
                q->text = NULL;
            }
            pthread_mutex_unlock(&f->mu);
            fn(user, &o);
        }
    }
    return NULL;
}

struct rig {
    struct echo_engine fe;
    struct server *srv;
    pthread_t loop;
    int port;
};

static void *server_thread(void *arg) {
    server_run(arg);
    return NULL;
}

static void rig_start(struct rig *h, enum reasoning_parser_kind rk, enum tool_parser_kind tk) {
    memset(h, 0, sizeof *h);
    pthread_mutex_init(&h->fe.mu, NULL);
    pthread_create(&h->fe.thread, NULL, echo_loop, &h->fe);
    struct server_options o;
    server_options_init(&o);
    o.port = 0;
    o.model_names[0] = "echo";
    o.n_model_names = 1;
    o.install_signal_handlers = false;
    o.drain_timeout_s = 5;
    o.tool_parser = tk;
    o.reasoning_parser = rk;
    struct error err;
    CHECK(server_create(&o, &h->srv, &err) == ATOMC_OK);
    h->port = server_port(h->srv);
    pthread_create(&h->loop, NULL, server_thread, h->srv);
    struct server_engine e = {.ctx = &h->fe,
                              .add_request = echo_add,
                              .abort_request = echo_abort,
                              .get_stats = echo_stats,
                              .tokenize = echo_tokenize,
                              .detokenize = echo_detokenize,
                              .token_bytes = echo_token_bytes,
                              .render_chat = echo_render,
                              .max_model_len = 4096,
                              .vocab_size = 256,
                              .model_path = "/models/echo"};
    server_attach_engine(h->srv, &e);
}

static void rig_stop(struct rig *h) {
    server_shutdown(h->srv);
    pthread_join(h->loop, NULL);
    atomic_store(&h->fe.stop, true);
    pthread_join(h->fe.thread, NULL);
    for (int i = 0; i < ECHO_MAX; i++)
        if (h->fe.reqs[i].live) {
            atomc_output o;
            memset(&o, 0, sizeof o);
            o.finish_reason = ATOMC_FINISH_ABORT;
            o.stop_token = -1;
            h->fe.reqs[i].live = false;
            free(h->fe.reqs[i].text);
            h->fe.reqs[i].fn(h->fe.reqs[i].user, &o);
        }
    server_free(h->srv);
    pthread_mutex_destroy(&h->fe.mu);
}

// Runs the client script in `mode` against the rig; SKIP when the SDK is not installed.
static int run_client(struct rig *h, const char *module, const char *mode) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "python3 -c 'import %s' 2>/dev/null", module);
    if (system(cmd) != 0) return -1;
    snprintf(cmd, sizeof cmd, "python3 tests/py/parser_http_client.py %d %s", h->port, mode);
    return system(cmd);
}

#define CLIENT_CASE(name, rk, tk, module, mode, special)                                                               \
    TEST(name) {                                                                                                       \
        struct rig h;                                                                                                  \
        rig_start(&h, rk, tk);                                                                                         \
        int rc = run_client(&h, module, mode);                                                                         \
        int kept = atomic_load(&h.fe.skip_special_false);                                                              \
        rig_stop(&h);                                                                                                  \
        if (rc < 0) SKIP("python module '%s' is not installed (tests/requirements.txt)", module);                      \
        ASSERT_EQ(rc, 0);                                                                                              \
        if (special)                                                                                                   \
            ASSERT_TRUE(kept > 0);                                                                                     \
        else                                                                                                           \
            ASSERT_EQ(kept, 0);                                                                                        \
    }

// GPT-OSS harmony through the openai client: reasoning_content, content and tool_calls,
// streaming and not; the engine is asked to keep special tokens.
CLIENT_CASE(http_harmony_openai_client, REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_OPENAI, "openai", "harmony", true)
// Qwen3 <think> reasoning then a hermes tool call through the openai client.
CLIENT_CASE(http_qwen3_hermes_openai_client, REASONING_PARSER_QWEN3, TOOL_PARSER_HERMES, "openai", "qwen3", false)

// The Anthropic Messages API over the same parsers: thinking, text and tool_use blocks.
CLIENT_CASE(http_qwen3_hermes_anthropic_client, REASONING_PARSER_QWEN3, TOOL_PARSER_HERMES, "anthropic", "anthropic",
            false)
CLIENT_CASE(http_harmony_anthropic_client, REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_OPENAI, "anthropic",
            "anthropic_harmony", true)

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
