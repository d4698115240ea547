// Issue 28 item 4: a model whose logits hold NaN turns into a clear per-request error
// (finish reason "error" with a message naming the cause), never into a fixed token, on the
// CPU backend. The fixture is tests/fixtures/models/llama_gqa copied to a scratch directory
// with one embedding row (token POISON) set to NaN: a prompt that holds that token has NaN
// hidden states (and so NaN logits) from its position on, every other prompt is untouched,
// so one batch shows both outcomes side by side. With echo + prompt logprobs the request
// fails at the first chunk whose rows are NaN. Before the fix the sampler's arg-max skipped
// NaN entries and returned a fixed id (0) with a NaN logprob.
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "common/check.h"
#include "engine_model_scenarios.h"
#include "test.h"

enum { POISON = 200 };

static void *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = xmalloc((size_t)len + 1);
    CHECK(fread(buf, 1, (size_t)len, f) == (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return buf;
}

// The poisoned copy of llama_gqa; returns its directory.
static const char *make_poisoned_model(void) {
    static char dir[1024];
    snprintf(dir, sizeof dir, "%s", test_tmp_path("llama_gqa_nan"));
    char cmd[2200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    CHECK(system(cmd) == 0);
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors"};
    for (int i = 0; i < 3; i++) {
        char rel[256], dst[1300];
        snprintf(rel, sizeof rel, "models/llama_gqa/%s", files[i]);
        size_t n;
        uint8_t *b = read_all(test_fixture(rel), &n);
        if (i == 2) { // model.embed_tokens.weight row POISON := NaN
            uint64_t hlen;
            memcpy(&hlen, b, 8);
            json_error_t je;
            json_t *h = json_loadb((const char *)b + 8, hlen, 0, &je);
            CHECK_MSG(h, "safetensors header: %s", je.text);
            json_t *t = json_object_get(h, "model.embed_tokens.weight");
            CHECK(t && !strcmp(json_string_value(json_object_get(t, "dtype")), "F32"));
            size_t cols = (size_t)json_integer_value(json_array_get(json_object_get(t, "shape"), 1));
            size_t off = 8 + hlen + (size_t)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0));
            float nan = NAN;
            for (size_t c = 0; c < cols; c++)
                memcpy(b + off + ((size_t)POISON * cols + c) * 4, &nan, 4);
            json_decref(h);
        }
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        test_write_file(dst, b, n);
        free(b);
    }
    return dir;
}

static atomc_engine *make_engine(const char *dir) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    o.model_path = dir;
    o.device = "cpu";
    o.block_size = 16;
    o.num_kv_blocks = 64;
    o.max_num_seqs = 4;
    o.max_num_batched_tokens = 16; // chunked prefill: the echo request spans several steps
    o.num_threads = 2;
    atomc_engine *e = NULL;
    char err[1024];
    CHECK_MSG(atomc_engine_create(&o, &e, err, sizeof err) == ATOMC_OK, "%s", err);
    return e;
}

struct plp_out {
    struct es_out base;
    int n_prompt_lp;
};

TEST(nan_logits_fail_only_the_request_that_produced_them) {
    atomc_engine *e = make_engine(make_poisoned_model());
    int32_t good[12], bad[12];
    for (int i = 0; i < 12; i++)
        good[i] = bad[i] = (int32_t)(3 + (i * 17) % 180);
    bad[7] = POISON;
    static struct es_out og, ob, os;
    es_add(e, good, 12, 6, &og, NULL);
    es_add(e, bad, 12, 6, &ob, NULL);
    // Sampled (temperature 1, top-p) rather than greedy: the same error.
    atomc_request r;
    atomc_request_init(&r);
    r.prompt_ids = bad;
    r.n_prompt_ids = 12;
    r.params.temperature = 1.0f;
    r.params.top_p = 0.9f;
    r.params.max_tokens = 4;
    r.params.seed = 5;
    r.params.has_seed = true;
    r.on_output = es_on_out;
    r.user = &os;
    char err[512];
    ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_OK);
    es_run(e);
    ASSERT_EQ(og.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(og.n, 6);
    for (int i = 0; i < og.n; i++)
        ASSERT_TRUE(isfinite(og.lp[i]));
    ASSERT_EQ(ob.reason, ATOMC_FINISH_ERROR);
    ASSERT_EQ(ob.n, 0); // no token was made up
    ASSERT_TRUE(strstr(ob.error, "non-finite logits") != NULL);
    ASSERT_EQ(os.reason, ATOMC_FINISH_ERROR);
    ASSERT_EQ(os.n, 0);
    ASSERT_TRUE(strstr(os.error, "NaN") != NULL);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_running, 0);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    atomc_engine_free(e);
}

static void plp_on_out(void *user, const atomc_output *o) {
    struct plp_out *c = user;
    if (o->prompt_logprobs) c->n_prompt_lp = o->n_prompt_logprobs;
    es_on_out(&c->base, o);
}

TEST(nan_prompt_logprobs_fail_the_echo_request_at_its_chunk) {
    atomc_engine *e = make_engine(make_poisoned_model());
    int32_t ids[40], clean[40];
    for (int i = 0; i < 40; i++)
        ids[i] = clean[i] = (int32_t)(3 + (i * 29) % 190);
    ids[20] = POISON; // rows from 20 on are NaN: the second chunk (16 tokens a step) fails
    static struct plp_out bad, ok;
    int32_t *prompts[2] = {ids, clean};
    struct plp_out *outs[2] = {&bad, &ok};
    for (int k = 0; k < 2; k++) {
        atomc_request r;
        atomc_request_init(&r);
        r.prompt_ids = prompts[k];
        r.n_prompt_ids = 40;
        r.params.temperature = 0;
        r.params.max_tokens = 2;
        r.params.ignore_eos = true;
        r.params.logprobs = 1;
        r.params.prompt_logprobs = 3;
        r.on_output = plp_on_out;
        memset(outs[k], 0, sizeof *outs[k]);
        r.user = outs[k];
        char err[512];
        ASSERT_EQ(atomc_engine_add_request(e, &r, NULL, err, sizeof err), ATOMC_OK);
    }
    es_run(e);
    ASSERT_EQ(bad.base.reason, ATOMC_FINISH_ERROR);
    ASSERT_TRUE(strstr(bad.base.error, "non-finite logits") != NULL);
    ASSERT_EQ(bad.base.n, 0);
    ASSERT_EQ(ok.base.reason, ATOMC_FINISH_LENGTH);
    ASSERT_EQ(ok.base.n, 2);
    ASSERT_EQ(ok.n_prompt_lp, 39);
    atomc_stats st;
    atomc_engine_get_stats(e, &st);
    ASSERT_EQ(st.num_free_kv_blocks, st.num_kv_blocks);
    atomc_engine_free(e);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
