// Model hyper-parameters, parsed from an HF config.json or from GGUF metadata.
// One struct for every architecture the engine knows or will know: dense (Llama, Qwen3),
// MoE (Qwen3-MoE, Mixtral, GPT-OSS, GLM-4-MoE), MLA (DeepSeek-V3), sliding window and
// hybrid layers (GPT-OSS, Qwen3-Next). Fields an architecture does not use stay zero.
#ifndef ATOMC_MODEL_CONFIG_H
#define ATOMC_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/error.h"
#include "core/dtype.h"

#define MODEL_MAX_EOS 8
#define MODEL_MAX_LAYERS 512

enum model_arch {
    MODEL_ARCH_UNKNOWN = 0,
    MODEL_ARCH_LLAMA,     // LlamaForCausalLM (also MistralForCausalLM)
    MODEL_ARCH_QWEN3,     // Qwen3ForCausalLM: per-head q/k RMSNorm
    MODEL_ARCH_QWEN3_MOE, // Qwen3MoeForCausalLM
    MODEL_ARCH_MIXTRAL,   // MixtralForCausalLM
    MODEL_ARCH_DEEPSEEK_V3,
    MODEL_ARCH_GPT_OSS,
    MODEL_ARCH_GLM4_MOE,
    MODEL_ARCH_QWEN3_NEXT,
};

enum rope_scaling_type {
    ROPE_SCALING_NONE = 0,
    ROPE_SCALING_LINEAR,
    ROPE_SCALING_LLAMA3,
    ROPE_SCALING_YARN,
    ROPE_SCALING_DYNAMIC,
};

struct rope_config {
    float theta;                       // rope_theta (base)
    enum rope_scaling_type scaling;
    float factor;                      // scaling factor
    float low_freq_factor;             // llama3
    float high_freq_factor;            // llama3
    int original_max_position;         // llama3 / yarn original_max_position_embeddings
    float beta_fast, beta_slow;        // yarn
    float mscale, mscale_all_dim;      // yarn / deepseek
    int rotary_dim;                    // dims rotated per head (head_dim * partial_rotary_factor)
    bool interleaved;                  // GPT-J style pairs (x0,x1) instead of NeoX halves
    float attention_factor;            // yarn: explicit cos/sin scale; 0 = derive from factor/mscale
    bool yarn_truncate;                // yarn: floor/ceil the correction range (default true; GPT-OSS false)
};

enum layer_attn_type { LAYER_ATTN_FULL = 0, LAYER_ATTN_SLIDING, LAYER_ATTN_LINEAR };

struct model_config {
    enum model_arch arch;
    char architecture[64];      // as in config.json "architectures"[0]
    int hidden_size;
    int intermediate_size;
    int num_layers;
    int num_heads;
    int num_kv_heads;
    int head_dim;
    int vocab_size;
    int max_position_embeddings;
    float rms_norm_eps;
    struct rope_config rope;
    bool tie_word_embeddings;
    bool attention_bias;        // bias on q/k/v projections
    bool attention_out_bias;    // bias on o_proj
    bool mlp_bias;
    bool qk_norm;               // Qwen3: RMSNorm per head on q and k
    char hidden_act[16];        // "silu" (only one supported for now)
    enum dtype torch_dtype;     // dtype the checkpoint declares
    int bos_token_id;           // -1 if none
    int eos_token_ids[MODEL_MAX_EOS];
    int n_eos;
    int pad_token_id;

    // Sliding window / hybrid layers.
    int sliding_window;         // 0 = none
    enum layer_attn_type layer_types[MODEL_MAX_LAYERS]; // per layer (FULL unless said)
    bool attention_sinks;       // GPT-OSS learned sinks

    // Mixture of experts.
    int num_experts;            // 0 = dense
    int num_experts_per_tok;
    int moe_intermediate_size;
    bool norm_topk_prob;
    int decoder_sparse_step;    // Qwen3-MoE: every n-th layer is MoE
    bool mlp_only_layers[MODEL_MAX_LAYERS]; // Qwen3-MoE: dense MLP despite step
    int first_k_dense_replace;  // DeepSeek/GLM: first k layers dense
    int n_shared_experts;
    int shared_expert_intermediate_size;
    float routed_scaling_factor;
    int n_group, topk_group;    // DeepSeek grouped top-k
    char scoring_func[16];      // "softmax" or "sigmoid"

    // Multi-head latent attention (DeepSeek-V3).
    int q_lora_rank;
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
};

// Parses config.json text (HF). Handles both `rope_theta` + `rope_scaling` and the
// transformers-5 `rope_parameters` form. `source` names the file for error messages.
atomc_status model_config_parse_json(struct model_config *c, const char *json, const char *source, struct error *err);

// Reads generation_config.json (if present) and merges its eos_token_id(s) and bos.
atomc_status model_config_merge_generation_config(struct model_config *c, const char *json, const char *source,
                                                  struct error *err);

enum model_arch model_arch_from_name(const char *name);
const char *model_arch_name(enum model_arch a);

// True if layer `l` uses an MoE block.
bool model_config_layer_is_moe(const struct model_config *c, int l);

// Checks derived invariants (heads divide hidden size, etc.); names the first problem.
atomc_status model_config_validate(const struct model_config *c, const char *source, struct error *err);

#endif
