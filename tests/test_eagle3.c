// EAGLE-3 drafts (speculative method "eagle3", src/model/eagle3.c, src/runtime/runner_eagle3.c,
// the engine's draft-layer path src/engine/engine_spec_mtp.c) on the tiny Llama target
// models/llama_gqa with the head tiny_eagle3 (tools/make_tiny_eagle3.py: references from HF
// transformers' Llama modules; a draft vocabulary of 64 of the 256 target ids, so d2t matters):
// - the head's draft-vocabulary logits at every prompt position against the reference (which the
//   tool checked to move with the aux layer ids, hidden_norm, norm_before_residual and the head's
//   own RoPE), the drafts as d2t of their argmax, and the chained k = 3 drafts after the prompt;
//   the same for tiny_eagle3_speculators (the speculators layout: an Eagle3Speculator config,
//   layers.0.*, its own embed_tokens, an fc bias, explicit aux ids);
// - refusals at load, each by name: a non-Llama target, a hidden-size mismatch, another layer
//   count, an unknown architecture, bad aux layer ids, a draft vocabulary that disagrees with
//   lm_head, a corrupt file, no head directory (tests/py/test_eagle3.py adds missing / unread
//   tensors and a bad d2t);
// - the engine: greedy output with eagle3 drafts equals greedy output without them in one
//   continuous batch (k = 1 and 3, most first drafts accepted), batched under preemption with
//   prefix hits, a prefix hit against a cold run, and the randomized stress with aborts (every
//   block free at the end).
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine_model_scenarios.h"
#include "runtime/runner_internal.h"
#include "runner_util.h"
#include "test.h"

#define TARGET "models/llama_gqa"
#define HEAD "tiny_eagle3"

static struct model_runner *e3_runner(const char *target_rel, const char *head_dir, struct error *err,
                                      atomc_status *st) {
    char path[1024], head[1024];
    snprintf(path, sizeof path, "%s", test_fixture(target_rel));
    snprintf(head, sizeof head, "%s", head_dir);
    struct runner_options o = small_cpu_runner_options(path);
    o.max_logits_rows = 32;
    o.eagle3_path = head;
    struct model_runner *r = NULL;
    *st = model_runner_create(&o, &r, err);
    return r;
}

// own_embed: the head ships embed_tokens and an fc bias (the speculators variant).
static void logits_and_chain_match_reference(const char *head_rel, bool own_embed) {
    char rel[256];
    snprintf(rel, sizeof rel, "%s/eagle3_refs.json", head_rel);
    json_t *refs = test_fixture_json(rel);
    ASSERT_TRUE(refs != NULL);
    struct error err = {0};
    atomc_status st;
    char head[1024];
    snprintf(head, sizeof head, "%s", test_fixture(head_rel));
    struct model_runner *r = e3_runner(TARGET, head, &err, &st);
    if (st != ATOMC_OK) fprintf(stderr, "  %s\n", err.msg);
    ASSERT_OK(st);
    const struct model_eagle3 *e3 = r->model->eagle3;
    ASSERT_TRUE(e3 != NULL);
    ASSERT_EQ(model_runner_num_mtp_layers(r), 1);
    // No embed_tokens in the head: the target's serve; the speculators variant has its own and an fc bias.
    ASSERT_TRUE((e3->embed.data == r->model->embed.data) == !own_embed);
    ASSERT_TRUE((e3->fc_bias.data != NULL) == own_embed);
    const int DV = e3->draft_vocab;
    ASSERT_EQ(DV, (int)json_integer_value(json_object_get(refs, "draft_vocab_size")));
    ASSERT_TRUE(DV < r->cfg.vocab_size);
    json_t *aux = json_object_get(refs, "aux_layer_ids"), *jd2t = json_object_get(refs, "d2t");
    for (int i = 0; i < EAGLE3_N_AUX; i++)
        ASSERT_EQ(e3->aux_layers[i], (int)json_integer_value(json_array_get(aux, i)));
    int moved = 0;
    for (int d = 0; d < DV; d++) {
        ASSERT_EQ(e3->d2t[d], d + (int)json_integer_value(json_array_get(jd2t, d)));
        moved += e3->d2t[d] != d;
    }
    ASSERT_TRUE(moved > DV / 2); // a non-trivial mapping
    json_t *prompts = json_object_get(refs, "prompts");
    double worst = 0, scale = 1;
    int chain_checked = 0;
    for (size_t pi = 0; pi < json_array_size(prompts); pi++) {
        json_t *p = json_array_get(prompts, pi);
        json_t *jids = json_object_get(p, "ids");
        int n = (int)json_array_size(jids);
        int32_t ids[64], bt[16], slots[64], pos[64], tok[64], hrows[64], lrows[64], nd[64], rs[64];
        for (int t = 0; t < n; t++)
            ids[t] = (int32_t)json_integer_value(json_array_get(jids, t));
        int32_t t_n = one_seq_prefill(r, ids, n, bt, slots, pos);
        ASSERT_EQ(t_n, (int32_t)json_integer_value(json_object_get(p, "target_next")));
        for (int t = 0; t < n; t++) {
            tok[t] = t + 1 < n ? ids[t + 1] : t_n;
            hrows[t] = t, lrows[t] = t, nd[t] = 1, rs[t] = 0;
        }
        int32_t qs[2] = {0, n}, ctx[1] = {n}, drafts[64 * 3];
        struct draft_batch db = {.fb = {.n_seqs = 1,
                                        .n_tokens = n,
                                        .token_ids = tok,
                                        .positions = pos,
                                        .query_start = qs,
                                        .context_lens = ctx,
                                        .block_tables = bt,
                                        .max_blocks_per_seq = 16,
                                        .slot_mapping = slots,
                                        .n_logits = n,
                                        .logits_rows = lrows},
                                 .hidden_rows = hrows,
                                 .n_drafts = nd,
                                 .row_seq = rs,
                                 .max_drafts = 1,
                                 .chain_slots = NULL};
        ASSERT_OK(model_runner_draft(r, &db, drafts, &err));
        float *lg = malloc((size_t)n * DV * sizeof(float));
        r->backend->ops->copy_d2h(r->backend, lg, r->model->scratch.logits, (size_t)n * DV * sizeof(float));
        r->backend->ops->synchronize(r->backend);
        json_t *jl = json_object_get(p, "draft_logits");
        ASSERT_EQ((int)json_array_size(jl), n);
        for (int t = 0; t < n; t++) {
            json_t *row = json_array_get(jl, t);
            ASSERT_EQ((int)json_array_size(row), DV);
            int best = 0;
            for (int v = 0; v < DV; v++) {
                double ref = json_real_value(json_array_get(row, v));
                if (fabs(ref) > scale) scale = fabs(ref);
                double d = fabs(ref - lg[(size_t)t * DV + v]);
                if (d > worst) worst = d;
                if (lg[(size_t)t * DV + v] > lg[(size_t)t * DV + best]) best = v;
            }
            ASSERT_EQ(drafts[t], e3->d2t[best]); // the draft is the target id of its row's argmax
        }
        free(lg);
        // The chain: k = 3 drafts after the prompt, recomputing the first pass (same slots) first.
        int32_t one[1] = {n - 1}, nd3[1] = {3}, rs0[1] = {0}, chain_slots[2] = {n, n + 1};
        db.fb.n_logits = 1;
        db.fb.logits_rows = one;
        db.n_drafts = nd3;
        db.row_seq = rs0;
        db.max_drafts = 3;
        db.chain_slots = chain_slots;
        one_seq_prefill(r, ids, n, bt, slots, pos);
        ASSERT_OK(model_runner_draft(r, &db, drafts, &err));
        json_t *jc = json_object_get(p, "chain"), *jm = json_object_get(p, "chain_margins");
        for (int j = 0; j < 3; j++) {
            int32_t want = (int32_t)json_integer_value(json_array_get(jc, j));
            fprintf(stderr, "  prompt %zu: draft %d = %d (reference %d, margin %.3g)\n", pi, j + 1, drafts[j], want,
                    json_real_value(json_array_get(jm, j)));
            if (json_real_value(json_array_get(jm, j)) < 1e-3) break; // a near tie: the rest may differ
            ASSERT_EQ(drafts[j], want);
            chain_checked++;
        }
    }
    fprintf(stderr, "  %s draft logits: max |atomc - reference| %.3g (logit scale %.3g); %d chained drafts checked\n",
            head_rel, worst, scale, chain_checked);
    ASSERT_TRUE(worst < 1e-4 * scale + 1e-5);
    ASSERT_TRUE(chain_checked >= 8);
    model_runner_free(r);
    json_decref(refs);
}

TEST(eagle3_logits_and_chain_match_reference) {
    logits_and_chain_match_reference(HEAD, false);
    if (test_failed_now()) return;
    logits_and_chain_match_reference(HEAD "_speculators", true);
}

// A copy of the head in the scratch directory with config.json rewritten by `edit` (NULL: as it
// is) and model.safetensors copied (or replaced by `bad_weights`).
static const char *head_variant(const char *name, void (*edit)(json_t *), const char *bad_weights) {
    const char *dir = test_tmp_path(name);
    static char out[8][1024];
    static int k;
    char *d = out[k++ % 8];
    snprintf(d, 1024, "%s", dir);
    mkdir(d, 0700);
    json_t *cfg = test_fixture_json(HEAD "/config.json");
    CHECK(cfg);
    if (edit) edit(cfg);
    char p[1100];
    snprintf(p, sizeof p, "%s/config.json", d);
    CHECK(json_dump_file(cfg, p, 0) == 0);
    json_decref(cfg);
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    if (bad_weights) {
        test_write_file(p, bad_weights, strlen(bad_weights));
    } else {
        FILE *f = fopen(test_fixture(HEAD "/model.safetensors"), "rb");
        CHECK(f);
        static char buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        test_write_file(p, buf, n);
    }
    return d;
}

static void edit_hidden(json_t *c) {
    json_object_set_new(c, "target_hidden_size", json_integer(128));
}
static void edit_layers(json_t *c) {
    json_object_set_new(c, "num_hidden_layers", json_integer(2));
}
static void edit_arch(json_t *c) {
    json_object_set_new(c, "architectures", json_pack("[s]", "Eagle3DeepseekV2ForCausalLM"));
}
static void edit_aux(json_t *c) {
    json_object_set_new(c, "eagle_config", json_pack("{s:[i,i,i]}", "eagle_aux_hidden_state_layer_ids", 0, 1, 7));
}
static void edit_draft_vocab(json_t *c) {
    json_object_set_new(c, "draft_vocab_size", json_integer(32));
}

static void expect_refused(const char *target, const char *head, atomc_status want, const char *needle) {
    struct error err = {0};
    atomc_status st;
    struct model_runner *r = e3_runner(target, head, &err, &st);
    model_runner_free(r);
    fprintf(stderr, "  %s: %s\n", needle, err.msg);
    ASSERT_EQ(st, want);
    ASSERT_TRUE(strstr(err.msg, needle) != NULL);
}

TEST(eagle3_bad_heads_are_refused_by_name) {
    char head[1024];
    snprintf(head, sizeof head, "%s", test_fixture(HEAD));
    expect_refused("models/qwen3", head, ATOMC_ERR_UNSUPPORTED, "LlamaForCausalLM targets only");
    if (test_failed_now()) return;
    expect_refused(TARGET, head_variant("hidden", edit_hidden, NULL), ATOMC_ERR_UNSUPPORTED, "target_hidden_size");
    expect_refused(TARGET, head_variant("layers", edit_layers, NULL), ATOMC_ERR_UNSUPPORTED, "2 decoder layers");
    expect_refused(TARGET, head_variant("arch", edit_arch, NULL), ATOMC_ERR_UNSUPPORTED, "Eagle3DeepseekV2ForCausalLM");
    expect_refused(TARGET, head_variant("aux", edit_aux, NULL), ATOMC_ERR_FORMAT,
                   "eagle_aux_hidden_state_layer_ids[2]");
    // draft_vocab_size 32 against a 64-row lm_head and d2t: the shape is named.
    expect_refused(TARGET, head_variant("dv", edit_draft_vocab, NULL), ATOMC_ERR_FORMAT, "lm_head.weight");
    expect_refused(TARGET, head_variant("corrupt", NULL, "not a safetensors file"), ATOMC_ERR_FORMAT,
                   "model.safetensors");
    expect_refused(TARGET, test_tmp_path("absent"), ATOMC_ERR_IO, "config.json");
}

TEST(eagle3_engine_refusals) {
    atomc_engine_options o;
    atomc_engine_options_init(&o);
    char path[1024], head[1024];
    snprintf(path, sizeof path, "%s", test_fixture(TARGET));
    snprintf(head, sizeof head, "%s", test_fixture(HEAD));
    o.model_path = path;
    o.device = "cpu";
    o.speculative_method = "eagle3";
    o.num_speculative_tokens = 2;
    atomc_engine *e = NULL;
    char msg[512];
    ASSERT_EQ(atomc_engine_create(&o, &e, msg, sizeof msg), ATOMC_ERR_INVALID_ARGUMENT);
    fprintf(stderr, "  no head: %s\n", msg);
    ASSERT_TRUE(strstr(msg, "needs the EAGLE-3 head") != NULL);
    o.speculative_method = "ngram";
    o.speculative_model = head;
    ASSERT_EQ(atomc_engine_create(&o, &e, msg, sizeof msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "belongs to method \"eagle3\"") != NULL);
    o.speculative_method = "eagle3";
    o.prompt_lookup_min = 2;
    ASSERT_EQ(atomc_engine_create(&o, &e, msg, sizeof msg), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(msg, "prompt_lookup") != NULL);
}

static const struct es_setup CPU_E3 = {.device = "cpu",
                                       .margin_tol = 1e-4f,
                                       .lp_tol = 1e-3f,
                                       .lp_tol_cached = 1e-4f,
                                       .min_clear = 0.5,
                                       .spec_k = 3,
                                       .spec_method = "eagle3",
                                       .spec_model = HEAD};

// Every reference prompt of eagle3_refs.json in one continuous batch, 24 greedy tokens each, with
// k = 1 and k = 3 drafts against the engine without drafts.
TEST(eagle3_greedy_identical_to_plain) {
    json_t *refs = test_fixture_json(HEAD "/eagle3_refs.json");
    ASSERT_TRUE(refs != NULL);
    json_t *prompts = json_object_get(refs, "prompts");
    const int n_p = (int)json_array_size(prompts);
    static int32_t ids[8][64];
    int n_ids[8];
    for (int i = 0; i < n_p; i++) {
        json_t *j = json_object_get(json_array_get(prompts, i), "ids");
        n_ids[i] = (int)json_array_size(j);
        for (int t = 0; t < n_ids[i]; t++)
            ids[i][t] = (int32_t)json_integer_value(json_array_get(j, t));
    }
    static struct es_out out[3][8];
    const int ks[3] = {0, 1, 3};
    for (int run = 0; run < 3; run++) {
        struct es_setup s = CPU_E3;
        s.spec_k = ks[run];
        atomc_engine *e = es_make(&s, "llama_gqa", 4, 256, 128, 8, 64, true);
        for (int i = 0; i < n_p; i++)
            es_add(e, ids[i], n_ids[i], 24, &out[run][i], NULL);
        while (atomc_engine_has_work(e))
            atomc_engine_step(e);
        atomc_stats st;
        atomc_engine_get_stats(e, &st);
        fprintf(stderr, "  llama_gqa + eagle3 k=%d%s\n", ks[run], es_spec_line(e));
        if (ks[run] > 0) {
            fprintf(stderr, "    accepted per draft position:");
            for (int j = 0; j < ks[run]; j++)
                fprintf(stderr, " %llu", (unsigned long long)st.spec_accepted_per_pos[j]);
            fprintf(stderr, "\n");
            ASSERT_TRUE(st.spec_num_drafts > 0);
            // The head was fitted to these prompts' continuations: most first drafts must be
            // accepted, which wrong aux rows, positions, token shifts or d2t would prevent.
            ASSERT_TRUE(st.spec_accepted_per_pos[0] * 2 > st.spec_num_drafts);
            // The head was fitted on its own chained step too (the tool's depth-2 training-time
            // test): second drafts after an accepted first are often accepted, which a wrong chain
            // position, slot or hidden input would prevent.
            if (ks[run] > 1) ASSERT_TRUE(st.spec_accepted_per_pos[1] * 3 > st.spec_accepted_per_pos[0]);
        }
        atomc_engine_free(e);
        for (int i = 0; i < n_p; i++) {
            ASSERT_EQ(out[run][i].n, 24);
            if (run > 0) ASSERT_TRUE(es_compare(&out[0][i], &out[run][i], 1e-4f, NULL) >= 0);
        }
    }
    json_decref(refs);
}

TEST(eagle3_batched_under_preemption_equals_alone) {
    es_batched_under_preemption_equals_alone(&CPU_E3, "llama_gqa");
}

TEST(eagle3_prefix_hit_identical_to_cold) {
    es_prefix_hit_identical_to_cold(&CPU_E3, "llama_gqa");
}

TEST(eagle3_random_stress_equals_alone) {
    es_random_stress_equals_alone(&CPU_E3, "llama_gqa", 0x5eed3e3ull, 24);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
