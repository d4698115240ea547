// GPT-OSS (GptOssForCausalLM) beyond the reference checks tests/test_models.c runs on its two
// fixtures (tools/make_tiny_gpt_oss.py: gpt_oss in bf16, gpt_oss_mxfp4 with the experts in
// OpenAI's MXFP4 layout; window 8 on layers 0 and 2, full attention on layer 1):
//   - the fixtures exercise what the family adds: with the sinks, the clamp limit, alpha, the
//     window, YaRN's truncate flag or the MXFP4 scales / nibbles changed the logits leave HF's
//     (so the reference checks can fail);
//   - the MXFP4 experts stay MXFP4 in memory (bytes by scheme);
//   - the CPU MX matmul decodes nibbles (even column low) and e8m0 exponents as transformers does;
//   - the engine scenarios (engine_model_scenarios.h): a batch under preemption with prefix hits
//     equals each prompt alone, a prefix hit equals a cold run, and the randomized stress ends
//     with every block free, on both fixtures, whose prompts cross the window.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "atomc.h"
#include "backend/backend.h"
#include "common/check.h"
#include "common/mapped_file.h"
#include "loader/model_files.h"
#include "engine_model_scenarios.h"
#include "model/model.h"
#include "model/quant.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"
#include "tokenizer/tokenizer.h"

static const struct es_setup CPU = {
    .device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f, .min_clear = 0.5};

static struct model_runner *open_dir(const char *path) {
    struct runner_options o = {.model_path = path, .device = "cpu", .dtype = "auto", .load_format = "auto",
                               .kv_cache_dtype = "auto", .block_size = 4, .num_kv_blocks = 256, .max_num_seqs = 8,
                               .max_num_batched_tokens = 256, .max_model_len = 128, .num_threads = 2};
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) {
        fprintf(stderr, "  %s: %s\n", path, err.msg);
        return NULL;
    }
    return r;
}

// Max |logit - HF| over the last prompt's stored positions.
static double last_prompt_error(struct model_runner *r, const struct refs *R) {
    const struct ref_prompt *p = &R->p[R->n - 1];
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 3u);
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, p->ids, p->n);
    sim_step_begin(s);
    CHECK(sim_step_add(s, q, p->n, 0) == 0);
    for (int k = 0; k < p->n_pos; k++)
        s->rows[k] = p->pos[k];
    s->n_rows = p->n_pos;
    struct forward_batch fb = sim_step_batch(s);
    float *lg = malloc(sizeof(float) * (size_t)p->n_pos * (size_t)R->vocab);
    struct error err = {0};
    CHECK(model_runner_execute_logits(r, &fb, lg, &err) == ATOMC_OK);
    double worst = max_abs_diff(lg, p->logits, p->n_pos * R->vocab);
    free(lg);
    sim_seq_release(s, q);
    free(q);
    sim_free(s);
    free(s);
    return worst;
}

// A copy of fixture `name` in a temp dir whose config.json has `from` replaced by `to` (and the
// safetensors file linked), or with byte `flip_off` of the safetensors file changed when >= 0.
static char *mutant(const char *name, const char *from, const char *to, long flip_off) {
    static char dir[256];
    snprintf(dir, sizeof dir, "/tmp/atomc_test_gpt_oss_XXXXXX");
    CHECK(mkdtemp(dir));
    char rel[256], *json = NULL;
    snprintf(rel, sizeof rel, "models/%s/config.json", name);
    CHECK(file_read_all(test_fixture(rel), &json, NULL, NULL) == ATOMC_OK);
    char *hit = from ? strstr(json, from) : NULL;
    CHECK(!from || hit);
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    if (hit) {
        fwrite(json, 1, (size_t)(hit - json), f);
        fputs(to, f);
        fputs(hit + strlen(from), f);
    } else {
        fputs(json, f);
    }
    fclose(f);
    free(json);
    snprintf(rel, sizeof rel, "models/%s/model.safetensors", name);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (flip_off < 0) {
        char abs[4096];
        CHECK(realpath(test_fixture(rel), abs) && symlink(abs, path) == 0);
    } else {
        char *data = NULL;
        size_t n = 0;
        CHECK(file_read_all(test_fixture(rel), &data, &n, NULL) == ATOMC_OK);
        CHECK((size_t)flip_off < n);
        data[flip_off] = (char)(data[flip_off] + 1);
        f = fopen(path, "wb");
        CHECK(f && fwrite(data, 1, n, f) == n);
        fclose(f);
        free(data);
    }
    return dir;
}

static void rm_dir(const char *dir) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

// Offset in model.safetensors of the first data byte of tensor `tensor` (header parsed here).
static long tensor_offset(const char *name, const char *tensor) {
    char rel[256], *data = NULL;
    size_t n = 0;
    snprintf(rel, sizeof rel, "models/%s/model.safetensors", name);
    CHECK(file_read_all(test_fixture(rel), &data, &n, NULL) == ATOMC_OK);
    uint64_t hl;
    memcpy(&hl, data, 8);
    json_error_t je;
    json_t *h = json_loadb(data + 8, (size_t)hl, 0, &je);
    CHECK(h);
    json_t *t = json_object_get(h, tensor);
    CHECK(t);
    long off = 8 + (long)hl + (long)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0));
    json_decref(h);
    free(data);
    return off;
}

TEST(gpt_oss_fixtures_exercise_sinks_clamp_window_and_scales) {
    struct {
        const char *name, *from, *to, *tensor, *what;
    } cases[] = {
        {"gpt_oss", "\"swiglu_limit\": 2.0", "\"swiglu_limit\": 7.0", NULL, "clamp limit 7 instead of 2"},
        {"gpt_oss", "\"sliding_window\": 8", "\"sliding_window\": 16", NULL, "window 16 instead of 8"},
        {"gpt_oss", "\"swiglu_alpha\": 1.702", "\"swiglu_alpha\": 1.0", NULL, "alpha 1.0"},
        {"gpt_oss", "\"truncate\": false", "\"truncate\": true", NULL, "YaRN truncate true"},
        {"gpt_oss", NULL, NULL, "model.layers.1.self_attn.sinks", "a changed sink"},
        {"gpt_oss_mxfp4", NULL, NULL, "model.layers.0.mlp.experts.gate_up_proj_scales", "a changed e8m0 scale"},
        {"gpt_oss_mxfp4", NULL, NULL, "model.layers.2.mlp.experts.down_proj_blocks", "a changed nibble pair"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct refs R;
        ASSERT_EQ(refs_load(cases[i].name, &R, 1e-4, 4.0), 0);
        // The sink's bf16 high byte (little endian: offset + 1) moves it by a lot.
        long off = cases[i].tensor ? tensor_offset(cases[i].name, cases[i].tensor) + 1 : -1;
        char *dir = mutant(cases[i].name, cases[i].from, cases[i].to, off);
        struct model_runner *r = open_dir(dir);
        ASSERT_TRUE(r != NULL);
        double e = last_prompt_error(r, &R);
        fprintf(stderr, "  %-14s %-28s max |logit - HF| = %.3g (tolerance %.3g)\n", cases[i].name, cases[i].what, e,
                R.tol);
        ASSERT_TRUE(e > 3 * R.tol);
        model_runner_free(r);
        rm_dir(dir);
        refs_free(&R);
    }
}

TEST(gpt_oss_mxfp4_experts_stay_mxfp4) {
    struct error e = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_create("cpu", &bo, &b, &e));
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("models/gpt_oss_mxfp4"), &e));
    ASSERT_OK(model_quant_check(&mf->config, &e));
    struct model_load_options lo = {.files = mf, .weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_F32};
    struct model *m = NULL;
    ASSERT_OK(model_load(&m, b, &mf->config, &lo, &e));
    ASSERT_OK(model_files_check_consumed(mf, &e)); // every _blocks / _scales tensor was read
    // 3 layers x (gate_up 4 x 128 x 64 + down 4 x 64 x 64) values at half a byte, plus a scale byte per 32.
    const size_t vals = 3 * (4 * 128 * 64 + 4 * 64 * 64);
    ASSERT_EQ(m->weight_bytes_by_scheme[WEIGHT_SCHEME_MX], vals / 2 + vals / 32);
    ASSERT_EQ(m->layers[0].ffn.moe.gate_up.scheme, WEIGHT_SCHEME_MX);
    ASSERT_EQ(m->layers[0].ffn.moe.gate_up.t.dtype, DTYPE_U8);
    ASSERT_EQ(m->layers[0].ffn.moe.gate_up.t.ne[2], 32);
    ASSERT_EQ(m->layers[2].ffn.moe.down.scheme, WEIGHT_SCHEME_MX);
    ASSERT_EQ(m->layers[0].ffn.moe.router.scheme, WEIGHT_SCHEME_NONE);
    ASSERT_EQ(m->layers[0].ffn.moe.router_bias.dtype, DTYPE_F32);
    ASSERT_EQ(m->layers[0].attn.gqa.sinks.dtype, DTYPE_F32);
    ASSERT_EQ(m->layers[0].sliding_window, 8);
    ASSERT_EQ(m->layers[1].sliding_window, 0);
    model_free(m);
    model_files_close(mf);
    backend_destroy(b);
}

// Dummy weights of a config that declares mxfp4 (the benchmark configs): the experts are MXFP4
// (random nibbles, one exponent per tensor), so gpt-oss-120b keeps its MXFP4 size in memory.
TEST(gpt_oss_dummy_mxfp4_experts) {
    struct error e = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_create("cpu", &bo, &b, &e));
    char *json = NULL;
    ASSERT_OK(file_read_all(test_fixture("models/gpt_oss_mxfp4/config.json"), &json, NULL, NULL));
    struct model_config c;
    ASSERT_OK(model_config_parse_json(&c, json, "config.json", &e));
    free(json);
    struct model_load_options lo = {.dummy_seed = 7, .weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_F32};
    struct model *m = NULL;
    ASSERT_OK(model_load(&m, b, &c, &lo, &e));
    ASSERT_EQ(m->layers[1].ffn.moe.gate_up.scheme, WEIGHT_SCHEME_MX);
    ASSERT_EQ(m->layers[1].ffn.moe.down.scheme, WEIGHT_SCHEME_MX);
    ASSERT_EQ(m->layers[1].ffn.moe.gate_up_bias.ndim, 2);
    model_free(m);
    backend_destroy(b);
}

// out = x W^T with W in MX (random bytes, exponents 120..133, odd row count) equals the F32
// product with W decoded by the definition (transformers' _convert_moe_packed_tensors: the low
// nibble is the even column, value = e2m1 * 2^(e - 127)), on the skinny and the sgemm paths.
TEST(gpt_oss_cpu_mx_matmul_matches_definition) {
    struct backend *b = NULL;
    struct error err = {0};
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_cpu_create(&bo, &b, &err));
    const int64_t M = 37, K = 96;
    uint8_t *q = malloc((size_t)(M * K / 2)), *e = malloc((size_t)(M * K / 32));
    float *wd = malloc(sizeof(float) * (size_t)(M * K));
    uint32_t s = 12345;
    for (int64_t i = 0; i < M * K / 2; i++) {
        s = s * 1103515245u + 12345u;
        q[i] = (uint8_t)(s >> 16);
    }
    for (int64_t i = 0; i < M * K / 32; i++)
        e[i] = (uint8_t)(120 + i % 14);
    static const float lut[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < K; c++) {
            uint8_t byte = q[r * K / 2 + c / 2];
            wd[r * K + c] = lut[c % 2 ? byte >> 4 : byte & 15] * ldexpf(1.0f, (int)e[r * K / 32 + c / 32] - 127);
        }
    for (int n = 1; n <= 40; n += 39) {
        float *x = malloc(sizeof(float) * (size_t)(n * K)), *y = malloc(sizeof(float) * (size_t)(n * M));
        float *yr = malloc(sizeof(float) * (size_t)(n * M));
        for (int64_t i = 0; i < n * K; i++)
            x[i] = (float)((i * 7919) % 101) / 50.0f - 1.0f;
        struct weight w = {.t = tensor_2d(q, DTYPE_U8, M, K / 2), .scheme = WEIGHT_SCHEME_MX,
                           .scale = tensor_2d(e, DTYPE_U8, M, K / 32), .block_rows = 1, .block_cols = 32};
        struct tensor tx = tensor_2d(x, DTYPE_F32, n, K), ty = tensor_2d(y, DTYPE_F32, n, M);
        b->ops->matmul(b, &ty, &tx, &w, NULL);
        double worst = 0;
        for (int i = 0; i < n; i++)
            for (int64_t r = 0; r < M; r++) {
                double acc = 0, mag = 0;
                for (int64_t c = 0; c < K; c++) {
                    acc += (double)x[i * K + c] * wd[r * K + c];
                    mag += fabs((double)x[i * K + c] * wd[r * K + c]);
                }
                yr[i * M + r] = (float)acc;
                // Against the F32 summation bound of any order: |error| <= K u sum |x w| (u = 2^-24,
                // K u = 5.7e-6 here); a wrong nibble or exponent is off by a whole product.
                double d = fabs(acc - y[i * M + r]) / (mag > 0 ? mag : 1.0);
                worst = d > worst ? d : worst;
            }
        fprintf(stderr, "  n %d: worst error / sum |x w| %.3g\n", n, worst);
        ASSERT_TRUE(worst < 1e-5);
        free(x);
        free(y);
        free(yr);
    }
    free(q);
    free(e);
    free(wd);
    backend_destroy(b);
}

// o200k_harmony (../shared/tokenizers/gpt_oss): a harmony transcript (analysis, then a commentary
// tool call) encodes to HF tokenizers' ids, every harmony marker one special token, and decodes back.
TEST(gpt_oss_tokenizer_harmony_markers_match_hf) {
    const char *path = test_shared_path("tokenizers/gpt_oss");
    if (!path) return; // skipped (a failure under ATOMC_REQUIRE_FIXTURES=1)
    static const char text[] = "<|start|>assistant<|channel|>analysis<|message|>Let me think: 2+2=4.<|end|><|start|>"
                               "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                               "{\"city\":\"Paris\"}<|call|>";
    // tokenizers 0.23: Tokenizer.from_file(...).encode(text, add_special_tokens=False).ids
    static const int32_t want[] = {200006, 173781, 200005, 35644,  200008, 12845, 668,    2411,   25,
                                   220,    17,     10,     17,     28,     19,    13,     200007, 200006,
                                   173781, 200005, 12606,  815,    316,    28,    44580,  775,    170154,
                                   220,    200003, 4108,   200008, 10848,  17500, 7534,   72782,  18583,
                                   200012};
    const int nw = (int)(sizeof want / sizeof want[0]);
    struct tokenizer *t = NULL;
    struct error err = {0};
    ASSERT_OK(tokenizer_load(path, &t, &err));
    int32_t *ids = NULL;
    int n = 0;
    ASSERT_OK(tokenizer_encode(t, text, strlen(text), false, &ids, &n, &err));
    ASSERT_EQ(n, nw);
    for (int i = 0; i < nw; i++)
        ASSERT_EQ(ids[i], want[i]);
    ASSERT_EQ(tokenizer_token_id(t, "<|return|>"), 200002);
    char *back = NULL;
    ASSERT_OK(tokenizer_decode(t, ids, n, false, &back, &err));
    ASSERT_STREQ(back, text);
    free(back);
    free(ids);
    tokenizer_free(t);
}

// Window block freeing with sinks: the MXFP4 fixture with every layer sliding (window 8; real
// GPT-OSS alternates sliding and full layers, and the engine frees out-of-window blocks only when
// every layer slides: hybrid models keep all blocks). Four prompts (1, 6, 19, 37 tokens + 16 new)
// need 34 blocks of 4 without the freeing; on 16 blocks they run with no preemption, on 14 blocks
// with preemption, with prefix caching on and off, and give exactly the tokens of a roomy pool
// (batch-invariant CPU matmuls: a row's result does not depend on its batch), every block free
// at the end.
TEST(gpt_oss_all_sliding_frees_window_blocks) {
    char *dir = mutant("gpt_oss_mxfp4", "\"full_attention\"", "\"sliding_attention\"", -1);
    struct refs R;
    ASSERT_EQ(refs_load("gpt_oss_mxfp4", &R, 1e-4, 4.0), 0);
    ASSERT_TRUE(R.n == 4 && R.p[3].n == 37);
    setenv("ATOMC_BATCH_INVARIANT", "1", 1);
    int32_t want[8][N_GREEDY];
    const struct {
        int blocks, prefix;
        bool preempts;
    } runs[] = {{256, 0, false}, {256, 1, false}, {32, 0, false}, {14, 0, true}, {14, 1, true}};
    for (size_t ri = 0; ri < sizeof runs / sizeof runs[0]; ri++) {
        atomc_engine_options o;
        atomc_engine_options_init(&o);
        o.model_path = dir;
        o.block_size = 4;
        o.num_kv_blocks = runs[ri].blocks;
        o.max_model_len = 56; // 14 blocks: the 53-token sequence fits one pool of 14
        o.max_num_seqs = 8;
        o.max_num_batched_tokens = 64;
        o.num_threads = 2;
        o.enable_prefix_caching = runs[ri].prefix;
        atomc_engine *e = NULL;
        char msg[512];
        ASSERT_OK(atomc_engine_create(&o, &e, msg, sizeof msg));
        atomc_request rq[8];
        atomc_result res[8];
        for (int i = 0; i < 8; i++) { // each prompt twice: the second copies hit the prefix cache
            atomc_request_init(&rq[i]);
            rq[i].prompt_ids = R.p[i % 4].ids;
            rq[i].n_prompt_ids = R.p[i % 4].n;
            rq[i].params.temperature = 0;
            rq[i].params.ignore_eos = true;
            rq[i].params.max_tokens = N_GREEDY;
        }
        ASSERT_OK(atomc_engine_generate(e, rq, 8, res, msg, sizeof msg));
        for (int i = 0; i < 8; i++) {
            ASSERT_EQ(res[i].n_tokens, N_GREEDY);
            for (int k = 0; k < N_GREEDY; k++) {
                if (ri == 0)
                    want[i][k] = res[i].tokens[k];
                else
                    ASSERT_EQ(res[i].tokens[k], want[i][k]);
            }
            atomc_result_free(&res[i]);
        }
        atomc_stats st;
        atomc_engine_get_stats(e, &st);
        fprintf(stderr,
                "  %3d blocks, prefix caching %d: %llu preemptions, %llu prefix-hit tokens, %d of %d blocks free at "
                "the end\n",
                runs[ri].blocks, runs[ri].prefix, (unsigned long long)st.num_preemptions,
                (unsigned long long)st.prefix_cache_hits, st.num_free_kv_blocks, runs[ri].blocks);
        ASSERT_EQ(st.prefix_cache_hits > 0, runs[ri].prefix != 0);
        ASSERT_EQ(st.num_preemptions > 0, runs[ri].preempts);
        ASSERT_EQ(st.num_free_kv_blocks, runs[ri].blocks);
        atomc_engine_free(e);
    }
    unsetenv("ATOMC_BATCH_INVARIANT");
    refs_free(&R);
    rm_dir(dir);
}

TEST(gpt_oss_batched_under_preemption_equals_alone) {
    es_batched_under_preemption_equals_alone(&CPU, "gpt_oss");
    es_batched_under_preemption_equals_alone(&CPU, "gpt_oss_mxfp4");
}

TEST(gpt_oss_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU, "gpt_oss");
}

TEST(gpt_oss_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, "gpt_oss_mxfp4", 0x5eed1234ull, 24);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
