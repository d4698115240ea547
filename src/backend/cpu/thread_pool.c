#include "backend/cpu/thread_pool.h"

#include <pthread.h>
#include <sched.h>
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

// Protocol. A job is published with a seqlock-style generation: odd while the caller writes
// the job fields, even (and new) once they are valid. A worker announces itself in `refs`
// before reading the generation; the caller waits for refs == 0 after making the generation
// odd and before touching the fields, so no worker ever reads a half-written job. Items are
// claimed from `next` and counted into `done` when finished; the caller returns when done == n.
// The barrier therefore waits for the work, not for every worker: a worker the OS has not
// scheduled yet (a loaded machine) finds nothing left to claim and costs nothing.
struct thread_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t dispatch; // serialises callers of parallel_for
    pthread_mutex_t mu;       // guards sleeping / waking below
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    _Atomic uint64_t generation; // even = job published (or none), odd = being written
    _Atomic int refs;            // workers inside the current job
    _Atomic int64_t next;        // next unclaimed item
    _Atomic int64_t done;        // items finished
    _Atomic int sleepers;        // workers blocked on cv_work
    _Atomic bool caller_sleeping;
    _Atomic bool stop;
    // Current job (valid while the generation is even).
    thread_pool_fn fn;
    void *ctx;
    int64_t n, chunk;
};

struct worker_arg {
    struct thread_pool *p;
    int tid;
};

static void pool_run_chunks(struct thread_pool *p, int tid) {
    const int64_t n = p->n, chunk = p->chunk;
    for (;;) {
        int64_t b = atomic_fetch_add(&p->next, chunk);
        if (b >= n) break;
        int64_t e = b + chunk < n ? b + chunk : n;
        p->fn(p->ctx, b, e, tid);
        if (atomic_fetch_add(&p->done, e - b) + (e - b) == n && atomic_load(&p->caller_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
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
        for (;;) {
            if (atomic_load(&p->stop)) return NULL;
            uint64_t g = atomic_load(&p->generation);
            if (g != seen && (g & 1) == 0) break;
            if (++spins < POOL_SPIN_ITERS) {
                CPU_RELAX();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            for (;;) {
                g = atomic_load(&p->generation);
                if (atomic_load(&p->stop) || (g != seen && (g & 1) == 0)) break;
                pthread_cond_wait(&p->cv_work, &p->mu);
            }
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        atomic_fetch_add(&p->refs, 1);
        uint64_t g = atomic_load(&p->generation);
        if (g != seen && (g & 1) == 0) {
            seen = g;
            pool_run_chunks(p, tid);
        }
        atomic_fetch_sub(&p->refs, 1);
    }
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
            return error_set(err, ATOMC_ERR_INTERNAL, "thread pool: cannot start worker thread %d of %d", i, n_threads);
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
    for (int i = 1; i < p->n_threads && p->threads; i++)
        pthread_join(p->threads[i], NULL);
    free(p->threads);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->dispatch);
    free(p);
}

int thread_pool_size(const struct thread_pool *p) {
    return p->n_threads;
}

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
    // Close the previous job: odd generation, then wait for stragglers still inside it.
    atomic_fetch_add(&p->generation, 1);
    for (int spins = 0; atomic_load(&p->refs) > 0; spins++) {
        if (spins < POOL_SPIN_ITERS)
            CPU_RELAX();
        else
            sched_yield(); // a straggler was descheduled inside the old job
    }
    // About four chunks per thread balances uneven items (attention rows, busy shared cores)
    // without making the claim counter hot.
    int64_t chunk = (n + (int64_t)p->n_threads * 4 - 1) / ((int64_t)p->n_threads * 4);
    if (chunk < grain) chunk = grain;
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk;
    atomic_store(&p->next, 0);
    atomic_store(&p->done, 0);
    atomic_store(&p->caller_sleeping, false);
    atomic_fetch_add(&p->generation, 1); // even: published
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }

    pool_run_chunks(p, 0);

    int spins = 0;
    while (atomic_load(&p->done) < n) {
        if (++spins < POOL_SPIN_ITERS) {
            CPU_RELAX();
            continue;
        }
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_sleeping, true);
        while (atomic_load(&p->done) < n)
            pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->dispatch);
}
