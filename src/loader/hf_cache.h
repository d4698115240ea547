// Model ids from the local Hugging Face cache: `--model Qwen/Qwen3-0.6B` as vLLM users type it.
//
// Contract:
// - hf_cache_resolve(spec): a spec naming an existing file or directory is returned as it is.
//   Otherwise, when it has the shape of a repo id ("ORG/NAME", letters, digits, '-', '_', '.';
//   no "..", no leading '/' or '.'), the cache's snapshot directory of that repo is returned:
//     hub = $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
//           else $HOME/.cache/huggingface/hub (huggingface_hub's order)
//     repo = hub/models--ORG--NAME; revision = the commit named by repo/refs/main, else the
//           only (or the most recently modified) directory under repo/snapshots
//   The snapshot directory is returned when it holds config.json (an HF model); else its one
//   .gguf file (GGUF repos); several .gguf files and no config.json is an error asking for a path.
// - A spec that is neither is NOT_FOUND with a message listing every place looked at and the
//   environment that chose them. atomc never downloads (there is no network code).
// - The environment comes in as struct hf_cache_env (the CLI reads it), so the function is pure.
#ifndef ATOMC_LOADER_HF_CACHE_H
#define ATOMC_LOADER_HF_CACHE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"

struct hf_cache_env {
    const char *hf_hub_cache;   // $HF_HUB_CACHE or NULL
    const char *hf_home;        // $HF_HOME or NULL
    const char *xdg_cache_home; // $XDG_CACHE_HOME or NULL
    const char *home;           // $HOME or NULL
};

// Whether spec has the shape of a Hugging Face repo id (see above).
bool hf_cache_is_repo_id(const char *spec);

// out (out_len bytes) receives the path to open; see the contract above.
atomc_status hf_cache_resolve(const char *spec, const struct hf_cache_env *env, char *out, size_t out_len,
                              struct error *err);

#endif
