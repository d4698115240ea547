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
//   strategy, activation scheme). It is empty today: the quantized-weights issue adds a
//   row per scheme as its kernels land, and everything else stays refused.
// - The check reads only the config. Tensors the loader never consumes (scale tensors of a
//   checkpoint that declares no quantization, say) are caught after loading by
//   model_files_check_consumed() (loader/model_files.h).
#ifndef ATOMC_MODEL_QUANT_H
#define ATOMC_MODEL_QUANT_H

#include <stddef.h>

#include "common/error.h"
#include "model/config.h"

atomc_status model_quant_check(const struct model_config *c, struct error *err);

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
