// The KV pool of the model runner (runner_internal.h): one allocation laid out per layer by the
// layer's cache spec (struct cache_spec, model.h), sized from num_kv_blocks, the CPU's
// cpu_kv_cache_bytes, or (CUDA) a profile forward and gpu_memory_utilization, as vLLM does.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "kv_transfer/kv_connector.h"
#include "runtime/runner_internal.h"

// The CPU pool's default ceiling in tokens (below max_model_len it is max_model_len): llama-server's
// default context for the models it is usually run with (one slot's worth, shared by its slots).
#define CPU_KV_DEFAULT_TOKENS 8192

// Per-layer-group block tables: layer l's K/V live in the sliding group's pool.
static bool layer_in_sw_group(const struct model_runner *r, int l) {
    return r->kv_groups && r->model->layer_cache[l].kind == CACHE_KIND_SLIDING;
}

// Bytes of one block (block_size tokens) summed over the paged caches of the layers of one group
// (sw: the sliding group's; else the others; without groups every layer is in the first).
static size_t runner_kv_group_block_bytes(const struct model_runner *r, bool sw) {
    size_t per_token = 0;
    for (int l = 0; l < r->model->n_cache_layers; l++)
        if (layer_in_sw_group(r, l) == sw) per_token += cache_spec_token_bytes(&r->model->layer_cache[l], r->kv_dtype);
    return per_token * (size_t)r->block_size;
}

// Bytes of one block (block_size tokens) summed over every layer's paged cache.
size_t runner_kv_block_bytes(const struct model_runner *r) {
    size_t per_token = 0;
    for (int l = 0; l < r->model->n_cache_layers; l++) per_token += cache_spec_token_bytes(&r->model->layer_cache[l], r->kv_dtype);
    return per_token * (size_t)r->block_size;
}

// Per-layer-group block tables (vLLM's hybrid KV-cache manager, with a pool per group): on when
// asked for and the model mixes sliding-window layers (all of one window) with layers that keep
// every token (full K/V or latent rows). A model whose paged layers all slide keeps one table
// (the engine frees out-of-window blocks of it directly).
void runner_kv_plan_groups(struct model_runner *r, const struct runner_options *o) {
    r->kv_groups = false;
    r->sw_window = 0;
    r->num_blocks_sw = 0;
    if (!o->hybrid_kv_groups || (o->tp_size > 1)) return;
    int window = 0, n_sw = 0, n_full = 0;
    for (int l = 0; l < r->cfg.num_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        if (s->kind == CACHE_KIND_SLIDING) {
            if (window && s->window != window) return; // several windows: one group each is not done yet
            window = s->window;
            n_sw++;
        } else if (s->kind != CACHE_KIND_RECURRENT) {
            n_full++;
        }
    }
    if (n_sw == 0 || n_full == 0) return;
    r->kv_groups = true;
    r->sw_window = window;
}

bool model_runner_kv_groups(const struct model_runner *r, int *window, int *num_blocks_sw) {
    if (window) *window = r->kv_groups ? r->sw_window : 0;
    if (num_blocks_sw) *num_blocks_sw = r->kv_groups ? r->num_blocks_sw : 0;
    return r->kv_groups;
}

// Refuses cache kinds the runner cannot hold yet (a model declaring one must not load).
atomc_status runner_kv_check_specs(const struct model_runner *r, struct error *err) {
    for (int l = 0; l < r->model->n_cache_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        if (s->kind == CACHE_KIND_RECURRENT && !r->state_pool)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s layer %d keeps a %s but the runner has no state slots",
                             r->cfg.architecture, l, cache_kind_name(s->kind));
        if (s->kind == CACHE_KIND_SLIDING && s->window <= 0)
            return error_set(err, ATOMC_ERR_FORMAT, "%s layer %d: sliding-window cache with window %d",
                             r->cfg.architecture, l, s->window);
    }
    return ATOMC_OK;
}

// One allocation; per layer, in layer order: FULL / SLIDING: K (blocks, block_size, kv_heads,
// head_dim_k) then V (..., head_dim_v); LATENT: the latent rows (blocks, block_size, 1,
// latent_dim) as k, and with DSA the indexer keys (blocks, block_size, 1, index_dim) as v. For a
// model whose layers all keep full K/V of one shape this is the layout the runner always had. With
// per-layer-group block tables the sliding-window layers' tensors hold r->num_blocks_sw blocks,
// the others num_blocks.
atomc_status runner_kv_alloc(struct model_runner *r, int num_blocks, struct error *err) {
    struct backend *b = r->backend;
    size_t per_block = runner_kv_group_block_bytes(r, false);
    r->kv_bytes = per_block * (size_t)num_blocks + runner_kv_group_block_bytes(r, true) * (size_t)r->num_blocks_sw;
    r->kv_pool = b->ops->alloc(b, r->kv_bytes);
    if (!r->kv_pool)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate the KV cache: %d blocks of %d tokens (%.1f MiB)",
                         num_blocks, r->block_size, (double)r->kv_bytes / (1 << 20));
    // Zeroed once so that padded graph slots (which read block 0) never see NaN bit patterns.
    b->ops->memset_zero(b, r->kv_pool, r->kv_bytes);
    r->num_blocks = num_blocks;
    if (!r->kv) r->kv = xcalloc((size_t)r->model->n_cache_layers, sizeof *r->kv);
    const size_t e = dtype_row_bytes(r->kv_dtype, 1);
    char *base = r->kv_pool;
    for (int l = 0; l < r->model->n_cache_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        struct kv_layer *kv = &r->kv[l];
        const int nb = layer_in_sw_group(r, l) ? r->num_blocks_sw : num_blocks;
        const size_t slots = (size_t)nb * (size_t)r->block_size;
        memset(kv, 0, sizeof *kv);
        // An FP8 cache of a checkpoint with KV-cache scales stores value / scale (the attention
        // ops multiply back); without them, and for other dtypes, the scale is 1.
        const bool scaled = r->kv_dtype == DTYPE_FP8_E4M3 && s->k_scale > 0.0f && s->v_scale > 0.0f;
        kv->k_scale = scaled ? s->k_scale : 1.0f;
        kv->v_scale = scaled ? s->v_scale : 1.0f;
        if (s->kind == CACHE_KIND_RECURRENT) continue; // state slots (runner_state.c), bound below
        if (s->kind == CACHE_KIND_LATENT) {
            kv->k = tensor_make(base, r->kv_dtype, 4, (int64_t[]){nb, r->block_size, 1, s->latent_dim});
            base += slots * (size_t)s->latent_dim * e;
            if (s->index_dim > 0) { // DSA: the indexer's keys beside the latent, as v
                kv->v = tensor_make(base, r->kv_dtype, 4, (int64_t[]){nb, r->block_size, 1, s->index_dim});
                base += slots * (size_t)s->index_dim * e;
            }
            continue;
        }
        kv->k = tensor_make(base, r->kv_dtype, 4, (int64_t[]){nb, r->block_size, s->n_kv_heads, s->head_dim_k});
        base += slots * (size_t)s->n_kv_heads * (size_t)s->head_dim_k * e;
        kv->v = tensor_make(base, r->kv_dtype, 4, (int64_t[]){nb, r->block_size, s->n_kv_heads, s->head_dim_v});
        base += slots * (size_t)s->n_kv_heads * (size_t)s->head_dim_v * e;
    }
    CHECK((size_t)(base - (char *)r->kv_pool) == r->kv_bytes);
    runner_state_bind(r);
    return ATOMC_OK;
}

void runner_kv_release(struct model_runner *r) {
    if (r->kv_pool) r->backend->ops->free(r->backend, r->kv_pool);
    r->kv_pool = NULL;
    r->num_blocks = 0;
    r->num_blocks_sw = 0;
}

// A forward of the largest batch (max_num_batched_tokens prompt tokens in as many sequences
// as allowed) over a temporary minimal KV pool, so memory the backend allocates lazily
// (GEMM workspaces, attention scratch) is counted before the KV pool is sized.
static atomc_status runner_profile(struct model_runner *r, struct error *err) {
    int T = r->max_tokens, bs = r->block_size;
    int per_seq = r->max_model_len < T ? r->max_model_len : T;
    int S = (T + per_seq - 1) / per_seq;
    if (S > r->max_seqs) S = r->max_seqs;
    if (T > S * per_seq) T = S * per_seq;
    int blocks_per_seq = (per_seq + bs - 1) / bs;
    r->num_blocks_sw = r->kv_groups ? blocks_per_seq : 0;
    atomc_status st = runner_kv_alloc(r, blocks_per_seq, err);
    if (st != ATOMC_OK) return error_prefix(err, "profile run: ");
    int32_t *ids = xcalloc((size_t)T, 4), *pos = xcalloc((size_t)T, 4), *slot = xcalloc((size_t)T, 4);
    int32_t *qs = xcalloc((size_t)S + 1, 4), *ctx = xcalloc((size_t)S, 4);
    int32_t *bt = xcalloc((size_t)S * (size_t)blocks_per_seq, 4), *rows = xcalloc((size_t)S, 4);
    int32_t *sslots = xcalloc((size_t)S, 4); // recurrent-state slot s for sequence s (S <= max_num_seqs)
    for (int s = 0; s < S; s++) sslots[s] = s;
    int t = 0;
    for (int s = 0; s < S; s++) {
        int n = T - t < per_seq ? T - t : per_seq;
        qs[s] = t;
        for (int i = 0; i < n; i++, t++) {
            pos[t] = i;
            slot[t] = s == 0 ? i : -1; // sequence 0 writes the temporary pool; the others only read it
        }
        ctx[s] = n;
        for (int j = 0; j < blocks_per_seq; j++) bt[(size_t)s * blocks_per_seq + j] = j;
        rows[s] = t - 1;
    }
    qs[S] = t;
    struct forward_batch fb = {.n_seqs = S, .n_tokens = T, .token_ids = ids, .positions = pos, .query_start = qs,
                               .context_lens = ctx, .block_tables = bt, .max_blocks_per_seq = blocks_per_seq,
                               .slot_mapping = slot, .block_tables_sw = r->kv_groups ? bt : NULL,
                               .slot_mapping_sw = r->kv_groups ? slot : NULL,
                               .n_logits = S < r->max_rows ? S : r->max_rows,
                               .logits_rows = rows, .state_slots = r->n_state_slots ? sslots : NULL};
    st = runner_validate(r, &fb, err);
    if (st == ATOMC_OK) st = runner_forward(r, &fb, fb.n_logits, err);
    r->backend->ops->synchronize(r->backend);
    free(ids); free(pos); free(slot); free(qs); free(ctx); free(bt); free(rows); free(sslots);
    runner_kv_release(r);
    return st;
}

atomc_status runner_size_kv(struct model_runner *r, const struct runner_options *o, struct error *err) {
    atomc_status st0 = runner_kv_check_specs(r, err);
    if (st0 != ATOMC_OK) return st0;
    size_t per_block = runner_kv_block_bytes(r);
    int64_t min_blocks = ((int64_t)r->max_model_len + r->block_size - 1) / r->block_size; // no int overflow
    // Hybrid groups: the sliding group's pool holds what max_num_seqs sequences read at their
    // window (ceil((W - 1) / bs) + 1 blocks each) plus the blocks of one step's new tokens (a
    // chunk's K/V is written before it is attended to: max_num_batched_tokens / bs, + 1 per
    // sequence for partial blocks), never more than the full group's worst case; the rest of the
    // budget goes to the full group. A step never needs more (the scheduler cuts chunks to both
    // groups' free blocks), so the static split costs no preemption.
    int64_t sw_blocks = 0;
    size_t bytes_sw = 0, bytes_full = per_block;
    if (r->kv_groups) {
        const int64_t bs = r->block_size, W = r->sw_window;
        sw_blocks = (int64_t)r->max_seqs * ((W - 1 + bs - 1) / bs + 2) + ((int64_t)r->max_tokens + bs - 1) / bs;
        if (sw_blocks > (int64_t)r->max_seqs * min_blocks) sw_blocks = (int64_t)r->max_seqs * min_blocks;
        bytes_sw = runner_kv_group_block_bytes(r, true);
        bytes_full = runner_kv_group_block_bytes(r, false);
    }
    int64_t blocks;
    const char *how;
    if (o->num_kv_blocks > 0) {
        blocks = o->num_kv_blocks;
        how = "num_kv_blocks";
        if (sw_blocks > blocks) sw_blocks = blocks; // never more sliding blocks than full ones
    } else if (r->backend->kind == BACKEND_CPU) {
        // Default: what max_num_seqs sequences of max_model_len tokens need, at most
        // max(max_model_len, CPU_KV_DEFAULT_TOKENS) tokens (then the scheduler preempts, as with
        // any full pool): the pool is sized to what is asked (--max-model-len 512 --max-num-seqs 8
        // holds 4096 tokens, as llama-server -c 4096 -np 8), and the defaults (the model's context,
        // 16 sequences) hold one full-length context, as llama-server's default does.
        // cpu_kv_cache_bytes overrides.
        if (o->cpu_kv_cache_bytes == 0) {
            const int64_t cap_tokens = r->max_model_len > CPU_KV_DEFAULT_TOKENS ? r->max_model_len : CPU_KV_DEFAULT_TOKENS;
            const int64_t cap = (cap_tokens + r->block_size - 1) / r->block_size;
            blocks = min_blocks > INT64_MAX / r->max_seqs ? INT64_MAX : min_blocks * r->max_seqs;
            if (blocks > cap) blocks = cap;
            if (blocks < min_blocks) blocks = min_blocks;
            how = "the default CPU pool";
        } else {
            blocks = (int64_t)(o->cpu_kv_cache_bytes / per_block);
            how = "cpu_kv_cache_bytes";
        }
        if (r->kv_groups) { // the same bytes, split: the sliding group's share first
            const size_t bytes = (size_t)blocks * per_block;
            if ((size_t)sw_blocks * bytes_sw > bytes / 2) sw_blocks = (int64_t)(bytes / 2 / bytes_sw);
            blocks = (int64_t)((bytes - (size_t)sw_blocks * bytes_sw) / bytes_full);
        }
    } else {
        atomc_status st = runner_profile(r, err);
        if (st != ATOMC_OK) return st;
        size_t free_b = 0, total_b = 0;
        r->backend->ops->memory_info(r->backend, &free_b, &total_b);
        // As vLLM: gpu_memory_utilization is this instance's share of the device's memory; the KV
        // cache gets that share less what this instance's weights and activations took since
        // before the load (so a second instance on the same GPU, e.g. P/D's prefill and decode
        // at 0.45 each, is not charged for the first one's memory), and never more than is free
        // now less a margin.
        double util = o->gpu_memory_utilization > 0 ? o->gpu_memory_utilization : 0.9;
        double used = r->mem_free_at_load > free_b ? (double)(r->mem_free_at_load - free_b)
                                                   : (double)total_b - (double)free_b;
        double avail = util * (double)total_b - used;
        const double margin = 512.0 * 1048576.0;
        if (avail > (double)free_b - margin) avail = (double)free_b - margin;
        blocks = avail > 0 ? (int64_t)(avail / (double)per_block) : 0;
        how = "gpu_memory_utilization";
        if (r->kv_groups && avail > 0) {
            if ((double)sw_blocks * (double)bytes_sw > avail / 2) sw_blocks = (int64_t)(avail / 2 / (double)bytes_sw);
            blocks = (int64_t)((avail - (double)sw_blocks * (double)bytes_sw) / (double)bytes_full);
        }
        LOG_INFO("memory: %.2f GiB free of %.2f GiB after weights (%.2f GiB) and activations (this instance: "
                 "%.2f GiB of its %.2f GiB share); KV gets %.2f GiB",
                 free_b / 1073741824.0, total_b / 1073741824.0, r->model->weight_bytes / 1073741824.0,
                 used / 1073741824.0, util * total_b / 1073741824.0, blocks * (double)per_block / 1073741824.0);
    }
    if (blocks < min_blocks)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY,
                         "the KV cache (%s) holds %lld blocks of %d tokens, but one sequence of max_model_len %d "
                         "needs %lld blocks (%.1f MiB): raise the KV memory or lower max_model_len",
                         how, (long long)blocks, r->block_size, r->max_model_len, (long long)min_blocks,
                         (double)per_block * min_blocks / (1 << 20));
    if (blocks > INT32_MAX / r->block_size) blocks = INT32_MAX / r->block_size;
    if (r->kv_groups) {
        int64_t need_sw = (r->sw_window - 1 + r->block_size - 1) / r->block_size + 2;
        if (need_sw > min_blocks) need_sw = min_blocks;
        if (sw_blocks < need_sw)
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "the KV cache (%s) leaves the sliding-window layers %lld "
                             "blocks, but one sequence needs %lld (window %d): raise the KV memory", how,
                             (long long)sw_blocks, (long long)need_sw, r->sw_window);
        r->num_blocks_sw = (int)sw_blocks;
        int n_sw = 0;
        for (int l = 0; l < r->cfg.num_layers; l++) n_sw += layer_in_sw_group(r, l);
        LOG_INFO("KV cache groups: %d full-attention layers x %lld blocks (%.1f MiB), %d sliding-window layers "
                 "(window %d) x %d blocks (%.1f MiB): sliding layers keep ~%d blocks per sequence",
                 r->cfg.num_layers - n_sw, (long long)blocks, (double)blocks * bytes_full / (1 << 20), n_sw,
                 r->sw_window, r->num_blocks_sw, (double)r->num_blocks_sw * bytes_sw / (1 << 20),
                 (int)((r->sw_window - 1 + r->block_size - 1) / r->block_size + 1));
    }
    // Per token over all layers, by cache kind (MLA's latent row is what makes DeepSeek's cache small).
    size_t per_token = per_block / (size_t)r->block_size, latent = 0;
    for (int l = 0; l < r->model->n_cache_layers; l++)
        if (r->model->layer_cache[l].kind == CACHE_KIND_LATENT)
            latent += cache_spec_token_bytes(&r->model->layer_cache[l], r->kv_dtype);
    LOG_INFO("KV cache: %zu bytes per token over %d layers (%s%s)", per_token, r->model->n_cache_layers,
             dtype_name(r->kv_dtype), latent ? ", latent (MLA) rows" : "");
    return runner_kv_alloc(r, (int)blocks, err);
}

int model_runner_sliding_window(const struct model_runner *r) {
    int w = 0;
    for (int l = 0; l < r->model->n_cache_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        if (s->kind != CACHE_KIND_SLIDING || (w && s->window != w)) return 0;
        w = s->window;
    }
    return w;
}

// --- KV transfer (model_runner.h: model_runner_kv_pool_view) ---------------------------------

// Rows of tokens [tok0, tok0 + n) of one layer between the pool and host (K rows then V rows),
// one copy per run of consecutive slots inside a block.
static atomc_status runner_kv_copy(void *ctx, int layer, const int32_t *blocks, int tok0, int n, void *host,
                                   bool to_pool, struct error *err) {
    struct model_runner *r = ctx;
    struct backend *b = r->backend;
    if (layer < 0 || layer >= r->model->n_cache_layers || tok0 < 0 || n < 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "KV copy: layer %d tokens [%d, %d)", layer, tok0, tok0 + n);
    char *h = host;
    const int bs = r->block_size;
    for (int kv = 0; kv < 2; kv++) {
        size_t row = kv ? r->xfer_v_row[layer] : r->xfer_k_row[layer];
        if (!row) continue;
        char *base = (char *)r->kv_pool + (kv ? r->xfer_v_off[layer] : r->xfer_k_off[layer]);
        for (int t = tok0; t < tok0 + n;) {
            int blk = blocks[t / bs], off = t % bs, run = bs - off;
            if (run > tok0 + n - t) run = tok0 + n - t;
            if (blk < 0 || blk >= r->num_blocks)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "KV copy: block %d of %d", blk, r->num_blocks);
            char *slot = base + ((size_t)blk * bs + off) * row;
            size_t len = (size_t)run * row;
            if (to_pool) b->ops->copy_h2d(b, slot, h, len);
            else if (b->ops->copy_d2h_side) b->ops->copy_d2h_side(b, h, slot, len); // the I/O thread, mid-forward
            else b->ops->copy_d2h(b, h, slot, len);
            h += len;
            t += run;
        }
    }
    if (to_pool) b->ops->synchronize(b);
    return ATOMC_OK;
}

// kv_pool_view.wait: the layer event of forward_batch.kv_layer_done (any thread).
static void runner_kv_wait(void *ctx, void *event) {
    struct model_runner *r = ctx;
    if (event && r->backend->ops->event_sync) r->backend->ops->event_sync(r->backend, event);
}

void model_runner_kv_pool_view(struct model_runner *r, struct kv_pool_view *v) {
    CHECK_MSG(!r->kv_groups, "KV transfer of per-layer-group block tables (the engine refuses it)");
    const size_t e = dtype_row_bytes(r->kv_dtype, 1), slots = (size_t)r->num_blocks * (size_t)r->block_size;
    size_t off = 0;
    for (int l = 0; l < r->model->n_cache_layers; l++) {
        const struct cache_spec *s = &r->model->layer_cache[l];
        if (s->kind == CACHE_KIND_LATENT) {
            r->xfer_k_row[l] = (size_t)s->latent_dim * e;
            r->xfer_v_row[l] = (size_t)s->index_dim * e; // DSA indexer keys (0 without)
        } else {
            r->xfer_k_row[l] = (size_t)s->n_kv_heads * (size_t)s->head_dim_k * e;
            r->xfer_v_row[l] = (size_t)s->n_kv_heads * (size_t)s->head_dim_v * e;
        }
        r->xfer_k_off[l] = off;
        off += slots * r->xfer_k_row[l];
        r->xfer_v_off[l] = off;
        off += slots * r->xfer_v_row[l];
    }
    CHECK(off == r->kv_bytes);
    memset(v, 0, sizeof *v);
    v->n_layers = r->model->n_cache_layers;
    v->block_size = r->block_size;
    v->num_blocks = r->num_blocks;
    v->kv_dtype = (int)r->kv_dtype;
    v->k_row_bytes = r->xfer_k_row;
    v->v_row_bytes = r->xfer_v_row;
    v->ctx = r;
    v->copy = runner_kv_copy;
    v->wait = runner_kv_wait;
    v->base = r->kv_pool;
    v->bytes = r->kv_bytes;
    v->on_device = r->backend->kind != BACKEND_CPU;
    v->device = r->backend->device_id; // cuda_ipc: the device its IPC handle belongs to
    v->k_offset = r->xfer_k_off;
    v->v_offset = r->xfer_v_off;
}
