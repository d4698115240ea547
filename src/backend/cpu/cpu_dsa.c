// DeepSeek Sparse Attention's lightning indexer on the CPU (the reference; backend.h "---- DSA ----").
//
// cpu_dsa_index_write: per new token, RoPE of every indexer query head's first `rope` dims in
// place, and the key LayerNorm(ik) * w + b, roped, written to the layer's indexer key cache
// (kv->v) at its slot.
//
// cpu_dsa_topk: per new token (a work item each), the scores of every key 0..p of its sequence,
// score_j = IH^-1/2 sum_h w_h relu(q_h . k_j / sqrt(D)) in fp32, and the min(topk, p + 1) best positions
// (ties to the lower position), written ascending and padded with -1. A dense sort of the p + 1
// scores: the reference, not the fast path.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_backend.h"
#include "common/check.h"

static void dsa_rope(float *x, int rd, const float *inv_freq, float attn_factor, bool interleaved, int pos) {
    const int half = rd / 2;
    for (int i = 0; i < half; i++) {
        float ang = (float)pos * inv_freq[i];
        float c = cosf(ang) * attn_factor, s = sinf(ang) * attn_factor;
        int i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
        float a = x[i0], b = x[i1];
        x[i0] = a * c - b * s;
        x[i1] = b * c + a * s;
    }
}

void cpu_dsa_index_write(struct backend *b, struct tensor *iq, const struct tensor *ik, const struct tensor *norm_w,
                         const struct tensor *norm_b, const struct rope_args *rope, const struct dsa_args *a,
                         struct kv_layer *kv, const struct attn_metadata *md) {
    struct cpu_backend *c = cpu_backend_of(b);
    const int IH = a->n_heads, D = a->head_dim, R = a->rope;
    CHECK(iq->dtype == DTYPE_F32 && ik->dtype == DTYPE_F32);
    CHECK(tensor_numel(iq) >= (int64_t)md->n_tokens * IH * D && tensor_numel(ik) >= (int64_t)md->n_tokens * D);
    CHECK(R <= D && R % 2 == 0 && tensor_numel(norm_w) == D && tensor_numel(norm_b) == D);
    CHECK(kv->v.ndim == 4 && kv->v.ne[2] == 1 && kv->v.ne[3] == D && kv->v.ne[1] == md->block_size);
    const int64_t slots = kv->v.ne[0] * kv->v.ne[1];
    cpu_lock(c);
    cpu_scratch_reserve(c, (size_t)(3 * D) * sizeof(float) + 64);
    float *w = c->scratch[0], *bias = w + D, *row = bias + D;
    dtype_to_f32(norm_w->dtype, norm_w->data, w, D);
    dtype_to_f32(norm_b->dtype, norm_b->data, bias, D);
    const size_t re = dtype_row_bytes(kv->v.dtype, D);
    for (int t = 0; t < md->n_tokens; t++) {
        const int pos = md->h_positions[t];
        float *qt = (float *)iq->data + (int64_t)t * IH * D;
        for (int h = 0; h < IH; h++)
            dsa_rope(qt + (int64_t)h * D, R, rope->inv_freq, rope->attn_factor, a->rope_interleaved, pos);
        const int32_t slot = md->h_slot_mapping[t];
        if (slot < 0) continue;
        CHECK_MSG(slot < slots, "DSA index write: slot %d outside the cache's %lld", slot, (long long)slots);
        const float *src = (const float *)ik->data + (int64_t)t * D;
        double mean = 0, var = 0;
        for (int i = 0; i < D; i++)
            mean += src[i];
        mean /= D;
        for (int i = 0; i < D; i++)
            var += ((double)src[i] - mean) * ((double)src[i] - mean);
        const float inv = 1.0f / sqrtf((float)(var / D) + a->norm_eps);
        for (int i = 0; i < D; i++)
            row[i] = (float)(src[i] - mean) * inv * w[i] + bias[i];
        dsa_rope(row, R, rope->inv_freq, rope->attn_factor, a->rope_interleaved, pos);
        dtype_from_f32(kv->v.dtype, row, (char *)kv->v.data + (size_t)slot * re, D);
    }
    cpu_unlock(c);
}

struct dsa_ctx {
    int32_t *topk;
    const float *q, *w;
    const struct kv_layer *kv;
    const struct attn_metadata *md;
    const struct dsa_args *a;
    const int32_t *tok_seq; // (n) sequence of each new token
    void **scratch;
};

struct dsa_cand {
    float score;
    int32_t pos;
};

static int dsa_cand_cmp(const void *x, const void *y) {
    const struct dsa_cand *a = x, *b = y;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    return (a->pos > b->pos) - (a->pos < b->pos);
}

static int int32_cmp(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

static void dsa_tokens(void *vctx, int64_t t0, int64_t t1, int tid) {
    struct dsa_ctx *x = vctx;
    const struct dsa_args *a = x->a;
    const struct attn_metadata *md = x->md;
    const int IH = a->n_heads, D = a->head_dim, K = a->topk, bs = md->block_size;
    const float qscale = 1.0f / sqrtf((float)D), wscale = 1.0f / sqrtf((float)IH);
    float *kbuf = x->scratch[tid];
    struct dsa_cand *cand = (struct dsa_cand *)(kbuf + D);
    for (int64_t t = t0; t < t1; t++) {
        const int s = x->tok_seq[t], pos = md->h_positions[t];
        const int32_t *bt = md->h_block_tables + (int64_t)s * attn_md_table_stride(md);
        const float *qt = x->q + t * IH * D, *wt = x->w + t * IH;
        const int n = pos + 1;
        for (int j = 0; j < n; j++) {
            const int64_t phys = bt[j / bs];
            CHECK_MSG(phys >= 0 && phys < x->kv->v.ne[0], "DSA top-k: sequence %d block %d maps to %lld", s, j / bs,
                      (long long)phys);
            const size_t re = dtype_row_bytes(x->kv->v.dtype, D);
            dtype_to_f32(x->kv->v.dtype, (const char *)x->kv->v.data + (size_t)(phys * bs + j % bs) * re, kbuf, D);
            float sc = 0.0f;
            for (int h = 0; h < IH; h++) {
                const float *qh = qt + (int64_t)h * D;
                float dot = 0.0f;
                for (int i = 0; i < D; i++)
                    dot += qh[i] * kbuf[i];
                dot *= qscale;
                if (dot > 0.0f) sc += wt[h] * dot;
            }
            cand[j] = (struct dsa_cand){sc * wscale, j};
        }
        int32_t *out = x->topk + t * K;
        const int m = n < K ? n : K;
        if (n > K) qsort(cand, (size_t)n, sizeof *cand, dsa_cand_cmp);
        for (int i = 0; i < m; i++)
            out[i] = cand[i].pos;
        qsort(out, (size_t)m, sizeof *out, int32_cmp);
        for (int i = m; i < K; i++)
            out[i] = -1;
    }
}

void cpu_dsa_topk(struct backend *b, int32_t *topk, const struct tensor *iq, const struct tensor *w,
                  const struct kv_layer *kv, const struct attn_metadata *md, const struct dsa_args *a) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(iq->dtype == DTYPE_F32 && w->dtype == DTYPE_F32 && a->topk > 0);
    CHECK(kv->v.ndim == 4 && kv->v.ne[3] == a->head_dim && kv->v.ne[1] == md->block_size);
    int max_pos = 0;
    for (int t = 0; t < md->n_tokens; t++)
        if (md->h_positions[t] > max_pos) max_pos = md->h_positions[t];
    cpu_lock(c);
    int32_t *tok_seq = cpu_shared_reserve(c, (size_t)(md->n_tokens > 0 ? md->n_tokens : 1) * sizeof(int32_t));
    for (int s = 0; s < md->n_seqs; s++)
        for (int t = md->h_query_start[s]; t < md->h_query_start[s + 1]; t++)
            tok_seq[t] = s;
    cpu_scratch_reserve(c, (size_t)a->head_dim * sizeof(float) + (size_t)(max_pos + 1) * sizeof(struct dsa_cand) + 64);
    struct dsa_ctx x = {.topk = topk,
                        .q = iq->data,
                        .w = w->data,
                        .kv = kv,
                        .md = md,
                        .a = a,
                        .tok_seq = tok_seq,
                        .scratch = c->scratch};
    if (md->n_tokens > 0) thread_pool_parallel_for(c->pool, md->n_tokens, 1, dsa_tokens, &x);
    cpu_unlock(c);
}
