// Loading and freeing of MTP layers (model.h struct model_mtp_layer), for model.c.
#ifndef ATOMC_MODEL_MTP_H
#define ATOMC_MODEL_MTP_H

#include "model/arch.h"

// Loads cfg.num_nextn_predict_layers MTP layers into m->mtp (after the decoder layers, the head
// and the RoPE tables; before the family's finish_load) and extends m->layer_cache with their
// caches. UNSUPPORTED naming the model when its family has no MTP support, it declares no MTP
// layers, or tensor parallelism is asked; a missing tensor is the loader's error naming it.
atomc_status model_mtp_load(struct model *m, struct weight_loader *L, struct error *err);
void model_mtp_free(struct model *m);

#endif
