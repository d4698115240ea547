// `atomc serve`: the OpenAI-compatible HTTP server (flag names follow vLLM's `vllm serve`).
//
// The socket is bound first, so /health answers 503 while the model loads on a separate
// thread; once loaded the engine loop starts and the server begins serving. SIGTERM/SIGINT
// stop accepting, drain in-flight requests (bounded by --shutdown-timeout) and exit 0.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/log.h"
#include "kv_transfer/kv_connector.h"
#include "parallel/dp_router.h"
#include "parallel/dp_serve.h"
#include "server/engine_adapter.h"
#include "server/server.h"

struct serve_args {
    atomc_engine_options eo;
    struct server_options so;
    const char *model;
    const char *chat_template;
    const char *api_key;
    int data_parallel_size;
    bool enable_auto_tool_choice;
    const char *tool_call_parser;
    const char *reasoning_parser;
    const char *speculative_config;
    char spec_method[32];
    char spec_model[4096];
};

enum flag_kind { FLAG_STR, FLAG_INT, FLAG_DOUBLE, FLAG_SIZE, FLAG_BOOL_ON, FLAG_BOOL_OFF, FLAG_NAMES };

struct flag {
    const char *name;
    enum flag_kind kind;
    size_t offset; // into struct serve_args
    const char *def;
    const char *help;
};

#define A(f) offsetof(struct serve_args, f)
static const struct flag flags[] = {
    {"--model", FLAG_STR, A(model), "", "required: a .gguf file or a Hugging Face model directory (also positional)"},
    {"--host", FLAG_STR, A(so.host), "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)"},
    {"--port", FLAG_INT, A(so.port), "8000", "TCP port"},
    {"--served-model-name", FLAG_NAMES, A(so.model_names), "basename of --model (the id itself for a Hugging Face id)",
     "name(s) clients use in \"model\"; the first is reported in responses and metrics"},
    {"--api-key", FLAG_STR, A(api_key), "$VLLM_API_KEY or $ATOMC_API_KEY",
     "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /apply-template"},
    {"--chat-template", FLAG_STR, A(chat_template), "the model's",
     "chat template: a file path or the Jinja text itself"},
    {"--no-webui", FLAG_BOOL_OFF, A(so.webui), "", "do not serve the built-in chat page at GET / (on by default)"},
    {"--enable-auto-tool-choice", FLAG_BOOL_ON, A(enable_auto_tool_choice), "off",
     "parse chat output of requests with tools for tool calls (needs --tool-call-parser)"},
    {"--tool-call-parser", FLAG_STR, A(tool_call_parser), "none",
     "tool-call format (vLLM's names): hermes (Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), mistral, "
     "pythonic (Llama 3.2 / 4), deepseek_v3 (DeepSeek-V3 / R1 / V3.1), kimi_k2, qwen3_coder (XML style), glm45 "
     "(GLM-4.5 - 4.7), openai (GPT-OSS harmony)"},
    {"--reasoning-parser", FLAG_STR, A(reasoning_parser), "none",
     "split chat output into reasoning_content and content: deepseek_r1, qwen3, glm45 (<think>...</think>) "
     "or openai_gptoss (GPT-OSS harmony analysis channel)"},
    {"--max-model-len", FLAG_INT, A(eo.max_model_len), "the model's", "context length (prompt + completion) in tokens"},
    {"--max-num-seqs", FLAG_INT, A(eo.max_num_seqs), "256 (cuda), 16 (cpu)", "sequences per engine step"},
    {"--max-num-batched-tokens", FLAG_INT, A(eo.max_num_batched_tokens), "8192 (cuda), 2048 (cpu)",
     "tokens per engine step (longer prompts are prefilled in chunks)"},
    {"--long-prefill-token-threshold", FLAG_INT, A(eo.long_prefill_token_threshold), "512 (cpu), 0 (cuda)",
     "most tokens of one prompt's prefill chunk per step, so requests arriving under a long prompt are admitted "
     "and decode between its chunks (0 = no cap)"},
    {"--max-waiting-requests", FLAG_INT, A(eo.max_waiting), "4096",
     "bounded waiting queue: requests past it get 503 (0 = unbounded)"},
    {"--block-size", FLAG_INT, A(eo.block_size), "16", "KV-cache block size in tokens"},
    {"--num-kv-blocks", FLAG_INT, A(eo.num_kv_blocks), "0 (auto)", "KV-cache blocks (overrides sizing by memory)"},
    {"--gpu-memory-utilization", FLAG_DOUBLE, A(eo.gpu_memory_utilization), "0.9",
     "fraction of GPU memory for weights + KV cache"},
    {"--kv-cache-memory-bytes", FLAG_SIZE, A(eo.cpu_kv_cache_bytes), "--max-num-seqs x --max-model-len tokens, at most max(--max-model-len, 8192)",
     "CPU backend KV-cache size in bytes (suffixes K, M, G)"},
    {"--kv-cache-dtype", FLAG_STR, A(eo.kv_cache_dtype), "auto", "auto, bf16 or fp8"},
    {"--enable-prefix-caching", FLAG_BOOL_ON, A(eo.enable_prefix_caching), "on", "reuse KV blocks of shared prefixes"},
    {"--no-enable-prefix-caching", FLAG_BOOL_OFF, A(eo.enable_prefix_caching), "", "disable prefix caching"},
    {"--disable-hybrid-kv-cache-manager", FLAG_BOOL_ON, A(eo.disable_hybrid_kv_cache_manager), "off",
     "hybrid sliding / full models: one block table for every layer (no freeing of out-of-window blocks)"},
    {"--generation-config", FLAG_STR, A(eo.generation_config), "auto",
     "auto: apply the model's generation_config.json (EOS ids); vllm: ignore it"},
    {"--enforce-eager", FLAG_BOOL_ON, A(eo.enforce_eager), "off", "CUDA: do not capture decode graphs"},
    {"--dtype", FLAG_STR, A(eo.dtype), "auto", "auto, bfloat16, float16 or float32"},
    {"--seed", FLAG_SIZE, A(eo.seed), "0", "default sampling seed for requests without one"},
    {"--device", FLAG_STR, A(eo.device), "auto", "auto (CUDA when a usable GPU is present), cpu or cuda"},
    {"--load-format", FLAG_STR, A(eo.load_format), "auto", "auto, or dummy (random weights from config.json)"},
    {"--quantization", FLAG_STR, A(eo.quantization), "none",
     "none, or fp8: online per-channel FP8 weights with dynamic per-token FP8 activations"},
    {"--tensor-parallel-size", FLAG_INT, A(eo.tensor_parallel_size), "1",
     "ranks per model, tensor parallel (CPU: threads; CUDA: one GPU each; alias -tp)"},
    {"--data-parallel-size", FLAG_INT, A(data_parallel_size), "1",
     "engine replicas behind this server, each request to the least loaded (CPU; alias -dp)"},
    {"--num-threads", FLAG_INT, A(eo.num_threads), "0 (all cores)", "CPU backend threads"},
    {"--grammar-threads", FLAG_INT, A(eo.grammar_threads), "0 (auto)",
     "structured output: threads filling a step's grammar masks (auto: cores - CPU backend threads, CUDA: cores - 1)"},
    {"--cpu-exact-kernels", FLAG_BOOL_ON, A(eo.cpu_exact_kernels), "off",
     "CPU: quantized weights through the bit-exact dequantise-in-registers decode kernels"},
    {"--profile-dir", FLAG_STR, A(eo.profile_dir), "off",
     "enable POST /start_profile and /stop_profile: per-step Chrome traces written here"},
    {"--speculative-config", FLAG_STR, A(speculative_config), "off",
     "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
     "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}'"},
    {"--method", FLAG_STR, A(eo.speculative_method), "off",
     "speculative method (ATOM's flag): ngram, mtp or eagle3"},
    {"--speculative-model", FLAG_STR, A(eo.speculative_model), "off",
     "method eagle3: the EAGLE-3 head's directory (vLLM's \"model\" in --speculative-config)"},
    {"--num-speculative-tokens", FLAG_INT, A(eo.num_speculative_tokens), "0",
     "draft tokens verified per step (ATOM's flag)"},
    {"--kv-transfer-config", FLAG_STR, A(eo.kv_transfer_config), "off",
     "prefill/decode disaggregation, vLLM's JSON: '{\"kv_role\": \"kv_producer\"|\"kv_consumer\", "
     "\"kv_connector\": \"tcp\"|\"cuda_ipc\", \"kv_ip\": \"127.0.0.1\", \"kv_port\": 14579}' (README: P/D)"},
    {"--max-n", FLAG_INT, A(so.max_n), "64", "largest accepted n (choices per request)"},
    {"--max-request-body-bytes", FLAG_SIZE, A(so.max_body_bytes), "32 MiB", "larger request bodies get 413"},
    {"--max-connections", FLAG_INT, A(so.max_connections), "descriptor limit less 1/8 (at least 64)",
     "open connections at most; past it the oldest one without a request in progress is closed"},
    {"--timeout-keep-alive", FLAG_DOUBLE, A(so.timeout_keep_alive_s), "5",
     "seconds a connection without a request in progress may stay silent"},
    {"--timeout-request-read", FLAG_DOUBLE, A(so.request_read_timeout_s), "60",
     "seconds a request (headers and body) may take to arrive after its first byte"},
    {"--shutdown-timeout", FLAG_DOUBLE, A(so.drain_timeout_s), "30",
     "seconds SIGTERM waits for in-flight requests before aborting them"},
};
#undef A

static void serve_usage(FILE *f) {
    fprintf(f, "usage: atomc serve [--model] PATH [options]\n\n"
               "OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,\n"
               "/tokenize, /detokenize, /apply-template, /openapi.json. Log level: ATOMC_LOG=error|warn|info|debug.\n\n"
               "options:\n");
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        const struct flag *fl = &flags[i];
        const char *arg = fl->kind == FLAG_BOOL_ON || fl->kind == FLAG_BOOL_OFF ? ""
                          : fl->kind == FLAG_NAMES                             ? " NAME [NAME...]"
                          : fl->kind == FLAG_STR                               ? " STR"
                                                                               : " N";
        char left[64];
        snprintf(left, sizeof left, "%s%s", fl->name, arg);
        fprintf(f, "  %-36s %s", left, fl->help);
        if (fl->def[0]) fprintf(f, " (default: %s)", fl->def);
        fputc('\n', f);
    }
    fprintf(f, "  %-36s %s\n", "-h, --help", "show this help");
}

static int parse_size(const char *s, unsigned long long *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || v < 0) return -1;
    double mul = 1;
    if (*end == 'k' || *end == 'K') mul = 1024, end++;
    else if (*end == 'm' || *end == 'M') mul = 1024.0 * 1024, end++;
    else if (*end == 'g' || *end == 'G') mul = 1024.0 * 1024 * 1024, end++;
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return -1;
    *out = (unsigned long long)(v * mul);
    return 0;
}

// Returns 0, 1 (--help printed) or 2 (usage error).
static int serve_parse(int argc, char **argv, struct serve_args *a) {
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
            serve_usage(stdout);
            return 1;
        }
        if (arg[0] != '-') {
            if (a->model) {
                fprintf(stderr, "atomc serve: unexpected argument '%s'\n", arg);
                return 2;
            }
            a->model = arg;
            continue;
        }
        char name[64];
        const char *val = NULL;
        const char *eq = strchr(arg, '=');
        snprintf(name, sizeof name, "%.*s", eq ? (int)(eq - arg) : (int)strlen(arg), arg);
        if (eq) val = eq + 1;
        const struct flag *fl = NULL;
        for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++)
            if (!strcmp(name, flags[k].name)) fl = &flags[k];
        if (!fl) {
            fprintf(stderr, "atomc serve: unknown option '%s' (see --help)\n", name);
            return 2;
        }
        char *base = (char *)a + fl->offset;
        if (fl->kind == FLAG_BOOL_ON || fl->kind == FLAG_BOOL_OFF) {
            *(bool *)base = fl->kind == FLAG_BOOL_ON;
            continue;
        }
        if (fl->kind == FLAG_NAMES) {
            if (val) {
                if (a->so.n_model_names < SERVER_MAX_MODEL_NAMES) a->so.model_names[a->so.n_model_names++] = val;
            }
            while (i + 1 < argc && argv[i + 1][0] != '-') {
                if (a->so.n_model_names >= SERVER_MAX_MODEL_NAMES) {
                    fprintf(stderr, "atomc serve: at most %d served model names\n", SERVER_MAX_MODEL_NAMES);
                    return 2;
                }
                a->so.model_names[a->so.n_model_names++] = argv[++i];
            }
            if (a->so.n_model_names == 0) {
                fprintf(stderr, "atomc serve: %s needs a value\n", name);
                return 2;
            }
            continue;
        }
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "atomc serve: %s needs a value\n", name);
                return 2;
            }
            val = argv[++i];
        }
        char *end = NULL;
        switch (fl->kind) {
        case FLAG_STR: *(const char **)base = val; break;
        case FLAG_INT: {
            long v = strtol(val, &end, 10);
            if (!*val || *end || v < 0 || v > 1L << 30) {
                fprintf(stderr, "atomc serve: %s expects a non-negative integer, got '%s'\n", name, val);
                return 2;
            }
            *(int *)base = (int)v;
            break;
        }
        case FLAG_DOUBLE: {
            double v = strtod(val, &end);
            if (!*val || *end || !(v >= 0)) {
                fprintf(stderr, "atomc serve: %s expects a non-negative number, got '%s'\n", name, val);
                return 2;
            }
            *(double *)base = v;
            break;
        }
        case FLAG_SIZE: {
            unsigned long long v;
            if (parse_size(val, &v)) {
                fprintf(stderr, "atomc serve: %s expects a size such as 4096, 512M or 2G, got '%s'\n", name, val);
                return 2;
            }
            if (fl->offset == offsetof(struct serve_args, eo.seed)) a->eo.seed = v;
            else *(size_t *)base = (size_t)v;
            break;
        }
        default: break;
        }
    }
    if (!a->model) {
        fprintf(stderr, "atomc serve: --model is required\n");
        serve_usage(stderr);
        return 2;
    }
    return 0;
}

struct loader {
    struct serve_args *args;
    struct server *srv;
    atomc_engine *engine;
    struct engine_adapter *adapter;
    struct dp_router *router; // --data-parallel-size > 1: owns the replicas (engine = replica 0)
    struct dp_serve *dp;
    bool failed;
    pthread_t thread;
};

static void *load_model(void *arg) {
    struct loader *l = arg;
    struct serve_args *a = l->args;
    char err[1024] = "";
    LOG_INFO("loading %s", a->model);
    atomc_status st;
    if (a->data_parallel_size != 1) { // the router rejects sizes < 1
        st = dp_router_create(&a->eo, a->data_parallel_size, &l->router, err, sizeof err);
        if (st == ATOMC_OK) l->engine = dp_router_replica(l->router, 0);
    } else {
        st = atomc_engine_create(&a->eo, &l->engine, err, sizeof err);
    }
    if (st == ATOMC_OK) {
        struct error e;
        error_clear(&e);
        struct server_engine se;
        st = engine_adapter_create(l->engine, a->model, a->chat_template, &l->adapter, &se, &e);
        if (st != ATOMC_OK) snprintf(err, sizeof err, "%s", e.msg);
        else if (l->router) {
            struct server_engine inner = se;
            l->dp = dp_serve_wrap(l->router, &inner, &se);
            st = dp_router_start(l->router);
        } else {
            st = atomc_engine_start(l->engine);
        }
        if (st == ATOMC_OK) {
            server_attach_engine(l->srv, &se);
            const char *host = strcmp(a->so.host, "0.0.0.0") ? a->so.host : "127.0.0.1";
            fprintf(stderr,
                    "\natomc is serving '%s' at http://%s:%d/v1 - try:\n"
                    "  curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json'%s \\\n"
                    "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
                    "\"max_tokens\": 64}'\n\n",
                    a->so.model_names[0], host, server_port(l->srv), host, server_port(l->srv),
                    a->api_key ? " -H \"Authorization: Bearer $API_KEY\"" : "", a->so.model_names[0]);
            return NULL;
        }
    }
    LOG_ERROR("failed to load %s: %s (%s)", a->model, err, atomc_status_name(st));
    l->failed = true;
    server_mark_failed(l->srv, err);
    server_shutdown(l->srv);
    return NULL;
}

int cmd_serve(int argc, char **argv) {
    struct serve_args a;
    memset(&a, 0, sizeof a);
    atomc_engine_options_init(&a.eo);
    a.eo.device = "auto"; // the CLI's default, as for every other command (src/backend/backend.c)
    if (a.eo.max_waiting == 0) a.eo.max_waiting = 4096;
    a.data_parallel_size = 1;
    server_options_init(&a.so);
    int rc = serve_parse(argc, argv, &a);
    if (rc) return rc == 1 ? 0 : 2;
    if (a.speculative_config &&
        !cli_parse_speculative_config(&a.eo, a.spec_method, sizeof a.spec_method, a.spec_model, sizeof a.spec_model,
                                      a.speculative_config))
        return 2;
    if (a.eo.kv_transfer_config) {
        struct kv_transfer_config kc;
        struct error e = {0};
        if (kv_transfer_config_parse(a.eo.kv_transfer_config, &kc, &e) != ATOMC_OK) {
            fprintf(stderr, "atomc serve: %s\n", e.msg);
            return 2;
        }
        if (a.data_parallel_size > 1) {
            fprintf(stderr, "atomc serve: --kv-transfer-config with --data-parallel-size > 1 is not implemented "
                            "(run one server per replica)\n");
            return 2;
        }
    }
    if (a.tool_call_parser && tool_parser_from_name(a.tool_call_parser) == TOOL_PARSER_NONE) {
        fprintf(stderr, "atomc serve: unknown --tool-call-parser '%s' (supported: %s)\n", a.tool_call_parser,
                tool_parser_names());
        return 2;
    }
    if (a.enable_auto_tool_choice && !a.tool_call_parser) {
        fprintf(stderr, "atomc serve: --enable-auto-tool-choice needs --tool-call-parser (supported: %s)\n",
                tool_parser_names());
        return 2;
    }
    if (a.reasoning_parser && reasoning_parser_from_name(a.reasoning_parser) == REASONING_PARSER_NONE) {
        fprintf(stderr, "atomc serve: unknown --reasoning-parser '%s' (supported: %s)\n", a.reasoning_parser,
                reasoning_parser_names());
        return 2;
    }
    a.so.reasoning_parser = reasoning_parser_from_name(a.reasoning_parser);
    a.so.profiling = a.eo.profile_dir && *a.eo.profile_dir;
    a.so.tool_parser = a.enable_auto_tool_choice ? tool_parser_from_name(a.tool_call_parser) : TOOL_PARSER_NONE;
    char model_path[4096];
    const char *resolved = cli_resolve_model_arg(a.model, model_path, sizeof model_path);
    if (!resolved) return 1;
    bool from_hf_cache = resolved != a.model;
    a.eo.model_path = resolved;
    char head_path[4096]; // --speculative-model ORG/NAME (the JSON's "model" is resolved as it is parsed)
    if (a.eo.speculative_model && a.eo.speculative_model != a.spec_model &&
        !(a.eo.speculative_model = cli_resolve_model_arg(a.eo.speculative_model, head_path, sizeof head_path)))
        return 1;
    if (!a.api_key) a.api_key = getenv("VLLM_API_KEY");
    if (!a.api_key) a.api_key = getenv("ATOMC_API_KEY");
    a.so.api_key = a.api_key;
    char base_name[256];
    if (a.so.n_model_names == 0 && from_hf_cache) {
        a.so.model_names[a.so.n_model_names++] = a.model; // vLLM serves "ORG/NAME" under that id
    } else if (a.so.n_model_names == 0) {
        const char *slash = strrchr(a.model, '/');
        const char *b = slash && slash[1] ? slash + 1 : a.model;
        snprintf(base_name, sizeof base_name, "%s", b);
        size_t n = strlen(base_name);
        while (n > 1 && base_name[n - 1] == '/') base_name[--n] = '\0';
        a.so.model_names[a.so.n_model_names++] = base_name;
    }
    a.model = resolved; // the path from here on (loading, the adapter's tokenizer and template)

    struct error err;
    error_clear(&err);
    struct server *srv;
    if (server_create(&a.so, &srv, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc serve: %s\n", err.msg);
        return 1;
    }
    LOG_INFO("listening on http://%s:%d (/health is 503 until the model is loaded)", a.so.host, server_port(srv));
    struct loader l = {.args = &a, .srv = srv};
    pthread_create(&l.thread, NULL, load_model, &l);
    server_run(srv);
    pthread_join(l.thread, NULL);
    // Stop the engine first: its final callbacks (aborts) still reach the server's queues.
    if (l.router) dp_router_free(l.router); // owns l.engine (replica 0)
    else if (l.engine) atomc_engine_free(l.engine);
    server_free(srv);
    engine_adapter_free(l.adapter);
    dp_serve_free(l.dp);
    LOG_INFO("server stopped");
    return l.failed ? 1 : 0;
}
