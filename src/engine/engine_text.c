// The engine's text seam over the real tokenizer (src/tokenizer): encode, decode and the
// incremental detokenizer. Kept apart from engine_create.c so tests can pair a real
// tokenizer with a fake model without linking the model runner.
#include <stdlib.h>

#include "common/check.h"
#include "engine/engine_internal.h"
#include "tokenizer/tokenizer.h"

static atomc_status tok_encode(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids, int *n,
                               struct error *err) {
    return tokenizer_encode(ctx, text, len, add_special, ids, n, err);
}

static atomc_status tok_decode(void *ctx, const int32_t *ids, int n, bool skip_special, char **out,
                               struct error *err) {
    return tokenizer_decode(ctx, ids, n, skip_special, out, err);
}

static void *tok_detok_new(void *ctx, bool skip_special) {
    struct detokenizer *d = xcalloc(1, sizeof *d);
    detokenizer_init(d, ctx, skip_special);
    return d;
}

static atomc_status tok_detok_step(void *state, const int32_t *ids, int n_ids, int n_new, bool final, char **out,
                                   size_t *out_len) {
    return detokenizer_step(state, ids, n_ids, n_new, final, out, out_len);
}

static void tok_detok_free(void *state) {
    detokenizer_free(state);
    free(state);
}

static void tok_free(void *ctx) { tokenizer_free(ctx); }

static const char *tok_token_bytes(void *ctx, int32_t id, size_t *len) { return tokenizer_token_bytes(ctx, id, len); }

static bool tok_is_special(void *ctx, int32_t id) { return tokenizer_is_special(ctx, id); }

void engine_text_ops_from_tokenizer(struct engine_text_ops *ops, struct tokenizer *tok) {
    *ops = (struct engine_text_ops){.ctx = tok,
                                    .encode = tok_encode,
                                    .decode = tok_decode,
                                    .detok_new = tok_detok_new,
                                    .detok_step = tok_detok_step,
                                    .detok_free = tok_detok_free,
                                    .token_bytes = tok_token_bytes,
                                    .is_special = tok_is_special,
                                    .free = tok_free};
}
