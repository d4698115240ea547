// Tensor-parallel runner: ranks as threads of one process (see tp_runner.h and the
// Parallelism section of docs/ARCHITECTURE.md for why threads).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "common/check.h"
#include "common/log.h"
#include "common/timeutil.h"
#include "parallel/comm.h"
#include "parallel/tp_runner.h"

enum tp_job { TP_JOB_NONE = 0, TP_JOB_EXECUTE, TP_JOB_LOGITS, TP_JOB_EXIT };

struct tp_rank {
    struct tp_runner *t;
    int rank;
    struct backend *backend; // CUDA: the rank's backend (its device is bound on every thread using it)
    struct model_runner *runner;
    struct comm *comm;
    pthread_t thread;
    bool started;
    float *logits;          // ranks > 0: private logits buffer of execute_logits
    size_t logits_cap;
    atomc_status st;        // result of the last job
    struct error err;
};

struct tp_runner {
    int n;
    struct tp_rank *ranks;
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    uint64_t job_seq;        // incremented per job
    enum tp_job job;
    const struct forward_batch *fb;
    int pending;             // workers still running the current job
};

static void tp_rank_run(struct tp_rank *rk, enum tp_job job, const struct forward_batch *fb) {
    struct runner_output out;
    error_clear(&rk->err);
    if (job == TP_JOB_EXECUTE) {
        rk->st = model_runner_execute(rk->runner, fb, &out, &rk->err);
        return;
    }
    size_t need = (size_t)fb->n_logits * (size_t)model_runner_config(rk->runner)->vocab_size;
    if (need > rk->logits_cap) {
        free(rk->logits);
        rk->logits = xmalloc((need ? need : 1) * sizeof(float));
        rk->logits_cap = need;
    }
    rk->st = model_runner_execute_logits(rk->runner, fb, rk->logits, &rk->err);
}

// CUDA's current device is per thread: bind the rank's device before using its backend.
static void tp_bind(struct tp_rank *rk) {
#ifdef ATOMC_CUDA
    comm_nccl_bind_device(rk->backend);
#else
    (void)rk;
#endif
}

static void *tp_worker(void *arg) {
    struct tp_rank *rk = arg;
    struct tp_runner *t = rk->t;
    uint64_t seen = 0;
    tp_bind(rk);
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (t->job_seq == seen) pthread_cond_wait(&t->cv_job, &t->mu);
        seen = t->job_seq;
        enum tp_job job = t->job;
        const struct forward_batch *fb = t->fb;
        pthread_mutex_unlock(&t->mu);
        if (job == TP_JOB_EXIT) return NULL;
        tp_rank_run(rk, job, fb);
        pthread_mutex_lock(&t->mu);
        if (--t->pending == 0) pthread_cond_signal(&t->cv_done);
        pthread_mutex_unlock(&t->mu);
    }
}

// Posts a job to the workers (ranks 1..n-1).
static void tp_post(struct tp_runner *t, enum tp_job job, const struct forward_batch *fb) {
    pthread_mutex_lock(&t->mu);
    t->job = job;
    t->fb = fb;
    t->pending = t->n - 1;
    t->job_seq++;
    pthread_cond_broadcast(&t->cv_job);
    pthread_mutex_unlock(&t->mu);
}

static void tp_wait(struct tp_runner *t) {
    pthread_mutex_lock(&t->mu);
    while (t->pending > 0) pthread_cond_wait(&t->cv_done, &t->mu);
    pthread_mutex_unlock(&t->mu);
}

// Waits for the other ranks and returns the first failure of any rank (rank 0 included).
static atomc_status tp_collect(struct tp_runner *t, struct error *err) {
    tp_wait(t);
    for (int k = 0; k < t->n; k++)
        if (t->ranks[k].st != ATOMC_OK) {
            if (err) *err = t->ranks[k].err;
            return error_prefix(err, "tensor parallel rank %d of %d: ", k, t->n);
        }
    return ATOMC_OK;
}

// Starts job on the other ranks and readies rank 0 (this thread) for its share.
static struct tp_rank *tp_start(struct tp_runner *t, enum tp_job job, const struct forward_batch *fb) {
    tp_post(t, job, fb);
    struct tp_rank *r0 = &t->ranks[0];
    tp_bind(r0);
    error_clear(&r0->err);
    return r0;
}

atomc_status tp_runner_execute(struct tp_runner *t, const struct forward_batch *fb, struct runner_output *out,
                               struct error *err) {
    struct tp_rank *r0 = tp_start(t, TP_JOB_EXECUTE, fb);
    r0->st = model_runner_execute(r0->runner, fb, out, &r0->err);
    return tp_collect(t, err);
}

atomc_status tp_runner_execute_logits(struct tp_runner *t, const struct forward_batch *fb, float *logits,
                                      struct error *err) {
    struct tp_rank *r0 = tp_start(t, TP_JOB_LOGITS, fb);
    r0->st = model_runner_execute_logits(r0->runner, fb, logits, &r0->err);
    return tp_collect(t, err);
}

int tp_runner_size(const struct tp_runner *t) { return t->n; }
struct model_runner *tp_runner_rank(struct tp_runner *t, int rank) { return t->ranks[rank].runner; }

int tp_runner_num_kv_blocks(const struct tp_runner *t) {
    int m = model_runner_num_kv_blocks(t->ranks[0].runner);
    for (int k = 1; k < t->n; k++) {
        int b = model_runner_num_kv_blocks(t->ranks[k].runner);
        if (b < m) m = b;
    }
    return m;
}

void tp_runner_free(struct tp_runner *t) {
    if (!t) return;
    bool any = false;
    for (int k = 1; k < t->n; k++) any |= t->ranks[k].started;
    if (any) {
        pthread_mutex_lock(&t->mu);
        t->job = TP_JOB_EXIT;
        t->job_seq++;
        pthread_cond_broadcast(&t->cv_job);
        pthread_mutex_unlock(&t->mu);
        for (int k = 1; k < t->n; k++)
            if (t->ranks[k].started) pthread_join(t->ranks[k].thread, NULL);
    }
    for (int k = 0; k < t->n; k++) {
        if (t->ranks[k].runner) tp_bind(&t->ranks[k]); // (a failed create already freed the backend)
        comm_destroy(t->ranks[k].comm);               // before the backend whose stream it used
        model_runner_free(t->ranks[k].runner);
        free(t->ranks[k].logits);
    }
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv_job);
    pthread_cond_destroy(&t->cv_done);
    free(t->ranks);
    free(t);
}

// Communicator creation meets every rank at once, so each rank creates its own on a thread.
struct tp_comm_job {
    struct tp_rank *rk;
    const char *shm_name;
    struct backend *backend;         // CUDA: the rank's backend (NCCL)
    const unsigned char *nccl_id;
    atomc_status st;
    struct error err;
};

static void *tp_comm_thread(void *arg) {
    struct tp_comm_job *j = arg;
    int n = j->rk->t->n;
#ifdef ATOMC_CUDA
    if (j->backend) {
        j->st = comm_nccl_create(j->backend, j->nccl_id, j->rk->rank, n, 0, &j->rk->comm, &j->err);
        return NULL;
    }
#endif
    j->st = comm_shm_create(j->shm_name, j->rk->rank, n, 0, 0, &j->rk->comm, &j->err);
    return NULL;
}

// Each rank loads its shard on its own thread (own model_files, own backend), so start-up
// takes about one shard's load time instead of tp_size of them.
struct tp_load_job {
    struct tp_rank *rk;
    struct runner_options ro;
    struct model_runner **out;
    atomc_status st;
    struct error err;
};

static void *tp_load_thread(void *arg) {
    struct tp_load_job *j = arg;
    tp_bind(j->rk);
    j->st = model_runner_create(&j->ro, j->out, &j->err);
    return NULL;
}

atomc_status tp_runner_create(const struct runner_options *o, int tp_size, struct tp_runner **out,
                              struct error *err) {
    *out = NULL;
    if (tp_size < 2 || tp_size > 64)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d outside 2..64", tp_size);
    if (o->backend)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallelism creates one backend per rank; a "
                         "pre-made backend cannot be passed");
    const char *device = backend_resolve_device(o->device);
    bool cuda = !strcmp(device, "cuda");
    if (!cuda && strcmp(device, "cpu"))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown device '%s' (cpu or cuda)", device);
#ifndef ATOMC_CUDA
    if (cuda)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "tensor parallelism on cuda needs a CUDA build (make CUDA=1)");
#endif
    struct tp_runner *t = xcalloc(1, sizeof *t);
    t->n = tp_size;
    t->ranks = xcalloc((size_t)tp_size, sizeof *t->ranks);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv_job, NULL);
    pthread_cond_init(&t->cv_done, NULL);
    for (int k = 0; k < tp_size; k++) t->ranks[k] = (struct tp_rank){.t = t, .rank = k};
    atomc_status st = ATOMC_OK;
    struct backend **backends = xcalloc((size_t)tp_size, sizeof *backends);
    unsigned char nccl_id[128] = {0};
    char shm_name[96];
    snprintf(shm_name, sizeof shm_name, "/atomc-tp-%d-%llx", (int)getpid(), (unsigned long long)time_now_ns());

    int threads = o->num_threads > 0 ? o->num_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    int per_rank_threads = threads / tp_size > 0 ? threads / tp_size : 1;
#ifdef ATOMC_CUDA
    if (cuda) {
        int ndev = 0;
        if ((st = comm_nccl_device_count(&ndev, err)) != ATOMC_OK) goto fail;
        if (ndev < tp_size) {
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "tensor parallel size %d needs %d GPUs, %d visible",
                           tp_size, tp_size, ndev);
            goto fail;
        }
        for (int k = 0; k < tp_size; k++) {
            struct backend_options bo = {.device_id = k};
            if ((st = backend_create("cuda", &bo, &backends[k], err)) != ATOMC_OK) {
                error_prefix(err, "GPU %d: ", k);
                goto fail;
            }
        }
        if ((st = comm_nccl_unique_id(nccl_id, err)) != ATOMC_OK) goto fail;
    }
#endif
    {
        struct tp_comm_job *jobs = xcalloc((size_t)tp_size, sizeof *jobs);
        pthread_t *th = xcalloc((size_t)tp_size, sizeof *th);
        for (int k = 0; k < tp_size; k++) {
            jobs[k] = (struct tp_comm_job){.rk = &t->ranks[k], .shm_name = shm_name, .backend = backends[k],
                                           .nccl_id = nccl_id};
            pthread_create(&th[k], NULL, tp_comm_thread, &jobs[k]);
        }
        for (int k = 0; k < tp_size; k++) pthread_join(th[k], NULL);
        for (int k = 0; k < tp_size && st == ATOMC_OK; k++)
            if (jobs[k].st != ATOMC_OK) {
                if (err) *err = jobs[k].err;
                st = error_prefix(err, "tensor parallel rank %d: ", k);
            }
        free(jobs);
        free(th);
        if (st != ATOMC_OK) goto fail;
    }
    {
        struct tp_load_job *jobs = xcalloc((size_t)tp_size, sizeof *jobs);
        pthread_t *th = xcalloc((size_t)tp_size, sizeof *th);
        for (int k = 0; k < tp_size; k++) {
            struct runner_options ro = *o;
            ro.tp_rank = k;
            ro.tp_size = tp_size;
            ro.comm = t->ranks[k].comm;
            ro.num_threads = per_rank_threads;
            ro.cpu_kv_cache_bytes = o->cpu_kv_cache_bytes / (size_t)tp_size;
            ro.backend = backends[k]; // NULL on the CPU: the runner creates it
            t->ranks[k].backend = backends[k];
            backends[k] = NULL;       // owned by the runner from here, also on failure
            jobs[k] = (struct tp_load_job){.rk = &t->ranks[k], .ro = ro, .out = &t->ranks[k].runner};
            pthread_create(&th[k], NULL, tp_load_thread, &jobs[k]);
        }
        for (int k = 0; k < tp_size; k++) pthread_join(th[k], NULL);
        for (int k = 0; k < tp_size && st == ATOMC_OK; k++)
            if (jobs[k].st != ATOMC_OK) {
                if (err) *err = jobs[k].err;
                st = error_prefix(err, "tensor parallel rank %d of %d: ", k, tp_size);
            }
        free(jobs);
        free(th);
        if (st != ATOMC_OK) goto fail;
    }
    for (int k = 1; k < tp_size; k++) {
        if (pthread_create(&t->ranks[k].thread, NULL, tp_worker, &t->ranks[k]) != 0) {
            st = error_set(err, ATOMC_ERR_INTERNAL, "cannot start the worker thread of tensor parallel rank %d", k);
            goto fail;
        }
        t->ranks[k].started = true;
    }
    LOG_INFO("tensor parallel: %d ranks (%s communicator), %d KV blocks per rank", tp_size,
             t->ranks[0].comm->ops->name, tp_runner_num_kv_blocks(t));
    free(backends);
    *out = t;
    return ATOMC_OK;
fail:
    for (int k = 0; k < tp_size; k++) backend_destroy(backends[k]);
    free(backends);
    tp_runner_free(t);
    return st;
}
