// A speculative-step schedule for the runner's verify graphs (src/runtime/runner_graphs.c), run
// on a graph runner and an eager runner side by side (tests/test_runner_graphs.c on the CPU
// under recorded graphs, tests/gpu/test_cuda_spec.c on CUDA). Header-only.
//
// Seven prompts are prefilled, then 15 steps with 1..7 live sequences (so the buckets 1, 2, 4
// and 8 are padded): each live sequence carries its last token and 0..SG_K "drafts" (arbitrary
// ids; every third step none, a decode step for the decode graphs), logits at every row. A
// pseudo-random number m of its drafts is accepted: its cache then keeps the last token and those
// m (the rejected slots are overwritten later, as after the engine's verification) and the eager
// runner's argmax at row m follows, identically in both simulations. With mtp, every step is
// followed by an MTP pass over all its rows (the hidden states read through the verify graph's
// padded rows) with one draft per sequence. The runners must have been created with
// max_num_seqs 8, num_speculative_tokens SG_K and max_logits_rows >= 8 * (1 + SG_K).
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
    double worst, scale;         // max |logit graph - eager| over every row, max |eager logit|
    double worst_mtp;            // the same for the MTP logits
    int n_verify, n_decode;      // steps with drafts (verify graphs) / without (decode graphs)
    int n_short;                 // sequence-steps with 1 .. SG_K - 1 drafts (fewer than k)
    int draft_mismatch;          // MTP drafts that differ where the eager top-2 margin is >= margin_tol
    bool failed;                 // an execute failed or a replay counter did not move as it should
};

static int sg_argmax(const float *row, int V) {
    int best = 0;
    for (int v = 1; v < V; v++) best = row[v] > row[best] ? v : best;
    return best;
}

// The MTP pass after a step over every row of fb (token t's successor at t's position, its hidden
// state row t), one draft per sequence from its last row; the MTP logits back in lg.
static bool sg_mtp_pass(struct model_runner *r, const struct forward_batch *fb, int32_t *drafts, float *lg) {
    int32_t tok[128], hrows[128], lrows[16], nd[16], rs[16];
    for (int s = 0; s < fb->n_seqs; s++) {
        for (int t = fb->query_start[s]; t < fb->query_start[s + 1]; t++) {
            tok[t] = t + 1 < fb->query_start[s + 1] ? fb->token_ids[t + 1] : 7;
            hrows[t] = t;
        }
        lrows[s] = fb->query_start[s + 1] - 1, nd[s] = 1, rs[s] = s;
    }
    struct draft_batch db = {.fb = *fb, .hidden_rows = hrows, .n_drafts = nd, .row_seq = rs, .max_drafts = 1};
    db.fb.token_ids = tok;
    db.fb.n_logits = fb->n_seqs;
    db.fb.logits_rows = lrows;
    db.fb.sampling = NULL;
    struct error err = {0};
    if (model_runner_draft(r, &db, drafts, &err) != ATOMC_OK) {
        fprintf(stderr, "  draft: %s\n", err.msg);
        return false;
    }
    const int V = model_runner_config(r)->vocab_size;
    r->backend->ops->copy_d2h(r->backend, lg, r->model->scratch.logits, (size_t)fb->n_seqs * V * sizeof(float));
    r->backend->ops->synchronize(r->backend);
    return true;
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
        for (int k = 0; k < 2 + 4 * i; k++) ids[k] = (int32_t)((i * 29 + k * 13) % (V - 4) + 4);
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
            for (int k = 0; k < sg->n_seqs; k++) dup |= sg->seqs[k] == &qg[i];
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
            int32_t dg[8], de[8];
            res.failed |= !sg_mtp_pass(rg, &fg, dg, mg) || !sg_mtp_pass(re, &fe, de, me);
            for (int k = 0; k < fe.n_seqs * V; k++) {
                double d = fabs((double)mg[k] - me[k]);
                if (!(d <= res.worst_mtp)) res.worst_mtp = d;
            }
            for (int k = 0; k < fe.n_seqs; k++) {
                if (dg[k] == de[k]) continue;
                const float *row = me + (size_t)k * V;
                float second = -INFINITY;
                for (int v = 0; v < V; v++)
                    if (v != de[k] && row[v] > second) second = row[v];
                res.draft_mismatch += row[de[k]] - second >= margin_tol;
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
