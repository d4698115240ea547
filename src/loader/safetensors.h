// safetensors reader: single files and sharded checkpoints (model.safetensors.index.json).
//
// Format: u64 little-endian header length N, N bytes of JSON header (an object mapping
// tensor names to {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
// "__metadata__" object that we skip), then the data buffer; offsets are relative to it.
//
// Contract:
// - safetensors_open() mmaps the file; tensors are views into the mapping (no copies),
//   valid until safetensors_close(). safetensors_open_memory() parses a caller-owned
//   buffer (fuzzing, tests) that must outlive the handle.
// - Everything is validated at open: header length vs file size, header is a JSON object,
//   each entry's dtype/shape/data_offsets types, offsets inside the data buffer and equal
//   to numel * element size, no two tensors overlapping. A violation is ATOMC_ERR_FORMAT
//   with a message naming the file and the tensor.
// - Recognised dtypes: F32, F16, BF16 (compute), I32, I64, U8, F8_E4M3 (metadata / FP8
//   checkpoints). Other dtypes (F64, I8, BOOL, F8_E5M2, ...) are listed and size-checked
//   where their size is known, but fetching one is ATOMC_ERR_UNSUPPORTED naming the
//   tensor and its dtype; so are tensors with more than TENSOR_MAX_DIMS dimensions.
//   A 0-d (scalar) tensor is served as shape [1].
// - The data buffer starts at byte 8 + N, which writers pad to 8 bytes; a tensor's data
//   pointer is therefore only as aligned as the writer made it.
#ifndef ATOMC_LOADER_SAFETENSORS_H
#define ATOMC_LOADER_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "common/mapped_file.h"
#include "core/tensor.h"

#define SAFETENSORS_MAX_HEADER (100u << 20) // the format's own cap on the JSON header
#define SAFETENSORS_MAX_NDIM 8               // shapes with more dims are rejected as corrupt

struct safetensors_tensor {
    char *name;              // owned
    char dtype_name[16];     // as written in the header ("BF16", "F64", ...)
    bool supported;          // dtype recognised and ndim <= TENSOR_MAX_DIMS
    enum dtype dtype;        // valid if supported
    int ndim;
    int64_t ne[SAFETENSORS_MAX_NDIM]; // shape, outermost first (row-major, as in the file)
    uint64_t begin, end;     // byte offsets into the data buffer
    const void *data;        // view into the file
};

struct safetensors_file {
    char *path;                      // for messages (owned)
    struct mapped_file map;          // valid when opened from a path
    const unsigned char *data;       // whole file
    size_t size;
    uint64_t header_len;             // N
    size_t n_tensors;
    struct safetensors_tensor *tensors; // sorted by name
};

atomc_status safetensors_open(struct safetensors_file **out, const char *path, struct error *err);
atomc_status safetensors_open_memory(struct safetensors_file **out, const void *data, size_t size, const char *name,
                                     struct error *err);
void safetensors_close(struct safetensors_file *f);

const struct safetensors_tensor *safetensors_find(const struct safetensors_file *f, const char *name);
// A view of a tensor: NOT_FOUND if absent, UNSUPPORTED for dtypes/ranks atomc does not handle.
atomc_status safetensors_get_tensor(const struct safetensors_file *f, const char *name, struct tensor *out,
                                    struct error *err);

// --- A checkpoint: one file or a sharded set ------------------------------------
struct safetensors_entry {
    const char *name;                      // points into the owning file's tensor
    struct safetensors_file *file;
    const struct safetensors_tensor *tensor;
};

struct safetensors_set {
    char *index_path;                      // the index.json, or NULL for a single file
    size_t n_files;
    struct safetensors_file **files;       // (n_files)
    size_t n_entries;
    struct safetensors_entry *entries;     // sorted by name
};

// `path` is a model directory (model.safetensors.index.json preferred, else
// model.safetensors), an index .json file, or a single .safetensors file. For an index,
// every tensor of weight_map must exist in the shard it names (else FORMAT naming the
// index, the shard and the tensor); shard names must be plain file names in the same
// directory.
atomc_status safetensors_set_open(struct safetensors_set **out, const char *path, struct error *err);
void safetensors_set_close(struct safetensors_set *s);
const struct safetensors_entry *safetensors_set_find(const struct safetensors_set *s, const char *name);
// Like safetensors_get_tensor; *file_out (may be NULL) gets the shard's path, for messages.
atomc_status safetensors_set_get_tensor(const struct safetensors_set *s, const char *name, struct tensor *out,
                                        const char **file_out, struct error *err);

#endif
