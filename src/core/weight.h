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
//                                                        and q = field - 2^(bits-1))
//   MX          w = q * 2^(scale[row][col / 32] - 127)  (MXFP4, OCP microscaling: t is U8
//                                                        (rows, cols / 2), two e2m1 values per
//                                                        byte, the even column in the low
//                                                        nibble; scale is U8 (rows, cols / 32)
//                                                        e8m0 exponents; block_cols = 32;
//                                                        e2m1 nibbles: sign bit 3, magnitudes
//                                                        0, .5, 1, 1.5, 2, 3, 4, 6)
// A backend implements a subset (struct backend_caps.weight_schemes); model loading refuses a
// checkpoint whose scheme the backend lacks, so an op that meets an unsupported scheme is a
// programmer error (CHECK), never a silent wrong answer.
#ifndef ATOMC_CORE_WEIGHT_H
#define ATOMC_CORE_WEIGHT_H

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

struct weight {
    struct tensor t;           // stored values: (rows, cols), or (E, rows, cols) for stacked experts
    enum weight_scheme scheme; // NONE: scale / zero unused (data == NULL)
    struct tensor scale;       // per scheme, see above
    struct tensor zero;        // GROUP with zero points; else data == NULL
    int block_rows, block_cols; // BLOCK: br x bc; GROUP / MX: 1 x group
    int bits;                   // values packed in I32 words (GROUP): bits per value; else 0
};

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

// The e2m1 (FP4) value of a nibble (bits 0..3 of v), as MX stores it.
static inline float weight_e2m1_value(unsigned v) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (v & 8u) ? -mag[v & 7u] : mag[v & 7u];
}

#endif
