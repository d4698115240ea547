// The DeepSeek family (src/model/deepseek.c) beyond the HF comparisons of tests/test_models.c:
// config parsing of the fixture and the bench shapes (parameter counts equal transformers' on the
// meta device, plus noaux_tc's e_score_correction_bias, which transformers keeps as a buffer),
// the latent cache spec and its bytes per token, and every refusal: routing methods paired with
// the wrong scoring, bad groups, attention biases, FP8 checkpoints with two shared experts, a backend without MLA ops (the CUDA
// caps table).
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/mapped_file.h"
#include "model/model.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "runner_util.h"
#include "test.h"

static int parse_file(const char *path, struct model_config *c) {
    char *json = NULL;
    struct error err = {0};
    if (file_read_all(path, &json, NULL, &err) != ATOMC_OK) return -1;
    memset(c, 0, sizeof *c);
    atomc_status st = model_config_parse_json(c, json, path, &err);
    free(json);
    if (st == ATOMC_OK) st = model_config_validate(c, path, &err);
    if (st != ATOMC_OK) fprintf(stderr, "  %s: %s\n", path, err.msg);
    return st == ATOMC_OK ? 0 : -1;
}

TEST(deepseek_v2_fixture_config) {
    struct model_config c;
    ASSERT_EQ(parse_file(test_fixture("models/deepseek_v2/config.json"), &c), 0);
    ASSERT_EQ(c.arch, MODEL_ARCH_DEEPSEEK_V2);
    ASSERT_EQ(c.q_lora_rank, 0);
    ASSERT_EQ(c.kv_lora_rank, 64);
    ASSERT_EQ(c.qk_nope_head_dim, 32);
    ASSERT_EQ(c.qk_rope_head_dim, 32);
    ASSERT_EQ(c.v_head_dim, 48);
    ASSERT_EQ(c.head_dim, 32); // = qk_rope_head_dim, as transformers sets it
    ASSERT_EQ(c.rope.rotary_dim, 32);
    ASSERT_TRUE(c.rope.interleaved);
    ASSERT_EQ(c.rope.scaling, ROPE_SCALING_YARN);
    ASSERT_NEAR(c.rope.mscale_all_dim, 0.707, 1e-6);
    ASSERT_STREQ(c.topk_method, "greedy");
    ASSERT_STREQ(c.scoring_func, "softmax");
    ASSERT_EQ(c.num_experts, 8);
    ASSERT_EQ(c.n_shared_experts, 2);
    ASSERT_NEAR(c.routed_scaling_factor, 1.5, 1e-6);
    ASSERT_EQ(c.moe_layer_freq, 1);
    for (int l = 0; l < c.num_layers; l++)
        ASSERT_TRUE(model_config_layer_is_moe(&c, l));
}

TEST(deepseek_bench_configs) {
    static const struct {
        const char *file;
        int64_t params; // transformers on the meta device (+ e_score_correction_bias buffers)
        enum model_arch arch;
        int dense_layers;
    } want[] = {
        {"bench/configs/deepseek_v2_lite.json", 15706484224LL, MODEL_ARCH_DEEPSEEK_V2, 1},
        {"bench/configs/moonlight_16b_a3b.json", 15960108544LL + 1664, MODEL_ARCH_DEEPSEEK_V3, 1},
        {"bench/configs/deepseek_v3_4layers.json", 36958706688LL + 768, MODEL_ARCH_DEEPSEEK_V3, 1},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        struct model_config c;
        ASSERT_EQ(parse_file(want[i].file, &c), 0);
        ASSERT_EQ(c.arch, want[i].arch);
        int64_t n = model_param_count(&c);
        fprintf(stderr, "  %s: %lld parameters\n", want[i].file, (long long)n);
        ASSERT_EQ(n, want[i].params);
        for (int l = 0; l < c.num_layers; l++)
            ASSERT_EQ(model_config_layer_is_moe(&c, l), l >= want[i].dense_layers);
    }
    // DeepSeek-V3: 576 latent values per token and layer (512 + 64) instead of 2 x 128 x 128.
    struct model_config c;
    ASSERT_EQ(parse_file("bench/configs/deepseek_v3_4layers.json", &c), 0);
    struct cache_spec s = {.kind = CACHE_KIND_LATENT, .latent_dim = c.kv_lora_rank + c.qk_rope_head_dim};
    ASSERT_EQ((long long)cache_spec_token_bytes(&s, DTYPE_BF16), 1152);
    ASSERT_EQ((long long)cache_spec_token_bytes(&s, DTYPE_FP8_E4M3), 576);
    ASSERT_EQ(c.num_nextn_predict_layers, 1);
}

// The fixture's config.json with one key replaced (a JSON fragment), in a temporary directory.
static int write_variant(char *dir, const char *key, const char *value) {
    char *json = NULL;
    if (file_read_all(test_fixture("models/deepseek_v2/config.json"), &json, NULL, NULL) != ATOMC_OK) return -1;
    if (!mkdtemp(dir)) return -1;
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    // Keys are unique in the fixture; the new value goes first, the old key is renamed away.
    char *k = NULL;
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    if ((k = strstr(json, pat))) k[1] = 'X';
    fprintf(f, "{\"%s\": %s, %s", key, value, strchr(json, '{') + 1);
    fclose(f);
    free(json);
    return 0;
}

static void cleanup(const char *dir) {
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

static atomc_status try_load(const char *dir, struct error *err) {
    struct runner_options o = {.model_path = dir,
                               .device = "cpu",
                               .dtype = "auto",
                               .load_format = "dummy",
                               .kv_cache_dtype = "auto",
                               .block_size = 4,
                               .num_kv_blocks = 64,
                               .max_num_seqs = 4,
                               .max_num_batched_tokens = 64,
                               .max_model_len = 64,
                               .num_threads = 1};
    struct model_runner *r = NULL;
    atomc_status st = model_runner_create(&o, &r, err);
    model_runner_free(r);
    return st;
}

TEST(deepseek_unsupported_configs_refused) {
    static const struct {
        const char *key, *value, *expect;
    } bad[] = {
        {"n_group", "3", "n_group"},
        {"topk_method", "\"noaux_tc\"", "noaux_tc"},
        {"scoring_func", "\"sigmoid\"", "sigmoid"},
        {"attention_bias", "true", "attention_bias"},
        {"topk_method", "\"random\"", "topk_method"},
        {"kv_lora_rank", "0", "kv_lora_rank"},
        {"quantization_config", "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}", "shared experts in a quantized"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char dir[] = "/tmp/atomc_ds_badXXXXXX";
        ASSERT_EQ(write_variant(dir, bad[i].key, bad[i].value), 0);
        struct error err = {0};
        atomc_status st = try_load(dir, &err);
        cleanup(dir);
        fprintf(stderr, "  %s = %s: %s\n", bad[i].key, bad[i].value, err.msg);
        ASSERT_TRUE(st != ATOMC_OK);
        ASSERT_TRUE(strstr(err.msg, bad[i].expect) != NULL);
    }
    // The unchanged config loads (dummy weights): the refusals above are the keys, not the file.
    char dir[] = "/tmp/atomc_ds_okXXXXXX";
    ASSERT_EQ(write_variant(dir, "moe_layer_freq", "1"), 0);
    struct error err = {0};
    atomc_status st = try_load(dir, &err);
    cleanup(dir);
    if (st != ATOMC_OK) fprintf(stderr, "  %s\n", err.msg);
    ASSERT_OK(st);
}

// A backend without MLA ops refuses the model before any weight is loaded, naming MLA; the CUDA
// table takes the fixture's shape but refuses a kv_lora_rank its kernels do not (> 512 or not a
// multiple of 32).
TEST(deepseek_backend_without_mla_refused) {
    struct model_config c;
    ASSERT_EQ(parse_file(test_fixture("models/deepseek_v2/config.json"), &c), 0);
    struct model_load_options o = {.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
    struct error err = {0};
    ASSERT_OK(model_check_backend_caps(&c, &backend_cpu_caps, &o, &err));
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
    struct backend_caps no_mla = backend_cpu_caps;
    no_mla.mla = false;
    atomc_status st = model_check_backend_caps(&c, &no_mla, &o, &err);
    fprintf(stderr, "  no MLA ops: %s\n", err.msg);
    ASSERT_EQ(st, ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "latent attention") != NULL);
    const int bad_lora[] = {520, 48};
    for (int i = 0; i < 2; i++) {
        c.kv_lora_rank = bad_lora[i];
        st = model_check_backend_caps(&c, &backend_cuda_caps, &o, &err);
        fprintf(stderr, "  cuda, kv_lora_rank %d: %s\n", bad_lora[i], err.msg);
        ASSERT_EQ(st, ATOMC_ERR_UNSUPPORTED);
        ASSERT_TRUE(strstr(err.msg, "kv_lora_rank") != NULL);
    }
}

// A checkpoint with an MTP layer (num_nextn_predict_layers 1, tensors model.layers.<3>.* after the
// 3 decoder layers, in a second shard): it loads and its tensors are skipped; the same files without
// num_nextn_predict_layers are refused naming the layer's tensor (model_files_check_consumed), so the skip is by
// declaration, not silent.
static int write_shard(const char *path, const char *name) {
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", name);
    while (n % 8)
        hdr[n++] = ' ';
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    uint64_t len = (uint64_t)n;
    float data[4] = {1, 2, 3, 4};
    int ok = fwrite(&len, 8, 1, f) == 1 && fwrite(hdr, 1, (size_t)n, f) == (size_t)n && fwrite(data, 4, 4, f) == 4;
    fclose(f);
    return ok ? 0 : -1;
}

static int write_mtp_checkpoint(char *dir, bool declare) {
    if (!mkdtemp(dir)) return -1;
    char path[512], src[4096];
    if (!realpath(test_fixture("models/deepseek_v2/model.safetensors"), src)) return -1;
    snprintf(path, sizeof path, "%s/model-00001.safetensors", dir);
    if (symlink(src, path) != 0) return -1;
    snprintf(path, sizeof path, "%s/model-00002.safetensors", dir);
    if (write_shard(path, "model.layers.3.eh_proj.weight") != 0) return -1;
    // The index lists every tensor of the fixture and the MTP one.
    FILE *in = fopen(src, "rb");
    uint64_t hl = 0;
    if (!in || fread(&hl, 8, 1, in) != 1 || hl > (1u << 20)) return -1;
    char *h = calloc(1, hl + 1);
    if (fread(h, 1, hl, in) != hl) return -1;
    fclose(in);
    json_t *root = json_loads(h, 0, NULL), *map = json_object();
    free(h);
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (strcmp(k, "__metadata__")) json_object_set_new(map, k, json_string("model-00001.safetensors"));
    }
    json_decref(root);
    json_object_set_new(map, "model.layers.3.eh_proj.weight", json_string("model-00002.safetensors"));
    json_t *idx = json_pack("{s:{},s:o}", "metadata", "weight_map", map);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    int st = json_dump_file(idx, path, 0);
    json_decref(idx);
    if (st != 0) return -1;
    char *cfg = NULL;
    if (file_read_all(test_fixture("models/deepseek_v2/config.json"), &cfg, NULL, NULL) != ATOMC_OK) return -1;
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    if (declare)
        fprintf(f, "{\"num_nextn_predict_layers\": 1, %s", strchr(cfg, '{') + 1);
    else
        fputs(cfg, f);
    fclose(f);
    free(cfg);
    return 0;
}

static void rm_mtp_checkpoint(const char *dir) {
    const char *files[] = {"model-00001.safetensors", "model-00002.safetensors", "model.safetensors.index.json",
                           "config.json"};
    char path[512];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
}

TEST(deepseek_mtp_layers_skipped_by_declaration) {
    for (int declare = 1; declare >= 0; declare--) {
        char dir[] = "/tmp/atomc_ds_mtpXXXXXX";
        ASSERT_EQ(write_mtp_checkpoint(dir, declare), 0);
        struct runner_options o = small_cpu_runner_options(dir);
        o.num_threads = 1;
        struct model_runner *r = NULL;
        struct error err = {0};
        atomc_status st = model_runner_create(&o, &r, &err);
        model_runner_free(r);
        rm_mtp_checkpoint(dir);
        if (declare) {
            if (st != ATOMC_OK) fprintf(stderr, "  %s\n", err.msg);
            ASSERT_OK(st);
        } else {
            fprintf(stderr, "  undeclared MTP tensor: %s\n", err.msg);
            ASSERT_TRUE(st != ATOMC_OK);
            ASSERT_TRUE(strstr(err.msg, "model.layers.3.eh_proj.weight") != NULL);
        }
    }
}

// The fixtures with a BF16 and an FP8 E4M3 latent cache (unit scale): full-prompt logits against HF
// within the rounding of the cache, stated as a fraction of max(1, max |logit|): BF16 2e-2, FP8
// 2e-1 (these random-weight models amplify rounding: the GQA fixture llama_gqa with an FP8 K/V
// cache is off by 10% of its scale, deepseek_v2 by 12%, deepseek_v3 by 14%). Checks that low-precision latent rows are
// laid out and dequantised right (a wrong layout is off by the scale itself).
TEST(deepseek_low_precision_latent_cache) {
    const char *models[] = {"deepseek_v2", "deepseek_v3"};
    const struct {
        const char *dt;
        double rtol;
    } kv[] = {{"bfloat16", 2e-2}, {"fp8", 2e-1}};
    for (int mi = 0; mi < 2; mi++)
        for (int ki = 0; ki < 2; ki++) {
            struct refs R;
            ASSERT_EQ(refs_load(models[mi], &R, kv[ki].rtol, 1.0), 0);
            char rel[64], path[4096];
            snprintf(rel, sizeof rel, "models/%s", models[mi]);
            snprintf(path, sizeof path, "%s", test_fixture(rel));
            struct runner_options o = {.model_path = path,
                                       .device = "cpu",
                                       .dtype = "auto",
                                       .load_format = "auto",
                                       .kv_cache_dtype = kv[ki].dt,
                                       .block_size = 4,
                                       .num_kv_blocks = 64,
                                       .max_num_seqs = 4,
                                       .max_num_batched_tokens = 64,
                                       .max_model_len = 64,
                                       .num_threads = 2};
            struct model_runner *r = NULL;
            struct error err = {0};
            ASSERT_OK(model_runner_create(&o, &r, &err));
            struct sim *sm = malloc(sizeof *sm);
            sim_init(sm, r, 5u);
            double worst = 0;
            for (int pi = 0; pi < R.n; pi++) {
                struct ref_prompt *p = &R.p[pi];
                struct sim_seq *q = malloc(sizeof *q);
                sim_seq_init(q, p->ids, p->n);
                sim_step_begin(sm);
                ASSERT_EQ(sim_step_add(sm, q, p->n, 0), 0);
                for (int k = 0; k < p->n_pos; k++)
                    sm->rows[k] = p->pos[k];
                sm->n_rows = p->n_pos;
                struct forward_batch fb = sim_step_batch(sm);
                float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R.vocab);
                ASSERT_OK(model_runner_execute_logits(r, &fb, lg, &err));
                double d = max_abs_diff(lg, p->logits, p->n_pos * R.vocab);
                if (d > worst) worst = d;
                free(lg);
                sim_seq_release(sm, q);
                free(q);
            }
            fprintf(stderr, "  %s, %s latent cache: max |logit - HF| = %.2e (tolerance %.2e)\n", models[mi], kv[ki].dt,
                    worst, R.tol);
            sim_free(sm);
            free(sm);
            model_runner_free(r);
            refs_free(&R);
            ASSERT_TRUE(worst <= R.tol);
        }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
