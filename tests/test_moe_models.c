// Whole-model tests of the mixture-of-experts architectures (Qwen3MoeForCausalLM,
// MixtralForCausalLM, Glm4MoeForCausalLM) on the CPU backend against HF transformers: tiny
// random-weight checkpoints written with their references by tools/make_tiny_moe_models.py (8
// experts top-4 with norm_topk_prob and an mlp_only layer; 8 experts top-2 without
// norm_topk_prob and decoder_sparse_step 2; Mixtral 4 experts top-2 with a sliding window the
// prompts cross) and tools/make_tiny_glm_mimo.py (GLM-4-MoE: grouped sigmoid routing with a
// correction bias, shared experts, partial rotary, an MTP layer to skip).
//
// The reference checks every fixture gets (logits and greedy tokens vs HF, mixed chunked-prefill
// batches) run in tests/test_models.c over the dense and MoE fixtures together; this file holds
// the MoE-specific ones. The fixtures' routing decisions are at least 2e-2 in probability (0.25
// in router logits) away from a tie (refs.json router_min_gap / router_min_logit_gap), so
// neither fp32 nor BF16 noise can change the experts chosen.
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "common/check.h"
#include "common/mapped_file.h"
#include "loader/model_files.h"
#include "model/model.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
#define MARGIN_FACTOR 4.0

static struct runner_options base_options(const char *path) {
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .dtype = "auto",
        .load_format = "auto",
        .kv_cache_dtype = "auto",
        .block_size = 4,
        .num_kv_blocks = 256,
        .max_num_seqs = 8,
        .max_num_batched_tokens = 256,
        .max_model_len = 128,
        .num_threads = 2,
    };
    return o;
}

static struct model_runner *open_model_uniform(const char *name, bool uniform) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", name);
    char path[4096];
    snprintf(path, sizeof path, "%s", test_fixture(rel));
    struct runner_options o = base_options(path);
    o.moe_uniform_routing = uniform;
    struct model_runner *r = NULL;
    struct error err = {0};
    if (model_runner_create(&o, &r, &err) != ATOMC_OK) {
        fprintf(stderr, "  %s: model_runner_create: %s\n", name, err.msg);
        return NULL;
    }
    return r;
}

static struct model_runner *open_model(const char *name) { return open_model_uniform(name, false); }

TEST(moe_models_layer_kinds) {
    struct {
        const char *name;
        bool moe[4];
        int n_layers, E, k;
        bool renorm;
    } want[] = {
        {"qwen3_moe", {true, false, true}, 3, 8, 4, true},
        {"qwen3_moe_sparse2", {false, true, false}, 3, 8, 2, false},
        {"mixtral", {true, true, false}, 2, 4, 2, true},
        {"glm4_moe", {false, true, true}, 3, 8, 3, true},             // first_k_dense_replace 1
        {"glm4_moe_air", {false, false, true, true}, 4, 8, 2, false}, // first_k_dense_replace 2
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        struct model_runner *r = open_model(want[i].name);
        ASSERT_TRUE(r != NULL);
        const struct model_config *c = model_runner_config(r);
        ASSERT_EQ(c->num_layers, want[i].n_layers);
        ASSERT_EQ(c->num_experts, want[i].E);
        ASSERT_EQ(c->num_experts_per_tok, want[i].k);
        ASSERT_EQ(c->norm_topk_prob, want[i].renorm);
        for (int l = 0; l < c->num_layers; l++)
            ASSERT_EQ(model_config_layer_is_moe(c, l), want[i].moe[l]);
        model_runner_free(r);
    }
}

// The dense fixtures (model_refs.h's list) have no MoE layer: the hook in the dense forward
// stays off for them.
TEST(moe_models_dense_fixtures_have_no_moe_layers) {
    for (int mi = 0; mi < N_MODELS; mi++) {
        char rel[256], *json = NULL;
        snprintf(rel, sizeof rel, "models/%s/config.json", MODELS[mi]);
        ASSERT_OK(file_read_all(test_fixture(rel), &json, NULL, NULL));
        struct model_config c;
        memset(&c, 0, sizeof c);
        struct error err = {0};
        ASSERT_OK(model_config_parse_json(&c, json, rel, &err));
        free(json);
        ASSERT_EQ(c.num_experts, 0);
        for (int l = 0; l < c.num_layers; l++)
            ASSERT_TRUE(!model_config_layer_is_moe(&c, l));
    }
}

// Benchmark-only uniform routing changes the outputs (the router is really bypassed) and is
// deterministic.
TEST(moe_models_force_uniform_routing) {
    struct refs R;
    ASSERT_EQ(refs_load("qwen3_moe", &R, LOGIT_RTOL, MARGIN_FACTOR), 0);
    float *lg[2];
    for (int pass = 0; pass < 2; pass++) {
        struct model_runner *r = open_model_uniform("qwen3_moe", true);
        ASSERT_TRUE(r != NULL);
        struct sim *s = malloc(sizeof *s);
        sim_init(s, r, 3u);
        struct ref_prompt *p = &R.p[R.n - 1];
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, p->ids, p->n);
        sim_step_begin(s);
        ASSERT_EQ(sim_step_add(s, q, p->n, 0), 0);
        for (int k = 0; k < p->n_pos; k++)
            s->rows[k] = p->pos[k];
        s->n_rows = p->n_pos;
        struct forward_batch fb = sim_step_batch(s);
        lg[pass] = malloc(sizeof(float) * (size_t)p->n_pos * R.vocab);
        struct error err = {0};
        ASSERT_OK(model_runner_execute_logits(r, &fb, lg[pass], &err));
        sim_seq_release(s, q);
        free(q);
        sim_free(s);
        free(s);
        model_runner_free(r);
    }
    struct ref_prompt *p = &R.p[R.n - 1];
    int n = p->n_pos * R.vocab;
    ASSERT_TRUE(max_abs_diff(lg[0], lg[1], n) == 0.0);
    ASSERT_TRUE(max_abs_diff(lg[0], p->logits, n) > 100 * R.tol);
    free(lg[0]);
    free(lg[1]);
    refs_free(&R);
}

// Qwen3-30B-A3B's published shape: the bench config parses into the right MoE config and the
// parameter count is the published 30.5B (3.3B active).
TEST(moe_models_bench_config_qwen3_30b_a3b) {
    char *json = NULL;
    ASSERT_OK(file_read_all("bench/configs/qwen3_30b_a3b.json", &json, NULL, NULL));
    struct model_config c;
    struct error err = {0};
    memset(&c, 0, sizeof c);
    ASSERT_OK(model_config_parse_json(&c, json, "qwen3_30b_a3b.json", &err));
    ASSERT_OK(model_config_validate(&c, "qwen3_30b_a3b.json", &err));
    free(json);
    ASSERT_EQ(c.arch, MODEL_ARCH_QWEN3_MOE);
    ASSERT_EQ(c.num_experts, 128);
    ASSERT_EQ(c.num_experts_per_tok, 8);
    ASSERT_EQ(c.moe_intermediate_size, 768);
    ASSERT_TRUE(c.norm_topk_prob && c.qk_norm);
    for (int l = 0; l < c.num_layers; l++)
        ASSERT_TRUE(model_config_layer_is_moe(&c, l));
    int64_t n = model_param_count(&c);
    fprintf(stderr, "  qwen3_30b_a3b: %lld parameters\n", (long long)n);
    ASSERT_EQ(n, 30532122624LL);
}

// The GLM-4-MoE fixtures exercise what their router adds: the references' routing decisions change
// when the correction bias or (glm4_moe) the group limit is left out (counted by
// tools/make_tiny_glm_mimo.py), so the logits match above could not hold with either ignored; the
// configs parse into sigmoid grouped routing with shared experts, partial rotary and q/k norm.
TEST(moe_models_glm4_moe_routing_exercised) {
    json_t *g = test_fixture_json("models/glm4_moe/refs.json");
    json_t *a = test_fixture_json("models/glm4_moe_air/refs.json");
    ASSERT_TRUE(g != NULL && a != NULL);
    ASSERT_TRUE(json_integer_value(json_object_get(g, "bias_changed_decisions")) > 0);
    ASSERT_TRUE(json_integer_value(json_object_get(g, "groups_changed_decisions")) > 0);
    ASSERT_TRUE(json_integer_value(json_object_get(a, "bias_changed_decisions")) > 0);
    ASSERT_EQ(json_integer_value(json_object_get(g, "bf16_routing_flips")), 0);
    ASSERT_TRUE(json_number_value(json_object_get(g, "router_min_key_gap")) >= 0.025);
    ASSERT_TRUE(json_number_value(json_object_get(a, "router_min_key_gap")) >= 0.025);
    json_decref(g);
    json_decref(a);
    struct model_runner *r = open_model("glm4_moe");
    ASSERT_TRUE(r != NULL);
    const struct model_config *c = model_runner_config(r);
    ASSERT_STREQ(c->scoring_func, "sigmoid");
    ASSERT_EQ(c->n_group, 4);
    ASSERT_EQ(c->topk_group, 2);
    ASSERT_EQ(c->n_shared_experts, 1);
    ASSERT_EQ(c->num_nextn_predict_layers, 1);
    ASSERT_NEAR(c->routed_scaling_factor, 2.5, 0);
    ASSERT_EQ(c->rope.rotary_dim, 32); // head_dim 64 x partial_rotary_factor 0.5
    ASSERT_TRUE(c->qk_norm && c->attention_bias && !c->attention_out_bias);
    model_runner_free(r);
    r = open_model("glm4_moe_air");
    ASSERT_TRUE(r != NULL);
    c = model_runner_config(r);
    ASSERT_EQ(c->n_shared_experts, 2); // one shared MLP of 2 x 32 columns, stacked as two experts
    ASSERT_EQ(c->rope.rotary_dim, 16);
    ASSERT_TRUE(!c->qk_norm && !c->norm_topk_prob);
    model_runner_free(r);
}

// What the loader builds for GLM-4-MoE with BF16 weights (the CUDA layout, here on the CPU): the
// correction bias stays F32 (moe_route's contract; a BF16 copy would move the keys), the experts
// are stacked E + n_shared deep, and the shared experts' rows are the checkpoint's shared MLP
// sliced per expert (glm4_moe_air: rows / columns [s I, (s + 1) I) of one MLP of 2 I). Both
// fixtures pass the CUDA backend's capability check (sigmoid, groups, 9-10 experts, head_dim 64).
TEST(moe_models_glm4_moe_loaded_layout) {
    const char *names[] = {"glm4_moe", "glm4_moe_air"};
    struct backend_options bo = {.num_threads = 2};
    struct backend *b = NULL;
    struct error err = {0};
    ASSERT_OK(backend_cpu_create(&bo, &b, &err));
    for (int fi = 0; fi < 2; fi++) {
        char rel[128];
        snprintf(rel, sizeof rel, "models/%s", names[fi]);
        struct model_files *mf = NULL;
        ASSERT_OK(model_files_open(&mf, test_fixture(rel), &err));
        const struct model_config *c = &mf->config;
        struct model_load_options o = {.files = mf, .weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16};
        struct model_load_options co = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
        ASSERT_OK(model_check_backend_caps(c, &backend_cuda_caps, &co, &err));
        struct model *m = NULL;
        ASSERT_OK(model_load(&m, b, c, &o, &err));
        const int E = c->num_experts, ns = c->n_shared_experts, I = c->moe_intermediate_size, H = c->hidden_size;
        const int l = c->first_k_dense_replace; // the first MoE layer
        const struct ffn_moe_weights *w = &m->layers[l].ffn.moe;
        ASSERT_EQ(m->layers[l].ffn_kind, FFN_KIND_MOE);
        ASSERT_EQ(w->score_bias.dtype, DTYPE_F32);
        ASSERT_EQ(w->gate_up.t.dtype, DTYPE_BF16);
        ASSERT_EQ(w->gate_up.t.ne[0], E + ns);
        ASSERT_EQ(w->down.t.ne[0], E + ns);
        ASSERT_EQ(m->moe_route.n_shared, ns);
        ASSERT_EQ(m->moe_route.scoring, MOE_SCORING_SIGMOID);
        ASSERT_EQ(m->moe_route.n_group, c->n_group > 1 ? c->n_group : 0);
        char name[160];
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        struct tensor t;
        ASSERT_OK(model_files_get_tensor(mf, name, &t, &err));
        ASSERT_EQ(t.dtype, DTYPE_F32);
        ASSERT_TRUE(memcmp(t.data, w->score_bias.data, (size_t)E * 4) == 0);
        const uint16_t *gu = w->gate_up.t.data, *dn = w->down.t.data;
        for (int s = 0; s < ns; s++) {
            const uint16_t *eg = gu + (size_t)(E + s) * 2 * I * H, *ed = dn + (size_t)(E + s) * H * I;
            snprintf(name, sizeof name, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l);
            ASSERT_OK(model_files_get_tensor(mf, name, &t, &err));
            ASSERT_TRUE(memcmp(eg, (const uint16_t *)t.data + (size_t)s * I * H, (size_t)I * H * 2) == 0);
            snprintf(name, sizeof name, "model.layers.%d.mlp.shared_experts.up_proj.weight", l);
            ASSERT_OK(model_files_get_tensor(mf, name, &t, &err));
            ASSERT_TRUE(memcmp(eg + (size_t)I * H, (const uint16_t *)t.data + (size_t)s * I * H, (size_t)I * H * 2) ==
                        0);
            snprintf(name, sizeof name, "model.layers.%d.mlp.shared_experts.down_proj.weight", l);
            ASSERT_OK(model_files_get_tensor(mf, name, &t, &err));
            ASSERT_EQ(t.ne[1], ns * I);
            for (int r = 0; r < H; r++) // down: columns [s I, (s + 1) I) of each row
                ASSERT_TRUE(memcmp(ed + (size_t)r * I, (const uint16_t *)t.data + (size_t)r * ns * I + (size_t)s * I,
                                   (size_t)I * 2) == 0);
        }
        model_free(m);
        model_files_close(mf);
    }
    backend_destroy(b);
}

// Writes `config` beside a link to `fixture`'s model.safetensors into a fresh directory (path
// in dir, at least 64 bytes), for checkpoint-level refusals.
static void checkpoint_with_config(char *dir, const char *fixture, const char *config) {
    snprintf(dir, 64, "/tmp/atomc_glm_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    char path[256], rel[128];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(config, f);
    fclose(f);
    snprintf(rel, sizeof rel, "models/%s/model.safetensors", fixture);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    char *target = realpath(test_fixture(rel), NULL);
    CHECK(target != NULL && symlink(target, path) == 0);
    free(target);
}

static void remove_checkpoint(const char *dir) {
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

// MTP layers are skipped by name only where the config declares them: the same checkpoint with
// num_nextn_predict_layers 0 is refused (its model.layers.3.* tensors are never read), and a
// shared-expert tensor of the wrong width is a FORMAT error naming it.
TEST(moe_models_glm4_moe_checkpoint_refusals) {
    char rel[128], *json = NULL;
    snprintf(rel, sizeof rel, "models/glm4_moe/config.json");
    ASSERT_OK(file_read_all(test_fixture(rel), &json, NULL, NULL));
    const char *key = "\"num_nextn_predict_layers\": 1";
    char *at = strstr(json, key);
    ASSERT_TRUE(at != NULL);
    at[strlen(key) - 1] = '0';
    char dir[64];
    checkpoint_with_config(dir, "glm4_moe", json);
    struct runner_options o = base_options(dir);
    struct model_runner *r = NULL;
    struct error err = {0};
    atomc_status st = model_runner_create(&o, &r, &err);
    fprintf(stderr, "  rejected: %s\n", err.msg);
    ASSERT_EQ(st, ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "model.layers.3.") != NULL);
    remove_checkpoint(dir);
    at[strlen(key) - 1] = '1';
    // n_shared_experts 2 over a checkpoint whose shared MLP has one expert's width.
    key = "\"n_shared_experts\": 1";
    at = strstr(json, key);
    ASSERT_TRUE(at != NULL);
    at[strlen(key) - 1] = '2';
    checkpoint_with_config(dir, "glm4_moe", json);
    o = base_options(dir);
    err = (struct error){0};
    st = model_runner_create(&o, &r, &err);
    fprintf(stderr, "  rejected: %s\n", err.msg);
    ASSERT_EQ(st, ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(err.msg, "shared_experts") != NULL);
    remove_checkpoint(dir);
    free(json);
}

// GLM-4.5-Air's layer shapes with 16 of its 46 layers (bench/configs/glm45_air.json): the
// parameter count equals HF's (Glm4MoeForCausalLM on the meta device: 36,607,463,424 parameters
// plus 15 x 128 correction-bias entries), and the full 46 layers give HF's 106,852,245,504 (+ 5,760).
TEST(moe_models_bench_config_glm45_air) {
    char *json = NULL;
    ASSERT_OK(file_read_all("bench/configs/glm45_air.json", &json, NULL, NULL));
    struct model_config c;
    struct error err = {0};
    memset(&c, 0, sizeof c);
    ASSERT_OK(model_config_parse_json(&c, json, "glm45_air.json", &err));
    ASSERT_OK(model_config_validate(&c, "glm45_air.json", &err));
    free(json);
    ASSERT_EQ(c.arch, MODEL_ARCH_GLM4_MOE);
    ASSERT_EQ(c.num_layers, 16);
    ASSERT_EQ(c.rope.rotary_dim, 64);
    ASSERT_EQ(c.n_shared_experts, 1);
    ASSERT_TRUE(!model_config_layer_is_moe(&c, 0) && model_config_layer_is_moe(&c, 1));
    int64_t n = model_param_count(&c);
    fprintf(stderr, "  glm45_air (16 layers): %lld parameters\n", (long long)n);
    ASSERT_EQ(n, 36607463424LL + 15 * 128);
    c.num_layers = 46;
    ASSERT_EQ(model_param_count(&c), 106852245504LL + 45 * 128);
}

// Bad MoE configs are refused with a message, never a crash.
TEST(moe_models_bad_configs_rejected) {
    const char *bad[] = {
        // top-k larger than the experts
        "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":1,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
        "\"vocab_size\":256,\"num_experts\":4,\"num_experts_per_tok\":5,\"moe_intermediate_size\":32}",
        // shared experts (not implemented yet)
        "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":1,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
        "\"vocab_size\":256,\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
        "\"n_shared_experts\":1}",
        // GLM-4-MoE: softmax scoring (HF's router is sigmoid only)
        "{\"architectures\":[\"Glm4MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
        "\"vocab_size\":256,\"n_routed_experts\":8,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
        "\"scoring_func\":\"softmax\"}",
        // GLM-4-MoE: groups of one expert (scored by their top two)
        "{\"architectures\":[\"Glm4MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
        "\"vocab_size\":256,\"n_routed_experts\":8,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
        "\"n_group\":8,\"topk_group\":4}",
        // GLM-4-MoE: the kept groups hold fewer experts than top-k (1 group of 2, top-3)
        "{\"architectures\":[\"Glm4MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
        "\"vocab_size\":256,\"n_routed_experts\":8,\"num_experts_per_tok\":3,\"moe_intermediate_size\":32,"
        "\"n_group\":4,\"topk_group\":1}",
        // GLM-4-MoE: n_group does not divide the experts
        "{\"architectures\":[\"Glm4MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":64,"
        "\"vocab_size\":256,\"n_routed_experts\":8,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
        "\"n_group\":3,\"topk_group\":2}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char dir[] = "/tmp/atomc_moe_badXXXXXX";
        ASSERT_TRUE(mkdtemp(dir) != NULL);
        char path[256];
        snprintf(path, sizeof path, "%s/config.json", dir);
        FILE *f = fopen(path, "w");
        ASSERT_TRUE(f != NULL);
        fputs(bad[i], f);
        fclose(f);
        struct runner_options o = base_options(dir);
        o.load_format = "dummy";
        struct model_runner *r = NULL;
        struct error err = {0};
        atomc_status st = model_runner_create(&o, &r, &err);
        ASSERT_TRUE(st != ATOMC_OK);
        ASSERT_TRUE(r == NULL);
        ASSERT_TRUE(strlen(err.msg) > 0);
        fprintf(stderr, "  rejected: %s\n", err.msg);
        unlink(path);
        rmdir(dir);
    }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
