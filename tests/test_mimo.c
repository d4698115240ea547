// MiMo-V2-Flash (MiMoV2FlashForCausalLM, src/model/mimo.c) on the CPU backend against HF
// transformers: the tiny fixture of tools/make_tiny_glm_mimo.py (full / sliding / sliding / full
// layers, window 8 crossed by the 19- and 37-token prompts, 1 vs 2 KV heads, sinks on the sliding
// layers, q/k head dim 48 vs v head dim 32, per-layer-type RoPE theta and partial factor,
// attention_value_scale, a dense first layer, sigmoid routing with a correction bias and a
// routed scaling factor, an MTP tensor under model.mtp.*).
//   - logits at the reference positions within LOGIT_RTOL * max(1, |logit|), one shot and in
//     chunks of 1 and 5 tokens; greedy tokens of a staggered mixed batch equal HF's where the
//     margin is clear;
//   - the fixture exercises what the family adds: with the value scale, the sliding layers' RoPE,
//     the window or the sinks changed, the logits leave HF's;
//   - the engine scenarios (engine_model_scenarios.h): a batch under preemption with prefix hits
//     equals each prompt alone, a prefix hit equals a cold run, and the randomized stress with
//     aborts ends with every block free;
//   - refusals: the CUDA caps (split head dims off; with them on, only the 192 / 128 pair), other
//     quant methods, disagreeing layer keys, a flat rope_parameters.
// The fixture with the real head dims (mimo_v2_flash_hd192, q/k 192 / v 128: what the CUDA model
// test tests/gpu/test_cuda_mimo.c runs) matches HF on the CPU too. The FP8 release's form
// (quant/mimo_v2_flash_fp8, tools/make_tiny_mimo_fp8.py: FP8 e4m3 128x128 blocks, the hub's own
// config keys): weight-only logits and greedy vs HF, the default W8A8 run vs refs_w8a8.json, the
// weights kept FP8 (o_proj's scales x attention_value_scale), the release keys parsed as the
// equivalent transformers config and each one mattering (or refused by name), and
// bench/configs/mimo_v2_flash_fp8.json (the released config) equal in shape to mimo_v2_flash.json.
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
#include "engine_model_scenarios.h"
#include "loader/model_files.h"
#include "model/config.h"
#include "model/model.h"
#include "model/quant.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define MARGIN_FACTOR 4.0
#define FIXTURE "mimo_v2_flash"
#define FIXTURE_HD192 "mimo_v2_flash_hd192"
#define FIXTURE_FP8 "mimo_v2_flash_fp8"

static const struct es_setup CPU = {
    .device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f, .min_clear = 0.5};

// weight_only: quantized weights with unquantized activations (runner_options.quant_weight_only),
// what the fp32 references of the FP8 fixture compute.
static struct model_runner *open_dir_q(const char *path, int max_seqs, bool weight_only, struct error *err) {
    struct runner_options o = {.model_path = path,
                               .quant_weight_only = weight_only,
                               .device = "cpu",
                               .dtype = "auto",
                               .load_format = "auto",
                               .kv_cache_dtype = "auto",
                               .block_size = 4,
                               .num_kv_blocks = 256,
                               .max_num_seqs = max_seqs,
                               .max_num_batched_tokens = 256,
                               .max_model_len = 128,
                               .num_threads = 2};
    struct model_runner *r = NULL;
    if (model_runner_create(&o, &r, err) != ATOMC_OK) return NULL;
    return r;
}

static struct model_runner *open_dir(const char *path, int max_seqs, struct error *err) {
    return open_dir_q(path, max_seqs, true, err);
}

static struct model_runner *open_named(const char *name, int max_seqs) {
    struct error err = {0};
    char rel[128], path[4096];
    snprintf(rel, sizeof rel, "models/%s", name);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    struct model_runner *r = open_dir(path, max_seqs, &err);
    if (!r) fprintf(stderr, "  %s: %s\n", name, err.msg);
    return r;
}

static struct model_runner *open_fixture(int max_seqs) {
    return open_named(FIXTURE, max_seqs);
}

// Logits of prompt p at its reference positions, fed in pieces of `chunk` tokens (0 = one shot).
static int prompt_logits(struct sim *s, struct ref_prompt *p, int chunk, float *lg, int vocab) {
    struct sim_seq *q = malloc(sizeof *q);
    sim_seq_init(q, p->ids, p->n);
    int done = 0, got = 0;
    while (done < p->n) {
        int n = chunk > 0 && p->n - done > chunk ? chunk : p->n - done;
        sim_step_begin(s);
        if (sim_step_add(s, q, n, 0) != 0) return -1;
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
    return got == p->n_pos ? 0 : -1;
}

// Worst |logit - HF| over every prompt of R, fed in chunks of `chunk`.
static double worst_error(struct model_runner *r, struct refs *R, int chunk) {
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 7u);
    double worst = 0;
    for (int pi = 0; pi < R->n; pi++) {
        struct ref_prompt *p = &R->p[pi];
        float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R->vocab);
        CHECK(prompt_logits(s, p, chunk, lg, R->vocab) == 0);
        double d = max_abs_diff(lg, p->logits, p->n_pos * R->vocab);
        if (!(d <= worst)) worst = d;
        free(lg);
    }
    sim_free(s);
    free(s);
    return worst;
}

TEST(mimo_logits_match_hf_one_shot_and_chunked) {
    struct refs R;
    ASSERT_EQ(refs_load(FIXTURE, &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    ASSERT_TRUE(R.n == 4 && R.p[3].n == 37);
    struct model_runner *r = open_fixture(4);
    ASSERT_TRUE(r != NULL);
    static const int chunks[] = {0, 1, 5};
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
        double d = worst_error(r, &R, chunks[ci]);
        fprintf(stderr, "  chunk %d: max |logit - HF| = %.2e (tolerance %.2e)\n", chunks[ci], d, R.tol);
        ASSERT_TRUE(d <= R.tol);
    }
    model_runner_free(r);
    refs_free(&R);
}

// The fixture with MiMo-V2-Flash's own head dims (q/k 192, v 128: the ones the CUDA attention
// implements; tests/gpu/test_cuda_mimo.c runs it on CUDA): the same check on the CPU.
TEST(mimo_hd192_logits_match_hf) {
    struct refs R;
    ASSERT_EQ(refs_load(FIXTURE_HD192, &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    struct model_runner *r = open_named(FIXTURE_HD192, 4);
    ASSERT_TRUE(r != NULL);
    ASSERT_EQ(model_runner_config(r)->head_dim, 192);
    ASSERT_EQ(model_runner_config(r)->v_head_dim, 128);
    static const int chunks[] = {0, 5};
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
        double d = worst_error(r, &R, chunks[ci]);
        fprintf(stderr, "  %s chunk %d: max |logit - HF| = %.2e (tolerance %.2e)\n", FIXTURE_HD192, chunks[ci], d,
                R.tol);
        ASSERT_TRUE(d <= R.tol);
    }
    model_runner_free(r);
    refs_free(&R);
}

// Every prompt at once in a continuous batch: prefill chunks of at most 7 tokens mixed with the
// decodes of sequences already generating; greedy tokens vs HF.
TEST(mimo_mixed_batch_greedy_matches_hf) {
    struct refs R;
    ASSERT_EQ(refs_load(FIXTURE, &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    struct model_runner *r = open_fixture(8);
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 19u);
    struct sim_seq *q = calloc((size_t)R.n, sizeof *q);
    int32_t got[MAX_PROMPTS][N_GREEDY];
    int n_got[MAX_PROMPTS] = {0};
    for (int pi = 0; pi < R.n; pi++)
        sim_seq_init(&q[pi], R.p[pi].ids, R.p[pi].n);
    for (int step = 0; step < 200; step++) {
        sim_step_begin(s);
        int idx[MAX_PROMPTS], n_in = 0;
        for (int pi = 0; pi < R.n; pi++) {
            if (n_got[pi] == N_GREEDY || step < pi * 3) continue;
            int rem = q[pi].n_ids - q[pi].n_cached, n = rem > 7 ? 7 : rem;
            ASSERT_EQ(sim_step_add(s, &q[pi], n, n == rem), 0);
            if (n == rem) idx[n_in++] = pi;
        }
        if (s->n_seqs == 0) {
            if (step > 3 * R.n) break;
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
        snprintf(what, sizeof what, "prompt %d (mixed batch)", pi);
        int c = greedy_compare(&R, &R.p[pi], got[pi], what);
        ASSERT_TRUE(c >= 0);
        checked += c;
    }
    fprintf(stderr, "  mixed batch: %d greedy steps with a clear margin matched HF\n", checked);
    ASSERT_TRUE(checked >= R.n * N_GREEDY / 2);
    free(q);
    sim_free(s);
    free(s);
    model_runner_free(r);
    refs_free(&R);
}

// A temp copy of fixture directory `rel` (under tests/fixtures) whose config.json has `from`
// replaced by `to` (weights linked), or whose weights have byte flip_off changed when >= 0.
static char *mutant_of(const char *rel, const char *from, const char *to, long flip_off) {
    static char dir[256];
    snprintf(dir, sizeof dir, "/tmp/atomc_test_mimo_XXXXXX");
    CHECK(mkdtemp(dir));
    char *json = NULL, src[512];
    snprintf(src, sizeof src, "%s/config.json", rel);
    CHECK(file_read_all(test_fixture(src), &json, NULL, NULL) == ATOMC_OK);
    char *hit = strstr(json, from);
    CHECK_MSG(hit, "%s not in %s", from, src);
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fwrite(json, 1, (size_t)(hit - json), f);
    fputs(to, f);
    fputs(hit + strlen(from), f);
    fclose(f);
    free(json);
    char abs[4096];
    snprintf(src, sizeof src, "%s/model.safetensors", rel);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (flip_off < 0) {
        CHECK(realpath(test_fixture(src), abs) && symlink(abs, path) == 0);
        return dir;
    }
    char *data = NULL;
    size_t n = 0;
    CHECK(file_read_all(test_fixture(src), &data, &n, NULL) == ATOMC_OK);
    CHECK((size_t)flip_off < n);
    data[flip_off] = (char)(data[flip_off] + 8);
    f = fopen(path, "wb");
    CHECK(f && fwrite(data, 1, n, f) == n);
    fclose(f);
    free(data);
    return dir;
}

static char *mutant_flip(const char *from, const char *to, long flip_off) {
    return mutant_of("models/" FIXTURE, from, to, flip_off);
}

static char *mutant(const char *from, const char *to) {
    return mutant_flip(from, to, -1);
}

// Offset in the fixture's model.safetensors of the last byte of tensor `tensor`'s first element
// (the high byte of a little-endian BF16 value).
static long tensor_offset(const char *tensor) {
    char *data = NULL;
    size_t n = 0;
    CHECK(file_read_all(test_fixture("models/" FIXTURE "/model.safetensors"), &data, &n, NULL) == ATOMC_OK);
    uint64_t hl;
    memcpy(&hl, data, 8);
    json_error_t je;
    json_t *h = json_loadb(data + 8, (size_t)hl, 0, &je);
    CHECK(h);
    json_t *t = json_object_get(h, tensor);
    CHECK(t);
    long off = 8 + (long)hl + (long)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0)) + 1;
    json_decref(h);
    free(data);
    return off;
}

static void rm_dir(const char *dir) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

// Each piece the family adds moves the logits off HF's when it is changed, so the logits check
// above could not pass with it ignored.
TEST(mimo_fixture_exercises_value_scale_rope_window_and_sinks) {
    struct refs R;
    ASSERT_EQ(refs_load(FIXTURE, &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    const struct {
        const char *from, *to, *what;
    } muts[] = {
        {"\"attention_value_scale\": 0.707", "\"attention_value_scale\": 1.0", "attention_value_scale 1"},
        {"\"rope_theta\": 10000.0", "\"rope_theta\": 1000000.0", "sliding layers' theta = full layers'"},
        {"\"partial_rotary_factor\": 0.5", "\"partial_rotary_factor\": 0.334", "sliding layers' partial factor"},
        {"\"sliding_window\": 8", "\"sliding_window\": 9", "window 9"},
        {"\"sliding_window\": 8", "\"sliding_window_size\": 7", "sliding_window_size 7 (= window 8)"},
    };
    for (size_t i = 0; i < sizeof muts / sizeof muts[0]; i++) {
        char *dir = mutant(muts[i].from, muts[i].to);
        struct error err = {0};
        struct model_runner *r = open_dir(dir, 4, &err);
        if (!r) fprintf(stderr, "  %s: %s\n", muts[i].what, err.msg);
        ASSERT_TRUE(r != NULL);
        double d = worst_error(r, &R, 0);
        bool same = strstr(muts[i].what, "(= window 8)") != NULL;
        fprintf(stderr, "  %-40s max |logit - HF| = %.2e (tolerance %.2e)\n", muts[i].what, d, R.tol);
        if (same)
            ASSERT_TRUE(d <= R.tol);
        else
            ASSERT_TRUE(d > 10 * R.tol);
        model_runner_free(r);
        rm_dir(dir);
    }
    // A sink of a sliding layer changed (head 0 of layer 1: its BF16 exponent byte).
    char *dir = mutant_flip("\"sliding_window\": 8", "\"sliding_window\": 8",
                            tensor_offset("model.layers.1.self_attn.attention_sink_bias"));
    struct error err = {0};
    struct model_runner *r = open_dir(dir, 4, &err);
    ASSERT_TRUE(r != NULL);
    double d = worst_error(r, &R, 0);
    fprintf(stderr, "  %-40s max |logit - HF| = %.2e (tolerance %.2e)\n", "layer 1's sink of head 0", d, R.tol);
    ASSERT_TRUE(d > 10 * R.tol);
    model_runner_free(r);
    rm_dir(dir);
    refs_free(&R);
}

// The parsed config: the layer types, KV heads per type, head dims, both RoPEs, routing.
TEST(mimo_config_parsed_as_transformers) {
    char *json = NULL;
    ASSERT_OK(file_read_all(test_fixture("models/" FIXTURE "/config.json"), &json, NULL, NULL));
    struct model_config c;
    struct error err = {0};
    ASSERT_OK(model_config_parse_json(&c, json, "config.json", &err));
    free(json);
    ASSERT_EQ(c.arch, MODEL_ARCH_MIMO_V2_FLASH);
    ASSERT_EQ(c.head_dim, 48);
    ASSERT_EQ(c.v_head_dim, 32);
    ASSERT_EQ(c.num_kv_heads, 1);
    ASSERT_EQ(c.swa_num_kv_heads, 2);
    ASSERT_EQ(c.layer_types[0], LAYER_ATTN_FULL);
    ASSERT_EQ(c.layer_types[1], LAYER_ATTN_SLIDING);
    ASSERT_EQ(c.layer_types[3], LAYER_ATTN_FULL);
    ASSERT_EQ(c.sliding_window, 8);
    ASSERT_EQ(c.rope.rotary_dim, 16); // int(48 x 0.334)
    ASSERT_EQ(c.rope_sliding.rotary_dim, 24);
    ASSERT_TRUE(c.rope.theta == 1000000.0f && c.rope_sliding.theta == 10000.0f);
    ASSERT_TRUE(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 1));
    ASSERT_TRUE(!strcmp(c.scoring_func, "sigmoid") && c.norm_topk_prob && c.routed_scaling_factor == 1.5f);
    ASSERT_TRUE(fabsf(c.attention_value_scale - 0.707f) < 1e-7f);
    // transformers' defaults for a config that gives only the sizes.
    const char *bare = "{\"architectures\": [\"MiMoV2FlashForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": "
                       "128, \"num_hidden_layers\": 12, \"num_attention_heads\": 4, \"num_key_value_heads\": 1, "
                       "\"vocab_size\": 256}";
    ASSERT_OK(model_config_parse_json(&c, bare, "bare", &err));
    ASSERT_EQ(c.head_dim, 192);
    ASSERT_EQ(c.v_head_dim, 128);
    ASSERT_EQ(c.sliding_window, 129);
    ASSERT_EQ(c.rope.rotary_dim, 64);
    ASSERT_TRUE(c.rope.theta == 5000000.0f && c.rope_sliding.theta == 10000.0f);
    for (int l = 0; l < 12; l++)
        ASSERT_EQ(c.layer_types[l], l == 0 || l == 5 || l == 11 ? LAYER_ATTN_FULL : LAYER_ATTN_SLIDING);
    ASSERT_TRUE(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 11));
}

// MiMo-V2-Flash's own shape (bench/configs/mimo_v2_flash.json: transformers' MiMoV2FlashConfig
// defaults, 48 layers, 9 full / 39 sliding): the parameter count equals HF's
// (MiMoV2FlashForCausalLM on the meta device: 308,778,768,832 parameters, MTP not built) plus the
// 47 MoE layers' 256 correction-bias entries; the KV cache per token is that of 8 full layers of 4
// KV heads and 39 sliding ones of 8, (192 + 128) dims each.
TEST(mimo_bench_config_matches_hf_shape) {
    char *json = NULL;
    ASSERT_OK(file_read_all("bench/configs/mimo_v2_flash.json", &json, NULL, NULL));
    struct model_config c;
    struct error err = {0};
    ASSERT_OK(model_config_parse_json(&c, json, "mimo_v2_flash.json", &err));
    ASSERT_OK(model_config_validate(&c, "mimo_v2_flash.json", &err));
    free(json);
    int n_full = 0;
    for (int l = 0; l < c.num_layers; l++)
        n_full += c.layer_types[l] == LAYER_ATTN_FULL;
    ASSERT_EQ(n_full, 9); // layers 0, 5, 11, ..., 47
    ASSERT_EQ(c.rope.rotary_dim, 64);
    ASSERT_EQ(c.swa_num_kv_heads, 8);
    int64_t n = model_param_count(&c);
    fprintf(stderr, "  mimo_v2_flash: %lld parameters\n", (long long)n);
    ASSERT_EQ(n, 308778768832LL + 47 * 256);
}

// What is not implemented is refused with a message naming it.
TEST(mimo_refusals) {
    char *json = NULL;
    ASSERT_OK(file_read_all(test_fixture("models/" FIXTURE "/config.json"), &json, NULL, NULL));
    struct model_config c;
    struct error err = {0};
    ASSERT_OK(model_config_parse_json(&c, json, "config.json", &err));
    // The CUDA backend's attention: split q/k vs v head dims only as q/k 192 with v 128.
    struct model_load_options lo = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &lo, &err), ATOMC_ERR_UNSUPPORTED);
    fprintf(stderr, "  cuda caps: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "head") != NULL);
    struct model_config c64 = c;
    c64.head_dim = 64;
    ASSERT_EQ(model_check_backend_caps(&c64, &backend_cuda_caps, &lo, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "v head dim 32") != NULL);
    // The real head dims (q/k 192, v 128): the one pair the CUDA attention has, admitted by the
    // shipped table (split_v_head_dim on since tests/gpu/test_cuda_mimo.c passed on the H200) and
    // refused by a table without split head dims; other pairs refused naming the pairs.
    char *json192 = NULL;
    struct model_config c192;
    ASSERT_OK(file_read_all(test_fixture("models/" FIXTURE_HD192 "/config.json"), &json192, NULL, NULL));
    ASSERT_OK(model_config_parse_json(&c192, json192, "config.json", &err));
    free(json192);
    ASSERT_OK(model_check_backend_caps(&c192, &backend_cuda_caps, &lo, &err));
    struct backend_caps off = backend_cuda_caps;
    off.split_v_head_dim = false;
    ASSERT_EQ(model_check_backend_caps(&c192, &off, &lo, &err), ATOMC_ERR_UNSUPPORTED);
    fprintf(stderr, "  cuda caps without split heads, 192 / 128: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "v head dim 128") != NULL);
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &lo, &err), ATOMC_ERR_UNSUPPORTED);
    fprintf(stderr, "  cuda caps, 48 / 32: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "192 / 128") != NULL);
    lo.weight_dtype = DTYPE_F32;
    lo.kv_dtype = DTYPE_F32;
    ASSERT_OK(model_check_backend_caps(&c, &backend_cpu_caps, &lo, &err));
    ASSERT_OK(model_check_backend_caps(&c192, &backend_cpu_caps, &lo, &err));
    // The release's hybrid_layer_pattern beside transformers' layer_types: read, and it must agree.
    struct model_config c2;
    char *bad = malloc(strlen(json) + 64);
    snprintf(bad, strlen(json) + 64, "{\"hybrid_layer_pattern\": [0, 1, 1, 0],%s", strchr(json, '{') + 1);
    ASSERT_OK(model_config_parse_json(&c2, bad, "config.json", &err));
    snprintf(bad, strlen(json) + 64, "{\"hybrid_layer_pattern\": [0, 1, 0, 0],%s", strchr(json, '{') + 1);
    ASSERT_EQ(model_config_parse_json(&c2, bad, "config.json", &err), ATOMC_ERR_FORMAT);
    fprintf(stderr, "  disagreeing layer keys: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "hybrid_layer_pattern") != NULL);
    free(bad);
    free(json);
    // A flat rope_parameters is not what MiMoV2FlashConfig takes.
    char *dir = mutant("\"rope_parameters\": {", "\"rope_parameters\": {\"rope_theta\": 1.0, \"x\": {},");
    struct model_runner *r = open_dir(dir, 4, &err);
    ASSERT_TRUE(r == NULL);
    fprintf(stderr, "  flat rope: %s\n", err.msg);
    rm_dir(dir);
    // Quantization other than the release's fp8 is refused by name.
    dir = mutant("\"attention_bias\": false,",
                 "\"attention_bias\": false, \"quantization_config\": {\"quant_method\": \"compressed-tensors\", "
                 "\"format\": \"float-quantized\", \"config_groups\": {\"g\": {\"targets\": [\"Linear\"], "
                 "\"weights\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"channel\", "
                 "\"symmetric\": true, \"dynamic\": false}}}},");
    r = open_dir(dir, 4, &err);
    ASSERT_TRUE(r == NULL);
    fprintf(stderr, "  compressed-tensors: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "compressed-tensors") != NULL);
    rm_dir(dir);
}

// ---------------------------------------------------------------------------------------------
// The FP8 release's form (tests/fixtures/quant/mimo_v2_flash_fp8, tools/make_tiny_mimo_fp8.py):
// FP8 e4m3 weights in 128x128 blocks and the hub's own config keys.

#define FP8_DIR "quant/" FIXTURE_FP8

// Logits vs transformers' fp32 forward of the exactly dequantized weights (what transformers' own
// fp8 loader with dequantize=True computes, up to its bf16 rounding; the generator checks that),
// one shot and in chunks of 5; greedy tokens of a one-shot prefill plus decodes where HF's margin
// is clear. The weights stay FP8 in memory (weight-only on the CPU: F32 activations).
TEST(mimo_fp8_release_matches_hf) {
    struct refs R;
    ASSERT_EQ(refs_load_rel(FP8_DIR "/refs.json", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    char path[4096];
    snprintf(path, sizeof path, "%s", test_fixture(FP8_DIR));
    struct error err = {0};
    struct model_runner *r = open_dir(path, 4, &err);
    if (!r) fprintf(stderr, "  %s: %s\n", FIXTURE_FP8, err.msg);
    ASSERT_TRUE(r != NULL);
    const struct model_config *c = model_runner_config(r);
    ASSERT_TRUE(c->quant.present && c->quant.method == QUANT_METHOD_FP8);
    static const int chunks[] = {0, 5};
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
        double d = worst_error(r, &R, chunks[ci]);
        fprintf(stderr, "  %s chunk %d: max |logit - HF| = %.2e (tolerance %.2e)\n", FIXTURE_FP8, chunks[ci], d, R.tol);
        ASSERT_TRUE(d <= R.tol);
    }
    int checked = 0;
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 29u);
    for (int pi = 0; pi < R.n; pi++) {
        int32_t got[N_GREEDY];
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, R.p[pi].ids, R.p[pi].n);
        ASSERT_OK(sim_greedy(s, q, N_GREEDY, got, &err));
        sim_seq_release(s, q);
        free(q);
        char what[96];
        snprintf(what, sizeof what, "%s prompt %d", FIXTURE_FP8, pi);
        int k = greedy_compare(&R, &R.p[pi], got, what);
        ASSERT_TRUE(k >= 0);
        checked += k;
    }
    fprintf(stderr, "  %s: %d greedy steps with a clear margin matched HF\n", FIXTURE_FP8, checked);
    ASSERT_TRUE(checked >= R.n * N_GREEDY / 2);
    sim_free(s);
    free(s);
    model_runner_free(r);
    refs_free(&R);
}

// The default run (FP8 activations: per token and 128-column group before every FP8 linear, as
// quant_method fp8 with dynamic activations states) against refs_w8a8.json (torch's own e4m3
// rounding of the same activations) within 1e-3 x max |logit|, at most one position off (an
// activation within fp32 rounding of an e4m3 midpoint flips), and far from the weight-only refs
// (the activation rounding is really there).
TEST(mimo_fp8_release_w8a8_matches_fake_quant_refs) {
    struct refs R, W;
    ASSERT_EQ(refs_load_rel(FP8_DIR "/refs_w8a8.json", &R, 1e-3, MARGIN_FACTOR), 0);
    ASSERT_EQ(refs_load_rel(FP8_DIR "/refs.json", &W, LOGIT_RTOL, MARGIN_FACTOR), 0);
    char path[4096];
    snprintf(path, sizeof path, "%s", test_fixture(FP8_DIR));
    struct error err = {0};
    struct model_runner *r = open_dir_q(path, 4, false, &err);
    ASSERT_TRUE(r != NULL);
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 31u);
    int positions = 0, off = 0;
    double worst = 0, off_worst = 0, vs_wonly = 0;
    for (int pi = 0; pi < R.n; pi++) {
        struct ref_prompt *p = &R.p[pi];
        float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R.vocab);
        ASSERT_EQ(prompt_logits(s, p, 0, lg, R.vocab), 0);
        for (int k = 0; k < p->n_pos; k++) {
            double d = max_abs_diff(lg + (size_t)k * R.vocab, p->logits + (size_t)k * R.vocab, R.vocab);
            double dw = max_abs_diff(lg + (size_t)k * R.vocab, W.p[pi].logits + (size_t)k * R.vocab, R.vocab);
            positions++;
            if (d <= R.tol)
                worst = d > worst ? d : worst;
            else
                off++, off_worst = d > off_worst ? d : off_worst;
            vs_wonly = dw > vs_wonly ? dw : vs_wonly;
        }
        free(lg);
    }
    fprintf(stderr,
            "  W8A8: %d of %d positions within %.2e of refs_w8a8 (max %.2e), %d off (%.3f); vs weight-only "
            "refs %.3f\n",
            positions - off, positions, R.tol, worst, off, off_worst, vs_wonly);
    ASSERT_TRUE(off <= 1);
    ASSERT_TRUE(vs_wonly > 20 * R.tol);
    sim_free(s);
    free(s);
    model_runner_free(r);
    refs_free(&R);
    refs_free(&W);
}

// Loaded as stored: every decoder linear FP8 e4m3 with 128x128 block scales (q/k/v fused: 768 +
// 384 + 256 rows of the full layer in 6 + 3 + 2 block rows), routers and sinks plain F32, every
// tensor of the file read; o_proj's scales are the file's times attention_value_scale (the fold),
// its values the file's bytes.
TEST(mimo_fp8_weights_stay_fp8) {
    struct error e = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_create("cpu", &bo, &b, &e));
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture(FP8_DIR), &e));
    ASSERT_OK(model_quant_check(&mf->config, &e));
    struct model_load_options lo = {.files = mf, .weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_F32};
    struct model *m = NULL;
    ASSERT_OK(model_load(&m, b, &mf->config, &lo, &e));
    ASSERT_OK(model_files_check_consumed(mf, &e));
    for (int l = 0; l < m->cfg.num_layers; l++) {
        const struct model_layer *ly = &m->layers[l];
        const struct weight *w[] = {&ly->attn.gqa.qkv, &ly->attn.gqa.o,
                                    l == 0 ? &ly->ffn.dense.gate_up : &ly->ffn.moe.gate_up,
                                    l == 0 ? &ly->ffn.dense.down : &ly->ffn.moe.down};
        for (int i = 0; i < 4; i++) {
            ASSERT_EQ(w[i]->scheme, WEIGHT_SCHEME_BLOCK);
            ASSERT_EQ(w[i]->t.dtype, DTYPE_FP8_E4M3);
            // Parts of one partial block stacked (dense gate / up of 64 rows, experts' gate / up of
            // 16 and down of 64): on a grid of their row count.
            const int br = i == 2 ? (l == 0 ? 64 : 16) : i == 3 && l == 1 ? 64 : 128;
            ASSERT_EQ(w[i]->block_rows, br);
            ASSERT_EQ(w[i]->block_cols, 128);
        }
        ASSERT_EQ(ly->attn.gqa.qkv.scale.ne[0], l == 0 ? 6 + 3 + 2 : 6 + 6 + 4);
        if (l == 1) {
            ASSERT_EQ(ly->ffn.moe.router.scheme, WEIGHT_SCHEME_NONE);
            ASSERT_EQ(ly->ffn.moe.router.t.dtype, DTYPE_F32);
            ASSERT_TRUE(ly->attn.gqa.sinks.data != NULL);
        }
        // o_proj: (64, 512) in one block row of 4 block columns.
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.self_attn.o_proj.weight_scale_inv", l);
        struct tensor fs;
        ASSERT_OK(model_files_get_tensor(mf, name, &fs, &e));
        ASSERT_EQ(tensor_numel(&fs), 4);
        ASSERT_EQ(tensor_numel(&ly->attn.gqa.o.scale), 4);
        const float *got = ly->attn.gqa.o.scale.data, *file = fs.data;
        for (int k = 0; k < 4; k++)
            ASSERT_TRUE(got[k] == file[k] * 0.707f);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.o_proj.weight", l);
        ASSERT_OK(model_files_get_tensor(mf, name, &fs, &e));
        ASSERT_TRUE(memcmp(fs.data, ly->attn.gqa.o.t.data, tensor_bytes(&fs)) == 0);
    }
    model_free(m);
    model_files_close(mf);
    backend_destroy(b);
}

// The release's config keys parse to the model transformers' MiMoV2FlashConfig spells with
// layer_types / mlp_layer_types / rope_parameters (the generator's equivalent config).
TEST(mimo_release_config_keys_parsed) {
    char *json = NULL;
    ASSERT_OK(file_read_all(test_fixture(FP8_DIR "/config.json"), &json, NULL, NULL));
    struct model_config c;
    struct error err = {0};
    ASSERT_OK(model_config_parse_json(&c, json, "config.json", &err));
    free(json);
    ASSERT_EQ(c.num_layers, 2);
    ASSERT_EQ(c.layer_types[0], LAYER_ATTN_FULL);
    ASSERT_EQ(c.layer_types[1], LAYER_ATTN_SLIDING);
    ASSERT_TRUE(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 1));
    ASSERT_EQ(c.num_kv_heads, 2);
    ASSERT_EQ(c.swa_num_kv_heads, 4);
    ASSERT_EQ(c.head_dim, 192);
    ASSERT_EQ(c.v_head_dim, 128);
    ASSERT_EQ(c.sliding_window, 9); // sliding_window_size 8 + the query
    ASSERT_TRUE(c.rope.theta == 1000000.0f && c.rope_sliding.theta == 10000.0f);
    ASSERT_EQ(c.rope.rotary_dim, 64);
    ASSERT_EQ(c.rope_sliding.rotary_dim, 64);
    ASSERT_TRUE(fabsf(c.rms_norm_eps - 1e-5f) < 1e-12f); // layernorm_epsilon
    ASSERT_TRUE(c.routed_scaling_factor == 1.5f && fabsf(c.attention_value_scale - 0.707f) < 1e-7f);
    // The released model's own config (bench/configs/mimo_v2_flash_fp8.json): the same shape as
    // transformers' defaults (bench/configs/mimo_v2_flash.json).
    struct model_config hub, def;
    ASSERT_OK(file_read_all("bench/configs/mimo_v2_flash_fp8.json", &json, NULL, NULL));
    ASSERT_OK(model_config_parse_json(&hub, json, "mimo_v2_flash_fp8.json", &err));
    free(json);
    ASSERT_OK(file_read_all("bench/configs/mimo_v2_flash.json", &json, NULL, NULL));
    ASSERT_OK(model_config_parse_json(&def, json, "mimo_v2_flash.json", &err));
    free(json);
    ASSERT_TRUE(hub.quant.present && !def.quant.present);
    ASSERT_EQ(hub.num_layers, def.num_layers);
    for (int l = 0; l < hub.num_layers; l++) {
        ASSERT_EQ(hub.layer_types[l], def.layer_types[l]);
        ASSERT_EQ(model_config_layer_is_moe(&hub, l), model_config_layer_is_moe(&def, l));
    }
    ASSERT_EQ(hub.swa_num_kv_heads, def.swa_num_kv_heads);
    ASSERT_EQ(hub.sliding_window, def.sliding_window);
    ASSERT_TRUE(hub.rope.theta == def.rope.theta && hub.rope_sliding.theta == def.rope_sliding.theta);
    ASSERT_EQ(hub.rope.rotary_dim, def.rope.rotary_dim);
    ASSERT_EQ(hub.rope_sliding.rotary_dim, def.rope_sliding.rotary_dim);
    ASSERT_TRUE(hub.rms_norm_eps == def.rms_norm_eps && hub.routed_scaling_factor == def.routed_scaling_factor);
    ASSERT_EQ(model_param_count(&hub), model_param_count(&def));
    // Its dummy weights (benchmarks): decoder linears FP8 blocks with per-token-group FP8
    // activations, lm_head and the routers plain.
    ASSERT_OK(model_quant_check(&hub, &err));
    struct quant_weight_plan qp;
    model_quant_weight_plan(&hub, "model.layers.1.self_attn.q_proj", &qp);
    ASSERT_TRUE(qp.scheme == WEIGHT_SCHEME_BLOCK && qp.act == WEIGHT_ACT_FP8_GROUP);
    model_quant_weight_plan(&hub, "model.layers.1.mlp.experts.3.down_proj", &qp);
    ASSERT_EQ(qp.scheme, WEIGHT_SCHEME_BLOCK);
    model_quant_weight_plan(&hub, "lm_head", &qp);
    ASSERT_EQ(qp.scheme, WEIGHT_SCHEME_NONE);
    model_quant_weight_plan(&hub, "model.layers.1.mlp.gate", &qp);
    ASSERT_EQ(qp.scheme, WEIGHT_SCHEME_NONE);
    // Its 12-layer cut for one H200 (bench/configs/mimo_v2_flash_12layers_fp8.json): the first 12
    // layers of the same pattern (3 full: 0, 5, 11).
    struct model_config cut;
    ASSERT_OK(file_read_all("bench/configs/mimo_v2_flash_12layers_fp8.json", &json, NULL, NULL));
    ASSERT_OK(model_config_parse_json(&cut, json, "mimo_v2_flash_12layers_fp8.json", &err));
    free(json);
    ASSERT_OK(model_quant_check(&cut, &err));
    ASSERT_EQ(cut.num_layers, 12);
    for (int l = 0; l < 12; l++) {
        ASSERT_EQ(cut.layer_types[l], hub.layer_types[l]);
        ASSERT_EQ(model_config_layer_is_moe(&cut, l), model_config_layer_is_moe(&hub, l));
    }
    // The shipped CUDA caps (split head dims on) take it.
    struct model_load_options lo = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
    ASSERT_OK(model_check_backend_caps(&hub, &backend_cuda_caps, &lo, &err));
}

// The release's keys are what atomc reads: changing one moves the logits off HF's (or makes the
// weights not fit); keys it cannot honour are refused by name.
TEST(mimo_release_config_keys_matter_or_refused) {
    struct refs R;
    ASSERT_EQ(refs_load_rel(FP8_DIR "/refs.json", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    const struct {
        const char *from, *to, *what;
        int expect; // 0: loads, logits move; 1: refused (message names `name`)
        const char *name;
    } muts[] = {
        {"\"swa_rope_theta\": 10000.0", "\"swa_rope_theta\": 1000000.0", "swa_rope_theta", 0, NULL},
        {"\"rope_theta\": 1000000.0", "\"rope_theta\": 10000.0", "rope_theta", 0, NULL},
        {"\"partial_rotary_factor\": 0.334", "\"partial_rotary_factor\": 0.5", "partial_rotary_factor", 0, NULL},
        {"\"sliding_window_size\": 8", "\"sliding_window_size\": 6", "sliding_window_size", 0, NULL},
        {"\"routed_scaling_factor\": 1.5", "\"routed_scaling_factor\": null", "routed_scaling_factor null", 0, NULL},
        {"\"hybrid_layer_pattern\": [\n    0,", "\"hybrid_layer_pattern\": [\n    1,", "hybrid_layer_pattern [1, 1]", 1,
         "k_proj"},
        {"\"moe_layer_freq\": [\n    0,", "\"moe_layer_freq\": [\n    1,", "moe_layer_freq [1, 1]", 1, "mlp"},
        {"\"swa_head_dim\": 192", "\"swa_head_dim\": 128", "swa_head_dim", 1, "swa_head_dim"},
        {"\"swa_num_attention_heads\": 4", "\"swa_num_attention_heads\": 8", "swa_num_attention_heads", 1,
         "swa_num_attention_heads"},
        {"\"add_full_attention_sink_bias\": false", "\"add_full_attention_sink_bias\": true", "full-layer sinks", 1,
         "add_full_attention_sink_bias"},
        {"\"add_swa_attention_sink_bias\": true", "\"add_swa_attention_sink_bias\": false", "no sliding sinks", 1,
         "add_swa_attention_sink_bias"},
        {"\"hidden_act\"", "\"attention_projection_layout\": \"fused_qkv\", \"hidden_act\"", "fused qkv", 1,
         "fused_qkv"},
    };
    for (size_t i = 0; i < sizeof muts / sizeof muts[0]; i++) {
        char *dir = mutant_of(FP8_DIR, muts[i].from, muts[i].to, -1);
        struct error err = {0};
        struct model_runner *r = open_dir(dir, 4, &err);
        if (muts[i].expect == 1) {
            fprintf(stderr, "  %-28s refused: %s\n", muts[i].what, r ? "(loaded)" : err.msg);
            ASSERT_TRUE(r == NULL);
            ASSERT_TRUE(strstr(err.msg, muts[i].name) != NULL);
        } else {
            if (!r) fprintf(stderr, "  %s: %s\n", muts[i].what, err.msg);
            ASSERT_TRUE(r != NULL);
            double d = worst_error(r, &R, 0);
            fprintf(stderr, "  %-28s max |logit - HF| = %.2e (tolerance %.2e)\n", muts[i].what, d, R.tol);
            ASSERT_TRUE(d > 10 * R.tol);
            model_runner_free(r);
        }
        rm_dir(dir);
    }
    refs_free(&R);
}

TEST(mimo_batched_under_preemption_equals_alone) {
    es_batched_under_preemption_equals_alone(&CPU, FIXTURE);
}

TEST(mimo_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU, FIXTURE);
}

TEST(mimo_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, FIXTURE, 0x31770ull, 24);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
