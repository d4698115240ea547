// A speculative-step schedule for the runner's verify graphs (src/runtime/runner_graphs.c), run
// on a graph runner and an eager runner side by side (tests/test_runner_graphs.c on the CPU
// under recorded graphs, tests/gpu/test_cuda_spec.c on CUDA). Header-only.
//
// Seven prompts are prefilled, then 15 steps with 1..7 live sequences (so the buckets 1, 2, 4
// and 8 are padded): each live sequence carries its last token and 0..SG_K "drafts" (arbitrary
// ids; every third step none, a decode step for the decode graphs), logits at every row. A
// pseudo-random number m of its drafts is accepted: its cache then keeps the last token and those
// m (the rejected slots are overwritten later, as after the engine's verification) and the eager
// runner's argmax at row m follows, identically in both simulations. With mtp (a runner with MTP
// layers or an EAGLE-3 head), every step is followed by a drafting pass over all its rows (the
// hidden states, or the EAGLE-3 aux states, read through the verify graph's padded rows) and up to
// SG_K chained drafts per sequence (the MTP chain graphs; an EAGLE-3 head's passes run eagerly). The runners must have
// been created with max_num_seqs 8, num_speculative_tokens SG_K and max_logits_rows >= 8 * (1 + SG_K).
#ifndef ATOMC_TESTS_SPEC_GRAPH_SCHEDULE_H
#define ATOMC_TESTS_SPEC_GRAPH_SCHEDULE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "runner_sim.h"
#include "runtime/runner_internal.h"
#include "test.h"

#define SG_K 3 // drafts per sequence at most

struct sg_result {
    double worst, scale;    // max |logit graph - eager| over every row, max |eager logit|
    double worst_mtp;       // the same for the MTP logits
    int n_verify, n_decode; // steps with drafts (verify graphs) / without (decode graphs)
    int n_short;            // sequence-steps with 1 .. SG_K - 1 drafts (fewer than k)
    int draft_mismatch;     // MTP draft chains that differ when margin_tol <= 0 (exact runs)
    int draft_diff;         // MTP draft chains that differ (any margin)
    int n_chains;           // MTP draft chains compared
    bool failed;            // an execute failed or a replay counter did not move as it should
};

// The drafter's logits width: the EAGLE-3 head's draft vocabulary, else the target's.
static int sg_draft_vocab(const struct model_runner *r) {
    return r->model->eagle3 ? r->model->eagle3->draft_vocab : model_runner_config(r)->vocab_size;
}

static int sg_argmax(const float *row, int V) {
    int best = 0;
    for (int v = 1; v < V; v++)
        best = row[v] > row[best] ? v : best;
    return best;
}

// The MTP pass after a step over every row of fb (token t's successor at t's position, its hidden
// state row t), then drafts chained from each sequence's last row: SG_K for the first half of the
// sequences, 2 for the next quarter, 1 for the rest (non-increasing, so the chained passes run
// over 1..n rows and pad into the MTP chain buckets), their cache slots at positions ctx .. ctx +
// SG_K - 2 in the sequence's blocks (sg_run reserved them). drafts: (n_seqs, SG_K); the last
// pass's MTP logits back in lg (rows of the sequences it ran).
static bool sg_mtp_pass(struct model_runner *r, struct sim *sm, const struct forward_batch *fb, int32_t *drafts,
                        float *lg, int *n_last) {
    int32_t tok[128], hrows[128], lrows[16], nd[16], rs[16], chain[16 * SG_K];
    const int n = fb->n_seqs;
    for (int s = 0; s < n; s++) {
        for (int t = fb->query_start[s]; t < fb->query_start[s + 1]; t++) {
            tok[t] = t + 1 < fb->query_start[s + 1] ? fb->token_ids[t + 1] : 7;
            hrows[t] = t;
        }
        lrows[s] = fb->query_start[s + 1] - 1, rs[s] = s;
        nd[s] = 2 * s < n ? SG_K : 4 * s < 3 * n ? 2 : 1;
        for (int j = 1; j < SG_K; j++) {
            int p = fb->context_lens[s] + j - 1;
            chain[s * (SG_K - 1) + j - 1] = sm->seqs[s]->blocks[p / sm->bs] * sm->bs + p % sm->bs;
        }
    }
    struct draft_batch db = {
        .fb = *fb, .hidden_rows = hrows, .n_drafts = nd, .row_seq = rs, .max_drafts = SG_K, .chain_slots = chain};
    db.fb.token_ids = tok;
    db.fb.n_logits = n;
    db.fb.logits_rows = lrows;
    db.fb.sampling = NULL;
    struct error err = {0};
    if (model_runner_draft(r, &db, drafts, &err) != ATOMC_OK) {
        fprintf(stderr, "  draft: %s\n", err.msg);
        return false;
    }
    *n_last = 0; // rows of the last chained pass: the sequences that wanted SG_K drafts
    for (int s = 0; s < n; s++)
        *n_last += nd[s] == SG_K;
    const int V = sg_draft_vocab(r);
    r->backend->ops->copy_d2h(r->backend, lg, r->model->scratch.logits, (size_t)*n_last * V * sizeof(float));
    r->backend->ops->synchronize(r->backend);
    return true;
}

// Blocks for q's next `tokens` positions past its cache (the MTP chain's slots), in both sims alike.
static void sg_reserve(struct sim *s, struct sim_seq *q, int tokens) {
    int need = (q->n_cached + tokens + s->bs - 1) / s->bs;
    while (q->n_blocks < need && s->n_free > 0)
        q->blocks[q->n_blocks++] = s->free_blocks[--s->n_free];
    if (q->n_blocks > s->width) s->width = q->n_blocks;
}

static struct sg_result sg_run(struct model_runner *rg, struct model_runner *re, bool mtp, float margin_tol) {
    struct sg_result res = {.scale = 1};
    const int V = model_runner_config(rg)->vocab_size;
    enum { N = 7, RMAX = 8 * (1 + SG_K) };
    struct sim *sg = malloc(sizeof *sg), *se = malloc(sizeof *se);
    sim_init(sg, rg, 321u);
    sim_init(se, re, 321u);
    struct sim_seq *qg = calloc(N, sizeof *qg), *qe = calloc(N, sizeof *qe);
    for (int i = 0; i < N; i++) {
        int32_t ids[40];
        for (int k = 0; k < 2 + 4 * i; k++)
            ids[k] = (int32_t)((i * 29 + k * 13) % (V - 4) + 4);
        sim_seq_init(&qg[i], ids, 2 + 4 * i);
        sim_seq_init(&qe[i], ids, 2 + 4 * i);
    }
    float *lg = malloc(sizeof(float) * RMAX * (size_t)V), *le = malloc(sizeof(float) * RMAX * (size_t)V);
    float *mg = malloc(sizeof(float) * 8 * (size_t)V), *me = malloc(sizeof(float) * 8 * (size_t)V);
    struct error err = {0};
    int32_t rows[RMAX];
    struct sample_row samp[RMAX];
    for (int i = 0; i < RMAX; i++) {
        rows[i] = i;
        samp[i] = (struct sample_row){.top_p = 1, .repetition_penalty = 1};
    }
    for (int i = 0; i < N && !res.failed; i++) { // prefill (eager on both)
        sim_step_begin(sg);
        sim_step_begin(se);
        res.failed |= sim_step_add(sg, &qg[i], qg[i].n_ids, 1) != 0 || sim_step_add(se, &qe[i], qe[i].n_ids, 1) != 0;
        struct forward_batch fg = sim_step_batch(sg), fe = sim_step_batch(se);
        res.failed |= model_runner_execute_logits(rg, &fg, lg, &err) != ATOMC_OK;
        res.failed |= model_runner_execute_logits(re, &fe, le, &err) != ATOMC_OK;
        sim_step_commit(sg);
        sim_step_commit(se);
        qg[i].ids[qg[i].n_ids++] = qe[i].ids[qe[i].n_ids++] = sg_argmax(le, V);
    }
    res.failed |= model_runner_num_graph_replays(rg) != 0;
    static const int live[] = {3, 1, 7, 2, 5, 4, 6, 8, 3, 1, 7, 2, 5, 4, 6};
    uint32_t rng = 77u;
    for (size_t st = 0; st < sizeof live / sizeof live[0] && !res.failed; st++) {
        int n = live[st] < N ? live[st] : N;
        sim_step_begin(sg);
        sim_step_begin(se);
        int nd[N], any = 0;
        for (int j = 0; j < n; j++) {
            int i = (int)((j * 3 + st) % N);
            bool dup = false;
            for (int k = 0; k < sg->n_seqs; k++)
                dup |= sg->seqs[k] == &qg[i];
            if (dup) continue;
            int k = sg->n_seqs;
            nd[k] = st % 3 == 2 ? 0 : (int)((i + st) % (SG_K + 1));
            any |= nd[k] > 0;
            res.n_short += nd[k] > 0 && nd[k] < SG_K;
            for (int d = 0; d < nd[k]; d++) {
                int32_t t = (int32_t)((qg[i].ids[qg[i].n_ids - 1] * 7 + d * 5 + (int)st) % (V - 4) + 4);
                qg[i].ids[qg[i].n_ids + d] = qe[i].ids[qe[i].n_ids + d] = t;
            }
            qg[i].n_ids += nd[k];
            qe[i].n_ids += nd[k];
            res.failed |= sim_step_add(sg, &qg[i], 1 + nd[k], 0) != 0 || sim_step_add(se, &qe[i], 1 + nd[k], 0) != 0;
            if (mtp) { // the chain's slots after the step's tokens
                sg_reserve(sg, &qg[i], 1 + nd[k] + SG_K);
                sg_reserve(se, &qe[i], 1 + nd[k] + SG_K);
            }
        }
        struct forward_batch fg = sim_step_batch(sg), fe = sim_step_batch(se);
        fg.n_logits = fe.n_logits = fg.n_tokens; // logits at every row
        fg.logits_rows = fe.logits_rows = rows;
        fg.sampling = fe.sampling = samp;
        uint64_t before = model_runner_num_graph_replays(rg), vbefore = model_runner_num_verify_graph_replays(rg);
        if (model_runner_execute_logits(rg, &fg, lg, &err) != ATOMC_OK ||
            model_runner_execute_logits(re, &fe, le, &err) != ATOMC_OK) {
            fprintf(stderr, "  step %zu: %s\n", st, err.msg);
            res.failed = true;
            break;
        }
        if (model_runner_num_graph_replays(rg) != before + 1 ||
            model_runner_num_verify_graph_replays(rg) != vbefore + (any ? 1 : 0)) {
            fprintf(stderr, "  step %zu (%s): the graph replay counters did not move as expected\n", st,
                    any ? "verify" : "decode");
            res.failed = true;
        }
        res.n_verify += any;
        res.n_decode += !any;
        for (int k = 0; k < fe.n_tokens * V; k++) {
            res.scale = fmax(res.scale, fabs(le[k]));
            double d = fabs((double)lg[k] - le[k]);
            if (!(d <= res.worst)) res.worst = d;
        }
        sim_step_commit(sg);
        sim_step_commit(se);
        if (mtp) {
            int32_t dg[8 * SG_K], de[8 * SG_K];
            int ng = 0, ne = 0;
            res.failed |= !sg_mtp_pass(rg, sg, &fg, dg, mg, &ng) || !sg_mtp_pass(re, se, &fe, de, me, &ne);
            // The last chained pass's logits, for the rows whose chain inputs (the drafts before
            // the last) agree: BF16 may flip an argmax at a near tie, which then feeds the chain.
            const int Vd = sg_draft_vocab(rg);
            for (int k = 0; k < ne && ng == ne; k++) {
                bool same = true;
                for (int j = 0; j + 1 < SG_K; j++)
                    same &= dg[k * SG_K + j] == de[k * SG_K + j];
                for (int v = 0; same && v < Vd; v++) {
                    double d = fabs((double)mg[(size_t)k * Vd + v] - me[(size_t)k * Vd + v]);
                    if (!(d <= res.worst_mtp)) res.worst_mtp = d;
                }
            }
            res.failed |= ng != ne;
            // Drafts: equal, or the eager run's last chained logits were a near tie there (the
            // earlier drafts of a chain feed the later ones, so only the first difference counts).
            for (int k = 0; k < fe.n_seqs; k++) {
                int nd_k = 2 * k < fe.n_seqs ? SG_K : 4 * k < 3 * fe.n_seqs ? 2 : 1;
                res.n_chains++;
                for (int j = 0; j < nd_k; j++) {
                    if (dg[k * SG_K + j] == de[k * SG_K + j]) continue;
                    res.draft_mismatch += margin_tol <= 0; // CPU: exact; CUDA: counted only as a log line
                    res.draft_diff++;
                    break;
                }
            }
        }
        for (int k = 0; k < sg->n_seqs; k++) {
            rng = rng * 1103515245u + 12345u;
            int m = nd[k] ? (int)((rng >> 8) % (unsigned)(nd[k] + 1)) : 0;
            struct sim_seq *a = sg->seqs[k], *b = se->seqs[k];
            a->n_cached -= nd[k] - m;
            b->n_cached -= nd[k] - m;
            a->n_ids = b->n_ids = a->n_cached;
            int32_t t = (int32_t)sg_argmax(le + (size_t)(se->qs[k] + m) * V, V);
            a->ids[a->n_ids++] = b->ids[b->n_ids++] = t;
        }
    }
    free(lg);
    free(le);
    free(mg);
    free(me);
    free(qg);
    free(qe);
    sim_free(sg);
    sim_free(se);
    free(sg);
    free(se);
    return res;
}

#endif
