// The mixture-of-experts block of Qwen3MoeForCausalLM and MixtralForCausalLM, called from
// the dense forward (llama.c) for the layers model_config_layer_is_moe() selects; the other
// layers keep the dense MLP (Qwen3-MoE mlp_only_layers / decoder_sparse_step).
//
//   logits = x @ W_router^T                (E, H) router in the weight dtype; logits F32
//   ids, w = moe_route(logits)             fp32 softmax, top-k, renormalised when norm_topk_prob
//   h      = moe_experts(x, ids, w)        fused: group by expert, gate_up GEMM, SiLU*mul, down,
//                                          weighted combine
//
// Weights are packed at load into one stacked tensor per layer: gate_up (E, 2I, H) with each
// expert's gate rows then its up rows, and down (E, H, I), from HF's per-expert tensors
// (mlp.experts.N.{gate,up,down}_proj or Mixtral's block_sparse_moe.experts.N.{w1,w3,w2}; a
// GGUF's stacked ffn_*_exps reach us as the same per-expert views).
#ifndef ATOMC_MODEL_MOE_H
#define ATOMC_MODEL_MOE_H

#include "model/model.h"

struct weight_loader;

// Loads layer l's router and stacked experts into ly (ly->moe set). Names per architecture.
atomc_status model_moe_load_layer(struct weight_loader *L, struct model *m, int l, struct error *err);
void model_moe_layer_free(struct model *m, struct model_layer *ly);
// MoE scratch (router logits, top-k ids/weights, expert workspace) for max_tokens rows.
atomc_status model_moe_scratch_alloc(struct model *m, int max_tokens, struct error *err);
void model_moe_scratch_free(struct model *m);
// h(T, H) = MoE(x(T, H)) for layer ly.
void model_moe_forward(struct model *m, const struct model_layer *ly, struct tensor *h, const struct tensor *x);
// Routing parameters of cfg (+ env ATOMC_MOE_FORCE_UNIFORM=1: benchmark-only round-robin routing).
struct moe_route_args model_moe_route_args(const struct model_config *cfg);
// Parameters of one MoE layer's experts + router, and the active (per-token) part of them.
int64_t model_moe_layer_params(const struct model_config *c, bool active_only);

// Weight bytes one decode step of `batch` tokens reads: everything but the experts, plus the
// experts the step touches per MoE layer, min(E, batch * top_k) (exact under the benchmark's
// round-robin routing, an upper bound otherwise). weight_bytes: the model's total.
double model_moe_decode_weight_bytes(const struct model_config *c, double weight_bytes, int batch);

// Exported by model_weights.c for this file: load one tensor / rows of several tensors stacked.
atomc_status model_weight_load(struct weight_loader *L, struct tensor *dst, const char *name, int ndim,
                               const int64_t *ne, int kind, struct error *err);
atomc_status model_weight_load_fused(struct weight_loader *L, struct tensor *dst, int n, const char *const *names,
                                     const int64_t *rows, int64_t cols, int kind, struct error *err);

#endif
