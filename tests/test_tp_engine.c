// The engine end to end with --tensor-parallel-size on the CPU backend: every prompt of a tiny
// fixture model submitted at once (continuous batching, chunked prefill under a small token
// budget, a small KV pool) through atomc_engine with TP=2 and TP=4 gives the same greedy tokens
// as TP=1, compared up to the first position whose TP=1 top-2 logprob margin is below 1e-3 (a
// near tie that summation order may flip). Also: the engine reports a TP size that does not
// divide the heads as a creation error.
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "test.h"

struct out {
    int32_t toks[64];
    float margin[64];
    int n;
    atomc_finish_reason reason;
};

static void on_out(void *user, const atomc_output *o) {
    struct out *c = user;
    for (int i = 0; i < o->n_new_tokens && c->n < 64; i++) {
        c->toks[c->n] = o->new_tokens[i];
        c->margin[c->n] = o->logprobs && o->logprobs[i].n_top >= 2
                              ? o->logprobs[i].top[0].logprob - o->logprobs[i].top[1].logprob
                              : 1e9f;
        c->n++;
    }
    if (o->finish_reason != ATOMC_FINISH_NONE) c->reason = o->finish_reason;
}

static atomc_engine *make(const char *model, int tp, char *err, size_t err_n) {
    char rel[256], path[1024];
    snprintf(rel, sizeof rel, "models/%s", model);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = path;
    o.block_size = 4;
    o.num_kv_blocks = 64;
    o.max_num_seqs = 8;
    o.max_num_batched_tokens = 24;
    o.num_threads = 2;
    o.tensor_parallel_size = tp;
    atomc_engine *e = NULL;
    if (atomc_engine_create(&o, &e, err, err_n) != ATOMC_OK) return NULL;
    return e;
}

#define N_PROMPTS 6
static int run_all(const char *model, int tp, struct out *outs) {
    char err[512];
    atomc_engine *e = make(model, tp, err, sizeof err);
    if (!e) {
        fprintf(stderr, "  %s tp=%d: %s\n", model, tp, err);
        return -1;
    }
    static int32_t ids[N_PROMPTS][40];
    for (int p = 0; p < N_PROMPTS; p++) {
        int n = 5 + 6 * p;
        for (int i = 0; i < n; i++) ids[p][i] = (int32_t)((p * 37 + i * 11 + 3) % 250 + 1);
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = ids[p];
        r.n_prompt_ids = n;
        r.params.temperature = 0;
        r.params.max_tokens = 12;
        r.params.ignore_eos = true;
        r.params.logprobs = 2;
        r.on_output = on_out;
        memset(&outs[p], 0, sizeof outs[p]);
        r.user = &outs[p];
        if (atomc_engine_add_request(e, &r, NULL, err, sizeof err) != ATOMC_OK) {
            fprintf(stderr, "  add: %s\n", err);
            atomc_engine_free(e);
            return -1;
        }
    }
    while (atomc_engine_has_work(e)) atomc_engine_step(e);
    atomc_engine_free(e);
    return 0;
}

static void check_model(const char *model) {
    struct out ref[N_PROMPTS], got[N_PROMPTS];
    ASSERT_EQ(run_all(model, 1, ref), 0);
    for (int tp = 2; tp <= 4; tp *= 2) {
        ASSERT_EQ(run_all(model, tp, got), 0);
        int compared = 0;
        for (int p = 0; p < N_PROMPTS; p++) {
            ASSERT_EQ(got[p].reason, ATOMC_FINISH_LENGTH);
            ASSERT_EQ(got[p].n, 12);
            for (int k = 0; k < ref[p].n; k++) {
                if (got[p].toks[k] != ref[p].toks[k]) {
                    test_fail(__FILE__, __LINE__, "%s TP=%d prompt %d token %d: %d != TP=1 %d", model, tp, p, k,
                              got[p].toks[k], ref[p].toks[k]);
                    return;
                }
                compared++;
                if (ref[p].margin[k] < 1e-3f) break;
            }
        }
        fprintf(stderr, "  %-12s TP=%d: %d tokens equal to TP=1 over %d batched prompts\n", model, tp, compared,
                N_PROMPTS);
        ASSERT_TRUE(compared >= N_PROMPTS * 6);
    }
}

TEST(tp_engine_llama_gqa) { check_model("llama_gqa"); }
TEST(tp_engine_qwen3) { check_model("qwen3"); }
TEST(tp_engine_llama_tied) { check_model("llama_tied"); }

TEST(tp_engine_rejects_indivisible_size) {
    char err[512] = "";
    atomc_engine *e = make("llama_gqa", 3, err, sizeof err);
    ASSERT_TRUE(e == NULL);
    ASSERT_TRUE(strstr(err, "tensor parallel size 3 does not divide num_attention_heads 4") != NULL);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
