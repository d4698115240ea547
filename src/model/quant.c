// Refusal of quantization schemes the engine does not implement. See quant.h.
#include "model/quant.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "backend/backend.h"
#include "common/check.h"

// A scheme the engine runs: checkpoints whose every scheme matches a row load; the rest
// are refused. Fields: the method; its format (NULL = any); the weights' type, bits, strategy
// and block (BLOCK only); the activation scheme and, when activations are quantized, their
// strategy; whether zero points (asymmetric weights) are handled; then what the loader builds
// (struct quant_weight_plan).
struct quant_impl {
    enum quant_method method;
    const char *format;
    enum quant_num_type weight_type;
    int weight_bits;
    enum quant_strategy weight_strategy;
    int block_rows, block_cols;
    enum quant_act_scheme act;
    enum quant_strategy act_strategy;
    bool asymmetric_ok;
    enum weight_scheme scheme;
    enum dtype values_dtype;
    const char *values, *scale;
    bool shape_tensor;
    const char *what; // for messages: "FP8 e4m3 in 128x128 blocks"
    // Asymmetric / reordered integer weights and static activations (issue 19 part 3):
    bool actorder_ok;         // GPTQ desc_act / compressed-tensors actorder (a g_idx map) handled
    bool sym_refused;         // symmetric weights are not this row's (AWQ without zero points)
    enum quant_layout layout; // values / scales / zeros as the method stores them
    const char *zero, *gidx;  // tensor suffixes (NULL: none); zero only for asymmetric weights
    const char *input_scale;  // static activations: the stored scale's suffix
    bool act_int;             // the activations are INT8 (else FP8)
};

// The CPU backend runs each of these as weight-only compute (activations stay F32, the
// dequantized weights are the reference); a GPU backend adds the activation quantization the
// config states (dynamic per token, or per token and 128-channel group for fp8 blocks).
// The list ends with a QUANT_METHOD_NONE row.
// The part-3 fields (actorder_ok .. input_scale) default to none: rows name them when they need them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
static const struct quant_impl quant_implemented[] = {
    {QUANT_METHOD_FP8, "e4m3", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_BLOCK, 128, 128, QUANT_ACT_DYNAMIC,
     QUANT_STRATEGY_GROUP, false, WEIGHT_SCHEME_BLOCK, DTYPE_FP8_E4M3, "weight", "weight_scale_inv", false,
     "FP8 e4m3 weights in 128x128 blocks"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "float-quantized", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_CHANNEL, 0, 0,
     QUANT_ACT_DYNAMIC, QUANT_STRATEGY_TOKEN, false, WEIGHT_SCHEME_PER_CHANNEL, DTYPE_FP8_E4M3, "weight",
     "weight_scale", false, "FP8 e4m3 weights with per-channel scales"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "float-quantized", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_CHANNEL, 0, 0,
     QUANT_ACT_NONE, QUANT_STRATEGY_NONE, false, WEIGHT_SCHEME_PER_CHANNEL, DTYPE_FP8_E4M3, "weight", "weight_scale",
     false, "FP8 e4m3 weights with per-channel scales"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "float-quantized", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_TENSOR, 0, 0,
     QUANT_ACT_DYNAMIC, QUANT_STRATEGY_TOKEN, false, WEIGHT_SCHEME_PER_TENSOR, DTYPE_FP8_E4M3, "weight", "weight_scale",
     false, "FP8 e4m3 weights with per-tensor scales"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "float-quantized", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_TENSOR, 0, 0,
     QUANT_ACT_NONE, QUANT_STRATEGY_NONE, false, WEIGHT_SCHEME_PER_TENSOR, DTYPE_FP8_E4M3, "weight", "weight_scale",
     false, "FP8 e4m3 weights with per-tensor scales"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "pack-quantized", QUANT_TYPE_INT, 4, QUANT_STRATEGY_GROUP, 0, 0, QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE, true, WEIGHT_SCHEME_GROUP, DTYPE_I32, "weight_packed", "weight_scale", true,
     "INT4 weights packed in int32 with group scales (and zero points)", .actorder_ok = true,
     .zero = "weight_zero_point", .gidx = "weight_g_idx"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "pack-quantized", QUANT_TYPE_INT, 8, QUANT_STRATEGY_GROUP, 0, 0, QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE, true, WEIGHT_SCHEME_GROUP, DTYPE_I32, "weight_packed", "weight_scale", true,
     "INT8 weights packed in int32 with group scales (and zero points)", .actorder_ok = true,
     .zero = "weight_zero_point", .gidx = "weight_g_idx"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "pack-quantized", QUANT_TYPE_INT, 4, QUANT_STRATEGY_CHANNEL, 0, 0, QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE, true, WEIGHT_SCHEME_GROUP, DTYPE_I32, "weight_packed", "weight_scale", true,
     "INT4 weights packed in int32 with per-channel scales (and zero points)", .zero = "weight_zero_point"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "pack-quantized", QUANT_TYPE_INT, 8, QUANT_STRATEGY_CHANNEL, 0, 0, QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE, true, WEIGHT_SCHEME_GROUP, DTYPE_I32, "weight_packed", "weight_scale", true,
     "INT8 weights packed in int32 with per-channel scales (and zero points)", .zero = "weight_zero_point"},
    // Static FP8 activations: one stored input_scale per module (compressed-tensors dynamic: false,
    // strategy tensor; quant_method fp8 with activation_scheme static and per-tensor weights).
    {QUANT_METHOD_COMPRESSED_TENSORS, "float-quantized", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_CHANNEL, 0, 0,
     QUANT_ACT_STATIC, QUANT_STRATEGY_TENSOR, false, WEIGHT_SCHEME_PER_CHANNEL, DTYPE_FP8_E4M3, "weight",
     "weight_scale", false, "FP8 e4m3 weights with per-channel scales, static FP8 activations",
     .input_scale = "input_scale"},
    {QUANT_METHOD_COMPRESSED_TENSORS, "float-quantized", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_TENSOR, 0, 0,
     QUANT_ACT_STATIC, QUANT_STRATEGY_TENSOR, false, WEIGHT_SCHEME_PER_TENSOR, DTYPE_FP8_E4M3, "weight", "weight_scale",
     false, "FP8 e4m3 weights with per-tensor scales, static FP8 activations", .input_scale = "input_scale"},
    {QUANT_METHOD_FP8, "e4m3", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_TENSOR, 0, 0, QUANT_ACT_STATIC,
     QUANT_STRATEGY_TENSOR, false, WEIGHT_SCHEME_PER_TENSOR, DTYPE_FP8_E4M3, "weight", "weight_scale", false,
     "FP8 e4m3 weights with per-tensor scales, static FP8 activations", .input_scale = "input_scale"},
    // compressed-tensors int-quantized (llm-compressor W8A8 INT8): int8 weights per channel,
    // INT8 activations dynamic per token (as vLLM computes them: amax / 127) or static per tensor.
    {QUANT_METHOD_COMPRESSED_TENSORS, "int-quantized", QUANT_TYPE_INT, 8, QUANT_STRATEGY_CHANNEL, 0, 0,
     QUANT_ACT_DYNAMIC, QUANT_STRATEGY_TOKEN, false, WEIGHT_SCHEME_GROUP, DTYPE_I32, "weight", "weight_scale", false,
     "INT8 weights per channel, dynamic per-token INT8 activations", .layout = QUANT_LAYOUT_CT_INT8, .act_int = true},
    {QUANT_METHOD_COMPRESSED_TENSORS, "int-quantized", QUANT_TYPE_INT, 8, QUANT_STRATEGY_CHANNEL, 0, 0,
     QUANT_ACT_STATIC, QUANT_STRATEGY_TENSOR, false, WEIGHT_SCHEME_GROUP, DTYPE_I32, "weight", "weight_scale", false,
     "INT8 weights per channel, static INT8 activations", .layout = QUANT_LAYOUT_CT_INT8, .input_scale = "input_scale",
     .act_int = true},
    // GPTQ (v1 "gptq": stored zeros are the zero minus 1; "gptq_v2": the zero) and AWQ GEMM, 4 / 8
    // bits (AWQ 4), group or channel (group_size -1), converted at load to packed GROUP rows.
    {QUANT_METHOD_GPTQ,
     "gptq",
     QUANT_TYPE_INT,
     4,
     QUANT_STRATEGY_GROUP,
     0,
     0,
     QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE,
     true,
     WEIGHT_SCHEME_GROUP,
     DTYPE_I32,
     "qweight",
     "scales",
     false,
     "GPTQ INT4 with group scales and zeros",
     .actorder_ok = true,
     .layout = QUANT_LAYOUT_GPTQ,
     .zero = "qzeros",
     .gidx = "g_idx"},
    {QUANT_METHOD_GPTQ,
     "gptq",
     QUANT_TYPE_INT,
     8,
     QUANT_STRATEGY_GROUP,
     0,
     0,
     QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE,
     true,
     WEIGHT_SCHEME_GROUP,
     DTYPE_I32,
     "qweight",
     "scales",
     false,
     "GPTQ INT8 with group scales and zeros",
     .actorder_ok = true,
     .layout = QUANT_LAYOUT_GPTQ,
     .zero = "qzeros",
     .gidx = "g_idx"},
    {QUANT_METHOD_GPTQ,
     "gptq",
     QUANT_TYPE_INT,
     4,
     QUANT_STRATEGY_CHANNEL,
     0,
     0,
     QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE,
     true,
     WEIGHT_SCHEME_GROUP,
     DTYPE_I32,
     "qweight",
     "scales",
     false,
     "GPTQ INT4 with per-channel scales and zeros",
     .actorder_ok = true,
     .layout = QUANT_LAYOUT_GPTQ,
     .zero = "qzeros",
     .gidx = "g_idx"},
    {QUANT_METHOD_GPTQ,
     "gptq",
     QUANT_TYPE_INT,
     8,
     QUANT_STRATEGY_CHANNEL,
     0,
     0,
     QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE,
     true,
     WEIGHT_SCHEME_GROUP,
     DTYPE_I32,
     "qweight",
     "scales",
     false,
     "GPTQ INT8 with per-channel scales and zeros",
     .actorder_ok = true,
     .layout = QUANT_LAYOUT_GPTQ,
     .zero = "qzeros",
     .gidx = "g_idx"},
    {QUANT_METHOD_GPTQ,
     "gptq_v2",
     QUANT_TYPE_INT,
     4,
     QUANT_STRATEGY_GROUP,
     0,
     0,
     QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE,
     true,
     WEIGHT_SCHEME_GROUP,
     DTYPE_I32,
     "qweight",
     "scales",
     false,
     "GPTQ v2 INT4 with group scales and zeros",
     .actorder_ok = true,
     .layout = QUANT_LAYOUT_GPTQ,
     .zero = "qzeros",
     .gidx = "g_idx"},
    {QUANT_METHOD_GPTQ,
     "gptq_v2",
     QUANT_TYPE_INT,
     8,
     QUANT_STRATEGY_GROUP,
     0,
     0,
     QUANT_ACT_NONE,
     QUANT_STRATEGY_NONE,
     true,
     WEIGHT_SCHEME_GROUP,
     DTYPE_I32,
     "qweight",
     "scales",
     false,
     "GPTQ v2 INT8 with group scales and zeros",
     .actorder_ok = true,
     .layout = QUANT_LAYOUT_GPTQ,
     .zero = "qzeros",
     .gidx = "g_idx"},
    {QUANT_METHOD_AWQ, "gemm", QUANT_TYPE_INT, 4, QUANT_STRATEGY_GROUP, 0, 0, QUANT_ACT_NONE, QUANT_STRATEGY_NONE, true,
     WEIGHT_SCHEME_GROUP, DTYPE_I32, "qweight", "scales", false, "AWQ GEMM INT4 with group scales and zeros",
     .sym_refused = true, .layout = QUANT_LAYOUT_AWQ, .zero = "qzeros"},
    // GPT-OSS's experts (the only modules transformers' mxfp4 quantizer converts): stored as
    // <experts tensor>_blocks / _scales, read by the stacked-experts loader (weight_loader.c).
    {QUANT_METHOD_MXFP4, NULL, QUANT_TYPE_FLOAT, 4, QUANT_STRATEGY_GROUP, 0, 0, QUANT_ACT_NONE, QUANT_STRATEGY_NONE,
     false, WEIGHT_SCHEME_MX, DTYPE_U8, "blocks", "scales", false, "MXFP4 experts (e2m1 values, e8m0 scales per 32)"},
    {QUANT_METHOD_NONE, NULL, QUANT_TYPE_NONE, 0, QUANT_STRATEGY_NONE, 0, 0, QUANT_ACT_NONE, QUANT_STRATEGY_NONE, false,
     WEIGHT_SCHEME_NONE, DTYPE_F32, NULL, NULL, false, NULL},
};
#pragma GCC diagnostic pop

#define QUANT_SUPPORTED                                                                                                \
    "supported: none (unquantized safetensors), GGUF Q8_0/Q4_0/Q4_1, fp8 e4m3 with weight_block_size [128, 128] "      \
    "and dynamic activations, fp8 per-tensor weights with static activations, compressed-tensors float-quantized "     \
    "FP8 (channel or tensor weights; no, dynamic per-token or static per-tensor activations), compressed-tensors "     \
    "pack-quantized INT4 / INT8 with group or channel scales, symmetric or with zero points, actorder (weight-only), " \
    "compressed-tensors int-quantized INT8 per channel with dynamic per-token or static INT8 activations, "            \
    "gptq / gptq_v2 INT4 / INT8 (group or channel, sym or asym, desc_act), awq gemm INT4 with zero points, mxfp4 "     \
    "(GptOssForCausalLM experts)"

const char *quant_method_name(enum quant_method m) {
    switch (m) {
    case QUANT_METHOD_NONE:
        return "none";
    case QUANT_METHOD_FP8:
        return "fp8";
    case QUANT_METHOD_COMPRESSED_TENSORS:
        return "compressed-tensors";
    case QUANT_METHOD_GPTQ:
        return "gptq";
    case QUANT_METHOD_AWQ:
        return "awq";
    case QUANT_METHOD_MXFP4:
        return "mxfp4";
    case QUANT_METHOD_BITSANDBYTES:
        return "bitsandbytes";
    case QUANT_METHOD_MODELOPT:
        return "modelopt";
    case QUANT_METHOD_OTHER:
        return "other";
    }
    return "?";
}

const char *quant_strategy_name(enum quant_strategy s) {
    switch (s) {
    case QUANT_STRATEGY_NONE:
        return "none";
    case QUANT_STRATEGY_TENSOR:
        return "tensor";
    case QUANT_STRATEGY_CHANNEL:
        return "channel";
    case QUANT_STRATEGY_GROUP:
        return "group";
    case QUANT_STRATEGY_BLOCK:
        return "block";
    case QUANT_STRATEGY_TOKEN:
        return "token";
    case QUANT_STRATEGY_TENSOR_GROUP:
        return "tensor_group";
    case QUANT_STRATEGY_ATTN_HEAD:
        return "attn_head";
    case QUANT_STRATEGY_OTHER:
        return "other";
    }
    return "?";
}

const char *quant_type_name(enum quant_num_type t) {
    switch (t) {
    case QUANT_TYPE_NONE:
        return "none";
    case QUANT_TYPE_INT:
        return "int";
    case QUANT_TYPE_FLOAT:
        return "float";
    case QUANT_TYPE_OTHER:
        return "other";
    }
    return "?";
}

const char *quant_act_scheme_name(enum quant_act_scheme a) {
    switch (a) {
    case QUANT_ACT_NONE:
        return "none";
    case QUANT_ACT_DYNAMIC:
        return "dynamic";
    case QUANT_ACT_STATIC:
        return "static";
    }
    return "?";
}

// Appends to buf[cap] at *n, never past cap (the output is cut, and stays NUL-terminated).
static void put(char *buf, size_t cap, size_t *n, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t cap, size_t *n, const char *fmt, ...) {
    if (*n >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *n, cap - *n, fmt, ap);
    va_end(ap);
    if (k > 0) *n = *n + (size_t)k < cap ? *n + (size_t)k : cap;
}

void quant_args_describe(const struct quant_args *a, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    if (!a->present) {
        put(buf, cap, &n, "not quantized");
        return;
    }
    bool named = a->type == QUANT_TYPE_INT || a->type == QUANT_TYPE_FLOAT;
    if (a->num_bits <= 0)
        put(buf, cap, &n, "%s", named ? quant_type_name(a->type) : "of an unknown type");
    else if (named)
        put(buf, cap, &n, "%s%d", quant_type_name(a->type), a->num_bits);
    else
        put(buf, cap, &n, "%d-bit", a->num_bits);
    if (a->dynamic) put(buf, cap, &n, " dynamic");
    const char *sname = a->strategy == QUANT_STRATEGY_OTHER && a->strategy_name[0] ? a->strategy_name
                                                                                   : quant_strategy_name(a->strategy);
    put(buf, cap, &n, ", strategy %s", sname);
    if (a->strategy == QUANT_STRATEGY_BLOCK || a->block_size[0])
        put(buf, cap, &n, " [%d, %d]", a->block_size[0], a->block_size[1]);
    if (a->group_size) put(buf, cap, &n, ", group_size %d", a->group_size);
    if (!a->symmetric) put(buf, cap, &n, ", asymmetric");
    if (a->actorder[0]) put(buf, cap, &n, ", actorder %s", a->actorder);
}

void quant_scheme_describe(const struct quant_scheme *s, char *buf, size_t cap) {
    size_t n = 0;
    char a[160];
    buf[0] = '\0';
    if (s->format[0]) put(buf, cap, &n, "format %s; ", s->format);
    quant_args_describe(&s->weights, a, sizeof a);
    put(buf, cap, &n, "weights %s; ", a);
    quant_args_describe(&s->input_act, a, sizeof a);
    put(buf, cap, &n, "activations %s", a);
    if (s->output_act) put(buf, cap, &n, "; output activations quantized");
}

void quant_config_describe(const struct quant_config *q, char *buf, size_t cap) {
    size_t n = 0;
    char d[400];
    buf[0] = '\0';
    if (!q->present) {
        put(buf, cap, &n, "none");
        return;
    }
    put(buf, cap, &n, "%s: quant_method '%s'", q->origin, q->method_name);
    if (q->format[0]) put(buf, cap, &n, ", format %s", q->format);
    int kept = q->n_schemes < QUANT_MAX_SCHEMES ? q->n_schemes : QUANT_MAX_SCHEMES;
    for (int i = 0; i < kept; i++) {
        const struct quant_scheme *s = &q->schemes[i];
        quant_scheme_describe(s, d, sizeof d);
        put(buf, cap, &n, "\n  %s", s->name);
        if (s->n_targets) {
            put(buf, cap, &n, " (targets");
            for (int t = 0; t < s->n_targets && t < QUANT_MAX_TARGETS; t++)
                put(buf, cap, &n, " %s", s->targets[t]);
            if (s->n_targets > QUANT_MAX_TARGETS) put(buf, cap, &n, " +%d more", s->n_targets - QUANT_MAX_TARGETS);
            put(buf, cap, &n, ")");
        }
        put(buf, cap, &n, ": %s", d);
    }
    if (q->n_schemes > kept) put(buf, cap, &n, "\n  +%d more scheme(s)", q->n_schemes - kept);
    if (q->kv_cache.present) {
        quant_args_describe(&q->kv_cache, d, sizeof d);
        put(buf, cap, &n, "\n  kv cache: %s", d);
    }
    if (q->sparsity_format[0]) put(buf, cap, &n, "\n  sparsity: %s", q->sparsity_format);
    if (q->n_ignore) {
        put(buf, cap, &n, "\n  not quantized (%d):", q->n_ignore);
        for (int i = 0; i < q->n_ignore && i < QUANT_MAX_IGNORE; i++)
            put(buf, cap, &n, " %s", q->ignore[i]);
        if (q->n_ignore > QUANT_MAX_IGNORE) put(buf, cap, &n, " +%d more", q->n_ignore - QUANT_MAX_IGNORE);
    }
}

static bool impl_matches(const struct quant_impl *r, const struct quant_config *q, const struct quant_scheme *s) {
    const struct quant_args *w = &s->weights, *a = &s->input_act;
    if (r->method != q->method || (r->format && strcmp(r->format, s->format)) || !w->present) return false;
    if (r->weight_type != w->type || r->weight_bits != w->num_bits || r->weight_strategy != w->strategy) return false;
    if (w->dynamic || (w->actorder[0] && !r->actorder_ok) || (!w->symmetric && !r->asymmetric_ok) || s->output_act)
        return false;
    if (w->symmetric && r->sym_refused) return false;
    // compressed-tensors actorder: "group" stores weight_g_idx, "weight" permutes nothing at run time.
    if (w->actorder[0] && r->method == QUANT_METHOD_COMPRESSED_TENSORS && strcmp(w->actorder, "group") &&
        strcmp(w->actorder, "weight"))
        return false;
    if (r->weight_strategy == QUANT_STRATEGY_BLOCK &&
        (w->block_size[0] != r->block_rows || w->block_size[1] != r->block_cols))
        return false;
    if (r->weight_strategy == QUANT_STRATEGY_GROUP && w->group_size <= 0) return false;
    if (r->act != s->act_scheme) return false;
    if (r->act != QUANT_ACT_NONE && (a->type != (r->act_int ? QUANT_TYPE_INT : QUANT_TYPE_FLOAT) || a->num_bits != 8 ||
                                     a->strategy != r->act_strategy || !a->symmetric))
        return false;
    return true;
}

static const struct quant_impl *scheme_impl(const struct quant_config *q, const struct quant_scheme *s) {
    for (const struct quant_impl *r = quant_implemented; r->method != QUANT_METHOD_NONE; r++)
        if (impl_matches(r, q, s)) return r;
    return NULL;
}

static bool scheme_implemented(const struct quant_config *q, const struct quant_scheme *s) {
    return scheme_impl(q, s) != NULL;
}

bool model_quant_kv_fp8(const struct model_config *c) {
    const struct quant_config *q = &c->quant;
    const struct quant_args *a = &q->kv_cache;
    return q->present && (q->method == QUANT_METHOD_COMPRESSED_TENSORS || q->method == QUANT_METHOD_FP8) &&
           a->present && a->type == QUANT_TYPE_FLOAT &&
           a->num_bits == 8 && a->strategy == QUANT_STRATEGY_TENSOR && !a->dynamic && a->symmetric &&
           a->group_size == 0 && !a->block_size[0];
}

atomc_status model_quant_check(const struct model_config *c, struct error *err) {
    const struct quant_config *q = &c->quant;
    if (!q->present) return ATOMC_OK;
    char d[400];
    if (q->n_schemes == 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: quant_method '%s'%s%s%s is not implemented; " QUANT_SUPPORTED,
                         q->origin, q->method_name, q->format[0] ? " (format " : "", q->format,
                         q->format[0] ? ")" : "");
    int kept = q->n_schemes < QUANT_MAX_SCHEMES ? q->n_schemes : QUANT_MAX_SCHEMES;
    for (int i = 0; i < kept; i++) {
        const struct quant_scheme *s = &q->schemes[i];
        if (scheme_implemented(q, s)) continue;
        quant_scheme_describe(s, d, sizeof d);
        char which[64] = "";
        if (q->n_schemes > 1) snprintf(which, sizeof which, "%.31s of %d: ", s->name, q->n_schemes);
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method '%s' (%s%s) is not implemented; " QUANT_SUPPORTED, q->origin, q->method_name,
                         which, d);
    }
    if (q->method == QUANT_METHOD_MXFP4 && c->arch != MODEL_ARCH_GPT_OSS)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method 'mxfp4' is implemented for GptOssForCausalLM's experts only, not for %s",
                         q->origin, c->architecture[0] ? c->architecture : model_arch_name(c->arch));
    if (q->n_schemes > kept)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method '%s' lists %d schemes, more than the %d atomc "
                         "reads",
                         q->origin, q->method_name, q->n_schemes, QUANT_MAX_SCHEMES);
    if (q->kv_cache.present && !model_quant_kv_fp8(c)) {
        quant_args_describe(&q->kv_cache, d, sizeof d);
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method '%s': KV-cache quantization (%s) is not implemented; only static "
                         "symmetric float8 with one scale per layer's K and V (strategy tensor: self_attn.k_scale "
                         "/ v_scale) is; use --kv-cache-dtype instead",
                         q->origin, q->method_name, d);
    }
    if (q->sparsity_format[0])
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: quant_method '%s': sparsity format '%s' is not implemented",
                         q->origin, q->method_name, q->sparsity_format);
    if (q->n_ignore > QUANT_MAX_IGNORE)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method '%s' leaves %d modules unquantized, more than the "
                         "%d atomc reads",
                         q->origin, q->method_name, q->n_ignore, QUANT_MAX_IGNORE);
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// Per-module plans

// Python's re.match(pattern, name): anchored at the start only. A pattern that does not
// compile matches nothing (the module then loads plain, and its scale tensors stay unread,
// which model_files_check_consumed refuses).
static bool regex_match_start(const char *pattern, const char *name) {
    int code;
    PCRE2_SIZE off;
    pcre2_code *re =
        pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED | PCRE2_UTF, &code, &off, NULL);
    if (!re) return false;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = pcre2_match(re, (PCRE2_SPTR)name, strlen(name), 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc >= 0;
}

// compressed-tensors' matching of a module name against a target / ignore entry: "re:"
// regexes, else the exact name; `linear_class` also lets the class name "Linear" match.
static bool ct_name_matches(const char *entry, const char *module, bool linear_class) {
    if (!strncmp(entry, "re:", 3)) return regex_match_start(entry + 3, module);
    if (linear_class && !strcmp(entry, "Linear")) return true;
    return !strcmp(entry, module);
}

// transformers' should_convert_module (modules_to_not_convert of the other methods): the key as a
// regex from the start of the name up to a module boundary ("layer.1" matches "layer.1.attn",
// not "layer.11.attn"; "mlp.gate" not "mlp.gate_proj"), or the key as a suffix of the name.
static bool hf_name_matches(const char *key, const char *module) {
    size_t n = strlen(module), k = strlen(key);
    if (n >= k && !strcmp(module + n - k, key)) return true;
    char pat[QUANT_NAME_MAX + 48];
    snprintf(pat, sizeof pat, "(?:%s)(?:(?<=\\.)|(?=\\.|$))", key);
    return regex_match_start(pat, module);
}

static bool module_ignored(const struct quant_config *q, const char *module) {
    for (int i = 0; i < q->n_ignore && i < QUANT_MAX_IGNORE; i++) {
        if (q->method == QUANT_METHOD_COMPRESSED_TENSORS ? ct_name_matches(q->ignore[i], module, false)
                                                         : hf_name_matches(q->ignore[i], module))
            return true;
    }
    return false;
}

static bool scheme_targets(const struct quant_config *q, const struct quant_scheme *s, const char *module) {
    if (q->method != QUANT_METHOD_COMPRESSED_TENSORS) return true; // single-scheme methods: every linear
    for (int t = 0; t < s->n_targets && t < QUANT_MAX_TARGETS; t++)
        if (ct_name_matches(s->targets[t], module, true)) return true;
    return false;
}

// The part-3 additions of a plan (zero points, g_idx, static activation scales, layouts), kept
// apart from the rest of model_quant_weight_plan.
static void quant_plan_extras(const struct quant_config *q, const struct quant_scheme *s, const struct quant_impl *r,
                              struct quant_weight_plan *plan) {
    plan->layout = r->layout;
    if (r->layout != QUANT_LAYOUT_CT) // GPTQ / AWQ store their zeros whatever sym says
        plan->zero = r->zero;
    else if (!s->weights.symmetric)
        plan->zero = r->zero;
    // GPTQ's g_idx is read when stored (a trivial one is dropped at load); compressed-tensors
    // writes weight_g_idx only for actorder "group".
    if (r->layout == QUANT_LAYOUT_GPTQ || !strcmp(s->weights.actorder, "group")) plan->gidx = r->gidx;
    plan->gptq_zero_plus_one = r->layout == QUANT_LAYOUT_GPTQ && strcmp(q->format, "gptq_v2") != 0;
    plan->gidx_required = s->weights.actorder[0] && strcmp(s->weights.actorder, "weight") != 0;
    if (r->act == QUANT_ACT_DYNAMIC && r->act_int) plan->act = WEIGHT_ACT_INT8_TOKEN;
    if (r->act == QUANT_ACT_STATIC) {
        plan->act = r->act_int ? WEIGHT_ACT_INT8_STATIC : WEIGHT_ACT_FP8_STATIC;
        plan->input_scale = r->input_scale;
    }
}

void model_quant_weight_plan(const struct model_config *c, const char *module, struct quant_weight_plan *plan) {
    const struct quant_config *q = &c->quant;
    *plan = (struct quant_weight_plan){.scheme = WEIGHT_SCHEME_NONE, .values = "weight"};
    // mxfp4 converts GPT-OSS's stacked experts only (loaded from their _blocks / _scales by the
    // stacked-experts loader); every linear `.weight` stays plain.
    if (!q->present || q->method == QUANT_METHOD_MXFP4 || module_ignored(q, module)) return;
    int kept = q->n_schemes < QUANT_MAX_SCHEMES ? q->n_schemes : QUANT_MAX_SCHEMES;
    for (int i = 0; i < kept; i++) {
        const struct quant_scheme *s = &q->schemes[i];
        if (!scheme_targets(q, s, module)) continue;
        const struct quant_impl *r = scheme_impl(q, s);
        CHECK_MSG(r, "model_quant_weight_plan: scheme %s of an unchecked config", s->name);
        plan->scheme = r->scheme;
        plan->values_dtype = r->values_dtype;
        plan->bits = r->weight_bits;
        plan->values = r->values;
        plan->scale = r->scale;
        plan->shape_tensor = r->shape_tensor;
        if (r->act == QUANT_ACT_DYNAMIC)
            plan->act = r->act_strategy == QUANT_STRATEGY_GROUP ? WEIGHT_ACT_FP8_GROUP : WEIGHT_ACT_FP8_TOKEN;
        quant_plan_extras(q, s, r, plan);
        if (r->scheme == WEIGHT_SCHEME_BLOCK) {
            plan->block_rows = r->block_rows;
            plan->block_cols = r->block_cols;
        } else if (r->scheme == WEIGHT_SCHEME_GROUP) { // per channel: one group per row (block_cols 0)
            plan->block_rows = 1;
            plan->block_cols = r->weight_strategy == QUANT_STRATEGY_CHANNEL ? 0 : s->weights.group_size;
        }
        return;
    }
}

atomc_status model_quant_check_backend(const struct model_config *c, const struct backend_caps *caps,
                                       struct error *err) {
    const struct quant_config *q = &c->quant;
    if (!q->present) return ATOMC_OK;
    int kept = q->n_schemes < QUANT_MAX_SCHEMES ? q->n_schemes : QUANT_MAX_SCHEMES;
    for (int i = 0; i < kept; i++) {
        const struct quant_impl *r = scheme_impl(q, &q->schemes[i]);
        if (!r) continue; // model_quant_check refuses it
        bool scheme_ok = caps->weight_schemes & BACKEND_CAP_BIT(r->scheme);
        bool dtype_ok = caps->weight_dtypes & BACKEND_CAP_BIT(r->values_dtype);
        if (!scheme_ok || !dtype_ok)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "%s: quant_method '%s' (%s): the %s backend does not implement the weight scheme "
                             "'%s' with %s values yet (its %s); the cpu backend runs it",
                             q->origin, q->method_name, r->what, caps->name, weight_scheme_name(r->scheme),
                             dtype_name(r->values_dtype),
                             !scheme_ok ? "kernels lack the scheme" : "matmuls lack the dtype");
    }
    return ATOMC_OK;
}
