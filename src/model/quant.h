// What the engine does with a checkpoint's quantization config (struct quant_config,
// parsed in model/config.c from quantization_config and its sibling files).
//
// Contract:
// - model_quant_check() is called once a model's files are open and before any weight is
//   read. It returns ATOMC_OK for an unquantized checkpoint (quant.present == false: plain
//   F32/F16/BF16 safetensors, and every GGUF, whose Q8_0/Q4_0/Q4_1 blocks are tensor dtypes
//   the backends implement). Any other config is ATOMC_ERR_UNSUPPORTED with a message that
//   names where it was found, the quant_method, the format and the strategy of the first
//   scheme that is not implemented (or the KV-cache scheme / sparsity format), and what is
//   supported.
// - What is implemented is one table in quant.c (method, format, weight type / bits /
//   strategy / block, activation scheme). Today:
//     fp8 e4m3, weight_block_size [128, 128], dynamic activations   -> WEIGHT_SCHEME_BLOCK
//     fp8 e4m3 per-tensor weights, static activations (input_scale) -> WEIGHT_SCHEME_PER_TENSOR
//     compressed-tensors float-quantized FP8, channel strategy      -> WEIGHT_SCHEME_PER_CHANNEL
//     compressed-tensors float-quantized FP8, tensor strategy       -> WEIGHT_SCHEME_PER_TENSOR
//       (both: weight-only, dynamic per-token or static per-tensor FP8 activations)
//     compressed-tensors pack-quantized INT4 or INT8, group or channel strategy, symmetric or
//       with zero points, actorder, weight-only                     -> WEIGHT_SCHEME_GROUP
//       (channel: one group per row)
//     compressed-tensors int-quantized INT8 per channel, dynamic per-token or static INT8
//       activations                                                 -> WEIGHT_SCHEME_GROUP
//     gptq / gptq_v2 INT4 / INT8, group or channel, sym / asym, desc_act; awq gemm INT4
//       with zero points                                            -> WEIGHT_SCHEME_GROUP
//       (the layouts: enum quant_layout below)
//     mxfp4 (GptOssForCausalLM only): the experts' _blocks / _scales   -> WEIGHT_SCHEME_MX
//       (every other module plain, as transformers' mxfp4 quantizer leaves it)
//     KV cache: compressed-tensors kv_cache_scheme static float8 per tensor (model_quant_kv_fp8),
//       and the fp8 method's self_attn.k_scale / v_scale / kv_scale tensors (model_kv_scales_load)
//   Everything else stays refused by name (other KV-cache schemes, other block sizes or bit widths,
//   static per-token scales, bitsandbytes / modelopt, ...). Whether a backend runs a scheme
//   is its caps' business (model_quant_check_backend).
// - model_quant_weight_plan() tells the weight loader, per linear module, which scheme and
//   tensors to expect: ignore lists (compressed-tensors `ignore`: exact names or "re:"
//   regexes; fp8 `modules_to_not_convert`: a regex from the start up to a module boundary, or a
//   suffix, as transformers' should_convert_module matches them) and
//   compressed-tensors `targets` ("Linear", "re:" regexes or exact module names) are
//   honoured; a module no scheme targets is a plain weight.
// - The check reads only the config. Tensors the loader never consumes (scale tensors of a
//   checkpoint that declares no quantization, say) are caught after loading by
//   model_files_check_consumed() (loader/model_files.h).
#ifndef ATOMC_MODEL_QUANT_H
#define ATOMC_MODEL_QUANT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"
#include "core/weight.h"
#include "model/config.h"

atomc_status model_quant_check(const struct model_config *c, struct error *err);

// True when the checkpoint declares an FP8 KV cache that atomc implements: compressed-tensors'
// kv_cache_scheme {num_bits 8, type float, strategy tensor, dynamic false, symmetric}, or the fp8
// method's "kv_cache_scheme": "static" (per layer self_attn.k_scale / v_scale; model_kv_scales_load
// reads them). --kv-cache-dtype auto then picks FP8. Other kv_cache_scheme forms (int, dynamic,
// asymmetric, per head / channel / group) make model_quant_check refuse the checkpoint.
bool model_quant_kv_fp8(const struct model_config *c);

struct model;
struct model_files;
// Reads each decoder layer's KV-cache scales into m->layer_cache[l].k_scale / v_scale (0: none):
// model.layers.<l>.self_attn.k_scale / v_scale (compressed-tensors, vLLM's fp8 method; older
// compressed-tensors: k_proj.output_scale / v_proj.output_scale), or the deprecated single
// kv_scale for both; a layer with only one of K / V uses it for both (as vLLM does). Each must
// be one positive finite F32 / BF16 / F16 value. Refused by name: more than one value (per head
// / channel), zero points (asymmetric), q_scale / prob_scale (FP8 attention), scales on a
// latent (MLA) or recurrent layer, a declared kv_cache_scheme without a layer's scales. files
// NULL (dummy weights): nothing. The runner applies the scales when the KV cache is FP8.
atomc_status model_kv_scales_load(struct model *m, struct model_files *f, struct error *err);

struct backend_caps;
// ATOMC_ERR_UNSUPPORTED when the backend's caps lack a weight scheme or storage dtype the
// (implemented) config needs, naming the scheme and the backend. OK for unquantized configs.
atomc_status model_quant_check_backend(const struct model_config *c, const struct backend_caps *caps,
                                       struct error *err);

// The tensor layouts of integer weights the loader converts (all become WEIGHT_SCHEME_GROUP,
// core/weight.h, with the values' bits as stored):
//   QUANT_LAYOUT_CT    compressed-tensors: weight_packed (rows, cols*bits/32) offset 2^(bits-1),
//                      weight_scale (rows, groups), weight_zero_point (rows*bits/32, groups)
//                      packed along rows, weight_g_idx (cols) (the format itself)
//   QUANT_LAYOUT_GPTQ  AutoGPTQ / GPTQModel: qweight (cols*bits/32, rows) packed along cols,
//                      unsigned values, low bits first; qzeros (groups, rows*bits/32) packed along
//                      rows, the zero minus 1 in the v1 format ("gptq"), the zero in "gptq_v2";
//                      scales (groups, rows); g_idx (cols)
//   QUANT_LAYOUT_AWQ   AutoAWQ GEMM: qweight (cols, rows/8) packed along rows with the nibble
//                      order 0 2 4 6 1 3 5 7 (nibble i holds row 8j + order[i]), unsigned;
//                      qzeros (groups, rows/8) the same way; scales (groups, rows)
//   QUANT_LAYOUT_CT_INT8  compressed-tensors int-quantized: weight I8 (rows, cols), one value per
//                      byte, repacked into I32 words of 4 offset-128 fields; weight_scale per
//                      channel (rows, 1)
enum quant_layout { QUANT_LAYOUT_CT = 0, QUANT_LAYOUT_GPTQ, QUANT_LAYOUT_AWQ, QUANT_LAYOUT_CT_INT8 };

// What the loader reads for one linear module (its HF name without ".weight", e.g.
// "model.layers.0.self_attn.q_proj"): values <module>.<values>, scales <module>.<scale>.
struct quant_weight_plan {
    enum weight_scheme scheme;  // NONE: a plain <module>.weight
    enum dtype values_dtype;    // FP8_E4M3, or I32 words of packed `bits`-bit integers
    int bits;                   // 8 (FP8) or 4 (packed)
    const char *values;         // "weight" or "weight_packed"
    const char *scale;          // "weight_scale_inv" (fp8 blocks) or "weight_scale"
    bool shape_tensor;          // <module>.weight_shape (I64 [rows, cols]) is stored too
    int block_rows, block_cols; // BLOCK: the tile; GROUP: 1 x group size (0: the whole row)
    enum weight_act act;        // the input activations' quantization (NONE: weight-only)
    // Asymmetric / reordered integer weights and static activations (NULL: none):
    const char *zero;         // zero points: "weight_zero_point" (compressed-tensors, packed by rows)
    const char *gidx;         // column -> group map: "weight_g_idx" (compressed-tensors actorder group)
    const char *input_scale;  // static activations: "input_scale" (one element)
    enum quant_layout layout; // how values / scales / zeros are laid out in the files
    bool gptq_zero_plus_one;  // GPTQ v1: the stored zero is the zero minus 1
    bool gidx_required;       // desc_act / actorder group: the g_idx tensor must be there
};

// Fills *plan for `module` under config c (a checked config: model_quant_check passed).
void model_quant_weight_plan(const struct model_config *c, const char *module, struct quant_weight_plan *plan);

const char *quant_method_name(enum quant_method m);         // "fp8", "compressed-tensors", ... ("none")
const char *quant_strategy_name(enum quant_strategy s);     // "tensor", "channel", ... ("none")
const char *quant_type_name(enum quant_num_type t);         // "int", "float", "other" ("none")
const char *quant_act_scheme_name(enum quant_act_scheme a); // "none", "dynamic", "static"

// One line describing quantization args ("float8, strategy block [128, 128], symmetric"),
// a scheme ("format e4m3; weights ...; activations ..."), or a whole config (method,
// schemes, KV cache, sparsity, ignore list) as `atomc inspect` prints it. Output is cut to cap.
void quant_args_describe(const struct quant_args *a, char *buf, size_t cap);
void quant_scheme_describe(const struct quant_scheme *s, char *buf, size_t cap);
void quant_config_describe(const struct quant_config *q, char *buf, size_t cap);

#endif
