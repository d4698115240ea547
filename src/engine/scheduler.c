// Scheduler: see scheduler.h for the policy.
#include "engine/scheduler.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"

atomc_status scheduler_create(const struct scheduler_config *cfg, struct block_manager *bm, struct scheduler **out,
                              struct error *err) {
    *out = NULL;
    if (cfg->max_num_seqs <= 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "max_num_seqs must be positive, got %d", cfg->max_num_seqs);
    if (cfg->max_num_batched_tokens < cfg->max_num_seqs)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "max_num_batched_tokens (%d) must be at least max_num_seqs (%d) so every running sequence "
                         "can decode each step",
                         cfg->max_num_batched_tokens, cfg->max_num_seqs);
    if (cfg->long_prefill_token_threshold < 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "long_prefill_token_threshold must be >= 0, got %d",
                         cfg->long_prefill_token_threshold);
    if (cfg->state_slots < 0 || (cfg->state_slots > 0 && cfg->state_slots < cfg->max_num_seqs))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%d recurrent-state slots for max_num_seqs %d",
                         cfg->state_slots, cfg->max_num_seqs);
    struct scheduler *s = xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    s->bm = bm;
    s->run_cap = cfg->max_num_seqs;
    s->running = xcalloc((size_t)s->run_cap, sizeof *s->running);
    s->scheduled = xcalloc((size_t)s->run_cap, sizeof *s->scheduled);
    s->wait_cap = 64;
    s->waiting = xcalloc((size_t)s->wait_cap, sizeof *s->waiting);
    if (cfg->state_slots > 0) {
        s->free_slots = xcalloc((size_t)cfg->state_slots, sizeof *s->free_slots);
        for (int i = 0; i < cfg->state_slots; i++) s->free_slots[i] = cfg->state_slots - 1 - i; // pops 0 first
        s->n_free_slots = cfg->state_slots;
    }
    *out = s;
    return ATOMC_OK;
}

void scheduler_free(struct scheduler *s) {
    if (!s) return;
    free(s->running);
    free(s->scheduled);
    free(s->waiting);
    free(s->match);
    free(s->match_sw);
    free(s->free_slots);
    free(s);
}

// --- waiting deque ---------------------------------------------------------------------------

struct sequence *scheduler_waiting_at(const struct scheduler *s, int i) {
    CHECK(i >= 0 && i < s->n_waiting);
    return s->waiting[(s->wait_head + i) % s->wait_cap];
}

static void waiting_grow(struct scheduler *s) {
    if (s->n_waiting < s->wait_cap) return;
    int cap = s->wait_cap * 2;
    struct sequence **w = xcalloc((size_t)cap, sizeof *w);
    for (int i = 0; i < s->n_waiting; i++) w[i] = scheduler_waiting_at(s, i);
    free(s->waiting);
    s->waiting = w;
    s->wait_cap = cap;
    s->wait_head = 0;
}

static void waiting_push_back(struct scheduler *s, struct sequence *seq) {
    waiting_grow(s);
    s->waiting[(s->wait_head + s->n_waiting) % s->wait_cap] = seq;
    s->n_waiting++;
}

static void waiting_push_front(struct scheduler *s, struct sequence *seq) {
    waiting_grow(s);
    s->wait_head = (s->wait_head + s->wait_cap - 1) % s->wait_cap;
    s->waiting[s->wait_head] = seq;
    s->n_waiting++;
}

static void waiting_pop_front(struct scheduler *s) {
    CHECK(s->n_waiting > 0);
    s->wait_head = (s->wait_head + 1) % s->wait_cap;
    s->n_waiting--;
}

static bool waiting_remove(struct scheduler *s, struct sequence *seq) {
    for (int i = 0; i < s->n_waiting; i++) {
        if (scheduler_waiting_at(s, i) != seq) continue;
        for (int j = i; j + 1 < s->n_waiting; j++)
            s->waiting[(s->wait_head + j) % s->wait_cap] = s->waiting[(s->wait_head + j + 1) % s->wait_cap];
        s->n_waiting--;
        return true;
    }
    return false;
}

void scheduler_set_sliding_group(struct scheduler *s, struct block_manager *bm_sw, int window) {
    CHECK(bm_sw && window > 0 && bm_sw->block_size == s->bm->block_size && s->cfg.sliding_window == 0);
    CHECK(bm_sw->enable_prefix_caching == s->bm->enable_prefix_caching && s->n_running == 0);
    s->bm_sw = bm_sw;
    s->sw_window = window;
}

// Drops seq's references in every group and empties its tables.
static void release_blocks(struct scheduler *s, struct sequence *seq) {
    block_manager_release(s->bm, &seq->bt);
    if (s->bm_sw) block_manager_release(s->bm_sw, &seq->bt_sw);
}

void scheduler_add(struct scheduler *s, struct sequence *seq) {
    CHECK(seq->status == SEQ_STATUS_WAITING && seq->bt.n == 0 && seq->bt_sw.n == 0);
    seq->state_slot = -1;
    waiting_push_back(s, seq);
}

// --- running set ---------------------------------------------------------------------------

static int running_index(const struct scheduler *s, const struct sequence *seq) {
    for (int i = s->n_running - 1; i >= 0; i--)
        if (s->running[i] == seq) return i;
    return -1;
}

static void running_remove_at(struct scheduler *s, int i) {
    memmove(s->running + i, s->running + i + 1, (size_t)(s->n_running - i - 1) * sizeof *s->running);
    s->n_running--;
}

static void slot_release(struct scheduler *s, struct sequence *seq) {
    if (seq->state_slot < 0) return;
    CHECK(s->n_free_slots < s->cfg.state_slots);
    s->free_slots[s->n_free_slots++] = seq->state_slot;
    seq->state_slot = -1;
}

static void preempt(struct scheduler *s, int i, int *n_preempted) {
    struct sequence *seq = s->running[i];
    CHECK(seq->n_sched == 0);
    running_remove_at(s, i);
    release_blocks(s, seq);
    slot_release(s, seq);
    seq->n_computed = 0;
    seq->n_draft = 0;
    seq->status = SEQ_STATUS_WAITING;
    seq->n_preemptions++;
    waiting_push_front(s, seq);
    s->num_preemptions++;
    (*n_preempted)++;
}

// The most recently admitted running sequence that is not scheduled this step and was
// admitted after `than` (NULL: any). Returns its index or -1.
static int pick_victim(const struct scheduler *s, const struct sequence *than) {
    for (int i = s->n_running - 1; i >= 0; i--) {
        const struct sequence *v = s->running[i];
        if (than && v->admit_order <= than->admit_order) return -1;
        if (v->n_sched == 0) return i;
    }
    return -1;
}

// Tokens (at most want) that seq can compute now given its blocks plus the free pool (of every
// group: the sliding group's table holds its dropped leading entries too, so the same count works).
static int fit_tokens(const struct scheduler *s, const struct sequence *seq, int want) {
    long cap = (long)(seq->bt.n + block_manager_num_free(s->bm)) * s->bm->block_size - seq->n_computed;
    if (s->bm_sw) {
        long cap_sw = (long)(seq->bt_sw.n + block_manager_num_free(s->bm_sw)) * s->bm->block_size - seq->n_computed;
        if (cap_sw < cap) cap = cap_sw;
    }
    return cap < want ? (int)(cap > 0 ? cap : 0) : want;
}

// Tokens a prefill chunk asks for: its remaining ones, at most the budget left and the
// long-prefill threshold.
static int chunk_want(const struct scheduler *s, int rem, int budget) {
    int want = rem < budget ? rem : budget, t = s->cfg.long_prefill_token_threshold;
    return t > 0 && want > t ? t : want;
}

static void mark_scheduled(struct scheduler *s, struct sequence *seq, int n, int *budget, int *n_tokens) {
    CHECK(n > 0 && seq->n_sched == 0 && s->n_scheduled < s->run_cap);
    bool ok = block_manager_allocate(s->bm, &seq->bt, seq->n_computed + n);
    CHECK(ok);
    // Blocks this step fills are registered now, so sequences admitted later in the same step
    // share them instead of recomputing (see block_manager.h on same-step sharing).
    block_manager_commit(s->bm, &seq->bt, seq->tokens, seq->n_computed + n);
    if (s->bm_sw) {
        ok = block_manager_allocate(s->bm_sw, &seq->bt_sw, seq->n_computed + n);
        CHECK(ok);
        block_manager_commit(s->bm_sw, &seq->bt_sw, seq->tokens, seq->n_computed + n);
    }
    seq->n_sched = n;
    s->scheduled[s->n_scheduled++] = seq;
    *budget -= n;
    *n_tokens += n;
}

void scheduler_schedule(struct scheduler *s, double now, struct scheduler_output *out) {
    int budget = s->cfg.max_num_batched_tokens, n_tokens = 0, n_preempted = 0;
    s->n_scheduled = 0;
    if (s->cfg.sliding_window > 0)
        for (int i = 0; i < s->n_running; i++) {
            struct sequence *seq = s->running[i];
            block_manager_drop_before(s->bm, &seq->bt, seq->n_computed - s->cfg.sliding_window + 1);
        }
    if (s->bm_sw)
        for (int i = 0; i < s->n_running; i++) {
            struct sequence *seq = s->running[i];
            block_manager_drop_before(s->bm_sw, &seq->bt_sw, seq->n_computed - s->sw_window + 1);
        }

    // Pass 1: decodes, in admission order; preempt the newest to make room.
    for (int i = 0; i < s->n_running; i++) {
        struct sequence *seq = s->running[i];
        if (sequence_n_remaining(seq) != 1) continue;
        bool self_preempted = false;
        while (fit_tokens(s, seq, 1) < 1) {
            int v = pick_victim(s, NULL);
            CHECK(v >= 0);
            if (s->running[v] == seq) {
                preempt(s, v, &n_preempted);
                self_preempted = true;
                break;
            }
            preempt(s, v, &n_preempted);
        }
        if (self_preempted) break; // seq was the newest: nothing after it is left
        mark_scheduled(s, seq, 1, &budget, &n_tokens);
    }
    out->n_decodes = s->n_scheduled;

    // Pass 1b: draft tokens of the decodes, in admission order, from what the budget and the free
    // pool hold after every decode has its one token; never by preempting (no room: no drafts).
    for (int i = 0; i < s->n_running; i++) {
        struct sequence *seq = s->running[i];
        if (seq->n_draft == 0) continue;
        int d = seq->n_sched == 1 && sequence_n_remaining(seq) == 1 ? seq->n_draft : 0;
        if (d > budget) d = budget;
        if (d > 0 && fit_tokens(s, seq, 1 + d) < 1 + d) d = 0;
        if (d > 0) {
            CHECK(block_manager_allocate(s->bm, &seq->bt, seq->n_computed + 1 + d));
            if (s->bm_sw) CHECK(block_manager_allocate(s->bm_sw, &seq->bt_sw, seq->n_computed + 1 + d));
        }
        seq->n_draft = d;
        seq->n_sched += d;
        budget -= d;
        n_tokens += d;
    }

    // Pass 2: ongoing chunked prefills, oldest first.
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        struct sequence *seq = s->running[i];
        int rem = sequence_n_remaining(seq);
        if (seq->n_sched || rem <= 1) continue;
        int want = chunk_want(s, rem, budget), n;
        while ((n = fit_tokens(s, seq, want)) < 1) {
            int v = pick_victim(s, seq);
            if (v < 0) break;
            preempt(s, v, &n_preempted);
        }
        if (n >= 1) mark_scheduled(s, seq, n, &budget, &n_tokens);
    }

    // Pass 3: admissions, FCFS; none in a step that had to preempt (that would only thrash).
    while (n_preempted == 0 && s->n_waiting > 0 && s->n_running < s->cfg.max_num_seqs && budget > 0) {
        struct sequence *seq = scheduler_waiting_at(s, 0);
        CHECK(seq->n_computed == 0 && seq->bt.n == 0);
        int bs = s->bm->block_size, n_match = 0, n_revived = 0;
        if (!seq->no_prefix_cache && s->bm->enable_prefix_caching) {
            int max = seq->n_tokens / bs + 1;
            if (max > s->match_cap) {
                s->match_cap = max * 2;
                s->match = xrealloc(s->match, (size_t)s->match_cap * sizeof *s->match);
            }
            n_match = block_manager_lookup(s->bm, seq->tokens, seq->n_tokens, s->match, &n_revived);
        }
        // Hybrid models: the hit also needs the sliding group's blocks of the window before it.
        int lo_sw = 0, rev_sw = 0;
        uint64_t hash_sw = 0;
        if (s->bm_sw && n_match > 0) {
            if (n_match > s->match_sw_cap) {
                s->match_sw_cap = s->match_cap > n_match ? s->match_cap : n_match;
                s->match_sw = xrealloc(s->match_sw, (size_t)s->match_sw_cap * sizeof *s->match_sw);
            }
            int k = block_manager_lookup_window(s->bm_sw, seq->tokens, n_match, s->sw_window, s->match_sw, &lo_sw,
                                                &rev_sw, &hash_sw);
            if (k < n_match) {
                n_match = k;
                n_revived = 0;
                for (int j = 0; j < k; j++) n_revived += s->bm->blocks[s->match[j]].ref_count == 0;
            }
        }
        int cached = n_match * bs, rem = seq->n_tokens - cached;
        int want = chunk_want(s, rem, budget);
        long free_fresh = (long)block_manager_num_free(s->bm) - n_revived;
        long cap = (long)(n_match + free_fresh) * bs - cached;
        if (s->bm_sw) {
            long cap_sw = (long)(n_match + block_manager_num_free(s->bm_sw) - rev_sw) * bs - cached;
            if (cap_sw < cap) cap = cap_sw;
        }
        int n = cap < want ? (int)cap : want;
        if (n < 1) break; // the head does not fit: wait (FCFS, no overtaking)
        waiting_pop_front(s);
        if (n_match && s->bm_sw) block_manager_acquire_window(s->bm_sw, &seq->bt_sw, s->match_sw, lo_sw, n_match, hash_sw);
        if (n_match) block_manager_acquire_prefix(s->bm, &seq->bt, s->match, n_match, seq->n_tokens);
        else if (!seq->no_prefix_cache && s->bm->enable_prefix_caching) {
            s->bm->queries += (uint64_t)seq->n_tokens;
        }
        seq->n_computed = cached;
        seq->status = SEQ_STATUS_RUNNING;
        if (s->cfg.state_slots > 0) { // n_running < max_num_seqs <= slots: one is free
            CHECK(s->n_free_slots > 0 && seq->state_slot < 0);
            seq->state_slot = s->free_slots[--s->n_free_slots];
        }
        seq->admit_order = ++s->admit_counter;
        s->running[s->n_running++] = seq;
        if (!seq->admitted_once) {
            seq->admitted_once = true;
            seq->n_cached = cached;
            seq->t_first_scheduled = now;
        }
        mark_scheduled(s, seq, n, &budget, &n_tokens);
    }

    out->seqs = s->scheduled;
    out->n_seqs = s->n_scheduled;
    out->n_tokens = n_tokens;
    out->n_preempted = n_preempted;
}

bool scheduler_admit_prefilled(struct scheduler *s, struct sequence *seq, double now) {
    CHECK(seq->status == SEQ_STATUS_WAITING && seq->n_sched == 0 && seq->n_computed < seq->n_tokens);
    if (s->n_running >= s->cfg.max_num_seqs) return false;
    // A sequence whose prompt KV arrived from a prefill instance (engine_kv_transfer.c) never went
    // through scheduler_add: it holds no recurrent-state slot (P/D is refused for recurrent models).
    CHECK_MSG(s->cfg.state_slots == 0, "prefilled admission with recurrent state slots");
    CHECK_MSG(!s->bm_sw, "prefilled admission with per-layer-group block tables");
    seq->state_slot = -1;
    seq->status = SEQ_STATUS_RUNNING;
    seq->admit_order = ++s->admit_counter;
    s->running[s->n_running++] = seq;
    if (!seq->admitted_once) {
        seq->admitted_once = true;
        seq->t_first_scheduled = now;
    }
    return true;
}

void scheduler_complete_step(struct scheduler *s) {
    for (int i = 0; i < s->n_scheduled; i++) {
        struct sequence *seq = s->scheduled[i];
        // Draft tokens are not computed yet as far as the sequence knows: verification (the
        // engine) adds the accepted ones.
        seq->n_computed += seq->n_sched - seq->n_draft;
        CHECK(seq->n_computed <= seq->n_tokens);
        seq->n_sched = 0;
    }
    s->n_scheduled = 0;
}

void scheduler_remove(struct scheduler *s, struct sequence *seq) {
    int i = running_index(s, seq);
    if (i >= 0) running_remove_at(s, i);
    else CHECK_MSG(waiting_remove(s, seq), "sequence %llu is not in the scheduler", (unsigned long long)seq->id);
    for (int j = 0; j < s->n_scheduled; j++)
        if (s->scheduled[j] == seq) { // removed mid-step: drop it from this step's list
            seq->n_sched = 0;
            seq->n_draft = 0;
            memmove(s->scheduled + j, s->scheduled + j + 1, (size_t)(s->n_scheduled - j - 1) * sizeof *s->scheduled);
            s->n_scheduled--;
            break;
        }
    release_blocks(s, seq);
    slot_release(s, seq);
}
