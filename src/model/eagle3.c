// EAGLE-3 draft heads (model.h struct model_eagle3) in the published checkpoint layout
// (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and the heads trained like it; vLLM's llama_eagle3.py and
// SGLang's llama_eagle3.py load the same files):
//   config.json   architectures ["LlamaForCausalLMEagle3"], a Llama config of one decoder layer
//                 (speculators' ["Eagle3Speculator"]: the Llama part in transformer_layer_config),
//                 draft_vocab_size (default vocab_size), optional target_hidden_size,
//                 norm_before_residual, eagle_config.eagle_aux_hidden_state_layer_ids (also
//                 accepted at the top level, as RedHat's speculators configs put it; default
//                 (2, L / 2, L - 3) for a target of L layers, vLLM's choice)
//   tensors       fc.weight (H, 3 H)          midlayer.{input_layernorm, hidden_norm,
//                 post_attention_layernorm}.weight (H)      midlayer.self_attn.{q,k,v}_proj.weight
//                 (rows, 2 H: the embedding half first)     midlayer.self_attn.o_proj.weight
//                 midlayer.mlp.{gate,up,down}_proj.weight   norm.weight (H)
//                 lm_head.weight (draft_vocab, H)           d2t (draft_vocab) I64: target id - draft id
//                 t2d (vocab) BOOL (not needed: read over)  embed_tokens.weight (vocab, H) optional:
//                 the target's embeddings serve without it   fc.bias (H) optional (speculators')
//                 ("layers.0." is accepted for "midlayer.", as speculators' heads name the layer)
// Aux layer id i means the residual stream entering target layer i (0: the embeddings), as vLLM
// collects hidden_states + residual before running layer i; HF's hidden_states[i] is the same.
//
// The forward (model.h has the formula) reuses the target's scratch views (fwd_begin) and the
// same backend ops as a Llama layer; the head's attention geometry must therefore equal the
// target's (it does for every published Llama head), which is checked at load.
#include "model/eagle3.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mapped_file.h"
#include "loader/model_files.h"
#include "model/weight_loader.h"

static void e3_release(struct model *m, struct tensor *t, const void *alias) {
    if (t->data && t->data != alias) m->backend->ops->free(m->backend, t->data);
    t->data = NULL;
}

void model_eagle3_free(struct model *m) {
    struct model_eagle3 *e = m->eagle3;
    if (!e) return;
    for (int i = 0; i < EAGLE3_N_AUX; i++)
        e3_release(m, &e->fc[i].t, NULL);
    struct tensor *ts[] = {&e->fc_bias, &e->input_norm, &e->hidden_norm, &e->post_norm, &e->norm,  &e->qkv_e.t,
                           &e->qkv_h.t, &e->o.t,        &e->gate_up.t,   &e->down.t,    &e->head.t};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        e3_release(m, ts[i], NULL);
    e3_release(m, &e->embed, m->embed.data);
    if (e->inv_freq) m->backend->ops->free(m->backend, e->inv_freq);
    free(e->d2t);
    free(e);
    m->eagle3 = NULL;
}

// --- config ---------------------------------------------------------------------------------

static int json_int_or(const json_t *o, const char *key, int dflt) {
    const json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (int)json_integer_value(v) : dflt;
}

// The head's config.json: the Llama part parsed by the model config parser (so its RoPE reads as
// a Llama model's), the EAGLE-3 keys here. L: the target's layer count.
static atomc_status e3_parse_config(const char *dir, bool bare, int L, struct model_config *dc, struct model_eagle3 *e,
                                    int *target_hidden, struct error *err) {
    char path[4200];
    snprintf(path, sizeof path, bare ? "%s" : "%s/config.json", dir);
    char *text = NULL;
    if (file_read_all(path, &text, NULL, err) != ATOMC_OK)
        return error_set(err, ATOMC_ERR_IO,
                         "speculative method eagle3: %s: no readable config.json in the EAGLE-3 "
                         "head directory",
                         dir);
    json_error_t je;
    json_t *root = json_loads(text, 0, &je);
    free(text);
    atomc_status st = ATOMC_OK;
    if (!json_is_object(root)) {
        st = error_set(err, ATOMC_ERR_FORMAT, "%s: not a JSON object (%s, line %d)", path, je.text, je.line);
        goto done;
    }
    const json_t *archs = json_object_get(root, "architectures");
    const char *arch = json_is_array(archs) && json_is_string(json_array_get(archs, 0))
                           ? json_string_value(json_array_get(archs, 0))
                           : "";
    // The Llama part of the config: the root (LlamaForCausalLMEagle3), or speculators'
    // transformer_layer_config (Eagle3Speculator); the EAGLE-3 keys are at the root either way.
    const json_t *llama = root;
    if (!strcmp(arch, "Eagle3Speculator")) {
        llama = json_object_get(root, "transformer_layer_config");
        const json_t *mt = json_object_get(llama, "model_type");
        const json_t *sc = json_object_get(root, "speculators_config");
        const json_t *alg = json_is_object(sc) ? json_object_get(sc, "algorithm") : NULL;
        if (!json_is_object(llama) || (mt && !json_is_string(mt))) {
            st = error_set(err, ATOMC_ERR_FORMAT,
                           "%s: an Eagle3Speculator config needs a transformer_layer_config object", path);
            goto done;
        }
        if ((mt && strcmp(json_string_value(mt), "llama")) ||
            (alg && (!json_is_string(alg) || strcmp(json_string_value(alg), "eagle3")))) {
            st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                           "speculative method eagle3: %s: transformer_layer_config model_type '%s' / algorithm '%s'; "
                           "implemented: llama / eagle3",
                           path, mt ? json_string_value(mt) : "", json_is_string(alg) ? json_string_value(alg) : "");
            goto done;
        }
    } else if (strcmp(arch, "LlamaForCausalLMEagle3")) {
        st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                       "speculative method eagle3: %s declares architecture '%s'; implemented: LlamaForCausalLMEagle3 "
                       "(the EAGLE-3 layout of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and Eagle3Speculator (speculators)",
                       path, arch);
        goto done;
    }
    const json_t *ec = json_object_get(root, "eagle_config");
    const json_t *use_aux = json_is_object(ec) ? json_object_get(ec, "use_aux_hidden_state") : NULL;
    if (use_aux && !json_is_true(use_aux)) {
        st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                       "%s: eagle_config.use_aux_hidden_state false (an EAGLE-1/2 style "
                       "head) is not implemented",
                       path);
        goto done;
    }
    const json_t *ids = json_is_object(ec) ? json_object_get(ec, "eagle_aux_hidden_state_layer_ids") : NULL;
    if (!ids) ids = json_object_get(root, "eagle_aux_hidden_state_layer_ids");
    if (ids) {
        if (!json_is_array(ids) || json_array_size(ids) != EAGLE3_N_AUX) {
            st = error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: eagle_aux_hidden_state_layer_ids must list %d layer ids",
                           path, EAGLE3_N_AUX);
            goto done;
        }
        for (int i = 0; i < EAGLE3_N_AUX; i++) {
            const json_t *v = json_array_get(ids, (size_t)i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= L) {
                st = error_set(err, ATOMC_ERR_FORMAT,
                               "%s: eagle_aux_hidden_state_layer_ids[%d] must be a layer id in [0, %d) of the target",
                               path, i, L);
                goto done;
            }
            e->aux_layers[i] = (int)json_integer_value(v);
        }
    } else {
        if (L < 3) {
            st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                           "%s: the default aux layers (2, L/2, L-3) need a target of at "
                           "least 3 layers, it has %d; give eagle_aux_hidden_state_layer_ids",
                           path, L);
            goto done;
        }
        e->aux_layers[0] = 2, e->aux_layers[1] = L / 2, e->aux_layers[2] = L - 3;
    }
    const json_t *nbr = json_object_get(root, "norm_before_residual");
    e->norm_before_residual = json_is_true(nbr);
    const json_t *ls = json_object_get(root, "logit_scale");
    if (ls && json_is_number(ls) && json_number_value(ls) != 1.0) {
        st = error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: logit_scale %g is not implemented (1 only)", path,
                       json_number_value(ls));
        goto done;
    }
    *target_hidden = json_int_or(root, "target_hidden_size", 0);
    // The Llama part through the model config parser, under the plain Llama architecture name.
    json_t *copy = json_deep_copy(llama);
    json_object_set_new(copy, "architectures", json_pack("[s]", "LlamaForCausalLM"));
    json_object_set_new(copy, "model_type", json_string("llama"));
    char *dumped = json_dumps(copy, JSON_COMPACT);
    json_decref(copy);
    memset(dc, 0, sizeof *dc);
    st = model_config_parse_json(dc, dumped, path, err);
    free(dumped);
    if (st == ATOMC_OK) st = model_config_validate(dc, path, err);
    if (st != ATOMC_OK) goto done;
    e->draft_vocab = json_int_or(root, "draft_vocab_size", dc->vocab_size);
    e->intermediate_size = dc->intermediate_size;
    e->eps = dc->rms_norm_eps;
done:
    json_decref(root);
    return st;
}

// The head's config against the target's: what the shared scratch and cache layout assume.
static atomc_status e3_check(const struct model *m, const struct model_config *dc, const struct model_eagle3 *e,
                             int target_hidden, const char *dir, struct error *err) {
    const struct model_config *c = &m->cfg;
    const char *p = "speculative method eagle3";
    if (target_hidden && target_hidden != c->hidden_size)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: the head %s was trained for a target of hidden size %d (its "
                         "target_hidden_size), the target %s has %d",
                         p, dir, target_hidden, c->architecture, c->hidden_size);
    if (dc->hidden_size != c->hidden_size)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: the head %s has hidden size %d, the target %s has %d (heads of "
                         "another width than their target are not implemented)",
                         p, dir, dc->hidden_size, c->architecture, c->hidden_size);
    if (dc->num_layers != 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: the head %s has %d decoder layers; implemented: 1", p, dir,
                         dc->num_layers);
    if (dc->num_heads != c->num_heads || dc->num_kv_heads != c->num_kv_heads || dc->head_dim != c->head_dim)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: the head %s has %d heads / %d KV heads of %d, the target %d / "
                         "%d of %d; implemented: the target's attention geometry",
                         p, dir, dc->num_heads, dc->num_kv_heads, dc->head_dim, c->num_heads, c->num_kv_heads,
                         c->head_dim);
    if (dc->intermediate_size > c->intermediate_size)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: the head %s has intermediate_size %d, larger than the "
                         "target's %d (not implemented)",
                         p, dir, dc->intermediate_size, c->intermediate_size);
    if (dc->vocab_size != c->vocab_size)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%s: the head %s has vocab_size %d, the target %s %d", p, dir,
                         dc->vocab_size, c->architecture, c->vocab_size);
    if (e->draft_vocab < 1 || e->draft_vocab > c->vocab_size)
        return error_set(err, ATOMC_ERR_FORMAT, "%s: the head %s has draft_vocab_size %d (need 1..%d)", p, dir,
                         e->draft_vocab, c->vocab_size);
    if (dc->attention_bias || dc->attention_out_bias || dc->mlp_bias || dc->qk_norm || dc->tie_word_embeddings ||
        (dc->hidden_act[0] && strcmp(dc->hidden_act, "silu")) || dc->sliding_window > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "%s: the head %s asks for attention / MLP biases, q/k norm, tied "
                         "embeddings, a sliding window or activation '%s', which are not implemented",
                         p, dir, dc->hidden_act);
    return ATOMC_OK;
}

// --- weights --------------------------------------------------------------------------------

// Rows stacked on the device: dst = [parts[0]; parts[1]; ...] (same dtype and columns); the parts
// are freed.
static atomc_status e3_fuse_rows(struct model *m, struct weight *dst, struct tensor *parts, int n, const char *what,
                                 struct error *err) {
    struct backend *b = m->backend;
    int64_t rows = 0;
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        if (parts[i].dtype != parts[0].dtype || tensor_cols(&parts[i]) != tensor_cols(&parts[0]))
            return error_set(err, ATOMC_ERR_UNSUPPORTED, "EAGLE-3 head: the parts of %s differ in dtype or columns",
                             what);
        rows += tensor_rows(&parts[i]);
        bytes += tensor_bytes(&parts[i]);
    }
    void *data = b->ops->alloc(b, bytes);
    if (!data) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "EAGLE-3 head: cannot allocate %s", what);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        b->ops->copy_d2d(b, (char *)data + off, parts[i].data, tensor_bytes(&parts[i]));
        off += tensor_bytes(&parts[i]);
    }
    b->ops->synchronize(b);
    memset(dst, 0, sizeof *dst);
    dst->t = tensor_2d(data, parts[0].dtype, rows, tensor_cols(&parts[0]));
    for (int i = 0; i < n; i++)
        e3_release(m, &parts[i], NULL);
    return ATOMC_OK;
}

static bool e3_has(const struct model_files *mf, const char *name) {
    return mf && model_files_has_tensor(mf, name);
}

// mf NULL: random weights (the loader's dummy path; a benchmark-only head), d2t spreading the
// draft ids evenly over the target's.
static atomc_status e3_load_weights(struct model *m, struct weight_loader *L, struct model_files *mf,
                                    struct model_eagle3 *e, struct error *err) {
    const struct model_config *c = &m->cfg;
    const int64_t H = c->hidden_size, V = c->vocab_size, Q = m->q_dim, KV = m->kv_dim, I = e->intermediate_size;
    const char *pre = e3_has(mf, "midlayer.self_attn.q_proj.weight")   ? "midlayer."
                      : e3_has(mf, "layers.0.self_attn.q_proj.weight") ? "layers.0."
                                                                       : "midlayer.";
    char name[128];
#define E3_NAME(suffix) (snprintf(name, sizeof name, "%s%s", pre, suffix), name)
    atomc_status st;
    for (int i = 0; i < EAGLE3_N_AUX; i++)
        if ((st = weight_loader_load_tensor(L, &e->fc[i].t, "fc.weight", 2, (int64_t[]){H, H}, WINIT_MATRIX, 1, i * H,
                                            err)))
            return st;
    // speculators' heads give fc a bias (added once, with the first column block's GEMM).
    if (e3_has(mf, "fc.bias") &&
        (st = weight_loader_load_tensor(L, &e->fc_bias, "fc.bias", 1, (int64_t[]){H}, WINIT_BIAS, -1, 0, err)))
        return st;
    if ((st = weight_loader_load_tensor(L, &e->input_norm, E3_NAME("input_layernorm.weight"), 1, (int64_t[]){H},
                                        WINIT_NORM, -1, 0, err)) ||
        (st = weight_loader_load_tensor(L, &e->hidden_norm, E3_NAME("hidden_norm.weight"), 1, (int64_t[]){H},
                                        WINIT_NORM, -1, 0, err)) ||
        (st = weight_loader_load_tensor(L, &e->post_norm, E3_NAME("post_attention_layernorm.weight"), 1, (int64_t[]){H},
                                        WINIT_NORM, -1, 0, err)))
        return st;
    // q / k / v: the embedding half (columns [0, H)) and the hidden half ([H, 2 H)), each fused by rows.
    static const char *qkv[3] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"};
    const int64_t qkv_rows[3] = {Q, KV, KV};
    for (int half = 0; half < 2; half++) {
        struct tensor parts[3] = {{0}};
        st = ATOMC_OK;
        for (int i = 0; i < 3 && st == ATOMC_OK; i++)
            st = weight_loader_load_tensor(L, &parts[i], E3_NAME(qkv[i]), 2, (int64_t[]){qkv_rows[i], H}, WINIT_MATRIX,
                                           1, half * H, err);
        if (st == ATOMC_OK) st = e3_fuse_rows(m, half ? &e->qkv_h : &e->qkv_e, parts, 3, "q/k/v", err);
        for (int i = 0; i < 3; i++)
            e3_release(m, &parts[i], NULL);
        if (st) return st;
    }
    if ((st = weight_loader_load_tensor(L, &e->o.t, E3_NAME("self_attn.o_proj.weight"), 2, (int64_t[]){H, Q},
                                        WINIT_MATRIX, -1, 0, err)))
        return st;
    struct tensor gu[2] = {{0}};
    if (!(st = weight_loader_load_tensor(L, &gu[0], E3_NAME("mlp.gate_proj.weight"), 2, (int64_t[]){I, H}, WINIT_MATRIX,
                                         -1, 0, err)) &&
        !(st = weight_loader_load_tensor(L, &gu[1], E3_NAME("mlp.up_proj.weight"), 2, (int64_t[]){I, H}, WINIT_MATRIX,
                                         -1, 0, err)))
        st = e3_fuse_rows(m, &e->gate_up, gu, 2, "gate/up", err);
    for (int i = 0; i < 2; i++)
        e3_release(m, &gu[i], NULL);
    if (st) return st;
    if ((st = weight_loader_load_tensor(L, &e->down.t, E3_NAME("mlp.down_proj.weight"), 2, (int64_t[]){H, I},
                                        WINIT_MATRIX, -1, 0, err)) ||
        (st = weight_loader_load_tensor(L, &e->norm, "norm.weight", 1, (int64_t[]){H}, WINIT_NORM, -1, 0, err)) ||
        (st = weight_loader_load_tensor(L, &e->head.t, "lm_head.weight", 2, (int64_t[]){e->draft_vocab, H},
                                        WINIT_MATRIX, -1, 0, err)))
        return st;
#undef E3_NAME
    const char *emb = e3_has(mf, "embed_tokens.weight")         ? "embed_tokens.weight"
                      : e3_has(mf, "model.embed_tokens.weight") ? "model.embed_tokens.weight"
                                                                : NULL;
    if (emb) {
        if ((st = weight_loader_load_tensor(L, &e->embed, emb, 2, (int64_t[]){V, H}, WINIT_MATRIX, -1, 0, err)))
            return st;
    } else {
        e->embed = m->embed;
    }
    // d2t: draft id d stands for target id d + d2t[d]; without it the vocabularies are the same.
    e->d2t = xmalloc((size_t)e->draft_vocab * sizeof *e->d2t);
    if (e3_has(mf, "d2t")) {
        struct tensor t;
        if ((st = model_files_expect(mf, "d2t", TENSOR_CLASS_INT, &t, err, e->draft_vocab))) return st;
        if (t.dtype != DTYPE_I64 && t.dtype != DTYPE_I32)
            return error_set(err, ATOMC_ERR_FORMAT, "EAGLE-3 head: d2t must be I64 or I32");
        for (int d = 0; d < e->draft_vocab; d++) {
            int64_t off = t.dtype == DTYPE_I64 ? ((const int64_t *)t.data)[d] : ((const int32_t *)t.data)[d];
            if (d + off < 0 || d + off >= V)
                return error_set(err, ATOMC_ERR_FORMAT,
                                 "EAGLE-3 head: d2t[%d] = %lld maps outside the target's %lld "
                                 "ids",
                                 d, (long long)off, (long long)V);
            e->d2t[d] = (int32_t)(d + off);
        }
    } else if (!mf) {
        for (int d = 0; d < e->draft_vocab; d++)
            e->d2t[d] = (int32_t)((int64_t)d * V / e->draft_vocab);
    } else if (e->draft_vocab != V) {
        return error_set(err, ATOMC_ERR_FORMAT,
                         "EAGLE-3 head: draft_vocab_size %d differs from vocab_size %lld but the "
                         "checkpoint has no d2t",
                         e->draft_vocab, (long long)V);
    } else {
        for (int d = 0; d < e->draft_vocab; d++)
            e->d2t[d] = d;
    }
    if (!mf) return ATOMC_OK;
    model_files_mark_consumed(mf, "t2d"); // the inverse map: the drafts need d2t only (vLLM reads it over too)
    return model_files_check_consumed(mf, err);
}

static atomc_status e3_rope(struct model *m, const struct model_config *dc, struct model_eagle3 *e, struct error *err) {
    struct backend *b = m->backend;
    const int rd = dc->rope.rotary_dim > 0 ? dc->rope.rotary_dim : dc->head_dim;
    float *h = xmalloc((size_t)(rd / 2) * sizeof(float)), attn_factor;
    model_rope_inv_freq(dc, rd, h, &attn_factor);
    e->inv_freq = b->ops->alloc(b, (size_t)(rd / 2) * sizeof(float));
    if (!e->inv_freq) {
        free(h);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "EAGLE-3 head: cannot allocate RoPE frequencies");
    }
    b->ops->copy_h2d(b, e->inv_freq, h, (size_t)(rd / 2) * sizeof(float));
    b->ops->synchronize(b);
    free(h);
    e->rope = (struct rope_args){.inv_freq = e->inv_freq,
                                 .rotary_dim = rd,
                                 .attn_factor = attn_factor,
                                 .interleaved = dc->rope.interleaved,
                                 .norm_eps = dc->rms_norm_eps};
    return ATOMC_OK;
}

atomc_status model_eagle3_load(struct model *m, const char *dir, bool dummy, uint64_t dummy_seed, struct error *err) {
    const struct model_config *c = &m->cfg;
    // A bare config.json (bench/configs/eagle3_*.json) is a random head for benchmarks, over a
    // target with random weights only.
    const size_t dl = strlen(dir);
    const bool bare = !dir_exists(dir) && dl >= 5 && !strcmp(dir + dl - 5, ".json");
    if (bare && !dummy)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "speculative method eagle3: %s is a bare config (a random head, for benchmarks); it needs "
                         "--load-format dummy, else give the head's directory",
                         dir);
    if (dummy && !bare)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "speculative method eagle3 over random (dummy) target weights takes a bare head config "
                         "(bench/configs/eagle3_*.json), not the trained head %s",
                         dir);
    if (strcmp(c->architecture, "LlamaForCausalLM"))
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "speculative method eagle3: the target is %s; EAGLE-3 heads are implemented for "
                         "LlamaForCausalLM targets only",
                         c->architecture);
    if (m->tp_size > 1)
        return error_set(err, ATOMC_ERR_UNSUPPORTED,
                         "speculative method eagle3 with tensor parallelism is not "
                         "implemented");
    if (m->n_mtp > 0)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "speculative method eagle3 with MTP layers loaded as well");
    const int L0 = c->num_layers;
    if (L0 + 1 > MODEL_MAX_LAYERS)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "%d layers + an EAGLE-3 layer (at most %d)", L0, MODEL_MAX_LAYERS);
    struct model_eagle3 *e = xcalloc(1, sizeof *e);
    m->eagle3 = e;
    struct model_config dc;
    int target_hidden = 0;
    struct model_files *mf = NULL;
    struct weight_loader *L = NULL;
    atomc_status st = e3_parse_config(dir, bare, L0, &dc, e, &target_hidden, err);
    if (st == ATOMC_OK) st = e3_check(m, &dc, e, target_hidden, dir, err);
    if (st == ATOMC_OK) {
        char bin[4200];
        snprintf(bin, sizeof bin, "%s/pytorch_model.bin", dir);
        if (!bare && (st = model_files_open_tensors(&mf, dir, err)) != ATOMC_OK && file_exists(bin))
            error_prefix(err, "the head ships pytorch_model.bin, which is not read (convert it to safetensors): ");
        if (bare || st == ATOMC_OK) {
            L = weight_loader_create(m, mf, dummy_seed ^ 0xea9e3ull);
            st = e3_load_weights(m, L, mf, e, err);
        }
        if (st != ATOMC_OK) error_prefix(err, "speculative method eagle3: %s: ", dir);
    }
    if (st == ATOMC_OK) st = e3_rope(m, &dc, e, err);
    weight_loader_free(L);
    model_files_close(mf);
    if (st != ATOMC_OK) {
        model_eagle3_free(m);
        return st;
    }
    m->layer_cache = xrealloc(m->layer_cache, (size_t)(L0 + 1) * sizeof *m->layer_cache);
    m->layer_cache[L0] = (struct cache_spec){
        .kind = CACHE_KIND_FULL, .n_kv_heads = c->num_kv_heads, .head_dim_k = c->head_dim, .head_dim_v = c->head_dim};
    m->n_cache_layers = L0 + 1;
    LOG_INFO("%s: EAGLE-3 head %s loaded%s (aux layers %d, %d, %d; draft vocabulary %d of %d%s)", c->architecture, dir,
             bare ? " with random weights" : "", e->aux_layers[0], e->aux_layers[1], e->aux_layers[2], e->draft_vocab,
             c->vocab_size, e->embed.data == m->embed.data ? "; the target's embeddings" : "");
    return ATOMC_OK;
}

// --- forward --------------------------------------------------------------------------------

void model_eagle3_capture(struct model *m, const struct fwd_state *f, int layer) {
    const struct model_eagle3 *e = m->eagle3;
    if (!e) return;
    struct backend *b = m->backend;
    for (int i = 0; i < EAGLE3_N_AUX; i++) {
        if (e->aux_layers[i] != layer) continue;
        struct tensor a = tensor_2d(m->scratch.eagle3_aux[i], f->residual.dtype, f->T, m->cfg.hidden_size);
        b->ops->copy_d2d(b, a.data, f->residual.data, tensor_bytes(&a));
        if (!f->first) b->ops->add(b, &a, &f->h);
    }
}

void model_eagle3_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md,
                          struct kv_layer *kv, const int32_t *hidden_rows) {
    const struct model_eagle3 *e = m->eagle3;
    CHECK(e != NULL);
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->scratch;
    const enum dtype dt = b->act_dtype;
    const int64_t T = md->n_tokens, H = c->hidden_size, I = e->intermediate_size;
    const float eps = e->eps;
    CHECK(s->mtp_a && s->eagle3_qkv && T > 0 && T <= s->max_tokens);
    struct tensor A = tensor_2d(s->mtp_a, dt, T, H), B = tensor_2d(s->mtp_b, dt, T, H),
                  C = tensor_2d(s->mtp_c, dt, T, H);
    struct tensor hid;
    if (hidden_rows) {
        // hid = fc [a_0 ; a_1 ; a_2] of the gathered rows, as a sum over fc's column blocks.
        const int64_t T0 = m->last_tokens;
        for (int i = 0; i < EAGLE3_N_AUX; i++) {
            struct tensor aux = tensor_2d(s->eagle3_aux[i], dt, T0, H);
            ops->gather_rows(b, &B, &aux, hidden_rows, (int)T);
            ops->matmul(b, i ? &C : &A, &B, &e->fc[i], i == 0 && e->fc_bias.data ? &e->fc_bias : NULL);
            if (i) ops->add(b, &A, &C);
        }
        hid = A;
    } else {
        CHECK(T <= s->max_logits_rows);
        hid = tensor_2d(s->lg_res, dt, T, H);
    }
    ops->rmsnorm(b, &C, &hid, &e->hidden_norm, eps);
    ops->embedding(b, &B, &e->embed, token_ids);
    struct fwd_state f;
    fwd_begin(m, &f, md);
    ops->rmsnorm(b, &f.x, &B, &e->input_norm, eps);
    struct tensor qkv_h = tensor_2d(s->eagle3_qkv, dt, T, m->qkv_dim);
    ops->matmul(b, &f.qkv, &f.x, &e->qkv_e, NULL);
    ops->matmul(b, &qkv_h, &C, &e->qkv_h, NULL);
    ops->add(b, &f.qkv, &qkv_h);
    const struct tensor *res0 = e->norm_before_residual ? &C : &hid;
    ops->copy_d2d(b, f.residual.data, res0->data, tensor_bytes(&f.residual));
    struct kv_layer *kl = &kv[c->num_layers];
    ops->rope_kv_write(b, &f.q, &f.k, &f.v, m->qkv_dim, &e->rope, kl, md);
    ops->attention(b, &f.attn, &f.q, m->qkv_dim, kl, md, 1.0f / sqrtf((float)c->head_dim), 0, NULL);
    ops->matmul(b, &f.h, &f.attn2, &e->o, NULL);
    ops->add_rmsnorm(b, &f.x, &f.residual, &f.h, &e->post_norm, eps);
    struct tensor gu = tensor_2d(s->gate_up, dt, T, 2 * I), act = tensor_2d(s->act, dt, T, I);
    ops->matmul(b, &gu, &f.x, &e->gate_up, NULL);
    ops->silu_mul(b, &act, &gu);
    ops->matmul(b, &f.h, &act, &e->down, NULL);
    f.first = false;
    fwd_end(m, &f);
}

struct tensor model_eagle3_compute_logits(struct model *m, const int32_t *rows, int n_rows) {
    const struct model_eagle3 *e = m->eagle3;
    CHECK(e != NULL);
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    struct model_scratch *s = &m->scratch;
    CHECK_MSG(n_rows > 0 && n_rows <= s->max_logits_rows, "%d logits rows, scratch holds %d", n_rows,
              s->max_logits_rows);
    const enum dtype dt = b->act_dtype;
    const int64_t T = m->last_tokens, H = m->cfg.hidden_size;
    struct tensor residual = tensor_2d(s->residual, dt, T, H), h = tensor_2d(s->h, dt, T, H);
    struct tensor gres = tensor_2d(s->lg_res, dt, n_rows, H), gh = tensor_2d(s->lg_h, dt, n_rows, H);
    struct tensor gx = tensor_2d(s->lg_x, dt, n_rows, H);
    struct tensor logits = tensor_2d(s->logits, DTYPE_F32, n_rows, e->draft_vocab);
    ops->gather_rows(b, &gres, &residual, rows, n_rows);
    ops->gather_rows(b, &gh, &h, rows, n_rows);
    ops->add_rmsnorm(b, &gx, &gres, &gh, &e->norm, e->eps);
    ops->matmul(b, &logits, &gx, &e->head, NULL);
    return logits;
}
