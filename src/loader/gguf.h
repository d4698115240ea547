// GGUF (v2/v3, little-endian) reader: header, metadata key/values (all value types,
// nested arrays), tensor infos and tensor data views.
//
// Contract:
// - gguf_open() mmaps the file; gguf_open_memory() parses a caller-owned buffer that
//   must outlive the gguf_file. Every length, count, offset and shape read from the file
//   is validated against the buffer size before use, so a corrupt or hostile file yields
//   ATOMC_ERR_FORMAT (or UNSUPPORTED) with a message naming the file and the key or
//   tensor, never a crash or an allocation larger than the file justifies.
// - All metadata strings are copied once at open into storage owned by the gguf_file
//   and are NUL-terminated (their length is also available: GGUF strings may in
//   principle contain NUL bytes). Pointers stay valid until gguf_close().
// - Tensor shapes are converted to atomc's row-major order: `ne[0]` is the OUTERMOST
//   dimension (GGUF/ggml stores dims fastest-first; we reverse them). So llama.cpp's
//   token_embd.weight with ggml ne = [hidden, vocab] becomes ne = {vocab, hidden}.
// - Tensor data are views into the mapping (no copies). Supported element types are
//   F32, F16, BF16, Q8_0, Q4_0, Q4_1; tensors of other GGML types are listed (their
//   sizes are validated when the type is known) but gguf_get_tensor() returns
//   ATOMC_ERR_UNSUPPORTED naming the tensor and its type.
//
// Metadata accessors take a key and return ATOMC_ERR_NOT_FOUND if it is absent and
// ATOMC_ERR_FORMAT if it has an incompatible type; both name the file and key. Integer
// getters coerce between integer widths/signedness when the value fits (u32 from a u8,
// i32 from a u64 that fits, ...), and the float getter accepts f32/f64.
#ifndef ATOMC_LOADER_GGUF_H
#define ATOMC_LOADER_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "common/mapped_file.h"
#include "core/tensor.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_ARRAY_DEPTH 8 // nested arrays deeper than this are rejected

// Metadata value types, numbered as in the GGUF specification.
enum gguf_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
};

const char *gguf_type_name(enum gguf_type t);

// GGML tensor types (subset named; the numbering is ggml's).
enum ggml_type {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q2_K = 10,
    GGML_TYPE_Q3_K = 11,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_Q8_K = 15,
    GGML_TYPE_I8 = 24,
    GGML_TYPE_I16 = 25,
    GGML_TYPE_I32 = 26,
    GGML_TYPE_I64 = 27,
    GGML_TYPE_F64 = 28,
    GGML_TYPE_BF16 = 30,
};

// Name of a GGML type ("Q4_K", ...), or "type<N>" style "unknown" for unknown ids.
const char *ggml_type_name(uint32_t t);

struct gguf_string {
    const char *s; // NUL-terminated, owned by the gguf_file
    uint64_t len;  // bytes, excluding the terminator
};

// One metadata value. Scalars are widened into the union; arrays hold their element
// type and count and, per element type: `raw` (little-endian packed scalars, a view
// into the file; use the accessors, it may be unaligned), `strs` (strings) or `items`
// (nested arrays).
struct gguf_value {
    enum gguf_type type;
    union {
        uint64_t u64; // UINT8/16/32/64 and BOOL (0/1)
        int64_t i64;  // INT8/16/32/64
        double f64;   // FLOAT32/64
        struct gguf_string str;
    } v;
    // Arrays only:
    enum gguf_type arr_type;
    uint64_t arr_len;
    const unsigned char *raw;    // arr_type a fixed-size scalar type
    struct gguf_string *strs;    // arr_type STRING (arr_len entries)
    struct gguf_value *items;    // arr_type ARRAY (arr_len entries)
};

struct gguf_kv {
    struct gguf_string key;
    struct gguf_value value;
};

struct gguf_tensor_info {
    const char *name;          // NUL-terminated, owned by the gguf_file
    int ndim;
    int64_t ne[GGUF_MAX_DIMS]; // row-major, outermost first (reversed from GGUF's order)
    uint32_t ggml_type;        // raw GGML type id
    bool supported;            // maps to an atomc dtype (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_K)
    enum dtype dtype;          // valid if supported
    uint64_t offset;           // relative to the start of the data section
    uint64_t nbytes;           // 0 if the type's size is unknown
    const void *data;          // view into the file (NULL if the type's size is unknown)
};

struct gguf_file {
    char *path;                 // name used in error messages (owned)
    struct mapped_file map;     // valid when opened from a path
    const unsigned char *data;  // whole file
    size_t size;
    uint32_t version;           // 2 or 3
    uint32_t alignment;         // general.alignment or 32
    uint64_t data_offset;       // start of the tensor data section (aligned)
    uint64_t n_kv;
    struct gguf_kv *kv;         // (n_kv)
    uint64_t n_tensors;
    struct gguf_tensor_info *tensors; // (n_tensors), in file order
    struct gguf_kv **kv_by_key;       // (n_kv) sorted by key: O(log n) lookups, O(n log n) duplicate checks
    struct gguf_tensor_info **tensors_by_name; // (n_tensors) sorted by name
    void *arena;                // owned string storage (opaque)
};

// Opens and fully validates a GGUF file. On failure *out is NULL.
atomc_status gguf_open(struct gguf_file **out, const char *path, struct error *err);
// Same from a caller-owned in-memory buffer (fuzzing, tests). `name` is for messages.
atomc_status gguf_open_memory(struct gguf_file **out, const void *data, size_t size, const char *name,
                              struct error *err);
void gguf_close(struct gguf_file *g);

// --- Metadata -------------------------------------------------------------------
// Index of a key, or -1.
int64_t gguf_find_key(const struct gguf_file *g, const char *key);
// The value of a key, or NULL if absent.
const struct gguf_value *gguf_get_value(const struct gguf_file *g, const char *key);
bool gguf_has_key(const struct gguf_file *g, const char *key);

// Scalars (see coercion rules at the top).
atomc_status gguf_get_str(const struct gguf_file *g, const char *key, const char **out, size_t *len,
                          struct error *err);
atomc_status gguf_get_u32(const struct gguf_file *g, const char *key, uint32_t *out, struct error *err);
atomc_status gguf_get_i32(const struct gguf_file *g, const char *key, int32_t *out, struct error *err);
atomc_status gguf_get_u64(const struct gguf_file *g, const char *key, uint64_t *out, struct error *err);
atomc_status gguf_get_i64(const struct gguf_file *g, const char *key, int64_t *out, struct error *err);
atomc_status gguf_get_f32(const struct gguf_file *g, const char *key, float *out, struct error *err);
// Accepts BOOL, or an integer (non-zero = true).
atomc_status gguf_get_bool(const struct gguf_file *g, const char *key, bool *out, struct error *err);

// Arrays. gguf_get_arr_info fails with FORMAT if the key is not an array.
atomc_status gguf_get_arr_info(const struct gguf_file *g, const char *key, enum gguf_type *elem_type, uint64_t *n,
                               struct error *err);
// Element i of a string array (key must be an array of strings, i < n).
atomc_status gguf_get_arr_str(const struct gguf_file *g, const char *key, uint64_t i, const char **out, size_t *len,
                              struct error *err);
// Copies a whole integer array into out[n] as int32 (n must equal the array length;
// every element must fit), or a numeric array as float.
atomc_status gguf_get_arr_i32(const struct gguf_file *g, const char *key, int32_t *out, uint64_t n,
                              struct error *err);
atomc_status gguf_get_arr_f32(const struct gguf_file *g, const char *key, float *out, uint64_t n,
                              struct error *err);

// Value-level accessors for callers that iterate (e.g. the tokenizer over 150k tokens):
// no key lookup per element. Return false if the value has the wrong type or i >= n.
bool gguf_value_arr_str(const struct gguf_value *v, uint64_t i, const char **out, size_t *len);
bool gguf_value_arr_i64(const struct gguf_value *v, uint64_t i, int64_t *out); // any integer / bool element
bool gguf_value_arr_f64(const struct gguf_value *v, uint64_t i, double *out);  // any numeric element

// --- Tensors --------------------------------------------------------------------
const struct gguf_tensor_info *gguf_find_tensor(const struct gguf_file *g, const char *name);
// A view of a tensor's bytes: NOT_FOUND if absent, UNSUPPORTED for GGML types atomc
// does not handle (message names the tensor and the type).
atomc_status gguf_get_tensor(const struct gguf_file *g, const char *name, struct tensor *out, struct error *err);

#endif
