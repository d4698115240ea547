// Gated DeltaNet ops of the CPU backend (the reference; backend.h "Gated DeltaNet"): the causal
// depthwise conv1d with its per-sequence conv state, the gated delta rule (chunked form for a
// sequence's multi-token step, recurrent step for a single token) with its per-sequence state,
// the gated RMSNorm and the sigmoid gate. Activations F32 (the CPU act dtype), weights any dtype
// the backend takes, states F32 in the slots that md->h_state_slots names.
//
// The chunked form (chunks of CHUNK tokens of a sequence's step, the last one shorter): with
// cum_i the running sum of the decays g inside the chunk, A[i][j] = beta_i (k_i . k_j)
// exp(cum_i - cum_j) for j < i, the UT transform solves (I + A) U = beta v and
// (I + A) W = beta exp(cum) k by forward substitution; then per chunk, with S the state before it,
//   v'_i  = U_i - W_i S
//   out_i = exp(cum_i) q_i S + sum_{j <= i} (q_i . k_j) exp(cum_i - cum_j) v'_j
//   S     = exp(cum_last) S + sum_i exp(cum_last - cum_i) k_i v'_i^T
// which equals running the recurrent step over the chunk's tokens (tests/test_cpu_deltanet.c
// checks both against a double-precision loop).
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_backend.h"
#include "common/check.h"

#define CHUNK 64
#define DN_MAX_KERNEL 64

static inline float silu_f(float x) {
    return x / (1.0f + expf(-x));
}
static inline float sigmoid_f(float x) {
    return 1.0f / (1.0f + expf(-x));
}
static inline float softplus_f(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
} // torch's threshold 20

// A small weight (conv kernel, per-head parameters) as F32 in op scratch.
static const float *weight_f32(struct cpu_backend *c, const struct tensor *w, size_t offset_floats, float *shared) {
    int64_t n = tensor_numel(w);
    if (w->dtype == DTYPE_F32) return w->data;
    dtype_to_f32(w->dtype, w->data, shared + offset_floats, n);
    return shared + offset_floats;
}

static bool seq_is_fresh(const struct attn_metadata *md, int s) {
    return md->h_context_lens[s] == md->h_query_start[s + 1] - md->h_query_start[s];
}

// ---------------------------------------------------------------------------------------------
// Causal depthwise conv1d + conv state

struct conv_ctx {
    const struct attn_metadata *md;
    const float *x;
    int64_t xs;
    float *out;
    const float *w; // (C, K)
    int64_t C;
    int K;
    float *state; // (slots, C, K - 1)
    int64_t n_slots;
};

static void conv_channels(void *p, int64_t c0, int64_t c1, int tid) {
    const struct conv_ctx *k = p;
    const struct attn_metadata *md = k->md;
    const int K = k->K, P = K - 1;
    float win[DN_MAX_KERNEL];
    for (int s = 0; s < md->n_seqs; s++) {
        int t0 = md->h_query_start[s], t1 = md->h_query_start[s + 1];
        if (t1 <= t0) continue;
        int slot = md->h_state_slots[s];
        CHECK_MSG(slot >= 0 && slot < k->n_slots, "deltanet_conv: state slot %d outside [0, %lld)", slot,
                  (long long)k->n_slots);
        bool fresh = seq_is_fresh(md, s);
        for (int64_t c = c0; c < c1; c++) {
            float *st = k->state + ((size_t)slot * (size_t)k->C + (size_t)c) * (size_t)P;
            for (int j = 0; j < P; j++)
                win[j] = fresh ? 0.0f : st[j];
            const float *w = k->w + c * K;
            for (int t = t0; t < t1; t++) {
                float xv = k->x[(size_t)t * (size_t)k->xs + (size_t)c];
                float acc = w[P] * xv;
                for (int j = 0; j < P; j++)
                    acc += w[j] * win[j];
                k->out[(size_t)t * (size_t)k->C + (size_t)c] = silu_f(acc);
                if (P > 0) {
                    memmove(win, win + 1, (size_t)(P - 1) * sizeof(float));
                    win[P - 1] = xv;
                }
            }
            memcpy(st, win, (size_t)P * sizeof(float));
        }
    }
}

void cpu_deltanet_conv(struct backend *b, struct tensor *out, const struct tensor *x, int64_t x_row_stride,
                       const struct tensor *w, struct kv_layer *kv, const struct attn_metadata *md) {
    struct cpu_backend *c = cpu_backend_of(b);
    const int64_t C = tensor_cols(out), K = tensor_cols(w);
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && kv->k.dtype == DTYPE_F32);
    CHECK(tensor_rows(w) == C && K >= 1 && K <= DN_MAX_KERNEL && md->h_state_slots);
    CHECK(kv->k.ndim == 3 && kv->k.ne[1] == C && kv->k.ne[2] == K - 1);
    CHECK(tensor_rows(out) >= md->n_tokens);
    cpu_lock(c);
    float *shared = cpu_shared_reserve(c, (size_t)(C * K) * sizeof(float));
    struct conv_ctx k = {
        md,         x->data,    x_row_stride ? x_row_stride : C, out->data, weight_f32(c, w, 0, shared), C, (int)K,
        kv->k.data, kv->k.ne[0]};
    if ((int64_t)md->n_tokens * C < 4096)
        conv_channels(&k, 0, C, 0);
    else
        thread_pool_parallel_for(c->pool, C, 16, conv_channels, &k);
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule

struct rule_ctx {
    const struct attn_metadata *md;
    const struct deltanet_args *a;
    const float *qkv; // (n, conv_dim)
    const float *ba;
    int64_t bas;
    const float *a_log, *dt_bias;
    float *out;   // (n, Hv, Dv)
    float *state; // (slots, Hv, Dk, Dv)
    int64_t n_slots;
    void **scratch; // per thread
};

static void l2norm_into(float *dst, const float *src, int n, float scale) {
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)src[i] * src[i];
    float inv = scale / sqrtf((float)ss + 1e-6f);
    for (int i = 0; i < n; i++)
        dst[i] = src[i] * inv;
}

// Token t's q (scaled), k, v, g and beta for value head h.
static void rule_load(const struct rule_ctx *k, int t, int h, float *q, float *kk, float *v, float *g, float *beta) {
    const struct deltanet_args *a = k->a;
    const int Dk = a->k_dim, Dv = a->v_dim, Hk = a->n_k_heads, Hv = a->n_v_heads, kh = h / (Hv / Hk);
    const int64_t conv_dim = 2 * (int64_t)Hk * Dk + (int64_t)Hv * Dv;
    const float *row = k->qkv + (size_t)t * (size_t)conv_dim;
    l2norm_into(q, row + (size_t)kh * Dk, Dk, 1.0f / sqrtf((float)Dk));
    l2norm_into(kk, row + (size_t)(Hk + kh) * Dk, Dk, 1.0f);
    memcpy(v, row + 2 * (size_t)Hk * Dk + (size_t)h * Dv, (size_t)Dv * sizeof(float));
    const float *bar = k->ba + (size_t)t * (size_t)k->bas;
    *beta = sigmoid_f(bar[h]);
    *g = -expf(k->a_log[h]) * softplus_f(bar[Hv + h] + k->dt_bias[h]);
}

static void rule_heads(void *p, int64_t i0, int64_t i1, int tid) {
    const struct rule_ctx *k = p;
    const struct attn_metadata *md = k->md;
    const int Dk = k->a->k_dim, Dv = k->a->v_dim, Hv = k->a->n_v_heads;
    float *S = k->scratch[tid];
    float *q = S + (size_t)Dk * Dv, *kk = q + (size_t)CHUNK * Dk, *v = kk + (size_t)CHUNK * Dk;
    float *U = v + (size_t)CHUNK * Dv, *W = U + (size_t)CHUNK * Dv, *A = W + (size_t)CHUNK * Dk;
    float g[CHUNK], beta[CHUNK], cum[CHUNK];
    for (int64_t it = i0; it < i1; it++) {
        int s = (int)(it / Hv), h = (int)(it % Hv);
        int t0 = md->h_query_start[s], t1 = md->h_query_start[s + 1];
        if (t1 <= t0) continue;
        int slot = md->h_state_slots[s];
        CHECK_MSG(slot >= 0 && slot < k->n_slots, "deltanet_rule: state slot %d outside [0, %lld)", slot,
                  (long long)k->n_slots);
        float *st = k->state + ((size_t)slot * Hv + (size_t)h) * (size_t)Dk * Dv;
        if (seq_is_fresh(md, s))
            memset(S, 0, (size_t)Dk * Dv * sizeof(float));
        else
            memcpy(S, st, (size_t)Dk * Dv * sizeof(float));
        if (t1 - t0 == 1) { // recurrent step
            float gg, bb;
            rule_load(k, t0, h, q, kk, v, &gg, &bb);
            float decay = expf(gg);
            for (int i = 0; i < Dk * Dv; i++)
                S[i] *= decay;
            for (int j = 0; j < Dv; j++) {
                float mem = 0;
                for (int i = 0; i < Dk; i++)
                    mem += S[(size_t)i * Dv + j] * kk[i];
                U[j] = bb * (v[j] - mem);
            }
            float *o = k->out + ((size_t)t0 * Hv + (size_t)h) * Dv;
            for (int j = 0; j < Dv; j++)
                o[j] = 0;
            for (int i = 0; i < Dk; i++) {
                float *Si = S + (size_t)i * Dv;
                for (int j = 0; j < Dv; j++) {
                    Si[j] += kk[i] * U[j];
                    o[j] += Si[j] * q[i];
                }
            }
        } else {
            for (int c0 = t0; c0 < t1; c0 += CHUNK) {
                int L = t1 - c0 < CHUNK ? t1 - c0 : CHUNK;
                for (int i = 0; i < L; i++)
                    rule_load(k, c0 + i, h, q + (size_t)i * Dk, kk + (size_t)i * Dk, v + (size_t)i * Dv, &g[i],
                              &beta[i]);
                for (int i = 0; i < L; i++)
                    cum[i] = g[i] + (i ? cum[i - 1] : 0.0f);
                for (int i = 0; i < L; i++) {
                    const float *ki = kk + (size_t)i * Dk;
                    for (int j = 0; j < i; j++) {
                        const float *kj = kk + (size_t)j * Dk;
                        float d = 0;
                        for (int e = 0; e < Dk; e++)
                            d += ki[e] * kj[e];
                        A[(size_t)i * CHUNK + j] = beta[i] * d * expf(cum[i] - cum[j]);
                    }
                }
                // Forward substitution: (I + A) U = beta v, (I + A) W = beta exp(cum) k.
                for (int i = 0; i < L; i++) {
                    float *Ui = U + (size_t)i * Dv, *Wi = W + (size_t)i * Dk;
                    float eb = beta[i] * expf(cum[i]);
                    for (int j = 0; j < Dv; j++)
                        Ui[j] = beta[i] * v[(size_t)i * Dv + j];
                    for (int e = 0; e < Dk; e++)
                        Wi[e] = eb * kk[(size_t)i * Dk + e];
                    for (int j = 0; j < i; j++) {
                        float aij = A[(size_t)i * CHUNK + j];
                        const float *Uj = U + (size_t)j * Dv, *Wj = W + (size_t)j * Dk;
                        for (int e = 0; e < Dv; e++)
                            Ui[e] -= aij * Uj[e];
                        for (int e = 0; e < Dk; e++)
                            Wi[e] -= aij * Wj[e];
                    }
                }
                // v' = U - W S (into U).
                for (int i = 0; i < L; i++) {
                    float *Ui = U + (size_t)i * Dv;
                    const float *Wi = W + (size_t)i * Dk;
                    for (int d = 0; d < Dk; d++) {
                        float w = Wi[d];
                        const float *Sd = S + (size_t)d * Dv;
                        for (int j = 0; j < Dv; j++)
                            Ui[j] -= w * Sd[j];
                    }
                }
                // Outputs.
                for (int i = 0; i < L; i++) {
                    float *o = k->out + ((size_t)(c0 + i) * Hv + (size_t)h) * Dv;
                    const float *qi = q + (size_t)i * Dk;
                    float ec = expf(cum[i]);
                    for (int j = 0; j < Dv; j++)
                        o[j] = 0;
                    for (int d = 0; d < Dk; d++) {
                        float w = qi[d] * ec;
                        const float *Sd = S + (size_t)d * Dv;
                        for (int j = 0; j < Dv; j++)
                            o[j] += w * Sd[j];
                    }
                    for (int j = 0; j <= i; j++) {
                        const float *kj = kk + (size_t)j * Dk;
                        float d = 0;
                        for (int e = 0; e < Dk; e++)
                            d += qi[e] * kj[e];
                        d *= expf(cum[i] - cum[j]);
                        const float *Uj = U + (size_t)j * Dv;
                        for (int e = 0; e < Dv; e++)
                            o[e] += d * Uj[e];
                    }
                }
                // State after the chunk.
                float el = expf(cum[L - 1]);
                for (int e = 0; e < Dk * Dv; e++)
                    S[e] *= el;
                for (int i = 0; i < L; i++) {
                    float w = expf(cum[L - 1] - cum[i]);
                    const float *ki = kk + (size_t)i * Dk, *Ui = U + (size_t)i * Dv;
                    for (int d = 0; d < Dk; d++) {
                        float kd = w * ki[d];
                        float *Sd = S + (size_t)d * Dv;
                        for (int j = 0; j < Dv; j++)
                            Sd[j] += kd * Ui[j];
                    }
                }
            }
        }
        memcpy(st, S, (size_t)Dk * Dv * sizeof(float));
    }
}

void cpu_deltanet_rule(struct backend *b, struct tensor *out, const struct tensor *qkv, const struct tensor *ba,
                       int64_t ba_row_stride, const struct tensor *a_log, const struct tensor *dt_bias,
                       struct kv_layer *kv, const struct attn_metadata *md, const struct deltanet_args *a) {
    struct cpu_backend *c = cpu_backend_of(b);
    const int Hk = a->n_k_heads, Hv = a->n_v_heads, Dk = a->k_dim, Dv = a->v_dim;
    CHECK(Hk > 0 && Hv % Hk == 0 && Dk > 0 && Dv > 0 && md->h_state_slots);
    CHECK(out->dtype == DTYPE_F32 && qkv->dtype == DTYPE_F32 && ba->dtype == DTYPE_F32);
    CHECK(tensor_cols(qkv) == 2 * (int64_t)Hk * Dk + (int64_t)Hv * Dv && tensor_numel(a_log) == Hv &&
          tensor_numel(dt_bias) == Hv);
    CHECK(tensor_numel(out) >= (int64_t)md->n_tokens * Hv * Dv);
    const struct tensor *rs = &kv->v;
    CHECK(rs->dtype == DTYPE_F32 && rs->ndim == 4 && rs->ne[1] == Hv && rs->ne[2] == Dk && rs->ne[3] == Dv);
    cpu_lock(c);
    cpu_scratch_reserve(c, ((size_t)Dk * Dv + 3 * (size_t)CHUNK * Dk + 2 * (size_t)CHUNK * Dv + (size_t)CHUNK * CHUNK) *
                               sizeof(float));
    float *shared = cpu_shared_reserve(c, 2 * (size_t)Hv * sizeof(float));
    struct rule_ctx k = {md,
                         a,
                         qkv->data,
                         ba->data,
                         ba_row_stride ? ba_row_stride : 2 * (int64_t)Hv,
                         weight_f32(c, a_log, 0, shared),
                         weight_f32(c, dt_bias, (size_t)Hv, shared),
                         out->data,
                         rs->data,
                         rs->ne[0],
                         c->scratch};
    int64_t n = (int64_t)md->n_seqs * Hv;
    thread_pool_parallel_for(c->pool, n, 1, rule_heads, &k);
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// Gated RMSNorm and the sigmoid gate

struct gnorm_ctx {
    float *out;
    const float *x, *z, *w;
    int64_t d, zs;
    int zh;
    float eps;
};

static void gnorm_rows(void *p, int64_t r0, int64_t r1, int tid) {
    const struct gnorm_ctx *k = p;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = k->x + r * k->d, *z = k->z + (r / k->zh) * k->zs + (r % k->zh) * k->d;
        float *o = k->out + r * k->d;
        double ss = 0;
        for (int64_t i = 0; i < k->d; i++)
            ss += (double)x[i] * x[i];
        float inv = 1.0f / sqrtf((float)(ss / (double)k->d) + k->eps);
        for (int64_t i = 0; i < k->d; i++)
            o[i] = x[i] * inv * k->w[i] * silu_f(z[i]);
    }
}

void cpu_rmsnorm_gated(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *z,
                       int64_t z_row_stride, int z_heads, const struct tensor *w, float eps) {
    struct cpu_backend *c = cpu_backend_of(b);
    const int64_t d = tensor_cols(x);
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && z->dtype == DTYPE_F32 && z_heads > 0);
    CHECK(tensor_numel(w) == d && tensor_numel(out) == tensor_numel(x));
    cpu_lock(c);
    float *shared = cpu_shared_reserve(c, (size_t)d * sizeof(float));
    struct gnorm_ctx k = {
        out->data, x->data, z->data, weight_f32(c, w, 0, shared), d, z_row_stride ? z_row_stride : d * z_heads,
        z_heads,   eps};
    int64_t rows = tensor_rows(x);
    if (rows * d < 16384)
        gnorm_rows(&k, 0, rows, 0);
    else
        thread_pool_parallel_for(c->pool, rows, 8, gnorm_rows, &k);
    cpu_unlock(c);
}

void cpu_gate_sigmoid_mul(struct backend *b, struct tensor *x, const struct tensor *gate, int64_t gate_row_stride,
                          int gate_cols) {
    struct cpu_backend *c = cpu_backend_of(b);
    const int64_t d = tensor_cols(x), rows = tensor_rows(x);
    CHECK(x->dtype == DTYPE_F32 && gate->dtype == DTYPE_F32 && (gate_cols == 1 || gate_cols == d));
    const int64_t gs = gate_row_stride ? gate_row_stride : gate_cols;
    cpu_lock(c);
    float *xv = x->data;
    const float *g = gate->data;
    for (int64_t r = 0; r < rows; r++) {
        float *xr = xv + r * d;
        const float *gr = g + r * gs;
        if (gate_cols == 1) {
            float s = sigmoid_f(gr[0]);
            for (int64_t i = 0; i < d; i++)
                xr[i] *= s;
        } else {
            for (int64_t i = 0; i < d; i++)
                xr[i] *= sigmoid_f(gr[i]);
        }
    }
    cpu_unlock(c);
}
