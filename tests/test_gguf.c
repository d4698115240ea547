// GGUF reader: the reference file written by the `gguf` package's GGUFWriter
// (tests/fixtures/loader/ref.gguf; values and offsets as the package's GGUFReader and
// gguf.quants.dequantize see them in ref_gguf.json; both made by tools/gen_loader_refs.py),
// hand-built corrupt files, every truncation of the reference file, and the real
// SmolLM2 GGUF ($ATOMC_SMOLLM2, skipped if unset; failed under ATOMC_REQUIRE_FIXTURES=1) against smollm2_refs.json.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "loader/gguf.h"
#include "test.h"

TEST(reference_metadata_all_types) {
    struct error e = {0};
    struct gguf_file *g;
    ASSERT_OK(gguf_open(&g, test_fixture("loader/ref.gguf"), &e));
    ASSERT_EQ(g->version, 3);
    ASSERT_EQ(g->alignment, 64);
    const char *s;
    size_t len;
    ASSERT_OK(gguf_get_str(g, "general.architecture", &s, &len, &e));
    ASSERT_STREQ(s, "llama");
    ASSERT_OK(gguf_get_str(g, "t.str", &s, &len, &e));
    ASSERT_STREQ(s, "h\xc3\xa9llo w\xc3\xb6rld");
    ASSERT_EQ(len, 13);
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f;
    bool b;
    ASSERT_OK(gguf_get_u32(g, "t.u8", &u32, &e));
    ASSERT_EQ(u32, 200);
    ASSERT_OK(gguf_get_i32(g, "t.i8", &i32, &e));
    ASSERT_EQ(i32, -100);
    ASSERT_OK(gguf_get_u32(g, "t.u16", &u32, &e));
    ASSERT_EQ(u32, 60000);
    ASSERT_OK(gguf_get_i32(g, "t.i16", &i32, &e));
    ASSERT_EQ(i32, -30000);
    ASSERT_OK(gguf_get_u32(g, "t.u32", &u32, &e));
    ASSERT_EQ(u32, 4000000000u);
    ASSERT_OK(gguf_get_i32(g, "t.i32", &i32, &e));
    ASSERT_EQ(i32, -2000000000);
    ASSERT_OK(gguf_get_u64(g, "t.u64", &u64, &e));
    ASSERT_EQ(u64, 1ull << 40);
    ASSERT_OK(gguf_get_i64(g, "t.i64", &i64, &e));
    ASSERT_EQ(i64, -(1ll << 40));
    ASSERT_OK(gguf_get_f32(g, "t.f32", &f, &e));
    ASSERT_NEAR(f, 0.15625, 0);
    ASSERT_OK(gguf_get_f32(g, "t.f64", &f, &e));
    ASSERT_TRUE(f == 0.0f); // 2.5e-300 underflows in f32
    ASSERT_EQ(gguf_get_value(g, "t.f64")->type, GGUF_TYPE_FLOAT64);
    ASSERT_TRUE(gguf_get_value(g, "t.f64")->v.f64 == 2.5e-300);
    ASSERT_OK(gguf_get_bool(g, "t.bool", &b, &e));
    ASSERT_TRUE(b);
    // Width coercion: u32 from a small u64, i32 from u8, i64 from u32.
    ASSERT_OK(gguf_get_u32(g, "t.small_u64", &u32, &e));
    ASSERT_EQ(u32, 7);
    ASSERT_OK(gguf_get_i32(g, "t.u8", &i32, &e));
    ASSERT_EQ(i32, 200);
    ASSERT_OK(gguf_get_i64(g, "t.u32", &i64, &e));
    ASSERT_EQ(i64, 4000000000ll);
    ASSERT_OK(gguf_get_bool(g, "t.u8", &b, &e));
    ASSERT_TRUE(b);
    // Out of range / wrong type / missing: named errors.
    ASSERT_EQ(gguf_get_u32(g, "t.i8", &u32, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "ref.gguf") && strstr(e.msg, "'t.i8'") && strstr(e.msg, "-100"));
    ASSERT_EQ(gguf_get_i32(g, "t.u32", &i32, &e), ATOMC_ERR_FORMAT);
    ASSERT_EQ(gguf_get_u32(g, "t.u64", &u32, &e), ATOMC_ERR_FORMAT);
    ASSERT_EQ(gguf_get_u32(g, "t.str", &u32, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "'t.str' has type string, expected an integer") != NULL);
    ASSERT_EQ(gguf_get_str(g, "t.u8", &s, &len, &e), ATOMC_ERR_FORMAT);
    ASSERT_EQ(gguf_get_f32(g, "t.u8", &f, &e), ATOMC_ERR_FORMAT);
    ASSERT_EQ(gguf_get_u32(g, "no.such.key", &u32, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "ref.gguf") && strstr(e.msg, "'no.such.key' not found"));
    ASSERT_TRUE(!gguf_has_key(g, "no.such.key"));
    ASSERT_TRUE(gguf_has_key(g, "t.nested"));
    gguf_close(g);
}

TEST(reference_arrays) {
    struct error e = {0};
    struct gguf_file *g;
    ASSERT_OK(gguf_open(&g, test_fixture("loader/ref.gguf"), &e));
    enum gguf_type et;
    uint64_t n;
    ASSERT_OK(gguf_get_arr_info(g, "t.arr_i32", &et, &n, &e));
    ASSERT_EQ(et, GGUF_TYPE_INT32);
    ASSERT_EQ(n, 4);
    int32_t iv[4];
    ASSERT_OK(gguf_get_arr_i32(g, "t.arr_i32", iv, 4, &e));
    ASSERT_EQ(iv[1], -2);
    ASSERT_EQ(iv[3], 2147483647);
    ASSERT_EQ(gguf_get_arr_i32(g, "t.arr_i32", iv, 3, &e), ATOMC_ERR_FORMAT); // length mismatch
    ASSERT_TRUE(strstr(e.msg, "has 4 elements, expected 3") != NULL);
    int32_t u8v[3];
    ASSERT_OK(gguf_get_arr_i32(g, "t.arr_u8", u8v, 3, &e)); // coercion from uint8
    ASSERT_EQ(u8v[2], 255);
    float fv[3];
    ASSERT_OK(gguf_get_arr_f32(g, "t.arr_f32", fv, 3, &e));
    ASSERT_NEAR(fv[1], -1.25, 0);
    ASSERT_EQ(gguf_get_arr_i32(g, "t.arr_f32", iv, 3, &e), ATOMC_ERR_FORMAT);
    ASSERT_OK(gguf_get_arr_info(g, "t.arr_str", &et, &n, &e));
    ASSERT_EQ(et, GGUF_TYPE_STRING);
    ASSERT_EQ(n, 4);
    const char *s;
    size_t len;
    ASSERT_OK(gguf_get_arr_str(g, "t.arr_str", 1, &s, &len, &e));
    ASSERT_EQ(len, 0);
    ASSERT_OK(gguf_get_arr_str(g, "t.arr_str", 2, &s, &len, &e));
    ASSERT_STREQ(s, "\xc3\xbcn\xc3\xaf");
    ASSERT_OK(gguf_get_arr_str(g, "t.arr_str", 3, &s, &len, &e));
    ASSERT_STREQ(s, "<|end|>");
    ASSERT_EQ(gguf_get_arr_str(g, "t.arr_str", 4, &s, &len, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_EQ(gguf_get_arr_str(g, "t.arr_i32", 0, &s, &len, &e), ATOMC_ERR_FORMAT);
    ASSERT_EQ(gguf_get_arr_info(g, "t.u8", &et, &n, &e), ATOMC_ERR_FORMAT);
    // Nested arrays: [[1,2],[3],[4,5,6]].
    const struct gguf_value *v = gguf_get_value(g, "t.nested");
    ASSERT_TRUE(v && v->type == GGUF_TYPE_ARRAY && v->arr_type == GGUF_TYPE_ARRAY);
    ASSERT_EQ(v->arr_len, 3);
    ASSERT_EQ(v->items[2].arr_len, 3);
    int64_t x;
    ASSERT_TRUE(gguf_value_arr_i64(&v->items[2], 2, &x));
    ASSERT_EQ(x, 6);
    ASSERT_TRUE(gguf_value_arr_i64(&v->items[0], 1, &x));
    ASSERT_EQ(x, 2);
    ASSERT_TRUE(!gguf_value_arr_i64(&v->items[1], 1, &x)); // out of range
    const struct gguf_value *bv = gguf_get_value(g, "t.arr_bool");
    ASSERT_TRUE(gguf_value_arr_i64(bv, 0, &x) && x == 1);
    ASSERT_TRUE(gguf_value_arr_i64(bv, 1, &x) && x == 0);
    gguf_close(g);
}

TEST(reference_tensors_match_gguf_package) {
    struct error e = {0};
    json_t *ref = test_fixture_json("loader/ref_gguf.json");
    ASSERT_TRUE(ref != NULL);
    struct gguf_file *g;
    ASSERT_OK(gguf_open(&g, test_fixture("loader/ref.gguf"), &e));
    ASSERT_EQ(g->data_offset, json_integer_value(json_object_get(ref, "data_offset")));
    ASSERT_EQ(g->n_tensors, 8);
    const char *name;
    json_t *off;
    json_object_foreach(json_object_get(ref, "tensor_offsets"), name, off) {
        const struct gguf_tensor_info *ti = gguf_find_tensor(g, name);
        ASSERT_TRUE(ti != NULL);
        ASSERT_EQ(ti->offset, json_integer_value(off));
    }
    json_t *r;
    json_object_foreach(json_object_get(ref, "tensors"), name, r) {
        struct tensor t;
        ASSERT_OK(gguf_get_tensor(g, name, &t, &e));
        json_t *shape = json_object_get(r, "shape"), *vals = json_object_get(r, "values");
        ASSERT_EQ(t.ndim, (int)json_array_size(shape));
        for (int d = 0; d < t.ndim; d++) ASSERT_EQ(t.ne[d], json_integer_value(json_array_get(shape, (size_t)d)));
        int64_t n = tensor_numel(&t);
        ASSERT_EQ(n, (int64_t)json_array_size(vals));
        float *buf = malloc((size_t)n * sizeof(float));
        dtype_to_f32(t.dtype, t.data, buf, n);
        for (int64_t i = 0; i < n; i++) {
            double want = json_number_value(json_array_get(vals, (size_t)i));
            if (!test_close_rel(buf[i], want)) {
                test_fail(__FILE__, __LINE__, "%s[%lld] = %g, gguf package says %g", name, (long long)i, buf[i], want);
                free(buf);
                gguf_close(g);
                json_decref(ref);
                return;
            }
        }
        free(buf);
    }
    struct tensor t;
    ASSERT_OK(gguf_get_tensor(g, "t.q4_1", &t, &e));
    ASSERT_EQ(t.dtype, DTYPE_Q4_1);
    ASSERT_OK(gguf_get_tensor(g, "t.q8_0", &t, &e));
    ASSERT_EQ(t.dtype, DTYPE_Q8_0);
    // Q4_K (a K-quant since issue 25) maps to DTYPE_Q4_K; its values are checked against gguf-py
    // in test_cpu_quant_ops.c (kquants.gguf).
    const struct gguf_tensor_info *k = gguf_find_tensor(g, "t.q4_k");
    ASSERT_TRUE(k && k->supported && k->dtype == DTYPE_Q4_K);
    ASSERT_EQ(k->nbytes, 2 * 144);
    ASSERT_EQ(k->ne[0], 2);
    ASSERT_EQ(k->ne[1], 256);
    ASSERT_OK(gguf_get_tensor(g, "t.q4_k", &t, &e));
    ASSERT_EQ(gguf_get_tensor(g, "nope", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "'nope'") != NULL);
    gguf_close(g);
    // Unsupported type: the same file with t.q4_k's type id patched to IQ4_NL (20: blocks of 32
    // in 18 bytes, so the 512 elements still take 288 bytes) is listed with its size and refused
    // by name.
    char *data;
    size_t n;
    ASSERT_OK(file_read_all(test_fixture("loader/ref.gguf"), &data, &n, &e));
    char *nm = memmem(data, n, "t.q4_k", 6);
    ASSERT_TRUE(nm != NULL);
    uint32_t iq4_nl = 20, was;
    memcpy(&was, nm + 6 + 4 + 16, 4); // after the name: n_dims (u32) and two u64 dims
    ASSERT_EQ(was, 12);               // GGML_TYPE_Q4_K
    memcpy(nm + 6 + 4 + 16, &iq4_nl, 4);
    ASSERT_OK(gguf_open_memory(&g, data, n, "ref.gguf", &e));
    k = gguf_find_tensor(g, "t.q4_k");
    ASSERT_TRUE(k && !k->supported);
    ASSERT_EQ(k->nbytes, 2 * 144);
    ASSERT_EQ(gguf_get_tensor(g, "t.q4_k", &t, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "ref.gguf") && strstr(e.msg, "'t.q4_k'") && strstr(e.msg, "IQ4_NL"));
    gguf_close(g);
    free(data);
    json_decref(ref);
}

TEST(every_truncation_is_an_error) {
    struct error e = {0};
    char *data;
    size_t n;
    ASSERT_OK(file_read_all(test_fixture("loader/ref.gguf"), &data, &n, &e));
    json_t *ref = test_fixture_json("loader/ref_gguf.json");
    // The last tensor (q4_k, 288 bytes) ends here; any shorter file must be rejected.
    size_t end = (size_t)json_integer_value(json_object_get(ref, "data_offset")) + 2240 + 288;
    json_decref(ref);
    ASSERT_TRUE(end <= n);
    for (size_t len = 0; len < end; len++) {
        struct gguf_file *g = NULL;
        char *copy = malloc(len ? len : 1); // exact-size buffer so ASan sees over-reads
        memcpy(copy, data, len);
        atomc_status st = gguf_open_memory(&g, copy, len, "cut.gguf", &e);
        free(copy);
        if (st != ATOMC_ERR_FORMAT || g != NULL || !strstr(e.msg, "cut.gguf")) {
            test_fail(__FILE__, __LINE__, "prefix %zu: status %d message \"%s\"", len, (int)st, e.msg);
            gguf_close(g);
            free(data);
            return;
        }
    }
    struct gguf_file *g;
    ASSERT_OK(gguf_open_memory(&g, data, end, "cut.gguf", &e));
    gguf_close(g);
    free(data);
}

// ---------------------------------------------------------------------------------
// A tiny GGUF builder for corrupt files.

struct buf {
    unsigned char d[4096];
    size_t n;
};

static void put(struct buf *b, const void *p, size_t n) {
    memcpy(b->d + b->n, p, n);
    b->n += n;
}
static void put_u32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(struct buf *b, const char *s) {
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void header(struct buf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    b->n = 0;
    put(b, "GGUF", 4);
    put_u32(b, version);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
}
// One 2-D tensor info (ggml order dims d0 fastest).
static void tinfo(struct buf *b, const char *name, uint64_t d0, uint64_t d1, uint32_t type, uint64_t off) {
    put_str(b, name);
    put_u32(b, 2);
    put_u64(b, d0);
    put_u64(b, d1);
    put_u32(b, type);
    put_u64(b, off);
}
static void pad_to(struct buf *b, size_t align, size_t extra) {
    while (b->n % align) b->d[b->n++] = 0;
    memset(b->d + b->n, 0, extra);
    b->n += extra;
}

static int expect(struct buf *b, atomc_status want, const char *needle) {
    struct error e = {0};
    struct gguf_file *g = NULL;
    // Copy into an exact-size heap block so ASan catches any over-read.
    unsigned char *copy = malloc(b->n);
    memcpy(copy, b->d, b->n);
    atomc_status st = gguf_open_memory(&g, copy, b->n, "bad.gguf", &e);
    int ok = st == want && g == NULL && strstr(e.msg, "bad.gguf") && strstr(e.msg, needle);
    if (!ok) test_fail(__FILE__, __LINE__, "status %d message \"%s\" (want %d, \"%s\")", (int)st, e.msg, (int)want, needle);
    gguf_close(g);
    free(copy);
    return ok;
}

TEST(corrupt_headers) {
    struct buf b;
    header(&b, 3, 0, 0);
    memcpy(b.d, "GGUG", 4);
    if (!expect(&b, ATOMC_ERR_FORMAT, "bad magic")) return;
    header(&b, 1, 0, 0);
    if (!expect(&b, ATOMC_ERR_UNSUPPORTED, "version 1")) return;
    header(&b, 0x03000000u, 0, 0);
    if (!expect(&b, ATOMC_ERR_UNSUPPORTED, "big-endian")) return;
    header(&b, 7, 0, 0);
    if (!expect(&b, ATOMC_ERR_FORMAT, "unknown GGUF version 7")) return;
    header(&b, 3, 0, 1ull << 60);
    if (!expect(&b, ATOMC_ERR_FORMAT, "metadata count")) return;
    header(&b, 3, 1ull << 60, 0);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor count")) return;
    // Key with an absurd length.
    header(&b, 3, 0, 1);
    put_u64(&b, 1ull << 62);
    put(&b, "abcdefghijklmnop", 16);
    if (!expect(&b, ATOMC_ERR_FORMAT, "metadata key")) return;
    // Invalid value type.
    header(&b, 3, 0, 1);
    put_str(&b, "k");
    put_u32(&b, 13);
    put_u32(&b, 0);
    if (!expect(&b, ATOMC_ERR_FORMAT, "'k': invalid value type 13")) return;
    // Bool with value 2.
    header(&b, 3, 0, 1);
    put_str(&b, "flag");
    put_u32(&b, GGUF_TYPE_BOOL);
    b.d[b.n++] = 2;
    if (!expect(&b, ATOMC_ERR_FORMAT, "'flag': bool has value 2")) return;
    // Array longer than the file.
    header(&b, 3, 0, 1);
    put_str(&b, "arr");
    put_u32(&b, GGUF_TYPE_ARRAY);
    put_u32(&b, GGUF_TYPE_UINT32);
    put_u64(&b, 1ull << 40);
    if (!expect(&b, ATOMC_ERR_FORMAT, "'arr': array of 1099511627776 uint32")) return;
    // String array whose count exceeds the file.
    header(&b, 3, 0, 1);
    put_str(&b, "toks");
    put_u32(&b, GGUF_TYPE_ARRAY);
    put_u32(&b, GGUF_TYPE_STRING);
    put_u64(&b, 1000);
    put_str(&b, "a");
    if (!expect(&b, ATOMC_ERR_FORMAT, "'toks'")) return;
    // String element running past the end.
    header(&b, 3, 0, 1);
    put_str(&b, "toks");
    put_u32(&b, GGUF_TYPE_ARRAY);
    put_u32(&b, GGUF_TYPE_STRING);
    put_u64(&b, 2);
    put_str(&b, "a");
    put_u64(&b, 100);
    put(&b, "xyzxyzxyz", 9);
    if (!expect(&b, ATOMC_ERR_FORMAT, "'toks' element 1")) return;
    // Invalid array element type.
    header(&b, 3, 0, 1);
    put_str(&b, "arr");
    put_u32(&b, GGUF_TYPE_ARRAY);
    put_u32(&b, 77);
    put_u64(&b, 0);
    if (!expect(&b, ATOMC_ERR_FORMAT, "invalid array element type 77")) return;
    // Arrays nested too deep.
    header(&b, 3, 0, 1);
    put_str(&b, "deep");
    put_u32(&b, GGUF_TYPE_ARRAY);
    for (int i = 0; i < 20; i++) {
        put_u32(&b, GGUF_TYPE_ARRAY);
        put_u64(&b, 1);
    }
    put(&b, "\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 24);
    if (!expect(&b, ATOMC_ERR_FORMAT, "nested deeper")) return;
    // Duplicate key.
    header(&b, 3, 0, 2);
    for (int i = 0; i < 2; i++) {
        put_str(&b, "dup");
        put_u32(&b, GGUF_TYPE_UINT8);
        b.d[b.n++] = 1;
    }
    if (!expect(&b, ATOMC_ERR_FORMAT, "duplicate metadata key 'dup'")) return;
    // Alignment not a power of two / of the wrong type.
    header(&b, 3, 0, 1);
    put_str(&b, "general.alignment");
    put_u32(&b, GGUF_TYPE_UINT32);
    put_u32(&b, 48);
    if (!expect(&b, ATOMC_ERR_FORMAT, "general.alignment 48 is not a power of two")) return;
    header(&b, 3, 0, 1);
    put_str(&b, "general.alignment");
    put_u32(&b, GGUF_TYPE_STRING);
    put_str(&b, "32");
    if (!expect(&b, ATOMC_ERR_FORMAT, "'general.alignment' has type string")) return;
}

TEST(corrupt_tensor_infos) {
    struct buf b;
    // Valid baseline: one F32 tensor [2 x 32] -> 256 bytes.
    header(&b, 3, 1, 0);
    tinfo(&b, "w", 32, 2, GGML_TYPE_F32, 0);
    pad_to(&b, 32, 256);
    {
        struct error e = {0};
        struct gguf_file *g;
        ASSERT_OK(gguf_open_memory(&g, b.d, b.n, "bad.gguf", &e));
        ASSERT_EQ(g->tensors[0].ne[0], 2);
        ASSERT_EQ(g->tensors[0].ne[1], 32);
        gguf_close(g);
    }
    // Data one byte short.
    b.n -= 1;
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'w': data [0, 256) runs past the end")) return;
    // ndim 5.
    header(&b, 3, 1, 0);
    put_str(&b, "w");
    put_u32(&b, 5);
    for (int i = 0; i < 5; i++) put_u64(&b, 1);
    put_u32(&b, 0);
    put_u64(&b, 0);
    pad_to(&b, 32, 32);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'w': 5 dimensions")) return;
    // Zero / overflowing dims.
    header(&b, 3, 1, 0);
    tinfo(&b, "w", 0, 2, GGML_TYPE_F32, 0);
    pad_to(&b, 32, 32);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'w': invalid dimension 0")) return;
    header(&b, 3, 1, 0);
    tinfo(&b, "w", 1ull << 40, 1ull << 40, GGML_TYPE_F32, 0);
    pad_to(&b, 32, 32);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'w': invalid dimension")) return;
    // Quantized row not a multiple of the block.
    header(&b, 3, 1, 0);
    tinfo(&b, "q", 48, 2, GGML_TYPE_Q8_0, 0);
    pad_to(&b, 32, 128);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'q': innermost dimension 48 is not a multiple of the Q8_0 block size 32"))
        return;
    // Misaligned offset.
    header(&b, 3, 1, 0);
    tinfo(&b, "w", 32, 1, GGML_TYPE_F32, 4);
    pad_to(&b, 32, 256);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'w': data offset 4 is not a multiple of the alignment 32")) return;
    // Offset beyond the file.
    header(&b, 3, 1, 0);
    tinfo(&b, "w", 32, 1, GGML_TYPE_F32, 1ull << 50);
    pad_to(&b, 32, 256);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensor 'w': data [")) return;
    // Duplicate tensor names.
    header(&b, 3, 2, 0);
    tinfo(&b, "w", 32, 1, GGML_TYPE_F32, 0);
    tinfo(&b, "w", 32, 1, GGML_TYPE_F32, 128);
    pad_to(&b, 32, 256);
    if (!expect(&b, ATOMC_ERR_FORMAT, "duplicate tensor name 'w'")) return;
    // Overlapping data ranges (issue 28 item 9): [0, 256) and [128, 384).
    header(&b, 3, 2, 0);
    tinfo(&b, "a", 32, 2, GGML_TYPE_F32, 0);
    tinfo(&b, "b", 32, 2, GGML_TYPE_F32, 128);
    pad_to(&b, 32, 384);
    if (!expect(&b, ATOMC_ERR_FORMAT, "tensors 'a' [0, 256) and 'b' [128, 384) overlap")) return;
    // Adjacent ranges are fine.
    header(&b, 3, 2, 0);
    tinfo(&b, "a", 32, 2, GGML_TYPE_F32, 0);
    tinfo(&b, "b", 32, 2, GGML_TYPE_F32, 256);
    pad_to(&b, 32, 512);
    {
        struct error e = {0};
        struct gguf_file *g;
        ASSERT_OK(gguf_open_memory(&g, b.d, b.n, "adjacent.gguf", &e));
        gguf_close(g);
    }
    // Unknown GGML type: listed (size unknown), refused by name on access.
    header(&b, 3, 1, 0);
    tinfo(&b, "odd", 32, 1, 999, 0);
    pad_to(&b, 32, 0);
    {
        struct error e = {0};
        struct gguf_file *g;
        ASSERT_OK(gguf_open_memory(&g, b.d, b.n, "odd.gguf", &e));
        struct tensor t;
        ASSERT_EQ(gguf_get_tensor(g, "odd", &t, &e), ATOMC_ERR_UNSUPPORTED);
        ASSERT_TRUE(strstr(e.msg, "odd.gguf") && strstr(e.msg, "'odd'") && strstr(e.msg, "(999)"));
        gguf_close(g);
    }
}

TEST(many_tensors_and_keys_parse_in_n_log_n) {
    // 200k tensor infos and 200k keys: quadratic duplicate checks would take minutes.
    enum { N = 200000 };
    size_t cap = (size_t)N * 64 + 4096 + (size_t)N * 32, n = 0;
    unsigned char *b = malloc(cap);
#define PUT(p, len) (memcpy(b + n, (p), (len)), n += (len))
    uint32_t u32;
    uint64_t u64;
    PUT("GGUF", 4);
    u32 = 3, PUT(&u32, 4);
    u64 = N, PUT(&u64, 8);
    u64 = N, PUT(&u64, 8);
    char name[32];
    for (int i = 0; i < N; i++) {
        int len = snprintf(name, sizeof name, "k.%d", i);
        u64 = (uint64_t)len, PUT(&u64, 8);
        PUT(name, (size_t)len);
        u32 = GGUF_TYPE_UINT8, PUT(&u32, 4);
        b[n++] = (unsigned char)i;
    }
    for (int i = 0; i < N; i++) {
        int len = snprintf(name, sizeof name, "t.%d", i);
        u64 = (uint64_t)len, PUT(&u64, 8);
        PUT(name, (size_t)len);
        u32 = 1, PUT(&u32, 4);
        u64 = 8, PUT(&u64, 8);
        u32 = GGML_TYPE_F32, PUT(&u32, 4);
        u64 = (uint64_t)i * 32, PUT(&u64, 8); // each its own 32 bytes (overlaps are refused)
    }
#undef PUT
    while (n % 32) b[n++] = 0;
    memset(b + n, 0, (size_t)N * 32);
    n += (size_t)N * 32;
    struct error e = {0};
    struct gguf_file *g;
    ASSERT_OK(gguf_open_memory(&g, b, n, "many.gguf", &e));
    ASSERT_EQ(g->n_tensors, N);
    const struct gguf_tensor_info *t = gguf_find_tensor(g, "t.123456");
    ASSERT_TRUE(t != NULL && t == &g->tensors[123456]);
    uint32_t v;
    ASSERT_OK(gguf_get_u32(g, "k.199999", &v, &e));
    ASSERT_EQ(v, 199999 & 0xff);
    gguf_close(g);
    // One duplicate among them is found.
    memcpy(b + 4 + 4 + 8 + 8 + 8, "k.1", 3); // key "k.0" -> "k.1"
    ASSERT_EQ(gguf_open_memory(&g, b, n, "many.gguf", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "duplicate metadata key 'k.1'") != NULL);
    free(b);
}

TEST(open_errors_name_the_path) {
    struct error e = {0};
    struct gguf_file *g;
    ASSERT_EQ(gguf_open(&g, "/nonexistent/x.gguf", &e), ATOMC_ERR_IO);
    ASSERT_TRUE(strstr(e.msg, "/nonexistent/x.gguf") != NULL);
    ASSERT_TRUE(g == NULL);
    // A safetensors file is not a GGUF.
    ASSERT_EQ(gguf_open(&g, test_fixture("loader/ref.safetensors"), &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "ref.safetensors: not a GGUF file") != NULL);
}

// ---------------------------------------------------------------------------------
// The real SmolLM2 GGUF.

TEST(smollm2_metadata_and_embeddings) {
    const char *path = test_smollm2_path();
    if (!path) return;
    json_t *ref = test_fixture_json("loader/smollm2_refs.json");
    ASSERT_TRUE(ref != NULL);
    struct error e = {0};
    struct gguf_file *g;
    ASSERT_OK(gguf_open(&g, path, &e));
    json_t *md = json_object_get(ref, "metadata");
    const char *key;
    json_t *val;
    json_object_foreach(md, key, val) {
        if (json_is_string(val)) {
            const char *s;
            ASSERT_OK(gguf_get_str(g, key, &s, NULL, &e));
            ASSERT_STREQ(s, json_string_value(val));
        } else if (json_is_boolean(val)) {
            bool b;
            ASSERT_OK(gguf_get_bool(g, key, &b, &e));
            ASSERT_EQ(b, json_is_true(val));
        } else if (json_is_integer(val)) {
            uint32_t u;
            ASSERT_OK(gguf_get_u32(g, key, &u, &e));
            ASSERT_EQ(u, json_integer_value(val));
        } else {
            float f;
            ASSERT_OK(gguf_get_f32(g, key, &f, &e));
            ASSERT_NEAR(f, json_real_value(val), 1e-12);
        }
    }
    const struct gguf_value *toks = gguf_get_value(g, "tokenizer.ggml.tokens");
    ASSERT_TRUE(toks != NULL);
    ASSERT_EQ(toks->arr_len, json_integer_value(json_object_get(ref, "n_tokens")));
    json_object_foreach(json_object_get(ref, "tokens"), key, val) {
        const char *s;
        ASSERT_TRUE(gguf_value_arr_str(toks, (uint64_t)atoll(key), &s, NULL));
        ASSERT_STREQ(s, json_string_value(val));
    }
    uint64_t n_tok = toks->arr_len;
    int32_t *types = malloc(n_tok * sizeof *types);
    ASSERT_OK(gguf_get_arr_i32(g, "tokenizer.ggml.token_type", types, n_tok, &e));
    json_object_foreach(json_object_get(ref, "token_types"), key, val) ASSERT_EQ(types[atoll(key)], json_integer_value(val));
    free(types);
    uint64_t n_merges;
    ASSERT_OK(gguf_get_arr_info(g, "tokenizer.ggml.merges", NULL, &n_merges, &e));
    ASSERT_EQ(n_merges, json_integer_value(json_object_get(ref, "n_merges")));
    json_object_foreach(json_object_get(ref, "merges"), key, val) {
        const char *s;
        ASSERT_OK(gguf_get_arr_str(g, "tokenizer.ggml.merges", (uint64_t)atoll(key), &s, NULL, &e));
        ASSERT_STREQ(s, json_string_value(val));
    }
    const char *tmpl;
    size_t tlen;
    ASSERT_OK(gguf_get_str(g, "tokenizer.chat_template", &tmpl, &tlen, &e));
    ASSERT_EQ(tlen, json_integer_value(json_object_get(ref, "chat_template_len")));
    const char *head = json_string_value(json_object_get(ref, "chat_template_head"));
    ASSERT_TRUE(strncmp(tmpl, head, strlen(head)) == 0);
    ASSERT_EQ(g->n_tensors, json_integer_value(json_object_get(ref, "n_tensors")));

    // token_embd (Q8_0) rows, dequantized, against gguf.quants.dequantize.
    json_t *emb = json_object_get(ref, "token_embd");
    struct tensor t;
    ASSERT_OK(gguf_get_tensor(g, "token_embd.weight", &t, &e));
    ASSERT_STREQ(dtype_name(t.dtype), json_string_value(json_object_get(emb, "type")));
    ASSERT_EQ(t.ne[0], json_integer_value(json_array_get(json_object_get(emb, "shape"), 0)));
    ASSERT_EQ(t.ne[1], json_integer_value(json_array_get(json_object_get(emb, "shape"), 1)));
    float row[576];
    ASSERT_EQ(t.ne[1], 576);
    json_object_foreach(json_object_get(emb, "rows"), key, val) {
        int64_t r = atoll(key);
        dtype_to_f32(t.dtype, (const char *)t.data + r * (int64_t)dtype_row_bytes(t.dtype, 576), row, 576);
        for (int i = 0; i < 576; i++) ASSERT_NEAR(row[i], json_number_value(json_array_get(val, (size_t)i)), 1e-7);
    }
    gguf_close(g);
    json_decref(ref);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
