// Prometheus metrics of the OpenAI server, named as vLLM names them so existing dashboards
// and alerts work unchanged (vllm:num_requests_running, vllm:time_to_first_token_seconds, ...).
//
// Contract: a `struct metrics` is owned by one server and touched only on its event-loop
// thread (request completions are recorded there, /metrics is rendered there), so it needs
// no lock. Engine-side gauges and counters (running/waiting, KV usage, token totals,
// preemptions, prefix cache) are read from atomc_stats at scrape time and passed in.
#ifndef ATOMC_SERVER_METRICS_H
#define ATOMC_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "atomc.h"

#define METRICS_MAX_BUCKETS 32

struct histogram {
    const char *name; // e.g. "vllm:time_to_first_token_seconds"
    const char *help;
    int n_buckets;
    double bounds[METRICS_MAX_BUCKETS];   // upper bounds, ascending (+Inf implied)
    uint64_t counts[METRICS_MAX_BUCKETS + 1]; // per bucket (not cumulative); last = +Inf
    double sum;
    uint64_t count;
};

enum metrics_finish { METRICS_FINISH_STOP = 0, METRICS_FINISH_LENGTH, METRICS_FINISH_ABORT, METRICS_FINISH_ERROR, METRICS_FINISH_COUNT };

struct metrics {
    char *model_name; // label value (escaped when rendered)
    uint64_t request_success[METRICS_FINISH_COUNT]; // per finished_reason
    uint64_t http_requests_total;                   // every HTTP request handled
    uint64_t http_errors_total[6];                  // by status class: index = status/100 (4 -> 4xx, 5 -> 5xx)
    uint64_t rejected_busy_total;                   // 503 because the waiting queue was full
    uint64_t connections_total;                     // connections accepted
    uint64_t connections_shed_total;                // closed to stay under the connection / descriptor limit
    uint64_t connections_timed_out_total;           // closed by the keep-alive or request-read deadline
    uint64_t connections_open;                      // gauge
    struct histogram ttft, itl, e2e, queue_time, prompt_tokens, generation_tokens;
    struct histogram kv_transfer_time; // consumer: per request, first to last KV frame (P/D)
};

void metrics_init(struct metrics *m, const char *model_name);
void metrics_free(struct metrics *m);

void histogram_observe(struct histogram *h, double v);

// Records one finished engine request (one choice).
// ttft/e2e/queue in seconds (queue < 0 = unknown, not observed).
void metrics_record_request(struct metrics *m, atomc_finish_reason reason, int prompt_tokens, int generation_tokens,
                            double ttft, double e2e, double queue);

// Appends the Prometheus text exposition (format 0.0.4) to *buf (malloc'd, grown as needed).
// Returns 0, or -1 on allocation failure.
int metrics_render(const struct metrics *m, const atomc_stats *s, char **buf, size_t *len);

#endif
