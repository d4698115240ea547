// Qwen3-Next and Qwen3.5-MoE (src/model/qwen3_next.c) on the CPU backend against HF transformers:
// the tiny fixtures of tools/make_tiny_qwen3_next.py (hybrid Gated DeltaNet + gated attention
// layers, zero-centred norms, partial rotary, MoE with a sigmoid-gated shared expert; prompts of
// 1, 6, 37 and 130 tokens). Logits at the reference positions within LOGIT_RTOL * max(1, |logit|)
// (fp32 both sides; the BF16 checkpoints are exact in F32), greedy tokens equal where HF's top-2
// margin is clear. The recurrent state is carried in slots across steps: chunked prefill at
// several chunk sizes, a mixed batch of prefill chunks and decodes, and token-by-token decode all
// give the one-shot logits; a sequence recomputed from scratch (as after preemption) gives the
// same tokens whatever its slot held.
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/mapped_file.h"
#include "model/model.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define MARGIN_FACTOR 4.0

static const char *QN_MODELS[] = {"qwen3_next", "qwen3_5_moe"};
#define N_QN 2

static struct model_runner *open_qn(const char *name, int max_seqs) {
    char rel[256], path[4096];
    snprintf(rel, sizeof rel, "models/%s", name);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .dtype = "auto",
        .load_format = "auto",
        .kv_cache_dtype = "auto",
        .block_size = 4,
        .num_kv_blocks = 512,
        .max_num_seqs = max_seqs,
        .max_num_batched_tokens = 512,
        .max_model_len = 256,
        .num_threads = 2,
    };
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) {
        fprintf(stderr, "  %s: model_runner_create: %s\n", name, err.msg);
        return NULL;
    }
    return r;
}

// Logits of prompt p at its reference positions, fed in pieces of `chunk` tokens (0 = one shot),
// the logits of each reference position taken from the step that computes it.
static int prompt_logits(struct sim *s, struct ref_prompt *p, int chunk, int slot, float *lg, int vocab) {
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, p->ids, p->n);
    q->state_slot = slot;
    int done = 0, got = 0;
    while (done < p->n) {
        int n = chunk > 0 && p->n - done > chunk ? chunk : p->n - done;
        sim_step_begin(s);
        if (sim_step_add(s, q, n, 0) != 0) {
            fprintf(stderr, "sim_step_add failed\n");
            return -1;
        }
        s->n_rows = 0;
        int first = got;
        for (int k = 0; k < p->n_pos; k++)
            if (p->pos[k] >= done && p->pos[k] < done + n) s->rows[s->n_rows++] = p->pos[k] - done;
        struct forward_batch fb = sim_step_batch(s);
        float *tmp = malloc(sizeof(float) * (size_t)(s->n_rows ? s->n_rows : 1) * vocab);
        struct error err = {0};
        if (model_runner_execute_logits(s->r, &fb, tmp, &err) != ATOMC_OK) {
            fprintf(stderr, "execute: %s\n", err.msg);
            return -1;
        }
        memcpy(lg + (size_t)first * vocab, tmp, sizeof(float) * (size_t)s->n_rows * vocab);
        got += s->n_rows;
        free(tmp);
        sim_step_commit(s);
        done += n;
    }
    sim_seq_release(s, q);
    free(q);
    if (got != p->n_pos) fprintf(stderr, "got %d of %d positions\n", got, p->n_pos);
    return got == p->n_pos ? 0 : -1;
}

TEST(qwen3_next_logits_match_hf_one_shot_and_chunked) {
    static const int chunks[] = {0, 1, 5, 64, 17};
    for (int mi = 0; mi < N_QN; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(QN_MODELS[mi], &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_qn(QN_MODELS[mi], 4);
        ASSERT_TRUE(r != NULL);
        ASSERT_EQ(model_runner_num_state_slots(r), 4);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 3u + (unsigned)mi);
        for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
            double worst = 0;
            for (int pi = 0; pi < R.n; pi++) {
                struct ref_prompt *p = &R.p[pi];
                float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R.vocab);
                ASSERT_EQ(prompt_logits(s, p, chunks[ci], (pi + (int)ci) % 4, lg, R.vocab), 0);
                double d = max_abs_diff(lg, p->logits, p->n_pos * R.vocab);
                if (!(d <= R.tol))
                    test_fail(__FILE__, __LINE__, "%s prompt %d (%d tokens), chunk %d: max |logit - HF| = %g > %g",
                              QN_MODELS[mi], pi, p->n, chunks[ci], d, R.tol);
                if (!(d <= worst)) worst = d;
                free(lg);
            }
            fprintf(stderr, "  %-12s chunk %3d: max |logit - HF| = %.2e (tolerance %.2e)\n", QN_MODELS[mi], chunks[ci],
                    worst, R.tol);
        }
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// Every prompt at once in a continuous batch: prefill chunks of at most 7 tokens mixed with the
// decodes of sequences already generating, each sequence in its own slot; greedy tokens vs HF.
TEST(qwen3_next_mixed_batch_greedy_matches_hf) {
    for (int mi = 0; mi < N_QN; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(QN_MODELS[mi], &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_qn(QN_MODELS[mi], 8);
        ASSERT_TRUE(r != NULL);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 19u + (unsigned)mi);
        struct sim_seq *q = calloc((size_t)R.n, sizeof *q);
        int32_t got[MAX_PROMPTS][N_GREEDY];
        int n_got[MAX_PROMPTS] = {0};
        for (int pi = 0; pi < R.n; pi++) {
            sim_seq_init(&q[pi], R.p[pi].ids, R.p[pi].n);
            q[pi].state_slot = 7 - pi; // not the sequence index
        }
        for (int step = 0; step < 200; step++) {
            sim_step_begin(s);
            int idx[MAX_PROMPTS], n_in = 0;
            for (int pi = 0; pi < R.n; pi++) {
                if (n_got[pi] == N_GREEDY || step < pi * 3) continue; // staggered arrivals
                int rem = q[pi].n_ids - q[pi].n_cached, n = rem > 7 ? 7 : rem;
                ASSERT_EQ(sim_step_add(s, &q[pi], n, n == rem), 0);
                if (n == rem) idx[n_in++] = pi;
            }
            if (s->n_seqs == 0) {
                if (n_in == 0 && step > 3 * R.n) break;
                continue;
            }
            struct forward_batch fb = sim_step_batch(s);
            struct runner_output out;
            struct error err = {0};
            ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
            sim_step_commit(s);
            for (int k = 0; k < n_in; k++) {
                int pi = idx[k];
                got[pi][n_got[pi]++] = out.ids[k];
                q[pi].ids[q[pi].n_ids++] = out.ids[k];
            }
        }
        int checked = 0;
        for (int pi = 0; pi < R.n; pi++) {
            ASSERT_EQ(n_got[pi], N_GREEDY);
            char what[96];
            snprintf(what, sizeof what, "%s prompt %d (mixed batch)", QN_MODELS[mi], pi);
            int c = greedy_compare(&R, &R.p[pi], got[pi], what);
            ASSERT_TRUE(c >= 0);
            checked += c;
        }
        fprintf(stderr, "  %-12s mixed batch: %d greedy steps with a clear margin matched HF\n", QN_MODELS[mi],
                checked);
        ASSERT_TRUE(checked >= R.n * N_GREEDY / 2);
        free(q);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// Recompute after preemption: a sequence decodes a few tokens, is dropped (blocks released, its
// slot handed to another sequence that runs meanwhile), then recomputed from position 0 in a new
// slot that holds another sequence's state: the continuation equals the uninterrupted one.
TEST(qwen3_next_recompute_gives_same_tokens) {
    struct refs R;
    ASSERT_EQ(refs_load("qwen3_next", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    struct model_runner *r = open_qn("qwen3_next", 4);
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 5u);
    struct ref_prompt *p = &R.p[2];
    struct sim_seq *a = malloc(sizeof *a), *other = malloc(sizeof *other);
    int32_t base[12], again[12];
    // Uninterrupted: prefill + 11 decodes in slot 0.
    sim_seq_init(a, p->ids, p->n);
    for (int k = 0; k < 12; k++) {
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, a, a->n_ids - a->n_cached, 1), 0);
        struct forward_batch fb = sim_step_batch(s);
        struct runner_output out;
        struct error err = {0};
        ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
        sim_step_commit(s);
        base[k] = out.ids[0];
        a->ids[a->n_ids++] = out.ids[0];
    }
    sim_seq_release(s, a);
    // Interrupted: 5 tokens in slot 1, preempted; another prompt then runs in slot 2 (and leaves
    // its state there); the sequence is recomputed (prompt + its 5 tokens) in slot 2.
    sim_seq_init(a, p->ids, p->n);
    a->state_slot = 1;
    for (int k = 0; k < 12; k++) {
        if (k == 5) {
            sim_seq_release(s, a);
            a->n_cached = 0;
            sim_seq_init(other, R.p[3].ids, R.p[3].n);
            other->state_slot = 2;
            sim_step_begin(s);
            ASSERT_EQ(sim_step_add(s, other, other->n_ids, 1), 0);
            struct forward_batch fb = sim_step_batch(s);
            struct runner_output out;
            struct error err = {0};
            ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
            sim_step_commit(s);
            sim_seq_release(s, other);
            a->state_slot = 2;
        }
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, a, a->n_ids - a->n_cached, 1), 0);
        struct forward_batch fb = sim_step_batch(s);
        struct runner_output out;
        struct error err = {0};
        ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
        sim_step_commit(s);
        again[k] = out.ids[0];
        a->ids[a->n_ids++] = out.ids[0];
    }
    for (int k = 0; k < 12; k++)
        ASSERT_EQ(again[k], base[k]);
    sim_seq_release(s, a);
    free(a);
    free(other);
    sim_free(s);
    free(s);
    model_runner_free(r);
    refs_free(&R);
}

// Bad state slots are errors, not crashes.
TEST(qwen3_next_bad_state_slots_rejected) {
    struct model_runner *r = open_qn("qwen3_5_moe", 4);
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 1u);
    struct sim_seq *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    int32_t ids[3] = {5, 6, 7};
    sim_seq_init(a, ids, 3);
    sim_seq_init(b, ids, 3);
    const int bad[][2] = {{0, 0}, {-1, 1}, {0, 4}, {4, 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        a->state_slot = bad[i][0];
        b->state_slot = bad[i][1];
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, a, 3, 1), 0);
        ASSERT_EQ(sim_step_add(s, b, 3, 1), 0);
        struct forward_batch fb = sim_step_batch(s);
        struct runner_output out;
        struct error err = {0};
        ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
        ASSERT_TRUE(strstr(err.msg, "state slot") != NULL);
        fb.state_slots = NULL;
        ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    }
    sim_seq_release(s, a);
    sim_seq_release(s, b);
    free(a);
    free(b);
    sim_free(s);
    free(s);
    model_runner_free(r);
}

// The benchmark shapes parse, plan and count exactly the parameters transformers builds for them
// (Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM on the meta device, without MTP or vision).
TEST(qwen3_next_bench_configs) {
    static const struct {
        const char *file;
        enum model_arch arch;
        int64_t params;
        int experts, topk;
    } cfgs[] = {{"bench/configs/qwen3_next_80b_a3b.json", MODEL_ARCH_QWEN3_NEXT, 79674391296LL, 512, 10},
                {"bench/configs/qwen3_5_35b_a3b.json", MODEL_ARCH_QWEN3_5_MOE, 34660610688LL, 256, 8}};
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
        char *json = NULL;
        ASSERT_OK(file_read_all(cfgs[i].file, &json, NULL, NULL));
        struct model_config c;
        struct error err = {0};
        ASSERT_OK(model_config_parse_json(&c, json, cfgs[i].file, &err));
        ASSERT_OK(model_config_validate(&c, cfgs[i].file, &err));
        free(json);
        ASSERT_EQ(c.arch, cfgs[i].arch);
        ASSERT_EQ(c.num_experts, cfgs[i].experts);
        ASSERT_EQ(c.num_experts_per_tok, cfgs[i].topk);
        ASSERT_EQ(c.rope.rotary_dim, 64);
        ASSERT_TRUE(c.norm_topk_prob && c.qk_norm && c.norm_zero_centered);
        for (int l = 0; l < c.num_layers; l++) {
            ASSERT_EQ(c.layer_types[l], (l + 1) % 4 ? LAYER_ATTN_LINEAR : LAYER_ATTN_FULL);
            ASSERT_TRUE(model_config_layer_is_moe(&c, l));
        }
        int64_t n = model_param_count(&c);
        fprintf(stderr, "  %s: %lld parameters\n", cfgs[i].file, (long long)n);
        ASSERT_EQ(n, cfgs[i].params);
        // CUDA's table takes the real shapes (gated attention of head_dim 256, DeltaNet heads of
        // 128); a backend without the Gated DeltaNet ops refuses them by name.
        struct model_load_options lo = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
        ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &lo, &err));
        struct backend_caps off = backend_cuda_caps;
        off.gated_deltanet = false;
        err = (struct error){0};
        ASSERT_EQ(model_check_backend_caps(&c, &off, &lo, &err), ATOMC_ERR_UNSUPPORTED);
        ASSERT_TRUE(strstr(err.msg, "Gated DeltaNet") && strstr(err.msg, "cuda"));
    }
}

// Dummy weights of the fixture's config load (no reorders, no norm offsets) and run finite.
TEST(qwen3_next_dummy_weights_run) {
    for (int mi = 0; mi < N_QN; mi++) {
        char rel[256], path[4096];
        snprintf(rel, sizeof rel, "models/%s", QN_MODELS[mi]);
        snprintf(path, sizeof path, "%s", test_fixture(rel));
        struct runner_options o = {.model_path = path,
                                   .device = "cpu",
                                   .load_format = "dummy",
                                   .block_size = 4,
                                   .num_kv_blocks = 64,
                                   .max_num_seqs = 2,
                                   .max_num_batched_tokens = 64,
                                   .max_model_len = 128,
                                   .num_threads = 2,
                                   .dummy_seed = 3};
        struct model_runner *r = NULL;
        struct error err = {0};
        ASSERT_OK(model_runner_create(&o, &r, &err));
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 2u);
        struct sim_seq *q = calloc(1, sizeof *q);
        int32_t ids[70];
        for (int i = 0; i < 70; i++)
            ids[i] = 4 + (i * 7) % 200;
        sim_seq_init(q, ids, 70);
        q->state_slot = 1;
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, q, 64, 1), 0);
        struct forward_batch fb = sim_step_batch(s);
        float *lg = malloc(sizeof(float) * 256);
        ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
        for (int v = 0; v < 256; v++)
            ASSERT_TRUE(isfinite(lg[v]));
        free(lg);
        sim_seq_release(s, q);
        free(q);
        sim_free(s);
        free(s);
        model_runner_free(r);
    }
}

// What the family does not implement is refused at load with a message naming it.
TEST(qwen3_next_bad_configs_rejected) {
    static const char *base =
        "{\"architectures\":[\"%s\"],\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":64,\"vocab_size\":256,"
        "\"num_experts\":4,\"moe_intermediate_size\":32,\"linear_num_key_heads\":2,"
        "\"linear_key_head_dim\":16,\"linear_value_head_dim\":16%s%s}";
    // Keys a case may override; appended with these values unless the case sets them.
    static const char *defaults[][2] = {
        {"linear_num_value_heads", ":4"}, {"shared_expert_intermediate_size", ":32"}, {"num_experts_per_tok", ":2"}};
    static const struct {
        const char *arch, *extra, *want;
    } bad[] = {
        {"Qwen3NextForCausalLM", ",\"linear_num_value_heads\":3", "multiple"},
        {"Qwen3NextForCausalLM", ",\"attention_bias\":true", "biases"},
        {"Qwen3NextForCausalLM", ",\"shared_expert_intermediate_size\":0", "shared_expert_intermediate_size"},
        {"Qwen3NextForCausalLM", ",\"linear_conv_kernel_dim\":65", "linear_conv_kernel_dim"},
        {"Qwen3_5MoeForCausalLM", ",\"num_experts_per_tok\":5", "num_experts_per_tok"},
        {"Qwen3_5MoeForConditionalGeneration", "", "not supported"},
        {"Qwen3NextForCausalLM", ",\"layer_types\":[\"linear_attention\",\"linear_attention\"]", "full-attention"},
        {"Qwen3NextForCausalLM",
         ",\"layer_types\":[\"linear_attention\",\"sliding_attention\"],"
         "\"use_sliding_window\":true,\"sliding_window\":8",
         "sliding"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char json[2048], path[512], more[256] = "";
        for (size_t d = 0; d < sizeof defaults / sizeof defaults[0]; d++)
            if (!strstr(bad[i].extra, defaults[d][0]))
                snprintf(more + strlen(more), sizeof more - strlen(more), ",\"%s\"%s", defaults[d][0], defaults[d][1]);
        snprintf(json, sizeof json, base, bad[i].arch, bad[i].extra, more);
        snprintf(path, sizeof path, "%s", test_tmp_path("config.json"));
        test_write_file(path, json, strlen(json));
        struct runner_options o = {.model_path = path,
                                   .device = "cpu",
                                   .load_format = "dummy",
                                   .block_size = 4,
                                   .num_kv_blocks = 64,
                                   .max_num_seqs = 2,
                                   .max_num_batched_tokens = 64,
                                   .max_model_len = 128,
                                   .num_threads = 2};
        struct model_runner *r = NULL;
        struct error err = {0};
        ASSERT_TRUE(model_runner_create(&o, &r, &err) != ATOMC_OK);
        ASSERT_TRUE(r == NULL);
        fprintf(stderr, "  rejected: %s\n", err.msg);
        if (!strstr(err.msg, bad[i].want))
            test_fail(__FILE__, __LINE__, "case %zu: '%s' does not name '%s'", i, err.msg, bad[i].want);
    }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
