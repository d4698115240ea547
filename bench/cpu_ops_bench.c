// Micro-benchmark of the CPU backend on a synthetic forward-like sequence of ops with
// SmolLM2-135M's shapes (hidden 576, 30 layers, 9 query / 3 kv heads of 64, MLP 1536,
// vocab 49152, F32 weights), plus a large sgemm for the machine's OpenBLAS peak.
//
//   make bench && build/bench/cpu_ops_bench [threads] [decode_steps] [prefill_tokens] [f32|bf16|f16|q8_0|q4_1]
//
// Prints per-op time and GFLOP/s (or GB/s for bandwidth-bound ops) for a batch-1 decode step
// at context ~256 and for one prefill step, then tokens/s of the synthetic decode.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/cpu/thread_pool.h"
#include "common/timeutil.h"

// Wall clock by default; with one thread, BENCH_CPU_TIME=1 times ops by the calling thread's
// CPU time instead, which a shared, oversubscribed machine does not inflate.
static int use_cpu_time;
static double bench_now(void) {
    if (!use_cpu_time) return time_now_s();
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

enum { HID = 576, LAYERS = 30, HQ = 9, HK = 3, HD = 64, FF = 1536, VOCAB = 49152, BS = 16 };

struct layer {
    struct tensor qkv, o, gu, down, n1, n2;
};

enum op_id { OP_NORM, OP_QKV, OP_ROPE, OP_ATTN, OP_O, OP_GU, OP_SILU, OP_DOWN, OP_HEAD, OP_SAMPLE, OP_COUNT };
static const char *op_names[OP_COUNT] = {"add_rmsnorm",    "matmul qkv", "rope_kv_write", "attention",      "matmul o",
                                         "matmul gate_up", "silu_mul",   "matmul down",   "matmul lm_head", "sample"};

static float *rand_buf(struct backend *b, size_t n, float scale, uint64_t *st) {
    float *p = b->ops->alloc(b, n * 4);
    for (size_t i = 0; i < n; i++) {
        *st = *st * 6364136223846793005ULL + 1442695040888963407ULL;
        p[i] = ((float)(*st >> 40) / 16777216.0f - 0.5f) * scale;
    }
    return p;
}

struct model {
    struct layer l[LAYERS];
    struct tensor embed, norm;
    struct kv_layer kv[LAYERS];
    float *inv_freq;
    int num_blocks;
};

// One forward over n tokens of one sequence whose context grows to ctx. Accumulates op times.
static void forward(struct backend *b, struct model *m, int n, int ctx, double *t_op, int32_t *ids_out) {
    const struct backend_ops *o = b->ops;
    static float *x, *h, *qkv, *att, *tmp, *gu, *act, *logits;
    static int cap;
    if (n > cap) {
        cap = n;
        x = realloc(x, (size_t)n * HID * 4);
        h = realloc(h, (size_t)n * HID * 4);
        qkv = realloc(qkv, (size_t)n * (HQ + 2 * HK) * HD * 4);
        att = realloc(att, (size_t)n * HQ * HD * 4);
        tmp = realloc(tmp, (size_t)n * HID * 4);
        gu = realloc(gu, (size_t)n * 2 * FF * 4);
        act = realloc(act, (size_t)n * FF * 4);
        logits = realloc(logits, (size_t)VOCAB * 4);
    }
    int32_t *pos = malloc(n * 4), *slot = malloc(n * 4), *ids = malloc(n * 4);
    int nb = (ctx + BS - 1) / BS;
    int32_t *bt = malloc(nb * 4), qs[2] = {0, n}, cl[1] = {ctx};
    for (int j = 0; j < nb; j++)
        bt[j] = (j * 7) % m->num_blocks; // scattered blocks
    for (int i = 0; i < n; i++) {
        pos[i] = ctx - n + i;
        slot[i] = bt[pos[i] / BS] * BS + pos[i] % BS;
        ids[i] = (i * 131) % VOCAB;
    }
    struct attn_metadata md = {.n_seqs = 1,
                               .n_tokens = n,
                               .max_query_len = n,
                               .max_context_len = ctx,
                               .max_blocks_per_seq = nb,
                               .block_size = BS,
                               .decode_only = n == 1,
                               .h_query_start = qs,
                               .h_context_lens = cl,
                               .h_block_tables = bt,
                               .h_positions = pos,
                               .h_slot_mapping = slot};
    struct tensor tx = tensor_2d(x, DTYPE_F32, n, HID), th = tensor_2d(h, DTYPE_F32, n, HID);
    struct tensor tqkv = tensor_2d(qkv, DTYPE_F32, n, (HQ + 2 * HK) * HD);
    struct tensor ttmp = tensor_2d(tmp, DTYPE_F32, n, HID), tgu = tensor_2d(gu, DTYPE_F32, n, 2 * FF);
    struct tensor tact = tensor_2d(act, DTYPE_F32, n, FF);
    int64_t qne[3] = {n, HQ, HD}, kne[3] = {n, HK, HD};
    struct tensor tq = tensor_make(qkv, DTYPE_F32, 3, qne), tk = tensor_make(qkv + HQ * HD, DTYPE_F32, 3, kne);
    struct tensor tv = tensor_make(qkv + (HQ + HK) * HD, DTYPE_F32, 3, kne);
    struct tensor tatt = tensor_make(att, DTYPE_F32, 3, qne), tatt2 = tensor_2d(att, DTYPE_F32, n, HQ * HD);
    struct rope_args rope = {.inv_freq = m->inv_freq, .rotary_dim = HD, .attn_factor = 1.0f, .interleaved = false};
    o->embedding(b, &tx, &m->embed, ids);
    memset(h, 0, (size_t)n * HID * 4);
    double t;
#define TIMED(id, call)                                                                                                \
    do {                                                                                                               \
        t = bench_now();                                                                                               \
        call;                                                                                                          \
        t_op[id] += bench_now() - t;                                                                                   \
    } while (0)
    for (int L = 0; L < LAYERS; L++) {
        struct layer *l = &m->l[L];
        TIMED(OP_NORM, o->add_rmsnorm(b, &ttmp, &th, &tx, &l->n1, 1e-5f));
        TIMED(OP_QKV, o->matmul(b, &tqkv, &ttmp, WEIGHT_PLAIN(&l->qkv), NULL));
        TIMED(OP_ROPE, o->rope_kv_write(b, &tq, &tk, &tv, (HQ + 2 * HK) * HD, &rope, &m->kv[L], &md));
        TIMED(OP_ATTN, o->attention(b, &tatt, &tq, (HQ + 2 * HK) * HD, &m->kv[L], &md, 0.125f, 0, NULL));
        TIMED(OP_O, o->matmul(b, &tx, &tatt2, WEIGHT_PLAIN(&l->o), NULL));
        TIMED(OP_NORM, o->add_rmsnorm(b, &ttmp, &th, &tx, &l->n2, 1e-5f));
        TIMED(OP_GU, o->matmul(b, &tgu, &ttmp, WEIGHT_PLAIN(&l->gu), NULL));
        TIMED(OP_SILU, o->silu_mul(b, &tact, &tgu));
        TIMED(OP_DOWN, o->matmul(b, &tx, &tact, WEIGHT_PLAIN(&l->down), NULL));
    }
    TIMED(OP_NORM, o->add_rmsnorm(b, &ttmp, &th, &tx, &m->norm, 1e-5f));
    struct tensor last = tensor_2d(tmp + (size_t)(n - 1) * HID, DTYPE_F32, 1, HID);
    struct tensor tl = tensor_2d(logits, DTYPE_F32, 1, VOCAB);
    TIMED(OP_HEAD, o->matmul(b, &tl, &last, WEIGHT_PLAIN(&m->embed), NULL));
    float temp = 0.8f, top_p = 0.95f, min_p = 0.0f, zero = 0.0f, one = 1.0f;
    int32_t top_k = 0;
    uint64_t seed = 1, step = (uint64_t)ctx;
    struct sample_args sa = {.n_rows = 1,
                             .vocab_size = VOCAB,
                             .logits = &tl,
                             .temperature = &temp,
                             .top_p = &top_p,
                             .top_k = &top_k,
                             .min_p = &min_p,
                             .presence_penalty = &zero,
                             .frequency_penalty = &zero,
                             .repetition_penalty = &one,
                             .seed = &seed,
                             .step = &step,
                             .out_ids = ids_out};
    TIMED(OP_SAMPLE, o->sample(b, &sa));
    free(pos);
    free(slot);
    free(ids);
    free(bt);
}

// FLOPs of each op for n tokens at context ctx (matmuls 2*n*m*k; attention 4*hq*hd per key).
static double op_flops(int id, int n, int ctx) {
    switch (id) {
    case OP_QKV:
        return 2.0 * n * HID * (HQ + 2 * HK) * HD * LAYERS;
    case OP_O:
        return 2.0 * n * HID * HQ * HD * LAYERS;
    case OP_GU:
        return 2.0 * n * HID * 2 * FF * LAYERS;
    case OP_DOWN:
        return 2.0 * n * FF * HID * LAYERS;
    case OP_HEAD:
        return 2.0 * HID * VOCAB;
    case OP_ATTN: {
        double keys = 0;
        for (int i = 0; i < n; i++)
            keys += ctx - n + i + 1;
        return 4.0 * HQ * HD * keys * LAYERS;
    }
    default:
        return 0;
    }
}

static void report(const char *what, double *t_op, int reps, int n, int ctx) {
    double total = 0;
    for (int i = 0; i < OP_COUNT; i++)
        total += t_op[i];
    printf("%s: %.2f ms per step (n=%d tokens, context %d)\n", what, 1e3 * total / reps, n, ctx);
    for (int i = 0; i < OP_COUNT; i++) {
        double f = op_flops(i, n, ctx);
        printf("  %-16s %8.3f ms %5.1f%%", op_names[i], 1e3 * t_op[i] / reps, 100 * t_op[i] / total);
        if (f > 0) printf("  %7.1f GFLOP/s", f * reps / t_op[i] / 1e9);
        printf("\n");
    }
}

// Memory read bandwidth: threads sum disjoint slices of a large array (the ceiling for a
// batch-1 decode, whose F32 weights stream from DRAM once per token).
struct bw_ctx {
    const float *a;
    int64_t per;
    double *sums;
};
#include <immintrin.h>
__attribute__((target("avx2"))) static void bw_read(void *vctx, int64_t b, int64_t e, int tid) {
    struct bw_ctx *c = vctx;
    for (int64_t part = b; part < e; part++) {
        const float *p = c->a + part * c->per;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < c->per; i += 32) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
            s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
            s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
        }
        float t[8];
        _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        c->sums[part] = (double)t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    }
}

static double read_bandwidth(int threads) {
    const int64_t n = (int64_t)1 << 27, parts = 64; // 512 MB
    float *a = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        a[i] = (float)(i & 7);
    double sums[64];
    struct bw_ctx c = {a, n / parts, sums};
    struct thread_pool *p;
    struct error err;
    if (thread_pool_create(threads, &p, &err) != ATOMC_OK) return 0;
    thread_pool_parallel_for(p, parts, 1, bw_read, &c);
    double best = 0;
    for (int r = 0; r < 3; r++) {
        double t0 = bench_now();
        thread_pool_parallel_for(p, parts, 1, bw_read, &c);
        double gbs = n * 4.0 / (bench_now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    thread_pool_free(p);
    free(a);
    return best;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    int steps = argc > 2 ? atoi(argv[2]) : 20;
    int prefill = argc > 3 ? atoi(argv[3]) : 256;
    enum dtype wdt = DTYPE_F32;
    if (argc > 4) {
        const char *names[] = {"f32", "bf16", "f16", "q8_0", "q4_0", "q4_1"};
        enum dtype dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1};
        for (int i = 0; i < 6; i++)
            if (!strcmp(argv[4], names[i])) wdt = dts[i];
    }
    struct backend_options bo = {.num_threads = threads};
    use_cpu_time = threads == 1 && getenv("BENCH_CPU_TIME") != NULL;
    if (use_cpu_time) printf("timing by thread CPU time\n");
    struct backend *b;
    struct error err;
    if (backend_cpu_create(&bo, &b, &err) != ATOMC_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("threads %d\n", b->num_threads);
    uint64_t st = 1;
    struct model m;
    m.num_blocks = (prefill + steps + 64) / BS + 8;
    for (int L = 0; L < LAYERS; L++) {
        struct layer *l = &m.l[L];
        l->qkv =
            tensor_2d(rand_buf(b, (size_t)(HQ + 2 * HK) * HD * HID, 0.1f, &st), DTYPE_F32, (HQ + 2 * HK) * HD, HID);
        l->o = tensor_2d(rand_buf(b, (size_t)HID * HQ * HD, 0.1f, &st), DTYPE_F32, HID, HQ * HD);
        l->gu = tensor_2d(rand_buf(b, (size_t)2 * FF * HID, 0.1f, &st), DTYPE_F32, 2 * FF, HID);
        l->down = tensor_2d(rand_buf(b, (size_t)HID * FF, 0.1f, &st), DTYPE_F32, HID, FF);
        l->n1 = tensor_2d(rand_buf(b, HID, 1.0f, &st), DTYPE_F32, 1, HID);
        l->n2 = tensor_2d(rand_buf(b, HID, 1.0f, &st), DTYPE_F32, 1, HID);
        int64_t kvne[4] = {m.num_blocks, BS, HK, HD};
        m.kv[L].k = tensor_make(b->ops->alloc(b, (size_t)m.num_blocks * BS * HK * HD * 4), DTYPE_F32, 4, kvne);
        m.kv[L].v = tensor_make(b->ops->alloc(b, (size_t)m.num_blocks * BS * HK * HD * 4), DTYPE_F32, 4, kvne);
        m.kv[L].k_scale = m.kv[L].v_scale = 1.0f;
    }
    m.embed = tensor_2d(rand_buf(b, (size_t)VOCAB * HID, 0.1f, &st), DTYPE_F32, VOCAB, HID);
    m.norm = tensor_2d(rand_buf(b, HID, 1.0f, &st), DTYPE_F32, 1, HID);
    if (wdt != DTYPE_F32) { // keep the matrices in the half dtype (fp32 compute)
        struct tensor *mats[4 * LAYERS + 1];
        int nm = 0;
        for (int L = 0; L < LAYERS; L++) {
            mats[nm++] = &m.l[L].qkv;
            mats[nm++] = &m.l[L].o;
            mats[nm++] = &m.l[L].gu;
            mats[nm++] = &m.l[L].down;
        }
        mats[nm++] = &m.embed;
        for (int i = 0; i < nm; i++) {
            struct tensor src = *mats[i], dst = *mats[i];
            dst.dtype = wdt;
            void *qbuf = NULL;
            if (dtype_block_elems(wdt) > 1) { // random blocks of the quantised type (scales ~0.01)
                size_t qb = tensor_bytes(&dst);
                qbuf = malloc(qb);
                uint8_t *q = qbuf;
                for (size_t j = 0; j < qb; j++) {
                    st = st * 6364136223846793005ULL + 1442695040888963407ULL;
                    q[j] = (uint8_t)(st >> 56);
                }
                size_t bb = dtype_block_bytes(wdt);
                for (size_t j = 0; j < qb; j += bb) {
                    uint16_t h = f32_to_f16(0.01f);
                    memcpy(q + j, &h, 2);
                    if (wdt == DTYPE_Q4_1) memcpy(q + j + 2, &h, 2);
                }
                b->ops->free(b, src.data);
                src.data = qbuf;
                src.dtype = wdt;
            }
            if (b->ops->upload_weight(b, &dst, &src, &err) != ATOMC_OK) {
                fprintf(stderr, "%s\n", err.msg);
                return 1;
            }
            if (qbuf)
                free(qbuf);
            else
                b->ops->free(b, src.data);
            *mats[i] = dst;
        }
        printf("weights %s\n", dtype_name(wdt));
    }
    m.inv_freq = malloc(HD / 2 * 4);
    for (int i = 0; i < HD / 2; i++)
        m.inv_freq[i] = powf(100000.0f, -2.0f * i / HD);

    double t_op[OP_COUNT] = {0};
    int32_t id;
    forward(b, &m, prefill, prefill, t_op, &id); // warm-up + fills the cache
    memset(t_op, 0, sizeof t_op);
    forward(b, &m, prefill, prefill, t_op, &id);
    report("prefill", t_op, 1, prefill, prefill);
    memset(t_op, 0, sizeof t_op);
    double t0 = bench_now();
    for (int s = 0; s < steps; s++)
        forward(b, &m, 1, prefill + 1 + s, t_op, &id);
    double dt = bench_now() - t0;
    report("decode", t_op, steps, 1, prefill + steps / 2);
    double wbytes =
        (double)dtype_block_bytes(wdt) / dtype_block_elems(wdt) *
        ((double)LAYERS * ((HQ + 2 * HK) * HD * HID + HID * HQ * HD + 3.0 * FF * HID) + (double)VOCAB * HID);
    printf("decode: %.1f tokens/s, weights %.0f MB/token -> %.1f GB/s effective\n", steps / dt, wbytes / 1e6,
           wbytes * steps / dt / 1e9);

    // OpenBLAS peak on this machine: a large square sgemm.
    int N = 1024;
    float *A = rand_buf(b, (size_t)N * N, 1.0f, &st), *B = rand_buf(b, (size_t)N * N, 1.0f, &st);
    float *C = b->ops->alloc(b, (size_t)N * N * 4);
    struct tensor ta = tensor_2d(A, DTYPE_F32, N, N), tb = tensor_2d(B, DTYPE_F32, N, N),
                  tc = tensor_2d(C, DTYPE_F32, N, N);
    b->ops->matmul(b, &tc, &ta, WEIGHT_PLAIN(&tb), NULL);
    t0 = bench_now();
    int reps = 5;
    for (int r = 0; r < reps; r++)
        b->ops->matmul(b, &tc, &ta, WEIGHT_PLAIN(&tb), NULL);
    dt = bench_now() - t0;
    printf("sgemm %dx%dx%d: %.1f GFLOP/s\n", N, N, N, 2.0 * N * N * N * reps / dt / 1e9);
    // The skinny (decode) matmul alone on the lm_head shape: weight bytes streamed per second.
    {
        float xv[HID], *lo = malloc((size_t)4 * VOCAB * 4), x4[4 * HID];
        for (int i = 0; i < HID; i++)
            xv[i] = 0.01f * (float)i;
        for (int i = 0; i < 4 * HID; i++)
            x4[i] = 0.01f * (float)(i % 97);
        for (int rows = 1; rows <= 8; rows *= 2) {
            struct tensor tx1 = tensor_2d(rows == 1 ? xv : x4, DTYPE_F32, rows > 4 ? 4 : rows, HID);
            float *xr = NULL;
            if (rows == 8) {
                xr = malloc((size_t)8 * HID * 4);
                for (int i = 0; i < 8 * HID; i++)
                    xr[i] = 0.01f * (float)(i % 89);
                tx1 = tensor_2d(xr, DTYPE_F32, 8, HID);
                lo = realloc(lo, (size_t)8 * VOCAB * 4);
            }
            struct tensor tlo = tensor_2d(lo, DTYPE_F32, tx1.ne[0], VOCAB);
            b->ops->matmul(b, &tlo, &tx1, WEIGHT_PLAIN(&m.embed), NULL);
            t0 = bench_now();
            for (int r = 0; r < 10; r++)
                b->ops->matmul(b, &tlo, &tx1, WEIGHT_PLAIN(&m.embed), NULL);
            dt = bench_now() - t0;
            printf("matmul (%lld x %d) @ (%d x %d)^T: %.2f ms, %.1f GB/s of weights\n", (long long)tx1.ne[0], HID,
                   VOCAB, HID, dt * 100,
                   10.0 * VOCAB * HID * dtype_block_bytes(wdt) / dtype_block_elems(wdt) / dt / 1e9);
            free(xr);
        }
        free(lo);
    }
    printf("memory read bandwidth (%d threads): %.1f GB/s\n", b->num_threads, read_bandwidth(b->num_threads));
    backend_destroy(b);
    return 0;
}
