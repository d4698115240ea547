// The architecture table: one entry per model family, looked up by the config's architecture
// (config.json "architectures"[0] / GGUF general.architecture, parsed into enum model_arch).
// model_load (model.c) drives every family through the same steps:
//
//   def = model_arch_find(cfg->arch)          unknown architecture -> UNSUPPORTED, naming it
//   def->check(cfg)                           what the family implements (UNSUPPORTED / FORMAT)
//   model_check_backend_caps(cfg, caps)       what the backend can run
//   per layer: def->plan_layer(m, l, &plan)   attention kind, FFN kind, window, cache spec and
//                                             weight tables of layer l
//              weight_loader_load_layer(...)  every table of the plan
//   def->forward(m, ids, md, kv)              per step: a short loop over src/model/blocks.c
//
// Freeing walks the same tables, and the scratch is sized from the model's dimensions
// (model_scratch_alloc), so a family provides no free or scratch code of its own.
#ifndef ATOMC_MODEL_ARCH_H
#define ATOMC_MODEL_ARCH_H

#include "model/model.h"
#include "model/weight_loader.h"

#define LAYER_MAX_TABLES 5

// What one layer is: its kinds, its cache and the weight tables that hold its fields.
struct layer_plan {
    enum attn_kind attn_kind;
    enum ffn_kind ffn_kind;
    int sliding_window;            // 0 = full attention
    struct cache_spec cache;
    const struct weight_entry *tables[LAYER_MAX_TABLES]; // loaded in this order (NULL-terminated)
};

struct model_arch_def {
    const char *family;                       // for messages and docs ("llama")
    const enum model_arch *archs;             // the enum model_arch values it serves, ends with MODEL_ARCH_UNKNOWN
    // What this family implements beyond model_config_validate; a status naming the field.
    atomc_status (*check)(const struct model_config *c, struct error *err);
    // Layer l of m (m->cfg holds this rank's local sizes).
    void (*plan_layer)(const struct model *m, int l, struct layer_plan *plan);
    void (*forward)(struct model *m, const int32_t *token_ids, const struct attn_metadata *md, struct kv_layer *kv);
    // Optional (NULL = none):
    // per-token activation columns (act dtype) the family needs beyond struct model_scratch's
    // (model_scratch_alloc gives them in scratch.extra: max_tokens x cols);
    int64_t (*extra_scratch_cols)(const struct model *m);
    // run once after every weight (layers, head, RoPE tables) has loaded (o->files NULL: dummy
    // weights): layout fix-ups in backend memory (DeepSeek stacks its shared experts after the
    // routed ones; Qwen3-Next reorders rows and offsets norms) or accounting for checkpoint tensors
    // the model skips (L: the loader, its files may be NULL); a status naming the tensor on failure.
    atomc_status (*finish_load)(struct model *m, struct weight_loader *L, const struct model_load_options *o,
                                struct error *err);
    bool no_tensor_parallel; // the family does not shard yet: tp_size > 1 is refused at load
    // Its MTP layers (num_nextn_predict_layers) load through src/model/mtp.c: plan_layer serves
    // index num_layers + i (evaluated with num_layers counting them) and finish_load fixes their
    // layers up too (m->mtp[i].layer).
    bool mtp;
};

// The entry serving `a`, or NULL.
const struct model_arch_def *model_arch_find(enum model_arch a);
// "LlamaForCausalLM, Qwen3ForCausalLM, ..." for messages.
void model_arch_supported_list(char *buf, size_t n);

// Families (one file each).
extern const struct model_arch_def model_arch_llama;    // llama.c
extern const struct model_arch_def model_arch_deepseek; // deepseek.c
extern const struct model_arch_def model_arch_gpt_oss;  // gpt_oss.c
extern const struct model_arch_def model_arch_qwen3_next; // qwen3_next.c: Qwen3-Next, Qwen3.5-MoE
extern const struct model_arch_def model_arch_glm4_moe; // glm4_moe.c
extern const struct model_arch_def model_arch_mimo;     // mimo.c: MiMo-V2-Flash

// Shared weight tables of the pre-norm decoder layer (blocks.c): the two RMSNorm weights every
// layer has (input_layernorm, post_attention_layernorm).
extern const struct weight_entry weights_layer_norms[];
// Routed experts: mlp.gate + mlp.experts.E.{gate,up,down}_proj (Qwen3-MoE, DeepSeek).
extern const struct weight_entry weights_moe_routed[];
// The dense gated MLP (mlp.{gate,up,down}_proj, optional mlp_bias biases).
extern const struct weight_entry weights_dense_mlp[];

#endif
