// Multi-head latent attention on the CPU (the reference; backend.h "---- MLA ----").
//
// cpu_mla_latent_write: per new token, RoPE of every head's q_pe in place, and the latent cache
// row [rmsnorm(c) * w, rope(k_pe)] at its slot.
//
// cpu_mla_attention runs the absorbed form for every batch (prefill chunks and decode alike):
// work items are (query head h, chunk of up to MLA_QCHUNK queries of one sequence). An item widens
// W_UK_h (nope x kv_lora) once, turns each query into qa = [scale * W_UK_h^T q_nope, scale * q_pe]
// (kv_lora + rope), attends over the sequence's latent rows as one shared KV head (scores
// qa . row, online softmax in fp32, o_lat = sum_j p_j c_j), and writes out[t, h] = W_UV_h o_lat
// through the weight-dtype gemv kernel. Query i of a sequence sits at position
// context_len - q_len + i and sees keys 0..itself; with DSA (mla_args.topk) only the keys of its
// top-k list, the others scoring -inf. The expanded form (k_nope / v per head) is the
// same sum regrouped; tests/test_mla_ops.c checks this op against a naive expanded double loop.
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_backend.h"
#include "common/check.h"

#define MLA_QCHUNK 16

static int mla_weight_kind(enum dtype d) {
    switch (d) {
    case DTYPE_F32:
        return CPU_WEIGHT_F32;
    case DTYPE_BF16:
        return CPU_WEIGHT_BF16;
    case DTYPE_F16:
        return CPU_WEIGHT_F16;
    default:
        CHECK_MSG(0, "MLA: weight dtype %s not supported on the CPU", dtype_name(d));
    }
    return 0;
}

// One (rope) pair rotation of x (rope dims) at position pos, in place.
static void mla_rope(float *x, int rd, const float *inv_freq, float attn_factor, bool interleaved, int pos) {
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

void cpu_mla_latent_write(struct backend *b, struct tensor *q, const struct tensor *kv_a, const struct tensor *kv_norm,
                          float eps, const struct rope_args *rope, const struct mla_args *a, struct kv_layer *kv,
                          const struct attn_metadata *md) {
    struct cpu_backend *c = cpu_backend_of(b);
    const int H = a->n_heads, L = a->kv_lora, R = a->rope, DQ = a->nope + a->rope;
    CHECK(q->dtype == DTYPE_F32 && kv_a->dtype == DTYPE_F32);
    CHECK(tensor_numel(q) >= (int64_t)md->n_tokens * H * DQ && tensor_cols(kv_a) == L + R);
    CHECK(rope->rotary_dim == R && tensor_numel(kv_norm) == L);
    CHECK(kv->k.ndim == 4 && kv->k.ne[2] == 1 && kv->k.ne[3] == L + R && kv->k.ne[1] == md->block_size);
    const int64_t slots = kv->k.ne[0] * kv->k.ne[1];
    cpu_lock(c);
    cpu_scratch_reserve(c, (size_t)(2 * (L + R)) * sizeof(float) + 64);
    float *w = c->scratch[0], *row = w + L + R;
    c->kern.widen[mla_weight_kind(kv_norm->dtype)](w, kv_norm->data, L);
    const size_t re = dtype_row_bytes(kv->k.dtype, L + R);
    for (int t = 0; t < md->n_tokens; t++) {
        const int pos = md->h_positions[t];
        float *qt = (float *)q->data + (int64_t)t * H * DQ;
        for (int h = 0; h < H; h++)
            mla_rope(qt + (int64_t)h * DQ + a->nope, R, rope->inv_freq, rope->attn_factor, rope->interleaved, pos);
        const int32_t slot = md->h_slot_mapping[t];
        if (slot < 0) continue;
        CHECK_MSG(slot < slots, "MLA latent write: slot %d outside the cache's %lld", slot, (long long)slots);
        const float *src = (const float *)kv_a->data + (int64_t)t * (L + R);
        double ss = 0;
        for (int i = 0; i < L; i++)
            ss += (double)src[i] * src[i];
        float inv = 1.0f / sqrtf((float)(ss / L) + eps);
        for (int i = 0; i < L; i++)
            row[i] = src[i] * inv * w[i];
        memcpy(row + L, src + L, (size_t)R * sizeof(float));
        mla_rope(row + L, R, rope->inv_freq, rope->attn_factor, rope->interleaved, pos);
        if (kv->k.dtype == DTYPE_FP8_E4M3 && kv->k_scale != 1.0f)
            for (int i = 0; i < L + R; i++)
                row[i] /= kv->k_scale;
        dtype_from_f32(kv->k.dtype, row, (char *)kv->k.data + (size_t)slot * re, L + R);
    }
    cpu_unlock(c);
}

struct mla_ctx {
    float *out;     // (n, H, v)
    const float *q; // (n, H, nope + rope)
    const struct kv_layer *kv;
    const struct attn_metadata *md;
    const struct mla_args *a;
    const struct cpu_kernels *kern;
    void **scratch;
    const int64_t *item_start; // (n_seqs + 1) query chunks per sequence, prefix sums
    int wk;                    // CPU_WEIGHT_* of kv_b
};

// Rows [t0, t0 + n) of physical block `phys` as fp32 rows of D floats (into buf unless F32).
static const float *mla_load_tile(const struct kv_layer *kv, const struct cpu_kernels *kern, int64_t phys, int bs,
                                  int D, int t0, int n, float *buf) {
    const int64_t first = (phys * bs + t0) * (int64_t)D;
    switch (kv->k.dtype) {
    case DTYPE_F32:
        return (const float *)kv->k.data + first;
    case DTYPE_BF16:
        kern->widen[CPU_WEIGHT_BF16](buf, (const uint16_t *)kv->k.data + first, (int64_t)n * D);
        break;
    case DTYPE_F16:
        kern->widen[CPU_WEIGHT_F16](buf, (const uint16_t *)kv->k.data + first, (int64_t)n * D);
        break;
    case DTYPE_FP8_E4M3: {
        const uint8_t *s = (const uint8_t *)kv->k.data + first;
        for (int64_t i = 0; i < (int64_t)n * D; i++)
            buf[i] = fp8_e4m3_to_f32(s[i]) * kv->k_scale;
        break;
    }
    default:
        CHECK_MSG(0, "MLA: latent cache dtype %s not supported", dtype_name(kv->k.dtype));
    }
    return buf;
}

static void mla_item(struct mla_ctx *x, int s, int chunk, int h, float *scr) {
    const struct mla_args *a = x->a;
    const struct attn_metadata *md = x->md;
    const int H = a->n_heads, L = a->kv_lora, R = a->rope, NP = a->nope, V = a->v_dim, D = L + R, DQ = NP + R;
    const int bs = md->block_size;
    const int q_begin = md->h_query_start[s], q_len = md->h_query_start[s + 1] - q_begin;
    const int ctx_len = md->h_context_lens[s];
    CHECK_MSG(ctx_len >= q_len, "MLA attention: sequence %d has %d new tokens but context_len %d", s, q_len, ctx_len);
    const int i0 = chunk * MLA_QCHUNK, nq = q_len - i0 < MLA_QCHUNK ? q_len - i0 : MLA_QCHUNK;
    const int pos0 = ctx_len - q_len + i0, pos_last = pos0 + nq - 1;

    float *wuk = scr;                         // (NP, L) W_UK_h in fp32
    float *qa = wuk + (size_t)NP * L;         // (nq, D) absorbed, scaled queries
    float *acc = qa + (size_t)MLA_QCHUNK * D; // (nq, L) latent outputs
    float *mx = acc + (size_t)MLA_QCHUNK * L;
    float *lsum = mx + MLA_QCHUNK;
    float *tile = lsum + MLA_QCHUNK;  // (bs, D)
    float *S = tile + (size_t)bs * D; // (nq, bs)

    const struct tensor *kvb = &a->kv_b->t;
    const size_t wrow = dtype_row_bytes(kvb->dtype, L);
    const char *wh = (const char *)kvb->data + (size_t)h * (NP + V) * wrow;
    for (int i = 0; i < NP; i++)
        x->kern->widen[x->wk](wuk + (size_t)i * L, wh + (size_t)i * wrow, L);

    for (int qi = 0; qi < nq; qi++) {
        const float *qt = x->q + ((int64_t)(q_begin + i0 + qi) * H + h) * DQ;
        float *dst = qa + (size_t)qi * D;
        memset(dst, 0, (size_t)L * sizeof(float));
        x->kern->axpy_rows(dst, qt, wuk, L, NP, L); // W_UK_h^T q_nope
        for (int i = 0; i < L; i++)
            dst[i] *= a->scale;
        for (int i = 0; i < R; i++)
            dst[L + i] = qt[NP + i] * a->scale;
        mx[qi] = -INFINITY;
        lsum[qi] = 0.0f;
    }
    memset(acc, 0, (size_t)nq * L * sizeof(float));

    const int32_t *bt = md->h_block_tables + (int64_t)s * attn_md_table_stride(md);
    int cur[MLA_QCHUNK] = {0}; // DSA: each query's cursor into its ascending top-k list
    for (int blk = 0; blk <= pos_last / bs; blk++) {
        const int j0 = blk * bs, t1 = pos_last - j0 + 1 < bs ? pos_last - j0 + 1 : bs;
        const int qa0 = j0 - pos0 > 0 ? j0 - pos0 : 0; // queries that see at least key j0
        const int64_t phys = bt[blk];
        CHECK_MSG(phys >= 0 && phys < x->kv->k.ne[0], "MLA attention: sequence %d block %d maps to %lld of %lld", s,
                  blk, (long long)phys, (long long)x->kv->k.ne[0]);
        const float *K = mla_load_tile(x->kv, x->kern, phys, bs, D, 0, t1, tile);
        x->kern->gemv[CPU_WEIGHT_F32](S, bs, qa + (size_t)qa0 * D, D, nq - qa0, K, NULL, D, D, 0, t1);
        for (int qi = qa0; qi < nq; qi++) {
            const int u1 = pos0 + qi - j0 + 1 < t1 ? pos0 + qi - j0 + 1 : t1;
            float *sc = S + (size_t)(qi - qa0) * bs;
            if (a->topk) { // sparse: keys outside the query's top-k list score -inf
                const int32_t *sel = a->topk + (int64_t)(q_begin + i0 + qi) * a->topk_k;
                bool any = false;
                for (int t = 0; t < u1; t++) {
                    while (cur[qi] < a->topk_k && sel[cur[qi]] >= 0 && sel[cur[qi]] < j0 + t)
                        cur[qi]++;
                    if (cur[qi] < a->topk_k && sel[cur[qi]] == j0 + t)
                        any = true;
                    else
                        sc[t] = -INFINITY;
                }
                if (!any) continue;
            }
            float tmax = -INFINITY;
            for (int t = 0; t < u1; t++)
                if (sc[t] > tmax) tmax = sc[t];
            const float mnew = mx[qi] > tmax ? mx[qi] : tmax;
            const float corr = expf(mx[qi] - mnew);
            float *ac = acc + (size_t)qi * L;
            if (corr != 1.0f) x->kern->scale(ac, corr, L);
            const float ls = x->kern->exp_sum(sc, u1, mnew);
            x->kern->axpy_rows(ac, sc, K, D, u1, L);
            lsum[qi] = lsum[qi] * corr + ls;
            mx[qi] = mnew;
        }
    }
    for (int qi = 0; qi < nq; qi++)
        x->kern->scale(acc + (size_t)qi * L, 1.0f / lsum[qi], L);
    // out[t, h, :] = W_UV_h o_lat: weight rows h (NP + V) + NP .. + V of kv_b.
    x->kern->gemv[x->wk](x->out + ((int64_t)(q_begin + i0) * H + h) * V, (int64_t)H * V, acc, L, nq,
                         wh + (size_t)NP * wrow, NULL, L, L, 0, V);
}

static void mla_items(void *vctx, int64_t it0, int64_t it1, int tid) {
    struct mla_ctx *x = vctx;
    const int n_seqs = x->md->n_seqs, H = x->a->n_heads;
    for (int64_t it = it0; it < it1; it++) {
        const int h = (int)(it % H);
        const int64_t ci = it / H;
        int lo = 0, hi = n_seqs - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (x->item_start[mid] <= ci)
                lo = mid;
            else
                hi = mid - 1;
        }
        mla_item(x, lo, (int)(ci - x->item_start[lo]), h, x->scratch[tid]);
    }
}

void cpu_mla_attention(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                       const struct attn_metadata *md, const struct mla_args *a, void *workspace) {
    (void)workspace; // the CPU uses its per-thread scratch
    struct cpu_backend *c = cpu_backend_of(b);
    const int H = a->n_heads, L = a->kv_lora, R = a->rope, D = L + R, bs = md->block_size;
    CHECK(out->dtype == DTYPE_F32 && q->dtype == DTYPE_F32);
    CHECK(tensor_numel(q) >= (int64_t)md->n_tokens * H * (a->nope + R));
    CHECK(tensor_numel(out) >= (int64_t)md->n_tokens * H * a->v_dim);
    CHECK(kv->k.ndim == 4 && kv->k.ne[2] == 1 && kv->k.ne[3] == D && kv->k.ne[1] == bs);
    CHECK(a->kv_b && a->kv_b->scheme == WEIGHT_SCHEME_NONE && a->kv_b->t.ne[0] == (int64_t)H * (a->nope + a->v_dim) &&
          tensor_cols(&a->kv_b->t) == L);
    cpu_lock(c);
    int64_t *item_start = cpu_shared_reserve(c, (size_t)(md->n_seqs + 1) * sizeof(int64_t));
    item_start[0] = 0;
    for (int s = 0; s < md->n_seqs; s++) {
        int ql = md->h_query_start[s + 1] - md->h_query_start[s];
        CHECK(ql >= 0);
        item_start[s + 1] = item_start[s] + (ql + MLA_QCHUNK - 1) / MLA_QCHUNK;
    }
    const int64_t n_items = item_start[md->n_seqs] * H;
    cpu_scratch_reserve(
        c, ((size_t)a->nope * L + (size_t)MLA_QCHUNK * (D + L + 2 + bs) + (size_t)bs * D) * sizeof(float) + 64);
    struct mla_ctx x = {
        .out = out->data,
        .q = q->data,
        .kv = kv,
        .md = md,
        .a = a,
        .kern = &c->kern,
        .scratch = c->scratch,
        .item_start = item_start,
        .wk = mla_weight_kind(a->kv_b->t.dtype),
    };
    if (n_items > 0) thread_pool_parallel_for(c->pool, n_items, 1, mla_items, &x);
    cpu_unlock(c);
}
