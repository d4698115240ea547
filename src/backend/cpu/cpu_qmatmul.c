// The CPU backend's matmul over quantized weights (struct weight with a scheme other than NONE,
// core/weight.h): the reference the GPU kernels are tested against.
//
// Contract:
// - Schemes: PER_TENSOR, PER_CHANNEL and BLOCK over FP8 E4M3 values; GROUP over 4-bit (or
//   8-bit) integers packed in I32 words (offset 2^(bits-1), low bits first), optionally with F32
//   zero points (asymmetric: (q - z) * s) and a column -> group map (GPTQ desc_act). Scales
//   are F32 in the layouts weight.h gives (the loader converts them). MX (MXFP4): U8 bytes of
//   two e2m1 nibbles and U8 e8m0 exponents per 32 columns, both as the checkpoint stores them;
//   a value is e2m1 * 2^(e - 127), exact in F32.
// - Weights: dequantized exactly (value * scale in F32, the formats' definition) a tile of rows
//   at a time into scratch, and multiplied by the same kernels as F32 weights (the skinny
//   kernel for decode-sized batches and in batch-invariant mode, OpenBLAS sgemm above).
// - Activations (W8A8): when the weight says so (w->act, set by the loader from the
//   checkpoint's input_activations: dynamic per-token FP8, per token and 128-column group for
//   fp8 blocks, per-token INT8, or static FP8 / INT8 with the stored input scale), x is quantized first by act_quant_row (core/weight.c, the
//   definition every backend follows: same scales, same bytes) and the product runs over
//   the dequantized values f32(xq) * s. That is W8A8 exactly, up to fp32 summation order: the
//   GPU's tensor-core product sum(xq * wq) * sx * sw differs from it by fp32 rounding only.
//   This is the CPU's default for such checkpoints (not a mode): the CPU computes what the
//   GPU computes. Weight-only configs (act NONE) keep x as it is (W8A16 / W4A16); the model
//   load option quant_weight_only runs a W8A8 checkpoint weight-only (transformers'
//   dequantize=True forward).
// - The weights stay quantized in memory: nothing is widened beyond one tile per call (the
//   skinny path: 16 rows per pool thread; the sgemm path: ~4 MB of F32 rows); a W8A8 call also
//   holds the (n, k) dequantized activations in the op scratch.
#include "backend/cpu/cpu_backend.h"

#include <cblas.h> // after backend.h: its complex.h defines I
#include <math.h>
#include <string.h>

#include "common/check.h"

#define QMATMUL_SKINNY_MAX_ROWS 8     // as cpu_matmul
#define QMATMUL_TILE_BYTES (4u << 20) // F32 rows of the sgemm path's tile
#define QMATMUL_SKINNY_ROWS 16        // weight rows dequantized per step of the skinny path

bool cpu_qweight_supported(const struct weight *w) {
    switch (w->scheme) {
    case WEIGHT_SCHEME_PER_TENSOR:
    case WEIGHT_SCHEME_PER_CHANNEL:
    case WEIGHT_SCHEME_BLOCK:
        return w->t.dtype == DTYPE_FP8_E4M3 && w->scale.dtype == DTYPE_F32;
    case WEIGHT_SCHEME_GROUP:
        return w->t.dtype == DTYPE_I32 && (w->bits == 4 || w->bits == 8) && w->block_cols > 0 &&
               w->scale.dtype == DTYPE_F32 && (!w->zero.data || w->zero.dtype == DTYPE_F32) &&
               (!w->gidx.data || (w->gidx.dtype == DTYPE_I32 && w->t.ndim == 2));
    case WEIGHT_SCHEME_MX:
        return w->t.dtype == DTYPE_U8 && w->scale.dtype == DTYPE_U8 && w->block_cols == 32;
    default:
        return false;
    }
}

struct weight cpu_weight_expert(const struct weight *w, int e) {
    CHECK(w->t.ndim == 3 && e >= 0 && e < w->t.ne[0]);
    struct weight v = *w;
    size_t rb = dtype_row_bytes(w->t.dtype, w->t.ne[2]) * (size_t)w->t.ne[1];
    v.t = tensor_2d((char *)w->t.data + rb * (size_t)e, w->t.dtype, w->t.ne[1], w->t.ne[2]);
    if (w->scheme == WEIGHT_SCHEME_NONE) return v;
    const struct tensor *s = &w->scale;
    CHECK_MSG(s->ne[0] == w->t.ne[0], "expert weight scale has %lld experts, values %lld", (long long)s->ne[0],
              (long long)w->t.ne[0]);
    CHECK_MSG(!w->gidx.data, "expert weights with a column -> group map");
    int64_t per = tensor_numel(s) / s->ne[0];
    void *sp = (char *)s->data + dtype_row_bytes(s->dtype, per) * (size_t)e;
    if (w->zero.data) // GROUP zero points: the scales' layout
        v.zero = tensor_2d((char *)w->zero.data + dtype_row_bytes(w->zero.dtype, per) * (size_t)e, w->zero.dtype,
                           s->ne[1], s->ne[2]);
    if (s->ndim == 1) // PER_TENSOR (E)
        v.scale = tensor_make(sp, s->dtype, 1, (int64_t[]){1});
    else if (s->ndim == 2) // PER_CHANNEL (E, rows)
        v.scale = tensor_make(sp, s->dtype, 1, (int64_t[]){s->ne[1]});
    else // BLOCK / GROUP / MX (E, srows, scols)
        v.scale = tensor_2d(sp, s->dtype, s->ne[1], s->ne[2]);
    return v;
}

// What dequantizing rows needs, fixed per call.
struct qdeq {
    const struct weight *w;
    int64_t k;      // logical columns
    int64_t scols;  // scale columns (BLOCK / GROUP)
    float lut[256]; // FP8 E4M3 byte -> F32
    float e2m1[16]; // MX nibble -> F32
};

static void qdeq_init(struct qdeq *d, const struct weight *w) {
    d->w = w;
    d->k = weight_cols(w);
    d->scols = w->scale.ndim == 2 ? w->scale.ne[1] : 1;
    if (w->t.dtype == DTYPE_FP8_E4M3)
        for (int i = 0; i < 256; i++)
            d->lut[i] = fp8_e4m3_to_f32((uint8_t)i);
    for (unsigned i = 0; i < 16; i++)
        d->e2m1[i] = weight_e2m1_value(i);
}

// dst (r1 - r0, k) = the F32 weights of rows [r0, r1).
static void qdeq_rows(const struct qdeq *d, int64_t r0, int64_t r1, float *dst) {
    const struct weight *w = d->w;
    const int64_t k = d->k;
    const float *sc = w->scale.data;
    for (int64_t r = r0; r < r1; r++) {
        float *o = dst + (r - r0) * k;
        if (w->scheme == WEIGHT_SCHEME_MX) { // 16 bytes (32 values) per e8m0 exponent
            const uint8_t *q = (const uint8_t *)w->t.data + r * (k / 2);
            const uint8_t *e = (const uint8_t *)w->scale.data + r * (k / 32);
            for (int64_t bi = 0; bi < k / 32; bi++) {
                const float f = ldexpf(1.0f, (int)e[bi] - 127);
                for (int j = 0; j < 16; j++) {
                    const uint8_t v = q[bi * 16 + j];
                    o[bi * 32 + 2 * j] = d->e2m1[v & 15u] * f;
                    o[bi * 32 + 2 * j + 1] = d->e2m1[v >> 4] * f;
                }
            }
        } else if (w->t.dtype == DTYPE_FP8_E4M3) {
            const uint8_t *q = (const uint8_t *)w->t.data + r * k;
            if (w->scheme == WEIGHT_SCHEME_BLOCK) {
                const float *srow = sc + (r / w->block_rows) * d->scols;
                for (int64_t c0 = 0, b = 0; c0 < k; c0 += w->block_cols, b++) {
                    int64_t c1 = c0 + w->block_cols < k ? c0 + w->block_cols : k;
                    float s = srow[b];
                    for (int64_t c = c0; c < c1; c++)
                        o[c] = d->lut[q[c]] * s;
                }
            } else {
                float s = w->scheme == WEIGHT_SCHEME_PER_CHANNEL ? sc[r] : sc[0];
                for (int64_t c = 0; c < k; c++)
                    o[c] = d->lut[q[c]] * s;
            }
        } else { // GROUP over packed I32 words, a group at a time (words inside one group)
            const int bits = w->bits, per = 32 / bits;
            const uint32_t *q = (const uint32_t *)w->t.data + r * (k / per);
            const float *srow = sc + r * d->scols;
            const float *zrow = w->zero.data ? (const float *)w->zero.data + r * d->scols : NULL;
            const int32_t *gidx = w->gidx.data;
            const int64_t g = w->block_cols;
            // w = (q - z) * s: q and z are small integers, so q - z is exact and the value is one
            // rounding of the product (z = 0 without zero points: q * s, as before).
            if (g % per == 0 && !gidx) {
                for (int64_t c0 = 0, gi = 0; c0 < k; c0 += g, gi++) {
                    const int64_t c1 = c0 + g < k ? c0 + g : k;
                    const float s = srow[gi], z = zrow ? zrow[gi] : 0.0f;
                    if (bits == 4)
                        for (int64_t c = c0; c < c1; c += 8) {
                            const uint32_t u = q[c / 8];
                            for (int i = 0; i < 8; i++)
                                o[c + i] = ((float)((int32_t)((u >> (4 * i)) & 15u) - 8) - z) * s;
                        }
                    else
                        for (int64_t c = c0; c < c1; c += 4) {
                            const uint32_t u = q[c / 4];
                            for (int i = 0; i < 4; i++)
                                o[c + i] = ((float)((int32_t)((u >> (8 * i)) & 255u) - 128) - z) * s;
                        }
                }
            } else { // groups that split words, or a column -> group map: per value
                const uint32_t mask = (1u << bits) - 1u;
                const int32_t off = 1 << (bits - 1);
                for (int64_t c = 0; c < k; c++) {
                    const int64_t gi = gidx ? gidx[c] : c / g;
                    o[c] = ((float)((int32_t)((q[c / per] >> (bits * (c % per))) & mask) - off) -
                            (zrow ? zrow[gi] : 0.0f)) *
                           srow[gi];
                }
            }
        }
    }
}

struct qmm_ctx {
    struct cpu_backend *c;
    const struct qdeq *d;
    float *out;
    const float *x, *bias;
    float *tile; // sgemm path: the shared tile; row0 is its first weight row
    int64_t row0;
    int nx;
    int64_t m;
};

// Skinny path: output columns [j0, j1) for every row, dequantizing 16 weight rows at a time
// into this thread's scratch.
static void qmm_skinny_cols(void *vctx, int64_t j0, int64_t j1, int tid) {
    struct qmm_ctx *g = vctx;
    const int64_t k = g->d->k;
    float *buf = g->c->scratch[tid];
    for (int64_t c0 = j0; c0 < j1; c0 += QMATMUL_SKINNY_ROWS) {
        int64_t c1 = c0 + QMATMUL_SKINNY_ROWS < j1 ? c0 + QMATMUL_SKINNY_ROWS : j1;
        qdeq_rows(g->d, c0, c1, buf);
        for (int i0 = 0; i0 < g->nx; i0 += 64) {
            int ni = g->nx - i0 < 64 ? g->nx - i0 : 64;
            g->c->kern.gemv[CPU_WEIGHT_F32](g->out + (int64_t)i0 * g->m + c0, g->m, g->x + (int64_t)i0 * k, k, ni, buf,
                                            g->bias ? g->bias + c0 : NULL, k, k, 0, c1 - c0);
        }
    }
}

static void qmm_tile_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct qmm_ctx *g = vctx;
    qdeq_rows(g->d, g->row0 + r0, g->row0 + r1, g->tile + r0 * g->d->k);
    (void)tid;
}

// W8A8: rows [r0, r1) of x quantized and dequantized (act_quant_row) into xq.
struct actq_ctx {
    enum weight_act act;
    float act_scale;
    const float *x;
    float *xq;
    int64_t k;
};

static void actq_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct actq_ctx *a = vctx;
    for (int64_t r = r0; r < r1; r++)
        act_quant_row(a->act, a->x + r * a->k, a->k, a->act_scale, a->xq + r * a->k, NULL, NULL);
    (void)tid;
}

void cpu_qmatmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                 const struct tensor *bias) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK_MSG(cpu_qweight_supported(w), "CPU matmul: weight scheme %s over %s values not implemented",
              weight_scheme_name(w->scheme), dtype_name(w->t.dtype));
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && w->t.ndim == 2);
    CHECK(w->act >= WEIGHT_ACT_NONE && w->act < WEIGHT_ACT_COUNT);
    const int64_t n = tensor_rows(x), k = tensor_cols(x), m = w->t.ne[0];
    CHECK_MSG(weight_cols(w) == k, "matmul: x has %lld columns, w has %lld", (long long)k, (long long)weight_cols(w));
    CHECK(tensor_cols(out) == m && tensor_rows(out) == n);
    if (w->scheme == WEIGHT_SCHEME_BLOCK)
        CHECK(w->block_rows > 0 && w->block_cols > 0 && w->scale.ndim == 2 &&
              w->scale.ne[0] == (m + w->block_rows - 1) / w->block_rows &&
              w->scale.ne[1] == (k + w->block_cols - 1) / w->block_cols);
    else if (w->scheme == WEIGHT_SCHEME_PER_CHANNEL)
        CHECK(tensor_numel(&w->scale) == m);
    else if (w->scheme == WEIGHT_SCHEME_PER_TENSOR)
        CHECK(tensor_numel(&w->scale) == 1);
    else if (w->scheme == WEIGHT_SCHEME_MX)
        CHECK(k % 32 == 0 && w->scale.ndim == 2 && w->scale.ne[0] == m && w->scale.ne[1] == k / 32);
    else {
        CHECK(w->scale.ndim == 2 && w->scale.ne[0] == m && k % (32 / w->bits) == 0);
        CHECK(w->gidx.data ? tensor_numel(&w->gidx) == k : w->scale.ne[1] == (k + w->block_cols - 1) / w->block_cols);
        CHECK(!w->zero.data || tensor_numel(&w->zero) == tensor_numel(&w->scale));
    }
    if (bias) CHECK(tensor_numel(bias) == m);
    if (n == 0) return;
    struct qdeq dq, *d = &dq;
    qdeq_init(d, w);
    const bool skinny = n <= QMATMUL_SKINNY_MAX_ROWS || c->batch_invariant;
    int64_t tile_rows = 0;
    if (!skinny) {
        tile_rows = (int64_t)(QMATMUL_TILE_BYTES / ((size_t)k * sizeof(float)));
        if (tile_rows < 16) tile_rows = 16;
        if (tile_rows > m) tile_rows = m;
    }
    size_t bias_bytes = bias ? ((size_t)m * sizeof(float) + 63) & ~(size_t)63 : 0;
    size_t xq_bytes = w->act != WEIGHT_ACT_NONE ? ((size_t)n * (size_t)k * sizeof(float) + 63) & ~(size_t)63 : 0;
    cpu_lock(c);
    uint8_t *scr =
        cpu_shared_reserve(c, xq_bytes + bias_bytes + (size_t)tile_rows * (size_t)k * sizeof(float) + 64);
    const float *xin = x->data;
    if (xq_bytes) {
        struct actq_ctx a = {w->act, w->act_scale, x->data, (float *)scr, k};
        if (n * k < 65536)
            actq_rows(&a, 0, n, 0);
        else
            thread_pool_parallel_for(c->pool, n, 1, actq_rows, &a);
        xin = (const float *)scr;
        scr += xq_bytes;
    }
    float *bf = NULL;
    if (bias) {
        bf = (float *)scr;
        dtype_to_f32(bias->dtype, bias->data, bf, m);
    }
    struct qmm_ctx g = {c, d, out->data, xin, bf, (float *)(scr + bias_bytes), 0, (int)n, m};
    if (skinny) {
        cpu_scratch_reserve(c, (size_t)QMATMUL_SKINNY_ROWS * (size_t)k * sizeof(float));
        if (m * k * n < 65536) {
            qmm_skinny_cols(&g, 0, m, 0);
        } else {
            int64_t grain = 16384 / k; // >= 64 KB of F32 weights per chunk
            grain =
                grain < QMATMUL_SKINNY_ROWS ? QMATMUL_SKINNY_ROWS : grain / QMATMUL_SKINNY_ROWS * QMATMUL_SKINNY_ROWS;
            thread_pool_parallel_for(c->pool, m, grain, qmm_skinny_cols, &g);
        }
    } else {
        float *o = out->data, beta = 0.0f;
        if (bf) {
            for (int64_t i = 0; i < n; i++)
                memcpy(o + i * m, bf, (size_t)m * sizeof(float));
            beta = 1.0f;
        }
        for (int64_t j0 = 0; j0 < m; j0 += tile_rows) {
            int64_t jn = m - j0 < tile_rows ? m - j0 : tile_rows;
            g.row0 = j0;
            if (jn * k < 32768)
                qmm_tile_rows(&g, 0, jn, 0);
            else
                thread_pool_parallel_for(c->pool, jn, 8, qmm_tile_rows, &g);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)jn, (blasint)k, 1.0f, xin,
                        (blasint)k, g.tile, (blasint)k, beta, o + j0, (blasint)m);
        }
    }
    cpu_unlock(c);
}
