#include "backend/cpu/thread_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "common/check.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

// Spin iterations before a worker (or the waiting caller) falls back to sleeping. Short:
// the development machines are shared, and long spins steal cycles from other processes.
#define POOL_SPIN_ITERS 4000

struct thread_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t dispatch; // serialises callers of parallel_for
    pthread_mutex_t mu;       // guards sleeping / waking below
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    _Atomic uint64_t generation; // bumped once per job
    _Atomic int pending;         // workers that have not finished the current job
    _Atomic int64_t next;        // next unclaimed item of the current job
    _Atomic bool stop;
    // Current job (written by the caller before the generation bump, read by workers after).
    thread_pool_fn fn;
    void *ctx;
    int64_t n, chunk;
};

struct worker_arg {
    struct thread_pool *p;
    int tid;
};

static void pool_run_chunks(struct thread_pool *p, int tid) {
    for (;;) {
        int64_t b = atomic_fetch_add_explicit(&p->next, p->chunk, memory_order_relaxed);
        if (b >= p->n) break;
        int64_t e = b + p->chunk < p->n ? b + p->chunk : p->n;
        p->fn(p->ctx, b, e, tid);
    }
}

static void *pool_worker(void *arg) {
    struct worker_arg *wa = arg;
    struct thread_pool *p = wa->p;
    int tid = wa->tid;
    free(wa);
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen &&
               !atomic_load_explicit(&p->stop, memory_order_acquire)) {
            if (++spins < POOL_SPIN_ITERS) { CPU_RELAX(); continue; }
            pthread_mutex_lock(&p->mu);
            while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen &&
                   !atomic_load_explicit(&p->stop, memory_order_acquire))
                pthread_cond_wait(&p->cv_work, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        pool_run_chunks(p, tid);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

atomc_status thread_pool_create(int n_threads, struct thread_pool **out, struct error *err) {
    CHECK(n_threads >= 1);
    *out = NULL;
    struct thread_pool *p = calloc(1, sizeof *p);
    if (!p) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "thread pool: out of memory");
    p->n_threads = n_threads;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    pthread_mutex_init(&p->dispatch, &attr);
    pthread_mutexattr_destroy(&attr);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!p->threads) {
        thread_pool_free(p);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "thread pool: out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        struct worker_arg *wa = malloc(sizeof *wa);
        int rc = -1;
        if (wa) {
            wa->p = p;
            wa->tid = i;
            rc = pthread_create(&p->threads[i], NULL, pool_worker, wa);
        }
        if (rc != 0) {
            // The workers already started are joined by thread_pool_free.
            free(wa);
            p->n_threads = i;
            thread_pool_free(p);
            return error_set(err, ATOMC_ERR_INTERNAL, "thread pool: cannot start worker thread %d of %d", i,
                             n_threads);
        }
    }
    *out = p;
    return ATOMC_OK;
}

void thread_pool_free(struct thread_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, true, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads && p->threads; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->dispatch);
    free(p);
}

int thread_pool_size(const struct thread_pool *p) { return p->n_threads; }

void thread_pool_parallel_for(struct thread_pool *p, int64_t n, int64_t grain, thread_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    // An error-checking mutex: a job that re-enters from the calling thread aborts here
    // instead of deadlocking.
    int rc = pthread_mutex_lock(&p->dispatch);
    CHECK_MSG(rc == 0, "thread_pool_parallel_for re-entered from inside a job (%d)", rc);
    // About four chunks per thread balances uneven items (attention rows, busy shared cores)
    // without making the claim counter hot.
    int64_t chunk = (n + (int64_t)p->n_threads * 4 - 1) / ((int64_t)p->n_threads * 4);
    if (chunk < grain) chunk = grain;
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    pool_run_chunks(p, 0);

    int spins = 0;
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) {
        if (++spins < POOL_SPIN_ITERS) { CPU_RELAX(); continue; }
        pthread_mutex_lock(&p->mu);
        while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->dispatch);
}
