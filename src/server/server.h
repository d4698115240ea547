// The OpenAI-compatible HTTP server (libevent + llhttp, HTTP/1.1, on one event-loop thread).
//
// Life cycle (driven by src/cli/cmd_serve.c):
//   server_create()        binds the socket; /health answers 503 "loading" from then on
//   server_attach_engine() (any thread, once the model is loaded) starts serving requests
//   server_run()           runs the event loop until SIGINT/SIGTERM (or server_shutdown) and the drain ends
//   ... stop / free the engine (its final callbacks may still arrive) ...
//   server_free()          frees everything; no request state outlives it
//
// Threads: every HTTP object is touched only on the loop thread. Engine callbacks (on the
// engine's thread) copy each output into the request's queue under a mutex and wake the loop
// through an eventfd; the loop turns queued outputs into SSE chunks or the final JSON body.
// Request state is reference counted (HTTP side + one per live engine sub-request + one while
// queued for the loop) and freed by whichever side lets go last.
#ifndef ATOMC_SERVER_SERVER_H
#define ATOMC_SERVER_SERVER_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"
#include "server/reasoning_parser.h"
#include "server/server_engine.h"
#include "server/tool_parser.h"

#define SERVER_MAX_MODEL_NAMES 8

struct server_options {
    const char *host;                                  // default "127.0.0.1"
    int port;                                          // default 8000; 0 = any free port (see server_port)
    const char *api_key;                               // NULL = no authentication
    const char *model_names[SERVER_MAX_MODEL_NAMES];   // served names; the first is the default
    int n_model_names;
    size_t max_body_bytes;                             // default 32 MiB (413 past it)
    size_t max_header_bytes;                           // default 64 KiB
    int max_n;                                         // upper bound on n (default 64)
    double drain_timeout_s;                            // SIGTERM: wait this long for in-flight requests (default 30)
    size_t max_pending_output_bytes;                   // per connection; a slower reader is aborted (default 64 MiB)
    double idle_timeout_s;                             // stalled transfer (no byte moving) timeout (default 300);
                                                       // a request waiting for the engine is exempt
    int max_connections;                               // open connections at most (0 = from the descriptor limit,
                                                       // see server_default_max_connections); past it the oldest
                                                       // connection without a request in progress is closed
    double timeout_keep_alive_s;                       // a connection without a request in progress that sends
                                                       // nothing for this long is closed (default 5, vLLM's)
    double request_read_timeout_s;                     // a request (headers and body) must arrive within this long
                                                       // of its first byte, or the connection is closed (default 60)
    bool install_signal_handlers;                      // SIGINT/SIGTERM drain (default true)
    bool profiling;                                    // the engine has a profile directory: /start_profile and
                                                       // /stop_profile work (otherwise 404, as vLLM without
                                                       // VLLM_TORCH_PROFILER_DIR)
    bool webui;                                        // GET / serves the built-in chat page (default true;
                                                       // `atomc serve --no-webui` turns it off: GET / is 404)
    enum tool_parser_kind tool_parser;                 // chat output parsed for tool calls when the request
                                                       // has tools (vLLM --enable-auto-tool-choice
                                                       // --tool-call-parser); default NONE
    enum reasoning_parser_kind reasoning_parser;       // chat output split into reasoning_content and content
                                                       // (vLLM --reasoning-parser); default NONE
};
void server_options_init(struct server_options *o);

struct server;

atomc_status server_create(const struct server_options *o, struct server **out, struct error *err);
int server_port(const struct server *s); // the bound port (useful with port 0)
// Hands the loaded engine to the server (thread-safe; the table is copied).
void server_attach_engine(struct server *s, const struct server_engine *eng);
// Marks the engine as failed (/health 503 with the message; new requests 503). Thread-safe.
void server_mark_failed(struct server *s, const char *msg);
// Runs the event loop until shutdown has drained. Returns 0.
int server_run(struct server *s);
// Starts a graceful shutdown from any thread (what SIGTERM does).
void server_shutdown(struct server *s);
void server_free(struct server *s);
// The default connection cap: the soft descriptor limit less headroom (1/8, at least 64).
int server_default_max_connections(void);

#endif
