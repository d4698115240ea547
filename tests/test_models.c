// Whole-model tests on the CPU backend against HF transformers: tiny random-weight
// checkpoints of every supported architecture (tests/fixtures/models/*, written with their
// reference outputs by tools/make_tiny_models.py, tools/make_tiny_moe_models.py and tools/make_tiny_deepseek.py).
//
// Tolerances: logits must be within LOGIT_RTOL * max(1, max |HF logit|) of HF (fp32 on both
// sides; BF16/F16 checkpoints are exact in F32). Greedy tokens must equal HF's at every step
// whose HF top-2 margin exceeds MARGIN_FACTOR times that tolerance (below it, fp32 summation
// order may legitimately flip the argmax; after such a flip the continuations differ, so the
// comparison of that prompt stops there).
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/mapped_file.h"
#include "model/model.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define MARGIN_FACTOR 4.0


static struct runner_options base_options(const char *path) {
    struct runner_options o = {
        .model_path = path, .device = "cpu", .dtype = "auto", .load_format = "auto", .kv_cache_dtype = "auto",
        .block_size = 4, .num_kv_blocks = 256, .max_num_seqs = 8, .max_num_batched_tokens = 256,
        .max_model_len = 128, .num_threads = 2,
    };
    return o;
}

static struct model_runner *open_model(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", name);
    char path[4096];
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    struct runner_options o = base_options(path);
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) {
        fprintf(stderr, "  %s: model_runner_create: %s\n", name, err.msg);
        return NULL;
    }
    return r;
}

// Full-prompt logits at the reference positions, one prefill per prompt.
TEST(models_logits_match_hf) {
    for (int mi = 0; mi < N_CPU_MODELS; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(cpu_models(mi), &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_model(cpu_models(mi));
        ASSERT_TRUE(r != NULL);
        ASSERT_EQ(model_runner_config(r)->vocab_size, R.vocab);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 7u + (unsigned)mi);
        double worst = 0;
        for (int pi = 0; pi < R.n; pi++) {
            struct ref_prompt *p = &R.p[pi];
            struct sim_seq *q = malloc(sizeof *q);
            sim_seq_init(q, p->ids, p->n);
            sim_step_begin(s);
            ASSERT_EQ(sim_step_add(s, q, p->n, 0), 0);
            for (int k = 0; k < p->n_pos; k++) s->rows[k] = p->pos[k];
            s->n_rows = p->n_pos;
            struct forward_batch fb = sim_step_batch(s);
            float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R.vocab);
            struct error err = {0};
            ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
            double d = max_abs_diff(lg, p->logits, p->n_pos * R.vocab);
            if (!(d <= R.tol))
                test_fail(__FILE__, __LINE__, "%s prompt %d (%d tokens): max |logit - HF| = %g > %g", cpu_models(mi), pi,
                          p->n, d, R.tol);
            if (d > worst) worst = d;
            free(lg);
            sim_seq_release(s, q);
            free(q);
        }
        fprintf(stderr, "  %-18s max |logit - HF| = %.2e (tolerance %.2e)\n", cpu_models(mi), worst, R.tol);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// Prefill, then 16 greedy decode steps through the runner's sampler, one sequence at a time.
TEST(models_greedy_match_hf) {
    for (int mi = 0; mi < N_CPU_MODELS; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(cpu_models(mi), &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_model(cpu_models(mi));
        ASSERT_TRUE(r != NULL);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 11u + (unsigned)mi);
        int checked = 0;
        for (int pi = 0; pi < R.n; pi++) {
            struct ref_prompt *p = &R.p[pi];
            struct sim_seq *q = malloc(sizeof *q);
            sim_seq_init(q, p->ids, p->n);
            int32_t got[N_GREEDY];
            struct error err = {0};
            ASSERT_OK(sim_greedy(s, q, N_GREEDY, got, &err));
            char what[128];
            snprintf(what, sizeof what, "%s prompt %d", cpu_models(mi), pi);
            int c = greedy_compare(&R, p, got, what);
            ASSERT_TRUE(c >= 0);
            checked += c;
            sim_seq_release(s, q);
            free(q);
        }
        fprintf(stderr, "  %-18s %d greedy steps with a clear margin matched HF\n", cpu_models(mi), checked);
        ASSERT_TRUE(checked >= R.n * N_GREEDY / 2); // the comparison must have teeth
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// All prompts of a model at once, as the engine would run them: a token budget per step,
// prompts chunked (at most 7 tokens of one prompt per step), decodes mixed with prefill
// chunks in the same batch. Every sequence's greedy continuation must equal HF's.
TEST(models_mixed_batch_chunked_prefill) {
    for (int mi = 0; mi < N_CPU_MODELS; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(cpu_models(mi), &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_model(cpu_models(mi));
        ASSERT_TRUE(r != NULL);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 99u + (unsigned)mi);
        struct sim_seq *q = calloc((size_t)R.n, sizeof *q);
        int32_t got[MAX_PROMPTS][N_GREEDY];
        int n_got[MAX_PROMPTS] = {0};
        for (int pi = 0; pi < R.n; pi++) sim_seq_init(&q[pi], R.p[pi].ids, R.p[pi].n);
        int steps = 0, mixed_steps = 0;
        for (;;) {
            sim_step_begin(s);
            int budget = 16, n_prefill = 0, n_decode = 0, owner[MAX_PROMPTS];
            // Start sequences in a staggered way (sequence i joins at step 2 i) so prefill
            // chunks of late arrivals mix with decodes of early ones.
            for (int pi = 0; pi < R.n && budget > 0; pi++) {
                if (n_got[pi] == N_GREEDY || steps < 2 * pi) continue;
                int remaining = q[pi].n_ids - q[pi].n_cached;
                int take = remaining < 7 ? remaining : 7;
                if (take > budget) take = budget;
                int completes = take == remaining;
                owner[s->n_rows] = pi;
                ASSERT_EQ(sim_step_add(s, &q[pi], take, completes), 0);
                budget -= take;
                if (take > 1 || !completes) n_prefill++;
                else n_decode++;
            }
            if (s->n_seqs == 0) break;
            if (n_prefill && n_decode) mixed_steps++;
            struct forward_batch fb = sim_step_batch(s);
            struct runner_output out;
            struct error err = {0};
            ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
            sim_step_commit(s);
            for (int k = 0; k < fb.n_logits; k++) {
                int pi = owner[k];
                got[pi][n_got[pi]++] = out.ids[k];
                q[pi].ids[q[pi].n_ids++] = out.ids[k];
            }
            steps++;
            ASSERT_TRUE(steps < 1000);
        }
        ASSERT_TRUE(mixed_steps > 0);
        for (int pi = 0; pi < R.n; pi++) {
            char what[128];
            snprintf(what, sizeof what, "%s mixed batch, prompt %d", cpu_models(mi), pi);
            ASSERT_TRUE(greedy_compare(&R, &R.p[pi], got[pi], what) >= 0);
        }
        free(q);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// A prompt split into chunks ending exactly at the reference positions: the logits of each
// chunk's last token equal HF's full-prompt logits there.
TEST(models_chunked_prefill_logits) {
    for (int mi = 0; mi < N_PREFIX_MODELS; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(prefix_models(mi), &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_model(prefix_models(mi));
        ASSERT_TRUE(r != NULL);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 5u);
        struct ref_prompt *p = &R.p[R.n - 1]; // the longest prompt
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, p->ids, p->n);
        float *lg = malloc(sizeof(float) * (size_t)R.vocab);
        for (int k = 0; k < p->n_pos; k++) {
            int end = p->pos[k] + 1;
            sim_step_begin(s);
            ASSERT_EQ(sim_step_add(s, q, end - q->n_cached, 1), 0);
            struct forward_batch fb = sim_step_batch(s);
            struct error err = {0};
            ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
            sim_step_commit(s);
            double d = max_abs_diff(lg, p->logits + (size_t)k * R.vocab, R.vocab);
            if (!(d <= R.tol))
                test_fail(__FILE__, __LINE__, "%s chunk ending at %d: max |logit - HF| = %g > %g", prefix_models(mi), p->pos[k],
                          d, R.tol);
        }
        free(lg);
        free(q);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// Prefix-cache reuse: sequence B shares A's full KV blocks of the prompt and computes only
// the tail; its last-position logits and greedy continuation equal HF's for the prompt.
TEST(models_prefix_cache_reuse) {
    for (int mi = 0; mi < N_PREFIX_MODELS; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(prefix_models(mi), &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct model_runner *r = open_model(prefix_models(mi));
        ASSERT_TRUE(r != NULL);
        int bs = model_runner_block_size(r);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 3u);
        struct ref_prompt *p = &R.p[R.n - 1];
        struct sim_seq *a = malloc(sizeof *a), *b = malloc(sizeof *b);
        sim_seq_init(a, p->ids, p->n);
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, a, p->n, 0), 0);
        struct forward_batch fb = sim_step_batch(s);
        s->n_rows = 0;
        fb.n_logits = 0;
        struct runner_output out;
        struct error err = {0};
        ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
        sim_step_commit(s);

        sim_seq_init(b, p->ids, p->n);
        int shared = (p->n - 1) / bs; // full blocks, leaving at least one token to compute
        for (int j = 0; j < shared; j++) b->blocks[j] = a->blocks[j];
        b->n_blocks = shared;
        b->n_cached = shared * bs;
        float *lg = malloc(sizeof(float) * (size_t)R.vocab);
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, b, p->n - b->n_cached, 1), 0);
        fb = sim_step_batch(s);
        ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
        sim_step_commit(s);
        double d = max_abs_diff(lg, p->logits + (size_t)(p->n_pos - 1) * R.vocab, R.vocab);
        if (!(d <= R.tol))
            test_fail(__FILE__, __LINE__, "%s: prefix-cached tail (%d of %d tokens recomputed): max |logit - HF| = %g",
                      prefix_models(mi), p->n - shared * bs, p->n, d);
        // Continue B greedily from its own last logits.
        int32_t got[N_GREEDY];
        int best = 0;
        for (int v = 1; v < R.vocab; v++)
            if (lg[v] > lg[best]) best = v;
        got[0] = best;
        b->ids[b->n_ids++] = best;
        for (int k = 1; k < N_GREEDY; k++) {
            sim_step_begin(s);
            ASSERT_EQ(sim_step_add(s, b, 1, 1), 0);
            fb = sim_step_batch(s);
            ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
            sim_step_commit(s);
            got[k] = out.ids[0];
            b->ids[b->n_ids++] = out.ids[0];
        }
        char what[128];
        snprintf(what, sizeof what, "%s prefix-cached", prefix_models(mi));
        ASSERT_TRUE(greedy_compare(&R, p, got, what) >= 0);
        free(lg);
        free(a);
        free(b);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// Prompt logprobs (echo): logprob of the next prompt token and the top-k, against HF's
// log-softmax; plus the sampled token's logprob.
TEST(models_prompt_logprobs) {
    struct refs R;
    ASSERT_EQ(refs_load("llama_gqa", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    struct model_runner *r = open_model("llama_gqa");
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 1u);
    struct ref_prompt *p = &R.p[R.n - 1];
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, p->ids, p->n);
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, q, p->n, 1), 0);
    s->samp[0].n_logprobs = 3;
    struct forward_batch fb = sim_step_batch(s);
    int32_t lp_rows[MAX_POS], lp_targets[MAX_POS];
    int n_lp = 0;
    for (int k = 0; k < p->n_pos; k++)
        if (p->pos[k] + 1 < p->n) {
            lp_rows[n_lp] = p->pos[k];
            lp_targets[n_lp++] = p->ids[p->pos[k] + 1];
        }
    const int K = 5;
    fb.n_prompt_lp = n_lp;
    fb.prompt_lp_rows = lp_rows;
    fb.prompt_lp_targets = lp_targets;
    fb.prompt_lp_k = K;
    struct runner_output out;
    struct error err = {0};
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    ASSERT_TRUE(out.prompt_lp != NULL);
    for (int i = 0; i < n_lp; i++) {
        const float *hf = p->logits + (size_t)i * R.vocab;
        double mx = hf[0], sum = 0;
        for (int v = 1; v < R.vocab; v++) mx = hf[v] > mx ? hf[v] : mx;
        for (int v = 0; v < R.vocab; v++) sum += exp(hf[v] - mx);
        double lse = mx + log(sum);
        ASSERT_NEAR(out.prompt_lp[i], hf[lp_targets[i]] - lse, 2 * R.tol);
        // Top-k: best first, values equal HF's k largest log-probs.
        float sorted[8];
        for (int k = 0; k < K; k++) {
            float best = -INFINITY;
            for (int v = 0; v < R.vocab; v++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= sorted[j] == hf[v];
                if (!taken && hf[v] > best) best = hf[v];
            }
            sorted[k] = best;
            ASSERT_NEAR(out.prompt_top_logprobs[i * K + k], best - lse, 2 * R.tol);
            ASSERT_NEAR(hf[out.prompt_top_ids[i * K + k]], best, 2 * R.tol);
        }
    }
    // The sampled (greedy) token: HF's argmax at the last position, with its logprob.
    const float *hf = p->logits + (size_t)(p->n_pos - 1) * R.vocab;
    double mx = hf[0], sum = 0;
    for (int v = 1; v < R.vocab; v++) mx = hf[v] > mx ? hf[v] : mx;
    for (int v = 0; v < R.vocab; v++) sum += exp(hf[v] - mx);
    ASSERT_EQ(out.ids[0], p->greedy[0]);
    ASSERT_NEAR(out.logprobs[0], mx - (mx + log(sum)), 2 * R.tol);
    ASSERT_EQ(out.top_stride, 3);
    ASSERT_EQ(out.top_ids[0], p->greedy[0]);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
    refs_free(&R);
}

// Penalty histories reach the sampler row by row: two sequences in one batch with different
// penalties and histories; the greedy ids equal the argmax of the raw logits penalised on the
// host with vLLM's definitions (repetition over prompt + output, frequency / presence over output).
TEST(models_penalties_reach_sampler) {
    struct model_runner *r = open_model("llama_gqa");
    ASSERT_TRUE(r != NULL);
    const int V = model_runner_config(r)->vocab_size;
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 4u);
    struct sim_seq *q = calloc(2, sizeof *q);
    int32_t a_ids[9] = {10, 11, 12, 13, 14, 15, 16, 17, 18}, b_ids[5] = {40, 41, 42, 43, 44};
    sim_seq_init(&q[0], a_ids, 9);
    sim_seq_init(&q[1], b_ids, 5);
    float *raw = malloc(sizeof(float) * 2 * (size_t)V);
    struct error err = {0};
    // Raw logits of both rows first (execute_logits writes the same K/V that execute then rewrites).
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, &q[0], 9, 1), 0);
    ASSERT_EQ(sim_step_add(s, &q[1], 5, 1), 0);
    struct forward_batch fb = sim_step_batch(s);
    ASSERT_OK(model_runner_execute_logits(r, &fb, raw, &err));
    // Penalise each row's current top tokens so the choice must change: outputs are the top-3
    // raw tokens of each row (as if generated before), the prompt is the prompt.
    int32_t outs[2][3];
    for (int row = 0; row < 2; row++)
        for (int k = 0; k < 3; k++) {
            int best = -1;
            for (int v = 0; v < V; v++) {
                bool used = false;
                for (int j = 0; j < k; j++) used |= outs[row][j] == v;
                if (!used && (best < 0 || raw[row * V + v] > raw[row * V + best])) best = v;
            }
            outs[row][k] = best;
        }
    s->samp[0].repetition_penalty = 1.8f;
    s->samp[0].output_ids = outs[0];
    s->samp[0].n_output = 3;
    s->samp[1].frequency_penalty = 0.7f;
    s->samp[1].presence_penalty = 2.5f;
    s->samp[1].output_ids = outs[1];
    s->samp[1].n_output = 2;
    struct runner_output out;
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err));
    for (int row = 0; row < 2; row++) {
        const struct sample_row *sr = &s->samp[row];
        float *w = raw + (size_t)row * V;
        for (int v = 0; v < V; v++) {
            bool in_hist = false;
            int count = 0;
            for (int j = 0; j < sr->n_prompt; j++) in_hist |= sr->prompt_ids[j] == v;
            for (int j = 0; j < sr->n_output; j++) count += sr->output_ids[j] == v;
            if (in_hist || count) w[v] = w[v] > 0 ? w[v] / sr->repetition_penalty : w[v] * sr->repetition_penalty;
            w[v] -= sr->frequency_penalty * count + sr->presence_penalty * (count > 0);
        }
        int best = 0;
        for (int v = 1; v < V; v++) best = w[v] > w[best] ? v : best;
        ASSERT_EQ(out.ids[row], best);
        ASSERT_NE(out.ids[row], outs[row][0]); // the penalty changed the choice
    }
    free(raw);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
}

// Bad batches are rejected with a status and a message; the runner keeps working.
TEST(models_bad_batches_rejected) {
    struct model_runner *r = open_model("llama_gqa");
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 2u);
    int32_t ids[5] = {5, 6, 7, 8, 9};
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, ids, 5);
    struct runner_output out;
    struct error err = {0};

    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, q, 5, 1), 0);
    struct forward_batch fb = sim_step_batch(s);
    s->tok[2] = 100000; // outside the vocabulary
    ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "vocabulary") != NULL);
    s->tok[2] = 7;
    s->slot[1] = 1 << 30; // outside the KV pool
    ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "slot") != NULL);
    s->slot[1] = q->blocks[0] * s->bs + 1;
    s->bt[0] = -3; // bad block id
    ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    s->bt[0] = q->blocks[0];
    s->ctx[0] = 2; // fewer than the new tokens
    ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    s->ctx[0] = 5;
    fb.n_tokens = 100000;
    ASSERT_EQ(model_runner_execute(r, &fb, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "max_num_batched_tokens") != NULL);
    fb.n_tokens = 5;
    ASSERT_OK(model_runner_execute(r, &fb, &out, &err)); // still fine afterwards
    ASSERT_TRUE(out.ids[0] >= 0 && out.ids[0] < model_runner_config(r)->vocab_size);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
}

// Bad models and options give clear errors, never a crash.
TEST(models_bad_models_rejected) {
    struct error err = {0};
    struct model_runner *r = NULL;
    struct runner_options o = base_options("/nonexistent/model/dir");
    ASSERT_NE(model_runner_create(&o, &r, &err), ATOMC_OK);
    ASSERT_TRUE(r == NULL);
    ASSERT_TRUE(strlen(err.msg) > 0);

    // An architecture we do not run.
    char dir[] = "/tmp/atomc_test_models_XXXXXX";
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    ASSERT_TRUE(f != NULL);
    fputs("{\"architectures\": [\"GPT2LMHeadModel\"], \"model_type\": \"gpt2\", \"n_embd\": 64, \"n_layer\": 2, "
          "\"n_head\": 4, \"vocab_size\": 256}\n", f);
    fclose(f);
    o = base_options(dir);
    o.load_format = "dummy";
    error_clear(&err);
    ASSERT_NE(model_runner_create(&o, &r, &err), ATOMC_OK);
    fprintf(stderr, "  unknown architecture: %s\n", err.msg);
    ASSERT_TRUE(strlen(err.msg) > 0);

    // KV cache too small for one max_model_len sequence.
    char fx[4096];
    snprintf(fx, sizeof fx, "%s", test_fixture("models/llama_gqa"));
    o = base_options(fx);
    o.num_kv_blocks = 0;
    o.cpu_kv_cache_bytes = 4096;
    error_clear(&err);
    ASSERT_EQ(model_runner_create(&o, &r, &err), ATOMC_ERR_OUT_OF_MEMORY);
    fprintf(stderr, "  small KV: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "max_model_len") != NULL);

    o = base_options(fx);
    o.load_format = "bogus";
    ASSERT_EQ(model_runner_create(&o, &r, &err), ATOMC_ERR_INVALID_ARGUMENT);
    o = base_options(fx);
    o.kv_cache_dtype = "int3";
    ASSERT_EQ(model_runner_create(&o, &r, &err), ATOMC_ERR_INVALID_ARGUMENT);
    remove(path);
    rmdir(dir);
}

// --load-format dummy: a runnable model from config.json alone; KV sized from bytes.
TEST(models_dummy_weights) {
    char fx[4096];
    snprintf(fx, sizeof fx, "%s", test_fixture("models/qwen3"));
    struct runner_options o = base_options(fx);
    o.load_format = "dummy";
    o.dummy_seed = 42;
    o.num_kv_blocks = 0;
    o.cpu_kv_cache_bytes = 1 << 20;
    struct model_runner *r = NULL;
    struct error err = {0};
    ASSERT_OK(model_runner_create(&o, &r, &err));
    const struct model_config *c = model_runner_config(r);
    size_t per_block = (size_t)c->num_layers * 2 * 4 * c->num_kv_heads * c->head_dim * sizeof(float);
    ASSERT_EQ(model_runner_num_kv_blocks(r), (int)((1 << 20) / per_block));
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 9u);
    int32_t ids[6] = {1, 2, 3, 4, 5, 6};
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, ids, 6);
    sim_step_begin(s);
    ASSERT_EQ(sim_step_add(s, q, 6, 1), 0);
    struct forward_batch fb = sim_step_batch(s);
    float *lg = malloc(sizeof(float) * (size_t)c->vocab_size);
    ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
    double spread = 0;
    for (int v = 0; v < c->vocab_size; v++) {
        ASSERT_TRUE(isfinite(lg[v]));
        spread = fmax(spread, fabs(lg[v] - lg[0]));
    }
    ASSERT_TRUE(spread > 0); // random weights give distinct logits
    free(lg);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
}

// The benchmark shapes under bench/configs parse and have their published parameter counts.
TEST(models_bench_configs) {
    static const struct {
        const char *file;
        int64_t params;
    } want[] = {
        {"bench/configs/llama3_8b.json", 8030261248LL},
        {"bench/configs/llama3_1_8b.json", 8030261248LL},
        {"bench/configs/llama3_2_1b.json", 1235814400LL},
        {"bench/configs/qwen3_8b.json", 8190735360LL},
        {"bench/configs/gpt_oss_20b.json", 20914757184LL},   // OpenAI's model card: 20.91 B
        {"bench/configs/gpt_oss_120b.json", 116829156672LL}, // 116.83 B
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        char *json = NULL;
        struct error err = {0};
        ASSERT_OK(file_read_all(want[i].file, &json, NULL, &err));
        struct model_config c;
        memset(&c, 0, sizeof c);
        ASSERT_OK(model_config_parse_json(&c, json, want[i].file, &err));
        free(json);
        ASSERT_OK(model_config_validate(&c, want[i].file, &err));
        ASSERT_EQ(model_param_count(&c), want[i].params);
    }
    struct model_config c;
    char *json = NULL;
    memset(&c, 0, sizeof c);
    ASSERT_OK(file_read_all("bench/configs/llama3_1_8b.json", &json, NULL, NULL));
    ASSERT_OK(model_config_parse_json(&c, json, "llama3_1_8b.json", NULL));
    free(json);
    ASSERT_EQ(c.rope.scaling, ROPE_SCALING_LLAMA3);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
