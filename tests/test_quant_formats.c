// Issue 19 part 3 on the CPU backend (the reference): integer weights with zero points, GPTQ and
// AWQ checkpoints, static activation scales.
// - tests/fixtures/quant (tools/make_quant_fixtures.py):
//     ct_w4a16_asym_group32, ct_w4a16_asym_channel, ct_w8a16_asym_group32, ct_w8a16_asym_channel:
//       compressed-tensors pack-quantized with symmetric: false (weight_zero_point packed along
//       the rows), written by compressed-tensors itself; transformers' decompression checked
//       against (q - z) * s by the tool;
//     gptq_w4_g32_sym, gptq_w4_g32_asym_desc_act, gptq_w8_channel_asym, gptq_w8_g32_sym_desc_act:
//       GPTQ v1 (qweight / qzeros "zero - 1" / scales / g_idx), packed by AutoGPTQ 0.7.1's own
//       QuantLinear.pack, checked against its torch dequantization; desc_act ones with a random
//       act-order g_idx shared by the modules of one input;
//     awq_w4_g32: AWQ GEMM packed by AutoAWQ 0.2.9's WQLinear_GEMM.from_linear, checked against
//       its dequantize_gemm;
//     ct_w8a8_int8_token / ct_w8a8_int8_static: compressed-tensors int-quantized (I8 weights per
//       channel, repacked at load into GROUP's 8-bit words), INT8 activations per token (vLLM's
//       amax / 127) or static (stored input_scale, clamp(round(x / s), -128, 127));
//     ct_fp8_static_tensor / ct_fp8_static_channel (compressed-tensors, input_activations
//       dynamic: false) and fp8_static (quant_method fp8, activation_scheme static, per-tensor):
//       FP8 weights with a stored input_scale per linear; gptq_w4_g64_asym_desc_act_hd64,
//       awq_w4_g64_hd64, fp8_static_hd64: the same at head_dim 64 (the CUDA model tests' shapes).
//   refs.json: transformers' fp32 forward with the linear weights set to the exact fp32
//   dequantization; every fixture's logits match it within LOGIT_RTOL x max(1, max |logit|)
//   (weight-only: the W8A8 ones run with quant_weight_only here). refs_w8a8.json (W8A8 ones):
//   each quantized linear's input fake-quantized with its stored scale as compressed-tensors'
//   fake_quantize does (e4m3(clamp(x / s, +-448)) * s, or the int8 forms; checked equal by the
//   tool), or per token for the dynamic INT8 one; the default
//   (W8A8) forward matches it within W8A8_RTOL and differs visibly from the weight-only refs.
// - The loaded weights are GROUP rows with zero points (and a g_idx map only where desc_act
//   permutes the groups), static ones carry their act_scale; bytes stay quantized.
// - Op level: cpu matmul over GROUP weights with zero points and a column -> group map (4 / 8
//   bits, skinny and sgemm paths) and static FP8 / INT8 activations against the definition in
//   double.
// - Refused by name: GPTQ 3-bit, AWQ GEMV / without zero points, fused parts whose static input
//   scales or g_idx maps differ, a desc_act checkpoint without g_idx, a g_idx out of range,
//   a kv_cache_scheme without its KV-cache scales.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/backend.h"
#include "loader/model_files.h"
#include "loader/safetensors.h"
#include "model/model.h"
#include "model/quant.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "runner_util.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define MARGIN_FACTOR 4.0
#define W8A8_RTOL 1e-3

static const struct {
    const char *name;
    int bits;            // packed bits (0: FP8)
    bool zero;           // zero points expected
    bool gidx;           // a column -> group map expected (desc_act)
    enum weight_act act; // the activation quantization the checkpoint declares
} FIXTURES[] = {
    {"ct_w4a16_asym_group32", 4, true, false, WEIGHT_ACT_NONE},
    {"ct_w4a16_asym_channel", 4, true, false, WEIGHT_ACT_NONE},
    {"ct_w8a16_asym_group32", 8, true, false, WEIGHT_ACT_NONE},
    {"ct_w8a16_asym_channel", 8, true, false, WEIGHT_ACT_NONE},
    {"gptq_w4_g32_sym", 4, false, false, WEIGHT_ACT_NONE}, // its stored zeros are all 2^(bits-1): dropped
    {"gptq_w4_g32_asym_desc_act", 4, true, true, WEIGHT_ACT_NONE},
    {"gptq_w8_channel_asym", 8, true, false, WEIGHT_ACT_NONE},
    {"gptq_w8_g32_sym_desc_act", 8, false, true, WEIGHT_ACT_NONE},
    {"awq_w4_g32", 4, true, false, WEIGHT_ACT_NONE},
    {"ct_fp8_static_tensor", 0, false, false, WEIGHT_ACT_FP8_STATIC},
    {"ct_fp8_static_channel", 0, false, false, WEIGHT_ACT_FP8_STATIC},
    {"fp8_static", 0, false, false, WEIGHT_ACT_FP8_STATIC},
    {"ct_w8a8_int8_token", 8, false, false, WEIGHT_ACT_INT8_TOKEN},
    {"ct_w8a8_int8_static", 8, false, false, WEIGHT_ACT_INT8_STATIC},
    // head_dim 64, the shapes of the CUDA model tests (tests/gpu/test_cuda_quant_models.c)
    {"gptq_w4_g64_asym_desc_act_hd64", 4, true, true, WEIGHT_ACT_NONE},
    {"awq_w4_g64_hd64", 4, true, false, WEIGHT_ACT_NONE},
    {"fp8_static_hd64", 0, false, false, WEIGHT_ACT_FP8_STATIC},
    {"ct_w8a8_int8_static_hd64", 8, false, false, WEIGHT_ACT_INT8_STATIC},
};
#define N_FIXTURES ((int)(sizeof FIXTURES / sizeof FIXTURES[0]))

static bool has(const char *msg, const char *needle) {
    if (strstr(msg, needle)) return true;
    fprintf(stderr, "  message lacks \"%s\": %s\n", needle, msg);
    return false;
}

static struct runner_options base_options(const char *path) {
    struct runner_options o = small_cpu_runner_options(path);
    o.enforce_eager = true;
    o.quant_weight_only = true;
    return o;
}

static const char *fixture_dir(const char *name) {
    static char path[4096];
    char rel[256];
    snprintf(rel, sizeof rel, "quant/%s", name);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    return path;
}

// Max |logit - ref| over every position of every prompt of R (the runner's logits), and the max
// against a second set W (same prompts) when given.
static double run_logits(struct model_runner *r, const struct refs *R, const struct refs *W, double *vs_w,
                         unsigned seed) {
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, seed);
    double worst = 0;
    if (vs_w) *vs_w = 0;
    struct error err = {0};
    for (int pi = 0; pi < R->n; pi++) {
        const struct ref_prompt *p = &R->p[pi];
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, p->ids, p->n);
        sim_step_begin(s);
        if (sim_step_add(s, q, p->n, 0) != 0) abort();
        for (int k = 0; k < p->n_pos; k++)
            s->rows[k] = p->pos[k];
        s->n_rows = p->n_pos;
        struct forward_batch fb = sim_step_batch(s);
        float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R->vocab);
        if (model_runner_execute_logits(r, &fb, lg, &err) != ATOMC_OK) {
            fprintf(stderr, "execute: %s\n", err.msg);
            abort();
        }
        double d = max_abs_diff(lg, p->logits, p->n_pos * R->vocab);
        if (!(d <= worst)) worst = d;
        if (W && vs_w) {
            double dw = max_abs_diff(lg, W->p[pi].logits, p->n_pos * R->vocab);
            if (dw > *vs_w) *vs_w = dw;
        }
        free(lg);
        sim_seq_release(s, q);
        free(q);
    }
    sim_free(s);
    free(s);
    return worst;
}

TEST(quant_formats_logits_match_refs) {
    for (int fi = 0; fi < N_FIXTURES; fi++) {
        struct refs R;
        char rel[256];
        snprintf(rel, sizeof rel, "quant/%s/refs.json", FIXTURES[fi].name);
        ASSERT_EQ(refs_load_rel(rel, &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct runner_options o = base_options(fixture_dir(FIXTURES[fi].name));
        struct model_runner *r = NULL;
        struct error err = {0};
        if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  %s: %s\n", FIXTURES[fi].name, err.msg);
        ASSERT_TRUE(r != NULL);
        double d = run_logits(r, &R, NULL, NULL, 3u + (unsigned)fi);
        fprintf(stderr, "  %-26s max |logit - ref| = %.2e (tolerance %.2e)\n", FIXTURES[fi].name, d, R.tol);
        if (!(d <= R.tol)) test_fail(__FILE__, __LINE__, "%s: %g > %g", FIXTURES[fi].name, d, R.tol);
        model_runner_free(r);
        refs_free(&R);
    }
}

TEST(quant_formats_static_w8a8_match_fake_quant_refs) {
    for (int fi = 0; fi < N_FIXTURES; fi++) {
        if (FIXTURES[fi].act == WEIGHT_ACT_NONE) continue;
        const char *name = FIXTURES[fi].name;
        struct refs R, W;
        char rel[256];
        snprintf(rel, sizeof rel, "quant/%s/refs_w8a8.json", name);
        ASSERT_EQ(refs_load_rel(rel, &R, W8A8_RTOL, MARGIN_FACTOR), 0);
        snprintf(rel, sizeof rel, "quant/%s/refs.json", name);
        ASSERT_EQ(refs_load_rel(rel, &W, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct runner_options o = base_options(fixture_dir(name));
        o.quant_weight_only = false;
        struct model_runner *r = NULL;
        struct error err = {0};
        ASSERT_OK(model_runner_create(&o, &r, &err));
        double vs_w, d = run_logits(r, &R, &W, &vs_w, 17u + (unsigned)fi);
        fprintf(stderr, "  %-22s W8A8: max |logit - refs_w8a8| = %.2e (tolerance %.2e); vs weight-only %.3f\n", name, d,
                R.tol, vs_w);
        ASSERT_TRUE(d <= R.tol);
        // The activation rounding is there (INT8 per token moves these logits by only ~0.04, so 10x).
        ASSERT_TRUE(vs_w > 10 * R.tol && vs_w > 1000 * d);
        model_runner_free(r);
        refs_free(&R);
        refs_free(&W);
    }
}

// The loaded weights: GROUP rows over packed I32 with F32 zero points (GPTQ / AWQ / asymmetric
// compressed-tensors), a g_idx only for desc_act, static FP8 with its stored scale; nothing
// expanded (the weight bytes are the packed values plus F32 scales and zeros).
TEST(quant_formats_weights_as_loaded) {
    for (int fi = 0; fi < N_FIXTURES; fi++) {
        struct error e = {0};
        struct backend *b;
        struct backend_options bo = {.num_threads = 2};
        ASSERT_OK(backend_create("cpu", &bo, &b, &e));
        struct model_files *mf;
        ASSERT_OK(model_files_open(&mf, fixture_dir(FIXTURES[fi].name), &e));
        ASSERT_OK(model_quant_check(&mf->config, &e));
        struct model_load_options lo = {.files = mf, .weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_F32};
        struct model *m = NULL;
        ASSERT_OK(model_load(&m, b, &mf->config, &lo, &e));
        ASSERT_OK(model_files_check_consumed(mf, &e)); // every qweight / qzeros / scales / g_idx was read
        const struct model_layer *ly = &m->layers[0];
        const struct weight *ws[] = {&ly->attn.gqa.qkv, &ly->attn.gqa.o, &ly->ffn.dense.gate_up, &ly->ffn.dense.down};
        size_t qbytes = 0, f32bytes = 0;
        for (int i = 0; i < 4; i++) {
            const struct weight *w = ws[i];
            if (FIXTURES[fi].bits) {
                ASSERT_EQ(w->scheme, WEIGHT_SCHEME_GROUP);
                ASSERT_EQ(w->t.dtype, DTYPE_I32);
                ASSERT_EQ(w->bits, FIXTURES[fi].bits);
                ASSERT_EQ(w->zero.data != NULL, FIXTURES[fi].zero);
                ASSERT_EQ(w->gidx.data != NULL, FIXTURES[fi].gidx);
                ASSERT_EQ(w->act, FIXTURES[fi].act);
                if (w->zero.data) ASSERT_EQ(tensor_numel(&w->zero), tensor_numel(&w->scale));
                if (w->gidx.data) ASSERT_EQ(tensor_numel(&w->gidx), weight_cols(w));
            } else {
                ASSERT_EQ(w->t.dtype, DTYPE_FP8_E4M3);
                ASSERT_EQ(w->act, WEIGHT_ACT_FP8_STATIC);
            }
            if (weight_act_static(w->act)) {
                ASSERT_TRUE(w->act_scale > 0.0f && isfinite(w->act_scale));
            }
            qbytes += tensor_bytes(&w->t) + tensor_bytes(&w->scale) + (w->zero.data ? tensor_bytes(&w->zero) : 0) +
                      (w->gidx.data ? tensor_bytes(&w->gidx) : 0);
            f32bytes += (size_t)tensor_rows(&w->t) * (size_t)weight_cols(w) * 4;
        }
        // 4 bits: 1/8 of F32, 8 bits 1/4, plus F32 scales and zeros per group of 32 (+1/16) and g_idx.
        const double ratio = (double)qbytes / (double)f32bytes;
        fprintf(stderr, "  %-26s linear weights: %zu bytes, %.3f of F32\n", FIXTURES[fi].name, qbytes, ratio);
        ASSERT_TRUE(ratio < (FIXTURES[fi].bits == 4 ? 0.2 : 0.33));
        model_free(m);
        model_files_close(mf);
        backend_destroy(b);
    }
}

// ---------------------------------------------------------------------------------------------
// Op level

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) { // [-1, 1)
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static void *host_copy(struct backend *b, const void *src, size_t bytes) {
    void *p = b->ops->alloc(b, bytes);
    memcpy(p, src, bytes);
    return p;
}

// GROUP weight (rows x cols, bits, groups of g columns, or a random column -> group map with
// g-sized groups when `map`) with random zero points; dense = (q - z) * s in double.
struct gw {
    struct weight w;
    double *dense;
};

static struct gw make_group_weight(struct backend *b, int64_t rows, int64_t cols, int bits, int g, bool zeros,
                                   bool map) {
    struct gw q = {0};
    const int per = 32 / bits, off = 1 << (bits - 1);
    const int64_t G = (cols + g - 1) / g, words = cols / per;
    int32_t *gidx = malloc(sizeof(int32_t) * (size_t)cols);
    for (int64_t c = 0; c < cols; c++)
        gidx[c] = (int32_t)(c / g);
    if (map) // a random permutation of the contiguous map (act order)
        for (int64_t c = cols - 1; c > 0; c--) {
            int64_t j = (int64_t)((frand() + 1.0f) * 0.5f * (float)(c + 1)) % (c + 1);
            int32_t t = gidx[c];
            gidx[c] = gidx[j];
            gidx[j] = t;
        }
    float *s = malloc(sizeof(float) * (size_t)(rows * G)), *z = malloc(sizeof(float) * (size_t)(rows * G));
    for (int64_t i = 0; i < rows * G; i++) {
        s[i] = 0.01f + 0.02f * (frand() + 1.0f);
        z[i] = zeros ? (float)((int)((frand() + 1.0f) * 0.5f * (float)(2 * off)) - off) : 0.0f;
    }
    uint32_t *p = calloc((size_t)(rows * words), sizeof(uint32_t));
    q.dense = malloc(sizeof(double) * (size_t)(rows * cols));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            int v = (int)((frand() + 1.0f) * 0.5f * (float)(2 * off)) & ((1 << bits) - 1);
            p[r * words + c / per] |= (uint32_t)v << (bits * (c % per));
            int64_t gi = gidx[c];
            q.dense[r * cols + c] = ((double)(v - off) - z[r * G + gi]) * s[r * G + gi];
        }
    q.w = (struct weight){
        .t = tensor_2d(host_copy(b, p, sizeof(uint32_t) * (size_t)(rows * words)), DTYPE_I32, rows, words),
        .scheme = WEIGHT_SCHEME_GROUP,
        .scale = tensor_2d(host_copy(b, s, sizeof(float) * (size_t)(rows * G)), DTYPE_F32, rows, G),
        .block_rows = 1,
        .block_cols = g,
        .bits = bits};
    if (zeros) q.w.zero = tensor_2d(host_copy(b, z, sizeof(float) * (size_t)(rows * G)), DTYPE_F32, rows, G);
    if (map)
        q.w.gidx = tensor_make(host_copy(b, gidx, sizeof(int32_t) * (size_t)cols), DTYPE_I32, 1, (int64_t[]){cols});
    free(p);
    free(s);
    free(z);
    free(gidx);
    return q;
}

static void free_group_weight(struct backend *b, struct gw *q) {
    b->ops->free(b, q->w.t.data);
    b->ops->free(b, q->w.scale.data);
    if (q->w.zero.data) b->ops->free(b, q->w.zero.data);
    if (q->w.gidx.data) b->ops->free(b, q->w.gidx.data);
    free(q->dense);
}

TEST(quant_group_zero_gidx_matmul_matches_definition) {
    struct error e = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_create("cpu", &bo, &b, &e));
    static const struct {
        int64_t m, k;
        int bits, g;
        bool zeros, map;
    } cases[] = {
        {41, 200, 4, 32, true, false},                                // a partial last group
        {64, 256, 4, 64, true, true},                                 // act order
        {19, 72, 4, 36, true, false},                                 // groups that split int32 words
        {37, 96, 8, 32, true, false},  {33, 128, 8, 128, true, true}, // one group (a trivial map of a channel weight)
        {24, 160, 8, 32, false, true},                                // a map without zero points
        {50, 64, 4, 64, true, false},                                 // per channel
    };
    const int ns[] = {1, 5, 21};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        struct gw q =
            make_group_weight(b, cases[ci].m, cases[ci].k, cases[ci].bits, cases[ci].g, cases[ci].zeros, cases[ci].map);
        const int64_t m = cases[ci].m, k = cases[ci].k;
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            const int n = ns[ni];
            float *x = malloc(sizeof(float) * (size_t)(n * k)), *y = malloc(sizeof(float) * (size_t)(n * m));
            for (int64_t i = 0; i < n * k; i++)
                x[i] = frand();
            struct tensor xt = tensor_2d(x, DTYPE_F32, n, k), yt = tensor_2d(y, DTYPE_F32, n, m);
            b->ops->matmul(b, &yt, &xt, &q.w, NULL);
            double worst = 0, scale = 0;
            for (int i = 0; i < n; i++)
                for (int64_t j = 0; j < m; j++) {
                    double ref = 0;
                    for (int64_t c = 0; c < k; c++)
                        ref += (double)x[i * k + c] * q.dense[j * k + c];
                    double d = fabs(ref - y[i * m + j]);
                    if (!(d <= worst)) worst = d;
                    if (fabs(ref) > scale) scale = fabs(ref);
                }
            if (!(worst <= 1e-5 * (1 + scale)))
                test_fail(__FILE__, __LINE__, "case %zu (%lldx%lld, %d bits, g %d, zeros %d, map %d) n=%d: error %g",
                          ci, (long long)m, (long long)k, cases[ci].bits, cases[ci].g, cases[ci].zeros, cases[ci].map,
                          n, worst);
            free(x);
            free(y);
        }
        free_group_weight(b, &q);
    }
    backend_destroy(b);
}

// Static activations: x quantized with the weight's act_scale (FP8: e4m3 of clamp(x / s); INT8:
// rint(x / s) clamped to [-128, 127]) for every row, against that definition computed here with
// an independent nearest-value search, over FP8 per-channel and INT8 GROUP weights.
static double e4m3_nearest(double v) {
    double best = 0, bd = INFINITY;
    int bm = 0;
    for (int bb = 0; bb < 256; bb++) {
        if ((bb & 0x7f) == 0x7f) continue;
        double f = fp8_e4m3_to_f32((uint8_t)bb), d = fabs(f - v);
        if (d < bd || (d == bd && (bb & 1) == 0 && (bm & 1))) bd = d, best = f, bm = bb;
    }
    return best;
}

TEST(quant_static_activation_matmul_matches_definition) {
    struct error e = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_create("cpu", &bo, &b, &e));
    for (int int8 = 0; int8 < 2; int8++) {
        const int64_t m = 29, k = 96;
        struct gw q = make_group_weight(b, m, k, 8, 32, true, false);
        q.w.act = int8 ? WEIGHT_ACT_INT8_STATIC : WEIGHT_ACT_FP8_STATIC;
        const float s = int8 ? 0.004f : 0.0011f; // saturates the larger inputs on purpose
        q.w.act_scale = s;
        for (int n = 1; n <= 12; n += 11) {
            float *x = malloc(sizeof(float) * (size_t)(n * k)), *y = malloc(sizeof(float) * (size_t)(n * m));
            for (int64_t i = 0; i < n * k; i++)
                x[i] = frand() * (i % 7 == 0 ? 1.5f : 0.3f);
            struct tensor xt = tensor_2d(x, DTYPE_F32, n, k), yt = tensor_2d(y, DTYPE_F32, n, m);
            b->ops->matmul(b, &yt, &xt, &q.w, NULL);
            double worst = 0, scale = 0, vs_plain = 0;
            int saturated = 0;
            for (int i = 0; i < n; i++)
                for (int64_t j = 0; j < m; j++) {
                    double ref = 0, plain = 0;
                    for (int64_t c = 0; c < k; c++) {
                        double v = (double)(x[i * k + c] / s), xq;
                        if (int8) {
                            xq = nearbyint(v);
                            xq = xq > 127 ? 127 : xq < -128 ? -128 : xq;
                        } else {
                            xq = e4m3_nearest(v > 448 ? 448 : v < -448 ? -448 : v);
                        }
                        if (j == 0 && fabs(v) > (int8 ? 127.5 : 464)) saturated++;
                        ref += xq * s * q.dense[j * k + c];
                        plain += (double)x[i * k + c] * q.dense[j * k + c];
                    }
                    worst = fmax(worst, fabs(ref - y[i * m + j]));
                    vs_plain = fmax(vs_plain, fabs(plain - y[i * m + j]));
                    scale = fmax(scale, fabs(ref));
                }
            fprintf(stderr, "  static %s n=%d: max error %.2e (scale %.2f), vs unquantized x %.2e, %d saturated\n",
                    int8 ? "int8" : "fp8", n, worst, scale, vs_plain, saturated);
            ASSERT_TRUE(worst <= 1e-5 * (1 + scale));
            ASSERT_TRUE(saturated > 0 && vs_plain > 100 * worst);
            free(x);
            free(y);
        }
        free_group_weight(b, &q);
    }
    backend_destroy(b);
}

// ---------------------------------------------------------------------------------------------
// Refusals

static void copy_file(const char *src, const char *dst) {
    FILE *f = fopen(src, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) abort();
    fclose(f);
    test_write_file(dst, buf, (size_t)n);
    free(buf);
}

// A copy of fixture `name` as `as` with one exact substring of config.json replaced (if set).
static const char *mutant(const char *name, const char *as, const char *from, const char *to) {
    static char dir[600];
    snprintf(dir, sizeof dir, "%s", test_tmp_path(as));
    mkdir(dir, 0755);
    char src[4200], dst[700];
    snprintf(src, sizeof src, "%s/model.safetensors", fixture_dir(name));
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    copy_file(src, dst);
    snprintf(src, sizeof src, "%s/config.json", fixture_dir(name));
    FILE *f = fopen(src, "rb");
    if (!f) abort();
    char *json = calloc(1, 1 << 16);
    size_t n = fread(json, 1, (1 << 16) - 1, f);
    fclose(f);
    char *out = calloc(1, (1 << 16) + 1024);
    char *p = from ? strstr(json, from) : NULL;
    if (from && !p) {
        fprintf(stderr, "mutant: '%s' not in %s (%zu bytes)\n", from, src, n);
        abort();
    }
    if (p)
        sprintf(out, "%.*s%s%s", (int)(p - json), json, to, p + strlen(from));
    else
        strcpy(out, json);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    test_write_file(dst, out, strlen(out));
    free(json);
    free(out);
    return dir;
}

// Rewrites dir/model.safetensors with tensor `name`'s data replaced by `bytes` (same size), or
// the tensor dropped (bytes NULL).
static void edit_tensor_data(const char *dir, const char *name, const void *bytes) {
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct safetensors_file *f;
    struct error e = {0};
    if (safetensors_open(&f, path, &e) != ATOMC_OK) abort();
    json_t *h = json_object();
    uint64_t end = 0, hb = 0, he = 0;
    bool found = false;
    for (size_t i = 0; i < f->n_tensors; i++) {
        const struct safetensors_tensor *t = &f->tensors[i];
        if (t->end > end) end = t->end;
        if (!strcmp(t->name, name)) {
            found = true, hb = t->begin, he = t->end;
            if (!bytes) continue;
        }
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->ne[d]));
        json_object_set_new(h, t->name,
                            json_pack("{s:s, s:o, s:[I, I]}", "dtype", t->dtype_name, "shape", shape, "data_offsets",
                                      (json_int_t)t->begin, (json_int_t)t->end));
    }
    if (!found) abort();
    char *hs = json_dumps(h, JSON_COMPACT);
    size_t hl = strlen(hs), padded = (hl + 7) / 8 * 8, total = 8 + padded + (size_t)end;
    unsigned char *out = calloc(1, total);
    for (int k = 0; k < 8; k++)
        out[k] = (unsigned char)((uint64_t)padded >> (8 * k));
    memcpy(out + 8, hs, hl);
    memset(out + 8 + hl, ' ', padded - hl);
    memcpy(out + 8 + padded, f->data + 8 + f->header_len, (size_t)end);
    if (bytes) memcpy(out + 8 + padded + hb, bytes, (size_t)(he - hb));
    safetensors_close(f);
    test_write_file(path, out, total);
    free(out);
    free(hs);
    json_decref(h);
}

// The stored bytes of tensor `name` of fixture dir (malloc'd) and their count.
static void *tensor_bytes_of(const char *dir, const char *name, size_t *n) {
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct safetensors_file *f;
    struct error e = {0};
    if (safetensors_open(&f, path, &e) != ATOMC_OK) abort();
    void *out = NULL;
    for (size_t i = 0; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, name)) {
            *n = (size_t)(f->tensors[i].end - f->tensors[i].begin);
            out = malloc(*n);
            memcpy(out, f->data + 8 + f->header_len + f->tensors[i].begin, *n);
        }
    safetensors_close(f);
    if (!out) abort();
    return out;
}

static atomc_status try_load(const char *dir, struct error *e) {
    struct runner_options o = base_options(dir);
    o.quant_weight_only = false;
    struct model_runner *r = NULL;
    *e = (struct error){0};
    atomc_status st = model_runner_create(&o, &r, e);
    if (r) model_runner_free(r);
    fprintf(stderr, "  %s: %s\n", strrchr(dir, '/') + 1, st == ATOMC_OK ? "loads" : e->msg);
    return st;
}

TEST(quant_formats_unimplemented_variants_refused_by_name) {
    struct error e = {0};
    const char *d;
    d = mutant("gptq_w4_g32_sym", "g_bits3", "\"bits\": 4", "\"bits\": 3");
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'gptq'") && has(e.msg, "int3"));
    d = mutant("awq_w4_g32", "a_gemv", "\"version\": \"gemm\"", "\"version\": \"gemv\"");
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "format gemv"));
    d = mutant("awq_w4_g32", "a_nozero", "\"zero_point\": true", "\"zero_point\": false");
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'awq'"));
    // A compressed-tensors kv_cache_scheme without its per-layer k_scale / v_scale tensors is refused
    // (the scheme itself is implemented: tests/test_quant_kv.c; other forms of it are refused there).
    d = mutant("ct_fp8_static_tensor", "c_kv", "\"kv_cache_scheme\": null",
               "\"kv_cache_scheme\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": "
               "false, \"symmetric\": true}");
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "kv_cache_scheme") && has(e.msg, "layer 0 has no model.layers.0.self_attn.k_scale"));
    // desc_act without g_idx; a g_idx out of range; q / k / v maps that differ.
    d = mutant("gptq_w4_g32_asym_desc_act", "g_noidx", NULL, NULL);
    edit_tensor_data(d, "model.layers.0.self_attn.k_proj.g_idx", NULL);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "desc_act") && has(e.msg, "k_proj.g_idx is missing"));
    size_t n;
    int32_t *g = tensor_bytes_of(fixture_dir("gptq_w4_g32_asym_desc_act"), "model.layers.0.self_attn.k_proj.g_idx", &n);
    d = mutant("gptq_w4_g32_asym_desc_act", "g_range", NULL, NULL);
    int32_t keep = g[5];
    g[5] = 2; // hidden 64, groups of 32: 0 or 1
    edit_tensor_data(d, "model.layers.0.self_attn.k_proj.g_idx", g);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "k_proj.g_idx: column 5's group 2 is outside [0, 2)"));
    g[5] = keep;
    int32_t t = g[0];
    for (size_t i = 0; i + 1 < n / 4; i++)
        if (g[i] != t) { // swap two columns of different groups
            g[0] = g[i], g[i] = t;
            break;
        }
    d = mutant("gptq_w4_g32_asym_desc_act", "g_differ", NULL, NULL);
    edit_tensor_data(d, "model.layers.0.self_attn.k_proj.g_idx", g);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "k_proj.weight's column -> group map (g_idx) differs"));
    free(g);
    // Static input scales of fused parts (q / k / v) that differ.
    float *s = tensor_bytes_of(fixture_dir("fp8_static"), "model.layers.0.self_attn.v_proj.input_scale", &n);
    ASSERT_EQ(n, sizeof(float));
    s[0] *= 2.0f;
    d = mutant("fp8_static", "s_differ", NULL, NULL);
    edit_tensor_data(d, "model.layers.0.self_attn.v_proj.input_scale", s);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "v_proj.weight's static input scale"));
    s[0] = -1.0f;
    d = mutant("fp8_static", "s_negative", NULL, NULL);
    edit_tensor_data(d, "model.layers.0.mlp.down_proj.input_scale", s);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "down_proj.input_scale: the input scale -1 is not a positive finite number"));
    free(s);
    d = mutant("fp8_static", "s_missing", NULL, NULL);
    edit_tensor_data(d, "model.layers.0.self_attn.o_proj.input_scale", NULL);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(has(e.msg, "o_proj.input_scale"));
    // Asymmetric compressed-tensors without its zero points.
    d = mutant("ct_w4a16_asym_group32", "c_nozp", NULL, NULL);
    edit_tensor_data(d, "model.layers.0.mlp.down_proj.weight_zero_point", NULL);
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(has(e.msg, "down_proj.weight_zero_point"));
    // Zero points stored for a symmetric config are never read: refused by name.
    d = mutant("ct_w4a16_asym_group32", "c_symzp", "\"symmetric\": false", "\"symmetric\": true");
    ASSERT_EQ(try_load(d, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "weight_zero_point' (I32) is never read"));
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
