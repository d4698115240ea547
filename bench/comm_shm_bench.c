// Shared-memory communicator all-reduce: latency and bandwidth per message size, ranks as
// threads of this process (the tensor-parallel CPU setup):
//
//   make bench && build/bench/comm_shm_bench [world=2] [iters=200]
//
// Prints, per F32 message size, the mean wall time of one all_reduce_sum (rank 0's clock,
// after a barrier-separated warm-up) and the bus bandwidth NCCL-style: busbw = bytes / t *
// 2 (W - 1) / W (what each rank moves in a reduce-scatter + all-gather).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "parallel/comm.h"

static const size_t SIZES[] = {1024, 4096, 16384, 65536, 262144, 1048576, 4194304};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])

struct job {
    const char *name;
    int rank, world, iters;
    double t[N_SIZES];
    int fail;
};

static void *run(void *arg) {
    struct job *j = arg;
    struct error err = {0};
    struct comm *c = NULL;
    if (comm_shm_create(j->name, j->rank, j->world, 0, 60, &c, &err) != ATOMC_OK) {
        fprintf(stderr, "rank %d: %s\n", j->rank, err.msg);
        j->fail = 1;
        return NULL;
    }
    float *buf = calloc(SIZES[N_SIZES - 1] / sizeof(float), sizeof(float));
    for (size_t si = 0; si < N_SIZES && !j->fail; si++) {
        size_t n = SIZES[si] / sizeof(float);
        int iters = SIZES[si] >= 1048576 ? j->iters / 10 + 1 : j->iters;
        for (int w = 0; w < 5; w++) j->fail |= comm_all_reduce_sum(c, buf, DTYPE_F32, n, &err) != ATOMC_OK;
        j->fail |= comm_barrier(c, &err) != ATOMC_OK;
        double t0 = time_now_s();
        for (int i = 0; i < iters; i++) j->fail |= comm_all_reduce_sum(c, buf, DTYPE_F32, n, &err) != ATOMC_OK;
        j->t[si] = (time_now_s() - t0) / iters;
    }
    if (j->fail) fprintf(stderr, "rank %d: %s\n", j->rank, err.msg);
    free(buf);
    comm_destroy(c);
    return NULL;
}

int main(int argc, char **argv) {
    int world = argc > 1 ? atoi(argv[1]) : 2, iters = argc > 2 ? atoi(argv[2]) : 200;
    if (world < 1 || world > 16 || iters < 1) {
        fprintf(stderr, "usage: %s [world 1..16] [iters]\n", argv[0]);
        return 2;
    }
    char name[64];
    snprintf(name, sizeof name, "/atomc-bench-%d", (int)getpid());
    struct job jobs[16];
    pthread_t th[16];
    for (int r = 0; r < world; r++) {
        jobs[r] = (struct job){.name = name, .rank = r, .world = world, .iters = iters};
        pthread_create(&th[r], NULL, run, &jobs[r]);
    }
    int fail = 0;
    for (int r = 0; r < world; r++) {
        pthread_join(th[r], NULL);
        fail |= jobs[r].fail;
    }
    if (fail) return 1;
    printf("shm all_reduce_sum F32, %d ranks (threads)\n%10s %12s %12s\n", world, "bytes", "time_us", "busbw_GB/s");
    for (size_t si = 0; si < N_SIZES; si++) {
        double t = jobs[0].t[si];
        printf("%10zu %12.1f %12.2f\n", SIZES[si], t * 1e6, SIZES[si] / t * 2.0 * (world - 1) / world / 1e9);
    }
    return 0;
}
