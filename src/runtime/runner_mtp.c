// MTP drafts of the model runner (model_runner.h model_runner_draft): one pass of the MTP layer
// over the positions a step verified (filling its cache, reading the target's hidden states the
// step left in the scratch), the argmax of the drafting sequences' last rows, then k - 1 chained
// one-token passes fed by the previous pass's output (replays of the MTP first-pass and chain
// graphs where captured, runner_graphs.c); an EAGLE-3 head runs the same passes (runner_eagle3.c).
// Drafts are argmax (q one-hot), which keeps the engine's verification exact for sampled
// requests too (src/engine/spec.h).
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "runtime/runner_internal.h"

void runner_mtp_release(struct model_runner *r) {
    free(r->mtp.tok);
    free(r->mtp.pos);
    free(r->mtp.qs);
    free(r->mtp.ctx);
    free(r->mtp.slot);
    free(r->mtp.rows);
    free(r->mtp.bt);
    free(r->mtp.greedy);
    free(r->mtp.h_hidden_rows);
    if (r->mtp.d_hidden_rows) r->backend->ops->free(r->backend, r->mtp.d_hidden_rows);
    memset(&r->mtp, 0, sizeof r->mtp);
}

int model_runner_num_mtp_layers(const struct model_runner *r) { return r->model->n_mtp + (r->model->eagle3 != NULL); }

static void mtp_reserve(struct model_runner *r, int n, size_t bt) {
    if (n > r->mtp.cap) {
        int c = n > 2 * r->mtp.cap ? n : 2 * r->mtp.cap;
        r->mtp.tok = xrealloc(r->mtp.tok, (size_t)c * 4);
        r->mtp.pos = xrealloc(r->mtp.pos, (size_t)c * 4);
        r->mtp.qs = xrealloc(r->mtp.qs, (size_t)(c + 1) * 4);
        r->mtp.ctx = xrealloc(r->mtp.ctx, (size_t)c * 4);
        r->mtp.slot = xrealloc(r->mtp.slot, (size_t)c * 4);
        r->mtp.rows = xrealloc(r->mtp.rows, (size_t)c * 4);
        r->mtp.greedy = xrealloc(r->mtp.greedy, (size_t)c * sizeof *r->mtp.greedy);
        for (int i = 0; i < c; i++)
            r->mtp.greedy[i] = (struct sample_row){.temperature = 0, .top_p = 1, .repetition_penalty = 1};
        r->mtp.cap = c;
    }
    if (bt > r->mtp.bt_cap) {
        r->mtp.bt = xrealloc(r->mtp.bt, bt * 4);
        r->mtp.bt_cap = bt;
    }
}

// Checks the draft-specific fields (runner_validate checks fb itself).
static atomc_status mtp_validate(const struct model_runner *r, const struct draft_batch *db, struct error *err) {
    const struct forward_batch *fb = &db->fb;
    const int R = fb->n_logits, K = db->max_drafts;
    if (R > 0 && (K < 1 || K > ATOMC_MAX_SPEC_TOKENS))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "draft batch: max_drafts %d outside 1..%d", K,
                         ATOMC_MAX_SPEC_TOKENS);
    for (int t = 0; t < fb->n_tokens; t++)
        if (db->hidden_rows[t] < 0 || db->hidden_rows[t] >= r->model->last_tokens)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "draft batch: hidden row %d outside the last step's %d rows",
                             db->hidden_rows[t], r->model->last_tokens);
    const int64_t n_slots = (int64_t)r->num_blocks * r->block_size;
    for (int i = 0; i < R; i++) {
        int nd = db->n_drafts[i], si = db->row_seq[i];
        if (nd < 1 || nd > K || (i > 0 && nd > db->n_drafts[i - 1]))
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "draft batch: row %d wants %d drafts (1..%d, non-increasing over the rows)", i, nd, K);
        if (si < 0 || si >= fb->n_seqs || fb->logits_rows[i] < fb->query_start[si] ||
            fb->logits_rows[i] >= fb->query_start[si + 1])
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "draft batch: row %d is not a row of its sequence %d", i,
                             si);
        for (int j = 1; j < nd; j++) {
            int ctx = fb->context_lens[si] + j, slot = db->chain_slots[(size_t)i * (K - 1) + j - 1];
            if (ctx > r->max_model_len || ctx > fb->max_blocks_per_seq * r->block_size || slot < -1 || slot >= n_slots)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                 "draft batch: chained draft %d of row %d (context %d, slot %d) does not fit", j, i,
                                 ctx, slot);
            int blk = fb->block_tables[(size_t)si * fb->max_blocks_per_seq + (ctx - 1) / r->block_size];
            if (blk < 0 || blk >= r->num_blocks)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "draft batch: block %d outside the pool", blk);
        }
    }
    return ATOMC_OK;
}

// Uploads fb, runs MTP layer 0 (hidden_rows: from the target's rows, NULL: chained), takes the
// argmax of the logits rows into ids (host, valid until the next sampling).
// A chained pass (d_hidden_rows NULL) replays the MTP chain graph of its bucket when one is captured.
static atomc_status mtp_pass(struct model_runner *r, const struct forward_batch *fb, const int32_t *d_hidden_rows,
                             const int32_t **ids, struct error *err) {
    if (r->model->eagle3) return runner_eagle3_pass(r, fb, d_hidden_rows, ids, err);
    *ids = NULL;
    bool replayed = false;
    if (!d_hidden_rows) {
        atomc_status st = runner_mtp_chain_replay(r, fb, &replayed, err);
        if (st != ATOMC_OK) return st;
    }
    if (replayed) { // the graph computed the logits of rows 0..n-1
        struct runner_output out;
        atomc_status st = runner_sample(r, fb, &out, err);
        *ids = out.ids;
        return st;
    }
    struct attn_metadata md;
    runner_layout_build(&r->lay, fb->n_tokens, fb->n_seqs, fb->max_blocks_per_seq, fb->n_logits, 0);
    runner_upload(r, runner_pack(r, fb, 0, fb->max_blocks_per_seq, &md));
    model_mtp_forward(r->model, 0, DPTR(r, token_ids, int32_t), &md, r->kv, d_hidden_rows);
    if (fb->n_logits == 0) {
        r->backend->ops->synchronize(r->backend);
        return ATOMC_OK;
    }
    model_mtp_compute_logits(r->model, 0, DPTR(r, logits_rows, int32_t), fb->n_logits);
    struct runner_output out;
    atomc_status st = runner_sample(r, fb, &out, err);
    *ids = out.ids;
    return st;
}

atomc_status model_runner_draft(struct model_runner *r, const struct draft_batch *db, int32_t *drafts,
                                struct error *err) {
    struct model *m = r->model;
    if (m->n_mtp == 0 && !m->eagle3)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "MTP drafts: %s was loaded without MTP layers or an EAGLE-3 head",
                         r->cfg.architecture);
    const struct forward_batch *fb0 = &db->fb;
    struct draft_batch mapped;
    if (r->vpad.row_map_n > 0) { // the last step replayed a verify graph: its rows are padded
        if (fb0->n_tokens < 1 || fb0->n_tokens > r->max_tokens)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "draft batch has %d tokens", fb0->n_tokens);
        if (!r->mtp.h_hidden_rows) r->mtp.h_hidden_rows = xcalloc((size_t)r->max_tokens, 4);
        for (int t = 0; t < fb0->n_tokens; t++) {
            if (db->hidden_rows[t] < 0 || db->hidden_rows[t] >= r->vpad.row_map_n)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                 "draft batch: hidden row %d outside the last step's %d rows", db->hidden_rows[t],
                                 r->vpad.row_map_n);
            r->mtp.h_hidden_rows[t] = r->vpad.row_map[db->hidden_rows[t]];
        }
        mapped = *db;
        mapped.hidden_rows = r->mtp.h_hidden_rows;
        db = &mapped;
        fb0 = &db->fb;
    }
    atomc_status st = runner_validate(r, fb0, err);
    if (st == ATOMC_OK) st = mtp_validate(r, db, err);
    if (st != ATOMC_OK) return st;
    struct backend *b = r->backend;
    const int R = fb0->n_logits, K = db->max_drafts, W = fb0->max_blocks_per_seq, T = fb0->n_tokens;
    mtp_reserve(r, R > 1 ? R : 1, (size_t)(R > 1 ? R : 1) * (size_t)W);
    if (T > r->mtp.d_cap) {
        if (r->mtp.d_hidden_rows) b->ops->free(b, r->mtp.d_hidden_rows);
        r->mtp.d_hidden_rows = b->ops->alloc(b, (size_t)r->max_tokens * 4);
        r->mtp.d_cap = r->mtp.d_hidden_rows ? r->max_tokens : 0;
        if (!r->mtp.d_hidden_rows)
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "MTP drafts: cannot allocate %d hidden rows", r->max_tokens);
    }
    struct forward_batch fb = *fb0;
    fb.sampling = r->mtp.greedy;
    fb.sample_ready = NULL;
    fb.sample_check = NULL;
    fb.n_prompt_lp = 0;
    const int32_t *ids = NULL;
    bool replayed = false; // the first pass as a graph replay (runner_graphs.c) where one fits
    if ((st = runner_mtp_first_replay(r, &fb, db->hidden_rows, &replayed, err)) != ATOMC_OK) return st;
    if (replayed && R > 0) {
        struct runner_output out;
        if ((st = runner_sample(r, &fb, &out, err)) != ATOMC_OK) return st;
        ids = out.ids;
    } else if (replayed) {
        b->ops->synchronize(b);
    } else {
        b->ops->copy_h2d(b, r->mtp.d_hidden_rows, db->hidden_rows, (size_t)T * 4);
        if ((st = mtp_pass(r, &fb, r->mtp.d_hidden_rows, &ids, err)) != ATOMC_OK) return st;
    }
    for (int i = 0; i < R; i++) drafts[(size_t)i * K] = ids[i];
    for (int j = 1; j < K; j++) {
        int n = 0;
        while (n < R && db->n_drafts[n] > j) n++;
        if (n == 0) break;
        for (int i = 0; i < n; i++) {
            const int si = db->row_seq[i];
            r->mtp.tok[i] = drafts[(size_t)i * K + j - 1];
            r->mtp.pos[i] = fb0->context_lens[si] + j - 1;
            r->mtp.qs[i] = i;
            r->mtp.ctx[i] = fb0->context_lens[si] + j;
            r->mtp.slot[i] = db->chain_slots[(size_t)i * (K - 1) + j - 1];
            r->mtp.rows[i] = i;
            memcpy(r->mtp.bt + (size_t)i * W, fb0->block_tables + (size_t)si * W, (size_t)W * 4);
        }
        r->mtp.qs[n] = n;
        const struct forward_batch cb = {
            .n_seqs = n,
            .n_tokens = n,
            .token_ids = r->mtp.tok,
            .positions = r->mtp.pos,
            .query_start = r->mtp.qs,
            .context_lens = r->mtp.ctx,
            .block_tables = r->mtp.bt,
            .max_blocks_per_seq = W,
            .slot_mapping = r->mtp.slot,
            .n_logits = n,
            .logits_rows = r->mtp.rows,
            .sampling = r->mtp.greedy,
        };
        // The previous pass's rows 0..n-1 (its first n logits rows) are these sequences' hidden states.
        if ((st = mtp_pass(r, &cb, NULL, &ids, err)) != ATOMC_OK) return st;
        for (int i = 0; i < n; i++) drafts[(size_t)i * K + j] = ids[i];
    }
    return ATOMC_OK;
}
