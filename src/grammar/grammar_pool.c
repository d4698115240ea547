// The grammar mask pool (grammar_pool.h). Synchronisation:
// - a job is published under mu: fill / ctx / n, a new generation `gen`, n_done = 0 and
//   claim = gen << 32; threads sleep on cv_job until gen changes and read (gen, n) under mu.
// - an index is claimed by a compare-and-swap on claim = (gen << 32) | next index. The CAS
//   fails once the generation moved on, so a thread that wakes late (after its job was joined
//   and the next one published) never takes an index of the new job with the old job's n. A
//   successful claim of job gen's index i means the job is not joined yet (i is not done), so
//   the job's fill / ctx are still its own.
// - each finished fill adds to n_done (seq_cst: the fill's writes happen before it); the one that
//   makes it n broadcasts cv_done under mu, and the join waits on cv_done under mu while
//   n_done < n, so the wake-up cannot be lost.
#include "grammar/grammar_pool.h"

#include <pthread.h>
#include <stdatomic.h>

#include "common/check.h"
#include "common/log.h"

struct grammar_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done; // a new job (gen changed) / the job's last fill done
    pthread_t *threads;             // (max_threads)
    int n_threads, max_threads;
    bool stop; // under mu
    // The job (written under mu by begin).
    grammar_pool_fill_fn fill;
    void *ctx;
    int n;
    uint32_t gen;
    _Atomic uint64_t claim;
    _Atomic int n_done;
    _Atomic bool pending; // a job handed over and not yet joined
    _Atomic uint64_t by_threads, by_join;
};

struct grammar_pool *grammar_pool_create(int max_threads) {
    CHECK(max_threads >= 1);
    struct grammar_pool *p = xcalloc(1, sizeof *p);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_job, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->max_threads = max_threads;
    p->threads = xcalloc((size_t)max_threads, sizeof *p->threads);
    return p;
}

void grammar_pool_free(struct grammar_pool *p) {
    if (!p) return;
    CHECK(!atomic_load(&p->pending));
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv_job);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_job);
    pthread_cond_destroy(&p->cv_done);
    free(p->threads);
    free(p);
}

// Runs job gen's unclaimed indices until none is left; returns how many this thread ran.
static int run_claimed(struct grammar_pool *p, uint32_t gen, int n, grammar_pool_fill_fn fill, void *ctx) {
    int k = 0;
    uint64_t c = atomic_load(&p->claim);
    while ((uint32_t)(c >> 32) == gen && (int)(uint32_t)c < n) {
        if (!atomic_compare_exchange_weak(&p->claim, &c, c + 1)) continue; // c reloaded
        fill(ctx, (int)(uint32_t)c);
        k++;
        if (atomic_fetch_add(&p->n_done, 1) + 1 == n) { // the job's last fill: wake the join
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
        c = atomic_load(&p->claim);
    }
    return k;
}

static void *pool_thread(void *arg) {
    struct grammar_pool *p = arg;
    uint32_t seen = 0; // jobs start at generation 1; a thread started late tries the current one
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->gen == seen)
            pthread_cond_wait(&p->cv_job, &p->mu);
        if (p->stop) break;
        seen = p->gen;
        int n = p->n;
        grammar_pool_fill_fn fill = p->fill;
        void *ctx = p->ctx;
        pthread_mutex_unlock(&p->mu);
        int k = run_claimed(p, seen, n, fill, ctx);
        if (k) atomic_fetch_add(&p->by_threads, (uint64_t)k);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

bool grammar_pool_begin(struct grammar_pool *p, int n, grammar_pool_fill_fn fill, void *ctx) {
    CHECK(n >= 0 && !atomic_load(&p->pending));
    if (n == 0) return true;
    pthread_mutex_lock(&p->mu);
    int want = n < p->max_threads ? n : p->max_threads;
    while (p->n_threads < want) {
        if (pthread_create(&p->threads[p->n_threads], NULL, pool_thread, p) != 0) {
            LOG_WARN("structured output: cannot start mask thread %d; the pool stays at %d", p->n_threads + 1,
                     p->n_threads);
            p->max_threads = want = p->n_threads;
            break;
        }
        p->n_threads++;
    }
    if (p->n_threads == 0) {
        pthread_mutex_unlock(&p->mu);
        return false;
    }
    p->gen++;
    p->n = n;
    p->fill = fill;
    p->ctx = ctx;
    atomic_store(&p->n_done, 0);
    atomic_store(&p->claim, (uint64_t)p->gen << 32);
    atomic_store(&p->pending, true);
    for (int i = 0; i < want; i++) // each wakes a different waiting thread (or finds gen moved on)
        pthread_cond_signal(&p->cv_job);
    pthread_mutex_unlock(&p->mu);
    return true;
}

void grammar_pool_join(struct grammar_pool *p) {
    if (!atomic_load(&p->pending)) return;
    pthread_mutex_lock(&p->mu);
    uint32_t gen = p->gen;
    int n = p->n;
    grammar_pool_fill_fn fill = p->fill;
    void *ctx = p->ctx;
    pthread_mutex_unlock(&p->mu);
    int k = run_claimed(p, gen, n, fill, ctx);
    if (k) atomic_fetch_add(&p->by_join, (uint64_t)k);
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->n_done) < n)
        pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    atomic_store(&p->pending, false);
}

void grammar_pool_counts(const struct grammar_pool *p, uint64_t *by_threads, uint64_t *by_join, int *n_threads) {
    *by_threads = atomic_load(&p->by_threads);
    *by_join = atomic_load(&p->by_join);
    *n_threads = p->n_threads;
}
