// HF config.json -> struct model_config (see config.h).
//
// Parsing rules, in brief:
// - The architecture comes from "architectures"[0] (falling back to "model_type" when the
//   list is absent); unknown names are ATOMC_ERR_UNSUPPORTED listing what is supported.
// - Keys that must exist (hidden_size, num_hidden_layers, num_attention_heads,
//   vocab_size, intermediate_size) are ATOMC_ERR_FORMAT when absent; a key present with
//   the wrong JSON type is ATOMC_ERR_FORMAT naming the key. JSON null means "absent".
// - Defaults follow the transformers config classes of each architecture.
// - RoPE: classic `rope_theta` + `rope_scaling` ({"type"|"rope_type", factor, ...}) or the
//   transformers-5 `rope_parameters` (same keys plus rope_theta; possibly one object per
//   layer type, e.g. {"full_attention": {...}, "sliding_attention": {...}}; we take
//   full_attention's and warn if the others differ, since one rope_config is kept).
#include "model/config.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/check.h"
#include "common/log.h"

static const struct {
    const char *name;
    enum model_arch arch;
} arch_names[] = {
    {"LlamaForCausalLM", MODEL_ARCH_LLAMA},
    {"MistralForCausalLM", MODEL_ARCH_LLAMA},
    {"Qwen3ForCausalLM", MODEL_ARCH_QWEN3},
    {"Qwen3MoeForCausalLM", MODEL_ARCH_QWEN3_MOE},
    {"MixtralForCausalLM", MODEL_ARCH_MIXTRAL},
    {"DeepseekV3ForCausalLM", MODEL_ARCH_DEEPSEEK_V3},
    {"DeepseekV2ForCausalLM", MODEL_ARCH_DEEPSEEK_V2},
    {"GlmMoeDsaForCausalLM", MODEL_ARCH_GLM_MOE_DSA},
    {"DeepseekV32ForCausalLM", MODEL_ARCH_DEEPSEEK_V32},
    {"GptOssForCausalLM", MODEL_ARCH_GPT_OSS},
    {"Glm4MoeForCausalLM", MODEL_ARCH_GLM4_MOE},
    {"Qwen3NextForCausalLM", MODEL_ARCH_QWEN3_NEXT},
    {"Qwen3_5MoeForCausalLM", MODEL_ARCH_QWEN3_5_MOE},
    {"MiMoV2FlashForCausalLM", MODEL_ARCH_MIMO_V2_FLASH},
};

// config.json "model_type" values: the architecture when "architectures" is missing; otherwise
// model_type must be one of these and map to the same architecture family (check_model_type).
static const struct {
    const char *model_type;
    const char *architecture;
} model_types[] = {
    {"llama", "LlamaForCausalLM"},
    {"mistral", "MistralForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},
    {"qwen3_moe", "Qwen3MoeForCausalLM"},
    {"mixtral", "MixtralForCausalLM"},
    {"deepseek_v3", "DeepseekV3ForCausalLM"},
    {"deepseek_v2", "DeepseekV2ForCausalLM"},
    {"gpt_oss", "GptOssForCausalLM"},
    {"glm4_moe", "Glm4MoeForCausalLM"},
    {"qwen3_next", "Qwen3NextForCausalLM"},
    {"qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"},
    {"qwen3_5_moe", "Qwen3_5MoeForCausalLM"},
    {"kimi_k2", "DeepseekV3ForCausalLM"}, // Kimi-K2: DeepSeek-V3's architecture under its own model_type
    {"glm_moe_dsa", "GlmMoeDsaForCausalLM"}, {"deepseek_v32", "DeepseekV32ForCausalLM"},
    {"mimo_v2_flash", "MiMoV2FlashForCausalLM"},
};

#define N_ARCH_NAMES (sizeof arch_names / sizeof arch_names[0])

enum model_arch model_arch_from_name(const char *name) {
    for (size_t i = 0; i < N_ARCH_NAMES; i++)
        if (strcmp(arch_names[i].name, name) == 0) return arch_names[i].arch;
    return MODEL_ARCH_UNKNOWN;
}

const char *model_arch_name(enum model_arch a) {
    for (size_t i = 0; i < N_ARCH_NAMES; i++)
        if (arch_names[i].arch == a) return arch_names[i].name;
    return "unknown";
}

static void supported_list(char *buf, size_t cap) {
    buf[0] = '\0';
    size_t n = 0;
    for (size_t i = 0; i < N_ARCH_NAMES && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? ", " : "", arch_names[i].name);
}

bool model_config_layer_is_moe(const struct model_config *c, int l) {
    if (c->num_experts <= 0 || l < 0 || l >= c->num_layers) return false;
    if (l < MODEL_MAX_LAYERS && c->mlp_only_layers[l]) return false;
    if (l < c->first_k_dense_replace) return false;
    if (c->moe_layer_freq > 1) return l % c->moe_layer_freq == 0; // DeepSeek's rule
    int step = c->decoder_sparse_step > 0 ? c->decoder_sparse_step : 1;
    return (l + 1) % step == 0;
}

// ---------------------------------------------------------------------------------
// Typed JSON getters. Each returns ATOMC_OK and leaves *out untouched when the key is
// absent or null (the caller pre-sets the default); `required` turns absence into an
// error.

struct ctx {
    const char *src;
    struct error *err;
};

static const char *json_type_word(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

static const json_t *jget(const json_t *obj, const char *key) {
    const json_t *v = json_object_get(obj, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

static atomc_status missing(struct ctx *x, const char *key) {
    return error_set(x->err, ATOMC_ERR_FORMAT, "%s: required key '%s' is missing", x->src, key);
}

static atomc_status bad_type(struct ctx *x, const char *key, const json_t *v, const char *want) {
    return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' must be %s, got %s", x->src, key, want,
                     json_type_word(v));
}

// Integer; a real with an integral value (4096.0) is accepted. Range [lo, hi]. `label`
// names the key in messages (its path when nested, e.g. "quantization_config.bits").
static atomc_status get_int_at(struct ctx *x, const json_t *o, const char *key, const char *label, bool required,
                               long long lo, long long hi, int *out) {
    const json_t *v = jget(o, key);
    if (!v) return required ? missing(x, label) : ATOMC_OK;
    long long n;
    if (json_is_integer(v)) {
        n = json_integer_value(v);
    } else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
               fabs(json_real_value(v)) < 9e15) {
        n = (long long)json_real_value(v);
    } else {
        return bad_type(x, label, v, "an integer");
    }
    if (n < lo || n > hi)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' = %lld is out of range [%lld, %lld]", x->src, label, n,
                         lo, hi);
    *out = (int)n;
    return ATOMC_OK;
}

static atomc_status get_int(struct ctx *x, const json_t *o, const char *key, bool required, long long lo, long long hi,
                            int *out) {
    return get_int_at(x, o, key, key, required, lo, hi, out);
}

static atomc_status get_float(struct ctx *x, const json_t *o, const char *key, bool required, float *out) {
    const json_t *v = jget(o, key);
    if (!v) return required ? missing(x, key) : ATOMC_OK;
    if (!json_is_number(v)) return bad_type(x, key, v, "a number");
    double d = json_number_value(v);
    if (!isfinite(d) || fabs(d) > 3.0e38)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' = %g is not a finite float", x->src, key, d);
    *out = (float)d;
    return ATOMC_OK;
}

static atomc_status get_bool_at(struct ctx *x, const json_t *o, const char *key, const char *label, bool *out) {
    const json_t *v = jget(o, key);
    if (!v) return ATOMC_OK;
    if (!json_is_boolean(v)) return bad_type(x, label, v, "a boolean");
    *out = json_is_true(v);
    return ATOMC_OK;
}

static atomc_status get_bool(struct ctx *x, const json_t *o, const char *key, bool *out) {
    return get_bool_at(x, o, key, key, out);
}

// A string value (not a key lookup) into out[cap]; too long is FORMAT naming `label`.
static atomc_status copy_str(struct ctx *x, const json_t *v, const char *label, char *out, size_t cap) {
    if (!json_is_string(v)) return bad_type(x, label, v, "a string");
    const char *s = json_string_value(v);
    if (strlen(s) >= cap)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' value \"%.40s\" is too long (max %zu bytes)", x->src,
                         label, s, cap - 1);
    snprintf(out, cap, "%s", s);
    return ATOMC_OK;
}

static atomc_status get_str_at(struct ctx *x, const json_t *o, const char *key, const char *label, char *out,
                               size_t cap) {
    const json_t *v = jget(o, key);
    if (!v) return ATOMC_OK;
    return copy_str(x, v, label, out, cap);
}

static atomc_status get_str(struct ctx *x, const json_t *o, const char *key, char *out, size_t cap) {
    return get_str_at(x, o, key, key, out, cap);
}

// eos_token_id: int or list of ints (null = absent). Replaces ids/n when present.
static atomc_status get_token_ids(struct ctx *x, const json_t *o, const char *key, int *ids, int *n) {
    const json_t *v = jget(o, key);
    if (!v) return ATOMC_OK;
    if (json_is_integer(v)) {
        long long t = json_integer_value(v);
        if (t < 0 || t > INT32_MAX)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' = %lld is not a token id", x->src, key, t);
        ids[0] = (int)t;
        *n = 1;
        return ATOMC_OK;
    }
    if (!json_is_array(v)) return bad_type(x, key, v, "an integer or a list of integers");
    size_t len = json_array_size(v);
    if (len > MODEL_MAX_EOS)
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: key '%s' lists %zu ids (at most %d supported)", x->src,
                         key, len, MODEL_MAX_EOS);
    for (size_t i = 0; i < len; i++) {
        const json_t *e = json_array_get(v, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' element %zu must be a token id, got %s", x->src,
                             key, i, json_type_word(e));
        ids[i] = (int)json_integer_value(e);
    }
    *n = (int)len;
    return ATOMC_OK;
}

#define TRY(expr)                         \
    do {                                  \
        atomc_status st_ = (expr);        \
        if (st_ != ATOMC_OK) return st_;  \
    } while (0)

// ---------------------------------------------------------------------------------
// RoPE.

// Reads one rope parameter object (the classic rope_scaling or a transformers-5
// rope_parameters entry). `what` is its key for messages.
static atomc_status parse_rope_object(struct ctx *x, const json_t *r, const char *what, struct rope_config *rope,
                                      float *partial_rotary) {
    if (!json_is_object(r)) return bad_type(x, what, r, "an object");
    char type[32] = "";
    const json_t *tv = jget(r, "rope_type");
    const char *tkey = "rope_type";
    if (!tv) {
        tv = jget(r, "type");
        tkey = "type";
    }
    if (tv) {
        if (!json_is_string(tv)) return bad_type(x, tkey, tv, "a string");
        snprintf(type, sizeof type, "%s", json_string_value(tv));
    }
    TRY(get_float(x, r, "rope_theta", false, &rope->theta));
    TRY(get_float(x, r, "partial_rotary_factor", false, partial_rotary));
    if (type[0] == '\0' || strcmp(type, "default") == 0) {
        rope->scaling = ROPE_SCALING_NONE;
        return ATOMC_OK;
    }
    rope->factor = 1.0f;
    TRY(get_float(x, r, "factor", false, &rope->factor));
    if (strcmp(type, "linear") == 0) {
        rope->scaling = ROPE_SCALING_LINEAR;
        TRY(get_float(x, r, "factor", true, &rope->factor));
    } else if (strcmp(type, "dynamic") == 0) {
        rope->scaling = ROPE_SCALING_DYNAMIC;
        TRY(get_float(x, r, "factor", true, &rope->factor));
        TRY(get_int(x, r, "original_max_position_embeddings", false, 1, INT32_MAX, &rope->original_max_position));
    } else if (strcmp(type, "llama3") == 0) {
        rope->scaling = ROPE_SCALING_LLAMA3;
        TRY(get_float(x, r, "factor", true, &rope->factor));
        TRY(get_float(x, r, "low_freq_factor", true, &rope->low_freq_factor));
        TRY(get_float(x, r, "high_freq_factor", true, &rope->high_freq_factor));
        TRY(get_int(x, r, "original_max_position_embeddings", true, 1, INT32_MAX, &rope->original_max_position));
        if (rope->high_freq_factor <= rope->low_freq_factor)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: %s: high_freq_factor (%g) must exceed low_freq_factor (%g)",
                             x->src, what, rope->high_freq_factor, rope->low_freq_factor);
    } else if (strcmp(type, "yarn") == 0) {
        rope->scaling = ROPE_SCALING_YARN;
        TRY(get_float(x, r, "factor", true, &rope->factor));
        rope->beta_fast = 32.0f;
        rope->beta_slow = 1.0f;
        TRY(get_float(x, r, "beta_fast", false, &rope->beta_fast));
        TRY(get_float(x, r, "beta_slow", false, &rope->beta_slow));
        TRY(get_float(x, r, "mscale", false, &rope->mscale));
        TRY(get_float(x, r, "mscale_all_dim", false, &rope->mscale_all_dim));
        TRY(get_float(x, r, "attention_factor", false, &rope->attention_factor));
        TRY(get_bool(x, r, "truncate", &rope->yarn_truncate));
        TRY(get_int(x, r, "original_max_position_embeddings", false, 1, INT32_MAX, &rope->original_max_position));
    } else {
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED,
                         "%s: %s.%s '%s' is not supported (supported: default, linear, dynamic, llama3, yarn)", x->src,
                         what, tkey, type);
    }
    if (!(rope->factor > 0.0f))
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: %s.factor must be positive, got %g", x->src, what,
                         rope->factor);
    return ATOMC_OK;
}

static bool rope_equal(const struct rope_config *a, const struct rope_config *b) {
    return a->theta == b->theta && a->scaling == b->scaling && a->factor == b->factor;
}

static atomc_status parse_rope(struct ctx *x, const json_t *root, struct model_config *c, float *partial_rotary,
                               float *partial_sliding) {
    struct rope_config *rope = &c->rope;
    rope->theta = 10000.0f;
    rope->factor = 1.0f;
    rope->yarn_truncate = true;
    TRY(get_float(x, root, "rope_theta", false, &rope->theta));
    const json_t *rp = jget(root, "rope_parameters");
    if (rp) {
        if (!json_is_object(rp)) return bad_type(x, "rope_parameters", rp, "an object");
        // Per layer type: every value is an object.
        bool per_layer = json_object_size(rp) > 0;
        const char *k;
        const json_t *v;
        json_object_foreach((json_t *)rp, k, v) {
            if (!json_is_object(v)) per_layer = false;
        }
        if (!per_layer && c->arch == MODEL_ARCH_MIMO_V2_FLASH)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'rope_parameters' must hold one object per layer type "
                             "(\"full_attention\", \"sliding_attention\") for %s", x->src, c->architecture);
        if (!per_layer) return parse_rope_object(x, rp, "rope_parameters", rope, partial_rotary);
        const json_t *full = jget(rp, "full_attention");
        const char *chosen = "full_attention";
        if (!full) {
            void *it = json_object_iter((json_t *)rp);
            chosen = json_object_iter_key(it);
            full = json_object_iter_value(it);
        }
        char what[96];
        snprintf(what, sizeof what, "rope_parameters.%s", chosen);
        TRY(parse_rope_object(x, full, what, rope, partial_rotary));
        json_object_foreach((json_t *)rp, k, v) {
            if (v == full) continue;
            struct rope_config other = *rope;
            float pr = c->arch == MODEL_ARCH_MIMO_V2_FLASH ? 0.334f : *partial_rotary; // HF: per entry
            snprintf(what, sizeof what, "rope_parameters.%s", k);
            TRY(parse_rope_object(x, v, what, &other, &pr));
            if (c->arch == MODEL_ARCH_MIMO_V2_FLASH && !strcmp(k, "sliding_attention")) {
                // MiMo's sliding layers rotate with their own theta and partial factor.
                c->rope_sliding = other;
                *partial_sliding = pr;
                continue;
            }
            if (!rope_equal(&other, rope))
                LOG_WARN("%s: rope_parameters.%s differs from %s; atomc applies %s's RoPE to all layers", x->src, k,
                         chosen, chosen);
        }
        return ATOMC_OK;
    }
    const json_t *rs = jget(root, "rope_scaling");
    if (rs) TRY(parse_rope_object(x, rs, "rope_scaling", rope, partial_rotary));
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------

static atomc_status parse_dtype(struct ctx *x, const json_t *root, enum dtype *out) {
    const char *key = "torch_dtype";
    const json_t *v = jget(root, key);
    if (!v) {
        key = "dtype";
        v = jget(root, key);
    }
    *out = DTYPE_F32; // transformers' default when unspecified
    if (!v) return ATOMC_OK;
    if (!json_is_string(v)) return bad_type(x, key, v, "a string");
    const char *s = json_string_value(v);
    if (!strcmp(s, "bfloat16")) *out = DTYPE_BF16;
    else if (!strcmp(s, "float16") || !strcmp(s, "half")) *out = DTYPE_F16;
    else if (!strcmp(s, "float32") || !strcmp(s, "float")) *out = DTYPE_F32;
    else
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED,
                         "%s: key '%s' = \"%s\" is not supported (bfloat16, float16, float32)", x->src, key, s);
    return ATOMC_OK;
}

static atomc_status parse_layer_types_list(struct ctx *x, const json_t *root, struct model_config *c);

// DSA (GlmMoeDsaConfig / DeepseekV32Config): index_n_heads / index_head_dim / index_topk with
// transformers' defaults (32 / 128 / 2048), and GLM-5's indexer_types (or index_topk_pattern
// "FS..", or index_topk_freq / index_skip_topk_offset) marking layers that reuse the previous full
// layer's top-k. Other architectures: no DSA (index_n_heads 0).
static atomc_status parse_dsa(struct ctx *x, const json_t *root, struct model_config *c) {
    if (c->arch != MODEL_ARCH_GLM_MOE_DSA && c->arch != MODEL_ARCH_DEEPSEEK_V32) return ATOMC_OK;
    c->index_n_heads = c->arch == MODEL_ARCH_GLM_MOE_DSA ? 32 : 64;
    c->index_head_dim = 128;
    c->index_topk = 2048;
    c->index_rope_interleaved = c->arch == MODEL_ARCH_GLM_MOE_DSA;
    TRY(get_int(x, root, "index_n_heads", false, 1, 1 << 12, &c->index_n_heads));
    TRY(get_int(x, root, "index_head_dim", false, 1, 1 << 12, &c->index_head_dim));
    TRY(get_int(x, root, "index_topk", false, 1, INT32_MAX, &c->index_topk));
    const json_t *it = jget(root, "indexer_types"), *pat = jget(root, "index_topk_pattern");
    if (it && !json_is_null(it)) {
        if (!json_is_array(it) || json_array_size(it) != (size_t)c->num_layers)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'indexer_types' must list %d of \"full\" / \"shared\"",
                             x->src, c->num_layers);
        for (int l = 0; l < c->num_layers; l++) {
            const char *s = json_string_value(json_array_get(it, (size_t)l));
            if (!s || (strcmp(s, "full") && strcmp(s, "shared")))
                return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'indexer_types' entry %d must be \"full\" or \"shared\"",
                                 x->src, l);
            c->index_shared[l] = !strcmp(s, "shared");
        }
    } else if (pat && json_is_string(pat)) {
        const char *s = json_string_value(pat);
        if (strlen(s) != (size_t)c->num_layers || strspn(s, "FS") != strlen(s))
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'index_topk_pattern' must be %d of 'F' / 'S'", x->src,
                             c->num_layers);
        for (int l = 0; l < c->num_layers; l++) c->index_shared[l] = s[l] == 'S';
    } else if (c->arch == MODEL_ARCH_GLM_MOE_DSA) {
        int freq = 1, offset = 2;
        TRY(get_int(x, root, "index_topk_freq", false, 0, MODEL_MAX_LAYERS, &freq));
        TRY(get_int(x, root, "index_skip_topk_offset", false, INT32_MIN, INT32_MAX, &offset));
        if (freq < 1) freq = 1;
        for (int l = 0; l < c->num_layers; l++) {
            int d = l - offset + 1;
            c->index_shared[l] = (d > 0 ? d : 0) % freq != 0;
        }
    }
    if (c->index_shared[0])
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: layer 0's indexer is \"shared\" but no earlier layer has one",
                         x->src);
    return ATOMC_OK;
}

static atomc_status parse_layer_types(struct ctx *x, const json_t *root, struct model_config *c) {
    // Qwen configs carry sliding_window but switch it off with use_sliding_window (default
    // false there, as in transformers' Qwen3 configs); a layer typed "sliding_attention"
    // without a window attends fully, which is what transformers does.
    bool qwen = c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3_MOE || c->arch == MODEL_ARCH_QWEN3_NEXT ||
                c->arch == MODEL_ARCH_QWEN3_5_MOE;
    bool use_sw = !qwen;
    TRY(get_bool(x, root, "use_sliding_window", &use_sw));
    if (!use_sw) c->sliding_window = 0;
    TRY(parse_layer_types_list(x, root, c));
    if (c->sliding_window == 0 && c->arch != MODEL_ARCH_MIMO_V2_FLASH) // MiMo: validate refuses it
        for (int l = 0; l < c->num_layers; l++)
            if (c->layer_types[l] == LAYER_ATTN_SLIDING) c->layer_types[l] = LAYER_ATTN_FULL;
    return ATOMC_OK;
}

static atomc_status parse_layer_types_list(struct ctx *x, const json_t *root, struct model_config *c) {
    const json_t *lt = jget(root, "layer_types");
    if (lt) {
        if (!json_is_array(lt)) return bad_type(x, "layer_types", lt, "a list of strings");
        if ((int)json_array_size(lt) != c->num_layers)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'layer_types' has %zu entries but num_hidden_layers is %d",
                             x->src, json_array_size(lt), c->num_layers);
        for (int l = 0; l < c->num_layers; l++) {
            const json_t *e = json_array_get(lt, (size_t)l);
            const char *s = json_is_string(e) ? json_string_value(e) : NULL;
            if (s && !strcmp(s, "full_attention")) c->layer_types[l] = LAYER_ATTN_FULL;
            else if (s && !strcmp(s, "sliding_attention")) c->layer_types[l] = LAYER_ATTN_SLIDING;
            else if (s && !strcmp(s, "linear_attention")) c->layer_types[l] = LAYER_ATTN_LINEAR;
            else if (s && !strcmp(s, "indexed_attention") && c->index_n_heads > 0) c->layer_types[l] = LAYER_ATTN_FULL;
            else
                return error_set(x->err, ATOMC_ERR_FORMAT,
                                 "%s: key 'layer_types' entry %d must be \"full_attention\", \"sliding_attention\" or "
                                 "\"linear_attention\"", x->src, l);
        }
        return ATOMC_OK;
    }
    if (c->arch == MODEL_ARCH_QWEN3_NEXT || c->arch == MODEL_ARCH_QWEN3_5_MOE) {
        // every full_attention_interval-th layer is full attention
        int interval = 4;
        TRY(get_int(x, root, "full_attention_interval", false, 1, MODEL_MAX_LAYERS, &interval));
        for (int l = 0; l < c->num_layers; l++)
            c->layer_types[l] = (l + 1) % interval == 0 ? LAYER_ATTN_FULL : LAYER_ATTN_LINEAR;
        return ATOMC_OK;
    }
    if (c->arch == MODEL_ARCH_MIMO_V2_FLASH) { // MiMoV2FlashConfig: layer 0 and every 6th full, the rest sliding
        for (int l = 0; l < c->num_layers; l++)
            c->layer_types[l] = l == 0 || (l + 1) % 6 == 0 ? LAYER_ATTN_FULL : LAYER_ATTN_SLIDING;
        return ATOMC_OK;
    }
    if (c->arch == MODEL_ARCH_GPT_OSS) { // transformers' default: even layers sliding, odd layers full
        for (int l = 0; l < c->num_layers; l++) c->layer_types[l] = l % 2 == 0 ? LAYER_ATTN_SLIDING : LAYER_ATTN_FULL;
        return ATOMC_OK;
    }
    for (int l = 0; l < c->num_layers; l++) c->layer_types[l] = c->sliding_window > 0 ? LAYER_ATTN_SLIDING : LAYER_ATTN_FULL;
    return ATOMC_OK;
}

static atomc_status parse_moe(struct ctx *x, const json_t *root, struct model_config *c) {
    static const char *expert_keys[] = {"num_experts", "num_local_experts", "n_routed_experts"};
    for (size_t i = 0; i < 3; i++) TRY(get_int(x, root, expert_keys[i], false, 0, 1 << 20, &c->num_experts));
    TRY(get_int(x, root, "experts_per_token", false, 0, 1 << 20, &c->num_experts_per_tok)); // GPT-OSS alias
    TRY(get_int(x, root, "num_experts_per_tok", false, 0, 1 << 20, &c->num_experts_per_tok));
    TRY(get_int(x, root, "moe_intermediate_size", false, 0, INT32_MAX, &c->moe_intermediate_size));
    // Mixtral and GPT-OSS route over softmax(top-k), i.e. normalised top-k weights.
    c->norm_topk_prob = c->arch == MODEL_ARCH_MIXTRAL || c->arch == MODEL_ARCH_GPT_OSS;
    TRY(get_bool(x, root, "norm_topk_prob", &c->norm_topk_prob));
    c->decoder_sparse_step = 1;
    TRY(get_int(x, root, "decoder_sparse_step", false, 1, MODEL_MAX_LAYERS, &c->decoder_sparse_step));
    TRY(get_int(x, root, "first_k_dense_replace", false, 0, MODEL_MAX_LAYERS, &c->first_k_dense_replace));
    TRY(get_int(x, root, "n_shared_experts", false, 0, 1 << 20, &c->n_shared_experts));
    TRY(get_int(x, root, "shared_expert_intermediate_size", false, 0, INT32_MAX, &c->shared_expert_intermediate_size));
    c->routed_scaling_factor = 1.0f;
    TRY(get_float(x, root, "routed_scaling_factor", false, &c->routed_scaling_factor));
    TRY(get_int(x, root, "n_group", false, 0, 1 << 20, &c->n_group));
    TRY(get_int(x, root, "topk_group", false, 0, 1 << 20, &c->topk_group));
    snprintf(c->scoring_func, sizeof c->scoring_func, "%s",
             (c->arch == MODEL_ARCH_DEEPSEEK_V3 || c->arch == MODEL_ARCH_GLM4_MOE || c->arch == MODEL_ARCH_GLM_MOE_DSA ||
              c->arch == MODEL_ARCH_DEEPSEEK_V32 || c->arch == MODEL_ARCH_MIMO_V2_FLASH)
                 ? "sigmoid"
                 : "softmax");
    TRY(get_str(x, root, "scoring_func", c->scoring_func, sizeof c->scoring_func));
    TRY(get_int(x, root, "num_nextn_predict_layers", false, 0, 64, &c->num_nextn_predict_layers));
    if (c->arch == MODEL_ARCH_GLM4_MOE) { // Glm4MoeConfig's defaults for keys a config.json may omit
        if (!jget(root, "norm_topk_prob")) c->norm_topk_prob = true;
        if (!jget(root, "n_shared_experts")) c->n_shared_experts = 1;
        if (!jget(root, "first_k_dense_replace")) c->first_k_dense_replace = 1;
    }
    if (strcmp(c->scoring_func, "softmax") && strcmp(c->scoring_func, "sigmoid"))
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: key 'scoring_func' = \"%s\" is not supported (softmax, sigmoid)",
                         x->src, c->scoring_func);
    if (c->num_experts > 0 && c->moe_intermediate_size == 0) c->moe_intermediate_size = c->intermediate_size;
    const json_t *mol = jget(root, "mlp_only_layers");
    if (mol) {
        if (!json_is_array(mol)) return bad_type(x, "mlp_only_layers", mol, "a list of layer indices");
        for (size_t i = 0; i < json_array_size(mol); i++) {
            const json_t *e = json_array_get(mol, i);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= c->num_layers)
                return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'mlp_only_layers' element %zu is not a layer index "
                                 "in [0, %d)", x->src, i, c->num_layers);
            c->mlp_only_layers[json_integer_value(e)] = true;
        }
    }
    return ATOMC_OK;
}

// The MiMo-V2-Flash release's own config keys (config.json on the hub, as SGLang reads them),
// which transformers' MiMoV2FlashConfig does not: their presence marks the original format.
static bool mimo_original_format(const json_t *root) {
    static const char *keys[] = {"hybrid_layer_pattern", "moe_layer_freq", "swa_num_key_value_heads",
                                 "swa_num_attention_heads", "swa_head_dim", "swa_v_head_dim", "swa_rope_theta",
                                 "add_swa_attention_sink_bias", "add_full_attention_sink_bias"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (jget(root, keys[i])) return true;
    return false;
}

// A 0 / 1 list of one entry per layer (hybrid_layer_pattern, moe_layer_freq) into out.
static atomc_status get_01_list(struct ctx *x, const json_t *root, const char *key, int n, bool *out) {
    const json_t *v = jget(root, key);
    if (!json_is_array(v)) return bad_type(x, key, v, "a list of 0 / 1");
    if ((int)json_array_size(v) != n)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' has %zu entries but num_hidden_layers is %d", x->src,
                         key, json_array_size(v), n);
    for (int l = 0; l < n; l++) {
        const json_t *e = json_array_get(v, (size_t)l);
        if (!json_is_integer(e) || (json_integer_value(e) != 0 && json_integer_value(e) != 1))
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' entry %d must be 0 or 1", x->src, key, l);
        out[l] = json_integer_value(e) == 1;
    }
    return ATOMC_OK;
}

// The original format's layer and head keys (the RoPE keys rope_theta / swa_rope_theta /
// partial_rotary_factor and sliding_window_size are read with the others): hybrid_layer_pattern
// (0 full, 1 sliding) as layer_types, moe_layer_freq (0 dense, 1 MoE) as mlp_layer_types,
// swa_num_key_value_heads as the sliding layers' KV heads; swa_num_attention_heads /
// swa_head_dim / swa_v_head_dim must equal the full layers' (one head geometry, as the release
// has), add_swa_attention_sink_bias true and add_full_attention_sink_bias false (the release's
// sinks; other combinations are refused). Where a config also has transformers' key
// (layer_types, mlp_layer_types) the two must agree.
static atomc_status parse_mimo_original(struct ctx *x, const json_t *root, struct model_config *c) {
    const int L = c->num_layers;
    bool flags[MODEL_MAX_LAYERS];
    if (jget(root, "hybrid_layer_pattern")) {
        TRY(get_01_list(x, root, "hybrid_layer_pattern", L, flags));
        const bool given = jget(root, "layer_types") != NULL;
        for (int l = 0; l < L; l++) {
            enum layer_attn_type t = flags[l] ? LAYER_ATTN_SLIDING : LAYER_ATTN_FULL;
            if (given && c->layer_types[l] != t)
                return error_set(x->err, ATOMC_ERR_FORMAT, "%s: layer_types and hybrid_layer_pattern disagree at "
                                 "layer %d", x->src, l);
            c->layer_types[l] = t;
        }
    }
    if (jget(root, "moe_layer_freq")) {
        TRY(get_01_list(x, root, "moe_layer_freq", L, flags));
        const bool given = jget(root, "mlp_layer_types") != NULL;
        for (int l = 0; l < L; l++) {
            if (given && c->mlp_only_layers[l] != !flags[l])
                return error_set(x->err, ATOMC_ERR_FORMAT, "%s: mlp_layer_types and moe_layer_freq disagree at "
                                 "layer %d", x->src, l);
            c->mlp_only_layers[l] = !flags[l];
        }
    }
    TRY(get_int(x, root, "swa_num_key_value_heads", false, 1, 1 << 16, &c->swa_num_kv_heads));
    const struct {
        const char *key;
        int want;
        const char *of;
    } same[] = {{"swa_num_attention_heads", c->num_heads, "num_attention_heads"},
                {"swa_head_dim", c->head_dim, "head_dim"},
                {"swa_v_head_dim", c->v_head_dim, "v_head_dim"}};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        int v = same[i].want;
        TRY(get_int(x, root, same[i].key, false, 1, 1 << 16, &v));
        if (v != same[i].want)
            return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: %s %d differs from %s %d: sliding layers with their "
                             "own head count or head dims are not implemented", x->src, same[i].key, v, same[i].of,
                             same[i].want);
    }
    bool swa_sinks = true, full_sinks = false;
    TRY(get_bool(x, root, "add_swa_attention_sink_bias", &swa_sinks));
    TRY(get_bool(x, root, "add_full_attention_sink_bias", &full_sinks));
    if (!swa_sinks || full_sinks)
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: add_swa_attention_sink_bias %s / "
                         "add_full_attention_sink_bias %s: only sinks on the sliding layers (true / false, as "
                         "MiMo-V2-Flash has) are implemented", x->src, swa_sinks ? "true" : "false",
                         full_sinks ? "true" : "false");
    const json_t *layout = jget(root, "attention_projection_layout");
    if (layout && (!json_is_string(layout) || strcmp(json_string_value(layout), "separate") != 0))
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: attention_projection_layout %s: only separate q / k / v "
                         "projections are implemented for MiMoV2FlashForCausalLM", x->src,
                         json_is_string(layout) ? json_string_value(layout) : "(not a string)");
    return ATOMC_OK;
}

// MiMo-V2-Flash (transformers' MiMoV2FlashConfig): v_head_dim (default 128; head_dim defaults to
// 192), sliding layers with twice the KV heads, attention_value_scale (default 0.707; null = 1),
// mlp_layer_types ("dense" / "sparse"; default layer 0 dense, the rest MoE) as mlp_only_layers,
// norm_topk_prob default true, routed_scaling_factor null = 1. The release's own config format
// (hybrid_layer_pattern, swa_*, moe_layer_freq, add_*_sink_bias: what the hub's config.json
// has, and what transformers' defaults happen to equal for the released model) is read too:
// parse_mimo_original.
static atomc_status parse_mimo(struct ctx *x, const json_t *root, struct model_config *c) {
    if (c->arch != MODEL_ARCH_MIMO_V2_FLASH) return ATOMC_OK;
    c->v_head_dim = 128;
    TRY(get_int(x, root, "v_head_dim", false, 1, 1 << 16, &c->v_head_dim));
    c->swa_num_kv_heads = 2 * c->num_kv_heads;
    c->attention_value_scale = 0.707f;
    TRY(get_float(x, root, "attention_value_scale", false, &c->attention_value_scale));
    if (!isfinite(c->attention_value_scale) || c->attention_value_scale == 0.0f)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: attention_value_scale %g must be finite and non-zero", x->src,
                         c->attention_value_scale);
    if (!jget(root, "norm_topk_prob")) c->norm_topk_prob = true;
    if (!jget(root, "n_routed_experts") && !jget(root, "num_experts") && !jget(root, "num_local_experts"))
        c->num_experts = 256;
    if (!jget(root, "num_experts_per_tok")) c->num_experts_per_tok = 8;
    if (!jget(root, "moe_intermediate_size")) c->moe_intermediate_size = 2048;
    c->attention_sinks = true; // on the sliding layers
    const json_t *mt = jget(root, "mlp_layer_types");
    if (!mt) {
        c->mlp_only_layers[0] = true;
        return mimo_original_format(root) ? parse_mimo_original(x, root, c) : ATOMC_OK;
    }
    if (!json_is_array(mt)) return bad_type(x, "mlp_layer_types", mt, "a list of strings");
    if ((int)json_array_size(mt) != c->num_layers)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'mlp_layer_types' has %zu entries but num_hidden_layers is "
                         "%d", x->src, json_array_size(mt), c->num_layers);
    for (int l = 0; l < c->num_layers; l++) {
        const json_t *e = json_array_get(mt, (size_t)l);
        const char *s = json_is_string(e) ? json_string_value(e) : NULL;
        if (s && !strcmp(s, "dense")) c->mlp_only_layers[l] = true;
        else if (!s || strcmp(s, "sparse"))
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key 'mlp_layer_types' entry %d must be \"dense\" or "
                             "\"sparse\"", x->src, l);
    }
    return mimo_original_format(root) ? parse_mimo_original(x, root, c) : ATOMC_OK;
}

// GPT-OSS: the clamped SwiGLU of its experts (transformers' GptOssConfig defaults).
static atomc_status parse_gpt_oss(struct ctx *x, const json_t *root, struct model_config *c) {
    if (c->arch != MODEL_ARCH_GPT_OSS) return ATOMC_OK;
    c->swiglu_alpha = 1.702f;
    c->swiglu_limit = 7.0f;
    TRY(get_float(x, root, "swiglu_alpha", false, &c->swiglu_alpha));
    TRY(get_float(x, root, "swiglu_limit", false, &c->swiglu_limit));
    if (!(c->swiglu_alpha > 0.0f) || !(c->swiglu_limit > 0.0f) || !isfinite(c->swiglu_alpha) ||
        !isfinite(c->swiglu_limit))
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: swiglu_alpha %g and swiglu_limit %g must be positive and finite",
                         x->src, c->swiglu_alpha, c->swiglu_limit);
    return ATOMC_OK;
}

// Qwen3-Next / Qwen3.5 (Gated DeltaNet): the linear-attention dims (transformers' defaults
// where a key is absent), zero-centred norms and the gated full attention, and Qwen3.5's
// intermediate_size (absent there: every layer is MoE; the shared expert's size stands in).
static atomc_status parse_linear_attention(struct ctx *x, const json_t *root, struct model_config *c) {
    if (c->arch != MODEL_ARCH_QWEN3_NEXT && c->arch != MODEL_ARCH_QWEN3_5_MOE) return ATOMC_OK;
    c->linear_num_key_heads = 16;
    c->linear_num_value_heads = 32;
    c->linear_key_head_dim = 128;
    c->linear_value_head_dim = 128;
    c->linear_conv_kernel_dim = 4;
    TRY(get_int(x, root, "linear_num_key_heads", false, 1, 1 << 16, &c->linear_num_key_heads));
    TRY(get_int(x, root, "linear_num_value_heads", false, 1, 1 << 16, &c->linear_num_value_heads));
    TRY(get_int(x, root, "linear_key_head_dim", false, 1, 1 << 16, &c->linear_key_head_dim));
    TRY(get_int(x, root, "linear_value_head_dim", false, 1, 1 << 16, &c->linear_value_head_dim));
    TRY(get_int(x, root, "linear_conv_kernel_dim", false, 1, 64, &c->linear_conv_kernel_dim));
    if (c->linear_num_value_heads % c->linear_num_key_heads != 0)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: linear_num_value_heads (%d) is not a multiple of "
                         "linear_num_key_heads (%d)", x->src, c->linear_num_value_heads, c->linear_num_key_heads);
    c->norm_zero_centered = true;
    c->attn_output_gate = true;
    // Qwen3.5's router always renormalises its top-k (no norm_topk_prob key); Qwen3-Next's
    // default is true.
    if (c->arch == MODEL_ARCH_QWEN3_5_MOE || !jget(root, "norm_topk_prob")) c->norm_topk_prob = true;
    if (c->intermediate_size == 0) c->intermediate_size = c->shared_expert_intermediate_size;
    if (c->intermediate_size == 0) c->intermediate_size = c->moe_intermediate_size;
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------
// Quantization config (see config.h). Each method's keys are read into one quant_config;
// a value of the wrong type or range is FORMAT naming its path
// ("quantization_config.config_groups.group_0.weights.num_bits"); unknown keys are ignored.

#define QPATH_MAX 192

static const struct {
    const char *name;
    enum quant_method method;
} quant_method_names[] = {
    {"fp8", QUANT_METHOD_FP8},
    {"compressed-tensors", QUANT_METHOD_COMPRESSED_TENSORS},
    {"compressed_tensors", QUANT_METHOD_COMPRESSED_TENSORS},
    {"gptq", QUANT_METHOD_GPTQ},
    {"awq", QUANT_METHOD_AWQ},
    {"mxfp4", QUANT_METHOD_MXFP4},
    {"bitsandbytes", QUANT_METHOD_BITSANDBYTES},
    {"modelopt", QUANT_METHOD_MODELOPT},
};

enum quant_method quant_method_from_name(const char *name) {
    for (size_t i = 0; i < sizeof quant_method_names / sizeof quant_method_names[0]; i++)
        if (!strcmp(quant_method_names[i].name, name)) return quant_method_names[i].method;
    return QUANT_METHOD_OTHER;
}

static const struct {
    const char *name;
    enum quant_strategy strategy;
} quant_strategy_names[] = {
    {"tensor", QUANT_STRATEGY_TENSOR},       {"channel", QUANT_STRATEGY_CHANNEL},
    {"group", QUANT_STRATEGY_GROUP},         {"block", QUANT_STRATEGY_BLOCK},
    {"token", QUANT_STRATEGY_TOKEN},         {"tensor_group", QUANT_STRATEGY_TENSOR_GROUP},
    {"attn_head", QUANT_STRATEGY_ATTN_HEAD},
};

enum quant_strategy quant_strategy_from_name(const char *name) {
    for (size_t i = 0; i < sizeof quant_strategy_names / sizeof quant_strategy_names[0]; i++)
        if (!strcmp(quant_strategy_names[i].name, name)) return quant_strategy_names[i].strategy;
    return QUANT_STRATEGY_OTHER;
}

// "path.key" into out[QPATH_MAX], for messages only (a longer path is cut).
static void qjoin(char *out, const char *path, const char *key) {
    if (snprintf(out, QPATH_MAX, "%s.%s", path, key) >= QPATH_MAX) out[QPATH_MAX - 1] = '\0';
}

// A list of strings (a single string counts as a list of one) into names[0..cap); *n gets
// the full count, entries past cap are checked but not kept.
static atomc_status get_name_list(struct ctx *x, const json_t *o, const char *key, const char *path,
                                  char (*names)[QUANT_NAME_MAX], int cap, int *n) {
    char label[QPATH_MAX];
    qjoin(label, path, key);
    const json_t *v = jget(o, key);
    *n = 0;
    if (!v) return ATOMC_OK;
    if (json_is_string(v)) {
        *n = 1;
        return copy_str(x, v, label, names[0], QUANT_NAME_MAX);
    }
    if (!json_is_array(v)) return bad_type(x, label, v, "a list of strings");
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *e = json_array_get(v, i);
        char el[QPATH_MAX + 16], scratch[QUANT_NAME_MAX];
        if (snprintf(el, sizeof el, "%s[%zu]", label, i) >= (int)sizeof el) el[sizeof el - 1] = '\0';
        TRY(copy_str(x, e, el, *n < cap ? names[*n] : scratch, QUANT_NAME_MAX));
        (*n)++;
    }
    return ATOMC_OK;
}

// A list of two positive integers (weight_block_size, block_structure).
static atomc_status get_int_pair(struct ctx *x, const json_t *o, const char *key, const char *path, int out[2]) {
    char label[QPATH_MAX];
    qjoin(label, path, key);
    const json_t *v = jget(o, key);
    if (!v) return ATOMC_OK;
    bool ok = json_is_array(v) && json_array_size(v) == 2;
    for (size_t i = 0; ok && i < 2; i++) {
        const json_t *e = json_array_get(v, i);
        ok = json_is_integer(e) && json_integer_value(e) > 0 && json_integer_value(e) <= (1 << 24);
        if (ok) out[i] = (int)json_integer_value(e);
    }
    if (!ok)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' must be a list of 2 positive integers, got %s", x->src,
                         label, json_is_array(v) ? "another list" : json_type_word(v));
    return ATOMC_OK;
}

// compressed-tensors QuantizationArgs (an object, or null = not quantized).
static atomc_status parse_quant_args(struct ctx *x, const json_t *o, const char *key, const char *path,
                                     struct quant_args *a) {
    char label[QPATH_MAX], p[QPATH_MAX];
    qjoin(label, path, key);
    memset(a, 0, sizeof *a);
    const json_t *v = jget(o, key);
    if (!v) return ATOMC_OK;
    if (!json_is_object(v)) return bad_type(x, label, v, "an object or null");
    a->present = true;
    a->num_bits = 8;
    a->type = QUANT_TYPE_INT;
    a->symmetric = true;
    qjoin(p, label, "num_bits");
    TRY(get_int_at(x, v, "num_bits", p, false, 1, 64, &a->num_bits));
    char type[16] = "int";
    qjoin(p, label, "type");
    TRY(get_str_at(x, v, "type", p, type, sizeof type));
    a->type = !strcasecmp(type, "int")     ? QUANT_TYPE_INT
              : !strcasecmp(type, "float") ? QUANT_TYPE_FLOAT
                                           : QUANT_TYPE_OTHER;
    qjoin(p, label, "symmetric");
    TRY(get_bool_at(x, v, "symmetric", p, &a->symmetric));
    int gs = 0; // -1: one group per row (channel), as compressed-tensors reads it
    char gp[QPATH_MAX];
    qjoin(gp, label, "group_size");
    TRY(get_int_at(x, v, "group_size", gp, false, -1, 1 << 24, &gs));
    if (jget(v, "group_size") && gs == 0)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' must be -1 or positive, got 0", x->src, gp);
    a->group_size = gs > 0 ? gs : 0;
    const json_t *bs = jget(v, "block_structure");
    if (bs && json_is_string(bs)) { // the older "128x128" spelling
        qjoin(p, label, "block_structure");
        int r = 0, c = 0, k = 0;
        if (sscanf(json_string_value(bs), "%dx%d%n", &r, &c, &k) != 2 || json_string_value(bs)[k] || r <= 0 || c <= 0)
            return error_set(x->err, ATOMC_ERR_FORMAT,
                             "%s: key '%s' = \"%.40s\" must be \"RxC\" or a list of 2 positive "
                             "integers",
                             x->src, p, json_string_value(bs));
        a->block_size[0] = r, a->block_size[1] = c;
    } else {
        TRY(get_int_pair(x, v, "block_structure", label, a->block_size));
    }
    qjoin(p, label, "strategy");
    TRY(get_str_at(x, v, "strategy", p, a->strategy_name, sizeof a->strategy_name));
    for (char *ch = a->strategy_name; *ch; ch++)
        *ch = (char)(*ch >= 'A' && *ch <= 'Z' ? *ch - 'A' + 'a' : *ch);
    if (a->strategy_name[0])
        a->strategy = quant_strategy_from_name(a->strategy_name);
    else if (a->block_size[0])
        a->strategy = QUANT_STRATEGY_BLOCK;
    else // compressed-tensors' own inference when strategy is null
        a->strategy = gs > 0 ? QUANT_STRATEGY_GROUP : gs < 0 ? QUANT_STRATEGY_CHANNEL : QUANT_STRATEGY_TENSOR;
    if ((a->strategy == QUANT_STRATEGY_GROUP || a->strategy == QUANT_STRATEGY_TENSOR_GROUP) && a->group_size == 0)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' is \"%s\" but '%s.group_size' is not set", x->src, p,
                         a->strategy_name, label);
    if (a->strategy == QUANT_STRATEGY_BLOCK && a->block_size[0] == 0)
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' is \"block\" but '%s.block_structure' is not set",
                         x->src, p, label);
    const json_t *d = jget(v, "dynamic");
    qjoin(p, label, "dynamic");
    if (d && json_is_boolean(d))
        a->dynamic = json_is_true(d);
    else if (d && json_is_string(d) && !strcmp(json_string_value(d), "local"))
        a->dynamic = true;
    else if (d)
        return bad_type(x, p, d, "a boolean or \"local\"");
    const json_t *ao = jget(v, "actorder");
    qjoin(p, label, "actorder");
    if (ao && json_is_boolean(ao))
        snprintf(a->actorder, sizeof a->actorder, "%s", json_is_true(ao) ? "group" : "");
    else if (ao)
        TRY(copy_str(x, ao, p, a->actorder, sizeof a->actorder));
    return ATOMC_OK;
}

static enum quant_act_scheme act_scheme_of(const struct quant_args *a) {
    return !a->present ? QUANT_ACT_NONE : a->dynamic ? QUANT_ACT_DYNAMIC : QUANT_ACT_STATIC;
}

// One scheme of a method that has a single one (everything but compressed-tensors).
static struct quant_scheme *quant_single_scheme(struct quant_config *q) {
    q->n_schemes = 1;
    struct quant_scheme *s = &q->schemes[0];
    snprintf(s->name, sizeof s->name, "%s", q->method_name);
    s->weights.present = true;
    s->weights.symmetric = true;
    return s;
}

// fp8: {"quant_method": "fp8", "activation_scheme": "dynamic"|"static", "weight_block_size":
// [128, 128] (absent: one scale per tensor), "fmt": "e4m3", "modules_to_not_convert": [...],
// "kv_cache_scheme": "static"|"dynamic"}.
static atomc_status parse_quant_fp8(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    char p[QPATH_MAX];
    snprintf(q->format, sizeof q->format, "e4m3");
    qjoin(p, path, "fmt");
    TRY(get_str_at(x, o, "fmt", p, q->format, sizeof q->format));
    struct quant_scheme *s = quant_single_scheme(q);
    snprintf(s->format, sizeof s->format, "%s", q->format);
    s->weights.num_bits = 8;
    s->weights.type = QUANT_TYPE_FLOAT;
    TRY(get_int_pair(x, o, "weight_block_size", path, s->weights.block_size));
    s->weights.strategy = s->weights.block_size[0] ? QUANT_STRATEGY_BLOCK : QUANT_STRATEGY_TENSOR;
    char act[16] = "dynamic";
    qjoin(p, path, "activation_scheme");
    TRY(get_str_at(x, o, "activation_scheme", p, act, sizeof act));
    if (strcmp(act, "dynamic") && strcmp(act, "static"))
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' = \"%s\" must be \"dynamic\" or \"static\"", x->src, p,
                         act);
    s->input_act = (struct quant_args){.present = true,
                                       .num_bits = 8,
                                       .type = QUANT_TYPE_FLOAT,
                                       .symmetric = true,
                                       .dynamic = !strcmp(act, "dynamic")};
    if (s->weights.strategy == QUANT_STRATEGY_BLOCK) { // per token and group of block-width channels
        s->input_act.strategy = QUANT_STRATEGY_GROUP;
        s->input_act.group_size = s->weights.block_size[1];
    } else {
        s->input_act.strategy = QUANT_STRATEGY_TENSOR;
    }
    s->act_scheme = act_scheme_of(&s->input_act);
    // "kv_cache_scheme": "static" (AutoFP8, AMD / Tencent FP8 checkpoints): an FP8 KV cache with
    // per-layer static scales stored as self_attn.k_scale / v_scale (or kv_scale).
    char kvs[16] = "";
    qjoin(p, path, "kv_cache_scheme");
    TRY(get_str_at(x, o, "kv_cache_scheme", p, kvs, sizeof kvs));
    if (kvs[0] && strcmp(kvs, "static") && strcmp(kvs, "dynamic"))
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' = \"%s\" must be \"static\" or \"dynamic\"", x->src,
                         p, kvs);
    if (kvs[0])
        q->kv_cache = (struct quant_args){.present = true,
                                          .num_bits = 8,
                                          .type = QUANT_TYPE_FLOAT,
                                          .strategy = QUANT_STRATEGY_TENSOR,
                                          .symmetric = true,
                                          .dynamic = !strcmp(kvs, "dynamic")};
    return get_name_list(x, o, "modules_to_not_convert", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore);
}

// compressed-tensors: {"format", "config_groups": {name: {"targets", "weights",
// "input_activations", "output_activations", "format"}}, "ignore", "kv_cache_scheme",
// "sparsity_config": {"format", ...}}.
static atomc_status parse_quant_ct(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    char p[QPATH_MAX];
    qjoin(p, path, "format");
    TRY(get_str_at(x, o, "format", p, q->format, sizeof q->format));
    TRY(get_name_list(x, o, "ignore", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore));
    TRY(parse_quant_args(x, o, "kv_cache_scheme", path, &q->kv_cache));
    const json_t *sp = jget(o, "sparsity_config");
    qjoin(p, path, "sparsity_config");
    if (sp) {
        if (!json_is_object(sp)) return bad_type(x, p, sp, "an object or null");
        char sf[QPATH_MAX];
        qjoin(sf, p, "format");
        TRY(get_str_at(x, sp, "format", sf, q->sparsity_format, sizeof q->sparsity_format));
        if (!strcmp(q->sparsity_format, "dense")) q->sparsity_format[0] = '\0';
    }
    const json_t *groups = jget(o, "config_groups");
    qjoin(p, path, "config_groups");
    if (!groups) return ATOMC_OK;
    if (!json_is_object(groups)) return bad_type(x, p, groups, "an object");
    const char *name;
    const json_t *g;
    json_object_foreach((json_t *)groups, name, g) {
        char gp[QPATH_MAX], fp[QPATH_MAX];
        qjoin(gp, p, name);
        if (!json_is_object(g)) return bad_type(x, gp, g, "an object");
        struct quant_scheme scratch, *s = q->n_schemes < QUANT_MAX_SCHEMES ? &q->schemes[q->n_schemes] : &scratch;
        memset(s, 0, sizeof *s);
        q->n_schemes++;
        snprintf(s->name, sizeof s->name, "%.31s", name);
        snprintf(s->format, sizeof s->format, "%s", q->format);
        qjoin(fp, gp, "format");
        TRY(get_str_at(x, g, "format", fp, s->format, sizeof s->format));
        TRY(get_name_list(x, g, "targets", gp, s->targets, QUANT_MAX_TARGETS, &s->n_targets));
        TRY(parse_quant_args(x, g, "weights", gp, &s->weights));
        TRY(parse_quant_args(x, g, "input_activations", gp, &s->input_act));
        struct quant_args out_act;
        TRY(parse_quant_args(x, g, "output_activations", gp, &out_act));
        s->output_act = out_act.present;
        s->act_scheme = act_scheme_of(&s->input_act);
    }
    return ATOMC_OK;
}

// gptq: {"bits", "group_size" (-1: per channel), "desc_act", "sym", "checkpoint_format"}.
static atomc_status parse_quant_gptq(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    char p[QPATH_MAX];
    snprintf(q->format, sizeof q->format, "gptq");
    qjoin(p, path, "checkpoint_format");
    TRY(get_str_at(x, o, "checkpoint_format", p, q->format, sizeof q->format));
    struct quant_scheme *s = quant_single_scheme(q);
    snprintf(s->format, sizeof s->format, "%s", q->format);
    s->weights.type = QUANT_TYPE_INT;
    qjoin(p, path, "bits");
    TRY(get_int_at(x, o, "bits", p, true, 1, 16, &s->weights.num_bits));
    int gs = 128;
    qjoin(p, path, "group_size");
    TRY(get_int_at(x, o, "group_size", p, false, -1, 1 << 24, &gs));
    if (gs == 0) return error_set(x->err, ATOMC_ERR_FORMAT, "%s: key '%s' must be -1 or positive, got 0", x->src, p);
    s->weights.strategy = gs < 0 ? QUANT_STRATEGY_CHANNEL : QUANT_STRATEGY_GROUP;
    s->weights.group_size = gs < 0 ? 0 : gs;
    qjoin(p, path, "sym");
    TRY(get_bool_at(x, o, "sym", p, &s->weights.symmetric));
    bool desc_act = false;
    qjoin(p, path, "desc_act");
    TRY(get_bool_at(x, o, "desc_act", p, &desc_act));
    if (desc_act) snprintf(s->weights.actorder, sizeof s->weights.actorder, "desc_act");
    return get_name_list(x, o, "modules_to_not_convert", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore);
}

// awq: {"bits" | "w_bit", "group_size" | "q_group_size", "zero_point", "version": "gemm" | "gemv" | ...}.
static atomc_status parse_quant_awq(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    char p[QPATH_MAX];
    snprintf(q->format, sizeof q->format, "gemm");
    qjoin(p, path, "version");
    TRY(get_str_at(x, o, "version", p, q->format, sizeof q->format));
    struct quant_scheme *s = quant_single_scheme(q);
    snprintf(s->format, sizeof s->format, "%s", q->format);
    s->weights.type = QUANT_TYPE_INT;
    s->weights.num_bits = 4;
    s->weights.group_size = 128;
    static const char *bits_keys[] = {"w_bit", "bits"}, *group_keys[] = {"q_group_size", "group_size"};
    for (int i = 0; i < 2; i++) {
        qjoin(p, path, bits_keys[i]);
        TRY(get_int_at(x, o, bits_keys[i], p, false, 1, 16, &s->weights.num_bits));
        qjoin(p, path, group_keys[i]);
        TRY(get_int_at(x, o, group_keys[i], p, false, -1, 1 << 24, &s->weights.group_size));
    }
    s->weights.strategy = s->weights.group_size > 0 ? QUANT_STRATEGY_GROUP : QUANT_STRATEGY_CHANNEL;
    if (s->weights.group_size < 0) s->weights.group_size = 0;
    bool zero_point = true;
    qjoin(p, path, "zero_point");
    TRY(get_bool_at(x, o, "zero_point", p, &zero_point));
    s->weights.symmetric = !zero_point;
    return get_name_list(x, o, "modules_to_not_convert", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore);
}

// mxfp4 (GPT-OSS): the format itself fixes the scheme: FP4 (e2m1) weights in blocks of 32
// along k sharing one power-of-two (e8m0) scale.
static atomc_status parse_quant_mxfp4(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    struct quant_scheme *s = quant_single_scheme(q);
    s->weights.num_bits = 4;
    s->weights.type = QUANT_TYPE_FLOAT;
    s->weights.strategy = QUANT_STRATEGY_GROUP;
    s->weights.group_size = 32;
    return get_name_list(x, o, "modules_to_not_convert", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore);
}

// bitsandbytes: {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type": "nf4" | "fp4",
// "llm_int8_skip_modules"}.
static atomc_status parse_quant_bnb(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    char p[QPATH_MAX];
    bool in4 = false, in8 = false;
    qjoin(p, path, "load_in_4bit");
    TRY(get_bool_at(x, o, "load_in_4bit", p, &in4));
    qjoin(p, path, "load_in_8bit");
    TRY(get_bool_at(x, o, "load_in_8bit", p, &in8));
    struct quant_scheme *s = quant_single_scheme(q);
    if (in4) {
        snprintf(q->format, sizeof q->format, "fp4");
        qjoin(p, path, "bnb_4bit_quant_type");
        TRY(get_str_at(x, o, "bnb_4bit_quant_type", p, q->format, sizeof q->format));
        s->weights.num_bits = 4;
        s->weights.type = strcmp(q->format, "fp4") ? QUANT_TYPE_OTHER : QUANT_TYPE_FLOAT;
        s->weights.strategy = QUANT_STRATEGY_GROUP;
        s->weights.group_size = 64; // bitsandbytes' 4-bit blocksize
    } else {
        snprintf(q->format, sizeof q->format, "%s", in8 ? "int8" : "");
        s->weights.num_bits = in8 ? 8 : 0;
        s->weights.type = QUANT_TYPE_INT;
        s->weights.strategy = QUANT_STRATEGY_CHANNEL;
    }
    snprintf(s->format, sizeof s->format, "%s", q->format);
    return get_name_list(x, o, "llm_int8_skip_modules", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore);
}

// ModelOpt: {"quant_algo": "FP8" | "NVFP4" | ..., "kv_cache_quant_algo", "exclude_modules"},
// at the top or inside "quantization" (hf_quant_config.json).
static atomc_status parse_quant_modelopt(struct ctx *x, const json_t *o, const char *path, struct quant_config *q) {
    char p[QPATH_MAX], sub[QPATH_MAX];
    const json_t *inner = jget(o, "quantization");
    if (inner) {
        qjoin(sub, path, "quantization");
        if (!json_is_object(inner)) return bad_type(x, sub, inner, "an object");
        o = inner;
        path = sub;
    }
    qjoin(p, path, "quant_algo");
    TRY(get_str_at(x, o, "quant_algo", p, q->format, sizeof q->format));
    struct quant_scheme *s = quant_single_scheme(q);
    snprintf(s->format, sizeof s->format, "%s", q->format);
    if (!strcmp(q->format, "FP8")) {
        s->weights.num_bits = 8;
        s->weights.type = QUANT_TYPE_FLOAT;
        s->weights.strategy = QUANT_STRATEGY_TENSOR;
    } else if (!strcmp(q->format, "NVFP4")) {
        s->weights.num_bits = 4;
        s->weights.type = QUANT_TYPE_FLOAT;
        s->weights.strategy = QUANT_STRATEGY_TENSOR_GROUP;
        s->weights.group_size = 16;
    } else {
        s->weights.type = QUANT_TYPE_OTHER;
        s->weights.strategy = QUANT_STRATEGY_OTHER;
    }
    char kv[32] = "";
    qjoin(p, path, "kv_cache_quant_algo");
    TRY(get_str_at(x, o, "kv_cache_quant_algo", p, kv, sizeof kv));
    if (kv[0]) {
        q->kv_cache = (struct quant_args){.present = true, .type = QUANT_TYPE_OTHER, .strategy = QUANT_STRATEGY_TENSOR};
        snprintf(q->kv_cache.strategy_name, sizeof q->kv_cache.strategy_name, "%.15s", kv);
    }
    return get_name_list(x, o, "exclude_modules", path, q->ignore, QUANT_MAX_IGNORE, &q->n_ignore);
}

// One quantization config object found under `origin` (its path in messages). A missing
// quant_method takes `def` (AutoGPTQ's quantize_config.json has none), else is FORMAT.
static atomc_status parse_quant_object(struct ctx *x, const json_t *o, const char *origin, enum quant_method def,
                                       struct quant_config *q) {
    memset(q, 0, sizeof *q);
    if (!json_is_object(o)) return bad_type(x, origin, o, "an object");
    char p[QPATH_MAX];
    qjoin(p, origin, "quant_method");
    const json_t *m = jget(o, "quant_method");
    if (m) {
        TRY(copy_str(x, m, p, q->method_name, sizeof q->method_name));
        q->method = quant_method_from_name(q->method_name);
    } else if (def != QUANT_METHOD_NONE) {
        q->method = def;
        for (size_t i = 0; i < sizeof quant_method_names / sizeof quant_method_names[0]; i++)
            if (quant_method_names[i].method == def) {
                snprintf(q->method_name, sizeof q->method_name, "%s", quant_method_names[i].name);
                break;
            }
    } else {
        return missing(x, p);
    }
    q->present = true;
    snprintf(q->origin, sizeof q->origin, "%.47s", origin);
    switch (q->method) {
    case QUANT_METHOD_FP8:
        return parse_quant_fp8(x, o, origin, q);
    case QUANT_METHOD_COMPRESSED_TENSORS:
        return parse_quant_ct(x, o, origin, q);
    case QUANT_METHOD_GPTQ:
        return parse_quant_gptq(x, o, origin, q);
    case QUANT_METHOD_AWQ:
        return parse_quant_awq(x, o, origin, q);
    case QUANT_METHOD_MXFP4:
        return parse_quant_mxfp4(x, o, origin, q);
    case QUANT_METHOD_BITSANDBYTES:
        return parse_quant_bnb(x, o, origin, q);
    case QUANT_METHOD_MODELOPT:
        return parse_quant_modelopt(x, o, origin, q);
    case QUANT_METHOD_NONE:
    case QUANT_METHOD_OTHER:
        break;
    }
    // Unknown method: keep a string `format` if there is one; the method itself is refused.
    const json_t *f = jget(o, "format");
    if (f && json_is_string(f)) snprintf(q->format, sizeof q->format, "%.31s", json_string_value(f));
    return ATOMC_OK;
}

// config.json: quantization_config, or older llm-compressor files' compression_config
// (compressed-tensors, possibly wrapping its quantization_config).
static atomc_status parse_quant_root(struct ctx *x, const json_t *root, struct model_config *c) {
    const json_t *qc = jget(root, "quantization_config");
    if (qc) return parse_quant_object(x, qc, "quantization_config", QUANT_METHOD_NONE, &c->quant);
    const json_t *cc = jget(root, "compression_config");
    if (!cc) return ATOMC_OK;
    const json_t *inner = json_is_object(cc) ? jget(cc, "quantization_config") : NULL;
    if (inner)
        return parse_quant_object(x, inner, "compression_config.quantization_config", QUANT_METHOD_COMPRESSED_TENSORS,
                                  &c->quant);
    return parse_quant_object(x, cc, "compression_config", QUANT_METHOD_COMPRESSED_TENSORS, &c->quant);
}

// bos / pad / eos ids (as read from x->src) inside the vocabulary: an id past the embedding would
// never match a sampled token (EOS) or index past the table (BOS, padding).
static atomc_status check_special_ids(struct ctx *x, int vocab, int bos, int pad, const int *eos, int n_eos) {
    const struct {
        const char *key;
        int id;
    } one[] = {{"bos_token_id", bos}, {"pad_token_id", pad}};
    for (int i = 0; i < 2; i++)
        if (one[i].id >= vocab)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: %s %d is outside the vocabulary (vocab_size %d)", x->src,
                             one[i].key, one[i].id, vocab);
    for (int i = 0; i < n_eos; i++)
        if (eos[i] >= vocab)
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: eos_token_id %d is outside the vocabulary (vocab_size %d)",
                             x->src, eos[i], vocab);
    return ATOMC_OK;
}

// model_type (transformers' config class) against the architecture: when both are given they must
// name the same family (the defaults applied are the architecture's); an unknown model_type is
// refused, as transformers' AutoConfig refuses it. Absent with "architectures" present: accepted
// (the architecture decides; the loader does not need it).
static atomc_status check_model_type(struct ctx *x, const json_t *root, const struct model_config *c) {
    const json_t *mt = jget(root, "model_type");
    if (!mt) return ATOMC_OK;
    if (!json_is_string(mt)) return bad_type(x, "model_type", mt, "a string");
    const char *v = json_string_value(mt);
    char known[512];
    size_t n = 0;
    known[0] = 0;
    for (size_t i = 0; i < sizeof model_types / sizeof model_types[0]; i++) {
        if (!strcmp(model_types[i].model_type, v)) {
            if (model_arch_from_name(model_types[i].architecture) == c->arch) return ATOMC_OK;
            return error_set(x->err, ATOMC_ERR_FORMAT, "%s: model_type '%s' does not match architecture '%s'", x->src,
                             v, c->architecture);
        }
        if (n < sizeof known)
            n += (size_t)snprintf(known + n, sizeof known - n, "%s%s", i ? ", " : "", model_types[i].model_type);
    }
    return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: model_type '%s' is not supported (supported: %s)", x->src, v,
                     known);
}

static atomc_status resolve_architecture(struct ctx *x, const json_t *root, struct model_config *c) {
    const json_t *archs = jget(root, "architectures");
    const char *name = NULL;
    if (archs) {
        if (!json_is_array(archs) || json_array_size(archs) == 0 || !json_is_string(json_array_get(archs, 0)))
            return bad_type(x, "architectures", archs, "a non-empty list of strings");
        name = json_string_value(json_array_get(archs, 0));
    } else {
        const json_t *mt = jget(root, "model_type");
        if (!mt)
            return error_set(x->err, ATOMC_ERR_FORMAT,
                             "%s: key 'architectures' is missing (and there is no 'model_type' to infer it from)",
                             x->src);
        if (!json_is_string(mt)) return bad_type(x, "model_type", mt, "a string");
        for (size_t i = 0; i < sizeof model_types / sizeof model_types[0]; i++)
            if (!strcmp(model_types[i].model_type, json_string_value(mt))) name = model_types[i].architecture;
        if (!name) return check_model_type(x, root, c); // unknown: refused, listing the known ones
    }
    snprintf(c->architecture, sizeof c->architecture, "%s", name);
    c->arch = model_arch_from_name(name);
    if (c->arch == MODEL_ARCH_UNKNOWN) {
        char list[512];
        supported_list(list, sizeof list);
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: architecture '%s' is not supported (supported: %s)", x->src,
                         name, list);
    }
    return check_model_type(x, root, c);
}

static atomc_status parse_root(struct ctx *x, const json_t *root, struct model_config *c) {
    TRY(resolve_architecture(x, root, c));
    TRY(get_int(x, root, "hidden_size", true, 1, 1 << 20, &c->hidden_size));
    // Qwen3.5-MoE has no dense MLP and no intermediate_size (parse_linear_attention sets it).
    TRY(get_int(x, root, "intermediate_size", c->arch != MODEL_ARCH_QWEN3_5_MOE, 1, INT32_MAX, &c->intermediate_size));
    TRY(get_int(x, root, "num_hidden_layers", true, 1, INT32_MAX, &c->num_layers));
    if (c->num_layers > MODEL_MAX_LAYERS)
        return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: num_hidden_layers = %d exceeds the supported maximum %d",
                         x->src, c->num_layers, MODEL_MAX_LAYERS);
    TRY(get_int(x, root, "num_attention_heads", true, 1, 1 << 16, &c->num_heads));
    c->num_kv_heads = c->num_heads;
    TRY(get_int(x, root, "num_key_value_heads", false, 1, 1 << 16, &c->num_kv_heads));
    TRY(get_int(x, root, "vocab_size", true, 1, INT32_MAX, &c->vocab_size));
    c->head_dim = c->arch == MODEL_ARCH_MIMO_V2_FLASH ? 192 : c->hidden_size / c->num_heads;
    TRY(get_int(x, root, "head_dim", false, 1, 1 << 16, &c->head_dim));
    c->max_position_embeddings = 2048;
    TRY(get_int(x, root, "max_position_embeddings", false, 1, INT32_MAX, &c->max_position_embeddings));
    c->rms_norm_eps = c->arch == MODEL_ARCH_MIMO_V2_FLASH ? 1e-5f : 1e-6f; // MiMoV2FlashConfig's default
    // The MiMo-V2-Flash release names it layernorm_epsilon.
    if (c->arch == MODEL_ARCH_MIMO_V2_FLASH && !jget(root, "rms_norm_eps"))
        TRY(get_float(x, root, "layernorm_epsilon", false, &c->rms_norm_eps));
    TRY(get_float(x, root, "rms_norm_eps", false, &c->rms_norm_eps));

    // transformers' Qwen3NextConfig defaults partial_rotary_factor to 0.25 (Qwen3.5 inherits it);
    // Glm4MoeConfig to 0.5.
    const bool mimo = c->arch == MODEL_ARCH_MIMO_V2_FLASH;
    float partial_rotary = c->arch == MODEL_ARCH_QWEN3_NEXT || c->arch == MODEL_ARCH_QWEN3_5_MOE ? 0.25f
                           : c->arch == MODEL_ARCH_GLM4_MOE                                      ? 0.5f
                           : mimo                                                                ? 0.334f
                                                                                                 : 1.0f;
    if (!mimo) TRY(get_float(x, root, "partial_rotary_factor", false, &partial_rotary));
    float partial_sliding = partial_rotary;
    if (mimo && !jget(root, "rope_parameters")) {
        // MiMoV2FlashConfig's per-layer-type defaults; it reads no rope_theta / partial_rotary_factor
        // key outside rope_parameters. The release's format has them: rope_theta (full layers),
        // swa_rope_theta (sliding; default rope_theta) and one partial_rotary_factor for both.
        c->rope = (struct rope_config){.theta = 5000000.0f, .factor = 1.0f, .yarn_truncate = true};
        c->rope_sliding = (struct rope_config){.theta = 10000.0f, .factor = 1.0f, .yarn_truncate = true};
        if (mimo_original_format(root)) {
            TRY(get_float(x, root, "rope_theta", false, &c->rope.theta));
            c->rope_sliding.theta = c->rope.theta;
            TRY(get_float(x, root, "swa_rope_theta", false, &c->rope_sliding.theta));
            TRY(get_float(x, root, "partial_rotary_factor", false, &partial_rotary));
            partial_sliding = partial_rotary;
            if (!(c->rope.theta > 0.0f) || !(c->rope_sliding.theta > 0.0f))
                return error_set(x->err, ATOMC_ERR_FORMAT, "%s: rope_theta %g / swa_rope_theta %g must be positive",
                                 x->src, c->rope.theta, c->rope_sliding.theta);
            if (jget(root, "rope_scaling"))
                return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: rope_scaling with the original MiMo-V2-Flash "
                                 "config keys is not implemented", x->src);
        }
    } else {
        if (mimo) c->rope_sliding = (struct rope_config){.theta = 10000.0f, .factor = 1.0f, .yarn_truncate = true};
        TRY(parse_rope(x, root, c, &partial_rotary, &partial_sliding));
    }
    if (!(partial_rotary > 0.0f && partial_rotary <= 1.0f) || !(partial_sliding > 0.0f && partial_sliding <= 1.0f))
        return error_set(x->err, ATOMC_ERR_FORMAT, "%s: partial_rotary_factor = %g must be in (0, 1]", x->src,
                         partial_rotary > 0.0f && partial_rotary <= 1.0f ? partial_sliding : partial_rotary);
    c->rope.rotary_dim = (int)lroundf((float)c->head_dim * partial_rotary);
    if (mimo) {
        // HF's MiMo rotary embedding: dim = int(head_dim * factor), truncated; an odd dim gives
        // frequencies no NeoX-halves rotation reproduces, so it is refused.
        c->rope.rotary_dim = (int)((double)c->head_dim * (double)partial_rotary);
        c->rope_sliding.rotary_dim = (int)((double)c->head_dim * (double)partial_sliding);
        if (c->rope.rotary_dim % 2 || c->rope_sliding.rotary_dim % 2 || c->rope.rotary_dim <= 0 ||
            c->rope_sliding.rotary_dim <= 0)
            return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: rotary dims int(head_dim %d x partial_rotary_factor) = "
                             "%d (full) / %d (sliding) must be even and positive", x->src, c->head_dim,
                             c->rope.rotary_dim, c->rope_sliding.rotary_dim);
    }
    if (c->rope.original_max_position == 0 &&
        (c->rope.scaling == ROPE_SCALING_YARN || c->rope.scaling == ROPE_SCALING_DYNAMIC))
        c->rope.original_max_position = c->max_position_embeddings;

    TRY(get_bool(x, root, "tie_word_embeddings", &c->tie_word_embeddings));
    c->attention_bias = c->arch == MODEL_ARCH_GPT_OSS; // GptOssConfig's default
    TRY(get_bool(x, root, "attention_bias", &c->attention_bias));
    // o_proj follows attention_bias in Llama/Qwen3/GPT-OSS; GLM-4-MoE and DeepSeek-V3 never bias it.
    c->attention_out_bias = c->attention_bias && c->arch != MODEL_ARCH_GLM4_MOE && c->arch != MODEL_ARCH_DEEPSEEK_V3 &&
                            c->arch != MODEL_ARCH_GLM_MOE_DSA && c->arch != MODEL_ARCH_DEEPSEEK_V32;
    TRY(get_bool(x, root, "mlp_bias", &c->mlp_bias));
    c->qk_norm = c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3_MOE || c->arch == MODEL_ARCH_QWEN3_NEXT ||
                 c->arch == MODEL_ARCH_QWEN3_5_MOE;
    TRY(get_bool(x, root, "use_qk_norm", &c->qk_norm));
    snprintf(c->hidden_act, sizeof c->hidden_act, "silu");
    TRY(get_str(x, root, "hidden_act", c->hidden_act, sizeof c->hidden_act));
    TRY(parse_dtype(x, root, &c->torch_dtype));

    c->bos_token_id = -1;
    c->pad_token_id = -1;
    TRY(get_int(x, root, "bos_token_id", false, 0, INT32_MAX, &c->bos_token_id));
    TRY(get_int(x, root, "pad_token_id", false, 0, INT32_MAX, &c->pad_token_id));
    TRY(get_token_ids(x, root, "eos_token_id", c->eos_token_ids, &c->n_eos));
    TRY(check_special_ids(x, c->vocab_size, c->bos_token_id, c->pad_token_id, c->eos_token_ids, c->n_eos));

    // GptOssConfig's default when absent (an explicit null means no window, as in transformers).
    if (c->arch == MODEL_ARCH_GPT_OSS && !json_object_get(root, "sliding_window")) c->sliding_window = 128;
    if (mimo && !json_object_get(root, "sliding_window")) c->sliding_window = 129; // MiMoV2FlashConfig's default
    TRY(get_int(x, root, "sliding_window", false, 0, INT32_MAX, &c->sliding_window));
    TRY(parse_dsa(x, root, c));
    if (mimo && jget(root, "sliding_window_size")) {
        // As MiMoV2FlashConfig: the original checkpoints' key counts the previous tokens only.
        int sws = 0;
        TRY(get_int(x, root, "sliding_window_size", false, 0, INT32_MAX - 1, &sws));
        c->sliding_window = sws + 1;
    }
    TRY(parse_layer_types(x, root, c));
    c->attention_sinks = c->arch == MODEL_ARCH_GPT_OSS;

    TRY(parse_moe(x, root, c));
    TRY(parse_mimo(x, root, c));
    TRY(parse_gpt_oss(x, root, c));
    TRY(parse_linear_attention(x, root, c));

    TRY(get_int(x, root, "q_lora_rank", false, 0, INT32_MAX, &c->q_lora_rank));
    TRY(get_int(x, root, "kv_lora_rank", false, 0, INT32_MAX, &c->kv_lora_rank));
    TRY(get_int(x, root, "qk_nope_head_dim", false, 0, 1 << 16, &c->qk_nope_head_dim));
    TRY(get_int(x, root, "qk_rope_head_dim", false, 0, 1 << 16, &c->qk_rope_head_dim));
    TRY(get_int(x, root, "v_head_dim", false, 0, 1 << 16, &c->v_head_dim));
    if (c->kv_lora_rank > 0) {
        // MLA: RoPE covers only the qk_rope_head_dim part of each head (transformers'
        // DeepseekV3Config sets head_dim to it, so do we); DeepSeek's checkpoints store those
        // dims interleaved (rope_interleave, default true).
        if (c->qk_rope_head_dim > 0) c->head_dim = c->qk_rope_head_dim;
        c->rope.rotary_dim = c->qk_rope_head_dim;
        c->rope.interleaved = true;
        TRY(get_bool(x, root, "rope_interleave", &c->rope.interleaved));
    }
    if (c->arch == MODEL_ARCH_DEEPSEEK_V2 || c->arch == MODEL_ARCH_DEEPSEEK_V3 || c->arch == MODEL_ARCH_GLM_MOE_DSA ||
        c->arch == MODEL_ARCH_DEEPSEEK_V32) {
        snprintf(c->topk_method, sizeof c->topk_method, "%s", c->arch == MODEL_ARCH_DEEPSEEK_V2 ? "greedy" : "noaux_tc");
        TRY(get_str(x, root, "topk_method", c->topk_method, sizeof c->topk_method));
        if (strcmp(c->topk_method, "greedy") && strcmp(c->topk_method, "group_limited_greedy") &&
            strcmp(c->topk_method, "noaux_tc"))
            return error_set(x->err, ATOMC_ERR_UNSUPPORTED, "%s: key 'topk_method' = \"%s\" is not supported (greedy, "
                             "group_limited_greedy, noaux_tc)", x->src, c->topk_method);
        c->moe_layer_freq = 1;
        TRY(get_int(x, root, "moe_layer_freq", false, 1, MODEL_MAX_LAYERS, &c->moe_layer_freq));
        TRY(get_int(x, root, "num_nextn_predict_layers", false, 0, 64, &c->num_nextn_predict_layers));
    }
    return parse_quant_root(x, root, c);
}

atomc_status model_config_parse_json(struct model_config *c, const char *json, const char *source,
                                     struct error *err) {
    memset(c, 0, sizeof *c);
    struct ctx x = {.src = source ? source : "config.json", .err = err};
    json_error_t je;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", x.src, je.line, je.column,
                         je.text);
    atomc_status st;
    if (!json_is_object(root)) st = error_set(err, ATOMC_ERR_FORMAT, "%s: top level must be a JSON object", x.src);
    else st = parse_root(&x, root, c);
    json_decref(root);
    return st;
}

atomc_status model_config_parse_quant_file(struct model_config *c, const char *json, const char *source,
                                           const char *origin, enum quant_method default_method, struct error *err) {
    struct ctx x = {.src = source ? source : origin, .err = err};
    json_error_t je;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", x.src, je.line, je.column,
                         je.text);
    struct quant_config q;
    atomc_status st = parse_quant_object(&x, root, origin, default_method, &q);
    json_decref(root);
    if (st == ATOMC_OK) c->quant = q;
    return st;
}

atomc_status model_config_merge_generation_config(struct model_config *c, const char *json, const char *source,
                                                  struct error *err) {
    struct ctx x = {.src = source ? source : "generation_config.json", .err = err};
    json_error_t je;
    json_t *root = json_loads(json, 0, &je);
    if (!root)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", x.src, je.line, je.column,
                         je.text);
    atomc_status st = ATOMC_OK;
    if (!json_is_object(root)) {
        st = error_set(err, ATOMC_ERR_FORMAT, "%s: top level must be a JSON object", x.src);
    } else {
        int ids[MODEL_MAX_EOS], n = 0, bos = c->bos_token_id, pad = c->pad_token_id;
        st = get_token_ids(&x, root, "eos_token_id", ids, &n);
        if (!st) st = get_int(&x, root, "bos_token_id", false, 0, INT32_MAX, &bos);
        if (!st) st = get_int(&x, root, "pad_token_id", false, 0, INT32_MAX, &pad);
        if (!st && c->vocab_size > 0) st = check_special_ids(&x, c->vocab_size, bos, pad, ids, n);
        if (!st) { // all-or-nothing: c is untouched on error
            if (n > 0) {
                memcpy(c->eos_token_ids, ids, sizeof(int) * (size_t)n);
                c->n_eos = n;
            }
            c->bos_token_id = bos;
            c->pad_token_id = pad;
        }
    }
    json_decref(root);
    return st;
}

// a * b, saturated at INT64_MAX (inputs >= 0): products of counts read from a file, checked.
static int64_t mul_sat(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

static int64_t add_sat(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

// The per-token widths the model code keeps in int (model.c q_dim / kv_dim / qkv_dim, MLA and
// linear-attention projections and state, the fused gate/up width): each is computed here in
// checked 64-bit arithmetic from the file's counts and must fit an int, so no later product of
// them can wrap. Returns the first that does not, or NULL.
static const char *width_overflow(const struct model_config *c, int64_t *value) {
    int64_t H = c->num_heads, D = c->head_dim, q = mul_sat(H, D), kv = mul_sat(c->num_kv_heads, D);
    int64_t hk = c->linear_num_key_heads, hv = c->linear_num_value_heads;
    int64_t dk = c->linear_key_head_dim, dv = c->linear_value_head_dim;
    int64_t lin_conv = add_sat(mul_sat(2 * hk, dk), mul_sat(hv, dv));
    const struct {
        const char *what;
        int64_t v;
    } w[] = {
        {"num_attention_heads * head_dim * 2 (q and its gate)", mul_sat(q, 2)},
        {"(num_attention_heads + 2 * num_key_value_heads) * head_dim", add_sat(q, mul_sat(kv, 2))},
        {"2 * intermediate_size", mul_sat(c->intermediate_size, 2)},
        {"2 * moe_intermediate_size * num_experts_per_tok",
         mul_sat(mul_sat(c->moe_intermediate_size, 2), c->num_experts_per_tok > 1 ? c->num_experts_per_tok : 1)},
        {"2 * shared_expert_intermediate_size", mul_sat(c->shared_expert_intermediate_size, 2)},
        {"2 * n_shared_experts * moe_intermediate_size",
         mul_sat(mul_sat(c->n_shared_experts, 2), c->moe_intermediate_size)},
        {"num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)",
         mul_sat(H, (int64_t)c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim)},
        {"MLA q / kv projections", add_sat(add_sat(mul_sat(H, (int64_t)c->qk_nope_head_dim + c->qk_rope_head_dim),
                                                   (int64_t)c->kv_lora_rank + c->qk_rope_head_dim),
                                           mul_sat(c->q_lora_rank, 2))},
        {"linear attention q / k / v / z widths", add_sat(mul_sat(lin_conv, 1), mul_sat(mul_sat(hv, dv), 2))},
        {"linear attention state (heads * key dim * value dim)", mul_sat(mul_sat(hv, dk), dv)},
        {"linear attention conv state",
         mul_sat(lin_conv, c->linear_conv_kernel_dim > 0 ? c->linear_conv_kernel_dim : 1)},
    };
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (w[i].v > INT32_MAX) {
            *value = w[i].v;
            return w[i].what;
        }
    return NULL;
}

atomc_status model_config_validate(const struct model_config *c, const char *source, struct error *err) {
    const char *s = source ? source : "config";
#define BAD(...) return error_set(err, ATOMC_ERR_FORMAT, __VA_ARGS__)
    if (c->arch == MODEL_ARCH_UNKNOWN) return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: unknown architecture", s);
    if (c->hidden_size <= 0) BAD("%s: hidden_size must be positive", s);
    if (c->num_layers <= 0 || c->num_layers > MODEL_MAX_LAYERS)
        BAD("%s: num_hidden_layers = %d must be in [1, %d]", s, c->num_layers, MODEL_MAX_LAYERS);
    if (c->num_heads <= 0 || c->num_kv_heads <= 0) BAD("%s: attention head counts must be positive", s);
    if (c->num_heads % c->num_kv_heads != 0)
        BAD("%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)", s, c->num_heads,
            c->num_kv_heads);
    if (c->head_dim <= 0) BAD("%s: head_dim must be positive", s);
    if (c->vocab_size <= 0) BAD("%s: vocab_size must be positive", s);
    if (c->intermediate_size <= 0) BAD("%s: intermediate_size must be positive", s);
    if (!(c->rms_norm_eps > 0.0f)) BAD("%s: rms_norm_eps must be positive", s);
    if (!(c->rope.theta > 0.0f)) BAD("%s: rope_theta must be positive", s);
    int rope_head = c->kv_lora_rank > 0 ? c->qk_rope_head_dim : c->head_dim;
    if (c->rope.rotary_dim <= 0 || c->rope.rotary_dim % 2 != 0 || c->rope.rotary_dim > rope_head)
        BAD("%s: rotary dimension %d must be even and in (0, %d]", s, c->rope.rotary_dim, rope_head);
    if (c->rope.scaling == ROPE_SCALING_LLAMA3 && c->rope.original_max_position <= 0)
        BAD("%s: llama3 rope scaling needs original_max_position_embeddings", s);
    if (c->sliding_window < 0) BAD("%s: sliding_window must not be negative", s);
    for (int l = 0; l < c->num_layers; l++)
        if (c->layer_types[l] == LAYER_ATTN_SLIDING && c->sliding_window <= 0)
            BAD("%s: layer %d uses sliding attention but sliding_window is not set", s, l);
    int64_t wv;
    const char *wide = width_overflow(c, &wv);
    if (wide) {
        if (wv == INT64_MAX) BAD("%s: %s overflows 64 bits", s, wide);
        BAD("%s: %s = %lld exceeds %d", s, wide, (long long)wv, INT32_MAX);
    }
    if (c->bos_token_id >= c->vocab_size) BAD("%s: bos_token_id %d >= vocab_size %d", s, c->bos_token_id, c->vocab_size);
    if (c->pad_token_id >= c->vocab_size)
        BAD("%s: pad_token_id %d >= vocab_size %d", s, c->pad_token_id, c->vocab_size);
    if (c->n_eos < 0 || c->n_eos > MODEL_MAX_EOS) BAD("%s: bad number of eos tokens %d", s, c->n_eos);
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] < 0 || c->eos_token_ids[i] >= c->vocab_size)
            BAD("%s: eos_token_id %d is outside the vocabulary (%d)", s, c->eos_token_ids[i], c->vocab_size);
    if (strcmp(c->hidden_act, "silu") != 0 && strcmp(c->hidden_act, "swish") != 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: hidden_act \"%s\" is not supported (silu)", s, c->hidden_act);
    if (c->num_experts > 0) {
        if (c->num_experts_per_tok <= 0 || c->num_experts_per_tok > c->num_experts)
            BAD("%s: num_experts_per_tok = %d must be in [1, num_experts = %d]", s, c->num_experts_per_tok,
                c->num_experts);
        if (c->moe_intermediate_size <= 0) BAD("%s: moe_intermediate_size must be positive", s);
        if (c->n_group > 0 && (c->num_experts % c->n_group != 0 || c->topk_group <= 0 || c->topk_group > c->n_group))
            BAD("%s: n_group = %d / topk_group = %d do not divide %d experts", s, c->n_group, c->topk_group,
                c->num_experts);
        if (c->n_group > 1 && c->topk_group * (c->num_experts / c->n_group) < c->num_experts_per_tok)
            BAD("%s: topk_group = %d groups of %d experts hold fewer than num_experts_per_tok = %d", s, c->topk_group,
                c->num_experts / c->n_group, c->num_experts_per_tok);
    } else if (c->num_experts_per_tok > 0 && c->arch != MODEL_ARCH_LLAMA && c->arch != MODEL_ARCH_QWEN3) {
        BAD("%s: num_experts_per_tok is set but the number of experts is 0", s);
    }
    if (c->arch == MODEL_ARCH_DEEPSEEK_V3 || c->arch == MODEL_ARCH_DEEPSEEK_V2 || c->arch == MODEL_ARCH_GLM_MOE_DSA ||
        c->arch == MODEL_ARCH_DEEPSEEK_V32) {
        if (c->kv_lora_rank <= 0 || c->qk_rope_head_dim <= 0 || c->qk_nope_head_dim <= 0 || c->v_head_dim <= 0)
            BAD("%s: DeepSeek-V2/V3 need kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim", s);
    }
#undef BAD
    return ATOMC_OK;
}
