// Recurrent-state slots of the model runner (runner_internal.h): the per-sequence state of
// recurrent layers (CACHE_KIND_RECURRENT: Gated DeltaNet's conv state and delta-rule state),
// which is fixed-size per sequence instead of growing per token, so it lives in slots, not in
// the paged KV pool.
//
// Slots: max_num_seqs + 1, F32. The engine's scheduler gives each running sequence one of the
// first max_num_seqs (at admission; freed on finish, abort and preemption) and passes it per
// sequence in forward_batch.state_slots; slot max_num_seqs is a dummy that padding sequences of
// graph-replayed decode steps (and batches without slots, the graph captures) write. A state is
// never cleared in memory: a step that starts a sequence's cache (a new or recomputed sequence)
// starts from zero inside the ops (backend.h), so a freed slot needs no reset.
//
// Layout: one allocation; per recurrent layer, in layer order, its conv state (slots, conv_dim,
// K - 1) then its delta-rule state (slots, Hv, Dk, Dv), bound to the layer's kv->k / kv->v.
// Allocated before the KV pool is sized, so on CUDA the KV pool gets what
// gpu_memory_utilization leaves after the weights, the activations and the state (the two pools
// are sized together from one budget); start-up logs both.
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "runtime/runner_internal.h"

bool runner_state_needed(const struct model_runner *r) {
    for (int l = 0; l < r->cfg.num_layers; l++)
        if (r->model->layer_cache[l].kind == CACHE_KIND_RECURRENT) return true;
    return false;
}

static size_t layer_state_bytes(const struct cache_spec *s, int n_slots) {
    return (size_t)n_slots *
           ((size_t)s->conv_dim * (size_t)(s->conv_kernel - 1) +
            (size_t)s->n_v_heads * (size_t)s->k_dim * (size_t)s->v_dim) *
           sizeof(float);
}

atomc_status runner_state_alloc(struct model_runner *r, struct error *err) {
    struct backend *b = r->backend;
    const int n = r->max_seqs + 1;
    size_t bytes = 0;
    for (int l = 0; l < r->cfg.num_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        if (s->kind != CACHE_KIND_RECURRENT) continue;
        CHECK(s->conv_dim > 0 && s->conv_kernel >= 1 && s->n_v_heads > 0 && s->k_dim > 0 && s->v_dim > 0);
        bytes += layer_state_bytes(s, n);
    }
    r->state_pool = b->ops->alloc(b, bytes);
    if (!r->state_pool)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY,
                         "cannot allocate the recurrent state of %d sequences (%.1f MiB): "
                         "lower max_num_seqs",
                         r->max_seqs, (double)bytes / (1 << 20));
    b->ops->memset_zero(b, r->state_pool, bytes); // padding slots never read NaN bit patterns
    r->state_bytes = bytes;
    r->n_state_slots = r->max_seqs;
    r->state_seen = xcalloc((size_t)n, 1);
    LOG_INFO("recurrent state: %d slots (+1 padding) x %.1f KiB = %.1f MiB", r->max_seqs, (double)bytes / n / 1024.0,
             (double)bytes / (1 << 20));
    return ATOMC_OK;
}

void runner_state_bind(struct model_runner *r) {
    if (!r->state_pool || !r->kv) return;
    const int64_t n = r->n_state_slots + 1;
    char *base = r->state_pool;
    for (int l = 0; l < r->cfg.num_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        if (s->kind != CACHE_KIND_RECURRENT) continue;
        struct kv_layer *kv = &r->kv[l];
        kv->k = tensor_make(base, DTYPE_F32, 3, (int64_t[]){n, s->conv_dim, s->conv_kernel - 1});
        base += tensor_bytes(&kv->k);
        kv->v = tensor_make(base, DTYPE_F32, 4, (int64_t[]){n, s->n_v_heads, s->k_dim, s->v_dim});
        base += tensor_bytes(&kv->v);
    }
    CHECK((size_t)(base - (char *)r->state_pool) == r->state_bytes);
}

void runner_state_release(struct model_runner *r) {
    if (r->state_pool) r->backend->ops->free(r->backend, r->state_pool);
    r->state_pool = NULL;
    free(r->state_seen);
    r->state_seen = NULL;
    r->state_bytes = 0;
    r->n_state_slots = 0;
}

// A batch of a recurrent model names a distinct engine slot per sequence.
atomc_status runner_state_validate(const struct model_runner *r, const struct forward_batch *fb, struct error *err) {
    if (!r->n_state_slots) return ATOMC_OK;
    if (!fb->state_slots)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "%s keeps recurrent state: the forward batch needs "
                         "state_slots",
                         r->cfg.architecture);
    atomc_status st = ATOMC_OK;
    int s = 0;
    for (; s < fb->n_seqs; s++) {
        int k = fb->state_slots[s];
        if (k < 0 || k >= r->n_state_slots) {
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "sequence %d: state slot %d outside 0..%d", s, k,
                           r->n_state_slots - 1);
            break;
        }
        if (r->state_seen[k]) {
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "sequence %d: state slot %d is used twice in the batch", s,
                           k);
            break;
        }
        r->state_seen[k] = 1;
    }
    for (int j = 0; j < s; j++)
        r->state_seen[fb->state_slots[j]] = 0;
    return st;
}
