// Sampled speculative decoding keeps the output distribution: a statistical test on a tiny
// vocabulary, with the real CPU sampler (backend sample op) behind a TEST-ONLY model whose logits
// are a fixed function of the context it reads back through the paged "KV" (so a wrong rollback
// or slot shows). Verification (spec.h) draws each position with the plain sampler's own (seed,
// step) draw, which makes it the standard accept / resample rule for deterministic drafts.
//
// The test. Requests: a fixed prompt, 4 sampled output tokens (temperature 0.9, top-k 3, min-p
// 0.05, repetition penalty 1.3, presence penalty 0.4: the penalties see the drafts before each
// verified position), N = 100000 seeds, ngram k = 3 with lookup 1..2 (about half the drafts are
// accepted). The exact distribution of the 4-token continuation (V^4 = 256 outcomes) is
// enumerated here from the model's logits and the sampler's written semantics, in double, with
// no engine code. Pearson's chi-square goodness of fit over the outcomes (cells of expected count
// < 5 pooled) must stay below the alpha = 1e-4 critical value, with speculation and without it.
// A stronger property is checked too: every seed gives the same tokens with and without drafts.
//
// Power. Against the exact distribution of the same model at temperature 0.95 instead of 0.9 (a
// shift a broken accept rule easily exceeds) the noncentrality is lambda = N * sum (p1 - p0)^2 / p0;
// the test prints lambda and the (normal-approximation) power, and asserts that the observed
// speculative sample is rejected as a draw from that alternative (measured: lambda 513, power
// ~1; the statistic against it 508 vs a critical 136). A verifier that accepts every draft (tried
// by hand) gives 9525 against the exact distribution.
#include <math.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "core/tensor.h"
#include "engine_fake.h"
#include "test.h"

#define V 4
#define N_OUT 4
#define N_REQ 100000
#define TEMP 0.9f
#define TOP_K 3
#define MIN_P 0.05f
#define REP 1.3f
#define PRES 0.4f

static const int32_t PROMPT[] = {1, 2, 3, 1, 2};
#define N_PROMPT 5

// The model: logits after a context (its last three tokens matter): a preference for repeating
// the token three back (period-3 text, so prompt lookup hits), plus distinct per-pair values.
static void model_logits(const int32_t *ctx, int n, double *out) {
    int32_t a = ctx[n - 1], b = n >= 3 ? ctx[n - 3] : 0;
    for (int v = 0; v < V; v++)
        out[v] = 0.37 * v - 0.29 * ((a * 3 + v * 5) % 4) + (v == b ? 1.6 : 0.0) + 0.011 * a;
}

struct lmodel {
    int num_blocks, bs;
    int32_t *kv_tok, *kv_pos;
    struct backend *be;
    float *logits;
    int32_t *ids, *top_ids, *hs, *hpl, *hist, *topk;
    float *lps, *top_lps, *temp, *topp, *minp, *pres, *freq, *rep;
    uint64_t *seed, *step;
    int cap, hcap;
    int violations;
};

static atomc_status lmodel_execute(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                                   struct error *err) {
    (void)err;
    struct lmodel *m = ctx;
    for (int i = 0; i < fb->n_tokens; i++) {
        m->kv_tok[fb->slot_mapping[i]] = fb->token_ids[i];
        m->kv_pos[fb->slot_mapping[i]] = fb->positions[i];
    }
    int n = fb->n_logits;
    if (n > m->cap) {
        m->cap = n * 2;
        size_t c = (size_t)m->cap;
        m->logits = xrealloc(m->logits, c * V * 4);
        m->ids = xrealloc(m->ids, c * 4);
        m->lps = xrealloc(m->lps, c * 4);
        m->topk = xrealloc(m->topk, c * 4);
        m->temp = xrealloc(m->temp, c * 4);
        m->topp = xrealloc(m->topp, c * 4);
        m->minp = xrealloc(m->minp, c * 4);
        m->pres = xrealloc(m->pres, c * 4);
        m->freq = xrealloc(m->freq, c * 4);
        m->rep = xrealloc(m->rep, c * 4);
        m->hpl = xrealloc(m->hpl, c * 4);
        m->hs = xrealloc(m->hs, (c + 1) * 4);
        m->seed = xrealloc(m->seed, c * 8);
        m->step = xrealloc(m->step, c * 8);
    }
    int total = 0;
    for (int r = 0; r < n; r++)
        total += fb->sampling[r].n_prompt + fb->sampling[r].n_output;
    if (total > m->hcap) {
        m->hcap = total * 2;
        m->hist = xrealloc(m->hist, (size_t)m->hcap * 4);
    }
    m->hs[0] = 0;
    for (int r = 0; r < n; r++) {
        int row = fb->logits_rows[r], s = 0;
        while (!(fb->query_start[s] <= row && row < fb->query_start[s + 1]))
            s++;
        int upto = fb->positions[row] + 1;
        const int32_t *table = fb->block_tables + (size_t)s * fb->max_blocks_per_seq;
        int32_t c[64];
        CHECK(upto <= 64);
        for (int p = 0; p < upto; p++) {
            int32_t slot = table[p / m->bs] * m->bs + p % m->bs;
            if (m->kv_pos[slot] != p) m->violations++;
            c[p] = m->kv_tok[slot];
        }
        double lg[V];
        model_logits(c, upto, lg);
        for (int v = 0; v < V; v++)
            m->logits[r * V + v] = (float)lg[v];
        const struct sample_row *sr = &fb->sampling[r];
        m->temp[r] = sr->temperature;
        m->topp[r] = sr->top_p;
        m->minp[r] = sr->min_p;
        m->topk[r] = sr->top_k;
        m->pres[r] = sr->presence_penalty;
        m->freq[r] = sr->frequency_penalty;
        m->rep[r] = sr->repetition_penalty;
        m->seed[r] = sr->seed;
        m->step[r] = sr->step;
        m->hpl[r] = sr->n_prompt;
        memcpy(m->hist + m->hs[r], sr->prompt_ids, (size_t)sr->n_prompt * 4);
        memcpy(m->hist + m->hs[r] + sr->n_prompt, sr->output_ids, (size_t)sr->n_output * 4);
        m->hs[r + 1] = m->hs[r] + sr->n_prompt + sr->n_output;
    }
    struct tensor lt = tensor_2d(m->logits, DTYPE_F32, n, V);
    struct sample_args a = {.n_rows = n,
                            .vocab_size = V,
                            .logits = &lt,
                            .temperature = m->temp,
                            .top_p = m->topp,
                            .top_k = m->topk,
                            .min_p = m->minp,
                            .presence_penalty = m->pres,
                            .frequency_penalty = m->freq,
                            .repetition_penalty = m->rep,
                            .seed = m->seed,
                            .step = m->step,
                            .hist_start = m->hs,
                            .hist_ids = m->hist,
                            .hist_prompt_len = m->hpl,
                            .any_penalty = true,
                            .out_ids = m->ids,
                            .out_logprob = m->lps};
    m->be->ops->sample(m->be, &a);
    memset(out, 0, sizeof *out);
    out->ids = m->ids;
    out->logprobs = m->lps;
    return ATOMC_OK;
}

static void lmodel_free(void *ctx) {
    struct lmodel *m = ctx;
    free(m->kv_tok);
    free(m->kv_pos);
    free(m->logits);
    free(m->ids);
    free(m->lps);
    free(m->topk);
    free(m->temp);
    free(m->topp);
    free(m->minp);
    free(m->pres);
    free(m->freq);
    free(m->rep);
    free(m->hpl);
    free(m->hs);
    free(m->hist);
    free(m->seed);
    free(m->step);
    free(m);
}

static atomc_engine *lengine(struct backend *be, int k, struct lmodel **out_m) {
    struct lmodel *m = xcalloc(1, sizeof *m);
    m->num_blocks = 256;
    m->bs = 4;
    m->be = be;
    m->kv_tok = xcalloc((size_t)m->num_blocks * m->bs, 4);
    m->kv_pos = xmalloc((size_t)m->num_blocks * m->bs * 4);
    for (int i = 0; i < m->num_blocks * m->bs; i++)
        m->kv_pos[i] = -1;
    struct engine_setup su;
    memset(&su, 0, sizeof su);
    su.model.ctx = m;
    su.model.execute = lmodel_execute;
    su.model.free = lmodel_free;
    su.num_kv_blocks = m->num_blocks;
    su.vocab_size = V;
    su.max_model_len = 64;
    su.eos_ids[0] = 0;
    su.n_eos = 1;
    su.info.architecture = "FakeForTests";
    su.info.model_name = "fake";
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.block_size = 4;
    o.max_num_seqs = 16;
    o.max_num_batched_tokens = 128;
    if (k) {
        o.speculative_method = "ngram";
        o.num_speculative_tokens = k;
        o.prompt_lookup_min = 1;
        o.prompt_lookup_max = 2;
        o.speculative_disable_by_batch_size = -1;
    }
    atomc_engine *e;
    struct error err = {0};
    CHECK_MSG(engine_create_with(&o, &su, &e, &err) == ATOMC_OK, "%s", err.msg);
    *out_m = m;
    return e;
}

struct sres {
    int32_t toks[N_OUT];
    int n;
};
static void s_on_out(void *user, const atomc_output *o) {
    struct sres *r = user;
    for (int i = 0; i < o->n_new_tokens; i++)
        if (r->n < N_OUT) r->toks[r->n++] = o->new_tokens[i];
}

// Runs N_REQ seeded requests (seed = index + 1) and stores each 4-token continuation's code.
static void run_all(struct backend *be, int k, int *codes, atomc_stats *st) {
    struct lmodel *m;
    atomc_engine *e = lengine(be, k, &m);
    static struct sres res[N_REQ];
    memset(res, 0, sizeof res);
    for (int i = 0; i < N_REQ; i++) {
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = PROMPT;
        r.n_prompt_ids = N_PROMPT;
        r.params.temperature = TEMP;
        r.params.top_k = TOP_K;
        r.params.min_p = MIN_P;
        r.params.repetition_penalty = REP;
        r.params.presence_penalty = PRES;
        r.params.has_seed = true;
        r.params.seed = (uint64_t)i + 1;
        r.params.max_tokens = N_OUT;
        r.params.ignore_eos = true;
        r.on_output = s_on_out;
        r.user = &res[i];
        CHECK(atomc_engine_add_request(e, &r, NULL, NULL, 0) == ATOMC_OK);
        if (i % 64 == 63)
            while (atomc_engine_has_work(e))
                atomc_engine_step(e);
    }
    while (atomc_engine_has_work(e))
        atomc_engine_step(e);
    atomc_engine_get_stats(e, st);
    CHECK(m->violations == 0);
    CHECK(st->num_free_kv_blocks == st->num_kv_blocks);
    atomc_engine_free(e);
    for (int i = 0; i < N_REQ; i++) {
        CHECK(res[i].n == N_OUT);
        int c = 0;
        for (int t = 0; t < N_OUT; t++)
            c = c * V + res[i].toks[t];
        codes[i] = c;
    }
}

// The sampler's processed distribution (cpu_sampler.c's top comment), in double.
static void processed(const int32_t *ctx, int n, double temp, double *p) {
    double w[V];
    model_logits(ctx, n, w);
    bool seen[V] = {0}, out_seen[V] = {0};
    for (int i = 0; i < n; i++) {
        seen[ctx[i]] = true;
        if (i >= N_PROMPT) out_seen[ctx[i]] = true;
    }
    for (int v = 0; v < V; v++) {
        if (seen[v]) w[v] = w[v] > 0 ? w[v] / REP : w[v] * REP;
        if (out_seen[v]) w[v] -= PRES;
        w[v] /= temp;
    }
    double mx = w[0];
    for (int v = 1; v < V; v++)
        mx = w[v] > mx ? w[v] : mx;
    double e[V];
    bool keep[V];
    for (int v = 0; v < V; v++) {
        e[v] = exp(w[v] - mx);
        keep[v] = e[v] >= MIN_P;
    }
    // top-k: the TOP_K largest survivors (values are distinct here).
    for (int v = 0; v < V; v++) {
        if (!keep[v]) continue;
        int better = 0;
        for (int u = 0; u < V; u++)
            better += keep[u] && (w[u] > w[v] || (w[u] == w[v] && u < v));
        if (better >= TOP_K) keep[v] = false;
    }
    double z = 0;
    for (int v = 0; v < V; v++)
        z += keep[v] ? e[v] : 0;
    for (int v = 0; v < V; v++)
        p[v] = keep[v] ? e[v] / z : 0;
}

// Exact probability of every 4-token continuation (code = base-V digits, first token first).
static void exact(double temp, double *prob) {
    int32_t ctx[N_PROMPT + N_OUT];
    memcpy(ctx, PROMPT, sizeof PROMPT);
    int total = 1;
    for (int t = 0; t < N_OUT; t++)
        total *= V;
    for (int c = 0; c < total; c++) {
        double pr = 1;
        int rest = c, div = total / V;
        for (int t = 0; t < N_OUT; t++, div /= V) {
            int v = rest / div;
            rest %= div;
            double p[V];
            processed(ctx, N_PROMPT + t, temp, p);
            pr *= p[v];
            ctx[N_PROMPT + t] = v;
        }
        prob[c] = pr;
    }
}

// Pearson's statistic of the observed codes against prob, cells with expected < 5 pooled;
// *df receives the degrees of freedom. Also returns the noncentrality of alt vs prob in *lambda
// (when alt is given), over the same cells.
static double chi_square(const int *codes, const double *prob, const double *alt, int *df, double *lambda) {
    enum { CELLS = V * V * V * V };
    static double obs[CELLS];
    memset(obs, 0, sizeof obs);
    for (int i = 0; i < N_REQ; i++)
        obs[codes[i]]++;
    double chi = 0, pool_o = 0, pool_e = 0, pool_a = 0, lam = 0;
    int cells = 0;
    for (int c = 0; c < CELLS; c++) {
        double ex = prob[c] * N_REQ;
        if (ex < 5) {
            pool_o += obs[c];
            pool_e += ex;
            if (alt) pool_a += alt[c] * N_REQ;
            continue;
        }
        chi += (obs[c] - ex) * (obs[c] - ex) / ex;
        if (alt) lam += (alt[c] * N_REQ - ex) * (alt[c] * N_REQ - ex) / ex;
        cells++;
    }
    if (pool_e > 0) {
        chi += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        if (alt) lam += (pool_a - pool_e) * (pool_a - pool_e) / pool_e;
        cells++;
    }
    *df = cells - 1;
    if (lambda) *lambda = lam;
    return chi;
}

// Upper alpha = 1e-4 point of chi-square(df) (Wilson-Hilferty; z = 3.719).
static double chi_crit(int df) {
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + 3.719 * sqrt(a), 3);
}

TEST(spec_sampled_distribution_equals_plain) {
    struct backend *be;
    struct backend_options bo = {.num_threads = 1};
    struct error err;
    ASSERT_EQ(backend_cpu_create(&bo, &be, &err), ATOMC_OK);
    static int spec_codes[N_REQ], plain_codes[N_REQ];
    atomc_stats ss, ps;
    run_all(be, 3, spec_codes, &ss);
    run_all(be, 0, plain_codes, &ps);
    static double p0[V * V * V * V], p1[V * V * V * V];
    exact(TEMP, p0);
    exact(0.95, p1);
    double sum = 0;
    for (int c = 0; c < V * V * V * V; c++)
        sum += p0[c];
    ASSERT_NEAR(sum, 1.0, 1e-9);
    int df, df_alt;
    double lambda;
    double chi_spec = chi_square(spec_codes, p0, p1, &df, &lambda);
    double chi_plain = chi_square(plain_codes, p0, NULL, &df, NULL);
    double chi_alt = chi_square(spec_codes, p1, NULL, &df_alt, NULL);
    double crit = chi_crit(df), crit_alt = chi_crit(df_alt);
    // Power of the alpha = 1e-4 test against the alternative (noncentral chi-square by the normal
    // approximation: mean df + lambda, variance 2 (df + 2 lambda)).
    double power = 0.5 * erfc(-((df + lambda) - crit) / sqrt(2.0 * (df + 2 * lambda)) / sqrt(2.0));
    int same = 0;
    for (int i = 0; i < N_REQ; i++)
        same += spec_codes[i] == plain_codes[i];
    fprintf(stderr,
            "  %d requests x %d tokens, V=%d: ngram k=3 %llu drafts, %llu of %llu draft tokens accepted (%.1f%%), "
            "%llu steps vs %llu plain\n"
            "  chi-square vs exact (df %d, critical %.1f at 1e-4): speculative %.1f, plain %.1f\n"
            "  alternative T=0.95: lambda %.0f, power %.4f; speculative sample vs it: %.1f (critical %.1f)\n"
            "  %d of %d seeds give identical tokens with and without drafts\n",
            N_REQ, N_OUT, V, (unsigned long long)ss.spec_num_drafts, (unsigned long long)ss.spec_num_accepted_tokens,
            (unsigned long long)ss.spec_num_draft_tokens,
            100.0 * ss.spec_num_accepted_tokens / (ss.spec_num_draft_tokens ? ss.spec_num_draft_tokens : 1),
            (unsigned long long)ss.num_steps, (unsigned long long)ps.num_steps, df, crit, chi_spec, chi_plain, lambda,
            power, chi_alt, crit_alt, same, N_REQ);
    ASSERT_TRUE(ss.spec_num_accepted_tokens > N_REQ / 2);
    ASSERT_TRUE(ss.spec_num_accepted_tokens < ss.spec_num_draft_tokens);
    ASSERT_TRUE(chi_plain < crit); // the harness itself: plain sampling fits the enumeration
    ASSERT_TRUE(chi_spec < crit);
    ASSERT_TRUE(power > 0.99);
    ASSERT_TRUE(chi_alt > crit_alt);
    ASSERT_EQ(same, N_REQ);
    backend_destroy(be);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
