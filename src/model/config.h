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
    MODEL_ARCH_QWEN3_NEXT,   // Qwen3NextForCausalLM: Gated DeltaNet + gated attention, MoE + shared expert
    MODEL_ARCH_QWEN3_5_MOE,  // Qwen3_5MoeForCausalLM (text): the same layers, split DeltaNet projections
    MODEL_ARCH_DEEPSEEK_V2, // DeepseekV2ForCausalLM (MLA, greedy / group-limited softmax routing)
    MODEL_ARCH_GLM_MOE_DSA, // GlmMoeDsaForCausalLM (GLM-5): DeepSeek-V3 MLA + DSA indexer (interleaved RoPE)
    MODEL_ARCH_DEEPSEEK_V32, // DeepseekV32ForCausalLM: DeepSeek-V3 + DSA indexer (half-split indexer RoPE)
    MODEL_ARCH_MIMO_V2_FLASH, // MiMoV2FlashForCausalLM: hybrid sliding / full GQA, q/k vs v head dims, sigmoid MoE
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

// ---------------------------------------------------------------------------------
// Quantization, as a checkpoint declares it: config.json's `quantization_config` (older
// llm-compressor files: `compression_config`), else AutoGPTQ's quantize_config.json or
// ModelOpt's hf_quant_config.json beside it (model_files reads those). GGUF files have
// none: their block types (Q8_0, ...) are tensor dtypes. The parser records what the file
// says; model/quant.h decides what the engine can run (today: nothing, so any present
// config is refused there). Lists longer than the caps below are counted in full but only
// their first entries are kept.

enum quant_method {
    QUANT_METHOD_NONE = 0,           // no quantization config
    QUANT_METHOD_FP8,                // "fp8": transformers FineGrainedFP8 / DeepSeek-V3, Qwen3-FP8
    QUANT_METHOD_COMPRESSED_TENSORS, // "compressed-tensors": llm-compressor
    QUANT_METHOD_GPTQ,               // "gptq"
    QUANT_METHOD_AWQ,                // "awq"
    QUANT_METHOD_MXFP4,              // "mxfp4": GPT-OSS
    QUANT_METHOD_BITSANDBYTES,       // "bitsandbytes"
    QUANT_METHOD_MODELOPT,           // "modelopt": NVIDIA ModelOpt (FP8, NVFP4, ...)
    QUANT_METHOD_OTHER,              // any other quant_method (its name is kept)
};

enum quant_strategy {
    QUANT_STRATEGY_NONE = 0,     // not stated
    QUANT_STRATEGY_TENSOR,       // one scale per tensor
    QUANT_STRATEGY_CHANNEL,      // one scale per output row
    QUANT_STRATEGY_GROUP,        // one scale per group_size elements along k (activations: per token and group)
    QUANT_STRATEGY_BLOCK,        // one scale per block_size[0] x block_size[1] tile
    QUANT_STRATEGY_TOKEN,        // activations: one scale per token
    QUANT_STRATEGY_TENSOR_GROUP, // NVFP4: a global scale and group scales
    QUANT_STRATEGY_ATTN_HEAD,    // KV cache: one scale per head
    QUANT_STRATEGY_OTHER,        // a name this parser does not know (kept in strategy_name)
};

enum quant_num_type { QUANT_TYPE_NONE = 0, QUANT_TYPE_INT, QUANT_TYPE_FLOAT, QUANT_TYPE_OTHER };

enum quant_act_scheme {
    QUANT_ACT_NONE = 0, // weight-only (activations stay in the compute dtype)
    QUANT_ACT_DYNAMIC,  // scales computed at run time
    QUANT_ACT_STATIC,   // scales stored in the checkpoint (input_scale)
};

#define QUANT_NAME_MAX 128  // bytes of a module name / target kept (longer: ATOMC_ERR_FORMAT)
#define QUANT_MAX_IGNORE 64 // ignore entries kept
#define QUANT_MAX_TARGETS 4 // targets kept per scheme
#define QUANT_MAX_SCHEMES 8 // config groups kept

// How one kind of tensor is quantized (compressed-tensors' QuantizationArgs, or what an
// other method implies).
struct quant_args {
    bool present; // false: not quantized (e.g. no input_activations: weight-only)
    int num_bits;
    enum quant_num_type type;
    enum quant_strategy strategy;
    char strategy_name[16]; // as written ("" if implied)
    int group_size;         // GROUP / TENSOR_GROUP; 0 = none
    int block_size[2];      // BLOCK: (rows, cols) of a tile; 0 = none
    bool symmetric;         // false: zero points are stored
    bool dynamic;           // scales computed at run time (activations)
    char actorder[16];      // GPTQ desc_act / compressed-tensors actorder ("" = none)
};

// One quantization scheme: a compressed-tensors config group, or the single scheme of the
// other methods.
struct quant_scheme {
    char name[32];   // group name ("group_0"), or the method name
    char format[32]; // compressed-tensors per-group format, else the top-level format
    int n_targets;   // targets listed (all of them, see QUANT_MAX_TARGETS)
    char targets[QUANT_MAX_TARGETS][QUANT_NAME_MAX];
    struct quant_args weights;
    struct quant_args input_act;
    enum quant_act_scheme act_scheme;
    bool output_act; // output_activations quantized
};

struct quant_config {
    bool present;
    char origin[48]; // where it was found: "quantization_config", "quantize_config.json", ...
    enum quant_method method;
    char method_name[32]; // quant_method as written
    char format[32];      // compressed-tensors `format`, fp8 `fmt`, GPTQ checkpoint_format, AWQ version,
                          // bitsandbytes quant type, ModelOpt quant_algo ("" if none)
    int n_schemes;        // schemes listed (all of them, see QUANT_MAX_SCHEMES)
    struct quant_scheme schemes[QUANT_MAX_SCHEMES];
    struct quant_args kv_cache; // compressed-tensors kv_cache_scheme / ModelOpt kv_cache_quant_algo
    char sparsity_format[32];   // compressed-tensors sparsity_config.format ("" = dense)
    int n_ignore;               // modules left unquantized (ignore / modules_to_not_convert / ...), all of them
    char ignore[QUANT_MAX_IGNORE][QUANT_NAME_MAX];
};

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
    // A second RoPE for the sliding-window layers (transformers-5 `rope_parameters` given per
    // layer type with different values; MiMo-V2-Flash): rope_sliding.rotary_dim > 0 = set.
    // Families that do not read it refuse a config that sets it (see parse_rope).
    struct rope_config rope_sliding;
    // MiMo-V2-Flash: sliding layers have swa_num_kv_heads KV heads (2 x num_key_value_heads) and
    // sinks; q/k heads of head_dim, v heads of v_head_dim (the MLA field); values times
    // attention_value_scale.
    int swa_num_kv_heads;
    float attention_value_scale;

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

    // GPT-OSS (swiglu_alpha > 0 only there): experts apply a clamped SwiGLU,
    //   gate = min(gate, limit), up = clamp(up, -limit, limit), out = (up + 1) * gate * sigmoid(alpha * gate),
    // and the router and experts carry biases.
    float swiglu_alpha;         // 1.702 for GPT-OSS; 0 = plain SiLU experts
    float swiglu_limit;         // 7.0 for GPT-OSS

    // Multi-head latent attention (DeepSeek-V3).
    int q_lora_rank;
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
    // DeepSeek-V2/V3 (src/model/deepseek.c).
    char topk_method[24];         // "greedy", "group_limited_greedy", "noaux_tc" ("" = not given)
    int moe_layer_freq;           // MoE every n-th layer from first_k_dense_replace (DeepSeek; 1)
    int num_nextn_predict_layers; // MTP layers stored after the decoder layers (skipped at load; GLM too)
    // DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2; index_n_heads > 0): the lightning indexer
    // scores every past token per query and MLA attends only to the index_topk best.
    int index_n_heads;            // indexer query heads (0 = no DSA)
    int index_head_dim;           // indexer q / k head dim (its first qk_rope_head_dim dims roped)
    int index_topk;               // keys each query attends to
    bool index_rope_interleaved;  // indexer RoPE pairs (2i, 2i+1) (GLM-5) or halves (DeepSeek-V3.2)
    bool index_shared[MODEL_MAX_LAYERS]; // indexer_types "shared": reuse the previous full layer's top-k

    // Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5; layer_types LAYER_ATTN_LINEAR).
    int linear_num_key_heads;   // Hk: q/k heads of a linear-attention layer
    int linear_num_value_heads; // Hv: value heads (a multiple of Hk; k head h / (Hv / Hk) serves value head h)
    int linear_key_head_dim;    // Dk
    int linear_value_head_dim;  // Dv
    int linear_conv_kernel_dim; // K: depthwise causal conv1d over (q, k, v) channels
    bool norm_zero_centered;    // RMSNorm weights w scale by (1 + w) (Qwen3-Next's Qwen3NextRMSNorm)
    bool attn_output_gate;      // full attention: q_proj also yields a per-head sigmoid gate of the output

    // Quantization (present == false for unquantized checkpoints and GGUF).
    struct quant_config quant;
};

// Parses config.json text (HF). Handles both `rope_theta` + `rope_scaling` and the
// transformers-5 `rope_parameters` form. `source` names the file for error messages.
atomc_status model_config_parse_json(struct model_config *c, const char *json, const char *source, struct error *err);

// Reads generation_config.json (if present) and merges its eos_token_id(s) and bos.
atomc_status model_config_merge_generation_config(struct model_config *c, const char *json, const char *source,
                                                  struct error *err);

// Parses a quantization config found outside config.json (AutoGPTQ quantize_config.json,
// ModelOpt hf_quant_config.json) into c->quant; `origin` names the file for messages and
// `default_method` applies when the file has no quant_method. ATOMC_ERR_FORMAT naming the
// field for malformed values; unknown keys are ignored.
atomc_status model_config_parse_quant_file(struct model_config *c, const char *json, const char *source,
                                           const char *origin, enum quant_method default_method, struct error *err);

// quant_method / strategy strings as written in configs -> enums (unknown: *_OTHER).
enum quant_method quant_method_from_name(const char *name);
enum quant_strategy quant_strategy_from_name(const char *name);

enum model_arch model_arch_from_name(const char *name);
const char *model_arch_name(enum model_arch a);

// True if layer `l` uses an MoE block.
bool model_config_layer_is_moe(const struct model_config *c, int l);

// Checks derived invariants (heads divide hidden size, etc.); names the first problem.
atomc_status model_config_validate(const struct model_config *c, const char *source, struct error *err);

#endif
