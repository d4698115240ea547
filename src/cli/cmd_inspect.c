// `atomc inspect --model PATH [--tensors] [--json]`: opens a model (HF directory or .gguf)
// through the loader, validates it, and prints its configuration, a dtype histogram of the
// weights, and how long opening took; --tensors lists every tensor (file name, dtype, shape).
// A quantization config is printed (JSON: "quantization_config", with "refused" holding the
// message loading would fail with) rather than refused: inspecting is how one sees it.
// Exit status 0 if the model opens and validates, 1 with the loader's message otherwise.
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "common/timeutil.h"
#include "loader/model_files.h"
#include "model/quant.h"

struct tensor_row {
    const char *name;
    const char *dtype;
    int ndim;
    const int64_t *ne;
    uint64_t bytes;
};

// Every tensor of the underlying files, in file order (GGUF) or name order (safetensors).
static size_t collect(const struct model_files *mf, struct tensor_row **out) {
    size_t n = 0;
    struct tensor_row *rows;
    if (mf->kind == MODEL_FILES_GGUF) {
        rows = calloc(mf->gguf->n_tensors + 1, sizeof *rows);
        for (uint64_t i = 0; i < mf->gguf->n_tensors; i++) {
            const struct gguf_tensor_info *t = &mf->gguf->tensors[i];
            rows[n++] = (struct tensor_row){t->name, ggml_type_name(t->ggml_type), t->ndim, t->ne, t->nbytes};
        }
    } else {
        rows = calloc(mf->st->n_entries + 1, sizeof *rows);
        for (size_t i = 0; i < mf->st->n_entries; i++) {
            const struct safetensors_tensor *t = mf->st->entries[i].tensor;
            rows[n++] = (struct tensor_row){t->name, t->dtype_name, t->ndim, t->ne, t->end - t->begin};
        }
    }
    *out = rows;
    return n;
}

static const char *rope_name(enum rope_scaling_type s) {
    switch (s) {
    case ROPE_SCALING_NONE: return "none";
    case ROPE_SCALING_LINEAR: return "linear";
    case ROPE_SCALING_LLAMA3: return "llama3";
    case ROPE_SCALING_YARN: return "yarn";
    case ROPE_SCALING_DYNAMIC: return "dynamic";
    }
    return "?";
}

static json_t *quant_args_json(const struct quant_args *a) {
    if (!a->present) return json_null();
    json_t *o = json_object();
    json_object_set_new(o, "num_bits", json_integer(a->num_bits));
    json_object_set_new(o, "type", json_string(quant_type_name(a->type)));
    json_object_set_new(o, "strategy",
                        json_string(a->strategy == QUANT_STRATEGY_OTHER && a->strategy_name[0]
                                        ? a->strategy_name
                                        : quant_strategy_name(a->strategy)));
    json_object_set_new(o, "group_size", a->group_size ? json_integer(a->group_size) : json_null());
    json_object_set_new(o, "block_size",
                        a->block_size[0] ? json_pack("[ii]", a->block_size[0], a->block_size[1]) : json_null());
    json_object_set_new(o, "symmetric", json_boolean(a->symmetric));
    json_object_set_new(o, "dynamic", json_boolean(a->dynamic));
    if (a->actorder[0]) json_object_set_new(o, "actorder", json_string(a->actorder));
    return o;
}

// The parsed quantization config (null when there is none); `atomc inspect` shows it
// without refusing the model (loading would: model_quant_check).
static json_t *quant_json(const struct model_config *c) {
    const struct quant_config *q = &c->quant;
    if (!q->present) return json_null();
    json_t *o = json_object(), *schemes = json_array(), *ignore = json_array();
    json_object_set_new(o, "origin", json_string(q->origin));
    json_object_set_new(o, "quant_method", json_string(q->method_name));
    json_object_set_new(o, "format", q->format[0] ? json_string(q->format) : json_null());
    for (int i = 0; i < q->n_schemes && i < QUANT_MAX_SCHEMES; i++) {
        const struct quant_scheme *s = &q->schemes[i];
        json_t *so = json_object(), *targets = json_array();
        for (int t = 0; t < s->n_targets && t < QUANT_MAX_TARGETS; t++)
            json_array_append_new(targets, json_string(s->targets[t]));
        json_object_set_new(so, "name", json_string(s->name));
        json_object_set_new(so, "format", s->format[0] ? json_string(s->format) : json_null());
        json_object_set_new(so, "targets", targets);
        json_object_set_new(so, "weights", quant_args_json(&s->weights));
        json_object_set_new(so, "input_activations", quant_args_json(&s->input_act));
        json_object_set_new(so, "activation_scheme", json_string(quant_act_scheme_name(s->act_scheme)));
        json_array_append_new(schemes, so);
    }
    json_object_set_new(o, "schemes", schemes);
    json_object_set_new(o, "n_schemes", json_integer(q->n_schemes));
    json_object_set_new(o, "kv_cache_scheme", quant_args_json(&q->kv_cache));
    json_object_set_new(o, "sparsity_format", q->sparsity_format[0] ? json_string(q->sparsity_format) : json_null());
    for (int i = 0; i < q->n_ignore && i < QUANT_MAX_IGNORE; i++)
        json_array_append_new(ignore, json_string(q->ignore[i]));
    json_object_set_new(o, "ignore", ignore);
    json_object_set_new(o, "n_ignore", json_integer(q->n_ignore));
    struct error e = {0};
    json_object_set_new(o, "refused", model_quant_check(c, &e) ? json_string(e.msg) : json_null());
    return o;
}

// The weight scheme a tensor of an implemented quantized checkpoint is loaded with: for the
// values of a module the config quantizes (<module>.weight, or .weight_packed) whose scales are
// stored, its plan's scheme (model_quant_weight_plan) as the checkpoint stores it (per-tensor
// parts fused into one matmul load as per-channel); NULL for every other tensor (scales,
// shapes, plain weights) and for unquantized or refused checkpoints.
static const char *tensor_scheme(const struct model_files *mf, const char *name) {
    const struct model_config *c = &mf->config;
    struct error e = {0};
    if (!c->quant.present || model_quant_check(c, &e) != ATOMC_OK) return NULL;
    if (c->quant.method == QUANT_METHOD_MXFP4) { // GPT-OSS experts: <name>_blocks with <name>_scales
        size_t n = strlen(name), k = strlen("_blocks");
        char scale[320];
        if (n <= k || strcmp(name + n - k, "_blocks") || n - k >= 256) return NULL;
        snprintf(scale, sizeof scale, "%.*s_scales", (int)(n - k), name);
        return model_files_has_tensor(mf, scale) ? weight_scheme_name(WEIGHT_SCHEME_MX) : NULL;
    }
    static const char *suffixes[] = {".weight", ".weight_packed", ".qweight"}; // qweight: GPTQ / AWQ
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(name), k = strlen(suffixes[i]);
        if (n <= k || strcmp(name + n - k, suffixes[i]) || n - k >= 256) continue;
        char module[256], scale[320];
        snprintf(module, sizeof module, "%.*s", (int)(n - k), name);
        struct quant_weight_plan p;
        model_quant_weight_plan(c, module, &p);
        if (p.scheme == WEIGHT_SCHEME_NONE || strcmp(suffixes[i] + 1, p.values)) continue;
        snprintf(scale, sizeof scale, "%s.%s", module, p.scale);
        if (model_files_has_tensor(mf, scale)) return weight_scheme_name(p.scheme);
    }
    return NULL;
}

static void usage(FILE *f) {
    fprintf(f, "usage: atomc inspect --model PATH [--tensors] [--json]\n"
               "  PATH: an HF model directory (config.json + safetensors) or a .gguf file\n");
}

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    int list = 0, as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) path = argv[++i];
        else if (!strcmp(argv[i], "--tensors")) list = 1;
        else if (!strcmp(argv[i], "--json")) as_json = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "atomc inspect: unknown option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    struct error err = {0};
    struct model_files *mf;
    double t0 = time_now_s();
    if (model_files_open(&mf, path, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc inspect: %s\n", err.msg);
        return 1;
    }
    double open_ms = (time_now_s() - t0) * 1e3;
    const struct model_config *c = &mf->config;
    struct tensor_row *rows;
    size_t n = collect(mf, &rows);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += rows[i].bytes;

    if (as_json) {
        json_t *o = json_object();
        json_object_set_new(o, "path", json_string(path));
        json_object_set_new(o, "format", json_string(mf->kind == MODEL_FILES_GGUF ? "gguf" : "hf"));
        json_object_set_new(o, "architecture", json_string(c->architecture));
        json_object_set_new(o, "num_layers", json_integer(c->num_layers));
        json_object_set_new(o, "hidden_size", json_integer(c->hidden_size));
        json_object_set_new(o, "intermediate_size", json_integer(c->intermediate_size));
        json_object_set_new(o, "num_heads", json_integer(c->num_heads));
        json_object_set_new(o, "num_kv_heads", json_integer(c->num_kv_heads));
        json_object_set_new(o, "head_dim", json_integer(c->head_dim));
        json_object_set_new(o, "vocab_size", json_integer(c->vocab_size));
        json_object_set_new(o, "max_position_embeddings", json_integer(c->max_position_embeddings));
        json_object_set_new(o, "rope_theta", json_real(c->rope.theta));
        json_object_set_new(o, "rope_scaling", json_string(rope_name(c->rope.scaling)));
        json_object_set_new(o, "rotary_dim", json_integer(c->rope.rotary_dim));
        json_object_set_new(o, "rms_norm_eps", json_real(c->rms_norm_eps));
        json_object_set_new(o, "tie_word_embeddings", json_boolean(c->tie_word_embeddings));
        json_object_set_new(o, "num_experts", json_integer(c->num_experts));
        json_object_set_new(o, "num_experts_per_tok", json_integer(c->num_experts_per_tok));
        json_object_set_new(o, "bos_token_id", json_integer(c->bos_token_id));
        json_t *eos = json_array();
        for (int i = 0; i < c->n_eos; i++) json_array_append_new(eos, json_integer(c->eos_token_ids[i]));
        json_object_set_new(o, "eos_token_ids", eos);
        json_object_set_new(o, "quantization_config", quant_json(c));
        json_object_set_new(o, "n_tensors", json_integer((json_int_t)n));
        json_object_set_new(o, "weight_bytes", json_integer((json_int_t)total));
        json_object_set_new(o, "open_ms", json_real(open_ms));
        if (list) {
            json_t *arr = json_array();
            for (size_t i = 0; i < n; i++) {
                json_t *t = json_object(), *shape = json_array();
                for (int d = 0; d < rows[i].ndim; d++) json_array_append_new(shape, json_integer(rows[i].ne[d]));
                json_object_set_new(t, "name", json_string(rows[i].name));
                json_object_set_new(t, "dtype", json_string(rows[i].dtype));
                json_object_set_new(t, "shape", shape);
                const char *sch = tensor_scheme(mf, rows[i].name);
                json_object_set_new(t, "scheme", sch ? json_string(sch) : json_null());
                json_array_append_new(arr, t);
            }
            json_object_set_new(o, "tensors", arr);
        }
        char *s = json_dumps(o, JSON_INDENT(2));
        puts(s);
        free(s);
        json_decref(o);
    } else {
        printf("path:          %s\n", path);
        if (mf->kind == MODEL_FILES_GGUF)
            printf("format:        GGUF v%u (%" PRIu64 " metadata keys, alignment %u)\n", mf->gguf->version,
                   mf->gguf->n_kv, mf->gguf->alignment);
        else
            printf("format:        HF directory (%zu safetensors file%s%s)\n", mf->st->n_files,
                   mf->st->n_files == 1 ? "" : "s", mf->has_generation_config ? ", generation_config.json" : "");
        printf("architecture:  %s\n", c->architecture);
        printf("shape:         %d layers, hidden %d, ffn %d, heads %d / kv %d (head_dim %d), vocab %d, context %d\n",
               c->num_layers, c->hidden_size, c->intermediate_size, c->num_heads, c->num_kv_heads, c->head_dim,
               c->vocab_size, c->max_position_embeddings);
        printf("rope:          theta %g, scaling %s (factor %g), rotary_dim %d%s\n", c->rope.theta,
               rope_name(c->rope.scaling), c->rope.factor, c->rope.rotary_dim, c->rope.interleaved ? ", interleaved" : "");
        printf("norm/bias:     rms_eps %g, qk_norm %s, attention_bias %s, tied embeddings %s\n", c->rms_norm_eps,
               c->qk_norm ? "yes" : "no", c->attention_bias ? "yes" : "no", c->tie_word_embeddings ? "yes" : "no");
        if (c->num_experts)
            printf("moe:           %d experts, top-%d, expert ffn %d, shared %d, scoring %s\n", c->num_experts,
                   c->num_experts_per_tok, c->moe_intermediate_size, c->n_shared_experts, c->scoring_func);
        if (c->kv_lora_rank)
            printf("mla:           q_lora %d, kv_lora %d, qk_nope %d, qk_rope %d, v %d\n", c->q_lora_rank,
                   c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim);
        printf("tokens:        bos %d, eos", c->bos_token_id);
        for (int i = 0; i < c->n_eos; i++) printf(" %d", c->eos_token_ids[i]);
        printf("\n");
        if (c->quant.present) {
            char q[4096];
            quant_config_describe(&c->quant, q, sizeof q);
            printf("quantization:  %s\n", q);
            struct error e = {0};
            if (model_quant_check(c, &e)) {
                printf("               (not implemented: loading refuses this checkpoint)\n");
            } else { // how the quantized values load (scheme x tensors, bytes as stored)
                const char *sn[WEIGHT_SCHEME_COUNT] = {0};
                size_t sc[WEIGHT_SCHEME_COUNT] = {0};
                uint64_t sb[WEIGHT_SCHEME_COUNT] = {0};
                for (size_t i = 0; i < n; i++) {
                    const char *sch = tensor_scheme(mf, rows[i].name);
                    for (int k = 0; sch && k < WEIGHT_SCHEME_COUNT; k++)
                        if (!strcmp(sch, weight_scheme_name((enum weight_scheme)k)))
                            sn[k] = sch, sc[k]++, sb[k] += rows[i].bytes;
                }
                printf("weight schemes:");
                for (int k = 0; k < WEIGHT_SCHEME_COUNT; k++)
                    if (sc[k]) printf(" %s x%zu (%.2f MiB)", sn[k], sc[k], (double)sb[k] / (1 << 20));
                printf("\n");
            }
        }
        // dtype histogram
        const char *names[32];
        size_t counts[32] = {0};
        uint64_t bytes[32] = {0};
        int nd = 0;
        for (size_t i = 0; i < n; i++) {
            int k = 0;
            while (k < nd && strcmp(names[k], rows[i].dtype)) k++;
            if (k == nd && nd < 32) names[nd++] = rows[i].dtype;
            if (k < 32) counts[k]++, bytes[k] += rows[i].bytes;
        }
        printf("weights:       %zu tensors, %.1f MiB:", n, (double)total / (1 << 20));
        for (int k = 0; k < nd; k++) printf(" %s x%zu (%.1f MiB)", names[k], counts[k], (double)bytes[k] / (1 << 20));
        printf("\nopened in:     %.1f ms (mmap + parse + validate)\n", open_ms);
        if (list)
            for (size_t i = 0; i < n; i++) {
                printf("  %-56s %-8s [", rows[i].name, rows[i].dtype);
                for (int d = 0; d < rows[i].ndim; d++) printf("%s%" PRId64, d ? ", " : "", rows[i].ne[d]);
                const char *sch = tensor_scheme(mf, rows[i].name);
                printf("]%s%s\n", sch ? "  scheme " : "", sch ? sch : "");
            }
    }
    free(rows);
    model_files_close(mf);
    return 0;
}
