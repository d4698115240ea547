// The engine: the implementation of include/atomc.h (except atomc_engine_create, which
// loads a model: engine_create.c). This file holds the defaults, engine_create_with, the loop
// thread, free, profiling, stats and tokenization; request intake is engine_request.c, the step
// engine_step.c and blocking generate engine_generate.c. All of them share struct atomc_engine
// and the functions declared at the end of engine_internal.h.
//
// Threads. Any thread may add requests, abort them, read stats or tokenize. New sequences
// and abort ids go through an inbox under `mu`; the step drains it. The scheduler, block
// manager and sequences belong to whichever thread runs the steps (the loop thread once
// started, else the caller of atomc_engine_step). The loop thread sleeps on `wake` when
// there is no work. Callbacks run without `mu` held.
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/trace.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"

// --- defaults --------------------------------------------------------------------------------

void atomc_engine_options_init(atomc_engine_options *o) {
    memset(o, 0, sizeof *o);
    o->device = "cpu";
    o->dtype = "auto";
    o->load_format = "auto";
    o->kv_cache_dtype = "auto";
    o->generation_config = "auto";
    o->block_size = 16;
    o->gpu_memory_utilization = 0.9;
    o->enable_prefix_caching = true;
    o->tensor_parallel_size = 1;
    o->long_prefill_token_threshold = -1;
}

void atomc_sampling_params_init(atomc_sampling_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->max_tokens = 16;
    p->skip_special_tokens = true;
    p->logprobs = -1;
    p->prompt_logprobs = -1;
    p->grammar_start_token = -1;
}

void atomc_request_init(atomc_request *r) {
    memset(r, 0, sizeof *r);
    r->add_special_tokens = true;
    atomc_sampling_params_init(&r->params);
}

void atomc_free(void *p) { free(p); }

void atomc_result_free(atomc_result *r) {
    if (!r) return;
    free(r->tokens);
    free(r->text);
    memset(r, 0, sizeof *r);
}

struct block_manager *engine_block_manager(atomc_engine *e) { return e->bm; }
struct block_manager *engine_block_manager_sw(atomc_engine *e) { return e->bm_sw; }

int engine_num_free_state_slots(atomc_engine *e) { return e->sched ? scheduler_num_free_state_slots(e->sched) : 0; }

uint64_t engine_graph_replays(atomc_engine *e) {
    return e->su.model.graph_replays ? e->su.model.graph_replays(e->su.model.ctx) : 0;
}

// --- public API ------------------------------------------------------------------------------

static int resolve(int v, int dflt) { return v > 0 ? v : dflt; }

bool engine_spec_is_mtp(const atomc_engine_options *o) {
    const char *m = o->speculative_method;
    return m && (!strcmp(m, "mtp") || !strcmp(m, "deepseek_mtp") || !strcmp(m, "glm4_moe_mtp"));
}

bool engine_spec_is_eagle3(const atomc_engine_options *o) {
    const char *m = o->speculative_method;
    return m && !strcmp(m, "eagle3");
}

void engine_resolve_limits(const atomc_engine_options *o, int *max_num_seqs, int *max_num_batched_tokens) {
    bool cuda = o->device && !strcmp(o->device, "cuda");
    *max_num_seqs = resolve(o->max_num_seqs, cuda ? 256 : 16);
    // CUDA: vLLM's defaults on H100 / H200-class GPUs, 16384 for its offline (LLM-class) engines
    // and 8192 for its server; larger prefill chunks keep the grouped MoE GEMMs of a chunk fuller
    // (Qwen3-30B-A3B 1K/1K +1.1%, docs/perf.md session 8).
    *max_num_batched_tokens = resolve(o->max_num_batched_tokens, cuda ? (o->offline ? 16384 : 8192) : 2048);
    if (*max_num_batched_tokens < *max_num_seqs && o->max_num_batched_tokens <= 0)
        *max_num_batched_tokens = *max_num_seqs;
}

int engine_resolve_long_prefill(const atomc_engine_options *o) {
    if (o->long_prefill_token_threshold >= 0) return o->long_prefill_token_threshold;
    bool cuda = o->device && !strcmp(o->device, "cuda");
    // CPU: a 2048-token step of SmolLM2-135M takes seconds on two cores, and per-token cost hardly
    // changes from 512-token chunks up (docs/perf.md, session 11), so a request arriving under a
    // long prompt waits one short step instead of the whole prompt.
    return cuda || o->offline ? 0 : 512;
}

atomc_status engine_resolve_spec(const atomc_engine_options *o, int *k, int *min_n, int *max_n, int *max_batch,
                                 struct error *err) {
    *k = *min_n = *max_n = 0;
    *max_batch = 0;
    const char *m = o->speculative_method;
    if (!m || !*m) {
        if (o->num_speculative_tokens > 0)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "num_speculative_tokens %d given without a speculative method (\"ngram\")",
                             o->num_speculative_tokens);
        return ATOMC_OK;
    }
    if (!strcmp(m, "eagle") || !strcmp(m, "draft_model"))
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "speculative method \"%s\" is not implemented yet; supported: \"ngram\", \"mtp\", \"eagle3\"",
                         m);
    const bool eagle3 = engine_spec_is_eagle3(o), mtp = engine_spec_is_mtp(o) || eagle3;
    if (!mtp && strcmp(m, "ngram") && strcmp(m, "[ngram]"))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "unknown speculative method \"%s\"; supported: \"ngram\", \"mtp\", \"eagle3\"", m);
    if (eagle3 && (!o->speculative_model || !*o->speculative_model))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "speculative method \"eagle3\" needs the EAGLE-3 head's directory (\"model\" in "
                         "--speculative-config, or --speculative-model)");
    if (!eagle3 && o->speculative_model && *o->speculative_model)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "a speculative model (\"%s\") belongs to method \"eagle3\", not \"%s\"",
                         o->speculative_model, m);
    if (o->num_speculative_tokens < 1 || o->num_speculative_tokens > ATOMC_MAX_SPEC_TOKENS)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "num_speculative_tokens must be in 1..%d, got %d",
                         ATOMC_MAX_SPEC_TOKENS, o->num_speculative_tokens);
    if (mtp && (o->prompt_lookup_min || o->prompt_lookup_max))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "prompt_lookup_min / prompt_lookup_max belong to method \"ngram\", not \"%s\"", m);
    int lo = o->prompt_lookup_min, hi = o->prompt_lookup_max;
    if (lo < 0 || hi < 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "prompt_lookup_min (%d) and prompt_lookup_max (%d) must be >= 1", lo, hi);
    if (!lo && !hi)
        lo = hi = 5; // vLLM's defaults
    else if (!lo)
        lo = hi;
    else if (!hi)
        hi = lo;
    if (lo > hi)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "prompt_lookup_min (%d) is larger than prompt_lookup_max (%d)", lo, hi);
    int mb = o->speculative_disable_by_batch_size;
    if (mb < -1)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "speculative_disable_by_batch_size must be >= 1, 0 (auto) or -1 (never), got %d", mb);
    bool cuda = o->device && !strcmp(o->device, "cuda");
    *max_batch = mb == -1 ? INT_MAX : mb > 0 ? mb : cuda ? 32 : 8;
    *k = o->num_speculative_tokens;
    *min_n = lo;
    *max_n = hi;
    return ATOMC_OK;
}

atomc_status engine_create_with(const atomc_engine_options *o, struct engine_setup *setup, atomc_engine **out,
                                struct error *err) {
    *out = NULL;
    atomc_engine *e = xcalloc(1, sizeof *e);
    e->su = *setup;
    memset(setup, 0, sizeof *setup); // ownership moved
    e->block_size = o->block_size > 0 ? o->block_size : 16;
    engine_resolve_limits(o, &e->max_num_seqs, &e->max_num_batched_tokens);
    e->max_waiting = o->max_waiting;
    e->seed = o->seed;

    e->max_model_len = e->su.max_model_len;
    atomc_status st = ATOMC_OK;
    if (o->max_model_len < 0) {
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "max_model_len must be positive, got %d", o->max_model_len);
    } else if (o->max_model_len > 0) {
        if (e->max_model_len > 0 && o->max_model_len > e->max_model_len)
            LOG_WARN("max_model_len %d exceeds the model's %d; using it as asked", o->max_model_len,
                     e->max_model_len);
        e->max_model_len = o->max_model_len;
    }
    if (st == ATOMC_OK && e->max_model_len <= 0)
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "the model declares no context length; pass max_model_len");
    if (st == ATOMC_OK && e->su.vocab_size <= 0)
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "the model has no vocabulary");
    if (st == ATOMC_OK && (long)e->su.num_kv_blocks * e->block_size < e->max_model_len)
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                       "The model's max seq len (%d) is larger than the maximum number of tokens that can be stored "
                       "in KV cache (%ld = %d blocks of %d). Try increasing the KV cache size or decreasing "
                       "max_model_len.",
                       e->max_model_len, (long)e->su.num_kv_blocks * e->block_size, e->su.num_kv_blocks,
                       e->block_size);
    if (st == ATOMC_OK) st = engine_resolve_spec(o, &e->spec_k, &e->spec_min, &e->spec_max, &e->spec_max_batch, err);
    e->spec_mtp = st == ATOMC_OK && e->spec_k > 0 && (engine_spec_is_mtp(o) || engine_spec_is_eagle3(o));
    if (e->spec_mtp && !e->su.model.draft)
        st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                       "speculative method \"%s\": this model runner cannot draft (MTP and EAGLE-3 need the "
                       "single-rank model runner; tensor parallelism is not implemented for them)",
                       o->speculative_method);
    if (st == ATOMC_OK && o->spec_forced_acceptance != 0) {
        if (!(o->spec_forced_acceptance > 0 && o->spec_forced_acceptance <= 1))
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "spec_forced_acceptance must be in (0, 1], got %g",
                           o->spec_forced_acceptance);
        else if (e->spec_k == 0)
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "spec_forced_acceptance needs a speculative method");
        else
            e->spec_force = o->spec_forced_acceptance;
    }
    if (st == ATOMC_OK && o->profile_dir && *o->profile_dir) {
        if (mkdir(o->profile_dir, 0755) != 0 && errno != EEXIST) {
            st = error_set(err, ATOMC_ERR_IO, "profile directory %s: %s", o->profile_dir, strerror(errno));
        } else {
            e->profile_dir = xstrdup(o->profile_dir);
            e->trace = trace_create(0);
        }
    }
    // Recurrent-state models: a cached prefix of blocks would still need the state after it (state
    // snapshots are not kept), and rejected drafts cannot be rolled back out of a state.
    bool prefix_caching = o->enable_prefix_caching;
    if (st == ATOMC_OK && e->su.num_state_slots > 0) {
        if (prefix_caching)
            LOG_INFO("prefix caching disabled: %s keeps a per-sequence recurrent state (no state snapshots)",
                     e->su.info.architecture ? e->su.info.architecture : "the model");
        prefix_caching = false;
        if (e->spec_k > 0)
            st = error_set(err, ATOMC_ERR_UNSUPPORTED, "speculative decoding is not implemented for %s: its recurrent "
                           "state cannot roll back rejected drafts",
                           e->su.info.architecture ? e->su.info.architecture : "this model");
        else if (e->su.num_state_slots < e->max_num_seqs)
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "the model runner holds %d recurrent-state slots for "
                           "max_num_seqs %d", e->su.num_state_slots, e->max_num_seqs);
    }
    if (st == ATOMC_OK)
        st = block_manager_create(e->su.num_kv_blocks, e->block_size, prefix_caching, &e->bm, err);
    if (st == ATOMC_OK) {
        struct scheduler_config sc = {.max_num_seqs = e->max_num_seqs,
                                      .max_num_batched_tokens = e->max_num_batched_tokens,
                                      .sliding_window = e->su.sliding_window,
                                      .state_slots = e->su.num_state_slots,
                                      .long_prefill_token_threshold = engine_resolve_long_prefill(o)};
        st = scheduler_create(&sc, e->bm, &e->sched, err);
    }
    if (st == ATOMC_OK && e->su.num_kv_blocks_sw > 0) {
        st = block_manager_create(e->su.num_kv_blocks_sw, e->block_size, prefix_caching, &e->bm_sw, err);
        if (st == ATOMC_OK) scheduler_set_sliding_group(e->sched, e->bm_sw, e->su.sw_window);
    }
    engine_grammar_create(e, o);
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->done, NULL);
    if (st == ATOMC_OK) st = engine_kv_create(e, o, err);
    e->next_id = 1;
    e->su.info.max_model_len = e->max_model_len;
    e->su.info.block_size = e->block_size;
    e->su.info.vocab_size = e->su.vocab_size;
    if (st != ATOMC_OK) {
        atomc_engine_free(e);
        return st;
    }
    engine_refresh_stats(e);
    *out = e;
    return ATOMC_OK;
}

static void *loop_main(void *arg) {
    atomc_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    while (!e->stop_requested) {
        if (e->n_inbox == 0 && e->n_aborts == 0 && e->sched_seqs == 0 && !e->kv_poke) {
            pthread_cond_wait(&e->wake, &e->mu);
            continue;
        }
        e->kv_poke = false;
        pthread_mutex_unlock(&e->mu);
        int n = atomc_engine_step(e);
        pthread_mutex_lock(&e->mu);
        if (n == 0 && e->n_inbox == 0 && e->n_aborts == 0 && !e->stop_requested) {
            // Work exists but nothing could run (cannot happen while max_model_len fits the
            // pool); wait a little rather than spin.
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 1000000;
            if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&e->wake, &e->mu, &ts);
        }
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

atomc_status atomc_engine_start(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    atomc_status st = ATOMC_OK;
    if (!e->thread_on) {
        e->stop_requested = false;
        if (pthread_create(&e->thread, NULL, loop_main, e) != 0) st = ATOMC_ERR_INTERNAL;
        else e->thread_on = true;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void atomc_engine_stop(atomc_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool on = e->thread_on;
    e->stop_requested = true;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
    if (on) pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->mu);
    e->thread_on = false;
    e->stop_requested = false;
    pthread_mutex_unlock(&e->mu);
}

void atomc_engine_free(atomc_engine *e) {
    if (!e) return;
    if (e->sched) {
        atomc_engine_stop(e);
        engine_drain_inbox(e);
        while (scheduler_num_running(e->sched) > 0)
            engine_retire(e, e->sched->running[0], ATOMC_FINISH_ABORT, 0, NULL, NULL);
        while (scheduler_num_waiting(e->sched) > 0)
            engine_retire(e, scheduler_waiting_at(e->sched, 0), ATOMC_FINISH_ABORT, 0, NULL, NULL);
        engine_kv_free(e);
    }
    engine_grammar_free(e);
    engine_mtp_free(e);
    scheduler_free(e->sched);
    block_manager_free(e->bm);
    block_manager_free(e->bm_sw);
    if (e->su.model.free) e->su.model.free(e->su.model.ctx);
    if (e->su.text.free) e->su.text.free(e->su.text.ctx);
    for (int i = 0; i < 8; i++) free(e->su.owned_strings[i]);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->done);
    free(e->inbox);
    free(e->aborts);
    free(e->live);
    free(e->b_tokens);
    free(e->b_positions);
    free(e->b_slots);
    free(e->b_slots_sw);
    free(e->b_tables_sw);
    free(e->b_qstart);
    free(e->b_ctx);
    free(e->b_sslots);
    free(e->b_logit_rows);
    free(e->b_rows);
    free(e->b_row_seq);
    free(e->b_tables);
    free(e->b_plp_rows);
    free(e->b_plp_targets);
    free(e->b_plp_pos);
    free(e->b_plp_seq);
    free(e->o_top);
    free(e->drained);
    trace_free(e->trace);
    free(e->profile_dir);
    free(e);
}

static void copy_msg(char *buf, size_t len, const char *msg) {
    if (buf && len) snprintf(buf, len, "%s", msg);
}

atomc_status atomc_engine_start_profile(atomc_engine *e, char *err, size_t err_len) {
    if (!e->trace) {
        copy_msg(err, err_len, "profiling is off: start the engine with a profile directory (--profile-dir DIR)");
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    trace_start(e->trace);
    return ATOMC_OK;
}

atomc_status atomc_engine_stop_profile(atomc_engine *e, char *path_out, size_t path_len, char *err_buf,
                                       size_t err_len) {
    if (!e->trace) {
        copy_msg(err_buf, err_len, "profiling is off: start the engine with a profile directory (--profile-dir DIR)");
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    if (!trace_is_enabled(e->trace)) {
        copy_msg(err_buf, err_len, "no profile is running (start one first)");
        return ATOMC_ERR_INVALID_ARGUMENT;
    }
    trace_stop(e->trace);
    char path[4096];
    pthread_mutex_lock(&e->mu);
    int n = e->profile_count++;
    pthread_mutex_unlock(&e->mu);
    snprintf(path, sizeof path, "%s/atomc-trace-%d-%d.json", e->profile_dir, (int)getpid(), n);
    struct error err = {0};
    atomc_status st = trace_write_json(e->trace, path, NULL, &err);
    if (st != ATOMC_OK) {
        copy_msg(err_buf, err_len, err.msg);
        return st;
    }
    copy_msg(path_out, path_len, path);
    return ATOMC_OK;
}

void atomc_engine_get_stats(atomc_engine *e, atomc_stats *s) {
    pthread_mutex_lock(&e->mu);
    *s = e->stats;
    s->num_waiting += e->n_inbox;
    pthread_mutex_unlock(&e->mu);
    engine_kv_live_stats(e, s);
}

void atomc_engine_get_model_info(atomc_engine *e, atomc_model_info *info) { *info = e->su.info; }

atomc_status atomc_engine_tokenize(atomc_engine *e, const char *text, size_t len, bool add_special_tokens,
                                   int32_t **ids, int *n_ids) {
    if (!e->su.text.ctx) return ATOMC_ERR_UNSUPPORTED;
    return e->su.text.encode(e->su.text.ctx, text, len, add_special_tokens, ids, n_ids, NULL);
}

atomc_status atomc_engine_detokenize(atomc_engine *e, const int32_t *ids, int n_ids, bool skip_special_tokens,
                                     char **text) {
    if (!e->su.text.ctx) return ATOMC_ERR_UNSUPPORTED;
    return e->su.text.decode(e->su.text.ctx, ids, n_ids, skip_special_tokens, text, NULL);
}

const char *atomc_engine_token_bytes(atomc_engine *e, int32_t id, size_t *len) {
    *len = 0;
    if (!e->su.text.ctx || !e->su.text.token_bytes || id < 0) return NULL;
    return e->su.text.token_bytes(e->su.text.ctx, id, len);
}
