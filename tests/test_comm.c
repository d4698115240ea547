// Communicator and rendezvous tests: the shared-memory communicator with ranks as threads and
// as forked processes (sums exact for odd sizes and chunked ops, all_gather, all_gather_cols,
// broadcast), a
// rank that never arrives (timeout error, never a hang, later ops fail at once), and the TCP
// rendezvous on loopback with several processes (blob hand-out, refused, world size mismatch).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/timeutil.h"
#include "core/dtype.h"
#include "parallel/comm.h"
#include "parallel/rendezvous.h"
#include "test.h"

static void shm_name(char *buf, size_t n, const char *tag) {
    static int seq;
    snprintf(buf, n, "/atomc-test-%d-%s-%d", (int)getpid(), tag, seq++);
}

// Value of element i on rank r: small integers, so F32 and BF16 sums are exact.
static float val(int r, size_t i) { return (float)((int)((i * 7 + (size_t)r * 13) % 23) - 11); }

// Runs every collective on one rank; returns a message (static per rank) or NULL on success.
struct rank_job {
    const char *name;
    int rank, world;
    size_t slot_bytes;
    double timeout_s;
    int skip_ops;          // never arrives at the ops after attaching
    char msg[512];
    atomc_status st;
};

static int check_collectives(struct comm *c, int world, char *msg, size_t msg_n) {
    struct error err = {0};
    const size_t sizes[] = {1, 3, 7, 1001, 40000};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        float *f = malloc(n * sizeof(float));
        uint16_t *b = malloc(n * sizeof(uint16_t));
        for (size_t i = 0; i < n; i++) {
            f[i] = val(c->rank, i);
            b[i] = f32_to_bf16(val(c->rank, i));
        }
        atomc_status st = comm_all_reduce_sum(c, f, DTYPE_F32, n, &err);
        if (st == ATOMC_OK) st = comm_all_reduce_sum(c, b, DTYPE_BF16, n, &err);
        if (st != ATOMC_OK) {
            snprintf(msg, msg_n, "all_reduce n=%zu: %.400s", n, err.msg);
            free(f), free(b);
            return 1;
        }
        for (size_t i = 0; i < n; i++) {
            float want = 0;
            for (int r = 0; r < world; r++) want += val(r, i);
            if (f[i] != want || bf16_to_f32(b[i]) != want) {
                snprintf(msg, msg_n, "rank %d n=%zu elem %zu: f32 %g bf16 %g want %g", c->rank, n, i, f[i],
                         bf16_to_f32(b[i]), want);
                free(f), free(b);
                return 1;
            }
        }
        // all_gather of n ints from every rank
        int32_t *src = malloc(n * sizeof(int32_t)), *dst = malloc(n * (size_t)world * sizeof(int32_t));
        for (size_t i = 0; i < n; i++) src[i] = (int32_t)(c->rank * 100000 + (int)i);
        if (comm_all_gather(c, dst, src, DTYPE_I32, n, &err) != ATOMC_OK) {
            snprintf(msg, msg_n, "all_gather n=%zu: %.400s", n, err.msg);
            free(f), free(b), free(src), free(dst);
            return 1;
        }
        for (int r = 0; r < world; r++)
            for (size_t i = 0; i < n; i++)
                if (dst[(size_t)r * n + i] != (int32_t)(r * 100000 + (int)i)) {
                    snprintf(msg, msg_n, "all_gather rank %d n=%zu: slot %d elem %zu = %d", c->rank, n, r, i,
                             dst[(size_t)r * n + i]);
                    free(f), free(b), free(src), free(dst);
                    return 1;
                }
        free(f), free(b), free(src), free(dst);
        // all_gather_cols: (rows, cols) per rank side by side into (rows, world * cols)
        size_t rows = 9 + n % 5, cols = n % 100 + 1;
        float *gs = malloc(rows * cols * sizeof(float)), *gd = malloc(rows * cols * (size_t)world * sizeof(float));
        float *tmp = malloc(rows * cols * (size_t)world * sizeof(float));
        for (size_t i = 0; i < rows * cols; i++) gs[i] = (float)(c->rank * 1000000 + (int)i);
        if (comm_all_gather_cols(c, gd, gs, tmp, DTYPE_F32, rows, cols, &err) != ATOMC_OK) {
            snprintf(msg, msg_n, "all_gather_cols n=%zu: %.400s", n, err.msg);
            free(gs), free(gd), free(tmp);
            return 1;
        }
        for (size_t i = 0; i < rows; i++)
            for (int r = 0; r < world; r++)
                for (size_t j = 0; j < cols; j++)
                    if (gd[(i * (size_t)world + (size_t)r) * cols + j] != (float)(r * 1000000 + (int)(i * cols + j))) {
                        snprintf(msg, msg_n, "all_gather_cols rank %d: row %zu rank-block %d col %zu wrong", c->rank, i,
                                 r, j);
                        free(gs), free(gd), free(tmp);
                        return 1;
                    }
        free(gs), free(gd), free(tmp);
    }
    char text[3000];
    int root = world - 1;
    for (size_t i = 0; i < sizeof text; i++) text[i] = c->rank == root ? (char)('a' + i % 26) : 0;
    if (comm_broadcast_host(c, text, sizeof text, root, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "broadcast: %.400s", err.msg);
        return 1;
    }
    for (size_t i = 0; i < sizeof text; i++)
        if (text[i] != (char)('a' + i % 26)) {
            snprintf(msg, msg_n, "broadcast rank %d byte %zu = %d", c->rank, i, text[i]);
            return 1;
        }
    if (comm_barrier(c, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "barrier: %.400s", err.msg);
        return 1;
    }
    return 0;
}

static void *rank_thread(void *arg) {
    struct rank_job *j = arg;
    struct error err = {0};
    struct comm *c = NULL;
    j->st = comm_shm_create(j->name, j->rank, j->world, j->slot_bytes, j->timeout_s, &c, &err);
    if (j->st != ATOMC_OK) {
        snprintf(j->msg, sizeof j->msg, "%.400s", err.msg);
        return NULL;
    }
    if (!j->skip_ops && check_collectives(c, j->world, j->msg, sizeof j->msg)) j->st = ATOMC_ERR_INTERNAL;
    comm_destroy(c);
    return NULL;
}

static void run_threads(int world, size_t slot_bytes) {
    char name[96];
    shm_name(name, sizeof name, "thr");
    struct rank_job jobs[8];
    pthread_t th[8];
    for (int r = 0; r < world; r++) {
        jobs[r] = (struct rank_job){.name = name, .rank = r, .world = world, .slot_bytes = slot_bytes, .timeout_s = 30};
        pthread_create(&th[r], NULL, rank_thread, &jobs[r]);
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < world; r++) {
        if (jobs[r].st != ATOMC_OK) test_fail(__FILE__, __LINE__, "world %d rank %d: %s", world, r, jobs[r].msg);
    }
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    ASSERT_TRUE(access(path, F_OK) != 0); // unlinked once everyone attached
}

TEST(comm_shm_threads_sums_exact) {
    for (int w = 1; w <= 4; w++) run_threads(w, 0);
}

TEST(comm_shm_threads_chunked_small_slots) {
    // 1 KiB slots: 128 F32 per half, so 1001 and 40000 elements take many chunks.
    run_threads(3, 1024);
    run_threads(4, 1000); // rounded up to 1024
}

TEST(comm_shm_processes_sums_exact) {
    char name[96];
    shm_name(name, sizeof name, "proc");
    const int world = 3;
    pid_t pids[3];
    for (int r = 1; r < world; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            struct rank_job j = {.name = name, .rank = r, .world = world, .slot_bytes = 4096, .timeout_s = 30};
            rank_thread(&j);
            if (j.st != ATOMC_OK) fprintf(stderr, "child rank %d: %s\n", r, j.msg);
            _exit(j.st == ATOMC_OK ? 0 : 1);
        }
    }
    struct rank_job j0 = {.name = name, .rank = 0, .world = world, .slot_bytes = 4096, .timeout_s = 30};
    rank_thread(&j0);
    for (int r = 1; r < world; r++) {
        int ws = 0;
        waitpid(pids[r], &ws, 0);
        ASSERT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    }
    if (j0.st != ATOMC_OK) test_fail(__FILE__, __LINE__, "rank 0: %s", j0.msg);
}

TEST(comm_shm_rank_never_arrives_times_out) {
    char name[96];
    shm_name(name, sizeof name, "late");
    // Rank 1 attaches, then never joins the all_reduce.
    struct rank_job j1 = {.name = name, .rank = 1, .world = 2, .timeout_s = 30, .skip_ops = 1};
    pthread_t th;
    pthread_create(&th, NULL, rank_thread, &j1);
    struct error err = {0};
    struct comm *c = NULL;
    ASSERT_OK(comm_shm_create(name, 0, 2, 0, 30, &c, &err));
    pthread_join(th, NULL);
    c->timeout_s = 0.5; // rank 1 has attached and gone: the all_reduce must give up after this
    float x[5] = {1, 2, 3, 4, 5};
    double t0 = time_now_s();
    atomc_status st = comm_all_reduce_sum(c, x, DTYPE_F32, 5, &err);
    double dt = time_now_s() - t0;
    ASSERT_EQ(st, ATOMC_ERR_BACKEND);
    ASSERT_TRUE(strstr(err.msg, "timed out") != NULL);
    ASSERT_TRUE(strstr(err.msg, "1 of 2 ranks arrived") != NULL);
    ASSERT_TRUE(dt >= 0.4 && dt < 5.0);
    // The communicator is broken now: the next op fails at once.
    t0 = time_now_s();
    ASSERT_EQ(comm_barrier(c, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(strstr(err.msg, "earlier failure") != NULL);
    ASSERT_TRUE(time_now_s() - t0 < 0.1);
    comm_destroy(c);
}

TEST(comm_shm_peer_never_attaches_times_out) {
    char name[96];
    shm_name(name, sizeof name, "absent");
    struct error err = {0};
    struct comm *c = NULL;
    double t0 = time_now_s();
    ASSERT_EQ(comm_shm_create(name, 0, 3, 0, 0.3, &c, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(c == NULL);
    ASSERT_TRUE(strstr(err.msg, "timed out") != NULL);
    ASSERT_TRUE(time_now_s() - t0 < 5.0);
    // A non-zero rank whose rank 0 never comes.
    ASSERT_EQ(comm_shm_create(name, 2, 3, 0, 0.2, &c, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(strstr(err.msg, "waiting for rank 0") != NULL);
}

TEST(comm_shm_dead_process_detected) {
    char name[96];
    shm_name(name, sizeof name, "dead");
    pid_t pid = fork();
    if (pid == 0) {
        struct error err = {0};
        struct comm *c = NULL;
        if (comm_shm_create(name, 1, 2, 0, 10, &c, &err) != ATOMC_OK) _exit(2);
        float x = 1;
        comm_all_reduce_sum(c, &x, DTYPE_F32, 1, &err);
        kill(getpid(), SIGKILL); // dies without cleaning up
        _exit(3);
    }
    struct error err = {0};
    struct comm *c = NULL;
    ASSERT_OK(comm_shm_create(name, 0, 2, 0, 30, &c, &err)); // generous while the child starts (loaded CI)
    float x = 2;
    ASSERT_OK(comm_all_reduce_sum(c, &x, DTYPE_F32, 1, &err));
    ASSERT_EQ((int)x, 3);
    int ws = 0;
    waitpid(pid, &ws, 0);
    ASSERT_TRUE(WIFSIGNALED(ws));
    c->timeout_s = 0.5; // the peer is dead now: the next op must give up after this
    ASSERT_EQ(comm_all_reduce_sum(c, &x, DTYPE_F32, 1, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(strstr(err.msg, "timed out") != NULL);
    comm_destroy(c);
}

TEST(comm_shm_bad_arguments) {
    struct error err = {0};
    struct comm *c = NULL;
    ASSERT_EQ(comm_shm_create("noslash", 0, 2, 0, 1, &c, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(comm_shm_create("/x", 2, 2, 0, 1, &c, &err), ATOMC_ERR_INVALID_ARGUMENT);
    char name[96];
    shm_name(name, sizeof name, "one");
    ASSERT_OK(comm_shm_create(name, 0, 1, 0, 1, &c, &err));
    int32_t v = 5;
    ASSERT_EQ(comm_all_reduce_sum(c, &v, DTYPE_I32, 1, &err), ATOMC_ERR_UNSUPPORTED);
    comm_destroy(c);
}

// ---------------------------------------------------------------------------------------------
// Rendezvous

// Process body for one node: join, create the shm communicator named by the blob, check sums.
static int node_main(int nnodes, int node_rank, int port, char *msg, size_t msg_n) {
    struct rendezvous_options o = {.nnodes = nnodes, .node_rank = node_rank, .master_addr = "127.0.0.1",
                                   .master_port = port, .timeout_s = 20};
    char name[96];
    shm_name(name, sizeof name, "rdv");
    struct error err = {0};
    struct rendezvous *r = NULL;
    void *blob = NULL;
    size_t blob_len = 0;
    if (rendezvous_join(&o, name, strlen(name), &r, &blob, &blob_len, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "join: %.400s", err.msg);
        return 1;
    }
    struct comm *c = NULL;
    int rc = 0;
    if (comm_shm_create(blob, node_rank, nnodes, 0, 20, &c, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "shm: %.400s", err.msg);
        rc = 1;
    } else {
        rc = check_collectives(c, nnodes, msg, msg_n);
        comm_destroy(c);
    }
    if (!rc && rendezvous_barrier(r, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "barrier: %.400s", err.msg);
        rc = 1;
    }
    free(blob);
    rendezvous_close(r);
    return rc;
}

TEST(rendezvous_loopback_processes_share_comm) {
    const int nnodes = 4, port = test_free_port();
    pid_t pids[4];
    // Children first (they retry until node 0 listens).
    for (int k = 1; k < nnodes; k++) {
        pids[k] = fork();
        if (pids[k] == 0) {
            char msg[512] = "";
            int rc = node_main(nnodes, k, port, msg, sizeof msg);
            if (rc) fprintf(stderr, "node %d: %s\n", k, msg);
            _exit(rc);
        }
    }
    char msg[512] = "";
    int rc = node_main(nnodes, 0, port, msg, sizeof msg);
    for (int k = 1; k < nnodes; k++) {
        int ws = 0;
        waitpid(pids[k], &ws, 0);
        ASSERT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    }
    if (rc) test_fail(__FILE__, __LINE__, "node 0: %s", msg);
}

TEST(rendezvous_refused_times_out_with_clear_error) {
    struct rendezvous_options o = {.nnodes = 2, .node_rank = 1, .master_addr = "127.0.0.1",
                                   .master_port = test_free_port(), .timeout_s = 0.4};
    struct error err = {0};
    struct rendezvous *r = NULL;
    void *blob;
    size_t n;
    double t0 = time_now_s();
    ASSERT_EQ(rendezvous_join(&o, NULL, 0, &r, &blob, &n, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(time_now_s() - t0 < 5.0);
    ASSERT_TRUE(strstr(err.msg, "could not reach node 0") != NULL);
    ASSERT_TRUE(strstr(err.msg, "refused") != NULL);
    // Node 0 alone: nobody joins before the deadline.
    o.node_rank = 0;
    ASSERT_EQ(rendezvous_join(&o, "x", 1, &r, &blob, &n, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(strstr(err.msg, "1 of 2 nodes joined") != NULL);
    o.node_rank = 5;
    ASSERT_EQ(rendezvous_join(&o, NULL, 0, &r, &blob, &n, &err), ATOMC_ERR_INVALID_ARGUMENT);
}

TEST(rendezvous_world_size_mismatch) {
    const int port = test_free_port();
    pid_t pid = fork();
    if (pid == 0) {
        struct rendezvous_options o = {.nnodes = 3, .node_rank = 1, .master_addr = "127.0.0.1", .master_port = port,
                                       .timeout_s = 10};
        struct error err = {0};
        struct rendezvous *r = NULL;
        void *blob;
        size_t n;
        atomc_status st = rendezvous_join(&o, NULL, 0, &r, &blob, &n, &err);
        _exit(st == ATOMC_ERR_INVALID_ARGUMENT && strstr(err.msg, "world size mismatch") ? 0 : 1);
    }
    struct rendezvous_options o = {.nnodes = 2, .node_rank = 0, .master_addr = "127.0.0.1", .master_port = port,
                                   .timeout_s = 10};
    struct error err = {0};
    struct rendezvous *r = NULL;
    void *blob;
    size_t n;
    ASSERT_EQ(rendezvous_join(&o, "x", 1, &r, &blob, &n, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "world size mismatch: node 1 has --nnodes 3, node 0 has 2") != NULL);
    int ws = 0;
    waitpid(pid, &ws, 0);
    ASSERT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
