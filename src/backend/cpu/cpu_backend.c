// The CPU backend: the reference implementation of every op of backend.h, multi-threaded
// over a persistent thread pool, fp32 activations and fp32 compute, GEMMs through OpenBLAS.
//
// Contracts beyond backend.h:
// - Memory is host memory, 64-byte aligned; copies are memmove. From 64 KiB (weights, the KV
//   pool, activations) it lives in 2 MiB-aligned mappings advised for transparent huge pages
//   (see "Memory"); smaller allocations come from posix_memalign.
// - Weights (matmul w/bias, embedding table, norm weights) may be F32 (weight_dtype, the
//   default), BF16 or F16, and matmul / embedding weights also Q8_0 / Q4_0 / Q4_1 kept from a
//   GGUF file; all are computed in fp32. See upload_weight.
// - Tensors passed to ops are dense row-major unless an op takes an explicit row stride.
// - out may alias x for rmsnorm, add and convert (F32); add_rmsnorm's out must not be residual.
// - Ops run one at a time per backend (op_lock) and may be called from any thread.
// - OpenBLAS threading is process-wide: create sets it to this backend's thread count once.
//   Our pool's workers sleep after a short spin, so they do not compete with OpenBLAS's.
#include "backend/cpu/cpu_backend.h"

#include <cblas.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/check.h"

// Below these sizes an op runs on the calling thread: waking workers costs more than it saves.
#define CPU_PAR_MIN_ELEMS 32768

static const struct backend_ops cpu_ops;

// ---------------------------------------------------------------------------------------------
// Memory

static void *cpu_aligned_alloc(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 64;
    bytes = (bytes + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, bytes) != 0) return NULL;
    return p;
}

// Weights and the KV pool are read once per decode step. On 4 KiB pages that is a TLB miss (a
// two-dimensional page walk under a hypervisor) every 4 KiB of the stream; in 2 MiB pages a
// batch-1 Q4_1 / Q8_0 matmul over 86 / 28 MB ran 25-30% faster on the dev VM (docs/perf.md).
// So backend memory of CPU_ARENA_MIN bytes or more lives in 2 MiB-aligned anonymous mappings
// with MADV_HUGEPAGE: transparent huge pages where the kernel's THP mode is "madvise" or
// "always", plain pages elsewhere (the advice is then ignored). An allocation of CPU_BIG_ALLOC
// or more gets a mapping of its own; smaller ones share CPU_ARENA_BYTES arenas (first fit,
// freed ranges merged with their neighbours, so the loader's upload-copy-free of fused parts
// reuses the same bytes). Below CPU_ARENA_MIN: posix_memalign.
#define CPU_HUGE_PAGE ((size_t)2 << 20)
#define CPU_BIG_ALLOC ((size_t)4 << 20)
#define CPU_ARENA_BYTES ((size_t)32 << 20)
#define CPU_ARENA_MIN ((size_t)64 << 10)
#define CPU_ARENA_HDR ((size_t)64) // keeps allocations 64-byte aligned

// A new chunk of at least `bytes` (rounded up to 2 MiB), linked into c->chunks; NULL when out
// of address space. Caller holds mem_lock.
static struct cpu_chunk *cpu_chunk_new(struct cpu_backend *c, size_t bytes, bool arena) {
    size_t size = (bytes + CPU_HUGE_PAGE - 1) / CPU_HUGE_PAGE * CPU_HUGE_PAGE;
    struct cpu_chunk *k = calloc(1, sizeof *k);
    struct cpu_range *r = arena ? calloc(1, sizeof *r) : NULL;
    if (!k || (arena && !r) || size < bytes) {
        free(k);
        free(r);
        return NULL;
    }
    char *raw = mmap(NULL, size + CPU_HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        free(k);
        free(r);
        return NULL;
    }
    char *base = (char *)(((uintptr_t)raw + CPU_HUGE_PAGE - 1) & ~(uintptr_t)(CPU_HUGE_PAGE - 1));
    char *end = raw + size + CPU_HUGE_PAGE;
    if (base > raw) munmap(raw, (size_t)(base - raw));
    if (base + size < end) munmap(base + size, (size_t)(end - (base + size)));
    (void)madvise(base, size, MADV_HUGEPAGE); // advice only: EINVAL where THP is compiled out
    k->base = base;
    k->size = size;
    k->arena = arena;
    if (r) {
        r->len = size;
        k->free = r;
    }
    k->next = c->chunks;
    c->chunks = k;
    return k;
}

// First fit of `need` bytes in arena k: the offset, or SIZE_MAX. Caller holds mem_lock.
static size_t cpu_arena_take(struct cpu_chunk *k, size_t need) {
    for (struct cpu_range **rp = &k->free; *rp; rp = &(*rp)->next) {
        struct cpu_range *r = *rp;
        if (r->len < need) continue;
        size_t off = r->off;
        r->off += need;
        r->len -= need;
        if (r->len == 0) {
            *rp = r->next;
            free(r);
        }
        return off;
    }
    return SIZE_MAX;
}

// Returns [off, off + len) to arena k's free list, merged with adjacent ranges; false when the
// list node cannot be allocated (the range then stays unused until the arena is unmapped).
static bool cpu_arena_give(struct cpu_chunk *k, size_t off, size_t len) {
    struct cpu_range **rp = &k->free, *prev = NULL;
    while (*rp && (*rp)->off < off) {
        prev = *rp;
        rp = &(*rp)->next;
    }
    struct cpu_range *next = *rp;
    CHECK_MSG(!next || off + len <= next->off, "cpu backend: freed range overlaps a free one");
    CHECK_MSG(!prev || prev->off + prev->len <= off, "cpu backend: freed range overlaps a free one");
    if (prev && prev->off + prev->len == off) {
        prev->len += len;
        if (next && prev->off + prev->len == next->off) {
            prev->len += next->len;
            prev->next = next->next;
            free(next);
        }
        return true;
    }
    if (next && off + len == next->off) {
        next->off = off;
        next->len += len;
        return true;
    }
    struct cpu_range *r = malloc(sizeof *r);
    if (!r) return false;
    *r = (struct cpu_range){off, len, next};
    *rp = r;
    return true;
}

static void *cpu_alloc(struct backend *b, size_t bytes) {
    if (bytes < CPU_ARENA_MIN) return cpu_aligned_alloc(bytes);
    struct cpu_backend *c = cpu_backend_of(b);
    void *p = NULL;
    pthread_mutex_lock(&c->mem_lock);
    if (bytes >= CPU_BIG_ALLOC) {
        struct cpu_chunk *k = cpu_chunk_new(c, bytes, false);
        if (k) {
            k->live = 1;
            p = k->base;
        }
    } else {
        const size_t need = ((bytes + 63) & ~(size_t)63) + CPU_ARENA_HDR;
        struct cpu_chunk *k = c->chunks;
        size_t off = SIZE_MAX;
        for (; k; k = k->next)
            if (k->arena && (off = cpu_arena_take(k, need)) != SIZE_MAX) break;
        if (!k && (k = cpu_chunk_new(c, CPU_ARENA_BYTES, true)) != NULL) off = cpu_arena_take(k, need);
        if (k && off != SIZE_MAX) {
            memcpy(k->base + off, &need, sizeof need);
            k->live++;
            p = k->base + off + CPU_ARENA_HDR;
        }
    }
    pthread_mutex_unlock(&c->mem_lock);
    return p;
}

static void cpu_free(struct backend *b, void *p) {
    if (!p) return;
    struct cpu_backend *c = cpu_backend_of(b);
    pthread_mutex_lock(&c->mem_lock);
    struct cpu_chunk **kp = &c->chunks;
    while (*kp && !((char *)p >= (*kp)->base && (char *)p < (*kp)->base + (*kp)->size))
        kp = &(*kp)->next;
    struct cpu_chunk *k = *kp;
    if (k) {
        CHECK_MSG(k->live > 0, "cpu backend: free of %p: its mapping has no live allocations", p);
        if (k->arena) {
            size_t off = (size_t)((char *)p - k->base) - CPU_ARENA_HDR, need;
            memcpy(&need, k->base + off, sizeof need);
            CHECK_MSG(need >= CPU_ARENA_HDR && off + need <= k->size, "cpu backend: free of %p: not an allocation", p);
            (void)cpu_arena_give(k, off, need);
        }
        if (--k->live == 0) {
            *kp = k->next;
            for (struct cpu_range *r = k->free, *n; r; r = n) {
                n = r->next;
                free(r);
            }
            munmap(k->base, k->size);
            free(k);
        }
    }
    pthread_mutex_unlock(&c->mem_lock);
    if (!k) free(p);
}
static void cpu_copy(struct backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) memmove(dst, src, bytes);
}
static void cpu_memset_zero(struct backend *b, void *dst, size_t bytes) {
    if (bytes) memset(dst, 0, bytes);
}
static void cpu_synchronize(struct backend *b) {}

static void cpu_memory_info(struct backend *b, size_t *free_bytes, size_t *total_bytes) {
    struct cpu_backend *c = cpu_backend_of(b);
    if (free_bytes) *free_bytes = c->kv_pool_bytes;
    if (total_bytes) *total_bytes = c->kv_pool_bytes;
}

void cpu_scratch_reserve(struct cpu_backend *c, size_t bytes) {
    if (bytes <= c->scratch_bytes) return;
    size_t want = bytes + bytes / 4; // headroom: shapes grow a little from step to step
    for (int i = 0; i < c->n_threads; i++) {
        free(c->scratch[i]);
        c->scratch[i] = cpu_aligned_alloc(want);
        CHECK_MSG(c->scratch[i] != NULL, "cpu backend: cannot allocate %zu bytes of scratch", want);
    }
    c->scratch_bytes = want;
}

void cpu_sample_hist_reserve(struct cpu_backend *c, size_t V) {
    if (V <= c->sample_hist_vocab) return;
    for (int i = 0; i < c->n_threads; i++) {
        free(c->sample_hist[i]);
        c->sample_hist[i] = calloc(V, sizeof(int32_t) + 1);
        CHECK_MSG(c->sample_hist[i] != NULL, "cpu backend: cannot allocate sampler counters for %zu tokens", V);
    }
    c->sample_hist_vocab = V;
}

void *cpu_shared_reserve(struct cpu_backend *c, size_t bytes) {
    if (bytes > c->shared_bytes) {
        size_t want = bytes + bytes / 4;
        free(c->shared);
        c->shared = cpu_aligned_alloc(want);
        CHECK_MSG(c->shared != NULL, "cpu backend: cannot allocate %zu bytes of scratch", want);
        c->shared_bytes = want;
    }
    return c->shared;
}

// Rows per chunk so that a chunk holds at least CPU_PAR_MIN_ELEMS / 4 elements.
static int64_t cpu_row_grain(int64_t cols) {
    int64_t g = (CPU_PAR_MIN_ELEMS / 4) / (cols > 0 ? cols : 1);
    return g < 1 ? 1 : g;
}

static void cpu_parallel_rows(struct cpu_backend *c, int64_t rows, int64_t cols, thread_pool_fn fn, void *ctx) {
    if (rows * cols < CPU_PAR_MIN_ELEMS)
        fn(ctx, 0, rows, 0);
    else
        thread_pool_parallel_for(c->pool, rows, cpu_row_grain(cols), fn, ctx);
}

// ---------------------------------------------------------------------------------------------
// The matmul kernel index of a weight dtype, or -1 when weights cannot have it.
static int cpu_weight_kind(enum dtype t) {
    switch (t) {
    case DTYPE_F32:
        return CPU_WEIGHT_F32;
    case DTYPE_BF16:
        return CPU_WEIGHT_BF16;
    case DTYPE_F16:
        return CPU_WEIGHT_F16;
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

// True for the dtypes weights may have on this backend (see upload_weight).
static bool cpu_weight_dtype_ok(enum dtype t) {
    return cpu_weight_kind(t) >= 0;
}

// A small weight vector (norm weight, bias) as F32: the tensor itself, or a conversion into
// `buf` (op-level scratch) for BF16/F16 weights.
static const float *cpu_weight_f32(const struct tensor *w, float *buf) {
    if (w->dtype == DTYPE_F32) return w->data;
    CHECK(cpu_weight_dtype_ok(w->dtype));
    dtype_to_f32(w->dtype, w->data, buf, tensor_numel(w));
    return buf;
}

// Weight upload: any host dtype -> F32, BF16 or F16, or a GGUF quant type kept as is (Q8_0 /
// Q4_0 / Q4_1 from the same type); the ops compute in fp32 over any of them. Conversions run in
// parallel row chunks; same-dtype uploads are copies. A BF16/F16 checkpoint kept in its dtype is
// lossless and halves the decode's memory traffic; a kept GGUF quant gives bit-identical
// results to dequantising at load (the kernels dequantise with the same arithmetic).

#define UPLOAD_PIECE 4096 // elements converted through the stack per step (a multiple of 32)

struct upload_ctx {
    const struct tensor *src;
    struct tensor *dst;
    int64_t cols;
};

static void upload_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct upload_ctx *u = vctx;
    const enum dtype st = u->src->dtype, dt = u->dst->dtype;
    const int be = dtype_block_elems(st);
    const size_t bb = dtype_block_bytes(st), de = dtype_block_bytes(dt);
    const bool scaled = st == DTYPE_FP8_E4M3 && u->src->scale != 1.0f;
    const int64_t e0 = r0 * u->cols, e1 = r1 * u->cols; // e0 is a multiple of be (whole-block rows)
    const uint8_t *s = u->src->data;
    uint8_t *d = u->dst->data;
    if (st == dt && !scaled) {
        memcpy(d + (size_t)(e0 / be) * bb, s + (size_t)(e0 / be) * bb, (size_t)((e1 - e0) / be) * bb);
        return;
    }
    float tmp[UPLOAD_PIECE];
    for (int64_t e = e0; e < e1; e += UPLOAD_PIECE) {
        int64_t n = e1 - e < UPLOAD_PIECE ? e1 - e : UPLOAD_PIECE;
        float *f = dt == DTYPE_F32 ? (float *)d + e : tmp;
        dtype_to_f32(st, s + (size_t)(e / be) * bb, f, n);
        if (scaled)
            for (int64_t i = 0; i < n; i++)
                f[i] *= u->src->scale;
        if (dt != DTYPE_F32) dtype_from_f32(dt, f, d + (size_t)e * de, n);
    }
}

static atomc_status cpu_upload_weight(struct backend *b, struct tensor *dst, const struct tensor *src,
                                      struct error *err) {
    struct cpu_backend *c = cpu_backend_of(b);
    if (!cpu_weight_dtype_ok(dst->dtype))
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "cpu backend: weights are stored as F32, BF16, F16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K "
                         "or Q8_K, not %s",
                         dtype_name(dst->dtype));
    if (dtype_block_elems(dst->dtype) > 1 && src->dtype != dst->dtype)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "cpu backend: %s weights can only be kept from %s data, not %s",
                         dtype_name(dst->dtype), dtype_name(dst->dtype), dtype_name(src->dtype));
    switch (src->dtype) {
    case DTYPE_F32:
    case DTYPE_F16:
    case DTYPE_BF16:
    case DTYPE_FP8_E4M3:
    case DTYPE_Q8_0:
    case DTYPE_Q4_0:
    case DTYPE_Q4_1:
    case DTYPE_Q4_K:
    case DTYPE_Q5_K:
    case DTYPE_Q6_K:
    case DTYPE_Q8_K:
        break;
    default:
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "cpu backend: cannot convert a %s tensor to %s weights",
                         dtype_name(src->dtype), dtype_name(dst->dtype));
    }
    if (src->ndim < 1 || dst->ndim < 1 || tensor_numel(src) != tensor_numel(dst))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "cpu backend: weight has %lld elements, destination expects %lld",
                         (long long)tensor_numel(src), (long long)tensor_numel(dst));
    int64_t cols = tensor_cols(src), rows = tensor_rows(src);
    if (cols % dtype_block_elems(src->dtype) != 0)
        return error_set(err, ATOMC_ERR_FORMAT, "cpu backend: %s row of %lld elements is not whole blocks",
                         dtype_name(src->dtype), (long long)cols);
    size_t bytes = dtype_row_bytes(dst->dtype, cols) * (size_t)rows;
    void *data = cpu_alloc(b, bytes);
    if (!data)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cpu backend: cannot allocate %zu bytes for a weight", bytes);
    struct tensor out = *dst;
    out.data = data;
    struct upload_ctx u = {src, &out, cols};
    cpu_lock(c);
    if (rows * cols < (1 << 20)) {
        upload_rows(&u, 0, rows, 0);
    } else {
        int64_t grain = (1 << 18) / cols;
        thread_pool_parallel_for(c->pool, rows, grain < 1 ? 1 : grain, upload_rows, &u);
    }
    cpu_unlock(c);
    dst->data = data;
    dst->scale = 1.0f;
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// Embedding, gather, convert, add

struct embed_ctx {
    float *out;
    const struct tensor *table;
    const int32_t *ids;
    int64_t d, vocab;
    size_t row_bytes;
};

static void embed_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct embed_ctx *e = vctx;
    for (int64_t r = r0; r < r1; r++) {
        int64_t id = e->ids[r];
        CHECK_MSG(id >= 0 && id < e->vocab, "embedding: token id %lld outside [0, %lld)", (long long)id,
                  (long long)e->vocab);
        dtype_to_f32(e->table->dtype, (const uint8_t *)e->table->data + (size_t)id * e->row_bytes, e->out + r * e->d,
                     e->d);
    }
}

static void cpu_embedding(struct backend *b, struct tensor *out, const struct tensor *table, const int32_t *ids) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && cpu_weight_dtype_ok(table->dtype) && table->ndim == 2);
    CHECK(tensor_cols(out) == tensor_cols(table));
    struct embed_ctx e = {out->data,          table,        ids,
                          tensor_cols(table), table->ne[0], dtype_row_bytes(table->dtype, tensor_cols(table))};
    cpu_lock(c);
    cpu_parallel_rows(c, tensor_rows(out), e.d, embed_rows, &e);
    cpu_unlock(c);
}

static void cpu_gather_rows(struct backend *b, struct tensor *out, const struct tensor *x, const int32_t *rows,
                            int n_rows) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == x->dtype && tensor_cols(out) == tensor_cols(x) && tensor_rows(out) >= n_rows);
    size_t rb = dtype_row_bytes(x->dtype, tensor_cols(x));
    int64_t xr = tensor_rows(x);
    cpu_lock(c);
    for (int i = 0; i < n_rows; i++) {
        CHECK_MSG(rows[i] >= 0 && rows[i] < xr, "gather_rows: row %d outside [0, %lld)", rows[i], (long long)xr);
        memcpy((uint8_t *)out->data + (size_t)i * rb, (const uint8_t *)x->data + (size_t)rows[i] * rb, rb);
    }
    cpu_unlock(c);
}

struct convert_ctx {
    float *out;
    const void *x;
    enum dtype dt;
    size_t esize;
};

static void convert_range(void *vctx, int64_t i0, int64_t i1, int tid) {
    struct convert_ctx *v = vctx;
    if (v->dt == DTYPE_F32 && (const void *)(v->out + i0) == (const void *)((const float *)v->x + i0)) return;
    dtype_to_f32(v->dt, (const uint8_t *)v->x + (size_t)i0 * v->esize, v->out + i0, i1 - i0);
}

static void cpu_convert(struct backend *b, struct tensor *out, const struct tensor *x) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && tensor_numel(out) == tensor_numel(x));
    CHECK(x->dtype == DTYPE_F32 || x->dtype == DTYPE_BF16 || x->dtype == DTYPE_F16);
    struct convert_ctx v = {out->data, x->data, x->dtype, dtype_block_bytes(x->dtype)};
    CHECK(x->dtype == DTYPE_F32 || (const void *)out->data != x->data);
    int64_t n = tensor_numel(x);
    cpu_lock(c);
    cpu_parallel_rows(c, n, 1, convert_range, &v); // elementwise: rows of one element
    cpu_unlock(c);
}

struct add_ctx {
    float *out;
    const float *x;
};

static void add_range(void *vctx, int64_t i0, int64_t i1, int tid) {
    struct add_ctx *a = vctx;
    float *restrict o = a->out;
    const float *restrict x = a->x;
    for (int64_t i = i0; i < i1; i++)
        o[i] += x[i];
}

static void cpu_add(struct backend *b, struct tensor *out, const struct tensor *x) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && tensor_numel(out) == tensor_numel(x));
    struct add_ctx a = {out->data, x->data};
    int64_t n = tensor_numel(out);
    cpu_lock(c);
    cpu_parallel_rows(c, n, 1, add_range, &a); // elementwise: rows of one element
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (+ residual add). Sum of squares in double: d is small next to the matmuls around it.

struct norm_ctx {
    float *out;
    float *residual; // add_rmsnorm only
    const float *x;  // may be NULL for add_rmsnorm
    const float *w;
    int64_t d;
    float eps;
};

// o may equal h (in place: rope_kv_write's q/k norm); each o[i] depends only on h[i] and the sum.
static inline void norm_row(float *o, const float *h, const float *restrict w, int64_t d, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < d; i++)
        ss += (double)h[i] * h[i];
    float inv = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    for (int64_t i = 0; i < d; i++)
        o[i] = h[i] * inv * w[i];
}

static void rmsnorm_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct norm_ctx *n = vctx;
    for (int64_t r = r0; r < r1; r++)
        norm_row(n->out + r * n->d, n->x + r * n->d, n->w, n->d, n->eps);
}

static void add_rmsnorm_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct norm_ctx *n = vctx;
    for (int64_t r = r0; r < r1; r++) {
        float *h = n->residual + r * n->d;
        if (n->x) {
            const float *x = n->x + r * n->d;
            for (int64_t i = 0; i < n->d; i++)
                h[i] += x[i];
        }
        norm_row(n->out + r * n->d, h, n->w, n->d, n->eps);
    }
}

static void cpu_rmsnorm(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *w,
                        float eps) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && cpu_weight_dtype_ok(w->dtype));
    int64_t d = tensor_cols(x);
    CHECK(tensor_numel(w) == d && tensor_numel(out) == tensor_numel(x));
    cpu_lock(c);
    const float *wf = cpu_weight_f32(w, cpu_shared_reserve(c, (size_t)d * sizeof(float)));
    struct norm_ctx n = {out->data, NULL, x->data, wf, d, eps};
    cpu_parallel_rows(c, tensor_rows(x), d, rmsnorm_rows, &n);
    cpu_unlock(c);
}

static void cpu_add_rmsnorm(struct backend *b, struct tensor *out, struct tensor *residual, const struct tensor *x,
                            const struct tensor *w, float eps) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && residual->dtype == DTYPE_F32 && cpu_weight_dtype_ok(w->dtype));
    CHECK(out->data != residual->data);
    int64_t d = tensor_cols(residual);
    CHECK(tensor_numel(w) == d && tensor_numel(out) == tensor_numel(residual));
    if (x) CHECK(x->dtype == DTYPE_F32 && tensor_numel(x) == tensor_numel(residual));
    cpu_lock(c);
    const float *wf = cpu_weight_f32(w, cpu_shared_reserve(c, (size_t)d * sizeof(float)));
    struct norm_ctx n = {out->data, residual->data, x ? x->data : NULL, wf, d, eps};
    cpu_parallel_rows(c, tensor_rows(residual), d, add_rmsnorm_rows, &n);
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// Matmul: out(n, m) = x(n, k) @ w(m, k)^T + bias, w in F32, BF16 or F16 (fp32 compute).
// Few rows (decode, n <= 8): our own skinny kernel, parallel over output columns, which streams
// each weight row once per group of up to 4 rows and converts BF16/F16 weights in registers
// (OpenBLAS's sgemm is slow at tiny n and its gemv cannot share the weight stream between rows).
// More rows: OpenBLAS sgemm, threaded by OpenBLAS; BF16/F16 weights are converted to F32 a tile
// of rows at a time (in parallel) into op scratch, one sgemm per tile.

#define MATMUL_SKINNY_MAX_ROWS 8
#define MATMUL_TILE_BYTES (4u << 20) // F32 weight tile of the half-weight sgemm path

struct gemv_ctx {
    const struct cpu_kernels *kern;
    int wk; // CPU_WEIGHT_*
    float *out;
    const float *x, *bias;
    const void *w;
    int nx;
    int64_t k, m;
};

// Output columns [j0, j1) for every row, in cache blocks of up to 64 rows x ~128 KB of weights
// (only the batch-invariant mode has more than 8 rows). Blocking changes no result: each output
// is one dot product in the kernel's fixed order.
static void gemv_cols(void *vctx, int64_t j0, int64_t j1, int tid) {
    struct gemv_ctx *g = vctx;
    // A multiple of 12 columns, so the kernels' 4- and 3-column steps leave no slow tails.
    int64_t jb = (int64_t)(131072 / ((size_t)g->k * 4)) / 12 * 12;
    if (jb < 12) jb = 12;
    for (int i0 = 0; i0 < g->nx; i0 += 64) {
        int ni = g->nx - i0 < 64 ? g->nx - i0 : 64;
        for (int64_t c0 = j0; c0 < j1; c0 += jb) {
            int64_t c1 = c0 + jb < j1 ? c0 + jb : j1;
            g->kern->gemv[g->wk](g->out + (int64_t)i0 * g->m, g->m, g->x + (int64_t)i0 * g->k, g->k, ni, g->w, g->bias,
                                 g->k, g->k, c0, c1);
        }
    }
}

// The int8-activation variant of gemv_cols (quantised weights, few rows): xq holds nx rows of
// k / 32 quantised blocks.
struct gemv_xq_ctx {
    const struct cpu_kernels *kern;
    int wk;
    enum dtype wdt;
    float *out;
    const struct cpu_xq_block *xq;
    const float *bias;
    const void *w;
    int nx;
    int64_t k, m;
};

// Columns in cache blocks of ~64 KB of quantised weights, so the second group of four rows
// (n > 4) finds them in L2; blocking changes no result (each output is one pair's dot).
static void gemv_xq_cols(void *vctx, int64_t j0, int64_t j1, int tid) {
    struct gemv_xq_ctx *g = vctx;
    const int64_t nb = g->k / 32;
    int64_t jb = (int64_t)(65536 / (dtype_row_bytes(g->wdt, g->k) + 1)) / 4 * 4;
    if (jb < 4) jb = 4;
    for (int64_t c0 = j0; c0 < j1; c0 += jb) {
        int64_t c1 = c0 + jb < j1 ? c0 + jb : j1;
        for (int i0 = 0; i0 < g->nx; i0 += 64) {
            int ni = g->nx - i0 < 64 ? g->nx - i0 : 64;
            g->kern->gemv_xq[g->wk](g->out + (int64_t)i0 * g->m, g->m, g->xq + (int64_t)i0 * nb, nb, ni, g->w,
                                    g->bias, g->k, g->k, c0, c1);
        }
    }
}

struct widen_ctx {
    const struct cpu_kernels *kern;
    int wk;
    const struct tensor *w;
    float *dst;
    int64_t row0, k;
};

static void widen_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct widen_ctx *v = vctx;
    size_t rb = dtype_row_bytes(v->w->dtype, v->k);
    v->kern->widen[v->wk](v->dst + r0 * v->k, (const uint8_t *)v->w->data + (size_t)(v->row0 + r0) * rb,
                          (r1 - r0) * v->k);
}

static void cpu_matmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *wq,
                       const struct tensor *bias) {
    struct cpu_backend *c = cpu_backend_of(b);
    if (wq->scheme != WEIGHT_SCHEME_NONE) { // quantized weights: cpu_qmatmul.c
        cpu_qmatmul(b, out, x, wq, bias);
        return;
    }
    const struct tensor *w = &wq->t;
    CHECK(out->dtype == DTYPE_F32 && x->dtype == DTYPE_F32 && cpu_weight_dtype_ok(w->dtype) && w->ndim == 2);
    int64_t n = tensor_rows(x), k = tensor_cols(x), m = w->ne[0];
    CHECK_MSG(w->ne[1] == k, "matmul: x has %lld columns, w has %lld", (long long)k, (long long)w->ne[1]);
    CHECK(tensor_cols(out) == m && tensor_rows(out) == n);
    if (bias) CHECK(cpu_weight_dtype_ok(bias->dtype) && tensor_numel(bias) == m);
    if (n == 0) return;
    float *o = out->data;
    const int wk = cpu_weight_kind(w->dtype);
    if (wk >= CPU_WEIGHT_Q8_0)
        CHECK_MSG(k % dtype_block_elems(w->dtype) == 0, "matmul: %s weights need k %% %d == 0", dtype_name(w->dtype),
                  dtype_block_elems(w->dtype));
    bool skinny = n <= MATMUL_SKINNY_MAX_ROWS || c->batch_invariant;
    // Op scratch: [bias as F32 (m) | F32 weight tile (half weights, sgemm path)].
    int64_t tile_rows = 0;
    size_t bias_bytes = bias && bias->dtype != DTYPE_F32 ? ((size_t)m * sizeof(float) + 63) & ~(size_t)63 : 0;
    if (!skinny && wk != CPU_WEIGHT_F32) {
        tile_rows = (int64_t)(MATMUL_TILE_BYTES / ((size_t)k * sizeof(float)));
        if (tile_rows < 16) tile_rows = 16;
        if (tile_rows > m) tile_rows = m;
    }
    cpu_lock(c);
    uint8_t *scr = cpu_shared_reserve(c, bias_bytes + (size_t)tile_rows * (size_t)k * sizeof(float) + 64);
    const float *bf = bias ? cpu_weight_f32(bias, (float *)scr) : NULL;
    // Quantised weights at decode sizes: int8 activations and integer dot products (not
    // bit-identical to the F32 path; see cpu_kernels_xq.c). backend_options.exact_kernels (--cpu-exact-kernels) keeps the exact
    // dequantise-in-registers kernels; prefill (sgemm over widened tiles) is always exact.
    const bool q8 = skinny && !c->exact_matmul && c->kern.gemv_xq[wk] != NULL;
    if (q8) {
        const int64_t nb = k / 32;
        size_t qbytes = (size_t)n * (size_t)nb * sizeof(struct cpu_xq_block);
        scr = cpu_shared_reserve(c, bias_bytes + qbytes + 64);
        bf = bias ? cpu_weight_f32(bias, (float *)scr) : NULL;
        struct cpu_xq_block *xq = (struct cpu_xq_block *)(scr + bias_bytes);
        const float *xf = x->data;
        for (int64_t i = 0; i < n; i++)
            c->kern.quantize_xq(xq + i * nb, xf + i * k, k);
        struct gemv_xq_ctx g = {&c->kern, wk, w->dtype, o, xq, bf, w->data, (int)n, k, m};
        int64_t grain = 16384 / (k > 0 ? k : 1);
        if (grain < 4) grain = 4;
        if (m * k * n < 65536)
            gemv_xq_cols(&g, 0, m, 0);
        else
            thread_pool_parallel_for(c->pool, m, grain, gemv_xq_cols, &g);
    } else if (skinny) {
        struct gemv_ctx g = {&c->kern, wk, o, x->data, bf, w->data, (int)n, k, m};
        int64_t grain = 16384 / (k > 0 ? k : 1); // >= 64 KB of F32 weights per chunk
        if (grain < 4) grain = 4;
        if (m * k * n < 65536)
            gemv_cols(&g, 0, m, 0);
        else
            thread_pool_parallel_for(c->pool, m, grain, gemv_cols, &g);
    } else {
        float beta = 0.0f;
        if (bf) {
            for (int64_t i = 0; i < n; i++)
                memcpy(o + i * m, bf, (size_t)m * sizeof(float));
            beta = 1.0f;
        }
        if (wk == CPU_WEIGHT_F32) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)m, (blasint)k, 1.0f, x->data,
                        (blasint)k, w->data, (blasint)k, beta, o, (blasint)m);
        } else {
            float *tile = (float *)(scr + bias_bytes);
            for (int64_t j0 = 0; j0 < m; j0 += tile_rows) {
                int64_t jn = m - j0 < tile_rows ? m - j0 : tile_rows;
                struct widen_ctx v = {&c->kern, wk, w, tile, j0, k};
                if (jn * k < CPU_PAR_MIN_ELEMS)
                    widen_rows(&v, 0, jn, 0);
                else
                    thread_pool_parallel_for(c->pool, jn, cpu_row_grain(k), widen_rows, &v);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)jn, (blasint)k, 1.0f, x->data,
                            (blasint)k, tile, (blasint)k, beta, o + j0, (blasint)m);
            }
        }
    }
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// SiLU * mul

struct silu_ctx {
    const struct cpu_kernels *kern;
    float *out;
    const float *gu;
    int64_t f;
};

static void silu_rows(void *vctx, int64_t r0, int64_t r1, int tid) {
    struct silu_ctx *s = vctx;
    for (int64_t r = r0; r < r1; r++) {
        const float *g = s->gu + r * 2 * s->f;
        s->kern->silu_mul(s->out + r * s->f, g, g + s->f, s->f);
    }
}

static void cpu_silu_mul(struct backend *b, struct tensor *out, const struct tensor *gate_up) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(out->dtype == DTYPE_F32 && gate_up->dtype == DTYPE_F32);
    int64_t f = tensor_cols(out), n = tensor_rows(out);
    CHECK(tensor_cols(gate_up) == 2 * f && tensor_rows(gate_up) == n);
    struct silu_ctx s = {&c->kern, out->data, gate_up->data, f};
    cpu_lock(c);
    cpu_parallel_rows(c, n, 2 * f, silu_rows, &s);
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// RoPE + KV-cache write

#define ROPE_MAX_HALF 1024

struct rope_ctx {
    float *q, *k;
    const float *v;
    const float *q_norm, *k_norm; // F32 weights or NULL
    float norm_eps;
    int64_t q_stride, k_stride, v_stride; // elements between consecutive tokens' rows
    int hq, hk, d, dv;
    const struct rope_args *rope;
    struct kv_layer *kv;
    const int32_t *positions, *slots;
    int64_t n_slots;
};

static inline void rope_head(float *x, const float *cs, const float *sn, int half, bool interleaved) {
    if (interleaved) {
        for (int i = 0; i < half; i++) {
            float x0 = x[2 * i], x1 = x[2 * i + 1];
            x[2 * i] = x0 * cs[i] - x1 * sn[i];
            x[2 * i + 1] = x1 * cs[i] + x0 * sn[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float x0 = x[i], x1 = x[i + half];
            x[i] = x0 * cs[i] - x1 * sn[i];
            x[i + half] = x1 * cs[i] + x0 * sn[i];
        }
    }
}

static void kv_store_row(const struct tensor *cache, float scale, int64_t elem_off, const float *src, int n) {
    switch (cache->dtype) {
    case DTYPE_F32:
        memcpy((float *)cache->data + elem_off, src, (size_t)n * sizeof(float));
        break;
    case DTYPE_BF16: {
        uint16_t *d = (uint16_t *)cache->data + elem_off;
        for (int i = 0; i < n; i++)
            d[i] = f32_to_bf16(src[i]);
        break;
    }
    case DTYPE_F16: { // saturated to +-65504 (an overflow must not put inf into the cache); NaN stays NaN
        uint16_t *d = (uint16_t *)cache->data + elem_off;
        for (int i = 0; i < n; i++) {
            float v = src[i];
            if (v > 65504.0f) v = 65504.0f;
            if (v < -65504.0f) v = -65504.0f;
            d[i] = f32_to_f16(v);
        }
        break;
    }
    case DTYPE_FP8_E4M3: {
        uint8_t *d = (uint8_t *)cache->data + elem_off;
        float inv = 1.0f / scale;
        for (int i = 0; i < n; i++)
            d[i] = f32_to_fp8_e4m3(src[i] * inv);
        break;
    }
    default:
        CHECK_MSG(0, "kv cache dtype %s not supported", dtype_name(cache->dtype));
    }
}

static void rope_rows(void *vctx, int64_t t0, int64_t t1, int tid) {
    struct rope_ctx *r = vctx;
    const int half = r->rope->rotary_dim / 2;
    float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    for (int64_t t = t0; t < t1; t++) {
        // Angles in fp32, as HF transformers computes them (inv_freq * position).
        float pos = (float)r->positions[t];
        for (int i = 0; i < half; i++) {
            float a = pos * r->rope->inv_freq[i];
            cs[i] = cosf(a) * r->rope->attn_factor;
            sn[i] = sinf(a) * r->rope->attn_factor;
        }
        if (r->q)
            for (int h = 0; h < r->hq; h++) {
                float *x = r->q + t * r->q_stride + (int64_t)h * r->d;
                if (r->q_norm) norm_row(x, x, r->q_norm, r->d, r->norm_eps);
                rope_head(x, cs, sn, half, r->rope->interleaved);
            }
        float *krow = r->k + t * r->k_stride;
        for (int h = 0; h < r->hk; h++) {
            float *x = krow + (int64_t)h * r->d;
            if (r->k_norm) norm_row(x, x, r->k_norm, r->d, r->norm_eps);
            rope_head(x, cs, sn, half, r->rope->interleaved);
        }
        int32_t slot = r->slots[t];
        if (slot < 0) continue;
        CHECK_MSG(slot < r->n_slots, "rope_kv_write: slot %d outside the cache (%lld slots)", slot,
                  (long long)r->n_slots);
        for (int h = 0; h < r->hk; h++) {
            kv_store_row(&r->kv->k, r->kv->k_scale, ((int64_t)slot * r->hk + h) * r->d, krow + (int64_t)h * r->d, r->d);
            kv_store_row(&r->kv->v, r->kv->v_scale, ((int64_t)slot * r->hk + h) * r->dv,
                         r->v + t * r->v_stride + (int64_t)h * r->dv, r->dv);
        }
    }
}

static void cpu_rope_kv_write(struct backend *b, struct tensor *q, struct tensor *k, const struct tensor *v,
                              int64_t row_stride, const struct rope_args *rope, struct kv_layer *kv,
                              const struct attn_metadata *md) {
    struct cpu_backend *c = cpu_backend_of(b);
    CHECK(k && v && kv && md && rope);
    CHECK(k->ndim == 3 && v->ndim == 3 && k->dtype == DTYPE_F32 && v->dtype == DTYPE_F32);
    CHECK(kv->k.ndim == 4 && kv->v.ndim == 4 && kv->k.dtype == kv->v.dtype);
    int64_t n = k->ne[0];
    int hk = (int)k->ne[1], d = (int)k->ne[2], dv = (int)v->ne[2];
    CHECK(v->ne[0] == n && v->ne[1] == hk && kv->k.ne[2] == hk && kv->k.ne[3] == d && kv->v.ne[3] == dv);
    CHECK(rope->rotary_dim >= 0 && rope->rotary_dim % 2 == 0 && rope->rotary_dim <= d &&
          rope->rotary_dim / 2 <= ROPE_MAX_HALF);
    if (kv->k.dtype == DTYPE_FP8_E4M3) CHECK(kv->k_scale > 0.0f && kv->v_scale > 0.0f);
    int hq = 0;
    if (q) {
        CHECK(q->ndim == 3 && q->dtype == DTYPE_F32 && q->ne[0] == n && q->ne[2] == d);
        hq = (int)q->ne[1];
    }
    struct rope_ctx r = {
        .q = q ? q->data : NULL,
        .k = k->data,
        .v = v->data,
        .q_stride = row_stride ? row_stride : (int64_t)hq * d,
        .k_stride = row_stride ? row_stride : (int64_t)hk * d,
        .v_stride = row_stride ? row_stride : (int64_t)hk * dv,
        .hq = hq,
        .hk = hk,
        .d = d,
        .dv = dv,
        .rope = rope,
        .kv = kv,
        .positions = md->h_positions,
        .slots = md->h_slot_mapping,
        .n_slots = kv->k.ne[0] * kv->k.ne[1],
        .norm_eps = rope->norm_eps,
    };
    cpu_lock(c);
    if (rope->q_norm || rope->k_norm) { // both F32 weight copies in one scratch buffer
        float *wbuf = cpu_shared_reserve(c, (size_t)2 * d * sizeof(float));
        if (rope->q_norm && q) {
            CHECK(tensor_numel(rope->q_norm) == d && cpu_weight_dtype_ok(rope->q_norm->dtype));
            r.q_norm = cpu_weight_f32(rope->q_norm, wbuf);
        }
        if (rope->k_norm) {
            CHECK(tensor_numel(rope->k_norm) == d && cpu_weight_dtype_ok(rope->k_norm->dtype));
            r.k_norm = cpu_weight_f32(rope->k_norm, wbuf + d);
        }
    }
    cpu_parallel_rows(c, n, (int64_t)(hq + 2 * hk) * d, rope_rows, &r);
    cpu_unlock(c);
}

// ---------------------------------------------------------------------------------------------
// Create / destroy

static int cpu_count_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void cpu_destroy(struct backend *b) {
    struct cpu_backend *c = cpu_backend_of(b);
    thread_pool_free(c->pool);
    if (c->scratch)
        for (int i = 0; i < c->n_threads; i++)
            free(c->scratch[i]);
    free(c->scratch);
    if (c->sample_hist)
        for (int i = 0; i < c->n_threads; i++)
            free(c->sample_hist[i]);
    free(c->sample_hist);
    free(c->shared);
    for (struct cpu_chunk *k = c->chunks, *n; k; k = n) { // what the caller did not free
        n = k->next;
        for (struct cpu_range *r = k->free, *rn; r; r = rn) {
            rn = r->next;
            free(r);
        }
        munmap(k->base, k->size);
        free(k);
    }
    pthread_mutex_destroy(&c->mem_lock);
    pthread_mutex_destroy(&c->op_lock);
    free(c);
}

atomc_status backend_cpu_create(const struct backend_options *o, struct backend **out, struct error *err) {
    *out = NULL;
    int n = o && o->num_threads > 0 ? o->num_threads : cpu_count_cores();
    if (o && o->num_threads < 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "cpu backend: num_threads must be >= 0 (0 = cores), got %d",
                         o->num_threads);
    if (n > 1024) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "cpu backend: %d threads is too many", n);
    struct cpu_backend *c = calloc(1, sizeof *c);
    if (!c) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cpu backend: out of memory");
    pthread_mutex_init(&c->op_lock, NULL);
    pthread_mutex_init(&c->mem_lock, NULL);
    c->n_threads = n;
    c->kv_pool_bytes = o ? o->kv_pool_bytes : 0;
    const char *bi = getenv("ATOMC_BATCH_INVARIANT");
    c->batch_invariant = (o && o->batch_invariant) || (bi && !strcmp(bi, "1"));
    c->exact_matmul = o && o->exact_kernels;
    c->scratch = calloc((size_t)n, sizeof(void *));
    c->sample_hist = calloc((size_t)n, sizeof(void *));
    atomc_status st = !c->scratch || !c->sample_hist
                          ? error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cpu backend: out of memory")
                          : thread_pool_create(n, &c->pool, err);
    if (st != ATOMC_OK) {
        free(c->scratch);
        free(c->sample_hist);
        pthread_mutex_destroy(&c->mem_lock);
        pthread_mutex_destroy(&c->op_lock);
        free(c);
        return st;
    }
    openblas_set_num_threads(n);
    cpu_kernels_select(&c->kern);
    c->base.ops = &cpu_ops;
    c->base.caps = &backend_cpu_caps;
    c->base.kind = BACKEND_CPU;
    c->base.act_dtype = DTYPE_F32;
    c->base.weight_dtype = DTYPE_F32;
    c->base.num_threads = n;
    c->base.impl = c;
    *out = &c->base;
    return ATOMC_OK;
}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy,
    .memset_zero = cpu_memset_zero,
    .synchronize = cpu_synchronize,
    .memory_info = cpu_memory_info,
    .upload_weight = cpu_upload_weight,
    .embedding = cpu_embedding,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .matmul = cpu_matmul,
    .rope_kv_write = cpu_rope_kv_write,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .gather_rows = cpu_gather_rows,
    .convert = cpu_convert,
    .sample = cpu_sample,
    .graph_begin = NULL,
    .graph_end = NULL,
    .graph_launch = NULL,
    .graph_destroy = NULL,
    .moe_route = cpu_moe_route,
    .moe_experts = cpu_moe_experts,
    .mla_latent_write = cpu_mla_latent_write,
    .mla_attention = cpu_mla_attention,
    .deltanet_conv = cpu_deltanet_conv,
    .deltanet_rule = cpu_deltanet_rule,
    .rmsnorm_gated = cpu_rmsnorm_gated,
    .gate_sigmoid_mul = cpu_gate_sigmoid_mul,
    .dsa_index_write = cpu_dsa_index_write,
    .dsa_topk = cpu_dsa_topk,
};
