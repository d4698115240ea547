// What the HTTP server needs from an engine, as a table of functions. Production code builds it
// from an atomc_engine plus the model's tokenizer and chat template (engine_adapter.c); the C
// tests build it from a scripted fake engine so the HTTP/SSE/abort machinery is tested without
// a model. Every function may be called from the server's event-loop thread; output callbacks
// (atomc_request.on_output) may fire on any thread.
#ifndef ATOMC_SERVER_SERVER_ENGINE_H
#define ATOMC_SERVER_SERVER_ENGINE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomc.h"
#include "common/error.h"

struct server_engine {
    void *ctx;
    atomc_status (*add_request)(void *ctx, const atomc_request *r, uint64_t *id, char *err, size_t err_len);
    atomc_status (*abort_request)(void *ctx, uint64_t id);
    void (*get_stats)(void *ctx, atomc_stats *s);
    atomc_status (*tokenize)(void *ctx, const char *text, size_t len, bool add_special_tokens, int32_t **ids,
                             int *n_ids, struct error *err);
    atomc_status (*detokenize)(void *ctx, const int32_t *ids, int n_ids, bool skip_special_tokens, char **text,
                               struct error *err);
    // Raw bytes of one token as it appears in decoded text (may be a partial UTF-8 sequence); NULL if invalid.
    const char *(*token_bytes)(void *ctx, int32_t id, size_t *len);
    // Renders chat messages (validated, content normalised to strings) to prompt text (*out malloc'd).
    // ATOMC_ERR_UNSUPPORTED when the model has no chat template.
    atomc_status (*render_chat)(void *ctx, json_t *messages, json_t *tools, bool add_generation_prompt,
                                bool continue_final_message, json_t *kwargs, char **out, struct error *err);
    // Profiling (POST /start_profile, /stop_profile); NULL when the engine cannot profile.
    atomc_status (*start_profile)(void *ctx, char *err, size_t err_len);
    atomc_status (*stop_profile)(void *ctx, char *path, size_t path_len, char *err, size_t err_len);
    int max_model_len;
    int vocab_size;
    const char *model_path;    // shown as "root" in /v1/models
    const char *bos_token;     // GET /tokenizer_info; NULL when the model has none
    const char *eos_token;
    const char *chat_template; // template source, NULL when the model has none
    // KV transfer identity (atomc_engine_get_kv_info), for kv_transfer_params in responses and
    // GET /v1/kv_transfer; role 0 = none.
    int kv_role;
    const char *kv_engine_id, *kv_host;
    int kv_port;
};

#endif
