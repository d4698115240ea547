// `atomc bench <kind>`: benchmark dispatcher. `throughput` (cmd_bench_throughput.c) runs the
// engine offline on random prompts, as vLLM's `vllm bench throughput`; `serve` is the HTTP
// serving benchmark client (cmd_bench_serve.c). New kinds add one row to the table below.
#include "cli/cli_common.h"
#include "cli/commands.h"

static const struct cli_command bench_kinds[] = {
    {"throughput", cmd_bench_throughput, "offline throughput of the engine on random prompts"},
    {"latency", cmd_bench_latency, "decode step latency by batch size, prefill latency by prompt length"},
    {"serve", cmd_bench_serve, "online serving benchmark against an OpenAI-compatible server"},
};

int cmd_bench(int argc, char **argv) {
    return cli_dispatch(bench_kinds, sizeof bench_kinds / sizeof bench_kinds[0], "atomc bench", "kind", argc, argv);
}
