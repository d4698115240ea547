// A weight matrix as the matmul and MoE expert ops take it: its values (struct tensor, in
// the storage dtype) plus the quantisation scheme those values need to mean anything, and the
// scale (and zero-point) tensors of that scheme.
//
// Schemes (how a stored value q at (row, col) becomes a real weight):
//   NONE        w = q                                   (F32/BF16/F16; GGUF Q8_0/Q4_0/Q4_1
//                                                        carry their block scales inside q)
//   PER_TENSOR  w = q * scale[0]                        (scale (1), or (E) for stacked experts)
//   PER_CHANNEL w = q * scale[row]                      (scale (rows))
//   BLOCK       w = q * scale[row / br][col / bc]       (scale (ceil(rows/br), ceil(cols/bc)),
//                                                        DeepSeek-V3's 128x128 FP8 blocks; a fused
//                                                        weight whose parts are not whole 128-row
//                                                        blocks has br = the gcd of 128 and the
//                                                        parts' rows: a backend whose kernels
//                                                        need br = 128 must check block_rows)
//   GROUP       w = (q - zero[row][col / g]) * scale[row][col / g]
//                                                       (INT4/INT8 along k, group g = block_cols;
//                                                        symmetric values packed in I32 words
//                                                        (compressed-tensors pack-quantized) are
//                                                        stored offset by 2^(bits-1), low bits
//                                                        first, so t is (rows, cols * bits / 32)
//                                                        and q = field - 2^(bits-1));
//                                                        zero (optional, asymmetric weights:
//                                                        compressed-tensors zero points, GPTQ's
//                                                        qzeros (+1 in the v1 format), AWQ's)
//                                                        is F32 in scale's layout, holding the
//                                                        integer zero point in q's units (so an
//                                                        unsigned 0..2^bits-1 zero z is stored
//                                                        as z - 2^(bits-1)); gidx (optional,
//                                                        GPTQ desc_act / actorder): I32 (cols),
//                                                        the group of column c instead of
//                                                        c / g (one map for every row; 2-D
//                                                        weights only)
//   MX          w = q * 2^(scale[row][col / 32] - 127)  (MXFP4, OCP microscaling: t is U8
//                                                        (rows, cols / 2), two e2m1 values per
//                                                        byte, the even column in the low
//                                                        nibble; scale is U8 (rows, cols / 32)
//                                                        e8m0 exponents; block_cols = 32;
//                                                        e2m1 nibbles: sign bit 3, magnitudes
//                                                        0, .5, 1, 1.5, 2, 3, 4, 6)
// Activation quantization (struct weight.act): what a W8A8 scheme does to the matmul's input x
// before the product, dynamically per call (the checkpoint's input_activations, or fp8 blocks'
// DeepSeek-style per-token 128-column groups). Every backend computes exactly this (the values
// and scales below, then out = sum_k deq(xq) * w in fp32), so the CPU stays the reference:
//   NONE        x as it is (weight-only, W8A16 / W4A16)
//   FP8_TOKEN   per row i: s_i = max_k |x_ik| / 448 (1 when the row is 0), xq = e4m3_rn(x / s_i)
//               (round to nearest even, saturating), deq = f32(xq) * s_i
//   FP8_GROUP   the same per row and group of ACT_QUANT_GROUP columns (the last may be short)
//   INT8_TOKEN  per row: s_i = max |x_ik| / 127 (1 when 0), xq = clamp(rint(x / s_i), -127, 127),
//               deq = xq * s_i (symmetric int8, round half to even)
//   FP8_STATIC  the same as FP8_TOKEN with s = act_scale for every row (the checkpoint's stored
//               per-tensor input_scale; static activations)
//   INT8_STATIC the same as INT8_TOKEN with s = act_scale
// The division is IEEE (x / s, not x * (1 / s)): the CPU and CUDA quantize identical inputs to
// identical bytes. act_quant_row (weight.c) is the reference implementation.
// A backend implements a subset (struct backend_caps.weight_schemes); model loading refuses a
// checkpoint whose scheme the backend lacks, so an op that meets an unsupported scheme is a
// programmer error (CHECK), never a silent wrong answer.
#ifndef ATOMC_CORE_WEIGHT_H
#define ATOMC_CORE_WEIGHT_H

#include <stdbool.h>

#include "core/tensor.h"

enum weight_scheme {
    WEIGHT_SCHEME_NONE = 0,
    WEIGHT_SCHEME_PER_TENSOR,
    WEIGHT_SCHEME_PER_CHANNEL,
    WEIGHT_SCHEME_BLOCK,
    WEIGHT_SCHEME_GROUP,
    WEIGHT_SCHEME_MX,
    WEIGHT_SCHEME_COUNT
};

enum weight_act {
    WEIGHT_ACT_NONE = 0,
    WEIGHT_ACT_FP8_TOKEN,
    WEIGHT_ACT_FP8_GROUP,
    WEIGHT_ACT_INT8_TOKEN,
    WEIGHT_ACT_FP8_STATIC,
    WEIGHT_ACT_INT8_STATIC,
    WEIGHT_ACT_COUNT
};

#define ACT_QUANT_GROUP 128
#define ACT_QUANT_FP8_MAX 448.0f
#define ACT_QUANT_INT8_MAX 127.0f

struct weight {
    struct tensor t;           // stored values: (rows, cols), or (E, rows, cols) for stacked experts
    enum weight_scheme scheme; // NONE: scale / zero unused (data == NULL)
    struct tensor scale;       // per scheme, see above
    struct tensor zero;        // GROUP with zero points (F32, scale's layout); else data == NULL
    struct tensor gidx;        // GROUP with a column -> group map (I32 (cols)); else data == NULL
    int block_rows, block_cols; // BLOCK: br x bc; GROUP / MX: 1 x group
    int bits;                   // values packed in I32 words (GROUP): bits per value; else 0
    enum weight_act act;        // quantization of the matmul's input (above); NONE = weight-only
    float act_scale;            // FP8_STATIC / INT8_STATIC: the stored input scale (> 0, finite)
};

static inline bool weight_act_static(enum weight_act a) {
    return a == WEIGHT_ACT_FP8_STATIC || a == WEIGHT_ACT_INT8_STATIC;
}
static inline bool weight_act_int8(enum weight_act a) {
    return a == WEIGHT_ACT_INT8_TOKEN || a == WEIGHT_ACT_INT8_STATIC;
}

// Columns (k) of a weight: t's last dim, times the values per word when packed in I32 (or
// per byte for MX).
static inline int64_t weight_cols(const struct weight *w) {
    int64_t c = tensor_cols(&w->t);
    if (w->scheme == WEIGHT_SCHEME_MX) return 2 * c;
    return w->t.dtype == DTYPE_I32 && w->bits > 0 ? c * (32 / w->bits) : c;
}

// A plain (unquantised) weight viewing tensor *tp, as a compound literal in the caller's
// scope: `ops->matmul(b, &out, &x, WEIGHT_PLAIN(&w), NULL)`.
#define WEIGHT_PLAIN(tp) (&(const struct weight){.t = *(tp), .scheme = WEIGHT_SCHEME_NONE})

const char *weight_scheme_name(enum weight_scheme s);
const char *weight_act_name(enum weight_act a); // "none", "fp8-token", "fp8-group128", "int8-token",
                                                // "fp8-static", "int8-static"

// Columns per activation scale of mode a for rows of k columns: ACT_QUANT_GROUP for FP8_GROUP,
// else k (one scale per row). Scales per row: ceil(k / that).
static inline int64_t act_quant_group_cols(enum weight_act a, int64_t k) {
    return a == WEIGHT_ACT_FP8_GROUP ? ACT_QUANT_GROUP : k;
}

// The reference quantization of one row x (k) under mode a (not NONE): writes the dequantized
// values deq (k) (f32(xq) * s, what the product multiplies) and, when q / s are non-NULL, the
// stored bytes q (k: e4m3 bits or int8) and the scales s (ceil(k / group cols)). Static modes
// use static_scale as s (the weight's act_scale); the dynamic ones ignore it.
void act_quant_row(enum weight_act a, const float *x, int64_t k, float static_scale, float *deq, uint8_t *q,
                   float *s);

// The e2m1 (FP4) value of a nibble (bits 0..3 of v), as MX stores it.
static inline float weight_e2m1_value(unsigned v) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (v & 8u) ? -mag[v & 7u] : mag[v & 7u];
}

#endif
