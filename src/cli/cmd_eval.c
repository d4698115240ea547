// `atomc eval perplexity`: sliding-window perplexity of a text file, computed the way HF
// transformers documents it: windows of --ctx tokens moved by --stride; each window scores
// only the tokens the previous window did not score; the text's first token is never scored.
// Every window is one engine request asking for prompt logprobs (so the batched, paged path
// the server uses is what gets measured). The text is tokenized without special tokens.
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/mapped_file.h"
#include "common/timeutil.h"

struct window {
    int begin, end, first; // tokens [begin, end); score positions [first, end)
    double nll;
    bool done, failed;
    char error[256];
};

static void on_window_output(void *user, const atomc_output *out) {
    struct window *w = user;
    if (out->prompt_logprobs) {
        // Entry i is prompt token i + 1 of the window.
        for (int p = w->first; p < w->end; p++) {
            int i = p - w->begin - 1;
            if (i < 0 || i >= out->n_prompt_logprobs) {
                w->failed = true;
                snprintf(w->error, sizeof w->error, "prompt logprob %d missing", i);
                break;
            }
            w->nll -= out->prompt_logprobs[i].logprob;
        }
    }
    if (out->finish_reason == ATOMC_FINISH_ERROR) {
        w->failed = true;
        snprintf(w->error, sizeof w->error, "%s", out->error ? out->error : "error");
    }
    if (out->finish_reason != ATOMC_FINISH_NONE) w->done = true;
}

static void eval_usage(void) {
    printf("usage: atomc eval perplexity --model PATH --file TEXT [--ctx N] [--stride S] [--device auto|cpu|cuda]\n"
           "                             [--max-num-seqs N] [--max-num-batched-tokens N] [--quantization fp8] [--cpu-exact-kernels] [--json]\n"
           "  --ctx N      window length in tokens (default 512)\n"
           "  --stride S   window step (default ctx/2); tokens already scored are not scored again\n");
}

static int eval_perplexity(int argc, char **argv) {
    const char *model = NULL, *file = NULL, *device = "auto", *quantization = NULL;
    bool exact = false;
    int ctx = 512, stride = 0, max_num_seqs = 0, max_batched = 0;
    bool json = false;
    enum { O_MODEL = 1, O_FILE, O_CTX, O_STRIDE, O_DEVICE, O_SEQS, O_BATCHED, O_JSON, O_HELP, O_QUANT, O_EXACT };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"file", required_argument, 0, O_FILE},
        {"ctx", required_argument, 0, O_CTX}, {"stride", required_argument, 0, O_STRIDE},
        {"device", required_argument, 0, O_DEVICE}, {"max-num-seqs", required_argument, 0, O_SEQS},
        {"max-num-batched-tokens", required_argument, 0, O_BATCHED}, {"json", no_argument, 0, O_JSON},
        {"help", no_argument, 0, O_HELP}, {"quantization", required_argument, 0, O_QUANT},
        {"cpu-exact-kernels", no_argument, 0, O_EXACT}, {0, 0, 0, 0},
    };
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_MODEL: model = optarg; break;
        case O_FILE: file = optarg; break;
        case O_CTX:
            if (!cli_parse_int(optarg, "--ctx", 2, 1 << 30, &ctx)) return 2;
            break;
        case O_STRIDE:
            if (!cli_parse_int(optarg, "--stride", 1, 1 << 30, &stride)) return 2;
            break;
        case O_DEVICE: device = optarg; break;
        case O_QUANT: quantization = optarg; break;
        case O_EXACT: exact = true; break;
        case O_SEQS:
            if (!cli_parse_int(optarg, "--max-num-seqs", 1, 1 << 20, &max_num_seqs)) return 2;
            break;
        case O_BATCHED:
            if (!cli_parse_int(optarg, "--max-num-batched-tokens", 1, 1 << 30, &max_batched)) return 2;
            break;
        case O_JSON: json = true; break;
        case O_HELP: eval_usage(); return 0;
        default: fprintf(stderr, "atomc eval perplexity: bad option '%s'\n", argv[optind - 1]); return 2;
        }
    }
    if (!model || !file) {
        fprintf(stderr, "atomc eval perplexity: --model and --file are required\n");
        return 2;
    }
    if (stride <= 0) stride = ctx / 2;
    if (ctx < 2 || stride < 1 || stride > ctx) {
        fprintf(stderr, "atomc eval perplexity: need --ctx >= 2 and 1 <= --stride <= --ctx\n");
        return 2;
    }
    struct error err = {0};
    char *text = NULL;
    size_t text_len = 0;
    if (file_read_all(file, &text, &text_len, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc eval perplexity: %s\n", err.msg);
        return 1;
    }
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = model;
    o.device = device;
    o.quantization = quantization;
    o.cpu_exact_kernels = exact;
    o.max_num_seqs = max_num_seqs;
    o.max_num_batched_tokens = max_batched > 0 ? max_batched : (ctx > 2048 ? ctx : 2048);
    if (o.max_model_len == 0 || o.max_model_len < ctx + 1) o.max_model_len = ctx + 1;
    char msg[512];
    atomc_engine *e;
    double t_load = time_now_s();
    if (atomc_engine_create(&o, &e, msg, sizeof msg) != ATOMC_OK) {
        fprintf(stderr, "atomc eval perplexity: %s\n", msg);
        free(text);
        return 1;
    }
    t_load = time_now_s() - t_load;
    int32_t *ids = NULL;
    int n = 0;
    if (atomc_engine_tokenize(e, text, text_len, false, &ids, &n) != ATOMC_OK || n < 2) {
        fprintf(stderr, "atomc eval perplexity: %s: cannot tokenize (or fewer than 2 tokens)\n", file);
        atomc_free(ids);
        atomc_engine_free(e);
        free(text);
        return 1;
    }
    free(text);
    int n_win = 0, cap = n / stride + 2;
    struct window *w = calloc((size_t)cap, sizeof *w);
    for (int begin = 0, prev_end = 0; begin < n; begin += stride) {
        int end = begin + ctx < n ? begin + ctx : n;
        int first = prev_end > begin + 1 ? prev_end : begin + 1;
        w[n_win++] = (struct window){.begin = begin, .end = end, .first = first};
        prev_end = end;
        if (end == n) break;
    }
    double t0 = time_now_s();
    int rc = 0;
    for (int i = 0; i < n_win; i++) {
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = ids + w[i].begin;
        r.n_prompt_ids = w[i].end - w[i].begin;
        r.params.max_tokens = 1;
        r.params.temperature = 0;
        r.params.ignore_eos = true;
        r.params.prompt_logprobs = 0;
        r.on_output = on_window_output;
        r.user = &w[i];
        uint64_t id;
        if (atomc_engine_add_request(e, &r, &id, msg, sizeof msg) != ATOMC_OK) {
            fprintf(stderr, "atomc eval perplexity: window %d: %s\n", i, msg);
            rc = 1;
            w[i].done = w[i].failed = true;
        }
    }
    while (atomc_engine_has_work(e)) atomc_engine_step(e);
    double dt = time_now_s() - t0;
    double nll = 0;
    long scored = 0;
    for (int i = 0; i < n_win; i++) {
        if (!w[i].done || w[i].failed) {
            fprintf(stderr, "atomc eval perplexity: window %d failed: %s\n", i, w[i].error);
            rc = 1;
            continue;
        }
        nll += w[i].nll;
        scored += w[i].end - w[i].first;
    }
    if (rc == 0) {
        double ppl = exp(nll / (double)scored);
        if (json)
            printf("{\"perplexity\": %.6f, \"nll\": %.6f, \"n_tokens\": %d, \"n_scored\": %ld, \"windows\": %d, "
                   "\"ctx\": %d, \"stride\": %d, \"seconds\": %.3f, \"load_seconds\": %.3f}\n",
                   ppl, nll, n, scored, n_win, ctx, stride, dt, t_load);
        else
            printf("perplexity: %.4f  (%ld tokens scored of %d, %d windows of %d, stride %d, %.2f s, %.0f tok/s)\n",
                   ppl, scored, n, n_win, ctx, stride, dt, (double)(n_win > 0 ? w[n_win - 1].end : 0) / dt);
    }
    free(w);
    atomc_free(ids);
    atomc_engine_free(e);
    return rc;
}

int cmd_eval(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        eval_usage();
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "perplexity")) return eval_perplexity(argc - 1, argv + 1);
    fprintf(stderr, "atomc eval: unknown evaluation '%s' (perplexity)\n", argv[1]);
    return 2;
}
