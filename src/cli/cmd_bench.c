// `atomc bench <kind>`: benchmark dispatcher. `throughput` (cmd_bench_throughput.c) runs the
// engine offline on random prompts, as vLLM's `vllm bench throughput`; `serve` is the HTTP
// serving benchmark client (cmd_bench_serve.c). New kinds add one row to the table below.
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *help;
} bench_kinds[] = {
    {"throughput", cmd_bench_throughput, "offline throughput of the engine on random prompts"},
    {"latency", cmd_bench_latency, "decode step latency by batch size, prefill latency by prompt length"},
    {"serve", cmd_bench_serve, "online serving benchmark against an OpenAI-compatible server"},
};

static void bench_usage(FILE *f) {
    fprintf(f, "usage: atomc bench <kind> [options]   (atomc bench <kind> --help)\n\nkinds:\n");
    for (size_t i = 0; i < sizeof bench_kinds / sizeof bench_kinds[0]; i++)
        fprintf(f, "  %-12s %s\n", bench_kinds[i].name, bench_kinds[i].help);
}

int cmd_bench(int argc, char **argv) {
    if (argc < 2) {
        bench_usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        bench_usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof bench_kinds / sizeof bench_kinds[0]; i++)
        if (!strcmp(argv[1], bench_kinds[i].name)) return bench_kinds[i].run(argc - 1, argv + 1);
    fprintf(stderr, "atomc bench: unknown kind '%s'\n", argv[1]);
    bench_usage(stderr);
    return 2;
}

