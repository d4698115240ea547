// One source of weights and hyper-parameters over either an HF model directory
// (config.json, generation_config.json, model.safetensors or a sharded index) or a single
// .gguf file. Model code asks for tensors by their HF names whatever the format.
//
// Contract:
// - model_files_open(path): a directory is read as an HF model; a file starting with the
//   GGUF magic as GGUF. `config` is filled (GGUF: from general.architecture and the
//   `<arch>.*` keys; the vocabulary size from tokenizer.ggml.tokens) and validated.
// - model_files_get_tensor(name): tensors are views into the mmapped files (no copies)
//   in the file's own dtype (F32/F16/BF16 for safetensors; also Q8_0/Q4_0/Q4_1 for GGUF,
//   which the backend dequantises). Exception: GGUF q_proj/k_proj (and their biases) of
//   LLaMA-architecture files, whose rows llama.cpp's converter permuted
//   (w.reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2)); they are un-permuted into an
//   owned buffer, in the same dtype (rows are whole quantisation blocks, so moving rows
//   is exact), and cached. Likewise a plain-typed view whose address is not a multiple of
//   its element size (a writer that did not pad) is copied once into an aligned owned
//   buffer. Owned buffers live until model_files_close().
// - GGUF names are mapped from HF names (model.embed_tokens.weight <- token_embd.weight,
//   model.layers.N.self_attn.q_proj.weight <- blk.N.attn_q.weight, ...; per-expert
//   weights model.layers.N.mlp.experts.E.gate_proj.weight, or Mixtral's
//   block_sparse_moe.experts.E.w1/w3/w2, are views of expert E of blk.N.ffn_{gate,up,down}_exps;
//   shared experts map to ffn_*_shexp). A GGUF without output.weight has tied embeddings
//   (config.tie_word_embeddings), and lm_head.weight is then NOT_FOUND. Names with no HF
//   mapping are looked up verbatim (e.g. llama.cpp's rope_freqs.weight).
// - Not thread-safe: model_files_get_tensor may fill its cache of owned buffers; load
//   weights from one thread (views it returned may then be read from any thread).
// - Quantization: an HF directory's config.json quantization_config is parsed into
//   config.quant; without one, AutoGPTQ's quantize_config.json or ModelOpt's
//   hf_quant_config.json beside it is read instead. Opening does not refuse any of them:
//   model_quant_check (model/quant.h) does, so `atomc inspect` can still show them.
// - Errors name the file and the tensor: missing tensor (ATOMC_ERR_NOT_FOUND), wrong
//   shape or dtype class in model_files_expect (ATOMC_ERR_FORMAT), unsupported dtype.
//
// Tensor-parallel hook: model_files_get_tensor_slice() returns rows [start, start+len)
// of dim 0 as a view (column-parallel linears shard the output rows) or a column range of
// the last dim copied into an owned buffer (row-parallel linears shard the input); a
// TP loader asks each rank's shard through it, so the files are never fully copied.
#ifndef ATOMC_LOADER_MODEL_FILES_H
#define ATOMC_LOADER_MODEL_FILES_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"
#include "core/tensor.h"
#include "loader/gguf.h"
#include "loader/safetensors.h"
#include "model/config.h"

enum model_files_kind { MODEL_FILES_HF = 0, MODEL_FILES_GGUF };

// What dtypes a caller accepts in model_files_expect.
enum tensor_class {
    TENSOR_CLASS_ANY = 0,
    TENSOR_CLASS_FLOAT,   // F32, F16, BF16
    TENSOR_CLASS_WEIGHT,  // FLOAT or a quantised weight type (Q8_0, Q4_0, Q4_1, F8_E4M3)
    TENSOR_CLASS_INT,     // I32, I64, U8
};

struct model_files_owned; // a buffer owned by model_files (opaque)

struct model_files {
    enum model_files_kind kind;
    char *path;                     // as given (directory or .gguf)
    struct model_config config;
    bool has_generation_config;     // HF: generation_config.json was found and merged
    char *tokenizer_path;           // HF: <dir>/tokenizer.json if present; GGUF: the .gguf; else NULL
    struct safetensors_set *st;     // HF
    struct gguf_file *gguf;         // GGUF
    bool gguf_permuted_qk;          // GGUF q/k rows are in llama.cpp's permuted order
    // One flag per tensor of the files (HF: st->entries order; GGUF: gguf->tensors order):
    // set once any view, slice or copy of it was handed out (model_files_check_consumed).
    size_t n_tensors;
    bool *consumed;
    size_t n_owned, cap_owned;
    struct model_files_owned *owned;
};

atomc_status model_files_open(struct model_files **out, const char *path, struct error *err);
// The safetensors of an HF directory whose config.json the caller reads itself (a draft head
// whose architecture is no model of its own: EAGLE-3, src/model/eagle3.c); config stays zeroed.
atomc_status model_files_open_tensors(struct model_files **out, const char *dir, struct error *err);
void model_files_close(struct model_files *mf);

// The file a tensor comes from (shard path or .gguf), or the model path if unknown.
const char *model_files_source(const struct model_files *mf, const char *hf_name);
bool model_files_has_tensor(const struct model_files *mf, const char *hf_name);
atomc_status model_files_get_tensor(struct model_files *mf, const char *hf_name, struct tensor *out,
                                    struct error *err);

// Fetches a tensor and checks its dtype class and exact shape (ndim = number of dims
// given). Use through the macro: model_files_expect(mf, name, TENSOR_CLASS_FLOAT, &t, err, rows, cols).
atomc_status model_files_expect_shape(struct model_files *mf, const char *hf_name, enum tensor_class cls,
                                      const int64_t *shape, int ndim, struct tensor *out, struct error *err);
#define model_files_expect(mf, name, cls, out, err, ...)                                                    \
    model_files_expect_shape((mf), (name), (cls), (const int64_t[]){__VA_ARGS__},                          \
                             (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (out), (err))

// Rows [start, start + len) of `dim` (0 = a view; ndim-1 = a copy into an owned buffer,
// which for quantised dtypes must fall on block boundaries). Other dims: UNSUPPORTED.
atomc_status model_files_get_tensor_slice(struct model_files *mf, const char *hf_name, int dim, int64_t start,
                                          int64_t len, struct tensor *out, struct error *err);

// Consumption. Every fetch through model_files_get_tensor / model_files_expect /
// model_files_get_tensor_slice marks the tensor of the files it reads (a GGUF expert view
// marks the stacked tensor; any slice counts), and the GGUF config reader marks
// rope_freqs.weight, which it turns into the RoPE scaling. After a model has loaded,
// model_files_check_consumed() returns ATOMC_ERR_UNSUPPORTED naming the first tensor (in
// name order) the model never read and how many there are in all, so that a scale, zero
// point or unknown tensor never passes silently. Exempt, by design: HF `*rotary_emb.inv_freq`
// buffers (recomputed from the RoPE config) and, when tie_word_embeddings is set,
// `lm_head.weight` (transformers ties it to the embeddings and ignores the stored copy);
// an HF shard's tensors that the index does not list count as never read.
// With tensor parallelism a rank may skip tensors another rank reads (row-parallel biases
// are loaded on rank 0 only): check on rank 0, or mark skipped tensors with
// model_files_mark_consumed.
atomc_status model_files_check_consumed(const struct model_files *mf, struct error *err);
// Marks an HF-named tensor as read without fetching it; false if there is no such tensor.
bool model_files_mark_consumed(struct model_files *mf, const char *hf_name);

// GGUF name for an HF name (for messages and tools); false if there is no mapping.
bool model_files_gguf_name(const char *hf_name, char *out, size_t cap);

#endif
