// Backend capabilities (struct backend_caps): a model the CUDA backend cannot run is refused at
// load with a message, never a CHECK abort inside a forward. Driven with the CUDA backend's own
// table (src/backend/cuda/cuda_caps.c, compiled into every build), so no GPU is needed: the check
// itself (model_check_backend_caps), and a whole model_runner_create over a CPU backend that
// reports the CUDA table.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/config.h"
#include "model/model.h"
#include "runtime/model_runner.h"
#include "test.h"

static char *read_fixture_config(void) {
    const char *path = test_fixture("models/llama_gqa/config.json");
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

// The llama_gqa fixture's config with `key` replaced by `value` (JSON text), parsed.
static atomc_status config_with(struct model_config *c, const char *key, const char *value, struct error *err) {
    char *json = read_fixture_config();
    if (!json) return error_set(err, ATOMC_ERR_NOT_FOUND, "fixture config missing");
    char *out = calloc(1, strlen(json) + 256);
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    char *p = key ? strstr(json, pat) : NULL;
    if (p) {
        char *end = p + strlen(pat);
        while (*end && *end != ',' && *end != '\n') end++;
        sprintf(out, "%.*s\"%s\": %s%s", (int)(p - json), json, key, value, end);
    } else {
        strcpy(out, json);
    }
    memset(c, 0, sizeof *c);
    atomc_status st = model_config_parse_json(c, out, "config.json", err);
    free(json);
    free(out);
    return st;
}

static struct model_load_options cuda_like_options(void) {
    return (struct model_load_options){.weight_dtype = DTYPE_BF16, .kv_dtype = DTYPE_BF16, .block_size = 16};
}

TEST(caps_cuda_accepts_what_its_kernels_run) {
    struct model_config c;
    struct error err = {0};
    ASSERT_OK(config_with(&c, NULL, NULL, &err));
    struct model_load_options o = cuda_like_options();
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
    ASSERT_OK(config_with(&c, "head_dim", "128", &err));
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
    o.kv_dtype = DTYPE_FP8_E4M3;
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
}

TEST(caps_cuda_refuses_head_dims_dtypes_and_block_sizes) {
    struct model_config c;
    struct error err = {0};
    struct model_load_options o = cuda_like_options();
    ASSERT_OK(config_with(&c, "head_dim", "96", &err));
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "head_dim 96") && strstr(err.msg, "cuda") && strstr(err.msg, "64, 128"));
    // The CPU backend runs any head dim.
    struct model_load_options oc = {.weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_F32, .block_size = 16};
    ASSERT_OK(model_check_backend_caps(&c, &backend_cpu_caps, &oc, &err));

    ASSERT_OK(config_with(&c, NULL, NULL, &err));
    o.weight_dtype = DTYPE_F32; // CUDA matmuls take BF16 weights only
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "weight dtype F32") != NULL);
    o = cuda_like_options();
    o.kv_dtype = DTYPE_F32;
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "KV cache dtype") != NULL);
    o = cuda_like_options();
    o.block_size = 24;
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "power of two") != NULL);
    o.block_size = 1;
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_OK(model_check_backend_caps(&c, &backend_cpu_caps,
                                       &(struct model_load_options){.weight_dtype = DTYPE_F32,
                                                                    .kv_dtype = DTYPE_F32, .block_size = 24},
                                       &err));
}

TEST(caps_cuda_refuses_moe_beyond_its_router) {
    struct model_config c;
    struct error err = {0};
    struct model_load_options o = cuda_like_options();
    ASSERT_OK(config_with(&c, NULL, NULL, &err));
    c.num_experts = 2048;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 64;
    ASSERT_EQ(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "2048 experts") != NULL);
    c.num_experts = 64;
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
    // The CUDA router runs sigmoid and grouped routing; a backend whose table lacks them refuses.
    struct backend_caps plain = backend_cuda_caps;
    plain.moe_sigmoid_scoring = plain.moe_grouped_topk = false;
    snprintf(c.scoring_func, sizeof c.scoring_func, "sigmoid");
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
    ASSERT_EQ(model_check_backend_caps(&c, &plain, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "sigmoid") != NULL);
    c.scoring_func[0] = 0;
    c.n_group = 8;
    c.topk_group = 4;
    ASSERT_OK(model_check_backend_caps(&c, &backend_cuda_caps, &o, &err));
    ASSERT_EQ(model_check_backend_caps(&c, &plain, &o, &err), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(err.msg, "n_group 8") != NULL);
}

// A whole runner start on a CPU backend that reports the CUDA table: dummy weights of a config
// whose head_dim the CUDA attention lacks give a status and a message, and nothing aborts.
TEST(caps_cuda_table_refuses_at_runner_create) {
    const char *dir = test_tmp_path("hd96");
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    ASSERT_EQ(system(cmd), 0);
    char *json = read_fixture_config();
    ASSERT_TRUE(json != NULL);
    char *p = strstr(json, "\"head_dim\": 64");
    ASSERT_TRUE(p != NULL);
    memcpy(p, "\"head_dim\": 96", 14);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    test_write_file(path, json, strlen(json));
    free(json);
    for (int hd96 = 1; hd96 >= 0; hd96--) {
        if (!hd96) { // the same config at head_dim 64 loads under the same caps
            json = read_fixture_config();
            test_write_file(path, json, strlen(json));
            free(json);
        }
        struct backend *b = NULL;
        struct error err = {0};
        struct backend_options bo = {.num_threads = 1};
        ASSERT_OK(backend_cpu_create(&bo, &b, &err));
        b->caps = &backend_cuda_caps;
        struct runner_options o = {.model_path = dir, .load_format = "dummy", .dtype = "bfloat16",
                                   .kv_cache_dtype = "bf16", .block_size = 16, .max_num_seqs = 2,
                                   .max_num_batched_tokens = 32, .max_model_len = 64, .num_kv_blocks = 8,
                                   .backend = b, .enforce_eager = true};
        struct model_runner *r = NULL;
        atomc_status st = model_runner_create(&o, &r, &err);
        if (hd96) {
            ASSERT_EQ(st, ATOMC_ERR_UNSUPPORTED);
            ASSERT_TRUE(r == NULL);
            ASSERT_TRUE(strstr(err.msg, "head_dim 96") != NULL);
        } else {
            ASSERT_OK(st);
            model_runner_free(r);
        }
    }
}

int main(int argc, char **argv) { return test_main(argc, argv); }
