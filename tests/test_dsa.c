// DeepSeek Sparse Attention (src/model/deepseek.c, block_mla.c, src/backend/cpu/cpu_dsa.c, the
// sparse path of cpu_mla.c) on the CPU, against transformers:
// - tests/fixtures/models/{glm5_dsa, deepseek_v32_dsa} (tools/make_tiny_dsa.py): GlmMoeDsaForCausalLM
//   (interleaved indexer RoPE, indexer_types [full, shared, full]) and DeepseekV32ForCausalLM
//   (half-split indexer RoPE, an indexer per layer), index_topk 8, prompts of 5 / 13 / 24 tokens.
//   Config and cache spec (the indexer keys beside the latent on full layers only); logits within
//   LOGIT_RTOL of HF's sparse forward (refs.json) and greedy tokens through the paged caches equal
//   HF's at clear margins.
// - The sparsity is real: the same checkpoint with index_topk 4096 (a config variant) matches HF's
//   dense forward (refs_dense.json), while the sparse run is far from it on the 13- and 24-token
//   prompts and identical on the 5-token one (at most 8 keys: dense is exact there).
// - The engine scenarios (preemption with recompute, chunked prefill, prefix-cache hits, aborts)
//   over the latent + indexer-key cache: every request equals the prompt decoded alone.
// - Refusals: a backend without the DSA ops (caps.dsa off), a quantized DSA checkpoint, DSA without
//   q_lora, a "shared" first layer.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "common/check.h"
#include "common/mapped_file.h"
#include "engine_model_scenarios.h"
#include "loader/model_files.h"
#include "model/model.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "runner_util.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define MARGIN_FACTOR 4.0
static const char *const DSA_MODELS[] = {"glm5_dsa", "deepseek_v32_dsa"};
#define N_DSA 2
#define MODEL DSA_MODELS[0]

static const char *model_dir_of(const char *name) {
    static char path[4096];
    char rel[128];
    snprintf(rel, sizeof rel, "models/%s", name);
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    return path;
}

static const char *model_dir(void) {
    return model_dir_of(MODEL);
}

static struct runner_options base_options(const char *path) {
    struct runner_options o = small_cpu_runner_options(path);
    o.enforce_eager = true;
    return o;
}

static int parse_config(const char *dir, struct model_config *c) {
    char path[4200], *json = NULL;
    snprintf(path, sizeof path, "%s/config.json", dir);
    struct error err = {0};
    if (file_read_all(path, &json, NULL, &err) != ATOMC_OK) return -1;
    memset(c, 0, sizeof *c);
    atomc_status st = model_config_parse_json(c, json, path, &err);
    free(json);
    if (st == ATOMC_OK) st = model_config_validate(c, path, &err);
    if (st != ATOMC_OK) fprintf(stderr, "  %s: %s\n", path, err.msg);
    return st == ATOMC_OK ? 0 : -1;
}

// Prefill logits of every prompt of R at its positions into lg[pi] (n_pos x vocab each).
static void run_logits(struct model_runner *r, const struct refs *R, float **lg) {
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, 13u);
    struct error err = {0};
    for (int pi = 0; pi < R->n; pi++) {
        const struct ref_prompt *p = &R->p[pi];
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, p->ids, p->n);
        sim_step_begin(s);
        CHECK(sim_step_add(s, q, p->n, 0) == 0);
        for (int k = 0; k < p->n_pos; k++)
            s->rows[k] = p->pos[k];
        s->n_rows = p->n_pos;
        struct forward_batch fb = sim_step_batch(s);
        lg[pi] = malloc(sizeof(float) * (size_t)p->n_pos * R->vocab);
        CHECK(model_runner_execute_logits(r, &fb, lg[pi], &err) == ATOMC_OK);
        sim_seq_release(s, q);
        free(q);
    }
    sim_free(s);
    free(s);
}

TEST(dsa_config_and_cache) {
    struct model_config c;
    ASSERT_EQ(parse_config(model_dir(), &c), 0);
    ASSERT_EQ(c.arch, MODEL_ARCH_GLM_MOE_DSA);
    ASSERT_EQ(c.index_n_heads, 4);
    ASSERT_EQ(c.index_head_dim, 48);
    ASSERT_EQ(c.index_topk, 8);
    ASSERT_TRUE(c.index_rope_interleaved);
    ASSERT_TRUE(!c.index_shared[0] && c.index_shared[1] && !c.index_shared[2]);
    ASSERT_EQ(c.q_lora_rank, 48);
    ASSERT_EQ(c.kv_lora_rank, 64);
    for (int l = 0; l < c.num_layers; l++)
        ASSERT_TRUE(!model_config_layer_is_moe(&c, l));
    struct error err = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 1};
    ASSERT_OK(backend_create("cpu", &bo, &b, &err));
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, model_dir(), &err));
    struct model_load_options lo = {.files = mf, .weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_F32};
    struct model *m = NULL;
    ASSERT_OK(model_load(&m, b, &mf->config, &lo, &err));
    ASSERT_OK(model_files_check_consumed(mf, &err)); // every indexer tensor was read
    for (int l = 0; l < 3; l++) {
        const struct cache_spec *s = &m->layer_cache[l];
        ASSERT_EQ(s->kind, CACHE_KIND_LATENT);
        ASSERT_EQ(s->latent_dim, 96);
        ASSERT_EQ(s->index_dim, l == 1 ? 0 : 48);
        ASSERT_EQ(m->layers[l].attn.mla.idx_wq_b.t.data != NULL, l != 1);
    }
    // F32 cache: (96 + 48) + 96 + (96 + 48) values per token.
    ASSERT_EQ((long long)(cache_spec_token_bytes(&m->layer_cache[0], DTYPE_F32) +
                          cache_spec_token_bytes(&m->layer_cache[1], DTYPE_F32) +
                          cache_spec_token_bytes(&m->layer_cache[2], DTYPE_F32)),
              (long long)(4 * (144 + 96 + 144)));
    model_free(m);
    model_files_close(mf);
    backend_destroy(b);
    // DeepSeek-V3.2: an indexer on every layer, half-split indexer RoPE.
    ASSERT_EQ(parse_config(model_dir_of("deepseek_v32_dsa"), &c), 0);
    ASSERT_EQ(c.arch, MODEL_ARCH_DEEPSEEK_V32);
    ASSERT_TRUE(!c.index_rope_interleaved && c.rope.interleaved);
    ASSERT_EQ(c.index_topk, 8);
    for (int l = 0; l < c.num_layers; l++)
        ASSERT_TRUE(!c.index_shared[l]);
}

TEST(dsa_logits_and_greedy_match_hf_sparse) {
    for (int mi = 0; mi < N_DSA; mi++) {
        struct refs R;
        ASSERT_EQ(refs_load(DSA_MODELS[mi], &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct runner_options o = base_options(model_dir_of(DSA_MODELS[mi]));
        struct model_runner *r = NULL;
        struct error err = {0};
        ASSERT_OK(model_runner_create(&o, &r, &err));
        float *lg[MAX_PROMPTS];
        run_logits(r, &R, lg);
        double worst = 0;
        for (int pi = 0; pi < R.n; pi++) {
            double d = max_abs_diff(lg[pi], R.p[pi].logits, R.p[pi].n_pos * R.vocab);
            fprintf(stderr, "  %s prompt %d (%d tokens): max |logit - HF sparse| = %.2e (tolerance %.2e)\n",
                    DSA_MODELS[mi], pi, R.p[pi].n, d, R.tol);
            if (!(d <= R.tol)) test_fail(__FILE__, __LINE__, "prompt %d: %g > %g", pi, d, R.tol);
            worst = d > worst ? d : worst;
            free(lg[pi]);
        }
        // Greedy: prefill, then one token per step (decode reads the cached indexer keys).
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 5u);
        int checked = 0, steps = 0;
        for (int pi = 0; pi < R.n; pi++) {
            struct ref_prompt *p = &R.p[pi];
            struct sim_seq *q = malloc(sizeof *q);
            sim_seq_init(q, p->ids, p->n);
            int32_t got[N_GREEDY];
            memcpy(got, p->greedy, sizeof got);
            ASSERT_OK(sim_greedy(s, q, 4, got, &err));
            steps += 4;
            char what[64];
            snprintf(what, sizeof what, "%s prompt %d", DSA_MODELS[mi], pi);
            int c = greedy_compare(&R, p, got, what);
            ASSERT_TRUE(c >= 0);
            checked += c;
            sim_seq_release(s, q);
            free(q);
        }
        fprintf(stderr, "  %s: %d of %d greedy steps had a clear margin and matched\n", DSA_MODELS[mi], checked, steps);
        ASSERT_TRUE(checked >= steps / 2);
        sim_free(s);
        free(s);
        model_runner_free(r);
        refs_free(&R);
    }
}

// A copy of the fixture whose config.json has `from` replaced by `to` (model.safetensors linked).
static const char *variant_of(const char *name, const char *from, const char *to) {
    static char dir[256];
    snprintf(dir, sizeof dir, "/tmp/atomc_glm5_XXXXXX");
    CHECK(mkdtemp(dir));
    char path[4200], *json = NULL;
    snprintf(path, sizeof path, "%s/config.json", model_dir_of(name));
    CHECK(file_read_all(path, &json, NULL, NULL) == ATOMC_OK);
    char *at = strstr(json, from);
    CHECK_MSG(at, "config.json lacks %s", from);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fprintf(f, "%.*s%s%s", (int)(at - json), json, to, at + strlen(from));
    fclose(f);
    free(json);
    char src[4200], dst[512], *abs = realpath(model_dir_of(name), NULL);
    CHECK(abs);
    snprintf(src, sizeof src, "%s/model.safetensors", abs);
    free(abs);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    CHECK(symlink(src, dst) == 0);
    return dir;
}

// Replaces `from` by `to` in a variant's config.json (a second edit).
static void variant_edit(const char *dir, const char *from, const char *to) {
    char path[512], *json = NULL;
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK(file_read_all(path, &json, NULL, NULL) == ATOMC_OK);
    char *at = strstr(json, from);
    CHECK_MSG(at, "config.json lacks %s", from);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fprintf(f, "%.*s%s%s", (int)(at - json), json, to, at + strlen(from));
    fclose(f);
    free(json);
}

static const char *variant(const char *from, const char *to) {
    return variant_of(MODEL, from, to);
}

static void variant_rm(const char *dir) {
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

TEST(dsa_sparsity_matters_dense_variant_matches_hf_dense) {
    for (int mi = 0; mi < N_DSA; mi++) {
        struct refs S, Dn;
        char rel[128];
        snprintf(rel, sizeof rel, "models/%s/refs_dense.json", DSA_MODELS[mi]);
        ASSERT_EQ(refs_load(DSA_MODELS[mi], &S, LOGIT_RTOL, MARGIN_FACTOR), 0);
        ASSERT_EQ(refs_load_rel(rel, &Dn, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct error err = {0};
        struct model_runner *r = NULL;
        struct runner_options o = base_options(model_dir_of(DSA_MODELS[mi]));
        ASSERT_OK(model_runner_create(&o, &r, &err));
        float *sparse[MAX_PROMPTS], *dense[MAX_PROMPTS];
        run_logits(r, &S, sparse);
        model_runner_free(r);
        const char *dir = variant_of(DSA_MODELS[mi], "\"index_topk\": 8", "\"index_topk\": 4096");
        o = base_options(dir);
        if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  %s\n", err.msg);
        ASSERT_TRUE(r != NULL);
        ASSERT_EQ(model_runner_config(r)->index_topk, 4096);
        run_logits(r, &Dn, dense);
        model_runner_free(r);
        variant_rm(dir);
        for (int pi = 0; pi < S.n; pi++) {
            const int n = S.p[pi].n_pos * S.vocab;
            double dd = max_abs_diff(dense[pi], Dn.p[pi].logits, n), sd = max_abs_diff(sparse[pi], dense[pi], n);
            fprintf(stderr,
                    "  %s prompt %d (%d tokens): dense run vs HF dense %.2e (tol %.2e); sparse vs dense run %.3f\n",
                    DSA_MODELS[mi], pi, S.p[pi].n, dd, Dn.tol, sd);
            if (!(dd <= Dn.tol)) test_fail(__FILE__, __LINE__, "dense prompt %d: %g > %g", pi, dd, Dn.tol);
            if (S.p[pi].n <= 8)
                ASSERT_TRUE(sd <= S.tol); // at most index_topk keys: sparse is dense
            else
                ASSERT_TRUE(sd > 100 * S.tol); // the top-k selection changes the answer
            free(sparse[pi]);
            free(dense[pi]);
        }
        refs_free(&S);
        refs_free(&Dn);
    }
}

// The fixtures' indexers select by distance through one RoPE pair (tools/make_tiny_dsa.py
// structure_indexer), so the layout is visible: DeepSeek-V3.2's checkpoint run with GLM-5's
// interleaved indexer RoPE (its architecture swapped, every layer still its own indexer) selects
// other keys, and its logits leave HF's on the longest prompt (a backend that
// ropes the indexer in the wrong layout fails the HF comparison, on the CPU as in
// tests/gpu/test_cuda_dsa.c).
TEST(dsa_indexer_rope_layout_matters) {
    struct refs S;
    ASSERT_EQ(refs_load(DSA_MODELS[1], &S, LOGIT_RTOL, MARGIN_FACTOR), 0);
    const char *dir = variant_of(DSA_MODELS[1], "\"DeepseekV32ForCausalLM\"", "\"GlmMoeDsaForCausalLM\"");
    variant_edit(dir, "\"model_type\": \"deepseek_v32\"", "\"model_type\": \"glm_moe_dsa\"");
    struct runner_options o = base_options(dir);
    struct error err = {0};
    struct model_runner *r = NULL;
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) fprintf(stderr, "  %s\n", err.msg);
    ASSERT_TRUE(r != NULL);
    ASSERT_TRUE(model_runner_config(r)->index_rope_interleaved);
    float *lg[MAX_PROMPTS];
    run_logits(r, &S, lg);
    model_runner_free(r);
    variant_rm(dir);
    double worst = 0;
    for (int pi = 0; pi < S.n; pi++) {
        const double d = max_abs_diff(lg[pi], S.p[pi].logits, S.p[pi].n_pos * S.vocab);
        fprintf(stderr, "  %s with interleaved indexer RoPE, prompt %d (%d tokens): max |logit - HF| = %.3f\n",
                DSA_MODELS[1], pi, S.p[pi].n, d);
        if (S.p[pi].n <= 8) ASSERT_TRUE(d <= S.tol); // every key is selected whatever the scores
        worst = d > worst ? d : worst;
        free(lg[pi]);
    }
    ASSERT_TRUE(worst > 100 * S.tol); // the 24-token prompt (the 13-token one may keep the nearest 8 either way)
    refs_free(&S);
}

TEST(dsa_refusals) {
    struct model_config c;
    ASSERT_EQ(parse_config(model_dir(), &c), 0);
    struct model_load_options o = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
    struct error err = {0};
    ASSERT_OK(model_check_backend_caps(&c, &backend_cpu_caps, &o, &err));
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err)); // caps.dsa on (session 13)
    struct backend_caps no_dsa = backend_cuda_caps;                         // a backend without the DSA ops
    no_dsa.dsa = false;
    ASSERT_EQ(model_check_backend_caps(&c, &no_dsa, &o, &err), ATOMC_ERR_UNSUPPORTED);
    fprintf(stderr, "  without caps.dsa: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "DSA") != NULL);
    static const struct {
        const char *from, *to, *expect;
    } bad[] = {
        {"\"q_lora_rank\": 48", "\"q_lora_rank\": null", "q_lora_rank"},
        {"\"indexer_types\": [\n    \"full\"", "\"indexer_types\": [\n    \"shared\"", "layer 0"},
        {"\"index_topk\": 8",
         "\"index_topk\": 8, \"quantization_config\": {\"quant_method\": \"fp8\", "
         "\"weight_block_size\": [128, 128], \"activation_scheme\": \"dynamic\"}",
         "DSA"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *dir = variant(bad[i].from, bad[i].to);
        struct runner_options ro = base_options(dir);
        ro.load_format = "dummy";
        struct model_runner *r = NULL;
        atomc_status st = model_runner_create(&ro, &r, &err);
        variant_rm(dir);
        fprintf(stderr, "  %s: %s\n", bad[i].to, err.msg);
        ASSERT_TRUE(st != ATOMC_OK && r == NULL);
        ASSERT_TRUE(strstr(err.msg, bad[i].expect) != NULL);
    }
}

// bench/configs/glm5_4layers.json: GLM-5's layer shapes (transformers' GlmMoeDsaConfig defaults:
// hidden 6144, 64 MLA heads, q_lora 2048, kv_lora 512, nope 192 / rope 64 / v 256, 256 experts top-8
// + 1 shared, indexer 32 heads of 128, top 2048) with 4 layers (1 dense + 3 MoE). Its parameter
// count equals transformers' on the meta device (plus the 3 x 256 correction-bias buffers), the
// latent + indexer key cache is (576 + 128) values per token and layer, and both backends' caps take
// it (caps.dsa).
TEST(dsa_glm5_bench_config) {
    struct model_config c;
    char *json = NULL;
    struct error err = {0};
    const char *path = "bench/configs/glm5_4layers.json";
    ASSERT_OK(file_read_all(path, &json, NULL, &err));
    memset(&c, 0, sizeof c);
    ASSERT_OK(model_config_parse_json(&c, json, path, &err));
    free(json);
    ASSERT_OK(model_config_validate(&c, path, &err));
    ASSERT_EQ(c.arch, MODEL_ARCH_GLM_MOE_DSA);
    const int64_t n = model_param_count(&c);
    fprintf(stderr, "  %s: %lld parameters\n", path, (long long)n);
    ASSERT_EQ(n, 31936283648LL + 768);
    struct cache_spec s = {
        .kind = CACHE_KIND_LATENT, .latent_dim = c.kv_lora_rank + c.qk_rope_head_dim, .index_dim = c.index_head_dim};
    ASSERT_EQ((long long)cache_spec_token_bytes(&s, DTYPE_BF16), 2 * (576 + 128));
    struct model_load_options o = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
    ASSERT_OK(model_check_backend_caps(&c, &backend_cpu_caps, &o, &err));
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err)); // caps.dsa on since session 13
}

// ---------------------------------------------------------------------------------------------
// The engine over the latent + indexer-key cache

static const struct es_setup CPU = {
    .device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f, .min_clear = 0.5};

TEST(dsa_engine_batched_under_preemption_equals_alone) {
    es_batched_under_preemption_equals_alone(&CPU, MODEL);
}

TEST(dsa_engine_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU, MODEL);
}

TEST(dsa_engine_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU, DSA_MODELS[0], 0xd5a5eedull, 32);
    es_random_stress_equals_alone(&CPU, DSA_MODELS[1], 0xd5a5eee1ull, 32);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
