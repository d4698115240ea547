// The quantised-weight decode kernels of the CPU backend (cpu_kernels_xq.c) against a
// dequantise-then-F32 reference, for every block type, the portable and the run-time selected
// (AVX2) implementation, odd sizes.
//
// Tolerance (stated in cpu_kernels_xq.c): activations are rounded to int16 per block of 32 with
// d = max|x_b| / 32767, so |out - dot(x, dequant(w))| <= sum_b d_b / 2 * sum_{i in b} |w_i|, plus
// fp32 rounding (1e-5 of sum |x_i w_i|). Every output is checked against that bound in double
// precision; the bound is tight enough that a wrong nibble order or scale fails it by orders of
// magnitude.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"
#include "loader/gguf.h"
#include "test.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_u64(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rng_uniform(void) {
    return (float)((rng_u64() >> 40) * (1.0 / 16777216.0));
}
static float rng_sym(void) {
    return 2.0f * rng_uniform() - 1.0f;
}

static void put_f16(unsigned char *p, float v) {
    uint16_t h = f32_to_f16(v);
    memcpy(p, &h, 2);
}

// Random weight blocks of a GGUF block type: random quant (and sub-block scale) bytes, sane
// f16 / f32 block scales.
static void make_blocks(enum dtype dt, void *dst, int64_t n_elems) {
    unsigned char *p = dst;
    size_t bb = dtype_block_bytes(dt);
    int be = dtype_block_elems(dt);
    for (int64_t i = 0; i < n_elems / be; i++) {
        unsigned char *blk = p + i * bb;
        for (size_t j = 0; j < bb; j++)
            blk[j] = (unsigned char)rng_u64();
        switch (dt) {
        case DTYPE_Q4_1:
            put_f16(blk, 0.002f + 0.05f * rng_uniform());
            put_f16(blk + 2, -0.3f * rng_uniform());
            break;
        case DTYPE_Q4_K:
        case DTYPE_Q5_K:
            put_f16(blk, 0.0005f + 0.003f * rng_uniform());
            put_f16(blk + 2, 0.0005f + 0.003f * rng_uniform());
            break;
        case DTYPE_Q6_K:
            put_f16(blk + 208, 0.0005f + 0.003f * rng_uniform());
            break;
        case DTYPE_Q8_K: {
            float d = 0.0005f + 0.003f * rng_uniform();
            memcpy(blk, &d, 4);
            break;
        }
        default:
            put_f16(blk, 0.002f + 0.05f * rng_uniform());
            break;
        }
    }
}

static int weight_kind(enum dtype t) {
    switch (t) {
    case DTYPE_Q8_0:
        return CPU_WEIGHT_Q8_0;
    case DTYPE_Q4_0:
        return CPU_WEIGHT_Q4_0;
    case DTYPE_Q4_1:
        return CPU_WEIGHT_Q4_1;
    case DTYPE_Q4_K:
        return CPU_WEIGHT_Q4_K;
    case DTYPE_Q5_K:
        return CPU_WEIGHT_Q5_K;
    case DTYPE_Q6_K:
        return CPU_WEIGHT_Q6_K;
    case DTYPE_Q8_K:
        return CPU_WEIGHT_Q8_K;
    default:
        return -1;
    }
}

// x rows with a spread of magnitudes (some blocks tiny, one all zero) so per-block scales matter.
static void make_x(float *x, int nx, int64_t k) {
    for (int i = 0; i < nx; i++)
        for (int64_t t = 0; t < k; t++) {
            int64_t b = t / 32;
            float scale = b % 5 == 3 ? 0.0f : (b % 3 == 1 ? 0.01f : 2.0f);
            x[i * k + t] = rng_sym() * scale;
        }
}

static const enum dtype QTYPES[] = {DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_Q8_K};
#define N_QTYPES ((int)(sizeof QTYPES / sizeof QTYPES[0]))

// Checks one kernel set on (nx, k, m) with output columns [j0, j1): bound per output, columns
// outside the range untouched.
static void check_gemv_xq(const struct cpu_kernels *K, enum dtype qt, int nx, int64_t k, int64_t m, int64_t j0,
                          int64_t j1, int with_bias, double *worst_ratio) {
    const int wk = weight_kind(qt);
    const int64_t nb = k / 32;
    size_t rb = dtype_row_bytes(qt, k);
    uint8_t *w = malloc(rb * (size_t)m);
    make_blocks(qt, w, m * k);
    float *wf = malloc(sizeof(float) * (size_t)(m * k)), *x = malloc(sizeof(float) * (size_t)(nx * k));
    dtype_to_f32(qt, w, wf, m * k);
    make_x(x, nx, k);
    float *bias = NULL;
    if (with_bias) {
        bias = malloc(sizeof(float) * (size_t)m);
        for (int64_t j = 0; j < m; j++)
            bias[j] = rng_sym();
    }
    struct cpu_xq_block *xq = malloc(sizeof *xq * (size_t)(nx * nb));
    for (int i = 0; i < nx; i++)
        K->quantize_xq(xq + i * nb, x + i * k, k);
    float *out = malloc(sizeof(float) * (size_t)(nx * m));
    for (int64_t i = 0; i < nx * m; i++)
        out[i] = -12345.0f;
    K->gemv_xq[wk](out, m, xq, nb, nx, w, bias, k, k, j0, j1);
    for (int i = 0; i < nx; i++)
        for (int64_t j = 0; j < m; j++) {
            float got = out[i * m + j];
            if (j < j0 || j >= j1) {
                if (got != -12345.0f) {
                    test_fail(__FILE__, __LINE__, "%s %s: column %lld outside [%lld, %lld) written", K->xq_name,
                              dtype_name(qt), (long long)j, (long long)j0, (long long)j1);
                    goto done;
                }
                continue;
            }
            double ref = bias ? bias[j] : 0.0, bound = 0.0, mag = 0.0;
            for (int64_t b = 0; b < nb; b++) {
                double amax = 0.0, wsum = 0.0;
                for (int t = 0; t < 32; t++) {
                    double xv = x[i * k + b * 32 + t], wv = wf[j * k + b * 32 + t];
                    ref += xv * wv;
                    mag += fabs(xv * wv);
                    wsum += fabs(wv);
                    if (fabs(xv) > amax) amax = fabs(xv);
                }
                bound += amax / 65534.0 * wsum * (1.0 + 1e-4);
            }
            bound += 1e-5 * (mag + (bias ? fabs(bias[j]) : 0.0)) + 1e-6;
            double e = fabs((double)got - ref);
            if (!(e <= bound)) {
                test_fail(__FILE__, __LINE__,
                          "%s %s nx %d k %lld row %d col %lld: %g vs reference %g (error %g > bound %g)", K->xq_name,
                          dtype_name(qt), nx, (long long)k, i, (long long)j, got, ref, e, bound);
                goto done;
            }
            if (bound > 0 && e / bound > *worst_ratio) *worst_ratio = e / bound;
        }
done:
    free(w);
    free(wf);
    free(x);
    free(bias);
    free(xq);
    free(out);
}

static void kernel_sets(struct cpu_kernels *gen, struct cpu_kernels *sel) {
    memset(gen, 0, sizeof *gen);
    gen->name = gen->xq_name = "generic";
    cpu_kernels_xq_generic(gen);
    cpu_kernels_select(sel);
}

// The AVX2 set where AVX-512 replaced some of its kernels in the selected one (else NULL name).
static void kernel_set_avx2(const struct cpu_kernels *sel, struct cpu_kernels *k) {
    *k = *sel;
    if (strcmp(sel->xq_name, "avx512")) {
        k->xq_name = NULL;
        return;
    }
    cpu_kernels_xq_avx2(k);
    k->xq_name = "avx2";
}

TEST(cpu_quant_xq_kernels_within_bound_odd_sizes) {
    struct cpu_kernels kg, ks, k2;
    kernel_sets(&kg, &ks);
    kernel_set_avx2(&ks, &k2);
    const struct cpu_kernels *sets[3] = {&kg, &ks, &k2};
    const int nsets = k2.xq_name ? 3 : 2;
    const int64_t ks_[] = {32, 96, 256, 576, 768, 1536};
    const int64_t ms[] = {1, 7, 301};
    const int nxs[] = {1, 2, 3, 4, 5, 8};
    int checked = 0;
    for (int si = 0; si < nsets; si++)
        for (int qi = 0; qi < N_QTYPES; qi++) {
            double worst = 0.0;
            for (size_t a = 0; a < sizeof ks_ / sizeof ks_[0]; a++)
                for (size_t b = 0; b < sizeof ms / sizeof ms[0]; b++)
                    if (ks_[a] % dtype_block_elems(QTYPES[qi]) == 0)
                        for (size_t c = 0; c < sizeof nxs / sizeof nxs[0]; c++) {
                            int64_t m = ms[b], j0 = m > 2 ? 1 : 0, j1 = m > 2 ? m - 1 : m;
                            check_gemv_xq(sets[si], QTYPES[qi], nxs[c], ks_[a], m, j0, j1, (int)(c & 1), &worst);
                            if (test_failed_now()) return;
                            checked++;
                        }
            fprintf(stderr, "  %-7s %s: worst error / bound = %.3f\n", sets[si]->xq_name, dtype_name(QTYPES[qi]), worst);
            ASSERT_TRUE(worst > 1e-3); // the bound is not vacuous: errors are a visible fraction of it
        }
    fprintf(stderr, "  selected kernels: %s (integer dots %s); %d shapes checked\n", ks.name, ks.xq_name, checked);
}

// quantize_xq: d = max|x| / 32767, q = round-to-nearest-even(x / d), s = d * sum(q); the portable
// and selected versions agree bit for bit, and a zero block gives d = 0, q = 0.
TEST(cpu_quant_xq_activation_quantisation) {
    struct cpu_kernels kg, ks;
    kernel_sets(&kg, &ks);
    const int64_t k = 32 * 37;
    float *x = malloc(sizeof(float) * k);
    make_x(x, 1, k);
    x[5] = 1e-30f; // denormal-ish values stay finite
    struct cpu_xq_block *a = malloc(sizeof *a * 37), *b = malloc(sizeof *b * 37);
    kg.quantize_xq(a, x, k);
    ks.quantize_xq(b, x, k);
    ASSERT_TRUE(memcmp(a, b, sizeof *a * 37) == 0);
    for (int blk = 0; blk < 37; blk++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(x[blk * 32 + i]));
        ASSERT_TRUE(a[blk].d == amax / 32767.0f);
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            float id = a[blk].d > 0 ? 1.0f / a[blk].d : 0.0f;
            ASSERT_EQ(a[blk].q[i], (int)lrintf(x[blk * 32 + i] * id));
            ASSERT_TRUE(a[blk].q[i] >= -32767 && a[blk].q[i] <= 32767);
            sum += a[blk].q[i];
        }
        ASSERT_TRUE(a[blk].s == a[blk].d * (float)sum);
        if (amax == 0.0f) ASSERT_TRUE(a[blk].d == 0.0f && a[blk].s == 0.0f);
    }
    free(x);
    free(a);
    free(b);
}

// An output depends only on its (x row, weight row): not on how many rows a call computes (batch
// sizes 1..8) nor on the column range (how threads split the columns).
TEST(cpu_quant_xq_kernels_batch_and_split_invariant) {
    struct cpu_kernels ks;
    cpu_kernels_select(&ks);
    const int64_t k = 768, m = 203, nb = k / 32;
    for (int qi = 0; qi < N_QTYPES; qi++) {
        enum dtype qt = QTYPES[qi];
        int wk = weight_kind(qt);
        uint8_t *w = malloc(dtype_row_bytes(qt, k) * m);
        make_blocks(qt, w, m * k);
        float *x = malloc(sizeof(float) * 8 * k);
        make_x(x, 8, k);
        struct cpu_xq_block *xq = malloc(sizeof *xq * 8 * nb);
        for (int i = 0; i < 8; i++)
            ks.quantize_xq(xq + i * nb, x + i * k, k);
        float *all = malloc(sizeof(float) * 8 * m), *one = malloc(sizeof(float) * m);
        ks.gemv_xq[wk](all, m, xq, nb, 8, w, NULL, k, k, 0, m);
        for (int i = 0; i < 8; i++) {
            // row i alone, columns in three uneven pieces
            ks.gemv_xq[wk](one, m, xq + i * nb, nb, 1, w, NULL, k, k, 0, 5);
            ks.gemv_xq[wk](one, m, xq + i * nb, nb, 1, w, NULL, k, k, 5, 6);
            ks.gemv_xq[wk](one, m, xq + i * nb, nb, 1, w, NULL, k, k, 6, m);
            if (memcmp(one, all + i * m, sizeof(float) * m)) {
                test_fail(__FILE__, __LINE__, "%s %s row %d: alone differs from within a batch of 8", ks.xq_name,
                          dtype_name(qt), i);
                return;
            }
        }
        free(w);
        free(x);
        free(xq);
        free(all);
        free(one);
    }
}

// The backend's matmul takes the integer-dot path for quantised weights at decode sizes (n <= 8) and
// stays within the bound of the dequantised F32 matmul (int16 activations); backend_options.exact_kernels restores the exact
// kernels (bit-identical to the F32 expansion).
TEST(cpu_quant_backend_matmul_decode_path) {
    const int64_t k = 768, m = 301;
    for (int exact = 0; exact < 2; exact++) {
        struct backend_options bo = {.num_threads = 2, .kv_pool_bytes = 1 << 20, .exact_kernels = exact};
        struct backend *b = NULL;
        struct error err = {0};
        ASSERT_OK(backend_cpu_create(&bo, &b, &err));
        for (int qi = 0; qi < N_QTYPES; qi++) {
            enum dtype qt = QTYPES[qi];
            size_t qbytes = dtype_row_bytes(qt, k) * m;
            void *host = malloc(qbytes);
            make_blocks(qt, host, m * k);
            struct tensor src = tensor_2d(host, qt, m, k);
            struct tensor wq = tensor_2d(NULL, qt, m, k), wf = tensor_2d(NULL, DTYPE_F32, m, k);
            ASSERT_OK(b->ops->upload_weight(b, &wq, &src, &err));
            ASSERT_OK(b->ops->upload_weight(b, &wf, &src, &err));
            for (int n = 1; n <= 8; n += 3) {
                float *x = malloc(sizeof(float) * n * k), *oq = malloc(sizeof(float) * n * m),
                      *of = malloc(sizeof(float) * n * m);
                make_x(x, n, k);
                struct tensor tx = tensor_2d(x, DTYPE_F32, n, k), toq = tensor_2d(oq, DTYPE_F32, n, m),
                              tof = tensor_2d(of, DTYPE_F32, n, m);
                b->ops->matmul(b, &toq, &tx, WEIGHT_PLAIN(&wq), NULL);
                b->ops->matmul(b, &tof, &tx, WEIGHT_PLAIN(&wf), NULL);
                int same = memcmp(oq, of, sizeof(float) * n * m) == 0;
                if (exact) {
                    if (!same) test_fail(__FILE__, __LINE__, "%s n %d: exact path differs from F32", dtype_name(qt), n);
                } else {
                    if (same) test_fail(__FILE__, __LINE__, "%s n %d: integer path not taken", dtype_name(qt), n);
                    const float *wd = wf.data;
                    for (int i = 0; i < n; i++)
                        for (int64_t j = 0; j < m; j++) {
                            double bound = 1e-6, mag = 0.0;
                            for (int64_t bb = 0; bb < k / 32; bb++) {
                                double amax = 0, ws = 0;
                                for (int t = 0; t < 32; t++) {
                                    amax = fmax(amax, fabs(x[i * k + bb * 32 + t]));
                                    ws += fabs(wd[j * k + bb * 32 + t]);
                                    mag += fabs(x[i * k + bb * 32 + t] * wd[j * k + bb * 32 + t]);
                                }
                                bound += amax / 65534.0 * ws * (1.0 + 1e-4);
                            }
                            bound += 2e-5 * mag;
                            if (!(fabs((double)oq[i * m + j] - of[i * m + j]) <= bound)) {
                                test_fail(__FILE__, __LINE__, "%s n %d (%d, %lld): %g vs F32 %g beyond %g",
                                          dtype_name(qt), n, i, (long long)j, oq[i * m + j], of[i * m + j], bound);
                                i = n;
                                break;
                            }
                        }
                }
                free(x);
                free(oq);
                free(of);
            }
            free(host);
            b->ops->free(b, wq.data);
            b->ops->free(b, wf.data);
        }
        backend_destroy(b);
    }
}

// The K-quant decoders (dtype_to_f32) against gguf-py's dequantisation of random blocks
// (tests/fixtures/loader/kquants.gguf, tools/make_kquant_fixture.py), read through the GGUF
// loader, which must map the GGML type ids to the K dtypes.
TEST(cpu_quant_kquant_dequant_matches_gguf_py) {
    struct gguf_file *g = NULL;
    struct error err = {0};
    ASSERT_OK(gguf_open(&g, test_fixture("loader/kquants.gguf"), &err));
    const enum dtype kt[] = {DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_Q8_K};
    for (int i = 0; i < 4; i++) {
        char qn[32], rn[32];
        snprintf(qn, sizeof qn, "%s.q", dtype_name(kt[i]));
        snprintf(rn, sizeof rn, "%s.ref", dtype_name(kt[i]));
        const struct gguf_tensor_info *q = gguf_find_tensor(g, qn), *r = gguf_find_tensor(g, rn);
        ASSERT_TRUE(q && r && q->supported && r->supported);
        ASSERT_EQ(q->dtype, kt[i]);
        ASSERT_EQ(r->dtype, DTYPE_F32);
        int64_t n = q->ne[0] * q->ne[1];
        ASSERT_EQ(n, r->ne[0] * r->ne[1]);
        ASSERT_EQ(q->nbytes, dtype_row_bytes(kt[i], n));
        float *got = malloc(sizeof(float) * (size_t)n);
        dtype_to_f32(kt[i], q->data, got, n);
        const float *ref = r->data;
        int64_t bad = 0, nonzero = 0;
        for (int64_t e = 0; e < n; e++) {
            if (got[e] != ref[e]) bad++;
            if (ref[e] != 0.0f) nonzero++;
        }
        if (bad)
            test_fail(__FILE__, __LINE__, "%s: %lld of %lld elements differ from gguf-py", dtype_name(kt[i]),
                      (long long)bad, (long long)n);
        ASSERT_TRUE(nonzero > n / 2);
        free(got);
    }
    gguf_close(g);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}

// Attention's P @ V over a 16-bit V read in place (axpy_rows16, BF16 and F16) equals axpy_rows
// over the widened tile bit for bit, row by row, in the portable and the selected kernels; widths
// with and without a tail past the 8-lane groups, 1-9 rows.
TEST(cpu_kernels_axpy_rows16_equals_widened_axpy_rows) {
    struct cpu_kernels kg, ks;
    struct cpu_kernels *sets[2] = {&kg, &ks};
    cpu_kernels_select(&ks);
    kg = ks;
    setenv("ATOMC_CPU_KERNELS", "generic", 1);
    cpu_kernels_select(&kg);
    unsetenv("ATOMC_CPU_KERNELS");
    const enum dtype vdt[2] = {DTYPE_BF16, DTYPE_F16};
    const int64_t ns[] = {64, 80, 13, 8};
    const int nrs[] = {1, 3, 4, 9};
    const int nt = 11, vs = 100, ps = 16, ys = 96;
    uint16_t *v = malloc(sizeof(uint16_t) * nt * vs);
    float *vf = malloc(sizeof(float) * nt * vs), *p = malloc(sizeof(float) * 9 * ps);
    float *y0 = malloc(sizeof(float) * 9 * ys), *y1 = malloc(sizeof(float) * 9 * ys);
    for (int si = 0; si < 2; si++)
        for (int di = 0; di < 2; di++)
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                for (size_t c = 0; c < sizeof nrs / sizeof nrs[0]; c++) {
                    const struct cpu_kernels *K = sets[si];
                    for (int i = 0; i < nt * vs; i++) {
                        float f = rng_sym() * 3.0f;
                        v[i] = vdt[di] == DTYPE_BF16 ? f32_to_bf16(f) : f32_to_f16(f);
                    }
                    dtype_to_f32(vdt[di], v, vf, nt * vs);
                    for (int i = 0; i < 9 * ps; i++)
                        p[i] = rng_sym();
                    for (int i = 0; i < 9 * ys; i++)
                        y0[i] = y1[i] = rng_sym();
                    const int nr = nrs[c];
                    for (int r = 0; r < nr; r++)
                        K->axpy_rows(y0 + r * ys, p + r * ps, vf, vs, nt, ns[a]);
                    K->axpy_rows16[di](y1, ys, nr, p, ps, v, vs, nt, ns[a]);
                    if (memcmp(y0, y1, sizeof(float) * 9 * ys)) {
                        test_fail(__FILE__, __LINE__, "%s axpy_rows16 %s n %lld rows %d differs from axpy_rows",
                                  K->name, dtype_name(vdt[di]), (long long)ns[a], nr);
                        goto done;
                    }
                }
done:
    free(v);
    free(vf);
    free(p);
    free(y0);
    free(y1);
}
