// atomc command-line entry point: dispatches to one subcommand per file in src/cli/.
// Only the CLI calls exit(); subcommands return the process status.
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"

static const struct cli_command commands[] = {
    {"generate", cmd_generate, "generate text for one prompt (streams it, or --json)"},
    {"chat", cmd_chat, "interactive multi-turn chat with a model"},
    {"serve", cmd_serve, "OpenAI-compatible HTTP server (vLLM's flags)"},
    {"proxy", cmd_proxy, "prefill/decode disaggregation front: prefill on one instance, decode on another"},
    {"bench", cmd_bench, "benchmarks: throughput, latency (offline engine), serve (HTTP client)"},
    {"eval", cmd_eval, "accuracy evaluations (perplexity)"},
    {"tokenize", cmd_tokenize, "text -> token ids with a model's tokenizer"},
    {"detokenize", cmd_detokenize, "token ids -> text with a model's tokenizer"},
    {"chat-template", cmd_chat_template, "render a conversation with a model's chat template"},
    {"inspect", cmd_inspect, "open and validate a model (HF dir or .gguf); print its config and tensors"},
    {"bench-runner", cmd_bench_runner, "time the model runner alone: prefill and decode tokens/s, bandwidth"},
    {"version", cmd_version, "print the version and build features"},
};

int main(int argc, char **argv) {
    for (int i = 2; i < argc; i++) // vLLM's short forms -tp N / -dp N (getopt has no two-letter short options)
        if (!strcmp(argv[i], "-tp")) argv[i] = "--tensor-parallel-size";
        else if (!strcmp(argv[i], "-dp")) argv[i] = "--data-parallel-size";
    return cli_dispatch(commands, sizeof commands / sizeof commands[0], "atomc", "command", argc, argv);
}
