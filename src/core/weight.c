// Names of the weight quantisation schemes and activation modes (core/weight.h), for messages,
// and the reference activation quantization act_quant_row.
#include "core/weight.h"

#include <math.h>

#include "common/check.h"

const char *weight_scheme_name(enum weight_scheme s) {
    switch (s) {
    case WEIGHT_SCHEME_NONE: return "none";
    case WEIGHT_SCHEME_PER_TENSOR: return "per-tensor";
    case WEIGHT_SCHEME_PER_CHANNEL: return "per-channel";
    case WEIGHT_SCHEME_BLOCK: return "block";
    case WEIGHT_SCHEME_GROUP: return "group";
    case WEIGHT_SCHEME_MX: return "mx";
    case WEIGHT_SCHEME_COUNT: break;
    }
    return "?";
}

const char *weight_act_name(enum weight_act a) {
    switch (a) {
    case WEIGHT_ACT_NONE: return "none";
    case WEIGHT_ACT_FP8_TOKEN: return "fp8-token";
    case WEIGHT_ACT_FP8_GROUP: return "fp8-group128";
    case WEIGHT_ACT_INT8_TOKEN: return "int8-token";
    case WEIGHT_ACT_FP8_STATIC: return "fp8-static";
    case WEIGHT_ACT_INT8_STATIC: return "int8-static";
    case WEIGHT_ACT_COUNT: break;
    }
    return "?";
}

void act_quant_row(enum weight_act a, const float *x, int64_t k, float static_scale, float *deq, uint8_t *q,
                   float *s) {
    CHECK(a > WEIGHT_ACT_NONE && a < WEIGHT_ACT_COUNT);
    const int64_t g = act_quant_group_cols(a, k);
    const bool int8 = weight_act_int8(a), stat = weight_act_static(a);
    const float qmax = int8 ? ACT_QUANT_INT8_MAX : ACT_QUANT_FP8_MAX;
    // Static int8 (compressed-tensors' int8 range) reaches -128; dynamic scales never pass 127.
    const float qmin = stat && int8 ? -128.0f : -127.0f;
    if (stat) CHECK_MSG(static_scale > 0.0f && isfinite(static_scale), "act_quant_row: static scale %g", static_scale);
    for (int64_t c0 = 0, gi = 0; c0 < k; c0 += g, gi++) {
        const int64_t c1 = c0 + g < k ? c0 + g : k;
        float sc = static_scale;
        if (!stat) {
            float amax = 0.0f;
            for (int64_t c = c0; c < c1; c++)
                amax = fmaxf(amax, fabsf(x[c]));
            sc = amax / qmax;
            if (!(sc > 0.0f)) sc = 1.0f; // all zero (or NaN: propagates through the values)
        }
        if (s) s[gi] = sc;
        for (int64_t c = c0; c < c1; c++) {
            float v = x[c] / sc;
            if (int8) {
                float r = isnan(v) ? 0.0f : rintf(v); // int8 has no NaN (CUDA's cvt.rni gives 0 too)
                r = r > 127.0f ? 127.0f : r < qmin ? qmin : r;
                if (q) q[c] = (uint8_t)(int8_t)r;
                deq[c] = r * sc;
            } else {
                uint8_t b = f32_to_fp8_e4m3(v);
                if (q) q[c] = b;
                deq[c] = fp8_e4m3_to_f32(b) * sc;
            }
        }
    }
}
