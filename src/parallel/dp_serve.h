// The HTTP server's engine table over a data-parallel router: add / abort / stats go through
// dp_router (fewest-outstanding-tokens routing, routed ids), everything else (tokenizer, chat
// template, limits) is forwarded to the table of replica 0's engine adapter (all replicas
// serve the same model).
#ifndef ATOMC_PARALLEL_DP_SERVE_H
#define ATOMC_PARALLEL_DP_SERVE_H

#include "parallel/dp_router.h"
#include "server/server_engine.h"

struct dp_serve;

// inner: replica 0's table (copied); *out receives the routed table. Free after the server.
struct dp_serve *dp_serve_wrap(struct dp_router *r, const struct server_engine *inner, struct server_engine *out);
void dp_serve_free(struct dp_serve *d);

#endif
