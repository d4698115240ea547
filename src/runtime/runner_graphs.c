// CUDA graphs of the model runner (runner_internal.h), captured at start-up unless enforce_eager:
//
// Decode graphs: batches of one token per sequence, per batch-size bucket; the graph covers
// model_forward and the logits of every slot (rows from the fixed iota array). A replay pads to
// the bucket (padded slots: token 0, slot -1, context 1, block 0) and refreshes the fixed
// metadata arrays the captured kernels read (layout r->dec).
//
// Verify graphs (runner_options.num_speculative_tokens = k > 0): speculative steps, q = 1 + k
// query tokens per sequence with logits at every row, per batch bucket B (B * q <= the logits
// rows and the token budget). The padded layout (r->ver) gives every one of the B sequences
// exactly q token rows, sequence s at rows s * q .. s * q + q - 1, so query_start is s * q and
// the captured shapes (n_tokens B * q, n_seqs B, max_query_len q) never change:
//   - a sequence with n < q tokens (fewer drafts than k, or none) keeps its real rows first and
//     gets q - n padding rows after them: token 0, slot -1 (no KV write), positions continuing
//     its last one (clamped below max_model_len), and its context length grows by q - n so the
//     causal rule (row i sees keys up to ctx - q + i) keeps the real rows' positions; padding rows
//     see keys past the real context that no one wrote for them (stale or zero cache rows of
//     valid blocks: block-table entries past the real context are set to block 0), and their
//     logits are never sampled, as vLLM pads;
//   - padded sequences (past the batch's) are q padding rows at positions 0..q-1, context q,
//     block 0;
//   - the graph computes logits for all B * q rows gathered through the layout's logits_rows
//     array, which the replay fills with the padded rows of the batch's logits rows first (then
//     any valid rows), so scratch logits rows 0..n_logits-1 are the batch's rows in order and the
//     sampler (runner_sample, on the device, after the replay) reads them as after an eager step.
// The batch's token rows map to padded rows (vpad.row_map): MTP drafts read the verified
// positions' hidden states through it. Eligible: every token is a logits row (a verify or
// decode step; a prefill chunk asks for its last row only, so mixed steps run eagerly), at most
// q tokens per sequence, the padded context within max_model_len, no prompt logprobs or
// per-layer KV hooks (runner_forward). Kernels were captured with max_context_len =
// max_model_len and the capacity block-table stride, so they must bound their loops by the
// device context_lens / query_start (cuda_attention.cu, cuda_mla.cu, cuda_dsa.cu do). Models
// with recurrent state get no verify graphs (speculation is refused for them).
//
// MTP chain graphs (a model loaded with MTP layers, k >= 2): the chained one-token MTP passes of
// model_runner_draft (runner_mtp.c) per decode bucket, on the decode layout: MTP layer 0 over one
// token per sequence reading the previous pass's logits rows (scratch.lg_res rows 0..B-1), its
// logits for rows 0..B-1 (d_iota); the argmax runs after the replay. Padded slots are decode
// padding (slot -1) whose hidden rows are whatever earlier passes left past the real rows
// (lg_res is zeroed before the captures, so never NaN bits). The first MTP pass (1 .. 1 + k rows
// per sequence, and whole prefill chunks after a prefill step) runs eagerly.
//
// MTP first-pass graphs (the same models): the pass over the positions a verify step computed, on
// the verify layout (at most 1 + k rows per sequence, padded as for verify graphs, bucket B); the
// target's hidden rows come from the fixed device array mtp.d_hidden_rows, which the replay fills
// in the padded order (padding rows read row 0), and the MTP logits of all B (1 + k) rows are
// gathered through logits_rows with the drafting rows first. Passes after a prefill chunk (more
// rows per sequence) run eagerly.
//
// Capture: every graph's eager warm-up runs first (lazy per-shape set-up: GEMM plans, the
// attention split scratch, which may grow and would leave an earlier captured graph pointing at
// the freed buffer), then every capture, largest first.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "runtime/runner_internal.h"

// The smallest captured decode bucket holding n sequences, or NULL.
struct runner_graph *runner_graph_for(struct model_runner *r, int n) {
    for (int i = 0; i < r->n_graphs; i++)
        if (r->graphs[i].batch_size >= n) return &r->graphs[i];
    return NULL;
}

// The smallest bucket of graphs[0..n) (ascending) holding fb padded to spec_q rows per sequence,
// or NULL when a sequence has more rows or its padded context passes max_model_len.
static struct runner_graph *runner_padded_graph_for(struct model_runner *r, struct runner_graph *graphs, int n,
                                                    const struct forward_batch *fb) {
    const int q = r->spec_q;
    for (int s = 0; s < fb->n_seqs; s++) {
        int qlen = fb->query_start[s + 1] - fb->query_start[s];
        if (qlen > q || fb->context_lens[s] + (q - qlen) > r->max_model_len) return NULL;
    }
    for (int i = 0; i < n; i++)
        if (graphs[i].batch_size >= fb->n_seqs) return &graphs[i];
    return NULL;
}

struct runner_graph *runner_verify_graph_for(struct model_runner *r, const struct forward_batch *fb) {
    if (r->n_vgraphs == 0 || fb->n_logits != fb->n_tokens) return NULL;
    return runner_padded_graph_for(r, r->vgraphs, r->n_vgraphs, fb);
}

// Padding sequence s of a verify layout with q rows: rows s * q .. s * q + q - 1.
static void vpad_dummy_seq(struct model_runner *r, int s, int q) {
    const int W = r->max_blocks;
    for (int i = 0; i < q; i++) {
        int t = s * q + i;
        r->vpad.tok[t] = 0;
        r->vpad.pos[t] = i;
        r->vpad.slot[t] = -1;
        r->vpad.slot_sw[t] = -1;
    }
    r->vpad.qs[s] = s * q;
    r->vpad.ctx[s] = q;
    memset(r->vpad.bt + (size_t)s * W, 0, (size_t)W * 4);
    if (r->kv_groups) memset(r->vpad.bt_sw + (size_t)s * W, 0, (size_t)W * 4);
}

// The forward batch of vpad's arrays: S sequences of q rows each.
static struct forward_batch vpad_batch(struct model_runner *r, int S, int q) {
    r->vpad.qs[S] = S * q;
    return (struct forward_batch){.n_seqs = S,
                                  .n_tokens = S * q,
                                  .token_ids = r->vpad.tok,
                                  .positions = r->vpad.pos,
                                  .query_start = r->vpad.qs,
                                  .context_lens = r->vpad.ctx,
                                  .block_tables = r->vpad.bt,
                                  .max_blocks_per_seq = r->max_blocks,
                                  .slot_mapping = r->vpad.slot,
                                  .block_tables_sw = r->kv_groups ? r->vpad.bt_sw : NULL,
                                  .slot_mapping_sw = r->kv_groups ? r->vpad.slot_sw : NULL};
}

// Copies fb's sequence s into rows s * q.. of vpad (see the top comment) and maps its rows in map.
static void vpad_real_seq(struct model_runner *r, const struct forward_batch *fb, int s, int q, int32_t *map) {
    const int W = r->max_blocks, q0 = fb->query_start[s], n = fb->query_start[s + 1] - q0, base = s * q;
    for (int i = 0; i < n; i++) {
        r->vpad.tok[base + i] = fb->token_ids[q0 + i];
        r->vpad.pos[base + i] = fb->positions[q0 + i];
        r->vpad.slot[base + i] = fb->slot_mapping[q0 + i];
        r->vpad.slot_sw[base + i] = r->kv_groups ? fb->slot_mapping_sw[q0 + i] : -1;
        map[q0 + i] = base + i;
    }
    const int last = n > 0 ? fb->positions[q0 + n - 1] : fb->context_lens[s] - 1;
    for (int i = n; i < q; i++) {
        int p = last + (i - n + 1);
        r->vpad.tok[base + i] = 0;
        r->vpad.pos[base + i] = p < r->max_model_len ? p : r->max_model_len - 1;
        r->vpad.slot[base + i] = -1;
        r->vpad.slot_sw[base + i] = -1;
    }
    r->vpad.qs[s] = base;
    r->vpad.ctx[s] = fb->context_lens[s] + (q - n);
    // Entries past the real context were not validated: block 0 for the padding rows' reads.
    const int nb = (fb->context_lens[s] + r->block_size - 1) / r->block_size;
    for (int g = 0; g < (r->kv_groups ? 2 : 1); g++) {
        const int32_t *src = (g ? fb->block_tables_sw : fb->block_tables) + (size_t)s * fb->max_blocks_per_seq;
        int32_t *dst = (g ? r->vpad.bt_sw : r->vpad.bt) + (size_t)s * W;
        memcpy(dst, src, (size_t)nb * 4);
        memset(dst + nb, 0, (size_t)(W - nb) * 4);
    }
}

atomc_status runner_verify_replay(struct model_runner *r, const struct forward_batch *fb, struct runner_graph *g,
                                  struct error *err) {
    const int q = g->q, S = g->batch_size, T = S * q;
    for (int s = 0; s < fb->n_seqs; s++)
        vpad_real_seq(r, fb, s, q, r->vpad.row_map);
    for (int s = fb->n_seqs; s < S; s++)
        vpad_dummy_seq(r, s, q);
    struct forward_batch pfb = vpad_batch(r, S, q);
    pfb.n_logits = fb->n_logits;
    pfb.logits_rows = fb->logits_rows;
    pfb.sampling = fb->sampling;
    struct attn_metadata md;
    r->lay = r->ver;
    size_t bytes = runner_pack(r, &pfb, S, r->max_blocks, &md);
    int32_t *rows = HPTR(r, logits_rows, int32_t);
    for (int i = 0; i < fb->n_logits; i++)
        rows[i] = r->vpad.row_map[fb->logits_rows[i]];
    for (int i = fb->n_logits; i < T; i++)
        rows[i] = i;
    runner_upload(r, bytes);
    struct backend *b = r->backend;
    atomc_status st = b->ops->graph_launch(b, g->graph, err);
    if (st != ATOMC_OK) return error_prefix(err, "replaying the verify graph of batch %d x %d: ", S, q);
    r->n_graph_replays++;
    r->n_verify_replays++;
    r->model->last_tokens = T; // what the replayed forward left in the scratch
    r->vpad.row_map_n = fb->n_tokens;
    return ATOMC_OK;
}

// The smallest captured MTP chain bucket holding n sequences, or NULL.
static struct runner_graph *runner_mtp_graph_for(struct model_runner *r, int n) {
    for (int i = 0; i < r->n_mgraphs; i++)
        if (r->mgraphs[i].batch_size >= n) return &r->mgraphs[i];
    return NULL;
}

// A chained MTP pass (fb: one token per sequence, logits rows 0..n-1) as a graph replay when a
// bucket holds it; *replayed false: the caller runs it eagerly.
atomc_status runner_mtp_chain_replay(struct model_runner *r, const struct forward_batch *fb, bool *replayed,
                                     struct error *err) {
    *replayed = false;
    struct runner_graph *g = r->graphs_enabled ? runner_mtp_graph_for(r, fb->n_seqs) : NULL;
    if (!g || !runner_is_decode_only(fb) || fb->n_logits != fb->n_seqs) return ATOMC_OK;
    for (int i = 0; i < fb->n_logits; i++)
        if (fb->logits_rows[i] != i) return ATOMC_OK;
    struct attn_metadata md;
    r->lay = r->dec;
    runner_upload(r, runner_pack(r, fb, g->batch_size, r->max_blocks, &md));
    struct backend *b = r->backend;
    atomc_status st = b->ops->graph_launch(b, g->graph, err);
    if (st != ATOMC_OK) return error_prefix(err, "replaying the MTP chain graph of batch %d: ", g->batch_size);
    r->n_graph_replays++;
    r->n_mtp_replays++;
    r->model->last_tokens = g->batch_size;
    *replayed = true;
    return ATOMC_OK;
}

atomc_status runner_mtp_first_replay(struct model_runner *r, const struct forward_batch *fb, const int32_t *hidden_rows,
                                     bool *replayed, struct error *err) {
    *replayed = false;
    struct runner_graph *g =
        r->graphs_enabled && r->n_m1graphs ? runner_padded_graph_for(r, r->m1graphs, r->n_m1graphs, fb) : NULL;
    if (!g) return ATOMC_OK;
    const int q = g->q, S = g->batch_size, T = S * q;
    for (int s = 0; s < fb->n_seqs; s++)
        vpad_real_seq(r, fb, s, q, r->vpad.mtp_map);
    for (int s = fb->n_seqs; s < S; s++)
        vpad_dummy_seq(r, s, q);
    memset(r->vpad.mtp_hidden, 0, (size_t)T * 4);
    for (int t = 0; t < fb->n_tokens; t++)
        r->vpad.mtp_hidden[r->vpad.mtp_map[t]] = hidden_rows[t];
    struct forward_batch pfb = vpad_batch(r, S, q);
    pfb.n_logits = fb->n_logits;
    pfb.logits_rows = fb->logits_rows;
    pfb.sampling = fb->sampling;
    struct attn_metadata md;
    r->lay = r->ver;
    size_t bytes = runner_pack(r, &pfb, S, r->max_blocks, &md);
    int32_t *rows = HPTR(r, logits_rows, int32_t);
    for (int i = 0; i < fb->n_logits; i++)
        rows[i] = r->vpad.mtp_map[fb->logits_rows[i]];
    for (int i = fb->n_logits; i < T; i++)
        rows[i] = i;
    struct backend *b = r->backend;
    b->ops->copy_h2d(b, r->mtp.d_hidden_rows, r->vpad.mtp_hidden, (size_t)T * 4);
    runner_upload(r, bytes);
    atomc_status st = b->ops->graph_launch(b, g->graph, err);
    if (st != ATOMC_OK) return error_prefix(err, "replaying the MTP first-pass graph of batch %d x %d: ", S, q);
    r->n_graph_replays++;
    r->n_mtp_replays++;
    r->model->last_tokens = T;
    *replayed = true;
    return ATOMC_OK;
}

// Uploads the metadata of an all-padding batch of bs sequences x q tokens under the graph's
// layout and returns its attn_metadata as the graph is captured with; *rows: the logits rows.
static struct attn_metadata runner_graph_dummy(struct model_runner *r, int bs, int q, const int32_t **rows) {
    struct attn_metadata md;
    if (q == 1) {
        int32_t tok[1] = {0}, pos[1] = {0}, slot[1] = {-1}, qs[2] = {0, 1}, ctx[1] = {1};
        int32_t *bt = xcalloc((size_t)r->max_blocks, 4);
        struct forward_batch fb = {.n_seqs = 1,
                                   .n_tokens = 1,
                                   .token_ids = tok,
                                   .positions = pos,
                                   .query_start = qs,
                                   .context_lens = ctx,
                                   .block_tables = bt,
                                   .max_blocks_per_seq = r->max_blocks,
                                   .slot_mapping = slot,
                                   .block_tables_sw = r->kv_groups ? bt : NULL,
                                   .slot_mapping_sw = r->kv_groups ? slot : NULL};
        r->lay = r->dec;
        runner_upload(r, runner_pack(r, &fb, bs, r->max_blocks, &md));
        free(bt);
        *rows = r->d_iota;
    } else {
        for (int s = 0; s < bs; s++)
            vpad_dummy_seq(r, s, q);
        struct forward_batch fb = vpad_batch(r, bs, q);
        r->lay = r->ver;
        size_t bytes = runner_pack(r, &fb, bs, r->max_blocks, &md);
        int32_t *h = HPTR(r, logits_rows, int32_t);
        for (int i = 0; i < bs * q; i++)
            h[i] = i;
        runner_upload(r, bytes);
        *rows = DPTR(r, logits_rows, int32_t);
    }
    md.max_context_len = r->max_model_len; // replays see any context length up to this
    return md;
}

// model_forward (mtp: an MTP pass, chained for q == 1, else the first pass over hidden rows
// mtp.d_hidden_rows, all row 0 here) + the logits of every row of one bucket; captured when
// graph != NULL.
static atomc_status runner_graph_run(struct model_runner *r, int bs, int q, bool mtp, void **graph, struct error *err) {
    struct backend *b = r->backend;
    const int32_t *rows;
    struct attn_metadata md = runner_graph_dummy(r, bs, q, &rows);
    if (mtp && q > 1) {
        memset(r->vpad.mtp_hidden, 0, (size_t)bs * q * 4);
        b->ops->copy_h2d(b, r->mtp.d_hidden_rows, r->vpad.mtp_hidden, (size_t)bs * q * 4);
        // The first pass views the target's scratch rows 0..last_tokens-1: the whole scratch, as
        // replays gather from any step's rows.
        r->model->last_tokens = r->max_tokens;
    }
    b->ops->synchronize(b);
    if (graph) {
        atomc_status st = b->ops->graph_begin(b, err);
        if (st != ATOMC_OK) return st;
    }
    if (mtp) {
        model_mtp_forward(r->model, 0, DPTR(r, token_ids, int32_t), &md, r->kv, q > 1 ? r->mtp.d_hidden_rows : NULL);
        model_mtp_compute_logits(r->model, 0, rows, bs * q);
    } else {
        model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
        model_compute_logits(r->model, rows, bs * q);
    }
    if (graph) return b->ops->graph_end(b, graph, err);
    b->ops->synchronize(b);
    return ATOMC_OK;
}

// Buckets: 1, 2, 4, 8, then steps of 8 to 64, then steps of 16 up to min(max_seqs, cap_seqs).
static int runner_graph_buckets(int max_seqs, int cap_seqs, int *out) {
    int n = 0, cap = max_seqs < cap_seqs ? max_seqs : cap_seqs;
    for (int bs = 1; bs <= cap && n < RUNNER_MAX_GRAPHS; bs = bs < 8 ? bs * 2 : bs < 64 ? bs + 8 : bs + 16)
        out[n++] = bs;
    if (n > 0 && out[n - 1] < cap && n < RUNNER_MAX_GRAPHS) out[n++] = cap;
    return n;
}

static void runner_vpad_alloc(struct model_runner *r) {
    const size_t T = (size_t)r->max_tokens, S = (size_t)r->max_seqs, W = (size_t)r->max_blocks;
    r->vpad.tok = xcalloc(T, 4);
    r->vpad.pos = xcalloc(T, 4);
    r->vpad.slot = xcalloc(T, 4);
    r->vpad.slot_sw = xcalloc(T, 4);
    r->vpad.row_map = xcalloc(T, 4);
    r->vpad.mtp_map = xcalloc(T, 4);
    r->vpad.mtp_hidden = xcalloc(T, 4);
    r->vpad.qs = xcalloc(S + 1, 4);
    r->vpad.ctx = xcalloc(S, 4);
    r->vpad.bt = xcalloc(S * W, 4);
    r->vpad.bt_sw = r->kv_groups ? xcalloc(S * W, 4) : NULL; // the sliding group's tables
}

atomc_status runner_capture_graphs(struct model_runner *r, int spec_k, struct error *err) {
    struct backend *b = r->backend;
    if (!b->ops->graph_begin || !b->ops->graph_end || !b->ops->graph_launch) return ATOMC_OK;
    const int limit = r->max_tokens < r->max_rows ? r->max_tokens : r->max_rows; // rows of one graph
    int dec[RUNNER_MAX_GRAPHS], ver[RUNNER_MAX_GRAPHS], n_ver = 0;
    const int n_dec = runner_graph_buckets(r->max_seqs, limit, dec);
    const int q = 1 + spec_k;
    if (spec_k > 0 && r->n_state_slots == 0 && q <= limit) {
        n_ver = runner_graph_buckets(r->max_seqs, limit / q, ver);
        r->spec_q = q;
        runner_vpad_alloc(r);
        const int tw = r->max_blocks * (r->kv_groups ? 2 : 1);
        runner_layout_build(&r->ver, limit, r->max_seqs, tw, r->max_rows, 0);
        CHECK(r->ver.bytes <= r->meta_cap);
    }
    const int n_mtp = spec_k >= 2 && r->model->n_mtp > 0 ? n_dec : 0;
    const int n_mtp1 = r->model->n_mtp > 0 ? n_ver : 0;
    if (n_mtp) { // chained passes read lg_res rows past the real ones: finite values only
        const size_t row = dtype_row_bytes(b->act_dtype, r->cfg.hidden_size);
        b->ops->memset_zero(b, r->model->scratch.lg_res, (size_t)r->max_rows * row);
    }
    if (n_mtp1 && !r->mtp.d_hidden_rows) { // the first-pass graphs keep its pointer
        r->mtp.d_hidden_rows = b->ops->alloc(b, (size_t)r->max_tokens * 4);
        if (!r->mtp.d_hidden_rows)
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "MTP graphs: cannot allocate %d hidden rows", r->max_tokens);
        r->mtp.d_cap = r->max_tokens;
    }
    size_t free0 = 0, total = 0, free1 = 0;
    if (b->ops->memory_info) b->ops->memory_info(b, &free0, &total);
    double t0 = time_now_s();
    // Every warm-up first (see the top comment), then the captures, largest first.
    for (int pass = 0; pass < 2; pass++) {
        for (int i = n_ver - 1; i >= 0; i--) {
            void *graph = NULL;
            atomc_status st = runner_graph_run(r, ver[i], q, false, pass ? &graph : NULL, err);
            if (st != ATOMC_OK) return error_prefix(err, "capturing the verify graph of batch %d x %d: ", ver[i], q);
            if (pass) r->vgraphs[r->n_vgraphs++] = (struct runner_graph){.batch_size = ver[i], .q = q, .graph = graph};
        }
        for (int i = n_dec - 1; i >= 0; i--) {
            void *graph = NULL;
            atomc_status st = runner_graph_run(r, dec[i], 1, false, pass ? &graph : NULL, err);
            if (st != ATOMC_OK) return error_prefix(err, "capturing the decode graph of batch %d: ", dec[i]);
            if (pass) r->graphs[r->n_graphs++] = (struct runner_graph){.batch_size = dec[i], .q = 1, .graph = graph};
        }
        for (int i = n_mtp1 - 1; i >= 0; i--) {
            void *graph = NULL;
            atomc_status st = runner_graph_run(r, ver[i], q, true, pass ? &graph : NULL, err);
            if (st != ATOMC_OK)
                return error_prefix(err, "capturing the MTP first-pass graph of batch %d x %d: ", ver[i], q);
            if (pass)
                r->m1graphs[r->n_m1graphs++] = (struct runner_graph){.batch_size = ver[i], .q = q, .graph = graph};
        }
        for (int i = n_mtp - 1; i >= 0; i--) {
            void *graph = NULL;
            atomc_status st = runner_graph_run(r, dec[i], 1, true, pass ? &graph : NULL, err);
            if (st != ATOMC_OK) return error_prefix(err, "capturing the MTP chain graph of batch %d: ", dec[i]);
            if (pass) r->mgraphs[r->n_mgraphs++] = (struct runner_graph){.batch_size = dec[i], .q = 1, .graph = graph};
        }
    }
    r->lay = r->dec;
    // Keep graphs sorted by batch size ascending for the lookups.
    for (int i = 0; i < r->n_graphs / 2; i++) {
        struct runner_graph t = r->graphs[i];
        r->graphs[i] = r->graphs[r->n_graphs - 1 - i];
        r->graphs[r->n_graphs - 1 - i] = t;
    }
    for (int i = 0; i < r->n_vgraphs / 2; i++) {
        struct runner_graph t = r->vgraphs[i];
        r->vgraphs[i] = r->vgraphs[r->n_vgraphs - 1 - i];
        r->vgraphs[r->n_vgraphs - 1 - i] = t;
    }
    for (int i = 0; i < r->n_mgraphs / 2; i++) {
        struct runner_graph t = r->mgraphs[i];
        r->mgraphs[i] = r->mgraphs[r->n_mgraphs - 1 - i];
        r->mgraphs[r->n_mgraphs - 1 - i] = t;
    }
    for (int i = 0; i < r->n_m1graphs / 2; i++) {
        struct runner_graph t = r->m1graphs[i];
        r->m1graphs[i] = r->m1graphs[r->n_m1graphs - 1 - i];
        r->m1graphs[r->n_m1graphs - 1 - i] = t;
    }
    r->model->last_tokens = 0; // no step has run yet
    r->graphs_enabled = r->n_graphs > 0 || r->n_vgraphs > 0 || r->n_mgraphs > 0 || r->n_m1graphs > 0;
    if (b->ops->memory_info) b->ops->memory_info(b, &free1, &total);
    char vdesc[160] = "";
    if (r->n_vgraphs)
        snprintf(vdesc, sizeof vdesc, ", %d verify graphs (batch 1..%d x %d tokens)", r->n_vgraphs, ver[n_ver - 1], q);
    if (r->n_mgraphs || r->n_m1graphs)
        snprintf(vdesc + strlen(vdesc), sizeof vdesc - strlen(vdesc), ", %d + %d MTP graphs (first pass + chain)",
                 r->n_m1graphs, r->n_mgraphs);
    LOG_INFO("captured %d decode graphs (batch 1..%d)%s in %.2f s, %.1f MiB of device memory", r->n_graphs,
             n_dec ? dec[n_dec - 1] : 0, vdesc, time_now_s() - t0,
             free0 > free1 ? (double)(free0 - free1) / 1048576.0 : 0.0);
    return ATOMC_OK;
}

void runner_graphs_release(struct model_runner *r) {
    struct backend *b = r->backend;
    for (int i = 0; i < r->n_graphs; i++)
        if (b->ops->graph_destroy) b->ops->graph_destroy(b, r->graphs[i].graph);
    for (int i = 0; i < r->n_vgraphs; i++)
        if (b->ops->graph_destroy) b->ops->graph_destroy(b, r->vgraphs[i].graph);
    for (int i = 0; i < r->n_mgraphs; i++)
        if (b->ops->graph_destroy) b->ops->graph_destroy(b, r->mgraphs[i].graph);
    for (int i = 0; i < r->n_m1graphs; i++)
        if (b->ops->graph_destroy) b->ops->graph_destroy(b, r->m1graphs[i].graph);
    r->n_graphs = r->n_vgraphs = r->n_mgraphs = r->n_m1graphs = 0;
    free(r->vpad.tok);
    free(r->vpad.pos);
    free(r->vpad.slot);
    free(r->vpad.slot_sw);
    free(r->vpad.row_map);
    free(r->vpad.mtp_map);
    free(r->vpad.mtp_hidden);
    free(r->vpad.qs);
    free(r->vpad.ctx);
    free(r->vpad.bt);
    free(r->vpad.bt_sw);
    memset(&r->vpad, 0, sizeof r->vpad);
}
