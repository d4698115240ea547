// safetensors reader: the reference file written by the `safetensors` package
// (tests/fixtures/loader/ref.safetensors, values in ref_safetensors.json, both made by
// tools/gen_loader_refs.py), and hand-made valid / corrupt files in a temp directory:
// every error must name the file and (where there is one) the tensor.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loader/safetensors.h"
#include "test.h"

// Writes [u64 len][header][data] with header length `hlen_override` if non-zero.
static const char *write_st(const char *name, const char *header, const void *data, size_t dlen,
                            uint64_t hlen_override) {
    size_t hl = strlen(header);
    size_t total = 8 + hl + dlen;
    unsigned char *buf = malloc(total);
    uint64_t n = hlen_override ? hlen_override : hl;
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(n >> (8 * i));
    memcpy(buf + 8, header, hl);
    if (dlen) memcpy(buf + 8 + hl, data, dlen);
    const char *p = test_tmp_path(name);
    test_write_file(p, buf, total);
    free(buf);
    return p;
}

static const float F6[6] = {1, 2, 3, 4, 5, 6};

// ---------------------------------------------------------------------------------

TEST(reads_reference_file_from_safetensors_package) {
    struct error e = {0};
    char *text;
    ASSERT_OK(file_read_all(test_fixture("loader/ref_safetensors.json"), &text, NULL, &e));
    json_t *ref = json_loads(text, 0, NULL);
    free(text);
    ASSERT_TRUE(ref != NULL);
    struct safetensors_file *f;
    ASSERT_OK(safetensors_open(&f, test_fixture("loader/ref.safetensors"), &e));
    ASSERT_EQ(f->n_tensors, json_object_size(ref));
    const char *name;
    json_t *r;
    json_object_foreach(ref, name, r) {
        const char *dt = json_string_value(json_object_get(r, "dtype"));
        json_t *shape = json_object_get(r, "shape"), *vals = json_object_get(r, "values");
        struct tensor t;
        atomc_status st = safetensors_get_tensor(f, name, &t, &e);
        if (!strcmp(dt, "float64")) { // listed, not served
            ASSERT_EQ(st, ATOMC_ERR_UNSUPPORTED);
            ASSERT_TRUE(strstr(e.msg, "'f64'") && strstr(e.msg, "F64") && strstr(e.msg, "ref.safetensors"));
            continue;
        }
        ASSERT_OK(st);
        if (json_array_size(shape) == 0) {
            ASSERT_EQ(t.ndim, 1);
            ASSERT_EQ(t.ne[0], 1);
        } else {
            ASSERT_EQ(t.ndim, (int)json_array_size(shape));
            for (int d = 0; d < t.ndim; d++) ASSERT_EQ(t.ne[d], json_integer_value(json_array_get(shape, (size_t)d)));
        }
        // A view into the mapping, not a copy.
        ASSERT_TRUE((const unsigned char *)t.data >= f->data && (const unsigned char *)t.data < f->data + f->size);
        int64_t n = tensor_numel(&t);
        ASSERT_EQ(n, (int64_t)json_array_size(vals));
        for (int64_t i = 0; i < n; i++) {
            double want = json_number_value(json_array_get(vals, (size_t)i)), got;
            switch (t.dtype) {
            case DTYPE_I32: { int32_t v; memcpy(&v, (char *)t.data + 4 * i, 4); got = v; break; }
            case DTYPE_I64: { int64_t v; memcpy(&v, (char *)t.data + 8 * i, 8); got = (double)v; break; }
            case DTYPE_U8: got = ((uint8_t *)t.data)[i]; break;
            default: { float v; dtype_to_f32(t.dtype, (char *)t.data + dtype_row_bytes(t.dtype, i), &v, 1); got = v; }
            }
            if (got != want) {
                test_fail(__FILE__, __LINE__, "%s[%lld]: %g != %g", name, (long long)i, got, want);
                json_decref(ref);
                safetensors_close(f);
                return;
            }
        }
    }
    struct tensor t;
    ASSERT_OK(safetensors_get_tensor(f, "lm_head.weight", &t, &e));
    ASSERT_EQ(t.dtype, DTYPE_BF16);
    ASSERT_OK(safetensors_get_tensor(f, "model.norm.weight", &t, &e));
    ASSERT_EQ(t.dtype, DTYPE_F16);
    ASSERT_OK(safetensors_get_tensor(f, "x.3d", &t, &e));
    ASSERT_EQ(t.ndim, 3);
    json_decref(ref);
    safetensors_close(f);
}

TEST(valid_handmade_file_and_metadata_skipped) {
    struct error e = {0};
    const char *p = write_st("ok.safetensors",
                             "{\"__metadata__\":{\"format\":\"pt\"},"
                             "\"b\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                             "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[24,24]}}  ",
                             F6, sizeof F6, 0);
    struct safetensors_file *f;
    ASSERT_OK(safetensors_open(&f, p, &e));
    ASSERT_EQ(f->n_tensors, 2);
    struct tensor t;
    ASSERT_OK(safetensors_get_tensor(f, "b", &t, &e));
    ASSERT_EQ(t.dtype, DTYPE_F32);
    ASSERT_EQ(t.ne[0], 2);
    ASSERT_EQ(t.ne[1], 3);
    float v;
    memcpy(&v, (char *)t.data + 5 * 4, 4);
    ASSERT_NEAR(v, 6.0, 0);
    ASSERT_EQ(safetensors_get_tensor(f, "nope", &t, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "ok.safetensors") && strstr(e.msg, "'nope'"));
    safetensors_close(f);
}

// Each corrupt file -> FORMAT, message containing the file name and `needle`.
static int expect_bad(const char *path, const char *needle) {
    struct error e = {0};
    struct safetensors_file *f = NULL;
    atomc_status st = safetensors_open(&f, path, &e);
    const char *base = strrchr(path, '/') + 1;
    if (st != ATOMC_ERR_FORMAT || f != NULL || !strstr(e.msg, base) || !strstr(e.msg, needle)) {
        test_fail(__FILE__, __LINE__, "%s: status %d, message \"%s\" (want \"%s\")", base, (int)st, e.msg, needle);
        safetensors_close(f);
        return 0;
    }
    return 1;
}

TEST(corrupt_files_are_clear_errors) {
    // Header length larger than the file.
    if (!expect_bad(write_st("hl.safetensors", "{}", NULL, 0, 1000), "header length 1000 is larger than the file"))
        return;
    // Absurd header length (garbage file).
    if (!expect_bad(write_st("huge.safetensors", "{}", NULL, 0, 0xffffffffffffull), "larger than the file")) return;
    // Too short.
    test_write_file(test_tmp_path("short.safetensors"), "abc", 3);
    if (!expect_bad(test_tmp_path("short.safetensors"), "too short")) return;
    // Not JSON / not an object.
    if (!expect_bad(write_st("nojson.safetensors", "{\"a\": nope}", NULL, 0, 0), "not valid JSON")) return;
    if (!expect_bad(write_st("arr.safetensors", "[1, 2]", NULL, 0, 0), "not a JSON object")) return;
    // Entry problems name the tensor.
    if (!expect_bad(write_st("ent.safetensors", "{\"w\": 3}", NULL, 0, 0), "tensor 'w': header entry is not a JSON"))
        return;
    if (!expect_bad(write_st("nodt.safetensors", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", F6, 4, 0),
                    "tensor 'w': 'dtype'"))
        return;
    if (!expect_bad(write_st("shp.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
                             F6, 4, 0),
                    "tensor 'w': shape[0] is not a non-negative integer"))
        return;
    if (!expect_bad(write_st("shp2.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
                             F6, 4, 0),
                    "tensor 'w': shape[0]"))
        return;
    if (!expect_bad(write_st("shp3.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,4]}}",
                             F6, 4, 0),
                    "tensor 'w': 'shape'"))
        return;
    if (!expect_bad(write_st("off.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", F6, 4,
                             0),
                    "tensor 'w': 'data_offsets'"))
        return;
    if (!expect_bad(write_st("neg.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", F6,
                             4, 0),
                    "tensor 'w': data_offsets must be non-negative"))
        return;
    if (!expect_bad(write_st("rev.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", F6,
                             8, 0),
                    "tensor 'w': data_offsets [8, 4] are reversed"))
        return;
    // Out of range (also what a truncated file looks like).
    if (!expect_bad(write_st("oob.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24]}}", F6,
                             20, 0),
                    "tensor 'w': data_offsets [0, 24] run past the end of the data (20 bytes; truncated file?)"))
        return;
    // Inconsistent with dtype * shape.
    if (!expect_bad(write_st("sz.safetensors", "{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,24]}}",
                             F6, 24, 0),
                    "tensor 'w': data_offsets span 24 bytes but shape and dtype BF16 need 12"))
        return;
    // Overflowing shape.
    if (!expect_bad(write_st("ovf.safetensors",
                             "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", F6,
                             4, 0),
                    "tensor 'w': data_offsets span 4 bytes"))
        return;
    // Overlap names both tensors.
    if (!expect_bad(write_st("ovl.safetensors",
                             "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
                             F6, 24, 0),
                    "tensors 'a' [0, 16) and 'b' [8, 16) overlap"))
        return;
    // Duplicate keys in the header.
    if (!expect_bad(write_st("dup.safetensors",
                             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                             "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                             F6, 8, 0),
                    "not valid JSON"))
        return;
}

TEST(truncated_real_file) {
    // Take the reference file and cut off its last bytes: the last tensor must be named.
    struct error e = {0};
    char *data;
    size_t n;
    ASSERT_OK(file_read_all(test_fixture("loader/ref.safetensors"), &data, &n, &e));
    const char *p = test_tmp_path("trunc.safetensors");
    test_write_file(p, data, n - 3);
    free(data);
    struct safetensors_file *f = NULL;
    ASSERT_EQ(safetensors_open(&f, p, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "trunc.safetensors") && strstr(e.msg, "tensor '") && strstr(e.msg, "truncated"));
    // Header cut in half.
    ASSERT_OK(file_read_all(test_fixture("loader/ref.safetensors"), &data, &n, &e));
    test_write_file(p, data, 100);
    free(data);
    ASSERT_EQ(safetensors_open(&f, p, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "trunc.safetensors") && strstr(e.msg, "larger than the file"));
}

TEST(unsupported_dtypes_and_ranks) {
    struct error e = {0};
    const char *p = write_st("uns.safetensors",
                             "{\"b\":{\"dtype\":\"BOOL\",\"shape\":[4],\"data_offsets\":[0,4]},"
                             "\"q\":{\"dtype\":\"Q9_X\",\"shape\":[4],\"data_offsets\":[4,8]},"
                             "\"r\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,2],\"data_offsets\":[8,10]}}",
                             F6, 12, 0);
    struct safetensors_file *f;
    ASSERT_OK(safetensors_open(&f, p, &e));
    struct tensor t;
    ASSERT_EQ(safetensors_get_tensor(f, "b", &t, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "uns.safetensors") && strstr(e.msg, "'b'") && strstr(e.msg, "BOOL"));
    ASSERT_EQ(safetensors_get_tensor(f, "q", &t, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "Q9_X") != NULL);
    ASSERT_EQ(safetensors_get_tensor(f, "r", &t, &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(strstr(e.msg, "5 dimensions") != NULL);
    safetensors_close(f);
}

TEST(memory_entry_point) {
    struct error e = {0};
    unsigned char buf[8 + 64];
    const char *h = "{\"w\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}";
    size_t hl = strlen(h);
    memset(buf, 0, sizeof buf);
    buf[0] = (unsigned char)hl;
    memcpy(buf + 8, h, hl);
    struct safetensors_file *f;
    ASSERT_OK(safetensors_open_memory(&f, buf, 8 + hl + 4, "mem", &e));
    ASSERT_TRUE(safetensors_find(f, "w") != NULL);
    safetensors_close(f);
    ASSERT_EQ(safetensors_open_memory(&f, buf, 8 + hl + 3, "mem", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "mem: tensor 'w'") != NULL);
}

TEST(sharded_checkpoint_via_index) {
    struct error e = {0};
    char dir[600];
    snprintf(dir, sizeof dir, "%s/sharded", test_tmp_dir());
    mkdir(dir, 0755);
    char s1[700], s2[700], idx[700];
    snprintf(s1, sizeof s1, "sharded/model-00001-of-00002.safetensors");
    snprintf(s2, sizeof s2, "sharded/model-00002-of-00002.safetensors");
    write_st(s1, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", F6, 12, 0);
    write_st(s2, "{\"c\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", F6 + 3, 12, 0);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    const char *index = "{\"metadata\":{\"total_size\":24},\"weight_map\":{"
                        "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002.safetensors\","
                        "\"c\":\"model-00002-of-00002.safetensors\"}}";
    test_write_file(idx, index, strlen(index));
    struct safetensors_set *s;
    ASSERT_OK(safetensors_set_open(&s, dir, &e)); // directory -> index preferred
    ASSERT_EQ(s->n_files, 2);
    ASSERT_EQ(s->n_entries, 3);
    struct tensor t;
    const char *file;
    ASSERT_OK(safetensors_set_get_tensor(s, "c", &t, &file, &e));
    ASSERT_TRUE(strstr(file, "model-00002-of-00002") != NULL);
    float v;
    memcpy(&v, (char *)t.data + 8, 4);
    ASSERT_NEAR(v, 6.0, 0);
    ASSERT_OK(safetensors_set_get_tensor(s, "b", &t, &file, &e));
    memcpy(&v, t.data, 4);
    ASSERT_NEAR(v, 3.0, 0);
    ASSERT_EQ(safetensors_set_get_tensor(s, "zz", &t, &file, &e), ATOMC_ERR_NOT_FOUND);
    ASSERT_TRUE(strstr(e.msg, "model.safetensors.index.json") && strstr(e.msg, "'zz'"));
    safetensors_set_close(s);

    // Index naming a tensor its shard lacks.
    const char *bad = "{\"weight_map\":{\"a\":\"model-00002-of-00002.safetensors\"}}";
    test_write_file(idx, bad, strlen(bad));
    ASSERT_EQ(safetensors_set_open(&s, idx, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "index.json") && strstr(e.msg, "'a'") && strstr(e.msg, "model-00002-of-00002"));
    // Path traversal in a shard name.
    bad = "{\"weight_map\":{\"a\":\"../x.safetensors\"}}";
    test_write_file(idx, bad, strlen(bad));
    ASSERT_EQ(safetensors_set_open(&s, idx, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "not a plain file name") != NULL);
    // Missing shard file.
    bad = "{\"weight_map\":{\"a\":\"model-00009.safetensors\"}}";
    test_write_file(idx, bad, strlen(bad));
    ASSERT_EQ(safetensors_set_open(&s, idx, &e), ATOMC_ERR_IO);
    ASSERT_TRUE(strstr(e.msg, "model-00009.safetensors") && strstr(e.msg, "'a'"));
    // weight_map missing.
    test_write_file(idx, "{}", 2);
    ASSERT_EQ(safetensors_set_open(&s, idx, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "weight_map") != NULL);
    // A corrupt shard is reported with the index and the tensor that led to it.
    write_st("sharded/model-00003.safetensors", "[]", NULL, 0, 0);
    bad = "{\"weight_map\":{\"a\":\"model-00003.safetensors\"}}";
    test_write_file(idx, bad, strlen(bad));
    ASSERT_EQ(safetensors_set_open(&s, idx, &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(strstr(e.msg, "model-00003.safetensors") && strstr(e.msg, "not a JSON object"));
}

TEST(directory_without_weights) {
    struct error e = {0};
    char dir[600];
    snprintf(dir, sizeof dir, "%s/emptydir", test_tmp_dir());
    mkdir(dir, 0755);
    struct safetensors_set *s;
    ASSERT_EQ(safetensors_set_open(&s, dir, &e), ATOMC_ERR_IO);
    ASSERT_TRUE(strstr(e.msg, "emptydir") && strstr(e.msg, "model.safetensors"));
}

int main(int argc, char **argv) { return test_main(argc, argv); }
