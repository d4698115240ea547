// HF directory / GGUF weight source. See model_files.h for the contract.
#include "loader/model_files.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"

struct model_files_owned {
    char *key;         // HF name (+ slice spec) this buffer serves
    void *data;
    struct tensor t;
};

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

void model_files_close(struct model_files *mf) {
    if (!mf) return;
    for (size_t i = 0; i < mf->n_owned; i++) {
        free(mf->owned[i].key);
        free(mf->owned[i].data);
    }
    free(mf->owned);
    free(mf->consumed);
    safetensors_set_close(mf->st);
    gguf_close(mf->gguf);
    free(mf->tokenizer_path);
    free(mf->path);
    free(mf);
}

static const struct tensor *owned_find(const struct model_files *mf, const char *key) {
    for (size_t i = 0; i < mf->n_owned; i++)
        if (strcmp(mf->owned[i].key, key) == 0) return &mf->owned[i].t;
    return NULL;
}

// Takes ownership of data.
static const struct tensor *owned_add(struct model_files *mf, const char *key, void *data, struct tensor t) {
    if (mf->n_owned == mf->cap_owned) {
        mf->cap_owned = mf->cap_owned ? 2 * mf->cap_owned : 16;
        mf->owned = xrealloc(mf->owned, mf->cap_owned * sizeof *mf->owned);
    }
    t.data = data;
    mf->owned[mf->n_owned] = (struct model_files_owned){.key = xstrdup(key), .data = data, .t = t};
    return &mf->owned[mf->n_owned++].t;
}

// ---------------------------------------------------------------------------------
// HF name <-> GGUF name.

enum gguf_map_flags {
    MAP_PERMUTE_Q = 1, // rows permuted by llama.cpp with n_head = attention heads
    MAP_PERMUTE_K = 2, // ... with n_head = kv heads
};

struct gguf_mapping {
    char name[128];
    int flags;
    int expert; // >= 0: view of this expert of a stacked (n_expert, ...) tensor
};

static bool map_hf_to_gguf(const char *hf, struct gguf_mapping *m) {
    memset(m, 0, sizeof *m);
    m->expert = -1;
    static const struct {
        const char *hf, *gg;
    } globals[] = {
        {"model.embed_tokens.weight", "token_embd.weight"},
        {"model.norm.weight", "output_norm.weight"},
        {"lm_head.weight", "output.weight"},
    };
    for (size_t i = 0; i < sizeof globals / sizeof globals[0]; i++)
        if (!strcmp(hf, globals[i].hf)) {
            snprintf(m->name, sizeof m->name, "%s", globals[i].gg);
            return true;
        }
    int layer, n = 0;
    if (sscanf(hf, "model.layers.%d.%n", &layer, &n) != 1 || n == 0 || layer < 0) return false;
    const char *rest = hf + n;
    static const struct {
        const char *hf, *gg;
        int flags;
    } per_layer[] = {
        {"self_attn.q_proj", "attn_q", MAP_PERMUTE_Q},
        {"self_attn.k_proj", "attn_k", MAP_PERMUTE_K},
        {"self_attn.v_proj", "attn_v", 0},
        {"self_attn.o_proj", "attn_output", 0},
        {"self_attn.q_norm", "attn_q_norm", 0},
        {"self_attn.k_norm", "attn_k_norm", 0},
        {"mlp.gate_proj", "ffn_gate", 0},
        {"mlp.up_proj", "ffn_up", 0},
        {"mlp.down_proj", "ffn_down", 0},
        {"mlp.gate", "ffn_gate_inp", 0}, // MoE router
        {"block_sparse_moe.gate", "ffn_gate_inp", 0}, // Mixtral router
        {"mlp.shared_expert.gate_proj", "ffn_gate_shexp", 0},
        {"mlp.shared_expert.up_proj", "ffn_up_shexp", 0},
        {"mlp.shared_expert.down_proj", "ffn_down_shexp", 0},
        {"mlp.shared_expert_gate", "ffn_gate_inp_shexp", 0},
        {"mlp.shared_experts.gate_proj", "ffn_gate_shexp", 0}, // DeepSeek naming
        {"mlp.shared_experts.up_proj", "ffn_up_shexp", 0},
        {"mlp.shared_experts.down_proj", "ffn_down_shexp", 0},
        {"input_layernorm", "attn_norm", 0},
        {"post_attention_layernorm", "ffn_norm", 0},
    };
    for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++) {
        size_t l = strlen(per_layer[i].hf);
        if (strncmp(rest, per_layer[i].hf, l) == 0 && (!strcmp(rest + l, ".weight") || !strcmp(rest + l, ".bias"))) {
            snprintf(m->name, sizeof m->name, "blk.%d.%s%s", layer, per_layer[i].gg, rest + l);
            m->flags = per_layer[i].flags;
            return true;
        }
    }
    int expert, k = 0;
    char proj[16];
    if (sscanf(rest, "mlp.experts.%d.%15[a-z]_proj.weight%n", &expert, proj, &k) == 2 && rest[k] == '\0' &&
        expert >= 0 && (!strcmp(proj, "gate") || !strcmp(proj, "up") || !strcmp(proj, "down"))) {
        snprintf(m->name, sizeof m->name, "blk.%d.ffn_%s_exps.weight", layer, proj);
        m->expert = expert;
        return true;
    }
    // Mixtral: block_sparse_moe.experts.E.w1 (gate) / w3 (up) / w2 (down).
    int wi;
    k = 0;
    if (sscanf(rest, "block_sparse_moe.experts.%d.w%d.weight%n", &expert, &wi, &k) == 2 && rest[k] == '\0' &&
        expert >= 0 && wi >= 1 && wi <= 3) {
        static const char *which[] = {"", "gate", "down", "up"};
        snprintf(m->name, sizeof m->name, "blk.%d.ffn_%s_exps.weight", layer, which[wi]);
        m->expert = expert;
        return true;
    }
    return false;
}

bool model_files_gguf_name(const char *hf_name, char *out, size_t cap) {
    struct gguf_mapping m;
    if (!map_hf_to_gguf(hf_name, &m)) return false;
    snprintf(out, cap, "%s", m.name);
    return true;
}

// ---------------------------------------------------------------------------------
// GGUF -> model_config.

struct gguf_arch_desc {
    const char *gguf;           // general.architecture
    enum model_arch arch;
    const char *hf;             // architecture name recorded in config.architecture
};

static const struct gguf_arch_desc gguf_archs[] = {
    {"llama", MODEL_ARCH_LLAMA, "LlamaForCausalLM"},
    {"qwen3", MODEL_ARCH_QWEN3, "Qwen3ForCausalLM"},
    {"qwen3moe", MODEL_ARCH_QWEN3_MOE, "Qwen3MoeForCausalLM"},
};

// Reads <arch>.<key> as u32 into *out (int); absent keeps *out unless required.
static atomc_status arch_u32(const struct gguf_file *g, const char *arch, const char *key, bool required, int *out,
                             struct error *err) {
    char full[160];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    if (!gguf_has_key(g, full)) {
        if (required)
            return error_set(err, ATOMC_ERR_FORMAT, "%s: required metadata key '%s' is missing", g->path, full);
        return ATOMC_OK;
    }
    uint32_t v;
    atomc_status st = gguf_get_u32(g, full, &v, err);
    if (st) return st;
    if (v > INT32_MAX) return error_set(err, ATOMC_ERR_FORMAT, "%s: metadata key '%s' = %u is too large", g->path, full, v);
    *out = (int)v;
    return ATOMC_OK;
}

static atomc_status arch_f32(const struct gguf_file *g, const char *arch, const char *key, float *out,
                             struct error *err) {
    char full[160];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    if (!gguf_has_key(g, full)) return ATOMC_OK;
    return gguf_get_f32(g, full, out, err);
}

#define TRY(expr)                        \
    do {                                 \
        atomc_status st_ = (expr);       \
        if (st_ != ATOMC_OK) return st_; \
    } while (0)

// llama.cpp's converter turns HF's llama3 rope_scaling into a rope_freqs.weight tensor of
// per-frequency divisors (1 for short wavelengths, `factor` for long ones, a smooth blend
// between) and writes no scaling metadata. Recover the HF parameters by matching the
// tensor against the llama3 formula over the values real checkpoints use; if nothing
// matches, refuse rather than run with silently wrong positions.
static void llama3_factors(float theta, int dim, float factor, float low, float high, int orig, float *out) {
    const double pi = 3.14159265358979323846;
    for (int i = 0; i < dim / 2; i++) {
        double freq = 1.0 / pow((double)theta, (double)(2 * i) / dim);
        double wavelen = 2 * pi / freq;
        if (wavelen < orig / high) out[i] = 1.0f;
        else if (wavelen > orig / low) out[i] = factor;
        else {
            double smooth = (orig / wavelen - low) / (high - low);
            out[i] = (float)(1.0 / ((1 - smooth) / factor + smooth));
        }
    }
}

static atomc_status gguf_llama3_rope(const struct gguf_file *g, struct model_config *c, struct error *err) {
    const struct gguf_tensor_info *ti = gguf_find_tensor(g, "rope_freqs.weight");
    if (!ti) return ATOMC_OK;
    int half = c->rope.rotary_dim / 2;
    if (ti->ggml_type != GGML_TYPE_F32 || ti->ndim != 1 || ti->ne[0] != half || half <= 0 || half > 1024)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor 'rope_freqs.weight' must be F32 of shape [%d]", g->path,
                         half);
    float have[1024], want[1024];
    memcpy(have, ti->data, (size_t)half * sizeof(float));
    float factor = 1.0f;
    for (int i = 0; i < half; i++) factor = have[i] > factor ? have[i] : factor;
    if (factor == 1.0f) return ATOMC_OK; // all ones: no scaling
    static const float lows[] = {1.0f, 0.5f, 2.0f}, highs[] = {4.0f, 2.0f, 8.0f};
    static const int origs[] = {8192, 4096, 16384, 32768, 2048, 65536, 131072};
    for (size_t a = 0; a < sizeof lows / sizeof lows[0]; a++)
        for (size_t b = 0; b < sizeof highs / sizeof highs[0]; b++)
            for (size_t o = 0; o < sizeof origs / sizeof origs[0]; o++) {
                if (highs[b] <= lows[a]) continue;
                llama3_factors(c->rope.theta, c->rope.rotary_dim, factor, lows[a], highs[b], origs[o], want);
                bool ok = true;
                for (int i = 0; ok && i < half; i++) ok = fabsf(have[i] - want[i]) <= 1e-4f * want[i];
                if (!ok) continue;
                c->rope.scaling = ROPE_SCALING_LLAMA3;
                c->rope.factor = factor;
                c->rope.low_freq_factor = lows[a];
                c->rope.high_freq_factor = highs[b];
                c->rope.original_max_position = origs[o];
                return ATOMC_OK;
            }
    return error_set(err, ATOMC_ERR_UNSUPPORTED,
                     "%s: tensor 'rope_freqs.weight' holds RoPE frequency factors that match no llama3 "
                     "rope_scaling (factor %g); atomc cannot reproduce them", g->path, factor);
}

static atomc_status gguf_config(struct model_files *mf, struct error *err) {
    const struct gguf_file *g = mf->gguf;
    struct model_config *c = &mf->config;
    memset(c, 0, sizeof *c);
    const char *arch;
    atomc_status st = gguf_get_str(g, "general.architecture", &arch, NULL, err);
    if (st) return st;
    const struct gguf_arch_desc *ad = NULL;
    for (size_t i = 0; i < sizeof gguf_archs / sizeof gguf_archs[0]; i++)
        if (!strcmp(gguf_archs[i].gguf, arch)) ad = &gguf_archs[i];
    if (!ad)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: GGUF architecture '%s' is not supported (supported: llama, qwen3, qwen3moe)", g->path,
                         arch);
    c->arch = ad->arch;
    snprintf(c->architecture, sizeof c->architecture, "%s", ad->hf);
    TRY(arch_u32(g, arch, "block_count", true, &c->num_layers, err));
    if (c->num_layers < 1 || c->num_layers > MODEL_MAX_LAYERS)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %s.block_count = %d is outside [1, %d]", g->path, arch,
                         c->num_layers, MODEL_MAX_LAYERS);
    TRY(arch_u32(g, arch, "embedding_length", true, &c->hidden_size, err));
    TRY(arch_u32(g, arch, "feed_forward_length", true, &c->intermediate_size, err));
    TRY(arch_u32(g, arch, "attention.head_count", true, &c->num_heads, err));
    if (c->num_heads <= 0) return error_set(err, ATOMC_ERR_FORMAT, "%s: %s.attention.head_count is 0", g->path, arch);
    c->num_kv_heads = c->num_heads;
    TRY(arch_u32(g, arch, "attention.head_count_kv", false, &c->num_kv_heads, err));
    // head_dim: attention.key_length when present; else Qwen3's fixed 128 (as
    // transformers' Qwen3Config assumes), else hidden / heads.
    c->head_dim = (c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3_MOE) ? 128 : c->hidden_size / c->num_heads;
    TRY(arch_u32(g, arch, "attention.key_length", false, &c->head_dim, err));
    c->max_position_embeddings = 2048;
    TRY(arch_u32(g, arch, "context_length", false, &c->max_position_embeddings, err));
    c->rms_norm_eps = 1e-5f;
    TRY(arch_f32(g, arch, "attention.layer_norm_rms_epsilon", &c->rms_norm_eps, err));
    c->rope.theta = 10000.0f;
    c->rope.factor = 1.0f;
    c->rope.yarn_truncate = true;
    TRY(arch_f32(g, arch, "rope.freq_base", &c->rope.theta, err));
    c->rope.rotary_dim = c->head_dim;
    TRY(arch_u32(g, arch, "rope.dimension_count", false, &c->rope.rotary_dim, err));
    char key[160];
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    if (gguf_has_key(g, key)) {
        const char *type;
        TRY(gguf_get_str(g, key, &type, NULL, err));
        if (!strcmp(type, "linear")) c->rope.scaling = ROPE_SCALING_LINEAR;
        else if (!strcmp(type, "yarn")) c->rope.scaling = ROPE_SCALING_YARN;
        else if (strcmp(type, "none") != 0)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: %s = \"%s\" is not supported (none, linear, yarn)",
                             g->path, key, type);
        TRY(arch_f32(g, arch, "rope.scaling.factor", &c->rope.factor, err));
        TRY(arch_u32(g, arch, "rope.scaling.original_context_length", false, &c->rope.original_max_position, err));
        if (c->rope.scaling == ROPE_SCALING_YARN) {
            c->rope.beta_fast = 32.0f;
            c->rope.beta_slow = 1.0f;
            if (!c->rope.original_max_position) c->rope.original_max_position = c->max_position_embeddings;
        }
    }
    TRY(gguf_llama3_rope(g, c, err));
    const struct gguf_tensor_info *rf = gguf_find_tensor(g, "rope_freqs.weight");
    if (rf) mf->consumed[rf - g->tensors] = true; // read above: it became c->rope

    // MoE.
    TRY(arch_u32(g, arch, "expert_count", false, &c->num_experts, err));
    TRY(arch_u32(g, arch, "expert_used_count", false, &c->num_experts_per_tok, err));
    TRY(arch_u32(g, arch, "expert_feed_forward_length", false, &c->moe_intermediate_size, err));
    if (c->num_experts > 0) {
        if (!c->moe_intermediate_size) c->moe_intermediate_size = c->intermediate_size;
        c->decoder_sparse_step = 1;
        c->norm_topk_prob = true;
        c->routed_scaling_factor = 1.0f;
        snprintf(c->scoring_func, sizeof c->scoring_func, "softmax");
        if (c->arch == MODEL_ARCH_LLAMA) { // llama.cpp stores Mixtral as llama + experts
            c->arch = MODEL_ARCH_MIXTRAL;
            snprintf(c->architecture, sizeof c->architecture, "MixtralForCausalLM");
        }
    }

    c->qk_norm = c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3_MOE;
    snprintf(c->hidden_act, sizeof c->hidden_act, "silu");
    c->torch_dtype = DTYPE_F32;
    for (int l = 0; l < c->num_layers; l++) c->layer_types[l] = LAYER_ATTN_FULL;

    // Vocabulary: the tokenizer's token list (tokenizer.ggml.tokens; <arch>.vocab_size if
    // there is none). The embedding matrix may have more rows than tokens (checkpoints pad
    // the vocabulary to a multiple of 64/128 for the GEMMs); then vocab_size is the row count,
    // as HF's config would say, and the extra rows are never produced by the tokenizer.
    uint64_t n_tok = 0;
    if (gguf_has_key(g, "tokenizer.ggml.tokens")) {
        TRY(gguf_get_arr_info(g, "tokenizer.ggml.tokens", NULL, &n_tok, err));
    } else {
        int v = 0;
        TRY(arch_u32(g, arch, "vocab_size", true, &v, err));
        n_tok = (uint64_t)v;
    }
    if (n_tok == 0 || n_tok > INT32_MAX)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: vocabulary size %" PRIu64 " is invalid", g->path, n_tok);
    const struct gguf_tensor_info *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor 'token_embd.weight' is missing", g->path);
    if (emb->ndim != 2 || emb->ne[0] < (int64_t)n_tok || emb->ne[0] > INT32_MAX || emb->ne[1] != c->hidden_size)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: tensor 'token_embd.weight' has shape [%" PRId64 ", %" PRId64 "], expected [>= %" PRIu64
                         ", %d] (%" PRIu64 " tokens in tokenizer.ggml.tokens, %s.embedding_length %d)",
                         g->path, emb->ne[0], emb->ndim > 1 ? emb->ne[1] : 0, n_tok, c->hidden_size, n_tok, arch,
                         c->hidden_size);
    c->vocab_size = (int)emb->ne[0];
    c->tie_word_embeddings = gguf_find_tensor(g, "output.weight") == NULL;
    // Biases on q/k/v (Qwen2-style) show up as tensors.
    c->attention_bias = gguf_find_tensor(g, "blk.0.attn_q.bias") != NULL;
    c->attention_out_bias = gguf_find_tensor(g, "blk.0.attn_output.bias") != NULL;

    // Special tokens.
    c->bos_token_id = -1;
    c->pad_token_id = -1;
    static const char *eos_keys[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id"};
    for (size_t i = 0; i < 3; i++) {
        if (!gguf_has_key(g, eos_keys[i])) continue;
        uint32_t id;
        TRY(gguf_get_u32(g, eos_keys[i], &id, err));
        bool dup = false;
        for (int j = 0; j < c->n_eos; j++) dup |= c->eos_token_ids[j] == (int)id;
        if (!dup && c->n_eos < MODEL_MAX_EOS) c->eos_token_ids[c->n_eos++] = (int)id;
    }
    if (gguf_has_key(g, "tokenizer.ggml.bos_token_id")) {
        uint32_t id;
        TRY(gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id, err));
        c->bos_token_id = (int)id;
    }
    if (gguf_has_key(g, "tokenizer.ggml.padding_token_id")) {
        uint32_t id;
        TRY(gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &id, err));
        c->pad_token_id = (int)id;
    }
    // llama.cpp's converter permutes q/k rows for the LLaMA family only.
    mf->gguf_permuted_qk = !strcmp(arch, "llama");
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------
// Open.

// A quantization config kept beside config.json rather than in it: AutoGPTQ's
// quantize_config.json (no quant_method: GPTQ) or ModelOpt's hf_quant_config.json.
static atomc_status read_quant_side_file(struct model_files *mf, struct error *err) {
    static const struct {
        const char *file;
        enum quant_method method;
    } side[] = {{"quantize_config.json", QUANT_METHOD_GPTQ}, {"hf_quant_config.json", QUANT_METHOD_MODELOPT}};
    for (size_t i = 0; i < sizeof side / sizeof side[0]; i++) {
        char *p = path_join(mf->path, side[i].file);
        atomc_status st = ATOMC_OK;
        if (file_exists(p)) {
            char *text = NULL;
            st = file_read_all(p, &text, NULL, err);
            if (!st) st = model_config_parse_quant_file(&mf->config, text, p, side[i].file, side[i].method, err);
            free(text);
        }
        free(p);
        if (st || mf->config.quant.present) return st;
    }
    return ATOMC_OK;
}

static atomc_status open_hf(struct model_files *mf, struct error *err) {
    mf->kind = MODEL_FILES_HF;
    char *cfg_path = path_join(mf->path, "config.json");
    char *text = NULL;
    atomc_status st = file_read_all(cfg_path, &text, NULL, err);
    if (st) {
        error_set(err, ATOMC_ERR_IO, "%s: no readable config.json in this model directory", mf->path);
        free(cfg_path);
        return st;
    }
    st = model_config_parse_json(&mf->config, text, cfg_path, err);
    free(text);
    if (!st) {
        char *gen = path_join(mf->path, "generation_config.json");
        if (file_exists(gen)) {
            st = file_read_all(gen, &text, NULL, err);
            if (!st) st = model_config_merge_generation_config(&mf->config, text, gen, err);
            free(text);
            mf->has_generation_config = !st;
        }
        free(gen);
    }
    if (!st) st = model_config_validate(&mf->config, cfg_path, err);
    free(cfg_path);
    if (!st && !mf->config.quant.present) st = read_quant_side_file(mf, err);
    if (st) return st;
    char *tok = path_join(mf->path, "tokenizer.json");
    if (file_exists(tok)) mf->tokenizer_path = tok;
    else free(tok);
    if ((st = safetensors_set_open(&mf->st, mf->path, err))) return st;
    mf->n_tensors = mf->st->n_entries;
    mf->consumed = xcalloc(mf->n_tensors ? mf->n_tensors : 1, sizeof *mf->consumed);
    return ATOMC_OK;
}

static atomc_status open_gguf(struct model_files *mf, struct error *err) {
    mf->kind = MODEL_FILES_GGUF;
    atomc_status st = gguf_open(&mf->gguf, mf->path, err);
    if (st) return st;
    mf->n_tensors = (size_t)mf->gguf->n_tensors;
    mf->consumed = xcalloc(mf->n_tensors ? mf->n_tensors : 1, sizeof *mf->consumed);
    if ((st = gguf_config(mf, err))) return st;
    mf->tokenizer_path = xstrdup(mf->path);
    return model_config_validate(&mf->config, mf->path, err);
}

static bool has_gguf_magic(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    char magic[4] = {0};
    size_t n = fread(magic, 1, 4, f);
    fclose(f);
    return n == 4 && memcmp(magic, GGUF_MAGIC, 4) == 0;
}

atomc_status model_files_open(struct model_files **out, const char *path, struct error *err) {
    *out = NULL;
    struct model_files *mf = xcalloc(1, sizeof *mf);
    mf->path = xstrdup(path);
    atomc_status st;
    if (dir_exists(path)) st = open_hf(mf, err);
    else if (!file_exists(path)) st = error_set(err, ATOMC_ERR_IO, "%s: no such file or directory", path);
    else if (has_gguf_magic(path)) st = open_gguf(mf, err);
    else
        st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                       "%s: not a model: expected an HF model directory (config.json + safetensors) or a .gguf file",
                       path);
    if (st) {
        model_files_close(mf);
        return st;
    }
    *out = mf;
    return ATOMC_OK;
}

atomc_status model_files_open_tensors(struct model_files **out, const char *dir, struct error *err) {
    *out = NULL;
    if (!dir_exists(dir)) return error_set(err, ATOMC_ERR_IO, "%s: no such directory", dir);
    struct model_files *mf = xcalloc(1, sizeof *mf);
    mf->path = xstrdup(dir);
    mf->kind = MODEL_FILES_HF;
    atomc_status st = safetensors_set_open(&mf->st, dir, err);
    if (st) {
        model_files_close(mf);
        return st;
    }
    mf->n_tensors = mf->st->n_entries;
    mf->consumed = xcalloc(mf->n_tensors ? mf->n_tensors : 1, sizeof *mf->consumed);
    *out = mf;
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------
// Tensors.

const char *model_files_source(const struct model_files *mf, const char *hf_name) {
    if (mf->kind == MODEL_FILES_GGUF) return mf->gguf->path;
    const struct safetensors_entry *e = safetensors_set_find(mf->st, hf_name);
    if (e) return e->file->path;
    return mf->st->index_path ? mf->st->index_path : (mf->st->n_files ? mf->st->files[0]->path : mf->path);
}

bool model_files_has_tensor(const struct model_files *mf, const char *hf_name) {
    if (mf->kind == MODEL_FILES_HF) return safetensors_set_find(mf->st, hf_name) != NULL;
    struct gguf_mapping m;
    if (!map_hf_to_gguf(hf_name, &m)) return gguf_find_tensor(mf->gguf, hf_name) != NULL;
    const struct gguf_tensor_info *t = gguf_find_tensor(mf->gguf, m.name);
    return t && (m.expert < 0 || (t->ndim == 3 && m.expert < t->ne[0]));
}

// Undoes llama.cpp's q/k row permutation. In HF order the rows of one head are
// [half 0: i = 0..hd/2-1 | half 1: i = 0..hd/2-1]; the converter interleaved them so
// GGUF row 2*i + s of a head holds HF row s*hd/2 + i.
static atomc_status unpermute_rows(struct model_files *mf, const char *hf_name, const char *gguf_name,
                                   const struct tensor *src, int n_head, struct tensor *out, struct error *err) {
    const struct tensor *cached = owned_find(mf, hf_name);
    if (cached) {
        *out = *cached;
        return ATOMC_OK;
    }
    int64_t rows = src->ne[0];
    size_t row_bytes = src->ndim == 1 ? dtype_block_bytes(src->dtype) : dtype_row_bytes(src->dtype, tensor_cols(src));
    if (src->ndim == 1) CHECK(dtype_block_elems(src->dtype) == 1); // biases are plain floats
    if (src->ndim > 2 || n_head <= 0 || rows % n_head != 0 || (rows / n_head) % 2 != 0)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: tensor '%s' (%s) with %" PRId64 " rows cannot hold %d heads of even size", mf->gguf->path,
                         gguf_name, hf_name, rows, n_head);
    int64_t hd = rows / n_head, half = hd / 2;
    unsigned char *buf = malloc((size_t)rows * row_bytes);
    if (!buf)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory un-permuting tensor '%s'", mf->gguf->path,
                         gguf_name);
    const unsigned char *s = src->data;
    for (int64_t h = 0; h < n_head; h++)
        for (int64_t sidx = 0; sidx < 2; sidx++)
            for (int64_t i = 0; i < half; i++) {
                int64_t hf_row = h * hd + sidx * half + i, gg_row = h * hd + 2 * i + sidx;
                memcpy(buf + hf_row * row_bytes, s + gg_row * row_bytes, row_bytes);
            }
    *out = *owned_add(mf, hf_name, buf, *src);
    return ATOMC_OK;
}

static atomc_status get_gguf(struct model_files *mf, const char *hf_name, struct tensor *out, struct error *err) {
    struct gguf_mapping m;
    const char *gname = hf_name;
    if (map_hf_to_gguf(hf_name, &m)) gname = m.name;
    else m.expert = -1, m.flags = 0;
    const struct gguf_tensor_info *ti = gguf_find_tensor(mf->gguf, gname);
    if (!ti) {
        if (!strcmp(hf_name, "lm_head.weight"))
            return error_set(err, ATOMC_ERR_NOT_FOUND,
                             "%s: tensor 'lm_head.weight' (GGUF 'output.weight') not found: the embeddings are tied",
                             mf->gguf->path);
        if (gname != hf_name)
            return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: missing tensor '%s' (GGUF name '%s')", mf->gguf->path,
                             hf_name, gname);
        return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: missing tensor '%s' (no GGUF equivalent known)",
                         mf->gguf->path, hf_name);
    }
    struct tensor t;
    atomc_status st = gguf_get_tensor(mf->gguf, gname, &t, err);
    if (st) {
        error_prefix(err, "%s (GGUF '%s'): ", hf_name, gname);
        return st;
    }
    if (m.expert >= 0) {
        if (t.ndim != 3 || m.expert >= t.ne[0])
            return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: missing tensor '%s': '%s' has no expert %d", mf->gguf->path,
                             hf_name, gname, m.expert);
        size_t bytes = tensor_bytes(&t) / (size_t)t.ne[0];
        *out = tensor_2d((char *)t.data + bytes * (size_t)m.expert, t.dtype, t.ne[1], t.ne[2]);
        return ATOMC_OK;
    }
    if (mf->gguf_permuted_qk && (m.flags & (MAP_PERMUTE_Q | MAP_PERMUTE_K))) {
        int n_head = (m.flags & MAP_PERMUTE_Q) ? mf->config.num_heads : mf->config.num_kv_heads;
        return unpermute_rows(mf, hf_name, gname, &t, n_head, out, err);
    }
    *out = t;
    return ATOMC_OK;
}

// Files only promise the alignment their writer gave them (safetensors: none beyond the
// header's padding; GGUF: general.alignment, which may be 1). Kernels may load elements
// through typed pointers, so a plain-typed view that is not aligned to its element size
// is copied once into an owned (malloc-aligned) buffer. Quantised blocks are byte-addressed.
static atomc_status ensure_aligned(struct model_files *mf, const char *hf_name, struct tensor *t, struct error *err) {
    size_t align = dtype_block_elems(t->dtype) == 1 ? dtype_block_bytes(t->dtype) : 1;
    if (align <= 1 || (uintptr_t)t->data % align == 0) return ATOMC_OK;
    char key[300];
    snprintf(key, sizeof key, "%s#aligned", hf_name);
    const struct tensor *cached = owned_find(mf, key);
    if (cached) {
        *t = *cached;
        return ATOMC_OK;
    }
    size_t bytes = tensor_bytes(t);
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory aligning tensor '%s'",
                         model_files_source(mf, hf_name), hf_name);
    memcpy(buf, t->data, bytes);
    *t = *owned_add(mf, key, buf, *t);
    return ATOMC_OK;
}

// The index in mf->consumed of the files' tensor that serves hf_name, or -1.
static int64_t tensor_index(const struct model_files *mf, const char *hf_name) {
    if (mf->kind == MODEL_FILES_HF) {
        const struct safetensors_entry *e = safetensors_set_find(mf->st, hf_name);
        return e ? e - mf->st->entries : -1;
    }
    struct gguf_mapping m;
    const struct gguf_tensor_info *ti = gguf_find_tensor(mf->gguf, map_hf_to_gguf(hf_name, &m) ? m.name : hf_name);
    return ti ? ti - mf->gguf->tensors : -1;
}

bool model_files_mark_consumed(struct model_files *mf, const char *hf_name) {
    int64_t i = tensor_index(mf, hf_name);
    if (i < 0) return false;
    mf->consumed[i] = true;
    return true;
}

atomc_status model_files_get_tensor(struct model_files *mf, const char *hf_name, struct tensor *out,
                                    struct error *err) {
    atomc_status st;
    if (mf->kind == MODEL_FILES_GGUF) {
        st = get_gguf(mf, hf_name, out, err);
    } else {
        const char *file;
        st = safetensors_set_get_tensor(mf->st, hf_name, out, &file, err);
        if (st == ATOMC_ERR_NOT_FOUND)
            return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: missing tensor '%s'", model_files_source(mf, hf_name),
                             hf_name);
    }
    if (st) return st;
    model_files_mark_consumed(mf, hf_name);
    return ensure_aligned(mf, hf_name, out, err);
}

static bool class_accepts(enum tensor_class c, enum dtype d) {
    switch (c) {
    case TENSOR_CLASS_ANY: return true;
    case TENSOR_CLASS_FLOAT: return d == DTYPE_F32 || d == DTYPE_F16 || d == DTYPE_BF16;
    case TENSOR_CLASS_WEIGHT:
        return d == DTYPE_F32 || d == DTYPE_F16 || d == DTYPE_BF16 || dtype_block_elems(d) > 1 || d == DTYPE_FP8_E4M3;
    case TENSOR_CLASS_INT: return d == DTYPE_I32 || d == DTYPE_I64 || d == DTYPE_U8;
    }
    return false;
}

static const char *class_name(enum tensor_class c) {
    switch (c) {
    case TENSOR_CLASS_ANY: return "any";
    case TENSOR_CLASS_FLOAT: return "a float dtype (F32, F16, BF16)";
    case TENSOR_CLASS_WEIGHT: return "a weight dtype (F32, F16, BF16, F8_E4M3, Q8_0, Q4_0, Q4_1)";
    case TENSOR_CLASS_INT: return "an integer dtype";
    }
    return "?";
}

static void shape_str(char *buf, size_t cap, const int64_t *ne, int ndim) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++) n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, i ? ", " : "", ne[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

atomc_status model_files_expect_shape(struct model_files *mf, const char *hf_name, enum tensor_class cls,
                                      const int64_t *shape, int ndim, struct tensor *out, struct error *err) {
    struct tensor t;
    atomc_status st = model_files_get_tensor(mf, hf_name, &t, err);
    if (st) return st;
    const char *file = model_files_source(mf, hf_name);
    bool ok = t.ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t.ne[i] == shape[i];
    if (!ok) {
        char have[128], want[128];
        shape_str(have, sizeof have, t.ne, t.ndim);
        shape_str(want, sizeof want, shape, ndim);
        return error_set(err, ATOMC_ERR_FORMAT, "file %s: tensor %s has shape %s, expected %s", file, hf_name, have,
                         want);
    }
    if (!class_accepts(cls, t.dtype))
        return error_set(err, ATOMC_ERR_FORMAT, "file %s: tensor %s has dtype %s, expected %s", file, hf_name,
                         dtype_name(t.dtype), class_name(cls));
    *out = t;
    return ATOMC_OK;
}

atomc_status model_files_get_tensor_slice(struct model_files *mf, const char *hf_name, int dim, int64_t start,
                                          int64_t len, struct tensor *out, struct error *err) {
    struct tensor t;
    atomc_status st = model_files_get_tensor(mf, hf_name, &t, err);
    if (st) return st;
    const char *file = model_files_source(mf, hf_name);
    if (dim < 0 || dim >= t.ndim || start < 0 || len <= 0 || start > t.ne[dim] - len)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "file %s: tensor %s: slice [%" PRId64 ", %" PRId64 ") of dim %d is out of range", file, hf_name,
                         start, start + len, dim);
    if (dim == 0) { // outermost: contiguous, a view
        size_t inner = tensor_bytes(&t) / (size_t)t.ne[0];
        *out = t;
        out->ne[0] = len;
        out->data = (char *)t.data + inner * (size_t)start;
        return ATOMC_OK;
    }
    if (dim != t.ndim - 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "file %s: tensor %s: slicing dim %d of %d is not supported", file,
                         hf_name, dim, t.ndim);
    int be = dtype_block_elems(t.dtype);
    if (start % be || len % be)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "file %s: tensor %s: column slice [%" PRId64 ", %" PRId64 ") does not fall on %s blocks of %d",
                         file, hf_name, start, start + len, dtype_name(t.dtype), be);
    char key[300];
    snprintf(key, sizeof key, "%s[:, %" PRId64 ":%" PRId64 "]", hf_name, start, start + len);
    const struct tensor *cached = owned_find(mf, key);
    if (cached) {
        *out = *cached;
        return ATOMC_OK;
    }
    int64_t rows = tensor_rows(&t);
    size_t src_row = dtype_row_bytes(t.dtype, tensor_cols(&t)), dst_row = dtype_row_bytes(t.dtype, len);
    size_t off = dtype_row_bytes(t.dtype, start);
    unsigned char *buf = malloc((size_t)rows * dst_row);
    if (!buf) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "file %s: tensor %s: out of memory slicing", file, hf_name);
    for (int64_t r = 0; r < rows; r++) memcpy(buf + r * dst_row, (const char *)t.data + r * src_row + off, dst_row);
    struct tensor s = t;
    s.ne[t.ndim - 1] = len;
    *out = *owned_add(mf, key, buf, s);
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------
// Consumption.

static bool ends_with_str(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

// Whether name belongs to a multi-token-prediction layer: model.layers.<l>.* with l in
// [num_layers, num_layers + num_nextn_predict_layers) (GLM-4-MoE, DeepSeek-V3 store them so).
static bool is_mtp_tensor(const struct model_files *mf, const char *name) {
    const struct model_config *c = &mf->config;
    if (c->num_nextn_predict_layers <= 0 || strncmp(name, "model.layers.", 13) != 0) return false;
    char *end = NULL;
    long l = strtol(name + 13, &end, 10);
    return end != name + 13 && *end == '.' && l >= c->num_layers && l < c->num_layers + c->num_nextn_predict_layers;
}

// Tensors a checkpoint may carry that the engine leaves unread by design, and why.
static const char *unused_by_design(const struct model_files *mf, const char *name) {
    if (is_mtp_tensor(mf, name))
        return "a multi-token-prediction layer (num_nextn_predict_layers): only speculative method mtp reads it "
               "(src/model/mtp.c)";
    if (mf->kind == MODEL_FILES_HF && ends_with_str(name, "rotary_emb.inv_freq"))
        return "a RoPE buffer some HF checkpoints save; atomc computes it from the RoPE config";
    if (mf->kind == MODEL_FILES_HF && mf->config.tie_word_embeddings && !strcmp(name, "lm_head.weight"))
        return "tie_word_embeddings: transformers ties lm_head to the embeddings and ignores this copy";
    return NULL;
}

atomc_status model_files_check_consumed(const struct model_files *mf, struct error *err) {
    size_t n_unread = 0, n_mtp = 0;
    const char *first = NULL, *first_file = NULL, *first_dtype = NULL, *why = "";
    for (size_t i = 0; i < mf->n_tensors; i++) {
        if (mf->consumed[i]) continue;
        const char *name, *file, *dtype;
        if (mf->kind == MODEL_FILES_HF) {
            const struct safetensors_entry *e = &mf->st->entries[i];
            name = e->name, file = e->file->path, dtype = e->tensor->dtype_name;
        } else {
            const struct gguf_tensor_info *t = &mf->gguf->tensors[i];
            name = t->name, file = mf->gguf->path, dtype = ggml_type_name(t->ggml_type);
        }
        n_mtp += !mf->consumed[i] && is_mtp_tensor(mf, name);
        if (unused_by_design(mf, name)) continue;
        if (!first || strcmp(name, first) < 0) first = name, first_file = file, first_dtype = dtype;
        n_unread++;
    }
    // Shard tensors the index does not list are invisible to the model: never read either.
    for (size_t f = 0; mf->kind == MODEL_FILES_HF && mf->st->index_path && f < mf->st->n_files; f++) {
        const struct safetensors_file *sf = mf->st->files[f];
        for (size_t i = 0; i < sf->n_tensors; i++) {
            const struct safetensors_entry *e = safetensors_set_find(mf->st, sf->tensors[i].name);
            if (e && e->tensor == &sf->tensors[i]) continue;
            if (!first || strcmp(sf->tensors[i].name, first) < 0) {
                first = sf->tensors[i].name, first_file = sf->path, first_dtype = sf->tensors[i].dtype_name;
                why = ", not listed in the index";
            }
            n_unread++;
        }
    }
    if (n_mtp)
        LOG_INFO("skipped %zu tensors of %d multi-token-prediction layer%s (model.layers.%d.*%s): MTP speculative "
                 "decoding is not implemented", n_mtp, mf->config.num_nextn_predict_layers,
                 mf->config.num_nextn_predict_layers == 1 ? "" : "s", mf->config.num_layers,
                 mf->config.num_nextn_predict_layers == 1 ? "" : " and on");
    if (n_unread == 0) return ATOMC_OK;
    return error_set(err, ATOMC_ERR_UNSUPPORTED,
                     "%s: tensor '%s' (%s%s) is never read by the %s loader (%zu unread tensor%s in all); refusing "
                     "to load, since an ignored scale, zero point or other tensor silently gives wrong outputs",
                     first_file, first, first_dtype, why, mf->config.architecture, n_unread, n_unread == 1 ? "" : "s");
}
