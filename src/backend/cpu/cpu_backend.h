// Private state of the CPU backend, shared by its op files (cpu_backend.c, cpu_attention.c,
// cpu_sampler.c). Not for use outside src/backend/cpu/.
//
// Threading: every op takes `op_lock` for its whole duration, so ops may be called from any
// thread (one op runs at a time per backend); inside, work is spread over the persistent
// thread pool. Scratch: one buffer per pool thread, grown (rarely, under op_lock) to the
// largest size an op has needed; ops never allocate otherwise.
#ifndef ATOMC_BACKEND_CPU_CPU_BACKEND_H
#define ATOMC_BACKEND_CPU_CPU_BACKEND_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/thread_pool.h"

// A 2 MiB-aligned anonymous mapping with MADV_HUGEPAGE (cpu_backend.c "Memory"): one large
// allocation, or an arena that smaller ones are carved from (first fit over `free`, a list of
// free ranges in offset order; each allocation is preceded by a 64-byte header holding its
// length). Unmapped when its last allocation is freed.
struct cpu_range {
    size_t off, len;
    struct cpu_range *next;
};
struct cpu_chunk {
    char *base;
    size_t size;
    int live;               // allocations not yet freed
    bool arena;             // false: one allocation at base
    struct cpu_range *free; // arena: free ranges, ascending, never adjacent
    struct cpu_chunk *next;
};

struct cpu_backend {
    struct backend base; // base.impl points back to this struct
    pthread_mutex_t mem_lock; // chunks
    struct cpu_chunk *chunks; // every mapping
    struct thread_pool *pool;
    struct cpu_kernels kern; // inner loops chosen for this CPU (AVX2 or portable)
    pthread_mutex_t op_lock;
    size_t kv_pool_bytes;
    bool batch_invariant; // all matmuls through the skinny kernel (see backend_options)
    bool exact_matmul;    // backend_options.exact_kernels: quantised weights never take the int8-activation path
    int n_threads;
    void **scratch;       // (n_threads) per-thread scratch, 64-byte aligned
    size_t scratch_bytes; // current size of each
    void *shared;         // op-level scratch (work lists), 64-byte aligned
    size_t shared_bytes;
    void **sample_hist;       // (n_threads) sampler penalty counters: int32 count[V] + uint8 seen[V],
    size_t sample_hist_vocab; // kept all-zero between uses (cleared by the sampler after each row)
};

static inline void cpu_lock(struct cpu_backend *c) {
    pthread_mutex_lock(&c->op_lock);
}
static inline void cpu_unlock(struct cpu_backend *c) {
    pthread_mutex_unlock(&c->op_lock);
}

static inline struct cpu_backend *cpu_backend_of(struct backend *b) {
    return (struct cpu_backend *)b->impl;
}

// Ensures every per-thread scratch buffer holds at least `bytes`; aborts when memory is
// exhausted (scratch sizes are bounded by the model's shapes, fixed after the first steps).
void cpu_scratch_reserve(struct cpu_backend *c, size_t bytes);
// Ensures every thread's sampler counters cover a vocabulary of V (zero-filled).
void cpu_sample_hist_reserve(struct cpu_backend *c, size_t V);
// Ensures the op-level scratch holds at least `bytes` and returns it.
void *cpu_shared_reserve(struct cpu_backend *c, size_t bytes);

// Op entry points implemented outside cpu_backend.c.
void cpu_attention(struct backend *b, struct tensor *out, const struct tensor *q, int64_t q_row_stride,
                   const struct kv_layer *kv, const struct attn_metadata *md, float scale, int sliding_window,
                   const struct tensor *sinks);
void cpu_sample(struct backend *b, const struct sample_args *a);
// MLA ops (cpu_mla.c; backend.h "---- MLA ----").
void cpu_mla_latent_write(struct backend *b, struct tensor *q, const struct tensor *kv_a, const struct tensor *kv_norm,
                          float eps, const struct rope_args *rope, const struct mla_args *a, struct kv_layer *kv,
                          const struct attn_metadata *md);
void cpu_mla_attention(struct backend *b, struct tensor *out, const struct tensor *q, const struct kv_layer *kv,
                       const struct attn_metadata *md, const struct mla_args *a, void *workspace);
void cpu_dsa_index_write(struct backend *b, struct tensor *iq, const struct tensor *ik, const struct tensor *norm_w,
                         const struct tensor *norm_b, const struct rope_args *rope, const struct dsa_args *a,
                         struct kv_layer *kv, const struct attn_metadata *md);
void cpu_dsa_topk(struct backend *b, int32_t *topk, const struct tensor *iq, const struct tensor *w,
                  const struct kv_layer *kv, const struct attn_metadata *md, const struct dsa_args *a);
// Mixture-of-experts ops (cpu_moe.c).
void cpu_moe_route(struct backend *b, const struct tensor *logits, const struct moe_route_args *a, int32_t *topk_ids,
                   float *topk_w);
void cpu_moe_experts(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *gate_up,
                     const struct weight *down, const int32_t *topk_ids, const float *topk_w, int n_slots,
                     const struct moe_experts_args *ea, void *workspace);

// Gated DeltaNet ops (cpu_deltanet.c), see backend.h.
void cpu_deltanet_conv(struct backend *b, struct tensor *out, const struct tensor *x, int64_t x_row_stride,
                       const struct tensor *w, struct kv_layer *kv, const struct attn_metadata *md);
void cpu_deltanet_rule(struct backend *b, struct tensor *out, const struct tensor *qkv, const struct tensor *ba,
                       int64_t ba_row_stride, const struct tensor *a_log, const struct tensor *dt_bias,
                       struct kv_layer *kv, const struct attn_metadata *md, const struct deltanet_args *a);
void cpu_rmsnorm_gated(struct backend *b, struct tensor *out, const struct tensor *x, const struct tensor *z,
                       int64_t z_row_stride, int z_heads, const struct tensor *w, float eps);
void cpu_gate_sigmoid_mul(struct backend *b, struct tensor *x, const struct tensor *gate, int64_t gate_row_stride,
                          int gate_cols);

// Quantized weights (cpu_qmatmul.c): the matmul for schemes other than NONE (cpu_matmul
// dispatches to it), whether a weight is one it runs, and expert e of a stacked (E, rows,
// cols) weight as a 2-D weight with its scales (any scheme, NONE included).
void cpu_qmatmul(struct backend *b, struct tensor *out, const struct tensor *x, const struct weight *w,
                 const struct tensor *bias);
bool cpu_qweight_supported(const struct weight *w);
struct weight cpu_weight_expert(const struct weight *w, int e);

#endif
