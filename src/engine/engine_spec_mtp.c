// Speculative method "mtp" on the engine side (spec.h): after a step's outputs, the model's MTP
// layer runs over every position the step verified, and the sequences that decode next get their
// drafts for the next step.
//
// The MTP layer keeps its own cache layer in the same paged blocks as the target (runner_kv.c
// lays it out after the decoder's layers), so it is allocated, shared by prefix hits, truncated
// after rejections and freed with the sequence's blocks, and its entry at position p (which
// depends on tokens[0 .. p + 1]) is written in the step that verifies p: the positions
// [step_pos0, n_computed) of each sequence still running after the step, with token t_{p+1} and
// the target's hidden state of row step_row0 + (p - step_pos0). A sequence that decodes next (one
// token left) and may draft gets k drafts: the argmax at its last verified row, then k - 1
// chained one-token passes at positions n_tokens - 1 .. n_tokens + k - 3, whose slots the engine
// allocates here (they are the first slots the next step needs anyway; a pool too small for them
// shortens the chain). Drafts are stored in tokens[n_tokens ..) with mtp_ready; propose_drafts
// hands them to the next step only if n_tokens is unchanged. Nothing here changes an output
// token: verification decides (greedy drafts, q one-hot; spec.h).
//
// Entries that are stale only cost acceptance, never correctness: a sequence that finishes in the
// step leaves its last verified positions' MTP entries unwritten (a later prefix hit on those
// blocks reads an older entry), the entry at a block's last position depends on the token after
// the block (a prefix hit from a sequence that continues differently reads the other token's), a
// KV-transfer producer sends a prompt's blocks before this pass writes their MTP entries, and a
// failed MTP pass (logged) leaves this step's entries unwritten.
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"

void engine_mtp_free(atomc_engine *e) {
    void *ps[] = {e->mtp.tok,    e->mtp.pos,    e->mtp.slot,        e->mtp.hrows,  e->mtp.qs,   e->mtp.ctx,
                  e->mtp.lrows,  e->mtp.ndraft, e->mtp.row_seq,     e->mtp.drafts, e->mtp.seqs, e->mtp.order,
                  e->mtp.tables, e->mtp.chain_slots};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) free(ps[i]);
    memset(&e->mtp, 0, sizeof e->mtp);
}

static void mtp_reserve(atomc_engine *e, int n_seqs, int n_tok) {
    if (n_tok > e->mtp.tok_cap) {
        int c = e->mtp.tok_cap;
        e->mtp.tok = grow(e->mtp.tok, &c, n_tok, sizeof *e->mtp.tok);
        e->mtp.pos = xrealloc(e->mtp.pos, (size_t)c * 4);
        e->mtp.slot = xrealloc(e->mtp.slot, (size_t)c * 4);
        e->mtp.hrows = xrealloc(e->mtp.hrows, (size_t)c * 4);
        e->mtp.tok_cap = c;
    }
    if (n_seqs > e->mtp.seq_cap) {
        int c = e->mtp.seq_cap;
        e->mtp.seqs = grow(e->mtp.seqs, &c, n_seqs, sizeof *e->mtp.seqs);
        size_t n = (size_t)c;
        e->mtp.order = xrealloc(e->mtp.order, n * sizeof *e->mtp.order);
        e->mtp.qs = xrealloc(e->mtp.qs, (n + 1) * 4);
        e->mtp.ctx = xrealloc(e->mtp.ctx, n * 4);
        e->mtp.lrows = xrealloc(e->mtp.lrows, n * 4);
        e->mtp.ndraft = xrealloc(e->mtp.ndraft, n * 4);
        e->mtp.row_seq = xrealloc(e->mtp.row_seq, n * 4);
        e->mtp.chain_slots = xrealloc(e->mtp.chain_slots, n * ATOMC_MAX_SPEC_TOKENS * 4);
        e->mtp.drafts = xrealloc(e->mtp.drafts, n * ATOMC_MAX_SPEC_TOKENS * 4);
        e->mtp.seq_cap = c;
    }
}

// Drafts s may get next step (0: none): k, at most what it may still output minus the target's
// own token, and (k >= 2) no more than the chain slots its blocks hold after trying to allocate them.
static int mtp_wanted(atomc_engine *e, struct sequence *s, bool batch_ok) {
    if (!batch_ok || sequence_n_remaining(s) != 1 || s->params.no_speculation || s->spec_pause > 0) return 0;
    int k = s->max_output - sequence_n_output(s) - 1;
    if (k > e->spec_k) k = e->spec_k;
    if (k <= 0) return 0;
    if (k >= 2) {
        const int need = s->n_tokens + k - 2, have = s->bt.n * e->block_size;
        if (have < need && !block_manager_allocate(e->bm, &s->bt, need)) {
            int fit = s->bt.n * e->block_size - s->n_tokens + 2;
            k = fit < 1 ? 1 : fit < k ? fit : k;
        }
    }
    return k;
}

void engine_mtp_after_step(atomc_engine *e) {
    struct scheduler *sc = e->sched;
    const int bs = e->block_size;
    int n = 0, n_tok = 0, n_dec = 0;
    for (int i = 0; i < sc->n_running; i++) n_dec += sequence_n_remaining(sc->running[i]) == 1;
    const bool batch_ok = n_dec <= e->spec_max_batch;
    mtp_reserve(e, sc->n_running, 0);
    for (int i = 0; i < sc->n_running; i++) {
        struct sequence *s = sc->running[i];
        if (!s->in_step) continue;
        s->in_step = false;
        s->mtp_ready = 0;
        if (s->n_computed <= s->step_pos0) continue;
        e->mtp.seqs[n++] = s;
        n_tok += s->n_computed - s->step_pos0;
    }
    if (n == 0) return;
    mtp_reserve(e, n, n_tok);
    int n_rows = 0, max_blocks = 1;
    int32_t *kk = e->mtp.ndraft; // per sequence first, then rewritten per logits row below
    for (int i = 0; i < n; i++) {
        struct sequence *s = e->mtp.seqs[i];
        e->mtp.ctx[i] = mtp_wanted(e, s, batch_ok); // drafts wanted, kept in ctx until the loop below
        if (s->bt.n > max_blocks) max_blocks = s->bt.n;
    }
    size_t tneed = (size_t)n * (size_t)max_blocks;
    if (tneed > e->mtp.tables_cap) {
        e->mtp.tables = xrealloc(e->mtp.tables, tneed * 2 * 4);
        e->mtp.tables_cap = tneed * 2;
    }
    // Drafting sequences in order of non-increasing drafts (the runner's chained steps then run over
    // a prefix of the rows); stable, so ties keep the batch order.
    for (int i = 0; i < n; i++) {
        if (e->mtp.ctx[i] <= 0) continue;
        int r = n_rows++;
        while (r > 0 && e->mtp.ctx[e->mtp.row_seq[r - 1]] < e->mtp.ctx[i]) {
            e->mtp.row_seq[r] = e->mtp.row_seq[r - 1];
            r--;
        }
        e->mtp.row_seq[r] = i;
    }
    for (int r = 0; r < n_rows; r++) kk[r] = e->mtp.ctx[e->mtp.row_seq[r]];
    const int K = n_rows ? kk[0] : 1;
    int tok = 0;
    for (int i = 0; i < n; i++) {
        struct sequence *s = e->mtp.seqs[i];
        e->mtp.qs[i] = tok;
        for (int p = s->step_pos0; p < s->n_computed; p++, tok++) {
            e->mtp.tok[tok] = s->tokens[p + 1];
            e->mtp.pos[tok] = p;
            e->mtp.slot[tok] = s->bt.ids[p / bs] * bs + p % bs;
            e->mtp.hrows[tok] = s->step_row0 + (p - s->step_pos0);
        }
        e->mtp.ctx[i] = s->n_computed;
        int32_t *row = e->mtp.tables + (size_t)i * max_blocks;
        memcpy(row, s->bt.ids, (size_t)s->bt.n * 4);
        for (int b = s->bt.n; b < max_blocks; b++) row[b] = 0; // padding, never read
    }
    e->mtp.qs[n] = tok;
    CHECK(tok == n_tok);
    for (int r = 0; r < n_rows; r++) {
        const int i = e->mtp.row_seq[r];
        const struct sequence *s = e->mtp.seqs[i];
        e->mtp.lrows[r] = e->mtp.qs[i + 1] - 1;
        for (int j = 1; j < K; j++) {
            int p = e->mtp.ctx[i] + j - 1;
            e->mtp.chain_slots[(size_t)r * (K - 1) + j - 1] = j < kk[r] ? s->bt.ids[p / bs] * bs + p % bs : -1;
        }
    }
    struct draft_batch db = {
        .fb = {.n_seqs = n,
               .n_tokens = n_tok,
               .token_ids = e->mtp.tok,
               .positions = e->mtp.pos,
               .query_start = e->mtp.qs,
               .context_lens = e->mtp.ctx,
               .block_tables = e->mtp.tables,
               .max_blocks_per_seq = max_blocks,
               .slot_mapping = e->mtp.slot,
               .n_logits = n_rows,
               .logits_rows = e->mtp.lrows},
        .hidden_rows = e->mtp.hrows,
        .n_drafts = kk,
        .row_seq = e->mtp.row_seq,
        .max_drafts = K,
        .chain_slots = e->mtp.chain_slots,
    };
    struct error err = {0};
    atomc_status st = e->su.model.draft(e->su.model.ctx, &db, e->mtp.drafts, &err);
    if (st != ATOMC_OK) {
        LOG_WARN("MTP drafting failed (%s): %s; the next step decodes without drafts", atomc_status_name(st), err.msg);
        return;
    }
    for (int r = 0; r < n_rows; r++) {
        struct sequence *s = e->mtp.seqs[e->mtp.row_seq[r]];
        const int k = kk[r];
        if (s->n_tokens + k > s->cap) {
            while (s->n_tokens + k > s->cap) s->cap *= 2;
            s->tokens = xrealloc(s->tokens, (size_t)s->cap * sizeof *s->tokens);
        }
        memcpy(s->tokens + s->n_tokens, e->mtp.drafts + (size_t)r * K, (size_t)k * 4);
        s->mtp_ready = k;
        s->mtp_ready_at = s->n_tokens;
    }
}
