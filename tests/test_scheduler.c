// Scheduler without a model: FCFS admission, max_num_seqs, chunked-prefill budgets, decodes
// never starved, preemption of the newest sequence (to the front of the queue, recomputed
// with its generated tokens), prefix-cache hits at admission, abort in every state.
#include <stdlib.h>

#include "common/check.h"
#include "engine/scheduler.h"
#include "test.h"

struct fixture {
    struct block_manager *bm;
    struct scheduler *s;
    struct sequence *last[64]; // scheduled in the last step, with their token counts
    int last_n[64], n_last;
    struct sequence *owned[8]; // made by fx_seq, deleted by fx_free
    int n_owned;
};

static void fx_init(struct fixture *f, int blocks, int bs, int max_seqs, int budget, bool cache) {
    memset(f, 0, sizeof *f);
    struct error err;
    CHECK(block_manager_create(blocks, bs, cache, &f->bm, &err) == ATOMC_OK);
    struct scheduler_config cfg = {.max_num_seqs = max_seqs, .max_num_batched_tokens = budget};
    CHECK(scheduler_create(&cfg, f->bm, &f->s, &err) == ATOMC_OK);
}

static struct sequence *seq_new(uint64_t id, int n_prompt, int32_t base) {
    struct sequence *s = xcalloc(1, sizeof *s);
    s->id = id;
    s->cap = n_prompt + 64;
    s->tokens = xcalloc((size_t)s->cap, sizeof *s->tokens);
    for (int i = 0; i < n_prompt; i++) s->tokens[i] = base + i;
    s->n_tokens = s->n_prompt = n_prompt;
    block_table_init(&s->bt);
    return s;
}

static void seq_del(struct sequence *s) {
    block_table_free(&s->bt);
    free(s->tokens);
    free(s);
}

// A sequence the fixture owns: the test removes it from the scheduler, fx_free deletes it.
static struct sequence *fx_seq(struct fixture *f, uint64_t id, int n_prompt, int32_t base) {
    CHECK(f->n_owned < (int)(sizeof f->owned / sizeof f->owned[0]));
    return f->owned[f->n_owned++] = seq_new(id, n_prompt, base);
}

static void fx_free(struct fixture *f) {
    for (int i = 0; i < f->n_owned; i++) seq_del(f->owned[i]);
    scheduler_free(f->s);
    block_manager_free(f->bm);
}

// One step: schedule, "compute", append a token to every sequence that reached its end.
static void step(struct fixture *f, struct scheduler_output *out) {
    scheduler_schedule(f->s, 1.0, out);
    f->n_last = out->n_seqs;
    for (int i = 0; i < out->n_seqs; i++) {
        f->last[i] = out->seqs[i];
        f->last_n[i] = out->seqs[i]->n_sched;
    }
    scheduler_complete_step(f->s);
    for (int i = 0; i < out->n_seqs; i++) {
        struct sequence *q = out->seqs[i];
        if (q->n_computed == q->n_tokens) {
            CHECK(q->n_tokens < q->cap);
            q->tokens[q->n_tokens] = 1000 + q->n_tokens;
            q->n_tokens++;
        }
    }
}

// Tokens q computed in the last step (0 = not scheduled).
static int sched_of(const struct fixture *f, const struct sequence *q) {
    for (int i = 0; i < f->n_last; i++)
        if (f->last[i] == q) return f->last_n[i];
    return 0;
}

static bool consistent(struct block_manager *bm) {
    struct error err = {0};
    bool ok = block_manager_check(bm, &err);
    if (!ok) fprintf(stderr, "  %s\n", err.msg);
    return ok;
}

TEST(scheduler_validates_config) {
    struct block_manager *bm;
    struct scheduler *s;
    struct error err;
    CHECK(block_manager_create(4, 4, true, &bm, &err) == ATOMC_OK);
    struct scheduler_config cfg = {.max_num_seqs = 8, .max_num_batched_tokens = 4};
    ASSERT_EQ(scheduler_create(&cfg, bm, &s, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "max_num_batched_tokens") != NULL);
    cfg.max_num_seqs = 0;
    ASSERT_EQ(scheduler_create(&cfg, bm, &s, &err), ATOMC_ERR_INVALID_ARGUMENT);
    block_manager_free(bm);
}

TEST(scheduler_admits_fcfs_up_to_max_num_seqs) {
    struct fixture f;
    fx_init(&f, 64, 4, 2, 64, false);
    struct sequence *a = fx_seq(&f, 1, 5, 0), *b = fx_seq(&f, 2, 5, 100), *c = fx_seq(&f, 3, 5, 200);
    scheduler_add(f.s, a);
    scheduler_add(f.s, b);
    scheduler_add(f.s, c);
    struct scheduler_output o;
    step(&f, &o);
    ASSERT_EQ(o.n_seqs, 2);
    ASSERT_TRUE(o.seqs[0] == a && o.seqs[1] == b);
    ASSERT_EQ(o.n_tokens, 10);
    ASSERT_EQ(scheduler_num_waiting(f.s), 1);
    ASSERT_EQ(a->n_tokens, 6); // sampled after its full prompt
    step(&f, &o);
    ASSERT_EQ(o.n_seqs, 2);
    ASSERT_EQ(o.n_decodes, 2);
    ASSERT_EQ(o.n_tokens, 2);
    scheduler_remove(f.s, a); // a finishes: c gets its slot
    step(&f, &o);
    ASSERT_EQ(sched_of(&f, c), 5);
    ASSERT_EQ(c->n_computed, 5);
    scheduler_remove(f.s, b);
    scheduler_remove(f.s, c);
    ASSERT_EQ(block_manager_num_free(f.bm), 64);
    fx_free(&f);
}

TEST(scheduler_chunks_long_prompts_without_starving_decodes) {
    struct fixture f;
    fx_init(&f, 256, 16, 4, 32, true);
    struct sequence *d = fx_seq(&f, 1, 3, 0), *p = fx_seq(&f, 2, 100, 500);
    scheduler_add(f.s, d);
    struct scheduler_output o;
    step(&f, &o); // d prefilled
    scheduler_add(f.s, p);
    int chunks[8], n_chunks = 0, steps = 0;
    while (p->n_computed < 100) {
        step(&f, &o);
        steps++;
        ASSERT_TRUE(o.n_tokens <= 32);
        ASSERT_EQ(sched_of(&f, d), 1); // d decodes every step
        ASSERT_TRUE(o.seqs[0] == d);    // decodes come first
        if (sched_of(&f, p)) chunks[n_chunks++] = p->n_computed;
    }
    // 100 prompt tokens with 31 tokens of budget left per step: 31, 31, 31, 7.
    ASSERT_EQ(n_chunks, 4);
    ASSERT_EQ(chunks[0], 31);
    ASSERT_EQ(chunks[1], 62);
    ASSERT_EQ(chunks[2], 93);
    ASSERT_EQ(chunks[3], 100);
    ASSERT_EQ(p->n_tokens, 101); // sampled only after the last chunk
    ASSERT_EQ(d->n_tokens, 4 + steps);
    scheduler_remove(f.s, d);
    scheduler_remove(f.s, p);
    ASSERT_TRUE(consistent(f.bm));
    ASSERT_EQ(block_manager_num_free(f.bm), 256);
    fx_free(&f);
}

// The fairness rule (scheduler.h): with long_prefill_token_threshold T, a long prompt takes at
// most T tokens per step, so a short request that arrives while it is prefilled is admitted in
// the very next step and decodes in every step after it, long before the long prompt ends.
// Without the threshold the long prompt's chunks take the whole budget: the short one waits.
static int short_wait_steps(int threshold, int *long_steps) {
    struct fixture f;
    memset(&f, 0, sizeof f);
    struct error err;
    CHECK(block_manager_create(512, 16, true, &f.bm, &err) == ATOMC_OK);
    struct scheduler_config cfg = {
        .max_num_seqs = 4, .max_num_batched_tokens = 256, .long_prefill_token_threshold = threshold};
    CHECK(scheduler_create(&cfg, f.bm, &f.s, &err) == ATOMC_OK);
    struct sequence *big = fx_seq(&f, 1, 2000, 0), *small = fx_seq(&f, 2, 5, 9000);
    scheduler_add(f.s, big);
    struct scheduler_output o;
    step(&f, &o); // big's first chunk
    scheduler_add(f.s, small);
    int wait = -1, steps = 1;
    while (big->n_computed < 2000) {
        step(&f, &o);
        steps++;
        CHECK(o.n_tokens <= 256);
        if (threshold > 0) CHECK(sched_of(&f, big) <= threshold);
        if (wait < 0 && sched_of(&f, small)) wait = steps - 1; // steps from its arrival to its admission
        if (wait >= 0 && small->n_computed >= 5 && steps - 1 > wait) CHECK(sched_of(&f, small) == 1); // decodes
    }
    if (wait < 0) { // admitted only after big's prefill
        step(&f, &o);
        wait = steps;
    }
    *long_steps = steps;
    scheduler_remove(f.s, big);
    scheduler_remove(f.s, small);
    CHECK(consistent(f.bm));
    CHECK(block_manager_num_free(f.bm) == 512);
    fx_free(&f);
    return wait;
}

TEST(scheduler_long_prefill_threshold_admits_short_requests_between_chunks) {
    int long_steps;
    ASSERT_EQ(short_wait_steps(64, &long_steps), 1); // admitted in the step after it arrived
    ASSERT_EQ(long_steps, (2000 + 63) / 64);         // 64 tokens per step, none lost to the short one
    int wait0 = short_wait_steps(0, &long_steps);
    ASSERT_EQ(long_steps, (2000 + 255) / 256); // whole-budget chunks
    ASSERT_EQ(wait0, long_steps - 1);          // the short request waited until the long prompt's last
                                               // chunk left room in the budget
}

TEST(scheduler_long_prefill_threshold_caps_admission_chunks_too) {
    struct fixture f;
    memset(&f, 0, sizeof f);
    struct error err;
    CHECK(block_manager_create(512, 16, false, &f.bm, &err) == ATOMC_OK);
    struct scheduler_config cfg = {
        .max_num_seqs = 4, .max_num_batched_tokens = 256, .long_prefill_token_threshold = 100};
    ASSERT_EQ(scheduler_create(&cfg, f.bm, &f.s, &err), ATOMC_OK);
    struct sequence *a = fx_seq(&f, 1, 1000, 0), *b = fx_seq(&f, 2, 1000, 5000), *c = fx_seq(&f, 3, 30, 9000);
    scheduler_add(f.s, a);
    scheduler_add(f.s, b);
    scheduler_add(f.s, c);
    struct scheduler_output o;
    step(&f, &o); // two long prompts share the budget, 100 each; the short one gets its whole prompt
    ASSERT_EQ(sched_of(&f, a), 100);
    ASSERT_EQ(sched_of(&f, b), 100);
    ASSERT_EQ(sched_of(&f, c), 30);
    ASSERT_EQ(o.n_tokens, 230);
    step(&f, &o); // c decodes first, a and b continue
    ASSERT_TRUE(o.seqs[0] == c && o.n_decodes == 1);
    ASSERT_EQ(sched_of(&f, a), 100);
    ASSERT_EQ(sched_of(&f, b), 100);
    scheduler_remove(f.s, a);
    scheduler_remove(f.s, b);
    scheduler_remove(f.s, c);
    ASSERT_EQ(block_manager_num_free(f.bm), 512);
    cfg.long_prefill_token_threshold = -1;
    struct scheduler *bad;
    ASSERT_EQ(scheduler_create(&cfg, f.bm, &bad, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "long_prefill_token_threshold") != NULL);
    fx_free(&f);
}

TEST(scheduler_waiting_head_blocks_later_requests) {
    struct fixture f;
    fx_init(&f, 6, 4, 8, 64, false);
    struct sequence *a = fx_seq(&f, 1, 16, 0), *big = fx_seq(&f, 2, 20, 100), *small = fx_seq(&f, 3, 2, 200);
    scheduler_add(f.s, a);
    struct scheduler_output o;
    step(&f, &o);
    ASSERT_EQ(block_manager_num_free(f.bm), 2); // a holds 4 blocks; its decode takes a 5th
    scheduler_add(f.s, big);
    scheduler_add(f.s, small);
    step(&f, &o);
    // big gets a first chunk of the 1 free block... only if it fits: 4 tokens.
    ASSERT_EQ(sched_of(&f, big), 4);
    ASSERT_EQ(sched_of(&f, small), 0); // no blocks left: small waits behind big
    ASSERT_EQ(scheduler_num_waiting(f.s), 1);
    scheduler_remove(f.s, a);
    scheduler_remove(f.s, big);
    scheduler_remove(f.s, small);
    ASSERT_EQ(block_manager_num_free(f.bm), 6);
    fx_free(&f);
}

TEST(scheduler_preempts_the_newest_and_requeues_it_first) {
    struct fixture f;
    // 6 blocks of 4 tokens; three sequences of 7 tokens use 2 blocks each.
    fx_init(&f, 6, 4, 8, 64, false);
    struct sequence *a = fx_seq(&f, 1, 7, 0), *b = fx_seq(&f, 2, 7, 100), *c = fx_seq(&f, 3, 7, 200),
                    *w = fx_seq(&f, 4, 3, 300);
    scheduler_add(f.s, a);
    scheduler_add(f.s, b);
    scheduler_add(f.s, c);
    struct scheduler_output o;
    step(&f, &o); // all prefilled, each has 8 tokens, 7 computed
    ASSERT_EQ(o.n_seqs, 3);
    scheduler_add(f.s, w); // waits: no blocks
    step(&f, &o);          // each decodes token 8 (fits in block 2)
    ASSERT_EQ(o.n_decodes, 3);
    ASSERT_EQ(o.n_preempted, 0);
    ASSERT_EQ(sched_of(&f, w), 0);
    // The next decode needs a third block each: a preempts c (the newest); b then fits.
    step(&f, &o);
    ASSERT_EQ(o.n_preempted, 1);
    ASSERT_EQ(sched_of(&f, a), 1);
    ASSERT_EQ(sched_of(&f, b), 1);
    ASSERT_EQ(c->status, SEQ_STATUS_WAITING);
    ASSERT_EQ(c->n_computed, 0);
    ASSERT_EQ(c->n_tokens, 9); // generated tokens kept
    ASSERT_TRUE(scheduler_waiting_at(f.s, 0) == c && scheduler_waiting_at(f.s, 1) == w);
    step(&f, &o); // tokens 9..11 fit in the third block
    step(&f, &o);
    step(&f, &o);
    ASSERT_EQ(o.n_preempted, 0);
    ASSERT_EQ(a->n_tokens, 13);
    // Position 12 needs a fourth block: b (now the newest running) is preempted for a.
    step(&f, &o);
    ASSERT_EQ(o.n_preempted, 1);
    ASSERT_EQ(sched_of(&f, a), 1);
    ASSERT_EQ(b->status, SEQ_STATUS_WAITING);
    ASSERT_EQ(b->n_tokens, 13);
    ASSERT_EQ(f.s->num_preemptions, 2);
    // Queue order: b (admitted before c) at the front, then c, then w.
    ASSERT_TRUE(scheduler_waiting_at(f.s, 0) == b);
    ASSERT_TRUE(scheduler_waiting_at(f.s, 1) == c);
    ASSERT_TRUE(scheduler_waiting_at(f.s, 2) == w);
    ASSERT_TRUE(consistent(f.bm));
    // a finishes: b is re-admitted and recomputes prompt + generated tokens (13 tokens).
    scheduler_remove(f.s, a);
    step(&f, &o);
    ASSERT_EQ(sched_of(&f, b), 13);
    ASSERT_EQ(b->n_computed, 13);
    ASSERT_EQ(b->n_tokens, 14);
    ASSERT_EQ(b->n_preemptions, 1);
    scheduler_remove(f.s, b);
    scheduler_remove(f.s, c);
    scheduler_remove(f.s, w);
    ASSERT_EQ(block_manager_num_free(f.bm), 6);
    ASSERT_TRUE(consistent(f.bm));
    fx_free(&f);
}

TEST(scheduler_decode_preempts_itself_when_newest) {
    struct fixture f;
    fx_init(&f, 2, 4, 8, 64, false);
    struct sequence *a = fx_seq(&f, 1, 4, 0), *b = fx_seq(&f, 2, 3, 100);
    scheduler_add(f.s, a);
    scheduler_add(f.s, b);
    struct scheduler_output o;
    step(&f, &o); // a: 5 tokens (1 block), b: 4 tokens (1 block)
    // a needs a second block: b (newest) is preempted; then b waits.
    step(&f, &o);
    ASSERT_EQ(o.n_preempted, 1);
    ASSERT_EQ(sched_of(&f, a), 1);
    ASSERT_EQ(b->status, SEQ_STATUS_WAITING);
    scheduler_remove(f.s, a);
    scheduler_remove(f.s, b);
    fx_free(&f);
}

TEST(scheduler_prefix_hit_skips_cached_tokens) {
    struct fixture f;
    fx_init(&f, 32, 4, 8, 64, true);
    struct sequence *a = fx_seq(&f, 1, 10, 0), *b = fx_seq(&f, 2, 10, 0), *c = fx_seq(&f, 3, 8, 0);
    scheduler_add(f.s, a);
    struct scheduler_output o;
    step(&f, &o);
    scheduler_add(f.s, b);
    scheduler_add(f.s, c);
    step(&f, &o);
    ASSERT_EQ(b->n_cached, 8);
    ASSERT_EQ(sched_of(&f, b), 2);
    ASSERT_EQ(b->n_computed, 10);
    ASSERT_EQ(b->bt.ids[0], a->bt.ids[0]);
    ASSERT_EQ(b->bt.ids[1], a->bt.ids[1]);
    ASSERT_EQ(c->n_cached, 4); // its whole prompt is cached: recomputes the last block
    ASSERT_EQ(f.bm->hits, 12);
    ASSERT_EQ(f.bm->queries, 28);
    scheduler_remove(f.s, a);
    scheduler_remove(f.s, b);
    scheduler_remove(f.s, c);
    ASSERT_TRUE(consistent(f.bm));
    fx_free(&f);
}

TEST(scheduler_same_step_admissions_share_prefix_blocks) {
    struct fixture f;
    fx_init(&f, 32, 4, 8, 64, true);
    struct sequence *a = fx_seq(&f, 1, 13, 0), *b = fx_seq(&f, 2, 13, 0), *c = fx_seq(&f, 3, 6, 0);
    scheduler_add(f.s, a);
    scheduler_add(f.s, b);
    scheduler_add(f.s, c);
    struct scheduler_output o;
    step(&f, &o);
    // a computes 13 tokens and registers its 3 full blocks when scheduled; b and c, admitted
    // in the same step, share them (never covering their own last token).
    ASSERT_EQ(sched_of(&f, a), 13);
    ASSERT_EQ(b->n_cached, 12);
    ASSERT_EQ(sched_of(&f, b), 1);
    ASSERT_EQ(c->n_cached, 4);
    ASSERT_EQ(sched_of(&f, c), 2);
    for (int i = 0; i < 3; i++) ASSERT_EQ(b->bt.ids[i], a->bt.ids[i]);
    ASSERT_EQ(c->bt.ids[0], a->bt.ids[0]);
    ASSERT_EQ(f.bm->blocks[a->bt.ids[0]].ref_count, 3);
    scheduler_remove(f.s, a);
    scheduler_remove(f.s, b);
    scheduler_remove(f.s, c);
    ASSERT_TRUE(consistent(f.bm));
    fx_free(&f);
}

TEST(scheduler_remove_in_every_state_frees_blocks) {
    struct fixture f;
    fx_init(&f, 64, 4, 8, 16, true);
    struct sequence *dec = fx_seq(&f, 1, 3, 0), *mid = fx_seq(&f, 2, 40, 100), *wait = fx_seq(&f, 3, 5, 200);
    scheduler_add(f.s, dec);
    struct scheduler_output o;
    step(&f, &o);
    scheduler_add(f.s, mid);
    step(&f, &o);
    ASSERT_TRUE(mid->n_computed > 0 && mid->n_computed < 40); // mid-prefill
    scheduler_add(f.s, wait);
    ASSERT_EQ(scheduler_num_waiting(f.s), 1);
    scheduler_remove(f.s, wait);
    ASSERT_EQ(scheduler_num_waiting(f.s), 0);
    scheduler_remove(f.s, mid);
    ASSERT_EQ(mid->bt.n, 0);
    // Removal between schedule and completion (abort during a step) also works.
    scheduler_schedule(f.s, 2.0, &o);
    ASSERT_EQ(o.n_seqs, 1);
    scheduler_remove(f.s, dec);
    scheduler_complete_step(f.s);
    ASSERT_EQ(scheduler_num_running(f.s), 0);
    ASSERT_EQ(block_manager_num_free(f.bm), 64);
    ASSERT_TRUE(consistent(f.bm));
    fx_free(&f);
}

// Randomized scheduler properties over thousands of steps (no model): the token budget and
// max_num_seqs always hold, decodes come first and every running sequence with one token left
// is decoded or preempted in each step (never starved), chunks never exceed what remains, block
// tables cover what is computed, first admissions follow arrival order, and at the end every
// block is free.
TEST(scheduler_randomized_properties) {
    struct fixture f;
    const int budget = 20, max_seqs = 5;
    fx_init(&f, 30, 4, max_seqs, budget, true);
    enum { N = 600 };
    static struct sequence *seqs[N];
    int n = 0, admitted_in_order = 0, finished = 0;
    uint64_t next_first = 1, rng = 0x9e3779b97f4a7c15ull;
#define RND(k) (rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17, (int)(rng % (uint64_t)(k)))
    int max_out[N];
    for (int stepno = 0; stepno < 4000 && (n < N || finished < n); stepno++) {
        if (n < N && RND(3) == 0) {
            int len = 1 + RND(40);
            seqs[n] = seq_new((uint64_t)n + 1, len, RND(4) ? 0 : 1000 * n); // many share a prefix
            max_out[n] = 1 + RND(24);
            scheduler_add(f.s, seqs[n]);
            n++;
        }
        // Sequences with one token left before the step: each must be decoded or preempted.
        struct sequence *dec[64];
        int n_dec = 0;
        for (int i = 0; i < f.s->n_running; i++)
            if (sequence_n_remaining(f.s->running[i]) == 1) dec[n_dec++] = f.s->running[i];
        struct scheduler_output o;
        scheduler_schedule(f.s, (double)stepno, &o);
        ASSERT_TRUE(o.n_tokens <= budget);
        ASSERT_TRUE(o.n_seqs <= max_seqs && f.s->n_running <= max_seqs);
        int sum = 0;
        for (int i = 0; i < o.n_seqs; i++) {
            struct sequence *q = o.seqs[i];
            ASSERT_TRUE(q->n_sched >= 1 && q->n_sched <= sequence_n_remaining(q));
            ASSERT_TRUE(q->bt.n * 4 >= q->n_computed + q->n_sched);
            if (i < o.n_decodes) ASSERT_EQ(q->n_sched, 1);
            sum += q->n_sched;
            if (q->admitted_once && q->t_first_scheduled == (double)stepno && q->id >= next_first) {
                ASSERT_EQ(q->id, next_first); // first admissions in arrival order
                next_first++;
                admitted_in_order++;
            }
        }
        ASSERT_EQ(sum, o.n_tokens);
        for (int d = 0; d < n_dec; d++) {
            bool sched = false;
            for (int i = 0; i < o.n_seqs; i++) sched |= o.seqs[i] == dec[d];
            ASSERT_TRUE(sched || dec[d]->status == SEQ_STATUS_WAITING);
        }
        scheduler_complete_step(f.s);
        for (int i = 0; i < o.n_seqs; i++) {
            struct sequence *q = o.seqs[i];
            if (q->n_computed < q->n_tokens) continue;
            CHECK(q->n_tokens < q->cap);
            q->tokens[q->n_tokens] = 7 + RND(50);
            q->n_tokens++;
        }
        // Finish sequences that reached their length (out of the scheduler, blocks freed).
        for (int i = 0; i < n; i++) {
            struct sequence *q = seqs[i];
            if (q->status == SEQ_STATUS_RUNNING && sequence_n_output(q) >= max_out[i] && q->n_sched == 0) {
                scheduler_remove(f.s, q);
                q->status = SEQ_STATUS_FINISHED;
                finished++;
            }
        }
        struct error err = {0};
        if (!block_manager_check(f.bm, &err)) {
            test_fail(__FILE__, __LINE__, "step %d: %s", stepno, err.msg);
            return;
        }
    }
#undef RND
    ASSERT_EQ(finished, N);
    ASSERT_EQ(admitted_in_order, N);
    ASSERT_TRUE(f.s->num_preemptions > 0);
    ASSERT_EQ(block_manager_num_free(f.bm), 30);
    for (int i = 0; i < N; i++) seq_del(seqs[i]);
    fx_free(&f);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
