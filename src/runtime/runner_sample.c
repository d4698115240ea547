// Sampling glue of the model runner (runner_internal.h): sampling parameters and penalty
// histories to the backend's sampler, ids and logprobs back; prompt logprobs (echo) in chunks
// of max_logits_rows rows with the log-softmax on the host (a rare path, off the decode loop).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sample_rng.h"
#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "runtime/runner_internal.h"

_Static_assert(RUNNER_ID_NONFINITE == SAMPLE_ID_NONFINITE, "one value for a non-finite row");

// Prompt logprobs: logits of the requested rows in chunks, log-softmax on the host. A row with a
// NaN or +inf logit gets NaN logprobs (the engine fails its request).
void runner_prompt_logprobs(struct model_runner *r, const struct forward_batch *fb) {
    struct backend *b = r->backend;
    const int V = r->cfg.vocab_size, k = fb->prompt_lp_k;
    for (int c0 = 0; c0 < fb->n_prompt_lp; c0 += r->max_rows) {
        int n = fb->n_prompt_lp - c0 < r->max_rows ? fb->n_prompt_lp - c0 : r->max_rows;
        struct tensor lg = model_compute_logits(r->model, DPTR(r, lp_rows, int32_t) + c0, n);
        b->ops->copy_d2h(b, r->h_logits, lg.data, (size_t)n * (size_t)V * sizeof(float));
        for (int i = 0; i < n; i++) {
            const float *row = r->h_logits + (size_t)i * V;
            float mx = row[0];
            bool bad = false;
            for (int j = 0; j < V; j++) {
                mx = row[j] > mx ? row[j] : mx;
                bad |= isnan(row[j]) || row[j] == INFINITY;
            }
            if (bad) {
                int o = c0 + i;
                r->h_plp[o] = NAN;
                for (int j = 0; j < k; j++) {
                    r->h_plp_top_ids[(size_t)o * k + j] = -1;
                    r->h_plp_top_lp[(size_t)o * k + j] = NAN;
                }
                continue;
            }
            double sum = 0;
            for (int j = 0; j < V; j++) sum += exp((double)row[j] - mx);
            float lse = mx + (float)log(sum);
            int o = c0 + i;
            r->h_plp[o] = row[fb->prompt_lp_targets[o]] - lse;
            int32_t *ti = r->h_plp_top_ids + (size_t)o * k;
            float *tl = r->h_plp_top_lp + (size_t)o * k;
            // Partial selection of the k best (k <= 20): insertion into a sorted prefix.
            int have = 0;
            for (int j = 0; j < V && k > 0; j++) {
                float v = row[j];
                if (have == k && v <= tl[k - 1]) continue;
                int p = have < k ? have++ : k - 1;
                while (p > 0 && tl[p - 1] < v) {
                    tl[p] = tl[p - 1];
                    ti[p] = ti[p - 1];
                    p--;
                }
                tl[p] = v;
                ti[p] = j;
            }
            for (int j = 0; j < k; j++) tl[j] -= lse;
        }
    }
}

static atomc_status runner_hist_reserve(struct model_runner *r, size_t n, struct error *err) {
    if (n <= r->hist_cap) return ATOMC_OK;
    size_t want = n + n / 2 + 1024;
    struct backend *b = r->backend;
    if (r->d_hist) b->ops->free(b, r->d_hist);
    r->d_hist = b->ops->alloc(b, want * 4);
    int32_t *h = realloc(r->h_hist, want * 4);
    if (!r->d_hist || !h) {
        if (h) r->h_hist = h;
        r->hist_cap = 0;
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu token ids of penalty history", want);
    }
    r->h_hist = h;
    r->hist_cap = want;
    return ATOMC_OK;
}

static atomc_status runner_mask_reserve(struct model_runner *r, size_t words, struct error *err) {
    if (words <= r->mask_cap) return ATOMC_OK;
    size_t want = words + words / 2;
    struct backend *b = r->backend;
    if (r->d_mask) b->ops->free(b, r->d_mask);
    r->d_mask = b->ops->alloc(b, want * 4);
    uint32_t *h = realloc(r->h_mask, want * 4);
    if (h) r->h_mask = h;
    if (!r->d_mask || !h) {
        r->mask_cap = 0;
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu words of token bitmasks", want);
    }
    r->mask_cap = want;
    return ATOMC_OK;
}

// Structured output: the rows' grammar bitmasks (sample_row.allowed, NULL = all ones) packed
// and uploaded in one copy; NULL when no row is constrained.
static atomc_status runner_upload_masks(struct model_runner *r, const struct forward_batch *fb, int words,
                                        const uint32_t **dev, struct error *err) {
    const int n = fb->n_logits;
    *dev = NULL;
    bool any = false;
    for (int i = 0; i < n && !any; i++) any = fb->sampling[i].allowed != NULL;
    if (!any) return ATOMC_OK;
    atomc_status st = runner_mask_reserve(r, (size_t)n * (size_t)words, err);
    if (st != ATOMC_OK) return st;
    for (int i = 0; i < n; i++) {
        uint32_t *dst = r->h_mask + (size_t)i * words;
        if (fb->sampling[i].allowed)
            memcpy(dst, fb->sampling[i].allowed, (size_t)words * 4);
        else
            memset(dst, 0xff, (size_t)words * 4);
    }
    r->backend->ops->copy_h2d(r->backend, r->d_mask, r->h_mask, (size_t)n * (size_t)words * 4);
    *dev = r->d_mask;
    return ATOMC_OK;
}

// Structured output, sample-then-check (forward_batch.sample_check): the rows whose first draw
// the grammar rejected are drawn again, one row per call, under their mask now filled and with
// the step's second random stream; a's row arrays are offset to the row. The logits must be left
// unchanged by the first draw (model_runner_sample_check_ok: the CPU and CUDA samplers leave them).
static atomc_status runner_redraw_rejected(struct model_runner *r, const struct forward_batch *fb,
                                           const struct sample_args *a, struct error *err) {
    const int32_t *redo = NULL;
    int n_redo = fb->sample_check(fb->sample_check_ctx, r->h_out_ids, &redo);
    if (n_redo == 0) return ATOMC_OK;
    CHECK(model_runner_sample_check_ok(r));
    struct backend *b = r->backend;
    const int V = r->cfg.vocab_size, words = a->bitmask_words;
    atomc_status st = runner_mask_reserve(r, (size_t)n_redo * (size_t)words, err);
    if (st != ATOMC_OK) return st;
    // One upload of the rows' masks (packed, row k at k * words) and of the step numbers, one
    // launch per row without a wait between them, then one copy of the ids back (no synchronising
    // copy per row; on the H200 this did not move the batch-64 figure, which the mask fills
    // dominate: docs/perf.md session 14).
    uint64_t *hstep = HPTR(r, step, uint64_t);
    for (int k = 0; k < n_redo; k++) {
        int i = redo[k];
        CHECK(i >= 0 && i < fb->n_logits && fb->sampling[i].allowed && (k == 0 || i > redo[k - 1]));
        memcpy(r->h_mask + (size_t)k * words, fb->sampling[i].allowed, (size_t)words * 4);
        hstep[i] = SAMPLE_REDRAW_STEP(fb->sampling[i].step);
    }
    b->ops->copy_h2d(b, r->d_mask, r->h_mask, (size_t)n_redo * (size_t)words * 4);
    b->ops->copy_h2d(b, DPTR(r, step, uint64_t) + redo[0], hstep + redo[0],
                     sizeof *hstep * (size_t)(redo[n_redo - 1] - redo[0] + 1));
    for (int k = 0; k < n_redo; k++) {
        int i = redo[k];
        struct tensor row = tensor_2d((float *)a->logits->data + (size_t)i * V, DTYPE_F32, 1, V);
        struct sample_args a1 = *a;
        a1.n_rows = 1;
        a1.logits = &row;
        a1.temperature += i;
        a1.top_p += i;
        a1.top_k += i;
        a1.min_p += i;
        a1.presence_penalty += i;
        a1.frequency_penalty += i;
        a1.repetition_penalty += i;
        a1.seed += i;
        a1.step += i;
        a1.hist_start += i; // row i's history is hist_ids[hist_start[i] .. hist_start[i + 1])
        a1.hist_prompt_len += i;
        a1.token_bitmask = r->d_mask + (size_t)k * words;
        a1.out_ids += i;
        // The engine checks only rows that want no logprobs (engine_grammar.c): none computed.
        a1.n_logprobs = 0;
        a1.out_logprob = NULL;
        a1.out_top_ids = NULL;
        a1.out_top_logprobs = NULL;
        a1.all_greedy = false;
        b->ops->sample(b, &a1);
    }
    // Rows between the first and last redrawn one: the others' ids are the first draw's, on
    // both sides.
    b->ops->copy_d2h(b, r->h_out_ids + redo[0], r->d_out_ids + redo[0],
                     sizeof(int32_t) * (size_t)(redo[n_redo - 1] - redo[0] + 1));
    b->ops->synchronize(b);
    return ATOMC_OK;
}

atomc_status runner_sample(struct model_runner *r, const struct forward_batch *fb, struct runner_output *out,
                                  struct error *err) {
    struct backend *b = r->backend;
    const int n = fb->n_logits;
    if (fb->sample_ready) fb->sample_ready(fb->sample_ready_ctx); // the grammar masks are written
    const int mask_words = (r->cfg.vocab_size + 31) / 32;
    const uint32_t *d_mask = NULL;
    atomc_status mst = runner_upload_masks(r, fb, mask_words, &d_mask, err);
    if (mst != ATOMC_OK) return mst;
    int32_t *hs = HPTR(r, hist_start, int32_t), *hp = HPTR(r, hist_prompt_len, int32_t);
    bool any_penalty = false, all_greedy = true;
    int n_lp = 0;
    size_t hist_total = 0;
    for (int i = 0; i < n; i++) {
        const struct sample_row *sr = &fb->sampling[i];
        if (!(sr->temperature < 1e-5f)) all_greedy = false;
        if (sr->presence_penalty != 0 || sr->frequency_penalty != 0 ||
            (sr->repetition_penalty != 1.0f && sr->repetition_penalty > 0))
            any_penalty = true;
        if (sr->n_logprobs > n_lp) n_lp = sr->n_logprobs;
        hist_total += (size_t)sr->n_prompt + (size_t)sr->n_output;
    }
    if (any_penalty) { // rare: the token histories go up in their own copies
        atomc_status st = runner_hist_reserve(r, hist_total, err);
        if (st != ATOMC_OK) return st;
        size_t o = 0;
        for (int i = 0; i < n; i++) {
            const struct sample_row *sr = &fb->sampling[i];
            hs[i] = (int32_t)o;
            hp[i] = sr->n_prompt;
            if (sr->n_prompt) memcpy(r->h_hist + o, sr->prompt_ids, (size_t)sr->n_prompt * 4);
            o += (size_t)sr->n_prompt;
            if (sr->n_output) memcpy(r->h_hist + o, sr->output_ids, (size_t)sr->n_output * 4);
            o += (size_t)sr->n_output;
        }
        hs[n] = (int32_t)o;
        if (o) b->ops->copy_h2d(b, r->d_hist, r->h_hist, o * 4);
        size_t p0 = r->lay.hist_start, p1 = r->lay.hist_prompt_len + (size_t)n * 4;
        b->ops->copy_h2d(b, r->d_meta + p0, r->h_meta + p0, p1 - p0);
    }

    struct tensor logits = tensor_2d(r->model->scratch.logits, DTYPE_F32, n, r->cfg.vocab_size);
    // min_tokens: ids the engine bans until a sequence has enough output (EOS, stop ids) get
    // -inf logits. Rare (only while min_tokens is pending), so one small copy per banned id.
    static const float neg_inf = -INFINITY;
    for (int i = 0; i < n; i++) {
        const struct sample_row *sr = &fb->sampling[i];
        for (int k = 0; k < sr->n_banned; k++) {
            int32_t id = sr->banned_ids[k];
            if (id < 0 || id >= r->cfg.vocab_size) continue;
            float *dst = (float *)r->model->scratch.logits + (size_t)i * r->cfg.vocab_size + id;
            b->ops->copy_h2d(b, dst, &neg_inf, sizeof neg_inf);
        }
    }
    struct sample_args a = {
        .n_rows = n,
        .vocab_size = r->cfg.vocab_size,
        .logits = &logits,
        .temperature = DPTR(r, temperature, float),
        .top_p = DPTR(r, top_p, float),
        .top_k = DPTR(r, top_k, int32_t),
        .min_p = DPTR(r, min_p, float),
        .presence_penalty = DPTR(r, presence, float),
        .frequency_penalty = DPTR(r, frequency, float),
        .repetition_penalty = DPTR(r, repetition, float),
        .seed = DPTR(r, seed, uint64_t),
        .step = DPTR(r, step, uint64_t),
        .hist_start = DPTR(r, hist_start, int32_t),
        .hist_ids = r->d_hist,
        .hist_prompt_len = DPTR(r, hist_prompt_len, int32_t),
        .any_penalty = any_penalty,
        .n_logprobs = n_lp,
        .all_greedy = all_greedy && !any_penalty && n_lp == 0,
        .token_bitmask = d_mask,
        .bitmask_words = mask_words,
        .out_ids = r->d_out_ids,
        .out_logprob = r->d_out_lp,
        .out_top_ids = n_lp ? r->d_out_top_ids : NULL,
        .out_top_logprobs = n_lp ? r->d_out_top_lp : NULL,
    };
    b->ops->sample(b, &a);
    // Ids and their logprobs in one transfer (the step's synchronisation point).
    b->ops->copy_d2h(b, r->h_out_ids, r->d_out_ids, ((size_t)r->max_rows + (size_t)n) * 4);
    if (n_lp) {
        b->ops->copy_d2h(b, r->h_out_top_ids, r->d_out_top_ids, (size_t)n * n_lp * 4);
        b->ops->copy_d2h(b, r->h_out_top_lp, r->d_out_top_lp, (size_t)n * n_lp * 4);
    }
    b->ops->synchronize(b);
    if (fb->sample_check) {
        atomc_status cst = runner_redraw_rejected(r, fb, &a, err);
        if (cst != ATOMC_OK) return cst;
    }
    out->ids = r->h_out_ids;
    out->logprobs = r->h_out_lp;
    out->top_ids = r->h_out_top_ids;
    out->top_logprobs = r->h_out_top_lp;
    out->top_stride = n_lp;
    return ATOMC_OK;
}
