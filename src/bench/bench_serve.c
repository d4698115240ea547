// The serving benchmark client. One libevent loop drives every request: a pool of
// keep-alive HTTP connections (one per in-flight request), arrivals released by a timer
// (gamma-distributed gaps for a request rate, or all at once), a concurrency cap per level.
// Each streamed chunk is parsed as it arrives and timestamped: TTFT is the time to the
// first chunk carrying text, ITL the gaps between later chunks, TPOT (e2e - TTFT) /
// (output tokens - 1), output tokens from the final usage chunk (stream_options.include_usage)
// or the number of content chunks when the server sends no usage.
#include "bench/bench_serve.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_stats.h"
#include "common/check.h"
#include "common/timeutil.h"

void bench_serve_options_init(struct bench_serve_options *o) {
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->endpoint = "/v1/completions";
    o->data.name = "random";
    o->data.num_prompts = 1000;
    o->data.input_len = 1024;
    o->data.output_len = 128;
    o->data.vocab_size = 0; // 0 = the served model's (GET /tokenizer_info), see bench_serve_run
    o->data.first_id = 100;
    o->data.num_prefixes = 10;
    o->data.suffix_len = 64;
    o->burstiness = 1.0;
    o->levels[0] = 0;
    o->n_levels = 1;
    o->ignore_eos = true;
    o->temperature = 0.0;
    o->pcts[0] = 50, o->pcts[1] = 90, o->pcts[2] = 95, o->pcts[3] = 99;
    o->n_pcts = 4;
    o->label = "openai";
    o->num_gpus = 1;
    o->progress = isatty(2);
    o->timeout_s = 3600;
}

void bench_serve_usage(void) {
    printf(
        "usage: atomc bench serve [options]\n"
        "Benchmarks an OpenAI-compatible server with streaming requests (vLLM's flag names).\n\n"
        "  --base-url URL               server address, e.g. http://127.0.0.1:8000 (overrides --host/--port)\n"
        "  --host H / --port P          default 127.0.0.1:8000\n"
        "  --endpoint PATH              default /v1/completions (/v1/chat/completions with --backend openai-chat)\n"
        "  --backend openai|openai-chat request shape; stored as the result's backend (default openai)\n"
        "  --label NAME                 engine name stored in the result (default: the backend)\n"
        "  --model NAME                 model name sent in each request (required)\n"
        "  --api-key KEY                bearer token (default: env OPENAI_API_KEY)\n"
        "  --dataset-name NAME          random (default), sharegpt, prefix_repetition\n"
        "  --dataset-path FILE          ShareGPT JSON file\n"
        "  --num-prompts N              requests per level (default 1000)\n"
        "  --random-input-len N         default 1024\n"
        "  --random-output-len N        default 128\n"
        "  --random-range-ratio R       lengths uniform in [len*(1-R), len*(1+R)] (default 0)\n"
        "  --random-prefix-len N        shared prefix tokens before every random prompt (default 0)\n"
        "  --random-vocab-size N        token ids drawn from [100, N) (default: the served model's vocabulary,\n"
        "                               from GET /tokenizer_info or llama-server's /v1/models n_vocab)\n"
        "  --tokenizer PATH             send prompts as text: random ids from this tokenizer's vocabulary,\n"
        "                               decoded (needed for --backend openai-chat with random prompts)\n"
        "  --prefix-repetition-prefix-len N / --prefix-repetition-suffix-len N\n"
        "  --prefix-repetition-num-prefixes N / --prefix-repetition-output-len N\n"
        "  --sharegpt-output-len N      fixed output length for sharegpt prompts\n"
        "  --request-rate R             requests/s (default inf: all at once)\n"
        "  --burstiness B               gamma shape of arrival gaps; 1 = Poisson (default 1)\n"
        "  --max-concurrency N[,N...]   concurrency cap; a list sweeps the levels in one run\n"
        "  --num-warmups N              warm-up requests before each level (default 0)\n"
        "  --ignore-eos / --no-ignore-eos   ask for exact output lengths (default on)\n"
        "  --temperature T              default 0\n"
        "  --metric-percentiles P,...   default 50,90,95,99\n"
        "  --goodput KEY:MS ...         SLOs for goodput: ttft:MS tpot:MS e2el:MS\n"
        "  --save-result                write JSON results (to --result-dir, default .)\n"
        "  --result-dir DIR / --result-filename NAME\n"
        "  --num-gpus N                 GPUs behind the server (for per-GPU charts; default 1)\n"
        "  --seed S                     workload seed (default 0)\n"
        "  --request-timeout S          per request (default 3600)\n"
        "  --disable-tqdm               no progress bar\n");
}

static int parse_int_list(const char *s, int *out, int max) {
    int n = 0;
    const char *p = s;
    while (*p && n < max) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > 1000000) return -1;
        out[n++] = (int)v;
        p = end;
        if (*p == ',') p++;
        else if (*p) return -1;
    }
    return n;
}

// The whole of s as a decimal int (a sign allowed); false on empty input, trailing text or overflow.
static bool int_arg(const char *s, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < INT_MIN || v > INT_MAX) return false;
    *out = (int)v;
    return true;
}

atomc_status bench_serve_parse_args(struct bench_serve_options *o, int argc, char **argv, bool *help,
                                    struct error *err) {
    enum {
        O_BASE_URL = 1000, O_HOST, O_PORT, O_ENDPOINT, O_BACKEND, O_MODEL, O_API_KEY, O_DATASET, O_DATASET_PATH,
        O_NUM_PROMPTS, O_IN, O_OUT, O_RANGE, O_PREFIX, O_VOCAB, O_PR_PREFIX, O_PR_SUFFIX, O_PR_NUM, O_PR_OUT,
        O_SG_OUT, O_RATE, O_BURST, O_CONC, O_WARMUP, O_IGNORE_EOS, O_NO_IGNORE_EOS, O_TEMP, O_PCTS, O_GOODPUT,
        O_SAVE, O_RESULT_DIR, O_RESULT_FILE, O_GPUS, O_SEED, O_TIMEOUT, O_NO_TQDM, O_LABEL, O_TOKENIZER, O_HELP,
    };
    static const struct option opts[] = {
        {"base-url", required_argument, 0, O_BASE_URL}, {"host", required_argument, 0, O_HOST},
        {"port", required_argument, 0, O_PORT}, {"endpoint", required_argument, 0, O_ENDPOINT},
        {"backend", required_argument, 0, O_BACKEND}, {"model", required_argument, 0, O_MODEL},
        {"api-key", required_argument, 0, O_API_KEY}, {"dataset-name", required_argument, 0, O_DATASET},
        {"dataset-path", required_argument, 0, O_DATASET_PATH}, {"num-prompts", required_argument, 0, O_NUM_PROMPTS},
        {"random-input-len", required_argument, 0, O_IN}, {"random-output-len", required_argument, 0, O_OUT},
        {"random-range-ratio", required_argument, 0, O_RANGE}, {"random-prefix-len", required_argument, 0, O_PREFIX},
        {"random-vocab-size", required_argument, 0, O_VOCAB}, {"tokenizer", required_argument, 0, O_TOKENIZER},
        {"prefix-repetition-prefix-len", required_argument, 0, O_PR_PREFIX},
        {"prefix-repetition-suffix-len", required_argument, 0, O_PR_SUFFIX},
        {"prefix-repetition-num-prefixes", required_argument, 0, O_PR_NUM},
        {"prefix-repetition-output-len", required_argument, 0, O_PR_OUT},
        {"sharegpt-output-len", required_argument, 0, O_SG_OUT}, {"request-rate", required_argument, 0, O_RATE},
        {"burstiness", required_argument, 0, O_BURST}, {"max-concurrency", required_argument, 0, O_CONC},
        {"num-warmups", required_argument, 0, O_WARMUP}, {"ignore-eos", no_argument, 0, O_IGNORE_EOS},
        {"no-ignore-eos", no_argument, 0, O_NO_IGNORE_EOS}, {"temperature", required_argument, 0, O_TEMP},
        {"metric-percentiles", required_argument, 0, O_PCTS}, {"goodput", required_argument, 0, O_GOODPUT},
        {"save-result", no_argument, 0, O_SAVE}, {"result-dir", required_argument, 0, O_RESULT_DIR},
        {"result-filename", required_argument, 0, O_RESULT_FILE}, {"num-gpus", required_argument, 0, O_GPUS},
        {"seed", required_argument, 0, O_SEED}, {"request-timeout", required_argument, 0, O_TIMEOUT},
        {"disable-tqdm", no_argument, 0, O_NO_TQDM}, {"label", required_argument, 0, O_LABEL},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0},
    };
    bool save = false;
    *help = false;
    o->api_key = getenv("OPENAI_API_KEY");
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        const char *a = optarg;
        char *end = NULL; // set by the strtod cases: trailing text is an error
        bool ok = true;   // cleared by int_arg
        switch (c) {
        case O_BASE_URL: {
            const char *p = strstr(a, "://");
            p = p ? p + 3 : a;
            const char *colon = strchr(p, ':'), *slash = strchr(p, '/');
            size_t hl = colon ? (size_t)(colon - p) : slash ? (size_t)(slash - p) : strlen(p);
            if (hl == 0 || hl >= sizeof o->host_buf)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad --base-url '%s'", a);
            memcpy(o->host_buf, p, hl);
            o->host_buf[hl] = '\0';
            o->host = o->host_buf;
            o->port = 80;
            if (colon) {
                o->port = (int)strtol(colon + 1, &end, 10);
                if (end == colon + 1 || (*end && *end != '/'))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad port in --base-url '%s'", a);
                end = NULL;
            }
            break;
        }
        case O_HOST: o->host = a; break;
        case O_PORT: ok = int_arg(a, &o->port); break;
        case O_ENDPOINT: o->endpoint = a; break;
        case O_BACKEND:
            if (!strcmp(a, "openai-chat")) {
                o->chat = true;
                if (!strcmp(o->endpoint, "/v1/completions")) o->endpoint = "/v1/chat/completions";
            } else if (strcmp(a, "openai") && strcmp(a, "vllm")) {
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown --backend '%s' (openai, openai-chat)", a);
            }
            o->label = a;
            break;
        case O_LABEL: o->label = a; break;
        case O_MODEL: o->model = a; break;
        case O_API_KEY: o->api_key = a; break;
        case O_DATASET: o->data.name = a; break;
        case O_DATASET_PATH: o->data.path = a; break;
        case O_NUM_PROMPTS: ok = int_arg(a, &o->data.num_prompts); break;
        case O_IN: ok = int_arg(a, &o->data.input_len); break;
        case O_OUT: ok = int_arg(a, &o->data.output_len); break;
        case O_RANGE: o->data.range_ratio = strtod(a, &end); break;
        case O_PREFIX: ok = int_arg(a, &o->data.prefix_len); break;
        case O_VOCAB: ok = int_arg(a, &o->data.vocab_size); break;
        case O_TOKENIZER: o->data.tokenizer = a; break;
        case O_PR_PREFIX: ok = int_arg(a, &o->data.prefix_len); break;
        case O_PR_SUFFIX: ok = int_arg(a, &o->data.suffix_len); break;
        case O_PR_NUM: ok = int_arg(a, &o->data.num_prefixes); break;
        case O_PR_OUT: ok = int_arg(a, &o->data.output_len); break;
        case O_SG_OUT: ok = int_arg(a, &o->data.sharegpt_output_len); break;
        case O_RATE: o->request_rate = !strcmp(a, "inf") ? 0 : strtod(a, &end); break;
        case O_BURST: o->burstiness = strtod(a, &end); break;
        case O_CONC:
            o->n_levels = parse_int_list(a, o->levels, BENCH_MAX_LEVELS);
            if (o->n_levels <= 0) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad --max-concurrency '%s'", a);
            break;
        case O_WARMUP: ok = int_arg(a, &o->num_warmups); break;
        case O_IGNORE_EOS: o->ignore_eos = true; break;
        case O_NO_IGNORE_EOS: o->ignore_eos = false; break;
        case O_TEMP: o->temperature = strtod(a, &end); break;
        case O_PCTS: {
            o->n_pcts = 0;
            const char *p = a;
            while (*p && o->n_pcts < BENCH_MAX_PCTS) {
                double v = strtod(p, &end);
                if (end == p || v < 0 || v > 100) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad --metric-percentiles '%s'", a);
                o->pcts[o->n_pcts++] = v;
                p = *end == ',' ? end + 1 : end;
            }
            end = NULL;
            break;
        }
        case O_GOODPUT: {
            // Accept "ttft:100" and also several space-separated items after the flag.
            const char *item = a;
            for (;;) {
                double ms;
                char key[16];
                if (sscanf(item, "%15[a-z]:%lf", key, &ms) != 2 || ms <= 0)
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad --goodput '%s' (KEY:MS)", item);
                if (!strcmp(key, "ttft")) o->goodput_ttft_ms = ms;
                else if (!strcmp(key, "tpot")) o->goodput_tpot_ms = ms;
                else if (!strcmp(key, "e2el")) o->goodput_e2el_ms = ms;
                else return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad --goodput key '%s' (ttft, tpot, e2el)", key);
                if (optind < argc && strchr(argv[optind], ':') && argv[optind][0] != '-') item = argv[optind++];
                else break;
            }
            break;
        }
        case O_SAVE: save = true; break;
        case O_RESULT_DIR: o->result_dir = a; break;
        case O_RESULT_FILE: o->result_filename = a; break;
        case O_GPUS: ok = int_arg(a, &o->num_gpus); break;
        case O_SEED: o->data.seed = strtoull(a, &end, 10); break;
        case O_TIMEOUT: o->timeout_s = strtod(a, &end); break;
        case O_NO_TQDM: o->progress = false; break;
        case O_HELP: *help = true; return ATOMC_OK;
        default:
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown or incomplete option '%s'",
                             argv[optind - 1 < argc ? optind - 1 : argc - 1]);
        }
        if (!ok || (end && (end == a || *end))) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad number '%s'", a);
    }
    if (optind < argc) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unexpected argument '%s'", argv[optind]);
    if (!o->model) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--model is required");
    if (o->port <= 0 || o->port > 65535) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "bad port %d", o->port);
    if (o->burstiness <= 0) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--burstiness must be > 0");
    if (o->num_gpus < 1) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "--num-gpus must be >= 1");
    if (save && !o->result_dir) o->result_dir = ".";
    if (!save && (o->result_dir || o->result_filename) && !o->result_dir) o->result_dir = ".";
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------
// One level's run.

struct req_state {
    struct level_run *run;
    int idx;
    bool warmup;
    struct evhttp_connection *conn;
    double t_start, t_first, t_last;
    struct sample_vec itl;  // ms
    int content_chunks;
    int usage_completion, usage_prompt;
    char *line;             // partial SSE line
    size_t line_len, line_cap;
    bool done_marker, failed, finished;
    bool reused;            // sent on a kept-alive connection from the pool
    bool retried;           // already re-sent once on a fresh connection
    bool conn_lost;         // failed with EOF / connection failure before any byte of the response
    char error[200];
};

struct level_run {
    const struct bench_serve_options *o;
    const struct bench_dataset *d;
    struct event_base *base;
    struct event *arrival_timer;
    int max_conc;            // 0 = unlimited
    int n;                   // requests in this run
    bool warmup;
    struct req_state *reqs;
    double *arrivals;        // seconds after start
    int released, launched, inflight, completed, max_inflight;
    double t0;
    struct evhttp_connection **pool; // idle keep-alive connections
    int n_pool, cap_pool;
    struct evhttp_connection **all_conns;
    int n_all, cap_all;
    double last_progress;
};

// An idle kept-alive connection from the pool (*reused = true) or a new one. Connections are freed
// together at the end of the level (all_conns), never inside their own callbacks.
static struct evhttp_connection *conn_get(struct level_run *r, bool fresh, bool *reused) {
    *reused = !fresh && r->n_pool > 0;
    if (*reused) return r->pool[--r->n_pool];
    struct evhttp_connection *c = evhttp_connection_base_new(r->base, NULL, r->o->host, (unsigned short)r->o->port);
    CHECK_MSG(c != NULL, "cannot create HTTP connection");
    evhttp_connection_set_timeout(c, (int)r->o->timeout_s);
    evhttp_connection_set_retries(c, 0);
    if (r->n_all == r->cap_all) {
        r->cap_all = r->cap_all ? r->cap_all * 2 : 64;
        r->all_conns = xrealloc(r->all_conns, sizeof(*r->all_conns) * (size_t)r->cap_all);
        r->pool = xrealloc(r->pool, sizeof(*r->pool) * (size_t)r->cap_all);
    }
    r->all_conns[r->n_all++] = c;
    return c;
}

static void progress_draw(struct level_run *r, bool final) {
    if (!r->o->progress || r->warmup) return;
    double now = time_now_s();
    if (!final && now - r->last_progress < 0.1) return;
    r->last_progress = now;
    int width = 40, filled = r->n ? (int)((long)width * r->completed / r->n) : width;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < filled ? '#' : '.';
    bar[width] = '\0';
    double el = now - r->t0;
    fprintf(stderr, "\r[%s] %d/%d  %.1fs  in flight %d ", bar, r->completed, r->n, el, r->inflight);
    if (final) fputc('\n', stderr);
}

static void launch_pending(struct level_run *r);
static void launch_one(struct level_run *r, int i, bool fresh);

static void handle_sse_payload(struct req_state *s, const char *p, size_t n) {
    if (n == 6 && !memcmp(p, "[DONE]", 6)) {
        s->done_marker = true;
        return;
    }
    json_error_t je;
    json_t *j = json_loadb(p, n, 0, &je);
    if (!j) {
        snprintf(s->error, sizeof s->error, "unparsable stream chunk: %s", je.text);
        s->failed = true;
        return;
    }
    json_t *errj = json_object_get(j, "error");
    if (errj) {
        const char *m = json_string_value(json_object_get(errj, "message"));
        snprintf(s->error, sizeof s->error, "server error in stream: %s", m ? m : "?");
        s->failed = true;
    }
    json_t *choices = json_object_get(j, "choices");
    json_t *ch0 = json_array_get(choices, 0);
    const char *text = NULL;
    if (ch0) {
        text = json_string_value(json_object_get(ch0, "text"));
        if (!text) {
            json_t *delta = json_object_get(ch0, "delta");
            text = json_string_value(json_object_get(delta, "content"));
            if (!text || !*text) text = json_string_value(json_object_get(delta, "reasoning_content"));
        }
    }
    if (text && *text) {
        double now = time_now_s();
        if (s->content_chunks == 0) s->t_first = now;
        else sample_vec_push(&s->itl, (now - s->t_last) * 1000.0);
        s->t_last = now;
        s->content_chunks++;
    }
    json_t *usage = json_object_get(j, "usage");
    if (json_is_object(usage)) {
        json_t *ct = json_object_get(usage, "completion_tokens"), *pt = json_object_get(usage, "prompt_tokens");
        if (json_is_integer(ct)) s->usage_completion = (int)json_integer_value(ct);
        if (json_is_integer(pt)) s->usage_prompt = (int)json_integer_value(pt);
    }
    json_decref(j);
}

static void on_chunk(struct evhttp_request *req, void *arg) {
    struct req_state *s = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (s->line_len + len + 1 > s->line_cap) {
        s->line_cap = (s->line_len + len + 1) * 2;
        s->line = xrealloc(s->line, s->line_cap);
    }
    evbuffer_remove(in, s->line + s->line_len, len);
    s->line_len += len;
    // Process complete lines; keep the tail.
    size_t start = 0;
    for (size_t i = 0; i < s->line_len; i++) {
        if (s->line[i] != '\n') continue;
        size_t l = i - start;
        const char *ln = s->line + start;
        if (l && ln[l - 1] == '\r') l--;
        if (l >= 5 && !memcmp(ln, "data:", 5)) {
            const char *p = ln + 5;
            size_t pl = l - 5;
            while (pl && *p == ' ') p++, pl--;
            handle_sse_payload(s, p, pl);
        }
        start = i + 1;
    }
    memmove(s->line, s->line + start, s->line_len - start);
    s->line_len -= start;
}

static void request_finished(struct req_state *s) {
    struct level_run *r = s->run;
    s->finished = true;
    if (!s->failed && s->content_chunks == 0 && s->usage_completion <= 0) {
        s->failed = true;
        if (!s->error[0]) snprintf(s->error, sizeof s->error, "no tokens received");
    }
    r->inflight--;
    r->completed++;
    progress_draw(r, false);
    if (r->completed == r->n) event_base_loopbreak(r->base);
    else launch_pending(r);
}

static void retry_cb(evutil_socket_t fd, short ev, void *arg) {
    struct req_state *s = arg;
    launch_one(s->run, s->idx, true);
}

static void on_done(struct evhttp_request *req, void *arg) {
    struct req_state *s = arg;
    double now = time_now_s();
    if (!req) {
        s->failed = true;
        if (!s->error[0]) snprintf(s->error, sizeof s->error, "connection failed");
        if (s->content_chunks == 0 && s->line_len == 0) s->conn_lost = true;
    } else {
        int code = evhttp_request_get_response_code(req);
        if (code != 200) {
            s->failed = true;
            char body[160] = {0};
            struct evbuffer *in = evhttp_request_get_input_buffer(req);
            evbuffer_copyout(in, body, sizeof body - 1);
            for (char *c = body; *c; c++) if (*c == '\n' || *c == '\r') *c = ' ';
            snprintf(s->error, sizeof s->error, "HTTP %d %s", code, body);
        } else if (evbuffer_get_length(evhttp_request_get_input_buffer(req))) {
            on_chunk(req, s); // trailing data not delivered through the chunk callback
        }
    }
    if (s->line_len && !s->failed) { // a last line without newline
        s->line[s->line_len] = '\0';
        const char *p = s->line;
        if (!strncmp(p, "data:", 5)) handle_sse_payload(s, p + 5 + (p[5] == ' '), s->line_len - 5 - (p[5] == ' '));
        s->line_len = 0;
    }
    if (!s->t_last) s->t_last = now;
    s->t_last = now > s->t_last ? now : s->t_last;
    struct level_run *r = s->run;
    // A server may close a kept-alive connection after a response (llama-server does after each
    // stream, without saying so): a request sent on such a reused connection fails with EOF before
    // any response byte. HTTP clients then re-send it once on a new connection; so does this one.
    if (s->failed && s->conn_lost && s->reused && !s->retried && s->content_chunks == 0) {
        s->retried = true;
        s->failed = s->conn_lost = false;
        s->error[0] = '\0';
        s->conn = NULL; // the dead connection stays in all_conns until the level ends
        r->inflight--;
        struct timeval now_tv = {0, 0};
        event_base_once(r->base, -1, EV_TIMEOUT, retry_cb, s, &now_tv);
        return;
    }
    // Pool the connection unless the server announced it closes it.
    const char *conn_hdr = req ? evhttp_find_header(evhttp_request_get_input_headers(req), "Connection") : NULL;
    bool closing = !req || (conn_hdr && !strcasecmp(conn_hdr, "close"));
    if (s->conn && !closing) r->pool[r->n_pool++] = s->conn;
    s->conn = NULL;
    request_finished(s);
}

static void on_error(enum evhttp_request_error e, void *arg) {
    struct req_state *s = arg;
    s->failed = true;
    static const char *names[] = {"timeout", "EOF", "invalid header", "buffer error", "request canceled", "data too long"};
    snprintf(s->error, sizeof s->error, "request error: %s", (unsigned)e < 6 ? names[e] : "unknown");
    if (e == EVREQ_HTTP_EOF && s->content_chunks == 0 && s->line_len == 0) s->conn_lost = true;
}

static char *build_body(const struct bench_serve_options *o, const struct bench_request *q) {
    json_t *j = json_object();
    json_object_set_new(j, "model", json_string(o->model));
    json_t *prompt;
    if (q->ids) {
        prompt = json_array();
        for (int i = 0; i < q->n_ids; i++) json_array_append_new(prompt, json_integer(q->ids[i]));
    } else {
        prompt = json_string(q->text);
    }
    if (o->chat) {
        if (!q->text) {
            json_decref(prompt);
            json_decref(j);
            return NULL;
        }
        json_t *msgs = json_array(), *m = json_object();
        json_object_set_new(m, "role", json_string("user"));
        json_object_set_new(m, "content", prompt);
        json_array_append_new(msgs, m);
        json_object_set_new(j, "messages", msgs);
        json_object_set_new(j, "max_completion_tokens", json_integer(q->output_len));
    } else {
        json_object_set_new(j, "prompt", prompt);
        json_object_set_new(j, "max_tokens", json_integer(q->output_len));
    }
    json_object_set_new(j, "temperature", json_real(o->temperature));
    json_object_set_new(j, "stream", json_true());
    json_t *so = json_object();
    json_object_set_new(so, "include_usage", json_true());
    json_object_set_new(j, "stream_options", so);
    if (o->ignore_eos) json_object_set_new(j, "ignore_eos", json_true());
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

// Sends request i; fresh = on a new connection (the retry of a request whose reused connection was
// closed by the server; it keeps its original start time).
static void launch_one(struct level_run *r, int i, bool fresh) {
    struct req_state *s = &r->reqs[i];
    const struct bench_request *q = &r->d->reqs[i % r->d->n];
    s->run = r;
    s->idx = i;
    s->conn = conn_get(r, fresh, &s->reused);
    struct evhttp_request *req = evhttp_request_new(on_done, s);
    evhttp_request_set_chunked_cb(req, on_chunk);
    evhttp_request_set_error_cb(req, on_error);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    char hostport[300];
    snprintf(hostport, sizeof hostport, "%s:%d", r->o->host, r->o->port);
    evhttp_add_header(h, "Host", hostport);
    evhttp_add_header(h, "Content-Type", "application/json");
    evhttp_add_header(h, "Accept", "text/event-stream");
    if (r->o->api_key && *r->o->api_key) {
        char auth[512];
        snprintf(auth, sizeof auth, "Bearer %s", r->o->api_key);
        evhttp_add_header(h, "Authorization", auth);
    }
    char *body = build_body(r->o, q);
    CHECK_MSG(body != NULL, "chat requests need text prompts (use --dataset-name sharegpt)");
    evbuffer_add(evhttp_request_get_output_buffer(req), body, strlen(body));
    free(body);
    if (!fresh) s->t_start = time_now_s();
    r->inflight++;
    if (r->inflight > r->max_inflight) r->max_inflight = r->inflight;
    if (evhttp_make_request(s->conn, req, EVHTTP_REQ_POST, r->o->endpoint) != 0) {
        // evhttp frees req on failure.
        s->failed = true;
        snprintf(s->error, sizeof s->error, "cannot send request");
        r->pool[r->n_pool++] = s->conn;
        s->conn = NULL;
        request_finished(s);
    }
}

static void launch_pending(struct level_run *r) {
    while (r->launched < r->released && (r->max_conc <= 0 || r->inflight < r->max_conc)) launch_one(r, r->launched++, false);
}

static void on_arrival(evutil_socket_t fd, short ev, void *arg) {
    struct level_run *r = arg;
    double el = time_now_s() - r->t0;
    while (r->released < r->n && r->arrivals[r->released] <= el) r->released++;
    launch_pending(r);
    if (r->released < r->n) {
        double wait = r->arrivals[r->released] - (time_now_s() - r->t0);
        if (wait < 0) wait = 0;
        struct timeval tv = {(time_t)wait, (suseconds_t)((wait - floor(wait)) * 1e6)};
        evtimer_add(r->arrival_timer, &tv);
    }
}

// Runs n requests (dataset entries offset..offset+n, wrapping) at the given concurrency.
static void level_run_exec(struct level_run *r) {
    const struct bench_serve_options *o = r->o;
    r->reqs = xcalloc((size_t)r->n, sizeof *r->reqs);
    r->arrivals = xcalloc((size_t)r->n, sizeof *r->arrivals);
    uint64_t rng = o->data.seed * 7919 + 17;
    double t = 0;
    for (int i = 0; i < r->n; i++) {
        if (o->request_rate > 0 && !r->warmup && i > 0) t += bench_rng_gamma(&rng, o->burstiness, 1.0 / (o->request_rate * o->burstiness));
        r->arrivals[i] = t;
    }
    r->arrival_timer = evtimer_new(r->base, on_arrival, r);
    r->t0 = time_now_s();
    on_arrival(-1, 0, r);
    if (r->completed < r->n) event_base_dispatch(r->base);
    progress_draw(r, true);
    event_free(r->arrival_timer);
}

static void level_run_free(struct level_run *r) {
    for (int i = 0; i < r->n; i++) {
        sample_vec_free(&r->reqs[i].itl);
        free(r->reqs[i].line);
    }
    for (int i = 0; i < r->n_all; i++) evhttp_connection_free(r->all_conns[i]);
    free(r->all_conns);
    free(r->pool);
    free(r->reqs);
    free(r->arrivals);
}

// ---------------------------------------------------------------------------------------
// Metrics and output.

struct metric {
    const char *key; // ttft, tpot, itl, e2el
    const char *title;
    struct sample_vec v;
};

static void json_add_metric(json_t *j, const struct bench_serve_options *o, struct metric *m) {
    char k[64];
    snprintf(k, sizeof k, "mean_%s_ms", m->key);
    json_object_set_new(j, k, json_real(stats_mean(m->v.v, m->v.n)));
    snprintf(k, sizeof k, "median_%s_ms", m->key);
    json_object_set_new(j, k, json_real(stats_percentile(m->v.v, m->v.n, 50)));
    snprintf(k, sizeof k, "std_%s_ms", m->key);
    json_object_set_new(j, k, json_real(stats_std(m->v.v, m->v.n)));
    for (int p = 0; p < o->n_pcts; p++) {
        snprintf(k, sizeof k, "p%g_%s_ms", o->pcts[p], m->key);
        json_object_set_new(j, k, json_real(stats_percentile(m->v.v, m->v.n, o->pcts[p])));
    }
}

static void print_metric(const struct bench_serve_options *o, struct metric *m) {
    char title[80];
    snprintf(title, sizeof title, "%s", m->title);
    int pad = (50 - (int)strlen(title)) / 2;
    printf("%.*s%s%.*s\n", pad, "--------------------------------------------------", title,
           50 - pad - (int)strlen(title), "--------------------------------------------------");
    char up[8];
    snprintf(up, sizeof up, "%s", m->key);
    for (char *c = up; *c; c++) *c = (char)(*c - 32 * (*c >= 'a' && *c <= 'z'));
    char label[64];
    snprintf(label, sizeof label, "Mean %s (ms):", up);
    printf("%-40s%-10.2f\n", label, stats_mean(m->v.v, m->v.n));
    snprintf(label, sizeof label, "Median %s (ms):", up);
    printf("%-40s%-10.2f\n", label, stats_percentile(m->v.v, m->v.n, 50));
    for (int p = 0; p < o->n_pcts; p++) {
        snprintf(label, sizeof label, "P%g %s (ms):", o->pcts[p], up);
        printf("%-40s%-10.2f\n", label, stats_percentile(m->v.v, m->v.n, o->pcts[p]));
    }
}

struct level_summary {
    int max_conc;
    double output_throughput, request_throughput, median_tpot, median_e2el, median_ttft;
    int completed, failed;
};

static json_t *summarize(const struct bench_serve_options *o, struct level_run *r, double duration,
                         double cpu_s, struct level_summary *sum) {
    struct metric m[4] = {{"ttft", "Time to First Token", {0}},
                          {"tpot", "Time per Output Token (excl. 1st token)", {0}},
                          {"itl", "Inter-token Latency", {0}},
                          {"e2el", "End-to-end Latency", {0}}};
    long total_in = 0, total_out = 0;
    int completed = 0, failed = 0, good = 0;
    json_t *input_lens = json_array(), *output_lens = json_array(), *ttfts = json_array(), *errors = json_array();
    for (int i = 0; i < r->n; i++) {
        struct req_state *s = &r->reqs[i];
        const struct bench_request *q = &r->d->reqs[i % r->d->n];
        if (s->failed) {
            failed++;
            json_array_append_new(errors, json_string(s->error));
            continue;
        }
        completed++;
        int out = s->usage_completion > 0 ? s->usage_completion : s->content_chunks;
        int in = s->usage_prompt > 0 ? s->usage_prompt : q->prompt_len;
        total_in += in;
        total_out += out;
        double ttft = (s->t_first - s->t_start) * 1000.0, e2el = (s->t_last - s->t_start) * 1000.0;
        double tpot = out > 1 ? (e2el - ttft) / (out - 1) : 0;
        sample_vec_push(&m[0].v, ttft);
        if (out > 1) sample_vec_push(&m[1].v, tpot);
        for (size_t k = 0; k < s->itl.n; k++) sample_vec_push(&m[2].v, s->itl.v[k]);
        sample_vec_push(&m[3].v, e2el);
        bool ok = (!o->goodput_ttft_ms || ttft <= o->goodput_ttft_ms) && (!o->goodput_tpot_ms || tpot <= o->goodput_tpot_ms) &&
                  (!o->goodput_e2el_ms || e2el <= o->goodput_e2el_ms);
        good += ok;
        json_array_append_new(input_lens, json_integer(in));
        json_array_append_new(output_lens, json_integer(out));
        json_array_append_new(ttfts, json_real(ttft / 1000.0));
    }
    bool any_slo = o->goodput_ttft_ms || o->goodput_tpot_ms || o->goodput_e2el_ms;
    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s%-10s\n", "Engine:", o->label);
    if (r->max_conc > 0) printf("%-40s%-10d\n", "Maximum request concurrency:", r->max_conc);
    else printf("%-40s%-10s\n", "Maximum request concurrency:", "unlimited");
    printf("%-40s%-10d\n", "Successful requests:", completed);
    printf("%-40s%-10d\n", "Failed requests:", failed);
    printf("%-40s%-10.2f\n", "Benchmark duration (s):", duration);
    printf("%-40s%-10ld\n", "Total input tokens:", total_in);
    printf("%-40s%-10ld\n", "Total generated tokens:", total_out);
    printf("%-40s%-10.2f\n", "Request throughput (req/s):", completed / duration);
    if (any_slo) printf("%-40s%-10.2f\n", "Request goodput (req/s):", good / duration);
    printf("%-40s%-10.2f\n", "Output token throughput (tok/s):", total_out / duration);
    printf("%-40s%-10.2f\n", "Total Token throughput (tok/s):", (total_in + total_out) / duration);
    printf("%-40s%-10d\n", "Peak concurrent requests:", r->max_inflight);
    printf("%-40s%-10.1f\n", "Client CPU use (% of one core):", 100.0 * cpu_s / duration);
    for (int k = 0; k < 4; k++) print_metric(o, &m[k]);
    printf("==================================================\n");
    if (failed) {
        printf("first errors:\n");
        for (size_t k = 0; k < json_array_size(errors) && k < 5; k++) printf("  %s\n", json_string_value(json_array_get(errors, k)));
    }

    json_t *j = json_object();
    char date[32];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", &tm);
    json_object_set_new(j, "date", json_string(date));
    json_object_set_new(j, "backend", json_string(o->label));
    json_object_set_new(j, "model_id", json_string(o->model));
    json_object_set_new(j, "tokenizer_id", json_string(o->model));
    json_object_set_new(j, "endpoint", json_string(o->endpoint));
    json_object_set_new(j, "dataset_name", json_string(o->data.name));
    json_object_set_new(j, "num_prompts", json_integer(r->n));
    json_object_set_new(j, "request_rate", o->request_rate > 0 ? json_real(o->request_rate) : json_string("inf"));
    json_object_set_new(j, "burstiness", json_real(o->burstiness));
    json_object_set_new(j, "max_concurrency", r->max_conc > 0 ? json_integer(r->max_conc) : json_null());
    json_object_set_new(j, "num_gpus", json_integer(o->num_gpus));
    json_object_set_new(j, "duration", json_real(duration));
    json_object_set_new(j, "completed", json_integer(completed));
    json_object_set_new(j, "failed", json_integer(failed));
    json_object_set_new(j, "total_input_tokens", json_integer(total_in));
    json_object_set_new(j, "total_output_tokens", json_integer(total_out));
    json_object_set_new(j, "request_throughput", json_real(completed / duration));
    json_object_set_new(j, "request_goodput", any_slo ? json_real(good / duration) : json_null());
    json_object_set_new(j, "output_throughput", json_real(total_out / duration));
    json_object_set_new(j, "total_token_throughput", json_real((total_in + total_out) / duration));
    json_object_set_new(j, "max_concurrent_requests", json_integer(r->max_inflight));
    json_object_set_new(j, "client_cpu_seconds", json_real(cpu_s));
    for (int k = 0; k < 4; k++) json_add_metric(j, o, &m[k]);
    json_object_set_new(j, "input_lens", input_lens);
    json_object_set_new(j, "output_lens", output_lens);
    json_object_set_new(j, "ttfts", ttfts);
    json_object_set_new(j, "errors", errors);
    sum->max_conc = r->max_conc;
    sum->completed = completed;
    sum->failed = failed;
    sum->output_throughput = total_out / duration;
    sum->request_throughput = completed / duration;
    sum->median_tpot = stats_percentile(m[1].v.v, m[1].v.n, 50);
    sum->median_ttft = stats_percentile(m[0].v.v, m[0].v.n, 50);
    sum->median_e2el = stats_percentile(m[3].v.v, m[3].v.n, 50);
    for (int k = 0; k < 4; k++) sample_vec_free(&m[k].v);
    return j;
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

// ---------------------------------------------------------------------------------------
// The served model's vocabulary size, for random prompts when --random-vocab-size is not given.

struct get_ctx {
    struct event_base *base;
    int code;
    char *body;
};

static void get_done(struct evhttp_request *req, void *arg) {
    struct get_ctx *g = arg;
    if (req) {
        g->code = evhttp_request_get_response_code(req);
        struct evbuffer *in = evhttp_request_get_input_buffer(req);
        size_t n = evbuffer_get_length(in);
        g->body = xmalloc(n + 1);
        evbuffer_remove(in, g->body, n);
        g->body[n] = '\0';
    }
    event_base_loopbreak(g->base);
}

// GET path as JSON (NULL on any failure: connection, status other than 200, not JSON).
static json_t *http_get_json(const struct bench_serve_options *o, struct event_base *base, const char *path) {
    struct evhttp_connection *c = evhttp_connection_base_new(base, NULL, o->host, (unsigned short)o->port);
    if (!c) return NULL;
    evhttp_connection_set_timeout(c, 30);
    struct get_ctx g = {base, 0, NULL};
    struct evhttp_request *req = evhttp_request_new(get_done, &g);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    char hostport[300];
    snprintf(hostport, sizeof hostport, "%s:%d", o->host, o->port);
    evhttp_add_header(h, "Host", hostport);
    if (o->api_key && *o->api_key) {
        char auth[512];
        snprintf(auth, sizeof auth, "Bearer %s", o->api_key);
        evhttp_add_header(h, "Authorization", auth);
    }
    json_t *j = NULL;
    if (evhttp_make_request(c, req, EVHTTP_REQ_GET, path) == 0) {
        event_base_dispatch(base);
        if (g.code == 200 && g.body) j = json_loads(g.body, 0, NULL);
    }
    free(g.body);
    evhttp_connection_free(c);
    return j;
}

// vLLM / atomc: GET /tokenizer_info {"vocab_size": N}; llama-server: GET /v1/models
// data[0].meta.n_vocab. 0 when neither says.
static int served_vocab_size(const struct bench_serve_options *o, struct event_base *base) {
    int v = 0;
    json_t *j = http_get_json(o, base, "/tokenizer_info");
    if (j && json_is_integer(json_object_get(j, "vocab_size"))) v = (int)json_integer_value(json_object_get(j, "vocab_size"));
    json_decref(j);
    if (v > 0) return v;
    j = http_get_json(o, base, "/v1/models");
    json_t *meta = json_object_get(json_array_get(json_object_get(j, "data"), 0), "meta");
    if (json_is_integer(json_object_get(meta, "n_vocab"))) v = (int)json_integer_value(json_object_get(meta, "n_vocab"));
    json_decref(j);
    return v;
}

atomc_status bench_serve_run(const struct bench_serve_options *o_in, struct error *err) {
    // Many concurrent streams need many sockets.
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    struct event_base *base = event_base_new();
    if (!base) return error_set(err, ATOMC_ERR_INTERNAL, "event_base_new failed");
    struct bench_serve_options oo = *o_in;
    const struct bench_serve_options *o = &oo;
    bool needs_vocab = !oo.data.tokenizer && strcmp(oo.data.name, "sharegpt") != 0;
    if (oo.data.vocab_size <= 0 && needs_vocab) {
        oo.data.vocab_size = served_vocab_size(o, base);
        if (oo.data.vocab_size <= 0) {
            oo.data.vocab_size = 10000;
            fprintf(stderr, "bench serve: the server reports no vocabulary size (GET /tokenizer_info, /v1/models); "
                            "drawing token ids from [100, 10000): pass --random-vocab-size or --tokenizer\n");
        } else {
            // Ordinary ids: skip the low ids where small vocabularies keep their special tokens.
            if (oo.data.vocab_size <= 4 * oo.data.first_id) oo.data.first_id = oo.data.vocab_size / 4;
            fprintf(stderr, "bench serve: random token ids from [%d, %d) (the served model's vocabulary)\n",
                    oo.data.first_id, oo.data.vocab_size);
        }
    }
    if (oo.data.vocab_size <= 0) oo.data.vocab_size = 10000; // unused (text prompts), but validated
    struct bench_dataset d;
    atomc_status st = bench_dataset_build(&o->data, &d, err);
    if (st != ATOMC_OK) return event_base_free(base), st;
    if (o->chat && d.reqs[0].ids)
        return event_base_free(base), bench_dataset_free(&d),
               error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "--backend openai-chat needs text prompts (--tokenizer PATH, or --dataset-name sharegpt)");
    struct level_summary sums[BENCH_MAX_LEVELS];
    for (int l = 0; l < o->n_levels; l++) {
        int conc = o->levels[l];
        if (o->num_warmups > 0) {
            struct level_run w = {.o = o, .d = &d, .base = base, .max_conc = conc, .n = o->num_warmups, .warmup = true};
            fprintf(stderr, "warming up with %d requests...\n", o->num_warmups);
            level_run_exec(&w);
            level_run_free(&w);
        }
        struct level_run r = {.o = o, .d = &d, .base = base, .max_conc = conc, .n = d.n};
        fprintf(stderr, "level %d/%d: max concurrency %s%d, %d requests, rate %s\n", l + 1, o->n_levels,
                conc ? "" : "unlimited ", conc, d.n, o->request_rate > 0 ? "finite" : "inf");
        double c0 = cpu_seconds(), t0 = time_now_s();
        level_run_exec(&r);
        double duration = time_now_s() - t0, cpu = cpu_seconds() - c0;
        json_t *res = summarize(o, &r, duration, cpu, &sums[l]);
        if (o->result_dir) {
            char path[1024];
            mkdir(o->result_dir, 0755);
            if (o->result_filename && o->n_levels == 1) snprintf(path, sizeof path, "%s/%s", o->result_dir, o->result_filename);
            else snprintf(path, sizeof path, "%s/%s-c%d.json", o->result_dir, o->result_filename ? o->result_filename : o->label, conc);
            if (json_dump_file(res, path, JSON_INDENT(1)) != 0) fprintf(stderr, "cannot write %s\n", path);
            else fprintf(stderr, "saved %s\n", path);
        }
        json_decref(res);
        int failed_all = sums[l].completed == 0 ? sums[l].failed : 0;
        char first_err[200] = "";
        if (failed_all) snprintf(first_err, sizeof first_err, "%s", r.reqs[0].error);
        level_run_free(&r);
        if (failed_all) {
            event_base_free(base);
            bench_dataset_free(&d);
            return error_set(err, ATOMC_ERR_IO, "every request failed (%d at max concurrency %d); first error: %s",
                             failed_all, conc, first_err);
        }
    }
    if (o->n_levels > 1) {
        printf("\n%-12s %10s %10s %14s %16s %12s %12s\n", "concurrency", "completed", "failed", "output tok/s",
               "tok/s/user", "median TTFT", "median E2EL");
        for (int l = 0; l < o->n_levels; l++) {
            struct level_summary *s = &sums[l];
            printf("%-12d %10d %10d %14.1f %16.1f %10.1fms %10.1fms\n", s->max_conc, s->completed, s->failed,
                   s->output_throughput, s->median_tpot > 0 ? 1000.0 / s->median_tpot : 0, s->median_ttft, s->median_e2el);
        }
    }
    event_base_free(base);
    bench_dataset_free(&d);
    return ATOMC_OK;
}
