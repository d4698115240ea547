// KV-cache scales from checkpoints (model_kv_scales_load, quant.h): the per-layer static scales
// an FP8 KV cache stores K / scale and V / scale with, as llm-compressor (compressed-tensors
// kv_cache_scheme) and vLLM's fp8 method lay them out.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "loader/model_files.h"
#include "model/model.h"
#include "model/quant.h"

// One stored scale: a single F32 / BF16 / F16 value, positive and finite. present false (and
// OK) when the checkpoint lacks the tensor.
static atomc_status kv_scale_read(struct model_files *f, const char *name, bool *present, float *out,
                                  struct error *err) {
    *present = model_files_has_tensor(f, name);
    if (!*present) return ATOMC_OK;
    struct tensor t;
    atomc_status st = model_files_get_tensor(f, name, &t, err);
    if (st != ATOMC_OK) return st;
    if (t.dtype != DTYPE_F32 && t.dtype != DTYPE_BF16 && t.dtype != DTYPE_F16)
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s: a KV-cache scale must be F32 / BF16 / F16, not %s", name,
                         dtype_name(t.dtype));
    if (tensor_numel(&t) != 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "tensor %s holds %lld KV-cache scales: per-head / per-channel KV-cache scales are not "
                         "implemented (one scale per layer's K and V is)",
                         name, (long long)tensor_numel(&t));
    dtype_to_f32(t.dtype, t.data, out, 1);
    if (!(*out > 0.0f) || !isfinite(*out))
        return error_set(err, ATOMC_ERR_FORMAT, "tensor %s: the KV-cache scale %g is not a positive finite number",
                         name, (double)*out);
    return ATOMC_OK;
}

// The first of the names (suffixes of the layer's "model.layers.<l>.self_attn.") the files hold.
static atomc_status kv_scale_find(struct model_files *f, int l, const char *const *suffixes, int n, bool *present,
                                  float *out, char *found, size_t cap, struct error *err) {
    *present = false;
    for (int i = 0; i < n && !*present; i++) {
        snprintf(found, cap, "model.layers.%d.self_attn.%s", l, suffixes[i]);
        atomc_status st = kv_scale_read(f, found, present, out, err);
        if (st != ATOMC_OK) return st;
    }
    return ATOMC_OK;
}

atomc_status model_kv_scales_load(struct model *m, struct model_files *f, struct error *err) {
    if (!f) return ATOMC_OK; // dummy weights: no scales (the KV cache keeps 1.0)
    const struct model_config *c = &m->cfg;
    const bool declared = model_quant_kv_fp8(c);
    // compressed-tensors: self_attn.k_scale (its KV observer's), older releases the k_proj /
    // v_proj output activations' scale; vLLM's fp8 method: the same k_scale / v_scale, or the
    // deprecated single kv_scale for both.
    static const char *const K[] = {"k_scale", "k_proj.output_scale"};
    static const char *const V[] = {"v_scale", "v_proj.output_scale"};
    static const char *const KV[] = {"kv_scale"};
    static const char *const REFUSED[] = {"q_scale", "k_zero_point", "v_zero_point", "prob_scale"};
    int n_scaled = 0;
    for (int l = 0; l < c->num_layers; l++) {
        struct cache_spec *s = &m->layer_cache[l];
        char kname[160], vname[160], kvname[160];
        bool hk, hv, hkv;
        float ks = 0, vs = 0, kvs = 0;
        atomc_status st = kv_scale_find(f, l, K, 2, &hk, &ks, kname, sizeof kname, err);
        if (st == ATOMC_OK) st = kv_scale_find(f, l, V, 2, &hv, &vs, vname, sizeof vname, err);
        if (st == ATOMC_OK) st = kv_scale_find(f, l, KV, 1, &hkv, &kvs, kvname, sizeof kvname, err);
        if (st != ATOMC_OK) return st;
        for (size_t i = 0; i < sizeof REFUSED / sizeof REFUSED[0]; i++) {
            char name[160];
            snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", l, REFUSED[i]);
            if (model_files_has_tensor(f, name))
                return error_set(err, ATOMC_ERR_UNSUPPORTED, "tensor %s: %s is not implemented (%s)", name,
                                 i == 0  ? "query quantization for FP8 attention (q_scale)"
                                 : i < 3 ? "asymmetric KV-cache quantization (zero points)"
                                         : "FP8 attention probabilities (prob_scale)",
                                 i < 3 && i > 0 ? "the KV cache takes one symmetric scale per layer's K and V"
                                                : "attention computes the query and probabilities unquantized");
        }
        const bool any = hk || hv || hkv;
        if (!any) {
            if (declared && (s->kind == CACHE_KIND_FULL || s->kind == CACHE_KIND_SLIDING))
                return error_set(err, ATOMC_ERR_FORMAT,
                                 "%s declares kv_cache_scheme (static float8 per tensor) but layer %d has no "
                                 "model.layers.%d.self_attn.k_scale / v_scale",
                                 c->quant.origin, l, l);
            continue;
        }
        if (s->kind != CACHE_KIND_FULL && s->kind != CACHE_KIND_SLIDING)
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "tensor %s: KV-cache scales for a %s cache (layer %d of %s) are not implemented",
                             hk   ? kname
                             : hv ? vname
                                  : kvname,
                             cache_kind_name(s->kind), l, c->architecture);
        if (hkv && (hk || hv))
            return error_set(err, ATOMC_ERR_FORMAT, "layer %d stores both %s and %s: one KV-cache scale form only", l,
                             kvname, hk ? kname : vname);
        // vLLM: the deprecated kv_scale serves K and V; a layer with one of k_scale / v_scale
        // uses it for both.
        if (hkv)
            ks = vs = kvs;
        else if (!hk)
            ks = vs;
        else if (!hv)
            vs = ks;
        s->k_scale = ks;
        s->v_scale = vs;
        n_scaled++;
    }
    if (n_scaled)
        LOG_INFO("KV-cache scales: %d of %d layers carry the checkpoint's K / V scales (used by an fp8 KV cache)",
                 n_scaled, c->num_layers);
    return ATOMC_OK;
}
