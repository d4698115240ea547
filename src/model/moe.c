// The MoE block (Qwen3-MoE, Mixtral): weight packing at load, scratch, and the forward of one
// MoE layer as three backend ops (router matmul, moe_route, moe_experts). See moe.h.
//
// Qwen3-MoE and Mixtral route identically once written as data: softmax over all experts,
// top-k, renormalise over the k (Mixtral's softmax over the top-k logits is the same thing;
// config.c sets norm_topk_prob for Mixtral). The differences are the tensor names only.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "model/moe.h"

struct moe_names {
    const char *block;               // "mlp" or "block_sparse_moe"
    const char *gate, *up, *down;    // per-expert suffixes
};

static struct moe_names moe_names_of(const struct model_config *c) {
    if (c->arch == MODEL_ARCH_MIXTRAL) return (struct moe_names){"block_sparse_moe", "w1", "w3", "w2"};
    return (struct moe_names){"mlp", "gate_proj", "up_proj", "down_proj"};
}

struct moe_route_args model_moe_route_args(const struct model_config *c) {
    const char *u = getenv("ATOMC_MOE_FORCE_UNIFORM");
    struct moe_route_args a = {
        .num_experts = c->num_experts,
        .top_k = c->num_experts_per_tok,
        .scoring = MOE_SCORING_SOFTMAX,
        .renormalize = c->norm_topk_prob,
        .scale = 1.0f,
        .force_uniform = u && *u && strcmp(u, "0") != 0,
    };
    return a;
}

int64_t model_moe_layer_params(const struct model_config *c, bool active_only) {
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts;
    int64_t n = active_only ? c->num_experts_per_tok : E;
    return n * 3 * H * I + E * H;
}

double model_moe_decode_weight_bytes(const struct model_config *c, double weight_bytes, int batch) {
    if (c->num_experts <= 0) return weight_bytes;
    double per_param = weight_bytes / (double)model_param_count(c);
    int64_t touched = (int64_t)batch * c->num_experts_per_tok;
    if (touched > c->num_experts) touched = c->num_experts;
    double idle = 0;
    for (int l = 0; l < c->num_layers; l++)
        if (model_config_layer_is_moe(c, l))
            idle += (double)(c->num_experts - touched) * 3.0 * c->hidden_size * c->moe_intermediate_size;
    return weight_bytes - idle * per_param;
}

atomc_status model_moe_load_layer(struct weight_loader *L, struct model *m, int l, struct error *err) {
    const struct model_config *c = &m->cfg;
    struct model_layer *ly = &m->layers[l];
    const struct moe_names nm = moe_names_of(c);
    const int E = c->num_experts;
    const int64_t H = c->hidden_size, I = c->moe_intermediate_size;
    ly->moe = true;
    char buf[192];
    snprintf(buf, sizeof buf, "model.layers.%d.%s.gate.weight", l, nm.block);
    atomc_status st = model_weight_load(L, &ly->router, buf, 2, (int64_t[]){E, H}, 0, err);
    if (st != ATOMC_OK) return st;

    // 2E names (gate_0, up_0, gate_1, up_1, ...) stacked by rows = (E, 2I, H); E names for down.
    char(*names)[160] = xcalloc((size_t)2 * E, sizeof *names);
    const char **np = xcalloc((size_t)2 * E, sizeof *np);
    int64_t *rows = xcalloc((size_t)2 * E, sizeof *rows);
    for (int e = 0; e < E; e++) {
        snprintf(names[2 * e], sizeof names[0], "model.layers.%d.%s.experts.%d.%s.weight", l, nm.block, e, nm.gate);
        snprintf(names[2 * e + 1], sizeof names[0], "model.layers.%d.%s.experts.%d.%s.weight", l, nm.block, e, nm.up);
        np[2 * e] = names[2 * e];
        np[2 * e + 1] = names[2 * e + 1];
        rows[2 * e] = rows[2 * e + 1] = I;
    }
    st = model_weight_load_fused(L, &ly->exp_gate_up, 2 * E, np, rows, H, 0, err);
    if (st == ATOMC_OK) {
        for (int e = 0; e < E; e++) {
            snprintf(names[e], sizeof names[0], "model.layers.%d.%s.experts.%d.%s.weight", l, nm.block, e, nm.down);
            np[e] = names[e];
            rows[e] = H;
        }
        st = model_weight_load_fused(L, &ly->exp_down, E, np, rows, I, 0, err);
    }
    free(names);
    free(np);
    free(rows);
    if (st != ATOMC_OK) return st;
    // Fused loads produce 2-D (E * rows, cols); view them as the stacked 3-D weights.
    ly->exp_gate_up = tensor_make(ly->exp_gate_up.data, ly->exp_gate_up.dtype, 3, (int64_t[]){E, 2 * I, H});
    ly->exp_down = tensor_make(ly->exp_down.data, ly->exp_down.dtype, 3, (int64_t[]){E, H, I});
    return ATOMC_OK;
}

void model_moe_layer_free(struct model *m, struct model_layer *ly) {
    struct tensor *ts[] = {&ly->router, &ly->exp_gate_up, &ly->exp_down};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
        if (ts[i]->data) m->backend->ops->free(m->backend, ts[i]->data);
        ts[i]->data = NULL;
    }
}

void model_moe_scratch_free(struct model *m) {
    struct model_moe_scratch *s = &m->scratch.moe;
    void **ps[] = {(void **)&s->logits, (void **)&s->topk_ids, (void **)&s->topk_w, &s->workspace};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        if (*ps[i]) m->backend->ops->free(m->backend, *ps[i]);
        *ps[i] = NULL;
    }
    s->bytes = 0;
}

atomc_status model_moe_scratch_alloc(struct model *m, int max_tokens, struct error *err) {
    model_moe_scratch_free(m);
    const struct model_config *c = &m->cfg;
    if (c->num_experts <= 0) return ATOMC_OK;
    struct backend *b = m->backend;
    struct model_moe_scratch *s = &m->scratch.moe;
    size_t e = dtype_row_bytes(b->act_dtype, 1), T = (size_t)max_tokens, E = (size_t)c->num_experts;
    size_t k = (size_t)c->num_experts_per_tok;
    struct {
        void **p;
        size_t bytes;
    } want[] = {
        {(void **)&s->logits, T * E * sizeof(float)},
        {(void **)&s->topk_ids, T * k * sizeof(int32_t)},
        {(void **)&s->topk_w, T * k * sizeof(float)},
        {&s->workspace, moe_workspace_bytes((int64_t)T, (int)k, (int)E, c->hidden_size, c->moe_intermediate_size, e)},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        *want[i].p = b->ops->alloc(b, want[i].bytes);
        if (!*want[i].p) {
            size_t total = s->bytes + want[i].bytes;
            model_moe_scratch_free(m);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY,
                             "cannot allocate %.1f MiB of MoE activations for %d batched tokens (lower "
                             "max_num_batched_tokens)", (double)total / (1 << 20), max_tokens);
        }
        s->bytes += want[i].bytes;
    }
    return ATOMC_OK;
}

void model_moe_forward(struct model *m, const struct model_layer *ly, struct tensor *h, const struct tensor *x) {
    struct backend *b = m->backend;
    const struct model_config *c = &m->cfg;
    struct model_moe_scratch *s = &m->scratch.moe;
    const int64_t T = tensor_rows(x);
    CHECK(ly->moe && s->workspace != NULL);
    // F32 router logits straight from the GEMM (matmul may write F32): routing decisions do not
    // see a BF16 rounding of the logits on the GPU.
    struct tensor logits = tensor_2d(s->logits, DTYPE_F32, T, c->num_experts);
    b->ops->matmul(b, &logits, x, &ly->router, NULL);
    b->ops->moe_route(b, &logits, &m->moe_route, s->topk_ids, s->topk_w);
    b->ops->moe_experts(b, h, x, &ly->exp_gate_up, &ly->exp_down, s->topk_ids, s->topk_w, c->num_experts_per_tok,
                        s->workspace);
}
