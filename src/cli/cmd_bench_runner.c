// `atomc bench-runner`: the model runner alone (no scheduler, no HTTP) on synthetic batches:
// prefill of `batch` prompts of `prompt-len` random tokens, then `decode-steps` greedy decode
// steps of the whole batch. Prints prefill tokens/s, decode tokens/s and ms/step, and the
// bytes a decode step must read (weights + the KV of every context) per second, as a
// fraction of --peak-bw (GB/s) or of the host memory bandwidth measured with --measure-bw.
// Works with real checkpoints and with --load-format dummy (config.json alone).
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/timeutil.h"
#include "model/model.h"
#include "runtime/model_runner.h"

static void bench_runner_usage(FILE *f) {
    fprintf(f,
            "usage: atomc bench-runner --model PATH [options]\n"
            "  --model PATH          HF model directory, .gguf file, or (with --load-format dummy) a config.json/dir\n"
            "  --device auto|cpu|cuda (default auto)\n"
            "  --dtype D             auto|float32|bfloat16|float16 (default auto)\n"
            "  --load-format F       auto|dummy (default auto)\n"
            "  --kv-cache-dtype D    auto|bf16|fp8|float32\n"
            "  --batch B             sequences decoded together (default 1)\n"
            "  --prompt-len P        prompt tokens per sequence (default 128)\n"
            "  --decode-steps N      timed decode steps (default 64)\n"
            "  --warmup N            untimed decode steps first (default 4)\n"
            "  --max-num-batched-tokens T  prefill chunk size (default min(8192, B*P))\n"
            "  --threads N           CPU threads (default: all cores)\n"
            "  --enforce-eager       no CUDA graphs\n"
            "  --peak-bw GBPS        memory bandwidth limit for the ratio (GB/s)\n"
            "  --measure-bw          measure host memory read bandwidth first and use it as the limit\n"
            "  --json                one JSON object on stdout\n"
            "  --moe-uniform-routing MoE models: balanced round-robin routing instead of the router's\n"
            "                        (random dummy routers concentrate traffic that real ones spread)\n");
}

struct bw_ctx {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
};

static void *bw_read(void *arg) {
    struct bw_ctx *c = arg;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= c->n; i += 4) {
        s0 += c->p[i];
        s1 += c->p[i + 1];
        s2 += c->p[i + 2];
        s3 += c->p[i + 3];
    }
    c->sum = s0 + s1 + s2 + s3;
    return NULL;
}

// Read bandwidth (GB/s) of `threads` threads summing a 1 GiB buffer, best of 5; 0 when it
// cannot be measured (no memory or no threads).
static double bench_measure_bw(int threads) {
    size_t bytes = (size_t)1 << 30, n = bytes / 8;
    uint64_t *buf = malloc(bytes);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = i;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        pthread_t th[64];
        struct bw_ctx ctx[64];
        double t0 = time_now_s();
        int started = 0;
        for (; started < threads; started++) {
            ctx[started] = (struct bw_ctx){buf + n / threads * started, n / threads, 0};
            if (pthread_create(&th[started], NULL, bw_read, &ctx[started]) != 0) break;
        }
        uint64_t sink = 0;
        for (int t = 0; t < started; t++) {
            pthread_join(th[t], NULL);
            sink += ctx[t].sum;
        }
        double dt = time_now_s() - t0;
        if (started < threads) { // no threads left: report "not measured" rather than a wrong figure
            fprintf(stderr, "atomc bench-runner: could not start %d bandwidth threads\n", threads);
            best = 0;
            break;
        }
        if (sink == 42) fprintf(stderr, " ");
        if (bytes / dt / 1e9 > best) best = bytes / dt / 1e9;
    }
    free(buf);
    return best;
}

int cmd_bench_runner(int argc, char **argv) {
    struct runner_options o = {.device = "auto", .dtype = "auto", .load_format = "auto", .kv_cache_dtype = "auto",
                               .block_size = 16, .gpu_memory_utilization = 0.9, .dummy_seed = 1};
    int batch = 1, prompt_len = 128, steps = 64, warmup = 4, json = 0, measure = 0;
    double peak_bw = 0;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},        {"device", required_argument, 0, 'd'},
        {"dtype", required_argument, 0, 't'},        {"load-format", required_argument, 0, 'l'},
        {"kv-cache-dtype", required_argument, 0, 'k'}, {"batch", required_argument, 0, 'b'},
        {"prompt-len", required_argument, 0, 'p'},   {"decode-steps", required_argument, 0, 'n'},
        {"warmup", required_argument, 0, 'w'},       {"max-num-batched-tokens", required_argument, 0, 'T'},
        {"threads", required_argument, 0, 'j'},      {"enforce-eager", no_argument, 0, 'e'},
        {"peak-bw", required_argument, 0, 'P'},      {"measure-bw", no_argument, 0, 'M'},
        {"json", no_argument, 0, 'J'},               {"help", no_argument, 0, 'h'},
        {"moe-uniform-routing", no_argument, 0, 'U'},
        {0, 0, 0, 0}};
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o.model_path = optarg; break;
        case 'd': o.device = optarg; break;
        case 't': o.dtype = optarg; break;
        case 'l': o.load_format = optarg; break;
        case 'k': o.kv_cache_dtype = optarg; break;
        case 'b':
            if (!cli_parse_int(optarg, "--batch", 1, 1 << 20, &batch)) return 2;
            break;
        case 'p':
            if (!cli_parse_int(optarg, "--prompt-len", 1, 1 << 24, &prompt_len)) return 2;
            break;
        case 'n':
            if (!cli_parse_int(optarg, "--decode-steps", 1, 1 << 24, &steps)) return 2;
            break;
        case 'w':
            if (!cli_parse_int(optarg, "--warmup", 0, 1 << 24, &warmup)) return 2;
            break;
        case 'T':
            if (!cli_parse_int(optarg, "--max-num-batched-tokens", 1, 1 << 30, &o.max_num_batched_tokens)) return 2;
            break;
        case 'j':
            if (!cli_parse_int(optarg, "--threads", 0, 4096, &o.num_threads)) return 2;
            break;
        case 'e': o.enforce_eager = true; break;
        case 'P':
            if (!cli_parse_double(optarg, "--peak-bw", &peak_bw)) return 2;
            break;
        case 'M': measure = 1; break;
        case 'J': json = 1; break;
        case 'U': o.moe_uniform_routing = true; break;
        case 'h': bench_runner_usage(stdout); return 0;
        default: bench_runner_usage(stderr); return 2;
        }
    }
    if (!o.model_path || batch < 1 || prompt_len < 1 || steps < 1 || warmup < 0) {
        fprintf(stderr, "atomc bench-runner: --model is required; --batch, --prompt-len, --decode-steps must be >= 1\n");
        bench_runner_usage(stderr);
        return 2;
    }
    int total = prompt_len + warmup + steps;
    o.max_num_seqs = batch;
    o.max_model_len = total;
    if (o.max_num_batched_tokens <= 0) {
        long t = (long)batch * prompt_len;
        o.max_num_batched_tokens = (int)(t > 8192 ? 8192 : t < batch ? batch : t);
    }
    int blocks_per_seq = (total + o.block_size - 1) / o.block_size;
    o.num_kv_blocks = batch * blocks_per_seq;
    if (measure) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        peak_bw = bench_measure_bw(o.num_threads > 0 ? o.num_threads : (int)cores);
        fprintf(stderr, "host memory read bandwidth: %.1f GB/s\n", peak_bw);
    }

    struct model_runner *r = NULL;
    struct error err = {0};
    double t_load = time_now_s();
    o.device = backend_resolve_device(o.device);
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc bench-runner: %s\n", err.msg);
        return 1;
    }
    t_load = time_now_s() - t_load;
    const struct model_config *cfg = model_runner_config(r);
    int bs = model_runner_block_size(r);

    // Sequences: block tables laid out back to back; random prompt tokens.
    int n_tok_max = o.max_num_batched_tokens;
    int32_t *bt = calloc((size_t)batch * blocks_per_seq, 4), *ctx = calloc((size_t)batch, 4);
    int32_t *tok = calloc((size_t)n_tok_max, 4), *pos = calloc((size_t)n_tok_max, 4), *slot = calloc((size_t)n_tok_max, 4);
    int32_t *qs = calloc((size_t)batch + 1, 4), *rows = calloc((size_t)batch, 4), *last = calloc((size_t)batch, 4);
    struct sample_row *samp = calloc((size_t)batch, sizeof *samp);
    for (int s = 0; s < batch; s++) {
        for (int j = 0; j < blocks_per_seq; j++) bt[s * blocks_per_seq + j] = s * blocks_per_seq + j;
        samp[s].top_p = 1.0f;
        samp[s].repetition_penalty = 1.0f;
    }
    uint64_t rng = 12345;
    int rc = 0;

    // Prefill, chunked by max_num_batched_tokens across the sequences in order.
    double t0 = time_now_s();
    int cur_seq = 0, cur_pos = 0;
    while (cur_seq < batch) {
        int n_tok = 0, n_seq = 0, n_rows = 0;
        qs[0] = 0;
        int first_seq = cur_seq;
        while (cur_seq < batch && n_tok < n_tok_max) {
            int take = prompt_len - cur_pos;
            if (take > n_tok_max - n_tok) take = n_tok_max - n_tok;
            for (int i = 0; i < take; i++, n_tok++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                tok[n_tok] = (int32_t)((rng >> 33) % (uint64_t)cfg->vocab_size);
                pos[n_tok] = cur_pos + i;
                int p = cur_pos + i;
                slot[n_tok] = bt[cur_seq * blocks_per_seq + p / bs] * bs + p % bs;
            }
            cur_pos += take;
            ctx[n_seq] = cur_pos;
            qs[++n_seq] = n_tok;
            if (cur_pos == prompt_len) {
                rows[n_rows++] = n_tok - 1;
                cur_seq++;
                cur_pos = 0;
            }
        }
        struct forward_batch fb = {.n_seqs = n_seq, .n_tokens = n_tok, .token_ids = tok, .positions = pos,
                                   .query_start = qs, .context_lens = ctx, .block_tables = bt + first_seq * blocks_per_seq,
                                   .max_blocks_per_seq = blocks_per_seq, .slot_mapping = slot, .n_logits = n_rows,
                                   .logits_rows = rows, .sampling = samp};
        // Rows asked for belong to the sequences that completed; their sampled ids become the
        // first decode tokens.
        struct runner_output out;
        if (model_runner_execute(r, &fb, &out, &err) != ATOMC_OK) {
            fprintf(stderr, "atomc bench-runner: prefill: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        for (int i = 0; i < n_rows; i++) last[cur_seq - n_rows + i] = out.ids[i];
    }
    double t_prefill = time_now_s() - t0;

    // Decode: every sequence one token per step.
    double t_decode = 0;
    double kv_bytes_read = 0;
    size_t kv_per_token = (size_t)cfg->num_layers * 2 * (size_t)cfg->num_kv_heads * (size_t)cfg->head_dim *
                          (size_t)model_runner_kv_dtype_bytes(r);
    for (int step = 0; step < warmup + steps; step++) {
        int p = prompt_len + step;
        for (int s = 0; s < batch; s++) {
            tok[s] = last[s];
            pos[s] = p;
            slot[s] = bt[s * blocks_per_seq + p / bs] * bs + p % bs;
            qs[s + 1] = s + 1;
            ctx[s] = p + 1;
            rows[s] = s;
        }
        qs[0] = 0;
        struct forward_batch fb = {.n_seqs = batch, .n_tokens = batch, .token_ids = tok, .positions = pos,
                                   .query_start = qs, .context_lens = ctx, .block_tables = bt,
                                   .max_blocks_per_seq = blocks_per_seq, .slot_mapping = slot, .n_logits = batch,
                                   .logits_rows = rows, .sampling = samp};
        struct runner_output out;
        double ts = time_now_s();
        if (model_runner_execute(r, &fb, &out, &err) != ATOMC_OK) {
            fprintf(stderr, "atomc bench-runner: decode: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        if (step >= warmup) {
            t_decode += time_now_s() - ts;
            kv_bytes_read += (double)batch * (p + 1) * (double)kv_per_token;
        }
        memcpy(last, out.ids, (size_t)batch * 4);
    }
    {
        // MoE: only the experts a step touches are read (moe.h), not every expert's weights.
        double wbytes = model_moe_decode_weight_bytes(cfg, (double)model_runner_weight_bytes(r), batch);
        double bytes = wbytes * steps + kv_bytes_read;
        double bw = bytes / t_decode / 1e9;
        double tps = (double)batch * steps / t_decode;
        if (json) {
            printf("{\"model\":\"%s\",\"device\":\"%s\",\"batch\":%d,\"prompt_len\":%d,\"decode_steps\":%d,"
                   "\"load_s\":%.3f,\"prefill_s\":%.4f,\"prefill_tok_s\":%.1f,\"decode_tok_s\":%.2f,"
                   "\"ms_per_step\":%.3f,\"weight_bytes\":%.0f,\"achieved_gb_s\":%.2f,\"peak_gb_s\":%.2f,"
                   "\"bw_ratio\":%.3f}\n",
                   o.model_path, o.device, batch, prompt_len, steps, t_load, t_prefill,
                   batch * prompt_len / t_prefill, tps, 1e3 * t_decode / steps, wbytes, bw, peak_bw,
                   peak_bw > 0 ? bw / peak_bw : 0);
        } else {
            printf("model %s (%s), device %s, batch %d, prompt %d, %d decode steps\n", o.model_path,
                   cfg->architecture, o.device, batch, prompt_len, steps);
            printf("load         %.2f s (weights %.1f MiB)\n", t_load, model_runner_weight_bytes(r) / 1048576.0);
            if (cfg->num_experts > 0)
                printf("moe          %.1f MiB of weights read per step (experts touched: min(E, batch * top_k))\n",
                       wbytes / 1048576.0);
            printf("prefill      %.3f s, %.1f tokens/s\n", t_prefill, batch * prompt_len / t_prefill);
            printf("decode       %.2f tokens/s, %.2f ms/step\n", tps, 1e3 * t_decode / steps);
            printf("bytes read   %.2f GB/s (weights + KV per step)", bw);
            if (peak_bw > 0) printf(", %.1f%% of %.1f GB/s", 100 * bw / peak_bw, peak_bw);
            printf("\n");
        }
    }
done:
    free(bt); free(ctx); free(tok); free(pos); free(slot); free(qs); free(rows); free(last); free(samp);
    model_runner_free(r);
    return rc;
}
