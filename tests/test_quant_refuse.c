// Refusal of what the engine does not implement: quantization configs, tensors the model
// never reads, and tensor dtypes that cannot be converted exactly.
// - quantization_config parsing of each method's form (fp8, compressed-tensors, gptq, awq,
//   mxfp4, bitsandbytes, modelopt, unknown), the side files (quantize_config.json,
//   hf_quant_config.json) and malformed values, which must name their field.
// - model_quant_check messages: quant_method, format and strategy named.
// - tests/fixtures/quant (tools/make_quant_fixtures.py, written by compressed-tensors and in
//   the fp8 layout transformers reads): the implemented ones load (test_quant_cpu.c runs them);
//   fp8_no_config and unknown_tensor are refused by model_runner_create with their message;
//   with the quantization config dropped, the consumption check still catches the unread
//   scale tensors.
// - Every committed unquantized fixture (tests/fixtures/models/*, the sharded HF one, the
//   loadable GGUF ones, SmolLM2 when $ATOMC_SMOLLM2 is set) loads with every tensor read.
// - Retyped copies of fixtures (same bytes, another dtype in the header): integer or
//   unsupported float dtypes in weight slots are refused naming the tensor.
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/backend.h"
#include "loader/model_files.h"
#include "model/model.h"
#include "model/quant.h"
#include "runtime/model_runner.h"
#include "test.h"

static struct model_config cfg; // large: keep off the stack

#define LLAMA_BASE                                                                                                     \
    "\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "                     \
    "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"vocab_size\": 128"

// Parses a config.json made of LLAMA_BASE plus `quant` (a `"quantization_config": {...}` member or "").
static atomc_status parse_with(const char *quant, struct error *e) {
    char json[8192];
    snprintf(json, sizeof json, "{" LLAMA_BASE "%s%s}", quant[0] ? ", " : "", quant);
    return model_config_parse_json(&cfg, json, "config.json", e);
}

static bool has(const char *msg, const char *needle) {
    if (strstr(msg, needle)) return true;
    fprintf(stderr, "  message lacks \"%s\": %s\n", needle, msg);
    return false;
}

// ---------------------------------------------------------------------------------
// Parsing.

TEST(no_quantization_config_is_absent) {
    struct error e = {0};
    ASSERT_OK(parse_with("", &e));
    ASSERT_TRUE(!cfg.quant.present);
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_NONE);
    ASSERT_OK(model_quant_check(&cfg, &e));
    ASSERT_OK(parse_with("\"quantization_config\": null", &e)); // null = absent
    ASSERT_TRUE(!cfg.quant.present);
    ASSERT_OK(model_quant_check(&cfg, &e));
}

TEST(fp8_block_deepseek_form) {
    struct error e = {0};
    ASSERT_OK(
        parse_with("\"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", "
                   "\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], \"some_future_key\": {\"x\": 1}}",
                   &e));
    const struct quant_config *q = &cfg.quant;
    ASSERT_TRUE(q->present);
    ASSERT_EQ(q->method, QUANT_METHOD_FP8);
    ASSERT_STREQ(q->method_name, "fp8");
    ASSERT_STREQ(q->format, "e4m3");
    ASSERT_STREQ(q->origin, "quantization_config");
    ASSERT_EQ(q->n_schemes, 1);
    const struct quant_scheme *s = &q->schemes[0];
    ASSERT_EQ(s->weights.type, QUANT_TYPE_FLOAT);
    ASSERT_EQ(s->weights.num_bits, 8);
    ASSERT_EQ(s->weights.strategy, QUANT_STRATEGY_BLOCK);
    ASSERT_EQ(s->weights.block_size[0], 128);
    ASSERT_EQ(s->weights.block_size[1], 128);
    ASSERT_EQ(s->act_scheme, QUANT_ACT_DYNAMIC);
    ASSERT_EQ(s->input_act.strategy, QUANT_STRATEGY_GROUP); // per token and 128 channels
    ASSERT_EQ(s->input_act.group_size, 128);
    ASSERT_EQ(q->n_ignore, 0);
    // Implemented (the CPU runs it: test_quant_cpu.c); every linear gets 128x128 FP8 blocks.
    ASSERT_OK(model_quant_check(&cfg, &e));
    struct quant_weight_plan p;
    model_quant_weight_plan(&cfg, "model.layers.3.self_attn.q_proj", &p);
    ASSERT_EQ(p.scheme, WEIGHT_SCHEME_BLOCK);
    ASSERT_EQ(p.values_dtype, DTYPE_FP8_E4M3);
    ASSERT_STREQ(p.values, "weight");
    ASSERT_STREQ(p.scale, "weight_scale_inv");
    ASSERT_EQ(p.block_rows, 128);
    ASSERT_EQ(p.block_cols, 128);
    // Its static-activation variant is not, and the refusal names it.
    ASSERT_OK(parse_with("\"quantization_config\": {\"activation_scheme\": \"static\", \"fmt\": \"e4m3\", "
                         "\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}",
                         &e));
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quantization_config: quant_method 'fp8'"));
    ASSERT_TRUE(has(e.msg, "format e4m3"));
    ASSERT_TRUE(has(e.msg, "strategy block [128, 128]"));
    ASSERT_TRUE(has(e.msg, "activations float8, strategy group"));
    ASSERT_TRUE(has(e.msg, "is not implemented; supported: none (unquantized safetensors), GGUF Q8_0/Q4_0/Q4_1, "
                           "fp8 e4m3 with weight_block_size [128, 128]"));
}

TEST(fp8_per_tensor_static) {
    struct error e = {0};
    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"fp8\", \"activation_scheme\": \"static\", "
                         "\"modules_to_not_convert\": [\"lm_head\", \"model.layers.0.mlp.gate\"]}",
                         &e));
    const struct quant_scheme *s = &cfg.quant.schemes[0];
    ASSERT_EQ(s->weights.strategy, QUANT_STRATEGY_TENSOR);
    ASSERT_EQ(s->weights.block_size[0], 0);
    ASSERT_EQ(s->act_scheme, QUANT_ACT_STATIC);
    ASSERT_EQ(cfg.quant.n_ignore, 2);
    ASSERT_STREQ(cfg.quant.ignore[1], "model.layers.0.mlp.gate");
    // Implemented since issue 19 part 3: per-tensor FP8 weights, the stored input_scale per module.
    ASSERT_OK(model_quant_check(&cfg, &e));
    struct quant_weight_plan p;
    model_quant_weight_plan(&cfg, "model.layers.0.self_attn.q_proj", &p);
    ASSERT_EQ(p.scheme, WEIGHT_SCHEME_PER_TENSOR);
    ASSERT_EQ(p.act, WEIGHT_ACT_FP8_STATIC);
    ASSERT_STREQ(p.input_scale, "input_scale");
    ASSERT_STREQ(p.scale, "weight_scale");
    // Its dynamic variant (a per-tensor scale computed per call) is not, and the refusal names it.
    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\"}",
                         &e));
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "strategy tensor"));
    ASSERT_TRUE(has(e.msg, "activations float8 dynamic, strategy tensor"));
}

// The fixtures' own config.json files, as compressed-tensors wrote them.
static atomc_status parse_fixture_config(const char *rel, struct error *e) {
    char *text = NULL;
    FILE *f = fopen(test_fixture(rel), "rb");
    if (!f) {
        fprintf(stderr, "  cannot open fixture %s\n", test_fixture(rel));
        return ATOMC_ERR_IO;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    text = calloc(1, (size_t)n + 1);
    size_t got = fread(text, 1, (size_t)n, f);
    fclose(f);
    atomc_status st = got == (size_t)n ? model_config_parse_json(&cfg, text, rel, e) : ATOMC_ERR_IO;
    free(text);
    return st;
}

TEST(compressed_tensors_fp8_channel_fixture_config) {
    struct error e = {0};
    ASSERT_OK(parse_fixture_config("quant/ct_fp8_channel/config.json", &e));
    const struct quant_config *q = &cfg.quant;
    ASSERT_EQ(q->method, QUANT_METHOD_COMPRESSED_TENSORS);
    ASSERT_STREQ(q->format, "float-quantized");
    ASSERT_EQ(q->n_schemes, 1);
    const struct quant_scheme *s = &q->schemes[0];
    ASSERT_STREQ(s->name, "group_0");
    ASSERT_STREQ(s->format, "float-quantized");
    ASSERT_EQ(s->n_targets, 1);
    ASSERT_STREQ(s->targets[0], "Linear");
    ASSERT_EQ(s->weights.type, QUANT_TYPE_FLOAT);
    ASSERT_EQ(s->weights.num_bits, 8);
    ASSERT_EQ(s->weights.strategy, QUANT_STRATEGY_CHANNEL);
    ASSERT_TRUE(s->weights.symmetric);
    ASSERT_TRUE(s->input_act.present);
    ASSERT_EQ(s->input_act.strategy, QUANT_STRATEGY_TOKEN);
    ASSERT_EQ(s->act_scheme, QUANT_ACT_DYNAMIC);
    ASSERT_TRUE(!q->kv_cache.present);
    ASSERT_STREQ(q->sparsity_format, "");
    ASSERT_EQ(q->n_ignore, 1);
    ASSERT_STREQ(q->ignore[0], "lm_head");
    ASSERT_OK(model_quant_check(&cfg, &e)); // implemented: per-channel FP8 weights (the CPU: weight-only)
    struct quant_weight_plan p;
    model_quant_weight_plan(&cfg, "model.layers.0.mlp.down_proj", &p);
    ASSERT_EQ(p.scheme, WEIGHT_SCHEME_PER_CHANNEL);
    ASSERT_STREQ(p.scale, "weight_scale");
    model_quant_weight_plan(&cfg, "lm_head", &p); // in the ignore list
    ASSERT_EQ(p.scheme, WEIGHT_SCHEME_NONE);
}

TEST(compressed_tensors_w4a16_fixture_config) {
    struct error e = {0};
    ASSERT_OK(parse_fixture_config("quant/ct_w4a16_group128/config.json", &e));
    const struct quant_scheme *s = &cfg.quant.schemes[0];
    ASSERT_STREQ(cfg.quant.format, "pack-quantized");
    ASSERT_EQ(s->weights.type, QUANT_TYPE_INT);
    ASSERT_EQ(s->weights.num_bits, 4);
    ASSERT_EQ(s->weights.strategy, QUANT_STRATEGY_GROUP);
    ASSERT_EQ(s->weights.group_size, 128);
    ASSERT_TRUE(!s->input_act.present);
    ASSERT_EQ(s->act_scheme, QUANT_ACT_NONE);
    ASSERT_OK(model_quant_check(&cfg, &e)); // implemented: symmetric INT4 groups
    struct quant_weight_plan p;
    model_quant_weight_plan(&cfg, "model.layers.0.self_attn.o_proj", &p);
    ASSERT_EQ(p.scheme, WEIGHT_SCHEME_GROUP);
    ASSERT_EQ(p.values_dtype, DTYPE_I32);
    ASSERT_EQ(p.bits, 4);
    ASSERT_STREQ(p.values, "weight_packed");
    ASSERT_TRUE(p.shape_tensor);
    ASSERT_EQ(p.block_cols, 128);
    ASSERT_TRUE(p.zero == NULL);
    // With zero points it is implemented too (issue 19 part 3): the plan reads weight_zero_point ...
    cfg.quant.schemes[0].weights.symmetric = false;
    ASSERT_OK(model_quant_check(&cfg, &e));
    model_quant_weight_plan(&cfg, "model.layers.0.self_attn.q_proj", &p);
    ASSERT_STREQ(p.zero, "weight_zero_point");
    ASSERT_EQ(p.layout, QUANT_LAYOUT_CT);
    // ... but 2-bit values are not, and the refusal names them.
    cfg.quant.schemes[0].weights.num_bits = 2;
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "format pack-quantized"));
    ASSERT_TRUE(has(e.msg, "weights int2, strategy group, group_size 128, asymmetric"));
    ASSERT_TRUE(has(e.msg, "activations not quantized"));
}

TEST(compressed_tensors_groups_kv_cache_sparsity) {
    struct error e = {0};
    ASSERT_OK(parse_with(
        "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"mixed-precision\", "
        "\"config_groups\": {"
        "\"group_0\": {\"targets\": [\"re:.*self_attn.*\"], \"format\": \"int-quantized\", "
        "\"weights\": {\"num_bits\": 8, \"type\": \"int\", \"strategy\": \"channel\", \"symmetric\": true}, "
        "\"input_activations\": {\"num_bits\": 8, \"type\": \"int\", \"strategy\": \"tensor\", \"dynamic\": false}}, "
        "\"group_1\": {\"targets\": [\"re:.*mlp.*\"], \"format\": \"pack-quantized\", "
        "\"weights\": {\"num_bits\": 4, \"type\": \"int\", \"group_size\": 32, \"symmetric\": false, "
        "\"actorder\": \"weight\"}}}, "
        "\"kv_cache_scheme\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": false}, "
        "\"sparsity_config\": {\"format\": \"sparse-24-bitmask\"}, \"ignore\": \"lm_head\"}",
        &e));
    const struct quant_config *q = &cfg.quant;
    ASSERT_EQ(q->n_schemes, 2);
    ASSERT_STREQ(q->schemes[0].format, "int-quantized");
    ASSERT_EQ(q->schemes[0].act_scheme, QUANT_ACT_STATIC);
    ASSERT_STREQ(q->schemes[1].targets[0], "re:.*mlp.*");
    ASSERT_EQ(q->schemes[1].weights.strategy, QUANT_STRATEGY_GROUP); // inferred from group_size
    ASSERT_EQ(q->schemes[1].weights.group_size, 32);
    ASSERT_TRUE(!q->schemes[1].weights.symmetric);
    ASSERT_STREQ(q->schemes[1].weights.actorder, "weight");
    ASSERT_TRUE(q->kv_cache.present);
    ASSERT_EQ(q->kv_cache.type, QUANT_TYPE_FLOAT);
    ASSERT_STREQ(q->sparsity_format, "sparse-24-bitmask");
    ASSERT_EQ(q->n_ignore, 1); // a single string counts as a list of one
    // Both groups are implemented (int-quantized static INT8, pack-quantized with zero points:
    // issue 19 part 3), and so is the static float8 per-tensor KV-cache scheme (tests/test_quant_kv.c):
    // the sparsity format is what is refused. A dynamic KV scheme is not implemented.
    ASSERT_TRUE(model_quant_kv_fp8(&cfg));
    cfg.quant.kv_cache.dynamic = true;
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "KV-cache quantization (float8 dynamic, strategy tensor) is not implemented"));
    cfg.quant.kv_cache.dynamic = false;
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "sparsity format 'sparse-24-bitmask' is not implemented"));
    char sparsity[sizeof cfg.quant.sparsity_format];
    memcpy(sparsity, cfg.quant.sparsity_format, sizeof sparsity);
    cfg.quant.sparsity_format[0] = '\0';
    ASSERT_OK(model_quant_check(&cfg, &e));
    cfg.quant.schemes[0].input_act.symmetric = false; // asymmetric INT8 activations are not
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "group_0 of 2: format int-quantized; weights int8, strategy channel"));
    cfg.quant.schemes[0].input_act.symmetric = true;
    cfg.quant.kv_cache.present = true;
    memcpy(cfg.quant.sparsity_format, sparsity, sizeof sparsity);
    char d[2048];
    quant_config_describe(q, d, sizeof d);
    ASSERT_TRUE(has(d, "group_1 (targets re:.*mlp.*): format pack-quantized; weights int4, strategy group, "
                       "group_size 32, asymmetric, actorder weight"));
    ASSERT_TRUE(has(d, "kv cache: float8, strategy tensor"));
    ASSERT_TRUE(has(d, "sparsity: sparse-24-bitmask"));

    // group_size -1 means per channel; block_structure may be spelled "RxC"; names are case-blind.
    ASSERT_OK(parse_with(
        "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {"
        "\"a\": {\"weights\": {\"num_bits\": 4, \"group_size\": -1}}, "
        "\"b\": {\"weights\": {\"type\": \"FLOAT\", \"strategy\": \"Block\", \"block_structure\": \"128x64\"}}}}",
        &e));
    ASSERT_EQ(q->schemes[0].weights.strategy, QUANT_STRATEGY_CHANNEL);
    ASSERT_EQ(q->schemes[0].weights.group_size, 0);
    ASSERT_EQ(q->schemes[1].weights.strategy, QUANT_STRATEGY_BLOCK);
    ASSERT_EQ(q->schemes[1].weights.type, QUANT_TYPE_FLOAT);
    ASSERT_EQ(q->schemes[1].weights.block_size[0], 128);
    ASSERT_EQ(q->schemes[1].weights.block_size[1], 64);
}

TEST(legacy_compression_config) {
    struct error e = {0};
    ASSERT_OK(parse_with("\"compression_config\": {\"quantization_config\": {\"format\": \"naive-quantized\", "
                         "\"config_groups\": {\"g\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8}}}}}",
                         &e));
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_COMPRESSED_TENSORS);
    ASSERT_STREQ(cfg.quant.origin, "compression_config.quantization_config");
    ASSERT_EQ(cfg.quant.schemes[0].weights.strategy, QUANT_STRATEGY_TENSOR); // no group_size / block: tensor
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "compression_config.quantization_config: quant_method 'compressed-tensors'"));
    ASSERT_TRUE(has(e.msg, "format naive-quantized"));
}

TEST(gptq_awq_mxfp4_bnb_modelopt_forms) {
    struct error e = {0};
    ASSERT_OK(
        parse_with("\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, \"group_size\": 128, "
                   "\"desc_act\": true, \"sym\": false, \"checkpoint_format\": \"gptq_v2\", \"damp_percent\": 0.01}",
                   &e));
    const struct quant_scheme *s = &cfg.quant.schemes[0];
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_GPTQ);
    ASSERT_STREQ(cfg.quant.format, "gptq_v2");
    ASSERT_EQ(s->weights.num_bits, 4);
    ASSERT_EQ(s->weights.strategy, QUANT_STRATEGY_GROUP);
    ASSERT_TRUE(!s->weights.symmetric);
    ASSERT_STREQ(s->weights.actorder, "desc_act");
    ASSERT_OK(model_quant_check(&cfg, &e)); // implemented (issue 19 part 3)
    struct quant_weight_plan p;
    model_quant_weight_plan(&cfg, "model.layers.0.mlp.down_proj", &p);
    ASSERT_EQ(p.scheme, WEIGHT_SCHEME_GROUP);
    ASSERT_EQ(p.layout, QUANT_LAYOUT_GPTQ);
    ASSERT_STREQ(p.values, "qweight");
    ASSERT_STREQ(p.zero, "qzeros");
    ASSERT_STREQ(p.gidx, "g_idx");
    ASSERT_TRUE(p.gidx_required && !p.gptq_zero_plus_one); // v2 stores the zero itself
    cfg.quant.schemes[0].weights.num_bits = 3;
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'gptq' (format gptq_v2; weights int3, strategy group, group_size 128, "
                           "asymmetric, actorder desc_act"));

    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 8, \"group_size\": -1}", &e));
    ASSERT_EQ(cfg.quant.schemes[0].weights.strategy, QUANT_STRATEGY_CHANNEL);
    ASSERT_EQ(cfg.quant.schemes[0].weights.group_size, 0);

    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"awq\", \"bits\": 4, \"group_size\": 128, "
                         "\"zero_point\": true, \"version\": \"gemm\"}",
                         &e));
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_AWQ);
    ASSERT_STREQ(cfg.quant.format, "gemm");
    ASSERT_TRUE(!cfg.quant.schemes[0].weights.symmetric);
    ASSERT_OK(model_quant_check(&cfg, &e)); // implemented (issue 19 part 3)
    model_quant_weight_plan(&cfg, "model.layers.0.mlp.down_proj", &p);
    ASSERT_EQ(p.layout, QUANT_LAYOUT_AWQ);
    ASSERT_TRUE(p.gidx == NULL);
    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"awq\", \"bits\": 4, \"group_size\": 128, "
                         "\"zero_point\": true, \"version\": \"gemv\"}",
                         &e));
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(
        has(e.msg, "quant_method 'awq' (format gemv; weights int4, strategy group, group_size 128, asymmetric"));

    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"mxfp4\", \"modules_to_not_convert\": "
                         "[\"model.layers.*.self_attn\", \"model.layers.*.mlp.router\", \"model.embed_tokens\", "
                         "\"lm_head\"]}",
                         &e));
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_MXFP4);
    ASSERT_EQ(cfg.quant.n_ignore, 4);
    ASSERT_EQ(cfg.quant.schemes[0].weights.group_size, 32);
    // Implemented for GPT-OSS's experts only (tests/test_models.c runs gpt_oss_mxfp4).
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'mxfp4' is implemented for GptOssForCausalLM's experts only"));

    // On a GPT-OSS config it is implemented (CPU, and CUDA's MoE kernels).
    {
        const char *j = "{\"architectures\": [\"GptOssForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 64, "
                        "\"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
                        "\"vocab_size\": 128, \"num_local_experts\": 4, \"num_experts_per_tok\": 2, "
                        "\"quantization_config\": {\"quant_method\": \"mxfp4\"}}";
        ASSERT_OK(model_config_parse_json(&cfg, j, "config.json", &e));
        ASSERT_OK(model_quant_check(&cfg, &e));
        ASSERT_OK(model_quant_check_backend(&cfg, &backend_cpu_caps, &e));
        ASSERT_OK(model_quant_check_backend(&cfg, &backend_cuda_caps, &e));
        ASSERT_EQ(cfg.layer_types[0], LAYER_ATTN_SLIDING); // GptOssConfig's defaults
        ASSERT_EQ(cfg.layer_types[1], LAYER_ATTN_FULL);
        ASSERT_EQ(cfg.sliding_window, 128);
        ASSERT_TRUE(cfg.attention_bias && cfg.attention_sinks && cfg.norm_topk_prob);
        ASSERT_TRUE(cfg.swiglu_alpha == 1.702f && cfg.swiglu_limit == 7.0f);
        // An explicit null window: no sliding layers (transformers passes sliding_window None).
        const char *jn = "{\"architectures\": [\"GptOssForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": "
                         "64, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
                         "\"vocab_size\": 128, \"num_local_experts\": 4, \"num_experts_per_tok\": 2, "
                         "\"sliding_window\": null}";
        ASSERT_OK(model_config_parse_json(&cfg, jn, "config.json", &e));
        ASSERT_EQ(cfg.sliding_window, 0);
        ASSERT_EQ(cfg.layer_types[0], LAYER_ATTN_FULL);
    }

    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true, "
                         "\"bnb_4bit_quant_type\": \"nf4\", \"bnb_4bit_compute_dtype\": \"bfloat16\"}",
                         &e));
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_BITSANDBYTES);
    ASSERT_STREQ(cfg.quant.format, "nf4");
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'bitsandbytes' (format nf4"));

    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"NVFP4\", "
                         "\"kv_cache_quant_algo\": \"FP8\", \"exclude_modules\": [\"lm_head\"]}",
                         &e));
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_MODELOPT);
    ASSERT_STREQ(cfg.quant.format, "NVFP4");
    ASSERT_EQ(cfg.quant.schemes[0].weights.strategy, QUANT_STRATEGY_TENSOR_GROUP);
    ASSERT_TRUE(cfg.quant.kv_cache.present);
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'modelopt' (format NVFP4; weights float4, strategy tensor_group"));
}

TEST(modelopt_without_algorithm_and_bnb_without_bits_describe_cleanly) {
    struct error e = {0};
    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"modelopt\", \"quantization\": {\"quant_algo\": "
                         "null}}",
                         &e));
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'modelopt' (weights of an unknown type, strategy other"));
    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"bitsandbytes\"}", &e));
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quant_method 'bitsandbytes' (weights int, strategy channel"));
}

TEST(unknown_method_is_kept_and_refused) {
    struct error e = {0};
    ASSERT_OK(parse_with("\"quantization_config\": {\"quant_method\": \"hqq\", \"nbits\": 4}", &e));
    ASSERT_TRUE(cfg.quant.present);
    ASSERT_EQ(cfg.quant.method, QUANT_METHOD_OTHER);
    ASSERT_STREQ(cfg.quant.method_name, "hqq");
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "quantization_config: quant_method 'hqq' is not implemented"));
}

TEST(long_ignore_list_is_counted) {
    static char json[16384];
    size_t n = (size_t)snprintf(json, sizeof json,
                                "\"quantization_config\": {\"quant_method\": \"fp8\", "
                                "\"modules_to_not_convert\": [");
    for (int i = 0; i < 70; i++)
        n += (size_t)snprintf(json + n, sizeof json - n, "%s\"model.layers.%d.mlp.gate\"", i ? ", " : "", i);
    snprintf(json + n, sizeof json - n, "]}");
    struct error e = {0};
    ASSERT_OK(parse_with(json, &e));
    ASSERT_EQ(cfg.quant.n_ignore, 70);
    ASSERT_STREQ(cfg.quant.ignore[QUANT_MAX_IGNORE - 1], "model.layers.63.mlp.gate");
    ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
}

// Malformed values: FORMAT naming the field.
TEST(malformed_quantization_configs_name_the_field) {
    static const struct {
        const char *quant, *field;
    } cases[] = {
        {"\"quantization_config\": \"fp8\"", "key 'quantization_config' must be an object"},
        {"\"quantization_config\": {\"bits\": 4}", "required key 'quantization_config.quant_method' is missing"},
        {"\"quantization_config\": {\"quant_method\": 8}", "key 'quantization_config.quant_method' must be a string"},
        {"\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128]}",
         "key 'quantization_config.weight_block_size' must be a list of 2 positive integers"},
        {"\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": \"128x128\"}",
         "key 'quantization_config.weight_block_size' must be a list of 2 positive integers, got a string"},
        {"\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 0]}",
         "key 'quantization_config.weight_block_size' must be a list of 2 positive integers"},
        {"\"quantization_config\": {\"quant_method\": \"fp8\", \"activation_scheme\": \"sometimes\"}",
         "key 'quantization_config.activation_scheme' = \"sometimes\" must be \"dynamic\" or \"static\""},
        {"\"quantization_config\": {\"quant_method\": \"fp8\", \"modules_to_not_convert\": [\"lm_head\", 3]}",
         "key 'quantization_config.modules_to_not_convert[1]' must be a string, got an integer"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": [1]}",
         "key 'quantization_config.config_groups' must be an object, got an array"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"weights\": {\"num_bits\": \"4\"}}}}",
         "key 'quantization_config.config_groups.group_0.weights.num_bits' must be an integer, got a string"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"weights\": {\"num_bits\": 0}}}}",
         "key 'quantization_config.config_groups.group_0.weights.num_bits' = 0 is out of range"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"weights\": {\"strategy\": \"group\"}}}}",
         "key 'quantization_config.config_groups.group_0.weights.strategy' is \"group\" but "
         "'quantization_config.config_groups.group_0.weights.group_size' is not set"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"input_activations\": {\"dynamic\": \"yes\"}}}}",
         "key 'quantization_config.config_groups.group_0.input_activations.dynamic' must be a boolean or \"local\""},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"weights\": 8}}}",
         "key 'quantization_config.config_groups.group_0.weights' must be an object or null, got an integer"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"weights\": {\"group_size\": 0}}}}",
         "key 'quantization_config.config_groups.group_0.weights.group_size' must be -1 or positive, got 0"},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"group_0\": "
         "{\"weights\": {\"strategy\": \"block\", \"block_structure\": \"128by128\"}}}}",
         "key 'quantization_config.config_groups.group_0.weights.block_structure' = \"128by128\" must be \"RxC\""},
        {"\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"sparsity_config\": \"24\"}",
         "key 'quantization_config.sparsity_config' must be an object or null"},
        {"\"quantization_config\": {\"quant_method\": \"gptq\", \"group_size\": 128}",
         "required key 'quantization_config.bits' is missing"},
        {"\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, \"group_size\": 0}",
         "key 'quantization_config.group_size' must be -1 or positive, got 0"},
        {"\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, \"desc_act\": \"no\"}",
         "key 'quantization_config.desc_act' must be a boolean, got a string"},
        {"\"quantization_config\": {\"quant_method\": \"awq\", \"zero_point\": 1}",
         "key 'quantization_config.zero_point' must be a boolean, got an integer"},
        {"\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true, "
         "\"bnb_4bit_quant_type\": [\"nf4\"]}",
         "key 'quantization_config.bnb_4bit_quant_type' must be a string, got an array"},
        {"\"quantization_config\": {\"quant_method\": \"modelopt\", \"quantization\": 3}",
         "key 'quantization_config.quantization' must be an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct error e = {0};
        atomc_status st = parse_with(cases[i].quant, &e);
        if (st != ATOMC_ERR_FORMAT) fprintf(stderr, "  case %zu: %s -> status %d (%s)\n", i, cases[i].quant, st, e.msg);
        ASSERT_EQ(st, ATOMC_ERR_FORMAT);
        ASSERT_TRUE(has(e.msg, "config.json: "));
        ASSERT_TRUE(has(e.msg, cases[i].field));
    }
    // An over-long module name is refused, not cut.
    char json[1024], longname[300];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    snprintf(json, sizeof json,
             "\"quantization_config\": {\"quant_method\": \"fp8\", \"modules_to_not_convert\": [\"%s\"]}", longname);
    struct error e = {0};
    ASSERT_EQ(parse_with(json, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "quantization_config.modules_to_not_convert[0]' value"));
    ASSERT_TRUE(has(e.msg, "is too long"));
}

// ---------------------------------------------------------------------------------
// Scratch model directories.

static void copy_file(const char *src, const char *dst) {
    FILE *f = fopen(src, "rb");
    if (!f) {
        fprintf(stderr, "copy_file: cannot open %s\n", src);
        abort();
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) abort();
    fclose(f);
    test_write_file(dst, buf, (size_t)n);
    free(buf);
}

// A new directory `name` in the scratch dir with a copy of fixture `rel`'s config.json and
// model.safetensors. Returns its path (static buffer per call site: copy it).
static const char *copy_fixture_dir(const char *rel, const char *name) {
    static char dir[600];
    snprintf(dir, sizeof dir, "%s", test_tmp_path(name));
    mkdir(dir, 0755);
    char src[700], dst[700];
    static const char *files[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(src, sizeof src, "%s/%s", test_fixture(rel), files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        copy_file(src, dst);
    }
    return dir;
}

// An edit of a safetensors file: tensor `retype` gets dtype `dtype` (same bytes: the element
// sizes must match), tensors whose name ends with `drop_suffix` leave the header (their
// bytes stay, unreferenced), and `add` (NULL-terminated names) are appended as zero-filled
// F32 tensors of add_n[i] elements.
struct st_edit {
    const char *retype, *dtype, *drop_suffix;
    const char *add[4];
    int64_t add_n[4];
};

static void rewrite_safetensors(const char *path, const struct st_edit *ed) {
    struct safetensors_file *f;
    struct error e = {0};
    if (safetensors_open(&f, path, &e) != ATOMC_OK) {
        fprintf(stderr, "rewrite_safetensors: %s\n", e.msg);
        abort();
    }
    json_t *h = json_object();
    uint64_t end = 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        const struct safetensors_tensor *t = &f->tensors[i];
        if (t->end > end) end = t->end;
        size_t nl = strlen(t->name), sl = ed->drop_suffix ? strlen(ed->drop_suffix) : 0;
        if (ed->drop_suffix && nl >= sl && !strcmp(t->name + nl - sl, ed->drop_suffix)) continue;
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->ne[d]));
        bool re = ed->retype && !strcmp(t->name, ed->retype);
        json_object_set_new(h, t->name,
                            json_pack("{s:s, s:o, s:[I, I]}", "dtype", re ? ed->dtype : t->dtype_name, "shape", shape,
                                      "data_offsets", (json_int_t)t->begin, (json_int_t)t->end));
    }
    size_t data_off = 8 + f->header_len, data_len = (size_t)end, extra = 0;
    for (int i = 0; i < 4 && ed->add[i]; i++) {
        json_object_set_new(h, ed->add[i],
                            json_pack("{s:s, s:[I], s:[I, I]}", "dtype", "F32", "shape", (json_int_t)ed->add_n[i],
                                      "data_offsets", (json_int_t)(data_len + extra),
                                      (json_int_t)(data_len + extra + 4 * (size_t)ed->add_n[i])));
        extra += 4 * (size_t)ed->add_n[i];
    }
    char *hs = json_dumps(h, JSON_COMPACT);
    size_t hl = strlen(hs), padded = (hl + 7) / 8 * 8, total = 8 + padded + data_len + extra;
    unsigned char *out = calloc(1, total);
    for (int b = 0; b < 8; b++)
        out[b] = (unsigned char)((uint64_t)padded >> (8 * b));
    memcpy(out + 8, hs, hl);
    memset(out + 8 + hl, ' ', padded - hl);
    memcpy(out + 8 + padded, f->data + data_off, data_len);
    safetensors_close(f);
    test_write_file(path, out, total);
    free(out);
    free(hs);
    json_decref(h);
}

static void rewrite_model(const char *dir, const struct st_edit *ed) {
    char p[700];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    rewrite_safetensors(p, ed);
}

// ---------------------------------------------------------------------------------
// Loading through model_runner_create (what generate / serve / bench call).

static struct runner_options base_options(const char *path) {
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .dtype = "auto",
        .load_format = "auto",
        .kv_cache_dtype = "auto",
        .block_size = 4,
        .num_kv_blocks = 16,
        .max_num_seqs = 2,
        .max_num_batched_tokens = 64,
        .max_model_len = 64,
        .num_threads = 2,
        .enforce_eager = true,
    };
    return o;
}

static atomc_status runner_open(const char *path, struct error *e) {
    struct runner_options o = base_options(path);
    struct model_runner *r = NULL;
    atomc_status st = model_runner_create(&o, &r, e);
    if (st == ATOMC_OK) model_runner_free(r);
    return st;
}

TEST(quant_fixtures_are_refused_at_load) {
    static const struct {
        const char *rel;
        const char *needles[3];
    } cases[] = {
        {"quant/fp8_no_config",
         {"fp8_no_config/model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight_scale' (F32) is never read "
          "by the LlamaForCausalLM loader",
          "(7 unread tensors in all)", "refusing to load"}},
        {"quant/unknown_tensor",
         {"tensor 'model.layers.0.self_attn.sinks' (BF16) is never read", "(1 unread tensor in all)", "refusing"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct error e = {0};
        atomc_status st = runner_open(test_fixture(cases[i].rel), &e);
        if (st != ATOMC_ERR_UNSUPPORTED) fprintf(stderr, "  %s: status %d: %s\n", cases[i].rel, st, e.msg);
        ASSERT_EQ(st, ATOMC_ERR_UNSUPPORTED);
        for (int k = 0; k < 3; k++)
            ASSERT_TRUE(has(e.msg, cases[i].needles[k]));
    }
}

// The second line of defence: with the quantization config dropped (a loader that ignored it),
// the unread scale tensors still stop the fp8 checkpoint, and W4A16's packed weights are not
// found as weights.
TEST(consumption_check_catches_scales_without_the_config_check) {
    struct error e = {0};
    struct backend *b;
    struct backend_options bo = {.num_threads = 2};
    ASSERT_OK(backend_create("cpu", &bo, &b, &e));
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("quant/fp8_block"), &e));
    ASSERT_TRUE(mf->config.quant.present);
    mf->config.quant.present = false;
    struct model_load_options lo = {.files = mf, .weight_dtype = DTYPE_F32};
    struct model *m = NULL;
    ASSERT_OK(model_load(&m, b, &mf->config, &lo, &e)); // FP8 weights load, their scales do not
    ASSERT_EQ(model_files_check_consumed(mf, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "tensor 'model.layers.0.mlp.down_proj.weight_scale_inv' (F32) is never read"));
    ASSERT_TRUE(has(e.msg, "(7 unread tensors in all)"));
    // Marking them read (what a loader that consumes scales will do) clears it.
    static const char *lin[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
    for (int i = 0; i < 7; i++) {
        char n[128];
        snprintf(n, sizeof n, "model.layers.0.%s.weight_scale_inv", lin[i]);
        ASSERT_TRUE(model_files_mark_consumed(mf, n));
    }
    ASSERT_TRUE(!model_files_mark_consumed(mf, "model.layers.0.no_such.weight"));
    ASSERT_OK(model_files_check_consumed(mf, &e));
    model_free(m);
    model_files_close(mf);

    ASSERT_OK(model_files_open(&mf, test_fixture("quant/ct_w4a16_group128"), &e));
    mf->config.quant.present = false;
    m = NULL;
    lo.files = mf;
    ASSERT_EQ(model_load(&m, b, &mf->config, &lo, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(has(e.msg, "missing tensor 'model.layers.0.self_attn.q_proj.weight'"));
    model_files_close(mf);
    backend_destroy(b);
}

// Every committed unquantized model loads, and reads every tensor it has.
TEST(unquantized_fixtures_load_with_every_tensor_read) {
    char dirs[64][512];
    int n = 0;
    DIR *d = opendir(test_fixture("models"));
    ASSERT_TRUE(d != NULL);
    struct dirent *de;
    while ((de = readdir(d)) && n < 64) {
        if (de->d_name[0] == '.') continue;
        char p[700];
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s/config.json", test_fixture("models"), de->d_name);
        if (stat(p, &sb) != 0) continue;
        snprintf(dirs[n++], sizeof dirs[0], "models/%s", de->d_name);
    }
    closedir(d);
    ASSERT_TRUE(n >= 12); // llama_* (6), mistral_sliding, mixtral, qwen3, qwen3_yarn, qwen3_moe (2) at least
    snprintf(dirs[n++], sizeof dirs[0], "loader/tiny_qwen3_hf");   // sharded, with an index
    // The GGUF fixtures that are whole models. The others are not: loader/ref.gguf (a format
    // test file), tiny_llama31_rope.gguf and tiny_moe.gguf (config and expert-view files without
    // layers; see the two GGUF tests below), tokenizer/*.gguf (tokenizers of qwen2 / deepseek2).
    snprintf(dirs[n++], sizeof dirs[0], "loader/tiny_llama.gguf"); // Q8_0 / F16, permuted q/k
    snprintf(dirs[n++], sizeof dirs[0], "loader/tiny_qwen3.gguf");
    for (int i = 0; i < n; i++) {
        char path[700];
        snprintf(path, sizeof path, "%s", test_fixture(dirs[i]));
        struct error e = {0};
        atomc_status st = runner_open(path, &e);
        if (st != ATOMC_OK) fprintf(stderr, "  %s: %s\n", dirs[i], e.msg);
        ASSERT_OK(st);
    }
}

// GGUF: rope_freqs.weight is read by the config loader (it becomes the llama3 RoPE), so
// it counts as read even though no layer fetches it.
TEST(gguf_rope_freqs_counts_as_read) {
    struct error e = {0};
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_llama31_rope.gguf"), &e));
    ASSERT_EQ(mf->config.rope.scaling, ROPE_SCALING_LLAMA3);
    const struct gguf_tensor_info *rf = gguf_find_tensor(mf->gguf, "rope_freqs.weight");
    ASSERT_TRUE(rf != NULL);
    ASSERT_TRUE(mf->consumed[rf - mf->gguf->tensors]);
    ASSERT_EQ(model_files_check_consumed(mf, &e), ATOMC_ERR_UNSUPPORTED); // nothing else was read
    ASSERT_TRUE(!strstr(e.msg, "rope_freqs"));
    ASSERT_TRUE(has(e.msg, "unread tensor"));
    model_files_close(mf);
}

// GGUF MoE: a per-expert view marks the stacked ffn_*_exps tensor it comes from; a slice
// marks its tensor too.
TEST(gguf_expert_views_and_slices_mark_their_tensor) {
    struct error e = {0};
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_moe.gguf"), &e));
    struct tensor t;
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.mlp.experts.2.gate_proj.weight", &t, &e));
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.mlp.experts.0.up_proj.weight", &t, &e));
    ASSERT_OK(model_files_get_tensor_slice(mf, "model.layers.0.mlp.experts.3.down_proj.weight", 0, 0, 8, &t, &e));
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.mlp.gate.weight", &t, &e));
    ASSERT_EQ(model_files_check_consumed(mf, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "tiny_moe.gguf: tensor 'token_embd.weight' (F32) is never read"));
    ASSERT_TRUE(has(e.msg, "(1 unread tensor in all)"));
    ASSERT_OK(model_files_get_tensor_slice(mf, "model.embed_tokens.weight", 1, 0, 16, &t, &e)); // a column slice
    ASSERT_OK(model_files_check_consumed(mf, &e));
    model_files_close(mf);
}

TEST(smollm2_reads_every_tensor) {
    const char *path = getenv("ATOMC_SMOLLM2");
    if (!path || !*path) {
        fprintf(stderr, "  skip: ATOMC_SMOLLM2 is not set (scripts/fetch_model.sh prints the path)\n");
        return;
    }
    struct error e = {0};
    atomc_status st = runner_open(path, &e);
    if (st != ATOMC_OK) fprintf(stderr, "  %s: %s\n", path, e.msg);
    ASSERT_OK(st);
}

// Quantization configs beside config.json: AutoGPTQ's quantize_config.json (no
// quant_method: GPTQ) and ModelOpt's hf_quant_config.json.
TEST(side_files_quantize_config_and_hf_quant_config) {
    static const struct {
        const char *file, *json;
        enum quant_method method;
        const char *format, *needle;
    } cases[] = {
        {"quantize_config.json", "{\"bits\": 2, \"group_size\": 128, \"desc_act\": false, \"sym\": true}",
         QUANT_METHOD_GPTQ, "gptq",
         "quantize_config.json: quant_method 'gptq' (format gptq; weights int2, strategy "
         "group, group_size 128"},
        {"hf_quant_config.json",
         "{\"producer\": {\"name\": \"modelopt\", \"version\": \"0.29\"}, \"quantization\": {\"quant_algo\": \"FP8\", "
         "\"kv_cache_quant_algo\": null, \"exclude_modules\": [\"lm_head\"]}}",
         QUANT_METHOD_MODELOPT, "FP8",
         "hf_quant_config.json: quant_method 'modelopt' (format FP8; weights float8, "
         "strategy tensor"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[32], dir[600], p[700];
        snprintf(name, sizeof name, "side_%zu", i);
        snprintf(dir, sizeof dir, "%s", copy_fixture_dir("models/llama_gqa", name));
        snprintf(p, sizeof p, "%s/%s", dir, cases[i].file);
        test_write_file(p, cases[i].json, strlen(cases[i].json));
        struct error e = {0};
        struct model_files *mf;
        ASSERT_OK(model_files_open(&mf, dir, &e)); // opening (inspect) does not refuse
        ASSERT_TRUE(mf->config.quant.present);
        ASSERT_EQ(mf->config.quant.method, cases[i].method);
        ASSERT_STREQ(mf->config.quant.origin, cases[i].file);
        ASSERT_STREQ(mf->config.quant.format, cases[i].format);
        model_files_close(mf);
        ASSERT_EQ(runner_open(dir, &e), ATOMC_ERR_UNSUPPORTED);
        ASSERT_TRUE(has(e.msg, cases[i].needle));
    }
    // Malformed: FORMAT naming the file and the field.
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s", copy_fixture_dir("models/llama_gqa", "side_bad"));
    snprintf(p, sizeof p, "%s/quantize_config.json", dir);
    test_write_file(p, "{\"bits\": \"4\"}", 13);
    struct error e = {0};
    struct model_files *mf;
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "quantize_config.json: key 'quantize_config.json.bits' must be an integer, got a string"));
    test_write_file(p, "{\"bits\": 4,", 11);
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "quantize_config.json: invalid JSON"));
}

// HF exemptions: rotary inv_freq buffers, and lm_head.weight beside tied embeddings; any
// other extra tensor, and a shard tensor the index does not list, is refused.
TEST(exempt_tensors_and_shard_tensors_outside_the_index) {
    struct error e = {0};
    char dir[600];
    snprintf(dir, sizeof dir, "%s", copy_fixture_dir("models/llama_tied", "tied_extra"));
    struct st_edit ok = {
        .add = {"lm_head.weight", "model.rotary_emb.inv_freq", "model.layers.0.self_attn.rotary_emb.inv_freq"},
        .add_n = {256 * 64, 32, 32}};
    rewrite_model(dir, &ok);
    atomc_status st = runner_open(dir, &e);
    if (st) fprintf(stderr, "  tied_extra: %s\n", e.msg);
    ASSERT_OK(st);
    // Not tied: an extra tensor with a quantization-like name is refused.
    snprintf(dir, sizeof dir, "%s", copy_fixture_dir("models/llama_tied", "tied_scale"));
    struct st_edit bad = {.add = {"model.layers.1.self_attn.o_proj.input_scale", "model.rotary_emb.inv_freq"},
                          .add_n = {1, 32}};
    rewrite_model(dir, &bad);
    ASSERT_EQ(runner_open(dir, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "tensor 'model.layers.1.self_attn.o_proj.input_scale' (F32) is never read"));
    ASSERT_TRUE(has(e.msg, "(1 unread tensor in all)"));

    // The sharded fixture with a tensor in a shard that the index does not list.
    char sdir[600];
    snprintf(sdir, sizeof sdir, "%s", test_tmp_path("sharded"));
    mkdir(sdir, 0755);
    static const char *files[] = {"config.json",
                                  "model.safetensors.index.json",
                                  "model-00001-of-00004.safetensors",
                                  "model-00002-of-00004.safetensors",
                                  "model-00003-of-00004.safetensors",
                                  "model-00004-of-00004.safetensors"};
    for (int i = 0; i < 6; i++) {
        char src[700], dst[700];
        snprintf(src, sizeof src, "%s/%s", test_fixture("loader/tiny_qwen3_hf"), files[i]);
        snprintf(dst, sizeof dst, "%s/%s", sdir, files[i]);
        copy_file(src, dst);
    }
    char shard[700];
    snprintf(shard, sizeof shard, "%s/model-00002-of-00004.safetensors", sdir);
    struct st_edit hidden = {.add = {"model.layers.0.mlp.down_proj.weight_scale"}, .add_n = {1}};
    rewrite_safetensors(shard, &hidden);
    ASSERT_EQ(runner_open(sdir, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "model-00002-of-00004.safetensors: tensor 'model.layers.0.mlp.down_proj.weight_scale' "
                           "(F32, not listed in the index) is never read"));
}

// Dtypes: a weight slot holding integers, or a float type atomc does not convert, is
// refused naming the tensor; FP8 weights without any scale are exact and load.
TEST(weight_dtypes_that_cannot_be_converted_are_refused) {
    static const struct {
        const char *fixture, *tensor, *dtype;
        atomc_status st;
        const char *needle;
    } cases[] = {
        {"models/llama_gqa", "model.layers.0.self_attn.q_proj.weight", "I32", ATOMC_ERR_UNSUPPORTED,
         "cannot convert a I32 tensor"},
        {"models/llama_gqa", "model.layers.1.input_layernorm.weight", "I32", ATOMC_ERR_UNSUPPORTED,
         "cannot convert a I32 tensor"},
        {"quant/fp8_no_config", "model.layers.0.mlp.up_proj.weight", "U8", ATOMC_ERR_UNSUPPORTED,
         "cannot convert a U8 tensor"},
        {"quant/fp8_no_config", "model.layers.0.mlp.up_proj.weight", "I8", ATOMC_ERR_UNSUPPORTED, "I8"},
        {"quant/fp8_no_config", "model.layers.0.mlp.up_proj.weight", "F8_E5M2", ATOMC_ERR_UNSUPPORTED, "F8_E5M2"},
        {"quant/fp8_no_config", "model.layers.0.mlp.up_proj.weight", "BOOL", ATOMC_ERR_UNSUPPORTED, "BOOL"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[32], dir[600];
        snprintf(name, sizeof name, "retyped_%zu", i);
        snprintf(dir, sizeof dir, "%s", copy_fixture_dir(cases[i].fixture, name));
        struct st_edit ed = {.retype = cases[i].tensor, .dtype = cases[i].dtype, .drop_suffix = "weight_scale"};
        rewrite_model(dir, &ed);
        struct error e = {0};
        atomc_status st = runner_open(dir, &e);
        if (st != cases[i].st) fprintf(stderr, "  case %zu: status %d: %s\n", i, st, e.msg);
        ASSERT_EQ(st, cases[i].st);
        ASSERT_TRUE(has(e.msg, cases[i].tensor));
        ASSERT_TRUE(has(e.msg, cases[i].needle));
    }
    // F8_E4M3 weights with their scales dropped from the header: an exact conversion, loads.
    char dir[600];
    snprintf(dir, sizeof dir, "%s", copy_fixture_dir("quant/fp8_no_config", "fp8_unscaled"));
    struct st_edit unscaled = {.drop_suffix = "weight_scale"};
    rewrite_model(dir, &unscaled);
    struct error e = {0};
    atomc_status st = runner_open(dir, &e);
    if (st != ATOMC_OK) fprintf(stderr, "  fp8_unscaled: %s\n", e.msg);
    ASSERT_OK(st);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
