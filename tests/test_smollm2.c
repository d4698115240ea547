// SmolLM2-135M-Instruct from its GGUF (Q4_1, dequantized to F32 by the CPU backend) against
// HF transformers loading the same GGUF (`gguf_file=`, also dequantized to fp32): greedy
// 64-token continuations of several prompts, all run together as one continuous batch.
// References: tests/fixtures/models/smollm2_refs.json, written by tools/gen_smollm2_refs.py.
// The model path comes from $ATOMC_SMOLLM2; without it the test prints a skip note.
//
// Rule: tokens must be identical at every step whose HF top-2 margin exceeds MIN_MARGIN (fp32
// summation order differs between the two implementations, so an exact tie could flip); the
// committed prompts' margins are all above it, so in practice every token must match.
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define MIN_MARGIN 2e-3
#define MAX_PROMPTS 16
#define N_NEW 64

struct smol_prompt {
    int32_t ids[512];
    int n;
    int32_t greedy[N_NEW];
    float margins[N_NEW];
    char text[160];
};

static int load_refs(struct smol_prompt *p, int max) {
    json_error_t je;
    json_t *root = json_load_file(test_fixture("models/smollm2_refs.json"), 0, &je);
    if (!root) {
        fprintf(stderr, "cannot read smollm2_refs.json: %s\n", je.text);
        return -1;
    }
    int n = 0;
    size_t i;
    json_t *jp;
    json_array_foreach(json_object_get(root, "prompts"), i, jp) {
        if (n == max) break;
        struct smol_prompt *q = &p[n++];
        json_t *ids = json_object_get(jp, "ids"), *g = json_object_get(jp, "greedy");
        json_t *m = json_object_get(jp, "greedy_margins");
        q->n = (int)json_array_size(ids);
        for (int k = 0; k < q->n && k < 512; k++) q->ids[k] = (int32_t)json_integer_value(json_array_get(ids, (size_t)k));
        for (int k = 0; k < N_NEW; k++) {
            q->greedy[k] = (int32_t)json_integer_value(json_array_get(g, (size_t)k));
            q->margins[k] = (float)json_number_value(json_array_get(m, (size_t)k));
        }
        snprintf(q->text, sizeof q->text, "%s", json_string_value(json_object_get(jp, "text")));
    }
    json_decref(root);
    return n;
}

TEST(smollm2_greedy_64_matches_hf_gguf) {
    const char *path = getenv("ATOMC_SMOLLM2");
    if (!path || !*path) {
        fprintf(stderr, "  skip: ATOMC_SMOLLM2 is not set (scripts/fetch_model.sh prints the path)\n");
        return;
    }
    static struct smol_prompt P[MAX_PROMPTS];
    int n = load_refs(P, MAX_PROMPTS);
    ASSERT_TRUE(n >= 5);
    struct runner_options o = {
        .model_path = path, .device = "cpu", .dtype = "auto", .load_format = "auto", .kv_cache_dtype = "auto",
        .block_size = 16, .max_num_seqs = 8, .max_num_batched_tokens = 256, .max_model_len = 256,
        .cpu_kv_cache_bytes = 64u << 20, .num_threads = 0,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    ASSERT_OK(model_runner_create(&o, &r, &err));
    ASSERT_STREQ(model_runner_config(r)->architecture, "LlamaForCausalLM");
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 17u);
    struct sim_seq *q = calloc((size_t)n, sizeof *q);
    static int32_t got[MAX_PROMPTS][N_NEW];
    int n_got[MAX_PROMPTS] = {0};
    for (int i = 0; i < n; i++) sim_seq_init(&q[i], P[i].ids, P[i].n);
    // Continuous batching: up to 8 sequences, prompts chunked under a 64-token budget.
    int steps = 0;
    for (;;) {
        sim_step_begin(s);
        int budget = 64, owner[MAX_PROMPTS];
        for (int i = 0; i < n && budget > 0 && s->n_seqs < 8; i++) {
            if (n_got[i] == N_NEW) continue;
            int remaining = q[i].n_ids - q[i].n_cached;
            int take = remaining < budget ? remaining : budget;
            owner[s->n_rows] = i;
            ASSERT_EQ(sim_step_add(s, &q[i], take, take == remaining), 0);
            budget -= take;
        }
        if (s->n_seqs == 0) break;
        struct forward_batch fb = sim_step_batch(s);
        struct runner_output out;
        ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
        sim_step_commit(s);
        for (int k = 0; k < fb.n_logits; k++) {
            int i = owner[k];
            got[i][n_got[i]++] = out.ids[k];
            q[i].ids[q[i].n_ids++] = out.ids[k];
        }
        ASSERT_TRUE(++steps < 2000);
    }
    int full = 0;
    for (int i = 0; i < n; i++) {
        int same = 0;
        while (same < N_NEW && got[i][same] == P[i].greedy[same]) same++;
        fprintf(stderr, "  prompt %d (%d tokens, \"%.40s\"): %d/%d greedy tokens equal HF\n", i, P[i].n, P[i].text, same,
                N_NEW);
        if (same < N_NEW) {
            if (P[i].margins[same] > MIN_MARGIN)
                test_fail(__FILE__, __LINE__, "prompt %d: token %d is %d, HF %d (HF margin %.4f)", i, same, got[i][same],
                          P[i].greedy[same], P[i].margins[same]);
        } else {
            full++;
        }
    }
    ASSERT_TRUE(full >= 5);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
