// atomc command-line entry point: dispatches to one subcommand per file in src/cli/.
// Only the CLI calls exit(); subcommands return the process status.
#include <stdio.h>
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

#define MAX_RESOLVED 4

int main(int argc, char **argv) {
    for (int i = 2; i < argc; i++) // vLLM's short forms -tp N / -dp N (getopt has no two-letter short options)
        if (!strcmp(argv[i], "-tp")) argv[i] = "--tensor-parallel-size";
        else if (!strcmp(argv[i], "-dp")) argv[i] = "--data-parallel-size";
    // Hugging Face repo ids (`--model Qwen/Qwen3-0.6B`, `--tokenizer ...`, an EAGLE-3 head's
    // `--speculative-model ...`) become cache snapshot paths here for every command but serve,
    // which resolves its own (it also names the served model after the id). `bench serve --model`
    // is the name sent to a server, not a path: only its --tokenizer is resolved.
    char resolved[MAX_RESOLVED][4096];
    int n_resolved = 0;
    bool serve = argc > 1 && !strcmp(argv[1], "serve");
    bool bench_serve = argc > 2 && !strcmp(argv[1], "bench") && !strcmp(argv[2], "serve");
    for (int i = 2; i < argc && !serve; i++) {
        const char *flags[] = {"--model", "--tokenizer", "--speculative-model"}; // the last: an EAGLE-3 head
        for (int f = bench_serve ? 1 : 0; f < 3; f++) {
            size_t fl = strlen(flags[f]);
            char *val = NULL;
            if (!strcmp(argv[i], flags[f]) && i + 1 < argc) val = argv[++i];
            else if (!strncmp(argv[i], flags[f], fl) && argv[i][fl] == '=') val = argv[i] + fl + 1;
            if (!val || n_resolved == MAX_RESOLVED) continue;
            char path[4000];
            const char *p = cli_resolve_model_arg(val, path, sizeof path);
            if (!p) return 1;
            if (p != val) {
                if (val == argv[i]) snprintf(resolved[n_resolved], sizeof resolved[0], "%s", p);
                else snprintf(resolved[n_resolved], sizeof resolved[0], "%s=%s", flags[f], p);
                argv[i] = resolved[n_resolved++];
            }
            break;
        }
    }
    return cli_dispatch(commands, sizeof commands / sizeof commands[0], "atomc", "command", argc, argv);
}
