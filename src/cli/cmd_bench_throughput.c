// `atomc bench throughput`: offline engine throughput on random prompts (vLLM's flags and
// output wording). Dispatched from cmd_bench.c.
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/check.h"
#include "common/timeutil.h"

// --- throughput ----------------------------------------------------------------------------------

static void throughput_usage(FILE *f) {
    fprintf(f,
            "usage: atomc bench throughput --model PATH [--num-prompts N] [--input-len I] [--output-len O] [options]\n"
            "  Random prompts of I token ids (vLLM's random dataset), O output tokens each (ignore_eos),\n"
            "  all submitted at once;\n"
            "  reports requests/s and input/output/total tokens/s.\n"
            "  --num-prompts N (default 1000)  --input-len I (default 1024)  --output-len O (default 128)\n"
            "  --prefix-len P (first P tokens shared by all prompts, default 0)\n"
            "  --seed S (prompt generator, default 0)  --output-json FILE\n"
            "  --moe-uniform-routing (MoE models: balanced round-robin routing, benchmark only)\n"
            "  An offline run: --max-num-batched-tokens defaults to 16384 on CUDA, as for vLLM's offline\n"
            "  engines on H100 / H200-class GPUs (the server's default stays 8192).\n"
            "%s",
            CLI_ENGINE_OPTIONS_HELP);
}

struct tp_state {
    int done;
    uint64_t output_tokens;
    int errors;
    char first_error[256];
};

static void tp_on_output(void *user, const atomc_output *o) {
    struct tp_state *s = user;
    s->output_tokens += (uint64_t)o->n_new_tokens;
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        s->done++;
        if (o->finish_reason == ATOMC_FINISH_ERROR && s->errors++ == 0)
            snprintf(s->first_error, sizeof s->first_error, "%s", o->error ? o->error : "error");
    }
}

static uint64_t tp_rng(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

int cmd_bench_throughput(int argc, char **argv) {
    enum { T_NUM = 1000, T_IN, T_OUT, T_PREFIX, T_SEED, T_JSON, T_UNIFORM, T_HELP };
    static const struct option opts[] = {{"num-prompts", required_argument, 0, T_NUM},
                                         {"input-len", required_argument, 0, T_IN},
                                         {"output-len", required_argument, 0, T_OUT},
                                         {"prefix-len", required_argument, 0, T_PREFIX},
                                         {"seed", required_argument, 0, T_SEED},
                                         {"output-json", required_argument, 0, T_JSON},
                                         {"moe-uniform-routing", no_argument, 0, T_UNIFORM},
                                         {"help", no_argument, 0, T_HELP},
                                         CLI_ENGINE_LONG_OPTIONS,
                                         {0, 0, 0, 0}};
    struct cli_engine_args ea;
    cli_engine_args_init(&ea);
    int num = 1000, in_len = 1024, out_len = 128, prefix_len = 0, seed = 0;
    const char *json_path = NULL;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case T_NUM: ok = cli_parse_int(optarg, "--num-prompts", 1, 10000000, &num); break;
        case T_IN: ok = cli_parse_int(optarg, "--input-len", 1, 1 << 24, &in_len); break;
        case T_OUT: ok = cli_parse_int(optarg, "--output-len", 1, 1 << 24, &out_len); break;
        case T_PREFIX: ok = cli_parse_int(optarg, "--prefix-len", 0, 1 << 24, &prefix_len); break;
        case T_SEED: ok = cli_parse_int(optarg, "--seed", 0, 1 << 30, &seed); break;
        case T_JSON: json_path = optarg; break;
        case T_UNIFORM: ea.o.moe_uniform_routing = true; break;
        case T_HELP: throughput_usage(stdout); return 0;
        case '?': ok = false; break;
        default: ok = cli_engine_parse_flag(&ea, c, optarg) > 0;
        }
        if (!ok) {
            throughput_usage(stderr);
            return 2;
        }
    }
    if (optind < argc || !ea.o.model_path) {
        fprintf(stderr, optind < argc ? "atomc bench throughput: unexpected argument '%s'\n"
                                      : "atomc bench throughput: --model is required%s\n",
                optind < argc ? argv[optind] : "");
        return 2;
    }
    if (prefix_len > in_len) {
        fprintf(stderr, "atomc bench throughput: --prefix-len %d exceeds --input-len %d\n", prefix_len, in_len);
        return 2;
    }
    if (ea.o.max_model_len == 0) ea.o.max_model_len = in_len + out_len;
    ea.o.offline = true;
    atomc_engine *e;
    char err[1024];
    if (atomc_engine_create(&ea.o, &e, err, sizeof err) != ATOMC_OK) {
        fprintf(stderr, "atomc bench throughput: %s\n", err);
        return 1;
    }
    atomc_model_info info;
    atomc_engine_get_model_info(e, &info);
    if (in_len + out_len > info.max_model_len) {
        fprintf(stderr, "atomc bench throughput: input-len + output-len = %d exceeds max_model_len %d\n",
                in_len + out_len, info.max_model_len);
        atomc_engine_free(e);
        return 2;
    }
    // Prompts: uniform random ids (as vLLM's random dataset), made before the clock starts.
    int32_t *ids = malloc((size_t)num * in_len * sizeof *ids);
    if (!ids) {
        fprintf(stderr, "atomc bench throughput: out of memory for %d x %d prompt ids\n", num, in_len);
        atomc_engine_free(e);
        return 1;
    }
    uint64_t rs = 0x9e3779b97f4a7c15ull ^ (uint64_t)seed;
    for (size_t i = 0; i < (size_t)num * in_len; i++) ids[i] = (int32_t)(tp_rng(&rs) % (uint64_t)info.vocab_size);
    for (int i = 1; i < num; i++) // a common prefix (prefix caching): the first prompt's first tokens
        memcpy(ids + (size_t)i * in_len, ids, (size_t)prefix_len * sizeof *ids);

    struct tp_state st;
    memset(&st, 0, sizeof st);
    if (!cli_profile_start(e, &ea)) {
        free(ids);
        atomc_engine_free(e);
        return 1;
    }
    double t0 = time_now_s();
    int rc = 0;
    for (int i = 0; i < num; i++) {
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = ids + (size_t)i * in_len;
        r.n_prompt_ids = in_len;
        r.params.max_tokens = out_len;
        r.params.ignore_eos = true;
        r.params.temperature = 1.0f;
        r.params.top_p = 1.0f;
        r.on_output = tp_on_output;
        r.user = &st;
        if (atomc_engine_add_request(e, &r, NULL, err, sizeof err) != ATOMC_OK) {
            fprintf(stderr, "atomc bench throughput: request %d: %s\n", i, err);
            rc = 1;
            break;
        }
    }
    while (!rc && st.done < num) atomc_engine_step(e);
    double elapsed = time_now_s() - t0;
    cli_profile_stop(e, &ea);
    if (!rc && st.errors) {
        fprintf(stderr, "atomc bench throughput: %d requests failed: %s\n", st.errors, st.first_error);
        rc = 1;
    }
    if (!rc) {
        atomc_stats s;
        atomc_engine_get_stats(e, &s);
        uint64_t in_tok = (uint64_t)num * in_len, total = in_tok + st.output_tokens;
        printf("Throughput: %.2f requests/s, %.2f total tokens/s, %.2f output tokens/s\n", num / elapsed,
               total / elapsed, st.output_tokens / elapsed);
        printf("Input tokens/s: %.2f\n", in_tok / elapsed);
        printf("Total num prompt tokens:  %llu\n", (unsigned long long)in_tok);
        printf("Total num output tokens:  %llu\n", (unsigned long long)st.output_tokens);
        printf("Elapsed: %.3f s, %llu engine steps, %llu preemptions, prefix cache hit rate %.2f%%\n", elapsed,
               (unsigned long long)s.num_steps, (unsigned long long)s.num_preemptions,
               s.prefix_cache_queries ? 100.0 * s.prefix_cache_hits / s.prefix_cache_queries : 0.0);
        if (json_path) {
            json_t *j = json_pack("{s:f,s:i,s:I,s:I,s:I,s:f,s:f,s:f}", "elapsed_time", elapsed, "num_requests", num,
                                  "total_num_tokens", (json_int_t)total, "total_num_prompt_tokens", (json_int_t)in_tok,
                                  "total_num_output_tokens", (json_int_t)st.output_tokens, "requests_per_second",
                                  num / elapsed, "tokens_per_second", total / elapsed, "output_tokens_per_second",
                                  st.output_tokens / elapsed);
            if (!j || json_dump_file(j, json_path, JSON_INDENT(2)) != 0) {
                fprintf(stderr, "atomc bench throughput: cannot write %s\n", json_path);
                rc = 1;
            }
            json_decref(j);
        }
    }
    free(ids);
    atomc_engine_free(e);
    return rc;
}
