// CUDA graphs of decode-only batches (runner_internal.h): captured per batch-size bucket at
// start-up unless enforce_eager; a replay refreshes the fixed metadata arrays the captured
// kernels read.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "runtime/runner_internal.h"

// The smallest captured bucket holding n sequences, or NULL.
struct runner_graph *runner_graph_for(struct model_runner *r, int n) {
    for (int i = 0; i < r->n_graphs; i++)
        if (r->graphs[i].batch_size >= n) return &r->graphs[i];
    return NULL;
}

// Captures model_forward + logits of every slot for one decode batch size. The captured
// kernels read metadata from the fixed device arrays, so a replay only needs them refreshed.
// max_context_len is captured as max_model_len: decode kernels must bound their loops by the
// per-sequence context_lens they read on the device.
static atomc_status runner_capture_one(struct model_runner *r, int bs, struct error *err) {
    struct backend *b = r->backend;
    // A decode batch of bs dummy slots (all padding: slot -1, so nothing is written).
    int32_t tok[1] = {0}, pos[1] = {0}, slot[1] = {-1}, qs[2] = {0, 1}, ctx[1] = {1};
    int32_t *bt = xcalloc((size_t)r->max_blocks, 4);
    struct forward_batch fb = {.n_seqs = 1, .n_tokens = 1, .token_ids = tok, .positions = pos, .query_start = qs,
                               .context_lens = ctx, .block_tables = bt, .max_blocks_per_seq = r->max_blocks,
                               .slot_mapping = slot, .block_tables_sw = r->kv_groups ? bt : NULL,
                               .slot_mapping_sw = r->kv_groups ? slot : NULL};
    struct attn_metadata md;
    r->lay = r->dec;
    runner_upload(r, runner_pack(r, &fb, bs, r->max_blocks, &md));
    free(bt);
    md.max_context_len = r->max_model_len; // replays see any context length up to this
    b->ops->synchronize(b);
    // Warm-up run outside capture (lazy per-shape set-up such as GEMM algorithm choice).
    model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
    model_compute_logits(r->model, r->d_iota, bs);
    b->ops->synchronize(b);
    atomc_status st = b->ops->graph_begin(b, err);
    if (st != ATOMC_OK) return st;
    model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
    model_compute_logits(r->model, r->d_iota, bs);
    void *graph = NULL;
    st = b->ops->graph_end(b, &graph, err);
    if (st != ATOMC_OK) return st;
    r->graphs[r->n_graphs++] = (struct runner_graph){.batch_size = bs, .graph = graph};
    return ATOMC_OK;
}

// Buckets: 1, 2, 4, 8, then steps of 8 to 64, then steps of 16 up to max_num_seqs.
static int runner_graph_buckets(int max_seqs, int limit_rows, int *out) {
    int n = 0, cap = max_seqs < limit_rows ? max_seqs : limit_rows;
    for (int bs = 1; bs <= cap && n < RUNNER_MAX_GRAPHS; bs = bs < 8 ? bs * 2 : bs < 64 ? bs + 8 : bs + 16)
        out[n++] = bs;
    if (n > 0 && out[n - 1] < cap && n < RUNNER_MAX_GRAPHS) out[n++] = cap;
    return n;
}

atomc_status runner_capture_graphs(struct model_runner *r, struct error *err) {
    struct backend *b = r->backend;
    if (!b->ops->graph_begin || !b->ops->graph_end || !b->ops->graph_launch) return ATOMC_OK;
    int buckets[RUNNER_MAX_GRAPHS];
    int limit = r->max_tokens < r->max_rows ? r->max_tokens : r->max_rows;
    int n = runner_graph_buckets(r->max_seqs, limit, buckets);
    double t0 = time_now_s();
    // Largest first: the graphs then share the memory pool of the biggest capture.
    for (int i = n - 1; i >= 0; i--) {
        atomc_status st = runner_capture_one(r, buckets[i], err);
        if (st != ATOMC_OK) return error_prefix(err, "capturing the decode graph of batch %d: ", buckets[i]);
    }
    // Keep graphs sorted by batch size ascending for runner_graph_for.
    for (int i = 0; i < r->n_graphs / 2; i++) {
        struct runner_graph t = r->graphs[i];
        r->graphs[i] = r->graphs[r->n_graphs - 1 - i];
        r->graphs[r->n_graphs - 1 - i] = t;
    }
    r->graphs_enabled = r->n_graphs > 0;
    LOG_INFO("captured %d decode graphs (batch 1..%d) in %.2f s", r->n_graphs, n ? buckets[n - 1] : 0,
             time_now_s() - t0);
    return ATOMC_OK;
}
