// A tensor is a typed view of memory owned by someone else (a backend allocation, an
// mmapped file, an arena). Shapes are row-major: ne[ndim-1] is the contiguous dimension.
#ifndef ATOMC_CORE_TENSOR_H
#define ATOMC_CORE_TENSOR_H

#include <stdint.h>

#include "core/dtype.h"

#define TENSOR_MAX_DIMS 4

struct tensor {
    enum dtype dtype;
    int ndim;
    int64_t ne[TENSOR_MAX_DIMS]; // shape, outermost first
    void *data;                  // host or device memory, per the owning backend
    float scale;                 // dequantisation scale for FP8 tensors (1.0 otherwise)
};

static inline int64_t tensor_numel(const struct tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->ne[i];
    return n;
}

static inline int64_t tensor_rows(const struct tensor *t) { return tensor_numel(t) / t->ne[t->ndim - 1]; }
static inline int64_t tensor_cols(const struct tensor *t) { return t->ne[t->ndim - 1]; }

static inline size_t tensor_bytes(const struct tensor *t) {
    return dtype_row_bytes(t->dtype, tensor_cols(t)) * (size_t)tensor_rows(t);
}

static inline struct tensor tensor_make(void *data, enum dtype dt, int ndim, const int64_t *ne) {
    struct tensor t = {.dtype = dt, .ndim = ndim, .data = data, .scale = 1.0f};
    for (int i = 0; i < ndim; i++) t.ne[i] = ne[i];
    return t;
}

static inline struct tensor tensor_2d(void *data, enum dtype dt, int64_t rows, int64_t cols) {
    int64_t ne[2] = {rows, cols};
    return tensor_make(data, dt, 2, ne);
}

#endif
