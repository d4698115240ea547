// Prometheus text rendering of server + engine metrics (see metrics.h for the threading contract).
#include "server/metrics.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

static void histogram_setup(struct histogram *h, const char *name, const char *help, const double *bounds, int n) {
    CHECK(n <= METRICS_MAX_BUCKETS);
    memset(h, 0, sizeof *h);
    h->name = name;
    h->help = help;
    h->n_buckets = n;
    memcpy(h->bounds, bounds, (size_t)n * sizeof *bounds);
}

void metrics_init(struct metrics *m, const char *model_name) {
    memset(m, 0, sizeof *m);
    m->model_name = xstrdup(model_name ? model_name : "");
    // Bucket bounds as vLLM uses them, so dashboards' quantile queries read the same.
    static const double ttft[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,  0.75,
                                  1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160., 640., 2560.};
    static const double itl[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4,  0.5,
                                 0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
    static const double e2e[] = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,  15.0, 20.0,
                                 30.0, 40.0, 50.0, 60.0, 120., 240.0, 480.0, 960.0, 1920., 7680.};
    static const double toks[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};
#define N(a) (int)(sizeof a / sizeof a[0])
    histogram_setup(&m->ttft, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    ttft, N(ttft));
    histogram_setup(&m->itl, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl,
                    N(itl));
    histogram_setup(&m->e2e, "vllm:e2e_request_latency_seconds",
                    "Histogram of end to end request latency in seconds.", e2e, N(e2e));
    histogram_setup(&m->queue_time, "vllm:request_queue_time_seconds",
                    "Histogram of time spent waiting to be scheduled, in seconds.", e2e, N(e2e));
    histogram_setup(&m->prompt_tokens, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", toks,
                    N(toks));
    histogram_setup(&m->generation_tokens, "vllm:request_generation_tokens",
                    "Number of generation tokens processed.", toks, N(toks));
    static const double xfer[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
    histogram_setup(&m->kv_transfer_time, "atomc:kv_transfer_time_seconds",
                    "Per request on the decode instance: seconds from the first to the last KV frame of its prompt.",
                    xfer, N(xfer));
#undef N
}

void metrics_free(struct metrics *m) {
    free(m->model_name);
    m->model_name = NULL;
}

void histogram_observe(struct histogram *h, double v) {
    if (!isfinite(v)) return;
    int i = 0;
    while (i < h->n_buckets && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

void metrics_record_request(struct metrics *m, atomc_finish_reason reason, int prompt_tokens, int generation_tokens,
                            double ttft, double e2e, double queue) {
    enum metrics_finish f = METRICS_FINISH_ERROR;
    switch (reason) {
    case ATOMC_FINISH_STOP: f = METRICS_FINISH_STOP; break;
    case ATOMC_FINISH_LENGTH: f = METRICS_FINISH_LENGTH; break;
    case ATOMC_FINISH_ABORT: f = METRICS_FINISH_ABORT; break;
    default: f = METRICS_FINISH_ERROR; break;
    }
    m->request_success[f]++;
    if (ttft >= 0) histogram_observe(&m->ttft, ttft);
    if (e2e >= 0) histogram_observe(&m->e2e, e2e);
    if (queue >= 0) histogram_observe(&m->queue_time, queue);
    histogram_observe(&m->prompt_tokens, prompt_tokens);
    histogram_observe(&m->generation_tokens, generation_tokens);
}

// Growable output buffer; `failed` latches allocation failure.
struct outbuf {
    char *p;
    size_t len, cap;
    int failed;
};

__attribute__((format(printf, 2, 3))) static void out_printf(struct outbuf *o, const char *fmt, ...) {
    if (o->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(o->p + o->len, o->cap - o->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            o->failed = 1;
            return;
        }
        if ((size_t)n < o->cap - o->len) {
            o->len += (size_t)n;
            return;
        }
        size_t ncap = (o->cap + (size_t)n + 1) * 2;
        char *np = realloc(o->p, ncap);
        if (!np) {
            o->failed = 1;
            return;
        }
        o->p = np;
        o->cap = ncap;
    }
}

// Label values escape backslash, double quote and newline (Prometheus text format).
static char *label_escape(const char *s) {
    size_t n = strlen(s);
    char *out = xmalloc(2 * n + 1), *q = out;
    for (const char *p = s; *p; p++) {
        if (*p == '\\' || *p == '"') {
            *q++ = '\\';
            *q++ = *p;
        } else if (*p == '\n') {
            *q++ = '\\';
            *q++ = 'n';
        } else {
            *q++ = *p;
        }
    }
    *q = '\0';
    return out;
}

// Shortest decimal that reads back as the same double (Prometheus parses it with strtod).
static const char *fmt_double(double v, char *buf, size_t len) {
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

static void out_header(struct outbuf *o, const char *name, const char *type, const char *help) {
    out_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void out_gauge(struct outbuf *o, const char *lbl, const char *name, const char *help, double v) {
    out_header(o, name, "gauge", help);
    char num[40];
    out_printf(o, "%s{model_name=\"%s\"} %s\n", name, lbl, fmt_double(v, num, sizeof num));
}

static void out_counter(struct outbuf *o, const char *lbl, const char *name, const char *help, uint64_t v) {
    out_header(o, name, "counter", help);
    out_printf(o, "%s{model_name=\"%s\"} %llu\n", name, lbl, (unsigned long long)v);
}

static void out_histogram(struct outbuf *o, const char *lbl, const struct histogram *h) {
    out_header(o, h->name, "histogram", h->help);
    uint64_t cum = 0;
    char num[40];
    for (int i = 0; i < h->n_buckets; i++) {
        cum += h->counts[i];
        out_printf(o, "%s_bucket{le=\"%s\",model_name=\"%s\"} %llu\n", h->name, fmt_double(h->bounds[i], num, sizeof num),
                   lbl, (unsigned long long)cum);
    }
    cum += h->counts[h->n_buckets];
    out_printf(o, "%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", h->name, lbl, (unsigned long long)cum);
    out_printf(o, "%s_sum{model_name=\"%s\"} %s\n", h->name, lbl, fmt_double(h->sum, num, sizeof num));
    out_printf(o, "%s_count{model_name=\"%s\"} %llu\n", h->name, lbl, (unsigned long long)h->count);
}

int metrics_render(const struct metrics *m, const atomc_stats *s, char **buf, size_t *len) {
    struct outbuf o = {0};
    char *lbl = label_escape(m->model_name);
    out_gauge(&o, lbl, "vllm:num_requests_running", "Number of requests in model execution batches.",
              s->num_running);
    out_gauge(&o, lbl, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", s->num_waiting);
    out_gauge(&o, lbl, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s->kv_cache_usage);
    out_gauge(&o, lbl, "vllm:gpu_cache_usage_perc", "KV-cache usage (older name of vllm:kv_cache_usage_perc).",
              s->kv_cache_usage);
    out_gauge(&o, lbl, "atomc:num_kv_blocks", "Total KV-cache blocks.", s->num_kv_blocks);
    out_gauge(&o, lbl, "atomc:num_free_kv_blocks", "Free KV-cache blocks.", s->num_free_kv_blocks);
    out_counter(&o, lbl, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", s->prompt_tokens_total);
    out_counter(&o, lbl, "vllm:generation_tokens_total", "Number of generation tokens processed.",
                s->generation_tokens_total);
    out_counter(&o, lbl, "vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.",
                s->num_preemptions);
    out_counter(&o, lbl, "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
                s->prefix_cache_queries);
    out_counter(&o, lbl, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
                s->prefix_cache_hits);
    out_counter(&o, lbl, "atomc:engine_steps_total", "Engine steps run.", s->num_steps);
    out_counter(&o, lbl, "atomc:prompt_tokens_computed_total",
                "Prompt tokens run through the model (prefix-cache hits and transferred KV excluded).",
                s->prompt_tokens_computed);
    if (s->kv_role) { // prefill/decode disaggregation (--kv-transfer-config)
        out_counter(&o, lbl, "atomc:kv_transfer_bytes_sent_total", "KV bytes sent to decode instances.",
                    s->kv_bytes_sent);
        out_counter(&o, lbl, "atomc:kv_transfer_bytes_received_total", "KV bytes received from prefill instances.",
                    s->kv_bytes_received);
        out_counter(&o, lbl, "atomc:kv_transfer_blocks_sent_total", "KV blocks of completed transfers sent.",
                    s->kv_blocks_sent);
        out_counter(&o, lbl, "atomc:kv_transfer_blocks_received_total", "KV blocks of transfers received.",
                    s->kv_blocks_received);
        out_counter(&o, lbl, "atomc:kv_transfers_sent_total", "Prompt KV transfers sent.", s->kv_transfers_sent);
        out_counter(&o, lbl, "atomc:kv_transfers_received_total", "Prompt KV transfers received and used.",
                    s->kv_transfers_received);
        out_counter(&o, lbl, "atomc:kv_transfers_failed_total", "KV transfers aborted, broken or refused.",
                    s->kv_transfers_failed);
        out_counter(&o, lbl, "atomc:kv_transfer_fallbacks_total",
                    "Requests for a remote prefill that prefilled locally (KV late, broken or mismatched).",
                    s->kv_fallbacks);
        out_gauge(&o, lbl, "atomc:kv_transfer_held_blocks",
                  "KV blocks a prefill instance holds until decode instances acknowledge them.", s->kv_held_blocks);
        out_gauge(&o, lbl, "atomc:kv_transfer_waiting_requests", "Requests waiting for their prompt's KV.",
                  s->kv_waiting);
        out_gauge(&o, lbl, "atomc:kv_transfer_peers", "KV transfer connections past the handshake.", s->kv_peers);
        out_counter(&o, lbl, "atomc:kv_transfer_layers_sent_total", "KV DATA frames (one layer of one step) queued.",
                    s->kv_layers_sent);
        out_counter(&o, lbl, "atomc:kv_transfer_layers_during_forward_total",
                    "KV DATA frames queued while the forward that wrote them still ran.", s->kv_layers_during_forward);
        out_gauge(&o, lbl, "atomc:kv_transfer_send_queue_peak_bytes",
                  "Largest send queue of one decode-instance connection.", (double)s->kv_send_queue_peak);
        out_counter(&o, lbl, "atomc:kv_transfer_send_queue_waits_total",
                    "Times a full send queue made the prefill instance wait.", s->kv_send_queue_waits);
        out_counter(&o, lbl, "atomc:kv_transfer_blocks_skipped_total",
                    "Prompt KV blocks not sent because the decode instance had them cached.", s->kv_blocks_skipped);
    }
    if (s->num_speculative_tokens > 0) { // speculative decoding on: vLLM's spec_decode counters
        out_counter(&o, lbl, "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
                    s->spec_num_drafts);
        out_counter(&o, lbl, "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
                    s->spec_num_draft_tokens);
        out_counter(&o, lbl, "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                    s->spec_num_accepted_tokens);
        out_header(&o, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted tokens per draft position.");
        for (int i = 0; i < s->num_speculative_tokens && i < ATOMC_MAX_SPEC_TOKENS; i++)
            out_printf(&o,
                       "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"%s\",position=\"%d\"} %llu\n",
                       lbl, i, (unsigned long long)s->spec_accepted_per_pos[i]);
    }

    static const char *reasons[METRICS_FINISH_COUNT] = {"stop", "length", "abort", "error"};
    out_header(&o, "vllm:request_success_total", "counter", "Count of finished requests by finish reason.");
    for (int i = 0; i < METRICS_FINISH_COUNT; i++)
        out_printf(&o, "vllm:request_success_total{finished_reason=\"%s\",model_name=\"%s\"} %llu\n", reasons[i], lbl,
                   (unsigned long long)m->request_success[i]);
    out_counter(&o, lbl, "atomc:http_requests_total", "HTTP requests received.", m->http_requests_total);
    out_header(&o, "atomc:http_errors_total", "counter", "HTTP error responses by status class.");
    out_printf(&o, "atomc:http_errors_total{code=\"4xx\",model_name=\"%s\"} %llu\n", lbl,
               (unsigned long long)m->http_errors_total[4]);
    out_printf(&o, "atomc:http_errors_total{code=\"5xx\",model_name=\"%s\"} %llu\n", lbl,
               (unsigned long long)m->http_errors_total[5]);
    out_header(&o, "atomc:http_connections", "gauge", "Open HTTP connections.");
    out_printf(&o, "atomc:http_connections{model_name=\"%s\"} %llu\n", lbl, (unsigned long long)m->connections_open);
    out_counter(&o, lbl, "atomc:http_connections_total", "HTTP connections accepted.", m->connections_total);
    out_counter(&o, lbl, "atomc:http_connections_shed_total",
                "HTTP connections closed to stay under the connection or descriptor limit.", m->connections_shed_total);
    out_counter(&o, lbl, "atomc:http_connections_timed_out_total",
                "HTTP connections closed by the keep-alive or request-read deadline.", m->connections_timed_out_total);
    out_counter(&o, lbl, "atomc:requests_rejected_busy_total", "Requests rejected because the waiting queue was full.",
                m->rejected_busy_total);

    out_histogram(&o, lbl, &m->ttft);
    out_histogram(&o, lbl, &m->itl);
    out_histogram(&o, lbl, &m->e2e);
    out_histogram(&o, lbl, &m->queue_time);
    out_histogram(&o, lbl, &m->prompt_tokens);
    out_histogram(&o, lbl, &m->generation_tokens);
    if (s->kv_role) out_histogram(&o, lbl, &m->kv_transfer_time);
    free(lbl);
    if (o.failed) {
        free(o.p);
        return -1;
    }
    *buf = o.p;
    *len = o.len;
    return 0;
}
