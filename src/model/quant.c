// Refusal of quantization schemes the engine does not implement. See quant.h.
#include "model/quant.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

// A scheme the engine runs: checkpoints whose every scheme matches a row load; the rest
// are refused. Fields: the method; its format (NULL = any); the weights' type, bits and
// strategy; the activation scheme; whether zero points (asymmetric weights) are handled.
struct quant_impl {
    enum quant_method method;
    const char *format;
    enum quant_num_type weight_type;
    int weight_bits;
    enum quant_strategy weight_strategy;
    enum quant_act_scheme act;
    bool asymmetric_ok;
};

// None yet: the quantized-weights issue adds rows here as each scheme's kernels land, e.g.
// {QUANT_METHOD_FP8, "e4m3", QUANT_TYPE_FLOAT, 8, QUANT_STRATEGY_BLOCK, QUANT_ACT_DYNAMIC, false}.
// The list ends with a QUANT_METHOD_NONE row.
static const struct quant_impl quant_implemented[] = {
    {QUANT_METHOD_NONE, NULL, QUANT_TYPE_NONE, 0, QUANT_STRATEGY_NONE, QUANT_ACT_NONE, false},
};

#define QUANT_SUPPORTED "supported: none (unquantized safetensors) and GGUF Q8_0/Q4_0/Q4_1"

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
    return r->method == q->method && (!r->format || !strcmp(r->format, s->format)) && s->weights.present &&
           r->weight_type == s->weights.type && r->weight_bits == s->weights.num_bits &&
           r->weight_strategy == s->weights.strategy && r->act == s->act_scheme &&
           (s->weights.symmetric || r->asymmetric_ok) && !s->output_act;
}

static bool scheme_implemented(const struct quant_config *q, const struct quant_scheme *s) {
    for (const struct quant_impl *r = quant_implemented; r->method != QUANT_METHOD_NONE; r++)
        if (impl_matches(r, q, s)) return true;
    return false;
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
    if (q->n_schemes > kept)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method '%s' lists %d schemes, more than the %d atomc "
                         "reads",
                         q->origin, q->method_name, q->n_schemes, QUANT_MAX_SCHEMES);
    if (q->kv_cache.present) {
        quant_args_describe(&q->kv_cache, d, sizeof d);
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: quant_method '%s': KV-cache quantization (%s) is not "
                         "implemented; use --kv-cache-dtype instead",
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
