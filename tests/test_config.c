// model_config parsing against real-world config.json texts (tests/fixtures/configs/)
// and against malformed variants: every error must name the file and the key.
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/mapped_file.h"
#include "model/config.h"
#include "test.h"
#include <stddef.h>

static struct model_config cfg; // large (per-layer arrays): keep off the stack

// Parses fixture `name`; returns the status and leaves the message in *err.
static atomc_status load_fixture(const char *name, struct error *err) {
    char rel[256];
    snprintf(rel, sizeof rel, "configs/%s", name);
    char *text;
    atomc_status st = file_read_all(test_fixture(rel), &text, NULL, err);
    if (st) return st;
    st = model_config_parse_json(&cfg, text, name, err);
    if (!st) st = model_config_validate(&cfg, name, err);
    free(text);
    return st;
}

static atomc_status parse_text(const char *text, struct error *err) {
    return model_config_parse_json(&cfg, text, "bad/config.json", err);
}

// Every fixture against transformers' own reading of it (AutoConfig; transformers_parsed.json
// made by tools/gen_loader_refs.py): the effective values, defaults included.
TEST(every_fixture_matches_transformers_autoconfig) {
    struct error e = {0};
    char *text;
    ASSERT_OK(file_read_all(test_fixture("configs/transformers_parsed.json"), &text, NULL, &e));
    json_t *all = json_loads(text, 0, NULL);
    free(text);
    ASSERT_TRUE(all != NULL);
    ASSERT_TRUE(json_object_size(all) >= 12);
    const char *name;
    json_t *r;
    json_object_foreach(all, name, r) {
        atomc_status st = load_fixture(name, &e);
        if (st) {
            test_fail(__FILE__, __LINE__, "%s: %s", name, e.msg);
            break;
        }
#define I(key) json_integer_value(json_object_get(r, key))
#define F(key) json_number_value(json_object_get(r, key))
#define CMP(field, want)                                                                                    \
    if ((double)(field) != (double)(want)) {                                                                \
        test_fail(__FILE__, __LINE__, "%s: %s = %g, transformers says %g", name, #field, (double)(field),     \
                  (double)(want));                                                                          \
        break;                                                                                              \
    }
        CMP(cfg.hidden_size, I("hidden_size"));
        CMP(cfg.intermediate_size, I("intermediate_size"));
        CMP(cfg.num_layers, I("num_hidden_layers"));
        CMP(cfg.num_heads, I("num_attention_heads"));
        CMP(cfg.num_kv_heads, I("num_key_value_heads"));
        CMP(cfg.head_dim, I("head_dim"));
        CMP(cfg.vocab_size, I("vocab_size"));
        CMP(cfg.max_position_embeddings, I("max_position_embeddings"));
        CMP(cfg.rms_norm_eps, (float)F("rms_norm_eps"));
        CMP(cfg.tie_word_embeddings, json_is_true(json_object_get(r, "tie_word_embeddings")));
        CMP(cfg.rope.theta, (float)F("rope_theta"));
        CMP(cfg.rope.rotary_dim, I("rotary_dim"));
        const char *rt = json_string_value(json_object_get(r, "rope_type"));
        enum rope_scaling_type want_rt = !strcmp(rt, "linear")   ? ROPE_SCALING_LINEAR
                                         : !strcmp(rt, "llama3") ? ROPE_SCALING_LLAMA3
                                         : !strcmp(rt, "yarn")   ? ROPE_SCALING_YARN
                                         : !strcmp(rt, "dynamic") ? ROPE_SCALING_DYNAMIC
                                                                  : ROPE_SCALING_NONE;
        CMP(cfg.rope.scaling, want_rt);
        if (want_rt != ROPE_SCALING_NONE) CMP(cfg.rope.factor, (float)F("rope_factor"));
        if (json_object_get(r, "low_freq_factor")) CMP(cfg.rope.low_freq_factor, (float)F("low_freq_factor"));
        if (json_object_get(r, "high_freq_factor")) CMP(cfg.rope.high_freq_factor, (float)F("high_freq_factor"));
        if (json_object_get(r, "original_max_position_embeddings"))
            CMP(cfg.rope.original_max_position, F("original_max_position_embeddings"));
        if (json_object_get(r, "beta_fast")) CMP(cfg.rope.beta_fast, (float)F("beta_fast"));
        if (json_object_get(r, "beta_slow")) CMP(cfg.rope.beta_slow, (float)F("beta_slow"));
        if (json_object_get(r, "mscale")) CMP(cfg.rope.mscale, (float)F("mscale"));
        if (json_object_get(r, "mscale_all_dim")) CMP(cfg.rope.mscale_all_dim, (float)F("mscale_all_dim"));
        CMP(cfg.bos_token_id, I("bos_token_id"));
        json_t *eos = json_object_get(r, "eos_token_ids");
        CMP(cfg.n_eos, json_array_size(eos));
        for (int i = 0; i < cfg.n_eos; i++) CMP(cfg.eos_token_ids[i], json_integer_value(json_array_get(eos, (size_t)i)));
        CMP(cfg.sliding_window, I("sliding_window"));
        json_t *lt = json_object_get(r, "layer_types");
        CMP(json_array_size(lt), cfg.num_layers);
        for (int l = 0; l < cfg.num_layers; l++) {
            const char *t = json_string_value(json_array_get(lt, (size_t)l));
            enum layer_attn_type want = !strcmp(t, "sliding_attention") ? LAYER_ATTN_SLIDING
                                        : !strcmp(t, "linear_attention") ? LAYER_ATTN_LINEAR
                                                                          : LAYER_ATTN_FULL;
            CMP(cfg.layer_types[l], want);
        }
        CMP(cfg.num_experts, I("num_experts"));
        CMP(cfg.num_experts_per_tok, I("num_experts_per_tok"));
        static const struct {
            const char *key;
            size_t off;
        } ints[] = {
            {"moe_intermediate_size", offsetof(struct model_config, moe_intermediate_size)},
            {"first_k_dense_replace", offsetof(struct model_config, first_k_dense_replace)},
            {"n_shared_experts", offsetof(struct model_config, n_shared_experts)},
            {"n_group", offsetof(struct model_config, n_group)},
            {"topk_group", offsetof(struct model_config, topk_group)},
            {"q_lora_rank", offsetof(struct model_config, q_lora_rank)},
            {"kv_lora_rank", offsetof(struct model_config, kv_lora_rank)},
            {"qk_nope_head_dim", offsetof(struct model_config, qk_nope_head_dim)},
            {"qk_rope_head_dim", offsetof(struct model_config, qk_rope_head_dim)},
            {"v_head_dim", offsetof(struct model_config, v_head_dim)},
            {"shared_expert_intermediate_size", offsetof(struct model_config, shared_expert_intermediate_size)},
            {"decoder_sparse_step", offsetof(struct model_config, decoder_sparse_step)},
        };
        for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++) {
            json_t *v = json_object_get(r, ints[k].key);
            if (!v) continue;
            int have;
            memcpy(&have, (const char *)&cfg + ints[k].off, sizeof have);
            if (have != json_integer_value(v)) {
                test_fail(__FILE__, __LINE__, "%s: %s = %d, transformers says %lld", name, ints[k].key, have,
                          (long long)json_integer_value(v));
                break;
            }
        }
        if (json_object_get(r, "routed_scaling_factor"))
            CMP(cfg.routed_scaling_factor, (float)F("routed_scaling_factor"));
#undef CMP
#undef F
#undef I
        if (test_failed_now()) break;
    }
    json_decref(all);
}

TEST(llama31_8b_llama3_rope) {
    struct error e = {0};
    ASSERT_OK(load_fixture("llama-3.1-8b-instruct.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_LLAMA);
    ASSERT_STREQ(cfg.architecture, "LlamaForCausalLM");
    ASSERT_EQ(cfg.hidden_size, 4096);
    ASSERT_EQ(cfg.intermediate_size, 14336);
    ASSERT_EQ(cfg.num_layers, 32);
    ASSERT_EQ(cfg.num_heads, 32);
    ASSERT_EQ(cfg.num_kv_heads, 8);
    ASSERT_EQ(cfg.head_dim, 128);
    ASSERT_EQ(cfg.vocab_size, 128256);
    ASSERT_EQ(cfg.max_position_embeddings, 131072);
    ASSERT_NEAR(cfg.rms_norm_eps, 1e-5, 1e-12);
    ASSERT_NEAR(cfg.rope.theta, 500000.0, 0.0);
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_LLAMA3);
    ASSERT_NEAR(cfg.rope.factor, 8.0, 0);
    ASSERT_NEAR(cfg.rope.low_freq_factor, 1.0, 0);
    ASSERT_NEAR(cfg.rope.high_freq_factor, 4.0, 0);
    ASSERT_EQ(cfg.rope.original_max_position, 8192);
    ASSERT_EQ(cfg.rope.rotary_dim, 128);
    ASSERT_TRUE(!cfg.rope.interleaved);
    ASSERT_TRUE(!cfg.tie_word_embeddings);
    ASSERT_TRUE(!cfg.attention_bias && !cfg.mlp_bias && !cfg.qk_norm);
    ASSERT_EQ(cfg.torch_dtype, DTYPE_BF16);
    ASSERT_EQ(cfg.bos_token_id, 128000);
    ASSERT_EQ(cfg.n_eos, 3);
    ASSERT_EQ(cfg.eos_token_ids[0], 128001);
    ASSERT_EQ(cfg.eos_token_ids[2], 128009);
    ASSERT_EQ(cfg.num_experts, 0);
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 0));
    ASSERT_EQ(cfg.sliding_window, 0);
    ASSERT_EQ(cfg.layer_types[31], LAYER_ATTN_FULL);
}

TEST(llama2_7b) {
    struct error e = {0};
    ASSERT_OK(load_fixture("llama-2-7b.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_LLAMA);
    ASSERT_EQ(cfg.num_kv_heads, 32); // MHA
    ASSERT_EQ(cfg.head_dim, 128);
    ASSERT_EQ(cfg.intermediate_size, 11008);
    ASSERT_EQ(cfg.vocab_size, 32000);
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_NONE);
    ASSERT_NEAR(cfg.rope.theta, 10000.0, 0); // default when the key is absent
    ASSERT_EQ(cfg.torch_dtype, DTYPE_F16);
    ASSERT_EQ(cfg.bos_token_id, 1);
    ASSERT_EQ(cfg.n_eos, 1);
    ASSERT_EQ(cfg.eos_token_ids[0], 2);
    ASSERT_EQ(cfg.pad_token_id, -1);
}

TEST(qwen3_8b_qk_norm_explicit_head_dim) {
    struct error e = {0};
    ASSERT_OK(load_fixture("qwen3-8b.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_QWEN3);
    ASSERT_TRUE(cfg.qk_norm);
    ASSERT_EQ(cfg.head_dim, 128);
    ASSERT_EQ(cfg.num_layers, 36);
    ASSERT_NEAR(cfg.rope.theta, 1e6, 0);
    ASSERT_NEAR(cfg.rms_norm_eps, 1e-6, 1e-13);
    ASSERT_EQ(cfg.sliding_window, 0); // null
    ASSERT_EQ(cfg.layer_types[0], LAYER_ATTN_FULL);
    ASSERT_EQ(cfg.vocab_size, 151936);
    ASSERT_EQ(cfg.eos_token_ids[0], 151645);
}

TEST(qwen3_30b_a3b_moe) {
    struct error e = {0};
    ASSERT_OK(load_fixture("qwen3-30b-a3b.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_QWEN3_MOE);
    ASSERT_EQ(cfg.hidden_size, 2048);
    ASSERT_EQ(cfg.head_dim, 128); // != hidden / heads (64): explicit head_dim wins
    ASSERT_EQ(cfg.num_kv_heads, 4);
    ASSERT_EQ(cfg.num_experts, 128);
    ASSERT_EQ(cfg.num_experts_per_tok, 8);
    ASSERT_EQ(cfg.moe_intermediate_size, 768);
    ASSERT_TRUE(cfg.norm_topk_prob);
    ASSERT_EQ(cfg.decoder_sparse_step, 1);
    ASSERT_TRUE(cfg.qk_norm);
    ASSERT_STREQ(cfg.scoring_func, "softmax");
    for (int l = 0; l < 48; l++) ASSERT_TRUE(model_config_layer_is_moe(&cfg, l));
}

TEST(qwen3_moe_sparse_step_and_mlp_only_layers) {
    struct error e = {0};
    ASSERT_OK(parse_text("{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                         "\"num_hidden_layers\":6,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                         "\"vocab_size\":100,\"num_experts\":8,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
                         "\"decoder_sparse_step\":2,\"mlp_only_layers\":[3]}",
                         &e));
    ASSERT_OK(model_config_validate(&cfg, "x", &e));
    // (l+1) % 2 == 0 -> layers 1, 3, 5; layer 3 forced dense.
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 0));
    ASSERT_TRUE(model_config_layer_is_moe(&cfg, 1));
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 2));
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 3));
    ASSERT_TRUE(model_config_layer_is_moe(&cfg, 5));
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 6)); // out of range
}

TEST(mixtral_8x7b) {
    struct error e = {0};
    ASSERT_OK(load_fixture("mixtral-8x7b.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_MIXTRAL);
    ASSERT_EQ(cfg.num_experts, 8);
    ASSERT_EQ(cfg.num_experts_per_tok, 2);
    ASSERT_EQ(cfg.moe_intermediate_size, 14336); // experts use intermediate_size
    ASSERT_TRUE(cfg.norm_topk_prob);
    ASSERT_NEAR(cfg.rope.theta, 1e6, 0);
    ASSERT_EQ(cfg.sliding_window, 0);
    ASSERT_TRUE(model_config_layer_is_moe(&cfg, 0));
}

TEST(deepseek_v3_mla_yarn) {
    struct error e = {0};
    ASSERT_OK(load_fixture("deepseek-v3.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_DEEPSEEK_V3);
    ASSERT_EQ(cfg.num_layers, 61);
    ASSERT_EQ(cfg.q_lora_rank, 1536);
    ASSERT_EQ(cfg.kv_lora_rank, 512);
    ASSERT_EQ(cfg.qk_nope_head_dim, 128);
    ASSERT_EQ(cfg.qk_rope_head_dim, 64);
    ASSERT_EQ(cfg.v_head_dim, 128);
    ASSERT_EQ(cfg.rope.rotary_dim, 64);
    ASSERT_TRUE(cfg.rope.interleaved);
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_YARN);
    ASSERT_NEAR(cfg.rope.factor, 40, 0);
    ASSERT_NEAR(cfg.rope.beta_fast, 32, 0);
    ASSERT_NEAR(cfg.rope.beta_slow, 1, 0);
    ASSERT_NEAR(cfg.rope.mscale, 1.0, 0);
    ASSERT_NEAR(cfg.rope.mscale_all_dim, 1.0, 0);
    ASSERT_EQ(cfg.rope.original_max_position, 4096);
    ASSERT_EQ(cfg.num_experts, 256);
    ASSERT_EQ(cfg.num_experts_per_tok, 8);
    ASSERT_EQ(cfg.n_shared_experts, 1);
    ASSERT_EQ(cfg.moe_intermediate_size, 2048);
    ASSERT_EQ(cfg.first_k_dense_replace, 3);
    ASSERT_EQ(cfg.n_group, 8);
    ASSERT_EQ(cfg.topk_group, 4);
    ASSERT_NEAR(cfg.routed_scaling_factor, 2.5, 0);
    ASSERT_STREQ(cfg.scoring_func, "sigmoid");
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 2));
    ASSERT_TRUE(model_config_layer_is_moe(&cfg, 3));
    ASSERT_TRUE(model_config_layer_is_moe(&cfg, 60));
    ASSERT_TRUE(!cfg.attention_out_bias);
}

TEST(gpt_oss_20b_sliding_yarn_sinks) {
    struct error e = {0};
    ASSERT_OK(load_fixture("gpt-oss-20b.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_GPT_OSS);
    ASSERT_EQ(cfg.num_layers, 24);
    ASSERT_EQ(cfg.head_dim, 64);
    ASSERT_EQ(cfg.num_heads, 64);
    ASSERT_EQ(cfg.num_kv_heads, 8);
    ASSERT_EQ(cfg.sliding_window, 128);
    ASSERT_EQ(cfg.layer_types[0], LAYER_ATTN_SLIDING);
    ASSERT_EQ(cfg.layer_types[1], LAYER_ATTN_FULL);
    ASSERT_EQ(cfg.layer_types[23], LAYER_ATTN_FULL);
    ASSERT_TRUE(cfg.attention_sinks);
    ASSERT_TRUE(cfg.attention_bias && cfg.attention_out_bias);
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_YARN);
    ASSERT_NEAR(cfg.rope.factor, 32, 0);
    ASSERT_TRUE(!cfg.rope.yarn_truncate);
    ASSERT_NEAR(cfg.rope.theta, 150000, 0);
    ASSERT_EQ(cfg.num_experts, 32);
    ASSERT_EQ(cfg.num_experts_per_tok, 4);
    ASSERT_EQ(cfg.moe_intermediate_size, 2880);
    ASSERT_EQ(cfg.pad_token_id, 199999);
    ASSERT_EQ(cfg.torch_dtype, DTYPE_F32); // no torch_dtype key
}

TEST(glm45_air_partial_rotary) {
    struct error e = {0};
    ASSERT_OK(load_fixture("glm-4.5-air.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_GLM4_MOE);
    ASSERT_EQ(cfg.head_dim, 128);
    ASSERT_EQ(cfg.rope.rotary_dim, 64); // partial_rotary_factor 0.5
    ASSERT_TRUE(cfg.attention_bias && !cfg.attention_out_bias);
    ASSERT_TRUE(!cfg.qk_norm); // use_qk_norm false
    ASSERT_STREQ(cfg.scoring_func, "sigmoid");
    ASSERT_EQ(cfg.first_k_dense_replace, 1);
    ASSERT_TRUE(!model_config_layer_is_moe(&cfg, 0));
    ASSERT_TRUE(model_config_layer_is_moe(&cfg, 1));
    ASSERT_EQ(cfg.n_eos, 3);
}

TEST(qwen3_next_hybrid_layers) {
    struct error e = {0};
    ASSERT_OK(load_fixture("qwen3-next-80b-a3b.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_QWEN3_NEXT);
    ASSERT_EQ(cfg.rope.rotary_dim, 64); // 256 * 0.25
    ASSERT_EQ(cfg.layer_types[0], LAYER_ATTN_LINEAR);
    ASSERT_EQ(cfg.layer_types[2], LAYER_ATTN_LINEAR);
    ASSERT_EQ(cfg.layer_types[3], LAYER_ATTN_FULL);
    ASSERT_EQ(cfg.layer_types[47], LAYER_ATTN_FULL);
    ASSERT_EQ(cfg.num_experts, 512);
    ASSERT_EQ(cfg.shared_expert_intermediate_size, 512);
}

TEST(smollm2_tied) {
    struct error e = {0};
    ASSERT_OK(load_fixture("smollm2-135m-instruct.json", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_LLAMA);
    ASSERT_TRUE(cfg.tie_word_embeddings);
    ASSERT_EQ(cfg.head_dim, 64);
    ASSERT_EQ(cfg.num_heads, 9);
    ASSERT_EQ(cfg.num_kv_heads, 3);
    ASSERT_EQ(cfg.num_layers, 30);
    ASSERT_NEAR(cfg.rope.theta, 100000, 0);
    ASSERT_EQ(cfg.pad_token_id, 2);
}

TEST(transformers5_rope_parameters) {
    struct error e = {0};
    ASSERT_OK(load_fixture("transformers5-llama-3.1-8b.json", &e));
    struct model_config t5 = cfg;
    ASSERT_OK(load_fixture("llama-3.1-8b-instruct.json", &e));
    // Same model in both spellings -> same RoPE.
    ASSERT_EQ(t5.rope.scaling, ROPE_SCALING_LLAMA3);
    ASSERT_NEAR(t5.rope.theta, cfg.rope.theta, 0);
    ASSERT_NEAR(t5.rope.factor, cfg.rope.factor, 0);
    ASSERT_NEAR(t5.rope.low_freq_factor, cfg.rope.low_freq_factor, 0);
    ASSERT_NEAR(t5.rope.high_freq_factor, cfg.rope.high_freq_factor, 0);
    ASSERT_EQ(t5.rope.original_max_position, cfg.rope.original_max_position);
    ASSERT_EQ(t5.torch_dtype, DTYPE_BF16); // "dtype" key
    ASSERT_EQ(t5.pad_token_id, -1);        // null
}

TEST(transformers5_per_layer_rope) {
    struct error e = {0};
    ASSERT_OK(load_fixture("transformers5-per-layer-rope.json", &e));
    ASSERT_NEAR(cfg.rope.theta, 1e6, 0); // full_attention's entry
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_NONE);
    ASSERT_EQ(cfg.sliding_window, 4096);
    ASSERT_EQ(cfg.layer_types[0], LAYER_ATTN_SLIDING);
    ASSERT_EQ(cfg.layer_types[3], LAYER_ATTN_FULL);
}

TEST(rope_linear_and_dynamic) {
    struct error e = {0};
    const char *base = "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                       "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                       "\"max_position_embeddings\":1024,";
    char buf[1024];
    snprintf(buf, sizeof buf, "%s\"rope_scaling\":{\"type\":\"linear\",\"factor\":2.0}}", base);
    ASSERT_OK(parse_text(buf, &e));
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_LINEAR);
    ASSERT_NEAR(cfg.rope.factor, 2.0, 0);
    snprintf(buf, sizeof buf, "%s\"rope_scaling\":{\"rope_type\":\"dynamic\",\"factor\":4}}", base);
    ASSERT_OK(parse_text(buf, &e));
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_DYNAMIC);
    ASSERT_EQ(cfg.rope.original_max_position, 1024);
    snprintf(buf, sizeof buf, "%s\"rope_scaling\":{\"rope_type\":\"default\"}}", base);
    ASSERT_OK(parse_text(buf, &e));
    ASSERT_EQ(cfg.rope.scaling, ROPE_SCALING_NONE);
    snprintf(buf, sizeof buf, "%s\"rope_scaling\":{\"rope_type\":\"longrope\",\"factor\":4}}", base);
    ASSERT_EQ(parse_text(buf, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "longrope") && strstr(e.msg, "bad/config.json"));
    snprintf(buf, sizeof buf, "%s\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8}}", base);
    ASSERT_EQ(parse_text(buf, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "low_freq_factor") != NULL);
    snprintf(buf, sizeof buf, "%s\"partial_rotary_factor\":0.5}", base);
    ASSERT_OK(parse_text(buf, &e));
    ASSERT_EQ(cfg.rope.rotary_dim, 8);
}

TEST(unknown_architecture_is_unsupported) {
    struct error e = {0};
    ASSERT_EQ(parse_text("{\"architectures\":[\"GPT2LMHeadModel\"],\"hidden_size\":64}", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "bad/config.json") != NULL);
    ASSERT_TRUE(strstr(e.msg, "GPT2LMHeadModel") != NULL);
    ASSERT_TRUE(strstr(e.msg, "LlamaForCausalLM") != NULL); // lists the supported ones
    ASSERT_TRUE(strstr(e.msg, "Qwen3ForCausalLM") != NULL);
}

TEST(model_type_fallback) {
    struct error e = {0};
    ASSERT_OK(parse_text("{\"model_type\":\"qwen3\",\"hidden_size\":64,\"intermediate_size\":128,"
                         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100}",
                         &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_QWEN3);
}

TEST(format_errors_name_the_key) {
    struct error e = {0};
    struct {
        const char *json;
        const char *needle;
    } cases[] = {
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"intermediate_size\":128,\"num_hidden_layers\":2,"
         "\"num_attention_heads\":4,\"vocab_size\":100}", "'hidden_size' is missing"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":\"64\",\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100}", "'hidden_size' must be an integer"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"rope_theta\":\"x\"}", "'rope_theta'"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"eos_token_id\":[1,\"a\"]}",
         "'eos_token_id' element 1"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"tie_word_embeddings\":1}",
         "'tie_word_embeddings' must be a boolean"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"rope_scaling\":[1]}",
         "'rope_scaling' must be an object"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"layer_types\":[\"full_attention\"]}",
         "'layer_types' has 1 entries"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":-2,\"num_attention_heads\":4,\"vocab_size\":100}", "'num_hidden_layers' = -2"},
        {"{\"architectures\":\"LlamaForCausalLM\"}", "'architectures' must be a non-empty list"},
        {"[1,2]", "top level must be a JSON object"},
        {"{\"architectures\": [", "invalid JSON"},
        {"{\"hidden_size\":64}", "'architectures' is missing"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        atomc_status st = parse_text(cases[i].json, &e);
        if (st != ATOMC_ERR_FORMAT || !strstr(e.msg, cases[i].needle) || !strstr(e.msg, "bad/config.json")) {
            test_fail(__FILE__, __LINE__, "case %zu: status %d message \"%s\" (want \"%s\")", i, (int)st, e.msg,
                      cases[i].needle);
            return;
        }
    }
}

TEST(validate_catches_inconsistencies) {
    struct error e = {0};
    ASSERT_OK(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":3,"
                         "\"vocab_size\":100}",
                         &e));
    ASSERT_EQ(model_config_validate(&cfg, "v.json", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "num_key_value_heads") && strstr(e.msg, "v.json"));
    ASSERT_EQ(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"eos_token_id\":100}",
                         &e),
              ATOMC_ERR_FORMAT); // at parse time now (issue 28 item 9), before generation_config can hide it
    ASSERT_TRUE(strstr(e.msg, "eos_token_id 100 is outside the vocabulary") != NULL);
    ASSERT_OK(parse_text("{\"architectures\":[\"MixtralForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                         "\"num_local_experts\":4,\"num_experts_per_tok\":5}",
                         &e));
    ASSERT_EQ(model_config_validate(&cfg, "v.json", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "num_experts_per_tok") != NULL);
    ASSERT_OK(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,\"hidden_act\":\"gelu\"}",
                         &e));
    ASSERT_EQ(model_config_validate(&cfg, "v.json", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "gelu") != NULL);
}

// Issue 28 item 9: bos / pad / eos ids outside the vocabulary are refused where they are read
// (config.json, then generation_config.json), naming the file and the key; a model_type that
// transformers would not know, or that names another family than "architectures", is refused.
#define TINY_LLAMA                                                                                                     \
    "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":"   \
    "100"
TEST(special_token_ids_outside_the_vocabulary_are_refused) {
    struct error e = {0};
    const char *keys[] = {"eos_token_id\":1000000000", "eos_token_id\":[2,100]", "bos_token_id\":100",
                          "pad_token_id\":1000000000"};
    const char *names[] = {"eos_token_id 1000000000", "eos_token_id 100", "bos_token_id 100",
                           "pad_token_id 1000000000"};
    for (int i = 0; i < 4; i++) {
        char j[512];
        snprintf(j, sizeof j, "{\"architectures\":[\"LlamaForCausalLM\"]," TINY_LLAMA ",\"%s}", keys[i]);
        ASSERT_EQ(parse_text(j, &e), ATOMC_ERR_FORMAT);
        if (!strstr(e.msg, names[i]) || !strstr(e.msg, "outside the vocabulary (vocab_size 100)") ||
            !strstr(e.msg, "bad/config.json"))
            test_fail(__FILE__, __LINE__, "case %d: %s", i, e.msg);
    }
    ASSERT_OK(parse_text(
        "{\"architectures\":[\"LlamaForCausalLM\"]," TINY_LLAMA ",\"eos_token_id\":99,\"pad_token_id\":0}", &e));
    // generation_config.json: refused, the config left as it was.
    ASSERT_EQ(
        model_config_merge_generation_config(&cfg, "{\"eos_token_id\": 1000000000}", "generation_config.json", &e),
        ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "generation_config.json: eos_token_id 1000000000 is outside the vocabulary") != NULL);
    ASSERT_EQ(model_config_merge_generation_config(&cfg, "{\"pad_token_id\": 100}", "generation_config.json", &e),
              ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "pad_token_id 100") != NULL);
    ASSERT_EQ(cfg.n_eos, 1);
    ASSERT_EQ(cfg.eos_token_ids[0], 99);
    ASSERT_EQ(cfg.pad_token_id, 0);
}

TEST(model_type_unknown_or_mismatched_is_refused) {
    struct error e = {0};
    ASSERT_EQ(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"nonsense\"," TINY_LLAMA "}", &e),
              ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "model_type 'nonsense' is not supported") && strstr(e.msg, "llama") &&
                strstr(e.msg, "bad/config.json"));
    ASSERT_EQ(parse_text("{\"model_type\":\"nonsense\"," TINY_LLAMA "}", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "model_type 'nonsense' is not supported") != NULL);
    ASSERT_EQ(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"qwen3_moe\"," TINY_LLAMA "}", &e),
              ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "model_type 'qwen3_moe' does not match architecture 'LlamaForCausalLM'") != NULL);
    ASSERT_EQ(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":7," TINY_LLAMA "}", &e),
              ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "'model_type' must be a string") != NULL);
    ASSERT_EQ(parse_text("{" TINY_LLAMA "}", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "'architectures' is missing") && strstr(e.msg, "model_type"));
    // The same family under another name, and an absent model_type beside "architectures": accepted.
    ASSERT_OK(parse_text("{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"mistral\"," TINY_LLAMA "}", &e));
    ASSERT_OK(parse_text("{\"architectures\":[\"MistralForCausalLM\"],\"model_type\":\"llama\"," TINY_LLAMA "}", &e));
    ASSERT_OK(parse_text("{\"architectures\":[\"LlamaForCausalLM\"]," TINY_LLAMA "}", &e));
    ASSERT_EQ(cfg.arch, MODEL_ARCH_LLAMA);
}
#undef TINY_LLAMA

// Issue 28 item 9: widths derived from the file's counts (kept in int by the model code) are
// computed in checked 64-bit arithmetic and refused when they do not fit, instead of wrapping.
TEST(derived_widths_that_overflow_an_int_are_refused) {
    struct error e = {0};
    static const struct {
        const char *json, *needle;
    } cases[] = {
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":"
         "2,"
         "\"num_attention_heads\":65536,\"num_key_value_heads\":65536,\"head_dim\":65536,\"vocab_size\":100}",
         "num_attention_heads * head_dim * 2 (q and its gate) = 8589934592 exceeds 2147483647"},
        {"{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":2147483647,"
         "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100}",
         "2 * intermediate_size = 4294967294"},
        {"{\"architectures\":[\"Qwen3NextForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
         "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":16,\"vocab_size\":"
         "100,"
         "\"linear_num_key_heads\":2,\"linear_num_value_heads\":65536,\"linear_key_head_dim\":65536,"
         "\"linear_value_head_dim\":64,\"num_experts\":0}",
         "linear attention state"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        atomc_status st = parse_text(cases[i].json, &e);
        if (st == ATOMC_OK) st = model_config_validate(&cfg, "w.json", &e);
        if (st != ATOMC_ERR_FORMAT || !strstr(e.msg, cases[i].needle))
            test_fail(__FILE__, __LINE__, "case %zu: status %d \"%s\" (want \"%s\")", i, (int)st, e.msg,
                      cases[i].needle);
    }
}

TEST(generation_config_merge) {
    struct error e = {0};
    ASSERT_OK(load_fixture("llama-2-7b.json", &e));
    ASSERT_OK(model_config_merge_generation_config(&cfg, "{\"bos_token_id\": 5, \"eos_token_id\": [2, 7], "
                                                         "\"temperature\": 0.6}",
                                                   "generation_config.json", &e));
    ASSERT_EQ(cfg.bos_token_id, 5);
    ASSERT_EQ(cfg.n_eos, 2);
    ASSERT_EQ(cfg.eos_token_ids[1], 7);
    ASSERT_OK(model_config_merge_generation_config(&cfg, "{\"eos_token_id\": 9}", "g.json", &e));
    ASSERT_EQ(cfg.n_eos, 1);
    ASSERT_EQ(cfg.eos_token_ids[0], 9);
    ASSERT_EQ(cfg.bos_token_id, 5); // untouched when absent
    // Errors leave the config unchanged and name the file.
    ASSERT_EQ(model_config_merge_generation_config(&cfg, "{\"eos_token_id\": \"x\", \"bos_token_id\": 3}", "g.json", &e),
              ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "g.json") && strstr(e.msg, "eos_token_id"));
    ASSERT_EQ(cfg.bos_token_id, 5);
    ASSERT_EQ(cfg.eos_token_ids[0], 9);
    ASSERT_EQ(model_config_merge_generation_config(&cfg, "not json", "g.json", &e), ATOMC_ERR_FORMAT);
}

TEST(arch_names_roundtrip) {
    ASSERT_EQ(model_arch_from_name("MistralForCausalLM"), MODEL_ARCH_LLAMA);
    ASSERT_EQ(model_arch_from_name("Glm4MoeForCausalLM"), MODEL_ARCH_GLM4_MOE);
    ASSERT_EQ(model_arch_from_name("Nope"), MODEL_ARCH_UNKNOWN);
    ASSERT_STREQ(model_arch_name(MODEL_ARCH_QWEN3_NEXT), "Qwen3NextForCausalLM");
    ASSERT_STREQ(model_arch_name(MODEL_ARCH_DEEPSEEK_V3), "DeepseekV3ForCausalLM");
}

int main(int argc, char **argv) { return test_main(argc, argv); }
