// A miniature engine for runner tests: sequences with token ids and KV blocks taken from a
// shuffled free list (so block tables are never contiguous), and a builder that turns
// "these sequences advance by these many tokens" into a struct forward_batch exactly as the
// engine would (positions, slot mapping, block tables, query starts, logits rows).
// Header-only (static functions) so each test binary includes what it needs.
#ifndef ATOMC_TESTS_RUNNER_SIM_H
#define ATOMC_TESTS_RUNNER_SIM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/model_runner.h"

#define SIM_MAX_SEQS 16
#define SIM_MAX_TOKENS 4096

struct sim_seq {
    int32_t ids[SIM_MAX_TOKENS]; // prompt + generated
    int n_ids;
    int n_cached;                // tokens whose K/V are in the cache
    int blocks[SIM_MAX_TOKENS / 4];
    int n_blocks;
    int state_slot;              // recurrent-state slot (models with recurrent layers; set by the test)
};

struct sim {
    struct model_runner *r;
    int bs;
    int *free_blocks;
    int n_free;
    // The batch being built (valid until the next sim_step_begin).
    int32_t tok[SIM_MAX_TOKENS], pos[SIM_MAX_TOKENS], slot[SIM_MAX_TOKENS];
    int32_t qs[SIM_MAX_SEQS + 1], ctx[SIM_MAX_SEQS], rows[SIM_MAX_SEQS], sslot[SIM_MAX_SEQS];
    int32_t bt[SIM_MAX_SEQS * (SIM_MAX_TOKENS / 4)];
    struct sample_row samp[SIM_MAX_SEQS];
    struct sim_seq *seqs[SIM_MAX_SEQS];
    int n_new[SIM_MAX_SEQS];
    int n_seqs, n_tokens, n_rows, width;
};

static inline void sim_init(struct sim *s, struct model_runner *r, unsigned seed) {
    memset(s, 0, sizeof *s);
    s->r = r;
    s->bs = model_runner_block_size(r);
    int n = model_runner_num_kv_blocks(r), n_sw = 0;
    // Per-layer-group block tables: the sliding layers' table is the same as the full layers' (ids
    // valid in both pools), so the sim draws from the smaller pool.
    if (model_runner_kv_groups(r, NULL, &n_sw) && n_sw < n) n = n_sw;
    s->free_blocks = malloc(sizeof(int) * (size_t)n);
    for (int i = 0; i < n; i++) s->free_blocks[i] = i;
    for (int i = n - 1; i > 0; i--) { // Fisher-Yates with a tiny LCG: deterministic, non-contiguous
        seed = seed * 1103515245u + 12345u;
        int j = (int)((seed >> 8) % (unsigned)(i + 1));
        int t = s->free_blocks[i];
        s->free_blocks[i] = s->free_blocks[j];
        s->free_blocks[j] = t;
    }
    s->n_free = n;
}

static inline void sim_free(struct sim *s) { free(s->free_blocks); }

static inline void sim_seq_init(struct sim_seq *q, const int32_t *ids, int n) {
    memset(q, 0, sizeof *q);
    memcpy(q->ids, ids, sizeof(int32_t) * (size_t)n);
    q->n_ids = n;
}

// Returns a sequence's blocks to the free list.
static inline void sim_seq_release(struct sim *s, struct sim_seq *q) {
    for (int i = q->n_blocks - 1; i >= 0; i--) s->free_blocks[s->n_free++] = q->blocks[i];
    q->n_blocks = 0;
}

static inline void sim_step_begin(struct sim *s) {
    s->n_seqs = s->n_tokens = s->n_rows = 0;
    s->width = 1;
    s->qs[0] = 0;
}

// Adds `n_new` tokens of q (from q->n_cached on) to the batch; want_logits asks for the
// logits / a sampled token of its last new token (greedy unless temperature set later).
static inline int sim_step_add(struct sim *s, struct sim_seq *q, int n_new, int want_logits) {
    int need = (q->n_cached + n_new + s->bs - 1) / s->bs;
    while (q->n_blocks < need) {
        if (s->n_free == 0) return -1;
        q->blocks[q->n_blocks++] = s->free_blocks[--s->n_free];
    }
    int k = s->n_seqs++;
    s->seqs[k] = q;
    s->n_new[k] = n_new;
    for (int i = 0; i < n_new; i++) {
        int p = q->n_cached + i, t = s->n_tokens++;
        s->tok[t] = q->ids[p];
        s->pos[t] = p;
        s->slot[t] = q->blocks[p / s->bs] * s->bs + p % s->bs;
    }
    s->qs[k + 1] = s->n_tokens;
    s->ctx[k] = q->n_cached + n_new;
    if (need > s->width) s->width = need;
    if (want_logits) {
        s->rows[s->n_rows] = s->n_tokens - 1;
        memset(&s->samp[s->n_rows], 0, sizeof s->samp[0]);
        s->samp[s->n_rows].top_p = 1.0f;
        s->samp[s->n_rows].repetition_penalty = 1.0f;
        s->samp[s->n_rows].prompt_ids = q->ids;
        s->samp[s->n_rows].n_prompt = q->n_ids;
        s->n_rows++;
    }
    return 0;
}

// Finishes the batch: block tables packed with the batch's width.
static inline struct forward_batch sim_step_batch(struct sim *s) {
    for (int k = 0; k < s->n_seqs; k++) {
        struct sim_seq *q = s->seqs[k];
        for (int j = 0; j < s->width; j++) s->bt[k * s->width + j] = j < q->n_blocks ? q->blocks[j] : 0;
        s->sslot[k] = q->state_slot;
    }
    struct forward_batch fb = {
        .n_seqs = s->n_seqs, .n_tokens = s->n_tokens, .token_ids = s->tok, .positions = s->pos,
        .query_start = s->qs, .context_lens = s->ctx, .block_tables = s->bt, .max_blocks_per_seq = s->width,
        .slot_mapping = s->slot, .n_logits = s->n_rows, .logits_rows = s->rows, .sampling = s->samp,
        .block_tables_sw = model_runner_kv_groups(s->r, NULL, NULL) ? s->bt : NULL,
        .slot_mapping_sw = model_runner_kv_groups(s->r, NULL, NULL) ? s->slot : NULL,
        .state_slots = model_runner_num_state_slots(s->r) > 0 ? s->sslot : NULL,
    };
    return fb;
}

// After a successful execute: the new tokens are cached.
static inline void sim_step_commit(struct sim *s) {
    for (int k = 0; k < s->n_seqs; k++) s->seqs[k]->n_cached += s->n_new[k];
}

// Greedy decode of q alone: a step over what is not cached yet (the prompt first), then one token a
// step, n steps; got[k] is the k-th sampled token, also appended to q. ATOMC_ERR_OUT_OF_MEMORY when
// the sim's blocks run out, else the first failing execute's status (with err).
static inline atomc_status sim_greedy(struct sim *s, struct sim_seq *q, int n, int32_t *got, struct error *err) {
    for (int k = 0; k < n; k++) {
        sim_step_begin(s);
        if (sim_step_add(s, q, q->n_ids - q->n_cached, 1) != 0) return ATOMC_ERR_OUT_OF_MEMORY;
        struct forward_batch fb = sim_step_batch(s);
        struct runner_output out;
        atomc_status st = model_runner_execute(s->r, &fb, &out, err);
        if (st != ATOMC_OK) return st;
        sim_step_commit(s);
        got[k] = out.ids[0];
        q->ids[q->n_ids++] = out.ids[0];
    }
    return ATOMC_OK;
}

#endif
