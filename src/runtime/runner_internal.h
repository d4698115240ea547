// Internals of the model runner shared by its files (not a public header):
//   model_runner.c   options, step buffers, batch validation / packing / upload, the forward, execute, create
//   runner_kv.c      the KV pool: per-layer cache specs -> bytes per block, layout, sizing (profile run)
//   runner_graphs.c  CUDA graphs of decode batches, speculative verify batches and MTP chain steps
//   runner_sample.c  sampling glue and prompt logprobs
#ifndef ATOMC_RUNTIME_RUNNER_INTERNAL_H
#define ATOMC_RUNTIME_RUNNER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/model.h"
#include "runtime/model_runner.h"

#define RUNNER_MAX_LOGPROBS 20
#define RUNNER_MAX_GRAPHS 64

struct runner_graph {
    int batch_size; // sequences
    int q;          // query tokens per sequence: 1 (decode graphs) or 1 + k (verify graphs)
    void *graph;
};

// Offsets (in bytes) of a step's arrays inside the metadata block; the same layout on the
// host staging copy and on the device, so a step is uploaded with one copy. Eager steps use
// a dense layout built for the step's own sizes; decode-graph steps use a fixed layout with
// the capacity of max_num_seqs (captured kernels keep its pointers). The block table comes
// last so that only the rows in use are copied.
struct runner_layout {
    size_t token_ids, positions, slot_mapping; // (T) int32
    size_t slot_mapping_sw;                    // (T) int32: the sliding group's slots (hybrid groups)
    size_t query_start;                        // (S + 1) int32
    size_t context_lens;                       // (S) int32
    size_t state_slots;                        // (S) int32 recurrent-state slots
    size_t logits_rows;                        // (R) int32
    size_t lp_rows;                            // (L) int32: prompt-logprob rows
    size_t temperature, top_p, min_p;          // (R) float
    size_t top_k;                              // (R) int32
    size_t presence, frequency, repetition;    // (R) float
    size_t hist_start;                         // (R + 1) int32
    size_t hist_prompt_len;                    // (R) int32
    size_t seed, step;                         // (R) uint64
    size_t block_tables;                       // (S, W) int32 (hybrid groups: (S, 2 W), rows full | sliding)
    size_t bytes;
};

struct model_runner {
    struct backend *backend;
    size_t mem_free_at_load; // device memory free before the weights load (GPU backends; 0 = unknown)
    struct model_config cfg;
    struct model *model;

    int block_size;
    int num_blocks;
    // Per-layer-group block tables (runner_options.hybrid_kv_groups on a hybrid model): the
    // sliding-window layers' tensors hold num_blocks_sw blocks (the others num_blocks), addressed
    // by forward_batch.block_tables_sw; md_sw is their metadata of the current step.
    bool kv_groups;
    int sw_window;
    int num_blocks_sw;
    struct attn_metadata md_sw;
    int max_model_len;
    int max_tokens;          // max_num_batched_tokens
    int max_seqs;            // max_num_seqs
    int max_blocks;          // blocks per sequence at max_model_len (block table capacity stride)
    int max_rows;            // logits rows per sampling call
    enum dtype kv_dtype;
    void *kv_pool;           // one allocation: per layer K then V
    size_t kv_bytes;
    struct kv_layer *kv;     // (num_layers)
    // KV transfer (model_runner_kv_pool_view): bytes of one token's K / V row and the byte offset
    // of each layer's K / V region in kv_pool, per layer.
    size_t xfer_k_row[MODEL_MAX_LAYERS], xfer_v_row[MODEL_MAX_LAYERS];
    size_t xfer_k_off[MODEL_MAX_LAYERS], xfer_v_off[MODEL_MAX_LAYERS];
    // Per-layer KV sends (forward_batch.kv_layer_done): the batch of the running forward and one
    // backend event per layer (created on first use; backends with event ops only).
    const struct forward_batch *hook_fb;
    void *layer_ev[MODEL_MAX_LAYERS];

    // Recurrent-state slots (models with CACHE_KIND_RECURRENT layers, runner_state.c): slots
    // 0 .. n_state_slots - 1 are the engine's (one per running sequence), slot n_state_slots is
    // the dummy that padding sequences of graph steps write.
    int n_state_slots;       // 0 = the model keeps no recurrent state
    void *state_pool;        // one allocation: per recurrent layer conv state, then delta-rule state
    size_t state_bytes;
    unsigned char *state_seen; // (n_state_slots + 1) validation scratch: slots used in a batch

    struct runner_layout lay; // this step's layout
    struct runner_layout dec; // fixed layout of decode-graph steps
    struct runner_layout ver; // fixed layout of verify-graph steps (spec_q tokens per sequence)
    size_t meta_cap;          // bytes of h_meta / d_meta: the largest layout a valid batch needs
    unsigned char *h_meta;    // host staging
    unsigned char *d_meta;    // backend memory
    int32_t *d_iota;          // (max_rows) 0, 1, 2, ...: logits rows of captured decode graphs
    int32_t *d_hist;         // penalty token history, grown on demand
    size_t hist_cap;         // elements
    int32_t *h_hist;
    size_t h_hist_cap;
    uint32_t *d_mask;        // structured output: (rows, words) token bitmasks, grown on demand
    uint32_t *h_mask;        // host staging of d_mask
    size_t mask_cap;         // words

    // Sampling outputs: device and host copies.
    int32_t *d_out_ids;      // (max_rows) ids, then (max_rows) F32 logprobs: one allocation, one copy back
    float *d_out_lp;         // = d_out_ids + max_rows
    int32_t *d_out_top_ids;  // (max_rows, 20)
    float *d_out_top_lp;     // (max_rows, 20)
    int32_t *h_out_ids;      // (2 max_rows) mirror of d_out_ids
    float *h_out_lp;         // = h_out_ids + max_rows
    int32_t *h_out_top_ids;
    float *h_out_top_lp;
    // Prompt logprobs (host).
    float *h_logits;         // (max_rows, vocab) staging of logits rows
    float *h_plp;            // (max_tokens)
    int32_t *h_plp_top_ids;  // (max_tokens, 20)
    float *h_plp_top_lp;

    // MTP drafts (runner_mtp.c): host staging of the chained steps' batches and the device copy
    // of a draft batch's hidden rows, grown on demand.
    struct {
        int32_t *tok, *pos, *qs, *ctx, *slot, *rows, *bt;
        struct sample_row *greedy;
        int cap;          // rows of tok .. rows, greedy (qs: cap + 1)
        size_t bt_cap;    // elements of bt
        int32_t *d_hidden_rows;
        int d_cap;
        int32_t *h_hidden_rows; // (max_tokens) hidden rows mapped to a verify graph's padded rows
    } mtp;

    struct runner_graph graphs[RUNNER_MAX_GRAPHS];
    int n_graphs;
    bool graphs_enabled;
    uint64_t n_graph_replays;   // decode and verify replays together
    // Verify graphs (runner_graphs.c): speculative steps of spec_q = 1 + k query tokens per
    // sequence, captured per batch bucket when runner_options.num_speculative_tokens > 0.
    int spec_q;                 // 0: none captured
    struct runner_graph vgraphs[RUNNER_MAX_GRAPHS];
    int n_vgraphs;
    uint64_t n_verify_replays;
    // MTP chain graphs (models with MTP layers, k >= 2): the chained one-token MTP passes of
    // model_runner_draft per decode bucket (layout r->dec, rows from d_iota).
    struct runner_graph mgraphs[RUNNER_MAX_GRAPHS];
    int n_mgraphs;
    // MTP first-pass graphs (models with MTP layers): the pass over a verify step's positions
    // (<= 1 + k rows per sequence) on the verify layout, hidden rows from mtp.d_hidden_rows.
    struct runner_graph m1graphs[RUNNER_MAX_GRAPHS];
    int n_m1graphs;
    uint64_t n_mtp_replays; // chain and first-pass replays
    // Host staging of a verify step padded to its bucket (every sequence spec_q tokens), and the
    // map of the executed batch's token rows to the padded rows the scratch holds (MTP reads the
    // hidden states through it); row_map_n 0: the last forward's rows are the batch's own.
    struct {
        int32_t *tok, *pos, *slot, *slot_sw, *qs, *ctx, *bt, *bt_sw, *row_map;
        int row_map_n;
        int32_t *mtp_map, *mtp_hidden; // (max_tokens) an MTP first pass's row map / padded hidden rows
    } vpad;
};


#define HPTR(r, field, type) ((type *)((r)->h_meta + (r)->lay.field))
#define DPTR(r, field, type) ((type *)((r)->d_meta + (r)->lay.field))

// model_runner.c
void runner_layout_build(struct runner_layout *l, int T, int S, int W, int R, int L);
atomc_status runner_validate(const struct model_runner *r, const struct forward_batch *fb, struct error *err);
bool runner_is_decode_only(const struct forward_batch *fb);
size_t runner_pack(struct model_runner *r, const struct forward_batch *fb, int pad_seqs, int bt_stride,
                          struct attn_metadata *md);
void runner_upload(struct model_runner *r, size_t bytes);
atomc_status runner_forward(struct model_runner *r, const struct forward_batch *fb, int n_rows,
                                   struct error *err);

// runner_kv.c
size_t runner_kv_block_bytes(const struct model_runner *r);
atomc_status runner_kv_check_specs(const struct model_runner *r, struct error *err);
void runner_kv_plan_groups(struct model_runner *r, const struct runner_options *o);
atomc_status runner_kv_alloc(struct model_runner *r, int num_blocks, struct error *err);
void runner_kv_release(struct model_runner *r);
atomc_status runner_size_kv(struct model_runner *r, const struct runner_options *o, struct error *err);

// runner_state.c
bool runner_state_needed(const struct model_runner *r);
atomc_status runner_state_alloc(struct model_runner *r, struct error *err);
void runner_state_bind(struct model_runner *r);
void runner_state_release(struct model_runner *r);
atomc_status runner_state_validate(const struct model_runner *r, const struct forward_batch *fb, struct error *err);

// runner_mtp.c
void runner_mtp_release(struct model_runner *r);

// runner_eagle3.c: runner_mtp.c's pass for an EAGLE-3 head (the same contract: fb uploaded and run
// through the head, *ids the target ids of the logits rows' argmax drafts).
atomc_status runner_eagle3_pass(struct model_runner *r, const struct forward_batch *fb, const int32_t *d_hidden_rows,
                                const int32_t **ids, struct error *err);

// runner_graphs.c
struct runner_graph *runner_graph_for(struct model_runner *r, int n);
struct runner_graph *runner_verify_graph_for(struct model_runner *r, const struct forward_batch *fb);
atomc_status runner_verify_replay(struct model_runner *r, const struct forward_batch *fb, struct runner_graph *g,
                                  struct error *err);
atomc_status runner_capture_graphs(struct model_runner *r, int spec_k, struct error *err);
atomc_status runner_mtp_chain_replay(struct model_runner *r, const struct forward_batch *fb, bool *replayed,
                                     struct error *err);
atomc_status runner_mtp_first_replay(struct model_runner *r, const struct forward_batch *fb, const int32_t *hidden_rows,
                                     bool *replayed, struct error *err);
void runner_graphs_release(struct model_runner *r);

// runner_sample.c
void runner_prompt_logprobs(struct model_runner *r, const struct forward_batch *fb);
atomc_status runner_sample(struct model_runner *r, const struct forward_batch *fb, struct runner_output *out,
                                  struct error *err);

#endif
