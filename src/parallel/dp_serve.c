// Routed server engine table (see dp_serve.h).
#include <stdlib.h>

#include "common/check.h"
#include "parallel/dp_serve.h"

struct dp_serve {
    struct dp_router *router;
    struct server_engine inner;
};

static atomc_status d_add(void *ctx, const atomc_request *r, uint64_t *id, char *err, size_t err_len) {
    struct dp_serve *d = ctx;
    return dp_router_add_request(d->router, r, id, err, err_len);
}

static atomc_status d_abort(void *ctx, uint64_t id) {
    struct dp_serve *d = ctx;
    return dp_router_abort(d->router, id);
}

static void d_stats(void *ctx, atomc_stats *s) {
    struct dp_serve *d = ctx;
    dp_router_get_stats(d->router, s);
}

static atomc_status d_tokenize(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids, int *n,
                               struct error *err) {
    struct dp_serve *d = ctx;
    return d->inner.tokenize(d->inner.ctx, text, len, add_special, ids, n, err);
}

static atomc_status d_detokenize(void *ctx, const int32_t *ids, int n, bool skip, char **text, struct error *err) {
    struct dp_serve *d = ctx;
    return d->inner.detokenize(d->inner.ctx, ids, n, skip, text, err);
}

static const char *d_token_bytes(void *ctx, int32_t id, size_t *len) {
    struct dp_serve *d = ctx;
    return d->inner.token_bytes(d->inner.ctx, id, len);
}

static atomc_status d_render(void *ctx, json_t *messages, json_t *tools, bool add_gen, bool cont, json_t *kwargs,
                             char **out, struct error *err) {
    struct dp_serve *d = ctx;
    return d->inner.render_chat(d->inner.ctx, messages, tools, add_gen, cont, kwargs, out, err);
}

// Profiling covers the replica the inner table was built over (its engine's steps).
static atomc_status d_start_profile(void *ctx, char *err, size_t err_len) {
    struct dp_serve *d = ctx;
    return d->inner.start_profile(d->inner.ctx, err, err_len);
}

static atomc_status d_stop_profile(void *ctx, char *path, size_t path_len, char *err, size_t err_len) {
    struct dp_serve *d = ctx;
    return d->inner.stop_profile(d->inner.ctx, path, path_len, err, err_len);
}

// Every function pointer of `inner` must be wrapped here: the copy gets ctx = d, so an unwrapped
// one would be called with the wrong context.
struct dp_serve *dp_serve_wrap(struct dp_router *r, const struct server_engine *inner, struct server_engine *out) {
    struct dp_serve *d = xcalloc(1, sizeof *d);
    d->router = r;
    d->inner = *inner;
    *out = *inner;
    out->ctx = d;
    out->add_request = d_add;
    out->abort_request = d_abort;
    out->get_stats = d_stats;
    out->tokenize = d_tokenize;
    out->detokenize = d_detokenize;
    out->token_bytes = d_token_bytes;
    out->render_chat = d_render;
    out->start_profile = inner->start_profile ? d_start_profile : NULL;
    out->stop_profile = inner->stop_profile ? d_stop_profile : NULL;
    return d;
}

void dp_serve_free(struct dp_serve *d) { free(d); }
