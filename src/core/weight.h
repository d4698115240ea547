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
//                                                        DeepSeek-V3's 128x128 FP8 blocks)
//   GROUP       w = (q - zero[row][col / g]) * scale[row][col / g]
//                                                       (INT4/INT8 along k, group g = block_cols)
//   MX          w = q * 2^(scale[row][col / 32] - 127)  (MXFP4: e2m1 values, e8m0 scales)
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
};

// A plain (unquantised) weight viewing tensor *tp, as a compound literal in the caller's
// scope: `ops->matmul(b, &out, &x, WEIGHT_PLAIN(&w), NULL)`.
#define WEIGHT_PLAIN(tp) (&(const struct weight){.t = *(tp), .scheme = WEIGHT_SCHEME_NONE})

const char *weight_scheme_name(enum weight_scheme s);

#endif
