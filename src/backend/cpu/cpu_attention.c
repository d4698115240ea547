// Paged attention on the CPU for a batch mixing prefill and decode sequences.
//
// Sequence s owns query rows [query_start[s], query_start[s+1]) (q_len of them) and has
// context_len[s] tokens in its KV blocks (cached + the new ones, already written by
// rope_kv_write). Query i of the sequence sits at absolute position p = context_len - q_len + i
// and attends to keys j with lo(p) <= j <= p, where lo(p) = 0, or p - sliding_window + 1 when
// sliding_window > 0 (the last `sliding_window` positions, itself included). With sinks, the
// head's sink logit joins the softmax denominator (GPT-OSS) but contributes no value.
//
// Work items are (sequence, kv head, chunk of up to ATTN_QCHUNK queries): every query head of
// the kv head's GQA group and every query of the chunk share each K/V tile, so a BF16/FP8 tile
// is dequantised once per item. Softmax is the online (running max) form in fp32.
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "backend/cpu/cpu_backend.h"
#include "common/check.h"

#define ATTN_QCHUNK 16

struct attn_ctx {
    float *out;       // (n_tokens, hq, dv)
    const float *q;   // (n_tokens, q_stride): head h of a token at [h * d, (h + 1) * d)
    int64_t q_stride; // elements between consecutive tokens' q rows (>= hq * d: q may sit in fused qkv)
    const struct kv_layer *kv;
    const struct attn_metadata *md;
    const float *sinks; // (hq) or NULL
    float scale;
    int window;
    int hq, hk, rep, d, dv, bs;
    const int64_t *item_start; // (n_seqs + 1) prefix sums of query chunks per sequence
    const struct cpu_kernels *kern;
    void **scratch;
};

// Rows [t0, t0 + n) of one block's K or V for kv head g, as fp32 rows of `width` floats.
// Returns a pointer to them and their stride: straight into the cache for F32, else dequantised
// into buf.
static const float *attn_load_tile(const struct cpu_kernels *kern, const struct tensor *cache, float scale,
                                   int64_t phys, int bs, int hk, int g, int width, int t0, int n, float *buf,
                                   int64_t *stride) {
    int64_t first = ((phys * bs + t0) * hk + g) * (int64_t)width;
    int64_t rs = (int64_t)hk * width;
    switch (cache->dtype) {
    case DTYPE_F32:
        *stride = rs;
        return (const float *)cache->data + first;
    case DTYPE_BF16: {
        const uint16_t *s = (const uint16_t *)cache->data + first;
        for (int t = 0; t < n; t++)
            kern->widen[CPU_WEIGHT_BF16](buf + (int64_t)t * width, s + t * rs, width);
        break;
    }
    case DTYPE_F16: {
        const uint16_t *s = (const uint16_t *)cache->data + first;
        for (int t = 0; t < n; t++)
            kern->widen[CPU_WEIGHT_F16](buf + (int64_t)t * width, s + t * rs, width);
        break;
    }
    case DTYPE_FP8_E4M3: {
        const uint8_t *s = (const uint8_t *)cache->data + first;
        for (int t = 0; t < n; t++)
            for (int i = 0; i < width; i++)
                buf[(int64_t)t * width + i] = fp8_e4m3_to_f32(s[t * rs + i]) * scale;
        break;
    }
    default:
        CHECK_MSG(0, "attention: kv cache dtype %s not supported", dtype_name(cache->dtype));
    }
    *stride = width;
    return buf;
}

// The next block's K and V rows of kv head g, towards the cache while this block is computed:
// its rows sit hk heads apart (one head's slice per token), a stride the hardware prefetchers
// follow poorly, and a decode step reads the whole cache once.
static void attn_prefetch_block(const struct attn_ctx *a, int64_t phys, int g) {
    if (phys < 0 || phys >= a->kv->k.ne[0]) return;
    const struct tensor *t[2] = {&a->kv->k, &a->kv->v};
    const int width[2] = {a->d, a->dv};
    for (int c = 0; c < 2; c++) {
        const size_t row = dtype_row_bytes(t[c]->dtype, width[c]);
        const char *base = (const char *)t[c]->data + (size_t)((phys * a->bs) * a->hk + g) * row;
        for (int r = 0; r < a->bs; r++)
            for (size_t o = 0; o < row; o += 64)
                __builtin_prefetch(base + (size_t)r * a->hk * row + o);
    }
}

static void attn_item(struct attn_ctx *a, int s, int chunk, int g, float *scr) {
    const struct attn_metadata *md = a->md;
    const int d = a->d, dv = a->dv, rep = a->rep, bs = a->bs;
    const struct cpu_kernels *kern = a->kern;
    int q_begin = md->h_query_start[s], q_len = md->h_query_start[s + 1] - q_begin;
    int ctx_len = md->h_context_lens[s];
    CHECK_MSG(ctx_len >= q_len, "attention: sequence %d has %d new tokens but context_len %d", s, q_len, ctx_len);
    int i0 = chunk * ATTN_QCHUNK;
    int nq = q_len - i0 < ATTN_QCHUNK ? q_len - i0 : ATTN_QCHUNK;
    int pos0 = ctx_len - q_len + i0; // position of the chunk's first query
    int pos_last = pos0 + nq - 1;
    int kmin = a->window > 0 ? pos0 - a->window + 1 : 0;
    if (kmin < 0) kmin = 0;

    const int nrow = nq * rep;          // (query, head) pairs of this item
    float *qs = scr;                    // (nrow, d) scaled queries
    float *acc = qs + (size_t)nrow * d; // (nrow, dv)
    float *m = acc + (size_t)nrow * dv; // (nrow) running max
    float *l = m + nrow;                // (nrow) running denominator
    float *kt = l + nrow;               // (bs, d) dequantised K tile
    float *vt = kt + (size_t)bs * d;    // (bs, dv)
    float *S = vt + (size_t)bs * dv;    // (nrow, bs) scores of one tile

    for (int qi = 0; qi < nq; qi++) {
        const float *qrow = a->q + (int64_t)(q_begin + i0 + qi) * a->q_stride;
        for (int r = 0; r < rep; r++) {
            int h = g * rep + r, row = qi * rep + r;
            const float *src = qrow + (int64_t)h * d;
            for (int i = 0; i < d; i++)
                qs[(size_t)row * d + i] = src[i] * a->scale;
            m[row] = a->sinks ? a->sinks[h] : -INFINITY;
            l[row] = a->sinks ? 1.0f : 0.0f;
        }
    }
    memset(acc, 0, (size_t)nrow * dv * sizeof(float));

    const int32_t *bt = md->h_block_tables + (int64_t)s * attn_md_table_stride(md);
    for (int blk = kmin / bs; blk <= pos_last / bs; blk++) {
        int j0 = blk * bs;
        int t0 = kmin > j0 ? kmin - j0 : 0;
        int t1 = pos_last - j0 + 1 < bs ? pos_last - j0 + 1 : bs; // exclusive
        // Queries with at least one key in [j0 + t0, j0 + t1): pos >= j0 + t0, and with a
        // window also pos - window + 1 < j0 + t1.
        int qa = j0 + t0 - pos0 > 0 ? j0 + t0 - pos0 : 0, qb = nq;
        if (a->window > 0 && j0 + t1 + a->window - 1 - pos0 < qb) qb = j0 + t1 + a->window - 1 - pos0;
        if (qa >= qb) continue;
        int64_t phys = bt[blk];
        CHECK_MSG(phys >= 0 && phys < a->kv->k.ne[0], "attention: sequence %d block %d maps to %lld of %lld", s, blk,
                  (long long)phys, (long long)a->kv->k.ne[0]);
        if (blk < pos_last / bs) attn_prefetch_block(a, bt[blk + 1], g);
        int64_t ks, vs = 0;
        // A 16-bit V tile is read in place too (axpy_rows16: the widened values, the same order).
        const bool v16 = a->kv->v.dtype == DTYPE_BF16 || a->kv->v.dtype == DTYPE_F16;
        const uint16_t *V16 =
            v16 ? (const uint16_t *)a->kv->v.data + ((phys * bs + t0) * a->hk + g) * (int64_t)dv : NULL;
        const float *V =
            v16 ? NULL : attn_load_tile(kern, &a->kv->v, a->kv->v_scale, phys, bs, a->hk, g, dv, t0, t1 - t0, vt, &vs);
        // All scores of the tile at once: rows (qa..qb) x rep against keys t0..t1. A BF16 K tile
        // (or F16) tile is read in place by the 16-bit kernel (exactly the widened values, same dot order).
        if (a->kv->k.dtype == DTYPE_BF16 || a->kv->k.dtype == DTYPE_F16) {
            const uint16_t *K = (const uint16_t *)a->kv->k.data + ((phys * bs + t0) * a->hk + g) * (int64_t)d;
            kern->gemv[a->kv->k.dtype == DTYPE_BF16 ? CPU_WEIGHT_BF16 : CPU_WEIGHT_F16](
                S, bs, qs + (size_t)qa * rep * d, d, (qb - qa) * rep, K, NULL, d, (int64_t)a->hk * d, 0, t1 - t0);
        } else {
            const float *K = attn_load_tile(kern, &a->kv->k, a->kv->k_scale, phys, bs, a->hk, g, d, t0, t1 - t0, kt, &ks);
            kern->gemv[CPU_WEIGHT_F32](S, bs, qs + (size_t)qa * rep * d, d, (qb - qa) * rep, K, NULL, d, ks, 0,
                                       t1 - t0);
        }
        for (int qi = qa; qi < qb; qi++) {
            int pos = pos0 + qi;
            int lo = a->window > 0 ? pos - a->window + 1 : 0;
            int u0 = lo - j0 > t0 ? lo - j0 : t0;
            int u1 = pos - j0 + 1 < t1 ? pos - j0 + 1 : t1;
            if (u0 >= u1) continue;
            for (int r = 0; r < rep; r++) {
                int row = qi * rep + r;
                float *sc = S + (size_t)(row - qa * rep) * bs - t0; // sc[t], t in [u0, u1)
                float tmax = -INFINITY;
                for (int t = u0; t < u1; t++)
                    if (sc[t] > tmax) tmax = sc[t];
                float mnew = m[row] > tmax ? m[row] : tmax;
                float corr = expf(m[row] - mnew); // 0 when m was -inf
                float *ac = acc + (size_t)row * dv;
                if (corr != 1.0f) kern->scale(ac, corr, dv);
                float lsum = kern->exp_sum(sc + u0, u1 - u0, mnew);
                if (!v16) kern->axpy_rows(ac, sc + u0, V + (u0 - t0) * vs, vs, u1 - u0, dv);
                l[row] = l[row] * corr + lsum;
                m[row] = mnew;
            }
            if (v16) // the query's rep rows share [u0, u1): one pass over the tile for all of them
                kern->axpy_rows16[a->kv->v.dtype == DTYPE_F16](
                    acc + (size_t)qi * rep * dv, dv, rep, S + (size_t)(qi - qa) * rep * bs - t0 + u0, bs,
                    V16 + (int64_t)(u0 - t0) * a->hk * dv, (int64_t)a->hk * dv, u1 - u0, dv);
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        float *orow = a->out + (int64_t)(q_begin + i0 + qi) * a->hq * dv;
        for (int r = 0; r < rep; r++) {
            int row = qi * rep + r, h = g * rep + r;
            float inv = 1.0f / l[row];
            for (int i = 0; i < dv; i++)
                orow[(int64_t)h * dv + i] = acc[(size_t)row * dv + i] * inv;
        }
    }
}

static void attn_items(void *vctx, int64_t it0, int64_t it1, int tid) {
    struct attn_ctx *a = vctx;
    const int n_seqs = a->md->n_seqs;
    for (int64_t it = it0; it < it1; it++) {
        int g = (int)(it % a->hk);
        int64_t ci = it / a->hk;
        // Sequence owning query chunk ci: binary search in the prefix sums.
        int lo = 0, hi = n_seqs - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (a->item_start[mid] <= ci)
                lo = mid;
            else
                hi = mid - 1;
        }
        attn_item(a, lo, (int)(ci - a->item_start[lo]), g, a->scratch[tid]);
    }
}

void cpu_attention(struct backend *b, struct tensor *out, const struct tensor *q, int64_t q_row_stride,
                   const struct kv_layer *kv, const struct attn_metadata *md, float scale, int sliding_window,
                   const struct tensor *sinks) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && q->dtype == DTYPE_F32 && q->ndim == 3 && out->ndim == 3);
    CHECK(kv->k.ndim == 4 && kv->v.ndim == 4);
    int hq = (int)q->ne[1], d = (int)q->ne[2];
    int bs = (int)kv->k.ne[1], hk = (int)kv->k.ne[2], dv = (int)kv->v.ne[3];
    CHECK(kv->k.ne[3] == d && kv->v.ne[2] == hk && kv->v.ne[1] == bs && bs == md->block_size);
    CHECK(hk > 0 && hq % hk == 0);
    CHECK(out->ne[0] == q->ne[0] && out->ne[1] == hq && out->ne[2] == dv);
    CHECK(q->ne[0] >= md->n_tokens);
    if (sinks) CHECK(sinks->dtype == DTYPE_F32 && tensor_numel(sinks) == hq);
    if (kv->k.dtype == DTYPE_FP8_E4M3) CHECK(kv->k_scale > 0.0f && kv->v_scale > 0.0f);
    int rep = hq / hk;

    cpu_lock(c);
    int64_t *item_start = cpu_shared_reserve(c, (size_t)(md->n_seqs + 1) * sizeof(int64_t));
    item_start[0] = 0;
    for (int s = 0; s < md->n_seqs; s++) {
        int ql = md->h_query_start[s + 1] - md->h_query_start[s];
        CHECK(ql >= 0);
        item_start[s + 1] = item_start[s] + (ql + ATTN_QCHUNK - 1) / ATTN_QCHUNK;
    }
    int64_t n_items = item_start[md->n_seqs] * hk;
    size_t nrow = (size_t)ATTN_QCHUNK * rep;
    cpu_scratch_reserve(c, (nrow * (d + dv + 2 + (size_t)bs) + (size_t)bs * (d + dv)) * sizeof(float) + 64);
    struct attn_ctx a = {
        .out = out->data,
        .q = q->data,
        .q_stride = q_row_stride ? q_row_stride : (int64_t)hq * d,
        .kv = kv,
        .md = md,
        .sinks = sinks ? sinks->data : NULL,
        .scale = scale,
        .window = sliding_window,
        .hq = hq,
        .hk = hk,
        .rep = rep,
        .d = d,
        .dv = dv,
        .bs = bs,
        .item_start = item_start,
        .kern = &c->kern,
        .scratch = c->scratch,
    };
    if (n_items > 0) thread_pool_parallel_for(c->pool, n_items, 1, attn_items, &a);
    cpu_unlock(c);
}
