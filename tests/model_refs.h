// Reference outputs of the tiny HF checkpoints (tests/fixtures/models/*/refs.json, written by
// tools/make_tiny_models.py) and the comparisons the model tests share. Header-only.
#ifndef ATOMC_TESTS_MODEL_REFS_H
#define ATOMC_TESTS_MODEL_REFS_H

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

#define MAX_PROMPTS 8
#define MAX_POS 8
#define N_GREEDY 16
#define REF_MAX_IDS 256

static const char *MODELS[] = {"llama_gqa",  "llama_mha",       "llama_tied", "llama_rope_llama3", "llama_rope_linear",
                               "llama_bias", "mistral_sliding", "qwen3",      "qwen3_yarn"};
#define N_MODELS ((int)(sizeof MODELS / sizeof MODELS[0]))
// Mixture-of-experts fixtures (tools/make_tiny_moe_models.py; gpt_oss*: tools/make_tiny_gpt_oss.py,
// bf16 and MXFP4 experts; glm4_moe*: tools/make_tiny_glm_mimo.py); the CPU model tests check them
// with the dense ones, test_moe_models.c adds the MoE-specific checks.
__attribute__((unused)) static const char *MOE_MODELS[] = {"qwen3_moe", "qwen3_moe_sparse2", "mixtral", "gpt_oss",
                                                           "gpt_oss_mxfp4", "glm4_moe", "glm4_moe_air"};
#define N_MOE_MODELS ((int)(sizeof MOE_MODELS / sizeof MOE_MODELS[0]))
// Dense fixtures, then the MoE ones: the whole-model reference checks run on all of them.
#define N_ALL_MODELS (N_MODELS + N_MOE_MODELS)
__attribute__((unused)) static const char *all_models(int i) {
    return i < N_MODELS ? MODELS[i] : MOE_MODELS[i - N_MODELS];
}
// Multi-head latent attention fixtures (tools/make_tiny_deepseek.py): checked by tests/test_models.c
// and by the logits test of tests/gpu/test_cuda_models.c with the others (cpu_models), not by
// test_cpu_quant.c's all_models loop.
__attribute__((unused)) static const char *MLA_MODELS[] = {"deepseek_v2", "deepseek_v3", "deepseek_v3_192"};
#define N_MLA_MODELS ((int)(sizeof MLA_MODELS / sizeof MLA_MODELS[0]))
#define N_CPU_MODELS (N_ALL_MODELS + N_MLA_MODELS)
__attribute__((unused)) static const char *cpu_models(int i) {
    return i < N_ALL_MODELS ? all_models(i) : MLA_MODELS[i - N_ALL_MODELS];
}
// The dense fixtures, then the MLA ones (chunk-boundary and prefix-reuse checks).
#define N_PREFIX_MODELS (N_MODELS + N_MLA_MODELS)
__attribute__((unused)) static const char *prefix_models(int i) {
    return i < N_MODELS ? MODELS[i] : MLA_MODELS[i - N_MODELS];
}

struct ref_prompt {
    int32_t ids[REF_MAX_IDS];
    int n;
    int pos[MAX_POS];
    int n_pos;
    float *logits; // (n_pos, vocab)
    int32_t greedy[N_GREEDY];
    float margins[N_GREEDY];
};

struct refs {
    struct ref_prompt p[MAX_PROMPTS];
    int n;
    int vocab;
    double tol;        // absolute logit tolerance
    double min_margin; // greedy steps with a margin above this must match
};

__attribute__((unused)) static void refs_free(struct refs *r) {
    for (int i = 0; i < r->n; i++) free(r->p[i].logits);
}

// Reads tests/fixtures/<rel> (a refs.json). tol = rtol * max(1, max |HF logit|);
// min_margin = margin_factor * tol.
__attribute__((unused)) static int refs_load_rel(const char *rel, struct refs *out, double rtol, double margin_factor) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_load_file(test_fixture(rel), 0, &je);
    if (!root) {
        fprintf(stderr, "cannot read %s: %s\n", rel, je.text);
        return -1;
    }
    json_t *prompts = json_object_get(root, "prompts");
    double scale = 1.0;
    size_t i;
    json_t *jp;
    json_array_foreach(prompts, i, jp) {
        if (i >= MAX_PROMPTS) break;
        struct ref_prompt *p = &out->p[out->n++];
        json_t *ids = json_object_get(jp, "ids"), *pos = json_object_get(jp, "logit_positions");
        json_t *lg = json_object_get(jp, "logits"), *gr = json_object_get(jp, "greedy");
        json_t *mg = json_object_get(jp, "greedy_margins");
        p->n = (int)json_array_size(ids);
        if (p->n > REF_MAX_IDS || (int)json_array_size(pos) > MAX_POS) {
            fprintf(stderr, "%s: prompt %zu has %d ids / %zu positions (at most %d / %d)\n", rel, i, p->n,
                    json_array_size(pos), REF_MAX_IDS, MAX_POS);
            json_decref(root);
            return -1;
        }
        for (int k = 0; k < p->n; k++) p->ids[k] = (int32_t)json_integer_value(json_array_get(ids, (size_t)k));
        p->n_pos = (int)json_array_size(pos);
        for (int k = 0; k < p->n_pos; k++) p->pos[k] = (int)json_integer_value(json_array_get(pos, (size_t)k));
        out->vocab = (int)json_array_size(json_array_get(lg, 0));
        p->logits = malloc(sizeof(float) * (size_t)p->n_pos * (size_t)out->vocab);
        for (int k = 0; k < p->n_pos; k++)
            for (int v = 0; v < out->vocab; v++) {
                double x = json_number_value(json_array_get(json_array_get(lg, (size_t)k), (size_t)v));
                p->logits[(size_t)k * out->vocab + v] = (float)x;
                if (fabs(x) > scale) scale = fabs(x);
            }
        for (int k = 0; k < N_GREEDY; k++) {
            p->greedy[k] = (int32_t)json_integer_value(json_array_get(gr, (size_t)k));
            p->margins[k] = (float)json_number_value(json_array_get(mg, (size_t)k));
        }
    }
    json_decref(root);
    out->tol = rtol * scale;
    out->min_margin = margin_factor * out->tol;
    return out->n > 0 ? 0 : -1;
}

// Reads tests/fixtures/models/<model>/refs.json (see refs_load_rel).
__attribute__((unused)) static int refs_load(const char *model, struct refs *out, double rtol, double margin_factor) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s/refs.json", model);
    return refs_load_rel(rel, out, rtol, margin_factor);
}

__attribute__((unused)) static double max_abs_diff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d; // NaN propagates as a failure
    }
    return m;
}

// Compares greedy tokens against HF's with the margin rule; returns the number of steps
// that were required to match, or -1 on a mismatch at a clear margin.
__attribute__((unused)) static int greedy_compare(const struct refs *R, const struct ref_prompt *p, const int32_t *got, const char *what) {
    int checked = 0;
    for (int k = 0; k < N_GREEDY; k++) {
        if (got[k] != p->greedy[k]) {
            if (p->margins[k] > R->min_margin) {
                fprintf(stderr, "  %s: greedy step %d: got %d, HF %d (HF margin %.5f > %.5f)\n", what, k, got[k],
                        p->greedy[k], p->margins[k], R->min_margin);
                return -1;
            }
            break; // a near-tie flipped: the continuations legitimately differ from here
        }
        if (p->margins[k] > R->min_margin) checked++;
    }
    return checked;
}

#endif
