// atomc_engine_create: loads the model runner (weights, backend, KV pool) and the tokenizer
// and plugs them into the engine's seams (engine_internal.h).
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "common/check.h"
#include "common/error.h"
#include "common/log.h"
#include "common/mapped_file.h"
#include "engine/engine_internal.h"
#include "model/config.h"
#include "parallel/tp_runner.h"
#include "runtime/model_runner.h"
#include "tokenizer/tokenizer.h"

#include <xxhash.h>

static atomc_status runner_execute(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                                   struct error *err) {
    return model_runner_execute(ctx, fb, out, err);
}

static void runner_free(void *ctx) { model_runner_free(ctx); }
static uint64_t runner_graph_replays(void *ctx) { return model_runner_num_graph_replays(ctx); }
static void runner_kv_pool(void *ctx, int rank, struct kv_pool_view *v) {
    (void)rank;
    model_runner_kv_pool_view(ctx, v);
}
static atomc_status runner_draft(void *ctx, const struct draft_batch *db, int32_t *drafts, struct error *err) {
    return model_runner_draft(ctx, db, drafts, err);
}

// The model's shape for the KV transfer handshake: what decides the KV's meaning and layout.
static uint64_t config_hash(const struct model_config *c) {
    int64_t f[] = {c->arch, c->hidden_size, c->intermediate_size, c->num_layers, c->num_heads, c->num_kv_heads,
                   c->head_dim, c->vocab_size, c->sliding_window, c->num_experts, c->qk_norm, c->tie_word_embeddings};
    return XXH64(f, sizeof f, XXH64(c->architecture, strnlen(c->architecture, sizeof c->architecture), 0));
}

// Tensor parallelism: the engine drives a tp_runner through the same seam.
static atomc_status tp_execute(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                               struct error *err) {
    return tp_runner_execute(ctx, fb, out, err);
}

static void tp_free(void *ctx) { tp_runner_free(ctx); }
static void tp_kv_pool(void *ctx, int rank, struct kv_pool_view *v) {
    model_runner_kv_pool_view(tp_runner_rank(ctx, rank), v);
}
static uint64_t tp_graph_replays(void *ctx) { return model_runner_num_graph_replays(tp_runner_rank(ctx, 0)); }

static void add_eos(struct engine_setup *su, int32_t id) {
    if (id < 0 || su->n_eos >= ENGINE_MAX_EOS) return;
    for (int i = 0; i < su->n_eos; i++)
        if (su->eos_ids[i] == id) return;
    su->eos_ids[su->n_eos++] = id;
}

// j[key] into *out when it is a number (an integer for the int form); whether it was.
static bool json_take_float(json_t *j, const char *key, float *out) {
    json_t *v = json_object_get(j, key);
    if (!json_is_number(v)) return false;
    *out = (float)json_number_value(v);
    return true;
}

static bool json_take_int(json_t *j, const char *key, int *out) {
    json_t *v = json_object_get(j, key);
    if (!json_is_integer(v)) return false;
    *out = (int)json_integer_value(v);
    return true;
}

// Sampling defaults from <model dir>/generation_config.json (absent for GGUF files). As vLLM,
// only these keys count (do_sample is ignored); info's "unset" values are left otherwise.
static void read_generation_defaults(const char *model_path, atomc_model_info *info) {
    if (!dir_exists(model_path)) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/generation_config.json", model_path);
    if (!file_exists(path)) return;
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!json_is_object(j)) {
        LOG_WARN("%s: not a JSON object (line %d: %s); sampling defaults not used", path, je.line, je.text);
        json_decref(j);
        return;
    }
    bool any = false;
    any |= json_take_float(j, "temperature", &info->default_temperature);
    any |= json_take_float(j, "top_p", &info->default_top_p);
    any |= json_take_int(j, "top_k", &info->default_top_k);
    any |= json_take_float(j, "min_p", &info->default_min_p);
    any |= json_take_float(j, "repetition_penalty", &info->default_repetition_penalty);
    any |= json_take_int(j, "max_new_tokens", &info->default_max_tokens);
    info->has_generation_defaults = any;
    json_decref(j);
}

// backend: NULL (create one from o->device), or a backend to run on (engine_create_on_backend),
// owned from here also on failure.
static atomc_status engine_create_impl(const atomc_engine_options *o_in, struct backend *backend, atomc_engine **out,
                                       char *err_buf, size_t err_len) {
    struct error err = {0};
    // "auto" becomes "cpu" or "cuda" once, here: limits, backends and TP ranks all see the same name.
    atomc_engine_options o_resolved;
    const atomc_engine_options *o = o_in;
    if (o_in) {
        o_resolved = *o_in;
        o_resolved.device = backend_resolve_device(o_in->device);
        o = &o_resolved;
    }
    atomc_status st = ATOMC_OK;
    *out = NULL;
    struct model_runner *runner = NULL;
    struct tp_runner *tp = NULL;
    struct tokenizer *tok = NULL;
    if (!o || !o->model_path || !o->model_path[0]) {
        st = error_set(&err, ATOMC_ERR_INVALID_ARGUMENT, "no model path given");
        goto fail;
    }
    if (o->generation_config && strcmp(o->generation_config, "auto") && strcmp(o->generation_config, "vllm")) {
        st = error_set(&err, ATOMC_ERR_INVALID_ARGUMENT, "generation_config must be \"auto\" or \"vllm\", got \"%s\"",
                       o->generation_config);
        goto fail;
    }
    int max_seqs, max_tokens, spec_k, spec_min, spec_max, spec_batch;
    engine_resolve_limits(o, &max_seqs, &max_tokens);
    // Speculative options are checked before the weights load; a decode with k drafts needs 1 + k rows.
    if ((st = engine_resolve_spec(o, &spec_k, &spec_min, &spec_max, &spec_batch, &err)) != ATOMC_OK) goto fail;
    struct runner_options ro = {
        .model_path = o->model_path,
        .device = o->device ? o->device : "cpu",
        .dtype = o->dtype ? o->dtype : "auto",
        .load_format = o->load_format ? o->load_format : "auto",
        .quantization = o->quantization,
        .kv_cache_dtype = o->kv_cache_dtype ? o->kv_cache_dtype : "auto",
        .block_size = o->block_size > 0 ? o->block_size : 16,
        .num_kv_blocks = o->num_kv_blocks,
        .gpu_memory_utilization = o->gpu_memory_utilization > 0 ? o->gpu_memory_utilization : 0.9,
        .cpu_kv_cache_bytes = o->cpu_kv_cache_bytes,
        .max_num_seqs = max_seqs,
        .max_num_batched_tokens = max_tokens,
        .max_logits_rows = max_seqs * (1 + spec_k),
        .max_model_len = o->max_model_len,
        .enforce_eager = o->enforce_eager,
        .num_speculative_tokens = spec_k, // verify-step graphs of 1 + k tokens per sequence
        .num_threads = o->num_threads,
        .cpu_exact_kernels = o->cpu_exact_kernels,
        .dummy_seed = o->seed,
        .moe_uniform_routing = o->moe_uniform_routing,
        .load_mtp = spec_k > 0 && engine_spec_is_mtp(o),
        .eagle3_path = spec_k > 0 && engine_spec_is_eagle3(o) ? o->speculative_model : NULL,
    };
    int tp_size = o->tensor_parallel_size > 0 ? o->tensor_parallel_size : 1;
    // Per-layer-group block tables: not with KV transfer (it moves one table's blocks) or TP yet.
    ro.hybrid_kv_groups = !o->disable_hybrid_kv_cache_manager && tp_size == 1 &&
                          !(o->kv_transfer_config && o->kv_transfer_config[0]);
    if (backend && tp_size > 1) {
        st = error_set(&err, ATOMC_ERR_INVALID_ARGUMENT, "a given backend runs tensor_parallel_size 1 only");
        goto fail;
    }
    ro.backend = backend;
    backend = NULL; // model_runner_create owns it, also on failure
    if (tp_size > 1) {
        st = tp_runner_create(&ro, tp_size, &tp, &err);
        if (st == ATOMC_OK) runner = tp_runner_rank(tp, 0); // rank 0 answers the config queries; tp owns it
    } else {
        st = model_runner_create(&ro, &runner, &err);
    }
    if (st != ATOMC_OK) goto fail;
    // A model directory without tokenizer.json runs on token ids only (as vLLM's
    // --skip-tokenizer-init): text prompts and stop strings are then rejected per request.
    char tok_path[4096];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", o->model_path);
    // A bare config.json file (--load-format dummy with bench/configs/*.json) likewise.
    size_t mp_len = strlen(o->model_path);
    bool bare_config = !dir_exists(o->model_path) && mp_len >= 5 && !strcmp(o->model_path + mp_len - 5, ".json");
    if ((dir_exists(o->model_path) && !file_exists(tok_path)) || bare_config) {
        LOG_WARN("%s has no tokenizer.json: token-id prompts only, no text output", o->model_path);
    } else {
        st = tokenizer_load(o->model_path, &tok, &err);
        if (st != ATOMC_OK) {
            error_prefix(&err, "loading the tokenizer of %s: ", o->model_path);
            goto fail;
        }
    }

    const struct model_config *cfg = model_runner_config(runner);
    struct engine_setup su;
    memset(&su, 0, sizeof su);
    su.model = (struct engine_model_ops){
        .ctx = runner, .execute = runner_execute, .free = runner_free, .graph_replays = runner_graph_replays,
        .kv_pool = runner_kv_pool, .draft = model_runner_num_mtp_layers(runner) > 0 ? runner_draft : NULL};
    if (tp)
        su.model = (struct engine_model_ops){
            .ctx = tp, .execute = tp_execute, .free = tp_free, .graph_replays = tp_graph_replays,
            .kv_pool = tp_kv_pool, .kv_ranks = tp_runner_size(tp)};
    if (tok) engine_text_ops_from_tokenizer(&su.text, tok);
    su.config_hash = config_hash(cfg);
    su.num_kv_blocks = tp ? tp_runner_num_kv_blocks(tp) : model_runner_num_kv_blocks(runner); // smallest rank's pool
    su.vocab_size = cfg->vocab_size;
    su.max_model_len = model_runner_max_model_len(runner);
    su.sliding_window = model_runner_sliding_window(runner);
    if (!tp) model_runner_kv_groups(runner, &su.sw_window, &su.num_kv_blocks_sw);
    su.num_state_slots = model_runner_num_state_slots(runner);
    su.sample_check = !tp && model_runner_sample_check_ok(runner);
    if (tp) {
        for (int i = 0; i < tp_runner_size(tp); i++)
            su.host_threads += model_runner_host_threads(tp_runner_rank(tp, i));
    } else {
        su.host_threads = model_runner_host_threads(runner);
    }
    // EOS: config.json + generation_config.json (merged by the loader), and the tokenizer's.
    for (int i = 0; i < cfg->n_eos; i++) add_eos(&su, cfg->eos_token_ids[i]);
    if (tok) add_eos(&su, tokenizer_eos_id(tok));
    const char *base = strrchr(o->model_path, '/');
    su.owned_strings[0] = xstrdup(base && base[1] ? base + 1 : o->model_path);
    su.owned_strings[1] = xstrdup(cfg->architecture);
    su.info.model_name = su.owned_strings[0];
    su.info.architecture = su.owned_strings[1];
    su.info.chat_template = tok ? tokenizer_chat_template(tok) : NULL;
    su.info.bos_token = tok ? tokenizer_bos_text(tok) : NULL;
    su.info.eos_token = tok ? tokenizer_eos_text(tok) : NULL;
    su.info.default_temperature = -1; // unset
    su.info.default_top_k = -1;
    su.info.default_min_p = -1;
    if (!o->generation_config || strcmp(o->generation_config, "vllm")) read_generation_defaults(o->model_path, &su.info);
    runner = NULL; // owned by the setup from here
    tp = NULL;
    tok = NULL;
    atomc_engine_options eo = *o;
    eo.max_model_len = su.max_model_len;
    st = engine_create_with(&eo, &su, out, &err);
    if (st != ATOMC_OK) goto fail;
    return ATOMC_OK;

fail:
    if (backend) backend_destroy(backend);
    if (tp) tp_runner_free(tp); // owns its ranks' runners
    else if (runner) model_runner_free(runner);
    if (tok) tokenizer_free(tok);
    if (err_buf && err_len) snprintf(err_buf, err_len, "%s", err.msg);
    return st;
}

atomc_status atomc_engine_create(const atomc_engine_options *o, atomc_engine **out, char *err_buf, size_t err_len) {
    return engine_create_impl(o, NULL, out, err_buf, err_len);
}

atomc_status engine_create_on_backend(const atomc_engine_options *o, struct backend *b, atomc_engine **out,
                                      char *err_buf, size_t err_len) {
    CHECK(b);
    return engine_create_impl(o, b, out, err_buf, err_len);
}
