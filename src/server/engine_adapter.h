// Builds the server's engine table (server_engine.h) from a running atomc_engine plus the
// model's tokenizer (for /tokenize, prompt lengths and logprob token strings) and chat template
// (compiled once; rendered per request).
#ifndef ATOMC_SERVER_ENGINE_ADAPTER_H
#define ATOMC_SERVER_ENGINE_ADAPTER_H

#include "atomc.h"
#include "common/error.h"
#include "server/server_engine.h"

struct engine_adapter;

// chat_template: NULL (the model's own), a file path, or the template text itself (as vLLM's
// --chat-template). Fills *out; the adapter must outlive every use of the table.
atomc_status engine_adapter_create(atomc_engine *e, const char *model_path, const char *chat_template,
                                   struct engine_adapter **adapter, struct server_engine *out, struct error *err);
void engine_adapter_free(struct engine_adapter *a);

#endif
