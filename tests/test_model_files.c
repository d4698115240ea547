// model_files: one weight source over HF directories and GGUF files, addressed by HF names.
// - tests/fixtures/loader/tiny_llama.gguf: a 2-layer LLaMA GGUF with llama.cpp's q/k row
//   permutation (q in Q8_0, k in F16); the reference is what HF transformers serves when it
//   loads that GGUF (tiny_llama_refs.json; tools/gen_loader_refs.py).
// - The real SmolLM2 GGUF ($ATOMC_SMOLLM2; skipped if unset, failed under ATOMC_REQUIRE_FIXTURES=1)
//   against transformers' q/k/v/down weights recorded in smollm2_refs.json.
// - Hand-made HF directories (temp dir) for config/generation_config/safetensors wiring and
//   for the errors: missing tensor, wrong shape, wrong dtype, unknown architecture.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loader/model_files.h"
#include "test.h"

static void write_file(const char *dir, const char *name, const void *data, size_t n) {
    char p[700];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    test_write_file(p, data, n);
}

// Dequantised row r of a 2-D tensor into out (cols floats).
static void row_f32(const struct tensor *t, int64_t r, float *out) {
    size_t rb = dtype_row_bytes(t->dtype, tensor_cols(t));
    dtype_to_f32(t->dtype, (const char *)t->data + (size_t)r * rb, out, tensor_cols(t));
}

// Every tensor of `refs` ({name: {shape, n_rows, values}}, values row-major over the first
// n_rows rows; for 1-D tensors the first n_rows elements) as model_files serves it, against
// transformers' values. Reports the first mismatch through test_fail.
static void expect_tensors_match(struct model_files *mf, json_t *refs) {
    struct error e = {0};
    const char *name;
    json_t *r;
    json_object_foreach(refs, name, r) {
        struct tensor t;
        ASSERT_OK(model_files_get_tensor(mf, name, &t, &e));
        json_t *shape = json_object_get(r, "shape"), *vals = json_object_get(r, "values");
        ASSERT_EQ(t.ndim, (int)json_array_size(shape));
        for (int d = 0; d < t.ndim; d++) ASSERT_EQ(t.ne[d], json_integer_value(json_array_get(shape, (size_t)d)));
        int64_t n_rows = json_integer_value(json_object_get(r, "n_rows")), cols = tensor_cols(&t);
        if (t.ndim == 1) {
            cols = n_rows;
            n_rows = 1;
        }
        float *row = malloc((size_t)cols * sizeof *row);
        ASSERT_TRUE(row != NULL);
        for (int64_t i = 0; i < n_rows; i++) {
            if (t.ndim == 1) dtype_to_f32(t.dtype, t.data, row, cols);
            else row_f32(&t, i, row);
            for (int64_t j = 0; j < cols; j++) {
                double want = json_number_value(json_array_get(vals, (size_t)(i * cols + j)));
                if (!test_close_rel(row[j], want)) {
                    test_fail(__FILE__, __LINE__, "%s[%lld, %lld] = %.9g, transformers says %.9g", name, (long long)i,
                              (long long)j, row[j], want);
                    free(row);
                    return;
                }
            }
        }
        free(row);
    }
}

// ---------------------------------------------------------------------------------

TEST(tiny_gguf_matches_transformers) {
    struct error e = {0};
    json_t *ref = test_fixture_json("loader/tiny_llama_refs.json");
    ASSERT_TRUE(ref != NULL);
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_llama.gguf"), &e));
    ASSERT_EQ(mf->kind, MODEL_FILES_GGUF);
    ASSERT_TRUE(mf->gguf_permuted_qk);
    const struct model_config *c = &mf->config;
    json_t *rc = json_object_get(ref, "config");
    ASSERT_EQ(c->arch, MODEL_ARCH_LLAMA);
    ASSERT_EQ(c->hidden_size, json_integer_value(json_object_get(rc, "hidden_size")));
    ASSERT_EQ(c->num_heads, json_integer_value(json_object_get(rc, "num_attention_heads")));
    ASSERT_EQ(c->num_kv_heads, json_integer_value(json_object_get(rc, "num_key_value_heads")));
    ASSERT_EQ(c->intermediate_size, json_integer_value(json_object_get(rc, "intermediate_size")));
    ASSERT_EQ(c->num_layers, json_integer_value(json_object_get(rc, "num_hidden_layers")));
    ASSERT_EQ(c->vocab_size, json_integer_value(json_object_get(rc, "vocab_size")));
    ASSERT_EQ(c->max_position_embeddings, json_integer_value(json_object_get(rc, "max_position_embeddings")));
    ASSERT_NEAR(c->rope.theta, json_number_value(json_object_get(rc, "rope_theta")), 0);
    ASSERT_NEAR(c->rms_norm_eps, json_number_value(json_object_get(rc, "rms_norm_eps")), 1e-12);
    ASSERT_EQ(c->tie_word_embeddings, json_is_true(json_object_get(rc, "tie_word_embeddings")));
    ASSERT_EQ(c->head_dim, 16);
    ASSERT_EQ(c->rope.rotary_dim, 16);
    ASSERT_EQ(c->bos_token_id, 1);
    ASSERT_EQ(c->n_eos, 1);
    ASSERT_EQ(c->eos_token_ids[0], 2);

    expect_tensors_match(mf, json_object_get(ref, "tensors"));
    if (test_failed_now()) {
        model_files_close(mf);
        json_decref(ref);
        return;
    }
    // q stays Q8_0 (rows moved, not requantised), k stays F16; both in owned buffers, cached.
    struct tensor q, q2, k, raw;
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.self_attn.q_proj.weight", &q, &e));
    ASSERT_EQ(q.dtype, DTYPE_Q8_0);
    ASSERT_TRUE((const unsigned char *)q.data < mf->gguf->data ||
                (const unsigned char *)q.data >= mf->gguf->data + mf->gguf->size);
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.self_attn.q_proj.weight", &q2, &e));
    ASSERT_TRUE(q.data == q2.data);
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.self_attn.k_proj.weight", &k, &e));
    ASSERT_EQ(k.dtype, DTYPE_F16);
    // The file's own order differs from HF's (so the un-permutation is what made it match).
    ASSERT_OK(gguf_get_tensor(mf->gguf, "blk.0.attn_q.weight", &raw, &e));
    float a[64], b[64];
    row_f32(&raw, 1, a);
    row_f32(&q, 1, b);
    ASSERT_TRUE(memcmp(a, b, sizeof a) != 0);
    row_f32(&raw, 2, a); // GGUF row 2 = head 0, i = 1, first half = HF row 1
    ASSERT_TRUE(memcmp(a, b, sizeof a) == 0);
    // Untouched tensors are views into the mapping.
    struct tensor v;
    ASSERT_OK(model_files_get_tensor(mf, "model.layers.0.self_attn.v_proj.weight", &v, &e));
    ASSERT_TRUE((const unsigned char *)v.data >= mf->gguf->data &&
                (const unsigned char *)v.data < mf->gguf->data + mf->gguf->size);
    model_files_close(mf);
    json_decref(ref);
}

TEST(tiny_qwen3_gguf_matches_transformers) {
    struct error e = {0};
    json_t *ref = test_fixture_json("loader/tiny_qwen3_refs.json");
    ASSERT_TRUE(ref != NULL);
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_qwen3.gguf"), &e));
    ASSERT_TRUE(!mf->gguf_permuted_qk);
    const struct model_config *c = &mf->config;
    json_t *rc = json_object_get(ref, "config");
    ASSERT_EQ(c->arch, MODEL_ARCH_QWEN3);
    ASSERT_STREQ(c->architecture, json_string_value(json_object_get(rc, "architecture")));
    ASSERT_EQ(c->head_dim, json_integer_value(json_object_get(rc, "head_dim")));
    ASSERT_EQ(c->num_heads, json_integer_value(json_object_get(rc, "num_attention_heads")));
    ASSERT_EQ(c->num_kv_heads, json_integer_value(json_object_get(rc, "num_key_value_heads")));
    ASSERT_EQ(c->num_layers, json_integer_value(json_object_get(rc, "num_hidden_layers")));
    ASSERT_EQ(c->vocab_size, json_integer_value(json_object_get(rc, "vocab_size")));
    ASSERT_NEAR(c->rope.theta, json_number_value(json_object_get(rc, "rope_theta")), 0);
    ASSERT_EQ(c->tie_word_embeddings, json_is_true(json_object_get(rc, "tie_word_embeddings")));
    ASSERT_TRUE(c->qk_norm);
    ASSERT_EQ(c->rope.rotary_dim, 128);
    ASSERT_EQ(c->bos_token_id, -1);
    ASSERT_EQ(c->eos_token_ids[0], 3);
    expect_tensors_match(mf, json_object_get(ref, "tensors"));
    if (test_failed_now()) {
        model_files_close(mf);
        json_decref(ref);
        return;
    }
    struct tensor t;
    ASSERT_EQ(model_files_get_tensor(mf, "lm_head.weight", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "tied") != NULL);
    ASSERT_OK(model_files_expect(mf, "model.layers.0.self_attn.q_proj.weight", TENSOR_CLASS_WEIGHT, &t, &e, 512, 64));
    ASSERT_OK(model_files_expect(mf, "model.layers.0.self_attn.q_norm.weight", TENSOR_CLASS_FLOAT, &t, &e, 128));
    model_files_close(mf);
    json_decref(ref);
}

TEST(gguf_llama31_rope_freqs_recovered) {
    // llama.cpp stores Llama-3.1's rope_scaling only as rope_freqs.weight; the config must
    // come back as the HF llama3 parameters it was made from.
    struct error e = {0};
    json_t *ref = test_fixture_json("loader/tiny_llama31_rope_refs.json");
    ASSERT_TRUE(ref != NULL);
    json_t *sc = json_object_get(ref, "rope_scaling");
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_llama31_rope.gguf"), &e));
    const struct rope_config *r = &mf->config.rope;
    ASSERT_EQ(r->scaling, ROPE_SCALING_LLAMA3);
    ASSERT_NEAR(r->theta, json_number_value(json_object_get(ref, "rope_theta")), 0);
    ASSERT_NEAR(r->factor, json_number_value(json_object_get(sc, "factor")), 0);
    ASSERT_NEAR(r->low_freq_factor, json_number_value(json_object_get(sc, "low_freq_factor")), 0);
    ASSERT_NEAR(r->high_freq_factor, json_number_value(json_object_get(sc, "high_freq_factor")), 0);
    ASSERT_EQ(r->original_max_position, json_integer_value(json_object_get(sc, "original_max_position_embeddings")));
    // Factors that fit no llama3 parameters are refused, naming the tensor.
    const struct gguf_tensor_info *ti = gguf_find_tensor(mf->gguf, "rope_freqs.weight");
    ASSERT_TRUE(ti != NULL);
    size_t off = (size_t)((const unsigned char *)ti->data - mf->gguf->data);
    char *data;
    size_t n;
    ASSERT_OK(file_read_all(test_fixture("loader/tiny_llama31_rope.gguf"), &data, &n, &e));
    model_files_close(mf);
    float bad = 3.0f;
    memcpy(data + off + 4 * 2, &bad, 4); // a short-wavelength factor that should be 1
    const char *p = test_tmp_path("badrope.gguf");
    test_write_file(p, data, n);
    free(data);
    ASSERT_EQ(model_files_open(&mf, p, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "badrope.gguf") && strstr(e.msg, "rope_freqs.weight"));
    json_decref(ref);
}

TEST(gguf_errors_name_file_and_tensor) {
    struct error e = {0};
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_llama.gguf"), &e));
    struct tensor t;
    ASSERT_EQ(model_files_expect(mf, "model.layers.0.self_attn.q_proj.weight", TENSOR_CLASS_WEIGHT, &t, &e, 64, 32),
              ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "tiny_llama.gguf: tensor model.layers.0.self_attn.q_proj.weight has shape [64, 64], "
                              "expected [64, 32]") != NULL);
    ASSERT_OK(model_files_expect(mf, "model.layers.0.self_attn.q_proj.weight", TENSOR_CLASS_WEIGHT, &t, &e, 64, 64));
    ASSERT_EQ(model_files_expect(mf, "model.layers.0.self_attn.q_proj.weight", TENSOR_CLASS_FLOAT, &t, &e, 64, 64),
              ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "has dtype Q8_0, expected a float dtype") != NULL);
    ASSERT_OK(model_files_expect(mf, "model.norm.weight", TENSOR_CLASS_FLOAT, &t, &e, 64));
    ASSERT_EQ(model_files_get_tensor(mf, "model.layers.7.mlp.up_proj.weight", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "tiny_llama.gguf: missing tensor 'model.layers.7.mlp.up_proj.weight' (GGUF name "
                              "'blk.7.ffn_up.weight')") != NULL);
    ASSERT_EQ(model_files_get_tensor(mf, "model.layers.0.self_attn.q_norm.weight", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(!model_files_has_tensor(mf, "model.layers.0.self_attn.q_norm.weight"));
    ASSERT_TRUE(model_files_has_tensor(mf, "lm_head.weight"));
    ASSERT_EQ(model_files_get_tensor(mf, "something.else", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "'something.else'") != NULL);
    // Raw GGUF names pass through.
    ASSERT_OK(model_files_get_tensor(mf, "blk.1.ffn_down.weight", &t, &e));
    model_files_close(mf);
}

TEST(gguf_name_mapping) {
    char n[128];
    struct {
        const char *hf, *gg;
    } cases[] = {
        {"model.embed_tokens.weight", "token_embd.weight"},
        {"model.norm.weight", "output_norm.weight"},
        {"lm_head.weight", "output.weight"},
        {"model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"},
        {"model.layers.12.self_attn.k_proj.bias", "blk.12.attn_k.bias"},
        {"model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"},
        {"model.layers.3.self_attn.q_norm.weight", "blk.3.attn_q_norm.weight"},
        {"model.layers.3.self_attn.k_norm.weight", "blk.3.attn_k_norm.weight"},
        {"model.layers.29.mlp.gate_proj.weight", "blk.29.ffn_gate.weight"},
        {"model.layers.29.mlp.down_proj.weight", "blk.29.ffn_down.weight"},
        {"model.layers.5.input_layernorm.weight", "blk.5.attn_norm.weight"},
        {"model.layers.5.post_attention_layernorm.weight", "blk.5.ffn_norm.weight"},
        {"model.layers.5.mlp.gate.weight", "blk.5.ffn_gate_inp.weight"},
        {"model.layers.5.mlp.experts.17.up_proj.weight", "blk.5.ffn_up_exps.weight"},
        {"model.layers.5.block_sparse_moe.gate.weight", "blk.5.ffn_gate_inp.weight"},
        {"model.layers.5.block_sparse_moe.experts.7.w1.weight", "blk.5.ffn_gate_exps.weight"},
        {"model.layers.5.block_sparse_moe.experts.7.w2.weight", "blk.5.ffn_down_exps.weight"},
        {"model.layers.5.block_sparse_moe.experts.7.w3.weight", "blk.5.ffn_up_exps.weight"},
        {"model.layers.2.mlp.shared_expert.down_proj.weight", "blk.2.ffn_down_shexp.weight"},
        {"model.layers.2.mlp.shared_expert_gate.weight", "blk.2.ffn_gate_inp_shexp.weight"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ASSERT_TRUE(model_files_gguf_name(cases[i].hf, n, sizeof n));
        ASSERT_STREQ(n, cases[i].gg);
    }
    ASSERT_TRUE(!model_files_gguf_name("model.layers.x.mlp.up_proj.weight", n, sizeof n));
    ASSERT_TRUE(!model_files_gguf_name("model.layers.1.mlp.up_proj.weightX", n, sizeof n));
    ASSERT_TRUE(!model_files_gguf_name("model.layers.1.mlp.experts.2.foo_proj.weight", n, sizeof n));
}

TEST(gguf_moe_expert_views) {
    // tiny_moe.gguf (gguf package writer): expert tensors stacked (n_expert, rows, cols), each
    // value = expert * 1000 + row + col / 1000 (+0.5 up, +0.25 down).
    struct error e = {0};
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_moe.gguf"), &e));
    const struct model_config *c = &mf->config;
    ASSERT_EQ(c->arch, MODEL_ARCH_QWEN3_MOE);
    ASSERT_EQ(c->num_experts, 4);
    ASSERT_EQ(c->num_experts_per_tok, 2);
    ASSERT_EQ(c->moe_intermediate_size, 16);
    ASSERT_TRUE(model_config_layer_is_moe(c, 0));
    static const struct {
        const char *proj;
        int rows, cols;
        float extra;
    } projs[] = {{"gate", 16, 32, 0.0f}, {"up", 16, 32, 0.5f}, {"down", 32, 16, 0.25f}};
    for (int ex = 0; ex < 4; ex++)
        for (int p = 0; p < 3; p++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.%s_proj.weight", ex, projs[p].proj);
            struct tensor t;
            ASSERT_OK(model_files_expect(mf, name, TENSOR_CLASS_FLOAT, &t, &e, projs[p].rows, projs[p].cols));
            const float *v = t.data;
            for (int r = 0; r < projs[p].rows; r++)
                for (int col = 0; col < projs[p].cols; col++) {
                    float want = (float)(ex * 1000 + r) + (float)col / 1000.0f + projs[p].extra;
                    if (fabsf(v[r * projs[p].cols + col] - want) > 1e-3f) {
                        test_fail(__FILE__, __LINE__, "%s[%d, %d] = %g, want %g", name, r, col,
                                  v[r * projs[p].cols + col], want);
                        model_files_close(mf);
                        return;
                    }
                }
        }
    struct tensor t;
    ASSERT_EQ(model_files_get_tensor(mf, "model.layers.0.mlp.experts.4.up_proj.weight", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "no expert 4") != NULL);
    ASSERT_TRUE(!model_files_has_tensor(mf, "model.layers.0.mlp.experts.4.up_proj.weight"));
    ASSERT_TRUE(model_files_has_tensor(mf, "model.layers.0.mlp.experts.3.up_proj.weight"));
    ASSERT_OK(model_files_expect(mf, "model.layers.0.mlp.gate.weight", TENSOR_CLASS_FLOAT, &t, &e, 4, 32));
    model_files_close(mf);
}

// Minimal llama GGUF: n_tok tokens, token_embd.weight of emb_rows x 32 (F32, zeros).
static const char *write_vocab_gguf(const char *fname, int n_tok, int emb_rows) {
    size_t cap = 4096 + (size_t)emb_rows * 32 * 4 + (size_t)n_tok * 16, n = 0;
    unsigned char *b = calloc(1, cap);
    uint32_t u32;
    uint64_t u64;
#define PUT(p, len) (memcpy(b + n, (p), (len)), n += (len))
#define PUT_STR(str) (u64 = strlen(str), PUT(&u64, 8), PUT((str), strlen(str)))
#define KV_U32(key, v) (PUT_STR(key), u32 = GGUF_TYPE_UINT32, PUT(&u32, 4), u32 = (v), PUT(&u32, 4))
    PUT("GGUF", 4);
    u32 = 3, PUT(&u32, 4);
    u64 = 1, PUT(&u64, 8);
    u64 = 6, PUT(&u64, 8);
    PUT_STR("general.architecture");
    u32 = GGUF_TYPE_STRING, PUT(&u32, 4);
    PUT_STR("llama");
    KV_U32("llama.block_count", 1);
    KV_U32("llama.embedding_length", 32);
    KV_U32("llama.feed_forward_length", 64);
    KV_U32("llama.attention.head_count", 2);
    PUT_STR("tokenizer.ggml.tokens");
    u32 = GGUF_TYPE_ARRAY, PUT(&u32, 4);
    u32 = GGUF_TYPE_STRING, PUT(&u32, 4);
    u64 = (uint64_t)n_tok, PUT(&u64, 8);
    for (int i = 0; i < n_tok; i++) {
        char t[16];
        snprintf(t, sizeof t, "t%d", i);
        PUT_STR(t);
    }
    PUT_STR("token_embd.weight");
    u32 = 2, PUT(&u32, 4);
    u64 = 32, PUT(&u64, 8);
    u64 = (uint64_t)emb_rows, PUT(&u64, 8);
    u32 = GGML_TYPE_F32, PUT(&u32, 4);
    u64 = 0, PUT(&u64, 8);
#undef KV_U32
#undef PUT_STR
#undef PUT
    n = (n + 31) / 32 * 32 + (size_t)emb_rows * 32 * 4;
    const char *p = test_tmp_path(fname);
    test_write_file(p, b, n);
    free(b);
    return p;
}

TEST(gguf_vocab_from_tokens_and_embeddings) {
    struct error e = {0};
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, write_vocab_gguf("v_eq.gguf", 10, 10), &e));
    ASSERT_EQ(mf->config.vocab_size, 10);
    ASSERT_TRUE(mf->config.tie_word_embeddings);
    model_files_close(mf);
    // Embedding padded beyond the token list: vocab is the row count.
    ASSERT_OK(model_files_open(&mf, write_vocab_gguf("v_pad.gguf", 10, 16), &e));
    ASSERT_EQ(mf->config.vocab_size, 16);
    model_files_close(mf);
    // More tokens than embedding rows: refused, naming the tensor and the counts.
    ASSERT_EQ(model_files_open(&mf, write_vocab_gguf("v_bad.gguf", 20, 16), &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "v_bad.gguf") && strstr(e.msg, "'token_embd.weight' has shape [16, 32]") &&
                strstr(e.msg, "20 tokens"));
}

TEST(gguf_unsupported_architecture) {
    // GGUF header with general.architecture = "gpt2" and nothing else.
    unsigned char b[128];
    size_t n = 0;
    uint32_t u32;
    uint64_t u64;
#define PUT(v) (memcpy(b + n, &(v), sizeof(v)), n += sizeof(v))
    memcpy(b, "GGUF", 4);
    n = 4;
    u32 = 3, PUT(u32);
    u64 = 0, PUT(u64);
    u64 = 1, PUT(u64);
    u64 = 20, PUT(u64);
    memcpy(b + n, "general.architecture", 20), n += 20;
    u32 = GGUF_TYPE_STRING, PUT(u32);
    u64 = 4, PUT(u64);
    memcpy(b + n, "gpt2", 4), n += 4;
#undef PUT
    const char *p = test_tmp_path("gpt2.gguf");
    test_write_file(p, b, n);
    struct error e = {0};
    struct model_files *mf;
    ASSERT_EQ(model_files_open(&mf, p, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "gpt2.gguf") && strstr(e.msg, "'gpt2'") && strstr(e.msg, "llama"));
    ASSERT_TRUE(mf == NULL);
}

// ---------------------------------------------------------------------------------
// HF directories.

static void write_st(const char *dir, const char *name, const char *header, const void *data, size_t dlen) {
    size_t hl = strlen(header);
    unsigned char *buf = malloc(8 + hl + dlen);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    memcpy(buf + 8 + hl, data, dlen);
    write_file(dir, name, buf, 8 + hl + dlen);
    free(buf);
}

static const char *TINY_CONFIG =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":8,\"intermediate_size\":16,\"num_hidden_layers\":1,"
    "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"vocab_size\":4,\"eos_token_id\":2,\"bos_token_id\":1,"
    "\"tie_word_embeddings\":true,\"torch_dtype\":\"float32\"}";

static const char *make_hf_dir(const char *sub) {
    const char *dir = test_tmp_path(sub);
    if (mkdir(dir, 0755) != 0) abort();
    return dir;
}

TEST(hf_directory) {
    struct error e = {0};
    const char *dir = make_hf_dir("hf");
    write_file(dir, "config.json", TINY_CONFIG, strlen(TINY_CONFIG));
    const char *gen = "{\"bos_token_id\":1,\"eos_token_id\":[2,3]}";
    write_file(dir, "generation_config.json", gen, strlen(gen));
    write_file(dir, "tokenizer.json", "{}", 2);
    float emb[4 * 8 + 4]; // embeddings, then 8 bf16 norm weights
    for (int i = 0; i < 36; i++) emb[i] = (float)i;
    write_st(dir, "model.safetensors",
             "{\"model.embed_tokens.weight\":{\"dtype\":\"F32\",\"shape\":[4,8],\"data_offsets\":[0,128]},"
             "\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[0,0]},"
             "\"ids\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,0]}}",
             emb, sizeof emb);
    struct model_files *mf;
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_FORMAT); // norm shape [8] but 0 bytes
    ASSERT_TRUE(strstr(e.msg, "model.safetensors") && strstr(e.msg, "'model.norm.weight'"));
    write_st(dir, "model.safetensors",
             "{\"model.embed_tokens.weight\":{\"dtype\":\"F32\",\"shape\":[4,8],\"data_offsets\":[0,128]},"
             "\"model.norm.weight\":{\"dtype\":\"BF16\",\"shape\":[8],\"data_offsets\":[128,144]}}",
             emb, sizeof emb);
    ASSERT_OK(model_files_open(&mf, dir, &e));
    ASSERT_EQ(mf->kind, MODEL_FILES_HF);
    ASSERT_TRUE(mf->has_generation_config);
    ASSERT_EQ(mf->config.n_eos, 2);
    ASSERT_EQ(mf->config.eos_token_ids[1], 3);
    ASSERT_TRUE(mf->config.tie_word_embeddings);
    ASSERT_TRUE(mf->tokenizer_path && strstr(mf->tokenizer_path, "tokenizer.json"));
    struct tensor t;
    ASSERT_OK(model_files_expect(mf, "model.embed_tokens.weight", TENSOR_CLASS_FLOAT, &t, &e, 4, 8));
    float v;
    memcpy(&v, (char *)t.data + 4 * 9, 4);
    ASSERT_NEAR(v, 9.0, 0);
    // Shape / dtype / missing errors name the file and the tensor.
    ASSERT_EQ(model_files_expect(mf, "model.embed_tokens.weight", TENSOR_CLASS_FLOAT, &t, &e, 8, 4), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "hf/model.safetensors: tensor model.embed_tokens.weight has shape [4, 8], expected [8, 4]") !=
                NULL);
    ASSERT_EQ(model_files_expect(mf, "model.norm.weight", TENSOR_CLASS_FLOAT, &t, &e, 8, 1), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "has shape [8], expected [8, 1]") != NULL);
    ASSERT_EQ(model_files_expect(mf, "model.norm.weight", TENSOR_CLASS_INT, &t, &e, 8), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "tensor model.norm.weight has dtype BF16, expected an integer dtype") != NULL);
    ASSERT_EQ(model_files_get_tensor(mf, "model.layers.0.self_attn.q_proj.weight", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "hf/model.safetensors: missing tensor 'model.layers.0.self_attn.q_proj.weight'") != NULL);
    // Tensor-parallel slices: rows are views, columns are copies.
    ASSERT_OK(model_files_get_tensor_slice(mf, "model.embed_tokens.weight", 0, 2, 2, &t, &e));
    ASSERT_EQ(t.ne[0], 2);
    memcpy(&v, t.data, 4);
    ASSERT_NEAR(v, 16.0, 0);
    ASSERT_OK(model_files_get_tensor_slice(mf, "model.embed_tokens.weight", 1, 4, 4, &t, &e));
    ASSERT_EQ(t.ne[0], 4);
    ASSERT_EQ(t.ne[1], 4);
    memcpy(&v, (char *)t.data + 4 * 5, 4); // row 1, col 1 of the slice = emb[1][5]
    ASSERT_NEAR(v, 13.0, 0);
    ASSERT_EQ(model_files_get_tensor_slice(mf, "model.embed_tokens.weight", 1, 6, 4, &t, &e),
              ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(e.msg, "slice [6, 10) of dim 1 is out of range") != NULL);
    model_files_close(mf);
}

TEST(hf_sharded_checkpoint_from_transformers) {
    // tiny_qwen3_hf/: transformers save_pretrained (bf16, 4 shards + index, transformers-5
    // config with rope_parameters, generation_config with two eos ids).
    struct error e = {0};
    json_t *ref = test_fixture_json("loader/tiny_qwen3_hf_refs.json");
    ASSERT_TRUE(ref != NULL);
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, test_fixture("loader/tiny_qwen3_hf"), &e));
    ASSERT_EQ(mf->kind, MODEL_FILES_HF);
    ASSERT_EQ(mf->st->n_files, 4);
    ASSERT_TRUE(mf->has_generation_config);
    const struct model_config *c = &mf->config;
    ASSERT_EQ(c->arch, MODEL_ARCH_QWEN3);
    ASSERT_EQ(c->head_dim, 16);
    ASSERT_EQ(c->num_kv_heads, 2);
    ASSERT_NEAR(c->rope.theta, 10000.0, 0);
    ASSERT_EQ(c->torch_dtype, DTYPE_BF16);
    ASSERT_EQ(c->n_eos, 2);
    ASSERT_EQ(c->eos_token_ids[1], 5);
    ASSERT_TRUE(!c->tie_word_embeddings);
    ASSERT_EQ(mf->st->n_entries, json_object_size(ref));
    const char *name;
    json_t *r;
    json_object_foreach(ref, name, r) {
        struct tensor t;
        ASSERT_OK(model_files_get_tensor(mf, name, &t, &e));
        ASSERT_EQ(t.dtype, DTYPE_BF16);
        json_t *shape = json_object_get(r, "shape");
        ASSERT_EQ(t.ndim, (int)json_array_size(shape));
        for (int d = 0; d < t.ndim; d++) ASSERT_EQ(t.ne[d], json_integer_value(json_array_get(shape, (size_t)d)));
        int64_t n = tensor_numel(&t);
        float *buf = malloc((size_t)n * sizeof(float));
        dtype_to_f32(t.dtype, t.data, buf, n);
        double sum = 0;
        for (int64_t i = 0; i < n; i++) sum += buf[i];
        json_t *first = json_object_get(r, "first");
        for (size_t i = 0; i < json_array_size(first); i++)
            ASSERT_TRUE(buf[i] == (float)json_number_value(json_array_get(first, i)));
        free(buf);
        ASSERT_NEAR(sum, json_number_value(json_object_get(r, "sum")), 1e-9 * (1 + fabs(sum)));
        // Every view points into the shard the index names.
        const char *src = model_files_source(mf, name);
        ASSERT_TRUE(strstr(src, "model-0000") != NULL);
    }
    struct tensor t;
    ASSERT_OK(model_files_expect(mf, "model.layers.1.self_attn.k_norm.weight", TENSOR_CLASS_FLOAT, &t, &e, 16));
    ASSERT_OK(model_files_expect(mf, "lm_head.weight", TENSOR_CLASS_FLOAT, &t, &e, 64, 32));
    model_files_close(mf);
    json_decref(ref);
}

TEST(misaligned_views_are_copied_aligned) {
    struct error e = {0};
    const char *dir = make_hf_dir("misaligned");
    write_file(dir, "config.json", TINY_CONFIG, strlen(TINY_CONFIG));
    // A 1-byte padded header: the data buffer starts at an odd address within the mapping.
    float emb[32];
    for (int i = 0; i < 32; i++) emb[i] = 0.5f * (float)i;
    char hdr[256];
    snprintf(hdr, sizeof hdr, "{\"model.embed_tokens.weight\":{\"dtype\":\"F32\",\"shape\":[4,8],"
                              "\"data_offsets\":[0,128]}}");
    size_t hl = strlen(hdr);
    if ((8 + hl) % 4 == 0) hdr[hl++] = ' ', hdr[hl] = '\0'; // force misalignment
    write_st(dir, "model.safetensors", hdr, emb, sizeof emb);
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, dir, &e));
    const struct safetensors_entry *en = safetensors_set_find(mf->st, "model.embed_tokens.weight");
    ASSERT_TRUE(en && (uintptr_t)en->tensor->data % 4 != 0);
    struct tensor t, t2;
    ASSERT_OK(model_files_get_tensor(mf, "model.embed_tokens.weight", &t, &e));
    ASSERT_TRUE((uintptr_t)t.data % 4 == 0);
    ASSERT_TRUE(memcmp(t.data, emb, sizeof emb) == 0);
    ASSERT_OK(model_files_get_tensor(mf, "model.embed_tokens.weight", &t2, &e));
    ASSERT_TRUE(t.data == t2.data); // cached
    model_files_close(mf);
}

TEST(hf_directory_errors) {
    struct error e = {0};
    struct model_files *mf;
    const char *dir = make_hf_dir("noconfig");
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_IO);
    ASSERT_TRUE(strstr(e.msg, "noconfig") && strstr(e.msg, "config.json"));
    dir = make_hf_dir("gpt2");
    const char *cfg = "{\"architectures\":[\"GPT2LMHeadModel\"],\"n_embd\":768}";
    write_file(dir, "config.json", cfg, strlen(cfg));
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "gpt2/config.json") && strstr(e.msg, "GPT2LMHeadModel") && strstr(e.msg, "supported"));
    dir = make_hf_dir("noweights");
    write_file(dir, "config.json", TINY_CONFIG, strlen(TINY_CONFIG));
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_IO);
    ASSERT_TRUE(strstr(e.msg, "noweights") && strstr(e.msg, "model.safetensors"));
    dir = make_hf_dir("badgen");
    write_file(dir, "config.json", TINY_CONFIG, strlen(TINY_CONFIG));
    write_file(dir, "generation_config.json", "{\"eos_token_id\": {}}", 20);
    ASSERT_EQ(model_files_open(&mf, dir, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "generation_config.json") && strstr(e.msg, "eos_token_id"));
    ASSERT_EQ(model_files_open(&mf, "/nonexistent/model", &e), ATOMC_ERR_IO);
    ASSERT_TRUE(strstr(e.msg, "/nonexistent/model") != NULL);
    ASSERT_EQ(model_files_open(&mf, test_fixture("loader/ref_gguf.json"), &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "not a model") != NULL);
}

// ---------------------------------------------------------------------------------
// The real SmolLM2 GGUF vs HF transformers' own GGUF loader.

TEST(smollm2_gguf_matches_transformers) {
    const char *path = test_smollm2_path();
    if (!path) return;
    json_t *ref = test_fixture_json("loader/smollm2_refs.json");
    ASSERT_TRUE(ref != NULL);
    struct error e = {0};
    struct model_files *mf;
    ASSERT_OK(model_files_open(&mf, path, &e));
    const struct model_config *c = &mf->config;
    ASSERT_EQ(c->arch, MODEL_ARCH_LLAMA);
    ASSERT_EQ(c->num_layers, 30);
    ASSERT_EQ(c->hidden_size, 576);
    ASSERT_EQ(c->intermediate_size, 1536);
    ASSERT_EQ(c->num_heads, 9);
    ASSERT_EQ(c->num_kv_heads, 3);
    ASSERT_EQ(c->head_dim, 64);
    ASSERT_EQ(c->vocab_size, 49152);
    ASSERT_EQ(c->max_position_embeddings, 8192);
    ASSERT_NEAR(c->rope.theta, 100000.0, 0);
    ASSERT_NEAR(c->rms_norm_eps, 1e-5, 1e-12);
    ASSERT_EQ(c->tie_word_embeddings, json_is_true(json_object_get(ref, "hf_tie_word_embeddings")));
    ASSERT_EQ(c->bos_token_id, 1);
    ASSERT_EQ(c->eos_token_ids[0], 2);
    ASSERT_EQ(c->pad_token_id, 2);
    struct tensor t;
    ASSERT_EQ(model_files_get_tensor(mf, "lm_head.weight", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "tied") != NULL);

    json_t *cols = json_object_get(ref, "cols");
    const char *name;
    json_t *r;
    float row[1536];
    json_object_foreach(json_object_get(ref, "hf"), name, r) {
        ASSERT_OK(model_files_get_tensor(mf, name, &t, &e));
        json_t *rows = json_object_get(r, "rows");
        if (!strcmp(name, "model.norm.weight")) {
            json_t *vals = json_object_get(r, "values");
            dtype_to_f32(t.dtype, t.data, row, 576);
            for (size_t j = 0; j < json_array_size(vals); j++)
                ASSERT_NEAR(row[j], json_number_value(json_array_get(vals, j)), 1e-7);
            continue;
        }
        json_t *shape = json_object_get(r, "shape");
        if (shape) {
            ASSERT_EQ(t.ne[0], json_integer_value(json_array_get(shape, 0)));
            ASSERT_EQ(t.ne[1], json_integer_value(json_array_get(shape, 1)));
        }
        const char *key;
        json_t *vals;
        json_object_foreach(rows, key, vals) {
            row_f32(&t, atoll(key), row);
            for (size_t j = 0; j < json_array_size(vals); j++) {
                size_t col = shape ? (size_t)json_integer_value(json_array_get(cols, j)) : j;
                double want = json_number_value(json_array_get(vals, j));
                if (!test_close_rel(row[col], want)) {
                    test_fail(__FILE__, __LINE__, "%s[%s, %zu] = %.9g, transformers says %.9g", name, key, col, row[col],
                              want);
                    model_files_close(mf);
                    json_decref(ref);
                    return;
                }
            }
        }
    }
    model_files_close(mf);
    json_decref(ref);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
