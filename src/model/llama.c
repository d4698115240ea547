// The dense decoder forward shared by LlamaForCausalLM and Qwen3ForCausalLM, written once
// against backend.h ops. Per step, for n new tokens (prefill chunks and decode tokens mixed):
//
//   residual = embed[ids]
//   per layer:  x = rmsnorm(residual += h)            (add_rmsnorm; layer 0 only norms)
//               qkv = x @ Wqkv^T (+ b)                 (one fused GEMM)
//               Qwen3: q, k = per-head rmsnorm(q, k)
//               rope(q, k); write k, v into the paged cache at slot_mapping
//               attn = paged_attention(q, cache)      (sliding-window layers: Mistral)
//               h = attn @ Wo^T (+ b)
//               x = rmsnorm(residual += h)
//               h = down(silu(gate) * up)              (fused gate_up GEMM, then silu_mul)
//   logits rows only: gather residual and h rows, add_rmsnorm with the final norm, lm_head
//
// Tensor parallelism (m->tp_size > 1, see model.h and src/parallel/): the same code runs on
// every rank with local head / intermediate counts in m->cfg; h is all-reduced after o_proj
// and after down_proj (row-parallel), and the vocab-parallel lm_head's logits are all-gathered.
//
// Q, K and V stay inside the fused qkv buffer: the RoPE/KV-write and attention ops take the
// row stride, so no copies. Qwen3's per-head q/k RMSNorm rides in the same op (rope_args'
// q_norm / k_norm: one launch on CUDA instead of three).
#include <math.h>

#include "common/check.h"
#include "model/model.h"
#include "model/moe.h"
#include "parallel/comm.h"

static inline struct tensor view2(void *data, enum dtype dt, int64_t rows, int64_t cols) {
    return tensor_2d(data, dt, rows, cols);
}

static inline struct tensor view3(void *data, enum dtype dt, int64_t a, int64_t b, int64_t c) {
    int64_t ne[3] = {a, b, c};
    return tensor_make(data, dt, 3, ne);
}

// Tensor parallelism: sums a row-parallel output over the ranks (in place, backend memory).
static void model_tp_all_reduce(struct model *m, struct tensor *t) {
    if (!m->comm || m->comm_status != ATOMC_OK) return;
    m->comm_status = comm_all_reduce_sum(m->comm, t->data, t->dtype, (size_t)tensor_numel(t), &m->comm_err);
}

static inline const struct tensor *opt(const struct tensor *t) {
    return t->data ? t : NULL;
}

void model_forward(struct model *m, const int32_t *token_ids, const struct attn_metadata *md, struct kv_layer *kv) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->scratch;
    const int64_t T = md->n_tokens, H = c->hidden_size, D = c->head_dim, I = c->intermediate_size;
    const int64_t hq = c->num_heads, hk = c->num_kv_heads;
    CHECK_MSG(T > 0 && T <= s->max_tokens, "forward of %lld tokens, scratch holds %d", (long long)T, s->max_tokens);
    const enum dtype dt = b->act_dtype;
    const size_t e = dtype_row_bytes(dt, 1);
    const float eps = c->rms_norm_eps, scale = 1.0f / sqrtf((float)D);

    struct tensor residual = view2(s->residual, dt, T, H), x = view2(s->x, dt, T, H), h = view2(s->h, dt, T, H);
    struct tensor qkv = view2(s->qkv, dt, T, m->qkv_dim);
    struct tensor attn = view3(s->attn, dt, T, hq, D), attn2 = view2(s->attn, dt, T, m->q_dim);
    struct tensor gu = view2(s->gate_up, dt, T, 2 * I), act = view2(s->act, dt, T, I);
    char *qkv_base = s->qkv;
    struct tensor q = view3(qkv_base, dt, T, hq, D);
    struct tensor k = view3(qkv_base + (size_t)m->q_dim * e, dt, T, hk, D);
    struct tensor v = view3(qkv_base + (size_t)(m->q_dim + m->kv_dim) * e, dt, T, hk, D);
    struct rope_args rope = m->rope;
    rope.norm_eps = eps;

    ops->embedding(b, &residual, &m->embed, token_ids);
    for (int l = 0; l < c->num_layers; l++) {
        struct model_layer *ly = &m->layers[l];
        ops->add_rmsnorm(b, &x, &residual, l == 0 ? NULL : &h, &ly->attn_norm, eps);
        ops->matmul(b, &qkv, &x, &ly->qkv, opt(&ly->qkv_bias));
        rope.q_norm = c->qk_norm ? &ly->q_norm : NULL;
        rope.k_norm = c->qk_norm ? &ly->k_norm : NULL;
        ops->rope_kv_write(b, &q, &k, &v, m->qkv_dim, &rope, &kv[l], md);
        int window = c->layer_types[l] == LAYER_ATTN_SLIDING ? c->sliding_window : 0;
        ops->attention(b, &attn, &q, m->qkv_dim, &kv[l], md, scale, window, NULL);
        ops->matmul(b, &h, &attn2, &ly->o, opt(&ly->o_bias));
        model_tp_all_reduce(m, &h);
        ops->add_rmsnorm(b, &x, &residual, &h, &ly->mlp_norm, eps);
        if (ly->moe) { // Qwen3-MoE / Mixtral sparse layers: router + fused experts (moe.c)
            model_moe_forward(m, ly, &h, &x);
            continue;
        }
        ops->matmul(b, &gu, &x, &ly->gate_up, opt(&ly->gate_up_bias));
        ops->silu_mul(b, &act, &gu);
        ops->matmul(b, &h, &act, &ly->down, opt(&ly->down_bias));
        model_tp_all_reduce(m, &h);
    }
    m->last_tokens = (int)T;
}

struct tensor model_compute_logits(struct model *m, const int32_t *rows, int n_rows) {
    struct backend *b = m->backend;
    const struct backend_ops *ops = b->ops;
    struct model_scratch *s = &m->scratch;
    const struct model_config *c = &m->cfg;
    CHECK_MSG(n_rows > 0 && n_rows <= s->max_logits_rows, "%d logits rows, scratch holds %d", n_rows,
              s->max_logits_rows);
    const enum dtype dt = b->act_dtype;
    const int64_t T = m->last_tokens, H = c->hidden_size, V = c->vocab_size;
    struct tensor residual = view2(s->residual, dt, T, H), h = view2(s->h, dt, T, H);
    struct tensor gres = view2(s->lg_res, dt, n_rows, H), gh = view2(s->lg_h, dt, n_rows, H);
    struct tensor gx = view2(s->lg_x, dt, n_rows, H);
    struct tensor logits = view2(s->logits, DTYPE_F32, n_rows, V);
    ops->gather_rows(b, &gres, &residual, rows, n_rows);
    ops->gather_rows(b, &gh, &h, rows, n_rows);
    ops->add_rmsnorm(b, &gx, &gres, &gh, &m->final_norm, c->rms_norm_eps);
    // F32 logits straight from the GEMM (backend.h: matmul may write F32 from act-dtype input),
    // so no rounding of logits to BF16 and no conversion pass.
    if (m->tp_size > 1) {
        // Vocab-parallel lm_head: this rank's (n, V/tp) logits, all-gathered side by side.
        int64_t Vs = V / m->tp_size;
        struct tensor shard = view2(s->lg_shard, DTYPE_F32, n_rows, Vs);
        ops->matmul(b, &shard, &gx, &m->lm_head, NULL);
        if (m->comm_status == ATOMC_OK)
            m->comm_status = comm_all_gather_cols(m->comm, s->logits, s->lg_shard, s->lg_gather, DTYPE_F32,
                                                  (size_t)n_rows, (size_t)Vs, &m->comm_err);
        return logits;
    }
    ops->matmul(b, &logits, &gx, &m->lm_head, NULL);
    return logits;
}
