// The engine's seams: what it needs from the model side and the text side, as function
// pointers. atomc_engine_create (engine_create.c) plugs in the real model runner and
// tokenizer; tests plug in a deterministic fake model (and fake tokenizer) so the whole
// engine loop (scheduling, batching, stop rules, streaming, threading) runs without weights.
#ifndef ATOMC_ENGINE_ENGINE_INTERNAL_H
#define ATOMC_ENGINE_ENGINE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"
#include "common/error.h"
#include "runtime/model_runner.h"

struct engine_model_ops {
    void *ctx;
    // Computes fb (writes KV at slot_mapping, samples logits rows); see model_runner_execute.
    atomc_status (*execute)(void *ctx, const struct forward_batch *fb, struct runner_output *out, struct error *err);
    void (*free)(void *ctx); // may be NULL
    // CUDA graph replays so far (tests check the decode graphs ran); may be NULL (= 0).
    uint64_t (*graph_replays)(void *ctx);
};

// Text side. ctx NULL = no tokenizer: text prompts and stop strings are rejected, outputs
// carry no text.
struct engine_text_ops {
    void *ctx;
    atomc_status (*encode)(void *ctx, const char *text, size_t len, bool add_special_tokens, int32_t **ids,
                           int *n_ids, struct error *err);
    atomc_status (*decode)(void *ctx, const int32_t *ids, int n_ids, bool skip_special_tokens, char **out,
                           struct error *err);
    // Incremental detokenizer of one sequence (see tokenizer.h detokenizer_step).
    void *(*detok_new)(void *ctx, bool skip_special_tokens);
    atomc_status (*detok_step)(void *state, const int32_t *ids, int n_ids, int n_new, bool final, char **out,
                               size_t *out_len);
    void (*detok_free)(void *state);
    const char *(*token_bytes)(void *ctx, int32_t id, size_t *len); // may be NULL
    void (*free)(void *ctx); // may be NULL
};

struct tokenizer;
// Text ops over a loaded tokenizer (engine_text.c); the ops own it (freed with the engine).
void engine_text_ops_from_tokenizer(struct engine_text_ops *ops, struct tokenizer *tok);

#define ENGINE_MAX_EOS 16

struct engine_setup {
    struct engine_model_ops model;
    struct engine_text_ops text;
    int num_kv_blocks;
    int vocab_size;
    int max_model_len;              // the model's limit (options may lower it)
    int sliding_window;             // model_runner_sliding_window: > 0 frees blocks out of the window
    int32_t eos_ids[ENGINE_MAX_EOS]; // config + generation_config + tokenizer
    int n_eos;
    atomc_model_info info;          // strings must outlive the engine (owned by ctx / strings below)
    char *owned_strings[8];         // freed with the engine
};

// Takes ownership of setup's contexts (freed with the engine, also on failure).
atomc_status engine_create_with(const atomc_engine_options *o, struct engine_setup *setup, atomc_engine **out,
                                struct error *err);

// max_num_seqs / max_num_batched_tokens after defaults (0 = auto: 256 / 8192 on cuda, 16 / 2048
// on cpu; the token budget is raised to max_num_seqs when only the latter was given).
void engine_resolve_limits(const atomc_engine_options *o, int *max_num_seqs, int *max_num_batched_tokens);

// For tests: the engine's block manager (only touch it between steps, loop thread stopped).
struct block_manager *engine_block_manager(atomc_engine *e);
// For tests: the model's CUDA graph replays so far (0 on the CPU or with --enforce-eager).
uint64_t engine_graph_replays(atomc_engine *e);

#endif
