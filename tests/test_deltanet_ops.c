// The CPU Gated DeltaNet ops (src/backend/cpu/cpu_deltanet.c) against a naive double-precision
// loop: the causal conv1d with its conv state and the gated delta rule with its recurrent state,
// over batches of sequences with odd lengths (1, 5, 63, 64, 65, 150: inside one chunk of 64,
// exactly one, across chunks), grouped key heads and odd head dims. The same sequence computed
// one-shot, in prefill chunks of several sizes (the state carried in its slot between calls) and
// token by token (the recurrent step) gives the same outputs and final state; a step that does
// not start the sequence continues the slot's state; a fresh one ignores what the slot holds.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "test.h"

#define HK 2
#define HV 4
#define DK 12
#define DV 7
#define KS 4
#define CONV_DIM (2 * HK * DK + HV * DV)
#define NSLOTS 6
#define MAXT 400

static struct backend *B;

static struct backend *cpu(void) {
    if (!B) {
        struct backend_options o = {.num_threads = 2};
        struct error err = {0};
        if (backend_cpu_create(&o, &B, &err) != ATOMC_OK) return NULL;
    }
    return B;
}

static uint64_t rng = 88172645463325252ull;
static double urand(void) { // [-1, 1)
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

// Per-token inputs of one long "sequence universe": qkv (after conv), ba, conv inputs.
static float X[MAXT][CONV_DIM]; // conv inputs / rule qkv inputs
static float BA[MAXT][2 * HV];
static float WCONV[CONV_DIM][KS];
static float ALOG[HV], DTB[HV];

static void fill_inputs(void) {
    for (int t = 0; t < MAXT; t++) {
        for (int c = 0; c < CONV_DIM; c++)
            X[t][c] = (float)urand();
        for (int h = 0; h < 2 * HV; h++)
            BA[t][h] = (float)(2.0 * urand());
    }
    for (int c = 0; c < CONV_DIM; c++)
        for (int j = 0; j < KS; j++)
            WCONV[c][j] = (float)(0.6 * urand());
    for (int h = 0; h < HV; h++) {
        ALOG[h] = (float)(0.8 * urand());
        DTB[h] = (float)(0.5 * urand());
    }
}

// Double-precision reference of the delta rule over tokens x[0..n) of one sequence starting from
// state S0 (HV, DK, DV) (NULL = zeros): out (n, HV, DV), final state into S.
static void ref_rule(const float (*x)[CONV_DIM], const float (*ba)[2 * HV], int n, const float *S0, double *out,
                     double *S) {
    const int r = HV / HK;
    for (int i = 0; i < HV * DK * DV; i++)
        S[i] = S0 ? S0[i] : 0.0;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < HV; h++) {
            int kh = h / r;
            double q[DK], k[DK], v[DV], qs = 0, ks = 0;
            for (int i = 0; i < DK; i++) {
                q[i] = x[t][kh * DK + i];
                k[i] = x[t][(HK + kh) * DK + i];
                qs += q[i] * q[i];
                ks += k[i] * k[i];
            }
            for (int i = 0; i < DK; i++) {
                q[i] /= sqrt(qs + 1e-6) * sqrt((double)DK);
                k[i] /= sqrt(ks + 1e-6);
            }
            for (int j = 0; j < DV; j++)
                v[j] = x[t][2 * HK * DK + h * DV + j];
            double beta = 1.0 / (1.0 + exp(-(double)ba[t][h]));
            double a = ba[t][HV + h] + DTB[h];
            double sp = a > 20 ? a : log1p(exp(a));
            double g = -exp((double)ALOG[h]) * sp, decay = exp(g);
            double *Sh = S + (size_t)h * DK * DV;
            for (int i = 0; i < DK * DV; i++)
                Sh[i] *= decay;
            for (int j = 0; j < DV; j++) {
                double mem = 0;
                for (int i = 0; i < DK; i++)
                    mem += Sh[i * DV + j] * k[i];
                double delta = beta * (v[j] - mem);
                for (int i = 0; i < DK; i++)
                    Sh[i * DV + j] += k[i] * delta;
            }
            for (int j = 0; j < DV; j++) {
                double o = 0;
                for (int i = 0; i < DK; i++)
                    o += Sh[i * DV + j] * q[i];
                out[((size_t)t * HV + h) * DV + j] = o;
            }
        }
}

// One call of an op over a batch: sequence s has new tokens tok[s][0..len[s]) (indices into X),
// ctx[s] tokens in its cache after the step, slot[s].
struct batch {
    int n;
    int len[8], ctx[8], slot[8], start[8];
};

struct state {
    float *conv; // (NSLOTS, CONV_DIM, KS - 1)
    float *rec;  // (NSLOTS, HV, DK, DV)
};

static void run_ops(const struct batch *bt, struct state *st, float *conv_out, float *rule_out, bool do_conv) {
    struct backend *b = cpu();
    int32_t qs[9], ctx[8], slots[8];
    int T = 0;
    qs[0] = 0;
    static float xin[MAXT * 2][CONV_DIM], bain[MAXT * 2][2 * HV];
    for (int s = 0; s < bt->n; s++) {
        for (int i = 0; i < bt->len[s]; i++, T++) {
            memcpy(xin[T], X[bt->start[s] + i], sizeof xin[T]);
            memcpy(bain[T], BA[bt->start[s] + i], sizeof bain[T]);
        }
        qs[s + 1] = T;
        ctx[s] = bt->ctx[s];
        slots[s] = bt->slot[s];
    }
    struct attn_metadata md = {.n_seqs = bt->n,
                               .n_tokens = T,
                               .query_start = qs,
                               .context_lens = ctx,
                               .h_query_start = qs,
                               .h_context_lens = ctx,
                               .state_slots = slots,
                               .h_state_slots = slots};
    struct kv_layer kv = {0};
    kv.k = tensor_make(st->conv, DTYPE_F32, 3, (int64_t[]){NSLOTS, CONV_DIM, KS - 1});
    kv.v = tensor_make(st->rec, DTYPE_F32, 4, (int64_t[]){NSLOTS, HV, DK, DV});
    struct tensor w = tensor_2d(WCONV, DTYPE_F32, CONV_DIM, KS);
    struct tensor alog = tensor_2d(ALOG, DTYPE_F32, 1, HV), dtb = tensor_2d(DTB, DTYPE_F32, 1, HV);
    struct deltanet_args a = {.n_k_heads = HK, .n_v_heads = HV, .k_dim = DK, .v_dim = DV};
    struct tensor xt = tensor_2d(xin, DTYPE_F32, T, CONV_DIM), bat = tensor_2d(bain, DTYPE_F32, T, 2 * HV);
    if (do_conv) {
        struct tensor co = tensor_2d(conv_out, DTYPE_F32, T, CONV_DIM);
        b->ops->deltanet_conv(b, &co, &xt, CONV_DIM, &w, &kv, &md);
    } else {
        struct tensor ro = tensor_2d(rule_out, DTYPE_F32, T, HV * DV);
        b->ops->deltanet_rule(b, &ro, &xt, &bat, 2 * HV, &alog, &dtb, &kv, &md, &a);
    }
}

static double max_err(const float *a, const double *ref, size_t n, double *scale) {
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - ref[i]);
        if (!(d <= e)) e = d; // NaN propagates
        if (fabs(ref[i]) > s) s = fabs(ref[i]);
    }
    *scale = s;
    return e;
}

static void state_new(struct state *st) {
    st->conv = calloc((size_t)NSLOTS * CONV_DIM * (KS - 1), sizeof(float));
    st->rec = calloc((size_t)NSLOTS * HV * DK * DV, sizeof(float));
    // Garbage in every slot: fresh sequences must not read it.
    for (size_t i = 0; i < (size_t)NSLOTS * CONV_DIM * (KS - 1); i++)
        st->conv[i] = 7.0f;
    for (size_t i = 0; i < (size_t)NSLOTS * HV * DK * DV; i++)
        st->rec[i] = -5.0f;
}

static void state_free(struct state *st) {
    free(st->conv);
    free(st->rec);
}

static const int LENS[] = {1, 5, 63, 64, 65, 150};
#define NLENS 6

TEST(deltanet_rule_one_shot_matches_double_loop) {
    if (!cpu()) SKIP("no CPU backend");
    fill_inputs();
    struct state st;
    state_new(&st);
    struct batch bt = {.n = NLENS};
    int start = 0;
    for (int s = 0; s < NLENS; s++) {
        bt.len[s] = bt.ctx[s] = LENS[s];
        bt.slot[s] = NSLOTS - 1 - s;
        bt.start[s] = start;
        start += LENS[s];
    }
    static float out[MAXT * HV * DV];
    run_ops(&bt, &st, NULL, out, false);
    static double ref[MAXT * HV * DV], S[HV * DK * DV];
    size_t off = 0;
    double worst = 0, worst_s = 0;
    for (int s = 0; s < NLENS; s++) {
        ref_rule((const float(*)[CONV_DIM])X[bt.start[s]], (const float(*)[2 * HV]) BA[bt.start[s]], LENS[s], NULL, ref,
                 S);
        double scale, e = max_err(out + off, ref, (size_t)LENS[s] * HV * DV, &scale);
        ASSERT_TRUE(e <= 2e-5 * (1 + scale));
        double se = max_err(st.rec + (size_t)bt.slot[s] * HV * DK * DV, S, HV * DK * DV, &scale);
        ASSERT_TRUE(se <= 2e-5 * (1 + scale));
        if (e > worst) worst = e;
        if (se > worst_s) worst_s = se;
        off += (size_t)LENS[s] * HV * DV;
    }
    printf("  rule one-shot vs double: max |out err| %.2e, max |state err| %.2e\n", worst, worst_s);
    state_free(&st);
}

// The 150-token sequence in pieces (chunked prefill sizes), token by token, and after a random
// initial state: the same as one-shot.
TEST(deltanet_rule_chunked_equals_recurrent_equals_one_shot) {
    if (!cpu()) SKIP("no CPU backend");
    fill_inputs();
    const int n = 150;
    static double ref[MAXT * HV * DV], S[HV * DK * DV];
    ref_rule((const float(*)[CONV_DIM])X[0], (const float(*)[2 * HV]) BA[0], n, NULL, ref, S);
    static const int pieces[][8] = {{150}, {37, 1, 64, 48}, {64, 64, 22}, {1, 1, 1, 100, 47}, {65, 85}, {7, 143}};
    for (size_t p = 0; p < sizeof pieces / sizeof pieces[0]; p++) {
        struct state st;
        state_new(&st);
        static float out[MAXT * HV * DV];
        int done = 0;
        for (int i = 0; i < 8 && pieces[p][i]; i++) {
            struct batch bt = {
                .n = 1, .len = {pieces[p][i]}, .ctx = {done + pieces[p][i]}, .slot = {2}, .start = {done}};
            run_ops(&bt, &st, NULL, out + (size_t)done * HV * DV, false);
            done += pieces[p][i];
        }
        ASSERT_EQ(done, n);
        double scale, e = max_err(out, ref, (size_t)n * HV * DV, &scale);
        ASSERT_TRUE(e <= 2e-5 * (1 + scale));
        double se = max_err(st.rec + 2 * HV * DK * DV, S, HV * DK * DV, &scale);
        ASSERT_TRUE(se <= 2e-5 * (1 + scale));
        state_free(&st);
    }
    // Token by token (the recurrent step every time).
    struct state st;
    state_new(&st);
    static float out[MAXT * HV * DV];
    for (int t = 0; t < n; t++) {
        struct batch bt = {.n = 1, .len = {1}, .ctx = {t + 1}, .slot = {0}, .start = {t}};
        run_ops(&bt, &st, NULL, out + (size_t)t * HV * DV, false);
    }
    double scale, e = max_err(out, ref, (size_t)n * HV * DV, &scale);
    ASSERT_TRUE(e <= 2e-5 * (1 + scale));
    printf("  rule token-by-token vs double: max |out err| %.2e (scale %.2f)\n", e, scale);
    // Continuing a given state: slot 0 holds the state after 150 tokens; 65 more tokens from there
    // (context 215) against the reference over all 215.
    static double ref2[MAXT * HV * DV], S2[HV * DK * DV];
    ref_rule((const float(*)[CONV_DIM])X[0], (const float(*)[2 * HV]) BA[0], n + 65, NULL, ref2, S2);
    struct batch bt = {.n = 1, .len = {65}, .ctx = {n + 65}, .slot = {0}, .start = {n}};
    run_ops(&bt, &st, NULL, out, false);
    e = max_err(out, ref2 + (size_t)n * HV * DV, (size_t)65 * HV * DV, &scale);
    ASSERT_TRUE(e <= 2e-5 * (1 + scale));
    state_free(&st);
}

// Conv1d: one-shot, in pieces and token by token against the direct formula.
TEST(deltanet_conv_matches_reference_in_pieces) {
    if (!cpu()) SKIP("no CPU backend");
    fill_inputs();
    const int n = 150;
    static double ref[MAXT * CONV_DIM];
    for (int t = 0; t < n; t++)
        for (int c = 0; c < CONV_DIM; c++) {
            double acc = 0;
            for (int j = 0; j < KS; j++) {
                int tt = t - (KS - 1) + j;
                if (tt >= 0) acc += (double)WCONV[c][j] * X[tt][c];
            }
            ref[(size_t)t * CONV_DIM + c] = acc / (1.0 + exp(-acc));
        }
    static const int pieces[][8] = {{150}, {1, 2, 3, 144}, {64, 1, 85}, {149, 1}};
    for (size_t p = 0; p < sizeof pieces / sizeof pieces[0]; p++) {
        struct state st;
        state_new(&st);
        static float out[MAXT * CONV_DIM];
        int done = 0;
        for (int i = 0; i < 8 && pieces[p][i]; i++) {
            // Batched with an unrelated fresh sequence in another slot (mixed batch).
            struct batch bt = {.n = 2,
                               .len = {3, pieces[p][i]},
                               .ctx = {3, done + pieces[p][i]},
                               .slot = {4, 1},
                               .start = {300, done}};
            static float tmp[MAXT * 2 * CONV_DIM];
            run_ops(&bt, &st, tmp, NULL, true);
            memcpy(out + (size_t)done * CONV_DIM, tmp + 3 * CONV_DIM, (size_t)pieces[p][i] * CONV_DIM * sizeof(float));
            done += pieces[p][i];
        }
        double scale, e = max_err(out, ref, (size_t)n * CONV_DIM, &scale);
        ASSERT_TRUE(e <= 1e-5 * (1 + scale));
        // The conv state holds the last K - 1 inputs.
        for (int c = 0; c < CONV_DIM; c++)
            for (int j = 0; j < KS - 1; j++)
                ASSERT_TRUE(st.conv[((size_t)1 * CONV_DIM + c) * (KS - 1) + j] == X[n - (KS - 1) + j][c]);
        state_free(&st);
    }
}

TEST(gated_rmsnorm_and_sigmoid_gate) {
    if (!cpu()) SKIP("no CPU backend");
    struct backend *b = cpu();
    enum { T = 3, H = 4, D = 7, ZS = 40 };
    float x[T * H * D], z[T * ZS], w[D], out[T * H * D], g[T * ZS];
    for (int i = 0; i < T * H * D; i++)
        x[i] = (float)urand();
    for (int i = 0; i < T * ZS; i++)
        z[i] = (float)(2 * urand()), g[i] = (float)(3 * urand());
    for (int i = 0; i < D; i++)
        w[i] = (float)(1 + 0.3 * urand());
    struct tensor xt = tensor_2d(x, DTYPE_F32, T * H, D), zt = tensor_2d(z + 5, DTYPE_F32, T * H, D);
    struct tensor ot = tensor_2d(out, DTYPE_F32, T * H, D), wt = tensor_2d(w, DTYPE_F32, 1, D);
    b->ops->rmsnorm_gated(b, &ot, &xt, &zt, ZS, H, &wt, 1e-6f);
    for (int r = 0; r < T * H; r++) {
        double ss = 0;
        for (int i = 0; i < D; i++)
            ss += (double)x[r * D + i] * x[r * D + i];
        for (int i = 0; i < D; i++) {
            double zz = z[5 + (r / H) * ZS + (r % H) * D + i];
            double want = x[r * D + i] / sqrt(ss / D + 1e-6) * w[i] * zz / (1 + exp(-zz));
            ASSERT_NEAR(out[r * D + i], want, 1e-5);
        }
    }
    // Per-element gate with a row stride, then a per-row (broadcast) gate.
    float y[T * H * D];
    memcpy(y, x, sizeof y);
    struct tensor yt = tensor_2d(y, DTYPE_F32, T, H * D), gt = tensor_2d(g, DTYPE_F32, T, H * D);
    b->ops->gate_sigmoid_mul(b, &yt, &gt, ZS, H * D);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H * D; i++)
            ASSERT_NEAR(y[t * H * D + i], x[t * H * D + i] / (1 + exp(-(double)g[t * ZS + i])), 1e-6);
    memcpy(y, x, sizeof y);
    b->ops->gate_sigmoid_mul(b, &yt, &gt, ZS, 1);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H * D; i++)
            ASSERT_NEAR(y[t * H * D + i], x[t * H * D + i] / (1 + exp(-(double)g[t * ZS])), 1e-6);
}

int main(int argc, char **argv) {
    int rc = test_main(argc, argv);
    if (B) backend_destroy(B);
    return rc;
}
