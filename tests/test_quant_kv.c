// KV-cache scales from checkpoints on the CPU backend (the reference): model_kv_scales_load
// (src/model/kv_scales.c), the FP8 KV cache storing value / scale per layer (runner_kv.c,
// cpu_backend.c's KV write, cpu_attention.c's tile loads).
// - tests/fixtures/quant (tools/make_quant_fixtures.py):
//     ct_fp8_kv, ct_fp8_kv_hd64 (head_dim 64, also the CUDA model test's): compressed-tensors FP8_DYNAMIC
//       weights with kv_cache_scheme {float8, tensor, static}, self_attn.k_scale / v_scale
//       written by compressed-tensors itself (scales = max |K| / 448, max |V| / 448 over
//       calibration prompts);
//     fp8_kv: quant_method fp8 (128x128 blocks) with F32 scalar self_attn.k_scale / v_scale and
//       "kv_cache_scheme": "static" (AutoFP8 / AMD FP8-KV checkpoints);
//     fp8_kv_legacy: the same with the deprecated single self_attn.kv_scale (K and V), undeclared.
//   Their q / k projections are scaled by 2^-8 / 2^8 and v / o by 2^8 / 2^-8: the same function,
//   with post-RoPE K and V beyond 448, so an FP8 cache that ignored the scales saturates.
//   refs.json: transformers' fp32 forward, weights = the exact dequantization, KV unquantized
//   (transformers 5 + compressed-tensors 0.20 drop k_scale / v_scale on load: the tool checks
//   it); refs_kv.json: the same with every layer's post-RoPE K / V fake-quantized with the stored
//   scales, e4m3(clamp(x / s, +-448)) * s, in torch.
// - The scales are read per layer (legacy kv_scale for both), every tensor consumed; the runner's
//   FP8 KV layers carry them; --kv-cache-dtype auto picks FP8 for a checkpoint that declares its KV
//   scheme only; an F32 cache ignores them.
// - Logits: the FP8 cache matches refs_kv.json within KV_RTOL, far from refs.json; an F32 cache
//   matches refs.json within LOGIT_RTOL; the same checkpoint with its scales replaced by 1.0 misses
//   refs_kv.json by far (the check can fail). Greedy decode over the FP8 cache equals refs_kv's.
// - Refused by name: kv_cache_scheme int8 / dynamic / asymmetric / per-head / per-channel /
//   group / 4-bit; per-head scale tensors, q_scale, zero points, a declared scheme without a
//   layer's scales, a non-positive scale, both kv_scale and k_scale; scales on an MLA layer.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/backend.h"
#include "loader/model_files.h"
#include "loader/safetensors.h"
#include "model/model.h"
#include "model/quant.h"
#include "model_refs.h"
#include "runner_sim.h"
#include "runtime/model_runner.h"
#include "test.h"

#define LOGIT_RTOL 1e-4
// The FP8 cache against torch's fake-quantized K / V: the same e4m3 roundings (measured 5.5e-6 off,
// as the F32 cache against refs.json), with room for x * (1 / s) (atomc) and x / s (torch) or fp32
// sums rounding apart at an e4m3 edge on another machine.
#define KV_RTOL 5e-4
#define MARGIN_FACTOR 4.0

static const char *const KV_FIXTURES[] = {"ct_fp8_kv", "fp8_kv", "fp8_kv_legacy", "ct_fp8_kv_hd64"};
#define N_KV ((int)(sizeof KV_FIXTURES / sizeof KV_FIXTURES[0]))

static bool has(const char *msg, const char *needle) {
    if (strstr(msg, needle)) return true;
    fprintf(stderr, "  message lacks \"%s\": %s\n", needle, msg);
    return false;
}

static const char *fixture_dir(const char *name) {
    static char path[8][4096];
    static int slot;
    char rel[256];
    snprintf(rel, sizeof rel, "quant/%s", name);
    char *p = path[slot++ % 8];
    snprintf(p, 4096, "%s", test_fixture(rel));
    return p;
}

static struct runner_options base_options(const char *path, const char *kv) {
    struct runner_options o = {
        .model_path = path,
        .device = "cpu",
        .dtype = "auto",
        .load_format = "auto",
        .kv_cache_dtype = kv,
        .block_size = 4,
        .num_kv_blocks = 64,
        .max_num_seqs = 4,
        .max_num_batched_tokens = 64,
        .max_model_len = 64,
        .num_threads = 2,
        .enforce_eager = true,
        .quant_weight_only = true, // the refs are weight-only (activations unquantized)
    };
    return o;
}

// The stored scales refs_kv.json records (layer 0; the fixtures have one layer).
static void refs_kv_scales(const char *name, float *k, float *v) {
    char rel[256];
    snprintf(rel, sizeof rel, "quant/%s/refs_kv.json", name);
    json_t *j = test_fixture_json(rel);
    if (!j) abort();
    *k = (float)json_number_value(json_array_get(json_object_get(j, "k_scale"), 0));
    *v = (float)json_number_value(json_array_get(json_object_get(j, "v_scale"), 0));
    json_decref(j);
}

// Max |logit - R| over every reference position of every prompt (one prefill each), and the max
// against W (same prompts) when given; then greedy decode over the cache compared with R's.
static double run_logits(struct model_runner *r, const struct refs *R, const struct refs *W, double *vs_w,
                         int *greedy_checked, unsigned seed) {
    struct sim *s = malloc(sizeof *s);
    sim_init(s, r, seed);
    double worst = 0;
    if (vs_w) *vs_w = 0;
    if (greedy_checked) *greedy_checked = 0;
    struct error err = {0};
    for (int pi = 0; pi < R->n; pi++) {
        const struct ref_prompt *p = &R->p[pi];
        struct sim_seq *q = malloc(sizeof *q);
        sim_seq_init(q, p->ids, p->n);
        sim_step_begin(s);
        if (sim_step_add(s, q, p->n, 0) != 0) abort();
        for (int k = 0; k < p->n_pos; k++)
            s->rows[k] = p->pos[k];
        s->n_rows = p->n_pos;
        struct forward_batch fb = sim_step_batch(s);
        float *lg = malloc(sizeof(float) * (size_t)p->n_pos * R->vocab);
        if (model_runner_execute_logits(r, &fb, lg, &err) != ATOMC_OK) {
            fprintf(stderr, "execute: %s\n", err.msg);
            abort();
        }
        sim_step_commit(s);
        double d = max_abs_diff(lg, p->logits, p->n_pos * R->vocab);
        if (!(d <= worst)) worst = d;
        if (W && vs_w) {
            double dw = max_abs_diff(lg, W->p[pi].logits, p->n_pos * R->vocab);
            if (dw > *vs_w) *vs_w = dw;
        }
        if (greedy_checked) { // the first token from the prefill's last row, the rest decoded over the cache
            int32_t got[N_GREEDY];
            const float *last = lg + (size_t)(p->n_pos - 1) * R->vocab;
            int best = 0;
            for (int v = 1; v < R->vocab; v++)
                best = last[v] > last[best] ? v : best;
            got[0] = best;
            q->ids[q->n_ids++] = best;
            if (sim_greedy(s, q, N_GREEDY - 1, got + 1, &err) != ATOMC_OK) {
                fprintf(stderr, "greedy: %s\n", err.msg);
                abort();
            }
            int c = greedy_compare(R, p, got, "fp8 KV");
            if (c < 0) test_fail(__FILE__, __LINE__, "greedy tokens differ from refs_kv.json");
            *greedy_checked += c > 0 ? c : 0;
        }
        free(lg);
        sim_seq_release(s, q);
        free(q);
    }
    sim_free(s);
    free(s);
    return worst;
}

// ---------------------------------------------------------------------------------------------
// Loading

TEST(kv_scales_read_per_layer) {
    for (int fi = 0; fi < N_KV; fi++) {
        struct error e = {0};
        struct backend *b;
        struct backend_options bo = {.num_threads = 2};
        ASSERT_OK(backend_create("cpu", &bo, &b, &e));
        struct model_files *mf;
        ASSERT_OK(model_files_open(&mf, fixture_dir(KV_FIXTURES[fi]), &e));
        ASSERT_OK(model_quant_check(&mf->config, &e));
        ASSERT_EQ(model_quant_kv_fp8(&mf->config), strstr(KV_FIXTURES[fi], "legacy") == NULL); // legacy: undeclared
        struct model_load_options lo = {.files = mf, .weight_dtype = DTYPE_F32, .kv_dtype = DTYPE_FP8_E4M3};
        struct model *m = NULL;
        ASSERT_OK(model_load(&m, b, &mf->config, &lo, &e));
        ASSERT_OK(model_files_check_consumed(mf, &e)); // the scales were read
        float k, v;
        refs_kv_scales(KV_FIXTURES[fi], &k, &v);
        fprintf(stderr, "  %-14s k_scale %.6g v_scale %.6g\n", KV_FIXTURES[fi], m->layer_cache[0].k_scale,
                m->layer_cache[0].v_scale);
        ASSERT_TRUE(m->layer_cache[0].k_scale == k && m->layer_cache[0].v_scale == v);
        ASSERT_TRUE(k > 1.0f);                                      // |K| beyond 448: the scale matters
        if (strstr(KV_FIXTURES[fi], "legacy")) ASSERT_TRUE(k == v); // legacy kv_scale serves both
        model_free(m);
        model_files_close(mf);
        backend_destroy(b);
    }
}

TEST(kv_cache_dtype_auto_follows_the_checkpoint) {
    struct error e = {0};
    const struct {
        const char *name, *kv;
        int bytes; // per element
    } cases[] = {
        {"ct_fp8_kv", "auto", 1},     // kv_cache_scheme: FP8
        {"ct_fp8_kv", "float32", 4},  // explicit wins
        {"fp8_kv", "auto", 1},        // "kv_cache_scheme": "static"
        {"fp8_kv_legacy", "auto", 4}, // kv_scale tensors without a declaration do not switch the cache
        {"fp8_kv_legacy", "fp8", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct runner_options o = base_options(fixture_dir(cases[i].name), cases[i].kv);
        struct model_runner *r = NULL;
        ASSERT_OK(model_runner_create(&o, &r, &e));
        ASSERT_EQ(model_runner_kv_dtype_bytes(r), cases[i].bytes);
        model_runner_free(r);
    }
}

// ---------------------------------------------------------------------------------------------
// Logits

TEST(kv_fp8_cache_matches_fake_quantized_refs) {
    for (int fi = 0; fi < N_KV; fi++) {
        const char *name = KV_FIXTURES[fi];
        struct refs R, W;
        char rel[256];
        snprintf(rel, sizeof rel, "quant/%s/refs_kv.json", name);
        ASSERT_EQ(refs_load_rel(rel, &R, KV_RTOL, MARGIN_FACTOR), 0);
        snprintf(rel, sizeof rel, "quant/%s/refs.json", name);
        ASSERT_EQ(refs_load_rel(rel, &W, LOGIT_RTOL, MARGIN_FACTOR), 0);
        struct runner_options o = base_options(fixture_dir(name), "fp8");
        struct model_runner *r = NULL;
        struct error err = {0};
        ASSERT_OK(model_runner_create(&o, &r, &err));
        int greedy = 0;
        double vs_w, d = run_logits(r, &R, &W, &vs_w, &greedy, 5u + (unsigned)fi);
        fprintf(stderr,
                "  %-14s fp8 KV: max |logit - refs_kv| = %.2e (tolerance %.2e); vs unquantized-KV refs %.3f; %d "
                "greedy steps equal\n",
                name, d, R.tol, vs_w, greedy);
        ASSERT_TRUE(d <= R.tol);
        ASSERT_TRUE(vs_w > 10 * R.tol); // the KV rounding is there
        ASSERT_TRUE(greedy > 0);
        model_runner_free(r);

        // An F32 cache ignores the scales: the unquantized reference, tightly.
        o = base_options(fixture_dir(name), "float32");
        ASSERT_OK(model_runner_create(&o, &r, &err));
        d = run_logits(r, &W, NULL, NULL, NULL, 9u + (unsigned)fi);
        fprintf(stderr, "  %-14s f32 KV: max |logit - refs| = %.2e (tolerance %.2e)\n", name, d, W.tol);
        ASSERT_TRUE(d <= W.tol);
        model_runner_free(r);
        refs_free(&R);
        refs_free(&W);
    }
}

// ---------------------------------------------------------------------------------------------
// Fixture copies

static void copy_file(const char *src, const char *dst) {
    FILE *f = fopen(src, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) abort();
    fclose(f);
    test_write_file(dst, buf, (size_t)n);
    free(buf);
}

// A copy of fixture `name` as tmp dir `as`, config.json with one exact substring replaced (from
// NULL: as is). Returns the directory.
static const char *mutant(const char *name, const char *as, const char *from, const char *to) {
    static char dirs[4][600];
    static int slot;
    char *dir = dirs[slot++ % 4];
    snprintf(dir, 600, "%s", test_tmp_path(as));
    mkdir(dir, 0755);
    char src[4200], dst[700];
    snprintf(src, sizeof src, "%s/model.safetensors", fixture_dir(name));
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    copy_file(src, dst);
    snprintf(src, sizeof src, "%s/config.json", fixture_dir(name));
    FILE *f = fopen(src, "rb");
    if (!f) abort();
    char *json = calloc(1, 1 << 16);
    size_t n = fread(json, 1, (1 << 16) - 1, f);
    fclose(f);
    char *out = calloc(1, (1 << 16) + 1024);
    char *p = from ? strstr(json, from) : NULL;
    if (from && !p) {
        fprintf(stderr, "mutant: '%s' not in %s (%zu bytes)\n", from, src, n);
        abort();
    }
    if (p)
        sprintf(out, "%.*s%s%s", (int)(p - json), json, to, p + strlen(from));
    else
        strcpy(out, json);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    test_write_file(dst, out, strlen(out));
    free(json);
    free(out);
    return dir;
}

// One change to dir/model.safetensors: tensor `name` dropped (dtype NULL), or set to `n` values
// `vals` as dtype "F32" / "BF16" with shape {n} (added when absent).
static void edit_tensor(const char *dir, const char *name, const char *dtype, const float *vals, int n) {
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct safetensors_file *f;
    struct error e = {0};
    if (safetensors_open(&f, path, &e) != ATOMC_OK) abort();
    json_t *h = json_object();
    unsigned char *data = malloc(f->size + 64);
    size_t used = 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        const struct safetensors_tensor *t = &f->tensors[i];
        if (!strcmp(t->name, name)) continue;
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->ne[d]));
        size_t nb = (size_t)(t->end - t->begin);
        memcpy(data + used, f->data + 8 + f->header_len + t->begin, nb);
        json_object_set_new(h, t->name,
                            json_pack("{s:s, s:o, s:[I, I]}", "dtype", t->dtype_name, "shape", shape, "data_offsets",
                                      (json_int_t)used, (json_int_t)(used + nb)));
        used += nb;
    }
    if (dtype) {
        const bool bf = !strcmp(dtype, "BF16");
        size_t nb = (size_t)n * (bf ? 2 : 4);
        for (int i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &vals[i], 4);
            if (bf) {
                uint16_t b16 = (uint16_t)(u >> 16); // the test values are bf16-exact
                memcpy(data + used + 2 * (size_t)i, &b16, 2);
            } else {
                memcpy(data + used + 4 * (size_t)i, &u, 4);
            }
        }
        json_object_set_new(h, name,
                            json_pack("{s:s, s:[i], s:[I, I]}", "dtype", dtype, "shape", n, "data_offsets",
                                      (json_int_t)used, (json_int_t)(used + nb)));
        used += nb;
    }
    char *hs = json_dumps(h, JSON_COMPACT | JSON_SORT_KEYS);
    size_t hl = strlen(hs), padded = (hl + 7) / 8 * 8, total = 8 + padded + used;
    unsigned char *out = calloc(1, total);
    for (int k = 0; k < 8; k++)
        out[k] = (unsigned char)((uint64_t)padded >> (8 * k));
    memcpy(out + 8, hs, hl);
    memset(out + 8 + hl, ' ', padded - hl);
    memcpy(out + 8 + padded, data, used);
    safetensors_close(f);
    test_write_file(path, out, total);
    free(out);
    free(data);
    free(hs);
    json_decref(h);
}

static atomc_status try_load(const char *dir, const char *kv, struct error *e) {
    struct runner_options o = base_options(dir, kv);
    struct model_runner *r = NULL;
    *e = (struct error){0};
    atomc_status st = model_runner_create(&o, &r, e);
    if (r) model_runner_free(r);
    fprintf(stderr, "  %s: %s\n", strrchr(dir, '/') + 1, st == ATOMC_OK ? "loads" : e->msg);
    return st;
}

// The check can fail: the same checkpoint with its scales replaced by 1.0 (an FP8 cache that
// ignored them) saturates K / V at 448 and misses refs_kv.json by far.
TEST(kv_scales_of_one_miss_the_refs) {
    const float one = 1.0f;
    const char *d = mutant("ct_fp8_kv", "kv_one", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.k_scale", "BF16", &one, 1);
    edit_tensor(d, "model.layers.0.self_attn.v_scale", "BF16", &one, 1);
    struct refs R;
    ASSERT_EQ(refs_load_rel("quant/ct_fp8_kv/refs_kv.json", &R, KV_RTOL, MARGIN_FACTOR), 0);
    struct runner_options o = base_options(d, "fp8");
    struct model_runner *r = NULL;
    struct error err = {0};
    ASSERT_OK(model_runner_create(&o, &r, &err));
    double dd = run_logits(r, &R, NULL, NULL, NULL, 21u);
    fprintf(stderr, "  scales 1.0: max |logit - refs_kv| = %.3f (tolerance %.2e)\n", dd, R.tol);
    ASSERT_TRUE(dd > 20 * R.tol);
    model_runner_free(r);
    refs_free(&R);
}

// A layer with k_scale alone uses it for V too (vLLM); tensors in the wrong form are refused.
TEST(kv_scale_tensors_refused_by_name) {
    struct error e = {0};
    const char *d;
    const float two[2] = {1.5f, 2.0f}, neg = -1.0f;
    // k_scale only: loads, v = k
    d = mutant("fp8_kv", "kv_konly", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.v_scale", NULL, NULL, 0);
    ASSERT_OK(try_load(d, "fp8", &e));
    // per-head scales
    d = mutant("fp8_kv", "kv_perhead", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.k_scale", "F32", two, 2);
    ASSERT_EQ(try_load(d, "fp8", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "self_attn.k_scale holds 2 KV-cache scales") && has(e.msg, "per-head"));
    // non-positive
    d = mutant("fp8_kv", "kv_neg", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.v_scale", "F32", &neg, 1);
    ASSERT_EQ(try_load(d, "fp8", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "v_scale: the KV-cache scale -1 is not a positive finite number"));
    // q_scale (FP8 attention's query)
    d = mutant("fp8_kv", "kv_q", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.q_scale", "F32", two, 1);
    ASSERT_EQ(try_load(d, "fp8", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "self_attn.q_scale") && has(e.msg, "query quantization"));
    // zero points
    d = mutant("ct_fp8_kv", "kv_zp", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.k_zero_point", "F32", two, 1);
    ASSERT_EQ(try_load(d, "auto", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "k_zero_point") && has(e.msg, "asymmetric"));
    // both forms
    d = mutant("fp8_kv_legacy", "kv_both", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.k_scale", "F32", two, 1);
    ASSERT_EQ(try_load(d, "fp8", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "both") && has(e.msg, "kv_scale"));
    // a declared kv_cache_scheme without the scales
    d = mutant("ct_fp8_kv", "kv_missing", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.k_scale", NULL, NULL, 0);
    edit_tensor(d, "model.layers.0.self_attn.v_scale", NULL, NULL, 0);
    ASSERT_EQ(try_load(d, "auto", &e), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e.msg, "declares kv_cache_scheme") && has(e.msg, "layer 0 has no"));
    // scales on a latent (MLA) layer: DeepSeek-V3 in fp8 blocks
    d = mutant("deepseek_v3_fp8_block", "kv_mla", NULL, NULL);
    edit_tensor(d, "model.layers.0.self_attn.k_scale", "F32", two, 1);
    ASSERT_EQ(try_load(d, "fp8", &e), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e.msg, "KV-cache scales for a latent (MLA) cache") && has(e.msg, "not implemented"));
}

// kv_cache_scheme forms other than static symmetric float8 per tensor are refused by name.
TEST(kv_cache_scheme_variants_refused_by_name) {
    static struct model_config cfg;
    const struct {
        const char *scheme, *needle;
    } cases[] = {
        {"{\"num_bits\": 8, \"type\": \"int\", \"strategy\": \"tensor\", \"dynamic\": false, \"symmetric\": true}",
         "KV-cache quantization (int8, strategy tensor)"},
        {"{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": true, \"symmetric\": true}",
         "(float8 dynamic, strategy tensor)"},
        {"{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": false, \"symmetric\": false}",
         "asymmetric"},
        {"{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"attn_head\", \"dynamic\": false, \"symmetric\": true}",
         "strategy attn_head"},
        {"{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"channel\", \"dynamic\": false, \"symmetric\": true}",
         "strategy channel"},
        {"{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"group\", \"group_size\": 16, \"dynamic\": false, "
         "\"symmetric\": true}",
         "group_size 16"},
        {"{\"num_bits\": 4, \"type\": \"float\", \"strategy\": \"tensor\", \"dynamic\": false, \"symmetric\": true}",
         "float4"},
    };
    // the fp8 method's string form
    const char *fp8 = "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
                      "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
                      "\"vocab_size\": 128, \"quantization_config\": {\"quant_method\": \"fp8\", "
                      "\"weight_block_size\": [128, 128], \"kv_cache_scheme\": \"%s\"}}";
    char js[1024];
    struct error e0 = {0};
    snprintf(js, sizeof js, fp8, "static");
    ASSERT_OK(model_config_parse_json(&cfg, js, "config.json", &e0));
    ASSERT_TRUE(model_quant_kv_fp8(&cfg));
    ASSERT_OK(model_quant_check(&cfg, &e0));
    snprintf(js, sizeof js, fp8, "dynamic");
    ASSERT_OK(model_config_parse_json(&cfg, js, "config.json", &e0));
    ASSERT_EQ(model_quant_check(&cfg, &e0), ATOMC_ERR_UNSUPPORTED);
    ASSERT_TRUE(has(e0.msg, "quant_method 'fp8': KV-cache quantization (float8 dynamic, strategy tensor)"));
    snprintf(js, sizeof js, fp8, "per_head");
    ASSERT_EQ(model_config_parse_json(&cfg, js, "config.json", &e0), ATOMC_ERR_FORMAT);
    ASSERT_TRUE(has(e0.msg, "kv_cache_scheme' = \"per_head\" must be \"static\" or \"dynamic\""));
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char json[4096];
        snprintf(json, sizeof json,
                 "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
                 "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"vocab_size\": "
                 "128, \"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": "
                 "\"float-quantized\", \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], \"weights\": "
                 "{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"channel\", \"symmetric\": true, \"dynamic\": "
                 "false}}}, \"kv_cache_scheme\": %s}}",
                 cases[i].scheme);
        struct error e = {0};
        ASSERT_OK(model_config_parse_json(&cfg, json, "config.json", &e));
        ASSERT_TRUE(!model_quant_kv_fp8(&cfg));
        ASSERT_EQ(model_quant_check(&cfg, &e), ATOMC_ERR_UNSUPPORTED);
        fprintf(stderr, "  %s\n", e.msg);
        ASSERT_TRUE(has(e.msg, cases[i].needle) && has(e.msg, "is not implemented"));
    }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
