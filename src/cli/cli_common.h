// Command-line helpers shared by the subcommands that create an engine (generate, chat,
// bench throughput): the engine flags (vLLM's names) and checked number parsing.
#ifndef ATOMC_CLI_CLI_COMMON_H
#define ATOMC_CLI_CLI_COMMON_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "atomc.h"

struct cli_engine_args {
    atomc_engine_options o;
    char spec_method[32]; // backs o.speculative_method
    char spec_model[4096]; // backs o.speculative_model when --speculative-config gives "model"
};

enum {
    CLI_E_MODEL = 2000,
    CLI_E_DEVICE,
    CLI_E_DTYPE,
    CLI_E_LOAD_FORMAT,
    CLI_E_KV_DTYPE,
    CLI_E_MAX_MODEL_LEN,
    CLI_E_MAX_NUM_SEQS,
    CLI_E_MAX_BATCHED,
    CLI_E_BLOCK_SIZE,
    CLI_E_NUM_KV_BLOCKS,
    CLI_E_GPU_UTIL,
    CLI_E_CPU_KV_GB,
    CLI_E_PREFIX_ON,
    CLI_E_PREFIX_OFF,
    CLI_E_EAGER,
    CLI_E_THREADS,
    CLI_E_CPU_EXACT,
    CLI_E_GEN_CONFIG,
    CLI_E_ENGINE_SEED,
    CLI_E_PROFILE_DIR,
    CLI_E_TP,
    CLI_E_SPEC_CONFIG,
    CLI_E_SPEC_METHOD,
    CLI_E_SPEC_NUM,
    CLI_E_SPEC_MODEL,
    CLI_E_QUANT,
    CLI_E_KV_TRANSFER,
    CLI_E_NO_HYBRID_KV,
};

#define CLI_ENGINE_LONG_OPTIONS                                                                                        \
    {"model", required_argument, 0, CLI_E_MODEL}, {"device", required_argument, 0, CLI_E_DEVICE},                      \
        {"dtype", required_argument, 0, CLI_E_DTYPE}, {"load-format", required_argument, 0, CLI_E_LOAD_FORMAT},        \
        {"kv-cache-dtype", required_argument, 0, CLI_E_KV_DTYPE},                                                      \
        {"max-model-len", required_argument, 0, CLI_E_MAX_MODEL_LEN},                                                  \
        {"max-num-seqs", required_argument, 0, CLI_E_MAX_NUM_SEQS},                                                    \
        {"max-num-batched-tokens", required_argument, 0, CLI_E_MAX_BATCHED},                                           \
        {"block-size", required_argument, 0, CLI_E_BLOCK_SIZE},                                                        \
        {"num-gpu-blocks-override", required_argument, 0, CLI_E_NUM_KV_BLOCKS},                                        \
        {"gpu-memory-utilization", required_argument, 0, CLI_E_GPU_UTIL},                                              \
        {"cpu-kv-cache-gb", required_argument, 0, CLI_E_CPU_KV_GB},                                                    \
        {"enable-prefix-caching", no_argument, 0, CLI_E_PREFIX_ON},                                                    \
        {"no-enable-prefix-caching", no_argument, 0, CLI_E_PREFIX_OFF},                                                \
        {"enforce-eager", no_argument, 0, CLI_E_EAGER}, {"num-threads", required_argument, 0, CLI_E_THREADS},          \
        {"disable-hybrid-kv-cache-manager", no_argument, 0, CLI_E_NO_HYBRID_KV},                                       \
        {"cpu-exact-kernels", no_argument, 0, CLI_E_CPU_EXACT},                                                        \
        {"generation-config", required_argument, 0, CLI_E_GEN_CONFIG},                                                 \
        {"engine-seed", required_argument, 0, CLI_E_ENGINE_SEED},                                                      \
        {"profile-dir", required_argument, 0, CLI_E_PROFILE_DIR},                                                      \
        {"tensor-parallel-size", required_argument, 0, CLI_E_TP},                                                      \
        {"speculative-config", required_argument, 0, CLI_E_SPEC_CONFIG},                                               \
        {"method", required_argument, 0, CLI_E_SPEC_METHOD}, {"quantization", required_argument, 0, CLI_E_QUANT},     \
        {"kv-transfer-config", required_argument, 0, CLI_E_KV_TRANSFER},                                               \
        {"speculative-model", required_argument, 0, CLI_E_SPEC_MODEL}, {                                               \
        "num-speculative-tokens", required_argument, 0, CLI_E_SPEC_NUM                                                 \
    }

#define CLI_ENGINE_OPTIONS_HELP                                                                                        \
    "engine options:\n"                                                                                                \
    "  --model PATH           HF model directory or .gguf file (required)\n"                                           \
    "  --device auto|cpu|cuda (default auto)  --dtype auto|bfloat16|float16|float32\n"                                 \
    "  --load-format auto|dummy   --kv-cache-dtype auto|bf16|fp8   --num-threads N (CPU)\n"                            \
    "  --cpu-exact-kernels    CPU: quantized weights through the bit-exact (slower) decode kernels\n"                    \
    "  --quantization none|fp8    fp8: online per-channel FP8 weights, per-token FP8 activations\n"                     \
    "  --max-model-len N   --max-num-seqs N   --max-num-batched-tokens N   --block-size N\n"                           \
    "  --gpu-memory-utilization F   --cpu-kv-cache-gb F   --num-gpu-blocks-override N\n"                               \
    "  --no-enable-prefix-caching   --enforce-eager   --generation-config auto|vllm   --engine-seed N\n"               \
    "  --disable-hybrid-kv-cache-manager   hybrid sliding / full models: one block table for all layers\n"             \
    "  --profile-dir DIR      record a per-step Chrome trace of the run into DIR\n"                                    \
    "  --tensor-parallel-size / -tp N   split the model over N ranks (CPU: threads; CUDA: GPUs)\n"                     \
    "  --speculative-config JSON   e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4,\n"                     \
    "                         \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4, \"disable_by_batch_size\": 8}'\n"    \
    "  --method ngram --num-speculative-tokens K   ATOM's spelling of the same (prompt lookup 5..5)\n"         \
    "  eagle3 (Llama targets): '{\"method\": \"eagle3\", \"model\": HEAD_DIR, \"num_speculative_tokens\": 3}'\n"  \
    "                         or --method eagle3 --speculative-model HEAD_DIR\n"                                    \
    "  --kv-transfer-config JSON   prefill/decode disaggregation, vLLM's JSON: '{\"kv_role\": \"kv_producer\",\n"     \
    "                         \"kv_connector\": \"tcp\", \"kv_ip\": \"127.0.0.1\", \"kv_port\": 14579}' (README)\n"

void cli_engine_args_init(struct cli_engine_args *a);
// A --model / --tokenizer argument: an existing path is returned as it is; a Hugging Face repo id
// ("ORG/NAME") becomes its snapshot in the local HF cache (src/loader/hf_cache.h; the environment
// is read here), written to buf. NULL (the error printed) when neither.
const char *cli_resolve_model_arg(const char *spec, char *buf, size_t buf_len);
// Handles one engine flag: 1 = handled, 0 = not an engine flag, -1 = bad value (message printed).
int cli_engine_parse_flag(struct cli_engine_args *a, int code, const char *arg);

// vLLM's --speculative-config JSON into o: method (copied into buf, which o then points to),
// model (the draft head's directory, copied into model_buf likewise), num_speculative_tokens,
// prompt_lookup_min / _max, disable_by_batch_size; other keys are refused by name (the engine
// checks the values' sense). Prints the problem and returns false.
bool cli_parse_speculative_config(atomc_engine_options *o, char *buf, size_t buf_len, char *model_buf,
                                  size_t model_buf_len, const char *json);

// With --profile-dir: start recording after the engine is created, and write the Chrome trace
// (path printed to stderr) when the command's work is done. No-ops without the flag.
bool cli_profile_start(atomc_engine *e, const struct cli_engine_args *a);
void cli_profile_stop(atomc_engine *e, const struct cli_engine_args *a);

// Whole-string parsers: print "atomc: FLAG expects ..." and return false on a bad value.
bool cli_parse_int(const char *s, const char *flag, long min, long max, int *out);
bool cli_parse_u64(const char *s, const char *flag, uint64_t *out);
bool cli_parse_float(const char *s, const char *flag, float *out);
bool cli_parse_double(const char *s, const char *flag, double *out);
bool isatty_stdin(void);
// All of f into a NUL-terminated malloc'd buffer (*len bytes); NULL on a read error or no memory.
char *cli_read_stream(FILE *f, size_t *len);
// Token ids separated by commas, whitespace or JSON brackets ("1,2,3", "[1, 2]"), each in
// [0, 2^31). Returns how many (*out malloc'd, caller frees) or -1 with a message printed.
int cli_parse_token_ids(const char *s, int32_t **out);

// One row of a subcommand table (`atomc <command>`, `atomc bench <kind>`).
struct cli_command {
    const char *name;
    int (*run)(int argc, char **argv); // argv[0] is the row's name
    const char *help;
};

// Runs the row argv[1] names. With no name or an unknown one it prints the table to stderr and
// returns 2; --help, -h or help print it to stdout and return 0. `prog` ("atomc bench") and
// `noun` ("kind") word the usage line.
int cli_dispatch(const struct cli_command *rows, size_t n_rows, const char *prog, const char *noun, int argc,
                 char **argv);

#endif
