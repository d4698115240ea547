#include "cli/cli_common.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "loader/hf_cache.h"
#include "kv_transfer/kv_connector.h"

bool cli_parse_int(const char *s, const char *flag, long min, long max, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < min || v > max) {
        fprintf(stderr, "atomc: %s expects an integer in [%ld, %ld], got '%s'\n", flag, min, max, s);
        return false;
    }
    *out = (int)v;
    return true;
}

bool cli_parse_u64(const char *s, const char *flag, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    // strtoull accepts a sign and wraps "-1" to the maximum: only plain digits are taken.
    if (!*s || *s == '-' || *s == '+' || *end || errno) {
        fprintf(stderr, "atomc: %s expects a non-negative integer, got '%s'\n", flag, s);
        return false;
    }
    *out = v;
    return true;
}

bool cli_parse_double(const char *s, const char *flag, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !isfinite(v)) {
        fprintf(stderr, "atomc: %s expects a number, got '%s'\n", flag, s);
        return false;
    }
    *out = v;
    return true;
}

bool cli_parse_float(const char *s, const char *flag, float *out) {
    double v;
    if (!cli_parse_double(s, flag, &v)) return false;
    *out = (float)v;
    return true;
}

bool isatty_stdin(void) { return isatty(0); }

char *cli_read_stream(FILE *f, size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) return NULL;
    for (;;) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        cap *= 2;
        char *b = realloc(buf, cap + 1);
        if (!b) {
            free(buf);
            return NULL;
        }
        buf = b;
    }
    if (ferror(f)) {
        perror("atomc: reading input");
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

int cli_parse_token_ids(const char *s, int32_t **out) {
    *out = NULL;
    size_t cap = 64;
    int n = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return -1;
    for (const char *p = s;;) {
        while (*p == ',' || *p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == '[' || *p == ']') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) {
            fprintf(stderr, "atomc: bad token id near \"%.20s\"\n", p);
            free(v);
            return -1;
        }
        if ((size_t)n == cap) {
            int32_t *w = realloc(v, (cap *= 2) * sizeof *w);
            if (!w) {
                free(v);
                return -1;
            }
            v = w;
        }
        v[n++] = (int32_t)x;
        p = end;
    }
    *out = v;
    return n;
}

static void cli_usage(FILE *f, const struct cli_command *rows, size_t n_rows, const char *prog, const char *noun) {
    fprintf(f, "usage: %s <%s> [options]   (%s <%s> --help for its options)\n\n%ss:\n", prog, noun, prog, noun, noun);
    for (size_t i = 0; i < n_rows; i++) fprintf(f, "  %-14s %s\n", rows[i].name, rows[i].help);
}

int cli_dispatch(const struct cli_command *rows, size_t n_rows, const char *prog, const char *noun, int argc,
                 char **argv) {
    if (argc < 2) {
        cli_usage(stderr, rows, n_rows, prog, noun);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        cli_usage(stdout, rows, n_rows, prog, noun);
        return 0;
    }
    for (size_t i = 0; i < n_rows; i++)
        if (!strcmp(argv[1], rows[i].name)) return rows[i].run(argc - 1, argv + 1);
    fprintf(stderr, "%s: unknown %s '%s'\n", prog, noun, argv[1]);
    cli_usage(stderr, rows, n_rows, prog, noun);
    return 2;
}

const char *cli_resolve_model_arg(const char *spec, char *buf, size_t buf_len) {
    struct hf_cache_env env = {getenv("HF_HUB_CACHE"), getenv("HF_HOME"), getenv("XDG_CACHE_HOME"), getenv("HOME")};
    struct error err = {0};
    if (hf_cache_resolve(spec, &env, buf, buf_len, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc: %s\n", err.msg);
        return NULL;
    }
    if (!strcmp(buf, spec)) return spec;
    LOG_INFO("model %s: %s (Hugging Face cache)", spec, buf);
    return buf;
}

void cli_engine_args_init(struct cli_engine_args *a) {
    atomc_engine_options_init(&a->o);
    a->o.device = "auto"; // the CLI's default: CUDA when a usable GPU is present (src/backend/backend.c)
    a->spec_method[0] = 0;
}

static bool set_spec_method(atomc_engine_options *o, char *buf, size_t buf_len, const char *m, const char *flag) {
    if (strlen(m) >= buf_len) {
        fprintf(stderr, "atomc: %s: unknown speculative method \"%.40s...\"\n", flag, m);
        return false;
    }
    snprintf(buf, buf_len, "%s", m);
    o->speculative_method = buf;
    return true;
}

// One integer field of --speculative-config (absent: *out unchanged).
static bool spec_int(json_t *j, const char *key, long min, long max, int *out) {
    json_t *v = json_object_get(j, key);
    if (!v) return true;
    if (!json_is_integer(v) || json_integer_value(v) < min || json_integer_value(v) > max) {
        fprintf(stderr, "atomc: --speculative-config: \"%s\" must be an integer in [%ld, %ld]\n", key, min, max);
        return false;
    }
    *out = (int)json_integer_value(v);
    return true;
}

bool cli_parse_speculative_config(atomc_engine_options *o, char *buf, size_t buf_len, char *model_buf,
                                  size_t model_buf_len, const char *arg) {
    json_error_t je;
    json_t *j = json_loads(arg, 0, &je);
    if (!json_is_object(j)) {
        fprintf(stderr, "atomc: --speculative-config expects a JSON object, got '%s'%s%s\n", arg, j ? "" : ": ",
                j ? "" : je.text);
        json_decref(j);
        return false;
    }
    static const char *known[] = {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
                                  "prompt_lookup_max", "disable_by_batch_size"};
    const char *key;
    json_t *v;
    bool ok = true;
    json_object_foreach(j, key, v) {
        bool found = false;
        for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
            found |= !strcmp(key, known[i]);
        if (!found) {
            fprintf(stderr,
                    "atomc: --speculative-config: unsupported key \"%s\" (supported: method, model, "
                    "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)\n",
                    key);
            ok = false;
        }
    }
    json_t *m = json_object_get(j, "method");
    if (ok && m && !json_is_string(m)) {
        fprintf(stderr, "atomc: --speculative-config: \"method\" must be a string\n");
        ok = false;
    }
    if (ok && m) ok = set_spec_method(o, buf, buf_len, json_string_value(m), "--speculative-config");
    json_t *model = json_object_get(j, "model");
    if (ok && model) {
        if (!json_is_string(model) || !*json_string_value(model) || strlen(json_string_value(model)) >= model_buf_len) {
            fprintf(stderr, "atomc: --speculative-config: \"model\" must be a non-empty path (the draft head's "
                            "directory)\n");
            ok = false;
        } else {
            // A Hugging Face repo id ("ORG/NAME", as vLLM takes it) becomes its cache snapshot.
            char resolved[4096];
            const char *p = cli_resolve_model_arg(json_string_value(model), resolved, sizeof resolved);
            if (!p || strlen(p) >= model_buf_len) {
                ok = false;
            } else {
                snprintf(model_buf, model_buf_len, "%s", p);
                o->speculative_model = model_buf;
            }
        }
    }
    ok = ok && spec_int(j, "num_speculative_tokens", 1, ATOMC_MAX_SPEC_TOKENS, &o->num_speculative_tokens);
    ok = ok && spec_int(j, "prompt_lookup_min", 1, 1 << 20, &o->prompt_lookup_min);
    ok = ok && spec_int(j, "prompt_lookup_max", 1, 1 << 20, &o->prompt_lookup_max);
    ok = ok && spec_int(j, "disable_by_batch_size", 1, 1 << 20, &o->speculative_disable_by_batch_size);
    if (ok && !m && o->speculative_method == NULL) {
        fprintf(stderr, "atomc: --speculative-config needs a \"method\" (\"ngram\", \"mtp\" or \"eagle3\")\n");
        ok = false;
    }
    json_decref(j);
    return ok;
}

int cli_engine_parse_flag(struct cli_engine_args *a, int code, const char *arg) {
    atomc_engine_options *o = &a->o;
    double d;
    switch (code) {
    case CLI_E_MODEL: o->model_path = arg; return 1;
    case CLI_E_DEVICE: o->device = arg; return 1;
    case CLI_E_DTYPE: o->dtype = arg; return 1;
    case CLI_E_LOAD_FORMAT: o->load_format = arg; return 1;
    case CLI_E_QUANT: o->quantization = arg; return 1;
    case CLI_E_KV_DTYPE: o->kv_cache_dtype = arg; return 1;
    case CLI_E_MAX_MODEL_LEN: return cli_parse_int(arg, "--max-model-len", 1, 1 << 30, &o->max_model_len) ? 1 : -1;
    case CLI_E_MAX_NUM_SEQS: return cli_parse_int(arg, "--max-num-seqs", 1, 1 << 20, &o->max_num_seqs) ? 1 : -1;
    case CLI_E_MAX_BATCHED:
        return cli_parse_int(arg, "--max-num-batched-tokens", 1, 1 << 30, &o->max_num_batched_tokens) ? 1 : -1;
    case CLI_E_BLOCK_SIZE: return cli_parse_int(arg, "--block-size", 1, 4096, &o->block_size) ? 1 : -1;
    case CLI_E_NUM_KV_BLOCKS:
        return cli_parse_int(arg, "--num-gpu-blocks-override", 1, 1 << 30, &o->num_kv_blocks) ? 1 : -1;
    case CLI_E_GPU_UTIL:
        if (!cli_parse_double(arg, "--gpu-memory-utilization", &d)) return -1;
        if (d <= 0 || d > 1) {
            fprintf(stderr, "atomc: --gpu-memory-utilization must be in (0, 1], got %s\n", arg);
            return -1;
        }
        o->gpu_memory_utilization = d;
        return 1;
    case CLI_E_CPU_KV_GB:
        if (!cli_parse_double(arg, "--cpu-kv-cache-gb", &d)) return -1;
        if (d <= 0 || d > 4096) {
            fprintf(stderr, "atomc: --cpu-kv-cache-gb must be in (0, 4096], got %s\n", arg);
            return -1;
        }
        o->cpu_kv_cache_bytes = (size_t)(d * 1073741824.0);
        return 1;
    case CLI_E_PREFIX_ON: o->enable_prefix_caching = true; return 1;
    case CLI_E_PREFIX_OFF: o->enable_prefix_caching = false; return 1;
    case CLI_E_EAGER: o->enforce_eager = true; return 1;
    case CLI_E_NO_HYBRID_KV: o->disable_hybrid_kv_cache_manager = true; return 1;
    case CLI_E_THREADS: return cli_parse_int(arg, "--num-threads", 0, 4096, &o->num_threads) ? 1 : -1;
    case CLI_E_CPU_EXACT: o->cpu_exact_kernels = true; return 1;
    case CLI_E_GEN_CONFIG: o->generation_config = arg; return 1;
    case CLI_E_PROFILE_DIR: o->profile_dir = arg; return 1;
    case CLI_E_TP: return cli_parse_int(arg, "--tensor-parallel-size", 1, 64, &o->tensor_parallel_size) ? 1 : -1;
    case CLI_E_ENGINE_SEED: return cli_parse_u64(arg, "--engine-seed", &o->seed) ? 1 : -1;
    case CLI_E_SPEC_CONFIG:
        return cli_parse_speculative_config(o, a->spec_method, sizeof a->spec_method, a->spec_model,
                                            sizeof a->spec_model, arg)
                   ? 1
                   : -1;
    case CLI_E_SPEC_MODEL: o->speculative_model = arg; return 1;
    case CLI_E_SPEC_METHOD:
        return set_spec_method(o, a->spec_method, sizeof a->spec_method, arg, "--method") ? 1 : -1;
    case CLI_E_KV_TRANSFER: {
        struct kv_transfer_config kc;
        struct error e = {0};
        if (kv_transfer_config_parse(arg, &kc, &e) != ATOMC_OK) {
            fprintf(stderr, "atomc: %s\n", e.msg);
            return -1;
        }
        o->kv_transfer_config = arg;
        return 1;
    }
    case CLI_E_SPEC_NUM:
        return cli_parse_int(arg, "--num-speculative-tokens", 1, ATOMC_MAX_SPEC_TOKENS, &o->num_speculative_tokens)
                   ? 1
                   : -1;
    }
    return 0;
}

bool cli_profile_start(atomc_engine *e, const struct cli_engine_args *a) {
    if (!a->o.profile_dir) return true;
    char msg[512];
    if (atomc_engine_start_profile(e, msg, sizeof msg) != ATOMC_OK) {
        fprintf(stderr, "atomc: %s\n", msg);
        return false;
    }
    return true;
}

void cli_profile_stop(atomc_engine *e, const struct cli_engine_args *a) {
    if (!a->o.profile_dir) return;
    char path[4096], msg[512];
    if (atomc_engine_stop_profile(e, path, sizeof path, msg, sizeof msg) != ATOMC_OK)
        fprintf(stderr, "atomc: writing the profile failed: %s\n", msg);
    else
        fprintf(stderr, "atomc: profile written to %s (open in chrome://tracing or ui.perfetto.dev)\n", path);
}
