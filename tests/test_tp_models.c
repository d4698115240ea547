// Tensor parallelism on the CPU backend: every tiny fixture model (tests/fixtures/models, all
// supported dense architectures) split over 2 and 4 ranks (threads + the shared-memory
// communicator) against the same model unsplit (TP=1) and against HF transformers.
//
// Tolerances: TP changes only the summation order of the row-parallel matmuls (each rank sums
// its slice of the inner dimension, then the all-reduce adds the partial sums), so logits must
// be within TP_RTOL * max(1, max |HF logit|) of TP=1's (fp32 on both sides), and within the
// HF tolerance of test_models.c (1e-4 relative) of HF's. Greedy tokens must equal TP=1's and
// HF's at every step up to the first one whose HF top-2 margin is below 4x the HF tolerance
// (a near-tie may flip under a different summation order; the continuations differ from there).
// The fixtures have 4 query heads and 4, 2 or 1 KV heads, so TP=4 covers split KV heads (MHA)
// and replicated KV heads (2 ranks per KV head with GQA, 4 with one KV head).
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "common/timeutil.h"
#include "model_refs.h"
#include "parallel/comm.h"
#include "parallel/rendezvous.h"
#include "parallel/tp_runner.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define TP_RTOL 2e-5
#define MARGIN_FACTOR 4.0

static struct runner_options base_options(const char *path) {
    struct runner_options o = {
        .model_path = path, .device = "cpu", .dtype = "auto", .load_format = "auto", .kv_cache_dtype = "auto",
        .block_size = 4, .num_kv_blocks = 128, .max_num_seqs = 8, .max_num_batched_tokens = 256,
        .max_model_len = 128, .num_threads = 2,
    };
    return o;
}

static const char *model_path(const char *name, char *buf, size_t n) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", name);
    snprintf(buf, n, "%s", test_fixture(rel));
    return buf;
}

// One runner of either kind behind the same two calls.
struct any_runner {
    struct model_runner *r;
    struct tp_runner *tp;
};

static int any_open(struct any_runner *a, const char *name, int tp) {
    char path[4096];
    struct runner_options o = base_options(model_path(name, path, sizeof path));
    struct error err = {0};
    memset(a, 0, sizeof *a);
    atomc_status st = tp > 1 ? tp_runner_create(&o, tp, &a->tp, &err) : model_runner_create(&o, &a->r, &err);
    if (st != ATOMC_OK) fprintf(stderr, "  %s tp=%d: %s\n", name, tp, err.msg);
    return st == ATOMC_OK ? 0 : -1;
}

static struct model_runner *any_rank0(struct any_runner *a) { return a->tp ? tp_runner_rank(a->tp, 0) : a->r; }

static atomc_status any_logits(struct any_runner *a, const struct forward_batch *fb, float *lg, struct error *err) {
    return a->tp ? tp_runner_execute_logits(a->tp, fb, lg, err) : model_runner_execute_logits(a->r, fb, lg, err);
}

static atomc_status any_execute(struct any_runner *a, const struct forward_batch *fb, struct runner_output *out,
                                struct error *err) {
    return a->tp ? tp_runner_execute(a->tp, fb, out, err) : model_runner_execute(a->r, fb, out, err);
}

static void any_free(struct any_runner *a) {
    tp_runner_free(a->tp);
    model_runner_free(a->r);
}

// Logits of every reference position of every prompt: (sum n_pos, vocab).
static float *all_logits(struct any_runner *a, const struct refs *R, unsigned seed) {
    int rows = 0;
    for (int pi = 0; pi < R->n; pi++) rows += R->p[pi].n_pos;
    float *lg = malloc(sizeof(float) * (size_t)rows * (size_t)R->vocab);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, any_rank0(a), seed);
    int off = 0;
    for (int pi = 0; pi < R->n; pi++) {
        const struct ref_prompt *p = &R->p[pi];
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, p->ids, p->n);
        sim_step_begin(s);
        if (sim_step_add(s, q, p->n, 0) != 0) abort();
        for (int k = 0; k < p->n_pos; k++) s->rows[k] = p->pos[k];
        s->n_rows = p->n_pos;
        struct forward_batch fb = sim_step_batch(s);
        struct error err = {0};
        if (any_logits(a, &fb, lg + (size_t)off * R->vocab, &err) != ATOMC_OK) {
            fprintf(stderr, "  execute_logits: %s\n", err.msg);
            free(lg);
            lg = NULL;
        }
        sim_seq_release(s, q);
        free(q);
        if (!lg) break;
        off += p->n_pos;
    }
    sim_free(s);
    free(s);
    return lg;
}

// 16 greedy tokens of prompt pi (prefill + decodes through the sampler).
static int greedy(struct any_runner *a, const struct ref_prompt *p, int32_t *got) {
    struct sim *s = malloc(sizeof *s);
    sim_init(s, any_rank0(a), 5);
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, p->ids, p->n);
    int rc = 0;
    for (int k = 0; k < N_GREEDY && !rc; k++) {
        sim_step_begin(s);
        if (sim_step_add(s, q, q->n_ids - q->n_cached, 1) != 0) abort();
        struct forward_batch fb = sim_step_batch(s);
        struct runner_output out;
        struct error err = {0};
        if (any_execute(a, &fb, &out, &err) != ATOMC_OK) {
            fprintf(stderr, "  execute: %s\n", err.msg);
            rc = -1;
            break;
        }
        sim_step_commit(s);
        got[k] = out.ids[0];
        q->ids[q->n_ids++] = out.ids[0];
    }
    sim_seq_release(s, q);
    free(q);
    sim_free(s);
    free(s);
    return rc;
}

static void check_tp(int tp) {
    for (int mi = 0; mi < N_MODELS; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(MODELS[mi], &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        double tp_tol = R.tol / LOGIT_RTOL * TP_RTOL;
        struct any_runner a1, an;
        ASSERT_EQ(any_open(&a1, MODELS[mi], 1), 0);
        ASSERT_EQ(any_open(&an, MODELS[mi], tp), 0);
        ASSERT_EQ(model_runner_config(any_rank0(&an))->vocab_size, R.vocab);
        float *l1 = all_logits(&a1, &R, 3), *ln = all_logits(&an, &R, 9);
        ASSERT_TRUE(l1 && ln);
        int rows = 0;
        for (int pi = 0; pi < R.n; pi++) rows += R.p[pi].n_pos;
        double d_tp = max_abs_diff(ln, l1, rows * R.vocab), d_hf = 0;
        for (int pi = 0, off = 0; pi < R.n; off += R.p[pi].n_pos, pi++) {
            double d = max_abs_diff(ln + (size_t)off * R.vocab, R.p[pi].logits, R.p[pi].n_pos * R.vocab);
            if (d > d_hf) d_hf = d;
        }
        free(l1);
        free(ln);
        if (!(d_tp <= tp_tol))
            test_fail(__FILE__, __LINE__, "%s TP=%d: max |logit - TP=1| = %g > %g", MODELS[mi], tp, d_tp, tp_tol);
        if (!(d_hf <= R.tol))
            test_fail(__FILE__, __LINE__, "%s TP=%d: max |logit - HF| = %g > %g", MODELS[mi], tp, d_hf, R.tol);
        int checked = 0;
        for (int pi = 0; pi < R.n; pi++) {
            int32_t g1[N_GREEDY], gn[N_GREEDY];
            ASSERT_EQ(greedy(&a1, &R.p[pi], g1), 0);
            ASSERT_EQ(greedy(&an, &R.p[pi], gn), 0);
            ASSERT_TRUE(greedy_compare(&R, &R.p[pi], gn, MODELS[mi]) >= 0);
            for (int k = 0; k < N_GREEDY; k++) {
                if (R.p[pi].margins[k] <= R.min_margin) break; // near-tie: may flip from here on
                if (gn[k] != g1[k] || gn[k] != R.p[pi].greedy[k]) {
                    test_fail(__FILE__, __LINE__, "%s TP=%d prompt %d step %d: TP %d, TP=1 %d, HF %d (margin %g)",
                              MODELS[mi], tp, pi, k, gn[k], g1[k], R.p[pi].greedy[k], R.p[pi].margins[k]);
                    break;
                }
                checked++;
            }
        }
        fprintf(stderr, "  %-18s TP=%d: max |logit - TP=1| %.2e (tol %.2e), |logit - HF| %.2e, %d greedy steps equal\n",
                MODELS[mi], tp, d_tp, tp_tol, d_hf, checked);
        ASSERT_TRUE(checked >= R.n * N_GREEDY / 2);
        any_free(&a1);
        any_free(&an);
        refs_free(&R);
    }
}

TEST(tp2_matches_tp1_and_hf) { check_tp(2); }
TEST(tp4_matches_tp1_and_hf) { check_tp(4); }

// The real SmolLM2-135M (GGUF Q4_1; 9 query heads, 3 KV heads, intermediate 1536) at TP=3:
// quantised shards (row slices of q/k/v/gate/up, 32-aligned column slices of o/down) give the
// same greedy tokens as TP=1 and logits within the stated tolerance. Skipped without ATOMC_SMOLLM2.
TEST(tp3_smollm2_gguf_matches_tp1) {
    const char *path = test_smollm2_path();
    if (!path) return;
    // The exact CPU path (cpu_exact_kernels, F32 KV): TP_RTOL is an fp32-reordering tolerance;
    // the default path's int16 activations and BF16 KV round differently reordered values
    // differently (~1e-4 relative at the logits).
    struct runner_options o = base_options(path);
    o.kv_cache_dtype = "float32";
    o.cpu_exact_kernels = true; // every rank's backend
    struct any_runner a1 = {0}, a3 = {0};
    struct error err = {0};
    atomc_status s1 = model_runner_create(&o, &a1.r, &err);
    atomc_status s3 = s1 == ATOMC_OK ? tp_runner_create(&o, 3, &a3.tp, &err) : s1;
    ASSERT_OK(s1);
    ASSERT_OK(s3);
    struct ref_prompt p = {.ids = {1, 504, 3458, 282, 4649, 314, 2}, .n = 7};
    int32_t g1[N_GREEDY], g3[N_GREEDY];
    ASSERT_EQ(greedy(&a1, &p, g1), 0);
    ASSERT_EQ(greedy(&a3, &p, g3), 0);
    for (int k = 0; k < N_GREEDY; k++) ASSERT_EQ(g3[k], g1[k]);
    // Logits of the whole prompt's last row.
    struct refs R = {.n = 1, .vocab = model_runner_config(a1.r)->vocab_size};
    R.p[0] = p;
    R.p[0].pos[0] = p.n - 1;
    R.p[0].n_pos = 1;
    float *l1 = all_logits(&a1, &R, 1), *l3 = all_logits(&a3, &R, 2);
    ASSERT_TRUE(l1 && l3);
    double scale = 1;
    for (int v = 0; v < R.vocab; v++) scale = fabs(l1[v]) > scale ? fabs(l1[v]) : scale;
    double d = max_abs_diff(l3, l1, R.vocab);
    fprintf(stderr, "  SmolLM2 Q4_1 TP=3: max |logit - TP=1| %.2e (tol %.2e), %d greedy tokens equal\n", d,
            TP_RTOL * scale, N_GREEDY);
    ASSERT_TRUE(d <= TP_RTOL * scale);
    free(l1);
    free(l3);
    any_free(&a1);
    any_free(&a3);
}

// Ranks as separate processes (the multi-node shape on one host): two processes meet through the
// TCP rendezvous on loopback, which hands out the shm segment name; each loads its shard
// (model_runner with tp_rank / tp_size / comm) and runs the same batches; rank 0's logits must
// equal TP=1's within the TP tolerance.
static int process_rank_logits(int rank, int port, const struct refs *R, float **out, char *msg, size_t msg_n) {
    struct rendezvous_options ro = {.nnodes = 2, .node_rank = rank, .master_addr = "127.0.0.1", .master_port = port,
                                    .timeout_s = 60};
    char name[96];
    snprintf(name, sizeof name, "/atomc-test-tpproc-%d", (int)getpid());
    struct error err = {0};
    struct rendezvous *rdv = NULL;
    void *blob = NULL;
    size_t blob_len = 0;
    if (rendezvous_join(&ro, name, strlen(name), &rdv, &blob, &blob_len, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "rank %d rendezvous: %.400s", rank, err.msg);
        return 1;
    }
    struct comm *c = NULL;
    int rc = 1;
    if (comm_shm_create(blob, rank, 2, 0, 60, &c, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "rank %d comm: %.400s", rank, err.msg);
    } else {
        char path[4096];
        struct runner_options o = base_options(model_path("llama_gqa", path, sizeof path));
        o.tp_rank = rank;
        o.tp_size = 2;
        o.comm = c;
        o.num_threads = 1;
        struct any_runner a = {0};
        if (model_runner_create(&o, &a.r, &err) != ATOMC_OK) {
            snprintf(msg, msg_n, "rank %d runner: %.400s", rank, err.msg);
        } else {
            *out = all_logits(&a, R, 4);
            rc = *out ? 0 : 1;
            if (rc) snprintf(msg, msg_n, "rank %d: forward failed", rank);
            any_free(&a);
        }
        comm_destroy(c);
    }
    if (!rc && rendezvous_barrier(rdv, &err) != ATOMC_OK) {
        snprintf(msg, msg_n, "rank %d final barrier: %.400s", rank, err.msg);
        rc = 1;
    }
    free(blob);
    rendezvous_close(rdv);
    return rc;
}

TEST(tp2_ranks_as_processes_via_rendezvous) {
    struct refs R;
    ASSERT_EQ(refs_load("llama_gqa", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    const int port = test_free_port();
    pid_t pid = fork();
    if (pid == 0) {
        char msg[512] = "";
        float *lg = NULL;
        int rc = process_rank_logits(1, port, &R, &lg, msg, sizeof msg);
        if (rc) fprintf(stderr, "  child: %s\n", msg);
        _exit(rc);
    }
    char msg[512] = "";
    float *ln = NULL;
    int rc = process_rank_logits(0, port, &R, &ln, msg, sizeof msg);
    int ws = 0;
    waitpid(pid, &ws, 0);
    if (rc) test_fail(__FILE__, __LINE__, "%s", msg);
    ASSERT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    struct any_runner a1;
    ASSERT_EQ(any_open(&a1, "llama_gqa", 1), 0);
    float *l1 = all_logits(&a1, &R, 3);
    ASSERT_TRUE(l1 && ln);
    int rows = 0;
    for (int pi = 0; pi < R.n; pi++) rows += R.p[pi].n_pos;
    double d = max_abs_diff(ln, l1, rows * R.vocab), tol = R.tol / LOGIT_RTOL * TP_RTOL;
    fprintf(stderr, "  llama_gqa TP=2 as 2 processes: max |logit - TP=1| %.2e (tol %.2e)\n", d, tol);
    ASSERT_TRUE(d <= tol);
    free(l1);
    free(ln);
    any_free(&a1);
    refs_free(&R);
}

// A rank process that dies (SIGKILL) after the first batch: rank 0's next forward fails with a
// timeout error naming the wait (no hang), and the one after fails at once with the same cause.
TEST(tp2_dead_rank_process_is_an_error_not_a_hang) {
    struct refs R;
    ASSERT_EQ(refs_load("llama_gqa", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    const int n_prompts = R.n;
    R.n = 1; // one prompt per batch
    char name[96];
    snprintf(name, sizeof name, "/atomc-test-tpdead-%d", (int)getpid());
    pid_t pid = fork();
    if (pid == 0) {
        struct error err = {0};
        struct comm *c = NULL;
        if (comm_shm_create(name, 1, 2, 0, 30, &c, &err) != ATOMC_OK) _exit(2);
        char path[4096];
        struct runner_options o = base_options(model_path("llama_gqa", path, sizeof path));
        o.tp_rank = 1, o.tp_size = 2, o.comm = c, o.num_threads = 1;
        struct any_runner a = {0};
        if (model_runner_create(&o, &a.r, &err) != ATOMC_OK) _exit(3);
        float *lg = all_logits(&a, &R, 4);
        if (!lg) _exit(4);
        kill(getpid(), SIGKILL);
        _exit(5);
    }
    struct error err = {0};
    struct comm *c = NULL;
    ASSERT_OK(comm_shm_create(name, 0, 2, 0, 60, &c, &err)); // generous while the child loads (loaded CI)
    char path[4096];
    struct runner_options o = base_options(model_path("llama_gqa", path, sizeof path));
    o.tp_rank = 0, o.tp_size = 2, o.comm = c, o.num_threads = 1;
    struct any_runner a = {0};
    ASSERT_OK(model_runner_create(&o, &a.r, &err));
    float *lg = all_logits(&a, &R, 4); // both ranks alive
    ASSERT_TRUE(lg != NULL);
    free(lg);
    int ws = 0;
    waitpid(pid, &ws, 0);
    ASSERT_TRUE(WIFSIGNALED(ws));
    c->timeout_s = 1.0; // the peer is dead now: the next collective must give up after this
    double t0 = time_now_s();
    ASSERT_TRUE(all_logits(&a, &R, 4) == NULL); // peer gone: timeout error (printed), not a hang
    ASSERT_TRUE(time_now_s() - t0 < 10);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, a.r, 1);
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, R.p[0].ids, R.p[0].n);
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, q, R.p[0].n, 1), 0);
    struct forward_batch fb = sim_step_batch(s);
    struct runner_output out;
    t0 = time_now_s();
    ASSERT_EQ(model_runner_execute(a.r, &fb, &out, &err), ATOMC_ERR_BACKEND);
    ASSERT_TRUE(strstr(err.msg, "timed out") != NULL); // the failure is sticky and names its cause
    ASSERT_TRUE(time_now_s() - t0 < 0.5);
    sim_seq_release(s, q);
    free(q);
    sim_free(s);
    free(s);
    any_free(&a);
    comm_destroy(c);
    R.n = n_prompts;
    refs_free(&R);
}

TEST(tp_size_must_divide_heads) {
    char path[4096];
    struct runner_options o = base_options(model_path("llama_gqa", path, sizeof path));
    struct tp_runner *t = NULL;
    struct error err = {0};
    ASSERT_EQ(tp_runner_create(&o, 3, &t, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "tensor parallel size 3 does not divide num_attention_heads 4") != NULL);
    ASSERT_TRUE(t == NULL);
    ASSERT_EQ(tp_runner_create(&o, 1, &t, &err), ATOMC_ERR_INVALID_ARGUMENT);
    o.device = "cuda";
    ASSERT_NE(tp_runner_create(&o, 2, &t, &err), ATOMC_OK); // CPU build: needs CUDA; CUDA build: GPUs or fixture
}

int main(int argc, char **argv) { return test_main(argc, argv); }
