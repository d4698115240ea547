// safetensors reader. See safetensors.h for the contract.
#include "loader/safetensors.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

struct st_dtype_desc {
    const char *name;
    int size;       // bytes per element; 0 = unknown
    bool supported; // maps to an atomc dtype
    enum dtype dtype;
};

static const struct st_dtype_desc st_dtypes[] = {
    {"F32", 4, true, DTYPE_F32},      {"F16", 2, true, DTYPE_F16},       {"BF16", 2, true, DTYPE_BF16},
    {"I32", 4, true, DTYPE_I32},      {"I64", 8, true, DTYPE_I64},       {"U8", 1, true, DTYPE_U8},
    {"F8_E4M3", 1, true, DTYPE_FP8_E4M3}, {"I8", 1, true, DTYPE_I8},
    // Known to the format, sized for validation, not served:
    {"F64", 8, false, DTYPE_F32},     {"I16", 2, false, DTYPE_F32},
    {"U16", 2, false, DTYPE_F32},     {"U32", 4, false, DTYPE_F32},      {"U64", 8, false, DTYPE_F32},
    {"BOOL", 1, false, DTYPE_F32},    {"F8_E5M2", 1, false, DTYPE_F32},  {"F8_E8M0", 1, false, DTYPE_F32},
};

static const struct st_dtype_desc *st_dtype_lookup(const char *name) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(st_dtypes[i].name, name) == 0) return &st_dtypes[i];
    return NULL;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const struct safetensors_tensor *)a)->name, ((const struct safetensors_tensor *)b)->name);
}

static int cmp_tensor_begin(const void *a, const void *b) {
    const struct safetensors_tensor *x = *(const struct safetensors_tensor *const *)a;
    const struct safetensors_tensor *y = *(const struct safetensors_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

void safetensors_close(struct safetensors_file *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    if (f->map.data || f->map.path) mapped_file_close(&f->map);
    free(f->path);
    free(f);
}

// Non-negative JSON integer.
static bool json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static atomc_status parse_entry(struct safetensors_file *f, const char *name, const json_t *v, uint64_t data_size,
                                struct safetensors_tensor *t, struct error *err) {
    const char *p = f->path;
    if (!json_is_object(v))
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': header entry is not a JSON object", p, name);
    const json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
                 *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': 'dtype' is missing or not a string", p, name);
    if (!json_is_array(js))
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': 'shape' is missing or not a list", p, name);
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': 'data_offsets' must be a list [begin, end]", p,
                         name);
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", json_string_value(jd));
    const struct st_dtype_desc *dd = st_dtype_lookup(json_string_value(jd));
    size_t nd = json_array_size(js);
    if (nd > SAFETENSORS_MAX_NDIM)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': %zu dimensions (at most %d)", p, name, nd,
                         SAFETENSORS_MAX_NDIM);
    t->ndim = (int)nd;
    uint64_t numel = 1;
    bool numel_overflow = false;
    for (size_t d = 0; d < nd; d++) {
        uint64_t x;
        if (!json_u64(json_array_get(js, d), &x))
            return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': shape[%zu] is not a non-negative integer", p,
                             name, d);
        t->ne[d] = (int64_t)x;
        if (x && numel > UINT64_MAX / x) numel_overflow = true;
        numel *= x;
    }
    if (!json_u64(json_array_get(jo, 0), &t->begin) || !json_u64(json_array_get(jo, 1), &t->end))
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': data_offsets must be non-negative integers", p, name);
    if (t->begin > t->end)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] are reversed",
                         p, name, t->begin, t->end);
    if (t->end > data_size)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] run past the end of the data "
                         "(%" PRIu64 " bytes; truncated file?)", p, name, t->begin, t->end, data_size);
    if (dd && dd->size) {
        if (numel_overflow || numel > UINT64_MAX / (uint64_t)dd->size || numel * (uint64_t)dd->size != t->end - t->begin)
            return error_set(err, ATOMC_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets span %" PRIu64 " bytes but shape and dtype %s need %s%" PRIu64,
                             p, name, t->end - t->begin, dd->name, numel_overflow ? "more than " : "",
                             numel_overflow ? UINT64_MAX : numel * (uint64_t)dd->size);
    }
    t->supported = dd && dd->supported && nd <= TENSOR_MAX_DIMS;
    if (dd) t->dtype = dd->dtype;
    t->data = f->data + 8 + f->header_len + t->begin;
    return ATOMC_OK;
}

static atomc_status parse_header(struct safetensors_file *f, struct error *err) {
    const char *p = f->path;
    if (f->size < 8)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: too short for a safetensors file (%zu bytes)", p, f->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | f->data[i];
    f->header_len = n;
    if (n > f->size - 8)
        return error_set(err, ATOMC_ERR_FORMAT,
                         "%s: header length %" PRIu64 " is larger than the file (%zu bytes): truncated or not safetensors",
                         p, n, f->size);
    if (n > SAFETENSORS_MAX_HEADER)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the format's limit of %u bytes", p,
                         n, SAFETENSORS_MAX_HEADER);
    json_error_t je;
    json_t *root = json_loadb((const char *)f->data + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: header is not valid JSON (at byte %d: %s)", p, je.position,
                         je.text);
    atomc_status st = ATOMC_OK;
    if (!json_is_object(root)) {
        st = error_set(err, ATOMC_ERR_FORMAT, "%s: header is not a JSON object", p);
        goto done;
    }
    uint64_t data_size = f->size - 8 - n;
    size_t cap = json_object_size(root);
    f->tensors = calloc(cap ? cap : 1, sizeof *f->tensors);
    if (!f->tensors) {
        st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", p);
        goto done;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) continue;
        struct safetensors_tensor *t = &f->tensors[f->n_tensors];
        t->name = xstrdup(key);
        f->n_tensors++;
        if ((st = parse_entry(f, key, val, data_size, t, err))) goto done;
    }
    // No two non-empty tensors may share bytes.
    if (f->n_tensors > 1) {
        struct safetensors_tensor **by_begin = malloc(f->n_tensors * sizeof *by_begin);
        if (!by_begin) {
            st = error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "%s: out of memory", p);
            goto done;
        }
        for (size_t i = 0; i < f->n_tensors; i++) by_begin[i] = &f->tensors[i];
        qsort(by_begin, f->n_tensors, sizeof *by_begin, cmp_tensor_begin);
        const struct safetensors_tensor *prev = NULL;
        for (size_t i = 0; i < f->n_tensors && !st; i++) {
            const struct safetensors_tensor *t = by_begin[i];
            if (t->begin == t->end) continue;
            if (prev && t->begin < prev->end)
                st = error_set(err, ATOMC_ERR_FORMAT,
                               "%s: tensors '%s' [%" PRIu64 ", %" PRIu64 ") and '%s' [%" PRIu64 ", %" PRIu64 ") overlap",
                               p, prev->name, prev->begin, prev->end, t->name, t->begin, t->end);
            if (!prev || t->end > prev->end) prev = t;
        }
        free(by_begin);
        if (st) goto done;
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_tensor_name);
done:
    json_decref(root);
    return st;
}

atomc_status safetensors_open_memory(struct safetensors_file **out, const void *data, size_t size, const char *name,
                                     struct error *err) {
    *out = NULL;
    struct safetensors_file *f = xcalloc(1, sizeof *f);
    f->path = xstrdup(name ? name : "(memory)");
    f->data = data;
    f->size = size;
    atomc_status st = parse_header(f, err);
    if (st) {
        safetensors_close(f);
        return st;
    }
    *out = f;
    return ATOMC_OK;
}

atomc_status safetensors_open(struct safetensors_file **out, const char *path, struct error *err) {
    *out = NULL;
    struct safetensors_file *f = xcalloc(1, sizeof *f);
    f->path = xstrdup(path);
    atomc_status st = mapped_file_open(&f->map, path, err);
    if (!st) {
        f->data = f->map.data;
        f->size = f->map.size;
        st = parse_header(f, err);
    }
    if (st) {
        safetensors_close(f);
        return st;
    }
    *out = f;
    return ATOMC_OK;
}

const struct safetensors_tensor *safetensors_find(const struct safetensors_file *f, const char *name) {
    struct safetensors_tensor key = {.name = (char *)name};
    return bsearch(&key, f->tensors, f->n_tensors, sizeof *f->tensors, cmp_tensor_name);
}

static atomc_status tensor_view(const char *path, const struct safetensors_tensor *t, struct tensor *out,
                                struct error *err) {
    if (!t->supported) {
        if (t->ndim > TENSOR_MAX_DIMS)
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: tensor '%s' has %d dimensions (atomc handles at most %d)",
                             path, t->name, t->ndim, TENSOR_MAX_DIMS);
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: tensor '%s' has dtype %s, which atomc does not support "
                         "(F32, F16, BF16, F8_E4M3, I32, I64, U8, I8)", path, t->name, t->dtype_name);
    }
    if (t->ndim == 0) {
        int64_t one = 1;
        *out = tensor_make((void *)t->data, t->dtype, 1, &one);
    } else {
        *out = tensor_make((void *)t->data, t->dtype, t->ndim, t->ne);
    }
    return ATOMC_OK;
}

atomc_status safetensors_get_tensor(const struct safetensors_file *f, const char *name, struct tensor *out,
                                    struct error *err) {
    const struct safetensors_tensor *t = safetensors_find(f, name);
    if (!t) return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: tensor '%s' not found", f->path, name);
    return tensor_view(f->path, t, out, err);
}

// ---------------------------------------------------------------------------------
// Sets (sharded checkpoints).

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const struct safetensors_entry *)a)->name, ((const struct safetensors_entry *)b)->name);
}

void safetensors_set_close(struct safetensors_set *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n_files; i++) safetensors_close(s->files[i]);
    free(s->files);
    free(s->entries);
    free(s->index_path);
    free(s);
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static atomc_status set_single(struct safetensors_set *s, const char *path, struct error *err) {
    s->files = xcalloc(1, sizeof *s->files);
    atomc_status st = safetensors_open(&s->files[0], path, err);
    if (st) return st;
    s->n_files = 1;
    struct safetensors_file *f = s->files[0];
    s->entries = xcalloc(f->n_tensors ? f->n_tensors : 1, sizeof *s->entries);
    for (size_t i = 0; i < f->n_tensors; i++)
        s->entries[i] = (struct safetensors_entry){.name = f->tensors[i].name, .file = f, .tensor = &f->tensors[i]};
    s->n_entries = f->n_tensors; // f->tensors is sorted, so entries are too
    return ATOMC_OK;
}

static atomc_status set_index(struct safetensors_set *s, const char *index_path, struct error *err) {
    s->index_path = xstrdup(index_path);
    char *text;
    atomc_status st = file_read_all(index_path, &text, NULL, err);
    if (st) return st;
    json_error_t je;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!root)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", index_path, je.line,
                         je.column, je.text);
    char *dir = xstrdup(index_path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else snprintf(dir, strlen(dir) + 1, ".");
    const json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        st = error_set(err, ATOMC_ERR_FORMAT, "%s: 'weight_map' is missing or not an object", index_path);
        goto done;
    }
    size_t n = json_object_size(wm);
    s->entries = xcalloc(n ? n : 1, sizeof *s->entries);
    s->files = xcalloc(n ? n : 1, sizeof *s->files);
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)wm, key, val) {
        if (!json_is_string(val)) {
            st = error_set(err, ATOMC_ERR_FORMAT, "%s: weight_map entry for tensor '%s' is not a file name", index_path,
                           key);
            goto done;
        }
        const char *shard = json_string_value(val);
        if (!shard[0] || strchr(shard, '/') || strcmp(shard, "..") == 0 || strcmp(shard, ".") == 0) {
            st = error_set(err, ATOMC_ERR_FORMAT, "%s: weight_map entry for tensor '%s' names '%s', which is not a "
                           "plain file name in the model directory", index_path, key, shard);
            goto done;
        }
        struct safetensors_file *f = NULL;
        char *shard_path = path_join(dir, shard);
        for (size_t i = 0; i < s->n_files && !f; i++)
            if (strcmp(s->files[i]->path, shard_path) == 0) f = s->files[i];
        if (!f) {
            st = safetensors_open(&f, shard_path, err);
            if (st) {
                free(shard_path);
                error_prefix(err, "%s (shard of tensor '%s'): ", index_path, key);
                goto done;
            }
            s->files[s->n_files++] = f;
        }
        free(shard_path);
        const struct safetensors_tensor *t = safetensors_find(f, key);
        if (!t) {
            st = error_set(err, ATOMC_ERR_FORMAT, "%s: weight_map says tensor '%s' is in %s, but that file does not "
                           "contain it", index_path, key, f->path);
            goto done;
        }
        s->entries[s->n_entries++] = (struct safetensors_entry){.name = t->name, .file = f, .tensor = t};
    }
    qsort(s->entries, s->n_entries, sizeof *s->entries, cmp_entry);
done:
    free(dir);
    json_decref(root);
    return st;
}

atomc_status safetensors_set_open(struct safetensors_set **out, const char *path, struct error *err) {
    *out = NULL;
    struct safetensors_set *s = xcalloc(1, sizeof *s);
    atomc_status st;
    if (dir_exists(path)) {
        char *idx = path_join(path, "model.safetensors.index.json");
        char *single = path_join(path, "model.safetensors");
        if (file_exists(idx)) st = set_index(s, idx, err);
        else if (file_exists(single)) st = set_single(s, single, err);
        else
            st = error_set(err, ATOMC_ERR_IO, "%s: no model.safetensors or model.safetensors.index.json in this directory",
                           path);
        free(idx);
        free(single);
    } else if (ends_with(path, ".json")) {
        st = set_index(s, path, err);
    } else {
        st = set_single(s, path, err);
    }
    if (st) {
        safetensors_set_close(s);
        return st;
    }
    *out = s;
    return ATOMC_OK;
}

const struct safetensors_entry *safetensors_set_find(const struct safetensors_set *s, const char *name) {
    struct safetensors_entry key = {.name = name};
    return bsearch(&key, s->entries, s->n_entries, sizeof *s->entries, cmp_entry);
}

atomc_status safetensors_set_get_tensor(const struct safetensors_set *s, const char *name, struct tensor *out,
                                        const char **file_out, struct error *err) {
    const struct safetensors_entry *e = safetensors_set_find(s, name);
    if (!e) {
        const char *where = s->index_path ? s->index_path : (s->n_files ? s->files[0]->path : "(checkpoint)");
        return error_set(err, ATOMC_ERR_NOT_FOUND, "%s: tensor '%s' not found", where, name);
    }
    if (file_out) *file_out = e->file->path;
    return tensor_view(e->file->path, e->tensor, out, err);
}
