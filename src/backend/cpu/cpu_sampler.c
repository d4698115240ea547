// The reference sampler. Every backend implements exactly these semantics; the CUDA sampler
// is tested against this one. For one logits row (vocab V, raw model output `raw`):
//
// 1. Logprobs (only when asked): from log_softmax(raw), the RAW model distribution before
//    penalties, temperature and any filtering, as vLLM V1 returns them by default
//    (logprobs_mode = raw_logprobs). lse = max + log(sum exp(raw - max)).
//    out_logprob = raw[chosen] - lse. The top-n alternatives are the n largest raw logits,
//    ordered by (value descending, id ascending), each with raw - lse.
//
// 2. Penalties (vLLM's definitions and order), on a copy w = raw:
//    - repetition penalty rp, over every distinct token of prompt + output so far:
//        w = w > 0 ? w / rp : w * rp
//    - then frequency f and presence pr, over output tokens only (count = occurrences in output):
//        w = w - f * count - pr * (count > 0)
//
// 3. temperature < 1e-5: greedy, chosen = argmax w, ties to the lowest id. Done.
//
// 4. Otherwise w = w / temperature and m = max w; e_i = expf(w_i - m) (so the max has e = 1).
//    The total order used by every filter: i before j iff w_i > w_j, or w_i == w_j and i < j.
//    - min-p (0 < min_p): drop tokens with e_i < min_p (prob < min_p * max prob). Applied first,
//      as in vLLM V1; min-p compares probability ratios, so it commutes with top-k.
//    - top-k (0 < k < V): keep the first k survivors in the total order.
//    - top-p (top_p < 1): over the survivors in the total order, keep the shortest prefix whose
//      mass sum(e) >= top_p * sum over all survivors of e (at least one token). Equivalently a
//      token is kept iff the mass strictly before it is < top_p * total (vLLM's rule).
//    The kept set is always a prefix of the total order, described by its last element c:
//    token i is kept iff (w_i > w_c) or (w_i == w_c and i <= c).
//
// 5. The draw: u = sample_rng_uniform(seed, step) in [0, 1) (backend/sample_rng.h).
//    total = sum of e_i over kept tokens; walking kept tokens in ascending id order and summing
//    e_i, the chosen token is the first whose running sum exceeds u * total (the last kept
//    token if rounding leaves none). Sums are in double here; a GPU summing in float in another
//    order can differ only when u * total falls within rounding of a CDF boundary.
//
// 0. Structured output (sample_args.token_bitmask): before all of the above, every token whose
//    bit is clear gets raw = -inf (in a copy of the row), so logprobs are those of the masked
//    distribution and no filter or draw can pick a masked token (its e is 0; the max is kept).
//
// A row holding a NaN or +inf logit (after the mask; -inf is a legal "never") is a broken
// model's output, not a distribution: out_ids = SAMPLE_ID_NONFINITE, out_logprob NaN, top
// alternatives -1 / NaN, nothing drawn (backend.h).
//
// The logits tensor is left unchanged by this backend (backend.h allows in-place use).
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/sample_rng.h"
#include "common/check.h"

#define SAMPLE_GREEDY_EPS 1e-5f
#define SAMPLE_MAX_LOGPROBS 20
#define SAMPLE_TOPP_TAU 1e-4f // e below which top-p candidates may be pre-filtered (see sample_row)

struct cand {
    float v;
    int32_t id;
};

// The sampler's total order: higher value first, then lower id.
static inline int cand_before(struct cand a, struct cand b) {
    return a.v > b.v || (a.v == b.v && a.id < b.id);
}

static inline void cand_swap(struct cand *a, struct cand *b) {
    struct cand t = *a;
    *a = *b;
    *b = t;
}

// Partitions c[lo, hi) (hi - lo >= 2) around a pivot: returns st with c[lo, st) before the
// pivot, c[st] the pivot and c(st, hi) after it in the total order.
static int64_t cand_partition(struct cand *c, int64_t lo, int64_t hi) {
    int64_t mid = lo + (hi - lo) / 2;
    // Median of three as the pivot, moved to hi - 1.
    if (cand_before(c[hi - 1], c[lo])) cand_swap(&c[hi - 1], &c[lo]);
    if (cand_before(c[mid], c[lo])) cand_swap(&c[mid], &c[lo]);
    if (cand_before(c[hi - 1], c[mid])) cand_swap(&c[hi - 1], &c[mid]);
    cand_swap(&c[mid], &c[hi - 1]);
    struct cand pv = c[hi - 1];
    int64_t st = lo;
    for (int64_t i = lo; i < hi - 1; i++)
        if (cand_before(c[i], pv)) cand_swap(&c[i], &c[st++]);
    cand_swap(&c[st], &c[hi - 1]);
    return st;
}

// Rearranges c[0, n) so that its first k elements are the k first in the total order.
static void cand_select_top(struct cand *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        int64_t st = cand_partition(c, lo, hi);
        if (st == k || st + 1 == k) return;
        if (st > k)
            hi = st;
        else
            lo = st + 1;
    }
}

// Top-p cut over c[0, n) (any order): rearranges c so that c[0, cut) is the shortest prefix of
// the total order whose mass of e[id] = expf(v - m) reaches `target`; returns cut (>= 1).
static int64_t cand_select_top_p(struct cand *c, int64_t n, const float *e, double target) {
    int64_t lo = 0, hi = n;
    double base = 0.0; // mass of c[0, lo), all of them kept; invariant base < target
    while (lo < hi) {
        if (hi - lo == 1) return lo + 1;
        int64_t st = cand_partition(c, lo, hi);
        double upper = 0.0;
        for (int64_t i = lo; i < st; i++)
            upper += e[c[i].id];
        if (base + upper >= target) {
            if (st == lo) return lo + 1; // only by rounding
            hi = st;
        } else {
            double with_pivot = base + upper + e[c[st].id];
            if (with_pivot >= target) return st + 1;
            base = with_pivot;
            lo = st + 1;
        }
    }
    return n; // rounding left the target unreached: keep everything
}

struct sample_ctx {
    const struct sample_args *a;
    void **scratch;
    void **hist;
};

static void sample_logprobs(const struct sample_args *a, int r, const float *raw, int V, int32_t chosen) {
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (raw[i] > mx) mx = raw[i];
    double sum = 0.0;
    for (int i = 0; i < V; i++)
        sum += exp((double)raw[i] - mx);
    float lse = (float)(mx + log(sum));
    if (a->out_logprob) a->out_logprob[r] = raw[chosen] - lse;
    int n = a->n_logprobs;
    if (n <= 0) return;
    if (n > V) n = V;
    // Insertion into a sorted list of the best n (n <= 20).
    struct cand best[SAMPLE_MAX_LOGPROBS];
    int have = 0;
    for (int i = 0; i < V; i++) {
        struct cand x = {raw[i], i};
        if (have == n && !cand_before(x, best[n - 1])) continue;
        int j = have < n ? have++ : n - 1;
        while (j > 0 && cand_before(x, best[j - 1])) {
            best[j] = best[j - 1];
            j--;
        }
        best[j] = x;
    }
    for (int j = 0; j < a->n_logprobs; j++) {
        a->out_top_ids[(int64_t)r * a->n_logprobs + j] = j < n ? best[j].id : -1;
        a->out_top_logprobs[(int64_t)r * a->n_logprobs + j] = j < n ? best[j].v - lse : -INFINITY;
    }
}

static void sample_penalties(const struct sample_args *a, int r, float *w, int V, int32_t *cnt, uint8_t *seen) {
    float rp = a->repetition_penalty ? a->repetition_penalty[r] : 1.0f;
    float fp = a->frequency_penalty ? a->frequency_penalty[r] : 0.0f;
    float pp = a->presence_penalty ? a->presence_penalty[r] : 0.0f;
    if (rp == 1.0f && fp == 0.0f && pp == 0.0f) return;
    int32_t h0 = a->hist_start[r], h1 = a->hist_start[r + 1];
    int32_t out0 = h0 + a->hist_prompt_len[r];
    CHECK(out0 >= h0 && out0 <= h1);
    for (int32_t i = h0; i < h1; i++) {
        int32_t id = a->hist_ids[i];
        CHECK_MSG(id >= 0 && id < V, "sample: history token %d outside the vocabulary (%d)", id, V);
        seen[id] = 1;
        if (i >= out0) cnt[id]++;
    }
    // Each distinct token once; clearing seen / cnt as we go leaves the scratch zeroed.
    for (int32_t i = h0; i < h1; i++) {
        int32_t id = a->hist_ids[i];
        if (!seen[id]) continue;
        float v = w[id];
        v = v > 0.0f ? v / rp : v * rp;
        v = v - fp * (float)cnt[id] - pp * (cnt[id] > 0 ? 1.0f : 0.0f);
        w[id] = v;
        seen[id] = 0;
        cnt[id] = 0;
    }
}

static int32_t sample_row(const struct sample_args *a, int r, const float *raw, float *w, float *e, struct cand *cands,
                          int32_t *cnt, uint8_t *seen) {
    const int V = a->vocab_size;
    memcpy(w, raw, (size_t)V * sizeof(float));
    if (a->any_penalty) sample_penalties(a, r, w, V, cnt, seen);

    float temp = a->temperature ? a->temperature[r] : 0.0f;
    if (!(temp >= SAMPLE_GREEDY_EPS)) { // also NaN -> greedy
        int32_t best = 0;
        for (int i = 1; i < V; i++)
            if (w[i] > w[best]) best = i;
        return best;
    }
    float inv_t = 1.0f / temp;
    float m = -INFINITY;
    for (int i = 0; i < V; i++) {
        w[i] *= inv_t;
        if (w[i] > m) m = w[i];
    }
    for (int i = 0; i < V; i++)
        e[i] = expf(w[i] - m); // unnormalised probabilities, max 1
    float min_p = a->min_p ? a->min_p[r] : 0.0f;
    int k = a->top_k ? a->top_k[r] : 0;
    float top_p = a->top_p ? a->top_p[r] : 1.0f;
    bool use_k = k > 0 && k < V, use_p = top_p<1.0f, use_min_p = min_p> 0.0f;

    // The kept set as a prefix of the total order, described by its last element `boundary`;
    // without top-k / top-p, by the min-p threshold alone.
    bool have_boundary = false;
    struct cand boundary = {0, 0};
    if (use_k || use_p) {
        // Top-p without top-k: tokens with e below SAMPLE_TOPP_TAU may be left out of the
        // selection when their total mass is below (1 - top_p) of all survivors' mass, because
        // the kept prefix (mass >= top_p) then ends before reaching any of them. Exact; usually
        // leaves a few hundred candidates instead of the whole vocabulary.
        double total_all = -1.0;
        float tau = 0.0f;
        if (use_p && !use_k && top_p > 0.0f) {
            double below = 0.0;
            total_all = 0.0;
            for (int i = 0; i < V; i++)
                if (!use_min_p || e[i] >= min_p) {
                    total_all += e[i];
                    if (e[i] < SAMPLE_TOPP_TAU) below += e[i];
                }
            if (below < (1.0 - (double)top_p) * total_all) tau = SAMPLE_TOPP_TAU;
        }
        int64_t n = 0;
        for (int i = 0; i < V; i++)
            if ((!use_min_p || e[i] >= min_p) && e[i] >= tau) cands[n++] = (struct cand){w[i], i};
        if (n == 0) { // only when min_p > 1: keep the max (lowest id among equals)
            for (int i = 0; i < V && n == 0; i++)
                if (w[i] == m) cands[n++] = (struct cand){w[i], i};
        }
        if (use_k && k < n) {
            cand_select_top(cands, n, k);
            n = k;
        }
        if (use_p) {
            if (top_p > 0.0f) {
                double total = total_all;
                if (total < 0.0) { // after top-k: the mass of the k kept
                    total = 0.0;
                    for (int64_t i = 0; i < n; i++)
                        total += e[cands[i].id];
                }
                n = cand_select_top_p(cands, n, e, (double)top_p * total);
            } else {
                cand_select_top(cands, n, 1);
                n = 1;
            }
        }
        boundary = cands[0];
        for (int64_t i = 1; i < n; i++)
            if (cand_before(boundary, cands[i])) boundary = cands[i];
        have_boundary = true;
    }

#define SAMPLE_KEPT(i)                                                                                                 \
    (have_boundary ? (w[i] > boundary.v || (w[i] == boundary.v && (i) <= boundary.id)) : (!use_min_p || e[i] >= min_p))
    double total = 0.0;
    int32_t last = -1;
    for (int i = 0; i < V; i++)
        if (SAMPLE_KEPT(i)) {
            total += e[i];
            last = i;
        }
    if (last < 0) { // min_p > 1 without top-k / top-p: keep the max (lowest id among equals)
        for (int i = 0; i < V; i++)
            if (w[i] == m) return i;
        return 0;
    }
    double target = sample_rng_uniform(a->seed ? a->seed[r] : 0, a->step ? a->step[r] : 0) * total;
    double acc = 0.0;
    for (int i = 0; i <= last; i++) {
        if (!SAMPLE_KEPT(i)) continue;
        acc += e[i];
        if (acc > target) return i;
    }
    return last;
#undef SAMPLE_KEPT
}

// Step 0 + 3..5 over the allowed ids alone, for a masked row without top-k / top-p / min-p and
// without top alternatives whose mask allows at most half the vocabulary (a grammar's usual
// mask): the same token and logprob as the dense path over the masked row, because a masked
// token's e is exactly 0 and adding 0 leaves a double sum unchanged (the total, the walk's
// running sums and the max are the dense row's), and it is never chosen (the walk stops at the
// first running sum above u * total < total, which a zero term cannot raise). Returns false to
// leave the row to the dense path: the filters are on, the mask allows no token or more than
// half of them, or every allowed logit is -inf (the dense path's degenerate cases).
static bool sample_row_sparse(const struct sample_args *a, int64_t r, const float *raw, const uint32_t *bits, float *w,
                              struct cand *c, int32_t *cnt, uint8_t *seen, int32_t *out_id) {
    const int V = a->vocab_size;
    float temp = a->temperature ? a->temperature[r] : 0.0f;
    bool greedy = !(temp >= SAMPLE_GREEDY_EPS);
    if (a->n_logprobs > 0) return false;
    if (!greedy) {
        float min_p = a->min_p ? a->min_p[r] : 0.0f, top_p = a->top_p ? a->top_p[r] : 1.0f;
        int k = a->top_k ? a->top_k[r] : 0;
        if ((k > 0 && k < V) || top_p < 1.0f || min_p > 0.0f) return false;
    }
    int64_t n = 0;
    const int words = (V + 31) / 32;
    for (int wi = 0; wi < words; wi++) {
        uint32_t m = bits[wi];
        while (m) {
            int id = wi * 32 + __builtin_ctz(m);
            m &= m - 1;
            if (id >= V) break;
            if (n >= V / 2) return false;
            c[n++].id = id;
        }
    }
    if (n == 0) return false;
    const float *src = raw;
    if (a->any_penalty) { // on a dense copy: the pass indexes by token id
        memcpy(w, raw, (size_t)V * sizeof(float));
        sample_penalties(a, (int)r, w, V, cnt, seen);
        src = w;
    }
    bool bad = false;
    for (int64_t i = 0; i < n; i++) {
        float v = raw[c[i].id];
        bad |= isnan(v) || v == INFINITY;
    }
    if (bad) {
        *out_id = SAMPLE_ID_NONFINITE;
        return true;
    }
    int32_t chosen;
    if (greedy) {
        int64_t best = 0;
        for (int64_t i = 0; i < n; i++) {
            c[i].v = src[c[i].id];
            if (c[i].v > c[best].v) best = i;
        }
        if (c[best].v == -INFINITY) return false;
        chosen = c[best].id;
    } else {
        float inv_t = 1.0f / temp, m = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            c[i].v = src[c[i].id] * inv_t;
            if (c[i].v > m) m = c[i].v;
        }
        if (m == -INFINITY) return false;
        double total = 0.0;
        for (int64_t i = 0; i < n; i++) {
            c[i].v = expf(c[i].v - m); // from here on: e
            total += c[i].v;
        }
        double target = sample_rng_uniform(a->seed ? a->seed[r] : 0, a->step ? a->step[r] : 0) * total;
        double acc = 0.0;
        chosen = c[n - 1].id;
        for (int64_t i = 0; i < n; i++) {
            acc += c[i].v;
            if (acc > target) {
                chosen = c[i].id;
                break;
            }
        }
    }
    if (a->out_logprob) { // sample_logprobs over the allowed ids (the masked ones add exp(-inf) = 0)
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++)
            if (raw[c[i].id] > mx) mx = raw[c[i].id];
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++)
            sum += exp((double)raw[c[i].id] - mx);
        a->out_logprob[r] = raw[chosen] - (float)(mx + log(sum));
    }
    *out_id = chosen;
    return true;
}

static bool row_nonfinite(const float *raw, int V) {
    bool bad = false;
    for (int i = 0; i < V; i++)
        bad |= isnan(raw[i]) || raw[i] == INFINITY;
    return bad;
}

static void sample_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct sample_ctx *s = vctx;
    const struct sample_args *a = s->a;
    const int V = a->vocab_size;
    uint8_t *base = s->scratch[tid];
    float *w = (float *)base;
    float *e = w + V;
    struct cand *cands = (struct cand *)(base + (size_t)V * 2 * sizeof(float));
    int32_t *cnt = (int32_t *)s->hist[tid];
    uint8_t *seen = (uint8_t *)(cnt + V);
    float *masked = (float *)(base + (size_t)V * (2 * sizeof(float) + sizeof(struct cand)));
    for (int64_t r = r0; r < r1; r++) {
        const float *raw = (const float *)a->logits->data + r * V;
        if (a->token_bitmask) {
            const uint32_t *bits = a->token_bitmask + r * a->bitmask_words;
            int32_t sid;
            if (sample_row_sparse(a, r, raw, bits, w, cands, cnt, seen, &sid)) {
                a->out_ids[r] = sid;
                if (sid == SAMPLE_ID_NONFINITE && a->out_logprob) a->out_logprob[r] = NAN;
                continue;
            }
            for (int i = 0; i < V; i++)
                masked[i] = (bits[i >> 5] >> (i & 31)) & 1u ? raw[i] : -INFINITY;
            raw = masked;
        }
        if (row_nonfinite(raw, V)) {
            a->out_ids[r] = SAMPLE_ID_NONFINITE;
            if (a->out_logprob) a->out_logprob[r] = NAN;
            for (int j = 0; j < a->n_logprobs; j++) {
                a->out_top_ids[r * a->n_logprobs + j] = -1;
                a->out_top_logprobs[r * a->n_logprobs + j] = NAN;
            }
            continue;
        }
        int32_t id = sample_row(a, (int)r, raw, w, e, cands, cnt, seen);
        a->out_ids[r] = id;
        if (a->out_logprob || a->n_logprobs > 0) sample_logprobs(a, (int)r, raw, V, id);
    }
}

void cpu_sample(struct backend *b, const struct sample_args *a) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(a->logits && a->logits->dtype == DTYPE_F32 && a->vocab_size > 0);
    CHECK(tensor_cols(a->logits) == a->vocab_size && tensor_rows(a->logits) >= a->n_rows);
    CHECK(a->n_logprobs >= 0 && a->n_logprobs <= SAMPLE_MAX_LOGPROBS);
    CHECK(a->n_logprobs == 0 || (a->out_top_ids && a->out_top_logprobs));
    CHECK(!a->any_penalty || (a->hist_start && a->hist_ids && a->hist_prompt_len));
    if (a->n_rows <= 0) return;
    cpu_lock(c);
    size_t V = (size_t)a->vocab_size;
    CHECK(!a->token_bitmask || a->bitmask_words * 32 >= a->vocab_size);
    cpu_scratch_reserve(c, V * (3 * sizeof(float) + sizeof(struct cand)) + 64);
    if (a->any_penalty) cpu_sample_hist_reserve(c, V);
    struct sample_ctx s = {a, c->scratch, c->sample_hist};
    thread_pool_parallel_for(c->pool, a->n_rows, 1, sample_rows, &s);
    cpu_unlock(c);
}
