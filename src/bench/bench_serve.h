// `atomc bench serve`: an OpenAI-compatible serving benchmark client on libevent, usable
// against any server (atomc, vLLM, SGLang, llama-server). Streams every request (SSE),
// timestamps each chunk, and reports vLLM's benchmark metrics per concurrency level.
#ifndef ATOMC_BENCH_SERVE_H
#define ATOMC_BENCH_SERVE_H

#include <stdbool.h>
#include <stdint.h>

#include "bench/bench_dataset.h"
#include "common/error.h"

#define BENCH_MAX_LEVELS 32
#define BENCH_MAX_PCTS 8

struct bench_serve_options {
    const char *host;         // points into argv, or at host_buf when taken from --base-url
    char host_buf[256];
    int port;
    const char *endpoint;     // "/v1/completions" or "/v1/chat/completions"
    bool chat;                // request shape: chat messages instead of prompt
    const char *model;
    const char *api_key;
    struct bench_dataset_options data;
    double request_rate;      // requests/s; <= 0 = all at once (inf)
    double burstiness;        // gamma shape; 1 = Poisson
    int levels[BENCH_MAX_LEVELS]; // max concurrency levels swept (0 = unlimited)
    int n_levels;
    int num_warmups;
    bool ignore_eos;
    double temperature;
    double pcts[BENCH_MAX_PCTS]; // percentiles reported
    int n_pcts;
    double goodput_ttft_ms, goodput_tpot_ms, goodput_e2el_ms; // 0 = no SLO
    const char *result_dir;   // NULL = don't save
    const char *result_filename; // base name; level suffix added when sweeping
    const char *label;        // engine label stored in the result ("backend")
    int num_gpus;             // stored for per-GPU throughput charts
    bool progress;
    double timeout_s;         // per request
};

void bench_serve_options_init(struct bench_serve_options *o);
// Parses vLLM-style flags (argv[0] is the subcommand name). Returns ATOMC_ERR_INVALID_ARGUMENT
// with a message on a bad flag; *help is set when --help was asked.
atomc_status bench_serve_parse_args(struct bench_serve_options *o, int argc, char **argv, bool *help,
                                    struct error *err);
void bench_serve_usage(void);
atomc_status bench_serve_run(const struct bench_serve_options *o, struct error *err);

#endif
