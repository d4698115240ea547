// `atomc bench latency`: per-step decode latency by batch size and prefill latency by prompt
// length, measured through the public engine API (so scheduling, input preparation, the
// forward, sampling and detokenization are all included, as a server sees them).
//   decode: B requests of --input-len random tokens; once every request has its first token,
//           each following step decodes all B: its wall time is the decode step latency.
//   prefill: one request of L random tokens, max_tokens 1 (prefix caching off, fresh prompt
//           each iteration): the time until its first token is the prefill latency (TTFT).
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "bench/bench_dataset.h"
#include "bench/bench_stats.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/timeutil.h"

#define MAX_POINTS 32

struct lat_req {
    int tokens;     // output tokens so far
    bool finished;
};

static void on_lat_output(void *user, const atomc_output *out) {
    struct lat_req *r = user;
    r->tokens += out->n_new_tokens;
    if (out->finish_reason != ATOMC_FINISH_NONE) r->finished = true;
}

static int parse_list(const char *s, int *out) {
    int n = 0;
    for (const char *p = s; *p && n < MAX_POINTS;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 1 << 20) return -1;
        out[n++] = (int)v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static void usage(void) {
    printf("usage: atomc bench latency --model PATH [options]\n"
           "  --device auto|cpu|cuda        default auto (CUDA when a usable GPU is present)\n"
           "  --load-format auto|dummy      dummy = random weights from config.json\n"
           "  --batch-sizes B,...           decode batch sizes (default 1,2,4,8,16,32,64)\n"
           "  --input-len N                 prompt tokens of each decoding request (default 128)\n"
           "  --output-len N                decode steps timed per batch size (default 32)\n"
           "  --prompt-lens L,...           prefill prompt lengths (default 128,512,1024,2048)\n"
           "  --num-iters N                 prefill repetitions per length (default 3)\n"
           "  --max-num-batched-tokens N    default max(prompt lens)\n"
           "  --enforce-eager               no CUDA graphs\n"
           "  --kv-cache-dtype auto|bf16|fp8\n"
           "  --output-json FILE            write the results as JSON\n"
           "  --profile-dir DIR             record a per-step Chrome trace of the whole run into DIR\n"
           "  --moe-uniform-routing         MoE models: balanced round-robin routing (benchmark only)\n");
}

int cmd_bench_latency(int argc, char **argv) {
    const char *model = NULL, *device = "auto", *load_format = "auto", *json_path = NULL, *kv_dtype = "auto";
    const char *profile_dir = NULL;
    int bs[MAX_POINTS] = {1, 2, 4, 8, 16, 32, 64}, n_bs = 7;
    int pl[MAX_POINTS] = {128, 512, 1024, 2048}, n_pl = 4;
    int input_len = 128, output_len = 32, iters = 3, max_batched = 0;
    bool eager = false, uniform = false;
    enum { O_MODEL = 1, O_DEVICE, O_LOAD, O_BS, O_IN, O_OUT, O_PL, O_ITERS, O_BATCHED, O_EAGER, O_KV, O_JSON, O_PROFILE,
           O_UNIFORM, O_HELP };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"device", required_argument, 0, O_DEVICE},
        {"load-format", required_argument, 0, O_LOAD}, {"batch-sizes", required_argument, 0, O_BS},
        {"input-len", required_argument, 0, O_IN}, {"output-len", required_argument, 0, O_OUT},
        {"prompt-lens", required_argument, 0, O_PL}, {"num-iters", required_argument, 0, O_ITERS},
        {"max-num-batched-tokens", required_argument, 0, O_BATCHED}, {"enforce-eager", no_argument, 0, O_EAGER},
        {"kv-cache-dtype", required_argument, 0, O_KV}, {"output-json", required_argument, 0, O_JSON},
        {"profile-dir", required_argument, 0, O_PROFILE}, {"moe-uniform-routing", no_argument, 0, O_UNIFORM},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0},
    };
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_MODEL: model = optarg; break;
        case O_DEVICE: device = optarg; break;
        case O_LOAD: load_format = optarg; break;
        case O_BS: n_bs = parse_list(optarg, bs); break;
        case O_IN:
            if (!cli_parse_int(optarg, "--input-len", 1, 1 << 24, &input_len)) return 2;
            break;
        case O_OUT:
            if (!cli_parse_int(optarg, "--output-len", 1, 1 << 24, &output_len)) return 2;
            break;
        case O_PL: n_pl = parse_list(optarg, pl); break;
        case O_ITERS:
            if (!cli_parse_int(optarg, "--num-iters", 1, 1 << 30, &iters)) return 2;
            break;
        case O_BATCHED:
            if (!cli_parse_int(optarg, "--max-num-batched-tokens", 1, 1 << 30, &max_batched)) return 2;
            break;
        case O_EAGER: eager = true; break;
        case O_KV: kv_dtype = optarg; break;
        case O_JSON: json_path = optarg; break;
        case O_PROFILE: profile_dir = optarg; break;
        case O_UNIFORM: uniform = true; break;
        case O_HELP: usage(); return 0;
        default: fprintf(stderr, "atomc bench latency: bad option '%s'\n", argv[optind - 1]); return 2;
        }
    }
    if (!model || n_bs < 0 || n_pl < 0 || input_len < 1 || output_len < 1 || iters < 1) {
        fprintf(stderr, "atomc bench latency: --model is required; lists must be positive integers\n");
        return 2;
    }
    int max_bs = 1, max_pl = 1;
    for (int i = 0; i < n_bs; i++) max_bs = bs[i] > max_bs ? bs[i] : max_bs;
    for (int i = 0; i < n_pl; i++) max_pl = pl[i] > max_pl ? pl[i] : max_pl;
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = model;
    o.device = device;
    o.load_format = load_format;
    o.kv_cache_dtype = kv_dtype;
    o.enforce_eager = eager;
    o.moe_uniform_routing = uniform;
    o.enable_prefix_caching = false;
    o.profile_dir = profile_dir;
    o.max_num_seqs = max_bs;
    long long batch_tokens = (long long)max_bs * input_len;
    if (batch_tokens > 1 << 30) batch_tokens = 1 << 30;
    o.max_num_batched_tokens = max_batched > 0 ? max_batched : (int)(max_pl > batch_tokens ? max_pl : batch_tokens);
    if (o.max_num_batched_tokens < 256) o.max_num_batched_tokens = 256;
    char msg[512];
    atomc_engine *e;
    if (atomc_engine_create(&o, &e, msg, sizeof msg) != ATOMC_OK) {
        fprintf(stderr, "atomc bench latency: %s\n", msg);
        return 1;
    }
    if (profile_dir && atomc_engine_start_profile(e, msg, sizeof msg) != ATOMC_OK) {
        fprintf(stderr, "atomc bench latency: %s\n", msg);
        atomc_engine_free(e);
        return 1;
    }
    atomc_model_info info;
    atomc_engine_get_model_info(e, &info);
    uint64_t rng = 42;
    int vocab = info.vocab_size > 1000 ? 1000 : info.vocab_size; // ordinary ids, well below specials
    int total = input_len + output_len + 8 > max_pl ? input_len + output_len + 8 : max_pl;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)total * (size_t)max_bs);
    struct lat_req *reqs = calloc((size_t)max_bs, sizeof *reqs);
    uint64_t *req_ids = calloc((size_t)max_bs, sizeof *req_ids);
    double dec_ms[MAX_POINTS][3] = {{0}}, pre_ms[MAX_POINTS][2] = {{0}};
    int rc = 0;

    printf("%-12s %14s %14s %14s %16s\n", "batch size", "mean step ms", "median ms", "p90 ms", "output tok/s");
    for (int b = 0; b < n_bs && rc == 0; b++) {
        int B = bs[b];
        memset(reqs, 0, sizeof *reqs * (size_t)B);
        for (int i = 0; i < B; i++) {
            int32_t *p = ids + (size_t)i * total;
            for (int k = 0; k < input_len; k++) p[k] = 10 + (int32_t)(bench_rng_next(&rng) % (uint64_t)(vocab - 10));
            atomc_request r;
            atomc_request_init(&r);
            r.prompt_ids = p;
            r.n_prompt_ids = input_len;
            // Long enough that no request finishes before the last one has been prefilled (prefill
            // of B prompts takes about B * input_len / max_num_batched_tokens steps); the run is
            // cut short by aborts once output_len decode steps have been timed.
            r.params.max_tokens = output_len + 4 + (B * input_len) / o.max_num_batched_tokens + 2 * B;
            r.params.temperature = 0;
            r.params.ignore_eos = true;
            r.on_output = on_lat_output;
            r.user = &reqs[i];
            if (atomc_engine_add_request(e, &r, &req_ids[i], msg, sizeof msg) != ATOMC_OK) {
                fprintf(stderr, "atomc bench latency: %s\n", msg);
                rc = 1;
                break;
            }
        }
        struct sample_vec steps = {0};
        bool aborted = false;
        while (rc == 0 && atomc_engine_has_work(e)) {
            bool all_started = true;
            for (int i = 0; i < B; i++) all_started &= reqs[i].tokens > 0;
            double t0 = time_now_s();
            atomc_engine_step(e);
            double dt = (time_now_s() - t0) * 1000.0;
            bool all_alive = true;
            for (int i = 0; i < B; i++) all_alive &= !reqs[i].finished;
            if (all_started && all_alive && (int)steps.n < output_len) sample_vec_push(&steps, dt);
            if ((int)steps.n >= output_len && !aborted) { // measured: finish the level quickly
                for (int i = 0; i < B; i++)
                    if (!reqs[i].finished) atomc_engine_abort(e, req_ids[i]);
                aborted = true;
            }
        }
        double mean = stats_mean(steps.v, steps.n);
        dec_ms[b][0] = mean;
        dec_ms[b][1] = stats_percentile(steps.v, steps.n, 50);
        dec_ms[b][2] = stats_percentile(steps.v, steps.n, 90);
        printf("%-12d %14.3f %14.3f %14.3f %16.1f\n", B, mean, dec_ms[b][1], dec_ms[b][2], mean > 0 ? B * 1000.0 / mean : 0);
        sample_vec_free(&steps);
    }
    printf("\n%-12s %14s %14s %18s\n", "prompt len", "mean TTFT ms", "median ms", "prefill tok/s");
    for (int l = 0; l < n_pl && rc == 0; l++) {
        struct sample_vec t = {0};
        for (int it = 0; it < iters + 1 && rc == 0; it++) { // first iteration is a warm-up
            for (int k = 0; k < pl[l]; k++) ids[k] = 10 + (int32_t)(bench_rng_next(&rng) % (uint64_t)(vocab - 10));
            struct lat_req r0 = {0};
            atomc_request r;
            atomc_request_init(&r);
            r.prompt_ids = ids;
            r.n_prompt_ids = pl[l];
            r.params.max_tokens = 1;
            r.params.temperature = 0;
            r.params.ignore_eos = true;
            r.on_output = on_lat_output;
            r.user = &r0;
            uint64_t id;
            if (atomc_engine_add_request(e, &r, &id, msg, sizeof msg) != ATOMC_OK) {
                fprintf(stderr, "atomc bench latency: %s\n", msg);
                rc = 1;
                break;
            }
            double t0 = time_now_s();
            while (r0.tokens == 0 && !r0.finished && atomc_engine_has_work(e)) atomc_engine_step(e);
            double dt = (time_now_s() - t0) * 1000.0;
            while (atomc_engine_has_work(e)) atomc_engine_step(e);
            if (it > 0) sample_vec_push(&t, dt);
        }
        pre_ms[l][0] = stats_mean(t.v, t.n);
        pre_ms[l][1] = stats_percentile(t.v, t.n, 50);
        printf("%-12d %14.3f %14.3f %18.1f\n", pl[l], pre_ms[l][0], pre_ms[l][1],
               pre_ms[l][1] > 0 ? pl[l] * 1000.0 / pre_ms[l][1] : 0);
        sample_vec_free(&t);
    }
    if (json_path && rc == 0) {
        json_t *decode = json_array(), *prefill = json_array();
        for (int b = 0; b < n_bs; b++)
            json_array_append_new(decode, json_pack("{s:i, s:f, s:f, s:f}", "batch_size", bs[b], "mean_ms", dec_ms[b][0],
                                                    "median_ms", dec_ms[b][1], "p90_ms", dec_ms[b][2]));
        for (int l = 0; l < n_pl; l++)
            json_array_append_new(prefill, json_pack("{s:i, s:f, s:f}", "prompt_len", pl[l], "mean_ms", pre_ms[l][0],
                                                     "median_ms", pre_ms[l][1]));
        json_t *j = json_pack("{s:s, s:s, s:i, s:o, s:o}", "model", info.model_name, "device", device, "input_len",
                              input_len, "decode", decode, "prefill", prefill);
        if (!j || json_dump_file(j, json_path, JSON_INDENT(2)) != 0) {
            fprintf(stderr, "atomc bench latency: cannot write %s\n", json_path);
            rc = 1;
        }
        json_decref(j);
    }
    if (profile_dir) {
        char path[4096];
        if (atomc_engine_stop_profile(e, path, sizeof path, msg, sizeof msg) != ATOMC_OK) {
            fprintf(stderr, "atomc bench latency: writing the profile failed: %s\n", msg);
            rc = 1;
        } else {
            fprintf(stderr, "atomc bench latency: profile written to %s\n", path);
        }
    }
    free(ids);
    free(reqs);
    free(req_ids);
    atomc_engine_free(e);
    return rc;
}
