// libFuzzer target for the GGUF parser (gguf_open_memory) and its accessors.
// Build: `make fuzz`; run: build-fuzz/fuzz/fuzz_gguf CORPUS_DIR (seed with tests/fixtures/loader/*.gguf).
// Whatever the bytes, parsing must either fail with a status or yield a handle whose every
// metadata value and tensor view can be read without going out of bounds (ASan checks).
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "loader/gguf.h"

static volatile unsigned char sink;

static void touch_value(const struct gguf_value *v) {
    if (v->type == GGUF_TYPE_STRING) {
        if (v->v.str.len) sink ^= (unsigned char)v->v.str.s[v->v.str.len - 1];
        sink ^= (unsigned char)v->v.str.s[v->v.str.len]; // the terminator
        return;
    }
    if (v->type != GGUF_TYPE_ARRAY) return;
    for (uint64_t i = 0; i < v->arr_len; i++) {
        const char *s;
        size_t len;
        int64_t x;
        double d;
        if (gguf_value_arr_str(v, i, &s, &len) && len) sink ^= (unsigned char)s[len - 1];
        if (gguf_value_arr_i64(v, i, &x)) sink ^= (unsigned char)x;
        if (gguf_value_arr_f64(v, i, &d)) sink ^= (unsigned char)(d > 0);
        if (v->arr_type == GGUF_TYPE_ARRAY) touch_value(&v->items[i]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct gguf_file *g;
    struct error err;
    if (gguf_open_memory(&g, data, size, "fuzz.gguf", &err) != ATOMC_OK) return 0;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const char *key = g->kv[i].key.s;
        touch_value(&g->kv[i].value);
        uint32_t u32;
        int32_t i32;
        uint64_t u64;
        int64_t i64;
        float f;
        bool b;
        const char *s;
        size_t len;
        enum gguf_type et;
        uint64_t n;
        (void)gguf_get_u32(g, key, &u32, &err);
        (void)gguf_get_i32(g, key, &i32, &err);
        (void)gguf_get_u64(g, key, &u64, &err);
        (void)gguf_get_i64(g, key, &i64, &err);
        (void)gguf_get_f32(g, key, &f, &err);
        (void)gguf_get_bool(g, key, &b, &err);
        (void)gguf_get_str(g, key, &s, &len, &err);
        if (gguf_get_arr_info(g, key, &et, &n, &err) == ATOMC_OK && n > 0 && n < 4096) {
            int32_t iv[4096];
            float fv[4096];
            (void)gguf_get_arr_i32(g, key, iv, n, &err);
            (void)gguf_get_arr_f32(g, key, fv, n, &err);
            (void)gguf_get_arr_str(g, key, n - 1, &s, &len, &err);
        }
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct tensor t;
        if (gguf_get_tensor(g, g->tensors[i].name, &t, &err) != ATOMC_OK) continue;
        size_t bytes = tensor_bytes(&t);
        if (bytes) sink ^= ((const unsigned char *)t.data)[0] ^ ((const unsigned char *)t.data)[bytes - 1];
    }
    gguf_close(g);
    return 0;
}
