// Loading, freeing and the target-side capture of an EAGLE-3 draft head (model.h struct
// model_eagle3), for model.c and the Llama forward.
#ifndef ATOMC_MODEL_EAGLE3_H
#define ATOMC_MODEL_EAGLE3_H

#include "model/blocks.h"

// Loads the EAGLE-3 head in directory `dir` (config.json + safetensors) into m->eagle3 (after the
// target's layers, head and RoPE) and extends m->layer_cache with the draft layer's cache. With
// dummy (the target has random weights, a benchmark) `dir` must be a bare head config (.json) and
// the head gets random weights from dummy_seed; a bare config without dummy is refused.
// UNSUPPORTED naming what is not implemented (a target other than LlamaForCausalLM, tensor
// parallelism, MTP layers too, another layer count, head geometry or vocabulary than the
// target's, biases, ...); FORMAT / IO for a missing or corrupt config or tensor, naming it.
atomc_status model_eagle3_load(struct model *m, const char *dir, bool dummy, uint64_t dummy_seed,
                               struct error *err);
void model_eagle3_free(struct model *m);

// In the target's forward, before layer `layer`'s first block: the residual stream entering that
// layer (residual + h) into the aux buffer of every aux id equal to `layer`. No-op without a head.
void model_eagle3_capture(struct model *m, const struct fwd_state *f, int layer);

#endif
